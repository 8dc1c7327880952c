//! The chaos run with reconciliation (issue 42's done-when): an
//! operator's worst day, shortened. Two proxies (the real binary) share a
//! Redis that keeps an append-only file fsynced on every write;
//! operations arrive spread over the run, a third of them sent twice at
//! once, each retried through either proxy until it has its answer; a
//! fault task meanwhile kills a proxy with SIGKILL while it holds a
//! request at the upstream (then starts a new one), or crashes Redis and
//! restarts it. The route looks unknown outcomes up in the upstream's
//! ledger of executed keys (`reconcile_url = "/ledger/{key}"`).
//!
//! Every operation must run exactly once, and end with its own execution's
//! answer (executed, replayed, or found by the lookup and marked
//! reconciled): none ends `outcome-unknown`. Every killed proxy's request
//! is answered by the lookup.
//!
//! `CHAOS_OPERATIONS`, `CHAOS_SECONDS` and `CHAOS_FAULTS` scale it; CI
//! runs the default (150 operations over 10 s, 4 faults). The issue's run:
//! `CHAOS_OPERATIONS=600 CHAOS_SECONDS=40 CHAOS_FAULTS=10 cargo test
//! --test integration chaos -- --nocapture`.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Method;
use idemproxy::config::Config;
use serde_json::Value;
use support::binary::ProxyProcess;
use support::proxy::{redis_config, Reply, TestClient};
use support::redis_server::{self, RedisOptions, RedisServer};
use support::upstream::TestUpstream;
use tokio::task::JoinSet;
use tokio::time::{sleep, Instant};

/// How an operation ended, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Answer {
    /// 201 from the upstream, or its replay: the execution's number.
    Executed(u64),
    /// 200 from the ledger lookup, marked reconciled: the execution's.
    Reconciled(u64),
}

impl Answer {
    fn execution(self) -> u64 {
        match self {
            Answer::Executed(n) | Answer::Reconciled(n) => n,
        }
    }
}

/// What one answer tells a client.
enum Seen {
    End(Answer),
    /// No answer yet: 425 (in flight), 503 (the store is down).
    Retry,
    /// `outcome-unknown`: a lookup may resolve it on a later retry.
    Unknown,
    /// An answer no client should get.
    Unexpected(String),
}

/// What one client of an operation saw.
#[derive(Debug)]
struct Settled {
    key: String,
    answer: Option<Answer>,
    /// `outcome-unknown` answers on the way (each resolved by a later
    /// retry's lookup, or the operation fails the run).
    unknown_seen: usize,
    attempts: usize,
    unexpected: Vec<String>,
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The proxies' base URLs, which a restart changes.
type Live = Arc<Mutex<Vec<String>>>;

fn live_url(live: &Live, pick: usize) -> String {
    let urls = live.lock().unwrap_or_else(|e| e.into_inner());
    urls[pick % urls.len()].clone()
}

/// Sends the operation keyed `key` to `target`, first through proxy
/// `first`, then through either, retrying what is no answer yet until it
/// has one or `until` passes.
async fn settle(key: String, target: String, live: Live, first: usize, until: Instant) -> Settled {
    let client = TestClient::new();
    let body = format!(r#"{{"key":"{key}","amount":700}}"#);
    let mut settled = Settled {
        key,
        answer: None,
        unknown_seen: 0,
        attempts: 0,
        unexpected: Vec::new(),
    };
    let pause = Duration::from_millis(150 + (settled.key.len() as u64 * 37 % 100));
    while Instant::now() < until {
        let url = format!("{}{target}", live_url(&live, first + settled.attempts));
        settled.attempts += 1;
        let headers = [
            ("content-type", "application/json"),
            ("idempotency-key", settled.key.as_str()),
        ];
        let within = Duration::from_secs(8);
        let sent = client
            .try_send(Method::POST, &url, &headers, body.clone(), within)
            .await;
        // A failed exchange: the proxy died under the request, or was gone.
        match sent.map(|reply| classify(&reply)) {
            Ok(Seen::End(answer)) => {
                settled.answer = Some(answer);
                return settled;
            }
            Ok(Seen::Unknown) => settled.unknown_seen += 1,
            Ok(Seen::Unexpected(what)) => settled.unexpected.push(what),
            Ok(Seen::Retry) | Err(_) => {}
        }
        sleep(pause).await;
    }
    settled
}

fn classify(reply: &Reply) -> Seen {
    let execution = serde_json::from_slice::<Value>(&reply.body)
        .ok()
        .and_then(|json| json["execution"].as_u64());
    let reconciled = reply.header("idempotency-reconciled") == Some("true");
    match (reply.status.as_u16(), execution) {
        (201, Some(n)) if !reconciled => Seen::End(Answer::Executed(n)),
        (200, Some(n)) if reconciled => Seen::End(Answer::Reconciled(n)),
        (425 | 503, _) => Seen::Retry,
        (502 | 504, _) if reply.body.windows(15).any(|w| w == b"outcome-unknown") => Seen::Unknown,
        _ => Seen::Unexpected(format!("{reply:?}")),
    }
}

fn chaos_config(upstream: &TestUpstream, redis: &RedisServer) -> Config {
    let mut c = redis_config(
        &upstream.url(),
        &redis.url(),
        &redis_server::unique_prefix("chaos"),
    );
    // Lease: 1 s upstream timeout + 1.4 s margin (the least a 250 ms store
    // timeout allows) + 1 s lookup.
    c.upstream.timeout = Duration::from_secs(1);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.idempotency.reconcile_url = "/ledger/{key}".into();
    c
}

/// The ledger's answer to `key`'s only execution; panics, naming the key,
/// if it ran other than once.
fn only_execution(upstream: &TestUpstream, key: &str) -> u64 {
    let ledger = upstream.ledger(key);
    assert_eq!(
        ledger.len(),
        1,
        "{key} ran {} times: {ledger:?}",
        ledger.len()
    );
    ledger[0]["execution"].as_u64().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_kills_and_redis_crashes_every_operation_runs_once_and_none_stays_unknown() {
    let operations = env_or("CHAOS_OPERATIONS", 150);
    let run = Duration::from_secs(env_or("CHAOS_SECONDS", 10) as u64);
    let faults = env_or("CHAOS_FAULTS", 4);
    let aof = ["--appendonly", "yes", "--appendfsync", "always"];
    let mut redis = RedisServer::start_with(RedisOptions {
        extra_args: aof.iter().map(|a| a.to_string()).collect(),
        ..RedisOptions::default()
    });
    let upstream = TestUpstream::start().await;
    let c = chaos_config(&upstream, &redis);
    let mut proxies = [
        ProxyProcess::start(c.clone()).await,
        ProxyProcess::start(c.clone()).await,
    ];
    let live: Live = Arc::new(Mutex::new(proxies.iter().map(|p| p.url("")).collect()));
    let started = Instant::now();
    // Time for the last arrivals to ride out a lease or two.
    let until = started + run + Duration::from_secs(30);
    let at = |i: usize, of: usize| started + run.mul_f64(i as f64 / of as f64);

    let mut clients = JoinSet::new();
    for op in 0..operations {
        let key = format!("chaos-{op}");
        // A third of the operations are sent twice at once.
        for copy in 0..1 + usize::from(op % 3 == 0) {
            let (key, live, arrival) = (key.clone(), live.clone(), at(op, operations));
            let target = "/v1/chaos?ledger=1&delay_ms=60".to_owned();
            clients.spawn(async move {
                tokio::time::sleep_until(arrival).await;
                settle(key, target, live, op + copy, until).await
            });
        }
    }

    // Each proxy kill catches a request at the upstream: its key is one
    // only the lookup can answer.
    let mut held = Vec::new();
    let (mut kills, mut crashes) = (0, 0);
    for fault in 0..faults {
        tokio::time::sleep_until(at(fault + 1, faults + 1)).await;
        if fault % 2 == 1 {
            tokio::task::block_in_place(|| redis.restart());
            crashes += 1;
            continue;
        }
        let victim = kills % proxies.len();
        let key = format!("chaos-held-{fault}");
        let target = format!("/v1/chaos?ledger=1&hold={key}");
        let (k, l) = (key.clone(), live.clone());
        clients.spawn(async move { settle(k, target, l, victim, until).await });
        let arrived = async {
            while upstream.ledger(&key).is_empty() {
                sleep(Duration::from_millis(10)).await;
            }
        };
        let at_upstream = tokio::time::timeout(Duration::from_secs(10), arrived).await;
        assert!(at_upstream.is_ok(), "{key} never reached the upstream");
        proxies[victim].kill();
        upstream.release(&key);
        proxies[victim] = ProxyProcess::start(c.clone()).await;
        live.lock().unwrap_or_else(|e| e.into_inner())[victim] = proxies[victim].url("");
        held.push(key);
        kills += 1;
    }

    let mut settled = Vec::new();
    while let Some(done) = clients.join_next().await {
        settled.push(done.expect("a client task"));
    }
    let (mut executed, mut reconciled, mut unknown_seen, mut attempts) = (0, 0, 0, 0);
    for client in &settled {
        assert!(client.unexpected.is_empty(), "{client:?}");
        let answer = client
            .answer
            .unwrap_or_else(|| panic!("{} has no answer by the end: {client:?}", client.key));
        assert_eq!(
            answer.execution(),
            only_execution(&upstream, &client.key),
            "{} was answered another execution's response: {client:?}",
            client.key
        );
        match answer {
            Answer::Executed(_) => executed += 1,
            Answer::Reconciled(_) => reconciled += 1,
        }
        unknown_seen += client.unknown_seen;
        attempts += client.attempts;
    }
    for key in &held {
        let client = settled.iter().find(|s| &s.key == key).expect("held client");
        assert!(
            matches!(client.answer, Some(Answer::Reconciled(_))),
            "a request its proxy died holding is the lookup's to answer: {client:?}"
        );
    }
    eprintln!(
        "chaos: {} operations ({} clients, {attempts} attempts) over {run:?}, {kills} proxy kills, \
         {crashes} Redis crashes: {executed} answered executed or replayed, {reconciled} \
         reconciled, {unknown_seen} outcome-unknown answers on the way (each resolved), \
         none run twice, none left unknown; took {:?}",
        operations + held.len(),
        settled.len(),
        started.elapsed()
    );
}
