//! One MCP session's shell around its [`LeaseBook`]: the daemon connection (made when a tool
//! first needs it, made again once it is lost), a [`LeaseHold`] task per lease, the client's
//! notifications, and the end of the session, which releases every lease it holds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::{Peer, RoleServer};
use serde_json::{Value, json};
use simlock_client::{Client, HoldEnd, LeaseHold, LeaseLost, LeaseNotice, Renewal};
use simlock_contract::model::{LeaseGrant, LeaseRecord};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::push::Progress;
use simlock_contract::{ContractError, ErrorCode};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::book::{Entry, LeaseBook, Standing};
use super::notify::{Level, Notifier};
use crate::Target;
use crate::identity::Requester;
use crate::lease::Reconnected;
use crate::view;

/// The longest the end of a session waits for its releases (and withdrawn requests).
pub(crate) const CLOSE_BOUND: Duration = Duration::from_secs(15);
/// Progress notifications a slow client may leave unsent before newer ones are dropped.
const PROGRESS_QUEUE: usize = 16;
/// How often a wait with nothing new is told again: MCP clients commonly give up on a call
/// after 60 s without a progress notification, and a queue can hold a request far longer.
pub(crate) const PROGRESS_AGAIN: Duration = Duration::from_secs(20);

/// A request to a hold's task to release its lease; it answers how the hold ended.
type ReleaseAsk = oneshot::Sender<HoldEnd>;

/// One MCP session.
#[derive(Debug)]
pub(crate) struct Session {
    target: Target,
    requester: Requester,
    client: tokio::sync::Mutex<Option<Client>>,
    book: Mutex<LeaseBook>,
    releases: Mutex<HashMap<String, mpsc::Sender<ReleaseAsk>>>,
    notifier: Notifier,
    closing: CancellationToken,
    tasks: TaskTracker,
}

impl Session {
    pub(crate) fn new(target: Target, requester: Requester) -> Arc<Self> {
        Arc::new(Self {
            target,
            requester,
            client: tokio::sync::Mutex::new(None),
            book: Mutex::new(LeaseBook::default()),
            releases: Mutex::new(HashMap::new()),
            notifier: Notifier::default(),
            closing: CancellationToken::new(),
            tasks: TaskTracker::new(),
        })
    }

    /// Who the session's leases are for.
    pub(crate) const fn requester(&self) -> &Requester {
        &self.requester
    }

    /// Where the session's notifications go.
    pub(crate) const fn notifier(&self) -> &Notifier {
        &self.notifier
    }

    /// The daemon connection: the open one, or a new one.
    ///
    /// # Errors
    /// The connection's failure (`DAEMON_CONNECTION_LOST` naming the socket, a usage error).
    pub(crate) async fn client(&self) -> Result<Client, ContractError> {
        let mut slot = self.client.lock().await;
        if let Some(client) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(client.clone());
        }
        let client = self.target.connect().await?;
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Reads the book.
    pub(crate) fn with_book<T>(&self, read: impl FnOnce(&LeaseBook) -> T) -> T {
        read(&self.book.lock())
    }

    /// Requests a lease for the session's requester, reporting progress to `progress` when the
    /// client asked for it, withdrawing the request when `cancel` fires or the session ends;
    /// then holds the grant.
    ///
    /// # Errors
    /// The daemon's refusal (`NO_CAPACITY`, `REQUESTER_ALREADY_LEASED`, …), `CANCELLED`, or the
    /// connection's failure.
    pub(crate) async fn lease(
        self: &Arc<Self>,
        mut input: LeaseRequestInput,
        progress: Option<(Peer<RoleServer>, ProgressToken)>,
        cancel: CancellationToken,
    ) -> Result<LeaseGrant, ContractError> {
        if self.closing.is_cancelled() {
            return Err(ending());
        }
        input.requester_id = Some(self.requester.id());
        let client = self.client().await?;
        let sink = progress.map(|(peer, token)| self.forward_progress(peer, token));
        // A task of its own: it runs to its end (withdrawing the request, or holding or releasing
        // the grant) even when the call is dropped as the session ends.
        let session = Arc::clone(self);
        let task = self.tasks.spawn(async move {
            let closing = session.closing.clone();
            let abort = async move {
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = closing.cancelled() => {}
                }
            };
            let on_progress = |p: &Progress| {
                if let Some(sink) = &sink {
                    // Progress is advisory: a client that reads slowly misses some.
                    let _ = sink.try_send(*p);
                }
            };
            let grant = client
                .request_lease(input, on_progress, abort)
                .await
                .map_err(|e| session.explain_left_over(e))?;
            if session.closing.is_cancelled() {
                let _ = client.release(grant.lease.id.as_str()).await;
                return Err(ending());
            }
            session.hold(&client, grant.clone());
            Ok(grant)
        });
        task.await.unwrap_or_else(|e| {
            Err(ContractError::internal(format!(
                "the lease request stopped: {e}"
            )))
        })
    }

    /// A task that sends each progress as an MCP progress notification.
    fn forward_progress(
        &self,
        peer: Peer<RoleServer>,
        token: ProgressToken,
    ) -> mpsc::Sender<Progress> {
        let (tx, rx) = mpsc::channel::<Progress>(PROGRESS_QUEUE);
        self.tasks
            .spawn(pace(rx, PROGRESS_AGAIN, move |count, message| {
                let (peer, token) = (peer.clone(), token.clone());
                async move {
                    let note = ProgressNotificationParam::new(token, count).with_message(message);
                    peer.notify_progress(note).await.is_ok()
                }
            }));
        tx
    }

    /// Holds `grant` on `client` until it is released, lost, or the session ends.
    fn hold(self: &Arc<Self>, client: &Client, grant: LeaseGrant) {
        let lease_id = grant.lease.id.to_string();
        let hold = client.hold(grant.clone());
        let (tx, rx) = mpsc::channel(1);
        self.book.lock().hold(grant);
        self.releases.lock().insert(lease_id, tx);
        self.tasks
            .spawn(Arc::clone(self).keep(client.clone(), hold, rx));
    }

    /// A hold's task. A hold on the socket whose daemon went away (a restart, which keeps the
    /// lease) connects again and holds on, as `simlock lease` does.
    async fn keep(
        self: Arc<Self>,
        mut client: Client,
        mut hold: LeaseHold,
        mut asks: mpsc::Receiver<ReleaseAsk>,
    ) {
        /// What woke the task.
        enum Step {
            Ended(HoldEnd),
            Release(Option<ReleaseAsk>),
            Health(Option<LeaseNotice>),
            Renewal(Renewal),
        }
        let lease_id = hold.lease_id().to_owned();
        let mut health = hold.notices();
        let mut renewals = hold.renewal();
        loop {
            let step = tokio::select! {
                end = hold.ended() => Step::Ended(end),
                Some(ask) = asks.recv() => Step::Release(Some(ask)),
                () = self.closing.cancelled() => Step::Release(None),
                notice = health.recv() => Step::Health(notice.ok()),
                Ok(()) = renewals.changed() => Step::Renewal(renewals.borrow_and_update().clone()),
            };
            match step {
                Step::Ended(HoldEnd::Failed(lost))
                    if lost.code.is_transport() && client.is_closed() =>
                {
                    let grant = hold.grant().clone();
                    match self.hold_again(grant, &lost, &mut asks).await {
                        Ok((again, held)) => {
                            client = again;
                            hold = held;
                            health = hold.notices();
                            renewals = hold.renewal();
                        }
                        // The session ended while it connected again: it releases the lease.
                        Err(HoldEnd::Failed(_)) if self.closing.is_cancelled() => {
                            let end = self.release_at_close(None, &lease_id).await;
                            self.settled(&lease_id, &end).await;
                            return;
                        }
                        Err(end) => {
                            self.settled(&lease_id, &end).await;
                            return;
                        }
                    }
                }
                Step::Ended(end) => {
                    self.settled(&lease_id, &end).await;
                    return;
                }
                Step::Release(Some(ask)) => match hold.release_or_keep().await {
                    Ok(end) => {
                        self.settled(&lease_id, &end).await;
                        let _ = ask.send(end);
                        return;
                    }
                    // The daemon cannot be reached (a gateway restarting, a worker's socket
                    // gone): the lease stays held, renewed as before, for the agent to release
                    // again; it did not end.
                    Err((kept, e)) => {
                        hold = kept;
                        let _ = ask.send(HoldEnd::Failed(ContractError::new(
                            ErrorCode::DaemonConnectionLost,
                            format!(
                                "{} ({}); this session keeps lease {lease_id}: release it again \
                                 in a moment",
                                e.message, e.code
                            ),
                        )));
                    }
                },
                Step::Release(None) => {
                    let end = self.release_at_close(Some(hold), &lease_id).await;
                    self.settled(&lease_id, &end).await;
                    return;
                }
                Step::Health(Some(notice)) => self.tell_health(&notice).await,
                Step::Health(None) => {}
                Step::Renewal(renewal) => self.tell_renewal(&lease_id, &renewal).await,
            }
        }
    }

    /// The session ends: releases `lease_id`, through its hold when it has one. While the daemon
    /// cannot be reached (a worker or gateway restarting) it asks again, on a new connection
    /// when the old one closed, backing off up to a second, until the daemon answers or the
    /// close bound ([`CLOSE_BOUND`]) ends the process; the hold renews meanwhile.
    async fn release_at_close(&self, hold: Option<LeaseHold>, lease_id: &str) -> HoldEnd {
        let _renewing = match hold {
            Some(hold) => match hold.release_or_keep().await {
                Ok(end) => return end,
                Err((kept, _)) => Some(kept),
            },
            None => None,
        };
        let mut pause = Duration::from_millis(100);
        loop {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
            let Ok(client) = self.client().await else {
                continue;
            };
            match client.release(lease_id).await {
                Ok(_) => return HoldEnd::Released,
                Err(e) if e.code == ErrorCode::UnknownLease => {
                    return HoldEnd::Lost(LeaseLost {
                        lease_id: lease_id.to_owned(),
                        reason: None,
                    });
                }
                Err(e) if e.code.is_transport() => {}
                Err(e) => return HoldEnd::Failed(e),
            }
        }
    }

    /// Connects again after the daemon of `grant`'s hold went away (`lost`), renews the lease
    /// and holds it on the new connection, telling the client both ways. A release asked
    /// meanwhile is answered that the session is connecting again (the lease stays held). Answers
    /// how the hold ended when the lease is gone, its TTL passed, or the session ends first.
    async fn hold_again(
        &self,
        mut grant: LeaseGrant,
        lost: &ContractError,
        asks: &mut mpsc::Receiver<ReleaseAsk>,
    ) -> Result<(Client, LeaseHold), HoldEnd> {
        let lease_id = grant.lease.id.to_string();
        self.notifier
            .tell(
                Level::Warning,
                json!({
                    "event": "lease-reconnecting",
                    "leaseId": lease_id,
                    "message": format!(
                        "{} ({}); simlock is connecting again to keep lease {lease_id}",
                        lost.message, lost.code
                    ),
                }),
            )
            .await;
        let ttl = Duration::from_millis(grant.lease.ttl_ms.max(1));
        let again =
            crate::lease::reconnect(|| self.client(), &lease_id, ttl, self.closing.cancelled());
        tokio::pin!(again);
        let again = loop {
            tokio::select! {
                again = &mut again => break again,
                Some(ask) = asks.recv() => {
                    let _ = ask.send(HoldEnd::Failed(ContractError::new(
                        ErrorCode::DaemonConnectionLost,
                        format!(
                            "The daemon went away; this session is connecting again to keep \
                             lease {lease_id}: release it again in a moment"
                        ),
                    )));
                }
            }
        };
        match again {
            Reconnected::Held(client, record) => {
                grant.lease = *record;
                self.book.lock().renewed(&grant.lease);
                let hold = client.hold(grant);
                self.notifier
                    .tell(
                        Level::Info,
                        json!({
                            "event": "lease-reconnected",
                            "leaseId": lease_id,
                            "message": format!("connected again; this session holds lease {lease_id}"),
                        }),
                    )
                    .await;
                Ok((client, hold))
            }
            Reconnected::Ended(end) => Err(end),
            Reconnected::Interrupted => Err(HoldEnd::Failed(lost.clone())),
        }
    }

    /// Records how a hold ended and, when the daemon ended it, tells the client.
    async fn settled(&self, lease_id: &str, end: &HoldEnd) {
        self.releases.lock().remove(lease_id);
        let standing = match end {
            HoldEnd::Released => Standing::Released,
            HoldEnd::Lost(LeaseLost { reason, .. }) => Standing::Lost(*reason),
            HoldEnd::Failed(e) => Standing::Failed(e.clone()),
        };
        let settled = self.book.lock().settle(lease_id, standing);
        if let Some(entry) = settled
            && !matches!(entry.standing, Standing::Released)
        {
            self.tell_end(&entry).await;
        }
    }

    /// Releases the session's lease `lease_id` (default: the one it holds).
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` when the lease is not this session's, already ended (saying why), or the
    /// daemon no longer knows it; the release's own failure.
    pub(crate) async fn release(&self, lease_id: Option<&str>) -> Result<String, ContractError> {
        let picked = self
            .book
            .lock()
            .pick_held(lease_id)
            .map(|e| e.lease_id().to_owned());
        let lease_id = match (picked, lease_id) {
            (Ok(id), _) => id,
            (Err(not_ours), Some(named)) if not_ours.code == ErrorCode::UnknownLease => {
                return self.release_left_over(named, not_ours).await;
            }
            (Err(e), _) => return Err(e),
        };
        let asks = self.releases.lock().get(&lease_id).cloned();
        let (tx, rx) = oneshot::channel();
        let sent = match asks {
            Some(asks) => asks.send(tx).await.is_ok(),
            None => false,
        };
        let end = if sent { rx.await.ok() } else { None };
        match end {
            Some(HoldEnd::Released) => Ok(lease_id),
            Some(HoldEnd::Failed(e)) => Err(e),
            // Lost, or the hold ended on its own meanwhile: say how it stands now.
            Some(HoldEnd::Lost(_)) | None => {
                let err = self.book.lock().pick_held(Some(&lease_id)).err();
                Err(err.unwrap_or_else(|| {
                    ContractError::internal(format!("the hold of lease {lease_id} stopped"))
                }))
            }
        }
    }

    /// Releases `lease_id`, which this session does not hold, when it is a lease of this
    /// session's requester that an earlier session left (one killed before it released): the
    /// agent can end it by name instead of waiting out its TTL. Any other lease is `not_ours`.
    async fn release_left_over(
        &self,
        lease_id: &str,
        not_ours: ContractError,
    ) -> Result<String, ContractError> {
        let requester = self.requester.id();
        match self.record(lease_id).await? {
            Some(record) if record.requester_id == requester => {
                let client = self.client().await?;
                client.release(lease_id).await?;
                Ok(lease_id.to_owned())
            }
            _ => Err(not_ours),
        }
    }

    /// `err` with what to do when it is `REQUESTER_ALREADY_LEASED` for a lease this session
    /// does not hold: an earlier session of its requester left it.
    fn explain_left_over(&self, mut err: ContractError) -> ContractError {
        let left = err
            .details
            .as_ref()
            .and_then(|d| d.get("existingLeaseId"))
            .and_then(Value::as_str)
            .filter(|id| self.book.lock().pick(Some(id)).is_err())
            .map(str::to_owned);
        if err.code == ErrorCode::RequesterAlreadyLeased
            && let Some(id) = left
        {
            err.message = format!(
                "{}: an earlier session of this requester left it (ended without releasing it); \
                 release_simulator with leaseId {id} ends it now",
                err.message
            );
        }
        err
    }

    /// The daemon's current record of a held lease (`None`: the daemon no longer lists it).
    ///
    /// # Errors
    /// The connection's or the call's failure.
    pub(crate) async fn record(
        &self,
        lease_id: &str,
    ) -> Result<Option<LeaseRecord>, ContractError> {
        let client = self.client().await?;
        let list = client.leases().await?;
        Ok(list.leases.into_iter().find(|l| l.id.as_str() == lease_id))
    }

    /// Ends the session: withdraws pending requests and releases every held lease, waiting at
    /// most [`CLOSE_BOUND`]. Answers the leases it held, each with how it stands now.
    pub(crate) async fn close(&self) -> Vec<(String, Standing)> {
        let before: Vec<String> =
            self.with_book(|b| b.held().map(|e| e.lease_id().to_owned()).collect());
        self.closing.cancel();
        self.tasks.close();
        if tokio::time::timeout(CLOSE_BOUND, self.tasks.wait())
            .await
            .is_err()
        {
            crate::say_err(&format!(
                "simlock mcp: the session's releases did not finish within {}; leases left expire on their TTL",
                view::duration(u64::try_from(CLOSE_BOUND.as_millis()).unwrap_or(u64::MAX))
            ));
        }
        self.with_book(|b| {
            before
                .into_iter()
                .map(|id| {
                    let standing = b
                        .entries()
                        .find(|e| e.lease_id() == id)
                        .map_or(Standing::Held, |e| e.standing.clone());
                    (id, standing)
                })
                .collect()
        })
    }

    /// Tells the client the daemon ended a lease of the session.
    async fn tell_end(&self, entry: &Entry) {
        let lease = entry.lease_id();
        let device = &entry.grant.device;
        let (event, level, reason) = match &entry.standing {
            Standing::Lost(reason) => (
                "lease-lost",
                Level::Warning,
                reason.map(|r| view::value_name(&r)),
            ),
            Standing::Failed(_) => ("lease-failed", Level::Error, None),
            Standing::Held | Standing::Released => return,
        };
        let mut data = json!({
            "event": event,
            "leaseId": lease,
            "deviceId": device.id,
            "requesterId": entry.grant.lease.requester_id,
            "message": format!(
                "simlock ended lease {lease}: {}; this session no longer holds device {} ({} {})",
                entry.standing.why(),
                device.id,
                device.spec.model,
                device.spec.os_version,
            ),
        });
        if let (Some(reason), Some(map)) = (reason, data.as_object_mut()) {
            map.insert("reason".into(), Value::from(reason));
        }
        self.notifier.tell(level, data).await;
    }

    /// Tells the client that renewing its lease started failing (the daemon, or the lease's
    /// worker behind a gateway, out of reach: the session keeps trying until the TTL runs out),
    /// or goes through again: the notifications of a session that connects again.
    async fn tell_renewal(&self, lease_id: &str, renewal: &Renewal) {
        let (level, data) = match renewal {
            Renewal::Retrying { error, deadline } => {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                (
                    Level::Warning,
                    json!({
                        "event": "lease-reconnecting",
                        "leaseId": lease_id,
                        "message": format!(
                            "renewing lease {lease_id} failed: {} ({}); simlock keeps trying, \
                             for {} more before its TTL runs out",
                            error.message,
                            error.code,
                            view::duration(u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
                        ),
                    }),
                )
            }
            Renewal::Renewing => (
                Level::Info,
                json!({
                    "event": "lease-reconnected",
                    "leaseId": lease_id,
                    "message": format!("renewed again; this session holds lease {lease_id}"),
                }),
            ),
        };
        self.notifier.tell(level, data).await;
    }

    /// Tells the client about its device's health.
    async fn tell_health(&self, notice: &LeaseNotice) {
        let (level, message) = match notice {
            LeaseNotice::Unhealthy { device_id, .. } => (
                Level::Warning,
                format!(
                    "device {device_id} crashed; simlock is booting it again under the same lease \
                     (apps, log streams and port forwards on it are gone)"
                ),
            ),
            LeaseNotice::Recovered {
                device_id,
                attempts,
                ..
            } => (
                Level::Info,
                format!("device {device_id} is ready again after {attempts} attempt(s)"),
            ),
            LeaseNotice::Lost { .. } => return,
        };
        let push = notice.clone().into_push();
        let mut data = json!({ "event": push.kind(), "message": message });
        if let (Ok(Value::Object(payload)), Some(map)) = (push.payload(), data.as_object_mut()) {
            map.extend(payload);
        }
        self.notifier.tell(level, data).await;
    }
}

/// Sends each progress of `rx` through `send` (its count, rising, and its words), and the last
/// one again, with how long it has stood, after `again` with nothing new; until `rx` ends or
/// `send` answers false (the client is gone).
async fn pace<F, Fut>(mut rx: mpsc::Receiver<Progress>, again: Duration, mut send: F)
where
    F: FnMut(f64, String) -> Fut,
    Fut: Future<Output = bool>,
{
    /// The last progress, when it came, and when it was last told.
    struct Standing {
        progress: Progress,
        since: tokio::time::Instant,
        told: tokio::time::Instant,
    }
    let mut count = 0.0_f64;
    let mut last: Option<Standing> = None;
    loop {
        let repeat_at = last.as_ref().map(|l| l.told + again);
        let next = tokio::select! {
            progress = rx.recv() => match progress {
                Some(progress) => Some(progress),
                None => return,
            },
            () = async {
                match repeat_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => None,
        };
        let now = tokio::time::Instant::now();
        let message = match (next, last.as_mut()) {
            (Some(progress), _) => {
                last = Some(Standing {
                    progress,
                    since: now,
                    told: now,
                });
                crate::stderr::describe(&progress)
            }
            (None, Some(standing)) => {
                standing.told = now;
                let stood = u64::try_from(now.duration_since(standing.since).as_millis())
                    .unwrap_or(u64::MAX);
                format!(
                    "{} (so for {})",
                    crate::stderr::describe(&standing.progress),
                    view::duration(stood)
                )
            }
            (None, None) => continue,
        };
        count += 1.0;
        if !send(count, message).await {
            return;
        }
    }
}

/// `CANCELLED` for a request that comes as the session ends.
fn ending() -> ContractError {
    ContractError::new(ErrorCode::Cancelled, "The MCP session is ending")
}

#[cfg(test)]
mod tests {
    use simlock_contract::push::WaitingFor;

    use super::*;

    /// Outside trial 24: a long wait in the queue sent one progress notification, and MCP
    /// clients that give up after 60 s without one gave up on the call. The last progress is
    /// told again every 20 s with nothing new, with how long it has stood; each count rises.
    #[tokio::test(start_paused = true)]
    async fn a_wait_with_nothing_new_is_told_again_every_interval() {
        let (tx, rx) = mpsc::channel(4);
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&sent);
        let pacing = tokio::spawn(pace(rx, PROGRESS_AGAIN, move |count, message| {
            log.lock()
                .push((count, message, tokio::time::Instant::now()));
            async { true }
        }));
        let start = tokio::time::Instant::now();
        let queued = Progress::Queued {
            queue_position: 2,
            waiting_for: Some(WaitingFor::Capacity),
        };
        tx.send(queued).await.unwrap();
        tokio::time::sleep(Duration::from_secs(45)).await;
        tx.send(Progress::Booting { eta_ms: 20_000 }).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(tx);
        pacing.await.unwrap();
        let sent = sent.lock();
        let at: Vec<(f64, u64)> = sent
            .iter()
            .map(|(count, _, when)| (*count, when.duration_since(start).as_secs()))
            .collect();
        assert_eq!(at, [(1.0, 0), (2.0, 20), (3.0, 40), (4.0, 45)]);
        assert_eq!(sent[0].1, crate::stderr::describe(&queued));
        assert_eq!(
            sent[2].1,
            format!("{} (so for 40s)", crate::stderr::describe(&queued))
        );
        assert!(sent[3].1.starts_with("booting"), "{}", sent[3].1);
    }

    /// A client that is gone ends the pacing.
    #[tokio::test(start_paused = true)]
    async fn a_gone_client_ends_the_pacing() {
        let (tx, rx) = mpsc::channel(4);
        tx.send(Progress::Booting { eta_ms: 1 }).await.unwrap();
        let pacing = tokio::spawn(pace(rx, PROGRESS_AGAIN, |_, _| async { false }));
        // Within one interval (paused time): a pacing that went on would tell it again.
        tokio::time::timeout(PROGRESS_AGAIN, pacing)
            .await
            .expect("the pacing ended")
            .unwrap();
        drop(tx);
    }
}
