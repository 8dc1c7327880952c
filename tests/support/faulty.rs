//! A [`Store`] that can be told to fail: every call either delegates to a
//! [`MemoryStore`], hangs (longer than any test's `store.timeout`), fails
//! at once with [`StoreError::Unavailable`], loses its answer, or (a
//! `begin`) answers late. Switching the mode back to
//! [`Fault::None`] models a store that recovered, without restarting the
//! proxy.

#![allow(unreachable_pub)]

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemproxy::core::{Clock, CompletedRecord, FencingToken, Record, RecordKey};
use idemproxy::store::{Begin, BeginOutcome, MemoryStore, Removal, Removed, Store, StoreError};

/// How long a hanging call sleeps: far past any `store.timeout` in tests.
pub const HANG: Duration = Duration::from_secs(30);

/// How long a late call waits before it applies: past a test's 200 ms
/// `store.timeout`, well inside any lease.
pub const LATE: Duration = Duration::from_millis(600);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// Every call goes to the memory store.
    None = 0,
    /// Every call sleeps for [`HANG`] (the proxy's store timeout fires first).
    Hang = 1,
    /// Every call fails at once with `StoreError::Unavailable`.
    Fail = 2,
    /// Every call runs, and its answer is lost: it fails with
    /// `StoreError::Unavailable` after the memory store applied it (a
    /// connection reset after the write, a client that gave up waiting).
    LoseAnswer = 3,
    /// Every `begin` waits [`LATE`], then runs and answers: a reply that
    /// arrives after the proxy stopped waiting (a frozen server, a row
    /// lock that lets go a second later). Other calls go through.
    LateBegin = 4,
}

#[derive(Default)]
pub struct FaultyStore {
    inner: MemoryStore,
    mode: AtomicU8,
    /// Calls made through the faults, whatever their mode.
    calls: AtomicU64,
}

impl FaultyStore {
    pub fn new() -> Arc<FaultyStore> {
        Arc::new(FaultyStore::default())
    }

    /// A faulty store whose memory store reads the time from `clock`.
    pub fn with_clock(clock: Clock) -> Arc<FaultyStore> {
        Arc::new(FaultyStore {
            inner: MemoryStore::new().with_clock(clock),
            ..FaultyStore::default()
        })
    }

    pub fn set(&self, fault: Fault) {
        self.mode.store(fault as u8, Ordering::SeqCst);
    }

    /// The memory store behind the faults, for checks that bypass them.
    pub fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    /// How many calls the proxy has made to this store.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    async fn gate(&self) -> Result<(), StoreError> {
        // The mode first: a call counted has its mode, whatever a test sets
        // once it sees the count move.
        let mode = self.mode.load(Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
        match mode {
            0 | 3 | 4 => Ok(()),
            1 => {
                tokio::time::sleep(HANG).await;
                Err(StoreError::Unavailable("hung (test fault)".into()))
            }
            _ => Err(StoreError::Unavailable("down (test fault)".into())),
        }
    }
}

#[async_trait]
impl Store for FaultyStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        if self.mode.load(Ordering::SeqCst) == Fault::LateBegin as u8 {
            tokio::time::sleep(LATE).await;
        }
        self.gate().await?;
        let outcome = self.inner.begin(begin).await;
        if self.mode.load(Ordering::SeqCst) == Fault::LoseAnswer as u8 {
            return Err(StoreError::Unavailable("answer lost (test fault)".into()));
        }
        outcome
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        self.gate().await?;
        self.inner.complete(key, token, record).await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.gate().await?;
        self.inner.release(key, token).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.gate().await?;
        self.inner.get(key).await
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        self.gate().await?;
        self.inner.remove(key, removal).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.gate().await?;
        self.inner.ping().await
    }

    fn kind(&self) -> &'static str {
        "faulty-memory"
    }
}
