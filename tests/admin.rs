//! docs/operating.md, "Admin listener": the key API
//! (`GET`/`DELETE /v1/keys/{hash}`, `POST /v1/keys/lookup`), its token, and
//! the reconciliation flow for an `outcome-unknown` key.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use http::Method;
use idemproxy::config::{Config, LogFormat, RouteConfig};
use idemproxy::core::{CompletedRecord, FencingToken, Record, RecordKey};
use idemproxy::store::{Begin, BeginOutcome, MemoryStore, Removal, Removed, Store, StoreError};
use serde_json::{json, Value};
use support::binary::ProxyProcess;
use support::keys;
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::upstream::TestUpstream;

const TOKEN: &str = "admin-test-token-5f2c-9e0a7b31c4d8f265";
const ARRIVAL: Duration = Duration::from_secs(5);
const TENANT_A: &str = "Bearer sk_tenant_a_d41d8cd98f";
const TENANT_B: &str = "Bearer sk_tenant_b_0cc175b9c0";

fn with_routes(mut c: Config, token: Option<&str>) -> Config {
    c.admin_token = token.map(str::to_owned);
    c.routes = vec![RouteConfig {
        name: "payments".into(),
        path: "/v1/payments".into(),
        idempotency: c.idempotency.clone(),
        ..RouteConfig::default()
    }];
    c
}

/// The admin API, as an operator calls it.
struct Admin {
    client: TestClient,
    /// `http://ADMIN_ADDR`: the in-process proxy's or the binary's.
    base: String,
    auth: Option<String>,
}

impl Admin {
    fn new(proxy: &TestProxy, auth: Option<&str>) -> Self {
        Self::at(proxy.admin_url(""), auth)
    }

    fn at(base: String, auth: Option<&str>) -> Self {
        Admin {
            client: TestClient::new(),
            base,
            auth: auth.map(str::to_owned),
        }
    }

    fn bearer(proxy: &TestProxy) -> Self {
        Self::new(proxy, Some(&format!("Bearer {TOKEN}")))
    }

    async fn call(&self, method: Method, path: &str, body: &str) -> Reply {
        let mut headers = vec![("content-type", "application/json")];
        if let Some(auth) = &self.auth {
            headers.push(("authorization", auth));
        }
        self.client
            .send(
                method,
                &format!("{}{path}", self.base),
                &headers,
                body.to_string(),
            )
            .await
    }

    async fn get(&self, hash: &str) -> Reply {
        self.call(Method::GET, &format!("/v1/keys/{hash}"), "")
            .await
    }

    async fn delete(&self, hash: &str) -> Reply {
        self.call(Method::DELETE, &format!("/v1/keys/{hash}"), "")
            .await
    }

    async fn lookup(&self, body: Value) -> Reply {
        self.call(Method::POST, "/v1/keys/lookup", &body.to_string())
            .await
    }
}

/// A request to a covered path on behalf of a tenant.
async fn post(
    client: &TestClient,
    proxy: &TestProxy,
    target: &str,
    key: &str,
    auth: &str,
) -> Reply {
    post_to(client, &proxy.url(target), key, auth).await
}

/// [`post`] to a whole URL, for a request sent from a task of its own.
async fn post_to(client: &TestClient, url: &str, key: &str, auth: &str) -> Reply {
    client
        .send(
            Method::POST,
            url,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
                ("authorization", auth),
            ],
            r#"{"amount":1000}"#,
        )
        .await
}

/// The record key the proxy derives for `key` sent to `target` by `auth`.
fn hash_of(target: &str, key: &str, auth: &str) -> String {
    let parts = keys::parts(
        Method::POST,
        target,
        &[
            ("content-type", "application/json"),
            ("authorization", auth),
        ],
    );
    keys::record_key(&parts, key).to_hex()
}

fn time(v: &Value) -> SystemTime {
    let s = v
        .as_str()
        .unwrap_or_else(|| panic!("a timestamp string: {v}"));
    humantime::parse_rfc3339(s).unwrap_or_else(|e| panic!("{s} is RFC 3339: {e}"))
}

fn secs_between(from: &Value, to: &Value) -> f64 {
    time(to)
        .duration_since(time(from))
        .unwrap_or_else(|e| panic!("{to} is after {from}: {e}"))
        .as_secs_f64()
}

#[tokio::test]
async fn without_an_admin_token_the_key_api_is_refused() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(with_routes(config(&upstream.url()), None)).await;
    let client = TestClient::new();
    let done = post(&client, &proxy, "/v1/payments", "k-1", TENANT_A).await;
    assert_eq!(done.status, 201, "{done:?}");
    let hash = hash_of("/v1/payments", "k-1", TENANT_A);

    // With or without a bearer (no token is configured, none is right).
    for auth in [None, Some("Bearer anything"), Some("Bearer ")] {
        let admin = Admin::new(&proxy, auth);
        (admin.get(&hash).await).assert_problem(403, "admin-disabled");
        (admin.delete(&hash).await).assert_problem(403, "admin-disabled");
        let lookup = admin
            .lookup(
                json!({"key": "k-1", "route": "payments", "headers": {"authorization": TENANT_A}}),
            )
            .await;
        lookup.assert_problem(403, "admin-disabled");
    }
    // Nothing was deleted; the rest of the admin listener is open.
    let retry = post(&client, &proxy, "/v1/payments", "k-1", TENANT_A).await;
    assert!(retry.replayed(), "{retry:?}");
    for path in ["/healthz", "/readyz", "/metrics"] {
        let reply = client
            .send(Method::GET, &proxy.admin_url(path), &[], "")
            .await;
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
    }
}

/// A `GET /v1/keys/{hash}` with `auth` from the local address `from`
/// (the loopback network holds all of 127.0.0.0/8), over a bare socket:
/// the test's stand-in for another machine.
async fn get_from(proxy: &TestProxy, from: [u8; 4], hash: &str, auth: &str) -> Reply {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(std::net::SocketAddr::from((from, 0)))
        .expect("bind a loopback address");
    let mut stream = socket.connect(proxy.admin_addr).await.expect("connect");
    let head = support::raw::request(
        "GET",
        &format!("/v1/keys/{hash}"),
        &[format!("authorization: {auth}").as_bytes()],
        b"",
    );
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(&head).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(ARRIVAL, stream.read_to_end(&mut raw))
        .await
        .expect("answered in time")
        .expect("read");
    support::raw::parse(&raw)
}

/// Past 100 failed attempts within 10 s a peer's wrong tokens are answered
/// 429 until its window ends: the token cannot be guessed at line rate.
/// The right token is never refused, from that very peer either, and
/// another peer's attempts are not limited by this one's failures: whoever
/// can reach the admin port cannot lock the operators out. Before, 100
/// failures from anyone answered every attempt 429, the right token too.
#[tokio::test]
async fn failed_attempts_are_limited_per_peer_and_never_refuse_the_right_token() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(with_routes(config(&upstream.url()), Some(TOKEN))).await;
    let client = TestClient::new();
    let done = post(&client, &proxy, "/v1/payments", "k-1", TENANT_A).await;
    assert_eq!(done.status, 201, "{done:?}");
    let hash = hash_of("/v1/payments", "k-1", TENANT_A);
    let wrong = Admin::new(
        &proxy,
        Some("Bearer guess-0123456789abcdef0123456789abcdef"),
    );
    let right = Admin::new(&proxy, Some(&format!("Bearer {TOKEN}")));
    for attempt in 0..150 {
        let reply = wrong.get(&hash).await;
        if attempt < 100 {
            reply.assert_problem(401, "admin-unauthorized");
        } else {
            reply.assert_problem(429, "admin-rate-limited");
            assert_eq!(reply.header("retry-after"), Some("10"));
        }
    }
    for _ in 0..3 {
        let shown = right.get(&hash).await;
        assert_eq!(shown.status, 200, "{shown:?}");
        assert_eq!(shown.json()["state"], "completed", "{shown:?}");
        // Still limited: a right token does not reopen the window for
        // the wrong ones.
        wrong
            .get(&hash)
            .await
            .assert_problem(429, "admin-rate-limited");
    }

    // Another peer: its own failures are counted from nothing.
    let wrong_auth = "Bearer another-guess-0123456789abcdef0123456789";
    get_from(&proxy, [127, 0, 0, 2], &hash, wrong_auth)
        .await
        .assert_problem(401, "admin-unauthorized");
    let shown = get_from(&proxy, [127, 0, 0, 2], &hash, &format!("Bearer {TOKEN}")).await;
    assert_eq!(shown.status, 200, "{shown:?}");
}

#[tokio::test]
async fn the_key_api_requires_the_bearer_token() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(with_routes(config(&upstream.url()), Some(TOKEN))).await;
    let client = TestClient::new();
    let done = post(&client, &proxy, "/v1/payments", "k-1", TENANT_A).await;
    assert_eq!(done.status, 201, "{done:?}");
    let hash = hash_of("/v1/payments", "k-1", TENANT_A);
    let lookup = json!({"key": "k-1", "route": "payments", "headers": {"authorization": TENANT_A}});

    let wrong = [
        None,
        Some("Bearer wrong-token".to_string()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Basic {TOKEN}")),
        Some(TOKEN.to_string()),
        Some("Bearer ".to_string()),
    ];
    for auth in &wrong {
        let admin = Admin::new(&proxy, auth.as_deref());
        for reply in [
            admin.get(&hash).await,
            admin.delete(&hash).await,
            admin.lookup(lookup.clone()).await,
            // Authentication comes before the body is even parsed.
            admin
                .call(Method::POST, "/v1/keys/lookup", "not json")
                .await,
            // ... and before the hash is checked.
            admin.get("not-a-hash").await,
            // Listing too, and before its query is read.
            admin
                .call(Method::GET, "/v1/keys?state=outcome-unknown", "")
                .await,
            admin.call(Method::GET, "/v1/keys?state=bogus", "").await,
        ] {
            reply.assert_problem(401, "admin-unauthorized");
            assert_eq!(
                reply.header("www-authenticate"),
                Some("Bearer"),
                "{auth:?}: {reply:?}"
            );
        }
    }
    // The refused DELETEs deleted nothing.
    let retry = post(&client, &proxy, "/v1/payments", "k-1", TENANT_A).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("/v1/payments"), 1);
    let admin = Admin::bearer(&proxy);
    assert_eq!(admin.get(&hash).await.status, 200);
}

/// Collects what the `tracing` JSON formatter writes.
/// The `idemproxy::request` lines of the binary's JSON log.
fn request_events(logs: &str) -> Vec<Value> {
    logs.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["target"] == "idemproxy::request")
        .collect()
}

// The proxy is the real binary, logging JSON to a file of its own, so the
// test reads exactly this proxy's log, whatever else runs in the test
// process. (A scoped subscriber, `tracing::subscriber::set_default`, lost
// events when a multi-thread runtime ran beside it: tracing caches each
// call site's interest process-wide. All the tests share one process.)
#[tokio::test]
async fn lookup_and_get_describe_a_completed_key_by_its_logged_hash() {
    let upstream = TestUpstream::start().await;
    let mut c = with_routes(config(&upstream.url()), Some(TOKEN));
    c.log.format = LogFormat::Json;
    c.log.level = "info".into();
    let mut proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();
    let admin = Admin::at(proxy.admin_url(""), Some(&format!("Bearer {TOKEN}")));
    let raw_key = "order-7f3a9c-raw-key";
    let done = post_to(&client, &proxy.url("/v1/payments"), raw_key, TENANT_A).await;
    assert_eq!(done.status, 201, "{done:?}");
    let expected_hash = hash_of("/v1/payments", raw_key, TENANT_A);

    // Looked up the moment the response arrived: already completed.
    let found = admin
        .lookup(
            json!({"key": raw_key, "route": "payments", "headers": {"authorization": TENANT_A}}),
        )
        .await;
    assert_eq!(found.status, 200, "{found:?}");
    assert_eq!(found.header("content-type"), Some("application/json"));
    let record = found.json();
    assert_eq!(record["key_hash"], expected_hash.as_str());
    assert_eq!(record["state"], "completed");
    assert_eq!(record["outcome"], "response");
    assert_eq!(record["status"], 201);
    assert!(record.get("lease_expires_at").is_none(), "{record}");
    assert!(secs_between(&record["created_at"], &record["completed_at"]) < 5.0);
    // Completed records live `ttl` (24 h by default).
    let ttl = secs_between(&record["completed_at"], &record["expires_at"]);
    assert!((ttl - 86_400.0).abs() < 1.0, "{ttl}");

    // GET by that hash answers the same record.
    let by_hash = admin.get(&expected_hash).await;
    assert_eq!(by_hash.status, 200, "{by_hash:?}");
    assert_eq!(by_hash.json(), record);

    // The hash is the request log's `key_hash`; the log never carries the
    // raw key or the caller's credential.
    // (Lines reach the file in batches: wait for the request's.)
    let text = proxy
        .logs_when(|logs| !request_events(logs).is_empty())
        .await;
    let events = request_events(&text);
    let executed: Vec<&Value> = events
        .iter()
        .filter(|e| e["outcome"] == "executed")
        .collect();
    assert_eq!(executed.len(), 1, "{events:?}");
    assert_eq!(executed[0]["key_hash"], expected_hash.as_str());
    assert_eq!(executed[0]["route"], "payments");
    assert!(!text.contains(raw_key), "raw key logged: {text}");
    assert!(!text.contains("sk_tenant_a"), "credential logged: {text}");

    // Lookups are scoped like requests: another tenant, or no credential,
    // has no such key. Header names are case-insensitive.
    for headers in [json!({"authorization": TENANT_B}), json!({})] {
        let other = admin
            .lookup(json!({"key": raw_key, "route": "payments", "headers": headers}))
            .await;
        other.assert_problem(404, "key-not-found");
    }
    let cased = admin
        .lookup(
            json!({"key": raw_key, "route": "payments", "headers": {"Authorization": TENANT_A}}),
        )
        .await;
    assert_eq!(cased.json(), record);
    // Without a route, `default` applies (same scope rules here).
    let default_route = admin
        .lookup(json!({"key": raw_key, "headers": {"authorization": TENANT_A}}))
        .await;
    assert_eq!(default_route.json(), record);

    // Nor does any line logged since (the lookups'), all in the file once
    // the binary has drained and exited.
    proxy.terminate();
    proxy.wait_exit(Duration::from_secs(15)).await;
    let text = proxy.logs();
    assert!(!text.contains(raw_key), "raw key logged: {text}");
    assert!(!text.contains("sk_tenant_a"), "credential logged: {text}");
}

#[tokio::test]
async fn a_key_in_flight_is_pending_with_its_lease() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.upstream.timeout = Duration::from_secs(5);
    c.idempotency.lease_margin = Duration::from_secs(2);
    let c = with_routes(c, Some(TOKEN));
    let proxy = TestProxy::start(c).await;
    let admin = Admin::bearer(&proxy);
    let target = "/v1/payments?hold=slow";

    let slow = {
        let (client, url) = (TestClient::new(), proxy.url(target));
        tokio::spawn(async move { post_to(&client, &url, "slow-1", TENANT_A).await })
    };
    assert!(
        upstream
            .wait_for_executions("/v1/payments", 1, ARRIVAL)
            .await
    );
    let pending = admin
        .lookup(
            json!({"key": "slow-1", "route": "payments", "headers": {"authorization": TENANT_A}}),
        )
        .await;
    assert_eq!(pending.status, 200, "{pending:?}");
    let record = pending.json();
    assert_eq!(record["state"], "pending");
    assert_eq!(
        record["key_hash"],
        hash_of(target, "slow-1", TENANT_A).as_str()
    );
    assert!(record.get("status").is_none(), "{record}");
    // The lease is upstream.timeout + lease_margin.
    let lease = secs_between(&record["created_at"], &record["lease_expires_at"]);
    assert!((lease - 7.0).abs() < 1.0, "lease {lease} s: {record}");
    let hash = record["key_hash"].as_str().unwrap_or_default().to_owned();
    assert_eq!(admin.get(&hash).await.json(), record);
    // A running request's claim is not deleted without `force`: its retry
    // would execute while it runs.
    let refused = admin.delete(&hash).await;
    refused.assert_problem(409, "key-in-flight");
    assert!(
        refused.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("force=true"),
        "{refused:?}"
    );
    assert_eq!(admin.get(&hash).await.json(), record, "nothing deleted");

    upstream.release("slow");
    let done = slow.await.expect("slow request task");
    assert_eq!(done.status, 201, "{done:?}");
    let completed = admin.get(&hash).await.json();
    assert_eq!(completed["state"], "completed", "{completed}");
    assert_eq!(completed["status"], 201);
    // (The pending record's `created_at` is the store's clock at the claim,
    // the completed one's the proxy's at the request's arrival: a few ms
    // apart, not equal.)
    let drift = secs_between(&completed["created_at"], &record["created_at"]);
    assert!(drift < 1.0, "{drift} s: {record} then {completed}");
}

#[tokio::test]
async fn a_running_claim_is_deleted_only_with_force() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(with_routes(config(&upstream.url()), Some(TOKEN))).await;
    let admin = Admin::bearer(&proxy);
    let client = TestClient::new();
    let target = "/v1/payments?hold=stuck";
    let slow = {
        let (client, url) = (client.clone(), proxy.url(target));
        tokio::spawn(async move { post_to(&client, &url, "stuck-1", TENANT_A).await })
    };
    assert!(
        upstream
            .wait_for_executions("/v1/payments", 1, ARRIVAL)
            .await
    );
    let hash = hash_of(target, "stuck-1", TENANT_A);
    (admin.delete(&hash).await).assert_problem(409, "key-in-flight");
    let forced = admin.delete(&format!("{hash}?force=true")).await;
    assert_eq!(forced.status, 200, "{forced:?}");
    (admin.get(&hash).await).assert_problem(404, "key-not-found");
    // The first request still finishes; its outcome is refused (its claim
    // is gone), as the operator chose: nothing is stored, and a retry runs.
    upstream.release("stuck");
    assert_eq!(slow.await.expect("slow task").status, 201);
    (admin.get(&hash).await).assert_problem(404, "key-not-found");
    let retry = post(&client, &proxy, target, "stuck-1", TENANT_A).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("/v1/payments"), 2);
}

#[tokio::test]
async fn deleting_an_outcome_unknown_key_lets_the_retry_execute() {
    let upstream = TestUpstream::start().await;
    let mut c = with_routes(config(&upstream.url()), Some(TOKEN));
    c.upstream.timeout = Duration::from_millis(300);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let admin = Admin::bearer(&proxy);
    let target = "/v1/payments?delay_ms=1000";

    let first = post(&client, &proxy, target, "charge-9", TENANT_A).await;
    first.assert_problem(504, "outcome-unknown");
    let retry = post(&client, &proxy, target, "charge-9", TENANT_A).await;
    retry.assert_problem(504, "outcome-unknown");
    assert!(retry.replayed(), "fail closed: {retry:?}");
    assert_eq!(upstream.executions("/v1/payments"), 1);

    // The operator finds the key from what the caller sent ...
    let found = admin
        .lookup(
            json!({"key": "charge-9", "route": "payments", "headers": {"authorization": TENANT_A}}),
        )
        .await;
    assert_eq!(found.status, 200, "{found:?}");
    let record = found.json();
    assert_eq!(record["state"], "completed");
    assert_eq!(record["outcome"], "outcome-unknown (timeout)");
    assert_eq!(record["status"], 504);
    let hash = record["key_hash"].as_str().unwrap_or_default().to_owned();
    assert_eq!(hash, hash_of(target, "charge-9", TENANT_A));

    // ... reconciles with the upstream (it did not charge, say) and
    // deletes the key.
    let deleted = admin.delete(&hash).await;
    assert_eq!(deleted.status, 200, "{deleted:?}");
    assert_eq!(
        deleted.json(),
        json!({"key_hash": hash.as_str(), "deleted": true})
    );
    (admin.delete(&hash).await).assert_problem(404, "key-not-found");
    (admin.get(&hash).await).assert_problem(404, "key-not-found");

    // The caller's next retry executes again.
    let again = post(&client, &proxy, target, "charge-9", TENANT_A).await;
    again.assert_problem(504, "outcome-unknown");
    assert!(!again.replayed(), "executed, not replayed: {again:?}");
    assert_eq!(upstream.executions("/v1/payments"), 2);
    assert_eq!(admin.get(&hash).await.json()["state"], "completed");
}

#[tokio::test]
async fn bad_hashes_and_bad_lookups_are_400() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(with_routes(config(&upstream.url()), Some(TOKEN))).await;
    let admin = Admin::bearer(&proxy);

    let valid_unknown = "ab".repeat(32);
    (admin.get(&valid_unknown).await).assert_problem(404, "key-not-found");
    (admin.delete(&valid_unknown).await).assert_problem(404, "key-not-found");
    for bad in [
        "xyz".to_string(),
        "ab".repeat(31) + "a",
        "ab".repeat(33),
        "zz".repeat(32),
        "order-1".to_string(),
    ] {
        (admin.get(&bad).await).assert_problem(400, "invalid-key-hash");
        (admin.delete(&bad).await).assert_problem(400, "invalid-key-hash");
    }

    let unknown_route = admin
        .lookup(json!({"key": "k", "route": "refunds", "headers": {}}))
        .await;
    unknown_route.assert_problem(400, "unknown-route");
    for body in [
        json!({"key": ""}),
        json!({"key": "k".repeat(256)}),
        json!({"key": "two words"}),
        json!({"key": "k", "headers": {"bad header": "x"}}),
        json!({"key": "k", "unknown": 1}),
        json!({"route": "payments"}),
    ] {
        let reply = admin.lookup(body.clone()).await;
        reply.assert_problem(400, "invalid-lookup");
    }
    let not_json = admin
        .call(Method::POST, "/v1/keys/lookup", "{not json")
        .await;
    not_json.assert_problem(400, "invalid-lookup");
}

/// A memory store whose `complete` takes [`SLOW_COMPLETE`]: storing an
/// outcome is slow, everything else is not.
#[derive(Default)]
struct SlowComplete(MemoryStore);

const SLOW_COMPLETE: Duration = Duration::from_millis(200);

#[async_trait]
impl Store for SlowComplete {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        self.0.begin(begin).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        tokio::time::sleep(SLOW_COMPLETE).await;
        self.0.complete(key, token, record).await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.0.release(key, token).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.0.get(key).await
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        self.0.remove(key, removal).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.0.ping().await
    }

    fn kind(&self) -> &'static str {
        "slow-complete-memory"
    }
}

/// docs/contract.md: "The client's response body ends only after the outcome is
/// stored, so a caller that retries the moment it has the response finds
/// the record" — also when the response has a `Content-Length` (the client
/// needs no end of stream to know the body is complete) or no body at all.
/// `GET /v1/keys` lists by state and age, and says what is wrong with a
/// query it cannot read.
#[tokio::test]
async fn keys_are_listed_by_state_and_age() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(with_routes(config(&upstream.url()), Some(TOKEN))).await;
    let client = TestClient::new();
    for key in ["list-1", "list-2"] {
        let done = post(&client, &proxy, "/v1/payments", key, TENANT_A).await;
        assert_eq!(done.status, 201);
    }
    let admin = Admin::bearer(&proxy);
    let listed = |reply: Reply| -> Vec<String> {
        assert_eq!(reply.status, 200, "{reply:?}");
        let mut hashes: Vec<String> = reply.json()["keys"]
            .as_array()
            .expect("keys")
            .iter()
            .map(|k| k["key_hash"].as_str().expect("a hash").to_owned())
            .collect();
        hashes.sort();
        hashes
    };
    let mut both = vec![
        hash_of("/v1/payments", "list-1", TENANT_A),
        hash_of("/v1/payments", "list-2", TENANT_A),
    ];
    both.sort();
    let all = admin.call(Method::GET, "/v1/keys", "").await;
    assert_eq!(listed(all), both);
    let completed = admin
        .call(Method::GET, "/v1/keys?state=completed&limit=5", "")
        .await;
    assert_eq!(listed(completed), both);
    for empty in [
        "/v1/keys?state=pending",
        "/v1/keys?state=outcome-unknown",
        "/v1/keys?older_than=1h",
    ] {
        let reply = admin.call(Method::GET, empty, "").await;
        assert!(listed(reply).is_empty(), "{empty}");
    }
    let walked = admin.call(Method::GET, "/v1/keys", "").await.json();
    assert_eq!(walked["examined"], 2);
    assert_eq!(walked["next_cursor"], Value::Null, "the walk is over");
    for bad in [
        "/v1/keys?state=bogus",
        "/v1/keys?older_than=soon",
        "/v1/keys?limit=-1",
        "/v1/keys?colour=red",
        "/v1/keys?cursor=not-a-cursor",
    ] {
        let reply = admin.call(Method::GET, bad, "").await;
        reply.assert_problem(400, "invalid-list");
    }
}

#[tokio::test]
async fn a_key_is_completed_by_the_time_its_response_has_arrived() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.store.timeout = Duration::from_secs(2);
    c.idempotency.lease_margin = Duration::from_secs(9);
    let c = with_routes(c, Some(TOKEN));
    let proxy = TestProxy::start_with_store(c, Arc::new(SlowComplete::default())).await;
    let client = TestClient::new();
    let admin = Admin::bearer(&proxy);

    for (i, (target, status, len)) in [
        ("/v1/payments", 201u16, None),
        ("/v1/payments?body_bytes=100000", 201, Some(100_000usize)),
        ("/v1/payments?body_bytes=0", 201, Some(0)),
        ("/v1/payments?status=204", 204, Some(0)),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("arrived-{i}");
        let started = tokio::time::Instant::now();
        let first = post(&client, &proxy, target, &key, TENANT_A).await;
        let took = started.elapsed();
        assert_eq!(first.status, status, "{target}: {first:?}");
        assert!(!first.replayed());
        if let Some(len) = len {
            assert_eq!(first.body.len(), len, "{target}");
        }
        assert!(took >= SLOW_COMPLETE, "{target}: complete after {took:?}");

        let record = admin
            .lookup(
                json!({"key": key, "route": "payments", "headers": {"authorization": TENANT_A}}),
            )
            .await
            .json();
        assert_eq!(record["state"], "completed", "{target}: {record}");
        assert_eq!(record["status"], status);
        let retry = post(&client, &proxy, target, &key, TENANT_A).await;
        assert!(retry.replayed(), "{target}: {retry:?}");
        assert_eq!(retry.status, status);
        assert_eq!(retry.body, first.body, "{target}");
    }
    assert_eq!(upstream.executions("/v1/payments"), 4);
}

/// A completed record of `body` bytes written straight to `store`, under
/// a key made of `n`; its hash.
async fn stored_record(store: &dyn Store, n: u8, body: usize) -> String {
    use idemproxy::core::{Fingerprint, Outcome, StoredResponse};
    let key = RecordKey::from_bytes([n; 32]);
    let begin = Begin {
        key,
        fingerprint: Fingerprint([n; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        on_stale: idemproxy::store::OnStale::Store,
        token: FencingToken::random(),
        reconcile: false,
    };
    let BeginOutcome::Acquired { token, .. } = store.begin(&begin).await.expect("begin") else {
        panic!("{n}: not a free key");
    };
    let now = idemproxy::core::now_millis();
    let record = CompletedRecord {
        fingerprint: begin.fingerprint,
        created_at: now,
        completed_at: now,
        expires_at: now + 3_600_000,
        outcome: Outcome::Response(StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: vec![b'x'; body].into(),
        }),
    };
    store
        .complete(&key, token, &record)
        .await
        .expect("complete");
    key.to_hex()
}

/// The memory, embedded, Redis (at `redis_url`) and PostgreSQL (the
/// shared test server) stores, raw (no compression, no cache), each with a
/// proxy whose admin API lists it.
async fn listed_stores(
    upstream: &TestUpstream,
    dir: &std::path::Path,
    redis_url: &str,
) -> Vec<(&'static str, idemproxy::store::SharedStore, Config)> {
    let mut c = with_routes(config(&upstream.url()), Some(TOKEN));
    c.store.local_cache_entries = 0;
    let prefix = support::redis_server::unique_prefix("listing");
    let redis_c = support::proxy::redis_config(&upstream.url(), redis_url, &prefix);
    let redis = idemproxy::store::redis::open(&redis_c.store)
        .await
        .expect("redis");
    vec![
        ("memory", Arc::new(MemoryStore::new()) as _, c.clone()),
        (
            "embedded",
            Arc::new(idemproxy::store::EmbeddedStore::open(dir).expect("embedded")) as _,
            c.clone(),
        ),
        ("redis", redis, c.clone()),
        ("postgres", postgres_store().await, c),
    ]
}

/// A PostgreSQL store on the shared test server, tables of its own.
async fn postgres_store() -> idemproxy::store::SharedStore {
    let url = tokio::task::spawn_blocking(|| support::postgres_server::shared().url())
        .await
        .expect("the shared PostgreSQL starts");
    let prefix = support::postgres_server::unique_prefix("listing");
    let store = support::proxy::postgres_config("http://127.0.0.1:9", &url, &prefix).store;
    Arc::new(
        idemproxy::store::PostgresStore::connect(&store)
            .await
            .expect("postgres"),
    )
}

/// Follows `GET /v1/keys?limit=…` pages to the end; each page's hashes.
async fn pages(admin: &Admin, limit: usize) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/v1/keys?limit={limit}");
        if let Some(cursor) = &cursor {
            let encoded: String = form_urlencoded::byte_serialize(cursor.as_bytes()).collect();
            path.push_str(&format!("&cursor={encoded}"));
        }
        let reply = admin.call(Method::GET, &path, "").await;
        assert_eq!(reply.status, 200, "{reply:?}");
        let page = reply.json();
        pages.push(
            page["keys"]
                .as_array()
                .expect("keys")
                .iter()
                .map(|k| k["key_hash"].as_str().expect("a hash").to_owned())
                .collect(),
        );
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return pages,
        }
        assert!(pages.len() < 100, "the walk ends");
    }
}

/// `GET /v1/keys?limit=N` holds at most N keys per page, on every store,
/// and its `next_cursor` walks the rest: every key once. Before, a page
/// held a whole store page (up to 500) whatever the limit.
#[tokio::test]
async fn a_listing_page_holds_at_most_its_limit_and_the_cursor_walks_the_rest() {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = tokio::task::spawn_blocking(|| support::redis_server::shared().url())
        .await
        .expect("the shared Redis starts");
    for (kind, store, c) in listed_stores(&upstream, dir.path(), &shared).await {
        let mut all = Vec::new();
        for n in 1..=7 {
            all.push(stored_record(&*store, n, 10).await);
        }
        all.sort();
        let proxy = TestProxy::start_with_store(c, store).await;
        let admin = Admin::bearer(&proxy);
        for limit in [1, 3] {
            let pages = pages(&admin, limit).await;
            assert!(
                pages.iter().all(|page| page.len() <= limit),
                "{kind}, limit {limit}: {pages:?}"
            );
            assert!(pages.len() >= 7_usize.div_ceil(limit), "{kind}: {pages:?}");
            let mut walked: Vec<String> = pages.concat();
            walked.sort();
            assert_eq!(walked, all, "{kind}, limit {limit}: every key once");
        }
        proxy.shutdown().await;
    }
}

/// A listing reads records' metadata, never their stored responses: ten
/// records of 2 MB in Redis cost it a few hundred bytes each off the wire
/// (`GETRANGE`), not 20 MB (`GET`), PostgreSQL likewise (`substring`),
/// and the embedded store, which reads
/// whole values, stops a page once 4 MiB were read and goes on with a
/// cursor. Before, both read every body in full, and a page held all.
#[tokio::test]
async fn a_listing_reads_no_stored_response_and_is_bounded_by_bytes() {
    const BODY: usize = 2_000_000;
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    // A Redis of its own: the bytes it sends are this test's alone (other
    // tests use the shared one at the same time, in this process).
    let redis = tokio::task::spawn_blocking(support::redis_server::RedisServer::start)
        .await
        .expect("a private Redis starts");
    let redis = Arc::new(redis);
    for (kind, store, c) in listed_stores(&upstream, dir.path(), &redis.url()).await {
        if kind == "memory" {
            continue;
        }
        let mut all = Vec::new();
        for n in 1..=10 {
            all.push(stored_record(&*store, n, BODY).await);
        }
        all.sort();
        let proxy = TestProxy::start_with_store(c, store).await;
        let admin = Admin::bearer(&proxy);
        let sent = || async {
            let redis = redis.clone();
            tokio::task::spawn_blocking(move || redis.cli(&["INFO", "stats"]))
                .await
                .expect("redis-cli")
                .lines()
                .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
                .and_then(|n| n.trim().parse::<u64>().ok())
                .expect("total_net_output_bytes")
        };
        let before = sent().await;
        let listed = admin.call(Method::GET, "/v1/keys?limit=100", "").await;
        let after = sent().await;
        assert_eq!(listed.status, 200, "{listed:?}");
        let page = listed.json();
        let keys = page["keys"].as_array().expect("keys");
        assert!(
            keys.iter().all(|k| k["state"] == "completed"
                && k["outcome"] == "response"
                && k["status"] == 201),
            "{kind}: {page}"
        );
        match kind {
            "redis" => {
                assert_eq!(keys.len(), 10, "{page}");
                assert!(
                    after - before < 64 * 1024,
                    "redis sent {} bytes for a listing of 10 records",
                    after - before
                );
            }
            // Reads only the fronts (`substring`), as Redis does: one page.
            "postgres" => assert_eq!(keys.len(), 10, "{page}"),
            _ => {
                assert!(keys.len() <= 3, "{kind}: 4 MiB a page: {}", keys.len());
                assert!(page["next_cursor"].is_string(), "{kind}: {page}");
                let mut walked: Vec<String> = pages(&admin, 100).await.concat();
                walked.sort();
                assert_eq!(walked, all, "{kind}");
            }
        }
        proxy.shutdown().await;
    }
}

/// An observe-mode route keeps its records apart from enforced ones
/// (DESIGN §1 "Namespaces"); the operator's lookup by raw key must find
/// them there, not answer "no record" for a key the route has seen.
#[tokio::test]
async fn lookup_finds_the_record_of_an_observe_mode_route() {
    let upstream = TestUpstream::start().await;
    let mut c = with_routes(config(&upstream.url()), Some(TOKEN));
    c.routes = vec![
        RouteConfig {
            name: "observed".into(),
            path: "/v1/observed".into(),
            idempotency: idemproxy::config::IdempotencySettings {
                mode: idemproxy::config::Mode::Observe,
                ..c.idempotency.clone()
            },
            ..RouteConfig::default()
        },
        RouteConfig {
            name: "payments".into(),
            path: "/v1/payments".into(),
            idempotency: c.idempotency.clone(),
            ..RouteConfig::default()
        },
    ];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let done = post(&client, &proxy, "/v1/observed", "k-obs", TENANT_A).await;
    assert_eq!(done.status, 201, "{done:?}");

    let admin = Admin::bearer(&proxy);
    let lookup = |route: &str| json!({"key": "k-obs", "route": route, "headers": {"authorization": TENANT_A}});
    let found = admin.lookup(lookup("observed")).await;
    assert_eq!(found.status, 200, "{found:?}");
    assert_eq!(found.json()["state"], "completed", "{found:?}");
    // The same key looked up on the enforced route is another namespace.
    let absent = admin.lookup(lookup("payments")).await;
    absent.assert_problem(404, "key-not-found");
}
