//! The one log event per request, and its count in the metrics: written
//! exactly once, whether the request was answered, its client left, or its
//! run panicked or was cut off (see [`RequestLog`]'s fields).

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Method, Request, Response};
use tokio::time::Instant;
use tracing::Span;

use super::metrics::{RouteMetrics, UNLISTED_TOOL};
use super::outcome::RequestOutcome;
use super::trace;
use crate::core::{KeyHex, RecordKey};
use crate::http::headers::X_REQUEST_ID;

/// The one log event per request: route, method, outcome, status, key hash
/// (never the raw key) and the time spent in the store and the upstream.
pub struct RequestLog {
    metrics: Arc<RouteMetrics>,
    route: Arc<str>,
    method: Method,
    /// `x-request-id`, set by the outer request-id layer when absent.
    request_id: Option<HeaderValue>,
    started: Instant,
    key: Option<RecordKey>,
    /// The tool of an MCP `tools/call`, and its `tool` label (the name if
    /// a listing named it, else [`UNLISTED_TOOL`]).
    tool: Option<(Arc<str>, Arc<str>)>,
    /// In observe mode, the id of the first request of a duplicate's key.
    first_request_id: Option<Arc<str>>,
    status: Option<u16>,
    store: Duration,
    upstream: Option<Duration>,
    /// The request's span (see [`trace`]); disabled while traces are off.
    /// It ends with the line.
    span: Span,
    /// Set once the line is written. A log dropped before that while its
    /// thread unwinds belongs to a run that panicked: it is written then, as
    /// `internal`, so the request is in the log and in
    /// `idemproxy_requests_total` all the same, with the status already sent
    /// if there was one, else the 500 the client gets (if it still waits).
    /// Dropped unwritten otherwise, its client went away before an answer
    /// (`client_closed`): every request gets its line and its count.
    written: bool,
    /// Set while a covered request is at the upstream and its key not yet
    /// settled. A run dropped then (the drain deadline passed, the runtime
    /// stopped) leaves its key to end as `outcome-unknown` by its lease,
    /// and is logged and counted so (`outcome_unknown`), not as a client
    /// that left.
    unsettled: bool,
}

impl std::fmt::Debug for RequestLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestLog")
            .field("route", &self.route)
            .field("method", &self.method)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        if self.written {
            return;
        }
        if std::thread::panicking() {
            self.status.get_or_insert(500);
            self.write(RequestOutcome::Internal);
        } else if self.unsettled {
            self.write(RequestOutcome::OutcomeUnknown);
        } else {
            self.write(RequestOutcome::ClientClosed);
        }
    }
}

impl RequestLog {
    /// Opens the log of `req` on `route`, whose series are `metrics`: the
    /// request's time counts from here.
    pub fn new<B>(route: Arc<str>, metrics: Arc<RouteMetrics>, req: &Request<B>) -> Self {
        Self {
            span: trace::request_span(&route, req),
            metrics,
            route,
            method: req.method().clone(),
            request_id: req.headers().get(X_REQUEST_ID).cloned(),
            started: Instant::now(),
            key: None,
            tool: None,
            first_request_id: None,
            status: None,
            store: Duration::ZERO,
            upstream: None,
            written: false,
            unsettled: false,
        }
    }

    /// The route's series, for the counts that are not per request.
    pub fn metrics(&self) -> &Arc<RouteMetrics> {
        &self.metrics
    }

    /// The request's span: the parent of its store and upstream calls'.
    pub fn span(&self) -> &Span {
        &self.span
    }

    /// When the request arrived.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The store hash of the request's key, once it is known.
    pub fn set_key(&mut self, key: RecordKey) {
        self.key = Some(key);
    }

    /// The tool an MCP `tools/call` calls, for the line and the per-tool
    /// count; `listed` when a `tools/list` answer named it.
    pub fn set_tool(&mut self, tool: &str, listed: bool) {
        let tool: Arc<str> = Arc::from(tool);
        let label = if listed {
            tool.clone()
        } else {
            Arc::from(UNLISTED_TOOL)
        };
        self.tool = Some((tool, label));
    }

    /// The request's `x-request-id`.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_ref().and_then(|v| v.to_str().ok())
    }

    /// In observe mode: the first request of the key this one duplicates.
    pub fn set_first_request_id(&mut self, id: Option<Arc<str>>) {
        self.first_request_id = id;
    }

    /// The status sent, for a response whose body is still being relayed.
    pub fn set_status(&mut self, status: u16) {
        self.status = Some(status);
    }

    /// Adds the time of one store call.
    pub fn add_store_time(&mut self, elapsed: Duration) {
        self.store += elapsed;
    }

    /// Marks the request's key as claimed and not yet settled (see the
    /// field), or as settled.
    pub fn set_unsettled(&mut self, unsettled: bool) {
        self.unsettled = unsettled;
    }

    /// The upstream answered (or failed) after `elapsed`: for the log line
    /// and `idemproxy_upstream_duration_seconds`.
    pub fn upstream_done(&mut self, elapsed: Duration) {
        self.upstream = Some(elapsed);
        self.metrics.upstream(elapsed);
    }

    /// Writes the line for an answer whose status is `response`'s.
    pub fn finish<B>(mut self, outcome: RequestOutcome, response: &Response<B>) {
        self.status = Some(response.status().as_u16());
        self.finish_streamed(outcome);
    }

    /// Writes the line once a relayed body is done (its status already set).
    pub fn finish_streamed(mut self, outcome: RequestOutcome) {
        self.write(outcome);
    }

    fn write(&mut self, outcome: RequestOutcome) {
        self.written = true;
        let elapsed = self.started.elapsed();
        if let Some((_, label)) = &self.tool {
            self.metrics.tool_call(label, outcome);
        }
        // The full store hash: an operator can look the key up through the
        // admin API. It is a hash of scope and key, never the key itself.
        let key = self.key.map(|k| k.hex());
        let sampled = trace::end_request(
            &self.span,
            &trace::Ending {
                outcome: outcome.as_str(),
                status: self.status.unwrap_or(0),
                key_hash: key.as_ref().map(KeyHex::as_str),
                replayed: outcome == RequestOutcome::Replayed,
                tool: self.tool.as_ref().map(|(tool, _)| &**tool),
            },
        );
        self.metrics.request(outcome, elapsed, sampled);
        let key = key.as_ref().map_or("-", KeyHex::as_str);
        let request_id = self
            .request_id
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-");
        let upstream_ms = self.upstream.map(whole_micros_as_ms);
        tracing::info!(
            target: "idemproxy::request",
            route = %self.route,
            method = %self.method,
            outcome = outcome.as_str(),
            status = self.status.unwrap_or(0),
            key_hash = key,
            tool = self.tool.as_ref().map(|(tool, _)| &**tool),
            first_request_id = self.first_request_id.as_deref(),
            request_id,
            store_ms = whole_micros_as_ms(self.store),
            upstream_ms,
            total_ms = whole_micros_as_ms(elapsed),
        );
    }
}

/// Milliseconds to the microsecond: `1.47`, not the `1.4700030000000002`
/// that scaling the seconds gives, and finer than a log reader needs.
fn whole_micros_as_ms(d: Duration) -> f64 {
    d.as_micros() as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_durations_are_milliseconds_to_the_microsecond() {
        assert_eq!(
            whole_micros_as_ms(Duration::from_nanos(1_470_003_999)),
            1470.003
        );
        assert_eq!(whole_micros_as_ms(Duration::from_nanos(1_470_003)), 1.47);
        assert_eq!(whole_micros_as_ms(Duration::from_nanos(2_464)), 0.002);
        assert_eq!(whole_micros_as_ms(Duration::ZERO), 0.0);
    }
}
