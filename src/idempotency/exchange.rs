//! One covered request from its body to its answer: claim the key
//! (`begin`), then replay, reject, wait, or execute; what executing
//! forwards and how its outcome is relayed and settled live in [`relay`]
//! and [`settle`].
//!
//! [`relay`]: super::relay
//! [`settle`]: super::settle

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use tokio::sync::{oneshot, OwnedSemaphorePermit};
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use super::body::{holding, read_request_body};
use super::detach::DetachOnDrop;
use super::layer::Settings;
use super::mcp_call::McpCall;
use super::policy::{OnAmbiguous, OnInFlight, OnStoreError, Policy};
use super::rejection::Rejection;
use super::replay::replay;
use super::settle::Settling;
use super::store_call::{owned_begin, release_unanswered_claim, timed};
use crate::core::{
    millis, Begin, BeginOutcome, CompletedRecord, FencingToken, Fingerprint, Outcome, RecordKey,
    UnknownCause, UpstreamFailure,
};
use crate::observe::{trace, RequestLog, RequestOutcome};
use crate::request::key::IdempotencyKey;
use crate::request::key_source::KeyRefusal;
use crate::request::scope::ScopeError;
use crate::store::StoreError;

/// One covered request, from its body to its stored outcome.
pub(super) struct Exchange<S> {
    pub(super) settings: Arc<Settings>,
    pub(super) policy: Arc<Policy>,
    pub(super) inner: S,
    pub(super) log: RequestLog,
    /// Held until the exchange ends (see `Settings::in_flight`), or handed
    /// to the task that settles its key late (`settle_late`).
    pub(super) permit: OwnedSemaphorePermit,
    /// Set for a protected MCP `tools/call`: how its answers are made.
    pub(super) mcp: Option<McpCall>,
}

/// The identity of a covered request, carried into the task that runs it.
#[derive(Clone, Copy)]
pub(super) struct Claim {
    /// When the request arrived: the record's `created_at`.
    pub(super) arrived_at: u64,
    pub(super) key: RecordKey,
    pub(super) fingerprint: Fingerprint,
    /// When the claim this request holds is presumed dead, counted from
    /// the instant it asked for the key (no later than the store's own
    /// `now`): set when `begin` acquires the key.
    pub(super) lease_ends: Instant,
}

pub(super) type Responder = oneshot::Sender<Response<Body>>;

/// How a duplicate waits for the request in flight under its key
/// (`on_in_flight = "wait"`): polling `begin`, with a growing pause.
struct Waiting {
    until: Instant,
    backoff: Duration,
    /// Set once the store said that this same request is running under
    /// the key: from then on a store failure is no reason to forward it,
    /// whatever `on_store_error` says, since that would run it a second
    /// time.
    seen_in_flight: bool,
}

impl Waiting {
    fn new(timeout: Duration) -> Self {
        Self {
            until: Instant::now() + timeout,
            backoff: Duration::from_millis(10),
            seen_in_flight: false,
        }
    }

    /// Pauses before the next look, or says the wait is over (its time is
    /// up, or the client left).
    async fn pause(&mut self, respond: &Responder) -> bool {
        let now = Instant::now();
        if now >= self.until || respond.is_closed() {
            return false;
        }
        self.seen_in_flight = true;
        // Polling `begin` is one round trip per look, works across
        // replicas, and takes the key over at once if the first request
        // released it.
        tokio::time::sleep(self.backoff.min(self.until - now)).await;
        self.backoff = (self.backoff * 2).min(Duration::from_millis(250));
        true
    }
}

impl<S> Exchange<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
{
    /// Runs on the connection's task: reads the body, then drives the run
    /// until it answers (see [`DetachOnDrop`]). Without a `key` from the
    /// head, the body names it (`json:` sources, derived keys), or the
    /// request has none.
    pub(super) async fn start(
        self,
        req: Request<Body>,
        key: Option<IdempotencyKey>,
    ) -> Response<Body> {
        let (parts, body) = req.into_parts();
        if self.policy.observe.is_some() {
            return self.start_observed(parts, body, key).await;
        }
        // Who calls, before reading a body for a caller that cannot say.
        let scope = match self.scope_of(&parts) {
            Ok(scope) => scope,
            Err((outcome, rejection)) => return self.reject(outcome, rejection),
        };
        let body = match self.read_body(&parts, body).await {
            Ok(body) => body,
            Err((outcome, rejection)) => return self.reject(outcome, rejection),
        };
        let key = match key
            .map(Ok)
            .or_else(|| self.policy.keys.from_request(&parts, &body).transpose())
        {
            Some(Ok(key)) => key,
            Some(Err(KeyRefusal::Invalid(invalid))) => {
                return self.reject(RequestOutcome::InvalidKey, Rejection::InvalidKey(invalid))
            }
            Some(Err(KeyRefusal::UnreadableBody { at })) => {
                return self.reject(RequestOutcome::BadBody, Rejection::InvalidBody { at })
            }
            None if self.policy.require_key => {
                return self.reject(RequestOutcome::MissingKey, Rejection::MissingKey)
            }
            None => {
                return self
                    .forward_untouched(parts, Body::from(body), RequestOutcome::Passthrough)
                    .await
            }
        };
        let fingerprint = self.policy.fingerprint.fingerprint(&parts, &body);
        let request = Request::from_parts(parts, Body::from(body));
        self.claim_and_run(&scope, &key, fingerprint, request).await
    }

    /// Forwards a request the proxy does not protect, as it came, and
    /// counts it as `outcome`.
    pub(super) async fn forward_untouched(
        self,
        parts: http::request::Parts,
        body: Body,
        outcome: RequestOutcome,
    ) -> Response<Body> {
        let deadline = Instant::now() + self.settings.upstream_timeout;
        let request = Request::from_parts(parts, body);
        let response = match self.inner.clone().oneshot(request).await {
            Ok(response) => response,
            Err(e) => Rejection::PassthroughFailed {
                timeout: e.into().is_timeout(),
            }
            .into_response(self.policy.profile),
        };
        let Self { log, permit, .. } = self;
        log.finish(outcome, &response);
        response.map(|body| holding(body, permit, deadline))
    }

    /// The request's scope, or why a caller that cannot say who it is is
    /// refused.
    pub(super) fn scope_of(
        &self,
        parts: &http::request::Parts,
    ) -> Result<[u8; 32], (RequestOutcome, Rejection)> {
        let rejection = match self.policy.scope.scope(parts) {
            Ok(scope) => return Ok(scope),
            Err(ScopeError::InvalidToken(why)) => Rejection::InvalidToken { why },
            Err(ScopeError::MissingIdentity) => Rejection::MissingIdentity,
        };
        Err((RequestOutcome::Unauthenticated, rejection))
    }

    /// The whole request body, under `max_request_bytes` and the body
    /// timeout, or the answer that refuses it.
    pub(super) fn read_body(
        &self,
        parts: &http::request::Parts,
        body: Body,
    ) -> impl Future<Output = Result<bytes::Bytes, (RequestOutcome, Rejection)>> + Send + 'static
    {
        // Owns what it needs: the exchange is not `Sync`.
        let timeout = self.settings.request_body_timeout;
        let declared = crate::http::headers::content_length(&parts.headers);
        let read = read_request_body(declared, body, self.policy.max_request_bytes);
        async move {
            let rejection = match tokio::time::timeout(timeout, read).await {
                Ok(Ok(body)) => return Ok(body),
                Ok(Err(rejection)) => rejection,
                Err(_elapsed) => Rejection::BodyTimeout { timeout },
            };
            Err((RequestOutcome::BadBody, rejection))
        }
    }

    /// Claims `key` in `scope` for `request` (its body read, its
    /// fingerprint taken) and drives the run until it answers.
    pub(super) async fn claim_and_run(
        mut self,
        scope: &[u8; 32],
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        request: Request<Body>,
    ) -> Response<Body> {
        let record_key = RecordKey::new(scope, key.as_str());
        self.log.set_key(record_key);
        let claim = Claim {
            arrived_at: self.settings.clock.now_millis(),
            key: record_key,
            fingerprint,
            // No claim yet.
            lease_ends: Instant::now(),
        };
        let (respond, mut answer) = oneshot::channel();
        let tasks = self.settings.tasks.clone();
        // The request's span goes with the run, into its own task too.
        let span = self.log.span().clone();
        let mut run = DetachOnDrop::new(trace::boxed_in(
            span,
            tasks.track_future(self.run(claim, request, respond)),
        ));
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

    pub(super) fn reject(self, outcome: RequestOutcome, rejection: Rejection) -> Response<Body> {
        let response = self.render(rejection);
        self.log.finish(outcome, &response);
        response
    }

    /// Sends `response` to the client (if it still listens) and logs.
    pub(super) fn answer(
        self,
        respond: Responder,
        outcome: RequestOutcome,
        response: Response<Body>,
    ) {
        self.log.finish(outcome, &response);
        let _ = respond.send(response);
    }

    /// Answers with a response of the upstream's whose body may still be
    /// arriving, as a passthrough's does: the body holds the request's
    /// `max_in_flight` slot until it is done and is cut off at `deadline`,
    /// so an upstream that stalls mid-body cannot hold either for good.
    pub(super) fn answer_relayed(
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

    pub(super) fn answer_rejection(
        self,
        respond: Responder,
        outcome: RequestOutcome,
        rejection: Rejection,
    ) {
        let response = self.render(rejection);
        self.answer(respond, outcome, response);
    }

    /// A refusal as this request's client reads it: a problem, or for an
    /// MCP tool call, a tool result the model can act on.
    fn render(&self, rejection: Rejection) -> Response<Body> {
        match self
            .mcp
            .as_ref()
            .and_then(|call| call.rejection(&rejection))
        {
            Some(response) => response,
            None => rejection.into_response(self.policy.profile),
        }
    }

    /// The answer to a retry from the key's completed record.
    fn replay(&self, record: &CompletedRecord) -> Response<Body> {
        match &self.mcp {
            Some(call) => call.replay(record),
            None => replay(record, &self.policy),
        }
    }

    /// Claims the key, or answers from what the store holds for it; with
    /// `on_in_flight = "wait"`, asks again until the request in flight is
    /// done or the wait is over.
    async fn run(mut self, claim: Claim, request: Request<Body>, respond: Responder) {
        let begin = Begin {
            key: claim.key,
            fingerprint: claim.fingerprint,
            lease: self.policy.lease,
            ttl: self.policy.ttl,
            on_stale: self.policy.on_stale,
            token: FencingToken::random(),
        };
        let mut waiting = Waiting::new(self.policy.wait_timeout);
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
            let outcome = match begun {
                Ok(outcome) => outcome,
                Err(e) => {
                    // Observe mode never lets the store stop a request.
                    let observe = self.policy.observe.is_some();
                    let pass = (self.passes(&e) || observe) && !waiting.seen_in_flight;
                    // Failed or late, the call may have claimed the key all
                    // the same. Rejected, this request executes nothing, so
                    // such a claim only blocks the retry: released by its
                    // token. (Passed on unprotected, the request does
                    // execute; its claim is then left to fail closed.)
                    // A store that reports a record it cannot read did
                    // read the key, and claims nothing over a record.
                    if !pass && !matches!(e, StoreError::Corrupt(_)) {
                        let lease_ends = asked_at + self.policy.lease;
                        release_unanswered_claim(&self.settings, &begin, call, lease_ends);
                    }
                    return self.store_failed(request, respond, e, pass).await;
                }
            };
            match outcome {
                BeginOutcome::Acquired { token, took_over } => {
                    if took_over {
                        self.log.metrics().lease_expired();
                        tracing::warn!(key = %claim.key.to_hex(), "took over a stale key (on_stale = \"retry\")");
                    }
                    let claim = Claim {
                        lease_ends: asked_at + self.policy.lease,
                        ..claim
                    };
                    if let Some(observe) = &self.policy.observe {
                        observe.remember(claim.key, self.log.request_id());
                    }
                    return self.execute(claim, request, token, respond).await;
                }
                _ if self.policy.observe.is_some() => {
                    return self
                        .forward_observed(&claim, outcome, request, respond)
                        .await
                }
                BeginOutcome::InFlight { lease_expires_at } => {
                    if self.policy.on_in_flight == OnInFlight::Wait && waiting.pause(&respond).await
                    {
                        continue;
                    }
                    return self.in_flight(respond, lease_expires_at);
                }
                BeginOutcome::Completed(record) => {
                    let response = self.replay(&record);
                    return self.answer(respond, RequestOutcome::Replayed, response);
                }
                BeginOutcome::Settled(record) => {
                    return self.settled_stale(&claim, respond, &record)
                }
                BeginOutcome::Mismatch { state } => {
                    return self.answer_rejection(
                        respond,
                        RequestOutcome::Mismatch,
                        Rejection::KeyReused { state },
                    )
                }
            }
        }
    }

    /// Answers the request whose `begin` found the key's claim abandoned
    /// and settled it as outcome-unknown.
    fn settled_stale(self, claim: &Claim, respond: Responder, record: &CompletedRecord) {
        self.log.metrics().lease_expired();
        tracing::warn!(key = %claim.key.to_hex(), "settled a stale key as outcome-unknown (its holder died mid-call)");
        // This request is the one that found the claim abandoned: counted
        // as the unknown outcome it answers, so the alert on
        // `outcome_unknown` sees a proxy that died mid-call. Later retries
        // replay the record.
        let response = self.replay(record);
        self.answer(respond, RequestOutcome::OutcomeUnknown, response)
    }

    /// 425 (or 409): the same request holds the key, its lease ends at
    /// `lease_expires_at`.
    fn in_flight(self, respond: Responder, lease_expires_at: u64) {
        let now = self.settings.clock.now_millis();
        let remaining = Duration::from_millis(lease_expires_at.saturating_sub(now));
        let retry_after = remaining.clamp(Duration::from_millis(100), Duration::from_secs(1));
        self.answer_rejection(
            respond,
            RequestOutcome::InFlight,
            Rejection::InFlight { retry_after },
        )
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
        self,
        request: Request<Body>,
        respond: Responder,
        error: StoreError,
        pass: bool,
    ) {
        tracing::error!(error = %error, route = %self.policy.route, "idempotency store failed");
        // Permanent until an operator removes the record: a 503 would have
        // SDKs and agents retry it for the whole `ttl`.
        if !pass && matches!(error, StoreError::Corrupt(_)) {
            return self.answer_rejection(
                respond,
                RequestOutcome::RecordUnreadable,
                Rejection::RecordUnreadable,
            );
        }
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
        self.forward_unclaimed(request, respond, RequestOutcome::Unprotected, None)
            .await
    }

    /// Forwards a request that holds no claim, its answer relayed and
    /// counted as `outcome`: nothing of it is stored.
    pub(super) async fn forward_unclaimed(
        mut self,
        request: Request<Body>,
        respond: Responder,
        outcome: RequestOutcome,
        duplicate_of: Option<RecordKey>,
    ) {
        let started = Instant::now();
        let deadline = started + self.settings.upstream_timeout;
        let result = self.inner.clone().oneshot(request).await;
        self.upstream_done(started);
        // Which request came first, looked up once the upstream answered
        // rather than before: the request that holds the key remembers
        // itself only when its claim returns, and a duplicate's claim can
        // overtake that (one in six storms did, on two workers).
        if let (Some(key), Some(observe)) = (duplicate_of, &self.policy.observe) {
            self.log
                .set_first_request_id(observe.first_request_id(&key));
        }
        let response = result.unwrap_or_else(|e| {
            Rejection::PassthroughFailed {
                timeout: e.into().is_timeout(),
            }
            .into_response(self.policy.profile)
        });
        self.answer_relayed(respond, outcome, response, deadline)
    }

    /// Forwards the request that holds the key, then settles the key as the
    /// upstream's answer (or failure) says.
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
        // Observe mode changes nothing of the request: its records are
        // never replayed, so a coded body stored as it came costs nothing.
        let request = match self.policy.observe {
            Some(_) => request,
            None => uncompressed(request),
        };
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
        if self.mcp.is_some() {
            return self
                .relay_call(claim, token, response, deadline, respond)
                .await;
        }
        self.stream_and_store(claim, token, response, deadline, respond)
            .await
    }

    /// The request may have executed: settle the key as unknown (fail
    /// closed) or release it, as `on_ambiguous` says.
    pub(super) async fn ambiguous(
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

    /// Stores `outcome` as the key's completed record.
    pub(super) async fn complete(&mut self, claim: &Claim, token: FencingToken, outcome: Outcome) {
        let now = self.settings.clock.now_millis();
        let record = CompletedRecord {
            fingerprint: claim.fingerprint,
            created_at: claim.arrived_at,
            completed_at: now,
            expires_at: now.saturating_add(millis(self.policy.ttl)),
            outcome,
        };
        let completion = Box::new(self.settings.store.prepare(&claim.key, record));
        self.settle(claim, token, Settling::Complete(completion))
            .await;
    }

    fn upstream_done(&mut self, started: Instant) {
        self.log.upstream_done(started.elapsed());
    }

    pub(super) async fn release(&mut self, claim: &Claim, token: FencingToken) {
        self.settle(claim, token, Settling::Release).await;
    }
}

/// The request as sent to the upstream when its response will be stored:
/// asking for no content coding. A stored response is replayed to every
/// retry, and a retry may not accept the coding the first request did
/// (gzip to one client, plain to the next): a replay must never hand a
/// client a `Content-Encoding` it did not ask for. Between a sidecar and
/// its upstream, on one host, compression saves nothing worth that.
pub(super) fn uncompressed(mut request: Request<Body>) -> Request<Body> {
    request.headers_mut().insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    request
}
