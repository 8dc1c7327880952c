//! OpenTelemetry traces from the real binary, as a collector receives them
//! (OTLP/HTTP, protobuf, decoded by `support::otlp`): a request is one hop
//! in its caller's W3C trace (a SERVER span parented on the `traceparent`,
//! with the store calls and the upstream call as its children, and the
//! upstream call carrying the trace on); a replay is traced without an
//! upstream call; a request without a `traceparent` starts a trace; the
//! caller's sampling decision wins over `sample_ratio`, in both directions;
//! spans still batched at SIGTERM are sent before the process exits; a
//! collector that is down costs spans and a log line, never a request;
//! with telemetry off a `traceparent` is forwarded untouched; and
//! `idemproxy check` names a bad `[telemetry]` field.
//!
//! The proxy runs with `OTEL_BSP_SCHEDULE_DELAY=100` so batches leave
//! within a fraction of a second while it runs; every test that needs all
//! of them (in particular to say something was *not* exported) stops it
//! with SIGTERM first, which flushes the last batch before the process
//! exits.

use crate::support;

use std::process::Command;
use std::time::Duration;

use http::Method;
use idemproxy::config::{Config, RouteConfig};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode as SpanStatus;
use support::binary::{ProxyProcess, BIN};
use support::otlp::{describe_all, named, the_span, OtlpReceiver, ReceivedSpan};
use support::proxy::{config, TestClient};
use support::upstream::TestUpstream;

/// The `service.name` the traced proxies run under: not the default, so the
/// resource is seen to come from the configuration.
const SERVICE: &str = "idemproxy-traces-test";

/// How long spans get to reach the receiver while the proxy runs.
const ARRIVAL: Duration = Duration::from_secs(10);

/// How long a SIGTERM'd proxy gets to drain, flush its spans and exit.
const EXIT: Duration = Duration::from_secs(10);

/// A random trace id, 32 lowercase hex digits, never all zeros (invalid).
fn trace_id() -> String {
    format!("{:032x}", rand::random::<u128>().max(1))
}

/// A random span id, 16 lowercase hex digits, never all zeros (invalid).
fn span_id() -> String {
    format!("{:016x}", rand::random::<u64>().max(1))
}

/// A `traceparent` (version 00) for a caller's span.
fn traceparent(trace_id: &str, span_id: &str, sampled: bool) -> String {
    let flags = if sampled { "01" } else { "00" };
    format!("00-{trace_id}-{span_id}-{flags}")
}

/// The four fields of a version-00 `traceparent`: version, trace id, parent
/// id, flags; panics unless it is well formed.
fn parse_traceparent(value: &str) -> [String; 4] {
    let fields: Vec<&str> = value.split('-').collect();
    let lowercase_hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    assert!(
        fields.len() == 4
            && fields[0] == "00"
            && lowercase_hex(fields[1], 32)
            && lowercase_hex(fields[2], 16)
            && lowercase_hex(fields[3], 2),
        "not a version-00 traceparent: {value:?}"
    );
    assert_ne!(fields[1], "0".repeat(32), "all-zero trace id: {value:?}");
    assert_ne!(fields[2], "0".repeat(16), "all-zero parent id: {value:?}");
    fields
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>()
        .try_into()
        .expect("four fields")
}

/// The `traceparent` the upstream received with the last request to `path`.
fn upstream_traceparent(upstream: &TestUpstream, path: &str) -> String {
    let headers = upstream
        .last_headers(path)
        .unwrap_or_else(|| panic!("the upstream received no request to {path}"));
    let values: Vec<&str> = headers
        .get_all("traceparent")
        .iter()
        .map(|v| v.to_str().expect("traceparent is text"))
        .collect();
    match values.as_slice() {
        [one] => (*one).to_owned(),
        other => panic!("expected one traceparent at the upstream for {path}, got {other:?}"),
    }
}

/// The proxy in front of `upstream`, exporting to `receiver` as
/// [`SERVICE`], every new trace sampled.
fn traced_config(upstream: &TestUpstream, receiver: &OtlpReceiver) -> Config {
    let mut c = config(&upstream.url());
    c.telemetry.otlp_endpoint = Some(receiver.url());
    c.telemetry.service_name = SERVICE.into();
    c.telemetry.sample_ratio = 1.0;
    c.log.level = "warn".into();
    c
}

/// Starts the binary with `c`, its span batches sent every 100 ms.
async fn start_traced(c: Config) -> ProxyProcess {
    ProxyProcess::start_with_env(c, &[("OTEL_BSP_SCHEDULE_DELAY", "100".into())]).await
}

/// SIGTERM, then waits for a clean exit: by then the last batch of spans
/// has been exported (and answered), so the receiver holds everything.
async fn stop(proxy: &mut ProxyProcess) {
    proxy.terminate();
    let status = proxy.wait_exit(EXIT).await;
    assert!(status.success(), "exit status {status}:\n{}", proxy.logs());
}

/// The SERVER span of trace `trace_id` whose `url.path` is `path`, if any.
fn request_span<'a>(
    spans: &'a [ReceivedSpan],
    trace_id: &str,
    path: &str,
) -> Option<&'a ReceivedSpan> {
    spans.iter().find(|s| {
        s.trace_id() == trace_id
            && s.kind() == SpanKind::Server
            && s.str_attr("url.path") == Some(path)
    })
}

/// The first SERVER span, of any trace, whose `url.path` is `path`.
fn server_span<'a>(spans: &'a [ReceivedSpan], path: &str) -> Option<&'a ReceivedSpan> {
    spans
        .iter()
        .find(|s| s.kind() == SpanKind::Server && s.str_attr("url.path") == Some(path))
}

/// Waits until the request span of `trace` for `path`, and spans named
/// `children` in that trace, have arrived; returns every span received.
async fn wait_for_request(
    receiver: &OtlpReceiver,
    trace: &str,
    path: &str,
    children: &[&str],
) -> Vec<ReceivedSpan> {
    let what = format!("the request span for {path} and {children:?} in trace {trace}");
    receiver
        .wait_for(&what, ARRIVAL, |spans| {
            request_span(spans, trace, path).is_some()
                && children
                    .iter()
                    .all(|name| !named(spans, trace, name).is_empty())
        })
        .await
}

/// Asserts `child` is a CLIENT span directly under `parent`, in its trace.
fn assert_client_child(spans: &[ReceivedSpan], parent: &ReceivedSpan, child: &ReceivedSpan) {
    assert_eq!(
        child.trace_id(),
        parent.trace_id(),
        "{} is not in its request's trace:\n{}",
        child.name(),
        describe_all(spans)
    );
    assert_eq!(
        child.parent_span_id(),
        parent.span_id(),
        "{} is not a child of the request span:\n{}",
        child.name(),
        describe_all(spans)
    );
    assert_eq!(child.kind(), SpanKind::Client, "{}", child.describe());
    assert_eq!(child.service_name.as_deref(), Some(SERVICE));
}

/// Whether `hash` looks like the key's hash: 64 hex digits.
fn is_key_hash(hash: &str) -> bool {
    hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_hop_in_the_callers_trace() {
    let upstream = TestUpstream::start().await;
    let receiver = OtlpReceiver::start().await;
    let mut c = traced_config(&upstream, &receiver);
    c.routes = vec![RouteConfig {
        name: "payments".into(),
        path: "/v1/payments".into(),
        idempotency: c.idempotency.clone(),
        ..RouteConfig::default()
    }];
    let mut proxy = start_traced(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/payments");
    let body = r#"{"amount":42}"#;

    // The caller's span, sampled.
    let trace = trace_id();
    let caller = span_id();
    let first = client
        .post_json_with(
            &url,
            &[
                ("idempotency-key", "trace-order-1"),
                ("traceparent", &traceparent(&trace, &caller, true)),
                ("x-request-id", "trace-request-1"),
            ],
            body,
        )
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());

    let spans = wait_for_request(
        &receiver,
        &trace,
        "/v1/payments",
        &["store.begin", "store.complete", "upstream"],
    )
    .await;
    let request = the_span(&spans, &trace, "POST payments");
    assert_eq!(request.kind(), SpanKind::Server, "{}", request.describe());
    assert_eq!(
        request.parent_span_id(),
        caller,
        "the request span's parent is the caller's span:\n{}",
        describe_all(&spans)
    );
    assert_eq!(request.service_name.as_deref(), Some(SERVICE));
    assert_eq!(request.str_attr("http.request.method"), Some("POST"));
    assert_eq!(request.str_attr("url.path"), Some("/v1/payments"));
    assert_eq!(request.str_attr("idemproxy.route"), Some("payments"));
    assert_eq!(request.str_attr("idemproxy.outcome"), Some("executed"));
    assert_eq!(request.bool_attr("idemproxy.replayed"), Some(false));
    assert_eq!(request.int_attr("http.response.status_code"), Some(201));
    assert_eq!(
        request.str_attr("idemproxy.request_id"),
        Some("trace-request-1")
    );
    let key_hash = request
        .str_attr("idemproxy.key_hash")
        .unwrap_or_else(|| panic!("no key hash: {}", request.describe()))
        .to_owned();
    assert!(is_key_hash(&key_hash), "{}", request.describe());
    assert_ne!(
        request.status(),
        SpanStatus::Error,
        "{}",
        request.describe()
    );

    for (name, op) in [("store.begin", "begin"), ("store.complete", "complete")] {
        let store = the_span(&spans, &trace, name);
        assert_client_child(&spans, request, store);
        assert_eq!(
            store.str_attr("idemproxy.store.op"),
            Some(op),
            "{}",
            store.describe()
        );
    }
    let call = the_span(&spans, &trace, "upstream");
    assert_client_child(&spans, request, call);
    assert_eq!(call.str_attr("http.request.method"), Some("POST"));
    assert_eq!(
        call.str_attr("url.full"),
        Some(format!("{}/v1/payments", upstream.url()).as_str()),
        "{}",
        call.describe()
    );
    assert_eq!(call.int_attr("http.response.status_code"), Some(201));

    // The upstream's request is a child of the `upstream` span.
    let sent = upstream_traceparent(&upstream, "/v1/payments");
    assert_eq!(
        sent,
        format!("00-{trace}-{}-01", call.span_id()),
        "the upstream's traceparent names the upstream span:\n{}",
        describe_all(&spans)
    );

    // The retry, from another span of the caller (in a trace of its own,
    // to tell its spans apart): replayed, nothing sent upstream.
    let retry_trace = trace_id();
    let retry_caller = span_id();
    let retry = client
        .post_json_with(
            &url,
            &[
                ("idempotency-key", "trace-order-1"),
                (
                    "traceparent",
                    &traceparent(&retry_trace, &retry_caller, true),
                ),
                ("x-request-id", "trace-request-2"),
            ],
            body,
        )
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("/v1/payments"), 1);
    wait_for_request(&receiver, &retry_trace, "/v1/payments", &["store.begin"]).await;

    // Everything, flushed: the replay made no upstream call, and the first
    // request exactly one.
    stop(&mut proxy).await;
    let spans = receiver.spans();
    let replay = the_span(&spans, &retry_trace, "POST payments");
    assert_eq!(replay.kind(), SpanKind::Server, "{}", replay.describe());
    assert_eq!(
        replay.parent_span_id(),
        retry_caller,
        "{}",
        replay.describe()
    );
    assert_eq!(replay.str_attr("idemproxy.outcome"), Some("replayed"));
    assert_eq!(replay.bool_attr("idemproxy.replayed"), Some(true));
    assert_eq!(replay.int_attr("http.response.status_code"), Some(201));
    assert_eq!(
        replay.str_attr("idemproxy.request_id"),
        Some("trace-request-2")
    );
    assert_eq!(
        replay.str_attr("idemproxy.key_hash"),
        Some(key_hash.as_str()),
        "the same key, the same hash"
    );
    let begin = the_span(&spans, &retry_trace, "store.begin");
    assert_client_child(&spans, replay, begin);
    assert!(
        named(&spans, &retry_trace, "upstream").is_empty(),
        "a replay calls no upstream:\n{}",
        describe_all(&spans)
    );
    let calls: Vec<_> = spans.iter().filter(|s| s.name() == "upstream").collect();
    assert_eq!(calls.len(), 1, "{}", describe_all(&spans));
    assert!(
        spans
            .iter()
            .all(|s| s.service_name.as_deref() == Some(SERVICE)),
        "{}",
        describe_all(&spans)
    );
    assert_eq!(upstream.executions("/v1/payments"), 1);
    assert_eq!(receiver.rejected(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_traceparent_starts_a_trace() {
    let upstream = TestUpstream::start().await;
    let receiver = OtlpReceiver::start().await;
    let mut proxy = start_traced(traced_config(&upstream, &receiver)).await;
    let client = TestClient::new();

    let reply = client
        .post_json(&proxy.url("/v1/orders"), "trace-root-1", "{}")
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let spans = receiver
        .wait_for(
            "a request span for /v1/orders and an upstream span in its trace",
            ARRIVAL,
            |spans| {
                server_span(spans, "/v1/orders")
                    .is_some_and(|r| !named(spans, &r.trace_id(), "upstream").is_empty())
            },
        )
        .await;
    let request = server_span(&spans, "/v1/orders").expect("waited for it");
    let trace = request.trace_id();
    assert_eq!(
        request.parent_span_id(),
        "",
        "a new trace's request span is its root:\n{}",
        describe_all(&spans)
    );
    assert_ne!(trace, "0".repeat(32), "{}", request.describe());
    assert_eq!(request.name(), "POST default", "{}", request.describe());
    assert_eq!(request.str_attr("idemproxy.route"), Some("default"));
    assert_eq!(request.str_attr("idemproxy.outcome"), Some("executed"));
    assert_eq!(request.int_attr("http.response.status_code"), Some(201));
    let call = the_span(&spans, &trace, "upstream");
    assert_client_child(&spans, request, call);

    // The trace the proxy started is the one the upstream was told of.
    assert_eq!(
        upstream_traceparent(&upstream, "/v1/orders"),
        format!("00-{trace}-{}-01", call.span_id()),
        "{}",
        describe_all(&spans)
    );

    // An upstream 5xx makes the request span an error.
    let broken = client
        .send(Method::GET, &proxy.url("/v1/broken?status=500"), &[], "")
        .await;
    assert_eq!(broken.status, 500, "{broken:?}");
    let spans = receiver
        .wait_for("a request span for /v1/broken", ARRIVAL, |spans| {
            server_span(spans, "/v1/broken").is_some()
        })
        .await;
    let failed = server_span(&spans, "/v1/broken").expect("waited for it");
    assert_ne!(failed.trace_id(), trace, "a new request, a new trace");
    assert_eq!(failed.parent_span_id(), "", "{}", failed.describe());
    assert_eq!(failed.int_attr("http.response.status_code"), Some(500));
    assert_eq!(failed.status(), SpanStatus::Error, "{}", failed.describe());
    assert_eq!(failed.attr("idemproxy.key_hash"), None, "no key, no hash");
    let [_, sent_trace, _, _] = parse_traceparent(&upstream_traceparent(&upstream, "/v1/broken"));
    assert_eq!(sent_trace, failed.trace_id());
    // The upstream span's URL leaves the query out: callers put tokens there.
    let spans = receiver
        .wait_for("the upstream span for /v1/broken", ARRIVAL, |spans| {
            !named(spans, &sent_trace, "upstream").is_empty()
        })
        .await;
    let call = the_span(&spans, &sent_trace, "upstream");
    assert_eq!(
        call.str_attr("url.full"),
        Some(format!("{}/v1/broken", upstream.url()).as_str()),
        "{}",
        call.describe()
    );
    assert_eq!(call.int_attr("http.response.status_code"), Some(500));
    assert_eq!(call.status(), SpanStatus::Error, "{}", call.describe());

    stop(&mut proxy).await;
    assert_eq!(receiver.rejected(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_follows_the_caller() {
    let upstream = TestUpstream::start().await;
    let receiver = OtlpReceiver::start().await;
    let mut c = traced_config(&upstream, &receiver);
    c.telemetry.sample_ratio = 0.0;
    let mut proxy = start_traced(c).await;
    let client = TestClient::new();

    // The caller decided not to record: the proxy records nothing, and the
    // upstream gets the caller's trace and decision as they came.
    let unsampled = trace_id();
    let unsampled_parent = traceparent(&unsampled, &span_id(), false);
    let reply = client
        .post_json_with(
            &proxy.url("/v1/unsampled"),
            &[
                ("idempotency-key", "trace-unsampled"),
                ("traceparent", &unsampled_parent),
            ],
            "{}",
        )
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");

    // Neither does a new trace at ratio 0 get recorded.
    let reply = client
        .post_json(&proxy.url("/v1/unparented"), "trace-unparented", "{}")
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");

    // The caller decided to record: the proxy does, ratio 0 or not.
    let sampled = trace_id();
    let caller = span_id();
    let reply = client
        .post_json_with(
            &proxy.url("/v1/sampled"),
            &[
                ("idempotency-key", "trace-sampled"),
                ("traceparent", &traceparent(&sampled, &caller, true)),
            ],
            "{}",
        )
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let spans = wait_for_request(&receiver, &sampled, "/v1/sampled", &["upstream"]).await;
    let call = the_span(&spans, &sampled, "upstream");
    assert_eq!(
        upstream_traceparent(&upstream, "/v1/sampled"),
        format!("00-{sampled}-{}-01", call.span_id()),
        "{}",
        describe_all(&spans)
    );
    let sent = upstream_traceparent(&upstream, "/v1/unsampled");
    let [_, trace, _, flags] = parse_traceparent(&sent);
    assert_eq!(trace, unsampled, "the caller's trace: {sent:?}");
    assert_eq!(flags, "00", "not sampled: {sent:?}");
    assert_eq!(sent, unsampled_parent, "passed on as it came");
    // A new trace not sampled is not started at all.
    let unparented = upstream
        .last_headers("/v1/unparented")
        .expect("the upstream got /v1/unparented");
    assert_eq!(unparented.get("traceparent"), None, "{unparented:?}");

    // Everything, flushed: only the sampled trace is there.
    stop(&mut proxy).await;
    let spans = receiver.spans();
    let request = request_span(&spans, &sampled, "/v1/sampled").expect("waited for it");
    assert_eq!(request.parent_span_id(), caller, "{}", request.describe());
    assert!(
        spans.iter().all(|s| s.trace_id() == sampled),
        "only trace {sampled} was sampled (not {unsampled}, nor a new one):\n{}",
        describe_all(&spans)
    );
    assert_eq!(receiver.rejected(), Vec::<String>::new());
}

/// Spans still batched when the proxy is told to stop leave before it
/// exits: the batch schedule is set to ten minutes, so only the flush at
/// shutdown can send them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_batched_at_shutdown_are_sent_before_exit() {
    let upstream = TestUpstream::start().await;
    let receiver = OtlpReceiver::start().await;
    let mut proxy = ProxyProcess::start_with_env(
        traced_config(&upstream, &receiver),
        &[("OTEL_BSP_SCHEDULE_DELAY", "600000".into())],
    )
    .await;
    let reply = TestClient::new()
        .post_json(&proxy.url("/v1/flushed"), "trace-flush-1", "{}")
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(receiver.exports(), 0, "nothing leaves before the stop");

    stop(&mut proxy).await;
    let spans = receiver.spans();
    let request = server_span(&spans, "/v1/flushed")
        .unwrap_or_else(|| panic!("not sent at shutdown:\n{}", describe_all(&spans)));
    let trace = request.trace_id();
    for name in ["store.begin", "upstream", "store.complete"] {
        assert_client_child(&spans, request, the_span(&spans, &trace, name));
    }
    assert_eq!(receiver.rejected(), Vec::<String>::new());
}

/// A collector that is not there costs the spans, never a request, and
/// the operator reads why in the log (the SDK's own error, per batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_costs_spans_never_a_request() {
    let upstream = TestUpstream::start().await;
    // A port bound but not listening, held for the whole test: connecting
    // is refused at once. A port merely freed could be taken by another
    // test's server, and an export to one that never answers fails only
    // after its 10 s limit, past the wait for the log below.
    let refusing =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
    refusing
        .bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .expect("a free port");
    let gone = refusing
        .local_addr()
        .ok()
        .and_then(|address| address.as_socket())
        .expect("its address");
    let mut c = config(&upstream.url());
    c.telemetry.otlp_endpoint = Some(format!("http://{gone}"));
    c.log.level = "warn".into();
    let mut proxy = start_traced(c).await;
    let client = TestClient::new();
    for n in 0..5 {
        let reply = client
            .post_json(&proxy.url("/v1/untraced"), &format!("trace-gone-{n}"), "{}")
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    assert_eq!(upstream.executions("/v1/untraced"), 5);
    let logs = proxy
        .logs_when(|logs| logs.contains("BatchSpanProcessor.ExportError"))
        .await;
    assert!(
        logs.contains("BatchSpanProcessor.ExportError"),
        "no word of the failed export:\n{logs}"
    );
    stop(&mut proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_off_forwards_traceparent_untouched() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.log.level = "warn".into();
    assert_eq!(c.telemetry.otlp_endpoint, None, "telemetry is off");
    let mut proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();

    let parent = traceparent(&trace_id(), &span_id(), true);
    let state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
    let reply = client
        .post_json_with(
            &proxy.url("/v1/untraced"),
            &[
                ("idempotency-key", "trace-off-1"),
                ("traceparent", &parent),
                ("tracestate", state),
            ],
            "{}",
        )
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(upstream_traceparent(&upstream, "/v1/untraced"), parent);
    let headers = upstream.last_headers("/v1/untraced").expect("recorded");
    assert_eq!(
        headers.get("tracestate").and_then(|v| v.to_str().ok()),
        Some(state)
    );
    stop(&mut proxy).await;
}

#[test]
fn check_names_a_bad_telemetry_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("idemproxy.toml");
    let check = |text: &str| {
        std::fs::write(&file, text).expect("write the config file");
        let mut cmd = Command::new(BIN);
        for (name, _) in std::env::vars() {
            if name.starts_with("IDEMPROXY_") {
                cmd.env_remove(name);
            }
        }
        let out = cmd
            .arg("check")
            .arg("--config")
            .arg(&file)
            .output()
            .expect("run idemproxy check");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status, stdout, stderr)
    };

    for (text, field) in [
        (
            "[telemetry]\notlp_endpoint = \"not a url\"\n",
            "telemetry.otlp_endpoint",
        ),
        (
            "[telemetry]\notlp_endpoint = \"grpc://collector:4317\"\n",
            "telemetry.otlp_endpoint",
        ),
        (
            "[telemetry]\nsample_ratio = 2.0\n",
            "telemetry.sample_ratio",
        ),
        (
            "[telemetry]\nsample_ratio = -0.5\n",
            "telemetry.sample_ratio",
        ),
    ] {
        let (status, stdout, stderr) = check(text);
        assert_eq!(status.code(), Some(2), "{text:?}:\n{stdout}{stderr}");
        assert!(stderr.contains(field), "{text:?}: {stderr}");
        assert!(stdout.is_empty(), "{text:?}: nothing printed: {stdout}");
    }

    // A good one is taken as written.
    let (status, stdout, stderr) = check(
        "[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\n\
         service_name = \"checkout-proxy\"\nsample_ratio = 0.25\n",
    );
    assert!(status.success(), "{status}:\n{stderr}");
    let printed: Config = toml::from_str(&stdout).unwrap_or_else(|e| panic!("{e}\n{stdout}"));
    assert_eq!(
        printed.telemetry.otlp_endpoint.as_deref(),
        Some("http://127.0.0.1:4318")
    );
    assert_eq!(printed.telemetry.service_name, "checkout-proxy");
    assert_eq!(printed.telemetry.sample_ratio, 0.25);
}

/// A retry that reconciles an unknown outcome (`reconcile_url`) has a
/// `reconcile` span under its request span, saying what the lookup found,
/// and the lookup's own upstream call under that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_lookup_is_a_span_of_the_retry() {
    let upstream = TestUpstream::start().await;
    let receiver = OtlpReceiver::start().await;
    let mut c = traced_config(&upstream, &receiver);
    // Lease: 300 ms upstream timeout + 1.4 s margin + 300 ms lookup.
    c.upstream.timeout = Duration::from_millis(300);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.idempotency.reconcile_url = "/lookup/{key}?status=200&header=idempotency-lookup:found".into();
    c.routes = vec![RouteConfig {
        name: "orders".into(),
        path: "/v1/orders".into(),
        idempotency: c.idempotency.clone(),
        ..RouteConfig::default()
    }];
    let mut proxy = start_traced(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=1000");
    let key = ("idempotency-key", "trace-reconcile-1");
    let timed_out = client.post_json_with(&url, &[key], "{}").await;
    timed_out.assert_problem(504, "outcome-unknown");
    tokio::time::sleep(Duration::from_millis(2100)).await;

    let trace = trace_id();
    let parent = ("traceparent", traceparent(&trace, &span_id(), true));
    let retry = client
        .post_json_with(&url, &[key, (parent.0, &parent.1)], "{}")
        .await;
    assert_eq!(
        retry.header("idempotency-reconciled"),
        Some("true"),
        "{retry:?}"
    );
    let spans = wait_for_request(&receiver, &trace, "/v1/orders", &["reconcile", "upstream"]).await;
    let request = the_span(&spans, &trace, "POST orders");
    let reconcile = the_span(&spans, &trace, "reconcile");
    assert_eq!(
        reconcile.parent_span_id(),
        request.span_id(),
        "{}",
        describe_all(&spans)
    );
    assert_eq!(
        reconcile.str_attr("idemproxy.reconcile.result"),
        Some("found"),
        "{}",
        reconcile.describe()
    );
    assert_eq!(reconcile.int_attr("http.response.status_code"), Some(200));
    let lookup = the_span(&spans, &trace, "upstream");
    assert_eq!(
        lookup.parent_span_id(),
        reconcile.span_id(),
        "the lookup's call is the reconcile span's child:\n{}",
        describe_all(&spans)
    );
    assert_eq!(
        upstream.executions("/v1/orders"),
        1,
        "ran once, the first time"
    );
    stop(&mut proxy).await;
}
