//! Runs the real proxy in-process on `127.0.0.1:0`, and a small HTTP client
//! to talk to it.

#![allow(unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemproxy::config::Config;
use idemproxy::store::{MemoryStore, SharedStore};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A test configuration in front of `upstream_url`: memory store, short
/// timeouts so failure rows finish quickly.
pub fn config(upstream_url: &str) -> Config {
    let mut c = Config::default();
    c.upstream.url = upstream_url.to_string();
    c.upstream.timeout = Duration::from_secs(5);
    c.upstream.connect_timeout = Duration::from_secs(1);
    c.store.kind = idemproxy::config::StoreKind::Memory;
    c.store.timeout = Duration::from_millis(250);
    c.drain_timeout = Duration::from_secs(5);
    c
}

/// [`config`] on the Redis at `redis_url`, its keys under `prefix` (make it
/// unique per test: `redis_server::unique_prefix`).
pub fn redis_config(upstream_url: &str, redis_url: &str, prefix: &str) -> Config {
    let mut c = config(upstream_url);
    c.store.kind = idemproxy::config::StoreKind::Redis;
    c.store.url = redis_url.to_string();
    c.store.key_prefix = prefix.to_string();
    c
}

/// The proxy's configuration on the PostgreSQL at `postgres_url`, its
/// tables under `prefix`.
pub fn postgres_config(upstream_url: &str, postgres_url: &str, prefix: &str) -> Config {
    let mut c = config(upstream_url);
    c.store.kind = idemproxy::config::StoreKind::Postgres;
    c.store.url = postgres_url.to_string();
    c.store.table_prefix = prefix.to_string();
    c
}

pub struct TestProxy {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub store: SharedStore,
    stop: Option<oneshot::Sender<()>>,
    served: Option<JoinHandle<()>>,
}

impl TestProxy {
    /// Starts the proxy on a fresh memory store.
    pub async fn start(config: Config) -> TestProxy {
        Self::start_with_store(config, Arc::new(MemoryStore::new())).await
    }

    pub async fn start_with_store(config: Config, store: SharedStore) -> TestProxy {
        idemproxy::validate(&config).expect("test config is valid");
        let app = idemproxy::app(&config, store.clone()).expect("app builds");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
        let addr = listener.local_addr().expect("proxy addr");
        let admin_addr = admin.local_addr().expect("admin addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let drain = config.drain_timeout;
        let served = tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            idemproxy::serve_app(app, listener, admin, shutdown, drain)
                .await
                .expect("the proxy serves");
        });
        TestProxy {
            addr,
            admin_addr,
            store,
            stop: Some(stop),
            served: Some(served),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin_addr, path)
    }

    /// Graceful shutdown: returns once connections and executions drained.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(served) = self.served.take() {
            let _ = served.await;
        }
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The problem type slug of a problem+json answer.
    /// Asserts an answer of the proxy's own: `status`, as problem+json of
    /// type `slug`.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.problem(), slug, "{self:?}");
    }

    /// 500 `record-unreadable`: a key whose stored record does not read
    /// is refused as permanent (the SDKs' retry hints say no, and no
    /// `Retry-After`), and the caller is told an operator must act.
    pub fn assert_record_unreadable(&self) {
        self.assert_problem(500, "record-unreadable");
        assert_eq!(self.header("x-should-retry"), Some("false"), "{self:?}");
        assert_eq!(
            self.header("stripe-should-retry"),
            Some("false"),
            "{self:?}"
        );
        assert_eq!(self.header("retry-after"), None, "{self:?}");
        assert_eq!(self.header("retry-after-ms"), None, "{self:?}");
        let detail = self.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            detail.contains("keys show") && detail.contains("keys forget"),
            "{detail}"
        );
    }

    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "not a problem: {self:?}"
        );
        let json = self.json();
        assert_eq!(
            json["status"],
            self.status.as_u16(),
            "status member matches"
        );
        assert!(json["title"].is_string() && json["detail"].is_string());
        json["type"]
            .as_str()
            .and_then(|t| t.strip_prefix("urn:idemproxy:problem:"))
            .unwrap_or_else(|| panic!("problem type: {json}"))
            .to_string()
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// A pooled HTTP/1.1 client for tests.
#[derive(Clone)]
pub struct TestClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for TestClient {
    fn default() -> Self {
        Self::new()
    }
}

impl TestClient {
    pub fn new() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        let within = Duration::from_secs(20);
        match self.try_send(method, url, headers, body, within).await {
            Ok(reply) => reply,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::send`] that reports a failed exchange (refused, broken off,
    /// no answer `within`) instead of panicking: for tests whose proxies
    /// die on purpose.
    pub async fn try_send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
        within: Duration,
    ) -> Result<Reply, String> {
        let mut req = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(body.into())).expect("request builds");
        let exchange = async {
            let response = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("request fails: {e}"))?;
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| format!("body breaks off: {e}"))?;
            Ok(Reply {
                status: parts.status,
                headers: parts.headers,
                body: body.to_bytes(),
            })
        };
        tokio::time::timeout(within, exchange)
            .await
            .map_err(|_| format!("no answer within {within:?}"))?
    }

    /// POSTs a JSON body with `headers` besides its content type.
    pub async fn post_json_with(&self, url: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        self.send(Method::POST, url, &all, body.to_string()).await
    }

    /// The value of `series` (a name with its labels, as exposed) in the
    /// `/metrics` at `metrics_url`; panics if it is not there.
    pub async fn metric(&self, metrics_url: &str, series: &str) -> f64 {
        let reply = self.send(Method::GET, metrics_url, &[], "").await;
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }

    /// POSTs a JSON body with an `Idempotency-Key`.
    pub async fn post_json(&self, url: &str, key: &str, body: &str) -> Reply {
        self.send(
            Method::POST,
            url,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
            body.to_string(),
        )
        .await
    }
}
