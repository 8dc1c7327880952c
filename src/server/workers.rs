//! The threads that serve traffic, one event loop each, and the
//! least-connections placement of connections on them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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
    pub(super) workers: Vec<Worker<S>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl<S> std::fmt::Debug for Workers<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

pub(super) struct Worker<S> {
    /// Jobs run inside the worker's runtime, so the tasks they spawn land
    /// there. Dropping every sender ends the worker: its loop stops once the
    /// queue is empty and the runtime drops whatever is left, so this
    /// happens only after the drain (see [`Workers::stop`]).
    pub(super) jobs: tokio::sync::mpsc::UnboundedSender<Job>,
    /// The worker's own copy of the traffic stack (its own upstream pool).
    pub(super) service: S,
    /// Connections open on this worker, for least-connections placement.
    pub(super) open: Arc<AtomicUsize>,
}

pub(super) type Job = Box<dyn FnOnce() + Send>;

/// Threads of a worker's blocking pool. What runs there now is the upstream
/// connector's DNS lookups: the embedded store's changes go to its writer
/// thread and its replays to its replay cache, and its reads (`get`,
/// `ping`) come from the admin listener, on the main runtime. Tokio's
/// default (512) lets a burst of slow blocking calls start a thread per
/// call, each with an allocator heap of its own (measured when the
/// embedded store still read on this pool: docs/performance.md, "What made
/// it faster"). The bound keeps a slow resolver from doing the same; calls
/// queued behind it wait, under `upstream.connect_timeout`.
pub(super) const MAX_BLOCKING_THREADS: usize = 8;

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

    pub(super) fn least_busy(&self) -> Option<&Worker<S>> {
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
pub(super) struct OpenConnection(Arc<AtomicUsize>);

impl OpenConnection {
    pub(super) fn new(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        Self(open.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
