//! `simlock lease`: request a device, print the grant, then hold it (renew at a third of its
//! TTL) until Ctrl-C or SIGTERM releases it, the process named by `--bind-pid` exits (which
//! releases it too), or the daemon ends it (exit 14). `--detach` prints the grant and leaves the
//! lease to its TTL. With no `--requester`, the lease is for the agent session or the parent
//! process (`identity`).

use simlock_client::{Client, HoldEnd, LeaseLost};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::{ContractError, ErrorCode};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::cli::LeaseArgs;
use crate::identity;
use crate::pidwatch::Bound;
use crate::stderr::Reporter;
use crate::view;

/// The exit code of a held lease the daemon ended.
const EXIT_LEASE_LOST: u8 = 14;
/// The exit code after a second interrupt gave up waiting.
const EXIT_INTERRUPTED: u8 = 130;

/// SIGINT and SIGTERM, counted.
#[derive(Debug)]
pub(crate) struct Signals {
    count: watch::Receiver<u32>,
}

impl Signals {
    /// Starts counting SIGINT and SIGTERM (they no longer end the process by themselves).
    pub(crate) fn listen() -> Result<Self, ContractError> {
        let failed =
            |e: std::io::Error| ContractError::internal(format!("cannot watch signals: {e}"));
        let mut interrupt = signal(SignalKind::interrupt()).map_err(failed)?;
        let mut terminate = signal(SignalKind::terminate()).map_err(failed)?;
        let (tx, count) = watch::channel(0u32);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    Some(()) = interrupt.recv() => {}
                    Some(()) = terminate.recv() => {}
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
async fn unbound(bound: Option<Bound>, period: std::time::Duration) {
    match bound {
        Some(bound) => bound.gone(period).await,
        None => std::future::pending().await,
    }
}

pub(crate) async fn run(
    json: bool,
    client: &Client,
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
    let withdraw = async {
        tokio::select! {
            () = signals.nth(1) => {}
            () = unbound(bound, crate::pidwatch::CHECK_EVERY) => {}
        }
    };
    let requested = tokio::select! {
        outcome = client.request_lease(request_input(args, requester.id()), |p| reporter.progress(p), withdraw) => outcome,
        () = signals.nth(2) => {
            reporter.done();
            eprintln!("simlock: interrupted again; the daemon may still grant the request, and the lease then expires on its TTL");
            return Ok(EXIT_INTERRUPTED);
        }
    };
    reporter.done();
    let grant = requested?;
    let lease_id = grant.lease.id.to_string();
    if signals.count() > 0 {
        // The request settled before the interrupt could withdraw it: give the lease back.
        let message = match client.release(&lease_id).await {
            Ok(_) => format!("interrupted; lease {lease_id} was granted meanwhile and released"),
            Err(e) => format!(
                "interrupted; lease {lease_id} was granted meanwhile and could not be released \
                 ({e}); it expires on its TTL"
            ),
        };
        return Err(ContractError::new(ErrorCode::Cancelled, message));
    }
    if args.detach {
        crate::emit(json, &grant, view::grant);
        return Ok(0);
    }
    // Hold first, then print: a notice that comes once the grant is out is not missed.
    let mut hold = client.hold(grant);
    let mut notices = hold.notices();
    crate::emit(json, hold.grant(), view::grant);
    let renewal = std::time::Duration::from_millis(hold.grant().lease.ttl_ms / 3);
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
            end = hold.ended() => return Ok(ended(&lease_id, end)),
            notice = notices.recv() => {
                if let Ok(notice) = notice {
                    reporter.notice(&notice);
                }
            }
            () = release_now => {
                let end = tokio::select! {
                    end = hold.release() => end,
                    () = signals.nth(2) => {
                        eprintln!("simlock: interrupted again; lease {lease_id} expires on its TTL");
                        return Ok(EXIT_INTERRUPTED);
                    }
                };
                if end == HoldEnd::Released {
                    reporter.say(&format!("released lease {lease_id}"));
                }
                return Ok(ended(&lease_id, end));
            }
        }
    }
}

/// The exit of a hold. The grant is already on stdout (with `--json`, its one document), so
/// how the hold ended is told on stderr only.
fn ended(lease_id: &str, end: HoldEnd) -> u8 {
    match end {
        HoldEnd::Released => 0,
        HoldEnd::Lost(LeaseLost { reason, .. }) => {
            let why = reason.map_or_else(|| "it is gone".to_owned(), |r| view::value_name(&r));
            eprintln!("simlock: the daemon ended lease {lease_id} ({why})");
            EXIT_LEASE_LOST
        }
        HoldEnd::Failed(err) => crate::fail(false, &err),
    }
}
