//! DESIGN.md §1, the failure rows: oversized requests, an unreachable,
//! releasing, slow or broken upstream, a proxy that died holding a key, an
//! oversized response, a client that goes away, and a failing store.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use idemproxy::config::{OnAmbiguous, OnInFlight, OnStoreError};
use idemproxy::core::{now_millis, CompletedRecord, Outcome, Record, StoredResponse, UnknownCause};
use idemproxy::store::{SharedStore, StoreError};
use support::faulty::{Fault, FaultyStore};
use support::keys;
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::raw;
use support::upstream::{expected_body, unused_port_url, TestUpstream, CHUNK};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

const JSON: (&str, &str) = ("content-type", "application/json");
const ARRIVAL: Duration = Duration::from_secs(5);

async fn record(store: &SharedStore, target: &str, key: &str) -> Option<Record> {
    let key = keys::record_key(&keys::json_post(target), key);
    store.get(&key).await.expect("store answers")
}

#[tokio::test]
async fn a_body_over_max_request_bytes_is_413_and_never_executes() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.max_request_bytes = 1024;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2048));

    let reply = client
        .post_json(&proxy.url("/v1/orders"), "big-1", &big)
        .await;
    reply.assert_problem(413, "body-too-large");
    assert_eq!(reply.header("x-should-retry"), Some("false"));
    assert!(record(&proxy.store, "/v1/orders", "big-1").await.is_none());

    // Without a Content-Length (chunked), the limit holds while reading.
    let mut chunked = b"POST /v1/orders HTTP/1.1\r\nhost: proxy.test\r\nconnection: close\r\n\
idempotency-key: big-2\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        .to_vec();
    for _ in 0..4 {
        chunked.extend_from_slice(format!("400\r\n{}\r\n", "y".repeat(0x400)).as_bytes());
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let reply = raw::exchange(proxy.addr, &chunked).await;
    reply.assert_problem(413, "body-too-large");

    // At the limit it is fine.
    let exact = format!(r#"{{"b":"{}"}}"#, "z".repeat(1024 - 8));
    assert_eq!(exact.len(), 1024);
    let reply = client
        .post_json(&proxy.url("/v1/exact"), "exact-1", &exact)
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(upstream.executions("/v1/orders"), 0);
    assert_eq!(upstream.executions("/v1/exact"), 1);
}

#[tokio::test]
async fn an_unreachable_upstream_is_502_and_releases_the_key() {
    let mut c = config(&unused_port_url());
    c.upstream.connect_timeout = Duration::from_millis(500);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    for attempt in 1..=2 {
        let reply = client.post_json(&url, "refused-1", "{}").await;
        reply.assert_problem(502, "upstream-unreachable");
        assert!(!reply.replayed(), "attempt {attempt} is not a replay");
        assert_eq!(reply.header("x-should-retry"), Some("true"));
        assert_eq!(reply.header("stripe-should-retry"), Some("true"));
        assert_eq!(reply.json()["key_status"], "released");
        // Released: the store holds nothing under the key, so the retry
        // (attempt 2) was free to execute, and did try.
        assert!(
            record(&proxy.store, "/v1/orders", "refused-1")
                .await
                .is_none(),
            "attempt {attempt}: the key was released"
        );
    }
}

#[tokio::test]
async fn release_statuses_pass_through_and_release_the_key() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();

    for status in [429u16, 503] {
        let path = format!("/v1/s{status}");
        let target = format!("{path}?status={status}&header=retry-after%3A0");
        let url = proxy.url(&target);
        for n in 1..=2usize {
            let reply = client.post_json(&url, "busy-1", "{}").await;
            assert_eq!(reply.status, status, "{reply:?}");
            assert!(!reply.replayed(), "{status} #{n}");
            // The upstream's own answer, not a problem of the proxy's.
            assert_eq!(reply.header("content-type"), Some("application/json"));
            assert_eq!(reply.header("retry-after"), Some("0"));
            assert_eq!(reply.header("x-upstream-execution"), Some(&*n.to_string()));
            assert!(
                record(&proxy.store, &target, "busy-1").await.is_none(),
                "{status}: the key was released"
            );
        }
        assert_eq!(upstream.executions(&path), 2, "{status} executes again");
    }
}

#[tokio::test]
async fn an_upstream_timeout_is_504_outcome_unknown_and_stored() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.upstream.timeout = Duration::from_millis(300);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let target = "/v1/orders?delay_ms=2000";

    let started = Instant::now();
    let first = client.post_json(&proxy.url(target), "slow-1", "{}").await;
    assert!(started.elapsed() < Duration::from_millis(1500));
    first.assert_problem(504, "outcome-unknown");
    assert!(!first.replayed());
    assert_eq!(first.json()["key_status"], "completed");
    assert_eq!(first.header("x-should-retry"), Some("false"));
    assert_eq!(first.header("stripe-should-retry"), Some("false"));
    assert!(matches!(
        record(&proxy.store, target, "slow-1").await,
        Some(Record::Completed(CompletedRecord {
            outcome: Outcome::Unknown {
                cause: UnknownCause::Timeout
            },
            ..
        }))
    ));

    for _ in 0..2 {
        let retry = client.post_json(&proxy.url(target), "slow-1", "{}").await;
        retry.assert_problem(504, "outcome-unknown");
        assert!(retry.replayed(), "the stored answer: {retry:?}");
        assert!(retry.header("idempotency-original-date").is_some());
        assert_eq!(retry.header("x-should-retry"), Some("false"));
    }
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn an_upstream_reset_is_502_outcome_unknown_and_stored() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let target = "/v1/orders?reset=1";

    let first = client.post_json(&proxy.url(target), "reset-1", "{}").await;
    first.assert_problem(502, "outcome-unknown");
    assert!(!first.replayed());
    assert_eq!(first.json()["key_status"], "completed");
    assert_eq!(first.header("x-should-retry"), Some("false"));
    assert!(matches!(
        record(&proxy.store, target, "reset-1").await,
        Some(Record::Completed(CompletedRecord {
            outcome: Outcome::Unknown {
                cause: UnknownCause::Reset
            },
            ..
        }))
    ));

    let retry = client.post_json(&proxy.url(target), "reset-1", "{}").await;
    retry.assert_problem(502, "outcome-unknown");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn with_on_ambiguous_release_a_timeout_or_reset_releases_the_key() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.upstream.timeout = Duration::from_millis(300);
    c.idempotency.on_ambiguous = OnAmbiguous::Release;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    for (target, path, status) in [
        ("/v1/reset?reset=1", "/v1/reset", 502u16),
        ("/v1/slow?delay_ms=1000", "/v1/slow", 504),
    ] {
        for n in 1..=2 {
            let reply = client.post_json(&proxy.url(target), "amb-1", "{}").await;
            reply.assert_problem(status, "outcome-unknown");
            assert!(!reply.replayed(), "{target} #{n}: executed, not replayed");
            assert_eq!(reply.json()["key_status"], "released");
            assert_eq!(reply.header("x-should-retry"), Some("true"));
            assert!(record(&proxy.store, target, "amb-1").await.is_none());
            assert_eq!(upstream.executions(path), n, "{target}: the retry executes");
        }
    }
}

fn zombie_record(status: u16) -> CompletedRecord {
    let now = now_millis();
    CompletedRecord {
        fingerprint: idemproxy::core::Fingerprint([0; 32]),
        created_at: now,
        completed_at: now,
        expires_at: now + 3_600_000,
        outcome: Outcome::Response(StoredResponse {
            status,
            headers: Vec::new(),
            body: bytes::Bytes::from_static(b"zombie"),
        }),
    }
}

#[tokio::test]
async fn a_stale_pending_key_fails_closed_as_outcome_unknown() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let body = r#"{"amount":5}"#;
    let (record_key, token) =
        keys::plant_stale_claim(&proxy.store, "/v1/orders", "stale-1", body.as_bytes()).await;

    for attempt in 1..=2 {
        let reply = client
            .post_json(&proxy.url("/v1/orders"), "stale-1", body)
            .await;
        reply.assert_problem(502, "outcome-unknown");
        assert!(reply.replayed(), "attempt {attempt}: the settled answer");
        assert_eq!(reply.json()["key_status"], "completed");
        assert_eq!(reply.header("x-should-retry"), Some("false"));
    }
    assert_eq!(upstream.executions("/v1/orders"), 0, "fail closed");
    assert!(matches!(
        proxy.store.get(&record_key).await.expect("store answers"),
        Some(Record::Completed(CompletedRecord {
            outcome: Outcome::Unknown {
                cause: UnknownCause::Abandoned
            },
            ..
        }))
    ));
    // The dead holder, were it to come back, cannot overwrite the answer.
    let late = proxy
        .store
        .complete(&record_key, token, &zombie_record(201))
        .await;
    assert!(matches!(late, Err(StoreError::Fenced)), "{late:?}");
}

#[tokio::test]
async fn with_on_stale_retry_the_request_takes_a_stale_key_over() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.on_stale = idemproxy::config::OnStale::Retry;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let body = r#"{"amount":5}"#;
    let (record_key, token) =
        keys::plant_stale_claim(&proxy.store, "/v1/orders", "stale-2", body.as_bytes()).await;

    let reply = client
        .post_json(&proxy.url("/v1/orders"), "stale-2", body)
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(!reply.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 1);

    // The old holder is fenced off; the new outcome stands.
    let late = proxy
        .store
        .complete(&record_key, token, &zombie_record(500))
        .await;
    assert!(matches!(late, Err(StoreError::Fenced)), "{late:?}");
    let retry = client
        .post_json(&proxy.url("/v1/orders"), "stale-2", body)
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, reply.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn a_response_over_max_response_bytes_is_streamed_but_not_stored() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.max_response_bytes = 64 * 1024;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let n = 300_000;
    let target = format!("/v1/export?body_bytes={n}");

    let first = client.post_json(&proxy.url(&target), "big-1", "{}").await;
    assert_eq!(first.status, 201, "status {}", first.status);
    assert!(!first.replayed());
    assert_eq!(first.body.len(), n);
    assert!(first.body == expected_body(n), "every byte arrived intact");

    let retry = client.post_json(&proxy.url(&target), "big-1", "{}").await;
    retry.assert_problem(502, "response-not-stored");
    assert!(retry.replayed());
    assert_eq!(retry.json()["key_status"], "completed");
    let detail = retry.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        detail.contains("201"),
        "names the original status: {detail}"
    );
    assert_eq!(retry.header("x-should-retry"), Some("false"));
    assert!(matches!(
        record(&proxy.store, &target, "big-1").await,
        Some(Record::Completed(CompletedRecord {
            outcome: Outcome::NotStored { status: 201 },
            ..
        }))
    ));
    assert_eq!(upstream.executions("/v1/export"), 1);

    // Just under the limit it is stored whole.
    let small = format!("/v1/small?body_bytes={}", 64 * 1024);
    let first = client.post_json(&proxy.url(&small), "small-1", "{}").await;
    let retry = client.post_json(&proxy.url(&small), "small-1", "{}").await;
    assert!(retry.replayed());
    assert_eq!(retry.status, 201);
    assert!(retry.body == first.body && retry.body == expected_body(64 * 1024));
    assert_eq!(upstream.executions("/v1/small"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_call_gets_the_stored_result_on_retry() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let target = "/v1/orders?delay_ms=500";
    let body = r#"{"amount":5}"#;

    let mut socket = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect to the proxy");
    let request = raw::request(
        "POST",
        target,
        &[
            b"idempotency-key: gone-1",
            b"content-type: application/json",
        ],
        body.as_bytes(),
    );
    socket.write_all(&request).await.expect("write the request");
    assert!(
        upstream.wait_for_executions("/v1/orders", 1, ARRIVAL).await,
        "the request reached the upstream"
    );
    drop(socket);

    // Retry as a client would: 425 while the upstream still runs, then the
    // stored result.
    let deadline = Instant::now() + Duration::from_secs(5);
    let reply = loop {
        let reply = client.post_json(&proxy.url(target), "gone-1", body).await;
        if reply.status != 425 || Instant::now() > deadline {
            break reply;
        }
        let wait: u64 = reply
            .header("retry-after-ms")
            .and_then(|v| v.parse().ok())
            .expect("retry-after-ms");
        tokio::time::sleep(Duration::from_millis(wait.min(200))).await;
    };
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(reply.replayed(), "{reply:?}");
    assert_eq!(reply.header("x-upstream-execution"), Some("1"));
    assert_eq!(reply.json()["body_len"], body.len());
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_a_chunked_body_sees_it_cut_off_not_ended() {
    // The proxy drops a client that does not read by the upstream deadline
    // (the upstream read, and the outcome, must not wait for it). A chunked
    // body has no length to check against, so its end must not look clean.
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.upstream.timeout = Duration::from_secs(1);
    let proxy = TestProxy::start(c).await;
    // Far more than the sockets and the proxy's buffers hold between them.
    let total = 256 << 20;
    let mut socket = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect to the proxy");
    let request = raw::request(
        "POST",
        &format!("/v1/orders?body_bytes={total}&chunked=1"),
        &[
            b"idempotency-key: stalled-1",
            b"content-type: application/json",
        ],
        b"{}",
    );
    socket.write_all(&request).await.expect("write the request");
    let mut answer = vec![0; 4096];
    let n = socket.read(&mut answer).await.expect("the head arrives");
    answer.truncate(n);
    assert!(
        answer.starts_with(b"HTTP/1.1 201")
            && answer
                .windows(26)
                .any(|w| w.eq_ignore_ascii_case(b"transfer-encoding: chunked")),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    // Stops reading past the upstream deadline, then reads what is left.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    tokio::time::timeout(Duration::from_secs(20), socket.read_to_end(&mut answer))
        .await
        .expect("the proxy closes within 20 s")
        .ok();
    assert!(answer.len() < total, "the body was not all relayed");
    assert!(
        !answer.ends_with(b"\r\n0\r\n\r\n"),
        "a cut-off body ended like a complete one ({} bytes)",
        answer.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_does_not_cost_the_stored_response() {
    // The upstream sends a chunked body under `max_response_bytes` at once;
    // the client reads the head and then nothing until past the upstream
    // deadline. Waiting for that client used up the deadline, and the
    // response, all there in time, was stored as incomplete: every retry
    // got 502 `response-not-stored` for a call that succeeded.
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    // Ample for the upstream to send it all through a debug build on a
    // loaded machine; the client then stalls past it.
    c.upstream.timeout = Duration::from_secs(3);
    c.idempotency.max_response_bytes = 128 << 20;
    let proxy = TestProxy::start(c).await;
    let total = beyond_socket_buffers();
    let target = format!("/v1/orders?body_bytes={total}&chunked=1");
    let request = raw::request(
        "POST",
        &target,
        &[
            b"idempotency-key: slow-reader-1",
            b"content-type: application/json",
        ],
        b"{}",
    );
    let (socket, _head) = slow_reader(proxy.addr, &request).await;
    // Past the upstream deadline.
    tokio::time::sleep(Duration::from_millis(4000)).await;
    drop(socket);

    let client = TestClient::new();
    let reply = client
        .post_json(&proxy.url(&target), "slow-reader-1", "{}")
        .await;
    assert_eq!(reply.status, 201, "{:?}", reply.headers);
    assert!(reply.replayed());
    assert_eq!(reply.body.len(), total);
    assert!(
        reply.body[..] == expected_body(total)[..],
        "the stored body differs"
    );
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

/// A body longer than the sockets between the proxy and a client that stops
/// reading can hold (the proxy's send buffer grows to `tcp_wmem`'s maximum,
/// the client's receive buffer is kept at 4 KiB), so that the rest waits in
/// the proxy: twice that maximum and 4 MiB more, in whole chunks.
fn beyond_socket_buffers() -> usize {
    let wmem_max = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|text| text.split_whitespace().nth(2)?.parse::<usize>().ok())
        .unwrap_or(4 << 20);
    (2 * wmem_max + (4 << 20)).div_ceil(CHUNK) * CHUNK
}

/// Connects with a 4 KiB receive buffer (no autotuning), sends `request`
/// and returns the socket with what the first read got (the head).
async fn slow_reader(
    addr: std::net::SocketAddr,
    request: &[u8],
) -> (tokio::net::TcpStream, Vec<u8>) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut socket = socket.connect(addr).await.expect("connect");
    socket.write_all(request).await.expect("write the request");
    let mut head = vec![0; 1024];
    let n = socket.read(&mut head).await.expect("the head arrives");
    head.truncate(n);
    assert!(
        head.starts_with(b"HTTP/1.1 201"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    (socket, head)
}

/// Frames the client could not take wait in the proxy while it reads the
/// upstream on; once the client reads again they go to it at once, not
/// when the upstream sends its next frame (a stream of events may pause
/// for long between them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_waited_for_a_slow_client_reaches_it_before_the_upstreams_next_frame() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.upstream.timeout = Duration::from_secs(30);
    c.idempotency.max_response_bytes = 128 << 20;
    let proxy = TestProxy::start(c).await;
    let total = beyond_socket_buffers();
    let target = format!("/v1/orders?body_bytes={total}&chunked=1&hold_tail=tail");
    let request = raw::request(
        "POST",
        &target,
        &[
            b"idempotency-key: catch-up-1",
            b"content-type: application/json",
        ],
        b"{}",
    );
    let (mut socket, head) = slow_reader(proxy.addr, &request).await;
    // The sockets and the proxy's channel fill up; the rest waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // All but the last chunk, which the upstream holds back: the head, then
    // each chunk as hyper frames it (`4000\r\n`, 16 KiB, `\r\n`).
    let head_len = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("the whole head in the first read")
        + 4;
    let wanted = head_len + (total / CHUNK - 1) * (CHUNK + 8);
    let mut got = head.len();
    let mut buf = vec![0; 64 * 1024];
    tokio::time::timeout(Duration::from_secs(15), async {
        while got < wanted {
            let n = socket.read(&mut buf).await.expect("read");
            assert!(n > 0, "the body ended early at {got} bytes");
            got += n;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("stuck at {got} of {wanted} bytes until the upstream's next frame"));

    upstream.release("tail");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(15), socket.read_to_end(&mut rest))
        .await
        .expect("the body ends once the tail comes")
        .expect("read the rest");
    assert!(rest.ends_with(b"\r\n0\r\n\r\n"), "a clean end");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

/// A response relayed without being stored (a status in `release_statuses`,
/// or forwarded unprotected under `on_store_error = "pass"`) is bounded as
/// a passthrough's is: its body holds the request's `max_in_flight` slot
/// while it streams and is cut off at `upstream.timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_bodies_that_stall_hold_their_slot_and_are_cut_off() {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    // 8 chunks of 16 KiB, 1 s apart: the whole body takes 7 s.
    let stalling = "body_bytes=131072&stream_delay_ms=1000";
    for (case, target, store_fails, head) in [
        (
            "released",
            format!("/v1/released?status=503&{stalling}"),
            false,
            "HTTP/1.1 503",
        ),
        (
            "passed",
            format!("/v1/passed?{stalling}"),
            true,
            "HTTP/1.1 201",
        ),
    ] {
        let mut c = config(&upstream.url());
        c.upstream.timeout = Duration::from_secs(2);
        c.max_in_flight = 1;
        c.store.timeout = Duration::from_millis(250);
        c.idempotency.on_store_error = OnStoreError::Pass;
        let store = FaultyStore::new();
        if store_fails {
            store.set(Fault::Fail);
        }
        let proxy = TestProxy::start_with_store(c, store.clone()).await;

        let started = Instant::now();
        let mut socket = tokio::net::TcpStream::connect(proxy.addr)
            .await
            .expect("connect to the proxy");
        let request = raw::request(
            "POST",
            &target,
            &[
                b"idempotency-key: stalls-1",
                b"content-type: application/json",
            ],
            b"{}",
        );
        socket.write_all(&request).await.expect("write the request");
        let mut answer = vec![0; 1024];
        let n = socket.read(&mut answer).await.expect("the head arrives");
        answer.truncate(n);
        assert!(
            answer.starts_with(head.as_bytes()),
            "{case}: {}",
            String::from_utf8_lossy(&answer)
        );

        let meanwhile = client
            .post_json(&proxy.url("/v1/meanwhile"), "meanwhile-1", "{}")
            .await;
        meanwhile.assert_problem(503, "overloaded");

        tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut answer))
            .await
            .expect("the proxy ends the body")
            .ok();
        let elapsed = started.elapsed();
        assert!(
            elapsed < Duration::from_millis(5000),
            "{case}: cut off at upstream.timeout, not streamed to its end ({elapsed:?})"
        );
        assert!(answer.len() < 131072, "{case}: the body was all relayed");
        let after = client
            .post_json(&proxy.url("/v1/after"), "after-1", "{}")
            .await;
        assert_eq!(
            after.status, 201,
            "{case}: the slot is free again: {after:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_draining_running_calls_finish_and_no_new_execution_starts() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.drain_timeout = Duration::from_secs(5);
    let proxy = TestProxy::start(c).await;
    let addr = proxy.addr;
    let client = TestClient::new();

    // One call running, and one request whose body is still arriving.
    let running = {
        let (client, url) = (client.clone(), proxy.url("/v1/orders?delay_ms=800"));
        tokio::spawn(async move { client.post_json(&url, "running", "{}").await })
    };
    assert!(upstream.wait_for_executions("/v1/orders", 1, ARRIVAL).await);
    let mut arriving = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the proxy");
    let body = br#"{"amount":5}"#;
    let request = raw::request(
        "POST",
        "/v1/late",
        &[
            b"idempotency-key: late-1",
            b"content-type: application/json",
        ],
        body,
    );
    let (head, rest) = request.split_at(request.len() - 4);
    arriving.write_all(head).await.expect("write the head");
    // Time for the proxy to take the connection (nothing shows it).
    tokio::time::sleep(Duration::from_millis(300)).await;

    let ready = proxy.admin_url("/readyz");
    let drained = tokio::spawn(proxy.shutdown());
    // Draining has begun once readiness says so.
    let deadline = Instant::now() + ARRIVAL;
    loop {
        let reply = client.send(Method::GET, &ready, &[], "").await;
        if reply.status == 503 && reply.body.starts_with(b"draining") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never reported draining: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    arriving.write_all(rest).await.expect("write the rest");
    let mut answer = Vec::new();
    tokio::time::timeout(ARRIVAL, arriving.read_to_end(&mut answer))
        .await
        .expect("answered and closed")
        .expect("read");
    let late = raw::parse(&answer);
    late.assert_problem(503, "shutting-down");
    assert_eq!(late.header("retry-after"), Some("1"));
    assert_eq!(late.header("connection"), Some("close"));
    assert_eq!(upstream.executions("/v1/late"), 0, "nothing started");

    let running = running.await.expect("running task");
    assert_eq!(running.status, 201, "{running:?}");
    tokio::time::timeout(Duration::from_secs(6), drained)
        .await
        .expect("drained within drain_timeout")
        .expect("shutdown task");
}

async fn proxy_on_faulty_store(
    upstream: &TestUpstream,
    on_store_error: OnStoreError,
) -> (TestProxy, Arc<FaultyStore>) {
    let mut c = config(&upstream.url());
    c.store.timeout = Duration::from_millis(250);
    c.idempotency.on_store_error = on_store_error;
    let store = FaultyStore::new();
    let proxy = TestProxy::start_with_store(c, store.clone()).await;
    (proxy, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waiting_on_a_running_request_is_not_passed_when_the_store_fails() {
    // `on_store_error = "pass"` forwards a request the store cannot vouch
    // for. A duplicate held by `on_in_flight = "wait"` was told by the store
    // that the same request is running: forwarding it when a later look at
    // the store fails would run it twice.
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.store.timeout = Duration::from_millis(250);
    c.idempotency.on_store_error = OnStoreError::Pass;
    c.idempotency.on_in_flight = OnInFlight::Wait;
    c.idempotency.wait_timeout = Duration::from_secs(5);
    let store = FaultyStore::new();
    let proxy = TestProxy::start_with_store(c, store.clone()).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=2500");

    let first = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.post_json(&url, "k", "{}").await })
    };
    assert!(upstream.wait_for_executions("/v1/orders", 1, ARRIVAL).await);
    let calls = store.calls();
    let duplicate = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.post_json(&url, "k", "{}").await })
    };
    // The duplicate's first look (past the gate, so answered by the store)
    // finds the first request running; then the store goes down while it
    // waits.
    let deadline = Instant::now() + ARRIVAL;
    while store.calls() == calls {
        assert!(
            Instant::now() < deadline,
            "the duplicate never asked the store"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    store.set(Fault::Fail);
    let duplicate = duplicate.await.expect("duplicate task");
    store.set(Fault::None);
    duplicate.assert_problem(503, "store-unavailable");
    let first = first.await.expect("first task");
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

/// Polls the record of `key` in the store behind the faults until `done`
/// says it is settled, for up to `within`.
async fn settled_within(
    store: &FaultyStore,
    target: &str,
    key: &str,
    within: Duration,
    done: impl Fn(Option<&Record>) -> bool,
) -> bool {
    let key = keys::record_key(&keys::json_post(target), key);
    let until = Instant::now() + within;
    loop {
        let record = idemproxy::store::Store::get(store.inner(), &key)
            .await
            .expect("memory store answers");
        if done(record.as_ref()) {
            return true;
        }
        if Instant::now() > until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// POSTs `{}` under key `k` to `url` (a path of `/v1/orders`), makes the
/// store fail once the upstream has the request, and returns the answer:
/// the store breaks between the upstream's answer and the completion.
async fn answered_while_the_store_fails(
    client: &TestClient,
    upstream: &TestUpstream,
    store: &FaultyStore,
    url: &str,
) -> Reply {
    let first = {
        let (client, url) = (client.clone(), url.to_owned());
        tokio::spawn(async move { client.post_json(&url, "k", "{}").await })
    };
    assert!(upstream.wait_for_executions("/v1/orders", 1, ARRIVAL).await);
    store.set(Fault::Fail);
    first.await.expect("first task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_store_refused_for_a_moment_is_stored_once_it_is_back() {
    // A store blip (a Redis failover) between the upstream's answer and
    // the completion: the client gets its answer after a few quick tries,
    // and the outcome is stored when the store is back, well within the
    // lease (10 s here), not left pending to settle as outcome-unknown.
    let upstream = TestUpstream::start().await;
    let (proxy, store) = proxy_on_faulty_store(&upstream, OnStoreError::Reject).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=1000");

    let first = answered_while_the_store_fails(&client, &upstream, &store, &url).await;
    assert_eq!(first.status, 201, "the client has its answer: {first:?}");
    assert!(
        matches!(
            idemproxy::store::Store::get(
                store.inner(),
                &keys::record_key(&keys::json_post("/v1/orders"), "k")
            )
            .await,
            Ok(Some(Record::Pending(_)))
        ),
        "not stored while the store fails"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    store.set(Fault::None);
    assert!(
        settled_within(&store, "/v1/orders", "k", Duration::from_secs(4), |r| {
            matches!(r, Some(Record::Completed(_)))
        })
        .await,
        "stored once the store was back"
    );
    let retry = client.post_json(&url, "k", "{}").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_in_the_background_holds_its_slot_and_gives_up_with_the_lease() {
    // The store keeps failing after the upstream answered: the key is
    // settled in the background, holding the request's `max_in_flight`
    // slot, until the claim's lease ends (1 s + 1.4 s here). Then the slot
    // is free, and the key is left to `on_stale` (fail closed).
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.max_in_flight = 1;
    c.upstream.timeout = Duration::from_secs(1);
    // The least store.timeout (250 ms) allows: see `lease_margin`.
    c.idempotency.lease_margin = Duration::from_millis(1400);
    let store = FaultyStore::new();
    let proxy = TestProxy::start_with_store(c, store.clone()).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=300");

    let asked = Instant::now();
    let first = answered_while_the_store_fails(&client, &upstream, &store, &url).await;
    assert_eq!(first.status, 201, "{first:?}");
    // The only slot is still taken: even an uncovered GET is shed.
    let get = client
        .send(Method::GET, &proxy.url("/v1/ping"), &[], "")
        .await;
    get.assert_problem(503, "overloaded");
    let settling = || async {
        let metrics = client
            .send(Method::GET, &proxy.admin_url("/metrics"), &[], "")
            .await;
        let text = String::from_utf8_lossy(&metrics.body).into_owned();
        text.lines()
            .find_map(|l| l.strip_prefix("idemproxy_settling_in_background "))
            .map(str::to_owned)
    };
    assert_eq!(settling().await.as_deref(), Some("1"));
    // Freed once the lease has ended.
    let admitted = loop {
        let get = client
            .send(Method::GET, &proxy.url("/v1/ping"), &[], "")
            .await;
        if get.status != 503 || asked.elapsed() > Duration::from_secs(6) {
            break get;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(admitted.status, 201, "{admitted:?}");
    assert_eq!(settling().await.as_deref(), Some("0"));
    assert!(
        asked.elapsed() >= Duration::from_millis(2400),
        "held until the lease ended: {:?}",
        asked.elapsed()
    );
    // Given up: the claim is still there, and fails closed.
    store.set(Fault::None);
    let retry = client.post_json(&url, "k", "{}").await;
    retry.assert_problem(502, "outcome-unknown");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_the_store_refused_for_a_moment_happens_once_it_is_back() {
    // A 503 from the upstream releases the key (`release_statuses`), so
    // that a retry executes. A store blip at that moment must not leave the
    // key held until its lease runs out.
    let upstream = TestUpstream::start().await;
    let (proxy, store) = proxy_on_faulty_store(&upstream, OnStoreError::Reject).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=1000&status=503");

    let first = answered_while_the_store_fails(&client, &upstream, &store, &url).await;
    assert_eq!(first.status, 503, "{first:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    store.set(Fault::None);
    assert!(
        settled_within(&store, "/v1/orders", "k", Duration::from_secs(4), |r| r
            .is_none())
        .await,
        "released once the store was back"
    );
    let retry = client.post_json(&proxy.url("/v1/orders"), "k", "{}").await;
    assert_eq!(retry.status, 201, "the retry executes: {retry:?}");
    assert!(!retry.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 2);
}

#[tokio::test]
async fn an_unavailable_store_is_503_and_nothing_executes() {
    let upstream = TestUpstream::start().await;
    let (proxy, store) = proxy_on_faulty_store(&upstream, OnStoreError::Reject).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    for (fault, within) in [
        // Slower than store.timeout (250 ms): answered at the timeout, long
        // before the hang ends (30 s).
        (Fault::Hang, Duration::from_secs(3)),
        // Refusing outright: answered at once.
        (Fault::Fail, Duration::from_secs(2)),
    ] {
        store.set(fault);
        let started = Instant::now();
        let reply = client.post_json(&url, "k", "{}").await;
        let took = started.elapsed();
        reply.assert_problem(503, "store-unavailable");
        let secs: u64 = reply
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("Retry-After: {reply:?}"));
        assert!(secs >= 1);
        assert_eq!(reply.header("x-should-retry"), Some("true"));
        assert!(took < within, "{fault:?}: answered after {took:?}");
        if fault == Fault::Hang {
            assert!(took >= Duration::from_millis(250), "{took:?}");
        }
    }
    assert_eq!(upstream.executions("/v1/orders"), 0);

    // The store recovers: normal service, no restart.
    store.set(Fault::None);
    let first = client.post_json(&url, "k", "{}").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    let retry = client.post_json(&url, "k", "{}").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn with_on_store_error_pass_requests_are_forwarded_unprotected() {
    let upstream = TestUpstream::start().await;
    let (proxy, store) = proxy_on_faulty_store(&upstream, OnStoreError::Pass).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    store.set(Fault::Hang);
    let reply = client.post_json(&url, "k", "{}").await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(!reply.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 1);
    store.set(Fault::Fail);
    let reply = client.post_json(&url, "k", "{}").await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(!reply.replayed(), "no protection while the store is down");
    assert_eq!(upstream.executions("/v1/orders"), 2);
    // Nothing was recorded while the store was down.
    let key = keys::record_key(&keys::json_post("/v1/orders"), "k");
    let stored = idemproxy::store::Store::get(store.inner(), &key)
        .await
        .expect("memory store answers");
    assert!(stored.is_none(), "{stored:?}");

    // Recovered: protected again.
    store.set(Fault::None);
    let first = client.post_json(&url, "k", "{}").await;
    assert!(!first.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 3);
    let retry = client.post_json(&url, "k", "{}").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("/v1/orders"), 3);

    // Uncovered requests never touch the store (`pass` would answer them
    // 201 either way: the store's call count tells).
    store.set(Fault::Fail);
    let calls = store.calls();
    let get = client
        .send(Method::GET, &proxy.url("/v1/orders"), &[JSON], "")
        .await;
    assert_eq!(get.status, 201);
    assert_eq!(store.calls(), calls, "the GET asked the store");
}
