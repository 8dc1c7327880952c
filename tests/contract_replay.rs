//! DESIGN.md §1, the happy rows: the first request executes and streams, a
//! retry of the same request replays it; what "the same request" (the
//! fingerprint) and "the same caller" (the scope) mean; the record's TTL.

use crate::support;

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::upstream::{TestUpstream, CHUNK};
use tokio::time::Instant;

const JSON: (&str, &str) = ("content-type", "application/json");

/// Headers that describe the message framing or the moment, not the stored
/// response: hyper sets them per message.
// `x-request-id` belongs to each exchange: the retry carries its own.
const PER_MESSAGE: [&str; 4] = [
    "date",
    "transfer-encoding",
    "content-length",
    "x-request-id",
];

/// The replay carries every header of the original (framing aside) with the
/// same values in the same order.
fn assert_same_headers(original: &Reply, replay: &Reply) {
    for name in original.headers.keys() {
        if PER_MESSAGE.contains(&name.as_str()) {
            continue;
        }
        let a: Vec<_> = original.headers.get_all(name).iter().collect();
        let b: Vec<_> = replay.headers.get_all(name).iter().collect();
        assert_eq!(a, b, "header {name}");
    }
}

fn original_date(reply: &Reply) -> SystemTime {
    let text = reply
        .header("idempotency-original-date")
        .unwrap_or_else(|| panic!("Idempotency-Original-Date: {reply:?}"));
    // IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`.
    assert!(text.ends_with(" GMT") && text.len() == 29, "{text:?}");
    httpdate::parse_http_date(text).expect("Idempotency-Original-Date is an HTTP date")
}

#[tokio::test]
async fn first_request_executes_and_the_same_request_replays_it_whole() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?header=x-custom%3Ahello&header=cache-control%3Ano-store");
    let body = r#"{"amount":5}"#;
    let before = SystemTime::now() - Duration::from_secs(1);

    let first = client.post_json(&url, "order-1", body).await;
    let first_done = SystemTime::now();
    assert_eq!(first.status, 201, "{first:?}");
    assert!(first.header("idempotent-replayed").is_none(), "{first:?}");
    assert!(first.header("idempotency-original-date").is_none());
    assert_eq!(first.header("x-upstream-execution"), Some("1"));
    assert_eq!(first.header("x-custom"), Some("hello"));
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(first.json()["body_len"], body.len());

    let mut dates = Vec::new();
    for _ in 0..2 {
        let replay = client.post_json(&url, "order-1", body).await;
        assert_eq!(replay.status, first.status);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_same_headers(&first, &replay);
        assert_eq!(replay.header("x-upstream-execution"), Some("1"));
        assert_eq!(replay.header("x-custom"), Some("hello"));
        assert_eq!(replay.header("cache-control"), Some("no-store"));
        assert_eq!(replay.header("content-type"), Some("application/json"));
        assert_eq!(replay.body, first.body, "body byte for byte");
        // The date of the first completion (HTTP dates have whole seconds).
        let date = original_date(&replay);
        assert!(date >= before && date <= first_done, "{date:?}");
        dates.push(
            replay
                .header("idempotency-original-date")
                .map(str::to_owned),
        );
    }
    assert_eq!(dates[0], dates[1], "every replay names the same completion");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn an_upstream_error_status_outside_release_statuses_is_stored_and_replayed() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();

    for status in [400u16, 422, 500] {
        let url = proxy.url(&format!("/v1/s{status}?status={status}"));
        let key = format!("k-{status}");
        let first = client.post_json(&url, &key, "{}").await;
        assert_eq!(first.status, status, "{first:?}");
        assert!(!first.replayed());
        let replay = client.post_json(&url, &key, "{}").await;
        assert_eq!(replay.status, status, "{replay:?}");
        assert!(
            replay.replayed(),
            "{status} is a settled outcome: {replay:?}"
        );
        assert_eq!(replay.body, first.body);
        assert_eq!(upstream.executions(&format!("/v1/s{status}")), 1);
    }
}

#[tokio::test]
async fn the_first_response_is_streamed_as_it_comes() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    // Three chunks, 500 ms apart: the whole body takes at least a second.
    let total = 3 * CHUNK;
    let req = Request::builder()
        .method(Method::POST)
        .uri(proxy.url(&format!(
            "/v1/stream?body_bytes={total}&stream_delay_ms=500"
        )))
        .header("idempotency-key", "stream-1")
        .body(Full::new(Bytes::new()))
        .expect("request builds");
    let sent = Instant::now();
    let response = client.request(req).await.expect("response head");
    assert_eq!(response.status(), 201);
    let mut body = response.into_body();
    let first = loop {
        let frame = body
            .frame()
            .await
            .expect("a first frame")
            .expect("frame reads");
        if let Some(data) = frame.data_ref() {
            break data.len();
        }
    };
    let first_at = sent.elapsed();
    let rest = body.collect().await.expect("rest of the body").to_bytes();
    let done_at = sent.elapsed();
    assert_eq!(first + rest.len(), total);
    assert!(done_at >= Duration::from_millis(1000), "{done_at:?}");
    assert!(
        first_at + Duration::from_millis(600) <= done_at,
        "the first bytes arrived at {first_at:?}, not long before the end at {done_at:?}: \
         the response was buffered, not streamed"
    );
    assert_eq!(upstream.executions("/v1/stream"), 1);
}

#[tokio::test]
async fn json_bodies_are_fingerprinted_canonically() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    let first = client
        .post_json(
            &url,
            "k",
            r#"{"amount":5,"items":[1,2],"to":{"a":1,"b":2}}"#,
        )
        .await;
    assert_eq!(first.status, 201);
    let reordered = client
        .post_json(
            &url,
            "k",
            "{ \"to\": {\"b\": 2, \"a\": 1},\n  \"items\": [ 1, 2 ],\n  \"amount\": 5.0 }",
        )
        .await;
    assert_eq!(reordered.status, 201, "{reordered:?}");
    assert!(
        reordered.replayed(),
        "key order and whitespace do not matter"
    );
    assert_eq!(upstream.executions("/v1/orders"), 1);

    // But content does: array order, a value.
    for different in [
        r#"{"amount":5,"items":[2,1],"to":{"a":1,"b":2}}"#,
        r#"{"amount":6,"items":[1,2],"to":{"a":1,"b":2}}"#,
    ] {
        let reply = client.post_json(&url, "k", different).await;
        assert_eq!(reply.status, 409, "{different}: {reply:?}");
        assert_eq!(reply.problem(), "key-reused");
    }
    // A JSON body under a non-JSON content type is hashed raw.
    let url2 = proxy.url("/v1/raw");
    let a = client
        .send(
            Method::POST,
            &url2,
            &[("idempotency-key", "k-raw"), ("content-type", "text/plain")],
            r#"{"a":1,"b":2}"#,
        )
        .await;
    assert_eq!(a.status, 201);
    let b = client
        .send(
            Method::POST,
            &url2,
            &[("idempotency-key", "k-raw"), ("content-type", "text/plain")],
            r#"{"b":2,"a":1}"#,
        )
        .await;
    assert_eq!(b.status, 409, "{b:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
    assert_eq!(upstream.executions("/v1/raw"), 1);
}

#[tokio::test]
async fn fingerprint_ignore_drops_the_named_fields() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.fingerprint_ignore = vec!["/meta/sent_at".into()];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    let first = client
        .post_json(&url, "k", r#"{"amount":5,"meta":{"sent_at":"10:00:00"}}"#)
        .await;
    assert_eq!(first.status, 201);
    let later = client
        .post_json(&url, "k", r#"{"amount":5,"meta":{"sent_at":"10:00:07"}}"#)
        .await;
    assert!(later.replayed(), "an ignored field changed: {later:?}");
    let without = client
        .post_json(&url, "k", r#"{"amount":5,"meta":{}}"#)
        .await;
    assert!(without.replayed(), "an ignored field absent: {without:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);

    let changed = client
        .post_json(&url, "k", r#"{"amount":6,"meta":{"sent_at":"10:00:00"}}"#)
        .await;
    assert_eq!(changed.status, 409, "{changed:?}");
    assert_eq!(changed.problem(), "key-reused");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn method_path_query_and_content_type_are_part_of_the_fingerprint() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();

    let first = client
        .post_json(&proxy.url("/v1/orders?x=1"), "k", "{}")
        .await;
    assert_eq!(first.status, 201);
    let variants: [(Method, &str, &str); 4] = [
        (Method::PATCH, "/v1/orders?x=1", "application/json"),
        (Method::POST, "/v1/orders?x=2", "application/json"),
        (Method::POST, "/v1/other?x=1", "application/json"),
        (
            Method::POST,
            "/v1/orders?x=1",
            "application/merge-patch+json",
        ),
    ];
    for (method, target, ctype) in variants {
        let reply = client
            .send(
                method.clone(),
                &proxy.url(target),
                &[("idempotency-key", "k"), ("content-type", ctype)],
                "{}",
            )
            .await;
        assert_eq!(reply.status, 409, "{method} {target} {ctype}: {reply:?}");
        assert_eq!(reply.problem(), "key-reused");
    }
    assert_eq!(upstream.total(), 1);
}

/// A route's own `scope` and `fingerprint_headers`, through the proxy:
/// tenants named by another header have separate keys, and a request that
/// differs only in a fingerprinted header is another request (409), while
/// an unlisted header changes nothing.
#[tokio::test]
async fn a_routes_scope_and_fingerprint_headers_apply() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.routes = vec![idemproxy::config::RouteConfig {
        name: "transfers".into(),
        path: "/v1/transfers".into(),
        idempotency: idemproxy::config::IdempotencySettings {
            scope: vec!["header:x-tenant-id".into()],
            fingerprint_headers: vec!["x-account".into()],
            ..c.idempotency.clone()
        },
        ..Default::default()
    }];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/transfers");
    let post = |tenant: &'static str, account: &'static str, other: &'static str| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let headers = [
                ("idempotency-key", "t-1"),
                JSON,
                ("x-tenant-id", tenant),
                ("x-account", account),
                ("x-trace", other),
                // The default scope's header: not this route's scope.
                ("authorization", other),
            ];
            client.send(Method::POST, &url, &headers, "{}").await
        }
    };

    let first = post("acme", "acc-1", "a").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    // Same tenant, same fingerprinted header; other unlisted headers (and
    // another Authorization, which this route does not scope by): a retry.
    let retry = post("acme", "acc-1", "b").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.header("x-upstream-execution"), Some("1"));
    // Same tenant, another account: the same key for another request.
    let other_account = post("acme", "acc-2", "a").await;
    assert_eq!(other_account.status, 409, "{other_account:?}");
    assert_eq!(other_account.problem(), "key-reused");
    // Another tenant: a key of its own.
    let other_tenant = post("globex", "acc-2", "a").await;
    assert_eq!(other_tenant.status, 201, "{other_tenant:?}");
    assert!(!other_tenant.replayed());
    assert_eq!(upstream.executions("/v1/transfers"), 2);
}

#[tokio::test]
async fn keys_are_scoped_by_the_authorization_header() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");
    let post = |auth: Option<&'static str>| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let mut headers = vec![("idempotency-key", "shared-key"), JSON];
            if let Some(auth) = auth {
                headers.push(("authorization", auth));
            }
            client.send(Method::POST, &url, &headers, "{}").await
        }
    };

    let alice = post(Some("Bearer alice")).await;
    assert_eq!(alice.status, 201);
    assert!(!alice.replayed());
    let bob = post(Some("Bearer bob")).await;
    assert_eq!(bob.status, 201);
    assert!(!bob.replayed(), "another caller's key is a separate key");
    let anonymous = post(None).await;
    assert!(
        !anonymous.replayed(),
        "no credentials is a scope of its own"
    );
    assert_eq!(upstream.executions("/v1/orders"), 3);

    // Each caller replays its own response, never another's.
    let alice_again = post(Some("Bearer alice")).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.header("x-upstream-execution"), Some("1"));
    let bob_again = post(Some("Bearer bob")).await;
    assert!(bob_again.replayed());
    assert_eq!(bob_again.header("x-upstream-execution"), Some("2"));
    let anonymous_again = post(None).await;
    assert!(anonymous_again.replayed());
    assert_eq!(anonymous_again.header("x-upstream-execution"), Some("3"));
    assert_eq!(upstream.executions("/v1/orders"), 3);

    // The authorization header itself is forwarded to the upstream.
    let headers = upstream.last_headers("/v1/orders").expect("headers");
    assert!(headers.get("authorization").is_none());
    let _ = post(Some("Bearer carol")).await;
    let headers = upstream.last_headers("/v1/orders").expect("headers");
    assert_eq!(headers["authorization"], "Bearer carol");
}

#[tokio::test]
async fn a_completed_key_expires_after_its_ttl_and_then_executes_again() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    // Long enough that the replay below always falls within it, even on a
    // loaded machine.
    let ttl = Duration::from_secs(2);
    c.idempotency.ttl = ttl;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    let first = client.post_json(&url, "k", "{}").await;
    assert_eq!(first.status, 201);
    let completed = Instant::now();
    let replay = client.post_json(&url, "k", "{}").await;
    assert!(
        replay.replayed(),
        "within the ttl the key replays: {replay:?}"
    );
    tokio::time::sleep_until(completed + ttl + Duration::from_millis(100)).await;
    let after = client.post_json(&url, "k", "{}").await;
    assert_eq!(after.status, 201, "{after:?}");
    assert!(
        !after.replayed(),
        "past the ttl the key is forgotten: {after:?}"
    );
    assert_eq!(after.header("x-upstream-execution"), Some("2"));
    assert_eq!(upstream.executions("/v1/orders"), 2);
}

/// A stored response is replayed to retries that may accept another
/// content coding than the first request did, so the first is sent to the
/// upstream asking for none; a request that is not covered keeps its own.
#[tokio::test]
async fn an_executed_request_asks_the_upstream_for_no_content_coding() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let gzip = ("accept-encoding", "gzip, br");
    let reply = client
        .send(
            Method::POST,
            &proxy.url("/v1/coded"),
            &[("idempotency-key", "coded-1"), JSON, gzip],
            "{}",
        )
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let sent = upstream.last_headers("/v1/coded").expect("forwarded");
    assert_eq!(sent["accept-encoding"], "identity");

    let keyless = client
        .send(Method::POST, &proxy.url("/v1/plain"), &[JSON, gzip], "{}")
        .await;
    assert_eq!(keyless.status, 201, "{keyless:?}");
    let sent = upstream.last_headers("/v1/plain").expect("forwarded");
    assert_eq!(sent["accept-encoding"], "gzip, br");
}
