//! Identifier newtypes. Each kind of id has a prefix so a stray id is recognisable in any log.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id_type {
    ($(#[doc = $doc:literal])* $name:ident, $prefix:literal) => {
        $(#[doc = $doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// The prefix every minted id of this kind starts with.
            pub const PREFIX: &'static str = $prefix;

            /// Mints a fresh random id.
            pub fn mint() -> Self {
                Self(format!("{}{}", $prefix, uuid::Uuid::new_v4().simple()))
            }

            /// Wraps an id read from storage or the wire, already checked by its input's bounds.
            pub fn from_raw(raw: impl Into<String>) -> Self {
                Self(raw.into())
            }

            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The id as an owned string.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

id_type!(
    /// A lease: `lse_…`, or an id the requester chose (`leaseId`). On a gateway,
    /// `<workerId>.<workerLeaseId>` unless the requester chose it.
    LeaseId,
    "lse_"
);
id_type!(
    /// A device: `dev_…`.
    DeviceId,
    "dev_"
);
id_type!(
    /// A lease request: `req_…`.
    RequestId,
    "req_"
);
id_type!(
    /// A token: `tok_…`; also the principal of every HTTP caller holding it.
    TokenId,
    "tok_"
);
id_type!(
    /// An event: `evt_…`, minted where the fact happened and kept when relayed.
    EventId,
    "evt_"
);
id_type!(
    /// An event subscription: `sub_…`.
    SubscriptionId,
    "sub_"
);

/// A worker: its instance id, written once to its home on first start.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(String);

impl WorkerId {
    /// A fresh instance id (a UUID).
    pub fn mint() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    /// Wraps an id read from storage or the wire, already checked by its bounds.
    pub fn from_raw(raw: impl Into<String>) -> Self {
        Self(raw.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for WorkerId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// The prefix a gateway puts on the requester ids it forwards: `gw:<gateway id>:`.
pub fn gateway_requester_prefix(gateway_id: &str) -> String {
    format!("gw:{gateway_id}:")
}

/// A requester id a gateway forwarded, split into the gateway's id and the requester it was
/// given ([`gateway_requester_prefix`]); `None` for any other requester.
pub fn split_gateway_requester(requester_id: &str) -> Option<(&str, &str)> {
    requester_id
        .strip_prefix("gw:")?
        .split_once(':')
        .filter(|(gateway, _)| !gateway.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gateways_requester_splits_back_into_its_parts() {
        let requester = format!("{}agent-7", gateway_requester_prefix("g1"));
        assert_eq!(split_gateway_requester(&requester), Some(("g1", "agent-7")));
        assert_eq!(split_gateway_requester("gw:g1:a:b"), Some(("g1", "a:b")));
        for other in ["agent-7", "gw:", "gw::x", "gw:g1", "GW:g1:x"] {
            assert_eq!(split_gateway_requester(other), None, "{other}");
        }
    }

    #[test]
    fn minted_ids_carry_their_prefix_and_differ() {
        let a = LeaseId::mint();
        let b = LeaseId::mint();
        assert!(a.as_str().starts_with("lse_"));
        assert_ne!(a, b);
        assert!(TokenId::mint().as_str().starts_with("tok_"));
        assert_eq!(
            serde_json::to_string(&DeviceId::from_raw("dev_1")).unwrap(),
            "\"dev_1\""
        );
    }
}
