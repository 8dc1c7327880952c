//! Request traces: a span per request, a child per store call and per
//! upstream call, and W3C trace context in and out, so the proxy is one hop
//! in its caller's trace.
//!
//! The spans are `tracing` spans at the [`TARGET`] target, which only the
//! OpenTelemetry layer ([`super::otlp`]) enables: the log lines never see
//! them. With traces off no layer enables the target, each span macro is a
//! disabled callsite (one load and a branch), and nothing here allocates,
//! formats or reads a header.
//!
//! Parentage follows the task: the request span is entered whenever its
//! request's future is polled (the covered run is instrumented with it, in
//! a task of its own too), so a store call or an upstream call opens its
//! span as a child of the current one. The attributes are named as
//! OpenTelemetry's HTTP conventions name them where one exists
//! (`http.request.method`, `http.response.status_code`, `url.path`,
//! `url.full`), and `idemproxy.*` otherwise.

use std::future::Future;

use futures_util::future::BoxFuture;
use http::{HeaderMap, Method, Request};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TraceId};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::field::Empty;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::http::headers::X_REQUEST_ID;

/// The `tracing` target of every span this module opens.
pub const TARGET: &str = "idemproxy::trace";

const TRACESTATE: &str = "tracestate";

/// The span of one request on `route`, in the trace its `traceparent`
/// names (its caller's decision to sample included), else in a new one.
pub fn request_span<B>(route: &str, req: &Request<B>) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "request",
        otel.name = %format_args!("{} {route}", req.method()),
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = %req.method(),
        url.path = req.uri().path(),
        idemproxy.route = route,
        idemproxy.outcome = Empty,
        idemproxy.key_hash = Empty,
        idemproxy.replayed = Empty,
        idemproxy.tool = Empty,
        http.response.status_code = Empty,
        idemproxy.request_id = Empty,
    );
    if span.is_disabled() {
        return span;
    }
    if let Some(id) = req
        .headers()
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
    {
        span.record("idemproxy.request_id", id);
    }
    let caller = TraceContextPropagator::new().extract(&HeaderExtractor(req.headers()));
    if caller.span().span_context().is_valid() {
        // Before anything starts the span: its parent and its sampling
        // decision are fixed when it starts.
        let _ = span.set_parent(caller);
    }
    span
}

/// Boxes `fut` to run in `span`; with traces off, boxes it as it is: the
/// wrapper of a disabled span would still cost a copy of a large future
/// and a check on every poll.
#[inline]
pub fn boxed_in<'a, F>(span: Span, fut: F) -> BoxFuture<'a, F::Output>
where
    F: Future + Send + 'a,
{
    if span.is_disabled() {
        Box::pin(fut)
    } else {
        Box::pin(fut.instrument(span))
    }
}

// Integers are recorded as `i64`: the OpenTelemetry layer turns other
// integer types into text, and `http.response.status_code` is an int.

/// What a request ended as, on its span (see [`request_span`]).
#[derive(Debug)]
pub struct Ending<'a> {
    pub outcome: &'static str,
    pub status: u16,
    pub key_hash: Option<&'a str>,
    pub replayed: bool,
    pub tool: Option<&'a str>,
}

/// Records how the request ended and ends its span now, whatever still
/// holds it. Returns the trace id when the trace is sampled, for the
/// latency histogram's exemplar.
pub fn end_request(span: &Span, ending: &Ending<'_>) -> Option<TraceId> {
    if span.is_disabled() {
        return None;
    }
    span.record("idemproxy.outcome", ending.outcome);
    span.record("http.response.status_code", i64::from(ending.status));
    span.record("idemproxy.replayed", ending.replayed);
    if let Some(key_hash) = ending.key_hash {
        span.record("idemproxy.key_hash", key_hash);
    }
    if let Some(tool) = ending.tool {
        span.record("idemproxy.tool", tool);
    }
    if ending.status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
    // A span ends when it was last left: entered once more here, it ends
    // with the log line, after a relayed body, not at the last poll of the
    // response future.
    drop(span.enter());
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_sampled().then(|| span_context.trace_id())
}

/// The span of one store call, a child of the current span.
pub fn store_span(op: &'static str) -> Span {
    tracing::info_span!(
        target: TARGET,
        "store",
        otel.name = %format_args!("store.{op}"),
        otel.kind = "client",
        otel.status_code = Empty,
        idemproxy.store.op = op,
        error.type = Empty,
    )
}

/// Marks a store call's span failed, with the kind of failure.
pub fn store_failed(span: &Span, kind: &'static str) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", kind);
}

/// The span of the call to the upstream, a child of the current span.
pub fn upstream_span(method: &Method, url: &http::Uri) -> Span {
    tracing::info_span!(
        target: TARGET,
        "upstream",
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = %method,
        url.full = %url,
        http.response.status_code = Empty,
        error.type = Empty,
    )
}

/// Records the upstream's answer on its span.
pub fn upstream_answered(span: &Span, status: u16) {
    span.record("http.response.status_code", i64::from(status));
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
}

/// Records that the upstream gave no answer, and why.
pub fn upstream_failed(span: &Span, kind: &'static str) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", kind);
}

/// Writes `span`'s trace context into the headers of the request it
/// makes, so the next hop's spans are its children; what the caller sent
/// is replaced. Nothing is touched while traces are off: the caller's
/// `traceparent` then goes on as any other header.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
    // An empty `tracestate` says nothing; leave it out.
    if headers.get(TRACESTATE).is_some_and(|v| v.is_empty()) {
        headers.remove(TRACESTATE);
    }
}
