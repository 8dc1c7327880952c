//! The admin listener, separate from traffic: liveness, readiness, metrics,
//! and the key reconciliation API.
//!
//! The key API lets an operator who reconciled an `outcome-unknown` with the
//! upstream inspect and delete the key's record. It is refused unless
//! `admin_token` is configured, and then requires `Authorization: Bearer
//! <admin_token>`. Keys are addressed by their store hash (the `key_hash` of
//! the request log) or looked up from the raw key and the scope attributes
//! the caller sent; raw keys are never stored, so the reverse is impossible.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

mod auth;
mod reconcile;

pub use self::auth::{AdminToken, Peer};
use self::auth::{TokenRefusal, FAILURE_WINDOW, MAX_FAILURES};
use crate::core::ClientCertificate;
use crate::core::{from_millis, KeyState, Outcome, OutcomeMeta, Record, RecordKey, RecordMeta};
use crate::http::Problem;
use crate::idempotency::{KeyReconciler, Policies, Policy};
use crate::observe::metrics::Metrics;
use crate::store::{ListWant, Removal, Removed, SharedStore, StoreError};

#[derive(Clone)]
pub struct AdminState {
    pub store: SharedStore,
    pub store_timeout: Duration,
    pub metrics: Arc<Metrics>,
    pub policies: Arc<Policies>,
    /// Reconciles one key with the upstream's lookup (`reconcile_url`).
    pub reconciler: KeyReconciler,
    /// Who may use the key API.
    pub token: Arc<AdminToken>,
    /// The traffic's executions: closed once the proxy drains, which
    /// `/readyz` reports so that a load balancer stops sending traffic the
    /// proxy would only answer 503 `shutting-down`.
    pub tasks: tokio_util::task::TaskTracker,
}

impl std::fmt::Debug for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState").finish_non_exhaustive()
    }
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/keys", get(list_keys))
        .route("/v1/keys/{hash}", get(show_key).delete(delete_key))
        .route("/v1/keys/lookup", post(lookup_key))
        .route("/v1/keys/reconcile", post(reconcile::reconcile_key))
        .with_state(state)
}

/// Ready when the store answers within its timeout and the proxy is not
/// draining: a proxy that cannot reach its store, or that is shutting down,
/// would only answer 503, so it should not get traffic.
async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    if state.tasks.is_closed() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
    }
    match tokio::time::timeout(state.store_timeout, state.store.ping()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready\n".into()),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("store: {e}\n")),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store: no answer within {:?}\n", state.store_timeout),
        ),
    }
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    if let Some(hits) = state.store.local_cache_hits() {
        state.metrics.sync_cache_hits(hits);
    }
    if let Some(live) = state.store.local_cache_live() {
        state.metrics.set_cache_live(state.store.kind(), live);
    }
    state
        .metrics
        .sync_log_lines_dropped(crate::observe::log_writer::dropped_lines());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

/// An admin API error, as problem+json.
struct AdminProblem {
    status: StatusCode,
    slug: &'static str,
    detail: String,
}

impl From<TokenRefusal> for AdminProblem {
    fn from(refusal: TokenRefusal) -> Self {
        let (status, slug, detail) = match refusal {
            TokenRefusal::Disabled => (
                StatusCode::FORBIDDEN,
                "admin-disabled",
                "The key API is disabled: set admin_token (or IDEMPROXY_ADMIN_TOKEN).".into(),
            ),
            TokenRefusal::RateLimited => (
                StatusCode::TOO_MANY_REQUESTS,
                "admin-rate-limited",
                format!(
                    "More than {MAX_FAILURES} failed attempts at the admin token from this address within {}s; try again shortly.",
                    FAILURE_WINDOW.as_secs()
                ),
            ),
            TokenRefusal::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "admin-unauthorized",
                "A valid `Authorization: Bearer <admin_token>` header is required.".into(),
            ),
        };
        AdminProblem {
            status,
            slug,
            detail,
        }
    }
}

impl IntoResponse for AdminProblem {
    fn into_response(self) -> Response {
        let title = self.status.canonical_reason().unwrap_or("Error");
        let mut response = Problem::new(self.status, self.slug, title, self.detail).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("10"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

fn parse_hash(hash: &str) -> Result<RecordKey, AdminProblem> {
    RecordKey::from_hex(hash).ok_or(AdminProblem {
        status: StatusCode::BAD_REQUEST,
        slug: "invalid-key-hash",
        detail: "A key hash is 64 lower-case hex digits (the key_hash of the request log).".into(),
    })
}

fn store_problem(e: impl std::fmt::Display) -> AdminProblem {
    AdminProblem {
        status: StatusCode::SERVICE_UNAVAILABLE,
        slug: "store-unavailable",
        detail: format!("store: {e}"),
    }
}

async fn read(state: &AdminState, key: RecordKey) -> Result<Json<Value>, AdminProblem> {
    let record = tokio::time::timeout(state.store_timeout, state.store.get(&key))
        .await
        .map_err(|_| store_problem("no answer in time"))?
        .map_err(|e| match e {
            // The store answered: what it holds is wrong, and asking again
            // will not help (a 503 would say it might).
            StoreError::Corrupt(why) => AdminProblem {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                slug: "record-unreadable",
                detail: format!(
                    "The store holds a record for this key that does not read ({why}). Requests with this key are refused with 500 `record-unreadable` and never executed. Check with the upstream whether the first request took effect, then delete the key (DELETE /v1/keys/{hex}, or idemproxy keys forget --hash {hex}) so that a retry executes.",
                    hex = key.to_hex()
                ),
            },
            e => store_problem(e),
        })?;
    match record {
        Some(record) => Ok(Json(describe(&key, &record))),
        None => Err(AdminProblem {
            status: StatusCode::NOT_FOUND,
            slug: "key-not-found",
            detail: "No record for this key (never used, expired, released or deleted).".into(),
        }),
    }
}

async fn show_key(
    State(state): State<AdminState>,
    peer: Peer,
    headers: HeaderMap,
    Path(hash): Path<String>,
) -> Result<Json<Value>, AdminProblem> {
    state.token.check(&peer, &headers)?;
    read(&state, parse_hash(&hash)?).await
}

async fn delete_key(
    State(state): State<AdminState>,
    peer: Peer,
    headers: HeaderMap,
    Path(hash): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, AdminProblem> {
    state.token.check(&peer, &headers)?;
    let key = parse_hash(&hash)?;
    // A claim whose lease runs is a request executing now (or one whose
    // proxy died moments ago): deleted, its retry would execute while the
    // first may still run, and the first's outcome would be refused. Only
    // `?force=true` goes ahead; an expired claim is stuck and goes. The
    // store decides in the same step as it deletes, so a request that
    // claims the key just before keeps its claim.
    let force = query
        .as_deref()
        .is_some_and(|q| q.split('&').any(|pair| pair == "force=true"));
    let removal = if force {
        Removal::Any
    } else {
        Removal::UnlessLeased
    };
    let removed = tokio::time::timeout(state.store_timeout, state.store.remove(&key, removal))
        .await
        .map_err(|_| store_problem("no answer in time"))?
        .map_err(store_problem)?;
    match removed {
        Removed::Deleted => {
            tracing::warn!(key_hash = %key.to_hex(), "key deleted through the admin API");
            Ok(Json(json!({ "key_hash": key.to_hex(), "deleted": true })))
        }
        Removed::Absent => Err(AdminProblem {
            status: StatusCode::NOT_FOUND,
            slug: "key-not-found",
            detail: "No record for this key.".into(),
        }),
        Removed::Leased { until } => Err(AdminProblem {
            status: StatusCode::CONFLICT,
            slug: "key-in-flight",
            detail: format!(
                "A request holds this key and its lease runs until {}: deleting it now would let a retry execute while the first may still be running. Wait for the lease to end, or add ?force=true.",
                httpdate::fmt_http_date(from_millis(until))
            ),
        }),
    }
}

/// Records a `GET /v1/keys` examines at most per call, whatever it finds:
/// the work one call puts on the store is bounded, and `next_cursor` goes
/// on from where it stopped.
const LIST_WALK: usize = 10_000;

/// Bytes of stored values a `GET /v1/keys` reads at most per call (the
/// embedded store reads whole values; Redis only their fronts): with
/// responses of megabytes, a page stops early and `next_cursor` goes on,
/// rather than holding up the store and the proxy's memory.
const LIST_BYTES: usize = 4 << 20;

/// How long one `GET /v1/keys` page may take.
const LIST_PAGE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    /// `pending`, `outcome-unknown`, `completed` (every other completion)
    /// or `any` (the default).
    #[serde(default)]
    state: Option<String>,
    /// Only records created at least this long ago (`10m`, `2h`).
    #[serde(default)]
    older_than: Option<String>,
    /// At most this many in a page (default 100, at most 1,000);
    /// `next_cursor` goes on right after the last record examined.
    #[serde(default)]
    limit: Option<usize>,
    /// Where the previous page stopped (its `next_cursor`).
    #[serde(default)]
    cursor: Option<String>,
}

/// Which records a list shows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ListState {
    Pending,
    OutcomeUnknown,
    Completed,
    Any,
}

impl ListState {
    fn parse(text: Option<&str>) -> Option<Self> {
        Some(match text.unwrap_or("any") {
            "pending" => Self::Pending,
            "outcome-unknown" => Self::OutcomeUnknown,
            "completed" => Self::Completed,
            "any" => Self::Any,
            _ => return None,
        })
    }

    fn admits(self, record: &RecordMeta) -> bool {
        let unknown = matches!(record.outcome, Some(OutcomeMeta::Unknown { .. }));
        match (self, record.state) {
            (Self::Any, _) | (Self::Pending, KeyState::Pending) => true,
            (Self::OutcomeUnknown, KeyState::Completed) => unknown,
            (Self::Completed, KeyState::Completed) => !unknown,
            _ => false,
        }
    }
}

/// `GET /v1/keys?state=outcome-unknown&older_than=10m`: the records in a
/// state, for reconciling them, from their metadata alone (never a stored
/// response: see [`crate::store::Store::list`]). A bounded walk over the
/// store (Redis `SCAN`, never `KEYS`) until `limit` are found, or
/// [`LIST_WALK`] examined, or [`LIST_BYTES`] read, then `next_cursor` to
/// go on (`null` once the walk is over).
async fn list_keys(
    State(state): State<AdminState>,
    peer: Peer,
    headers: HeaderMap,
    // Taken as a Result: the caller is authenticated before its query is
    // read, and a bad one is a problem+json like every answer here.
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<Value>, AdminProblem> {
    state.token.check(&peer, &headers)?;
    let bad = |detail: String| AdminProblem {
        status: StatusCode::BAD_REQUEST,
        slug: "invalid-list",
        detail,
    };
    let Query(query) = query.map_err(|e| bad(format!("query: {}", e.body_text())))?;
    let wanted = ListState::parse(query.state.as_deref())
        .ok_or_else(|| bad("`state` is one of pending, outcome-unknown, completed, any".into()))?;
    let older_than = query
        .older_than
        .as_deref()
        .map(humantime::parse_duration)
        .transpose()
        .map_err(|e| bad(format!("`older_than`: {e} (e.g. 10m, 2h)")))?
        .unwrap_or_default();
    let limit = query.limit.unwrap_or(100).clamp(1, 1000);
    let created_before = crate::core::now_millis().saturating_sub(crate::core::millis(older_than));
    let cursor = crate::store::ScanCursor::new(query.cursor.unwrap_or_default());
    let admits =
        move |record: &RecordMeta| wanted.admits(record) && record.created_at <= created_before;
    let want = ListWant {
        limit,
        max_examined: LIST_WALK,
        max_bytes: LIST_BYTES,
        admits: &admits,
    };
    // Given longer than one request's store call, as an operator's listing
    // is not on a request's path.
    let page_timeout = state.store_timeout.max(LIST_PAGE_TIMEOUT);
    let page = tokio::time::timeout(page_timeout, state.store.list(&cursor, &want))
        .await
        .map_err(|_| store_problem("no answer in time"))?
        .map_err(|e| match e {
            StoreError::InvalidCursor(_) => bad(format!("`cursor`: {e}")),
            StoreError::WalkInterrupted(_) => AdminProblem {
                status: StatusCode::CONFLICT,
                slug: "walk-interrupted",
                detail: format!("{e}. Start the listing again, without `cursor`."),
            },
            e => store_problem(e),
        })?;
    // Unreadable ones in every listing, whatever its filter: neither their
    // state nor their age can be read, and each may be an outcome to
    // reconcile.
    let mut keys: Vec<Value> = page
        .unreadable
        .iter()
        .map(|(key, why)| {
            json!({
                "key_hash": key.to_hex(),
                "state": "unreadable",
                "error": why,
            })
        })
        .collect();
    keys.extend(
        page.records
            .iter()
            .map(|(key, record)| describe_meta(key, record)),
    );
    Ok(Json(json!({
        "keys": keys,
        "examined": page.examined,
        "next_cursor": page.next.map(|c| c.as_str().to_owned()),
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Lookup {
    /// The raw `Idempotency-Key` value, as the client sent it.
    key: String,
    /// The route whose scope rules apply (default: `default`).
    #[serde(default)]
    route: Option<String>,
    /// The scope attributes as the client sent them, e.g.
    /// `{"authorization": "Bearer sk_..."}`.
    #[serde(default)]
    headers: std::collections::HashMap<String, String>,
    /// For a `client_cert` scope: the SHA-256 of the client's certificate
    /// (DER), in hex, as `openssl x509 -outform der | sha256sum` prints it.
    #[serde(default)]
    client_cert_sha256: Option<String>,
}

/// A key as a client sent it: its route's policy, the request head its
/// attributes make, the parsed key and its record's key.
struct Addressed {
    policy: Arc<Policy>,
    parts: axum::http::request::Parts,
    key: crate::request::key::IdempotencyKey,
    record_key: RecordKey,
}

/// The key API call in `body`, parsed only once the caller is
/// authenticated; a bad one is a problem+json like every other answer of
/// the key API.
fn authorized_call<T: serde::de::DeserializeOwned>(
    state: &AdminState,
    peer: &Peer,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, AdminProblem> {
    state.token.check(peer, headers)?;
    serde_json::from_slice(body).map_err(|e| invalid_lookup(format!("request body: {e}")))
}

fn invalid_lookup(detail: String) -> AdminProblem {
    AdminProblem {
        status: StatusCode::BAD_REQUEST,
        slug: "invalid-lookup",
        detail,
    }
}

/// Finds the record key of `lookup` on its route; `target`, the
/// request's method and path-and-query as sent, when the caller has them
/// (a reconciliation fingerprints the request and fills its lookup).
fn address(
    state: &AdminState,
    lookup: &Lookup,
    target: Option<(axum::http::Method, axum::http::Uri)>,
) -> Result<Addressed, AdminProblem> {
    let bad = invalid_lookup;
    let route = lookup.route.as_deref().unwrap_or("default");
    let policy = state.policies.by_name(route).ok_or(AdminProblem {
        status: StatusCode::BAD_REQUEST,
        slug: "unknown-route",
        detail: format!("No route is named `{route}`."),
    })?;
    let value = axum::http::HeaderValue::from_str(&lookup.key)
        .map_err(|_| bad("`key` is not a valid header value".into()))?;
    let key = crate::request::key::parse_key(&value).map_err(|e| bad(e.to_string()))?;
    let mut request = axum::http::Request::builder();
    if let Some((method, uri)) = target {
        request = request.method(method).uri(uri);
    }
    for (name, value) in &lookup.headers {
        request = request.header(name.as_str(), value.as_str());
    }
    let (mut parts, ()) = request
        .body(())
        .map_err(|e| bad(format!("`headers`: {e}")))?
        .into_parts();
    if let Some(digest) = &lookup.client_cert_sha256 {
        let digest = hex::decode(digest.trim())
            .ok()
            .and_then(|d| <[u8; 32]>::try_from(d).ok())
            .ok_or_else(|| bad("`client_cert_sha256` is not 64 hex digits".into()))?;
        parts.extensions.insert(ClientCertificate(digest));
    }
    let scope = policy
        .scope
        .scope(&parts)
        .map_err(|e| bad(format!("`headers`: {e}")))?;
    // An observe-mode route keeps its records in a namespace of its own,
    // apart from the enforced ones (DESIGN §1 "Namespaces").
    let scope = match policy.observe {
        Some(_) => crate::idempotency::observe::ObserveRoute::records_scope(&scope),
        None => scope,
    };
    let record_key = RecordKey::new(&scope, key.as_str());
    Ok(Addressed {
        policy: policy.clone(),
        parts,
        key,
        record_key,
    })
}

async fn lookup_key(
    State(state): State<AdminState>,
    peer: Peer,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<Value>, AdminProblem> {
    let lookup: Lookup = authorized_call(&state, &peer, &headers, &body)?;
    let addressed = address(&state, &lookup, None)?;
    read(&state, addressed.record_key).await
}

fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(from_millis(ms)).to_string()
}

/// A record in a listing, from its metadata alone: a response's status
/// only where it is stored in the clear (a packed or sealed one's is
/// inside, and `GET /v1/keys/{hash}` shows it).
fn describe_meta(key: &RecordKey, record: &RecordMeta) -> Value {
    let mut shown = json!({
        "key_hash": key.to_hex(),
        "state": record.state.as_str(),
        "created_at": rfc3339(record.created_at),
        "expires_at": rfc3339(record.expires_at),
    });
    if let Some(lease) = record.lease_expires_at {
        shown["lease_expires_at"] = json!(rfc3339(lease));
    }
    if let Some(completed) = record.completed_at {
        shown["completed_at"] = json!(rfc3339(completed));
    }
    let (outcome, status) = match record.outcome {
        None => return shown,
        Some(OutcomeMeta::Response { status }) => ("response".to_string(), Some(status)),
        Some(OutcomeMeta::Sealed | OutcomeMeta::Packed) => ("response".to_string(), None),
        Some(OutcomeMeta::NotStored { status }) => {
            ("response-not-stored".to_string(), Some(status))
        }
        Some(OutcomeMeta::Unknown { cause }) => (
            format!("outcome-unknown ({})", cause.as_str()),
            Some(cause.status()),
        ),
    };
    shown["outcome"] = json!(outcome);
    if let Some(status) = status {
        shown["status"] = json!(status);
    }
    shown
}

fn describe(key: &RecordKey, record: &Record) -> Value {
    match record {
        Record::Pending(p) => json!({
            "key_hash": key.to_hex(),
            "state": "pending",
            "created_at": rfc3339(p.created_at),
            "lease_expires_at": rfc3339(p.lease_expires_at),
            "expires_at": rfc3339(p.expires_at),
        }),
        Record::Completed(c) => {
            let (outcome, status) = match &c.outcome {
                Outcome::Response(r) => ("response".to_string(), r.status),
                Outcome::NotStored { status } => ("response-not-stored".to_string(), *status),
                Outcome::Unknown { cause } => (
                    format!("outcome-unknown ({})", cause.as_str()),
                    cause.status(),
                ),
                // Opened by the store before it gets here; sealed still,
                // no configured key opens it.
                Outcome::Sealed(_) => ("sealed".to_string(), 0),
                // Unpacked likewise; packed still, it does not unpack (a
                // dictionary no longer configured, or corruption).
                Outcome::Packed(_) => ("packed".to_string(), 0),
            };
            json!({
                "key_hash": key.to_hex(),
                "state": "completed",
                "created_at": rfc3339(c.created_at),
                "completed_at": rfc3339(c.completed_at),
                "expires_at": rfc3339(c.expires_at),
                "outcome": outcome,
                "status": status,
            })
        }
    }
}
