//! Android emulators over `avdmanager`, `emulator` and `adb`.
//!
//! Scoping: every call runs with `ANDROID_AVD_HOME` = simlock's own AVD home and talks to
//! simlock's own adb server (`adb -P <drivers.android.adbServerPort>`), which the driver runs in
//! the foreground with its emulator scanner, USB and mDNS off and `kill-server` refused, so it
//! sees only the emulators simlock announces to it and never the user's devices. The user's
//! server (5037) is never started nor asked.
//!
//! Ports: each AVD keeps one even console port (and the adb port next to it) from
//! `drivers.android.consolePortMin`–`consolePortMax`, reserved when it first boots and kept
//! until it is deleted, so its serial (`emulator-<port>`) does not change under a lease. A port
//! is taken only when both it and the next one bind on loopback and no transport names it.
//!
//! Boot: the emulator is launched detached (it may outlive the worker) and recorded in the
//! driver's ledger by pid; the driver asks `getprop sys.boot_completed` every
//! `drivers.android.bootPollMs` (announcing the emulator to its server again when no transport
//! shows), then `init.svc.bootanim`, then checks with `emu avd path` that the console port
//! answers for this AVD. Past `drivers.android.bootTimeoutMs` the emulator is killed.
//!
//! Reclaim: the first boot saves a clean baseline snapshot and the key of what it depends on
//! (system image and revision, emulator version, hardware config); a reclaim loads it
//! (seconds) while the key matches, else wipes the AVD with a cold boot and saves it again.
//! A recovery after a crash is always a cold boot on the same port: never a snapshot load nor a
//! wipe under a live lease.

pub mod parse;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{
    DeviceAccess, DeviceSpec, DriverKind, DriverStatus, Platform, PlatformCatalog,
};
use simlock_core::{Adopted, Driver, DriverError, Estimates, Keep, Observation, RunState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::error::ToolError;
use crate::locks::DeviceLocks;
use crate::process::{self, Entry, Role, Runner, Spawned, Start, make_private_dir, reap};

/// The baseline snapshot's name.
pub const BASELINE: &str = "simlock_clean_baseline";
/// The prefix of every AVD simlock makes.
pub const AVD_PREFIX: &str = "simlock_";
/// How long an emulator gets to exit after `emu kill`, or a process after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long a booting emulator may show no transport before it is announced again.
const REANNOUNCE_AFTER: Duration = Duration::from_secs(5);

/// The SDK's tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sdk {
    /// The SDK's root.
    pub root: PathBuf,
    /// `platform-tools/adb`.
    pub adb: PathBuf,
    /// `emulator/emulator`.
    pub emulator: PathBuf,
    /// `cmdline-tools/<version>/bin/avdmanager` (`latest` first), else `tools/bin/avdmanager`.
    pub avdmanager: PathBuf,
}

impl Sdk {
    /// The tools of the SDK at `root`.
    ///
    /// # Errors
    /// A message naming what is missing.
    pub fn at(root: &Path) -> Result<Self, String> {
        let adb = root.join("platform-tools/adb");
        let emulator = root.join("emulator/emulator");
        let mut bins = vec![root.join("cmdline-tools/latest/bin")];
        if let Ok(dir) = std::fs::read_dir(root.join("cmdline-tools")) {
            let mut versions: Vec<PathBuf> = dir
                .filter_map(Result::ok)
                .map(|e| e.path().join("bin"))
                .collect();
            versions.sort();
            versions.reverse();
            bins.extend(versions);
        }
        bins.push(root.join("tools/bin"));
        let avdmanager = bins
            .into_iter()
            .map(|b| b.join("avdmanager"))
            .find(|p| p.exists());
        match (adb.exists(), emulator.exists(), avdmanager) {
            (true, true, Some(avdmanager)) => Ok(Self {
                root: root.to_path_buf(),
                adb,
                emulator,
                avdmanager,
            }),
            (adb_ok, emulator_ok, avdmanager) => {
                let mut missing = Vec::new();
                if !adb_ok {
                    missing.push("platform-tools/adb");
                }
                if !emulator_ok {
                    missing.push("emulator/emulator");
                }
                if avdmanager.is_none() {
                    missing.push("cmdline-tools/*/bin/avdmanager");
                }
                Err(format!(
                    "the SDK at {} lacks {}",
                    root.display(),
                    missing.join(", ")
                ))
            }
        }
    }
}

/// What the Android driver is built from.
#[derive(Debug, Clone)]
pub struct AndroidSettings {
    /// The SDK.
    pub sdk: Sdk,
    /// The AVD home simlock owns.
    pub avd_home: PathBuf,
    /// Where its ledger and the adb server's log live.
    pub state_dir: PathBuf,
    /// simlock's adb server port.
    pub adb_server_port: u16,
    /// The lowest and highest console ports.
    pub console_ports: (u16, u16),
    /// Launch emulators without a window, audio or boot animation.
    pub headless: bool,
    /// The bound on one tool call.
    pub call_timeout: Duration,
    /// The bound on a boot.
    pub boot_timeout: Duration,
    /// How often a booting emulator is asked.
    pub boot_poll: Duration,
}

/// A system image: its package and the API level it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Image {
    package: String,
    dir: PathBuf,
    rank: u8,
}

/// How an emulator is launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launch {
    /// `-no-snapshot-load`.
    Cold,
    /// `-snapshot simlock_clean_baseline`.
    Baseline,
    /// `-wipe-data -no-snapshot-load`.
    Wipe,
}

/// `<avd>.avd/simlock.json`: the console port the AVD keeps.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reservation {
    console_port: u16,
}

/// `<avd>.avd/simlock-clean-baseline.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Baseline {
    config_hash: String,
    snapshot: String,
}

struct Inner {
    s: AndroidSettings,
    runner: Runner,
    profiles: Vec<parse::Profile>,
    images: BTreeMap<u32, Image>,
    emulator_version: String,
    ports: Mutex<BTreeMap<String, u16>>,
    spawned: Mutex<HashMap<String, Spawned>>,
    server: Mutex<Option<Spawned>>,
    locks: DeviceLocks,
    reason: String,
}

/// The Android driver.
#[derive(Clone)]
pub struct AndroidDriver {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AndroidDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AndroidDriver")
            .field("avd_home", &self.inner.s.avd_home)
            .field("adb_server_port", &self.inner.s.adb_server_port)
            .finish_non_exhaustive()
    }
}

fn host_abi() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "arm64-v8a"
    } else {
        "x86_64"
    }
}

/// The installed system images, one per API level (google_apis on the host's ABI first).
fn scan_images(sdk: &Path) -> BTreeMap<u32, Image> {
    let mut images: BTreeMap<u32, Image> = BTreeMap::new();
    let root = sdk.join("system-images");
    let dirs = |p: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(p)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default()
    };
    for api_dir in dirs(&root) {
        let name = api_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some(api) = name
            .strip_prefix("android-")
            .and_then(|a| a.parse::<u32>().ok())
        else {
            continue;
        };
        for tag_dir in dirs(&api_dir) {
            for abi_dir in dirs(&tag_dir) {
                if !abi_dir.join("source.properties").exists() {
                    continue;
                }
                let tag = tag_dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let abi = abi_dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let rank = match (tag == "google_apis", abi == host_abi()) {
                    (true, true) => 0,
                    (false, true) => 1,
                    (true, false) => 2,
                    (false, false) => 3,
                };
                let image = Image {
                    package: format!("system-images;android-{api};{tag};{abi}"),
                    dir: abi_dir.clone(),
                    rank,
                };
                if images.get(&api).is_none_or(|i| i.rank > rank) {
                    images.insert(api, image);
                }
            }
        }
    }
    images
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), ToolError> {
    let text = serde_json::to_vec(value).map_err(|e| ToolError::State(e.to_string()))?;
    std::fs::write(path, text).map_err(|e| ToolError::io(format!("writing {}", path.display()), e))
}

fn listening(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

fn free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

impl AndroidDriver {
    /// Opens the driver: makes the AVD home (owner-only), stops what an earlier run left (a
    /// tool call, its adb server: reaped by pid) but keeps its emulators for adoption, reads the
    /// catalog (`avdmanager list device`, the installed system images), and starts simlock's
    /// own adb server.
    ///
    /// # Errors
    /// When a tool cannot be run or read, no system image or phone profile exists, or the adb
    /// server's port is held by another process.
    pub async fn open(s: AndroidSettings) -> Result<Self, ToolError> {
        make_private_dir(&s.avd_home)?;
        make_private_dir(&s.state_dir)?;
        let ledger = Arc::new(process::open_ledger(&s.state_dir.join("processes"))?);
        reap(&ledger, |e| e.role == Role::Emulator).await;
        let env = vec![
            (
                "ANDROID_AVD_HOME".to_owned(),
                s.avd_home.display().to_string(),
            ),
            (
                "ANDROID_ADB_SERVER_PORT".to_owned(),
                s.adb_server_port.to_string(),
            ),
            ("ANDROID_HOME".to_owned(), s.sdk.root.display().to_string()),
            (
                "ANDROID_SDK_ROOT".to_owned(),
                s.sdk.root.display().to_string(),
            ),
        ];
        let runner = Runner::new(ledger, env);
        let version = runner
            .run(
                &s.sdk.emulator,
                &["-version".to_owned()],
                None,
                s.call_timeout,
            )
            .await?;
        let emulator_version = version
            .stdout
            .lines()
            .find(|l| l.contains("emulator version"))
            .map(str::trim)
            .map(String::from)
            .ok_or_else(|| ToolError::Garbled {
                command: "emulator -version".into(),
                what: "the emulator's version",
                detail: version.stdout.chars().take(80).collect(),
            })?;
        let listed = runner
            .run(
                &s.sdk.avdmanager,
                &["list".to_owned(), "device".to_owned()],
                None,
                s.call_timeout,
            )
            .await?;
        let profiles: Vec<parse::Profile> = parse::profiles(&listed.stdout)
            .map_err(|detail| ToolError::Garbled {
                command: "avdmanager list device".into(),
                what: "the hardware profiles",
                detail,
            })?
            .into_iter()
            .filter(|p| p.tag.is_none())
            .collect();
        let images = scan_images(&s.sdk.root);
        if profiles.is_empty() || images.is_empty() {
            return Err(ToolError::State(format!(
                "the SDK at {} has {} phone or tablet profiles and {} system images; it needs at least one of each",
                s.sdk.root.display(),
                profiles.len(),
                images.len()
            )));
        }
        let mut ports = BTreeMap::new();
        for name in avd_names(&s.avd_home) {
            if let Some(r) =
                read_json::<Reservation>(&s.avd_home.join(format!("{name}.avd/simlock.json")))
            {
                ports.insert(name, r.console_port);
            }
        }
        let reason = format!(
            "Android SDK at {} (adb server on port {}, AVD home {}): {} profiles on API levels {}",
            s.sdk.root.display(),
            s.adb_server_port,
            s.avd_home.display(),
            profiles.len(),
            images
                .keys()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let inner = Inner {
            s,
            runner,
            profiles,
            images,
            emulator_version,
            ports: Mutex::new(ports),
            spawned: Mutex::new(HashMap::new()),
            server: Mutex::new(None),
            locks: DeviceLocks::default(),
            reason,
        };
        let server = inner.start_server().await?;
        *inner.server.lock() = Some(server);
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Why it serves (for status).
    pub fn reason(&self) -> &str {
        &self.inner.reason
    }

    /// simlock's adb server, while it runs.
    pub fn adb_server_pid(&self) -> Option<u32> {
        self.inner.server.lock().as_ref().map(|s| s.entry.pid)
    }
}

/// The names of the AVDs in `home` that simlock made.
fn avd_names(home: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(home)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_suffix(".ini")
                        .map(String::from)
                })
                .filter(|n| n.starts_with(AVD_PREFIX))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

impl Inner {
    fn avd_dir(&self, avd: &str) -> PathBuf {
        self.s.avd_home.join(format!("{avd}.avd"))
    }

    async fn start_server(&self) -> Result<Spawned, ToolError> {
        let port = self.s.adb_server_port;
        if listening(port) {
            return Err(ToolError::State(format!(
                "port {port} already has a listener that simlock did not start; set drivers.android.adbServerPort to a free port"
            )));
        }
        let env: Vec<(String, String)> = [
            ("ADB_EMU", "0"),
            ("ADB_USB", "0"),
            ("ADB_MDNS", "0"),
            ("ADB_REJECT_KILL_SERVER", "1"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .to_vec();
        let log = self.s.state_dir.join("adb-server.log");
        let args = [
            "-P".into(),
            port.to_string(),
            "nodaemon".into(),
            "server".into(),
        ];
        let server = self.runner.spawn(&Start {
            program: &self.s.sdk.adb,
            args: &args,
            env: &env,
            log: &log,
            role: Role::AdbServer,
            device: None,
            port: Some(port),
        })?;
        // It must listen within 10 s (the original's bound); nothing but a connect tells.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !listening(port) {
            if server.has_exited() || Instant::now() >= deadline {
                server.stop(Duration::from_secs(1)).await;
                return Err(ToolError::State(format!(
                    "simlock's adb server did not listen on port {port}: {}",
                    tail(&log)
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        info!(port, pid = server.entry.pid, "simlock's adb server listens");
        Ok(server)
    }

    async fn adb(&self, args: &[&str]) -> Result<process::Output, ToolError> {
        let mut all = vec!["-P".to_owned(), self.s.adb_server_port.to_string()];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        self.runner
            .run(&self.s.sdk.adb, &all, None, self.s.call_timeout)
            .await
    }

    async fn transports(&self) -> Result<BTreeMap<String, String>, ToolError> {
        let out = self.adb(&["devices"]).await?;
        parse::devices(&out.stdout).map_err(|detail| ToolError::Garbled {
            command: "adb devices".into(),
            what: "the device list",
            detail,
        })
    }

    /// `adb -s emulator-<port> emu <cmd>`: its reply lines, and whether it said OK.
    async fn emu(&self, port: u16, cmd: &[&str]) -> Result<(Vec<String>, bool), ToolError> {
        let serial = format!("emulator-{port}");
        let mut args = vec!["-s", serial.as_str(), "emu"];
        args.extend_from_slice(cmd);
        let out = self.adb(&args).await?;
        Ok(parse::emu_reply(&out.stdout))
    }

    /// Tells simlock's server about the emulator on `console` (`host:emulator:<console+1>`).
    async fn announce(&self, console: u16) {
        let service = format!("host:emulator:{}", console + 1);
        let frame = format!("{:04x}{service}", service.len());
        let attempt = async {
            let mut stream =
                tokio::net::TcpStream::connect(("127.0.0.1", self.s.adb_server_port)).await?;
            stream.write_all(frame.as_bytes()).await?;
            let mut status = [0u8; 4];
            let _ = stream.read_exact(&mut status).await;
            Ok::<_, std::io::Error>(())
        };
        if let Err(e) = tokio::time::timeout(Duration::from_secs(5), attempt)
            .await
            .unwrap_or(Ok(()))
        {
            warn!(error = %e, console, "announcing an emulator to simlock's adb server failed");
        }
    }

    /// The running emulator of `avd`: this run's, else one an earlier run left.
    fn running(&self, avd: &str) -> Option<Entry> {
        if let Some(s) = self.spawned.lock().get(avd).filter(|s| !s.has_exited()) {
            return Some(s.entry.clone());
        }
        self.runner.ledger().entries().into_iter().find(|e| {
            e.role == Role::Emulator && e.device.as_deref() == Some(avd) && process::still_runs(e)
        })
    }

    fn reserved(&self, avd: &str) -> Option<u16> {
        self.ports.lock().get(avd).copied()
    }

    /// The console port of `avd`: its reservation, else the lowest free even port.
    async fn reserve(&self, avd: &str) -> Result<u16, ToolError> {
        if let Some(p) = self.reserved(avd) {
            return Ok(p);
        }
        let serials = self.transports().await.unwrap_or_default();
        let (min, max) = self.s.console_ports;
        let mut ports = self.ports.lock();
        let taken: Vec<u16> = ports.values().copied().collect();
        let port = (min..=max)
            .step_by(2)
            .find(|p| {
                !taken.contains(p)
                    && !serials.contains_key(&format!("emulator-{p}"))
                    && free(*p)
                    && free(p + 1)
            })
            .ok_or_else(|| {
                ToolError::State(format!(
                    "no free console port in {min}–{max} (each emulator needs an even port and the next one)"
                ))
            })?;
        ports.insert(avd.to_owned(), port);
        drop(ports);
        write_json(
            &self.avd_dir(avd).join("simlock.json"),
            &Reservation { console_port: port },
        )?;
        Ok(port)
    }

    fn release(&self, avd: &str) {
        self.ports.lock().remove(avd);
        let _ = std::fs::remove_file(self.avd_dir(avd).join("simlock.json"));
    }

    fn access(&self, avd: &str, port: u16) -> DeviceAccess {
        DeviceAccess::AndroidEmulator {
            serial: format!("emulator-{port}"),
            adb_server_port: self.s.adb_server_port,
            avd_name: avd.to_owned(),
        }
    }

    async fn create(&self, spec: &DeviceSpec, device: &DeviceId) -> Result<String, ToolError> {
        let profile = self
            .profiles
            .iter()
            .find(|p| p.name == spec.model)
            .ok_or_else(|| ToolError::State(format!("no hardware profile named {}", spec.model)))?;
        let api: u32 = spec
            .os_version
            .parse()
            .map_err(|_| ToolError::State(format!("{} is not an API level", spec.os_version)))?;
        let image = self.images.get(&api).ok_or_else(|| {
            ToolError::State(format!("no system image of API {api} is installed"))
        })?;
        let name = format!("{AVD_PREFIX}{device}");
        let args: Vec<String> = [
            "create",
            "avd",
            "-n",
            &name,
            "-k",
            &image.package,
            "-d",
            &profile.id,
        ]
        .map(String::from)
        .to_vec();
        self.runner
            .run(
                &self.s.sdk.avdmanager,
                &args,
                Some("no\n"),
                self.s.call_timeout,
            )
            .await?;
        if !self.avd_dir(&name).join("config.ini").exists() {
            return Err(ToolError::State(format!(
                "avdmanager reported success but {} has no config.ini",
                self.avd_dir(&name).display()
            )));
        }
        Ok(name)
    }

    /// The key of what a baseline snapshot of `avd` depends on.
    fn baseline_key(&self, avd: &str) -> String {
        let config =
            std::fs::read_to_string(self.avd_dir(avd).join("config.ini")).unwrap_or_default();
        let sysdir = config
            .lines()
            .find_map(|l| l.trim().strip_prefix("image.sysdir.1="))
            .unwrap_or_default()
            .trim_end_matches('/')
            .to_owned();
        let revision =
            std::fs::read_to_string(self.s.sdk.root.join(&sysdir).join("source.properties"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("Pkg.Revision=")
                        .map(str::trim)
                        .map(String::from)
                })
                .unwrap_or_default();
        let image = format!("{sysdir}@{revision}");
        let headless = format!("headless={}", self.s.headless);
        let lines = parse::baseline_lines(&config);
        let mut parts: Vec<&str> = vec![&image, &self.emulator_version, &headless];
        parts.extend(lines.iter().map(String::as_str));
        parse::fnv1a(&parts)
    }

    fn baseline_valid(&self, avd: &str) -> bool {
        read_json::<Baseline>(&self.avd_dir(avd).join("simlock-clean-baseline.json"))
            .is_some_and(|b| b.snapshot == BASELINE && b.config_hash == self.baseline_key(avd))
    }

    fn launch(&self, avd: &str, port: u16, how: Launch) -> Result<Spawned, ToolError> {
        let mut args: Vec<String> = vec![
            "-avd".into(),
            avd.into(),
            "-port".into(),
            port.to_string(),
            "-no-snapshot-save".into(),
        ];
        if self.s.headless {
            args.extend(["-no-window", "-no-audio", "-no-boot-anim"].map(String::from));
        }
        match how {
            Launch::Cold => args.push("-no-snapshot-load".into()),
            Launch::Baseline => args.extend(["-snapshot".to_owned(), BASELINE.to_owned()]),
            Launch::Wipe => args.extend(["-wipe-data", "-no-snapshot-load"].map(String::from)),
        }
        let log = self.avd_dir(avd).join("simlock-emulator.log");
        let spawned = self.runner.spawn(&Start {
            program: &self.s.sdk.emulator,
            args: &args,
            env: &[],
            log: &log,
            role: Role::Emulator,
            device: Some(avd.to_owned()),
            port: Some(port),
        })?;
        self.spawned.lock().insert(avd.to_owned(), spawned.clone());
        Ok(spawned)
    }

    /// Waits until the emulator of `avd` on `port` booted, answers for this AVD on its console
    /// and shows as `device`; bounded by the boot timeout.
    async fn wait_ready(
        &self,
        avd: &str,
        port: u16,
        spawned: Option<&Spawned>,
    ) -> Result<(), ToolError> {
        let serial = format!("emulator-{port}");
        let bound = self.s.boot_timeout;
        let deadline = Instant::now() + bound;
        let mut announced = Instant::now();
        self.announce(port).await;
        loop {
            if spawned.is_some_and(Spawned::has_exited) {
                return Err(ToolError::State(format!(
                    "the emulator of {avd} exited while booting: {}",
                    tail(&self.avd_dir(avd).join("simlock-emulator.log"))
                )));
            }
            if Instant::now() >= deadline {
                return Err(ToolError::BootTimeout {
                    device: format!("the emulator of {avd}"),
                    ms: u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
                });
            }
            match self
                .adb(&["-s", &serial, "shell", "getprop", "sys.boot_completed"])
                .await
            {
                Ok(out) if parse::prop(&out.stdout) == "1" => {
                    let anim = self
                        .adb(&["-s", &serial, "shell", "getprop", "init.svc.bootanim"])
                        .await?;
                    if matches!(parse::prop(&anim.stdout), "" | "stopped") {
                        return self.check_console(avd, port).await;
                    }
                }
                Ok(_) | Err(ToolError::Timeout { .. }) => {}
                Err(ToolError::Failed { .. }) => {
                    // No transport yet: a server that lost it (or started after) hears again.
                    if announced.elapsed() >= REANNOUNCE_AFTER {
                        self.announce(port).await;
                        announced = Instant::now();
                    }
                }
                Err(e) => return Err(e),
            }
            tokio::time::sleep(self.s.boot_poll).await;
        }
    }

    /// The console on `port` must answer for `avd`: two emulators on one port means the
    /// serial reaches the other one.
    async fn check_console(&self, avd: &str, port: u16) -> Result<(), ToolError> {
        let (lines, ok) = self.emu(port, &["avd", "path"]).await?;
        let path = lines.first().map(PathBuf::from);
        let same = |a: &Path, b: &Path| {
            a.canonicalize()
                .ok()
                .zip(b.canonicalize().ok())
                .is_some_and(|(a, b)| a == b)
        };
        match path {
            _ if !ok => Err(ToolError::Garbled {
                command: format!("adb -s emulator-{port} emu avd path"),
                what: "the console's answer, ending OK",
                detail: format!("{lines:?}"),
            }),
            Some(p) if same(&p, &self.avd_dir(avd)) => Ok(()),
            _ => Err(ToolError::State(format!(
                "console port {port} answers for another emulator ({:?}), not {avd}",
                lines.first()
            ))),
        }
    }

    /// Saves the clean baseline of the running `avd` and its key.
    async fn capture_baseline(&self, avd: &str, port: u16) -> Result<(), ToolError> {
        let (lines, ok) = self
            .emu(port, &["avd", "snapshot", "save", BASELINE])
            .await?;
        if !ok {
            return Err(ToolError::State(format!(
                "saving the baseline snapshot of {avd} failed: {}",
                lines.join(" ")
            )));
        }
        let (lines, ok) = self.emu(port, &["avd", "snapshot", "list"]).await?;
        if !ok || !lines.iter().any(|l| l.contains(BASELINE)) {
            return Err(ToolError::State(format!(
                "the baseline snapshot of {avd} is not listed after saving it"
            )));
        }
        write_json(
            &self.avd_dir(avd).join("simlock-clean-baseline.json"),
            &Baseline {
                config_hash: self.baseline_key(avd),
                snapshot: BASELINE.into(),
            },
        )
    }

    /// Launches `avd` and waits for it; a boot past its bound kills the emulator. An emulator
    /// that exited at once gives up its port (unless `keep_port`), so a retry takes another.
    async fn start(&self, avd: &str, how: Launch, keep_port: bool) -> Result<u16, ToolError> {
        let port = self.reserve(avd).await?;
        let spawned = self.launch(avd, port, how)?;
        match self.wait_ready(avd, port, Some(&spawned)).await {
            Ok(()) => Ok(port),
            Err(e) => {
                spawned.stop(Duration::from_millis(200)).await;
                self.spawned.lock().remove(avd);
                if spawned.has_exited() && !keep_port && matches!(e, ToolError::State(_)) {
                    self.release(avd);
                }
                Err(match e {
                    e @ ToolError::BootTimeout { .. } => {
                        ToolError::State(format!("{e}; it was stopped"))
                    }
                    other => other,
                })
            }
        }
    }

    /// A fresh boot: from the baseline when it is valid, else cold (then the baseline is saved).
    async fn boot(&self, avd: &str) -> Result<DeviceAccess, ToolError> {
        if let Some(e) = self.running(avd) {
            let port = e.port.unwrap_or_default();
            self.wait_ready(avd, port, None).await?;
            return Ok(self.access(avd, port));
        }
        if self.baseline_valid(avd) {
            let port = self.start(avd, Launch::Baseline, false).await?;
            return Ok(self.access(avd, port));
        }
        let port = self.start(avd, Launch::Cold, false).await?;
        self.capture_baseline(avd, port).await?;
        Ok(self.access(avd, port))
    }

    /// Back to the baseline: a snapshot load while it is valid, else a wipe and a new baseline.
    async fn reclaim(&self, avd: &str) -> Result<DeviceAccess, ToolError> {
        if let Some(e) = self.running(avd) {
            let port = e.port.unwrap_or_default();
            if self.baseline_valid(avd) {
                let (lines, ok) = self
                    .emu(port, &["avd", "snapshot", "load", BASELINE])
                    .await?;
                if ok {
                    self.wait_ready(avd, port, None).await?;
                    return Ok(self.access(avd, port));
                }
                warn!(avd, reply = %lines.join(" "), "loading the baseline failed; wiping instead");
            }
            self.stop(avd).await?;
        }
        let _ = std::fs::remove_dir_all(self.avd_dir(avd).join("snapshots"));
        let port = self.start(avd, Launch::Wipe, false).await?;
        self.capture_baseline(avd, port).await?;
        Ok(self.access(avd, port))
    }

    /// After a crash under a lease: a cold boot on the same port, never a wipe.
    async fn recover(&self, avd: &str) -> Result<DeviceAccess, ToolError> {
        if self.running(avd).is_some() {
            self.stop(avd).await?;
        }
        let port = self.start(avd, Launch::Cold, true).await?;
        Ok(self.access(avd, port))
    }

    async fn adopt(&self, avd: &str) -> Result<Adopted, ToolError> {
        let Some(entry) = self.running(avd) else {
            return Ok(Adopted::Stopped);
        };
        let port = entry
            .port
            .or_else(|| self.reserved(avd))
            .unwrap_or_default();
        self.ports.lock().entry(avd.to_owned()).or_insert(port);
        self.announce(port).await;
        info!(
            avd,
            pid = entry.pid,
            port,
            "adopted an emulator left running"
        );
        Ok(Adopted::Running(self.access(avd, port)))
    }

    /// Stops the emulator of `avd`, if one runs: `emu kill`, then by pid.
    async fn stop(&self, avd: &str) -> Result<(), ToolError> {
        let Some(entry) = self.running(avd) else {
            return Ok(());
        };
        if let Some(port) = entry.port {
            let _ = self.emu(port, &["kill"]).await;
        }
        let ours = self
            .spawned
            .lock()
            .get(avd)
            .filter(|s| s.entry.pid == entry.pid)
            .cloned();
        match ours {
            Some(s) => {
                if !s.wait_exit(STOP_GRACE).await {
                    s.stop(Duration::from_secs(1)).await;
                }
            }
            None => {
                // Left by an earlier run: not our child, so only its pid tells when it is gone.
                let deadline = Instant::now() + STOP_GRACE;
                while process::pid_alive(entry.pid) && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                process::stop_foreign(entry.pid, Duration::from_secs(1)).await;
                self.runner.ledger().forget(entry.pid);
            }
        }
        self.spawned.lock().remove(avd);
        Ok(())
    }

    async fn delete(&self, avd: &str) -> Result<(), ToolError> {
        self.stop(avd).await?;
        let args: Vec<String> = ["delete", "avd", "-n", avd].map(String::from).to_vec();
        match self
            .runner
            .run(&self.s.sdk.avdmanager, &args, None, self.s.call_timeout)
            .await
        {
            Ok(_) => {}
            Err(e) if e.says("There is no Android Virtual Device") => {}
            Err(e) => return Err(e),
        }
        let _ = std::fs::remove_dir_all(self.avd_dir(avd));
        let _ = std::fs::remove_file(self.s.avd_home.join(format!("{avd}.ini")));
        self.release(avd);
        Ok(())
    }

    async fn close(&self) {
        let server = self.server.lock().take();
        if let Some(server) = server {
            server.stop(Duration::from_secs(5)).await;
            info!(pid = server.entry.pid, "simlock's adb server stopped");
        }
    }
}

/// The last lines of a log, for messages.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    if lines.is_empty() {
        "its log is empty".into()
    } else {
        lines.into_iter().rev().collect::<Vec<_>>().join(" / ")
    }
}

/// The port's future for a driver call.
fn boxed<T: Send + 'static>(
    call: impl Future<Output = Result<T, ToolError>> + Send + 'static,
) -> BoxFuture<'static, Result<T, DriverError>> {
    async move { call.await.map_err(|e| e.into_driver(Platform::Android)) }.boxed()
}

impl Driver for AndroidDriver {
    fn platform(&self) -> Platform {
        Platform::Android
    }

    fn status(&self) -> DriverStatus {
        DriverStatus {
            platform: Platform::Android,
            driver: DriverKind::AndroidSdk,
            available: true,
            reason: self.inner.reason.clone(),
        }
    }

    fn catalog(&self) -> PlatformCatalog {
        let i = &self.inner;
        let runtimes: Vec<String> = i.images.keys().rev().map(u32::to_string).collect();
        PlatformCatalog {
            platform: Platform::Android,
            models: i.profiles.iter().map(|p| p.name.clone()).collect(),
            default_runtime: runtimes.first().cloned(),
            model_runtimes: i
                .profiles
                .iter()
                .map(|p| (p.name.clone(), runtimes.clone()))
                .collect(),
            model_aliases: i
                .profiles
                .iter()
                .map(|p| (p.name.clone(), vec![p.id.clone()]))
                .collect(),
            runtimes,
            model_workers: None,
            runtime_workers: None,
            unavailable: None,
        }
    }

    fn estimates(&self) -> Estimates {
        // The original's measurements: AVD create ≈ 1 s, cold boot 60–71 s, snapshot reclaim ≈ 5 s.
        Estimates {
            provision_ms: 1_000,
            boot_ms: 70_000,
            reclaim_ms: 6_000,
        }
    }

    fn provision(
        &self,
        spec: &DeviceSpec,
        device: &DeviceId,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        let (i, spec, device) = (self.inner.clone(), spec.clone(), device.clone());
        boxed(async move { i.create(&spec, &device).await })
    }

    fn boot(&self, avd: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        let (i, avd) = (self.inner.clone(), avd.to_owned());
        boxed(async move {
            let _held = i.locks.lock(&avd).await;
            i.boot(&avd).await
        })
    }

    fn reclaim(&self, avd: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        let (i, avd) = (self.inner.clone(), avd.to_owned());
        boxed(async move {
            let _held = i.locks.lock(&avd).await;
            i.reclaim(&avd).await
        })
    }

    fn recover(&self, avd: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        let (i, avd) = (self.inner.clone(), avd.to_owned());
        boxed(async move {
            let _held = i.locks.lock(&avd).await;
            i.recover(&avd).await
        })
    }

    fn adopt(&self, avd: &str) -> BoxFuture<'static, Result<Adopted, DriverError>> {
        let (i, avd) = (self.inner.clone(), avd.to_owned());
        boxed(async move {
            let _held = i.locks.lock(&avd).await;
            i.adopt(&avd).await
        })
    }

    fn shutdown(&self, avd: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        let (i, avd) = (self.inner.clone(), avd.to_owned());
        boxed(async move {
            let _held = i.locks.lock(&avd).await;
            i.stop(&avd).await
        })
    }

    fn delete(&self, avd: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        let (i, avd) = (self.inner.clone(), avd.to_owned());
        boxed(async move {
            let _held = i.locks.lock(&avd).await;
            i.delete(&avd).await
        })
    }

    fn sweep(&self, keep: Vec<Keep>) -> BoxFuture<'static, Result<Vec<String>, DriverError>> {
        let i = self.inner.clone();
        boxed(async move {
            let mut names = avd_names(&i.s.avd_home);
            // An emulator of an AVD that is gone from the home is swept too.
            for e in i.runner.ledger().entries() {
                if let Some(d) = e.device.filter(|_| e.role == Role::Emulator)
                    && !names.contains(&d)
                {
                    names.push(d);
                }
            }
            let mut purged = Vec::new();
            for avd in names {
                let _held = i.locks.lock(&avd).await;
                match keep.iter().find(|k| k.driver_device_id == avd) {
                    None => {
                        tracing::info!(avd = %avd, "deleting an AVD no lease or device record holds (an earlier run's)");
                        i.delete(&avd).await?;
                        purged.push(avd);
                    }
                    Some(k) if k.stopped => {
                        if let Some(running) = i.running(&avd) {
                            tracing::info!(avd = %avd, pid = running.pid, "stopping an emulator an earlier run left running");
                        }
                        i.stop(&avd).await?;
                    }
                    Some(_) => {}
                }
            }
            Ok(purged)
        })
    }

    fn probe(&self) -> BoxFuture<'static, Result<Option<Vec<Observation>>, DriverError>> {
        let i = self.inner.clone();
        boxed(async move {
            let transports = i.transports().await?;
            let seen = avd_names(&i.s.avd_home)
                .into_iter()
                .map(|avd| {
                    let state = match i.running(&avd) {
                        None => RunState::Stopped,
                        Some(e) => {
                            let serial = format!("emulator-{}", e.port.unwrap_or_default());
                            if transports.get(&serial).is_some_and(|s| s == "device") {
                                RunState::Running
                            } else {
                                RunState::Transitioning
                            }
                        }
                    };
                    Observation {
                        driver_device_id: avd,
                        state,
                    }
                })
                .collect();
            Ok(Some(seen))
        })
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let i = self.inner.clone();
        async move { i.close().await }.boxed()
    }
}
