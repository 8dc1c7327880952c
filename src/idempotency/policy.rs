//! Which policy a request gets: `[[routes]]` are matched by path prefix in
//! order, first match wins; everything else gets `[idempotency]` under the
//! route name `default`.

use std::sync::Arc;
use std::time::Duration;

use http::Method;

use super::fingerprint::FingerprintRules;
use super::scope::ScopeRules;
use crate::core::OnStale;

/// Which status codes the proxy's own answers use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    /// 409 for a reused key, 425 for a key in flight.
    #[default]
    Default,
    /// draft-ietf-httpapi-idempotency-key-header: 422 reused, 409 in flight.
    Ietf,
}

/// What a duplicate that arrives while its key is in flight gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnInFlight {
    /// 425 (or 409) at once, with `Retry-After`.
    Reject,
    /// Held up to `wait_timeout`, then replayed.
    Wait,
}

/// What a request gets when the store cannot answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnStoreError {
    /// 503 `store-unavailable`.
    Reject,
    /// Forwarded without protection (counted as `unprotected`).
    Pass,
}

/// What happens to a key whose request may have executed (upstream timeout
/// or reset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnAmbiguous {
    /// Stored as `outcome-unknown`: fail closed.
    Store,
    /// Released: a retry executes again.
    Release,
}

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
    /// `routes` as (path prefix, policy), matched in order; `default` for
    /// every other path.
    pub fn new(routes: Vec<(String, Policy)>, default: Policy) -> Self {
        Self {
            routes: routes
                .into_iter()
                .map(|(prefix, policy)| (prefix, Arc::new(policy)))
                .collect(),
            default: Arc::new(default),
        }
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
