//! `X-Request-Id` for requests that arrive without one.
//!
//! tower-http's `MakeRequestUuid` asks the kernel for 16 random bytes per
//! request (a `getrandom` syscall each time). Request ids only need to be
//! unique, so they are drawn from the thread-local generator instead: a
//! CSPRNG seeded from the OS, no syscall per request. Still UUID v4 text.

use http::{HeaderValue, Request};
use tower_http::request_id::{MakeRequestId, RequestId};

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
