//! The agent-device lease id the front mints (`L`): 32 lower-case hex characters, the form
//! agent-device itself mints. The CLI only ever sees `L`; the worker's host maps it to the
//! daemon's own id.

use std::fmt;

/// The header that names the agent-device lease an upload, artifact download or diagnostics
/// request is for (read through a gateway only).
pub const LEASE_HEADER: &str = "x-agent-device-lease-id";

/// An agent-device lease id: exactly 32 lower-case hex characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseId(String);

impl LeaseId {
    /// The length of every id.
    pub const LEN: usize = 32;

    /// Reads `raw` as an id: `None` unless it is 32 lower-case hex characters.
    pub fn parse(raw: &str) -> Option<Self> {
        (raw.len() == Self::LEN
            && raw
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| Self(raw.to_owned()))
    }

    /// A fresh random id.
    pub fn mint() -> Self {
        let bytes: [u8; 16] = rand::random();
        let mut out = String::with_capacity(Self::LEN);
        for b in bytes {
            out.push_str(&format!("{b:02x}"));
        }
        Self(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_32_lower_case_hex_characters_are_an_id() {
        let ok = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            LeaseId::parse(ok).map(|l| l.to_string()).as_deref(),
            Some(ok)
        );
        assert!(LeaseId::parse(&ok[..31]).is_none(), "one short");
        assert!(LeaseId::parse(&format!("{ok}0")).is_none(), "one past");
        assert!(LeaseId::parse(&ok.to_uppercase()).is_none(), "upper case");
        assert!(LeaseId::parse("g123456789abcdef0123456789abcdef").is_none());
        assert!(LeaseId::parse("").is_none());
        assert!(
            LeaseId::parse(&"é".repeat(16)).is_none(),
            "32 bytes, not hex"
        );
    }

    #[test]
    fn minted_ids_parse_and_differ() {
        let a = LeaseId::mint();
        let b = LeaseId::mint();
        assert_eq!(LeaseId::parse(a.as_str()), Some(a.clone()));
        assert_ne!(a, b);
    }
}
