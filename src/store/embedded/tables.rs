//! The file's two tables, `records` and the `expiry` index, and the rule
//! every write keeps between them: one index entry per record, under the
//! record's own expiry, so that purging reads only the records that are due.

use std::borrow::Borrow;

use redb::{Database, ReadableTable, Table, TableDefinition};

use super::writer::{storage, WriteError};
use super::RECORDS_TABLE;
use crate::core::{Record, RecordKey, UnixMillis};
use crate::store::StoreError;

pub(super) const RECORDS: TableDefinition<'static, &[u8; 32], &[u8]> =
    TableDefinition::new(RECORDS_TABLE);
pub(super) const EXPIRY: TableDefinition<'static, (u64, &[u8; 32]), ()> =
    TableDefinition::new("expiry");

/// Records deleted per purge transaction. Purging holds the single writer
/// lock, so it works in short batches that let `begin` calls interleave.
const PURGE_BATCH: usize = 1024;

/// The tables a change works on, opened once per group.
pub(super) struct Tables<'t> {
    pub(super) records: RecordsTable<'t>,
    pub(super) expiry: ExpiryTable<'t>,
    /// Whether a change of the group wrote: a group that only decided
    /// (duplicates, replays) ends without a commit, so without an fsync.
    pub(super) wrote: bool,
}

pub(super) type RecordsTable<'txn> = Table<'txn, &'static [u8; 32], &'static [u8]>;
pub(super) type ExpiryTable<'txn> = Table<'txn, (u64, &'static [u8; 32]), ()>;

/// Maps redb's errors: a corrupted file is reported as such, everything else
/// (I/O, a poisoned transaction, a closed file) means the store cannot serve.
pub(super) fn db_error(e: impl Into<redb::Error>) -> StoreError {
    match e.into() {
        redb::Error::Corrupted(detail) => StoreError::Corrupt(detail),
        other => StoreError::Unavailable(format!("embedded store: {other}")),
    }
}

fn decode(key: &RecordKey, bytes: &[u8]) -> Result<Record, StoreError> {
    Record::decode(bytes).map_err(|e| StoreError::Corrupt(format!("record {}: {e}", key.to_hex())))
}

/// The record stored under `key`, expired or not.
pub(super) fn read(
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
pub(super) fn live<R: Borrow<Record>>(record: Option<R>, now: UnixMillis) -> Option<R> {
    record.filter(|r| r.borrow().expires_at() > now)
}

/// [`read`], inside a group: a record that does not decode refuses this
/// change alone; a redb failure aborts the group.
pub(super) fn read_for_write(
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
pub(super) fn replace(
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
pub(super) fn delete(
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
pub(super) fn purge_batch(db: &Database, now: UnixMillis) -> Result<(usize, bool), StoreError> {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::core::{Clock, RecordKey};
    use crate::store::embedded::tests::{assert_index_matches, begin, completed, token};
    use crate::store::embedded::EmbeddedStore;
    use crate::store::{BeginOutcome, OnStale, Removal, Removed, Store};

    /// Leases run out and records expire by the store's clock, which
    /// follows paused tokio time here: no waiting for them.
    #[tokio::test(start_paused = true)]
    async fn every_write_keeps_the_expiry_index_in_step() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EmbeddedStore::open(dir.path())
            .expect("open")
            .with_clock(Clock::tokio());
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
        tokio::time::advance(Duration::from_millis(30)).await;
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
        tokio::time::advance(Duration::from_millis(300)).await;
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
