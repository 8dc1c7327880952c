//! Dictionaries the proxy learns from its own first responses
//! (`store.compression = "zstd"`, the default, without a configured
//! dictionary): two replicas on one real Redis share the one the first
//! learned, each reads the other's records (the second loads the
//! dictionary from the store when it first meets its id), and a restarted
//! replica still reads them all. The store stacks are the binary's
//! (`idemproxy::open_store`).

use crate::compression::{begin, response, store_response};
use crate::support;

use std::time::Duration;

use idemproxy::core::{Begin, BeginOutcome, Outcome, Record, RecordKey};
use idemproxy::store::compression::{dictionary_of, DictionaryId, CURRENT, SAMPLES};
use idemproxy::store::redis::RedisStore;
use idemproxy::store::{SharedStore, Store};
use support::keys::{fingerprint, json_post, record_key};
use support::proxy::{redis_config, TestClient, TestProxy};
use support::redis_server::{shared, unique_prefix};
use support::upstream::TestUpstream;

fn key(i: u32) -> RecordKey {
    let mut bytes = [0u8; 32];
    bytes[..4].copy_from_slice(&i.to_be_bytes());
    bytes[4] = 0x1e;
    RecordKey::from_bytes(bytes)
}

/// The dictionary the record under `key` was stored with, as Redis holds it.
async fn stored_with(raw: &RedisStore, key: RecordKey) -> Option<DictionaryId> {
    match raw.get(&key).await.expect("raw read") {
        Some(Record::Completed(record)) => match &record.outcome {
            Outcome::Packed(packed) => dictionary_of(packed),
            other => panic!("stored unpacked: {other:?}"),
        },
        other => panic!("no record: {other:?}"),
    }
}

/// Stores responses numbered from `*next` through `store` until one is
/// stored with a dictionary (within `within`), which it returns.
async fn store_until_compressed_with_dictionary(
    store: &SharedStore,
    raw: &RedisStore,
    next: &mut u32,
    within: Duration,
) -> DictionaryId {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let i = *next;
        *next += 1;
        store_response(&**store, key(i), response(i)).await;
        if let Some(id) = stored_with(raw, key(i)).await {
            return id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no record stored with a dictionary after {i}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A replay of record `i` through `store`: the response as it was stored.
async fn assert_replays(store: &SharedStore, i: u32, who: &str) {
    let begun = store
        .begin(&begin(key(i)))
        .await
        .unwrap_or_else(|e| panic!("{who}: record {i}: {e}"));
    let BeginOutcome::Completed(record) = begun else {
        panic!("{who}: record {i}: {begun:?}");
    };
    assert_eq!(
        record.outcome,
        Outcome::Response(response(i)),
        "{who}: record {i}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_a_learned_dictionary_and_read_each_others_records() {
    let upstream = TestUpstream::start().await;
    let config = redis_config(&upstream.url(), &shared().url(), &unique_prefix("learned"));
    let raw = RedisStore::connect(&config.store).await.expect("redis");
    let first = idemproxy::open_store(&config).await.expect("first replica");

    // Its first responses are stored without a dictionary while it learns.
    let mut next = 0;
    for _ in 0..SAMPLES {
        store_response(&*first, key(next), response(next)).await;
        assert_eq!(stored_with(&raw, key(next)).await, None, "record {next}");
        next += 1;
    }
    let id =
        store_until_compressed_with_dictionary(&first, &raw, &mut next, Duration::from_secs(30))
            .await;
    let with_dictionary = next - 1;
    let shared_record = raw.get(&CURRENT).await.expect("read the shared record");
    assert!(
        matches!(shared_record, Some(Record::Completed(_))),
        "the dictionary is shared: {shared_record:?}"
    );
    // Smaller than zstd without it: the point of learning.
    let packed_len = |record: Option<Record>| match record {
        Some(Record::Completed(record)) => match &record.outcome {
            Outcome::Packed(packed) => packed.len(),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    };
    let without = packed_len(raw.get(&key(0)).await.expect("read"));
    let with = packed_len(raw.get(&key(with_dictionary)).await.expect("read"));
    assert!(
        with * 2 < without,
        "{with} bytes with the dictionary, {without} without"
    );

    // A second replica, started after: reads the first's records (loading
    // the dictionary from the store), and compresses with the same one.
    let second = idemproxy::open_store(&config)
        .await
        .expect("second replica");
    assert_replays(&second, with_dictionary, "second").await;
    assert_replays(&second, 3, "second").await;
    let second_id =
        store_until_compressed_with_dictionary(&second, &raw, &mut next, Duration::from_secs(5))
            .await;
    assert_eq!(second_id, id, "the replicas compress alike");
    assert_replays(&first, next - 1, "first").await;

    // A proxy in front of the second replica replays a request the first
    // stored with the dictionary, without executing it.
    let target = "/v1/learned";
    let parts = json_post(target);
    let first_key = record_key(&parts, "learned-1");
    let begun = first
        .begin(&Begin {
            fingerprint: fingerprint(&parts, b"{}"),
            ..begin(first_key)
        })
        .await
        .expect("begin");
    let BeginOutcome::Acquired { token, .. } = begun else {
        panic!("{begun:?}");
    };
    let now = idemproxy::core::now_millis();
    let record = idemproxy::core::CompletedRecord {
        fingerprint: fingerprint(&parts, b"{}"),
        created_at: now,
        completed_at: now,
        expires_at: now + 3_600_000,
        outcome: Outcome::Response(response(77)),
    };
    first
        .complete(&first_key, token, &record)
        .await
        .expect("complete");
    assert_eq!(stored_with(&raw, first_key).await, Some(id));
    let proxy = TestProxy::start_with_store(config.clone(), second.clone()).await;
    let replay = TestClient::new()
        .post_json(&proxy.url(target), "learned-1", "{}")
        .await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed());
    assert_eq!(replay.body, response(77).body);
    assert_eq!(upstream.executions(target), 0, "answered from the record");
    proxy.shutdown().await;

    // Restarted: both gone, a new one reads every record, old and new.
    drop((first, second));
    let restarted = idemproxy::open_store(&config).await.expect("restarted");
    for i in [0, 3, with_dictionary, next - 1] {
        assert_replays(&restarted, i, "restarted").await;
    }
}

/// `learn_dictionary = false`: responses are still packed, each on its
/// own, and no dictionary reaches the store, while a proxy that learns,
/// fed the same responses alongside, has learned and shared one by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_told_not_to_learn_keeps_no_dictionary() {
    let upstream = TestUpstream::start().await;
    let learning_config = redis_config(&upstream.url(), &shared().url(), &unique_prefix("learns"));
    let mut plain_config = redis_config(
        &upstream.url(),
        &shared().url(),
        &unique_prefix("learns-not"),
    );
    plain_config.store.learn_dictionary = false;
    let learning_raw = RedisStore::connect(&learning_config.store)
        .await
        .expect("redis");
    let plain_raw = RedisStore::connect(&plain_config.store)
        .await
        .expect("redis");
    let learning = idemproxy::open_store(&learning_config)
        .await
        .expect("learning proxy");
    let plain = idemproxy::open_store(&plain_config)
        .await
        .expect("plain proxy");

    // Fed alike until the learning one has written 50 records with its
    // dictionary (a second of them at least): time enough for the other
    // to have learned too, had it been told to.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (mut i, mut with_dictionary) = (0, 0);
    while with_dictionary < 50 {
        store_response(&*learning, key(i), response(i)).await;
        store_response(&*plain, key(i), response(i)).await;
        if stored_with(&learning_raw, key(i)).await.is_some() {
            with_dictionary += 1;
        }
        assert_eq!(stored_with(&plain_raw, key(i)).await, None, "record {i}");
        i += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "the learning proxy learned nothing after {i} responses"
        );
        if i as usize >= SAMPLES {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(
        matches!(learning_raw.get(&CURRENT).await, Ok(Some(_))),
        "the learning proxy shared its dictionary"
    );
    assert_eq!(
        plain_raw.get(&CURRENT).await.expect("read"),
        None,
        "no dictionary shared by the proxy told not to learn"
    );
    for j in [0, i - 1] {
        assert_replays(&plain, j, "plain").await;
    }
}
