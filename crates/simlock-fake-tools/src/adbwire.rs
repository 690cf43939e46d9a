//! adb's host protocol as the fakes speak it: a request is four hex digits of length and the
//! service (`host:emulator:5587`); a reply is `OKAY`, or `FAIL` and a length-prefixed message,
//! optionally followed by a length-prefixed payload.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Writes one length-prefixed message.
pub fn write_message(stream: &mut impl Write, text: &str) -> io::Result<()> {
    write!(stream, "{:04x}{text}", text.len())
}

/// Reads one length-prefixed message.
pub fn read_message(stream: &mut impl Read) -> io::Result<String> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = std::str::from_utf8(&len)
        .ok()
        .and_then(|h| usize::from_str_radix(h, 16).ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad length prefix"))?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    String::from_utf8(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The answer to one host request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `OKAY`, with the payload that followed, if any.
    Okay(Option<String>),
    /// `FAIL` and its message.
    Fail(String),
}

/// Sends `service` to the server on `127.0.0.1:port` and reads its answer; `with_payload` when
/// the service answers a length-prefixed payload after `OKAY`.
pub fn request(port: u16, service: &str, with_payload: bool) -> io::Result<Answer> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write_message(&mut stream, service)?;
    let mut status = [0u8; 4];
    stream.read_exact(&mut status)?;
    match &status {
        b"OKAY" => {
            if with_payload {
                Ok(Answer::Okay(Some(read_message(&mut stream)?)))
            } else {
                Ok(Answer::Okay(None))
            }
        }
        b"FAIL" => Ok(Answer::Fail(read_message(&mut stream)?)),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected status {:?}", String::from_utf8_lossy(other)),
        )),
    }
}
