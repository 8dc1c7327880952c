//! Part of the composition root: operators' commands beside serving.
//!
//! - `idemproxy store train-dictionary` ([`dictionary`]) trains a zstd
//!   dictionary for `store.compression_dictionary` from a sample of the
//!   responses the configured store holds.
//! - `idemproxy keys list|show|reconcile|forget` ([`keys`]) reconcile keys
//!   through a running proxy's admin API: find the `outcome-unknown` (or
//!   stuck `pending`) keys, look one up, ask the upstream's lookup
//!   (`reconcile_url`) and settle it by the answer, or forget it once its
//!   effect was checked with the upstream (docs/runbook.md).
//! - `idemproxy store migrate` ([`migrate`]) copies an earlier version's
//!   embedded store into today's.
//! - [`progress`] shows how far such a walk over many records has come.

pub mod dictionary;
pub mod keys;
pub mod migrate;
mod progress;

pub use dictionary::{train_dictionary, TrainOptions, TrainReport};
