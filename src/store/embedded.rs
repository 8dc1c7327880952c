//! Durable store on local disk (the default): one redb database file, one
//! process. Records survive restarts and crashes, because every change is a
//! redb transaction committed with immediate durability (fsync before the
//! call returns).
//!
//! Layout, two tables written together in every transaction:
//!
//! - `records`: the 32 record-key bytes → [`Record::encode`] bytes.
//! - `expiry`: `(expires_at, record key)` → `()`, an index ordered by expiry,
//!   so purging reads only the records that are due instead of scanning (and
//!   decoding) every record kept for the whole TTL.
//!
//! redb is a blocking library; every call runs on Tokio's blocking pool.

use std::borrow::Borrow;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redb::{
    Database, DatabaseError, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table,
    TableDefinition,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::{check_owner, decide_begin, Begin, BeginOutcome, Store, StoreError};
use crate::idempotency::record::{
    now_millis, CompletedRecord, FencingToken, Record, RecordKey, UnixMillis,
};

/// The database file inside the configured directory.
pub const FILE_NAME: &str = "idemproxy.redb";

/// Name of the redb table holding the records (key: `&[u8; 32]`, value:
/// `&[u8]`). Public so that tools and tests can inspect the file directly
/// while no store has it open.
pub const RECORDS_TABLE: &str = "records";

const RECORDS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new(RECORDS_TABLE);
const EXPIRY: TableDefinition<(u64, &[u8; 32]), ()> = TableDefinition::new("expiry");

/// Upper bound of the page cache. redb's default (1 GiB) is sized for a
/// database server, not a sidecar; the hot set here is the records of the
/// last few minutes, and the page cache of the OS backs the rest.
const CACHE_BYTES: usize = 64 * 1024 * 1024;

/// Records deleted per purge transaction. Purging holds the single writer
/// lock, so it works in short batches that let `begin` calls interleave.
const PURGE_BATCH: usize = 1024;

/// A [`Store`] on local disk, backed by redb.
///
/// Share it as `Arc<EmbeddedStore>` (it coerces to a [`super::SharedStore`]).
/// The database file stays locked, and open, until the store and every call
/// still running on it are dropped.
pub struct EmbeddedStore {
    db: Arc<Database>,
    path: PathBuf,
    /// Never sent on: dropping the store drops it, which ends the purger at
    /// once instead of at its next tick.
    purger_stop: watch::Sender<()>,
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
        Ok(EmbeddedStore {
            db: Arc::new(db),
            path,
            purger_stop,
        })
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
        let now = now_millis();
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
        let store = Arc::downgrade(self);
        let mut stop = self.purger_stop.subscribe();
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
                match store.purge_expired().await {
                    Ok(0) => {}
                    Ok(purged) => tracing::debug!(purged, "purged expired records"),
                    Err(error) => {
                        tracing::warn!(%error, "purging expired records failed; will retry")
                    }
                }
            }
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

type RecordsTable<'txn> = Table<'txn, &'static [u8; 32], &'static [u8]>;
type ExpiryTable<'txn> = Table<'txn, (u64, &'static [u8; 32]), ()>;

/// Maps redb's errors: a corrupted file is reported as such, everything else
/// (I/O, a poisoned transaction, a closed file) means the store cannot serve.
fn db_error(e: impl Into<redb::Error>) -> StoreError {
    match e.into() {
        redb::Error::Corrupted(detail) => StoreError::Corrupt(detail),
        other => StoreError::Unavailable(format!("embedded store: {other}")),
    }
}

fn decode(key: &RecordKey, bytes: &[u8]) -> Result<Record, StoreError> {
    Record::decode(bytes).map_err(|e| StoreError::Corrupt(format!("record {}: {e}", key.to_hex())))
}

/// The record stored under `key`, expired or not.
fn read(
    table: &impl ReadableTable<&'static [u8; 32], &'static [u8]>,
    key: &RecordKey,
) -> Result<Option<Record>, StoreError> {
    match table.get(key.as_bytes()).map_err(db_error)? {
        Some(value) => decode(key, value.value()).map(Some),
        None => Ok(None),
    }
}

/// What readers may see of a stored record (owned or borrowed): expired
/// ones read as absent.
fn live<R: Borrow<Record>>(record: Option<R>, now: UnixMillis) -> Option<R> {
    record.filter(|r| r.borrow().expires_at() > now)
}

/// Replaces what is stored under `key` (`old`, as read in this transaction)
/// with `new`, keeping the expiry index in step.
fn write(
    records: &mut RecordsTable<'_>,
    expiry: &mut ExpiryTable<'_>,
    key: &RecordKey,
    old: Option<&Record>,
    new: (&[u8], UnixMillis),
) -> Result<(), StoreError> {
    if let Some(old) = old {
        expiry
            .remove((old.expires_at(), key.as_bytes()))
            .map_err(db_error)?;
    }
    records.insert(key.as_bytes(), new.0).map_err(db_error)?;
    expiry
        .insert((new.1, key.as_bytes()), ())
        .map_err(db_error)?;
    Ok(())
}

fn delete(
    records: &mut RecordsTable<'_>,
    expiry: &mut ExpiryTable<'_>,
    key: &RecordKey,
    old: Option<&Record>,
) -> Result<(), StoreError> {
    if let Some(old) = old {
        expiry
            .remove((old.expires_at(), key.as_bytes()))
            .map_err(db_error)?;
    }
    records.remove(key.as_bytes()).map_err(db_error)?;
    Ok(())
}

/// One purge transaction: takes up to [`PURGE_BATCH`] due entries off the
/// expiry index and deletes their records. Returns how many records were
/// deleted and whether due entries may remain.
fn purge_batch(db: &Database, now: UnixMillis) -> Result<(usize, bool), StoreError> {
    const LAST_KEY: [u8; 32] = [0xff; 32];
    let txn = db.begin_write().map_err(db_error)?;
    let mut purged = 0;
    let more;
    {
        let mut records = txn.open_table(RECORDS).map_err(db_error)?;
        let mut expiry = txn.open_table(EXPIRY).map_err(db_error)?;
        let mut due = Vec::with_capacity(PURGE_BATCH);
        for entry in expiry
            .extract_from_if(..=(now, &LAST_KEY), |_, _| true)
            .map_err(db_error)?
            .take(PURGE_BATCH)
        {
            let (index_key, _) = entry.map_err(db_error)?;
            due.push(RecordKey::from_bytes(*index_key.value().1));
        }
        more = due.len() == PURGE_BATCH;
        for key in due {
            // The index is only a hint: the record itself decides. It may be
            // gone (removed while undecodable), or rewritten with a later
            // expiry (which has its own index entry).
            let expired = match records.get(key.as_bytes()).map_err(db_error)? {
                Some(value) => Record::decode(value.value())
                    .map(|r| r.expires_at() <= now)
                    .unwrap_or(false),
                None => false,
            };
            if expired {
                records.remove(key.as_bytes()).map_err(db_error)?;
                purged += 1;
            }
        }
    }
    txn.commit().map_err(db_error)?;
    Ok((purged, more))
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        let begin = begin.clone();
        self.blocking(move |db| {
            // Replays and duplicates change nothing: decide them on a read
            // snapshot, without the writer lock or an fsync. Anything that
            // writes is decided again inside the write transaction, on the
            // state it will change.
            let now = now_millis();
            {
                let txn = db.begin_read().map_err(db_error)?;
                let records = txn.open_table(RECORDS).map_err(db_error)?;
                let stored = read(&records, &begin.key)?;
                let (outcome, write) = decide_begin(&begin, live(stored, now), now);
                if write.is_none() {
                    return Ok(outcome);
                }
            }

            let txn = db.begin_write().map_err(db_error)?;
            let now = now_millis();
            let outcome = {
                let mut records = txn.open_table(RECORDS).map_err(db_error)?;
                let mut expiry = txn.open_table(EXPIRY).map_err(db_error)?;
                let stored = read(&records, &begin.key)?;
                // Cloned only on this write path, and only when it replaces
                // a live record (a stale claim): `write` needs the old one.
                let (outcome, new) = decide_begin(&begin, live(stored.as_ref(), now).cloned(), now);
                match new {
                    // Dropping the transaction aborts it: nothing to write.
                    None => return Ok(outcome),
                    Some(new) => write(
                        &mut records,
                        &mut expiry,
                        &begin.key,
                        stored.as_ref(),
                        (&new.encode(), new.expires_at()),
                    )?,
                }
                outcome
            };
            txn.commit().map_err(db_error)?;
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
        self.blocking(move |db| {
            let txn = db.begin_write().map_err(db_error)?;
            {
                let mut records = txn.open_table(RECORDS).map_err(db_error)?;
                let mut expiry = txn.open_table(EXPIRY).map_err(db_error)?;
                let stored = read(&records, &key)?;
                check_owner(live(stored.as_ref(), now_millis()), token)?;
                write(
                    &mut records,
                    &mut expiry,
                    &key,
                    stored.as_ref(),
                    (&bytes, expires_at),
                )?;
            }
            txn.commit().map_err(db_error)
        })
        .await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let key = *key;
        self.blocking(move |db| {
            let txn = db.begin_write().map_err(db_error)?;
            {
                let mut records = txn.open_table(RECORDS).map_err(db_error)?;
                let mut expiry = txn.open_table(EXPIRY).map_err(db_error)?;
                let stored = read(&records, &key)?;
                check_owner(live(stored.as_ref(), now_millis()), token)?;
                delete(&mut records, &mut expiry, &key, stored.as_ref())?;
            }
            txn.commit().map_err(db_error)
        })
        .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let key = *key;
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(db_error)?;
            let records = txn.open_table(RECORDS).map_err(db_error)?;
            let now = now_millis();
            Ok(read(&records, &key)?.filter(|r| r.expires_at() > now))
        })
        .await
    }

    async fn remove(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let key = *key;
        self.blocking(move |db| {
            let txn = db.begin_write().map_err(db_error)?;
            let existed = {
                let mut records = txn.open_table(RECORDS).map_err(db_error)?;
                let mut expiry = txn.open_table(EXPIRY).map_err(db_error)?;
                let Some(value) = records.get(key.as_bytes()).map_err(db_error)? else {
                    return Ok(false);
                };
                // Removing is how an operator clears a record that no longer
                // decodes, so it must not need to decode it. Its index entry,
                // if any, is then left for the purger, which skips it.
                let stored = Record::decode(value.value()).ok();
                drop(value);
                delete(&mut records, &mut expiry, &key, stored.as_ref())?;
                stored.is_none_or(|r| r.expires_at() > now_millis())
            };
            txn.commit().map_err(db_error)?;
            Ok(existed)
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
    use crate::idempotency::record::Fingerprint;
    use crate::store::OnStale;

    /// The invariant every write keeps: one index entry per record, under the
    /// record's own expiry, and nothing else in the index.
    fn assert_index_matches(db: &Database) {
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

    fn begin(key: RecordKey, lease_ms: u64, on_stale: OnStale) -> Begin {
        Begin {
            key,
            fingerprint: Fingerprint([1; 32]),
            lease: Duration::from_millis(lease_ms),
            ttl: Duration::from_millis(300),
            on_stale,
        }
    }

    fn token(outcome: BeginOutcome) -> FencingToken {
        match outcome {
            BeginOutcome::Acquired { token, .. } => token,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn every_write_keeps_the_expiry_index_in_step() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EmbeddedStore::open(dir.path()).expect("open");
        let keys: Vec<RecordKey> = (0..7u8).map(|i| RecordKey::from_bytes([i; 32])).collect();
        let mut tokens = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            // Keys 3 to 6 get a short lease, to be taken over, settled or
            // forgotten below.
            let lease = if i >= 3 { 30 } else { 60_000 };
            tokens.push(token(
                store
                    .begin(&begin(*key, lease, OnStale::Store))
                    .await
                    .expect("begin"),
            ));
        }
        assert_index_matches(&store.db);

        let now = now_millis();
        let done = CompletedRecord {
            fingerprint: Fingerprint([1; 32]),
            created_at: now,
            completed_at: now,
            expires_at: now + 3_600_000,
            outcome: crate::idempotency::record::Outcome::NotStored { status: 200 },
        };
        store
            .complete(&keys[0], tokens[0], &done)
            .await
            .expect("complete");
        store.release(&keys[1], tokens[1]).await.expect("release");
        assert!(store.remove(&keys[2]).await.expect("remove"));
        tokio::time::sleep(Duration::from_millis(60)).await;
        token(
            store
                .begin(&begin(keys[3], 60_000, OnStale::Retry))
                .await
                .expect("take over"),
        );
        let settled = store.begin(&begin(keys[4], 60_000, OnStale::Store)).await;
        assert!(
            matches!(settled, Ok(BeginOutcome::Settled(_))),
            "{settled:?}"
        );
        assert_index_matches(&store.db);

        // Now expired: key 4 (settled with the 300 ms ttl), and keys 5 and 6
        // (past lease + ttl). Key 5 is claimed afresh over its expired record;
        // 4 and 6 are left for the purge.
        tokio::time::sleep(Duration::from_millis(450)).await;
        token(
            store
                .begin(&begin(keys[5], 60_000, OnStale::Store))
                .await
                .expect("claim again"),
        );
        assert_index_matches(&store.db);
        assert_eq!(store.purge_expired().await.expect("purge"), 2);
        assert_index_matches(&store.db);
        assert_eq!(store.record_count().await.expect("count"), 3);
    }
}
