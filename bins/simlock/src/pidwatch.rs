//! Binding a lease to a process: `simlock lease --bind-pid <pid>` and `simlock mcp` (bound to
//! the agent that started it) release their leases once that process is gone, so a crashed agent
//! does not keep a device for ever.
//!
//! A process is looked at every [`CHECK_EVERY`] (or every renewal period, when that is shorter):
//! a bound pid is gone when signalling it answers "no such process"; a bound parent is gone when
//! this process has been handed to another parent. The look is a system call, cheap enough to
//! repeat; waiting on an exit event instead (`pidfd`, `kqueue`) differs per platform.

use std::time::Duration;

use rustix::io::Errno;
use rustix::process::Pid;
use simlock_contract::{ContractError, ErrorCode};

/// How often a bound process is looked at, at most.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The process a lease is bound to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bound {
    /// Any process, by pid.
    Pid(Pid),
    /// The process that started this one, as it was when the binding was made.
    Parent(Option<Pid>),
}

impl Bound {
    /// A binding to `pid`, which must exist now.
    ///
    /// # Errors
    /// `USAGE` when `pid` is not a process id or no such process runs.
    pub(crate) fn pid(raw: u32) -> Result<Self, ContractError> {
        let pid = i32::try_from(raw)
            .ok()
            .and_then(Pid::from_raw)
            .ok_or_else(|| {
                ContractError::new(ErrorCode::Usage, format!("{raw} is not a process id"))
            })?;
        let bound = Self::Pid(pid);
        if bound.is_gone() {
            return Err(ContractError::new(
                ErrorCode::Usage,
                format!("--bind-pid {raw}: no such process is running"),
            ));
        }
        Ok(bound)
    }

    /// A binding to this process's parent.
    pub(crate) fn parent() -> Self {
        Self::Parent(rustix::process::getppid())
    }

    /// Whether the bound process is gone (one look).
    pub(crate) fn is_gone(&self) -> bool {
        match self {
            Self::Pid(pid) => matches!(rustix::process::test_kill_process(*pid), Err(Errno::SRCH)),
            Self::Parent(parent) => rustix::process::getppid() != *parent,
        }
    }

    /// Resolves once the bound process is gone, looking every `period` (at most [`CHECK_EVERY`]).
    pub(crate) async fn gone(&self, period: Duration) {
        let period = period.clamp(Duration::from_millis(10), CHECK_EVERY);
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if self.is_gone() {
                return;
            }
        }
    }

    /// What the binding is to, for people.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::Pid(pid) => format!("process {}", pid.as_raw_nonzero()),
            Self::Parent(Some(pid)) => format!("the parent process ({})", pid.as_raw_nonzero()),
            Self::Parent(None) => "the parent process".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_and_its_parent_are_not_gone() {
        let me = Bound::pid(std::process::id()).unwrap();
        assert!(!me.is_gone());
        assert!(!Bound::parent().is_gone());
    }

    #[test]
    fn a_pid_that_is_not_one_is_a_usage_error() {
        for raw in [0, u32::MAX] {
            let err = Bound::pid(raw).unwrap_err();
            assert_eq!(err.code, ErrorCode::Usage);
            assert_eq!(err.message, format!("{raw} is not a process id"));
        }
    }

    #[tokio::test]
    async fn a_reaped_child_is_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let bound = Bound::pid(child.id()).unwrap();
        assert!(!bound.is_gone());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(bound.is_gone());
        // Already gone: resolves at the first look.
        bound.gone(Duration::from_secs(3600)).await;
        let err = Bound::pid(child.id()).unwrap_err();
        assert_eq!(err.code, ErrorCode::Usage);
        assert!(err.message.contains("no such process"), "{}", err.message);
    }
}
