//! `X-Request-Id` for requests that arrive without one, or with one too long
//! to repeat.
//!
//! A caller's id is kept and forwarded, and it is written into every log
//! line of the request. One longer than [`MAX_REQUEST_ID_LEN`] is replaced:
//! hyper accepts header sections of tens of kilobytes, and a client sending
//! such an id on every request would fill the logs (and the upstream's)
//! with it. The longest common ids (W3C `traceparent`, 55 bytes; AWS X-Ray
//! trace headers, under 100) fit.
//!
//! tower-http's `MakeRequestUuid` asks the kernel for 16 random bytes per
//! request (a `getrandom` syscall each time). Request ids only need to be
//! unique, so they are drawn from the thread-local generator instead: a
//! CSPRNG seeded from the OS, no syscall per request. Still UUID v4 text.

use axum::body::Body;
use http::{HeaderValue, Request};
use tower_http::request_id::{MakeRequestId, RequestId};

use crate::http::headers::X_REQUEST_ID;

/// The longest `X-Request-Id` kept from a caller, in bytes.
pub const MAX_REQUEST_ID_LEN: usize = 200;

/// Removes an `X-Request-Id` longer than [`MAX_REQUEST_ID_LEN`], so that the
/// request-id layer after it gives the request a fresh one.
pub fn drop_oversized_request_id(mut request: Request<Body>) -> Request<Body> {
    let oversized = request
        .headers()
        .get_all(X_REQUEST_ID)
        .iter()
        .any(|id| id.len() > MAX_REQUEST_ID_LEN);
    if oversized {
        request.headers_mut().remove(X_REQUEST_ID);
    }
    request
}

/// Random (v4) UUIDs from the thread-local generator; see the module docs.
#[derive(Clone, Copy, Debug, Default)]
pub struct MakeRequestUuidV4;

impl MakeRequestId for MakeRequestUuidV4 {
    fn make_request_id<B>(&mut self, _request: &Request<B>) -> Option<RequestId> {
        let uuid = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
        let mut text = uuid::Uuid::encode_buffer();
        let text = uuid.hyphenated().encode_lower(&mut text);
        HeaderValue::from_str(text).ok().map(RequestId::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ids_longer_than_the_cap_are_dropped() {
        for (len, kept) in [
            (36, true),
            (MAX_REQUEST_ID_LEN, true),
            (MAX_REQUEST_ID_LEN + 1, false),
        ] {
            let id = "a".repeat(len);
            let mut request = Request::new(Body::empty());
            request
                .headers_mut()
                .insert(X_REQUEST_ID, HeaderValue::from_str(&id).expect("id"));
            let request = drop_oversized_request_id(request);
            assert_eq!(
                request.headers().get(X_REQUEST_ID).is_some(),
                kept,
                "{len} bytes"
            );
        }
    }

    #[test]
    fn ids_are_distinct_v4_uuids() {
        let request = Request::new(());
        let mut make = MakeRequestUuidV4;
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| {
                let id = make.make_request_id(&request).expect("an id");
                let text = id.header_value().to_str().expect("ascii").to_owned();
                let parsed = uuid::Uuid::parse_str(&text).expect("a uuid");
                assert_eq!(parsed.get_version_num(), 4, "{text}");
                assert_eq!(
                    text,
                    parsed.hyphenated().to_string(),
                    "lower-case hyphenated"
                );
                text
            })
            .collect();
        assert_eq!(ids.len(), 1000);
    }
}
