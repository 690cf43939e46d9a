//! Durations as a person types them: `15m`, `90s`, `1h30m`, `2d`, `500ms`, or a bare number of
//! milliseconds (what the CLI took before, still accepted). One parser for every flag and for the
//! MCP tools' arguments; the views print durations the same way (`view::duration`).

/// The units, longest name first so `ms` is not read as `m` then `s`.
const UNITS: &[(&str, u64)] = &[
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
];

/// What a duration may look like, for messages.
pub(crate) const SHAPES: &str = "15m, 90s, 1h30m, 2d, 500ms or a number of milliseconds";

/// Parses a duration into milliseconds: one or more `<number><unit>` parts (`1h30m`), or a bare
/// number of milliseconds. Surrounding spaces are ignored; spaces inside are not allowed.
///
/// # Errors
/// A message naming the text and the shapes a duration may take, or saying that it is too
/// large (past 64 bits of milliseconds, some 584 million years).
pub(crate) fn parse_ms(text: &str) -> Result<u64, String> {
    match parse_wide(text)? {
        Some(ms) => Ok(ms),
        None => Err(format!("{text:?} is too large for a duration")),
    }
}

/// [`parse_ms`], with `None` for a well-formed duration too large for 64 bits of milliseconds,
/// so that a caller with a bound can say it is past that bound.
fn parse_wide(text: &str) -> Result<Option<u64>, String> {
    let bad = || format!("{text:?} is not a duration like {SHAPES}");
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(bad());
    }
    if trimmed.bytes().all(|b| b.is_ascii_digit()) {
        // Only digits: a parse failure is an overflow.
        return Ok(trimmed.parse().ok());
    }
    let mut rest = trimmed;
    let mut total: Option<u64> = Some(0);
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(bad());
        }
        let (number, after) = rest.split_at(digits);
        let Some((unit, factor)) = UNITS.iter().find(|(unit, _)| after.starts_with(unit)) else {
            return Err(bad());
        };
        let part = number
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(*factor));
        total = total
            .zip(part)
            .and_then(|(total, part)| total.checked_add(part));
        rest = &after[unit.len()..];
    }
    Ok(total)
}

/// Every duration the CLI takes is positive.
fn positive(ms: u64, said: &str) -> Result<u64, String> {
    match ms {
        0 => Err(format!("{said} is zero; a duration must be positive")),
        ms => Ok(ms),
    }
}

/// What a duration is for, and the contract's bound on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Width {
    /// A lease's TTL: at most [`simlock_contract::bounds::MAX_TTL_MS`] (the daemon's
    /// `lease.maxTtlMs` may be lower; it says so).
    Ttl,
    /// A queue wait: at most [`simlock_contract::bounds::MAX_QUEUE_TIMEOUT_MS`].
    QueueWait,
}

impl Width {
    const fn max(self) -> u64 {
        match self {
            Self::Ttl => simlock_contract::bounds::MAX_TTL_MS,
            Self::QueueWait => simlock_contract::bounds::MAX_QUEUE_TIMEOUT_MS,
        }
    }

    const fn name(self) -> &'static str {
        match self {
            Self::Ttl => "TTL",
            Self::QueueWait => "queue wait",
        }
    }

    /// `ms` (given as `said`) when it is positive and within the bound, else why not, naming it
    /// as it was given.
    pub(crate) fn check(self, ms: u64, said: &str) -> Result<u64, String> {
        let ms = positive(ms, said)?;
        if ms > self.max() {
            return Err(format!(
                "{said} is longer than the longest {} simlock takes, {}",
                self.name(),
                simlock_contract::duration::text(self.max())
            ));
        }
        Ok(ms)
    }

    /// A typed duration: [`parse_ms`], then [`Self::check`]; one too large for 64 bits is past
    /// the bound as any other.
    pub(crate) fn parse(self, text: &str) -> Result<u64, String> {
        let ms = parse_wide(text)?.unwrap_or(u64::MAX);
        self.check(ms, &format!("{text:?}"))
    }

    /// [`Self::parse`] for text that must name its unit (an MCP argument, where a JSON number
    /// is the way to give milliseconds): a bare number could mean minutes as well.
    pub(crate) fn parse_with_unit(self, text: &str) -> Result<u64, String> {
        let trimmed = text.trim();
        if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{text:?} has no unit: write it like 15m, 90s or 500ms (a JSON number is milliseconds)"
            ));
        }
        self.parse(text)
    }
}

/// `--ttl` for clap: [`Width::Ttl`].
pub(crate) fn ttl_ms(text: &str) -> Result<u64, String> {
    Width::Ttl.parse(text)
}

/// `--timeout` for clap: [`Width::QueueWait`].
pub(crate) fn timeout_ms(text: &str) -> Result<u64, String> {
    Width::QueueWait.parse(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ttl_or_a_wait_past_the_contracts_bound_is_said_in_its_units() {
        assert_eq!(ttl_ms("31d"), Ok(2_678_400_000));
        assert_eq!(
            ttl_ms("31d1ms"),
            Err("\"31d1ms\" is longer than the longest TTL simlock takes, 31d".to_owned())
        );
        assert_eq!(timeout_ms("24h"), Ok(86_400_000));
        assert_eq!(
            timeout_ms("86400001"),
            Err("\"86400001\" is longer than the longest queue wait simlock takes, 1d".to_owned())
        );
        assert_eq!(
            ttl_ms("0"),
            Err("\"0\" is zero; a duration must be positive".to_owned())
        );
        // A number given as a number is named as given, not quoted.
        assert_eq!(
            Width::QueueWait.check(0, "0"),
            Err("0 is zero; a duration must be positive".to_owned())
        );
        assert_eq!(
            Width::Ttl.check(2_678_400_001, "2678400001"),
            Err("2678400001 is longer than the longest TTL simlock takes, 31d".to_owned())
        );
    }

    #[test]
    fn text_that_must_name_its_unit_refuses_a_bare_number() {
        assert_eq!(Width::Ttl.parse_with_unit("15m"), Ok(900_000));
        assert_eq!(Width::Ttl.parse_with_unit(" 500ms "), Ok(500));
        assert_eq!(
            Width::Ttl.parse_with_unit("15"),
            Err("\"15\" has no unit: write it like 15m, 90s or 500ms (a JSON number is milliseconds)".to_owned())
        );
        assert!(Width::Ttl.parse_with_unit("").unwrap_err().contains(SHAPES));
    }

    #[test]
    fn single_units_parse() {
        assert_eq!(parse_ms("500"), Ok(500));
        assert_eq!(parse_ms("500ms"), Ok(500));
        assert_eq!(parse_ms("90s"), Ok(90_000));
        assert_eq!(parse_ms("15m"), Ok(900_000));
        assert_eq!(parse_ms("2h"), Ok(7_200_000));
        assert_eq!(parse_ms("1d"), Ok(86_400_000));
        assert_eq!(parse_ms(" 30s "), Ok(30_000));
    }

    #[test]
    fn compound_durations_add_up() {
        assert_eq!(parse_ms("1h30m"), Ok(5_400_000));
        assert_eq!(parse_ms("1h30m30s"), Ok(5_430_000));
        assert_eq!(parse_ms("1m500ms"), Ok(60_500));
        assert_eq!(parse_ms("1d2h"), Ok(93_600_000));
    }

    #[test]
    fn what_the_views_print_parses_back() {
        for ms in [500, 45_000, 900_000, 5_430_000, 3_600_000, 86_400_000] {
            assert_eq!(parse_ms(&crate::view::duration(ms)), Ok(ms), "{ms}");
        }
    }

    #[test]
    fn malformed_durations_are_refused_with_the_shapes() {
        for text in ["", " ", "m", "5 m", "3w", "1.5h", "-5s", "5m-", "h1", "1hh"] {
            let err = parse_ms(text).expect_err(text);
            assert!(err.contains(SHAPES), "{err}");
        }
    }

    #[test]
    fn an_overflow_is_refused_as_too_large_not_wrapped() {
        assert_eq!(parse_ms("18446744073709551615"), Ok(u64::MAX));
        for text in [
            "18446744073709551616",
            "99999999999999999999999",
            "213503982335d",
            "213503982334d1d",
            "99999999999999999999999s",
        ] {
            assert_eq!(
                parse_ms(text),
                Err(format!("{text:?} is too large for a duration")),
            );
        }
        // A malformed text stays malformed, however large its numbers.
        assert!(
            parse_ms("99999999999999999999999x")
                .unwrap_err()
                .contains(SHAPES)
        );
        // Against a bound, too large is past it.
        assert_eq!(
            ttl_ms("99999999999999999999999"),
            Err(
                "\"99999999999999999999999\" is longer than the longest TTL simlock takes, 31d"
                    .to_owned()
            )
        );
    }

    #[test]
    fn zero_is_not_a_positive_duration() {
        assert_eq!(ttl_ms("1s"), Ok(1_000));
        assert!(ttl_ms("0").is_err());
        assert!(timeout_ms("0s").is_err());
    }
}
