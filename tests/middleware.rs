//! The idempotency middleware on its own, around an inner service that is
//! not the proxy's: it needs only an error that converts into
//! `UpstreamFailure`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use http::{Request, Response};
use idemproxy::config::Config;
use idemproxy::core::UpstreamFailure;
use idemproxy::idempotency::IdempotencyLayer;
use idemproxy::observe::Metrics;
use idemproxy::store::MemoryStore;
use tower::{Layer, ServiceExt};

/// The run is polled on the connection's task; a panic in it (here in
/// the upstream service) must end in a 500 for this request, not unwind
/// into the connection, and must not take the service down for the next.
#[tokio::test(flavor = "current_thread")]
async fn a_panicking_run_answers_500_and_the_service_goes_on() {
    let policies = idemproxy::policies(&Config::default()).expect("policies");
    let calls = Arc::new(AtomicUsize::new(0));
    let upstream = tower::service_fn({
        let calls = calls.clone();
        move |_req: Request<Body>| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                assert!(!first, "the upstream service panics on its first call");
                Ok::<_, UpstreamFailure>(Response::new(Body::from("ok")))
            }
        }
    });
    let metrics = Metrics::new();
    let service = IdempotencyLayer::new(policies, Arc::new(MemoryStore::new()))
        .metrics(metrics.clone())
        .layer(upstream);
    let request = |key: &str| {
        Request::post("/v1/payments")
            .header("idempotency-key", key)
            .body(Body::from("{}"))
            .expect("request")
    };
    let status = |response: Result<Response<Body>, Infallible>| match response {
        Ok(response) => response.status(),
        Err(never) => match never {},
    };
    let panicked = service.clone().oneshot(request("a")).await;
    assert_eq!(status(panicked), http::StatusCode::INTERNAL_SERVER_ERROR);
    let next = service.clone().oneshot(request("b")).await;
    assert_eq!(status(next), http::StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // The panicked request is counted (and logged) as `internal`, once.
    let text = metrics.render();
    let count = |outcome: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("idemproxy_requests_total{")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    assert_eq!(count("internal"), Some(1.0), "{text}");
    assert_eq!(count("executed"), Some(1.0), "{text}");
}
