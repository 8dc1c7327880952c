//! Keys are never executed twice, however many duplicates arrive at once:
//! on the memory store, and on the embedded store, which commits the
//! changes in flight together in groups.

use crate::support;

use std::time::Duration;

use idemproxy::config::{Config, StoreKind};
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::upstream::TestUpstream;
use tempfile::TempDir;
use tokio::task::JoinSet;

/// The proxy in front of `upstream` on `store`, opened as the binary opens
/// it; an embedded store lives in `dir`.
async fn proxy_on(store: StoreKind, upstream: &TestUpstream, dir: &TempDir) -> TestProxy {
    let mut c: Config = config(&upstream.url());
    c.store.kind = store;
    c.store.path = dir.path().to_path_buf();
    let opened = idemproxy::open_store(&c).await.expect("the store opens");
    TestProxy::start_with_store(c, opened).await
}

/// Whether the proxy really ran on the embedded store in `dir`.
fn assert_store(store: StoreKind, dir: &TempDir) {
    let file = dir.path().join(idemproxy::store::embedded::DATA_DIR);
    assert_eq!(file.exists(), store == StoreKind::Embedded, "{file:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_simultaneous_duplicates_execute_once_on_memory() {
    fifty_simultaneous_duplicates_execute_once(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_simultaneous_duplicates_execute_once_on_embedded() {
    fifty_simultaneous_duplicates_execute_once(StoreKind::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_keys_with_ten_duplicates_each_execute_twenty_times_on_memory() {
    twenty_keys_with_ten_duplicates_each_execute_twenty_times(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_keys_with_ten_duplicates_each_execute_twenty_times_on_embedded() {
    twenty_keys_with_ten_duplicates_each_execute_twenty_times(StoreKind::Embedded).await;
}

async fn fifty_simultaneous_duplicates_execute_once(store: StoreKind) {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = proxy_on(store, &upstream, &dir).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=200");

    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(50));
    let mut set = JoinSet::new();
    for _ in 0..50 {
        let client = client.clone();
        let url = url.clone();
        let barrier = barrier.clone();
        set.spawn(async move {
            barrier.wait().await;
            client.post_json(&url, "one-key", r#"{"amount":5}"#).await
        });
    }
    let replies: Vec<Reply> = set.join_all().await;

    assert_eq!(upstream.executions("/v1/orders"), 1);
    let mut executed = 0;
    let mut replayed = 0;
    let mut in_flight = 0;
    for reply in &replies {
        match reply.status.as_u16() {
            201 => {
                assert_eq!(reply.header("x-upstream-execution"), Some("1"), "{reply:?}");
                if reply.replayed() {
                    replayed += 1;
                } else {
                    executed += 1;
                }
            }
            425 => {
                assert_eq!(reply.problem(), "in-flight");
                in_flight += 1;
            }
            _ => panic!("unexpected answer: {reply:?}"),
        }
    }
    assert_eq!(executed, 1, "exactly one response is the execution");
    assert_eq!(executed + replayed + in_flight, 50);
    assert!(
        in_flight > 0,
        "the duplicates overlapped the 200 ms execution"
    );

    // Afterwards every retry replays.
    let after = client.post_json(&url, "one-key", r#"{"amount":5}"#).await;
    assert!(after.replayed(), "{after:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
    assert_store(store, &dir);
}

async fn twenty_keys_with_ten_duplicates_each_execute_twenty_times(store: StoreKind) {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = proxy_on(store, &upstream, &dir).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders?delay_ms=100");

    let mut set = JoinSet::new();
    for dup in 0..10 {
        for key in 0..20 {
            let client = client.clone();
            let url = url.clone();
            set.spawn(async move {
                let key = format!("key-{key}");
                let body = format!(r#"{{"for":"{key}"}}"#);
                let reply = client.post_json(&url, &key, &body).await;
                (key, dup, reply)
            });
        }
    }
    let mut executed_keys = Vec::new();
    while let Some(joined) = set.join_next().await {
        let (key, dup, reply) = joined.expect("request task");
        match reply.status.as_u16() {
            201 if !reply.replayed() => executed_keys.push(key),
            201 => {}
            425 => assert_eq!(reply.problem(), "in-flight"),
            _ => panic!("{key} #{dup}: unexpected answer {reply:?}"),
        }
    }
    executed_keys.sort();
    let mut expected: Vec<String> = (0..20).map(|k| format!("key-{k}")).collect();
    expected.sort();
    assert_eq!(executed_keys, expected, "each key executed exactly once");
    assert_eq!(upstream.executions("/v1/orders"), 20);

    // Settled: every key replays its own execution.
    for key in 0..20 {
        let key = format!("key-{key}");
        let body = format!(r#"{{"for":"{key}"}}"#);
        let reply =
            tokio::time::timeout(Duration::from_secs(5), client.post_json(&url, &key, &body))
                .await
                .expect("answers");
        assert!(reply.replayed(), "{key}: {reply:?}");
    }
    assert_eq!(upstream.executions("/v1/orders"), 20);
    assert_store(store, &dir);
}
