//! Progress of an operator's command that walks many records (`keys
//! list` over a large store, `store train-dictionary`): on a terminal, a
//! spinner with the count and the rate (indicatif), redrawn in place; when
//! stderr is not a terminal (a script, a CI log, a test), plain lines, at
//! most one a second and one at the end, which a log keeps readable.
//! Always on stderr, so stdout stays the command's answer (`--json`).

use std::fmt::Display;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a plain line is written while the walk goes on.
const PLAIN_EVERY: Duration = Duration::from_secs(1);

/// One walk's progress: how many records it examined, and a note on what
/// it found among them.
#[derive(Debug)]
pub(crate) struct Progress {
    /// `None` when stderr is not a terminal: plain lines instead.
    bar: Option<ProgressBar>,
    /// What is walking (`keys list`), the first word of every line.
    label: &'static str,
    examined: u64,
    note: String,
    started: Instant,
    last_line: Instant,
}

impl Progress {
    /// The progress of `label`'s walk, drawn as stderr allows.
    pub(crate) fn new(label: &'static str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            let template = format!(
                "{{spinner}} {label}: {{pos}} records examined, {{msg}} ({{per_sec}}, {{elapsed}})"
            );
            if let Ok(style) = ProgressStyle::with_template(&template) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        let now = Instant::now();
        Self {
            bar,
            label,
            examined: 0,
            note: String::new(),
            started: now,
            last_line: now,
        }
    }

    /// `examined` more records were walked; `note` says what the walk has
    /// found so far (`17 keys found`).
    pub(crate) fn advance(&mut self, examined: u64, note: impl Display) {
        self.examined += examined;
        self.note = note.to_string();
        match &self.bar {
            Some(bar) => {
                bar.set_position(self.examined);
                bar.set_message(self.note.clone());
            }
            None if self.last_line.elapsed() >= PLAIN_EVERY => {
                self.last_line = Instant::now();
                eprintln!("{}", self.line());
            }
            None => {}
        }
    }

    /// The walk is over: the bar is cleared, and one line says what it did.
    pub(crate) fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        eprintln!("{}", self.line());
    }

    fn line(&self) -> String {
        let seconds = self.started.elapsed().as_secs_f64();
        let rate = self.examined as f64 / seconds.max(0.001);
        format!(
            "{}: {} records examined, {} ({rate:.0}/s, {seconds:.1} s)",
            self.label, self.examined, self.note
        )
    }
}
