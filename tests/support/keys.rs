//! The store identities the proxy derives from a request, computed the same
//! way from request parts built in the test, so a test can look a key up in
//! the store or plant a record the proxy will find.

#![allow(unreachable_pub)]

use std::time::Duration;

use http::request::Parts;
use http::{Method, Request};
use idemproxy::core::{Begin, BeginOutcome, FencingToken, Fingerprint, OnStale, RecordKey};
use idemproxy::request::fingerprint::FingerprintRules;
use idemproxy::request::scope::ScopeRules;
use idemproxy::store::SharedStore;

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
    RecordKey::new(&scope.scope(parts).expect("the default scope"), key)
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

/// Plants a pending claim for `key` on `target`, as the proxy would have
/// made it for `post_json(target, key, body)`, with a 50 ms lease, and
/// waits for the lease to expire: a proxy that died holding the key.
pub async fn plant_stale_claim(
    store: &SharedStore,
    target: &str,
    key: &str,
    body: &[u8],
) -> (RecordKey, FencingToken) {
    let parts = json_post(target);
    let record_key = record_key(&parts, key);
    let begun = store
        .begin(&Begin {
            key: record_key,
            fingerprint: fingerprint(&parts, body),
            lease: Duration::from_millis(50),
            ttl: Duration::from_secs(3600),
            on_stale: OnStale::Store,
            token: FencingToken::random(),
            reconcile: false,
        })
        .await
        .expect("begin");
    let BeginOutcome::Acquired { token, .. } = begun else {
        panic!("the key was free: {begun:?}");
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    (record_key, token)
}
