//! `[store]`: which store holds the records and how, one table for every
//! kind; each kind reads the fields it needs (the Redis kinds: see
//! [`redis::open`](super::redis::open)).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StoreKind {
    Memory,
    Embedded,
    Redis,
    RedisCluster,
    /// A primary that Sentinels watch and fail over (`sentinels`,
    /// `master_name`).
    RedisSentinel,
    /// A PostgreSQL database (`url`, `table_prefix`, `pool_size`).
    Postgres,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSettings {
    pub kind: StoreKind,
    /// Directory of the embedded store.
    pub path: PathBuf,
    /// `redis://` or `rediss://` (TLS) URL of a standalone Redis; may carry
    /// `user:password@` and a `/db` number. For `kind = "postgres"`, a
    /// `postgres://user@host:port/db` URL (`?sslmode=require` for TLS, the
    /// certificate verified).
    pub url: String,
    /// Seed nodes of a Redis Cluster (`kind = "redis-cluster"`).
    pub urls: Vec<String>,
    /// ACL user name; overrides one in the URL.
    pub username: Option<String>,
    /// Redis password; overrides one in the URL. Prefer setting it through
    /// `IDEMPROXY_STORE__PASSWORD` (or `password_env`) over the file.
    pub password: Option<String>,
    /// Name of an environment variable holding the Redis password.
    pub password_env: Option<String>,
    /// Database number (standalone only); overrides one in the URL.
    pub database: Option<i64>,
    /// Prefix of every Redis key this proxy writes.
    pub key_prefix: String,
    /// Extra PEM CA bundle trusted for `rediss://`, and for PostgreSQL with
    /// `sslmode=require`.
    pub ca_file: Option<PathBuf>,
    /// Completed records cached in-process to answer replays without a
    /// round trip (0 = off). Completed records never change, except that an
    /// operator may remove one; other replicas hear of that through Redis
    /// pub/sub (see [`cache`](super::cache)). The embedded store keeps at least
    /// [`EMBEDDED_ENTRIES`](super::cache::EMBEDDED_ENTRIES); the memory store, whose records are
    /// in the process already, none unless they are compressed (the cache
    /// then saves a replay the decompression).
    pub local_cache_entries: usize,
    /// Bounds every store call; past it the store counts as unavailable.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// How often the embedded and PostgreSQL stores purge expired records.
    #[serde(with = "humantime_serde")]
    pub purge_interval: Duration,
    /// Sentinels of `kind = "redis-sentinel"` (`redis://host:26379`); the
    /// primary they name for `master_name` is the store, and followed
    /// across a failover.
    pub sentinels: Vec<String>,
    /// The name the Sentinels monitor the primary under.
    pub master_name: String,
    /// Redis (every kind): a claim counts only once this many replicas have
    /// it (`WAIT`), so a failover cannot forget a claim whose request ran;
    /// 0 = do not wait. Completions wait the same.
    pub min_replica_acks: u32,
    /// How long `WAIT` waits; past it the claim is released and the
    /// request answered 503 `store-unavailable`. Below `timeout`.
    #[serde(with = "humantime_serde")]
    pub replica_ack_timeout: Duration,
    /// Name of an environment variable holding comma-separated base64
    /// 32-byte keys: stored responses are sealed with AES-256-GCM, the
    /// first key seals, every key opens (rotation).
    pub encryption_keys_env: Option<String>,
    /// How stored responses are kept: `zstd` (compact headers, the whole
    /// compressed when that is shorter) or `off` (as they came). Records
    /// read whatever it says now ([`compression`](super::compression)).
    pub compression: Compression,
    /// A zstd dictionary file (`idemproxy store train-dictionary`) new
    /// records are compressed with: small JSON responses compress several
    /// times better with one trained on the API's own responses.
    pub compression_dictionary: Option<PathBuf>,
    /// Without `compression_dictionary`: whether the proxy learns a
    /// dictionary from its own first responses and shares it through the
    /// store ([`compression`](super::compression)). Off, each response
    /// is compressed on its own: for operators whose policy keeps no
    /// response content past its record (a learned dictionary is made of
    /// fragments of real responses, kept, sealed like any record, as long
    /// as records may use it).
    pub learn_dictionary: bool,
    /// Dictionaries replaced by `compression_dictionary`, kept so that
    /// records written with them read until they expire (`ttl`).
    pub previous_compression_dictionaries: Vec<PathBuf>,
    /// PostgreSQL: the prefix of the store's table names (lowercase letters,
    /// digits, `_`), so several proxies' stores can share a database.
    pub table_prefix: String,
    /// PostgreSQL: connections each proxy keeps open at most for traffic,
    /// split between its traffic threads.
    pub pool_size: usize,
}

impl StoreSettings {
    /// The password to connect with: `password`, else the variable named by
    /// `password_env` (read now, at connect), else none (the URL's, if any).
    pub(crate) fn resolved_password(&self) -> Result<Option<String>, super::StoreError> {
        if let Some(password) = &self.password {
            return Ok(Some(password.clone()));
        }
        match &self.password_env {
            Some(name) => std::env::var(name).map(Some).map_err(|_| {
                super::StoreError::Unavailable(format!(
                    "store.password_env names {name}, which is not set (or not UTF-8)"
                ))
            }),
            None => Ok(None),
        }
    }
}

/// `store.compression`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    #[default]
    Zstd,
    Off,
}

/// Completed records each proxy keeps to answer replays itself: up to about
/// 40 MiB of responses (see [`ENTRY_BYTES`](super::cache::ENTRY_BYTES)). A replay it holds
/// costs no store round trip (measured: docs/performance.md, "What made it
/// faster").
pub const DEFAULT_LOCAL_CACHE_ENTRIES: usize = 10_000;

impl Default for StoreSettings {
    fn default() -> Self {
        Self {
            kind: StoreKind::Embedded,
            path: PathBuf::from("idemproxy-data"),
            url: "redis://127.0.0.1:6379".into(),
            urls: Vec::new(),
            username: None,
            password: None,
            password_env: None,
            database: None,
            key_prefix: "idemproxy:".into(),
            ca_file: None,
            local_cache_entries: DEFAULT_LOCAL_CACHE_ENTRIES,
            timeout: Duration::from_millis(250),
            purge_interval: Duration::from_secs(60),
            sentinels: Vec::new(),
            master_name: String::new(),
            min_replica_acks: 0,
            replica_ack_timeout: Duration::from_millis(100),
            encryption_keys_env: None,
            compression: Compression::Zstd,
            compression_dictionary: None,
            learn_dictionary: true,
            previous_compression_dictionaries: Vec::new(),
            table_prefix: "idemproxy_".into(),
            pool_size: 16,
        }
    }
}
