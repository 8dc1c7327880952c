//! A pooled connection lent to one store call, and what becomes of it when
//! the call is dropped before its statement answered.
//!
//! Every store call is bounded by its caller (`store.timeout`), which drops
//! the call's future when the time is up, wherever it is: often waiting
//! for a statement's answer. Handed straight back to the pool, the
//! connection looked free while PostgreSQL still ran that statement (a
//! claim waiting on a row another transaction had locked, say), and the
//! next call given it queued its own statement behind: one locked row made
//! calls on other keys time out too.
//!
//! So a connection dropped mid-statement is kept from everyone: it stays
//! checked out of its pool (still counted in `pool_size`, so the proxy
//! never opens more connections than that) while a task waits for the
//! server to answer what it was running, which PostgreSQL's own limits
//! end soon (`lock_timeout` a lock wait after `store.timeout`,
//! `statement_timeout` anything after twice that: `connect`'s
//! `pool_limits`). Answered, the connection is idle and healthy again and
//! goes back. Not answered within [`Reclaim::wait`] (a server ignoring
//! those limits: an operator's `options` turned them off, a stalled disk),
//! the statement is cancelled and the connection closed; only then does
//! its place in the pool go to a new one.
//!
//! Cancelling first and reusing the connection would be quicker, but a
//! cancel request travels on a connection of its own with no answer, and
//! can land after the statement it was meant for, on the next call's:
//! with synchronous replication, a cancelled wait for the standby reports
//! the commit done although the standby may not have it. A connection a
//! cancel was sent for is never used again.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Object};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row, Statement, Transaction};

use super::pg_error;
use super::tls::MakeRustls;
use crate::store::StoreError;

/// What a statement of a walk over many rows (a sweep batch, a page of
/// `list` or `scan`) may take on the server: its cost grows with the rows
/// it reads, not with a request's wait, and none of them waits on a row
/// lock (the sweep skips locked rows, the others only read). Bounded all
/// the same, so that one stuck on a slow disk ends by itself; above the
/// admin API's 5 s bound on a page, so that its caller gives up first.
pub(super) const WALK_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// `limit` as PostgreSQL's milliseconds: rounded up, and at least 1 (0
/// would mean no limit at all); at most `i32::MAX`, PostgreSQL's largest.
pub(super) fn setting_millis(limit: Duration) -> u64 {
    let millis = limit.as_nanos().div_ceil(1_000_000).max(1);
    u64::try_from(millis)
        .unwrap_or(u64::MAX)
        .min(i32::MAX.unsigned_abs().into())
}

/// How a connection dropped mid-statement is won back, or closed.
pub(super) struct Reclaim {
    /// To send a cancel request as the connection itself was opened.
    tls: Option<MakeRustls>,
    /// How long its statement may take to answer after its caller gave up,
    /// before it is cancelled and the connection closed: the I/O timeout
    /// (4 × `store.timeout`, at least 1 s), above the server's own limits,
    /// which end it first.
    wait: Duration,
}

impl Reclaim {
    pub(super) fn new(tls: Option<MakeRustls>, wait: Duration) -> Reclaim {
        Reclaim { tls, wait }
    }

    /// Waits, in a task of its own, until the statement `object` was
    /// sent answers, then gives `object` back to its pool; cancels the
    /// statement and closes the connection if it does not answer in time.
    fn reclaim(self: &Arc<Self>, object: Object) {
        let held = Quarantined(Some(object));
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to wait on (the process is ending): `held` closes
            // it, and the server's own limits end the statement.
            return;
        };
        let reclaim = Arc::clone(self);
        runtime.spawn(async move {
            // Queued behind the statement given up on (and a transaction's
            // rollback, sent when it was dropped): its answer means the
            // connection is idle, outside any transaction.
            let idle = match &held.0 {
                Some(object) => tokio::time::timeout(reclaim.wait, object.simple_query("")).await,
                None => return,
            };
            if matches!(idle, Ok(Ok(_))) {
                return held.idle();
            }
            let Some(client) = held.detach() else {
                return;
            };
            if client.is_closed() {
                return;
            }
            let token = client.cancel_token();
            let sent = match &reclaim.tls {
                Some(tls) => tokio::time::timeout(reclaim.wait, token.cancel_query(tls.clone())).await,
                None => tokio::time::timeout(reclaim.wait, token.cancel_query(NoTls)).await,
            };
            let sent = match sent {
                Ok(Ok(())) => "sent".to_owned(),
                Ok(Err(e)) => format!("not sent: {e}"),
                Err(_) => format!("not sent within {:?}", reclaim.wait),
            };
            tracing::warn!(
                wait = ?reclaim.wait,
                cancel = %sent,
                "a PostgreSQL statement given up on by its caller did not end within the wait (are statement_timeout and lock_timeout overridden?); cancelled it and closed its connection"
            );
            // Closed only now, so that the cancel finds the statement's
            // session still there.
            drop(client);
        });
    }
}

/// A connection whose statement may still be running: out of its pool
/// until [`Self::idle`] gives it back; closed if dropped otherwise (its
/// task dropped unfinished, as a runtime that shuts down does).
struct Quarantined(Option<Object>);

impl Quarantined {
    /// Back to the pool, idle: its statement answered.
    fn idle(mut self) {
        drop(self.0.take());
    }

    /// Out of the pool for good, its place free for a new connection.
    fn detach(mut self) -> Option<ClientWrapper> {
        self.0.take().map(Object::take)
    }
}

impl Drop for Quarantined {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            drop(Object::take(object));
        }
    }
}

/// A pooled connection lent to one store call. Every statement goes
/// through it, so that a call dropped before a statement answered is
/// known (see the module docs).
pub(super) struct Conn {
    /// `None` only once dropped.
    object: Option<Object>,
    /// Whether a statement was sent whose answer has not been read: set
    /// before each statement and cleared once its answer is in, rows or an
    /// error (a connection that answered an error is idle and fine). Read
    /// only in `drop`: a `Conn` is used by one call at a time (`&mut`
    /// for every statement), and dropped by that call's task, when it
    /// returns (clear) or when its future is dropped mid-statement (set);
    /// so no other task ever sees it. The connection then moves to a task
    /// of [`Reclaim`]'s, still checked out of its pool, and is used by
    /// nothing else until that task gives it back.
    asking: bool,
    reclaim: Arc<Reclaim>,
}

impl Conn {
    pub(super) fn new(object: Object, reclaim: Arc<Reclaim>) -> Conn {
        Conn {
            object: Some(object),
            asking: false,
            reclaim,
        }
    }

    /// The connection, about to be sent a statement.
    fn ask(&mut self) -> Result<&mut ClientWrapper, StoreError> {
        self.asking = true;
        self.object.as_deref_mut().ok_or_else(|| {
            StoreError::Unavailable("postgres: the connection was given back".into())
        })
    }

    /// Runs `sql` (prepared once per connection) and returns how many rows
    /// it changed.
    pub(super) async fn execute(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let client = self.ask()?;
        let answer = async {
            let statement = client.prepare_cached(sql).await?;
            client.execute(&statement, params).await
        }
        .await;
        self.asking = false;
        answer.map_err(pg_error)
    }

    pub(super) async fn query(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.ask()?;
        let answer = async {
            let statement = client.prepare_cached(sql).await?;
            client.query(&statement, params).await
        }
        .await;
        self.asking = false;
        answer.map_err(pg_error)
    }

    /// Runs `sql` unprepared (one round trip, no statement to cache).
    pub(super) async fn simple(&mut self, sql: &str) -> Result<(), StoreError> {
        let client = self.ask()?;
        let answer = client.simple_query(sql).await;
        self.asking = false;
        answer.map(drop).map_err(pg_error)
    }

    /// [`Self::query`] for a walk over many rows, under
    /// [`WALK_STATEMENT_TIMEOUT`] instead of the connection's limit (see
    /// [`Self::walk`]).
    pub(super) async fn walk_query(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        self.walk(sql, async |tx, statement| tx.query(statement, params).await)
            .await
    }

    /// [`Self::execute`] for a walk over many rows (see [`Self::walk`]).
    pub(super) async fn walk_execute(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        self.walk(sql, async |tx, statement| {
            tx.execute(statement, params).await
        })
        .await
    }

    /// Runs `sql` (prepared once per connection) as `run` says, in a
    /// transaction of its own under [`WALK_STATEMENT_TIMEOUT`] (`SET
    /// LOCAL` lasts as long as the transaction).
    async fn walk<T>(
        &mut self,
        sql: &str,
        run: impl AsyncFnOnce(&Transaction<'_>, &Statement) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, StoreError> {
        let client = self.ask()?;
        let answer = async {
            let tx = client.transaction().await?;
            tx.batch_execute(&walk_limit()).await?;
            let statement = tx.prepare_cached(sql).await?;
            let answer = run(&tx, &statement).await?;
            tx.commit().await?;
            Ok(answer)
        }
        .await;
        self.asking = false;
        answer.map_err(pg_error)
    }
}

fn walk_limit() -> String {
    format!(
        "SET LOCAL statement_timeout = {}",
        setting_millis(WALK_STATEMENT_TIMEOUT)
    )
}

impl Drop for Conn {
    fn drop(&mut self) {
        let Some(object) = self.object.take() else {
            return;
        };
        if self.asking {
            tracing::debug!("a PostgreSQL call was given up on mid-statement; its connection waits for the answer before it is used again");
            self.reclaim.reclaim(object);
        }
        // Else `object` goes back to its pool here, idle.
    }
}
