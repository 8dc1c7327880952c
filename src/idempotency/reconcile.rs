//! Reconciling a key whose outcome is unknown (`reconcile_url`): the
//! request that took it over, still holding its new claim, asks the
//! upstream's lookup what became of the operation. Found: the lookup's
//! answer is stored and replayed; absent: the caller executes the request;
//! anything else: the key settles `outcome-unknown` as it would have
//! without a lookup. A failed lookup never lets the request execute.
//!
//! Plain HTTP and MCP routes in enforce mode: observe mode never renders
//! a lookup, so its claims never ask to reconcile. What a found lookup
//! becomes is the dialect's ([`Dialect::reconciled`](super::dialect::Dialect::reconciled)): the lookup's own
//! response for HTTP, a tool result saying what it found for MCP.

use std::time::Duration;

use axum::body::Body;
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tower::{Service, ServiceExt};
use tracing::Instrument;

use super::context::RequestContext;
use super::policy::Policy;
use super::replay::{stored_headers, stored_outcome};
use super::settings::{IdempotencySettings, ReconcileProof};
use crate::core::{Outcome, RecordKey, UpstreamFailure};
use crate::http::headers::X_REQUEST_ID;
use crate::observe::{trace, Reconciled};
use crate::request::key::{IdempotencyKey, IDEMPOTENCY_KEY};
use crate::request::reconcile::LookupInput;

/// Marks an answer that came from the upstream's lookup, on the first
/// answer and on every replay of it (it is stored with the response).
pub(super) const IDEMPOTENCY_RECONCILED: &str = "idempotency-reconciled";

/// What the upstream's lookup says it found: `found` or `absent`
/// (docs/guarantees.md, "The lookup protocol").
pub(super) const IDEMPOTENCY_LOOKUP: &str = "idempotency-lookup";

/// What the lookup said.
pub(super) enum Lookup {
    /// The operation happened: this is what the lookup answered, which
    /// the dialect makes the stored outcome ([`Dialect::reconciled`](super::dialect::Dialect::reconciled)).
    Found(FoundAnswer),
    /// It never happened: execute the request.
    Absent,
    /// No answer to go by, and why (what `keys reconcile` shows).
    Failed { why: String },
}

/// A found lookup's answer, whole (under `max_response_bytes`).
pub(super) struct FoundAnswer {
    pub(super) head: http::response::Parts,
    pub(super) body: bytes::Bytes,
}

impl FoundAnswer {
    /// The lookup's response as the stored outcome of a plain HTTP
    /// request: replayed as it came, marked reconciled.
    pub(super) fn as_response(&self) -> Outcome {
        let mut headers = stored_headers(&self.head.headers);
        headers.push((IDEMPOTENCY_RECONCILED.to_owned(), "true".into()));
        stored_outcome(self.head.status.as_u16(), headers, Some(self.body.clone()))
    }
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
    lookup_request(&policy.reconcile.as_ref()?.render(&input)?, parts, key)
}

/// The lookup for the request whose head is `original`: a GET of `path`
/// on the upstream with the request's own credentials, key and request
/// id, so the upstream can authorize it and trace it to the retry. The
/// key is sent as `Idempotency-Key` wherever the request carried it (a
/// header, a body member, an MCP tool argument).
fn lookup_request(path: &str, original: &Parts, key: &IdempotencyKey) -> Option<Request<Body>> {
    let mut request = Request::builder()
        .method(Method::GET)
        .uri(path)
        .header(IDEMPOTENCY_KEY, key.as_str())
        .body(Body::empty())
        .ok()?;
    let headers = request.headers_mut();
    for name in [http::header::AUTHORIZATION, X_REQUEST_ID] {
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
    let status = response.status();
    let settings = &cx.policy.settings;
    let lookup = match proof_of(settings, status, response.headers()) {
        Ok(Proof::Found) => found(response, settings.max_response_bytes).await,
        Ok(Proof::Absent) => Lookup::Absent,
        Err(why) => Lookup::Failed {
            why: format!("the lookup answered {status}: {why}"),
        },
    };
    (lookup, Some(status.as_u16()))
}

/// What a lookup's answer positively says.
#[derive(Debug, PartialEq, Eq)]
enum Proof {
    Found,
    Absent,
}

/// What the lookup's `status` and `headers` prove under the route's
/// `reconcile_proof` (see [`ReconcileProof`]); otherwise why they prove
/// nothing, and the outcome stays unknown.
fn proof_of(
    settings: &IdempotencySettings,
    status: StatusCode,
    headers: &HeaderMap,
) -> Result<Proof, &'static str> {
    if settings.reconcile_proof == ReconcileProof::Status {
        let status = status.as_u16();
        if settings.reconcile_found_statuses.contains(&status) {
            return Ok(Proof::Found);
        }
        if settings.reconcile_absent_statuses.contains(&status) {
            return Ok(Proof::Absent);
        }
        return Err(
            "neither found (reconcile_found_statuses) nor absent (reconcile_absent_statuses)",
        );
    }
    let mut said = headers.get_all(IDEMPOTENCY_LOOKUP).iter();
    let word = match (said.next(), said.next()) {
        (Some(word), None) => word.as_bytes().trim_ascii(),
        (None, _) => return Err("no Idempotency-Lookup header (reconcile_proof = \"header\")"),
        (Some(_), Some(_)) => return Err("Idempotency-Lookup given more than once"),
    };
    if word.eq_ignore_ascii_case(b"found") {
        return match status.is_success() {
            true => Ok(Proof::Found),
            false => Err("Idempotency-Lookup: found, but not on a 2xx"),
        };
    }
    if word.eq_ignore_ascii_case(b"absent") {
        let absent =
            status.is_success() || status == StatusCode::NOT_FOUND || status == StatusCode::GONE;
        return match absent {
            true => Ok(Proof::Absent),
            false => Err("Idempotency-Lookup: absent, but not on a 2xx, 404 or 410"),
        };
    }
    Err("Idempotency-Lookup is neither `found` nor `absent`")
}

/// The found answer, read whole; a body over `max_response_bytes` (or
/// broken off) is no answer to go by.
async fn found(response: Response<Body>, max_bytes: usize) -> Lookup {
    let (head, body) = response.into_parts();
    let Ok(body) = Limited::new(body, max_bytes).collect().await else {
        let why = format!(
            "the lookup answered {}, but its body was over max_response_bytes ({max_bytes}) or broken off",
            head.status
        );
        return Lookup::Failed { why };
    };
    Lookup::Found(FoundAnswer {
        head,
        body: body.to_bytes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn says(proof: ReconcileProof, status: u16, lookup: &[&str]) -> Result<Proof, &'static str> {
        let mut headers = HeaderMap::new();
        for word in lookup {
            headers.append(
                IDEMPOTENCY_LOOKUP,
                http::HeaderValue::from_str(word).expect("value"),
            );
        }
        let status = StatusCode::from_u16(status).expect("status");
        let settings = IdempotencySettings {
            reconcile_proof: proof,
            ..IdempotencySettings::default()
        };
        proof_of(&settings, status, &headers)
    }

    #[test]
    fn by_default_only_the_header_proves_found_or_absent() {
        use ReconcileProof::Header;
        assert_eq!(says(Header, 200, &["found"]), Ok(Proof::Found));
        assert_eq!(says(Header, 201, &[" Found "]), Ok(Proof::Found));
        assert_eq!(says(Header, 404, &["absent"]), Ok(Proof::Absent));
        assert_eq!(says(Header, 410, &["absent"]), Ok(Proof::Absent));
        assert_eq!(says(Header, 200, &["absent"]), Ok(Proof::Absent));
        // A route the upstream lacks answers a bare 404: no proof.
        assert!(says(Header, 404, &[]).is_err());
        assert!(says(Header, 200, &[]).is_err());
        assert!(says(Header, 404, &["found"]).is_err());
        assert!(says(Header, 500, &["absent"]).is_err());
        assert!(says(Header, 409, &["absent"]).is_err());
        assert!(says(Header, 200, &["yes"]).is_err());
        assert!(says(Header, 200, &["found", "absent"]).is_err());
        assert!(says(Header, 200, &["found", "found"]).is_err());
    }

    #[test]
    fn trusting_statuses_reads_the_status_lists_alone() {
        use ReconcileProof::Status;
        assert_eq!(says(Status, 200, &[]), Ok(Proof::Found));
        assert_eq!(says(Status, 404, &[]), Ok(Proof::Absent));
        assert!(says(Status, 201, &["found"]).is_err());
        assert!(says(Status, 500, &[]).is_err());
    }
}
