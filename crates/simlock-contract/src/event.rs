//! The events daemons record on their bus (`events.subscribe`, `events.replay`,
//! `/v1/events/stream`): every event's name, the module that records it and its payload, typed.
//!
//! [`Event`] is one variant per name; its payload is the variant's fields, spelled on the wire as
//! [`EventEnvelope::payload`] carries them. [`Event::parts`] splits an event into the name and the
//! payload an envelope holds; [`Event::from_envelope`] reads an envelope back (a gateway reads its
//! workers' events this way). An envelope of a name this build does not know reads as `None`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{DeviceId, RequestId};
use crate::model::{DeviceSpec, EventEnvelope, LeaseEndReason, Mode, Platform, RequestedDevice};
use crate::push::UnhealthyReason;

/// The module that records an event ([`EventEnvelope::module`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventModule {
    /// The daemon itself: start, stop, and a worker's store failure.
    Daemon,
    /// A worker's leases and its queue.
    LeaseLifecycle,
    /// A worker's devices.
    Devices,
    /// A gateway's fleet: its queue, routing and workers.
    Fleet,
    /// A worker's capabilities (`status.get`'s `capabilities`).
    Capabilities,
}

impl EventModule {
    /// The module's name on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Daemon => "daemon",
            Self::LeaseLifecycle => "lease-lifecycle",
            Self::Devices => "devices",
            Self::Fleet => "fleet",
            Self::Capabilities => "capabilities",
        }
    }
}

/// Whether a lease request waits in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WaitPolicy {
    /// It waits for a device.
    Wait,
    /// `noWait`: refused when nothing is free now.
    NoWait,
}

impl WaitPolicy {
    /// The policy of a request whose `noWait` is `no_wait`.
    pub const fn of(no_wait: bool) -> Self {
        if no_wait { Self::NoWait } else { Self::Wait }
    }
}

/// Why a lease request ended without a lease (`lease.rejected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RejectionReason {
    /// `noWait` and nothing free.
    NoWait,
    /// The requester holds a lease or has a pending request.
    AlreadyLeased,
    /// The chosen lease id is held.
    LeaseIdTaken,
    /// The request waited past its timeout.
    Timeout,
    /// The worker's device work failed, or the worker was lost.
    WorkerFailed,
    /// Its requester cancelled it.
    Cancelled,
    /// The worker restarted while it waited.
    DaemonRestarted,
    /// A gateway had no worker to take it.
    NoWorker,
    /// A gateway stopped while it waited.
    Killed,
    /// No worker known to a gateway can serve its spec.
    UnresolvableSpec,
    /// The queue held `lease.maxWaiting` requests already.
    QueueFull,
}

impl RejectionReason {
    /// Every reason.
    pub const ALL: [Self; 11] = [
        Self::NoWait,
        Self::AlreadyLeased,
        Self::LeaseIdTaken,
        Self::Timeout,
        Self::WorkerFailed,
        Self::Cancelled,
        Self::DaemonRestarted,
        Self::NoWorker,
        Self::Killed,
        Self::UnresolvableSpec,
        Self::QueueFull,
    ];

    /// As the wire spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NoWait => "no-wait",
            Self::AlreadyLeased => "already-leased",
            Self::LeaseIdTaken => "lease-id-taken",
            Self::Timeout => "timeout",
            Self::WorkerFailed => "worker-failed",
            Self::Cancelled => "cancelled",
            Self::DaemonRestarted => "daemon-restarted",
            Self::NoWorker => "no-worker",
            Self::Killed => "killed",
            Self::UnresolvableSpec => "unresolvable-spec",
            Self::QueueFull => "queue-full",
        }
    }
}

/// How a granted device came to be ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GrantSource {
    /// It was ready and idle.
    Warm,
    /// It was booted for the request.
    Booted,
    /// It was created and booted for the request.
    Provisioned,
}

/// Why a gateway routed a request to the worker it chose (`request.dispatched`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DispatchReason {
    /// The worker had a ready device that fits.
    WarmHit,
    /// The worker had the most free capacity.
    FreeCapacity,
}

/// The routing stage that decided a dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DispatchStage {
    /// A ready device fits.
    WarmHit,
    /// Only slots held by idle devices were left.
    FreeSlot,
    /// The most free slots for the platform.
    FreeCapacity,
}

/// Why a gateway forgot a worker (`worker.removed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkerRemovedReason {
    /// An operator removed it.
    Operator,
    /// It stayed disconnected past `gateway.disconnectedRetentionMs`.
    Retention,
}

/// Why a gateway refused an uplink (`worker.rejected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UplinkRejection {
    /// No join token, or an unknown one.
    Unauthenticated,
    /// A valid token of another role.
    Forbidden,
}

/// Which device `device.crash-detected` names: its payload holds `leaseId` for a leased device
/// (`null` when none), `spec` for a free one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, rename_all_fields = "camelCase")]
pub enum CrashedDevice {
    /// A free ready device, with what it is.
    Free {
        /// What it is.
        spec: DeviceSpec,
    },
    /// A leased device, with its lease.
    Leased {
        /// Its lease (`null` when none).
        lease_id: Option<String>,
    },
}

/// One event, by name, with its payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", content = "payload", rename_all_fields = "camelCase")]
pub enum Event {
    /// The daemon serves.
    #[serde(rename = "daemon.started")]
    DaemonStarted {
        /// Its version.
        version: String,
        /// Worker or gateway.
        mode: Mode,
    },
    /// The daemon began stopping.
    #[serde(rename = "daemon.stopping")]
    DaemonStopping {
        /// Why (a signal, `daemon.stop`).
        reason: String,
    },
    /// A worker could not store a decision (a full disk) and decides nothing more until it is
    /// restarted: its health is `failed`.
    #[serde(rename = "daemon.failed")]
    DaemonFailed {
        /// The store's error.
        error: String,
    },
    /// A lease request was admitted.
    #[serde(rename = "lease.requested")]
    LeaseRequested {
        /// The request.
        request_id: RequestId,
        /// What it asks for.
        request_spec: RequestedDevice,
        /// Its requester.
        requester: String,
        /// Whether it waits.
        wait_policy: WaitPolicy,
    },
    /// A lease request waits in the queue.
    #[serde(rename = "lease.queued")]
    LeaseQueued {
        /// The request.
        request_id: RequestId,
        /// Its place, from 1.
        queue_position: u32,
    },
    /// A lease request ended without a lease.
    #[serde(rename = "lease.rejected")]
    LeaseRejected {
        /// The request (`null` when it was refused before it was recorded).
        request_id: Option<RequestId>,
        /// Its requester.
        requester: String,
        /// What it asked for.
        request_spec: RequestedDevice,
        /// Why.
        reason: RejectionReason,
        /// On a gateway, the worker that failed it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker_id: Option<String>,
    },
    /// A lease was granted.
    #[serde(rename = "lease.granted")]
    LeaseGranted {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// Its requester.
        requester: String,
        /// Its owner.
        owner_id: String,
        /// The request it answers.
        request_id: RequestId,
        /// How the device came to be ready.
        source: GrantSource,
    },
    /// A lease was renewed.
    #[serde(rename = "lease.renewed")]
    LeaseRenewed {
        /// The lease.
        lease_id: String,
        /// Its new deadline, ms since the epoch.
        new_deadline: i64,
        /// Its width after the renewal (a renewal may set a new one); absent from workers
        /// before this field.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ttl_ms: Option<u64>,
    },
    /// A lease ended before its deadline (released, killed, its device lost).
    #[serde(rename = "lease.released")]
    LeaseReleased {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// Its owner (empty when a sender left it out).
        #[serde(default)]
        owner_id: String,
        /// Why it ended (`explicit` when a sender left it out).
        #[serde(default = "explicit")]
        reason: LeaseEndReason,
    },
    /// A lease's deadline passed.
    #[serde(rename = "lease.expired")]
    LeaseExpired {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// Its owner (empty when a sender left it out).
        #[serde(default)]
        owner_id: String,
    },
    /// The number of waiting requests changed.
    #[serde(rename = "queue.changed")]
    QueueChanged {
        /// How many wait now.
        depth: u32,
    },
    /// A device was created.
    #[serde(rename = "device.provisioned")]
    DeviceProvisioned {
        /// The device.
        device_id: DeviceId,
        /// What it is.
        spec: DeviceSpec,
        /// The driver's id for it.
        driver_device_id: String,
    },
    /// A device booted and is ready.
    #[serde(rename = "device.ready")]
    DeviceReady {
        /// The device.
        device_id: DeviceId,
        /// What it is.
        spec: DeviceSpec,
    },
    /// A device was wiped after a lease and is ready.
    #[serde(rename = "device.reclaimed")]
    DeviceReclaimed {
        /// The device.
        device_id: DeviceId,
        /// What it is.
        spec: DeviceSpec,
    },
    /// A device was shut down.
    #[serde(rename = "device.shutdown")]
    DeviceShutdown {
        /// The device.
        device_id: DeviceId,
        /// What it is.
        spec: DeviceSpec,
    },
    /// A device was destroyed.
    #[serde(rename = "device.deleted")]
    DeviceDeleted {
        /// The device.
        device_id: DeviceId,
        /// What it was.
        spec: DeviceSpec,
    },
    /// A device was seen stopped by its driver: a leased one crashed (its holder hears
    /// `device-unhealthy` and its recovery starts), a free ready one is marked shut down.
    #[serde(rename = "device.crash-detected")]
    DeviceCrashDetected {
        /// The device.
        device_id: DeviceId,
        /// Which device it was: a leased one with its lease, or a free one with its spec.
        #[serde(flatten)]
        seen: CrashedDevice,
        /// Why it counts as unhealthy.
        reason: UnhealthyReason,
    },
    /// A crashed leased device was booted again under its lease.
    #[serde(rename = "device.recovered")]
    DeviceRecovered {
        /// The device.
        device_id: DeviceId,
        /// Its lease.
        lease_id: String,
        /// The recovery attempts it took.
        attempts: u32,
    },
    /// A recovery of a crashed device failed; another follows after a backoff.
    #[serde(rename = "device.recovery-attempt-failed")]
    DeviceRecoveryAttemptFailed {
        /// The device.
        device_id: DeviceId,
        /// Its lease (`null` when none).
        lease_id: Option<String>,
        /// The attempts so far.
        attempts: u32,
        /// The driver's error.
        error: String,
    },
    /// The last recovery of a crashed device failed: it is deleted and its lease ends.
    #[serde(rename = "device.recovery-failed")]
    DeviceRecoveryFailed {
        /// The device.
        device_id: DeviceId,
        /// Its lease (`null` when none).
        lease_id: Option<String>,
        /// The attempts made.
        attempts: u32,
        /// The driver's error.
        error: String,
    },
    /// A device that could not be wiped was quarantined until its next retry.
    #[serde(rename = "device.quarantined")]
    DeviceQuarantined {
        /// The device.
        device_id: DeviceId,
        /// The reclaims that failed so far.
        attempts: u32,
        /// When its reclaim is retried, ms since the epoch.
        next_retry_at: i64,
        /// The driver's error.
        error: String,
    },
    /// A quarantined device was wiped after all and is ready.
    #[serde(rename = "device.quarantine-recovered")]
    DeviceQuarantineRecovered {
        /// The device.
        device_id: DeviceId,
        /// The reclaims that had failed.
        attempts: u32,
    },
    /// A quarantined device failed past `quarantine.maxRetries` and is deleted.
    #[serde(rename = "device.quarantine-abandoned")]
    DeviceQuarantineAbandoned {
        /// The device.
        device_id: DeviceId,
        /// The reclaims that failed.
        attempts: u32,
        /// The last error.
        error: String,
    },
    /// After a restart, the driver deleted a device the registry did not know.
    #[serde(rename = "device.orphan-purged")]
    DeviceOrphanPurged {
        /// Its platform.
        platform: Platform,
        /// The driver's id for it.
        driver_device_id: String,
    },
    /// After a restart, a driver's sweep of what the registry did not know ended.
    #[serde(rename = "driver.swept")]
    DriverSwept {
        /// The driver's platform.
        platform: Platform,
        /// How many devices it deleted.
        purged: usize,
    },
    /// After a restart, a driver's sweep failed.
    #[serde(rename = "device.sweep-failed")]
    DeviceSweepFailed {
        /// The driver's platform.
        platform: Platform,
        /// The driver's error.
        error: String,
    },
    /// A capability a module reports live became available or unavailable, or its reason
    /// changed (a worker's `agent-device` when its daemon starts or goes down).
    #[serde(rename = "capability.changed")]
    CapabilityChanged {
        /// The capability's name.
        name: String,
        /// Whether it is available now.
        available: bool,
        /// Why not, when it is not.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// A gateway forwarded a request to a worker.
    #[serde(rename = "request.dispatched")]
    RequestDispatched {
        /// The request.
        request_id: RequestId,
        /// The worker.
        worker_id: String,
        /// Its requester.
        requester_id: String,
        /// Its platform.
        platform: Platform,
        /// The worker's name for the model asked for, if one was.
        model: Option<String>,
        /// Why that worker.
        reason: DispatchReason,
        /// The routing stage that decided.
        stage: DispatchStage,
        /// How long it waited at the gateway, ms.
        queued_ms: i64,
    },
    /// A worker granted a request a gateway forwarded.
    #[serde(rename = "request.granted")]
    RequestGranted {
        /// The request.
        request_id: RequestId,
        /// The worker.
        worker_id: String,
        /// The gateway's id for the lease.
        lease_id: String,
        /// The worker's id for it.
        worker_lease_id: String,
    },
    /// A worker's uplink came up and its handshake passed.
    #[serde(rename = "worker.connected")]
    WorkerConnected {
        /// The worker.
        worker_id: String,
        /// Its label.
        label: Option<String>,
        /// Its version.
        version: String,
    },
    /// A connected worker's uplink went down.
    #[serde(rename = "worker.disconnected")]
    WorkerDisconnected {
        /// The worker.
        worker_id: String,
        /// Its label.
        label: Option<String>,
        /// How many leases its view listed.
        lease_count: usize,
    },
    /// A worker was drained.
    #[serde(rename = "worker.drain-started")]
    WorkerDrainStarted {
        /// The worker.
        worker_id: String,
    },
    /// A worker was undrained.
    #[serde(rename = "worker.drain-ended")]
    WorkerDrainEnded {
        /// The worker.
        worker_id: String,
    },
    /// A gateway forgot a worker.
    #[serde(rename = "worker.removed")]
    WorkerRemoved {
        /// The worker.
        worker_id: String,
        /// Its label.
        label: Option<String>,
        /// Why.
        reason: WorkerRemovedReason,
    },
    /// A gateway refused an uplink.
    #[serde(rename = "worker.rejected")]
    WorkerRejected {
        /// Why.
        reason: UplinkRejection,
        /// The worker id it named, if any.
        worker_id: Option<String>,
        /// The label it named, if any.
        label: Option<String>,
    },
}

const fn explicit() -> LeaseEndReason {
    LeaseEndReason::Explicit
}

impl Event {
    /// Why a lease request or a lease ended, for the events that say so (`lease.rejected`,
    /// `lease.released`), as the wire spells it: a closed set, so metrics may label by it.
    pub const fn reason(&self) -> Option<&'static str> {
        match self {
            Self::LeaseRejected { reason, .. } => Some(reason.as_str()),
            Self::LeaseReleased { reason, .. } => Some(reason.as_str()),
            _ => None,
        }
    }

    /// The event's name and its payload, as an [`EventEnvelope`] carries them.
    pub fn parts(&self) -> (String, Value) {
        match serde_json::to_value(self) {
            Ok(Value::Object(mut fields)) => {
                let name = match fields.remove("event") {
                    Some(Value::String(name)) => name,
                    _ => String::new(),
                };
                (name, fields.remove("payload").unwrap_or(Value::Null))
            }
            // An adjacently tagged enum of plain fields always serializes to an object.
            _ => (String::new(), Value::Null),
        }
    }

    /// The event an envelope holds, if its name is one this build knows and its payload has
    /// that event's fields (more fields are ignored). The payload is read in place, not copied.
    pub fn from_envelope(envelope: &EventEnvelope) -> Option<Self> {
        crate::tagged::read(Self::KEYS, &envelope.event, &envelope.payload).ok()
    }

    /// The keys an event's name and payload take in its serialised form.
    const KEYS: crate::tagged::Keys = ["event", "payload"];
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::ids::EventId;

    fn envelope(name: &str, payload: Value) -> EventEnvelope {
        EventEnvelope {
            id: EventId::from_raw("evt_1"),
            seq: 1,
            timestamp: 5,
            event: name.into(),
            payload,
            module: "lease-lifecycle".into(),
        }
    }

    #[test]
    fn an_event_is_its_name_and_camel_case_payload() {
        let event = Event::LeaseRenewed {
            lease_id: "lse_1".into(),
            new_deadline: 42,
            ttl_ms: Some(40),
        };
        assert_eq!(
            event.parts(),
            (
                "lease.renewed".to_owned(),
                json!({"leaseId": "lse_1", "newDeadline": 42, "ttlMs": 40})
            )
        );
        let rejected = Event::LeaseRejected {
            request_id: None,
            requester: "a".into(),
            request_spec: RequestedDevice {
                platform: Platform::Ios,
                model: None,
                os_version: None,
                requires: Vec::new(),
            },
            reason: RejectionReason::AlreadyLeased,
            worker_id: None,
        };
        let (name, payload) = rejected.parts();
        assert_eq!(name, "lease.rejected");
        assert_eq!(
            payload["requestId"],
            Value::Null,
            "an absent request is null"
        );
        assert_eq!(payload["reason"], "already-leased");
        assert!(payload.get("workerId").is_none(), "no worker, no field");
        assert_eq!(rejected.reason(), Some("already-leased"));
        assert_eq!(event.reason(), None, "a renewal has no reason");
        let released = Event::LeaseReleased {
            lease_id: "lse_1".into(),
            device_id: DeviceId::from_raw("dev_1"),
            owner_id: "o".into(),
            reason: LeaseEndReason::DeviceLost,
        };
        assert_eq!(released.reason(), Some("device-lost"));
        // Each reason as the wire spells it.
        for reason in RejectionReason::ALL {
            assert_eq!(serde_json::to_value(reason).unwrap(), reason.as_str());
        }
        for reason in LeaseEndReason::ALL {
            assert_eq!(serde_json::to_value(reason).unwrap(), reason.as_str());
        }
        let stopping = Event::DaemonStopping {
            reason: "SIGTERM".into(),
        };
        assert_eq!(stopping.reason(), None, "free text is not a reason label");
    }

    #[test]
    fn an_envelope_reads_back_and_extra_fields_are_ignored() {
        let read = Event::from_envelope(&envelope(
            "lease.expired",
            json!({"leaseId": "lse_1", "deviceId": "dev_1", "ownerId": "o", "workerId": "w1"}),
        ));
        assert_eq!(
            read,
            Some(Event::LeaseExpired {
                lease_id: "lse_1".into(),
                device_id: DeviceId::from_raw("dev_1"),
                owner_id: "o".into(),
            })
        );
        assert_eq!(
            Event::from_envelope(&envelope("lease.unheard-of", json!({}))),
            None
        );
        assert_eq!(
            Event::from_envelope(&envelope("lease.renewed", json!({"leaseId": 3}))),
            None,
            "a payload without the event's fields does not read"
        );
    }

    #[test]
    fn a_lease_end_without_its_owner_or_reason_still_reads() {
        let read = Event::from_envelope(&envelope(
            "lease.released",
            json!({"leaseId": "lse_1", "deviceId": "dev_1"}),
        ));
        assert_eq!(
            read,
            Some(Event::LeaseReleased {
                lease_id: "lse_1".into(),
                device_id: DeviceId::from_raw("dev_1"),
                owner_id: String::new(),
                reason: LeaseEndReason::Explicit,
            })
        );
    }

    #[test]
    fn the_device_health_and_driver_events_keep_their_wire_payloads() {
        let device = || DeviceId::from_raw("dev_1");
        let spec = DeviceSpec {
            platform: Platform::Ios,
            model: "iPhone 16".into(),
            os_version: "18.2".into(),
        };
        let cases = [
            (
                Event::DeviceCrashDetected {
                    device_id: device(),
                    seen: CrashedDevice::Leased {
                        lease_id: Some("lse_1".into()),
                    },
                    reason: UnhealthyReason::Crashed,
                },
                "device.crash-detected",
                json!({"deviceId": "dev_1", "leaseId": "lse_1", "reason": "crashed"}),
            ),
            (
                Event::DeviceCrashDetected {
                    device_id: device(),
                    seen: CrashedDevice::Leased { lease_id: None },
                    reason: UnhealthyReason::Crashed,
                },
                "device.crash-detected",
                json!({"deviceId": "dev_1", "leaseId": null, "reason": "crashed"}),
            ),
            (
                Event::DeviceCrashDetected {
                    device_id: device(),
                    seen: CrashedDevice::Free { spec: spec.clone() },
                    reason: UnhealthyReason::Crashed,
                },
                "device.crash-detected",
                json!({"deviceId": "dev_1", "spec": {"platform": "ios", "model": "iPhone 16", "osVersion": "18.2"}, "reason": "crashed"}),
            ),
            (
                Event::DeviceRecovered {
                    device_id: device(),
                    lease_id: "lse_1".into(),
                    attempts: 2,
                },
                "device.recovered",
                json!({"deviceId": "dev_1", "leaseId": "lse_1", "attempts": 2}),
            ),
            (
                Event::DeviceRecoveryAttemptFailed {
                    device_id: device(),
                    lease_id: None,
                    attempts: 1,
                    error: "boot failed".into(),
                },
                "device.recovery-attempt-failed",
                json!({"deviceId": "dev_1", "leaseId": null, "attempts": 1, "error": "boot failed"}),
            ),
            (
                Event::DeviceRecoveryFailed {
                    device_id: device(),
                    lease_id: Some("lse_1".into()),
                    attempts: 3,
                    error: "boot failed".into(),
                },
                "device.recovery-failed",
                json!({"deviceId": "dev_1", "leaseId": "lse_1", "attempts": 3, "error": "boot failed"}),
            ),
            (
                Event::DeviceQuarantined {
                    device_id: device(),
                    attempts: 1,
                    next_retry_at: 32_000,
                    error: "wipe failed".into(),
                },
                "device.quarantined",
                json!({"deviceId": "dev_1", "attempts": 1, "nextRetryAt": 32_000, "error": "wipe failed"}),
            ),
            (
                Event::DeviceQuarantineRecovered {
                    device_id: device(),
                    attempts: 2,
                },
                "device.quarantine-recovered",
                json!({"deviceId": "dev_1", "attempts": 2}),
            ),
            (
                Event::DeviceQuarantineAbandoned {
                    device_id: device(),
                    attempts: 4,
                    error: "wipe failed".into(),
                },
                "device.quarantine-abandoned",
                json!({"deviceId": "dev_1", "attempts": 4, "error": "wipe failed"}),
            ),
            (
                Event::DeviceOrphanPurged {
                    platform: Platform::Android,
                    driver_device_id: "simlock-a1".into(),
                },
                "device.orphan-purged",
                json!({"platform": "android", "driverDeviceId": "simlock-a1"}),
            ),
            (
                Event::DriverSwept {
                    platform: Platform::Ios,
                    purged: 2,
                },
                "driver.swept",
                json!({"platform": "ios", "purged": 2}),
            ),
            (
                Event::DeviceSweepFailed {
                    platform: Platform::Ios,
                    error: "simctl failed".into(),
                },
                "device.sweep-failed",
                json!({"platform": "ios", "error": "simctl failed"}),
            ),
        ];
        for (event, name, payload) in cases {
            assert_eq!(event.parts(), (name.to_owned(), payload.clone()), "{name}");
            assert_eq!(
                Event::from_envelope(&envelope(name, payload)),
                Some(event),
                "{name} reads back"
            );
        }
    }

    #[test]
    fn a_capability_change_keeps_its_wire_payload() {
        let down = Event::CapabilityChanged {
            name: "agent-device".into(),
            available: false,
            reason: Some("the agent-device daemon is stopped".into()),
        };
        let payload = json!({"name": "agent-device", "available": false,
            "reason": "the agent-device daemon is stopped"});
        assert_eq!(
            down.parts(),
            ("capability.changed".to_owned(), payload.clone())
        );
        assert_eq!(
            Event::from_envelope(&envelope("capability.changed", payload)),
            Some(down)
        );
        let up = Event::CapabilityChanged {
            name: "agent-device".into(),
            available: true,
            reason: None,
        };
        let payload = json!({"name": "agent-device", "available": true});
        assert_eq!(
            up.parts(),
            ("capability.changed".to_owned(), payload.clone()),
            "no reason, no field"
        );
        assert_eq!(
            Event::from_envelope(&envelope("capability.changed", payload)),
            Some(up)
        );
        assert_eq!(
            Event::from_envelope(&envelope(
                "capability.changed",
                json!({"name": "agent-device"})
            )),
            None,
            "a change without `available` does not read"
        );
    }

    #[test]
    fn every_module_has_its_wire_name() {
        let names: Vec<&str> = [
            EventModule::Daemon,
            EventModule::LeaseLifecycle,
            EventModule::Devices,
            EventModule::Fleet,
            EventModule::Capabilities,
        ]
        .into_iter()
        .map(EventModule::as_str)
        .collect();
        assert_eq!(
            names,
            [
                "daemon",
                "lease-lifecycle",
                "devices",
                "fleet",
                "capabilities"
            ]
        );
    }
}
