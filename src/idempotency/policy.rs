//! Which policy a request gets: `[[routes]]` are matched by path prefix in
//! order, first match wins; everything else gets `[idempotency]` under the
//! route name `default`.

use std::sync::Arc;
use std::time::Duration;

use http::Method;

use super::fingerprint::FingerprintRules;
use super::scope::ScopeRules;
use crate::config::{Config, IdempotencyConfig, OnAmbiguous, OnInFlight, OnStoreError, Profile};
use crate::store::OnStale;

/// A route's checked, ready-to-use policy.
#[derive(Debug)]
pub struct Policy {
    /// The `route` label of metrics and logs: a configured name, never a raw
    /// path, so label cardinality stays bounded.
    pub route: Arc<str>,
    pub methods: Vec<Method>,
    pub require_key: bool,
    pub profile: Profile,
    pub ttl: Duration,
    /// How long a pending claim protects the key: the upstream timeout plus a
    /// margin, so a live holder always finishes inside its lease.
    pub lease: Duration,
    pub on_in_flight: OnInFlight,
    pub wait_timeout: Duration,
    pub on_store_error: OnStoreError,
    pub on_ambiguous: OnAmbiguous,
    pub on_stale: OnStale,
    pub release_statuses: Vec<u16>,
    pub max_request_bytes: usize,
    pub max_response_bytes: usize,
    pub fingerprint: FingerprintRules,
    pub scope: ScopeRules,
}

impl Policy {
    fn new(route: &str, c: &IdempotencyConfig, upstream_timeout: Duration) -> Result<Self, String> {
        let methods = c
            .methods
            .iter()
            .map(|m| Method::from_bytes(m.as_bytes()).map_err(|e| format!("method `{m}`: {e}")))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            route: Arc::from(route),
            methods,
            require_key: c.require_key,
            profile: c.profile,
            ttl: c.ttl,
            lease: upstream_timeout + c.lease_margin,
            on_in_flight: c.on_in_flight,
            wait_timeout: c.wait_timeout,
            on_store_error: c.on_store_error,
            on_ambiguous: c.on_ambiguous,
            on_stale: c.on_stale,
            release_statuses: c.release_statuses.clone(),
            max_request_bytes: c.max_request_bytes,
            max_response_bytes: c.max_response_bytes,
            fingerprint: FingerprintRules::new(&c.fingerprint_headers, &c.fingerprint_ignore)?,
            scope: ScopeRules::new(&c.scope)?,
        })
    }

    pub fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    pub fn releases(&self, status: u16) -> bool {
        self.release_statuses.contains(&status)
    }
}

#[derive(Clone, Debug)]
pub struct Policies {
    routes: Vec<(String, Arc<Policy>)>,
    default: Arc<Policy>,
}

impl Policies {
    pub fn from_config(config: &Config) -> Result<Self, String> {
        let timeout = config.upstream.timeout;
        let routes = config
            .routes
            .iter()
            .map(|r| {
                let policy = Policy::new(&r.name, &r.resolve(&config.idempotency), timeout)
                    .map_err(|e| format!("routes `{}`: {e}", r.name))?;
                Ok((r.path.clone(), Arc::new(policy)))
            })
            .collect::<Result<_, String>>()?;
        let default = Arc::new(Policy::new("default", &config.idempotency, timeout)?);
        Ok(Self { routes, default })
    }

    /// The policy of the first route whose prefix matches `path` on a segment
    /// boundary (`/v1/pay` matches `/v1/pay` and `/v1/pay/x`, not `/v1/payx`).
    pub fn for_path(&self, path: &str) -> &Arc<Policy> {
        self.routes
            .iter()
            .find(|(prefix, _)| prefix_matches(prefix, path))
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

fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouteConfig;

    fn config() -> Config {
        Config {
            routes: vec![
                RouteConfig {
                    name: "payments".into(),
                    path: "/v1/payments".into(),
                    require_key: Some(true),
                    ..Default::default()
                },
                RouteConfig {
                    name: "v1".into(),
                    path: "/v1/".into(),
                    methods: Some(vec!["PUT".into()]),
                    ..Default::default()
                },
            ],
            ..Config::default()
        }
    }

    #[test]
    fn first_matching_prefix_wins_on_segment_boundaries() {
        let p = Policies::from_config(&config()).expect("valid");
        assert_eq!(&*p.for_path("/v1/payments").route, "payments");
        assert_eq!(&*p.for_path("/v1/payments/abc").route, "payments");
        assert_eq!(&*p.for_path("/v1/paymentsx").route, "v1");
        assert_eq!(&*p.for_path("/v1/emails").route, "v1");
        assert_eq!(&*p.for_path("/v2/x").route, "default");
    }

    #[test]
    fn unset_route_fields_inherit_the_defaults() {
        let p = Policies::from_config(&config()).expect("valid");
        let payments = p.for_path("/v1/payments");
        assert!(payments.require_key);
        assert!(payments.covers(&Method::POST) && payments.covers(&Method::PATCH));
        let v1 = p.for_path("/v1/x");
        assert!(!v1.require_key);
        assert!(v1.covers(&Method::PUT) && !v1.covers(&Method::POST));
        assert_eq!(v1.lease, Duration::from_secs(35));
    }
}
