//! Lease requests through the gateway: a caller's `lease.request` is admitted by the fleet core
//! (which queues, routes and forwards it), and the caller follows its request's progress until
//! the core answers it; `lease.cancel` and the waiting list.

use std::sync::Arc;

use simlock_contract::ids::RequestId;
use simlock_contract::model::{LeaseGrant, WaitingRequest};
use simlock_contract::ops::{CancelResult, LeaseRequestInput};
use simlock_contract::{ContractError, Push, Role};
use simlock_daemon::context::CallCtx;
use tokio::sync::mpsc;

use crate::error::FleetError;
use crate::fleet::{Fleet, Update};
use crate::state::{Admitted, Ask, Caller};

/// The fleet core's view of the caller of `ctx`.
pub(crate) fn caller(ctx: &CallCtx) -> Caller<'_> {
    Caller {
        principal: &ctx.principal,
        admin: ctx.role == Role::Admin,
        connection: ctx.connection_id(),
    }
}

impl Fleet {
    /// `lease.request` through the gateway.
    ///
    /// # Errors
    /// Every refusal of the table, the worker's answer, or `QUEUE_TIMEOUT`.
    pub async fn request_lease(
        self: &Arc<Self>,
        ctx: &CallCtx,
        input: LeaseRequestInput,
    ) -> Result<LeaseGrant, ContractError> {
        let ask = Ask {
            request_id: RequestId::mint(),
            input,
            principal: ctx.principal.clone(),
        };
        let (tx, mut updates) = mpsc::unbounded_channel();
        // Admission and following happen in one decision: nothing the core answers is missed.
        let replay = self
            .decide(|shared, now| -> Result<_, FleetError> {
                let (id, told) = match shared.core.handle_lease_request(ask, now)? {
                    Admitted::New(id) => (id, None),
                    // A repeat hears at once where the request it follows stands.
                    Admitted::Joined(id, told) => (id, told),
                    Admitted::Replay(outcome) => return Ok(Some(outcome)),
                };
                if let Some(progress) = told {
                    let _ = tx.send(Update::Progress(progress));
                }
                shared.followers.entry(id).or_default().push(tx);
                Ok(None)
            })
            .map_err(ContractError::from)?;
        if let Some(outcome) = replay {
            return (*outcome).map_err(ContractError::from);
        }
        while let Some(update) = updates.recv().await {
            match update {
                Update::Progress(progress) => {
                    let _ = ctx
                        .push(Push::Progress {
                            request_id: ctx.request_id().clone(),
                            progress,
                        })
                        .await;
                }
                Update::Done(outcome) => return *outcome,
            }
        }
        Err(ContractError::stopping())
    }

    /// `lease.cancel` of `requester`'s pending request through the gateway.
    ///
    /// # Errors
    /// `FORBIDDEN` when the pending request is another principal's.
    pub fn cancel_request(
        &self,
        ctx: &CallCtx,
        requester: &str,
    ) -> Result<CancelResult, ContractError> {
        self.decide(|shared, now| shared.core.handle_cancel(requester, caller(ctx), now))
            .map_err(ContractError::from)
    }

    /// The owner of `requester`'s pending request, if it has one.
    pub fn pending_owner(&self, requester: &str) -> Option<String> {
        self.shared
            .lock()
            .core
            .pending_owner(requester)
            .map(str::to_owned)
    }

    /// The waiting requests, oldest first.
    pub fn waiting(&self) -> Vec<WaitingRequest> {
        self.shared.lock().core.waiting()
    }

    /// The number of requests waiting in the fleet queue.
    pub fn queue_depth(&self) -> u32 {
        self.shared.lock().core.queue_depth()
    }
}
