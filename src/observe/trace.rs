//! Request traces: a span per request, a child per store call and per
//! upstream call, and W3C trace context in and out, so the proxy is one hop
//! in its caller's trace.
//!
//! The spans are `tracing` spans at the [`TARGET`] target, which only the
//! OpenTelemetry layer ([`super::otlp`]) enables: the log lines never see
//! them. With traces off no layer enables the target: each check here is
//! a disabled call site (a load and a branch), and nothing allocates,
//! formats or reads a header. With traces on, a request is sampled before
//! its span is made, and an unsampled one gets no spans at all.
//!
//! Parentage follows the task: the request span is entered whenever its
//! request's future is polled (the covered run is instrumented with it, in
//! a task of its own too), so a store call or an upstream call opens its
//! span as a child of the current one. The attributes are named as
//! OpenTelemetry's HTTP conventions name them where one exists
//! (`http.request.method`, `http.response.status_code`, `url.path`,
//! `url.full`), and `idemproxy.*` otherwise.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::future::BoxFuture;
use http::{HeaderMap, Method, Request};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TraceId};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::field::Empty;
use tracing::{Instrument, Level, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::metrics::Reconciled;
use crate::http::headers::X_REQUEST_ID;

/// The `tracing` target of every span this module opens.
pub const TARGET: &str = "idemproxy::trace";

const TRACESTATE: &str = "tracestate";

/// The share of new traces kept (`telemetry.sample_ratio`), as `f64`
/// bits; set once, by [`super::otlp::layer`].
static SAMPLE_RATIO: AtomicU64 = AtomicU64::new(1.0f64.to_bits());

/// Sets the share of requests without a sampled caller that are traced.
pub fn set_sample_ratio(ratio: f64) {
    SAMPLE_RATIO.store(ratio.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
}

/// Whether traces are on: the exporter's layer enables [`TARGET`]. With
/// them off, a call site no subscriber wants: a load and a branch.
fn tracing_on() -> bool {
    tracing::enabled!(target: TARGET, Level::INFO)
}

/// The span of one request on `route`, in the trace its `traceparent`
/// names, else in a new one; none when the request is not sampled.
///
/// Sampling is decided here, before any span exists: a caller's sampled
/// flag is followed both ways, and `sample_ratio` decides for requests
/// without one. An unsampled request then costs a header lookup, not the
/// spans the exporter would drop (they cost nearly as much to make as to
/// keep), and its `traceparent` goes on to the upstream as it came.
pub fn request_span<B>(route: &str, req: &Request<B>) -> Span {
    if !tracing_on() {
        return Span::none();
    }
    let caller = TraceContextPropagator::new().extract(&HeaderExtractor(req.headers()));
    let caller_context = caller.span().span_context().clone();
    let sampled = if caller_context.is_valid() {
        caller_context.is_sampled()
    } else {
        let ratio = f64::from_bits(SAMPLE_RATIO.load(Ordering::Relaxed));
        ratio > 0.0 && rand::random::<f64>() < ratio
    };
    if !sampled {
        return Span::none();
    }
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
    if let Some(id) = req
        .headers()
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
    {
        span.record("idemproxy.request_id", id);
    }
    if caller_context.is_valid() {
        // Before anything starts the span: its parent is fixed when it
        // starts.
        let _ = span.set_parent(caller);
    }
    span
}

/// Whether the current span is a traced request's (or one of its
/// children's): store and upstream calls get spans only then, never as
/// roots of their own.
fn in_traced_request() -> bool {
    tracing_on()
        && Span::current()
            .metadata()
            .is_some_and(|span| span.target() == TARGET)
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
    if !in_traced_request() {
        return Span::none();
    }
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

/// The span of a reconcile lookup (`reconcile_url`), a child of the
/// current span; the upstream call it makes is its own child.
pub fn reconcile_span() -> Span {
    if !in_traced_request() {
        return Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        "reconcile",
        otel.kind = "internal",
        otel.status_code = Empty,
        idemproxy.reconcile.result = Empty,
        http.response.status_code = Empty,
    )
}

/// Records what a lookup found on its span; a failed one marks it an
/// error.
pub fn reconciled(span: &Span, result: Reconciled, status: Option<u16>) {
    span.record("idemproxy.reconcile.result", result.as_str());
    if let Some(status) = status {
        span.record("http.response.status_code", i64::from(status));
    }
    if result == Reconciled::Failed {
        span.record("otel.status_code", "ERROR");
    }
}

/// The span of the call to the upstream, a child of the current span. Its
/// `url.full` leaves the query out: callers put tokens there.
pub fn upstream_span(method: &Method, url: &http::Uri) -> Span {
    if !in_traced_request() {
        return Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        "upstream",
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = %method,
        url.full = %format_args!(
            "{}://{}{}",
            url.scheme_str().unwrap_or("http"),
            url.authority().map_or("", |a| a.as_str()),
            url.path()
        ),
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
/// is replaced. Nothing is touched while traces are off, or for a request
/// not sampled: the caller's `traceparent` then goes on as any other
/// header.
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
