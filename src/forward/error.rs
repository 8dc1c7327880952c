//! What the forward service reports and what it is told: failures
//! classified by whether the request could have executed, and how the
//! client reached the proxy.

use std::net::SocketAddr;

use http::HeaderValue;

use crate::core::UpstreamFailure;

/// Why an upstream exchange failed, classified by whether the request could
/// have executed. See the module documentation.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Nothing was sent (connection refused, DNS failure, TLS handshake
    /// failure, connect timeout): a retry is safe.
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    /// No response within the deadline, after the request may have been sent.
    #[error("upstream timed out")]
    Timeout,
    /// The connection broke after the request was sent.
    #[error("upstream connection broke: {0}")]
    Reset(String),
}

impl UpstreamError {
    /// The failure's class in one word, for the upstream span's
    /// `error.type`.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Unreachable(_) => "unreachable",
            UpstreamError::Timeout => "timeout",
            UpstreamError::Reset(_) => "reset",
        }
    }
}

/// How the client reached the proxy, for `X-Forwarded-*`.
#[derive(Clone, Debug)]
pub struct ClientInfo {
    /// The client's IP as `X-Forwarded-For` carries it, written once per
    /// connection rather than per request.
    pub(super) ip: Option<HeaderValue>,
    pub(super) https: bool,
}

impl ClientInfo {
    pub fn new(addr: Option<SocketAddr>, https: bool) -> Self {
        // An IPv4 client on a dual-stack socket shows up as `::ffff:a.b.c.d`;
        // the upstream expects the plain IPv4 form.
        let ip = addr.and_then(|a| HeaderValue::try_from(a.ip().to_canonical().to_string()).ok());
        Self { ip, https }
    }
}

/// The idempotency layer sees only the class of a failure, never this type.
impl From<UpstreamError> for UpstreamFailure {
    fn from(error: UpstreamError) -> Self {
        match error {
            UpstreamError::Unreachable(why) => UpstreamFailure::NotSent(why),
            UpstreamError::Timeout => UpstreamFailure::TimedOut,
            UpstreamError::Reset(why) => UpstreamFailure::Broken(why),
        }
    }
}
