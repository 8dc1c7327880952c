//! Fault injection on real `idemproxy` processes sharing a private Redis:
//! a proxy killed with SIGKILL while it holds a key mid-call (the key is
//! in flight until its lease runs out, then settled fail-closed as
//! `outcome-unknown`, never executed again), and a proxy stopped with
//! SIGTERM while calls are in flight (they finish, are stored, and replay
//! on another replica). The same SIGKILL on the embedded store (the
//! default): what was answered survives, what was mid-call fails closed.

use crate::support;

use std::time::Duration;

use idemproxy::config::Config;
use support::binary::ProxyProcess;
use support::fault::{killed_mid_call, raw_exchange, raw_post, Executions};
use support::postgres_server::{self, PostgresServer};
use support::proxy::{postgres_config, redis_config, Reply, TestClient};
use support::redis_server::{self, RedisServer};
use support::upstream::TestUpstream;
use tokio::task::JoinSet;
use tokio::time::Instant;

const BODY: &str = r#"{"amount":1000,"currency":"eur"}"#;

/// A binary's configuration on the private Redis at `redis`.
fn on_redis(upstream: &TestUpstream, redis: &RedisServer, prefix: &str) -> Config {
    let mut c = redis_config(&upstream.url(), &redis.url(), prefix);
    c.log.level = "info".into();
    c
}

/// Retries of `key`, whose proxy died holding it (request sent at
/// `sent_at`): one before the lease ends, which finds it in flight (the dead
/// proxy might still be running it, for all the new one knows), and the
/// first after it that is not 425 (returned for the caller to check: the
/// key settled fail-closed). The lease began when the dead proxy called
/// `begin`, a moment after the send, so a retry right at its end may still
/// find it running.
async fn in_flight_then_settled(
    client: &TestClient,
    url: &str,
    key: &str,
    sent_at: Instant,
    lease: Duration,
) -> (Reply, Duration, Reply) {
    let early = client.post_json(url, key, BODY).await;
    let early_at = sent_at.elapsed();
    assert!(
        early_at < lease - Duration::from_millis(500),
        "the retry came {early_at:?} after the claim: too late to test the lease"
    );
    early.assert_problem(425, "in-flight");
    let lease_end = sent_at + lease;
    tokio::time::sleep_until(lease_end).await;
    // The claim was made a moment after the send: well within 2 s of it on
    // any machine, and a lease much longer than configured fails.
    let give_up = lease_end + Duration::from_secs(2);
    loop {
        let reply = client.post_json(url, key, BODY).await;
        if reply.status != 425 || Instant::now() > give_up {
            return (early, early_at, reply);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_mid_call_leaves_its_key_in_flight_then_outcome_unknown() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let c = on_redis(&upstream, &redis, &redis_server::unique_prefix("kill9"));
    killed_mid_call_then_outcome_unknown(c, &upstream).await;
}

/// The same on PostgreSQL: the retry through the other proxy process finds
/// the dead one's claim, in flight, then settled fail-closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_mid_call_on_postgres_leaves_its_key_in_flight_then_outcome_unknown() {
    let postgres = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let mut c = postgres_config(
        &upstream.url(),
        &postgres.url(),
        &postgres_server::unique_prefix("kill9"),
    );
    c.log.level = "info".into();
    killed_mid_call_then_outcome_unknown(c, &upstream).await;
}

/// A proxy process on `c` dies holding a key mid-call; another one on the
/// same store answers the retries: in flight, then `outcome-unknown`, and
/// the upstream saw the request once.
async fn killed_mid_call_then_outcome_unknown(mut c: Config, upstream: &TestUpstream) {
    c.upstream.timeout = Duration::from_secs(4);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    let lease = Duration::from_millis(5400);
    let mut first = ProxyProcess::start(c.clone()).await;
    // Another proxy process on the same Redis, started now: its start-up
    // must not eat into the lease the early retry has to land in.
    let second = ProxyProcess::start(c.clone()).await;
    let client = TestClient::new();
    let path = "/v1/charges?delay_ms=3000";

    // The first request: its proxy dies while the upstream works on it, so
    // its client gets no answer (the connection breaks).
    let pid = first.pid();
    let sent_at = killed_mid_call(&mut first, upstream, path, "crash-1", BODY).await;

    let url = second.url(path);

    let (early, early_at, late) =
        in_flight_then_settled(&client, &url, "crash-1", sent_at, lease).await;
    // The settlement is stored: another retry gets the same answer.
    let again = client.post_json(&url, "crash-1", BODY).await;
    let executions = Executions::count(upstream, [path]);
    println!(
        "kill9: operations=1 duplicates=3 executions={} killed_pid={pid} \
         early={} at {early_at:?}, late={}, again={}",
        executions.total, early.status, late.status, again.status
    );
    executions.assert_at_most_once();
    late.assert_problem(502, "outcome-unknown");
    assert!(late.replayed(), "{late:?}");
    again.assert_problem(502, "outcome-unknown");
    assert_eq!(
        again.header("idempotency-original-date"),
        late.header("idempotency-original-date")
    );
    assert_eq!(executions.total, 1);
}

/// The default store, one sidecar, SIGKILL: a completion answered before
/// the crash was fsync'd and replays from the file after a restart; a key
/// claimed mid-call is in flight until its lease ends, then settled as
/// `outcome-unknown`; nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_killed_on_the_embedded_store_keeps_its_answers_and_fails_closed() {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = support::proxy::config(&upstream.url());
    c.store.kind = idemproxy::config::StoreKind::Embedded;
    c.store.path = dir.path().join("data");
    // The restart (after a crash, redb checks the file) happens inside the
    // lease: leave it room on a loaded machine.
    c.upstream.timeout = Duration::from_secs(7);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    let lease = Duration::from_millis(8400);
    let mut first = ProxyProcess::start(c.clone()).await;
    let client = TestClient::new();

    let done = client
        .post_json(&first.url("/v1/done"), "done-1", BODY)
        .await;
    assert_eq!(done.status, 201, "{done:?}\n{}", first.logs());
    assert!(!done.replayed());

    let path = "/v1/charges?delay_ms=6000";
    let sent_at = killed_mid_call(&mut first, &upstream, path, "crash-1", BODY).await;

    // The sidecar restarts on the same file.
    let second = ProxyProcess::start(c).await;
    let replay = client
        .post_json(&second.url("/v1/done"), "done-1", BODY)
        .await;
    assert_eq!(replay.status, 201, "{replay:?}\n{}", second.logs());
    assert!(replay.replayed(), "answered before the crash: {replay:?}");
    assert_eq!(replay.body, done.body);

    let url = second.url(path);
    let (_, _, late) = in_flight_then_settled(&client, &url, "crash-1", sent_at, lease).await;
    late.assert_problem(502, "outcome-unknown");
    let executions = Executions::count(&upstream, ["/v1/done", path]);
    executions.assert_at_most_once();
    assert_eq!(executions.total, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_calls_which_then_replay_on_another_replica() {
    const CALLS: usize = 5;
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let mut c = on_redis(&upstream, &redis, &redis_server::unique_prefix("drain"));
    c.drain_timeout = Duration::from_secs(10);
    let mut a = ProxyProcess::start(c.clone()).await;
    let b = ProxyProcess::start(c).await;
    let client = TestClient::new();
    let paths: Vec<String> = (0..CALLS)
        .map(|i| format!("/v1/drain/{i}?delay_ms=1500"))
        .collect();

    let mut calls = JoinSet::new();
    for (i, path) in paths.iter().enumerate() {
        let client = client.clone();
        let url = a.url(path);
        calls.spawn(async move { (i, client.post_json(&url, &format!("drain-{i}"), BODY).await) });
    }
    // All five are at the upstream (and so hold their keys) before the signal.
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.total() < CALLS {
        assert!(Instant::now() < deadline, "calls did not arrive");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let signalled = Instant::now();
    a.terminate();

    let mut originals: Vec<Option<Reply>> = (0..CALLS).map(|_| None).collect();
    for (i, reply) in calls.join_all().await {
        assert_eq!(reply.status, 201, "call {i} through the drain: {reply:?}");
        assert!(!reply.replayed());
        originals[i] = Some(reply);
    }
    let status = a.wait_exit(Duration::from_secs(10)).await;
    let drained_in = signalled.elapsed();
    assert!(status.success(), "exit status {status}:\n{}", a.logs());

    let mut replays = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let reply = client
            .post_json(&b.url(path), &format!("drain-{i}"), BODY)
            .await;
        replays.push(reply);
    }
    let executions = Executions::count(&upstream, paths.iter().map(String::as_str));
    println!(
        "sigterm: operations={CALLS} duplicates={} executions={} exit={status} \
         drained_in={drained_in:?}",
        replays.len(),
        executions.total
    );
    executions.assert_at_most_once();
    for (i, reply) in replays.iter().enumerate() {
        let original = originals[i].as_ref().expect("every call answered");
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed(), "call {i} replays on B: {reply:?}");
        assert_eq!(reply.body, original.body);
    }
    assert_eq!(executions.total, CALLS);
    assert_eq!(upstream.total(), CALLS);
}

/// A covered call still at the upstream when the drain deadline passes is
/// cut off with the process: its key is left to end as `outcome-unknown` by
/// its lease, and its log line says `outcome_unknown`, not that its client
/// left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_off_by_the_drain_deadline_is_logged_as_outcome_unknown() {
    let upstream = TestUpstream::start().await;
    let mut c = support::proxy::config(&upstream.url());
    c.drain_timeout = Duration::from_millis(500);
    c.log.level = "info".into();
    c.log.format = idemproxy::config::LogFormat::Json;
    let mut proxy = ProxyProcess::start(c).await;
    let cut = {
        let addr = proxy.addr;
        tokio::spawn(async move {
            raw_exchange(
                addr,
                &raw_post("/v1/held?hold=never", "cut-1", BODY),
                Duration::from_secs(10),
            )
            .await
        })
    };
    assert!(
        upstream
            .wait_for_executions("/v1/held", 1, Duration::from_secs(5))
            .await,
        "the call reached the upstream:\n{}",
        proxy.logs()
    );
    proxy.terminate();
    let status = proxy.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "exit status {status}:\n{}", proxy.logs());
    let _ = cut.await;
    let logs = proxy.logs();
    let outcomes: Vec<String> = logs
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|line| line["target"] == "idemproxy::request")
        .map(|line| line["outcome"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(outcomes, ["outcome_unknown"], "{logs}");
}
