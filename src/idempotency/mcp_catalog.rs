//! What an MCP route's `tools/list` answers taught, shared through the
//! store. A tool never seen in a listing is protected (DESIGN §5.1), so a
//! catalog kept in one process alone makes a restarted proxy, or another
//! replica, refuse the calls of read-only tools as "needs a key" until a
//! listing passes through it. Each route's catalog is kept as one record
//! under a fixed key ([`shared_catalog_key`]): written after a listing
//! taught something new, read when a call names a tool the process does not
//! know, at most once per [`REFRESH`], never on every request.
//!
//! The record goes through the `Store` trait as any key does: claimed with
//! a fingerprint of its content, completed with the catalog as its body. A
//! catalog that changed is a fingerprint mismatch: the old record is removed
//! and the new one written. Replicas that learn at the same moment may
//! overwrite each other's additions; the next listing through either
//! teaches them again, and an unknown tool is protected meanwhile: the
//! error is always on the safe side.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::core::RecordKey;

/// How often a process looks at the shared record for a tool it does not
/// know: often enough that a replica learns a listing within seconds,
/// rarely enough that calls of a tool no listing shows cost the store
/// nothing more than once per interval.
pub(super) const REFRESH: Duration = Duration::from_secs(2);

/// Where a route's catalog is shared in the store: a fixed record key,
/// derived from the route's name in a domain of its own (no key a caller
/// sends can hash to it).
pub fn shared_catalog_key(route: &str) -> RecordKey {
    let digest = Sha256::new()
        .chain_update(b"idemproxy.mcp.catalog.v1\0")
        .chain_update(route.as_bytes())
        .finalize();
    RecordKey::from_bytes(digest.into())
}

/// A route's link to its shared catalog record.
#[derive(Debug)]
pub struct SharedCatalog {
    pub(super) key: RecordKey,
    /// When this process last read the record.
    last_read: Mutex<Option<Instant>>,
}

impl SharedCatalog {
    pub fn new(route: &str) -> Self {
        Self {
            key: shared_catalog_key(route),
            last_read: Mutex::new(None),
        }
    }

    /// Whether a read is due, marking it taken if so.
    pub(super) fn take_read(&self) -> bool {
        let now = Instant::now();
        let mut last = self
            .last_read
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|at| now.duration_since(at) < REFRESH) {
            return false;
        }
        *last = Some(now);
        true
    }
}
