//! Shapes only the HTTP API carries: a lease request as a resource (`/v1/lease-requests`).
//! Errors inside them use the HTTP form, details inlined (`ErrorBody::to_inline`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::decode::{check_input, parse};
use crate::error::{ContractError, ErrorBody, ErrorCode};
use crate::ids::RequestId;
use crate::model::{LeaseGrant, Platform};
use crate::ops::LeaseRequestInput;
use crate::push::{Progress, WaitingFor};

/// The body of `POST /v1/lease-requests`: `lease.request`'s input under the HTTP API's names,
/// `device` for the model and `os` for the OS version; its idempotency key travels in the
/// `Idempotency-Key` header, and `owner` has no HTTP form. Unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseRequestBody {
    /// The platform.
    pub platform: Platform,
    /// A model name or alias (`lease.request`'s `model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// An exact OS version (`lease.request`'s `osVersion`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os: Option<String>,
    /// The lease's width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// How long to wait in the queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Refuse with `NO_CAPACITY` instead of waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_wait: Option<bool>,
    /// Capabilities the serving worker must have available.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
    /// The id the lease must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    /// Who the lease is for; defaults to the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester_id: Option<String>,
}

impl LeaseRequestBody {
    /// The body that asks for `input` (its idempotency key goes in the header).
    pub fn of(input: &LeaseRequestInput) -> Self {
        Self {
            platform: input.platform,
            device: input.model.clone(),
            os: input.os_version.clone(),
            ttl_ms: input.ttl_ms,
            timeout_ms: input.timeout_ms,
            no_wait: input.no_wait,
            requires: input.requires.clone(),
            lease_id: input.lease_id.clone(),
            requester_id: input.requester_id.clone(),
        }
    }

    /// Reads a request's body and its `Idempotency-Key` as `lease.request`'s input, with
    /// `lease.request`'s bounds; every problem names the body's key (`device`, not `model`).
    ///
    /// # Errors
    /// `BAD_REQUEST` naming the key: unknown, of the wrong type, or out of its bounds.
    pub fn decode(
        value: Value,
        idempotency_key: Option<String>,
    ) -> Result<LeaseRequestInput, ContractError> {
        let body: Self = parse(value)?;
        let input = body.into_input(idempotency_key);
        check_input(&input, |field| match field {
            "model" => "device",
            "osVersion" => "os",
            "idempotencyKey" => "Idempotency-Key",
            other => other,
        })?;
        Ok(input)
    }

    /// `lease.request`'s input: this body with `idempotency_key`.
    pub fn into_input(self, idempotency_key: Option<String>) -> LeaseRequestInput {
        LeaseRequestInput {
            platform: self.platform,
            model: self.device,
            os_version: self.os,
            requester_id: self.requester_id,
            no_wait: self.no_wait,
            timeout_ms: self.timeout_ms,
            ttl_ms: self.ttl_ms,
            idempotency_key,
            owner: None,
            lease_id: self.lease_id,
            requires: self.requires,
        }
    }
}

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
    /// Why it gets no device now, while queued, when the daemon can tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<WaitingFor>,
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
    /// Moves to `state`, dropping what that state does not carry: `queuePosition` outside
    /// `queued`, `etaSeconds` outside `provisioning`, `booting` and `reclaiming`.
    pub fn enter(&mut self, state: RequestState) {
        self.state = state;
        if state != RequestState::Queued {
            self.queue_position = None;
            self.waiting_for = None;
        }
        if !matches!(
            state,
            RequestState::Provisioning | RequestState::Booting | RequestState::Reclaiming
        ) {
            self.eta_seconds = None;
        }
    }

    /// The progress a working request reports, as the `progress` push would.
    pub fn progress(&self) -> Option<Progress> {
        let eta_ms = self.eta_seconds.unwrap_or(0).saturating_mul(1000);
        match self.state {
            RequestState::Queued => Some(Progress::Queued {
                queue_position: self.queue_position.unwrap_or(0),
                waiting_for: self.waiting_for,
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
    fn a_view_carries_only_what_its_state_does() {
        let mut view: RequestView = serde_json::from_value(json!({
            "id": "req_1", "state": "queued", "queuePosition": 1, "createdAt": 0
        }))
        .unwrap();
        view.enter(RequestState::Cancelled);
        assert_eq!(
            serde_json::to_value(&view).unwrap(),
            json!({"id": "req_1", "state": "cancelled", "createdAt": 0})
        );
        view.eta_seconds = Some(3);
        view.enter(RequestState::Booting);
        assert_eq!(view.eta_seconds, Some(3));
        view.enter(RequestState::Queued);
        assert_eq!(view.eta_seconds, None);
    }

    #[test]
    fn a_failed_view_round_trips_with_its_error_inlined() {
        let view = RequestView {
            id: RequestId::from_raw("req_1"),
            state: RequestState::Failed,
            queue_position: None,
            waiting_for: None,
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
        assert_eq!(view.progress(), Some(Progress::queued(3)));
        assert_eq!(view.outcome(), None);
        let view: RequestView =
            serde_json::from_value(json!({"id": "req_1", "state": "downloading", "createdAt": 1}))
                .unwrap();
        assert_eq!(view.state, RequestState::Unknown);
        assert_eq!((view.progress(), view.outcome()), (None, None));
    }

    fn refused(body: Value, key: Option<&str>) -> String {
        let err = LeaseRequestBody::decode(body, key.map(String::from)).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        err.message
    }

    #[test]
    fn a_lease_request_body_names_its_own_keys_in_every_refusal() {
        let wrong_type = refused(json!({"platform": "ios", "device": 5}), None);
        assert!(
            wrong_type.starts_with("device: invalid type"),
            "{wrong_type}"
        );
        let too_short = refused(json!({"platform": "ios", "os": ""}), None);
        assert_eq!(too_short, "os: length is lower than 1");
        let long = "m".repeat(crate::bounds::MAX_MODEL + 1);
        let too_long = refused(json!({"platform": "ios", "device": long}), None);
        assert!(
            too_long.starts_with("device: length is greater than"),
            "{too_long}"
        );
        let key = "k".repeat(crate::bounds::MAX_IDEMPOTENCY_KEY + 1);
        let key = refused(json!({"platform": "ios"}), Some(&key));
        assert!(key.starts_with("Idempotency-Key: length"), "{key}");
        let unknown = refused(json!({"platform": "ios", "model": "iPhone 16"}), None);
        assert!(
            unknown
                .starts_with("model: unknown field `model`, expected one of `platform`, `device`"),
            "{unknown}"
        );
        let missing = refused(json!({"device": "iPhone 16"}), None);
        assert_eq!(missing, "missing field `platform`");
        // Fields that keep their names still name them.
        let ttl = refused(json!({"platform": "ios", "ttlMs": 0}), None);
        assert!(ttl.starts_with("ttlMs: "), "{ttl}");
    }

    #[test]
    fn a_lease_request_body_carries_every_field_of_its_input_but_the_owner() {
        let mut input = LeaseRequestInput::for_platform(Platform::Android);
        input.model = Some("Pixel 9".into());
        input.os_version = Some("35".into());
        input.ttl_ms = Some(60_000);
        input.timeout_ms = Some(5_000);
        input.no_wait = Some(true);
        input.requires = vec!["agent-device".into()];
        input.lease_id = Some("0123456789abcdef0123456789abcdef".into());
        input.requester_id = Some("ci-7".into());
        input.idempotency_key = Some("k1".into());
        let body = serde_json::to_value(LeaseRequestBody::of(&input)).unwrap();
        assert_eq!(body["device"], "Pixel 9");
        assert_eq!(body["os"], "35");
        assert!(body.get("idempotencyKey").is_none(), "the key is a header");
        let back = LeaseRequestBody::decode(body, Some("k1".into())).unwrap();
        assert_eq!(back, input);
    }
}
