//! A heartbeat's simlock renewal, done by the worker that holds the lease.
//!
//! Through a gateway a heartbeat goes to the lease's worker over the relay, and then the
//! simlock lease is renewed: before, the gateway made that renewal as a second call over the
//! uplink after the relay answered. Now the front asks the worker's host to renew once its
//! daemon has answered the heartbeat ok ([`RenewAsk`], a request header), and the host says
//! what became of it ([`Renewal`], a header on the answer). The order stays the seed's (the
//! daemon first, then the simlock lease) and a heartbeat costs one round trip over the uplink
//! instead of two.
//!
//! Both headers are simlock's own, between a front and a host: the front takes them off every
//! caller's request before anything else reads it, and off the answer before the caller sees
//! it. A host that does not know them (a worker built before them, or the in-process link on a
//! worker) answers without a [`Renewal`], and the front renews the lease itself as before.

use http::HeaderMap;
use http::header::HeaderValue;

/// The request header asking a host to renew the relayed lease to now plus this many
/// milliseconds once its daemon answered ok.
pub const RENEW_TTL_HEADER: &str = "x-simlock-renew-ttl-ms";

/// The answer header saying what became of a [`RenewAsk`]: see [`Renewal`].
pub const RENEWAL_HEADER: &str = "x-simlock-renewal";

/// A front's ask that the host renew the simlock lease it relays for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenewAsk {
    /// The TTL to renew to, from the moment of the renewal.
    pub ttl_ms: u64,
}

impl RenewAsk {
    /// Puts the ask on a request's headers.
    pub fn put(self, headers: &mut HeaderMap) {
        headers.insert(RENEW_TTL_HEADER, HeaderValue::from(self.ttl_ms));
    }

    /// Takes the ask off a request's headers: `None` when there is none, or when it is not
    /// one decimal TTL above zero (the header is removed either way).
    pub fn take(headers: &mut HeaderMap) -> Option<Self> {
        let ttl_ms = take_ttl(headers, RENEW_TTL_HEADER)?;
        Some(Self { ttl_ms })
    }
}

/// What became of a [`RenewAsk`], as the host answers it. No header at all means the host did
/// not renew (it does not know the ask, or the renewal failed for another reason): the front
/// renews itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The simlock lease was renewed to now plus the asked TTL.
    Renewed,
    /// The host's simlock has no such lease: it ended.
    LeaseEnded,
}

impl Renewal {
    /// The header's value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Renewed => "renewed",
            Self::LeaseEnded => "lease-ended",
        }
    }

    /// Puts the outcome on an answer's headers.
    pub fn put(self, headers: &mut HeaderMap) {
        headers.insert(RENEWAL_HEADER, HeaderValue::from_static(self.as_str()));
    }

    /// Takes the outcome off an answer's headers: `None` when there is none or it is not one
    /// value this build knows (the header is removed either way).
    pub fn take(headers: &mut HeaderMap) -> Option<Self> {
        let value = take_one(headers, RENEWAL_HEADER)?;
        [Self::Renewed, Self::LeaseEnded]
            .into_iter()
            .find(|renewal| value == renewal.as_str())
    }
}

/// The request header asking a worker's host to keep a relayed command's lease once the
/// exchange ends, however it ends: see [`KeepAsk`].
pub const KEEP_TTL_HEADER: &str = "x-simlock-keep-ttl-ms";

/// The answer header by which a host takes on a [`KeepAsk`].
pub const KEEP_HEADER: &str = "x-simlock-keep";

/// A gateway front's ask that the worker's host keep a relayed device command's lease: once
/// the exchange ends (its answer read to the end, or cut: the relay cancelled, the uplink or
/// the gateway gone), heartbeat agent-device's lease and renew the simlock lease to now plus
/// `ttl_ms`, as the front's own keep after a command does. agent-device 0.21.5 resets a
/// lease to its 60 s default on every command, and a gateway that stops mid-command never
/// sends its keep: the worker, which sees the command end in every case, does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAsk {
    /// The TTL to renew both leases to.
    pub ttl_ms: u64,
}

impl KeepAsk {
    /// Puts the ask on a request's headers.
    pub fn put(self, headers: &mut HeaderMap) {
        headers.insert(KEEP_TTL_HEADER, HeaderValue::from(self.ttl_ms));
    }

    /// Takes the ask off a request's headers, as [`RenewAsk::take`] takes its own.
    pub fn take(headers: &mut HeaderMap) -> Option<Self> {
        let ttl_ms = take_ttl(headers, KEEP_TTL_HEADER)?;
        Some(Self { ttl_ms })
    }

    /// Says on an answer's headers that the host keeps the lease after the exchange.
    pub fn taken(headers: &mut HeaderMap) {
        headers.insert(KEEP_HEADER, HeaderValue::from_static("after-exchange"));
    }

    /// Whether the answer says the host keeps the lease (the header is removed either way).
    pub fn was_taken(headers: &mut HeaderMap) -> bool {
        take_one(headers, KEEP_HEADER).is_some_and(|v| v == "after-exchange")
    }
}

/// A TTL header's one decimal value above zero; the header is removed either way.
fn take_ttl(headers: &mut HeaderMap, name: &'static str) -> Option<u64> {
    let value = take_one(headers, name)?;
    let text = value.to_str().ok()?;
    // Digits only: `u64`'s parser would also take a leading `+`.
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u64>().ok().filter(|ttl| *ttl > 0)
}

/// Removes every value of `name` from `headers`, answering the value when there was exactly
/// one.
fn take_one(headers: &mut HeaderMap, name: &'static str) -> Option<HeaderValue> {
    let http::header::Entry::Occupied(entry) = headers.entry(name) else {
        return None;
    };
    let mut values = entry.remove_entry_mult().1;
    let value = values.next()?;
    values.next().is_none().then_some(value)
}

/// Removes every header of this module: what a caller sends under these names is never
/// simlock's own.
pub fn strip(headers: &mut HeaderMap) {
    for name in [
        RENEW_TTL_HEADER,
        RENEWAL_HEADER,
        KEEP_TTL_HEADER,
        KEEP_HEADER,
    ] {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(name: &'static str, values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn an_ask_goes_on_and_comes_off_a_request_and_is_taken_once() {
        let mut headers = HeaderMap::new();
        RenewAsk { ttl_ms: 600_000 }.put(&mut headers);
        assert_eq!(headers[RENEW_TTL_HEADER], "600000");
        assert_eq!(
            RenewAsk::take(&mut headers),
            Some(RenewAsk { ttl_ms: 600_000 })
        );
        assert!(headers.is_empty());
        assert_eq!(RenewAsk::take(&mut headers), None);
    }

    #[test]
    fn an_ask_that_is_not_one_ttl_above_zero_is_none_and_is_removed() {
        let max = u64::MAX.to_string();
        let past_max = format!("{max}0");
        let bad: [&[&str]; 9] = [
            &[""],
            &["0"],
            &["-5"],
            &["+5"],
            &["5 "],
            &["1e3"],
            &["18446744073709551616"],
            &[past_max.as_str()],
            &["5", "5"],
        ];
        for values in bad {
            let mut headers = with(RENEW_TTL_HEADER, values);
            assert_eq!(RenewAsk::take(&mut headers), None, "{values:?}");
            assert!(headers.is_empty(), "{values:?} is removed");
        }
        let mut headers = with(RENEW_TTL_HEADER, &[max.as_str()]);
        assert_eq!(
            RenewAsk::take(&mut headers),
            Some(RenewAsk { ttl_ms: u64::MAX }),
            "the largest TTL is read; the core holds it to lease.maxTtlMs"
        );
        let mut headers = with(RENEW_TTL_HEADER, &["1"]);
        assert_eq!(RenewAsk::take(&mut headers), Some(RenewAsk { ttl_ms: 1 }));
    }

    #[test]
    fn each_renewal_reads_back_and_anything_else_is_none_and_removed() {
        for renewal in [Renewal::Renewed, Renewal::LeaseEnded] {
            let mut headers = HeaderMap::new();
            renewal.put(&mut headers);
            assert_eq!(Renewal::take(&mut headers), Some(renewal));
            assert!(headers.is_empty());
        }
        let bad: [&[&str]; 4] = [&["RENEWED"], &["renewed", "renewed"], &[""], &["ok"]];
        for values in bad {
            let mut headers = with(RENEWAL_HEADER, values);
            assert_eq!(Renewal::take(&mut headers), None, "{values:?}");
            assert!(headers.is_empty(), "{values:?} is removed");
        }
        assert_eq!(Renewal::take(&mut HeaderMap::new()), None);
    }

    #[test]
    fn a_keep_ask_and_its_taking_read_back_once_and_bad_ones_are_removed() {
        let mut headers = HeaderMap::new();
        KeepAsk { ttl_ms: 120_000 }.put(&mut headers);
        assert_eq!(
            KeepAsk::take(&mut headers),
            Some(KeepAsk { ttl_ms: 120_000 })
        );
        assert!(headers.is_empty());
        for values in [&["0"][..], &["+5"], &["5", "5"], &["x"]] {
            let mut headers = with(KEEP_TTL_HEADER, values);
            assert_eq!(KeepAsk::take(&mut headers), None, "{values:?}");
            assert!(headers.is_empty(), "{values:?} is removed");
        }
        let mut answer = HeaderMap::new();
        assert!(!KeepAsk::was_taken(&mut answer));
        KeepAsk::taken(&mut answer);
        assert!(KeepAsk::was_taken(&mut answer));
        assert!(answer.is_empty(), "read once");
        let mut odd = with(KEEP_HEADER, &["yes"]);
        assert!(!KeepAsk::was_taken(&mut odd));
        assert!(odd.is_empty());
    }

    #[test]
    fn strip_removes_every_one_and_nothing_else() {
        let mut headers = with(RENEW_TTL_HEADER, &["5"]);
        headers.append(RENEWAL_HEADER, HeaderValue::from_static("renewed"));
        headers.append(KEEP_TTL_HEADER, HeaderValue::from_static("5"));
        headers.append(KEEP_HEADER, HeaderValue::from_static("after-exchange"));
        headers.append("x-request-id", HeaderValue::from_static("r1"));
        strip(&mut headers);
        assert_eq!(headers.len(), 1);
        assert_eq!(headers["x-request-id"], "r1");
    }
}
