//! An incremental `text/event-stream` parser (the WHATWG SSE format) that
//! keeps each event's own bytes: the relay passes events on as they came
//! and reads only their `data`, so it must know where each one ends.
//!
//! Lines end with LF or CRLF (a lone CR, which the format also allows and
//! no MCP server sends, is not taken as a line end); an event ends at an
//! empty line. The bytes of an event not yet ended wait in the parser.

use bytes::{Bytes, BytesMut};

/// One event: its bytes as received (through its empty line), its `data`
/// lines joined with LF, and its `id` (kept when an event is rewritten, as
/// a client resumes a stream by it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub raw: Bytes,
    pub data: String,
    pub id: Option<String>,
}

impl Event {
    /// A `message` event carrying `data` (one line of JSON) under `id`.
    pub fn message(data: &str, id: Option<&str>) -> Bytes {
        match id {
            Some(id) => Bytes::from(format!("event: message\nid: {id}\ndata: {data}\n\n")),
            None => Bytes::from(format!("event: message\ndata: {data}\n\n")),
        }
    }
}

/// Splits a stream of chunks into events, holding no event longer than
/// its limit: past it, it is [overflowed](EventParser::overflowed) and
/// gives no more events; the caller takes what it holds
/// ([`EventParser::take_rest`]) and passes the rest of the stream on
/// unread.
#[derive(Debug)]
pub struct EventParser {
    /// The most bytes one event may take.
    limit: usize,
    overflowed: bool,
    /// Bytes of the event being read.
    pending: BytesMut,
    /// How far `pending` was scanned for line ends.
    scanned: usize,
    /// Where the current line starts in `pending`.
    line_start: usize,
    /// The current event's data lines so far.
    data: Option<String>,
    /// The current event's `id` field.
    id: Option<String>,
}

impl Default for EventParser {
    fn default() -> Self {
        Self::with_limit(usize::MAX)
    }
}

impl EventParser {
    /// A parser whose events may take up to `limit` bytes each.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            limit,
            overflowed: false,
            pending: BytesMut::new(),
            scanned: 0,
            line_start: 0,
            data: None,
            id: None,
        }
    }

    /// Whether an event was longer than the limit: from it on, the bytes
    /// fed are held unread, for [`EventParser::take_rest`].
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Takes `chunk` and returns the events it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.pending.extend_from_slice(chunk);
        let mut events = Vec::new();
        if self.overflowed {
            return events;
        }
        while let Some(offset) = self.pending[self.scanned..]
            .iter()
            .position(|&b| b == b'\n')
        {
            let line_end = self.scanned + offset;
            self.scanned = line_end + 1;
            let mut line = &self.pending[self.line_start..line_end];
            if let Some(stripped) = line.strip_suffix(b"\r") {
                line = stripped;
            }
            if line.is_empty() {
                if self.scanned > self.limit {
                    self.overflowed = true;
                    return events;
                }
                let raw = self.pending.split_to(self.scanned).freeze();
                self.scanned = 0;
                self.line_start = 0;
                // An empty line ends the event; one with no field before it
                // (a keep-alive) is an event with no data.
                let data = self.data.take().unwrap_or_default();
                let id = self.id.take();
                events.push(Event { raw, data, id });
                continue;
            }
            if let Some(value) = field(line, b"id") {
                self.id = Some(String::from_utf8_lossy(value).into_owned());
            } else if let Some(value) = field(line, b"data") {
                let value = String::from_utf8_lossy(value);
                match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(&value);
                    }
                    None => self.data = Some(value.into_owned()),
                }
            }
            self.line_start = self.scanned;
        }
        if self.pending.len() > self.limit {
            self.overflowed = true;
        }
        events
    }

    /// The bytes of an event the stream ended without finishing (or, once
    /// overflowed, every byte fed from the event that overflowed on).
    pub fn rest(&self) -> &[u8] {
        &self.pending
    }

    /// [`EventParser::rest`], taken out of the parser.
    pub fn take_rest(&mut self) -> Bytes {
        self.scanned = 0;
        self.line_start = 0;
        self.data = None;
        self.id = None;
        self.pending.split().freeze()
    }
}

/// The value of `line` if it is the field `name` (`name:value`, one space
/// after the colon dropped; a bare `name` has an empty value).
fn field<'a>(line: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let rest = line.strip_prefix(name)?;
    if rest.is_empty() {
        return Some(rest);
    }
    let value = rest.strip_prefix(b":")?;
    Some(value.strip_prefix(b" ").unwrap_or(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(chunks: &[&[u8]]) -> Vec<Event> {
        let mut parser = EventParser::default();
        chunks.iter().flat_map(|c| parser.feed(c)).collect()
    }

    #[test]
    fn events_keep_their_bytes_and_join_their_data() {
        let stream: &[u8] =
            b"event: message\nid: 1\ndata: {\"a\":\ndata: 1}\n\n: comment\ndata:x\r\n\r\n";
        let events = all(&[stream]);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].data, "{\"a\":\n1}");
        assert_eq!(
            &events[0].raw[..],
            b"event: message\nid: 1\ndata: {\"a\":\ndata: 1}\n\n"
        );
        assert_eq!(events[0].id.as_deref(), Some("1"));
        assert_eq!(events[1].data, "x");
        assert_eq!(events[1].id, None);
        assert_eq!(&events[1].raw[..], b": comment\ndata:x\r\n\r\n");
    }

    #[test]
    fn any_split_of_the_stream_gives_the_same_events() {
        let stream: &[u8] = b"event: message\r\ndata: {\"id\":1}\r\n\r\ndata: two\n\ndata\n\n";
        let whole = all(&[stream]);
        assert_eq!(whole.len(), 3);
        assert_eq!(whole[2].data, "");
        for split in 0..stream.len() {
            let (a, b) = stream.split_at(split);
            assert_eq!(all(&[a, b]), whole, "split at {split}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(all(&bytes), whole);
    }

    #[test]
    fn an_event_over_the_limit_stops_the_parser_with_every_byte_kept() {
        let stream: &[u8] = b"data: small\n\ndata: 0123456789abcdef\n\ndata: after\n\n";
        for split in 0..stream.len() {
            let (a, b) = stream.split_at(split);
            let mut parser = EventParser::with_limit(16);
            let mut events = parser.feed(a);
            events.extend(parser.feed(b));
            assert!(parser.overflowed(), "split at {split}");
            assert_eq!(events.len(), 1, "split at {split}");
            assert_eq!(events[0].data, "small");
            let rest = parser.take_rest();
            assert_eq!(
                &rest[..],
                &stream[events[0].raw.len()..],
                "split at {split}"
            );
            assert!(parser.rest().is_empty());
        }
        let mut unbounded = EventParser::default();
        assert_eq!(unbounded.feed(stream).len(), 3);
        assert!(!unbounded.overflowed());
    }

    #[test]
    fn an_unfinished_event_waits() {
        let mut parser = EventParser::default();
        assert!(parser.feed(b"data: {\"id\":1").is_empty());
        assert_eq!(parser.rest(), b"data: {\"id\":1");
        let events = parser.feed(b"}\n\n");
        assert_eq!(events[0].data, "{\"id\":1}");
        assert!(parser.rest().is_empty());
    }
}
