//! The demo's payments API: `POST /v1/payments` "charges" and answers 201
//! with a new payment id and the number of charges so far; `?delay_ms=N`
//! makes it slow (to see 425); `GET /v1/payments` lists every charge, which
//! shows that retries through the proxy did not charge twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

#[derive(Clone, Default)]
struct Ledger {
    /// Every charge made; a std Mutex is enough (never held across an await).
    charges: Arc<Mutex<Vec<Value>>>,
}

/// `/v1/payments`, with a ledger of its own.
pub(super) fn router() -> Router {
    Router::new()
        .route("/v1/payments", post(charge).get(list))
        .with_state(Ledger::default())
}

async fn charge(
    State(ledger): State<Ledger>,
    Query(query): Query<HashMap<String, String>>,
    body: Option<Json<Value>>,
) -> (StatusCode, Json<Value>) {
    if let Some(ms) = query.get("delay_ms").and_then(|v| v.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms.min(60_000))).await;
    }
    let request = body.map(|Json(v)| v).unwrap_or(Value::Null);
    let mut charges = match ledger.charges.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    };
    let payment = json!({
        "id": format!("pay_{:04}", charges.len() + 1),
        "status": "succeeded",
        "amount": request.get("amount").cloned().unwrap_or(Value::Null),
        "currency": request.get("currency").cloned().unwrap_or(Value::Null),
        "charges_so_far": charges.len() + 1,
    });
    charges.push(payment.clone());
    (StatusCode::CREATED, Json(payment))
}

async fn list(State(ledger): State<Ledger>) -> Json<Value> {
    let charges = match ledger.charges.lock() {
        Ok(guard) => guard.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    Json(json!({ "charges": charges.len(), "payments": charges }))
}
