//! Fault injection on the PostgreSQL store: the database behind a real
//! `idemproxy` process crashes (immediate shutdown) under load and comes
//! back on the same port and data; a streaming standby is promoted
//! mid-traffic. While the store is gone, covered requests are answered 503
//! `store-unavailable` quickly and never reach the upstream; once it is
//! back, the same proxy process serves again (the first request after it),
//! and keys completed before still replay. Also: the sweep deletes expired
//! rows in batches; a row another session holds locked fails only its own
//! key, and a call given up on mid-statement hands its connection to no
//! other call (PostgreSQL's `lock_timeout` and `statement_timeout`, and the
//! store's reclaiming of such connections: `store/postgres/conn.rs`).

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
    let live = completed_key(&store).await;
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

/// A connection of the test's own, outside any store, driven in a task.
async fn side_connection(postgres: &PostgresServer) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&postgres.url(), tokio_postgres::NoTls)
        .await
        .expect("connect to postgres");
    tokio::spawn(connection);
    client
}

/// Holds every row of `prefix`'s table locked (`SELECT … FOR UPDATE` in a
/// transaction left open, as an operator's session might) until dropped.
async fn lock_rows(postgres: &PostgresServer, prefix: &str) -> tokio_postgres::Client {
    let locker = side_connection(postgres).await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT key FROM {prefix}records FOR UPDATE"
        ))
        .await
        .expect("lock the rows");
    locker
}

/// How many statements on `prefix`'s table wait for a lock now.
async fn waiting_on_locks(observer: &tokio_postgres::Client, prefix: &str) -> i64 {
    // A statement of its own each time: pg_stat_activity is read once per
    // transaction.
    observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || 'records%'",
            &[&prefix],
        )
        .await
        .expect("read pg_stat_activity")
        .get(0)
}

/// Polls until no statement on `prefix`'s table waits for a lock, for at
/// most `within`; returns how long that took.
async fn until_none_waits(
    observer: &tokio_postgres::Client,
    prefix: &str,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        let waiting = waiting_on_locks(observer, prefix).await;
        if waiting == 0 {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "{waiting} statements of the store still wait on the locked row after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Rows held locked by another session (an operator's `SELECT … FOR
/// UPDATE` left open) cost their own keys a fast 503, nothing executed,
/// and nothing else: fresh keys through the same proxy, on a pool of two
/// connections, keep being served. PostgreSQL ends each claim waiting on
/// a locked row after `store.timeout` (`lock_timeout`), so none keeps its
/// connection, with the calls queued behind it, until the lock goes (two
/// keys: the proxy has one `begin` of a key in flight at a time, and two
/// such would hold the whole pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_rows_fail_their_own_keys_fast_and_fresh_keys_keep_being_served() {
    let postgres = tokio::task::block_in_place(postgres_server::shared);
    let upstream = TestUpstream::start().await;
    let prefix = postgres_server::unique_prefix("locked");
    let mut c = postgres_config(&upstream.url(), &postgres.url(), &prefix);
    // Some patience for a loaded machine (PostgreSQL's limits follow it).
    c.store.timeout = Duration::from_millis(400);
    // One traffic thread, so one pool holds both connections.
    c.workers = 1;
    c.store.pool_size = 2;
    let store: idemproxy::store::SharedStore =
        Arc::new(PostgresStore::connect(&c.store).await.expect("connect"));
    let proxy = support::proxy::TestProxy::start_with_store(c.clone(), store).await;
    let client = TestClient::new();
    for n in 0..2 {
        let path = format!("/v1/locked/{n}");
        let first = client
            .post_json(&proxy.url(&path), &format!("locked-{n}"), BODY)
            .await;
        assert_eq!(first.status, 201, "{first:?}");
    }

    let locker = lock_rows(postgres, &prefix).await;
    let observer = side_connection(postgres).await;
    let retries = {
        let (client, proxy_url) = (client.clone(), proxy.url("/v1/locked"));
        tokio::spawn(async move {
            let mut took = Vec::new();
            for n in [0, 1, 0, 1] {
                let sent = Instant::now();
                let url = format!("{proxy_url}/{n}");
                let reply = client.post_json(&url, &format!("locked-{n}"), BODY).await;
                took.push((sent.elapsed(), reply));
            }
            took
        })
    };
    let mut fresh = Vec::new();
    while !retries.is_finished() {
        let n = fresh.len();
        let reply = client
            .post_json(
                &proxy.url(&format!("/v1/fresh/{n}")),
                &format!("fresh-{n}"),
                BODY,
            )
            .await;
        fresh.push(reply);
        // A steady trickle, not a flood that starves the tests beside it.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let retried = retries.await.expect("join");
    let mut statuses = std::collections::BTreeMap::new();
    for reply in &fresh {
        *statuses.entry(reply.status.as_u16()).or_insert(0) += 1;
    }
    println!(
        "locked rows: retries took {:?}; fresh keys meanwhile: {statuses:?}",
        retried.iter().map(|(took, _)| *took).collect::<Vec<_>>(),
    );
    for (took, reply) in &retried {
        reply.assert_problem(503, "store-unavailable");
        assert!(
            *took < c.store.timeout + Duration::from_millis(600),
            "a retry of a locked key took {took:?}"
        );
    }
    for n in 0..2 {
        let path = format!("/v1/locked/{n}");
        assert_eq!(upstream.executions(&path), 1, "{path} ran again");
    }
    assert!(
        fresh.len() >= 4,
        "only {} fresh keys in the meantime",
        fresh.len()
    );
    for (n, reply) in fresh.iter().enumerate() {
        assert_eq!(
            reply.status, 201,
            "fresh key {n} behind the locked rows: {reply:?}"
        );
    }
    until_none_waits(&observer, &prefix, c.store.timeout + Duration::from_secs(1)).await;
    // Once the lock goes, the keys replay as before.
    drop(locker);
    let after = client
        .post_json(&proxy.url("/v1/locked/0"), "locked-0", BODY)
        .await;
    assert_eq!(after.status, 201, "{after:?}");
    assert!(after.replayed(), "{after:?}");
}

/// A store call dropped mid-statement (its caller's timeout) hands its
/// connection to no other call: the next call, on another key, is served
/// at once on another connection instead of queueing behind a statement
/// that waits on a locked row; and the statement given up on ends on the
/// server within `store.timeout` (`lock_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_mid_statement_hands_its_connection_to_no_other_call() {
    let postgres = tokio::task::block_in_place(postgres_server::shared);
    let prefix = postgres_server::unique_prefix("dropped");
    // PostgreSQL's own limits follow it: long enough that a call served on
    // the dropped call's connection could not be served in time.
    let timeout = Duration::from_secs(1);
    let (store, locked, locker, observer) =
        a_locked_row(postgres, &prefix, postgres.url(), timeout).await;

    // Given up on well before PostgreSQL's own limit would end it.
    let given_up =
        tokio::time::timeout(Duration::from_millis(100), store.begin(&claim(locked))).await;
    assert!(given_up.is_err(), "answered under a row lock: {given_up:?}");
    let dropped_at = Instant::now();
    assert_eq!(
        waiting_on_locks(&observer, &prefix).await,
        1,
        "the dropped claim still waits on the server"
    );
    let served =
        tokio::time::timeout(Duration::from_millis(400), store.begin(&claim(new_key()))).await;
    assert!(
        matches!(
            served,
            Ok(Ok(idemproxy::store::BeginOutcome::Acquired { .. }))
        ),
        "a fresh key behind the dropped call's connection: {served:?}"
    );
    until_none_waits(&observer, &prefix, timeout + Duration::from_secs(1)).await;
    println!(
        "dropped call: its statement ended {:?} after it was given up on",
        dropped_at.elapsed()
    );
    // Not dropped: PostgreSQL answers the claim an error after its
    // lock_timeout, and the call fails closed.
    let started = Instant::now();
    let waited = store.begin(&claim(locked)).await;
    let took = started.elapsed();
    match waited {
        Err(idemproxy::store::StoreError::Unavailable(why)) => {
            assert!(why.contains("55P03"), "not a lock timeout: {why}")
        }
        other => panic!("a claim under a row lock: {other:?}"),
    }
    assert!(
        took >= timeout && took < timeout + Duration::from_millis(600),
        "the lock was waited on for {took:?}"
    );
    drop(locker);
    // Both connections serve again, the one given up on among them.
    let (one, two) = (claim(new_key()), claim(new_key()));
    let both = tokio::time::timeout(
        timeout,
        futures_util::future::join(store.begin(&one), store.begin(&two)),
    )
    .await;
    assert!(matches!(both, Ok((Ok(_), Ok(_)))), "{both:?}");
}

/// With PostgreSQL's limits turned off (`options` in the URL, which win
/// over the store's), a statement given up on that never ends by itself is
/// cancelled once the store has waited `max(4 × store.timeout, 1 s)`, and
/// its connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_given_up_on_that_never_ends_is_cancelled() {
    let postgres = tokio::task::block_in_place(postgres_server::shared);
    let prefix = postgres_server::unique_prefix("cancel");
    let url = format!(
        "{}?options=-c%20lock_timeout%3D0%20-c%20statement_timeout%3D0",
        postgres.url()
    );
    let timeout = Duration::from_millis(250);
    let (store, locked, locker, observer) = a_locked_row(postgres, &prefix, url, timeout).await;

    let given_up = tokio::time::timeout(timeout, store.begin(&claim(locked))).await;
    assert!(given_up.is_err(), "answered under a row lock: {given_up:?}");
    let dropped_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        waiting_on_locks(&observer, &prefix).await,
        1,
        "the URL's options did not turn lock_timeout off"
    );
    until_none_waits(&observer, &prefix, Duration::from_secs(3)).await;
    let ended = dropped_at.elapsed();
    println!("never-ending statement: cancelled {ended:?} after it was given up on");
    assert!(
        ended >= Duration::from_millis(900),
        "cancelled after {ended:?}"
    );
    drop(locker);
}

/// A store on `url` (tables under `prefix`, calls bounded by `timeout`,
/// two connections) with one completed key whose row another session
/// holds locked: the store, the key, the locking session (dropped, it lets
/// go) and a session to watch the server from.
async fn a_locked_row(
    postgres: &PostgresServer,
    prefix: &str,
    url: String,
    timeout: Duration,
) -> (
    PostgresStore,
    idemproxy::core::RecordKey,
    tokio_postgres::Client,
    tokio_postgres::Client,
) {
    let config = StoreSettings {
        kind: idemproxy::config::StoreKind::Postgres,
        url,
        table_prefix: prefix.to_owned(),
        timeout,
        pool_size: 2,
        ..StoreSettings::default()
    };
    let store = PostgresStore::connect(&config).await.expect("connect");
    let locked = completed_key(&store).await;
    let locker = lock_rows(postgres, prefix).await;
    let observer = side_connection(postgres).await;
    (store, locked, locker, observer)
}

/// A `begin` of `key` by a request of its own, with a 30 s lease.
fn claim(key: idemproxy::core::RecordKey) -> idemproxy::store::Begin {
    support::store_fixtures::begin(
        key,
        1,
        Duration::from_secs(30),
        idemproxy::store::OnStale::Store,
    )
}

/// A key whose record is completed in `store`.
async fn completed_key(store: &PostgresStore) -> idemproxy::core::RecordKey {
    let key = new_key();
    let begun = store.begin(&claim(key)).await.expect("begin");
    let idemproxy::store::BeginOutcome::Acquired { token, .. } = begun else {
        panic!("claimed: {begun:?}");
    };
    store
        .complete(&key, token, &completed(1, Duration::from_secs(3600)))
        .await
        .expect("complete");
    key
}
