//! Group commit, pipelined: the writer thread, which decides groups of
//! changes; the committer thread, which writes and syncs them in order
//! while the writer decides the next ones; the bounded queue of changes to
//! the writer; and how a group ends for each change in it (see "Group
//! commit" in the [`super`] docs).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle as ThreadHandle;

use fjall::{Database, Keyspace};
use tokio::sync::oneshot;

use super::tables::{commit, db_error, GroupWrites, Tables};
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

/// Most decided groups waiting for the committer. It takes all of them
/// into its next batch, so a few are enough to keep it busy; past them the
/// writer waits, and changes wait in (and past [`MAX_QUEUED`], are refused
/// by) the queue, as when the disk stalls.
const MAX_DECIDED: usize = 4;

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

/// A group the writer decided, for the committer to write, persist and
/// answer.
struct Decided {
    /// Which failures it is bound to: it was decided on the writes of every
    /// group in flight, and fails with any of them (see [`write_groups`]).
    epoch: u64,
    /// Groups are numbered in the order they were decided.
    group: u64,
    writes: GroupWrites,
    answers: Vec<Answer>,
}

/// What the committer tells the writer about the groups it took.
enum Committed {
    /// Every group up to this one is durable and in the keyspace.
    Through(u64),
    /// Every group of this epoch or earlier failed, or will.
    Failed { epoch: u64 },
}

/// The writer and committer threads and the queue to them.
pub(super) struct Writer {
    /// `None` only while dropping: closing the queue is what stops the
    /// threads, after they have answered everything queued. At most
    /// [`MAX_QUEUED`] changes wait in it.
    queue: Option<mpsc::SyncSender<Job>>,
    thread: Option<ThreadHandle<()>>,
    /// Batches committed, by the committer ([`EmbeddedStore::commit_count`]).
    pub(super) commits: Arc<AtomicU64>,
    /// Lets tests see the pipeline's steps and fail a commit.
    #[cfg(test)]
    pub(super) probe: Arc<Probe>,
}

/// What tests see of, and inject into, the pipeline.
#[cfg(test)]
#[derive(Default)]
pub(super) struct Probe {
    /// Changes queued since the store opened: lets a test know that the
    /// changes it started are waiting for the writer.
    pub(super) submitted: AtomicU64,
    /// Groups the writer handed to the committer.
    pub(super) handed_over: AtomicU64,
    /// Runs (once) on the committer before its next batch that writes, in
    /// place of fjall's failure: its error fails the batch.
    pub(super) before_commit: std::sync::Mutex<Option<CommitHook>>,
}

#[cfg(test)]
pub(super) type CommitHook = Box<dyn FnOnce() -> Result<(), StoreError> + Send>;

impl Writer {
    pub(super) fn start(db: Database, records: Keyspace) -> Result<Self, StoreError> {
        let (queue, jobs) = mpsc::sync_channel(MAX_QUEUED);
        let (to_committer, decided) = mpsc::sync_channel(MAX_DECIDED);
        let (to_writer, committed) = mpsc::channel();
        let commits = Arc::new(AtomicU64::new(0));
        #[cfg(test)]
        let probe = Arc::new(Probe::default());
        let pipeline = Pipeline {
            commits: Arc::clone(&commits),
            #[cfg(test)]
            probe: Arc::clone(&probe),
        };
        let committer = {
            let records = records.clone();
            std::thread::Builder::new()
                .name("idemproxy-commit".into())
                .spawn(move || commit_groups(&db, &records, &decided, &to_writer, &pipeline))
        };
        // Lets a test know that the writer has decided the groups it waits
        // for.
        #[cfg(test)]
        let handed_over = {
            let probe = Arc::clone(&probe);
            move || {
                probe.handed_over.fetch_add(1, Ordering::Relaxed);
            }
        };
        #[cfg(not(test))]
        let handed_over = || {};
        let thread = committer.and_then(|committer| {
            std::thread::Builder::new()
                .name("idemproxy-store".into())
                .spawn(move || {
                    write_groups(records, &jobs, &to_committer, &committed, handed_over);
                    // Closing its queue ends the committer, once it has
                    // answered every group decided; the database is closed
                    // when both are gone.
                    drop(to_committer);
                    let _ = committer.join();
                })
        });
        let thread = thread.map_err(|e| {
            StoreError::Unavailable(format!("cannot start the embedded store's writer: {e}"))
        })?;
        Ok(Self {
            queue: Some(queue),
            thread: Some(thread),
            commits,
            #[cfg(test)]
            probe,
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
        self.probe.submitted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// What the committer shares with the store.
struct Pipeline {
    commits: Arc<AtomicU64>,
    #[cfg(test)]
    probe: Arc<Probe>,
}

fn closed() -> StoreError {
    StoreError::Unavailable("the embedded store is closed".into())
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            // At most the groups decided: one batch and its fsync.
            let _ = thread.join();
        }
    }
}

/// The writer thread: waits for a change, takes everything queued behind
/// it, decides them as one group on the keyspace overlaid with the groups
/// still in flight, and hands the group to the committer without waiting
/// for its commit; until the queue closes.
///
/// A group decided on another's writes must not outlive it: if that one
/// fails, so does this one. Every group carries the writer's epoch, and
/// when the committer fails a batch it fails every later group of the
/// same epoch or earlier: all of them were decided before the writer
/// learned of the failure, on overlays that may hold the failed writes.
/// The writer, told, forgets every write in flight and moves to the next
/// epoch. This fails more than the groups that read the failed writes, but
/// a failure of fjall is rare and poisons the database anyway (every later
/// write fails); what matters is that none of them is committed.
fn write_groups(
    records: Keyspace,
    jobs: &mpsc::Receiver<Job>,
    to_committer: &mpsc::SyncSender<Decided>,
    committed: &mpsc::Receiver<Committed>,
    handed_over: impl Fn(),
) {
    let mut tables = Tables::new(records);
    let (mut epoch, mut next_group) = (0, 0);
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
        while let Ok(news) = committed.try_recv() {
            match news {
                Committed::Through(group) => tables.committed_through(group),
                Committed::Failed { epoch: failed } if failed >= epoch => {
                    tables.forget_in_flight();
                    epoch = failed + 1;
                }
                Committed::Failed { .. } => {}
            }
        }
        let mut answers = Vec::with_capacity(queued.len());
        // A panic would be a bug in a change; it costs that group (its
        // callers see the change dropped), not the store.
        let ran = catch_unwind(AssertUnwindSafe(|| {
            run_group(&mut tables, &mut queued, &mut answers)
        }));
        match ran {
            // Decided on durable state alone, writing nothing: nothing to
            // wait for.
            Ok(Ok(())) if !tables.wrote() && !tables.reads_in_flight() => {
                answers.into_iter().for_each(|answer| answer(Ok(())));
            }
            Ok(Ok(())) => {
                let group = next_group;
                next_group += 1;
                let writes = tables.hand_over(group);
                let decided = Decided {
                    epoch,
                    group,
                    writes,
                    answers,
                };
                if to_committer.send(decided).is_err() {
                    // The committer is gone (it cannot be, short of a
                    // panic in fjall): its answers are dropped, and so
                    // are the changes queued.
                    tracing::error!("embedded store: the committer stopped");
                    return;
                }
                handed_over();
            }
            Ok(Err(error)) => {
                tables.discard();
                tracing::error!(%error, "embedded store: a group of changes failed");
                answers.into_iter().for_each(|answer| answer(Err(&error)));
            }
            // The changes run before it wrote only to the group's overlay,
            // discarded, so their callers see them dropped; those queued
            // after it never ran and go in the next group, as after a
            // storage error.
            Err(_) => {
                tables.discard();
                tracing::error!("embedded store: a change panicked; its group was dropped");
            }
        }
    }
}

/// Runs queued changes as one group, in order. Changes not run (after one
/// that aborted the group) stay queued for the next group.
fn run_group(
    tables: &mut Tables,
    queued: &mut VecDeque<Job>,
    answers: &mut Vec<Answer>,
) -> Result<(), StoreError> {
    while let Some(job) = queued.pop_front() {
        let ran = job(tables);
        answers.push(ran.answer);
        if let Some(error) = ran.aborts {
            // Discarding the group's writes aborts it.
            return Err(error);
        }
    }
    Ok(())
}

/// The committer thread: takes every group decided so far, writes them as
/// one batch with one fsync, then answers their callers and tells the
/// writer; until the writer is gone.
fn commit_groups(
    db: &Database,
    records: &Keyspace,
    decided: &mpsc::Receiver<Decided>,
    to_writer: &mpsc::Sender<Committed>,
    pipeline: &Pipeline,
) {
    // The last failure, and its epoch: the groups of that epoch or earlier
    // still to come were decided on its writes.
    let mut failed: Option<(u64, StoreError)> = None;
    let mut batch = Vec::with_capacity(MAX_DECIDED);
    while let Ok(group) = decided.recv() {
        batch.push(group);
        batch.extend(decided.try_iter());
        let doomed = batch
            .iter()
            .take_while(|group| {
                failed
                    .as_ref()
                    .is_some_and(|(epoch, _)| group.epoch <= *epoch)
            })
            .count();
        for group in batch.drain(..doomed) {
            if let Some((_, error)) = &failed {
                let error = StoreError::Unavailable(format!(
                    "an earlier group of changes that this one read failed: {error}"
                ));
                group
                    .answers
                    .into_iter()
                    .for_each(|answer| answer(Err(&error)));
            }
        }
        let Some(last) = batch.last() else { continue };
        let (epoch, group) = (last.epoch, last.group);
        let result = catch_unwind(AssertUnwindSafe(|| {
            #[cfg(test)]
            if batch.iter().any(|group| !group.writes.is_empty()) {
                let hook = pipeline
                    .probe
                    .before_commit
                    .lock()
                    .ok()
                    .and_then(|mut h| h.take());
                if let Some(hook) = hook {
                    hook()?;
                }
            }
            commit(db, records, batch.iter().map(|group| &group.writes))
        }))
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(
                "the embedded store's commit panicked".into(),
            ))
        });
        let news = match &result {
            Ok(wrote) => {
                // Counted before anyone is answered, so a caller that got
                // its answer sees its commit counted.
                if *wrote {
                    pipeline.commits.fetch_add(1, Ordering::Relaxed);
                }
                Committed::Through(group)
            }
            Err(error) => {
                tracing::error!(%error, "embedded store: a batch of changes failed");
                failed = Some((epoch, error.clone()));
                Committed::Failed { epoch }
            }
        };
        // The writer reads it before its next group: it never waits.
        let _ = to_writer.send(news);
        let result = result.as_ref().map(|_| ());
        for group in batch.drain(..) {
            group.answers.into_iter().for_each(|answer| answer(result));
        }
    }
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

    /// Waits until `counter` (of the probe) reaches `count`.
    async fn until_counted(counter: &AtomicU64, count: u64, what: &str) {
        for _ in 0..500 {
            if counter.load(Ordering::Relaxed) >= count {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("never {count} {what}");
    }

    /// Waits until `changes` changes in all have been queued for the writer.
    async fn until_queued(store: &EmbeddedStore, changes: u64) {
        let queued = &store.writer.probe.submitted;
        until_counted(queued, changes, "changes queued for the writer").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_queued_together_commit_as_one_group_and_one_refusal_spares_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let held = RecordKey::from_bytes([9; 32]);
        let token_held = claim(&store, held).await;

        let commits_before = store.commit_count();
        let release = hold_writer(&store).await;
        let queued_before = store.writer.probe.submitted.load(Ordering::Relaxed);
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
        let queued_before = store.writer.probe.submitted.load(Ordering::Relaxed);
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
        let queued_before = store.writer.probe.submitted.load(Ordering::Relaxed);
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
        let queued_before = store.writer.probe.submitted.load(Ordering::Relaxed);
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
        let queued_before = store.writer.probe.submitted.load(Ordering::Relaxed);
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

    /// Waits until the writer has handed `groups` groups in all to the
    /// committer.
    async fn until_handed_over(store: &EmbeddedStore, groups: u64) {
        let handed_over = &store.writer.probe.handed_over;
        until_counted(handed_over, groups, "groups handed to the committer").await;
    }

    /// Stops the committer before its next batch that writes, until the
    /// returned sender is used (or dropped); the batch then fails with
    /// `failure`, as if fjall had, or commits. The receiver says when the
    /// committer is held.
    fn hold_next_commit(
        store: &EmbeddedStore,
        failure: Option<StoreError>,
    ) -> (std::sync::mpsc::Sender<()>, oneshot::Receiver<()>) {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (committing, started) = oneshot::channel();
        let hook: CommitHook = Box::new(move || {
            let _ = committing.send(());
            let _ = held.recv();
            failure.map_or(Ok(()), Err)
        });
        *store.writer.probe.before_commit.lock().expect("hook") = Some(hook);
        (release, started)
    }

    /// The pipeline's failure case: a batch fails while groups decided on
    /// its writes wait behind it. None of them may commit or tell its
    /// caller what it read: the claim failed, so a completion of it, and a
    /// begin that found it in flight, read a claim that never existed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_commit_fails_the_groups_decided_on_its_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let (key, other) = (
            RecordKey::from_bytes([1; 32]),
            RecordKey::from_bytes([2; 32]),
        );
        let (release, started) = hold_next_commit(
            &store,
            Some(StoreError::Unavailable("injected commit failure".into())),
        );

        // The claim's group reaches the committer, which stops before its
        // commit.
        let claim_of_key = begin(key, 60_000, OnStale::Store);
        let holder = claim_of_key.token;
        let claimed = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.begin(&claim_of_key).await })
        };
        started
            .await
            .expect("the committer takes the claim's group");

        // Decided meanwhile, on the claim in flight: its holder completes
        // it, another caller finds it in flight, a third claims another key.
        let handed_before = store.writer.probe.handed_over.load(Ordering::Relaxed);
        let completed_by_holder = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.complete(&key, holder, &completed(60_000)).await })
        };
        until_handed_over(&store, handed_before + 1).await;
        let duplicate = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.begin(&begin(key, 60_000, OnStale::Store)).await })
        };
        until_handed_over(&store, handed_before + 2).await;
        let unrelated = spawn_claim(&store, 2);
        until_handed_over(&store, handed_before + 3).await;
        drop(release);

        let claimed = claimed.await.expect("task");
        assert!(
            matches!(&claimed, Err(StoreError::Unavailable(e)) if e == "injected commit failure"),
            "{claimed:?}"
        );
        let completed_by_holder = completed_by_holder.await.expect("task");
        assert!(
            matches!(&completed_by_holder, Err(StoreError::Unavailable(e)) if e.contains("injected")),
            "{completed_by_holder:?}"
        );
        let duplicate = duplicate.await.expect("task");
        assert!(
            matches!(&duplicate, Err(StoreError::Unavailable(_))),
            "told about a claim that never was: {duplicate:?}"
        );
        // Decided before the writer learned of the failure: it fails too,
        // though it read nothing of it.
        let unrelated = unrelated.await.expect("task");
        assert!(
            matches!(&unrelated, Err(StoreError::Unavailable(_))),
            "{unrelated:?}"
        );
        assert_eq!(store.get(&key).await.expect("get"), None);
        assert_eq!(store.get(&other).await.expect("get"), None);

        // The writer forgot the failed writes: the key is free, and the
        // store goes on.
        let again = claim(&store, key).await;
        store
            .complete(&key, again, &completed(60_000))
            .await
            .expect("complete");
        claim(&store, other).await;
        drop(store);
        let reopened = EmbeddedStore::open(dir.path()).expect("reopen");
        assert_eq!(reopened.record_count().await.expect("count"), 2);
    }

    /// Groups decided while a batch commits are committed after it, in
    /// order, each seeing the writes of those before it; a key written by
    /// several of the groups one batch takes keeps the last group's value.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn groups_decided_during_a_commit_build_on_it_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).expect("open"));
        let key = RecordKey::from_bytes([4; 32]);
        let (release, started) = hold_next_commit(&store, None);
        let first = spawn_claim(&store, 5);
        started.await.expect("the committer takes the first group");

        // Three groups behind it, one batch: claim, complete, then remove
        // and claim again, each decided on the one before.
        let handed_before = store.writer.probe.handed_over.load(Ordering::Relaxed);
        let claim_of_key = begin(key, 60_000, OnStale::Store);
        let holder = claim_of_key.token;
        let claimed = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.begin(&claim_of_key).await })
        };
        until_handed_over(&store, handed_before + 1).await;
        let completion = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.complete(&key, holder, &completed(60_000)).await })
        };
        until_handed_over(&store, handed_before + 2).await;
        let replaced = {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                store.remove(&key, Removal::Any).await?;
                store.begin(&begin(key, 60_000, OnStale::Store)).await
            })
        };
        until_handed_over(&store, handed_before + 3).await;
        // Not answered before their commit.
        assert!(!claimed.is_finished() && !completion.is_finished());
        let commits = store.commit_count();
        drop(release);

        token(first.await.expect("task").expect("first claim"));
        token(claimed.await.expect("task").expect("claim"));
        completion.await.expect("task").expect("completion");
        let last = token(replaced.await.expect("task").expect("claimed again"));
        assert!(store.commit_count() <= commits + 3);
        match store.get(&key).await.expect("get") {
            Some(Record::Pending(pending)) => assert_eq!(pending.token, last),
            other => panic!("expected the last claim, got {other:?}"),
        }
        drop(store);
        let reopened = EmbeddedStore::open(dir.path()).expect("reopen");
        match reopened.get(&key).await.expect("get") {
            Some(Record::Pending(pending)) => assert_eq!(pending.token, last),
            other => panic!("expected the last claim after a restart, got {other:?}"),
        }
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
