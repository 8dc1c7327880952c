//! A real, counting upstream for integration tests.
//!
//! [`TestUpstream::start`] serves HTTP/1.1 and h2c (prior knowledge) on
//! `127.0.0.1:0`; [`TestUpstream::start_tls`] the same over TLS with ALPN
//! `h2`/`http/1.1`. It stops when dropped. Its behaviour is driven by the
//! request's query, so tests need no setup calls; the parameters combine
//! freely and unknown ones are ignored (handy to vary a fingerprint):
//!
//! | query | effect |
//! |---|---|
//! | (none) | `201`, JSON `{"path", "execution", "body_len"}` |
//! | `delay_ms=N` | wait N ms before the response head |
//! | `hold=NAME` | wait before the response head until the test calls [`TestUpstream::release`] with NAME (30 s at most) |
//! | `status=NNN` | respond with that status |
//! | `reset=1` | read and count the request, then break the connection without a response |
//! | `body_bytes=N` | an N-byte body (see [`expected_body`]), streamed in chunks, with `Content-Length` |
//! | `chunked=1` | that body without `Content-Length` (chunked over HTTP/1.1) |
//! | `stream_delay_ms=N` | wait N ms between body chunks |
//! | `abort_body=1` | send the head and part of the body, then break the connection |
//! | `hold_tail=NAME` | with `body_bytes`: send all but the last chunk at once, the last once the test calls [`TestUpstream::release`] with NAME |
//! | `header=name:value` | add a response header (repeatable, percent-decoded) |
//! | `jsonrpc=result` | answer as an MCP server does: `200`, a JSON-RPC response to the request's `id` whose result's one text item is `<path> execution <n>` |
//! | `jsonrpc=listing` | `200`, a `tools/list` result: `send_email` (no annotations) whose `inputSchema` declares its own `idempotency_key`, and `get_weather` (`readOnlyHint`) that declares one too |
//! | `jsonrpc=null_id_error` | `200`, a JSON-RPC parse error with `"id": null` (a server that could not read the request) |
//! | `result_bytes=N` | with `jsonrpc=result`: the text item is N bytes of [`expected_body`] instead |
//! | `sse=1` | with `jsonrpc`: the message as one `text/event-stream` event |
//! | `ledger=1` | enter the request's `Idempotency-Key` in the ledger with the JSON answered (the default one), as an API that keeps its clients' keys does |
//!
//! `GET /ledger/<key>` (percent-decoded) looks the ledger up, as a
//! reconciliation lookup does: `200` with the JSON the key's first
//! execution answered and `Idempotency-Lookup: found`, `404` with
//! `Idempotency-Lookup: absent` when no request carried the key.
//!
//! Every request is counted per path (without the query) as soon as it has
//! fully arrived, before any delay: the side effect is considered done the
//! moment the upstream has the request. Every response carries
//! `x-upstream-execution: <n>`, the count for its path after this request.

#![allow(unreachable_pub)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{
    HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri, Version,
};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Size of each streamed body chunk.
pub const CHUNK: usize = 16 * 1024;

/// `body_bytes` when only `abort_body=1` is given.
pub const DEFAULT_ABORT_BODY_BYTES: usize = 64 * 1024;

type ResponseBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// One request as the upstream received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: Method,
    pub uri: Uri,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

#[derive(Default)]
struct Counts {
    executions: HashMap<String, usize>,
    total: usize,
    last: HashMap<String, RecordedRequest>,
    /// `ledger=1` requests by `Idempotency-Key`: the JSON each execution
    /// answered, in order (more than one: the key ran twice).
    ledger: HashMap<String, Vec<serde_json::Value>>,
}

struct State {
    counts: Mutex<Counts>,
    /// Connections accepted so far.
    connections: std::sync::atomic::AtomicUsize,
    /// Bumped on every counted request, so tests can wait for arrivals.
    arrivals: watch::Sender<usize>,
    /// Names of `hold=` requests the test has let go.
    released: watch::Sender<std::collections::HashSet<String>>,
}

impl State {
    fn counts(&self) -> MutexGuard<'_, Counts> {
        // A panicking test thread must not hide the counts from the others.
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a request; returns its execution number for its path.
    fn record(&self, path: &str, request: RecordedRequest) -> usize {
        let n = {
            let mut c = self.counts();
            c.total += 1;
            let n = c.executions.entry(path.to_owned()).or_insert(0);
            *n += 1;
            let n = *n;
            c.last.insert(path.to_owned(), request);
            n
        };
        self.arrivals.send_modify(|t| *t += 1);
        n
    }
}

/// A counting test upstream; see the module documentation.
pub struct TestUpstream {
    pub addr: SocketAddr,
    https: bool,
    state: Arc<State>,
    /// The accept loop; it owns every connection task, so aborting it (on
    /// drop) closes the listener and all connections.
    task: JoinHandle<()>,
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestUpstream {
    /// Plain HTTP/1.1 and h2c (prior knowledge) on `127.0.0.1:0`.
    pub async fn start() -> TestUpstream {
        Self::spawn(None).await
    }

    /// HTTPS with the given server config (see [`TestCert`]); HTTP/2 or
    /// HTTP/1.1 as ALPN picks.
    pub async fn start_tls(config: Arc<rustls::ServerConfig>) -> TestUpstream {
        Self::spawn(Some(tokio_rustls::TlsAcceptor::from(config))).await
    }

    async fn spawn(tls: Option<tokio_rustls::TlsAcceptor>) -> TestUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the test upstream");
        let addr = listener.local_addr().expect("test upstream address");
        let state = Arc::new(State {
            counts: Mutex::new(Counts::default()),
            connections: Default::default(),
            arrivals: watch::channel(0).0,
            released: watch::channel(Default::default()).0,
        });
        let https = tls.is_some();
        let task = tokio::spawn(accept_loop(listener, tls, state.clone()));
        TestUpstream {
            addr,
            https,
            state,
            task,
        }
    }

    /// `http://127.0.0.1:PORT` (`https://` for [`TestUpstream::start_tls`]).
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// How many connections the upstream has accepted.
    pub fn connections(&self) -> usize {
        self.state
            .connections
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many requests reached `path` (a query in `path` is ignored).
    pub fn executions(&self, path: &str) -> usize {
        let c = self.state.counts();
        c.executions.get(strip_query(path)).copied().unwrap_or(0)
    }

    /// How many requests reached any path.
    pub fn total(&self) -> usize {
        self.state.counts().total
    }

    /// The last request to `path`, whole.
    pub fn last_request(&self, path: &str) -> Option<RecordedRequest> {
        self.state.counts().last.get(strip_query(path)).cloned()
    }

    /// The headers of the last request to `path`.
    pub fn last_headers(&self, path: &str) -> Option<HeaderMap> {
        self.last_request(path).map(|r| r.headers)
    }

    /// The body of the last request to `path`.
    pub fn last_body(&self, path: &str) -> Option<Bytes> {
        self.last_request(path).map(|r| r.body)
    }

    /// Lets every `hold=NAME` request answer, now and from now on: a test
    /// keeps a request in flight for exactly as long as it needs, however
    /// slow the machine, instead of guessing a `delay_ms`.
    pub fn release(&self, name: &str) {
        self.state.released.send_modify(|released| {
            released.insert(name.to_owned());
        });
    }

    /// The JSON answered to each `ledger=1` request that carried `key`.
    pub fn ledger(&self, key: &str) -> Vec<serde_json::Value> {
        self.state
            .counts()
            .ledger
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// Waits until `path` has been executed at least `n` times; false if
    /// that did not happen within `within`. Lets a test act while a
    /// delayed request is known to be at the upstream, without sleeping.
    pub async fn wait_for_executions(&self, path: &str, n: usize, within: Duration) -> bool {
        let mut arrivals = self.state.arrivals.subscribe();
        let reached = arrivals.wait_for(|_| self.executions(path) >= n);
        let outcome = tokio::time::timeout(within, reached).await;
        matches!(outcome, Ok(Ok(_)))
    }
}

/// An `http://127.0.0.1:PORT` URL where nothing listens, for
/// connection-refused tests. The port stays bound, never listening, for
/// the rest of the test process: a connection to it is refused, and no
/// other test's listener (all run in one process, side by side) can take
/// it, as one could a port bound and released.
pub fn unused_port_url() -> String {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
        .expect("a TCP socket");
    let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    socket.bind(&any.into()).expect("bind an ephemeral port");
    let addr = socket
        .local_addr()
        .expect("ephemeral address")
        .as_socket()
        .expect("an IP address");
    std::mem::forget(socket);
    format!("http://{addr}")
}

/// The body `body_bytes=N` produces: byte `i` is `b'a' + i % 26`, so a
/// test can check a relayed body byte for byte.
pub fn expected_body(n: usize) -> Vec<u8> {
    (0..n).map(body_byte).collect()
}

fn body_byte(i: usize) -> u8 {
    b'a' + (i % 26) as u8
}

/// A self-signed certificate for `127.0.0.1` and `localhost`.
pub struct TestCert {
    /// The certificate, PEM: write it to a file for `upstream.ca_file`.
    pub cert_pem: String,
    /// The private key, PKCS#8 PEM.
    pub key_pem: String,
    cert_der: rustls_pki_types::CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl TestCert {
    pub fn generate() -> TestCert {
        let certified = rcgen::generate_simple_self_signed(vec![
            "127.0.0.1".to_owned(),
            "localhost".to_owned(),
        ])
        .expect("generate a self-signed certificate");
        TestCert {
            cert_pem: certified.cert.pem(),
            key_pem: certified.key_pair.serialize_pem(),
            cert_der: certified.cert.der().clone(),
            key_der: certified.key_pair.serialize_der(),
        }
    }

    /// A rustls server config (ring) presenting this certificate, with ALPN
    /// `h2` and `http/1.1`.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(self.key_der.clone().into());
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![self.cert_der.clone()], key)
        .expect("server certificate");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

fn strip_query(path: &str) -> &str {
    path.split('?').next().unwrap_or(path)
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<State>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _peer)) = accepted else { continue };
                state.connections.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = stream.set_nodelay(true);
                let state = state.clone();
                let tls = tls.clone();
                connections.spawn(async move {
                    match tls {
                        Some(acceptor) => {
                            // A client that rejects the certificate ends here.
                            if let Ok(stream) = acceptor.accept(stream).await {
                                serve(TokioIo::new(stream), state).await;
                            }
                        }
                        None => serve(TokioIo::new(stream), state).await,
                    }
                });
            }
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve<I>(io: I, state: Arc<State>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = service_fn(move |req| handle(state.clone(), req));
    // Errors here are the point of `reset` and `abort_body`.
    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .serve_connection(io, service)
        .await;
}

#[derive(Default)]
struct Controls {
    delay: Option<Duration>,
    hold: Option<String>,
    hold_tail: Option<String>,
    status: Option<u16>,
    reset: bool,
    body_bytes: Option<usize>,
    stream_delay: Option<Duration>,
    abort_body: bool,
    chunked: bool,
    headers: Vec<(String, String)>,
    jsonrpc: Option<String>,
    result_bytes: Option<usize>,
    sse: bool,
    ledger: bool,
}

impl Controls {
    fn parse(query: Option<&str>) -> Controls {
        let mut c = Controls::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v);
            let flag = v == "1" || v == "true";
            match k {
                "delay_ms" => c.delay = v.parse().ok().map(Duration::from_millis),
                "hold" => c.hold = Some(v),
                "hold_tail" => c.hold_tail = Some(v),
                "status" => c.status = v.parse().ok(),
                "reset" => c.reset = flag,
                "body_bytes" => c.body_bytes = v.parse().ok(),
                "stream_delay_ms" => c.stream_delay = v.parse().ok().map(Duration::from_millis),
                "abort_body" => c.abort_body = flag,
                "chunked" => c.chunked = flag,
                "jsonrpc" => c.jsonrpc = Some(v),
                "result_bytes" => c.result_bytes = v.parse().ok(),
                "sse" => c.sse = flag,
                "ledger" => c.ledger = flag,
                "header" => {
                    if let Some((name, value)) = v.split_once(':') {
                        c.headers
                            .push((name.trim().to_owned(), value.trim().to_owned()));
                    }
                }
                _ => {}
            }
        }
        c
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    // A request whose body never fully arrives is not counted: the upstream
    // would not have acted on it.
    let body = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    let path = parts.uri.path().to_owned();
    let controls = Controls::parse(parts.uri.query());
    let body_len = body.len();
    let request_id = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|message| message.get("id").cloned())
        .unwrap_or_default();
    let key = parts.headers.get("idempotency-key").cloned();
    let execution = state.record(
        &path,
        RecordedRequest {
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            headers: parts.headers,
            body,
        },
    );
    let answer = serde_json::json!({
        "path": path,
        "execution": execution,
        "body_len": body_len,
    });
    if let Some(looked_up) = path.strip_prefix("/ledger/") {
        return Ok(ledger_lookup(&state, &percent_decode(looked_up)));
    }
    if let (true, Some(key)) = (controls.ledger, key) {
        let key = String::from_utf8_lossy(key.as_bytes()).into_owned();
        let mut counts = state.counts();
        counts.ledger.entry(key).or_default().push(answer.clone());
    }

    if let Some(delay) = controls.delay {
        tokio::time::sleep(delay).await;
    }
    if let Some(name) = &controls.hold {
        until_released(&state, name).await;
    }
    if controls.reset {
        // hyper drops an HTTP/1 connection (no response written) and resets
        // an HTTP/2 stream when the service fails: the client sees a broken
        // exchange after its request went out, not a connect error.
        return Err(std::io::Error::other("reset requested by the test"));
    }

    let status = match controls.status.map(StatusCode::from_u16) {
        None if controls.jsonrpc.is_some() => StatusCode::OK,
        None => StatusCode::CREATED,
        Some(Ok(s)) => s,
        Some(Err(_)) => StatusCode::BAD_REQUEST,
    };
    let mut builder = Response::builder()
        .status(status)
        .header("x-upstream-execution", execution.to_string());
    for (name, value) in &controls.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            builder = builder.header(n, v);
        }
    }

    let body = if let Some(mode) = &controls.jsonrpc {
        let own_key = serde_json::json!({"type": "object",
            "properties": {"idempotency_key": {"type": "string"}}});
        let message = if mode == "listing" {
            serde_json::json!({"jsonrpc": "2.0", "id": request_id, "result": {"tools": [
                {"name": "send_email", "inputSchema": own_key},
                {"name": "get_weather", "annotations": {"readOnlyHint": true},
                    "inputSchema": own_key},
            ]}})
        } else if mode == "null_id_error" {
            serde_json::json!({"jsonrpc": "2.0", "id": null,
                "error": {"code": -32700, "message": "Parse error"}})
        } else {
            let text = match controls.result_bytes {
                Some(n) => String::from_utf8(expected_body(n)).unwrap_or_default(),
                None => format!("{path} execution {execution}"),
            };
            serde_json::json!({"jsonrpc": "2.0", "id": request_id,
                "result": {"content": [{"type": "text", "text": text}], "isError": false}})
        };
        let mut text = message.to_string();
        if controls.sse {
            text = format!("event: message\ndata: {text}\n\n");
            builder = builder.header("content-type", "text/event-stream");
        } else {
            builder = builder.header("content-type", "application/json");
            builder = builder.header("content-length", text.len().to_string());
        }
        let chunks: Vec<Result<Frame<Bytes>, std::io::Error>> = text
            .into_bytes()
            .chunks(CHUNK)
            .map(|chunk| Ok(Frame::data(Bytes::copy_from_slice(chunk))))
            .collect();
        StreamBody::new(futures_util::stream::iter(chunks)).boxed_unsync()
    } else if controls.body_bytes.is_some() || controls.abort_body {
        let total = controls
            .body_bytes
            .unwrap_or(DEFAULT_ABORT_BODY_BYTES)
            // An abort needs a body to break in the middle of.
            .max(if controls.abort_body { 2 } else { 0 });
        builder = builder.header("content-type", "application/octet-stream");
        if !controls.chunked {
            builder = builder.header("content-length", total.to_string());
        }
        let tail = controls.hold_tail.map(|name| (state.clone(), name));
        streamed_body(total, controls.stream_delay, controls.abort_body, tail)
    } else {
        builder = builder.header("content-type", "application/json");
        json_body(&answer)
    };
    builder.body(body).map_err(std::io::Error::other)
}

fn json_body(json: &serde_json::Value) -> ResponseBody {
    Full::new(Bytes::from(json.to_string()))
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// `GET /ledger/<key>`: what the key's first execution answered, or 404.
fn ledger_lookup(state: &State, key: &str) -> Response<ResponseBody> {
    let first = state
        .counts()
        .ledger
        .get(key)
        .and_then(|answers| answers.first().cloned());
    let (status, said, body) = match first {
        Some(answer) => (StatusCode::OK, "found", answer),
        None => (
            StatusCode::NOT_FOUND,
            "absent",
            serde_json::json!({"key": key}),
        ),
    };
    let mut response = Response::new(json_body(&body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    // The lookup protocol (docs/guarantees.md): the proof the proxy needs.
    headers.insert("idempotency-lookup", HeaderValue::from_static(said));
    response
}

/// Waits until the test releases `name` (30 s at most).
async fn until_released(state: &State, name: &str) {
    let mut released = state.released.subscribe();
    let _ = tokio::time::timeout(
        Duration::from_secs(30),
        released.wait_for(|names| names.contains(name)),
    )
    .await;
}

/// `total` bytes in chunks of [`CHUNK`], `delay` between chunks; with
/// `abort`, an error after the first chunk (at most half the body), which
/// makes hyper break the connection mid-body; with `tail`, the last chunk
/// only once the test releases that name.
fn streamed_body(
    total: usize,
    delay: Option<Duration>,
    abort: bool,
    tail: Option<(Arc<State>, String)>,
) -> ResponseBody {
    let first_limit = if abort {
        (total / 2).clamp(1, CHUNK)
    } else {
        CHUNK
    };
    // The state is the number of bytes sent; `usize::MAX` once aborted.
    let stream = futures_util::stream::unfold(0usize, move |sent| {
        let tail = tail.clone();
        async move {
            if sent == usize::MAX || (!abort && sent >= total) {
                return None;
            }
            if let Some((state, name)) = &tail {
                if sent > 0 && sent + CHUNK >= total {
                    until_released(state, name).await;
                }
            }
            if sent > 0 {
                // Before an abort, always pause: hyper writes out the head and
                // the first chunk only when the body stops being ready; an error
                // right away would discard them unsent.
                let pause = if abort {
                    Some(delay.unwrap_or(Duration::from_millis(20)))
                } else {
                    delay
                };
                if let Some(d) = pause {
                    tokio::time::sleep(d).await;
                }
                if abort {
                    let broken = std::io::Error::other("body aborted by the test");
                    return Some((Err(broken), usize::MAX));
                }
            }
            let limit = if sent == 0 { first_limit } else { CHUNK };
            let len = limit.min(total - sent);
            let chunk: Vec<u8> = (sent..sent + len).map(body_byte).collect();
            Some((Ok(Frame::data(Bytes::from(chunk))), sent + len))
        }
    });
    StreamBody::new(stream).boxed_unsync()
}
