//! One covered request from its body to its answer: claim the key
//! (`begin`), then replay, reject, wait, or execute, the same for every
//! [`Dialect`]; what executing relays and stores is the dialect's
//! `capture`, and settling the key is [`settle`]'s. A key whose outcome
//! is unknown, on a route with `reconcile_url`, is looked up before
//! anything executes ([`reconcile`]).
//!
//! [`settle`]: super::settle
//! [`reconcile`]: super::reconcile

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tower::{Service, ServiceExt};
use tracing::Span;

use super::body::{holding, read_request_body};
use super::context::{Claim, RequestContext, Responder};
use super::detach::DetachOnDrop;
use super::dialect::{settle_ambiguous, settle_looked_up, Dialect, Http};
use super::policy::{OnInFlight, OnStoreError};
use super::reconcile::{look_up, lookup_of, lookup_timeout, Lookup};
use super::rejection::Rejection;
use super::settle::Holder;
use super::store_call::{owned_begin, release_unanswered_claim, timed, OwnedBegin};
use super::waiting::Waiting;
use crate::core::{
    Begin, BeginOutcome, CompletedRecord, FencingToken, Fingerprint, Outcome, RecordKey,
    UnknownCause, UpstreamFailure,
};
use crate::observe::{trace, RequestOutcome};
use crate::request::key::IdempotencyKey;
use crate::request::key_source::KeyRefusal;
use crate::request::scope::ScopeError;
use crate::store::StoreError;

/// One covered request, from its body to its stored outcome, answered in
/// dialect `D`.
pub(super) struct Exchange<S, D> {
    pub(super) inner: S,
    pub(super) dialect: D,
    pub(super) cx: RequestContext,
    /// The upstream's lookup of this request (`reconcile_url`), when its
    /// route has one and the request has every value it names: then a
    /// key whose outcome is unknown is taken over and looked up.
    pub(super) lookup: Option<Request<Body>>,
}

impl<S, D> Exchange<S, D> {
    pub(super) fn new(inner: S, cx: RequestContext, dialect: D) -> Self {
        Self {
            inner,
            dialect,
            cx,
            lookup: None,
        }
    }

    /// The same request, answered in `dialect` from now on.
    pub(super) fn speaking<E>(self, dialect: E) -> Exchange<S, E> {
        Exchange {
            inner: self.inner,
            dialect,
            cx: self.cx,
            lookup: self.lookup,
        }
    }
}

impl<S> Exchange<S, Http>
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
        mut self,
        req: Request<Body>,
        key: Option<IdempotencyKey>,
    ) -> Response<Body> {
        let (parts, body) = req.into_parts();
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
            .or_else(|| self.cx.policy.keys.from_request(&parts, &body).transpose())
        {
            Some(Ok(key)) => key,
            Some(Err(KeyRefusal::Invalid(invalid))) => {
                return self.reject(RequestOutcome::InvalidKey, Rejection::InvalidKey(invalid))
            }
            Some(Err(KeyRefusal::UnreadableBody { at })) => {
                return self.reject(RequestOutcome::BadBody, Rejection::InvalidBody { at })
            }
            None if self.cx.policy.settings.require_key => {
                return self.reject(RequestOutcome::MissingKey, Rejection::MissingKey)
            }
            None => {
                return self
                    .forward_untouched(parts, Body::from(body), RequestOutcome::Passthrough)
                    .await
            }
        };
        let fingerprint = self.cx.policy.fingerprint.fingerprint(&parts, &body);
        self.lookup = lookup_of(&self.cx.policy, &parts, &body, &key);
        let request = Request::from_parts(parts, Body::from(body));
        self.claim_and_run(&scope, &key, fingerprint, request).await
    }
}

impl<S, D> Exchange<S, D>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
    D: Dialect,
{
    /// Forwards a request the proxy does not protect, as it came, and
    /// counts it as `outcome`.
    pub(super) async fn forward_untouched(
        self,
        parts: http::request::Parts,
        body: Body,
        outcome: RequestOutcome,
    ) -> Response<Body> {
        let deadline = Instant::now() + self.cx.settings.upstream_timeout;
        let request = Request::from_parts(parts, body);
        let response = match self.inner.oneshot(request).await {
            Ok(response) => response,
            Err(e) => Rejection::PassthroughFailed {
                timeout: e.into().is_timeout(),
            }
            .into_response(self.cx.policy.settings.profile),
        };
        let RequestContext { log, permit, .. } = self.cx;
        log.finish(outcome, &response);
        response.map(|body| holding(body, permit, deadline))
    }

    /// The request's scope, or why a caller that cannot say who it is is
    /// refused.
    pub(super) fn scope_of(
        &self,
        parts: &http::request::Parts,
    ) -> Result<[u8; 32], (RequestOutcome, Rejection)> {
        let rejection = match self.cx.policy.scope.scope(parts) {
            Ok(scope) => {
                self.cx.policy.warn_if_bearer_scoped(&parts.headers);
                return Ok(scope);
            }
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
        let timeout = self.cx.settings.request_body_timeout;
        let declared = crate::http::headers::content_length(&parts.headers);
        let read = read_request_body(declared, body, self.cx.policy.settings.max_request_bytes);
        async move {
            let rejection = match tokio::time::timeout(timeout, read).await {
                Ok(Ok(body)) => return Ok(body),
                Ok(Err(rejection)) => rejection,
                Err(_elapsed) => Rejection::BodyTimeout { timeout },
            };
            Err((RequestOutcome::BadBody, rejection))
        }
    }

    /// The claim `key` in `scope` makes for a request of `fingerprint`
    /// arriving now, before the store is asked.
    pub(super) fn claim(
        &mut self,
        scope: &[u8; 32],
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Claim {
        let record_key = RecordKey::new(scope, key.as_str());
        self.cx.log.set_key(record_key);
        Claim {
            arrived_at: self.cx.settings.clock.now_millis(),
            key: record_key,
            fingerprint,
            // No claim yet.
            lease_ends: Instant::now(),
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
        let claim = self.claim(scope, key, fingerprint);
        let tasks = self.cx.settings.tasks.clone();
        let span = self.cx.log.span().clone();
        until_answered(&tasks, span, |respond| self.run(claim, request, respond)).await
    }

    pub(super) fn reject(self, outcome: RequestOutcome, rejection: Rejection) -> Response<Body> {
        let response = self
            .dialect
            .refuse(rejection, self.cx.policy.settings.profile);
        self.cx.log.finish(outcome, &response);
        response
    }

    pub(super) fn answer_rejection(
        self,
        respond: Responder,
        outcome: RequestOutcome,
        rejection: Rejection,
    ) {
        let response = self
            .dialect
            .refuse(rejection, self.cx.policy.settings.profile);
        self.cx.answer(respond, outcome, response);
    }

    /// The `begin` that claims `claim`'s key for this request.
    pub(super) fn begin_of(&self, claim: &Claim) -> Begin {
        let policy = &self.cx.policy;
        Begin {
            key: claim.key,
            fingerprint: claim.fingerprint,
            lease: self.lease(),
            ttl: policy.settings.ttl,
            on_stale: policy.settings.on_stale,
            token: FencingToken::random(),
            reconcile: self.lookup.is_some(),
        }
    }

    /// How long a claim of this request's protects its key: long enough
    /// for a lookup and then the execution it may allow, so that no
    /// retry finds the claim stale while the upstream may still act on it.
    fn lease(&self) -> Duration {
        let lookup = self.lookup.as_ref().map(|_| lookup_timeout(&self.cx));
        self.cx.policy.lease + lookup.unwrap_or_default()
    }

    /// Asks the store for the key: when it was asked (the lease counts
    /// from then), the call (which may outlive this wait), its answer.
    pub(super) async fn ask(
        &mut self,
        begin: &Begin,
    ) -> (Instant, OwnedBegin, Result<BeginOutcome, StoreError>) {
        let asked_at = Instant::now();
        let mut call = owned_begin(&self.cx.settings.store, begin);
        let cx = &mut self.cx;
        let begun = timed(&cx.settings, &mut cx.log, "begin", |_| &mut call).await;
        (asked_at, call, begun)
    }

    /// The claim once `begin` acquired the key at `asked_at`.
    pub(super) fn acquired(&self, claim: Claim, asked_at: Instant, took_over: bool) -> Claim {
        if took_over {
            self.cx.log.metrics().lease_expired();
            tracing::warn!(key = %claim.key.to_hex(), "took over a stale key (on_stale = \"retry\", or to reconcile it)");
        }
        Claim {
            lease_ends: asked_at + self.lease(),
            ..claim
        }
    }

    /// Whether the proxy is draining (the tracker is closed when shutdown
    /// begins): an execution started now might outlive the drain and be
    /// cut off holding its key, which would then settle as
    /// outcome-unknown.
    pub(super) fn draining(&self) -> bool {
        self.cx.settings.tasks.is_closed()
    }

    /// Claims the key, or answers from what the store holds for it; with
    /// `on_in_flight = "wait"`, asks again until the request in flight is
    /// done or the wait is over.
    async fn run(mut self, claim: Claim, request: Request<Body>, respond: Responder) {
        let begin = self.begin_of(&claim);
        let mut waiting = Waiting::new(self.cx.policy.settings.wait_timeout);
        loop {
            if self.draining() {
                return self.answer_rejection(
                    respond,
                    RequestOutcome::ShuttingDown,
                    Rejection::ShuttingDown,
                );
            }
            let (asked_at, call, begun) = self.ask(&begin).await;
            let outcome = match begun {
                Ok(outcome) => outcome,
                Err(e) => {
                    let pass = self.passes(&e) && !waiting.seen_in_flight;
                    // Failed or late, the call may have claimed the key all
                    // the same. Rejected, this request executes nothing, so
                    // such a claim only blocks the retry: released by its
                    // token. (Passed on unprotected, the request does
                    // execute; its claim is then left to fail closed.)
                    // A store that reports a record it cannot read did
                    // read the key, and claims nothing over a record.
                    if !pass && !matches!(e, StoreError::Corrupt(_)) {
                        // The lease the claim would have had: a takeover's
                        // includes its lookup.
                        let lease_ends = asked_at + self.lease();
                        release_unanswered_claim(&self.cx.settings, &begin, call, lease_ends);
                    }
                    return self.store_failed(request, respond, e, pass).await;
                }
            };
            let (profile, dialect) = (self.cx.policy.settings.profile, &self.dialect);
            let (outcome, response) = match outcome {
                BeginOutcome::Acquired {
                    token,
                    took_over,
                    reconcile,
                } => {
                    let claim = self.acquired(claim, asked_at, took_over);
                    if let Some(cause) = reconcile {
                        return self.reconcile(claim, request, token, cause, respond).await;
                    }
                    return self
                        .execute(claim, uncompressed(request), token, respond)
                        .await;
                }
                BeginOutcome::InFlight { lease_expires_at } => {
                    let wait = self.cx.policy.settings.on_in_flight == OnInFlight::Wait;
                    if wait && waiting.pause(&respond).await {
                        continue;
                    }
                    return self.in_flight(respond, lease_expires_at);
                }
                BeginOutcome::Completed(record) => (
                    RequestOutcome::Replayed,
                    dialect.replay(&record, &self.cx.policy),
                ),
                BeginOutcome::Settled(record) => {
                    return self.settled_stale(&claim, respond, &record)
                }
                BeginOutcome::Mismatch { state } => {
                    let rejection = Rejection::KeyReused { state };
                    (RequestOutcome::Mismatch, dialect.refuse(rejection, profile))
                }
            };
            return self.cx.answer(respond, outcome, response);
        }
    }

    /// Holding a new claim on a key whose outcome was unknown (`cause`),
    /// asks the upstream's lookup before anything executes (see
    /// [`super::reconcile`]).
    async fn reconcile(
        mut self,
        claim: Claim,
        request: Request<Body>,
        token: FencingToken,
        cause: UnknownCause,
        respond: Responder,
    ) {
        let Some(lookup) = self.lookup.take() else {
            return self.answer_rejection(respond, RequestOutcome::Internal, Rejection::Internal);
        };
        let outcome = match look_up(self.inner.clone(), &self.cx, claim.key, lookup).await {
            Lookup::Absent => {
                return self
                    .execute(claim, uncompressed(request), token, respond)
                    .await
            }
            Lookup::Found(answer) => self.dialect.reconciled(&answer),
            Lookup::Failed { .. } => Outcome::Unknown { cause },
        };
        let Self { dialect, cx, .. } = self;
        settle_looked_up(Holder { cx, claim, token }, &dialect, outcome, respond).await
    }

    /// Answers the request whose `begin` found the key's claim abandoned
    /// and settled it as outcome-unknown.
    fn settled_stale(self, claim: &Claim, respond: Responder, record: &CompletedRecord) {
        self.cx.log.metrics().lease_expired();
        tracing::warn!(key = %claim.key.to_hex(), "settled a stale key as outcome-unknown (its holder died mid-call)");
        // This request is the one that found the claim abandoned: counted
        // as the unknown outcome it answers, so the alert on
        // `outcome_unknown` sees a proxy that died mid-call. Later retries
        // replay the record.
        let response = self.dialect.replay(record, &self.cx.policy);
        self.cx
            .answer(respond, RequestOutcome::OutcomeUnknown, response)
    }

    /// 425 (or 409): the same request holds the key, its lease ends at
    /// `lease_expires_at`.
    fn in_flight(self, respond: Responder, lease_expires_at: u64) {
        let now = self.cx.settings.clock.now_millis();
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
        self.cx.policy.settings.on_store_error == OnStoreError::Pass
            && matches!(error, StoreError::Unavailable(_))
    }

    /// Answers a request whose `begin` failed: 503, or forwarded
    /// unprotected when `pass` (see [`Self::passes`]).
    pub(super) async fn store_failed(
        self,
        request: Request<Body>,
        respond: Responder,
        error: StoreError,
        pass: bool,
    ) {
        tracing::error!(error = %error, route = %self.cx.policy.route, "idempotency store failed");
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
        let (cx, response, deadline) = self.forward(request).await;
        cx.answer_relayed(respond, RequestOutcome::Unprotected, response, deadline)
    }

    /// Forwards a request that holds no claim: nothing of its answer is
    /// stored. Returns the answer (a failure made one) and its deadline.
    pub(super) async fn forward(
        self,
        request: Request<Body>,
    ) -> (RequestContext, Response<Body>, Instant) {
        let Self { inner, mut cx, .. } = self;
        let started = Instant::now();
        let deadline = started + cx.settings.upstream_timeout;
        let result = inner.oneshot(request).await;
        cx.upstream_done(started);
        let response = result.unwrap_or_else(|e| {
            Rejection::PassthroughFailed {
                timeout: e.into().is_timeout(),
            }
            .into_response(cx.policy.settings.profile)
        });
        (cx, response, deadline)
    }

    /// Forwards the request that holds the key, then has the dialect relay
    /// its answer and settle the key as the answer (or failure) says.
    pub(super) async fn execute(
        self,
        claim: Claim,
        request: Request<Body>,
        token: FencingToken,
        respond: Responder,
    ) {
        let Self {
            inner,
            dialect,
            mut cx,
            ..
        } = self;
        // Counted until the outcome is stored (this function awaits the
        // streaming of the body too).
        let _executing = cx.settings.metrics.executing();
        let deadline = Instant::now() + cx.settings.upstream_timeout;
        let started = Instant::now();
        cx.log.set_unsettled(true);
        let result = inner.oneshot(request).await;
        cx.upstream_done(started);
        let mut holder = Holder { cx, claim, token };
        let response = match result.map_err(Into::into) {
            Ok(response) => response,
            Err(UpstreamFailure::NotSent(why)) => {
                tracing::warn!(error = %why, "upstream unreachable; releasing the key");
                holder.release().await;
                let response = dialect.refuse(
                    Rejection::UpstreamUnreachable,
                    holder.cx.policy.settings.profile,
                );
                return holder
                    .cx
                    .answer(respond, RequestOutcome::UpstreamUnreachable, response);
            }
            Err(UpstreamFailure::TimedOut) => {
                return settle_ambiguous(holder, &dialect, UnknownCause::Timeout, respond).await
            }
            Err(UpstreamFailure::Broken(why)) => {
                tracing::warn!(error = %why, "upstream connection broke after the request was sent");
                return settle_ambiguous(holder, &dialect, UnknownCause::Reset, respond).await;
            }
        };
        let status = response.status().as_u16();
        if holder.cx.policy.releases(status) {
            holder.release().await;
            return holder
                .cx
                .answer_relayed(respond, RequestOutcome::Released, response, deadline);
        }
        dialect.capture(holder, response, deadline, respond).await
    }
}

/// Drives `run` on the connection's task until it answers, and hands
/// what it still does after answering (storing a streamed body) to a
/// task of its own, as it would if the client left (see
/// [`DetachOnDrop`]). The run goes in the request's `span`.
pub(super) async fn until_answered<F>(
    tasks: &TaskTracker,
    span: Span,
    run: impl FnOnce(Responder) -> F,
) -> Response<Body>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (respond, mut answer) = oneshot::channel();
    let mut run = DetachOnDrop::new(trace::boxed_in(span, tasks.track_future(run(respond))));
    let answer = std::future::poll_fn(|cx| {
        run.poll(cx);
        Pin::new(&mut answer).poll(cx)
    })
    .await;
    drop(run);
    answer.unwrap_or_else(|_| Rejection::Internal.into_response(Default::default()))
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
