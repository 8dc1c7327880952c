//! Listeners, TLS and graceful shutdown.
//!
//! Each accepted connection is served by hyper-util's auto builder
//! (HTTP/1.1 and h2c, or HTTP/1.1 and HTTP/2 by ALPN over TLS when `[tls]`
//! is set) on one of the [`Workers`]. The peer address is attached to every
//! request as [`ClientInfo`] for `X-Forwarded-For`, and the verified
//! client certificate (mTLS) for the `client_cert` scope. On shutdown the
//! listener closes at once, open connections finish their current
//! exchange, and the caller then waits for executions that outlived their
//! connections (see
//! [`IdempotencyLayer::tasks`](crate::idempotency::IdempotencyLayer::tasks)).

mod tls;
mod workers;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use futures_util::TryFutureExt;
use http::{Request, Response, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::TcpListener;
use tower::{Service, ServiceExt};

use crate::core::ClientCertificate;
use crate::forward::ClientInfo;
pub use tls::{tls_acceptor, ClientCertificates, TLS_HANDSHAKE_TIMEOUT};
pub use tokio_rustls::TlsAcceptor;
pub use workers::Workers;
use workers::{Job, OpenConnection, Worker};

/// How long a client may take to send a request head: bounds slowloris
/// connections.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `listener` (over TLS with `tls`) on `workers` until `shutdown`
/// resolves, then lets open connections finish for at most `drain`.
pub async fn serve<S>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    workers: &Workers<S>,
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
        let Some(worker) = workers.least_busy() else {
            tracing::error!("no worker threads; closing the connection");
            continue;
        };
        let connection = Connection {
            peer,
            tls: tls.clone(),
            builder: builder.clone(),
            watcher: graceful.watcher(),
        };
        hand_over(worker, stream, connection);
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(?drain, "connections still open after the drain timeout");
        }
    }
}

/// What serving one accepted connection takes besides its socket.
struct Connection {
    peer: SocketAddr,
    tls: Option<TlsAcceptor>,
    builder: auto::Builder<TokioExecutor>,
    watcher: Watcher,
}

/// Moves an accepted socket to `worker`, whose event loop serves it.
fn hand_over<S>(worker: &Worker<S>, stream: tokio::net::TcpStream, connection: Connection)
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let peer = connection.peer;
    let _ = stream.set_nodelay(true);
    // The socket moves to the worker's reactor: a tokio stream is bound to
    // the runtime that registered it.
    let stream = match stream.into_std() {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!(error = %e, peer = %peer, "cannot hand the connection to a worker");
            return;
        }
    };
    let service = worker.service.clone();
    let open = OpenConnection::new(&worker.open);
    let job: Job = Box::new(move || {
        tokio::spawn(async move {
            let _open = open;
            connection.serve(stream, service).await;
        });
    });
    if worker.jobs.send(job).is_err() {
        tracing::error!(peer = %peer, "worker thread is gone; connection dropped");
    }
}

impl Connection {
    /// Serves the connection on the worker's runtime until it ends (or the
    /// drain ends it).
    async fn serve<S>(self, stream: std::net::TcpStream, service: S)
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
            + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
    {
        let peer = self.peer;
        let resets = ResetOnAbort::new(&stream);
        let stream = match tokio::net::TcpStream::from_std(stream) {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, peer = %peer, "cannot register the connection");
                return;
            }
        };
        let client = ClientInfo::new(Some(peer), self.tls.is_some());
        let result = match &self.tls {
            None => {
                let service = tagged(service, client, None, resets.clone());
                let conn = self.builder.serve_connection(TokioIo::new(stream), service);
                self.watcher.watch(conn).await
            }
            // The handshake runs in the connection's task, so a slow
            // client never holds up the accept loop.
            Some(acceptor) => {
                let Some((stream, certificate)) = tls::handshake(acceptor, stream, peer).await
                else {
                    return;
                };
                let service = tagged(service, client, certificate, resets.clone());
                let conn = self.builder.serve_connection(TokioIo::new(stream), service);
                self.watcher.watch(conn).await
            }
        };
        if let Err(e) = result {
            tracing::debug!(error = %e, peer = %peer, "connection ended with an error");
        }
        resets.close();
    }
}

/// Makes the connection end in a reset, not a clean close, once a
/// response body that is delimited by the close broke off (an HTTP/1.0
/// client's, whose body has no length): for such a client a FIN is the
/// body's end, and a truncated body would look complete.
#[derive(Clone)]
struct ResetOnAbort {
    /// A second descriptor of the socket: it keeps the socket open after
    /// hyper closed its own, so the last close is ours and can be a reset
    /// (`SO_LINGER` 0). Closing a descriptor while another is open sends
    /// nothing.
    socket: Option<Arc<std::net::TcpStream>>,
    aborted: Arc<AtomicBool>,
}

impl ResetOnAbort {
    fn new(stream: &std::net::TcpStream) -> Self {
        Self {
            socket: stream.try_clone().ok().map(Arc::new),
            aborted: Arc::default(),
        }
    }

    /// `response` with a body that, should it break off, resets the
    /// connection: for HTTP/1.0 requests only, since HTTP/1.1 (chunked)
    /// and HTTP/2 tell a client an aborted body by themselves.
    fn guard(&self, version: Version, response: Response<Body>) -> Response<Body> {
        if version != Version::HTTP_10 {
            return response;
        }
        let aborted = self.aborted.clone();
        response.map(|body| {
            Body::new(body.map_err(move |e| {
                aborted.store(true, Ordering::Release);
                e
            }))
        })
    }

    /// After hyper let go of the connection: a reset if a body broke off.
    fn close(self) {
        if let Some(socket) = &self.socket {
            if self.aborted.load(Ordering::Acquire) {
                let _ = socket2::SockRef::from(socket.as_ref()).set_linger(Some(Duration::ZERO));
            }
        }
    }
}

/// `service` for hyper, each request tagged with what the connection knows
/// of its peer (the address, and the client certificate it verified), each
/// response guarded by `resets`.
fn tagged<S>(
    service: S,
    client: ClientInfo,
    certificate: Option<ClientCertificate>,
    resets: ResetOnAbort,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
> + Clone
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let version = req.version();
        let mut req = req.map(Body::new);
        req.extensions_mut().insert(client.clone());
        if let Some(certificate) = certificate {
            req.extensions_mut().insert(certificate);
        }
        let resets = resets.clone();
        service
            .clone()
            .oneshot(req)
            .map_ok(move |response| resets.guard(version, response))
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::workers::MAX_BLOCKING_THREADS;
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Answers with the name of the thread that served the request.
    fn thread_name_service(
    ) -> tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible> {
        tower::util::BoxCloneService::new(tower::service_fn(|_req: Request<Body>| async {
            let name = std::thread::current().name().unwrap_or("?").to_owned();
            Ok::<_, Infallible>(Response::new(Body::from(name)))
        }))
    }

    async fn served_by(stream: &mut tokio::net::TcpStream) -> String {
        stream
            .write_all(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0; 1024];
        let mut read = 0;
        loop {
            let n = stream.read(&mut buf[read..]).await.expect("read");
            assert!(n > 0, "connection closed");
            read += n;
            let text = String::from_utf8_lossy(&buf[..read]).into_owned();
            if let Some(name) = text.split("\r\n\r\n").nth(1) {
                if name.starts_with("idemproxy-worker-") && name.len() >= 18 {
                    return name.to_owned();
                }
            }
        }
    }

    /// Blocking calls on a worker's runtime never run more than
    /// `MAX_BLOCKING_THREADS` at once, however many are started together.
    #[tokio::test]
    async fn a_workers_blocking_pool_is_bounded() {
        let workers = Workers::start(vec![thread_name_service()]).expect("workers");
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (done, finished) = tokio::sync::oneshot::channel();
        let (counting, peak) = (Arc::clone(&running), Arc::clone(&most));
        let job: Job = Box::new(move || {
            tokio::spawn(async move {
                let calls: Vec<_> = (0..64)
                    .map(|_| {
                        let (running, most) = (Arc::clone(&counting), Arc::clone(&peak));
                        tokio::task::spawn_blocking(move || {
                            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(20));
                            running.fetch_sub(1, Ordering::SeqCst);
                        })
                    })
                    .collect();
                for call in calls {
                    let _ = call.await;
                }
                let _ = done.send(());
            });
        });
        assert!(workers.workers[0].jobs.send(job).is_ok());
        finished.await.expect("the calls finish");
        let most = most.load(Ordering::SeqCst);
        // At least two: the calls did run side by side, so it is the bound
        // that held them, and well short of one thread per call.
        assert!(
            (2..=MAX_BLOCKING_THREADS).contains(&most) && most < 64,
            "{most} of 64 blocking calls at once"
        );
        workers.stop().await;
    }

    #[tokio::test]
    async fn connections_go_to_the_least_busy_worker_and_stay_there() {
        let workers =
            Workers::start(vec![thread_name_service(), thread_name_service()]).expect("workers");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = async {
            serve(
                listener,
                None,
                &workers,
                async {
                    let _ = stopped.await;
                },
                Duration::from_secs(2),
            )
            .await
        };
        let client = async {
            let mut a = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let first_a = served_by(&mut a).await;
            let mut b = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let first_b = served_by(&mut b).await;
            // While `a` is open its worker serves one connection more, so
            // `b` goes to the other one; each keeps its worker.
            assert_ne!(first_a, first_b);
            assert_eq!(served_by(&mut a).await, first_a);
            assert_eq!(served_by(&mut b).await, first_b);
            drop(a);
            drop(b);
            let _ = stop.send(());
        };
        tokio::join!(serving, client);
        workers.stop().await;
    }
}
