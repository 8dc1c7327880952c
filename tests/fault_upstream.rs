//! Fault injection: an upstream that times out, resets the connection after
//! receiving the request, or breaks off its response body, through the
//! real `idemproxy` binary on a private Redis. The outcome is ambiguous, so
//! it is stored fail-closed (`outcome-unknown`, or `response-not-stored`
//! for a broken body) and replayed, by this process and by another replica,
//! and the upstream executes each request once.

use crate::support;

use std::time::Duration;

use support::binary::ProxyProcess;
use support::fault::{raw_exchange, raw_post, Executions};
use support::proxy::{redis_config, TestClient};
use support::redis_server::{self, RedisServer};
use support::upstream::TestUpstream;
use tokio::time::Instant;

const BODY: &str = r#"{"amount":1000,"currency":"eur"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_timeouts_resets_and_broken_bodies_are_stored_and_replayed() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let mut c = redis_config(
        &upstream.url(),
        &redis.url(),
        &redis_server::unique_prefix("upstream-faults"),
    );
    c.upstream.timeout = Duration::from_secs(1);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    let a = ProxyProcess::start(c.clone()).await;
    let b = ProxyProcess::start(c).await;
    let client = TestClient::new();

    // Timeout: the upstream has the request and answers after the proxy
    // gave up.
    let timeout_path = "/v1/timeout?delay_ms=2500";
    let started = Instant::now();
    let timed_out = client.post_json(&a.url(timeout_path), "t-1", BODY).await;
    let took = started.elapsed();
    timed_out.assert_problem(504, "outcome-unknown");
    assert!(!timed_out.replayed(), "{timed_out:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(2),
        "the timeout answer took {took:?}"
    );

    // Reset: the upstream reads the request, then breaks the connection.
    let reset_path = "/v1/reset?reset=1";
    let reset = client.post_json(&a.url(reset_path), "r-1", BODY).await;
    reset.assert_problem(502, "outcome-unknown");

    // A response body that breaks off: the client sees the head and an
    // aborted body (never a complete-looking one); the retry is told the
    // response was not stored.
    let abort_path = "/v1/abort?abort_body=1";
    let aborted = raw_exchange(
        a.addr,
        &raw_post(abort_path, "x-1", BODY),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(aborted.status(), Some(201), "{}", aborted.first_line());
    let head_end = aborted
        .bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let received = aborted.bytes.len() - head_end - 4;
    assert!(
        received < support::upstream::DEFAULT_ABORT_BODY_BYTES,
        "only part of the body arrived ({received} bytes)"
    );

    // The upstream finished even the delayed request by now.
    tokio::time::sleep_until(started + Duration::from_millis(2700)).await;

    // Every retry, on this process or on the other replica, replays the
    // stored fail-closed outcome.
    let mut retries = Vec::new();
    for proxy in [&a, &b, &b] {
        for (path, key) in [
            (timeout_path, "t-1"),
            (reset_path, "r-1"),
            (abort_path, "x-1"),
        ] {
            let reply = client.post_json(&proxy.url(path), key, BODY).await;
            retries.push((path, reply));
        }
    }
    let executions = Executions::count(&upstream, [timeout_path, reset_path, abort_path]);
    println!(
        "upstream-faults: operations=3 duplicates={} executions={} \
         timeout_answer_after={took:?} aborted_body_bytes={received}",
        retries.len(),
        executions.total
    );
    executions.assert_at_most_once();
    for (path, reply) in &retries {
        assert!(reply.replayed(), "{path}: {reply:?}");
        if *path == timeout_path {
            reply.assert_problem(504, "outcome-unknown");
        } else if *path == reset_path {
            reply.assert_problem(502, "outcome-unknown");
        } else {
            reply.assert_problem(502, "response-not-stored");
            assert!(
                reply.json()["detail"]
                    .as_str()
                    .unwrap_or("")
                    .contains("201"),
                "names the original status: {reply:?}"
            );
        }
    }
    assert_eq!(executions.total, 3, "each request executed exactly once");
    assert_eq!(upstream.total(), 3);
}
