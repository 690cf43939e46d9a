//! The tenant agent-device sees for a caller. agent-device accepts `^[a-zA-Z0-9._-]{1,128}$`;
//! simlock principals and gateway ids may hold other characters, so each part is escaped: a
//! character outside letters, digits and hyphen is written `_<hex>_` (its code point in
//! lower-case hex). On a worker the tenant is the escaped principal; through a gateway it is
//! `gw.<escaped gateway id>.<escaped principal>`, so the parts never run into each other (an
//! escaped part holds no dot) and a relayed tenant never equals a worker token's. A tenant over
//! 128 characters is cut and ends in `.` and 16 hex characters of the SHA-256 of the whole, so
//! every input gives a valid tenant and distinct inputs distinct ones.

use std::fmt;
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

/// The longest tenant agent-device accepts.
pub const MAX_TENANT: usize = 128;
/// Hex characters of the hash a cut tenant ends in.
const HASH_HEX: usize = 16;

/// A valid agent-device tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(String);

impl Tenant {
    /// The tenant of `principal` on a worker it calls directly.
    pub fn on_worker(principal: &str) -> Self {
        Self::bounded(escape(principal))
    }

    /// The tenant of `principal` calling through the gateway whose instance id is `gateway`.
    pub fn through_gateway(gateway: &str, principal: &str) -> Self {
        Self::bounded(format!("gw.{}.{}", escape(gateway), escape(principal)))
    }

    /// A tenant a trusted peer (the gateway over the relay) already computed; `None` unless it
    /// is valid.
    pub fn from_peer(raw: &str) -> Option<Self> {
        is_valid(raw).then(|| Self(raw.to_owned()))
    }

    /// The tenant as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn bounded(full: String) -> Self {
        if full.is_empty() {
            // An empty principal still gets a tenant of its own, one escaping never produces.
            return Self("_".to_owned());
        }
        if full.len() <= MAX_TENANT {
            return Self(full);
        }
        let digest = Sha256::digest(full.as_bytes());
        let mut hash = String::with_capacity(HASH_HEX);
        for b in digest.iter().take(HASH_HEX / 2) {
            let _ = write!(hash, "{b:02x}");
        }
        // The escaped text is ASCII, so any byte index is a character boundary.
        let keep = MAX_TENANT - 1 - HASH_HEX;
        Self(format!("{}.{hash}", &full[..keep]))
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `raw` is a tenant agent-device accepts.
pub fn is_valid(raw: &str) -> bool {
    (1..=MAX_TENANT).contains(&raw.len())
        && raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn escape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for c in part.chars() {
        if c.is_ascii_alphanumeric() || c == '-' {
            out.push(c);
        } else {
            let _ = write!(out, "_{:x}_", u32::from(c));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_token_principal_is_escaped_and_a_gateway_tenant_is_prefixed() {
        assert_eq!(Tenant::on_worker("tok_abc").as_str(), "tok_5f_abc");
        assert_eq!(
            Tenant::through_gateway("1f0e-aa", "tok_abc").as_str(),
            "gw.1f0e-aa.tok_5f_abc"
        );
        assert_eq!(Tenant::on_worker("a:b.c").as_str(), "a_3a_b_2e_c");
        assert_eq!(Tenant::on_worker("é").as_str(), "_e9_");
    }

    #[test]
    fn a_worker_tenant_never_looks_like_a_relayed_one() {
        // "gw.x.y" as a principal escapes its dots.
        assert_eq!(Tenant::on_worker("gw.x.y").as_str(), "gw_2e_x_2e_y");
        assert_ne!(
            Tenant::on_worker("gw.x.y"),
            Tenant::through_gateway("x", "y")
        );
    }

    #[test]
    fn a_tenant_at_the_bound_is_kept_and_one_past_is_cut_with_a_hash() {
        let at = "a".repeat(MAX_TENANT);
        assert_eq!(Tenant::on_worker(&at).as_str(), at);
        let past = "a".repeat(MAX_TENANT + 1);
        let cut = Tenant::on_worker(&past);
        assert_eq!(cut.as_str().len(), MAX_TENANT);
        assert!(is_valid(cut.as_str()));
        assert_ne!(cut, Tenant::on_worker(&"a".repeat(MAX_TENANT + 2)));
    }

    proptest! {
        #[test]
        fn every_input_gives_a_valid_tenant(gateway in ".{0,80}", principal in ".{0,300}") {
            prop_assert!(is_valid(Tenant::on_worker(&principal).as_str()));
            prop_assert!(is_valid(Tenant::through_gateway(&gateway, &principal).as_str()));
        }

        #[test]
        fn distinct_principals_give_distinct_tenants(a in ".{0,200}", b in ".{0,200}") {
            prop_assume!(a != b);
            prop_assert_ne!(Tenant::on_worker(&a), Tenant::on_worker(&b));
            prop_assert_ne!(Tenant::through_gateway("g", &a), Tenant::through_gateway("g", &b));
        }

        #[test]
        fn distinct_gateways_give_distinct_tenants(a in ".{0,60}", b in ".{0,60}", p in ".{0,60}") {
            prop_assume!(a != b);
            prop_assert_ne!(Tenant::through_gateway(&a, &p), Tenant::through_gateway(&b, &p));
        }
    }
}
