//! Lease operations on leases the gateway issued: renew, release and exec go to the worker that
//! holds the lease (`WORKER_UNREACHABLE` while its uplink is down, but for its holder's release,
//! which the core answers and carries out once the worker is back), as typed calls; the fleet
//! core decides where a lease is and who may act on it, and takes in the worker's answers.
//! Lists come from the core's index.

use std::time::Duration;

use simlock_contract::model::{LeaseEndReason, LeaseRecord, ReleaseReason};
use simlock_contract::ops::{
    DeviceExec, ExecInput, ExecOutput, LeaseIdInput, LeaseListOutput, LeaseRelease,
    LeaseReleaseOutput, LeaseRenew, LeaseRenewInput,
};
use simlock_contract::{ContractError, Operation, Push};
use simlock_daemon::context::CallCtx;
use simlock_wire::{CallEvent, decode_raw};

use crate::error::FleetError;
use crate::fleet::Fleet;
use crate::requests::caller;
use crate::state::{Caller, LeaseTarget, Release};

impl Fleet {
    /// Calls `O` on the worker holding `target`, bounded by the call timeout.
    async fn call_worker<O: Operation>(
        &self,
        target: &LeaseTarget,
        input: &O::Input,
    ) -> Result<O::Output, FleetError> {
        let Some(conn) = self.conn_of(target.generation) else {
            return Err(FleetError::unreachable(&target.worker_id));
        };
        let bound = self.timing.call_timeout;
        match tokio::time::timeout(bound, conn.client.call::<O>(input)).await {
            Ok(outcome) => outcome.map_err(|e| FleetError::from_worker(&target.worker_id, e)),
            Err(_) => Err(no_answer(target, O::NAME, bound)),
        }
    }

    /// `lease.renew` through the gateway.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE`, `BAD_REQUEST` over the cap, `WORKER_UNREACHABLE`, or the worker's error.
    pub async fn renew(
        &self,
        ctx: &CallCtx,
        input: LeaseRenewInput,
    ) -> Result<LeaseRecord, ContractError> {
        if input.ttl_ms.is_some() {
            // Absent keeps the lease's width; present is held to the one rule.
            self.limits
                .ttl(input.ttl_ms)
                .map_err(|e| ContractError::bad_request(e.to_string()))?;
        }
        let target = self
            .shared
            .lock()
            .core
            .lease_target(&input.lease_id, caller(ctx))?;
        let forwarded = LeaseRenewInput {
            lease_id: target.worker_lease_id.clone(),
            ttl_ms: input.ttl_ms,
        };
        let outcome = self.call_worker::<LeaseRenew>(&target, &forwarded).await;
        self.decide(|shared, now| shared.core.handle_renew_answered(&target, outcome, now))
            .map_err(ContractError::from)
    }

    /// `lease.release` through the gateway, for `reason` (absent: `explicit`), which travels
    /// to the worker with the call.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`, or the worker's error.
    pub async fn release(
        &self,
        ctx: &CallCtx,
        lease_id: &str,
        reason: Option<ReleaseReason>,
    ) -> Result<LeaseReleaseOutput, ContractError> {
        self.release_as(caller(ctx), lease_id, reason)
            .await
            .map(|lease_id| LeaseReleaseOutput { lease_id })
            .map_err(ContractError::from)
    }

    async fn release_as(
        &self,
        caller: Caller<'_>,
        lease_id: &str,
        reason: Option<ReleaseReason>,
    ) -> Result<String, FleetError> {
        let reason_ended = reason.map_or(LeaseEndReason::Explicit, LeaseEndReason::from);
        let target = match self.decide_release(|shared, now| {
            shared
                .core
                .handle_release_sent(lease_id, caller, reason_ended, now)
        })? {
            Release::Send(target) => target,
            Release::Deferred(lease_id) => return Ok(lease_id),
        };
        // A caller that hangs up before the worker answers drops this future: the core hears it.
        let abandoned = Abandoned {
            fleet: self,
            target: Some(&target),
            connection: caller.connection,
        };
        let input = LeaseIdInput {
            lease_id: target.worker_lease_id.clone(),
            reason,
        };
        let outcome = self
            .call_worker::<LeaseRelease>(&target, &input)
            .await
            .map(|_| ());
        abandoned.answered();
        self.decide_release(|shared, now| {
            shared
                .core
                .handle_release_answered(&target, reason_ended, outcome, now)
        })
    }

    /// Runs a release's decision. One that keeps the release to carry out later (its worker
    /// away, or not answering) and cannot store it (a full disk) is not answered as kept: the
    /// caller hears why, `INTERNAL` (trial 19).
    fn decide_release<T>(
        &self,
        decision: impl FnOnce(&mut crate::fleet::Shared, i64) -> Result<T, FleetError>,
    ) -> Result<T, FleetError> {
        let (decided, unstored) = self.decide_storing(decision);
        let decided = decided?;
        match unstored {
            None => Ok(decided),
            Some(e) => Err(FleetError::ReleaseNotStored(format!(
                "the release is carried out once its worker is back, but could not be stored \
                 yet ({e}); it is stored once the disk has room: should this gateway restart \
                 before, the lease is listed again until its TTL; release it again then"
            ))),
        }
    }

    /// `lease.release-all` through the gateway: every lease it issued, each released on its
    /// worker with reason `killed`, as a worker's own `lease.release-all` ends them.
    ///
    /// # Errors
    /// `WORKER_UNREACHABLE` with `details.releasedLeaseIds` when some could not be released.
    pub async fn release_all(&self, ctx: &CallCtx) -> Result<Vec<String>, ContractError> {
        let ids = self.shared.lock().core.lease_ids();
        let mut released = Vec::new();
        let mut failed: Option<FleetError> = None;
        for id in ids {
            match self
                .release_as(caller(ctx), &id, Some(ReleaseReason::Killed))
                .await
            {
                Ok(id) => released.push(id),
                Err(FleetError::UnknownLease(_)) => {}
                Err(err) => {
                    failed.get_or_insert(err);
                }
            }
        }
        match failed {
            None => Ok(released),
            Some(err) => {
                let worker_id = match &err {
                    FleetError::WorkerUnreachable { worker_id, .. } => Some(worker_id.clone()),
                    _ => ContractError::from(err.clone())
                        .details
                        .and_then(|d| d.get("workerId")?.as_str().map(str::to_owned)),
                };
                Err(FleetError::SomeNotReleased {
                    worker_id,
                    message: ContractError::from(err).message,
                    released,
                }
                .into())
            }
        }
    }

    /// `device.exec` through the gateway: forwarded with the namespaced requester (the worker
    /// checks it again), its pushes relayed to the caller, stopped after `gateway.execTimeoutMs`.
    ///
    /// # Errors
    /// `FORBIDDEN`, `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`, `EXEC_TIMEOUT`, or the worker's error.
    pub async fn exec(&self, ctx: &CallCtx, input: ExecInput) -> Result<ExecOutput, ContractError> {
        let target = self.shared.lock().core.exec_target(
            &input.lease_id,
            caller(ctx),
            input.requester_id.as_deref(),
        )?;
        let Some(conn) = self.conn_of(target.generation) else {
            return Err(crate::error::unreachable(&target.worker_id));
        };
        let forwarded = ExecInput {
            lease_id: target.worker_lease_id.clone(),
            requester_id: Some(target.worker_requester_id.clone()),
            ..input
        };
        let run = async {
            let mut call = conn.client.begin_call::<DeviceExec>(&forwarded, 16).await?;
            loop {
                match call.next().await {
                    CallEvent::Push(frame) => match Push::from_frame(frame) {
                        Ok(Push::Started { .. }) => {
                            let _ = ctx
                                .push(Push::Started {
                                    request_id: ctx.request_id().clone(),
                                })
                                .await;
                        }
                        Ok(Push::Output { stream, chunk, .. }) => {
                            let _ = ctx
                                .push(Push::Output {
                                    request_id: ctx.request_id().clone(),
                                    stream,
                                    chunk,
                                })
                                .await;
                        }
                        _ => {}
                    },
                    CallEvent::Reply(reply) => {
                        return reply.and_then(|raw| decode_raw::<DeviceExec>(&raw));
                    }
                }
            }
        };
        match tokio::time::timeout(self.timing.exec_timeout, run).await {
            Ok(Ok(output)) => Ok(output),
            Ok(Err(err)) => {
                let err = FleetError::from_worker(&target.worker_id, err);
                Err(self
                    .decide(|shared, now| shared.core.handle_lease_call_failed(&target, err, now))
                    .into())
            }
            Err(_) => Err(FleetError::ExecTimeout {
                worker_id: target.worker_id.clone(),
                timeout_ms: self.timing.exec_timeout.as_millis(),
            }
            .into()),
        }
    }

    /// One lease by id as the caller may see it (`GET /v1/leases/{id}` and its events): the
    /// core's [`crate::state::Core::lease_seen`].
    ///
    /// # Errors
    /// `UNKNOWN_LEASE`, or `WORKER_UNREACHABLE` while the worker its id names has not reported.
    pub fn lease_seen(&self, ctx: &CallCtx, lease_id: &str) -> Result<LeaseRecord, ContractError> {
        self.shared
            .lock()
            .core
            .lease_seen(lease_id, ctx.viewer())
            .map_err(ContractError::from)
    }

    /// Every lease on every worker, projected: the gateway's own with their gateway ids (listed
    /// from the moment their grant is answered); others (leases made on a worker directly) as
    /// they are, with the worker's id, for admins. An agent sees only the gateway leases it owns.
    pub fn leases(&self, ctx: &CallCtx) -> Vec<LeaseRecord> {
        self.shared.lock().core.leases(ctx.viewer())
    }

    /// `lease.list`: the leases the caller may see, and the workers whose leases are not read
    /// yet (so that a lease of the caller's on a worker that is away is not silently missing).
    pub fn lease_list(&self, ctx: &CallCtx) -> LeaseListOutput {
        let shared = self.shared.lock();
        LeaseListOutput {
            leases: shared.core.leases(ctx.viewer()),
            unread_workers: shared.core.unread_workers(),
        }
    }
}

/// A release on its way to the worker: dropped before its answer (the caller hung up), it tells
/// the core the release is abandoned.
struct Abandoned<'a> {
    fleet: &'a Fleet,
    target: Option<&'a LeaseTarget>,
    /// The connection the release came on.
    connection: Option<u64>,
}

impl Abandoned<'_> {
    /// The worker answered: nothing to tell.
    fn answered(mut self) {
        self.target = None;
    }
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(target) = self.target.take() {
            self.fleet.decide(|shared, _| {
                shared
                    .core
                    .handle_release_abandoned(target, self.connection);
            });
        }
    }
}

/// `WORKER_UNREACHABLE` for a worker that did not answer `op` within `bound`.
fn no_answer(target: &LeaseTarget, op: &str, bound: Duration) -> FleetError {
    FleetError::no_answer(&target.worker_id, op, bound.as_millis())
}
