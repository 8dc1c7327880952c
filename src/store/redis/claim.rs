//! The commands of `begin`: claim a free key in one `SET … NX GET`, or
//! swap what was read for what was decided, and the decision on a record
//! read back.

use bytes::Bytes;

use super::connections::Conn;
use super::value::{pexpire_ms, stored, stored_pending};
use super::{redis_error, SCRIPTS};
use crate::core::{PendingRecord, Record, UnixMillis};
use crate::store::StoreError;

/// `SET key claim NX GET PX …`: writes `claim` if the key is free (`None`),
/// else leaves the key alone and returns what it holds.
pub(super) async fn claim_unless_held(
    conn: &mut Conn,
    key: &str,
    claim: &PendingRecord,
    now: UnixMillis,
) -> Result<Option<Bytes>, StoreError> {
    let current: Option<Vec<u8>> = redis::cmd("SET")
        .arg(key)
        .arg(stored_pending(claim))
        .arg("NX")
        .arg("GET")
        .arg("PX")
        .arg(pexpire_ms(claim.expires_at, now))
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    Ok(current.map(Bytes::from))
}

/// `swap.lua`: replaces the key's value with `replacement` only if it still
/// holds `current`, what `begin` read and decided on. False when another
/// writer changed it in between.
pub(super) async fn swap(
    conn: &mut Conn,
    key: &str,
    current: &[u8],
    replacement: &Record,
    now: UnixMillis,
) -> Result<bool, StoreError> {
    let swapped: i64 = SCRIPTS
        .swap
        .key(key)
        .arg(current)
        .arg(stored(replacement))
        .arg(pexpire_ms(replacement.expires_at(), now))
        .invoke_async(conn)
        .await
        .map_err(redis_error)?;
    Ok(swapped == 1)
}
