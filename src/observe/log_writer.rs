//! Where log lines go: stdout, written in batches by a background thread.
//!
//! One line per request is part of the contract, and at tens of thousands of
//! requests a second the way that line reaches stdout matters. A write
//! syscall per line on the worker costs more than proxying the request; a
//! channel to a writer thread (tracing-appender's non-blocking writer) wakes
//! that thread for nearly every line, and on a two-core sidecar those
//! wake-ups and context switches cost as much again. So lines are appended
//! to a shared buffer (a short critical section: one copy of the line) and
//! a flusher thread writes the buffer out every [`FLUSH_EVERY`], or as soon
//! as it holds [`FLUSH_AT`] bytes: one wake-up per few hundred lines, the
//! way nginx's `access_log ... buffer= flush=` works.
//!
//! When stdout cannot keep up (a log collector applying backpressure, a
//! full pipe) and the buffer reaches [`DROP_AT`], lines are dropped and
//! counted ([`dropped_lines`], `idemproxy_log_lines_dropped_total`, and a
//! note on stderr once the flusher gets through), not waited for: the
//! lines come from the traffic workers, and a worker that waits for stdout
//! stops every request on its event loop, executions holding leases
//! included; past a lease, their keys would be settled as
//! `outcome-unknown` by a retry.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// The longest a line waits in the buffer.
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// A buffer this full is written out at once.
pub const FLUSH_AT: usize = 64 * 1024;
/// Past this, lines are dropped (and counted) instead of buffered.
pub const DROP_AT: usize = 8 * 1024 * 1024;

/// Lines dropped since the process started, every writer together.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Log lines dropped so far because the output did not keep up.
pub fn dropped_lines() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// A `MakeWriter` for tracing-subscriber that batches lines to an output.
#[derive(Clone)]
pub struct BatchedWriter {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for BatchedWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchedWriter").finish_non_exhaustive()
    }
}

struct Shared {
    state: Mutex<State>,
    /// Signals the flusher: a full buffer or shutdown.
    flush_wanted: Condvar,
    /// The buffer size past which lines are dropped ([`DROP_AT`]).
    drop_at: usize,
}

struct State {
    buffer: Vec<u8>,
    /// Lines dropped since the flusher last took the buffer.
    dropped: u64,
    /// Set once the flusher was signalled for the current buffer, so a full
    /// buffer costs one notify, not one per line past `FLUSH_AT`.
    signalled: bool,
    stopping: bool,
}

/// Flushes what is buffered and stops the flusher thread when dropped: keep
/// it alive for as long as the process logs.
pub struct FlushGuard {
    shared: Arc<Shared>,
    flusher: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FlushGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlushGuard").finish_non_exhaustive()
    }
}

impl BatchedWriter {
    /// Starts the flusher thread writing to `output`.
    pub fn new<W: Write + Send + 'static>(output: W) -> std::io::Result<(Self, FlushGuard)> {
        Self::dropping_at(output, DROP_AT)
    }

    fn dropping_at<W: Write + Send + 'static>(
        output: W,
        drop_at: usize,
    ) -> std::io::Result<(Self, FlushGuard)> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                buffer: Vec::with_capacity(FLUSH_AT * 2),
                dropped: 0,
                signalled: false,
                stopping: false,
            }),
            flush_wanted: Condvar::new(),
            drop_at,
        });
        let flusher = std::thread::Builder::new()
            .name("idemproxy-log".into())
            .spawn({
                let shared = shared.clone();
                move || flush_loop(&shared, output)
            })?;
        Ok((
            Self {
                shared: shared.clone(),
            },
            FlushGuard {
                shared,
                flusher: Some(flusher),
            },
        ))
    }
}

impl Shared {
    /// A panic while holding the lock leaves a buffer of whole lines, which
    /// is still fine to write: never let one failed log line stop logging.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn flush_loop<W: Write>(shared: &Shared, mut output: W) {
    // Swapped with the shared buffer each round, so both keep their
    // capacity and steady-state logging allocates nothing.
    let mut spare = Vec::with_capacity(FLUSH_AT * 2);
    loop {
        let (stopping, dropped) = {
            let mut state = shared.lock();
            if state.buffer.len() < FLUSH_AT && !state.stopping {
                state = shared
                    .flush_wanted
                    .wait_timeout(state, FLUSH_EVERY)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            std::mem::swap(&mut state.buffer, &mut spare);
            state.signalled = false;
            (state.stopping, std::mem::take(&mut state.dropped))
        };
        if dropped > 0 {
            // Not into the log stream itself: its readers may parse every
            // line (JSON).
            // Not `eprintln!`: a closed stderr must not panic this thread.
            let _ = writeln!(
                std::io::stderr(),
                "idemproxy: {dropped} log lines dropped: the log output did not keep up"
            );
        }
        if !spare.is_empty() {
            // Nowhere to report a failing stdout; keep serving.
            let _ = output.write_all(&spare).and_then(|()| output.flush());
            spare.clear();
        }
        if stopping {
            return;
        }
    }
}

/// The writer for one event; tracing-subscriber formats a whole line and
/// writes it in one call.
pub struct LineWriter<'a> {
    shared: &'a Shared,
}

impl std::fmt::Debug for LineWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LineWriter").finish_non_exhaustive()
    }
}

impl Write for LineWriter<'_> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut state = self.shared.lock();
        if state.buffer.len() >= self.shared.drop_at {
            state.dropped += 1;
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return Ok(line.len());
        }
        state.buffer.extend_from_slice(line);
        if state.buffer.len() >= FLUSH_AT && !state.signalled {
            state.signalled = true;
            self.shared.flush_wanted.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for BatchedWriter {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
        }
    }
}

impl Drop for FlushGuard {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        self.shared.flush_wanted.notify_one();
        if let Some(flusher) = self.flusher.take() {
            let _ = flusher.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Captured;
    use std::time::Instant;
    use tracing_subscriber::fmt::MakeWriter;

    fn log(writer: &BatchedWriter, line: &str) {
        writer
            .make_writer()
            .write_all(line.as_bytes())
            .expect("buffered");
    }

    #[test]
    fn a_quiet_line_is_written_within_the_flush_interval() {
        let out = Captured::default();
        let (writer, _guard) = BatchedWriter::new(out.clone()).expect("flusher");
        let start = Instant::now();
        log(&writer, "one line\n");
        while out.text().is_empty() {
            assert!(start.elapsed() < FLUSH_EVERY * 20, "never flushed");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(out.text(), "one line\n");
    }

    #[test]
    fn lines_from_many_threads_arrive_whole_in_order_per_thread_and_none_lost() {
        let out = Captured::default();
        let (writer, guard) = BatchedWriter::new(out.clone()).expect("flusher");
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let writer = writer.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000 {
                        log(
                            &writer,
                            &format!("thread={t} line={i} {}\n", "x".repeat(i % 50)),
                        );
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("logging thread");
        }
        drop(guard);
        let text = out.text();
        let mut next = [0usize; 4];
        for line in text.lines() {
            let mut fields = line.split(' ');
            let t: usize = fields
                .next()
                .and_then(|f| f.strip_prefix("thread="))
                .and_then(|v| v.parse().ok())
                .expect("thread field");
            let i: usize = fields
                .next()
                .and_then(|f| f.strip_prefix("line="))
                .and_then(|v| v.parse().ok())
                .expect("line field");
            assert_eq!(i, next[t], "thread {t}: lines in order, none lost");
            assert_eq!(fields.next().map(str::len), Some(i % 50), "{line}");
            next[t] += 1;
        }
        assert_eq!(next, [20_000; 4]);
    }

    /// An output that takes nothing until the test says so: stdout into a
    /// pipe nobody reads.
    #[derive(Clone)]
    struct Stalled {
        open: Arc<(Mutex<bool>, Condvar)>,
        written: Captured,
    }

    impl Write for Stalled {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let (open, opened) = &*self.open;
            let mut is_open = open.lock().unwrap_or_else(PoisonError::into_inner);
            while !*is_open {
                is_open = opened.wait(is_open).unwrap_or_else(PoisonError::into_inner);
            }
            self.written.write(bytes)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stalled_output_costs_lines_never_a_waiting_logger() {
        let out = Stalled {
            open: Arc::new((Mutex::new(false), Condvar::new())),
            written: Captured::default(),
        };
        let (writer, guard) = BatchedWriter::dropping_at(out.clone(), 1024).expect("flusher");
        let before = dropped_lines();
        let started = Instant::now();
        // Far more than the flusher's buffer and the limit hold.
        for i in 0..10_000 {
            log(&writer, &format!("line {i:05} {}\n", "x".repeat(50)));
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the logger waited for the output: {:?}",
            started.elapsed()
        );
        assert!(
            dropped_lines() - before > 9_000,
            "{}",
            dropped_lines() - before
        );
        {
            let (open, opened) = &*out.open;
            *open.lock().unwrap_or_else(PoisonError::into_inner) = true;
            opened.notify_all();
        }
        // Once the output takes lines again (and the flusher has taken
        // what filled the buffer, within a flush interval or two), new ones
        // get through.
        std::thread::sleep(FLUSH_EVERY * 4);
        log(&writer, "after the stall\n");
        drop(guard);
        let text = out.written.text();
        assert!(
            text.starts_with("line 00000"),
            "{}",
            &text[..40.min(text.len())]
        );
        assert!(text.ends_with("after the stall\n"));
    }

    #[test]
    fn dropping_the_guard_flushes_what_is_buffered() {
        let out = Captured::default();
        let (writer, guard) = BatchedWriter::new(out.clone()).expect("flusher");
        log(&writer, "last words\n");
        drop(guard);
        assert_eq!(out.text(), "last words\n");
    }
}
