//! `simlock lease`: request a device, print the grant, then hold it (renew at a third of its
//! TTL) until Ctrl-C or SIGTERM releases it, the process named by `--bind-pid` exits (which
//! releases it too), or the daemon ends it (exit 14). `--detach` prints the grant and leaves the
//! lease to its TTL. With no `--requester`, the lease is for the agent session or the parent
//! process (`identity`). A hold on the local socket whose daemon restarts (its connection lost)
//! connects again and keeps the lease, which the daemon kept, until the lease's TTL would have
//! run out.

use std::time::Duration;

use simlock_client::{Client, HoldEnd, LeaseLost, Renewal};
use simlock_contract::model::LeaseRecord;
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::{ContractError, ErrorCode};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::Target;
use crate::cli::LeaseArgs;
use crate::identity;
use crate::pidwatch::Bound;
use crate::stderr::{RenewalLine, Reporter};
use crate::view;

/// The exit code of a held lease the daemon ended.
const EXIT_LEASE_LOST: u8 = 14;
/// The exit code of a request an interrupt (SIGINT, SIGTERM or SIGHUP) ended before it was
/// held: withdrawn, given back if it was granted meanwhile, or left to its TTL after a second
/// interrupt (128 + SIGINT, as a shell reports a process Ctrl-C ended).
const EXIT_INTERRUPTED: u8 = 130;

/// SIGINT, SIGTERM and SIGHUP, counted.
#[derive(Debug)]
pub(crate) struct Signals {
    count: watch::Receiver<u32>,
}

impl Signals {
    /// Starts counting SIGINT, SIGTERM and SIGHUP (they no longer end the process by
    /// themselves): closing the terminal a hold runs in releases its lease, as Ctrl-C does.
    pub(crate) fn listen() -> Result<Self, ContractError> {
        let failed =
            |e: std::io::Error| ContractError::internal(format!("cannot watch signals: {e}"));
        let mut interrupt = signal(SignalKind::interrupt()).map_err(failed)?;
        let mut terminate = signal(SignalKind::terminate()).map_err(failed)?;
        let mut hangup = signal(SignalKind::hangup()).map_err(failed)?;
        let (tx, count) = watch::channel(0u32);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    Some(()) = interrupt.recv() => {}
                    Some(()) = terminate.recv() => {}
                    Some(()) = hangup.recv() => {}
                    else => break,
                }
                tx.send_modify(|n| *n += 1);
            }
        });
        Ok(Self { count })
    }

    /// How many signals came so far.
    pub(crate) fn count(&self) -> u32 {
        *self.count.borrow()
    }

    /// Resolves once `n` signals came in all.
    pub(crate) async fn nth(&self, n: u32) {
        let mut count = self.count.clone();
        if count.wait_for(|c| *c >= n).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

fn request_input(args: &LeaseArgs, requester: String) -> LeaseRequestInput {
    let mut input = LeaseRequestInput::for_platform(args.platform.into());
    input.model = args.device.clone();
    input.os_version = args.os.clone();
    input.ttl_ms = args.ttl;
    input.timeout_ms = args.timeout;
    input.no_wait = args.no_wait.then_some(true);
    input.requester_id = Some(requester);
    input.requires = args.requires.clone();
    input
}

/// Resolves once `bound` is gone, looking at least every `period`; never without a binding.
async fn unbound(bound: Option<Bound>, period: Duration) {
    match bound {
        Some(bound) => bound.gone(period).await,
        None => std::future::pending().await,
    }
}

pub(crate) async fn run(
    json: bool,
    target: &Target,
    mut client: Client,
    args: &LeaseArgs,
) -> Result<u8, ContractError> {
    let bound = args.bind_pid.map(Bound::pid).transpose()?;
    let signals = Signals::listen()?;
    let reporter = Reporter::for_stderr();
    let requester = identity::from_environment(args.requester.as_deref());
    reporter.say(&format!(
        "requesting a device for {} ({})",
        requester.id(),
        requester.source()
    ));
    // A bound process that exits while the request waits withdraws it, as an interrupt does.
    let withdraw = || async {
        tokio::select! {
            () = signals.nth(1) => {}
            () = unbound(bound, crate::pidwatch::CHECK_EVERY) => {}
        }
    };
    let asked_at = tokio::time::Instant::now();
    // Past this, a request whose daemon went away is not asked again.
    let ask_until = asked_at
        + args
            .timeout
            .map_or(ASK_AGAIN_FOR, Duration::from_millis)
            .min(ASK_AGAIN_FOR);
    let requested = loop {
        // Asked again, the request waits only what is left of its --timeout.
        let mut input = request_input(args, requester.id());
        input.timeout_ms = args.timeout.map(|t| {
            let spent = u64::try_from(asked_at.elapsed().as_millis()).unwrap_or(u64::MAX);
            t.saturating_sub(spent).max(1)
        });
        let outcome = tokio::select! {
            outcome = client.request_lease(input, |p| reporter.progress(p), withdraw()) => outcome,
            () = signals.nth(2) => {
                reporter.done();
                crate::say_err("simlock: interrupted again; the daemon may still grant the request, and the lease then expires on its TTL");
                return Ok(EXIT_INTERRUPTED);
            }
        };
        // The socket's daemon went away while the request waited (a restart ends its waiting
        // requests): ask the next daemon on this home, as a hold connects again.
        match outcome {
            Err(e) if e.code.is_transport() && client.is_closed() && signals.count() == 0 => {
                reporter.say(&format!(
                    "{}; the request ended with it: asking again once the daemon is back (its \
                     place in the queue is not kept)",
                    e.message
                ));
                let left = ask_until.saturating_duration_since(tokio::time::Instant::now());
                match with_backoff(left, withdraw(), || target.connect()).await {
                    Some(Ok(again)) => client = again,
                    Some(Err(last)) => break Err(last),
                    // Withdrawn (an interrupt, or the bound process exited) before the daemon
                    // was back: the request had ended with the daemon.
                    None => {
                        break Err(ContractError::new(
                            ErrorCode::Cancelled,
                            format!("{}; withdrawn before the daemon was back", e.message),
                        ));
                    }
                }
            }
            other => break other,
        }
    };
    reporter.done();
    let interrupted = |message: String| {
        crate::fail(json, &ContractError::new(ErrorCode::Cancelled, message));
        Ok(EXIT_INTERRUPTED)
    };
    let grant = match requested {
        // Withdrawn, or ended with its connection (a daemon that went away ends the requests
        // waiting on it) after the interrupt.
        Err(e)
            if signals.count() > 0 && (e.code == ErrorCode::Cancelled || e.code.is_transport()) =>
        {
            return interrupted("interrupted; the request was withdrawn".into());
        }
        other => other.map_err(|e| requester.explain(e))?,
    };
    let lease_id = grant.lease.id.to_string();
    if signals.count() > 0 {
        // The request settled before the interrupt could withdraw it: give the lease back.
        return interrupted(match client.release(&lease_id).await {
            Ok(_) => format!("interrupted; lease {lease_id} was granted meanwhile and released"),
            Err(e) => format!(
                "interrupted; lease {lease_id} was granted meanwhile and could not be released \
                 ({e}); it expires on its TTL"
            ),
        });
    }
    if args.detach {
        if !crate::emit(json, &grant, view::grant) {
            return Ok(unreported(&client, &lease_id).await);
        }
        return Ok(0);
    }
    // Hold first, then print: a notice that comes once the grant is out is not missed.
    let mut hold = client.hold(grant.clone());
    let mut notices = hold.notices();
    let mut renewals = hold.renewal();
    if !crate::emit(json, hold.grant(), view::grant) {
        drop(hold);
        return Ok(unreported(&client, &lease_id).await);
    }
    let renewal = Duration::from_millis(hold.grant().lease.ttl_ms / 3);
    reporter.say(&format!(
        "holding lease {lease_id}: renewing every {}; Ctrl-C releases it{}",
        view::duration(hold.grant().lease.ttl_ms / 3),
        bound
            .map(|b| format!(", and so does the end of {}", b.describe()))
            .unwrap_or_default()
    ));
    loop {
        let release_now = async {
            tokio::select! {
                () = signals.nth(1) => {}
                () = unbound(bound, renewal) => {
                    reporter.say(&format!("{} exited; releasing lease {lease_id}", bound.map(|b| b.describe()).unwrap_or_default()));
                }
            }
        };
        tokio::select! {
            end = hold.ended() => match end {
                // The socket's daemon went away (a restart): the lease outlives the connection.
                HoldEnd::Failed(e) if e.code.is_transport() && client.is_closed() => {
                    reporter.say(&format!("{e}; connecting again to keep lease {lease_id}"));
                    let ttl = Duration::from_millis(grant.lease.ttl_ms.max(1));
                    match reconnect(|| target.connect(), &lease_id, ttl, signals.nth(1)).await {
                        Reconnected::Held(again, record) => {
                            reporter.say(&format!("connected again; holding lease {lease_id}"));
                            client = again;
                            let mut renewed = grant.clone();
                            renewed.lease = *record;
                            hold = client.hold(renewed);
                            notices = hold.notices();
                            renewals = hold.renewal();
                        }
                        Reconnected::Ended(end) => return Ok(ended(&lease_id, end, Ending::Holding)),
                        Reconnected::Interrupted => {
                            crate::say_err(&format!("simlock: interrupted while connecting again; lease {lease_id} expires on its TTL"));
                            return Ok(EXIT_INTERRUPTED);
                        }
                    }
                }
                end => return Ok(ended(&lease_id, end, Ending::Holding)),
            },
            notice = notices.recv() => {
                if let Ok(notice) = notice {
                    reporter.notice(&notice);
                }
            }
            Ok(()) = renewals.changed() => {
                let (said, fields) = match &*renewals.borrow_and_update() {
                    Renewal::Retrying { error, deadline } => {
                        let left = u64::try_from(
                            deadline.saturating_duration_since(tokio::time::Instant::now()).as_millis()
                        )
                        .unwrap_or(u64::MAX);
                        (
                            format!(
                                "renewing lease {lease_id} failed: {} ({}); retrying until its TTL runs out in {}",
                                error.message,
                                error.code,
                                view::duration(left)
                            ),
                            RenewalLine::Retrying {
                                lease_id: grant.lease.id.clone(),
                                error: error.to_body(),
                                expires_in_ms: left,
                            },
                        )
                    }
                    Renewal::Renewing => (
                        format!("renewed lease {lease_id} again"),
                        RenewalLine::Renewing {
                            lease_id: grant.lease.id.clone(),
                        },
                    ),
                };
                reporter.renewal(&said, fields);
            }
            () = release_now => {
                let end = tokio::select! {
                    end = hold.release() => end,
                    () = signals.nth(2) => {
                        crate::say_err(&format!("simlock: interrupted again; lease {lease_id} expires on its TTL"));
                        return Ok(EXIT_INTERRUPTED);
                    }
                };
                if end == HoldEnd::Released {
                    reporter.say(&format!("released lease {lease_id}"));
                }
                return Ok(ended(&lease_id, end, Ending::Releasing));
            }
        }
    }
}

/// A grant whose report could not be written (stdout on a full disk, a closed pipe): nobody
/// can use or release a lease they were not told of, so it is given back. Exit 1.
async fn unreported(client: &Client, lease_id: &str) -> u8 {
    match client.release(lease_id).await {
        Ok(_) => crate::say_err(&format!(
            "simlock: lease {lease_id} was granted, but its grant could not be written; it was released"
        )),
        Err(e) => crate::say_err(&format!(
            "simlock: lease {lease_id} was granted, but its grant could not be written, and it could \
             not be released ({e}); it expires on its TTL"
        )),
    }
    1
}

/// How connecting again for a hold turned out.
pub(crate) enum Reconnected {
    /// Connected, and the lease renewed: hold it on this client.
    Held(Client, Box<LeaseRecord>),
    /// The lease is gone, or it could not be reached before its TTL would have run out.
    Ended(HoldEnd),
    /// `abort` came first.
    Interrupted,
}

/// The first wait before connecting again, doubled up to [`RECONNECT_MAX`].
const RECONNECT_FIRST: Duration = Duration::from_millis(250);
/// The longest wait between two tries.
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// The longest a waiting `simlock lease` whose daemon went away tries to ask the next one (its
/// `--timeout`, when shorter).
const ASK_AGAIN_FOR: Duration = Duration::from_secs(15 * 60);

/// Runs `attempt` after a wait that doubles from [`RECONNECT_FIRST`] to [`RECONNECT_MAX`], again
/// while it fails with a transport error, until it answers anything else or `left` has passed
/// (then its last failure). `None` when `abort` came first.
async fn with_backoff<T, A, Fut>(
    left: Duration,
    abort: impl Future<Output = ()>,
    mut attempt: A,
) -> Option<Result<T, ContractError>>
where
    A: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ContractError>>,
{
    let deadline = tokio::time::Instant::now() + left;
    let mut wait = RECONNECT_FIRST;
    tokio::pin!(abort);
    loop {
        let outcome = tokio::select! {
            () = &mut abort => return None,
            () = tokio::time::sleep(wait) => attempt().await,
        };
        match outcome {
            Err(e) if e.code.is_transport() && tokio::time::Instant::now() + wait < deadline => {
                wait = (wait * 2).min(RECONNECT_MAX);
            }
            answered => return Some(answered),
        }
    }
}

/// Connects again (`connect`, which reads the daemon's new admin secret) and renews `lease_id`,
/// after a hold on the socket lost its daemon (a restart keeps the lease). Tries until `ttl` has
/// passed (past it the lease has expired whatever happens) or `abort` comes. The CLI's hold and
/// each lease of an MCP session use it.
pub(crate) async fn reconnect<F, C>(
    connect: C,
    lease_id: &str,
    ttl: Duration,
    abort: impl Future<Output = ()>,
) -> Reconnected
where
    C: Fn() -> F,
    F: Future<Output = Result<Client, ContractError>>,
{
    let renewed = with_backoff(ttl, abort, || async {
        let client = connect().await?;
        match client.renew(lease_id, None).await {
            Ok(record) => Ok((client, record)),
            Err(e) => {
                client.close();
                Err(e)
            }
        }
    })
    .await;
    match renewed {
        None => Reconnected::Interrupted,
        Some(Ok((client, record))) => Reconnected::Held(client, Box::new(record)),
        Some(Err(e)) if e.code == ErrorCode::UnknownLease => {
            Reconnected::Ended(HoldEnd::Lost(LeaseLost {
                lease_id: lease_id.to_owned(),
                reason: None,
            }))
        }
        Some(Err(e)) => Reconnected::Ended(HoldEnd::Failed(e)),
    }
}

/// What a hold was doing when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Renewing the lease.
    Holding,
    /// Releasing it (Ctrl-C, or the bound process exited).
    Releasing,
}

/// The exit of a hold. The grant is already on stdout (with `--json`, its one document), so
/// how the hold ended is told on stderr only.
fn ended(lease_id: &str, end: HoldEnd, ending: Ending) -> u8 {
    match end {
        HoldEnd::Released => 0,
        HoldEnd::Lost(LeaseLost { reason, .. }) => {
            let why = reason.map_or_else(|| "it is gone".to_owned(), |r| view::value_name(&r));
            crate::say_err(&format!(
                "simlock: the daemon ended lease {lease_id} ({why})"
            ));
            EXIT_LEASE_LOST
        }
        HoldEnd::Failed(err) => {
            let what = match ending {
                Ending::Holding => "could not be renewed",
                Ending::Releasing => "could not be released",
            };
            crate::say_err(&format!(
                "simlock: lease {lease_id} {what}: {} ({}); it expires on its TTL if it has not \
                 already",
                err.message, err.code
            ));
            err.code.exit_code()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    fn lost() -> ContractError {
        ContractError::new(ErrorCode::DaemonConnectionLost, "gone")
    }

    #[tokio::test(start_paused = true)]
    async fn the_backoff_doubles_to_its_cap_and_answers_the_last_failure_past_its_bound() {
        let tries = Cell::new(0_u32);
        let started = tokio::time::Instant::now();
        let outcome = with_backoff(Duration::from_secs(10), std::future::pending(), || {
            tries.set(tries.get() + 1);
            async { Err::<(), _>(lost()) }
        })
        .await;
        assert_eq!(outcome, Some(Err(lost())));
        // Tries at 0.25, 0.75, 1.75, 3.75, 5.75, 7.75 and 9.75 s; an eighth would be past 10 s.
        assert_eq!(tries.get(), 7);
        assert_eq!(started.elapsed(), Duration::from_millis(9_750));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_is_not_a_lost_connection_ends_it_and_an_abort_comes_first() {
        let refused = ContractError::new(ErrorCode::UnknownLease, "no");
        let outcome = with_backoff(Duration::from_secs(10), std::future::pending(), || {
            let refused = refused.clone();
            async move { Err::<(), _>(refused) }
        })
        .await;
        assert_eq!(outcome, Some(Err(refused)));
        let aborted = with_backoff(
            Duration::from_secs(10),
            tokio::time::sleep(Duration::from_millis(100)),
            || async { Ok::<_, ContractError>(()) },
        )
        .await;
        assert_eq!(aborted, None, "the abort came before the first try");
    }
}
