//! How a covered request's client is spoken to: the [`Dialect`] that
//! plain HTTP, an MCP tool call and observe mode each speak. The exchange
//! runs claim → run → settle the same for all of them and asks its
//! dialect only how to refuse, how to replay a record, and how to relay
//! and capture an executed response.

use std::future::Future;

use axum::body::Body;
use http::Response;
use tokio::time::Instant;

use super::context::Responder;
use super::policy::{OnAmbiguous, Policy, Profile};
use super::reconcile::FoundAnswer;
use super::rejection::Rejection;
use super::relay::stream_and_store;
use super::replay::replay;
use super::settle::Holder;
use crate::core::{CompletedRecord, Outcome, UnknownCause};
use crate::observe::RequestOutcome;

/// How one kind of client is answered. Static dispatch: the exchange is
/// generic over its dialect, so the plain HTTP path pays for no choice.
pub(super) trait Dialect: Send + Sync + 'static {
    /// The proxy's refusal as this client reads it.
    fn refuse(&self, rejection: Rejection, profile: Profile) -> Response<Body>;

    /// The answer to a retry, from the key's completed record.
    fn replay(&self, record: &CompletedRecord, policy: &Policy) -> Response<Body>;

    /// What a retry is answered from once the upstream's lookup found the
    /// operation (`reconcile_url`): the lookup's `answer` in the form this
    /// dialect stores.
    fn reconciled(&self, answer: &FoundAnswer) -> Outcome {
        answer.as_response()
    }

    /// Relays the executed `response` (not a released status) to the
    /// client while keeping what a retry is answered from, and settles the
    /// key `holder` holds before the client can see the answer end.
    fn capture(
        self,
        holder: Holder,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) -> impl Future<Output = ()> + Send
    where
        Self: Sized;
}

/// A plain HTTP client: refusals are problems (`application/problem+json`
/// or the route's profile), replays are the stored response, and the
/// response is stored as it was relayed.
pub(super) struct Http;

impl Dialect for Http {
    fn refuse(&self, rejection: Rejection, profile: Profile) -> Response<Body> {
        rejection.into_response(profile)
    }

    fn replay(&self, record: &CompletedRecord, policy: &Policy) -> Response<Body> {
        replay(record, policy)
    }

    fn capture(
        self,
        holder: Holder,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) -> impl Future<Output = ()> + Send {
        stream_and_store(holder, response, deadline, respond)
    }
}

/// The request may have executed: settles the key as unknown (fail
/// closed) or releases it, as `on_ambiguous` says, and tells the client.
pub(super) async fn settle_ambiguous(
    mut holder: Holder,
    dialect: &impl Dialect,
    cause: UnknownCause,
    respond: Responder,
) {
    let released = holder.cx.policy.settings.on_ambiguous == OnAmbiguous::Release;
    if released {
        holder.release().await;
    } else {
        holder.complete(Outcome::Unknown { cause }).await;
    }
    let rejection = Rejection::OutcomeUnknown { cause, released };
    let response = dialect.refuse(rejection, holder.cx.policy.settings.profile);
    holder
        .cx
        .answer(respond, RequestOutcome::OutcomeUnknown, response);
}

/// Stores `outcome` (what the lookup found, or the unknown outcome it
/// could not resolve) as the key's and answers it as every later retry
/// will be: a replay of the record.
pub(super) async fn settle_looked_up(
    mut holder: Holder,
    dialect: &impl Dialect,
    outcome: Outcome,
    respond: Responder,
) {
    let answered = match outcome {
        Outcome::Unknown { .. } => RequestOutcome::OutcomeUnknown,
        _ => RequestOutcome::Replayed,
    };
    let record = holder.record_of(outcome);
    holder.complete_with(record.clone()).await;
    let response = dialect.replay(&record, &holder.cx.policy);
    holder.cx.answer(respond, answered, response);
}
