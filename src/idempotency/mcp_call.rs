//! A POST to a `protocol = "mcp"` route (DESIGN §5): a JSON-RPC message
//! over Streamable HTTP. A protected `tools/call` is keyed by its key
//! argument and runs through the same claim → run → settle as any covered
//! request; what differs is what is stored (the JSON-RPC `result` that
//! answers the call), how a retry is answered (that result under the new
//! request's id), and how a refusal is said (a tool result with `isError`,
//! which the model reads, instead of an HTTP error, which it does not).
//! A `tools/list` answer is rewritten so the model learns the key
//! argument; everything else passes through untouched.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Limited};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use super::body::{channel_body, holding};
use super::exchange::{Claim, Exchange, Responder};
use super::fingerprint::canonical_json;
use super::key::{parse_key, IdempotencyKey, InvalidKey};
use super::policy::McpRoute;
use super::rejection::Rejection;
use crate::core::{
    from_millis, CompletedRecord, FencingToken, Fingerprint, Outcome, StoredResponse, UnknownCause,
    UpstreamFailure,
};
use crate::http::headers::{IDEMPOTENCY_KEY, IDEMPOTENCY_ORIGINAL_DATE, IDEMPOTENT_REPLAYED};
use crate::mcp::message::{answer_to, KeySource};
use crate::mcp::{
    encode, render, tool_error, Answer, EventParser, Framing, McpRequest, Protection, RunningCall,
};
use crate::observe::RequestOutcome;

/// Bumping this moves every MCP key to a new fingerprint (retries of
/// calls made before would be refused as reused keys).
const FINGERPRINT_DOMAIN: &[u8] = b"idemproxy.mcp.call.v1\0";

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
    /// The answer the model reads for `rejection`, as a tool result with
    /// `isError: true`; `None` for refusals that are the transport's
    /// (an unverified token, a body too large): those stay HTTP.
    pub(super) fn rejection(&self, rejection: &Rejection) -> Option<Response<Body>> {
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
    pub(super) fn replay(&self, record: &CompletedRecord) -> Response<Body> {
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
        self.respond(message, true, HeaderValue::from_str(&date).ok())
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

/// The fingerprint of a call: its tool and its arguments (RFC 8785
/// canonical, without the key argument). The JSON-RPC id, `_meta`, the
/// session and the protocol headers are left out: a new client restarts
/// ids at 1, and a retry comes with a new id.
fn call_fingerprint(tool: &str, arguments: &serde_json::Map<String, Value>) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(FINGERPRINT_DOMAIN);
    h.update((tool.len() as u64).to_be_bytes());
    h.update(tool.as_bytes());
    let raw = serde_json::to_vec(arguments).unwrap_or_default();
    match canonical_json(&raw, &[]) {
        Some(canonical) => h.update(&canonical),
        // Arguments serde_json wrote always canonicalize; were they not
        // to, their bytes as written still tell calls apart.
        None => h.update(&raw),
    }
    Fingerprint(h.finalize().into())
}

/// The key a call carries: in its body first, else the header.
fn call_key(
    key: Option<KeySource>,
    headers: &http::HeaderMap,
) -> Result<Option<IdempotencyKey>, InvalidKey> {
    let value = match key {
        Some(source) => match source.value() {
            Value::String(s) => s.clone(),
            Value::Number(n) if n.is_i64() || n.is_u64() => n.to_string(),
            _ => return Err(InvalidKey::NotText),
        },
        None => match headers.get(IDEMPOTENCY_KEY) {
            Some(value) => return parse_key(value).map(Some),
            None => return Ok(None),
        },
    };
    // The same rules as a header's key (`FromStr`).
    value.parse().map(Some)
}

impl<S> Exchange<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
{
    /// Runs a POST to an MCP route on the connection's task.
    pub(super) async fn start_mcp(
        mut self,
        req: Request<Body>,
        route: Arc<McpRoute>,
    ) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        let body = match self.read_body(&parts, body).await {
            Ok(body) => body,
            Err((outcome, rejection)) => return self.reject(outcome, rejection),
        };
        let call = match McpRequest::parse(&body) {
            McpRequest::Call(call) => call,
            McpRequest::List { id } => {
                if let Some(why) = header_mismatch(&parts.headers, "tools/list", None) {
                    return self.refuse_mismatch(&id, &why);
                }
                return self.list_tools(parts, body, id, &route).await;
            }
            McpRequest::Cancel { request_id } => {
                let session = session_of(&parts.headers);
                if session.is_some_and(|s| route.sessions.is_running(s, &request_id)) {
                    return self.hold_back_cancel(&request_id);
                }
                return self
                    .forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
                    .await;
            }
            McpRequest::Batch => {
                tracing::debug!(route = %self.policy.route, "a JSON-RPC batch passes unprotected");
                self.log.metrics().unprotected_batch();
                return self
                    .forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
                    .await;
            }
            McpRequest::Other => {
                return self
                    .forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
                    .await
            }
        };
        self.log
            .set_tool(&call.name, route.catalog.knows(&call.name));
        if let Some(why) = header_mismatch(&parts.headers, "tools/call", Some(&call.name)) {
            return self.refuse_mismatch(&call.id, &why);
        }
        let protection = route
            .rules
            .protection(&call.name, route.catalog.hints(&call.name));
        if protection == Protection::None {
            return self
                .forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
                .await;
        }
        let key_argument = &route.rules.key_argument;
        let version = parts
            .headers
            .get("mcp-protocol-version")
            .and_then(|v| v.to_str().ok());
        self.mcp = Some(McpCall {
            id: call.id.clone(),
            tool: call.name.clone(),
            key_argument: key_argument.clone(),
            framing: Framing::for_accept(
                parts
                    .headers
                    .get(http::header::ACCEPT)
                    .and_then(|v| v.to_str().ok()),
            ),
            result_type: version.is_some_and(|v| v >= SESSIONLESS_VERSION),
            replay_note: route.replay_note,
            _running: session_of(&parts.headers).map(|s| route.sessions.enter(s, &call.id)),
        });
        let key = match call_key(call.key(key_argument), &parts.headers) {
            Ok(Some(key)) => key,
            Ok(None) if protection == Protection::Optional => {
                return self
                    .forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
                    .await
            }
            Ok(None) => return self.reject(RequestOutcome::MissingKey, Rejection::MissingKey),
            Err(invalid) => {
                return self.reject(RequestOutcome::InvalidKey, Rejection::InvalidKey(invalid))
            }
        };
        let scope = match self.scope_of(&parts) {
            Ok(scope) => scope,
            Err((outcome, rejection)) => return self.reject(outcome, rejection),
        };
        let fingerprint = call_fingerprint(&call.name, &call.arguments_without(key_argument));
        let forwarded = Bytes::from(call.forwarded_body(key_argument, route.strip_key_argument));
        if route.strip_key_argument {
            // A 2026-07-28 client may mirror arguments in headers.
            let mirrored = format!("mcp-param-{key_argument}");
            parts.headers.remove(mirrored.as_str());
        }
        parts.headers.remove(IDEMPOTENCY_KEY);
        parts
            .headers
            .insert(CONTENT_LENGTH, HeaderValue::from(forwarded.len()));
        let request = Request::from_parts(parts, Body::from(forwarded));
        self.claim_and_run(&scope, &key, fingerprint, request).await
    }

    /// 400 with a JSON-RPC error: the `Mcp-Method`/`Mcp-Name` headers
    /// (2026-07-28) name another call than the body. Whatever routes or
    /// authorizes by the headers would see a different call than the
    /// server runs, so neither is trusted and nothing is forwarded.
    fn refuse_mismatch(self, id: &Value, why: &str) -> Response<Body> {
        let message = serde_json::json!({
            "jsonrpc": "2.0", "id": id,
            "error": {"code": -32600, "message": why},
        });
        let mut response = Response::new(Body::from(message.to_string()));
        *response.status_mut() = StatusCode::BAD_REQUEST;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        self.log.finish(RequestOutcome::BadBody, &response);
        response
    }

    /// A session's DELETE (2025 era): forwarded once the session's
    /// protected calls have settled, since the server drops what a closed
    /// session runs. Past the upstream timeout it goes anyway.
    pub(super) async fn end_session(
        self,
        req: Request<Body>,
        route: Arc<McpRoute>,
    ) -> Response<Body> {
        let (parts, body) = req.into_parts();
        if let Some(session) = session_of(&parts.headers) {
            let deadline = Instant::now() + self.settings.upstream_timeout;
            if !route.sessions.idle(session, deadline).await {
                tracing::warn!(
                    route = %self.policy.route,
                    "a session's DELETE waited its upstream timeout for a protected call and goes on"
                );
            }
        }
        self.forward_untouched(parts, body, RequestOutcome::Passthrough)
            .await
    }

    /// A `notifications/cancelled` for a protected call still running:
    /// acknowledged (202, as the server would) and not forwarded, so the
    /// call runs to completion and its result is kept for the retry.
    fn hold_back_cancel(self, request_id: &Value) -> Response<Body> {
        tracing::info!(
            route = %self.policy.route,
            request = %request_id,
            "a cancel of a protected call is held back: the call runs to completion"
        );
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::ACCEPTED;
        self.log.finish(RequestOutcome::Passthrough, &response);
        response
    }

    /// Forwards a `tools/list` and rewrites its answer: each protected
    /// tool gains the key argument; the listed tools are remembered.
    async fn list_tools(
        self,
        parts: Parts,
        body: Bytes,
        id: Value,
        route: &Arc<McpRoute>,
    ) -> Response<Body> {
        let deadline = Instant::now() + self.settings.upstream_timeout;
        let request = Request::from_parts(parts, Body::from(body));
        let response = match self.inner.clone().oneshot(request).await {
            Ok(response) => response,
            Err(e) => {
                let response = Rejection::PassthroughFailed {
                    timeout: e.into().is_timeout(),
                }
                .into_response(self.policy.profile);
                self.log.finish(RequestOutcome::Passthrough, &response);
                return response;
            }
        };
        let (mut head, body) = response.into_parts();
        let rewrite = {
            let route = route.clone();
            move |data: &str| -> Option<String> {
                let mut message: Value = serde_json::from_str(data).ok()?;
                if message.get("id") != Some(&id) {
                    return None;
                }
                let result = message.get_mut("result")?;
                route
                    .rules
                    .rewrite_listing(result, &route.catalog)
                    .then(|| message.to_string())
            }
        };
        let body = if is_event_stream(&head.headers) {
            head.headers.remove(CONTENT_LENGTH);
            rewrite_events(body, rewrite)
        } else if head.status.is_success() {
            let limit = self.policy.max_response_bytes;
            match tokio::time::timeout_at(deadline, Limited::new(body, limit).collect()).await {
                Ok(Ok(collected)) => {
                    let bytes = collected.to_bytes();
                    let text = std::str::from_utf8(&bytes).ok();
                    match text.and_then(rewrite) {
                        Some(rewritten) => {
                            head.headers
                                .insert(CONTENT_LENGTH, HeaderValue::from(rewritten.len()));
                            Body::from(rewritten)
                        }
                        None => Body::from(bytes),
                    }
                }
                _ => {
                    let response = Rejection::PassthroughFailed { timeout: false }
                        .into_response(self.policy.profile);
                    self.log.finish(RequestOutcome::Passthrough, &response);
                    return response;
                }
            }
        } else {
            body
        };
        let Self { log, permit, .. } = self;
        let response = Response::from_parts(head, body);
        log.finish(RequestOutcome::Passthrough, &response);
        response.map(|body| holding(body, permit, deadline))
    }

    /// Relays the answer to a protected call and stores the `result` that
    /// answers it (the key is released when the server refused the call:
    /// a JSON-RPC error, an `input_required` result, an HTTP 4xx).
    pub(super) async fn relay_call(
        mut self,
        claim: Claim,
        token: FencingToken,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) {
        let status = response.status();
        if status.is_client_error() {
            self.release(&claim, token).await;
            return self.answer_relayed(respond, RequestOutcome::Released, response, deadline);
        }
        if !status.is_success() {
            self.complete(
                &claim,
                token,
                Outcome::NotStored {
                    status: status.as_u16(),
                },
            )
            .await;
            return self.answer_relayed(respond, RequestOutcome::Executed, response, deadline);
        }
        if is_event_stream(response.headers()) {
            return self
                .relay_events(claim, token, response, deadline, respond)
                .await;
        }
        let (head, body) = response.into_parts();
        let limit = self.policy.max_response_bytes;
        let read = tokio::time::timeout_at(deadline, Limited::new(body, limit).collect()).await;
        let bytes = match read {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e))
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some() =>
            {
                self.complete(&claim, token, Outcome::NotStored { status: 200 })
                    .await;
                let rejection = Rejection::ResponseNotStored { status: 200 };
                return self.answer_rejection(respond, RequestOutcome::Executed, rejection);
            }
            Ok(Err(_)) | Err(_) => {
                let cause = if read.is_err() {
                    UnknownCause::Timeout
                } else {
                    UnknownCause::Reset
                };
                return self.ambiguous(claim, token, cause, respond).await;
            }
        };
        let outcome = self
            .settle_answer(&claim, token, answer_to(&bytes, &self.call_id()))
            .await;
        let response = Response::from_parts(head, Body::from(bytes));
        self.answer(respond, outcome, response);
    }

    /// Relays an event stream live (progress before the answer), holding
    /// the event that answers the call until its outcome is settled, so a
    /// retry sent on receipt finds the record. A client that leaves does
    /// not stop the reading: the call runs on and its result is stored.
    async fn relay_events(
        mut self,
        claim: Claim,
        token: FencingToken,
        response: Response<Body>,
        deadline: Instant,
        respond: Responder,
    ) {
        let (mut head, mut upstream) = response.into_parts();
        head.headers.remove(CONTENT_LENGTH);
        self.log.set_status(head.status.as_u16());
        let (tx, client_body) = channel_body(16);
        let _ = respond.send(Response::from_parts(head, client_body));
        let mut client = Some(tx);
        let id = self.call_id();
        let mut parser = EventParser::default();
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
                    if let Some(answer) = answer_to(event.data.as_bytes(), &id) {
                        settled = Some(self.settle_answer(&claim, token, Some(answer)).await);
                    }
                }
                if let Some(tx) = &client {
                    let mut frames = VecDeque::from([Frame::data(event.raw)]);
                    if !tx.send_all(&mut frames, deadline).await {
                        client = None;
                    }
                }
            }
        };
        let outcome = match (settled, ended) {
            (Some(outcome), _) => outcome,
            // The stream ended or broke without the answer: the tool may
            // have run.
            (None, cause) => {
                let cause = cause.unwrap_or(UnknownCause::Reset);
                self.complete(&claim, token, Outcome::Unknown { cause })
                    .await;
                RequestOutcome::OutcomeUnknown
            }
        };
        if let Some(tx) = client {
            if ended.is_some() {
                let _ = tx.try_send(Err("upstream event stream broke off".into()));
            } else {
                let rest = Bytes::copy_from_slice(parser.rest());
                let mut frames = VecDeque::from([Frame::data(rest)]);
                if rest_is_empty(&frames) || tx.send_all(&mut frames, deadline).await {
                    tx.finish();
                }
            }
        }
        self.log.finish_streamed(outcome);
    }

    /// Settles the key as the server's answer says: a final result is
    /// stored; an error or `input_required` releases the key; no answer at
    /// all (a body that is not the response to this call) is kept as ran,
    /// result not stored.
    async fn settle_answer(
        &mut self,
        claim: &Claim,
        token: FencingToken,
        answer: Option<Answer>,
    ) -> RequestOutcome {
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
                self.complete(claim, token, Outcome::Response(stored)).await;
                RequestOutcome::Executed
            }
            Some(Answer::Error | Answer::InputRequired) => {
                self.release(claim, token).await;
                RequestOutcome::Released
            }
            None => {
                self.complete(claim, token, Outcome::NotStored { status: 200 })
                    .await;
                RequestOutcome::Executed
            }
        }
    }

    fn call_id(&self) -> Value {
        self.mcp
            .as_ref()
            .map(|call| call.id.clone())
            .unwrap_or(Value::Null)
    }
}

/// The `Mcp-Session-Id` a request belongs to (2025 era), if any.
fn session_of(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

/// Why the `Mcp-Method`/`Mcp-Name` headers disagree with the body's
/// `method` and tool `name`, when they are present and do.
fn header_mismatch(headers: &http::HeaderMap, method: &str, name: Option<&str>) -> Option<String> {
    let header = |h: &str| headers.get(h).map(|v| v.to_str().unwrap_or("(not text)"));
    if let Some(said) = header("mcp-method").filter(|said| *said != method) {
        return Some(format!(
            "the Mcp-Method header says `{said}`, the body `{method}`"
        ));
    }
    let (said, name) = (header("mcp-name")?, name?);
    (said != name).then(|| format!("the Mcp-Name header says `{said}`, the body `{name}`"))
}

fn rest_is_empty(frames: &VecDeque<Frame<Bytes>>) -> bool {
    frames
        .iter()
        .all(|f| f.data_ref().is_none_or(|d| d.is_empty()))
}

fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
        })
}

/// `body`, an event stream, with each event whose data `rewrite` changes
/// replaced by a `message` event of the new data (its `id` kept); other
/// events pass as they came.
fn rewrite_events(body: Body, rewrite: impl Fn(&str) -> Option<String> + Send + 'static) -> Body {
    let parser = EventParser::default();
    let stream = futures_util::stream::unfold(
        (body, parser, rewrite, false),
        |(mut body, mut parser, rewrite, done)| async move {
            if done {
                return None;
            }
            loop {
                match body.frame().await {
                    Some(Ok(frame)) => {
                        let Some(data) = frame.data_ref() else {
                            continue;
                        };
                        let mut out = Vec::new();
                        for event in parser.feed(data) {
                            match rewrite(&event.data) {
                                Some(data) => out.extend_from_slice(&crate::mcp::Event::message(
                                    &data,
                                    event.id.as_deref(),
                                )),
                                None => out.extend_from_slice(&event.raw),
                            }
                        }
                        if out.is_empty() {
                            continue;
                        }
                        let chunk: Result<Bytes, axum::Error> = Ok(Bytes::from(out));
                        return Some((chunk, (body, parser, rewrite, false)));
                    }
                    Some(Err(e)) => return Some((Err(e), (body, parser, rewrite, true))),
                    None => {
                        let rest = Bytes::copy_from_slice(parser.rest());
                        if rest.is_empty() {
                            return None;
                        }
                        return Some((Ok(rest), (body, EventParser::default(), rewrite, true)));
                    }
                }
            }
        },
    );
    Body::from_stream(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_fingerprint_is_the_tool_and_its_canonical_arguments() {
        let args = |v: Value| v.as_object().cloned().unwrap_or_default();
        let a = call_fingerprint("send", &args(json!({"to": "a", "n": 1.0})));
        let b = call_fingerprint("send", &args(json!({"n": 1, "to": "a"})));
        assert_eq!(a, b, "reordered and renumbered arguments are the same call");
        assert_ne!(
            a,
            call_fingerprint("send", &args(json!({"to": "b", "n": 1})))
        );
        assert_ne!(
            a,
            call_fingerprint("mail", &args(json!({"to": "a", "n": 1})))
        );
    }

    #[test]
    fn mcp_headers_must_agree_with_the_body_when_present() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(header_mismatch(&headers, "tools/call", Some("send")), None);
        headers.insert("mcp-method", HeaderValue::from_static("tools/call"));
        headers.insert("mcp-name", HeaderValue::from_static("send"));
        assert_eq!(header_mismatch(&headers, "tools/call", Some("send")), None);
        assert!(header_mismatch(&headers, "tools/call", Some("get"))
            .is_some_and(|why| why.contains("Mcp-Name")));
        assert!(header_mismatch(&headers, "tools/list", None)
            .is_some_and(|why| why.contains("Mcp-Method")));
    }

    #[test]
    fn a_key_is_a_string_or_an_integer_from_the_body_else_the_header() {
        let mut headers = http::HeaderMap::new();
        let key = |source: Option<KeySource>, headers: &http::HeaderMap| {
            call_key(source, headers).map(|k| k.map(|k| k.as_str().to_owned()))
        };
        assert_eq!(key(None, &headers), Ok(None));
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("h-1"));
        assert_eq!(key(None, &headers), Ok(Some("h-1".into())));
        assert_eq!(
            key(Some(KeySource::Argument(json!("a-1"))), &headers),
            Ok(Some("a-1".into()))
        );
        assert_eq!(
            key(Some(KeySource::Params(json!(42))), &headers),
            Ok(Some("42".into()))
        );
        assert!(key(Some(KeySource::Argument(json!({"k": 1}))), &headers).is_err());
        assert!(key(Some(KeySource::Argument(json!(1.5))), &headers).is_err());
        assert!(key(Some(KeySource::Argument(json!(""))), &headers).is_err());
    }
}
