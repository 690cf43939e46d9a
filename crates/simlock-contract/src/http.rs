//! Shapes only the HTTP API carries: a lease request as a resource (`/v1/lease-requests`).
//! Errors inside them use the HTTP form, details inlined (`ErrorBody::to_inline`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::error::{ContractError, ErrorBody, ErrorCode};
use crate::ids::RequestId;
use crate::model::LeaseGrant;
use crate::push::Progress;

/// Where a lease request made over HTTP is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestState {
    /// Recorded; nothing reported yet.
    Pending,
    /// In the queue.
    Queued,
    /// A device is being created.
    Provisioning,
    /// A device is booting.
    Booting,
    /// A device is being wiped for it.
    Reclaiming,
    /// Granted: `lease` holds the grant.
    Granted,
    /// Failed: `error` says why.
    Failed,
    /// Cancelled by its owner.
    Cancelled,
    /// A state this side does not know (a newer daemon): still working.
    #[serde(other)]
    Unknown,
}

impl RequestState {
    /// Whether the request is over.
    pub const fn is_settled(self) -> bool {
        matches!(self, Self::Granted | Self::Failed | Self::Cancelled)
    }

    /// The state's name (the SSE event name).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Queued => "queued",
            Self::Provisioning => "provisioning",
            Self::Booting => "booting",
            Self::Reclaiming => "reclaiming",
            Self::Granted => "granted",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Unknown => "unknown",
        }
    }
}

/// A lease request as HTTP shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestView {
    /// Its id.
    pub id: RequestId,
    /// Where it is.
    pub state: RequestState,
    /// Its place in the queue, while queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<u32>,
    /// Expected seconds until the current stage ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<u64>,
    /// When it was made, ms since the epoch.
    pub created_at: i64,
    /// The grant, once granted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseGrant>,
    /// Why it failed, in the HTTP error form (details inlined).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "inline_error"
    )]
    pub error: Option<ErrorBody>,
}

impl RequestView {
    /// The progress a working request reports, as the `progress` push would.
    pub fn progress(&self) -> Option<Progress> {
        let eta_ms = self.eta_seconds.unwrap_or(0).saturating_mul(1000);
        match self.state {
            RequestState::Queued => Some(Progress::Queued {
                queue_position: self.queue_position.unwrap_or(0),
            }),
            RequestState::Provisioning => Some(Progress::Provisioning { eta_ms }),
            RequestState::Booting => Some(Progress::Booting { eta_ms }),
            RequestState::Reclaiming => Some(Progress::Reclaiming { eta_ms }),
            RequestState::Pending
            | RequestState::Granted
            | RequestState::Failed
            | RequestState::Cancelled
            | RequestState::Unknown => None,
        }
    }

    /// The outcome of a settled request, as `lease.request` would have answered it.
    pub fn outcome(&self) -> Option<Result<LeaseGrant, ContractError>> {
        let failure = |fallback: ContractError| {
            self.error
                .clone()
                .map_or(fallback, ContractError::from_body)
        };
        match self.state {
            RequestState::Granted => Some(self.lease.clone().ok_or_else(|| {
                ContractError::internal("a granted lease request without its lease")
            })),
            RequestState::Failed => Some(Err(failure(ContractError::internal(
                "the lease request failed",
            )))),
            RequestState::Cancelled => Some(Err(failure(ContractError::new(
                ErrorCode::Cancelled,
                "The lease request was cancelled",
            )))),
            RequestState::Pending
            | RequestState::Queued
            | RequestState::Provisioning
            | RequestState::Booting
            | RequestState::Reclaiming
            | RequestState::Unknown => None,
        }
    }
}

/// (De)serialises an optional error in the HTTP form.
mod inline_error {
    use super::*;

    #[allow(
        clippy::ref_option,
        reason = "serde's `with` passes the field by reference"
    )]
    pub(super) fn serialize<S: Serializer>(
        error: &Option<ErrorBody>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        error
            .as_ref()
            .map(ErrorBody::to_inline)
            .serialize(serializer)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<ErrorBody>, D::Error> {
        Ok(Option::<Value>::deserialize(deserializer)?
            .as_ref()
            .and_then(ErrorBody::from_inline))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_failed_view_round_trips_with_its_error_inlined() {
        let view = RequestView {
            id: RequestId::from_raw("req_1"),
            state: RequestState::Failed,
            queue_position: None,
            eta_seconds: None,
            created_at: 5,
            lease: None,
            error: Some(ContractError::unknown_lease("lse_1").to_body()),
        };
        let value = serde_json::to_value(&view).unwrap();
        assert_eq!(
            value["error"],
            json!({"code": "UNKNOWN_LEASE", "message": "Unknown lease lse_1", "leaseId": "lse_1"})
        );
        let back: RequestView = serde_json::from_value(value).unwrap();
        assert_eq!(back, view);
        assert_eq!(
            back.outcome().unwrap().unwrap_err().code,
            ErrorCode::UnknownLease
        );
    }

    #[test]
    fn working_states_report_progress_and_unknown_states_read_as_working() {
        let view: RequestView = serde_json::from_value(
            json!({"id": "req_1", "state": "queued", "queuePosition": 3, "createdAt": 1}),
        )
        .unwrap();
        assert_eq!(
            view.progress(),
            Some(Progress::Queued { queue_position: 3 })
        );
        assert_eq!(view.outcome(), None);
        let view: RequestView =
            serde_json::from_value(json!({"id": "req_1", "state": "downloading", "createdAt": 1}))
                .unwrap();
        assert_eq!(view.state, RequestState::Unknown);
        assert_eq!((view.progress(), view.outcome()), (None, None));
    }
}
