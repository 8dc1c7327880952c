//! A POST to a `protocol = "mcp"` route (DESIGN §5): a JSON-RPC message
//! over Streamable HTTP. A protected `tools/call` is keyed by its key
//! argument and runs in the MCP dialect ([`McpCall`]); a `tools/list`
//! answer is rewritten so the model learns the key argument; a cancel of
//! a protected call is held back; everything else passes through
//! untouched. Until a call is recognised, the request speaks plain HTTP.

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use super::body::holding;
use super::context::RequestContext;
use super::dialect::Http;
use super::exchange::{uncompressed, Exchange};
use super::layer::Settings;
use super::mcp_call::{is_event_stream, read_up_to, session_of, McpCall};
use super::mcp_catalog_store::{consult_shared_catalog, share_catalog_after};
use super::policy::McpRoute;
use super::reconcile::lookup_of;
use super::rejection::Rejection;
use crate::core::{Fingerprint, UnknownCause, UpstreamFailure};
use crate::mcp::message::KeySource;
use crate::mcp::{BatchItem, EventParser, McpRequest, Protection, ToolCall};
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

/// The fingerprint of the `tools/call` a client sent as `parts` and
/// `body` on `route`, as [`Exchange::start_call`] takes it; `None` when
/// the body is no well-formed call. What `keys reconcile` holds the
/// operator's account of the call to.
pub(super) fn fingerprint_of_call(
    parts: &Parts,
    body: &[u8],
    route: &McpRoute,
) -> Option<Fingerprint> {
    let McpRequest::Call(call) = McpRequest::parse(body) else {
        return None;
    };
    let arguments = call.arguments_text(body, &route.rules.key_argument);
    Some(call_fingerprint(
        request_target(parts),
        &call.name,
        &arguments,
    ))
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

impl<S> Exchange<S, Http>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<UpstreamFailure>,
    S::Future: Send + 'static,
{
    /// Runs a POST to an MCP route on the connection's task.
    pub(super) async fn start_mcp(
        self,
        req: Request<Body>,
        route: Arc<McpRoute>,
    ) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let body = match self.read_body(&parts, body).await {
            Ok(body) => body,
            Err((outcome, rejection)) => return self.reject(outcome, rejection),
        };
        let message = McpRequest::parse(&body);
        self.answer_message(parts, body, message, route).await
    }

    /// What each message gets: a well-formed `tools/call` starts; any
    /// other is refused, rewritten, held back, or passes as it came.
    async fn answer_message(
        self,
        parts: Parts,
        body: Bytes,
        message: McpRequest,
        route: Arc<McpRoute>,
    ) -> Response<Body> {
        match message {
            McpRequest::Call(call) => return self.start_call(parts, body, call, route).await,
            McpRequest::Unparsable(why) => {
                let message = format!(
                    "the body is not JSON, so the proxy cannot tell whether it calls a protected \
                     tool (NaN, Infinity and lone surrogate escapes such as \"\\ud800\" are not \
                     JSON, though some parsers take them): {why}"
                );
                return self.refuse(&Value::Null, PARSE_ERROR, &message);
            }
            McpRequest::MalformedCall { id, name, why } => {
                consult_shared_catalog(&self.cx.settings, &route, name.as_deref()).await;
                // A read-only tool's odd call is the server's to answer;
                // any other would pass unprotected.
                let protected = name
                    .as_deref()
                    .is_none_or(|name| protection_of(&route, name) != Protection::None);
                if protected {
                    return self.refuse(&id, INVALID_REQUEST, &why);
                }
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
            }
            McpRequest::Batch(items) => {
                for item in &items {
                    if let BatchItem::Call { name } = item {
                        consult_shared_catalog(&self.cx.settings, &route, name.as_deref()).await;
                    }
                }
                if let Some(why) = batch_refusal(&items, &route, session_of(&parts.headers)) {
                    return self.refuse(&Value::Null, INVALID_REQUEST, &why);
                }
                tracing::debug!(route = %self.cx.policy.route, "a JSON-RPC batch of unprotected messages passes");
                self.cx.log.metrics().unprotected_batch();
            }
            McpRequest::Other => {}
        }
        self.forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
            .await
    }

    /// A protected `tools/call`: keyed by its key argument (or the header)
    /// and run through claim → run → settle in the MCP dialect; an
    /// unprotected one passes.
    async fn start_call(
        mut self,
        mut parts: Parts,
        body: Bytes,
        call: ToolCall,
        route: Arc<McpRoute>,
    ) -> Response<Body> {
        consult_shared_catalog(&self.cx.settings, &route, Some(&call.name)).await;
        self.cx
            .log
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
        let mcp_call = McpCall::new(call.id.clone(), call.name.clone(), &route, &parts.headers);
        let mut exchange = self.speaking(mcp_call);
        let key = match call_key(call.key(key_argument), &parts.headers) {
            Ok(Some(key)) => key,
            Ok(None) if protection == Protection::Optional => {
                return exchange
                    .forward_untouched(parts, body.into(), RequestOutcome::Passthrough)
                    .await
            }
            Ok(None) => return exchange.reject(RequestOutcome::MissingKey, Rejection::MissingKey),
            Err(invalid) => {
                return exchange.reject(RequestOutcome::InvalidKey, Rejection::InvalidKey(invalid))
            }
        };
        let scope = match exchange.scope_of(&parts) {
            Ok(scope) => scope,
            Err((outcome, rejection)) => return exchange.reject(outcome, rejection),
        };
        // From the call as the client sent it: the template's
        // `{json:/params/arguments/...}` may name the key argument too.
        exchange.lookup = lookup_of(&exchange.cx.policy, &parts, &body, &key);
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
        exchange
            .claim_and_run(&scope, &key, fingerprint, request)
            .await
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
        self.cx.log.finish(RequestOutcome::BadBody, &response);
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
            let deadline = Instant::now() + self.cx.settings.upstream_timeout;
            if !route.sessions.idle(session, deadline).await {
                tracing::warn!(
                    route = %self.cx.policy.route,
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
            route = %self.cx.policy.route,
            request = %request_id,
            "a cancel of a protected call is held back: the call runs to completion"
        );
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::ACCEPTED;
        self.cx.log.finish(RequestOutcome::Passthrough, &response);
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
        let deadline = Instant::now() + self.cx.settings.upstream_timeout;
        // A listing in a content coding could be neither rewritten nor
        // learned from: the model would not see the key argument.
        let request = uncompressed(Request::from_parts(parts, Body::from(body)));
        let response = match self.inner.clone().oneshot(request).await {
            Ok(response) => response,
            Err(e) => {
                let response = Rejection::PassthroughFailed {
                    timeout: e.into().is_timeout(),
                }
                .into_response(self.cx.policy.settings.profile);
                self.cx.log.finish(RequestOutcome::Passthrough, &response);
                return response;
            }
        };
        let (mut head, body) = response.into_parts();
        let rewrite = listing_rewrite(
            route.clone(),
            self.cx.policy.route.clone(),
            self.cx.settings.clone(),
            id,
        );
        let body = if is_event_stream(&head.headers) {
            head.headers.remove(CONTENT_LENGTH);
            rewrite_events(body, self.cx.policy.settings.max_response_bytes, rewrite)
        } else if head.status.is_success() {
            let mut body = body;
            let max = self.cx.policy.settings.max_response_bytes;
            match read_up_to(&mut body, max, deadline).await {
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
                        route = %self.cx.policy.route,
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
                    .into_response(self.cx.policy.settings.profile);
                    self.cx.log.finish(RequestOutcome::Passthrough, &response);
                    return response;
                }
            }
        } else {
            body
        };
        let RequestContext { log, permit, .. } = self.cx;
        let response = Response::from_parts(head, body);
        log.finish(RequestOutcome::Passthrough, &response);
        response.map(|body| holding(body, permit, deadline))
    }
}

/// What a `tools/list` answer's message becomes: each protected tool with
/// the key argument added, once the listing taught the route's catalog
/// (shared when it learned something); `None` when the message is not
/// the answer to `id` or needs no change.
fn listing_rewrite(
    route: Arc<McpRoute>,
    route_name: Arc<str>,
    settings: Arc<Settings>,
    id: Value,
) -> impl Fn(&str) -> Option<String> + Send + 'static {
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
