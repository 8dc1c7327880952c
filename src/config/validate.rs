//! Checking what a loaded configuration means, every problem named by the
//! field that carries it so that an operator fixes them all in one go, and
//! showing the configuration without its secrets (`idemproxy check`).

use std::time::Duration;

use super::{Config, ConfigError, IdempotencySettings, OnInFlight, ReconcileProof, StoreKind};

impl Config {
    /// Checks every field and names each problem by its path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check_timeouts_and_limits(&mut problems);
        self.check_store(&mut problems);
        self.check_tls_and_admin_token(&mut problems);
        if let Err(why) = check_log_level(&self.log.level) {
            problems.push(format!("log.level: {why}"));
        }
        self.check_telemetry(&mut problems);
        self.check_policies(&mut problems);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// What is valid but deserves a second look, each named by its field
    /// (`idemproxy check` prints them; the proxy logs them when it starts).
    /// A route that inherits the setting from `[idempotency]` is covered
    /// by the warning about `[idempotency]`.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        lookup_warnings("idempotency", &self.idempotency, &mut warnings);
        for (i, route) in self.routes.iter().enumerate() {
            let (own, defaults) = (&route.idempotency, &self.idempotency);
            let inherited = own.reconcile_url == defaults.reconcile_url
                && own.reconcile_proof == defaults.reconcile_proof
                && own.reconcile_found_statuses == defaults.reconcile_found_statuses
                && own.reconcile_absent_statuses == defaults.reconcile_absent_statuses;
            if !inherited {
                lookup_warnings(&format!("routes[{i}]"), own, &mut warnings);
            }
        }
        warnings
    }

    fn check_telemetry(&self, problems: &mut Vec<String>) {
        let telemetry = &self.telemetry;
        if let Some(endpoint) = &telemetry.otlp_endpoint {
            let uri = endpoint.parse::<http::Uri>();
            let scheme = uri.as_ref().ok().and_then(|u| u.scheme_str());
            let host = uri.as_ref().ok().and_then(|u| u.host());
            if !matches!(scheme, Some("http" | "https")) || host.is_none() {
                // Not echoed: a URL that does not parse may still carry a
                // token, and where in it is anyone's guess.
                problems.push(
                    "telemetry.otlp_endpoint: not an http:// or https:// URL \
                     (the collector's OTLP/HTTP address, e.g. http://otel-collector:4318)"
                        .into(),
                );
            }
        }
        if !(0.0..=1.0).contains(&telemetry.sample_ratio) {
            problems.push(format!(
                "telemetry.sample_ratio: {} is not between 0 and 1",
                telemetry.sample_ratio
            ));
        }
        if telemetry.service_name.trim().is_empty() {
            problems.push("telemetry.service_name: must not be empty".into());
        }
    }

    fn check_timeouts_and_limits(&self, problems: &mut Vec<String>) {
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
            check_at_most_a_day(field, value, problems);
        }
        // Zero is allowed: stop at once.
        check_at_most_a_day("drain_timeout", self.drain_timeout, problems);
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
    }

    fn check_store(&self, problems: &mut Vec<String>) {
        match self.store.kind {
            // Checked where they are parsed (`postgres::check_settings`),
            // which the composition root runs.
            StoreKind::Memory | StoreKind::Embedded | StoreKind::Postgres => {}
            // URLs are checked where they are parsed: the Redis store's
            // `check_url`, which the composition root runs.
            StoreKind::Redis => {}
            StoreKind::RedisCluster => {
                if self.store.urls.is_empty() {
                    problems
                        .push("store.urls: redis-cluster needs at least one seed node URL".into());
                }
                if self.store.database.is_some_and(|db| db != 0) {
                    problems.push("store.database: Redis Cluster has only database 0".into());
                }
            }
            StoreKind::RedisSentinel => {
                if self.store.sentinels.is_empty() {
                    problems.push(
                        "store.sentinels: redis-sentinel needs at least one Sentinel URL \
                         (e.g. \"redis://127.0.0.1:26379\")"
                            .into(),
                    );
                }
                if self.store.master_name.is_empty() {
                    problems.push(
                        "store.master_name: redis-sentinel needs the name the Sentinels monitor \
                         the primary under (e.g. \"mymaster\")"
                            .into(),
                    );
                }
            }
        }
        if self.store.min_replica_acks > 0 && self.store.replica_ack_timeout >= self.store.timeout {
            problems.push(format!(
                "store.replica_ack_timeout: {:?} must be below store.timeout ({:?}), which bounds the claim and its WAIT together",
                self.store.replica_ack_timeout, self.store.timeout
            ));
        }
        if let Some(ca) = &self.store.ca_file {
            if !ca.is_file() {
                problems.push(format!("store.ca_file: {} is not a file", ca.display()));
            }
        }
    }

    fn check_tls_and_admin_token(&self, problems: &mut Vec<String>) {
        if let Some(tls) = &self.tls {
            let files = [
                ("tls.cert_file", Some(&tls.cert_file)),
                ("tls.key_file", Some(&tls.key_file)),
                ("tls.client_ca_file", tls.client_ca_file.as_ref()),
            ];
            for (field, path) in files.into_iter().filter_map(|(f, p)| Some((f, p?))) {
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
            // It guards deleting records, which lets a request run again.
            Some(token) if token.len() < MIN_ADMIN_TOKEN_BYTES => problems.push(format!(
                "admin_token: {} bytes are too few to resist guessing; use at least \
                 {MIN_ADMIN_TOKEN_BYTES} (e.g. `openssl rand -hex 32`); the token is not shown",
                token.len()
            )),
            _ => {}
        }
    }

    /// `[idempotency]`, then each route: its own fields, and its settings
    /// (`[idempotency]` under what it sets itself, see [`Config::load`]).
    fn check_policies(&self, problems: &mut Vec<String>) {
        validate_policy("idempotency", &self.idempotency, problems);
        let mut names = std::collections::HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            if route.name.is_empty() {
                problems.push(format!("{at}.name: must be set"));
            } else if route.name == "default" {
                // `[idempotency]` is the route `default` (metrics, logs, the
                // admin lookup, derived keys): a route of that name would
                // share its namespace.
                problems.push(format!(
                    "{at}.name: `default` is the name of the `[idempotency]` defaults; choose another"
                ));
            } else if !names.insert(route.name.as_str()) {
                problems.push(format!("{at}.name: `{}` is used twice", route.name));
            }
            if !route.path.starts_with('/') {
                problems.push(format!("{at}.path: `{}` must start with `/`", route.path));
            }
            validate_policy(&at, &route.idempotency, problems);
        }
    }
}

/// A lookup that trusts statuses alone can read a route the upstream
/// lacks (404) as "never happened" and run the payment again; status
/// lists that nothing reads are a misunderstanding worth naming.
fn lookup_warnings(at: &str, p: &IdempotencySettings, warnings: &mut Vec<String>) {
    if p.reconcile_url.is_empty() {
        return;
    }
    let defaults = IdempotencySettings::default();
    match p.reconcile_proof {
        ReconcileProof::Status => warnings.push(format!(
            "{at}.reconcile_proof = \"status\": a lookup status alone resolves unknown outcomes, \
             so a bare {absent:?} from a route the upstream lacks (a typo in reconcile_url, an \
             older deployment) reads as \"never happened\" and the request executes again; \
             have the lookup answer Idempotency-Lookup: found|absent and use \"header\" \
             (docs/guarantees.md, \"The lookup protocol\")",
            absent = p.reconcile_absent_statuses,
        )),
        ReconcileProof::Header => {
            let lists_set = p.reconcile_found_statuses != defaults.reconcile_found_statuses
                || p.reconcile_absent_statuses != defaults.reconcile_absent_statuses;
            if lists_set {
                warnings.push(format!(
                    "{at}.reconcile_found_statuses / reconcile_absent_statuses apply only with \
                     reconcile_proof = \"status\"; with \"header\" (the default) the lookup's \
                     Idempotency-Lookup header decides"
                ));
            }
        }
    }
}

/// The shortest admin token accepted.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 32;

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

fn validate_policy(at: &str, p: &IdempotencySettings, problems: &mut Vec<String>) {
    // What the margin must cover is checked where the request path's
    // store calls are known: `settings::policies` at the crate root.
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
    // Methods, header names, JSON pointers and key sources are parsed (and
    // reported by field) where they become the policy's own types, once:
    // `idempotency::Policy::new`; scope attributes, which need `[identity]`
    // and `[tls]`, in `settings::policies` at the crate root.
}
