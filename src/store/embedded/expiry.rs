//! Expiry: compactions drop expired records as they rewrite the tables
//! (a compaction filter reading each value's `expires_at` prefix), and a
//! purge deletes them for the times compactions do not run (an idle
//! store: compactions follow writes).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fjall::compaction::filter::{
    CompactionFilter, CompactionFilterResult, Context, Factory, ItemAccessor, Verdict,
};

use super::tables::expiry_of;
use crate::core::UnixMillis;

/// Records deleted per purge group: the purge shares the one writer with
/// the traffic, so it goes in groups that let claims interleave.
pub(super) const PURGE_BATCH: usize = 1024;

/// The time by the store's clock up to which records count as expired to
/// compactions: advanced by each purge, which reads the store's clock. A
/// compaction runs on fjall's thread, where a clock that follows (paused)
/// tokio time cannot be read; and a horizon behind the clock only keeps
/// records longer, which readers see as absent anyway.
#[derive(Clone, Debug, Default)]
pub(super) struct Horizon(Arc<AtomicU64>);

impl Horizon {
    pub(super) fn advance(&self, now: UnixMillis) {
        self.0.fetch_max(now, Ordering::Relaxed);
    }

    fn get(&self) -> UnixMillis {
        self.0.load(Ordering::Relaxed)
    }
}

/// Makes the compaction filter of the records keyspace.
pub(super) struct ExpiryFilters(pub(super) Horizon);

impl Factory for ExpiryFilters {
    fn name(&self) -> &str {
        "idemproxy-expiry"
    }

    fn make_filter(&self, _: &Context) -> Box<dyn CompactionFilter> {
        Box::new(ExpiryFilter {
            expired_by: self.0.get(),
        })
    }
}

struct ExpiryFilter {
    expired_by: UnixMillis,
}

impl CompactionFilter for ExpiryFilter {
    fn filter_item(&mut self, item: ItemAccessor<'_>, _: &Context) -> CompactionFilterResult {
        let value = item.value()?;
        Ok(match expiry_of(&value) {
            // A tombstone, not nothing: an older version of the key in a
            // table this compaction does not read must stay shadowed.
            Some(expires_at) if expires_at <= self.expired_by => Verdict::Remove,
            // Unexpired, or a value that does not read: that is for an
            // operator to see and remove.
            _ => Verdict::Keep,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::core::{Clock, RecordKey};
    use crate::store::embedded::tests::{begin, completed, token};
    use crate::store::embedded::EmbeddedStore;
    use crate::store::{OnStale, Store};

    /// Compactions drop what expired by the purge's last look at the
    /// clock, and nothing else; a record rewritten with a shorter expiry
    /// (a claim, then its completion) does not bring its older version
    /// back once the newer one is dropped.
    #[tokio::test(start_paused = true)]
    async fn compactions_drop_expired_records_without_resurrecting_older_versions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EmbeddedStore::open(dir.path())
            .expect("open")
            .with_clock(Clock::tokio());
        let kept = RecordKey::from_bytes([1; 32]);
        let rewritten = RecordKey::from_bytes([2; 32]);
        token(
            store
                .begin(&begin(kept, 60_000, OnStale::Store))
                .await
                .expect("claim"),
        );
        // Claimed for a minute (lease) plus 300 ms (ttl), in a table of
        // its own; then completed, expiring at once (by the wall clock the
        // record was made with), in a newer one.
        let claim = token(
            store
                .begin(&begin(rewritten, 60_000, OnStale::Store))
                .await
                .expect("claim"),
        );
        store.records.rotate_memtable_and_wait().expect("flush");
        store
            .complete(&rewritten, claim, &completed(0))
            .await
            .expect("complete");
        store.records.rotate_memtable_and_wait().expect("flush");

        tokio::time::advance(Duration::from_secs(1)).await;
        store.horizon.advance(store.clock.now_millis());
        store.records.major_compact().expect("compact");
        assert_eq!(store.record_count().await.expect("count"), 1);
        assert_eq!(store.get(&rewritten).await.expect("get"), None);
        assert!(store.get(&kept).await.expect("get").is_some());
    }
}
