//! In-process store: tests and throwaway runs. Nothing survives a restart, and
//! nothing is shared between processes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;

use super::{
    check_owner, scan_after, Begin, BeginOutcome, ListPage, ListWant, Removal, Removed, ScanCursor,
    ScanPage, Store, StoreError,
};
use crate::core::{
    decide_begin, running_lease, Clock, CompletedRecord, FencingToken, Record, RecordKey,
    RecordMeta, UnixMillis,
};

/// A [`Store`] backed by maps in this process. Clones share the same maps.
#[derive(Clone)]
pub struct MemoryStore {
    /// The records, split by key into [`SHARDS`] maps. Each is behind a
    /// plain `std` mutex, not an async one: every critical section is a few
    /// map operations with no `.await` inside, so a lock is never held
    /// across a suspension point. Holding a key's shard for the whole
    /// read-decide-write of `begin` is what makes `begin` atomic: two
    /// requests for one key are decided strictly one after the other.
    ///
    /// Sharded because a map that grows doubles its table in one go: one
    /// map of half a million records stalled every request for tens of ms
    /// at each doubling (and each purge walked all of it under one lock).
    shards: Arc<[Mutex<Shard>]>,
    /// Where leases and expiry read the time.
    clock: Clock,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

type Shard = HashMap<RecordKey, Stored>;

/// A record as this store keeps it: encoded (`Record::encode`, the format
/// the other stores write), with its expiry beside it so purging needs no
/// decoding. One allocation per record instead of one per stored header
/// name and value: a fifth of the memory, and far fewer pages for the
/// allocator to fault in while records accumulate.
struct Stored {
    expires_at: UnixMillis,
    /// A `Box`, not `Bytes`: 16 bytes less in every slot of the map, which
    /// holds every record. A read copies a completion's encoding once
    /// (`Record::decode`).
    bytes: Box<[u8]>,
}

impl Stored {
    fn new(record: &Record) -> Self {
        Self {
            expires_at: record.expires_at(),
            bytes: record.encode().into_boxed_slice(),
        }
    }

    /// A completion, encoded without cloning it into a `Record` first.
    fn completed(record: &CompletedRecord) -> Self {
        Self {
            expires_at: record.expires_at,
            bytes: record.encode().into_boxed_slice(),
        }
    }

    fn record(&self) -> Result<Record, StoreError> {
        Record::decode(&self.bytes).map_err(|e| StoreError::Corrupt(e.to_string()))
    }
}

/// The record under `key`, decoded, unless it has expired: an expired
/// record is absent for every reader, and is overwritten by the next write
/// or dropped by the purger. One map lookup.
fn read(records: &Shard, key: &RecordKey, now: UnixMillis) -> Result<Option<Record>, StoreError> {
    records
        .get(key)
        .filter(|stored| stored.expires_at > now)
        .map(Stored::record)
        .transpose()
}

/// Many, so that each doubling is short and they do not come together.
/// Keys spread evenly, so shards reach a doubling size at about the same
/// record count: with 64 shards (~8k records each at half a million) all
/// of them doubled within a fraction of a second, a stall that a proxy
/// near capacity took tens of ms to work off. With 1024 a shard holds 16
/// times fewer records, and the relative spread of shard sizes, so of the
/// moments they double, is 4 times wider (measured at a fixed rate across a
/// doubling: docs/performance.md). Also a power of two far above the
/// worker count, so shards rarely contend; the empty maps cost about 56 KB.
const SHARDS: usize = 1024;

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::new())).collect(),
            clock: Clock::wall(),
        }
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the time from `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Drops every expired record and returns how many there were. Reads
    /// already treat expired records as absent; this only bounds memory for
    /// keys that are never asked for again.
    pub fn purge_expired(&self) -> usize {
        let now = self.clock.now_millis();
        let mut purged = 0;
        for shard in self.shards.iter() {
            let mut records = lock(shard);
            let before = records.len();
            records.retain(|_, stored| stored.expires_at > now);
            purged += before - records.len();
        }
        purged
    }

    /// Purges expired records every `every` until the store is dropped, so
    /// a long run with ever-new keys holds only the records still within
    /// their TTL. A purge walks every record, one shard locked at a time.
    pub fn spawn_purger(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let shards = Arc::downgrade(&self.shards);
        let clock = self.clock;
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let Some(shards) = shards.upgrade() else {
                    return;
                };
                let purged = MemoryStore { shards, clock }.purge_expired();
                if purged > 0 {
                    tracing::debug!(purged, "purged expired records");
                }
            }
        })
    }

    /// The locked shard that holds `key`. Record keys are SHA-256 output,
    /// so any two bytes of them spread keys evenly.
    fn shard(&self, key: &RecordKey) -> MutexGuard<'_, Shard> {
        let [a, b, ..] = *key.as_bytes();
        let i = usize::from(u16::from_le_bytes([a, b])) % self.shards.len();
        lock(&self.shards[i])
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // No critical section can panic halfway through a change (they are
    // single map operations on plain data), so a poisoned map is still
    // consistent and refusing service over it would only turn one panic
    // elsewhere into an outage.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

#[async_trait]
impl Store for MemoryStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        let now = self.clock.now_millis();
        let mut records = self.shard(&begin.key);
        let existing = read(&records, &begin.key, now)?;
        let (outcome, write) = decide_begin(begin, existing, now);
        if let Some(record) = write {
            records.insert(begin.key, Stored::new(&record));
        }
        Ok(outcome)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        let now = self.clock.now_millis();
        let mut records = self.shard(key);
        check_owner(read(&records, key, now)?.as_ref(), token)?;
        records.insert(*key, Stored::completed(record));
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let now = self.clock.now_millis();
        let mut records = self.shard(key);
        check_owner(read(&records, key, now)?.as_ref(), token)?;
        records.remove(key);
        Ok(())
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let now = self.clock.now_millis();
        read(&self.shard(key), key, now)
    }

    /// In key order, from the front of each encoding alone (see
    /// [`Store::list`]).
    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        let after = scan_after(cursor)?;
        let now = self.clock.now_millis();
        let mut keys: Vec<RecordKey> = self
            .shards
            .iter()
            .flat_map(|shard| {
                lock(shard)
                    .iter()
                    .filter(|(key, stored)| Some(**key) > after && stored.expires_at > now)
                    .map(|(key, _)| *key)
                    .collect::<Vec<_>>()
            })
            .collect();
        keys.sort_unstable();
        let mut page = ListPage::default();
        let (mut bytes, mut last) = (0, None);
        for key in &keys {
            if want.full(page.held(), page.examined, bytes) {
                break;
            }
            last = Some(*key);
            let read = self.shard(key).get(key).map(|stored| {
                let front = &stored.bytes[..stored.bytes.len().min(RecordMeta::ENCODED_FRONT_MAX)];
                bytes += front.len();
                RecordMeta::read(front).map_err(|e| e.to_string())
            });
            if let Some(read) = read {
                page.file(want, *key, read, now);
            }
        }
        page.next = last
            .filter(|last| keys.last() != Some(last))
            .map(|last| ScanCursor::new(last.to_hex()));
        Ok(page)
    }

    /// In key order, each page after the last key of the one before: a
    /// pass over every shard per page, which a store for tests can afford.
    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        let after = scan_after(cursor)?;
        let now = self.clock.now_millis();
        let mut keys: Vec<RecordKey> = self
            .shards
            .iter()
            .flat_map(|shard| {
                lock(shard)
                    .iter()
                    .filter(|(key, stored)| Some(**key) > after && stored.expires_at > now)
                    .map(|(key, _)| *key)
                    .collect::<Vec<_>>()
            })
            .collect();
        keys.sort_unstable();
        let count = count.max(1);
        let next = keys
            .get(count - 1)
            .filter(|_| keys.len() > count)
            .map(|last| ScanCursor::new(last.to_hex()));
        keys.truncate(count);
        let mut page = ScanPage {
            next,
            ..ScanPage::default()
        };
        for key in keys {
            match read(&self.shard(&key), &key, now) {
                Ok(Some(record)) => page.records.push((key, record)),
                // Expired or removed since the keys were taken.
                Ok(None) => {}
                Err(e) => page.unreadable.push((key, e.to_string())),
            }
        }
        Ok(page)
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        let now = self.clock.now_millis();
        // Checked and removed under one lock of the shard, as `begin`
        // decides under it: no claim can come between the two.
        let mut records = self.shard(key);
        if removal == Removal::UnlessLeased {
            // A record that does not decode is no running claim: removing it
            // is how an operator clears it.
            let running = records
                .get(key)
                .and_then(|stored| stored.record().ok())
                .and_then(|record| running_lease(&record, now));
            if let Some(until) = running {
                return Ok(Removed::Leased { until });
            }
        }
        // An expired record goes too, but did not count as there.
        Ok(match records.remove(key) {
            Some(stored) if stored.expires_at > now => Removed::Deleted,
            _ => Removed::Absent,
        })
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}
