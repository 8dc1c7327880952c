//! What the steps of a covered request's run hand each other: the
//! request's context (its route's policy, its log line, its
//! `max_in_flight` slot), the claim it makes on its key, and the channel
//! its answer goes back on. Nothing here knows the steps that use them.

use std::sync::Arc;

use axum::body::Body;
use http::Response;
use tokio::sync::{oneshot, OwnedSemaphorePermit};
use tokio::time::Instant;

use super::body::holding;
use super::layer::Settings;
use super::policy::Policy;
use crate::core::{Fingerprint, RecordKey};
use crate::observe::{RequestLog, RequestOutcome};

/// One covered request's share of the layer, whatever its dialect.
pub(super) struct RequestContext {
    pub(super) settings: Arc<Settings>,
    pub(super) policy: Arc<Policy>,
    pub(super) log: RequestLog,
    /// Held until the request ends (see `Settings::in_flight`), or handed
    /// to the task that settles its key late (`settle_late`).
    pub(super) permit: OwnedSemaphorePermit,
}

impl RequestContext {
    /// Sends `response` to the client (if it still listens) and logs.
    pub(super) fn answer(
        self,
        respond: Responder,
        outcome: RequestOutcome,
        response: Response<Body>,
    ) {
        self.log.finish(outcome, &response);
        let _ = respond.send(response);
    }

    /// Answers with a response of the upstream's whose body may still be
    /// arriving, as a passthrough's does: the body holds the request's
    /// `max_in_flight` slot until it is done and is cut off at `deadline`,
    /// so an upstream that stalls mid-body cannot hold either for good.
    pub(super) fn answer_relayed(
        self,
        respond: Responder,
        outcome: RequestOutcome,
        response: Response<Body>,
        deadline: Instant,
    ) {
        let Self { log, permit, .. } = self;
        log.finish(outcome, &response);
        let _ = respond.send(response.map(|body| holding(body, permit, deadline)));
    }

    pub(super) fn upstream_done(&mut self, started: Instant) {
        self.log.upstream_done(started.elapsed());
    }
}

/// The identity of a covered request, carried into the task that runs it.
#[derive(Clone, Copy)]
pub(super) struct Claim {
    /// When the request arrived: the record's `created_at`.
    pub(super) arrived_at: u64,
    pub(super) key: RecordKey,
    pub(super) fingerprint: Fingerprint,
    /// When the claim this request holds is presumed dead, counted from
    /// the instant it asked for the key (no later than the store's own
    /// `now`): set when `begin` acquires the key.
    pub(super) lease_ends: Instant,
}

/// Where a run sends its answer while the client waits for it.
pub(super) type Responder = oneshot::Sender<Response<Body>>;
