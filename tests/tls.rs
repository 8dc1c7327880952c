//! The traffic listener over TLS: the same contract, HTTP/2 by ALPN, and
//! `X-Forwarded-Proto: https` for the upstream.

use crate::support;

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemproxy::config::TlsConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use sha2::Digest;
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
    c.tls = Some(TlsConfig::new(cert_file, key_file));
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
        tls: Some(TlsConfig::new(
            "/nonexistent/cert.pem".into(),
            "/nonexistent/key.pem".into(),
        )),
        ..Default::default()
    };
    let err = idemproxy::validate(&c).expect_err("invalid").to_string();
    assert!(err.contains("tls.cert_file"), "{err}");
    assert!(err.contains("tls.key_file"), "{err}");
}

/// A CA and the client certificates it issues, for mTLS.
struct ClientCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

/// A client certificate and its key, DER.
struct ClientCert {
    der: CertificateDer<'static>,
    key: Vec<u8>,
}

impl ClientCa {
    fn generate(name: &str) -> ClientCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        ClientCa { cert, key }
    }

    fn issue(&self, name: &str) -> ClientCert {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().expect("client key");
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("client certificate");
        ClientCert {
            der: cert.der().clone(),
            key: key.serialize_der(),
        }
    }
}

/// An HTTPS client trusting `server`, presenting `identity` when given.
fn mtls_client(
    server: &TestCert,
    identity: Option<&ClientCert>,
) -> Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(server.cert_pem.as_bytes()).expect("cert parses"))
        .expect("root added");
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocols")
    .with_root_certificates(roots);
    let tls = match identity {
        Some(id) => builder
            .with_client_auth_cert(
                vec![id.der.clone()],
                rustls_pki_types::PrivateKeyDer::Pkcs8(id.key.clone().into()),
            )
            .expect("client certificate"),
        None => builder.with_no_client_auth(),
    };
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

/// An upstream, and a proxy in front of it whose listener verifies client
/// certificates against `ca` and scopes keys by them (no certificate: 401
/// `missing-identity`).
struct Mtls {
    upstream: TestUpstream,
    server: TestCert,
    ca: ClientCa,
    proxy: TestProxy,
    _dir: tempfile::TempDir,
}

impl Mtls {
    async fn start(auth: idemproxy::config::ClientAuth) -> Mtls {
        let upstream = TestUpstream::start().await;
        let server = TestCert::generate();
        let ca = ClientCa::generate("clients");
        let dir = tempfile::tempdir().expect("tempdir");
        let cert_file = dir.path().join("cert.pem");
        let key_file = dir.path().join("key.pem");
        let ca_file = dir.path().join("clients-ca.pem");
        std::fs::write(&cert_file, &server.cert_pem).expect("write cert");
        std::fs::write(&key_file, &server.key_pem).expect("write key");
        std::fs::write(&ca_file, ca.cert.pem()).expect("write CA");
        let mut c = config(&upstream.url());
        let mut tls = TlsConfig::new(cert_file, key_file);
        tls.client_ca_file = Some(ca_file);
        tls.client_auth = auth;
        c.tls = Some(tls);
        c.idempotency.scope = vec!["client_cert".into()];
        c.idempotency.anonymous = idemproxy::config::Anonymous::Reject;
        c.admin_token = Some("t".repeat(32));
        let proxy = TestProxy::start(c).await;
        Mtls {
            upstream,
            server,
            ca,
            proxy,
            _dir: dir,
        }
    }

    /// A POST with `key` from a new connection presenting `identity`.
    async fn post(
        &self,
        identity: Option<&ClientCert>,
        key: &str,
    ) -> Result<support::proxy::Reply, hyper_util::client::legacy::Error> {
        post_as(&mtls_client(&self.server, identity), &self.proxy, key).await
    }
}

async fn post_as(
    client: &Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
    proxy: &TestProxy,
    key: &str,
) -> Result<support::proxy::Reply, hyper_util::client::legacy::Error> {
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("https://127.0.0.1:{}/v1/mtls", proxy.addr.port()))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"a\":1}")))
        .expect("request");
    let response = client.request(req).await?;
    let (parts, body) = response.into_parts();
    Ok(support::proxy::Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("body").to_bytes(),
    })
}

/// `client_cert` names the caller by the certificate its handshake
/// verified: the same key from two clients is two records, a client's
/// retry replays, and a client without a certificate (or with one another
/// CA issued) is refused in the handshake.
#[tokio::test]
async fn client_cert_scopes_keys_by_the_verified_client_certificate() {
    let mtls = Mtls::start(idemproxy::config::ClientAuth::Required).await;
    let (alice, bob) = (mtls.ca.issue("alice"), mtls.ca.issue("bob"));

    let first = mtls.post(Some(&alice), "k-1").await.expect("alice served");
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    // A new connection with the same certificate is the same caller.
    let again = mtls.post(Some(&alice), "k-1").await.expect("alice served");
    assert_eq!(again.status, 201);
    assert!(again.replayed(), "the same certificate replays");
    let other = mtls.post(Some(&bob), "k-1").await.expect("bob served");
    assert_eq!(other.status, 201);
    assert!(!other.replayed(), "another certificate is another caller");
    assert_eq!(mtls.upstream.executions("/v1/mtls"), 2);

    // The admin lookup finds alice's record by her certificate's digest.
    let digest = hex::encode(sha2::Sha256::digest(alice.der.as_ref()));
    let lookup = support::proxy::TestClient::new()
        .send(
            Method::POST,
            &mtls.proxy.admin_url("/v1/keys/lookup"),
            &[("authorization", &format!("Bearer {}", "t".repeat(32)))],
            serde_json::json!({"key": "k-1", "client_cert_sha256": digest}).to_string(),
        )
        .await;
    assert_eq!(lookup.status, 200, "{}", lookup.problem());
    assert_eq!(lookup.json()["state"], "completed", "{:?}", lookup.json());

    let anonymous = mtls.post(None, "k-1").await;
    assert!(
        anonymous.is_err(),
        "no certificate: refused in the handshake"
    );
    let stranger = ClientCa::generate("elsewhere").issue("mallory");
    let foreign = mtls.post(Some(&stranger), "k-1").await;
    assert!(foreign.is_err(), "a certificate of another CA is refused");
    assert_eq!(mtls.upstream.executions("/v1/mtls"), 2);
}

/// With `client_auth = "optional"` a client may come without a
/// certificate, and `anonymous` decides what it gets: here 401
/// `missing-identity`, nothing forwarded.
#[tokio::test]
async fn an_optional_client_certificate_leaves_the_anonymous_caller_to_anonymous() {
    let mtls = Mtls::start(idemproxy::config::ClientAuth::Optional).await;
    let anonymous = mtls
        .post(None, "k-1")
        .await
        .expect("served without a certificate");
    anonymous.assert_problem(401, "missing-identity");
    let carol = mtls
        .post(Some(&mtls.ca.issue("carol")), "k-1")
        .await
        .expect("carol served");
    assert_eq!(carol.status, 201);
    assert_eq!(mtls.upstream.executions("/v1/mtls"), 1);
    let stranger = ClientCa::generate("elsewhere").issue("mallory");
    let foreign = mtls.post(Some(&stranger), "k-1").await;
    assert!(
        foreign.is_err(),
        "a certificate that does not verify is refused"
    );
}

#[test]
fn client_cert_without_a_client_ca_is_a_config_error() {
    let mut c = idemproxy::config::Config::default();
    c.idempotency.scope = vec!["client_cert".into()];
    let err = idemproxy::validate(&c).expect_err("invalid").to_string();
    assert!(
        err.contains("`client_cert` needs [tls] client_ca_file"),
        "{err}"
    );
}
