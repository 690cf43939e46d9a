//! `simlock lease`: request a device, print the grant, then hold it (renew at a third of its
//! TTL) until Ctrl-C or SIGTERM releases it, or the daemon ends it (exit 14). `--detach` prints
//! the grant and leaves the lease to its TTL.

use std::io::Write as _;

use simlock_client::{Client, HoldEnd, LeaseLost};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::{ContractError, ErrorCode};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::cli::LeaseArgs;
use crate::stderr::Reporter;
use crate::view;

/// The exit code of a held lease the daemon ended.
pub(crate) const EXIT_LEASE_LOST: u8 = 14;
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

fn request_input(args: &LeaseArgs) -> LeaseRequestInput {
    let mut input = LeaseRequestInput::for_platform(args.platform.into());
    input.model = args.device.clone();
    input.os_version = args.os.clone();
    input.ttl_ms = args.ttl;
    input.timeout_ms = args.timeout;
    input.no_wait = args.no_wait.then_some(true);
    input.requester_id = args.requester.clone().filter(|r| !r.trim().is_empty());
    input.requires = args.requires.clone();
    input
}

pub(crate) async fn run(
    json: bool,
    client: &Client,
    args: &LeaseArgs,
) -> Result<u8, ContractError> {
    let signals = Signals::listen()?;
    let reporter = Reporter::for_stderr();
    let requested = tokio::select! {
        outcome = client.request_lease(request_input(args), |p| reporter.progress(p), signals.nth(1)) => outcome,
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
        let _ = client.release(&lease_id).await;
        return Err(ContractError::new(
            ErrorCode::Cancelled,
            format!("interrupted; lease {lease_id} was granted meanwhile and released"),
        ));
    }
    crate::emit(json, &grant, view::grant);
    if args.detach {
        return Ok(0);
    }
    reporter.say(&format!(
        "holding lease {lease_id}: renewing every {}; Ctrl-C releases it",
        view::duration(grant.lease.ttl_ms / 3)
    ));
    let mut hold = client.hold(grant);
    let mut notices = hold.notices();
    loop {
        tokio::select! {
            end = hold.ended() => return ended(&lease_id, end),
            notice = notices.recv() => {
                if let Ok(notice) = notice {
                    reporter.notice(&notice);
                }
            }
            () = signals.nth(1) => {
                let released = tokio::select! {
                    end = hold.release() => end,
                    () = signals.nth(2) => {
                        eprintln!("simlock: interrupted again; lease {lease_id} expires on its TTL");
                        return Ok(EXIT_INTERRUPTED);
                    }
                };
                if released == HoldEnd::Released {
                    reporter.say(&format!("released lease {lease_id}"));
                    let _ = std::io::stderr().flush();
                    return Ok(0);
                }
                return ended(&lease_id, released);
            }
        }
    }
}

/// The exit of a hold that ended by itself.
fn ended(lease_id: &str, end: HoldEnd) -> Result<u8, ContractError> {
    match end {
        HoldEnd::Released => Ok(0),
        HoldEnd::Lost(LeaseLost { reason, .. }) => {
            let why = reason.map_or_else(
                || "it is gone".to_owned(),
                |r| {
                    serde_json::to_value(r)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
                },
            );
            eprintln!("simlock: the daemon ended lease {lease_id} ({why})");
            Ok(EXIT_LEASE_LOST)
        }
        HoldEnd::Failed(err) => Err(err),
    }
}
