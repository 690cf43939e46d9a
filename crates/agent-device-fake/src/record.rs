//! The record of every request the fake received (the `/__fake/` control routes excepted): its
//! method, path and query, headers, the first bytes of its body with the body's full length and
//! SHA-256, and the status it was answered with.

use std::collections::VecDeque;
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use parking_lot::Mutex;
use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};

use crate::ids::hex;

/// How many records are kept; the oldest go first.
const KEPT: usize = 10_000;

/// One request as the fake received it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedRequest {
    /// Its position among every request the fake received, from 0.
    pub seq: u64,
    /// The method.
    pub method: String,
    /// The path and query, as sent.
    pub path: String,
    /// The headers, in order, with lower-case names.
    pub headers: Vec<(String, String)>,
    /// The first bytes of the body, up to the cap set by [`crate::FakeOptions::body_cap`]
    /// (in the control API: the text, or `null` when it is not UTF-8, plus `bodyBase64`).
    #[serde(serialize_with = "utf8_or_null")]
    pub body: Bytes,
    /// How many body bytes arrived in all.
    pub body_len: u64,
    /// The SHA-256 of every body byte that arrived, lower-case hex.
    pub body_sha256: String,
    /// Whether the body arrived to its end (false while it streams, or when the client left).
    pub complete: bool,
    /// The status the fake answered with, once it answered; `None` when it closed the
    /// connection instead (a body past the RPC cap).
    pub status: Option<u16>,
}

fn utf8_or_null<S: Serializer>(body: &Bytes, serializer: S) -> Result<S::Ok, S::Error> {
    match std::str::from_utf8(body) {
        Ok(text) => serializer.serialize_str(text),
        Err(_) => serializer.serialize_none(),
    }
}

impl RecordedRequest {
    /// The value of a header (the first, when it repeats).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON, when it is.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// The record as JSON for the control API, with the body also in base64.
    pub(crate) fn to_control_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).unwrap_or_default();
        if let Some(map) = value.as_object_mut() {
            map.insert(
                "bodyBase64".into(),
                serde_json::Value::String(STANDARD.encode(&self.body)),
            );
        }
        value
    }
}

/// The records, shared by every connection.
#[derive(Debug)]
pub(crate) struct RequestLog {
    cap: usize,
    records: VecDeque<RecordedRequest>,
    next_seq: u64,
}

impl RequestLog {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            cap,
            records: VecDeque::new(),
            next_seq: 0,
        }
    }

    /// Starts a record; its body is filled in by a [`BodyTap`].
    pub(crate) fn open(&mut self, method: &str, path: &str, headers: &HeaderMap) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.records.len() == KEPT {
            self.records.pop_front();
        }
        self.records.push_back(RecordedRequest {
            seq,
            method: method.to_owned(),
            path: path.to_owned(),
            headers: headers
                .iter()
                .map(|(name, value)| {
                    (
                        name.as_str().to_owned(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: Bytes::new(),
            body_len: 0,
            body_sha256: hex(&Sha256::digest(b"")),
            complete: false,
            status: None,
        });
        seq
    }

    fn update(&mut self, seq: u64, change: impl FnOnce(&mut RecordedRequest)) {
        if let Some(record) = self.records.iter_mut().rev().find(|r| r.seq == seq) {
            change(record);
        }
    }

    pub(crate) fn set_status(&mut self, seq: u64, status: u16) {
        self.update(seq, |r| r.status = Some(status));
    }

    pub(crate) fn snapshot(&self) -> Vec<RecordedRequest> {
        self.records.iter().cloned().collect()
    }

    pub(crate) fn clear(&mut self) {
        self.records.clear();
    }

    pub(crate) fn cap(&self) -> usize {
        self.cap
    }
}

/// Watches a request body go by: keeps its first bytes, counts and hashes all of them, and
/// writes what it saw into the record when it is done or dropped.
#[derive(Debug)]
pub(crate) struct BodyTap {
    log: Arc<Mutex<RequestLog>>,
    seq: u64,
    cap: usize,
    prefix: BytesMut,
    len: u64,
    hasher: Sha256,
    finished: bool,
}

impl BodyTap {
    pub(crate) fn new(log: Arc<Mutex<RequestLog>>, seq: u64) -> Self {
        let cap = log.lock().cap();
        Self {
            log,
            seq,
            cap,
            prefix: BytesMut::new(),
            len: 0,
            hasher: Sha256::new(),
            finished: false,
        }
    }

    pub(crate) fn feed(&mut self, chunk: &[u8]) {
        let room = self.cap.saturating_sub(self.prefix.len());
        self.prefix
            .extend_from_slice(&chunk[..room.min(chunk.len())]);
        self.len += chunk.len() as u64;
        self.hasher.update(chunk);
        // The length is kept current, so that a test can watch a body stream in.
        let len = self.len;
        self.log.lock().update(self.seq, |r| r.body_len = len);
    }

    fn write(&mut self, complete: bool) {
        let body = self.prefix.clone().freeze();
        let len = self.len;
        let sha = hex(&self.hasher.clone().finalize());
        self.log.lock().update(self.seq, |r| {
            r.body = body;
            r.body_len = len;
            r.body_sha256 = sha;
            r.complete = complete;
        });
    }

    /// Whether the body was seen to its end.
    pub(crate) fn finished(&self) -> bool {
        self.finished
    }

    /// How many body bytes went by.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The body arrived to its end.
    pub(crate) fn finish(&mut self) {
        self.finished = true;
        self.write(true);
    }
}

impl Drop for BodyTap {
    fn drop(&mut self) {
        if !self.finished {
            self.write(false);
        }
    }
}
