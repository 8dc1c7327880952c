//! Commands sent again when the connection turned out to be gone.

use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};

use super::connect::Conn;

/// A connection whose command is sent once more when the connection turns
/// out to be gone: for the commands of the request path only (claim,
/// swap, settle, read, ping), which are safe to repeat, since each claim
/// and settlement is fenced by the request's token and a repeat finds its
/// own write. A multiplexed connection learns that Redis went away (a
/// restart, a failover) only when it is used; without this, that use was
/// a request answered 503 while `/readyz` already said the store was back.
/// The single-node manager reconnects on the error, and the repeat waits
/// for the new connection; the cluster client repeats by itself.
pub(super) struct Resending(pub(super) Conn);

impl Resending {
    /// Whether `error` says the connection was gone: the command was not
    /// answered by this Redis, and the manager is connecting afresh.
    fn worth_repeating(&self, error: &RedisError) -> bool {
        matches!(self.0, Conn::Single(_)) && error.is_connection_dropped()
    }
}

impl ConnectionLike for Resending {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            match self.0.req_packed_command(cmd).await {
                Err(e) if self.worth_repeating(&e) => {
                    tracing::debug!(error = %e, "the Redis connection was gone; sending the command again");
                    self.0.req_packed_command(cmd).await
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
            match self.0.req_packed_commands(pipeline, offset, count).await {
                Err(e) if self.worth_repeating(&e) => {
                    self.0.req_packed_commands(pipeline, offset, count).await
                }
                answered => answered,
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }
}
