//! HTTP/1.1 by hand over a raw socket, for tests that must send what a client library would not
//! (a whole oversized body before reading) or keep one connection across requests.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test helper fails the test by panicking"
)]

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long one write or read may take before the test fails: a daemon that neither reads nor
/// answers fails the test, never hangs it.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Writes `bytes` whole to `stream`, within [`PATIENCE`]. Panics when the peer does not take
/// them.
pub async fn send(stream: &mut TcpStream, bytes: &[u8]) {
    tokio::time::timeout(PATIENCE, stream.write_all(bytes))
        .await
        .expect("the peer takes the request within PATIENCE")
        .unwrap();
}

/// A request head and `size` bytes of `fill` as a chunked body, in 64 KiB chunks, ready to be
/// written at once. `head` is the request line and headers, each line ending `\r\n`, without
/// the blank line that ends them; `Transfer-Encoding: chunked` is added.
pub fn chunked_request(head: &str, size: usize, fill: u8) -> Vec<u8> {
    let mut request = format!("{head}Transfer-Encoding: chunked\r\n\r\n").into_bytes();
    let mut left = size;
    while left > 0 {
        let len = left.min(64 * 1024);
        request.extend_from_slice(format!("{len:x}\r\n").as_bytes());
        request.extend(std::iter::repeat_n(fill, len));
        request.extend_from_slice(b"\r\n");
        left -= len;
    }
    request.extend_from_slice(b"0\r\n\r\n");
    request
}

/// Reads one response from `stream` and leaves the connection open: its status and its body
/// as text (a `content-length` body or a chunked one). Panics when the connection closes first.
pub async fn read_response(stream: &mut TcpStream) -> (u16, String) {
    let mut raw = Vec::new();
    let head_end = fill_until(stream, &mut raw, 0, b"\r\n\r\n").await;
    let head = String::from_utf8_lossy(&raw[..head_end]).to_lowercase();
    let status = head
        .get(9..12)
        .and_then(|code| code.parse().ok())
        .expect("a status line");
    let header = |name: &str| {
        head.lines()
            .find_map(|line| line.strip_prefix(name))
            .map(str::trim)
    };
    let mut body = Vec::new();
    if let Some(length) = header("content-length:") {
        let length: usize = length.parse().unwrap();
        fill_to(stream, &mut raw, head_end + length).await;
        body.extend_from_slice(&raw[head_end..head_end + length]);
    } else {
        assert_eq!(header("transfer-encoding:"), Some("chunked"), "{head}");
        let mut at = head_end;
        loop {
            let line_end = fill_until(stream, &mut raw, at, b"\r\n").await;
            let size_line = String::from_utf8_lossy(&raw[at..line_end - 2]).into_owned();
            let size = usize::from_str_radix(size_line.split(';').next().unwrap().trim(), 16)
                .unwrap_or_else(|_| panic!("a chunk size: {size_line:?}"));
            // The chunk and its CRLF; the last chunk is followed by the CRLF that ends trailers.
            fill_to(stream, &mut raw, line_end + size + 2).await;
            body.extend_from_slice(&raw[line_end..line_end + size]);
            at = line_end + size + 2;
            if size == 0 {
                break;
            }
        }
    }
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Reads into `raw` until `needle` appears at or after `from`; answers the index just past it.
async fn fill_until(
    stream: &mut TcpStream,
    raw: &mut Vec<u8>,
    from: usize,
    needle: &[u8],
) -> usize {
    loop {
        if let Some(at) = raw
            .get(from..)
            .and_then(|rest| rest.windows(needle.len()).position(|w| w == needle))
        {
            return from + at + needle.len();
        }
        read_more(stream, raw).await;
    }
}

/// Reads into `raw` until it holds `len` bytes.
async fn fill_to(stream: &mut TcpStream, raw: &mut Vec<u8>, len: usize) {
    while raw.len() < len {
        read_more(stream, raw).await;
    }
}

async fn read_more(stream: &mut TcpStream, raw: &mut Vec<u8>) {
    let mut buf = [0u8; 16 * 1024];
    let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no answer within PATIENCE: {}",
                String::from_utf8_lossy(raw)
            )
        })
        .unwrap();
    assert!(
        n > 0,
        "the connection closed: {}",
        String::from_utf8_lossy(raw)
    );
    raw.extend_from_slice(&buf[..n]);
}
