//! The embedded store survives a restart of the proxy: a retry sent to the
//! new process replays the answer the old one stored.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use idemproxy::store::{EmbeddedStore, SharedStore};
use support::proxy::{config, TestClient, TestProxy};
use support::upstream::TestUpstream;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_key_replays_after_a_restart_on_the_embedded_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.store.kind = idemproxy::config::StoreKind::Embedded;
    c.store.path = dir.path().to_path_buf();
    let body = r#"{"amount":5}"#;

    let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open the embedded store"));
    let weak = Arc::downgrade(&store);
    let proxy = TestProxy::start_with_store(c.clone(), store as SharedStore).await;
    let client = TestClient::new();
    let first = client
        .post_json(&proxy.url("/v1/orders"), "durable-1", body)
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 1);
    // A second open while the first is live is refused (one process owns
    // the file), which is how the reopen below proves the store was closed.
    assert!(EmbeddedStore::open(dir.path()).is_err());

    drop(client);
    proxy.shutdown().await;
    // Every clone of the store (proxy, admin, connections, executions) is
    // gone once shutdown has drained.
    let deadline = Instant::now() + Duration::from_secs(5);
    while weak.strong_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} references to the store outlived the shutdown",
            weak.strong_count()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let store = Arc::new(EmbeddedStore::open(dir.path()).expect("reopen after shutdown"));
    let proxy = TestProxy::start_with_store(c, store as SharedStore).await;
    let client = TestClient::new();
    let retry = client
        .post_json(&proxy.url("/v1/orders"), "durable-1", body)
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("x-upstream-execution"), Some("1"));
    assert_eq!(upstream.executions("/v1/orders"), 1);
}
