//! Records and claims for the store tests (`store_contract.rs`,
//! `redis_store.rs`), which include this file by path so that they do not
//! compile the rest of `support/`.

#![allow(unreachable_pub)]

use std::time::Duration;

use bytes::Bytes;
use idemproxy::core::{
    millis, now_millis, CompletedRecord, FencingToken, Fingerprint, Outcome, RecordKey,
    StoredResponse,
};
use idemproxy::store::{Begin, OnStale};

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
    }
}

/// A completed response record that lives `ttl` from now.
pub fn completed(fingerprint: u8, ttl: Duration) -> CompletedRecord {
    let now = now_millis();
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
