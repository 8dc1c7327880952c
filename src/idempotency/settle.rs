//! Settling the key a request holds: `complete` with its outcome, or
//! `release` so a retry executes. A transient store error must not turn a
//! known outcome into an unknown one (nor keep a released key held), so a
//! settling call is retried: briefly while the client waits, then in the
//! background until the claim's lease ends.

use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::context::{Claim, RequestContext};
use super::layer::Settings;
use super::store_call::{bounded, timed};
use crate::core::{millis, CompletedRecord, FencingToken, Outcome, Record, RecordKey};
use crate::observe::RouteMetrics;
use crate::store::{Completion, Store, StoreError};

/// A request that holds its key: what settling the key takes.
pub(super) struct Holder {
    pub(super) cx: RequestContext,
    pub(super) claim: Claim,
    /// Fences every settling call: a key taken over by another request is
    /// not this one's to settle any more.
    pub(super) token: FencingToken,
}

impl Holder {
    /// Stores `outcome` as the key's completed record.
    pub(super) async fn complete(&mut self, outcome: Outcome) {
        let record = self.record_of(outcome);
        self.complete_with(record).await;
    }

    /// The completed record `outcome` makes of the key held, as of now.
    pub(super) fn record_of(&self, outcome: Outcome) -> CompletedRecord {
        let now = self.cx.settings.clock.now_millis();
        CompletedRecord {
            fingerprint: self.claim.fingerprint,
            created_at: self.claim.arrived_at,
            completed_at: now,
            expires_at: now.saturating_add(millis(self.cx.policy.settings.ttl)),
            outcome,
        }
    }

    /// Stores `record` (made by [`Self::record_of`]) as the key's.
    pub(super) async fn complete_with(&mut self, record: CompletedRecord) {
        let completion = Box::new(self.cx.settings.store.prepare(&self.claim.key, record));
        self.settle(Settling::Complete(completion)).await;
    }

    /// Lets the key go, so a retry executes.
    pub(super) async fn release(&mut self) {
        self.settle(Settling::Release).await;
    }

    /// Completes or releases the key this request holds. A transient store
    /// error must not turn a known outcome into an unknown one (nor keep a
    /// released key held), so the call is retried: briefly here, while the
    /// client waits, then in the background (see [`Self::settle_late`]).
    async fn settle(&mut self, settling: Settling) {
        if !self.settle_inline(&settling).await {
            self.settle_late(settling);
        }
        // Settled, now or by `settle_late`.
        self.cx.log.set_unsettled(false);
    }

    /// The tries made while the client waits; whether they settled the key.
    async fn settle_inline(&mut self, settling: &Settling) -> bool {
        let (key, token) = (self.claim.key, self.token);
        for attempt in 0..INLINE_SETTLE_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(settle_backoff(attempt - 1)).await;
            }
            let cx = &mut self.cx;
            let result = timed(&cx.settings, &mut cx.log, settling.op(), |s| {
                settling.call(s, &key, token)
            })
            .await;
            let metrics = cx.log.metrics();
            if settled(&cx.settings, metrics, &key, settling, result, attempt).await {
                return true;
            }
        }
        false
    }

    /// Goes on settling the key in a task of its own once the client has
    /// had its answer, until the store takes it or the claim's lease ends
    /// (then the key is the next retry's to settle, per `on_stale`, and this
    /// request's token is no good anyway). Without it, a store that failed
    /// for a second or two, a Redis failover say, left the key pending:
    /// retries got 425 until the lease ran out, then `outcome-unknown`
    /// for a request whose outcome the proxy had (or, for a release, that
    /// a retry could have run safely).
    ///
    /// The task keeps this request's `max_in_flight` permit: a store that
    /// keeps failing cannot gather more of them than requests were allowed.
    fn settle_late(&mut self, settling: Settling) {
        let cx = &mut self.cx;
        let settings = cx.settings.clone();
        let route_metrics = cx.log.metrics().clone();
        let permit = cx.permit.split(cx.permit.num_permits());
        let counted = cx.settings.metrics.settling();
        let (key, lease_ends, token) = (self.claim.key, self.claim.lease_ends, self.token);
        let settle = async move {
            // The gauge goes down before the slot is free.
            let _held = (counted, permit);
            for attempt in INLINE_SETTLE_ATTEMPTS.. {
                let remaining = lease_ends.saturating_duration_since(Instant::now());
                tokio::time::sleep(settle_backoff(attempt - 1).min(remaining)).await;
                // One call at a time, waited for until the lease ends rather
                // than `store.timeout`: a call given up on can still be
                // queued in the store (the embedded store's writer), and a
                // new one each time would queue a copy of the record each.
                let limit = lease_ends.saturating_duration_since(Instant::now());
                if limit.is_zero() {
                    tracing::error!(
                        key = %key.to_hex(),
                        "gave up settling the key: its lease ended, and the next retry settles it per on_stale"
                    );
                    return;
                }
                let call = settling.call(&*settings.store, &key, token);
                let result = bounded(&settings, settling.op(), limit, call).await;
                let stored = result.is_ok();
                if settled(&settings, &route_metrics, &key, &settling, result, attempt).await {
                    if stored {
                        tracing::warn!(key = %key.to_hex(), op = settling.op(), attempt, "settled the key after the store came back");
                    }
                    return;
                }
            }
        };
        // In the request's span: the store calls' spans are its children.
        self.cx.settings.tasks.spawn(settle.in_current_span());
    }
}

/// The longest a live holder spends on store calls of its own inside its
/// lease, besides the upstream exchange (which `upstream.timeout`
/// bounds): its `begin`, and the completion tries made while the client
/// waits with the pauses between them. A lease margin shorter than this
/// lets a retry find a live request's claim expired.
pub fn store_time_in_lease(store_timeout: Duration) -> Duration {
    let pauses: Duration = (0..INLINE_SETTLE_ATTEMPTS - 1).map(settle_backoff).sum();
    store_timeout * (1 + INLINE_SETTLE_ATTEMPTS) + pauses
}

/// `complete` and `release` are tried this many times while the client
/// waits for its answer (~150 ms of pauses between them), then in the
/// background until the lease ends (see `Holder::settle_late`).
const INLINE_SETTLE_ATTEMPTS: u32 = 3;

/// The pause after failed settling attempt `attempt` (from 0): 50 ms,
/// doubling, at most 1.6 s.
fn settle_backoff(attempt: u32) -> Duration {
    Duration::from_millis(50 << attempt.min(5))
}

/// What a request that holds a key still has to tell the store.
enum Settling {
    /// The record, encoded once before the first try (see
    /// [`Store::prepare`]): every try sends the same bytes, so a retry
    /// whose first reply was lost is found to be the same write, and
    /// still waits for the replicas. An encoding that failed fails every
    /// try alike.
    Complete(Box<Result<Completion, StoreError>>),
    Release,
}

impl Settling {
    fn op(&self) -> &'static str {
        match self {
            Settling::Complete(..) => "complete",
            Settling::Release => "release",
        }
    }

    async fn call(
        &self,
        store: &dyn Store,
        key: &RecordKey,
        token: FencingToken,
    ) -> Result<(), StoreError> {
        match self {
            Settling::Complete(prepared) => match prepared.as_ref() {
                Ok(completion) => store.complete_prepared(key, token, completion).await,
                Err(e) => Err(e.clone()),
            },
            Settling::Release => store.release(key, token).await,
        }
    }
}

/// Whether one settling call's `result` ends the settling: it succeeded,
/// or the store says the key is not this request's any more, or holds
/// something asking again will not change. Otherwise it is logged, to be
/// tried again.
async fn settled(
    settings: &Settings,
    route_metrics: &RouteMetrics,
    key: &RecordKey,
    settling: &Settling,
    result: Result<(), StoreError>,
    attempt: u32,
) -> bool {
    let op = settling.op();
    match result {
        Ok(()) => {
            if let Settling::Release = settling {
                route_metrics.key_released();
            }
            true
        }
        Err(StoreError::Fenced) => {
            if let Settling::Complete(prepared) = settling {
                if let Ok(completion) = prepared.as_ref() {
                    fenced(settings, key, &completion.record).await;
                }
            }
            true
        }
        Err(e @ StoreError::Corrupt(_)) => {
            tracing::error!(error = %e, op, "could not settle the key");
            true
        }
        Err(e) => {
            tracing::error!(error = %e, op, attempt, "could not settle the key");
            false
        }
    }
}

/// A completion refused as not the key's holder's: either an earlier try
/// of the same completion got there first (it timed out here but went on in
/// the store, or the cluster client sent it twice), or the key was lost.
/// Only the second is worth an error.
async fn fenced(settings: &Settings, key: &RecordKey, record: &CompletedRecord) {
    let stored = tokio::time::timeout(settings.store_timeout, settings.store.get(key)).await;
    if let Ok(Ok(Some(Record::Completed(done)))) = &stored {
        if done.fingerprint == record.fingerprint && done.completed_at == record.completed_at {
            return;
        }
    }
    tracing::error!(
        key = %key.to_hex(),
        "lost the key before completing it (lease expired and another request took it over)"
    );
}
