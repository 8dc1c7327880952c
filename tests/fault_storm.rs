//! Fault injection: a duplicate storm. Many operations, each sent by many
//! concurrent duplicates spread over two replicas that share one private
//! Redis (or PostgreSQL), against a slow upstream. Every operation executes exactly once;
//! every answer is the execution's 201, its replay, or 425 in flight.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use idemproxy::config::Config;
use idemproxy::store::{PostgresStore, RedisStore, SharedStore};
use support::fault::Executions;
use support::postgres_server::{self, PostgresServer};
use support::proxy::{postgres_config, redis_config, TestClient, TestProxy};
use support::redis_server::{self, RedisServer};
use support::upstream::TestUpstream;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

const OPERATIONS: usize = 40;
const DUPLICATES: usize = 25;
/// Requests in flight at once, over both replicas.
const CONCURRENCY: usize = 200;

#[derive(Debug)]
enum Answer {
    Executed,
    Replayed,
    InFlight,
    Unexpected(String),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_over_two_replicas_executes_each_operation_once() {
    let redis = RedisServer::start();
    let upstream = TestUpstream::start().await;
    let c = patient(redis_config(
        &upstream.url(),
        &redis.url(),
        &redis_server::unique_prefix("storm"),
    ));
    // Each replica has its own Redis connection.
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let store: SharedStore = Arc::new(RedisStore::connect(&c.store).await.expect("redis"));
        replicas.push(TestProxy::start_with_store(c.clone(), store).await);
    }
    storm(&upstream, &replicas).await;
}

/// The same storm over two replicas sharing a private PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_over_two_replicas_on_postgres_executes_each_operation_once() {
    let postgres = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let c = patient(postgres_config(
        &upstream.url(),
        &postgres.url(),
        &postgres_server::unique_prefix("storm"),
    ));
    // Each replica has its own pool.
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let store: SharedStore = Arc::new(PostgresStore::connect(&c.store).await.expect("pg"));
        replicas.push(TestProxy::start_with_store(c.clone(), store).await);
    }
    storm(&upstream, &replicas).await;
}

/// The storm tests at-most-once, not store timeouts: a slow moment on a
/// loaded machine must not turn into 503s.
fn patient(mut c: Config) -> Config {
    c.store.timeout = Duration::from_secs(2);
    // The margin that timeout needs: see `lease_margin`.
    c.idempotency.lease_margin = Duration::from_secs(9);
    c
}

/// Sends every operation `DUPLICATES` times over `replicas` and checks
/// each executed once.
async fn storm(upstream: &TestUpstream, replicas: &[TestProxy]) {
    let client = TestClient::new();
    let paths: Vec<String> = (0..OPERATIONS)
        .map(|op| format!("/v1/storm/{op}"))
        .collect();

    let started = Instant::now();
    let permits = Arc::new(Semaphore::new(CONCURRENCY));
    let mut set = JoinSet::new();
    // Duplicate-major order: the first wave holds a few duplicates of every
    // operation, so each operation's duplicates overlap its execution.
    for dup in 0..DUPLICATES {
        for (op, path) in paths.iter().enumerate() {
            let url = replicas[(op + dup) % 2].url(&format!("{path}?delay_ms=50"));
            let client = client.clone();
            let permits = permits.clone();
            let body = format!(r#"{{"operation":{op}}}"#);
            set.spawn(async move {
                let _permit = permits.acquire_owned().await.expect("semaphore");
                let reply = client.post_json(&url, &format!("storm-{op}"), &body).await;
                // Judged after the storm, so that the counts print first.
                let answer = match reply.status.as_u16() {
                    201 if reply.header("x-upstream-execution") != Some("1") => {
                        Answer::Unexpected(format!("a second execution: {reply:?}"))
                    }
                    201 if reply.replayed() => Answer::Replayed,
                    201 => Answer::Executed,
                    425 if reply.problem() == "in-flight" => Answer::InFlight,
                    _ => Answer::Unexpected(format!("{reply:?}")),
                };
                (op, answer)
            });
        }
    }
    let answers = tokio::time::timeout(Duration::from_secs(60), set.join_all())
        .await
        .expect("the storm finishes within 60 s");
    let elapsed = started.elapsed();

    let mut executed = vec![0usize; OPERATIONS];
    let (mut replayed, mut in_flight) = (0, 0);
    let mut unexpected = Vec::new();
    for (op, answer) in &answers {
        match answer {
            Answer::Executed => executed[*op] += 1,
            Answer::Replayed => replayed += 1,
            Answer::InFlight => in_flight += 1,
            Answer::Unexpected(what) => unexpected.push(format!("operation {op}: {what}")),
        }
    }
    let executions = Executions::count(upstream, paths.iter().map(String::as_str));
    println!(
        "storm: operations={OPERATIONS} duplicates={} executions={} \
         executed_answers={} replayed={replayed} in_flight={in_flight} unexpected={} \
         elapsed={elapsed:?}",
        answers.len(),
        executions.total,
        executed.iter().sum::<usize>(),
        unexpected.len(),
    );
    executions.assert_at_most_once();
    assert!(unexpected.is_empty(), "unexpected answers: {unexpected:#?}");
    assert_eq!(answers.len(), OPERATIONS * DUPLICATES);
    assert_eq!(
        executions.total, OPERATIONS,
        "every operation executed once"
    );
    assert_eq!(
        upstream.total(),
        OPERATIONS,
        "nothing else reached the upstream"
    );
    for (op, n) in executed.iter().enumerate() {
        assert_eq!(*n, 1, "operation {op}: {n} answers were executions");
    }
    assert!(in_flight > 0, "duplicates overlapped the executions");

    // Afterwards, both replicas replay every operation.
    for (op, path) in paths.iter().enumerate() {
        for replica in replicas {
            let reply = client
                .post_json(
                    &replica.url(&format!("{path}?delay_ms=50")),
                    &format!("storm-{op}"),
                    &format!(r#"{{"operation":{op}}}"#),
                )
                .await;
            assert_eq!(reply.status, 201, "{reply:?}");
            assert!(reply.replayed(), "{reply:?}");
        }
    }
    assert_eq!(upstream.total(), OPERATIONS);
}
