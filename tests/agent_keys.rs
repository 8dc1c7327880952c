//! Agents without keys (DESIGN §6): keys read from the body or a query
//! parameter (`key_from`), keys derived from the ids an agent stack
//! carries (`derive_key`), and the replay marker a tool wrapper can hand
//! the model (`replay_body_field`). Real proxy, real counting upstream.

use crate::support;

use http::Method;
use serde_json::json;
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::upstream::TestUpstream;

const PATH: &str = "/v1/tools/send_email";

async fn post(
    client: &TestClient,
    proxy: &TestProxy,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    client.post_json_with(&proxy.url(PATH), headers, body).await
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// An OpenAI-style tool call: the model's `tool_call_id` names the intent.
fn tool_call(id: &str, to: &str) -> String {
    json!({"tool_call_id": id, "name": "send_email", "arguments": {"to": to, "subject": "hi"}})
        .to_string()
}

#[tokio::test]
async fn a_tool_call_id_in_the_body_is_the_key() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.key_from = strings(&["header:idempotency-key", "json:/tool_call_id"]);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    let first = post(
        &client,
        &proxy,
        &[],
        &tool_call("call_abc", "ada@example.com"),
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    let again = post(
        &client,
        &proxy,
        &[],
        &tool_call("call_abc", "ada@example.com"),
    )
    .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    let reused = post(
        &client,
        &proxy,
        &[],
        &tool_call("call_abc", "eve@example.com"),
    )
    .await;
    reused.assert_problem(409, "key-reused");
    let next = post(
        &client,
        &proxy,
        &[],
        &tool_call("call_def", "ada@example.com"),
    )
    .await;
    assert_eq!(next.status, 201);
    assert!(!next.replayed());
    // A header, first in the list, still wins over the body.
    let headed = post(
        &client,
        &proxy,
        &[("idempotency-key", "h-1")],
        &tool_call("call_abc", "ada@example.com"),
    )
    .await;
    assert!(!headed.replayed(), "another key, another request");
    assert_eq!(upstream.executions(PATH), 3);
}

#[tokio::test]
async fn an_unusable_body_key_is_refused_naming_its_source() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.key_from = strings(&["json:/tool_call_id"]);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let long = "c".repeat(256);
    for id in [json!({"nested": 1}), json!(1.5), json!(long)] {
        let body = json!({"tool_call_id": id, "arguments": {}}).to_string();
        let reply = post(&client, &proxy, &[], &body).await;
        reply.assert_problem(400, "invalid-key");
        let detail = reply.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(detail.contains("`json:/tool_call_id`"), "{detail}");
    }
    // An integer is a key (its decimal text).
    let numbered = post(&client, &proxy, &[], r#"{"tool_call_id": 42}"#).await;
    assert_eq!(numbered.status, 201);
    assert!(post(&client, &proxy, &[], r#"{"tool_call_id": 42}"#)
        .await
        .replayed());
    assert_eq!(upstream.executions(PATH), 1);
}

#[tokio::test]
async fn a_query_parameter_can_carry_the_key() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.key_from = strings(&["query:request_id"]);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/jobs?request_id=job%2F7");
    let send = || client.send(Method::POST, &url, &[], "{}");
    assert_eq!(send().await.status, 201);
    assert!(send().await.replayed());
    assert_eq!(upstream.executions("/v1/jobs"), 1);
}

#[tokio::test]
async fn a_derived_key_is_the_run_and_the_tool_call() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.derive_key = strings(&["header:x-run-id", "json:/tool_call_id"]);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let call = |run: &'static str, id: &'static str| {
        let (client, proxy) = (&client, &proxy);
        async move {
            post(
                client,
                proxy,
                &[("x-run-id", run)],
                &tool_call(id, "ada@example.com"),
            )
            .await
        }
    };
    assert!(!call("run-1", "call_1").await.replayed());
    assert!(
        call("run-1", "call_1").await.replayed(),
        "the same pair replays"
    );
    assert!(!call("run-2", "call_1").await.replayed(), "another run");
    assert!(
        !call("run-1", "call_2").await.replayed(),
        "another tool call"
    );
    assert!(call("run-2", "call_1").await.replayed());
    assert_eq!(upstream.executions(PATH), 3);

    // Missing one attribute: no key, so (require_key = false) a plain
    // passthrough every time.
    let body = tool_call("call_1", "ada@example.com");
    for _ in 0..2 {
        let keyless = post(&client, &proxy, &[], &body).await;
        assert_eq!(keyless.status, 201);
        assert!(!keyless.replayed());
    }
    let no_call_id = r#"{"name": "send_email", "arguments": {}}"#;
    assert!(!post(&client, &proxy, &[("x-run-id", "run-1")], no_call_id)
        .await
        .replayed());
    assert!(!post(&client, &proxy, &[("x-run-id", "run-1")], no_call_id)
        .await
        .replayed());
    assert_eq!(upstream.executions(PATH), 7);
}

#[tokio::test]
async fn a_request_missing_a_derived_attribute_is_keyless_under_require_key() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.derive_key = strings(&["header:x-run-id", "json:/tool_call_id"]);
    c.idempotency.require_key = true;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let reply = post(&client, &proxy, &[], &tool_call("call_1", "a")).await;
    reply.assert_problem(400, "missing-key");
    let reply = post(
        &client,
        &proxy,
        &[("x-run-id", "r")],
        r#"{"arguments": {}}"#,
    )
    .await;
    reply.assert_problem(400, "missing-key");
    assert_eq!(upstream.executions(PATH), 0);
    let keyed = post(
        &client,
        &proxy,
        &[("x-run-id", "r")],
        &tool_call("call_1", "a"),
    )
    .await;
    assert_eq!(keyed.status, 201);
}

#[tokio::test]
async fn only_a_replayed_json_object_gains_the_replay_member() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.replay_body_field = "_idempotency".into();
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let key = [("idempotency-key", "marker-1")];

    let first = post(&client, &proxy, &key, "{}").await;
    assert_eq!(first.status, 201);
    assert!(
        first.json().get("_idempotency").is_none(),
        "not on the first answer"
    );
    let replay = post(&client, &proxy, &key, "{}").await;
    assert!(replay.replayed());
    let body = replay.json();
    assert_eq!(body["_idempotency"]["replayed"], true);
    let date = body["_idempotency"]["original_date"]
        .as_str()
        .expect("a date");
    assert!(humantime::parse_rfc3339(date).is_ok(), "{date}");
    assert_eq!(
        body["execution"],
        first.json()["execution"],
        "the rest is the original"
    );
    assert_eq!(
        replay.header("content-length"),
        Some(replay.body.len().to_string().as_str()),
        "Content-Length follows the body"
    );
    // The record is unchanged: the next replay is the same, not marked twice.
    let again = post(&client, &proxy, &key, "{}").await;
    assert_eq!(again.body, replay.body);

    // A body that is not JSON is replayed untouched.
    let bytes_url = proxy.url("/v1/files?body_bytes=100");
    let send = || {
        client.send(
            Method::POST,
            &bytes_url,
            &[("idempotency-key", "marker-2")],
            "{}",
        )
    };
    let original = send().await;
    let replayed = send().await;
    assert!(replayed.replayed());
    assert_eq!(replayed.body, original.body);
    assert_eq!(replayed.header("content-length"), Some("100"));
}

/// What Python's `json` reads and the proxy's JSON parser does not: the
/// upstream could find a key in these bodies that the proxy cannot.
const PYTHON_ONLY_BODIES: [&str; 6] = [
    r#"{"key": "k-1", "amount": NaN}"#,
    r#"{"key": "k-1", "amount": Infinity}"#,
    r#"{"key": "k-1", "amount": -Infinity}"#,
    r#"{"key": "k-1", "note": "\ud800"}"#,
    r#"{"key": "k-1", "note": "\udc00"}"#,
    r#"{"key": "k-1", "amount": 1e400}"#,
];

#[tokio::test]
async fn a_body_a_json_key_source_cannot_parse_is_refused_never_forwarded_keyless() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.key_from = strings(&["json:/key"]);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    for body in PYTHON_ONLY_BODIES {
        for _ in 0..2 {
            let reply = post(&client, &proxy, &[], body).await;
            reply.assert_problem(400, "invalid-body");
            assert_eq!(reply.header("x-should-retry"), Some("false"), "{body}");
            let detail = reply.json()["detail"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(detail.contains("`json:/key`"), "{body}: {detail}");
        }
    }
    // Not JSON at all, whatever the content type says: the key source
    // cannot tell whether the caller sent a key.
    let form = client
        .send(
            Method::POST,
            &proxy.url(PATH),
            &[("content-type", "application/x-www-form-urlencoded")],
            "key=k-1&amount=5",
        )
        .await;
    form.assert_problem(400, "invalid-body");
    assert_eq!(upstream.executions(PATH), 0, "nothing was forwarded");
    let metrics = client
        .send(Method::GET, &proxy.admin_url("/metrics"), &[], "")
        .await;
    let text = String::from_utf8_lossy(&metrics.body);
    let line = r#"idemproxy_requests_total{route="default",outcome="bad_body"} 13"#;
    assert!(text.lines().any(|l| l == line), "{text}");

    // An empty body holds no key for anyone: keyless, as before.
    let empty = client.send(Method::POST, &proxy.url(PATH), &[], "").await;
    assert_eq!(empty.status, 201, "{empty:?}");
    // A header listed first still decides before the body is read.
    let mut c = config(&upstream.url());
    c.idempotency.key_from = strings(&["header:idempotency-key", "json:/key"]);
    let headed = TestProxy::start(c).await;
    let nan = PYTHON_ONLY_BODIES[0];
    let sent = post(&client, &headed, &[("idempotency-key", "h-1")], nan).await;
    assert_eq!(sent.status, 201, "{sent:?}");
    assert!(post(&client, &headed, &[("idempotency-key", "h-1")], nan)
        .await
        .replayed());
    post(&client, &headed, &[], nan)
        .await
        .assert_problem(400, "invalid-body");
}

#[tokio::test]
async fn a_body_a_json_key_attribute_cannot_parse_is_refused() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.derive_key = strings(&["header:x-run-id", "json:/tool_call_id"]);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let run = [("x-run-id", "run-1")];
    for body in [
        r#"{"tool_call_id": "call_1", "arguments": {"n": NaN}}"#,
        r#"{"tool_call_id": "call_1", "arguments": {"s": "\udbff"}}"#,
    ] {
        post(&client, &proxy, &run, body)
            .await
            .assert_problem(400, "invalid-body");
    }
    assert_eq!(upstream.executions(PATH), 0);
    // Without the run id the derived key is absent whatever the body
    // holds: the head alone decides, as before.
    let keyless = post(&client, &proxy, &[], r#"{"n": NaN}"#).await;
    assert_eq!(keyless.status, 201, "{keyless:?}");
}

/// A key from a header needs no body: a body the proxy cannot parse is
/// fingerprinted as its bytes, so the same bytes replay and other bytes
/// are a mismatch, ignore pointers or not.
#[tokio::test]
async fn a_header_keyed_route_fingerprints_an_unparseable_body_as_its_bytes() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.fingerprint_ignore = strings(&["/sent_at"]);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let key = [("idempotency-key", "raw-1")];
    let body = r#"{"amount": NaN, "sent_at": 1}"#;
    assert_eq!(post(&client, &proxy, &key, body).await.status, 201);
    assert!(post(&client, &proxy, &key, body).await.replayed());
    // Only the ignored member differs, but the proxy cannot tell: raw bytes.
    post(&client, &proxy, &key, r#"{"amount": NaN, "sent_at": 2}"#)
        .await
        .assert_problem(409, "key-reused");
    post(
        &client,
        &proxy,
        &key,
        r#"{"amount": Infinity, "sent_at": 1}"#,
    )
    .await
    .assert_problem(409, "key-reused");
    // Re-serialized, it would be the same JSON; as bytes it is not.
    post(&client, &proxy, &key, r#"{"amount":NaN,"sent_at":1}"#)
        .await
        .assert_problem(409, "key-reused");
    assert_eq!(upstream.executions(PATH), 1);
}

/// Two routes deriving their keys from the same ids: the same run and step
/// on each are two actions, not one key reused.
#[tokio::test]
async fn the_same_derived_ids_on_two_routes_are_two_keys() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.derive_key = strings(&["header:x-run-id", "json:/tool_call_id"]);
    c.routes = ["email", "sms"]
        .into_iter()
        .map(|name| idemproxy::config::RouteConfig {
            name: name.into(),
            path: format!("/v1/{name}"),
            idempotency: c.idempotency.clone(),
            ..Default::default()
        })
        .collect();
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let run = [("x-run-id", "run-1")];
    let send = |path: &'static str, body: String| {
        let (client, url) = (&client, proxy.url(path));
        async move { client.post_json_with(&url, &run, &body).await }
    };
    let email = send("/v1/email", tool_call("step-1", "ada@example.com")).await;
    assert_eq!(email.status, 201, "{email:?}");
    let sms = send("/v1/sms", tool_call("step-1", "+15550100")).await;
    assert_eq!(sms.status, 201, "another route, another action: {sms:?}");
    assert!(!sms.replayed());
    // Each still replays its own.
    assert!(send("/v1/email", tool_call("step-1", "ada@example.com"))
        .await
        .replayed());
    assert!(send("/v1/sms", tool_call("step-1", "+15550100"))
        .await
        .replayed());
    assert_eq!(upstream.executions("/v1/email"), 1);
    assert_eq!(upstream.executions("/v1/sms"), 1);
}
