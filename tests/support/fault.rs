//! Helpers for the fault-injection tests (`tests/fault_*.rs`): raw
//! exchanges that tolerate a connection the server (or a crash) breaks, and
//! a check that no path ever executed twice.

#![allow(unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::binary::ProxyProcess;
use super::proxy::Reply;
use super::upstream::TestUpstream;

/// What a raw exchange got back: whatever bytes arrived before the server
/// closed the connection (or it broke), and how it ended.
#[derive(Debug)]
pub struct RawAnswer {
    pub bytes: Vec<u8>,
    /// The error that ended the exchange, if it did not end with a clean
    /// close (e.g. a reset, or the write failing because the server gave up
    /// on the request).
    pub error: Option<std::io::ErrorKind>,
    pub elapsed: Duration,
}

impl RawAnswer {
    /// The status code of the response, if a response head arrived.
    pub fn status(&self) -> Option<u16> {
        status_of(&self.bytes)
    }

    /// The response, parsed; panics if there is no complete head.
    pub fn reply(&self) -> Reply {
        super::raw::parse(&self.bytes)
    }

    /// The first line, for messages.
    pub fn first_line(&self) -> String {
        let end = self
            .bytes
            .windows(2)
            .position(|w| w == b"\r\n")
            .unwrap_or(self.bytes.len().min(80));
        String::from_utf8_lossy(&self.bytes[..end]).into_owned()
    }
}

/// The status code of the HTTP/1.x response at the start of `raw`.
pub fn status_of(raw: &[u8]) -> Option<u16> {
    let line = raw.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split(' ');
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    parts.next()?.trim().parse().ok()
}

/// Writes `request` (in one go), then reads until the server closes the
/// connection or breaks it. A failing write is not an error here: servers
/// may answer and close before the request is fully sent. Panics if the
/// exchange takes longer than `within` (nothing may hang).
pub async fn raw_exchange(addr: SocketAddr, request: &[u8], within: Duration) -> RawAnswer {
    let started = Instant::now();
    let exchange = async {
        let mut stream = match TcpStream::connect(addr).await {
            Ok(stream) => stream,
            Err(e) => {
                return RawAnswer {
                    bytes: Vec::new(),
                    error: Some(e.kind()),
                    elapsed: started.elapsed(),
                }
            }
        };
        let mut error = stream.write_all(request).await.err().map(|e| e.kind());
        let mut bytes = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => bytes.extend_from_slice(&buf[..n]),
                Err(e) => {
                    error = Some(e.kind());
                    break;
                }
            }
        }
        RawAnswer {
            bytes,
            error,
            elapsed: started.elapsed(),
        }
    };
    match tokio::time::timeout(within, exchange).await {
        Ok(answer) => answer,
        Err(_) => panic!("raw exchange with {addr} still open after {within:?}"),
    }
}

/// A covered JSON POST to `target` with `key`, as raw bytes
/// (`Connection: close`).
pub fn raw_post(target: &str, key: &str, body: &str) -> Vec<u8> {
    let key = format!("idempotency-key: {key}");
    super::raw::request(
        "POST",
        target,
        &[key.as_bytes(), b"content-type: application/json"],
        body.as_bytes(),
    )
}

/// How often a set of paths reached the upstream (the fault tests give
/// every operation a path of its own).
#[derive(Debug)]
pub struct Executions {
    /// Executions over all the paths.
    pub total: usize,
    /// The paths executed more than once, with their counts.
    pub repeated: Vec<(String, usize)>,
}

impl Executions {
    pub fn count<'a>(upstream: &TestUpstream, paths: impl IntoIterator<Item = &'a str>) -> Self {
        let mut total = 0;
        let mut repeated = Vec::new();
        for path in paths {
            let n = upstream.executions(path);
            if n > 1 {
                repeated.push((path.to_string(), n));
            }
            total += n;
        }
        Executions { total, repeated }
    }

    /// Fails the test on any second execution.
    pub fn assert_at_most_once(&self) {
        assert!(
            self.repeated.is_empty(),
            "at most once was broken: executed more than once: {:?}",
            self.repeated
        );
    }
}

/// The problem type slug of `reply`, or `None` if it is no problem+json
/// answer (unlike [`Reply::problem`], never panics).
pub fn slug(reply: &Reply) -> Option<String> {
    if reply.header("content-type") != Some("application/problem+json") {
        return None;
    }
    let json: serde_json::Value = serde_json::from_slice(&reply.body).ok()?;
    json["type"]
        .as_str()?
        .strip_prefix("urn:idemproxy:problem:")
        .map(str::to_string)
}

/// Sends `key`'s request to `proxy` and kills the proxy (SIGKILL) once the
/// upstream has the request; the client gets no answer. Returns when the
/// request was sent.
pub async fn killed_mid_call(
    proxy: &mut ProxyProcess,
    upstream: &TestUpstream,
    path: &'static str,
    key: &'static str,
    body: &'static str,
) -> Instant {
    let sent_at = Instant::now();
    let doomed = {
        let addr = proxy.addr;
        tokio::spawn(async move {
            raw_exchange(addr, &raw_post(path, key, body), Duration::from_secs(10)).await
        })
    };
    assert!(
        upstream
            .wait_for_executions(path, 1, Duration::from_secs(5))
            .await,
        "the request reached the upstream:\n{}",
        proxy.logs()
    );
    proxy.kill();
    let lost = doomed.await.expect("the first client");
    assert_eq!(
        lost.status(),
        None,
        "no answer from a killed proxy: {lost:?}"
    );
    sent_at
}
