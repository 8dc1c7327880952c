//! Log lines as tracing-subscriber writes them, for less CPU: the human
//! format without colours, and JSON.
//!
//! Human lines are the ones tracing-subscriber's default format writes
//! (`time LEVEL target: message name=value ...`), written by parts that
//! replace the ones on the path of the line every request logs:
//! - [`PlainLines`] writes the line around the fields directly, where the
//!   default format `write!`s each part;
//! - [`PlainFields`] writes the fields. The default visitor passes every
//!   name and `=` through nu-ansi-term styles even with colours off,
//!   formats each string through `Debug`, and each duration through the
//!   shortest-digits float algorithm (here: from integers, same text);
//! - [`SecondCachedTime`] writes the timestamp. The default timer works out
//!   the calendar date for every event; this one once a second per thread.
//!
//! [`JsonLines`] does the same for the JSON format (`json()` with
//! `flatten_event(true)`): the same objects, written directly instead of
//! through a serde serializer over an adaptor that checks every write.
//!
//! The line is written on every request, so its cost is a visible part of
//! a replay's; `benches/micro.rs` (`log line`) measures both formats, and
//! docs/performance.md has the figures.

use std::cell::RefCell;
use std::fmt::{self, Write as _};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{Format, Full, Json, Writer};
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Fields as `name=value`, separated by spaces, the message first and bare:
/// what tracing-subscriber's `DefaultFields` writes without colours.
#[derive(Clone, Copy, Debug, Default)]
pub struct PlainFields;

impl<'writer> FormatFields<'writer> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = PlainVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct PlainVisitor<W> {
    writer: W,
    first: bool,
    /// The first write error; later fields are skipped.
    result: fmt::Result,
}

/// What [`PlainVisitor::begin`] made of a field.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Left out: a `log` crate's bookkeeping field, or an earlier write
    /// failed.
    Skipped,
    /// The message: written bare (and sanitized) after the separator.
    Message,
    /// Any other field: `name=` is written, the value follows.
    Named,
}

impl<W: fmt::Write> PlainVisitor<W> {
    /// Starts a field: the separator and `name=`, or only the separator for
    /// the message.
    fn begin(&mut self, field: &Field) -> Slot {
        if self.result.is_err() {
            return Slot::Skipped;
        }
        let name = field.name();
        // Fields `tracing-log` adds to events from the `log` crate, which
        // the default format leaves out too.
        if name.starts_with("log.") {
            return Slot::Skipped;
        }
        if !self.first {
            self.result = self.writer.write_char(' ');
        }
        self.first = false;
        if name == "message" {
            return Slot::Message;
        }
        let name = name.strip_prefix("r#").unwrap_or(name);
        self.result = self
            .result
            .and_then(|()| self.writer.write_str(name))
            .and_then(|()| self.writer.write_char('='));
        Slot::Named
    }

    /// A field whose value reads the same as message or named field.
    fn value(&mut self, field: &Field, write: impl FnOnce(&mut W) -> fmt::Result) {
        if self.begin(field) != Slot::Skipped {
            self.result = self.result.and_then(|()| write(&mut self.writer));
        }
    }
}

impl<W: fmt::Write> Visit for PlainVisitor<W> {
    fn record_str(&mut self, field: &Field, value: &str) {
        let slot = self.begin(field);
        self.result = self.result.and_then(|()| match slot {
            Slot::Skipped => Ok(()),
            Slot::Message => Sanitized(&mut self.writer).write_str(value),
            Slot::Named if debug_writes_as_is(value) => {
                // What `Debug` writes for a string that needs no escapes.
                self.writer.write_char('"')?;
                self.writer.write_str(value)?;
                self.writer.write_char('"')
            }
            Slot::Named => write!(self.writer, "{value:?}"),
        });
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.value(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.value(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.value(field, |w| write_f64(w, value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.value(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let slot = self.begin(field);
        self.result = self.result.and_then(|()| match slot {
            Slot::Skipped => Ok(()),
            Slot::Message => write!(Sanitized(&mut self.writer), "{value:?}"),
            Slot::Named => write!(self.writer, "{value:?}"),
        });
    }
}

/// `value` as `Debug` writes it (`0.005`, `2.0`, `1e-7`).
fn write_f64<W: fmt::Write>(w: &mut W, value: f64) -> fmt::Result {
    match write_thousandths(w, value) {
        Some(written) => written,
        None => write!(w, "{value:?}"),
    }
}

/// Writes `value` if it is a whole number of thousandths below 10^12, as
/// both `Debug` and serde_json (ryu) write it; `None` (nothing written)
/// for any other value.
///
/// The request line's durations are whole microseconds in milliseconds,
/// which are written from integers here instead of by the shortest-digits
/// float algorithm. Same text: a double that is exactly `m / 1000` for an
/// integer `m` below 10^15 has `m / 1000` with trailing zeros trimmed as its
/// shortest round-trip form (no other number with three decimals or fewer
/// lies within its rounding interval, which is narrower than 0.001), and
/// both write such magnitudes without an exponent, whole ones with `.0`.
fn write_thousandths<W: fmt::Write>(w: &mut W, value: f64) -> Option<fmt::Result> {
    let thousandths = (value * 1000.0).round();
    if !(value.is_sign_positive() && thousandths < 1e15 && thousandths / 1000.0 == value) {
        return None;
    }
    // A whole number below 10^15: exact as an integer.
    let thousandths = thousandths as u64;
    let fraction = thousandths % 1000;
    let padded = [
        b'.',
        b'0' + (fraction / 100) as u8,
        b'0' + (fraction / 10 % 10) as u8,
        b'0' + (fraction % 10) as u8,
    ];
    // `.0` for a whole number, else the digits up to the last non-zero.
    let used = match padded.iter().rposition(|&d| d != b'0') {
        Some(last) if fraction != 0 => last + 1,
        _ => 2,
    };
    let mut digits = itoa::Buffer::new();
    Some(
        w.write_str(digits.format(thousandths / 1000))
            // ASCII digits and a dot.
            .and_then(|()| w.write_str(std::str::from_utf8(&padded[..used]).unwrap_or_default())),
    )
}

/// Writes a message with the characters that could drive a terminal
/// (ESC, BEL, BS, FF, DEL and the C1 controls) escaped, as the default
/// format does for messages: error messages can carry a client's bytes.
struct Sanitized<'a, W>(&'a mut W);

impl<W: fmt::Write> fmt::Write for Sanitized<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let risky = |c: char| {
            matches!(
                c,
                '\x1b' | '\x07' | '\x08' | '\x0c' | '\x7f' | '\u{80}'..='\u{9f}'
            )
        };
        let mut rest = s;
        while let Some(at) = rest.find(risky) {
            let (plain, tail) = rest.split_at(at);
            self.0.write_str(plain)?;
            let mut chars = tail.chars();
            if let Some(c) = chars.next() {
                match c {
                    '\u{80}'..='\u{9f}' => write!(self.0, "\\u{{{:x}}}", u32::from(c))?,
                    c => write!(self.0, "\\x{:02x}", u32::from(c))?,
                }
            }
            rest = chars.as_str();
        }
        self.0.write_str(rest)
    }
}

/// RFC 3339 UTC with microseconds (`2026-11-30T21:43:28.123456Z`), as the
/// default timer writes it, with the part up to the second cached.
#[derive(Clone, Copy, Debug, Default)]
pub struct SecondCachedTime;

thread_local! {
    /// The second last formatted on this thread and its text up to the
    /// seconds. Per thread, so workers never share (or lock) it.
    static SECOND: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
}

impl FormatTime for SecondCachedTime {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let secs = since_epoch.as_secs();
        SECOND.with(|second| {
            // Never borrowed across anything that could log, but a
            // timestamp is not worth a panic: without the cache, format
            // afresh.
            let Ok(mut second) = second.try_borrow_mut() else {
                return w.write_str(&up_to_the_second(secs));
            };
            if second.0 != secs {
                *second = (secs, up_to_the_second(secs));
            }
            w.write_str(&second.1)
        })?;
        w.write_str(
            std::str::from_utf8(&micros_and_zone(since_epoch.subsec_micros())).unwrap_or("Z"),
        )
    }
}

/// `.000042Z`: a timestamp's microseconds, then its zone. Written digit by
/// digit: through `write!` and its padding, this was ~300 instructions of
/// every line.
fn micros_and_zone(micros: u32) -> [u8; 8] {
    let mut text = *b".000000Z";
    let mut rest = micros;
    for digit in text[1..7].iter_mut().rev() {
        // A digit: below 10.
        *digit = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    text
}

/// `2026-11-30T21:43:28`: `secs` after the epoch, in UTC.
fn up_to_the_second(secs: u64) -> String {
    let whole = UNIX_EPOCH + Duration::from_secs(secs);
    let mut text = humantime::format_rfc3339_seconds(whole).to_string();
    text.pop(); // the `Z`, written after the fraction
    text
}

/// A line format that writes the request's line itself and leaves the
/// events it does not cover to tracing-subscriber's format `F`: those
/// inside a span and those forwarded from the `log` crate carry more (the
/// span list, the record's own target); requests log outside any span.
pub struct DirectLines<F> {
    full: F,
    line: fn(&mut String, &Event<'_>) -> fmt::Result,
}

impl<F> std::fmt::Debug for DirectLines<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectLines").finish_non_exhaustive()
    }
}

/// Human lines, as tracing-subscriber's default format writes them without
/// colours: `time LEVEL target: fields`, written directly rather than
/// through that format's `write!` per part.
pub type PlainLines = DirectLines<Format<Full, SecondCachedTime>>;

/// One JSON object per line, as tracing-subscriber's `json()` with
/// `flatten_event(true)` writes it: `timestamp`, `level`, the event's
/// fields (the message as `message`), `target`.
pub type JsonLines = DirectLines<Format<Json>>;

impl PlainLines {
    pub fn new() -> Self {
        Self {
            full: tracing_subscriber::fmt::format()
                .with_timer(SecondCachedTime)
                .with_ansi(false),
            line: plain_line,
        }
    }
}

impl Default for PlainLines {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonLines {
    pub fn new() -> Self {
        Self {
            full: tracing_subscriber::fmt::format().json().flatten_event(true),
            line: json_line,
        }
    }
}

impl Default for JsonLines {
    fn default() -> Self {
        Self::new()
    }
}

impl<S, N, F> FormatEvent<S, N> for DirectLines<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        if needs_full_format(ctx, event) {
            return self.full.format_event(ctx, writer, event);
        }
        with_line_buffer(&mut writer, |line| (self.line)(line, event))
    }
}

/// The line [`PlainLines`] writes, fields as [`PlainFields`] writes them.
fn plain_line(line: &mut String, event: &Event<'_>) -> fmt::Result {
    let meta = event.metadata();
    if SecondCachedTime
        .format_time(&mut Writer::new(line))
        .is_err()
    {
        line.write_str("<unknown time>")?;
    }
    // The default format's level column: five wide, right-aligned.
    line.write_str(match *meta.level() {
        tracing::Level::TRACE => " TRACE ",
        tracing::Level::DEBUG => " DEBUG ",
        tracing::Level::INFO => "  INFO ",
        tracing::Level::WARN => "  WARN ",
        tracing::Level::ERROR => " ERROR ",
    })?;
    line.write_str(meta.target())?;
    line.write_str(": ")?;
    let mut fields = PlainVisitor {
        writer: &mut *line,
        first: true,
        result: Ok(()),
    };
    event.record(&mut fields);
    fields.result?;
    line.write_char('\n')
}

thread_local! {
    /// Where [`PlainLines`] and [`JsonLines`] put a line together before
    /// handing it to tracing-subscriber's writer in one piece: appending to
    /// a `String` is inlined, where each write to that writer is a call
    /// through `dyn fmt::Write` (dozens per line). One per thread, reused.
    static LINE: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Runs `format` on the thread's line buffer, then writes the line to
/// `writer` in one piece. A fresh `String` if the buffer is in use (only
/// if a `Debug` impl logged while being formatted, and tracing dispatched
/// that).
fn with_line_buffer(
    writer: &mut Writer<'_>,
    format: impl Fn(&mut String) -> fmt::Result,
) -> fmt::Result {
    LINE.with(|buffer| {
        let mut fresh = String::new();
        let mut shared = buffer.try_borrow_mut();
        let line = match &mut shared {
            Ok(line) => {
                line.clear();
                &mut **line
            }
            Err(_) => &mut fresh,
        };
        format(line)?;
        writer.write_str(line)
    })
}

/// Whether `event` carries more than a request's line does: a span list
/// (it belongs to a span) or a `log` record's own target. Such events are
/// left to tracing-subscriber's formatter.
fn needs_full_format<S, N>(ctx: &FmtContext<'_, S, N>, event: &Event<'_>) -> bool
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    event.parent().is_some()
        || (event.is_contextual() && ctx.lookup_current().is_some())
        || event.metadata().fields().field("log.target").is_some()
}

/// The object [`JsonLines`] writes, and its newline.
fn json_line(line: &mut String, event: &Event<'_>) -> fmt::Result {
    let meta = event.metadata();
    line.write_str("{\"timestamp\":\"")?;
    SecondCachedTime.format_time(&mut Writer::new(line))?;
    line.write_str("\",\"level\":\"")?;
    line.write_str(meta.level().as_str())?;
    line.write_char('"')?;
    let mut fields = JsonVisitor {
        writer: &mut *line,
        result: Ok(()),
    };
    event.record(&mut fields);
    fields.result?;
    line.write_str(",\"target\":")?;
    json_string(line, meta.target())?;
    line.write_str("}\n")
}

/// Appends `,"name":value` per field.
struct JsonVisitor<'a, W> {
    writer: &'a mut W,
    /// The first write error; later fields are skipped.
    result: fmt::Result,
}

impl<W: fmt::Write> JsonVisitor<'_, W> {
    fn field(&mut self, field: &Field, value: impl FnOnce(&mut W) -> fmt::Result) {
        if self.result.is_ok() {
            self.result = self
                .writer
                .write_char(',')
                .and_then(|()| json_string(self.writer, field.name()))
                .and_then(|()| self.writer.write_char(':'))
                .and_then(|()| value(self.writer));
        }
    }
}

impl<W: fmt::Write> Visit for JsonVisitor<'_, W> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.field(field, |w| json_string(w, value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.field(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        // serde_json's own rendering (shortest round trip; `null` when not
        // finite), as the default formatter writes it; durations from
        // integers, with the same text.
        self.field(field, |w| {
            write_thousandths(w, value).unwrap_or_else(|| serde_json(w, &value))
        });
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, |w| {
            DEBUG_TEXT.with(|text| match text.try_borrow_mut() {
                Ok(mut text) => {
                    text.clear();
                    write!(text, "{value:?}")?;
                    json_string(w, &text)
                }
                // Only if a `Debug` impl logged while being formatted and
                // tracing dispatched that (it does not today): a buffer of
                // its own rather than a panic.
                Err(_) => json_string(w, &format!("{value:?}")),
            })
        });
    }
}

thread_local! {
    /// Where a `Debug` field is formatted before it is escaped: one buffer
    /// per thread, reused, instead of a `String` per field.
    static DEBUG_TEXT: RefCell<String> = const { RefCell::new(String::new()) };
}

/// `s` as a JSON string: directly when nothing in it needs escaping (the
/// usual case: ids, hashes, routes), else escaped by serde_json.
fn json_string<W: fmt::Write>(w: &mut W, s: &str) -> fmt::Result {
    if json_writes_as_is(s) {
        w.write_char('"')?;
        w.write_str(s)?;
        w.write_char('"')
    } else {
        serde_json(w, s)
    }
}

/// Whether `Debug` writes `s` as it is between quotes: printable ASCII
/// but `"` and `\`. Every byte is tested, without stopping at the first
/// that fails: a fold without branches, which the compiler vectorizes.
/// The strings of a request's line (its key hash, its request id) pass,
/// and testing their ~100 bytes one at a time was ~900 instructions a line.
fn debug_writes_as_is(s: &str) -> bool {
    s.bytes().fold(true, |as_is, b| {
        as_is & (b.wrapping_sub(b' ') <= b'~' - b' ') & (b != b'"') & (b != b'\\')
    })
}

/// Whether a JSON string of `s` is `s` between quotes: no control
/// character, `"` or `\` (tested as [`debug_writes_as_is`] does).
fn json_writes_as_is(s: &str) -> bool {
    s.bytes().fold(true, |as_is, b| {
        as_is & (b >= 0x20) & (b != b'"') & (b != b'\\')
    })
}

/// Serializes `value` with serde_json into a `fmt::Write`.
fn serde_json<W: fmt::Write, T: serde::Serialize + ?Sized>(w: &mut W, value: &T) -> fmt::Result {
    serde_json::to_writer(FmtAdaptor(w), value).map_err(|_| fmt::Error)
}

/// serde_json writes to `io::Write`; every piece it writes for a string or
/// a number is whole UTF-8 (it splits text only at ASCII escapes).
struct FmtAdaptor<'a, W>(&'a mut W);

impl<W: fmt::Write> std::io::Write for FmtAdaptor<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = std::str::from_utf8(buf).map_err(std::io::Error::other)?;
        self.0.write_str(text).map_err(std::io::Error::other)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Captured;

    #[test]
    fn microseconds_are_written_as_six_digits_then_the_zone() {
        for micros in [0, 7, 42, 999, 123_456, 999_999] {
            let written = micros_and_zone(micros);
            assert_eq!(
                std::str::from_utf8(&written),
                Ok(format!(".{micros:06}Z").as_str())
            );
        }
    }

    /// The fast tests agree with what they stand for, at every ASCII byte
    /// and at positions across strings longer than a vector.
    #[test]
    fn a_string_is_written_as_is_exactly_when_its_escaped_form_is_itself() {
        let mut texts: Vec<String> = (0u8..=0x7f).map(|b| char::from(b).to_string()).collect();
        texts.extend(["é", "\u{2028}", "\u{feff}", "", "plain 01-ab_~"].map(String::from));
        for odd in ['\u{1f}', '\u{7f}', '"', '\\', 'é', '\n'] {
            for at in [0, 15, 16, 31, 32, 63, 99] {
                let mut text = "a".repeat(100);
                text.replace_range(at..=at, &odd.to_string());
                texts.push(text);
            }
        }
        for text in &texts {
            let quoted = format!("\"{text}\"");
            // Debug writes other printable characters as they are too:
            // those take the slow path, to the same text.
            let debug_as_is = format!("{text:?}") == quoted;
            assert!(
                debug_writes_as_is(text) == debug_as_is
                    || !text.is_ascii() && !debug_writes_as_is(text),
                "Debug of {text:?}"
            );
            assert_eq!(
                json_writes_as_is(text),
                serde_json::to_string(text).expect("a string serializes") == quoted,
                "JSON of {text:?}"
            );
        }
    }

    fn events() {
        let route: std::sync::Arc<str> = "payments".into();
        tracing::info!(
            target: "idemproxy::request",
            route = %route,
            method = %http::Method::POST,
            outcome = "replayed",
            status = 201u16,
            key_hash = "ab12",
            request_id = "with \"quotes\" and \\ and é",
            store_ms = 0.012_5,
            upstream_ms = Option::<f64>::None,
            total_ms = 1.0,
            negative = -3i64,
            flag = true,
        );
        tracing::warn!(error = %"boom", r#type = "x", "something {} happened", "bad");
        tracing::error!("only a message\twith a tab, \x1b[31mred\x07 \u{85}\x7f\x08\x0c");
        tracing::error!(message = "as a field \x1b[0m", status = 1u8);
        tracing::warn!(text = "not a message \x1b[0m", "{}", "\x1b");
        tracing::info!(empty = "", control = "a\nb", "");
    }

    fn lines(plain: bool) -> String {
        let out = Captured::default();
        let builder = tracing_subscriber::fmt()
            .with_writer(out.make_writer())
            .with_ansi(false)
            .with_timer(SecondCachedTime);
        let run = || {
            events();
            let span = tracing::info_span!("request", id = 7u8);
            span.in_scope(|| tracing::info!(inside = true, "in a span"));
            tracing::debug!(parent: &span, "explicit parent");
            tracing::trace!(level = "trace");
        };
        if plain {
            let subscriber = builder
                .with_max_level(tracing::Level::TRACE)
                .fmt_fields(PlainFields)
                .event_format(PlainLines::new())
                .finish();
            tracing::subscriber::with_default(subscriber, run);
        } else {
            let subscriber = builder.with_max_level(tracing::Level::TRACE).finish();
            tracing::subscriber::with_default(subscriber, run);
        }
        // Timestamps differ between runs; everything else must not.
        out.text()
            .lines()
            .map(|line| {
                assert_eq!(line.as_bytes().get(26), Some(&b'Z'), "{line}");
                format!("-{}\n", &line[27..])
            })
            .collect()
    }

    #[test]
    fn fields_read_as_the_default_format_writes_them() {
        let default = lines(false);
        assert_eq!(lines(true), default);
        assert!(
            default.contains(r#"request_id="with \"quotes\" and \\ and é""#),
            "{default}"
        );
        assert!(
            default.contains("store_ms=0.0125 total_ms=1.0 negative=-3 flag=true"),
            "{default}"
        );
        assert!(
            default.contains(r"\x1b[31mred\x07 \u{85}\x7f\x08\x0c"),
            "{default}"
        );
        assert!(
            default.contains("  INFO idemproxy::request: route=payments method=POST"),
            "{default}"
        );
        assert!(default.contains(" DEBUG request{id=7}: "), "{default}");
        assert_eq!(default.lines().count(), 9, "{default}");
    }

    fn json_lines(ours: bool) -> String {
        let out = Captured::default();
        let builder = tracing_subscriber::fmt()
            .with_writer(out.make_writer())
            .json();
        let run = || {
            events();
            tracing::info!(
                ratio = f64::NAN,
                big = 1e21,
                tiny = 1e-7,
                max = u64::MAX,
                "{}",
                "π"
            );
            let span = tracing::info_span!("request", id = 7u8);
            span.in_scope(|| tracing::info!(inside = true, "in a span"));
            tracing::info!(parent: &span, "explicit parent");
        };
        if ours {
            let subscriber = builder
                .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                .event_format(JsonLines::new())
                .finish();
            tracing::subscriber::with_default(subscriber, run);
        } else {
            tracing::subscriber::with_default(builder.flatten_event(true).finish(), run);
        }
        // Timestamps differ between runs; everything else must not.
        out.text()
            .lines()
            .map(|line| {
                let value: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
                assert!(
                    value["timestamp"].as_str().is_some_and(|t| t.len() == 27),
                    "{line}"
                );
                let at = line.find("\"level\"").expect("a level");
                format!("{{\"timestamp\":\"-\",{}\n", &line[at..])
            })
            .collect()
    }

    #[test]
    fn json_lines_read_as_the_default_json_format_writes_them() {
        let default = json_lines(false);
        assert_eq!(json_lines(true), default);
        assert!(
            default.contains(r#""outcome":"replayed","status":201,"#),
            "{default}"
        );
        assert!(
            default.contains(r#""ratio":null,"big":1e+21,"tiny":1e-7"#),
            "{default}"
        );
        assert!(default.contains(r#""spans":[{"#), "{default}");
        assert_eq!(default.lines().count(), 9, "{default}");
    }

    /// Stands in for tracing-subscriber's format, to see which events
    /// `DirectLines` hands to it.
    struct Delegated;

    impl<S, N> FormatEvent<S, N> for Delegated
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
        N: for<'a> FormatFields<'a> + 'static,
    {
        fn format_event(
            &self,
            _: &FmtContext<'_, S, N>,
            mut writer: Writer<'_>,
            _: &Event<'_>,
        ) -> fmt::Result {
            writer.write_str("delegated\n")
        }
    }

    #[test]
    fn only_events_with_more_than_a_request_line_are_delegated() {
        for line in [plain_line, json_line] {
            let out = Captured::default();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(out.make_writer())
                .fmt_fields(PlainFields)
                .event_format(DirectLines {
                    full: Delegated,
                    line,
                })
                .finish();
            tracing::subscriber::with_default(subscriber, || {
                tracing::info!(target: "idemproxy::request", status = 201u16);
                let span = tracing::info_span!("request");
                span.in_scope(|| tracing::info!("inside"));
                tracing::info!(parent: &span, "explicit parent");
                tracing::info!(log.target = "some_crate", "from the log crate");
            });
            let text = out.text();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 4, "{text}");
            assert!(lines[0].contains("201"), "{text}");
            assert_eq!(lines[1..], ["delegated"; 3], "{text}");
        }
    }

    #[test]
    fn floats_read_as_debug_and_serde_json_write_them() {
        let ours = |value: f64| {
            let mut text = String::new();
            write_f64(&mut Writer::new(&mut text), value).expect("formats");
            text
        };
        let mut checked = 0;
        let mut check = |value: f64| {
            assert_eq!(ours(value), format!("{value:?}"), "{value:e}");
            // What JSON lines write from integers is serde_json's text too.
            let mut json = String::new();
            if let Some(written) = write_thousandths(&mut json, value) {
                written.expect("formats");
                assert_eq!(json, serde_json::to_string(&value).expect("a number"));
            }
            checked += 1;
        };
        // Every duration up to 100 s, and then sparser up to the limit.
        for micros in 0..100_000_000u64 {
            if micros < 2_000_000 || micros % 9_973 == 0 {
                check(micros as f64 / 1000.0);
            }
        }
        let mut m = 1u64;
        while m < 2_000_000_000_000_000 {
            for near in [m - 1, m, m + 1, m * 7 / 3] {
                check(near as f64 / 1000.0);
            }
            m *= 3;
        }
        // Not thousandths, negative, or not finite: `Debug` itself.
        for value in [
            0.000_5,
            0.012_5,
            1e-7,
            1e21,
            1e15 + 0.5,
            -0.0,
            -1.5,
            f64::NAN,
            f64::INFINITY,
            f64::MAX,
            f64::MIN_POSITIVE,
            0.1 + 0.2,
        ] {
            check(value);
        }
        assert!(checked > 2_000_000);
    }

    #[test]
    fn time_reads_as_the_default_timer_writes_it() {
        use tracing_subscriber::fmt::time::SystemTime as DefaultTime;
        let format = |timer: &dyn FormatTime| {
            let mut text = String::new();
            timer
                .format_time(&mut Writer::new(&mut text))
                .expect("formats");
            text
        };
        // Twice, so the second call comes from the cache; the two timers
        // agree up to the second unless a second boundary falls between
        // them, which a few attempts get past.
        for _ in 0..3 {
            let ours = format(&SecondCachedTime);
            let cached = format(&SecondCachedTime);
            let theirs = format(&DefaultTime);
            assert_eq!(ours.len(), theirs.len(), "{ours} {theirs}");
            assert_eq!(cached.len(), theirs.len(), "{cached} {theirs}");
            assert!(ours.ends_with('Z') && ours.as_bytes()[19] == b'.', "{ours}");
            if ours[..19] == theirs[..19] && cached[..19] == theirs[..19] {
                return;
            }
        }
        panic!("the timers never agreed on the second");
    }
}
