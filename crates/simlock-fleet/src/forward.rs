//! Lease operations on leases the gateway issued: renew, release and exec go to the worker that
//! holds the lease (`WORKER_UNREACHABLE` while its uplink is down); lists project every worker's
//! leases through the index.

use std::sync::Arc;

use serde_json::json;
use simlock_contract::ids::LeaseId;
use simlock_contract::model::{LeaseRecord, WorkerRef};
use simlock_contract::ops::{ExecInput, ExecOutput, LeaseReleaseOutput, LeaseRenewInput};
use simlock_contract::{ContractError, ErrorCode, Push, Role};
use simlock_daemon::context::{CallCtx, Viewer};
use simlock_wire::CallEvent;

use crate::coordinator::{from_worker, unreachable};
use crate::fleet::{Fleet, WorkerConn};
use crate::index::{Entry, LeaseIndex};

impl Fleet {
    /// The index entry of `lease_id`, if the caller may act on it (its owner, or an admin).
    fn entry_for(&self, ctx: &CallCtx, lease_id: &str) -> Result<Entry, ContractError> {
        let entry = self
            .lease(lease_id)
            .ok_or_else(|| ContractError::unknown_lease(lease_id))?;
        if !ctx.viewer().may_see(&entry.owner_id) {
            return Err(ContractError::unknown_lease(lease_id));
        }
        Ok(entry)
    }

    fn live(&self, entry: &Entry) -> Result<Arc<WorkerConn>, ContractError> {
        self.conn(&entry.worker_id)
            .ok_or_else(|| unreachable(&entry.worker_id))
    }

    /// A worker's answer about a lease: `UNKNOWN_LEASE` means it is gone (the index forgets it),
    /// a lost uplink reads as `WORKER_UNREACHABLE`.
    fn lease_error(&self, entry: &Entry, err: ContractError) -> ContractError {
        if err.code == ErrorCode::UnknownLease {
            self.state.lock().index.remove(&entry.lease_id);
            self.views_changed();
            return ContractError::unknown_lease(&entry.lease_id);
        }
        from_worker(&entry.worker_id, err)
    }

    async fn bounded_call(
        &self,
        entry: &Entry,
        conn: &WorkerConn,
        op: &str,
        payload: serde_json::Value,
    ) -> Result<serde_json::Value, ContractError> {
        match tokio::time::timeout(
            self.timing.call_timeout,
            conn.client.call_value(op, payload),
        )
        .await
        {
            Ok(outcome) => outcome.map_err(|e| self.lease_error(entry, e)),
            Err(_) => Err(ContractError::worker_unreachable(
                &entry.worker_id,
                format!(
                    "Worker {} did not answer {op} within {} ms",
                    entry.worker_id,
                    self.timing.call_timeout.as_millis()
                ),
            )),
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
        if let Some(ttl) = input.ttl_ms
            && ttl > self.limits.max_ttl_ms
        {
            return Err(ContractError::bad_request(format!(
                "ttlMs: {ttl} is above lease.maxTtlMs ({})",
                self.limits.max_ttl_ms
            )));
        }
        let entry = self.entry_for(ctx, &input.lease_id)?;
        let conn = self.live(&entry)?;
        let mut payload = json!({ "leaseId": entry.worker_lease_id });
        if let Some(ttl) = input.ttl_ms {
            payload["ttlMs"] = json!(ttl);
        }
        let value = self
            .bounded_call(&entry, &conn, "lease.renew", payload)
            .await?;
        let record: LeaseRecord = serde_json::from_value(value).map_err(|e| {
            ContractError::internal(format!(
                "Worker {} answered an invalid lease: {e}",
                entry.worker_id
            ))
        })?;
        Ok(project(&entry, self.label_of(&entry.worker_id), record))
    }

    /// `lease.release` through the gateway.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`, or the worker's error.
    pub async fn release(
        &self,
        ctx: &CallCtx,
        lease_id: &str,
    ) -> Result<LeaseReleaseOutput, ContractError> {
        let entry = self.entry_for(ctx, lease_id)?;
        let conn = self.live(&entry)?;
        self.state
            .lock()
            .releasing
            .insert(entry.lease_id.clone(), ctx.connection_id());
        let outcome = self
            .bounded_call(
                &entry,
                &conn,
                "lease.release",
                json!({ "leaseId": entry.worker_lease_id }),
            )
            .await;
        match outcome {
            Ok(_) => {
                self.state.lock().index.remove(&entry.lease_id);
                self.views_changed();
                Ok(LeaseReleaseOutput {
                    lease_id: entry.lease_id,
                })
            }
            Err(err) => {
                self.state.lock().releasing.remove(&entry.lease_id);
                Err(err)
            }
        }
    }

    /// `lease.release-all` through the gateway: every lease it issued.
    ///
    /// # Errors
    /// `WORKER_UNREACHABLE` with `details.releasedLeaseIds` when some could not be released.
    pub async fn release_all(&self, ctx: &CallCtx) -> Result<Vec<String>, ContractError> {
        let entries: Vec<Entry> = self.state.lock().index.entries().cloned().collect();
        let mut released = Vec::new();
        let mut failed: Option<ContractError> = None;
        for entry in entries {
            let outcome = match self.live(&entry) {
                Ok(conn) => {
                    self.state
                        .lock()
                        .releasing
                        .insert(entry.lease_id.clone(), ctx.connection_id());
                    self.bounded_call(
                        &entry,
                        &conn,
                        "lease.release",
                        json!({ "leaseId": entry.worker_lease_id }),
                    )
                    .await
                }
                Err(err) => Err(err),
            };
            match outcome {
                Ok(_) => {
                    self.state.lock().index.remove(&entry.lease_id);
                    released.push(entry.lease_id);
                }
                Err(err) if err.code == ErrorCode::UnknownLease => {}
                Err(err) => {
                    self.state.lock().releasing.remove(&entry.lease_id);
                    failed.get_or_insert(err);
                }
            }
        }
        self.views_changed();
        match failed {
            None => Ok(released),
            Some(err) => {
                let worker = err
                    .details
                    .as_ref()
                    .and_then(|d| d.get("workerId"))
                    .cloned()
                    .unwrap_or_default();
                Err(ContractError::new(
                    ErrorCode::WorkerUnreachable,
                    format!("Some leases could not be released: {}", err.message),
                )
                .with_details(json!({ "workerId": worker, "releasedLeaseIds": released })))
            }
        }
    }

    /// `device.exec` through the gateway: forwarded with the namespaced requester (the worker
    /// checks it again), its pushes relayed to the caller, stopped after `gateway.execTimeoutMs`.
    ///
    /// # Errors
    /// `FORBIDDEN`, `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`, `EXEC_TIMEOUT`, or the worker's error.
    pub async fn exec(&self, ctx: &CallCtx, input: ExecInput) -> Result<ExecOutput, ContractError> {
        if ctx.role != Role::Admin && input.requester_id.is_some() {
            return Err(ContractError::forbidden(
                "Only an admin may name requesterId on device.exec",
            ));
        }
        let entry = self
            .lease(&input.lease_id)
            .ok_or_else(|| ContractError::unknown_lease(&input.lease_id))?;
        let allowed = match ctx.role {
            Role::Agent => entry.owner_id == ctx.principal,
            Role::Admin => {
                entry.requester_id
                    == input
                        .requester_id
                        .clone()
                        .unwrap_or_else(|| ctx.principal.clone())
            }
        };
        if !allowed {
            return Err(ContractError::unknown_lease(&input.lease_id));
        }
        let conn = self.live(&entry)?;
        let mut payload = json!({
            "leaseId": entry.worker_lease_id,
            "tool": input.tool,
            "args": input.args,
            "requesterId": format!("{}{}", self.prefix, entry.requester_id),
        });
        if let Some(stdin) = input.stdin {
            payload["stdin"] = json!(stdin);
        }
        let run = async {
            let mut call = conn.client.begin("device.exec", payload, 16).await?;
            loop {
                match call.next().await {
                    CallEvent::Push(frame) => match Push::from_frame(&frame) {
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
                    CallEvent::Reply(reply) => return reply,
                }
            }
        };
        let value = match tokio::time::timeout(self.timing.exec_timeout, run).await {
            Ok(outcome) => outcome.map_err(|e| self.lease_error(&entry, e))?,
            Err(_) => {
                return Err(ContractError::new(
                    ErrorCode::ExecTimeout,
                    format!(
                        "The exec on worker {} ran past gateway.execTimeoutMs ({} ms)",
                        entry.worker_id,
                        self.timing.exec_timeout.as_millis()
                    ),
                ));
            }
        };
        serde_json::from_value(value).map_err(|e| {
            ContractError::internal(format!(
                "Worker {} answered an invalid exec result: {e}",
                entry.worker_id
            ))
        })
    }

    /// Every lease on every worker, projected: the gateway's own with their gateway ids; others
    /// (leases made on a worker directly) as they are, with the worker's id. Who sees which is
    /// `seen`'s rule.
    pub fn leases(&self, ctx: &CallCtx) -> Vec<LeaseRecord> {
        let viewer = ctx.viewer();
        let state = self.state.lock();
        let mut out = Vec::new();
        for worker in state.workers.values() {
            let view = &worker.view;
            for lease in view.leases.as_deref().unwrap_or_default() {
                match seen(&state.index, &self.prefix, viewer, &view.id, lease) {
                    Seen::Issued(entry) => {
                        out.push(project(entry, view.label.clone(), lease.clone()));
                    }
                    Seen::Direct => {
                        let mut lease = lease.clone();
                        lease.worker_id = Some(view.id.clone());
                        out.push(lease);
                    }
                    Seen::Hidden => {}
                }
            }
        }
        out
    }
}

/// How one of a worker's leases shows to a viewer at the gateway.
pub(crate) enum Seen<'a> {
    /// A lease the gateway issued, and the viewer's to see (its owner, or an admin).
    Issued(&'a Entry),
    /// A lease made on the worker directly: an admin's to see.
    Direct,
    /// Not the viewer's to see.
    Hidden,
}

/// The rule for a worker's lease at the gateway, for the lease list and the workers' nested
/// views alike: a lease the gateway issued is its owner's (and an admin's) to see, through
/// [`Viewer::may_see`]; one made on the worker directly is an admin's; one the index does not
/// hold (yet, or any more) is nobody's in the list.
pub(crate) fn seen<'a>(
    index: &'a LeaseIndex,
    prefix: &str,
    viewer: Viewer<'_>,
    worker_id: &str,
    lease: &LeaseRecord,
) -> Seen<'a> {
    match index.by_worker_lease(worker_id, lease.id.as_str()) {
        Some(entry) if viewer.may_see(&entry.owner_id) => Seen::Issued(entry),
        Some(_) => Seen::Hidden,
        None if viewer.admin && !lease.requester_id.starts_with(prefix) => Seen::Direct,
        None => Seen::Hidden,
    }
}

/// Projects a worker's lease record for the gateway's callers: the gateway's id, requester and
/// owner, and the worker it lives on.
pub(crate) fn project(
    entry: &Entry,
    label: Option<String>,
    mut record: LeaseRecord,
) -> LeaseRecord {
    record.id = LeaseId::from_raw(entry.lease_id.clone());
    record.requester_id = entry.requester_id.clone();
    record.owner_id = entry.owner_id.clone();
    record.worker = Some(WorkerRef {
        id: entry.worker_id.clone(),
        label,
    });
    record.worker_id = Some(entry.worker_id.clone());
    record
}
