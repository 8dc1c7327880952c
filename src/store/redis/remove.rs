//! Removing a record (the admin API's `DELETE`, the `keys` CLI): a
//! guarded read-then-delete that never takes a running claim unless
//! forced, and the announcement that keeps other replicas' caches from
//! replaying what was removed.

use bytes::Bytes;
use redis::RedisError;

use super::value::{read_stored, stored_expires_at};
use super::{redis_error, RedisStore, ScriptCall, REMOVE_ATTEMPTS, SCRIPTS};
use crate::core::{running_lease, RecordKey};
use crate::store::{Removal, Removed, StoreError};

impl RedisStore {
    /// Tells the other replicas' caches that `key` was removed. The record
    /// is gone whatever happens here, so a failure is logged, not returned:
    /// a replica that missed the message replays from its cache for at
    /// most the cache's `max_age` (an operator who retries the removal
    /// announces it again).
    async fn announce_removal(&self, key: &RecordKey) {
        let published = redis::cmd("PUBLISH")
            .arg(self.removals.name())
            .arg(&key.as_bytes()[..])
            .query_async::<i64>(&mut self.conn())
            .await;
        if let Err(e) = &published {
            tracing::warn!(
                key = %key.hex(),
                error = %e,
                "removed, but other replicas were not told: their local caches may replay it for up to a minute"
            );
        }
    }

    /// Deletes `key`'s record unless `removal` keeps it, and announces the
    /// removal to the other replicas' caches.
    pub(super) async fn remove_and_announce(
        &self,
        key: &RecordKey,
        removal: Removal,
    ) -> Result<Removed, StoreError> {
        let removed = self.delete_read(key, removal).await?;
        // A running claim left in place changed nothing to announce. Any
        // other answer is announced even when nothing was there: a removal
        // whose answer was lost (its caller timed out after the deletion
        // ran) is retried, finds nothing, and must still reach the other
        // replicas' caches.
        if !matches!(removed, Removed::Leased { .. }) {
            self.announce_removal(key).await;
        }
        Ok(removed)
    }

    /// Deletes what the key holds, whatever it is (`Removal::Any`), or
    /// anything but a running claim (`Removal::UnlessLeased`). Either way
    /// the key is read, then deleted only if it still holds what was read
    /// (`remove.lua`): a request that claimed the key after the read keeps
    /// its claim, and a deletion sent again (its connection broke before
    /// the reply) finds the value changed instead of deleting a newer
    /// claim. A key that changed under the script is read again.
    async fn delete_read(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        let name = self.redis_key(key);
        for _ in 0..REMOVE_ATTEMPTS {
            let now = self.clock.now_millis();
            let read: Result<Option<Vec<u8>>, RedisError> = redis::cmd("GET")
                .arg(&name)
                .query_async(&mut self.conn())
                .await;
            let value = match read {
                Ok(None) => return Ok(Removed::Absent),
                Ok(Some(value)) => Bytes::from(value),
                // Not a string, so no record of this store's, nor a claim.
                Err(e) if e.code() == Some("WRONGTYPE") => {
                    if self.delete_foreign(&name).await? {
                        return Ok(Removed::Deleted);
                    }
                    continue;
                }
                Err(e) => return Err(redis_error(e)),
            };
            // A value that does not decode is no running claim: removing it
            // is how an operator clears it.
            let running = read_stored(&value)
                .ok()
                .and_then(|record| running_lease(&record, now));
            if let (Removal::UnlessLeased, Some(until)) = (removal, running) {
                return Ok(Removed::Leased { until });
            }
            let deleted: i64 = ScriptCall::new(&SCRIPTS.remove, &name, 1, value.len())
                .arg(&value[..])
                .run(&mut self.conn())
                .await
                .map_err(redis_error)?;
            if deleted == 1 {
                // A value without a readable expiry counts as live.
                return Ok(if stored_expires_at(&value).is_none_or(|exp| exp > now) {
                    Removed::Deleted
                } else {
                    Removed::Absent
                });
            }
        }
        Err(StoreError::Unavailable(format!(
            "the key changed under each of {REMOVE_ATTEMPTS} attempts to remove it: it is in use, try again"
        )))
    }

    /// Deletes a key that holds no string (a hash of an earlier build, or
    /// anything else) if it still holds none (`remove_foreign.lua`): a
    /// claim written since it was read is a string, and is left alone.
    async fn delete_foreign(&self, name: &str) -> Result<bool, StoreError> {
        let deleted: i64 = ScriptCall::new(&SCRIPTS.remove_foreign, name, 0, 0)
            .run(&mut self.conn())
            .await
            .map_err(redis_error)?;
        Ok(deleted == 1)
    }
}
