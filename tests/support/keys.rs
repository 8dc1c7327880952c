//! The store identities the proxy derives from a request, computed the same
//! way from request parts built in the test, so a test can look a key up in
//! the store or plant a record the proxy will find.

use http::request::Parts;
use http::{Method, Request};
use idemproxy::core::{Fingerprint, RecordKey};
use idemproxy::idempotency::fingerprint::FingerprintRules;
use idemproxy::idempotency::scope::ScopeRules;

/// The head of a request as the proxy sees it: `target` is the path and
/// query (origin form), `headers` whatever the client sends that matters
/// (content type, authorization).
pub fn parts(method: Method, target: &str, headers: &[(&str, &str)]) -> Parts {
    let mut req = Request::builder().method(method).uri(target);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(()).expect("request parts build").into_parts().0
}

/// The record key of `key` under the default scope (`header:authorization`).
pub fn record_key(parts: &Parts, key: &str) -> RecordKey {
    let scope = ScopeRules::parse(&["header:authorization".into()]).expect("default scope rules");
    RecordKey::new(&scope.scope(parts), key)
}

/// The fingerprint under the default rules (no extra headers, no ignores).
pub fn fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    FingerprintRules::parse(&[], &[])
        .expect("default fingerprint rules")
        .fingerprint(parts, body)
}

/// The parts of `TestClient::post_json(url, key, body)` for `target`.
pub fn json_post(target: &str) -> Parts {
    parts(
        Method::POST,
        target,
        &[("content-type", "application/json")],
    )
}
