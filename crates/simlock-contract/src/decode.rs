//! The one way an input enters simlock: parse the payload, apply its bounds, and answer
//! `BAD_REQUEST` naming the field when either fails.

use garde::Validate;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ContractError;

/// An operation's input: a serde type with garde bounds, plus any rule across fields.
pub trait Input: DeserializeOwned + Validate<Context = ()> {
    /// Whether unknown keys are refused (the original made `lease.request`, `device.exec` and
    /// the relay inputs strict). Keep in step with `#[serde(deny_unknown_fields)]`; a test
    /// checks every operation.
    const STRICT: bool = false;

    /// Rules that span fields, run after the per-field bounds pass.
    ///
    /// # Errors
    /// `BAD_REQUEST` naming the fields.
    fn check(&self) -> Result<(), ContractError> {
        Ok(())
    }
}

/// Parses and checks an input; `None` reads as `{}`.
///
/// # Errors
/// `BAD_REQUEST` with `field: problem; field: problem`, field names as on the wire.
pub fn decode_input<T: Input>(payload: Option<Value>) -> Result<T, ContractError> {
    let input: T = parse(payload.unwrap_or_else(|| Value::Object(Map::new())))?;
    check_input(&input, |path| path)?;
    Ok(input)
}

/// Deserialises `value`, naming the field that fails as serde's path gives it.
///
/// # Errors
/// `BAD_REQUEST` with `field: problem`, or the problem alone at the top level.
pub(crate) fn parse<T: DeserializeOwned>(value: Value) -> Result<T, ContractError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ContractError::bad_request(inner.to_string())
        } else {
            ContractError::bad_request(format!("{path}: {inner}"))
        }
    })
}

/// Applies `input`'s bounds and its rules across fields; `name` turns a field's wire path into
/// the name the caller knows it by (an HTTP body may name a field otherwise).
///
/// # Errors
/// `BAD_REQUEST` with `field: problem; field: problem`.
pub(crate) fn check_input<T: Input>(
    input: &T,
    name: impl Fn(&str) -> &str,
) -> Result<(), ContractError> {
    input.validate().map_err(|report| {
        let problems: Vec<String> = report
            .iter()
            .map(|(path, error)| format!("{}: {}", name(&wire_path(&path.to_string())), error))
            .collect();
        ContractError::bad_request(problems.join("; "))
    })?;
    input.check()
}

/// garde names fields as Rust does (`relay_id`); the wire names them in camelCase (`relayId`).
fn wire_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut upper = false;
    for c in path.chars() {
        match c {
            '_' if !out.is_empty() && !out.ends_with(['.', '[']) => upper = true,
            _ if upper => {
                out.extend(c.to_uppercase());
                upper = false;
            }
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_camel_cased() {
        assert_eq!(wire_path("relay_id"), "relayId");
        assert_eq!(wire_path("inner.the_name"), "inner.theName");
        assert_eq!(wire_path("headers[2]"), "headers[2]");
        assert_eq!(wire_path("ttl_ms"), "ttlMs");
    }
}
