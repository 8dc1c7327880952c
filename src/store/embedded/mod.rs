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

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle as ThreadHandle;
use std::time::Duration;

use async_trait::async_trait;
use redb::{
    Database, DatabaseError, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table,
    TableDefinition,
};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::{check_owner, Begin, BeginOutcome, Removal, Removed, Store, StoreError};
use crate::core::{
    decide_begin, now_millis, running_lease, CompletedRecord, FencingToken, Record, RecordKey,
    UnixMillis,
};

/// The database file inside the configured directory.
pub const FILE_NAME: &str = "idemproxy.redb";

/// Name of the redb table holding the records (key: `&[u8; 32]`, value:
/// `&[u8]`). Public so that tools and tests can inspect the file directly
/// while no store has it open.
pub const RECORDS_TABLE: &str = "records";

const RECORDS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new(RECORDS_TABLE);
const EXPIRY: TableDefinition<(u64, &[u8; 32]), ()> = TableDefinition::new("expiry");

/// Upper bound of redb's page cache (its read cache and write buffer).
/// redb's default (1 GiB) is sized for a database server, not a sidecar;
/// the OS's page cache backs what does not fit. The proxy's RSS levels off
/// at about this plus 50 MiB however large the file grows (unique keys
/// under `wrk -c32`, file 18 -> 128 MB: 65-71 MiB at 16 MiB, 93-95 MiB at
/// 32 MiB, over 140 MiB at 64 MiB), and 16 and 32 MiB served the same
/// first executions per second in a same-run A/B (0.99x).
const CACHE_BYTES: usize = 16 * 1024 * 1024;

/// Records deleted per purge transaction. Purging holds the single writer
/// lock, so it works in short batches that let `begin` calls interleave.
const PURGE_BATCH: usize = 1024;

/// Most changes one write transaction takes (see "Group commit" above):
/// enough to make one fsync serve every request a busy proxy has in flight,
/// few enough that a group's transaction stays small.
pub const MAX_GROUP: usize = 256;

/// Most changes waiting for the writer. A busy proxy keeps a few dozen
/// queued (a group's worth arrives during each fsync); a queue this long
/// means the disk stopped keeping up, and a change past it fails at once
/// (`Unavailable`, so 503) rather than waiting behind thousands: callers
/// that time out leave their changes queued, and a completion retried
/// against a stalled disk queued a copy of its response each time.
pub const MAX_QUEUED: usize = 16 * MAX_GROUP;

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
    /// again at once.
    writer: Writer,
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
        let db = Arc::new(db);
        Ok(EmbeddedStore {
            writer: Writer::start(Arc::clone(&db))?,
            db,
            path,
            purger_stop,
        })
    }

    /// Write transactions the writer has committed since the store opened.
    /// Under concurrent load, fewer than the changes they carried.
    pub fn commit_count(&self) -> u64 {
        self.writer.commits.load(Ordering::Relaxed)
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

    /// Queues `op` for the writer and waits until its group is committed.
    /// A caller that stops waiting (timeout) does not withdraw it: the
    /// change commits or aborts with its group, as a whole, unless
    /// `Waited::Only` says to skip it once its caller is gone.
    async fn write<T, F>(&self, waited: Waited, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'t> FnOnce(&mut Tables<'t>) -> Result<T, WriteError> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let job: Job = Box::new(move |tables| {
            if waited == Waited::Only && answer.is_closed() {
                return Ran {
                    aborts: None,
                    answer: Box::new(|_| {}),
                };
            }
            let result = op(tables);
            let aborts = match &result {
                Err(WriteError::Storage(e)) => Some(e.clone()),
                _ => None,
            };
            Ran {
                aborts,
                answer: Box::new(move |group| {
                    let _ = answer.send(match (group, result) {
                        // Nothing of the group was written.
                        (Err(e), _) => Err(e.clone()),
                        (Ok(()), Ok(value)) => Ok(value),
                        (Ok(()), Err(WriteError::Refused(e) | WriteError::Storage(e))) => Err(e),
                    });
                }),
            }
        });
        self.writer.submit(job)?;
        answered.await.map_err(|_| {
            StoreError::Unavailable(
                "the embedded store's writer dropped the change (see its log)".into(),
            )
        })?
    }
}

/// Whether a change still runs once its caller stopped waiting for it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Waited {
    /// Runs whatever happens: a completion or a release is as right late
    /// as on time (the fencing token still decides), and may be the only
    /// copy of an outcome.
    Either,
    /// Runs only if its caller still waits. A `begin` whose caller timed
    /// out was answered 503 and executed nothing: if it claimed the key
    /// after that, nobody would hold the claim, and the retry would find
    /// the key in flight, then settled `outcome-unknown` for a request that
    /// never ran.
    Only,
}

/// The tables a change works on, opened once per group.
struct Tables<'t> {
    records: RecordsTable<'t>,
    expiry: ExpiryTable<'t>,
    /// Whether a change of the group wrote: a group that only decided
    /// (duplicates, replays) ends without a commit, so without an fsync.
    wrote: bool,
}

/// Why a change did not go through.
enum WriteError {
    /// This change alone, which wrote nothing: the rest of its group
    /// commits.
    Refused(StoreError),
    /// redb failed in the middle of the transaction: the group is aborted.
    Storage(StoreError),
}

/// A redb failure: aborts the group.
fn storage(e: impl Into<redb::Error>) -> WriteError {
    WriteError::Storage(db_error(e))
}

/// A change queued for the writer: it runs inside its group's transaction
/// and leaves the answer to send once the group's fate is known.
type Job = Box<dyn for<'t> FnOnce(&mut Tables<'t>) -> Ran + Send>;

struct Ran {
    /// A redb failure: the transaction can no longer be trusted.
    aborts: Option<StoreError>,
    answer: Answer,
}

/// Sends a change's caller its answer, given how its group ended.
type Answer = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

/// The writer thread and the queue to it.
struct Writer {
    /// `None` only while dropping: closing the queue is what stops the
    /// thread, after it has answered everything queued. At most
    /// [`MAX_QUEUED`] changes wait in it.
    queue: Option<mpsc::SyncSender<Job>>,
    thread: Option<ThreadHandle<()>>,
    /// Groups committed, by the writer thread ([`EmbeddedStore::commit_count`]).
    commits: Arc<AtomicU64>,
    /// Changes queued since the store opened: lets a test know that the
    /// changes it started are waiting for the writer.
    #[cfg(test)]
    submitted: AtomicU64,
}

impl Writer {
    fn start(db: Arc<Database>) -> Result<Self, StoreError> {
        let (queue, jobs) = mpsc::sync_channel(MAX_QUEUED);
        let commits = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&commits);
        let thread = std::thread::Builder::new()
            .name("idemproxy-store".into())
            .spawn(move || write_groups(&db, &jobs, &counter))
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot start the embedded store's writer: {e}"))
            })?;
        Ok(Self {
            queue: Some(queue),
            thread: Some(thread),
            commits,
            #[cfg(test)]
            submitted: AtomicU64::new(0),
        })
    }

    fn submit(&self, job: Job) -> Result<(), StoreError> {
        let Some(queue) = &self.queue else {
            return Err(closed());
        };
        match queue.try_send(job) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(_)) => {
                return Err(StoreError::Unavailable(format!(
                "the embedded store's writer is {MAX_QUEUED} changes behind (is the disk stalled?)"
            )))
            }
            Err(mpsc::TrySendError::Disconnected(_)) => return Err(closed()),
        }
        #[cfg(test)]
        self.submitted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn closed() -> StoreError {
    StoreError::Unavailable("the embedded store is closed".into())
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            // At most the group in progress: one transaction and its fsync.
            let _ = thread.join();
        }
    }
}

/// The writer thread: waits for a change, takes everything queued behind
/// it, commits them as one group, answers them; until the queue closes.
fn write_groups(db: &Database, jobs: &mpsc::Receiver<Job>, commits: &AtomicU64) {
    let mut queued = VecDeque::new();
    loop {
        if queued.is_empty() {
            match jobs.recv() {
                Ok(job) => queued.push_back(job),
                Err(_) => return,
            }
        }
        while queued.len() < MAX_GROUP {
            match jobs.try_recv() {
                Ok(job) => queued.push_back(job),
                Err(_) => break,
            }
        }
        // A panic would be a bug in a change; it costs that group (its
        // callers see the change dropped), not the store.
        let group = catch_unwind(AssertUnwindSafe(|| commit_group(db, &mut queued, commits)));
        match group {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::error!(%error, "embedded store: a group of changes failed"),
            // The changes run before it were in the transaction the
            // unwinding dropped, so their callers see them dropped; those
            // queued after it never ran and go in the next group, as after
            // a storage error.
            Err(_) => tracing::error!("embedded store: a change panicked; its group was dropped"),
        }
    }
}

/// Runs queued changes in one write transaction, in order, commits it and
/// answers them. Changes not run (after one that aborted the group) stay
/// queued for the next group. If the transaction cannot even start, the
/// whole queue is dropped (its callers see that), rather than retried in a
/// loop.
fn commit_group(
    db: &Database,
    queued: &mut VecDeque<Job>,
    commits: &AtomicU64,
) -> Result<(), StoreError> {
    let mut answers = Vec::with_capacity(queued.len());
    let result = run_group(db, queued, &mut answers);
    match result {
        // Counted before anyone is answered, so a caller that got its
        // answer sees its commit counted.
        Ok(true) => {
            commits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(false) => {}
        Err(_) if answers.is_empty() => queued.clear(),
        Err(_) => {}
    }
    let result = result.map(|_| ());
    for answer in answers {
        answer(result.as_ref().copied());
    }
    result
}

fn run_group(
    db: &Database,
    queued: &mut VecDeque<Job>,
    answers: &mut Vec<Answer>,
) -> Result<bool, StoreError> {
    let txn = db.begin_write().map_err(db_error)?;
    let wrote = {
        let mut tables = Tables {
            records: txn.open_table(RECORDS).map_err(db_error)?,
            expiry: txn.open_table(EXPIRY).map_err(db_error)?,
            wrote: false,
        };
        while let Some(job) = queued.pop_front() {
            let ran = job(&mut tables);
            answers.push(ran.answer);
            if let Some(error) = ran.aborts {
                // Dropping the transaction aborts it.
                return Err(error);
            }
        }
        tables.wrote
    };
    if !wrote {
        // Nothing to make durable: no commit, no fsync.
        txn.abort().map_err(db_error)?;
        return Ok(false);
    }
    txn.commit().map_err(db_error)?;
    Ok(true)
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

/// [`read`], inside a group: a record that does not decode refuses this
/// change alone; a redb failure aborts the group.
fn read_for_write(
    records: &RecordsTable<'_>,
    key: &RecordKey,
) -> Result<Option<Record>, WriteError> {
    match records.get(key.as_bytes()).map_err(storage)? {
        Some(value) => decode(key, value.value())
            .map(Some)
            .map_err(WriteError::Refused),
        None => Ok(None),
    }
}

/// Replaces what is stored under `key` (expiring at `old_expiry`, as read
/// in this group) with `new`, keeping the expiry index in step.
fn replace(
    tables: &mut Tables<'_>,
    key: &RecordKey,
    old_expiry: Option<UnixMillis>,
    new: (&[u8], UnixMillis),
) -> Result<(), WriteError> {
    unindex(tables, key, old_expiry)?;
    tables
        .records
        .insert(key.as_bytes(), new.0)
        .map_err(storage)?;
    tables
        .expiry
        .insert((new.1, key.as_bytes()), ())
        .map_err(storage)?;
    Ok(())
}

/// Deletes what is stored under `key` (expiring at `old_expiry`, when it
/// decodes) and its index entry.
fn delete(
    tables: &mut Tables<'_>,
    key: &RecordKey,
    old_expiry: Option<UnixMillis>,
) -> Result<(), WriteError> {
    unindex(tables, key, old_expiry)?;
    tables.records.remove(key.as_bytes()).map_err(storage)?;
    Ok(())
}

/// The start of every write: marks the group as written and drops the
/// index entry of the record `key` held (expiring at `old_expiry`).
fn unindex(
    tables: &mut Tables<'_>,
    key: &RecordKey,
    old_expiry: Option<UnixMillis>,
) -> Result<(), WriteError> {
    tables.wrote = true;
    if let Some(old_expiry) = old_expiry {
        tables
            .expiry
            .remove((old_expiry, key.as_bytes()))
            .map_err(storage)?;
    }
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
        // Decided by the writer, on the state it changes, in one step: most
        // begins are first executions, which write. A replay of a recent key
        // never gets here (the replay cache in front of this store answers
        // it, see `open_store`); duplicates and older replays change nothing,
        // and a group of such ends without a commit. Reading a snapshot on
        // the blocking pool first, as this did, cost every first execution
        // a second round trip between threads: in two same-run A/Bs under
        // `wrk -c32`, deciding in the writer alone took 169 -> 127 and
        // 143 -> 115 µs of CPU per request, 7.2k -> 8.4k and 8.2k -> 9.3k
        // req/s.
        let begin = begin.clone();
        self.write(Waited::Only, move |tables| {
            let now = now_millis();
            let stored = read_for_write(&tables.records, &begin.key)?;
            // An expired record is absent to the decision, but its index
            // entry is still there to replace.
            let old_expiry = stored.as_ref().map(Record::expires_at);
            let (outcome, new) = decide_begin(&begin, live(stored, now), now, FencingToken::random);
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
        self.write(Waited::Either, move |tables| {
            let stored = read_for_write(&tables.records, &key)?;
            check_owner(live(stored.as_ref(), now_millis()), token).map_err(WriteError::Refused)?;
            let old_expiry = stored.as_ref().map(Record::expires_at);
            replace(tables, &key, old_expiry, (&bytes, expires_at))
        })
        .await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let key = *key;
        self.write(Waited::Either, move |tables| {
            let stored = read_for_write(&tables.records, &key)?;
            check_owner(live(stored.as_ref(), now_millis()), token).map_err(WriteError::Refused)?;
            delete(tables, &key, stored.as_ref().map(Record::expires_at))
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

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        let key = *key;
        // In the writer, which decides every `begin` too: the check and the
        // deletion are one step of the one writer.
        self.write(Waited::Either, move |tables| {
            let Some(value) = tables.records.get(key.as_bytes()).map_err(storage)? else {
                return Ok(Removed::Absent);
            };
            let now = now_millis();
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
    use crate::core::Fingerprint;
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

    /// Claims the free `key` with a lease of a minute.
    async fn claim(store: &EmbeddedStore, key: RecordKey) -> FencingToken {
        token(
            store
                .begin(&begin(key, 60_000, OnStale::Store))
                .await
                .expect("claim"),
        )
    }

    /// A completion made now, kept for `ttl_ms`.
    fn completed(ttl_ms: u64) -> CompletedRecord {
        let now = now_millis();
        CompletedRecord {
            fingerprint: Fingerprint([1; 32]),
            created_at: now,
            completed_at: now,
            expires_at: now + ttl_ms,
            outcome: crate::core::Outcome::NotStored { status: 200 },
        }
    }

    fn token(outcome: BeginOutcome) -> FencingToken {
        match outcome {
            BeginOutcome::Acquired { token, .. } => token,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    /// Holds the writer inside a change until the returned sender is used
    /// (or dropped), so that the changes queued meanwhile form one group.
    async fn hold_writer(store: &Arc<EmbeddedStore>) -> std::sync::mpsc::Sender<()> {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (running, started) = oneshot::channel();
        let holder = Arc::clone(store);
        tokio::spawn(async move {
            holder
                .write(Waited::Either, move |_| {
                    let _ = running.send(());
                    let _ = held.recv();
                    Ok(())
                })
                .await
        });
        started.await.expect("the writer runs the holding change");
        release
    }

    /// Claims `[i; 32]` in a task of its own, so that it can wait for the
    /// writer while the test goes on.
    fn spawn_claim(
        store: &Arc<EmbeddedStore>,
        i: u8,
    ) -> JoinHandle<Result<BeginOutcome, StoreError>> {
        let store = Arc::clone(store);
        tokio::spawn(async move {
            store
                .begin(&begin(
                    RecordKey::from_bytes([i; 32]),
                    60_000,
                    OnStale::Store,
                ))
                .await
        })
    }

    /// Waits until `changes` changes in all have been queued for the writer.
    async fn until_queued(store: &EmbeddedStore, changes: u64) {
        for _ in 0..500 {
            if store.writer.submitted.load(Ordering::Relaxed) >= changes {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("{changes} changes never reached the writer's queue");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_queued_together_commit_as_one_group_and_one_refusal_spares_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let held = RecordKey::from_bytes([9; 32]);
        let token_held = claim(&store, held).await;

        let commits_before = store.commit_count();
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        // Queued behind the holder, in this order: 15 claims, a completion
        // with a token that does not own `held`, a release by its rightful
        // holder, 15 more claims.
        let claim = |i: u8| spawn_claim(&store, i);
        let mut claims: Vec<_> = (100..115u8).map(claim).collect();
        until_queued(&store, queued_before + 15).await;
        let wrong = {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                store
                    .complete(&held, FencingToken::random(), &completed(60_000))
                    .await
            })
        };
        until_queued(&store, queued_before + 16).await;
        let rightful = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.release(&held, token_held).await })
        };
        until_queued(&store, queued_before + 17).await;
        claims.extend((115..130u8).map(claim));
        until_queued(&store, queued_before + 32).await;
        drop(release);

        assert!(
            matches!(wrong.await.expect("task"), Err(StoreError::Fenced)),
            "a completion without the key's token is refused"
        );
        rightful
            .await
            .expect("task")
            .expect("the holder releases its key");
        for claim in claims {
            token(claim.await.expect("task").expect("claim"));
        }
        // One group for the 32 queued behind the holder (whose own group
        // wrote nothing, so committed nothing).
        assert_eq!(store.commit_count(), commits_before + 1);

        // Everything acknowledged is on disk: a new process sees it.
        drop(store);
        let reopened = EmbeddedStore::open(dir.path()).expect("reopen at once");
        assert_eq!(reopened.record_count().await.expect("count"), 30);
        assert_eq!(reopened.get(&held).await.expect("get"), None);
        assert_index_matches(&reopened.db);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_begin_whose_caller_stopped_waiting_claims_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let (gone, waited) = (
            RecordKey::from_bytes([1; 32]),
            RecordKey::from_bytes([2; 32]),
        );
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        // Queued behind the holder; its caller gives up (store.timeout)
        // and answers its request 503.
        let given_up = tokio::time::timeout(
            Duration::from_millis(100),
            store.begin(&begin(gone, 60_000, OnStale::Store)),
        )
        .await;
        assert!(given_up.is_err(), "still queued: {given_up:?}");
        let behind = spawn_claim(&store, 2);
        until_queued(&store, queued_before + 2).await;
        drop(release);
        // A begin still waited for runs; the abandoned one before it did not.
        token(behind.await.expect("task").expect("claim"));
        assert_eq!(store.get(&gone).await.expect("get"), None);
        assert!(store.get(&waited).await.expect("get").is_some());
        // Completions run late all the same (covered by the fencing token).
        let t = claim(&store, gone).await;
        let release = hold_writer(&store).await;
        let late = tokio::time::timeout(
            Duration::from_millis(100),
            store.complete(&gone, t, &completed(60_000)),
        )
        .await;
        assert!(late.is_err(), "still queued: {late:?}");
        drop(release);
        claim(&store, RecordKey::from_bytes([3; 32])).await;
        assert!(matches!(
            store.get(&gone).await.expect("get"),
            Some(Record::Completed(_))
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_past_a_full_queue_fails_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        let waiting: Vec<_> = (0..MAX_QUEUED)
            .map(|i| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let mut bytes = [7; 32];
                    bytes[..8].copy_from_slice(&(i as u64).to_le_bytes());
                    let key = RecordKey::from_bytes(bytes);
                    store.begin(&begin(key, 60_000, OnStale::Store)).await
                })
            })
            .collect();
        until_queued(&store, queued_before + MAX_QUEUED as u64).await;
        let refused = tokio::time::timeout(
            Duration::from_secs(5),
            store.begin(&begin(
                RecordKey::from_bytes([8; 32]),
                60_000,
                OnStale::Store,
            )),
        )
        .await
        .expect("answered at once, not queued");
        assert!(
            matches!(&refused, Err(StoreError::Unavailable(why)) if why.contains("changes behind")),
            "{refused:?}"
        );
        drop(release);
        for claim in waiting {
            token(
                claim
                    .await
                    .expect("task")
                    .expect("queued claims go through"),
            );
        }
        // And the queue takes changes again.
        claim(&store, RecordKey::from_bytes([8; 32])).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_claims_of_one_key_leave_one_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        let claims: Vec<_> = (0..16).map(|_| spawn_claim(&store, 7)).collect();
        // All of them wait for the writer, and land in the same group.
        until_queued(&store, queued_before + 16).await;
        drop(release);
        let mut acquired = 0;
        for claim in claims {
            match claim.await.expect("task").expect("begin") {
                BeginOutcome::Acquired { .. } => acquired += 1,
                BeginOutcome::InFlight { .. } => {}
                other => panic!("expected Acquired or InFlight, got {other:?}"),
            }
        }
        assert_eq!(acquired, 1);
    }

    /// Queues, behind a held writer, a claim of `[1; 32]`, then `failing`
    /// (a change that fails the group), then a claim of `[3; 32]`, and
    /// returns their answers once the writer is let go.
    async fn group_with_failing_change(
        store: &Arc<EmbeddedStore>,
        failing: impl for<'t> FnOnce(&mut Tables<'t>) -> Result<(), WriteError> + Send + 'static,
    ) -> (
        Result<BeginOutcome, StoreError>,
        Result<(), StoreError>,
        Result<BeginOutcome, StoreError>,
    ) {
        let release = hold_writer(store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        let claim = |i: u8| spawn_claim(store, i);
        let first = claim(1);
        until_queued(store, queued_before + 1).await;
        let failed = {
            let store = Arc::clone(store);
            tokio::spawn(async move { store.write(Waited::Either, failing).await })
        };
        until_queued(store, queued_before + 2).await;
        let last = claim(3);
        until_queued(store, queued_before + 3).await;
        drop(release);
        (
            first.await.expect("task"),
            failed.await.expect("task"),
            last.await.expect("task"),
        )
    }

    /// A redb failure in the middle of a group: nothing of the group is
    /// written, every change already run in it is answered with the error
    /// (none is told it is durable), and the changes queued after it run
    /// in the next group.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_storage_failure_fails_its_group_and_the_changes_after_it_run_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let (first, failed, last) = group_with_failing_change(&store, |tables| {
            // As if redb failed after this change had written.
            tables.wrote = true;
            Err(WriteError::Storage(StoreError::Unavailable(
                "injected".into(),
            )))
        })
        .await;
        assert!(
            matches!(&first, Err(StoreError::Unavailable(e)) if e == "injected"),
            "{first:?}"
        );
        assert!(matches!(failed, Err(StoreError::Unavailable(_))));
        assert!(
            matches!(last, Ok(BeginOutcome::Acquired { .. })),
            "{last:?}"
        );
        assert_eq!(
            store
                .get(&RecordKey::from_bytes([1; 32]))
                .await
                .expect("get"),
            None
        );
        assert!(store
            .get(&RecordKey::from_bytes([3; 32]))
            .await
            .expect("get")
            .is_some());
        assert_index_matches(&store.db);
    }

    /// A change that panics costs what it shared a transaction with, not
    /// the store: the changes run before it in its group are dropped
    /// unwritten (their callers see that), those queued after it run in
    /// the next group, and the writer goes on serving.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_change_drops_its_group_and_the_writer_goes_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let (first, failed, last) =
            group_with_failing_change(&store, |_| panic!("a bug in a change")).await;
        assert!(
            matches!(first, Err(StoreError::Unavailable(_))),
            "{first:?}"
        );
        assert!(matches!(failed, Err(StoreError::Unavailable(_))));
        assert!(
            matches!(last, Ok(BeginOutcome::Acquired { .. })),
            "{last:?}"
        );
        let dropped = RecordKey::from_bytes([1; 32]);
        assert_eq!(store.get(&dropped).await.expect("get"), None);
        claim(&store, dropped).await;
        assert!(store
            .get(&RecordKey::from_bytes([3; 32]))
            .await
            .expect("get")
            .is_some());
        assert_index_matches(&store.db);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn begins_that_only_decide_commit_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let done = RecordKey::from_bytes([1; 32]);
        let t = claim(&store, done).await;
        store
            .complete(&done, t, &completed(60_000))
            .await
            .expect("complete");
        let busy = RecordKey::from_bytes([2; 32]);
        claim(&store, busy).await;
        let commits = store.commit_count();

        // Replays, duplicates in flight and removing an absent key decide
        // without writing: no commit, so no fsync.
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..30u8 {
            let store = Arc::clone(&store);
            calls.spawn(async move {
                match i % 3 {
                    0 => matches!(
                        store.begin(&begin(done, 60_000, OnStale::Store)).await,
                        Ok(BeginOutcome::Completed(_))
                    ),
                    1 => matches!(
                        store.begin(&begin(busy, 60_000, OnStale::Store)).await,
                        Ok(BeginOutcome::InFlight { .. })
                    ),
                    _ => matches!(
                        store
                            .remove(&RecordKey::from_bytes([3; 32]), Removal::Any)
                            .await,
                        Ok(Removed::Absent)
                    ),
                }
            });
        }
        while let Some(answered) = calls.join_next().await {
            assert!(answered.expect("task"), "each call got its answer");
        }
        assert_eq!(store.commit_count(), commits);

        // A group that writes still commits.
        store.remove(&done, Removal::Any).await.expect("remove");
        assert_eq!(store.commit_count(), commits + 1);
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

        let done = completed(3_600_000);
        store
            .complete(&keys[0], tokens[0], &done)
            .await
            .expect("complete");
        store.release(&keys[1], tokens[1]).await.expect("release");
        assert_eq!(
            store.remove(&keys[2], Removal::Any).await.expect("remove"),
            Removed::Deleted
        );
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
