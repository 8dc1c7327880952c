//! `idemproxy demo`: a small write API to put the proxy in front of, so a
//! newcomer can see a first call, a replay, a mismatch and an in-flight
//! duplicate with curl.
//!
//! `POST /v1/payments` "charges" and answers 201 with a new payment id and the
//! number of charges so far; `?delay_ms=N` makes it slow (to see 425);
//! `GET /v1/payments` lists every charge, which shows that retries through the
//! proxy did not charge twice.

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

pub fn router() -> Router {
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

/// The walkthrough printed when the demo starts.
pub fn walkthrough(proxy: &str) -> String {
    format!(
        r#"
idemproxy demo: proxy on http://{proxy}  (embedded store, demo payments API behind it)

1. A first call executes (201, a new payment id):
   curl -i -X POST http://{proxy}/v1/payments -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' -d '{{"amount": 1000, "currency": "eur"}}'

2. The same call again is a replay: same body, `Idempotent-Replayed: true`, no second charge:
   curl -i -X POST http://{proxy}/v1/payments -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' -d '{{"currency": "eur", "amount": 1000}}'

3. The same key with a different request is a caller bug: 409 key-reused:
   curl -i -X POST http://{proxy}/v1/payments -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' -d '{{"amount": 9999, "currency": "eur"}}'

4. A duplicate while the first is still running: 425 in-flight with Retry-After:
   curl -s -X POST 'http://{proxy}/v1/payments?delay_ms=5000' -H 'Idempotency-Key: slow-1' -d '{{}}' -H 'Content-Type: application/json' &
   sleep 1; curl -i -X POST 'http://{proxy}/v1/payments?delay_ms=5000' -H 'Idempotency-Key: slow-1' -d '{{}}' -H 'Content-Type: application/json'

5. Count the charges the API really made:
   curl -s http://{proxy}/v1/payments

Stop with Ctrl-C. The store lives in ./idemproxy-demo-data: restart the demo and step 2 still replays.
"#
    )
}
