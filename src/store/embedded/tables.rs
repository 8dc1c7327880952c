//! The one keyspace of records, what each value holds, and the view a
//! group of changes has of it: every record as last persisted, overlaid
//! with what the group's earlier changes wrote.
//!
//! A value is the record's `expires_at` (8 bytes, big-endian) followed by
//! [`Record::encode`]'s bytes. The prefix is what expiry reads without
//! decoding (the compaction filter, the purge): a completion writes one
//! key, and no index of expiries has to be kept in step with it.

use std::borrow::Borrow;
use std::collections::HashMap;

use fjall::{Database, Keyspace, OwnedWriteBatch, PersistMode, Slice};

use super::writer::{storage, WriteError};
use crate::core::{CompletedRecord, PendingRecord, Record, RecordKey, UnixMillis};
use crate::store::StoreError;

/// Bytes of the `expires_at` prefix of every value.
pub(super) const EXPIRY_PREFIX: usize = 8;

/// `record` as the keyspace holds it.
pub(super) fn encode_value(record: &Record) -> Vec<u8> {
    match record {
        Record::Pending(claim) => {
            let mut value = Vec::with_capacity(EXPIRY_PREFIX + PendingRecord::ENCODED_LEN_MAX);
            value.extend_from_slice(&claim.expires_at.to_be_bytes());
            claim.encode_after(value)
        }
        Record::Completed(completed) => encode_completed(completed),
    }
}

/// `record`'s completion as the keyspace holds it, encoded after its
/// prefix in one buffer (not encoded, then copied behind the prefix).
pub(super) fn encode_completed(record: &CompletedRecord) -> Vec<u8> {
    let mut value = Vec::with_capacity(EXPIRY_PREFIX + record.encoded_len_max());
    value.extend_from_slice(&record.expires_at.to_be_bytes());
    record.encode_after(value)
}

/// A value of `encoded` record bytes that expire at `expires_at`.
pub(super) fn wrap(expires_at: UnixMillis, encoded: &[u8]) -> Vec<u8> {
    let mut value = Vec::with_capacity(EXPIRY_PREFIX + encoded.len());
    value.extend_from_slice(&expires_at.to_be_bytes());
    value.extend_from_slice(encoded);
    value
}

/// The `expires_at` prefix of a value; `None` for one too short to hold
/// it (which is left for an operator, as any value that does not read).
pub(super) fn expiry_of(value: &[u8]) -> Option<UnixMillis> {
    let prefix: [u8; EXPIRY_PREFIX] = value.get(..EXPIRY_PREFIX)?.try_into().ok()?;
    Some(UnixMillis::from_be_bytes(prefix))
}

/// The record bytes of a value (after its prefix).
pub(super) fn record_bytes(value: &[u8]) -> Result<&[u8], String> {
    value
        .get(EXPIRY_PREFIX..)
        .ok_or_else(|| format!("a value of {} bytes holds no record", value.len()))
}

/// Maps fjall's errors: everything (I/O, a poisoned database after a failed
/// fsync, a closed database) means the store cannot serve.
pub(super) fn db_error(e: fjall::Error) -> StoreError {
    StoreError::Unavailable(format!("embedded store: {e}"))
}

/// Decodes the value stored under `key`.
pub(super) fn decode(key: &RecordKey, value: &[u8]) -> Result<Record, StoreError> {
    record_bytes(value)
        .and_then(|bytes| Record::decode(bytes).map_err(|e| e.to_string()))
        .map_err(|e| StoreError::Corrupt(format!("record {}: {e}", key.to_hex())))
}

/// The record stored under `key`, expired or not, as last persisted.
pub(super) fn read(records: &Keyspace, key: &RecordKey) -> Result<Option<Record>, StoreError> {
    match records.get(key.as_bytes()).map_err(db_error)? {
        Some(value) => decode(key, &value).map(Some),
        None => Ok(None),
    }
}

/// What readers may see of a stored record (owned or borrowed): expired
/// ones read as absent.
pub(super) fn live<R: Borrow<Record>>(record: Option<R>, now: UnixMillis) -> Option<R> {
    record.filter(|r| r.borrow().expires_at() > now)
}

/// The writes of one group, as the committer writes them: each key once
/// (`None`: deleted).
pub(super) type GroupWrites = Vec<([u8; 32], Option<Slice>)>;

/// The keyspace as the writer's groups of changes see it: what is
/// persisted, overlaid with the writes of the groups handed to the
/// committer but not yet known to be committed (`in_flight`), overlaid with
/// what the group being decided wrote so far (`written`). Nothing of a
/// group reaches the keyspace (where readers look) before its batch is
/// persisted: the overlays are the writer's alone.
pub(super) struct Tables {
    records: Keyspace,
    /// Writes of the groups decided ahead of their commit, with the number
    /// of the last group that wrote each key: once that group is committed
    /// the keyspace holds the same value, and the entry goes.
    in_flight: HashMap<[u8; 32], (u64, Option<Slice>)>,
    /// The group's writes so far, which its later changes read in place of
    /// the keyspace's value. Kept across groups, so that its table is
    /// allocated once.
    written: HashMap<[u8; 32], Option<Vec<u8>>>,
}

impl Tables {
    pub(super) fn new(records: Keyspace) -> Self {
        Self {
            records,
            in_flight: HashMap::new(),
            written: HashMap::new(),
        }
    }

    /// Whether a change of the group wrote: a group that only decided
    /// (duplicates, replays) ends without a batch, so without an fsync.
    pub(super) fn wrote(&self) -> bool {
        !self.written.is_empty()
    }

    /// Whether the group may have read a write that is not yet durable.
    pub(super) fn reads_in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// The value under `key` as the earlier groups left it: in flight, or
    /// as persisted.
    fn before_group(&self, key: &RecordKey) -> Result<Option<Slice>, WriteError> {
        match self.in_flight.get(key.as_bytes()) {
            Some((_, value)) => Ok(value.clone()),
            None => self.records.get(key.as_bytes()).map_err(storage),
        }
    }

    /// The value under `key`, as the group left it; a fjall failure aborts
    /// the group.
    pub(super) fn value(&self, key: &RecordKey) -> Result<Option<Slice>, WriteError> {
        match self.written.get(key.as_bytes()) {
            Some(written) => Ok(written.as_deref().map(Slice::from)),
            None => self.before_group(key),
        }
    }

    /// The record under `key`, expired or not: one that does not decode
    /// refuses this change alone.
    /// Decodes from the group's buffer or fjall's, without copying the
    /// value out first (decoding copies what it keeps).
    pub(super) fn read_for_write(&self, key: &RecordKey) -> Result<Option<Record>, WriteError> {
        let decoded = match self.written.get(key.as_bytes()) {
            Some(written) => written.as_deref().map(|value| decode(key, value)),
            None => self.before_group(key)?.map(|value| decode(key, &value)),
        };
        decoded.transpose().map_err(WriteError::Refused)
    }

    /// Stores `value` (see [`encode_value`]) under `key`.
    pub(super) fn put(&mut self, key: &RecordKey, value: Vec<u8>) {
        self.written.insert(*key.as_bytes(), Some(value));
    }

    /// Deletes what is stored under `key`.
    pub(super) fn delete(&mut self, key: &RecordKey) {
        self.written.insert(*key.as_bytes(), None);
    }

    /// Ends the group numbered `group`, decided: its writes, for the
    /// committer, and in flight for the groups decided after it.
    pub(super) fn hand_over(&mut self, group: u64) -> GroupWrites {
        let mut writes = Vec::with_capacity(self.written.len());
        for (key, value) in self.written.drain() {
            let value = value.map(Slice::from);
            self.in_flight.insert(key, (group, value.clone()));
            writes.push((key, value));
        }
        writes
    }

    /// Ends the group without a trace: it was aborted.
    pub(super) fn discard(&mut self) {
        self.written.clear();
    }

    /// The groups up to `group` are committed: the keyspace holds what they
    /// wrote.
    pub(super) fn committed_through(&mut self, group: u64) {
        self.in_flight.retain(|_, (last, _)| *last > group);
    }

    /// Every group in flight failed or is bound to: their writes never
    /// happened.
    pub(super) fn forget_in_flight(&mut self) {
        self.in_flight.clear();
    }
}

/// Writes `groups` (in the order they were decided: a later group's value
/// for a key replaces an earlier one's) as one batch and persists it
/// (`fdatasync` of the journal) before it applies it to the keyspace:
/// fjall's `WriteBatch::commit` with a durability writes the journal,
/// syncs it, and only then inserts into the memtables and publishes the
/// batch's sequence number, all under the journal's lock. So a reader
/// (`get`, the walks, the writer once it learns the batch is committed)
/// never sees a change that is not durable, and a failed sync (which
/// poisons the database: every later write fails) leaves the keyspace
/// without any of the batch. Returns whether there was anything to write.
pub(super) fn commit<'a>(
    db: &Database,
    records: &Keyspace,
    groups: impl Iterator<Item = &'a GroupWrites>,
) -> Result<bool, StoreError> {
    let mut writing = groups.filter(|writes| !writes.is_empty());
    let (Some(first), second) = (writing.next(), writing.next()) else {
        return Ok(false);
    };
    let mut batch: OwnedWriteBatch = db.batch().durability(Some(PersistMode::SyncData));
    let mut add = |key: &[u8; 32], value: &Option<Slice>| match value {
        Some(value) => batch.insert(records, *key, value.clone()),
        None => batch.remove(records, *key),
    };
    match second {
        // Each key once already (the group's writes were a map).
        None => first.iter().for_each(|(key, value)| add(key, value)),
        // One batch has one sequence number: a key written twice in it
        // would leave either value. The last group's wins.
        Some(second) => {
            let mut latest: HashMap<&[u8; 32], &Option<Slice>> = HashMap::new();
            for writes in [first, second].into_iter().chain(writing) {
                latest.extend(writes.iter().map(|(key, value)| (key, value)));
            }
            latest.into_iter().for_each(|(key, value)| add(key, value));
        }
    }
    batch.commit().map_err(db_error)?;
    Ok(true)
}
