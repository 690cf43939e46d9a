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
        let inner = in_json_terms(&e.into_inner().to_string());
        if path == "." {
            ContractError::bad_request(inner)
        } else {
            ContractError::bad_request(format!("{path}: {inner}"))
        }
    })
}

/// serde says which Rust type it expected (`expected u64`); a caller writes JSON (or TOML, or
/// an environment variable), so the message says it in those terms (`expected a whole number,
/// 0 or more`). The daemons' configuration errors say it the same way.
#[must_use]
pub fn in_json_terms(message: &str) -> String {
    const TERMS: &[(&str, &str)] = &[
        ("u64", "a whole number, 0 or more"),
        ("u32", "a whole number, 0 or more"),
        ("u16", "a whole number from 0 to 65535"),
        ("u8", "a whole number from 0 to 255"),
        ("usize", "a whole number, 0 or more"),
        ("i64", "a whole number"),
        ("i32", "a whole number"),
        ("f64", "a number"),
        // A unit enum (`platform`) given another kind of value.
        ("string or map", "a string"),
    ];
    let mut out = message.to_owned();
    for (rust, json) in TERMS {
        let said = format!("expected {rust}");
        if let Some(at) = out.find(&said)
            && !out[at + said.len()..].starts_with(|c: char| c.is_ascii_alphanumeric())
        {
            out.replace_range(at..at + said.len(), &format!("expected {json}"));
        }
    }
    // A whole number too large for 64 bits reaches serde as a float: said as what it is.
    const FLOAT: &str = "invalid type: floating point `";
    /// 2^64, the first whole number past `u64`.
    const PAST_U64: f64 = 18_446_744_073_709_551_616.0;
    if let Some(at) = out.find(FLOAT)
        && let Some(number) = out[at + FLOAT.len()..].split_once('`').map(|(n, _)| n)
        && let Ok(value) = number.parse::<f64>()
        && value.fract() == 0.0
        && value >= PAST_U64
        && out.ends_with("expected a whole number, 0 or more")
    {
        out.replace_range(at.., "too large: expected a whole number, 0 or more");
    }
    out
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
            .map(|(path, error)| {
                let field = name(&wire_path(&path.to_string())).to_owned();
                let problem = with_duration(&field, &error.to_string());
                format!("{field}: {problem}")
            })
            .collect();
        ContractError::bad_request(problems.join("; "))
    })?;
    input.check()
}

/// A bound on a field in milliseconds (`ttlMs`, `timeoutMs`) also said for people:
/// `greater than 2678400000 (31d)`.
fn with_duration(field: &str, problem: &str) -> String {
    if field.ends_with("Ms")
        && let Some((bound, n)) = ["greater than ", "lower than "].iter().find_map(|bound| {
            let n: u64 = problem.strip_prefix(bound)?.parse().ok()?;
            Some((bound, n))
        })
        && n >= 1000
    {
        return format!("{bound}{n} ({})", crate::duration::text(n));
    }
    problem.to_owned()
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

/// Parses JSON text as serde_json does, except that an object naming a key twice is an error
/// (`duplicate key "platform"`), where serde_json keeps the last: `{"platform":"ios",
/// "platform":"android"}` must not lease an Android device for a caller who may have meant
/// either. Every body and call line simlock reads goes through here.
///
/// # Errors
/// The text is not JSON, or an object in it repeats a key.
pub fn json_value(text: &[u8]) -> Result<Value, serde_json::Error> {
    serde_json::from_slice::<Strict>(text).map(|strict| strict.0)
}

/// A JSON value read with [`json_value`]'s rule.
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format!("duplicate key {key:?}")));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_with_a_key_given_twice_is_refused_at_any_depth_and_other_json_reads_as_serde_json_does()
    {
        let err = json_value(br#"{"platform":"ios","platform":"android"}"#).unwrap_err();
        assert!(
            err.to_string().starts_with("duplicate key \"platform\""),
            "{err}"
        );
        let nested = json_value(br#"{"a":[{"b":1,"b":2}]}"#).unwrap_err();
        assert!(
            nested.to_string().starts_with("duplicate key \"b\""),
            "{nested}"
        );
        let text = br#"{"a":[1,-2,3.5,"x",null,true,{"b":{}}],"c":18446744073709551615}"#;
        assert_eq!(
            json_value(text).unwrap(),
            serde_json::from_slice::<Value>(text).unwrap()
        );
        assert!(json_value(b"{").is_err());
    }

    #[test]
    fn a_bound_in_milliseconds_is_also_said_for_people() {
        let err = decode_input::<crate::ops::LeaseRequestInput>(Some(serde_json::json!({
            "platform": "ios",
            "ttlMs": crate::bounds::MAX_TTL_MS + 1,
            "timeoutMs": 0,
        })))
        .unwrap_err();
        let mut problems: Vec<&str> = err.message.split("; ").collect();
        problems.sort_unstable();
        assert_eq!(
            problems,
            [
                "timeoutMs: lower than 1",
                "ttlMs: greater than 2678400000 (31d)"
            ]
        );
        assert_eq!(
            with_duration("ttlMs", "lower than 1000"),
            "lower than 1000 (1s)"
        );
        // Under a second, the number says it as well as a duration would.
        assert_eq!(with_duration("ttlMs", "lower than 999"), "lower than 999");
        assert_eq!(
            with_duration("label", "greater than 5000"),
            "greater than 5000"
        );
    }

    #[test]
    fn a_value_of_the_wrong_kind_is_named_in_json_terms() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        #[allow(dead_code, reason = "only its decoding is tested")]
        struct Input {
            ttl_ms: Option<u64>,
            offset: Option<i64>,
            ratio: Option<f64>,
        }
        let message = |value: Value| parse::<Input>(value).unwrap_err().message;
        assert_eq!(
            message(serde_json::json!({"ttlMs": -5})),
            "ttlMs: invalid value: integer `-5`, expected a whole number, 0 or more"
        );
        assert_eq!(
            message(serde_json::json!({"ttlMs": "x"})),
            "ttlMs: invalid type: string \"x\", expected a whole number, 0 or more"
        );
        assert_eq!(
            message(serde_json::json!({"offset": 1.5})),
            "offset: invalid type: floating point `1.5`, expected a whole number"
        );
        // Outside trial 21: a whole number past 64 bits is read as a float; said so.
        let huge: Value = serde_json::from_str(r#"{"ttlMs": 18446744073709551616}"#).unwrap();
        assert_eq!(
            message(huge),
            "ttlMs: too large: expected a whole number, 0 or more"
        );
        // A float under 2^64 written as one is not called too large.
        let under: Value = serde_json::from_str(r#"{"ttlMs": 1.8e19}"#).unwrap();
        assert!(!message(under).contains("too large"));
        assert_eq!(
            message(serde_json::json!({"ratio": "x"})),
            "ratio: invalid type: string \"x\", expected a number"
        );
        let platform =
            decode_input::<crate::ops::CatalogInput>(Some(serde_json::json!({"platform": 5})))
                .unwrap_err()
                .message;
        assert_eq!(
            platform,
            "platform: invalid type: integer `5`, expected a string"
        );
        assert_eq!(
            in_json_terms("expected u640"),
            "expected u640",
            "a whole word only"
        );
    }

    #[test]
    fn paths_are_camel_cased() {
        assert_eq!(wire_path("relay_id"), "relayId");
        assert_eq!(wire_path("inner.the_name"), "inner.theName");
        assert_eq!(wire_path("headers[2]"), "headers[2]");
        assert_eq!(wire_path("ttl_ms"), "ttlMs");
    }
}
