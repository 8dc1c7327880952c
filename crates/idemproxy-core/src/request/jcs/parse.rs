//! Parsing a body into a [`Document`]: one pass over the bytes that
//! validates the JSON text and appends each value to the tape where it
//! goes, sorting each object's members once, as it closes, which is also
//! where duplicate names show up.
//!
//! Hand-written rather than serde_json's deserializer driving visitors,
//! which took twice as long: a trip through the visitor and its access
//! types per value, a scratch copy per escaped string, recursion per
//! container, and a full sort per object. What it accepts, and the double
//! every number reads as, are still serde_json's (with `float_roundtrip`,
//! as the crate builds it): the visitors it replaced stay as the test
//! oracle (`oracle`), and a differential property test holds the two to
//! the same documents on arbitrary and corrupted input.

use std::borrow::Cow;

use super::scan::{
    digits, error, escaped, exact_integer, exponent_of, fast_double, plain_run, skip_space,
    slow_double, sort_key, writes_as, ParseError, DBL_DIG,
};
use super::{name_at, utf16_cmp, Document, Entry};

impl<'a> Document<'a> {
    /// Parses `body` as I-JSON (RFC 7493): JSON text that serde_json
    /// accepts, without duplicate object names (parsers disagree on which
    /// one wins) and without numbers beyond the double range. Numbers whose
    /// canonical form would not be their value (integers beyond ±2^53, see
    /// [`EXACT_INTEGERS`], and decimals that round) are kept apart: see
    /// [`Document::is_exact`].
    pub(crate) fn parse(body: &'a [u8]) -> Result<Self, ParseError> {
        // Validated as UTF-8 once, whole, so that a string without escapes
        // is a slice of it as it stands. A body that is not UTF-8 is not
        // JSON text either (RFC 8259 section 8.1).
        let text = std::str::from_utf8(body).map_err(|e| error(e.valid_up_to(), "not UTF-8"))?;
        let mut parser = Parser {
            text,
            // Guesses that save typical bodies most of the regrowing.
            tape: Vec::with_capacity(body.len() / 5),
            names: Vec::with_capacity(16),
            order: Vec::with_capacity(body.len() / 12),
            inexact: false,
            last: LastObject {
                len: 0,
                keys: [0; LAST_MAX],
                order: [0; LAST_MAX],
            },
        };
        parser.document()?;
        Ok(Document {
            tape: parser.tape,
            order: parser.order,
            inexact: parser.inexact,
        })
    }
}

/// The largest integer literal read as a number. RFC 8785 reads every
/// number as a double, which holds every integer up to 2^53 and only some
/// past it: `9007199254740993` and `9007199254740992` would fingerprint
/// alike, so the same key with another account number (64-bit ids are
/// common) would be answered with the first request's response instead
/// of 409. I-JSON (RFC 7493 §2.2) leaves such numbers out; like a body
/// with duplicate names, a body with one (outside the ignored members) is
/// hashed as raw bytes, which can only err towards a 409. Any size and
/// sign: a literal past 64 bits is still an integer past 2^53.
///
/// Other literals round the same way (`1.00000000000000000001` reads as
/// 1, `1e-400` as 0, `4.9e-324` as `5e-324`): one counts as a number
/// only if its value is that of its double's canonical form, so that no
/// two different numbers share one (see [`writes_as`]).
const EXACT_INTEGERS: u64 = 1 << 53;

/// How many containers may be open at once: serde_json's recursion limit
/// (128) trips as the 128th opens.
pub(super) const MAX_DEPTH: usize = 127;

/// The document being parsed. While a container is open, its header's
/// `end` holds the position of the header of the container around it, and
/// an object's `first` where its names start in `names`: the stack of open
/// containers costs nothing beyond the tape.
///
/// The position read is passed along rather than kept here, and the
/// common paths are inlined into [`Parser::document`]'s loop, so that it
/// stays in a register rather than going to memory and back around every
/// push onto the tape.
struct Parser<'a> {
    text: &'a str,
    tape: Vec<Entry<'a>>,
    /// The names of the objects still open (one stack for all of them, so
    /// no object allocates its own), each with its [`sort_key`].
    names: Vec<(u64, usize)>,
    order: Vec<usize>,
    /// Whether an [`Entry::Inexact`] was pushed.
    inexact: bool,
    last: LastObject,
}

/// How many names an object may have for [`LastObject`] to keep it.
const LAST_MAX: usize = 16;

/// The names of the last object sorted whose keys (see [`sort_key`]) all
/// differ: the keys in document order, and where sorting put each (an
/// index into them). Arrays of records repeat the same names in the same
/// order, and the same keys sort the same way: a comparison per name
/// rather than a sort. Arrays rather than `Vec`s, so that documents
/// without such records allocate nothing for it.
struct LastObject {
    len: usize,
    keys: [u64; LAST_MAX],
    order: [u8; LAST_MAX],
}

impl LastObject {
    /// Sorts the names `own` of an object (at least two), refusing a
    /// duplicate (`at` is for the error); remembers the order they sort
    /// in if `remember` and their keys all differ.
    fn sort(
        &mut self,
        tape: &[Entry<'_>],
        own: &mut [(u64, usize)],
        remember: bool,
        at: usize,
    ) -> Result<(), ParseError> {
        let len = own.len();
        // The names as they came, to remember the order they sort in.
        let mut came = [(0, 0); LAST_MAX];
        if remember {
            for (to, &from) in came.iter_mut().zip(own.iter()) {
                *to = from;
            }
        }
        let name = |at| name_at(tape, at);
        own.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| utf16_cmp(name(a.1), name(b.1))));
        let mut distinct = true;
        for (a, b) in own.iter().zip(own.iter().skip(1)) {
            if a.0 == b.0 {
                if name(a.1) == name(b.1) {
                    return Err(error(at, "duplicate object key"));
                }
                distinct = false;
            }
        }
        if !(remember && distinct) {
            return Ok(());
        }
        self.len = 0;
        let came = came.get(..len).unwrap_or_default();
        for (to, &(key, _)) in self.keys.iter_mut().zip(came) {
            *to = key;
        }
        // Positions grow in document order, so `came` is sorted by them:
        // each name's index is always found.
        let mut found = 0;
        for (to, &(_, at)) in self.order.iter_mut().zip(own.iter()) {
            let index = came.binary_search_by_key(&at, |&(_, at)| at).ok();
            if let Some(index) = index.and_then(|i| u8::try_from(i).ok()) {
                *to = index;
                found += 1;
            }
        }
        if found == len {
            self.len = len;
        }
        Ok(())
    }
}

impl<'a> Parser<'a> {
    /// The whole body: one value, whitespace around it.
    fn document(&mut self) -> Result<(), ParseError> {
        let text = self.text;
        let bytes = text.as_bytes();
        let mut at = 0;
        // The header of the innermost open container, how many are open,
        // and whether that one is an object.
        let mut open = 0;
        let mut depth = 0;
        let mut in_object = false;
        loop {
            // A value starts here.
            at = skip_space(bytes, at);
            match bytes.get(at) {
                Some(b'"') => at = self.string(text, at + 1, false)?,
                Some(b'-' | b'0'..=b'9') => at = self.number(text, at)?,
                Some(b'[' | b'{') if depth == MAX_DEPTH => {
                    return Err(error(at, "nested too deep"));
                }
                Some(b'[') => {
                    let head = self.open_array(open);
                    at = skip_space(bytes, at + 1);
                    if bytes.get(at) != Some(&b']') {
                        (open, depth, in_object) = (head, depth + 1, false);
                        continue;
                    }
                    at += 1;
                    self.close_array(head);
                }
                Some(b'{') => {
                    let head = self.open_object(open);
                    at = skip_space(bytes, at + 1);
                    if bytes.get(at) != Some(&b'}') {
                        (open, depth, in_object) = (head, depth + 1, true);
                        at = self.member_name(text, at)?;
                        continue;
                    }
                    at += 1;
                    self.close_object(head, at)?;
                }
                Some(b't') => at = self.literal(bytes, at, b"true", Entry::Bool(true))?,
                Some(b'f') => at = self.literal(bytes, at, b"false", Entry::Bool(false))?,
                Some(b'n') => at = self.literal(bytes, at, b"null", Entry::Null)?,
                _ => return Err(error(at, "expected a value")),
            }
            // A value ended here: what follows is a separator, or the end
            // of its container, which is a value that ended too.
            loop {
                at = skip_space(bytes, at);
                if depth == 0 {
                    return match bytes.get(at) {
                        None => Ok(()),
                        Some(_) => Err(error(at, "trailing characters")),
                    };
                }
                match (bytes.get(at), in_object) {
                    (Some(b','), false) => {
                        at += 1;
                        break;
                    }
                    (Some(b','), true) => {
                        at = self.member_name(text, skip_space(bytes, at + 1))?;
                        break;
                    }
                    (Some(b']'), false) => {
                        at += 1;
                        open = self.close_array(open);
                    }
                    (Some(b'}'), true) => {
                        at += 1;
                        open = self.close_object(open, at)?;
                    }
                    _ => return Err(error(at, "expected `,` or the end of the container")),
                }
                depth -= 1;
                in_object = matches!(self.tape.get(open), Some(Entry::Object { .. }));
            }
        }
    }

    /// Opens an array inside the container whose header is at `outer`;
    /// the position of its own header.
    #[inline(always)]
    fn open_array(&mut self, outer: usize) -> usize {
        let head = self.tape.len();
        self.tape.push(Entry::Array { end: outer });
        head
    }

    /// Opens an object inside the container whose header is at `outer`;
    /// the position of its own header.
    #[inline(always)]
    fn open_object(&mut self, outer: usize) -> usize {
        let head = self.tape.len();
        self.tape.push(Entry::Object {
            end: outer,
            first: self.names.len(),
            len: 0,
        });
        head
    }

    /// An object member's name, at `at`, and the colon after it; the
    /// position after that. The name is appended to the tape like a string
    /// value.
    #[inline(always)]
    fn member_name(&mut self, text: &'a str, at: usize) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        if bytes.get(at) != Some(&b'"') {
            return Err(error(at, "expected a member name"));
        }
        let at = skip_space(bytes, self.string(text, at + 1, true)?);
        if bytes.get(at) != Some(&b':') {
            return Err(error(at, "expected `:`"));
        }
        Ok(at + 1)
    }

    /// Appends the string from `start`, just after its opening quote, to
    /// the tape, and to `names` if it is a member name; the position after
    /// its closing quote. A slice of the body unless there are escapes to
    /// decode.
    #[inline(always)]
    fn string(&mut self, text: &'a str, start: usize, name: bool) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        let stop = plain_run(bytes, start);
        let (s, next) = match text.get(start..stop) {
            // A plain run stops at an ASCII byte or the end, both
            // character boundaries: `get` is never `None`.
            Some(s) if bytes.get(stop) == Some(&b'"') => (Cow::Borrowed(s), stop + 1),
            _ => escaped(text, start, stop)?,
        };
        if name {
            self.names.push((sort_key(s.as_bytes()), self.tape.len()));
        }
        self.tape.push(Entry::String(s));
        Ok(next)
    }

    /// Ends the array whose header is at `head`; the header of the
    /// container around it.
    #[inline(always)]
    fn close_array(&mut self, head: usize) -> usize {
        let end = self.tape.len();
        match self.tape.get_mut(head) {
            Some(Entry::Array { end: slot }) => std::mem::replace(slot, end),
            _ => 0,
        }
    }

    /// Ends the object whose header is at `head`, sorting its names (or
    /// ordering them as the last record's, see [`LastObject`]); the header
    /// of the container around it. `at` is only for the error.
    fn close_object(&mut self, head: usize, at: usize) -> Result<usize, ParseError> {
        let Some(&Entry::Object {
            end: outer,
            first: open,
            ..
        }) = self.tape.get(head)
        else {
            return Err(error(at, "not an object"));
        };
        let Parser {
            tape,
            names,
            order,
            last,
            ..
        } = self;
        let own = names.get_mut(open..).unwrap_or_default();
        let (first, len) = (order.len(), own.len());
        // Only records in arrays come in runs of the same names.
        let in_array = matches!(tape.get(outer), Some(Entry::Array { .. }));
        let last_keys = last.keys.get(..last.len).unwrap_or_default();
        // The same keys, all different, sort the same way, and no two of
        // them can be the same name.
        if len > 1
            && in_array
            && own
                .iter()
                .map(|&(key, _)| key)
                .eq(last_keys.iter().copied())
        {
            let sorted = last.order.get(..len).unwrap_or_default();
            order.extend(
                sorted
                    .iter()
                    .filter_map(|&i| own.get(usize::from(i)))
                    .map(|&(_, at)| at),
            );
        } else {
            if len > 1 {
                last.sort(tape, own, in_array && len <= LAST_MAX, at)?;
            }
            order.extend(own.iter().map(|&(_, at)| at));
        }
        names.truncate(open);
        let end = tape.len();
        if let Some(slot) = tape.get_mut(head) {
            *slot = Entry::Object { end, first, len };
        }
        Ok(outer)
    }

    #[inline(always)]
    fn literal(
        &mut self,
        bytes: &[u8],
        at: usize,
        word: &'static [u8],
        entry: Entry<'a>,
    ) -> Result<usize, ParseError> {
        let end = at + word.len();
        if bytes.get(at..end) != Some(word) {
            return Err(error(at, "expected a value"));
        }
        self.tape.push(entry);
        Ok(end)
    }

    /// A number at `start`, as serde_json reads it; the position after it.
    #[inline(always)]
    fn number(&mut self, text: &str, start: usize) -> Result<usize, ParseError> {
        let (value, exact, at) = read_number(text, start)?;
        if exact {
            self.tape.push(Entry::Number(value));
        } else {
            self.inexact = true;
            self.tape.push(Entry::Inexact(value));
        }
        Ok(at)
    }
}

/// A number at `start`, as serde_json reads it (RFC 8259's grammar): the
/// double it reads as, whether its literal is exact (an integer up to
/// [`EXACT_INTEGERS`], or a literal whose value is that of its double's
/// canonical form), and the position after it.
#[inline(always)]
pub(super) fn read_number(text: &str, start: usize) -> Result<(f64, bool, usize), ParseError> {
    let bytes = text.as_bytes();
    let negative = bytes.get(start) == Some(&b'-');
    let int_start = start + usize::from(negative);
    // The digits read as an integer, wrapping: how many there are
    // tells whether it fits.
    let (mut mantissa, mut at) = digits(bytes, int_start, 0);
    let int_digits = at - int_start;
    if int_digits == 0 {
        return Err(error(at, "expected a digit"));
    }
    if int_digits > 1 && bytes.get(int_start) == Some(&b'0') {
        return Err(error(int_start, "leading zero"));
    }
    let mut significant = int_digits;
    // The power of ten that scales `mantissa`.
    let mut scale = 0i64;
    let fraction = bytes.get(at) == Some(&b'.');
    if fraction {
        let first = at + 1;
        (mantissa, at) = digits(bytes, first, mantissa);
        if at == first {
            return Err(error(at, "expected a digit"));
        }
        significant += at - first;
        scale = i64::try_from(at - first).map_or(i64::MIN, |n| -n);
    }
    let exponent = matches!(bytes.get(at), Some(b'e' | b'E'));
    if exponent {
        (scale, at) = exponent_of(bytes, at + 1, scale)?;
    }
    let integer = !fraction && !exponent;
    if integer {
        // 19 digits always fit a u64, 21 never do.
        let magnitude = match int_digits {
            ..=19 => Some(mantissa),
            20 => bytes.get(int_start..at).and_then(exact_integer),
            _ => None,
        };
        if let Some(magnitude) = magnitude {
            // For `-0` and below -2^63 serde_json hands over a double,
            // the same one.
            let value = match (negative, magnitude) {
                (false, m) => m as f64,
                (true, 0) => -0.0,
                (true, m) => -(m as f64),
            };
            return Ok((value, magnitude <= EXACT_INTEGERS, at));
        }
    }
    let magnitude = match fast_double(mantissa, scale) {
        Some(value) if significant <= 19 => value,
        _ => slow_double(text, int_start, at)?,
    };
    if !magnitude.is_finite() {
        return Err(error(start, "number out of range"));
    }
    let value = if negative { -magnitude } else { magnitude };
    // An integer literal that does not fit 64 bits is past 2^53. In
    // the normal range (below it doubles have fewer digits), a decimal
    // of at most `DBL_DIG` digits is the only one that short to read
    // as its double, so it is what that double writes as; and zero
    // digits read as zero. Only the rest, long literals and results
    // that underflowed, are compared digit by digit.
    let exact = !integer
        && (significant <= DBL_DIG && (magnitude.is_normal() || mantissa == 0)
            || writes_as(text.get(int_start..at).unwrap_or_default(), magnitude));
    Ok((value, exact, at))
}

/// The parser this one replaced: serde_json validates and tokenizes, and
/// visitors append each value to the tape. Kept as the oracle the
/// differential tests hold [`Document::parse`] to.
///
/// Visitors see a number's double, not its literal, which decides whether
/// it is exact: the oracle takes the literals from the text on its own
/// (`literals`) and decides as plainly as it can (`exact`), sharing no
/// code with the parser's fast path or [`writes_as`].
#[cfg(test)]
mod oracle {
    use std::borrow::Cow;
    use std::fmt;

    use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

    use super::EXACT_INTEGERS;
    use crate::request::jcs::{name_at, utf16_cmp, Document, Entry};

    pub(super) fn parse(body: &[u8]) -> Result<Document<'_>, serde_json::Error> {
        let text = std::str::from_utf8(body).map_err(de::Error::custom)?;
        let mut builder = Builder {
            tape: Vec::with_capacity(body.len() / 8),
            names: Vec::with_capacity(16),
            order: Vec::with_capacity(body.len() / 16),
            inexact: false,
            literals: literals(text).into_iter(),
        };
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

    struct Builder<'de> {
        tape: Vec<Entry<'de>>,
        names: Vec<usize>,
        order: Vec<usize>,
        inexact: bool,
        /// The number literals not yet visited, in document order.
        literals: std::vec::IntoIter<&'de str>,
    }

    /// The number literals in `text`, in order. Right for any text
    /// serde_json accepts (where only they start with `-` or a digit
    /// outside strings); on other text the oracle fails anyway.
    fn literals(text: &str) -> Vec<&str> {
        let bytes = text.as_bytes();
        let mut found = Vec::new();
        let mut at = 0;
        while let Some(&b) = bytes.get(at) {
            at += 1;
            match b {
                b'"' => {
                    while let Some(&c) = bytes.get(at) {
                        at += 1;
                        match c {
                            b'\\' => at += 1,
                            b'"' => break,
                            _ => {}
                        }
                    }
                }
                b'-' | b'0'..=b'9' => {
                    let start = at - 1;
                    while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = bytes.get(at) {
                        at += 1;
                    }
                    found.extend(text.get(start..at));
                }
                _ => {}
            }
        }
        found
    }

    /// Whether `literal`, read as `value`, is a number of I-JSON as the
    /// parser defines it: an integer literal up to 2^53 in magnitude, or
    /// a decimal whose value is that of the shortest decimal reading as
    /// `value`, compared digit by digit.
    fn exact(literal: &str, value: f64) -> bool {
        let unsigned = literal.trim_start_matches('-');
        if !unsigned.contains(['.', 'e', 'E']) {
            return unsigned
                .parse::<u64>()
                .is_ok_and(|magnitude| magnitude <= EXACT_INTEGERS);
        }
        let mut buffer = ryu_js::Buffer::new();
        normalized(unsigned) == normalized(buffer.format(value.abs()))
    }

    /// A decimal as its significant digits and the power of ten of the
    /// last one; zero as no digits.
    fn normalized(decimal: &str) -> (String, i128) {
        let (mantissa, exponent) = match decimal.split_once(['e', 'E']) {
            Some((mantissa, exponent)) => {
                let far = if exponent.starts_with('-') { -1 } else { 1 } * 10i128.pow(30);
                (mantissa, exponent.parse::<i128>().unwrap_or(far))
            }
            None => (decimal, 0),
        };
        let (int, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let digits = format!("{int}{fraction}");
        let digits = digits.trim_start_matches('0');
        let significant = digits.trim_end_matches('0');
        if significant.is_empty() {
            return (String::new(), 0);
        }
        let places = |n: usize| i128::try_from(n).unwrap_or(i128::MAX);
        let exponent = exponent - places(fraction.len()) + places(digits.len() - significant.len());
        (significant.to_owned(), exponent)
    }

    impl<'de> Builder<'de> {
        fn set(&mut self, at: usize, entry: Entry<'de>) {
            if let Some(slot) = self.tape.get_mut(at) {
                *slot = entry;
            }
        }
    }

    struct EntrySeed<'b, 'de>(&'b mut Builder<'de>);

    impl<'de> EntrySeed<'_, 'de> {
        fn push<E>(self, entry: Entry<'de>) -> Result<(), E> {
            self.0.tape.push(entry);
            Ok(())
        }

        fn push_number<E>(self, value: f64) -> Result<(), E> {
            let literal = self.0.literals.next().unwrap_or_default();
            if exact(literal, value) {
                return self.push(Entry::Number(value));
            }
            self.0.inexact = true;
            self.push(Entry::Inexact(value))
        }
    }

    impl<'de> DeserializeSeed<'de> for EntrySeed<'_, 'de> {
        type Value = ();

        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for EntrySeed<'_, 'de> {
        type Value = ();

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON value")
        }

        fn visit_bool<E>(self, v: bool) -> Result<(), E> {
            self.push(Entry::Bool(v))
        }

        fn visit_i64<E>(self, v: i64) -> Result<(), E> {
            self.push_number(v as f64)
        }

        fn visit_u64<E>(self, v: u64) -> Result<(), E> {
            self.push_number(v as f64)
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
            if v.is_finite() {
                self.push_number(v)
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::jcs::stream::Canonical;
    use crate::request::jcs::tests::canonical;
    use proptest::prelude::*;
    use proptest::sample::{select, Index};

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
            "-9223372036854775809",
            "123456789012345678901234567890",
            // Written as a decimal, still not the double's value.
            "9007199254740993.0",
        ] {
            let doc = Document::parse(text.as_bytes()).expect(text);
            assert!(!doc.is_exact(), "{text}");
        }
        assert!(Document::parse(b"[1, 2.5, {\"a\": -9007199254740992}]")
            .expect("JSON")
            .is_exact());
        // Written as a decimal that a double holds, the sender chose a
        // double.
        assert_eq!(
            canonical("[9007199254740992.0, 9007199254740994e0, 1e21]"),
            "[9007199254740992,9007199254740994,1e+21]"
        );
    }

    /// What a fingerprint hashes for `json`: its canonical form, or (not
    /// I-JSON) the bytes as sent.
    fn hashed_as(json: &str) -> Result<String, String> {
        let doc = Document::parse(json.as_bytes()).expect(json);
        if !doc.is_exact() {
            return Err(json.to_owned());
        }
        let mut out = Vec::new();
        doc.write(&mut out);
        Ok(String::from_utf8(out).expect("UTF-8"))
    }

    #[test]
    fn numbers_no_double_tells_apart_are_hashed_apart() {
        // The second of each pair reads as the same double as the first;
        // the first is not what that double writes as, so it is not I-JSON.
        for (inexact, other) in [
            ("12345678901234567890123", "12345678901234567890124"),
            ("12345678901234567890124", "12345678901234567890123"),
            ("-9223372036854775809", "-9223372036854775810"),
            ("-18446744073709551617", "-18446744073709551616"),
            ("0.1000000000000000055511151231257827", "0.1"),
            ("1.00000000000000000001", "1"),
            ("1.0000000000000001", "1"),
            ("0.30000000000000004441", "0.30000000000000004"),
            ("1e-400", "0"),
            ("-1e-400", "-0"),
            ("0.0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000001", "0"),
            ("4.9e-324", "5e-324"),
            ("2.4703282292062328e-324", "5e-324"),
            ("1.2345e-320", "1.2347e-320"),
            ("123456789012345678e-3", "123456789012345.67"),
            ("1.7976931348623158e308", "1.7976931348623157e308"),
            ("9007199254740993.0", "9007199254740992"),
            ("9007199254740993e0", "9007199254740992"),
        ] {
            for wrap in ["{}", "{\"amount\":{}}", "[1,{},\"x\"]"] {
                let (a, b) = (wrap.replace("{}", inexact), wrap.replace("{}", other));
                let doc = Document::parse(a.as_bytes()).expect(&a);
                assert!(!doc.is_exact(), "{a}");
                assert_ne!(hashed_as(&a), hashed_as(&b), "{a} vs {b}");
            }
        }
        // An ignored member may hold one (see `Document::is_exact`).
        let mut doc = Document::parse(br#"{"a":1,"ts":1.00000000000000000001}"#).expect("JSON");
        let root = doc.root();
        assert!(doc.remove_member(root, "ts"));
        assert!(doc.is_exact());
    }

    #[test]
    fn numbers_that_write_as_they_read_stay_canonical() {
        for (json, written) in [
            ("0.30000000000000004", "0.30000000000000004"),
            ("1e21", "1e+21"),
            ("1e23", "1e+23"),
            ("123.456", "123.456"),
            ("-0.0", "0"),
            ("-0", "0"),
            ("0.000e999999999999999999", "0"),
            ("0.00000000000000000000", "0"),
            ("1E+2", "100"),
            ("100.000000000000000000000", "100"),
            ("0.100000000000000000000", "0.1"),
            ("1.5e-5", "0.000015"),
            ("5e-324", "5e-324"),
            ("-2.2250738585072014e-308", "-2.2250738585072014e-308"),
            ("2.225073858507201e-308", "2.225073858507201e-308"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("9007199254740992.0", "9007199254740992"),
            ("9007199254740994.0", "9007199254740994"),
            ("9007199254740992", "9007199254740992"),
        ] {
            assert_eq!(hashed_as(json), Ok(written.to_owned()), "{json}");
        }
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

    /// A tape entry as the tests compare it: doubles by their bits, strings
    /// with whether they borrow.
    #[derive(Debug, PartialEq)]
    enum Seen {
        Null,
        Bool(bool),
        Number(u64),
        Inexact(u64),
        Borrowed(String),
        Owned(String),
        Array(usize),
        Object(usize, usize, usize),
        Removed(usize),
    }

    type Snapshot = (Vec<Seen>, Vec<usize>, bool);

    fn snapshot(doc: &Document<'_>) -> Snapshot {
        let tape = doc
            .tape
            .iter()
            .map(|entry| match entry {
                Entry::Null => Seen::Null,
                Entry::Bool(b) => Seen::Bool(*b),
                Entry::Number(n) => Seen::Number(n.to_bits()),
                Entry::Inexact(n) => Seen::Inexact(n.to_bits()),
                Entry::String(Cow::Borrowed(s)) => Seen::Borrowed((*s).to_owned()),
                Entry::String(Cow::Owned(s)) => Seen::Owned(s.clone()),
                Entry::Array { end } => Seen::Array(*end),
                Entry::Object { end, first, len } => Seen::Object(*end, *first, *len),
                Entry::Removed { end } => Seen::Removed(*end),
            })
            .collect();
        (tape, doc.order.clone(), doc.inexact)
    }

    /// Both parsers' documents for `body`, `None` where one refuses it.
    fn both(body: &[u8]) -> (Option<Snapshot>, Option<Snapshot>) {
        (
            Document::parse(body).ok().map(|d| snapshot(&d)),
            oracle::parse(body).ok().map(|d| snapshot(&d)),
        )
    }

    fn agrees(body: &[u8]) -> Result<(), TestCaseError> {
        let (ours, theirs) = both(body);
        prop_assert_eq!(
            ours,
            theirs,
            "on {:?}: ours {:?}, serde_json {:?}",
            String::from_utf8_lossy(body),
            Document::parse(body).err(),
            oracle::parse(body).err()
        );
        streams_alike(body)
    }

    /// The canonical form written while parsing is the tape's, and both
    /// refuse the same bodies (the tape's when it is not exact).
    fn streams_alike(body: &[u8]) -> Result<(), TestCaseError> {
        let tape = Document::parse(body)
            .ok()
            .filter(Document::is_exact)
            .map(|doc| {
                let mut out = Vec::new();
                doc.write(&mut out);
                out
            });
        let mut canonical = Canonical::default();
        let streamed = canonical.write(body).ok().map(<[u8]>::to_vec);
        prop_assert_eq!(
            streamed.as_deref().map(String::from_utf8_lossy),
            tape.as_deref().map(String::from_utf8_lossy),
            "on {:?}",
            String::from_utf8_lossy(body)
        );
        Ok(())
    }

    /// The root value of `json`, as the new parser reads it, checked
    /// against the oracle.
    fn root(json: &str) -> Option<Seen> {
        let (ours, theirs) = both(json.as_bytes());
        assert_eq!(ours, theirs, "{json:?}");
        ours.and_then(|(tape, _, _)| tape.into_iter().next())
    }

    fn number(value: f64) -> Option<Seen> {
        Some(Seen::Number(value.to_bits()))
    }

    fn inexact(value: f64) -> Option<Seen> {
        Some(Seen::Inexact(value.to_bits()))
    }

    fn nested(depth: usize, open: &str, inner: &str, close: &str) -> String {
        format!("{}{inner}{}", open.repeat(depth), close.repeat(depth))
    }

    #[test]
    fn nesting_stops_where_serde_json_does() {
        for (open, close) in [("[", "]"), (r#"{"a":"#, "}"), (r#"[{"a":"#, "}]")] {
            let levels = open.matches(['[', '{']).count();
            for (depth, ok) in [(126, true), (127, true), (128, false), (129, false)] {
                let Some(times) = (depth % levels == 0).then_some(depth / levels) else {
                    continue;
                };
                let json = nested(times, open, "0", close);
                assert_eq!(root(&json).is_some(), ok, "{depth} × {open}");
            }
        }
        // The innermost container counts, empty or not.
        assert!(root(&nested(126, "[", "[]", "]")).is_some());
        assert!(root(&nested(127, "[", "[]", "]")).is_none());
        assert!(root(&nested(127, "[", "{}", "]")).is_none());
        // Depth, not count: siblings do not add up.
        assert!(root(&format!("[{}]", ["[[]]"; 200].join(","))).is_some());
    }

    #[test]
    fn numbers_read_as_serde_json_reads_them() {
        let two53 = EXACT_INTEGERS as f64;
        for (json, seen) in [
            ("0", number(0.0)),
            // serde_json hands `-0` over as a double: not an integer zero.
            ("-0", number(-0.0)),
            ("-0.0", number(-0.0)),
            ("0e5", number(0.0)),
            ("-0e-5", number(-0.0)),
            ("0.000e999999999999999999", number(0.0)),
            ("1E400", None),
            ("-1e400", None),
            ("1e999999999999999999999", None),
            // The double, but not a number of I-JSON: it is not what
            // the double writes as.
            ("1e-400", inexact(0.0)),
            ("-1e-999999999999999999999", inexact(-0.0)),
            ("4.9e-324", inexact(f64::from_bits(1))),
            ("5e-324", number(f64::from_bits(1))),
            ("2.4703282292062327e-324", inexact(0.0)),
            ("2.4703282292062328e-324", inexact(f64::from_bits(1))),
            ("1.7976931348623157e308", number(f64::MAX)),
            ("1.7976931348623158e308", inexact(f64::MAX)),
            ("1.7976931348623159e308", None),
            ("9007199254740992", number(two53)),
            ("9007199254740993", inexact(two53)),
            ("-9007199254740993", inexact(-two53)),
            ("9007199254740993.0", inexact(two53)),
            ("9007199254740993e0", inexact(two53)),
            ("9007199254740994.0", number(two53 + 2.0)),
            (
                "9007199254740993.000000000000000000000000000001",
                inexact(two53 + 2.0),
            ),
            ("18446744073709551615", inexact(u64::MAX as f64)),
            // Past 64 bits serde_json reads a double: still an integer.
            ("18446744073709551616", inexact(2f64.powi(64))),
            ("-9223372036854775808", inexact(i64::MIN as f64)),
            // And so below -2^63, though it fits a u64.
            ("-9223372036854775809", inexact(-(2f64.powi(63)))),
            ("-18446744073709551615", inexact(-(u64::MAX as f64))),
            ("-18446744073709551616", inexact(-(2f64.powi(64)))),
            ("9".repeat(309).as_str(), None),
            ("9".repeat(308).as_str(), inexact(1e308)),
            ("1e308", number(1e308)),
            ("0.30000000000000004", number(0.1 + 0.2)),
            ("0.1000000000000000055511151231257827", inexact(0.1)),
            ("0.10000000000000000000", number(0.1)),
            ("123.456e-2", number(1.23456)),
            ("1E+2", number(100.0)),
            ("0.1", number(0.1)),
        ] {
            assert_eq!(root(json), seen, "{json}");
        }
        for json in [
            "01",
            "-01",
            "00",
            "-",
            "--1",
            "+1",
            "1.",
            ".5",
            "-.5",
            "1e",
            "1e+",
            "1E-",
            "1.e5",
            "0x10",
            "1_000",
            "NaN",
            "Infinity",
            "-Infinity",
            "1 2",
            "[1.]",
            "[-]",
            "[01]",
        ] {
            assert_eq!(root(json), None, "{json}");
        }
    }

    #[test]
    fn strings_read_as_serde_json_reads_them() {
        let owned = |s: &str| Some(Seen::Owned(s.to_owned()));
        let borrowed = |s: &str| Some(Seen::Borrowed(s.to_owned()));
        for (json, seen) in [
            (r#""""#, borrowed("")),
            ("\"é😀\u{7f}\u{2028}\"", borrowed("é😀\u{7f}\u{2028}")),
            (r#""\"\\\/\b\f\n\r\t""#, owned("\"\\/\u{8}\u{c}\n\r\t")),
            (r#""\u00e9\u00E9\u0000""#, owned("éé\0")),
            (r#""\uD83D\uDE00\ud83d\ude00""#, owned("😀😀")),
            (r#""\uDBFF\uDFFF""#, owned("\u{10ffff}")),
            (
                r#""a long plain run, then \n""#,
                owned("a long plain run, then \n"),
            ),
            (r#""\ud800""#, None),
            (r#""\udc00""#, None),
            (r#""\udc00\ud800""#, None),
            (r#""\ud800\ud800""#, None),
            (r#""\ud800\u0041""#, None),
            (r#""\ud800x\udc00""#, None),
            (r#""\ud800\n""#, None),
            (r#""\ud800\""#, None),
            (r#""\u12""#, None),
            (r#""\u12g4""#, None),
            (r#""\U0041""#, None),
            (r#""\x41""#, None),
            (r#""\'""#, None),
            ("\"\\\"", None),
            ("\"a\0\"", None),
            ("\"a\u{1f}\"", None),
            ("\"a\tb\"", None),
            ("\"a\nb\"", None),
            ("\"unterminated", None),
        ] {
            assert_eq!(root(json), seen, "{json:?}");
        }
    }

    #[test]
    fn records_in_arrays_sort_as_any_object() {
        let many = |from: usize| {
            let names = (0..17).map(|i| format!(r#""n{:02}":{i}"#, (i * 7 + from) % 17));
            format!("{{{}}}", names.collect::<Vec<_>>().join(","))
        };
        for json in [
            r#"[{"sku":1,"qty":2,"price":3},{"sku":4,"qty":5,"price":6},{"sku":7,"qty":8,"price":9}]"#,
            // Other orders, fewer names, more names.
            r#"[{"b":1,"a":2},{"a":1,"b":2},{"b":1},{"b":1,"a":2,"c":3},{"b":1,"a":2}]"#,
            // Names alike in their first eight bytes, within and across.
            r#"[{"customer_id":1,"customer_name":2},{"customer_id":3,"customer_name":4}]"#,
            r#"[{"b":0,"customer_a":1},{"b":0,"customer_z":1},{"b":0,"customer":1}]"#,
            r#"[{"\ue000":1,"😀":2,"é":3},{"\ue000":1,"😀":2,"é":3}]"#,
            // Records within records, and records past the ones remembered.
            r#"[{"y":{"d":1,"c":2},"x":1},{"y":{"d":1,"c":2},"x":1}]"#,
            &format!("[{},{},{}]", many(0), many(0), many(3)),
            // Objects in objects are sorted each time.
            r#"{"b":{"d":1,"c":2},"a":{"d":1,"c":2}}"#,
        ] {
            assert!(root(json).is_some(), "{json}");
        }
        for json in [
            r#"[{"b":1,"a":2},{"b":1,"b":2}]"#,
            r#"[{"b":1,"a":2},{"b":1,"a":2,"a":3}]"#,
            r#"[{"b":1,"a":2},{"b":1,"\u0061":2,"a":3}]"#,
            r#"[{"customer_id":1,"customer_name":2},{"customer_id":1,"customer_id":2}]"#,
        ] {
            assert_eq!(root(json), None, "{json}");
        }
    }

    #[test]
    fn only_json_text_is_accepted() {
        for json in [
            "",
            " ",
            "[1,]",
            "[,1]",
            "[1,,2]",
            "[1 2]",
            r#"{"a":1,}"#,
            r#"{,"a":1}"#,
            r#"{"a" 1}"#,
            r#"{"a":}"#,
            r#"{a:1}"#,
            "{'a':1}",
            "{1:1}",
            "[1]x",
            "[1]]",
            "[1}",
            r#"{"a":1]"#,
            "[",
            "{",
            "// c\n1",
            "/* c */ 1",
            "1 // c",
            "\u{feff}[]",
            "\u{c}[]",
            "[]\u{b}",
            "[\u{a0}]",
            "nul",
            "nulll",
            "True",
            "tru",
            "undefined",
        ] {
            assert_eq!(root(json), None, "{json:?}");
        }
        for json in [
            " \t\n\r[ \t\n\r1 \t\n\r] \t\n\r",
            "{ \"a\" : 1 , \"b\" : [ ] }",
            "null",
        ] {
            assert!(root(json).is_some(), "{json:?}");
        }
        assert!(Document::parse(b"[\"\xff\"]").is_err());
        assert!(Document::parse(b"\"\xed\xa0\x80\"").is_err());
    }

    /// Number literals, good and bad: edge values, random decimals, the
    /// shortest and the full expansion of random doubles.
    fn number_text() -> impl Strategy<Value = String> {
        prop_oneof![
            select(vec![
                "0",
                "-0",
                "-0.0",
                "0e5",
                "1E400",
                "1e-400",
                "-9223372036854775808",
                "-9223372036854775809",
                "18446744073709551615",
                "18446744073709551616",
                "9007199254740993",
                "9007199254740993.0",
                "2.4703282292062327e-324",
                "2.4703282292062328e-324",
                "1.7976931348623158e308",
                "1.7976931348623159e308",
                "01",
                "-",
                "1.",
                ".5",
                "1e",
                "+1",
                "-01",
                "1e+",
                "NaN",
                "Infinity",
            ])
            .prop_map(String::from),
            "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,24})?([eE][-+]?[0-9]{1,3})?",
            "-?[0-9]{1,3}(\\.[0-9]{0,3})?([eE][-+]?[0-9]{0,12})?",
            "[-+.eE0-9]{1,12}",
            any::<f64>().prop_map(|f| f.to_string()),
            any::<f64>().prop_map(|f| format!("{f:e}")),
            any::<f64>().prop_map(|f| format!("{f:.30e}")),
            any::<i64>().prop_map(|i| i.to_string()),
            any::<u64>().prop_map(|u| u.to_string()),
            (any::<u64>(), 1usize..30).prop_map(|(u, zeros)| format!("{u}{}", "0".repeat(zeros))),
            // Halfway between two doubles, then maybe a digit that decides.
            (0u64..1 << 11, 0usize..40, "[0-9]").prop_map(|(k, zeros, d)| {
                format!("{}.{}{d}", (1u64 << 53) + 2 * k + 1, "0".repeat(zeros))
            }),
        ]
    }

    /// Number literals a document holds, mostly good.
    fn value_number() -> impl Strategy<Value = String> {
        prop_oneof![
            6 => "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,24})?([eE][-+]?[0-9]{1,2})?",
            2 => any::<i64>().prop_map(|i| i.to_string()),
            2 => any::<f64>().prop_map(|f| format!("{f:e}")),
            1 => number_text(),
        ]
    }

    /// String literals with plain runs, every escape and surrogate pairs;
    /// with `odd`, also bad escapes, lone or misordered surrogates and raw
    /// control characters.
    fn string_text(odd: bool) -> BoxedStrategy<String> {
        let good = prop_oneof![
            4 => "[a-z ]{1,12}",
            3 => select(vec![
                "\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "é", "😀", "\u{e000}",
                "\u{ffff}", "\u{10ffff}", "\u{2028}", "\u{7f}",
            ])
            .prop_map(String::from),
            2 => "\\\\u(00[0-9a-fA-F]{2}|[0-9a-cA-CeEfF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})",
            1 => "\\\\u[dD][89abAB][0-9a-fA-F]{2}\\\\u[dD][c-fC-F][0-9a-fA-F]{2}",
        ];
        let piece = if odd {
            prop_oneof![
                6 => good,
                1 => "\\\\u[dD][89abAB][0-9a-fA-F]{2}",
                1 => "\\\\u[dD][c-fC-F][0-9a-fA-F]{2}",
                1 => "\\\\u[0-9a-fA-FgG]{0,4}",
                1 => "\\\\[a-zA-Z0-9'/ ]",
                1 => "[\\x00-\\x1f]",
                1 => Just("\\".to_owned()),
            ]
            .boxed()
        } else {
            good.boxed()
        };
        prop::collection::vec(piece, 0..6)
            .prop_map(|pieces| format!("\"{}\"", pieces.concat()))
            .boxed()
    }

    /// Member names: some from few spellings, so that duplicates show up.
    fn name_text(odd: bool) -> BoxedStrategy<String> {
        let names = vec![
            "\"a\"",
            "\"\\u0061\"",
            "\"b\"",
            "\"\"",
            "\"😀\"",
            "\"\\ud83d\\ude00\"",
            "\"\u{e000}\"",
        ];
        if odd {
            prop_oneof![
                2 => select(names).prop_map(String::from),
                6 => string_text(true),
                1 => select(vec!["a", "1", "null", "'a'", "[]"]).prop_map(String::from),
            ]
            .boxed()
        } else {
            prop_oneof![1 => select(names).prop_map(String::from), 6 => string_text(false)].boxed()
        }
    }

    fn space(odd: bool) -> BoxedStrategy<&'static str> {
        let good = prop_oneof![
            3 => Just(""),
            1 => select(vec![" ", "\n", "\t", "\r", " \r\n\t "]),
        ];
        if odd {
            prop_oneof![
                10 => good,
                1 => select(vec!["\u{b}", "\u{c}", "\u{a0}", "\u{feff}", "/**/", "//\n", "\0"]),
            ]
            .boxed()
        } else {
            good.boxed()
        }
    }

    fn separator(odd: bool) -> BoxedStrategy<&'static str> {
        if odd {
            prop_oneof![10 => Just(","), 1 => select(vec!["", ",,", ";", ", ,"])].boxed()
        } else {
            Just(",").boxed()
        }
    }

    /// JSON-like text: valid JSON unless `odd`, which mixes in tokens that
    /// break it here and there: bad literals, numbers, strings, names,
    /// separators, whitespace and trailing commas.
    fn json_text(odd: bool) -> impl Strategy<Value = String> {
        let literals = vec!["null", "true", "false"];
        let leaf = if odd {
            prop_oneof![
                4 => select(literals).prop_map(String::from),
                1 => select(vec!["nul", "tru", "nulll", "True", "NaN", "undefined", "'a'", ""])
                    .prop_map(String::from),
                6 => value_number(),
                2 => number_text(),
                8 => string_text(odd),
            ]
            .boxed()
        } else {
            prop_oneof![
                1 => select(literals).prop_map(String::from),
                2 => value_number(),
                3 => string_text(odd),
            ]
            .boxed()
        };
        leaf.prop_recursive(5, 64, 6, move |inner| {
            let element = (space(odd), inner.clone(), space(odd), separator(odd));
            let colon = if odd {
                prop_oneof![20 => Just(":"), 1 => Just("")].boxed()
            } else {
                Just(":").boxed()
            };
            let member = (
                (space(odd), name_text(odd), space(odd), colon),
                (inner, space(odd), separator(odd)),
            );
            let trailing = if odd {
                prop_oneof![20 => Just(""), 1 => Just(",")].boxed()
            } else {
                Just("").boxed()
            };
            prop_oneof![
                (prop::collection::vec(element, 0..6), trailing.clone()).prop_map(
                    |(items, trailing)| {
                        let last = items.len();
                        let mut out = String::from("[");
                        for (i, (a, value, b, sep)) in items.into_iter().enumerate() {
                            out.push_str(a);
                            out.push_str(&value);
                            out.push_str(b);
                            if i + 1 < last {
                                out.push_str(sep);
                            }
                        }
                        out.push_str(trailing);
                        out.push(']');
                        out
                    }
                ),
                (prop::collection::vec(member, 0..6), trailing).prop_map(|(members, trailing)| {
                    let last = members.len();
                    let mut out = String::from("{");
                    for (i, ((a, name, b, colon), (value, c, sep))) in
                        members.into_iter().enumerate()
                    {
                        out.push_str(a);
                        out.push_str(&name);
                        out.push_str(b);
                        out.push_str(colon);
                        out.push_str(&value);
                        out.push_str(c);
                        if i + 1 < last {
                            out.push_str(sep);
                        }
                    }
                    out.push_str(trailing);
                    out.push('}');
                    out
                }),
            ]
        })
    }

    /// Damage done to a text after it is built: cut short, a byte put in,
    /// taken out or changed.
    #[derive(Clone, Debug)]
    enum Damage {
        Truncate(Index),
        Insert(Index, u8),
        Remove(Index),
        Replace(Index, u8),
    }

    fn damage() -> impl Strategy<Value = Vec<Damage>> {
        let byte = prop_oneof![
            3 => select(b"\"\\,:[]{}0-.eE \n\x00\x1f\x7f\x80\xff/u".to_vec()),
            1 => any::<u8>(),
        ];
        let one = prop_oneof![
            any::<Index>().prop_map(Damage::Truncate),
            (any::<Index>(), byte.clone()).prop_map(|(i, b)| Damage::Insert(i, b)),
            any::<Index>().prop_map(Damage::Remove),
            (any::<Index>(), byte).prop_map(|(i, b)| Damage::Replace(i, b)),
        ];
        prop_oneof![
            3 => Just(Vec::new()),
            2 => prop::collection::vec(one, 1..3),
        ]
    }

    fn damaged(text: String, damage: &[Damage]) -> Vec<u8> {
        let mut bytes = text.into_bytes();
        for d in damage {
            let len = bytes.len();
            match *d {
                Damage::Truncate(i) => bytes.truncate(i.index(len + 1)),
                Damage::Insert(i, b) => bytes.insert(i.index(len + 1), b),
                Damage::Remove(i) if len > 0 => {
                    bytes.remove(i.index(len));
                }
                Damage::Replace(i, b) if len > 0 => {
                    if let Some(at) = bytes.get_mut(i.index(len)) {
                        *at = b;
                    }
                }
                Damage::Remove(_) | Damage::Replace(..) => {}
            }
        }
        bytes
    }

    /// How a record differs from the first of its array.
    #[derive(Clone, Debug)]
    enum Change {
        Same,
        Swap(Index, Index),
        Drop(Index),
        Repeat(Index),
        Rename(Index, Index),
    }

    /// Member names for records: some alike in their first eight bytes,
    /// some spelled two ways, and enough for records past [`LAST_MAX`].
    fn record_names() -> Vec<String> {
        let spelled = [
            "a",
            "\\u0061",
            "b",
            "sku",
            "qty",
            "customer",
            "customer_id",
            "customer_name",
            "aaaaaaaa",
            "aaaaaaaab",
            "\u{e000}",
            "😀",
            "\\ud83d\\ude00",
            "é",
            "",
        ];
        let numbered = (0..20).map(|i| format!("f{i:02}"));
        spelled
            .iter()
            .map(|&s| s.to_owned())
            .chain(numbered)
            .collect()
    }

    /// Arrays of records: objects with the first one's names, as they
    /// are, in another order, with one left out, repeated or renamed.
    fn records_text() -> impl Strategy<Value = String> {
        let change = prop_oneof![
            6 => Just(Change::Same),
            1 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| Change::Swap(i, j)),
            1 => any::<Index>().prop_map(Change::Drop),
            1 => any::<Index>().prop_map(Change::Repeat),
            1 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| Change::Rename(i, j)),
        ];
        let value = select(vec![
            "1",
            "\"x\"",
            "[]",
            "{}",
            r#"{"k":1,"j":2}"#,
            r#"[{"k":1,"j":2}]"#,
        ]);
        (
            prop::sample::subsequence(record_names(), 1..24).prop_shuffle(),
            prop::collection::vec((change, value), 1..6),
        )
            .prop_map(|(first, records)| {
                let pool = record_names();
                let records: Vec<String> = records
                    .into_iter()
                    .map(|(change, value)| {
                        let mut names = first.clone();
                        let len = names.len();
                        match change {
                            Change::Same => {}
                            Change::Swap(i, j) => names.swap(i.index(len), j.index(len)),
                            Change::Drop(i) => {
                                names.remove(i.index(len));
                            }
                            Change::Repeat(i) => {
                                let name = names.get(i.index(len)).cloned().unwrap_or_default();
                                names.push(name);
                            }
                            Change::Rename(i, j) => {
                                if let (Some(slot), Some(name)) =
                                    (names.get_mut(i.index(len)), pool.get(j.index(pool.len())))
                                {
                                    slot.clone_from(name);
                                }
                            }
                        }
                        let members: Vec<String> = names
                            .iter()
                            .map(|name| format!("\"{name}\":{value}"))
                            .collect();
                        format!("{{{}}}", members.join(","))
                    })
                    .collect();
                format!("[{}]", records.join(","))
            })
    }

    /// Containers nested around the depth limit, arrays and objects mixed.
    fn nested_text() -> impl Strategy<Value = String> {
        (
            prop::collection::vec(any::<bool>(), 118..134),
            select(vec!["0", "[]", "{}", "[[]]", "\"x\"", "", "[1,]"]),
        )
            .prop_map(|(levels, inner)| {
                let mut out = String::new();
                for &object in &levels {
                    out.push_str(if object { "{\"k\":" } else { "[" });
                }
                out.push_str(inner);
                for &object in levels.iter().rev() {
                    out.push(if object { '}' } else { ']' });
                }
                out
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Valid JSON text, now and then damaged in a place or two.
        #[test]
        fn agrees_with_serde_json_on_json_text(
            text in (space(false), json_text(false), space(false))
                .prop_map(|(a, v, b)| format!("{a}{v}{b}")),
            damage in damage(),
        ) {
            agrees(&damaged(text, &damage))?;
        }

        #[test]
        fn agrees_with_serde_json_on_odd_tokens(
            text in (space(true), json_text(true), space(true))
                .prop_map(|(a, v, b)| format!("{a}{v}{b}")),
        ) {
            agrees(text.as_bytes())?;
        }

        #[test]
        fn agrees_with_serde_json_on_numbers(
            text in (number_text(), space(true)).prop_map(|(n, s)| format!("[{n}{s}]")),
            damage in damage(),
        ) {
            agrees(&damaged(text, &damage))?;
        }

        #[test]
        fn agrees_with_serde_json_on_records(text in records_text(), damage in damage()) {
            agrees(&damaged(text, &damage))?;
        }

        #[test]
        fn agrees_with_serde_json_on_deep_nesting(text in nested_text(), damage in damage()) {
            agrees(&damaged(text, &damage))?;
        }

        #[test]
        fn agrees_with_serde_json_on_arbitrary_bytes(
            bytes in prop_oneof![
                prop::collection::vec(any::<u8>(), 0..64),
                prop::collection::vec(
                    select(b"[]{}\",:0123456789-+.eE \\ubfnrtl\x00\xc3\xa9".to_vec()),
                    0..48,
                ),
            ],
        ) {
            agrees(&bytes)?;
        }
    }
}
