//! Durable store on local disk (the default): an LSM tree (fjall) in one
//! directory, one process. Records survive restarts and crashes, because
//! every change is in a journal synced to disk (`fdatasync`) before its
//! call returns.
//!
//! # Group commit
//!
//! An fsync takes a fraction of a millisecond to several: a sync per
//! change would cap the store at one change per fsync. So every change
//! goes to one writer thread, which takes all the changes queued while it
//! was busy (up to [`MAX_GROUP`]), applies them in order to the group's
//! view of the keyspace ([`tables::Tables`]), then writes them as one
//! batch to the journal and syncs it once; only then does it answer their
//! callers. Each change still sees every change queued before it, and is
//! answered only once it is durable, so the contract is the one a
//! transaction per change gave. A change refused on its own merits (a
//! fencing token that does not own the key, a record that does not decode)
//! writes nothing and leaves the rest of its group to commit; a failure of
//! fjall itself aborts the group, and every change in it gets the error.
//!
//! The queue to the writer holds at most [`MAX_QUEUED`] changes: past that
//! the disk is not keeping up, and a change fails at once (503) instead of
//! joining the backlog. A `begin` whose caller stopped waiting (it timed
//! out and answered its request 503) is skipped when its turn comes, so
//! that a stalled disk does not leave claims nobody holds; completions and
//! releases run late all the same.
//!
//! `begin` goes to the writer too, which decides it on the state it would
//! change: most begins are first executions, which write. Those that only
//! decide (a duplicate in flight, a replay) do not make their group write:
//! a group that wrote nothing ends without a batch or an fsync. Replays of
//! recent keys do not reach the store at all: `open_store` puts a replay
//! cache in front of it (see [`crate::store::cache`]). `get`, the walks and
//! `ping` read the keyspace on Tokio's blocking pool and never wait for the
//! writer.
//!
//! # Only durable state is served
//!
//! A group's writes reach the keyspace only through
//! [`tables::Tables::commit`], which syncs the journal before it applies
//! the batch to the memtables and makes it visible: what any reader sees
//! is durable. Within a group, changes read each other's writes from the
//! group's own overlay, and are answered after the sync.
//!
//! # Fencing tokens across restarts
//!
//! A claim's fencing token is the 128-bit random token its caller drew
//! (`Begin::token`), stored in the claim's record: the store hands out no
//! counter that a restart could wind back. A holder from before a crash
//! keeps owning its key only if its claim was durable (then the record
//! after the restart is that claim); a claim lost with an unsynced group
//! was never answered, so nobody holds it.
//!
//! # Layout
//!
//! One keyspace, [`RECORDS_KEYSPACE`]: the 32 record-key bytes → the
//! record's `expires_at` (8 bytes, big-endian) and [`Record::encode`]'s
//! bytes. Expired records are dropped by compactions (a filter reading that
//! prefix, [`expiry`]) and by the purge, which walks the keyspace for the
//! idle times when no compaction runs. A directory written by the redb
//! store of earlier versions is migrated on open ([`migrate`]).
//!
//! fjall is a blocking library: it runs on the writer thread, on its own
//! background threads (flushes, compactions) and on Tokio's blocking pool,
//! never on a traffic worker's event loop.

mod database;
mod expiry;
pub mod migrate;
mod tables;
mod writer;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fjall::Keyspace;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use self::expiry::{ExpiryFilters, Horizon, PURGE_BATCH};
use self::tables::{
    db_error, decode, encode_completed, encode_value, expiry_of, live, read, record_bytes,
};
use self::writer::{Waited, WriteError, Writer};
pub use self::writer::{MAX_GROUP, MAX_QUEUED};
use super::{
    check_owner, scan_after, Begin, BeginOutcome, ListPage, ListWant, Removal, Removed, ScanCursor,
    ScanPage, Store, StoreError,
};
use crate::core::{
    decide_begin, running_lease, Clock, CompletedRecord, FencingToken, Record, RecordKey,
    RecordMeta, UnixMillis,
};

/// The database directory inside the configured one.
pub const DATA_DIR: &str = "idemproxy.fjall";

/// The keyspace holding the records (see "Layout" above). Public so that
/// tools and tests can inspect the database directly while no store has it
/// open.
pub const RECORDS_KEYSPACE: &str = "records";

/// A [`Store`] on local disk, backed by fjall.
///
/// Share it as `Arc<EmbeddedStore>` (it coerces to a [`super::SharedStore`]).
/// The database stays locked, and open, until the store and every call
/// still running on it are dropped.
pub struct EmbeddedStore {
    /// Holds the database open (and locked) with the writer's handle.
    records: Keyspace,
    path: PathBuf,
    /// Every change goes through here. Dropping it closes the queue and
    /// joins the writer thread (which holds the database), so the database
    /// is closed by the time the store is gone and a restart can open it
    /// again at once; unless a read or a purge is still running on the
    /// blocking pool, with its own handle, which closes it when it ends.
    writer: Writer,
    /// Up to when compactions drop expired records: advanced by the purge.
    horizon: Horizon,
    /// What this open migrated from an earlier version's redb file.
    migrated: Option<migrate::Migrated>,
    /// Never sent on: dropping the store drops it, which ends the purger at
    /// once instead of at its next tick.
    purger_stop: watch::Sender<()>,
    /// Where leases and expiry read the time. Read by the caller, on its
    /// runtime, and handed to the writer with the change: a clock that
    /// follows (paused) tokio time has no runtime on the writer's thread.
    clock: Clock,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl EmbeddedStore {
    /// Opens (creating if needed) the database in `dir`, which is created too
    /// if missing, and migrates the records of an earlier version's redb
    /// file found there ([`migrate`]).
    ///
    /// Blocking: it does file I/O, and after a crash fjall replays its
    /// journal before returning. Call it at startup, or through
    /// `spawn_blocking`.
    ///
    /// The database is locked exclusively: a second open of the same
    /// directory, from this process or another, fails with
    /// [`StoreError::Unavailable`].
    pub fn open(dir: &Path) -> Result<EmbeddedStore, StoreError> {
        Self::open_reporting(dir, &mut |_| {})
    }

    /// [`Self::open`], telling `copied` how many records each batch of a
    /// migration from redb copied (`idemproxy store migrate`'s progress).
    pub fn open_reporting(
        dir: &Path,
        copied: &mut dyn FnMut(u64),
    ) -> Result<EmbeddedStore, StoreError> {
        fs::create_dir_all(dir).map_err(|e| {
            StoreError::Unavailable(format!(
                "cannot create the store directory {}: {e}",
                dir.display()
            ))
        })?;
        let path = dir.join(DATA_DIR);
        let horizon = Horizon::default();
        let (db, records) = database::open(&path, Arc::new(ExpiryFilters(horizon.clone())))?;
        let migrated = migrate::from_redb(dir, &db, &records, copied)?;
        let (purger_stop, _) = watch::channel(());
        Ok(EmbeddedStore {
            writer: Writer::start(db, records.clone())?,
            records,
            path,
            horizon,
            migrated,
            purger_stop,
            clock: Clock::wall(),
        })
    }

    /// Groups the writer has written and synced since the store opened.
    /// Under concurrent load, fewer than the changes they carried.
    pub fn commit_count(&self) -> u64 {
        self.writer.commits.load(Ordering::Relaxed)
    }

    /// Reads the time from `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// What opening the store migrated from an earlier version's redb file
    /// (`None`: there was none).
    pub fn migrated(&self) -> Option<migrate::Migrated> {
        self.migrated
    }

    /// The database directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Deletes every record whose `expires_at` has passed; returns how many.
    ///
    /// Async: it walks the keyspace on the blocking pool, reading each
    /// value's expiry prefix, and deletes what is due through the writer,
    /// in groups of [`PURGE_BATCH`]. Records that cannot be read are left
    /// for an operator to inspect and remove. It also lets compactions drop
    /// what expired by now.
    pub async fn purge_expired(&self) -> Result<usize, StoreError> {
        let now = self.clock.now_millis();
        self.horizon.advance(now);
        let mut after: Option<RecordKey> = None;
        let mut purged = 0;
        loop {
            let (due, walked_to) = self
                .blocking(move |records| due_after(records, after, now))
                .await?;
            purged += self.delete_if_expired(due, now).await?;
            if walked_to.is_none() {
                return Ok(purged);
            }
            after = walked_to;
        }
    }

    /// Deletes those of `due` that are still expired at `now` (one may have
    /// been claimed again since it was read); returns how many.
    async fn delete_if_expired(
        &self,
        due: Vec<RecordKey>,
        now: UnixMillis,
    ) -> Result<usize, StoreError> {
        if due.is_empty() {
            return Ok(0);
        }
        self.write(Waited::Either, move |tables| {
            let mut deleted = 0;
            for key in due {
                let expired = tables
                    .with_value(&key, |value| value.and_then(expiry_of))?
                    .is_some_and(|expires_at| expires_at <= now);
                if expired {
                    tables.delete(&key);
                    deleted += 1;
                }
            }
            Ok(deleted)
        })
        .await
    }

    /// How many records the database holds, expired ones not yet purged
    /// included (a walk: for tests and tools).
    pub async fn record_count(&self) -> Result<u64, StoreError> {
        self.blocking(|records| records.len().map(|n| n as u64).map_err(db_error))
            .await
    }

    /// Starts a task that purges expired records every `every` (the first
    /// purge runs at once, clearing what expired while the process was down).
    /// It holds only a weak reference, and ends as soon as the store is
    /// dropped. Must be called within a Tokio runtime.
    pub fn spawn_purger(self: &Arc<Self>, every: Duration) -> JoinHandle<()> {
        let stop = self.purger_stop.subscribe();
        super::purger::spawn(Arc::downgrade(self), every, stop, |store| async move {
            let purged = store.purge_expired().await?;
            Ok(u64::try_from(purged).unwrap_or(u64::MAX))
        })
    }

    /// Runs `op` on the blocking pool with the records keyspace, whose
    /// handle goes with it.
    async fn blocking<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Keyspace) -> Result<T, StoreError> + Send + 'static,
    {
        let records = self.records.clone();
        tokio::task::spawn_blocking(move || op(&records))
            .await
            .map_err(|e| StoreError::Unavailable(format!("embedded store task failed: {e}")))?
    }
}

/// Up to [`PURGE_BATCH`] keys after `after` whose records expired by `now`,
/// and where the walk goes on (`None`: the keyspace is walked). Reads only
/// each value's prefix; one without it is left alone.
fn due_after(
    records: &Keyspace,
    after: Option<RecordKey>,
    now: UnixMillis,
) -> Result<(Vec<RecordKey>, Option<RecordKey>), StoreError> {
    let mut due = Vec::new();
    let mut last = None;
    for (walked, entry) in walk_after(records, after).enumerate() {
        if due.len() >= PURGE_BATCH || walked >= 16 * PURGE_BATCH {
            return Ok((due, last));
        }
        let (key, value) = entry.into_inner().map_err(db_error)?;
        let Some(key) = record_key(&key) else {
            continue;
        };
        last = Some(key);
        if expiry_of(&value).is_some_and(|expires_at| expires_at <= now) {
            due.push(key);
        }
    }
    Ok((due, None))
}

/// The records after `after` (from the first when `None`), in key order.
fn walk_after(records: &Keyspace, after: Option<RecordKey>) -> fjall::Iter {
    match after {
        Some(after) => records.range::<&[u8], _>((
            std::ops::Bound::Excluded(&after.as_bytes()[..]),
            std::ops::Bound::Unbounded,
        )),
        None => records.iter(),
    }
}

/// A key of the records keyspace as a record key; `None` for one of
/// another length, which no version of this store writes.
fn record_key(key: &[u8]) -> Option<RecordKey> {
    Some(RecordKey::from_bytes(key.try_into().ok()?))
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        // Decided by the writer, on the state it changes, in one step: most
        // begins are first executions, which write. A replay of a recent key
        // never gets here (the replay cache in front of this store answers
        // it, see `open_store`); duplicates and older replays change nothing,
        // and a group of such ends without a batch. Reading on the blocking
        // pool first would cost every first execution a second round trip
        // between threads.
        let begin = begin.clone();
        let now = self.clock.now_millis();
        self.write(Waited::Only, move |tables| {
            let stored = tables.read_for_write(&begin.key)?;
            let (outcome, new) = decide_begin(&begin, live(stored, now), now);
            if let Some(new) = new {
                tables.put(&begin.key, encode_value(&new));
            }
            Ok(outcome)
        })
        .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        let key = *key;
        let value = encode_completed(record);
        let now = self.clock.now_millis();
        self.write(Waited::Either, move |tables| {
            let stored = tables.read_for_write(&key)?;
            check_owner(live(stored.as_ref(), now), token).map_err(WriteError::Refused)?;
            tables.put(&key, value);
            Ok(())
        })
        .await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let key = *key;
        let now = self.clock.now_millis();
        self.write(Waited::Either, move |tables| {
            let stored = tables.read_for_write(&key)?;
            check_owner(live(stored.as_ref(), now), token).map_err(WriteError::Refused)?;
            tables.delete(&key);
            Ok(())
        })
        .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let key = *key;
        let now = self.clock.now_millis();
        self.blocking(move |records| Ok(read(records, &key)?.filter(|r| r.expires_at() > now)))
            .await
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        let key = *key;
        // In the writer, which decides every `begin` too: the check and the
        // deletion are one step of the one writer.
        let now = self.clock.now_millis();
        self.write(Waited::Either, move |tables| {
            // Removing is how an operator clears a record that no longer
            // decodes, so it must not need to decode it (one that does not is
            // no running claim).
            let Some(old) = tables.with_value(&key, |value| value.map(|v| decode(&key, v).ok()))?
            else {
                return Ok(Removed::Absent);
            };
            if removal == Removal::UnlessLeased {
                if let Some(until) = old.as_ref().and_then(|r| running_lease(r, now)) {
                    return Ok(Removed::Leased { until });
                }
            }
            tables.delete(&key);
            let old_expiry = old.map(|r| r.expires_at());
            Ok(if old_expiry.is_none_or(|expires_at| expires_at > now) {
                Removed::Deleted
            } else {
                Removed::Absent
            })
        })
        .await
    }

    /// In key order, from the front of each encoding alone (see
    /// [`Store::list`]).
    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        let after = scan_after(cursor)?;
        let now = self.clock.now_millis();
        let (max_examined, max_bytes) = (want.max_examined.max(1), want.max_bytes);
        // Read on the blocking pool, up to what one page may examine; the
        // filter, which may hold anything, runs here.
        let (found, more) = self
            .blocking(move |records| {
                let (mut found, mut bytes) = (Vec::new(), 0);
                for entry in walk_after(records, after) {
                    if found.len() >= max_examined || bytes >= max_bytes {
                        return Ok((found, true));
                    }
                    let (key, value) = entry.into_inner().map_err(db_error)?;
                    let Some(key) = record_key(&key) else {
                        continue;
                    };
                    bytes += value.len();
                    let meta = record_bytes(&value).and_then(|bytes| {
                        let front = &bytes[..bytes.len().min(RecordMeta::ENCODED_FRONT_MAX)];
                        RecordMeta::read(front).map_err(|e| e.to_string())
                    });
                    found.push((key, meta));
                }
                Ok((found, false))
            })
            .await?;
        Ok(ListPage::of_found(want, found, more, now))
    }

    /// In key order, each page after the last key of the one before.
    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        let after = scan_after(cursor)?;
        let now = self.clock.now_millis();
        self.blocking(move |records| {
            let mut page = ScanPage::default();
            let (mut last, mut taken) = (None, 0);
            for entry in walk_after(records, after).take(count.max(1)) {
                let (key, value) = entry.into_inner().map_err(db_error)?;
                taken += 1;
                let Some(key) = record_key(&key) else {
                    continue;
                };
                last = Some(key);
                match decode(&key, &value) {
                    Ok(record) if record.expires_at() > now => page.records.push((key, record)),
                    Ok(_expired) => {}
                    // Its expiry is in what does not read: it stays until
                    // removed, so it is shown.
                    Err(e) => page.unreadable.push((key, e.to_string())),
                }
            }
            // A short page is the last.
            page.next = last
                .filter(|_| taken == count.max(1))
                .map(|key| ScanCursor::new(key.to_hex()));
            Ok(page)
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.blocking(|records| {
            records.first_key_value();
            Ok(())
        })
        .await
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{now_millis, Fingerprint};
    use crate::store::OnStale;

    pub(super) fn begin(key: RecordKey, lease_ms: u64, on_stale: OnStale) -> Begin {
        Begin {
            key,
            fingerprint: Fingerprint([1; 32]),
            lease: Duration::from_millis(lease_ms),
            ttl: Duration::from_millis(300),
            on_stale,
            token: FencingToken::random(),
            reconcile: false,
        }
    }

    /// Claims the free `key` with a lease of a minute.
    pub(super) async fn claim(store: &EmbeddedStore, key: RecordKey) -> FencingToken {
        token(
            store
                .begin(&begin(key, 60_000, OnStale::Store))
                .await
                .expect("claim"),
        )
    }

    /// A completion made now, kept for `ttl_ms`.
    pub(super) fn completed(ttl_ms: u64) -> CompletedRecord {
        let now = now_millis();
        CompletedRecord {
            fingerprint: Fingerprint([1; 32]),
            created_at: now,
            completed_at: now,
            expires_at: now + ttl_ms,
            outcome: crate::core::Outcome::NotStored { status: 200 },
        }
    }

    pub(super) fn token(outcome: BeginOutcome) -> FencingToken {
        match outcome {
            BeginOutcome::Acquired { token, .. } => token,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }
}
