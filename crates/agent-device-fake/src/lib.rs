//! A faithful fake of Callstack's agent-device daemon as published in 0.21.5, for simlock's
//! tests: the same HTTP routes, JSON-RPC envelopes, HTTP statuses, lease rules, upload protocol,
//! one-shot artifacts and request diagnostics, so that the real 0.21.5 CLI (and simlock's
//! agent-device front and host) cannot tell it from the real daemon for the flows simlock uses.
//! `tests/conformance.rs` checks that claim by running one scripted CLI session against both.
//!
//! # As a library
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use agent_device_fake::{CommandFailure, DaemonError, Device, ErrorCode, FakeAgentDevice, FakeOptions};
//!
//! let fake = FakeAgentDevice::start(
//!     FakeOptions::default().with_devices(vec![Device::android_emulator("emulator-5554", "Pixel 9")]),
//! )?;
//! // Point a client at `fake.base_url()` with `fake.token()`.
//! let hold = fake.hold_commands("snapshot"); // snapshots now wait…
//! hold.wait_entered(1).await;                 // …until one arrives
//! hold.release();                             // …and then go through
//! fake.fail_commands(
//!     CommandFailure::new(DaemonError::new(ErrorCode::ToolMissing, "adb not found in PATH"))
//!         .for_command("install"),
//! );
//! assert!(fake.leases().is_empty());
//! fake.stop().await;
//! # Ok(()) }
//! ```
//!
//! * [`FakeAgentDevice::start`] binds `127.0.0.1:0` (inside a tokio runtime) and serves at once;
//!   [`FakeAgentDevice::base_url`], [`FakeAgentDevice::port`] and [`FakeAgentDevice::token`] (48
//!   lower-case hex characters, fresh per start unless [`FakeOptions::token`] fixes it) say how
//!   to reach it; [`FakeAgentDevice::stop`] closes the listener and every connection.
//! * Time is tokio's clock anchored to the wall clock at start, so a test that pauses and advances
//!   tokio time moves lease expiry with it (`createdAt`, `expiresAt` … stay epoch milliseconds).
//! * Inspection: [`FakeAgentDevice::requests`] (every request: method, path and query, headers,
//!   the first [`FakeOptions::body_cap`] bytes of the body with its full length and SHA-256, and
//!   the status answered), [`FakeAgentDevice::leases`], [`FakeAgentDevice::uploads`] (finalized
//!   uploads), [`FakeAgentDevice::sessions`].
//! * Knobs: [`FakeAgentDevice::set_devices`] (a list, an error reply, or a success with no list),
//!   [`FakeAgentDevice::fail_next_releases`] / [`FakeAgentDevice::fail_next_lease_calls`],
//!   [`FakeAgentDevice::fail_commands`] (a code and message, answered with a
//!   `diagnosticsRecord` so the CLI fetches the diagnostics), [`FakeAgentDevice::hold_commands`]
//!   (calls of a command wait until the test releases the hold), [`FakeAgentDevice::set_rpc_delay`]
//!   and [`FakeAgentDevice::set_screenshot`] (the bytes a `screenshot` artifact carries).
//!
//! # As a process: the `agent-device-fake` binary
//!
//! It starts like the real daemon (`node dist/src/internal/daemon.js`) so that simlock's host can
//! supervise it as `agentDevice.command`:
//!
//! * takes no arguments: `--help` (`-h`) prints its usage and exits 0, any other argument is
//!   refused, named on stderr, with exit status 2;
//! * reads `AGENT_DEVICE_STATE_DIR` (default `$HOME/.agent-device`) and
//!   `AGENT_DEVICE_DAEMON_SERVER_MODE` (`http`, or unset; `socket` and `dual` are refused with
//!   exit status 2), plus `AGENT_DEVICE_LEASE_TTL_MS`, `AGENT_DEVICE_LEASE_MIN_TTL_MS` and
//!   `AGENT_DEVICE_LEASE_MAX_TTL_MS` as the real daemon does;
//! * fake-only: `AGENT_DEVICE_FAKE_TOKEN` fixes the token, `AGENT_DEVICE_FAKE_DEVICES` (a JSON
//!   array of devices, as `devices` lists them) replaces the one Linux desktop it lists by default;
//! * prints `AGENT_DEVICE_DAEMON_HTTP_PORT=<n>` on stdout, then writes `<stateDir>/daemon.json`
//!   (mode 0600: `httpPort`, `transport`, `token`, `pid`, `version` `0.21.5`, `codeOrigin`,
//!   `processStartTime` as `ps -o lstart=` prints it, `stateDir`) and `daemon.lock`;
//! * on SIGTERM, SIGINT or SIGHUP removes both files and exits 0;
//! * like 0.21.5, when another live daemon holds the state directory (its `daemon.lock` names a
//!   running process) it prints `Daemon lock is held by another process; exiting.` and exits 0
//!   without a port line; a lock left by a daemon that died is taken over.
//!
//! # The control API (`/__fake/…`, no auth, not recorded)
//!
//! | Route | Body | Answer |
//! | --- | --- | --- |
//! | `GET /__fake/info` | | `{version, port, token, stateDir, pid, now}` |
//! | `GET /__fake/requests` | | `[RecordedRequest]`: `seq, method, path, headers` (pairs), `body` (text, or `null` when not UTF-8), `bodyBase64, bodyLen, bodySha256, complete, status` |
//! | `DELETE /__fake/requests` | | forgets the records |
//! | `GET /__fake/leases` | | active leases: `leaseId, tenantId, runId, backend, leaseProvider, deviceKey, clientId, createdAt, heartbeatAt, expiresAt, ttlMs, session, heartbeats, refreshes` |
//! | `GET /__fake/uploads` | | finalized uploads: `id, uploadId, fileName, size, sha256, artifactType, platform, tenant, route, finalizedAt` |
//! | `GET /__fake/sessions` | | open sessions: `name, device, leaseId, tenant, workspace, openedAt` |
//! | `PUT /__fake/devices` | `{"list":[device…]}`, `{"error":{code,message,…}}` or `"noList"` | what `devices` answers |
//! | `POST /__fake/lease-failures` | `{"op":"allocate"\|"heartbeat"\|"release","count":n,"error":{code,message,…}}` | the next `n` calls of `op` fail (0 clears) |
//! | `POST /__fake/command-failures` | `{"command"?,"platform"?,"error":{code,message,hint?,details?,retriable?},"times"?}` | matching commands fail |
//! | `DELETE /__fake/command-failures` | | clears the rules |
//! | `POST /__fake/holds` | `{"command":"open"}` | `{"id":n}`: calls of that command wait |
//! | `GET /__fake/holds`, `GET /__fake/holds/<id>` | | `{id, command, waiting, entered, released}` |
//! | `DELETE /__fake/holds/<id>` | | releases the hold |
//! | `PUT /__fake/rpc-delay` | `{"ms":n}` or `{"ms":null}` | every RPC waits that long first |
//! | `PUT /__fake/screenshot` | raw bytes | what the next screenshot artifacts carry |
//!
//! Errors are written `{"error":"<what>"}` with 400 (bad body), 404 (no such route or hold) or
//! 413 (a body over 16 MiB).
//!
//! # Fidelity
//!
//! What the fake answers was taken from the real 0.21.5 daemon's traffic, route by route
//! (see the module docs of [`leases`] and the tests); where the fake has to invent (the real
//! daemon drives real devices), it says so:
//!
//! * `devices` lists the configured devices, filtered by `--platform` (`apple` selects ios and
//!   macos), with `claimedBy` for a device an open session holds. A platform with no device lists
//!   nothing; the real daemon fails `TOOL_MISSING` when the platform's tools are missing, which a
//!   test gets with [`CommandFailure::on_platform`].
//! * `open` picks the first booted device matching `--platform`, `--udid`/`--serial` and
//!   `--device`; no match is `DEVICE_NOT_FOUND` (the real daemon's code; the message is the
//!   fake's), a device another session holds is `DEVICE_IN_USE` with
//!   `details.reason: DEVICE_CLAIM_LIVE_OWNER`. `close` releases the session's lease (§7.8).
//! * `screenshot` needs an open session and answers a 4×4 PNG (or the bytes set); it makes one
//!   artifact when the request names `meta.clientArtifactPaths.path`, downloadable once.
//! * `install` checks a named `meta.uploadedArtifactId` against the uploads finalized in the last
//!   five minutes (else `COMMAND_FAILED` with `details.reason: RESOURCE_EXPIRED`, as 0.21.5), or,
//!   naming none, that its path exists (`App binary not found: <path>`), and answers
//!   `{appId, message}`; `install_from_source` answers a made-up package
//!   (`com.agentdevice.fake`) and, with `retainPaths`, a materialization that
//!   `release_materialized_paths` releases once. `snapshot` answers `{nodes:[], truncated:false}`.
//!   Other commands answer `{}` once a session is open, and `No active session. Run open first.`
//!   before.
//! * `x-agent-device-network-access` is accepted only as `public-only` (anything else is 400
//!   `-32602` `Invalid daemon HTTP network access marker`); with it, an `install_source` command
//!   whose source is a `path` and that names no uploaded artifact is refused.
//! * Diagnostics hold the first and last line the real daemon writes (`request_start`,
//!   `request_failed`), not the steps in between; only failed requests have them, as in 0.21.5.
//! * The fake keeps no upload bytes: it hashes them as they arrive (finalize still checks size
//!   and SHA-256), so an upload of any size costs no memory. A legacy `app-bundle` upload is not
//!   unpacked. There is no idle timeout, no auth hook and no socket transport.

pub mod daemon_files;
pub mod leases;

mod control;
mod holds;
mod ids;
mod model;
mod record;
mod server;
mod uploads;
mod wire;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use crate::holds::{CommandHold, HoldStatus};
pub use crate::ids::{LeaseId, RunId, TenantId};
pub use crate::leases::{Lease, LeaseBackend, TtlPolicy};
pub use crate::model::{CommandFailure, DevicesAnswer, LeaseOp, Session, TINY_PNG};
pub use crate::record::RecordedRequest;
pub use crate::server::{HEALTH_BODY, JSON_BODY_CAP, RPC_BODY_CAP, VERSION};
pub use crate::uploads::{
    ArtifactType, FinalizedUpload, MAX_UPLOAD_BYTES, UPLOAD_IDLE_MS, UploadRoute,
};
pub use crate::wire::{
    DaemonError, Device, DeviceKind, DeviceTarget, DiagnosticsRecord, ErrorCode, Platform,
};

use crate::holds::Holds;
use crate::model::{Identity, Model};
use crate::record::RequestLog;
use crate::server::{Clock, Shared};

/// How a fake starts.
#[derive(Debug, Clone)]
pub struct FakeOptions {
    /// The token; `None` mints 24 random bytes as 48 lower-case hex characters, as 0.21.5 does.
    pub token: Option<String>,
    /// The devices `devices` lists and `open` picks from (default: the Linux desktop, named
    /// after this host, as the real daemon lists it on any Linux box).
    pub devices: Vec<Device>,
    /// The state directory the replies name in their paths (`logPath`, `sessionStateDir`, …);
    /// the library never writes there. Default: `<tmp>/agent-device-fake-<pid>`.
    pub state_dir: Option<PathBuf>,
    /// The lease TTL rule (default 60000, within 5000–600000).
    pub ttl: TtlPolicy,
    /// How many bytes of each request body [`FakeAgentDevice::requests`] keeps (default 64 KiB).
    pub body_cap: usize,
    /// The port to bind on 127.0.0.1 (default 0: one the system picks).
    pub port: u16,
}

impl Default for FakeOptions {
    fn default() -> Self {
        Self {
            token: None,
            devices: vec![Device::linux_local()],
            state_dir: None,
            ttl: TtlPolicy::default(),
            body_cap: 64 * 1024,
            port: 0,
        }
    }
}

impl FakeOptions {
    /// The same options with this token.
    #[must_use]
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The same options with these devices.
    #[must_use]
    pub fn with_devices(mut self, devices: Vec<Device>) -> Self {
        self.devices = devices;
        self
    }

    /// The same options with this state directory.
    #[must_use]
    pub fn with_state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.state_dir = Some(dir.into());
        self
    }

    /// The same options with this TTL rule.
    #[must_use]
    pub fn with_ttl(mut self, ttl: TtlPolicy) -> Self {
        self.ttl = ttl;
        self
    }
}

/// A fresh daemon token: 24 random bytes in lower-case hex.
fn mint_token() -> String {
    let mut bytes = [0u8; 24];
    rand::fill(&mut bytes);
    ids::hex(&bytes)
}

/// A running fake daemon. Dropping it stops serving; [`FakeAgentDevice::stop`] also waits for
/// the listener to close.
#[derive(Debug)]
pub struct FakeAgentDevice {
    shared: Arc<Shared>,
    state_dir: PathBuf,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl FakeAgentDevice {
    /// Binds `127.0.0.1:<options.port>` and starts serving. Must be called inside a tokio
    /// runtime.
    ///
    /// # Errors
    /// When there is no tokio runtime, or the port cannot be bound.
    pub fn start(options: FakeOptions) -> io::Result<Self> {
        let runtime = tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
        let std_listener =
            std::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, options.port)))?;
        std_listener.set_nonblocking(true)?;
        let local = std_listener.local_addr()?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(std_listener)?
        };
        let state_dir = options.state_dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("agent-device-fake-{}", std::process::id()))
        });
        let state_text = state_dir.display().to_string();
        let shared = Arc::new(Shared {
            model: Mutex::new(Model::new(
                Identity {
                    state_dir: state_text.clone(),
                    pid: std::process::id(),
                },
                options.devices,
                options.ttl,
            )),
            log: Arc::new(Mutex::new(RequestLog::new(options.body_cap))),
            holds: Arc::new(Holds::new()),
            token: options.token.unwrap_or_else(mint_token),
            clock: Clock::start(),
            local,
            state_dir: state_text,
        });
        let stop = CancellationToken::new();
        let task = runtime.spawn(server::serve(listener, shared.clone(), stop.clone()));
        Ok(Self {
            shared,
            state_dir,
            stop,
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.shared.local)
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.shared.local.port()
    }

    /// The token clients must present.
    pub fn token(&self) -> &str {
        &self.shared.token
    }

    /// The state directory the replies name.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The fake's clock, in epoch milliseconds.
    pub fn now_ms(&self) -> u64 {
        self.shared.clock.now_ms()
    }

    /// Stops serving: the listener closes, open connections are dropped.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Every request received so far, oldest first (the last 10 000).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.log.lock().snapshot()
    }

    /// Forgets the requests received so far.
    pub fn clear_requests(&self) {
        self.shared.log.lock().clear();
    }

    /// The leases active now, oldest first.
    pub fn leases(&self) -> Vec<Lease> {
        let now = self.now_ms();
        self.shared.model.lock().active_leases(now)
    }

    /// The uploads finalized so far (direct and legacy), oldest first.
    pub fn uploads(&self) -> Vec<FinalizedUpload> {
        self.shared.model.lock().finalized_uploads()
    }

    /// The open sessions.
    pub fn sessions(&self) -> Vec<Session> {
        self.shared.model.lock().sessions()
    }

    /// Sets what `devices` answers; a list is also what `open` picks from from now on.
    pub fn set_devices(&self, answer: DevicesAnswer) {
        self.shared.model.lock().set_devices(answer);
    }

    /// The next `n` lease releases fail with `error` (and release nothing).
    pub fn fail_next_releases(&self, n: u32, error: DaemonError) {
        self.fail_next_lease_calls(LeaseOp::Release, n, error);
    }

    /// The next `n` calls of a lease method fail with `error` (and change nothing); `n = 0`
    /// clears the knob.
    pub fn fail_next_lease_calls(&self, op: LeaseOp, n: u32, error: DaemonError) {
        let mut model = self.shared.model.lock();
        if n == 0 {
            model.knobs.lease_failures.remove(&op);
        } else {
            model.knobs.lease_failures.insert(op, (n, error));
        }
    }

    /// Commands matching `rule` fail with its error, after their lease checks pass. Rules are
    /// tried in the order they were added.
    pub fn fail_commands(&self, rule: CommandFailure) {
        self.shared.model.lock().knobs.command_failures.push(rule);
    }

    /// Drops every command failure rule.
    pub fn clear_command_failures(&self) {
        self.shared.model.lock().knobs.command_failures.clear();
    }

    /// Holds calls of `command` (a command name such as `open` or `snapshot`, or a method's
    /// internal name: `lease_allocate`, `lease_heartbeat`, `lease_release`, `install_source`,
    /// `release_materialized_paths`) once their checks pass, until the returned hold is released
    /// or dropped. A held call whose client hangs up stops waiting.
    pub fn hold_commands(&self, command: &str) -> CommandHold {
        CommandHold::new(self.shared.holds.clone(), command)
    }

    /// Every RPC waits `delay` (tokio time) before it runs; `None` removes the delay.
    pub fn set_rpc_delay(&self, delay: Option<Duration>) {
        self.shared.model.lock().knobs.rpc_delay = delay;
    }

    /// The bytes later screenshot artifacts carry (`width`/`height` are read from them when they
    /// are a PNG).
    pub fn set_screenshot(&self, bytes: Bytes) {
        self.shared.model.lock().knobs.screenshot = bytes;
    }
}

impl Drop for FakeAgentDevice {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
