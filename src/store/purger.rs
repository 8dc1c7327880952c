//! The periodic purge of expired records that the stores on disk run
//! (embedded, PostgreSQL): a task per store, which holds only a weak
//! reference to it and ends when the store is dropped.

use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::StoreError;

/// Runs `purge` on `store` every `every` (the first at once, clearing what
/// expired while the process was down) until the store is gone or `stop`'s
/// sender is dropped. Must be called within a Tokio runtime.
pub(crate) fn spawn<S, F, Fut>(
    store: Weak<S>,
    every: Duration,
    mut stop: watch::Receiver<()>,
    purge: F,
) -> JoinHandle<()>
where
    S: Send + Sync + 'static,
    F: Fn(Arc<S>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<u64, StoreError>> + Send,
{
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(every);
        // A purge that overran its period must not be followed by a burst
        // of catch-up purges.
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                // Only ever an error: the sender is never used to send.
                _ = stop.changed() => return,
            }
            let Some(store) = store.upgrade() else {
                return;
            };
            match purge(store).await {
                Ok(0) => {}
                Ok(purged) => tracing::debug!(purged, "purged expired records"),
                Err(error) => {
                    tracing::warn!(%error, "purging expired records failed; will retry")
                }
            }
        }
    })
}
