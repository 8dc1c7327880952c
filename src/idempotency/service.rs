//! The middleware service: [`Idempotency`] decides per request (pass
//! through, reject, or run the covered path) and [`ResponseFuture`] boxes
//! only the covered path, the one that waits for the store.
//!
//! The covered path, in order:
//! 1. read the body under `max_request_bytes`, fingerprint it, derive the
//!    record key from scope and key;
//! 2. run the rest on the connection's task while the client waits, and in
//!    a task of its own once it leaves ([`DetachOnDrop`]), so that a client
//!    that disconnects cancels nothing: a claimed key is always completed or
//!    released;
//! 3. `begin` in the store, then replay, reject, wait, or execute;
//! 4. when executing, stream the upstream's response to the client while
//!    keeping a bounded copy, and store it before ending the client's body,
//!    so the client's next retry finds the record.
//!
//! [`DetachOnDrop`]: super::detach::DetachOnDrop

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tower::util::Oneshot;
use tower::{Layer, Service, ServiceExt};
use tracing::Span;

use super::body::holding;
use super::context::RequestContext;
use super::dialect::Http;
use super::exchange::Exchange;
use super::layer::{IdempotencyLayer, Settings};
use super::observe_dialect::Observed;
use super::policy::{McpRoute, Policy, Profile};
use super::rejection::Rejection;
use crate::core::UpstreamFailure;
use crate::observe::{trace, RequestLog, RequestOutcome};
use crate::request::key::IdempotencyKey;
use crate::request::key_source::HeadKey;

/// The middleware service. `S` forwards a request to the upstream; its
/// error says whether the request could have executed
/// ([`UpstreamFailure`]).
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    settings: Arc<Settings>,
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

impl<S: std::fmt::Debug> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
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
        if let Some(mcp) = policy.mcp.clone() {
            return self.call_mcp(req, mcp, policy, log, permit);
        }
        if !policy.covers(req.method()) {
            return self.passthrough(req, log, permit, RequestOutcome::Passthrough);
        }
        let (parts, body) = req.into_parts();
        let head = policy.keys.from_head(&parts);
        let req = Request::from_parts(parts, body);
        // Observe mode refuses nothing: a request without a usable key
        // goes on, to be fingerprinted (keyless) or forwarded (invalid).
        let observe = policy.observe.is_some();
        let key = match head {
            HeadKey::Key(key) => Some(key),
            HeadKey::NeedsBody => None,
            HeadKey::Keyless if observe => None,
            HeadKey::Keyless if policy.settings.require_key => {
                return ResponseFuture::rejected(
                    log,
                    RequestOutcome::MissingKey,
                    Rejection::MissingKey,
                    &policy,
                )
            }
            HeadKey::Invalid(invalid) if !observe => {
                return ResponseFuture::rejected(
                    log,
                    RequestOutcome::InvalidKey,
                    Rejection::InvalidKey(invalid),
                    &policy,
                )
            }
            HeadKey::Keyless | HeadKey::Invalid(_) => {
                let outcome = if observe {
                    RequestOutcome::InvalidKey
                } else {
                    RequestOutcome::Passthrough
                };
                return self.passthrough(req, log, permit, outcome);
            }
        };
        self.call_covered(req, key, policy, log, permit)
    }
}

impl<S> Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
{
    /// A request to an MCP route: a POST is a JSON-RPC message, a DELETE
    /// ends a session; a GET stream is the transport's, not a call.
    fn call_mcp(
        &self,
        req: Request<Body>,
        mcp: Arc<McpRoute>,
        policy: Arc<Policy>,
        log: RequestLog,
        permit: OwnedSemaphorePermit,
    ) -> ResponseFuture<S> {
        if req.method() == http::Method::POST {
            let span = log.span().clone();
            let exchange = self.exchange(policy, log, permit, Http);
            return ResponseFuture::covered(span, exchange.start_mcp(req, mcp));
        }
        if req.method() == http::Method::DELETE {
            let span = log.span().clone();
            let exchange = self.exchange(policy, log, permit, Http);
            return ResponseFuture::covered(span, exchange.end_session(req, mcp));
        }
        self.passthrough(req, log, permit, RequestOutcome::Passthrough)
    }

    /// The covered path, in its route's dialect: observe mode's, or plain
    /// HTTP's.
    fn call_covered(
        &self,
        req: Request<Body>,
        key: Option<IdempotencyKey>,
        policy: Arc<Policy>,
        log: RequestLog,
        permit: OwnedSemaphorePermit,
    ) -> ResponseFuture<S> {
        let span = log.span().clone();
        if policy.observe.is_some() {
            let exchange = self.exchange(policy, log, permit, Observed);
            return ResponseFuture::covered(span, exchange.start_observed(req, key));
        }
        let exchange = self.exchange(policy, log, permit, Http);
        ResponseFuture::covered(span, exchange.start(req, key))
    }

    /// Forwards `req` as it came, counted as `outcome`.
    fn passthrough(
        &self,
        req: Request<Body>,
        log: RequestLog,
        permit: OwnedSemaphorePermit,
        outcome: RequestOutcome,
    ) -> ResponseFuture<S> {
        ResponseFuture::passthrough_as(
            self.inner.clone().oneshot(req),
            log,
            permit,
            self.settings.upstream_timeout,
            outcome,
        )
    }

    fn exchange<D>(
        &self,
        policy: Arc<Policy>,
        log: RequestLog,
        permit: OwnedSemaphorePermit,
        dialect: D,
    ) -> Exchange<S, D> {
        let cx = RequestContext {
            settings: self.settings.clone(),
            policy,
            log,
            permit,
        };
        Exchange::new(self.inner.clone(), cx, dialect)
    }
}

pin_project! {
    #[project = ResponseFutureProj]
    pub enum ResponseFuture<S: Service<Request<Body>>> {
        Passthrough {
            // Polled in the request's span (the log's), so the upstream
            // call's span is its child.
            #[pin]
            fut: Oneshot<S, Request<Body>>,
            log: Option<RequestLog>,
            permit: Option<OwnedSemaphorePermit>,
            // `upstream.timeout` from arrival: the body's too.
            deadline: Instant,
            // `passthrough`, or in observe mode what enforcement would
            // have refused the request as.
            outcome: RequestOutcome,
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
    fn passthrough_as(
        fut: Oneshot<S, Request<Body>>,
        log: RequestLog,
        permit: OwnedSemaphorePermit,
        timeout: Duration,
        outcome: RequestOutcome,
    ) -> Self {
        ResponseFuture::Passthrough {
            fut,
            deadline: log.started() + timeout,
            log: Some(log),
            permit: Some(permit),
            outcome,
        }
    }

    /// The covered path, run in the request's span: its store and
    /// upstream calls' spans are children of it.
    fn covered(span: Span, fut: impl Future<Output = Response<Body>> + Send + 'static) -> Self {
        ResponseFuture::Covered {
            fut: trace::boxed_in(span, fut),
        }
    }

    fn rejected(
        log: RequestLog,
        outcome: RequestOutcome,
        rejection: Rejection,
        policy: &Policy,
    ) -> Self {
        let response = rejection.into_response(policy.settings.profile);
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
                outcome,
            } => {
                let polled = {
                    let _in_span = log.as_ref().map(|log| log.span().enter());
                    std::task::ready!(fut.poll(cx))
                };
                let response = match polled {
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
                    log.finish(*outcome, &response);
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
