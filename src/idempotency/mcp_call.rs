//! The MCP dialect (DESIGN §5): a protected `tools/call` runs through the
//! same claim → run → settle as any covered request; what differs is what
//! is stored (the JSON-RPC `result` that answers the call), how a retry is
//! answered (that result under the new request's id), and how a refusal
//! is said (a tool result with `isError`, which the model reads, instead
//! of an HTTP error, which it does not). How a POST to an MCP route
//! becomes such a call is `mcp_request`'s.

use std::collections::VecDeque;
use std::future::Future;

use axum::body::Body;
use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::time::Instant;

use super::body::{channel_body, BodySender};
use super::context::Responder;
use super::dialect::{settle_ambiguous, Dialect};
use super::policy::{McpRoute, Policy, Profile};
use super::reconcile::{FoundAnswer, IDEMPOTENCY_RECONCILED};
use super::rejection::Rejection;
use super::settle::Holder;
use crate::core::{from_millis, CompletedRecord, Outcome, StoredResponse, UnknownCause};
use crate::http::headers::{IDEMPOTENCY_ORIGINAL_DATE, IDEMPOTENT_REPLAYED};
use crate::mcp::message::answer_to;
use crate::mcp::{
    encode, reconciled_result as found_result, render, tool_error, Answer, EventParser, Framing,
    RunningCall,
};
use crate::observe::RequestOutcome;

/// The first protocol version without sessions, whose results carry
/// `resultType`.
const SESSIONLESS_VERSION: &str = "2026-07-28";

/// The protected `tools/call` an exchange is running: how to answer it.
pub(super) struct McpCall {
    /// The request's JSON-RPC id: every answer the proxy makes uses it.
    id: Value,
    tool: String,
    key_argument: String,
    framing: Framing,
    /// Results the proxy makes carry `resultType: "complete"` (2026-07-28).
    result_type: bool,
    replay_note: bool,
    /// Marks the call as running in its session while the exchange lives,
    /// so the session's cancel and DELETE do not stop it.
    _running: Option<RunningCall>,
}

impl McpCall {
    /// The call `id` of `tool` on `route`, answered as its `headers` ask.
    pub(super) fn new(
        id: Value,
        tool: String,
        route: &McpRoute,
        headers: &http::HeaderMap,
    ) -> Self {
        let version = headers
            .get("mcp-protocol-version")
            .and_then(|v| v.to_str().ok());
        let running = session_of(headers).map(|s| route.sessions.enter(s, &id));
        Self {
            framing: Framing::for_accept(
                headers
                    .get(http::header::ACCEPT)
                    .and_then(|v| v.to_str().ok()),
            ),
            result_type: version.is_some_and(|v| v >= SESSIONLESS_VERSION),
            replay_note: route.replay_note,
            key_argument: route.rules.key_argument.clone(),
            _running: running,
            id,
            tool,
        }
    }

    /// The answer the model reads for `rejection`, as a tool result with
    /// `isError: true`; `None` for refusals that are the transport's
    /// (an unverified token, a body too large): those stay HTTP.
    fn rejection(&self, rejection: &Rejection) -> Option<Response<Body>> {
        let text = self.rejection_text(rejection)?;
        Some(self.respond(tool_error(&self.id, &text), false, None))
    }

    fn rejection_text(&self, rejection: &Rejection) -> Option<String> {
        let arg = &self.key_argument;
        let tool = &self.tool;
        Some(match rejection {
            Rejection::MissingKey => format!(
                "This call of `{tool}` was not executed: it needs an idempotency key. Call it again \
                 with the argument `{arg}` set to a new unique value for this action (e.g. a UUID), \
                 and reuse that same value if you ever retry this action."
            ),
            Rejection::InvalidKey(why) => format!(
                "This call of `{tool}` was not executed: `{arg}` is not a usable idempotency key ({why}). \
                 Call it again with `{arg}` set to a string of 1 to 255 visible ASCII characters, \
                 e.g. a new UUID."
            ),
            Rejection::KeyReused { .. } => format!(
                "This call of `{tool}` was not executed: its `{arg}` was already used for a call with \
                 different arguments. If this is a new action, call again with a new `{arg}`. If you \
                 meant to retry the earlier action, repeat it with exactly its original arguments."
            ),
            Rejection::InFlight { .. } => format!(
                "An earlier call of `{tool}` with this `{arg}` is still running, so this one was not \
                 executed. Wait a few seconds and call again with the same `{arg}` (not a new one): \
                 you will get the earlier call's result."
            ),
            Rejection::StoreUnavailable { .. } | Rejection::ShuttingDown => format!(
                "This call of `{tool}` was not executed: the idempotency service cannot check this \
                 `{arg}` right now. An earlier call with the same `{arg}` may or may not have run. \
                 Retry in a few seconds with the same `{arg}`; do not use a new `{arg}` for this \
                 action before checking whether it already happened."
            ),
            Rejection::UpstreamUnreachable => format!(
                "This call of `{tool}` was not executed: the tool's server could not be reached. \
                 Retry in a few seconds with the same `{arg}`."
            ),
            Rejection::OutcomeUnknown { released, .. } => {
                let retry = if *released {
                    format!("A retry with the same `{arg}` runs the action again.")
                } else {
                    format!("A retry with the same `{arg}` returns this same answer.")
                };
                format!(
                    "The call of `{tool}` was sent but its result was lost (the server timed out or \
                     the connection broke): the action may or may not have happened. Check whether \
                     it happened before doing anything else; do not call it again with a new `{arg}` \
                     before checking. {retry}"
                )
            }
            Rejection::ResponseNotStored { status } => format!(
                "The call of `{tool}` ran (the server answered {status}), but its result could not be \
                 kept, so it cannot be shown again. Do not run the action again with a new `{arg}`; \
                 check its effect instead."
            ),
            Rejection::RecordUnreadable => format!(
                "This call of `{tool}` was not executed: an earlier call with this `{arg}` has a \
                 stored record that cannot be read, so it may already have run. Check the action's \
                 effect; do not retry it, and do not call it with a new `{arg}` before checking."
            ),
            _ => return None,
        })
    }

    /// The answer to a retry from the key's completed record.
    fn replay_record(&self, record: &CompletedRecord) -> Response<Body> {
        let date = humantime::format_rfc3339_seconds(from_millis(record.completed_at)).to_string();
        let message = match &record.outcome {
            Outcome::Response(stored) => {
                render::replay(&self.id, &stored.body, &date, self.replay_note)
            }
            Outcome::NotStored { status } => self
                .rejection_text(&Rejection::ResponseNotStored { status: *status })
                .map(|text| tool_error(&self.id, &text)),
            Outcome::Unknown { cause } => self
                .rejection_text(&Rejection::OutcomeUnknown {
                    cause: *cause,
                    released: false,
                })
                .map(|text| tool_error(&self.id, &text)),
            // The stores open what they sealed and unpack what they packed:
            // one still sealed or packed cannot be read, which the message
            // below says.
            Outcome::Sealed(_) | Outcome::Packed(_) => None,
        };
        let message = message.unwrap_or_else(|| {
            tool_error(
                &self.id,
                "This call already ran with this key, but its stored result cannot be read. \
                 Do not run the action again with a new key; check its effect instead.",
            )
        });
        let date = httpdate::fmt_http_date(from_millis(record.completed_at));
        let mut response = self.respond(message, true, HeaderValue::from_str(&date).ok());
        if let Outcome::Response(stored) = &record.outcome {
            if stored
                .headers
                .iter()
                .any(|(name, _)| name == IDEMPOTENCY_RECONCILED)
            {
                response
                    .headers_mut()
                    .insert(IDEMPOTENCY_RECONCILED, HeaderValue::from_static("true"));
            }
        }
        response
    }

    /// `message` as the client accepts it, with `resultType` for the
    /// clients that expect it and the replay headers when `replayed`.
    fn respond(
        &self,
        mut message: Value,
        replayed: bool,
        original_date: Option<HeaderValue>,
    ) -> Response<Body> {
        if self.result_type {
            if let Some(result) = message.get_mut("result").and_then(Value::as_object_mut) {
                result
                    .entry("resultType")
                    .or_insert_with(|| Value::String("complete".into()));
            }
        }
        let mut response = Response::new(Body::from(encode(&message, self.framing)));
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static(self.framing.content_type()),
        );
        if replayed {
            headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            if let Some(date) = original_date {
                headers.insert(IDEMPOTENCY_ORIGINAL_DATE, date);
            }
        }
        response
    }
}

impl Dialect for McpCall {
    /// A tool result with `isError: true`, or for refusals that are the
    /// transport's (an unverified token, a body too large) a problem.
    fn refuse(&self, rejection: Rejection, profile: Profile) -> Response<Body> {
        match self.rejection(&rejection) {
            Some(response) => response,
            None => rejection.into_response(profile),
        }
    }

    fn replay(&self, record: &CompletedRecord, _policy: &Policy) -> Response<Body> {
        self.replay_record(record)
    }

    fn reconciled(&self, answer: &FoundAnswer) -> Outcome {
        reconciled_result(answer)
    }

    fn capture(
        self,
        holder: Holder,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) -> impl Future<Output = ()> + Send {
        self.relay_call(holder, response, deadline, respond)
    }
}

impl McpCall {
    /// Relays the answer to a protected call and stores the `result` that
    /// answers it (the key is released when the server refused the call:
    /// a JSON-RPC error, an `input_required` result, an HTTP 4xx).
    async fn relay_call(
        self,
        mut holder: Holder,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) {
        let status = response.status();
        if status.is_client_error() {
            holder.release().await;
            return holder
                .cx
                .answer_relayed(respond, RequestOutcome::Released, response, deadline);
        }
        if !status.is_success() {
            holder
                .complete(Outcome::NotStored {
                    status: status.as_u16(),
                })
                .await;
            return holder
                .cx
                .answer_relayed(respond, RequestOutcome::Executed, response, deadline);
        }
        if is_event_stream(response.headers()) {
            return self.relay_events(holder, response, deadline, respond).await;
        }
        let (head, mut body) = response.into_parts();
        let limit = holder.cx.policy.settings.max_response_bytes;
        let (read, over) = match read_up_to(&mut body, limit, deadline).await {
            Ok(read) => read,
            Err(cause) => return settle_ambiguous(holder, &self, cause, respond).await,
        };
        if over {
            // The answer reaches its caller whole, as it comes; only the
            // record goes without it.
            let status = head.status.as_u16();
            holder.cx.log.set_status(status);
            let (tx, client_body) = channel_body(16);
            let _ = respond.send(Response::from_parts(head, client_body));
            let outcome = relay_unstored(
                &mut holder,
                Some(tx),
                read,
                &mut body,
                deadline,
                Some(status),
            )
            .await;
            return holder
                .cx
                .log
                .finish_streamed(outcome.unwrap_or(RequestOutcome::Executed));
        }
        let bytes = Bytes::from(read.concat());
        let outcome = settle_answer(&mut holder, answer_to(&bytes, &self.id)).await;
        let response = Response::from_parts(head, Body::from(bytes));
        holder.cx.answer(respond, outcome, response);
    }

    /// Relays an event stream live (progress before the answer), holding
    /// the event that answers the call until its outcome is settled, so a
    /// retry sent on receipt finds the record. A client that leaves does
    /// not stop the reading: the call runs on and its result is stored.
    async fn relay_events(
        self,
        mut holder: Holder,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) {
        let (mut head, mut upstream) = response.into_parts();
        head.headers.remove(CONTENT_LENGTH);
        let status = head.status.as_u16();
        holder.cx.log.set_status(status);
        let (tx, client_body) = channel_body(16);
        let _ = respond.send(Response::from_parts(head, client_body));
        let mut client = Some(tx);
        let id = &self.id;
        // An event over the cap could be stored but never replayed (the
        // key would be stuck), and would grow the parser without bound.
        let mut parser = EventParser::with_limit(holder.cx.policy.settings.max_response_bytes);
        let mut settled: Option<RequestOutcome> = None;
        let ended = loop {
            let frame = match tokio::time::timeout_at(deadline, upstream.frame()).await {
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => break None,
                Ok(Some(Err(_))) => break Some(UnknownCause::Reset),
                Err(_) => break Some(UnknownCause::Timeout),
            };
            let Some(data) = frame.data_ref() else {
                continue;
            };
            for event in parser.feed(data) {
                if settled.is_none() {
                    if let Some(answer) = answer_to(event.data.as_bytes(), id) {
                        settled = Some(settle_answer(&mut holder, Some(answer)).await);
                    }
                }
                if let Some(tx) = &client {
                    let mut frames = VecDeque::from([Frame::data(event.raw)]);
                    if !tx.send_all(&mut frames, deadline).await {
                        client = None;
                    }
                }
            }
            if parser.overflowed() {
                let read = vec![parser.take_rest()];
                let unsettled = settled.is_none().then_some(status);
                let outcome = relay_unstored(
                    &mut holder,
                    client,
                    read,
                    &mut upstream,
                    deadline,
                    unsettled,
                )
                .await;
                let outcome = settled.or(outcome).unwrap_or(RequestOutcome::Executed);
                return holder.cx.log.finish_streamed(outcome);
            }
        };
        let outcome = match (settled, ended) {
            (Some(outcome), _) => outcome,
            // The stream ended or broke without the answer: the tool may
            // have run.
            (None, cause) => {
                let cause = cause.unwrap_or(UnknownCause::Reset);
                holder.complete(Outcome::Unknown { cause }).await;
                RequestOutcome::OutcomeUnknown
            }
        };
        if let Some(tx) = client {
            end_events(tx, ended.is_some(), parser.rest(), deadline).await;
        }
        holder.cx.log.finish_streamed(outcome);
    }
}

/// Ends the client's event stream once the call is settled: with what the
/// parser still holds (`rest`), or, when the upstream's stream `broke`,
/// with an error that aborts it.
async fn end_events(tx: BodySender, broke: bool, rest: &[u8], deadline: Instant) {
    if broke {
        let _ = tx.try_send(Err("upstream event stream broke off".into()));
        return;
    }
    let rest = Bytes::copy_from_slice(rest);
    let mut frames = VecDeque::from([Frame::data(rest)]);
    if rest_is_empty(&frames) || tx.send_all(&mut frames, deadline).await {
        tx.finish();
    }
}

/// Relays the rest of an answer that is over `max_response_bytes`:
/// `read` (what was read of it), then the upstream's frames as they
/// come, unchanged and unread. With a `status` to settle (the call was
/// not settled yet), its key settles as ran with that status, not
/// stored (outcome unknown if the stream breaks), before the client
/// sees the last frame, so a retry sent on receipt finds the record.
async fn relay_unstored(
    holder: &mut Holder,
    mut client: Option<BodySender>,
    read: Vec<Bytes>,
    upstream: &mut Body,
    deadline: Instant,
    status: Option<u16>,
) -> Option<RequestOutcome> {
    let mut pending: VecDeque<Frame<Bytes>> = read
        .into_iter()
        .filter(|data| !data.is_empty())
        .map(Frame::data)
        .collect();
    let broke = loop {
        let frame = match tokio::time::timeout_at(deadline, upstream.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(None) => break None,
            Ok(Some(Err(_))) => break Some(UnknownCause::Reset),
            Err(_) => break Some(UnknownCause::Timeout),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        // All but the newest frame go on; the newest may be the last.
        if let Some(tx) = &client {
            if !tx.send_all(&mut pending, deadline).await {
                client = None;
            }
        }
        pending.clear();
        pending.push_back(Frame::data(data));
    };
    let outcome = match (status, broke) {
        (None, _) => None,
        (Some(status), None) => {
            holder.complete(Outcome::NotStored { status }).await;
            Some(RequestOutcome::Executed)
        }
        (Some(_), Some(cause)) => {
            holder.complete(Outcome::Unknown { cause }).await;
            Some(RequestOutcome::OutcomeUnknown)
        }
    };
    if let Some(tx) = client {
        if broke.is_some() {
            let _ = tx.send_all(&mut pending, deadline).await;
            let _ = tx.try_send(Err("upstream event stream broke off".into()));
        } else if tx.send_all(&mut pending, deadline).await {
            tx.finish();
        }
    }
    outcome
}

/// The stored result of a call the server's lookup (`reconcile_url`)
/// found: a tool result saying so, holding what the lookup answered
/// (see [`render::reconciled_result`]), marked reconciled on every replay.
pub(super) fn reconciled_result(answer: &FoundAnswer) -> Outcome {
    let result = found_result(answer.head.status.as_u16(), &answer.body);
    Outcome::Response(StoredResponse {
        status: StatusCode::OK.as_u16(),
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            (IDEMPOTENCY_RECONCILED.into(), Bytes::from_static(b"true")),
        ],
        body: Bytes::from(result.to_string()),
    })
}

/// Settles the key as the server's answer says: a final result is
/// stored; an error or `input_required` releases the key; no answer at
/// all (a body that is not the response to this call) is kept as ran,
/// result not stored.
async fn settle_answer(holder: &mut Holder, answer: Option<Answer>) -> RequestOutcome {
    match answer {
        Some(Answer::Result(result)) => {
            let stored = StoredResponse {
                status: StatusCode::OK.as_u16(),
                headers: vec![(
                    "content-type".into(),
                    Bytes::from_static(b"application/json"),
                )],
                body: Bytes::from(serde_json::to_vec(&result).unwrap_or_default()),
            };
            holder.complete(Outcome::Response(stored)).await;
            RequestOutcome::Executed
        }
        Some(Answer::Error | Answer::InputRequired) => {
            holder.release().await;
            RequestOutcome::Released
        }
        None => {
            holder.complete(Outcome::NotStored { status: 200 }).await;
            RequestOutcome::Executed
        }
    }
}

/// Reads `body` until it ends or holds more than `limit` bytes: what was
/// read, and whether the limit was passed (the rest is still in `body`);
/// or how the body failed before.
pub(super) async fn read_up_to(
    body: &mut Body,
    limit: usize,
    deadline: Instant,
) -> Result<(Vec<Bytes>, bool), UnknownCause> {
    let mut read = Vec::new();
    let mut len = 0;
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(None) => return Ok((read, false)),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    len += data.len();
                    read.push(data);
                }
                if len > limit {
                    return Ok((read, true));
                }
            }
            Ok(Some(Err(_))) => return Err(UnknownCause::Reset),
            Err(_) => return Err(UnknownCause::Timeout),
        }
    }
}

/// The `Mcp-Session-Id` a request belongs to (2025 era), if any.
pub(super) fn session_of(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

fn rest_is_empty(frames: &VecDeque<Frame<Bytes>>) -> bool {
    frames
        .iter()
        .all(|f| f.data_ref().is_none_or(|d| d.is_empty()))
}

pub(super) fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
        })
}
