//! What the HTTP host reads out of a request's target and headers: path segments and query
//! values percent-decoded, and the numeric query values. Each function takes any text a peer can
//! send and answers a value or a contract error; none can panic (property tests below and in
//! `tests/http.rs` throw arbitrary text at them).

use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
use simlock_contract::ContractError;

/// Every byte but the unreserved ones (`A–Z a–z 0–9 - . _ ~`, RFC 3986 §2.3): what
/// [`percent_encode`] escapes.
pub const ESCAPED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Encodes `text` for a header or a URL: every byte but `A–Z a–z 0–9 - . _ ~` as `%XX`.
pub fn percent_encode(text: &str) -> String {
    utf8_percent_encode(text, ESCAPED).to_string()
}

/// Decodes every `%XX` (two hex digits) in `text`; anything else, `+` included, stays as it is.
/// Bytes that do not form UTF-8 become U+FFFD.
pub fn percent_decode(text: &str) -> String {
    percent_decode_str(text).decode_utf8_lossy().into_owned()
}

/// The segments of a path below `/v1/`, each percent-decoded after the split (so `%2F` stays
/// inside its segment).
pub fn segments(rest: &str) -> Vec<String> {
    rest.split('/').map(percent_decode).collect()
}

/// A request's query: `name=value` pairs split on `&`, names and values percent-decoded. A pair
/// without `=` has an empty value; a name given twice is refused when it is read, so that
/// `?platform=ios&platform=android` never serves one of the two in silence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    /// Reads the query part of a request target (after `?`, without it).
    pub fn parse(raw: &str) -> Self {
        let pairs = raw
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(name), percent_decode(value))
            })
            .collect();
        Self { pairs }
    }

    /// The value of `name`, if given.
    ///
    /// # Errors
    /// `BAD_REQUEST` naming `name` when the query gives it more than once.
    pub fn get(&self, name: &str) -> Result<Option<&str>, ContractError> {
        let mut values = self.pairs.iter().filter(|(k, _)| k == name);
        let first = values.next().map(|(_, v)| v.as_str());
        if values.next().is_some() {
            return Err(ContractError::bad_request(format!(
                "{name}: given more than once in the query; give it once"
            )));
        }
        Ok(first)
    }
}

/// `?wait=S` of a long-poll: a finite number of seconds, fraction allowed, clamped to
/// `0..=max`. Anything else (absent, not a number, `NaN`, `inf`, a value too large for a float
/// such as `1e400`) counts as 0.
pub fn wait(value: Option<&str>, max: Duration) -> Duration {
    let Some(seconds) = value
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite())
    else {
        return Duration::ZERO;
    };
    // Finite and clamped into a small range: the conversion cannot fail.
    Duration::try_from_secs_f64(seconds.clamp(0.0, max.as_secs_f64())).unwrap_or(Duration::ZERO)
}

/// `?since=D`: `30s`, `5m`, `2h`, `1d`, `500ms`, or a bare number of milliseconds; the span in
/// milliseconds.
///
/// # Errors
/// `BAD_REQUEST` naming `since` for anything else, an empty or signed number included, and for a
/// span beyond `i64` milliseconds.
pub fn since(text: &str) -> Result<i64, ContractError> {
    let bad = || {
        ContractError::bad_request(format!(
            "since: {text:?} is not a duration like 30s, 5m, 2h, 1d or 500ms"
        ))
    };
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, ""), |at| text.split_at(at));
    if number.is_empty() {
        return Err(bad());
    }
    let n: i64 = number.parse().map_err(|_| bad())?;
    let factor = match unit {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    // No further back than an event's timestamp can reach (`±8.64e15` ms, shared with
    // `events.replay`'s `sinceTs`), so the refusal names `since`, the parameter the caller sent.
    n.checked_mul(factor)
        .filter(|ms| *ms <= simlock_contract::bounds::MAX_TIMESTAMP_MS)
        .ok_or_else(|| {
            ContractError::bad_request(format!(
                "since: {text:?} reaches further back than {} ms",
                simlock_contract::bounds::MAX_TIMESTAMP_MS
            ))
        })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use simlock_contract::ErrorCode;

    use super::*;

    const MAX: Duration = Duration::from_secs(60);

    #[test]
    fn a_since_past_the_timestamps_reach_is_refused_naming_since() {
        let max = simlock_contract::bounds::MAX_TIMESTAMP_MS;
        assert_eq!(since(&format!("{max}ms")).unwrap(), max);
        for text in [
            format!("{}ms", max + 1),
            "9223372036854775807ms".to_owned(),
            "200000000d".to_owned(),
        ] {
            let refused = since(&text).unwrap_err();
            assert_eq!(refused.code, ErrorCode::BadRequest, "{text}");
            assert!(
                refused.message.starts_with("since: "),
                "{}",
                refused.message
            );
        }
    }

    #[test]
    fn a_wait_that_is_not_a_finite_number_counts_as_zero() {
        for text in [
            "NaN", "nan", "-nan", "inf", "-inf", "+inf", "infinity", "1e400", "-1e400", "", " ",
            "abc", "1s", "0x10",
        ] {
            assert_eq!(wait(Some(text), MAX), Duration::ZERO, "{text:?}");
        }
        assert_eq!(wait(None, MAX), Duration::ZERO);
    }

    #[test]
    fn a_finite_wait_is_clamped_to_its_range() {
        assert_eq!(wait(Some("-1"), MAX), Duration::ZERO);
        assert_eq!(wait(Some("-0"), MAX), Duration::ZERO);
        assert_eq!(wait(Some("1.5"), MAX), Duration::from_millis(1500));
        assert_eq!(wait(Some("60"), MAX), MAX);
        assert_eq!(wait(Some("60.001"), MAX), MAX);
        assert_eq!(wait(Some("1e300"), MAX), MAX);
        assert_eq!(wait(Some("5e-324"), MAX), Duration::ZERO);
    }

    #[test]
    fn since_reads_each_unit_and_refuses_the_rest_naming_since() {
        assert_eq!(since("500ms").unwrap(), 500);
        assert_eq!(since("500").unwrap(), 500);
        assert_eq!(since("30s").unwrap(), 30_000);
        assert_eq!(since("5m").unwrap(), 300_000);
        assert_eq!(since("2h").unwrap(), 7_200_000);
        assert_eq!(since("1d").unwrap(), 86_400_000);
        assert!(
            since(&i64::MAX.to_string()).is_err(),
            "past a timestamp's reach"
        );
        for text in [
            "",
            "s",
            "-5s",
            "+5s",
            "5 s",
            "5w",
            "1.5s",
            "9223372036854775808",
            "9223372036854775807s",
        ] {
            let err = since(text).unwrap_err();
            assert_eq!(err.code, ErrorCode::BadRequest, "{text:?}");
            assert!(err.message.starts_with("since:"), "{}", err.message);
        }
    }

    #[test]
    fn query_names_and_values_are_percent_decoded() {
        let query = Query::parse("wait=1%2E5&platform=%69os&since&a%3Db=c%26d&=x&&plus=a+b");
        assert_eq!(query.get("wait"), Ok(Some("1.5")));
        assert_eq!(query.get("platform"), Ok(Some("ios")));
        assert_eq!(query.get("since"), Ok(Some("")));
        assert_eq!(query.get("a=b"), Ok(Some("c&d")));
        assert_eq!(query.get(""), Ok(Some("x")));
        assert_eq!(query.get("plus"), Ok(Some("a+b")), "+ is not a space");
        assert_eq!(query.get("nowhere"), Ok(None));
    }

    #[test]
    fn a_name_given_twice_is_refused_naming_it_and_the_others_still_read() {
        // Once percent-decoded the two are the same name.
        let query = Query::parse("platform=ios&wait=1&pl%61tform=android");
        let err = query.get("platform").unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert_eq!(
            err.message,
            "platform: given more than once in the query; give it once"
        );
        assert_eq!(query.get("wait"), Ok(Some("1")));
        assert!(
            Query::parse("since=1s&since=1s").get("since").is_err(),
            "even the same value"
        );
    }

    #[test]
    fn percent_decoding_takes_two_hex_digits_only() {
        assert_eq!(percent_decode("a%20b"), "a b");
        assert_eq!(percent_decode("%e2%9C%93"), "✓");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
        assert_eq!(percent_decode("%+1"), "%+1", "a sign is no hex digit");
        assert_eq!(percent_decode("%-1"), "%-1");
        assert_eq!(percent_decode("end%4"), "end%4");
        assert_eq!(percent_decode("end%"), "end%");
        assert_eq!(percent_decode("%ff"), "\u{fffd}");
        assert_eq!(percent_decode("é%C3%A9"), "éé");
        assert_eq!(segments("leases/a%2Fb/events"), ["leases", "a/b", "events"]);
    }

    proptest! {
        #[test]
        fn encoding_then_decoding_is_the_identity(text in any::<String>()) {
            prop_assert_eq!(percent_decode(&percent_encode(&text)), text);
        }

        #[test]
        fn no_text_makes_a_parser_panic(text in any::<String>(), bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let lossy = String::from_utf8_lossy(&bytes).into_owned();
            for input in [&text, &lossy] {
                let waited = wait(Some(input), MAX);
                prop_assert!(waited <= MAX);
                let query = Query::parse(input);
                let _ = query.get("wait");
                let _ = segments(input);
                let _ = percent_decode(input);
                if let Err(err) = since(input) {
                    prop_assert_eq!(err.code, ErrorCode::BadRequest);
                }
            }
        }

        #[test]
        fn any_float_text_waits_within_the_range(value in any::<f64>()) {
            for text in [value.to_string(), format!("{value:e}"), format!("{value:?}")] {
                let waited = wait(Some(&text), MAX);
                prop_assert!(waited <= MAX);
                if !value.is_finite() || value <= 0.0 {
                    prop_assert_eq!(waited, Duration::ZERO);
                }
            }
        }
    }
}
