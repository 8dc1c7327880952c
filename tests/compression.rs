//! Compression of stored responses (DESIGN §2, `store.compression`): on
//! every store (memory, embedded, Redis, Redis Cluster) a response stored
//! plain, compressed, or compressed with a dictionary replays as it was; a
//! record an earlier build wrote still replays; a compressed response that
//! does not decompress fails closed and its request never runs again; the
//! binary trains a dictionary from what its store holds. Real Redis
//! servers, a real embedded store file, the real binary.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemproxy::config::{Compression, StoreKind};
use idemproxy::core::{
    Begin, BeginOutcome, Clock, CompletedRecord, FencingToken, Fingerprint, OnStale, Outcome,
    Record, RecordKey, StoredResponse,
};
use idemproxy::store::compression::{CompressedStore, Dictionary, Packer};
use idemproxy::store::redis::RedisStore;
use idemproxy::store::sealed::{Keyring, SealedStore};
use idemproxy::store::{EmbeddedStore, MemoryStore, ScanCursor, SharedStore, Store};
use support::binary::ProxyProcess;
use support::keys::{fingerprint, json_post, record_key};
use support::proxy::{config, TestClient, TestProxy};
use support::redis_server::{shared, shared_cluster, unique_prefix, RedisServer};
use support::upstream::TestUpstream;

/// A payment object as JSON APIs answer: what compression is for.
fn payment(i: u32) -> Bytes {
    Bytes::from(format!(
        r#"{{"id":"pi_{i:024}","object":"payment_intent","amount":{},"currency":"usd","status":"succeeded","customer":"cus_{:014}","metadata":{{"order_id":"{}","tool_call":"call_{:07}"}},"shipping":{{"address":{{"city":"Portland","country":"US","line1":"{} SE Hawthorne Blvd","postal_code":"97214","state":"OR"}},"name":"Jane Doe"}},"livemode":true,"payment_method_types":["card"],"receipt_email":"jane.doe@example.com"}}"#,
        499 + i * 7,
        i * 7919,
        100_000 + i,
        i * 31,
        i % 9000
    ))
}

pub(crate) fn response(i: u32) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("request-id".into(), Bytes::from(format!("req_{i:014}"))),
            ("x-shard".into(), Bytes::from_static(b"eu-west-7")),
            ("x-empty".into(), Bytes::new()),
        ],
        body: payment(i),
    }
}

/// A dictionary of raw content (zstd takes any bytes as one): payments
/// like the ones stored.
fn dictionary() -> Dictionary {
    let mut content = Vec::new();
    for i in 1000..1010 {
        content.extend_from_slice(&payment(i));
    }
    Dictionary::new(&content).expect("a dictionary")
}

/// How a store packs, by name.
fn packer(mode: &str) -> Packer {
    match mode {
        "off" => Packer::new(false, None, Vec::new(), 1 << 20),
        "zstd" => Packer::new(true, None, Vec::new(), 1 << 20),
        "dictionary" => Packer::new(true, Some(dictionary()), Vec::new(), 1 << 20),
        other => panic!("no mode {other}"),
    }
}

pub(crate) fn begin(key: RecordKey) -> Begin {
    Begin {
        key,
        fingerprint: Fingerprint([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        on_stale: OnStale::Store,
        token: FencingToken::random(),
        reconcile: false,
    }
}

/// Stores `response` under `key` through `store`, as the middleware does.
pub(crate) async fn store_response(store: &dyn Store, key: RecordKey, response: StoredResponse) {
    let begun = store.begin(&begin(key)).await.expect("begin");
    let BeginOutcome::Acquired { token, .. } = begun else {
        panic!("the key was free: {begun:?}");
    };
    let now = idemproxy::core::now_millis();
    let record = CompletedRecord {
        fingerprint: Fingerprint([7; 32]),
        created_at: now,
        completed_at: now,
        expires_at: now + 3_600_000,
        outcome: Outcome::Response(response),
    };
    store
        .complete(&key, token, &record)
        .await
        .expect("complete");
}

/// Every store kind, fresh: memory, an embedded file in `dir`, a Redis,
/// a Redis Cluster (each under a prefix of its own).
async fn every_store(dir: &std::path::Path) -> Vec<(&'static str, SharedStore)> {
    let redis = idemproxy::store::redis::open(&redis_settings(StoreKind::Redis))
        .await
        .expect("redis");
    let cluster = idemproxy::store::redis::open(&redis_settings(StoreKind::RedisCluster))
        .await
        .expect("redis cluster");
    vec![
        ("memory", Arc::new(MemoryStore::new()) as SharedStore),
        (
            "embedded",
            Arc::new(EmbeddedStore::open(dir).expect("embedded")) as SharedStore,
        ),
        ("redis", redis),
        ("redis-cluster", cluster),
    ]
}

fn redis_settings(kind: StoreKind) -> idemproxy::config::StoreSettings {
    let mut c = config("http://127.0.0.1:9").store;
    c.kind = kind;
    c.key_prefix = unique_prefix("compression");
    match kind {
        StoreKind::RedisCluster => {
            c.urls = tokio::task::block_in_place(|| shared_cluster().urls());
        }
        _ => c.url = tokio::task::block_in_place(|| shared().url()),
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_round_trips_plain_compressed_and_dictionary_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (kind, inner) in every_store(dir.path()).await {
        let mut sizes = Vec::new();
        for (i, mode) in ["off", "zstd", "dictionary"].into_iter().enumerate() {
            let store = CompressedStore::new(inner.clone(), packer(mode));
            let key = RecordKey::from_bytes([i as u8 + 1; 32]);
            let original = response(i as u32);
            store_response(&store, key, original.clone()).await;

            // What the store itself holds.
            let Some(Record::Completed(raw)) = inner.get(&key).await.expect("get") else {
                panic!("{kind}/{mode}: no completed record");
            };
            match (&raw.outcome, mode) {
                (Outcome::Response(stored), "off") => {
                    assert_eq!(
                        stored, &original,
                        "{kind}: off stores the response as it is"
                    );
                    sizes.push(original.encode().len());
                }
                (Outcome::Packed(packed), "zstd") => {
                    assert_eq!(packed[0], 2, "{kind}: the zstd layout");
                    sizes.push(packed.len());
                }
                (Outcome::Packed(packed), "dictionary") => {
                    assert_eq!(packed[0], 3, "{kind}: the dictionary layout");
                    assert_eq!(&packed[1..5], dictionary().id().as_bytes());
                    sizes.push(packed.len());
                }
                (other, _) => panic!("{kind}/{mode}: stored {other:?}"),
            }

            // A retry reads the response back as it was.
            let again = store.begin(&begin(key)).await.expect("begin again");
            let BeginOutcome::Completed(record) = again else {
                panic!("{kind}/{mode}: {again:?}");
            };
            assert_eq!(
                record.outcome,
                Outcome::Response(original.clone()),
                "{kind}/{mode}"
            );
            let Some(Record::Completed(read)) = store.get(&key).await.expect("get") else {
                panic!("{kind}/{mode}: get");
            };
            assert_eq!(read.outcome, Outcome::Response(original), "{kind}/{mode}");
        }
        assert!(
            sizes[1] < sizes[0] && sizes[2] * 2 < sizes[1],
            "{kind}: plain {}, zstd {}, dictionary {}",
            sizes[0],
            sizes[1],
            sizes[2]
        );

        // With compression turned off since, every record still reads (the
        // dictionary kept as a previous one), and a walk over the store
        // meets the three of them, unpacked.
        let off = CompressedStore::new(
            inner.clone(),
            Packer::new(false, None, vec![dictionary()], 1 << 20),
        );
        let mut met = Vec::new();
        let mut cursor = ScanCursor::start();
        loop {
            let page = off.scan(&cursor, 2).await.expect("scan");
            for (key, record) in page.records {
                let Record::Completed(record) = record else {
                    panic!("{kind}: a claim in the walk");
                };
                let i = u32::from(key.as_bytes()[0]) - 1;
                assert_eq!(
                    record.outcome,
                    Outcome::Response(response(i)),
                    "{kind}: {i}"
                );
                met.push(i);
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
        met.sort_unstable();
        met.dedup();
        assert_eq!(met, [0, 1, 2], "{kind}: the walk met every record");
    }
}

/// The configuration reaches the store `open_store` builds: `off` writes
/// responses as they came, `zstd` packs them with the configured
/// dictionary, and a dictionary moved to `previous_compression_dictionaries`
/// still reads its records with compression turned off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configuration_decides_how_responses_are_written_not_how_they_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dictionary = dir.path().join("responses.dict");
    let mut content = Vec::new();
    for i in 1000..1010 {
        content.extend_from_slice(&payment(i));
    }
    std::fs::write(&dictionary, &content).expect("write the dictionary");
    let mut c = config("http://127.0.0.1:9");
    c.store.kind = StoreKind::Embedded;
    c.store.path = dir.path().join("data");
    let (off, packed) = (
        RecordKey::from_bytes([1; 32]),
        RecordKey::from_bytes([2; 32]),
    );

    c.store.compression = Compression::Off;
    let store = idemproxy::open_store(&c).await.expect("open");
    store_response(&*store, off, response(1)).await;
    drop(store);
    c.store.compression = Compression::Zstd;
    c.store.compression_dictionary = Some(dictionary.clone());
    until_closed(&c.store.path).await;
    let store = idemproxy::open_store(&c).await.expect("open");
    store_response(&*store, packed, response(2)).await;
    drop(store);

    until_closed(&c.store.path).await;
    let raw = EmbeddedStore::open(&c.store.path).expect("the file");
    let outcome = |record: Option<Record>| match record {
        Some(Record::Completed(c)) => c.outcome,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        outcome(raw.get(&off).await.expect("get")),
        Outcome::Response(response(1))
    );
    match outcome(raw.get(&packed).await.expect("get")) {
        Outcome::Packed(bytes) => assert_eq!(bytes[0], 3, "the dictionary layout"),
        other => panic!("{other:?}"),
    }
    drop(raw);

    c.store.compression = Compression::Off;
    c.store.compression_dictionary = None;
    c.store.previous_compression_dictionaries = vec![dictionary];
    let store = idemproxy::open_store(&c).await.expect("open");
    for (key, i) in [(off, 1), (packed, 2)] {
        assert_eq!(
            outcome(store.get(&key).await.expect("get")),
            Outcome::Response(response(i))
        );
    }
}

/// Waits until the embedded store in `dir`, just dropped, has let go of
/// its file. The purge `open_store` starts at once may still be running on
/// the blocking pool, holding the file, for a moment after the store is
/// dropped; a second open meanwhile is refused as "already open".
async fn until_closed(dir: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match EmbeddedStore::open(dir) {
            Ok(_free) => return,
            Err(e) if tokio::time::Instant::now() < deadline => {
                assert!(e.to_string().contains("already open"), "{e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the store still holds its file after 10 s: {e}"),
        }
    }
}

/// With encryption at rest too, what is sealed is the packed response
/// (compression first: ciphertext does not compress), and it replays.
#[tokio::test]
async fn with_encryption_the_packed_response_is_what_is_sealed() {
    use base64::Engine;
    let keys = base64::engine::general_purpose::STANDARD.encode([3; 32]);
    let mut sizes = Vec::new();
    for mode in ["off", "zstd"] {
        let memory: SharedStore = Arc::new(MemoryStore::new());
        let sealed: SharedStore = Arc::new(SealedStore::new(
            memory.clone(),
            Keyring::parse(&keys).expect("keys"),
        ));
        let store = CompressedStore::new(sealed, packer(mode));
        let key = RecordKey::from_bytes([9; 32]);
        store_response(&store, key, response(9)).await;
        let Some(Record::Completed(raw)) = memory.get(&key).await.expect("get") else {
            panic!("{mode}: no record");
        };
        let Outcome::Sealed(sealed) = &raw.outcome else {
            panic!("{mode}: stored {:?}", raw.outcome);
        };
        // The seal's layout byte: 1 the response as it is, 2 packed.
        assert_eq!(sealed[0], if mode == "off" { 1 } else { 2 }, "{mode}");
        sizes.push(sealed.len());
        let again = store.begin(&begin(key)).await.expect("begin");
        let BeginOutcome::Completed(record) = again else {
            panic!("{mode}: {again:?}");
        };
        assert_eq!(record.outcome, Outcome::Response(response(9)), "{mode}");
    }
    assert!(
        sizes[1] < sizes[0],
        "sealed: plain {}, packed {}",
        sizes[0],
        sizes[1]
    );
}

/// A value the build before compression (c5f4ff8) wrote to Redis for the
/// request below, with `ttl = "365days"`: read back and replayed by this
/// build with compression on, its clock set to the hour after it was
/// written (so the fixture never expires).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_written_before_compression_still_replays() {
    const NAME: &str = "{8d483cc794eaae66cf924906b8d9436e56aff6cfef2134678ca550d58b6ee515}";
    const TARGET: &str = "/small/v1/payments";
    const BODY: &str = r#"{"amount":4999,"currency":"usd"}"#;
    const KEY: &str = "written-before-compression";
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/before_compression");
    let hex = std::fs::read_to_string(fixtures.join("redis_value.hex")).expect("fixture");
    let value = hex::decode(hex.trim()).expect("hex");
    let body = std::fs::read(fixtures.join("body.json")).expect("fixture body");

    // The fixture is what this request's identity says it is.
    let parts = json_post(TARGET);
    assert_eq!(format!("{{{}}}", record_key(&parts, KEY).to_hex()), NAME);
    let Ok(Record::Completed(written)) = Record::decode(&value[25..]) else {
        panic!("the fixture holds a completed record");
    };
    assert_eq!(written.fingerprint, fingerprint(&parts, BODY.as_bytes()));

    let upstream = TestUpstream::start().await;
    let redis = RedisServer::start();
    let prefix = unique_prefix("before");
    let mut conn = support::redis_server::connection(&redis.url()).await;
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}{NAME}"))
        .arg(&value)
        .query_async(&mut conn)
        .await
        .expect("plant the fixture");

    let mut c = config(&upstream.url());
    c.store.kind = StoreKind::Redis;
    c.store.url = redis.url();
    c.store.key_prefix = prefix;
    assert_eq!(
        c.store.compression,
        Compression::Zstd,
        "compression is on by default"
    );
    let inner = RedisStore::connect(&c.store)
        .await
        .expect("redis")
        .with_clock(Clock::tokio_from(written.completed_at + 3_600_000));
    let store: SharedStore = Arc::new(CompressedStore::new(Arc::new(inner), packer("zstd")));
    let proxy = TestProxy::start_with_store(c, store).await;
    let replay = TestClient::new()
        .post_json(&proxy.url(TARGET), KEY, BODY)
        .await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed());
    assert_eq!(replay.body, body);
    assert_eq!(replay.header("request-id"), Some("req_c6Y7h96vOjouJk"));
    assert_eq!(upstream.executions(TARGET), 0, "answered from the record");
}

/// A compressed response corrupted in the store, on every store: the
/// retry is answered 500 `record-unreadable` (permanent, not a 503 to
/// retry for a day) and the upstream never runs the request again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_compressed_response_fails_closed_on_every_store() {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    let dir = tempfile::tempdir().expect("tempdir");
    for (kind, inner) in every_store(dir.path()).await {
        let target = format!("/v1/corrupt-{kind}");
        let parts = json_post(&target);
        let key = record_key(&parts, "corrupt-1");
        // What the first execution stored, packed, with one byte of its
        // compressed frame flipped.
        let mut packed = packer("zstd").pack(&response(5)).to_vec();
        assert_eq!(packed[0], 2);
        let middle = packed.len() / 2;
        packed[middle] ^= 0x20;
        let begun = inner
            .begin(&Begin {
                fingerprint: fingerprint(&parts, b"{}"),
                ..begin(key)
            })
            .await
            .expect("begin");
        let BeginOutcome::Acquired { token, .. } = begun else {
            panic!("{kind}: {begun:?}");
        };
        let now = idemproxy::core::now_millis();
        let record = CompletedRecord {
            fingerprint: fingerprint(&parts, b"{}"),
            created_at: now,
            completed_at: now,
            expires_at: now + 3_600_000,
            outcome: Outcome::Packed(Bytes::from(packed)),
        };
        inner
            .complete(&key, token, &record)
            .await
            .expect("complete");

        let store: SharedStore = Arc::new(CompressedStore::new(inner, packer("zstd")));
        let proxy = TestProxy::start_with_store(config(&upstream.url()), store).await;
        for _ in 0..2 {
            let retry = client
                .post_json(&proxy.url(&target), "corrupt-1", "{}")
                .await;
            retry.assert_record_unreadable();
        }
        assert_eq!(upstream.executions(&target), 0, "{kind}: never executed");
        proxy.shutdown().await;
    }
}

/// The binary end to end on the embedded store: responses are stored
/// compressed by default, `store train-dictionary` learns from them (the
/// proxy stopped: the file is its), and the proxy restarted with the
/// dictionary replays the old records and stores new ones with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_trains_a_dictionary_from_its_store_and_uses_it() {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = config(&upstream.url());
    c.store.kind = StoreKind::Embedded;
    c.store.path = dir.path().join("data");
    // Six hundred durable writes in a row: on a CI disk shared with other
    // tests one fsync can pass the 250 ms default and answer 503, which is
    // right for the proxy and not what this test is about. (One second is
    // what the default lease margin allows.)
    c.store.timeout = Duration::from_secs(1);
    let client = TestClient::new();
    let mut proxy = ProxyProcess::start(c.clone()).await;
    let mut first = Vec::new();
    for i in 0..300 {
        // The test upstream answers `body_bytes` of text, and a JSON
        // document otherwise: both kinds get stored.
        let url = proxy.url(&format!("/v1/train/{i}?body_bytes={}", 200 + i % 7));
        first.push(client.post_json(&url, &format!("train-{i}"), "{}").await);
    }
    let refused: Vec<_> = first.iter().filter(|r| r.status != 201).collect();
    assert!(refused.is_empty(), "{refused:?}");
    proxy.terminate();
    proxy.wait_exit(Duration::from_secs(10)).await;

    let toml = dir.path().join("idemproxy.toml");
    std::fs::write(&toml, idemproxy::effective_toml(&c)).expect("write the config");
    let dictionary = dir.path().join("responses.dict");
    let output = std::process::Command::new(support::binary::BIN)
        .args(["store", "train-dictionary", "--size", "2048", "--out"])
        .arg(&dictionary)
        .arg("--config")
        .arg(&toml)
        .output()
        .expect("run train-dictionary");
    let said = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{said}");
    assert!(said.contains("trained on 270 responses"), "{said}");
    // Its walk's progress, as plain lines when stderr is not a terminal.
    let progress = String::from_utf8_lossy(&output.stderr);
    assert!(
        progress.contains(
            "store train-dictionary: 300 records examined, 300 of 5000 responses sampled ("
        ),
        "{progress}"
    );
    assert!(said.contains("held out"), "{said}");
    let trained = std::fs::read(&dictionary).expect("the dictionary");
    assert!(
        !trained.is_empty() && trained.len() <= 2048,
        "{}",
        trained.len()
    );

    c.store.compression_dictionary = Some(dictionary.clone());
    let proxy = ProxyProcess::start(c.clone()).await;
    for i in [0, 299] {
        let url = proxy.url(&format!("/v1/train/{i}?body_bytes={}", 200 + i % 7));
        let replay = client.post_json(&url, &format!("train-{i}"), "{}").await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, first[i].body);
    }
    let url = proxy.url("/v1/train/new?body_bytes=201");
    let new = client.post_json(&url, "train-new", "{}").await;
    assert_eq!(new.status, 201);
    assert!(client.post_json(&url, "train-new", "{}").await.replayed());
    assert_eq!(upstream.executions("/v1/train/new"), 1);
    drop(proxy);

    // A dictionary that is not there is a configuration error, named.
    let output = std::process::Command::new(support::binary::BIN)
        .arg("check")
        .env("IDEMPROXY_UPSTREAM__URL", upstream.url())
        .env(
            "IDEMPROXY_STORE__COMPRESSION_DICTIONARY",
            dir.path().join("missing.dict"),
        )
        .output()
        .expect("run idemproxy check");
    let said = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert!(
        said.contains("store.compression_dictionary") && said.contains("missing.dict"),
        "{said}"
    );
}
