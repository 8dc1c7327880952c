//! The MCP-aware route's protocol knowledge (DESIGN §5): JSON-RPC messages
//! over Streamable HTTP, Server-Sent Events, the `tools/list` rewrite and
//! the messages the proxy itself makes (replays, tool errors). No I/O and
//! no store: the idempotency layer drives a call through these.
//!
//! - [`message`]: what a request body says (a `tools/call`, a
//!   `tools/list`, anything else) and what answers it;
//! - [`sse`]: an incremental `text/event-stream` parser that keeps each
//!   event's bytes, so what is not rewritten is relayed as it came;
//! - [`tools`]: which tools are protected, and the listing rewrite;
//! - [`render`]: replays and tool errors as JSON-RPC responses.
//!
//! The proxy's `mcp` module re-exports all of this and adds `in_flight`
//! (the protected calls each session runs), which waits on tokio.

pub mod message;
pub mod render;
pub mod sse;
pub mod tools;

pub use message::{Answer, BatchItem, McpRequest, ToolCall};
pub use render::{encode, reconciled_result, replay, tool_error, Framing};
pub use sse::{Event, EventParser};
pub use tools::{Protection, ToolCatalog, ToolRules};
