//! `mode = "observe"` (DESIGN §6): every request reaches the upstream as
//! if the proxy were plain, and what enforcement would have done is
//! counted. The real binary on a real Redis, so that a store outage is a
//! killed `redis-server` and the log lines can be read.

mod support;

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
