//! Many replicas, one Redis: two proxies, each with its own connection to a
//! shared private `redis-server` (or a 3-master Redis Cluster), in front of
//! one counting upstream. A key claimed or completed through one replica is
//! seen by the other: replays, in-flight answers, waits and mismatches work
//! across replicas, with and without the local replay cache, and the
//! upstream executes each key once. A key an operator removes through one
//! replica is dropped from the others' caches, and a replica that cannot
//! hear removals answers nothing from its cache.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use idemproxy::config::{Config, OnInFlight, StoreKind, StoreSettings};
use idemproxy::store::{cache, CachedStore, RedisStore, SharedStore, Store};
use support::keys;
use support::proxy::{config, redis_config, Reply, TestClient, TestProxy};
use support::redis_server::{self, RedisServer};
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
    let entries = c.store.local_cache_entries;
    let store = cache::wrap(redis_store(&c).await, entries);
    TestProxy::start_with_store(c, store).await
}

/// A replica behind a local replay cache the test can watch, with the admin
/// API open to [`ADMIN_TOKEN`].
async fn cached_replica(mut c: Config) -> (TestProxy, Arc<CachedStore>) {
    c.admin_token = Some(ADMIN_TOKEN.into());
    let cache = cache::cached(redis_store(&c).await, 1000);
    (TestProxy::start_with_store(c, cache.clone()).await, cache)
}

const ADMIN_TOKEN: &str = "replicas-admin-token-7d1e-3b9f04a6c2e1";

/// The value of `proxy`'s `idemproxy_local_cache_live{store="redis"}`.
async fn cache_live_metric(client: &TestClient, proxy: &TestProxy) -> String {
    let reply = client
        .send(Method::GET, &proxy.admin_url("/metrics"), &[], "")
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let text = String::from_utf8(reply.body.to_vec()).expect("metrics are UTF-8");
    let series = r#"idemproxy_local_cache_live{store="redis"} "#;
    let mut values = text.lines().filter_map(|line| line.strip_prefix(series));
    let value = values
        .next()
        .unwrap_or_else(|| panic!("no {series}in:\n{text}"));
    assert!(values.next().is_none(), "one series: {text}");
    value.to_owned()
}

async fn redis_store(c: &Config) -> SharedStore {
    match c.store.kind {
        StoreKind::Redis => Arc::new(RedisStore::connect(&c.store).await.expect("redis")),
        StoreKind::RedisCluster => Arc::new(
            RedisStore::connect_cluster(&c.store)
                .await
                .expect("redis cluster"),
        ),
        StoreKind::Postgres => Arc::new(
            idemproxy::store::PostgresStore::connect(&c.store)
                .await
                .expect("postgres"),
        ),
        other => panic!("not a shared store: {other:?}"),
    }
}

/// Two replicas on the shared private Redis of this test binary, without
/// the local replay cache: every answer comes from Redis.
/// (`with_the_local_cache_replays_on_b_stay_correct` runs them with it.)
async fn two_replicas(upstream: &TestUpstream, name: &str) -> (TestProxy, TestProxy) {
    let server = redis_server::shared();
    let prefix = redis_server::unique_prefix(name);
    let mut c = redis_config(&upstream.url(), &server.url(), &prefix);
    c.store.local_cache_entries = 0;
    let a = replica(c.clone()).await;
    let b = replica(c).await;
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
    on_b.assert_problem(425, "in-flight");
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
    on_b.assert_problem(409, "key-reused");
    assert_eq!(on_b.header("x-should-retry"), Some("false"));
    assert_eq!(on_b.json()["key_status"], "pending", "{on_b:?}");

    let first = pending.await.expect("the first request");
    assert_executed(&first);
    let after = client.post_json(&b.url(path), "m-1", other_body).await;
    after.assert_problem(409, "key-reused");
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
    client
        .post_json(&b.url(path), "c-slow", BODY)
        .await
        .assert_problem(425, "in-flight");
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
    let c = redis_config(&upstream.url(), &server.url(), &prefix);
    let (a, a_cache) = cached_replica(c.clone()).await;
    let (b, b_cache) = cached_replica(c).await;
    eventually("both caches hear removals", || {
        a_cache.is_live() && b_cache.is_live()
    })
    .await;
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
    client
        .post_json(&b.url(path), "k-1", BODY)
        .await
        .assert_problem(425, "in-flight");
    let first = pending.await.expect("the first request");
    assert_executed(&first);
    // B replays (from Redis, then from its cache), and so does A (from the
    // record it cached on completion), every time identically.
    let hits = |cache: &CachedStore| cache.local_cache_hits().unwrap_or(0);
    let (a_hits, b_hits) = (hits(&a_cache), hits(&b_cache));
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
    assert!(
        hits(&a_cache) >= a_hits + 3 && hits(&b_cache) >= b_hits + 2,
        "the replays came from the caches: a {a_hits} -> {}, b {b_hits} -> {}",
        hits(&a_cache),
        hits(&b_cache)
    );
    // A cached completed record still answers a different body with 409.
    let mismatch = client.post_json(&b.url(path), "k-1", other_body).await;
    mismatch.assert_problem(409, "key-reused");
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

/// Waits until `condition` holds, for up to [`ARRIVAL`].
async fn eventually(what: &str, condition: impl Fn() -> bool) {
    eventually_within(ARRIVAL, what, condition).await;
}

async fn eventually_within(limit: Duration, what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Removes `key` (sent by `post_json` to `path`) through `replica`'s admin
/// API, as an operator does.
async fn admin_delete(client: &TestClient, replica: &TestProxy, path: &str, key: &str) {
    let hash = keys::record_key(&keys::json_post(path), key).to_hex();
    let reply = client
        .send(
            Method::DELETE,
            &replica.admin_url(&format!("/v1/keys/{hash}")),
            &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            "",
        )
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
}

/// Executes `key` through `a`, then replays it through `b` until `b`
/// answers from its cache. Returns the first answer.
async fn executed_on_a_cached_on_b(
    client: &TestClient,
    (a, b): (&TestProxy, &TestProxy),
    b_cache: &CachedStore,
    path: &str,
    key: &str,
) -> Reply {
    eventually("b's cache hears removals", || b_cache.is_live()).await;
    let first = client.post_json(&a.url(path), key, BODY).await;
    assert_executed(&first);
    for _ in 0..2 {
        assert_replays(&client.post_json(&b.url(path), key, BODY).await, &first);
    }
    assert_eq!(b_cache.len(), 1, "b caches the record it replayed");
    first
}

/// What a removal through A must do to B's cache, on a standalone Redis or
/// a cluster: B drops the key when it hears of it, and executes the key
/// afresh instead of replaying the removed record.
async fn removal_reaches_the_other_cache(a: StoreSettings, b: StoreSettings, path: &str) {
    let upstream = TestUpstream::start().await;
    let with_store = |store: StoreSettings| Config {
        store,
        ..config(&upstream.url())
    };
    let a = cached_replica(with_store(a)).await.0;
    let (b, b_cache) = cached_replica(with_store(b)).await;
    let client = TestClient::new();
    executed_on_a_cached_on_b(&client, (&a, &b), &b_cache, path, "r-1").await;
    let hits = b_cache.local_cache_hits();

    admin_delete(&client, &a, path, "r-1").await;
    eventually("b drops the key a removed", || b_cache.is_empty()).await;
    let again = client.post_json(&b.url(path), "r-1", BODY).await;
    assert_executed(&again);
    assert_eq!(
        upstream.executions(path),
        2,
        "executed afresh after removal"
    );
    assert_eq!(
        b_cache.local_cache_hits(),
        hits,
        "not answered from b's cache"
    );
    println!("replicas/removal-heard: executions={}", upstream.total());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_through_one_replica_is_dropped_from_the_others_cache() {
    let server = redis_server::shared();
    let prefix = redis_server::unique_prefix("removal");
    let store = redis_config("", &server.url(), &prefix).store;
    removal_reaches_the_other_cache(store.clone(), store, "/v1/orders").await;
}

/// On PostgreSQL, removals reach the other cache by `LISTEN`/`NOTIFY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_removal_is_dropped_from_the_others_cache() {
    let server = support::postgres_server::shared();
    let prefix = support::postgres_server::unique_prefix("removal");
    let store = support::proxy::postgres_config("", &server.url(), &prefix).store;
    removal_reaches_the_other_cache(store.clone(), store, "/v1/orders").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_redis_cluster_a_removal_is_dropped_from_the_others_cache() {
    let cluster = redis_server::shared_cluster();
    let prefix = redis_server::unique_prefix("cluster-removal");
    let a = StoreSettings {
        kind: StoreKind::RedisCluster,
        urls: cluster.urls(),
        key_prefix: prefix,
        ..StoreSettings::default()
    };
    // B follows removals on another seed node than the first, A's.
    let mut b = a.clone();
    b.urls.rotate_left(1);
    removal_reaches_the_other_cache(a, b, "/v1/orders").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_retried_after_its_answer_was_lost_still_reaches_the_others() {
    // The first DELETE's GETDEL ran, but its caller gave up (the admin
    // API's timeout) before anything was published; the operator retries.
    let server = redis_server::shared();
    let prefix = redis_server::unique_prefix("lost-removal");
    let upstream = TestUpstream::start().await;
    let c = redis_config(&upstream.url(), &server.url(), &prefix);
    let a = cached_replica(c.clone()).await.0;
    let (b, b_cache) = cached_replica(c).await;
    let client = TestClient::new();
    let path = "/v1/orders";
    executed_on_a_cached_on_b(&client, (&a, &b), &b_cache, path, "lost-1").await;

    let hash = keys::record_key(&keys::json_post(path), "lost-1").to_hex();
    let deleted = server.cli(&["DEL", &format!("{prefix}{{{hash}}}")]);
    assert_eq!(deleted.trim(), "1", "the first removal's GETDEL ran");
    assert_eq!(b_cache.len(), 1, "and nobody was told");
    let retried = client
        .send(
            Method::DELETE,
            &a.admin_url(&format!("/v1/keys/{hash}")),
            &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            "",
        )
        .await;
    assert_eq!(retried.status, 404, "nothing left to remove: {retried:?}");
    eventually("b drops the key the retried removal announced", || {
        b_cache.is_empty()
    })
    .await;
    let again = client.post_json(&b.url(path), "lost-1", BODY).await;
    assert_executed(&again);
    assert_eq!(
        upstream.executions(path),
        2,
        "executed afresh after removal"
    );
}

/// Two cached replicas on a Redis of their own, for a test that breaks it,
/// with `key` executed through A and cached on B.
struct PrivatePair {
    upstream: TestUpstream,
    server: RedisServer,
    a: TestProxy,
    b: TestProxy,
    b_cache: Arc<CachedStore>,
    client: TestClient,
    /// A's answer to `key`.
    first: Reply,
}

const PRIVATE_PATH: &str = "/v1/orders";

async fn private_pair(key: &str) -> PrivatePair {
    let upstream = TestUpstream::start().await;
    let server = RedisServer::start();
    let c = redis_config(&upstream.url(), &server.url(), "private:");
    let a = cached_replica(c.clone()).await.0;
    let (b, b_cache) = cached_replica(c).await;
    let client = TestClient::new();
    let first = executed_on_a_cached_on_b(&client, (&a, &b), &b_cache, PRIVATE_PATH, key).await;
    PrivatePair {
        upstream,
        server,
        a,
        b,
        b_cache,
        client,
        first,
    }
}

/// A replica that cannot subscribe (here: Redis refuses the channel to its
/// user, as an ACL without it does) answers replays from Redis, so a
/// removal it cannot hear of is never replayed from its cache; once it
/// hears removals again it caches again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_hear_removals_answers_nothing_from_its_cache() {
    // The test takes the channel away from the Redis user.
    let PrivatePair {
        upstream,
        server,
        a,
        b,
        b_cache,
        client,
        first,
    } = private_pair("d-1").await;
    let path = PRIVATE_PATH;

    // Redis drops subscribers that lose the channel, and refuses them again.
    server.cli(&["ACL", "SETUSER", "default", "resetchannels"]);
    eventually("b's cache stops answering", || !b_cache.is_live()).await;
    assert_eq!(
        cache_live_metric(&client, &b).await,
        "0",
        "b's /metrics says so"
    );
    let hits = b_cache.local_cache_hits();
    assert_replays(&client.post_json(&b.url(path), "d-1", BODY).await, &first);
    assert_eq!(b_cache.local_cache_hits(), hits, "replayed from Redis");

    // A's announcement cannot reach B (PUBLISH is refused too)...
    admin_delete(&client, &a, path, "d-1").await;
    // ...and B, which still holds the record, does not replay it.
    let again = client.post_json(&b.url(path), "d-1", BODY).await;
    assert_executed(&again);
    assert_eq!(upstream.executions(path), 2);

    server.cli(&["ACL", "SETUSER", "default", "allchannels"]);
    eventually("b's cache answers again", || b_cache.is_live()).await;
    assert_eq!(cache_live_metric(&client, &b).await, "1");
    assert!(
        b_cache.is_empty(),
        "b starts over: it cannot know what it missed"
    );
    for _ in 0..2 {
        assert_replays(&client.post_json(&b.url(path), "d-1", BODY).await, &again);
    }
    assert_eq!(
        b_cache.local_cache_hits(),
        hits.map(|h| h + 1),
        "cached again"
    );
    assert_eq!(upstream.executions(path), 2);
    println!("replicas/removal-unheard: executions={}", upstream.total());
}

/// Sends `signal` to the process `pid` (one this test started).
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {signal} {pid}");
}

/// Resumes a stopped process when dropped, so a failing test leaves no
/// frozen Redis behind.
struct Frozen(u32);

impl Drop for Frozen {
    fn drop(&mut self) {
        signal(self.0, "-CONT");
    }
}

/// A subscription that breaks without its socket saying so (here: Redis
/// frozen with SIGSTOP, as a partition looks from the proxy) is found by
/// the heartbeat `PING`: the cache stops answering within the heartbeat
/// (5 s) and the I/O timeout, and starts over empty once Redis answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_broken_subscription_is_found_by_the_heartbeat() {
    // Kept whole: both replicas stay up while Redis is frozen.
    let pair = private_pair("f-1").await;
    let b_cache = &pair.b_cache;
    assert_eq!(b_cache.len(), 1);

    let frozen = Frozen(pair.server.pid().expect("redis runs"));
    signal(frozen.0, "-STOP");
    eventually_within(Duration::from_secs(10), "b's cache stops answering", || {
        !b_cache.is_live()
    })
    .await;
    drop(frozen);
    eventually("b's cache answers again", || b_cache.is_live()).await;
    assert!(b_cache.is_empty(), "b starts over after the gap");
}
