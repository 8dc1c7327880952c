//! The connections a store holds: the one its calls share ([`Conn`],
//! repeated once when it turns out to be gone), how more like it are
//! opened ([`Connector`], waiting at startup for a Redis that is not up
//! yet), and the one each traffic worker's event loop keeps of its own
//! ([`LoopConnections`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Client, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value};
use tokio::runtime::{Handle, RuntimeFlavor};

use super::sentinel::SentinelConn;
use super::SCRIPTS;
use crate::store::StoreError;

/// The connection a store shares between all its calls. Both variants are
/// multiplexed and cheap to clone (a handle to the same connection).
///
/// A command is sent once more when the connection turns out to be gone.
/// A multiplexed connection learns that Redis went away (a restart, a
/// failover) only when it is used; without this, that use was a request
/// answered 503 while `/readyz` already said the store was back. The
/// single-node manager reconnects on the error and the repeat waits for the
/// new connection; the cluster client repeats by itself. Every command this
/// store sends is safe to repeat: claims and settlements are fenced by the
/// request's token (a repeat finds its own write), and removals delete only
/// what they read (`remove.lua`, `remove_foreign.lua`).
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// Follows the primary across failovers (see [`super::sentinel`]).
    Sentinel(SentinelConn),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            // The manager's own `send_packed_command`, not its
            // `ConnectionLike` method, which boxes another future per call.
            Conn::Single(c) => Box::pin(async move {
                match c.send_packed_command(cmd).await {
                    Err(e) if e.is_connection_dropped() => {
                        tracing::debug!(error = %e, "the Redis connection was gone; sending the command again");
                        c.send_packed_command(cmd).await
                    }
                    answered => answered,
                }
            }),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => Box::pin(async move {
                match c.send_packed_commands(pipeline, offset, count).await {
                    Err(e) if e.is_connection_dropped() => {
                        c.send_packed_commands(pipeline, offset, count).await
                    }
                    answered => answered,
                }
            }),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// Opens connections like the store's first one (same address, credentials,
/// database, TLS and timeouts).
#[derive(Clone)]
pub(super) enum Connector {
    Single(Client, ConnectionManagerConfig),
    Cluster(ClusterClient),
    /// One connection for every loop: it moves with the primary.
    Sentinel(SentinelConn),
}

impl Connector {
    /// The store's first connection, with the scripts loaded (on every
    /// primary of a cluster) so that the first request does not pay for a
    /// `NOSCRIPT` round trip. Tries again, backing off, for up to `wait`
    /// while the failure is one that passes by itself ([`not_up_yet`]).
    pub(super) async fn start(&self, target: &str, wait: Duration) -> Result<Conn, StoreError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut backoff = Duration::from_millis(100);
        loop {
            let attempt = async {
                let mut conn = self.connect().await?;
                for script in [
                    &SCRIPTS.settle,
                    &SCRIPTS.swap,
                    &SCRIPTS.remove,
                    &SCRIPTS.remove_foreign,
                ] {
                    script.load_async(&mut conn).await?;
                }
                Ok::<_, RedisError>(conn)
            };
            match attempt.await {
                Ok(conn) => return Ok(conn),
                Err(e) if not_up_yet(&e) && tokio::time::Instant::now() + backoff < deadline => {
                    tracing::warn!(redis = %target, error = %e, retry_in = ?backoff, "redis is not up yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(connect_error(target, e)),
            }
        }
    }

    async fn connect(&self) -> Result<Conn, RedisError> {
        match self {
            Connector::Single(client, config) => {
                ConnectionManager::new_with_config(client.clone(), config.clone())
                    .await
                    .map(Conn::Single)
            }
            Connector::Cluster(client) => client.get_async_connection().await.map(Conn::Cluster),
            Connector::Sentinel(conn) => Ok(Conn::Sentinel(conn.clone())),
        }
    }
}

/// Connections of the event loops that call the store, one set per loop.
///
/// A multiplexed connection's socket I/O runs in a driver task on the
/// runtime that opened it. Each traffic worker is a current-thread runtime
/// (`server::Workers`): sharing the startup connection, every call crossed
/// threads twice (to the driver on the main runtime, then back to wake the
/// caller). With a connection opened on the worker's own loop, a call, its
/// I/O and its reply stay on one thread; in the load benchmark that took
/// unique-key throughput on Redis from about 10.6k to 11.8k requests/s.
///
/// Only current-thread runtimes get their own: tasks on a multi-thread
/// runtime (the admin API, startup) move between threads anyway.
pub(super) struct LoopConnections {
    connector: Connector,
    /// Per runtime: `Some` once its connection is open, `None` while a task
    /// on that runtime opens it. Calls use the shared connection until it is
    /// open, so opening one (or failing to, with Redis down) never delays a
    /// request. A failed opening removes the entry and the next call tries
    /// again. Tokio may reuse the id of a runtime that has ended; a new
    /// runtime inheriting a dead runtime's connection would then see it
    /// fail like a broken one (the single-node manager reconnects).
    ///
    /// A list, not a map: there is one entry per traffic worker, a handful,
    /// and every store call looks its own up; hashing the id with the
    /// standard library's SipHash cost more than comparing it with each.
    by_runtime: Mutex<Vec<(tokio::runtime::Id, Option<Conn>)>>,
}

impl LoopConnections {
    pub(super) fn new(connector: Connector) -> Arc<Self> {
        Arc::new(Self {
            connector,
            by_runtime: Mutex::new(Vec::new()),
        })
    }

    /// The current loop's connection, if it has one; on a first call from a
    /// current-thread runtime, starts opening it there.
    pub(super) fn current(self: &Arc<Self>) -> Option<Conn> {
        let handle = Handle::try_current().ok()?;
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return None;
        }
        let id = handle.id();
        let mut by_runtime = self
            .by_runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, conn)) = by_runtime.iter().find(|(runtime, _)| *runtime == id) {
            return conn.clone();
        }
        by_runtime.push((id, None));
        let loops = Arc::clone(self);
        handle.spawn(async move {
            let opened = loops.connector.connect().await;
            let mut by_runtime = loops
                .by_runtime
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let Some(at) = by_runtime.iter().position(|(runtime, _)| *runtime == id) else {
                return;
            };
            match opened {
                Ok(conn) => by_runtime[at].1 = Some(conn),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot open a worker's Redis connection yet");
                    by_runtime.swap_remove(at);
                }
            }
        });
        None
    }
}

/// Whether a failed start may succeed if tried again later: Redis not
/// listening yet, not answering, dropping the connection, or loading its
/// data set; a cluster without a reachable node or with slots not served
/// yet. Nothing else (a TLS failure, a refused password, a name that does
/// not resolve): waiting would only delay the error.
fn not_up_yet(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || e.is_timeout()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ClusterDown
                )
        )
}

fn connect_error(target: &str, e: RedisError) -> StoreError {
    StoreError::Unavailable(format!("cannot connect to {target}: {e}"))
}
