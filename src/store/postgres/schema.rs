//! The store's tables, created and migrated on start: numbered migrations,
//! each applied once, in order, recorded in `<prefix>schema_migrations`,
//! under a transaction-scoped advisory lock so that proxies starting
//! together migrate one at a time.

use std::time::Duration;

use tokio_postgres::Client;

use super::conn::setting_millis;
use super::pg_error;
use crate::store::StoreError;

/// How long a migration waits for a lock (the advisory lock while another
/// proxy migrates, a table's lock for its DDL) before startup fails and
/// says so. The connection's own limit is a request's (`store.timeout`),
/// far too short for a proxy waiting its turn; none at all would let a DDL
/// queued behind a long transaction on the table hold up every request
/// queued behind it for as long. The same bound as waiting for the
/// database to come up (`connect::STARTUP_WAIT`).
const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// The advisory lock every proxy's migration takes first (an arbitrary
/// constant: `hashtext` of the prefix would be one per prefix, but
/// CockroachDB has no `hashtext`, and migrations are rare and short).
const MIGRATION_LOCK: i64 = 0x6964_656d_7078_7931;

/// `{p}` stands for the table prefix. Never edit one that shipped: add the
/// next.
const MIGRATIONS: &[&str] = &[
    // 1. One row per record. `pending`, `token`, `lease_expires_at` and
    // `expires_at` repeat what the record says so the statements can fence
    // and expire without decoding `value` (the `Record::encode` bytes,
    // which evolve in Rust alone). `expires_at` is indexed for the sweep.
    "CREATE TABLE {p}records (
        key bytea PRIMARY KEY,
        pending boolean NOT NULL,
        token bytea NOT NULL,
        lease_expires_at bigint NOT NULL,
        expires_at bigint NOT NULL,
        value bytea NOT NULL
    );
    CREATE INDEX {p}records_expires_at ON {p}records (expires_at);",
];

/// Whether `prefix` may stand in front of table names unquoted.
pub(super) fn check_prefix(prefix: &str) -> Result<(), String> {
    let starts_well = prefix
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let only_allowed = prefix
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    // 63 is PostgreSQL's identifier limit; the longest suffix is 26.
    if starts_well && only_allowed && prefix.len() <= 36 {
        Ok(())
    } else {
        Err(format!(
            "store.table_prefix: {prefix:?} must be 1 to 36 lowercase letters, digits or `_`, \
             not starting with a digit"
        ))
    }
}

/// Brings the tables under `prefix` to the latest version this build
/// knows; refuses a database migrated by a newer build.
pub(super) async fn migrate(client: &mut Client, prefix: &str) -> Result<(), StoreError> {
    let tx = client.transaction().await.map_err(pg_error)?;
    // No statement limit: a migration's work grows with the table (an
    // index built over it), and one cut off halfway only fails again at
    // every start. Both last as long as the transaction (`SET LOCAL`).
    tx.batch_execute(&format!(
        "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = {}",
        setting_millis(MIGRATION_LOCK_TIMEOUT)
    ))
    .await
    .map_err(pg_error)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(pg_error)?;
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {prefix}schema_migrations (
            version integer PRIMARY KEY,
            applied_at timestamptz NOT NULL DEFAULT now()
        )"
    ))
    .await
    .map_err(pg_error)?;
    let current: i32 = tx
        .query_one(
            &format!("SELECT coalesce(max(version), 0) FROM {prefix}schema_migrations"),
            &[],
        )
        .await
        .map_err(pg_error)?
        .get(0);
    let known = MIGRATIONS.len();
    let current = usize::try_from(current).unwrap_or(0);
    if current > known {
        return Err(StoreError::Unavailable(format!(
            "the tables under {prefix:?} are at schema version {current}, newer than this \
             build knows ({known}): run the newer build, or another table_prefix"
        )));
    }
    for (index, migration) in MIGRATIONS.iter().enumerate().skip(current) {
        tx.batch_execute(&migration.replace("{p}", prefix))
            .await
            .map_err(pg_error)?;
        let version = i32::try_from(index + 1).unwrap_or(i32::MAX);
        tx.execute(
            &format!("INSERT INTO {prefix}schema_migrations (version) VALUES ($1)"),
            &[&version],
        )
        .await
        .map_err(pg_error)?;
        tracing::info!(prefix, version, "migrated the PostgreSQL store's tables");
    }
    tx.commit().await.map_err(pg_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_plain_identifiers() {
        for good in ["idemproxy_", "_x", "a1_"] {
            assert!(check_prefix(good).is_ok(), "{good}");
        }
        for bad in ["", "1a", "A", "a-b", "a;drop", "a b", &"a".repeat(37)] {
            assert!(check_prefix(bad).is_err(), "{bad}");
        }
    }
}
