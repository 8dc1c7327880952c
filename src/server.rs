//! Listeners, TLS and graceful shutdown.
//!
//! Each accepted connection is served by hyper-util's auto builder (HTTP/1.1
//! and h2c, or HTTP/1.1 and HTTP/2 by ALPN over TLS when `[tls]` is set). The peer address is attached to every request as
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

use crate::config::TlsConfig;
use crate::upstream::ClientInfo;

pub use tokio_rustls::TlsAcceptor;

/// How long a client may take to send a request head: bounds slowloris
/// connections.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A client gets this long to finish its TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds the traffic listener's TLS acceptor from PEM files.
pub fn tls_acceptor(config: &TlsConfig) -> Result<TlsAcceptor, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};

    let certs = CertificateDer::pem_file_iter(&config.cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("tls.cert_file {}: {e}", config.cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "tls.cert_file {}: no certificate in it",
            config.cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&config.key_file)
        .map_err(|e| format!("tls.key_file {}: {e}", config.key_file.display()))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("tls: {e}"))?;
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(std::sync::Arc::new(tls)))
}

/// Serves `service` on `listener` (over TLS with `tls`) until `shutdown`
/// resolves, then lets open connections finish for at most `drain`.
pub async fn serve<S>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
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
            https: tls.is_some(),
        };
        let service = service.clone();
        let hyper_service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let mut req = req.map(Body::new);
            req.extensions_mut().insert(client);
            service.clone().oneshot(req)
        });
        match &tls {
            None => {
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
            Some(acceptor) => {
                // The handshake runs in the connection's task, so a slow
                // client never holds up the accept loop.
                let acceptor = acceptor.clone();
                let builder = builder.clone();
                let watcher = graceful.watcher();
                tokio::spawn(async move {
                    let stream =
                        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                            .await
                        {
                            Ok(Ok(stream)) => stream,
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, peer = %peer, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(peer = %peer, "TLS handshake timed out");
                                return;
                            }
                        };
                    let connection = builder.serve_connection(TokioIo::new(stream), hyper_service);
                    if let Err(e) = watcher.watch(connection).await {
                        tracing::debug!(error = %e, peer = %peer, "connection ended with an error");
                    }
                });
            }
        }
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(?drain, "connections still open after the drain timeout");
        }
    }
}
