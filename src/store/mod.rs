//! Where records live.
//!
//! One trait, [`Store`], with one contract (`tests/store_contract.rs`) that
//! every implementation passes:
//!
//! - [`begin`](Store::begin) atomically claims an absent key, or reports what
//!   is already there: a completed outcome with the same fingerprint, a claim
//!   still in flight, or a mismatch. A pending record whose lease expired is
//!   settled inside the same atomic step, per [`OnStale`].
//! - [`complete`](Store::complete) and [`release`](Store::release) succeed only
//!   for the holder of the record's fencing token; anyone else gets
//!   [`StoreError::Fenced`] and changes nothing.
//!
//! Every call is bounded by `store.timeout` by the caller, not here, so a
//! store implementation only reports what it observed.

pub mod cache;
pub mod codec;
pub mod compression;
pub mod embedded;
pub mod fixed_record;
pub mod memory;
pub mod postgres;
mod purger;
pub mod redis;
pub mod sealed;
pub mod settings;

use std::sync::Arc;

use async_trait::async_trait;

use crate::core::{
    decide_begin, CompletedRecord, FencingToken, Record, RecordKey, RecordMeta, UnixMillis,
    UnknownCause,
};
pub use crate::core::{Begin, BeginOutcome, OnStale, Removal, Removed};

pub use self::redis::RedisStore;
pub use cache::CachedStore;
pub use embedded::EmbeddedStore;
pub use memory::MemoryStore;
pub use postgres::PostgresStore;
pub use settings::{Compression, StoreKind, StoreSettings, DEFAULT_LOCAL_CACHE_ENTRIES};

#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or did not answer in time.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A value in the store could not be decoded.
    #[error("store holds a corrupt record: {0}")]
    Corrupt(String),
    /// A walk's cursor ([`Store::scan`]) that this store did not hand out.
    #[error("{0:?} is not a cursor of this store's walk")]
    InvalidCursor(String),
    /// A walk ([`Store::scan`]) that cannot go on where its cursor says:
    /// the store's layout changed under it (a cluster failover), so going
    /// on could pass over records. Start again.
    #[error("the walk cannot go on: {0}")]
    WalkInterrupted(String),
    /// The caller does not hold the key (its token was superseded or the
    /// record is gone).
    #[error("fencing token does not own the key")]
    Fenced,
}

impl StoreError {
    /// The error's class in one word, for a store call's span.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Corrupt(_) => "corrupt",
            StoreError::InvalidCursor(_) => "invalid_cursor",
            StoreError::WalkInterrupted(_) => "walk_interrupted",
            StoreError::Fenced => "fenced",
        }
    }
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims `begin.key` or reports its current state, in one atomic step.
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError>;

    /// Settles the key held with `token`. The record's `expires_at` says how
    /// long it is kept.
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError>;

    /// `record` made ready to complete: encoded once (compressed, sealed)
    /// into what the store will hold, so that every try of one completion
    /// writes the same bytes. A sealed response has a fresh nonce per seal:
    /// sealed again, a retried completion whose first reply was lost read
    /// as another writer's to the Redis script, which then skipped the
    /// replicas' acknowledgement. The default encodes nothing.
    fn prepare(&self, key: &RecordKey, record: CompletedRecord) -> Result<Completion, StoreError> {
        let _ = key;
        Ok(Completion {
            record: Arc::new(record),
            stored: None,
        })
    }

    /// [`Self::complete`] with a completion [`Self::prepare`] made: as
    /// often as it is tried, it writes the same bytes.
    async fn complete_prepared(
        &self,
        key: &RecordKey,
        token: FencingToken,
        completion: &Completion,
    ) -> Result<(), StoreError> {
        self.complete(key, token, completion.stored()).await
    }

    /// Forgets the pending claim held with `token`, so a retry executes.
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError>;

    /// Reads a record as it is (expired records read as absent).
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError>;

    /// Deletes a record (operator reconciliation), unless `removal` keeps
    /// it. The check and the deletion are one atomic step: a request that
    /// claims the key in between cannot lose its claim to a removal that
    /// was meant for the record before it.
    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError>;

    /// Checks that the store answers (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// One page of a walk over the stored records, about `count` of them,
    /// for operators' tools (listing keys, training a compression
    /// dictionary): expired records are left out, and records that do not
    /// read are listed apart ([`ScanPage::unreadable`]), never passed over
    /// in silence nor allowed to end the walk. A page may hold fewer than
    /// `count`, or none, before the walk ends (Redis `SCAN`), and a walk
    /// may meet a record twice; it meets every record present from its
    /// start to its end, or ends with [`StoreError::WalkInterrupted`]. The
    /// default walks nothing.
    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        let _ = (cursor, count);
        Err(StoreError::Unavailable(format!(
            "the {} store cannot be walked",
            self.kind()
        )))
    }

    /// One page of a listing of the records' metadata ([`RecordMeta`]),
    /// for the admin API's `GET /v1/keys`: never a stored response, so it
    /// costs the same whatever the responses weigh. From `cursor` on, in
    /// the walk's order, it keeps the records `want.admits` and every
    /// record that does not read (each may be an outcome to reconcile),
    /// and stops once it holds `want.limit` of them, has examined
    /// `want.max_examined` records, or has read `want.max_bytes` of values;
    /// `next` goes on right after the last record examined (`None`: the
    /// walk is over). Expired records are left out. It meets every record
    /// present from a walk's start to its end, or ends with
    /// [`StoreError::WalkInterrupted`]. The default lists nothing.
    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        let _ = (cursor, want);
        Err(StoreError::Unavailable(format!(
            "the {} store cannot be listed",
            self.kind()
        )))
    }

    /// A short name for logs and metrics.
    fn kind(&self) -> &'static str;

    /// Replays answered by an in-process cache so far, for stores that have
    /// one (see `cache::CachedStore`).
    fn local_cache_hits(&self) -> Option<u64> {
        None
    }

    /// Whether that cache answers replays now (see `cache::CachedStore`):
    /// false while removals made through other processes go unheard.
    fn local_cache_live(&self) -> Option<bool> {
        None
    }

    /// Reports removals made through other processes to `watcher`, for
    /// as long as it is open (see [`cache`]'s docs). The default reports
    /// nothing, which is right for a store this process alone writes
    /// (memory, embedded): every removal passes through the cache in front
    /// of it.
    fn watch_removals(&self, watcher: Arc<dyn RemovalWatcher>) {
        drop(watcher);
    }
}

/// Who hears of removals made through other processes
/// ([`Store::watch_removals`]): the local replay cache. Every method
/// returns false once the watcher is gone, which is the feed's cue to stop.
pub trait RemovalWatcher: Send + Sync + 'static {
    /// `key`'s record was removed.
    fn removed(&self, key: &RecordKey) -> bool;

    /// Removals may go unheard from now on (the feed is connecting, or lost
    /// its connection).
    fn suspend(&self) -> bool;

    /// The feed is connected and every removal from now on will be heard.
    fn resume(&self) -> bool;

    /// Whether the watcher is still there to be told anything.
    fn is_open(&self) -> bool;
}

pub type SharedStore = Arc<dyn Store>;

/// A completion made ready once ([`Store::prepare`]) and then tried as
/// often as it takes ([`Store::complete_prepared`]).
#[derive(Clone, Debug)]
pub struct Completion {
    /// The record as the caller gave it: what a cache above the encoding
    /// keeps, shared with it rather than copied (a copy is an allocation
    /// per header, and another set of frees when it goes).
    pub record: Arc<CompletedRecord>,
    /// What the store beneath the encoding writes, when a layer encoded
    /// it; `None`: the record itself.
    pub stored: Option<CompletedRecord>,
}

impl Completion {
    /// What the store beneath every encoding is to write.
    pub fn stored(&self) -> &CompletedRecord {
        self.stored.as_ref().unwrap_or(&self.record)
    }
}

/// Where a walk over the records ([`Store::scan`]) goes on: opaque text
/// each store reads back (a Redis `SCAN` cursor, the last key of a page).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanCursor(String);

impl ScanCursor {
    /// The start of a walk.
    pub fn start() -> Self {
        Self::default()
    }

    pub(crate) fn new(text: String) -> Self {
        Self(text)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The key a walk in key order resumes after (`None`: from the start), for
/// the stores whose cursor is the last key of a page.
pub(crate) fn scan_after(cursor: &ScanCursor) -> Result<Option<RecordKey>, StoreError> {
    if cursor.0.is_empty() {
        return Ok(None);
    }
    RecordKey::from_hex(&cursor.0)
        .map(Some)
        .ok_or_else(|| StoreError::InvalidCursor(cursor.0.clone()))
}

/// One page of a walk: its records, and where the walk goes on (`None`:
/// it is over).
#[derive(Debug, Default)]
pub struct ScanPage {
    pub records: Vec<(RecordKey, Record)>,
    /// Keys whose stored value is not a record this build reads (corrupt
    /// bytes, a value of another type under a Redis key), each with why.
    /// An operator reconciling outcomes must see them: each may be an
    /// outcome-unknown, and requests with its key are refused (500
    /// `record-unreadable`, never
    /// executed) until it is removed.
    pub unreadable: Vec<(RecordKey, String)>,
    pub next: Option<ScanCursor>,
}

/// What one page of a listing ([`Store::list`]) keeps and where it stops.
pub struct ListWant<'a> {
    pub limit: usize,
    pub max_examined: usize,
    pub max_bytes: usize,
    pub admits: &'a (dyn Fn(&RecordMeta) -> bool + Send + Sync),
}

impl std::fmt::Debug for ListWant<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListWant")
            .field("limit", &self.limit)
            .field("max_examined", &self.max_examined)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl ListWant<'_> {
    /// Whether a page holding `held` records, having examined `examined`
    /// and read `bytes`, is full.
    pub fn full(&self, held: usize, examined: usize, bytes: usize) -> bool {
        held >= self.limit.max(1) || examined >= self.max_examined.max(1) || bytes >= self.max_bytes
    }
}

/// One page of a listing ([`Store::list`]).
#[derive(Debug, Default)]
pub struct ListPage {
    pub records: Vec<(RecordKey, RecordMeta)>,
    /// Keys whose value is not a record this build reads, each with why
    /// (see [`ScanPage::unreadable`]).
    pub unreadable: Vec<(RecordKey, String)>,
    /// Records examined, kept or not.
    pub examined: usize,
    pub next: Option<ScanCursor>,
}

impl ListPage {
    /// Files the metadata `read` of the record under `key`, unless it
    /// expired by `now` or `want` does not admit it; whether it was one
    /// to examine (not expired).
    pub(crate) fn file(
        &mut self,
        want: &ListWant<'_>,
        key: RecordKey,
        read: Result<RecordMeta, String>,
        now: UnixMillis,
    ) {
        match read {
            Ok(meta) if meta.expires_at <= now => {}
            Ok(meta) => {
                self.examined += 1;
                if (want.admits)(&meta) {
                    self.records.push((key, meta));
                }
            }
            Err(why) => {
                self.examined += 1;
                self.unreadable.push((key, why));
            }
        }
    }

    /// How many records the page holds.
    pub fn held(&self) -> usize {
        self.records.len() + self.unreadable.len()
    }

    /// The page made of `found`, what a store read in walk order from the
    /// cursor on (at most what one page may examine), `more` saying
    /// whether the walk goes on after it: filed until the page is full,
    /// then on from the last record filed.
    pub(crate) fn of_found(
        want: &ListWant<'_>,
        found: Vec<(RecordKey, Result<RecordMeta, String>)>,
        more: bool,
        now: UnixMillis,
    ) -> ListPage {
        let mut page = ListPage::default();
        let mut next = found.last().map(|(key, _)| *key).filter(|_| more);
        let mut last_filed = None;
        for (key, read) in found {
            if page.held() >= want.limit.max(1) {
                next = last_filed;
                break;
            }
            page.file(want, key, read, now);
            last_filed = Some(key);
        }
        page.next = next.map(|key| ScanCursor::new(key.to_hex()));
        page
    }
}

/// The fencing rule shared by the in-process stores: only the holder of the
/// pending record's token may settle or release it.
pub fn check_owner(existing: Option<&Record>, token: FencingToken) -> Result<(), StoreError> {
    match existing {
        Some(Record::Pending(p)) if p.token == token => Ok(()),
        _ => Err(StoreError::Fenced),
    }
}

/// What `begin` makes of a record a shared store read back after its
/// claim did not take the key (Redis's `SET … NX GET`, PostgreSQL's
/// `INSERT … ON CONFLICT`): this call's own claim (`begin.token`: a
/// command sent twice, its first reply lost), or [`decide_begin`]'s
/// decision on it, the record absent once expired by this proxy's clock
/// (whenever the store reclaims it).
pub(crate) fn decide_read(
    begin: &Begin,
    existing: Record,
    now: UnixMillis,
    took_over: bool,
    reconcile: Option<UnknownCause>,
) -> (BeginOutcome, Option<Record>) {
    if matches!(&existing, Record::Pending(p) if p.token == begin.token) {
        let token = begin.token;
        let acquired = BeginOutcome::Acquired {
            token,
            took_over,
            reconcile,
        };
        return (acquired, None);
    }
    let live = (existing.expires_at() > now).then_some(existing);
    decide_begin(begin, live, now)
}

/// The answer of a shared store's `begin` whose record others changed
/// under each of its `attempts` to write it: the key is busy, not the
/// store. `Unavailable` would let `on_store_error = "pass"` forward a
/// request whose key others are claiming; in flight sends it back (425, or
/// another look under `on_in_flight = "wait"`).
pub(crate) fn busy_key(key: &RecordKey, attempts: usize, now: UnixMillis) -> BeginOutcome {
    tracing::warn!(
        key = %key.to_hex(),
        "the record changed under each of {attempts} attempts to claim it; answering in flight"
    );
    BeginOutcome::InFlight {
        lease_expires_at: now,
    }
}

/// What a `begin` that is about to write `outcome`'s takeover must
/// remember for a claim of its own read back after it ([`decide_read`]'s
/// `took_over` and `reconcile`): that it took a stale claim over, and the
/// cause to settle with if the lookup of a reconciling claim fails.
pub(crate) fn note_takeover(
    outcome: &BeginOutcome,
    took_over: &mut bool,
    reconcile: &mut Option<UnknownCause>,
) {
    if let BeginOutcome::Acquired {
        took_over: taken,
        reconcile: cause,
        ..
    } = outcome
    {
        *took_over |= taken;
        *reconcile = reconcile.or(*cause);
    }
}
