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
    /// Whether the caller can ask the upstream what became of a key whose
    /// outcome is unknown (a route with `reconcile_url`): then a claim
    /// past its lease, and an `outcome-unknown` record whose request's
    /// lease has run out, are taken over by a new claim that must look
    /// the outcome up before executing anything (see
    /// [`BeginOutcome::Acquired`]'s `reconcile`).
    pub reconcile: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BeginOutcome {
    /// The caller now holds the key and must complete or release it.
    Acquired {
        token: FencingToken,
        /// True when a stale claim was taken over (`on_stale = "retry"`,
        /// or to reconcile it): its holder died, which is counted.
        took_over: bool,
        /// Set when the key's outcome is unknown (a claim past its lease,
        /// or an `outcome-unknown` record) and the caller asked to
        /// reconcile: the claim is held to look the outcome up first, and
        /// the request executes only if the lookup says it never happened.
        /// A lookup that fails settles the key with this cause, as it was.
        reconcile: Option<UnknownCause>,
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

/// The `outcome-unknown` record a claim of `begin` is settled back to at
/// `now` when it must be let go of without executing, having replaced a
/// key whose outcome was unknown (`cause`; see
/// [`BeginOutcome::Acquired`]'s `reconcile`), or without knowing what it
/// replaced. Released instead, the key would be free and the next retry
/// would execute with no lookup. It counts as created now, later than the
/// outcome it replaced: the next lookup comes a lease from now, never
/// sooner than it would have.
pub fn settled_back(begin: &Begin, now: UnixMillis, cause: UnknownCause) -> CompletedRecord {
    CompletedRecord {
        fingerprint: begin.fingerprint,
        created_at: now,
        completed_at: now,
        expires_at: now.saturating_add(millis(begin.ttl)),
        outcome: Outcome::Unknown { cause },
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
    let claim = |took_over: bool, reconcile: Option<UnknownCause>| {
        let claim = new_claim(begin, now, begin.token);
        (
            BeginOutcome::Acquired {
                token: claim.token,
                took_over,
                reconcile,
            },
            Some(Record::Pending(claim)),
        )
    };
    match existing {
        None => claim(false, None),
        Some(record) if record.fingerprint() != &begin.fingerprint => (
            BeginOutcome::Mismatch {
                state: record.state(),
            },
            None,
        ),
        Some(Record::Completed(done)) => match done.outcome {
            // Its request's lease is over, so by what `reconcile_url`
            // promises ("absent" means the upstream will never perform it)
            // a lookup now is final. Before that, an upstream that timed
            // out may still be working on it: the record stands.
            Outcome::Unknown { cause }
                if begin.reconcile
                    && done.created_at.saturating_add(millis(begin.lease)) <= now =>
            {
                claim(false, Some(cause))
            }
            _ => (BeginOutcome::Completed(Arc::new(done)), None),
        },
        Some(Record::Pending(p)) if p.lease_expires_at > now => (
            BeginOutcome::InFlight {
                lease_expires_at: p.lease_expires_at,
            },
            None,
        ),
        Some(Record::Pending(_)) if begin.reconcile => claim(true, Some(UnknownCause::Abandoned)),
        Some(Record::Pending(p)) => match begin.on_stale {
            OnStale::Retry => claim(true, None),
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

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);

    fn begin(reconcile: bool) -> Begin {
        Begin {
            key: RecordKey::from_bytes([1; 32]),
            fingerprint: Fingerprint([2; 32]),
            lease: LEASE,
            ttl: Duration::from_secs(3600),
            on_stale: OnStale::Store,
            token: FencingToken::random(),
            reconcile,
        }
    }

    fn unknown(created_at: UnixMillis, cause: UnknownCause) -> Record {
        Record::Completed(CompletedRecord {
            fingerprint: Fingerprint([2; 32]),
            created_at,
            completed_at: created_at + 1_000,
            expires_at: created_at + 3_600_000,
            outcome: Outcome::Unknown { cause },
        })
    }

    fn stale_claim() -> Record {
        let mut claim = new_claim(&begin(false), 0, FencingToken::random());
        claim.lease_expires_at = 5_000;
        Record::Pending(claim)
    }

    fn reconciling(outcome: &BeginOutcome) -> Option<UnknownCause> {
        match outcome {
            BeginOutcome::Acquired { reconcile, .. } => *reconcile,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    #[test]
    fn a_stale_claim_is_taken_over_to_reconcile_when_asked() {
        let (outcome, write) = decide_begin(&begin(true), Some(stale_claim()), 6_000);
        assert_eq!(reconciling(&outcome), Some(UnknownCause::Abandoned));
        assert!(matches!(
            outcome,
            BeginOutcome::Acquired {
                took_over: true,
                ..
            }
        ));
        assert!(matches!(write, Some(Record::Pending(p)) if p.lease_expires_at == 16_000));
        // Without a lookup it settles fail-closed, as always.
        let (outcome, _) = decide_begin(&begin(false), Some(stale_claim()), 6_000);
        assert!(matches!(outcome, BeginOutcome::Settled(_)));
    }

    #[test]
    fn an_unknown_outcome_is_taken_over_to_reconcile_once_its_lease_is_over() {
        let record = unknown(0, UnknownCause::Timeout);
        let (outcome, write) = decide_begin(&begin(true), Some(record.clone()), 10_000);
        assert_eq!(reconciling(&outcome), Some(UnknownCause::Timeout));
        // Its holder's end was counted when it settled.
        assert!(matches!(
            outcome,
            BeginOutcome::Acquired {
                took_over: false,
                ..
            }
        ));
        assert!(matches!(write, Some(Record::Pending(_))));
        // The upstream may still be working on it: the record stands.
        let (outcome, write) = decide_begin(&begin(true), Some(record.clone()), 9_999);
        assert!(matches!(outcome, BeginOutcome::Completed(_)) && write.is_none());
        let (outcome, write) = decide_begin(&begin(false), Some(record), 60_000);
        assert!(matches!(outcome, BeginOutcome::Completed(_)) && write.is_none());
    }

    #[test]
    fn reconciling_leaves_known_outcomes_and_other_requests_alone() {
        let mut known = unknown(0, UnknownCause::Abandoned);
        if let Record::Completed(done) = &mut known {
            done.outcome = Outcome::NotStored { status: 201 };
        }
        let (outcome, write) = decide_begin(&begin(true), Some(known), 60_000);
        assert!(matches!(outcome, BeginOutcome::Completed(_)) && write.is_none());
        let mut other = unknown(0, UnknownCause::Abandoned);
        if let Record::Completed(done) = &mut other {
            done.fingerprint = Fingerprint([3; 32]);
        }
        let (outcome, write) = decide_begin(&begin(true), Some(other), 60_000);
        assert!(matches!(outcome, BeginOutcome::Mismatch { .. }) && write.is_none());
        let (outcome, _) = decide_begin(&begin(true), None, 60_000);
        assert_eq!(reconciling(&outcome), None);
    }
}
