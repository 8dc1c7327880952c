//! Idempotency-Key enforcement as a tower middleware, over any inner
//! service whose error says whether the request could have executed
//! (`Into<UpstreamFailure>`).
//!
//! A covered request (a method in its route's `methods`) that carries an
//! `Idempotency-Key` runs against the upstream at most once per (scope, key):
//! the first one claims the key in the store and executes; every retry is
//! answered from the stored record — replayed when it is the same request,
//! refused when it is a different one (409) or still running (425). The full
//! contract is the table in docs/contract.md.
//!
//! The request path, in the order a covered request meets it:
//! - [`layer`]: the settings every request shares;
//! - [`service`]: pass through, reject, or run the covered path in its
//!   route's dialect;
//! - `exchange`: claim the key, then replay, reject, wait or execute (and
//!   `observe_dialect`, `mcp_request`: how observe mode and an MCP route
//!   start and run it);
//! - `dialect`: how the client is answered — refused, replayed, and the
//!   executed response captured — by plain HTTP, an MCP tool call
//!   (`mcp_call`) or observe mode;
//! - `relay`: the executed response, relayed while a copy is kept;
//! - `settle`: completing or releasing the key, retried while it can be;
//! - `replay`: the answer to a retry, from the stored record.
//!
//! Each file imports only files below it in that order (`context`, what
//! the steps hand each other, and the files named below sit at the
//! bottom); `tests/architecture.rs` holds it to no import cycle.
//!
//! And what they are made of: [`settings`] (what `[idempotency]`, each
//! route and `[mcp]` say, as the file says it), [`policy`] (per-route
//! settings, checked and ready to use), [`body`]
//! (bounded reading and relaying), [`rejection`] (the proxy's own answers,
//! including to a request [`crate::request`] could not read). What a
//! request is (its key, key source, scope, identity and fingerprint) lives
//! in [`crate::request`], which this layer reads and never the other way.

mod body;
mod context;
mod detach;
mod dialect;
mod exchange;
mod layer;
mod mcp_call;
pub mod mcp_catalog;
mod mcp_catalog_store;
mod mcp_request;
pub mod observe;
mod observe_dialect;
pub mod policy;
mod reconcile;
mod reconcile_key;
mod rejection;
mod relay;
mod replay;
mod service;
pub mod settings;
mod settle;
mod store_call;
mod waiting;

pub use layer::{IdempotencyLayer, DEFAULT_MAX_IN_FLIGHT};
pub use policy::{Policies, Policy};
pub use reconcile_key::{KeyReconciler, KeyReconciliation, LookupSender, ReconcileRefusal};
pub use rejection::Rejection;
pub use service::{Idempotency, ResponseFuture};
pub use settings::{IdempotencySettings, McpSettings};
pub use settle::store_time_in_lease;
