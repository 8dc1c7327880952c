//! Records and claims for the store tests (`store_contract.rs`,
//! `redis_store.rs`).

#![allow(unreachable_pub)]

use std::time::Duration;

use bytes::Bytes;
use idemproxy::core::{
    millis, Clock, CompletedRecord, FencingToken, Fingerprint, Outcome, RecordKey, StoredResponse,
};
use idemproxy::store::{Begin, OnStale, ScanCursor, Store};

pub const TTL: Duration = Duration::from_secs(3600);

pub fn new_key() -> RecordKey {
    RecordKey::from_bytes(rand::random())
}

pub fn begin(key: RecordKey, fingerprint: u8, lease: Duration, on_stale: OnStale) -> Begin {
    Begin {
        key,
        fingerprint: Fingerprint([fingerprint; 32]),
        lease,
        ttl: TTL,
        on_stale,
        token: FencingToken::random(),
        reconcile: false,
    }
}

/// A completed response record that lives `ttl` from now.
pub fn completed(fingerprint: u8, ttl: Duration) -> CompletedRecord {
    completed_by(Clock::wall(), fingerprint, ttl)
}

/// [`completed`] at `clock`'s now: for a store on the same clock (paused
/// time, [`Clock::tokio`]).
pub fn completed_by(clock: Clock, fingerprint: u8, ttl: Duration) -> CompletedRecord {
    let now = clock.now_millis();
    CompletedRecord {
        fingerprint: Fingerprint([fingerprint; 32]),
        created_at: now - 5,
        completed_at: now,
        expires_at: now + millis(ttl),
        outcome: Outcome::Response(StoredResponse {
            status: 201,
            headers: vec![
                (
                    "content-type".into(),
                    Bytes::from_static(b"application/json"),
                ),
                ("x-request-id".into(), Bytes::from_static(b"abc")),
            ],
            body: Bytes::from_static(b"{\"id\":42}"),
        }),
    }
}

/// A whole walk over `store` ([`Store::scan`], pages of 100): the keys of
/// the records it read, and of those it could not, each with why. A key met
/// twice (Redis `SCAN` may) counts once.
pub async fn walk(
    store: &dyn Store,
) -> (
    std::collections::BTreeSet<RecordKey>,
    std::collections::BTreeMap<RecordKey, String>,
) {
    let mut read = std::collections::BTreeSet::new();
    let mut unreadable = std::collections::BTreeMap::new();
    let mut cursor = ScanCursor::start();
    for _ in 0..10_000 {
        let page = store.scan(&cursor, 100).await.expect("scan");
        read.extend(page.records.into_iter().map(|(key, _)| key));
        unreadable.extend(page.unreadable);
        match page.next {
            Some(next) => cursor = next,
            None => return (read, unreadable),
        }
    }
    panic!("the walk did not end");
}
