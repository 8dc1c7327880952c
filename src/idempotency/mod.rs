//! Idempotency-Key enforcement as a tower middleware.
//!
//! A covered request (a method in its route's `methods`) that carries an
//! `Idempotency-Key` runs against the upstream at most once per (scope, key):
//! the first one claims the key in the store and executes; every retry is
//! answered from the stored record — replayed when it is the same request,
//! refused when it is a different one (409) or still running (425). The full
//! contract is the table in the README.
//!
//! - [`key`]: parsing the header;
//! - [`fingerprint`] and [`scope`]: what "the same request" and "the same
//!   caller" mean;
//! - [`record`]: what the store keeps;
//! - [`policy`]: per-route settings;
//! - [`service`]: the layer, the service and the request path;
//! - [`rejection`]: every answer the proxy makes itself, as problem+json.

pub mod body;
pub mod canonical;
pub mod fingerprint;
pub mod key;
pub mod outcome;
pub mod policy;
pub mod record;
pub mod rejection;
pub mod scope;
pub mod service;

pub use outcome::RequestOutcome;
pub use policy::{Policies, Policy};
pub use rejection::Rejection;
pub use service::{Idempotency, IdempotencyLayer, ResponseFuture};
