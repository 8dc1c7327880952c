//! The idempotency middleware on its own, around an inner service that is
//! not the proxy's: it needs only an error that converts into
//! `UpstreamFailure`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use http_body_util::BodyExt;
use idemproxy::config::Config;
use idemproxy::core::{
    Begin, BeginOutcome, Clock, FencingToken, OnStale, Outcome, Record, UnknownCause,
    UpstreamFailure,
};
use idemproxy::idempotency::IdempotencyLayer;
use idemproxy::observe::Metrics;
use idemproxy::store::{MemoryStore, SharedStore, Store};
use tower::{Layer, Service, ServiceExt};

use crate::support::{faulty, keys};

use faulty::{Fault, FaultyStore};

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

/// A layer over `store`, both on `clock`, around an upstream that counts
/// its calls and answers 201 with a small JSON body.
fn counted_service(
    config: &Config,
    store: SharedStore,
    clock: Clock,
) -> (
    Arc<AtomicUsize>,
    impl Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone,
) {
    let calls = Arc::new(AtomicUsize::new(0));
    let upstream = tower::service_fn({
        let calls = calls.clone();
        move |_req: Request<Body>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let mut response = Response::new(Body::from(format!("{{\"charge\":{n}}}")));
                *response.status_mut() = http::StatusCode::CREATED;
                Ok::<_, UpstreamFailure>(response)
            }
        }
    });
    let policies = idemproxy::policies(config).expect("policies");
    let service = IdempotencyLayer::new(policies, store)
        .clock(clock)
        .layer(upstream);
    (calls, service)
}

/// `TestClient::post_json`'s request: what `keys::json_post` describes.
fn post(key: &str) -> Request<Body> {
    Request::post(TARGET)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(BODY))
        .expect("request")
}

const TARGET: &str = "/v1/payments";
const BODY: &str = r#"{"amount":1000}"#;

async fn send(
    service: &(impl Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone),
    key: &str,
) -> (http::StatusCode, http::HeaderMap, String) {
    let response = match service.clone().oneshot(post(key)).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// A claim whose holder died runs out with its lease, by the clock: 425
/// while the lease runs, `outcome-unknown` from its last millisecond on,
/// and the upstream never called. No test time is spent waiting.
#[tokio::test(start_paused = true)]
async fn a_dead_holders_lease_runs_out_by_the_clock() {
    let clock = Clock::tokio();
    let store: SharedStore = Arc::new(MemoryStore::new().with_clock(clock));
    let (calls, service) = counted_service(&Config::default(), store.clone(), clock);
    let parts = keys::json_post(TARGET);
    let lease = Duration::from_secs(35);
    let begun = store
        .begin(&Begin {
            key: keys::record_key(&parts, "dead"),
            fingerprint: keys::fingerprint(&parts, BODY.as_bytes()),
            lease,
            ttl: Duration::from_secs(3600),
            on_stale: OnStale::Store,
            token: FencingToken::random(),
            reconcile: false,
        })
        .await
        .expect("begin");
    assert!(matches!(begun, BeginOutcome::Acquired { .. }), "{begun:?}");

    tokio::time::advance(lease - Duration::from_millis(1)).await;
    let (status, headers, _) = send(&service, "dead").await;
    assert_eq!(status, 425, "the lease still runs");
    assert_eq!(headers["retry-after"], "1");

    tokio::time::advance(Duration::from_millis(1)).await;
    let (status, _, body) = send(&service, "dead").await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("outcome-unknown"), "{body}");
    let (status, headers, _) = send(&service, "dead").await;
    assert_eq!(status, 502);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "never executed");
}

/// A completed record answers retries for `ttl`, by the clock, and not a
/// millisecond longer: then the key is new again.
#[tokio::test(start_paused = true)]
async fn a_completed_key_lives_its_ttl() {
    let clock = Clock::tokio();
    let store: SharedStore = Arc::new(MemoryStore::new().with_clock(clock));
    let mut config = Config::default();
    config.idempotency.ttl = Duration::from_secs(3600);
    let (calls, service) = counted_service(&config, store, clock);

    let (status, _, first) = send(&service, "ttl").await;
    assert_eq!(status, 201);
    tokio::time::advance(Duration::from_secs(3600) - Duration::from_millis(1)).await;
    let (status, headers, replayed) = send(&service, "ttl").await;
    assert_eq!(
        (status, replayed.as_str()),
        (http::StatusCode::CREATED, first.as_str())
    );
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    tokio::time::advance(Duration::from_millis(1)).await;
    let (status, headers, again) = send(&service, "ttl").await;
    assert_eq!(status, 201);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_ne!(again, first, "a new execution");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A store that fails as the request finishes: the client gets its answer
/// after the inline tries, and the outcome is stored in the background,
/// backing off, once the store is back, well within the claim's lease.
/// Every pause is paused time.
#[tokio::test(start_paused = true)]
async fn an_outcome_the_store_refused_is_stored_once_it_is_back() {
    let clock = Clock::tokio();
    let faulty = FaultyStore::with_clock(clock);
    let store: SharedStore = faulty.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let upstream = tower::service_fn({
        let (calls, faulty) = (calls.clone(), faulty.clone());
        move |_req: Request<Body>| {
            calls.fetch_add(1, Ordering::SeqCst);
            // Down from the moment the request runs: `complete` fails.
            faulty.set(Fault::Fail);
            async move {
                let mut response = Response::new(Body::from("{\"charge\":1}"));
                *response.status_mut() = http::StatusCode::CREATED;
                Ok::<_, UpstreamFailure>(response)
            }
        }
    });
    let metrics = Metrics::new();
    let policies = idemproxy::policies(&Config::default()).expect("policies");
    let service = IdempotencyLayer::new(policies, store)
        .clock(clock)
        .metrics(metrics.clone())
        .layer(upstream);

    let (status, _, body) = send(&service, "late").await;
    assert_eq!((status.as_u16(), body.as_str()), (201, "{\"charge\":1}"));
    let parts = keys::json_post(TARGET);
    let key = keys::record_key(&parts, "late");
    let pending = faulty.inner().get(&key).await.expect("get");
    assert!(matches!(pending, Some(Record::Pending(_))), "{pending:?}");
    assert!(metrics
        .render()
        .contains("idemproxy_settling_in_background 1"));

    // Down for ten seconds of the 35 s lease, then back.
    tokio::time::advance(Duration::from_secs(10)).await;
    faulty.set(Fault::None);
    tokio::time::advance(Duration::from_secs(2)).await;
    let settled = faulty.inner().get(&key).await.expect("get");
    assert!(matches!(settled, Some(Record::Completed(_))), "{settled:?}");
    assert!(metrics
        .render()
        .contains("idemproxy_settling_in_background 0"));
    let (status, headers, replayed) = send(&service, "late").await;
    assert_eq!(
        (status.as_u16(), replayed.as_str()),
        (201, "{\"charge\":1}")
    );
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// The same on a route with `reconcile_url`: nothing says whether the
/// claim whose answer was lost took a free key or an unknown outcome over
/// to reconcile it, and freeing the second would let the next retry
/// execute with no lookup. So it is settled `outcome-unknown`
/// (abandoned), never released: the retry inside the lease gets that
/// answer, and nothing is executed or looked up.
#[tokio::test(start_paused = true)]
async fn on_a_route_with_a_lookup_a_claim_whose_answer_was_lost_is_settled_unknown() {
    let clock = Clock::tokio();
    let faulty = FaultyStore::with_clock(clock);
    let store: SharedStore = faulty.clone();
    let mut config = Config::default();
    config.idempotency.reconcile_url = "/v1/charges/by-key/{key}".into();
    let (calls, service) = counted_service(&config, store, clock);

    faulty.set(Fault::LoseAnswer);
    let (status, _, body) = send(&service, "lost-looked-up").await;
    assert_eq!(status, 503, "{body}");
    faulty.set(Fault::None);
    tokio::time::advance(Duration::from_millis(1)).await;
    let key = keys::record_key(&keys::json_post(TARGET), "lost-looked-up");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let settled = loop {
        match faulty.inner().get(&key).await.expect("get") {
            Some(Record::Completed(done)) => break done,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "not settled back: {other:?}"
            ),
        }
        tokio::time::advance(Duration::from_millis(50)).await;
    };
    assert_eq!(
        settled.outcome,
        Outcome::Unknown {
            cause: UnknownCause::Abandoned
        }
    );
    let (status, _, body) = send(&service, "lost-looked-up").await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("outcome-unknown"), "{body}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "nothing executed or looked up"
    );
}

/// A `begin` the store applied but whose answer was lost: the request is
/// answered 503 and not executed, and the claim it made is released in the
/// background by the token it drew, so the retry executes, once.
#[tokio::test(start_paused = true)]
async fn a_claim_whose_answer_was_lost_is_released_by_its_token() {
    let clock = Clock::tokio();
    let faulty = FaultyStore::with_clock(clock);
    let store: SharedStore = faulty.clone();
    let (calls, service) = counted_service(&Config::default(), store, clock);

    faulty.set(Fault::LoseAnswer);
    let (status, _, body) = send(&service, "lost").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store-unavailable"), "{body}");
    faulty.set(Fault::None);
    // The release runs in its own task; give it its first turn.
    tokio::time::advance(Duration::from_millis(1)).await;
    let key = keys::record_key(&keys::json_post(TARGET), "lost");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while faulty.inner().get(&key).await.expect("get").is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim is still held"
        );
        tokio::time::advance(Duration::from_millis(50)).await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "nothing executed");
    let (status, headers, _) = send(&service, "lost").await;
    assert_eq!(status, 201);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
