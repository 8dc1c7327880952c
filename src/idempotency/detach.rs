//! Runs that outlive their connection: a client that disconnects cancels
//! nothing, so a claimed key is always completed or released.

use std::panic::AssertUnwindSafe;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;

/// The run of a covered request (`Exchange::run`), polled on the
/// connection's task while the client waits for it, and moved to a task of
/// its own if the client goes first: dropping this spawns what is left, so a
/// disconnect cancels nothing and a claimed key is still completed or
/// released.
///
/// Spawning every run up front did the same, but each request then went
/// through the worker's run queue twice more (the spawned task, then the
/// connection's task woken by the answer), behind every other ready task;
/// polled here, the answer is ready in the poll that produces it.
pub(super) struct DetachOnDrop(Option<BoxFuture<'static, ()>>);

impl DetachOnDrop {
    pub(super) fn new(run: BoxFuture<'static, ()>) -> Self {
        Self(Some(run))
    }

    pub(super) fn poll(&mut self, cx: &mut Context<'_>) {
        let Some(run) = self.0.as_mut() else {
            return;
        };
        // A panic in the run must not take the client's connection with
        // it, as it would not have from a task of its own: the run is
        // dropped, its answer channel with it, and the client gets a 500.
        // Its claim, if it made one, fails closed when its lease runs out.
        match std::panic::catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(cx))) {
            Ok(Poll::Pending) => {}
            Ok(Poll::Ready(())) => self.0 = None,
            Err(_) => {
                tracing::error!("a covered request's run panicked; answering 500");
                self.0 = None;
            }
        }
    }
}

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        if let Some(run) = self.0.take() {
            // Without a runtime (it is shutting down), the run ends here like
            // every other task of that runtime; its claim then fails closed.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(run);
            }
        }
    }
}
