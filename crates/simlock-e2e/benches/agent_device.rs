//! The agent-device upload benchmark: `cargo bench -p simlock-e2e --bench agent_device` (or
//! `cargo xtask bench agent-device`).
//!
//! A gateway and one worker serving `/v1/agent-device` over the published agent-device 0.21.5
//! daemon (fetched by `cargo xtask fetch-peers`). A 256 MiB upload — preflight, PUT, finalize,
//! as the CLI does it — goes straight to the daemon, through the worker's front, and through the
//! gateway and the worker (the lease header sent by hand), twice per path in each of six runs,
//! in mirrored order (A B C C B A, the ends rotating between runs) so a rate that drifts across
//! a run weighs alike on every path; each run's ratio is direct time / path time over its two
//! uploads, and the medians are reported; those uploads run alone. The daemon hashes the whole
//! file at finalize on every path; the PUT-only ratios are printed beside. Then, each run, one
//! more upload on the gateway's path while another lease on the same worker heartbeats through
//! the gateway, and one more straight to the daemon while a lease of the daemon's own heartbeats
//! straight to it, both paced every 10 ms by a caller on a thread and runtime of its own: the
//! p99 of each. Two more uploads on the gateway's path per run show where its heartbeat's time
//! goes: beside one, heartbeats straight to the daemon; beside the other, through the worker's
//! front (printed, not targets). Each path's CPU per GiB (simlock's process, the daemon) is
//! printed beside, and for its PUTs alone: how busy the cores were, the context switches, and how
//! long the daemon's main thread (its event loop, which every byte passes) ran and waited for a
//! core. The daemon's stored uploads are removed after each one, so the disk's write-back of
//! earlier runs weighs on none of them.
//!
//! Last, the floor of this machine: the same upload through one and through two chained byte
//! relays (no HTTP), against straight to the daemon, five mirrored runs; relays of two kinds:
//! ones that copy nothing in user space (`splice(2)`: no relaying path with as many hops can be
//! expected above their ratios), and ones that read every byte into a buffer and write it on
//! (what any relay that looks at its bytes pays at least).
//!
//! For a profiler, `AGENT_DEVICE_BENCH_ONLY=direct|worker|gateway` uploads 40 times on that path
//! alone and prints no summary.
//!
//! The last line is the summary: `agent-device worker_upload_ratio=<x>
//! gateway_upload_ratio=<x> heartbeat_p99_ms=<x> heartbeat_direct_p99_ms=<x>
//! one_hop_floor_ratio=<x> two_hop_floor_ratio=<x> one_hop_copy_floor_ratio=<x>
//! two_hop_copy_floor_ratio=<x>`.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a benchmark reports on stdout and fails by panicking"
)]

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use simlock_e2e::agent_device::{agent_device_config, real_daemon_command, real_package};
use tokio::time::Instant;

use simlock_daemon::http::body::BoxError;
type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

const MIB: usize = 1024 * 1024;
const SIZE: usize = 256 * MIB;
const CHUNK: usize = 256 * 1024;
/// Runs; a multiple of three, so each path stands at the ends of as many runs as the others.
const RUNS: usize = 6;
/// Runs of the floor's paths (direct, one and two relaying hops of each kind); a multiple of
/// five, so each path stands at the ends of as many runs as the others.
const FLOOR_RUNS: usize = 5;
/// How often a heartbeat is sent beside an upload.
const BEAT_EVERY: Duration = Duration::from_millis(10);

fn main() {
    let runtime = simlock_daemon::launch::runtime().expect("a runtime");
    runtime.block_on(async {
        tokio::spawn(bench()).await.expect("the bench ran");
    });
}

/// The body's bytes: a repeating pattern, the same every run.
fn chunk() -> Bytes {
    Bytes::from(
        (0..CHUNK)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect::<Vec<u8>>(),
    )
}

fn streamed(piece: Bytes) -> Body {
    let frames = futures::stream::iter(
        (0..SIZE / CHUNK).map(move |_| Ok::<_, BoxError>(http_body::Frame::data(piece.clone()))),
    );
    StreamBody::new(frames).boxed()
}

fn full(bytes: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

#[derive(Clone)]
struct Target {
    /// The base the routes hang off: the daemon's root, or a front's `/v1/agent-device`.
    base: String,
    /// The token the request carries.
    token: String,
    /// The lease header a gateway reads, when the path goes through one.
    lease: Option<String>,
    /// The daemon behind every path, whose CPU is measured.
    daemon_pid: String,
    /// The daemon's origin, should the ticket's URL name it, and what to put in its place (a
    /// byte relay's).
    origin: Option<(String, String)>,
}

struct Timing {
    total: Duration,
    put: Duration,
    /// What the PUT alone cost.
    put_cost: Counters,
}

impl Timing {
    const ZERO: Self = Self {
        total: Duration::ZERO,
        put: Duration::ZERO,
        put_cost: Counters::ZERO,
    };

    fn add(&mut self, other: &Self) {
        self.total += other.total;
        self.put += other.put;
        self.put_cost.add(&other.put_cost);
    }
}

/// What the kernel counts for simlock's process and the daemon's; differences of two readings
/// are what happened between them.
#[derive(Clone, Copy)]
struct Counters {
    /// CPU seconds, every thread: simlock's process (the client, the worker and the gateway).
    cpu: f64,
    /// CPU seconds, every thread: the daemon.
    daemon_cpu: f64,
    /// Context switches, voluntary or not, every thread: simlock's process.
    switches: f64,
    /// The same for the daemon.
    daemon_switches: f64,
    /// Seconds the daemon's main thread (its event loop: every byte of a PUT passes it) ran.
    main_ran: f64,
    /// Seconds the daemon's main thread was ready to run and waited for a core.
    main_waited: f64,
}

impl Counters {
    const ZERO: Self = Self {
        cpu: 0.0,
        daemon_cpu: 0.0,
        switches: 0.0,
        daemon_switches: 0.0,
        main_ran: 0.0,
        main_waited: 0.0,
    };

    fn read(daemon_pid: &str) -> Self {
        let (main_ran, main_waited) = main_thread(daemon_pid);
        Self {
            cpu: cpu_seconds("self"),
            daemon_cpu: cpu_seconds(daemon_pid),
            switches: switches("self"),
            daemon_switches: switches(daemon_pid),
            main_ran,
            main_waited,
        }
    }

    /// What happened since `before`.
    fn since(self, before: &Self) -> Self {
        Self {
            cpu: self.cpu - before.cpu,
            daemon_cpu: self.daemon_cpu - before.daemon_cpu,
            switches: self.switches - before.switches,
            daemon_switches: self.daemon_switches - before.daemon_switches,
            main_ran: self.main_ran - before.main_ran,
            main_waited: self.main_waited - before.main_waited,
        }
    }

    fn add(&mut self, other: &Self) {
        self.cpu += other.cpu;
        self.daemon_cpu += other.daemon_cpu;
        self.switches += other.switches;
        self.daemon_switches += other.daemon_switches;
        self.main_ran += other.main_ran;
        self.main_waited += other.main_waited;
    }
}

/// The uploading caller: a thread and runtime of its own, with a client of its own, as the CLI
/// runs in a process of its own. On the bench's runtime its sends would wait behind the
/// gateway's and the worker's tasks in their run queues (on the paths through them only).
struct Uploader {
    jobs: tokio::sync::mpsc::UnboundedSender<(Target, usize, tokio::sync::oneshot::Sender<Timing>)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Uploader {
    fn start(piece: Bytes, sha256: String) -> Self {
        let (jobs, mut queue) = tokio::sync::mpsc::unbounded_channel::<(
            Target,
            usize,
            tokio::sync::oneshot::Sender<Timing>,
        )>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let client = Client::builder(TokioExecutor::new()).build_http();
                while let Some((target, attempt, done)) = queue.recv().await {
                    let timing = upload(&client, &target, &piece, &sha256, attempt).await;
                    let _ = done.send(timing);
                }
            });
        });
        Self {
            jobs,
            thread: Some(thread),
        }
    }

    /// Uploads once on `target`'s path.
    async fn upload(&self, target: &Target, attempt: usize) -> Timing {
        let (done, timing) = tokio::sync::oneshot::channel();
        self.jobs.send((target.clone(), attempt, done)).unwrap();
        timing.await.expect("the uploader ran")
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        let (jobs, _) = tokio::sync::mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.jobs, jobs));
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

async fn upload(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    target: &Target,
    piece: &Bytes,
    sha256: &str,
    attempt: usize,
) -> Timing {
    let started = Instant::now();
    let bearer = format!("Bearer {}", target.token);
    let send = |method: Method, url: String, headers: Vec<(String, String)>, body: Body| {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        client.request(request.body(body).unwrap())
    };
    let preflight = json!({
        "uploadAttemptId": format!("bench-{attempt}"),
        "sha256": sha256,
        "fileName": format!("bench-{attempt}.apk"),
        "sizeBytes": SIZE,
        "artifactType": "file",
        "platform": "android",
        "contentType": "application/octet-stream",
    });
    let mut auth = vec![
        ("authorization".to_owned(), bearer.clone()),
        ("x-agent-device-token".to_owned(), target.token.clone()),
        ("content-type".to_owned(), "application/json".to_owned()),
    ];
    if let Some(lease) = &target.lease {
        auth.push(("x-agent-device-lease-id".to_owned(), lease.clone()));
    }
    let ticket = send(
        Method::POST,
        format!("{}/upload/preflight", target.base),
        auth.clone(),
        full(preflight.to_string()),
    )
    .await
    .unwrap();
    assert!(
        ticket.status().is_success(),
        "preflight: {}",
        ticket.status()
    );
    let ticket: Value =
        serde_json::from_slice(&ticket.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let mut url = ticket["upload"]["url"].as_str().unwrap().to_owned();
    if let Some((daemon, relay)) = &target.origin {
        // The daemon names the origin it was asked on (the relay's), or its own.
        assert!(
            url.contains(daemon.as_str()) || url.contains(relay.as_str()),
            "the ticket names the daemon or the relay: {url}"
        );
        url = url.replace(daemon.as_str(), relay);
    }
    let mut headers = simlock_e2e::agent_device::ticket_headers(&ticket);
    if let Some(lease) = &target.lease {
        headers.push(("x-agent-device-lease-id".to_owned(), lease.clone()));
    }
    // The counters are read outside the PUT's time.
    let before = Counters::read(&target.daemon_pid);
    let put_started = Instant::now();
    let put = send(Method::PUT, url, headers, streamed(piece.clone()))
        .await
        .unwrap();
    let status = put.status();
    let _ = put.into_body().collect().await.unwrap();
    assert!(status.is_success(), "PUT: {status}");
    let put_time = put_started.elapsed();
    let put_cost = Counters::read(&target.daemon_pid).since(&before);
    let finalize = json!({"uploadId": ticket["uploadId"]});
    let done = send(
        Method::POST,
        format!("{}/upload/finalize", target.base),
        auth,
        full(finalize.to_string()),
    )
    .await
    .unwrap();
    let status = done.status();
    let body = done.into_body().collect().await.unwrap().to_bytes();
    assert!(
        status.is_success(),
        "finalize: {status} {}",
        String::from_utf8_lossy(&body)
    );
    Timing {
        total: started.elapsed(),
        put: put_time,
        put_cost,
    }
}

/// The main thread of process `pid`: seconds it ran, seconds it was ready and waited for a core
/// (`/proc/<pid>/task/<pid>/schedstat`, in nanoseconds).
fn main_thread(pid: &str) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/schedstat")).unwrap();
    let mut fields = stat
        .split_whitespace()
        .map(|f| f.parse::<f64>().unwrap() / 1e9);
    (fields.next().unwrap(), fields.next().unwrap())
}

/// Context switches (voluntary and not) of every thread of process `pid` so far.
fn switches(pid: &str) -> f64 {
    let mut total = 0.0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        for line in status.lines() {
            if line.contains("ctxt_switches:") {
                total += line
                    .split_whitespace()
                    .last()
                    .unwrap()
                    .parse::<f64>()
                    .unwrap();
            }
        }
    }
    total
}

/// CPU seconds (user and system, every thread) process `pid` has used so far, read from
/// `/proc/<pid>/stat` (in clock ticks of 1/100 s, Linux's `USER_HZ`).
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's closing parenthesis; utime and stime are the 14th and 15th.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// Removes the uploads the daemon keeps under `tmp` (each a directory of its own), between
/// uploads, when nothing is being written.
fn forget_uploads(tmp: &std::path::Path) {
    for entry in std::fs::read_dir(tmp).unwrap().flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("agent-device-")
        {
            std::fs::remove_dir_all(entry.path()).unwrap();
        }
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let half = values.len() / 2;
    if values.len().is_multiple_of(2) {
        f64::midpoint(values[half - 1], values[half])
    } else {
        values[half]
    }
}

/// The `percent`th percentile of `values` (nearest rank), NaN when there are none.
fn percentile(values: &[f64], percent: usize) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = (sorted.len() * percent).div_ceil(100).saturating_sub(1);
    sorted.get(at).copied().unwrap_or(f64::NAN)
}

/// Heartbeats `call` to `rpc` with `token`, one after another, until `stop`; answers each
/// round trip in ms.
async fn heartbeats(
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    rpc: String,
    token: String,
    call: Value,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<f64> {
    let mut samples = Vec::new();
    // Paced, so both paths carry the same load whatever their round trip.
    let mut pace = tokio::time::interval(BEAT_EVERY);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.is_cancelled() {
        pace.tick().await;
        let started = Instant::now();
        let request = Request::builder()
            .method(Method::POST)
            .uri(&rpc)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {token}"))
            .header("x-agent-device-token", &token)
            .body(full(call.to_string()))
            .unwrap();
        let response = client.request(request).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["result"]["ok"], json!(true), "{answer}");
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    samples
}

/// Runs `upload` while heartbeats run beside it; answers the upload's timing and the beats.
async fn upload_beside(
    uploader: &Uploader,
    target: &Target,
    attempt: usize,
    beat: (String, String, Value),
) -> (Timing, Vec<f64>) {
    let stop = tokio_util::sync::CancellationToken::new();
    // The heartbeating caller runs on a thread and runtime of its own, as the CLI runs in a
    // process of its own: its sends and reads never wait behind the daemons' tasks in their
    // run queues.
    let (done, beats) = tokio::sync::oneshot::channel();
    let caller = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let samples = runtime.block_on(async move {
                let client = Client::builder(TokioExecutor::new()).build_http();
                heartbeats(client, beat.0, beat.1, beat.2, stop).await
            });
            // Its connections closed first, so the join below waits for nothing.
            drop(runtime);
            let _ = done.send(samples);
        })
    };
    let timing = uploader.upload(target, attempt).await;
    stop.cancel();
    let samples = beats.await.expect("the heartbeats ended");
    caller.join().unwrap();
    (timing, samples)
}

async fn rpc(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    url: &str,
    token: &str,
    call: &Value,
) -> Value {
    let request = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {token}"))
        .header("x-agent-device-token", token)
        .body(full(call.to_string()))
        .unwrap();
    let response = client.request(request).await.unwrap();
    serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

fn lease_call(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": "b1", "method": format!("agent_device.lease.{method}"), "params": params})
}

async fn bench() {
    let pkg = real_package();
    let mut gateway = simlock_e2e::gateway_config();
    gateway.agent_device.enabled = true;
    let mut fleet = simlock_e2e::TestFleet::start(gateway).await;
    let daemon_home = tempfile::tempdir().unwrap();
    let home = daemon_home.path().display().to_string();
    let mut config = agent_device_config(real_daemon_command(&pkg));
    config.core.capacity.max_running = 4;
    fleet
        .join_worker(
            0,
            config,
            |options| {
                options.agent_device_env = vec![("HOME".into(), home), ("CI".into(), "1".into())];
            },
            true,
        )
        .await;
    let worker_id = fleet.worker_id(0);
    fleet
        .wait_until(|f| {
            f.capable_workers("agent-device")
                .iter()
                .any(|w| w.id == worker_id)
        })
        .await;
    // The daemon keeps each upload in its temporary directory; the bench empties it after every
    // upload, so no run waits on the disk writing back earlier runs' files (that made the rate
    // fall across a run, by up to half, whatever the path).
    let state_dir = fleet.worker_home(0).root().join("agent-device");
    let daemon_tmp = agent_device_host::process::temp_dir(&state_dir);
    let daemon_pid = {
        let file = std::fs::read(state_dir.join("daemon.json")).unwrap();
        serde_json::from_slice::<Value>(&file).unwrap()["pid"].to_string()
    };
    let worker = fleet.worker(0);
    let host = worker.agent_device.as_ref().unwrap().host.clone();
    let agent_device_host::DaemonState::Running(endpoint) = host.state() else {
        panic!("the daemon runs");
    };
    let mint = |session: simlock_e2e::Session| async move {
        let created = session
            .call("token.create", json!({"role": "agent", "label": "bench"}))
            .await
            .unwrap();
        created["secret"].as_str().unwrap().to_owned()
    };
    let worker_secret = mint(
        simlock_e2e::session(
            &worker.running.socket_path(),
            "operator",
            Some(&fleet.worker_home(0)),
        )
        .await,
    )
    .await;
    let gateway_secret = mint(fleet.operator().await).await;
    let gateway_base = format!(
        "http://{}/v1/agent-device",
        fleet.gateway().running.http_addr().unwrap()
    );
    let worker_base = format!(
        "http://{}/v1/agent-device",
        worker.running.http_addr().unwrap()
    );
    let client = Client::builder(TokioExecutor::new()).build_http();
    // Two leases through the gateway: one the upload names, one that heartbeats beside it.
    let allocate = |session: &str| {
        lease_call(
            "allocate",
            json!({"session": session, "tenantId": "bench", "runId": "run1", "backend": "android-instance"}),
        )
    };
    let mut through = Vec::new();
    for session in ["upload", "beats"] {
        let answer = rpc(
            &client,
            &format!("{gateway_base}/rpc"),
            &gateway_secret,
            &allocate(session),
        )
        .await;
        through.push(
            answer["result"]["data"]["lease"]["leaseId"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    let gateway_beat = (
        format!("{gateway_base}/rpc"),
        gateway_secret.clone(),
        lease_call(
            "heartbeat",
            json!({"session": "beats", "tenantId": "bench", "runId": "run1", "leaseId": through[1]}),
        ),
    );
    // A lease through the worker's front, heartbeating beside the gateway's upload: how much of
    // the gateway path's heartbeat is the worker's share (printed beside, not a target).
    let worker_lease = rpc(
        &client,
        &format!("{worker_base}/rpc"),
        &worker_secret,
        &allocate("worker-beats"),
    )
    .await;
    let worker_beat = (
        format!("{worker_base}/rpc"),
        worker_secret.clone(),
        lease_call(
            "heartbeat",
            json!({"session": "worker-beats", "tenantId": "bench", "runId": "run1",
                "leaseId": worker_lease["result"]["data"]["lease"]["leaseId"]}),
        ),
    );
    // A lease of the daemon's own, heartbeating straight to it: the baseline.
    let daemon_rpc = format!("http://127.0.0.1:{}/rpc", endpoint.port);
    let own = rpc(
        &client,
        &daemon_rpc,
        &endpoint.token,
        &lease_call(
            "allocate",
            json!({"session": "direct", "tenantId": "direct", "runId": "run1", "ttlMs": 600_000, "backend": "android-instance"}),
        ),
    )
    .await;
    let direct_beat = (
        daemon_rpc.clone(),
        endpoint.token.clone(),
        lease_call(
            "heartbeat",
            json!({"session": "direct", "tenantId": "direct", "runId": "run1",
                "leaseId": own["result"]["data"]["lease"]["leaseId"], "ttlMs": 600_000}),
        ),
    );
    let direct = Target {
        base: format!("http://127.0.0.1:{}", endpoint.port),
        token: endpoint.token.clone(),
        lease: None,
        daemon_pid: daemon_pid.clone(),
        origin: None,
    };
    let via_worker = Target {
        base: worker_base,
        token: worker_secret,
        lease: None,
        daemon_pid: daemon_pid.clone(),
        origin: None,
    };
    let via_gateway = Target {
        base: gateway_base,
        token: gateway_secret,
        lease: Some(through[0].clone()),
        daemon_pid: daemon_pid.clone(),
        origin: None,
    };
    let piece = chunk();
    let mut hasher = Sha256::new();
    for _ in 0..SIZE / CHUNK {
        hasher.update(&piece);
    }
    let sha256: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let uploader = Uploader::start(piece.clone(), sha256.clone());
    // One of each first, to warm up connections and the daemon.
    for (i, target) in [&direct, &via_worker, &via_gateway].into_iter().enumerate() {
        let _ = uploader.upload(target, i).await;
        forget_uploads(&daemon_tmp);
    }
    // For a profiler: `AGENT_DEVICE_BENCH_ONLY=direct|worker|gateway` uploads on that path alone,
    // 40 times, and prints each PUT's rate and no summary.
    if let Ok(only) = std::env::var("AGENT_DEVICE_BENCH_ONLY") {
        let target = match only.as_str() {
            "direct" => &direct,
            "worker" => &via_worker,
            "gateway" => &via_gateway,
            other => panic!("AGENT_DEVICE_BENCH_ONLY={other}: direct, worker or gateway"),
        };
        println!("{only} only; this process is {}", std::process::id());
        for n in 0..40 {
            let timing = uploader.upload(target, 1000 + n).await;
            forget_uploads(&daemon_tmp);
            println!(
                "{only} PUT {:.0} MiB/s",
                (SIZE / MIB) as f64 / timing.put.as_secs_f64()
            );
        }
        drop(daemon_home);
        fleet.stop().await;
        return;
    }
    let mut worker_ratios = Vec::new();
    let mut gateway_ratios = Vec::new();
    let mut put_ratios = (Vec::new(), Vec::new());
    let (mut beats, mut direct_beats) = (Vec::new(), Vec::new());
    let mut beside_gateway = (Vec::new(), Vec::new());
    // Each path's time in a run is that of its two uploads.
    let mibs = |t: Duration| (2 * SIZE / MIB) as f64 / t.as_secs_f64();
    // What each path's uploads cost, whole and their PUTs alone (in its timings).
    let mut cost = [Counters::ZERO; 3];
    let mut puts = [Timing::ZERO; 3];
    for run in 0..RUNS {
        let attempt = 10 + 10 * run;
        // Each path uploads twice per run, in mirrored order (A B C C B A), so a rate that
        // drifts across the run (the daemon slows as a run goes on) weighs alike on every path;
        // which path stands at the ends rotates from run to run. These six uploads run alone:
        // nothing else loads the daemon's event loop.
        let mut order = [0, 1, 2];
        order.rotate_left(run % 3);
        let mirrored = order.into_iter().chain(order.into_iter().rev());
        let mut timings = [Timing::ZERO; 3];
        for (n, which) in mirrored.enumerate() {
            let target = [&direct, &via_worker, &via_gateway][which];
            let before = Counters::read(&daemon_pid);
            let timing = uploader.upload(target, attempt + n).await;
            timings[which].add(&timing);
            puts[which].add(&timing);
            cost[which].add(&Counters::read(&daemon_pid).since(&before));
            forget_uploads(&daemon_tmp);
        }
        // Then the heartbeats, paced alike, each beside an upload on its own path.
        let (_, b) = upload_beside(&uploader, &direct, attempt + 6, direct_beat.clone()).await;
        direct_beats.extend(b);
        forget_uploads(&daemon_tmp);
        let (_, b) =
            upload_beside(&uploader, &via_gateway, attempt + 7, gateway_beat.clone()).await;
        beats.extend(b);
        forget_uploads(&daemon_tmp);
        // Where the gateway path's heartbeat goes: beside the same upload on the gateway's path,
        // heartbeats straight to the daemon (the daemon's own share under that load), then
        // through the worker's front (the worker's share).
        for (n, (beat, into)) in [
            (&direct_beat, &mut beside_gateway.0),
            (&worker_beat, &mut beside_gateway.1),
        ]
        .into_iter()
        .enumerate()
        {
            let (_, b) =
                upload_beside(&uploader, &via_gateway, attempt + 8 + n, beat.clone()).await;
            into.extend(b);
            forget_uploads(&daemon_tmp);
        }
        let [d, w, g] = timings;
        let ratio = |path: &Timing| d.total.as_secs_f64() / path.total.as_secs_f64();
        let put = |path: &Timing| d.put.as_secs_f64() / path.put.as_secs_f64();
        println!(
            "run {run}: direct {:.0} MiB/s (PUT {:.0}), worker {:.0} (PUT {:.0}) ratio {:.3} (PUT {:.3}), gateway {:.0} (PUT {:.0}) ratio {:.3} (PUT {:.3})",
            mibs(d.total),
            mibs(d.put),
            mibs(w.total),
            mibs(w.put),
            ratio(&w),
            put(&w),
            mibs(g.total),
            mibs(g.put),
            ratio(&g),
            put(&g),
        );
        worker_ratios.push(ratio(&w));
        gateway_ratios.push(ratio(&g));
        put_ratios.0.push(put(&w));
        put_ratios.1.push(put(&g));
    }
    println!(
        "PUT-only median ratios: worker {:.3}, gateway {:.3}; heartbeats: {} through the gateway, {} direct",
        median(put_ratios.0),
        median(put_ratios.1),
        beats.len(),
        direct_beats.len()
    );
    let gib = (2 * RUNS * SIZE) as f64 / (1024.0 * MIB as f64);
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as f64;
    for ((name, whole), put) in ["direct", "worker", "gateway"].iter().zip(&cost).zip(&puts) {
        let part = &put.put_cost;
        let wall = put.put.as_secs_f64();
        println!(
            "{name}: CPU per GiB, simlock's process {:.2} s, the daemon {:.2} s; in the PUT alone {:.2} s and {:.2} s, {:.2} of the {cores} cores busy, {:.1} and {:.1} context switches per MiB",
            whole.cpu / gib,
            whole.daemon_cpu / gib,
            part.cpu / gib,
            part.daemon_cpu / gib,
            (part.cpu + part.daemon_cpu) / wall / cores,
            part.switches / gib / 1024.0,
            part.daemon_switches / gib / 1024.0,
        );
        println!(
            "{name}: per GiB of PUT, {:.2} s of wall time; the daemon's main thread ran {:.2} s and waited {:.2} s for a core",
            wall / gib,
            part.main_ran / gib,
            part.main_waited / gib,
        );
    }
    let quantiles = |samples: &[f64]| {
        format!(
            "p50 {:.2} p90 {:.2} p99 {:.2} ms",
            percentile(samples, 50),
            percentile(samples, 90),
            percentile(samples, 99)
        )
    };
    println!(
        "heartbeats beside their own path's upload: through the gateway {}; straight to the daemon {}",
        quantiles(&beats),
        quantiles(&direct_beats)
    );
    println!(
        "heartbeats beside the gateway's upload: straight to the daemon {}; through the worker's front {}",
        quantiles(&beside_gateway.0),
        quantiles(&beside_gateway.1)
    );
    let floors = floors(&uploader, &direct, &endpoint, &daemon_tmp).await;
    let ((one_hop, two_hop), (one_copy, two_copy)) = (floors.splice, floors.copy);
    let (worker_ratio, gateway_ratio) = (median(worker_ratios), median(gateway_ratios));
    let (beat_p99, direct_p99) = (percentile(&beats, 99), percentile(&direct_beats, 99));
    drop(daemon_home);
    fleet.stop().await;
    println!(
        "agent-device worker_upload_ratio={worker_ratio:.3} gateway_upload_ratio={gateway_ratio:.3} heartbeat_p99_ms={beat_p99:.2} heartbeat_direct_p99_ms={direct_p99:.2} one_hop_floor_ratio={one_hop:.3} two_hop_floor_ratio={two_hop:.3} one_hop_copy_floor_ratio={one_copy:.3} two_hop_copy_floor_ratio={two_copy:.3}"
    );
}

/// The floor's medians: direct time / time through one and two chained byte relays of each
/// kind.
struct Floors {
    splice: (f64, f64),
    copy: (f64, f64),
}

/// What paths of one or two relaying hops can do on this machine: the same upload through one
/// and through two chained byte relays, no HTTP, of two kinds: relays that copy nothing in user
/// space (`splice(2)`), and relays that read every byte into a buffer and write it on (as any
/// relay that looks at its bytes must), against straight to the daemon, mirrored as the main
/// runs are; the median ratios.
async fn floors(
    uploader: &Uploader,
    direct: &Target,
    endpoint: &agent_device_host::process::Endpoint,
    daemon_tmp: &std::path::Path,
) -> Floors {
    let daemon_origin = format!("127.0.0.1:{}", endpoint.port);
    let splice_one = byte_relay(daemon_origin.clone(), Pump::Splice);
    let splice_two = byte_relay(splice_one.clone(), Pump::Splice);
    let copy_one = byte_relay(daemon_origin.clone(), Pump::Copy);
    let copy_two = byte_relay(copy_one.clone(), Pump::Copy);
    let relayed = |origin: &str| Target {
        base: format!("http://{origin}"),
        token: endpoint.token.clone(),
        lease: None,
        daemon_pid: direct.daemon_pid.clone(),
        origin: Some((daemon_origin.clone(), origin.to_owned())),
    };
    let paths = [
        direct,
        &relayed(&splice_one),
        &relayed(&splice_two),
        &relayed(&copy_one),
        &relayed(&copy_two),
    ];
    let mut ratios: [Vec<f64>; 4] = Default::default();
    for run in 0..FLOOR_RUNS {
        let mut order = [0, 1, 2, 3, 4];
        order.rotate_left(run % 5);
        let mut times = [Duration::ZERO; 5];
        for (n, which) in order.into_iter().chain(order.into_iter().rev()).enumerate() {
            let timing = uploader.upload(paths[which], 900 + 10 * run + n).await;
            times[which] += timing.total;
            forget_uploads(daemon_tmp);
        }
        let [d, relays @ ..] = times.map(|t| t.as_secs_f64());
        let run_ratios = relays.map(|t| d / t);
        println!(
            "floor run {run}: splice relays one hop {:.3}, two {:.3}; copying relays one hop {:.3}, two {:.3} (of direct)",
            run_ratios[0], run_ratios[1], run_ratios[2], run_ratios[3]
        );
        for (all, ratio) in ratios.iter_mut().zip(run_ratios) {
            all.push(ratio);
        }
    }
    let [splice_one, splice_two, copy_one, copy_two] = ratios.map(median);
    Floors {
        splice: (splice_one, splice_two),
        copy: (copy_one, copy_two),
    }
}

/// How a byte relay moves its bytes.
#[derive(Clone, Copy)]
enum Pump {
    /// Socket to pipe to socket with `splice(2)`: nothing copied in user space.
    Splice,
    /// Read into a 1 MiB buffer and written on: one copy in and one out of user space per byte.
    Copy,
}

/// A byte relay, a thread per direction; its address.
fn byte_relay(upstream: String, pump: Pump) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for inbound in listener.incoming() {
            let inbound = inbound.unwrap();
            let outbound = std::net::TcpStream::connect(&upstream).unwrap();
            inbound.set_nodelay(true).unwrap();
            outbound.set_nodelay(true).unwrap();
            let back = (outbound.try_clone().unwrap(), inbound.try_clone().unwrap());
            let run = move |from: &std::net::TcpStream, to: &std::net::TcpStream| match pump {
                Pump::Splice => splice_pump(from, to),
                Pump::Copy => copy_pump(from, to),
            };
            std::thread::spawn(move || run(&inbound, &outbound));
            std::thread::spawn(move || run(&back.0, &back.1));
        }
    });
    addr
}

/// Moves `from`'s bytes to `to` through a pipe until `from` ends, then ends `to`'s writing.
fn splice_pump(from: &std::net::TcpStream, to: &std::net::TcpStream) {
    use rustix::pipe::{SpliceFlags, splice};
    let (read, write) = rustix::pipe::pipe().unwrap();
    let _ = rustix::pipe::fcntl_setpipe_size(&write, MIB);
    while let Ok(n @ 1..) = splice(from, None, &write, None, MIB, SpliceFlags::MOVE) {
        let mut left = n;
        while left > 0 {
            match splice(&read, None, to, None, left, SpliceFlags::MOVE) {
                Ok(0) | Err(_) => return,
                Ok(moved) => left -= moved,
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Moves `from`'s bytes to `to` through a 1 MiB buffer until `from` ends, then ends `to`'s
/// writing.
fn copy_pump(mut from: &std::net::TcpStream, mut to: &std::net::TcpStream) {
    use std::io::{Read, Write};
    let mut buffer = vec![0; MIB];
    while let Ok(n @ 1..) = from.read(&mut buffer) {
        if to.write_all(&buffer[..n]).is_err() {
            return;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}
