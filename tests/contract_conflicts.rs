//! DESIGN.md §1, the conflict rows: a key reused for a different request
//! (409, `ietf` 422) and the same request still in flight (425, `ietf` 409,
//! or held with `on_in_flight = "wait"`).

use crate::support;

use std::time::Duration;

use idemproxy::config::{OnInFlight, Profile};
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::upstream::TestUpstream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

const ARRIVAL: Duration = Duration::from_secs(5);

fn assert_key_reused(reply: &Reply, status: u16, key_status: &str) {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(reply.problem(), "key-reused");
    assert_eq!(reply.header("x-should-retry"), Some("false"));
    assert_eq!(reply.header("stripe-should-retry"), Some("false"));
    assert_eq!(reply.json()["key_status"], key_status, "{reply:?}");
    assert!(!reply.replayed());
}

fn assert_in_flight(reply: &Reply, status: u16) {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(reply.problem(), "in-flight");
    let secs: u64 = reply
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After in integer seconds: {reply:?}"));
    assert!(secs >= 1, "{reply:?}");
    let ms: u64 = reply
        .header("retry-after-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("retry-after-ms in integer milliseconds: {reply:?}"));
    assert!(ms > 0 && ms <= secs * 1000, "{reply:?}");
    assert_eq!(reply.header("x-should-retry"), Some("true"));
    assert_eq!(reply.header("stripe-should-retry"), Some("true"));
    assert_eq!(reply.json()["key_status"], "pending", "{reply:?}");
    assert!(!reply.replayed());
}

/// Sends the first request in the background and returns once the upstream
/// has it (so the key is known to be pending).
async fn first_in_flight(
    client: &TestClient,
    upstream: &TestUpstream,
    url: &str,
    key: &'static str,
    body: &'static str,
) -> JoinHandle<Reply> {
    let path = url
        .split_once("://")
        .and_then(|(_, rest)| rest.find('/').map(|i| rest[i..].to_string()))
        .expect("url has a path");
    let task = {
        let client = client.clone();
        let url = url.to_string();
        tokio::spawn(async move { client.post_json(&url, key, body).await })
    };
    assert!(
        upstream.wait_for_executions(&path, 1, ARRIVAL).await,
        "the first request reached the upstream"
    );
    task
}

#[tokio::test]
async fn a_reused_key_with_a_different_body_is_409_once_completed() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    let first = client.post_json(&url, "k", r#"{"amount":5}"#).await;
    assert_eq!(first.status, 201);
    for _ in 0..2 {
        let reused = client.post_json(&url, "k", r#"{"amount":6}"#).await;
        assert_key_reused(&reused, 409, "completed");
    }
    // The original is untouched by the refusals.
    let replay = client.post_json(&url, "k", r#"{"amount":5}"#).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

/// Two amounts no double tells apart (23 digits, past 64 bits) are still
/// two requests: the second must not get the first one's answer.
#[tokio::test]
async fn a_reused_key_with_a_number_no_double_holds_is_409() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");
    let original = r#"{"amount":12345678901234567890123}"#;

    let first = client.post_json(&url, "k", original).await;
    assert_eq!(first.status, 201);
    let reused = client
        .post_json(&url, "k", r#"{"amount":12345678901234567890124}"#)
        .await;
    assert_key_reused(&reused, 409, "completed");
    let replay = client.post_json(&url, "k", original).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_with_a_different_body_is_409_while_pending() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?hold=first");

    let first = first_in_flight(&client, &upstream, &url, "k", r#"{"amount":5}"#).await;
    let reused = client.post_json(&url, "k", r#"{"amount":6}"#).await;
    assert_key_reused(&reused, 409, "pending");

    upstream.release("first");
    let first = first.await.expect("first request task");
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    let reused = client.post_json(&url, "k", r#"{"amount":6}"#).await;
    assert_key_reused(&reused, 409, "completed");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_ietf_profile_a_reused_key_is_422() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.profile = Profile::Ietf;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?hold=first");

    let first = first_in_flight(&client, &upstream, &url, "k", r#"{"amount":5}"#).await;
    let reused = client.post_json(&url, "k", r#"{"amount":6}"#).await;
    assert_key_reused(&reused, 422, "pending");
    upstream.release("first");
    assert_eq!(first.await.expect("first request task").status, 201);
    let reused = client.post_json(&url, "k", r#"{"amount":6}"#).await;
    assert_key_reused(&reused, 422, "completed");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_in_flight_is_425_with_retry_hints() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?hold=first");

    let first = first_in_flight(&client, &upstream, &url, "k", "{}").await;
    let started = Instant::now();
    let duplicate = client.post_json(&url, "k", "{}").await;
    // The first is held at the upstream until released: a duplicate that
    // waited for it would wait out `wait_timeout` (10 s) first.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered at once, not held: {:?}",
        started.elapsed()
    );
    assert_in_flight(&duplicate, 425);
    assert!(!first.is_finished());

    upstream.release("first");
    let first = first.await.expect("first request task");
    assert_eq!(first.status, 201);
    let after = client.post_json(&url, "k", "{}").await;
    assert!(after.replayed(), "once done, the retry replays: {after:?}");
    assert_eq!(after.body, first.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_ietf_profile_the_same_request_in_flight_is_409() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.profile = Profile::Ietf;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?hold=first");

    let first = first_in_flight(&client, &upstream, &url, "k", "{}").await;
    let duplicate = client.post_json(&url, "k", "{}").await;
    assert_in_flight(&duplicate, 409);
    upstream.release("first");
    assert_eq!(first.await.expect("first request task").status, 201);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_in_flight_wait_the_duplicate_is_held_and_gets_the_replay() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.on_in_flight = OnInFlight::Wait;
    c.idempotency.wait_timeout = Duration::from_secs(5);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?hold=first");

    let first = first_in_flight(&client, &upstream, &url, "k", "{}").await;
    let duplicate = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.post_json(&url, "k", "{}").await })
    };
    // Held while the first is: no answer before the upstream lets it go.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !duplicate.is_finished(),
        "answered while the first was held"
    );
    upstream.release("first");
    let duplicate = duplicate.await.expect("duplicate task");
    assert_eq!(duplicate.status, 201, "{duplicate:?}");
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(duplicate.header("x-upstream-execution"), Some("1"));
    let first = first.await.expect("first request task");
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_in_flight_wait_a_duplicate_held_past_wait_timeout_gets_425() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.on_in_flight = OnInFlight::Wait;
    let wait = Duration::from_millis(300);
    c.idempotency.wait_timeout = wait;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?hold=first");

    let first = first_in_flight(&client, &upstream, &url, "k", "{}").await;
    let started = Instant::now();
    let duplicate = client.post_json(&url, "k", "{}").await;
    let held = started.elapsed();
    assert_in_flight(&duplicate, 425);
    // The first is held until released (or 30 s): an answer within a few
    // seconds came from `wait_timeout`.
    assert!(
        held >= wait && held < wait + Duration::from_secs(3),
        "held for about wait_timeout ({wait:?}), got {held:?}"
    );
    assert!(!first.is_finished());
    upstream.release("first");
    assert_eq!(first.await.expect("first request task").status, 201);
    assert_eq!(upstream.executions("/v1/orders"), 1);
}
