//! The Redis stores beyond the shared contract (`tests/store_contract.rs`):
//! fencing across proxies, credentials, database selection, TLS, the key
//! layout on a cluster, expiry, corrupt values, a Redis that dies and comes
//! back, and the number of Redis commands per request.
//!
//! Every test runs its own `redis-server` processes (tests/support), never
//! the machine's shared Redis.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemproxy::config::{StoreKind, StoreSettings};
use idemproxy::core::{
    now_millis, Clock, CompletedRecord, FencingToken, KeyState, Outcome, Record, RecordKey,
    UnknownCause,
};
use idemproxy::store::redis::{open, redis_key};
use idemproxy::store::{
    BeginOutcome, CachedStore, OnStale, RedisStore, Removal, Removed, ScanCursor, Store, StoreError,
};

use crate::support::{redis_server, store_fixtures};

use redis_server::{RedisCluster, RedisOptions, RedisServer, TlsFiles};
use store_fixtures::{begin, new_key, walk, TTL};

/// A completed record that lives the default TTL.
fn completed(fingerprint: u8) -> CompletedRecord {
    store_fixtures::completed(fingerprint, TTL)
}

const LEASE: Duration = Duration::from_secs(30);
fn config(url: String) -> StoreSettings {
    StoreSettings {
        kind: StoreKind::Redis,
        url,
        key_prefix: redis_server::unique_prefix("redis"),
        ..StoreSettings::default()
    }
}

async fn connect(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&config(server.url()))
        .await
        .expect("connect to redis")
}

async fn claim(store: &dyn Store, key: RecordKey, lease: Duration) -> FencingToken {
    match store
        .begin(&begin(key, 1, lease, OnStale::Store))
        .await
        .expect("begin")
    {
        BeginOutcome::Acquired { token, .. } => token,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// A new key, claimed and completed with fingerprint 1.
async fn completed_key(store: &RedisStore) -> RecordKey {
    let key = new_key();
    let token = claim(store, key, LEASE).await;
    store
        .complete(&key, token, &completed(1))
        .await
        .expect("complete");
    key
}

fn assert_corrupt<T: std::fmt::Debug>(what: &str, result: Result<T, StoreError>) {
    assert!(
        matches!(result, Err(StoreError::Corrupt(_))),
        "{what}: expected Corrupt, got {result:?}"
    );
}

/// A plain connection for poking at what the store wrote.
async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis_server::connection(url).await
}

async fn pttl(url: &str, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut raw(url).await)
        .await
        .expect("PTTL")
}

/// The value under `key`, as the store wrote it.
async fn stored_value(server: &RedisServer, key: &str) -> Vec<u8> {
    let value: Option<Vec<u8>> = redis::cmd("GET")
        .arg(key)
        .query_async(&mut raw(&server.url()).await)
        .await
        .expect("GET");
    value.unwrap_or_else(|| panic!("{key} holds nothing"))
}

/// The state byte leading a stored record: `p` pending, `c` completed.
async fn state_byte(server: &RedisServer, key: &str) -> u8 {
    stored_value(server, key).await[0]
}

fn assert_about(what: &str, actual: i64, expected: Duration) {
    let expected = expected.as_millis() as i64;
    assert!(
        actual <= expected && actual > expected - 5_000,
        "{what}: PTTL {actual} ms, expected about {expected} ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_lease_expired_is_fenced_out_by_the_new_owner() {
    let server = RedisServer::start();
    let config = config(server.url());
    // Two proxies sharing one Redis.
    let a = RedisStore::connect(&config).await.expect("connect a");
    let b = RedisStore::connect(&config).await.expect("connect b");
    let key = new_key();
    let stale = claim(&a, key, Duration::from_millis(200)).await;

    tokio::time::sleep(Duration::from_millis(350)).await;
    let fresh = match b
        .begin(&begin(key, 1, LEASE, OnStale::Retry))
        .await
        .expect("begin")
    {
        BeginOutcome::Acquired {
            token,
            took_over: true,
            ..
        } => token,
        other => panic!("expected a takeover, got {other:?}"),
    };

    let result = a.complete(&key, stale, &completed(1)).await;
    assert!(matches!(result, Err(StoreError::Fenced)), "{result:?}");
    let result = a.release(&key, stale).await;
    assert!(matches!(result, Err(StoreError::Fenced)), "{result:?}");
    let Some(Record::Pending(pending)) = a.get(&key).await.expect("get") else {
        panic!("the new claim stands");
    };
    assert_eq!(pending.token, fresh);

    let record = completed(1);
    b.complete(&key, fresh, &record).await.expect("complete");
    assert_eq!(
        a.begin(&begin(key, 1, LEASE, OnStale::Retry))
            .await
            .expect("begin"),
        BeginOutcome::Completed(record.into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_from_env_acl_users_and_wrong_passwords() {
    let server = RedisServer::start_with(RedisOptions {
        requirepass: Some("default-secret".into()),
        users: vec![("proxy".into(), "proxy-secret".into())],
        ..RedisOptions::default()
    });

    // The default user, password read from the variable `password_env`
    // names (set by .cargo/config.toml: setting it here would race with the
    // other threads reading the environment).
    let var = "TEST_REDIS_DEFAULT_PASSWORD";
    assert_eq!(
        std::env::var(var).as_deref(),
        Ok("default-secret"),
        "set in .cargo/config.toml"
    );
    let from_env = StoreSettings {
        password_env: Some(var.into()),
        ..config(server.url())
    };
    let store = RedisStore::connect(&from_env)
        .await
        .expect("connect with password_env");
    store.ping().await.expect("ping");
    claim(&store, new_key(), LEASE).await;

    // An ACL user: from the config, and from the URL.
    let acl = StoreSettings {
        username: Some("proxy".into()),
        password: Some("proxy-secret".into()),
        ..config(server.url())
    };
    let store = RedisStore::connect(&acl).await.expect("connect as proxy");
    claim(&store, new_key(), LEASE).await;
    let in_url = config(format!(
        "redis://proxy:proxy-secret@127.0.0.1:{}",
        server.port()
    ));
    let store = RedisStore::connect(&in_url)
        .await
        .expect("connect with the URL's credentials");
    claim(&store, new_key(), LEASE).await;

    // Wrong or missing credentials fail at connect, and say why.
    for (what, bad) in [
        (
            "wrong password",
            StoreSettings {
                password: Some("nope".into()),
                ..config(server.url())
            },
        ),
        (
            "wrong ACL password",
            StoreSettings {
                username: Some("proxy".into()),
                password: Some("nope".into()),
                ..config(server.url())
            },
        ),
        ("no password", config(server.url())),
    ] {
        let started = Instant::now();
        match RedisStore::connect(&bad).await {
            Err(StoreError::Unavailable(message)) => {
                println!("{what}: {message}");
                let lower = message.to_lowercase();
                assert!(
                    lower.contains("pass") || lower.contains("auth"),
                    "{what}: the error names the credentials: {message}"
                );
                assert!(!message.contains("nope"), "no password in messages");
            }
            other => panic!("{what}: expected Unavailable, got {other:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: fails fast"
        );
    }

    // A variable that is not set is a clear error too.
    let unset = "TEST_REDIS_PASSWORD_NOBODY_SETS";
    let from_unset = StoreSettings {
        password_env: Some(unset.into()),
        ..config(server.url())
    };
    match RedisStore::connect(&from_unset).await {
        Err(StoreError::Unavailable(message)) => assert!(message.contains(unset), "{message}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_selection() {
    let server = RedisServer::start();
    let in_config = StoreSettings {
        database: Some(3),
        ..config(server.url())
    };
    let in_url = config(format!("{}/5", server.url()));
    for (store_config, db) in [(in_config, "3"), (in_url, "5")] {
        let store = RedisStore::connect(&store_config).await.expect("connect");
        let key = new_key();
        claim(&store, key, LEASE).await;
        let name = store.redis_key(&key);
        assert_eq!(server.cli(&["-n", db, "exists", &name]).trim(), "1");
        assert_eq!(server.cli(&["-n", "0", "exists", &name]).trim(), "0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_strings_under_prefix_and_hash_tag_with_their_expiry() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let prefix = store.key_prefix().to_string();
    let key = new_key();
    let name = format!("{prefix}{{{}}}", key.to_hex());
    assert_eq!(store.redis_key(&key), name);
    assert_eq!(redis_key(&prefix, &key), name);

    // Pending: kept for lease + ttl, not just the lease.
    let token = claim(&store, key, LEASE).await;
    let keys = server.cli(&["--raw", "keys", &format!("{prefix}*")]);
    assert_eq!(keys.trim(), name, "one key per record");
    assert_eq!(server.cli(&["type", &name]).trim(), "string");
    assert_eq!(state_byte(&server, &name).await, b'p');
    assert_about("pending", pttl(&server.url(), &name).await, LEASE + TTL);

    // Completed: kept until its expires_at.
    let mut record = completed(1);
    record.expires_at = now_millis() + 600_000;
    store
        .complete(&key, token, &record)
        .await
        .expect("complete");
    assert_eq!(state_byte(&server, &name).await, b'c');
    assert_about(
        "completed",
        pttl(&server.url(), &name).await,
        Duration::from_secs(600),
    );

    // A stale claim settled fail-closed: kept for ttl from the settlement.
    let stale = new_key();
    let stale_name = store.redis_key(&stale);
    claim(&store, stale, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let settled = match store
        .begin(&begin(stale, 1, LEASE, OnStale::Store))
        .await
        .expect("begin")
    {
        BeginOutcome::Settled(record) => record,
        other => panic!("expected the stale claim settled, got {other:?}"),
    };
    assert_eq!(
        settled.outcome,
        Outcome::Unknown {
            cause: UnknownCause::Abandoned
        }
    );
    assert_eq!(state_byte(&server, &stale_name).await, b'c');
    assert_about("settled", pttl(&server.url(), &stale_name).await, TTL);
    assert_eq!(
        store.get(&stale).await.expect("get"),
        Some(Record::Completed((*settled).clone()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_expired_by_the_proxies_clock_is_replaced_even_if_redis_keeps_it() {
    let server = RedisServer::start();
    let c = config(server.url());
    let writer = RedisStore::connect(&c).await.expect("connect to redis");
    let key = new_key();
    let name = writer.redis_key(&key);
    let mut short = begin(key, 1, Duration::from_millis(50), OnStale::Store);
    short.ttl = Duration::from_secs(10);
    let old = match writer.begin(&short).await.expect("begin") {
        BeginOutcome::Acquired { token, .. } => token,
        other => panic!("expected Acquired, got {other:?}"),
    };
    // Redis would reclaim it at the same instant; PERSIST stands for a Redis
    // whose clock runs behind the proxies'. The proxy from here on is one
    // whose clock is past the record's expiry (a clock, not a sleep: Redis
    // must not drop the record before PERSIST, however slow the machine).
    assert_eq!(server.cli(&["persist", &name]).trim(), "1");
    let store = RedisStore::connect(&c)
        .await
        .expect("connect to redis")
        .with_clock(Clock::tokio_from(now_millis() + 11_000));
    assert_eq!(store.get(&key).await.expect("get"), None);

    // A different request may claim it: the old record is gone for good.
    let new = match store
        .begin(&begin(key, 2, LEASE, OnStale::Store))
        .await
        .expect("begin")
    {
        BeginOutcome::Acquired {
            token, took_over, ..
        } => {
            assert!(!took_over, "an expired record is absent, not taken over");
            token
        }
        other => panic!("expected Acquired, got {other:?}"),
    };
    assert_ne!(new, old);
    assert_about(
        "the new claim",
        pttl(&server.url(), &name).await,
        LEASE + TTL,
    );
    assert!(matches!(
        store.complete(&key, old, &completed(1)).await,
        Err(StoreError::Fenced)
    ));
    store
        .complete(&key, new, &completed(2))
        .await
        .expect("complete");
}

/// Every begin that finds a dead holder's claim wants to replace it; the
/// replacement is a compare-and-swap, so exactly one of them does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_begins_on_a_stale_claim_replace_it_once() {
    let server = RedisServer::start();
    let store = Arc::new(connect(&server).await);
    for on_stale in [OnStale::Retry, OnStale::Store] {
        let key = new_key();
        claim(&*store, key, Duration::from_millis(50)).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
        let racers: Vec<_> = (0..16)
            .map(|_| {
                let store = Arc::clone(&store);
                tokio::spawn(async move { store.begin(&begin(key, 1, LEASE, on_stale)).await })
            })
            .collect();
        let (mut replaced, mut others) = (0, Vec::new());
        for racer in racers {
            match racer.await.expect("join").expect("begin") {
                BeginOutcome::Acquired {
                    took_over: true, ..
                } if on_stale == OnStale::Retry => replaced += 1,
                BeginOutcome::Settled(_) if on_stale == OnStale::Store => replaced += 1,
                other => others.push(other),
            }
        }
        assert_eq!(replaced, 1, "{on_stale:?}: the others saw {others:?}");
        for other in others {
            match (on_stale, other) {
                (OnStale::Retry, BeginOutcome::InFlight { .. })
                | (OnStale::Store, BeginOutcome::Completed(_)) => {}
                (_, other) => panic!("{on_stale:?}: unexpected {other:?}"),
            }
        }
    }
}

/// A key that other writers change under every compare-and-swap is busy, not
/// a failed store: `begin` answers in flight, never `Unavailable`, which
/// `on_store_error = "pass"` would forward unprotected while others
/// are claiming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_changing_under_every_swap_is_in_flight_not_unavailable() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    // Dead holders' claims to write over the key, each with its own token
    // and so its own bytes: a swap compares bytes.
    let mut stale = Vec::new();
    for _ in 0..64 {
        let other = new_key();
        claim(&store, other, Duration::from_millis(1)).await;
        stale.push(stored_value(&server, &store.redis_key(&other)).await);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let stale = Arc::new(stale);
    let key = new_key();
    let name = store.redis_key(&key);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for offset in 0..4 {
        let (stale, name, stop) = (Arc::clone(&stale), name.clone(), Arc::clone(&stop));
        let mut conn = raw(&server.url()).await;
        writers.push(tokio::spawn(async move {
            let mut written = offset * 17;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut pipe = redis::pipe();
                for _ in 0..31 {
                    pipe.cmd("SET")
                        .arg(&name)
                        .arg(&stale[written % stale.len()])
                        .ignore();
                    written += 1;
                }
                let () = pipe.query_async(&mut conn).await.expect("SET");
            }
        }));
    }

    let mut outcomes = BTreeMap::new();
    for _ in 0..100 {
        let outcome = match store.begin(&begin(key, 1, LEASE, OnStale::Retry)).await {
            Ok(BeginOutcome::Acquired {
                took_over: true, ..
            }) => "took the stale claim over",
            // At once, or when the live claim of an earlier begin (read
            // last, before a writer overwrote it) ends.
            Ok(BeginOutcome::InFlight { lease_expires_at }) => {
                assert!(
                    lease_expires_at <= now_millis() + LEASE.as_millis() as u64,
                    "retry within a lease"
                );
                "in flight"
            }
            other => panic!("expected a takeover or in flight, got {other:?}"),
        };
        *outcomes.entry(outcome).or_insert(0) += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for writer in writers {
        writer.await.expect("writer");
    }
    assert!(
        outcomes.contains_key("in flight"),
        "the writers never changed the key under every swap of one begin: {outcomes:?}"
    );
}

/// A caller that stops waiting for `remove` (the admin API's timeout) must
/// not cancel the announcement that follows the deletion: the other
/// replicas' caches would replay the record for up to a minute.
///
/// One thread: the removal's task cannot run before the test yields, so
/// the first poll is always before Redis could answer. (On two worker
/// threads a loaded machine could preempt the test between the spawn and
/// the poll, and the removal finished first: seen in CI.)
#[tokio::test]
async fn a_removal_given_up_on_is_still_announced() {
    use futures_util::StreamExt;
    let server = RedisServer::start();
    let store = connect(&server).await;
    let key = completed_key(&store).await;
    let client = redis::Client::open(server.url()).expect("redis url");
    let (mut sink, mut heard) = client
        .get_async_pubsub()
        .await
        .expect("pubsub connection")
        .split();
    sink.subscribe(format!("{}removed", store.key_prefix()))
        .await
        .expect("subscribe");

    // Given up on after its first poll, before Redis could answer.
    let given_up = futures_util::FutureExt::now_or_never(store.remove(&key, Removal::Any));
    assert!(given_up.is_none(), "answered at once: {given_up:?}");
    let message = tokio::time::timeout(Duration::from_secs(5), heard.next())
        .await
        .expect("the removal is announced")
        .expect("subscribed");
    assert_eq!(message.get_payload_bytes(), &key.as_bytes()[..]);
    assert_eq!(store.get(&key).await.expect("get"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_values_are_reported_not_fatal() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let url = server.url();
    let mut conn = raw(&url).await;

    // A completed record whose bytes are garbage, and one from a future
    // format version, behind a valid header.
    let unreadable: [(&str, &[u8]); 2] = [
        ("garbage", b"\x01garbage"),
        ("a future version", &[99, 1, 2, 3]),
    ];
    let mut unreadable_keys = Vec::new();
    for (what, rec) in unreadable {
        let key = new_key();
        unreadable_keys.push(key);
        let token = claim(&store, key, LEASE).await;
        store
            .complete(&key, token, &completed(1))
            .await
            .expect("complete");
        let name = store.redis_key(&key);
        let mut value = stored_value(&server, &name).await;
        value.truncate(25);
        value.extend_from_slice(rec);
        let _: () = redis::cmd("SET")
            .arg(&name)
            .arg(value)
            .query_async(&mut conn)
            .await
            .expect("SET");
        assert_corrupt(
            &format!("begin of {what}"),
            store.begin(&begin(key, 1, LEASE, OnStale::Store)).await,
        );
        assert_corrupt(&format!("get of {what}"), store.get(&key).await);
    }

    // A string that is no record, and a hash (the layout of earlier builds).
    let string = new_key();
    let _: () = redis::cmd("SET")
        .arg(store.redis_key(&string))
        .arg("hello")
        .query_async(&mut conn)
        .await
        .expect("SET");
    let strange = new_key();
    let _: () = redis::cmd("HSET")
        .arg(store.redis_key(&strange))
        .arg("st")
        .arg("x")
        .arg("fp")
        .arg("short")
        .query_async(&mut conn)
        .await
        .expect("HSET");
    for (what, key) in [("a string", string), ("a hash", strange)] {
        assert_corrupt(
            &format!("begin of {what}"),
            store.begin(&begin(key, 1, LEASE, OnStale::Store)).await,
        );
        assert_corrupt(&format!("get of {what}"), store.get(&key).await);
    }
    let token = FencingToken::random();
    assert_corrupt(
        "complete of a string",
        store.complete(&string, token, &completed(1)).await,
    );
    assert_corrupt("release of a string", store.release(&string, token).await);
    assert_corrupt(
        "complete of a hash",
        store.complete(&strange, token, &completed(1)).await,
    );

    // A walk reads past them, and lists each apart with why: one bad value
    // neither hides the others nor ends the walk.
    let good = new_key();
    let token = claim(&store, good, LEASE).await;
    store
        .complete(&good, token, &completed(1))
        .await
        .expect("complete");
    let (read, listed) = walk(&store).await;
    assert_eq!(read, [good].into(), "the record that reads");
    let mut expected: Vec<_> = unreadable_keys
        .iter()
        .copied()
        .chain([string, strange])
        .collect();
    expected.sort();
    assert_eq!(listed.keys().copied().collect::<Vec<_>>(), expected);
    assert!(listed[&strange].contains("WRONGTYPE"), "{listed:?}");
    assert!(listed[&string].contains("not a record"), "{listed:?}");

    // Removing needs no decoding: it is how an operator clears them.
    for key in unreadable_keys.into_iter().chain([string, strange]) {
        assert_eq!(
            store.remove(&key, Removal::Any).await.expect("remove"),
            Removed::Deleted
        );
        assert_eq!(store.get(&key).await.expect("get"), None);
        claim(&store, key, LEASE).await;
    }
    store.ping().await.expect("ping");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_unavailable_quickly_and_the_store_recovers() {
    let mut server = RedisServer::start();
    let store = connect(&server).await;
    let key = new_key();
    claim(&store, key, LEASE).await;

    server.kill();
    let bound = Duration::from_secs(2);
    for round in 0..3 {
        let started = Instant::now();
        let outcomes = [
            tokio::time::timeout(
                bound,
                store.begin(&begin(new_key(), 1, LEASE, OnStale::Store)),
            )
            .await
            .map(|r| r.map(drop)),
            tokio::time::timeout(bound, store.get(&key))
                .await
                .map(|r| r.map(drop)),
            tokio::time::timeout(
                bound,
                store.complete(&key, FencingToken::random(), &completed(1)),
            )
            .await,
            tokio::time::timeout(bound, store.ping()).await,
        ];
        for outcome in outcomes {
            match outcome {
                Ok(Err(StoreError::Unavailable(message))) => {
                    if round == 0 {
                        println!("redis down: {message}");
                    }
                }
                Ok(other) => panic!("round {round}: expected Unavailable, got {other:?}"),
                Err(_) => panic!("round {round}: a call to a dead Redis hung past {bound:?}"),
            }
        }
        println!("round {round}: 4 calls failed in {:?}", started.elapsed());
    }

    server.restart();
    // The same store object: it reconnects by itself.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout(bound, store.ping()).await {
            Ok(Ok(())) => break,
            other => assert!(
                Instant::now() < deadline,
                "the store did not recover: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The restarted Redis kept nothing (no persistence in tests) and has no
    // scripts loaded: the store reloads them by itself.
    let key = new_key();
    let token = claim(&store, key, LEASE).await;
    let record = completed(1);
    store
        .complete(&key, token, &record)
        .await
        .expect("complete");
    assert_eq!(
        store
            .begin(&begin(key, 1, LEASE, OnStale::Store))
            .await
            .expect("begin"),
        BeginOutcome::Completed(record.into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_fails_connect_with_unavailable() {
    let port = redis_server::free_port();
    let started = Instant::now();
    match RedisStore::connect(&config(format!("redis://127.0.0.1:{port}"))).await {
        Err(StoreError::Unavailable(message)) => println!("nothing listening: {message}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// The proxy writes every call, so a Redis it cannot write to (here a
/// read-only replica) fails at startup, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_redis_fails_connect_with_its_reason() {
    // A master that never answers, on a port held for the whole test: a
    // port merely free could go to another test's Redis, which this replica
    // would then sync from, adding commands to that test's counts.
    let master = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the master's port");
    let master_port = master
        .local_addr()
        .expect("master address")
        .port()
        .to_string();
    let replica = RedisServer::start_with(RedisOptions {
        extra_args: vec!["--replicaof".into(), "127.0.0.1".into(), master_port],
        ..RedisOptions::default()
    });
    match RedisStore::connect(&config(replica.url())).await {
        Err(StoreError::Unavailable(message)) => {
            assert!(message.contains("read only replica"), "{message}");
            assert!(!message.contains("7.0"), "not a version problem: {message}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// `INFO commandstats` of `servers`, summed: command → calls.
fn commandstats(servers: &[&RedisServer]) -> BTreeMap<String, u64> {
    let mut stats = BTreeMap::new();
    for server in servers {
        for line in server.cli(&["info", "commandstats"]).lines() {
            let Some((name, rest)) = line.trim().split_once(':') else {
                continue;
            };
            let Some(name) = name.strip_prefix("cmdstat_") else {
                continue;
            };
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            *stats.entry(name.to_string()).or_insert(0) += calls;
        }
    }
    stats
}

/// The commands Redis ran between two snapshots, those the scripts ran
/// included. Commands of the measuring `redis-cli` and of cluster
/// housekeeping are left out.
fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    let mut ran = BTreeMap::new();
    for (name, calls) in after {
        let diff = calls - before.get(name).copied().unwrap_or(0);
        if diff == 0 || name == "info" || name.starts_with("cluster") || name.starts_with("command")
        {
            continue;
        }
        ran.insert(name.clone(), diff);
    }
    ran
}

/// Measures the Redis commands of a first request (begin + complete), of a
/// replay (begin) and of a release, on `servers` (all nodes of a cluster).
async fn measure_round_trips(label: &str, store: &RedisStore, servers: &[&RedisServer]) {
    let key = new_key();
    let before = commandstats(servers);
    let token = claim(store, key, LEASE).await;
    let record = completed(1);
    store
        .complete(&key, token, &record)
        .await
        .expect("complete");
    let middle = commandstats(servers);
    assert_eq!(
        store
            .begin(&begin(key, 1, LEASE, OnStale::Store))
            .await
            .expect("begin"),
        BeginOutcome::Completed(record.into())
    );
    let after = commandstats(servers);

    let first = delta(&before, &middle);
    let replay = delta(&middle, &after);
    println!("{label}: first request (begin + complete) ran {first:?}");
    println!("{label}: replay (begin) ran {replay:?}");
    let counts = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
        pairs.iter().map(|(c, n)| (c.to_string(), *n)).collect()
    };
    // begin: one SET NX GET on the free key. complete: one EVALSHA (no
    // NOSCRIPT reload), which runs a GET and a SET inside.
    assert_eq!(
        first,
        counts(&[("evalsha", 1), ("get", 1), ("set", 2)]),
        "{label}: commands of begin + complete on a free key"
    );
    assert_eq!(
        replay,
        counts(&[("set", 1)]),
        "{label}: a replay is one SET NX GET, no script"
    );

    // release: one EVALSHA, which runs a GET and a DEL inside.
    let released = new_key();
    let token = claim(store, released, LEASE).await;
    let before = commandstats(servers);
    store.release(&released, token).await.expect("release");
    let release = delta(&before, &commandstats(servers));
    println!("{label}: release ran {release:?}");
    assert_eq!(
        release,
        counts(&[("del", 1), ("evalsha", 1), ("get", 1)]),
        "{label}: commands of a release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_trip_per_state_change() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    measure_round_trips("redis", &store, &[&server]).await;

    // Behind the local replay cache, a replay does not reach Redis at all.
    let cached = CachedStore::new(Arc::new(store), 16);
    let key = new_key();
    let token = claim(&cached, key, LEASE).await;
    let record = completed(1);
    cached
        .complete(&key, token, &record)
        .await
        .expect("complete");
    let before = commandstats(&[&server]);
    for _ in 0..3 {
        assert_eq!(
            cached
                .begin(&begin(key, 1, LEASE, OnStale::Store))
                .await
                .expect("begin"),
            BeginOutcome::Completed(record.clone().into())
        );
    }
    let ran = delta(&before, &commandstats(&[&server]));
    println!("redis + local cache: 3 replays ran {ran:?}");
    assert!(ran.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_spreads_records_over_slots_one_slot_per_script() {
    let cluster = RedisCluster::start(3);
    let store_config = StoreSettings {
        kind: StoreKind::RedisCluster,
        urls: cluster.urls(),
        key_prefix: redis_server::unique_prefix("cluster"),
        ..StoreSettings::default()
    };
    let store = open(&store_config).await.expect("open the cluster store");
    assert_eq!(store.kind(), "redis-cluster");

    let keys: Vec<RecordKey> = (0..12).map(|_| new_key()).collect();
    for key in &keys {
        let token = claim(&*store, *key, LEASE).await;
        store
            .complete(key, token, &completed(1))
            .await
            .expect("complete");
    }
    let mut nodes_used = std::collections::BTreeSet::new();
    for key in &keys {
        let name = redis_key(&store_config.key_prefix, key);
        // The slot is the hash tag's: the record key alone decides it.
        let slot = cluster.keyslot(&name);
        assert_eq!(slot, cluster.keyslot(&key.to_hex()));
        let owner = cluster.node_for(&name);
        assert_eq!(owner.cli(&["exists", &name]).trim(), "1");
        nodes_used.insert(owner.port());
    }
    assert!(
        nodes_used.len() > 1,
        "12 random records all landed on one node of 3"
    );

    let direct = RedisStore::connect_cluster(&store_config)
        .await
        .expect("connect");
    let nodes: Vec<&RedisServer> = cluster.nodes.iter().collect();
    measure_round_trips("redis-cluster", &direct, &nodes).await;

    // A database other than 0 does not exist on a cluster.
    let with_db = StoreSettings {
        database: Some(1),
        ..store_config.clone()
    };
    assert!(matches!(
        RedisStore::connect_cluster(&with_db).await,
        Err(StoreError::Unavailable(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
        .expect("generate a certificate");
    let cert = dir.path().join("redis.crt");
    let key = dir.path().join("redis.key");
    std::fs::write(&cert, certified.cert.pem()).expect("write cert");
    std::fs::write(&key, certified.key_pair.serialize_pem()).expect("write key");
    let server = RedisServer::start_with(RedisOptions {
        tls: Some(TlsFiles {
            cert: cert.clone(),
            key,
            ca: cert.clone(),
        }),
        ..RedisOptions::default()
    });
    assert!(server.url().starts_with("rediss://"));

    let trusted = StoreSettings {
        ca_file: Some(cert.clone()),
        ..config(server.url())
    };
    let store = RedisStore::connect(&trusted)
        .await
        .expect("connect over TLS");
    let key = completed_key(&store).await;
    assert!(matches!(
        store.begin(&begin(key, 2, LEASE, OnStale::Store)).await,
        Ok(BeginOutcome::Mismatch {
            state: KeyState::Completed
        })
    ));

    // The system roots do not know the private CA; waiting would not change
    // that, so even a store allowed to wait for Redis fails at once.
    let started = Instant::now();
    match RedisStore::connect_within(&config(server.url()), Duration::from_secs(10)).await {
        Err(StoreError::Unavailable(message)) => println!("untrusted: {message}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a TLS failure was retried for {:?}",
        started.elapsed()
    );
    // A CA file is for TLS only: a plain URL with one is a configuration
    // error, not a silent plaintext connection.
    let plain = StoreSettings {
        ca_file: Some(cert),
        ..config(format!("redis://127.0.0.1:{}", server.port()))
    };
    match RedisStore::connect(&plain).await {
        Err(StoreError::Unavailable(message)) => assert!(message.contains("ca_file"), "{message}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_dispatches_on_kind_and_shares_one_connection() {
    let server = RedisServer::start();
    let store = open(&config(server.url())).await.expect("open");
    assert_eq!(store.kind(), "redis");

    // Many concurrent requests, one multiplexed connection (plus the
    // measuring redis-cli).
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let key = new_key();
                let token = claim(&*store, key, LEASE).await;
                store.complete(&key, token, &completed(1)).await
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task").expect("complete");
    }
    let clients = server.cli(&["client", "list"]);
    let ours = clients
        .lines()
        .filter(|l| !l.contains("cmd=client"))
        .count();
    assert_eq!(ours, 1, "one connection for all requests: {clients}");

    // The kind is dispatched on where the store is opened from the whole
    // configuration: a memory kind never reaches the Redis store.
    let memory = idemproxy::config::Config {
        store: StoreSettings {
            kind: StoreKind::Memory,
            ..StoreSettings::default()
        },
        ..Default::default()
    };
    let opened = idemproxy::open_store(&memory).await.expect("memory store");
    assert_eq!(opened.kind(), "memory");
}

/// Connections of this store open on `server`, not counting the
/// redis-cli that asks.
fn our_connections(server: &RedisServer) -> usize {
    server
        .cli(&["client", "list"])
        .lines()
        .filter(|l| !l.contains("cmd=client"))
        .count()
}

/// A claim and its completion on a fresh key.
async fn claim_and_complete(store: &RedisStore) -> Result<(), StoreError> {
    let key = new_key();
    match store.begin(&begin(key, 1, LEASE, OnStale::Store)).await? {
        BeginOutcome::Acquired { token, .. } => store.complete(&key, token, &completed(1)).await,
        other => panic!("a fresh key was not acquired: {other:?}"),
    }
}

/// A traffic worker is a current-thread runtime; each gets a connection of
/// its own, opened on its loop, while multi-thread runtimes share the one
/// opened at startup. A worker whose connection is killed reconnects.
#[test]
fn each_current_thread_runtime_gets_its_own_connection() {
    let server = RedisServer::start();
    let shared = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let store = shared.block_on(connect(&server));
    shared.block_on(async {
        for _ in 0..10 {
            claim_and_complete(&store).await.expect("shared connection");
        }
    });
    assert_eq!(
        our_connections(&server),
        1,
        "multi-thread runtimes share one"
    );

    let workers: Vec<tokio::runtime::Runtime> = (0..2)
        .map(|_| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
        })
        .collect();
    for (i, worker) in workers.iter().enumerate() {
        worker.block_on(async {
            // The first call starts opening the loop's connection and goes
            // over the shared one meanwhile; every call succeeds either way.
            let deadline = Instant::now() + Duration::from_secs(5);
            while our_connections(&server) < 2 + i {
                claim_and_complete(&store).await.expect("while opening");
                assert!(Instant::now() < deadline, "worker {i} never opened its own");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
    }
    assert_eq!(
        our_connections(&server),
        3,
        "the shared one and one per worker"
    );
    // Opened once: further calls reuse them.
    for worker in &workers {
        worker.block_on(async {
            for _ in 0..20 {
                claim_and_complete(&store).await.expect("own connection");
            }
        });
    }
    assert_eq!(our_connections(&server), 3);

    // Kill every connection: each worker's next calls reconnect by themselves.
    server.cli(&["client", "kill", "type", "normal"]);
    for (i, worker) in workers.iter().enumerate() {
        worker.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut succeeded = 0;
            while succeeded < 5 {
                match claim_and_complete(&store).await {
                    Ok(()) => succeeded += 1,
                    Err(StoreError::Unavailable(_)) => {
                        assert!(Instant::now() < deadline, "worker {i} did not reconnect")
                    }
                    Err(other) => panic!("worker {i}: {other:?}"),
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
    }
    assert_eq!(
        our_connections(&server),
        2,
        "both workers reconnected their own"
    );
    drop(workers);
}

/// A cluster walk's cursor carries the set of primaries the walk began on.
/// A master that joins and takes slots midway (a resharding; a failover
/// changes the set the same way) ends the walk with `WalkInterrupted`,
/// where going on by node number would move it to another node, or past
/// one, in silence; a walk begun again meets every record. A master
/// without slots holds no records and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_walk_ends_loudly_when_its_primaries_change() {
    let mut cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let store_config = StoreSettings {
        kind: StoreKind::RedisCluster,
        urls: cluster.urls(),
        key_prefix: redis_server::unique_prefix("walk"),
        ..StoreSettings::default()
    };
    let store = open(&store_config).await.expect("open the cluster store");
    let mut keys = std::collections::BTreeSet::new();
    for _ in 0..60 {
        let key = new_key();
        let token = claim(&*store, key, LEASE).await;
        store
            .complete(&key, token, &completed(1))
            .await
            .expect("complete");
        keys.insert(key);
    }
    let first = store
        .scan(&ScanCursor::start(), 5)
        .await
        .expect("the first page");
    let cursor = first
        .next
        .expect("60 records on 3 nodes take more than a page");

    // A fourth master, without slots: the walk goes on.
    let added = tokio::task::block_in_place(|| cluster.add_master());
    let page = store
        .scan(&cursor, 5)
        .await
        .expect("a slotless master changes nothing");
    let cursor = page.next.unwrap_or(cursor);

    // It takes a quarter of the slots, with their records.
    tokio::task::block_in_place(|| cluster.reshard_to(added, 4096));
    let added = cluster.nodes[added].addr();
    match store.scan(&cursor, 5).await {
        Err(StoreError::WalkInterrupted(why)) => {
            assert!(why.contains(&added), "names the primaries now: {why}");
        }
        other => panic!("a walk across a layout change went on: {other:?}"),
    }

    // Every record still reads where it moved (the reads that meet a moved
    // slot teach the connection the new map), and a walk begun again
    // meets them all, on four nodes.
    for key in &keys {
        assert!(store.get(key).await.expect("get").is_some());
    }
    let (read, unreadable) = walk(&*store).await;
    assert_eq!(read, keys, "a walk begun again meets every record");
    assert!(unreadable.is_empty(), "{unreadable:?}");
}

/// Encryption at rest on Redis: a completion prepared once (sealed once)
/// and sent twice, as after a lost reply, is the same write to
/// `settle.lua` (answered settled both times, so the store goes on to its
/// replica acknowledgement), and the stored value does not change. The
/// same record sealed again (a new nonce) under the same token is another
/// writer's to the script: fenced. That was what every retry sent before
/// a completion was sealed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_sealed_completion_sent_twice_is_the_same_write() {
    use base64::Engine;
    use idemproxy::store::sealed::{Keyring, SealedStore};
    let server = RedisServer::start();
    let redis = connect(&server).await;
    let prefix = redis.key_prefix().to_owned();
    let keys = base64::engine::general_purpose::STANDARD.encode([3u8; 32]);
    let store = SealedStore::new(Arc::new(redis), Keyring::parse(&keys).expect("keys"));
    let key = new_key();
    let token = claim(&store, key, LEASE).await;
    let record = completed(1);
    let completion = store.prepare(&key, record.clone()).expect("prepare");
    assert!(
        matches!(completion.stored().outcome, Outcome::Sealed(_)),
        "sealed once, in prepare"
    );
    let value = || server.cli(&["GET", &redis_key(&prefix, &key)]);
    store
        .complete_prepared(&key, token, &completion)
        .await
        .expect("the first try");
    let first = value();
    store
        .complete_prepared(&key, token, &completion)
        .await
        .expect("the retry is the same write");
    assert_eq!(value(), first, "nothing rewritten");
    assert!(
        matches!(
            store.complete(&key, token, &record).await,
            Err(StoreError::Fenced)
        ),
        "sealed anew, it is another write"
    );
    assert_eq!(
        store
            .begin(&begin(key, 1, LEASE, OnStale::Store))
            .await
            .expect("begin"),
        BeginOutcome::Completed(record.into()),
        "opens to the record"
    );
}
