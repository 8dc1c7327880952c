//! A data directory written by the redb store of earlier versions
//! (`tests/fixtures/redb_store`, made by the binary before the move to
//! fjall: two completed keys and one claim left pending by a SIGKILL
//! mid-call) is migrated on the first start, and by `idemproxy store
//! migrate`: every record is there after, the completed ones replay and the
//! pending one is still in flight. A redb file that comes back after the
//! migration (an earlier version run on the directory: a downgrade) is
//! copied too, and never replaces the file moved aside before.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idemproxy::core::{Clock, Record, RecordKey};
use idemproxy::store::compression::{CompressedStore, Packer};
use idemproxy::store::embedded::migrate::{Migrated, MIGRATED_FILE_NAME, REDB_FILE_NAME};
use idemproxy::store::{EmbeddedStore, ScanCursor, SharedStore, Store};
use support::proxy::{config, Reply, TestClient, TestProxy};
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

/// The proxy as `open_store` layers it over `store`: the fixture's
/// responses were stored compressed (the default).
fn compressed(store: Arc<EmbeddedStore>) -> SharedStore {
    let packer = Packer::new(true, None, Vec::new(), 1 << 20);
    Arc::new(CompressedStore::new(store, packer))
}

/// The fixture's request `i` (`POST /v1/charges/{i}`) under `key`,
/// answered 201.
async fn charge(client: &TestClient, proxy: &TestProxy, key: &str, i: u32) -> Reply {
    let body = format!(r#"{{"amount":{i}00,"currency":"eur"}}"#);
    let reply = client
        .post_json(&proxy.url(&format!("/v1/charges/{i}")), key, &body)
        .await;
    assert_eq!(reply.status, 201, "{key}: {reply:?}");
    reply
}

async fn keyed_records(store: &EmbeddedStore) -> Vec<(RecordKey, Record)> {
    let page = store.scan(&ScanCursor::start(), 100).await.expect("scan");
    assert_eq!(page.unreadable, [], "every record reads");
    page.records
}

/// Writes `records` to a redb file laid out as earlier versions wrote
/// theirs (table `records`: 32 key bytes -> the encoded record).
fn write_redb(path: &Path, records: &[(RecordKey, Record)]) {
    const RECORDS: redb::TableDefinition<'static, &[u8; 32], &[u8]> =
        redb::TableDefinition::new("records");
    let db = redb::Database::create(path).expect("create the redb file");
    let txn = db.begin_write().expect("begin");
    {
        let mut table = txn.open_table(RECORDS).expect("table");
        for (key, record) in records {
            table
                .insert(key.as_bytes(), &record.encode()[..])
                .expect("insert");
        }
    }
    txn.commit().expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redb_file_an_earlier_version_wrote_after_the_migration_is_copied_too() {
    let (_dir, data) = fixture_copy();
    // The upgrade: the fixture migrated, its file moved aside.
    let store = EmbeddedStore::open(&data)
        .expect("open migrates")
        .with_clock(Clock::tokio_from(READ_AT));
    assert_eq!(store.migrated().map(|m| m.records), Some(3));
    let upgraded = keyed_records(&store).await;
    drop(store);
    let first_backup = std::fs::read(data.join(MIGRATED_FILE_NAME)).expect("moved aside");

    // The downgrade: the earlier version finds no `idemproxy.redb`, makes
    // one and answers from it. Its records are made by a proxy (on a store
    // of its own, knowing none of the fixture's keys) and written in its
    // layout: two new keys, and a retry of a fixture key it executes
    // again, not knowing it.
    let upstream = TestUpstream::start().await;
    let scratch = tempfile::tempdir().expect("tempdir");
    let earlier = Arc::new(EmbeddedStore::open(scratch.path()).expect("scratch store"));
    let mut c = config(&upstream.url());
    // A fresh store's first fsyncs, beside the whole suite: this test is
    // about what is copied, not about the store's latency.
    c.store.timeout = Duration::from_secs(2);
    c.idempotency.lease_margin = Duration::from_secs(10);
    let proxy = TestProxy::start_with_store(c, compressed(earlier.clone())).await;
    let client = TestClient::new();
    let requests = [
        ("downgrade-3", 3),
        ("downgrade-4", 4),
        ("fixture-done-1", 1),
    ];
    let mut answered = Vec::new();
    for (key, i) in requests {
        let reply = charge(&client, &proxy, key, i).await;
        assert!(!reply.replayed(), "{reply:?}");
        answered.push(reply.json());
    }
    proxy.shutdown().await;
    let downgraded = keyed_records(&earlier).await;
    assert_eq!(downgraded.len(), 3);
    drop(earlier);
    write_redb(&data.join(REDB_FILE_NAME), &downgraded);
    assert_eq!(upstream.total(), 3);

    // The upgrade again: the new file's records are all there, the
    // fixture's too, and the first file moved aside is untouched.
    let store = EmbeddedStore::open(&data)
        .expect("open migrates again")
        .with_clock(Clock::tokio_from(READ_AT));
    // The retry of `fixture-done-1` completed after the fixture's
    // completion: the later one stands, kept as long as the fixture's
    // would have been (its TTL was longer).
    let merged: Vec<(RecordKey, Record)> = downgraded
        .iter()
        .map(|(key, record)| {
            let mut record = record.clone();
            if let Some((_, before)) = upgraded.iter().find(|(k, _)| k == key) {
                let Record::Completed(done) = &mut record else {
                    panic!("{record:?}")
                };
                done.expires_at = done.expires_at.max(before.expires_at());
            }
            (*key, record)
        })
        .collect();
    assert!(merged != downgraded, "the fixture's key was merged");
    for (key, record) in &merged {
        assert_eq!(
            store.get(key).await.expect("get").as_ref(),
            Some(record),
            "{key:?}"
        );
    }
    assert_eq!(
        store.migrated(),
        Some(Migrated {
            records: 3,
            unreadable: 0
        }),
        "the new file is copied: the marker names the fixture's"
    );
    let mut kept = keyed_records(&store).await;
    kept.sort_by_key(|(key, _)| *key.as_bytes());
    let mut expected: Vec<_> = upgraded
        .iter()
        .filter(|(key, _)| !merged.iter().any(|(k, _)| k == key))
        .chain(&merged)
        .cloned()
        .collect();
    expected.sort_by_key(|(key, _)| *key.as_bytes());
    assert_eq!(kept, expected, "nothing lost, nothing else changed");
    assert!(!data.join(REDB_FILE_NAME).exists(), "moved aside");
    assert_eq!(
        std::fs::read(data.join(MIGRATED_FILE_NAME)).expect("first backup"),
        first_backup,
        "the first file moved aside is kept as it was"
    );
    assert!(data.join(format!("{MIGRATED_FILE_NAME}.1")).is_file());

    // Through the whole proxy: the keys the earlier version executed
    // replay what it answered, the fixture's other key what the fixture
    // holds; nothing executes again.
    let proxy =
        TestProxy::start_with_store(config(&upstream.url()), compressed(Arc::new(store))).await;
    for ((key, i), answer) in requests.into_iter().zip(&answered) {
        let reply = charge(&client, &proxy, key, i).await;
        assert!(reply.replayed(), "{key}: {reply:?}");
        assert_eq!(&reply.json(), answer, "{key}");
    }
    let reply = charge(&client, &proxy, "fixture-done-2", 2).await;
    assert!(reply.replayed(), "{reply:?}");
    assert_eq!(reply.json()["id"], "ch_v1_charges_2");
    assert_eq!(upstream.total(), 3, "nothing executed again");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_died_before_moving_the_file_aside_does_not_copy_it_again() {
    let (_dir, data) = fixture_copy();
    let store = EmbeddedStore::open(&data)
        .expect("open migrates")
        .with_clock(Clock::tokio_from(READ_AT));
    assert_eq!(store.migrated().map(|m| m.records), Some(3));
    let migrated = keyed_records(&store).await;
    drop(store);
    // What a crash after the marker, before the rename, leaves: the same
    // file where it was.
    std::fs::rename(data.join(MIGRATED_FILE_NAME), data.join(REDB_FILE_NAME)).expect("put back");

    let store = EmbeddedStore::open(&data)
        .expect("open")
        .with_clock(Clock::tokio_from(READ_AT));
    assert_eq!(store.migrated(), None, "the marker names this file");
    assert_eq!(
        keyed_records(&store).await,
        migrated,
        "the records as they were"
    );
    assert!(!data.join(REDB_FILE_NAME).exists(), "moved aside");
    assert!(data.join(MIGRATED_FILE_NAME).is_file());
    assert!(
        !data.join(format!("{MIGRATED_FILE_NAME}.1")).exists(),
        "one file, one name"
    );
}
