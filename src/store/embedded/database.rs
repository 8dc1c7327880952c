//! The fjall database under the store, and its settings: each is sized
//! for a sidecar on a couple of cores, not for a database server, and says
//! what it was measured against.

use std::path::Path;
use std::sync::Arc;

use fjall::compaction::filter::Factory;
use fjall::config::PinningPolicy;
use fjall::{Database, Keyspace, KeyspaceCreateOptions};

use super::tables::db_error;
use super::RECORDS_KEYSPACE;
use crate::store::StoreError;

/// fjall's block cache. Its default (32 MiB) is sized for a database, not
/// a sidecar; the OS's page cache backs what does not fit. Under
/// `benches/load.sh`'s unique-key load the cache holds the blocks that
/// completions read back from just-flushed tables: 8 MiB of it filled and
/// cost ~5 MiB more peak RSS in a 20 s run than 2 MiB, with the same CPU
/// per request (docs/performance.md, "The embedded store on fjall").
const CACHE_BYTES: u64 = 2 * 1024 * 1024;

/// The memtable's size before it is flushed to a table. fjall's default
/// (64 MiB) alone would exceed the RSS a sidecar is allowed. fjall keeps
/// the active memtable and up to four sealed ones waiting for their flush,
/// each taking ~1.5x its nominal size in the heap (skip-list nodes, one
/// allocation per key and per value): at 8 MiB they were ~14 MiB of the
/// proxy's peak under load, at 1 MiB ~2. Smaller memtables mean more,
/// smaller flushes and compactions: with one worker thread (as then) a first
/// execution costs 194.5k instructions at 1 MiB against 194.3k at 8 MiB
/// (cachegrind), and the CPU per request under load did not move beyond
/// this machine's noise.
const MEMTABLE_BYTES: u64 = 1024 * 1024;

/// fjall's background threads (flushes and compactions). Two would be
/// fjall's default here; one is not safe (fjall 3.1.13, which asks for at
/// least one):
///
/// - **One deadlocks under sustained writes.** A memtable past its size
///   makes every write batch ask the worker queue (1,000 messages) to
///   rotate it; while the one worker compacts, those requests fill the
///   queue; the worker then rotates and blocks sending itself the flush
///   (`Keyspace::inner_rotate_memtable`), on the queue only it empties.
///   No flush or compaction ever runs again, and the memtable (RSS) and
///   the journal grow by every write: at ~15k first executions/s the
///   proxy went from 65 to 515 MiB in 60 s, 50-90 s into `wrk -c64`.
/// - **Two spin.** Worker 0 never compacts: it hands every compaction
///   request back to the queue, and while worker 1 compacts it takes the
///   same request again at once, a core busy for every compaction's
///   length (31-34 s of fjall CPU per 100 s of load, against 17-19 s).
/// - **Three**: a compaction request worker 0 hands back waits for the
///   idle third, so the spin lasts only while two compactions run at
///   once; worker 0 flushes while the others compact.
///
/// A store that can no longer flush still answers correctly (its journal
/// is synced before every answer); what it loses is memory, and a restart
/// replays the whole journal. The test below holds a compaction and
/// checks flushes go on (docs/performance.md, "fjall's worker deadlock").
const WORKER_THREADS: usize = 3;

/// Tables in level 0 (each a flushed memtable) before a compaction merges
/// them into level 1; fjall's default is 4. Record keys are random, so
/// every table of level 1 overlaps every table of level 0, and each such
/// compaction rewrites all of level 1: merging 12 memtables at a time
/// instead of 4 rewrites it a third as often. Lookups check every level-0
/// table's filter (pinned, below), a hash probe each; fjall slows writes
/// only from 20 level-0 tables on. Under sustained unique-key load (`wrk
/// -c64`, 24 s) the CPU per first execution stayed at 66-69 µs with 12,
/// where with 4 it climbed to 81 µs as level 1 grew
/// (docs/performance.md, "The embedded store under sustained load").
const L0_TABLES: u8 = 12;

/// The size a compaction cuts its output tables at (fjall's default: 64
/// MiB). A compaction holds the table it is writing in memory (its index,
/// its filter's key hashes) and, once done, loads its filter beside the
/// old tables' until they go, and with [`WORKER_THREADS`] two can run at
/// once. At 64 MiB a proxy under sustained load peaked 15-18 MiB above
/// its usual RSS for about a second at each compaction into level 1; with
/// three workers, 100 s of `wrk -c64` peaked at 73-77 MiB with 16 MiB
/// tables and 65 with 8, whose smaller compactions also took less CPU.
/// Level 1's target size is this times [`L0_TABLES`].
const TABLE_BYTES: u64 = 8 * 1024 * 1024;

/// Opens (creating if needed) the database at `path` and its records
/// keyspace, whose compactions filter with `filters`.
pub(super) fn open(
    path: &Path,
    filters: Arc<dyn Factory>,
) -> Result<(Database, Keyspace), StoreError> {
    let db = Database::builder(path)
        .worker_threads(WORKER_THREADS)
        .cache_size(CACHE_BYTES)
        // Every batch says how it is persisted (`Tables::commit`).
        .manual_journal_persist(true)
        .with_compaction_filter_factories(Arc::new(move |keyspace| {
            (keyspace == RECORDS_KEYSPACE).then(|| Arc::clone(&filters))
        }))
        .open()
        .map_err(|e| match e {
            fjall::Error::Locked => StoreError::Unavailable(format!(
                "{} is already open (by this process or another); \
                 an embedded store belongs to one process",
                path.display()
            )),
            other => StoreError::Unavailable(format!("cannot open {}: {other}", path.display())),
        })?;
    let records = db
        .keyspace(RECORDS_KEYSPACE, || {
            KeyspaceCreateOptions::default()
                .max_memtable_size(MEMTABLE_BYTES)
                // Every table's filter stays in memory, not only level
                // 0's (fjall's default): a first execution looks up a key
                // that is in no table, and only the filters say so
                // without reading the table. Through the 2 MiB block
                // cache, the filters of a growing level 1 were read from
                // the file and checksummed again at nearly every lookup,
                // and the CPU per first execution climbed from 66 to 107
                // µs within 24 s of sustained load. Pinned, they cost
                // about 10 bits (level 0: about 19) per record held.
                .filter_block_pinning_policy(PinningPolicy::all(true))
                .compaction_strategy(Arc::new(
                    fjall::compaction::Leveled::default()
                        .with_l0_threshold(L0_TABLES)
                        .with_table_target_size(TABLE_BYTES),
                ))
        })
        .map_err(db_error)?;
    Ok((db, records))
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    use fjall::compaction::filter::{
        CompactionFilter, CompactionFilterResult, Context, Factory, ItemAccessor, Verdict,
    };
    use sha2::{Digest, Sha256};

    use super::{open, MEMTABLE_BYTES};

    /// Compactions that stop at their first record until released (a
    /// compaction of a large level, made long on purpose), saying when
    /// one has stopped there.
    struct HeldCompactions {
        stopped: mpsc::Sender<()>,
        released: Arc<(Mutex<bool>, Condvar)>,
    }

    struct HeldCompaction {
        stopped: mpsc::Sender<()>,
        released: Arc<(Mutex<bool>, Condvar)>,
    }

    impl Factory for HeldCompactions {
        fn name(&self) -> &str {
            "held"
        }

        fn make_filter(&self, _: &Context) -> Box<dyn CompactionFilter> {
            Box::new(HeldCompaction {
                stopped: self.stopped.clone(),
                released: Arc::clone(&self.released),
            })
        }
    }

    impl CompactionFilter for HeldCompaction {
        // Here, not in `make_filter`: fjall makes the filter while it holds
        // the locks a flush needs, and lets them go before the merge.
        fn filter_item(&mut self, _: ItemAccessor<'_>, _: &Context) -> CompactionFilterResult {
            let _ = self.stopped.send(());
            let (released, changed) = &*self.released;
            let mut released = released.lock().expect("lock");
            while !*released {
                released = changed.wait(released).expect("lock");
            }
            Ok(Verdict::Keep)
        }
    }

    /// A long compaction does not stop flushes: with one fjall worker it
    /// did, and under sustained writes that worker deadlocked (see
    /// `WORKER_THREADS`). While a compaction is held, 6 MiB more are
    /// written in 768 batches, each of which asks for a rotation once the
    /// memtable is full (the requests that filled fjall's queue); the
    /// memtables must still be flushed, so memory stays bounded.
    #[test]
    fn flushes_go_on_while_a_compaction_runs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (stopped, compacting) = mpsc::channel();
        let released = Arc::new((Mutex::new(false), Condvar::new()));
        let (db, records) = open(
            dir.path(),
            Arc::new(HeldCompactions {
                stopped,
                released: Arc::clone(&released),
            }),
        )
        .expect("open");
        let mut written = 0u32;
        let mut write = |bytes: usize| {
            written += 1;
            // Random keys, as record keys are: every table overlaps every
            // other, so compactions merge instead of moving tables.
            let key = Sha256::digest(written.to_be_bytes()).to_vec();
            let mut batch = db.batch();
            batch.insert(&records, key, vec![7u8; bytes]);
            batch.commit().expect("commit");
        };
        // Waits (up to 10 s: flushes are slow in a debug build) until at
        // most one memtable's worth is unflushed; returns what is.
        let flushed = || {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let buffered = db.write_buffer_size();
                if buffered <= MEMTABLE_BYTES || Instant::now() > deadline {
                    return buffered;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        };

        // Fill level 0, a memtable at a time, until a compaction starts
        // (and stops).
        let deadline = Instant::now() + Duration::from_secs(60);
        while compacting.try_recv().is_err() {
            assert!(Instant::now() < deadline, "no compaction started");
            for _ in 0..17 {
                write(64 * 1024);
            }
            flushed();
        }
        // 6 MiB more while it is held, in batches of 8 KiB, each of which
        // asks for a rotation once the memtable is full; after each MiB,
        // the memtables must be flushed.
        let mut unflushed = 0;
        for _ in 0..6 {
            for _ in 0..128 {
                write(8 * 1024);
            }
            unflushed = flushed();
            if unflushed > MEMTABLE_BYTES {
                break;
            }
        }
        // Released before asserting, so that a failure does not leave
        // fjall's worker waiting when the database closes.
        *released.0.lock().expect("lock") = true;
        released.1.notify_all();

        assert!(
            unflushed <= MEMTABLE_BYTES,
            "{unflushed} bytes of memtables waited for a compaction to end"
        );
    }
}
