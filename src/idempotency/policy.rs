//! Which policy a request gets: `[[routes]]` are matched by path prefix in
//! order, first match wins; everything else gets `[idempotency]` under the
//! route name `default`.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Method;

use super::mcp_catalog::SharedCatalog;
use super::observe::ObserveRoute;
use super::settings::{IdempotencySettings, Mode};
use crate::mcp::{SessionCalls, ToolCatalog, ToolRules};
use crate::request::fingerprint::{parse_header, validate_pointer, FingerprintRules};
use crate::request::key_source::{KeyAttribute, KeyRules, KeySource};
use crate::request::reconcile::LookupTemplate;
use crate::request::scope::ScopeRules;

/// The settings enums the policy carries as they are.
pub use super::settings::{OnAmbiguous, OnInFlight, OnStoreError, Profile};

/// A route's checked, ready-to-use policy.
#[derive(Debug)]
pub struct Policy {
    /// The `route` label of metrics and logs: a configured name, never a raw
    /// path, so label cardinality stays bounded.
    pub route: Arc<str>,
    /// The route's settings as the file says them, `[idempotency]` laid
    /// under its own table: what the request path reads as it is
    /// (`settings.ttl`, `settings.on_in_flight`, …). A new plain option is
    /// a field there and the code that reads it; what follows here is only
    /// what had to be parsed or built from them. (On an MCP route,
    /// `on_in_flight` is `[mcp]`'s: its retries are tool calls.)
    pub settings: IdempotencySettings,
    pub methods: Vec<Method>,
    /// How long a pending claim protects the key: the upstream timeout plus a
    /// margin, so a live holder always finishes inside its lease.
    pub lease: Duration,
    pub fingerprint: FingerprintRules,
    pub scope: ScopeRules,
    /// `key_from` and `derive_key`.
    pub keys: KeyRules,
    /// `observe`: nothing is answered from the store (DESIGN §6).
    pub observe: Option<ObserveRoute>,
    /// `replay_body_field`, when set.
    pub replay_body_field: Option<Arc<str>>,
    /// Set on a `protocol = "mcp"` route: its POSTs are JSON-RPC, and each
    /// `tools/call` is keyed and protected as `[mcp]` says.
    pub mcp: Option<Arc<McpRoute>>,
    /// `reconcile_url`, parsed; `None` when unset, and in observe mode
    /// (which answers nothing from the store).
    pub reconcile: Option<LookupTemplate>,
    /// Set on a route that scopes by the raw `Authorization` header until
    /// its first covered request with a bearer token has been warned about
    /// (see [`Policy::warn_if_bearer_scoped`]).
    bearer_scope_unwarned: AtomicBool,
}

/// What an MCP route knows besides its policy: the tool classification,
/// the tools its listings showed, and the `[mcp]` switches.
#[derive(Debug)]
pub struct McpRoute {
    pub rules: ToolRules,
    pub catalog: ToolCatalog,
    pub strip_key_argument: bool,
    pub replay_note: bool,
    /// The protected calls each session runs: its cancels and its DELETE
    /// wait for them (DESIGN §5.8).
    pub sessions: Arc<SessionCalls>,
    /// Where `catalog` is shared with other processes on the store.
    pub shared: SharedCatalog,
}

impl Policy {
    /// The policy of the route `route` as its `settings` say, `None` with
    /// each entry that does not parse added to `problems` as
    /// `<at>.<field>: why`, in the order of the fields. What takes more
    /// than the route's settings the caller builds: its `scope` rules
    /// (tokens are verified with `[identity]`'s keys; its problems added
    /// the same way) and its `lease` (`upstream.timeout + lease_margin`).
    pub fn new(
        at: &str,
        route: &str,
        settings: &IdempotencySettings,
        scope: impl FnOnce(&mut Vec<String>) -> ScopeRules,
        lease: Duration,
        problems: &mut Vec<String>,
    ) -> Option<Policy> {
        let c = settings;
        let before = problems.len();
        let methods = parse_each(at, "methods", &c.methods, parse_method, problems);
        let headers = parse_each(
            at,
            "fingerprint_headers",
            &c.fingerprint_headers,
            parse_header,
            problems,
        );
        let ignore = parse_each(
            at,
            "fingerprint_ignore",
            &c.fingerprint_ignore,
            |p| validate_pointer(p).map(|()| p.to_owned()),
            problems,
        );
        let scope = scope(problems);
        let key_from = parse_each(
            at,
            "key_from",
            &c.key_from,
            str::parse::<KeySource>,
            problems,
        );
        let derive_key = parse_each(
            at,
            "derive_key",
            &c.derive_key,
            str::parse::<KeyAttribute>,
            problems,
        );
        if c.mode == Mode::Observe && c.observe_window.is_zero() {
            problems.push(format!(
                "{at}.observe_window: must be more than 0 (e.g. \"10m\") in observe mode"
            ));
        }
        let reconcile = parse_reconcile(at, c, problems);
        if problems.len() > before {
            return None;
        }
        Some(Policy {
            route: Arc::from(route),
            settings: c.clone(),
            methods,
            lease,
            fingerprint: FingerprintRules::new(headers, ignore),
            scope,
            keys: KeyRules::new(key_from, derive_key).for_route(route),
            observe: (c.mode == Mode::Observe).then(|| ObserveRoute::new(c.observe_window)),
            replay_body_field: (!c.replay_body_field.is_empty())
                .then(|| Arc::from(c.replay_body_field.as_str())),
            mcp: None,
            reconcile: reconcile.filter(|_| c.mode == Mode::Enforce),
            bearer_scope_unwarned: AtomicBool::new(
                c.scope
                    .iter()
                    .any(|s| s.eq_ignore_ascii_case("header:authorization")),
            ),
        })
    }

    /// Warns, once per route, when a route scoped by the raw
    /// `Authorization` header sees its first bearer token: such tokens are
    /// refreshed between a lost answer and its retry, which then lands in
    /// a new scope and executes again. Warning at startup instead would
    /// greet every default configuration (the demo's first screen
    /// included), whose callers may send API keys that never change.
    pub fn warn_if_bearer_scoped(&self, headers: &http::HeaderMap) {
        if !self.bearer_scope_unwarned.load(Ordering::Relaxed) {
            return;
        }
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|value| value.as_bytes().get(..7))
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case(b"bearer "));
        if bearer && self.bearer_scope_unwarned.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                route = %self.route,
                "route `{}` scopes keys by the raw Authorization header and was sent a \
                 bearer token: a retry sent with a refreshed token lands in a new scope and \
                 executes again; scope by who calls (jwt:sub with [identity], or a tenant header)",
                self.route
            );
        }
    }

    /// How long a lookup may take: `reconcile_timeout`, or the upstream's
    /// (`upstream_timeout`) when that is zero.
    pub fn lookup_timeout(&self, upstream_timeout: Duration) -> Duration {
        match self.settings.reconcile_timeout {
            Duration::ZERO => upstream_timeout,
            timeout => timeout,
        }
    }

    pub fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    pub fn releases(&self, status: u16) -> bool {
        self.settings.release_statuses.contains(&status)
    }
}

#[derive(Clone, Debug)]
pub struct Policies {
    routes: Vec<(String, Arc<Policy>)>,
    default: Arc<Policy>,
}

impl Policies {
    /// `routes` as (path prefix, policy), matched in order; `default` for
    /// every other path.
    pub fn new(routes: Vec<(String, Policy)>, default: Policy) -> Self {
        Self {
            routes: routes
                .into_iter()
                .map(|(prefix, policy)| (normalize_path(&prefix).into_owned(), Arc::new(policy)))
                .collect(),
            default: Arc::new(default),
        }
    }

    /// The policy of the first route whose prefix matches `path` on a segment
    /// boundary (`/v1/pay` matches `/v1/pay` and `/v1/pay/x`, not `/v1/payx`).
    ///
    /// Matched on the normalized path ([`normalize_path`]): `/v1//payments`,
    /// `/v1/%70ayments` and `/v1/./payments` are `/v1/payments` to most
    /// upstream routers, so they get its policy here too, instead of a
    /// narrower default under which a keyed POST would pass unprotected.
    /// The request is still forwarded as it was sent.
    pub fn for_path(&self, path: &str) -> &Arc<Policy> {
        let path = normalize_path(path);
        self.routes
            .iter()
            .find(|(prefix, _)| prefix_matches(prefix, &path))
            .map(|(_, p)| p)
            .unwrap_or(&self.default)
    }
}

impl Policies {
    /// Every policy: the routes in order, then the default.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.routes
            .iter()
            .map(|(_, p)| p)
            .chain(std::iter::once(&self.default))
    }

    /// The policy of the route called `name` (`default` for `[idempotency]`).
    pub fn by_name(&self, name: &str) -> Option<&Arc<Policy>> {
        if name == "default" {
            return Some(&self.default);
        }
        self.routes
            .iter()
            .map(|(_, p)| p)
            .find(|p| &*p.route == name)
    }
}

/// Parses every entry of the list `field` of `at`, reporting each one that
/// does not parse as `<at>.<field>: why`.
pub fn parse_each<T>(
    at: &str,
    field: &str,
    values: &[String],
    parse: impl Fn(&str) -> Result<T, String>,
    problems: &mut Vec<String>,
) -> Vec<T> {
    values
        .iter()
        .filter_map(|value| match parse(value) {
            Ok(parsed) => Some(parsed),
            Err(why) => {
                problems.push(format!("{at}.{field}: {why}"));
                None
            }
        })
        .collect()
}

/// An upper-case HTTP method: `post` would never match, since methods are
/// case-sensitive.
fn parse_method(m: &str) -> Result<Method, String> {
    match Method::from_bytes(m.as_bytes()) {
        Ok(method) if m.to_ascii_uppercase() == m => Ok(method),
        _ => Err(format!("`{m}` is not an upper-case HTTP method")),
    }
}

fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

/// A path as an upstream router reads it, for matching only (RFC 3986
/// §6.2.2): percent-encoded unreserved characters decoded (`%70` is `p`;
/// an encoded `/` or anything else stays encoded, as it names no segment
/// boundary), empty segments dropped (`//`), and `.` and `..` segments
/// resolved (§5.2.4; `..` never climbs above the root). A path that needs
/// none of it, the usual case, is returned as it is, without a copy.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    if !path.contains('%') && !path.contains("//") && !path.contains("/.") {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    for segment in decoded.split('/') {
        trailing_slash = false;
        match segment {
            "" | "." => trailing_slash = true,
            ".." => {
                segments.pop();
                trailing_slash = true;
            }
            segment => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if trailing_slash || segments.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// `%XX` decoded where it encodes an unreserved character (ALPHA, DIGIT,
/// `-`, `.`, `_`, `~`); every other byte as it is.
fn decode_unreserved(path: &str) -> Cow<'_, str> {
    if !path.contains('%') {
        return Cow::Borrowed(path);
    }
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = (bytes[i] == b'%')
            .then(|| path.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok())
            .filter(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'));
        match decoded {
            Some(b) => {
                out.push(char::from(b));
                i += 3;
            }
            None => {
                // Whole characters: `i` is always at a char boundary here,
                // since only ASCII triples are skipped.
                let ch = path[i..].chars().next().unwrap_or_default();
                out.push(ch);
                i += ch.len_utf8().max(1);
            }
        }
    }
    Cow::Owned(out)
}

/// `reconcile_url` and its statuses; `None` when unset or refused (each
/// problem added to `problems`).
fn parse_reconcile(
    at: &str,
    c: &IdempotencySettings,
    problems: &mut Vec<String>,
) -> Option<LookupTemplate> {
    if c.reconcile_url.is_empty() {
        return None;
    }
    let template = c
        .reconcile_url
        .parse::<LookupTemplate>()
        .map_err(|why| problems.push(format!("{at}.reconcile_url: {why}")))
        .ok();
    let found = &c.reconcile_found_statuses;
    let absent = &c.reconcile_absent_statuses;
    if let Some(both) = found.iter().find(|s| absent.contains(s)) {
        problems.push(format!(
            "{at}.reconcile_absent_statuses: {both} is also a found status"
        ));
    }
    for (field, statuses) in [
        ("reconcile_found_statuses", found),
        ("reconcile_absent_statuses", absent),
    ] {
        if let Some(bad) = statuses.iter().find(|s| !(100..=599).contains(*s)) {
            problems.push(format!("{at}.{field}: {bad} is not an HTTP status"));
        }
    }
    template
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_matched_as_routers_read_them() {
        for (sent, read) in [
            ("/v1/payments", "/v1/payments"),
            ("/v1//payments", "/v1/payments"),
            ("//v1/payments/", "/v1/payments/"),
            ("/v1/%70ayments", "/v1/payments"),
            ("/v1/%2e/payments", "/v1/payments"),
            ("/v1/./payments", "/v1/payments"),
            ("/v1/x/../payments", "/v1/payments"),
            ("/../../v1/payments", "/v1/payments"),
            ("/v1/payments/.", "/v1/payments/"),
            ("/v1/pay%2Fments", "/v1/pay%2Fments"),
            ("/v1/caf%C3%A9/ü", "/v1/caf%C3%A9/ü"),
            ("/v1/%7euser", "/v1/~user"),
            ("/v1/%zz", "/v1/%zz"),
            ("/v1/%", "/v1/%"),
            ("/", "/"),
            ("//", "/"),
        ] {
            assert_eq!(normalize_path(sent), read, "{sent}");
        }
        assert!(matches!(
            normalize_path("/v1/payments/p_1"),
            Cow::Borrowed(_)
        ));
    }

    fn reconcile_problems(tune: impl FnOnce(&mut IdempotencySettings)) -> Vec<String> {
        let mut settings = IdempotencySettings::default();
        tune(&mut settings);
        let mut problems = Vec::new();
        let scope = |_: &mut Vec<String>| ScopeRules::default();
        Policy::new(
            "routes[0]",
            "r",
            &settings,
            scope,
            Duration::from_secs(35),
            &mut problems,
        );
        problems
    }

    #[test]
    fn reconcile_settings_are_checked_at_startup() {
        assert!(reconcile_problems(|_| {}).is_empty());
        let good = reconcile_problems(|s| s.reconcile_url = "/v1/p?ref={json:/order}".into());
        assert!(good.is_empty(), "{good:?}");
        let problems = reconcile_problems(|s| {
            s.reconcile_url = "/v1/p/{order}".into();
            s.reconcile_absent_statuses = vec![404, 200];
            s.reconcile_found_statuses = vec![200, 700];
        });
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("routes[0].reconcile_url: `{order}`"));
        assert!(problems[1].starts_with("routes[0].reconcile_absent_statuses: 200"));
        assert!(problems[2].starts_with("routes[0].reconcile_found_statuses: 700"));
    }

    #[test]
    fn observe_mode_never_reconciles() {
        let mut settings = IdempotencySettings {
            reconcile_url: "/v1/p/{key}".into(),
            ..IdempotencySettings::default()
        };
        let scope = |_: &mut Vec<String>| ScopeRules::default();
        let lease = Duration::from_secs(35);
        let enforce = Policy::new("r", "r", &settings, scope, lease, &mut Vec::new());
        assert!(enforce.is_some_and(|p| p.reconcile.is_some()));
        settings.mode = Mode::Observe;
        let observe = Policy::new("r", "r", &settings, scope, lease, &mut Vec::new());
        assert!(observe.is_some_and(|p| p.reconcile.is_none()));
    }
}
