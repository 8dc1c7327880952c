//! Prometheus metrics, served as text on the admin listener's `/metrics`.
//!
//! One [`Metrics`] per [`App`](crate::App), not a process-global recorder, so
//! several proxies in one test process count separately. Labels are bounded:
//! `route` is a configured route name (never a raw path), `outcome` and `op`
//! come from fixed lists.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TraceId;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::outcome::RequestOutcome;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconciledLabels {
    route: String,
    result: &'static str,
}

/// What a lookup of an unknown outcome (`reconcile_url`) said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// The operation happened: its answer is stored.
    Found,
    /// It never happened: the request executes.
    Absent,
    /// No answer to go by: the key stays `outcome-unknown`.
    Failed,
}

impl Reconciled {
    const ALL: [Reconciled; 3] = [Reconciled::Found, Reconciled::Absent, Reconciled::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            Reconciled::Found => "found",
            Reconciled::Absent => "absent",
            Reconciled::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolOutcomeLabels {
    route: Arc<str>,
    tool: Arc<str>,
    outcome: &'static str,
}

/// The `tool` label of a call to a tool no listing named: the label's
/// values stay bounded by what the server lists (the catalog's bound),
/// whatever names callers send.
pub const UNLISTED_TOOL: &str = "(unlisted)";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabels {
    store: &'static str,
}

/// Buckets from 100 µs to 60 s: resolve both sub-millisecond store calls and
/// upstream calls near a 30 s timeout.
const BUCKETS: [f64; 19] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 20.0, 30.0, 60.0,
];

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The exemplar of a request in a sampled trace: Grafana links a latency
/// point to its trace by `trace_id`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TraceExemplar {
    trace_id: String,
}

type LatencyHistogram = HistogramWithExemplars<TraceExemplar>;

fn latency_histogram() -> LatencyHistogram {
    HistogramWithExemplars::new(BUCKETS.into_iter())
}

/// A histogram per label set, each with [`BUCKETS`].
fn histograms<L: Clone + std::hash::Hash + Eq>() -> Family<L, Histogram, fn() -> Histogram> {
    Family::new_with_constructor(histogram as fn() -> Histogram)
}

pub struct Metrics {
    registry: Registry,
    /// Store-call series resolved once: the label set is fixed, and the
    /// per-request path should not hash and allocate labels.
    store_ops: [(&'static str, Histogram, Counter); 3],
    requests: Family<OutcomeLabels, Counter>,
    /// With the trace id of a recent sampled request per bucket, while
    /// traces are on.
    request_duration: Family<RouteLabels, LatencyHistogram, fn() -> LatencyHistogram>,
    upstream_duration: Family<RouteLabels, Histogram, fn() -> Histogram>,
    store_duration: Family<OpLabels, Histogram, fn() -> Histogram>,
    store_errors: Family<OpLabels, Counter>,
    in_flight: Gauge,
    /// Keys whose completion or release goes on in the background.
    settling: Gauge,
    released: Family<RouteLabels, Counter>,
    stale: Family<RouteLabels, Counter>,
    reconciled: Family<ReconciledLabels, Counter>,
    /// MCP `tools/call` outcomes per tool: created on first use, since the
    /// tools are known only once a server lists them.
    tool_calls: Family<ToolOutcomeLabels, Counter>,
    mcp_batches: Family<RouteLabels, Counter>,
    cache_hits: Counter,
    /// One series once a scrape found a local replay cache; none without
    /// one, so that an alert on 0 never fires for a cache turned off.
    cache_live: Family<StoreLabels, Gauge>,
    log_lines_dropped: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let store_duration = histograms();
        let store_errors = Family::<OpLabels, Counter>::default();
        let store_ops = ["begin", "complete", "release"].map(|op| {
            let labels = OpLabels { op };
            (
                op,
                store_duration.get_or_create_owned(&labels),
                store_errors.get_or_create_owned(&labels),
            )
        });
        let mut metrics = Self {
            registry: Registry::with_prefix("idemproxy"),
            store_ops,
            requests: Family::default(),
            request_duration: Family::new_with_constructor(
                latency_histogram as fn() -> LatencyHistogram,
            ),
            upstream_duration: histograms(),
            store_duration,
            store_errors,
            in_flight: Gauge::default(),
            settling: Gauge::default(),
            released: Family::default(),
            stale: Family::default(),
            reconciled: Family::default(),
            tool_calls: Family::default(),
            mcp_batches: Family::default(),
            cache_hits: Counter::default(),
            cache_live: Family::default(),
            log_lines_dropped: Counter::default(),
        };
        metrics.register();
        Arc::new(metrics)
    }

    /// Names and documents every series in the registry `/metrics` renders.
    fn register(&mut self) {
        self.registry.register(
            "requests",
            "Requests by route and idempotency outcome",
            self.requests.clone(),
        );
        self.registry.register(
            "request_duration_seconds",
            "Time from request to its settled outcome (for a relayed body, once it is stored)",
            self.request_duration.clone(),
        );
        self.registry.register(
            "upstream_duration_seconds",
            "Time the upstream took to answer (response head)",
            self.upstream_duration.clone(),
        );
        self.registry.register(
            "store_duration_seconds",
            "Store call latency by operation",
            self.store_duration.clone(),
        );
        self.registry.register(
            "store_errors",
            "Store calls that failed or timed out, by operation",
            self.store_errors.clone(),
        );
        self.registry.register(
            "in_flight",
            "Covered requests executing against the upstream now",
            self.in_flight.clone(),
        );
        self.registry.register(
            "settling_in_background",
            "Keys whose outcome (or release) is being retried in the background because the store failed as their request finished; each holds a max_in_flight slot",
            self.settling.clone(),
        );
        self.registry.register(
            "keys_released",
            "Keys released so that a retry executes (unreachable upstream, release_statuses, on_ambiguous = release)",
            self.released.clone(),
        );
        self.registry.register(
            "expired_leases",
            "Claims found with an expired lease (their proxy died), settled per on_stale",
            self.stale.clone(),
        );
        self.registry.register(
            "reconciled",
            "Lookups of unknown outcomes (reconcile_url) by route and result: found (stored and replayed), absent (executed), failed (left outcome-unknown)",
            self.reconciled.clone(),
        );
        self.registry.register(
            "mcp_tool_calls",
            "MCP tools/call requests by route, tool and outcome; a tool no tools/list named counts as (unlisted)",
            self.tool_calls.clone(),
        );
        self.registry.register(
            "mcp_unprotected_batches",
            "JSON-RPC batches on MCP routes, passed through without protection",
            self.mcp_batches.clone(),
        );
        self.registry.register(
            "local_cache_hits",
            "Replays answered from the in-process cache without a store round trip",
            self.cache_hits.clone(),
        );
        self.registry.register(
            "log_lines_dropped",
            "Log lines dropped because the log output (stdout) did not keep up",
            self.log_lines_dropped.clone(),
        );
        self.registry.register(
            "local_cache_live",
            "1 while the local replay cache answers replays; 0 while it cannot know that its records are current (removals through other replicas unheard: starting, Redis away, an ACL without the removals channel), and replays go to the store",
            self.cache_live.clone(),
        );
    }

    /// The series of one route, resolved once so that counting a request
    /// is a few atomic adds. Every outcome's series exists from then on
    /// (at zero), as Prometheus prefers.
    pub fn route(&self, route: &str) -> RouteMetrics {
        let labels = RouteLabels {
            route: route.to_owned(),
        };
        RouteMetrics {
            outcomes: RequestOutcome::ALL.map(|outcome| {
                self.requests.get_or_create_owned(&OutcomeLabels {
                    route: route.to_owned(),
                    outcome: outcome.as_str(),
                })
            }),
            duration: self.request_duration.get_or_create_owned(&labels),
            upstream: self.upstream_duration.get_or_create_owned(&labels),
            released: self.released.get_or_create_owned(&labels),
            stale: self.stale.get_or_create_owned(&labels),
            reconciled: Reconciled::ALL.map(|result| {
                self.reconciled.get_or_create_owned(&ReconciledLabels {
                    route: route.to_owned(),
                    result: result.as_str(),
                })
            }),
            batches: self.mcp_batches.get_or_create_owned(&labels),
            tool_calls: self.tool_calls.clone(),
            name: Arc::from(route),
        }
    }

    pub fn store_call(&self, op: &'static str, elapsed: Duration, ok: bool) {
        let resolved = self.store_ops.iter().find(|(name, _, _)| *name == op);
        let labels = OpLabels { op };
        let (histogram, errors) = match resolved {
            Some((_, h, e)) => (h.clone(), e.clone()),
            None => (
                self.store_duration.get_or_create_owned(&labels),
                self.store_errors.get_or_create_owned(&labels),
            ),
        };
        histogram.observe(elapsed.as_secs_f64());
        if !ok {
            errors.inc();
        }
    }

    /// Brings `local_cache_hits_total` up to `total`, the store's own count
    /// (the cache sits below the middleware and knows nothing of metrics).
    pub fn sync_cache_hits(&self, total: u64) {
        // One atomic step: concurrent scrapes must not both add the gap.
        self.cache_hits.inner().fetch_max(total, Ordering::Relaxed);
    }

    /// Brings `log_lines_dropped_total` up to `total`, the log writer's own
    /// count ([`crate::observe::log_writer::dropped_lines`]).
    pub fn sync_log_lines_dropped(&self, total: u64) {
        self.log_lines_dropped
            .inner()
            .fetch_max(total, Ordering::Relaxed);
    }

    /// Sets `local_cache_live{store}` to whether the cache in front of
    /// `store` answers replays now.
    pub fn set_cache_live(&self, store: &'static str, live: bool) {
        self.cache_live
            .get_or_create(&StoreLabels { store })
            .set(i64::from(live));
    }

    /// Counts a key settled in the background until the guard drops.
    pub fn settling(&self) -> GaugeGuard {
        GaugeGuard::new(&self.settling)
    }

    /// Counts an execution against the upstream until the guard drops.
    pub fn executing(&self) -> GaugeGuard {
        GaugeGuard::new(&self.in_flight)
    }

    /// The Prometheus text exposition of every series.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// One route's series (see [`Metrics::route`]).
#[derive(Clone)]
pub struct RouteMetrics {
    outcomes: [Counter; RequestOutcome::ALL.len()],
    duration: LatencyHistogram,
    upstream: Histogram,
    released: Counter,
    stale: Counter,
    reconciled: [Counter; Reconciled::ALL.len()],
    batches: Counter,
    tool_calls: Family<ToolOutcomeLabels, Counter>,
    name: Arc<str>,
}

impl std::fmt::Debug for RouteMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteMetrics").finish_non_exhaustive()
    }
}

impl RouteMetrics {
    /// Counts a request; `trace`, the id of its sampled trace, becomes its
    /// latency bucket's exemplar.
    pub fn request(&self, outcome: RequestOutcome, elapsed: Duration, trace: Option<TraceId>) {
        self.outcomes[outcome.index()].inc();
        let exemplar = trace.map(|id| TraceExemplar {
            trace_id: id.to_string(),
        });
        self.duration.observe(elapsed.as_secs_f64(), exemplar, None);
    }

    pub fn upstream(&self, elapsed: Duration) {
        self.upstream.observe(elapsed.as_secs_f64());
    }

    pub fn key_released(&self) {
        self.released.inc();
    }

    pub fn lease_expired(&self) {
        self.stale.inc();
    }

    pub fn reconciled(&self, result: Reconciled) {
        self.reconciled[result as usize].inc();
    }

    /// Counts an MCP `tools/call` of `tool` (a listed tool's name, else
    /// [`UNLISTED_TOOL`]).
    pub fn tool_call(&self, tool: &Arc<str>, outcome: RequestOutcome) {
        self.tool_calls
            .get_or_create(&ToolOutcomeLabels {
                route: self.name.clone(),
                tool: tool.clone(),
                outcome: outcome.as_str(),
            })
            .inc();
    }

    pub fn unprotected_batch(&self) {
        self.batches.inc();
    }
}

/// One up on a gauge for as long as it lives ([`Metrics::executing`],
/// [`Metrics::settling`]).
pub struct GaugeGuard(Gauge);

impl std::fmt::Debug for GaugeGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GaugeGuard").finish_non_exhaustive()
    }
}

impl GaugeGuard {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        // A clone shares the gauge's value.
        Self(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_named_as_documented() {
        let m = Metrics::new();
        m.route("payments")
            .request(RequestOutcome::Executed, Duration::from_millis(3), None);
        m.store_call("begin", Duration::from_micros(300), false);
        {
            let _g = m.executing();
            assert!(m.render().contains("idemproxy_in_flight 1"));
        }
        let text = m.render();
        assert!(
            text.contains(r#"idemproxy_requests_total{route="payments",outcome="executed"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"idemproxy_store_errors_total{op="begin"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"idemproxy_store_duration_seconds_bucket{le="0.0005",op="begin"} 1"#),
            "{text}"
        );
        assert!(text.contains("idemproxy_in_flight 0"), "{text}");
        assert!(
            !text.contains("trace_id"),
            "no exemplar without a trace: {text}"
        );
    }

    #[test]
    fn a_sampled_request_is_its_latency_buckets_exemplar() {
        let m = Metrics::new();
        let trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("a trace id");
        let route = m.route("payments");
        route.request(
            RequestOutcome::Executed,
            Duration::from_millis(3),
            Some(trace),
        );
        route.request(RequestOutcome::Replayed, Duration::from_millis(40), None);
        let text = m.render();
        // OpenMetrics: `bucket{…} count # {labels} value`, on the bucket the
        // request fell in only.
        assert!(
            text.contains(
                r#"idemproxy_request_duration_seconds_bucket{le="0.005",route="payments"} 1 # {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 0.003"#
            ),
            "{text}"
        );
        assert_eq!(text.matches("trace_id=").count(), 1, "{text}");
    }
}
