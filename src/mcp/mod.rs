//! The MCP-aware route's protocol knowledge (DESIGN §5): the pure part
//! (JSON-RPC messages, Server-Sent Events, the `tools/list` rewrite, the
//! messages the proxy makes) is `idemproxy_core::mcp`, re-exported here
//! whole so `crate::mcp::…` paths name it; this module adds what waits on
//! tokio:
//!
//! - [`in_flight`]: the protected calls each session runs, which its
//!   cancels and its DELETE must not stop.

pub use idemproxy_core::mcp::*;

pub mod in_flight;

pub use in_flight::{RunningCall, SessionCalls};
