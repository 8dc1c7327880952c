//! RFC 8785 (JSON Canonicalization Scheme): a body parsed into a
//! [`Document`] and written in canonical form.
//!
//! Written here rather than taken from `serde_json_canonicalizer` because
//! fingerprinting sits on every covered request: that crate re-parses every
//! object key and buffers every value separately, about fifty times the cost
//! of hashing the raw body. Even a `serde_json::Value` costs an allocation
//! per key, string and container, a recursive drop, and a map per object.
//! So serde_json only parses here (and so still does all the validation:
//! UTF-8, escapes, lone surrogates, control characters, nesting depth,
//! trailing data), into a flat document that borrows every string without
//! escapes from the body. Each object's members are sorted once, while
//! parsing, which is also where duplicate names show up, as neighbours. The
//! writer streams into any [`Sink`], so a fingerprint hashes the canonical
//! form without buffering it, and writes the usual short numbers without
//! ryu.
//!
//! The crate stays as the test oracle: a property test checks that both
//! produce the same bytes for arbitrary values, besides the RFC's own
//! vectors in `fingerprint.rs`.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// A parsed I-JSON document, borrowing from the body it was parsed from.
///
/// Every value sits in one `Vec` in document order: an array or object is a
/// header followed by its contents, and the header records where they end.
/// So containers cost no allocation of their own (only strings with escapes
/// do), and dropping the document is a loop, not a recursion. An object's
/// members stay in document order; the order they are written in is the
/// sorted list of their positions, kept for all objects in a second `Vec`.
#[derive(Debug)]
pub struct Document<'a> {
    tape: Vec<Entry<'a>>,
    /// Positions of object member names, each object's run sorted.
    order: Vec<usize>,
    /// Whether any [`Entry::Inexact`] was parsed.
    inexact: bool,
}

/// A value in a [`Document`]; the root is [`Document::root`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeId(usize);

/// What a JSON pointer can step into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Object,
    Array,
    Scalar,
}

#[derive(Debug)]
enum Entry<'a> {
    Null,
    Bool(bool),
    /// Every JSON number is an IEEE 754 double in RFC 8785 (§3.2.2.3).
    Number(f64),
    /// An integer literal a double cannot hold exactly (see
    /// [`EXACT_INTEGERS`]): the document is not I-JSON unless an ignore
    /// pointer removes it ([`Document::is_exact`]).
    Inexact(f64),
    /// Borrowed unless the JSON text had escapes in it.
    String(Cow<'a, str>),
    /// Elements follow, up to `end` (exclusive).
    Array {
        end: usize,
    },
    /// Members follow up to `end`, each a `String` name then the value;
    /// `order[first..first + len]` are the names' positions, sorted, minus
    /// removed members.
    Object {
        end: usize,
        first: usize,
        len: usize,
    },
    /// An array element a pointer removed, with everything up to `end`.
    Removed {
        end: usize,
    },
}

impl<'a> Document<'a> {
    /// Parses `body` as I-JSON (RFC 7493): JSON text that serde_json
    /// accepts, without duplicate object names (parsers disagree on which
    /// one wins) and without numbers beyond the double range. Integers a
    /// double cannot hold exactly (beyond ±2^53, see [`EXACT_INTEGERS`]) are
    /// kept apart: see [`Document::is_exact`].
    pub fn parse(body: &'a [u8]) -> Result<Self, serde_json::Error> {
        let mut builder = Builder {
            // Guesses that save typical bodies most of the regrowing.
            tape: Vec::with_capacity(body.len() / 8),
            names: Vec::with_capacity(16),
            order: Vec::with_capacity(body.len() / 16),
            inexact: false,
        };
        // Validated as UTF-8 once, whole: read from a `str`, serde_json
        // takes its strings as they are, where from a slice it validates
        // each one again (a seventh of the parse). A body that is not
        // UTF-8 is not JSON text either (RFC 8259 section 8.1).
        let text = std::str::from_utf8(body).map_err(de::Error::custom)?;
        let mut de = serde_json::Deserializer::from_str(text);
        EntrySeed(&mut builder).deserialize(&mut de)?;
        // What `serde_json::from_slice` does after the value: only
        // whitespace may follow.
        de.end()?;
        Ok(Document {
            tape: builder.tape,
            order: builder.order,
            inexact: builder.inexact,
        })
    }

    /// False while the document still holds an integer literal a double
    /// cannot hold exactly: it is not I-JSON, and its canonical form would
    /// make `9007199254740993` and `9007199254740992` alike. Checked after
    /// the ignore pointers are removed, so that such a number in an ignored
    /// member (a nanosecond timestamp) does not matter. Free for documents
    /// without one.
    pub fn is_exact(&self) -> bool {
        !self.inexact || !self.reaches_inexact(self.root().0)
    }

    fn reaches_inexact(&self, at: usize) -> bool {
        match self.tape.get(at) {
            Some(Entry::Inexact(_)) => true,
            Some(Entry::Array { .. }) => self
                .elements(NodeId(at))
                .any(|element| self.reaches_inexact(element)),
            Some(Entry::Object { .. }) => self
                .members(NodeId(at))
                .iter()
                .any(|&name| self.reaches_inexact(name + 1)),
            _ => false,
        }
    }

    pub fn root(&self) -> NodeId {
        NodeId(0)
    }

    pub fn kind(&self, node: NodeId) -> Kind {
        match self.tape.get(node.0) {
            Some(Entry::Object { .. }) => Kind::Object,
            Some(Entry::Array { .. }) => Kind::Array,
            _ => Kind::Scalar,
        }
    }

    /// The value of `object`'s member `name`.
    pub fn member(&self, object: NodeId, name: &str) -> Option<NodeId> {
        let names = self.members(object);
        let i = names
            .binary_search_by(|&at| utf16_cmp(self.name(at), name))
            .ok()?;
        names.get(i).map(|&at| NodeId(at + 1))
    }

    /// Element `index` of `array`, counting only elements not removed.
    pub fn element(&self, array: NodeId, index: usize) -> Option<NodeId> {
        self.elements(array).nth(index).map(NodeId)
    }

    /// Removes `object`'s member `name`; false if there is none.
    pub fn remove_member(&mut self, object: NodeId, name: &str) -> bool {
        let Some(Entry::Object { first, len, .. }) = self.tape.get(object.0) else {
            return false;
        };
        let (first, len) = (*first, *len);
        let Some(names) = self.order.get_mut(first..first + len) else {
            return false;
        };
        let tape = &self.tape;
        let Ok(i) = names.binary_search_by(|&at| utf16_cmp(name_at(tape, at), name)) else {
            return false;
        };
        // Keeps the rest in order.
        if let Some(rest) = names.get_mut(i..) {
            rest.rotate_left(1);
        }
        if let Some(Entry::Object { len, .. }) = self.tape.get_mut(object.0) {
            *len -= 1;
        }
        true
    }

    /// Removes element `index` of `array`, shifting the later ones down;
    /// false if there is none.
    pub fn remove_element(&mut self, array: NodeId, index: usize) -> bool {
        let Some(at) = self.elements(array).nth(index) else {
            return false;
        };
        let end = self.skip(at);
        match self.tape.get_mut(at) {
            Some(entry) => {
                *entry = Entry::Removed { end };
                true
            }
            None => false,
        }
    }

    /// Writes the canonical form to `out`.
    pub fn write<S: Sink + ?Sized>(&self, out: &mut S) {
        self.write_node(self.root().0, out);
    }

    fn write_node<S: Sink + ?Sized>(&self, at: usize, out: &mut S) {
        match self.tape.get(at) {
            Some(Entry::Null) => out.put(b"null"),
            Some(Entry::Bool(true)) => out.put(b"true"),
            Some(Entry::Bool(false)) => out.put(b"false"),
            Some(Entry::Number(n) | Entry::Inexact(n)) => write_number(*n, out),
            Some(Entry::String(_)) => write_tape_string(self.tape.get(at), out),
            Some(Entry::Array { .. }) => {
                out.put(b"[");
                for (i, element) in self.elements(NodeId(at)).enumerate() {
                    if i > 0 {
                        out.put(b",");
                    }
                    self.write_node(element, out);
                }
                out.put(b"]");
            }
            Some(Entry::Object { .. }) => {
                out.put(b"{");
                for (i, &name) in self.members(NodeId(at)).iter().enumerate() {
                    if i > 0 {
                        out.put(b",");
                    }
                    write_tape_string(self.tape.get(name), out);
                    out.put(b":");
                    self.write_node(name + 1, out);
                }
                out.put(b"}");
            }
            // Never written: the root is not removable, and removed
            // elements are skipped.
            Some(Entry::Removed { .. }) | None => {}
        }
    }

    /// The sorted positions of `object`'s member names.
    fn members(&self, object: NodeId) -> &[usize] {
        match self.tape.get(object.0) {
            Some(Entry::Object { first, len, .. }) => {
                self.order.get(*first..*first + *len).unwrap_or_default()
            }
            _ => &[],
        }
    }

    fn elements(&self, array: NodeId) -> impl Iterator<Item = usize> + '_ {
        let end = match self.tape.get(array.0) {
            Some(Entry::Array { end }) => *end,
            _ => array.0 + 1,
        };
        std::iter::successors(Some(array.0 + 1), |&at| Some(self.skip(at)))
            .take_while(move |&at| at < end)
            .filter(|&at| !matches!(self.tape.get(at), Some(Entry::Removed { .. })))
    }

    /// The position after the value at `at`.
    fn skip(&self, at: usize) -> usize {
        match self.tape.get(at) {
            Some(Entry::Array { end } | Entry::Object { end, .. } | Entry::Removed { end }) => *end,
            _ => at + 1,
        }
    }

    fn name(&self, at: usize) -> &str {
        name_at(&self.tape, at)
    }
}

/// Names are always strings; the fallback only keeps this total.
fn name_at<'t>(tape: &'t [Entry<'_>], at: usize) -> &'t str {
    match tape.get(at) {
        Some(Entry::String(s)) => s,
        _ => "",
    }
}

/// Where the canonical form goes: a `Vec`, or a hasher that never needs the
/// whole of it at once.
pub trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Properties sort by their names' UTF-16 code units (RFC 8785 §3.2.3).
/// That is code point order, which UTF-8 bytes also follow, except that
/// supplementary characters (surrogate pairs, from U+D800) sort before
/// U+E000..=U+FFFF. So compare bytes up to the first difference and decide
/// on the two characters it falls in. Equal only for equal strings.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let Some(common) = x.iter().zip(y).position(|(p, q)| p != q) else {
        return x.len().cmp(&y.len());
    };
    if let (Some(&p), Some(&q)) = (x.get(common), y.get(common)) {
        // An ASCII character orders below any other in both encodings.
        if p.is_ascii() || q.is_ascii() {
            return p.cmp(&q);
        }
    }
    // The shared prefix is the same bytes in both, so a character boundary
    // of one is a boundary of the other.
    let mut start = common;
    while !a.is_char_boundary(start) {
        start -= 1;
    }
    let first = |s: &str| s.get(start..).and_then(|rest| rest.chars().next());
    match (first(a), first(b)) {
        (Some(x), Some(y)) => utf16_rank(x).cmp(&utf16_rank(y)),
        (x, y) => x.is_some().cmp(&y.is_some()),
    }
}

/// A key that orders characters as their first UTF-16 code unit does (and
/// then as code points, which is how the second one of a pair orders).
fn utf16_rank(c: char) -> u32 {
    match u32::from(c) {
        c @ 0xE000..=0xFFFF => c + 0x11_0000,
        c => c,
    }
}

/// Numbers are IEEE 754 doubles serialized as ECMAScript's
/// `Number.prototype.toString` does (RFC 8785 §3.2.2.3), which is what
/// ryu-js implements; the common short numbers skip it (see
/// [`short_decimal`]).
fn write_number<S: Sink + ?Sized>(value: f64, out: &mut S) {
    if value == 0.0 {
        // Both zeros are "0".
        out.put(b"0");
    } else if let Some((digits, scale)) = short_decimal(value.abs()) {
        let mut buf = [0u8; 24];
        out.put(format_decimal(value < 0.0, digits, scale, &mut buf));
    } else if value.is_finite() {
        let mut buffer = ryu_js::Buffer::new();
        out.put(buffer.format_finite(value).as_bytes());
    } else {
        // Never parsed (not I-JSON); what `JSON.stringify` writes.
        out.put(b"null");
    }
}

/// 2^53.
const MAX_EXACT_INT: f64 = 9_007_199_254_740_992.0;

/// Powers of ten tried as the scale of a short decimal.
const SCALES: [f64; 6] = [1e1, 1e2, 1e3, 1e4, 1e5, 1e6];

/// `value` (positive) as `digits / 10^scale` when that is how
/// `Number.prototype.toString` writes it, for integers below 2^53 and
/// decimals of up to 15 significant digits and 6 places; `None` otherwise.
///
/// `toString` writes the fewest significant digits that parse back to the
/// same double. An integer below 2^53 has neighbours at most 1 away, so
/// only its own digits do. A decimal of at most 15 significant digits can
/// be recovered from its double (`DBL_DIG`), so no other such decimal, in
/// particular no shorter one, parses to the same double: the one with the
/// fewest places that does is the answer. Below 10^15 at a given scale,
/// the double's neighbours are less than 0.25 apart and the product is off
/// by less than 0.125, so `round(value * 10^scale)` is the only candidate,
/// and dividing back (exact operands, one correctly rounded division) is
/// exactly parsing it. Within these bounds `toString` never uses an
/// exponent.
fn short_decimal(value: f64) -> Option<(u64, usize)> {
    if value.fract() == 0.0 {
        // Whole, so at least 1.
        return (value < MAX_EXACT_INT).then_some((value as u64, 0));
    }
    for (i, &scale) in SCALES.iter().enumerate() {
        let digits = (value * scale).round();
        if digits >= 1e15 {
            return None;
        }
        if digits / scale == value {
            // A trailing zero would mean a smaller scale had matched;
            // checked rather than assumed.
            let digits = digits as u64;
            return (!digits.is_multiple_of(10)).then_some((digits, i + 1));
        }
    }
    None
}

/// `digits / 10^scale` in decimal: `scale` places after the point, a
/// leading `0.` (and zeros) when `digits` has no more than `scale` digits.
fn format_decimal(negative: bool, mut digits: u64, scale: usize, buf: &mut [u8; 24]) -> &[u8] {
    let mut at = buf.len();
    let mut place = 0;
    // Digits from the right, the point after `scale` of them, and at least
    // one digit before it.
    while digits > 0 || place <= scale {
        if place == scale && scale > 0 {
            at -= 1;
            if let Some(b) = buf.get_mut(at) {
                *b = b'.';
            }
        }
        at -= 1;
        if let Some(b) = buf.get_mut(at) {
            // The remainder is below 10.
            *b = b'0' + (digits % 10) as u8;
        }
        digits /= 10;
        place += 1;
    }
    if negative {
        at -= 1;
        if let Some(b) = buf.get_mut(at) {
            *b = b'-';
        }
    }
    buf.get(at..).unwrap_or_default()
}

/// A string of the parsed document, a value or a member name. One
/// borrowed from the body had no
/// escape in the JSON text, so it holds no `"`, no `\\` and no control
/// character (JSON text cannot carry them unescaped): its canonical form is
/// its text between quotes, with nothing to look for. Most strings of an
/// API request are such; only those that had escapes are scanned.
fn write_tape_string<S: Sink + ?Sized>(entry: Option<&Entry<'_>>, out: &mut S) {
    match entry {
        Some(Entry::String(Cow::Borrowed(text))) => {
            debug_assert!(!text.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\'));
            out.put(b"\"");
            out.put(text.as_bytes());
            out.put(b"\"");
        }
        Some(Entry::String(Cow::Owned(text))) => write_string(text, out),
        // Names are always strings; the fallback only keeps this total.
        _ => write_string("", out),
    }
}

/// Strings as ECMAScript's `JSON.stringify` writes them (RFC 8785
/// §3.2.2.2): only `"`, `\` and control characters are escaped, with the
/// short forms where they exist and lower-case `\u00xx` otherwise.
fn write_string<S: Sink + ?Sized>(s: &str, out: &mut S) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.put(b"\"");
    let bytes = s.as_bytes();
    let mut rest = bytes;
    while let Some(i) = rest
        .iter()
        .position(|&b| b < 0x20 || b == b'"' || b == b'\\')
    {
        let (plain, tail) = rest.split_at(i);
        out.put(plain);
        let Some((&b, tail)) = tail.split_first() else {
            rest = tail;
            break;
        };
        match b {
            b'"' => out.put(b"\\\""),
            b'\\' => out.put(b"\\\\"),
            b'\x08' => out.put(b"\\b"),
            b'\t' => out.put(b"\\t"),
            b'\n' => out.put(b"\\n"),
            b'\x0c' => out.put(b"\\f"),
            b'\r' => out.put(b"\\r"),
            _ => out.put(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]),
        }
        rest = tail;
    }
    out.put(rest);
    out.put(b"\"");
}

/// The document being parsed, plus the names of the objects still open
/// (one stack for all of them, so no object allocates its own).
struct Builder<'de> {
    tape: Vec<Entry<'de>>,
    names: Vec<usize>,
    order: Vec<usize>,
    /// Whether an [`Entry::Inexact`] was pushed.
    inexact: bool,
}

impl<'de> Builder<'de> {
    fn set(&mut self, at: usize, entry: Entry<'de>) {
        if let Some(slot) = self.tape.get_mut(at) {
            *slot = entry;
        }
    }
}

/// Appends a value to the tape rather than returning it: moving an entry
/// out of every nested call costs more than pushing it where it goes.
struct EntrySeed<'b, 'de>(&'b mut Builder<'de>);

impl<'de> EntrySeed<'_, 'de> {
    fn push<E>(self, entry: Entry<'de>) -> Result<(), E> {
        self.0.tape.push(entry);
        Ok(())
    }

    /// An integer literal, `value` as the double it reads as: inexact past
    /// [`EXACT_INTEGERS`] in `magnitude`.
    fn push_integer<E>(self, magnitude: u64, value: f64) -> Result<(), E> {
        if magnitude > EXACT_INTEGERS {
            self.0.inexact = true;
            return self.push(Entry::Inexact(value));
        }
        self.push(Entry::Number(value))
    }
}

impl<'de> DeserializeSeed<'de> for EntrySeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// The largest integer literal read as a number. RFC 8785 reads every
/// number as a double, which holds every integer up to 2^53 and only some
/// past it: `9007199254740993` and `9007199254740992` would fingerprint
/// alike, so the same key with another account number (64-bit ids are
/// common) would be answered with the first request's response instead
/// of 409. I-JSON (RFC 7493 §2.2) leaves such numbers out; like a body
/// with duplicate names, a body with one (outside the ignored members) is
/// hashed as raw bytes, which can only err towards a 409. (Literals beyond
/// 64 bits, and decimals with more than 15 significant digits, still round:
/// serde_json hands them over as doubles already.)
const EXACT_INTEGERS: u64 = 1 << 53;

impl<'de> Visitor<'de> for EntrySeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.push(Entry::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.push_integer(v.unsigned_abs(), v as f64)
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.push_integer(v, v as f64)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        if v.is_finite() {
            self.push(Entry::Number(v))
        } else {
            Err(E::custom("number out of range"))
        }
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<(), E> {
        self.push(Entry::String(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.push(Entry::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<(), E> {
        self.push(Entry::String(Cow::Owned(v)))
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.push(Entry::Null)
    }

    fn visit_none<E>(self) -> Result<(), E> {
        self.push(Entry::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let head = self.0.tape.len();
        self.0.tape.push(Entry::Array { end: head });
        while seq.next_element_seed(EntrySeed(&mut *self.0))?.is_some() {}
        let end = self.0.tape.len();
        self.0.set(head, Entry::Array { end });
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let head = self.0.tape.len();
        self.0.tape.push(Entry::Object {
            end: head,
            first: 0,
            len: 0,
        });
        let open = self.0.names.len();
        loop {
            let at = self.0.tape.len();
            if map.next_key_seed(NameSeed(&mut *self.0))?.is_none() {
                break;
            }
            self.0.names.push(at);
            map.next_value_seed(EntrySeed(&mut *self.0))?;
        }
        let Builder {
            tape, names, order, ..
        } = &mut *self.0;
        let own = names.get_mut(open..).unwrap_or_default();
        own.sort_unstable_by(|&a, &b| utf16_cmp(name_at(tape, a), name_at(tape, b)));
        if own
            .iter()
            .zip(own.iter().skip(1))
            .any(|(&a, &b)| name_at(tape, a) == name_at(tape, b))
        {
            return Err(de::Error::custom("duplicate object key"));
        }
        let (first, len) = (order.len(), own.len());
        order.extend_from_slice(own);
        names.truncate(open);
        let end = tape.len();
        self.0.set(head, Entry::Object { end, first, len });
        Ok(())
    }
}

/// An object member's name, appended to the tape like a string value.
struct NameSeed<'b, 'de>(&'b mut Builder<'de>);

impl<'de> DeserializeSeed<'de> for NameSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<(), E> {
        EntrySeed(self.0).push(Entry::String(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        EntrySeed(self.0).push(Entry::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<(), E> {
        EntrySeed(self.0).push(Entry::String(Cow::Owned(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    fn canonical(json: &str) -> String {
        let doc = Document::parse(json.as_bytes()).expect("JSON");
        assert!(doc.is_exact(), "I-JSON: {json}");
        let mut out = Vec::new();
        doc.write(&mut out);
        String::from_utf8(out).expect("UTF-8")
    }

    fn number(value: f64) -> String {
        let mut out = Vec::new();
        write_number(value, &mut out);
        String::from_utf8(out).expect("UTF-8")
    }

    /// What `write_number` would write without its shortcut.
    fn ryu(value: f64) -> String {
        if value == 0.0 {
            return "0".to_owned();
        }
        ryu_js::Buffer::new().format_finite(value).to_owned()
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            // Integer literals a double holds exactly (see `EXACT_INTEGERS`).
            (-(1i64 << 53)..=(1 << 53)).prop_map(Value::from),
            (0u64..=(1 << 53)).prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            (-1e-7f64..1e-7).prop_map(Value::from),
            (1e20f64..1e22).prop_map(Value::from),
            ".*".prop_map(Value::String),
            "[\\x00-\\x1f\"\\\\\u{7f}\u{2028}\u{e000}-\u{ffff}\u{10000}-\u{10ffff}a-z]{0,8}"
                .prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(
                    "[a-c\u{e000}\u{ffff}\u{10000}\u{1f600}é\"\\\\\\x00-\\x1f]{0,3}",
                    inner,
                    0..6
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn arb_key() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-c\u{7f}\u{80}\u{7ff}\u{800}\u{d7ff}\u{e000}\u{ffff}\u{10000}\u{1f600}\u{10ffff}é]{0,4}",
            any::<String>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The oracle: the `serde_json_canonicalizer` crate.
        #[test]
        fn matches_the_reference_implementation(v in arb_json()) {
            let reference = serde_json_canonicalizer::to_string(&v).expect("serializes");
            let text = serde_json::to_string(&v).expect("serializes");
            prop_assert_eq!(canonical(&text), reference);
        }

        #[test]
        fn utf16_cmp_is_utf16_order(a in arb_key(), b in arb_key()) {
            prop_assert_eq!(utf16_cmp(&a, &b), a.encode_utf16().cmp(b.encode_utf16()));
            prop_assert_eq!(utf16_cmp(&a, &a), Ordering::Equal);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        /// `short_decimal` rests on an argument about doubles; this checks
        /// it where it matters: short decimals, the edges of its bounds
        /// (15 digits, 6 places, 2^53), and arbitrary doubles.
        #[test]
        fn short_numbers_match_ryu(
            digits in prop_oneof![
                1u64..1000,
                1u64..10_000_000,
                100_000_000_000_000u64..1_000_000_000_001_000,
                (1u64 << 53) - 1000..(1 << 53) + 1000,
                1u64..(1 << 53),
            ],
            places in 0u32..20,
            negative: bool,
            bits: u64,
        ) {
            let text = format!("{}{digits}e-{places}", if negative { "-" } else { "" });
            let value: f64 = text.parse().expect("a number");
            prop_assert_eq!(number(value), ryu(value), "{}", text);
            let value = f64::from_bits(bits);
            if value.is_finite() {
                prop_assert_eq!(number(value), ryu(value), "{:e}", value);
            }
        }
    }

    #[test]
    fn integer_literals_a_double_cannot_hold_are_not_i_json() {
        // 2^53 and below: every integer is a double of its own.
        assert_eq!(
            canonical("[9007199254740992, -9007199254740992, 9007199254740991]"),
            "[9007199254740992,-9007199254740992,9007199254740991]"
        );
        // Past it, 2^53 + 1 would read as 2^53: not I-JSON, so hashed raw.
        for text in [
            "9007199254740993",
            "-9007199254740993",
            r#"{"to_account": 18446744073709551615}"#,
            "[-9223372036854775808]",
        ] {
            let doc = Document::parse(text.as_bytes()).expect(text);
            assert!(!doc.is_exact(), "{text}");
        }
        assert!(Document::parse(b"[1, 2.5, {\"a\": -9007199254740992}]")
            .expect("JSON")
            .is_exact());
        // Written as a double, the sender chose a double.
        assert_eq!(
            canonical("[9007199254740993.0, 1e21]"),
            "[9007199254740992,1e+21]"
        );
    }

    #[test]
    fn keys_sort_by_utf16_code_units() {
        // U+1F600 (surrogates D83D DE00) sorts before U+E000 in UTF-16,
        // after it in UTF-8.
        assert_eq!(
            canonical(r#"{"\ue000":1,"😀":2,"a":3}"#),
            "{\"a\":3,\"😀\":2,\"\u{e000}\":1}"
        );
    }

    #[test]
    fn numbers_follow_ecmascript() {
        assert_eq!(
            canonical("[0, -0.0, 1.0, 1e21, 1e-7, 123456789012345678901, 0.1]"),
            "[0,0,1,1e+21,1e-7,123456789012345680000,0.1]"
        );
    }

    #[test]
    fn duplicate_names_are_rejected_however_spelled() {
        for json in [
            r#"{"a":1,"a":1}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"b":0,"😀":1,"a":2,"\ud83d\ude00":3}"#,
            r#"[{"x":{"k":[],"k":{}}}]"#,
        ] {
            assert!(Document::parse(json.as_bytes()).is_err(), "{json}");
        }
    }

    #[test]
    fn strings_borrow_unless_escaped() {
        let doc = Document::parse(br#"{"plain":"text","\u0065sc":"t\u0065xt"}"#).expect("JSON");
        assert!(matches!(
            doc.tape.as_slice(),
            [
                Entry::Object { .. },
                Entry::String(Cow::Borrowed("plain")),
                Entry::String(Cow::Borrowed("text")),
                Entry::String(Cow::Owned(esc)),
                Entry::String(Cow::Owned(_)),
            ] if esc == "esc"
        ));
    }

    /// A borrowed string is written between quotes as it is, unscanned: that
    /// holds only because JSON text cannot carry a quote, a backslash or a
    /// control character in a string without an escape, which makes it owned.
    #[test]
    fn strings_written_unscanned_are_those_without_escapes() {
        for raw in [&b"[\"a\x01b\"]"[..], b"[\"tab\there\"]", b"[\"nl\nx\"]"] {
            assert!(Document::parse(raw).is_err(), "{raw:?}");
        }
        let doc = Document::parse(br#"{"q\"k":"a\\b","p":"\u0001 \t","x":"plain \u00e9"}"#)
            .expect("JSON");
        let mut out = Vec::new();
        doc.write(&mut out);
        assert_eq!(
            String::from_utf8(out).expect("UTF-8"),
            "{\"p\":\"\\u0001 \\t\",\"q\\\"k\":\"a\\\\b\",\"x\":\"plain \u{e9}\"}"
        );
    }

    #[test]
    fn members_are_found_and_removed_in_order() {
        let mut doc =
            Document::parse(r#"{"😀":1,"\ue000":{"x":[]},"a":3}"#.as_bytes()).expect("JSON");
        let root = doc.root();
        assert_eq!(doc.kind(root), Kind::Object);
        let e000 = doc.member(root, "\u{e000}").expect("member");
        assert_eq!(doc.kind(e000), Kind::Object);
        let x = doc.member(e000, "x").expect("member");
        assert_eq!(doc.kind(x), Kind::Array);
        assert!(doc.remove_member(root, "😀"));
        assert!(!doc.remove_member(root, "😀"));
        assert!(!doc.remove_member(x, "0"));
        assert_eq!(doc.member(root, "b"), None);
        let mut out = Vec::new();
        doc.write(&mut out);
        assert_eq!(out, "{\"a\":3,\"\u{e000}\":{\"x\":[]}}".as_bytes());
    }

    #[test]
    fn removed_elements_shift_the_later_ones() {
        let mut doc = Document::parse(br#"[[1,[2]],{"a":3},4,5]"#).expect("JSON");
        let root = doc.root();
        assert!(doc.remove_element(root, 0));
        let first = doc.element(root, 0).expect("element");
        assert_eq!(doc.kind(first), Kind::Object);
        assert!(doc.remove_element(root, 1));
        assert!(!doc.remove_element(root, 2));
        assert!(!doc.remove_element(first, 0));
        assert_eq!(doc.element(root, 2), None);
        let mut out = Vec::new();
        doc.write(&mut out);
        assert_eq!(out, br#"[{"a":3},5]"#);
        assert!(doc.remove_element(root, 1));
        assert!(doc.remove_element(root, 0));
        out.clear();
        doc.write(&mut out);
        assert_eq!(out, b"[]");
    }

    #[test]
    fn short_numbers_skip_ryu() {
        for (value, text) in [
            (1.0, "1"),
            (-7.0, "-7"),
            (1000.0, "1000"),
            (9007199254740991.0, "9007199254740991"),
            (-9007199254740991.0, "-9007199254740991"),
            (12.34, "12.34"),
            (-0.5, "-0.5"),
            (0.05, "0.05"),
            (0.000001, "0.000001"),
            (-0.000123, "-0.000123"),
            (123456789.123456, "123456789.123456"),
            (99999999999999.9, "99999999999999.9"),
            (0.1 + 0.2, "0.30000000000000004"),
            (9007199254740992.0, "9007199254740992"),
            (1e21, "1e+21"),
            (1e-7, "1e-7"),
            (1.5e-7, "1.5e-7"),
            (5e-324, "5e-324"),
        ] {
            assert_eq!(number(value), text, "{value:e}");
            assert_eq!(number(value), ryu(value), "{value:e}");
        }
    }
}
