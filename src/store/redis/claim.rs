//! The commands of `begin`: claim a free key in one `SET … NX GET`, or
//! swap what was read for what was decided, and the decision on a record
//! read back.

use bytes::Bytes;
use redis::Cmd;

use super::connections::Conn;
use super::value::{pexpire_ms, stored, stored_pending};
use super::{redis_error, ScriptCall, SCRIPTS};
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
    let value = stored_pending(claim);
    // "SET", the key, the value, "NX", "GET", "PX" and its digits: sized
    // at once, as a `redis::cmd` grows its buffers from empty.
    let mut set = Cmd::with_capacity(7, 32 + key.len() + value.len());
    set.arg("SET")
        .arg(key)
        .arg(&value[..])
        .arg("NX")
        .arg("GET")
        .arg("PX")
        .arg(pexpire_ms(claim.expires_at, now));
    let current: Option<Vec<u8>> = set.query_async(conn).await.map_err(redis_error)?;
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
    let replacement_value = stored(replacement);
    let mut call = ScriptCall::new(
        &SCRIPTS.swap,
        key,
        3,
        20 + current.len() + replacement_value.len(),
    );
    call.arg(current)
        .arg(&replacement_value[..])
        .arg(pexpire_ms(replacement.expires_at(), now));
    let swapped: i64 = call.run(conn).await.map_err(redis_error)?;
    Ok(swapped == 1)
}
