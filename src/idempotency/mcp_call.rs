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
use futures_util::StreamExt;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use super::body::{channel_body, holding, BodySender};
use super::exchange::{uncompressed, Claim, Exchange, Responder};
use super::mcp_catalog::{consult_shared_catalog, share_catalog_after};
use super::policy::McpRoute;
use super::rejection::Rejection;
use crate::core::{
    from_millis, CompletedRecord, FencingToken, Fingerprint, Outcome, StoredResponse, UnknownCause,
    UpstreamFailure,
};
use crate::http::headers::{IDEMPOTENCY_ORIGINAL_DATE, IDEMPOTENT_REPLAYED};
use crate::mcp::message::{answer_to, KeySource};
use crate::mcp::{
    encode, render, tool_error, Answer, BatchItem, EventParser, Framing, McpRequest, Protection,
    RunningCall,
};
use crate::observe::RequestOutcome;
use crate::request::fingerprint::canonical_json;
use crate::request::key::IDEMPOTENCY_KEY;
use crate::request::key::{parse_key, IdempotencyKey, InvalidKey};

/// Bumping this moves every MCP key to a new fingerprint (retries of
/// calls made before would be refused as reused keys). v2: the request
/// target is hashed too, and arguments that are not I-JSON as written.
const FINGERPRINT_DOMAIN: &[u8] = b"idemproxy.mcp.call.v2\0";

/// JSON-RPC: the body is not JSON.
const PARSE_ERROR: i64 = -32700;
/// JSON-RPC: the JSON is not a valid request.
const INVALID_REQUEST: i64 = -32600;

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

/// The fingerprint of a call: the request target it was sent to, its
/// tool and its arguments as written (without the key argument), in
/// RFC 8785 canonical form. The target keeps one key on two servers (two
/// routes, or one prefix in front of several) a mismatch, never the other
/// server's result. Its query counts as well: servers behind one endpoint
/// are often told apart by it (`/mcp?server=github`), and a client that
/// changes it between retries gets a loud mismatch, never a silent replay.
/// Arguments that are not I-JSON (an integer past 2^53, a member name
/// given twice) are hashed as written, so calls the server tells apart
/// stay apart. The JSON-RPC id, `_meta`, the session and the protocol
/// headers are left out: a new client restarts ids at 1, and a retry comes
/// with a new id.
fn call_fingerprint(target: &str, tool: &str, arguments: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(FINGERPRINT_DOMAIN);
    for part in [target, tool] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    match canonical_json(arguments, &[]) {
        Some(canonical) => {
            h.update(b"canonical\0");
            h.update(&canonical);
        }
        None => {
            h.update(b"as written\0");
            h.update(arguments);
        }
    }
    Fingerprint(h.finalize().into())
}

/// The request target as sent: path and query.
fn request_target(parts: &Parts) -> &str {
    parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |target| target.as_str())
}

/// How calls of `name` are protected on `route`.
fn protection_of(route: &McpRoute, name: &str) -> Protection {
    route.rules.protection(name, route.catalog.hints(name))
}

/// Why a batch may not pass: it carries a `tools/call` the proxy would
/// have to protect (it cannot, inside a batch, and forwarding it would run
/// it unprotected), or a cancel of a protected call still running.
fn batch_refusal(items: &[BatchItem], route: &McpRoute, session: Option<&str>) -> Option<String> {
    items.iter().find_map(|item| match item {
        BatchItem::Call { name } => {
            let protected = name
                .as_deref()
                .is_none_or(|name| protection_of(route, name) != Protection::None);
            protected.then(|| {
                "batches may not carry protected tool calls; send each call alone".to_owned()
            })
        }
        BatchItem::Cancel { request_id } => session
            .is_some_and(|s| route.sessions.is_running(s, request_id))
            .then(|| {
                "batches may not carry a cancel of a protected call that is running; \
                 send it alone"
                    .to_owned()
            }),
        BatchItem::Other => None,
    })
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
            McpRequest::Unparsable(why) => {
                let message = format!(
                    "the body is not JSON, so the proxy cannot tell whether it calls a protected \
                     tool (NaN, Infinity and lone surrogate escapes such as \"\\ud800\" are not \
                     JSON, though some parsers take them): {why}"
                );
                return self.refuse(&Value::Null, PARSE_ERROR, &message);
            }
            McpRequest::MalformedCall { id, name, why } => {
                consult_shared_catalog(&self.settings, &route, name.as_deref()).await;
                // A read-only tool's odd call is the server's to answer;
                // any other would pass unprotected.
                let protected = name
                    .as_deref()
                    .is_none_or(|name| protection_of(&route, name) != Protection::None);
                if protected {
                    return self.refuse(&id, INVALID_REQUEST, &why);
                }
                return self
                    .forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
                    .await;
            }
            McpRequest::List { id } => {
                if let Some(why) = header_mismatch(&parts.headers, "tools/list", None) {
                    return self.refuse(&id, INVALID_REQUEST, &why);
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
            McpRequest::Batch(items) => {
                for item in &items {
                    if let BatchItem::Call { name } = item {
                        consult_shared_catalog(&self.settings, &route, name.as_deref()).await;
                    }
                }
                if let Some(why) = batch_refusal(&items, &route, session_of(&parts.headers)) {
                    return self.refuse(&Value::Null, INVALID_REQUEST, &why);
                }
                tracing::debug!(route = %self.policy.route, "a JSON-RPC batch of unprotected messages passes");
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
        consult_shared_catalog(&self.settings, &route, Some(&call.name)).await;
        self.log
            .set_tool(&call.name, route.catalog.knows(&call.name));
        if let Some(why) = header_mismatch(&parts.headers, "tools/call", Some(&call.name)) {
            return self.refuse(&call.id, INVALID_REQUEST, &why);
        }
        let protection = protection_of(&route, &call.name);
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
        let fingerprint = call_fingerprint(
            request_target(&parts),
            &call.name,
            &call.arguments_text(&body, key_argument),
        );
        let forwarded = call.forwarded_body(&body, key_argument, route.strip_key_argument);
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

    /// 400 with a JSON-RPC error, nothing forwarded: a body the proxy
    /// cannot read (`-32700`), or a request it cannot protect as sent
    /// (`-32600`): a malformed protected call, a batch carrying one, or
    /// `Mcp-Method`/`Mcp-Name` headers (2026-07-28) that name another call
    /// than the body (whatever routes or authorizes by the headers would
    /// see a different call than the server runs).
    fn refuse(self, id: &Value, code: i64, why: &str) -> Response<Body> {
        let message = serde_json::json!({
            "jsonrpc": "2.0", "id": id,
            "error": {"code": code, "message": why},
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
        // A listing in a content coding could be neither rewritten nor
        // learned from: the model would not see the key argument.
        let request = uncompressed(Request::from_parts(parts, Body::from(body)));
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
            let route_name = self.policy.route.clone();
            let settings = self.settings.clone();
            move |data: &str| -> Option<String> {
                let mut message: Value = serde_json::from_str(data).ok()?;
                if message.get("id") != Some(&id) {
                    return None;
                }
                let result = message.get_mut("result")?;
                for tool in route.rules.shadowed_tools(result) {
                    tracing::warn!(
                        route = %route_name,
                        tool = %tool,
                        argument = %route.rules.key_argument,
                        "a protected tool declares the key argument itself: the proxy takes it \
                         as the idempotency key and strips it, so the server never sees its own \
                         argument; rename [mcp] key_argument"
                    );
                }
                let before = route.catalog.revision();
                let rewritten = route.rules.rewrite_listing(result, &route.catalog);
                share_catalog_after(&settings, &route, before);
                rewritten.then(|| message.to_string())
            }
        };
        let body = if is_event_stream(&head.headers) {
            head.headers.remove(CONTENT_LENGTH);
            rewrite_events(body, self.policy.max_response_bytes, rewrite)
        } else if head.status.is_success() {
            let mut body = body;
            match read_up_to(&mut body, self.policy.max_response_bytes, deadline).await {
                Ok((read, false)) => {
                    let bytes = Bytes::from(read.concat());
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
                // Too large to rewrite: the model does not learn the key
                // argument here, and a call without it is told which to add.
                Ok((read, true)) => {
                    tracing::warn!(
                        route = %self.policy.route,
                        "a tools/list answer over max_response_bytes passes unrewritten"
                    );
                    let read =
                        futures_util::stream::iter(read.into_iter().map(Ok::<_, axum::Error>));
                    Body::from_stream(read.chain(body.into_data_stream()))
                }
                Err(cause) => {
                    let response = Rejection::PassthroughFailed {
                        timeout: cause == UnknownCause::Timeout,
                    }
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
        let (head, mut body) = response.into_parts();
        let limit = self.policy.max_response_bytes;
        let (read, over) = match read_up_to(&mut body, limit, deadline).await {
            Ok(read) => read,
            Err(cause) => return self.ambiguous(claim, token, cause, respond).await,
        };
        if over {
            // The answer reaches its caller whole, as it comes; only the
            // record goes without it.
            let status = head.status.as_u16();
            self.log.set_status(status);
            let (tx, client_body) = channel_body(16);
            let _ = respond.send(Response::from_parts(head, client_body));
            let outcome = self
                .relay_unstored(
                    &claim,
                    token,
                    Some(tx),
                    read,
                    &mut body,
                    deadline,
                    Some(status),
                )
                .await;
            return self
                .log
                .finish_streamed(outcome.unwrap_or(RequestOutcome::Executed));
        }
        let bytes = Bytes::from(read.concat());
        let outcome = self
            .settle_answer(&claim, token, answer_to(&bytes, &self.call_id()))
            .await;
        let response = Response::from_parts(head, Body::from(bytes));
        self.answer(respond, outcome, response);
    }

    /// Relays the rest of an answer that is over `max_response_bytes`:
    /// `read` (what was read of it), then the upstream's frames as they
    /// come, unchanged and unread. With a `status` to settle (the call was
    /// not settled yet), its key settles as ran with that status, not
    /// stored (outcome unknown if the stream breaks), before the client
    /// sees the last frame, so a retry sent on receipt finds the record.
    #[allow(clippy::too_many_arguments)]
    async fn relay_unstored(
        &mut self,
        claim: &Claim,
        token: FencingToken,
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
                self.complete(claim, token, Outcome::NotStored { status })
                    .await;
                Some(RequestOutcome::Executed)
            }
            (Some(_), Some(cause)) => {
                self.complete(claim, token, Outcome::Unknown { cause })
                    .await;
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
        let status = head.status.as_u16();
        self.log.set_status(status);
        let (tx, client_body) = channel_body(16);
        let _ = respond.send(Response::from_parts(head, client_body));
        let mut client = Some(tx);
        let id = self.call_id();
        // An event over the cap could be stored but never replayed (the
        // key would be stuck), and would grow the parser without bound.
        let mut parser = EventParser::with_limit(self.policy.max_response_bytes);
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
            if parser.overflowed() {
                let read = vec![parser.take_rest()];
                let unsettled = settled.is_none().then_some(status);
                let outcome = self
                    .relay_unstored(
                        &claim,
                        token,
                        client,
                        read,
                        &mut upstream,
                        deadline,
                        unsettled,
                    )
                    .await;
                let outcome = settled.or(outcome).unwrap_or(RequestOutcome::Executed);
                return self.log.finish_streamed(outcome);
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

/// Reads `body` until it ends or holds more than `limit` bytes: what was
/// read, and whether the limit was passed (the rest is still in `body`);
/// or how the body failed before.
async fn read_up_to(
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
/// events pass as they came. From an event over `limit` bytes on, the
/// stream passes as it comes, unread: the parser holds no more than that.
fn rewrite_events(
    body: Body,
    limit: usize,
    rewrite: impl Fn(&str) -> Option<String> + Send + 'static,
) -> Body {
    let parser = EventParser::with_limit(limit);
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
                        if parser.overflowed() {
                            let chunk: Result<Bytes, axum::Error> = Ok(data.clone());
                            return Some((chunk, (body, parser, rewrite, false)));
                        }
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
                        if parser.overflowed() {
                            out.extend_from_slice(&parser.take_rest());
                        }
                        if out.is_empty() {
                            continue;
                        }
                        let chunk: Result<Bytes, axum::Error> = Ok(Bytes::from(out));
                        return Some((chunk, (body, parser, rewrite, false)));
                    }
                    Some(Err(e)) => return Some((Err(e), (body, parser, rewrite, true))),
                    None => {
                        let rest = parser.take_rest();
                        if rest.is_empty() {
                            return None;
                        }
                        return Some((Ok(rest), (body, parser, rewrite, true)));
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
    fn the_fingerprint_is_the_target_the_tool_and_its_canonical_arguments() {
        let fp = |target: &str, tool: &str, arguments: &str| {
            call_fingerprint(target, tool, arguments.as_bytes())
        };
        let a = fp("/mcp", "send", r#"{"to": "a", "n": 1.0}"#);
        assert_eq!(
            a,
            fp("/mcp", "send", r#"{"n":1,"to":"a"}"#),
            "reordered and renumbered arguments are the same call"
        );
        assert_ne!(a, fp("/mcp", "send", r#"{"to":"b","n":1}"#));
        assert_ne!(a, fp("/mcp", "mail", r#"{"to":"a","n":1}"#));
        assert_ne!(
            a,
            fp("/mcp/other", "send", r#"{"to":"a","n":1}"#),
            "another server"
        );
        assert_ne!(
            a,
            fp("/mcp?server=b", "send", r#"{"to":"a","n":1}"#),
            "another query"
        );
        // Not I-JSON: hashed as written, so what a server may read
        // differently stays apart.
        assert_ne!(
            fp("/mcp", "send", r#"{"n":{"a":1,"a":2}}"#),
            fp("/mcp", "send", r#"{"n":{"a":2}}"#)
        );
        assert_ne!(
            fp("/mcp", "send", r#"{"n":9007199254740993}"#),
            fp("/mcp", "send", r#"{"n":9007199254740992}"#)
        );
        // The parts cannot slide into each other.
        assert_ne!(fp("/mcpa", "b", "{}"), fp("/mcp", "ab", "{}"));
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
