//! A data directory written by the redb store of earlier versions
//! (`tests/fixtures/redb_store`, made by the binary before the move to
//! fjall: two completed keys and one claim left pending by a SIGKILL
//! mid-call) is migrated on the first start, and by `idemproxy store
//! migrate`: every record is there after, the completed ones replay and the
//! pending one is still in flight.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use idemproxy::core::{Clock, Record};
use idemproxy::store::compression::{CompressedStore, Packer};
use idemproxy::store::embedded::migrate::{Migrated, MIGRATED_FILE_NAME, REDB_FILE_NAME};
use idemproxy::store::{EmbeddedStore, ScanCursor, SharedStore, Store};
use support::proxy::{config, TestClient, TestProxy};
use support::upstream::TestUpstream;

/// When the fixture was written (Unix ms): its records are read as of a
/// few seconds later, so that the test does not expire with them.
const WRITTEN_AT: u64 = 1_796_409_180_975;
const READ_AT: u64 = WRITTEN_AT + 5_000;

/// A copy of the fixture's data directory, for a test to migrate.
fn fixture_copy() -> (tempfile::TempDir, PathBuf) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/redb_store");
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    std::fs::create_dir(&data).expect("data dir");
    std::fs::copy(fixture.join(REDB_FILE_NAME), data.join(REDB_FILE_NAME)).expect("copy");
    (dir, data)
}

async fn all_records(store: &EmbeddedStore) -> Vec<Record> {
    let page = store.scan(&ScanCursor::start(), 100).await.expect("scan");
    assert_eq!(page.unreadable, [], "every migrated record reads");
    page.records.into_iter().map(|(_, record)| record).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redb_directory_is_migrated_on_first_open_and_its_keys_replay() {
    let (_dir, data) = fixture_copy();
    let store = EmbeddedStore::open(&data)
        .expect("open migrates")
        .with_clock(Clock::tokio_from(READ_AT));
    assert_eq!(
        store.migrated(),
        Some(Migrated {
            records: 3,
            unreadable: 0
        })
    );
    assert!(
        !data.join(REDB_FILE_NAME).exists(),
        "the redb file is moved away"
    );
    assert!(data.join(MIGRATED_FILE_NAME).is_file(), "and kept");
    let records = all_records(&store).await;
    let completed = records
        .iter()
        .filter(|r| matches!(r, Record::Completed(_)))
        .count();
    let pending = records
        .iter()
        .filter(|r| matches!(r, Record::Pending(_)))
        .count();
    assert_eq!((completed, pending), (2, 1), "{records:?}");

    // Through the whole proxy (its decoding of the stored responses): the
    // completed keys replay what the upstream answered then, and the key
    // whose proxy died mid-call is still in flight, never executed again.
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.store.kind = idemproxy::config::StoreKind::Embedded;
    c.store.path = data.clone();
    // As `open_store` layers it: the fixture's responses were stored
    // compressed (the default).
    let packer = Packer::new(true, None, Vec::new(), 1 << 20);
    let store: SharedStore = Arc::new(CompressedStore::new(Arc::new(store), packer));
    let proxy = TestProxy::start_with_store(c, store).await;
    let client = TestClient::new();
    for i in 1..=2 {
        let body = format!(r#"{{"amount":{i}00,"currency":"eur"}}"#);
        let reply = client
            .post_json(
                &proxy.url(&format!("/v1/charges/{i}")),
                &format!("fixture-done-{i}"),
                &body,
            )
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(reply.json()["id"], format!("ch_v1_charges_{i}"));
    }
    // Its lease (30 s from the claim) may run out during a slow run: then
    // it is settled outcome-unknown, which fails closed all the same.
    let pending = client
        .post_json(
            &proxy.url("/v1/slow"),
            "fixture-pending",
            r#"{"amount":300}"#,
        )
        .await;
    match pending.status.as_u16() {
        425 => pending.assert_problem(425, "in-flight"),
        _ => pending.assert_problem(502, "outcome-unknown"),
    }
    assert_eq!(upstream.total(), 0, "nothing executed again");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_migrate_migrates_once_and_a_second_open_finds_the_records() {
    let (_dir, data) = fixture_copy();
    let run = || {
        std::process::Command::new(support::binary::BIN)
            .args(["store", "migrate", "--store", "embedded", "--store-path"])
            .arg(&data)
            .env_remove("IDEMPROXY_CONFIG")
            .output()
            .expect("run idemproxy store migrate")
    };
    let first = run();
    let said = String::from_utf8_lossy(&first.stdout);
    assert!(first.status.success(), "{first:?}");
    assert!(said.contains("migrated 3 records (0 unreadable"), "{said}");
    // Progress on stderr (plain: not a terminal), stdout the answer.
    let shown = String::from_utf8_lossy(&first.stderr);
    assert!(
        shown.contains("store migrate: 3 records examined, 3 copied"),
        "{shown}"
    );
    let again = run();
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success(), "{again:?}");
    assert!(said.contains("nothing to migrate"), "{said}");

    let store = EmbeddedStore::open(&data)
        .expect("open")
        .with_clock(Clock::tokio_from(READ_AT));
    assert_eq!(store.migrated(), None);
    assert_eq!(all_records(&store).await.len(), 3);
}
