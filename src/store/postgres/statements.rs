//! The store's SQL, one statement per step, each with the table prefix in
//! place (prepared once per connection and cached).

/// Every statement the store runs on its records table.
#[derive(Debug)]
pub(super) struct Statements {
    /// Claims a free key: inserts the claim, or replaces a row that has
    /// expired by the caller's clock (`$6`), in one statement. 0 rows: the
    /// key is held, and [`Self::read`] says by what.
    pub(super) claim: String,
    /// The row a claim did not win, whatever its expiry.
    pub(super) read: String,
    /// Replaces the row only if it still holds what `begin` read and
    /// decided on (`$7`); 0 rows: another writer changed it in between.
    pub(super) swap: String,
    /// Completes the claim held with `$2`, unless it expired (`$5`); or
    /// finds this very completion written before (its reply was lost),
    /// which succeeds again. 0 rows: fenced.
    pub(super) complete: String,
    /// Deletes the claim held with `$2`, unless it expired. 0 rows: fenced.
    pub(super) release: String,
    /// A live row's value.
    pub(super) get: String,
    /// Deletes the row unless it is a running claim and `$2` (force) is
    /// false; returns its expiry.
    pub(super) remove: String,
    /// Whether a row is a running claim, and until when.
    pub(super) lease: String,
    /// Live rows after a key, in key order.
    pub(super) scan: String,
    /// Live rows' fronts (the record metadata), after a key.
    pub(super) list: String,
    /// Deletes up to `$2` rows expired by `$1`, skipping rows another
    /// transaction holds.
    pub(super) sweep: String,
    /// Tells the other proxies' caches of a removal.
    pub(super) notify: String,
    /// The channel removals are announced on.
    pub(super) channel: String,
}

impl Statements {
    pub(super) fn new(prefix: &str) -> Statements {
        let t = format!("{prefix}records");
        Statements {
            claim: format!(
                "INSERT INTO {t} AS r (key, pending, token, lease_expires_at, expires_at, value) \
                 VALUES ($1, true, $2, $3, $4, $5) \
                 ON CONFLICT (key) DO UPDATE SET pending = true, token = excluded.token, \
                 lease_expires_at = excluded.lease_expires_at, \
                 expires_at = excluded.expires_at, value = excluded.value \
                 WHERE r.expires_at <= $6"
            ),
            read: format!("SELECT value FROM {t} WHERE key = $1"),
            swap: format!(
                "UPDATE {t} SET pending = $2, token = $3, lease_expires_at = $4, \
                 expires_at = $5, value = $6 WHERE key = $1 AND value = $7"
            ),
            complete: format!(
                "UPDATE {t} SET pending = false, lease_expires_at = 0, expires_at = $3, \
                 value = $4 WHERE key = $1 \
                 AND ((pending AND token = $2 AND expires_at > $5) OR value = $4)"
            ),
            release: format!(
                "DELETE FROM {t} WHERE key = $1 AND pending AND token = $2 AND expires_at > $3"
            ),
            get: format!("SELECT value FROM {t} WHERE key = $1 AND expires_at > $2"),
            remove: format!(
                "DELETE FROM {t} WHERE key = $1 \
                 AND ($2 OR NOT pending OR lease_expires_at <= $3) RETURNING expires_at"
            ),
            lease: format!("SELECT pending, lease_expires_at FROM {t} WHERE key = $1"),
            scan: format!(
                "SELECT key, value FROM {t} WHERE key > $1 AND expires_at > $2 \
                 ORDER BY key LIMIT $3"
            ),
            list: format!(
                "SELECT key, substring(value FROM 1 FOR $4) FROM {t} \
                 WHERE key > $1 AND expires_at > $2 ORDER BY key LIMIT $3"
            ),
            sweep: format!(
                "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at <= $1 \
                 ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED) AND expires_at <= $1"
            ),
            notify: "SELECT pg_notify($1, $2)".into(),
            channel: format!("{prefix}removed"),
        }
    }
}
