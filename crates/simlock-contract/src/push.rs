//! Pushes: what a daemon tells a client outside a reply.
//!
//! Request-scoped pushes (`progress`, `started`, `output`, `relay-head`) carry `requestId`, the
//! frame id of their call, and reach only that call. Lease-scoped pushes (`lease-lost`,
//! `device-unhealthy`, `device-recovered`) reach the lease owner's connections. `event` reaches
//! the subscribed connection.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::frame::{FrameId, PushFrame};
use crate::ids::{DeviceId, SubscriptionId};
use crate::model::{EventEnvelope, LeaseEndReason};

/// Where a lease request is, for its `progress` pushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "stage", rename_all = "lowercase")]
pub enum Progress {
    /// Waiting in the queue.
    #[serde(rename_all = "camelCase")]
    Queued {
        /// 1-based place in the queue.
        queue_position: u32,
        /// Why no device can be had for it now, when the daemon can tell (a daemon before this
        /// field sends none; a gateway tells it when every worker that could serve it is full).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        waiting_for: Option<WaitingFor>,
    },
    /// A device is being created.
    #[serde(rename_all = "camelCase")]
    Provisioning {
        /// Expected time to finish.
        eta_ms: u64,
    },
    /// A device is starting.
    #[serde(rename_all = "camelCase")]
    Booting {
        /// Expected time to finish.
        eta_ms: u64,
    },
    /// A device is being wiped for this request.
    #[serde(rename_all = "camelCase")]
    Reclaiming {
        /// Expected time to finish.
        eta_ms: u64,
    },
}

impl Progress {
    /// Waiting at `queue_position`, for no reason told.
    pub const fn queued(queue_position: u32) -> Self {
        Self::Queued {
            queue_position,
            waiting_for: None,
        }
    }
}

/// Why a queued request gets no device now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "camelCase")]
pub enum WaitingFor {
    /// The platform's capacity is full with devices in use (leased, starting, being wiped): one
    /// must end first.
    Capacity,
    /// Quarantined devices hold the room a device for it needs: their wipe failed and is tried
    /// again at `retryAt` (ms since the epoch, the earliest of them); one that fails
    /// `quarantine.maxRetries` times is deleted, which frees its room.
    #[serde(rename_all = "camelCase")]
    Quarantine {
        /// When the first of them is wiped again.
        retry_at: i64,
    },
    /// Through a gateway: no worker that could serve it takes requests now (each is away, its
    /// uplink down; drained; or failed, its state store did). It waits for one to come back.
    NoWorker,
    /// A reason this side does not know (a newer daemon's): read, so that a client keeps
    /// following its request, and never sent.
    #[serde(other)]
    Unknown,
}

/// Which stream an `output` chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Why a leased device is unhealthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnhealthyReason {
    /// The device stopped running.
    Crashed,
}

/// Every push, typed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "push", content = "payload", rename_all = "kebab-case")]
pub enum Push {
    /// Lease request progress.
    #[serde(rename_all = "camelCase")]
    Progress {
        /// The call's frame id.
        request_id: FrameId,
        /// Where it is.
        progress: Progress,
    },
    /// `device.exec`: the process exists; output follows.
    #[serde(rename_all = "camelCase")]
    Started {
        /// The call's frame id.
        request_id: FrameId,
    },
    /// `device.exec` output, unsplit and unbuffered.
    #[serde(rename_all = "camelCase")]
    Output {
        /// The call's frame id.
        request_id: FrameId,
        /// Which stream.
        stream: OutputStream,
        /// The text.
        chunk: String,
    },
    /// A lease ended without its owner releasing it.
    #[serde(rename_all = "camelCase")]
    LeaseLost {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// Why.
        reason: LeaseEndReason,
    },
    /// A leased device crashed; simlock is recovering it.
    #[serde(rename_all = "camelCase")]
    DeviceUnhealthy {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// Why.
        reason: UnhealthyReason,
    },
    /// A leased device recovered.
    #[serde(rename_all = "camelCase")]
    DeviceRecovered {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// How many attempts it took.
        attempts: u32,
    },
    /// An event, for a subscribed connection.
    #[serde(rename_all = "camelCase")]
    Event {
        /// The subscription.
        subscription_id: SubscriptionId,
        /// The event.
        event: EventEnvelope,
    },
    /// The head of a relayed response; its body follows on the relay's channel.
    #[serde(rename_all = "camelCase")]
    RelayHead {
        /// The `relay.request` call's frame id.
        request_id: FrameId,
        /// The status, 100–599 but never 101.
        status: u16,
        /// Response headers, `[name, value]`.
        headers: Vec<(String, String)>,
    },
}

impl Push {
    /// The wire name of [`Push::Event`], the one push a gateway reads from a worker unasked.
    pub const EVENT: &'static str = "event";

    /// The keys a push's kind and payload take in its frame.
    const KEYS: crate::tagged::Keys = ["push", "payload"];

    /// The push kind's wire name.
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Progress { .. } => "progress",
            Self::Started { .. } => "started",
            Self::Output { .. } => "output",
            Self::LeaseLost { .. } => "lease-lost",
            Self::DeviceUnhealthy { .. } => "device-unhealthy",
            Self::DeviceRecovered { .. } => "device-recovered",
            Self::Event { .. } => Self::EVENT,
            Self::RelayHead { .. } => "relay-head",
        }
    }

    /// The frame id of the call a request-scoped push belongs to.
    pub const fn request_id(&self) -> Option<&FrameId> {
        match self {
            Self::Progress { request_id, .. }
            | Self::Started { request_id }
            | Self::Output { request_id, .. }
            | Self::RelayHead { request_id, .. } => Some(request_id),
            Self::LeaseLost { .. }
            | Self::DeviceUnhealthy { .. }
            | Self::DeviceRecovered { .. }
            | Self::Event { .. } => None,
        }
    }

    /// The push as a frame.
    ///
    /// # Errors
    /// Never for our types; kept fallible because serialisation is.
    pub fn to_frame(&self) -> Result<PushFrame, serde_json::Error> {
        serde_json::from_value(serde_json::to_value(self)?)
    }

    /// Reads a push frame back into its type, taking it: its payload is moved into the push,
    /// not copied.
    ///
    /// # Errors
    /// A message naming the kind when the kind is unknown or the payload breaks the push's
    /// schema (a `relay-head` status outside 100–599, or 101, included).
    pub fn from_frame(frame: PushFrame) -> Result<Self, String> {
        let PushFrame {
            push: kind,
            payload,
        } = frame;
        let push: Self = crate::tagged::read(Self::KEYS, &kind, payload)
            .map_err(|e| format!("invalid {kind} push: {e}"))?;
        if let Self::RelayHead { status, .. } = &push
            && (!(100..=599).contains(status) || *status == 101)
        {
            return Err(format!("invalid relay-head push: status {status}"));
        }
        Ok(push)
    }

    /// The payload alone.
    ///
    /// # Errors
    /// Never for our types.
    pub fn payload(&self) -> Result<Value, serde_json::Error> {
        Ok(self.to_frame()?.payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pushes_have_the_original_shape() {
        let push = Push::Progress {
            request_id: 7.into(),
            progress: Progress::queued(2),
        };
        assert_eq!(
            serde_json::to_value(&push).unwrap(),
            json!({"push": "progress", "payload": {"requestId": 7, "progress": {"stage": "queued", "queuePosition": 2}}})
        );
        let frame = push.to_frame().unwrap();
        assert_eq!(frame.push, "progress");
        assert_eq!(Push::from_frame(frame).unwrap(), push);
        for (waiting_for, json) in [
            (WaitingFor::Capacity, json!({"reason": "capacity"})),
            (
                WaitingFor::Quarantine { retry_at: 1_000 },
                json!({"reason": "quarantine", "retryAt": 1_000}),
            ),
            (WaitingFor::NoWorker, json!({"reason": "noWorker"})),
        ] {
            let progress = Progress::Queued {
                queue_position: 1,
                waiting_for: Some(waiting_for),
            };
            let value = serde_json::to_value(progress).unwrap();
            assert_eq!(
                value,
                json!({"stage": "queued", "queuePosition": 1, "waitingFor": json})
            );
            assert_eq!(serde_json::from_value::<Progress>(value).unwrap(), progress);
        }
    }

    #[test]
    fn a_relay_head_with_status_101_is_invalid() {
        let frame = PushFrame {
            push: "relay-head".into(),
            payload: json!({"requestId": 1, "status": 101, "headers": []}),
        };
        assert!(Push::from_frame(frame).is_err());
        let frame = PushFrame {
            push: "relay-head".into(),
            payload: json!({"requestId": 1, "status": 204, "headers": [["a", "b"]]}),
        };
        assert!(Push::from_frame(frame).is_ok());
    }

    /// A reason a newer daemon tells, which this side does not know, reads as `Unknown`: a
    /// client goes on following its request.
    #[test]
    fn an_unknown_reason_to_wait_reads_as_unknown() {
        let progress: Progress = serde_json::from_value(json!({
            "stage": "queued",
            "queuePosition": 3,
            "waitingFor": {"reason": "somethingNew", "extra": 1}
        }))
        .unwrap();
        assert_eq!(
            progress,
            Progress::Queued {
                queue_position: 3,
                waiting_for: Some(WaitingFor::Unknown)
            }
        );
    }
}
