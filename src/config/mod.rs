//! Typed configuration: one TOML file, every field overridable from the
//! environment (`IDEMPROXY_<SECTION>__<FIELD>`, e.g.
//! `IDEMPROXY_UPSTREAM__URL`), the main ones by flags. Layers apply in that
//! order: defaults, file, environment, flags.
//!
//! [`Config::validate`] turns the raw shape into checked values and reports
//! every problem by the field that carries it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

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
    pub log: LogConfig,
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
            log: LogConfig::default(),
            drain_timeout: Duration::from_secs(35),
            workers: 0,
            max_in_flight: 1024,
            request_body_timeout: Duration::from_secs(30),
            ignored_env: Vec::new(),
        }
    }
}

/// PEM files of the traffic listener's certificate chain and private key.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
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
    /// in the process already, none.
    pub local_cache_entries: usize,
    /// Bounds every store call; past it the store counts as unavailable.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// How often the embedded store purges expired records.
    #[serde(with = "humantime_serde")]
    pub purge_interval: Duration,
}

/// Completed records each proxy keeps to answer replays itself: up to about
/// 40 MiB of responses (see `store::cache::ENTRY_BYTES`). A replay it holds
/// costs no store round trip: on Redis, 1.61-1.75x nginx's requests/s
/// instead of 1.19-1.52x in the same runs (`benches/load.sh`).
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
    /// Loads defaults, then `file` (if any), then `IDEMPROXY_*` variables from
    /// `env`, then `flags`, each value checked against its field's type.
    /// What the values mean is checked by `idemproxy::validate`, which
    /// runs [`Config::validate`] and parses what the parts take.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &FlagOverrides,
    ) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            // A directory (the volume a ConfigMap is mounted on, say)
            // would read as an empty file to figment: defaults, silently.
            if !file.is_file() {
                let why = if file.exists() {
                    "is not a file"
                } else {
                    "does not exist"
                };
                return Err(ConfigError::Invalid(vec![format!(
                    "config file {} {why}",
                    file.display()
                )]));
            }
            figment = figment.merge(Toml::file(file));
        }
        let mut vars: Vec<(String, String)> = env
            .into_iter()
            // The `--config` flag's own variable, read by the command line.
            .filter(|(k, _)| k.starts_with("IDEMPROXY_") && k != "IDEMPROXY_CONFIG")
            .collect();
        // The file's own types are checked strictly: a file that says
        // `workers = "2"` is wrong, whatever the environment does.
        figment
            .extract::<Config>()
            .map_err(|e| ConfigError::Load(Box::new(without_secrets(e))))?;
        // What the variables are laid over: `IDEMPROXY_ROUTES__0__TTL`
        // patches the file's first route.
        let base: figment::value::Dict = figment
            .extract()
            .map_err(|e| ConfigError::Load(Box::new(without_secrets(e))))?;
        let mut ignored_env = Vec::new();
        let mut config: Config = loop {
            let layered = figment
                .clone()
                .merge(EnvVars {
                    vars: vars.clone(),
                    base: base.clone(),
                })
                .merge(flags.as_provider());
            // Lossy: a variable's value is a string, read as a number or a
            // boolean where the field is one (see `EnvVars`).
            match layered.extract_lossy() {
                Ok(config) => break config,
                Err(e) => {
                    // A variable that names no field is not ours: Kubernetes
                    // gives every pod `IDEMPROXY_PORT`, `IDEMPROXY_SERVICE_HOST`...
                    // for a Service named `idemproxy`. Ignored (and logged),
                    // not a reason to refuse to start.
                    let strangers = unknown_env_vars(&e, &vars);
                    if strangers.is_empty() {
                        return Err(ConfigError::Load(Box::new(without_secrets(e))));
                    }
                    vars.retain(|(k, _)| !strangers.contains(k));
                    ignored_env.extend(strangers);
                }
            }
        };
        config.ignored_env = ignored_env;
        Ok(config)
    }

    /// The number of traffic threads `workers` asks for.
    pub fn worker_threads(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    /// Loads from the process environment.
    pub fn load_from_process(
        file: Option<&Path>,
        flags: &FlagOverrides,
    ) -> Result<Config, ConfigError> {
        Self::load(file, std::env::vars(), flags)
    }

    /// Checks every field and names each problem by its path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        // `upstream.url` is checked where it is parsed, once: see
        // `forward::UpstreamUrl`, which the composition root runs too.
        // Every one of these must be set, and none is meant to be a day.
        for (field, value) in [
            ("upstream.timeout", self.upstream.timeout),
            ("upstream.connect_timeout", self.upstream.connect_timeout),
            (
                "upstream.pool_idle_timeout",
                self.upstream.pool_idle_timeout,
            ),
            ("store.timeout", self.store.timeout),
            ("store.purge_interval", self.store.purge_interval),
            ("request_body_timeout", self.request_body_timeout),
        ] {
            if value.is_zero() {
                problems.push(format!("{field}: must be greater than zero"));
            }
            check_at_most_a_day(field, value, &mut problems);
        }
        // Zero is allowed: stop at once.
        check_at_most_a_day("drain_timeout", self.drain_timeout, &mut problems);
        if let Some(ca) = &self.upstream.ca_file {
            if !ca.is_file() {
                problems.push(format!("upstream.ca_file: {} is not a file", ca.display()));
            }
        }
        if self.max_in_flight == 0 {
            problems.push("max_in_flight: must be greater than zero".into());
        }
        if self.workers > 1024 {
            problems.push(format!(
                "workers: {} threads is not a sidecar; use at most 1024 (0 = one per CPU)",
                self.workers
            ));
        }
        match self.store.kind {
            StoreKind::Memory | StoreKind::Embedded => {}
            StoreKind::Redis => check_redis_url("store.url", &self.store.url, &mut problems),
            StoreKind::RedisCluster => {
                if self.store.urls.is_empty() {
                    problems
                        .push("store.urls: redis-cluster needs at least one seed node URL".into());
                }
                for url in &self.store.urls {
                    check_redis_url("store.urls", url, &mut problems);
                }
                if self.store.database.is_some_and(|db| db != 0) {
                    problems.push("store.database: Redis Cluster has only database 0".into());
                }
            }
        }
        if let Some(ca) = &self.store.ca_file {
            if !ca.is_file() {
                problems.push(format!("store.ca_file: {} is not a file", ca.display()));
            }
        }
        if let Some(tls) = &self.tls {
            for (field, path) in [
                ("tls.cert_file", &tls.cert_file),
                ("tls.key_file", &tls.key_file),
            ] {
                if !path.is_file() {
                    problems.push(format!("{field}: {} is not a file", path.display()));
                }
            }
        }
        match self.admin_token.as_deref() {
            Some("") => problems.push("admin_token: must not be empty when set".into()),
            // Sent as `Authorization: Bearer <token>`, which carries visible
            // ASCII only: any other token could never match, and the key
            // API would answer 401 for good.
            Some(token) if !token.bytes().all(|b| b.is_ascii_graphic()) => problems.push(
                "admin_token: must be visible ASCII without spaces \
                 (a trailing newline from a secret file?)"
                    .into(),
            ),
            _ => {}
        }
        if let Err(why) = check_log_level(&self.log.level) {
            problems.push(format!("log.level: {why}"));
        }
        validate_policy(
            "idempotency",
            &self.idempotency,
            self.store.timeout,
            &mut problems,
        );
        let mut names = std::collections::HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            if route.name.is_empty() {
                problems.push(format!("{at}.name: must be set"));
            } else if !names.insert(route.name.as_str()) {
                problems.push(format!("{at}.name: `{}` is used twice", route.name));
            }
            if !route.path.starts_with('/') {
                problems.push(format!("{at}.path: `{}` must start with `/`", route.path));
            }
            validate_policy(
                &at,
                &route.resolve(&self.idempotency),
                self.store.timeout,
                &mut problems,
            );
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// The effective configuration as TOML, as `idemproxy check` prints it.
    pub fn to_toml(&self) -> String {
        let mut shown = self.clone();
        if shown.admin_token.is_some() {
            shown.admin_token = Some("<redacted>".into());
        }
        if shown.store.password.is_some() {
            shown.store.password = Some("<redacted>".into());
        }
        shown.store.url = redact_url(&shown.store.url);
        shown.store.urls = shown.store.urls.iter().map(|u| redact_url(u)).collect();
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }
}

fn check_redis_url(at: &str, url: &str, problems: &mut Vec<String>) {
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        problems.push(format!(
            "{at}: `{}` must be a redis:// or rediss:// URL",
            redact_url(url)
        ));
    }
}

/// Hides the password of a `redis://user:password@host` URL.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        // Not a URL: where a password would be is anyone's guess.
        (None, _) => "<not shown>".into(),
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:<redacted>{}",
                    &url[..scheme_end + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// The longest `ttl` accepted.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Checks a `log.level` filter: a level (`info`), or comma-separated
/// `target=level` directives. tracing reads any other word as a target
/// name, so `warning` would have turned off every log line, the request
/// lines and startup errors included.
fn check_log_level(level: &str) -> Result<(), String> {
    for directive in level.split(',') {
        let named = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
        if named
            .trim()
            .parse::<tracing::level_filters::LevelFilter>()
            .is_err()
        {
            return Err(format!(
                "`{directive}` names no level (trace, debug, info, warn, error, off), \
                 alone or as `target=level`"
            ));
        }
    }
    Ok(())
}

/// figment's error without anything secret in it: a TOML syntax error
/// quotes the offending line (`password = "p4ss\word"`), a type error the
/// value it found (`admin_token = 12345678`). The first loses its quoted
/// lines (line and column stay); the second, for a secret field, its value.
fn without_secrets(error: figment::Error) -> figment::Error {
    use figment::error::Kind;
    let errors: Vec<figment::Error> = error
        .into_iter()
        .map(|mut e| {
            // A secret field, or the section holding some given as a plain
            // value (`IDEMPROXY_STORE=redis://:pw@h`).
            let secret =
                e.path.iter().any(|field| {
                    matches!(field.as_str(), "admin_token" | "password" | "url" | "urls")
                }) || e.path.last().is_some_and(|field| field == "store");
            let replacement = match &e.kind {
                Kind::Message(message) => Some(Kind::Message(
                    message
                        .lines()
                        .filter(|line| {
                            !line
                                .trim_start()
                                .trim_start_matches(|c: char| c.is_ascii_digit())
                                .trim_start()
                                .starts_with('|')
                        })
                        .collect::<Vec<_>>()
                        .join("\n"),
                )),
                Kind::InvalidType(_, expected) | Kind::InvalidValue(_, expected) if secret => Some(
                    Kind::Message(format!("invalid value (not shown), expected {expected}")),
                ),
                _ => None,
            };
            if let Some(kind) = replacement {
                e.kind = kind;
            }
            e
        })
        .collect();
    errors
        .into_iter()
        .rev()
        .reduce(|older, newer| older.chain(newer))
        .expect("an error holds at least one")
}

/// A timeout or margin longer than a day is a typo (`"30d"` for `"30s"`),
/// and would overflow the instant arithmetic of the request path.
fn check_at_most_a_day(field: &str, value: Duration, problems: &mut Vec<String>) {
    if value > Duration::from_secs(24 * 3600) {
        problems.push(format!(
            "{field}: {} is longer than a day",
            humantime::format_duration(value)
        ));
    }
}

fn validate_policy(
    at: &str,
    p: &IdempotencyConfig,
    store_timeout: Duration,
    problems: &mut Vec<String>,
) {
    // The lease is `upstream.timeout + lease_margin`: past it a retry
    // presumes the holder dead and settles its key (or takes it over with
    // `on_stale = "retry"`). The margin must leave a live holder time to
    // claim the key and store its outcome, a store call each.
    if p.lease_margin < store_timeout * 2 {
        problems.push(format!(
            "{at}.lease_margin: {} leaves a request that runs to upstream.timeout no time to store its outcome before its lease ends; use at least twice store.timeout ({})",
            humantime::format_duration(p.lease_margin),
            humantime::format_duration(store_timeout * 2)
        ));
    }
    check_at_most_a_day(&format!("{at}.lease_margin"), p.lease_margin, problems);
    check_at_most_a_day(&format!("{at}.wait_timeout"), p.wait_timeout, problems);
    if p.methods.is_empty() {
        problems.push(format!("{at}.methods: must name at least one method"));
    }
    if p.ttl.is_zero() {
        problems.push(format!("{at}.ttl: must be greater than zero"));
    }
    // Expiry instants are formatted as HTTP and RFC 3339 dates, which end
    // in the year 9999; past a year a TTL is a typo anyway.
    if p.ttl > MAX_TTL {
        problems.push(format!(
            "{at}.ttl: {} is longer than a year",
            humantime::format_duration(p.ttl)
        ));
    }
    if p.wait_timeout.is_zero() && p.on_in_flight == OnInFlight::Wait {
        problems.push(format!(
            "{at}.wait_timeout: must be greater than zero with on_in_flight = \"wait\""
        ));
    }
    for s in &p.release_statuses {
        if !(100..=599).contains(s) {
            problems.push(format!("{at}.release_statuses: {s} is not an HTTP status"));
        }
    }
    if p.max_request_bytes == 0 {
        problems.push(format!("{at}.max_request_bytes: must be greater than zero"));
    }
    // Zero would store no response body at all (every retry 502
    // `response-not-stored`), not "unlimited".
    if p.max_response_bytes == 0 {
        problems.push(format!(
            "{at}.max_response_bytes: must be greater than zero"
        ));
    }
    // Methods, header names, JSON pointers and scope attributes are parsed
    // (and reported by field) where they become the policy's own types,
    // once: see `settings::policies` at the crate root.
}

impl FlagOverrides {
    fn as_provider(&self) -> Serialized<serde_json::Value> {
        let mut root = serde_json::Map::new();
        if let Some(v) = self.listen {
            root.insert("listen".into(), v.to_string().into());
        }
        if let Some(v) = self.admin_listen {
            root.insert("admin_listen".into(), v.to_string().into());
        }
        if let Some(v) = &self.upstream_url {
            root.insert("upstream".into(), serde_json::json!({ "url": v }));
        }
        let mut store = serde_json::Map::new();
        if let Some(v) = self.store_kind {
            store.insert("kind".into(), serde_json::to_value(v).unwrap_or_default());
        }
        if let Some(v) = &self.store_path {
            store.insert("path".into(), v.display().to_string().into());
        }
        if let Some(v) = &self.redis_url {
            store.insert("url".into(), v.clone().into());
        }
        if !store.is_empty() {
            root.insert("store".into(), store.into());
        }
        Serialized::defaults(serde_json::Value::Object(root))
    }
}

/// The variables among `vars` that `error` says name no field, and that
/// may be someone else's: a name without `__`. Kubernetes names its
/// service variables with single underscores (`IDEMPROXY_PORT`,
/// `IDEMPROXY_SERVICE_HOST`); `__` is this configuration's own nesting, so
/// `IDEMPROXY_IDEMPOTENCY__REQUIRE_KEYS` is a typo to refuse, as in the
/// file, not a stranger to ignore.
fn unknown_env_vars(error: &figment::Error, vars: &[(String, String)]) -> Vec<String> {
    error
        .clone()
        .into_iter()
        .filter(|e| e.metadata.as_ref().is_some_and(|m| m.name == ENV_SOURCE))
        .flat_map(|e| match &e.kind {
            // Only a top-level field can be a stranger's: a variable under
            // a section has `__` in its name. (The path ends with the field,
            // or is empty.)
            figment::error::Kind::UnknownField(field, _)
                if e.path.len() <= 1 && e.path.iter().all(|p| p == field) =>
            {
                vars.iter()
                    .filter(|(k, _)| {
                        k.strip_prefix("IDEMPROXY_")
                            .is_some_and(|rest| rest.eq_ignore_ascii_case(field))
                    })
                    .map(|(k, _)| k.clone())
                    .collect()
            }
            _ => Vec::new(),
        })
        .collect()
}

const ENV_SOURCE: &str = "environment variable(s)";

/// `IDEMPROXY_A__B=v` sets field `a.b`. Figment's own `Env` provider reads
/// the process environment; this one reads an explicit list, so tests and
/// `check` see exactly the variables they pass in.
///
/// A value stays the string it is, unless it is an array or a table
/// (`[429, 503]`: so a secret that starts with `[` or `{` belongs in the
/// file, or in `password_env`); [`Config::load`] reads it as a number or a
/// boolean where the field is one. Parsed up front, `IDEMPROXY_ADMIN_TOKEN=12345678` would
/// have become a number that no string field takes (and the error would
/// have shown the secret), and quotes or spaces around a password would
/// have been dropped.
struct EnvVars {
    vars: Vec<(String, String)>,
    /// Defaults and file, for the lists a variable indexes into: such a list
    /// is given whole, with the variable's change (figment merges tables,
    /// not list items).
    base: figment::value::Dict,
}

impl figment::Provider for EnvVars {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(ENV_SOURCE)
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        use figment::value::{Dict, Map, Value};
        let mut dict = Dict::new();
        // Whole values before the fields set inside them, whatever the
        // environment's order: `IDEMPROXY_ROUTES` first, then
        // `IDEMPROXY_ROUTES__0__TTL` changes its first route.
        let mut vars: Vec<&(String, String)> = self.vars.iter().collect();
        vars.sort_by_key(|(k, _)| k.matches("__").count());
        let base = Value::from(self.base.clone());
        for (k, v) in vars {
            let Some(rest) = k.strip_prefix("IDEMPROXY_") else {
                continue;
            };
            let path: Vec<String> = rest.split("__").map(|p| p.to_ascii_lowercase()).collect();
            let value = match v.parse::<Value>() {
                Ok(parsed @ (Value::Array(..) | Value::Dict(..))) => parsed,
                _ => Value::from(v.clone()),
            };
            insert_path(&mut dict, Some(&base), &path, value)
                .map_err(|why| figment::Error::from(format!("{k}: {why}")))?;
        }
        let mut map = Map::new();
        map.insert(figment::Profile::Default, dict);
        Ok(map)
    }
}

/// Sets `path` to `value` in `dict`. A list that `path` indexes into (the
/// next part is a number) starts as `base`'s list at that place, so that
/// `routes.0.ttl` changes the first route and keeps the others.
fn insert_path(
    dict: &mut figment::value::Dict,
    base: Option<&figment::value::Value>,
    path: &[String],
    value: figment::value::Value,
) -> Result<(), String> {
    use figment::value::{Dict, Value};
    let [first, rest @ ..] = path else {
        return Ok(());
    };
    if rest.is_empty() {
        dict.insert(first.clone(), value);
        return Ok(());
    }
    let base = base.and_then(|b| b.find_ref(first));
    let indexes = rest[0].parse::<usize>().is_ok();
    let entry = dict.entry(first.clone()).or_insert_with(|| match base {
        Some(list @ Value::Array(..)) if indexes => list.clone(),
        _ => Value::from(Dict::new()),
    });
    match entry {
        Value::Dict(_, inner) => insert_path(inner, base, rest, value),
        Value::Array(_, items) => {
            let len = items.len();
            let [index, rest @ ..] = rest else {
                return Ok(());
            };
            let item = index
                .parse::<usize>()
                .ok()
                .and_then(|i| items.get_mut(i))
                .ok_or_else(|| format!("`{first}` has no item {index} (it has {len})"))?;
            match item {
                Value::Dict(_, inner) if !rest.is_empty() => insert_path(inner, None, rest, value),
                _ if rest.is_empty() => {
                    *item = value;
                    Ok(())
                }
                _ => Err(format!("`{first}` item {index} is not a table")),
            }
        }
        _ => Err(format!(
            "`{first}` is set whole by another variable: it has no fields to set"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// `config/idemproxy.toml` claims to list every option with its
    /// default: loading it must give exactly the defaults.
    #[test]
    fn the_shipped_config_file_is_the_defaults() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/idemproxy.toml");
        let shipped =
            Config::load(Some(&file), env(&[]), &FlagOverrides::default()).expect("file loads");
        assert_eq!(shipped.to_toml(), Config::default().to_toml());
    }

    /// The example files the README points to load and validate as they
    /// are.
    #[test]
    fn the_example_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
        let mut loaded = 0;
        for entry in std::fs::read_dir(&dir).expect("config/examples") {
            let file = entry.expect("entry").path();
            if file.extension().is_some_and(|e| e == "toml") {
                if let Err(e) = Config::load(Some(&file), env(&[]), &FlagOverrides::default()) {
                    panic!("{}: {e}", file.display());
                }
                loaded += 1;
            }
        }
        assert!(loaded >= 2, "{loaded} example files");
    }

    #[test]
    fn variables_that_name_no_field_are_ignored_and_reported() {
        // What Kubernetes gives every pod for a Service named `idemproxy`,
        // and the `--config` flag's own variable.
        let c = Config::load(
            None,
            env(&[
                ("IDEMPROXY_PORT", "tcp://10.0.0.7:8080"),
                ("IDEMPROXY_SERVICE_HOST", "10.0.0.7"),
                ("IDEMPROXY_PORT_8080_TCP_ADDR", "10.0.0.7"),
                ("IDEMPROXY_CONFIG", "/etc/idemproxy/idemproxy.toml"),
                ("IDEMPROXY_WORKERS", "3"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.workers, 3);
        let mut ignored = c.ignored_env.clone();
        ignored.sort();
        assert_eq!(
            ignored,
            [
                "IDEMPROXY_PORT",
                "IDEMPROXY_PORT_8080_TCP_ADDR",
                "IDEMPROXY_SERVICE_HOST"
            ]
        );
        // A name with this configuration's nesting (`__`) is ours, so one
        // that names no field is a typo, refused as in the file: under a
        // section that exists or one that does not, beside strangers.
        for typo in [
            "IDEMPROXY_IDEMPOTENCY__REQUIRE_KEYS",
            "IDEMPROXY_STORE__NO_SUCH_FIELD",
            "IDEMPROXY_FOO__BAR",
        ] {
            let err = Config::load(
                None,
                env(&[("IDEMPROXY_PORT", "tcp://10.0.0.7:8080"), (typo, "1")]),
                &FlagOverrides::default(),
            )
            .expect_err(typo)
            .to_string();
            // The unknown part is named: the field, or the section.
            let named = typo["IDEMPROXY_".len()..]
                .split("__")
                .any(|part| err.contains(&format!("`{}`", part.to_ascii_lowercase())));
            assert!(err.contains("unknown field") && named, "{typo}: {err}");
        }
        // A bad value for a field that exists is still an error.
        let err = Config::load(
            None,
            env(&[("IDEMPROXY_WORKERS", "many")]),
            &FlagOverrides::default(),
        )
        .expect_err("not a number");
        assert!(err.to_string().contains("workers"), "{err}");
    }

    #[test]
    fn the_file_is_typed_strictly_whatever_the_environment_reads_loosely() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "workers = \"2\"\n").expect("write");
        let err = Config::load(Some(&file), env(&[]), &FlagOverrides::default())
            .expect_err("a string for a number")
            .to_string();
        assert!(err.contains("workers") || err.contains("string"), "{err}");
        std::fs::write(&file, "[idempotency]\nrequire_key = \"on\"\n").expect("write");
        assert!(Config::load(Some(&file), env(&[]), &FlagOverrides::default()).is_err());
        // The same values from the environment are read as intended.
        let c = Config::load(
            None,
            env(&[
                ("IDEMPROXY_WORKERS", "2"),
                ("IDEMPROXY_IDEMPOTENCY__REQUIRE_KEY", "true"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.workers, 2);
        assert!(c.idempotency.require_key);
    }

    #[test]
    fn secrets_from_the_environment_are_taken_as_written() {
        let c = Config::load(
            None,
            env(&[
                ("IDEMPROXY_ADMIN_TOKEN", "12345678"),
                ("IDEMPROXY_STORE__PASSWORD", " \"true\" "),
                ("IDEMPROXY_STORE__USERNAME", "007"),
                ("IDEMPROXY_IDEMPOTENCY__REQUIRE_KEY", "true"),
                ("IDEMPROXY_MAX_IN_FLIGHT", "64"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.admin_token.as_deref(), Some("12345678"));
        assert_eq!(c.store.password.as_deref(), Some(" \"true\" "));
        assert_eq!(c.store.username.as_deref(), Some("007"));
        assert!(c.idempotency.require_key);
        assert_eq!(c.max_in_flight, 64);
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

    /// DESIGN: every field can be set from the environment, a route's too:
    /// `IDEMPROXY_ROUTES__<i>__<field>` changes the file's route `i` and
    /// leaves the rest of it, and the other routes, as they are.
    #[test]
    fn a_route_field_can_be_set_from_the_environment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            r#"
[[routes]]
name = "payments"
path = "/v1/payments"
require_key = true
[[routes]]
name = "emails"
path = "/v1/emails"
"#,
        )
        .expect("write");
        let c = Config::load(
            Some(&file),
            env(&[
                ("IDEMPROXY_ROUTES__1__REQUIRE_KEY", "true"),
                ("IDEMPROXY_ROUTES__0__TTL", "2h"),
                ("IDEMPROXY_ROUTES__0__RELEASE_STATUSES", "[429]"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.routes.len(), 2);
        let (payments, emails) = (&c.routes[0], &c.routes[1]);
        assert_eq!(
            (payments.name.as_str(), emails.name.as_str()),
            ("payments", "emails")
        );
        assert_eq!(payments.require_key, Some(true), "kept from the file");
        assert_eq!(payments.ttl, Some(Duration::from_secs(7200)));
        assert_eq!(payments.release_statuses, Some(vec![429]));
        assert_eq!(emails.require_key, Some(true));
        assert_eq!(emails.path, "/v1/emails");

        let err = Config::load(
            Some(&file),
            env(&[("IDEMPROXY_ROUTES__2__TTL", "2h")]),
            &FlagOverrides::default(),
        )
        .expect_err("there is no third route")
        .to_string();
        assert!(err.contains("IDEMPROXY_ROUTES__2__TTL"), "{err}");

        // The whole list from the environment, and a field of it, in either
        // order: the field applies to the list the variable gave.
        for reversed in [false, true] {
            let mut vars = env(&[
                ("IDEMPROXY_ROUTES", r#"[{name = "env", path = "/env"}]"#),
                ("IDEMPROXY_ROUTES__0__TTL", "2h"),
            ]);
            if reversed {
                vars.reverse();
            }
            let c = Config::load(Some(&file), vars, &FlagOverrides::default()).expect("loads");
            assert_eq!(c.routes.len(), 1, "reversed: {reversed}");
            assert_eq!(c.routes[0].name, "env");
            assert_eq!(c.routes[0].ttl, Some(Duration::from_secs(7200)));
        }
        // A section given as a plain value has no fields to set.
        let err = Config::load(
            None,
            env(&[
                ("IDEMPROXY_STORE", "x"),
                ("IDEMPROXY_STORE__URL", "redis://h"),
            ]),
            &FlagOverrides::default(),
        )
        .expect_err("store is a value and a table")
        .to_string();
        assert!(err.contains("IDEMPROXY_STORE__URL"), "{err}");
    }

    #[test]
    fn file_then_env_then_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            r#"
listen = "127.0.0.1:1111"
[upstream]
url = "http://127.0.0.1:4000"
timeout = "5s"
[idempotency]
ttl = "1h"
[[routes]]
name = "payments"
path = "/v1/payments"
require_key = true
"#,
        )
        .expect("write");
        let c = Config::load(
            Some(&file),
            env(&[
                ("IDEMPROXY_UPSTREAM__TIMEOUT", "7s"),
                ("IDEMPROXY_IDEMPOTENCY__RELEASE_STATUSES", "[429]"),
                ("IDEMPROXY_LISTEN", "127.0.0.1:2222"),
                ("OTHER", "ignored"),
            ]),
            &FlagOverrides {
                listen: Some("127.0.0.1:3333".parse().expect("addr")),
                ..Default::default()
            },
        )
        .expect("loads");
        assert_eq!(c.listen.to_string(), "127.0.0.1:3333");
        assert_eq!(c.upstream.url, "http://127.0.0.1:4000");
        assert_eq!(c.upstream.timeout, Duration::from_secs(7));
        assert_eq!(c.idempotency.release_statuses, vec![429]);
        assert_eq!(c.idempotency.ttl, Duration::from_secs(3600));
        let route = c.routes[0].resolve(&c.idempotency);
        assert!(route.require_key);
        assert_eq!(route.ttl, Duration::from_secs(3600));
    }

    #[test]
    fn a_config_path_that_is_a_directory_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = Config::load(Some(dir.path()), env(&[]), &FlagOverrides::default())
            .expect_err("a directory is no config file")
            .to_string();
        assert!(err.contains("is not a file"), "{err}");
    }

    /// Load errors are printed: a TOML syntax error must not quote the line
    /// with the secret in it, nor a type error a secret's value.
    #[test]
    fn load_errors_do_not_repeat_secrets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        for (text, secret, still_said) in [
            ("[store]\npassword = \"p4ss\\word\"\n", "p4ss", "line 2"),
            ("admin_token = s3cret\n", "s3cret", "line 1"),
            ("admin_token = 12345678\n", "12345678", "admin_token"),
            ("[store]\nurl = 42424242\n", "42424242", "url"),
            (
                "[store]\nurls = \"redis://:s3cretpw@node:6379\"\n",
                "s3cretpw",
                "urls",
            ),
        ] {
            std::fs::write(&file, text).expect("write");
            let err = Config::load(Some(&file), env(&[]), &FlagOverrides::default())
                .expect_err("invalid")
                .to_string();
            assert!(!err.contains(secret), "{text:?} repeated: {err}");
            assert!(err.contains(still_said), "{text:?}: {err}");
        }
        // A field that holds no secret keeps the value in its message.
        std::fs::write(&file, "workers = \"many\"\n").expect("write");
        let err = Config::load(Some(&file), env(&[]), &FlagOverrides::default())
            .expect_err("invalid")
            .to_string();
        assert!(err.contains("many"), "{err}");

        // A URL given to the store section itself, from the environment.
        let err = Config::load(
            None,
            env(&[("IDEMPROXY_STORE", "redis://:s3cretpw@h:6379")]),
            &FlagOverrides::default(),
        )
        .expect_err("store is a table")
        .to_string();
        assert!(!err.contains("s3cretpw") && err.contains("store"), "{err}");

        assert!(!redact_url("idemproxy:S3cret@redis:6379").contains("S3cret"));
        assert_eq!(
            redact_url("redis://u:S3cret@h:6379/0"),
            "redis://u:<redacted>@h:6379/0"
        );
    }

    #[test]
    fn a_lease_margin_too_short_for_the_store_or_any_timeout_over_a_day_is_refused() {
        let problems = |c: &Config| match c.validate() {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        };
        let mut c = Config::default();
        assert_eq!(problems(&c), "");
        c.idempotency.lease_margin = Duration::ZERO;
        assert!(
            problems(&c).contains("idempotency.lease_margin"),
            "{}",
            problems(&c)
        );
        // Twice store.timeout (250 ms) is the least.
        c.idempotency.lease_margin = Duration::from_millis(499);
        assert!(
            problems(&c).contains("at least twice store.timeout (500ms)"),
            "{}",
            problems(&c)
        );
        c.idempotency.lease_margin = Duration::from_millis(500);
        assert_eq!(problems(&c), "");
        // The same margin is too short for a slower store.
        c.store.timeout = Duration::from_secs(1);
        let err = problems(&c);
        assert!(err.contains("idempotency.lease_margin"), "{err}");
        c.idempotency.lease_margin = Duration::from_secs(5);
        c.idempotency.wait_timeout = Duration::from_secs(400 * 24 * 3600);
        c.upstream.timeout = Duration::from_secs(2 * 24 * 3600);
        let err = problems(&c);
        assert!(err.contains("idempotency.wait_timeout: 1year"), "{err}");
        assert!(
            err.contains("upstream.timeout: 2days is longer than a day"),
            "{err}"
        );
    }

    #[test]
    fn check_output_round_trips_and_redacts_the_admin_token() {
        let c = Config {
            admin_token: Some("s3cret".into()),
            ..Config::default()
        };
        let text = c.to_toml();
        assert!(!text.contains("s3cret"));
        assert_eq!(
            redact_url("redis://app:pw@127.0.0.1:6379/2"),
            "redis://app:<redacted>@127.0.0.1:6379/2"
        );
        assert_eq!(redact_url("redis://127.0.0.1"), "redis://127.0.0.1");
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(&file, text).expect("write");
        Config::load(Some(&file), env(&[]), &FlagOverrides::default()).expect("re-loads");
    }
}
