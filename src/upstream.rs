//! The pooled client to the upstream.
// STUB: to be implemented by the upstream helper.
use std::net::SocketAddr;

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;

use crate::config::UpstreamConfig;

/// Why an upstream exchange failed, classified by whether the request could
/// have executed.
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

/// How the client reached the proxy, for `X-Forwarded-*`.
#[derive(Clone, Copy, Debug)]
pub struct ClientInfo {
    pub addr: Option<SocketAddr>,
    pub https: bool,
}

#[derive(Clone)]
pub struct Upstream {}

impl Upstream {
    pub fn new(_config: &UpstreamConfig) -> Result<Self, String> {
        todo!()
    }

    /// Rewrites `req` for the upstream: URI and Host, hop-by-hop headers
    /// removed, `X-Forwarded-For/-Proto/-Host` added.
    pub fn prepare(&self, _req: Request<Body>, _client: ClientInfo) -> Request<Body> {
        todo!()
    }

    /// Sends a prepared request and waits for the response head until
    /// `deadline`. Hop-by-hop headers are removed from the response.
    pub async fn send(
        &self,
        _req: Request<Body>,
        _deadline: tokio::time::Instant,
    ) -> Result<Response<Incoming>, UpstreamError> {
        todo!()
    }
}
