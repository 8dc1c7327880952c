//! Who may use the key API: the bearer token, compared in constant time,
//! and a per-peer limit on failed attempts at it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};

use crate::request::identity::bearer;

/// Failed attempts at the admin token allowed per peer and window: past
/// them that peer's wrong tokens are answered 429 until its window ends,
/// so the token cannot be guessed at line rate. Only failures count, and
/// only the failing peer's: the right token is checked first and never
/// refused, so nobody who can reach the admin port can lock the operators
/// out by failing on purpose. With tokens of at least 32 bytes (checked at
/// startup) guessing is hopeless anyway; this keeps a misbehaving script
/// from hammering the listener.
pub(super) const MAX_FAILURES: u32 = 100;
pub(super) const FAILURE_WINDOW: Duration = Duration::from_secs(10);

/// Peers whose failures are remembered at once. A table that is full even
/// after forgetting ended windows counts a new peer as over its limit:
/// many addresses failing together (an IPv6 range) cannot push out the
/// one being limited, and costs nobody with the right token anything.
const MAX_PEERS: usize = 4096;

/// Who failed: the peer's address, an IPv6 peer by its /64 (one host
/// commonly holds the whole prefix). `None` when the listener gave no
/// address (the router served without connection info, as in unit tests).
type PeerId = Option<IpAddr>;

/// The configured admin token and the failed attempts at it.
#[derive(Debug, Default)]
pub struct AdminToken {
    /// SHA-256 of the configured token, so comparisons take the same time
    /// whatever the guess. `None`: the key API is refused.
    digest: Option<[u8; 32]>,
    /// The failures of each peer's current window.
    failures: Mutex<HashMap<PeerId, (Instant, u32)>>,
}

/// Why a call to the key API is refused.
pub(super) enum TokenRefusal {
    /// No token is configured.
    Disabled,
    /// The peer failed too often in this window.
    RateLimited,
    /// No token, or the wrong one.
    Unauthorized,
}

impl AdminToken {
    /// `token`: the configured `admin_token`; `None` refuses every call.
    pub fn new(token: Option<&str>) -> Self {
        Self {
            digest: token.map(|t| Sha256::digest(t.as_bytes()).into()),
            failures: Mutex::default(),
        }
    }

    /// Whether `headers` carry the token; a failure counts against `peer`.
    pub(super) fn check(&self, peer: &Peer, headers: &HeaderMap) -> Result<(), TokenRefusal> {
        let Some(expected) = self.digest else {
            return Err(TokenRefusal::Disabled);
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| bearer(v.as_bytes()));
        // Digests compared in constant time: how long the comparison takes
        // says nothing of how much of a guess was right.
        let ok = given.is_some_and(|g| {
            let digest: [u8; 32] = Sha256::digest(g.as_bytes()).into();
            let differing = digest
                .iter()
                .zip(expected.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            std::hint::black_box(differing) == 0
        });
        if ok {
            Ok(())
        } else if self.failed(peer.0) {
            Err(TokenRefusal::RateLimited)
        } else {
            Err(TokenRefusal::Unauthorized)
        }
    }

    fn peers(&self) -> MutexGuard<'_, HashMap<PeerId, (Instant, u32)>> {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one failure of `peer`; whether it is over the limit, this
    /// one included.
    fn failed(&self, peer: PeerId) -> bool {
        let mut peers = self.peers();
        let now = Instant::now();
        if !peers.contains_key(&peer) && peers.len() >= MAX_PEERS {
            peers.retain(|_, (started, _)| now.duration_since(*started) < FAILURE_WINDOW);
            if peers.len() >= MAX_PEERS {
                return true;
            }
        }
        let (started, failures) = peers.entry(peer).or_insert((now, 0));
        if now.duration_since(*started) >= FAILURE_WINDOW {
            (*started, *failures) = (now, 0);
        }
        *failures = failures.saturating_add(1);
        *failures > MAX_FAILURES
    }
}

/// The admin connection's peer, from the listener's connection info.
#[derive(Debug)]
pub struct Peer(PeerId);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        let ip = parts
            .extensions
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .map(|info| match info.0.ip().to_canonical() {
                IpAddr::V6(v6) => {
                    let mut octets = v6.octets();
                    octets[8..].fill(0);
                    IpAddr::V6(octets.into())
                }
                v4 => v4,
            });
        Ok(Peer(ip))
    }
}
