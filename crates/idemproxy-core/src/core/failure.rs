//! How a call to the upstream failed, in the only terms that decide what a
//! retry of its key may do: whether the request could have executed.
//!
//! The idempotency layer wraps any inner service whose error converts into
//! this (`Into<UpstreamFailure>`), so it knows no type of the service that
//! forwards.

/// A failed upstream call, classified by whether it may have executed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// Nothing was sent (refused, DNS, TLS handshake, connect timeout): the
    /// key is released and a retry executes.
    NotSent(String),
    /// No answer within the deadline after the request may have been sent.
    TimedOut,
    /// The exchange broke after the request may have been sent.
    Broken(String),
}

impl UpstreamFailure {
    /// Whether the failure was the deadline (504 rather than 502).
    pub fn is_timeout(&self) -> bool {
        matches!(self, UpstreamFailure::TimedOut)
    }
}
