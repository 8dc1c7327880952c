//! Deleting expired rows: reads leave them out already, so the sweep only
//! gives their space back. Batches of [`SWEEP_BATCH`] rows, each its own
//! short statement, so no sweep holds locks for long; rows another
//! transaction holds are skipped (`SKIP LOCKED`), so proxies sweeping at
//! once do not wait on each other or on requests.
//!
//! For very large tables, daily partitions (by `expires_at`) dropped whole
//! are the alternative: see docs/stores.md.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::{millis, PostgresStore};
use crate::store::{purger, StoreError};

/// Rows one sweep statement deletes at most.
const SWEEP_BATCH: i64 = 1000;

impl PostgresStore {
    /// Deletes every row expired by now, in batches; returns how many.
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = millis(self.clock.now_millis());
        let mut client = self.client().await?;
        let mut purged = 0;
        loop {
            let batch = client
                .walk_execute(&self.sql.sweep, &[&now, &SWEEP_BATCH])
                .await?;
            purged += batch;
            if batch < u64::try_from(SWEEP_BATCH).unwrap_or(u64::MAX) {
                return Ok(purged);
            }
        }
    }

    /// Starts a task that sweeps every `every` (the first at once). It
    /// holds only a weak reference, and ends when the store is dropped.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) -> JoinHandle<()> {
        let stop = self.sweep_stop.subscribe();
        purger::spawn(Arc::downgrade(self), every, stop, |store| async move {
            store.purge_expired().await
        })
    }
}
