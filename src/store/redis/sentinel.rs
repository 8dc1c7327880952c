//! `kind = "redis-sentinel"`: the store is the primary that a set of
//! Sentinels names for `master_name`, followed across a failover.
//!
//! One multiplexed connection to the primary serves every call. When a
//! call finds the primary gone (the connection dropped or refused, the
//! node answers `READONLY` because it was demoted, or `MASTERDOWN`), the
//! Sentinels are asked again for the primary, a connection is opened to
//! what they name, and the call is sent once more (every command this
//! store sends is safe to repeat: see [`super::connections::Conn`]). Callers
//! that saw the same connection fail share one lookup. While the
//! Sentinels still name the dead primary (before they agree on the
//! failover), calls fail and their requests are answered 503: nothing is
//! forwarded on a claim that was not written.

use std::sync::{PoisonError, RwLock};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Client, Cmd, Pipeline, RedisError, RedisFuture, Value};

/// The current primary, and how to find the next one.
pub(super) struct SentinelPrimary {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    config: AsyncConnectionConfig,
    /// The connection every call uses, with its generation: a caller whose
    /// call failed on generation N reconnects only if the connection is
    /// still N (another caller may have replaced it already).
    current: RwLock<Option<(u64, MultiplexedConnection)>>,
    /// One lookup at a time.
    resolving: tokio::sync::Mutex<u64>,
    database: i64,
}

impl SentinelPrimary {
    pub(super) fn new(
        sentinel: SentinelClient,
        config: AsyncConnectionConfig,
        database: i64,
    ) -> Self {
        Self {
            sentinel: tokio::sync::Mutex::new(sentinel),
            config,
            current: RwLock::new(None),
            resolving: tokio::sync::Mutex::new(0),
            database,
        }
    }

    /// A client of the primary the Sentinels name now (for connections of
    /// other kinds: the removals' subscription).
    pub(super) async fn client(&self) -> Result<Client, RedisError> {
        self.sentinel.lock().await.async_get_client().await
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The connection to use, opened if there is none.
    async fn connection(&self) -> Result<(u64, MultiplexedConnection), RedisError> {
        match self.current() {
            Some(current) => Ok(current),
            None => self.reconnect(None).await,
        }
    }

    /// A connection to the primary the Sentinels name now, unless the one
    /// that `failed` was already replaced.
    async fn reconnect(
        &self,
        failed: Option<u64>,
    ) -> Result<(u64, MultiplexedConnection), RedisError> {
        let mut generation = self.resolving.lock().await;
        if let Some((current, conn)) = self.current() {
            if Some(current) != failed {
                return Ok((current, conn));
            }
        }
        let client = self.client().await?;
        let conn = client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        *generation += 1;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) =
            Some((*generation, conn.clone()));
        tracing::info!(
            generation = *generation,
            "connected to the primary the Sentinels name"
        );
        Ok((*generation, conn))
    }
}

/// Whether `e` says the connection no longer reaches a primary.
fn lost_primary(e: &RedisError) -> bool {
    e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_io_error()
        || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"))
}

/// The store's connection on a Sentinel-managed primary (see the module
/// docs): cheap to clone, every clone the same connection.
#[derive(Clone)]
pub(super) struct SentinelConn(pub(super) std::sync::Arc<SentinelPrimary>);

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.0.connection().await?;
            match conn.req_packed_command(cmd).await {
                Err(e) if lost_primary(&e) => {
                    tracing::debug!(error = %e, "the primary is gone; asking the Sentinels");
                    let (_, mut conn) = self.0.reconnect(Some(generation)).await?;
                    conn.req_packed_command(cmd).await
                }
                answered => answered,
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.0.connection().await?;
            match conn.req_packed_commands(pipeline, offset, count).await {
                Err(e) if lost_primary(&e) => {
                    let (_, mut conn) = self.0.reconnect(Some(generation)).await?;
                    conn.req_packed_commands(pipeline, offset, count).await
                }
                answered => answered,
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.0.database
    }
}
