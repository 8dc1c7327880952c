//! Group commit: the one writer thread, the bounded queue of changes to
//! it, and how a group's batch ends for each change in it. One fsync
//! then serves every change queued while the previous one ran (see "Group
//! commit" in the [`super`] docs).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle as ThreadHandle;

use fjall::{Database, Keyspace};
use tokio::sync::oneshot;

use super::tables::{db_error, Tables};
use super::EmbeddedStore;
use crate::store::StoreError;

/// Most changes one group takes (see "Group commit" in the
/// [`super`] docs): enough to make one fsync serve every request a busy
/// proxy has in flight, few enough that a group's batch stays small.
pub const MAX_GROUP: usize = 256;

/// Most changes waiting for the writer. A busy proxy keeps a few dozen
/// queued (a group's worth arrives during each fsync); a queue this long
/// means the disk stopped keeping up, and a change past it fails at once
/// (`Unavailable`, so 503) rather than waiting behind thousands: callers
/// that time out leave their changes queued, and a completion retried
/// against a stalled disk queued a copy of its response each time.
pub const MAX_QUEUED: usize = 16 * MAX_GROUP;

impl EmbeddedStore {
    /// Queues `op` for the writer and waits until its group is committed.
    /// A caller that stops waiting (timeout) does not withdraw it: the
    /// change commits or aborts with its group, as a whole, unless
    /// `Waited::Only` says to skip it once its caller is gone.
    pub(super) async fn write<T, F>(&self, waited: Waited, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Tables) -> Result<T, WriteError> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let job: Job = Box::new(move |tables| {
            if waited == Waited::Only && answer.is_closed() {
                return Ran {
                    aborts: None,
                    answer: Box::new(|_| {}),
                };
            }
            let result = op(tables);
            let aborts = match &result {
                Err(WriteError::Storage(e)) => Some(e.clone()),
                _ => None,
            };
            Ran {
                aborts,
                answer: Box::new(move |group| {
                    let _ = answer.send(match (group, result) {
                        // Nothing of the group was written.
                        (Err(e), _) => Err(e.clone()),
                        (Ok(()), Ok(value)) => Ok(value),
                        (Ok(()), Err(WriteError::Refused(e) | WriteError::Storage(e))) => Err(e),
                    });
                }),
            }
        });
        self.writer.submit(job)?;
        answered.await.map_err(|_| {
            StoreError::Unavailable(
                "the embedded store's writer dropped the change (see its log)".into(),
            )
        })?
    }
}

/// Whether a change still runs once its caller stopped waiting for it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Waited {
    /// Runs whatever happens: a completion or a release is as right late
    /// as on time (the fencing token still decides), and may be the only
    /// copy of an outcome.
    Either,
    /// Runs only if its caller still waits. A `begin` whose caller timed
    /// out was answered 503 and executed nothing: if it claimed the key
    /// after that, nobody would hold the claim, and the retry would find
    /// the key in flight, then settled `outcome-unknown` for a request that
    /// never ran.
    Only,
}

/// Why a change did not go through.
pub(super) enum WriteError {
    /// This change alone, which wrote nothing: the rest of its group
    /// commits.
    Refused(StoreError),
    /// fjall failed in the middle of the group: the group is dropped.
    Storage(StoreError),
}

/// A fjall failure: aborts the group.
pub(super) fn storage(e: fjall::Error) -> WriteError {
    WriteError::Storage(db_error(e))
}

/// A change queued for the writer: it runs inside its group and leaves
/// the answer to send once the group's fate is known.
type Job = Box<dyn FnOnce(&mut Tables) -> Ran + Send>;

struct Ran {
    /// A fjall failure: what the group read can no longer be trusted.
    aborts: Option<StoreError>,
    answer: Answer,
}

/// Sends a change's caller its answer, given how its group ended.
type Answer = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

/// The writer thread and the queue to it.
pub(super) struct Writer {
    /// `None` only while dropping: closing the queue is what stops the
    /// thread, after it has answered everything queued. At most
    /// [`MAX_QUEUED`] changes wait in it.
    queue: Option<mpsc::SyncSender<Job>>,
    thread: Option<ThreadHandle<()>>,
    /// Groups committed, by the writer thread ([`EmbeddedStore::commit_count`]).
    pub(super) commits: Arc<AtomicU64>,
    /// Changes queued since the store opened: lets a test know that the
    /// changes it started are waiting for the writer.
    #[cfg(test)]
    submitted: AtomicU64,
}

impl Writer {
    pub(super) fn start(db: Database, records: Keyspace) -> Result<Self, StoreError> {
        let (queue, jobs) = mpsc::sync_channel(MAX_QUEUED);
        let commits = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&commits);
        let thread = std::thread::Builder::new()
            .name("idemproxy-store".into())
            .spawn(move || write_groups(&db, &records, &jobs, &counter))
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot start the embedded store's writer: {e}"))
            })?;
        Ok(Self {
            queue: Some(queue),
            thread: Some(thread),
            commits,
            #[cfg(test)]
            submitted: AtomicU64::new(0),
        })
    }

    fn submit(&self, job: Job) -> Result<(), StoreError> {
        let Some(queue) = &self.queue else {
            return Err(closed());
        };
        match queue.try_send(job) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(_)) => {
                return Err(StoreError::Unavailable(format!(
                "the embedded store's writer is {MAX_QUEUED} changes behind (is the disk stalled?)"
            )))
            }
            Err(mpsc::TrySendError::Disconnected(_)) => return Err(closed()),
        }
        #[cfg(test)]
        self.submitted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn closed() -> StoreError {
    StoreError::Unavailable("the embedded store is closed".into())
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            // At most the group in progress: one batch and its fsync.
            let _ = thread.join();
        }
    }
}

/// The writer thread: waits for a change, takes everything queued behind
/// it, commits them as one group, answers them; until the queue closes.
fn write_groups(
    db: &Database,
    records: &Keyspace,
    jobs: &mpsc::Receiver<Job>,
    commits: &AtomicU64,
) {
    let mut queued = VecDeque::new();
    loop {
        if queued.is_empty() {
            match jobs.recv() {
                Ok(job) => queued.push_back(job),
                Err(_) => return,
            }
        }
        while queued.len() < MAX_GROUP {
            match jobs.try_recv() {
                Ok(job) => queued.push_back(job),
                Err(_) => break,
            }
        }
        // A panic would be a bug in a change; it costs that group (its
        // callers see the change dropped), not the store.
        let group = catch_unwind(AssertUnwindSafe(|| {
            commit_group(db, records, &mut queued, commits)
        }));
        match group {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::error!(%error, "embedded store: a group of changes failed"),
            // The changes run before it wrote only to the group the
            // unwinding dropped, so their callers see them dropped; those
            // queued after it never ran and go in the next group, as after
            // a storage error.
            Err(_) => tracing::error!("embedded store: a change panicked; its group was dropped"),
        }
    }
}

/// Runs queued changes as one group, in order, writes and persists its
/// batch and answers them. Changes not run (after one that aborted the
/// group) stay queued for the next group. If the group fails before any
/// change ran, the whole queue is dropped (its callers see that), rather
/// than retried in a loop.
fn commit_group(
    db: &Database,
    records: &Keyspace,
    queued: &mut VecDeque<Job>,
    commits: &AtomicU64,
) -> Result<(), StoreError> {
    let mut answers = Vec::with_capacity(queued.len());
    let result = run_group(db, records, queued, &mut answers);
    match result {
        // Counted before anyone is answered, so a caller that got its
        // answer sees its commit counted.
        Ok(true) => {
            commits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(false) => {}
        Err(_) if answers.is_empty() => queued.clear(),
        Err(_) => {}
    }
    let result = result.map(|_| ());
    for answer in answers {
        answer(result.as_ref().copied());
    }
    result
}

fn run_group(
    db: &Database,
    records: &Keyspace,
    queued: &mut VecDeque<Job>,
    answers: &mut Vec<Answer>,
) -> Result<bool, StoreError> {
    let mut tables = Tables::new(records.clone());
    while let Some(job) = queued.pop_front() {
        let ran = job(&mut tables);
        answers.push(ran.answer);
        if let Some(error) = ran.aborts {
            // Dropping the group's writes unwritten aborts it.
            return Err(error);
        }
    }
    if !tables.wrote() {
        // Nothing to make durable: no batch, no fsync.
        return Ok(false);
    }
    tables.commit(db)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::task::JoinHandle;

    use super::*;
    use crate::core::{FencingToken, Record, RecordKey};
    use crate::store::embedded::tests::{begin, claim, completed, token};
    use crate::store::{BeginOutcome, OnStale, Removal, Removed, Store};

    /// Holds the writer inside a change until the returned sender is used
    /// (or dropped), so that the changes queued meanwhile form one group.
    async fn hold_writer(store: &Arc<EmbeddedStore>) -> std::sync::mpsc::Sender<()> {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (running, started) = oneshot::channel();
        let holder = Arc::clone(store);
        tokio::spawn(async move {
            holder
                .write(Waited::Either, move |_| {
                    let _ = running.send(());
                    let _ = held.recv();
                    Ok(())
                })
                .await
        });
        started.await.expect("the writer runs the holding change");
        release
    }

    /// Claims `[i; 32]` in a task of its own, so that it can wait for the
    /// writer while the test goes on.
    fn spawn_claim(
        store: &Arc<EmbeddedStore>,
        i: u8,
    ) -> JoinHandle<Result<BeginOutcome, StoreError>> {
        let store = Arc::clone(store);
        tokio::spawn(async move {
            store
                .begin(&begin(
                    RecordKey::from_bytes([i; 32]),
                    60_000,
                    OnStale::Store,
                ))
                .await
        })
    }

    /// Waits until `changes` changes in all have been queued for the writer.
    async fn until_queued(store: &EmbeddedStore, changes: u64) {
        for _ in 0..500 {
            if store.writer.submitted.load(Ordering::Relaxed) >= changes {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("{changes} changes never reached the writer's queue");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_queued_together_commit_as_one_group_and_one_refusal_spares_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let held = RecordKey::from_bytes([9; 32]);
        let token_held = claim(&store, held).await;

        let commits_before = store.commit_count();
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        // Queued behind the holder, in this order: 15 claims, a completion
        // with a token that does not own `held`, a release by its rightful
        // holder, 15 more claims.
        let claim = |i: u8| spawn_claim(&store, i);
        let mut claims: Vec<_> = (100..115u8).map(claim).collect();
        until_queued(&store, queued_before + 15).await;
        let wrong = {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                store
                    .complete(&held, FencingToken::random(), &completed(60_000))
                    .await
            })
        };
        until_queued(&store, queued_before + 16).await;
        let rightful = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.release(&held, token_held).await })
        };
        until_queued(&store, queued_before + 17).await;
        claims.extend((115..130u8).map(claim));
        until_queued(&store, queued_before + 32).await;
        drop(release);

        assert!(
            matches!(wrong.await.expect("task"), Err(StoreError::Fenced)),
            "a completion without the key's token is refused"
        );
        rightful
            .await
            .expect("task")
            .expect("the holder releases its key");
        for claim in claims {
            token(claim.await.expect("task").expect("claim"));
        }
        // One group for the 32 queued behind the holder (whose own group
        // wrote nothing, so committed nothing).
        assert_eq!(store.commit_count(), commits_before + 1);

        // Everything acknowledged is on disk: a new process sees it.
        drop(store);
        let reopened = EmbeddedStore::open(dir.path()).expect("reopen at once");
        assert_eq!(reopened.record_count().await.expect("count"), 30);
        assert_eq!(reopened.get(&held).await.expect("get"), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_begin_whose_caller_stopped_waiting_claims_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let (gone, waited) = (
            RecordKey::from_bytes([1; 32]),
            RecordKey::from_bytes([2; 32]),
        );
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        // Queued behind the holder; its caller gives up (store.timeout)
        // and answers its request 503.
        let given_up = tokio::time::timeout(
            Duration::from_millis(100),
            store.begin(&begin(gone, 60_000, OnStale::Store)),
        )
        .await;
        assert!(given_up.is_err(), "still queued: {given_up:?}");
        let behind = spawn_claim(&store, 2);
        until_queued(&store, queued_before + 2).await;
        drop(release);
        // A begin still waited for runs; the abandoned one before it did not.
        token(behind.await.expect("task").expect("claim"));
        assert_eq!(store.get(&gone).await.expect("get"), None);
        assert!(store.get(&waited).await.expect("get").is_some());
        // Completions run late all the same (covered by the fencing token).
        let t = claim(&store, gone).await;
        let release = hold_writer(&store).await;
        let late = tokio::time::timeout(
            Duration::from_millis(100),
            store.complete(&gone, t, &completed(60_000)),
        )
        .await;
        assert!(late.is_err(), "still queued: {late:?}");
        drop(release);
        claim(&store, RecordKey::from_bytes([3; 32])).await;
        assert!(matches!(
            store.get(&gone).await.expect("get"),
            Some(Record::Completed(_))
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_past_a_full_queue_fails_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        let waiting: Vec<_> = (0..MAX_QUEUED)
            .map(|i| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let mut bytes = [7; 32];
                    bytes[..8].copy_from_slice(&(i as u64).to_le_bytes());
                    let key = RecordKey::from_bytes(bytes);
                    store.begin(&begin(key, 60_000, OnStale::Store)).await
                })
            })
            .collect();
        until_queued(&store, queued_before + MAX_QUEUED as u64).await;
        let refused = tokio::time::timeout(
            Duration::from_secs(5),
            store.begin(&begin(
                RecordKey::from_bytes([8; 32]),
                60_000,
                OnStale::Store,
            )),
        )
        .await
        .expect("answered at once, not queued");
        assert!(
            matches!(&refused, Err(StoreError::Unavailable(why)) if why.contains("changes behind")),
            "{refused:?}"
        );
        drop(release);
        for claim in waiting {
            token(
                claim
                    .await
                    .expect("task")
                    .expect("queued claims go through"),
            );
        }
        // And the queue takes changes again.
        claim(&store, RecordKey::from_bytes([8; 32])).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_claims_of_one_key_leave_one_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let release = hold_writer(&store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        let claims: Vec<_> = (0..16).map(|_| spawn_claim(&store, 7)).collect();
        // All of them wait for the writer, and land in the same group.
        until_queued(&store, queued_before + 16).await;
        drop(release);
        let mut acquired = 0;
        for claim in claims {
            match claim.await.expect("task").expect("begin") {
                BeginOutcome::Acquired { .. } => acquired += 1,
                BeginOutcome::InFlight { .. } => {}
                other => panic!("expected Acquired or InFlight, got {other:?}"),
            }
        }
        assert_eq!(acquired, 1);
    }

    /// Queues, behind a held writer, a claim of `[1; 32]`, then `failing`
    /// (a change that fails the group), then a claim of `[3; 32]`, and
    /// returns their answers once the writer is let go.
    async fn group_with_failing_change(
        store: &Arc<EmbeddedStore>,
        failing: impl FnOnce(&mut Tables) -> Result<(), WriteError> + Send + 'static,
    ) -> (
        Result<BeginOutcome, StoreError>,
        Result<(), StoreError>,
        Result<BeginOutcome, StoreError>,
    ) {
        let release = hold_writer(store).await;
        let queued_before = store.writer.submitted.load(Ordering::Relaxed);
        let claim = |i: u8| spawn_claim(store, i);
        let first = claim(1);
        until_queued(store, queued_before + 1).await;
        let failed = {
            let store = Arc::clone(store);
            tokio::spawn(async move { store.write(Waited::Either, failing).await })
        };
        until_queued(store, queued_before + 2).await;
        let last = claim(3);
        until_queued(store, queued_before + 3).await;
        drop(release);
        (
            first.await.expect("task"),
            failed.await.expect("task"),
            last.await.expect("task"),
        )
    }

    /// A fjall failure in the middle of a group: nothing of the group is
    /// written, every change already run in it is answered with the error
    /// (none is told it is durable), and the changes queued after it run
    /// in the next group.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_storage_failure_fails_its_group_and_the_changes_after_it_run_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let (first, failed, last) = group_with_failing_change(&store, |tables| {
            // As if fjall failed after this change had written.
            tables.delete(&RecordKey::from_bytes([5; 32]));
            Err(WriteError::Storage(StoreError::Unavailable(
                "injected".into(),
            )))
        })
        .await;
        assert!(
            matches!(&first, Err(StoreError::Unavailable(e)) if e == "injected"),
            "{first:?}"
        );
        assert!(matches!(failed, Err(StoreError::Unavailable(_))));
        assert!(
            matches!(last, Ok(BeginOutcome::Acquired { .. })),
            "{last:?}"
        );
        assert_eq!(
            store
                .get(&RecordKey::from_bytes([1; 32]))
                .await
                .expect("get"),
            None
        );
        assert!(store
            .get(&RecordKey::from_bytes([3; 32]))
            .await
            .expect("get")
            .is_some());
    }

    /// A change that panics costs what it shared a group with, not
    /// the store: the changes run before it in its group are dropped
    /// unwritten (their callers see that), those queued after it run in
    /// the next group, and the writer goes on serving.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_change_drops_its_group_and_the_writer_goes_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let (first, failed, last) =
            group_with_failing_change(&store, |_| panic!("a bug in a change")).await;
        assert!(
            matches!(first, Err(StoreError::Unavailable(_))),
            "{first:?}"
        );
        assert!(matches!(failed, Err(StoreError::Unavailable(_))));
        assert!(
            matches!(last, Ok(BeginOutcome::Acquired { .. })),
            "{last:?}"
        );
        let dropped = RecordKey::from_bytes([1; 32]);
        assert_eq!(store.get(&dropped).await.expect("get"), None);
        claim(&store, dropped).await;
        assert!(store
            .get(&RecordKey::from_bytes([3; 32]))
            .await
            .expect("get")
            .is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn begins_that_only_decide_commit_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let done = RecordKey::from_bytes([1; 32]);
        let t = claim(&store, done).await;
        store
            .complete(&done, t, &completed(60_000))
            .await
            .expect("complete");
        let busy = RecordKey::from_bytes([2; 32]);
        claim(&store, busy).await;
        let commits = store.commit_count();

        // Replays, duplicates in flight and removing an absent key decide
        // without writing: no commit, so no fsync.
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..30u8 {
            let store = Arc::clone(&store);
            calls.spawn(async move {
                match i % 3 {
                    0 => matches!(
                        store.begin(&begin(done, 60_000, OnStale::Store)).await,
                        Ok(BeginOutcome::Completed(_))
                    ),
                    1 => matches!(
                        store.begin(&begin(busy, 60_000, OnStale::Store)).await,
                        Ok(BeginOutcome::InFlight { .. })
                    ),
                    _ => matches!(
                        store
                            .remove(&RecordKey::from_bytes([3; 32]), Removal::Any)
                            .await,
                        Ok(Removed::Absent)
                    ),
                }
            });
        }
        while let Some(answered) = calls.join_next().await {
            assert!(answered.expect("task"), "each call got its answer");
        }
        assert_eq!(store.commit_count(), commits);

        // A group that writes still commits.
        store.remove(&done, Removal::Any).await.expect("remove");
        assert_eq!(store.commit_count(), commits + 1);
    }
}
