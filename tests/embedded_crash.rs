//! The embedded store under SIGKILL, many times: a real sidecar takes a
//! write load of first executions (each a claim and a completion, group
//! committed) and is killed at a random moment, so that kills land between
//! a group's journal write and its sync as well as anywhere else; then it
//! restarts on the same directory. Across every crash no key executes
//! twice, and every answer a client got replays from the store.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use idemproxy::config::{Config, StoreKind};
use support::binary::ProxyProcess;
use support::fault::{raw_exchange, raw_post};
use support::upstream::TestUpstream;
use tokio::task::JoinSet;
use tokio::time::Instant;

const BODY: &str = r#"{"amount":1}"#;

/// Crash cycles, and how long the test may run in all.
const CRASHES: usize = 30;
const BUDGET: Duration = Duration::from_secs(25);

/// Concurrent clients during each cycle.
const CLIENTS: usize = 16;

fn target(key: usize) -> String {
    format!("/v1/crash/{key}")
}

/// Sends first executions from `CLIENTS` clients, each key new, until
/// the process dies under them (or `until`); returns each key's answer
/// (`None`: the connection broke or no answer came).
async fn load(
    addr: std::net::SocketAddr,
    first_key: usize,
    until: Instant,
) -> Vec<(usize, Option<u16>)> {
    let mut clients = JoinSet::new();
    for client in 0..CLIENTS {
        clients.spawn(async move {
            let mut answers = Vec::new();
            let mut key = first_key + client;
            while Instant::now() < until {
                let request = raw_post(&target(key), &format!("crash-{key}"), BODY);
                let answer = raw_exchange(addr, &request, Duration::from_secs(10)).await;
                answers.push((key, answer.status()));
                key += CLIENTS;
                if answer.status().is_none() {
                    // The process is gone.
                    break;
                }
            }
            answers
        });
    }
    clients.join_all().await.into_iter().flatten().collect()
}

/// Retries every key in `keys`, `CLIENTS` at a time.
async fn retry_all(
    addr: std::net::SocketAddr,
    keys: Vec<usize>,
) -> Vec<(usize, support::fault::RawAnswer)> {
    let mut retries = JoinSet::new();
    for client in 0..CLIENTS {
        let mine: Vec<usize> = keys.iter().copied().skip(client).step_by(CLIENTS).collect();
        retries.spawn(async move {
            let mut answers = Vec::new();
            for key in mine {
                let request = raw_post(&target(key), &format!("crash-{key}"), BODY);
                answers.push((
                    key,
                    raw_exchange(addr, &request, Duration::from_secs(10)).await,
                ));
            }
            answers
        });
    }
    retries.join_all().await.into_iter().flatten().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_group_commits_never_runs_a_key_twice_nor_loses_an_answer() {
    let started = Instant::now();
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c: Config = support::proxy::config(&upstream.url());
    c.store.kind = StoreKind::Embedded;
    c.store.path = dir.path().join("data");
    // Claims a crash left pending stay in flight for most of this test: a
    // retry of one is answered 425 (or, past the lease, outcome-unknown),
    // never executed again.
    c.upstream.timeout = Duration::from_secs(60);

    // key → the status its first execution was answered with (2xx only).
    let mut answered: HashMap<usize, u16> = HashMap::new();
    let mut unanswered = Vec::new();
    let mut next_key = 0;
    let mut crashes = 0;
    while crashes < CRASHES && started.elapsed() < BUDGET - Duration::from_secs(8) {
        let mut proxy = ProxyProcess::start(c.clone()).await;
        // Killed 150 to 650 ms into the load: some groups are mid-write.
        let kill_at = Instant::now() + Duration::from_millis(150 + rand::random::<u64>() % 500);
        let until = kill_at + Duration::from_secs(2);
        let sending = load(proxy.addr, next_key, until);
        let killing = async {
            tokio::time::sleep_until(kill_at).await;
            proxy.kill();
        };
        let (answers, ()) = tokio::join!(sending, killing);
        crashes += 1;
        for (key, status) in answers {
            next_key = next_key.max(key + 1);
            match status {
                Some(status) if (200..300).contains(&status) => {
                    answered.insert(key, status);
                }
                _ => unanswered.push(key),
            }
        }
        next_key += CLIENTS;
    }
    assert!(
        crashes >= 5,
        "only {crashes} crash cycles within the budget"
    );
    assert!(
        answered.len() >= 50,
        "only {} keys answered",
        answered.len()
    );

    // After the last crash: every answered key replays its answer, every
    // other key is either a replay, in flight, or free to execute (a claim
    // that never reached the disk was never forwarded).
    let proxy = ProxyProcess::start(c).await;
    let retried_at = Instant::now();
    let keys: Vec<usize> = answered.keys().chain(&unanswered).copied().collect();
    let retries = retry_all(proxy.addr, keys).await;
    let mut lost = Vec::new();
    for (key, answer) in retries {
        let status = answer.status();
        match answered.get(&key) {
            Some(&first) => {
                if status != Some(first) || !answer.reply().replayed() {
                    lost.push((key, status));
                }
            }
            // Executed now (its claim never reached the disk, so it was
            // never forwarded), replayed, in flight, or settled
            // outcome-unknown: never a second execution.
            None => assert!(
                matches!(status, Some(200..300 | 425 | 502)),
                "key {key} after the crashes: {}",
                String::from_utf8_lossy(&answer.bytes)
            ),
        }
    }
    let twice: Vec<(usize, usize)> = (0..next_key)
        .map(|key| (key, upstream.executions(&target(key))))
        .filter(|(_, executions)| *executions > 1)
        .collect();
    println!(
        "embedded kill -9: crashes={crashes} answered={} unanswered={} lost={} executed_twice={} \
         in {:?} (retries {:?})",
        answered.len(),
        unanswered.len(),
        lost.len(),
        twice.len(),
        started.elapsed(),
        retried_at.elapsed()
    );
    assert_eq!(twice, [], "keys executed more than once");
    assert_eq!(lost, [], "answered keys that did not replay their answer");
}
