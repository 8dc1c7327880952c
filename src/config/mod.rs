//! Typed configuration: one TOML file, every field overridable from the
//! environment (`IDEMPROXY_<SECTION>__<FIELD>`, e.g.
//! `IDEMPROXY_UPSTREAM__URL`), the main ones by flags. Layers apply in that
//! order: defaults, file, environment, flags.
//!
//! Each part owns the serde type of its own section, with its defaults:
//! `[upstream]` is [`UpstreamSettings`] (forward), `[store]`
//! [`StoreSettings`] (store), `[idempotency]` and every route's settings
//! [`IdempotencySettings`], `[mcp]` [`McpSettings`] (idempotency). This
//! module composes them, and a `[[routes]]` entry may override any field
//! of `[idempotency]`: [`Config::load`] lays `[idempotency]` under each
//! route's table before reading it, so a field added there is a route's
//! too, with nothing else to write.
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
// The parts' own settings, which the file is composed of.
pub use crate::core::OnStale;
pub use crate::forward::UpstreamSettings;
pub use crate::idempotency::settings::{
    IdempotencySettings, McpSettings, Mode, OnAmbiguous, OnInFlight, OnStoreError, Profile,
    Protocol, ReconcileProof,
};
pub use crate::mcp::tools::Protect;
pub use crate::request::scope::Anonymous;
pub use crate::store::{Compression, StoreKind, StoreSettings, DEFAULT_LOCAL_CACHE_ENTRIES};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    /// Bearer token for the admin key API; without one that API is refused.
    pub admin_token: Option<String>,
    /// Serve the traffic listener over TLS (HTTP/1.1 and HTTP/2 by ALPN).
    pub tls: Option<TlsConfig>,
    pub upstream: UpstreamSettings,
    pub store: StoreSettings,
    /// The idempotency policy: the defaults of every route, and the route
    /// `default`'s policy.
    pub idempotency: IdempotencySettings,
    pub routes: Vec<RouteConfig>,
    /// How callers are identified for `jwt:<claim>` scopes.
    pub identity: IdentityConfig,
    /// How routes with `protocol = "mcp"` protect tool calls.
    pub mcp: McpSettings,
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
            upstream: UpstreamSettings::default(),
            store: StoreSettings::default(),
            idempotency: IdempotencySettings::default(),
            routes: Vec::new(),
            identity: IdentityConfig::default(),
            mcp: McpSettings::default(),
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

/// A `[[routes]]` entry: a path prefix with its own name (the `route`
/// label) and its idempotency settings. In the file a route's table holds
/// its own fields beside any field of `[idempotency]` it overrides;
/// [`Config::load`] lays `[idempotency]` under it, so `idempotency` is the
/// route's whole, effective policy (and printed flat again).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    pub path: String,
    /// `mcp`: the route is an MCP server (Streamable HTTP), protected per
    /// tool call as `[mcp]` says.
    #[serde(default)]
    pub protocol: Protocol,
    /// `[idempotency]` with the route's own values laid over it.
    #[serde(default)]
    pub idempotency: IdempotencySettings,
}

impl RouteConfig {
    /// The fields a route's table holds that are the route's own, not
    /// `[idempotency]`'s.
    pub(crate) const OWN_FIELDS: [&'static str; 3] = ["name", "path", "protocol"];
}

/// As the file writes a route: its own fields, then its settings, in one
/// table.
impl Serialize for RouteConfig {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Flat<'a> {
            name: &'a str,
            path: &'a str,
            protocol: Protocol,
            #[serde(flatten)]
            idempotency: &'a IdempotencySettings,
        }
        Flat {
            name: &self.name,
            path: &self.path,
            protocol: self.protocol,
            idempotency: &self.idempotency,
        }
        .serialize(serializer)
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
