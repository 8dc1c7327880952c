//! Reconciling a key whose outcome is unknown (`reconcile_url`): the
//! request that took it over, still holding its new claim, asks the
//! upstream's lookup what became of the operation. Found: the lookup's
//! answer is stored and replayed; absent: the caller executes the request;
//! anything else: the key settles `outcome-unknown` as it would have
//! without a lookup. A failed lookup never lets the request execute.
//!
//! Plain HTTP routes in enforce mode only: an MCP tool call and observe
//! mode never render a lookup, so their claims never ask to reconcile.

use std::time::Duration;

use axum::body::Body;
use http::request::Parts;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tower::{Service, ServiceExt};
use tracing::Instrument;

use super::context::{RequestContext, Responder};
use super::dialect::Dialect;
use super::policy::Policy;
use super::replay::{stored_headers, stored_outcome};
use super::settle::Holder;
use crate::core::{Outcome, RecordKey, UpstreamFailure};
use crate::http::headers::X_REQUEST_ID;
use crate::observe::{trace, Reconciled, RequestOutcome};
use crate::request::key::{IdempotencyKey, IDEMPOTENCY_KEY};
use crate::request::reconcile::LookupInput;

/// Marks an answer that came from the upstream's lookup, on the first
/// answer and on every replay of it (it is stored with the response).
pub(super) const IDEMPOTENCY_RECONCILED: &str = "idempotency-reconciled";

/// What the lookup said.
pub(super) enum Lookup {
    /// The operation happened: this is what to store and replay.
    Found(Outcome),
    /// It never happened: execute the request.
    Absent,
    /// No answer to go by, and why (what `keys reconcile` shows).
    Failed { why: String },
}

/// The lookup for a request (`parts`, `body`, `key`) on a route with
/// `reconcile_url`; `None` without one, or when the request lacks a value
/// the template names (then there is nothing to look up: a key whose
/// outcome is unknown stays so, as without a lookup).
pub(super) fn lookup_of(
    policy: &Policy,
    parts: &Parts,
    body: &[u8],
    key: &IdempotencyKey,
) -> Option<Request<Body>> {
    let input = LookupInput {
        parts,
        body,
        key: key.as_str(),
    };
    lookup_request(&policy.reconcile.as_ref()?.render(&input)?, parts)
}

/// The lookup for the request whose head is `original`: a GET of `path`
/// on the upstream with the request's own credentials, key and request
/// id, so the upstream can authorize it and trace it to the retry.
fn lookup_request(path: &str, original: &Parts) -> Option<Request<Body>> {
    let mut request = Request::builder()
        .method(Method::GET)
        .uri(path)
        .body(Body::empty())
        .ok()?;
    let headers = request.headers_mut();
    for name in [http::header::AUTHORIZATION, IDEMPOTENCY_KEY, X_REQUEST_ID] {
        if let Some(value) = original.headers.get(&name) {
            headers.insert(name, value.clone());
        }
    }
    // Stored and replayed to every retry, as an executed response is (see
    // `exchange::uncompressed`).
    headers.insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    Some(request)
}

/// How long the lookup may take: `reconcile_timeout`, or the upstream's.
pub(super) fn lookup_timeout(cx: &RequestContext) -> Duration {
    cx.policy.lookup_timeout(cx.settings.upstream_timeout)
}

/// Sends `request` (from [`lookup_request`]) through `inner`, bounded by
/// the lookup's timeout, and classifies the answer; logged and counted.
pub(super) async fn look_up<S>(
    inner: S,
    cx: &RequestContext,
    key: RecordKey,
    request: Request<Body>,
) -> Lookup
where
    S: Service<Request<Body>, Response = Response<Body>> + Send,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send,
{
    let started = Instant::now();
    let span = trace::reconcile_span();
    let asked = ask(inner, cx, request).instrument(span.clone());
    let (lookup, status) = match tokio::time::timeout(lookup_timeout(cx), asked).await {
        Ok(answered) => answered,
        Err(_elapsed) => {
            let why = format!("the lookup did not answer within {:?}", lookup_timeout(cx));
            (Lookup::Failed { why }, None)
        }
    };
    let result = match &lookup {
        Lookup::Found(_) => Reconciled::Found,
        Lookup::Absent => Reconciled::Absent,
        Lookup::Failed { .. } => Reconciled::Failed,
    };
    trace::reconciled(&span, result, status);
    cx.log.metrics().reconciled(result);
    tracing::info!(
        key = %key.to_hex(),
        status = status.unwrap_or_default(),
        duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        result = result.as_str(),
        "looked up an unknown outcome (reconcile_url)"
    );
    lookup
}

/// The lookup's answer and its status, if one came.
async fn ask<S>(inner: S, cx: &RequestContext, request: Request<Body>) -> (Lookup, Option<u16>)
where
    S: Service<Request<Body>, Response = Response<Body>> + Send,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send,
{
    let response = match inner.oneshot(request).await {
        Ok(response) => response,
        Err(e) => {
            let e = e.into();
            tracing::warn!(error = ?e, "the reconcile lookup failed");
            let why = format!("the lookup failed: {e:?}");
            return (Lookup::Failed { why }, None);
        }
    };
    let status = response.status().as_u16();
    let lookup = match cx.policy.lookup_found(status) {
        Some(true) => found(response, cx.policy.settings.max_response_bytes).await,
        Some(false) => Lookup::Absent,
        None => Lookup::Failed {
            why: format!(
                "the lookup answered {}: neither found (reconcile_found_statuses) nor absent (reconcile_absent_statuses)",
                response.status()
            ),
        },
    };
    (lookup, Some(status))
}

/// The found answer as a stored outcome, marked reconciled; a body over
/// `max_response_bytes` (or broken off) is no answer to go by.
async fn found(response: Response<Body>, max_bytes: usize) -> Lookup {
    let (head, body) = response.into_parts();
    let Ok(body) = Limited::new(body, max_bytes).collect().await else {
        let why = format!(
            "the lookup answered {}, but its body was over max_response_bytes ({max_bytes}) or broken off",
            head.status
        );
        return Lookup::Failed { why };
    };
    let mut headers = stored_headers(&head.headers);
    headers.push((IDEMPOTENCY_RECONCILED.to_owned(), "true".into()));
    Lookup::Found(stored_outcome(
        head.status.as_u16(),
        headers,
        Some(body.to_bytes()),
    ))
}

/// Stores `outcome` (what the lookup found, or the unknown outcome it
/// could not resolve) as the key's and answers it as every later retry
/// will be: a replay of the record.
pub(super) async fn settle_looked_up(
    mut holder: Holder,
    dialect: &impl Dialect,
    outcome: Outcome,
    respond: Responder,
) {
    let answered = match outcome {
        Outcome::Unknown { .. } => RequestOutcome::OutcomeUnknown,
        _ => RequestOutcome::Replayed,
    };
    let record = holder.record_of(outcome);
    holder.complete_with(record.clone()).await;
    let response = dialect.replay(&record, &holder.cx.policy);
    holder.cx.answer(respond, answered, response);
}
