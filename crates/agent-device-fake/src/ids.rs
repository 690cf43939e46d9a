//! Identifiers and the rules 0.21.5 checks them by: tenant and run ids, lease ids, device keys,
//! plus the small encodings the daemon's replies use (hex, base36, ISO-8601 times, the file-safe
//! form of a session or request id, percent-decoding of route segments).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Whether `value` is 1–128 characters of letters, digits, `.`, `_` and `-` (tenant and run ids).
fn is_scope_id(value: &str) -> bool {
    (1..=128).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A tenant id: `^[a-zA-Z0-9._-]{1,128}$`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantId(String);

impl TenantId {
    /// The id, when `value` follows the rule.
    pub fn parse(value: &str) -> Option<Self> {
        is_scope_id(value).then(|| Self(value.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A run id: the same rule as a tenant id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RunId(String);

impl RunId {
    /// The id, when `value` follows the rule.
    pub fn parse(value: &str) -> Option<Self> {
        is_scope_id(value).then(|| Self(value.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A lease id. Minted as 32 lower-case hex characters; accepted as 16–128 hex characters in
/// either case and lower-cased.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseId(String);

impl LeaseId {
    /// A fresh id: 16 random bytes in lower-case hex.
    pub fn mint() -> Self {
        let mut bytes = [0u8; 16];
        rand::fill(&mut bytes);
        Self(hex(&bytes))
    }

    /// The id, when `value` is 16–128 hex characters.
    pub fn parse(value: &str) -> Option<Self> {
        ((16..=128).contains(&value.len()) && value.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Self(value.to_ascii_lowercase()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `value` is a device key: 1–256 printable ASCII characters.
pub(crate) fn is_device_key(value: &str) -> bool {
    (1..=256).contains(&value.len()) && value.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// `n` in base 36 with lower-case letters (JavaScript's `n.toString(36)`).
pub(crate) fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    if n == 0 {
        return "0".to_owned();
    }
    let mut out = Vec::new();
    while n > 0 {
        out.push(DIGITS[usize::try_from(n % 36).unwrap_or(0)]);
        n /= 36;
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// `len` random lower-case base-36 characters.
pub(crate) fn random_base36(len: usize) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut bytes = vec![0u8; len];
    rand::fill(&mut bytes[..]);
    bytes
        .iter()
        .map(|b| char::from(DIGITS[usize::from(*b) % 36]))
        .collect()
}

/// A fresh random UUID (v4), as the daemon's `randomUUID()`.
pub(crate) fn uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The file-safe form of a session or request id, as the daemon names its log files
/// (`acme:s1` → `acme_s1`).
pub(crate) fn file_safe(value: &str) -> String {
    value
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Epoch milliseconds as ISO-8601 UTC with milliseconds (`2026-12-01T14:01:14.341Z`).
pub(crate) fn iso8601(epoch_ms: u64) -> String {
    let millis = epoch_ms % 1000;
    let secs = epoch_ms / 1000;
    let (hour, minute, second) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let (year, month, day) = civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{millis:03}Z")
}

/// The proleptic Gregorian date of a count of days since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so that leap days fall at the end of a 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (
        year,
        u32::try_from(month).unwrap_or(1),
        u32::try_from(day).unwrap_or(1),
    )
}

/// Decodes `%XX` escapes in a route segment; `None` when an escape is malformed or the result is
/// not UTF-8 (JavaScript's `decodeURIComponent` throws there).
pub(crate) fn percent_decode(segment: &str) -> Option<String> {
    let escapes_whole = segment.match_indices('%').all(|(at, _)| {
        segment
            .as_bytes()
            .get(at + 1..at + 3)
            .is_some_and(|digits| digits.iter().all(u8::is_ascii_hexdigit))
    });
    if !escapes_whole {
        return None;
    }
    percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .ok()
        .map(std::borrow::Cow::into_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_ids_follow_the_rule_at_both_bounds() {
        assert!(TenantId::parse("acme.run_1-x").is_some());
        assert!(TenantId::parse(&"a".repeat(128)).is_some());
        assert!(TenantId::parse(&"a".repeat(129)).is_none());
        assert!(TenantId::parse("").is_none());
        assert!(TenantId::parse("a b").is_none());
        assert!(RunId::parse("acme:1").is_none());
        assert!(RunId::parse("é").is_none());
    }

    #[test]
    fn lease_ids_are_minted_as_32_hex_and_accepted_as_16_to_128() {
        let minted = LeaseId::mint();
        assert_eq!(minted.as_str().len(), 32);
        assert!(
            minted
                .as_str()
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        assert_ne!(minted, LeaseId::mint());
        assert!(LeaseId::parse(&"a".repeat(15)).is_none());
        assert!(LeaseId::parse(&"a".repeat(16)).is_some());
        assert!(LeaseId::parse(&"a".repeat(128)).is_some());
        assert!(LeaseId::parse(&"a".repeat(129)).is_none());
        assert!(LeaseId::parse("nothexnothexnothex").is_none());
        assert_eq!(
            LeaseId::parse("ABCDEF0123456789").map(|l| l.as_str().to_owned()),
            Some("abcdef0123456789".to_owned())
        );
    }

    #[test]
    fn device_keys_are_printable_ascii_up_to_256() {
        assert!(is_device_key("local:linux:none:local"));
        assert!(is_device_key(&"k".repeat(256)));
        assert!(!is_device_key(&"k".repeat(257)));
        assert!(!is_device_key(""));
        assert!(!is_device_key("ké"));
        assert!(!is_device_key("a\tb"));
    }

    #[test]
    fn encodings_match_javascript() {
        assert_eq!(hex(&[0, 15, 255]), "000fff");
        assert_eq!(base36(1_796_133_897_035), "mx4rqwqz");
        assert_eq!(base36(0), "0");
        assert_eq!(random_base36(8).len(), 8);
        assert_eq!(file_safe("acme:adc-1"), "acme_adc-1");
        assert_eq!(file_safe("req:r1:42:7:ab"), "req_r1_42_7_ab");
    }

    #[test]
    fn iso_times_are_utc_with_milliseconds() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso8601(1_796_133_674_341), "2026-12-01T14:01:14.341Z");
        assert_eq!(iso8601(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(iso8601(4_107_542_399_999), "2100-02-28T23:59:59.999Z");
    }

    #[test]
    fn route_segments_decode_like_decode_uri_component() {
        assert_eq!(
            percent_decode("acme%3Aadc-1").as_deref(),
            Some("acme:adc-1")
        );
        assert_eq!(percent_decode("sh%6Ft").as_deref(), Some("shot"));
        assert_eq!(percent_decode("plain").as_deref(), Some("plain"));
        assert_eq!(percent_decode("%ZZ"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%FF"), None);
    }
}
