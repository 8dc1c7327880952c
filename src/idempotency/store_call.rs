//! Every store call of a request: bounded by `store.timeout`, counted in
//! the metrics and timed for the log line; and the `begin` that may
//! outlive its caller's wait.

use std::future::Future;
use std::time::Duration;

use futures_util::future::FusedFuture;
use futures_util::future::{BoxFuture, Fuse};
use futures_util::FutureExt;
use tokio::time::Instant;
use tracing::Instrument;

use super::layer::Settings;
use crate::core::{settled_back, Begin, BeginOutcome, Clock, RecordKey, UnknownCause};
use crate::observe::{trace, RequestLog};
use crate::store::{SharedStore, Store, StoreError};

/// A `begin` that owns what it needs, so that it can outlive the caller's
/// wait (see [`release_unanswered_claim`]); fused, to tell whether it
/// finished.
pub(super) type OwnedBegin = Fuse<BoxFuture<'static, Result<BeginOutcome, StoreError>>>;

pub(super) fn owned_begin(store: &SharedStore, begin: &Begin) -> OwnedBegin {
    let (store, begin) = (store.clone(), begin.clone());
    async move { store.begin(&begin).await }.boxed().fuse()
}

/// Lets go of the claim a `begin` may have made for a request that was
/// answered 503 without executing: the call failed, or gave no answer
/// within `store.timeout`, and the store may have applied it all the same
/// (a reply lost to a reset connection, the client's own response
/// timeout, a write held by `CLIENT PAUSE`, a PostgreSQL row lock that
/// let go a second later). Without this the caller's retry finds a claim
/// nobody holds: 425 for the whole lease, then `outcome-unknown` for a
/// request that never ran.
///
/// Letting go must not lose what the claim replaced. A claim that took a
/// free key over is released: nothing was there. A claim that took over
/// a key whose outcome was unknown, to reconcile it (a route with
/// `reconcile_url`), is settled back to `outcome-unknown`: released, it
/// would free the key, and the next retry would run the payment again
/// without any lookup. When the answer never comes (or the call failed),
/// nothing says which of the two the claim was, so on such a route it is
/// settled `outcome-unknown` as well: fail closed, and the next retry
/// past the lease looks the operation up.
///
/// Every write is by the token the request drew before it asked
/// (`Begin::token`): fenced, so a claim that is not this request's, or no
/// claim, is left alone. It runs in a task of its own, holding no
/// `max_in_flight` slot, tracked for shutdown, and at most
/// [`MAX_LATE_RELEASES`](super::layer::MAX_LATE_RELEASES) at once; it tries again, backing off, while the
/// claim could still appear or be held, until `lease_ends`: the end of
/// the lease the claim would have, the lookup's time included.
pub(super) fn release_unanswered_claim(
    settings: &Settings,
    begin: &Begin,
    call: OwnedBegin,
    lease_ends: Instant,
) {
    let Ok(slot) = settings.late_releases.clone().try_acquire_owned() else {
        tracing::warn!(
            key = %begin.key.hex(),
            "too many claims being released in the background; this one fails closed when its lease ends"
        );
        return;
    };
    let (store, clock, begin) = (settings.store.clone(), settings.clock, begin.clone());
    let release = async move {
        let _slot = slot;
        let mut stopped = StoppedRelease(Some(begin.key));
        // What the call still does says whether it claimed the key, and
        // over what.
        let claimed = if call.is_terminated() {
            Claimed::Unheard
        } else {
            match tokio::time::timeout_at(lease_ends, call).await {
                Ok(Ok(BeginOutcome::Acquired {
                    reconcile: None, ..
                })) => Claimed::Key,
                Ok(Ok(BeginOutcome::Acquired {
                    reconcile: Some(cause),
                    ..
                })) => Claimed::Unknown(cause),
                Ok(Err(_)) | Err(_) => Claimed::Unheard,
                // The key was settled or held by another request: no claim
                // of this one's is there.
                Ok(Ok(_)) => return stopped.finished(),
            }
        };
        let letting_go = match claimed {
            Claimed::Key => LettingGo::Release,
            Claimed::Unheard if !begin.reconcile => LettingGo::Release,
            Claimed::Unheard => LettingGo::WriteBack(UnknownCause::Abandoned),
            Claimed::Unknown(cause) => LettingGo::WriteBack(cause),
        };
        let_go_by_token(&*store, &clock, &begin, letting_go, lease_ends).await;
        stopped.finished();
    };
    // In the request's span: the store calls' spans are its children.
    settings.tasks.spawn(release.in_current_span());
}

/// What an unanswered `begin` turned out to have claimed.
enum Claimed {
    /// A free key (or, without a lookup, a stale claim under `on_stale =
    /// "retry"`, which the next retry would take over anyway).
    Key,
    /// A key whose outcome was unknown (`cause`), taken over to reconcile it.
    Unknown(UnknownCause),
    /// No answer to go by: the call failed, or did not answer within the lease.
    Unheard,
}

/// How an unanswered claim is let go.
#[derive(Clone, Copy)]
enum LettingGo {
    /// Deleted: the key is free again.
    Release,
    /// Settled back to `outcome-unknown` with this cause.
    WriteBack(UnknownCause),
}

/// Says, when a release task is dropped before it finished (the drain
/// deadline passed and the runtime stopped), which key may keep a claim
/// whose request never ran: once its lease ends it answers
/// `outcome-unknown`, and only an operator can tell it never executed.
struct StoppedRelease(Option<RecordKey>);

impl StoppedRelease {
    fn finished(&mut self) {
        self.0 = None;
    }
}

impl Drop for StoppedRelease {
    fn drop(&mut self) {
        if let Some(key) = self.0 {
            tracing::warn!(
                key = %key.hex(),
                "shutdown stopped the release of a claim whose request was answered 503 and never ran; if the claim was made, the key answers 425 and then outcome-unknown: delete it (admin DELETE /v1/keys/{{hash}}?force=true) when the caller retries"
            );
        }
    }
}

/// Lets go of `begin.key` as `letting_go` says if `begin.token` holds
/// it, trying again until the write lands or `lease_ends`: a claim may
/// still appear (a write the store has not applied yet), and a store that
/// failed may come back.
async fn let_go_by_token(
    store: &dyn Store,
    clock: &Clock,
    begin: &Begin,
    letting_go: LettingGo,
    lease_ends: Instant,
) {
    let (key, token) = (begin.key, begin.token);
    // Encoded once, as a settling completion is (see `Store::prepare`):
    // every try writes the same bytes, so one whose reply was lost is
    // found to be the same write rather than fenced until the lease ends.
    let written_back = match letting_go {
        LettingGo::Release => None,
        LettingGo::WriteBack(cause) => {
            let record = settled_back(begin, clock.now_millis(), cause);
            match store.prepare(&key, record) {
                Ok(completion) => Some(completion),
                Err(e) => {
                    // The claim stays; once its lease ends the next retry
                    // takes it over as abandoned: still never freed.
                    tracing::error!(key = %key.hex(), error = %e, "cannot encode the outcome-unknown an unanswered claim is settled back to");
                    return;
                }
            }
        }
    };
    for attempt in 0u32.. {
        let call = async {
            match &written_back {
                None => store.release(&key, token).await,
                Some(completion) => store.complete_prepared(&key, token, completion).await,
            }
        };
        match tokio::time::timeout_at(lease_ends, call).await {
            Ok(Ok(())) => {
                match letting_go {
                    LettingGo::Release => tracing::warn!(
                        key = %key.hex(),
                        "released a claim whose begin answered after store.timeout or failed (its request was answered 503 and not executed)"
                    ),
                    LettingGo::WriteBack(cause) => tracing::warn!(
                        key = %key.hex(),
                        cause = ?cause,
                        "settled a claim whose begin answered after store.timeout or failed back to outcome-unknown: it may have taken over an unknown outcome to reconcile it, and freeing the key would let the next retry execute without a lookup"
                    ),
                }
                return;
            }
            // Not there (yet), or another request's: look again.
            Ok(Err(StoreError::Fenced)) => {}
            Ok(Err(e)) => {
                tracing::debug!(key = %key.hex(), error = %e, attempt, "letting go of an unanswered claim failed; trying again")
            }
            Err(_) => break,
        }
        let remaining = lease_ends.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        tokio::time::sleep(release_backoff(attempt).min(remaining)).await;
    }
}

/// The pause after release attempt `attempt` (from 0): 50 ms, doubling,
/// at most 1.6 s.
fn release_backoff(attempt: u32) -> Duration {
    Duration::from_millis(50 << attempt.min(5))
}

/// Every store call is bounded by `store.timeout` and timed for the log.
pub(super) async fn timed<'a, T, F>(
    settings: &'a Settings,
    log: &mut RequestLog,
    op: &'static str,
    call: impl FnOnce(&'a dyn Store) -> F,
) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>> + 'a,
{
    let started = Instant::now();
    let result = bounded(settings, op, settings.store_timeout, call(&*settings.store)).await;
    log.add_store_time(started.elapsed());
    result
}

/// A store call bounded by `limit` and counted in the metrics.
pub(super) async fn bounded<T>(
    settings: &Settings,
    op: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = Instant::now();
    let span = trace::store_span(op);
    let result = match tokio::time::timeout(limit, call.instrument(span.clone())).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Unavailable(format!(
            "no answer within {limit:?}"
        ))),
    };
    match &result {
        Ok(_) | Err(StoreError::Fenced) => {}
        Err(e) => trace::store_failed(&span, e.kind()),
    }
    settings.metrics.store_call(
        op,
        started.elapsed(),
        result.is_ok() || matches!(result, Err(StoreError::Fenced)),
    );
    result
}
