//! Fault injection: the Redis behind a real `idemproxy` process is killed
//! (SIGKILL) under load, then restarted on the same port with its
//! append-only file. While it is down, covered requests are answered 503
//! `store-unavailable` quickly and never reach the upstream; once it is
//! back, the same proxy process serves again, and keys completed before the
//! crash still replay. The same for one master of a Redis Cluster: only its
//! slots fail, closed.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemproxy::config::OnStoreError;
use support::binary::ProxyProcess;
use support::fault::{slug, Executions};
use support::keys;
use support::proxy::{redis_config, Reply, TestClient};
use support::redis_server::{self, RedisOptions, RedisServer};
use support::upstream::TestUpstream;
use tokio::task::JoinSet;
use tokio::time::Instant;

const BODY: &str = r#"{"amount":1000,"currency":"eur"}"#;
const WORKERS: usize = 4;
/// Every answer while Redis is down must arrive within this bound
/// (`store.timeout` is 250 ms).
const DOWN_BOUND: Duration = Duration::from_secs(1);

/// One request of the load: when it was sent and answered (relative to the
/// start), its path (a path of its own) and the answer.
struct Sample {
    sent: Duration,
    answered: Duration,
    key: String,
    path: String,
    reply: Reply,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_killed_under_load_means_fast_503s_then_recovery_and_aof_replays() {
    let mut redis = RedisServer::start_with(RedisOptions {
        extra_args: ["--appendonly", "yes", "--appendfsync", "always"]
            .map(String::from)
            .to_vec(),
        ..RedisOptions::default()
    });
    assert_eq!(
        redis.cli(&["config", "get", "appendfsync"]).lines().nth(1),
        Some("always"),
        "the test Redis runs with an fsynced AOF"
    );
    let upstream = TestUpstream::start().await;
    let mut c = redis_config(
        &upstream.url(),
        &redis.url(),
        &redis_server::unique_prefix("redis-down"),
    );
    c.store.timeout = Duration::from_millis(250);
    // Replays after the restart must come from Redis's AOF, not from the
    // proxy's own cache.
    c.store.local_cache_entries = 0;
    let proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();

    // A key completed before the crash.
    let before = client
        .post_json(&proxy.url("/v1/before"), "before-1", BODY)
        .await;
    assert_eq!(before.status, 201, "{before:?}\n{}", proxy.logs());
    assert!(!before.replayed());

    // Load: workers send new keys, each on a path of its own, until told to
    // stop, recording every answer.
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let mut workers = JoinSet::new();
    for w in 0..WORKERS {
        let (client, stop, samples) = (client.clone(), stop.clone(), samples.clone());
        let base = proxy.url("");
        workers.spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("load-{w}-{i}");
                let path = format!("/v1/load/{w}/{i}");
                let sent = start.elapsed();
                let reply = client.post_json(&format!("{base}{path}"), &key, BODY).await;
                let answered = start.elapsed();
                let sample = Sample {
                    sent,
                    answered,
                    key,
                    path,
                    reply,
                };
                samples
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(sample);
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    }

    tokio::time::sleep(Duration::from_millis(400)).await;
    let kill_started = start.elapsed();
    tokio::task::block_in_place(|| redis.kill());
    let killed_at = start.elapsed();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let restart_started = start.elapsed();
    tokio::task::block_in_place(|| redis.restart());
    let restarted_at = start.elapsed();

    // Recovery, without touching the proxy: a new key executes again
    // within a bounded number of tries.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut tries = 0;
    let recovered_at = loop {
        tries += 1;
        let reply = client
            .post_json(
                &proxy.url(&format!("/v1/recover/{tries}")),
                &format!("recover-{tries}"),
                BODY,
            )
            .await;
        if reply.status == 201 {
            assert!(!reply.replayed(), "{reply:?}");
            break start.elapsed();
        }
        assert_eq!(reply.status, 503, "{reply:?}");
        assert_eq!(reply.problem(), "store-unavailable");
        assert_eq!(upstream.executions(&format!("/v1/recover/{tries}")), 0);
        assert!(
            Instant::now() < deadline,
            "the proxy did not recover within 10 s of the Redis restart:\n{}",
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Let the load run on the recovered store for a moment, then stop it.
    tokio::time::sleep(Duration::from_millis(400)).await;
    stop.store(true, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(30), workers.join_all())
        .await
        .expect("the load stops");
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));

    // Classify: sent and answered while Redis was certainly down, or
    // certainly up (before the kill began, after the recovery). Violations
    // are collected, so that the counts print before the test fails.
    let mut violations: Vec<String> = Vec::new();
    macro_rules! expect {
        ($ok:expr, $($why:tt)+) => {
            if !$ok {
                violations.push(format!($($why)+));
            }
        };
    }
    let (mut down, mut up_before, mut up_after, mut straddling) = (0, 0, 0, 0);
    let mut slowest_down = Duration::ZERO;
    for s in &samples {
        let executions = upstream.executions(&s.path);
        let (status, reply) = (s.reply.status.as_u16(), &s.reply);
        if s.sent >= killed_at && s.answered <= restart_started {
            down += 1;
            let problem = slug(reply);
            expect!(
                status == 503 && problem.as_deref() == Some("store-unavailable"),
                "{} while down: {reply:?}",
                s.key
            );
            expect!(reply.header("retry-after").is_some(), "{reply:?}");
            expect!(executions == 0, "{} reached the upstream while down", s.key);
            let took = s.answered - s.sent;
            slowest_down = slowest_down.max(took);
            expect!(took <= DOWN_BOUND, "{} answered after {took:?}", s.key);
        } else if s.answered <= kill_started || s.sent >= recovered_at {
            if s.answered <= kill_started {
                up_before += 1;
            } else {
                up_after += 1;
            }
            expect!(
                status == 201 && !reply.replayed(),
                "{} while up: {reply:?}",
                s.key
            );
            expect!(executions == 1, "{} executed {executions} times", s.key);
        } else {
            straddling += 1;
            expect!(
                status == 201 || status == 503,
                "{} around the crash: {reply:?}",
                s.key
            );
            expect!(
                status != 503 || executions == 0,
                "{} got 503 but executed",
                s.key
            );
        }
    }
    expect!(down >= WORKERS, "{down} requests ran while Redis was down");
    expect!(
        up_before >= WORKERS && up_after >= WORKERS,
        "load while up: {up_before} before, {up_after} after"
    );

    // The AOF kept what was completed before the crash: it replays, and
    // executes nothing.
    let mut replayed = 0;
    let replay = client
        .post_json(&proxy.url("/v1/before"), "before-1", BODY)
        .await;
    replayed += 1;
    expect!(
        replay.status == 201 && replay.replayed() && replay.body == before.body,
        "completed before the crash, not replayed after it: {replay:?}"
    );
    for s in samples.iter().filter(|s| s.answered <= kill_started) {
        let reply = client.post_json(&proxy.url(&s.path), &s.key, BODY).await;
        replayed += 1;
        expect!(
            reply.status == 201 && reply.replayed() && reply.body == s.reply.body,
            "{} completed before the crash, not replayed after it: {reply:?}",
            s.key
        );
    }

    // A request that executed around the crash may have lost its
    // completion: its key is then still claimed (425 until the lease runs
    // out) or settled fail-closed, but never executed again.
    let mut straddlers_retried = 0;
    for s in samples
        .iter()
        .filter(|s| s.answered > kill_started && s.sent < recovered_at && s.reply.status == 201)
    {
        let reply = client.post_json(&proxy.url(&s.path), &s.key, BODY).await;
        straddlers_retried += 1;
        let fine = match reply.status.as_u16() {
            201 => reply.replayed(),
            425 => slug(&reply).as_deref() == Some("in-flight"),
            502 => slug(&reply).as_deref() == Some("outcome-unknown"),
            _ => false,
        };
        expect!(fine, "{} retried after the crash: {reply:?}", s.key);
    }
    replayed += straddlers_retried;

    let mut paths: Vec<String> = samples.iter().map(|s| s.path.clone()).collect();
    paths.push("/v1/before".into());
    paths.extend((1..=tries).map(|t| format!("/v1/recover/{t}")));
    let executions = Executions::count(&upstream, paths.iter().map(String::as_str));
    println!(
        "redis-down: operations={} duplicates={replayed} executions={} \
         answered_while_down={down} (503, slowest {slowest_down:?}) up_before={up_before} \
         up_after={up_after} straddling={straddling} (201s retried: {straddlers_retried}) \
         recovery_tries={tries} recovered_after={:?} killed_at={killed_at:?} \
         restarted_at={restarted_at:?} violations={}",
        samples.len() + 1 + tries,
        executions.total,
        recovered_at - restarted_at,
        violations.len(),
    );
    executions.assert_at_most_once();
    assert!(violations.is_empty(), "{violations:#?}");
    assert_eq!(
        executions.total,
        upstream.total(),
        "nothing else reached the upstream"
    );
}

/// A proxy process on `redis` (`store.timeout` in ms, if given) whose
/// every traffic worker has opened its own Redis connection, and the
/// clients that made them do so: connections held open at once land on
/// different workers.
async fn warm_proxy(
    redis: &RedisServer,
    upstream: &TestUpstream,
    name: &str,
    store_timeout_ms: Option<u64>,
) -> (ProxyProcess, Vec<TestClient>) {
    let mut c = redis_config(
        &upstream.url(),
        &redis.url(),
        &redis_server::unique_prefix(name),
    );
    if let Some(ms) = store_timeout_ms {
        c.store.timeout = Duration::from_millis(ms);
    }
    let proxy = ProxyProcess::start(c).await;
    let clients: Vec<TestClient> = (0..4).map(|_| TestClient::new()).collect();
    for (i, client) in clients.iter().enumerate() {
        let warm = client
            .post_json(&proxy.url("/v1/warm"), &format!("warm-{i}"), BODY)
            .await;
        assert_eq!(warm.status, 201, "{warm:?}\n{}", proxy.logs());
    }
    (proxy, clients)
}

/// Sends `key` to `path` until it executes (201), for at most 5 s: until
/// then it may find Redis paused (503) or the key still claimed (425).
async fn retry_until_executed(
    client: &TestClient,
    proxy: &ProxyProcess,
    path: &str,
    key: &str,
) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let reply = client.post_json(&proxy.url(path), key, BODY).await;
        if reply.status == 201 || Instant::now() > deadline {
            assert_eq!(reply.status, 201, "{reply:?}\n{}", proxy.logs());
            return reply;
        }
        assert!(
            reply.status == 503 || reply.status == 425,
            "while Redis is paused or before the release: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A `begin` that Redis runs only after `store.timeout` has passed (Redis
/// paused): the request is answered 503 `store-unavailable` and not
/// executed, and the claim the late `begin` makes is released, so the
/// caller's retry with the same key executes, once, instead of finding the
/// key in flight until its lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_answered_after_the_store_timeout_does_not_block_the_retry() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let (proxy, clients) = warm_proxy(&redis, &upstream, "late-begin", Some(100)).await;
    let client = &clients[0];

    // Redis holds every command for 750 ms: longer than store.timeout,
    // shorter than the connection's own response timeout (1 s), so the
    // begin still runs, late.
    redis.cli(&["client", "pause", "750", "all"]);
    let started = Instant::now();
    let first = client
        .post_json(&proxy.url("/v1/late"), "late-1", BODY)
        .await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.problem(), "store-unavailable", "{first:?}");
    // At store.timeout (100 ms), not when Redis resumes (750 ms; the 503
    // itself shows the begin had not run by then).
    assert!(
        started.elapsed() < Duration::from_millis(650),
        "answered at store.timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(upstream.executions("/v1/late"), 0);

    // Once Redis runs the begin, its claim is released: the retry executes.
    let retry = retry_until_executed(client, &proxy, "/v1/late", "late-1").await;
    assert!(!retry.replayed());
    assert_eq!(upstream.executions("/v1/late"), 1);
    let released = "released a claim whose begin answered after store.timeout";
    let logs = proxy.logs_when(|logs| logs.contains(released)).await;
    assert!(logs.contains(released), "{logs}");
    // And the key now replays.
    let again = client
        .post_json(&proxy.url("/v1/late"), "late-1", BODY)
        .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(upstream.executions("/v1/late"), 1);
}

/// A `begin` the Redis client itself gives up on (its response timeout,
/// 1 s here) while Redis holds writes for 1.5 s: the request is answered
/// 503 and not executed, and Redis applies the claim after the client has
/// stopped waiting for it. The claim is released all the same, by the
/// token the request drew before it asked, so the retry executes, once,
/// instead of finding a claim nobody holds (425 for the whole lease, then
/// `outcome-unknown` for a request that never ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_the_redis_client_gave_up_on_does_not_block_the_retry() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let (proxy, clients) = warm_proxy(&redis, &upstream, "lost-begin", Some(100)).await;
    let client = &clients[0];

    redis.cli(&["client", "pause", "1500", "write"]);
    let first = client
        .post_json(&proxy.url("/v1/lost"), "lost-1", BODY)
        .await;
    first.assert_problem(503, "store-unavailable");
    tokio::time::sleep(Duration::from_millis(2000)).await;

    let retry = retry_until_executed(client, &proxy, "/v1/lost", "lost-1").await;
    assert!(!retry.replayed());
    assert_eq!(upstream.executions("/v1/lost"), 1);
    let again = client
        .post_json(&proxy.url("/v1/lost"), "lost-1", BODY)
        .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(upstream.executions("/v1/lost"), 1);
}

/// A claim still being released in the background when shutdown's drain
/// deadline passes does not hold up the exit (its lease would allow 20 s,
/// Redis is paused for 10 s): the process stops at the deadline, says how
/// many releases were left, and names each key, which may keep a claim of
/// a request that never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_background_releases_at_the_drain_deadline_and_names_them() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let mut c = redis_config(
        &upstream.url(),
        &redis.url(),
        &redis_server::unique_prefix("drain-release"),
    );
    c.store.timeout = Duration::from_millis(100);
    c.upstream.timeout = Duration::from_secs(20);
    c.drain_timeout = Duration::from_secs(1);
    let mut proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();
    let warm = client.post_json(&proxy.url("/v1/warm"), "warm", BODY).await;
    assert_eq!(warm.status, 201, "{warm:?}");

    redis.cli(&["client", "pause", "10000", "write"]);
    let first = client
        .post_json(&proxy.url("/v1/drain"), "drain-1", BODY)
        .await;
    first.assert_problem(503, "store-unavailable");
    let started = Instant::now();
    proxy.terminate();
    let status = proxy.wait_exit(Duration::from_secs(8)).await;
    let took = started.elapsed();
    redis.cli(&["client", "unpause"]);
    assert!(status.success(), "{status}\n{}", proxy.logs());
    assert!(
        took < Duration::from_secs(4),
        "stopped {took:?} after SIGTERM with a 1 s drain\n{}",
        proxy.logs()
    );
    let logs = proxy.logs();
    let left = logs
        .lines()
        .find(|l| l.contains("still being released after the drain timeout"))
        .unwrap_or_else(|| panic!("the count of releases left:\n{logs}"));
    assert!(left.contains("remaining=1"), "{left}");
    let named = logs
        .lines()
        .find(|l| l.contains("shutdown stopped the release of a claim"))
        .unwrap_or_else(|| panic!("the key of the release left:\n{logs}"));
    assert!(named.contains("key="), "{named}");
    assert_eq!(upstream.executions("/v1/drain"), 0);
}

/// A Redis that restarted and is reported ready serves the next request:
/// each traffic worker's connection learns that it broke only when it is
/// used, and the command it could not send then is sent again on a fresh
/// one instead of failing its request with 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_requests_after_a_redis_restart_are_served() {
    let mut redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let (proxy, clients) = warm_proxy(&redis, &upstream, "restart", None).await;

    tokio::task::block_in_place(|| redis.restart());
    let ready = proxy.admin_url("/readyz");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = clients[0].send(http::Method::GET, &ready, &[], "").await;
        if reply.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {reply:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    for (i, client) in clients.iter().enumerate() {
        let path = format!("/v1/after-restart/{i}");
        let reply = client
            .post_json(&proxy.url(&path), &format!("after-{i}"), BODY)
            .await;
        assert_eq!(
            reply.status,
            201,
            "request {i}: {reply:?}\n{}",
            proxy.logs()
        );
        assert_eq!(upstream.executions(&path), 1);
    }
}

/// A proxy started while its Redis is down (restarting, or started after
/// it) waits for it instead of exiting, and serves once it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_started_before_its_redis_waits_for_it() {
    let mut redis = RedisServer::start();
    redis.kill();
    let upstream = TestUpstream::start().await;
    let config = redis_config(
        &upstream.url(),
        &redis.url(),
        &redis_server::unique_prefix("startup"),
    );
    let starting = tokio::spawn(ProxyProcess::start(config));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !starting.is_finished(),
        "gave up, or became healthy, without its Redis"
    );
    redis.restart();
    let proxy = starting.await.expect("the proxy starts once Redis is up");
    let logs = proxy
        .logs_when(|logs| logs.contains("redis is not up yet"))
        .await;
    assert!(
        logs.contains("redis is not up yet"),
        "the wait is logged:\n{logs}"
    );
    let client = TestClient::new();
    let first = client
        .post_json(&proxy.url("/v1/after"), "after-1", BODY)
        .await;
    assert_eq!(first.status, 201, "{first:?}\n{}", proxy.logs());
    let replay = client
        .post_json(&proxy.url("/v1/after"), "after-1", BODY)
        .await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(upstream.executions("/v1/after"), 1);
}

/// `on_store_error = "pass"` forwards requests while the store cannot
/// answer, not when it answers with a record this build cannot read: that
/// key may stand for a side effect already done, so it fails closed (500
/// `record-unreadable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_record_fails_closed_even_with_on_store_error_pass() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let prefix = redis_server::unique_prefix("unreadable-pass");
    let mut c = redis_config(&upstream.url(), &redis.url(), &prefix);
    c.idempotency.on_store_error = OnStoreError::Pass;
    let proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();

    // Where the key's record lives, a value that is no record.
    let key = keys::record_key(&keys::json_post("/v1/orders"), "unreadable-1");
    let name = idemproxy::store::redis::redis_key(&prefix, &key);
    assert_eq!(redis.cli(&["set", &name, "garbage"]).trim(), "OK");
    let reply = client
        .post_json(&proxy.url("/v1/orders"), "unreadable-1", BODY)
        .await;
    // Permanent until an operator acts: 500, not a 503 to retry.
    reply.assert_record_unreadable();
    assert_eq!(upstream.executions("/v1/orders"), 0);
    assert_eq!(
        redis.cli(&["get", &name]).trim(),
        "garbage",
        "left for the operator"
    );

    // Other keys on the same store are served and protected as usual.
    let fine = client
        .post_json(&proxy.url("/v1/orders"), "fine-1", BODY)
        .await;
    assert_eq!(fine.status, 201, "{fine:?}");
    let retry = client
        .post_json(&proxy.url("/v1/orders"), "fine-1", BODY)
        .await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_records_is_named_in_the_log_at_startup() {
    // Every record has an expiry, so a volatile-* policy can evict it once
    // Redis is full: the key is forgotten and its retry executes again.
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let config = || {
        redis_config(
            &upstream.url(),
            &redis.url(),
            &redis_server::unique_prefix("eviction"),
        )
    };
    const WARNING: &str = "maxmemory-policy volatile-lru";

    // Redis's defaults (noeviction, and no limit): nothing to say.
    let proxy = ProxyProcess::start(config()).await;
    let logs = proxy.logs_when(|l| l.contains("idemproxy serving")).await;
    assert!(logs.contains("idemproxy serving"), "{logs}");
    assert!(!logs.contains("maxmemory"), "{logs}");
    drop(proxy);

    redis.cli(&["CONFIG", "SET", "maxmemory", "100mb"]);
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
    let proxy = ProxyProcess::start(config()).await;
    let logs = proxy.logs_when(|l| l.contains(WARNING)).await;
    assert!(logs.contains(WARNING), "{logs}");
    assert!(logs.contains("ERROR"), "logged as an error: {logs}");
    // A warning, not a refusal: the proxy serves.
    let client = TestClient::new();
    let reply = client.post_json(&proxy.url("/v1/orders"), "k", BODY).await;
    assert_eq!(reply.status, 201, "{reply:?}");
}

/// A Redis Cluster master dies, with no replica to take over its slots:
/// keys in those slots are answered 503 `store-unavailable` within the
/// bound and execute nothing, keys in the other masters' slots are served
/// throughout (the cluster runs with `cluster-require-full-coverage no`),
/// and once the node is back with its append-only file the keys it held
/// replay. Nothing executes twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_lost_fails_its_slots_closed_and_spares_the_others() {
    use support::proxy::{config, TestProxy};
    let mut cluster = redis_server::RedisCluster::start_with(
        3,
        RedisOptions {
            extra_args: [
                "--cluster-require-full-coverage",
                "no",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ]
            .map(String::from)
            .to_vec(),
            ..RedisOptions::default()
        },
    );
    let upstream = TestUpstream::start().await;
    let prefix = redis_server::unique_prefix("cluster-loss");
    let mut c = config(&upstream.url());
    c.store.kind = idemproxy::config::StoreKind::RedisCluster;
    c.store.urls = cluster.urls();
    c.store.key_prefix = prefix.clone();
    c.store.timeout = Duration::from_millis(250);
    // Replays must come from Redis, not from the proxy's own cache.
    c.store.local_cache_entries = 0;
    let store = idemproxy::store::RedisStore::connect_cluster(&c.store)
        .await
        .expect("connect to the cluster");
    let proxy = TestProxy::start_with_store(c, std::sync::Arc::new(store)).await;
    let client = TestClient::new();

    // Keys by the node that holds them; the victim is the second node.
    let victim = cluster.nodes[1].port();
    let on_victim = |key: &str| {
        let record = keys::record_key(&keys::json_post("/v1/x"), key);
        let name = idemproxy::store::redis::redis_key(&prefix, &record);
        cluster.node_for(&name).port() == victim
    };
    let (mut lost, mut spared) = (Vec::new(), Vec::new());
    for i in 0.. {
        let key = format!("c-{i}");
        let side = if on_victim(&key) {
            &mut lost
        } else {
            &mut spared
        };
        if side.len() < 3 {
            side.push(key);
        }
        if lost.len() == 3 && spared.len() == 3 {
            break;
        }
    }
    let path = |key: &str| format!("/v1/cluster/{key}");
    let mut completed = Vec::new();
    for key in lost.iter().chain(&spared) {
        let reply = client.post_json(&proxy.url(&path(key)), key, BODY).await;
        assert_eq!(reply.status, 201, "{key}: {reply:?}");
        completed.push((key.clone(), reply));
    }

    // Keys never used, one on each side, for after the loss.
    let fresh_lost = (0..)
        .map(|i| format!("n-{i}"))
        .find(|k| on_victim(k))
        .expect("a key on the lost node");
    let fresh_spared = (0..)
        .map(|i| format!("n-{i}"))
        .find(|k| !on_victim(k))
        .expect("a key elsewhere");
    cluster.nodes[1].kill();
    for (key, first) in &completed {
        let started = Instant::now();
        let reply = client.post_json(&proxy.url(&path(key)), key, BODY).await;
        let took = started.elapsed();
        if lost.contains(key) {
            assert_eq!(reply.status, 503, "{key} (lost node): {reply:?}");
            assert_eq!(slug(&reply).as_deref(), Some("store-unavailable"));
            assert!(took < DOWN_BOUND, "{key}: answered after {took:?}");
        } else {
            assert_eq!(reply.status, 201, "{key} (spared node): {reply:?}");
            assert!(reply.replayed() && reply.body == first.body, "{reply:?}");
        }
    }
    // New keys: refused on the lost node's slots, executed elsewhere.
    let refused = client
        .post_json(&proxy.url(&path(&fresh_lost)), &fresh_lost, BODY)
        .await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(upstream.executions(&path(&fresh_lost)), 0);
    let served = client
        .post_json(&proxy.url(&path(&fresh_spared)), &fresh_spared, BODY)
        .await;
    assert_eq!(served.status, 201, "{served:?}");
    assert!(!served.replayed());

    // The node comes back with its AOF: what it held replays.
    cluster.nodes[1].restart();
    cluster.wait_ok();
    let deadline = Instant::now() + Duration::from_secs(10);
    for (key, first) in completed.iter().filter(|(k, _)| lost.contains(k)) {
        let reply = loop {
            let reply = client.post_json(&proxy.url(&path(key)), key, BODY).await;
            if reply.status != 503 || Instant::now() > deadline {
                break reply;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(reply.status, 201, "{key} after the restart: {reply:?}");
        assert!(reply.replayed() && reply.body == first.body, "{reply:?}");
    }
    let mut paths: Vec<String> = lost.iter().chain(&spared).map(|k| path(k)).collect();
    paths.push(path(&fresh_spared));
    let executions = Executions::count(&upstream, paths.iter().map(String::as_str));
    executions.assert_at_most_once();
    assert_eq!(executions.total, 7);
}
