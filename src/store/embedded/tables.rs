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

use fjall::{Keyspace, OwnedWriteBatch, PersistMode};

use super::writer::{storage, WriteError};
use crate::core::{CompletedRecord, PendingRecord, Record, RecordKey, UnixMillis};
use crate::store::StoreError;

/// Bytes of the `expires_at` prefix of every value.
pub(super) const EXPIRY_PREFIX: usize = 8;

/// `record` as the keyspace holds it.
pub(super) fn encode_value(record: &Record) -> Vec<u8> {
    match record {
        Record::Pending(claim) => {
            claim.encode_after(prefix(claim.expires_at, PendingRecord::ENCODED_LEN_MAX))
        }
        Record::Completed(completed) => encode_completed(completed),
    }
}

/// `record`'s completion as the keyspace holds it, encoded after its
/// prefix in one buffer (not encoded, then copied behind the prefix).
pub(super) fn encode_completed(record: &CompletedRecord) -> Vec<u8> {
    record.encode_after(prefix(record.expires_at, record.encoded_len_max()))
}

/// A value of `encoded` record bytes that expire at `expires_at`.
pub(super) fn wrap(expires_at: UnixMillis, encoded: &[u8]) -> Vec<u8> {
    let mut value = prefix(expires_at, encoded.len());
    value.extend_from_slice(encoded);
    value
}

/// A value's `expires_at` prefix, with room for `record_len` bytes of
/// record after it.
fn prefix(expires_at: UnixMillis, record_len: usize) -> Vec<u8> {
    let mut value = Vec::with_capacity(EXPIRY_PREFIX + record_len);
    value.extend_from_slice(&expires_at.to_be_bytes());
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

/// The keyspace as one group of changes sees it. Its writes go to
/// `written` only, so that nothing of the group is in the keyspace (where
/// readers look) before the group's batch is persisted.
pub(super) struct Tables {
    records: Keyspace,
    /// The group's writes so far (`None`: deleted), which later changes of
    /// the group read in place of the keyspace's value.
    written: HashMap<[u8; 32], Option<Vec<u8>>>,
}

impl Tables {
    pub(super) fn new(records: Keyspace) -> Self {
        Self {
            records,
            written: HashMap::new(),
        }
    }

    /// Whether a change of the group wrote: a group that only decided
    /// (duplicates, replays) ends without a batch, so without an fsync.
    pub(super) fn wrote(&self) -> bool {
        !self.written.is_empty()
    }

    /// `look` at the value under `key` as the group left it, where it is
    /// (the group's buffer or fjall's), without copying it out; a fjall
    /// failure aborts the group.
    pub(super) fn with_value<T>(
        &self,
        key: &RecordKey,
        look: impl FnOnce(Option<&[u8]>) -> T,
    ) -> Result<T, WriteError> {
        if let Some(written) = self.written.get(key.as_bytes()) {
            return Ok(look(written.as_deref()));
        }
        let stored = self.records.get(key.as_bytes()).map_err(storage)?;
        Ok(look(stored.as_deref()))
    }

    /// The record under `key`, expired or not: one that does not decode
    /// refuses this change alone.
    pub(super) fn read_for_write(&self, key: &RecordKey) -> Result<Option<Record>, WriteError> {
        self.with_value(key, |value| value.map(|value| decode(key, value)))?
            .transpose()
            .map_err(WriteError::Refused)
    }

    /// Stores `value` (see [`encode_value`]) under `key`.
    pub(super) fn put(&mut self, key: &RecordKey, value: Vec<u8>) {
        self.written.insert(*key.as_bytes(), Some(value));
    }

    /// Deletes what is stored under `key`.
    pub(super) fn delete(&mut self, key: &RecordKey) {
        self.written.insert(*key.as_bytes(), None);
    }

    /// Writes the group as one batch and persists it (`fdatasync` of the
    /// journal) before it applies it to the keyspace: fjall's
    /// `WriteBatch::commit` with a durability writes the journal, syncs it,
    /// and only then inserts into the memtables and publishes the batch's
    /// sequence number, all under the journal's lock. So a reader (`get`,
    /// the walks, the next group) never sees a change that is not durable,
    /// and a failed sync (which poisons the database: every later write
    /// fails) leaves the keyspace without any of the group.
    pub(super) fn commit(self, db: &fjall::Database) -> Result<(), StoreError> {
        let mut batch: OwnedWriteBatch = db.batch().durability(Some(PersistMode::SyncData));
        for (key, value) in self.written {
            match value {
                Some(value) => batch.insert(&self.records, key, value),
                None => batch.remove(&self.records, key),
            }
        }
        batch.commit().map_err(db_error)
    }
}
