//! Helpers for this crate's unit tests.

use std::sync::{Arc, Mutex};

/// An output that keeps what is written to it, for tests to read while a
/// writer (or a log subscriber) still holds a clone.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("capture").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// A `MakeWriter` for a log subscriber that writes here.
    pub(crate) fn make_writer(&self) -> impl Fn() -> Captured + Send + Sync + 'static {
        let out = self.clone();
        move || out.clone()
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8(self.0.lock().expect("capture").clone()).expect("UTF-8")
    }
}
