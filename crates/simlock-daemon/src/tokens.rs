//! Tokens: `tok_` ids with `slk_` secrets, of role agent, operator or worker. Only the SHA-256
//! of a secret is stored; the secret is shown once, when the token is created.

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rusqlite::{OptionalExtension, params};
use sha2::{Digest, Sha256};
use simlock_contract::ContractError;
use simlock_contract::ids::TokenId;
use simlock_contract::model::{Mode, TokenRecord, TokenRole};
use simlock_contract::ops::{
    TokenCreate, TokenCreateOutput, TokenList, TokenListOutput, TokenRevoke, TokenRevokeOutput,
};
use tokio::sync::broadcast;

use crate::clock::SharedClock;
use crate::pipeline::Router;
use crate::store::{Database, StoreError};

const MIGRATIONS: &[&str] = &["CREATE TABLE tokens (
    id TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    label TEXT,
    created_at INTEGER NOT NULL,
    hash TEXT NOT NULL UNIQUE
)"];

/// A fresh secret: `slk_` and 32 random bytes in base64url.
pub fn mint_secret() -> String {
    let mut bytes = [0u8; 32];
    rand::fill(&mut bytes);
    format!("slk_{}", URL_SAFE_NO_PAD.encode(bytes))
}

/// The SHA-256 of a secret, in hex.
pub fn hash_secret(secret: &str) -> String {
    Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The token store of one daemon.
pub struct TokenStore {
    db: Database,
    clock: SharedClock,
    revoked: broadcast::Sender<TokenId>,
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStore").finish_non_exhaustive()
    }
}

fn parse_role(role: &str) -> Option<TokenRole> {
    match role {
        "agent" => Some(TokenRole::Agent),
        "operator" => Some(TokenRole::Operator),
        "worker" => Some(TokenRole::Worker),
        _ => None,
    }
}

/// The refusal of a role `mode` has no use for (only `worker`, on a worker).
fn role_unused(role: TokenRole, mode: Mode) -> ContractError {
    ContractError::bad_request(format!(
        "role: a {} token joins a worker to a gateway, and this daemon is a {}: create it on the gateway the worker dials",
        role.as_str(),
        mode.as_str(),
    ))
}

fn store_error(e: StoreError) -> ContractError {
    ContractError::internal(e.to_string())
}

impl TokenStore {
    /// The store in `db`, migrated.
    ///
    /// # Errors
    /// When the migration fails.
    pub fn open(db: Database, clock: SharedClock) -> Result<Arc<Self>, StoreError> {
        db.migrate("tokens", MIGRATIONS)?;
        Ok(Arc::new(Self {
            db,
            clock,
            revoked: broadcast::channel(64).0,
        }))
    }

    /// Mints a token; the secret is returned this once.
    ///
    /// # Errors
    /// On a store failure.
    pub fn create(
        &self,
        role: TokenRole,
        label: Option<String>,
    ) -> Result<(String, TokenRecord), StoreError> {
        let secret = mint_secret();
        let record = TokenRecord {
            id: TokenId::mint(),
            role,
            label,
            created_at: self.clock.now_ms(),
        };
        self.db.with(|c| {
            c.execute(
                "INSERT INTO tokens (id, role, label, created_at, hash) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![record.id.as_str(), role.as_str(), record.label, record.created_at, hash_secret(&secret)],
            )
        })?;
        Ok((secret, record))
    }

    /// Every token, oldest first.
    ///
    /// # Errors
    /// On a store failure.
    pub fn list(&self) -> Result<Vec<TokenRecord>, StoreError> {
        self.db.with(|c| {
            let mut stmt = c.prepare(
                "SELECT id, role, label, created_at FROM tokens ORDER BY created_at, id",
            )?;
            let rows = stmt.query_map([], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get(2)?,
                    row.get(3)?,
                ))
            })?;
            let mut out = Vec::new();
            for row in rows {
                let (id, role, label, created_at) = row?;
                if let Some(role) = parse_role(&role) {
                    out.push(TokenRecord {
                        id: TokenId::from_raw(id),
                        role,
                        label,
                        created_at,
                    });
                }
            }
            Ok(out)
        })
    }

    /// Revokes a token; returns whether one was. Uplinks opened with it are told to close.
    ///
    /// # Errors
    /// On a store failure.
    pub fn revoke(&self, id: &str) -> Result<bool, StoreError> {
        let removed = self
            .db
            .with(|c| c.execute("DELETE FROM tokens WHERE id = ?1", [id]))?;
        if removed > 0 {
            let _ = self.revoked.send(TokenId::from_raw(id));
        }
        Ok(removed > 0)
    }

    /// The token whose secret is `secret`.
    ///
    /// # Errors
    /// On a store failure.
    pub fn verify(&self, secret: &str) -> Result<Option<TokenRecord>, StoreError> {
        let hash = hash_secret(secret);
        self.db.with(|c| {
            c.query_row(
                "SELECT id, role, label, created_at FROM tokens WHERE hash = ?1",
                [hash],
                |row| {
                    Ok((
                        row.get::<_, String>(0)?,
                        row.get::<_, String>(1)?,
                        row.get(2)?,
                        row.get(3)?,
                    ))
                },
            )
            .optional()
            .map(|found| {
                found.and_then(|(id, role, label, created_at)| {
                    parse_role(&role).map(|role| TokenRecord {
                        id: TokenId::from_raw(id),
                        role,
                        label,
                        created_at,
                    })
                })
            })
        })
    }

    /// Follows revocations.
    pub fn revocations(&self) -> broadcast::Receiver<TokenId> {
        self.revoked.subscribe()
    }
}

/// Registers `token.create`, `token.list` and `token.revoke` for a daemon in `mode`, which
/// mints only the roles it has a use for ([`TokenRole::used_by`]).
pub fn register(router: &mut Router, store: &Arc<TokenStore>, mode: Mode) {
    let s = store.clone();
    router.handle::<TokenCreate, _, _>(move |_, input| {
        let outcome = if input.role.used_by(mode) {
            s.create(input.role, input.label)
                .map(|(secret, token)| TokenCreateOutput { secret, token })
                .map_err(store_error)
        } else {
            Err(role_unused(input.role, mode))
        };
        async move { outcome }
    });
    let s = store.clone();
    router.handle::<TokenList, _, _>(move |_, _| {
        let outcome = s
            .list()
            .map(|tokens| TokenListOutput { tokens })
            .map_err(store_error);
        async move { outcome }
    });
    let s = store.clone();
    router.handle::<TokenRevoke, _, _>(move |_, input| {
        let outcome = s
            .revoke(&input.id)
            .map(|revoked| TokenRevokeOutput { revoked })
            .map_err(store_error);
        async move { outcome }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::TokioClock;

    #[tokio::test]
    async fn secrets_verify_and_only_their_hash_is_stored() {
        let db = Database::open_in_memory().unwrap();
        let store = TokenStore::open(db.clone(), TokioClock::starting_at(5).shared()).unwrap();
        let (secret, record) = store
            .create(TokenRole::Operator, Some("ops".into()))
            .unwrap();
        assert!(secret.starts_with("slk_"));
        assert!(record.id.as_str().starts_with("tok_"));
        assert_eq!(store.verify(&secret).unwrap(), Some(record.clone()));
        assert_eq!(store.verify("slk_wrong").unwrap(), None);
        let stored: String = db
            .with(|c| c.query_row("SELECT hash FROM tokens", [], |r| r.get(0)))
            .unwrap();
        assert_ne!(stored, secret);
        assert_eq!(stored, hash_secret(&secret));
        let mut revocations = store.revocations();
        assert!(store.revoke(record.id.as_str()).unwrap());
        assert!(!store.revoke(record.id.as_str()).unwrap());
        assert_eq!(revocations.recv().await.unwrap(), record.id);
        assert_eq!(store.verify(&secret).unwrap(), None);
    }
}
