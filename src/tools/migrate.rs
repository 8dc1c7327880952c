//! `idemproxy store migrate`: opens the embedded store, which copies an
//! earlier version's redb file into it (see
//! [`migrate`](crate::store::embedded::migrate)), showing how far the copy
//! has come as any long walk does ([`super::progress`]).

use std::path::Path;

use super::progress::Progress;
use crate::store::embedded::migrate::Migrated;
use crate::store::{EmbeddedStore, StoreError};

/// Migrates the embedded store in `dir`: what it copied, or `None` when
/// there was nothing to migrate.
pub fn migrate_embedded(dir: &Path) -> Result<Option<Migrated>, StoreError> {
    let mut progress = Progress::new("store migrate");
    let mut copied = 0;
    let store = EmbeddedStore::open_reporting(dir, &mut |records| {
        copied += records;
        progress.advance(records, format_args!("{copied} copied"));
    })?;
    let migrated = store.migrated();
    if migrated.is_some() {
        progress.finish();
    }
    Ok(migrated)
}
