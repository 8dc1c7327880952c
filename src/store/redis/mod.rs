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
//!   [`decide_begin`](super::decide_begin), like every store. No script
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
//! `NOSCRIPT` retry; after a Redis restart [`redis::Script`] reloads them
//! once.
//!
//! # Clocks
//!
//! Every instant compared (`now`, leases, expiries) comes from the calling
//! proxy's wall clock ([`now_millis`]), never from Redis's, so the decisions
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
//! Single node: a [`ConnectionManager`] (a multiplexed connection; it
//! reconnects by itself). Cluster: the async cluster connection (one
//! multiplexed connection per node). Each traffic worker gets connections of
//! its own, opened on its event loop (see [`LoopConnections`]); everything
//! else shares the connections opened at startup. Connection attempts and
//! responses have timeouts of their own, so nothing waits forever even
//! without the caller's `store.timeout`; a dead Redis surfaces as
//! [`StoreError::Unavailable`] and the store recovers when Redis returns.
//! A value that is not a record this build can read surfaces as
//! [`StoreError::Corrupt`].

mod removals;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::{
    Client, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, Pipeline,
    RedisError, RedisFuture, Script, ServerErrorKind, TlsCertificates, Value,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use tokio::runtime::{Handle, RuntimeFlavor};

use self::removals::RemovalChannel;
use super::RemovalWatcher;
use super::{Begin, BeginOutcome, Removal, Removed, SharedStore, Store, StoreError};
use crate::core::{
    decide_begin, new_claim, now_millis, running_lease, CompletedRecord, FencingToken,
    PendingRecord, Record, RecordKey, UnixMillis,
};

/// Longest relative expiry handed to `PX`. Redis refuses expiries that
/// overflow its own clock arithmetic; a `ttl` this long (about 35,000 years)
/// means "keep", so clamping changes nothing real.
const MAX_PEXPIRE_MS: u64 = 1 << 50;

/// Floor of the connect and response timeouts. `store.timeout` (250 ms by
/// default) already bounds every call at the caller; these only stop a
/// connection attempt or an answer from hanging forever, e.g. against a
/// host that drops packets, and let a reconnection that outlives one
/// request's timeout still finish for the next one.
const MIN_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// Reconnection attempts per failed connection (single node). Kept low so
/// that a dead Redis fails calls quickly; the next call starts a new round.
const RECONNECT_RETRIES: usize = 2;

struct Scripts {
    settle: Script,
    swap: Script,
    remove: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    settle: Script::new(include_str!("settle.lua")),
    swap: Script::new(include_str!("swap.lua")),
    remove: Script::new(include_str!("remove.lua")),
});

/// Reads of a key that a guarded removal makes before it gives up: each
/// one after the first follows a value that changed under `remove.lua`.
const REMOVE_ATTEMPTS: usize = 5;

/// Bytes before the record in a stored value (see "Layout" above).
const HEADER_LEN: usize = 25;

/// The header's first bytes, state and fencing token: what `settle.lua`
/// compares with the caller's claim.
const CLAIM_ID_LEN: usize = 17;

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

/// Where the Redis store connects and how: the `[store]` settings it reads.
#[derive(Clone, Debug, Default)]
pub struct RedisSettings {
    /// A Redis Cluster (seed nodes in `urls`) rather than a standalone Redis.
    pub cluster: bool,
    /// `redis://` or `rediss://` (TLS) URL of a standalone Redis; may carry
    /// `user:password@` and a `/db` number.
    pub url: String,
    /// Seed nodes of a Redis Cluster.
    pub urls: Vec<String>,
    /// ACL user name; overrides one in the URL.
    pub username: Option<String>,
    /// Password; overrides one in the URL.
    pub password: Option<String>,
    /// Name of an environment variable holding the password.
    pub password_env: Option<String>,
    /// Database number (standalone only); overrides one in the URL.
    pub database: Option<i64>,
    /// Prefix of every Redis key this proxy writes.
    pub key_prefix: String,
    /// Extra PEM CA bundle trusted for `rediss://`.
    pub ca_file: Option<PathBuf>,
    /// The caller's bound on every store call; connection timeouts derive
    /// from it.
    pub timeout: Duration,
}

/// How long [`open`] waits for a Redis that is not up yet.
pub const STARTUP_WAIT: Duration = Duration::from_secs(30);

/// Opens the store `config.kind` names (`redis` or `redis-cluster`), waiting
/// up to [`STARTUP_WAIT`] for a Redis that refuses connections, does not
/// answer or is still loading its data (as after a restart with a large
/// append-only file), instead of exiting into a restart loop that backs off
/// longer each time. Anything else (credentials, TLS, configuration) fails
/// at once.
pub async fn open(config: impl Into<RedisSettings>) -> Result<SharedStore, StoreError> {
    open_within(config, STARTUP_WAIT).await
}

/// [`open`] with another bound on the wait.
pub async fn open_within(
    config: impl Into<RedisSettings>,
    wait: Duration,
) -> Result<SharedStore, StoreError> {
    let config = config.into();
    Ok(std::sync::Arc::new(if config.cluster {
        RedisStore::connect_cluster_within(config, wait).await?
    } else {
        RedisStore::connect_within(config, wait).await?
    }))
}

/// The connection a store shares between all its calls. Both variants are
/// multiplexed and cheap to clone (a handle to the same connection).
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Opens connections like the store's first one (same address, credentials,
/// database, TLS and timeouts).
#[derive(Clone)]
enum Connector {
    Single(Client, ConnectionManagerConfig),
    Cluster(ClusterClient),
}

impl Connector {
    /// The store's first connection, with the scripts loaded (on every
    /// primary of a cluster) so that the first request does not pay for a
    /// `NOSCRIPT` round trip. Tries again, backing off, for up to `wait`
    /// while the failure is one that passes by itself ([`not_up_yet`]).
    async fn start(&self, target: &str, wait: Duration) -> Result<Conn, StoreError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut backoff = Duration::from_millis(100);
        loop {
            let attempt = async {
                let mut conn = self.connect().await?;
                for script in [&SCRIPTS.settle, &SCRIPTS.swap, &SCRIPTS.remove] {
                    script.load_async(&mut conn).await?;
                }
                Ok::<_, RedisError>(conn)
            };
            match attempt.await {
                Ok(conn) => return Ok(conn),
                Err(e) if not_up_yet(&e) && tokio::time::Instant::now() + backoff < deadline => {
                    tracing::warn!(redis = %target, error = %e, retry_in = ?backoff, "redis is not up yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(connect_error(target, e)),
            }
        }
    }

    async fn connect(&self) -> Result<Conn, RedisError> {
        match self {
            Connector::Single(client, config) => {
                ConnectionManager::new_with_config(client.clone(), config.clone())
                    .await
                    .map(Conn::Single)
            }
            Connector::Cluster(client) => client.get_async_connection().await.map(Conn::Cluster),
        }
    }
}

/// Connections of the event loops that call the store, one set per loop.
///
/// A multiplexed connection's socket I/O runs in a driver task on the
/// runtime that opened it. Each traffic worker is a current-thread runtime
/// (`server::Workers`): sharing the startup connection, every call crossed
/// threads twice (to the driver on the main runtime, then back to wake the
/// caller). With a connection opened on the worker's own loop, a call, its
/// I/O and its reply stay on one thread; in the load benchmark that took
/// unique-key throughput on Redis from about 10.6k to 11.8k requests/s.
///
/// Only current-thread runtimes get their own: tasks on a multi-thread
/// runtime (the admin API, startup) move between threads anyway.
struct LoopConnections {
    connector: Connector,
    /// Per runtime: `Some` once its connection is open, `None` while a task
    /// on that runtime opens it. Calls use the shared connection until it is
    /// open, so opening one (or failing to, with Redis down) never delays a
    /// request. A failed opening removes the entry and the next call tries
    /// again. Tokio may reuse the id of a runtime that has ended; a new
    /// runtime inheriting a dead runtime's connection would then see it
    /// fail like a broken one (the single-node manager reconnects).
    by_runtime: Mutex<HashMap<tokio::runtime::Id, Option<Conn>>>,
}

impl LoopConnections {
    fn new(connector: Connector) -> Arc<Self> {
        Arc::new(Self {
            connector,
            by_runtime: Mutex::new(HashMap::new()),
        })
    }

    /// The current loop's connection, if it has one; on a first call from a
    /// current-thread runtime, starts opening it there.
    fn current(self: &Arc<Self>) -> Option<Conn> {
        let handle = Handle::try_current().ok()?;
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return None;
        }
        let id = handle.id();
        let mut by_runtime = self
            .by_runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match by_runtime.get(&id) {
            Some(conn) => conn.clone(),
            None => {
                by_runtime.insert(id, None);
                let loops = Arc::clone(self);
                handle.spawn(async move {
                    let opened = loops.connector.connect().await;
                    let mut by_runtime = loops
                        .by_runtime
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    match opened {
                        Ok(conn) => by_runtime.insert(id, Some(conn)),
                        Err(e) => {
                            tracing::debug!(error = %e, "cannot open a worker's Redis connection yet");
                            by_runtime.remove(&id)
                        }
                    };
                });
                None
            }
        }
    }
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
    /// Connects to the standalone Redis at `config.url` (`redis://` or
    /// `rediss://`), with the credentials, database and CA of `config`, and
    /// loads the scripts. Fails if Redis cannot be reached or refuses the
    /// credentials; once connected, the store reconnects by itself.
    pub async fn connect(config: impl Into<RedisSettings>) -> Result<RedisStore, StoreError> {
        Self::connect_within(config, Duration::ZERO).await
    }

    /// [`RedisStore::connect`], trying again for up to `wait` while Redis is
    /// not up yet (see [`open`]).
    pub async fn connect_within(
        config: impl Into<RedisSettings>,
        wait: Duration,
    ) -> Result<RedisStore, StoreError> {
        let config = &config.into();
        let info = config
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| config_error("store.url", e))?;
        let client = node_client(info, config, config.database, "store.url")?;
        let io_timeout = io_timeout(config);
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(io_timeout))
            .set_response_timeout(Some(io_timeout))
            .set_number_of_retries(RECONNECT_RETRIES)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let removals = RemovalChannel::new(vec![client.clone()], &config.key_prefix, io_timeout);
        let connector = Connector::Single(client, manager_config);
        let conn = connector.start(&redacted(&config.url), wait).await?;
        Self::ready(conn, connector, removals, config, "redis").await
    }

    /// Connects to the Redis Cluster whose seed nodes are `config.urls`
    /// (`config.url` alone when `urls` is empty), with the credentials and CA
    /// of `config`, and loads the scripts on every primary.
    pub async fn connect_cluster(
        config: impl Into<RedisSettings>,
    ) -> Result<RedisStore, StoreError> {
        Self::connect_cluster_within(config, Duration::ZERO).await
    }

    /// [`RedisStore::connect_cluster`], trying again for up to `wait` while
    /// the cluster is not up yet (see [`open`]).
    pub async fn connect_cluster_within(
        config: impl Into<RedisSettings>,
        wait: Duration,
    ) -> Result<RedisStore, StoreError> {
        let config = &config.into();
        let urls: Vec<&str> = if config.urls.is_empty() {
            vec![config.url.as_str()]
        } else {
            config.urls.iter().map(String::as_str).collect()
        };
        if config.key_prefix.contains(['{', '}']) {
            // Redis hashes the first `{...}` of a key: braces in the prefix
            // would make them the hash tag, and put every record in one slot.
            tracing::warn!(
                prefix = %config.key_prefix,
                "store.key_prefix contains braces: records may not spread over the cluster"
            );
        }
        if config.database.is_some_and(|db| db != 0) {
            return Err(StoreError::Unavailable(
                "store.database: a Redis Cluster has database 0 only".into(),
            ));
        }
        let mut infos: Vec<ConnectionInfo> = Vec::with_capacity(urls.len());
        for url in &urls {
            infos.push(
                url.into_connection_info()
                    .map_err(|e| config_error("store.urls", e))?,
            );
        }
        let tls = infos
            .first()
            .is_some_and(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. }));
        let io_timeout = io_timeout(config);
        // Removals are followed on one node at a time (see [`removals`]).
        let nodes = infos
            .iter()
            .map(|info| node_client(info.clone(), config, None, "store.urls"))
            .collect::<Result<Vec<_>, _>>()?;
        let removals = RemovalChannel::new(nodes, &config.key_prefix, io_timeout);
        let mut builder = ClusterClientBuilder::new(infos)
            .connection_timeout(io_timeout)
            .response_timeout(io_timeout)
            // MOVED/ASK redirections during resharding are retried within
            // these; a dead cluster fails calls after them.
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(200)
            .tcp_settings(tcp_settings());
        if let Some(username) = &config.username {
            builder = builder.username(username);
        }
        if let Some(password) = password(config)? {
            builder = builder.password(password);
        }
        if let Some(certs) = tls_certificates(config, tls)? {
            builder = builder.certs(certs);
        }
        let client = builder.build().map_err(|e| config_error("store.urls", e))?;
        let connector = Connector::Cluster(client);
        let conn = connector.start(&redacted_list(&urls), wait).await?;
        Self::ready(conn, connector, removals, config, "redis-cluster").await
    }

    /// Checks that Redis takes `SET ... NX GET` (7.0 or later) and can be
    /// written to.
    async fn ready(
        conn: Conn,
        connector: Connector,
        removals: Arc<RemovalChannel>,
        config: &RedisSettings,
        kind: &'static str,
    ) -> Result<RedisStore, StoreError> {
        let store = RedisStore {
            shared: conn,
            loops: LoopConnections::new(connector),
            removals,
            prefix: config.key_prefix.clone(),
            kind,
        };
        // A key of our own that lives 1 ms: asking is the only check that
        // works the same through ACLs, proxies and managed Redis services.
        redis::cmd("SET")
            .arg(format!("{}{{version-check}}", store.prefix))
            .arg("")
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(1)
            .query_async::<Option<Vec<u8>>>(&mut store.shared.clone())
            .await
            .map_err(|e| {
                // Before 7.0, NX and GET together are a syntax error; any
                // other failure (a read-only replica, an ACL) says itself.
                let hint = if e.to_string().contains("syntax error") {
                    " (SET with both NX and GET needs Redis 7.0 or later)"
                } else {
                    ""
                };
                StoreError::Unavailable(format!("cannot write a test key to redis: {e}{hint}"))
            })?;
        store.check_eviction_policy().await;
        Ok(store)
    }

    /// Warns when Redis may evict records to make room. Every record has an
    /// expiry, so every `volatile-*` policy can evict it, as can the
    /// `allkeys-*` ones: an evicted claim or completion is a key forgotten,
    /// and its retry executes again. Only `noeviction` (Redis's default),
    /// or no `maxmemory`, is safe. A warning, not a refusal: managed
    /// services often hide `CONFIG` (then this says it could not check) or
    /// default to `volatile-lru` with room to spare, and the operator is
    /// the one who knows.
    async fn check_eviction_policy(&self) {
        // Several parameters in one CONFIG GET: Redis 7.0, which `ready`
        // requires anyway. On a cluster this asks one node.
        let asked: Result<HashMap<String, String>, _> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .arg("maxmemory")
            .query_async(&mut self.shared.clone())
            .await;
        match asked {
            Ok(config) => {
                let policy = config.get("maxmemory-policy").map(String::as_str);
                let maxmemory = config.get("maxmemory").map(String::as_str);
                if let Some(warning) = eviction_warning(policy, maxmemory) {
                    tracing::error!(store = self.kind, "{warning}");
                }
            }
            Err(e) => tracing::warn!(
                store = self.kind,
                error = %e,
                "cannot read redis's maxmemory-policy (CONFIG GET): make sure it is noeviction, or that maxmemory is 0, or records may be evicted and their retries executed again"
            ),
        }
    }

    /// The connection for a call from the current task (see
    /// [`LoopConnections`]).
    fn conn(&self) -> Conn {
        self.loops.current().unwrap_or_else(|| self.shared.clone())
    }

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
    async fn remove_and_announce(
        &self,
        key: &RecordKey,
        removal: Removal,
    ) -> Result<Removed, StoreError> {
        let removed = match removal {
            Removal::Any => self.delete_any(key).await?,
            Removal::UnlessLeased => self.delete_unless_leased(key).await?,
        };
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

    /// `GETDEL`, whatever the key holds.
    async fn delete_any(&self, key: &RecordKey) -> Result<Removed, StoreError> {
        let now = now_millis();
        let name = self.redis_key(key);
        let removed: Result<Option<Vec<u8>>, RedisError> = redis::cmd("GETDEL")
            .arg(&name)
            .query_async(&mut self.conn())
            .await;
        let live = match removed {
            Ok(None) => false,
            // A value without a readable expiry counts as live: removing it
            // is how an operator clears a corrupt record.
            Ok(Some(value)) => stored_expires_at(&value).is_none_or(|exp| exp > now),
            // Not a string (a hash of an earlier build, or anything else).
            Err(e) if e.code() == Some("WRONGTYPE") => {
                let deleted: i64 = redis::cmd("DEL")
                    .arg(&name)
                    .query_async(&mut self.conn())
                    .await
                    .map_err(redis_error)?;
                deleted != 0
            }
            Err(e) => return Err(redis_error(e)),
        };
        Ok(if live {
            Removed::Deleted
        } else {
            Removed::Absent
        })
    }

    /// Reads the key, and deletes what it read only if that is no running
    /// claim and the key still holds it (`remove.lua`): a request that
    /// claimed the key after the read keeps its claim. A key that changed
    /// under the script is read again.
    async fn delete_unless_leased(&self, key: &RecordKey) -> Result<Removed, StoreError> {
        let name = self.redis_key(key);
        for _ in 0..REMOVE_ATTEMPTS {
            let now = now_millis();
            let read: Result<Option<Vec<u8>>, RedisError> = redis::cmd("GET")
                .arg(&name)
                .query_async(&mut self.conn())
                .await;
            let value = match read {
                Ok(None) => return Ok(Removed::Absent),
                Ok(Some(value)) => Bytes::from(value),
                // Not a string, so no record of this store's, nor a claim.
                Err(e) if e.code() == Some("WRONGTYPE") => return self.delete_any(key).await,
                Err(e) => return Err(redis_error(e)),
            };
            // A value that does not decode is no running claim: removing it
            // is how an operator clears it.
            let running = read_stored(&value)
                .ok()
                .and_then(|record| running_lease(&record, now));
            if let Some(until) = running {
                return Ok(Removed::Leased { until });
            }
            let deleted: i64 = SCRIPTS
                .remove
                .key(&name)
                .arg(&value[..])
                .invoke_async(&mut self.conn())
                .await
                .map_err(redis_error)?;
            if deleted == 1 {
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

    /// The prefix of every key this store writes.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key holding `key`'s record.
    pub fn redis_key(&self, key: &RecordKey) -> String {
        redis_key(&self.prefix, key)
    }

    async fn settle(
        &self,
        key: &RecordKey,
        token: FencingToken,
        completed: Option<&CompletedRecord>,
    ) -> Result<(), StoreError> {
        let now = now_millis();
        let mut invocation = SCRIPTS.settle.key(self.redis_key(key));
        invocation.arg(now).arg(&claim_id(b'p', token.0)[..]);
        match completed {
            Some(record) => invocation
                .arg(stored_completed(record))
                .arg(pexpire_ms(record.expires_at, now)),
            None => invocation.arg("").arg(0),
        };
        let reply: Value = invocation
            .invoke_async(&mut self.conn())
            .await
            .map_err(redis_error)?;
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
        // One token for every claim this call writes, its takeovers
        // included. The cluster client sends a command again when the
        // connection broke before its reply came, so a `SET` or a `swap`
        // that did run can come back as a failure, and the next read then
        // finds this call's own claim: without the token to recognise it,
        // the request got 425 for its own claim, nobody held the key, and
        // it settled as `outcome-unknown` once the lease ran out, though
        // nothing had been sent upstream.
        let token = FencingToken::random();
        // Whether a takeover was written: the claim read back came from it
        // then (or, after a failed one, from a later `SET`: the claim is
        // this call's either way; `took_over` only feeds a metric).
        let mut took_over = false;
        for attempt in 1..=BEGIN_ATTEMPTS {
            let now = now_millis();
            // The claim to write if the key is free: prepared here, because
            // its token is random and its encoding is Rust's.
            let claim = new_claim(begin, now, token);
            let current: Option<Vec<u8>> = redis::cmd("SET")
                .arg(&key)
                .arg(stored_pending(&claim))
                .arg("NX")
                .arg("GET")
                .arg("PX")
                .arg(pexpire_ms(claim.expires_at, now))
                .query_async(&mut conn)
                .await
                .map_err(redis_error)?;
            let Some(current) = current else {
                return Ok(BeginOutcome::Acquired {
                    token: claim.token,
                    took_over: false,
                });
            };
            let current = Bytes::from(current);
            let existing = read_stored(&current)?;
            let (outcome, replacement) = decide_read(begin, existing, now, token, took_over);
            let Some(replacement) = replacement else {
                return Ok(outcome);
            };
            if attempt == BEGIN_ATTEMPTS {
                break;
            }
            took_over |= matches!(
                outcome,
                BeginOutcome::Acquired {
                    took_over: true,
                    ..
                }
            );
            let swapped: i64 = SCRIPTS
                .swap
                .key(&key)
                .arg(&current[..])
                .arg(stored(&replacement))
                .arg(pexpire_ms(replacement.expires_at(), now))
                .invoke_async(&mut conn)
                .await
                .map_err(redis_error)?;
            if swapped == 1 {
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
        tracing::warn!(
            key = %begin.key.to_hex(),
            "the record changed under each of {} attempts to claim it; answering in flight",
            BEGIN_ATTEMPTS - 1
        );
        Ok(BeginOutcome::InFlight {
            lease_expires_at: now_millis(),
        })
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        self.settle(key, token, Some(record)).await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.settle(key, token, None).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let now = now_millis();
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

/// What to tell the operator about Redis's `maxmemory-policy` and
/// `maxmemory` (`CONFIG GET` values), if anything: see
/// [`RedisStore::check_eviction_policy`].
fn eviction_warning(policy: Option<&str>, maxmemory: Option<&str>) -> Option<String> {
    let policy = policy?;
    if policy == "noeviction" || maxmemory == Some("0") {
        return None;
    }
    Some(format!(
        "redis runs with maxmemory-policy {policy} and maxmemory {}: when it fills up it evicts idempotency records, and the retry of an evicted key executes again; set maxmemory-policy noeviction (writes then fail with 503 store-unavailable instead)",
        maxmemory.unwrap_or("unknown")
    ))
}

/// What `begin` makes of the record a `SET … NX GET` read back: this
/// call's own claim (`token`: a command the cluster client sent twice),
/// or [`decide_begin`]'s decision on it, the record absent once expired by
/// this proxy's clock (whenever Redis reclaims it).
fn decide_read(
    begin: &Begin,
    existing: Record,
    now: UnixMillis,
    token: FencingToken,
    took_over: bool,
) -> (BeginOutcome, Option<Record>) {
    if matches!(&existing, Record::Pending(p) if p.token == token) {
        return (BeginOutcome::Acquired { token, took_over }, None);
    }
    let live = (existing.expires_at() > now).then_some(existing);
    decide_begin(begin, live, now, || token)
}

/// The header of a stored value (see "Layout" above), with room for the
/// `record_len` bytes of the record that follow it.
fn header(state: u8, token: u128, expires_at: UnixMillis, record_len: usize) -> Vec<u8> {
    let mut value = Vec::with_capacity(HEADER_LEN + record_len);
    value.extend_from_slice(&claim_id(state, token));
    value.extend_from_slice(&expires_at.to_be_bytes());
    value
}

/// A header's first [`CLAIM_ID_LEN`] bytes.
fn claim_id(state: u8, token: u128) -> [u8; CLAIM_ID_LEN] {
    let mut id = [state; CLAIM_ID_LEN];
    id[1..].copy_from_slice(&token.to_be_bytes());
    id
}

/// A pending claim as Redis holds it.
fn stored_pending(claim: &PendingRecord) -> Vec<u8> {
    claim.encode_after(header(
        b'p',
        claim.token.0,
        claim.expires_at,
        PendingRecord::ENCODED_LEN_MAX,
    ))
}

/// A completed record as Redis holds it.
fn stored_completed(record: &CompletedRecord) -> Vec<u8> {
    record.encode_after(header(b'c', 0, record.expires_at, record.encoded_len_max()))
}

fn stored(record: &Record) -> Vec<u8> {
    match record {
        Record::Pending(claim) => stored_pending(claim),
        Record::Completed(done) => stored_completed(done),
    }
}

/// `expires_at` from a stored value's header, if it has one.
fn stored_expires_at(value: &[u8]) -> Option<UnixMillis> {
    let exp: [u8; 8] = value.get(CLAIM_ID_LEN..HEADER_LEN)?.try_into().ok()?;
    matches!(value.first(), Some(b'p' | b'c')).then(|| UnixMillis::from_be_bytes(exp))
}

/// The record in a stored value, checked against its header: the scripts
/// trust the header, so a value whose header says something else than its
/// record is corrupt. The record shares `value` (`Record::decode_shared`):
/// a replay's body is a slice of the reply Redis sent, not a copy of it.
fn read_stored(value: &Bytes) -> Result<Record, StoreError> {
    let (Some(expires_at), Some(record)) = (stored_expires_at(value), value.get(HEADER_LEN..))
    else {
        return Err(corrupt("the value is not a record"));
    };
    let record = Record::decode_shared(&value.slice_ref(record))
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let id = match &record {
        Record::Pending(claim) => claim_id(b'p', claim.token.0),
        Record::Completed(_) => claim_id(b'c', 0),
    };
    if value.get(..CLAIM_ID_LEN) != Some(&id[..]) || record.expires_at() != expires_at {
        return Err(corrupt("the header of a record disagrees with the record"));
    }
    Ok(record)
}

/// A script reply: a status word, then its values in order.
struct Reply {
    status: String,
    values: std::vec::IntoIter<Value>,
}

impl Reply {
    fn new(reply: Value) -> Result<Reply, StoreError> {
        let Value::Array(values) = reply else {
            return Err(unexpected("script reply is not an array"));
        };
        let mut values = values.into_iter();
        let status = match values.next() {
            Some(Value::BulkString(s)) => String::from_utf8_lossy(&s).into_owned(),
            Some(Value::SimpleString(s)) => s,
            _ => return Err(unexpected("script reply has no status")),
        };
        Ok(Reply { status, values })
    }

    fn bytes(&mut self) -> Result<Vec<u8>, StoreError> {
        match self.values.next() {
            Some(Value::BulkString(b)) => Ok(b),
            Some(Value::SimpleString(s)) => Ok(s.into_bytes()),
            _ => Err(unexpected("script reply lacks a string")),
        }
    }

    fn corrupt(&mut self) -> StoreError {
        let why = self.bytes().unwrap_or_default();
        corrupt(&String::from_utf8_lossy(&why))
    }
}

/// The relative expiry of a key that should live until `expires_at`. At
/// least 1 ms: `PX 0` is an error, while a record that
/// is due already reads as absent anyway.
fn pexpire_ms(expires_at: UnixMillis, now: UnixMillis) -> u64 {
    expires_at.saturating_sub(now).clamp(1, MAX_PEXPIRE_MS)
}

/// A client of one node, with `config`'s credentials, TLS CA and TCP
/// settings (and `database`, standalone only). `field` names the setting
/// the address came from, for errors.
fn node_client(
    info: ConnectionInfo,
    config: &RedisSettings,
    database: Option<i64>,
    field: &str,
) -> Result<Client, StoreError> {
    let mut settings = info.redis_settings().clone();
    if let Some(username) = &config.username {
        settings = settings.set_username(username);
    }
    if let Some(password) = password(config)? {
        settings = settings.set_password(password);
    }
    if let Some(db) = database {
        settings = settings.set_db(db);
    }
    let info = info
        .set_redis_settings(settings)
        .set_tcp_settings(tcp_settings());
    let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
    match tls_certificates(config, tls)? {
        Some(certs) => Client::build_with_tls(info, certs),
        None => Client::open(info),
    }
    .map_err(|e| config_error(field, e))
}

/// `TCP_NODELAY`, which redis-rs leaves off: with Nagle's algorithm a small
/// write waits while an earlier one is unacknowledged, and on a multiplexed
/// connection under load one usually is. Redis sets it on its side. Unique
/// keys on Redis, 3 alternating wrk rounds: 13.1k -> 13.8k req/s; replays
/// 30.2k -> 31.1k.
fn tcp_settings() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

fn io_timeout(config: &RedisSettings) -> Duration {
    config.timeout.saturating_mul(4).max(MIN_IO_TIMEOUT)
}

/// The password `config` asks for: `password`, else the variable named by
/// `password_env` (read now, at connect), else none (the URL's, if any).
fn password(config: &RedisSettings) -> Result<Option<String>, StoreError> {
    if let Some(password) = &config.password {
        return Ok(Some(password.clone()));
    }
    match &config.password_env {
        Some(name) => std::env::var(name).map(Some).map_err(|_| {
            StoreError::Unavailable(format!(
                "store.password_env names {name}, which is not set (or not UTF-8)"
            ))
        }),
        None => Ok(None),
    }
}

/// The trust roots for `rediss://` when `ca_file` is set: its certificates
/// in addition to the system roots (the ones redis-rs uses without it).
/// redis-rs takes a single PEM bundle, which then replaces the system roots,
/// so the system roots are appended to it here.
fn tls_certificates(
    config: &RedisSettings,
    tls: bool,
) -> Result<Option<TlsCertificates>, StoreError> {
    let Some(path) = &config.ca_file else {
        return Ok(None);
    };
    let shown = path.display();
    if !tls {
        return Err(StoreError::Unavailable(format!(
            "store.ca_file ({shown}) is set, but the Redis URL is not rediss:// (TLS)"
        )));
    }
    let mut pem = std::fs::read(path)
        .map_err(|e| StoreError::Unavailable(format!("store.ca_file {shown}: {e}")))?;
    let mut found = 0usize;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| StoreError::Unavailable(format!("store.ca_file {shown}: {e}")))?;
        found += 1;
    }
    if found == 0 {
        return Err(StoreError::Unavailable(format!(
            "store.ca_file {shown}: no PEM certificate in it"
        )));
    }
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        // A broken system store must not stop the proxy: `ca_file` applies.
        tracing::warn!(error = %e, "cannot load some system CA certificates");
    }
    pem.push(b'\n');
    for cert in &native.certs {
        append_pem(&mut pem, cert);
    }
    Ok(Some(TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }))
}

/// Appends `cert` to `pem` as a PEM `CERTIFICATE` block.
fn append_pem(pem: &mut Vec<u8>, cert: &[u8]) {
    use base64::Engine;
    let body = base64::engine::general_purpose::STANDARD.encode(cert);
    pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.extend_from_slice(line);
        pem.push(b'\n');
    }
    pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
}

/// `url` without its userinfo, for messages.
fn redacted(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, _)), Some(at)) => format!("{scheme}://***@{}", &url[at + 1..]),
        _ => url.to_string(),
    }
}

fn redacted_list(urls: &[&str]) -> String {
    urls.iter()
        .map(|u| redacted(u))
        .collect::<Vec<_>>()
        .join(", ")
}

fn config_error(field: &str, e: RedisError) -> StoreError {
    StoreError::Unavailable(format!("{field}: {e}"))
}

/// Whether a failed start may succeed if tried again later: Redis not
/// listening yet, not answering, dropping the connection, or loading its
/// data set; a cluster without a reachable node or with slots not served
/// yet. Nothing else (a TLS failure, a refused password, a name that does
/// not resolve): waiting would only delay the error.
fn not_up_yet(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || e.is_timeout()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ClusterDown
                )
        )
}

fn connect_error(target: &str, e: RedisError) -> StoreError {
    StoreError::Unavailable(format!("cannot connect to {target}: {e}"))
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

fn corrupt(why: &str) -> StoreError {
    StoreError::Corrupt(why.to_string())
}

fn unexpected(what: &str) -> StoreError {
    StoreError::Unavailable(format!("unexpected reply from redis: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{Fingerprint, Outcome};

    #[test]
    fn an_evicting_policy_with_a_memory_limit_is_warned_about() {
        assert_eq!(eviction_warning(Some("noeviction"), Some("1000")), None);
        // No limit, nothing is ever evicted.
        assert_eq!(eviction_warning(Some("volatile-lru"), Some("0")), None);
        for policy in [
            "volatile-lru",
            "allkeys-lru",
            "volatile-ttl",
            "allkeys-random",
        ] {
            let warning = eviction_warning(Some(policy), Some("104857600")).unwrap_or_default();
            assert!(warning.contains(policy), "{warning}");
            assert!(warning.contains("executes again"), "{warning}");
        }
        // Nothing said, nothing known: the caller logs that it cannot check.
        assert_eq!(eviction_warning(None, None), None);
    }

    #[test]
    fn a_claim_of_this_begin_read_back_is_acquired_not_in_flight() {
        let begin = Begin {
            key: RecordKey::from_bytes([1; 32]),
            fingerprint: Fingerprint([1; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            on_stale: crate::store::OnStale::Store,
        };
        let now = now_millis();
        let claimed = |token| Record::Pending(new_claim(&begin, now, FencingToken(token)));
        // The `SET` ran, its reply was lost, the one sent again read it.
        for took_over in [false, true] {
            assert_eq!(
                decide_read(&begin, claimed(7), now, FencingToken(7), took_over),
                (
                    BeginOutcome::Acquired {
                        token: FencingToken(7),
                        took_over
                    },
                    None
                )
            );
        }
        // Anyone else's live claim is theirs.
        assert!(matches!(
            decide_read(&begin, claimed(8), now, FencingToken(7), false),
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

    #[test]
    fn pexpire_is_relative_and_bounded() {
        assert_eq!(pexpire_ms(1_500, 1_000), 500);
        assert_eq!(pexpire_ms(1_000, 1_000), 1);
        assert_eq!(pexpire_ms(900, 1_000), 1);
        assert_eq!(pexpire_ms(u64::MAX, 1_000), MAX_PEXPIRE_MS);
    }

    #[test]
    fn appended_pem_parses_back() {
        let der: Vec<u8> = (0..=255u8).cycle().take(700).collect();
        let mut pem = Vec::new();
        append_pem(&mut pem, &der);
        append_pem(&mut pem, &der[..10]);
        let parsed: Vec<_> = CertificateDer::pem_slice_iter(&pem)
            .map(|c| c.map(|c| c.to_vec()).ok())
            .collect();
        assert_eq!(parsed, vec![Some(der.clone()), Some(der[..10].to_vec())]);
    }

    #[test]
    fn redacts_credentials() {
        assert_eq!(redacted("redis://u:p@h:1/2"), "redis://***@h:1/2");
        assert_eq!(redacted("rediss://h:1"), "rediss://h:1");
    }

    #[test]
    fn password_precedence() {
        let mut config = RedisSettings::default();
        assert_eq!(password(&config).ok().flatten(), None);
        config.password_env = Some("IDEMPROXY_TEST_SURELY_UNSET_VARIABLE".into());
        assert!(matches!(
            password(&config),
            Err(StoreError::Unavailable(m)) if m.contains("IDEMPROXY_TEST_SURELY_UNSET_VARIABLE")
        ));
        config.password = Some("direct".into());
        assert_eq!(password(&config).ok().flatten().as_deref(), Some("direct"));
    }

    #[test]
    fn stored_values_read_back_and_check_their_header() {
        let claim = PendingRecord {
            fingerprint: Fingerprint([3; 32]),
            token: FencingToken(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
            created_at: 10,
            lease_expires_at: 20,
            expires_at: 0x0000_0123_4567_89ab,
        };
        let value = stored_pending(&claim);
        // The layout the scripts read: state, token, expires_at, then the
        // record's own bytes.
        assert_eq!(value[0], b'p');
        assert_eq!(value[1..17], claim.token.0.to_be_bytes());
        assert_eq!(value[17..25], [0, 0, 1, 0x23, 0x45, 0x67, 0x89, 0xab]);
        assert_eq!(value[HEADER_LEN..], claim.encode());
        assert_eq!(stored_expires_at(&value), Some(claim.expires_at));
        let pending = Record::Pending(claim);
        assert_eq!(
            read_stored(&value.clone().into()).ok(),
            Some(pending.clone())
        );
        assert_eq!(stored(&pending), value);

        let done = CompletedRecord {
            fingerprint: Fingerprint([3; 32]),
            created_at: 10,
            completed_at: 25,
            expires_at: 99,
            outcome: Outcome::NotStored { status: 201 },
        };
        let value = stored_completed(&done);
        assert_eq!(
            value[..17],
            [b'c', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            read_stored(&value.clone().into()).ok(),
            Some(Record::Completed(done))
        );

        // A header that says something else than its record is corrupt, as
        // are values too short to hold one and garbage after a valid one.
        let mut other_state = value.clone();
        other_state[0] = b'p';
        let mut other_expiry = value.clone();
        other_expiry[24] ^= 1;
        let mut garbage = value[..HEADER_LEN].to_vec();
        garbage.extend_from_slice(b"\x01junk");
        for bad in [
            &other_state[..],
            &other_expiry,
            &value[..HEADER_LEN],
            b"hello",
            &garbage,
        ] {
            assert!(matches!(
                read_stored(&Bytes::copy_from_slice(bad)),
                Err(StoreError::Corrupt(_))
            ));
        }
        assert_eq!(stored_expires_at(b"hello"), None);
        assert_eq!(stored_expires_at(&garbage), Some(99));
    }
}
