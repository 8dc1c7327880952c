//! docs/operating.md, "Metrics", and the admin listener's health
//! endpoints, scraped over HTTP from a running proxy: every request counts
//! exactly one outcome, labels are route names, histograms, store errors,
//! releases, expired leases, the in-flight gauge, readiness.

use crate::support;

use idemproxy::observe::RequestOutcome;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use http::Method;
use idemproxy::config::{Config, IdempotencySettings, RouteConfig};
use support::faulty::{Fault, FaultyStore};
use support::keys;
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::upstream::{unused_port_url, TestUpstream};
use tokio::time::Instant;

const ARRIVAL: Duration = Duration::from_secs(5);

/// The `outcome` values docs/operating.md lists for `idemproxy_requests_total`.
const OUTCOMES: [&str; 23] = [
    "executed",
    "replayed",
    "mismatch",
    "in_flight",
    "missing_key",
    "invalid_key",
    "bad_body",
    "passthrough",
    "store_unavailable",
    "upstream_unreachable",
    "outcome_unknown",
    "released",
    "internal",
    "overloaded",
    "shutting_down",
    "unprotected",
    "client_closed",
    "unauthenticated",
    "observed_replay",
    "observed_mismatch",
    "observed_in_flight",
    "observed_unkeyed_duplicate",
    "record_unreadable",
];

/// One sample line of the text exposition: `name{labels} value`.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed `/metrics` answer.
#[derive(Debug)]
struct Scrape {
    samples: Vec<Sample>,
}

/// Parses `k="v",k2="v2"` (with `\"`, `\\` and `\n` escapes).
fn parse_labels(s: &str, line: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (name, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("label without a value in {line:?}"));
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => panic!("dangling escape in {line:?}"),
                },
                Some((_, c)) => value.push(c),
                None => panic!("unterminated label value in {line:?}"),
            }
        };
        labels.insert(name.to_string(), value);
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    labels
}

fn parse(text: &str) -> Scrape {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("sample without a value: {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|e| panic!("value of {line:?}: {e}"));
        let (name, labels) = match series.split_once('{') {
            Some((name, labels)) => {
                let labels = labels
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels: {line:?}"));
                (name.to_string(), parse_labels(labels, line))
            }
            None => (series.to_string(), BTreeMap::new()),
        };
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    Scrape { samples }
}

impl Scrape {
    /// The samples called `name` whose labels include all of `labels`.
    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The value of the one sample called `name` with exactly `labels`;
    /// every series the tests read is exported from the start.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<&Sample> = self
            .matching(name, labels)
            .filter(|s| s.labels.len() == labels.len())
            .collect();
        assert!(
            found.len() <= 1,
            "{name} {labels:?} is ambiguous: {found:?}"
        );
        // Absent is not zero: a renamed or unexported series must fail the
        // checks that expect it to stay at zero.
        found
            .first()
            .unwrap_or_else(|| panic!("{name} {labels:?} is not exported"))
            .value
    }

    /// Every `idemproxy_requests_total` series: (route, outcome) → count.
    fn requests(&self) -> BTreeMap<(String, String), f64> {
        self.matching("idemproxy_requests_total", &[])
            .map(|s| {
                let route = s.labels.get("route").cloned().unwrap_or_default();
                let outcome = s.labels.get("outcome").cloned().unwrap_or_default();
                assert_eq!(s.labels.len(), 2, "labels are route and outcome: {s:?}");
                ((route, outcome), s.value)
            })
            .collect()
    }

    fn in_flight(&self) -> f64 {
        self.value("idemproxy_in_flight", &[])
    }
}

async fn scrape(client: &TestClient, proxy: &TestProxy) -> Scrape {
    let reply = client
        .send(Method::GET, &proxy.admin_url("/metrics"), &[], "")
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        reply
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/openmetrics-text")),
        "{reply:?}"
    );
    let text = String::from_utf8(reply.body.to_vec()).expect("metrics are UTF-8");
    assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    parse(&text)
}

/// The `idemproxy_requests_total` series that changed from `before` to
/// `after`, with their increase.
fn request_deltas(before: &Scrape, after: &Scrape) -> BTreeMap<(String, String), f64> {
    let (b, a) = (before.requests(), after.requests());
    a.keys()
        .chain(b.keys())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter_map(|k| {
            let delta = a.get(k).copied().unwrap_or(0.0) - b.get(k).copied().unwrap_or(0.0);
            (delta != 0.0).then(|| (k.clone(), delta))
        })
        .collect()
}

fn one(route: &str, outcome: &str) -> BTreeMap<(String, String), f64> {
    BTreeMap::from([((route.to_string(), outcome.to_string()), 1.0)])
}

/// Scrapes until `idemproxy_requests_total` moved from `before` by exactly
/// `expected` and the in-flight gauge reads `in_flight`, then asserts
/// exactly that. A request is counted when its outcome is settled, which for
/// an execution is a moment after the client's body ended, hence the short
/// wait; anything counted late would show in the next step's delta, since
/// each step starts from the previous step's scrape.
async fn expect_deltas(
    client: &TestClient,
    proxy: &TestProxy,
    before: &Scrape,
    expected: BTreeMap<(String, String), f64>,
    in_flight: f64,
) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let after = scrape(client, proxy).await;
        let settled = request_deltas(before, &after) == expected && after.in_flight() == in_flight;
        if settled || Instant::now() > deadline {
            assert_eq!(
                request_deltas(before, &after),
                expected,
                "idemproxy_requests_total deltas"
            );
            assert_eq!(after.in_flight(), in_flight, "idemproxy_in_flight");
            return after;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// [`expect_deltas`] for one request: exactly `route`/`outcome` + 1.
async fn expect_one(
    client: &TestClient,
    proxy: &TestProxy,
    before: &Scrape,
    route: &str,
    outcome: &str,
    in_flight: f64,
) -> Scrape {
    expect_deltas(client, proxy, before, one(route, outcome), in_flight).await
}

fn payments_route() -> RouteConfig {
    RouteConfig {
        name: "payments".into(),
        path: "/v1/payments".into(),
        idempotency: IdempotencySettings {
            require_key: true,
            max_request_bytes: 1024,
            ..IdempotencySettings::default()
        },
        ..RouteConfig::default()
    }
}

fn assert_status(reply: &Reply, status: u16, slug: Option<&str>) {
    assert_eq!(reply.status, status, "{reply:?}");
    if let Some(slug) = slug {
        assert_eq!(reply.problem(), slug, "{reply:?}");
    }
}

#[tokio::test]
async fn every_outcome_increments_exactly_one_series_by_one() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.routes = vec![payments_route()];
    let store = FaultyStore::new();
    let proxy = TestProxy::start_with_store(c, store.clone()).await;
    let client = TestClient::new();
    let url = |target: &str| proxy.url(target);
    let pay = url("/v1/payments");

    let s = scrape(&client, &proxy).await;
    // Every (route, outcome) series exists from the start, at zero.
    let before = s.requests();
    assert_eq!(before.len(), 2 * RequestOutcome::ALL.len(), "{before:?}");
    assert!(
        before.values().all(|v| *v == 0.0),
        "no request yet: {before:?}"
    );
    assert_eq!(s.in_flight(), 0.0);

    // executed
    let first = client.post_json(&pay, "pay-1", r#"{"amount":1}"#).await;
    assert_status(&first, 201, None);
    assert!(!first.replayed());
    let s = expect_one(&client, &proxy, &s, "payments", "executed", 0.0).await;

    // replayed
    let replay = client.post_json(&pay, "pay-1", r#"{"amount":1}"#).await;
    assert_status(&replay, 201, None);
    assert!(replay.replayed());
    let s = expect_one(&client, &proxy, &s, "payments", "replayed", 0.0).await;

    // mismatch
    let reused = client.post_json(&pay, "pay-1", r#"{"amount":2}"#).await;
    assert_status(&reused, 409, Some("key-reused"));
    let s = expect_one(&client, &proxy, &s, "payments", "mismatch", 0.0).await;

    // in_flight: a slow execution runs (gauge 1, nothing counted yet), a
    // duplicate is refused, then the slow one finishes (gauge 0).
    let slow_url = url("/v1/payments?hold=slow");
    let slow = {
        let client = client.clone();
        let slow_url = slow_url.clone();
        tokio::spawn(async move { client.post_json(&slow_url, "pay-slow", "{}").await })
    };
    assert!(
        upstream
            .wait_for_executions("/v1/payments", 2, ARRIVAL)
            .await
    );
    let running = scrape(&client, &proxy).await;
    assert_eq!(running.in_flight(), 1.0, "one execution running");
    assert_eq!(request_deltas(&s, &running), BTreeMap::new());
    let duplicate = client.post_json(&slow_url, "pay-slow", "{}").await;
    assert_status(&duplicate, 425, Some("in-flight"));
    let s = expect_one(&client, &proxy, &running, "payments", "in_flight", 1.0).await;
    upstream.release("slow");
    let slow = slow.await.expect("slow request task");
    assert_status(&slow, 201, None);
    let s = expect_one(&client, &proxy, &s, "payments", "executed", 0.0).await;

    // missing_key (the payments route requires one)
    let no_key = client
        .send(
            Method::POST,
            &pay,
            &[("content-type", "application/json")],
            "{}",
        )
        .await;
    assert_status(&no_key, 400, Some("missing-key"));
    let s = expect_one(&client, &proxy, &s, "payments", "missing_key", 0.0).await;

    // invalid_key
    let too_long = "k".repeat(256);
    let invalid = client.post_json(&pay, &too_long, "{}").await;
    assert_status(&invalid, 400, Some("invalid-key"));
    let s = expect_one(&client, &proxy, &s, "payments", "invalid_key", 0.0).await;

    // bad_body (max_request_bytes = 1024 on this route)
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2048));
    let too_big = client.post_json(&pay, "pay-big", &big).await;
    assert_status(&too_big, 413, Some("body-too-large"));
    let s = expect_one(&client, &proxy, &s, "payments", "bad_body", 0.0).await;

    // passthrough (GET is not covered)
    let get = client.send(Method::GET, &pay, &[], "").await;
    assert_status(&get, 201, None);
    let s = expect_one(&client, &proxy, &s, "payments", "passthrough", 0.0).await;

    // store_unavailable, and the failed `begin` is a store error
    store.set(Fault::Fail);
    let down = client.post_json(&pay, "pay-down", "{}").await;
    store.set(Fault::None);
    assert_status(&down, 503, Some("store-unavailable"));
    let before_errors = s.value("idemproxy_store_errors_total", &[("op", "begin")]);
    let s = expect_one(&client, &proxy, &s, "payments", "store_unavailable", 0.0).await;
    assert_eq!(
        s.value("idemproxy_store_errors_total", &[("op", "begin")]) - before_errors,
        1.0
    );

    // outcome_unknown (the upstream breaks the connection after reading)
    let reset = client
        .post_json(&url("/v1/payments?reset=1"), "pay-reset", "{}")
        .await;
    assert_status(&reset, 502, Some("outcome-unknown"));
    let s = expect_one(&client, &proxy, &s, "payments", "outcome_unknown", 0.0).await;

    // released (429 is in release_statuses), and the key release is counted
    let released_before = s.value("idemproxy_keys_released_total", &[("route", "payments")]);
    let busy = client
        .post_json(&url("/v1/payments?status=429"), "pay-busy", "{}")
        .await;
    assert_status(&busy, 429, None);
    let s = expect_one(&client, &proxy, &s, "payments", "released", 0.0).await;
    assert_eq!(
        s.value("idemproxy_keys_released_total", &[("route", "payments")]) - released_before,
        1.0
    );

    // The route label is the route's name whatever the path below it, and
    // `default` for paths no route matches (prefixes match on segments).
    let sub = client
        .post_json(&url("/v1/payments/pay_1/refunds?x=1"), "pay-sub", "{}")
        .await;
    assert_status(&sub, 201, None);
    let s = expect_one(&client, &proxy, &s, "payments", "executed", 0.0).await;
    for (i, target) in ["/v1/other", "/v1/paymentsx", "/"].into_iter().enumerate() {
        // (`default` does not require a key; these send one anyway.)
        let reply = client
            .post_json(&url(target), &format!("other-{i}"), "{}")
            .await;
        assert_status(&reply, 201, None);
    }
    let mut three = one("default", "executed");
    three.insert(("default".into(), "executed".into()), 3.0);
    let after = expect_deltas(&client, &proxy, &s, three, 0.0).await;

    // Over the whole run: only configured route names, only documented
    // outcomes, and one duration observation per request.
    let requests = after.requests();
    for (route, outcome) in requests.keys() {
        assert!(
            route == "payments" || route == "default",
            "route label {route:?}"
        );
        assert!(OUTCOMES.contains(&outcome.as_str()), "outcome {outcome:?}");
    }
    for s in &after.samples {
        if let Some(route) = s.labels.get("route") {
            assert!(
                route == "payments" || route == "default",
                "{} has route {route:?}",
                s.name
            );
        }
    }
    for route in ["payments", "default"] {
        let counted: f64 = requests
            .iter()
            .filter(|((r, _), _)| r == route)
            .map(|(_, v)| v)
            .sum();
        assert_eq!(
            after.value(
                "idemproxy_request_duration_seconds_count",
                &[("route", route)]
            ),
            counted,
            "{route}: one duration per counted request"
        );
    }
    assert_eq!(requests.values().sum::<f64>(), 16.0);
}

#[tokio::test]
async fn an_unreachable_upstream_counts_upstream_unreachable_and_a_release() {
    let mut c = config(&unused_port_url());
    c.upstream.connect_timeout = Duration::from_millis(500);
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    let s = scrape(&client, &proxy).await;
    let reply = client
        .post_json(&proxy.url("/v1/orders"), "refused-1", "{}")
        .await;
    assert_status(&reply, 502, Some("upstream-unreachable"));
    let after = expect_one(&client, &proxy, &s, "default", "upstream_unreachable", 0.0).await;
    assert_eq!(
        after.value("idemproxy_keys_released_total", &[("route", "default")]),
        1.0
    );
    assert_eq!(
        after.value("idemproxy_store_errors_total", &[("op", "release")]),
        0.0
    );
}

/// Every request is counted once, a client that leaves before its answer
/// too: a passthrough waiting for the upstream (the call is dropped) ends as
/// `client_closed`, a covered request whose body was still arriving as
/// `bad_body` (the body broke off), and neither is logged as anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_its_answer_is_counted() {
    use tokio::io::AsyncWriteExt;
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();

    let s = scrape(&client, &proxy).await;
    let mut socket = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect");
    socket
        .write_all(&support::raw::request(
            "POST",
            "/v1/slow?delay_ms=2000",
            &[b"content-type: application/json"],
            b"{}",
        ))
        .await
        .expect("write");
    assert!(
        upstream
            .wait_for_executions("/v1/slow", 1, Duration::from_secs(5))
            .await
    );
    drop(socket);
    let s = expect_one(&client, &proxy, &s, "default", "client_closed", 0.0).await;

    let mut socket = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect");
    socket
        .write_all(
            b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nidempotency-key: left-1\r\n\
              content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"amount\"",
        )
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(socket);
    expect_one(&client, &proxy, &s, "default", "bad_body", 0.0).await;
    assert_eq!(upstream.executions("/v1/orders"), 0);
}

/// With `on_store_error = "pass"`, a request forwarded while the store is
/// down is counted as `unprotected` (not `executed`), its failed
/// `begin` as a store error, and its unprotected upstream call is timed.
#[tokio::test]
async fn a_request_passed_while_the_store_is_down_is_counted_as_such() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.on_store_error = idemproxy::config::OnStoreError::Pass;
    let store = FaultyStore::new();
    let proxy = TestProxy::start_with_store(c, store.clone()).await;
    let client = TestClient::new();

    let s = scrape(&client, &proxy).await;
    store.set(Fault::Fail);
    let passed = client
        .post_json(&proxy.url("/v1/orders"), "passed-1", "{}")
        .await;
    assert_status(&passed, 201, None);
    assert!(!passed.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 1);
    let after = expect_one(&client, &proxy, &s, "default", "unprotected", 0.0).await;
    let delta =
        |name: &str, labels: &[(&str, &str)]| after.value(name, labels) - s.value(name, labels);
    assert_eq!(
        delta("idemproxy_store_errors_total", &[("op", "begin")]),
        1.0
    );
    assert_eq!(
        delta(
            "idemproxy_upstream_duration_seconds_count",
            &[("route", "default")]
        ),
        1.0
    );
}

/// Checks one histogram series: the documented buckets (100 µs to 60 s,
/// then `+Inf`), cumulative, `+Inf` equal to `_count`; returns `_count`.
fn histogram(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let buckets: Vec<(String, f64)> = s
        .matching(&format!("{name}_bucket"), labels)
        .map(|b| (b.labels["le"].clone(), b.value))
        .collect();
    let les: Vec<&str> = buckets.iter().map(|(le, _)| le.as_str()).collect();
    assert_eq!(les.len(), 20, "{name} {labels:?}: {les:?}");
    assert_eq!(les.first().copied(), Some("0.0001"), "{name}");
    assert_eq!(les[les.len() - 2], "60.0", "{name}");
    assert_eq!(les.last().copied(), Some("+Inf"), "{name}");
    assert!(
        buckets.windows(2).all(|w| w[0].1 <= w[1].1),
        "{name} {labels:?}: buckets are cumulative: {buckets:?}"
    );
    let count = s.value(&format!("{name}_count"), labels);
    assert_eq!(
        buckets.last().map(|b| b.1),
        Some(count),
        "{name}: +Inf = count"
    );
    assert!(s.matching(&format!("{name}_sum"), labels).count() == 1);
    count
}

#[tokio::test]
async fn histograms_cover_requests_upstream_calls_and_each_store_op() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.routes = vec![payments_route()];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    let executed = client
        .post_json(&proxy.url("/v1/payments"), "h-1", "{}")
        .await;
    assert_status(&executed, 201, None);
    let busy = client
        .post_json(&proxy.url("/v1/payments?status=503"), "h-2", "{}")
        .await;
    assert_status(&busy, 503, None);
    let passthrough = client
        .send(Method::GET, &proxy.url("/v1/other"), &[], "")
        .await;
    assert_status(&passthrough, 201, None);
    let expected = BTreeMap::from([
        (("payments".into(), "executed".into()), 1.0),
        (("payments".into(), "released".into()), 1.0),
        (("default".into(), "passthrough".into()), 1.0),
    ]);
    let empty = parse("");
    let s = expect_deltas(&client, &proxy, &empty, expected, 0.0).await;

    assert_eq!(
        histogram(
            &s,
            "idemproxy_request_duration_seconds",
            &[("route", "payments")]
        ),
        2.0
    );
    assert_eq!(
        histogram(
            &s,
            "idemproxy_request_duration_seconds",
            &[("route", "default")]
        ),
        1.0
    );
    // Covered executions time their upstream call (a release included), and
    // so do passthroughs.
    assert_eq!(
        histogram(
            &s,
            "idemproxy_upstream_duration_seconds",
            &[("route", "payments")]
        ),
        2.0
    );
    assert_eq!(
        histogram(
            &s,
            "idemproxy_upstream_duration_seconds",
            &[("route", "default")]
        ),
        1.0
    );
    assert_eq!(
        histogram(&s, "idemproxy_store_duration_seconds", &[("op", "begin")]),
        2.0
    );
    assert_eq!(
        histogram(
            &s,
            "idemproxy_store_duration_seconds",
            &[("op", "complete")]
        ),
        1.0
    );
    assert_eq!(
        histogram(&s, "idemproxy_store_duration_seconds", &[("op", "release")]),
        1.0
    );
    for op in ["begin", "complete", "release"] {
        assert_eq!(s.value("idemproxy_store_errors_total", &[("op", op)]), 0.0);
    }
    assert_eq!(s.value("idemproxy_local_cache_hits_total", &[]), 0.0);
    // Tests log nowhere near enough to fill the log buffer.
    assert_eq!(s.value("idemproxy_log_lines_dropped_total", &[]), 0.0);
    // No cache, no liveness series: an alert on 0 must not fire for it.
    assert_eq!(
        s.matching("idemproxy_local_cache_live", &[]).count(),
        0,
        "{:?}",
        s.matching("idemproxy_local_cache_live", &[])
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_settled_stale_claim_counts_one_expired_lease() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.routes = vec![
        payments_route(),
        RouteConfig {
            name: "orders".into(),
            path: "/v1/orders".into(),
            idempotency: IdempotencySettings {
                on_stale: idemproxy::config::OnStale::Retry,
                ..c.idempotency.clone()
            },
            ..RouteConfig::default()
        },
    ];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let body = r#"{"amount":5}"#;
    let expired =
        |s: &Scrape, route: &str| s.value("idemproxy_expired_leases_total", &[("route", route)]);

    // on_stale = "store": the request settles the key as outcome-unknown and
    // is answered from that record, counted once, as `outcome_unknown`: the
    // alert on that outcome must see a proxy that died mid-call.
    keys::plant_stale_claim(&proxy.store, "/v1/payments", "stale-1", body.as_bytes()).await;
    let s = scrape(&client, &proxy).await;
    assert_eq!(expired(&s, "payments"), 0.0);
    let reply = client
        .post_json(&proxy.url("/v1/payments"), "stale-1", body)
        .await;
    assert_status(&reply, 502, Some("outcome-unknown"));
    assert!(reply.replayed());
    let s = expect_one(&client, &proxy, &s, "payments", "outcome_unknown", 0.0).await;
    assert_eq!(expired(&s, "payments"), 1.0);
    // A later retry replays the settled record: no new expired lease.
    let again = client
        .post_json(&proxy.url("/v1/payments"), "stale-1", body)
        .await;
    assert_status(&again, 502, Some("outcome-unknown"));
    let s = expect_one(&client, &proxy, &s, "payments", "replayed", 0.0).await;
    assert_eq!(expired(&s, "payments"), 1.0);

    // on_stale = "retry": the request takes the key over and executes.
    keys::plant_stale_claim(&proxy.store, "/v1/orders", "stale-2", body.as_bytes()).await;
    let reply = client
        .post_json(&proxy.url("/v1/orders"), "stale-2", body)
        .await;
    assert_status(&reply, 201, None);
    assert!(!reply.replayed());
    let s = expect_one(&client, &proxy, &s, "orders", "executed", 0.0).await;
    assert_eq!(expired(&s, "orders"), 1.0);
    assert_eq!(expired(&s, "payments"), 1.0);
    assert_eq!(upstream.executions("/v1/orders"), 1);
    assert_eq!(upstream.executions("/v1/payments"), 0);
}

async fn get(client: &TestClient, proxy: &TestProxy, path: &str) -> Reply {
    client
        .send(Method::GET, &proxy.admin_url(path), &[], "")
        .await
}

#[tokio::test]
async fn readiness_follows_the_store_and_liveness_does_not() {
    let upstream = TestUpstream::start().await;
    let mut c: Config = config(&upstream.url());
    c.store.timeout = Duration::from_millis(250);
    let store = FaultyStore::new();
    let proxy = TestProxy::start_with_store(c, store.clone()).await;
    let client = TestClient::new();

    let check = |fault: Fault, ready: u16| {
        let (client, proxy, store) = (&client, &proxy, &store);
        async move {
            store.set(fault);
            let started = Instant::now();
            let readyz = get(client, proxy, "/readyz").await;
            let took = started.elapsed();
            assert_eq!(readyz.status, ready, "{fault:?}: {readyz:?}");
            // A hanging store is given up on at store.timeout.
            assert!(took < Duration::from_secs(3), "{fault:?}: {took:?}");
            if fault == Fault::Hang {
                assert!(took >= Duration::from_millis(250), "{took:?}");
            }
            let healthz = get(client, proxy, "/healthz").await;
            assert_eq!(healthz.status, 200, "{fault:?}: {healthz:?}");
            readyz
        }
    };
    let ready = check(Fault::None, 200).await;
    assert_eq!(&ready.body[..], b"ready\n");
    check(Fault::Hang, 503).await;
    check(Fault::Fail, 503).await;
    // Recovered, without a restart.
    check(Fault::None, 200).await;
    // Metrics are served whatever the store does.
    store.set(Fault::Fail);
    let s = scrape(&client, &proxy).await;
    assert_eq!(s.in_flight(), 0.0);
    store.set(Fault::None);
}

#[tokio::test]
async fn replays_from_the_local_cache_are_counted() {
    let upstream = TestUpstream::start().await;
    let store = idemproxy::store::cache::wrap(
        std::sync::Arc::new(idemproxy::store::MemoryStore::new()),
        100,
    );
    let proxy = TestProxy::start_with_store(config(&upstream.url()), store).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/cached");

    let before = scrape(&client, &proxy).await;
    assert_eq!(before.value("idemproxy_local_cache_hits_total", &[]), 0.0);
    // A cache in front of a store this process alone writes hears every
    // removal as it passes: it answers from the start.
    assert_eq!(
        before.value("idemproxy_local_cache_live", &[("store", "memory")]),
        1.0
    );
    let first = client.post_json(&url, "cached-1", "{}").await;
    assert_eq!(first.status, 201);
    for _ in 0..2 {
        let replay = client.post_json(&url, "cached-1", "{}").await;
        assert!(replay.replayed());
    }
    let after = scrape(&client, &proxy).await;
    // The completion filled the cache, so both replays were answered there.
    assert_eq!(after.value("idemproxy_local_cache_hits_total", &[]), 2.0);
    assert_eq!(upstream.executions("/v1/cached"), 1);
}
