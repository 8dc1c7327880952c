//! Header names as constants (inserting a header by a `&str` name that is
//! not one of HTTP's standard ones copies the name into a new allocation
//! each time), and the one reading of `Content-Length`.

use http::{HeaderMap, HeaderName};

/// The request id, generated when absent and returned to the client.
pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// `true` on every answer served from a stored record.
pub(crate) const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// When the replayed outcome was first stored (an IMF-fixdate).
pub(crate) const IDEMPOTENCY_ORIGINAL_DATE: HeaderName =
    HeaderName::from_static("idempotency-original-date");
/// The retry hint the OpenAI and Anthropic SDKs read.
pub(crate) const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// The retry hint stripe's SDKs read.
pub(crate) const STRIPE_SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");
/// `Retry-After` in milliseconds, for SDKs that read the finer hint.
pub(crate) const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// A message's `Content-Length`, when it has a valid one.
pub(crate) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}
