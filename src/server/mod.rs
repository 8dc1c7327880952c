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
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tower::{Service, ServiceExt};

use crate::forward::ClientInfo;

pub use tokio_rustls::TlsAcceptor;

/// How long a client may take to send a request head: bounds slowloris
/// connections.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A client gets this long to finish its TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds the traffic listener's TLS acceptor from PEM files.
pub fn tls_acceptor(cert_file: &Path, key_file: &Path) -> Result<TlsAcceptor, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};

    let certs = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("tls.cert_file {}: {e}", cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "tls.cert_file {}: no certificate in it",
            cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| format!("tls.key_file {}: {e}", key_file.display()))?;
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

/// The threads that serve traffic: each runs a current-thread runtime, so
/// a connection, its requests, their executions and the upstream connections
/// they use all live on one thread. A multi-thread runtime moves that work
/// between threads (work stealing, waking parked siblings), which on a small
/// sidecar costs more than it balances; per-thread loops are how nginx and
/// Envoy run for the same reason.
///
/// The accept loop stays on the caller's runtime and gives each connection
/// to the worker serving the fewest, so one long-lived client cannot pin a
/// whole thread's share of connections.
pub struct Workers<S> {
    workers: Vec<Worker<S>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

struct Worker<S> {
    /// Jobs run inside the worker's runtime, so the tasks they spawn land
    /// there. Dropping every sender ends the worker: its loop stops once the
    /// queue is empty and the runtime drops whatever is left, so this
    /// happens only after the drain (see [`Workers::stop`]).
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
    /// The worker's own copy of the traffic stack (its own upstream pool).
    service: S,
    /// Connections open on this worker, for least-connections placement.
    open: Arc<AtomicUsize>,
}

type Job = Box<dyn FnOnce() + Send>;

/// Threads of a worker's blocking pool. What runs there now is the upstream
/// connector's DNS lookups: the embedded store's changes go to its writer
/// thread and its replays to its replay cache, and its reads (`get`,
/// `ping`) come from the admin listener, on the main runtime. Tokio's
/// default (512) lets a burst of slow blocking calls start a thread per
/// call, each with an allocator heap of its own; when the embedded store
/// still read on this pool, a burst of replays under `wrk -c32` ran 72
/// threads instead of 16, with 20 MiB more RSS and no more throughput. The
/// bound keeps a slow resolver from doing the same; calls queued behind it
/// wait, under `upstream.connect_timeout`.
const MAX_BLOCKING_THREADS: usize = 8;

impl<S> Workers<S> {
    /// Starts one thread per service.
    pub fn start(services: Vec<S>) -> std::io::Result<Self> {
        let mut workers = Vec::with_capacity(services.len());
        let mut threads = Vec::with_capacity(services.len());
        // Workers log wherever their starter logs: the global subscriber in
        // the binary, a scoped one in a test that captures the logs.
        let dispatch = tracing::dispatcher::get_default(|current| current.clone());
        for (i, service) in services.into_iter().enumerate() {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .max_blocking_threads(MAX_BLOCKING_THREADS)
                .build()?;
            let (jobs, mut queue) = tokio::sync::mpsc::unbounded_channel::<Job>();
            let dispatch = dispatch.clone();
            let thread = std::thread::Builder::new()
                .name(format!("idemproxy-worker-{i}"))
                .spawn(move || {
                    let _logging = tracing::dispatcher::set_default(&dispatch);
                    runtime.block_on(async move {
                        while let Some(job) = queue.recv().await {
                            job();
                        }
                    })
                })?;
            threads.push(thread);
            workers.push(Worker {
                jobs,
                service,
                open: Arc::new(AtomicUsize::new(0)),
            });
        }
        Ok(Self { workers, threads })
    }

    fn least_busy(&self) -> Option<&Worker<S>> {
        self.workers
            .iter()
            .min_by_key(|w| w.open.load(Ordering::Relaxed))
    }

    /// Ends the worker threads once nothing runs on them any more: call it
    /// after connections have drained and executions have stored their
    /// outcomes, as anything still running is dropped.
    pub async fn stop(self) {
        drop(self.workers);
        let threads = self.threads;
        let _ = tokio::task::spawn_blocking(move || {
            for thread in threads {
                let _ = thread.join();
            }
        })
        .await;
    }
}

/// Decrements a worker's open-connection count when its connection ends,
/// however it ends.
struct OpenConnection(Arc<AtomicUsize>);

impl OpenConnection {
    fn new(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        Self(open.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

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
        let _ = stream.set_nodelay(true);
        // The socket moves to the worker's reactor: a tokio stream is bound
        // to the runtime that registered it.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, peer = %peer, "cannot hand the connection to a worker");
                continue;
            }
        };
        let client = ClientInfo::new(Some(peer), tls.is_some());
        let service = worker.service.clone();
        let hyper_service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let mut req = req.map(Body::new);
            req.extensions_mut().insert(client.clone());
            service.clone().oneshot(req)
        });
        let open = OpenConnection::new(&worker.open);
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        let job: Job = Box::new(move || {
            tokio::spawn(async move {
                let _open = open;
                let stream = match tokio::net::TcpStream::from_std(stream) {
                    Ok(stream) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, peer = %peer, "cannot register the connection");
                        return;
                    }
                };
                let result = match tls {
                    None => {
                        watcher
                            .watch(builder.serve_connection(TokioIo::new(stream), hyper_service))
                            .await
                    }
                    Some(acceptor) => {
                        // The handshake runs in the connection's task, so a
                        // slow client never holds up the accept loop.
                        let stream = match tokio::time::timeout(
                            TLS_HANDSHAKE_TIMEOUT,
                            acceptor.accept(stream),
                        )
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
                        watcher
                            .watch(builder.serve_connection(TokioIo::new(stream), hyper_service))
                            .await
                    }
                };
                if let Err(e) = result {
                    tracing::debug!(error = %e, peer = %peer, "connection ended with an error");
                }
            });
        });
        if worker.jobs.send(job).is_err() {
            tracing::error!(peer = %peer, "worker thread is gone; connection dropped");
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

#[cfg(test)]
mod tests {
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
