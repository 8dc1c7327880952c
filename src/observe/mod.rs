//! What the proxy tells its operators: Prometheus [`metrics`], the one
//! [`request_log`] line per request and its [`outcome`] label, the log line
//! formats ([`log_format`]) and their batched writer ([`log_writer`]),
//! request ids ([`request_id`]), and OpenTelemetry traces ([`trace`], sent
//! by [`otlp`]).

pub mod log_format;
pub mod log_writer;
pub mod metrics;
pub mod otlp;
mod outcome;
pub mod request_id;
mod request_log;
pub mod trace;

pub use metrics::{Metrics, Reconciled, RouteMetrics};
pub use outcome::RequestOutcome;
pub use request_log::RequestLog;
