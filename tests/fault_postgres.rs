//! Fault injection on the PostgreSQL store: the database behind a real
//! `idemproxy` process crashes (immediate shutdown) under load and comes
//! back on the same port and data; a streaming standby is promoted
//! mid-traffic. While the store is gone, covered requests are answered 503
//! `store-unavailable` quickly and never reach the upstream; once it is
//! back, the same proxy process serves again (the first request after it),
//! and keys completed before still replay. Also: the sweep deletes expired
//! rows in batches.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemproxy::config::{Config, StoreSettings};
use idemproxy::store::{PostgresStore, Store};
use support::binary::ProxyProcess;
use support::fault::Executions;
use support::postgres_server::{self, PostgresServer};
use support::proxy::{postgres_config, Reply, TestClient};
use support::store_fixtures::{completed, new_key};
use support::upstream::TestUpstream;
use tokio::task::JoinSet;
use tokio::time::Instant;

const BODY: &str = r#"{"amount":1000,"currency":"eur"}"#;
/// Every answer while the database is down must arrive within this bound
/// (`store.timeout` is 250 ms).
const DOWN_BOUND: Duration = Duration::from_secs(1);

fn on_postgres(upstream: &TestUpstream, postgres: &PostgresServer, name: &str) -> Config {
    let mut c = postgres_config(
        &upstream.url(),
        &postgres.url(),
        &postgres_server::unique_prefix(name),
    );
    c.log.level = "info".into();
    c
}

/// Load from `clients` until `stop`: each request a key and path of its
/// own; every reply kept with its path.
fn load(
    proxy: &ProxyProcess,
    clients: &[TestClient],
    stop: &Arc<AtomicBool>,
) -> JoinSet<Vec<(String, Duration, Reply)>> {
    let mut set = JoinSet::new();
    for (worker, client) in clients.iter().enumerate() {
        let (client, stop) = (client.clone(), stop.clone());
        let base = proxy.url("/v1/load");
        set.spawn(async move {
            let mut replies = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let path = format!("/v1/load/{worker}-{n}");
                let sent = Instant::now();
                let reply = client
                    .post_json(
                        &format!("{base}/{worker}-{n}"),
                        &format!("load-{worker}-{n}"),
                        BODY,
                    )
                    .await;
                replies.push((path, sent.elapsed(), reply));
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            replies
        });
    }
    set
}

async fn wait_ready(proxy: &ProxyProcess, client: &TestClient) {
    let ready = proxy.admin_url("/readyz");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reply = client.send(http::Method::GET, &ready, &[], "").await;
        if reply.status == 200 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never ready: {reply:?}\n{}",
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_crashed_under_load_means_fast_503s_then_recovery_and_replays() {
    let mut postgres = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let proxy = ProxyProcess::start(on_postgres(&upstream, &postgres, "crash")).await;
    let clients: Vec<TestClient> = (0..4).map(|_| TestClient::new()).collect();
    let before = clients[0]
        .post_json(&proxy.url("/v1/before"), "before-crash", BODY)
        .await;
    assert_eq!(before.status, 201, "{before:?}\n{}", proxy.logs());

    let stop = Arc::new(AtomicBool::new(false));
    let running = load(&proxy, &clients, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| postgres.crash());
    // While it is down: every answer fast, 503, nothing forwarded.
    let down_from = Instant::now();
    let mut down = Vec::new();
    while down_from.elapsed() < Duration::from_secs(2) {
        let path = format!("/v1/down/{}", down.len());
        let sent = Instant::now();
        let reply = clients[0]
            .post_json(&proxy.url(&path), &format!("down-{}", down.len()), BODY)
            .await;
        down.push((path, sent.elapsed(), reply));
    }
    tokio::task::block_in_place(|| postgres.restart());
    wait_ready(&proxy, &clients[0]).await;
    // The first request after the restart is served.
    let after = clients[1]
        .post_json(&proxy.url("/v1/after"), "after-restart", BODY)
        .await;
    assert_eq!(after.status, 201, "{after:?}\n{}", proxy.logs());
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let loaded: Vec<_> = running.join_all().await.into_iter().flatten().collect();

    let mut statuses = std::collections::BTreeMap::new();
    for (_, _, reply) in &loaded {
        *statuses.entry(reply.status.as_u16()).or_insert(0) += 1;
    }
    let slowest_down = down.iter().map(|(_, took, _)| *took).max();
    println!(
        "postgres crash: load={} statuses={statuses:?} down_requests={} slowest_down={slowest_down:?}",
        loaded.len(),
        down.len()
    );
    for (path, took, reply) in &down {
        reply.assert_problem(503, "store-unavailable");
        assert!(*took < DOWN_BOUND, "{path} took {took:?} while down");
        assert_eq!(upstream.executions(path), 0, "{path} reached the upstream");
    }
    for (path, _, reply) in &loaded {
        assert!(
            matches!(reply.status.as_u16(), 201 | 503),
            "{path}: {reply:?}"
        );
        if reply.status == 503 {
            reply.assert_problem(503, "store-unavailable");
        }
    }
    let paths = loaded.iter().map(|(path, _, _)| path.as_str());
    Executions::count(&upstream, paths).assert_at_most_once();
    assert!(
        statuses.get(&201).copied().unwrap_or(0) > 0,
        "the load was served"
    );
    // Completed before the crash: replays, from the database.
    let again = clients[2]
        .post_json(&proxy.url("/v1/before"), "before-crash", BODY)
        .await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed(), "{again:?}");
    assert_eq!(upstream.executions("/v1/before"), 1);
}

/// A proxy started while its database is not up waits for it (up to
/// `STARTUP_WAIT`) and serves once it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_opened_before_its_postgres_is_up_waits_for_it() {
    let mut postgres = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let c = on_postgres(&upstream, &postgres, "early");
    tokio::task::block_in_place(|| postgres.crash());
    let opening = tokio::spawn({
        let store = c.store.clone();
        async move { idemproxy::store::postgres::open(&store).await }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !opening.is_finished(),
        "gave up while the database was down"
    );
    tokio::task::block_in_place(|| postgres.restart());
    let store = opening.await.expect("join").expect("opened once up");
    store.ping().await.expect("ping");
}

/// The sweep deletes expired rows, in batches of up to 1,000, and leaves
/// live ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_expired_rows_in_batches_and_keeps_live_ones() {
    let postgres = postgres_server::shared();
    let prefix = postgres_server::unique_prefix("sweep");
    let config = StoreSettings {
        kind: idemproxy::config::StoreKind::Postgres,
        url: postgres.url(),
        table_prefix: prefix.clone(),
        ..StoreSettings::default()
    };
    let store = PostgresStore::connect(&config).await.expect("connect");
    let live = new_key();
    let token = store
        .begin(&support::store_fixtures::begin(
            live,
            1,
            Duration::from_secs(30),
            idemproxy::store::OnStale::Store,
        ))
        .await
        .expect("begin");
    let idemproxy::store::BeginOutcome::Acquired { token, .. } = token else {
        panic!("claimed: {token:?}");
    };
    store
        .complete(&live, token, &completed(1, Duration::from_secs(3600)))
        .await
        .expect("complete");
    // 2,500 rows expired a minute ago, written behind the store's back.
    let expired = idemproxy::core::now_millis() - 60_000;
    tokio::task::block_in_place(|| {
        postgres.sql(&format!(
            "INSERT INTO {prefix}records (key, pending, token, lease_expires_at, expires_at, value) \
             SELECT sha256(int4send(i)), false, '\\x00'::bytea, 0, {expired}, '\\x01'::bytea \
             FROM generate_series(1, 2500) AS i"
        ))
    });
    let purged = store.purge_expired().await.expect("sweep");
    assert_eq!(purged, 2500);
    let left = tokio::task::block_in_place(|| {
        postgres.sql(&format!("SELECT count(*) FROM {prefix}records"))
    });
    assert_eq!(left.trim(), "1");
    assert!(store.get(&live).await.expect("get").is_some());
    assert_eq!(store.purge_expired().await.expect("sweep"), 0);
}

/// A primary with a synchronous standby (`synchronous_standby_names = '*'`,
/// `synchronous_commit = on`: a commit returns once the standby has it on
/// disk) crashes mid-traffic and the standby is promoted: the proxy, given
/// both hosts with `target_session_attrs=read-write`, fails closed while
/// neither takes writes, then serves from the new primary, where every
/// request answered before the crash replays; nothing executed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_promoted_mid_traffic_keeps_every_answered_record() {
    let mut primary =
        PostgresServer::start_with(&["synchronous_standby_names=*", "synchronous_commit=on"]);
    let standby = tokio::task::block_in_place(|| PostgresServer::standby_of(&primary));
    let deadline = Instant::now() + Duration::from_secs(15);
    while tokio::task::block_in_place(|| primary.sql("SELECT sync_state FROM pg_stat_replication"))
        .trim()
        != "sync"
    {
        assert!(
            Instant::now() < deadline,
            "the standby never streamed in sync"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let upstream = TestUpstream::start().await;
    let mut c = on_postgres(&upstream, &primary, "promote");
    c.store.url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port(),
        standby.port()
    );
    let proxy = ProxyProcess::start(c).await;
    let clients: Vec<TestClient> = (0..4).map(|_| TestClient::new()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let running = load(&proxy, &clients, &stop);
    tokio::time::sleep(Duration::from_millis(800)).await;
    tokio::task::block_in_place(|| {
        primary.crash();
        standby.promote();
    });
    wait_ready(&proxy, &clients[0]).await;
    let after = clients[0]
        .post_json(&proxy.url("/v1/after"), "after-promotion", BODY)
        .await;
    assert_eq!(after.status, 201, "{after:?}\n{}", proxy.logs());
    stop.store(true, Ordering::SeqCst);
    let loaded: Vec<_> = running.join_all().await.into_iter().flatten().collect();
    let answered: Vec<_> = loaded.iter().filter(|(_, _, r)| r.status == 201).collect();
    println!(
        "postgres promotion: load={} answered={} refused={}",
        loaded.len(),
        answered.len(),
        loaded.iter().filter(|(_, _, r)| r.status == 503).count()
    );
    assert!(!answered.is_empty(), "the load was served");
    for (path, _, reply) in &loaded {
        assert!(
            matches!(reply.status.as_u16(), 201 | 503),
            "{path}: {reply:?}"
        );
    }
    for (i, (path, _, _)) in answered.iter().enumerate() {
        let key = format!("load-{}", path.trim_start_matches("/v1/load/"));
        let again = clients[i % 4].post_json(&proxy.url(path), &key, BODY).await;
        assert_eq!(again.status, 201, "{path}: {again:?}");
        assert!(
            again.replayed(),
            "{path} was lost in the promotion: {again:?}"
        );
    }
    let paths = loaded.iter().map(|(path, _, _)| path.as_str());
    Executions::count(&upstream, paths).assert_at_most_once();
}

/// `pool_size` bounds a proxy's traffic connections however many traffic
/// threads it runs: each thread keeps its own share of it
/// (`store/postgres/pools.rs`). Traffic connections are those whose last
/// statement was a claim or a completion; the shared pool (start-up, the
/// sweep, readiness pings) and the `LISTEN` connection run others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_traffic_threads_split_pool_size_between_them() {
    let postgres = tokio::task::block_in_place(PostgresServer::start);
    let upstream = TestUpstream::start().await;
    let mut c = on_postgres(&upstream, &postgres, "pools");
    c.workers = 2;
    // Odd, so that a split rounded up (2 + 2) would exceed it.
    c.store.pool_size = 3;
    let proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();
    wait_ready(&proxy, &client).await;

    // Rounds of 48 first executions at once, so that each thread has
    // several store calls waiting together and opens all it may.
    let mut most = 0;
    for round in 0..3 {
        let mut set = JoinSet::new();
        for i in 0..48 {
            let (client, url) = (client.clone(), proxy.url(&format!("/v1/pools/{round}-{i}")));
            set.spawn(async move {
                client
                    .post_json(&url, &format!("pools-{round}-{i}"), BODY)
                    .await
            });
        }
        for reply in set.join_all().await {
            assert_eq!(reply.status, 201, "{reply:?}");
        }
        let traffic = tokio::task::block_in_place(|| {
            postgres.sql(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemproxy' \
                 AND (query LIKE 'INSERT%' OR query LIKE 'UPDATE%')",
            )
        });
        most = most.max(traffic.trim().parse::<usize>().expect("a count"));
    }
    assert!(most >= 1, "no traffic connection seen");
    assert!(
        most <= 3,
        "{most} traffic connections for pool_size = 3 over 2 threads"
    );
}
