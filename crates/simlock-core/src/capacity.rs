//! Running capacity: how many devices may run per platform and in all, and whether one more
//! fits. Plain data and functions; the device registry supplies the counts.
//!
//! Running devices are ready, leased or reclaiming; reservations are devices being
//! provisioned or booted. Free slots = `maxRunning − running − reserved`.

use crate::config::{CapacityConfig, CapacityStrategy};
use simlock_contract::model::{Capacity, GlobalCapacity, Platform, PlatformCapacity};

use crate::system::{GIB, SystemFacts};

/// RAM left to the host under the `resource` strategy.
const HOST_RESERVE: u64 = 4 * GIB;

/// The RAM budget of the `resource` strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamBudget {
    /// Bytes devices may take together: total RAM − 4 GiB.
    pub limit_bytes: u64,
    /// What one iOS device takes.
    pub ios_bytes: u64,
    /// What one Android device takes.
    pub android_bytes: u64,
}

impl RamBudget {
    /// What one device of `platform` takes.
    pub const fn bytes(&self, platform: Platform) -> u64 {
        match platform {
            Platform::Ios => self.ios_bytes,
            Platform::Android => self.android_bytes,
        }
    }
}

/// The limits in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// iOS devices that may run at once.
    pub ios_max: u32,
    /// Android devices that may run at once.
    pub android_max: u32,
    /// Devices that may run at once, both platforms.
    pub global_max: u32,
    /// The RAM budget (`resource` only).
    pub ram: Option<RamBudget>,
}

impl Limits {
    /// The limits `config` sets on a machine with `system`'s CPUs and RAM.
    ///
    /// `fixed`: `maxRunning` in all (default 2), each platform capped by its own `maxRunning`
    /// (default: the global one), no RAM budget. `resource`: iOS `max(1, cpus/2)`, Android
    /// `max(1, min(cpus/4, RAM GiB/8))` (each overridable), in all their sum, and a RAM budget
    /// of total − 4 GiB.
    pub fn from_config(config: &CapacityConfig, system: &dyn SystemFacts) -> Self {
        match config.strategy {
            CapacityStrategy::Fixed => {
                let global = config.max_running.max(1);
                Self {
                    ios_max: config.ios.max_running.unwrap_or(global),
                    android_max: config.android.max_running.unwrap_or(global),
                    global_max: global,
                    ram: None,
                }
            }
            CapacityStrategy::Resource => {
                let cpus = system.cpu_count().max(1);
                let total = system.total_ram_bytes();
                let ram_gib = u32::try_from(total / GIB).unwrap_or(u32::MAX);
                let ios = config.ios.max_running.unwrap_or((cpus / 2).max(1));
                let android = config
                    .android
                    .max_running
                    .unwrap_or((cpus / 4).min(ram_gib / 8).max(1));
                Self {
                    ios_max: ios,
                    android_max: android,
                    global_max: ios.saturating_add(android),
                    ram: Some(RamBudget {
                        limit_bytes: total.saturating_sub(HOST_RESERVE),
                        ios_bytes: config.ios_bytes_per_device,
                        android_bytes: config.android_bytes_per_device,
                    }),
                }
            }
        }
    }

    /// The cap of one platform.
    pub const fn max(&self, platform: Platform) -> u32 {
        match platform {
            Platform::Ios => self.ios_max,
            Platform::Android => self.android_max,
        }
    }

    /// Whether one more device of `platform` may start given `usage`.
    pub fn fits(&self, usage: &Usage, platform: Platform) -> bool {
        let slot =
            usage.occupied(platform) < self.max(platform) && usage.occupied_all() < self.global_max;
        slot && !self.at_ram_budget(usage, platform)
    }

    /// Whether one more device of `platform` would be refused for RAM.
    pub fn at_ram_budget(&self, usage: &Usage, platform: Platform) -> bool {
        self.ram.is_some_and(|ram| {
            usage.ram_bytes.saturating_add(ram.bytes(platform)) > ram.limit_bytes
        })
    }

    /// The `capacity` part of `status.get`.
    pub fn snapshot(&self, usage: &Usage) -> Capacity {
        let platform = |p: Platform| {
            let i = index(p);
            PlatformCapacity {
                running: usage.running[i],
                max_running: self.max(p),
                reserved: usage.reserved[i],
                warm: usage.warm[i],
                over_limit: usage.occupied(p) > self.max(p),
                at_ram_budget: self.at_ram_budget(usage, p),
            }
        };
        let running = usage.running.iter().sum();
        let reserved = usage.reserved.iter().sum();
        Capacity {
            ios: platform(Platform::Ios),
            android: platform(Platform::Android),
            global: GlobalCapacity {
                running,
                max_running: self.global_max,
                reserved,
                warm: usage.warm.iter().sum(),
                over_limit: usage.occupied_all() > self.global_max,
            },
        }
    }
}

const fn index(platform: Platform) -> usize {
    match platform {
        Platform::Ios => 0,
        Platform::Android => 1,
    }
}

/// What devices take now, counted by the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Running devices per platform (iOS, Android).
    pub running: [u32; 2],
    /// Reserved slots per platform.
    pub reserved: [u32; 2],
    /// Running devices nobody leases or waits for, per platform.
    pub warm: [u32; 2],
    /// RAM running and reserved devices take (`resource` only; 0 otherwise).
    pub ram_bytes: u64,
}

impl Usage {
    /// Counts a running device.
    pub fn add_running(&mut self, platform: Platform, warm: bool, ram: Option<&RamBudget>) {
        let i = index(platform);
        self.running[i] += 1;
        if warm {
            self.warm[i] += 1;
        }
        self.ram_bytes += ram.map_or(0, |r| r.bytes(platform));
    }

    /// Counts a reservation.
    pub fn add_reserved(&mut self, platform: Platform, ram: Option<&RamBudget>) {
        self.reserved[index(platform)] += 1;
        self.ram_bytes += ram.map_or(0, |r| r.bytes(platform));
    }

    /// The same usage without one running device (what evicting it would leave).
    #[must_use]
    pub fn without_running(&self, platform: Platform, warm: bool, ram: Option<&RamBudget>) -> Self {
        let mut out = *self;
        let i = index(platform);
        out.running[i] = out.running[i].saturating_sub(1);
        if warm {
            out.warm[i] = out.warm[i].saturating_sub(1);
        }
        out.ram_bytes = out
            .ram_bytes
            .saturating_sub(ram.map_or(0, |r| r.bytes(platform)));
        out
    }

    /// Running plus reserved, one platform.
    pub const fn occupied(&self, platform: Platform) -> u32 {
        let i = index(platform);
        self.running[i] + self.reserved[i]
    }

    /// Running plus reserved, both platforms.
    pub const fn occupied_all(&self) -> u32 {
        self.running[0] + self.running[1] + self.reserved[0] + self.reserved[1]
    }
}

#[cfg(test)]
mod tests {
    use crate::config::PlatformLimit;

    use super::*;
    use crate::system::FixedSystem;

    fn resource(cpus: u32, ram_gib: u64) -> Limits {
        Limits::from_config(
            &CapacityConfig::default(),
            &FixedSystem {
                cpus,
                ram_bytes: ram_gib * GIB,
            },
        )
    }

    #[test]
    fn resource_limits_follow_cpus_and_ram() {
        let l = resource(8, 32);
        assert_eq!((l.ios_max, l.android_max, l.global_max), (4, 2, 6));
        assert_eq!(l.ram.unwrap().limit_bytes, 28 * GIB);
        // RAM bounds Android: min(16/4, 16/8) = 2.
        let l = resource(16, 16);
        assert_eq!((l.ios_max, l.android_max), (8, 2));
        // Never below one each.
        let l = resource(1, 4);
        assert_eq!((l.ios_max, l.android_max, l.global_max), (1, 1, 2));
        assert_eq!(l.ram.unwrap().limit_bytes, 0);
    }

    #[test]
    fn the_ram_budget_refuses_the_device_that_would_not_fit() {
        // 10 GiB: budget 6 GiB; one Android (4 GiB) fits, a second does not; an iOS (1.5) does.
        let l = resource(16, 10);
        let ram = l.ram.unwrap();
        let mut usage = Usage::default();
        assert!(l.fits(&usage, Platform::Android));
        usage.add_running(Platform::Android, false, Some(&ram));
        assert!(l.at_ram_budget(&usage, Platform::Android));
        assert!(!l.fits(&usage, Platform::Android));
        assert!(l.fits(&usage, Platform::Ios));
        let snap = l.snapshot(&usage);
        assert!(snap.android.at_ram_budget);
        assert!(!snap.ios.at_ram_budget);
    }

    #[test]
    fn fixed_limits_default_to_max_running_and_count_reservations() {
        let cfg = CapacityConfig {
            strategy: CapacityStrategy::Fixed,
            ..CapacityConfig::default()
        };
        let l = Limits::from_config(
            &cfg,
            &FixedSystem {
                cpus: 64,
                ram_bytes: 0,
            },
        );
        assert_eq!(
            (l.ios_max, l.android_max, l.global_max, l.ram),
            (2, 2, 2, None)
        );
        let mut usage = Usage::default();
        usage.add_running(Platform::Ios, true, None);
        usage.add_reserved(Platform::Android, None);
        assert!(!l.fits(&usage, Platform::Ios));
        let snap = l.snapshot(&usage);
        assert_eq!(snap.global.running, 1);
        assert_eq!(snap.global.reserved, 1);
        assert_eq!(snap.ios.warm, 1);
        assert_eq!(snap.android.free(), 1);
        assert!(!snap.ios.at_ram_budget);

        let cfg = CapacityConfig {
            strategy: CapacityStrategy::Fixed,
            max_running: 3,
            android: PlatformLimit {
                max_running: Some(1),
            },
            ..CapacityConfig::default()
        };
        let l = Limits::from_config(
            &cfg,
            &FixedSystem {
                cpus: 1,
                ram_bytes: 0,
            },
        );
        assert_eq!((l.ios_max, l.android_max, l.global_max), (3, 1, 3));
    }
}
