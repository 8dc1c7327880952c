//! `mode = "observe"` (DESIGN §6): every request reaches the upstream as
//! if the proxy were plain, and what enforcement would have done is
//! counted. The real binary on a real Redis, so that a store outage is a
//! killed `redis-server` and the log lines can be read.

use crate::support;

use std::time::Duration;

use idemproxy::config::{Config, Mode};
use support::binary::ProxyProcess;
use support::proxy::{redis_config, Reply, TestClient};
use support::redis_server::{unique_prefix, RedisServer};
use support::upstream::TestUpstream;

const PATH: &str = "/v1/charges";

fn observe_config(upstream: &TestUpstream, redis: &RedisServer) -> Config {
    let mut c = redis_config(&upstream.url(), &redis.url(), &unique_prefix("observe"));
    c.idempotency.mode = Mode::Observe;
    c
}

async fn metric(client: &TestClient, proxy: &ProxyProcess, series: &str) -> u64 {
    client.metric(&proxy.admin_url("/metrics"), series).await as u64
}

fn outcome(name: &str) -> String {
    format!(r#"idemproxy_requests_total{{route="default",outcome="{name}"}}"#)
}

async fn charge(
    client: &TestClient,
    proxy: &ProxyProcess,
    query: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let url = proxy.url(&format!("{PATH}{query}"));
    client.post_json_with(&url, headers, body).await
}

/// Nothing the proxy adds: every answer is the upstream's own.
fn assert_plain(reply: &Reply) {
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(reply.header("idempotent-replayed").is_none(), "{reply:?}");
    assert!(reply.header("idempotency-original-date").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_duplicates_executes_every_time_and_is_counted_exactly() {
    let upstream = TestUpstream::start().await;
    let redis = RedisServer::start();
    let proxy = ProxyProcess::start(observe_config(&upstream, &redis)).await;
    let client = TestClient::new();

    // 25 copies of one keyed request at once: the first claims the key and
    // runs 300 ms; enforcement would have answered the other 24 from the
    // store (in flight, or replayed once it finished).
    let storm = (0..25).map(|i| {
        let client = client.clone();
        let proxy = &proxy;
        async move {
            let id = format!("storm-{i}");
            charge(
                &client,
                proxy,
                "?delay_ms=300",
                &[("idempotency-key", "order-1"), ("x-request-id", &id)],
                r#"{"amount": 100}"#,
            )
            .await
        }
    });
    let replies = futures_util::future::join_all(storm).await;
    replies.iter().for_each(assert_plain);
    assert_eq!(upstream.executions(PATH), 25, "every request ran");
    let executions: std::collections::BTreeSet<_> = replies
        .iter()
        .map(|r| {
            r.header("x-upstream-execution")
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(executions.len(), 25, "25 distinct upstream answers");

    let executed = metric(&client, &proxy, &outcome("executed")).await;
    let observed = metric(&client, &proxy, &outcome("observed_in_flight")).await
        + metric(&client, &proxy, &outcome("observed_replay")).await;
    assert_eq!((executed, observed), (1, 24));
    assert_eq!(
        metric(&client, &proxy, &outcome("observed_mismatch")).await,
        0
    );

    // The same key with another body: what enforcement calls a mismatch.
    assert_plain(
        &charge(
            &client,
            &proxy,
            "",
            &[("idempotency-key", "order-1")],
            r#"{"amount": 999}"#,
        )
        .await,
    );
    assert_eq!(
        metric(&client, &proxy, &outcome("observed_mismatch")).await,
        1
    );

    // Keyless: 25 identical requests, 24 duplicates no key would catch.
    for i in 0..25 {
        let id = format!("keyless-{i}");
        assert_plain(
            &charge(
                &client,
                &proxy,
                "",
                &[("x-request-id", &id)],
                r#"{"amount": 5}"#,
            )
            .await,
        );
    }
    assert_eq!(
        metric(&client, &proxy, &outcome("observed_unkeyed_duplicate")).await,
        24
    );
    assert_eq!(upstream.executions(PATH), 51);

    // The log names the first request of each duplicate.
    let logs = proxy
        .logs_when(|l| l.matches("first_request_id=\"keyless-0\"").count() >= 24)
        .await;
    assert_eq!(
        logs.matches("first_request_id=\"keyless-0\"").count(),
        24,
        "{logs}"
    );
    let first_of_storm = logs
        .lines()
        .find(|l| l.contains("outcome=\"executed\""))
        .and_then(|l| l.split("request_id=\"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .expect("the executed line")
        .to_owned();
    let pointing = format!("first_request_id=\"{first_of_storm}\"");
    assert!(
        logs.matches(pointing.as_str()).count() >= 24,
        "the storm's duplicates name {first_of_storm}:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_in_observe_mode_costs_no_request() {
    let upstream = TestUpstream::start().await;
    let mut redis = RedisServer::start();
    let proxy = ProxyProcess::start(observe_config(&upstream, &redis)).await;
    let client = TestClient::new();

    for i in 0..5 {
        let key = format!("before-{i}");
        assert_plain(&charge(&client, &proxy, "", &[("idempotency-key", &key)], "{}").await);
    }
    tokio::task::block_in_place(|| redis.kill());
    let started = std::time::Instant::now();
    for i in 0..10 {
        let key = format!("during-{}", i % 2);
        assert_plain(&charge(&client, &proxy, "", &[("idempotency-key", &key)], "{}").await);
    }
    let during = started.elapsed();
    assert_eq!(upstream.executions(PATH), 15, "nothing was turned away");
    assert_eq!(metric(&client, &proxy, &outcome("unprotected")).await, 10);
    assert_eq!(
        metric(&client, &proxy, &outcome("store_unavailable")).await,
        0
    );
    // Bounded by the store timeout (250 ms here) per request at worst.
    assert!(during < Duration::from_secs(10), "{during:?}");

    tokio::task::block_in_place(|| redis.restart());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        assert_plain(&charge(&client, &proxy, "", &[("idempotency-key", "after")], "{}").await);
        if metric(&client, &proxy, &outcome("observed_replay")).await >= 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "observing again after the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An observe route and an enforce route on one store: the records the
/// observe route keeps are its own, so a key it saw first is still new to
/// the enforce route (and the other way round), and no observed record is
/// ever replayed by enforcement.
#[tokio::test]
async fn observed_records_live_apart_from_enforced_ones() {
    use idemproxy::config::{IdempotencySettings, RouteConfig};
    use support::proxy::{config, TestProxy};

    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.routes = vec![
        RouteConfig {
            name: "observed".into(),
            path: "/v1/observed".into(),
            idempotency: IdempotencySettings {
                mode: Mode::Observe,
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
        RouteConfig {
            name: "enforced".into(),
            path: "/v1/enforced".into(),
            idempotency: c.idempotency.clone(),
            ..Default::default()
        },
    ];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let send = |path: &'static str, key: &'static str| {
        let (client, url) = (&client, proxy.url(path));
        async move { client.post_json(&url, key, r#"{"amount": 1}"#).await }
    };
    assert_plain(&send("/v1/observed", "shared-1").await);
    let enforced = send("/v1/enforced", "shared-1").await;
    assert_eq!(
        enforced.status, 201,
        "a key new to enforcement: {enforced:?}"
    );
    assert!(!enforced.replayed());
    assert!(send("/v1/enforced", "shared-1").await.replayed());

    assert_eq!(send("/v1/enforced", "shared-2").await.status, 201);
    assert_plain(&send("/v1/observed", "shared-2").await);
    let metrics = proxy.admin_url("/metrics");
    let series = |outcome: &str| {
        format!(r#"idemproxy_requests_total{{route="observed",outcome="{outcome}"}}"#)
    };
    assert_eq!(client.metric(&metrics, &series("executed")).await, 2.0);
    assert_eq!(
        client.metric(&metrics, &series("observed_mismatch")).await,
        0.0,
        "an enforced key is no mismatch to the observe route"
    );
    assert_eq!(upstream.executions("/v1/observed"), 2);
    assert_eq!(upstream.executions("/v1/enforced"), 2);
}

/// Observe mode changes nothing of the request: the upstream sees the
/// client's own `Accept-Encoding`, on the keyed request the proxy records
/// as on every other, and a coded answer is recorded as it came (it is
/// only counted against, never replayed).
#[tokio::test]
async fn an_observed_request_reaches_the_upstream_with_the_clients_headers() {
    use support::proxy::{config, TestProxy};

    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.mode = Mode::Observe;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url(&format!("{PATH}?header=content-encoding%3Agzip"));
    for _ in 0..2 {
        let reply = client
            .post_json_with(
                &url,
                &[("idempotency-key", "enc-1"), ("accept-encoding", "gzip")],
                r#"{"amount": 1}"#,
            )
            .await;
        assert_plain(&reply);
        assert_eq!(reply.header("content-encoding"), Some("gzip"), "{reply:?}");
        let seen = upstream
            .last_headers(PATH)
            .expect("the upstream was called");
        assert_eq!(
            seen.get("accept-encoding").and_then(|v| v.to_str().ok()),
            Some("gzip"),
            "{seen:?}"
        );
    }
    let metrics = proxy.admin_url("/metrics");
    assert_eq!(client.metric(&metrics, &outcome("executed")).await, 1.0);
    assert_eq!(
        client.metric(&metrics, &outcome("observed_replay")).await,
        1.0
    );
}

/// A body a `json:` key source cannot parse is forwarded in observe mode
/// (nothing is refused), and counted as enforcement would have refused it.
#[tokio::test]
async fn an_unparseable_body_is_forwarded_when_observed_and_counted_as_bad_body() {
    use support::proxy::{config, TestProxy};

    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.mode = Mode::Observe;
    c.idempotency.key_from = vec!["json:/key".into()];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url(PATH);
    let body = r#"{"key": "k-1", "amount": NaN}"#;
    assert_plain(&client.post_json_with(&url, &[], body).await);
    assert_eq!(upstream.executions(PATH), 1);
    let metrics = proxy.admin_url("/metrics");
    assert_eq!(client.metric(&metrics, &outcome("bad_body")).await, 1.0);
}
