//! idemproxy's pure parsers and codecs: what the proxy (the `idemproxy`
//! crate) builds on and what the fuzz targets (fuzz/) exercise, without
//! its runtime, store clients or telemetry. No I/O but reading a
//! dictionary file ([`packed::Dictionary::load`]), no HTTP responses.
//!
//! The modules are the bottom layers of the proxy's (README, "Layout";
//! `tests/architecture.rs` holds them to it): [`core`] imports nothing,
//! [`request`], [`mcp`] and [`packed`] build on it. The proxy re-exports
//! `core`, `request` and `mcp` under the same names, so `idemproxy::core::…`
//! and `crate::core::…` there name the same items; `packed` it re-exports
//! from `store::compression`, which wraps a store in it.
//!
//! - [`core`]: the ids, the record model and its versioned codec, the
//!   clock, the begin decision every store makes;
//! - [`request`]: a request's key, where it comes from, whose it is, and
//!   its fingerprint (RFC 8785 canonical JSON);
//! - [`mcp`]: MCP's JSON-RPC messages, Server-Sent Events, the
//!   `tools/list` rewrite, the messages the proxy makes;
//! - [`packed`]: the packed layout of a stored response (zstd, with or
//!   without a dictionary) and its codec.

pub mod core;
pub mod mcp;
pub mod packed;
pub mod request;
