//! What the CLI says on stderr while it works: progress and lease notices, as JSON lines when
//! stderr is not a terminal (another program reads it), as a spinner and sentences when it is.

use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::{Map, Value, json};
use simlock_client::LeaseNotice;
use simlock_contract::ErrorBody;
use simlock_contract::ids::LeaseId;
use simlock_contract::push::{Progress, WaitingFor};

use crate::view;

/// How renewing a held lease goes, as a program reading stderr reads it:
/// `{"renewal": {"state": "retrying", "leaseId", "error", "expiresInMs"}}`, then
/// `{"renewal": {"state": "renewing", "leaseId"}}` once a renewal goes through again.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "state", rename_all = "camelCase")]
pub(crate) enum RenewalLine {
    /// A renewal failed and is tried again until the lease's TTL runs out.
    #[serde(rename_all = "camelCase")]
    Retrying {
        /// The lease.
        lease_id: LeaseId,
        /// Why the last renewal failed.
        error: ErrorBody,
        /// How long the lease has left.
        expires_in_ms: u64,
    },
    /// Renewals go through again.
    #[serde(rename_all = "camelCase")]
    Renewing {
        /// The lease.
        lease_id: LeaseId,
    },
}

/// Where progress goes.
#[derive(Debug)]
pub(crate) enum Reporter {
    /// JSON lines.
    Lines,
    /// A spinner on a terminal.
    Spinner(ProgressBar),
}

impl Reporter {
    /// A spinner on a terminal, JSON lines elsewhere.
    pub(crate) fn for_stderr() -> Self {
        if !std::io::stderr().is_terminal() {
            return Self::Lines;
        }
        let bar = ProgressBar::new_spinner();
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
            bar.set_style(style);
        }
        bar.set_message("requesting a device");
        bar.enable_steady_tick(Duration::from_millis(120));
        Self::Spinner(bar)
    }

    /// Whether a person is reading.
    pub(crate) const fn is_terminal(&self) -> bool {
        matches!(self, Self::Spinner(_))
    }

    /// Shows one progress.
    pub(crate) fn progress(&self, progress: &Progress) {
        match self {
            Self::Lines => {
                let value = serde_json::to_value(progress).unwrap_or_default();
                crate::say_err(&format!("{}", json!({ "progress": value })));
            }
            Self::Spinner(bar) => bar.set_message(describe(progress)),
        }
    }

    /// Clears the spinner.
    pub(crate) fn done(&self) {
        if let Self::Spinner(bar) = self {
            bar.finish_and_clear();
        }
    }

    /// Says something to a person (nothing when a program reads stderr), on a line of its own
    /// above a running spinner.
    pub(crate) fn say(&self, text: &str) {
        if let Self::Spinner(bar) = self {
            bar.suspend(|| crate::say_err(text));
        }
    }

    /// Says how renewing a held lease goes: `text` to a person, `{"renewal": line}` to a
    /// program reading stderr (so a log shows renewals failing before the lease is lost).
    pub(crate) fn renewal(&self, text: &str, line: RenewalLine) {
        if self.is_terminal() {
            self.say(text);
        } else {
            crate::say_err(&json!({ "renewal": line }).to_string());
        }
    }

    /// Shows a lease notice.
    pub(crate) fn notice(&self, notice: &LeaseNotice) {
        if !self.is_terminal() {
            // The push's own wire form, named by its kind: {"event", ...payload}.
            let push = notice.clone().into_push();
            let mut fields = Map::new();
            fields.insert("event".into(), Value::from(push.kind()));
            if let Ok(Value::Object(payload)) = push.payload() {
                fields.extend(payload);
            }
            crate::say_err(&format!("{}", json!({ "notice": fields })));
            return;
        }
        let line = match notice {
            LeaseNotice::Lost { lease_id, .. } => format!("lease {lease_id} was lost"),
            LeaseNotice::Unhealthy { device_id, .. } => {
                format!("device {device_id} crashed; simlock is recovering it under the same lease")
            }
            LeaseNotice::Recovered {
                device_id,
                attempts,
                ..
            } => format!("device {device_id} recovered after {attempts} attempt(s)"),
        };
        self.say(&line);
    }
}

/// A progress in words, for the spinner and for MCP progress notifications.
pub(crate) fn describe(progress: &Progress) -> String {
    match progress {
        Progress::Queued {
            queue_position,
            waiting_for,
        } => {
            let mut out = format!("waiting for a device: position {queue_position} in the queue");
            match waiting_for {
                None | Some(WaitingFor::Unknown) => {}
                Some(WaitingFor::Capacity) => {
                    out.push_str("; every device that may run is in use");
                }
                Some(WaitingFor::NoWorker) => {
                    out.push_str(
                        "; no worker that can serve it takes requests now (each is away, drained or failed)",
                    );
                }
                Some(WaitingFor::Quarantine { retry_at }) => {
                    let when = if *retry_at <= view::now_ms() {
                        "being tried again".to_owned()
                    } else {
                        format!("tried again {}", view::relative(*retry_at))
                    };
                    let _ = write!(
                        out,
                        "; quarantined devices hold the room (their wipe failed; {when})"
                    );
                }
            }
            out
        }
        Progress::Provisioning { eta_ms } => {
            format!("creating a device (about {})", view::duration(*eta_ms))
        }
        Progress::Booting { eta_ms } => {
            format!("booting a device (about {})", view::duration(*eta_ms))
        }
        Progress::Reclaiming { eta_ms } => {
            format!("wiping a device (about {})", view::duration(*eta_ms))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queued_request_says_why_it_waits_when_the_daemon_tells() {
        assert_eq!(
            describe(&Progress::queued(2)),
            "waiting for a device: position 2 in the queue"
        );
        assert_eq!(
            describe(&Progress::Queued {
                queue_position: 1,
                waiting_for: Some(WaitingFor::Capacity),
            }),
            "waiting for a device: position 1 in the queue; every device that may run is in use"
        );
        assert_eq!(
            describe(&Progress::Queued {
                queue_position: 3,
                waiting_for: Some(WaitingFor::NoWorker),
            }),
            "waiting for a device: position 3 in the queue; no worker that can serve it takes requests now (each is away, drained or failed)"
        );
        let soon = view::now_ms() + 90_000;
        let said = describe(&Progress::Queued {
            queue_position: 1,
            waiting_for: Some(WaitingFor::Quarantine { retry_at: soon }),
        });
        assert!(
            said.starts_with(
                "waiting for a device: position 1 in the queue; quarantined devices hold the room (their wipe failed; tried again in 1m"
            ),
            "{said}"
        );
        // A retry whose time came is under way.
        assert_eq!(
            describe(&Progress::Queued {
                queue_position: 1,
                waiting_for: Some(WaitingFor::Quarantine {
                    retry_at: view::now_ms() - 1_000
                }),
            }),
            "waiting for a device: position 1 in the queue; quarantined devices hold the room (their wipe failed; being tried again)"
        );
    }
}
