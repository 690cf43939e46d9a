//! The fake machine: its layout, profile, knobs and shared state, and the test-side handle.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The marker file at a fake machine's root.
pub const MARKER: &str = "fake-machine.json";
/// The variable that names a fake machine's root (wins over the invocation path).
pub const MACHINE_ENV: &str = "SIMLOCK_FAKE_MACHINE";

/// Wall time in ms since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether process `pid` exists and is not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    if let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) S …`: the state follows the last `)`.
        return stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|s| s != 'Z' && s != 'X');
    }
    if Path::new("/proc/self").exists() {
        return false;
    }
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    rustix::process::Pid::from_raw(pid)
        .is_some_and(|p| rustix::process::test_kill_process(p).is_ok())
}

/// Sends SIGKILL to `pid`, if it lives.
pub fn kill_pid(pid: u32) {
    if let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
}

// === Profile ===

/// One iOS runtime of the fake Xcode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Runtime {
    /// `com.apple.CoreSimulator.SimRuntime.iOS-18-2`.
    pub identifier: String,
    /// `18.2`.
    pub version: String,
    /// `22C150`.
    pub buildversion: String,
    /// `iOS 18.2`.
    pub name: String,
    /// Whether it can run devices.
    pub available: bool,
    /// The device type identifiers it pairs with.
    pub supported: Vec<String>,
}

/// One iOS device type of the fake Xcode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceType {
    /// `com.apple.CoreSimulator.SimDeviceType.iPhone-16`.
    pub identifier: String,
    /// `iPhone 16`.
    pub name: String,
    /// `iPhone`, `iPad`, `Apple Watch`…
    pub product_family: String,
    /// The oldest runtime version it runs, packed `major<<16 | minor<<8 | patch`.
    pub min_runtime_version: u64,
}

/// The fake Xcode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Xcode {
    /// What `maxRuntimeVersion` says for "no upper bound": 4294967295 (Xcode 26) or 16777215.
    pub unbounded_max: u64,
    /// Whether `/` is escaped as `\/` in JSON.
    pub escape_slashes: bool,
    /// Runtimes.
    pub runtimes: Vec<Runtime>,
    /// Device types.
    pub device_types: Vec<DeviceType>,
}

/// One hardware profile of the fake SDK (`avdmanager list device`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HardwareProfile {
    /// `pixel_8`.
    pub id: String,
    /// `Pixel 8`.
    pub name: String,
    /// `Google`.
    pub oem: String,
    /// `android-wear`, `android-tv`…; none for phones and tablets.
    pub tag: Option<String>,
}

/// The fake Android SDK.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sdk {
    /// Hardware profiles.
    pub profiles: Vec<HardwareProfile>,
    /// Installed system images: `system-images;android-35;google_apis;x86_64`.
    pub images: Vec<String>,
    /// `emulator -version`'s number.
    pub emulator_version: String,
}

/// What the machine has installed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    /// Xcode.
    pub xcode: Xcode,
    /// The Android SDK.
    pub sdk: Sdk,
}

/// `major.minor[.patch]` packed as simctl packs versions.
pub fn pack_version(version: &str) -> u64 {
    let mut parts = version.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    let patch = parts.next().unwrap_or(0);
    (major << 16) | (minor << 8) | patch
}

impl Default for Profile {
    fn default() -> Self {
        let ty = |id: &str, name: &str, family: &str, min: &str| DeviceType {
            identifier: format!("com.apple.CoreSimulator.SimDeviceType.{id}"),
            name: name.into(),
            product_family: family.into(),
            min_runtime_version: pack_version(min),
        };
        let device_types = vec![
            ty("iPhone-16", "iPhone 16", "iPhone", "18.0"),
            ty("iPhone-16-Pro", "iPhone 16 Pro", "iPhone", "18.0"),
            ty("iPhone-15", "iPhone 15", "iPhone", "17.0"),
            ty(
                "iPad-Air-11-inch-M2",
                "iPad Air 11-inch (M2)",
                "iPad",
                "17.4",
            ),
            ty(
                "Apple-Watch-Series-10-46mm",
                "Apple Watch Series 10 (46mm)",
                "Apple Watch",
                "11.0",
            ),
        ];
        let all: Vec<String> = device_types.iter().map(|t| t.identifier.clone()).collect();
        let runtime = |v: &str, build: &str| Runtime {
            identifier: format!(
                "com.apple.CoreSimulator.SimRuntime.iOS-{}",
                v.replace('.', "-")
            ),
            version: v.into(),
            buildversion: build.into(),
            name: format!("iOS {v}"),
            available: true,
            supported: all
                .iter()
                .filter(|id| !id.contains("Watch"))
                .cloned()
                .collect(),
        };
        Self {
            xcode: Xcode {
                unbounded_max: 4_294_967_295,
                escape_slashes: true,
                runtimes: vec![runtime("18.2", "22C150"), runtime("17.5", "21F79")],
                device_types,
            },
            sdk: Sdk {
                profiles: vec![
                    HardwareProfile {
                        id: "pixel_8".into(),
                        name: "Pixel 8".into(),
                        oem: "Google".into(),
                        tag: None,
                    },
                    HardwareProfile {
                        id: "pixel_tablet".into(),
                        name: "Pixel Tablet".into(),
                        oem: "Google".into(),
                        tag: None,
                    },
                    HardwareProfile {
                        id: "wearos_large_round".into(),
                        name: "Wear OS Large Round".into(),
                        oem: "Google".into(),
                        tag: Some("android-wear".into()),
                    },
                ],
                images: vec![
                    "system-images;android-34;google_apis;x86_64".into(),
                    "system-images;android-35;google_apis;x86_64".into(),
                ],
                emulator_version: "35.1.4.0".into(),
            },
        }
    }
}

// === Knobs ===

/// What a fault does to one tool command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum FaultKind {
    /// Exit with this code and stderr, doing nothing.
    #[serde(rename_all = "camelCase")]
    Exit {
        /// The exit code.
        code: i32,
        /// What goes to stderr.
        stderr: String,
    },
    /// Print garbage on stdout and exit 0, doing nothing.
    Garbage,
    /// Take this long (wall time) before doing the work.
    Slow {
        /// How long.
        ms: u64,
    },
    /// Never answer (until killed).
    Hang,
}

/// A fault injected into one tool command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fault {
    /// `xcrun`, `adb`, `avdmanager` or `emulator`.
    pub tool: String,
    /// The command: simctl's subcommand (`erase`), adb's (`shell`, `emu`, `devices`),
    /// avdmanager's (`create`), `emulator`'s (`launch`, `-version`).
    pub command: String,
    /// What it does.
    pub fault: FaultKind,
    /// How many more times it applies (`None`: every time).
    pub times: Option<u32>,
}

/// What a test turns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Knobs {
    /// Wall time of one virtual second of booting.
    pub step_ms: u64,
    /// Virtual seconds of a simulator boot.
    pub ios_boot_steps: u32,
    /// Simulator boots never finish.
    pub ios_hang_boot: bool,
    /// Virtual seconds of a cold emulator boot.
    pub emulator_cold_steps: u32,
    /// Virtual seconds of an emulator boot or load from a snapshot.
    pub emulator_snapshot_steps: u32,
    /// Virtual seconds before adbd answers (the transport is `offline` until then).
    pub emulator_offline_steps: u32,
    /// Emulator boots never finish (`sys.boot_completed` stays empty).
    pub emulator_hang_boot: bool,
    /// A launched emulator process dies after this many virtual seconds.
    pub emulator_die_after_steps: Option<u32>,
    /// Faults.
    pub faults: Vec<Fault>,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            step_ms: 3,
            ios_boot_steps: 30,
            ios_hang_boot: false,
            emulator_cold_steps: 60,
            emulator_snapshot_steps: 4,
            emulator_offline_steps: 3,
            emulator_hang_boot: false,
            emulator_die_after_steps: None,
            faults: Vec::new(),
        }
    }
}

// === State ===

/// A simulator's state, as simctl names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SimState {
    /// `Creating`.
    Creating,
    /// `Shutdown`.
    Shutdown,
    /// `Booting`.
    Booting,
    /// `Booted`.
    Booted,
    /// `Shutting Down`.
    #[serde(rename = "Shutting Down")]
    ShuttingDown,
}

impl SimState {
    /// simctl's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "Creating",
            Self::Shutdown => "Shutdown",
            Self::Booting => "Booting",
            Self::Booted => "Booted",
            Self::ShuttingDown => "Shutting Down",
        }
    }
}

/// One simulator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SimDevice {
    /// Its UDID.
    pub udid: String,
    /// Its name.
    pub name: String,
    /// Its device type identifier.
    pub device_type: String,
    /// Its runtime identifier.
    pub runtime: String,
    /// Its state.
    pub state: SimState,
    /// When its boot started (wall ms).
    pub boot_started_ms: Option<u64>,
    /// When it last finished booting (wall ms).
    pub last_booted_ms: Option<u64>,
}

/// The simulators of one device set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimSet {
    /// By UDID.
    pub devices: BTreeMap<String, SimDevice>,
}

/// A running (or dead) emulator process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EmulatorRecord {
    /// The process.
    pub pid: u32,
    /// The AVD.
    pub avd: String,
    /// The AVD's directory.
    pub avd_dir: PathBuf,
    /// The console port; the adb port is the next one.
    pub console_port: u16,
    /// The adb server it announced itself to (`ANDROID_ADB_SERVER_PORT`, else 5037).
    pub server_port: u16,
    /// When the current boot (or snapshot load) started, wall ms.
    pub boot_started_ms: u64,
    /// Its length in virtual seconds.
    pub boot_steps: u32,
    /// `cold`, `snapshot` or `wipe`.
    pub boot_kind: String,
    /// Whether it runs with `-no-boot-anim`.
    pub no_boot_anim: bool,
    /// Whether the process is alive (filled in when read).
    #[serde(default)]
    pub alive: bool,
}

impl EmulatorRecord {
    /// Whether the boot finished at `now`.
    pub fn booted(&self, now: u64, knobs: &Knobs) -> bool {
        !knobs.emulator_hang_boot
            && now
                >= self
                    .boot_started_ms
                    .saturating_add(u64::from(self.boot_steps) * knobs.step_ms)
    }

    /// Whether adbd answers at `now`.
    pub fn adbd_up(&self, now: u64, knobs: &Knobs) -> bool {
        now >= self
            .boot_started_ms
            .saturating_add(u64::from(knobs.emulator_offline_steps) * knobs.step_ms)
    }
}

/// One transport an adb server holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Transport {
    /// `emulator-5586`.
    pub serial: String,
    /// The emulator's adb port.
    pub adb_port: u16,
    /// Its id.
    pub transport_id: u32,
}

/// A running (or dead) adb server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdbServerRecord {
    /// The process.
    pub pid: u32,
    /// Its port.
    pub port: u16,
    /// Whether its emulator scanner runs (`ADB_EMU` is not `0`).
    pub scanner: bool,
    /// Whether `kill-server` is refused (`ADB_REJECT_KILL_SERVER=1`).
    pub reject_kill: bool,
    /// The highest port the scanner looks at (`ADB_LOCAL_TRANSPORT_MAX_PORT`, 5585).
    pub scan_max_port: u16,
    /// Transports announced to it.
    pub transports: Vec<Transport>,
    /// Whether the process is alive (filled in when read).
    #[serde(default)]
    pub alive: bool,
}

/// A fake process that was started (alive or not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcRecord {
    /// The process.
    pub pid: u32,
    /// Its tool.
    pub tool: String,
    /// Its arguments.
    pub args: Vec<String>,
}

/// Everything the fakes share.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct World {
    /// Simulators by device set path (`default` for the user's own set).
    pub sets: BTreeMap<String, SimSet>,
    /// Emulators by AVD name.
    pub emulators: BTreeMap<String, EmulatorRecord>,
    /// adb servers by port.
    pub adb_servers: BTreeMap<u16, AdbServerRecord>,
    /// Fake processes still registered, by pid.
    pub procs: BTreeMap<u32, ProcRecord>,
    /// The next adb transport id.
    pub next_transport_id: u32,
    /// How often each fault (by index) was used.
    pub fault_uses: BTreeMap<usize, u32>,
}

impl World {
    /// Moves simulators whose boot finished to `Booted`.
    pub fn settle(&mut self, now: u64, knobs: &Knobs) {
        if knobs.ios_hang_boot {
            return;
        }
        let boot_ms = u64::from(knobs.ios_boot_steps) * knobs.step_ms;
        for set in self.sets.values_mut() {
            for d in set.devices.values_mut() {
                if d.state == SimState::Booting
                    && d.boot_started_ms
                        .is_some_and(|t| now >= t.saturating_add(boot_ms))
                {
                    d.state = SimState::Booted;
                    d.last_booted_ms = Some(now);
                }
            }
        }
    }
}

/// One call a fake received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Call {
    /// The tool.
    pub tool: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Wall ms.
    pub at_ms: u64,
}

/// What a piece of device work cost in virtual time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualCost {
    /// The device (UDID or AVD name).
    pub device: String,
    /// `create`, `cold-boot`, `snapshot-boot`, `snapshot-load`, `wipe-boot`, `erase`, `boot`.
    pub work: String,
    /// Virtual ms.
    pub virtual_ms: u64,
    /// Wall ms when it started.
    pub at_ms: u64,
}

// === The machine ===

/// Paths to the four fake binaries.
#[derive(Debug, Clone)]
pub struct Tools {
    /// `xcrun`.
    pub xcrun: PathBuf,
    /// `adb`.
    pub adb: PathBuf,
    /// `emulator`.
    pub emulator: PathBuf,
    /// `avdmanager`.
    pub avdmanager: PathBuf,
}

/// A fake machine's directory, from either side: the fakes use it to lock and share state, tests
/// to build the machine, turn its knobs and look at what happened.
#[derive(Debug)]
pub struct FakeMachine {
    root: PathBuf,
    /// Kill every fake process of the machine when dropped (the test side).
    owner: bool,
}

impl FakeMachine {
    /// Lays out a machine under `root` (created if missing): the tools as symlinks to `tools`, an
    /// SDK tree with `profile`'s system images, a user home with its own (foreign) AVD home and
    /// simulator set, the profile and default knobs.
    ///
    /// # Panics
    /// When the directory cannot be written.
    pub fn create(root: &Path, tools: &Tools, profile: &Profile) -> Self {
        fs::create_dir_all(root).unwrap();
        let root = root.canonicalize().unwrap();
        let link = |target: &Path, at: PathBuf| {
            fs::create_dir_all(at.parent().unwrap()).unwrap();
            let _ = fs::remove_file(&at);
            std::os::unix::fs::symlink(target, &at).unwrap();
        };
        link(&tools.xcrun, root.join("bin/xcrun"));
        link(&tools.adb, root.join("sdk/platform-tools/adb"));
        link(&tools.emulator, root.join("sdk/emulator/emulator"));
        link(
            &tools.avdmanager,
            root.join("sdk/cmdline-tools/latest/bin/avdmanager"),
        );
        for image in &profile.sdk.images {
            let dir = root.join("sdk").join(image.replace(';', "/"));
            fs::create_dir_all(&dir).unwrap();
            fs::write(
                dir.join("source.properties"),
                "Pkg.Desc=Google APIs Intel x86_64 Atom System Image\nPkg.Revision=7\n",
            )
            .unwrap();
            fs::write(dir.join("package.xml"), "<package/>\n").unwrap();
        }
        fs::create_dir_all(root.join("home/.android/avd")).unwrap();
        fs::create_dir_all(root.join("home/Library/Developer/CoreSimulator/Devices")).unwrap();
        fs::create_dir_all(root.join("state")).unwrap();
        fs::write(
            root.join(MARKER),
            serde_json::to_string_pretty(profile).unwrap(),
        )
        .unwrap();
        let machine = Self { root, owner: true };
        machine.set_knobs(|_| {});
        machine
    }

    /// The machine the running fake belongs to.
    ///
    /// # Errors
    /// A message when none is found.
    pub fn of_invocation() -> Result<Self, String> {
        Self::found()?.checked()
    }

    /// The machine, once its profile reads: a fake tool says what is wrong with a hand-made
    /// `fake-machine.json` instead of panicking on it later.
    fn checked(self) -> Result<Self, String> {
        let marker = self.root.join(MARKER);
        let text = fs::read_to_string(&marker)
            .map_err(|e| format!("fake tool: cannot read {}: {e}", marker.display()))?;
        serde_json::from_str::<Profile>(&text).map_err(|e| {
            format!(
                "fake tool: {} is not a fake machine's profile: {e} (lay a machine out with \
                 FakeMachine::create, as the tests do)",
                marker.display()
            )
        })?;
        Ok(self)
    }

    fn found() -> Result<Self, String> {
        if let Some(root) = std::env::var_os(MACHINE_ENV) {
            let root = PathBuf::from(root);
            if root.join(MARKER).exists() {
                return Ok(Self { root, owner: false });
            }
        }
        let argv0 = std::env::args().next().unwrap_or_default();
        let mut candidates = Vec::new();
        if argv0.contains('/') {
            candidates.push(PathBuf::from(&argv0));
        } else if let Some(path) = std::env::var_os("PATH") {
            candidates.extend(std::env::split_paths(&path).map(|d| d.join(&argv0)));
        }
        for candidate in candidates.into_iter().filter(|c| c.exists()) {
            let absolute = std::path::absolute(&candidate).unwrap_or(candidate);
            for dir in absolute.ancestors().skip(1) {
                if dir.join(MARKER).exists() {
                    return Ok(Self {
                        root: dir.to_path_buf(),
                        owner: false,
                    });
                }
            }
        }
        Err(format!(
            "fake tool: no fake machine for {argv0} (set {MACHINE_ENV} or run it from a machine)"
        ))
    }

    /// The machine at `root`, as a fake sees it (dropping it kills nothing).
    pub fn at(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            owner: false,
        }
    }

    /// The machine's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The machine's `xcrun`.
    pub fn xcrun(&self) -> PathBuf {
        self.root.join("bin/xcrun")
    }

    /// The machine's Android SDK root.
    pub fn sdk_root(&self) -> PathBuf {
        self.root.join("sdk")
    }

    /// The machine's user home (with its own `~/.android/avd` and default simulator set).
    pub fn home(&self) -> PathBuf {
        self.root.join("home")
    }

    /// The user's own simulator set (what `simctl` without `--set` addresses).
    pub fn default_set(&self) -> PathBuf {
        self.home().join("Library/Developer/CoreSimulator/Devices")
    }

    /// The profile.
    pub fn profile(&self) -> Profile {
        serde_json::from_str(&fs::read_to_string(self.root.join(MARKER)).unwrap()).unwrap()
    }

    fn state(&self, name: &str) -> PathBuf {
        self.root.join("state").join(name)
    }

    /// Runs `f` on the shared state under the machine's lock, then stores it.
    pub fn with_world<T>(&self, f: impl FnOnce(&mut World, &Knobs) -> T) -> T {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.state("lock"))
            .unwrap();
        lock.lock().unwrap();
        let path = self.state("world.json");
        let mut world: World = fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let knobs: Knobs = fs::read_to_string(self.state("knobs.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        world.settle(now_ms(), &knobs);
        let out = f(&mut world, &knobs);
        let tmp = self.state(&format!("world.json.{}", std::process::id()));
        fs::write(&tmp, serde_json::to_vec(&world).unwrap()).unwrap();
        fs::rename(&tmp, &path).unwrap();
        drop(lock);
        out
    }

    /// A copy of the shared state, with liveness filled in.
    pub fn world(&self) -> World {
        let mut world = self.with_world(|w, _| w.clone());
        for e in world.emulators.values_mut() {
            e.alive = pid_alive(e.pid);
        }
        for s in world.adb_servers.values_mut() {
            s.alive = pid_alive(s.pid);
        }
        world
    }

    /// The knobs.
    pub fn knobs(&self) -> Knobs {
        fs::read_to_string(self.state("knobs.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default()
    }

    /// Changes the knobs.
    pub fn set_knobs(&self, f: impl FnOnce(&mut Knobs)) {
        let mut knobs = self.knobs();
        f(&mut knobs);
        let tmp = self.state("knobs.json.tmp");
        fs::write(&tmp, serde_json::to_vec_pretty(&knobs).unwrap()).unwrap();
        fs::rename(&tmp, self.state("knobs.json")).unwrap();
    }

    /// The fault for `tool`'s `command`, if one applies now (it is counted as used).
    pub fn take_fault(&self, tool: &str, command: &str) -> Option<FaultKind> {
        let knobs = self.knobs();
        self.with_world(|w, _| {
            for (i, f) in knobs.faults.iter().enumerate() {
                if f.tool != tool || f.command != command {
                    continue;
                }
                let used = w.fault_uses.entry(i).or_default();
                if f.times.is_some_and(|t| *used >= t) {
                    continue;
                }
                *used += 1;
                return Some(f.fault.clone());
            }
            None
        })
    }

    /// Appends to one of the logs.
    fn append(&self, name: &str, value: &impl Serialize) {
        let mut line = serde_json::to_vec(value).unwrap();
        line.push(b'\n');
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state(name))
            .unwrap();
        file.write_all(&line).unwrap();
    }

    fn read_log<T: serde::de::DeserializeOwned>(&self, name: &str) -> Vec<T> {
        fs::read_to_string(self.state(name))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Records a call (the fakes do, first thing).
    pub fn log_call(&self, tool: &str, args: &[String]) {
        self.append(
            "calls.log",
            &Call {
                tool: tool.into(),
                args: args.to_vec(),
                at_ms: now_ms(),
            },
        );
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.read_log("calls.log")
    }

    /// Records the virtual cost of a piece of work.
    pub fn log_cost(&self, device: &str, work: &str, virtual_ms: u64) {
        self.append(
            "virtual.log",
            &VirtualCost {
                device: device.into(),
                work: work.into(),
                virtual_ms,
                at_ms: now_ms(),
            },
        );
    }

    /// Every piece of work's virtual cost so far, in order.
    pub fn virtual_costs(&self) -> Vec<VirtualCost> {
        self.read_log("virtual.log")
    }

    /// Registers the running fake process (removed by [`FakeMachine::unregister`]).
    pub fn register(&self, tool: &str, args: &[String]) {
        let pid = std::process::id();
        let record = ProcRecord {
            pid,
            tool: tool.into(),
            args: args.to_vec(),
        };
        self.with_world(|w, _| w.procs.insert(pid, record));
    }

    /// Removes the running fake process's registration.
    pub fn unregister(&self) {
        let pid = std::process::id();
        self.with_world(|w, _| w.procs.remove(&pid));
    }

    /// Fake processes of this machine still alive.
    pub fn live_processes(&self) -> Vec<ProcRecord> {
        self.with_world(|w, _| w.procs.values().cloned().collect::<Vec<_>>())
            .into_iter()
            .filter(|p| pid_alive(p.pid))
            .collect()
    }

    /// The simulators of the device set at `set` (or the user's own set).
    pub fn simulators(&self, set: &Path) -> Vec<SimDevice> {
        let key = set_key(Some(set));
        self.with_world(|w, _| {
            w.sets
                .get(&key)
                .map(|s| s.devices.values().cloned().collect())
                .unwrap_or_default()
        })
    }

    /// Creates a simulator outside simlock's control (in `set`), as a user would.
    pub fn add_foreign_simulator(&self, set: &Path, name: &str, state: SimState) -> String {
        let profile = self.profile();
        let udid = uuid::Uuid::new_v4().hyphenated().to_string().to_uppercase();
        let device = SimDevice {
            udid: udid.clone(),
            name: name.into(),
            device_type: profile.xcode.device_types[0].identifier.clone(),
            runtime: profile.xcode.runtimes[0].identifier.clone(),
            state,
            boot_started_ms: None,
            last_booted_ms: None,
        };
        let dir = set.join(&udid);
        fs::create_dir_all(dir.join("data")).unwrap();
        fs::write(dir.join("device.plist"), "<plist/>\n").unwrap();
        fs::write(dir.join("data/user-file"), "the user's own data\n").unwrap();
        let key = set_key(Some(set));
        self.with_world(|w, _| {
            w.sets
                .entry(key)
                .or_default()
                .devices
                .insert(udid.clone(), device)
        });
        udid
    }

    /// A simulator dies: it is `Shutdown` from now on, as after a CoreSimulator crash.
    pub fn crash_simulator(&self, set: &Path, udid: &str) {
        let key = set_key(Some(set));
        self.with_world(|w, _| {
            if let Some(d) = w.sets.get_mut(&key).and_then(|s| s.devices.get_mut(udid)) {
                d.state = SimState::Shutdown;
                d.boot_started_ms = None;
            }
        });
    }

    /// The emulators, with liveness.
    pub fn emulators(&self) -> Vec<EmulatorRecord> {
        self.world().emulators.into_values().collect()
    }

    /// The adb servers, with liveness.
    pub fn adb_servers(&self) -> Vec<AdbServerRecord> {
        self.world().adb_servers.into_values().collect()
    }

    /// Kills the emulator of `avd` with SIGKILL, as a crash would; answers its pid.
    pub fn kill_emulator(&self, avd: &str) -> Option<u32> {
        let pid = self.with_world(|w, _| w.emulators.get(avd).map(|e| e.pid))?;
        kill_pid(pid);
        Some(pid)
    }

    /// Kills every fake process of the machine still alive.
    pub fn kill_all(&self) {
        if !self.root.join("state").exists() {
            return;
        }
        for p in self.live_processes() {
            kill_pid(p.pid);
        }
    }

    /// Waits (bounded by `patience`, polling every 10 ms) until `done` holds of the machine.
    ///
    /// # Panics
    /// Past `patience`, naming `what`.
    pub fn wait_until(&self, what: &str, patience: Duration, done: impl Fn(&Self) -> bool) {
        let deadline = SystemTime::now() + patience;
        while !done(self) {
            assert!(
                SystemTime::now() < deadline,
                "waited {patience:?} for {what}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for FakeMachine {
    fn drop(&mut self) {
        if self.owner {
            self.kill_all();
        }
    }
}

/// The state key of a device set: its canonical path, or `default`.
pub fn set_key(set: Option<&Path>) -> String {
    set.map_or_else(
        || "default".to_owned(),
        |p| {
            p.canonicalize()
                .unwrap_or_else(|_| p.to_path_buf())
                .display()
                .to_string()
        },
    )
}

/// Opens (creating) a file for appending, for a fake's own log.
pub fn append_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}
