//! `mode = "observe"` (DESIGN §6): what a route remembers to tell which
//! requests enforcement would have answered differently, while every
//! request reaches the upstream as if the proxy were plain.
//!
//! Keyed requests are judged by the store, as under enforcement: the first
//! claims and stores, a later one is counted as the replay, mismatch or
//! in-flight duplicate it would have been. Keyless covered requests have
//! nothing in the store, so the route remembers each (scope, fingerprint)
//! it saw for `observe_window`: one seen again within the window is a
//! duplicate that no key catches (`observed_unkeyed_duplicate`). That
//! memory, and which request came first (for the log line), is this
//! replica's own and bounded ([`REMEMBERED`] entries; past that the least
//! used go first, so a flood of distinct requests can undercount, never
//! grow memory). Several replicas each count the duplicates they saw.

use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::core::{Fingerprint, RecordKey};

/// How many requests a route remembers.
pub const REMEMBERED: usize = 100_000;

/// A route's observe-mode memory.
pub struct ObserveRoute {
    window: Duration,
    /// By record key (keyed requests) or by (scope, fingerprint) hash
    /// (keyless ones): the first request's id and when it was seen.
    seen: Cache<RecordKey, Seen>,
}

#[derive(Clone)]
struct Seen {
    request_id: Option<Arc<str>>,
    at: Instant,
}

impl std::fmt::Debug for ObserveRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObserveRoute")
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

/// What the route had seen of a request's identity.
#[derive(Debug, PartialEq, Eq)]
pub enum Sighting {
    /// Not within the window: this request is the first.
    First,
    /// Seen within the window, first by the request with this id.
    Again { first_request_id: Option<Arc<str>> },
}

impl ObserveRoute {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            seen: Cache::new(REMEMBERED),
        }
    }

    /// The identity of a keyless request: its scope and fingerprint.
    pub fn keyless_identity(scope: &[u8; 32], fingerprint: &Fingerprint) -> RecordKey {
        let mut h = Sha256::new();
        h.update(b"idemproxy.observe.keyless.v1\0");
        h.update(scope);
        h.update(fingerprint.0);
        RecordKey::from_bytes(h.finalize().into())
    }

    /// The namespace an observe route's keyed records live in, apart from
    /// enforced ones for the same caller: a key an observe route saw first
    /// must be new to an enforce route (never a 409 there, never a replay
    /// of a record enforcement did not make), including the same route
    /// after it is switched to enforce.
    pub fn records_scope(scope: &[u8; 32]) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"idemproxy.observe.records.v1\0");
        h.update(scope);
        h.finalize().into()
    }

    /// Notes a request of `identity` with `request_id`, and says whether
    /// one was seen within the window (the first one stays first).
    pub fn sight(&self, identity: RecordKey, request_id: Option<&str>) -> Sighting {
        let now = Instant::now();
        if let Some(seen) = self.seen.get(&identity) {
            if now.duration_since(seen.at) < self.window {
                return Sighting::Again {
                    first_request_id: seen.request_id,
                };
            }
        }
        self.remember(identity, request_id);
        Sighting::First
    }

    /// Records `request_id` as the first of `identity` (a keyed request
    /// that claimed its key).
    pub fn remember(&self, identity: RecordKey, request_id: Option<&str>) {
        self.seen.insert(
            identity,
            Seen {
                request_id: request_id.map(Arc::from),
                at: Instant::now(),
            },
        );
    }

    /// The id of the first request of `identity`, if remembered.
    pub fn first_request_id(&self, identity: &RecordKey) -> Option<Arc<str>> {
        self.seen.get(identity).and_then(|seen| seen.request_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_request_seen_again_within_the_window_is_a_duplicate_of_the_first() {
        let route = ObserveRoute::new(Duration::from_secs(600));
        let a = ObserveRoute::keyless_identity(&[1; 32], &Fingerprint([7; 32]));
        let other_scope = ObserveRoute::keyless_identity(&[2; 32], &Fingerprint([7; 32]));
        assert_eq!(route.sight(a, Some("req-1")), Sighting::First);
        assert_eq!(route.sight(other_scope, Some("req-x")), Sighting::First);
        tokio::time::advance(Duration::from_secs(599)).await;
        assert_eq!(
            route.sight(a, Some("req-2")),
            Sighting::Again {
                first_request_id: Some(Arc::from("req-1"))
            }
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            route.sight(a, Some("req-3")),
            Sighting::First,
            "past the window a request is new again"
        );
        assert_eq!(route.first_request_id(&a).as_deref(), Some("req-3"));
    }
}
