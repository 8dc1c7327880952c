//! Listeners and graceful shutdown.
//!
//! Each accepted connection is served by hyper-util's auto builder (HTTP/1.1
//! and h2c). The peer address is attached to every request as
//! [`ClientInfo`] for `X-Forwarded-For`. On shutdown the listener closes at
//! once, open connections finish their current exchange, and the caller then
//! waits for executions that outlived their connections (see
//! [`IdempotencyLayer::tasks`](crate::idempotency::IdempotencyLayer::tasks)).

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tower::{Service, ServiceExt};

use crate::upstream::ClientInfo;

/// How long a client may take to send a request head: bounds slowloris
/// connections.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `service` on `listener` until `shutdown` resolves, then lets open
/// connections finish for at most `drain`.
pub async fn serve<S>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Usually out of file descriptors: back off instead of
                    // spinning, and keep serving the connections we have.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let client = ClientInfo {
            addr: Some(peer),
            https: false,
        };
        let service = service.clone();
        let hyper_service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let mut req = req.map(Body::new);
            req.extensions_mut().insert(client);
            service.clone().oneshot(req)
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), hyper_service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, peer = %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(?drain, "connections still open after the drain timeout");
        }
    }
}
