//! A covered request on a `mode = "observe"` route (DESIGN §6): it reaches
//! the upstream whatever the store says, and is counted as what
//! enforcement would have answered. Whatever enforcement would refuse
//! before the store (a caller that cannot say who it is, a body over the
//! cap, an unusable key) is forwarded, counted as that refusal; a keyless
//! request is fingerprinted and counted if seen before (see
//! [`ObserveRoute`]); a keyed one claims its key as under enforcement,
//! and the first stores its outcome while every duplicate is forwarded.

use std::future::Future;

use axum::body::Body;
use http::{Request, Response};
use tokio::time::Instant;
use tower::Service;

use super::body::{read_or_keep, ReadOrKeep};
use super::context::{Claim, Responder};
use super::dialect::{Dialect, Http};
use super::exchange::{until_answered, Exchange};
use super::observe::{ObserveRoute, Sighting};
use super::policy::{Policy, Profile};
use super::rejection::Rejection;
use super::settle::Holder;
use crate::core::{BeginOutcome, CompletedRecord, RecordKey, UpstreamFailure};
use crate::http::headers::content_length;
use crate::observe::RequestOutcome;
use crate::request::key::IdempotencyKey;
use crate::request::key_source::KeyRefusal;

/// Observe mode's dialect: what it does say (a drain, a body that broke
/// off, an upstream that could not be reached) it says as plain HTTP, and
/// the first request's outcome is stored as it came. Its records are
/// never replayed: a duplicate is forwarded instead (see
/// `Exchange::run_observed`), so the request keeps its content coding.
pub(super) struct Observed;

impl Dialect for Observed {
    fn refuse(&self, rejection: Rejection, profile: Profile) -> Response<Body> {
        Http.refuse(rejection, profile)
    }

    fn replay(&self, record: &CompletedRecord, policy: &Policy) -> Response<Body> {
        Http.replay(record, policy)
    }

    fn capture(
        self,
        holder: Holder,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) -> impl Future<Output = ()> + Send {
        Http.capture(holder, response, deadline, respond)
    }
}

impl<S> Exchange<S, Observed>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
{
    /// Runs on the connection's task: reads the body, then forwards the
    /// request, or drives its run until it answers.
    pub(super) async fn start_observed(
        mut self,
        req: Request<Body>,
        key: Option<IdempotencyKey>,
    ) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let scope = match self.scope_of(&parts) {
            Ok(scope) => scope,
            Err((outcome, _)) => return self.forward_untouched(parts, body, outcome).await,
        };
        let declared = content_length(&parts.headers);
        let policy = &self.cx.policy;
        let timeout = self.cx.settings.request_body_timeout;
        let read = read_or_keep(declared, body, policy.settings.max_request_bytes);
        let body = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(ReadOrKeep::Whole(body))) => body,
            Ok(Ok(ReadOrKeep::TooLarge(body))) => {
                return self
                    .forward_untouched(parts, body, RequestOutcome::BadBody)
                    .await
            }
            // The body broke off or stalled: there is nothing whole to
            // forward, as a plain proxy would have found too.
            Ok(Err(rejection)) => return self.reject(RequestOutcome::BadBody, rejection),
            Err(_) => {
                return self.reject(RequestOutcome::BadBody, Rejection::BodyTimeout { timeout })
            }
        };
        let key = match key {
            Some(key) => Some(key),
            None => match policy.keys.from_request(&parts, &body) {
                Ok(key) => key,
                Err(refusal) => {
                    let outcome = match refusal {
                        KeyRefusal::Invalid(_) => RequestOutcome::InvalidKey,
                        KeyRefusal::UnreadableBody { .. } => RequestOutcome::BadBody,
                    };
                    return self
                        .forward_untouched(parts, Body::from(body), outcome)
                        .await;
                }
            },
        };
        let fingerprint = policy.fingerprint.fingerprint(&parts, &body);
        let Some(key) = key else {
            let identity = ObserveRoute::keyless_identity(&scope, &fingerprint);
            let outcome = self.sight_keyless(identity);
            return self
                .forward_untouched(parts, Body::from(body), outcome)
                .await;
        };
        let request = Request::from_parts(parts, Body::from(body));
        let records = ObserveRoute::records_scope(&scope);
        let claim = self.claim(&records, &key, fingerprint);
        let tasks = self.cx.settings.tasks.clone();
        let span = self.cx.log.span().clone();
        until_answered(&tasks, span, |respond| {
            self.run_observed(claim, request, respond)
        })
        .await
    }

    /// Counts a keyless request of `identity`: a duplicate of one seen
    /// within the window, or the first.
    fn sight_keyless(&mut self, identity: RecordKey) -> RequestOutcome {
        self.cx.log.set_key(identity);
        let policy = &self.cx.policy;
        let sighting = match &policy.observe {
            Some(observe) => observe.sight(identity, self.cx.log.request_id()),
            None => Sighting::First,
        };
        match sighting {
            Sighting::Again { first_request_id } => {
                self.cx.log.set_first_request_id(first_request_id);
                RequestOutcome::ObservedUnkeyedDuplicate
            }
            Sighting::First if policy.settings.require_key => RequestOutcome::MissingKey,
            Sighting::First => RequestOutcome::Passthrough,
        }
    }

    /// Claims the key once: the request that acquires it executes and
    /// stores its outcome, any other is forwarded, and a store that fails
    /// stops nothing.
    async fn run_observed(mut self, claim: Claim, request: Request<Body>, respond: Responder) {
        if self.draining() {
            return self.answer_rejection(
                respond,
                RequestOutcome::ShuttingDown,
                Rejection::ShuttingDown,
            );
        }
        let begin = self.begin_of(&claim);
        let (asked_at, _call, begun) = self.ask(&begin).await;
        // Observe mode never lets the store stop a request: forwarded, its
        // claim (if the failed call made one) is left to fail closed.
        let outcome = match begun {
            Ok(outcome) => outcome,
            Err(e) => return self.store_failed(request, respond, e, true).await,
        };
        if let BeginOutcome::Acquired {
            token, took_over, ..
        } = outcome
        {
            let claim = self.acquired(claim, asked_at, took_over);
            if let Some(observe) = &self.cx.policy.observe {
                observe.remember(claim.key, self.cx.log.request_id());
            }
            return self.execute(claim, request, token, respond).await;
        }
        self.forward_duplicate(&claim, outcome, request, respond)
            .await
    }

    /// Forwards a keyed request that enforcement would have answered from
    /// the store (`begun` says how), counted as what it would have been.
    /// Its answer is not stored: the key's record stays the first one's.
    async fn forward_duplicate(
        self,
        claim: &Claim,
        begun: BeginOutcome,
        request: Request<Body>,
        respond: Responder,
    ) {
        let outcome = match begun {
            BeginOutcome::InFlight { .. } => RequestOutcome::ObservedInFlight,
            BeginOutcome::Mismatch { .. } => RequestOutcome::ObservedMismatch,
            BeginOutcome::Completed(_) | BeginOutcome::Settled(_) => RequestOutcome::ObservedReplay,
            // Not sent here: an acquired key is executed.
            BeginOutcome::Acquired { .. } => RequestOutcome::Passthrough,
        };
        let (mut cx, response, deadline) = self.forward(request).await;
        // Which request came first, looked up once the upstream answered
        // rather than before: the request that holds the key remembers
        // itself only when its claim returns, and a duplicate's claim can
        // overtake that (one in six storms did, on two workers).
        if let Some(observe) = &cx.policy.observe {
            cx.log
                .set_first_request_id(observe.first_request_id(&claim.key));
        }
        cx.answer_relayed(respond, outcome, response, deadline)
    }
}
