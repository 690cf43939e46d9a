//! Every input bound, declared once. The input types refer to these constants and rules;
//! nothing else in simlock re-checks them.

use std::sync::LazyLock;

use garde::Error;

/// The longest call line a daemon reads: 1 MiB.
pub const MAX_CALL_LINE: usize = 1024 * 1024;
/// The longest line a client reads: 64 MiB, since a worker's catalog or device list can be large.
pub const MAX_CLIENT_LINE: usize = 64 * 1024 * 1024;

/// Capability and relay target names: `^[a-z][a-z0-9-]{0,63}$`.
pub const CAPABILITY_PATTERN: &str = r"^[a-z][a-z0-9-]{0,63}$";
/// At most this many required capabilities on one lease request.
pub const MAX_REQUIRES: usize = 8;
/// A caller-chosen lease id: ASCII, a letter or digit first, then letters, digits, `_` or `-`.
pub const CHOSEN_LEASE_ID_PATTERN: &str = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$";
/// Any lease id a caller names (a worker's, a chosen one, or a gateway's `<worker>.<lease>`).
pub const LEASE_ID_PATTERN: &str = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,159}$";
/// A worker id: letters, digits, `_` and `-` (no `.`, which splits gateway lease ids).
pub const WORKER_ID_PATTERN: &str = r"^[A-Za-z0-9_-]{1,128}$";
/// Requester ids, principals and owners: at most this many characters.
pub const MAX_REQUESTER: usize = 256;
/// What a gateway puts before a requester on its workers (`gw:` + its instance id, a UUID, +
/// `:`): through a gateway a requester may be [`MAX_REQUESTER`] less this long (ADR 0009).
pub const GATEWAY_REQUESTER_PREFIX: usize = 40;
/// A model name or alias: at most this many characters.
pub const MAX_MODEL: usize = 256;
/// An OS version: at most this many characters.
pub const MAX_OS_VERSION: usize = 64;
/// An idempotency key: at most this many characters.
pub const MAX_IDEMPOTENCY_KEY: usize = 200;
/// A label: at most this many characters.
pub const MAX_LABEL: usize = 128;
/// The longest TTL the contract carries: 31 days. Config sets the real cap, `lease.maxTtlMs`.
pub const MAX_TTL_MS: u64 = 31 * 24 * 3600 * 1000;
/// The longest queue wait: 24 hours.
pub const MAX_QUEUE_TIMEOUT_MS: u64 = 24 * 3600 * 1000;
/// An exec tool name: at most this many characters.
pub const MAX_TOOL: usize = 64;
/// At most this many exec arguments.
pub const MAX_ARGS: usize = 256;
/// One exec argument: at most this many bytes.
pub const MAX_ARG: usize = 8192;
/// Exec stdin: at most 512 KiB (it travels inside one call line).
pub const MAX_STDIN: usize = 512 * 1024;
/// Event timestamps: `|t| ≤ 8.64e15` ms, the range of a JavaScript date.
pub const MAX_TIMESTAMP_MS: i64 = 8_640_000_000_000_000;

/// A relay id: 1–64 of `[A-Za-z0-9_-]`.
pub const RELAY_ID_PATTERN: &str = r"^[A-Za-z0-9_-]{1,64}$";
/// A link channel id: 1–32 of `[A-Za-z0-9-]`.
pub const CHANNEL_PATTERN: &str = r"^[A-Za-z0-9-]{1,32}$";
/// A relayed lease id: 32 lower-case hex.
pub const RELAY_LEASE_ID_PATTERN: &str = r"^[0-9a-f]{32}$";
/// A relayed URL: at most this many bytes.
pub const MAX_RELAY_URL: usize = 4096;
/// At most this many relayed headers.
pub const MAX_RELAY_HEADERS: usize = 100;
/// One relayed header value: at most this many bytes.
pub const MAX_HEADER_VALUE: usize = 8192;
/// A relay tenant: 1–300 characters.
pub const MAX_TENANT: usize = 300;

/// Compiles one of the constant patterns above.
#[allow(
    clippy::expect_used,
    reason = "the patterns are constants, each compiled by a test"
)]
fn compiled(pattern: &'static str) -> regex::Regex {
    regex::Regex::new(pattern).expect("constant pattern compiles")
}

/// [`CAPABILITY_PATTERN`], compiled.
pub static CAPABILITY_RE: LazyLock<regex::Regex> = LazyLock::new(|| compiled(CAPABILITY_PATTERN));
/// [`CHOSEN_LEASE_ID_PATTERN`], compiled.
pub static CHOSEN_LEASE_ID_RE: LazyLock<regex::Regex> =
    LazyLock::new(|| compiled(CHOSEN_LEASE_ID_PATTERN));
/// [`LEASE_ID_PATTERN`], compiled.
pub static LEASE_ID_RE: LazyLock<regex::Regex> = LazyLock::new(|| compiled(LEASE_ID_PATTERN));
/// [`WORKER_ID_PATTERN`], compiled.
pub static WORKER_ID_RE: LazyLock<regex::Regex> = LazyLock::new(|| compiled(WORKER_ID_PATTERN));
/// [`RELAY_ID_PATTERN`], compiled.
pub static RELAY_ID_RE: LazyLock<regex::Regex> = LazyLock::new(|| compiled(RELAY_ID_PATTERN));
/// [`CHANNEL_PATTERN`], compiled.
pub static CHANNEL_RE: LazyLock<regex::Regex> = LazyLock::new(|| compiled(CHANNEL_PATTERN));
/// [`RELAY_LEASE_ID_PATTERN`], compiled.
pub static RELAY_LEASE_ID_RE: LazyLock<regex::Regex> =
    LazyLock::new(|| compiled(RELAY_LEASE_ID_PATTERN));

/// Whether `name` is a valid capability or relay target name.
pub fn is_capability_name(name: &str) -> bool {
    CAPABILITY_RE.is_match(name)
}

/// Whether `id` is a valid link channel id.
pub fn is_channel_id(id: &str) -> bool {
    CHANNEL_RE.is_match(id)
}

/// Whether `id` is a valid worker id.
pub fn is_worker_id(id: &str) -> bool {
    WORKER_ID_RE.is_match(id)
}

/// garde rule: an absolute `http:` or `https:` URL with a host.
pub fn absolute_http_url(url: &str, _: &()) -> garde::Result {
    if url.len() > MAX_RELAY_URL {
        return Err(Error::new(format!(
            "length is greater than {MAX_RELAY_URL}"
        )));
    }
    let parsed: http::Uri = url
        .parse()
        .map_err(|_| Error::new("is not an absolute http: or https: URL"))?;
    let scheme_ok = matches!(parsed.scheme_str(), Some("http" | "https"));
    if !scheme_ok || parsed.authority().is_none() {
        return Err(Error::new("is not an absolute http: or https: URL"));
    }
    Ok(())
}

/// Whether `name` is an HTTP token (RFC 9110 `tchar`s, at least one).
pub fn is_http_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// garde rule: at most 100 `[name, value]` pairs, each name a token, each value at most
/// 8192 bytes with no CR, LF or NUL.
pub fn relay_headers(headers: &[(String, String)], _: &()) -> garde::Result {
    if headers.len() > MAX_RELAY_HEADERS {
        return Err(Error::new(format!(
            "at most {MAX_RELAY_HEADERS} headers, got {}",
            headers.len()
        )));
    }
    for (index, (name, value)) in headers.iter().enumerate() {
        if !is_http_token(name) {
            return Err(Error::new(format!("[{index}] name is not an HTTP token")));
        }
        if value.len() > MAX_HEADER_VALUE {
            return Err(Error::new(format!(
                "[{index}] value is longer than {MAX_HEADER_VALUE} bytes"
            )));
        }
        if value.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
            return Err(Error::new(format!("[{index}] value holds CR, LF or NUL")));
        }
    }
    Ok(())
}

/// Headers neither side of a relay passes on, in either direction: the hop-by-hop and framing
/// headers, which the relay re-creates. Every header a `connection` header names goes too.
pub const RELAY_HOP_BY_HOP_HEADERS: &[&str] = &[
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-authenticate",
];

/// Headers the gateway also drops from its caller's request, so a worker never holds a gateway
/// credential.
pub const RELAY_GATEWAY_CREDENTIAL_HEADERS: &[&str] = &["authorization", "x-agent-device-token"];

/// Filters relayed headers before their bounds apply: drops [`RELAY_HOP_BY_HOP_HEADERS`], every
/// header a `connection` header names, and the names in `also` (all compared case-insensitively).
/// The order of the rest is kept.
pub fn filter_relay_headers(
    headers: Vec<(String, String)>,
    also: &[&str],
) -> Vec<(String, String)> {
    let named: Vec<String> = headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, value)| value.split(','))
        .map(|token| token.trim().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
        .collect();
    headers
        .into_iter()
        .filter(|(name, _)| {
            let dropped = |list: &[&str]| list.iter().any(|d| name.eq_ignore_ascii_case(d));
            !dropped(RELAY_HOP_BY_HOP_HEADERS)
                && !dropped(also)
                && !named.iter().any(|n| name.eq_ignore_ascii_case(n))
        })
        .collect()
}

/// Whether `c` is a character a name must not hold, by its Unicode general category: a control
/// character (`Cc`: C0, DEL or C1, a newline, an escape, a NUL…), a format character (`Cf`: one
/// that shows nothing or turns the text around: zero-width spaces and joiners, direction marks
/// and overrides, the byte order mark, the soft hyphen, tag characters…), or a line or paragraph
/// separator: with them, one name could pass for another in a listing.
pub fn is_hidden(c: char) -> bool {
    use unicode_general_category::{GeneralCategory, get_general_category};
    matches!(
        get_general_category(c),
        GeneralCategory::Control
            | GeneralCategory::Format
            | GeneralCategory::LineSeparator
            | GeneralCategory::ParagraphSeparator
    )
}

#[cfg(test)]
mod hidden_tests {
    use super::is_hidden;

    /// What the former hand-written table held is still hidden, and so are the format
    /// characters it missed (tag characters); the characters right outside its ranges, and
    /// names' ordinary text, are not.
    #[test]
    fn hidden_characters_are_told_by_their_category_and_their_neighbours_pass() {
        for c in [
            '\u{0}',
            '\n',
            '\u{1b}',
            '\u{7f}',
            '\u{85}',
            '\u{ad}',
            '\u{61c}',
            '\u{180e}',
            '\u{200b}',
            '\u{200f}',
            '\u{2028}',
            '\u{2029}',
            '\u{202a}',
            '\u{202e}',
            '\u{2060}',
            '\u{206f}',
            '\u{feff}',
            '\u{fff9}',
            '\u{fffb}',
            '\u{e0001}',
            '\u{e0041}',
            '\u{e007f}',
        ] {
            assert!(is_hidden(c), "{:?} is hidden", c);
        }
        for c in [
            'a',
            'é',
            'Ω',
            '·',
            '🦀',
            ' ',
            '-',
            '\u{2010}',
            '\u{2027}',
            '\u{202f}',
            '\u{2070}',
            '\u{fffc}',
            '\u{1f4bb}',
        ] {
            assert!(!is_hidden(c), "{:?} is shown", c);
        }
    }
}

/// garde rule: text that holds no hidden character ([`is_hidden`]), so that what a caller
/// names (a requester, a label) cannot forge a line, send escape sequences to whoever reads it
/// in a terminal or a log, or pass for another name.
pub fn printable<T: AsRef<str> + ?Sized>(text: &T, _: &()) -> garde::Result {
    match text.as_ref().chars().position(is_hidden) {
        Some(at) => Err(Error::new(format!(
            "must not hold control characters or invisible ones (character {} is one)",
            at + 1
        ))),
        None => Ok(()),
    }
}

/// A worker's label, wherever it is given (its configuration, its uplink's header): at most
/// [`MAX_LABEL`] characters, [`printable`]. The message says what is wrong, without the key.
///
/// # Errors
/// What is wrong with it.
pub fn label(text: &str) -> Result<(), String> {
    if text.chars().count() > MAX_LABEL {
        return Err(format!("at most {MAX_LABEL} characters"));
    }
    printable(text, &()).map_err(|e| e.to_string())
}

/// garde rule: exec arguments, at most 256, each at most 8192 bytes.
pub fn exec_args(args: &[String], _: &()) -> garde::Result {
    if args.len() > MAX_ARGS {
        return Err(Error::new(format!(
            "at most {MAX_ARGS} arguments, got {}",
            args.len()
        )));
    }
    if let Some(index) = args.iter().position(|a| a.len() > MAX_ARG) {
        return Err(Error::new(format!(
            "[{index}] is longer than {MAX_ARG} bytes"
        )));
    }
    Ok(())
}

/// garde rule: a timestamp within `±8.64e15` ms.
pub fn timestamp(ts: &i64, _: &()) -> garde::Result {
    if ts.unsigned_abs() > MAX_TIMESTAMP_MS.unsigned_abs() {
        return Err(Error::new("is outside ±8.64e15 ms"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pattern_compiles() {
        for pattern in [
            CAPABILITY_PATTERN,
            CHOSEN_LEASE_ID_PATTERN,
            LEASE_ID_PATTERN,
            WORKER_ID_PATTERN,
            RELAY_ID_PATTERN,
            CHANNEL_PATTERN,
            RELAY_LEASE_ID_PATTERN,
        ] {
            assert!(regex::Regex::new(pattern).is_ok(), "{pattern}");
        }
    }

    #[test]
    fn compiled_patterns_match_their_text() {
        assert!(CHANNEL_RE.is_match("ch-1"));
        assert!(!CHANNEL_RE.is_match(&"a".repeat(33)));
        assert!(RELAY_LEASE_ID_RE.is_match(&"a".repeat(32)));
        assert!(!RELAY_LEASE_ID_RE.is_match(&"A".repeat(32)));
        assert!(is_worker_id("3f81-aa_b"));
        assert!(!is_worker_id("a.b"));
        assert!(LEASE_ID_RE.is_match("3f81.lse_0a"));
        assert!(CHOSEN_LEASE_ID_RE.is_match("abc_-1"));
        assert!(!CHOSEN_LEASE_ID_RE.is_match("a.b"));
        assert!(RELAY_ID_RE.is_match("r_1-x"));
    }

    #[test]
    fn capability_names() {
        assert!(is_capability_name("agent-device"));
        assert!(is_capability_name(&format!("a{}", "b".repeat(63))));
        assert!(!is_capability_name(&format!("a{}", "b".repeat(64))));
        assert!(!is_capability_name("Agent"));
        assert!(!is_capability_name("1a"));
        assert!(!is_capability_name(""));
    }

    #[test]
    fn urls() {
        assert!(absolute_http_url("http://h/x?y=1", &()).is_ok());
        assert!(absolute_http_url("https://h:8/x", &()).is_ok());
        assert!(absolute_http_url("/relative", &()).is_err());
        assert!(absolute_http_url("file:///etc/passwd", &()).is_err());
        assert!(absolute_http_url("ftp://h/x", &()).is_err());
        let at_limit = format!("http://h/{}", "a".repeat(MAX_RELAY_URL - 9));
        assert_eq!(at_limit.len(), MAX_RELAY_URL);
        assert!(absolute_http_url(&at_limit, &()).is_ok());
        assert!(absolute_http_url(&format!("{at_limit}a"), &()).is_err());
    }

    #[test]
    fn relay_headers_are_filtered_with_what_connection_names() {
        let pair = |n: &str, v: &str| (n.to_owned(), v.to_owned());
        let kept = filter_relay_headers(
            vec![
                pair("Connection", "X-Secret, keep-alive"),
                pair("x-secret", "1"),
                pair("Keep-Alive", "timeout=5"),
                pair("Content-Length", "3"),
                pair("Transfer-Encoding", "chunked"),
                pair("TE", "trailers"),
                pair("Authorization", "Bearer x"),
                pair("accept", "*/*"),
                pair("X-Agent-Device-Token", "t"),
            ],
            RELAY_GATEWAY_CREDENTIAL_HEADERS,
        );
        assert_eq!(kept, vec![pair("accept", "*/*")]);
        let worker_side = filter_relay_headers(vec![pair("authorization", "a")], &[]);
        assert_eq!(worker_side, vec![pair("authorization", "a")]);
    }

    #[test]
    fn tokens() {
        assert!(is_http_token("x-agent-device-token"));
        assert!(!is_http_token("bad name"));
        assert!(!is_http_token(""));
        assert!(!is_http_token("a:b"));
    }
}
