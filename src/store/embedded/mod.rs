//! Durable store on local disk (the default): one redb database file, one
//! process. Records survive restarts and crashes, because every change is
//! committed with immediate durability (fsync) before its call returns.
//!
//! # Group commit
//!
//! An fsync takes a fraction of a millisecond to several, and redb has one
//! writer at a time: a transaction per change capped the store at one
//! change per fsync (about 1,600 first executions/s here, each a claim and
//! a completion, at 20 ms p50 under 32 concurrent requests). So every
//! change goes to one writer thread, which takes all the changes queued
//! while it was busy (up to [`MAX_GROUP`]), applies them in order in one
//! write transaction and commits it with one fsync; only then does it
//! answer their callers. Each change still sees every change queued before
//! it, and is answered only once it is durable, so the contract is the one
//! a transaction per change gave. A change refused on its own merits (a
//! fencing token that does not own the key, a record that does not decode)
//! writes nothing and leaves the rest of its group to commit; a failure of
//! redb itself aborts the group, and every change in it gets the error.
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
//! decide (a duplicate in flight, a replay) do not make their group commit:
//! a group that wrote nothing ends without a commit or an fsync. Replays of
//! recent keys do not reach the store at all: `open_store` puts a replay
//! cache in front of it (see [`crate::store::cache`]). `get` and `ping` read
//! snapshots on Tokio's blocking pool and never wait for the writer.
//!
//! Layout, two tables written together in every transaction:
//!
//! - `records`: the 32 record-key bytes → [`Record::encode`] bytes.
//! - `expiry`: `(expires_at, record key)` → `()`, an index ordered by expiry,
//!   so purging reads only the records that are due instead of scanning (and
//!   decoding) every record kept for the whole TTL.
//!
//! redb is a blocking library: it runs on the writer thread and on Tokio's
//! blocking pool, never on a traffic worker's event loop.

mod tables;
mod writer;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redb::{Database, DatabaseError, ReadableDatabase, ReadableTable, ReadableTableMetadata};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use self::tables::{
    db_error, delete, live, purge_batch, read, read_for_write, replace, EXPIRY, RECORDS,
};
use self::writer::{storage, Waited, WriteError, Writer};
pub use self::writer::{MAX_GROUP, MAX_QUEUED};
use super::{
    check_owner, scan_after, Begin, BeginOutcome, ListPage, ListWant, Removal, Removed, ScanCursor,
    ScanPage, Store, StoreError,
};
use crate::core::{
    decide_begin, running_lease, Clock, CompletedRecord, FencingToken, Record, RecordKey,
    RecordMeta,
};

/// The database file inside the configured directory.
pub const FILE_NAME: &str = "idemproxy.redb";

/// Name of the redb table holding the records (key: `&[u8; 32]`, value:
/// `&[u8]`). Public so that tools and tests can inspect the file directly
/// while no store has it open.
pub const RECORDS_TABLE: &str = "records";

/// Upper bound of redb's page cache (its read cache and write buffer).
/// redb's default (1 GiB) is sized for a database server, not a sidecar;
/// the OS's page cache backs what does not fit. The proxy's RSS levels off
/// at about this plus its own working set however large the file grows,
/// and a larger cache served no more first executions per second
/// (docs/performance.md, "What made it faster").
const CACHE_BYTES: usize = 16 * 1024 * 1024;

/// A [`Store`] on local disk, backed by redb.
///
/// Share it as `Arc<EmbeddedStore>` (it coerces to a [`super::SharedStore`]).
/// The database file stays locked, and open, until the store and every call
/// still running on it are dropped.
pub struct EmbeddedStore {
    db: Arc<Database>,
    path: PathBuf,
    /// Every change goes through here. Dropping it closes the queue and
    /// joins the writer thread (which holds a clone of `db`), so the file
    /// is closed by the time the store is gone and a restart can open it
    /// again at once; unless a read or a purge is still running on the
    /// blocking pool, with its own clone, which closes it when it ends.
    writer: Writer,
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
    /// if missing.
    ///
    /// Blocking: it does file I/O, and after a crash redb repairs the file
    /// before returning. Call it at startup, or through `spawn_blocking`.
    ///
    /// The file is locked exclusively: a second open of the same directory,
    /// from this process or another, fails with [`StoreError::Unavailable`].
    pub fn open(dir: &Path) -> Result<EmbeddedStore, StoreError> {
        fs::create_dir_all(dir).map_err(|e| {
            StoreError::Unavailable(format!(
                "cannot create the store directory {}: {e}",
                dir.display()
            ))
        })?;
        let path = dir.join(FILE_NAME);
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create(&path)
            .map_err(|e| match e {
                DatabaseError::DatabaseAlreadyOpen => StoreError::Unavailable(format!(
                    "{} is already open (by this process or another); \
                     an embedded store belongs to one process",
                    path.display()
                )),
                other => {
                    StoreError::Unavailable(format!("cannot open {}: {other}", path.display()))
                }
            })?;
        // Creating the tables up front lets read transactions open them
        // without handling a missing table.
        let txn = db.begin_write().map_err(db_error)?;
        txn.open_table(RECORDS).map_err(db_error)?;
        txn.open_table(EXPIRY).map_err(db_error)?;
        txn.commit().map_err(db_error)?;
        let (purger_stop, _) = watch::channel(());
        let db = Arc::new(db);
        Ok(EmbeddedStore {
            writer: Writer::start(Arc::clone(&db))?,
            db,
            path,
            purger_stop,
            clock: Clock::wall(),
        })
    }

    /// Write transactions the writer has committed since the store opened.
    /// Under concurrent load, fewer than the changes they carried.
    pub fn commit_count(&self) -> u64 {
        self.writer.commits.load(Ordering::Relaxed)
    }

    /// Reads the time from `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Deletes every record whose `expires_at` has passed; returns how many.
    ///
    /// Async (the work runs on the blocking pool), in batches of short write
    /// transactions. Records that cannot be decoded are left for an operator
    /// to inspect and remove.
    pub async fn purge_expired(&self) -> Result<usize, StoreError> {
        let now = self.clock.now_millis();
        self.blocking(move |db| {
            let mut purged = 0;
            loop {
                let (batch_purged, more) = purge_batch(db, now)?;
                purged += batch_purged;
                if !more {
                    return Ok(purged);
                }
            }
        })
        .await
    }

    /// How many records the file holds, expired ones not yet purged included.
    pub async fn record_count(&self) -> Result<u64, StoreError> {
        self.blocking(|db| {
            let txn = db.begin_read().map_err(db_error)?;
            let records = txn.open_table(RECORDS).map_err(db_error)?;
            records.len().map_err(db_error)
        })
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

    /// Runs `op` on the blocking pool. The database handle goes with it, so a
    /// caller that stops waiting (timeout) leaves a consistent transaction
    /// behind: it commits or aborts as a whole.
    async fn blocking<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T, StoreError> + Send + 'static,
    {
        let db = Arc::clone(&self.db);
        tokio::task::spawn_blocking(move || op(&db))
            .await
            .map_err(|e| StoreError::Unavailable(format!("embedded store task failed: {e}")))?
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        // Decided by the writer, on the state it changes, in one step: most
        // begins are first executions, which write. A replay of a recent key
        // never gets here (the replay cache in front of this store answers
        // it, see `open_store`); duplicates and older replays change nothing,
        // and a group of such ends without a commit. Reading a snapshot on
        // the blocking pool first would cost every first execution a second
        // round trip between threads.
        let begin = begin.clone();
        let now = self.clock.now_millis();
        self.write(Waited::Only, move |tables| {
            let stored = read_for_write(&tables.records, &begin.key)?;
            // An expired record is absent to the decision, but its index
            // entry is still there to replace.
            let old_expiry = stored.as_ref().map(Record::expires_at);
            let (outcome, new) = decide_begin(&begin, live(stored, now), now);
            if let Some(new) = new {
                replace(
                    tables,
                    &begin.key,
                    old_expiry,
                    (&new.encode(), new.expires_at()),
                )?;
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
        let expires_at = record.expires_at;
        let bytes = record.encode();
        let now = self.clock.now_millis();
        self.write(Waited::Either, move |tables| {
            let stored = read_for_write(&tables.records, &key)?;
            check_owner(live(stored.as_ref(), now), token).map_err(WriteError::Refused)?;
            let old_expiry = stored.as_ref().map(Record::expires_at);
            replace(tables, &key, old_expiry, (&bytes, expires_at))
        })
        .await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let key = *key;
        let now = self.clock.now_millis();
        self.write(Waited::Either, move |tables| {
            let stored = read_for_write(&tables.records, &key)?;
            check_owner(live(stored.as_ref(), now), token).map_err(WriteError::Refused)?;
            delete(tables, &key, stored.as_ref().map(Record::expires_at))
        })
        .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let key = *key;
        let now = self.clock.now_millis();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(db_error)?;
            let records = txn.open_table(RECORDS).map_err(db_error)?;
            Ok(read(&records, &key)?.filter(|r| r.expires_at() > now))
        })
        .await
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        let key = *key;
        // In the writer, which decides every `begin` too: the check and the
        // deletion are one step of the one writer.
        let now = self.clock.now_millis();
        self.write(Waited::Either, move |tables| {
            let Some(value) = tables.records.get(key.as_bytes()).map_err(storage)? else {
                return Ok(Removed::Absent);
            };
            // Removing is how an operator clears a record that no longer
            // decodes, so it must not need to decode it (one that does not is
            // no running claim). Its index entry, if any, is then left for
            // the purger, which skips it.
            let old = Record::decode(value.value()).ok();
            drop(value);
            if removal == Removal::UnlessLeased {
                if let Some(until) = old.as_ref().and_then(|r| running_lease(r, now)) {
                    return Ok(Removed::Leased { until });
                }
            }
            let old_expiry = old.map(|r| r.expires_at());
            delete(tables, &key, old_expiry)?;
            Ok(if old_expiry.is_none_or(|expires_at| expires_at > now) {
                Removed::Deleted
            } else {
                Removed::Absent
            })
        })
        .await
    }

    /// In key order (the records table's), in one read transaction, from
    /// the front of each encoding alone (see [`Store::list`]).
    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        let after = scan_after(cursor)?;
        let now = self.clock.now_millis();
        let (max_examined, max_bytes) = (want.max_examined.max(1), want.max_bytes);
        // Read on the blocking pool, up to what one page may examine; the
        // filter, which may hold anything, runs here.
        let (found, more) = self
            .blocking(move |db| {
                let txn = db.begin_read().map_err(db_error)?;
                let table = txn.open_table(RECORDS).map_err(db_error)?;
                let range = match &after {
                    Some(after) => table.range::<&[u8; 32]>((
                        std::ops::Bound::Excluded(after.as_bytes()),
                        std::ops::Bound::Unbounded,
                    )),
                    None => table.range::<&[u8; 32]>(..),
                }
                .map_err(db_error)?;
                let (mut found, mut bytes) = (Vec::new(), 0);
                for entry in range {
                    if found.len() >= max_examined || bytes >= max_bytes {
                        return Ok((found, true));
                    }
                    let (key, value) = entry.map_err(db_error)?;
                    let key = RecordKey::from_bytes(*key.value());
                    let value = value.value();
                    bytes += value.len();
                    let front = &value[..value.len().min(RecordMeta::ENCODED_FRONT_MAX)];
                    found.push((key, RecordMeta::read(front).map_err(|e| e.to_string())));
                }
                Ok((found, false))
            })
            .await?;
        Ok(ListPage::of_found(want, found, more, now))
    }

    /// In key order (the records table's), each page after the last key of
    /// the one before, in one read transaction.
    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        let after = scan_after(cursor)?;
        let now = self.clock.now_millis();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(db_error)?;
            let table = txn.open_table(RECORDS).map_err(db_error)?;
            let range = match &after {
                Some(after) => table.range::<&[u8; 32]>((
                    std::ops::Bound::Excluded(after.as_bytes()),
                    std::ops::Bound::Unbounded,
                )),
                None => table.range::<&[u8; 32]>(..),
            }
            .map_err(db_error)?;
            let mut page = ScanPage::default();
            let (mut last, mut taken) = (None, 0);
            for entry in range.take(count.max(1)) {
                let (key, value) = entry.map_err(db_error)?;
                let key = RecordKey::from_bytes(*key.value());
                (last, taken) = (Some(key), taken + 1);
                match Record::decode(value.value()) {
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
        self.blocking(|db| {
            let txn = db.begin_read().map_err(db_error)?;
            txn.open_table(RECORDS).map_err(db_error)?;
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

    /// The invariant every write keeps: one index entry per record, under the
    /// record's own expiry, and nothing else in the index.
    pub(super) fn assert_index_matches(db: &Database) {
        let txn = db.begin_read().expect("read");
        let records = txn.open_table(RECORDS).expect("records");
        let expiry = txn.open_table(EXPIRY).expect("expiry");
        let mut expected: Vec<(u64, [u8; 32])> = records
            .iter()
            .expect("iter")
            .map(|entry| {
                let (key, value) = entry.expect("entry");
                let record = Record::decode(value.value()).expect("decode");
                (record.expires_at(), *key.value())
            })
            .collect();
        expected.sort();
        let indexed: Vec<(u64, [u8; 32])> = expiry
            .iter()
            .expect("iter")
            .map(|entry| {
                let (key, _) = entry.expect("entry");
                let (expires_at, record_key) = key.value();
                (expires_at, *record_key)
            })
            .collect();
        assert_eq!(indexed, expected);
    }

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
