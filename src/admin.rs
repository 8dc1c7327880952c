//! The admin listener, separate from traffic: liveness and readiness.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;

use crate::store::SharedStore;

#[derive(Clone)]
struct AdminState {
    store: SharedStore,
    store_timeout: Duration,
}

pub fn router(store: SharedStore, store_timeout: Duration) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AdminState {
            store,
            store_timeout,
        })
}

/// Ready when the store answers within its timeout: a proxy that cannot reach
/// its store would only answer 503, so it should not get traffic.
async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    match tokio::time::timeout(state.store_timeout, state.store.ping()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready\n".into()),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("store: {e}\n")),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store: no answer within {:?}\n", state.store_timeout),
        ),
    }
}
