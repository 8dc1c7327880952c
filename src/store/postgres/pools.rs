//! One connection pool per traffic thread, so a statement, its socket I/O
//! and its answer stay on the thread that asked.
//!
//! tokio-postgres drives each connection in a task on the runtime that
//! opened it. Each traffic worker is a current-thread runtime
//! (`server::Workers`): with one pool for all of them, a worker handed a
//! connection another runtime opened (the startup connection, or another
//! worker's) crossed threads twice per statement, to the connection's task
//! and back, a futex wake and an extra `epoll_wait` each way. The Redis
//! store keeps a connection per event loop for the same reason
//! (`store::redis::connections`).
//!
//! `store.pool_size` stays the proxy's bound on traffic connections: the
//! loops' pools split it, rounded down, each resized as loops appear
//! (with more loops than `pool_size`, each still gets one). Everything else
//! (startup, the admin API, the sweeper, tests on a multi-thread runtime)
//! uses the shared pool, which opens few.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use deadpool_postgres::Pool;
use tokio::runtime::{Handle, RuntimeFlavor};

/// Builds a pool that opens connections as `store.url` says, holding at most the size given.
pub(super) type MakePool = Box<dyn Fn(usize) -> Option<Pool> + Send + Sync>;

pub(super) struct LoopPools {
    shared: Pool,
    make: MakePool,
    /// `store.pool_size`, split between the loops' pools.
    total: usize,
    /// Per current-thread runtime. Tokio may reuse the id of a runtime
    /// that has ended: its pool's connections then report closed when
    /// handed out (their tasks ended with it) and are replaced, as after a
    /// database restart.
    by_runtime: Mutex<HashMap<tokio::runtime::Id, Pool>>,
}

impl LoopPools {
    pub(super) fn new(shared: Pool, make: MakePool, total: usize) -> Self {
        Self {
            shared,
            make,
            total,
            by_runtime: Mutex::new(HashMap::new()),
        }
    }

    /// The pool for the calling task: its loop's own on a current-thread
    /// runtime, else the shared one.
    pub(super) fn current(&self) -> Pool {
        let Ok(handle) = Handle::try_current() else {
            return self.shared.clone();
        };
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return self.shared.clone();
        }
        let id = handle.id();
        let mut by_runtime = self
            .by_runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(pool) = by_runtime.get(&id) {
            return pool.clone();
        }
        let each = share(self.total, by_runtime.len() + 1);
        let Some(pool) = (self.make)(each) else {
            return self.shared.clone();
        };
        for other in by_runtime.values() {
            other.resize(each);
        }
        by_runtime.insert(id, pool.clone());
        pool
    }
}

/// Each of `loops` pools' part of `total` connections: rounded down, so
/// that the parts add up to `total` at most; at least one, so a loop with
/// more loops than connections to share can still serve (then, and only
/// then, one connection per loop is more than `total`).
fn share(total: usize, loops: usize) -> usize {
    (total / loops.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn the_loops_split_the_pool_size() {
        assert_eq!(share(16, 1), 16);
        assert_eq!(share(16, 2), 8);
        assert_eq!(share(16, 3), 5);
        assert_eq!(share(3, 2), 1);
        assert_eq!(share(1, 4), 1);
        assert_eq!(share(16, 0), 16);
    }
}
