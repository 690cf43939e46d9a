//! A large upload streams through the fake: the PUT is hashed as it arrives and never held in
//! memory, and finalize still checks its size and SHA-256. Its own test binary, so that the
//! process's peak memory reflects this test alone.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

mod common;

use agent_device_fake::{FakeAgentDevice, FakeOptions};
use bytes::Bytes;
use common::{chunked, post_json, send};
use http::{Method, StatusCode};
use serde_json::json;
use sha2::{Digest, Sha256};

const SIZE: u64 = 64 * 1024 * 1024;
const CHUNK: usize = 256 * 1024;

/// Chunk `index` of the file: a pattern that differs per chunk, made on demand.
fn chunk(index: u64) -> Bytes {
    let seed = index.to_le_bytes();
    Bytes::from(
        (0..CHUNK)
            .map(|i| seed[i % 8] ^ u8::try_from(i % 251).unwrap())
            .collect::<Vec<u8>>(),
    )
}

fn chunks() -> u64 {
    SIZE / CHUNK as u64
}

/// The process's peak resident set (`VmHWM`), in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test]
async fn a_64_mib_upload_is_hashed_as_it_arrives_not_held() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let mut hasher = Sha256::new();
    for index in 0..chunks() {
        hasher.update(chunk(index));
    }
    let sha: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let ticket = post_json(
        &fake,
        "/upload/preflight",
        &json!({"uploadAttemptId":"big","sha256":sha,"fileName":"big.apk","sizeBytes":SIZE,"artifactType":"file"}),
    )
    .await
    .json();
    let before = peak_rss_kib();
    let body = chunked(futures::stream::iter((0..chunks()).map(|i| Ok(chunk(i)))));
    let auth = format!("Bearer {}", fake.token());
    let done = send(
        Method::PUT,
        ticket["upload"]["url"].as_str().unwrap(),
        &[
            ("authorization", &auth),
            ("content-type", "application/octet-stream"),
        ],
        body,
    )
    .await;
    assert_eq!((done.status, done.text().as_str()), (StatusCode::OK, "ok"));
    let grown_mib = (peak_rss_kib() - before) / 1024;
    println!("peak memory grew by {grown_mib} MiB");
    assert!(
        grown_mib < 24,
        "a {} MiB upload grew the peak memory by {grown_mib} MiB",
        SIZE >> 20
    );
    let record = fake
        .requests()
        .into_iter()
        .find(|r| r.method == "PUT")
        .unwrap();
    assert_eq!(record.body_len, SIZE);
    assert_eq!(record.body.len(), 64 * 1024);
    assert_eq!(record.body_sha256, sha);
    let finalized = post_json(
        &fake,
        "/upload/finalize",
        &json!({"uploadId":ticket["uploadId"]}),
    )
    .await;
    assert_eq!(finalized.status, StatusCode::OK, "{}", finalized.text());
    let upload = &fake.uploads()[0];
    assert_eq!((upload.size, upload.sha256.as_str()), (SIZE, sha.as_str()));
}
