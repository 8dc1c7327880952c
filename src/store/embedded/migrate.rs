//! Moving an earlier version's data (one redb file, `idemproxy.redb`, in
//! the same directory) into the LSM tree: on the first open
//! ([`super::EmbeddedStore::open`], which `idemproxy store migrate` runs
//! too).
//!
//! Every record is copied, whatever its state: completed, pending (a claim
//! whose request may have run: it must still be found, to fail closed),
//! expired (harmless: it reads as absent and is purged) or unreadable (an
//! operator's to see and remove, never to lose in silence). The copy is
//! persisted, with a marker naming what it copied (a SHA-256 of the file's
//! records), before the redb file is moved out of the way; a crash at any
//! point leaves either the redb file to copy again or a whole copy.
//!
//! A redb file can come back after it was moved: an operator who goes
//! back to an earlier version (a downgrade) runs a build that knows only
//! `idemproxy.redb`, creates one (or takes back the moved one) and answers
//! requests from it, and the next upgrade finds it. Its records are the
//! only trace of the keys that build executed, so it is copied again
//! unless it holds exactly the records the marker names (then the start
//! that copied it died before moving it). The store may hold some of its keys too;
//! `merge` decides, so that a key stays refused as long as either record
//! would have kept it so, and copying the same file twice changes nothing.
//! A moved file never replaces an earlier one: it takes the next free
//! name (`idemproxy.redb.migrated`, then `.migrated.1`, `.2`, ...).

use std::fs;
use std::io;
use std::path::Path;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use sha2::{Digest, Sha256};

use super::tables::{db_error, encode_value, record_bytes, wrap};
use crate::core::{Record, UnixMillis};
use crate::store::StoreError;

/// The earlier versions' database file inside the configured directory.
pub const REDB_FILE_NAME: &str = "idemproxy.redb";

/// What the redb file is renamed to once its records are copied: kept for
/// the operator to delete (or to go back to an earlier version with). When
/// it exists already, the next free one of `idemproxy.redb.migrated.1`,
/// `.2`, ... is taken instead.
pub const MIGRATED_FILE_NAME: &str = "idemproxy.redb.migrated";

/// The redb table of records in earlier versions (key: `&[u8; 32]`,
/// value: [`Record::encode`] bytes).
const REDB_RECORDS: TableDefinition<'static, &[u8; 32], &[u8]> = TableDefinition::new("records");

/// The keyspace of the store's own facts (not records): here, that a
/// migration completed.
const META_KEYSPACE: &str = "meta";
/// The marker of a whole copy: see [`marker`].
const MIGRATED_KEY: &[u8] = b"migrated-from-redb";

/// Records copied per persisted batch.
const COPY_BATCH: usize = 4096;

/// What names a redb file: the SHA-256 of the records it holds (each key,
/// its value's length, the value, in key order), read in the transaction
/// the copy reads them from.
///
/// Not the file's size, modification time and inode: those say where and
/// when a file was written, not what it holds, and only a mismatch makes a
/// file copied again. A backup restored with its times (`cp -a`, `rsync
/// -a`, `tar`) into an inode freed by the file moved aside, or a file the
/// earlier build rewrote within the timestamp's resolution, would pass for
/// the one already copied, and its records would be dropped. Nor the
/// file's bytes: redb writes to its file when it opens and closes it (its
/// recovery, its own bookkeeping), so the file copied is never the file
/// left behind, while its records are; and a hash of the records read in
/// the copy's transaction covers exactly what was copied, with no moment
/// between the two for the file to change. The cost is one more read of
/// the records, on a start that finds a file (they hold records within
/// their TTL: megabytes, a few GiB at most).
type Identity = [u8; 32];

/// The redb table of records, as a read transaction opens it.
type RedbRecords = redb::ReadOnlyTable<&'static [u8; 32], &'static [u8]>;

/// What a migration did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Migrated {
    /// Records read from the redb file: each copied, or merged with the
    /// record the store held under its key already.
    pub records: u64,
    /// Of those, records whose bytes do not decode: copied as they are, to
    /// be listed as unreadable (and requests with their keys refused).
    pub unreadable: u64,
}

/// Copies the records of the redb file in `dir`, if there is one, into
/// `records`, telling `copied` of each batch persisted (how many records
/// of the file it went through: an operator's progress); `None` when there
/// was nothing to migrate.
pub fn from_redb(
    dir: &Path,
    db: &Database,
    records: &Keyspace,
    copied: &mut dyn FnMut(u64),
) -> Result<Option<Migrated>, StoreError> {
    let file = dir.join(REDB_FILE_NAME);
    if !file.exists() {
        return Ok(None);
    }
    let meta = db
        .keyspace(META_KEYSPACE, KeyspaceCreateOptions::default)
        .map_err(db_error)?;
    let unavailable = |e: &dyn std::fmt::Display| {
        StoreError::Unavailable(format!("cannot migrate {}: {e}", file.display()))
    };
    let old = redb::Database::open(&file).map_err(|e| unavailable(&e))?;
    let txn = old.begin_read().map_err(|e| unavailable(&e))?;
    let table = match txn.open_table(REDB_RECORDS) {
        Ok(table) => Some(table),
        // A file created but never written to.
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(unavailable(&e)),
    };
    let identity = identity(table.as_ref()).map_err(|e| unavailable(&e))?;
    let marked = meta.get(MIGRATED_KEY).map_err(db_error)?;
    let migrated = match marked.as_deref().map(marked_identity) {
        // Copied whole by a start that died before the move below.
        Some(Some(copied)) if copied == identity => None,
        earlier => {
            if earlier.is_some() {
                // A file other than the one copied, or one copied by a
                // build that did not say which: either way its records may
                // be the only trace of keys an earlier version executed.
                tracing::warn!(
                    file = %file.display(),
                    "the store was migrated from redb before, but this file is not the \
                     one it copied (an earlier version ran on this directory after \
                     the migration?): copying its records too"
                );
            }
            let migrated = match &table {
                Some(table) => copy(table, db, records, copied).map_err(|e| match e {
                    CopyError::Redb(e) => unavailable(&e),
                    CopyError::Store(e) => e,
                })?,
                None => Migrated::default(),
            };
            let mut done = db.batch().durability(Some(PersistMode::SyncAll));
            done.insert(&meta, MIGRATED_KEY, marker(migrated.records, &identity));
            done.commit().map_err(db_error)?;
            tracing::info!(
                file = %file.display(),
                records = migrated.records,
                unreadable = migrated.unreadable,
                "migrated the embedded store from redb"
            );
            Some(migrated)
        }
    };
    // redb writes to its file as it closes it: that lands before the move,
    // in the file an operator may take back to an earlier version.
    drop(table);
    drop(txn);
    drop(old);
    move_aside(dir, &file)?;
    Ok(migrated)
}

/// The marker's value: the number of records copied (8 bytes, big-endian,
/// all that builds before the identity wrote), then the copied file's
/// [`Identity`]. Only the last file copied is named: one copied before
/// that and brought back is copied again, which `merge` makes safe.
fn marker(records: u64, identity: &Identity) -> Vec<u8> {
    let mut value = Vec::with_capacity(8 + identity.len());
    value.extend_from_slice(&records.to_be_bytes());
    value.extend_from_slice(identity);
    value
}

/// The identity a marker names; `None` for one written before markers
/// named their file (which any file then differs from: copying a file
/// again is safe, skipping one is not).
fn marked_identity(value: &[u8]) -> Option<Identity> {
    match value.len() {
        40 => value.get(8..).and_then(|identity| identity.try_into().ok()),
        _ => None,
    }
}

fn identity(table: Option<&RedbRecords>) -> Result<Identity, redb::StorageError> {
    let mut hasher = Sha256::new();
    if let Some(table) = table {
        for entry in table.iter()? {
            let (key, value) = entry?;
            let value = value.value();
            hasher.update(key.value());
            hasher.update((value.len() as u64).to_be_bytes());
            hasher.update(value);
        }
    }
    Ok(hasher.finalize().into())
}

/// Renames the copied `file` to the first free name of
/// `idemproxy.redb.migrated`, `.migrated.1`, `.migrated.2`, ...: an earlier
/// file moved there may be what an operator goes back with, or the only
/// copy of what a build wrote before a downgrade, so it is never replaced.
/// Looking then renaming is not atomic, but nothing else writes these
/// names while this process holds the store's lock: earlier versions never
/// do, and a second proxy of this one cannot open the store.
fn move_aside(dir: &Path, file: &Path) -> Result<(), StoreError> {
    let unavailable = |e: &dyn std::fmt::Display| {
        StoreError::Unavailable(format!(
            "cannot move {} aside once migrated: {e}",
            file.display()
        ))
    };
    let mut aside = dir.join(MIGRATED_FILE_NAME);
    let mut taken = 0u64;
    loop {
        match fs::symlink_metadata(&aside) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => break,
            Err(e) => return Err(unavailable(&e)),
            Ok(_) => {
                taken += 1;
                aside = dir.join(format!("{MIGRATED_FILE_NAME}.{taken}"));
            }
        }
    }
    fs::rename(file, &aside).map_err(|e| unavailable(&e))?;
    if taken == 0 {
        tracing::info!(
            file = %file.display(),
            to = %aside.display(),
            "moved the migrated redb file aside"
        );
    } else {
        tracing::warn!(
            file = %file.display(),
            to = %aside.display(),
            "moved the migrated redb file aside, beside the one an earlier migration left \
             (kept untouched: delete them once you are satisfied)"
        );
    }
    Ok(())
}

/// Why a copy failed: reading the file, or writing the store.
enum CopyError {
    Redb(redb::StorageError),
    Store(StoreError),
}

impl From<redb::StorageError> for CopyError {
    fn from(e: redb::StorageError) -> Self {
        CopyError::Redb(e)
    }
}

fn copy(
    table: &RedbRecords,
    db: &Database,
    records: &Keyspace,
    copied: &mut dyn FnMut(u64),
) -> Result<Migrated, CopyError> {
    let store = |e: fjall::Error| CopyError::Store(db_error(e));
    let mut migrated = Migrated::default();
    let (mut both, mut kept) = (0u64, 0u64);
    let mut batch = db.batch().durability(Some(PersistMode::SyncAll));
    let mut unreported = 0;
    for entry in table.iter()? {
        let (key, value) = entry?;
        let key = *key.value();
        let bytes = value.value();
        let decoded = Record::decode(bytes).ok();
        if decoded.is_none() {
            migrated.unreadable += 1;
        }
        migrated.records += 1;
        unreported += 1;
        // Read from the keyspace, not the batch: the file holds each key
        // once, so no earlier entry of this copy wrote it.
        let write = match records.get(key).map_err(store)? {
            None => Some(as_value(decoded.as_ref(), bytes)),
            Some(stored) => {
                both += 1;
                match merge(&stored, bytes) {
                    Merge::Keep => {
                        kept += 1;
                        None
                    }
                    Merge::Write(value) => Some(value),
                }
            }
        };
        if let Some(value) = write {
            batch.insert(records, key, value);
        }
        if batch.len() >= COPY_BATCH {
            let full = std::mem::replace(
                &mut batch,
                db.batch().durability(Some(PersistMode::SyncAll)),
            );
            full.commit().map_err(store)?;
            copied(std::mem::take(&mut unreported));
        }
    }
    batch.commit().map_err(store)?;
    copied(unreported);
    if both > 0 {
        tracing::warn!(
            keys = both,
            kept_as_stored = kept,
            "the redb file and the store both held some keys: each keeps the record \
             that refuses it, as long as either would have (docs/stores.md)"
        );
    }
    Ok(migrated)
}

/// The keyspace's value for a record of the redb file (`decoded` from its
/// `bytes`, if they decode).
fn as_value(decoded: Option<&Record>, bytes: &[u8]) -> Vec<u8> {
    // One that does not decode never expires by itself: it stays until an
    // operator removes it, as it did in the redb file.
    wrap(decoded.map_or(UnixMillis::MAX, Record::expires_at), bytes)
}

/// What a copy does with a key the store holds already.
#[derive(Debug, PartialEq, Eq)]
enum Merge {
    /// The store's value stands as it is.
    Keep,
    /// The store's value is replaced with this one.
    Write(Vec<u8>),
}

/// Which record a key keeps when the store holds `stored` (a keyspace
/// value) and the redb file `old` (record bytes): the store's record was
/// written after the first migration, the file's by an earlier version
/// run after it (or the same record, copied before). Either may be the
/// later; neither store saw the other's. What matters is that no retry of
/// the key executes where either record would have refused it, so:
///
/// 1. A value that does not decode wins (the store's, if both): it refuses
///    its key until an operator looks, and it must be seen, not dropped.
/// 2. A record that expired before the other was created is an earlier
///    use of the key, over when the other began: the other stands.
/// 3. Otherwise a completion wins over a claim: it replays under every
///    policy, where a claim past its lease is run again under `on_stale =
///    "retry"`. Between two of a kind, the later one (completed, or
///    claimed, last) wins: it is the key's latest use, and a completion's
///    answer the one its client saw last. A tie keeps the store's, so
///    copying the same file twice writes nothing.
/// 4. The record kept lives until the later of the two expiries: the key
///    stays refused as long as either store would have refused it.
fn merge(stored: &[u8], old: &[u8]) -> Merge {
    let Some(stored_record) = record_bytes(stored)
        .ok()
        .and_then(|bytes| Record::decode(bytes).ok())
    else {
        return Merge::Keep;
    };
    let Ok(old_record) = Record::decode(old) else {
        return Merge::Write(as_value(None, old));
    };
    let (stored_until, old_until) = (stored_record.expires_at(), old_record.expires_at());
    if old_until <= stored_record.created_at() {
        return Merge::Keep;
    }
    if stored_until <= old_record.created_at() {
        return Merge::Write(as_value(Some(&old_record), old));
    }
    let old_wins = match (&stored_record, &old_record) {
        (Record::Completed(_), Record::Pending(_)) => false,
        (Record::Pending(_), Record::Completed(_)) => true,
        (Record::Completed(stored), Record::Completed(old)) => {
            old.completed_at > stored.completed_at
        }
        (Record::Pending(stored), Record::Pending(old)) => old.created_at > stored.created_at,
    };
    let until = stored_until.max(old_until);
    match (old_wins, stored_until == until, old_until == until) {
        (false, true, _) => Merge::Keep,
        (false, false, _) => Merge::Write(encode_value(&living_until(stored_record, until))),
        (true, _, true) => Merge::Write(as_value(Some(&old_record), old)),
        (true, _, false) => Merge::Write(encode_value(&living_until(old_record, until))),
    }
}

/// `record`, expiring at `expires_at` instead.
fn living_until(mut record: Record, expires_at: UnixMillis) -> Record {
    match &mut record {
        Record::Pending(claim) => claim.expires_at = expires_at,
        Record::Completed(done) => done.expires_at = expires_at,
    }
    record
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::core::{CompletedRecord, FencingToken, Fingerprint, Outcome, PendingRecord};
    use crate::store::embedded::expiry::{ExpiryFilters, Horizon};
    use crate::store::embedded::tables::expiry_of;
    use crate::store::embedded::{database, DATA_DIR};

    const HOUR: u64 = 3_600_000;
    const T: UnixMillis = 1_800_000_000_000;

    fn done(created_at: UnixMillis, status: u16) -> Record {
        Record::Completed(CompletedRecord {
            fingerprint: Fingerprint([1; 32]),
            created_at,
            completed_at: created_at + 1_000,
            expires_at: created_at + 24 * HOUR,
            outcome: Outcome::NotStored { status },
        })
    }

    fn claim(created_at: UnixMillis) -> Record {
        Record::Pending(PendingRecord {
            fingerprint: Fingerprint([1; 32]),
            token: FencingToken::random(),
            created_at,
            lease_expires_at: created_at + 30_000,
            expires_at: created_at + 30_000 + 24 * HOUR,
        })
    }

    fn stored(record: &Record) -> Vec<u8> {
        encode_value(record)
    }

    /// The record a merge leaves under the key.
    fn after(stored_value: &[u8], old: &Record) -> Record {
        let value = match merge(stored_value, &old.encode()) {
            Merge::Keep => stored_value.to_vec(),
            Merge::Write(value) => value,
        };
        let record = Record::decode(record_bytes(&value).expect("prefix")).expect("decodes");
        assert_eq!(
            expiry_of(&value),
            Some(record.expires_at()),
            "prefix in step"
        );
        // Copying the same file again writes nothing.
        assert_eq!(merge(&value, &old.encode()), Merge::Keep);
        record
    }

    #[test]
    fn merge_keeps_the_store_s_record_when_the_file_holds_the_same() {
        let record = done(T, 201);
        assert_eq!(merge(&stored(&record), &record.encode()), Merge::Keep);
        let record = claim(T);
        assert_eq!(merge(&stored(&record), &record.encode()), Merge::Keep);
    }

    #[test]
    fn merge_never_replaces_a_completion_with_a_claim_and_keeps_the_later_expiry() {
        // Completed before the downgrade; the earlier build ran the retry
        // again and died mid-call.
        let completion = done(T, 201);
        let later_claim = claim(T + HOUR);
        let kept = after(&stored(&completion), &later_claim);
        assert_eq!(
            kept,
            living_until(completion.clone(), later_claim.expires_at())
        );
        // The other way round: the file's completion settles the store's
        // claim.
        let kept = after(&stored(&later_claim), &completion);
        assert_eq!(kept, living_until(completion, later_claim.expires_at()));
    }

    #[test]
    fn merge_keeps_the_later_of_two_of_a_kind() {
        let (first, second) = (done(T, 201), done(T + HOUR, 202));
        assert_eq!(after(&stored(&first), &second), second);
        assert_eq!(after(&stored(&second), &first), second);
        let (first, second) = (claim(T), claim(T + HOUR));
        assert_eq!(after(&stored(&first), &second), second);
        assert_eq!(after(&stored(&second), &first), second);
    }

    #[test]
    fn merge_drops_an_earlier_use_of_the_key_that_expired_before_the_other_began() {
        // The file kept a completion past its expiry; the key was used
        // again since, and its claim's request may have run: replaying
        // the old answer to it would hide that.
        let old = done(T, 201);
        let again = claim(old.expires_at() + HOUR);
        assert_eq!(after(&stored(&again), &old), again);
        assert_eq!(after(&stored(&old), &again), again);
    }

    #[test]
    fn merge_keeps_a_value_that_does_not_decode_from_either_side() {
        let record = done(T, 201);
        let garbage = b"\xffnot a record".to_vec();
        match merge(&stored(&record), &garbage) {
            Merge::Write(value) => {
                assert_eq!(expiry_of(&value), Some(UnixMillis::MAX));
                assert_eq!(record_bytes(&value), Ok(&garbage[..]));
            }
            Merge::Keep => panic!("the unreadable record is dropped"),
        }
        assert_eq!(
            merge(&wrap(UnixMillis::MAX, &garbage), &record.encode()),
            Merge::Keep
        );
    }

    #[test]
    fn a_marker_from_before_identities_names_no_file() {
        let identity = [7; 32];
        assert_eq!(marked_identity(&marker(3, &identity)), Some(identity));
        assert_eq!(marked_identity(&3u64.to_be_bytes()), None);
    }

    fn write_redb(path: &Path, records: &[([u8; 32], Record)]) {
        let db = redb::Database::create(path).expect("create redb");
        let txn = db.begin_write().expect("begin");
        {
            let mut table = txn.open_table(REDB_RECORDS).expect("table");
            for (key, record) in records {
                table.insert(key, &record.encode()[..]).expect("insert");
            }
        }
        txn.commit().expect("commit");
    }

    fn open(dir: &Path) -> (Database, Keyspace) {
        let filters = Arc::new(ExpiryFilters(Horizon::default()));
        database::open(&dir.join(DATA_DIR), filters).expect("open")
    }

    #[test]
    fn a_marker_without_identity_copies_again_and_the_same_file_is_then_only_moved() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (file, aside) = (
            dir.path().join(REDB_FILE_NAME),
            dir.path().join(MIGRATED_FILE_NAME),
        );
        let record = done(T, 201);
        write_redb(&file, &[([1; 32], record.clone())]);
        let (db, records) = open(dir.path());
        let migrate = || from_redb(dir.path(), &db, &records, &mut |_| {}).expect("migrate");
        let once = Some(Migrated {
            records: 1,
            unreadable: 0,
        });
        assert_eq!(migrate(), once);

        // What a build before identities left, had it died before the
        // rename: its marker, and the file where it was.
        let meta = db
            .keyspace(META_KEYSPACE, KeyspaceCreateOptions::default)
            .expect("meta");
        meta.insert(MIGRATED_KEY, 1u64.to_be_bytes())
            .expect("marker");
        fs::rename(&aside, &file).expect("put back");
        assert_eq!(migrate(), once, "copied again: the marker names no file");
        assert!(!file.exists() && aside.is_file());
        let value = records.get([1; 32]).expect("get").expect("there");
        assert_eq!(record_bytes(&value), Ok(&record.encode()[..]), "unchanged");

        // Now the marker names it: a start that died before the rename.
        fs::rename(&aside, &file).expect("put back");
        assert_eq!(migrate(), None, "the same file is not copied again");
        assert!(!file.exists() && aside.is_file());
        assert!(!dir.path().join(format!("{MIGRATED_FILE_NAME}.1")).exists());
    }
}
