//! Facts about the machine the worker runs on (CPUs, RAM, OS version), behind a trait so tests
//! inject them.

/// One gibibyte.
pub const GIB: u64 = 1024 * 1024 * 1024;

/// What the capacity strategy and `status.get` need to know about the machine.
pub trait SystemFacts: Send + Sync + 'static {
    /// Logical CPUs available to the daemon (at least 1).
    fn cpu_count(&self) -> u32;
    /// Total RAM in bytes.
    fn total_ram_bytes(&self) -> u64;
    /// The OS version, when known (empty otherwise).
    fn os_version(&self) -> String {
        String::new()
    }
}

/// The real machine: `available_parallelism` and `/proc/meminfo`, with fallbacks.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostSystem;

/// RAM assumed when the machine does not say (8 GiB).
const FALLBACK_RAM: u64 = 8 * GIB;

impl SystemFacts for HostSystem {
    fn cpu_count(&self) -> u32 {
        std::thread::available_parallelism()
            .map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
    }

    fn total_ram_bytes(&self) -> u64 {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| parse_meminfo_total(&text))
            .unwrap_or(FALLBACK_RAM)
    }

    fn os_version(&self) -> String {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    }
}

/// `MemTotal:  16318504 kB` → bytes.
fn parse_meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    let unit = parts.next().unwrap_or("B");
    let factor = match unit {
        "kB" | "KB" | "kb" => 1024,
        "mB" | "MB" => 1024 * 1024,
        "gB" | "GB" => GIB,
        _ => 1,
    };
    value.checked_mul(factor)
}

/// Fixed facts, for tests and for machines that must not be probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedSystem {
    /// CPUs.
    pub cpus: u32,
    /// RAM in bytes.
    pub ram_bytes: u64,
}

impl SystemFacts for FixedSystem {
    fn cpu_count(&self) -> u32 {
        self.cpus.max(1)
    }

    fn total_ram_bytes(&self) -> u64 {
        self.ram_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_total_is_read_in_bytes() {
        let text = "MemTotal:       16318504 kB\nMemFree:         1 kB\n";
        assert_eq!(parse_meminfo_total(text), Some(16_318_504 * 1024));
        assert_eq!(parse_meminfo_total("nothing here"), None);
        assert_eq!(parse_meminfo_total("MemTotal: lots kB"), None);
    }

    #[test]
    fn the_host_answers_something_sane() {
        let host = HostSystem;
        assert!(host.cpu_count() >= 1);
        assert!(host.total_ram_bytes() > 0);
    }
}
