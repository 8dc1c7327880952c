//! `max_in_flight`: past the limit a request is shed with 503 `overloaded`
//! before its body is read or its key claimed, so memory stays bounded and
//! nothing executes; an execution whose client went away keeps counting.

use crate::support;

use std::time::Duration;

use http::Method;
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::raw;
use support::upstream::TestUpstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ARRIVAL: Duration = Duration::from_secs(5);
const SLOW: &str = "/v1/slow?delay_ms=800";

fn assert_overloaded(reply: &Reply) {
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.problem(), "overloaded", "{reply:?}");
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(reply.header("x-should-retry"), Some("true"));
}

async fn metric(client: &TestClient, proxy: &TestProxy, series: &str) -> f64 {
    client.metric(&proxy.admin_url("/metrics"), series).await
}

/// POSTs `{}` to `/v1/orders` under `key` until it is not shed (503), for
/// at most `ARRIVAL`: a freed permit is visible a moment after the client
/// sees the end of what held it.
async fn post_until_admitted(client: &TestClient, proxy: &TestProxy, key: &str) -> Reply {
    let deadline = tokio::time::Instant::now() + ARRIVAL;
    loop {
        let reply = client.post_json(&proxy.url("/v1/orders"), key, "{}").await;
        if reply.status != 503 || tokio::time::Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn past_max_in_flight_requests_are_shed_with_503_and_never_execute() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.max_in_flight = 2;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    // Two slow executions take both permits.
    let slow: Vec<_> = ["slow-1", "slow-2"]
        .into_iter()
        .map(|key| {
            let client = client.clone();
            let url = proxy.url(SLOW);
            tokio::spawn(async move { client.post_json(&url, key, "{}").await })
        })
        .collect();
    assert!(upstream.wait_for_executions("/v1/slow", 2, ARRIVAL).await);

    // A covered request and an unkeyed passthrough are both shed; neither
    // claims its key nor reaches the upstream.
    let shed = client
        .post_json(&proxy.url("/v1/orders"), "late-1", r#"{"a":1}"#)
        .await;
    assert_overloaded(&shed);
    let passthrough = client
        .send(Method::POST, &proxy.url("/v1/orders"), &[], "{}")
        .await;
    assert_overloaded(&passthrough);
    assert_eq!(upstream.executions("/v1/orders"), 0);
    let key = support::keys::record_key(&support::keys::json_post("/v1/orders"), "late-1");
    assert!(proxy
        .store
        .get(&key)
        .await
        .expect("store answers")
        .is_none());
    assert_eq!(
        metric(
            &client,
            &proxy,
            r#"idemproxy_requests_total{route="default",outcome="overloaded"}"#
        )
        .await,
        2.0
    );

    for handle in slow {
        let reply = handle.await.expect("slow request task");
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    // Permits are back: the shed request's retry, same key, executes once.
    let retry = client
        .post_json(&proxy.url("/v1/orders"), "late-1", r#"{"a":1}"#)
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn an_execution_whose_client_left_still_holds_its_permit() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.max_in_flight = 1;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    let mut socket = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect to the proxy");
    let request = raw::request(
        "POST",
        SLOW,
        &[
            b"idempotency-key: left-1",
            b"content-type: application/json",
        ],
        b"{}",
    );
    socket.write_all(&request).await.expect("write the request");
    assert!(upstream.wait_for_executions("/v1/slow", 1, ARRIVAL).await);
    drop(socket);

    // The execution runs on without its client, and still counts.
    let shed = client
        .post_json(&proxy.url("/v1/orders"), "next-1", "{}")
        .await;
    assert_overloaded(&shed);

    // Once it has stored its outcome the permit is free again.
    let reply = post_until_admitted(&client, &proxy, "next-1").await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
    let stored = client.post_json(&proxy.url(SLOW), "left-1", "{}").await;
    assert!(stored.replayed(), "{stored:?}");
    assert_eq!(upstream.executions("/v1/slow"), 1);
}

#[tokio::test]
async fn a_streaming_passthrough_holds_its_permit_until_its_body_ends() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.max_in_flight = 1;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    // An uncovered GET whose 64 KiB body streams in 4 chunks 300 ms apart.
    let body_bytes = 4 * support::upstream::CHUNK;
    let mut socket = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect to the proxy");
    let target = format!("/v1/stream?body_bytes={body_bytes}&stream_delay_ms=300");
    socket
        .write_all(&raw::request("GET", &target, &[], b""))
        .await
        .expect("write the request");
    let mut received = Vec::new();
    let head_end = tokio::time::timeout(ARRIVAL, async {
        let mut buf = [0u8; 4096];
        loop {
            let n = socket.read(&mut buf).await.expect("read the head");
            assert!(n > 0, "the proxy closed before the head");
            received.extend_from_slice(&buf[..n]);
            if let Some(at) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
        }
    })
    .await
    .expect("the response head arrives");
    let head = String::from_utf8_lossy(&received[..head_end]).into_owned();
    assert!(head.starts_with("HTTP/1.1 201"), "{head}");
    assert!(
        head.contains(&format!("content-length: {body_bytes}")),
        "{head}"
    );
    assert!(
        received.len() - head_end < body_bytes,
        "the body is still streaming"
    );

    // Mid-body the passthrough still holds the only permit.
    let shed = client
        .post_json(&proxy.url("/v1/orders"), "after-stream", "{}")
        .await;
    assert_overloaded(&shed);

    tokio::time::timeout(ARRIVAL, socket.read_to_end(&mut received))
        .await
        .expect("the body ends")
        .expect("read the body");
    assert_eq!(received.len() - head_end, body_bytes);

    // The body is done: the permit is free again.
    let reply = post_until_admitted(&client, &proxy, "after-stream").await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

/// A connection that sent a covered request's head and 10 of the 100 body
/// bytes it announced, and then nothing.
async fn trickle(addr: std::net::SocketAddr, i: usize) -> tokio::net::TcpStream {
    let mut socket = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the proxy");
    let key = format!("idempotency-key: trickle-{i}");
    let mut head = raw::request(
        "POST",
        "/v1/trickle",
        &[key.as_bytes(), b"content-type: application/json"],
        &[b' '; 100],
    );
    head.truncate(head.len() - 90);
    socket.write_all(&head).await.expect("write the head");
    socket
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_trickle_in_are_cut_off_at_request_body_timeout() {
    // A covered body is read before its key is claimed, holding a permit:
    // clients that send a head and then a byte now and then could hold
    // every permit for as long as they like.
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.max_in_flight = 2;
    // Long enough that the check below lands while both bodies trickle,
    // even when the whole suite loads the machine.
    c.request_body_timeout = Duration::from_secs(4);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    let mut trickling = Vec::new();
    for i in 0..2 {
        trickling.push(trickle(proxy.addr, i).await);
    }
    // Both permits are held while the bodies trickle (once both heads
    // were read: polled, as a loaded machine may take a moment).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    let held = loop {
        // A probe can take a permit before a trickling head is read, and
        // that request is then shed (503) before its body: open it again.
        for (i, socket) in trickling.iter_mut().enumerate() {
            if socket.try_read(&mut [0u8; 1]).is_ok() {
                *socket = trickle(proxy.addr, i).await;
            }
        }
        let reply = client
            .post_json(&proxy.url("/v1/orders"), "held", "{}")
            .await;
        if reply.status == 503 || tokio::time::Instant::now() > deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_overloaded(&held);

    let started = tokio::time::Instant::now();
    for mut socket in trickling {
        let mut raw_answer = Vec::new();
        tokio::time::timeout(ARRIVAL, socket.read_to_end(&mut raw_answer))
            .await
            .expect("answered and closed")
            .expect("read the answer");
        let reply = raw::parse(&raw_answer);
        assert_eq!(reply.status, 408, "{reply:?}");
        assert_eq!(reply.problem(), "body-timeout", "{reply:?}");
        assert_eq!(reply.header("x-should-retry"), Some("true"));
    }
    // Cut off at request_body_timeout, long before a trickle would end.
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    // The permits are free again, nothing executed, and no key was claimed:
    // the same key with the whole body is a first request.
    let admitted = post_until_admitted(&client, &proxy, "after").await;
    assert_eq!(admitted.status, 201, "{admitted:?}");
    assert_eq!(upstream.executions("/v1/trickle"), 0);
    let whole = client
        .post_json(&proxy.url("/v1/trickle"), "trickle-0", &" ".repeat(100))
        .await;
    assert_eq!(whole.status, 201, "{whole:?}");
    assert!(!whole.replayed());
}
