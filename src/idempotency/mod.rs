//! Idempotency-Key enforcement as a tower middleware, over any inner
//! service whose error says whether the request could have executed
//! (`Into<UpstreamFailure>`).
//!
//! A covered request (a method in its route's `methods`) that carries an
//! `Idempotency-Key` runs against the upstream at most once per (scope, key):
//! the first one claims the key in the store and executes; every retry is
//! answered from the stored record — replayed when it is the same request,
//! refused when it is a different one (409) or still running (425). The full
//! contract is the table in the README.
//!
//! - [`key`]: parsing the header;
//! - [`fingerprint`] (over [`jcs`], RFC 8785) and [`scope`]: what "the same
//!   request" and "the same caller" mean;
//! - [`policy`]: per-route settings;
//! - [`service`]: the layer, the service and the request path;
//! - [`rejection`]: every answer the proxy makes itself, as problem+json.

pub mod body;
pub mod fingerprint;
pub mod jcs;
pub mod key;
pub mod policy;
pub mod rejection;
pub mod scope;
pub mod service;

pub use policy::{Policies, Policy};
pub use rejection::Rejection;
pub use service::{Idempotency, IdempotencyLayer, ResponseFuture};
