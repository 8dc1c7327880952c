//! The traffic listener over TLS: the same contract, HTTP/2 by ALPN, and
//! `X-Forwarded-Proto: https` for the upstream.

mod support;

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemproxy::config::TlsConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use support::proxy::{config, TestProxy};
use support::upstream::{TestCert, TestUpstream};

#[tokio::test]
async fn the_contract_holds_over_tls_with_http2_by_alpn() {
    let upstream = TestUpstream::start().await;
    let cert = TestCert::generate();
    let dir = tempfile::tempdir().expect("tempdir");
    let cert_file = dir.path().join("cert.pem");
    let key_file = dir.path().join("key.pem");
    std::fs::write(&cert_file, &cert.cert_pem).expect("write cert");
    std::fs::write(&key_file, &cert.key_pem).expect("write key");
    let mut c = config(&upstream.url());
    c.tls = Some(TlsConfig {
        cert_file,
        key_file,
    });
    let proxy = TestProxy::start(c).await;

    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(cert.cert_pem.as_bytes()).expect("cert parses"))
        .expect("root added");
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocols")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .enable_http2()
        .build();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let url = format!("https://127.0.0.1:{}/v1/tls", proxy.addr.port());
    let send = || {
        let req = Request::builder()
            .method(Method::POST)
            .uri(&url)
            .header("idempotency-key", "tls-1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"a\":1}")))
            .expect("request");
        client.request(req)
    };

    let first = send().await.expect("TLS request succeeds");
    assert_eq!(first.version(), Version::HTTP_2, "h2 negotiated by ALPN");
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body = first.into_body().collect().await.expect("body").to_bytes();

    let replay = send().await.expect("TLS request succeeds");
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let replay_body = replay.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(first_body, replay_body);
    assert_eq!(upstream.executions("/v1/tls"), 1);

    let seen = upstream.last_headers("/v1/tls").expect("upstream saw it");
    assert_eq!(seen["x-forwarded-proto"], "https");

    // Plain HTTP on the TLS port is not served.
    let attempt = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        let req = Request::builder()
            .method(Method::GET)
            .uri(format!("http://127.0.0.1:{}/v1/tls", proxy.addr.port()))
            .body(Full::new(Bytes::new()))
            .expect("request");
        Client::builder(TokioExecutor::new())
            .build_http::<Full<Bytes>>()
            .request(req)
            .await
    })
    .await
    .expect("answers or fails within 5 s");
    assert!(
        attempt.is_err(),
        "plain HTTP must not be served over the TLS port"
    );
}

#[test]
fn a_missing_certificate_is_a_config_error_naming_the_field() {
    let c = idemproxy::config::Config {
        tls: Some(TlsConfig {
            cert_file: "/nonexistent/cert.pem".into(),
            key_file: "/nonexistent/key.pem".into(),
        }),
        ..Default::default()
    };
    let err = idemproxy::validate(&c).expect_err("invalid").to_string();
    assert!(err.contains("tls.cert_file"), "{err}");
    assert!(err.contains("tls.key_file"), "{err}");
}
