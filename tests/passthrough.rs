//! Uncovered requests are forwarded untouched and unbuffered; what the
//! upstream sees of the client; HTTP/2 (h2c) clients.

use crate::support;

use bytes::Bytes;
use http::{Method, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::proxy::{config, TestClient, TestProxy};
use support::upstream::{expected_body, TestUpstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_uncovered_response_passes_through_intact_and_unlimited() {
    let upstream = TestUpstream::start().await;
    let c = config(&upstream.url());
    // Larger than max_response_bytes: passthrough is not buffered or capped.
    let n = 3_000_000;
    assert!(n > c.idempotency.max_response_bytes);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    let reply = client
        .send(
            Method::GET,
            &proxy.url(&format!("/v1/export?body_bytes={n}")),
            &[("idempotency-key", "ignored-on-get")],
            "",
        )
        .await;
    assert_eq!(reply.status, 201);
    assert_eq!(reply.body.len(), n);
    assert!(reply.body == expected_body(n), "every byte intact");
    assert_eq!(reply.header("content-length"), Some(&*n.to_string()));
    assert!(!reply.replayed());
    assert_eq!(upstream.executions("/v1/export"), 1);
}

#[tokio::test]
async fn the_upstream_sees_forwarded_headers_and_its_own_host() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();

    // Covered and uncovered requests are forwarded alike.
    for (method, path, key) in [
        (Method::GET, "/v1/get", None),
        (Method::POST, "/v1/post", Some("fwd-1")),
    ] {
        let mut headers = vec![
            ("x-forwarded-for", "203.0.113.7"),
            ("content-type", "application/json"),
            ("x-custom", "kept"),
            ("connection", "x-hop"),
            ("x-hop", "dropped"),
        ];
        if let Some(key) = key {
            headers.push(("idempotency-key", key));
        }
        let reply = client
            .send(method.clone(), &proxy.url(path), &headers, "{}")
            .await;
        assert_eq!(reply.status, 201, "{method}: {reply:?}");

        let seen = upstream.last_headers(path).expect("the request arrived");
        assert_eq!(seen["host"], upstream.addr.to_string(), "{method}");
        assert_eq!(
            seen["x-forwarded-for"], "203.0.113.7, 127.0.0.1",
            "{method}: the client's address is appended"
        );
        assert_eq!(seen["x-forwarded-host"], proxy.addr.to_string(), "{method}");
        assert_eq!(seen["x-forwarded-proto"], "http", "{method}");
        assert_eq!(seen["x-custom"], "kept", "{method}");
        assert!(seen.get("x-hop").is_none(), "{method}: hop-by-hop removed");
        if let Some(key) = key {
            assert_eq!(seen["idempotency-key"], key, "the key reaches the upstream");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_client_is_served_with_the_same_contract() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let send = |method: Method, path: &str, key: Option<&str>| {
        let mut req = Request::builder()
            .method(method)
            .uri(proxy.url(path))
            .header("content-type", "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        let req = req
            .body(Full::new(Bytes::from_static(b"{\"a\":1}")))
            .expect("request builds");
        let client = client.clone();
        async move {
            let response = client.request(req).await.expect("h2c request");
            let (parts, body) = response.into_parts();
            let body = body.collect().await.expect("h2c body").to_bytes();
            (parts, body)
        }
    };

    let (first, first_body) = send(Method::POST, "/v1/orders", Some("h2-1")).await;
    assert_eq!(first.version, Version::HTTP_2);
    assert_eq!(first.status, 201);
    assert!(first.headers.get("idempotent-replayed").is_none());
    let (retry, retry_body) = send(Method::POST, "/v1/orders", Some("h2-1")).await;
    assert_eq!(retry.version, Version::HTTP_2);
    assert_eq!(retry.status, 201);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry_body, first_body);
    assert_eq!(upstream.executions("/v1/orders"), 1);

    let (get, _) = send(Method::GET, "/v1/orders", None).await;
    assert_eq!(get.version, Version::HTTP_2);
    assert_eq!(get.status, 201);
    assert_eq!(upstream.executions("/v1/orders"), 2);
    // HTTP/2 carries the host in the URI: the upstream still gets its own
    // Host and the client's in X-Forwarded-Host.
    let seen = upstream.last_headers("/v1/orders").expect("arrived");
    assert_eq!(seen["host"], upstream.addr.to_string());
    assert_eq!(seen["x-forwarded-host"], proxy.addr.to_string());
}

#[tokio::test]
async fn request_ids_are_generated_when_absent_and_propagated_both_ways() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();

    let reply = client.post_json(&proxy.url("/v1/rid"), "rid-1", "{}").await;
    assert_eq!(reply.status, 201);
    let generated = reply
        .header("x-request-id")
        .expect("a request id is generated")
        .to_string();
    assert_eq!(generated.len(), 36, "a UUID: {generated}");
    let seen = upstream.last_headers("/v1/rid").expect("upstream saw it");
    assert_eq!(seen["x-request-id"], generated.as_str());

    let reply = client
        .send(
            Method::GET,
            &proxy.url("/v1/rid-get"),
            &[("x-request-id", "caller-chosen-7")],
            "",
        )
        .await;
    assert_eq!(reply.header("x-request-id"), Some("caller-chosen-7"));
    let seen = upstream
        .last_headers("/v1/rid-get")
        .expect("upstream saw it");
    assert_eq!(seen["x-request-id"], "caller-chosen-7");

    // An id too long to repeat in every log line is replaced, not echoed.
    let oversized = "x".repeat(idemproxy::observe::request_id::MAX_REQUEST_ID_LEN + 1);
    let reply = client
        .send(
            Method::GET,
            &proxy.url("/v1/rid-long"),
            &[("x-request-id", oversized.as_str())],
            "",
        )
        .await;
    assert_eq!(reply.status, 201);
    let replaced = reply.header("x-request-id").expect("an id").to_string();
    assert_eq!(replaced.len(), 36, "a UUID instead: {replaced}");
    let seen = upstream
        .last_headers("/v1/rid-long")
        .expect("upstream saw it");
    assert_eq!(seen["x-request-id"], replaced.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncovered_body_that_outlives_the_upstream_timeout_is_cut_off() {
    // upstream.timeout bounds the whole exchange, body included, for
    // uncovered requests too: a body that trickles on must not hold its
    // `max_in_flight` slot for as long as the client waits.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.upstream.timeout = std::time::Duration::from_secs(1);
    let proxy = TestProxy::start(c).await;
    // 20 chunks of 16 KiB, 200 ms apart: about 4 s in all.
    let total = 20 * 16 * 1024;
    let mut socket = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect to the proxy");
    socket
        .write_all(
            format!(
                "GET /v1/export?body_bytes={total}&stream_delay_ms=200 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .expect("write the request");
    let started = tokio::time::Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        socket.read_to_end(&mut answer),
    )
    .await
    .expect("the proxy closes")
    .ok();
    let took = started.elapsed();
    assert!(
        answer.starts_with(b"HTTP/1.1 201"),
        "{:?}",
        &answer[..40.min(answer.len())]
    );
    assert!(
        answer.len() < total,
        "cut off, not all relayed: {} bytes",
        answer.len()
    );
    assert!(
        took < std::time::Duration::from_millis(2500),
        "cut off at the deadline, not when the body ended: {took:?}"
    );
}
