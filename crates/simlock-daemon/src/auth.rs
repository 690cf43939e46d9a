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
    http_caller(tokens, bearer_secret(authorization)?)
}

/// Authenticates `secret` (read from a bearer header) as an HTTP caller, as [`bearer`] does.
///
/// # Errors
/// `UNAUTHENTICATED` for an unknown token; `FORBIDDEN` for a worker token.
pub fn http_caller(tokens: &TokenStore, secret: &str) -> Result<HttpCaller, ContractError> {
    let token = verify(tokens, secret)?;
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
    verify(tokens, bearer_secret(authorization)?)
}

/// The request's `Authorization` header, as [`bearer`] and [`verify_bearer`] take it: `None`
/// when absent; a value that is not visible ASCII reads as empty (no bearer token, not a
/// missing header).
///
/// # Errors
/// `BAD_REQUEST` when it is sent more than once ([`single_header`]).
pub fn authorization(headers: &http::HeaderMap) -> Result<Option<&str>, ContractError> {
    Ok(
        single_header(headers, &http::header::AUTHORIZATION, "Authorization")?
            .map(|v| v.to_str().unwrap_or_default()),
    )
}

/// The one value of header `name` (`label` in messages): `None` when absent.
///
/// # Errors
/// `BAD_REQUEST` `<label>: sent <n> times; send it once` when it is sent more than once: which
/// one counts would be a guess (a proxy adding its own, a client adding a second), so neither
/// does.
pub fn single_header<'a>(
    headers: &'a http::HeaderMap,
    name: &http::HeaderName,
    label: &str,
) -> Result<Option<&'a http::HeaderValue>, ContractError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    let more = values.count();
    if more > 0 {
        return Err(ContractError::bad_request(format!(
            "{label}: sent {} times; send it once",
            more + 1
        )));
    }
    Ok(first)
}

/// The secret of an `Authorization: Bearer <secret>` header, trimmed. The scheme is matched
/// without regard to case, as HTTP's authentication schemes are (`bearer`, `BEARER`).
///
/// # Errors
/// `UNAUTHENTICATED` when the header is missing, is not a bearer or carries no secret.
pub fn bearer_secret(authorization: Option<&str>) -> Result<&str, ContractError> {
    let header = authorization
        .ok_or_else(|| unauthenticated("Authorization: Bearer <token> is required"))?;
    header
        .split_once(' ')
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, secret)| secret.trim())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| unauthenticated("Authorization must be Bearer <token>"))
}

fn verify(tokens: &TokenStore, secret: &str) -> Result<TokenRecord, ContractError> {
    tokens
        .verify(secret)
        .map_err(|e| ContractError::internal(e.to_string()))?
        .ok_or_else(|| unauthenticated("Unknown token"))
}

fn unauthenticated(message: &str) -> ContractError {
    ContractError::new(ErrorCode::Unauthenticated, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_read_in_any_case_and_a_secret_is_required() {
        for header in [
            "Bearer slk_x",
            "bearer slk_x",
            "BEARER slk_x",
            "bEaReR   slk_x  ",
        ] {
            assert_eq!(bearer_secret(Some(header)).unwrap(), "slk_x", "{header:?}");
        }
        for header in [
            "Basic slk_x",
            "Bearer",
            "Bearer ",
            "Bearer    ",
            "Bearerslk_x",
            "",
        ] {
            let refused = bearer_secret(Some(header)).unwrap_err();
            assert_eq!(refused.code, ErrorCode::Unauthenticated, "{header:?}");
            assert_eq!(refused.message, "Authorization must be Bearer <token>");
        }
        let missing = bearer_secret(None).unwrap_err();
        assert_eq!(missing.message, "Authorization: Bearer <token> is required");
    }

    #[test]
    fn an_authorization_sent_twice_is_refused_and_one_that_is_not_text_reads_as_empty() {
        let headers = |values: &[&[u8]]| {
            let mut map = http::HeaderMap::new();
            for v in values {
                map.append(
                    http::header::AUTHORIZATION,
                    http::HeaderValue::from_bytes(v).unwrap(),
                );
            }
            map
        };
        assert_eq!(authorization(&headers(&[])).unwrap(), None);
        let one = headers(&[b"Bearer slk_a"]);
        assert_eq!(authorization(&one).unwrap(), Some("Bearer slk_a"));
        let two = headers(&[b"Bearer slk_a", b"Bearer slk_b"]);
        let refused = authorization(&two).unwrap_err();
        assert_eq!(refused.code, ErrorCode::BadRequest);
        assert_eq!(refused.message, "Authorization: sent 2 times; send it once");
        let binary = headers(&[b"Bearer \xff"]);
        assert_eq!(authorization(&binary).unwrap(), Some(""));
    }
}
