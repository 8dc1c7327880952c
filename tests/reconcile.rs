//! Reconciliation (`reconcile_url`, DESIGN §1): a key whose outcome is
//! unknown (its holder died, or the upstream timed out) is looked up on
//! the upstream by the retry that takes it over. Found: the lookup's
//! answer is stored and replayed, marked `Idempotency-Reconciled`; absent:
//! the retry executes, once; anything else: `outcome-unknown`, nothing
//! executes. On the memory, embedded and Redis stores (in-process proxies,
//! behind the local replay cache), and with SIGKILL of a real binary
//! holding a request: the retry through another binary on Redis, and
//! through the restarted sidecar on the embedded store.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idemproxy::config::{Config, Protocol, ReconcileProof, RouteConfig};
use idemproxy::core::{Outcome, Record};
use idemproxy::store::{RedisStore, SharedStore, Store, StoreError};
use serde_json::{json, Value};
use support::binary::ProxyProcess;
use support::fault::killed_mid_call;
use support::faulty::{self, Fault, FaultyStore};
use support::keys;
use support::mcp::texts;
use support::postgres_server::{self, PostgresServer};
use support::proxy::{config, postgres_config, redis_config, Reply, TestClient, TestProxy};
use support::redis_server::{self, RedisServer};
use support::upstream::TestUpstream;
use tokio::task::JoinSet;
use tokio::time::Instant;

const BODY: &str = r#"{"amount":5}"#;

/// Where the tests' stores are.
#[derive(Clone, Copy)]
enum On<'a> {
    Memory,
    /// Each proxy on a file of its own under this directory.
    Embedded(&'a Path),
    Redis(&'a RedisServer),
}

impl std::fmt::Debug for On<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            On::Memory => "memory",
            On::Embedded(_) => "embedded",
            On::Redis(_) => "redis",
        })
    }
}

/// A proxy on `on` whose route looks keys up at `lookup` (a template).
async fn proxy(on: On<'_>, upstream: &TestUpstream, lookup: &str) -> TestProxy {
    proxy_with(on, upstream, lookup, |_| {}).await
}

async fn proxy_with(
    on: On<'_>,
    upstream: &TestUpstream,
    lookup: &str,
    tune: impl FnOnce(&mut Config),
) -> TestProxy {
    let mut c = match on {
        On::Redis(redis) => redis_config(
            &upstream.url(),
            &redis.url(),
            &redis_server::unique_prefix("reconcile"),
        ),
        _ => config(&upstream.url()),
    };
    c.idempotency.reconcile_url = lookup.to_owned();
    tune(&mut c);
    let store: SharedStore = match on {
        On::Memory => Arc::new(idemproxy::store::MemoryStore::new()),
        On::Embedded(dir) => {
            let file = dir.join(redis_server::unique_prefix("data"));
            Arc::new(idemproxy::store::EmbeddedStore::open(&file).expect("embedded"))
        }
        On::Redis(_) => Arc::new(RedisStore::connect(&c.store).await.expect("redis")),
    };
    // Behind the local replay cache, as `idemproxy` builds its store: it
    // must not answer an unknown outcome a lookup could resolve.
    let store = idemproxy::store::cache::wrap(store, c.store.local_cache_entries);
    TestProxy::start_with_store(c, store).await
}

fn assert_reconciled(reply: &Reply, upstream_path: &str) {
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(reply.replayed(), "{reply:?}");
    assert_eq!(
        reply.header("idempotency-reconciled"),
        Some("true"),
        "{reply:?}"
    );
    assert_eq!(
        reply.json()["path"],
        upstream_path,
        "the lookup's own answer"
    );
}

async fn a_stale_claim_found_by_the_lookup_is_stored_and_replayed(on: On<'_>) {
    let upstream = TestUpstream::start().await;
    let proxy = proxy(
        on,
        &upstream,
        "/lookup/{key}?status=200&header=idempotency-lookup:found",
    )
    .await;
    let client = TestClient::new();
    let (record_key, dead_holder) =
        keys::plant_stale_claim(&proxy.store, "/v1/orders", "stale/1", BODY.as_bytes()).await;

    let url = proxy.url("/v1/orders");
    let first = client.post_json(&url, "stale/1", BODY).await;
    assert_reconciled(&first, "/lookup/stale%2F1");
    // The dead holder, were it to come back, cannot overwrite the answer.
    let mut zombie = match proxy.store.get(&record_key).await.expect("store") {
        Some(Record::Completed(record)) => record,
        other => panic!("{on:?}: {other:?}"),
    };
    zombie.outcome = Outcome::NotStored { status: 500 };
    let late = proxy
        .store
        .complete(&record_key, dead_holder, &zombie)
        .await;
    assert!(matches!(late, Err(StoreError::Fenced)), "{on:?}: {late:?}");
    let again = client.post_json(&url, "stale/1", BODY).await;
    assert_reconciled(&again, "/lookup/stale%2F1");
    assert_eq!(again.body, first.body);
    assert_eq!(
        upstream.executions("/v1/orders"),
        0,
        "{on:?}: found, never executed"
    );
    assert_eq!(
        upstream.executions("/lookup/stale%2F1"),
        1,
        "{on:?}: one lookup"
    );
    let asked = upstream
        .last_headers("/lookup/stale%2F1")
        .expect("looked up");
    assert_eq!(
        asked.get("idempotency-key").map(|v| v.as_bytes()),
        Some(&b"stale/1"[..])
    );
    let metrics = client
        .send(http::Method::GET, &proxy.admin_url("/metrics"), &[], "")
        .await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains(r#"idemproxy_reconciled_total{route="default",result="found"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"idemproxy_expired_leases_total{route="default"} 1"#),
        "the dead holder is counted: {text}"
    );
}

async fn a_lookup_answering_404_lets_the_retry_execute_once(on: On<'_>) {
    let upstream = TestUpstream::start().await;
    let proxy = proxy(
        on,
        &upstream,
        "/lookup/{key}?status=404&header=idempotency-lookup:absent",
    )
    .await;
    let client = TestClient::new();
    keys::plant_stale_claim(&proxy.store, "/v1/orders", "stale-2", BODY.as_bytes()).await;

    let url = proxy.url("/v1/orders");
    let first = client.post_json(&url, "stale-2", BODY).await;
    assert_eq!(first.status, 201, "{on:?}: {first:?}");
    assert!(!first.replayed());
    assert_eq!(first.header("idempotency-reconciled"), None);
    let again = client.post_json(&url, "stale-2", BODY).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed());
    assert_eq!(
        upstream.executions("/v1/orders"),
        1,
        "{on:?}: executed once"
    );
    assert_eq!(upstream.executions("/lookup/stale-2"), 1);
}

async fn a_failed_lookup_leaves_outcome_unknown(on: On<'_>) {
    let upstream = TestUpstream::start().await;
    for (lookup, key) in [
        ("/lookup/{key}?status=500", "stale-500"),
        ("/lookup/{key}?status=409", "stale-409"),
        // No proof: a route the upstream lacks answers a bare 404 (or a
        // catch-all 200); the header on the wrong status is no proof
        // either (docs/guarantees.md, "The lookup protocol").
        ("/lookup/{key}?status=404", "stale-bare-404"),
        ("/lookup/{key}?status=200", "stale-bare-200"),
        (
            "/lookup/{key}?status=500&header=idempotency-lookup:absent",
            "stale-absent-500",
        ),
        (
            "/lookup/{key}?status=404&header=idempotency-lookup:found",
            "stale-found-404",
        ),
        (
            "/lookup/{key}?status=200&header=idempotency-lookup:maybe",
            "stale-maybe",
        ),
        ("/lookup/{key}?delay_ms=3000", "stale-slow"),
        ("/lookup/{header:x-missing}", "stale-missing"),
    ] {
        let proxy = proxy_with(on, &upstream, lookup, |c| {
            c.idempotency.reconcile_timeout = Duration::from_millis(300);
        })
        .await;
        let client = TestClient::new();
        keys::plant_stale_claim(&proxy.store, "/v1/orders", key, BODY.as_bytes()).await;
        for attempt in 1..=2 {
            let reply = client.post_json(&proxy.url("/v1/orders"), key, BODY).await;
            reply.assert_problem(502, "outcome-unknown");
            assert!(reply.replayed(), "{on:?} {lookup} #{attempt}: {reply:?}");
            assert_eq!(reply.header("idempotency-reconciled"), None);
        }
    }
    assert_eq!(
        upstream.executions("/v1/orders"),
        0,
        "{on:?}: nothing executes"
    );
}

async fn an_outcome_unknown_record_is_reconciled_once_its_lease_is_over(on: On<'_>) {
    let upstream = TestUpstream::start().await;
    // Lease: 300 ms upstream timeout + 1.4 s margin + 300 ms lookup.
    let proxy = proxy_with(
        on,
        &upstream,
        "/lookup/{json:/ref}?status=200&header=idempotency-lookup:found",
        |c| {
            c.upstream.timeout = Duration::from_millis(300);
            c.idempotency.lease_margin = Duration::from_millis(1400);
        },
    )
    .await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=1000");
    let body = r#"{"ref":"order/7"}"#;
    let headers = [
        ("idempotency-key", "late-1"),
        ("authorization", "Bearer alice"),
    ];
    let timed_out = client.post_json_with(&url, &headers, body).await;
    timed_out.assert_problem(504, "outcome-unknown");
    // The upstream may still be at work: the record stands, no lookup.
    let early = client.post_json_with(&url, &headers, body).await;
    early.assert_problem(504, "outcome-unknown");
    assert_eq!(upstream.executions("/lookup/order%2F7"), 0, "{on:?}");

    tokio::time::sleep(Duration::from_millis(2100)).await;
    let reconciled = client.post_json_with(&url, &headers, body).await;
    assert_reconciled(&reconciled, "/lookup/order%2F7");
    let again = client.post_json_with(&url, &headers, body).await;
    assert_reconciled(&again, "/lookup/order%2F7");
    assert_eq!(
        upstream.executions("/v1/orders"),
        1,
        "{on:?}: ran once, the first time"
    );
    assert_eq!(upstream.executions("/lookup/order%2F7"), 1);
    let asked = upstream
        .last_headers("/lookup/order%2F7")
        .expect("looked up");
    assert_eq!(
        asked.get("authorization").map(|v| v.as_bytes()),
        Some(&b"Bearer alice"[..]),
        "the request's own credentials"
    );
}

async fn concurrent_retries_make_one_lookup(on: On<'_>) {
    let upstream = TestUpstream::start().await;
    let proxy = proxy(
        on,
        &upstream,
        "/lookup/{key}?status=200&delay_ms=300&header=idempotency-lookup:found",
    )
    .await;
    keys::plant_stale_claim(&proxy.store, "/v1/orders", "stale-4", BODY.as_bytes()).await;
    let url = proxy.url("/v1/orders");
    let mut retries = JoinSet::new();
    for _ in 0..6 {
        let url = url.clone();
        retries.spawn(async move { TestClient::new().post_json(&url, "stale-4", BODY).await });
    }
    let mut statuses = Vec::new();
    while let Some(reply) = retries.join_next().await {
        statuses.push(reply.expect("retry").status.as_u16());
    }
    statuses.sort_unstable();
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 425),
        "{statuses:?}"
    );
    assert!(statuses.contains(&200), "{statuses:?}");
    assert_eq!(
        upstream.executions("/lookup/stale-4"),
        1,
        "{on:?}: {statuses:?}"
    );
    let after = TestClient::new().post_json(&url, "stale-4", BODY).await;
    assert_reconciled(&after, "/lookup/stale-4");
    assert_eq!(upstream.executions("/v1/orders"), 0);
}

/// One MCP route, `/mcp`, whose calls' lease is 2 s: 300 ms upstream
/// timeout + 1.4 s margin + 300 ms lookup.
fn short_mcp_lease(c: &mut Config) {
    c.upstream.timeout = Duration::from_millis(300);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.routes = vec![RouteConfig {
        name: "mcp".into(),
        path: "/mcp".into(),
        protocol: Protocol::Mcp,
        idempotency: c.idempotency.clone(),
    }];
}

/// A `tools/call` of `send_email` with `arguments`, JSON-RPC id `id`,
/// through the MCP route; the upstream holds its answer until `hold` is
/// released.
async fn call_tool(proxy: &TestProxy, id: u64, arguments: &Value, hold: &str) -> Reply {
    let call = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                      "params": {"name": "send_email", "arguments": arguments}});
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    let target = format!("/mcp?jsonrpc=result&hold={hold}");
    TestClient::new()
        .send(
            http::Method::POST,
            &proxy.url(&target),
            &headers,
            call.to_string(),
        )
        .await
}

/// MCP routes: the tool's arguments fill the template
/// (`{json:/params/arguments/...}`). A call whose answer was lost (the
/// server held it past the upstream timeout) is, once its lease is over,
/// looked up by the retry, which arrives under a new JSON-RPC id: found,
/// the retry gets a tool result holding the lookup's answer and saying
/// the action was not run again; absent, the retry runs it; a failed
/// lookup leaves the tool error that says the outcome is unknown.
async fn an_mcp_call_whose_answer_was_lost_is_reconciled_from_its_arguments(on: On<'_>) {
    let upstream = TestUpstream::start().await;
    let lookup = "/lookup/{json:/params/arguments/to}?status={json:/params/arguments/lookup}&header=idempotency-lookup:{json:/params/arguments/to}";
    let proxy = proxy_with(on, &upstream, lookup, short_mcp_lease).await;
    let cases = [("found", "200"), ("absent", "404"), ("failed", "500")];
    let arguments = |to: &str, status: &str| json!({"to": to, "lookup": status, "idempotency_key": format!("mcp-{to}")});
    for (to, status) in cases {
        let lost = call_tool(&proxy, 1, &arguments(to, status), "lost").await;
        let result = &lost.json()["result"];
        assert_eq!(result["isError"], true, "{on:?} {to}: {lost:?}");
        assert!(texts(result)
            .join(" ")
            .contains("may or may not have happened"));
    }
    upstream.release("lost");
    assert_eq!(upstream.executions("/mcp"), 3, "{on:?}: each ran once");
    tokio::time::sleep(Duration::from_millis(2100)).await;

    let found = call_tool(&proxy, 7, &arguments("found", "200"), "lost").await;
    assert!(found.replayed(), "{on:?}: {found:?}");
    assert_eq!(found.header("idempotency-reconciled"), Some("true"));
    let message = found.json();
    assert_eq!(message["id"], 7, "the retry's own id");
    let result = &message["result"];
    assert_eq!(result["isError"], false, "{message}");
    assert_eq!(result["structuredContent"]["path"], "/lookup/found");
    assert_eq!(result["_meta"]["io.idemproxy/reconciled"], true);
    assert!(
        texts(result).join(" ").contains("not run again"),
        "{message}"
    );
    let again = call_tool(&proxy, 8, &arguments("found", "200"), "lost").await;
    assert_eq!(again.header("idempotency-reconciled"), Some("true"));
    assert_eq!(
        again.json()["result"],
        message["result"],
        "stored, replayed"
    );
    let asked = upstream.last_headers("/lookup/found").expect("looked up");
    assert_eq!(
        asked.get("idempotency-key").map(|v| v.as_bytes()),
        Some(&b"mcp-found"[..]),
        "the key argument, as the lookup's Idempotency-Key"
    );

    let absent = call_tool(&proxy, 9, &arguments("absent", "404"), "lost").await;
    assert!(!absent.replayed(), "{on:?}: {absent:?}");
    assert_eq!(
        texts(&absent.json()["result"]),
        ["/mcp execution 4"],
        "{absent:?}"
    );
    let failed = call_tool(&proxy, 10, &arguments("failed", "500"), "lost").await;
    let result = &failed.json()["result"];
    assert_eq!(result["isError"], true, "{on:?}: {failed:?}");
    assert!(texts(result)
        .join(" ")
        .contains("may or may not have happened"));
    assert_eq!(failed.header("idempotency-reconciled"), None);

    assert_eq!(
        upstream.executions("/mcp"),
        4,
        "{on:?}: only the absent call ran again"
    );
    for to in ["found", "absent", "failed"] {
        let path = format!("/lookup/{to}");
        assert_eq!(upstream.executions(&path), 1, "{on:?}: {path}");
    }
}

/// The key API in process (`POST /v1/keys/reconcile`, what `keys
/// reconcile` calls) on an MCP route: the operator gives the call's body
/// for the template's `{json:...}`; found, the key holds a tool result
/// (not the lookup's raw response), which the next retry replays under
/// its own id. A call lacking a value the template names is 422 and a
/// key never used 404, both changing nothing.
#[tokio::test]
async fn the_key_api_reconciles_an_mcp_call_in_the_tool_results_form() {
    const TOKEN: &str = "reconcile-admin-token-7d1e5a90c2b4f386";
    let upstream = TestUpstream::start().await;
    let lookup = "/lookup/{json:/params/arguments/to}?status=200&header=idempotency-lookup:found";
    let proxy = proxy_with(On::Memory, &upstream, lookup, |c| {
        c.admin_token = Some(TOKEN.into());
        short_mcp_lease(c);
    })
    .await;
    let arguments = json!({"to": "bo", "idempotency_key": "mcp-admin-1"});
    let lost = call_tool(&proxy, 1, &arguments, "admin").await;
    assert_eq!(lost.json()["result"]["isError"], true, "{lost:?}");
    upstream.release("admin");
    tokio::time::sleep(Duration::from_millis(2100)).await;

    let admin = |body: Value| {
        let url = proxy.admin_url("/v1/keys/reconcile");
        async move {
            let auth = format!("Bearer {TOKEN}");
            let headers = [
                ("content-type", "application/json"),
                ("authorization", auth.as_str()),
            ];
            TestClient::new()
                .send(http::Method::POST, &url, &headers, body.to_string())
                .await
        }
    };
    let target = "/mcp?jsonrpc=result&hold=admin";
    let missing = admin(json!({"key": "mcp-admin-1", "route": "mcp", "path": target})).await;
    missing.assert_problem(422, "lookup-incomplete");
    let never = admin(json!({"key": "never-used", "route": "mcp", "path": target,
                             "body": {"params": {"arguments": {"to": "bo"}}}}))
    .await;
    never.assert_problem(404, "key-not-found");
    // The call as the operator tells it must be the key's: another
    // tool, other arguments, another target, or no call at all is
    // refused before anything is looked up or changed.
    let call = |name: &str, arguments: &Value| {
        json!({"jsonrpc": "2.0", "id": 99, "method": "tools/call",
               "params": {"name": name, "arguments": arguments}})
    };
    let other_arguments = json!({"to": "bo", "cc": "al", "idempotency_key": "mcp-admin-1"});
    for (path, body) in [
        (target, call("send_sms", &arguments)),
        (target, call("send_email", &other_arguments)),
        ("/mcp?jsonrpc=result", call("send_email", &arguments)),
        (
            target,
            json!({"params": {"name": "send_email", "arguments": arguments}}),
        ),
    ] {
        let refused =
            admin(json!({"key": "mcp-admin-1", "route": "mcp", "path": path, "body": body})).await;
        refused.assert_problem(409, "request-mismatch");
    }
    assert_eq!(
        upstream.executions("/lookup/bo"),
        0,
        "refused before a lookup"
    );

    let reconciled = admin(json!({"key": "mcp-admin-1", "route": "mcp", "path": target,
                                  "body": call("send_email", &arguments)}))
    .await;
    assert_eq!(reconciled.status, 200, "{reconciled:?}");
    let said = reconciled.json();
    assert_eq!(said["result"], "found", "{said}");
    assert_eq!(upstream.executions("/lookup/bo"), 1);

    let retry = call_tool(&proxy, 5, &arguments, "admin").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.header("idempotency-reconciled"), Some("true"));
    let message = retry.json();
    assert_eq!(message["id"], 5);
    assert_eq!(message["result"]["structuredContent"]["path"], "/lookup/bo");
    assert!(texts(&message["result"])
        .join(" ")
        .contains("not run again"));
    assert_eq!(upstream.executions("/mcp"), 1, "ran once, the first time");
    assert_eq!(upstream.executions("/lookup/bo"), 1, "looked up once");
}

/// `POST /v1/keys/reconcile` on a claim whose holder died (its lease
/// over, never settled): the operator's call takes it over as a retry
/// would, and the lookup's answer becomes the key's.
#[tokio::test]
async fn the_key_api_takes_over_a_stale_claim_to_reconcile_it() {
    const TOKEN: &str = "reconcile-admin-token-0b9c44e1d7a3f528";
    let upstream = TestUpstream::start().await;
    let proxy = proxy_with(
        On::Memory,
        &upstream,
        "/lookup/{key}?status=200&header=idempotency-lookup:found",
        |c| {
            c.admin_token = Some(TOKEN.into());
        },
    )
    .await;
    let (record_key, _) =
        keys::plant_stale_claim(&proxy.store, "/v1/orders", "stale-admin", BODY.as_bytes()).await;
    let auth = format!("Bearer {TOKEN}");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    let url = proxy.admin_url("/v1/keys/reconcile");
    let json_type = json!({"content-type": "application/json"});
    // Not the key's request: another body, path, method or content type
    // (so another fingerprint), or a body given twice. Refused; the key
    // keeps its stale claim, nothing is looked up.
    for (call, status, slug) in [
        (
            json!({"key": "stale-admin", "path": "/v1/orders", "headers": json_type,
                "body": {"amount": 6}}),
            409,
            "request-mismatch",
        ),
        (
            json!({"key": "stale-admin", "path": "/v1/orders/", "headers": json_type,
                "body": {"amount": 5}}),
            409,
            "request-mismatch",
        ),
        (
            json!({"key": "stale-admin", "path": "/v1/orders", "method": "PATCH",
                "headers": json_type, "body": {"amount": 5}}),
            409,
            "request-mismatch",
        ),
        (
            json!({"key": "stale-admin", "path": "/v1/orders", "body": {"amount": 5}}),
            409,
            "request-mismatch",
        ),
        (
            json!({"key": "stale-admin", "path": "/v1/orders", "headers": json_type,
                "body": {"amount": 5}, "body_text": BODY}),
            400,
            "invalid-lookup",
        ),
        (
            json!({"key": "stale-admin", "headers": json_type, "body": {"amount": 5}}),
            400,
            "invalid-lookup",
        ),
    ] {
        let refused = TestClient::new()
            .send(http::Method::POST, &url, &headers, call.to_string())
            .await;
        refused.assert_problem(status, slug);
    }
    assert_eq!(
        upstream.executions("/lookup/stale-admin"),
        0,
        "nothing looked up"
    );
    assert!(
        matches!(
            proxy.store.get(&record_key).await,
            Ok(Some(Record::Pending(_)))
        ),
        "the stale claim is as it was"
    );
    // The request as the client sent it; the JSON's spacing is the
    // canonical form's to ignore.
    let call = json!({"key": "stale-admin", "path": "/v1/orders", "headers": json_type,
                      "body_text": "{ \"amount\" : 5 }"});
    let reconciled = TestClient::new()
        .send(http::Method::POST, &url, &headers, call.to_string())
        .await;
    assert_eq!(reconciled.status, 200, "{reconciled:?}");
    assert_eq!(reconciled.json()["result"], "found", "{reconciled:?}");
    let retry = TestClient::new()
        .post_json(&proxy.url("/v1/orders"), "stale-admin", BODY)
        .await;
    assert_reconciled(&retry, "/lookup/stale-admin");
    assert_eq!(upstream.executions("/v1/orders"), 0);
    assert_eq!(upstream.executions("/lookup/stale-admin"), 1);
}

/// A retry that takes over an unknown outcome to reconcile it, whose
/// `begin` answers after `store.timeout` (503 to the client) but lands:
/// the claim is settled back to `outcome-unknown`, never released. Freed,
/// the next retry would execute with no lookup at all. The same for the
/// key API's claim (`keys reconcile`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_answers_late_writes_the_unknown_outcome_back() {
    const TOKEN: &str = "reconcile-admin-token-5e1b0c7d9a3f4826";
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.admin_token = Some(TOKEN.into());
    c.store.timeout = Duration::from_millis(200);
    c.idempotency.reconcile_url =
        "/lookup/{key}?status=404&header=idempotency-lookup:absent".into();
    let faulty = FaultyStore::new();
    let proxy = TestProxy::start_with_store(c, faulty.clone()).await;
    let url = proxy.url("/v1/orders");
    let (by_retry, _) =
        keys::plant_stale_claim(&proxy.store, "/v1/orders", "late-1", BODY.as_bytes()).await;
    let (by_admin, _) =
        keys::plant_stale_claim(&proxy.store, "/v1/orders", "late-2", BODY.as_bytes()).await;

    faulty.set(Fault::LateBegin);
    let retry = TestClient::new().post_json(&url, "late-1", BODY).await;
    retry.assert_problem(503, "store-unavailable");
    let auth = format!("Bearer {TOKEN}");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    let call = json!({"key": "late-2", "path": "/v1/orders", "body": json!({"amount": 5}),
                      "headers": {"content-type": "application/json"}});
    let admin = TestClient::new()
        .send(
            http::Method::POST,
            &proxy.admin_url("/v1/keys/reconcile"),
            &headers,
            call.to_string(),
        )
        .await;
    admin.assert_problem(503, "store-unavailable");
    // The late begins land, and are let go of.
    tokio::time::sleep(faulty::LATE * 2).await;
    faulty.set(Fault::None);

    for record_key in [by_retry, by_admin] {
        let settled = async {
            loop {
                match faulty.inner().get(&record_key).await.expect("memory store") {
                    Some(Record::Pending(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
                    other => return other,
                }
            }
        };
        let record = tokio::time::timeout(Duration::from_secs(5), settled).await;
        match record {
            Ok(Some(Record::Completed(done))) => {
                assert!(matches!(done.outcome, Outcome::Unknown { .. }), "{done:?}")
            }
            other => panic!("the unknown outcome was lost: {other:?}"),
        }
    }
    for key in ["late-1", "late-2"] {
        let again = TestClient::new().post_json(&url, key, BODY).await;
        again.assert_problem(502, "outcome-unknown");
    }
    assert_eq!(upstream.executions("/v1/orders"), 0, "nothing ran again");
}

/// The issue's reproduction, on a real PostgreSQL: a retry past the lease
/// takes over an `outcome-unknown` charge to reconcile it while the server
/// is frozen (SIGSTOP, 1 s); its `begin` answers long after `store.timeout`
/// (503, nothing executed) and lands. The claim is settled back to
/// `outcome-unknown`, not freed: the next retries get `outcome-unknown`,
/// then, past the lease, the ledger's answer, and the charge ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_held_up_by_a_frozen_postgres_is_not_freed() {
    let postgres = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let mut c = postgres_config(
        &upstream.url(),
        &postgres.url(),
        &postgres_server::unique_prefix("late_takeover"),
    );
    c.log.level = "info".into();
    // Lease: 300 ms upstream timeout + 1.4 s margin + 300 ms lookup.
    c.upstream.timeout = Duration::from_millis(300);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.idempotency.reconcile_url = "/ledger/{key}".into();
    let lease = Duration::from_millis(2000);
    let proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/charges?ledger=1&delay_ms=1000");

    let first = client.post_json(&url, "frozen-1", BODY).await;
    first.assert_problem(504, "outcome-unknown");
    tokio::time::sleep(lease + Duration::from_millis(100)).await;

    let frozen = tokio::task::block_in_place(|| postgres.suspend());
    let retry = client.post_json(&url, "frozen-1", BODY).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::block_in_place(|| drop(frozen));
    retry.assert_problem(503, "store-unavailable");

    // Until the lease of the claim let go of is over: outcome-unknown (or
    // 425 while the late claim is still held), never an execution.
    let until = Instant::now() + lease;
    while Instant::now() < until {
        let reply = client.post_json(&url, "frozen-1", BODY).await;
        assert!(
            matches!(reply.status.as_u16(), 425 | 502 | 503 | 504),
            "{reply:?}\n{}",
            proxy.logs()
        );
        assert_eq!(
            upstream.ledger("frozen-1").len(),
            1,
            "ran again:\n{}",
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let give_up = Instant::now() + lease * 3;
    let reconciled = loop {
        let reply = client.post_json(&url, "frozen-1", BODY).await;
        if reply.status == 200 || Instant::now() > give_up {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(reconciled.status, 200, "{reconciled:?}\n{}", proxy.logs());
    assert_eq!(reconciled.header("idempotency-reconciled"), Some("true"));
    assert_eq!(upstream.ledger("frozen-1").len(), 1, "ran once");
    assert!(
        proxy.logs().contains("back to outcome-unknown"),
        "the late claim was settled back: {}",
        proxy.logs()
    );
}

/// `reconcile_proof = "status"`, an operator's explicit choice for an
/// upstream that cannot send `Idempotency-Lookup`: the statuses alone
/// decide, as the lists say.
#[tokio::test]
async fn a_route_that_trusts_statuses_reads_a_bare_404_as_absent() {
    let upstream = TestUpstream::start().await;
    let proxy = proxy_with(On::Memory, &upstream, "/lookup/{key}?status=404", |c| {
        c.idempotency.reconcile_proof = ReconcileProof::Status;
    })
    .await;
    keys::plant_stale_claim(&proxy.store, "/v1/orders", "trusting", BODY.as_bytes()).await;
    let first = TestClient::new()
        .post_json(&proxy.url("/v1/orders"), "trusting", BODY)
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
    assert_eq!(upstream.executions("/lookup/trusting"), 1);
}

/// `{json:...}` looks up the value as the body wrote it: a 21-digit id
/// is not the nearest double (`1.2345678901234568e20`, another order,
/// whose 404 would have run the payment again).
#[tokio::test]
async fn a_large_json_number_is_looked_up_as_written() {
    let upstream = TestUpstream::start().await;
    let template = "/orders/{json:/order_id}?status=200&header=idempotency-lookup:found";
    let proxy = proxy(On::Memory, &upstream, template).await;
    let body = r#"{"order_id":123456789012345678901,"amount":12.50}"#;
    keys::plant_stale_claim(&proxy.store, "/v1/orders", "big-id", body.as_bytes()).await;
    let reply = TestClient::new()
        .post_json(&proxy.url("/v1/orders"), "big-id", body)
        .await;
    assert_reconciled(&reply, "/orders/123456789012345678901");
    assert_eq!(upstream.executions("/v1/orders"), 0);
}

/// A value that is no path segment (`..`, `.`, empty) means no lookup:
/// `/orders/..` is `/` to a normalizing router, whose 200 would be stored
/// as the payment's answer. The key fails closed as without a lookup,
/// and the upstream is asked nothing.
#[tokio::test]
async fn a_dot_or_empty_value_makes_no_lookup() {
    let upstream = TestUpstream::start().await;
    let template = "/orders/{json:/order_id}?status=200&header=idempotency-lookup:found";
    let proxy = proxy(On::Memory, &upstream, template).await;
    for (n, id) in ["..", ".", ""].into_iter().enumerate() {
        let key = format!("dots-{n}");
        let body = json!({ "order_id": id }).to_string();
        keys::plant_stale_claim(&proxy.store, "/v1/orders", &key, body.as_bytes()).await;
        let reply = TestClient::new()
            .post_json(&proxy.url("/v1/orders"), &key, &body)
            .await;
        reply.assert_problem(502, "outcome-unknown");
        assert_eq!(reply.header("idempotency-reconciled"), None, "{id:?}");
    }
    assert_eq!(upstream.total(), 0, "nothing looked up, nothing executed");
}

#[tokio::test]
async fn memory_a_stale_claim_found_by_the_lookup_is_stored_and_replayed() {
    a_stale_claim_found_by_the_lookup_is_stored_and_replayed(On::Memory).await;
}

#[tokio::test]
async fn memory_a_lookup_answering_404_lets_the_retry_execute_once() {
    a_lookup_answering_404_lets_the_retry_execute_once(On::Memory).await;
}

#[tokio::test]
async fn memory_a_failed_lookup_leaves_outcome_unknown() {
    a_failed_lookup_leaves_outcome_unknown(On::Memory).await;
}

#[tokio::test]
async fn memory_an_outcome_unknown_record_is_reconciled_once_its_lease_is_over() {
    an_outcome_unknown_record_is_reconciled_once_its_lease_is_over(On::Memory).await;
}

#[tokio::test]
async fn memory_concurrent_retries_make_one_lookup() {
    concurrent_retries_make_one_lookup(On::Memory).await;
}

#[tokio::test]
async fn memory_an_mcp_call_whose_answer_was_lost_is_reconciled_from_its_arguments() {
    an_mcp_call_whose_answer_was_lost_is_reconciled_from_its_arguments(On::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_reconciles_as_memory_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let on = On::Embedded(dir.path());
    a_stale_claim_found_by_the_lookup_is_stored_and_replayed(on).await;
    a_lookup_answering_404_lets_the_retry_execute_once(on).await;
    a_failed_lookup_leaves_outcome_unknown(on).await;
    an_outcome_unknown_record_is_reconciled_once_its_lease_is_over(on).await;
    concurrent_retries_make_one_lookup(on).await;
    an_mcp_call_whose_answer_was_lost_is_reconciled_from_its_arguments(on).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_reconciles_as_memory_does() {
    let redis = RedisServer::start();
    let on = On::Redis(&redis);
    a_stale_claim_found_by_the_lookup_is_stored_and_replayed(on).await;
    a_lookup_answering_404_lets_the_retry_execute_once(on).await;
    a_failed_lookup_leaves_outcome_unknown(on).await;
    an_outcome_unknown_record_is_reconciled_once_its_lease_is_over(on).await;
    concurrent_retries_make_one_lookup(on).await;
    an_mcp_call_whose_answer_was_lost_is_reconciled_from_its_arguments(on).await;
}

/// The issue's done-when: a proxy killed (SIGKILL) while the upstream
/// runs its request; the retry through another proxy on the same Redis,
/// once the lease is over, gets the upstream's answer from the lookup,
/// marked reconciled, and the upstream ran it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_mid_call_is_reconciled_through_another() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let prefix = redis_server::unique_prefix("reconcile-kill9");
    let mut c = redis_config(&upstream.url(), &redis.url(), &prefix);
    c.upstream.timeout = Duration::from_secs(2);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.idempotency.reconcile_timeout = Duration::from_millis(500);
    c.idempotency.reconcile_url =
        "/v1/charges/by-key/{key}?status=200&header=idempotency-lookup:found".into();
    let lease = Duration::from_millis(3900);
    let mut first = ProxyProcess::start(c.clone()).await;
    let second = ProxyProcess::start(c).await;
    let path = "/v1/charges?delay_ms=1500";
    let sent_at = killed_mid_call(&mut first, &upstream, path, "crash-1", BODY).await;
    reconciled_after_the_lease(&second, &upstream, path, sent_at + lease).await;
}

/// Retries of `crash-1`, whose proxy died mid-call, through `proxy`: one
/// before `lease_end` finds the dead proxy's claim in flight; the first
/// after it that is not 425 gets the lookup's answer, reconciled, as does
/// the next; the upstream ran the request once and was looked up once.
async fn reconciled_after_the_lease(
    proxy: &ProxyProcess,
    upstream: &TestUpstream,
    path: &str,
    lease_end: tokio::time::Instant,
) {
    let (client, url) = (TestClient::new(), proxy.url(path));
    let early = client.post_json(&url, "crash-1", BODY).await;
    early.assert_problem(425, "in-flight");
    tokio::time::sleep_until(lease_end).await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(3);
    let reconciled = loop {
        let reply = client.post_json(&url, "crash-1", BODY).await;
        if reply.status != 425 || tokio::time::Instant::now() > give_up {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_reconciled(&reconciled, "/v1/charges/by-key/crash-1");
    let again = client.post_json(&url, "crash-1", BODY).await;
    assert_reconciled(&again, "/v1/charges/by-key/crash-1");
    assert_eq!(upstream.executions("/v1/charges"), 1, "{}", proxy.logs());
    assert_eq!(upstream.executions("/v1/charges/by-key/crash-1"), 1);
}

/// The same on the embedded store: the sidecar killed mid-call restarts
/// on its file, and the retry after the lease is reconciled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_killed_on_the_embedded_store_is_reconciled_after_its_restart() {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = config(&upstream.url());
    c.store.kind = idemproxy::config::StoreKind::Embedded;
    c.store.path = dir.path().join("data");
    // The restart happens inside the lease: leave it room.
    c.upstream.timeout = Duration::from_secs(5);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.idempotency.reconcile_timeout = Duration::from_millis(500);
    c.idempotency.reconcile_url =
        "/v1/charges/by-key/{key}?status=200&header=idempotency-lookup:found".into();
    let lease = Duration::from_millis(6900);
    let mut first = ProxyProcess::start(c.clone()).await;
    let path = "/v1/charges?delay_ms=4000";
    let sent_at = killed_mid_call(&mut first, &upstream, path, "crash-1", BODY).await;
    let second = ProxyProcess::start(c).await;
    reconciled_after_the_lease(&second, &upstream, path, sent_at + lease).await;
}
