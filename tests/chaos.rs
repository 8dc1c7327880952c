//! The chaos run with reconciliation (issues 42 and 52's done-when): an
//! operator's worst day, shortened. Two proxies (the real binary) share a
//! store; operations arrive spread over the run, a third of them sent twice
//! at once, each retried through either proxy until it has its answer. A
//! fault task meanwhile alternates two faults:
//!
//! - it kills a proxy with SIGKILL while it holds a request at the
//!   upstream (then starts a new one): that key is the lookup's to answer
//!   once its claim's lease ends;
//! - just before that lease ends (so that the retries that would take the
//!   key over find the store gone), it crashes the store, with a request
//!   held at the upstream by a live proxy and let go while the store is
//!   down (the proxy settles the key once it is back), keeps it down for
//!   [`STORE_DOWN`], restarts it on the same port and data, and sends a
//!   fresh key through each proxy until both serve again (their
//!   connections to the store reopened).
//!
//! The route looks unknown outcomes up in the upstream's ledger of
//! executed keys (`reconcile_url = "/ledger/{key}"`). It runs on two stores
//! ([`ChaosStore`]), the same run for each:
//!
//! - Redis, keeping an append-only file fsynced on every write; its crash
//!   is SIGKILL.
//! - PostgreSQL, a private server ([`PostgresServer`]); its crash is an
//!   immediate shutdown (every backend gone at once, no checkpoint: the
//!   restart replays the WAL), which drops every connection of the
//!   proxies' pools.
//!
//! Every operation must run exactly once, and end with its own execution's
//! answer (executed, replayed, or found by the lookup and marked
//! reconciled): none ends `outcome-unknown`. Every killed proxy's request
//! is answered by the lookup. The summary line says how long the store's
//! restarts took and how soon both proxies served again; above it, the
//! faults' timeline and how each held or reconciled key ended.
//!
//! A failure names each key that went wrong with what its clients saw
//! (every attempt: when, through which proxy, what came back), what the
//! upstream's ledger holds for it, the proxies' log lines about it (each
//! attempt carries `x-request-id: KEY/ATTEMPT`, and the killed proxies'
//! logs are kept), the faults' timeline and the store's log. Times are UTC
//! wall-clock, as in the proxies' logs.
//!
//! `CHAOS_OPERATIONS`, `CHAOS_SECONDS` and `CHAOS_FAULTS` scale both runs;
//! CI runs the default (150 operations over 10 s, 4 faults; each run takes
//! about 12 s). The issues' run: `CHAOS_OPERATIONS=600 CHAOS_SECONDS=40
//! CHAOS_FAULTS=10 cargo test --test integration chaos -- --nocapture`
//! (add `redis` or `postgres` to the filter, e.g. `chaos::under_kills_and_postgres`,
//! for one store only).

use crate::support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::Method;
use idemproxy::config::Config;
use serde_json::Value;
use support::binary::ProxyProcess;
use support::postgres_server::{self, PostgresServer};
use support::proxy::{postgres_config, redis_config, Reply, TestClient};
use support::redis_server::{self, RedisOptions, RedisServer};
use support::upstream::TestUpstream;
use tokio::task::JoinSet;
use tokio::time::{sleep, Instant};

/// The store the two proxies share, and its crash.
trait ChaosStore {
    /// Its name in messages.
    const NAME: &'static str;
    /// A proxy's store settings on it, under a prefix of this run's own
    /// (every proxy of the run gets the same).
    fn config(&self, upstream: &TestUpstream) -> Config;
    /// Crashes it; returns once it is gone.
    fn crash(&mut self);
    /// Starts it again on the same port and data; returns once it answers.
    fn restart(&mut self);
    /// Its log, for a failure's message.
    fn log(&self) -> String;
}

impl ChaosStore for RedisServer {
    const NAME: &'static str = "Redis";

    fn config(&self, upstream: &TestUpstream) -> Config {
        let prefix = redis_server::unique_prefix("chaos");
        redis_config(&upstream.url(), &self.url(), &prefix)
    }

    /// SIGKILL: what the append-only file holds comes back.
    fn crash(&mut self) {
        self.kill();
    }

    fn restart(&mut self) {
        RedisServer::restart(self);
    }

    fn log(&self) -> String {
        RedisServer::log(self)
    }
}

impl ChaosStore for PostgresServer {
    const NAME: &'static str = "PostgreSQL";

    fn config(&self, upstream: &TestUpstream) -> Config {
        let prefix = postgres_server::unique_prefix("chaos");
        postgres_config(&upstream.url(), &self.url(), &prefix)
    }

    /// Immediate shutdown: the restart replays the WAL.
    fn crash(&mut self) {
        PostgresServer::crash(self);
    }

    /// Starts it again, then freezes it for 400 ms: the first statements
    /// after the restart answer after `store.timeout`, and those that take
    /// a killed proxy's key over to reconcile it land after their callers
    /// were answered 503 (issue 52: such a claim, released, freed the key
    /// and the next retry ran the operation again).
    fn restart(&mut self) {
        PostgresServer::restart(self);
        self.freeze(Duration::from_millis(400));
    }

    fn log(&self) -> String {
        PostgresServer::log(self)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_kills_and_redis_crashes_every_operation_runs_once_and_none_stays_unknown() {
    let aof = ["--appendonly", "yes", "--appendfsync", "always"];
    let redis = tokio::task::block_in_place(|| {
        RedisServer::start_with(RedisOptions {
            extra_args: aof.iter().map(|a| a.to_string()).collect(),
            ..RedisOptions::default()
        })
    });
    chaos(redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_kills_and_postgres_crashes_every_operation_runs_once_and_none_stays_unknown() {
    let postgres = tokio::task::block_in_place(PostgresServer::start);
    chaos(postgres).await;
}

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
    answered_at: Option<Instant>,
    /// `outcome-unknown` answers on the way (each resolved by a later
    /// retry's lookup, or the operation fails the run).
    unknown_seen: usize,
    attempts: usize,
    unexpected: Vec<String>,
    /// Each attempt: when (UTC), through which proxy, what came back.
    history: Vec<String>,
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The time of day (UTC) to the millisecond, as the proxies' logs show it.
fn clock() -> String {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let (s, ms) = (since.as_secs() % 86_400, since.subsec_millis());
    format!("{:02}:{:02}:{:02}.{ms:03}", s / 3600, s / 60 % 60, s % 60)
}

/// The proxies' base URLs, which a restart changes.
type Live = Arc<Mutex<Vec<String>>>;

fn live_url(live: &Live, pick: usize) -> String {
    let urls = live.lock().unwrap_or_else(|e| e.into_inner());
    urls[pick % urls.len()].clone()
}

/// Which proxies an operation's attempts go through.
#[derive(Clone, Copy)]
enum Via {
    /// The first through this one, then through either in turn.
    Either(usize),
    /// Every one through this one (whichever process it is by then).
    Only(usize),
}

/// Sends the operation keyed `key` to `target`, through the proxies `via`
/// says, retrying what is no answer yet, every `pause`, until it has one or
/// [`RETRY_WINDOW`] has passed.
async fn settle(key: String, target: String, live: Live, via: Via, pause: Duration) -> Settled {
    let until = Instant::now() + RETRY_WINDOW;
    let client = TestClient::new();
    let body = format!(r#"{{"key":"{key}","amount":700}}"#);
    let mut settled = Settled {
        key,
        answer: None,
        answered_at: None,
        unknown_seen: 0,
        attempts: 0,
        unexpected: Vec::new(),
        history: Vec::new(),
    };
    while Instant::now() < until {
        let pick = match via {
            Via::Either(first) => first + settled.attempts,
            Via::Only(proxy) => proxy,
        };
        let base = live_url(&live, pick);
        let url = format!("{base}{target}");
        settled.attempts += 1;
        // The proxies log it: their lines about the key are found by it.
        let request_id = format!("{}/{}", settled.key, settled.attempts);
        let headers = [
            ("content-type", "application/json"),
            ("idempotency-key", settled.key.as_str()),
            ("x-request-id", request_id.as_str()),
        ];
        let sent_at = clock();
        let within = Duration::from_secs(8);
        let sent = client
            .try_send(Method::POST, &url, &headers, body.clone(), within)
            .await;
        let port = base.rsplit(':').next().unwrap_or_default();
        settled.history.push(format!(
            "{sent_at}-{} #{} via :{port}: {}",
            clock(),
            settled.attempts,
            describe(&sent)
        ));
        // A failed exchange: the proxy died under the request, or was gone.
        match sent.map(|reply| classify(&reply)) {
            Ok(Seen::End(answer)) => {
                settled.answer = Some(answer);
                settled.answered_at = Some(Instant::now());
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

/// A pause between an operation's attempts, 150 to 250 ms, different
/// across keys so that retries do not march in step.
fn pause_for(key: &str) -> Duration {
    Duration::from_millis(150 + (key.len() as u64 * 37 % 100))
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

/// An attempt's answer in a few words: status, execution or problem type,
/// replayed or reconciled; or why there was none.
fn describe(sent: &Result<Reply, String>) -> String {
    let reply = match sent {
        Ok(reply) => reply,
        Err(e) => return format!("no answer: {e}"),
    };
    let json = serde_json::from_slice::<Value>(&reply.body).unwrap_or_default();
    let what = match (json["execution"].as_u64(), json["type"].as_str()) {
        (Some(n), _) => format!("execution {n}"),
        (None, Some(kind)) => kind.trim_start_matches("urn:idemproxy:problem:").to_owned(),
        (None, None) => String::from_utf8_lossy(&reply.body)
            .chars()
            .take(80)
            .collect(),
    };
    let marks = [
        ("idempotent-replayed", " replayed"),
        ("idempotency-reconciled", " reconciled"),
    ];
    let marked: String = marks
        .iter()
        .filter(|(header, _)| reply.header(header) == Some("true"))
        .map(|(_, mark)| *mark)
        .collect();
    format!("{} {what}{marked}", reply.status.as_u16())
}

/// The run's route on `store`: short upstream timeout and lease, unknown
/// outcomes looked up in the upstream's ledger.
fn chaos_config(upstream: &TestUpstream, store: &impl ChaosStore) -> Config {
    let mut c = store.config(upstream);
    // Lease: 1 s upstream timeout + 1.4 s margin (the least a 250 ms store
    // timeout allows) + 1 s lookup.
    c.upstream.timeout = Duration::from_secs(1);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.idempotency.reconcile_url = "/ledger/{key}".into();
    c
}

/// How long an operation is retried: time to ride out a lease or two.
const RETRY_WINDOW: Duration = Duration::from_secs(30);

/// How long a crashed store stays down before its restart begins: long
/// enough for requests to arrive while it is gone (a restart here takes
/// ~0.1 s, far less than a production server's recovery).
const STORE_DOWN: Duration = Duration::from_millis(600);

/// The longest of `durations` (zero if none).
fn longest(durations: &[Duration]) -> Duration {
    durations.iter().copied().max().unwrap_or_default()
}

/// The run against `store`; panics, saying what went wrong with which
/// keys, unless every operation ran once and ended with its answer.
async fn chaos<S: ChaosStore>(mut store: S) {
    let operations = env_or("CHAOS_OPERATIONS", 150);
    let run = Duration::from_secs(env_or("CHAOS_SECONDS", 10) as u64);
    let faults = env_or("CHAOS_FAULTS", 4);
    let upstream = TestUpstream::start().await;
    let c = chaos_config(&upstream, &store);
    let mut proxies = [
        ProxyProcess::start(c.clone()).await,
        ProxyProcess::start(c.clone()).await,
    ];
    // The killed proxies, kept for their logs.
    let mut fallen = Vec::new();
    let live: Live = Arc::new(Mutex::new(proxies.iter().map(|p| p.url("")).collect()));
    let mut timeline = vec![format!(
        "{} start: {} proxies {} and {}",
        clock(),
        S::NAME,
        proxies[0].url(""),
        proxies[1].url("")
    )];
    let started = Instant::now();
    let at = |i: usize, of: usize| started + run.mul_f64(i as f64 / of as f64);

    let mut clients = JoinSet::new();
    for op in 0..operations {
        let key = format!("chaos-{op}");
        // A third of the operations are sent twice at once.
        for copy in 0..1 + usize::from(op % 3 == 0) {
            let (key, live, arrival) = (key.clone(), live.clone(), at(op, operations));
            let target = "/v1/chaos?ledger=1&delay_ms=60".to_owned();
            let pause = pause_for(&key);
            clients.spawn(async move {
                tokio::time::sleep_until(arrival).await;
                settle(key, target, live, Via::Either(op + copy), pause).await
            });
        }
    }

    // Each proxy kill catches a request at the upstream: its key is one
    // only the lookup can answer, once its claim's lease ends. Each store
    // crash comes just before that (so the retries that would take the key
    // over find the store gone), and catches a request at the upstream
    // too, which its proxy, alive, must settle once the store is back;
    // then a fresh key through each proxy, retried every 20 ms, says when
    // both serve again.
    //
    // The lease: the upstream timeout, the margin, the lookup's timeout
    // (the upstream's).
    let lease = c.upstream.timeout * 2 + c.idempotency.lease_margin;
    let mut last_kill = None;
    let mut held = Vec::new();
    let mut probes = Vec::new();
    let (mut kills, mut crashes) = (0, 0);
    let (mut restarts, mut serving_after) = (Vec::new(), Vec::new());
    for fault in 0..faults {
        let crash = fault % 2 == 1;
        let when = match last_kill {
            Some(killed) if crash => killed + lease - Duration::from_millis(200),
            _ => at(fault + 1, faults + 1),
        };
        tokio::time::sleep_until(when).await;
        let holder = if crash { crashes } else { kills } % proxies.len();
        let key = format!("chaos-{}-{fault}", if crash { "crossed" } else { "held" });
        let target = format!("/v1/chaos?ledger=1&hold={key}");
        let (k, l, pause) = (key.clone(), live.clone(), pause_for(&key));
        clients.spawn(async move { settle(k, target, l, Via::Either(holder), pause).await });
        let arrived = async {
            while upstream.ledger(&key).is_empty() {
                sleep(Duration::from_millis(10)).await;
            }
        };
        let at_upstream = tokio::time::timeout(Duration::from_secs(10), arrived).await;
        assert!(
            at_upstream.is_ok(),
            "{key} never reached the upstream through {}:\n{}",
            proxies[holder].url(""),
            proxies[holder].logs()
        );
        if !crash {
            proxies[holder].kill();
            last_kill = Some(Instant::now());
            upstream.release(&key);
            timeline.push(format!(
                "{} SIGKILL {} holding {key}",
                clock(),
                proxies[holder].url("")
            ));
            let replacement = ProxyProcess::start(c.clone()).await;
            timeline.push(format!(
                "{} {} started in its place",
                clock(),
                replacement.url("")
            ));
            fallen.push(std::mem::replace(&mut proxies[holder], replacement));
            live.lock().unwrap_or_else(|e| e.into_inner())[holder] = proxies[holder].url("");
            held.push(key);
            kills += 1;
            continue;
        }
        timeline.push(format!(
            "{} {} crash, {} holding {key}",
            clock(),
            S::NAME,
            proxies[holder].url("")
        ));
        tokio::task::block_in_place(|| store.crash());
        // The held request comes back while the store is gone: its proxy
        // settles the key once it is back.
        sleep(STORE_DOWN / 2).await;
        upstream.release(&key);
        timeline.push(format!("{} {key} released", clock()));
        sleep(STORE_DOWN / 2).await;
        let restarted = Instant::now();
        tokio::task::block_in_place(|| store.restart());
        restarts.push(restarted.elapsed());
        timeline.push(format!(
            "{} {} back, its restart took {:?}",
            clock(),
            S::NAME,
            restarted.elapsed()
        ));
        let probing = (0..proxies.len()).map(|proxy| {
            let key = format!("chaos-probe-{fault}-{proxy}");
            let target = "/v1/chaos?ledger=1".to_owned();
            let pause = Duration::from_millis(20);
            settle(key, target, live.clone(), Via::Only(proxy), pause)
        });
        for probe in futures_util::future::join_all(probing).await {
            let serving = probe.answered_at.map(|at| at - restarted);
            timeline.push(format!(
                "{} {} answered {serving:?} after the restart began, in {} attempts; the last: {}",
                clock(),
                probe.key,
                probe.attempts,
                probe.history.last().map_or("-", String::as_str)
            ));
            serving_after.extend(serving);
            probes.push(probe);
        }
        crashes += 1;
    }

    let mut settled = Vec::new();
    while let Some(done) = clients.join_next().await {
        settled.push(done.expect("a client task"));
    }
    timeline.push(format!("{} every client done", clock()));
    for client in settled.iter().filter(|s| {
        let reconciled = matches!(s.answer, Some(Answer::Reconciled(_)));
        reconciled || s.key.contains("-held-") || s.key.contains("-crossed-")
    }) {
        timeline.push(format!(
            "{} ended {:?} after {} attempts; the first: {}; the last: {}",
            client.key,
            client.answer,
            client.attempts,
            client.history.first().map_or("-", String::as_str),
            client.history.last().map_or("-", String::as_str)
        ));
    }
    let probe_count = probes.len();
    settled.extend(probes);

    // Every problem, by key.
    let mut wrong: Vec<(String, String)> = Vec::new();
    let (mut executed, mut reconciled, mut unknown_seen, mut attempts) = (0, 0, 0, 0);
    let mut keys_seen_unknown = std::collections::BTreeSet::new();
    for client in &settled {
        let key = &client.key;
        if !client.unexpected.is_empty() {
            wrong.push((key.clone(), "got answers no client should get".into()));
        }
        let ledger = upstream.ledger(key);
        if ledger.len() > 1 {
            wrong.push((key.clone(), format!("executed {} times", ledger.len())));
        }
        let Some(answer) = client.answer else {
            let why = match client.unknown_seen {
                0 => "no answer by the end".to_owned(),
                n => format!("left outcome-unknown ({n} such answers, none resolved)"),
            };
            wrong.push((key.clone(), why));
            continue;
        };
        let ran = ledger.first().and_then(|json| json["execution"].as_u64());
        if ran != Some(answer.execution()) {
            wrong.push((
                key.clone(),
                format!(
                    "answered execution {} of {answer:?}, not the ledger's {ran:?}",
                    answer.execution()
                ),
            ));
        }
        match answer {
            Answer::Executed(_) => executed += 1,
            Answer::Reconciled(_) => reconciled += 1,
        }
        unknown_seen += client.unknown_seen;
        if client.unknown_seen > 0 {
            keys_seen_unknown.insert(key.as_str());
        }
        attempts += client.attempts;
    }
    // Killed proxies' keys whose retries found the store down, as the
    // crash's timing means them to.
    let mut met_down = 0;
    for key in &held {
        let clients = settled.iter().filter(|s| &s.key == key);
        met_down += clients
            .clone()
            .filter(|c| c.history.iter().any(|a| a.contains(": 503 ")))
            .count();
        if clients.clone().count() == 0 {
            wrong.push((key.clone(), "a held request with no client".into()));
        }
        for client in clients {
            if !matches!(client.answer, Some(Answer::Reconciled(_)) | None) {
                wrong.push((
                    key.clone(),
                    "a request its proxy died holding is the lookup's to answer, \
                     yet it was answered otherwise"
                        .into(),
                ));
            }
        }
    }
    if !wrong.is_empty() {
        let logs: Vec<(String, String)> = fallen
            .iter()
            .map(|p| (format!("{} (killed)", p.url("")), p.logs()))
            .chain(proxies.iter().map(|p| (p.url(""), p.logs())))
            .collect();
        panic!(
            "{}",
            report(&wrong, &settled, &upstream, &logs, &timeline, &store.log())
        );
    }
    for event in &timeline {
        eprintln!("  {event}");
    }
    eprintln!(
        "chaos ({}): {} operations ({} clients, {attempts} attempts) over {run:?}, {kills} proxy \
         kills ({met_down} of their keys retried into a store crash), {crashes} {} crashes \
         (down {STORE_DOWN:?}, restarts took at most {:?}, both proxies serving again at most \
         {:?} after a restart began): {executed} answered \
         executed or replayed, {reconciled} reconciled, {unknown_seen} outcome-unknown answers \
         on the way to {} keys (each resolved), none run twice, none left unknown; took {:?}",
        S::NAME,
        operations + kills + crashes + probe_count,
        settled.len(),
        S::NAME,
        longest(&restarts),
        longest(&serving_after),
        keys_seen_unknown.len(),
        started.elapsed()
    );
}

/// The keys that went wrong, each with what its clients saw, the ledger's
/// entries and the proxies' lines about it; then the faults' timeline and
/// the end of the store's log.
fn report(
    wrong: &[(String, String)],
    settled: &[Settled],
    upstream: &TestUpstream,
    logs: &[(String, String)],
    timeline: &[String],
    store_log: &str,
) -> String {
    const DETAILED: usize = 6;
    let keys: BTreeSet<&str> = wrong.iter().map(|(key, _)| key.as_str()).collect();
    let mut out = format!("{} key(s) went wrong:\n", keys.len());
    for (key, why) in wrong {
        out += &format!("  {key}: {why}\n");
    }
    for key in keys.iter().take(DETAILED) {
        out += &format!("\n=== {key}\nledger: {:?}\n", upstream.ledger(key));
        for client in settled.iter().filter(|s| s.key == *key) {
            out += &format!(
                "a client: answer {:?}, {} attempts, unexpected {:?}\n",
                client.answer, client.attempts, client.unexpected
            );
            for attempt in &client.history {
                out += &format!("    {attempt}\n");
            }
        }
        out += &logged_about(key, logs);
    }
    if keys.len() > DETAILED {
        out += &format!("\n(and {} more keys)\n", keys.len() - DETAILED);
    }
    out += "\n=== timeline\n";
    for event in timeline {
        out += &format!("  {event}\n");
    }
    let lines: Vec<&str> = store_log.lines().collect();
    let tail = &lines[lines.len().saturating_sub(60)..];
    out += &format!("\n=== the store's log (last {} lines)\n", tail.len());
    for line in tail {
        out += &format!("  {line}\n");
    }
    out
}

/// Every proxy's log lines about `key`: its requests' (their request ids
/// are `KEY/ATTEMPT`), and those naming its store hash (a takeover, a
/// stale claim settled), which the requests' lines give.
fn logged_about(key: &str, logs: &[(String, String)]) -> String {
    let own = format!("{key}/");
    let mut hashes = BTreeSet::new();
    for (_, log) in logs {
        for line in log.lines().filter(|line| line.contains(&own)) {
            if let Some(at) = line.find("key_hash=") {
                let hash: String = line[at + 9..]
                    .trim_start_matches('"')
                    .chars()
                    .take_while(char::is_ascii_hexdigit)
                    .collect();
                if hash.len() == 64 {
                    hashes.insert(hash);
                }
            }
        }
    }
    let mut out = format!("its store hash: {hashes:?}\n");
    for (proxy, log) in logs {
        let about: Vec<&str> = log
            .lines()
            .filter(|line| line.contains(&own) || hashes.iter().any(|h| line.contains(h)))
            .collect();
        if !about.is_empty() {
            out += &format!("  {proxy} logged:\n");
            for line in about {
                out += &format!("    {line}\n");
            }
        }
    }
    out
}
