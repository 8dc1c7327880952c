//! Encryption at rest (DESIGN §7): what the stores hold of a response is
//! sealed, replays open it, a key rotation keeps replays working, and a
//! record no configured key opens fails closed. Real Redis, a real
//! embedded store file, the real binary reading its keys from the
//! environment.

use crate::support;

use std::sync::Arc;

use base64::Engine;
use idemproxy::config::{Config, StoreKind};
use idemproxy::core::{CompletedRecord, FencingToken, Record, RecordKey};
use idemproxy::store::sealed::{Keyring, SealedStore};
use idemproxy::store::{
    Begin, BeginOutcome, EmbeddedStore, MemoryStore, Removal, Removed, SharedStore, Store,
    StoreError,
};
use support::binary::ProxyProcess;
use support::proxy::{config, redis_config, TestClient, TestProxy};
use support::redis_server::{unique_prefix, RedisOptions, RedisServer};
use support::upstream::TestUpstream;

/// What the upstream puts in its answer: the request path, so a path
/// holding this marker makes a response body holding it.
const MARKER: &str = "card-4242-4242-4242-4242";

fn key(byte: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([byte; 32])
}

fn keys(bytes: &[u8]) -> String {
    bytes.iter().map(|b| key(*b)).collect::<Vec<_>>().join(",")
}

/// `inner` sealed with `keys` (none: plain), with the local replay cache
/// in front as `open_store` puts it.
fn sealed(inner: SharedStore, keys: Option<&str>) -> SharedStore {
    let store: SharedStore = match keys {
        Some(keys) => Arc::new(SealedStore::new(inner, Keyring::parse(keys).expect("keys"))),
        None => inner,
    };
    idemproxy::store::cache::wrap(store, 100)
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// Every value under `prefix` in Redis, as bytes.
async fn redis_values(redis: &RedisServer, prefix: &str) -> Vec<Vec<u8>> {
    let mut conn = support::redis_server::connection(&redis.url()).await;
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    let mut values = Vec::new();
    for name in names {
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .unwrap_or(None);
        values.extend(value);
    }
    values
}

async fn post(client: &TestClient, proxy: &TestProxy, key: &str) -> support::proxy::Reply {
    client
        .post_json(&proxy.url(&format!("/v1/{MARKER}")), key, "{}")
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_no_plaintext_of_a_sealed_response() {
    let upstream = TestUpstream::start().await;
    let redis = RedisServer::start();
    let client = TestClient::new();
    for (sealing, prefix) in [
        (None, unique_prefix("plain")),
        (Some(keys(&[1])), unique_prefix("sealed")),
    ] {
        let c = redis_config(&upstream.url(), &redis.url(), &prefix);
        let inner = idemproxy::store::redis::open(&c.store)
            .await
            .expect("redis store");
        let proxy = TestProxy::start_with_store(c, sealed(inner, sealing.as_deref())).await;
        let first = post(&client, &proxy, "secret-1").await;
        assert_eq!(first.status, 201);
        assert!(
            contains(&first.body, MARKER),
            "the client gets the plaintext"
        );
        let replay = post(&client, &proxy, "secret-1").await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        let values = redis_values(&redis, &prefix).await;
        assert_eq!(values.len(), 1, "one record under {prefix}");
        let leaked = values.iter().any(|v| contains(v, MARKER));
        // The control run shows the check can see a leak.
        assert_eq!(leaked, sealing.is_none(), "sealed: {}", sealing.is_some());
    }
}

/// Whether any file of the directory tree at `dir` (the embedded store's
/// journals and tables) holds `needle`.
fn any_file_contains(dir: &std::path::Path, needle: &str) -> bool {
    let (mut found, mut dirs) = (false, vec![dir.to_path_buf()]);
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("store dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                found |= contains(&std::fs::read(&path).expect("read a store file"), needle);
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_file_holds_no_plaintext_of_a_sealed_response() {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    for sealing in [None, Some(keys(&[1]))] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut c = config(&upstream.url());
        c.store.kind = StoreKind::Embedded;
        c.store.path = dir.path().to_path_buf();
        let inner: SharedStore = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let proxy = TestProxy::start_with_store(c, sealed(inner, sealing.as_deref())).await;
        let first = post(&client, &proxy, "secret-2").await;
        assert!(post(&client, &proxy, "secret-2").await.replayed());
        assert!(contains(&first.body, MARKER));
        proxy.shutdown().await;
        let leaked = any_file_contains(dir.path(), MARKER);
        assert_eq!(leaked, sealing.is_none(), "sealed: {}", sealing.is_some());
    }
}

/// One memory store behind three proxies in turn, as three deployments of
/// one configuration would see it: sealed by key 1; then keys "2,1" (the
/// rotation: 2 seals, 1 still opens); then key 2 alone (1 removed).
#[tokio::test]
async fn replays_survive_a_rotation_and_a_removed_key_fails_closed() {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    let memory: SharedStore = Arc::new(MemoryStore::new());
    let deploy = |keyring: String| {
        let c: Config = config(&upstream.url());
        let store = sealed(memory.clone(), Some(&keyring));
        TestProxy::start_with_store(c, store)
    };

    let first = deploy(keys(&[1])).await;
    let original = post(&client, &first, "rotate-1").await;
    assert_eq!(original.status, 201);
    first.shutdown().await;

    let rotated = deploy(keys(&[2, 1])).await;
    let replay = post(&client, &rotated, "rotate-1").await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, original.body);
    let newer = post(&client, &rotated, "rotate-2").await;
    assert_eq!(newer.status, 201);
    rotated.shutdown().await;

    let removed = deploy(keys(&[2])).await;
    assert!(
        post(&client, &removed, "rotate-2").await.replayed(),
        "sealed by key 2"
    );
    let unreadable = post(&client, &removed, "rotate-1").await;
    unreadable.assert_record_unreadable();
    assert_eq!(
        upstream.executions(&format!("/v1/{MARKER}")),
        2,
        "nothing executed twice"
    );
}

/// The binary reads its keys from the variable `encryption_keys_env`
/// names, and refuses to start on a bad one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_seals_with_the_keys_its_environment_holds() {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = config(&upstream.url());
    c.store.kind = StoreKind::Embedded;
    c.store.path = dir.path().join("data");
    c.store.encryption_keys_env = Some("STORE_KEYS_UNDER_TEST".into());
    let env = [("STORE_KEYS_UNDER_TEST", keys(&[5, 6]))];
    let mut proxy = ProxyProcess::start_with_env(c.clone(), &env).await;
    let client = TestClient::new();
    let url = proxy.url(&format!("/v1/{MARKER}"));
    let first = client.post_json(&url, "bin-1", "{}").await;
    assert!(client.post_json(&url, "bin-1", "{}").await.replayed());
    assert!(contains(&first.body, MARKER));
    proxy.terminate();
    proxy.wait_exit(std::time::Duration::from_secs(10)).await;
    assert!(
        !any_file_contains(&dir.path().join("data"), MARKER),
        "plaintext in the store's files"
    );

    let short = base64::engine::general_purpose::STANDARD.encode([1; 16]);
    let output = std::process::Command::new(support::binary::BIN)
        .arg("check")
        .env("IDEMPROXY_UPSTREAM__URL", upstream.url())
        .env(
            "IDEMPROXY_STORE__ENCRYPTION_KEYS_ENV",
            "STORE_KEYS_UNDER_TEST",
        )
        .env("STORE_KEYS_UNDER_TEST", &short)
        .output()
        .expect("run idemproxy check");
    let said = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert!(
        said.contains("store.encryption_keys_env") && said.contains("key 1 is 16 bytes"),
        "{said}"
    );
    assert!(!said.contains(&short), "the key is not echoed: {said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_holds_no_plaintext_of_a_sealed_response() {
    let upstream = TestUpstream::start().await;
    let cluster = tokio::task::block_in_place(|| support::redis_server::RedisCluster::start(3));
    let client = TestClient::new();
    for (sealing, prefix) in [
        (None, unique_prefix("plain")),
        (Some(keys(&[4])), unique_prefix("sealed")),
    ] {
        let mut c = config(&upstream.url());
        c.store.kind = StoreKind::RedisCluster;
        c.store.urls = cluster.urls();
        c.store.key_prefix = prefix.clone();
        let inner = idemproxy::store::redis::open(&c.store)
            .await
            .expect("cluster store");
        let proxy = TestProxy::start_with_store(c, sealed(inner, sealing.as_deref())).await;
        let first = post(&client, &proxy, "secret-c").await;
        assert_eq!(first.status, 201);
        assert!(post(&client, &proxy, "secret-c").await.replayed());
        // redis-cli prints a value's bytes as they are when not on a terminal.
        let mut values = String::new();
        for node in &cluster.nodes {
            let names = tokio::task::block_in_place(|| node.cli(&["KEYS", &format!("{prefix}*")]));
            for name in names.lines().filter(|n| !n.is_empty()) {
                values.push_str(&tokio::task::block_in_place(|| node.cli(&["GET", name])));
            }
        }
        assert!(!values.is_empty(), "the record is on some node");
        assert_eq!(
            values.contains(MARKER),
            sealing.is_none(),
            "sealed: {}",
            sealing.is_some()
        );
    }
}

/// The real binary on Redis: a response sealed under key 7, then the
/// proxy redeployed with key 8 alone (7 rotated away too early) and with
/// encryption turned off. Each time the retry is refused as permanent,
/// 500 `record-unreadable` with no retry hint, counted as
/// `record_unreadable`, and never executed again. Before, the first was a
/// 503 `store-unavailable` (SDKs and agents retried it for the whole
/// `ttl`), and the second a 500 `internal` without retry hints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_no_configured_key_opens_is_refused_as_permanent() {
    let upstream = TestUpstream::start().await;
    let redis = tokio::task::block_in_place(RedisServer::start);
    let client = TestClient::new();
    let c = redis_config(&upstream.url(), &redis.url(), &unique_prefix("rotated"));
    let with_keys = |keys: Option<String>| {
        let mut c = c.clone();
        let mut env = Vec::new();
        if let Some(keys) = keys {
            c.store.encryption_keys_env = Some("STORE_KEYS_UNDER_TEST".into());
            env.push(("STORE_KEYS_UNDER_TEST", keys));
        }
        async move { ProxyProcess::start_with_env(c, &env).await }
    };
    let target = format!("/v1/{MARKER}");

    let mut first = with_keys(Some(keys(&[7]))).await;
    let done = client.post_json(&first.url(&target), "rot-1", "{}").await;
    assert_eq!(done.status, 201, "{done:?}");
    first.terminate();
    first.wait_exit(std::time::Duration::from_secs(10)).await;

    for ring in [Some(keys(&[8])), None] {
        let mut proxy = with_keys(ring.clone()).await;
        for _ in 0..2 {
            let refused = client.post_json(&proxy.url(&target), "rot-1", "{}").await;
            refused.assert_record_unreadable();
        }
        let series = r#"idemproxy_requests_total{route="default",outcome="record_unreadable"}"#;
        let counted = client.metric(&proxy.admin_url("/metrics"), series).await;
        assert_eq!(counted, 2.0, "keys {ring:?}");
        proxy.terminate();
        proxy.wait_exit(std::time::Duration::from_secs(10)).await;
    }
    assert_eq!(upstream.executions(&target), 1, "never executed again");
}

/// A store that applies the first completion it is sent, then reports
/// its reply lost (a connection reset after Redis ran the script) and
/// runs `after_first`; it keeps what the store answered each completion.
struct LosesFirstReply {
    inner: SharedStore,
    answers: std::sync::Mutex<Vec<Result<(), StoreError>>>,
    after_first: Box<dyn Fn() + Send + Sync>,
}

impl LosesFirstReply {
    fn answers(&self) -> Vec<Result<(), StoreError>> {
        self.answers.lock().expect("answers").clone()
    }
}

#[async_trait::async_trait]
impl Store for LosesFirstReply {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        self.inner.begin(begin).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        let answer = self.inner.complete(key, token, record).await;
        let first = {
            let mut answers = self.answers.lock().expect("answers");
            answers.push(answer.clone());
            answers.len() == 1
        };
        if first {
            (self.after_first)();
            return Err(StoreError::Unavailable("reply lost (test)".into()));
        }
        answer
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        self.inner.remove(key, removal).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    fn kind(&self) -> &'static str {
        "loses-first-reply"
    }
}

/// Waits until `replica` has synced from its primary.
fn synced(replica: &RedisServer) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !replica
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never synced"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Encryption on, `min_replica_acks = 1`, and a completion whose first
/// reply is lost after Redis applied it and the replica acknowledged it.
/// The retry sends the very bytes of the first try, so the settle script
/// finds its own write and the store waits for the replica again: with
/// the replica detached in between, the retry fails on the missing
/// acknowledgement (not fenced), and once it is back the completion
/// counts. Before, the retry was sealed again under a new nonce, the
/// script took it for someone else's write (fenced) and the proxy went
/// on without the acknowledgement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_sealed_completion_still_waits_for_the_replicas() {
    let upstream = TestUpstream::start().await;
    let primary = tokio::task::block_in_place(RedisServer::start);
    let replica_of = [
        "REPLICAOF".to_string(),
        "127.0.0.1".into(),
        primary.port().to_string(),
    ];
    let replica = tokio::task::block_in_place(|| {
        RedisServer::start_with(RedisOptions {
            extra_args: vec![
                "--replicaof".into(),
                "127.0.0.1".into(),
                primary.port().to_string(),
            ],
            ..RedisOptions::default()
        })
    });
    tokio::task::block_in_place(|| synced(&replica));
    let replica = Arc::new(replica);

    let mut c = redis_config(&upstream.url(), &primary.url(), &unique_prefix("acks"));
    c.store.min_replica_acks = 1;
    c.store.replica_ack_timeout = std::time::Duration::from_millis(200);
    c.store.timeout = std::time::Duration::from_secs(1);
    let redis = idemproxy::store::redis::open(&c.store)
        .await
        .expect("redis store");
    let detach = replica.clone();
    let lossy = Arc::new(LosesFirstReply {
        inner: redis,
        answers: std::sync::Mutex::default(),
        after_first: Box::new(move || {
            detach.cli(&["REPLICAOF", "NO", "ONE"]);
        }),
    });
    let store = sealed(lossy.clone(), Some(&keys(&[9])));
    let proxy = TestProxy::start_with_store(c, store).await;
    let client = TestClient::new();
    let first = post(&client, &proxy, "acks-1").await;
    assert_eq!(first.status, 201, "{first:?}");

    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while lossy.answers().len() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "never retried");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let answers = lossy.answers();
    assert!(answers[0].is_ok(), "{answers:?}");
    assert!(
        matches!(&answers[1], Err(StoreError::Unavailable(why)) if why.contains("replicas acknowledged")),
        "the retry is the same write and waits for the replica: {answers:?}"
    );

    // The replica back, a later try of the same completion counts.
    let args: Vec<&str> = replica_of.iter().map(String::as_str).collect();
    tokio::task::block_in_place(|| {
        replica.cli(&args);
        synced(&replica);
    });
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !matches!(lossy.answers().last(), Some(Ok(()))) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            lossy.answers()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        lossy
            .answers()
            .iter()
            .all(|a| !matches!(a, Err(StoreError::Fenced))),
        "never taken for another writer's: {:?}",
        lossy.answers()
    );
    let replay = post(&client, &proxy, "acks-1").await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.executions(&format!("/v1/{MARKER}")), 1);
    proxy.shutdown().await;
}
