//! Moving an earlier version's data (one redb file, `idemproxy.redb`, in
//! the same directory) into the LSM tree: on the first open
//! ([`super::EmbeddedStore::open`], which `idemproxy store migrate` runs
//! too).
//!
//! Every record is copied, whatever its state: completed, pending (a claim
//! whose request may have run: it must still be found, to fail closed),
//! expired (harmless: it reads as absent and is purged) or unreadable (an
//! operator's to see and remove, never to lose in silence). The copy is
//! persisted, with a marker saying it is whole, before the redb file is
//! renamed out of the way; a crash at any point leaves either the redb
//! file to copy again (the copy overwrites its own earlier attempt) or a
//! whole copy.

use std::path::Path;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use super::tables::{db_error, wrap};
use crate::core::Record;
use crate::store::StoreError;

/// The earlier versions' database file inside the configured directory.
pub const REDB_FILE_NAME: &str = "idemproxy.redb";

/// What the redb file is renamed to once its records are copied: kept for
/// the operator to delete (or to go back to an earlier version with).
pub const MIGRATED_FILE_NAME: &str = "idemproxy.redb.migrated";

/// The redb table of records in earlier versions (key: `&[u8; 32]`,
/// value: [`Record::encode`] bytes).
const REDB_RECORDS: TableDefinition<'static, &[u8; 32], &[u8]> = TableDefinition::new("records");

/// The keyspace of the store's own facts (not records): here, that a
/// migration completed.
const META_KEYSPACE: &str = "meta";
const MIGRATED_KEY: &[u8] = b"migrated-from-redb";

/// Records copied per persisted batch.
const COPY_BATCH: usize = 4096;

/// What a migration did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Migrated {
    /// Records copied from the redb file.
    pub records: u64,
    /// Of those, records whose bytes do not decode: copied as they are, to
    /// be listed as unreadable (and requests with their keys refused).
    pub unreadable: u64,
}

/// Copies the records of the redb file in `dir`, if there is one, into
/// `records`, telling `copied` of each batch persisted (how many records
/// it held: an operator's progress); `None` when there was nothing to
/// migrate.
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
    let migrated = if meta.get(MIGRATED_KEY).map_err(db_error)?.is_some() {
        // Copied whole by a start that died before the rename below.
        None
    } else {
        let migrated = copy(&file, db, records, copied)?;
        let mut done = db.batch().durability(Some(PersistMode::SyncAll));
        done.insert(&meta, MIGRATED_KEY, migrated.records.to_be_bytes());
        done.commit().map_err(db_error)?;
        tracing::info!(
            file = %file.display(),
            records = migrated.records,
            unreadable = migrated.unreadable,
            "migrated the embedded store from redb"
        );
        Some(migrated)
    };
    std::fs::rename(&file, dir.join(MIGRATED_FILE_NAME)).map_err(|e| {
        StoreError::Unavailable(format!(
            "cannot rename {} once migrated: {e}",
            file.display()
        ))
    })?;
    Ok(migrated)
}

fn copy(
    file: &Path,
    db: &Database,
    records: &Keyspace,
    copied: &mut dyn FnMut(u64),
) -> Result<Migrated, StoreError> {
    let unavailable = |e: &dyn std::fmt::Display| {
        StoreError::Unavailable(format!("cannot migrate {}: {e}", file.display()))
    };
    let old = redb::Database::open(file).map_err(|e| unavailable(&e))?;
    let txn = old.begin_read().map_err(|e| unavailable(&e))?;
    let table = match txn.open_table(REDB_RECORDS) {
        Ok(table) => table,
        // A file created but never written to.
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Migrated::default()),
        Err(e) => return Err(unavailable(&e)),
    };
    let mut migrated = Migrated::default();
    let mut batch = db.batch().durability(Some(PersistMode::SyncAll));
    for entry in table.iter().map_err(|e| unavailable(&e))? {
        let (key, value) = entry.map_err(|e| unavailable(&e))?;
        let bytes = value.value();
        // One that does not decode never expires by itself: it stays
        // until an operator removes it, as it did in the redb file.
        let expires_at = match Record::decode(bytes) {
            Ok(record) => record.expires_at(),
            Err(_) => {
                migrated.unreadable += 1;
                u64::MAX
            }
        };
        batch.insert(records, *key.value(), wrap(expires_at, bytes));
        migrated.records += 1;
        if batch.len() >= COPY_BATCH {
            let full = std::mem::replace(
                &mut batch,
                db.batch().durability(Some(PersistMode::SyncAll)),
            );
            let held = full.len() as u64;
            full.commit().map_err(db_error)?;
            copied(held);
        }
    }
    let held = batch.len() as u64;
    batch.commit().map_err(db_error)?;
    copied(held);
    Ok(migrated)
}
