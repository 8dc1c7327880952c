//! Many replicas, one Redis: two proxies, each with its own connection to a
//! shared private `redis-server` (or a 3-master Redis Cluster), in front of
//! one counting upstream. A key claimed or completed through one replica is
//! seen by the other: replays, in-flight answers, waits and mismatches work
//! across replicas, with and without the local replay cache, and the
//! upstream executes each key once.

mod support;

use std::sync::Arc;
use std::time::Duration;

use idemproxy::config::{Config, OnInFlight, StoreKind};
use idemproxy::store::{cache, RedisStore, SharedStore};
use support::proxy::{config, redis_config, Reply, TestClient, TestProxy};
use support::redis_server;
use support::upstream::TestUpstream;
use tokio::time::Instant;

const BODY: &str = r#"{"amount":1000,"currency":"eur"}"#;
const ARRIVAL: Duration = Duration::from_secs(5);

fn cluster_config(upstream: &TestUpstream, urls: Vec<String>, prefix: &str) -> Config {
    let mut c = config(&upstream.url());
    c.store.kind = StoreKind::RedisCluster;
    c.store.urls = urls;
    c.store.key_prefix = prefix.to_string();
    c
}

/// A replica with a Redis connection of its own (behind the local replay
/// cache when `store.local_cache_entries` is set), as `idemproxy` builds it.
async fn replica(c: Config) -> TestProxy {
    let store: SharedStore = match c.store.kind {
        StoreKind::Redis => Arc::new(RedisStore::connect(&c.store).await.expect("redis")),
        StoreKind::RedisCluster => Arc::new(
            RedisStore::connect_cluster(&c.store)
                .await
                .expect("redis cluster"),
        ),
        other => panic!("not a Redis store: {other:?}"),
    };
    let store = cache::wrap(store, c.store.local_cache_entries);
    TestProxy::start_with_store(c, store).await
}

/// Two replicas on the shared private Redis of this test binary.
async fn two_replicas(upstream: &TestUpstream, name: &str) -> (TestProxy, TestProxy) {
    let server = redis_server::shared();
    let prefix = redis_server::unique_prefix(name);
    let a = replica(redis_config(&upstream.url(), &server.url(), &prefix)).await;
    let b = replica(redis_config(&upstream.url(), &server.url(), &prefix)).await;
    (a, b)
}

fn assert_executed(reply: &Reply) {
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(
        !reply.replayed(),
        "the first answer is no replay: {reply:?}"
    );
}

/// `reply` replays `original`: same status and body, marked as a replay.
fn assert_replays(reply: &Reply, original: &Reply) {
    assert_eq!(reply.status, original.status, "{reply:?}");
    assert!(reply.replayed(), "not marked as a replay: {reply:?}");
    assert!(
        reply.header("idempotency-original-date").is_some(),
        "{reply:?}"
    );
    assert_eq!(
        reply.body, original.body,
        "the replay carries the stored body"
    );
    assert_eq!(
        reply.header("x-upstream-execution"),
        original.header("x-upstream-execution"),
        "stored upstream headers are replayed"
    );
}

fn assert_problem(reply: &Reply, status: u16, slug: &str) {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(reply.problem(), slug, "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executed_on_a_is_replayed_on_b() {
    let upstream = TestUpstream::start().await;
    let (a, b) = two_replicas(&upstream, "replay").await;
    let client = TestClient::new();

    let first = client.post_json(&a.url("/v1/orders"), "r-1", BODY).await;
    assert_executed(&first);
    let on_b = client.post_json(&b.url("/v1/orders"), "r-1", BODY).await;
    assert_replays(&on_b, &first);
    let on_a = client.post_json(&a.url("/v1/orders"), "r-1", BODY).await;
    assert_replays(&on_a, &first);
    assert_eq!(
        on_b.header("idempotency-original-date"),
        on_a.header("idempotency-original-date"),
        "both replicas replay the one stored record"
    );

    // A key first seen on B executes there, and replays on A.
    let other = client.post_json(&b.url("/v1/orders"), "r-2", BODY).await;
    assert_executed(&other);
    assert_replays(
        &client.post_json(&a.url("/v1/orders"), "r-2", BODY).await,
        &other,
    );
    assert_eq!(upstream.executions("/v1/orders"), 2);
    println!(
        "replicas/replay: operations=2 duplicates=2 executions={}",
        upstream.executions("/v1/orders")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_on_a_is_425_on_b() {
    let upstream = TestUpstream::start().await;
    let (a, b) = two_replicas(&upstream, "in-flight").await;
    let client = TestClient::new();
    let path = "/v1/orders?delay_ms=800";

    let pending = {
        let client = client.clone();
        let url = a.url(path);
        tokio::spawn(async move { client.post_json(&url, "f-1", BODY).await })
    };
    assert!(upstream.wait_for_executions(path, 1, ARRIVAL).await);
    let on_b = client.post_json(&b.url(path), "f-1", BODY).await;
    assert_problem(&on_b, 425, "in-flight");
    assert!(on_b.header("retry-after").is_some(), "{on_b:?}");
    assert!(on_b.header("retry-after-ms").is_some(), "{on_b:?}");
    assert_eq!(on_b.header("x-should-retry"), Some("true"));

    let first = pending.await.expect("the first request");
    assert_executed(&first);
    assert_replays(&client.post_json(&b.url(path), "f-1", BODY).await, &first);
    assert_eq!(upstream.executions(path), 1);
    println!(
        "replicas/in-flight: operations=1 duplicates=2 executions={}",
        upstream.executions(path)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_in_flight_wait_b_answers_with_the_replay_once_a_finishes() {
    let upstream = TestUpstream::start().await;
    let server = redis_server::shared();
    let prefix = redis_server::unique_prefix("wait");
    let a = replica(redis_config(&upstream.url(), &server.url(), &prefix)).await;
    let mut waiting = redis_config(&upstream.url(), &server.url(), &prefix);
    waiting.idempotency.on_in_flight = OnInFlight::Wait;
    waiting.idempotency.wait_timeout = Duration::from_secs(5);
    let b = replica(waiting).await;
    let client = TestClient::new();
    let path = "/v1/orders?delay_ms=800";

    let started = Instant::now();
    let pending = {
        let client = client.clone();
        let url = a.url(path);
        tokio::spawn(async move { client.post_json(&url, "w-1", BODY).await })
    };
    assert!(upstream.wait_for_executions(path, 1, ARRIVAL).await);
    let on_b = client.post_json(&b.url(path), "w-1", BODY).await;
    let b_done = started.elapsed();
    let first = pending.await.expect("the first request");
    assert_executed(&first);
    assert_replays(&on_b, &first);
    assert!(
        b_done >= Duration::from_millis(750),
        "B answered after {b_done:?}, before A's 800 ms execution could finish"
    );
    assert_eq!(upstream.executions(path), 1);
    println!(
        "replicas/wait: operations=1 duplicates=1 executions={} b_waited={b_done:?}",
        upstream.executions(path)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_body_on_b_is_409_while_a_is_pending_and_after() {
    let upstream = TestUpstream::start().await;
    let (a, b) = two_replicas(&upstream, "mismatch").await;
    let client = TestClient::new();
    let path = "/v1/orders?delay_ms=800";
    let other_body = r#"{"amount":2000,"currency":"eur"}"#;

    let pending = {
        let client = client.clone();
        let url = a.url(path);
        tokio::spawn(async move { client.post_json(&url, "m-1", BODY).await })
    };
    assert!(upstream.wait_for_executions(path, 1, ARRIVAL).await);
    let on_b = client.post_json(&b.url(path), "m-1", other_body).await;
    assert_problem(&on_b, 409, "key-reused");
    assert_eq!(on_b.header("x-should-retry"), Some("false"));
    assert_eq!(on_b.json()["key_status"], "pending", "{on_b:?}");

    let first = pending.await.expect("the first request");
    assert_executed(&first);
    let after = client.post_json(&b.url(path), "m-1", other_body).await;
    assert_problem(&after, 409, "key-reused");
    assert_eq!(after.json()["key_status"], "completed", "{after:?}");
    assert_eq!(upstream.executions(path), 1);
    println!(
        "replicas/mismatch: operations=1 duplicates=2 executions={}",
        upstream.executions(path)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_redis_cluster_executed_on_a_is_replayed_on_b() {
    let upstream = TestUpstream::start().await;
    let cluster = redis_server::shared_cluster();
    let prefix = redis_server::unique_prefix("cluster");
    let a = replica(cluster_config(&upstream, cluster.urls(), &prefix)).await;
    let b = replica(cluster_config(&upstream, cluster.urls(), &prefix)).await;
    let client = TestClient::new();

    // Enough keys that they land on every master.
    const KEYS: usize = 12;
    let mut firsts = Vec::new();
    for i in 0..KEYS {
        let key = format!("c-{i}");
        let (first, second) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let reply = client.post_json(&first.url("/v1/orders"), &key, BODY).await;
        assert_executed(&reply);
        assert_replays(
            &client
                .post_json(&second.url("/v1/orders"), &key, BODY)
                .await,
            &reply,
        );
        firsts.push(reply);
    }
    // In flight on A is in flight on B through the cluster as well.
    let path = "/v1/slow?delay_ms=600";
    let pending = {
        let client = client.clone();
        let url = a.url(path);
        tokio::spawn(async move { client.post_json(&url, "c-slow", BODY).await })
    };
    assert!(upstream.wait_for_executions(path, 1, ARRIVAL).await);
    assert_problem(
        &client.post_json(&b.url(path), "c-slow", BODY).await,
        425,
        "in-flight",
    );
    let slow = pending.await.expect("the slow request");
    assert_replays(&client.post_json(&b.url(path), "c-slow", BODY).await, &slow);

    // The records really are spread over the masters.
    let holding: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|node| {
            node.cli(&["--scan", "--pattern", &format!("{prefix}*")])
                .lines()
                .filter(|l| !l.is_empty())
                .count()
        })
        .collect();
    assert_eq!(holding.iter().sum::<usize>(), KEYS + 1, "{holding:?}");
    assert!(
        holding.iter().filter(|n| **n > 0).count() >= 2,
        "records on more than one master: {holding:?}"
    );
    assert_eq!(upstream.executions("/v1/orders"), KEYS);
    assert_eq!(upstream.executions(path), 1);
    println!(
        "replicas/cluster: operations={} duplicates={} executions={} records_per_master={holding:?}",
        KEYS + 1,
        KEYS + 2,
        upstream.total()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_local_cache_replays_on_b_stay_correct() {
    let upstream = TestUpstream::start().await;
    let server = redis_server::shared();
    let prefix = redis_server::unique_prefix("cached");
    let mut c = redis_config(&upstream.url(), &server.url(), &prefix);
    c.store.local_cache_entries = 1000;
    let a = replica(c.clone()).await;
    let b = replica(c).await;
    let client = TestClient::new();
    let path = "/v1/orders?delay_ms=500";
    let other_body = r#"{"amount":1,"currency":"eur"}"#;

    // Pending records are never cached: B sees A's claim as in flight, then
    // its completion, not a stale "in flight".
    let pending = {
        let client = client.clone();
        let url = a.url(path);
        tokio::spawn(async move { client.post_json(&url, "k-1", BODY).await })
    };
    assert!(upstream.wait_for_executions(path, 1, ARRIVAL).await);
    assert_problem(
        &client.post_json(&b.url(path), "k-1", BODY).await,
        425,
        "in-flight",
    );
    let first = pending.await.expect("the first request");
    assert_executed(&first);
    // B replays (from Redis, then from its cache), and so does A (from the
    // record it cached on completion), every time identically.
    let mut date = None;
    for round in 0..3 {
        for (name, replica) in [("b", &b), ("a", &a)] {
            let reply = client.post_json(&replica.url(path), "k-1", BODY).await;
            assert_replays(&reply, &first);
            let this = reply
                .header("idempotency-original-date")
                .map(str::to_string);
            let date = date.get_or_insert_with(|| this.clone());
            assert_eq!(&this, date, "round {round} on {name}");
        }
    }
    // A cached completed record still answers a different body with 409.
    let mismatch = client.post_json(&b.url(path), "k-1", other_body).await;
    assert_problem(&mismatch, 409, "key-reused");
    assert_eq!(mismatch.json()["key_status"], "completed");

    // A key completed through B after B cached others replays on A.
    let second = client.post_json(&b.url("/v1/other"), "k-2", BODY).await;
    assert_executed(&second);
    assert_replays(
        &client.post_json(&a.url("/v1/other"), "k-2", BODY).await,
        &second,
    );
    assert_eq!(upstream.executions(path), 1);
    assert_eq!(upstream.executions("/v1/other"), 1);
    println!(
        "replicas/local-cache: operations=2 duplicates=9 executions={}",
        upstream.total()
    );
}
