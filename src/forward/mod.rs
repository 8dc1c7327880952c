//! The innermost service: forwards a request to the upstream and reports
//! failures classified by whether the request could have executed.
//!
//! - [`client`]: the pooled client, header hygiene and the deadline;
//! - [`error`]: [`UpstreamError`] (and its class, as the idempotency layer
//!   sees it) and [`ClientInfo`], which the server attaches per connection.

mod client;
mod error;

use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use tower::Service;

pub use client::{Upstream, UpstreamSettings, UpstreamUrl};
pub use error::{ClientInfo, UpstreamError};

use crate::observe::trace;

/// Forwards each request to the upstream, within `timeout` (the response
/// body included).
#[derive(Clone, Debug)]
pub struct Forward {
    upstream: Upstream,
    timeout: Duration,
}

impl Forward {
    pub fn new(upstream: Upstream, timeout: Duration) -> Self {
        Self { upstream, timeout }
    }
}

impl Service<Request<Body>> for Forward {
    type Response = Response<Body>;
    type Error = UpstreamError;
    type Future = BoxFuture<'static, Result<Response<Body>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        // The pooled client queues internally; there is no back-pressure to
        // report here.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let client = req
            .extensions()
            .get::<ClientInfo>()
            .cloned()
            .unwrap_or_else(|| ClientInfo::new(None, false));
        let mut req = self.upstream.prepare(req, client);
        let span = trace::upstream_span(req.method(), req.uri());
        trace::inject(&span, req.headers_mut());
        let deadline = tokio::time::Instant::now() + self.timeout;
        let upstream = self.upstream.clone();
        let answered = span.clone();
        let call = async move {
            match upstream.send(req, deadline).await {
                Ok(response) => {
                    trace::upstream_answered(&answered, response.status().as_u16());
                    Ok(response.map(Body::new))
                }
                Err(e) => {
                    trace::upstream_failed(&answered, e.kind());
                    Err(e)
                }
            }
        };
        trace::boxed_in(span, call)
    }
}
