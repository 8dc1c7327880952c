//! `POST /v1/keys/reconcile` (`idemproxy keys reconcile`): one key
//! reconciled with its route's `reconcile_url`, by the idempotency
//! layer's [`KeyReconciler`](crate::idempotency::KeyReconciler), which the
//! composition root hands the admin state with a way to send lookups.

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::{
    address, authorized_call, describe, invalid_lookup, rfc3339, store_problem, Addressed,
    AdminProblem, AdminState, Lookup, Peer,
};
use crate::core::RecordKey;
use crate::idempotency::{KeyReconciliation, ReconcileRefusal};

/// `POST /v1/keys/reconcile`'s body: a lookup's (the key, its route and
/// scope headers), and the rest of the request as the client sent it.
/// The request must be the key's own: it is fingerprinted under the
/// route's rules and held to the record's fingerprint, so `headers`
/// carries `content-type` and the route's `fingerprint_headers` too.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReconcileCall {
    #[serde(flatten)]
    lookup: Lookup,
    /// The request's method (default `POST`).
    #[serde(default)]
    method: Option<String>,
    /// The request's path, with its query if it had one, as sent.
    path: String,
    /// The request's JSON body, kept as written (a number is not read
    /// into a double), for `{json:<pointer>}` and the fingerprint.
    #[serde(default)]
    body: Option<Box<RawValue>>,
    /// The request's body as text, exactly as sent (a body that is not
    /// JSON, or JSON whose spacing the fingerprint keeps); instead of
    /// `body`.
    #[serde(default)]
    body_text: Option<String>,
    /// The request's query string (`a=b&c=d`), for a `path` given
    /// without it.
    #[serde(default)]
    query: Option<String>,
}

impl ReconcileCall {
    /// The request's method and target (path and query), as the client
    /// sent them.
    fn target(&self) -> Result<(Method, Uri), AdminProblem> {
        let method = match &self.method {
            Some(method) => Method::from_bytes(method.as_bytes())
                .map_err(|_| invalid_lookup(format!("`method`: `{method}` is not a method")))?,
            None => Method::POST,
        };
        let target = match (&self.query, self.path.contains('?')) {
            (Some(_), true) => {
                return Err(invalid_lookup(
                    "give the query in `path` or in `query`, not both".into(),
                ))
            }
            (Some(query), false) => format!("{}?{}", self.path, query.trim_start_matches('?')),
            (None, _) => self.path.clone(),
        };
        let uri: Uri = target
            .parse()
            .map_err(|e| invalid_lookup(format!("`path`: {e}")))?;
        if uri.scheme().is_some() || !uri.path().starts_with('/') {
            return Err(invalid_lookup(
                "`path` is the request's path and query as sent, e.g. `/v1/payments?x=1`".into(),
            ));
        }
        Ok((method, uri))
    }

    /// The request's body as sent.
    fn body(&self) -> Result<Vec<u8>, AdminProblem> {
        match (&self.body, &self.body_text) {
            (Some(_), Some(_)) => Err(invalid_lookup(
                "give the body as `body` (JSON) or as `body_text`, not both".into(),
            )),
            (Some(json), None) => Ok(json.get().as_bytes().to_vec()),
            (None, Some(text)) => Ok(text.as_bytes().to_vec()),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// The longest body a reconciled answer shows (`body`); the stored
/// record keeps it whole.
const SHOWN_BODY: usize = 4096;

/// `POST /v1/keys/reconcile`: asks the upstream's lookup (`reconcile_url`)
/// what became of a key whose outcome is unknown, and settles the key by
/// its answer exactly as a retry on the request path would: found, the
/// answer is stored and replayed; absent, the key is released so that
/// the next retry executes; anything else, the key stays
/// `outcome-unknown`. A key holding anything else is reported unchanged.
pub(super) async fn reconcile_key(
    State(state): State<AdminState>,
    peer: Peer,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<Value>, AdminProblem> {
    let call: ReconcileCall = authorized_call(&state, &peer, &headers, &body)?;
    let body = call.body()?;
    let Addressed {
        policy,
        parts,
        key,
        record_key,
    } = address(&state, &call.lookup, Some(call.target()?))?;
    let route = policy.route.clone();
    let done = state
        .reconciler
        .reconcile(policy, &parts, &body, &key, record_key)
        .await
        .map_err(|refusal| problem_of(refusal, &route))?;
    Ok(Json(answer_of(done, &record_key).await))
}

/// Why a key was not reconciled, as problem+json.
fn problem_of(refusal: ReconcileRefusal, route: &str) -> AdminProblem {
    match refusal {
        ReconcileRefusal::NotConfigured => AdminProblem {
            status: StatusCode::CONFLICT,
            slug: "reconcile-not-configured",
            detail: format!("Route `{route}` has no reconcile_url (or is not in enforce mode): there is no lookup to ask. Check with the upstream by hand, then forget the key if the operation never happened."),
        },
        ReconcileRefusal::Incomplete => AdminProblem {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            slug: "lookup-incomplete",
            detail: format!("Route `{route}`'s reconcile_url names a value this call lacks: give the headers (`headers`), JSON body (`body`) and query (`query`) the client sent."),
        },
        ReconcileRefusal::NoRecord => AdminProblem {
            status: StatusCode::NOT_FOUND,
            slug: "key-not-found",
            detail: "No record for this key (never used, expired, released or deleted).".into(),
        },
        ReconcileRefusal::Unreadable(why) => AdminProblem {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            slug: "record-unreadable",
            detail: format!("The store holds a record for this key that does not read ({why}); it is not reconciled."),
        },
        ReconcileRefusal::Mismatch { not_a_call } => AdminProblem {
            status: StatusCode::CONFLICT,
            slug: "request-mismatch",
            detail: if not_a_call {
                format!("Route `{route}` is an MCP route and the body given is no tools/call: give the call's body as the client sent it (`body`), and its `path`. Nothing was changed.")
            } else {
                format!("The request given (method, path, headers, body) is not the request this key was used for: it does not fingerprint to the key's record under route `{route}`'s rules. Give them exactly as the client sent them, with `content-type` and the route's fingerprint_headers in `headers`. Nothing was looked up or changed.")
            },
        },
        ReconcileRefusal::Store(why) => store_problem(why),
        ReconcileRefusal::Overloaded => AdminProblem {
            status: StatusCode::SERVICE_UNAVAILABLE,
            slug: "overloaded",
            detail: "max_in_flight requests are being served; try again shortly.".into(),
        },
    }
}

/// What a reconciliation did, as the endpoint answers it.
async fn answer_of(done: KeyReconciliation, record_key: &RecordKey) -> Value {
    let hex = record_key.to_hex();
    match done {
        KeyReconciliation::Found(response) => {
            let (head, body) = response.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX)
                .await
                .unwrap_or_default();
            let shown = &body[..body.len().min(SHOWN_BODY)];
            let headers: serde_json::Map<String, Value> = head
                .headers
                .iter()
                .map(|(name, value)| {
                    let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                    (name.as_str().to_owned(), Value::from(value))
                })
                .collect();
            json!({
                "key_hash": hex,
                "result": "found",
                "status": head.status.as_u16(),
                "headers": headers,
                "body": String::from_utf8_lossy(shown),
                "body_bytes": body.len(),
                "detail": "The upstream's lookup found the operation: its answer is stored and every retry replays it, marked Idempotency-Reconciled: true.",
            })
        }
        KeyReconciliation::Absent => json!({
            "key_hash": hex,
            "result": "absent",
            "detail": "The upstream's lookup says the operation never happened: the key is free, the next retry executes.",
        }),
        KeyReconciliation::Failed { why } => json!({
            "key_hash": hex,
            "result": "failed",
            "why": why,
            "detail": "The lookup gave no answer to go by: the key stays outcome-unknown.",
        }),
        KeyReconciliation::Holds(record) => {
            let mut shown = describe(record_key, &record);
            shown["result"] = json!("unchanged");
            shown["detail"] = json!("The key's outcome is not unknown past its lease: nothing to reconcile, nothing changed.");
            shown
        }
        KeyReconciliation::InFlight { lease_expires_at } => json!({
            "key_hash": hex,
            "result": "unchanged",
            "state": "pending",
            "lease_expires_at": rfc3339(lease_expires_at),
            "detail": "A request holds this key and its lease runs: nothing to reconcile yet, nothing changed.",
        }),
        KeyReconciliation::Free => json!({
            "key_hash": hex,
            "result": "unchanged",
            "detail": "The key was freed meanwhile: nothing to reconcile, the next retry executes.",
        }),
        KeyReconciliation::Changed => json!({
            "key_hash": hex,
            "result": "unchanged",
            "detail": "The key now holds another request's record: nothing changed; run the command again to see it.",
        }),
    }
}
