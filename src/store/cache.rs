//! A local replay cache in front of a shared store (`local_cache_entries`).
//!
//! Completed records never change until they expire (only an operator's
//! `remove` deletes one early), so a proxy can answer replays of keys it has
//! seen completed without asking the store. Only completed records are
//! cached, never pending ones: a pending record changes with every
//! completion, release and takeover, and caching it would answer "in flight"
//! for a key that is done.
//!
//! What is cached, and when an entry is answered from:
//!
//! - `begin` answers from the cache when it holds a live completed record for
//!   the key: `Completed` for the same fingerprint, `Mismatch { Completed }`
//!   for another (the record is immutable, so the store would say the same).
//!   Otherwise it asks the store and caches a `Completed` answer.
//! - A successful `complete` caches the record it wrote: retries tend to come
//!   back to the proxy that served the first request.
//! - `release` and `remove` drop the key's entry; `get` always asks the store
//!   (it is the operator's view).
//! - An entry is used only while its record's `expires_at` is in the future
//!   and it is younger than the cache's `max_age` ([`DEFAULT_MAX_AGE`]).
//!
//! # Removals through other processes
//!
//! `remove` (an operator's `DELETE`) is the one change a completed record
//! can go through before it expires, and on a shared store another replica
//! may make it. [`wrap`] therefore hands the store an [`RemovalWatcher`]
//! ([`Store::watch_removals`]), through which the store reports what other
//! processes removed. A Redis store follows a pub/sub channel that every
//! replica's `remove` publishes to; the memory and embedded stores have no
//! other writer and ignore it. While a feed is not connected (at startup,
//! after Redis restarts, while the subscription is down) the cache answers
//! nothing and stores nothing: it cannot know what it missed. When the feed
//! (re)connects, the cache starts over empty.
//!
//! An answer read from the store while a removal was being reported could
//! put the removed record back after the report dropped it. Every report
//! (and every `remove` through this cache, before and after it reaches the
//! store) bumps an epoch; an answer is cached only if the epoch did not move
//! between asking the store and caching, checked again after the insert
//! (the report drops the key after bumping, so one of the two sees the
//! other). `max_age` stays as a backstop for a feed that is silently
//! broken between two of its heartbeats.
//!
//! The cache is bounded by entries of up to [`ENTRY_BYTES`] (quick_cache's
//! S3-FIFO-like eviction: rarely hit entries go first). A larger response
//! counts once per started [`ENTRY_BYTES`], so the responses held come to at
//! most about `entries` x 4 KiB, whatever `max_response_bytes` allows (a
//! plain count let 10,000 entries of 1 MiB responses hold 10 GB).
//!
//! The embedded store always has one in front of it ([`EMBEDDED_ENTRIES`]):
//! the proxy is the only writer of its file, so the cache can never
//! disagree with the store, and a replay is answered on the worker's
//! thread instead of a round trip to the blocking pool. The memory store
//! has one only when its responses are compressed (`store.compression`):
//! its records are in the process already, and a cache in front of
//! uncompressed ones only held a second copy (see `open_store`); in front
//! of compressed ones it saves a replay the decompression.
//!
//! The cache sits above compression (`super::compression`): it holds
//! unpacked responses, so a cached replay never decompresses.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use quick_cache::sync::Cache;

use super::{
    Begin, BeginOutcome, Completion, ListPage, ListWant, Removal, RemovalWatcher, Removed,
    ScanCursor, ScanPage, SharedStore, Store, StoreError,
};
use crate::core::{
    millis, Clock, CompletedRecord, FencingToken, KeyState, Outcome, Record, RecordKey, UnixMillis,
};

/// How long a cached record may be answered from before the store is asked
/// again, whatever its own expiry: the bound on how long another replica's
/// `remove` can go unnoticed here if the removal feed broke without this
/// proxy noticing (see the module docs).
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(60);

/// What one entry of `local_cache_entries` holds at most: a response's body
/// and headers. Most API responses fit in one.
pub const ENTRY_BYTES: usize = 4096;

/// The cache the embedded store gets when `local_cache_entries` asks for
/// less: up to 16 MiB of responses. Retries come seconds to minutes after
/// the first call, and the cache keeps the records replayed most; older
/// ones are read from the file. A cached replay is answered on the
/// worker's thread instead of a round trip to the blocking pool.
pub const EMBEDDED_ENTRIES: usize = 4096;

/// Wraps `store` in a [`CachedStore`] of `entries` entries, told about
/// removals through other processes by the store itself
/// ([`Store::watch_removals`]); with 0 entries (the cache is off) returns
/// `store` itself.
pub fn wrap(store: SharedStore, entries: usize) -> SharedStore {
    if entries == 0 {
        return store;
    }
    cached(store, entries)
}

/// [`wrap`] with a cache of at least one entry, as its own type: for a
/// caller that watches the cache (tests, tooling).
pub fn cached(store: SharedStore, entries: usize) -> Arc<CachedStore> {
    let cached = Arc::new(CachedStore::new(store.clone(), entries));
    store.watch_removals(cached.invalidator());
    cached
}

#[derive(Clone)]
struct Entry {
    record: Arc<CompletedRecord>,
    /// When it was cached, by the store's clock.
    cached_at: UnixMillis,
}

/// An entry's weight: one per started [`ENTRY_BYTES`] of its response.
#[derive(Clone)]
struct EntryWeight;

impl quick_cache::Weighter<RecordKey, Entry> for EntryWeight {
    fn weight(&self, _: &RecordKey, entry: &Entry) -> u64 {
        let bytes = match &entry.record.outcome {
            Outcome::Response(response) => {
                response.body.len()
                    + response
                        .headers
                        .iter()
                        .map(|(name, value)| name.len() + value.len())
                        .sum::<usize>()
            }
            Outcome::Sealed(bytes) | Outcome::Packed(bytes) => bytes.len(),
            Outcome::NotStored { .. } | Outcome::Unknown { .. } => 0,
        };
        // usize is at most 64 bits on every supported target.
        bytes.div_ceil(ENTRY_BYTES).max(1) as u64
    }
}

/// A [`Store`] that answers replays of completed keys from a bounded local
/// cache and delegates everything else to `S` (see the module docs).
pub struct CachedStore<S: ?Sized = dyn Store> {
    inner: Arc<S>,
    /// Shared with the store's removal feed, through an [`RemovalWatcher`].
    shared: Arc<Shared>,
    max_age: Duration,
    /// Where expiry and `max_age` read the time.
    clock: Clock,
}

impl<S: Store + ?Sized> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("entries", &self.len())
            .field("live", &self.is_live())
            .finish_non_exhaustive()
    }
}

/// What a [`CachedStore`] and its removal feed share.
struct Shared {
    cache: Cache<RecordKey, Entry, EntryWeight>,
    /// Bumped by every report of the feed, before it drops anything: an
    /// answer read from the store while the epoch moved may be a record
    /// that was just removed, and is not cached.
    epoch: AtomicU64,
    /// False while a removal feed is not connected: entries are neither
    /// answered from nor added, since removals may go unheard. True from
    /// the start for a store without other writers.
    live: AtomicBool,
    /// Begins answered from the cache, read by `/metrics` (see
    /// [`Store::local_cache_hits`]).
    hits: AtomicU64,
}

impl Shared {
    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// `key`'s record was removed: moves the epoch, then drops the entry,
    /// so that an answer read from the store before the removal is neither
    /// kept nor cached afterwards (see [`CachedStore::insert`]).
    fn removed(&self, key: &RecordKey) {
        self.bump();
        self.cache.remove(key);
    }
}

/// Reports `.1` removed when dropped: the second report of
/// [`CachedStore::remove`], made however its call ends.
struct RemovedOnDrop<'a>(&'a Shared, RecordKey);

impl Drop for RemovedOnDrop<'_> {
    fn drop(&mut self) {
        self.0.removed(&self.1);
    }
}

/// The handle through which a store reports removals made by other
/// processes to the cache in front of it ([`Store::watch_removals`]). It
/// does not keep the cache alive: every method returns false once the cache
/// is gone, which is the feed's cue to stop.
#[derive(Clone)]
struct Invalidator(Weak<Shared>);

impl RemovalWatcher for Invalidator {
    /// `key`'s record was removed: drops it from the cache.
    fn removed(&self, key: &RecordKey) -> bool {
        self.with(|shared| shared.removed(key))
    }

    /// Stops answering from the cache: removals may go unheard.
    fn suspend(&self) -> bool {
        self.with(|shared| {
            shared.live.store(false, Ordering::SeqCst);
            shared.bump();
        })
    }

    /// Starts over from an empty cache, since what was missed is unknown.
    fn resume(&self) -> bool {
        self.with(|shared| {
            shared.bump();
            shared.cache.clear();
            shared.live.store(true, Ordering::SeqCst);
        })
    }

    fn is_open(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl Invalidator {
    fn with(&self, report: impl FnOnce(&Shared)) -> bool {
        match self.0.upgrade() {
            Some(shared) => {
                report(&shared);
                true
            }
            None => false,
        }
    }
}

impl<S: Store + ?Sized> CachedStore<S> {
    /// A cache of at most `entries` completed records (at least 1) in front
    /// of `inner`.
    pub fn new(inner: Arc<S>, entries: usize) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared {
                cache: Cache::with_weighter(entries.max(1), entries.max(1) as u64, EntryWeight),
                epoch: AtomicU64::new(0),
                live: AtomicBool::new(true),
                hits: AtomicU64::new(0),
            }),
            max_age: DEFAULT_MAX_AGE,
            clock: Clock::wall(),
        }
    }

    /// Reads the time from `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The handle for the store's removal feed (see [`RemovalWatcher`]).
    pub fn invalidator(&self) -> Arc<dyn RemovalWatcher> {
        Arc::new(Invalidator(Arc::downgrade(&self.shared)))
    }

    /// Sets how long an entry may be answered from (default
    /// [`DEFAULT_MAX_AGE`]).
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &Arc<S> {
        &self.inner
    }

    /// Records cached now (live or not yet found expired).
    pub fn len(&self) -> usize {
        self.shared.cache.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shared.cache.is_empty()
    }

    /// Whether the cache answers now: false while a removal feed is not
    /// connected.
    pub fn is_live(&self) -> bool {
        self.shared.live.load(Ordering::SeqCst)
    }

    /// The live cached record of `key`, dropping it if it is due.
    fn lookup(&self, key: &RecordKey) -> Option<Arc<CompletedRecord>> {
        if !self.is_live() {
            return None;
        }
        let entry = self.shared.cache.get(key)?;
        let now = self.clock.now_millis();
        let age = now.saturating_sub(entry.cached_at);
        if entry.record.expires_at > now && age < millis(self.max_age) {
            Some(entry.record)
        } else {
            self.shared.cache.remove(key);
            None
        }
    }

    /// Caches `record`, read from or written to the store when the epoch
    /// was `epoch`, unless a removal was reported since (see the module
    /// docs).
    fn insert(&self, key: RecordKey, record: Arc<CompletedRecord>, epoch: u64) {
        let shared = &self.shared;
        let now = self.clock.now_millis();
        if record.expires_at <= now || !self.is_live() || shared.epoch() != epoch {
            return;
        }
        shared.cache.insert(
            key,
            Entry {
                record,
                cached_at: now,
            },
        );
        // A report that bumped the epoch after the check above may have
        // dropped the key before the insert.
        if shared.epoch() != epoch {
            shared.cache.remove(&key);
        }
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for CachedStore<S> {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        // An unknown outcome a lookup may resolve is the store's to decide
        // on (`decide_begin`): the cache would replay it for good.
        let cached = self.lookup(&begin.key).filter(|record| {
            !(begin.reconcile && matches!(record.outcome, Outcome::Unknown { .. }))
        });
        if let Some(record) = cached {
            self.shared.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(if record.fingerprint == begin.fingerprint {
                BeginOutcome::Completed(record)
            } else {
                BeginOutcome::Mismatch {
                    state: KeyState::Completed,
                }
            });
        }
        let epoch = self.shared.epoch();
        let outcome = self.inner.begin(begin).await?;
        match &outcome {
            BeginOutcome::Completed(record) | BeginOutcome::Settled(record) => {
                self.insert(begin.key, record.clone(), epoch);
            }
            // Taken over to be looked up: the record cached is replaced.
            BeginOutcome::Acquired {
                reconcile: Some(_), ..
            } => {
                self.shared.cache.remove(&begin.key);
            }
            _ => {}
        }
        Ok(outcome)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        let epoch = self.shared.epoch();
        let result = self.inner.complete(key, token, record).await;
        match &result {
            Ok(()) => self.insert(*key, Arc::new(record.clone()), epoch),
            Err(_) => {
                self.shared.cache.remove(key);
            }
        }
        result
    }

    fn prepare(&self, key: &RecordKey, record: CompletedRecord) -> Result<Completion, StoreError> {
        self.inner.prepare(key, record)
    }

    /// As [`Self::complete`]; what is cached is the record as the caller
    /// gave it, not its encoding.
    async fn complete_prepared(
        &self,
        key: &RecordKey,
        token: FencingToken,
        completion: &Completion,
    ) -> Result<(), StoreError> {
        let epoch = self.shared.epoch();
        let result = self.inner.complete_prepared(key, token, completion).await;
        match &result {
            Ok(()) => self.insert(*key, Arc::clone(&completion.record), epoch),
            Err(_) => {
                self.shared.cache.remove(key);
            }
        }
        result
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.shared.cache.remove(key);
        self.inner.release(key, token).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        // Reported as a removal through another process is. Before: no
        // replay is answered from the cache once the removal started.
        // After: a `begin` that read the record from the store before the
        // removal, and answers after it, does not cache it (the epoch
        // moved). "After" is a drop guard: the caller may stop waiting
        // (the admin API's `store.timeout`) once the store has removed it.
        self.shared.removed(key);
        let _after = RemovedOnDrop(&self.shared, *key);
        self.inner.remove(key, removal).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        self.inner.list(cursor, want).await
    }

    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        self.inner.scan(cursor, count).await
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn local_cache_hits(&self) -> Option<u64> {
        Some(self.shared.hits.load(Ordering::Relaxed))
    }

    fn local_cache_live(&self) -> Option<bool> {
        Some(self.is_live())
    }

    /// A cache in front of this one hears what the store behind both
    /// reports; removals through this one reach it as they pass.
    fn watch_removals(&self, watcher: Arc<dyn RemovalWatcher>) {
        self.inner.watch_removals(watcher);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;

    use super::*;
    use crate::core::{millis, now_millis, Fingerprint, Outcome, StoredResponse};
    use crate::store::{MemoryStore, OnStale};

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(3600);

    /// A MemoryStore that counts the calls that reach it, and that can
    /// hold a `begin` after it read the record until the test lets it go:
    /// a store round trip under way, for a removal to race with. It can
    /// hold a `remove` too, before and after it removes.
    #[derive(Default)]
    struct Counting {
        inner: MemoryStore,
        begins: AtomicUsize,
        removes: AtomicUsize,
        hold_next_begin: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
        hold_next_remove: std::sync::Mutex<Option<[tokio::sync::oneshot::Receiver<()>; 2]>>,
    }

    #[async_trait]
    impl Store for Counting {
        async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
            self.begins.fetch_add(1, Ordering::SeqCst);
            let outcome = self.inner.begin(begin).await;
            let hold = self.hold_next_begin.lock().expect("lock").take();
            if let Some(released) = hold {
                let _ = released.await;
            }
            outcome
        }
        async fn complete(
            &self,
            key: &RecordKey,
            token: FencingToken,
            record: &CompletedRecord,
        ) -> Result<(), StoreError> {
            self.inner.complete(key, token, record).await
        }
        async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
            self.inner.release(key, token).await
        }
        async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
            self.inner.get(key).await
        }
        async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
            self.removes.fetch_add(1, Ordering::SeqCst);
            let hold = self.hold_next_remove.lock().expect("lock").take();
            let Some([before, after]) = hold else {
                return self.inner.remove(key, removal).await;
            };
            let _ = before.await;
            let removed = self.inner.remove(key, removal).await;
            let _ = after.await;
            removed
        }
        async fn ping(&self) -> Result<(), StoreError> {
            self.inner.ping().await
        }
        fn kind(&self) -> &'static str {
            "counting"
        }
    }

    fn key() -> RecordKey {
        RecordKey::from_bytes(rand::random())
    }

    fn begin(key: RecordKey, fingerprint: u8) -> Begin {
        Begin {
            key,
            fingerprint: Fingerprint([fingerprint; 32]),
            lease: LEASE,
            ttl: TTL,
            on_stale: OnStale::Store,
            token: FencingToken::random(),
            reconcile: false,
        }
    }

    fn completed(fingerprint: u8, ttl: Duration) -> CompletedRecord {
        let now = now_millis();
        CompletedRecord {
            fingerprint: Fingerprint([fingerprint; 32]),
            created_at: now,
            completed_at: now,
            expires_at: now + millis(ttl),
            outcome: Outcome::Response(StoredResponse {
                status: 200,
                headers: vec![],
                body: Bytes::from_static(b"ok"),
            }),
        }
    }

    fn cached(entries: usize) -> (Arc<Counting>, CachedStore<Counting>) {
        let inner = Arc::new(Counting::default());
        (inner.clone(), CachedStore::new(inner, entries))
    }

    /// Claims a new key and completes it with `record`; returns the key.
    async fn complete_new_key(store: &dyn Store, record: &CompletedRecord) -> RecordKey {
        let k = key();
        let token = claim(store, k, 1).await;
        store.complete(&k, token, record).await.expect("complete");
        k
    }

    async fn claim(store: &dyn Store, key: RecordKey, fingerprint: u8) -> FencingToken {
        match store.begin(&begin(key, fingerprint)).await {
            Ok(BeginOutcome::Acquired { token, .. }) => token,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_unknown_outcome_to_reconcile_is_the_stores_to_decide() {
        let (inner, store) = cached(16);
        let mut unknown = completed(1, TTL);
        unknown.created_at -= millis(LEASE);
        unknown.outcome = Outcome::Unknown {
            cause: crate::core::UnknownCause::Timeout,
        };
        let k = complete_new_key(&store, &unknown).await;
        let before = inner.begins.load(Ordering::SeqCst);
        // Without a lookup the cache answers it, as any completion.
        let replayed = store.begin(&begin(k, 1)).await.expect("begin");
        assert!(matches!(replayed, BeginOutcome::Completed(_)));
        assert_eq!(inner.begins.load(Ordering::SeqCst), before);
        let reconciling = Begin {
            reconcile: true,
            ..begin(k, 1)
        };
        let taken = store.begin(&reconciling).await.expect("begin");
        assert!(matches!(
            taken,
            BeginOutcome::Acquired {
                reconcile: Some(_),
                ..
            }
        ));
        assert_eq!(inner.begins.load(Ordering::SeqCst), before + 1);
        // The claim replaced it: nobody is answered the old record.
        let after = store.begin(&begin(k, 1)).await.expect("begin");
        assert!(matches!(after, BeginOutcome::InFlight { .. }), "{after:?}");
    }

    #[tokio::test]
    async fn replays_come_from_the_cache_and_pending_is_never_cached() {
        let (inner, store) = cached(16);
        let k = key();
        let token = claim(&store, k, 1).await;
        // In flight: asked twice, answered by the store both times.
        for _ in 0..2 {
            assert!(matches!(
                store.begin(&begin(k, 1)).await,
                Ok(BeginOutcome::InFlight { .. })
            ));
        }
        assert_eq!(inner.begins.load(Ordering::SeqCst), 3);
        assert!(store.is_empty(), "pending records are not cached");

        let record = completed(1, TTL);
        store.complete(&k, token, &record).await.expect("complete");
        for _ in 0..3 {
            assert_eq!(
                store.begin(&begin(k, 1)).await.ok(),
                Some(BeginOutcome::Completed(Arc::new(record.clone())))
            );
        }
        assert_eq!(
            store.begin(&begin(k, 2)).await.ok(),
            Some(BeginOutcome::Mismatch {
                state: KeyState::Completed
            })
        );
        assert_eq!(
            inner.begins.load(Ordering::SeqCst),
            3,
            "replays hit the cache"
        );
        assert_eq!(store.kind(), "counting");
    }

    #[tokio::test]
    async fn a_cached_replay_shares_the_record_instead_of_copying_it() {
        let (_, store) = cached(16);
        let k = complete_new_key(&store, &completed(1, TTL)).await;
        let replay = || async {
            match store.begin(&begin(k, 1)).await {
                Ok(BeginOutcome::Completed(record)) => record,
                other => panic!("expected Completed, got {other:?}"),
            }
        };
        let (first, second) = (replay().await, replay().await);
        assert!(
            Arc::ptr_eq(&first, &second),
            "both replays hold the cache's one copy of the record"
        );
    }

    #[test]
    fn an_entry_weighs_one_per_started_4_kib_of_response() {
        let weight = |body: usize| {
            let mut record = completed(1, TTL);
            record.outcome = Outcome::Response(StoredResponse {
                status: 200,
                headers: vec![("a".into(), Bytes::from_static(b"b"))],
                body: Bytes::from(vec![b'x'; body]),
            });
            let entry = Entry {
                record: Arc::new(record),
                cached_at: 0,
            };
            quick_cache::Weighter::weight(&EntryWeight, &key(), &entry)
        };
        // The header's name and value count too: 2 bytes.
        assert_eq!(weight(0), 1);
        assert_eq!(weight(ENTRY_BYTES - 2), 1);
        assert_eq!(weight(ENTRY_BYTES - 1), 2);
        assert_eq!(weight(10 * ENTRY_BYTES - 2), 10);
    }

    #[tokio::test]
    async fn large_responses_count_once_per_started_4_kib() {
        let (_, store) = cached(100);
        // 40 KiB bodies: 11 entries' worth each.
        let mut large = completed(1, TTL);
        large.outcome = Outcome::Response(StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
            body: Bytes::from(vec![b'x'; 40 * 1024]),
        });
        for _ in 0..50 {
            complete_new_key(&store, &large).await;
        }
        assert!(
            store.shared.cache.weight() <= 100,
            "{}",
            store.shared.cache.weight()
        );
        assert!(
            store.len() <= 100 / 11,
            "{} large records held",
            store.len()
        );

        // Small ones count one each.
        for _ in 0..50 {
            complete_new_key(&store, &completed(1, TTL)).await;
        }
        assert!(store.len() > 9, "{} small records held", store.len());
    }

    #[tokio::test]
    async fn completed_answers_from_the_store_are_cached() {
        let (inner, writer) = cached(16);
        let k = key();
        let token = claim(&*inner, k, 1).await;
        let record = completed(1, TTL);
        inner.complete(&k, token, &record).await.expect("complete");

        // A second proxy's cache, which has not seen the completion.
        let reader = CachedStore::new(inner.clone(), 16);
        let before = inner.begins.load(Ordering::SeqCst);
        for _ in 0..3 {
            assert_eq!(
                reader.begin(&begin(k, 1)).await.ok(),
                Some(BeginOutcome::Completed(Arc::new(record.clone())))
            );
        }
        assert_eq!(inner.begins.load(Ordering::SeqCst), before + 1);
        drop(writer);
    }

    /// A cache over a memory store, both on a clock that follows paused
    /// tokio time, and a completion made now by that clock.
    fn paused(
        entries: usize,
        ttl: Duration,
    ) -> (Arc<Counting>, CachedStore<Counting>, CompletedRecord) {
        let clock = Clock::tokio();
        let inner = Arc::new(Counting {
            inner: MemoryStore::new().with_clock(clock),
            ..Counting::default()
        });
        let store = CachedStore::new(inner.clone(), entries).with_clock(clock);
        let now = clock.now_millis();
        let record = CompletedRecord {
            created_at: now,
            completed_at: now,
            expires_at: now + millis(ttl),
            ..completed(1, ttl)
        };
        (inner, store, record)
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_not_answered() {
        let (inner, store, record) = paused(16, Duration::from_millis(100));
        let k = key();
        let token = claim(&store, k, 1).await;
        store.complete(&k, token, &record).await.expect("complete");
        assert_eq!(store.len(), 1);
        tokio::time::advance(Duration::from_millis(99)).await;
        let before = inner.begins.load(Ordering::SeqCst);
        assert!(matches!(
            store.begin(&begin(k, 1)).await,
            Ok(BeginOutcome::Completed(_))
        ));
        assert_eq!(
            inner.begins.load(Ordering::SeqCst),
            before,
            "answered by the cache"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        // Expired: the store is asked, and the key is free again.
        assert!(matches!(
            store.begin(&begin(k, 2)).await,
            Ok(BeginOutcome::Acquired { .. })
        ));
        assert_eq!(inner.begins.load(Ordering::SeqCst), before + 1);
        assert!(store.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn entries_older_than_max_age_are_asked_again() {
        let (inner, store, record) = paused(16, TTL);
        let store = store.max_age(Duration::from_millis(50));
        let k = complete_new_key(&store, &record).await;
        tokio::time::advance(Duration::from_millis(49)).await;
        let before = inner.begins.load(Ordering::SeqCst);
        assert!(matches!(
            store.begin(&begin(k, 1)).await,
            Ok(BeginOutcome::Completed(_))
        ));
        assert_eq!(inner.begins.load(Ordering::SeqCst), before, "still young");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(matches!(
            store.begin(&begin(k, 1)).await,
            Ok(BeginOutcome::Completed(_))
        ));
        assert_eq!(inner.begins.load(Ordering::SeqCst), before + 1);
    }

    #[tokio::test]
    async fn remove_invalidates() {
        let (inner, store) = cached(16);
        let k = complete_new_key(&store, &completed(1, TTL)).await;
        assert_eq!(
            store.remove(&k, Removal::Any).await.expect("remove"),
            Removed::Deleted
        );
        assert_eq!(inner.removes.load(Ordering::SeqCst), 1);
        assert!(store.is_empty());
        // Free again, for any fingerprint.
        claim(&store, k, 2).await;
        assert_eq!(
            store.get(&k).await.ok().flatten().map(|r| r.state()),
            Some(KeyState::Pending)
        );
    }

    #[tokio::test]
    async fn fenced_completions_are_not_cached() {
        let (_inner, store) = cached(16);
        let k = key();
        claim(&store, k, 1).await;
        let result = store
            .complete(&k, FencingToken::random(), &completed(1, TTL))
            .await;
        assert!(matches!(result, Err(StoreError::Fenced)));
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn the_cache_is_bounded() {
        let (_inner, store) = cached(8);
        for _ in 0..100 {
            complete_new_key(&store, &completed(1, TTL)).await;
        }
        assert!(store.len() <= 8, "{} entries", store.len());
        assert!(!store.is_empty());
    }

    /// Runs `store.begin` for `k` until the inner store has read the
    /// record, then `meanwhile`, then lets the begin finish; returns its
    /// outcome.
    async fn begin_around<F: std::future::Future<Output = ()>>(
        inner: &Counting,
        store: &Arc<CachedStore<Counting>>,
        k: RecordKey,
        meanwhile: F,
    ) -> BeginOutcome {
        let (release, held) = tokio::sync::oneshot::channel();
        *inner.hold_next_begin.lock().expect("lock") = Some(held);
        let before = inner.begins.load(Ordering::SeqCst);
        let task = tokio::spawn({
            let store = store.clone();
            async move { store.begin(&begin(k, 1)).await }
        });
        // The test runtime has one thread: once the begin is counted, it
        // has read the record and waits to be released.
        while inner.begins.load(Ordering::SeqCst) == before {
            tokio::task::yield_now().await;
        }
        meanwhile.await;
        release.send(()).expect("the begin is held");
        task.await.expect("begin task").expect("begin")
    }

    #[tokio::test]
    async fn an_answer_read_while_a_removal_was_reported_is_not_cached() {
        let (inner, store) = cached(16);
        let store = Arc::new(store);
        let k = complete_new_key(&*inner, &completed(1, TTL)).await;
        let invalidator = store.invalidator();
        let outcome = begin_around(&inner, &store, k, async {
            invalidator.removed(&k);
        })
        .await;
        assert!(matches!(outcome, BeginOutcome::Completed(_)));
        assert!(
            store.is_empty(),
            "a record that may have been removed meanwhile is not cached"
        );
        // Without a report under way, the same answer is cached.
        store.begin(&begin(k, 1)).await.expect("begin");
        assert_eq!(store.len(), 1);
    }

    #[tokio::test]
    async fn a_removal_through_this_cache_during_a_begin_is_not_undone() {
        let (inner, store) = cached(16);
        let store = Arc::new(store);
        let k = complete_new_key(&*inner, &completed(1, TTL)).await;
        // The begin read the record before the removal; its answer comes
        // back after the removal finished.
        let outcome = begin_around(&inner, &store, k, async {
            assert_eq!(
                store.remove(&k, Removal::Any).await.expect("remove"),
                Removed::Deleted
            );
        })
        .await;
        assert!(matches!(outcome, BeginOutcome::Completed(_)));
        assert!(store.is_empty(), "the removed record is not cached again");
        assert!(matches!(
            store.begin(&begin(k, 1)).await,
            Ok(BeginOutcome::Acquired { .. })
        ));
    }

    #[tokio::test]
    async fn a_removal_whose_caller_gives_up_once_the_store_removed_it_is_not_undone() {
        use futures_util::FutureExt;
        let (inner, store) = cached(16);
        let store = Arc::new(store);
        let k = complete_new_key(&*inner, &completed(1, TTL)).await;
        let (go_on, before) = tokio::sync::oneshot::channel();
        let (_never, after) = tokio::sync::oneshot::channel();
        *inner.hold_next_remove.lock().expect("lock") = Some([before, after]);
        let mut removal = Box::pin(store.remove(&k, Removal::Any));
        // The first report is made; the store has not removed the record.
        assert!((&mut removal).now_or_never().is_none());
        // A begin reads the record now; then the store removes it, and the
        // removal's caller stops waiting (the admin API's timeout).
        let outcome = begin_around(&inner, &store, k, async move {
            go_on.send(()).expect("the removal waits");
            assert!(
                (&mut removal).now_or_never().is_none(),
                "removed, then held"
            );
            drop(removal);
        })
        .await;
        assert!(matches!(outcome, BeginOutcome::Completed(_)));
        assert!(store.is_empty(), "the removed record is not cached again");
    }

    #[tokio::test]
    async fn a_reported_removal_drops_the_entry() {
        let (inner, store) = cached(16);
        let k = complete_new_key(&store, &completed(1, TTL)).await;
        let other = complete_new_key(&store, &completed(1, TTL)).await;
        let invalidator = store.invalidator();
        assert!(invalidator.removed(&k));
        assert_eq!(store.len(), 1, "only the removed key is dropped");
        let before = inner.begins.load(Ordering::SeqCst);
        store.begin(&begin(k, 1)).await.expect("begin");
        assert_eq!(
            inner.begins.load(Ordering::SeqCst),
            before + 1,
            "asked again"
        );
        store.begin(&begin(other, 1)).await.expect("begin");
        assert_eq!(
            inner.begins.load(Ordering::SeqCst),
            before + 1,
            "still cached"
        );
    }

    #[tokio::test]
    async fn a_suspended_cache_answers_nothing_and_resumes_empty() {
        let (inner, store) = cached(16);
        let k = complete_new_key(&store, &completed(1, TTL)).await;
        let invalidator = store.invalidator();
        assert!(invalidator.suspend());
        assert!(!store.is_live());
        let before = inner.begins.load(Ordering::SeqCst);
        for _ in 0..2 {
            assert!(matches!(
                store.begin(&begin(k, 1)).await,
                Ok(BeginOutcome::Completed(_))
            ));
        }
        assert_eq!(
            inner.begins.load(Ordering::SeqCst),
            before + 2,
            "every replay asks the store"
        );
        // Nothing is added while removals may go unheard, either.
        let fresh = complete_new_key(&store, &completed(1, TTL)).await;
        assert_eq!(store.len(), 1, "only the entry from before");

        assert!(invalidator.resume());
        assert!(store.is_live());
        assert!(store.is_empty(), "what was missed is unknown: start over");
        let before = inner.begins.load(Ordering::SeqCst);
        store.begin(&begin(fresh, 1)).await.expect("begin");
        store.begin(&begin(fresh, 1)).await.expect("begin");
        assert_eq!(
            inner.begins.load(Ordering::SeqCst),
            before + 1,
            "cached again once resumed"
        );
    }

    #[tokio::test]
    async fn an_invalidator_outliving_its_cache_says_so() {
        let (_inner, store) = cached(16);
        let invalidator = store.invalidator();
        assert!(invalidator.is_open());
        drop(store);
        assert!(!invalidator.is_open());
        assert!(!invalidator.removed(&key()));
        assert!(!invalidator.suspend());
        assert!(!invalidator.resume());
    }

    #[tokio::test]
    async fn wrap_with_zero_entries_is_the_store_itself() {
        let inner: SharedStore = Arc::new(MemoryStore::new());
        let same = wrap(inner.clone(), 0);
        assert!(Arc::ptr_eq(&inner, &same));
        let wrapped = wrap(inner, 4);
        assert_eq!(wrapped.kind(), "memory");
    }
}
