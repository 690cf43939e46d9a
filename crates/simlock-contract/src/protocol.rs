//! The handshake: `hello` with a protocol range, and its negotiation.

use garde::Validate;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{ContractError, ErrorCode};

/// The range of protocol versions this build speaks. Every breaking change to the contract bumps it.
pub const PROTOCOL_RANGE: ProtocolRange = ProtocolRange { min: 2, max: 2 };

/// An inclusive range of protocol versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Validate)]
pub struct ProtocolRange {
    /// The lowest version spoken.
    #[garde(range(min = 1))]
    pub min: u32,
    /// The highest version spoken.
    #[garde(range(min = 1))]
    pub max: u32,
}

impl ProtocolRange {
    /// A range holding one version.
    pub const fn exactly(version: u32) -> Self {
        Self {
            min: version,
            max: version,
        }
    }

    /// The highest version both ranges hold, if they overlap.
    pub fn negotiate(self, other: Self) -> Option<u32> {
        let low = self.min.max(other.min);
        let high = self.max.min(other.max);
        (low <= high).then_some(high)
    }
}

/// The input of `hello`, the first call on every connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct Hello {
    /// The client's own version, for logs.
    #[garde(inner(length(chars, min = 1, max = 64), custom(crate::bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_version: Option<String>,
    /// A single protocol version (same as a range of one).
    #[garde(inner(range(min = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<u32>,
    /// The range of versions the client speaks; preferred over `protocolVersion`.
    #[garde(dive)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_range: Option<ProtocolRange>,
    /// Who the client says it is (socket only; HTTP principals come from tokens).
    #[garde(inner(length(chars, min = 1, max = 256), custom(crate::bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// An operator token's secret, asking for the admin role.
    #[garde(inner(length(min = 1, max = 512)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
}

impl Hello {
    /// The range the client asked for: `protocolRange`, else `{n, n}` for `protocolVersion`.
    ///
    /// # Errors
    /// `BAD_REQUEST` when neither is given, or the range is inverted.
    pub fn client_range(&self) -> Result<ProtocolRange, ContractError> {
        let range = match (self.protocol_range, self.protocol_version) {
            (Some(range), _) => range,
            (None, Some(version)) => ProtocolRange::exactly(version),
            (None, None) => {
                return Err(ContractError::bad_request(
                    "protocolVersion or protocolRange is required",
                ));
            }
        };
        if range.min > range.max {
            return Err(ContractError::bad_request(
                "protocolRange: min is greater than max",
            ));
        }
        Ok(range)
    }
}

/// The session roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// An agent: leases for itself.
    Agent,
    /// An operator, the gateway on an uplink, or the holder of the admin secret.
    Admin,
}

impl Role {
    /// Whether this role may run an operation that requires `needed`.
    pub const fn allows(self, needed: Self) -> bool {
        matches!(
            (self, needed),
            (Self::Admin, _) | (Self::Agent, Self::Agent)
        )
    }

    /// The role's wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Admin => "admin",
        }
    }
}

/// The result of `hello`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HelloReply {
    /// The version both sides speak from now on.
    pub protocol_version: u32,
    /// The daemon's range.
    pub daemon_protocol_range: ProtocolRange,
    /// The daemon's own version.
    pub version: String,
    /// The session's role.
    pub role: Role,
    /// The session's principal.
    pub principal: String,
}

/// `PROTOCOL_VERSION_UNSUPPORTED` with both ranges, as every later call on the connection answers.
pub fn version_unsupported(
    client: ProtocolRange,
    daemon: ProtocolRange,
    daemon_version: &str,
) -> ContractError {
    ContractError::new(
        ErrorCode::ProtocolVersionUnsupported,
        format!(
            "Protocol version mismatch: client speaks {}..{}, daemon speaks {}..{}",
            client.min, client.max, daemon.min, daemon.max
        ),
    )
    .with_details(json!({ "client": client, "daemon": daemon, "daemonVersion": daemon_version }))
}

/// Reads the two ranges back out of a `PROTOCOL_VERSION_UNSUPPORTED` error's details.
pub fn unsupported_ranges(details: Option<&Value>) -> Option<(ProtocolRange, ProtocolRange)> {
    let details = details?;
    let client = serde_json::from_value(details.get("client")?.clone()).ok()?;
    let daemon = serde_json::from_value(details.get("daemon")?.clone()).ok()?;
    Some((client, daemon))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_picks_the_highest_common_version() {
        let a = ProtocolRange { min: 1, max: 3 };
        assert_eq!(a.negotiate(ProtocolRange { min: 2, max: 5 }), Some(3));
        assert_eq!(a.negotiate(ProtocolRange::exactly(1)), Some(1));
        assert_eq!(a.negotiate(ProtocolRange { min: 4, max: 5 }), None);
    }

    #[test]
    fn the_client_range_prefers_protocol_range() {
        let hello = Hello {
            client_version: None,
            protocol_version: Some(9),
            protocol_range: Some(ProtocolRange { min: 1, max: 2 }),
            principal: None,
            credential: None,
        };
        assert_eq!(
            hello.client_range().unwrap(),
            ProtocolRange { min: 1, max: 2 }
        );
        let bare = Hello {
            protocol_range: None,
            ..hello.clone()
        };
        assert_eq!(bare.client_range().unwrap(), ProtocolRange::exactly(9));
        let neither = Hello {
            protocol_range: None,
            protocol_version: None,
            ..hello
        };
        assert_eq!(
            neither.client_range().unwrap_err().code,
            ErrorCode::BadRequest
        );
    }

    #[test]
    fn roles_order_agent_below_admin() {
        assert!(Role::Admin.allows(Role::Agent));
        assert!(Role::Admin.allows(Role::Admin));
        assert!(Role::Agent.allows(Role::Agent));
        assert!(!Role::Agent.allows(Role::Admin));
    }
}
