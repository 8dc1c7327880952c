//! A real OTLP/HTTP trace receiver for integration tests: what a collector
//! would get from the proxy, decoded.
//!
//! [`OtlpReceiver::start`] serves HTTP/1.1 and h2c on `127.0.0.1:0` and
//! accepts `POST /v1/traces` with an `application/x-protobuf`
//! `ExportTraceServiceRequest`, answering 200 with an empty
//! `ExportTraceServiceResponse`, as a collector does. Every span received is
//! kept, flattened out of its resource and scope, with the resource's
//! `service.name`. Anything else (another path or method, another content
//! type, a body that does not decode) is answered with an error and
//! remembered in [`OtlpReceiver::rejected`], so a test can assert that the
//! proxy sent nothing a collector would refuse. It stops when dropped.

#![allow(unreachable_pub)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode as SpanStatus;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// One span as the receiver got it.
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    /// The `service.name` attribute of the span's resource, if any.
    pub service_name: Option<String>,
    pub span: Span,
}

impl ReceivedSpan {
    pub fn name(&self) -> &str {
        &self.span.name
    }

    pub fn kind(&self) -> SpanKind {
        SpanKind::try_from(self.span.kind).unwrap_or(SpanKind::Unspecified)
    }

    /// The trace id, 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    /// The span id, 16 lowercase hex digits.
    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    /// The parent's span id, 16 lowercase hex digits; empty for a root.
    pub fn parent_span_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }

    /// The span's status code (`Unset` when it has no status).
    pub fn status(&self) -> SpanStatus {
        self.span
            .status
            .as_ref()
            .and_then(|s| SpanStatus::try_from(s.code).ok())
            .unwrap_or(SpanStatus::Unset)
    }

    /// The value of attribute `key`, if the span has it.
    pub fn attr(&self, key: &str) -> Option<&Value> {
        attribute(&self.span.attributes, key)
    }

    /// Attribute `key` as a string; `None` if absent or of another type.
    pub fn str_attr(&self, key: &str) -> Option<&str> {
        match self.attr(key) {
            Some(Value::StringValue(s)) => Some(s),
            _ => None,
        }
    }

    /// Attribute `key` as an integer; `None` if absent or of another type.
    pub fn int_attr(&self, key: &str) -> Option<i64> {
        match self.attr(key) {
            Some(Value::IntValue(i)) => Some(*i),
            _ => None,
        }
    }

    /// Attribute `key` as a bool; `None` if absent or of another type.
    pub fn bool_attr(&self, key: &str) -> Option<bool> {
        match self.attr(key) {
            Some(Value::BoolValue(b)) => Some(*b),
            _ => None,
        }
    }

    /// One line for failure messages: name, kind, ids, status, attributes.
    pub fn describe(&self) -> String {
        let mut line = format!(
            "{:?} {:?} trace={} span={} parent={} status={:?} service={:?}",
            self.name(),
            self.kind(),
            self.trace_id(),
            self.span_id(),
            self.parent_span_id(),
            self.status(),
            self.service_name.as_deref().unwrap_or("-"),
        );
        for kv in &self.span.attributes {
            let value = kv.value.as_ref().and_then(|v| v.value.as_ref());
            let _ = write!(line, " {}={:?}", kv.key, value);
        }
        line
    }
}

/// The spans in `spans` named `name` in trace `trace_id`.
pub fn named<'a>(spans: &'a [ReceivedSpan], trace_id: &str, name: &str) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|s| s.trace_id() == trace_id && s.name() == name)
        .collect()
}

/// The one span named `name` in trace `trace_id`; panics, listing what was
/// received, if there is none or more than one.
pub fn the_span<'a>(spans: &'a [ReceivedSpan], trace_id: &str, name: &str) -> &'a ReceivedSpan {
    match named(spans, trace_id, name).as_slice() {
        [one] => one,
        found => panic!(
            "expected one {name:?} span in trace {trace_id}, found {}; received:\n{}",
            found.len(),
            describe_all(spans)
        ),
    }
}

/// Every span of `spans`, one per line, for failure messages.
pub fn describe_all(spans: &[ReceivedSpan]) -> String {
    if spans.is_empty() {
        return "  (no spans)".to_owned();
    }
    spans
        .iter()
        .map(|s| format!("  {}", s.describe()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

#[derive(Default)]
struct Received {
    spans: Vec<ReceivedSpan>,
    /// Accepted export requests.
    exports: usize,
    /// Why each refused request was refused.
    rejected: Vec<String>,
}

struct State {
    received: Mutex<Received>,
    /// Bumped on every request, accepted or not, so waiters re-check.
    changes: watch::Sender<usize>,
}

impl State {
    fn received(&self) -> MutexGuard<'_, Received> {
        // A panicking test thread must not hide the spans from the others.
        self.received.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An OTLP/HTTP trace receiver; see the module documentation.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    state: Arc<State>,
    /// The accept loop; it owns every connection task, so aborting it (on
    /// drop) closes the listener and all connections.
    task: JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().expect("OTLP receiver address");
        let state = Arc::new(State {
            received: Mutex::new(Received::default()),
            changes: watch::channel(0).0,
        });
        let task = tokio::spawn(accept_loop(listener, state.clone()));
        OtlpReceiver { addr, state, task }
    }

    /// The base URL, `http://127.0.0.1:PORT`: what `telemetry.otlp_endpoint`
    /// takes (the exporter adds `/v1/traces`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far, in order of arrival.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.state.received().spans.clone()
    }

    /// How many export requests were accepted.
    pub fn exports(&self) -> usize {
        self.state.received().exports
    }

    /// Why each refused request was refused (empty if none was).
    pub fn rejected(&self) -> Vec<String> {
        self.state.received().rejected.clone()
    }

    /// Waits until `ready` holds for the spans received so far and returns
    /// them; panics after `within`, saying it waited for `what` and listing
    /// everything received (and refused).
    pub async fn wait_for(
        &self,
        what: &str,
        within: Duration,
        ready: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let mut changes = self.state.changes.subscribe();
        let waited = tokio::time::timeout(within, async {
            loop {
                // Marks the current version seen before checking, so a
                // change during the check wakes the next wait.
                changes.borrow_and_update();
                let spans = self.spans();
                if ready(&spans) {
                    return spans;
                }
                changes
                    .changed()
                    .await
                    .expect("the receiver's state outlives its waiters");
            }
        })
        .await;
        match waited {
            Ok(spans) => spans,
            Err(_) => panic!(
                "timed out after {within:?} waiting for {what}: {} export request(s) \
                 accepted, refused: {:?}; spans received:\n{}",
                self.exports(),
                self.rejected(),
                describe_all(&self.spans())
            ),
        }
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _peer)) = accepted else { continue };
                let state = state.clone();
                connections.spawn(async move {
                    let service = service_fn(move |req| handle(state.clone(), req));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let response = match receive(&state, req).await {
        Ok(()) => {
            let body = ExportTraceServiceResponse::default().encode_to_vec();
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/x-protobuf")
                .body(Full::new(Bytes::from(body)))
        }
        Err((status, why)) => {
            state.received().rejected.push(why.clone());
            Response::builder()
                .status(status)
                .header("content-type", "text/plain")
                .body(Full::new(Bytes::from(why)))
        }
    };
    state.changes.send_modify(|n| *n += 1);
    Ok(response.expect("the receiver's response builds"))
}

/// Decodes and keeps one export request, or says why it is refused.
async fn receive(state: &State, req: Request<Incoming>) -> Result<(), (StatusCode, String)> {
    let (parts, body) = req.into_parts();
    let target = format!("{} {}", parts.method, parts.uri);
    if parts.uri.path() != "/v1/traces" {
        return Err((StatusCode::NOT_FOUND, format!("{target}: not /v1/traces")));
    }
    if parts.method != Method::POST {
        return Err((
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{target}: not a POST"),
        ));
    }
    let content_type = parts
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if content_type != "application/x-protobuf" {
        return Err((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("{target}: content-type {content_type:?}, not application/x-protobuf"),
        ));
    }
    if let Some(encoding) = parts.headers.get("content-encoding") {
        if encoding != "identity" {
            return Err((
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("{target}: content-encoding {encoding:?} is not decoded here"),
            ));
        }
    }
    let body = body
        .collect()
        .await
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("{target}: body: {e}")))?
        .to_bytes();
    let export = ExportTraceServiceRequest::decode(body.as_ref()).map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!("{target}: not an ExportTraceServiceRequest ({e})"),
        )
    })?;
    let mut spans = Vec::new();
    for resource_spans in export.resource_spans {
        let service_name = resource_spans
            .resource
            .as_ref()
            .and_then(|r| attribute(&r.attributes, "service.name"))
            .and_then(|v| match v {
                Value::StringValue(s) => Some(s.clone()),
                _ => None,
            });
        for scope_spans in resource_spans.scope_spans {
            for span in scope_spans.spans {
                spans.push(ReceivedSpan {
                    service_name: service_name.clone(),
                    span,
                });
            }
        }
    }
    let mut received = state.received();
    received.exports += 1;
    received.spans.extend(spans);
    Ok(())
}
