//! The begin decision: what claiming a key does, given what the store
//! holds for it. Every store runs this same function inside its own atomic
//! step (a lock, a write transaction, a Lua script's read-then-write), so
//! the stores cannot drift apart on what `begin` means.

use std::sync::Arc;
use std::time::Duration;

use super::clock::{millis, UnixMillis};
use super::ids::{FencingToken, Fingerprint, RecordKey};
use super::record::{CompletedRecord, KeyState, Outcome, PendingRecord, Record, UnknownCause};

/// What to do with a pending record whose lease expired: its holder died
/// mid-call, so whether the upstream executed is unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStale {
    /// Fail closed: settle the key as `outcome-unknown` for good.
    Store,
    /// Let the new request take the key over (a second execution is possible).
    Retry,
}

/// A request to claim a key.
#[derive(Clone, Debug)]
pub struct Begin {
    pub key: RecordKey,
    pub fingerprint: Fingerprint,
    /// How long the claim protects the key before its holder is presumed dead.
    pub lease: Duration,
    /// How long a completed record (and an abandoned claim) is kept.
    pub ttl: Duration,
    pub on_stale: OnStale,
    /// The token a claim made by this call is held with, drawn by the
    /// caller ([`FencingToken::random`]), once per request: a claim found
    /// holding it is this request's own (a reply lost on the way, the
    /// command sent again). Knowing it before the answer is what lets a
    /// caller that never heard the answer release the claim. Never shared
    /// between requests.
    pub token: FencingToken,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BeginOutcome {
    /// The caller now holds the key and must complete or release it.
    Acquired {
        token: FencingToken,
        /// True when a stale claim was taken over (`on_stale = "retry"`).
        took_over: bool,
    },
    /// The key has a settled outcome for this same request. Shared: a
    /// replay cache hands out the record it holds without copying its
    /// headers and body (a replay only reads it).
    Completed(Arc<CompletedRecord>),
    /// This call found the key's claim past its lease (its holder died
    /// mid-call) and settled it fail-closed as an abandoned
    /// `outcome-unknown` (`on_stale = "store"`). Later calls get
    /// `Completed` with the same record; only this one says it happened now,
    /// which is what `idemproxy_expired_leases_total` counts.
    Settled(Arc<CompletedRecord>),
    /// Another request with the same fingerprint holds the key.
    InFlight { lease_expires_at: UnixMillis },
    /// The key belongs to a different request.
    Mismatch { state: KeyState },
}

/// A new claim of `begin.key` made at `now`, held with `token`.
pub fn new_claim(begin: &Begin, now: UnixMillis, token: FencingToken) -> PendingRecord {
    let lease_expires_at = now.saturating_add(millis(begin.lease));
    PendingRecord {
        fingerprint: begin.fingerprint,
        token,
        created_at: now,
        lease_expires_at,
        // An abandoned claim is kept as long as a completion would be, so
        // fail-closed answers outlive the retries that ask for them.
        expires_at: lease_expires_at.saturating_add(millis(begin.ttl)),
    }
}

/// The decision `begin` makes, shared by all stores so that they cannot
/// drift apart. `existing` is the live (unexpired) record, if any; returns
/// the outcome and the record to write, if the key changes. A claim it
/// makes is held with `begin.token`.
pub fn decide_begin(
    begin: &Begin,
    existing: Option<Record>,
    now: UnixMillis,
) -> (BeginOutcome, Option<Record>) {
    let claim = |took_over: bool| {
        let claim = new_claim(begin, now, begin.token);
        (
            BeginOutcome::Acquired {
                token: claim.token,
                took_over,
            },
            Some(Record::Pending(claim)),
        )
    };
    match existing {
        None => claim(false),
        Some(record) if record.fingerprint() != &begin.fingerprint => (
            BeginOutcome::Mismatch {
                state: record.state(),
            },
            None,
        ),
        Some(Record::Completed(done)) => (BeginOutcome::Completed(Arc::new(done)), None),
        Some(Record::Pending(p)) if p.lease_expires_at > now => (
            BeginOutcome::InFlight {
                lease_expires_at: p.lease_expires_at,
            },
            None,
        ),
        Some(Record::Pending(p)) => match begin.on_stale {
            OnStale::Retry => claim(true),
            OnStale::Store => {
                let done = CompletedRecord {
                    fingerprint: p.fingerprint,
                    created_at: p.created_at,
                    completed_at: now,
                    expires_at: now.saturating_add(millis(begin.ttl)),
                    outcome: Outcome::Unknown {
                        cause: UnknownCause::Abandoned,
                    },
                };
                (
                    BeginOutcome::Settled(Arc::new(done.clone())),
                    Some(Record::Completed(done)),
                )
            }
        },
    }
}

/// Which records the proxy's `Store::remove` deletes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Whatever the record holds (the admin API's `?force=true`).
    Any,
    /// Anything but a claim whose lease still runs: that is a request
    /// executing now (or one whose proxy died moments ago), and with its
    /// claim gone a retry would execute beside it.
    UnlessLeased,
}

/// What the proxy's `Store::remove` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removed {
    /// A live record was there and is gone.
    Deleted,
    /// Nothing live was there (an expired record is dropped all the same).
    Absent,
    /// A claim whose lease runs until `until` was left in place
    /// ([`Removal::UnlessLeased`]).
    Leased { until: UnixMillis },
}

/// The lease end of `record` if it is a claim whose lease runs at `now`:
/// what [`Removal::UnlessLeased`] keeps.
pub fn running_lease(record: &Record, now: UnixMillis) -> Option<UnixMillis> {
    match record {
        Record::Pending(claim) if claim.lease_expires_at > now => Some(claim.lease_expires_at),
        _ => None,
    }
}
