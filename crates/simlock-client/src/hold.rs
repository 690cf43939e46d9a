//! [`LeaseHold`]: keeps a granted lease alive the way a holder must, renewing at a third of its
//! TTL without naming a TTL, and stops when the daemon ends the lease: a `lease-lost` push, or
//! `UNKNOWN_LEASE` on a renewal. Nothing else says a lease is gone: a lookup that misses it (the
//! lease's event stream opening right after the grant) only means the hold renews without
//! notices until the stream opens.

use std::time::Duration;

use simlock_contract::model::{LeaseEndReason, LeaseGrant};
use simlock_contract::{ContractError, ErrorCode};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::client::{Backend, Client};
use crate::notices::{LeaseNotice, LeaseNotices};

/// Health notices kept for a slow reader of [`LeaseHold::notices`].
const HEALTH_QUEUE: usize = 64;

/// How a lease the daemon ended was learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseLost {
    /// The lease.
    pub lease_id: String,
    /// Why, when a `lease-lost` push said; `None` when a renewal answered `UNKNOWN_LEASE`.
    pub reason: Option<LeaseEndReason>,
}

/// How a hold ended.
#[derive(Debug, Clone, PartialEq)]
pub enum HoldEnd {
    /// [`LeaseHold::release`] released the lease.
    Released,
    /// The daemon ended the lease (it expired, an operator killed it, the device was lost).
    Lost(LeaseLost),
    /// Renewing failed for another reason until the lease's deadline passed, or the
    /// connection ended for good. The lease may still exist until its TTL runs out.
    Failed(ContractError),
}

/// How a hold's renewals are going ([`LeaseHold::renewal`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Renewal {
    /// The last renewal went through (or none has been due yet).
    Renewing,
    /// The last renewal failed for a reason that may pass (the daemon, or the lease's worker
    /// behind a gateway, out of reach); the hold retries until `deadline`, when the lease's TTL
    /// runs out.
    Retrying {
        /// What the last attempt answered.
        error: ContractError,
        /// When the lease expires unless a renewal goes through first.
        deadline: Instant,
    },
}

/// Why the renewing task stopped.
#[derive(Debug, Clone, PartialEq)]
enum Stop {
    /// Asked to.
    Asked,
    /// By itself.
    Ended(HoldEnd),
}

/// A granted lease kept alive until released or lost.
///
/// Dropping a hold stops renewing without releasing (the lease then expires on its TTL): call
/// [`Self::release`] to end it.
#[derive(Debug)]
pub struct LeaseHold {
    client: Client,
    grant: LeaseGrant,
    stop: CancellationToken,
    task: Option<JoinHandle<Stop>>,
    ended: watch::Receiver<Option<HoldEnd>>,
    health: broadcast::Sender<LeaseNotice>,
    renewal: watch::Receiver<Renewal>,
}

impl LeaseHold {
    pub(crate) fn start(client: Client, grant: LeaseGrant) -> Self {
        let lease_id = grant.lease.id.to_string();
        let ttl = Duration::from_millis(grant.lease.ttl_ms.max(1));
        let stop = CancellationToken::new();
        let (ended_tx, ended) = watch::channel(None);
        let health = broadcast::channel(HEALTH_QUEUE).0;
        let (renewal_tx, renewal) = watch::channel(Renewal::Renewing);
        // On a wire connection, follow now so nothing pushed after the grant is missed.
        let notices = match &client.backend {
            Backend::Wire(wire) => Some(LeaseNotices::wire(wire, &lease_id)),
            Backend::Http(_) => None,
        };
        let renewer = Renewer {
            client: client.clone(),
            lease_id,
            ttl,
            notices,
            health: health.clone(),
            renewal: renewal_tx,
        };
        let task_stop = stop.clone();
        let task = tokio::spawn(async move {
            let stopped = renewer.run(task_stop).await;
            if let Stop::Ended(end) = &stopped {
                let _ = ended_tx.send(Some(end.clone()));
            }
            stopped
        });
        Self {
            client,
            grant,
            stop,
            task: Some(task),
            ended,
            health,
            renewal,
        }
    }

    /// The grant being held.
    pub const fn grant(&self) -> &LeaseGrant {
        &self.grant
    }

    /// The lease's id.
    pub fn lease_id(&self) -> &str {
        self.grant.lease.id.as_str()
    }

    /// Follows how the renewals are going: [`Renewal::Retrying`] while they fail and the hold
    /// retries, [`Renewal::Renewing`] once one goes through again. A change is seen once.
    pub fn renewal(&self) -> watch::Receiver<Renewal> {
        self.renewal.clone()
    }

    /// Follows the lease's health notices (`device-unhealthy`, `device-recovered`) from now on.
    pub fn notices(&self) -> broadcast::Receiver<LeaseNotice> {
        self.health.subscribe()
    }

    /// Waits until the hold ends by itself: the lease was lost, or renewing failed for good.
    /// Never resolves while the hold is fine.
    pub async fn ended(&mut self) -> HoldEnd {
        let gone = || HoldEnd::Failed(ContractError::internal("the lease hold's task stopped"));
        match self.ended.wait_for(Option::is_some).await {
            Ok(end) => end.clone().unwrap_or_else(gone),
            // The task is gone without saying why (it panicked).
            Err(_) => gone(),
        }
    }

    /// Stops renewing and releases the lease. Answers [`HoldEnd::Released`], or how the hold
    /// had already ended ([`HoldEnd::Lost`] also when the release found the lease gone).
    pub async fn release(mut self) -> HoldEnd {
        self.stop.cancel();
        let stopped = match self.task.take() {
            Some(task) => task.await.unwrap_or(Stop::Asked),
            None => Stop::Asked,
        };
        if let Stop::Ended(end @ HoldEnd::Lost(_)) = stopped {
            return end;
        }
        let lease_id = self.lease_id().to_owned();
        match self.client.release(&lease_id).await {
            Ok(_) => HoldEnd::Released,
            Err(e) if e.code == ErrorCode::UnknownLease => HoldEnd::Lost(LeaseLost {
                lease_id,
                reason: None,
            }),
            Err(e) => HoldEnd::Failed(e),
        }
    }
}

impl LeaseHold {
    /// Releases the lease, renewing on until the daemon answers: when the daemon cannot be
    /// reached (a transport error: a gateway restarting, a socket gone), answers the hold back,
    /// still renewing (its next renewal and its retries as they were), with the error. Otherwise
    /// as [`Self::release`]; a hold that had already ended answers how, and releases nothing.
    ///
    /// # Errors
    /// The hold and the transport error, when the release could not reach the daemon.
    pub async fn release_or_keep(mut self) -> Result<HoldEnd, (Self, ContractError)> {
        let ended = self.ended.borrow().clone();
        if let Some(end) = ended {
            self.stop.cancel();
            return Ok(end);
        }
        let lease_id = self.lease_id().to_owned();
        let outcome = self.client.release(&lease_id).await;
        if let Err(e) = &outcome
            && e.code.is_transport()
        {
            return Err((self, e.clone()));
        }
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        Ok(match outcome {
            Ok(_) => HoldEnd::Released,
            Err(e) if e.code == ErrorCode::UnknownLease => HoldEnd::Lost(LeaseLost {
                lease_id,
                reason: None,
            }),
            Err(e) => HoldEnd::Failed(e),
        })
    }
}

impl Drop for LeaseHold {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The renewing task.
struct Renewer {
    client: Client,
    lease_id: String,
    ttl: Duration,
    notices: Option<LeaseNotices>,
    health: broadcast::Sender<LeaseNotice>,
    renewal: watch::Sender<Renewal>,
}

impl Renewer {
    async fn run(mut self, stop: CancellationToken) -> Stop {
        // Over HTTP the notices are a stream of their own: opened now, and reopened after a
        // renewal (at most once per renewal) when it broke or could not be opened.
        let over_http = matches!(self.client.backend, Backend::Http(_));
        let mut open_due = over_http;
        let mut deadline = Instant::now() + self.ttl;
        let mut next = Instant::now() + self.ttl / 3;
        loop {
            if open_due && self.notices.is_none() {
                open_due = false;
                // Never at the cost of a renewal: give up opening when one falls due.
                let opened = tokio::select! {
                    () = stop.cancelled() => return Stop::Asked,
                    () = tokio::time::sleep_until(next) => None,
                    opened = self.client.lease_notices(&self.lease_id) => Some(opened),
                };
                match opened {
                    Some(Ok(notices)) => self.notices = Some(notices),
                    // Not proof that the lease is gone: opening the stream looks the lease up,
                    // and a lookup can race the grant (a gateway's answer outruns what its lists
                    // show). Only the daemon's word that the lease ended (`lease-lost`, or
                    // `UNKNOWN_LEASE` to a renewal) ends the hold; the renewal decides, and the
                    // stream is opened again after it.
                    Some(Err(e)) => {
                        debug!(error = %e, "lease notices unavailable; relying on renewals")
                    }
                    None => debug!("lease notices not open yet; renewing first"),
                }
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return Stop::Asked,
                notice = next_notice(&mut self.notices) => match notice {
                    Some(Ok(LeaseNotice::Lost { reason, .. })) => return self.lost(Some(reason)),
                    Some(Ok(health)) => {
                        let _ = self.health.send(health);
                    }
                    Some(Err(e)) if self.client.is_closed() => return Stop::Ended(HoldEnd::Failed(e)),
                    Some(Err(e)) => {
                        debug!(error = %e, "lease notices broke; relying on renewals");
                        self.notices = None;
                    }
                    None => self.notices = None,
                },
                () = tokio::time::sleep_until(next) => {
                    let renewed = tokio::select! {
                        () = stop.cancelled() => return Stop::Asked,
                        renewed = self.client.renew(&self.lease_id, None) => renewed,
                    };
                    let now = Instant::now();
                    match renewed {
                        Ok(record) => {
                            self.ttl = Duration::from_millis(record.ttl_ms.max(1));
                            deadline = now + self.ttl;
                            next = now + self.ttl / 3;
                            open_due = over_http;
                            self.renewal.send_if_modified(|renewal| {
                                let was_failing = *renewal != Renewal::Renewing;
                                *renewal = Renewal::Renewing;
                                was_failing
                            });
                        }
                        Err(e) if e.code == ErrorCode::UnknownLease => {
                            let reason = self.why_gone(now >= deadline).await;
                            return self.lost(reason);
                        }
                        Err(e) if self.client.is_closed() => return Stop::Ended(HoldEnd::Failed(e)),
                        // A failure that may clear before the TTL: the connection, or the
                        // daemon's own (its store on a full disk, trial 19).
                        Err(e) if e.code.is_transport() || e.code == ErrorCode::Internal => {
                            let retry = (self.ttl / 10).clamp(Duration::from_millis(50), Duration::from_secs(5));
                            if now + retry >= deadline {
                                return Stop::Ended(HoldEnd::Failed(e));
                            }
                            warn!(lease = %self.lease_id, error = %e, "renewal failed; retrying");
                            next = now + retry;
                            // Said when renewals start failing, not at every retry.
                            self.renewal.send_if_modified(|renewal| {
                                let started = *renewal == Renewal::Renewing;
                                *renewal = Renewal::Retrying { error: e, deadline };
                                started
                            });
                        }
                        Err(e) => return Stop::Ended(HoldEnd::Failed(e)),
                    }
                }
            }
        }
    }

    /// Why the lease a renewal found gone ended: as its `lease-lost` said, when that came
    /// already (a push read before the renewal's answer, outside trial 24: a holder stopped past
    /// its deadline said only that the daemon no longer knew the lease); else `expired` when
    /// its deadline as this hold knows it had passed (the daemon's own came a little earlier);
    /// else not known.
    async fn why_gone(&mut self, past_deadline: bool) -> Option<LeaseEndReason> {
        loop {
            match tokio::time::timeout(Duration::ZERO, next_notice(&mut self.notices)).await {
                Ok(Some(Ok(LeaseNotice::Lost { reason, .. }))) => return Some(reason),
                Ok(Some(Ok(health))) => {
                    let _ = self.health.send(health);
                }
                Ok(_) | Err(_) => break,
            }
        }
        past_deadline.then_some(LeaseEndReason::Expired)
    }

    fn lost(&self, reason: Option<LeaseEndReason>) -> Stop {
        Stop::Ended(HoldEnd::Lost(LeaseLost {
            lease_id: self.lease_id.clone(),
            reason,
        }))
    }
}

/// The next notice, or never when there is no stream.
async fn next_notice(
    notices: &mut Option<LeaseNotices>,
) -> Option<Result<LeaseNotice, ContractError>> {
    match notices {
        Some(notices) => notices.next().await,
        None => std::future::pending().await,
    }
}
