//! Every store call of a request: bounded by `store.timeout`, counted in
//! the metrics and timed for the log line; and the `begin` that may
//! outlive its caller's wait.

use std::future::Future;
use std::time::Duration;

use futures_util::future::{BoxFuture, Fuse};
use futures_util::FutureExt;
use tokio::time::Instant;

use super::layer::Settings;
use crate::core::{Begin, BeginOutcome, RecordKey};
use crate::observe::RequestLog;
use crate::store::{SharedStore, Store, StoreError};

/// A `begin` that owns what it needs, so that it can outlive the caller's
/// wait (see [`release_late_claim`]); fused, to tell whether it finished.
pub(super) type OwnedBegin = Fuse<BoxFuture<'static, Result<BeginOutcome, StoreError>>>;

pub(super) fn owned_begin(store: &SharedStore, begin: &Begin) -> OwnedBegin {
    let (store, begin) = (store.clone(), begin.clone());
    async move { store.begin(&begin).await }.boxed().fuse()
}

/// Finishes a `begin` that gave no answer within `store.timeout`, after its
/// request was answered 503 without executing. If it turns out to have
/// claimed the key, the claim is released: otherwise the caller's retry
/// would find the key in flight and, once the lease ran out, settled as
/// outcome-unknown, for a request that never ran. Waits at most a lease
/// (after that the claim is stale anyway).
pub(super) async fn release_late_claim(
    store: SharedStore,
    key: RecordKey,
    call: OwnedBegin,
    lease: Duration,
) {
    let Ok(Ok(BeginOutcome::Acquired { token, .. })) = tokio::time::timeout(lease, call).await
    else {
        return;
    };
    match tokio::time::timeout(lease, store.release(&key, token)).await {
        Ok(Ok(())) => tracing::warn!(
            key = %key.hex(),
            "released a claim whose begin answered after store.timeout (its request was answered 503 and not executed)"
        ),
        Ok(Err(StoreError::Fenced)) => {}
        Ok(Err(e)) => tracing::error!(
            key = %key.hex(),
            error = %e,
            "could not release a claim whose begin answered late; it fails closed when its lease ends"
        ),
        Err(_) => tracing::error!(
            key = %key.hex(),
            "no answer releasing a claim whose begin answered late; it fails closed when its lease ends"
        ),
    }
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
    let result = match tokio::time::timeout(limit, call).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Unavailable(format!(
            "no answer within {limit:?}"
        ))),
    };
    settings.metrics.store_call(
        op,
        started.elapsed(),
        result.is_ok() || matches!(result, Err(StoreError::Fenced)),
    );
    result
}
