//! The answer to a retry, built from the key's completed record; and what
//! of an executed response is kept to build it from.

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response};

use super::policy::Policy;
use super::rejection::Rejection;
use crate::core::{from_millis, CompletedRecord, Outcome, StoredResponse};
use crate::http::headers::{IDEMPOTENCY_ORIGINAL_DATE, IDEMPOTENT_REPLAYED};

/// Builds the answer to a retry from the key's completed record.
pub(super) fn replay(record: &CompletedRecord, policy: &Policy) -> Response<Body> {
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
pub(super) fn stored_headers(headers: &http::HeaderMap) -> Vec<(String, Bytes)> {
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

/// What is kept of an executed request: the whole response, or only its
/// status when the body was too large or broke off.
pub(super) fn stored_outcome(
    status: u16,
    headers: Vec<(String, Bytes)>,
    body: Option<Bytes>,
) -> Outcome {
    match body {
        Some(body) => Outcome::Response(StoredResponse {
            status,
            headers,
            body,
        }),
        None => Outcome::NotStored { status },
    }
}
