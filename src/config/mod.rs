//! Typed configuration: one TOML file, every field overridable from the
//! environment (`IDEMPROXY_<SECTION>__<FIELD>`, e.g.
//! `IDEMPROXY_UPSTREAM__URL`), the main ones by flags. Layers apply in that
//! order: defaults, file, environment, flags.
//!
//! [`Config::validate`] turns the raw shape into checked values and reports
//! every problem by the field that carries it.

mod load;
mod validate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use self::validate::{MAX_TTL, MIN_ADMIN_TOKEN_BYTES};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    /// Bearer token for the admin key API; without one that API is refused.
    pub admin_token: Option<String>,
    /// Serve the traffic listener over TLS (HTTP/1.1 and HTTP/2 by ALPN).
    pub tls: Option<TlsConfig>,
    pub upstream: UpstreamConfig,
    pub store: StoreConfig,
    pub idempotency: IdempotencyConfig,
    pub routes: Vec<RouteConfig>,
    /// How callers are identified for `jwt:<claim>` scopes.
    pub identity: IdentityConfig,
    /// How routes with `protocol = "mcp"` protect tool calls.
    pub mcp: McpConfig,
    pub log: LogConfig,
    /// OpenTelemetry traces, off without `otlp_endpoint`.
    pub telemetry: TelemetryConfig,
    /// On SIGTERM/SIGINT: how long open connections and running executions
    /// get to finish (and store their outcomes) before the process exits.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Threads serving traffic, each with its own event loop and upstream
    /// connection pool; 0 means one per CPU.
    pub workers: usize,
    /// Requests served at once, all routes together; past it the proxy
    /// answers 503 `overloaded` at once, before reading the body or touching
    /// the store, so memory stays bounded and nothing executes.
    pub max_in_flight: usize,
    /// How long a covered request's body may take to arrive, whole; past
    /// it the request is answered 408 `body-timeout` and nothing executes.
    /// A body is read before the key is claimed, holding one of
    /// `max_in_flight`: without a bound, clients that trickle their bodies
    /// could hold them all.
    #[serde(with = "humantime_serde")]
    pub request_body_timeout: Duration,
    /// `IDEMPROXY_*` variables that name no field, ignored by
    /// [`Config::load`]: logged at startup.
    #[serde(skip)]
    pub ignored_env: Vec<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: ([127, 0, 0, 1], 8080).into(),
            admin_listen: ([127, 0, 0, 1], 9090).into(),
            admin_token: None,
            tls: None,
            upstream: UpstreamConfig::default(),
            store: StoreConfig::default(),
            idempotency: IdempotencyConfig::default(),
            routes: Vec::new(),
            identity: IdentityConfig::default(),
            mcp: McpConfig::default(),
            log: LogConfig::default(),
            telemetry: TelemetryConfig::default(),
            drain_timeout: Duration::from_secs(35),
            workers: 0,
            max_in_flight: 1024,
            request_body_timeout: Duration::from_secs(30),
            ignored_env: Vec::new(),
        }
    }
}

/// PEM files of the traffic listener's certificate chain and private key,
/// and the CAs its clients' certificates are verified against (mTLS).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// PEM bundle of the CAs that issue client certificates: set, the
    /// listener asks every client for a certificate and verifies it, and
    /// the `client_cert` scope names the caller by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<PathBuf>,
    /// With `client_ca_file`: whether a client without a certificate is
    /// refused in the handshake (`required`, the default) or served
    /// without one (`optional`; `anonymous` then decides).
    #[serde(default)]
    pub client_auth: ClientAuth,
}

impl TlsConfig {
    /// The listener's certificate and key, no client certificates.
    pub fn new(cert_file: PathBuf, key_file: PathBuf) -> Self {
        Self {
            cert_file,
            key_file,
            client_ca_file: None,
            client_auth: ClientAuth::Required,
        }
    }
}

/// Whether a TLS client must present a certificate (see
/// [`TlsConfig::client_auth`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    #[default]
    Required,
    Optional,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Base URL; a path here is prefixed to every forwarded path.
    pub url: String,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Bounds the whole exchange, response body included.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Extra PEM CA bundle trusted for `https://` upstreams, besides the
    /// system and webpki roots.
    pub ca_file: Option<PathBuf>,
    /// Speak HTTP/2 without TLS (prior knowledge) to a plain `http://`
    /// upstream. `https://` upstreams negotiate HTTP/2 by ALPN regardless.
    pub http2_prior_knowledge: bool,
    /// Idle pooled connections kept per upstream host.
    pub pool_max_idle_per_host: usize,
    /// How long a pooled connection may sit idle before the proxy closes
    /// it. Keep it below the upstream's own keep-alive timeout (Node.js 5 s,
    /// gunicorn 2 s): a request written just as the upstream closes an
    /// idle connection cannot be told from one it received, so it is
    /// stored as `outcome-unknown`.
    #[serde(with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:3000".into(),
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(30),
            ca_file: None,
            http2_prior_knowledge: false,
            pool_max_idle_per_host: 64,
            pool_idle_timeout: Duration::from_secs(1),
        }
    }
}

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
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// Directory of the embedded store.
    pub path: PathBuf,
    /// `redis://` or `rediss://` (TLS) URL of a standalone Redis; may carry
    /// `user:password@` and a `/db` number.
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
    /// Extra PEM CA bundle trusted for `rediss://`.
    pub ca_file: Option<PathBuf>,
    /// Completed records cached in-process to answer replays without a
    /// round trip (0 = off). Completed records never change, except that an
    /// operator may remove one; other replicas hear of that through Redis
    /// pub/sub (see `store::cache`). The embedded store keeps at least
    /// `store::cache::EMBEDDED_ENTRIES`; the memory store, whose records are
    /// in the process already, none unless they are compressed (the cache
    /// then saves a replay the decompression).
    pub local_cache_entries: usize,
    /// Bounds every store call; past it the store counts as unavailable.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// How often the embedded store purges expired records.
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
    /// read whatever it says now (`store::compression`).
    pub compression: Compression,
    /// A zstd dictionary file (`idemproxy store train-dictionary`) new
    /// records are compressed with: small JSON responses compress several
    /// times better with one trained on the API's own responses.
    pub compression_dictionary: Option<PathBuf>,
    /// Dictionaries replaced by `compression_dictionary`, kept so that
    /// records written with them read until they expire (`ttl`).
    pub previous_compression_dictionaries: Vec<PathBuf>,
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
/// 40 MiB of responses (see `store::cache::ENTRY_BYTES`). A replay it holds
/// costs no store round trip (measured: docs/performance.md, "What made it
/// faster").
pub const DEFAULT_LOCAL_CACHE_ENTRIES: usize = 10_000;

impl Default for StoreConfig {
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
            previous_compression_dictionaries: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// 409 for a reused key, 425 for a key in flight.
    #[default]
    Default,
    /// draft-ietf-httpapi-idempotency-key-header: 422 reused, 409 in flight.
    Ietf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnInFlight {
    Reject,
    Wait,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    Reject,
    Pass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnAmbiguous {
    Store,
    Release,
}

/// What a covered request that names no caller gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Anonymous {
    /// The shared anonymous scope.
    #[default]
    Shared,
    /// 401 `missing-identity`.
    Reject,
}

/// Bearer tokens that name their caller (`jwt:<claim>` scope attributes).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdentityConfig {
    /// A JWKS file (`{"keys": [...]}`) of the keys tokens are signed with
    /// (RS256, ES256, EdDSA). Read at startup.
    pub jwks_file: Option<PathBuf>,
    /// Required `iss` claim, if set.
    pub issuer: Option<String>,
    /// Required `aud` claim, if set.
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    #[serde(with = "humantime_serde")]
    pub leeway: Duration,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        Self {
            jwks_file: None,
            issuer: None,
            audience: None,
            leeway: Duration::from_secs(60),
        }
    }
}

/// What to do with a pending record whose lease expired (its holder died
/// mid-call).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStale {
    /// Fail closed: settle the key as `outcome-unknown` for good.
    Store,
    /// Let the new request take the key over (a second execution is possible).
    Retry,
}

/// The idempotency policy: `[idempotency]` holds the defaults, every
/// `[[routes]]` entry may override any field.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    pub methods: Vec<String>,
    pub require_key: bool,
    pub profile: Profile,
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    pub on_in_flight: OnInFlight,
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    pub on_store_error: OnStoreError,
    pub on_ambiguous: OnAmbiguous,
    pub on_stale: OnStale,
    /// Added to `upstream.timeout` to make the lease of a pending record.
    #[serde(with = "humantime_serde")]
    pub lease_margin: Duration,
    pub release_statuses: Vec<u16>,
    pub max_request_bytes: usize,
    pub max_response_bytes: usize,
    pub fingerprint_headers: Vec<String>,
    pub fingerprint_ignore: Vec<String>,
    pub scope: Vec<String>,
    pub anonymous: Anonymous,
    /// Where the key comes from, tried in order, the first present wins:
    /// `header:<name>`, `json:<pointer>` (a string or integer member of a
    /// JSON body), `query:<name>`.
    pub key_from: Vec<String>,
    /// When no `key_from` source is present: the key is a hash of these
    /// attributes (`header:<name>`, `json:<pointer>`, `method`, `path`),
    /// every one required, else the request has no key.
    pub derive_key: Vec<String>,
    pub mode: Mode,
    /// In `observe` mode, how long a keyless request's (scope,
    /// fingerprint) is remembered to count the duplicates no key catches.
    #[serde(with = "humantime_serde")]
    pub observe_window: Duration,
    /// When set, a replayed JSON object body gains this member:
    /// `{"replayed": true, "original_date": "<RFC 3339>"}`.
    pub replay_body_field: String,
}

/// Whether a route enforces idempotency or only observes what enforcing
/// would do (DESIGN §6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Enforce,
    /// Every request reaches the upstream as if the proxy were plain; what
    /// enforcement would have done is counted (`observed_*` outcomes).
    Observe,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            profile: Profile::Default,
            ttl: Duration::from_secs(24 * 3600),
            on_in_flight: OnInFlight::Reject,
            wait_timeout: Duration::from_secs(10),
            on_store_error: OnStoreError::Reject,
            on_ambiguous: OnAmbiguous::Store,
            on_stale: OnStale::Store,
            lease_margin: Duration::from_secs(5),
            release_statuses: vec![429, 503],
            max_request_bytes: 1024 * 1024,
            max_response_bytes: 1024 * 1024,
            fingerprint_headers: Vec::new(),
            fingerprint_ignore: Vec::new(),
            scope: vec!["header:authorization".into()],
            anonymous: Anonymous::Shared,
            key_from: vec!["header:idempotency-key".into()],
            derive_key: Vec::new(),
            mode: Mode::Enforce,
            observe_window: Duration::from_secs(600),
            replay_body_field: String::new(),
        }
    }
}

/// A route: a path prefix with its own name (the `route` label) and any
/// overrides of `[idempotency]`. Unset fields inherit.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    pub path: String,
    pub methods: Option<Vec<String>>,
    pub require_key: Option<bool>,
    pub profile: Option<Profile>,
    #[serde(default, with = "humantime_serde")]
    pub ttl: Option<Duration>,
    pub on_in_flight: Option<OnInFlight>,
    #[serde(default, with = "humantime_serde")]
    pub wait_timeout: Option<Duration>,
    pub on_store_error: Option<OnStoreError>,
    pub on_ambiguous: Option<OnAmbiguous>,
    pub on_stale: Option<OnStale>,
    #[serde(default, with = "humantime_serde")]
    pub lease_margin: Option<Duration>,
    pub release_statuses: Option<Vec<u16>>,
    pub max_request_bytes: Option<usize>,
    pub max_response_bytes: Option<usize>,
    pub fingerprint_headers: Option<Vec<String>>,
    pub fingerprint_ignore: Option<Vec<String>>,
    pub scope: Option<Vec<String>>,
    pub anonymous: Option<Anonymous>,
    pub key_from: Option<Vec<String>>,
    pub derive_key: Option<Vec<String>>,
    pub mode: Option<Mode>,
    #[serde(default, with = "humantime_serde")]
    pub observe_window: Option<Duration>,
    pub replay_body_field: Option<String>,
    /// `mcp`: the route is an MCP server (Streamable HTTP), protected per
    /// tool call as `[mcp]` says.
    #[serde(default)]
    pub protocol: Protocol,
}

/// What a route speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Any HTTP API: the key is the `Idempotency-Key` header.
    #[default]
    Http,
    /// JSON-RPC over Streamable HTTP: each `tools/call` is keyed.
    Mcp,
}

/// `[mcp]`: how `protocol = "mcp"` routes protect tool calls (DESIGN §5).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpConfig {
    /// The argument each protected tool gains for its key.
    pub key_argument: String,
    pub protect: McpProtect,
    /// Globs of tool names added to the protected set (`send_*`).
    pub protect_tools: Vec<String>,
    /// Globs of tool names removed from it.
    pub skip_tools: Vec<String>,
    /// Whether the key argument is removed before the call is forwarded.
    pub strip_key_argument: bool,
    /// A model cannot back off: `wait` holds a duplicate, then replays.
    pub on_in_flight: OnInFlight,
    /// Whether a replay's first content item tells the model it is one.
    pub replay_note: bool,
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            key_argument: "idempotency_key".into(),
            protect: McpProtect::Auto,
            protect_tools: Vec::new(),
            skip_tools: Vec::new(),
            strip_key_argument: true,
            on_in_flight: OnInFlight::Wait,
            replay_note: true,
        }
    }
}

/// Which tools `[mcp]` protects before `protect_tools` and `skip_tools`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum McpProtect {
    /// Every tool not annotated `readOnlyHint: true`.
    #[default]
    Auto,
    All,
    /// Only `protect_tools`.
    Listed,
}

impl RouteConfig {
    /// The route's effective policy: its overrides on top of `defaults`.
    pub fn resolve(&self, defaults: &IdempotencyConfig) -> IdempotencyConfig {
        let d = defaults.clone();
        IdempotencyConfig {
            methods: self.methods.clone().unwrap_or(d.methods),
            require_key: self.require_key.unwrap_or(d.require_key),
            profile: self.profile.unwrap_or(d.profile),
            ttl: self.ttl.unwrap_or(d.ttl),
            on_in_flight: self.on_in_flight.unwrap_or(d.on_in_flight),
            wait_timeout: self.wait_timeout.unwrap_or(d.wait_timeout),
            on_store_error: self.on_store_error.unwrap_or(d.on_store_error),
            on_ambiguous: self.on_ambiguous.unwrap_or(d.on_ambiguous),
            on_stale: self.on_stale.unwrap_or(d.on_stale),
            lease_margin: self.lease_margin.unwrap_or(d.lease_margin),
            release_statuses: self.release_statuses.clone().unwrap_or(d.release_statuses),
            max_request_bytes: self.max_request_bytes.unwrap_or(d.max_request_bytes),
            max_response_bytes: self.max_response_bytes.unwrap_or(d.max_response_bytes),
            fingerprint_headers: self
                .fingerprint_headers
                .clone()
                .unwrap_or(d.fingerprint_headers),
            fingerprint_ignore: self
                .fingerprint_ignore
                .clone()
                .unwrap_or(d.fingerprint_ignore),
            scope: self.scope.clone().unwrap_or(d.scope),
            anonymous: self.anonymous.unwrap_or(d.anonymous),
            key_from: self.key_from.clone().unwrap_or(d.key_from),
            derive_key: self.derive_key.clone().unwrap_or(d.derive_key),
            mode: self.mode.unwrap_or(d.mode),
            observe_window: self.observe_window.unwrap_or(d.observe_window),
            replay_body_field: self
                .replay_body_field
                .clone()
                .unwrap_or(d.replay_body_field),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `idemproxy=debug`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Human,
            level: "info".into(),
        }
    }
}

/// Where and how much the proxy traces (OpenTelemetry, OTLP over
/// HTTP/protobuf).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP base URL, e.g. `http://otel-collector:4318`;
    /// spans go to its `/v1/traces`. Unset, nothing is traced and the
    /// request path pays nothing for it.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of every span.
    pub service_name: String,
    /// The share of new traces recorded, 0 to 1. A request whose
    /// `traceparent` carries its caller's decision follows it.
    pub sample_ratio: f64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: "idemproxy".into(),
            sample_ratio: 1.0,
        }
    }
}

/// Values given as command-line flags: they win over file and environment.
#[derive(Clone, Debug, Default)]
pub struct FlagOverrides {
    pub listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub upstream_url: Option<String>,
    pub store_kind: Option<StoreKind>,
    pub store_path: Option<PathBuf>,
    pub redis_url: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Load(Box<figment::Error>),
    #[error("invalid configuration:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<String>),
}

impl Config {
    /// The number of traffic threads `workers` asks for.
    pub fn worker_threads(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The variables a test passes to [`Config::load`].
    pub(super) fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_route_may_not_take_the_defaults_name() {
        let mut c = Config::load(None, env(&[]), &FlagOverrides::default()).expect("defaults load");
        c.routes = vec![RouteConfig {
            name: "default".into(),
            path: "/v1/tools".into(),
            ..RouteConfig::default()
        }];
        let err = c.validate().expect_err("`default` is taken").to_string();
        assert!(err.contains("routes[0].name: `default`"), "{err}");
        c.routes[0].name = "tools".into();
        c.validate().expect("another name is fine");
    }

    #[test]
    fn defaults_are_valid_and_match_the_design() {
        let c = Config::load(None, env(&[]), &FlagOverrides::default()).expect("defaults load");
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.admin_listen.to_string(), "127.0.0.1:9090");
        assert_eq!(c.store.kind, StoreKind::Embedded);
        assert_eq!(c.idempotency.methods, vec!["POST", "PATCH"]);
        assert_eq!(c.idempotency.release_statuses, vec![429, 503]);
        assert_eq!(c.idempotency.ttl, Duration::from_secs(86400));
        assert_eq!(c.store.timeout, Duration::from_millis(250));
        // The rest of DESIGN's configuration shape, field by field.
        assert_eq!(c.upstream.url, "http://127.0.0.1:3000");
        assert_eq!(c.upstream.connect_timeout, Duration::from_secs(2));
        assert_eq!(c.upstream.timeout, Duration::from_secs(30));
        assert_eq!(c.store.path, Path::new("idemproxy-data"));
        assert_eq!(c.store.url, "redis://127.0.0.1:6379");
        let p = &c.idempotency;
        assert!(!p.require_key);
        assert_eq!(p.profile, Profile::Default);
        assert_eq!(p.on_in_flight, OnInFlight::Reject);
        assert_eq!(p.wait_timeout, Duration::from_secs(10));
        assert_eq!(p.on_store_error, OnStoreError::Reject);
        assert_eq!(p.on_ambiguous, OnAmbiguous::Store);
        assert_eq!(p.on_stale, OnStale::Store);
        assert_eq!(
            (p.max_request_bytes, p.max_response_bytes),
            (1 << 20, 1 << 20)
        );
        assert!(p.fingerprint_headers.is_empty() && p.fingerprint_ignore.is_empty());
        assert_eq!(p.scope, vec!["header:authorization"]);
        assert!(c.routes.is_empty());
    }
}
