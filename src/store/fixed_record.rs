//! Records the proxy keeps for itself under a fixed key (an MCP route's
//! shared tool catalog, a learned compression dictionary), written as a
//! request's outcome is: claimed with `begin`, settled with `complete`.
//! So every store holds them without a call of its own, and of replicas
//! writing at once one wins and the others read what it wrote.

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::Store;
use crate::core::{
    millis, Begin, BeginOutcome, CompletedRecord, FencingToken, Fingerprint, OnStale, Outcome,
    RecordKey, StoredResponse, UnixMillis,
};

/// How long a writer holds the key: one that died is taken over after it
/// (`OnStale::Retry`).
const WRITE_LEASE: Duration = Duration::from_secs(30);

/// What [`write()`] found or did.
#[derive(Debug)]
pub enum Written {
    /// Written now, as given.
    Now(CompletedRecord),
    /// The record held the same body already.
    Held(CompletedRecord),
    /// It holds another body, or another writer holds the key now.
    Other,
    /// The store did not answer in time: nothing is held.
    Failed,
}

/// Writes `response` under `key` for `lifetime`, as of `now`, each store
/// call bounded by `timeout`; a claim whose completion fails is released.
pub async fn write(
    store: &dyn Store,
    key: RecordKey,
    response: StoredResponse,
    lifetime: Duration,
    now: UnixMillis,
    timeout: Duration,
) -> Written {
    let fingerprint = Fingerprint(Sha256::digest(&response.body).into());
    let begin = Begin {
        key,
        fingerprint,
        lease: WRITE_LEASE,
        ttl: lifetime,
        on_stale: OnStale::Retry,
        token: FencingToken::random(),
        reconcile: false,
    };
    let token = match tokio::time::timeout(timeout, store.begin(&begin)).await {
        Ok(Ok(BeginOutcome::Acquired { token, .. })) => token,
        Ok(Ok(BeginOutcome::Completed(record))) => return Written::Held((*record).clone()),
        Ok(Ok(_)) => return Written::Other,
        _ => return Written::Failed,
    };
    let record = CompletedRecord {
        fingerprint,
        created_at: now,
        completed_at: now,
        expires_at: now.saturating_add(millis(lifetime)),
        outcome: Outcome::Response(response),
    };
    match tokio::time::timeout(timeout, store.complete(&key, token, &record)).await {
        Ok(Ok(())) => Written::Now(record),
        _ => {
            let _ = tokio::time::timeout(timeout, store.release(&key, token)).await;
            Written::Failed
        }
    }
}
