//! Redis and Redis Cluster stores: many proxy replicas share one Redis (or
//! one cluster), so a key claimed through one replica is seen by all.
//!
//! # Layout
//!
//! One Redis STRING per record, under `<key_prefix>{<hex of the RecordKey>}`.
//! The braces are a cluster hash tag: the slot is computed from the record
//! key alone, and since every command and script touches exactly that one
//! key, the same code runs unchanged on a standalone Redis and on a Redis
//! Cluster (no CROSSSLOT, no multi-key transactions).
//!
//! The value is a 25-byte header, then the [`Record::encode`] bytes (the
//! versioned record itself):
//!
//! | bytes  | holds                                                          |
//! |--------|----------------------------------------------------------------|
//! | 0      | `p` a pending claim, `c` a completed record                    |
//! | 1..17  | the claim's fencing token, big-endian (zero when completed)    |
//! | 17..25 | `expires_at`, Unix ms, big-endian                              |
//!
//! The header repeats what the record says, so that the scripts can check a
//! fencing token and an expiry without decoding records; they never parse
//! the rest, so the record format can evolve in Rust alone. Reading a value
//! back checks that the two agree.
//!
//! Development builds before this layout kept a HASH per record; for a key
//! still holding one, Redis answers `WRONGTYPE`, which surfaces as a corrupt
//! record (fail closed: nothing executes) until it expires or an operator
//! removes it.
//!
//! # One round trip per state change
//!
//! - `begin` is one `SET key claim NX GET PX lease+ttl` (Redis 7.0 or later):
//!   it claims a free key, and otherwise leaves the key alone and returns
//!   what it holds, which the proxy decides on with
//!   [`decide_begin`](crate::core::decide_begin), like every store. No script
//!   runs, so a replay costs Redis one plain command. Only when the answer
//!   is a record to replace (expired by the proxies' clock, or a claim whose
//!   holder died) does a second call follow: `swap.lua` replaces the value
//!   only if it is still exactly what was read, else `begin` starts over.
//! - `complete` and `release` are one `EVALSHA` of `settle.lua` each, with
//!   the fencing-token check inside the script.
//! - `get` is one `GET`, `ping` one `PING`. A forced `remove` is one
//!   `GETDEL`; the guarded one (the admin API's `DELETE` without
//!   `?force=true`) is a `GET`, then `remove.lua`, which deletes the value
//!   only if it is still exactly what was read and found to be no running
//!   claim.
//!
//! Scripts are preloaded at connect, so the first call does not pay for a
//! `NOSCRIPT` retry; after a Redis restart a call that meets `NOSCRIPT`
//! loads its script and sends it once more ([`ScriptCall`]).
//!
//! # Clocks
//!
//! Every instant compared (`now`, leases, expiries) comes from the calling
//! proxy's clock ([`Clock`]), never from Redis's, so the decisions
//! are exactly those of `decide_begin`. The assumption is that the
//! proxies sharing a Redis keep their clocks in step (NTP): a proxy whose
//! clock runs S ahead presumes a holder dead S early (and settles or takes
//! over its key S early), one running behind presumes it S late. Keep skew
//! well under the lease margin. Redis's own clock only decides when it
//! reclaims memory: keys get a relative `PX` of `expires_at - now`, so
//! proxy/Redis skew does not shift that either.
//!
//! # Expiry
//!
//! A completed record lives until completion + ttl. A pending claim lives
//! until lease + ttl, not just its lease: if it vanished with its lease, a
//! retry after the holder died would find the key absent and execute again;
//! kept, it is found stale and settled fail-closed (`on_stale = "store"`).
//!
//! # Durability
//!
//! At most once holds as long as Redis keeps what it acknowledged: run it
//! with `appendonly yes`. Replication is asynchronous, so a failover can lose
//! the last writes (a claim, a completion) and let a retry execute again.
//!
//! # Failures
//!
//! Single node: a [`ConnectionManager`](redis::aio::ConnectionManager) (a
//! multiplexed connection; it reconnects by itself). Cluster: the async
//! cluster connection (one multiplexed connection per node). Each traffic
//! worker gets connections of its own, opened on its event loop (see
//! [`LoopConnections`]); everything else shares
//! the connections opened at startup. Connection attempts and
//! responses have timeouts of their own, so nothing waits forever even
//! without the caller's `store.timeout`; a dead Redis surfaces as
//! [`StoreError::Unavailable`] and the store recovers when Redis returns.
//! A value that is not a record this build can read surfaces as
//! [`StoreError::Corrupt`].

mod claim;
mod connect;
mod connections;
mod removals;
mod remove;
mod sentinel;
mod value;
mod walk;

pub use connect::{check_url, redact_url};

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{
    Cmd, ErrorKind, FromRedisValue, RedisError, Script, ServerErrorKind, ToRedisArgs, Value,
};

use self::claim::{claim_unless_held, swap};
use self::connections::{Conn, LoopConnections};
use self::removals::RemovalChannel;
use self::value::{
    claim_id, pexpire_ms, read_stored, stored_completed, unexpected, Reply, CLAIM_ID_LEN,
};
use super::settings::{StoreKind, StoreSettings};
use super::RemovalWatcher;
use super::{
    busy_key, decide_read, note_takeover, Begin, BeginOutcome, ListPage, ListWant, Removal,
    Removed, ScanCursor, ScanPage, SharedStore, Store, StoreError,
};
use crate::core::{
    new_claim, settled_back, Clock, CompletedRecord, FencingToken, Record, RecordKey,
};

struct Scripts {
    settle: Script,
    swap: Script,
    remove: Script,
    remove_foreign: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    settle: Script::new(include_str!("settle.lua")),
    swap: Script::new(include_str!("swap.lua")),
    remove: Script::new(include_str!("remove.lua")),
    remove_foreign: Script::new(include_str!("remove_foreign.lua")),
});

/// One `EVALSHA` of a script on one key, built as a plain command sized
/// at once. A [`redis::ScriptInvocation`] copies every argument into a
/// vector of its own before copying them all into the command it sends,
/// whose buffers grow from empty: a completion's record (a kilobyte or
/// more) was copied once more, in one more allocation, and the command
/// reallocated on the way.
struct ScriptCall<'a> {
    script: &'a Script,
    cmd: Cmd,
}

impl<'a> ScriptCall<'a> {
    /// `EVALSHA` of `script` on `key`, with room for `args` arguments of
    /// `args_len` bytes in all after it (more only costs a reallocation).
    fn new(script: &'a Script, key: &str, args: usize, args_len: usize) -> Self {
        let hash = script.get_hash();
        // "EVALSHA", the hash, the key count "1", the key.
        let mut cmd = Cmd::with_capacity(4 + args, 8 + hash.len() + key.len() + args_len);
        cmd.arg("EVALSHA").arg(hash).arg(1).arg(key);
        Self { script, cmd }
    }

    fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// Runs the script. A Redis that has lost its scripts (a restart, a
    /// failover to a replica that never loaded them, `SCRIPT FLUSH`)
    /// answers `NOSCRIPT`: the script is loaded and sent once more, as
    /// [`redis::ScriptInvocation::invoke_async`] does.
    async fn run<T: FromRedisValue>(&self, conn: &mut Conn) -> Result<T, RedisError> {
        match self.cmd.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.script.load_async(conn).await?;
                self.cmd.query_async(conn).await
            }
            answered => answered,
        }
    }
}

/// Reads of a key that a guarded removal makes before it gives up: each
/// one after the first follows a value that changed under `remove.lua`.
const REMOVE_ATTEMPTS: usize = 5;

/// How many times `begin` reads a key, each read after the first following
/// a `swap` that found it changed. Each change means another proxy wrote the
/// key in between, which then holds a fresh claim or a completion, so a
/// second read practically always settles it; the bound only keeps a
/// pathological loop finite, and a key that would still need a write at the
/// last read is answered as in flight.
const BEGIN_ATTEMPTS: usize = 5;

/// The Redis key of `key` under `prefix`: `<prefix>{<hex>}`. The hash tag
/// (the part in braces) makes the cluster slot depend on the record key only.
pub fn redis_key(prefix: &str, key: &RecordKey) -> String {
    // Built by hand: `format!` would grow the string on the way, and every
    // store call names its key.
    let hex = key.hex();
    let mut name = String::with_capacity(prefix.len() + hex.as_str().len() + 2);
    name.push_str(prefix);
    name.push('{');
    name.push_str(hex.as_str());
    name.push('}');
    name
}

/// How long [`open`] waits for a Redis that is not up yet.
pub const STARTUP_WAIT: Duration = Duration::from_secs(30);

/// Opens the store `config.kind` names (`redis` or `redis-cluster`), waiting
/// up to [`STARTUP_WAIT`] for a Redis that refuses connections, does not
/// answer or is still loading its data (as after a restart with a large
/// append-only file), instead of exiting into a restart loop that backs off
/// longer each time. Anything else (credentials, TLS, configuration) fails
/// at once.
pub async fn open(config: &StoreSettings) -> Result<SharedStore, StoreError> {
    open_within(config, STARTUP_WAIT).await
}

/// [`open`] with another bound on the wait.
pub async fn open_within(
    config: &StoreSettings,
    wait: Duration,
) -> Result<SharedStore, StoreError> {
    Ok(std::sync::Arc::new(match config.kind {
        StoreKind::RedisCluster => RedisStore::connect_cluster_within(config, wait).await?,
        StoreKind::RedisSentinel if !config.sentinels.is_empty() => {
            RedisStore::connect_sentinel_within(config, wait).await?
        }
        _ => RedisStore::connect_within(config, wait).await?,
    }))
}

/// A [`Store`] in Redis (`kind = "redis"`) or a Redis Cluster
/// (`kind = "redis-cluster"`). See the module docs for the layout.
#[derive(Clone)]
pub struct RedisStore {
    /// Opened at startup; used by calls from outside the traffic workers and
    /// by a worker until its own connection is open.
    shared: Conn,
    loops: Arc<LoopConnections>,
    /// Where `remove` tells other replicas' caches (see [`removals`]).
    removals: Arc<RemovalChannel>,
    prefix: String,
    kind: &'static str,
    /// Where leases and expiry read the time (Redis's own expiry of a key
    /// runs on Redis's clock, from the relative `PX` this computes).
    clock: Clock,
    /// Replicas that must hold a claim or a completion before it counts
    /// (`WAIT`), and how long to wait for them; 0 = do not wait.
    min_replica_acks: u32,
    replica_ack_timeout: Duration,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("kind", &self.kind)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// The connection for a call from the current task (see
    /// [`LoopConnections`]).
    fn conn(&self) -> Conn {
        self.loops.current().unwrap_or_else(|| self.shared.clone())
    }

    /// Reads the time from `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The prefix of every key this store writes.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key holding `key`'s record.
    pub fn redis_key(&self, key: &RecordKey) -> String {
        redis_key(&self.prefix, key)
    }

    /// Waits until `min_replica_acks` replicas hold this connection's
    /// writes so far (`WAIT`: Redis answers how many do once that many do,
    /// or when `replica_ack_timeout` is up). On a cluster `WAIT` goes to
    /// the primary that owns `key`, over the connection the write took.
    /// A connection that reconnected in between has no writes to wait
    /// for and is answered at once: the window is one reconnect.
    async fn replicated(&self, conn: &mut Conn, key: &str) -> Result<(), StoreError> {
        let wanted = self.min_replica_acks;
        if wanted == 0 {
            return Ok(());
        }
        let timeout_ms = u64::try_from(self.replica_ack_timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut wait = redis::cmd("WAIT");
        wait.arg(wanted).arg(timeout_ms);
        let acked: i64 = match conn {
            Conn::Cluster(cluster) => {
                let route = Route::with_key(key.as_bytes(), SlotAddr::Master);
                let reply = cluster
                    .route_command(
                        wait,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await
                    .map_err(redis_error)?;
                redis::from_redis_value(reply)
                    .map_err(|e| StoreError::Unavailable(format!("WAIT: {e}")))?
            }
            other => wait.query_async(other).await.map_err(redis_error)?,
        };
        if acked >= i64::from(wanted) {
            return Ok(());
        }
        Err(StoreError::Unavailable(format!(
            "{acked} of {wanted} replicas acknowledged the write within {:?} (min_replica_acks)",
            self.replica_ack_timeout
        )))
    }

    /// Releases a claim whose replicas did not acknowledge it, and says
    /// why the request is refused. The release is fenced by the claim's
    /// token, and a failed one is retried by the caller's own release of
    /// an unanswered claim.
    async fn unacknowledged_claim(
        &self,
        key: &RecordKey,
        token: FencingToken,
        why: StoreError,
    ) -> StoreError {
        if let Err(e) = self.settle(key, token, None).await {
            tracing::warn!(key = %key.to_hex(), error = %e, "cannot release a claim its replicas did not acknowledge");
        }
        why
    }

    /// Lets go of what a swap that its replicas did not acknowledge wrote
    /// (`outcome`, for `begin`), and says why the request is refused. A
    /// claim is released, as [`Self::unacknowledged_claim`] does, unless
    /// it took over an unknown outcome to reconcile it: that one is
    /// settled back to `outcome-unknown`. Released, it would free a key
    /// whose request may have run, and its next retry would execute with
    /// no lookup. A failed write is retried by the caller's letting go of
    /// an unanswered claim, which settles it back the same way.
    async fn unacknowledged_swap(
        &self,
        begin: &Begin,
        outcome: &BeginOutcome,
        why: StoreError,
    ) -> StoreError {
        let cause = match outcome {
            BeginOutcome::Acquired {
                reconcile: Some(cause),
                ..
            } => *cause,
            BeginOutcome::Acquired { .. } => {
                return self
                    .unacknowledged_claim(&begin.key, begin.token, why)
                    .await
            }
            // A settled stale claim: nothing of this request's to let go.
            _ => return why,
        };
        let unknown = settled_back(begin, self.clock.now_millis(), cause);
        if let Err(e) = self.settle(&begin.key, begin.token, Some(&unknown)).await {
            tracing::warn!(key = %begin.key.to_hex(), error = %e, "cannot settle back a takeover its replicas did not acknowledge");
        }
        why
    }

    async fn settle(
        &self,
        key: &RecordKey,
        token: FencingToken,
        completed: Option<&CompletedRecord>,
    ) -> Result<(), StoreError> {
        self.settle_on(&mut self.conn(), &self.redis_key(key), token, completed)
            .await
    }

    /// [`Self::settle`] of the Redis key `name` over `conn`, which a `WAIT`
    /// after it must share.
    async fn settle_on(
        &self,
        conn: &mut Conn,
        name: &str,
        token: FencingToken,
        completed: Option<&CompletedRecord>,
    ) -> Result<(), StoreError> {
        let now = self.clock.now_millis();
        let settled =
            completed.map(|done| (stored_completed(done), pexpire_ms(done.expires_at, now)));
        // now and the PX: at most 20 digits each.
        let args_len = 40 + CLAIM_ID_LEN + settled.as_ref().map_or(0, |(value, _)| value.len());
        let mut call = ScriptCall::new(&SCRIPTS.settle, name, 4, args_len);
        call.arg(now).arg(&claim_id(b'p', token.0)[..]);
        match &settled {
            Some((value, px)) => call.arg(&value[..]).arg(*px),
            None => call.arg("").arg(0),
        };
        let reply: Value = call.run(conn).await.map_err(redis_error)?;
        match reply {
            Value::Int(1) => Ok(()),
            Value::Int(0) => Err(StoreError::Fenced),
            other => {
                let mut reply = Reply::new(other)?;
                match reply.status.as_str() {
                    "corrupt" => Err(reply.corrupt()),
                    other => Err(unexpected(other)),
                }
            }
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        let key = self.redis_key(&begin.key);
        let mut conn = self.conn();
        // The request's token, for every claim this call writes, its
        // takeovers included. The cluster client sends a command again when
        // the connection broke before its reply came, so a `SET` or a
        // `swap` that did run can come back as a failure, and the next read
        // then finds this call's own claim: without the token to recognise
        // it, the request got 425 for its own claim, nobody held the key,
        // and it settled as `outcome-unknown` once the lease ran out, though
        // nothing had been sent upstream.
        let token = begin.token;
        // Whether a takeover was written: the claim read back came from it
        // then (or, after a failed one, from a later `SET`: the claim is
        // this call's either way; `took_over` only feeds a metric).
        let mut took_over = false;
        // Likewise whether a takeover to reconcile was written (and the
        // cause it settles with if the lookup fails): a claim of this
        // call's read back after it must still look the outcome up before
        // executing, or a lost swap reply would execute a second time.
        let mut reconcile = None;
        for attempt in 1..=BEGIN_ATTEMPTS {
            let now = self.clock.now_millis();
            // The claim to write if the key is free: prepared here, because
            // its token is random and its encoding is Rust's.
            let claim = new_claim(begin, now, token);
            let Some(current) = claim_unless_held(&mut conn, &key, &claim, now).await? else {
                if let Err(why) = self.replicated(&mut conn, &key).await {
                    return Err(self.unacknowledged_claim(&begin.key, token, why).await);
                }
                return Ok(BeginOutcome::Acquired {
                    token: claim.token,
                    took_over: false,
                    reconcile: None,
                });
            };
            let existing = read_stored(&current)?;
            let (outcome, replacement) = decide_read(begin, existing, now, took_over, reconcile);
            let Some(replacement) = replacement else {
                return Ok(outcome);
            };
            if attempt == BEGIN_ATTEMPTS {
                break;
            }
            note_takeover(&outcome, &mut took_over, &mut reconcile);
            if swap(&mut conn, &key, &current, &replacement, now).await? {
                if let Err(why) = self.replicated(&mut conn, &key).await {
                    return Err(self.unacknowledged_swap(begin, &outcome, why).await);
                }
                return Ok(outcome);
            }
        }
        // Another writer changed the key under every swap: it is busy, not
        // the store. `Unavailable` would let `on_store_error = "pass"`
        // forward a request whose key others are claiming; in flight sends
        // it back (425, or another look under `on_in_flight = "wait"`). The
        // last read already decided what needs no write: this call's own
        // claim (a swap whose answer was lost, sent again by the cluster
        // client, finds its own value and reports a change), a completion,
        // another request's live claim, a different request.
        Ok(busy_key(
            &begin.key,
            BEGIN_ATTEMPTS - 1,
            self.clock.now_millis(),
        ))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        let (mut conn, name) = (self.conn(), self.redis_key(key));
        self.settle_on(&mut conn, &name, token, Some(record))
            .await?;
        // The caller retries a completion that fails here: `settle.lua`
        // finds its own write and the replicas are asked again.
        self.replicated(&mut conn, &name).await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.settle(key, token, None).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let now = self.clock.now_millis();
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(self.redis_key(key))
            .query_async(&mut self.conn())
            .await
            .map_err(redis_error)?;
        let Some(value) = value else {
            return Ok(None);
        };
        let record = read_stored(&Bytes::from(value))?;
        // Expired by this proxy's clock, whether or not Redis reclaimed it.
        Ok((record.expires_at() > now).then_some(record))
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        // In a task of its own: a caller that stops waiting (the admin
        // API's timeout) once Redis has deleted the record must not cancel
        // the announcement after it, or the other replicas' caches would
        // replay the record for up to a minute.
        let (store, key) = (self.clone(), *key);
        tokio::spawn(async move { store.remove_and_announce(&key, removal).await })
            .await
            .map_err(|e| StoreError::Unavailable(format!("remove: {e}")))?
    }

    fn watch_removals(&self, invalidator: Arc<dyn RemovalWatcher>) {
        self.removals.follow(invalidator);
    }

    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        self.list_page(cursor, want).await
    }

    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        self.scan_page(cursor, count).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        redis::cmd("PING")
            .query_async::<()>(&mut self.conn())
            .await
            .map_err(redis_error)
    }

    fn kind(&self) -> &'static str {
        self.kind
    }
}

/// A failed command. A value of the wrong type under a record key (for the
/// plain commands; scripts report it themselves) is corrupt data; anything
/// else means the store cannot serve: unreachable, timed out, out of memory,
/// not allowed, in a failover.
fn redis_error(e: RedisError) -> StoreError {
    if e.code() == Some("WRONGTYPE") {
        StoreError::Corrupt(format!(
            "the key holds no record string (a hash is an earlier build's layout): {e}"
        ))
    } else {
        StoreError::Unavailable(format!("redis: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::now_millis;
    use crate::core::Fingerprint;

    #[test]
    fn a_claim_of_this_begin_read_back_is_acquired_not_in_flight() {
        let begin = Begin {
            key: RecordKey::from_bytes([1; 32]),
            fingerprint: Fingerprint([1; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            on_stale: crate::store::OnStale::Store,
            token: FencingToken(7),
            reconcile: false,
        };
        let now = now_millis();
        let claimed = |token| Record::Pending(new_claim(&begin, now, FencingToken(token)));
        // The `SET` ran, its reply was lost, the one sent again read it.
        // A takeover to reconcile read back so must still look the outcome
        // up before executing.
        let reconciling = [None, Some(crate::core::UnknownCause::Abandoned)];
        for (took_over, reconcile) in [false, true].into_iter().zip(reconciling) {
            assert_eq!(
                decide_read(&begin, claimed(7), now, took_over, reconcile),
                (
                    BeginOutcome::Acquired {
                        token: FencingToken(7),
                        took_over,
                        reconcile,
                    },
                    None
                )
            );
        }
        // Anyone else's live claim is theirs.
        assert!(matches!(
            decide_read(&begin, claimed(8), now, false, None),
            (BeginOutcome::InFlight { .. }, None)
        ));
    }

    #[test]
    fn keys_carry_the_record_key_as_hash_tag() {
        let key = RecordKey::from_bytes([0xab; 32]);
        assert_eq!(
            redis_key("idemproxy:", &key),
            format!("idemproxy:{{{}}}", "ab".repeat(32))
        );
    }
}
