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
//! Nothing is dropped: when stdout cannot keep up and the buffer reaches
//! [`BLOCK_AT`], the logging thread waits for the flusher, as the previous
//! writer did with `lossy(false)`.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// The longest a line waits in the buffer.
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// A buffer this full is written out at once.
pub const FLUSH_AT: usize = 64 * 1024;
/// Past this, logging threads wait for the flusher instead of buffering more.
pub const BLOCK_AT: usize = 8 * 1024 * 1024;

/// A `MakeWriter` for tracing-subscriber that batches lines to an output.
#[derive(Clone)]
pub struct BatchedWriter {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Signals the flusher: a full buffer or shutdown.
    flush_wanted: Condvar,
    /// Signals logging threads waiting at `BLOCK_AT`: the buffer was taken.
    drained: Condvar,
}

struct State {
    buffer: Vec<u8>,
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

impl BatchedWriter {
    /// Starts the flusher thread writing to `output`.
    pub fn new<W: Write + Send + 'static>(output: W) -> std::io::Result<(Self, FlushGuard)> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                buffer: Vec::with_capacity(FLUSH_AT * 2),
                signalled: false,
                stopping: false,
            }),
            flush_wanted: Condvar::new(),
            drained: Condvar::new(),
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
        let stopping = {
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
            state.stopping
        };
        shared.drained.notify_all();
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

impl Write for LineWriter<'_> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut state = self.shared.lock();
        while state.buffer.len() >= BLOCK_AT && !state.stopping {
            state = self
                .shared
                .drained
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
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
        self.shared.drained.notify_all();
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

    #[test]
    fn dropping_the_guard_flushes_what_is_buffered() {
        let out = Captured::default();
        let (writer, guard) = BatchedWriter::new(out.clone()).expect("flusher");
        log(&writer, "last words\n");
        drop(guard);
        assert_eq!(out.text(), "last words\n");
    }
}
