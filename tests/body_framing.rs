//! Bodies whose end only a closed connection marks. An HTTP/1.0-style
//! upstream body without `Content-Length` or chunking ends when the
//! upstream closes, and a plain FIN after half of it looks exactly like
//! its end: such a body is never stored as the response (retries are told
//! it was not stored). And a client that itself reads a body until the
//! connection closes (HTTP/1.0) must never see an aborted relay end in a
//! clean close: the proxy resets the connection instead.

use crate::support;

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

use support::proxy::{config, TestClient, TestProxy};
use support::upstream::TestUpstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const BODY: &str = r#"{"amount":1000}"#;

/// An upstream that answers every request with `response` and then closes
/// its side (a FIN), however much of a body `response` holds.
struct CloseDelimitedUpstream {
    addr: SocketAddr,
    served: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: JoinHandle<()>,
}

impl CloseDelimitedUpstream {
    async fn start(response: &'static [u8]) -> CloseDelimitedUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = served.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    if read_request(&mut stream).await {
                        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = stream.write_all(response).await;
                        let _ = stream.shutdown().await;
                    }
                });
            }
        });
        CloseDelimitedUpstream { addr, served, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn executions(&self) -> usize {
        self.served.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for CloseDelimitedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one request head and its `Content-Length` body; whether it came.
async fn read_request(stream: &mut TcpStream) -> bool {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let Ok(n) = stream.read(&mut buf).await else {
            return false;
        };
        if n == 0 {
            return false;
        }
        data.extend_from_slice(&buf[..n]);
        let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&data[..end]).to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if data.len() >= end + 4 + length {
            return true;
        }
    }
}

/// The upstream said the body ends where its connection did: the client
/// gets what came, but the record cannot vouch that it is the whole
/// response, so a retry is told it was not stored (with the status), and
/// nothing runs twice.
#[tokio::test]
async fn a_body_that_ends_with_the_upstream_connection_is_not_stored_as_the_response() {
    let upstream = CloseDelimitedUpstream::start(
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{\"id\":\"ch_1\",\"amo",
    )
    .await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();

    let first = client
        .post_json(&proxy.url("/v1/charges"), "cd-1", BODY)
        .await;
    assert_eq!(first.status, 201);
    assert_eq!(&first.body[..], b"{\"id\":\"ch_1\",\"amo");
    let retry = client
        .post_json(&proxy.url("/v1/charges"), "cd-1", BODY)
        .await;
    retry.assert_problem(502, "response-not-stored");
    assert!(retry.replayed());
    let detail = retry.json()["detail"].as_str().unwrap_or("").to_owned();
    assert!(
        detail.contains("201"),
        "names the original status: {detail}"
    );
    assert_eq!(upstream.executions(), 1);

    // A body of declared length is stored as usual, though the upstream
    // closes after it too.
    let sized = CloseDelimitedUpstream::start(
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 13\r\nconnection: close\r\n\r\n{\"id\":\"ch_2\"}",
    )
    .await;
    let proxy = TestProxy::start(config(&sized.url())).await;
    let first = client
        .post_json(&proxy.url("/v1/charges"), "cd-2", BODY)
        .await;
    assert_eq!(first.status, 201);
    let retry = client
        .post_json(&proxy.url("/v1/charges"), "cd-2", BODY)
        .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(&retry.body[..], b"{\"id\":\"ch_2\"}");
    assert_eq!(sized.executions(), 1);
}

/// An HTTP/1.0 client reads a body without a length until the connection
/// closes; when the upstream's body breaks off, a clean close would hand it
/// a truncated body that looks complete. It must see the connection reset,
/// and only then: a body that completes still ends in a clean close.
#[tokio::test]
async fn an_http10_client_never_sees_an_aborted_relay_as_a_clean_close() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;

    let broken = http10_post(
        proxy.addr,
        "/v1/export?chunked=1&abort_body=1&body_bytes=262144",
        "h10-1",
    )
    .await;
    match broken.ended {
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}"),
        Ok(()) => panic!(
            "an aborted body ended in a clean close after {} bytes",
            broken.received.len()
        ),
    }
    let whole = http10_post(
        proxy.addr,
        "/v1/export?chunked=1&body_bytes=262144",
        "h10-2",
    )
    .await;
    assert!(
        whole.ended.is_ok(),
        "a whole body ends in a clean close: {:?}",
        whole.ended
    );
    let body_start = whole
        .received
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head")
        + 4;
    assert_eq!(
        &whole.received[body_start..],
        &support::upstream::expected_body(262_144)[..]
    );
    assert_eq!(upstream.executions("/v1/export"), 2);
}

/// What an HTTP/1.0 client got: the bytes, and how the connection ended.
struct Http10Reply {
    received: Vec<u8>,
    ended: std::io::Result<()>,
}

/// A keyed POST over HTTP/1.0, read until the proxy ends the connection;
/// the response must be a 201 without a length.
async fn http10_post(proxy: SocketAddr, target: &str, key: &str) -> Http10Reply {
    let request = format!(
        "POST {target} HTTP/1.0\r\nhost: proxy.test\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let mut stream = TcpStream::connect(proxy).await.expect("connect");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("write the request");
    let mut received = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the proxy ends the connection within 20 s");
    let head = String::from_utf8_lossy(&received[..received.len().min(200)]).into_owned();
    assert!(head.starts_with("HTTP/1.0 201"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("content-length"),
        "the body's length is unknown: {head}"
    );
    Http10Reply { received, ended }
}
