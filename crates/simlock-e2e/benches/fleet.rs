//! The fleet benchmark: `cargo bench -p simlock-e2e --bench fleet` (or `cargo xtask bench fleet`).
//!
//! It measures, in one run:
//! - the seeded simulation of the fleet core with 10 000 seeds (or `SIMLOCK_FLEET_SIM_SEEDS`),
//!   every seed run to its end: how many pass and how many fail (each failure printed with its
//!   seed);
//! - full lease → renew → release cycles over HTTP from 32 concurrent agents through a real
//!   gateway and two real workers, and the same cycles straight against one worker (HTTP on the
//!   worker), in the same process. The virtual driver's provisioning, boot and reclaim take no
//!   time, so the figure measures simlock and not the fake devices. Each gateway run is paired
//!   with a direct run (their order alternates); `gateway_vs_worker` is the median of the pairs'
//!   ratios, `leases_per_s` the median gateway rate, since the machine is shared.
//!
//! The last line is the summary:
//! `fleet seeds=<n> failed=<n> leases_per_s=<x> gateway_vs_worker=<x>`.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a benchmark reports on stdout and fails by panicking"
)]

use std::time::Duration;

use serde_json::json;
use simlock_client::{Client, ConnectOptions};
use simlock_contract::model::Platform;
use simlock_contract::ops::LeaseRequestInput;
use simlock_core::config::CapacityStrategy;
use simlock_e2e::{TestFleet, gateway_config, session};
use simlock_fleet::state::sim;
use simlock_worker::WorkerConfig;
use tokio::time::Instant;

type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Concurrent agents.
const AGENTS: usize = 32;
/// Cycles each agent runs in one measured run.
const CYCLES: usize = 25;
/// Paired runs (gateway and direct).
const PAIRS: usize = 5;

fn main() -> BenchResult<()> {
    let seeds = sim::seeds_from_env(10_000);
    let started = Instant::now();
    let (report, failures) = sim::run_all(0, seeds);
    println!(
        "simulation: {} of {seeds} seeds pass in {:.1} s ({} steps, {} grants, {} releases, {} expiries, {} uplinks dropped, {} gateway restarts, {} orphans released, {} stale view reads, {} requests right after a release)",
        report.seeds,
        started.elapsed().as_secs_f64(),
        report.steps,
        report.grants,
        report.releases,
        report.expiries,
        report.disconnects,
        report.restarts,
        report.orphans,
        report.stale_reads,
        report.asks_after_release,
    );
    for failure in &failures {
        println!("simulation failure: {failure}");
    }
    let runtime = simlock_daemon::launch::runtime()?;
    let (rate, ratio) = runtime.block_on(async { tokio::spawn(measure()).await })??;
    println!(
        "fleet seeds={seeds} failed={} leases_per_s={rate:.0} gateway_vs_worker={ratio:.2}",
        failures.len()
    );
    Ok(())
}

/// A worker whose virtual devices take no time, with room for every agent.
fn worker_config() -> WorkerConfig {
    let mut config = WorkerConfig::default();
    config.core.capacity.strategy = CapacityStrategy::Fixed;
    config.core.capacity.max_running = u32::try_from(AGENTS).unwrap();
    config.core.virtual_devices.provision_ms = 0;
    config.core.virtual_devices.boot_ms = 0;
    config.core.virtual_devices.reclaim_ms = 0;
    config
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `AGENTS` HTTP clients of the daemon at `url`, each with its own agent token minted by
/// `mint`.
async fn agents(url: &str, tokens: Vec<String>) -> Vec<Client> {
    tokens
        .iter()
        .map(|token| Client::over_http(url, token, ConnectOptions::default()).unwrap())
        .collect()
}

/// Agent tokens minted on the daemon whose socket is `socket` (admin secret in `home`).
async fn mint(socket: &std::path::Path, home: &simlock_daemon::home::Home) -> Vec<String> {
    let admin = session(socket, "bench", Some(home)).await;
    let mut tokens = Vec::new();
    for _ in 0..AGENTS {
        let token = admin
            .call("token.create", json!({"role": "agent"}))
            .await
            .unwrap();
        tokens.push(token["secret"].as_str().unwrap().to_owned());
    }
    tokens
}

/// Every agent runs `cycles` lease → renew → release cycles at once; answers cycles per second.
async fn cycles(agents: &[Client], cycles: usize) -> f64 {
    let started = Instant::now();
    let runs: Vec<_> = agents
        .iter()
        .cloned()
        .map(|agent| {
            tokio::spawn(async move {
                for _ in 0..cycles {
                    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
                    input.ttl_ms = Some(60_000);
                    let grant = agent
                        .request_lease(input, |_| {}, std::future::pending())
                        .await
                        .unwrap();
                    let lease_id = grant.lease.id.to_string();
                    agent.renew(&lease_id, None).await.unwrap();
                    agent.release(&lease_id).await.unwrap();
                }
            })
        })
        .collect();
    for run in runs {
        tokio::time::timeout(Duration::from_secs(600), run)
            .await
            .expect("the cycles finish")
            .unwrap();
    }
    let took = started.elapsed().as_secs_f64();
    (agents.len() * cycles) as f64 / took
}

async fn measure() -> BenchResult<(f64, f64)> {
    // Through a gateway and two workers.
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config()).await;
    fleet.add_worker(worker_config()).await;
    let gateway_url = format!("http://{}", fleet.gateway().running.http_addr().unwrap());
    let tokens = mint(
        &fleet.gateway().running.socket_path(),
        &fleet.gateway_home(),
    )
    .await;
    let through_gateway = agents(&gateway_url, tokens).await;

    // Straight against one worker.
    let dir = tempfile::tempdir()?;
    let home = simlock_daemon::home::Home::at(dir.path().join("direct"));
    let mut config = worker_config();
    config.daemon.http.enabled = Some(true);
    config.daemon.http.port = 0;
    let direct = simlock_worker::start(simlock_worker::WorkerOptions::new(home.clone(), config))
        .await
        .unwrap();
    let direct_url = format!("http://{}", direct.running.http_addr().unwrap());
    let tokens = mint(&direct.running.socket_path(), &home).await;
    let straight = agents(&direct_url, tokens).await;

    // Warm up both: devices made, connections open.
    cycles(&through_gateway, 2).await;
    cycles(&straight, 2).await;
    let mut rates = Vec::new();
    let mut ratios = Vec::new();
    for pair in 0..PAIRS {
        let (gateway, worker) = if pair % 2 == 0 {
            let g = cycles(&through_gateway, CYCLES).await;
            (g, cycles(&straight, CYCLES).await)
        } else {
            let w = cycles(&straight, CYCLES).await;
            (cycles(&through_gateway, CYCLES).await, w)
        };
        println!(
            "run {pair}: through the gateway {gateway:.0} leases/s, straight to a worker {worker:.0} leases/s, ratio {:.2}",
            gateway / worker
        );
        rates.push(gateway);
        ratios.push(gateway / worker);
    }
    fleet.stop().await;
    direct.stop("bench").await;
    Ok((median(rates), median(ratios)))
}
