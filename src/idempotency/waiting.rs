//! How a duplicate waits for the request in flight under its key
//! (`on_in_flight = "wait"`).

use std::time::Duration;

use tokio::time::Instant;

use super::context::Responder;

/// How a duplicate waits for the request in flight under its key
/// (`on_in_flight = "wait"`): polling `begin`, with a growing pause.
pub(super) struct Waiting {
    until: Instant,
    backoff: Duration,
    /// Set once the store said that this same request is running under
    /// the key: from then on a store failure is no reason to forward it,
    /// whatever `on_store_error` says, since that would run it a second
    /// time.
    pub(super) seen_in_flight: bool,
}

impl Waiting {
    pub(super) fn new(timeout: Duration) -> Self {
        Self {
            until: Instant::now() + timeout,
            backoff: Duration::from_millis(10),
            seen_in_flight: false,
        }
    }

    /// Pauses before the next look, or says the wait is over (its time is
    /// up, or the client left).
    pub(super) async fn pause(&mut self, respond: &Responder) -> bool {
        let now = Instant::now();
        if now >= self.until || respond.is_closed() {
            return false;
        }
        self.seen_in_flight = true;
        // Polling `begin` is one round trip per look, works across
        // replicas, and takes the key over at once if the first request
        // released it.
        tokio::time::sleep(self.backoff.min(self.until - now)).await;
        self.backoff = (self.backoff * 2).min(Duration::from_millis(250));
        true
    }
}
