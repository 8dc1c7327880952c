//! The store contract: one suite, written once over `SharedStore`, run against
//! every backend. A new backend joins with one line in `contract!` below (a
//! constructor returning a [`Backend`]).
//!
//! Backend-specific behaviour (durability across reopen, purging, corrupt
//! values, file locking) follows the contract, per backend.
//!
//! The memory and embedded stores run on paused time (`start_paused`,
//! their [`Clock`] on tokio's): a lease or a TTL runs out when the test
//! sleeps past it, at once and whatever the machine's load. Redis counts
//! its TTLs itself, and the embedded store as the binary opens it has the
//! wall clock: those wait in real time.

use std::sync::Arc;
use std::time::Duration;

use idemproxy::config::StoreSettings;
use idemproxy::core::{
    millis, Clock, FencingToken, Fingerprint, KeyState, Outcome, Record, RecordKey, UnknownCause,
};
use idemproxy::store::embedded::{DATA_DIR, RECORDS_KEYSPACE};
use idemproxy::store::{
    Begin, BeginOutcome, CachedStore, EmbeddedStore, MemoryStore, OnStale, PostgresStore,
    RedisStore, Removal, Removed, SharedStore, Store, StoreError,
};
use tempfile::TempDir;

use crate::support::{postgres_server, redis_server, store_fixtures};

use store_fixtures::{begin, completed, completed_by, new_key, walk, TTL};

/// A store under test, and whatever must outlive it (a temporary directory).
struct Backend {
    store: SharedStore,
    /// The store's clock, for the records a case writes and the times it
    /// checks.
    clock: Clock,
    _guard: Option<TempDir>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("store", &self.store.kind())
            .finish_non_exhaustive()
    }
}

async fn memory_backend() -> Backend {
    let clock = Clock::tokio();
    Backend {
        store: Arc::new(MemoryStore::new().with_clock(clock)),
        clock,
        _guard: None,
    }
}

async fn embedded_backend() -> Backend {
    let clock = Clock::tokio();
    let dir = tempfile::tempdir().expect("create a temporary directory");
    let store = EmbeddedStore::open(dir.path()).expect("open the embedded store");
    Backend {
        store: Arc::new(store.with_clock(clock)),
        clock,
        _guard: Some(dir),
    }
}

/// The memory store behind a local replay cache: the cache must keep the
/// contract too.
async fn memory_cached_backend() -> Backend {
    let clock = Clock::tokio();
    let memory = Arc::new(MemoryStore::new().with_clock(clock));
    Backend {
        store: Arc::new(CachedStore::new(memory, 64).with_clock(clock)),
        clock,
        _guard: None,
    }
}

/// The embedded store as the binary opens it (`open_store`): behind the
/// replay cache it always has.
async fn embedded_opened_backend() -> Backend {
    let dir = tempfile::tempdir().expect("create a temporary directory");
    let mut config = idemproxy::config::Config::default();
    config.store.kind = idemproxy::config::StoreKind::Embedded;
    config.store.path = dir.path().to_path_buf();
    config.store.local_cache_entries = 0;
    let store = idemproxy::open_store(&config)
        .await
        .expect("open the embedded store");
    assert!(
        store.local_cache_hits().is_some(),
        "the embedded store is opened behind a replay cache"
    );
    Backend {
        store,
        clock: Clock::wall(),
        _guard: Some(dir),
    }
}

/// The one private redis-server of the test process; each test writes under a key
/// prefix of its own.
async fn redis_backend() -> Backend {
    let config = StoreSettings {
        url: redis_server::shared().url(),
        key_prefix: redis_server::unique_prefix("contract"),
        ..StoreSettings::default()
    };
    redis_store(RedisStore::connect(&config).await)
}

/// The one private 3-master Redis Cluster of the test process, as for `redis`.
async fn redis_cluster_backend() -> Backend {
    let config = StoreSettings {
        urls: redis_server::shared_cluster().urls(),
        key_prefix: redis_server::unique_prefix("contract"),
        ..StoreSettings::default()
    };
    redis_store(RedisStore::connect_cluster(&config).await)
}

/// The one private PostgreSQL server of the test process; each test has
/// tables of its own (a table prefix).
async fn postgres_backend() -> Backend {
    let config = StoreSettings {
        kind: idemproxy::config::StoreKind::Postgres,
        url: postgres_server::shared().url(),
        table_prefix: postgres_server::unique_prefix("contract"),
        ..StoreSettings::default()
    };
    Backend {
        store: Arc::new(
            PostgresStore::connect(&config)
                .await
                .expect("connect to postgres"),
        ),
        clock: Clock::wall(),
        _guard: None,
    }
}

fn redis_store(connected: Result<RedisStore, StoreError>) -> Backend {
    Backend {
        store: Arc::new(connected.expect("connect to redis")),
        clock: Clock::wall(),
        _guard: None,
    }
}

/// Generates one test per (backend, case), each with its backend's
/// runtime attribute.
macro_rules! contract {
    ($(#[$runtime:meta] $backend:ident => $make:path),+ $(,)?) => {
        $(
            mod $backend {
                contract!(@cases #[$runtime] $make;
                    absent_key_acquires_and_duplicates_wait,
                    completed_record_replays,
                    wrong_token_is_fenced,
                    release_frees_the_key,
                    takeover_fences_the_stale_holder,
                    stale_claim_settles_as_unknown,
                    completed_record_expires,
                    abandoned_claim_expires,
                    get_remove_ping,
                    a_running_claim_is_removed_only_by_force,
                    concurrent_begins_acquire_once,
                    a_walk_meets_every_live_record,
                    a_listing_keeps_its_limit_and_meets_every_live_record,
                );
            }
        )+
    };
    (@cases #[$runtime:meta] $make:path; $($case:ident),+ $(,)?) => {
        $(
            #[$runtime]
            async fn $case() {
                let backend = $make().await;
                crate::store_contract::cases::$case(backend.store.clone(), backend.clock).await;
            }
        )+
    };
}

contract! {
    #[tokio::test(start_paused = true)]
    memory => crate::store_contract::memory_backend,
    #[tokio::test(start_paused = true)]
    embedded => crate::store_contract::embedded_backend,
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    embedded_opened => crate::store_contract::embedded_opened_backend,
    #[tokio::test(start_paused = true)]
    memory_cached => crate::store_contract::memory_cached_backend,
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    redis => crate::store_contract::redis_backend,
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    redis_cluster => crate::store_contract::redis_cluster_backend,
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    postgres => crate::store_contract::postgres_backend,
}

// ---------------------------------------------------------------- fixtures

const LONG_LEASE: Duration = Duration::from_secs(30);
const SHORT_LEASE: Duration = Duration::from_millis(250);
/// Comfortably past `SHORT_LEASE`, even on a loaded machine.
const PAST_SHORT_LEASE: Duration = Duration::from_millis(400);
fn acquired(outcome: BeginOutcome, expect_took_over: bool) -> FencingToken {
    match outcome {
        BeginOutcome::Acquired {
            token, took_over, ..
        } => {
            assert_eq!(took_over, expect_took_over, "took_over");
            token
        }
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn claim(
    store: &dyn Store,
    key: RecordKey,
    fingerprint: u8,
    lease: Duration,
) -> FencingToken {
    let outcome = store
        .begin(&begin(key, fingerprint, lease, OnStale::Store))
        .await
        .expect("begin");
    acquired(outcome, false)
}

fn assert_fenced(result: Result<(), StoreError>, what: &str) {
    assert!(
        matches!(result, Err(StoreError::Fenced)),
        "{what}: expected Fenced, got {result:?}"
    );
}

// ------------------------------------------------------------------- cases

mod cases {
    use super::*;

    pub(crate) async fn absent_key_acquires_and_duplicates_wait(store: SharedStore, clock: Clock) {
        let key = new_key();
        let before = clock.now_millis();
        let token = claim(&*store, key, 1, LONG_LEASE).await;

        let Some(Record::Pending(pending)) = store.get(&key).await.expect("get") else {
            panic!("a claimed key reads as pending");
        };
        assert_eq!(pending.token, token);
        assert_eq!(pending.fingerprint, Fingerprint([1; 32]));
        assert!(pending.lease_expires_at >= before + millis(LONG_LEASE));
        assert!(pending.lease_expires_at <= clock.now_millis() + millis(LONG_LEASE));
        assert_eq!(pending.expires_at, pending.lease_expires_at + millis(TTL));

        let again = store
            .begin(&begin(key, 1, LONG_LEASE, OnStale::Store))
            .await
            .expect("begin");
        assert_eq!(
            again,
            BeginOutcome::InFlight {
                lease_expires_at: pending.lease_expires_at
            }
        );

        let other = store
            .begin(&begin(key, 2, LONG_LEASE, OnStale::Store))
            .await
            .expect("begin");
        assert_eq!(
            other,
            BeginOutcome::Mismatch {
                state: KeyState::Pending
            }
        );
        // Neither duplicate changed the claim.
        assert_eq!(
            store.get(&key).await.expect("get"),
            Some(Record::Pending(pending))
        );
    }

    pub(crate) async fn completed_record_replays(store: SharedStore, clock: Clock) {
        let key = new_key();
        let token = claim(&*store, key, 1, LONG_LEASE).await;
        let record = completed_by(clock, 1, TTL);
        store
            .complete(&key, token, &record)
            .await
            .expect("the owner completes");

        for _ in 0..2 {
            let replay = store
                .begin(&begin(key, 1, LONG_LEASE, OnStale::Store))
                .await
                .expect("begin");
            assert_eq!(replay, BeginOutcome::Completed(record.clone().into()));
        }
        assert_eq!(
            store.get(&key).await.expect("get"),
            Some(Record::Completed(record.clone()))
        );

        let other = store
            .begin(&begin(key, 2, LONG_LEASE, OnStale::Store))
            .await
            .expect("begin");
        assert_eq!(
            other,
            BeginOutcome::Mismatch {
                state: KeyState::Completed
            }
        );

        // A settled key has no holder any more, not even its former one.
        let mut rewrite = completed_by(clock, 1, TTL);
        rewrite.outcome = Outcome::NotStored { status: 500 };
        assert_fenced(
            store.complete(&key, token, &rewrite).await,
            "second complete",
        );
        assert_fenced(store.release(&key, token).await, "release after complete");
        assert_eq!(
            store.get(&key).await.expect("get"),
            Some(Record::Completed(record))
        );
    }

    pub(crate) async fn wrong_token_is_fenced(store: SharedStore, clock: Clock) {
        let absent = new_key();
        assert_fenced(
            store
                .complete(
                    &absent,
                    FencingToken::random(),
                    &completed_by(clock, 1, TTL),
                )
                .await,
            "complete of an absent key",
        );
        assert_fenced(
            store.release(&absent, FencingToken::random()).await,
            "release of an absent key",
        );
        assert_eq!(store.get(&absent).await.expect("get"), None);

        let key = new_key();
        let token = claim(&*store, key, 1, LONG_LEASE).await;
        let before = store.get(&key).await.expect("get");
        let intruder = FencingToken(token.0.wrapping_add(1));
        assert_fenced(
            store
                .complete(&key, intruder, &completed_by(clock, 1, TTL))
                .await,
            "complete with a wrong token",
        );
        assert_fenced(
            store.release(&key, intruder).await,
            "release with a wrong token",
        );
        assert_eq!(store.get(&key).await.expect("get"), before);

        let record = completed_by(clock, 1, TTL);
        store
            .complete(&key, token, &record)
            .await
            .expect("the owner still completes");
        assert_eq!(
            store.get(&key).await.expect("get"),
            Some(Record::Completed(record))
        );
    }

    pub(crate) async fn release_frees_the_key(store: SharedStore, _clock: Clock) {
        let key = new_key();
        let token = claim(&*store, key, 1, LONG_LEASE).await;
        store
            .release(&key, token)
            .await
            .expect("the owner releases");
        assert_eq!(store.get(&key).await.expect("get"), None);
        assert_fenced(store.release(&key, token).await, "second release");

        // A released key is free for anyone, with any fingerprint.
        let next = claim(&*store, key, 2, LONG_LEASE).await;
        assert_ne!(next, token);
    }

    pub(crate) async fn takeover_fences_the_stale_holder(store: SharedStore, clock: Clock) {
        let key = new_key();
        let a = claim(&*store, key, 1, SHORT_LEASE).await;

        // While the lease runs, `retry` does not take over.
        let early = store
            .begin(&begin(key, 1, LONG_LEASE, OnStale::Retry))
            .await
            .expect("begin");
        assert!(matches!(early, BeginOutcome::InFlight { .. }), "{early:?}");

        tokio::time::sleep(PAST_SHORT_LEASE).await;
        let b = acquired(
            store
                .begin(&begin(key, 1, LONG_LEASE, OnStale::Retry))
                .await
                .expect("begin"),
            true,
        );
        assert_ne!(a, b);

        assert_fenced(
            store.complete(&key, a, &completed_by(clock, 1, TTL)).await,
            "stale holder completes",
        );
        assert_fenced(store.release(&key, a).await, "stale holder releases");
        let Some(Record::Pending(pending)) = store.get(&key).await.expect("get") else {
            panic!("the new claim is still pending");
        };
        assert_eq!(pending.token, b);

        let record = completed_by(clock, 1, TTL);
        store
            .complete(&key, b, &record)
            .await
            .expect("the new holder completes");
        assert_eq!(
            store
                .begin(&begin(key, 1, LONG_LEASE, OnStale::Retry))
                .await
                .expect("begin"),
            BeginOutcome::Completed(record.into())
        );
    }

    pub(crate) async fn stale_claim_settles_as_unknown(store: SharedStore, clock: Clock) {
        let key = new_key();
        let a = claim(&*store, key, 1, SHORT_LEASE).await;
        let Some(Record::Pending(pending)) = store.get(&key).await.expect("get") else {
            panic!("a claimed key reads as pending");
        };
        tokio::time::sleep(PAST_SHORT_LEASE).await;

        // Another request's fingerprint does not settle the key.
        let other = store
            .begin(&begin(key, 2, LONG_LEASE, OnStale::Store))
            .await
            .expect("begin");
        assert_eq!(
            other,
            BeginOutcome::Mismatch {
                state: KeyState::Pending
            }
        );

        let settled = match store
            .begin(&begin(key, 1, LONG_LEASE, OnStale::Store))
            .await
            .expect("begin")
        {
            BeginOutcome::Settled(record) => record,
            other => panic!("expected the stale claim settled, got {other:?}"),
        };
        assert_eq!(
            settled.outcome,
            Outcome::Unknown {
                cause: UnknownCause::Abandoned
            }
        );
        assert_eq!(settled.fingerprint, pending.fingerprint);
        assert_eq!(settled.created_at, pending.created_at);
        assert!(settled.completed_at >= pending.lease_expires_at);
        assert_eq!(settled.expires_at, settled.completed_at + millis(TTL));

        // Persisted: later requests get the very same record, even with
        // `retry`, since the key is no longer pending.
        tokio::time::sleep(Duration::from_millis(5)).await;
        for on_stale in [OnStale::Store, OnStale::Retry] {
            assert_eq!(
                store
                    .begin(&begin(key, 1, LONG_LEASE, on_stale))
                    .await
                    .expect("begin"),
                BeginOutcome::Completed(settled.clone())
            );
        }
        assert_eq!(
            store.get(&key).await.expect("get"),
            Some(Record::Completed((*settled).clone()))
        );

        assert_fenced(
            store.complete(&key, a, &completed_by(clock, 1, TTL)).await,
            "the dead holder completes",
        );
        assert_fenced(store.release(&key, a).await, "the dead holder releases");
        assert_eq!(
            store.get(&key).await.expect("get"),
            Some(Record::Completed((*settled).clone()))
        );
    }

    pub(crate) async fn completed_record_expires(store: SharedStore, clock: Clock) {
        let key = new_key();
        let token = claim(&*store, key, 1, LONG_LEASE).await;
        let record = completed_by(clock, 1, Duration::from_millis(500));
        store
            .complete(&key, token, &record)
            .await
            .expect("complete");
        assert_eq!(
            store.get(&key).await.expect("get"),
            Some(Record::Completed(record))
        );

        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(store.get(&key).await.expect("get"), None);
        assert_eq!(
            store.remove(&key, Removal::Any).await.expect("remove"),
            Removed::Absent,
            "an expired record reads as absent to remove too"
        );
        let again = store
            .begin(&begin(key, 2, LONG_LEASE, OnStale::Store))
            .await
            .expect("begin");
        acquired(again, false);
    }

    pub(crate) async fn abandoned_claim_expires(store: SharedStore, _clock: Clock) {
        // A claim is kept for lease + ttl; after that it is forgotten rather
        // than settled as abandoned.
        let key = new_key();
        let short_claim = Begin {
            ttl: Duration::from_millis(100),
            ..begin(key, 1, Duration::from_millis(100), OnStale::Store)
        };
        acquired(store.begin(&short_claim).await.expect("begin"), false);
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(store.get(&key).await.expect("get"), None);
        let again = store
            .begin(&begin(key, 1, LONG_LEASE, OnStale::Store))
            .await
            .expect("begin");
        acquired(again, false);
    }

    pub(crate) async fn get_remove_ping(store: SharedStore, clock: Clock) {
        store.ping().await.expect("ping");
        assert!(!store.kind().is_empty());

        let key = new_key();
        assert_eq!(store.get(&key).await.expect("get"), None);
        assert_eq!(
            store.remove(&key, Removal::Any).await.expect("remove"),
            Removed::Absent
        );

        let token = claim(&*store, key, 1, LONG_LEASE).await;
        assert_eq!(
            store
                .remove(&key, Removal::Any)
                .await
                .expect("remove a pending record"),
            Removed::Deleted
        );
        assert_eq!(
            store
                .remove(&key, Removal::Any)
                .await
                .expect("remove again"),
            Removed::Absent
        );
        assert_eq!(store.get(&key).await.expect("get"), None);
        assert_fenced(
            store
                .complete(&key, token, &completed_by(clock, 1, TTL))
                .await,
            "complete after remove",
        );

        let token = claim(&*store, key, 1, LONG_LEASE).await;
        store
            .complete(&key, token, &completed_by(clock, 1, TTL))
            .await
            .expect("complete");
        assert_eq!(
            store
                .remove(&key, Removal::Any)
                .await
                .expect("remove a completed record"),
            Removed::Deleted
        );
        assert_eq!(
            store
                .remove(&key, Removal::Any)
                .await
                .expect("remove again"),
            Removed::Absent
        );
        claim(&*store, key, 2, LONG_LEASE).await;

        // Other keys are untouched by all of this.
        let bystander = new_key();
        claim(&*store, bystander, 1, LONG_LEASE).await;
        assert_eq!(
            store.remove(&key, Removal::Any).await.expect("remove"),
            Removed::Deleted
        );
        assert!(matches!(
            store.get(&bystander).await.expect("get"),
            Some(Record::Pending(_))
        ));
    }

    pub(crate) async fn a_running_claim_is_removed_only_by_force(store: SharedStore, clock: Clock) {
        // A request executing now keeps its claim against a guarded removal.
        let key = new_key();
        let token = claim(&*store, key, 1, LONG_LEASE).await;
        let lease_expires_at = match store.get(&key).await.expect("get") {
            Some(Record::Pending(p)) => p.lease_expires_at,
            other => panic!("expected a claim, got {other:?}"),
        };
        assert_eq!(
            store
                .remove(&key, Removal::UnlessLeased)
                .await
                .expect("guarded remove"),
            Removed::Leased {
                until: lease_expires_at
            }
        );
        // Still its holder's: it completes, and a completion goes unforced.
        store
            .complete(&key, token, &completed_by(clock, 1, TTL))
            .await
            .expect("complete after a refused removal");
        assert_eq!(
            store
                .remove(&key, Removal::UnlessLeased)
                .await
                .expect("guarded remove"),
            Removed::Deleted
        );
        assert_eq!(store.get(&key).await.expect("get"), None);
        assert_eq!(
            store
                .remove(&key, Removal::UnlessLeased)
                .await
                .expect("guarded remove of nothing"),
            Removed::Absent
        );

        // A claim past its lease is stuck (its proxy died): it goes unforced.
        let stuck = new_key();
        claim(&*store, stuck, 1, SHORT_LEASE).await;
        tokio::time::sleep(PAST_SHORT_LEASE).await;
        assert_eq!(
            store
                .remove(&stuck, Removal::UnlessLeased)
                .await
                .expect("guarded remove"),
            Removed::Deleted
        );
        acquired(
            store
                .begin(&begin(stuck, 2, LONG_LEASE, OnStale::Store))
                .await
                .expect("begin"),
            false,
        );

        // Forced, a running claim goes, and its holder is fenced.
        let forced = new_key();
        let token = claim(&*store, forced, 1, LONG_LEASE).await;
        assert_eq!(
            store
                .remove(&forced, Removal::Any)
                .await
                .expect("forced remove"),
            Removed::Deleted
        );
        assert_fenced(
            store
                .complete(&forced, token, &completed_by(clock, 1, TTL))
                .await,
            "complete after a forced removal",
        );
    }

    /// `scan` pages through every record present for the whole walk (a
    /// record may come twice on Redis, never not at all), claims and
    /// completions alike, and leaves out expired ones.
    pub(crate) async fn a_walk_meets_every_live_record(store: SharedStore, clock: Clock) {
        let mut live = std::collections::BTreeSet::new();
        for i in 0..600 {
            let key = new_key();
            let token = claim(&*store, key, 1, LONG_LEASE).await;
            if i % 6 != 0 {
                store
                    .complete(&key, token, &completed_by(clock, 1, TTL))
                    .await
                    .expect("complete");
            }
            live.insert(key);
        }
        let expired = new_key();
        let token = claim(&*store, expired, 1, LONG_LEASE).await;
        store
            .complete(
                &expired,
                token,
                &completed_by(clock, 1, Duration::from_millis(50)),
            )
            .await
            .expect("complete");
        tokio::time::sleep(Duration::from_millis(120)).await;

        let (mut met, mut pending, mut pages) = (std::collections::BTreeSet::new(), 0, 0);
        let mut cursor = idemproxy::store::ScanCursor::start();
        loop {
            let page = store.scan(&cursor, 250).await.expect("scan");
            pages += 1;
            for (key, record) in page.records {
                if met.insert(key) && matches!(record, Record::Pending(_)) {
                    pending += 1;
                }
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
            assert!(pages < 1000, "the walk ends");
        }
        assert!(!met.contains(&expired), "an expired record is left out");
        assert_eq!(met, live, "every live record, once or more");
        assert_eq!(pending, 100, "claims too");
        assert!(pages >= 3, "{pages} pages of at most about 250");
    }

    /// `list` keeps at most `limit` records a page, only those its filter
    /// admits, and its cursor goes on right after the last one examined:
    /// a walk meets every live record (once or more on Redis), never an
    /// expired one, and reads their metadata without their responses.
    pub(crate) async fn a_listing_keeps_its_limit_and_meets_every_live_record(
        store: SharedStore,
        clock: Clock,
    ) {
        use idemproxy::core::{KeyState, RecordMeta};
        use idemproxy::store::ListWant;
        let (mut live, mut claims) = (std::collections::BTreeSet::new(), 0);
        for i in 0..90 {
            let key = new_key();
            let token = claim(&*store, key, 1, LONG_LEASE).await;
            if i % 9 == 0 {
                claims += 1;
            } else {
                store
                    .complete(&key, token, &completed_by(clock, 1, TTL))
                    .await
                    .expect("complete");
            }
            live.insert(key);
        }
        let expired = new_key();
        let token = claim(&*store, expired, 1, LONG_LEASE).await;
        store
            .complete(
                &expired,
                token,
                &completed_by(clock, 1, Duration::from_millis(50)),
            )
            .await
            .expect("complete");
        tokio::time::sleep(Duration::from_millis(120)).await;

        let any = |_: &RecordMeta| true;
        let pending = |meta: &RecordMeta| meta.state == KeyState::Pending;
        for (limit, admits, expected) in [
            (
                1,
                &any as &(dyn Fn(&RecordMeta) -> bool + Send + Sync),
                live.len(),
            ),
            (7, &any, live.len()),
            (4, &pending, claims),
        ] {
            let want = ListWant {
                limit,
                max_examined: 10_000,
                max_bytes: 4 << 20,
                admits,
            };
            let (mut met, mut pages) = (std::collections::BTreeSet::new(), 0);
            let mut cursor = idemproxy::store::ScanCursor::start();
            loop {
                let page = store.list(&cursor, &want).await.expect("list");
                pages += 1;
                assert!(page.records.len() <= limit, "limit {limit}: {page:?}");
                assert!(page.unreadable.is_empty(), "{page:?}");
                for (key, meta) in page.records {
                    assert!(admits(&meta), "{meta:?}");
                    met.insert(key);
                }
                match page.next {
                    Some(next) => cursor = next,
                    None => break,
                }
                assert!(pages < 1000, "the walk ends");
            }
            assert!(!met.contains(&expired), "an expired record is left out");
            assert_eq!(met.len(), expected, "limit {limit}: every admitted record");
            assert!(met.is_subset(&live));
            assert!(
                pages >= expected.div_ceil(limit),
                "limit {limit}: {pages} pages"
            );
        }
    }

    pub(crate) async fn concurrent_begins_acquire_once(store: SharedStore, _clock: Clock) {
        const N: usize = 50;
        let key = new_key();
        let barrier = Arc::new(tokio::sync::Barrier::new(N));
        let tasks: Vec<_> = (0..N)
            .map(|_| {
                let store = store.clone();
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .begin(&begin(key, 1, LONG_LEASE, OnStale::Store))
                        .await
                })
            })
            .collect();
        let mut outcomes = Vec::with_capacity(N);
        for task in tasks {
            outcomes.push(task.await.expect("task").expect("begin"));
        }

        let winners: Vec<_> = outcomes
            .iter()
            .filter_map(|o| match o {
                BeginOutcome::Acquired {
                    token, took_over, ..
                } => {
                    assert!(!took_over);
                    Some(*token)
                }
                _ => None,
            })
            .collect();
        assert_eq!(winners.len(), 1, "exactly one acquires: {outcomes:?}");
        let Some(Record::Pending(pending)) = store.get(&key).await.expect("get") else {
            panic!("the key is pending");
        };
        assert_eq!(pending.token, winners[0]);
        let in_flight = outcomes
            .iter()
            .filter(|o| {
                **o == BeginOutcome::InFlight {
                    lease_expires_at: pending.lease_expires_at,
                }
            })
            .count();
        assert_eq!(in_flight, N - 1, "{outcomes:?}");
    }
}

// ------------------------------------------------------------ memory only

mod memory_only {
    use super::*;

    #[tokio::test]
    async fn kind_and_shared_clones() {
        let store = MemoryStore::new();
        assert_eq!(store.kind(), "memory");
        let clone = store.clone();
        let key = new_key();
        claim(&store, key, 1, LONG_LEASE).await;
        assert!(clone.get(&key).await.expect("get").is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn purge_drops_only_expired_records() {
        let clock = Clock::tokio();
        let store = MemoryStore::default().with_clock(clock);
        let short = Duration::from_millis(50);
        for _ in 0..2 {
            let key = new_key();
            let token = claim(&store, key, 1, LONG_LEASE).await;
            store
                .complete(&key, token, &completed_by(clock, 1, short))
                .await
                .expect("complete");
        }
        // A claim with a short lease and ttl expires too.
        let pending = Begin {
            ttl: short,
            ..begin(new_key(), 1, short, OnStale::Store)
        };
        acquired(store.begin(&pending).await.expect("begin"), false);
        let kept = new_key();
        claim(&store, kept, 1, LONG_LEASE).await;

        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(store.purge_expired(), 3);
        assert_eq!(store.purge_expired(), 0);
        assert!(store.get(&kept).await.expect("get").is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn the_purger_drops_expired_records_on_its_own_and_stops_with_the_store() {
        let clock = Clock::tokio();
        let store = MemoryStore::default().with_clock(clock);
        let purger = store.spawn_purger(Duration::from_millis(20));
        let expiring = new_key();
        let token = claim(&store, expiring, 1, LONG_LEASE).await;
        store
            .complete(
                &expiring,
                token,
                &completed_by(clock, 1, Duration::from_millis(30)),
            )
            .await
            .expect("complete");
        let kept = new_key();
        claim(&store, kept, 1, LONG_LEASE).await;

        tokio::time::sleep(Duration::from_millis(300)).await;
        // Already gone: the purger got there first.
        assert_eq!(store.purge_expired(), 0);
        assert!(store.get(&kept).await.expect("get").is_some());

        drop(store);
        tokio::time::timeout(Duration::from_secs(2), purger)
            .await
            .expect("the purger ends once the store is gone")
            .expect("purger task");
    }
}

// ---------------------------------------------------------- embedded only

mod embedded_only {
    use super::*;
    use fjall::{KeyspaceCreateOptions, PersistMode};

    fn open(dir: &TempDir) -> Arc<EmbeddedStore> {
        Arc::new(EmbeddedStore::open(dir.path()).expect("open the embedded store"))
    }

    /// Drops the last handle to `store` and waits for its purger to end, so
    /// that the database file is closed and unlocked.
    async fn close(store: Arc<EmbeddedStore>, purger: Option<tokio::task::JoinHandle<()>>) {
        // A purge in progress holds a handle for its duration: wait it out.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while Arc::strong_count(&store) > 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the test holds the last handle"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(store);
        if let Some(purger) = purger {
            tokio::time::timeout(Duration::from_secs(2), purger)
                .await
                .expect("the purger ends once the store is dropped")
                .expect("the purger did not panic");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_survive_a_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let done_key = new_key();
        let pending_key = new_key();
        let record = completed(1, TTL);
        let pending = {
            let store = open(&dir);
            assert_eq!(store.kind(), "embedded");
            let purger = store.spawn_purger(Duration::from_millis(20));
            let token = claim(&*store, done_key, 1, LONG_LEASE).await;
            store
                .complete(&done_key, token, &record)
                .await
                .expect("complete");
            claim(&*store, pending_key, 1, LONG_LEASE).await;
            let pending = store.get(&pending_key).await.expect("get");
            close(store, Some(purger)).await;
            pending
        };

        let store = open(&dir);
        assert_eq!(
            store
                .begin(&begin(done_key, 1, LONG_LEASE, OnStale::Store))
                .await
                .expect("begin"),
            BeginOutcome::Completed(record.into())
        );
        let Some(Record::Pending(p)) = pending else {
            panic!("the claim was pending");
        };
        assert_eq!(
            store
                .begin(&begin(pending_key, 1, LONG_LEASE, OnStale::Store))
                .await
                .expect("begin"),
            BeginOutcome::InFlight {
                lease_expires_at: p.lease_expires_at
            }
        );
        assert_eq!(
            store.get(&pending_key).await.expect("get"),
            Some(Record::Pending(p))
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purge_deletes_expired_records_from_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(&dir);
        let short = Duration::from_millis(100);
        let done = new_key();
        let token = claim(&*store, done, 1, LONG_LEASE).await;
        store
            .complete(&done, token, &completed(1, short))
            .await
            .expect("complete");
        let short_claim = Begin {
            ttl: short,
            ..begin(new_key(), 1, short, OnStale::Store)
        };
        acquired(store.begin(&short_claim).await.expect("begin"), false);
        let kept = new_key();
        let token = claim(&*store, kept, 1, LONG_LEASE).await;
        store
            .complete(&kept, token, &completed(1, TTL))
            .await
            .expect("complete");
        assert_eq!(store.record_count().await.expect("count"), 3);

        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(store.purge_expired().await.expect("purge"), 2);
        assert_eq!(store.record_count().await.expect("count"), 1);
        assert_eq!(store.purge_expired().await.expect("purge"), 0);
        assert!(store.get(&kept).await.expect("get").is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purger_runs_in_the_background_and_ends_with_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(&dir);
        let purger = store.spawn_purger(Duration::from_millis(30));
        let key = new_key();
        let token = claim(&*store, key, 1, LONG_LEASE).await;
        store
            .complete(&key, token, &completed(1, Duration::from_millis(50)))
            .await
            .expect("complete");

        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while store.record_count().await.expect("count") > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the purger deleted the expired record"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        close(store, Some(purger)).await;
        // Closed for real: the file can be opened again.
        open(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn corrupt_values_are_reported_not_fatal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let garbled = new_key();
        let empty = new_key();
        let future = new_key();
        let token = {
            let store = open(&dir);
            // Indexed to expire soon, so the purge below meets it.
            let short = Begin {
                ttl: Duration::from_millis(50),
                ..begin(garbled, 1, Duration::from_millis(50), OnStale::Store)
            };
            let token = acquired(store.begin(&short).await.expect("begin"), false);
            close(store, None).await;
            token
        };
        {
            // Written past the store, as a bug or a bit flip would: the
            // record of `garbled`, after an expiry prefix, that does not
            // decode; a value too short for the prefix; and a record of a
            // format this build does not know.
            let db = fjall::Database::builder(dir.path().join(DATA_DIR))
                .open()
                .expect("open raw");
            let records = db
                .keyspace(RECORDS_KEYSPACE, KeyspaceCreateOptions::default)
                .expect("keyspace");
            let never = u64::MAX.to_be_bytes();
            records
                .insert(garbled.as_bytes(), [&never[..], b"\x01garbage"].concat())
                .expect("insert");
            records.insert(empty.as_bytes(), b"").expect("insert");
            records
                .insert(future.as_bytes(), [&never[..], &[99u8, 1, 2, 3]].concat())
                .expect("insert");
            db.persist(PersistMode::SyncAll).expect("persist");
            assert_eq!(records.len().expect("len"), 3);
        }

        let store = open(&dir);
        let corrupt = |what: &str, result: Result<(), StoreError>| {
            assert!(
                matches!(result, Err(StoreError::Corrupt(_))),
                "{what}: expected Corrupt, got {result:?}"
            );
        };
        for key in [garbled, empty, future] {
            corrupt("get", store.get(&key).await.map(drop));
            corrupt(
                "begin",
                store
                    .begin(&begin(key, 1, LONG_LEASE, OnStale::Store))
                    .await
                    .map(drop),
            );
        }
        corrupt(
            "complete",
            store.complete(&garbled, token, &completed(1, TTL)).await,
        );
        corrupt("release", store.release(&garbled, token).await);

        // The purger leaves what it cannot read for an operator.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(store.purge_expired().await.expect("purge"), 0);
        assert_eq!(store.record_count().await.expect("count"), 3);

        // A walk reads past them and lists each apart, with why.
        let good = new_key();
        let token = acquired(
            store
                .begin(&begin(good, 1, LONG_LEASE, OnStale::Store))
                .await
                .expect("begin"),
            false,
        );
        store
            .complete(&good, token, &completed(1, TTL))
            .await
            .expect("complete");
        let (read, listed) = walk(&*store).await;
        assert_eq!(read, [good].into(), "the record that reads");
        let mut expected = vec![garbled, empty, future];
        expected.sort();
        assert_eq!(listed.keys().copied().collect::<Vec<_>>(), expected);
        assert!(listed.values().all(|why| !why.is_empty()), "{listed:?}");
        store
            .remove(&good, Removal::Any)
            .await
            .expect("remove the good one");

        // Removing needs no decoding: it is how an operator clears them.
        for key in [garbled, empty, future] {
            assert_eq!(
                store.remove(&key, Removal::Any).await.expect("remove"),
                Removed::Deleted
            );
            assert_eq!(store.get(&key).await.expect("get"), None);
        }
        acquired(
            store
                .begin(&begin(garbled, 1, LONG_LEASE, OnStale::Store))
                .await
                .expect("begin"),
            false,
        );
        store.ping().await.expect("ping");
    }

    #[tokio::test]
    async fn a_second_open_is_refused_and_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = EmbeddedStore::open(dir.path()).expect("first open");
        match EmbeddedStore::open(dir.path()) {
            Err(StoreError::Unavailable(message)) => {
                let file = dir.path().join(DATA_DIR);
                assert!(message.contains(&file.display().to_string()), "{message}");
            }
            Err(other) => panic!("expected Unavailable, got {other:?}"),
            Ok(_) => panic!("a second open of the same file must fail"),
        }
        drop(first);
        EmbeddedStore::open(dir.path()).expect("open after the first closed");
    }

    #[tokio::test]
    async fn open_creates_the_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let nested = dir.path().join("a").join("b");
        let store = EmbeddedStore::open(&nested).expect("open");
        assert_eq!(store.path(), nested.join(DATA_DIR));
        assert!(nested.join(DATA_DIR).is_dir());
        store.ping().await.expect("ping");
    }
}
