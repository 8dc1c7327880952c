//! The pooled client to the upstream: one `hyper_util` legacy client over
//! rustls, header hygiene for a reverse proxy, and a deadline.
//!
//! # How failures are classified, and why it matters
//!
//! The idempotency layer must know whether the upstream may have executed
//! the request, because that decides what a retry of the same key may do:
//!
//! * [`UpstreamError::Unreachable`] — **nothing was sent**. The client
//!   never obtained a connection: connection refused, DNS failure, TLS
//!   handshake failure, connect timeout (all reported by hyper-util as
//!   [`is_connect`](hyper_util::client::legacy::Error::is_connect)), or the
//!   deadline passed before any connection was handed to the request. The
//!   key can be released: a retry is safe.
//! * [`UpstreamError::Timeout`] — the deadline passed after a connection had
//!   been handed to the request, so the request may have been (partly)
//!   written and executed. A retry is **not** safe.
//! * [`UpstreamError::Reset`] — any other client error: the connection
//!   broke, the upstream closed it without answering, an HTTP/2 stream was
//!   reset. The request may have been sent; a retry is **not** safe.
//!
//! Everything not provably "nothing sent" is treated as possibly executed:
//! misreading a sent request as unsent could execute a payment twice,
//! while the reverse only costs a client an `outcome-unknown` answer.
//! (hyper-util already retries, on a fresh connection, a request that a
//! reused pooled connection rejected before writing it.)
//!
//! # Header hygiene
//!
//! [`Upstream::prepare`] removes hop-by-hop headers (RFC 9110 §7.6.1):
//! `Connection` and every header it names, `Keep-Alive`, `Proxy-Connection`,
//! `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, `Proxy-Authorization`,
//! `Proxy-Authenticate`. Two deliberate choices:
//!
//! * `TE: trailers` is kept (as exactly `trailers`) when the client's `TE`
//!   listed `trailers`: it is the one `TE` value that is meaningful end to
//!   end (gRPC servers require it) and the only one HTTP/2 allows.
//! * `X-Forwarded-For` is appended to (the client's address after any
//!   existing chain), while `X-Forwarded-Proto` and `X-Forwarded-Host` are
//!   set **only when absent**. The proxy is a sidecar: normally a load
//!   balancer or ingress in front of it is the edge, terminated TLS and set
//!   these headers, and overwriting them with the sidecar's own view (plain
//!   `http`, the pod's address) would mislead the upstream. When the proxy
//!   itself faces untrusted clients, strip those headers at the edge.
//!
//! Protocol upgrades (WebSocket, `CONNECT`) are not proxied: `Upgrade` and
//! `Connection` are hop-by-hop and removed like the others.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::header::{
    HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, HOST, PROXY_AUTHENTICATE,
    PROXY_AUTHORIZATION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE,
};
use http::uri::{Authority, Scheme};
use http::{HeaderMap, Request, Response, Uri, Version};
use http_body::Body as _;
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::{capture_connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use super::error::{ClientInfo, UpstreamError};
use crate::http::CloseDelimited;

/// `[upstream]`: where requests go and how the client reaches it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamSettings {
    /// Base URL; a path here is prefixed to every forwarded path.
    pub url: String,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Bounds the whole exchange, response body included (see
    /// [`Forward`](super::Forward)).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Extra PEM CA bundle trusted for `https://` upstreams, besides the
    /// system and webpki roots.
    pub ca_file: Option<PathBuf>,
    /// Speak HTTP/2 without TLS (prior knowledge) to a plain `http://`
    /// upstream. `https://` upstreams negotiate HTTP/2 by ALPN regardless.
    pub http2_prior_knowledge: bool,
    /// Idle pooled connections kept per upstream host.
    pub pool_max_idle_per_host: usize,
    /// How long a pooled connection may sit idle before the proxy closes
    /// it. Keep it below the upstream's own keep-alive timeout (Node.js 5 s,
    /// gunicorn 2 s): a request written just as the upstream closes an
    /// idle connection cannot be told from one it received, so it is
    /// stored as `outcome-unknown`.
    #[serde(with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
}

impl Default for UpstreamSettings {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:3000".into(),
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(30),
            ca_file: None,
            http2_prior_knowledge: false,
            pool_max_idle_per_host: 64,
            pool_idle_timeout: Duration::from_secs(1),
        }
    }
}

/// An upstream base URL, checked: absolute `http://` or `https://`, with a
/// host, without credentials or a query. The one check of it, for the
/// configuration's validation and the client alike.
#[derive(Clone, Debug)]
pub struct UpstreamUrl {
    scheme: Scheme,
    authority: Authority,
    /// `Host` sent upstream: the URL's authority.
    host: HeaderValue,
    /// The URL's path without a trailing slash ("" for none).
    base_path: String,
}

impl UpstreamUrl {
    /// Errors name `upstream.url`; a URL with credentials is not echoed.
    pub fn parse(url: &str) -> Result<Self, String> {
        // Before anything echoes the URL: a password can hold any
        // character, and one with `/`, `?` or `#` does not even parse as
        // user info. Credentials would end up in `Host` and in logs.
        if has_user_info(url) {
            return Err(
                "upstream.url: must not carry credentials (user:password@); the URL is not shown"
                    .into(),
            );
        }
        let absolute =
            || format!("upstream.url: `{url}` must be an absolute http:// or https:// URL");
        let parsed: Uri = url
            .parse()
            .map_err(|e| format!("upstream.url: `{url}`: {e}"))?;
        let scheme = match parsed.scheme_str() {
            Some("http") => Scheme::HTTP,
            Some("https") => Scheme::HTTPS,
            _ => return Err(absolute()),
        };
        let authority = parsed.authority().cloned().ok_or_else(absolute)?;
        if parsed.query().is_some() {
            return Err(format!("upstream.url: `{url}` must not have a query"));
        }
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|e| format!("upstream.url: `{url}`: {e}"))?;
        Ok(Self {
            scheme,
            authority,
            host,
            base_path: parsed.path().trim_end_matches('/').to_owned(),
        })
    }
}

/// Whether `url` has an `@` after its scheme: user info (or a path no
/// upstream base URL needs). Checked on the raw text, since a password may
/// hold `/`, `?` or `#` and then does not parse as user info.
fn has_user_info(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    rest.contains('@')
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1,
/// plus the legacy `Proxy-Connection` and `Keep-Alive`, and the proxy
/// authentication pair, which is meant for the proxy, not the origin).
///
/// Names, not strings: removing by `&str` parses the name on every call.
/// `CONNECTION` first: bit 0 of `remove_hop_by_hop`'s set of names found.
static HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    PROXY_AUTHORIZATION,
    PROXY_AUTHENTICATE,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The pooled client to one upstream. Cheap to clone: clones share the
/// connection pool.
#[derive(Clone)]
pub struct Upstream {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client<HttpsConnector<HttpConnector>, Body>,
    scheme: Scheme,
    authority: Authority,
    /// `Host` sent upstream: the upstream URL's authority, so an HTTP/1
    /// `Host` never disagrees with the HTTP/2 `:authority` taken from the URI.
    host: HeaderValue,
    /// Path prefix from the upstream URL, without a trailing slash ("" for
    /// none).
    base_path: String,
    /// HTTP/2 for prior-knowledge plain upstreams, otherwise HTTP/1.1: the
    /// pooled connection (ALPN for https) decides the wire protocol, and an
    /// HTTP/2 request version would be refused on an HTTP/1 connection.
    version: Version,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("scheme", &self.inner.scheme)
            .field("authority", &self.inner.authority)
            .field("base_path", &self.inner.base_path)
            .field("version", &self.inner.version)
            .finish()
    }
}

impl Upstream {
    /// Builds the client for `config.url`. Fails on a URL
    /// [`UpstreamUrl::parse`] refuses, on an unreadable `ca_file` or one
    /// with no certificate in it, and on a TLS configuration rustls refuses.
    pub fn new(config: &UpstreamSettings) -> Result<Self, String> {
        let UpstreamUrl {
            scheme,
            authority,
            host,
            base_path,
        } = UpstreamUrl::parse(&config.url)?;
        let tls = tls_config(config, scheme == Scheme::HTTPS)?;
        let mut http = HttpConnector::new();
        // The HTTPS wrapper dispatches on the scheme; the inner connector
        // must accept `https://` URIs to open their TCP connection.
        http.enforce_http(false);
        http.set_connect_timeout(Some(config.connect_timeout));
        http.set_nodelay(true);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);

        // Prior knowledge applies to plain upstreams only; `https://` ones
        // negotiate by ALPN (forcing HTTP/2 there would break HTTP/1-only
        // TLS servers).
        let h2_prior_knowledge = config.http2_prior_knowledge && scheme == Scheme::HTTP;
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(config.pool_max_idle_per_host)
            // Closed before the upstream closes it: a request written into
            // a connection the upstream is closing reads as sent (and its
            // key as outcome-unknown), so an idle connection is not reused
            // near the upstream's keep-alive timeout.
            .pool_idle_timeout(config.pool_idle_timeout)
            // Without a timer the pool's idle timeout never fires.
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .http2_only(h2_prior_knowledge)
            .build(connector);

        Ok(Self {
            inner: Arc::new(Inner {
                client,
                scheme,
                authority,
                host,
                base_path,
                version: if h2_prior_knowledge {
                    Version::HTTP_2
                } else {
                    Version::HTTP_11
                },
            }),
        })
    }

    /// Rewrites `req` for the upstream: URI and Host, hop-by-hop headers
    /// removed, `X-Forwarded-For/-Proto/-Host` added.
    pub fn prepare(&self, req: Request<Body>, client: ClientInfo) -> Request<Body> {
        let (mut parts, body) = req.into_parts();
        let headers = &mut parts.headers;

        // HTTP/1 requests carry the host in `Host`, HTTP/2 ones in the URI.
        let original_host = headers.get(HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });

        let keep_te_trailers = te_accepts_trailers(headers);
        remove_hop_by_hop(headers);
        if keep_te_trailers {
            headers.insert(TE, HeaderValue::from_static("trailers"));
        }

        if let Some(ip) = client.ip {
            append_forwarded_for(headers, ip);
        }
        if !headers.contains_key(X_FORWARDED_PROTO) {
            let proto = if client.https { "https" } else { "http" };
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
        }
        if !headers.contains_key(X_FORWARDED_HOST) {
            if let Some(host) = original_host {
                headers.insert(X_FORWARDED_HOST, host);
            }
        }

        headers.insert(HOST, self.inner.host.clone());
        match self.upstream_uri(&parts.uri) {
            Ok(uri) => parts.uri = uri,
            // Unreachable in practice (both halves are valid URI parts);
            // `send` refuses the still-relative URI as nothing-sent.
            Err(e) => {
                tracing::error!(error = %e, uri = %parts.uri, "cannot build the upstream URI")
            }
        }
        parts.version = self.inner.version;
        Request::from_parts(parts, body)
    }

    /// Sends a prepared request and waits for the response head until
    /// `deadline`. Hop-by-hop headers are removed from the response.
    pub async fn send(
        &self,
        mut req: Request<Body>,
        deadline: tokio::time::Instant,
    ) -> Result<Response<Incoming>, UpstreamError> {
        if req.uri().scheme().is_none() || req.uri().authority().is_none() {
            return Err(UpstreamError::Unreachable(format!(
                "request URI `{}` was not prepared for the upstream",
                req.uri()
            )));
        }
        // Filled in by hyper-util the moment a connection is handed to the
        // request, before anything is written: tells a deadline that expired
        // while connecting (nothing sent) from one that expired later.
        let captured = capture_connection(&mut req);
        match tokio::time::timeout_at(deadline, self.inner.client.request(req)).await {
            Ok(Ok(mut response)) => {
                if is_close_delimited(&response) {
                    response.extensions_mut().insert(CloseDelimited);
                }
                remove_hop_by_hop(response.headers_mut());
                Ok(response)
            }
            Ok(Err(e)) if e.is_connect() => Err(UpstreamError::Unreachable(error_chain(&e))),
            Ok(Err(e)) => Err(UpstreamError::Reset(error_chain(&e))),
            Err(_elapsed) => {
                if captured.connection_metadata().is_none() {
                    Err(UpstreamError::Unreachable(
                        "no connection to the upstream before the deadline".into(),
                    ))
                } else {
                    Err(UpstreamError::Timeout)
                }
            }
        }
    }

    /// The upstream's absolute URI for an inbound request URI: its path and
    /// query behind the upstream URL's base path.
    fn upstream_uri(&self, inbound: &Uri) -> Result<Uri, http::Error> {
        let path_and_query = join_path(&self.inner.base_path, inbound);
        Uri::builder()
            .scheme(self.inner.scheme.clone())
            .authority(self.inner.authority.clone())
            .path_and_query(path_and_query)
            .build()
    }
}

/// Trust store: the system's roots, the webpki (Mozilla) roots so a bare
/// container without a CA bundle still verifies public upstreams, and the
/// operator's `ca_file`. rustls runs on ring, named explicitly because the
/// build has no aws-lc-rs.
///
/// The client only ever connects to the configured upstream, so for an
/// `http://` one the system and webpki roots are skipped (`https` false):
/// they would never be used, and reading the system store costs startup
/// time. A `ca_file` is still read, so a bad one is reported either way.
fn tls_config(config: &UpstreamSettings, https: bool) -> Result<rustls::ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    if https {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let native = rustls_native_certs::load_native_certs();
        for e in &native.errors {
            // A broken system store must not stop the proxy: webpki roots
            // and `ca_file` still apply.
            tracing::warn!(error = %e, "cannot load some system CA certificates");
        }
        let (_added, ignored) = roots.add_parsable_certificates(native.certs);
        if ignored > 0 {
            tracing::debug!(ignored, "system CA certificates rustls cannot use");
        }
    }

    if let Some(path) = &config.ca_file {
        let shown = path.display();
        let pem = std::fs::read(path).map_err(|e| format!("upstream.ca_file {shown}: {e}"))?;
        let mut found = 0usize;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| format!("upstream.ca_file {shown}: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("upstream.ca_file {shown}: {e}"))?;
            found += 1;
        }
        if found == 0 {
            return Err(format!(
                "upstream.ca_file {shown}: no PEM certificate in it"
            ));
        }
    }

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("upstream TLS: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// `base` (no trailing slash, possibly empty) followed by the inbound path
/// and query, without doubling the slash between them.
fn join_path(base: &str, inbound: &Uri) -> String {
    // An asterisk-form (`OPTIONS *`) or otherwise path-less target maps to
    // the upstream's root.
    let path = match inbound.path() {
        p if p.starts_with('/') => p,
        _ => "/",
    };
    let mut out =
        String::with_capacity(base.len() + path.len() + 1 + inbound.query().map_or(0, str::len));
    out.push_str(base);
    out.push_str(path);
    if let Some(q) = inbound.query() {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Whether `response`'s body ends only where the upstream closes the
/// connection: HTTP/1 with neither a length nor chunked framing (read
/// before `Transfer-Encoding`, a hop-by-hop header, is removed). hyper
/// knows a body that is empty by its status or the request's method.
fn is_close_delimited(response: &Response<Incoming>) -> bool {
    let body = response.body();
    response.version() <= Version::HTTP_11
        && !body.is_end_stream()
        && body.size_hint().exact().is_none()
        && !response.headers().contains_key(TRANSFER_ENCODING)
}

/// Removes the hop-by-hop headers: the fixed list and every header the
/// `Connection` header names. `Content-Length` survives even when named:
/// it frames the body the proxy forwards unchanged.
pub(super) fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // Runs on every request and response, and most carry none or only
    // `Connection: keep-alive`: one pass of name comparisons finds which
    // fixed names are present, and only those are removed (a removal is a
    // hash lookup).
    let mut present = 0u16;
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name.as_str()) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    // Names listed in `Connection` are hop-by-hop too. They are removed by
    // `&str`, which costs no `HeaderName` (an allocation for any name
    // outside the standard set, such as the usual `keep-alive`); the values
    // are cloned first (a reference count each) so they outlive removals.
    if present & 1 != 0 {
        let listed: Vec<HeaderValue> = headers.get_all(CONNECTION).iter().cloned().collect();
        for token in listed
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|token| !token.eq_ignore_ascii_case(CONTENT_LENGTH.as_str()))
        {
            headers.remove(token);
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

/// Where `name` (lower case, as header names are) sits in [`HOP_BY_HOP`]:
/// one `match`, mostly length comparisons, instead of nine name
/// comparisons per header.
fn hop_by_hop_index(name: &str) -> Option<usize> {
    Some(match name {
        "connection" => 0,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "te" => 3,
        "trailer" => 4,
        "transfer-encoding" => 5,
        "upgrade" => 6,
        "proxy-authorization" => 7,
        "proxy-authenticate" => 8,
        _ => return None,
    })
}

/// Whether any `TE` value lists the `trailers` token.
fn te_accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            item.split(';')
                .next()
                .is_some_and(|token| token.trim().eq_ignore_ascii_case("trailers"))
        })
}

/// Appends the client's IP to `X-Forwarded-For`, folding several header
/// lines into one comma-separated value.
fn append_forwarded_for(headers: &mut HeaderMap, ip: HeaderValue) {
    if !headers.contains_key(X_FORWARDED_FOR) {
        headers.insert(X_FORWARDED_FOR, ip);
        return;
    }
    let mut value: Vec<u8> = Vec::new();
    for existing in headers.get_all(X_FORWARDED_FOR) {
        let existing = existing.as_bytes().trim_ascii();
        if existing.is_empty() {
            continue;
        }
        if !value.is_empty() {
            value.extend_from_slice(b", ");
        }
        value.extend_from_slice(existing);
    }
    if !value.is_empty() {
        value.extend_from_slice(b", ");
    }
    value.extend_from_slice(ip.as_bytes());
    match HeaderValue::from_bytes(&value) {
        Ok(v) => {
            headers.insert(X_FORWARDED_FOR, v);
        }
        // The existing values were valid header bytes and an IP is ASCII,
        // so this cannot fail; keep the client's own value if it somehow does.
        Err(e) => tracing::warn!(error = %e, "cannot extend X-Forwarded-For"),
    }
}

/// The error and its sources, `a: b: c`, since hyper-util's own `Display`
/// only names the kind ("client error (Connect)").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(url: &str) -> Upstream {
        Upstream::new(&settings(url)).expect("upstream builds")
    }

    fn settings(url: &str) -> UpstreamSettings {
        UpstreamSettings {
            url: url.into(),
            ..UpstreamSettings::default()
        }
    }

    fn client() -> ClientInfo {
        ClientInfo::new(Some(([10, 1, 2, 3], 55555).into()), false)
    }

    fn request(uri: &str, headers: &[(&str, &str)]) -> Request<Body> {
        let mut b = Request::builder().method("POST").uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).expect("request")
    }

    #[test]
    fn base_path_is_joined_without_double_slashes() {
        for (base, inbound, want) in [
            ("http://h:1", "/v1/x?y=1", "http://h:1/v1/x?y=1"),
            ("http://h:1/", "/v1/x?y=1", "http://h:1/v1/x?y=1"),
            ("http://h:1/api", "/v1/x?y=1", "http://h:1/api/v1/x?y=1"),
            ("http://h:1/api/", "/v1/x", "http://h:1/api/v1/x"),
            ("https://h/a/b/", "/", "https://h/a/b/"),
            (
                "http://h:1/api",
                "http://client.example/v1?q",
                "http://h:1/api/v1?q",
            ),
        ] {
            let up = upstream(base);
            let req = up.prepare(request(inbound, &[]), client());
            assert_eq!(req.uri().to_string(), want, "{base} + {inbound}");
        }
    }

    #[test]
    fn host_is_rewritten_and_the_original_kept_as_forwarded_host() {
        let up = upstream("http://127.0.0.1:3000/api");
        let req = up.prepare(request("/v1/pay", &[("host", "api.example.com")]), client());
        assert_eq!(req.headers()[HOST], "127.0.0.1:3000");
        assert_eq!(req.headers()["x-forwarded-host"], "api.example.com");
        assert_eq!(req.headers()["x-forwarded-proto"], "http");
        assert_eq!(req.version(), Version::HTTP_11);

        // HTTP/2 inbound: the host is in the URI.
        let req = up.prepare(request("https://api.example.com/v1", &[]), client());
        assert_eq!(req.headers()[HOST], "127.0.0.1:3000");
        assert_eq!(req.headers()["x-forwarded-host"], "api.example.com");
    }

    #[test]
    fn forwarded_proto_and_host_from_a_fronting_proxy_are_kept() {
        let up = upstream("http://127.0.0.1:3000");
        let req = up.prepare(
            request(
                "/",
                &[
                    ("host", "pod:8080"),
                    ("x-forwarded-proto", "https"),
                    ("x-forwarded-host", "api.example.com"),
                ],
            ),
            client(),
        );
        assert_eq!(req.headers()["x-forwarded-proto"], "https");
        assert_eq!(req.headers()["x-forwarded-host"], "api.example.com");

        let req = up.prepare(request("/", &[]), ClientInfo::new(None, true));
        assert_eq!(req.headers()["x-forwarded-proto"], "https");
        assert!(req.headers().get("x-forwarded-for").is_none());
    }

    #[test]
    fn forwarded_for_is_appended() {
        let up = upstream("http://127.0.0.1:3000");
        let req = up.prepare(request("/", &[]), client());
        assert_eq!(req.headers()["x-forwarded-for"], "10.1.2.3");

        let req = up.prepare(
            request(
                "/",
                &[
                    ("x-forwarded-for", "203.0.113.7"),
                    ("x-forwarded-for", "198.51.100.1, 192.0.2.9"),
                ],
            ),
            client(),
        );
        let all: Vec<_> = req.headers().get_all("x-forwarded-for").iter().collect();
        assert_eq!(all, ["203.0.113.7, 198.51.100.1, 192.0.2.9, 10.1.2.3"]);

        let mapped = ClientInfo::new(Some("[::ffff:192.0.2.1]:1".parse().expect("addr")), false);
        let req = up.prepare(request("/", &[]), mapped);
        assert_eq!(req.headers()["x-forwarded-for"], "192.0.2.1");
        let v6 = ClientInfo::new(Some("[2001:db8::1]:1".parse().expect("addr")), false);
        let req = up.prepare(request("/", &[]), v6);
        assert_eq!(req.headers()["x-forwarded-for"], "2001:db8::1");
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_removed() {
        let up = upstream("http://127.0.0.1:3000");
        let req = up.prepare(
            request(
                "/",
                &[
                    ("connection", "keep-alive, X-Secret-Hop, content-length"),
                    ("connection", "x-other-hop"),
                    ("x-secret-hop", "1"),
                    ("x-other-hop", "1"),
                    ("keep-alive", "timeout=5"),
                    ("proxy-connection", "keep-alive"),
                    ("transfer-encoding", "chunked"),
                    ("upgrade", "websocket"),
                    ("trailer", "x-checksum"),
                    ("proxy-authorization", "Basic Zm9vOmJhcg=="),
                    ("proxy-authenticate", "Basic"),
                    ("te", "gzip"),
                    ("content-length", "0"),
                    ("authorization", "Bearer t"),
                    ("idempotency-key", "k1"),
                    ("content-type", "application/json"),
                ],
            ),
            client(),
        );
        let h = req.headers();
        for gone in [
            "connection",
            "x-secret-hop",
            "x-other-hop",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "upgrade",
            "trailer",
            "proxy-authorization",
            "proxy-authenticate",
            "te",
        ] {
            assert!(h.get(gone).is_none(), "{gone} should be removed");
        }
        assert_eq!(h["content-length"], "0");
        assert_eq!(h["authorization"], "Bearer t");
        assert_eq!(h["idempotency-key"], "k1");
        assert_eq!(h["content-type"], "application/json");
    }

    #[test]
    fn te_trailers_is_kept_alone() {
        let up = upstream("http://127.0.0.1:3000");
        let req = up.prepare(
            request("/", &[("te", "gzip;q=0.5, Trailers"), ("connection", "te")]),
            client(),
        );
        assert_eq!(req.headers()["te"], "trailers");
        assert!(req.headers().get("connection").is_none());
    }

    #[test]
    fn the_hop_by_hop_index_matches_the_list() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name.as_str()), Some(i), "{name}");
        }
        for other in ["content-length", "connectio", "x-te", "host", ""] {
            assert_eq!(hop_by_hop_index(other), None, "{other}");
        }
    }

    #[test]
    fn response_headers_lose_hop_by_hop_too() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        remove_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["x-request-id"], "r1");
    }

    #[test]
    fn each_fixed_hop_by_hop_header_goes_without_a_connection_header() {
        for name in [
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "proxy-authorization",
            "proxy-authenticate",
        ] {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_static("x"));
            h.insert("x-request-id", HeaderValue::from_static("r1"));
            remove_hop_by_hop(&mut h);
            assert!(h.get(name).is_none(), "{name} survived");
            assert_eq!(h.len(), 1, "{name}");
        }
        // Without any, nothing changes.
        let mut h = HeaderMap::new();
        h.insert("content-length", HeaderValue::from_static("2"));
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        let before = h.clone();
        remove_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }

    #[test]
    fn prior_knowledge_sends_http2_to_plain_upstreams_only() {
        let h2c = Upstream::new(&UpstreamSettings {
            http2_prior_knowledge: true,
            ..settings("http://127.0.0.1:3000")
        })
        .expect("builds");
        let req = h2c.prepare(request("/", &[("host", "x")]), client());
        assert_eq!(req.version(), Version::HTTP_2);
        assert_eq!(req.headers()[HOST], "127.0.0.1:3000");

        let tls = Upstream::new(&UpstreamSettings {
            http2_prior_knowledge: true,
            ..settings("https://127.0.0.1:3000")
        })
        .expect("builds");
        let req = tls.prepare(request("/", &[]), client());
        assert_eq!(req.version(), Version::HTTP_11);
    }

    #[test]
    fn bad_urls_and_ca_files_are_refused() {
        for url in [
            "ftp://h",
            "/relative",
            "http://user:pw@h:1",
            "http://h:1/api?x=1",
        ] {
            let r = Upstream::new(&settings(url));
            assert!(r.is_err(), "{url} should be refused");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        for ca in [empty, dir.path().join("missing.pem")] {
            let err = Upstream::new(&UpstreamSettings {
                ca_file: Some(ca.clone()),
                ..settings("http://127.0.0.1:3000")
            })
            .expect_err("bad ca_file");
            assert!(err.contains("upstream.ca_file"), "{err}");
        }
    }

    #[tokio::test]
    async fn an_unprepared_request_is_refused_as_nothing_sent() {
        let up = upstream("http://127.0.0.1:3000");
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
        let err = up
            .send(request("/relative", &[]), deadline)
            .await
            .expect_err("refused");
        assert!(matches!(err, UpstreamError::Unreachable(_)), "{err:?}");
    }
}
