//! Part of the composition root: what takes more than one part's settings.
//! Checks across parts (a route's `lease_margin` against `store.timeout`,
//! `jwt:` scopes against `[identity]`), and the runtime objects built from
//! several (each route's [`Policy`], the keyring, the packer), so that no
//! part below reads the configuration; each part's own settings it takes
//! as they are. Every value that does not parse is reported by the field
//! that carries it, all of them in one answer.

use std::sync::Arc;

use crate::config::{self, Config, IdentityConfig};
use crate::core::redact_url;
use crate::forward::UpstreamUrl;
use crate::idempotency::mcp_catalog::SharedCatalog;
use crate::idempotency::policy::{parse_each, McpRoute};
use crate::idempotency::settings::{IdempotencySettings, McpSettings, Protocol};
use crate::idempotency::{store_time_in_lease, Policies, Policy};
use crate::mcp::{ToolCatalog, ToolRules};
use crate::request::identity::{IdentitySettings, TokenVerifier};
use crate::request::scope::{Anonymous, ScopeAttribute, ScopeRules};
use crate::store::compression::{Dictionary, Packer};
use crate::store::redis;
use crate::store::sealed::Keyring;
use crate::store::{Compression, StoreKind, StoreSettings};

/// Every problem of `config`: its own checks ([`Config::validate`]) and
/// the values that do not parse into what the parts take.
pub(crate) fn problems(config: &Config) -> Vec<String> {
    let mut problems = match config.validate() {
        Ok(()) => Vec::new(),
        Err(config::ConfigError::Invalid(problems)) => problems,
        Err(other) => vec![other.to_string()],
    };
    if let Err(why) = UpstreamUrl::parse(&config.upstream.url) {
        problems.push(why);
    }
    problems.extend(redis_url_problems(&config.store));
    if config.store.kind == StoreKind::Postgres {
        problems.extend(crate::store::postgres::check_settings(&config.store));
    }
    if let Err(why) = keyring(&config.store) {
        problems.push(why);
    }
    if let Err(why) = packer(config) {
        problems.push(why);
    }
    if let Err(policy_problems) = policies(config) {
        problems.extend(policy_problems);
    }
    problems
}

/// The keys of `store.encryption_keys_env`, read from the environment
/// now; `None` when encryption at rest is off.
pub(crate) fn keyring(store: &StoreSettings) -> Result<Option<Keyring>, String> {
    let Some(name) = &store.encryption_keys_env else {
        return Ok(None);
    };
    let text = std::env::var(name).map_err(|_| {
        format!("store.encryption_keys_env names {name}, which is not set (or not UTF-8)")
    })?;
    Keyring::parse(&text)
        .map(Some)
        .map_err(|why| format!("store.encryption_keys_env ({name}): {why}"))
}

/// How stored responses are packed (`store.compression`), its
/// dictionaries read now. Unpacking allocates at most the largest
/// `max_response_bytes` any route allows, with room for headers, and never
/// less than 16 MiB: a limit lowered since must not make the larger
/// records stored before it unreadable.
pub(crate) fn packer(config: &Config) -> Result<Packer, String> {
    let store = &config.store;
    let dictionary = store
        .compression_dictionary
        .as_deref()
        .map(Dictionary::load)
        .transpose()
        .map_err(|why| format!("store.compression_dictionary: {why}"))?;
    let previous = store
        .previous_compression_dictionaries
        .iter()
        .map(|path| Dictionary::load(path))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|why| format!("store.previous_compression_dictionaries: {why}"))?;
    let largest = config
        .routes
        .iter()
        .map(|route| route.idempotency.max_response_bytes)
        .chain([config.idempotency.max_response_bytes])
        .max()
        .unwrap_or_default();
    let max_unpacked = largest.max(16 << 20).saturating_add(1 << 20);
    Ok(Packer::new(
        store.compression == Compression::Zstd,
        dictionary,
        previous,
        max_unpacked,
    ))
}

/// How long a record may live at most: its route's `ttl` after a lease
/// (an abandoned claim is kept that long past its lease), with a day's
/// room for leases and clocks. A learned compression dictionary outlives
/// its use by this much.
pub(crate) fn record_lifetime(config: &Config) -> std::time::Duration {
    let longest = config
        .routes
        .iter()
        .map(|route| route.idempotency.ttl)
        .chain([config.idempotency.ttl])
        .max()
        .unwrap_or_default();
    longest
        .saturating_add(config.upstream.timeout)
        .saturating_add(std::time::Duration::from_secs(24 * 3600))
}

/// The Redis URLs the store kind connects to, checked as the store checks
/// them.
fn redis_url_problems(store: &StoreSettings) -> Vec<String> {
    let urls: Vec<(&str, &String)> = match store.kind {
        StoreKind::Memory | StoreKind::Embedded | StoreKind::Postgres => Vec::new(),
        StoreKind::Redis => vec![("store.url", &store.url)],
        StoreKind::RedisCluster => store.urls.iter().map(|url| ("store.urls", url)).collect(),
        StoreKind::RedisSentinel => store
            .sentinels
            .iter()
            .map(|url| ("store.sentinels", url))
            .collect(),
    };
    urls.into_iter()
        .filter_map(|(at, url)| redis::check_url(at, url).err())
        .collect()
}

/// The effective configuration as TOML, as `idemproxy check` prints it:
/// secrets redacted, and the credentials of every URL in it.
pub(crate) fn effective_toml(config: &Config) -> String {
    let mut shown = config.clone();
    if shown.admin_token.is_some() {
        shown.admin_token = Some("<redacted>".into());
    }
    if shown.store.password.is_some() {
        shown.store.password = Some("<redacted>".into());
    }
    let rendered = toml::Value::try_from(&shown).map(|mut value| {
        redact_urls(&mut value);
        without_inherited(&mut value);
        value
    });
    rendered
        .and_then(|value| toml::to_string_pretty(&value))
        .unwrap_or_else(|e| format!("# cannot render: {e}\n"))
}

/// Each route's table without the values it has from `[idempotency]`, as
/// a file would write it: what the route sets itself stands out, and the
/// printed file still loads to the same configuration.
fn without_inherited(config: &mut toml::Value) {
    let Some(table) = config.as_table_mut() else {
        return;
    };
    let Some(defaults) = table.get("idempotency").cloned() else {
        return;
    };
    let routes = table.get_mut("routes").and_then(toml::Value::as_array_mut);
    for route in routes
        .into_iter()
        .flatten()
        .filter_map(toml::Value::as_table_mut)
    {
        route.retain(|field, value| defaults.get(field) != Some(value));
    }
}

/// Every string in `value` that is a URL, redacted: whatever field holds
/// it (Redis, Sentinels, the upstream, the OTLP collector, any added
/// later), so no field can be forgotten.
fn redact_urls(value: &mut toml::Value) {
    match value {
        toml::Value::String(text) if text.contains("://") => *text = redact_url(text),
        toml::Value::Array(items) => items.iter_mut().for_each(redact_urls),
        toml::Value::Table(table) => table.iter_mut().for_each(|(_, v)| redact_urls(v)),
        _ => {}
    }
}

/// The routes' policies, in order, and the default one.
pub(crate) fn policies(config: &Config) -> Result<Policies, Vec<String>> {
    let mut problems = Vec::new();
    let verifier = token_verifier(&config.identity, &mut problems);
    let shared = Shared {
        upstream_timeout: config.upstream.timeout,
        store_timeout: config.store.timeout,
        verifier: verifier.as_ref(),
        client_certificates: config
            .tls
            .as_ref()
            .is_some_and(|tls| tls.client_ca_file.is_some()),
    };
    let mut routes = Vec::with_capacity(config.routes.len());
    for (i, route) in config.routes.iter().enumerate() {
        let at = format!("routes[{i}]");
        if let Some(mut policy) =
            policy(&at, &route.name, &route.idempotency, &shared, &mut problems)
        {
            if route.protocol == Protocol::Mcp {
                if policy.observe.is_some() {
                    problems.push(format!(
                        "{at}.mode: observe is not available on a protocol = \"mcp\" route \
                         (its tool calls are keyed by argument); use enforce"
                    ));
                }
                if let Some(mcp) = mcp_route(&route.name, &config.mcp, &mut problems) {
                    policy.settings.on_in_flight = config.mcp.on_in_flight;
                    policy.mcp = Some(Arc::new(mcp));
                }
            }
            routes.push((route.path.clone(), policy));
        }
    }
    let default = policy(
        "idempotency",
        "default",
        &config.idempotency,
        &shared,
        &mut problems,
    );
    match default {
        Some(default) if problems.is_empty() => Ok(Policies::new(routes, default)),
        _ => Err(problems),
    }
}

/// What every route's policy is built with.
struct Shared<'a> {
    upstream_timeout: std::time::Duration,
    store_timeout: std::time::Duration,
    /// Set when `[identity] jwks_file` is, and it reads.
    verifier: Option<&'a TokenVerifier>,
    /// Whether the listener verifies client certificates (`[tls]
    /// client_ca_file`), which `client_cert` scopes by.
    client_certificates: bool,
}

/// The verifier of `[identity]`, when a key set is configured.
fn token_verifier(identity: &IdentityConfig, problems: &mut Vec<String>) -> Option<TokenVerifier> {
    let path = identity.jwks_file.as_ref()?;
    let jwks = match std::fs::read_to_string(path) {
        Ok(jwks) => jwks,
        Err(e) => {
            problems.push(format!("identity.jwks_file: {}: {e}", path.display()));
            return None;
        }
    };
    let settings = IdentitySettings {
        jwks,
        issuer: identity.issuer.clone(),
        audience: identity.audience.clone(),
        leeway: identity.leeway,
    };
    TokenVerifier::new(&settings)
        .map_err(|why| problems.push(format!("identity.jwks_file: {}: {why}", path.display())))
        .ok()
}

/// One route's policy, or `None` with its problems added to `problems`.
fn policy(
    at: &str,
    route: &str,
    c: &IdempotencySettings,
    shared: &Shared<'_>,
    problems: &mut Vec<String>,
) -> Option<Policy> {
    let before = problems.len();
    let scope = |problems: &mut Vec<String>| {
        let attributes = parse_each(
            at,
            "scope",
            &c.scope,
            str::parse::<ScopeAttribute>,
            problems,
        );
        scope_rules(at, attributes, c.anonymous, shared, problems)
    };
    let lease = shared.upstream_timeout + c.lease_margin;
    let policy = Policy::new(at, route, c, scope, lease, problems);
    check_lease_margin(at, c.lease_margin, shared.store_timeout, problems);
    policy.filter(|_| problems.len() == before)
}

/// `[mcp]` as the MCP routes use it, or `None` with its problems added.
fn mcp_route(name: &str, c: &McpSettings, problems: &mut Vec<String>) -> Option<McpRoute> {
    let key = &c.key_argument;
    if key.is_empty()
        || !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        problems.push(format!(
            "mcp.key_argument: `{key}` is not an argument name; use letters, digits, `_` or `-` (e.g. `idempotency_key`)"
        ));
        return None;
    }
    match ToolRules::new(key, c.protect, &c.protect_tools, &c.skip_tools) {
        Ok(rules) => Some(McpRoute {
            rules,
            catalog: ToolCatalog::default(),
            strip_key_argument: c.strip_key_argument,
            replay_note: c.replay_note,
            sessions: Default::default(),
            shared: SharedCatalog::new(name),
        }),
        Err(why) => {
            problems.push(format!("mcp.{why}"));
            None
        }
    }
}

/// Clocks of replicas sharing a store differ a little; a lease read on
/// another replica's clock must not end before its holder is done.
const CLOCK_SKEW_ALLOWANCE: std::time::Duration = std::time::Duration::from_millis(250);

/// The lease is `upstream.timeout + lease_margin`: past it a retry
/// presumes the holder dead and settles its key (or takes it over with
/// `on_stale = "retry"`). The margin must cover what a live holder spends
/// beside the upstream exchange: its `begin`, its completion tries with
/// their pauses, and the clock skew allowance.
fn check_lease_margin(
    at: &str,
    margin: std::time::Duration,
    store_timeout: std::time::Duration,
    problems: &mut Vec<String>,
) {
    let needed = store_time_in_lease(store_timeout) + CLOCK_SKEW_ALLOWANCE;
    if margin < needed {
        problems.push(format!(
            "{at}.lease_margin: {} leaves a request that runs to upstream.timeout too little time to claim its key and store its outcome before its lease ends; use at least {} (a begin and three completion tries of store.timeout each, 150 ms of pauses between them, and 250 ms for clock skew between replicas)",
            humantime::format_duration(margin),
            humantime::format_duration(needed)
        ));
    }
}

/// The scope rules of one route: `jwt:` attributes need the key set,
/// `client_cert` a listener that verifies client certificates.
fn scope_rules(
    at: &str,
    attributes: Vec<ScopeAttribute>,
    anonymous: Anonymous,
    shared: &Shared<'_>,
    problems: &mut Vec<String>,
) -> ScopeRules {
    let needs_tokens = attributes
        .iter()
        .any(|a| matches!(a, ScopeAttribute::Jwt(_)));
    if attributes.contains(&ScopeAttribute::ClientCert) && !shared.client_certificates {
        problems.push(format!(
            "{at}.scope: `client_cert` needs [tls] client_ca_file, the CAs client certificates are verified against"
        ));
    }
    let rules = ScopeRules::new(attributes).anonymous(anonymous);
    match shared.verifier {
        Some(verifier) if needs_tokens => rules.verifier(verifier.clone()),
        None if needs_tokens => {
            problems.push(format!(
                "{at}.scope: a `jwt:` attribute needs [identity] jwks_file, the keys its tokens are verified with"
            ));
            rules
        }
        _ => rules,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{ConfigError, FlagOverrides, RouteConfig, MAX_TTL};
    use crate::idempotency::settings::Mode;
    use http::Method;

    fn config() -> Config {
        Config {
            routes: vec![
                RouteConfig {
                    name: "payments".into(),
                    path: "/v1/payments".into(),
                    idempotency: IdempotencySettings {
                        require_key: true,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                RouteConfig {
                    name: "v1".into(),
                    path: "/v1/".into(),
                    idempotency: IdempotencySettings {
                        methods: vec!["PUT".into()],
                        ..Default::default()
                    },
                    ..Default::default()
                },
            ],
            ..Config::default()
        }
    }

    #[test]
    fn first_matching_prefix_wins_on_segment_boundaries() {
        let p = policies(&config()).expect("valid");
        assert_eq!(&*p.for_path("/v1/payments").route, "payments");
        assert_eq!(&*p.for_path("/v1/payments/abc").route, "payments");
        assert_eq!(&*p.for_path("/v1/paymentsx").route, "v1");
        assert_eq!(&*p.for_path("/v1/emails").route, "v1");
        assert_eq!(&*p.for_path("/v2/x").route, "default");
    }

    #[test]
    fn unset_route_fields_inherit_the_defaults() {
        let p = policies(&config()).expect("valid");
        let payments = p.for_path("/v1/payments");
        assert!(payments.settings.require_key);
        assert!(payments.covers(&Method::POST) && payments.covers(&Method::PATCH));
        let v1 = p.for_path("/v1/x");
        assert!(!v1.settings.require_key);
        assert!(v1.covers(&Method::PUT) && !v1.covers(&Method::POST));
        assert_eq!(v1.lease, Duration::from_secs(35));
    }

    #[test]
    fn an_upstream_url_with_credentials_is_refused_without_echoing_them() {
        let mut c = Config::default();
        for url in [
            "https://svc:hunter2@api.internal",
            "https://svc:hun?ter2@api.internal",
            "https://svc:hun/ter2@api.internal",
            "https://svc:hun#ter2@api.internal",
            "https://svc:hun ter2@api.internal",
        ] {
            c.upstream.url = url.into();
            let err = crate::validate(&c).expect_err("credentials").to_string();
            assert!(err.contains("must not carry credentials"), "{url}: {err}");
            assert!(!err.contains("ter2"), "{url}: {err}");
        }
        c.upstream.url = "http://api.internal/v1?x=1".into();
        let err = crate::validate(&c).expect_err("query").to_string();
        assert!(err.contains("must not have a query"), "{err}");
        // Zero is refused where it would break something (a zero purge
        // interval panics in the purger's `interval`); drain_timeout may be.
        type Field = fn(&mut Config) -> &mut Duration;
        let fields: [(&str, Field); 6] = [
            ("upstream.timeout", |c| &mut c.upstream.timeout),
            ("upstream.connect_timeout", |c| {
                &mut c.upstream.connect_timeout
            }),
            ("upstream.pool_idle_timeout", |c| {
                &mut c.upstream.pool_idle_timeout
            }),
            ("store.timeout", |c| &mut c.store.timeout),
            ("store.purge_interval", |c| &mut c.store.purge_interval),
            ("request_body_timeout", |c| &mut c.request_body_timeout),
        ];
        for (name, field) in fields {
            let mut c = Config::default();
            *field(&mut c) = Duration::ZERO;
            let err = crate::validate(&c).expect_err(name).to_string();
            assert!(
                err.contains(&format!("{name}: must be greater than zero")),
                "{err}"
            );
        }
        let c = Config {
            drain_timeout: Duration::ZERO,
            ..Config::default()
        };
        assert!(crate::validate(&c).is_ok());
    }

    #[test]
    fn bad_values_name_their_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "[idempotency]\nmethods = []\nrelease_statuses = [1000]\n[upstream]\nurl = \"ftp://x\"\n",
        )
        .expect("write");
        let err = Config::load(Some(&file), Vec::new(), &FlagOverrides::default())
            .and_then(|c| crate::validate(&c).map(|()| c))
            .expect_err("invalid")
            .to_string();
        assert!(err.contains("idempotency.methods"), "{err}");
        assert!(err.contains("idempotency.release_statuses: 1000"), "{err}");
        assert!(err.contains("upstream.url"), "{err}");

        std::fs::write(&file, "[upstream]\nurll = \"x\"\n").expect("write");
        let err = Config::load(Some(&file), Vec::new(), &FlagOverrides::default())
            .and_then(|c| crate::validate(&c).map(|()| c))
            .expect_err("unknown field")
            .to_string();
        assert!(err.contains("urll"), "{err}");

        std::fs::write(&file, "[upstream]\ntimeout = \"soon\"\n").expect("write");
        let err = Config::load(Some(&file), Vec::new(), &FlagOverrides::default())
            .and_then(|c| crate::validate(&c).map(|()| c))
            .expect_err("bad duration")
            .to_string();
        assert!(err.contains("timeout"), "{err}");
    }

    #[test]
    fn key_sources_and_observe_mode_are_checked_by_field() {
        let mut c = Config::default();
        c.idempotency.key_from = vec!["json:tool_call_id".into(), "cookie:x".into()];
        c.idempotency.derive_key = vec!["query:k".into()];
        c.idempotency.mode = Mode::Observe;
        c.idempotency.observe_window = Duration::ZERO;
        let err = crate::validate(&c).expect_err("invalid").to_string();
        for field in [
            "idempotency.key_from: `json:tool_call_id`",
            "idempotency.key_from: `cookie:x`",
            "idempotency.derive_key: `query:k`",
            "idempotency.observe_window",
        ] {
            assert!(err.contains(field), "{field} in {err}");
        }
        let mut c = Config::default();
        c.routes.push(config::RouteConfig {
            name: "mcp".into(),
            path: "/mcp".into(),
            protocol: Protocol::Mcp,
            idempotency: IdempotencySettings {
                mode: Mode::Observe,
                ..Default::default()
            },
        });
        let err = crate::validate(&c).expect_err("observe on mcp").to_string();
        assert!(err.contains("routes[0].mode"), "{err}");
    }

    /// Settings that would load and then break quietly at run time: each is
    /// refused with its field named, and the value next to it is accepted.
    #[test]
    fn settings_that_would_fail_quietly_are_refused() {
        let refused = |what: &str, c: Config, field: &str| {
            let err = crate::validate(&c).expect_err(what).to_string();
            assert!(err.contains(field), "{what}: {err}");
        };
        let accepted = |what: &str, c: Config| {
            crate::validate(&c).unwrap_or_else(|e| panic!("{what} should be accepted: {e}"));
        };
        for (level, ok) in [
            ("info", true),
            ("WARN", true),
            ("idemproxy=debug,info", true),
            ("info,idemproxy::request=off", true),
            ("off", true),
            ("warning", false),
            ("idemproxy=verbose", false),
        ] {
            let mut c = Config::default();
            c.log.level = level.into();
            if ok {
                accepted(level, c);
            } else {
                refused(level, c, "log.level");
            }
        }

        let mut c = Config::default();
        c.idempotency.max_response_bytes = 0;
        refused("no response bytes", c, "idempotency.max_response_bytes");

        let mut c = Config::default();
        c.idempotency.ttl = MAX_TTL;
        accepted("a year's ttl", c.clone());
        c.idempotency.ttl = MAX_TTL + Duration::from_secs(1);
        refused("ttl past a year", c, "idempotency.ttl");

        let with_token = |token: &str| Config {
            admin_token: Some(token.into()),
            ..Config::default()
        };
        for token in ["s3cret\n", " s3cret", "s3crét"] {
            refused(token, with_token(token), "admin_token");
        }
        accepted(
            "a plain token",
            with_token("s3cret-Token_1-0123456789abcdefghij"),
        );
        refused("31 bytes", with_token(&"x".repeat(31)), "at least 32");
        accepted("32 bytes", with_token(&"x".repeat(32)));

        let mut c = Config::default();
        c.idempotency.fingerprint_ignore = vec!["/a~2".into()];
        refused("a bad escape", c, "idempotency.fingerprint_ignore");
        let mut c = Config::default();
        c.idempotency.fingerprint_ignore = vec!["/a~1b/~0".into()];
        accepted("escapes", c);
    }

    #[test]
    fn check_output_round_trips_and_redacts_the_admin_token() {
        let c = Config {
            admin_token: Some("s3cret-0123456789abcdef0123456789abcdef".into()),
            ..Config::default()
        };
        let text = effective_toml(&c);
        assert!(!text.contains("s3cret"));
        let with_password = Config {
            store: StoreSettings {
                kind: StoreKind::RedisCluster,
                urls: vec!["redis://app:pw@127.0.0.1:6379/2".into()],
                password: Some("pw".into()),
                ..StoreSettings::default()
            },
            ..Config::default()
        };
        let shown = effective_toml(&with_password);
        assert!(
            shown.contains("redis://app:<redacted>@127.0.0.1:6379/2"),
            "{shown}"
        );
        assert!(
            !shown.contains(":pw@") && !shown.contains("\"pw\""),
            "{shown}"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(&file, text).expect("write");
        let reloaded =
            Config::load(Some(&file), Vec::new(), &FlagOverrides::default()).expect("re-loads");
        // Everything but the placeholder is valid as printed; the
        // placeholder is too short to pass for a token by mistake.
        let err = crate::validate(&reloaded).expect_err("a placeholder token");
        let ConfigError::Invalid(problems) = err else {
            panic!("not a validation error: {err}");
        };
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("admin_token:"), "{problems:?}");
    }

    /// A route is printed as a file writes it, with what it sets itself,
    /// and reads back to the same policy.
    #[test]
    fn check_output_shows_what_a_route_sets_itself() {
        let mut c = config();
        // Routes hold what they inherit (see `Config::load`).
        for settings in c.routes.iter_mut().map(|r| &mut r.idempotency) {
            settings.ttl = Duration::from_secs(3600);
        }
        c.idempotency.ttl = Duration::from_secs(3600);
        let text = effective_toml(&c);
        let payments = text.split("[[routes]]").nth(1).expect("a route is printed");
        assert!(payments.contains("require_key = true"), "{payments}");
        assert!(
            !payments.contains("ttl") && !payments.contains("methods"),
            "{payments}"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(&file, &text).expect("write");
        let reloaded =
            Config::load(Some(&file), Vec::new(), &FlagOverrides::default()).expect("re-loads");
        for (printed, route) in reloaded.routes.iter().zip(&c.routes) {
            assert_eq!(printed.idempotency.ttl, Duration::from_secs(3600));
            assert_eq!(printed.idempotency.methods, route.idempotency.methods);
            assert_eq!(
                printed.idempotency.require_key,
                route.idempotency.require_key
            );
        }
    }

    /// The example files the docs point to load and validate as they
    /// are.
    #[test]
    fn the_example_configs_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
        let mut loaded = 0;
        for entry in std::fs::read_dir(&dir).expect("config/examples") {
            let file = entry.expect("entry").path();
            if file.extension().is_some_and(|e| e == "toml") {
                let valid = Config::load(Some(&file), Vec::new(), &FlagOverrides::default())
                    .and_then(|c| crate::validate(&c));
                if let Err(e) = valid {
                    panic!("{}: {e}", file.display());
                }
                loaded += 1;
            }
        }
        assert!(loaded >= 2, "{loaded} example files");
    }

    #[test]
    fn a_lease_margin_too_short_for_the_store_or_any_timeout_over_a_day_is_refused() {
        let problems = |c: &Config| match crate::validate(c) {
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
        // With store.timeout 250 ms: a begin and three completion tries
        // (1 s), their pauses (150 ms) and the skew allowance (250 ms).
        c.idempotency.lease_margin = Duration::from_millis(1399);
        assert!(
            problems(&c).contains("use at least 1s 400ms"),
            "{}",
            problems(&c)
        );
        c.idempotency.lease_margin = Duration::from_millis(1400);
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
}
