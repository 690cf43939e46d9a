//! Facts about the machine a daemon runs on, as `status.get` reports them.

use simlock_contract::model::HostFacts;

/// The OS version: the kernel release where the OS says it (empty otherwise).
pub fn os_version() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// This machine, with `os_version` as given (tests inject it). Device tools are reported by the
/// drivers that find them; none here.
pub fn facts(os_version: String) -> HostFacts {
    HostFacts {
        os: std::env::consts::OS.to_owned(),
        os_version,
        arch: std::env::consts::ARCH.to_owned(),
        tools: Vec::new(),
    }
}
