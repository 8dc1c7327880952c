//! The protected calls still running in each MCP session (2025 protocol
//! era, `Mcp-Session-Id`). A client that gives up on a call sends
//! `notifications/cancelled` for its request id, and closing the client
//! sends the session's DELETE, which makes the server drop what the
//! session runs. Either would stop a side effect half-way, with its key
//! claimed and its outcome unknown. DESIGN §5.8 says a protected call runs
//! to completion and its result is stored for the retry, so the proxy
//! holds back a cancel of a protected call, and holds a DELETE until the
//! session's protected calls have settled.
//!
//! Sessionless clients (2026-07-28) cancel by closing the stream, which the
//! relay already ignores; their request ids restart with every client, so
//! they are not tracked here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use serde_json::Value;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Request ids (as JSON text, so `7` and `"7"` stay apart) by session id.
/// An entry lives from the claim of a call to its settle: the map holds no
/// more than the proxy's in-flight limit.
#[derive(Debug, Default)]
pub struct SessionCalls {
    running: Mutex<HashMap<String, Vec<String>>>,
    /// Woken whenever a call leaves, for DELETEs waiting on their session.
    left: Notify,
}

impl SessionCalls {
    /// Records the call `id` of `session` as running, until the returned
    /// guard is dropped.
    pub fn enter(self: &Arc<Self>, session: &str, id: &Value) -> RunningCall {
        let id = id.to_string();
        self.lock()
            .entry(session.to_owned())
            .or_default()
            .push(id.clone());
        RunningCall {
            calls: self.clone(),
            session: session.to_owned(),
            id,
        }
    }

    /// Whether `session`'s call `id` is a protected call still running.
    pub fn is_running(&self, session: &str, id: &Value) -> bool {
        let id = id.to_string();
        self.lock()
            .get(session)
            .is_some_and(|ids| ids.contains(&id))
    }

    /// Waits until `session` runs no protected call, or `deadline`; true
    /// when it is idle.
    pub async fn idle(&self, session: &str, deadline: Instant) -> bool {
        loop {
            // Registered before the check, so a call leaving in between
            // still wakes this waiter.
            let left = self.left.notified();
            if !self.lock().contains_key(session) {
                return true;
            }
            if tokio::time::timeout_at(deadline, left).await.is_err() {
                return false;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<String>>> {
        // A panic elsewhere cannot leave the map half-updated: every
        // update is a single push or remove.
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A protected call of a session, running until dropped.
#[derive(Debug)]
pub struct RunningCall {
    calls: Arc<SessionCalls>,
    session: String,
    id: String,
}

impl Drop for RunningCall {
    fn drop(&mut self) {
        {
            let mut running = self.calls.lock();
            if let Some(ids) = running.get_mut(&self.session) {
                if let Some(at) = ids.iter().position(|id| *id == self.id) {
                    ids.swap_remove(at);
                }
                if ids.is_empty() {
                    running.remove(&self.session);
                }
            }
        }
        self.calls.left.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_session_is_idle_once_its_last_call_leaves() {
        let calls = Arc::new(SessionCalls::default());
        let first = calls.enter("s1", &json!(7));
        let second = calls.enter("s1", &json!("7"));
        assert!(calls.is_running("s1", &json!(7)));
        assert!(calls.is_running("s1", &json!("7")));
        assert!(!calls.is_running("s1", &json!(8)));
        assert!(!calls.is_running("s2", &json!(7)));
        let soon = Instant::now() + Duration::from_secs(1);
        assert!(
            !calls.idle("s1", soon).await,
            "running calls hold the session"
        );
        assert!(calls.idle("s2", soon).await, "another session is idle");

        let waiter = {
            let calls = calls.clone();
            tokio::spawn(async move {
                calls
                    .idle("s1", Instant::now() + Duration::from_secs(60))
                    .await
            })
        };
        drop(first);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiter.is_finished(), "one call still runs");
        assert!(!calls.is_running("s1", &json!(7)));
        drop(second);
        assert!(waiter.await.expect("waiter"), "idle once the last left");
    }
}
