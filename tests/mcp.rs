//! `protocol = "mcp"` routes with the real thing (DESIGN §5): the real
//! binary in front of an unmodified MCP server from the official Python
//! SDK, driven by that SDK's own client. Every test checks what the
//! client saw and what the server says it executed.

use crate::support;

use idemproxy::config::{Config, IdempotencySettings, Protocol, RouteConfig};
use serde_json::{json, Value};
use support::binary::ProxyProcess;
use support::mcp::{run_client, texts, McpServer};
use support::proxy::{config, TestClient};

/// The protocol eras the client speaks: the sessionless one, and the
/// handshake one with `initialize` and `Mcp-Session-Id`.
const SESSIONLESS: &str = "2026-07-28";
const HANDSHAKE: &str = "2025-11-25";

/// The real binary with one MCP route at `/mcp` in front of `server`.
async fn proxy_for(server: &McpServer) -> ProxyProcess {
    ProxyProcess::start(mcp_config(server)).await
}

fn mcp_config(server: &McpServer) -> Config {
    let mut c = config(&server.url());
    c.upstream.timeout = std::time::Duration::from_secs(20);
    c.routes = vec![RouteConfig {
        name: "mcp".into(),
        path: "/mcp".into(),
        protocol: Protocol::Mcp,
        idempotency: c.idempotency.clone(),
    }];
    c
}

fn call(tool: &str, arguments: Value) -> Value {
    json!({"op": "call", "tool": tool, "arguments": arguments})
}

/// The result of scenario step `i`, which must not have failed.
fn result(steps: &[Value], i: usize) -> &Value {
    assert!(
        steps[i].get("error").is_none(),
        "step {i} failed: {}",
        steps[i]
    );
    &steps[i]["result"]
}

fn is_error(result: &Value) -> bool {
    result["isError"] == json!(true)
}

fn replayed(result: &Value) -> bool {
    result["_meta"]["io.idemproxy/replayed"] == json!(true)
}

const SEND: &str = "send_email";

fn email(key: &str) -> Value {
    json!({"to": "ada@example.com", "subject": "invoice", "body": "attached", "idempotency_key": key})
}

/// list → call → a NEW client (its JSON-RPC ids restart at 1) retries with
/// the arguments in another order: the first result comes back, marked,
/// and the tool ran once.
async fn exactly_once_across_clients(version: &str) {
    let server = McpServer::start(&[]).await;
    let proxy = proxy_for(&server).await;
    let url = proxy.url("/mcp");
    let first = run_client(
        &url,
        version,
        &json!([
            {"op": "list_tools"},
            call(SEND, email("order-17-mail")),
            {"op": "info"},
        ]),
    )
    .await;
    let tools = first[0]["tools"].as_array().expect("tools listed");
    let tool = |name: &str| {
        tools
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("{name} listed"))
    };
    let send = &tool(SEND)["inputSchema"];
    assert_eq!(send["properties"]["idempotency_key"]["type"], "string");
    assert!(
        send["required"]
            .as_array()
            .is_some_and(|r| r.contains(&json!("idempotency_key")) && r.contains(&json!("to"))),
        "the key argument is required beside the tool's own: {send}"
    );
    let weather = &tool("get_weather")["inputSchema"];
    assert!(
        weather["properties"].get("idempotency_key").is_none(),
        "a read-only tool is untouched: {weather}"
    );
    let original = result(&first, 1);
    assert!(!is_error(original) && !replayed(original), "{original}");
    assert_eq!(texts(original), ["sent email #1 to ada@example.com"]);
    assert_eq!(first[2]["protocol_version"], version);

    // A new process, a new session: the retry's id is 1 or 2 again.
    let retry = run_client(
        &url,
        version,
        &json!([call(
            SEND,
            json!({"idempotency_key": "order-17-mail", "body": "attached", "subject": "invoice", "to": "ada@example.com"})
        )]),
    )
    .await;
    let replay = result(&retry, 0);
    assert!(replayed(replay) && !is_error(replay), "{replay}");
    assert_eq!(replay["structuredContent"], original["structuredContent"]);
    let said = texts(replay);
    assert!(
        said[0].contains("already ran") && said[0].contains("not executed again"),
        "the model is told: {said:?}"
    );
    assert_eq!(said[1..], texts(original)[..]);
    assert_eq!(server.executions(SEND), 1, "{}", server.counts());
    server.assert_never_saw("idempotency_key");
}

#[tokio::test]
async fn a_sessionless_client_gets_one_execution_across_new_clients() {
    exactly_once_across_clients(SESSIONLESS).await;
}

#[tokio::test]
async fn a_session_client_gets_one_execution_across_new_clients() {
    exactly_once_across_clients(HANDSHAKE).await;
}

#[tokio::test]
async fn a_key_reused_with_other_arguments_is_a_tool_error_and_runs_nothing() {
    let server = McpServer::start(&["--json-response"]).await;
    let proxy = proxy_for(&server).await;
    let mut other = email("k-reused");
    other["to"] = json!("eve@example.com");
    let steps = run_client(
        &proxy.url("/mcp"),
        SESSIONLESS,
        &json!([call(SEND, email("k-reused")), call(SEND, other)]),
    )
    .await;
    assert!(!is_error(result(&steps, 0)));
    let refused = result(&steps, 1);
    assert!(is_error(refused), "{refused}");
    let said = texts(refused).join(" ");
    assert!(
        said.contains("different arguments") && said.contains("idempotency_key"),
        "{said}"
    );
    assert_eq!(server.executions(SEND), 1, "{}", server.counts());
    server.assert_never_saw("idempotency_key");
}

#[tokio::test]
async fn a_call_without_its_key_is_a_tool_error_naming_the_argument() {
    let server = McpServer::start(&[]).await;
    let proxy = proxy_for(&server).await;
    let steps = run_client(
        &proxy.url("/mcp"),
        HANDSHAKE,
        &json!([call(
            SEND,
            json!({"to": "ada@example.com", "subject": "s", "body": "b"})
        )]),
    )
    .await;
    let refused = result(&steps, 0);
    assert!(is_error(refused), "{refused}");
    let said = texts(refused).join(" ");
    assert!(said.contains("`idempotency_key`"), "{said}");
    assert_eq!(server.executions(SEND), 0);
    assert_eq!(
        server.counts()["methods"].get("tools/call"),
        None,
        "nothing was forwarded"
    );
}

#[tokio::test]
async fn a_read_only_tool_passes_through_unkeyed_every_time() {
    let server = McpServer::start(&[]).await;
    let proxy = proxy_for(&server).await;
    let weather = call("get_weather", json!({"city": "Oslo"}));
    let steps = run_client(
        &proxy.url("/mcp"),
        SESSIONLESS,
        &json!([{"op": "list_tools"}, weather, weather]),
    )
    .await;
    for i in [1, 2] {
        let answer = result(&steps, i);
        assert!(!is_error(answer) && !replayed(answer), "{answer}");
        assert_eq!(answer["structuredContent"]["city"], "Oslo");
    }
    assert_eq!(server.executions("get_weather"), 2);
    let logs = proxy
        .logs_when(|l| l.matches("outcome=\"passthrough\"").count() >= 3)
        .await;
    assert!(
        !logs.contains("outcome=\"executed\""),
        "nothing was keyed:\n{logs}"
    );
}

/// Two calls at the same instant on one client, and two client processes
/// started together: one execution each time, every caller gets it.
#[tokio::test]
async fn concurrent_duplicates_run_once_and_every_caller_gets_the_result() {
    let server = McpServer::start(&[]).await;
    let proxy = proxy_for(&server).await;
    let url = proxy.url("/mcp");
    let charge = |key: &str| {
        call(
            "charge_card",
            json!({"amount": 1250, "currency": "EUR", "delay_ms": 1500, "idempotency_key": key}),
        )
    };
    let same_client = run_client(
        &url,
        SESSIONLESS,
        &json!([{"op": "parallel", "steps": [charge("charge-a"), charge("charge-a")]}]),
    )
    .await;
    let pair = same_client[0]["results"].as_array().expect("two results");
    let (one, two) = (result(pair, 0), result(pair, 1));
    assert_eq!(one["structuredContent"]["charge_id"], "ch_1", "{one}");
    assert_eq!(two["structuredContent"], one["structuredContent"]);
    assert_eq!(
        [replayed(one), replayed(two)]
            .iter()
            .filter(|r| **r)
            .count(),
        1,
        "the waiter got the replay: {one} {two}"
    );
    assert_eq!(server.executions("charge_card"), 1);

    let scenario = json!([charge("charge-b")]);
    let (a, b) = tokio::join!(
        run_client(&url, SESSIONLESS, &scenario),
        run_client(&url, HANDSHAKE, &scenario)
    );
    let (a, b) = (result(&a, 0), result(&b, 0));
    assert_eq!(a["structuredContent"]["charge_id"], "ch_2", "{a}");
    assert_eq!(b["structuredContent"], a["structuredContent"]);
    assert_eq!(server.executions("charge_card"), 2, "{}", server.counts());
    server.assert_never_saw("idempotency_key");
}

/// The client gives up (a read timeout) while the tool runs: the call runs
/// to completion and the retry with the same key gets its result.
async fn a_client_that_leaves_mid_call_gets_the_result_on_retry(version: &str) {
    let server = McpServer::start(&[]).await;
    let proxy = proxy_for(&server).await;
    let url = proxy.url("/mcp");
    let charge =
        json!({"amount": 990, "currency": "USD", "delay_ms": 1500, "idempotency_key": "slow-1"});
    let gave_up = run_client(
        &url,
        version,
        &json!([{"op": "call", "tool": "charge_card", "arguments": charge, "timeout": 0.3}]),
    )
    .await;
    assert!(gave_up[0].get("error").is_some(), "{}", gave_up[0]);
    let retry = run_client(
        &url,
        version,
        &json!([{"op": "sleep", "ms": 1700}, call("charge_card", charge)]),
    )
    .await;
    let replay = result(&retry, 1);
    assert!(replayed(replay) && !is_error(replay), "{replay}");
    assert_eq!(replay["structuredContent"]["charge_id"], "ch_1");
    assert_eq!(
        server.counts()["completed"]["charge_card"],
        1,
        "{}",
        server.counts()
    );
    assert_eq!(server.executions("charge_card"), 1);
    if version == HANDSHAKE {
        // The client said so: its cancel stopped at the proxy.
        let logs = proxy.logs_when(|l| l.contains("held back")).await;
        assert!(
            logs.contains("a cancel of a protected call is held back"),
            "{logs}"
        );
        assert_eq!(
            server.counts()["methods"].get("notifications/cancelled"),
            None
        );
    }
}

#[tokio::test]
async fn a_sessionless_client_that_leaves_mid_call_gets_the_result_on_retry() {
    a_client_that_leaves_mid_call_gets_the_result_on_retry(SESSIONLESS).await;
}

#[tokio::test]
async fn a_session_client_that_cancels_mid_call_gets_the_result_on_retry() {
    a_client_that_leaves_mid_call_gets_the_result_on_retry(HANDSHAKE).await;
}

/// By hand, to see the wire: the first call is answered as an event
/// stream; each retry, under a new id, gets the stored result under that
/// id, framed as its `Accept` asks.
#[tokio::test]
async fn an_event_stream_answer_replays_under_the_new_requests_id() {
    let server = McpServer::start(&["--stateless"]).await;
    let proxy = proxy_for(&server).await;
    let client = TestClient::new();
    let post = |id: u64, accept: &'static str| {
        let body = json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": SEND, "arguments": email("raw-1")},
        });
        let url = proxy.url("/mcp");
        let client = &client;
        async move {
            client
                .send(
                    http::Method::POST,
                    &url,
                    &[
                        ("content-type", "application/json"),
                        ("accept", accept),
                        ("mcp-protocol-version", HANDSHAKE),
                    ],
                    body.to_string(),
                )
                .await
        }
    };
    let both = "application/json, text/event-stream";
    let first = post(7, both).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("content-type"), Some("text/event-stream"));
    let events = data_lines(&first.body);
    let answer = events.last().expect("an answering event");
    assert_eq!(answer["id"], 7);
    assert_eq!(answer["result"]["structuredContent"]["n"], 1);
    assert!(!first.replayed());

    let second = post(42, both).await;
    assert!(second.replayed());
    assert_eq!(second.header("content-type"), Some("application/json"));
    let message = second.json();
    assert_eq!(message["id"], 42);
    assert_eq!(
        message["result"]["structuredContent"],
        answer["result"]["structuredContent"]
    );
    assert!(replayed(&message["result"]));

    let third = post(43, "text/event-stream").await;
    assert!(third.replayed());
    assert_eq!(third.header("content-type"), Some("text/event-stream"));
    let events = data_lines(&third.body);
    assert_eq!(events.len(), 1, "one event");
    assert_eq!(events[0]["id"], 43);
    assert_eq!(
        events[0]["result"]["structuredContent"],
        answer["result"]["structuredContent"]
    );
    assert_eq!(server.executions(SEND), 1);
    server.assert_never_saw("idempotency_key");
}

/// The JSON messages in an event stream's `data:` lines.
fn data_lines(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .filter(|data| !data.trim().is_empty())
        .map(|data| serde_json::from_str(data.trim()).expect("data is JSON"))
        .collect()
}

/// `isError` results ran (stored, replayed); a JSON-RPC error means the
/// server did not run the tool (released: the retry runs).
#[tokio::test]
async fn a_tool_error_is_kept_and_a_protocol_error_releases_the_key() {
    let server = McpServer::start(&["--json-response"]).await;
    let proxy = proxy_for(&server).await;
    let failing =
        |mode: &str, key: &str| call("fail_tool", json!({"mode": mode, "idempotency_key": key}));
    let steps = run_client(
        &proxy.url("/mcp"),
        SESSIONLESS,
        &json!([
            failing("tool_error", "f-1"),
            failing("tool_error", "f-1"),
            failing("rpc_error", "f-2"),
            failing("rpc_error", "f-2"),
        ]),
    )
    .await;
    let (ran, again) = (result(&steps, 0), result(&steps, 1));
    assert!(is_error(ran) && !replayed(ran), "{ran}");
    assert!(is_error(again) && replayed(again), "{again}");
    assert!(texts(again)
        .iter()
        .any(|t| t.contains("fail_tool failed #1")));
    for i in [2, 3] {
        assert_eq!(steps[i]["error"]["code"], -32602, "{}", steps[i]);
    }
    assert_eq!(server.executions("fail_tool"), 3, "{}", server.counts());
}

/// What the route counts: each call under its tool once a listing named
/// it (before that, `(unlisted)`: the label is bounded by the listings, not
/// by what callers send), and batches apart, since they pass unprotected.
#[tokio::test]
async fn calls_are_counted_per_listed_tool_and_batches_apart() {
    let server = McpServer::start(&["--stateless", "--json-response"]).await;
    let proxy = proxy_for(&server).await;
    let client = TestClient::new();
    let url = proxy.url("/mcp");
    let post = |body: Value| {
        let (client, url) = (&client, &url);
        async move {
            client
                .send(
                    http::Method::POST,
                    url,
                    &[
                        ("content-type", "application/json"),
                        ("accept", "application/json, text/event-stream"),
                        ("mcp-protocol-version", HANDSHAKE),
                    ],
                    body.to_string(),
                )
                .await
        }
    };
    let send = |id: u64, key: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
               "params": {"name": SEND, "arguments": email(key)}})
    };
    // Never listed: protected all the same, counted as unlisted.
    let first = post(send(1, "m-1")).await;
    assert_eq!(first.json()["result"]["structuredContent"]["n"], 1);
    let listed = post(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})).await;
    assert_eq!(listed.status, 200);
    assert!(post(send(3, "m-2")).await.json()["result"]["isError"] == json!(false));
    assert!(post(send(4, "m-2")).await.replayed());
    let batch = post(json!([{"jsonrpc": "2.0", "id": 5, "method": "tools/list"}])).await;
    assert!(
        batch.status.is_success() || batch.status.is_client_error(),
        "the server's own answer to a batch comes back: {}",
        batch.status
    );

    let metrics = client
        .send(http::Method::GET, &proxy.admin_url("/metrics"), &[], "")
        .await;
    let text = String::from_utf8_lossy(&metrics.body);
    for line in [
        r#"idemproxy_mcp_tool_calls_total{route="mcp",tool="(unlisted)",outcome="executed"} 1"#,
        r#"idemproxy_mcp_tool_calls_total{route="mcp",tool="send_email",outcome="executed"} 1"#,
        r#"idemproxy_mcp_tool_calls_total{route="mcp",tool="send_email",outcome="replayed"} 1"#,
        r#"idemproxy_mcp_unprotected_batches_total{route="mcp"} 1"#,
    ] {
        assert!(text.contains(line), "{line} in:\n{text}");
    }
    assert_eq!(server.executions(SEND), 2);
    server.assert_never_saw("idempotency_key");
    let logs = proxy
        .logs_when(|l| l.matches("tool=\"send_email\"").count() >= 3)
        .await;
    assert_eq!(
        logs.matches("tool=\"send_email\"").count(),
        3,
        "each call's line names its tool:\n{logs}"
    );
}

/// Progress notifications before the answer reach the client as they come
/// (an SSE answer, relayed live); a replay has none: it is the result alone.
#[tokio::test]
async fn progress_streams_live_and_a_replay_is_the_result_alone() {
    let server = McpServer::start(&[]).await;
    let proxy = proxy_for(&server).await;
    let charge = json!({"op": "call", "tool": "charge_card", "progress": true,
        "arguments": {"amount": 5, "currency": "EUR", "delay_ms": 1200, "idempotency_key": "p-1"}});
    let steps = run_client(&proxy.url("/mcp"), HANDSHAKE, &json!([charge, charge])).await;
    let (first, again) = (&steps[0], &steps[1]);
    assert!(!replayed(result(&steps, 0)) && replayed(result(&steps, 1)));
    let progress = first["progress"].as_array().expect("progress recorded");
    assert!(progress.len() >= 2, "{first}");
    // Live: the first progress came well before the answer (1.2 s of work).
    let finished_at = progress.last().and_then(|p| p["t"].as_f64()).expect("t");
    let started_at = progress[0]["t"].as_f64().expect("t");
    assert!(finished_at - started_at >= 0.5, "{progress:?}");
    assert_eq!(again["progress"], json!([]), "{again}");
    assert_eq!(server.executions("charge_card"), 1);
}

/// 2026-07-28 headers that name another call than the body are refused
/// (400, JSON-RPC error) and nothing reaches the server.
#[tokio::test]
async fn mcp_headers_that_disagree_with_the_body_are_refused() {
    let server = McpServer::start(&["--json-response"]).await;
    let proxy = proxy_for(&server).await;
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": SEND, "arguments": email("h-1")}});
    let reply = TestClient::new()
        .send(
            http::Method::POST,
            &proxy.url("/mcp"),
            &[
                ("content-type", "application/json"),
                ("accept", "application/json, text/event-stream"),
                ("mcp-protocol-version", SESSIONLESS),
                ("mcp-method", "tools/call"),
                ("mcp-name", "get_weather"),
            ],
            body.to_string(),
        )
        .await;
    assert_eq!(reply.status, 400);
    let message = reply.json();
    assert_eq!(message["id"], 1);
    assert_eq!(message["error"]["code"], -32600);
    assert!(message["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("Mcp-Name")));
    assert_eq!(server.executions(SEND), 0);
    assert_eq!(server.counts()["methods"].get("tools/call"), None);
}

// ---------------------------------------------------------------------------
// Fail closed at every edge (issue 37), on the wire: the in-process proxy in
// front of the counting test upstream, which answers as an MCP server does
// (`jsonrpc=`) and keeps every request's bytes.
// ---------------------------------------------------------------------------

use support::proxy::{Reply, TestProxy};
use support::upstream::TestUpstream;

/// MCP routes in front of `upstream`: `/mcp` (a prefix that may front
/// several servers) and two routes of their own, `/mcp-a` and `/mcp-b`.
fn mcp_routes(upstream: &TestUpstream, max_response_bytes: Option<usize>) -> Config {
    let mut c = config(&upstream.url());
    c.routes = ["mcp", "mcp-a", "mcp-b"]
        .into_iter()
        .map(|name| RouteConfig {
            name: name.into(),
            path: format!("/{name}"),
            protocol: Protocol::Mcp,
            idempotency: IdempotencySettings {
                max_response_bytes: max_response_bytes.unwrap_or(c.idempotency.max_response_bytes),
                ..c.idempotency.clone()
            },
        })
        .collect();
    c
}

const MCP_HEADERS: [(&str, &str); 3] = [
    ("content-type", "application/json"),
    ("accept", "application/json, text/event-stream"),
    ("mcp-protocol-version", HANDSHAKE),
];

async fn post_raw(proxy: &TestProxy, target: &str, body: impl Into<bytes::Bytes>) -> Reply {
    TestClient::new()
        .send(http::Method::POST, &proxy.url(target), &MCP_HEADERS, body)
        .await
}

fn send_call(id: u64, arguments: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
           "params": {"name": SEND, "arguments": arguments}})
}

/// The JSON-RPC error of a refusal: 400, `code`, nothing forwarded.
fn assert_refused(reply: &Reply, code: i64) -> String {
    assert_eq!(reply.status, 400, "{reply:?}");
    let message = reply.json();
    assert_eq!(message["jsonrpc"], "2.0");
    assert_eq!(message["error"]["code"], code, "{message}");
    message["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// One key on two servers: behind one prefix (`/mcp/github`,
/// `/mcp/linear`) or on two routes. The second server's call is a key
/// reused, not executed, and never gets the first server's result.
#[tokio::test]
async fn one_key_on_two_mcp_servers_is_a_mismatch_never_the_other_servers_result() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, None)).await;
    for (first, second, key) in [
        ("/mcp/github", "/mcp/linear", "two-servers-1"),
        ("/mcp-a", "/mcp-b", "two-routes-1"),
    ] {
        let call = send_call(1, email(key));
        let ran = post_raw(&proxy, &format!("{first}?jsonrpc=result"), call.to_string()).await;
        let ran = ran.json();
        assert_eq!(
            texts(&ran["result"]),
            [format!("{first} execution 1")],
            "{ran}"
        );
        let other = post_raw(
            &proxy,
            &format!("{second}?jsonrpc=result"),
            call.to_string(),
        )
        .await;
        assert!(!other.replayed(), "{other:?}");
        let other = other.json()["result"].clone();
        assert!(is_error(&other), "{other}");
        let said = texts(&other).join(" ");
        assert!(said.contains("different arguments"), "{said}");
        assert!(!said.contains(first), "{said}");
        assert_eq!(upstream.executions(first), 1);
        assert_eq!(upstream.executions(second), 0, "the second server ran");
        // The first server's own retry is still a replay.
        let again = post_raw(&proxy, &format!("{first}?jsonrpc=result"), call.to_string()).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(upstream.executions(first), 1);
    }
}

/// What serde_json refuses and Python's `json` takes (`NaN`, `Infinity`,
/// lone surrogates) is refused with -32700, never forwarded, however often
/// it is sent.
#[tokio::test]
async fn a_call_body_that_is_not_json_is_refused_and_never_forwarded() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, None)).await;
    for value in ["NaN", "Infinity", "-Infinity", r#""\ud800""#] {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"send_email","arguments":{{"to":{value},"subject":"s","body":"b","idempotency_key":"nan-1"}}}}}}"#
        );
        for _ in 0..2 {
            let reply = post_raw(&proxy, "/mcp?jsonrpc=result", body.clone()).await;
            let why = assert_refused(&reply, -32700);
            assert_eq!(reply.json()["id"], Value::Null);
            assert!(why.contains("not JSON") && why.contains("NaN"), "{why}");
        }
    }
    assert_eq!(upstream.total(), 0, "nothing reached the server");
}

/// A `tools/call` the proxy cannot protect as sent is refused with -32600:
/// not JSON-RPC 2.0, no usable id, no tool name, arguments of another type,
/// a member given twice.
#[tokio::test]
async fn a_protected_call_in_an_odd_shape_is_refused_and_never_forwarded() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, None)).await;
    let arguments = r#"{"to":"a","subject":"s","body":"b","idempotency_key":"odd-1"}"#;
    for body in [
        format!(r#"{{"id":1,"method":"tools/call","params":{{"name":"send_email","arguments":{arguments}}}}}"#),
        format!(r#"{{"jsonrpc":"1.0","id":1,"method":"tools/call","params":{{"name":"send_email","arguments":{arguments}}}}}"#),
        format!(r#"{{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{{"name":"send_email","arguments":{arguments}}}}}"#),
        format!(r#"{{"jsonrpc":"2.0","method":"tools/call","params":{{"name":"send_email","arguments":{arguments}}}}}"#),
        format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"arguments":{arguments}}}}}"#),
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_email","arguments":["odd-1"]}}"#.to_owned(),
        format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"send_email","arguments":{arguments},"arguments":{{"to":"b"}}}}}}"#),
    ] {
        let reply = post_raw(&proxy, "/mcp?jsonrpc=result", body.clone()).await;
        let why = assert_refused(&reply, -32600);
        assert!(why.contains("not a valid JSON-RPC 2.0 request"), "{body}: {why}");
    }
    assert_eq!(upstream.total(), 0, "nothing reached the server");
}

/// A batch that carries a protected call, or a cancel of a protected call
/// still running, is refused; a batch of unprotected messages passes.
#[tokio::test]
async fn a_batch_with_a_protected_call_or_its_cancel_is_refused() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, None)).await;
    let batch = json!([
        {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
        send_call(2, email("batch-1")),
    ]);
    for _ in 0..2 {
        let reply = post_raw(&proxy, "/mcp?jsonrpc=result", batch.to_string()).await;
        let why = assert_refused(&reply, -32600);
        assert!(why.contains("send each call alone"), "{why}");
    }
    assert_eq!(upstream.total(), 0);

    // A protected call runs (held at the server) in session s1; a batch
    // with its cancel is refused, the call completes and is stored.
    let client = TestClient::new();
    let running = {
        let (client, url) = (
            client.clone(),
            proxy.url("/mcp?jsonrpc=result&hold=batch-2"),
        );
        tokio::spawn(async move {
            let mut headers = MCP_HEADERS.to_vec();
            headers.push(("mcp-session-id", "s1"));
            client
                .send(
                    http::Method::POST,
                    &url,
                    &headers,
                    send_call(7, email("batch-2")).to_string(),
                )
                .await
        })
    };
    assert!(
        upstream
            .wait_for_executions("/mcp", 1, std::time::Duration::from_secs(10))
            .await
    );
    let cancel = json!([{"jsonrpc": "2.0", "method": "notifications/cancelled",
                         "params": {"requestId": 7, "reason": "gave up"}}]);
    let mut headers = MCP_HEADERS.to_vec();
    headers.push(("mcp-session-id", "s1"));
    let reply = client
        .send(
            http::Method::POST,
            &proxy.url("/mcp?jsonrpc=result"),
            &headers,
            cancel.to_string(),
        )
        .await;
    assert_refused(&reply, -32600);
    upstream.release("batch-2");
    let ran = running.await.expect("the call's task");
    assert_eq!(texts(&ran.json()["result"]), ["/mcp execution 1"]);
    assert_eq!(
        upstream.executions("/mcp"),
        1,
        "the cancel never reached the server"
    );

    // Unprotected messages only: forwarded.
    let unprotected = json!([{"jsonrpc": "2.0", "method": "notifications/initialized"}]);
    let reply = post_raw(&proxy, "/mcp?jsonrpc=result", unprotected.to_string()).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(upstream.executions("/mcp"), 2);
}

/// The key argument and `params.idempotencyKey` are cut out of the bytes;
/// everything else reaches the server as the client wrote it.
#[tokio::test]
async fn a_forwarded_call_keeps_every_byte_but_the_key() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, None)).await;
    let sent = r#"{"method":"tools/call", "jsonrpc":"2.0","id":3,
  "params":{"name":"send_email","idempotencyKey":"ignored","arguments":{"z":123456789012345678901234567890,
    "idempotency_key" : "bytes-1", "amount":1.50,"to":"ada","nested":{"b":1,"a":[1e2,-0]}},"_meta":{"progressToken":"p"}}}"#;
    let want = r#"{"method":"tools/call", "jsonrpc":"2.0","id":3,
  "params":{"name":"send_email","arguments":{"z":123456789012345678901234567890, "amount":1.50,"to":"ada","nested":{"b":1,"a":[1e2,-0]}},"_meta":{"progressToken":"p"}}}"#;
    let reply = post_raw(&proxy, "/mcp?jsonrpc=result", sent).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let forwarded = upstream.last_body("/mcp").expect("forwarded");
    assert_eq!(String::from_utf8_lossy(&forwarded), want);
    let headers = upstream.last_headers("/mcp").expect("forwarded");
    assert_eq!(
        headers.get("content-length").and_then(|v| v.to_str().ok()),
        Some(want.len().to_string().as_str())
    );
}

/// A server that could not read the call answers a parse error with a null
/// id: it did not run the tool, so the key is released and the retry runs.
#[tokio::test]
async fn a_servers_parse_error_with_a_null_id_releases_the_key() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, None)).await;
    for (n, target) in [
        (1, "/mcp?jsonrpc=null_id_error"),
        (2, "/mcp?jsonrpc=null_id_error&sse=1"),
    ] {
        for attempt in 1..=2 {
            let call = send_call(attempt, email(&format!("null-id-{n}")));
            let reply = post_raw(&proxy, target, call.to_string()).await;
            assert!(!reply.replayed());
            assert!(
                String::from_utf8_lossy(&reply.body).contains("Parse error"),
                "the server's own answer: {reply:?}"
            );
        }
    }
    assert_eq!(
        upstream.executions("/mcp"),
        4,
        "every attempt reached the server"
    );
}

/// An answer over `max_response_bytes` reaches its first caller whole; the
/// key is kept as ran, result not stored, so the retry runs nothing.
#[tokio::test]
async fn an_answer_over_max_response_bytes_reaches_its_caller_and_is_not_stored() {
    const CAP: usize = 64 * 1024;
    const RESULT: usize = 300_000;
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, Some(CAP))).await;
    for (key, target) in [
        (
            "big-json",
            format!("/mcp/json?jsonrpc=result&result_bytes={RESULT}"),
        ),
        (
            "big-sse",
            format!("/mcp/sse?jsonrpc=result&sse=1&result_bytes={RESULT}"),
        ),
    ] {
        let call = send_call(1, email(key)).to_string();
        let first = post_raw(&proxy, &target, call.clone()).await;
        assert_eq!(first.status, 200);
        let message = match first.header("content-type") {
            Some("text/event-stream") => data_lines(&first.body).pop().expect("an event"),
            _ => first.json(),
        };
        let text = texts(&message["result"]).concat();
        assert_eq!(text.len(), RESULT, "{key}: the whole result");
        assert!(!is_error(&message["result"]), "{key}");

        let retry = post_raw(&proxy, &target, call).await;
        assert!(
            retry.replayed(),
            "{key}: {} {:?}",
            retry.status,
            retry.headers
        );
        let retry = retry.json()["result"].clone();
        // A replay of the whole result would be 300 kB of message.
        let shown: String = retry.to_string().chars().take(400).collect();
        assert!(is_error(&retry), "{key}: {shown}");
        assert!(
            texts(&retry).concat().contains("could not be"),
            "{key}: {shown}"
        );
    }
    assert_eq!(upstream.executions("/mcp/json"), 1);
    assert_eq!(upstream.executions("/mcp/sse"), 1);
}

/// A listing the proxy must rewrite and learn from is asked for without a
/// content coding, whatever the client accepts; so is a protected call.
#[tokio::test]
async fn a_listing_and_a_protected_call_ask_the_server_for_no_content_coding() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(mcp_routes(&upstream, None)).await;
    let mut headers = MCP_HEADERS.to_vec();
    headers.push(("accept-encoding", "gzip, br"));
    let client = TestClient::new();
    for (path, body) in [
        (
            "/mcp/list",
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
        ),
        ("/mcp/call", send_call(2, email("coding-1"))),
    ] {
        let url = proxy.url(&format!("{path}?jsonrpc=result"));
        let reply = client
            .send(http::Method::POST, &url, &headers, body.to_string())
            .await;
        assert_eq!(reply.status, 200, "{reply:?}");
        let seen = upstream.last_headers(path).expect("forwarded");
        assert_eq!(
            seen.get("accept-encoding").and_then(|v| v.to_str().ok()),
            Some("identity"),
            "{path}"
        );
    }
}

/// A listing seen by one proxy teaches every proxy on the same store: a
/// second proxy (a replica, or the first one restarted) lets a read-only
/// tool through without a key though no listing ever passed through it.
#[tokio::test]
async fn a_listing_learned_by_one_proxy_lets_read_only_tools_through_another() {
    let server = McpServer::start(&["--json-response"]).await;
    let store: idemproxy::store::SharedStore =
        std::sync::Arc::new(idemproxy::store::MemoryStore::new());
    let learner = TestProxy::start_with_store(mcp_config(&server), store.clone()).await;
    let listed = run_client(
        &learner.url("/mcp"),
        HANDSHAKE,
        &json!([{"op": "list_tools"}]),
    )
    .await;
    assert!(
        listed[0]["tools"].as_array().is_some_and(|t| !t.is_empty()),
        "{}",
        listed[0]
    );
    // The listing is shared in a task of its own: wait until it is there.
    let key = idemproxy::idempotency::mcp_catalog::shared_catalog_key("mcp");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while store.get(&key).await.ok().flatten().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the catalog was never shared"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }

    let other = TestProxy::start_with_store(mcp_config(&server), store).await;
    let weather = call("get_weather", json!({"city": "Oslo"}));
    let steps = run_client(&other.url("/mcp"), HANDSHAKE, &json!([weather, weather])).await;
    for i in [0, 1] {
        let answer = result(&steps, i);
        assert!(!is_error(answer) && !replayed(answer), "{answer}");
        assert_eq!(answer["structuredContent"]["city"], "Oslo");
    }
    assert_eq!(server.executions("get_weather"), 2);
    // A side-effecting tool of the listing is still protected there.
    let unlisted = run_client(
        &other.url("/mcp"),
        HANDSHAKE,
        &json!([call(SEND, json!({"to": "a", "subject": "s", "body": "b"}))]),
    )
    .await;
    assert!(is_error(result(&unlisted, 0)), "{}", unlisted[0]);
    assert_eq!(server.executions(SEND), 0);
}

/// A protected tool that declares the key argument itself would lose it
/// to the proxy: every listing that shows one says so in the log, once
/// per tool; a read-only tool's own argument is left alone.
#[tokio::test]
async fn a_protected_tool_with_its_own_key_argument_is_warned_about_per_listing() {
    let upstream = TestUpstream::start().await;
    let proxy = ProxyProcess::start(mcp_routes(&upstream, None)).await;
    let client = TestClient::new();
    let url = proxy.url("/mcp?jsonrpc=listing");
    for id in [1, 2] {
        let listing = json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"});
        let reply = client
            .send(http::Method::POST, &url, &MCP_HEADERS, listing.to_string())
            .await;
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    const WARNING: &str = "declares the key argument itself";
    let logs = proxy.logs_when(|l| l.matches(WARNING).count() >= 2).await;
    let warnings: Vec<&str> = logs.lines().filter(|l| l.contains(WARNING)).collect();
    assert_eq!(warnings.len(), 2, "one per listing:\n{logs}");
    assert!(
        warnings
            .iter()
            .all(|l| l.contains("send_email") && !l.contains("get_weather")),
        "{warnings:?}"
    );
}

/// The same across a restart, with two real processes one after the
/// other on one embedded store: the second never saw a listing, and lets
/// the read-only tool through without a key.
#[tokio::test]
async fn a_restarted_proxy_remembers_what_a_listing_taught() {
    let server = McpServer::start(&["--json-response"]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = mcp_config(&server);
    c.store.kind = idemproxy::config::StoreKind::Embedded;
    c.store.path = dir.path().join("data");
    let mut first = ProxyProcess::start(c.clone()).await;
    let listed = run_client(
        &first.url("/mcp"),
        HANDSHAKE,
        &json!([{"op": "list_tools"}]),
    )
    .await;
    assert!(
        listed[0]["tools"].as_array().is_some_and(|t| !t.is_empty()),
        "{}",
        listed[0]
    );
    // A graceful stop drains the task that shares the listing.
    first.terminate();
    assert!(first
        .wait_exit(std::time::Duration::from_secs(10))
        .await
        .success());

    let second = ProxyProcess::start(c).await;
    let weather = call("get_weather", json!({"city": "Oslo"}));
    let steps = run_client(&second.url("/mcp"), HANDSHAKE, &json!([weather])).await;
    let answer = result(&steps, 0);
    assert!(!is_error(answer), "{answer}");
    assert_eq!(answer["structuredContent"]["city"], "Oslo");
    assert_eq!(server.executions("get_weather"), 1);
}
