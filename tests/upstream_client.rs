//! `Upstream` against a real counting upstream: forwarding, header hygiene,
//! protocols, TLS, and the classification of failures by whether the
//! request could have executed.

use crate::support;

use std::time::Duration;

use axum::body::Body;
use http::{Request, Version};
use http_body_util::BodyExt;
use idemproxy::config::UpstreamSettings;
use idemproxy::forward::{ClientInfo, Upstream, UpstreamError};
use support::upstream::{expected_body, unused_port_url, TestCert, TestUpstream};
use tokio::time::Instant;

fn upstream(url: String) -> Upstream {
    Upstream::new(&UpstreamSettings {
        url,
        connect_timeout: Duration::from_secs(2),
        ..UpstreamSettings::default()
    })
    .expect("upstream client")
}

fn client() -> ClientInfo {
    ClientInfo::new(Some(([192, 0, 2, 1], 40000).into()), true)
}

fn post(uri: &str, body: &'static str) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri(uri)
        .header("host", "api.example.com")
        .header("content-type", "application/json")
        .header("x-custom", "kept")
        .header("connection", "x-hop")
        .header("x-hop", "dropped")
        .body(Body::from(body))
        .expect("request")
}

fn in_secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

async fn body_json(response: http::Response<hyper::body::Incoming>) -> serde_json::Value {
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("response body")
        .to_bytes();
    serde_json::from_slice(&bytes).expect("JSON body")
}

#[tokio::test]
async fn round_trip_forwards_body_and_headers_behind_the_base_path() {
    let test = TestUpstream::start().await;
    let up = upstream(format!("{}/api/", test.url()));

    for n in 1..=2 {
        let req = up.prepare(post("/v1/pay?x=1", r#"{"amount":5}"#), client());
        let response = up.send(req, in_secs(5)).await.expect("response");
        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["x-upstream-execution"], n.to_string());
        let json = body_json(response).await;
        assert_eq!(json["path"], "/api/v1/pay");
        assert_eq!(json["execution"], n);
        assert_eq!(json["body_len"], 12);
    }
    assert_eq!(test.executions("/api/v1/pay"), 2);
    assert_eq!(test.total(), 2);

    let seen = test.last_request("/api/v1/pay").expect("recorded");
    assert_eq!(seen.uri, "/api/v1/pay?x=1");
    assert_eq!(seen.version, Version::HTTP_11);
    assert_eq!(seen.body, r#"{"amount":5}"#);
    let h = seen.headers;
    assert_eq!(h["host"], test.addr.to_string());
    assert_eq!(h["x-forwarded-for"], "192.0.2.1");
    assert_eq!(h["x-forwarded-proto"], "https");
    assert_eq!(h["x-forwarded-host"], "api.example.com");
    assert_eq!(h["x-custom"], "kept");
    assert_eq!(h["content-type"], "application/json");
    assert!(h.get("x-hop").is_none());
}

#[tokio::test]
async fn hop_by_hop_response_headers_are_removed_and_bodies_stream_intact() {
    let test = TestUpstream::start().await;
    let up = upstream(test.url());
    let uri = "/dl?body_bytes=100000&stream_delay_ms=5&status=202\
               &header=connection:x-hop&header=x-hop:1&header=x-kept:yes";
    let response = up
        .send(up.prepare(post(uri, ""), client()), in_secs(5))
        .await
        .expect("response");
    assert_eq!(response.status(), 202);
    assert!(response.headers().get("x-hop").is_none());
    assert!(response.headers().get("connection").is_none());
    assert_eq!(response.headers()["x-kept"], "yes");
    assert_eq!(response.headers()["content-length"], "100000");
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(body, expected_body(100_000));
}

#[tokio::test]
async fn a_body_broken_midway_fails_after_the_head() {
    let test = TestUpstream::start().await;
    let up = upstream(test.url());
    let response = up
        .send(
            up.prepare(post("/cut?abort_body=1", ""), client()),
            in_secs(5),
        )
        .await
        .expect("the head arrives");
    assert_eq!(response.status(), 201);
    assert!(response.into_body().collect().await.is_err());
    assert_eq!(test.executions("/cut"), 1);
}

#[tokio::test]
async fn idle_connections_are_closed_after_pool_idle_timeout() {
    // An upstream closing an idle connection just as a request is written
    // into it makes that request look sent: the proxy closes idle ones
    // first, below the upstream's keep-alive timeout.
    let test = TestUpstream::start().await;
    let pooled = |idle: Duration| {
        Upstream::new(&UpstreamSettings {
            url: test.url(),
            pool_idle_timeout: idle,
            ..UpstreamSettings::default()
        })
        .expect("upstream client")
    };
    let send_twice = |up: Upstream| async move {
        for _ in 0..2 {
            let req = up.prepare(post("/v1/pay", "{}"), client());
            let response = up.send(req, in_secs(5)).await.expect("response");
            body_json(response).await;
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
    };
    send_twice(pooled(Duration::from_secs(30))).await;
    assert_eq!(test.connections(), 1, "reused within the idle timeout");
    send_twice(pooled(Duration::from_millis(200))).await;
    assert_eq!(test.connections(), 3, "a new connection after 700 ms idle");
}

#[tokio::test]
async fn connection_refused_is_unreachable() {
    let up = upstream(unused_port_url());
    let err = up
        .send(up.prepare(post("/x", "{}"), client()), in_secs(5))
        .await
        .expect_err("nothing listens");
    assert!(matches!(err, UpstreamError::Unreachable(_)), "{err:?}");
}

#[tokio::test]
async fn a_stopped_test_upstream_refuses_connections() {
    let test = TestUpstream::start().await;
    let url = test.url();
    drop(test);
    // The accept loop is aborted on drop; give the runtime a moment to
    // close the listener.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let up = upstream(url);
    let err = up
        .send(up.prepare(post("/x", "{}"), client()), in_secs(5))
        .await
        .expect_err("stopped");
    assert!(matches!(err, UpstreamError::Unreachable(_)), "{err:?}");
}

#[tokio::test]
async fn a_response_past_the_deadline_is_a_timeout_after_execution() {
    let test = TestUpstream::start().await;
    let up = upstream(test.url());
    let started = Instant::now();
    let err = up
        .send(
            up.prepare(post("/slow?delay_ms=3000", "{}"), client()),
            Instant::now() + Duration::from_millis(300),
        )
        .await
        .expect_err("too slow");
    assert!(matches!(err, UpstreamError::Timeout), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(test.executions("/slow"), 1);
}

#[tokio::test]
async fn a_connection_dropped_after_the_request_is_a_reset() {
    let test = TestUpstream::start().await;
    let up = upstream(test.url());
    let err = up
        .send(
            up.prepare(post("/boom?reset=1", "{}"), client()),
            in_secs(5),
        )
        .await
        .expect_err("reset");
    assert!(matches!(err, UpstreamError::Reset(_)), "{err:?}");
    assert_eq!(test.executions("/boom"), 1);
}

#[tokio::test]
async fn http2_prior_knowledge_speaks_h2c() {
    let test = TestUpstream::start().await;
    let up = Upstream::new(&UpstreamSettings {
        url: test.url(),
        http2_prior_knowledge: true,
        ..UpstreamSettings::default()
    })
    .expect("upstream client");
    let response = up
        .send(up.prepare(post("/h2", "{}"), client()), in_secs(5))
        .await
        .expect("response");
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), 201);
    let seen = test.last_request("/h2").expect("recorded");
    assert_eq!(seen.version, Version::HTTP_2);
    assert_eq!(
        seen.uri.authority().map(|a| a.as_str()),
        Some(test.addr.to_string().as_str())
    );
    assert_eq!(seen.headers["x-forwarded-for"], "192.0.2.1");

    // A stream reset on HTTP/2 is a Reset too.
    let err = up
        .send(
            up.prepare(post("/h2boom?reset=1", "{}"), client()),
            in_secs(5),
        )
        .await
        .expect_err("reset");
    assert!(matches!(err, UpstreamError::Reset(_)), "{err:?}");
    assert_eq!(test.executions("/h2boom"), 1);
}

#[tokio::test]
async fn https_upstream_is_trusted_through_ca_file_only() {
    let cert = TestCert::generate();
    let test = TestUpstream::start_tls(cert.server_config()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &cert.cert_pem).expect("write the CA file");

    let trusted = Upstream::new(&UpstreamSettings {
        url: test.url(),
        ca_file: Some(ca),
        ..UpstreamSettings::default()
    })
    .expect("upstream client");
    let response = trusted
        .send(trusted.prepare(post("/tls", "{}"), client()), in_secs(5))
        .await
        .expect("TLS round trip");
    // ALPN picked HTTP/2 although the prepared request said HTTP/1.1.
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(body_json(response).await["path"], "/tls");
    assert_eq!(test.executions("/tls"), 1);

    let untrusted = upstream(test.url());
    let err = untrusted
        .send(untrusted.prepare(post("/tls", "{}"), client()), in_secs(5))
        .await
        .expect_err("unknown issuer");
    assert!(matches!(err, UpstreamError::Unreachable(_)), "{err:?}");
    assert_eq!(test.executions("/tls"), 1);
}

#[tokio::test]
async fn waiting_for_an_execution_sees_a_delayed_request_arrive() {
    let test = TestUpstream::start().await;
    let up = upstream(test.url());
    let sent = {
        let up = up.clone();
        tokio::spawn(async move {
            let req = up.prepare(post("/held?delay_ms=300", "{}"), client());
            up.send(req, in_secs(5)).await.map(|r| r.status())
        })
    };
    assert!(
        test.wait_for_executions("/held", 1, Duration::from_secs(5))
            .await
    );
    assert!(!sent.is_finished(), "still held by delay_ms");
    let status = sent.await.expect("task").expect("response");
    assert_eq!(status, 201);
    assert!(
        !test
            .wait_for_executions("/held", 2, Duration::from_millis(50))
            .await
    );
}
