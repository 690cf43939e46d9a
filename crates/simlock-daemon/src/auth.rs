//! Who a caller is: the socket's `hello` credential and HTTP bearer tokens.

use std::sync::Arc;

use simlock_contract::model::{TokenRecord, TokenRole};
use simlock_contract::{ContractError, ErrorCode, Role};

use crate::home::AdminSecret;
use crate::pipeline::Greeter;
use crate::tokens::TokenStore;

/// The greeter of a daemon: operator tokens and the per-start admin secret grant admin.
#[derive(Debug)]
pub struct DaemonGreeter {
    tokens: Arc<TokenStore>,
    admin: Option<AdminSecret>,
    default_principal: String,
}

impl DaemonGreeter {
    /// A greeter over `tokens` and, when the daemon wrote one, its admin secret.
    pub fn new(tokens: Arc<TokenStore>, admin: Option<AdminSecret>) -> Self {
        let default_principal = std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "local".into());
        Self {
            tokens,
            admin,
            default_principal,
        }
    }

    /// Removes the admin secret's file (graceful stop).
    pub fn remove_admin_secret(&self) {
        if let Some(admin) = &self.admin {
            admin.remove();
        }
    }
}

impl Greeter for DaemonGreeter {
    fn is_admin_secret(&self, secret: &str) -> bool {
        if self.admin.as_ref().is_some_and(|a| a.matches(secret)) {
            return true;
        }
        matches!(
            self.tokens.verify(secret),
            Ok(Some(TokenRecord {
                role: TokenRole::Operator,
                ..
            }))
        )
    }

    fn default_principal(&self) -> String {
        self.default_principal.clone()
    }
}

/// An HTTP caller, authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCaller {
    /// The token.
    pub token: TokenRecord,
    /// The session role it grants.
    pub role: Role,
}

/// Authenticates `Authorization: Bearer <secret>` for every route but the uplink: a missing or
/// unknown token is `UNAUTHENTICATED` (401); a worker token is `FORBIDDEN` (403).
///
/// # Errors
/// As above.
pub fn bearer(
    tokens: &TokenStore,
    authorization: Option<&str>,
) -> Result<HttpCaller, ContractError> {
    let token = verify_bearer(tokens, authorization)?;
    let role = match token.role {
        TokenRole::Agent => Role::Agent,
        TokenRole::Operator => Role::Admin,
        TokenRole::Worker => {
            return Err(ContractError::forbidden(
                "A worker token may only open an uplink (/v1/uplink)",
            ));
        }
    };
    Ok(HttpCaller { token, role })
}

/// Reads and verifies a bearer token of any role.
///
/// # Errors
/// `UNAUTHENTICATED` when missing or unknown.
pub fn verify_bearer(
    tokens: &TokenStore,
    authorization: Option<&str>,
) -> Result<TokenRecord, ContractError> {
    let unauthenticated = |m: &str| ContractError::new(ErrorCode::Unauthenticated, m);
    let header = authorization
        .ok_or_else(|| unauthenticated("Authorization: Bearer <token> is required"))?;
    let secret = header
        .strip_prefix("Bearer ")
        .or_else(|| header.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| unauthenticated("Authorization must be Bearer <token>"))?;
    tokens
        .verify(secret)
        .map_err(|e| ContractError::internal(e.to_string()))?
        .ok_or_else(|| unauthenticated("Unknown token"))
}
