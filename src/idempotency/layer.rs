//! The layer: the settings every request shares (policies, store, bounds,
//! metrics, the execution tracker and the `max_in_flight` slots), built
//! tower-http style, each builder taking and returning `self`. It wraps a
//! service in [`Idempotency`](super::Idempotency) (`Layer` is implemented
//! beside the service, so that these settings sit below every step that
//! reads them).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

use super::policy::{Policies, Policy};
use crate::core::Clock;
use crate::observe::{Metrics, RequestLog, RouteMetrics};
use crate::store::SharedStore;

/// The default of `max_in_flight` (see `Config`).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;

/// Background releases of unanswered claims at once; past it a claim is
/// left to fail closed when its lease ends, as it would without them.
pub(super) const MAX_LATE_RELEASES: usize = 1024;

/// Applies idempotency to the requests the policies cover.
#[derive(Clone)]
pub struct IdempotencyLayer {
    pub(super) settings: Arc<Settings>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer").finish_non_exhaustive()
    }
}

pub(super) struct Settings {
    pub(super) policies: Policies,
    pub(super) store: SharedStore,
    pub(super) store_timeout: Duration,
    pub(super) upstream_timeout: Duration,
    pub(super) request_body_timeout: Duration,
    pub(super) metrics: Arc<Metrics>,
    /// Each route's series, resolved once (see `Metrics::route`).
    route_metrics: HashMap<Arc<str>, Arc<RouteMetrics>>,
    /// Executions outlive the connection that started them (a client may
    /// disconnect mid-call); graceful shutdown waits on this tracker, not on
    /// connections, before the process exits.
    pub(super) tasks: TaskTracker,
    /// One permit per request being served (`max_in_flight`). A covered
    /// request's permit moves into its run, so an execution whose client
    /// went away still counts until its outcome is stored:
    /// that is what bounds buffered bodies and upstream calls.
    pub(super) in_flight: Arc<Semaphore>,
    /// Slots for claims released in the background after their request
    /// was answered 503 (see `store_call::release_unanswered_claim`):
    /// they hold no `max_in_flight` slot, and this bounds them instead.
    pub(super) late_releases: Arc<Semaphore>,
    /// Where a record's instants (`created_at`, `completed_at`, expiry)
    /// are read; the store in `store` should read the same one.
    pub(super) clock: Clock,
}

impl IdempotencyLayer {
    pub fn new(policies: Policies, store: SharedStore) -> Self {
        let metrics = Metrics::new();
        Self {
            settings: Arc::new(Settings {
                route_metrics: resolve_routes(&policies, &metrics),
                policies,
                store,
                store_timeout: Duration::from_millis(250),
                upstream_timeout: Duration::from_secs(30),
                request_body_timeout: Duration::from_secs(30),
                metrics,
                tasks: TaskTracker::new(),
                in_flight: Arc::new(Semaphore::new(DEFAULT_MAX_IN_FLIGHT)),
                late_releases: Arc::new(Semaphore::new(MAX_LATE_RELEASES)),
                clock: Clock::wall(),
            }),
        }
    }

    /// Bounds every store call; past it the store counts as unavailable.
    pub fn store_timeout(self, timeout: Duration) -> Self {
        self.map(|s| s.store_timeout = timeout)
    }

    /// Bounds the whole upstream exchange, response body included.
    pub fn upstream_timeout(self, timeout: Duration) -> Self {
        self.map(|s| s.upstream_timeout = timeout)
    }

    /// Bounds the reading of a covered request's body, whole; past it the
    /// request is answered 408 `body-timeout`, before its key is claimed.
    pub fn request_body_timeout(self, timeout: Duration) -> Self {
        self.map(|s| s.request_body_timeout = timeout)
    }

    /// Where requests, store calls and executions are counted.
    pub fn metrics(self, metrics: Arc<Metrics>) -> Self {
        self.map(|s| {
            s.route_metrics = resolve_routes(&s.policies, &metrics);
            s.metrics = metrics;
        })
    }

    /// Requests served at once; past it, requests are answered 503
    /// `overloaded` before their body is read.
    pub fn max_in_flight(self, max: usize) -> Self {
        self.map(|s| s.in_flight = Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS))))
    }

    /// Reads records' time from `clock` (the wall clock by default): give
    /// the store the same one.
    pub fn clock(self, clock: Clock) -> Self {
        self.map(|s| s.clock = clock)
    }

    /// Tracks every execution in flight, for graceful shutdown, and every
    /// claim being released in the background.
    pub fn tasks(&self) -> TaskTracker {
        self.settings.tasks.clone()
    }

    /// Of [`tasks`](Self::tasks), the claims being released in the
    /// background for requests answered 503 (never executed).
    pub fn releases_pending(&self) -> usize {
        MAX_LATE_RELEASES.saturating_sub(self.settings.late_releases.available_permits())
    }

    fn map(self, f: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = match Arc::try_unwrap(self.settings) {
            Ok(s) => s,
            Err(shared) => Settings {
                policies: shared.policies.clone(),
                store: shared.store.clone(),
                store_timeout: shared.store_timeout,
                upstream_timeout: shared.upstream_timeout,
                request_body_timeout: shared.request_body_timeout,
                metrics: shared.metrics.clone(),
                route_metrics: shared.route_metrics.clone(),
                tasks: shared.tasks.clone(),
                in_flight: shared.in_flight.clone(),
                late_releases: shared.late_releases.clone(),
                clock: shared.clock,
            },
        };
        f(&mut settings);
        Self {
            settings: Arc::new(settings),
        }
    }
}

impl Settings {
    /// The request's log line, on its route's series (resolved once, when
    /// the layer was built).
    pub(super) fn request_log<B>(&self, policy: &Policy, req: &Request<B>) -> RequestLog {
        let metrics = match self.route_metrics.get(&policy.route) {
            Some(resolved) => resolved.clone(),
            None => Arc::new(self.metrics.route(&policy.route)),
        };
        RequestLog::new(policy.route.clone(), metrics, req)
    }
}

fn resolve_routes(policies: &Policies, metrics: &Metrics) -> HashMap<Arc<str>, Arc<RouteMetrics>> {
    policies
        .all()
        .map(|p| (p.route.clone(), Arc::new(metrics.route(&p.route))))
        .collect()
}
