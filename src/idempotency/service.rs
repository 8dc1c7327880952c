//! The middleware: [`IdempotencyLayer`] holds the settings, [`Idempotency`]
//! decides per request, and [`ResponseFuture`] boxes only the covered path
//! (the one that waits for the store).
//!
//! The covered path, in order:
//! 1. read the body under `max_request_bytes`, fingerprint it, derive the
//!    record key from scope and key;
//! 2. run the rest on the connection's task while the client waits, and in
//!    a task of its own once it leaves (`DetachOnDrop`), so that a client
//!    that disconnects cancels nothing: a claimed key is always completed or
//!    released;
//! 3. `begin` in the store, then replay, reject, wait, or execute;
//! 4. when executing, stream the upstream's response to the client while
//!    keeping a bounded copy, and store it before ending the client's body,
//!    so the client's next retry finds the record.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::{BoxFuture, Fuse, FusedFuture};
use futures_util::FutureExt;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tower::util::Oneshot;
use tower::{Layer, Service, ServiceExt};

use super::body::{channel_body, holding, read_request_body, BoundedCopy};
use super::key::{parse_key, IdempotencyKey, InvalidKey};
use super::policy::{OnAmbiguous, OnInFlight, OnStoreError, Policies, Policy, Profile};
use super::rejection::Rejection;
use crate::core::{
    from_millis, millis, now_millis, Begin, BeginOutcome, CompletedRecord, FencingToken,
    Fingerprint, Outcome, Record, RecordKey, StoredResponse, UnknownCause, UpstreamFailure,
};
use crate::http::headers::{IDEMPOTENCY_KEY, IDEMPOTENCY_ORIGINAL_DATE, IDEMPOTENT_REPLAYED};
use crate::observe::{Metrics, RequestLog, RequestOutcome, RouteMetrics};
use crate::store::{SharedStore, Store, StoreError};

/// The default of `max_in_flight` (see `Config`).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;

/// Applies idempotency to the requests the policies cover.
#[derive(Clone)]
pub struct IdempotencyLayer {
    settings: Arc<Settings>,
}

struct Settings {
    policies: Policies,
    store: SharedStore,
    store_timeout: Duration,
    upstream_timeout: Duration,
    request_body_timeout: Duration,
    metrics: Arc<Metrics>,
    /// Each route's series, resolved once (see `Metrics::route`).
    route_metrics: HashMap<Arc<str>, Arc<RouteMetrics>>,
    /// Executions outlive the connection that started them (a client may
    /// disconnect mid-call); graceful shutdown waits on this tracker, not on
    /// connections, before the process exits.
    tasks: TaskTracker,
    /// One permit per request being served (`max_in_flight`). A covered
    /// request's permit moves into its run, so an execution whose client
    /// went away still counts until its outcome is stored:
    /// that is what bounds buffered bodies and upstream calls.
    in_flight: Arc<Semaphore>,
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

    /// Tracks every execution in flight, for graceful shutdown.
    pub fn tasks(&self) -> TaskTracker {
        self.settings.tasks.clone()
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
    fn request_log<B>(&self, policy: &Policy, req: &Request<B>) -> RequestLog {
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

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            settings: self.settings.clone(),
        }
    }
}

/// The middleware service. `S` forwards a request to the upstream and
/// classifies its failures (see [`UpstreamError`]).
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> Service<Request<Body>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture<S>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Readiness of the upstream is awaited per request (`Oneshot`), where
        // a failure can become a response instead of an error.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let policy = self.settings.policies.for_path(req.uri().path()).clone();
        let log = self.settings.request_log(&policy, &req);
        let Ok(permit) = self.settings.in_flight.clone().try_acquire_owned() else {
            // Shedding beats queueing for a proxy in front of writes: a
            // queued request holds its body and its client's patience, and
            // the caller's retry (with the same key) is safe.
            let rejection = Rejection::Overloaded {
                retry_after: Duration::from_secs(1),
            };
            return ResponseFuture::rejected(log, RequestOutcome::Overloaded, rejection, &policy);
        };
        if !policy.covers(req.method()) {
            return ResponseFuture::passthrough(
                self.inner.clone().oneshot(req),
                log,
                permit,
                self.settings.upstream_timeout,
            );
        }
        let key = match key_of(req.headers()) {
            Ok(Some(key)) => key,
            Ok(None) if policy.require_key => {
                return ResponseFuture::rejected(
                    log,
                    RequestOutcome::MissingKey,
                    Rejection::MissingKey,
                    &policy,
                )
            }
            Ok(None) => {
                return ResponseFuture::passthrough(
                    self.inner.clone().oneshot(req),
                    log,
                    permit,
                    self.settings.upstream_timeout,
                )
            }
            Err(invalid) => {
                return ResponseFuture::rejected(
                    log,
                    RequestOutcome::InvalidKey,
                    Rejection::InvalidKey(invalid),
                    &policy,
                )
            }
        };
        let exchange = Exchange {
            settings: self.settings.clone(),
            policy,
            inner: self.inner.clone(),
            log,
            permit,
        };
        ResponseFuture::Covered {
            fut: Box::pin(exchange.start(req, key)),
        }
    }
}

/// At most one `Idempotency-Key` header: two would make the key ambiguous.
fn key_of(headers: &http::HeaderMap) -> Result<Option<IdempotencyKey>, InvalidKey> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(v), None) => parse_key(v).map(Some),
        (Some(_), Some(_)) => Err(InvalidKey::Repeated),
    }
}

pin_project! {
    #[project = ResponseFutureProj]
    pub enum ResponseFuture<S: Service<Request<Body>>> {
        Passthrough {
            #[pin]
            fut: Oneshot<S, Request<Body>>,
            log: Option<RequestLog>,
            permit: Option<OwnedSemaphorePermit>,
            // `upstream.timeout` from arrival: the body's too.
            deadline: Instant,
        },
        Covered {
            fut: BoxFuture<'static, Response<Body>>,
        },
        Ready {
            response: Option<Response<Body>>,
        },
    }
}

impl<S: Service<Request<Body>>> ResponseFuture<S> {
    fn passthrough(
        fut: Oneshot<S, Request<Body>>,
        log: RequestLog,
        permit: OwnedSemaphorePermit,
        timeout: Duration,
    ) -> Self {
        ResponseFuture::Passthrough {
            fut,
            deadline: log.started() + timeout,
            log: Some(log),
            permit: Some(permit),
        }
    }

    fn rejected(
        log: RequestLog,
        outcome: RequestOutcome,
        rejection: Rejection,
        policy: &Policy,
    ) -> Self {
        let response = rejection.into_response(policy.profile);
        log.finish(outcome, &response);
        ResponseFuture::Ready {
            response: Some(response),
        }
    }
}

impl<S> Future for ResponseFuture<S>
where
    S: Service<Request<Body>, Response = Response<Body>>,
    S::Error: Into<UpstreamFailure>,
{
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            ResponseFutureProj::Passthrough {
                fut,
                log,
                permit,
                deadline,
            } => {
                let response = match std::task::ready!(fut.poll(cx)) {
                    Ok(response) => response,
                    Err(e) => Rejection::PassthroughFailed {
                        timeout: e.into().is_timeout(),
                    }
                    .into_response(Profile::Default),
                };
                if let Some(mut log) = log.take() {
                    // Forwarding starts right after the log is opened: the
                    // whole wait is the upstream's.
                    log.upstream_done(log.started().elapsed());
                    log.finish(RequestOutcome::Passthrough, &response);
                }
                // The body streams without the proxy buffering it, but it
                // still holds an upstream connection and the client's: the
                // request counts until the body is done.
                let response = match permit.take() {
                    Some(permit) => response.map(|body| holding(body, permit, *deadline)),
                    None => response,
                };
                Poll::Ready(Ok(response))
            }
            ResponseFutureProj::Covered { fut } => fut.as_mut().poll(cx).map(Ok),
            ResponseFutureProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .unwrap_or_else(|| Rejection::Internal.into_response(Default::default())))),
        }
    }
}

/// The run of a covered request (`Exchange::run`), polled on the
/// connection's task while the client waits for it, and moved to a task of
/// its own if the client goes first: dropping this spawns what is left, so a
/// disconnect cancels nothing and a claimed key is still completed or
/// released.
///
/// Spawning every run up front did the same, but each request then went
/// through the worker's run queue twice more (the spawned task, then the
/// connection's task woken by the answer), behind every other ready task;
/// polled here, the answer is ready in the poll that produces it.
struct DetachOnDrop(Option<BoxFuture<'static, ()>>);

impl DetachOnDrop {
    fn poll(&mut self, cx: &mut Context<'_>) {
        let Some(run) = self.0.as_mut() else {
            return;
        };
        // A panic in the run must not take the client's connection with
        // it, as it would not have from a task of its own: the run is
        // dropped, its answer channel with it, and the client gets a 500.
        // Its claim, if it made one, fails closed when its lease runs out.
        match std::panic::catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(cx))) {
            Ok(Poll::Pending) => {}
            Ok(Poll::Ready(())) => self.0 = None,
            Err(_) => {
                tracing::error!("a covered request's run panicked; answering 500");
                self.0 = None;
            }
        }
    }
}

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        if let Some(run) = self.0.take() {
            // Without a runtime (it is shutting down), the run ends here like
            // every other task of that runtime; its claim then fails closed.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(run);
            }
        }
    }
}

/// One covered request, from its body to its stored outcome.
struct Exchange<S> {
    settings: Arc<Settings>,
    policy: Arc<Policy>,
    inner: S,
    log: RequestLog,
    /// Held until the exchange ends (see `Settings::in_flight`), or handed
    /// to the task that settles its key late (`settle_late`).
    permit: OwnedSemaphorePermit,
}

/// The identity of a covered request, carried into the task that runs it.
#[derive(Clone, Copy)]
struct Claim {
    /// When the request arrived: the record's `created_at`.
    arrived_at: u64,
    key: RecordKey,
    fingerprint: Fingerprint,
    /// When the claim this request holds is presumed dead, counted from
    /// the instant it asked for the key (no later than the store's own
    /// `now`): set when `begin` acquires the key.
    lease_ends: Instant,
}

type Responder = oneshot::Sender<Response<Body>>;

impl<S> Exchange<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
{
    /// Runs on the connection's task: reads the body, then drives the run
    /// until it answers (see [`DetachOnDrop`]).
    async fn start(mut self, req: Request<Body>, key: IdempotencyKey) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let read = read_request_body(&parts.headers, body, self.policy.max_request_bytes);
        let body = match tokio::time::timeout(self.settings.request_body_timeout, read).await {
            Ok(Ok(body)) => body,
            Ok(Err(rejection)) => return self.reject(RequestOutcome::BadBody, rejection),
            Err(_elapsed) => {
                let timeout = self.settings.request_body_timeout;
                return self.reject(RequestOutcome::BadBody, Rejection::BodyTimeout { timeout });
            }
        };
        let fingerprint = self.policy.fingerprint.fingerprint(&parts, &body);
        let scope = self.policy.scope.scope(&parts);
        let record_key = RecordKey::new(&scope, key.as_str());
        self.log.set_key(record_key);
        let claim = Claim {
            arrived_at: now_millis(),
            key: record_key,
            fingerprint,
            // No claim yet.
            lease_ends: Instant::now(),
        };
        let request = Request::from_parts(parts, Body::from(body));
        let (respond, mut answer) = oneshot::channel();
        let tasks = self.settings.tasks.clone();
        let mut run = DetachOnDrop(Some(Box::pin(
            tasks.track_future(self.run(claim, request, respond)),
        )));
        let answer = std::future::poll_fn(|cx| {
            run.poll(cx);
            Pin::new(&mut answer).poll(cx)
        })
        .await;
        // Whatever the run still does after answering (storing a streamed
        // body) goes on in a task of its own, as it would if the client left.
        drop(run);
        answer.unwrap_or_else(|_| Rejection::Internal.into_response(Default::default()))
    }

    fn reject(self, outcome: RequestOutcome, rejection: Rejection) -> Response<Body> {
        let response = rejection.into_response(self.policy.profile);
        self.log.finish(outcome, &response);
        response
    }

    /// Sends `response` to the client (if it still listens) and logs.
    fn answer(self, respond: Responder, outcome: RequestOutcome, response: Response<Body>) {
        self.log.finish(outcome, &response);
        let _ = respond.send(response);
    }

    /// Answers with a response of the upstream's whose body may still be
    /// arriving, as a passthrough's does: the body holds the request's
    /// `max_in_flight` slot until it is done and is cut off at `deadline`,
    /// so an upstream that stalls mid-body cannot hold either for good.
    fn answer_relayed(
        self,
        respond: Responder,
        outcome: RequestOutcome,
        response: Response<Body>,
        deadline: Instant,
    ) {
        let Self { log, permit, .. } = self;
        log.finish(outcome, &response);
        let _ = respond.send(response.map(|body| holding(body, permit, deadline)));
    }

    fn answer_rejection(self, respond: Responder, outcome: RequestOutcome, rejection: Rejection) {
        let response = rejection.into_response(self.policy.profile);
        self.answer(respond, outcome, response);
    }

    async fn run(mut self, claim: Claim, request: Request<Body>, respond: Responder) {
        let begin = Begin {
            key: claim.key,
            fingerprint: claim.fingerprint,
            lease: self.policy.lease,
            ttl: self.policy.ttl,
            on_stale: self.policy.on_stale,
        };
        let wait_until = Instant::now() + self.policy.wait_timeout;
        let mut backoff = Duration::from_millis(10);
        // Set once the store said that this same request is running under
        // the key (`on_in_flight = "wait"` asks again): from then on a
        // store failure is no reason to forward it, whatever
        // `on_store_error` says, since that would run it a second time.
        let mut seen_in_flight = false;
        loop {
            // Draining (the tracker is closed when shutdown begins): an
            // execution started now might outlive the drain and be cut off
            // holding its key, which would then settle as outcome-unknown.
            if self.settings.tasks.is_closed() {
                return self.answer_rejection(
                    respond,
                    RequestOutcome::ShuttingDown,
                    Rejection::ShuttingDown,
                );
            }
            let asked_at = Instant::now();
            let mut call = owned_begin(&self.settings.store, &begin);
            let begun = timed(&self.settings, &mut self.log, "begin", |_| &mut call).await;
            match begun {
                Err(e) => {
                    let pass = self.passes(&e) && !seen_in_flight;
                    // Timed out, the call may still claim the key. Rejected,
                    // this request executes nothing, so such a claim only
                    // blocks the retry: released once it shows up. (Passed
                    // on unprotected, the request does execute; its claim
                    // is then left to fail closed.)
                    let late = (!call.is_terminated() && !pass)
                        .then(|| (self.settings.store.clone(), self.policy.lease));
                    self.store_failed(request, respond, e, pass).await;
                    if let Some((store, lease)) = late {
                        release_late_claim(store, claim.key, call, lease).await;
                    }
                    return;
                }
                Ok(BeginOutcome::Acquired { token, took_over }) => {
                    if took_over {
                        self.log.metrics().lease_expired();
                        tracing::warn!(key = %claim.key.to_hex(), "took over a stale key (on_stale = \"retry\")");
                    }
                    let claim = Claim {
                        lease_ends: asked_at + self.policy.lease,
                        ..claim
                    };
                    return self.execute(claim, request, token, respond).await;
                }
                Ok(BeginOutcome::Completed(record)) => {
                    let response = replay(&record, &self.policy);
                    return self.answer(respond, RequestOutcome::Replayed, response);
                }
                Ok(BeginOutcome::Settled(record)) => {
                    self.log.metrics().lease_expired();
                    tracing::warn!(key = %claim.key.to_hex(), "settled a stale key as outcome-unknown (its holder died mid-call)");
                    // This request is the one that found the claim abandoned:
                    // counted as the unknown outcome it answers, so the alert
                    // on `outcome_unknown` sees a proxy that died mid-call.
                    // Later retries replay the record.
                    let response = replay(&record, &self.policy);
                    return self.answer(respond, RequestOutcome::OutcomeUnknown, response);
                }
                Ok(BeginOutcome::Mismatch { state }) => {
                    return self.answer_rejection(
                        respond,
                        RequestOutcome::Mismatch,
                        Rejection::KeyReused { state },
                    );
                }
                Ok(BeginOutcome::InFlight { lease_expires_at }) => {
                    let now = Instant::now();
                    if self.policy.on_in_flight == OnInFlight::Wait
                        && now < wait_until
                        && !respond.is_closed()
                    {
                        seen_in_flight = true;
                        // Polling `begin` is one round trip per look, works
                        // across replicas, and takes the key over at once if
                        // the first request released it.
                        tokio::time::sleep(backoff.min(wait_until - now)).await;
                        backoff = (backoff * 2).min(Duration::from_millis(250));
                        continue;
                    }
                    let remaining =
                        Duration::from_millis(lease_expires_at.saturating_sub(now_millis()));
                    let retry_after =
                        remaining.clamp(Duration::from_millis(100), Duration::from_secs(1));
                    return self.answer_rejection(
                        respond,
                        RequestOutcome::InFlight,
                        Rejection::InFlight { retry_after },
                    );
                }
            }
        }
    }

    /// Whether `on_store_error` forwards a request unprotected after
    /// `error`. `pass` trades protection for availability while the store
    /// cannot answer, and only then. Any other error means the store did
    /// answer: a record it returned but this build cannot read is a key that
    /// is there, maybe with a side effect already done behind it, so
    /// forwarding could repeat it. Fail closed.
    fn passes(&self, error: &StoreError) -> bool {
        self.policy.on_store_error == OnStoreError::Pass
            && matches!(error, StoreError::Unavailable(_))
    }

    /// Answers a request whose `begin` failed: 503, or forwarded
    /// unprotected when `pass` (see [`Self::passes`]).
    async fn store_failed(
        mut self,
        request: Request<Body>,
        respond: Responder,
        error: StoreError,
        pass: bool,
    ) {
        tracing::error!(error = %error, route = %self.policy.route, "idempotency store failed");
        if !pass {
            return self.answer_rejection(
                respond,
                RequestOutcome::StoreUnavailable,
                Rejection::StoreUnavailable {
                    retry_after: Duration::from_secs(1),
                },
            );
        }
        // Forwarded without protection, as the operator chose; the outcome
        // says so in logs and metrics.
        let started = Instant::now();
        let deadline = started + self.settings.upstream_timeout;
        let result = self.inner.clone().oneshot(request).await;
        self.upstream_done(started);
        let response = result.unwrap_or_else(|e| {
            Rejection::PassthroughFailed {
                timeout: e.into().is_timeout(),
            }
            .into_response(self.policy.profile)
        });
        self.answer_relayed(respond, RequestOutcome::Unprotected, response, deadline)
    }

    async fn execute(
        mut self,
        claim: Claim,
        request: Request<Body>,
        token: FencingToken,
        respond: Responder,
    ) {
        // Counted until the outcome is stored (this function awaits the
        // streaming of the body too).
        let _executing = self.settings.metrics.executing();
        let deadline = Instant::now() + self.settings.upstream_timeout;
        let started = Instant::now();
        self.log.set_unsettled(true);
        let result = self.inner.clone().oneshot(request).await;
        self.upstream_done(started);
        let response = match result.map_err(Into::into) {
            Ok(response) => response,
            Err(UpstreamFailure::NotSent(why)) => {
                tracing::warn!(error = %why, "upstream unreachable; releasing the key");
                self.release(&claim, token).await;
                return self.answer_rejection(
                    respond,
                    RequestOutcome::UpstreamUnreachable,
                    Rejection::UpstreamUnreachable,
                );
            }
            Err(UpstreamFailure::TimedOut) => {
                return self
                    .ambiguous(claim, token, UnknownCause::Timeout, respond)
                    .await
            }
            Err(UpstreamFailure::Broken(why)) => {
                tracing::warn!(error = %why, "upstream connection broke after the request was sent");
                return self
                    .ambiguous(claim, token, UnknownCause::Reset, respond)
                    .await;
            }
        };
        let status = response.status().as_u16();
        if self.policy.releases(status) {
            self.release(&claim, token).await;
            return self.answer_relayed(respond, RequestOutcome::Released, response, deadline);
        }
        self.stream_and_store(claim, token, response, deadline, respond)
            .await
    }

    /// Relays the upstream's response while keeping a bounded copy, and
    /// stores the outcome before the client can see the body end, so a
    /// retry sent on receipt finds the record.
    ///
    /// A small body of declared length that is already there with the head
    /// (the usual API answer) is read whole and sent in one piece after
    /// storing: one hand-off instead of one per frame. Any other body streams
    /// as it comes; as a client knows a body with a `Content-Length` is
    /// complete once it has that many bytes, the frame that completes it is
    /// held back until the outcome is stored.
    async fn stream_and_store(
        mut self,
        claim: Claim,
        token: FencingToken,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) {
        let (head, mut upstream_body) = response.into_parts();
        let status = head.status.as_u16();
        self.log.set_status(status);
        let stored_headers = stored_headers(&head.headers);
        let declared = head
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let small = declared
            .is_some_and(|len| len <= WHOLE_BODY_LIMIT.min(self.policy.max_response_bytes as u64))
            || head.status == http::StatusCode::NO_CONTENT
            || head.status == http::StatusCode::NOT_MODIFIED;
        let mut copy = BoundedCopy::new(self.policy.max_response_bytes);

        // Frames read before deciding to stream, and how the body ended if it
        // already did.
        let mut early = Vec::new();
        let mut ended = None;
        if small {
            loop {
                let next = if early.is_empty() {
                    match tokio::time::timeout_at(deadline, upstream_body.frame()).await {
                        Ok(next) => next,
                        Err(_elapsed) => {
                            ended = Some(false);
                            break;
                        }
                    }
                } else {
                    // Only what is already there: a body that trickles in
                    // is streamed instead.
                    match upstream_body.frame().now_or_never() {
                        Some(next) => next,
                        None => break,
                    }
                };
                match next {
                    None => {
                        ended = Some(true);
                        break;
                    }
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            copy.push(data);
                        }
                        early.push(frame);
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "upstream response body broke off");
                        ended = Some(false);
                        break;
                    }
                }
            }
        }
        if let Some(complete_body) = ended {
            let body = if complete_body { copy.finish() } else { None };
            let client_body = match &body {
                Some(body) => Body::from(body.clone()),
                None => broken_body(),
            };
            self.complete(&claim, token, stored_outcome(status, stored_headers, body))
                .await;
            let _ = respond.send(Response::from_parts(head, client_body));
            return self.log.finish_streamed(RequestOutcome::Executed);
        }

        let (tx, client_body) = channel_body(16);
        let _ = respond.send(Response::from_parts(head, client_body));
        let mut client = Some(tx);
        let mut relayed = 0u64;
        let mut held_frames = Vec::new();
        // Frames the client could not take yet. While the copy is whole
        // they are buffers it shares, so this holds no more than
        // `max_response_bytes` of its own.
        let mut backlog = VecDeque::new();
        let mut early = early.into_iter();
        let complete_body = loop {
            let frame = if let Some(frame) = early.next() {
                // Already in the copy.
                frame
            } else {
                let read = loop {
                    let Some(tx) = client.as_ref().filter(|_| !backlog.is_empty()) else {
                        break tokio::time::timeout_at(deadline, upstream_body.frame()).await;
                    };
                    // What the client could not take yet goes to it as it
                    // makes room, while the upstream is read: a client that
                    // catches up must not wait for the upstream's next frame
                    // (a stream of events may pause between them).
                    let fed = tokio::select! {
                        read = tokio::time::timeout_at(deadline, upstream_body.frame()) => Err(read),
                        sent = tx.send_front(&mut backlog) => Ok(sent),
                    };
                    match fed {
                        Err(read) => break read,
                        Ok(true) => {}
                        Ok(false) => {
                            // Gone: what waited for it is only the copy's now.
                            client = None;
                            backlog.clear();
                        }
                    }
                };
                match read {
                    Err(_elapsed) => break false,
                    Ok(None) => break true,
                    Ok(Some(Err(e))) => {
                        tracing::warn!(error = %e, "upstream response body broke off");
                        break false;
                    }
                    Ok(Some(Ok(frame))) => {
                        if let Some(data) = frame.data_ref() {
                            copy.push(data);
                        }
                        frame
                    }
                }
            };
            if let Some(data) = frame.data_ref() {
                relayed += data.len() as u64;
            }
            if declared.is_some_and(|len| relayed >= len) {
                held_frames.push(frame);
                continue;
            }
            if let Some(tx) = &client {
                backlog.push_back(frame);
                let keeps_up = if copy.is_whole() {
                    // The copy is what gets stored, so a client that stops
                    // reading must not hold up the upstream read: waiting for
                    // it would use up the deadline, and a response the
                    // upstream sent in time would be stored as incomplete.
                    tx.offer(&mut backlog)
                } else {
                    // Past the cap only the status is stored, whatever the
                    // client does: it sets the pace, up to the deadline,
                    // after which it is dropped, unfinished, so its body
                    // aborts.
                    tx.send_all(&mut backlog, deadline).await
                };
                if !keeps_up {
                    client = None;
                    backlog.clear();
                }
            }
        };
        let body = if complete_body { copy.finish() } else { None };
        self.complete(&claim, token, stored_outcome(status, stored_headers, body))
            .await;
        if let Some(tx) = client {
            if complete_body {
                backlog.extend(held_frames);
                if tx.send_all(&mut backlog, deadline).await {
                    tx.finish();
                }
            } else {
                // Unfinished, the body aborts once the client has read what
                // was sent; the error says why if there is room for it (a
                // client that reads nothing must not hold this run).
                let _ = tx.try_send(Err("upstream response body did not complete".into()));
            }
        }
        self.log.finish_streamed(RequestOutcome::Executed);
    }

    /// The request may have executed: settle the key as unknown (fail
    /// closed) or release it, as `on_ambiguous` says.
    async fn ambiguous(
        mut self,
        claim: Claim,
        token: FencingToken,
        cause: UnknownCause,
        respond: Responder,
    ) {
        let released = self.policy.on_ambiguous == OnAmbiguous::Release;
        if released {
            self.release(&claim, token).await;
        } else {
            self.complete(&claim, token, Outcome::Unknown { cause })
                .await;
        }
        self.answer_rejection(
            respond,
            RequestOutcome::OutcomeUnknown,
            Rejection::OutcomeUnknown { cause, released },
        )
    }

    async fn complete(&mut self, claim: &Claim, token: FencingToken, outcome: Outcome) {
        let now = now_millis();
        let record = CompletedRecord {
            fingerprint: claim.fingerprint,
            created_at: claim.arrived_at,
            completed_at: now,
            expires_at: now.saturating_add(millis(self.policy.ttl)),
            outcome,
        };
        self.settle(claim, token, Settling::Complete(record)).await;
    }

    fn upstream_done(&mut self, started: Instant) {
        self.log.upstream_done(started.elapsed());
    }

    async fn release(&mut self, claim: &Claim, token: FencingToken) {
        self.settle(claim, token, Settling::Release).await;
    }

    /// Completes or releases the key this request holds. A transient store
    /// error must not turn a known outcome into an unknown one (nor keep a
    /// released key held), so the call is retried: briefly here, while the
    /// client waits, then in the background (see [`Self::settle_late`]).
    async fn settle(&mut self, claim: &Claim, token: FencingToken, settling: Settling) {
        if !self.settle_inline(claim, token, &settling).await {
            self.settle_late(claim, token, settling);
        }
        // Settled, now or by `settle_late`.
        self.log.set_unsettled(false);
    }

    /// The tries made while the client waits; whether they settled the key.
    async fn settle_inline(
        &mut self,
        claim: &Claim,
        token: FencingToken,
        settling: &Settling,
    ) -> bool {
        for attempt in 0..INLINE_SETTLE_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(settle_backoff(attempt - 1)).await;
            }
            let result = timed(&self.settings, &mut self.log, settling.op(), |s| {
                settling.call(s, &claim.key, token)
            })
            .await;
            let metrics = self.log.metrics();
            if settled(
                &self.settings,
                metrics,
                &claim.key,
                settling,
                result,
                attempt,
            )
            .await
            {
                return true;
            }
        }
        false
    }

    /// Goes on settling the key in a task of its own once the client has
    /// had its answer, until the store takes it or the claim's lease ends
    /// (then the key is the next retry's to settle, per `on_stale`, and this
    /// request's token is no good anyway). Without it, a store that failed
    /// for a second or two, a Redis failover say, left the key pending:
    /// retries got 425 until the lease ran out, then `outcome-unknown`
    /// for a request whose outcome the proxy had (or, for a release, that
    /// a retry could have run safely).
    ///
    /// The task keeps this request's `max_in_flight` permit: a store that
    /// keeps failing cannot gather more of them than requests were allowed.
    fn settle_late(&mut self, claim: &Claim, token: FencingToken, settling: Settling) {
        let settings = self.settings.clone();
        let route_metrics = self.log.metrics().clone();
        let permit = self.permit.split(self.permit.num_permits());
        let counted = self.settings.metrics.settling();
        let (key, lease_ends) = (claim.key, claim.lease_ends);
        self.settings.tasks.spawn(async move {
            // The gauge goes down before the slot is free.
            let _held = (counted, permit);
            for attempt in INLINE_SETTLE_ATTEMPTS.. {
                let remaining = lease_ends.saturating_duration_since(Instant::now());
                tokio::time::sleep(settle_backoff(attempt - 1).min(remaining)).await;
                // One call at a time, waited for until the lease ends rather
                // than `store.timeout`: a call given up on can still be
                // queued in the store (the embedded store's writer), and a
                // new one each time would queue a copy of the record each.
                let limit = lease_ends.saturating_duration_since(Instant::now());
                if limit.is_zero() {
                    tracing::error!(
                        key = %key.to_hex(),
                        "gave up settling the key: its lease ended, and the next retry settles it per on_stale"
                    );
                    return;
                }
                let call = settling.call(&*settings.store, &key, token);
                let result = bounded(&settings, settling.op(), limit, call).await;
                let stored = result.is_ok();
                if settled(&settings, &route_metrics, &key, &settling, result, attempt).await {
                    if stored {
                        tracing::warn!(key = %key.to_hex(), op = settling.op(), attempt, "settled the key after the store came back");
                    }
                    return;
                }
            }
        });
    }
}

/// `complete` and `release` are tried this many times while the client
/// waits for its answer (~150 ms of pauses between them), then in the
/// background until the lease ends (see `Exchange::settle_late`).
const INLINE_SETTLE_ATTEMPTS: u32 = 3;

/// The pause after failed settling attempt `attempt` (from 0): 50 ms,
/// doubling, at most 1.6 s.
fn settle_backoff(attempt: u32) -> Duration {
    Duration::from_millis(50 << attempt.min(5))
}

/// What a request that holds a key still has to tell the store.
enum Settling {
    Complete(CompletedRecord),
    Release,
}

impl Settling {
    fn op(&self) -> &'static str {
        match self {
            Settling::Complete(_) => "complete",
            Settling::Release => "release",
        }
    }

    async fn call(
        &self,
        store: &dyn Store,
        key: &RecordKey,
        token: FencingToken,
    ) -> Result<(), StoreError> {
        match self {
            Settling::Complete(record) => store.complete(key, token, record).await,
            Settling::Release => store.release(key, token).await,
        }
    }
}

/// Whether one settling call's `result` ends the settling: it succeeded,
/// or the store says the key is not this request's any more, or holds
/// something asking again will not change. Otherwise it is logged, to be
/// tried again.
async fn settled(
    settings: &Settings,
    route_metrics: &RouteMetrics,
    key: &RecordKey,
    settling: &Settling,
    result: Result<(), StoreError>,
    attempt: u32,
) -> bool {
    let op = settling.op();
    match result {
        Ok(()) => {
            if let Settling::Release = settling {
                route_metrics.key_released();
            }
            true
        }
        Err(StoreError::Fenced) => {
            if let Settling::Complete(record) = settling {
                fenced(settings, key, record).await;
            }
            true
        }
        Err(e @ StoreError::Corrupt(_)) => {
            tracing::error!(error = %e, op, "could not settle the key");
            true
        }
        Err(e) => {
            tracing::error!(error = %e, op, attempt, "could not settle the key");
            false
        }
    }
}

/// A completion refused as not the key's holder's: either an earlier try
/// of the same completion got there first (it timed out here but went on in
/// the store, or the cluster client sent it twice), or the key was lost.
/// Only the second is worth an error.
async fn fenced(settings: &Settings, key: &RecordKey, record: &CompletedRecord) {
    let stored = tokio::time::timeout(settings.store_timeout, settings.store.get(key)).await;
    if let Ok(Ok(Some(Record::Completed(done)))) = &stored {
        if done.fingerprint == record.fingerprint && done.completed_at == record.completed_at {
            return;
        }
    }
    tracing::error!(
        key = %key.to_hex(),
        "lost the key before completing it (lease expired and another request took it over)"
    );
}

/// A `begin` that owns what it needs, so that it can outlive the caller's
/// wait (see [`release_late_claim`]); fused, to tell whether it finished.
type OwnedBegin = Fuse<BoxFuture<'static, Result<BeginOutcome, StoreError>>>;

fn owned_begin(store: &SharedStore, begin: &Begin) -> OwnedBegin {
    let (store, begin) = (store.clone(), begin.clone());
    async move { store.begin(&begin).await }.boxed().fuse()
}

/// Finishes a `begin` that gave no answer within `store.timeout`, after its
/// request was answered 503 without executing. If it turns out to have
/// claimed the key, the claim is released: otherwise the caller's retry
/// would find the key in flight and, once the lease ran out, settled as
/// outcome-unknown, for a request that never ran. Waits at most a lease
/// (after that the claim is stale anyway).
async fn release_late_claim(store: SharedStore, key: RecordKey, call: OwnedBegin, lease: Duration) {
    let Ok(Ok(BeginOutcome::Acquired { token, .. })) = tokio::time::timeout(lease, call).await
    else {
        return;
    };
    match tokio::time::timeout(lease, store.release(&key, token)).await {
        Ok(Ok(())) => tracing::warn!(
            key = %key.hex(),
            "released a claim whose begin answered after store.timeout (its request was answered 503 and not executed)"
        ),
        Ok(Err(StoreError::Fenced)) => {}
        Ok(Err(e)) => tracing::error!(
            key = %key.hex(),
            error = %e,
            "could not release a claim whose begin answered late; it fails closed when its lease ends"
        ),
        Err(_) => tracing::error!(
            key = %key.hex(),
            "no answer releasing a claim whose begin answered late; it fails closed when its lease ends"
        ),
    }
}

/// Every store call is bounded by `store.timeout` and timed for the log.
async fn timed<'a, T, F>(
    settings: &'a Settings,
    log: &mut RequestLog,
    op: &'static str,
    call: impl FnOnce(&'a dyn Store) -> F,
) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>> + 'a,
{
    let started = Instant::now();
    let result = bounded(settings, op, settings.store_timeout, call(&*settings.store)).await;
    log.add_store_time(started.elapsed());
    result
}

/// A store call bounded by `limit` and counted in the metrics.
async fn bounded<T>(
    settings: &Settings,
    op: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = Instant::now();
    let result = match tokio::time::timeout(limit, call).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Unavailable(format!(
            "no answer within {limit:?}"
        ))),
    };
    settings.metrics.store_call(
        op,
        started.elapsed(),
        result.is_ok() || matches!(result, Err(StoreError::Fenced)),
    );
    result
}

/// Bodies up to this size, with a declared length, are relayed in one piece
/// after the outcome is stored (see `stream_and_store`).
const WHOLE_BODY_LIMIT: u64 = 64 * 1024;

/// What is kept of an executed request: the whole response, or only its
/// status when the body was too large or broke off.
fn stored_outcome(status: u16, headers: Vec<(String, Bytes)>, body: Option<Bytes>) -> Outcome {
    match body {
        Some(body) => Outcome::Response(StoredResponse {
            status,
            headers,
            body,
        }),
        None => Outcome::NotStored { status },
    }
}

/// A body that fails at once: the client sees a broken response rather than
/// a complete-looking truncated one.
fn broken_body() -> Body {
    let (tx, body) = channel_body(1);
    let _ = tx.try_send(Err("upstream response body did not complete".into()));
    body
}

/// Builds the answer to a retry from the key's completed record.
fn replay(record: &CompletedRecord, policy: &Policy) -> Response<Body> {
    let mut response = match &record.outcome {
        Outcome::Response(stored) => {
            let mut response = Response::new(Body::from(stored.body.clone()));
            *response.status_mut() =
                http::StatusCode::from_u16(stored.status).unwrap_or(http::StatusCode::BAD_GATEWAY);
            let headers = response.headers_mut();
            headers.reserve(stored.headers.len() + 2);
            for (name, value) in &stored.headers {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_maybe_shared(value.clone()),
                ) {
                    headers.append(name, value);
                }
            }
            response
        }
        Outcome::NotStored { status } => {
            Rejection::ResponseNotStored { status: *status }.into_response(policy.profile)
        }
        Outcome::Unknown { cause } => Rejection::OutcomeUnknown {
            cause: *cause,
            released: false,
        }
        .into_response(policy.profile),
    };
    let headers = response.headers_mut();
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let date = httpdate::fmt_http_date(from_millis(record.completed_at));
    // The formatted text becomes the value as it is, not a copy of it.
    if let Ok(date) = HeaderValue::from_maybe_shared(Bytes::from(date)) {
        headers.insert(IDEMPOTENCY_ORIGINAL_DATE, date);
    }
    response
}

/// The headers a replay carries: the upstream's end-to-end headers (the
/// upstream client already removed hop-by-hop ones).
fn stored_headers(headers: &http::HeaderMap) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}
