//! Durations for people, in the units the CLI reads back (`1d2h`, `15m`, `90s` is `1m30s`,
//! `500ms`): messages that name a width in milliseconds add this beside the number.

use std::fmt::Write as _;

/// The units, largest first.
const UNITS: &[(&str, u64)] = &[
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

/// `ms` exactly, in the largest units that fit: `1h30m`, `2d`, `1m0s500ms` is written
/// `1m500ms`, zero is `0ms`.
#[must_use]
pub fn text(ms: u64) -> String {
    let mut out = String::new();
    let mut rest = ms;
    for (unit, size) in UNITS {
        let n = rest / size;
        rest %= size;
        if n > 0 {
            let _ = write!(out, "{n}{unit}");
        }
    }
    if out.is_empty() {
        out.push_str("0ms");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_unit_is_named_once_largest_first() {
        assert_eq!(text(0), "0ms");
        assert_eq!(text(500), "500ms");
        assert_eq!(text(45_000), "45s");
        assert_eq!(text(60_500), "1m500ms");
        assert_eq!(text(3_600_000), "1h");
        assert_eq!(text(5_430_000), "1h30m30s");
        assert_eq!(text(93_600_000), "1d2h");
        assert_eq!(text(crate::bounds::MAX_TTL_MS), "31d");
        assert_eq!(text(u64::MAX), "213503982334d14h25m51s615ms");
    }
}
