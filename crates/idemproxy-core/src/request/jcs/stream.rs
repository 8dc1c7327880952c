//! The canonical form written while parsing, for bodies without ignore
//! pointers: no [`Document`](super::Document), no tape.
//!
//! Scalars and arrays are final as they are read: each is written in its
//! canonical form straight into the output, most of them as a copy of
//! their text (a string without escapes between its quotes, an integer up
//! to 2^53, a short decimal without an exponent or trailing zeros). An
//! object's members are written as they come too, each remembered by its
//! name and where its bytes start; when the object closes, and only if its
//! members came out of order, the bytes of the members that moved are put
//! back in order, in place. Nothing else is buffered: the output is the
//! canonical form, which the fingerprint hashes in one call.
//!
//! It accepts exactly what [`Document::parse`](super::Document::parse)
//! accepts and then finds exact ([`Document::is_exact`](super::Document::is_exact)),
//! and writes the same bytes as [`Document::write`](super::Document::write):
//! the differential tests of `parse.rs` hold it to both on every text they
//! make, and the reference implementation's tests in `mod.rs` to
//! `serde_json_canonicalizer`.

use std::cell::RefCell;
use std::cmp::Ordering;

use super::parse::{read_number, MAX_DEPTH};
use super::scan::{error, escaped, plain_run, skip_space, sort_key, ParseError};
use super::utf16_cmp;
use super::write::{write_number, write_string};

/// The buffers of one canonicalization, kept between bodies.
#[derive(Debug, Default)]
pub(crate) struct Canonical {
    /// The canonical form of the last body canonicalized.
    out: Vec<u8>,
    /// The members of the objects still open, innermost last.
    members: Vec<Member>,
    /// For each open container, whether it is an object and where its
    /// members start in `members`.
    open: Vec<(bool, usize)>,
    /// Member names that had escapes, decoded.
    names: String,
    /// Where each member of the object being closed started, in the order
    /// they came.
    starts: Vec<usize>,
    /// The bytes of the members being put in order.
    moved: Vec<u8>,
}

/// A member of an open object: its name, by its [`sort_key`] and where the
/// name is (the body, or `names` if it had escapes), and where its bytes,
/// name first, start in the output (`end` is known once the next one
/// starts or the object closes).
#[derive(Clone, Copy, Debug)]
struct Member {
    key: u64,
    name: (usize, usize),
    decoded: bool,
    start: usize,
    end: usize,
}

thread_local! {
    static CANONICAL: RefCell<Canonical> = RefCell::new(Canonical::default());
}

/// `then` of the canonical form of `body`, or `None` when `body` is not
/// I-JSON; the buffers are the thread's, reused from body to body.
pub(crate) fn with_canonical<R>(body: &[u8], then: impl FnOnce(&[u8]) -> R) -> Option<R> {
    CANONICAL.with(|cell| match cell.try_borrow_mut() {
        Ok(mut canonical) => canonical.write(body).ok().map(then),
        // Only if canonicalizing ever ran inside itself: buffers of its
        // own rather than a panic.
        Err(_) => Canonical::default().write(body).ok().map(then),
    })
}

impl Canonical {
    /// Parses `body` as I-JSON and writes its canonical form, which it
    /// returns; an error if `body` is not JSON text, has duplicate names
    /// or a number whose canonical form is not its value.
    pub(crate) fn write(&mut self, body: &[u8]) -> Result<&[u8], ParseError> {
        let text = std::str::from_utf8(body).map_err(|e| error(e.valid_up_to(), "not UTF-8"))?;
        self.out.clear();
        self.members.clear();
        self.open.clear();
        self.names.clear();
        self.document(text)?;
        Ok(&self.out)
    }

    /// The whole body: one value, whitespace around it. The same loop as
    /// `Parser::document`'s, writing where that one pushes onto the tape.
    fn document(&mut self, text: &str) -> Result<(), ParseError> {
        let bytes = text.as_bytes();
        let mut at = 0;
        let mut in_object = false;
        loop {
            at = skip_space(bytes, at);
            match bytes.get(at) {
                Some(b'"') => at = self.string(text, at + 1)?,
                Some(b'-' | b'0'..=b'9') => at = self.number(text, at)?,
                Some(b'[' | b'{') if self.open.len() == MAX_DEPTH => {
                    return Err(error(at, "nested too deep"));
                }
                Some(b'[') => {
                    self.out.push(b'[');
                    at = skip_space(bytes, at + 1);
                    if bytes.get(at) != Some(&b']') {
                        self.open.push((false, 0));
                        in_object = false;
                        continue;
                    }
                    at += 1;
                    self.out.push(b']');
                }
                Some(b'{') => {
                    self.out.push(b'{');
                    at = skip_space(bytes, at + 1);
                    if bytes.get(at) != Some(&b'}') {
                        self.open.push((true, self.members.len()));
                        in_object = true;
                        at = self.member_name(text, at)?;
                        continue;
                    }
                    at += 1;
                    self.out.push(b'}');
                }
                Some(b't') => at = self.literal(bytes, at, b"true")?,
                Some(b'f') => at = self.literal(bytes, at, b"false")?,
                Some(b'n') => at = self.literal(bytes, at, b"null")?,
                _ => return Err(error(at, "expected a value")),
            }
            // A value ended here: a separator follows, or the end of its
            // container, which is a value that ended too.
            loop {
                at = skip_space(bytes, at);
                let Some(&(_, first)) = self.open.last() else {
                    return match bytes.get(at) {
                        None => Ok(()),
                        Some(_) => Err(error(at, "trailing characters")),
                    };
                };
                match (bytes.get(at), in_object) {
                    (Some(b','), false) => {
                        self.out.push(b',');
                        at += 1;
                        break;
                    }
                    (Some(b','), true) => {
                        self.out.push(b',');
                        at = self.member_name(text, skip_space(bytes, at + 1))?;
                        break;
                    }
                    (Some(b']'), false) => {
                        at += 1;
                        self.out.push(b']');
                    }
                    (Some(b'}'), true) => {
                        at += 1;
                        self.close_object(text, first, at)?;
                        self.out.push(b'}');
                    }
                    _ => return Err(error(at, "expected `,` or the end of the container")),
                }
                self.open.pop();
                in_object = matches!(self.open.last(), Some((true, _)));
            }
        }
    }

    #[inline(always)]
    fn literal(&mut self, bytes: &[u8], at: usize, word: &[u8]) -> Result<usize, ParseError> {
        let end = at + word.len();
        if bytes.get(at..end) != Some(word) {
            return Err(error(at, "expected a value"));
        }
        self.out.extend_from_slice(word);
        Ok(end)
    }

    /// A string value from `start`, just after its opening quote; the
    /// position after its closing quote. Without escapes, its text with
    /// its quotes is its canonical form.
    #[inline(always)]
    fn string(&mut self, text: &str, start: usize) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        let stop = plain_run(bytes, start);
        if bytes.get(stop) == Some(&b'"') {
            if let Some(quoted) = bytes.get(start - 1..=stop) {
                self.out.extend_from_slice(quoted);
                return Ok(stop + 1);
            }
        }
        let (s, next) = escaped(text, start, stop)?;
        write_string(&s, &mut self.out);
        Ok(next)
    }

    /// An object member's name at `at`, and the colon after it: written,
    /// and remembered as a member of the innermost object; the position
    /// after the colon.
    #[inline(always)]
    fn member_name(&mut self, text: &str, at: usize) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        if bytes.get(at) != Some(&b'"') {
            return Err(error(at, "expected a member name"));
        }
        let start = at + 1;
        let member_start = self.out.len();
        let stop = plain_run(bytes, start);
        let (key, name, decoded, next) = match bytes.get(start - 1..=stop) {
            Some(quoted) if bytes.get(stop) == Some(&b'"') => {
                self.out.extend_from_slice(quoted);
                let name = bytes.get(start..stop).unwrap_or_default();
                (sort_key(name), (start, stop), false, stop + 1)
            }
            _ => {
                let (s, next) = escaped(text, start, stop)?;
                write_string(&s, &mut self.out);
                let from = self.names.len();
                self.names.push_str(&s);
                (sort_key(s.as_bytes()), (from, self.names.len()), true, next)
            }
        };
        if let Some(previous) = self.members.last_mut() {
            // The member before it in the same object ends at the comma;
            // one of an outer object is given its end again on closing.
            previous.end = member_start.saturating_sub(1);
        }
        self.members.push(Member {
            key,
            name,
            decoded,
            start: member_start,
            end: 0,
        });
        let at = skip_space(bytes, next);
        if bytes.get(at) != Some(&b':') {
            return Err(error(at, "expected `:`"));
        }
        self.out.push(b':');
        Ok(at + 1)
    }

    /// A number at `start`; the position after it. Integers up to 2^53 and
    /// decimals of at most 15 digits without an exponent are written as
    /// they are (see [`short_literal`]); the rest are read as doubles and
    /// written as `Document::write` writes them.
    #[inline(always)]
    fn number(&mut self, text: &str, start: usize) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        if let Some(end) = short_literal(bytes, start) {
            if let Some(literal) = bytes.get(start..end) {
                self.out.extend_from_slice(literal);
                return Ok(end);
            }
        }
        let (value, exact, end) = read_number(text, start)?;
        if !exact {
            return Err(error(
                start,
                "a number whose canonical form is not its value",
            ));
        }
        write_number(value, &mut self.out);
        Ok(end)
    }

    /// Ends the object whose members start at `first` in `members`:
    /// refuses duplicate names, and puts the members in order if they are
    /// not. `at` is only for the error.
    fn close_object(&mut self, text: &str, first: usize, at: usize) -> Result<(), ParseError> {
        let end = self.out.len();
        let Canonical {
            out,
            members,
            names,
            starts,
            moved,
            ..
        } = self;
        let own = members.get_mut(first..).unwrap_or_default();
        if let Some(last) = own.last_mut() {
            last.end = end;
        }
        let name = |m: &Member| -> &str {
            let (from, to) = m.name;
            let source = if m.decoded { names.as_str() } else { text };
            source.get(from..to).unwrap_or_default()
        };
        let compare =
            |a: &Member, b: &Member| a.key.cmp(&b.key).then_with(|| utf16_cmp(name(a), name(b)));
        let mut in_order = true;
        for pair in own.windows(2) {
            if let [a, b] = pair {
                match compare(a, b) {
                    Ordering::Less => {}
                    Ordering::Equal => return Err(error(at, "duplicate object key")),
                    Ordering::Greater => {
                        in_order = false;
                        break;
                    }
                }
            }
        }
        if !in_order {
            starts.clear();
            starts.extend(own.iter().map(|m| m.start));
            own.sort_unstable_by(compare);
            for pair in own.windows(2) {
                if let [a, b] = pair {
                    if a.key == b.key && name(a) == name(b) {
                        return Err(error(at, "duplicate object key"));
                    }
                }
            }
            reorder(out, own, starts, moved);
        }
        members.truncate(first);
        Ok(())
    }
}

/// Rewrites the bytes of an object's members, sorted in `own`, in that
/// order; `starts` are where they started, in the order they came. Only
/// the members between the first and the last that moved are rewritten.
fn reorder(out: &mut [u8], own: &[Member], starts: &[usize], moved: &mut Vec<u8>) {
    let same = |&(m, &start): &(&Member, &usize)| m.start == start;
    let lead = own.iter().zip(starts).take_while(same).count();
    let trail = own.iter().zip(starts).rev().take_while(same).count();
    let (Some(first), Some(last)) = (
        starts.get(lead),
        own.len().checked_sub(trail + 1).and_then(|i| own.get(i)),
    ) else {
        return;
    };
    // The last member rewritten is the last of those that came, in the
    // order they came, among the ones rewritten: the one ending latest.
    let end = own
        .get(lead..own.len() - trail)
        .unwrap_or_default()
        .iter()
        .map(|m| m.end)
        .max()
        .unwrap_or(last.end);
    let from = *first;
    let Some(region) = out.get_mut(from..end) else {
        return;
    };
    moved.clear();
    moved.extend_from_slice(region);
    let mut at = 0;
    let rewritten = own.get(lead..own.len() - trail).unwrap_or_default();
    for (i, m) in rewritten.iter().enumerate() {
        if i > 0 {
            if let Some(comma) = region.get_mut(at) {
                *comma = b',';
            }
            at += 1;
        }
        let len = m.end - m.start;
        if let (Some(dst), Some(src)) = (
            region.get_mut(at..at + len),
            moved.get(m.start - from..m.end - from),
        ) {
            dst.copy_from_slice(src);
        }
        at += len;
    }
}

/// Where the number at `start` ends if its text is its canonical form
/// and it is exact: an integer of at most 2^53 but `-0`, or a decimal with
/// at most 15 digits in all, no exponent, no trailing zero, and not below
/// 10^-6 (where ECMAScript writes an exponent); `None` for anything else,
/// valid or not, which [`read_number`] reads.
///
/// Such a decimal is the only one of at most 15 significant digits that
/// reads as its double (`DBL_DIG`), so it is the shortest that does, which
/// is what `Number.prototype.toString` writes, and at 10^-6 and up and
/// below 10^21 it writes it without an exponent, with the digits of the
/// literal.
#[inline(always)]
fn short_literal(bytes: &[u8], start: usize) -> Option<usize> {
    let negative = bytes.get(start) == Some(&b'-');
    let int_start = start + usize::from(negative);
    let mut at = int_start;
    let mut value = 0u64;
    while let Some(&b) = bytes.get(at) {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        value = value.wrapping_mul(10).wrapping_add(u64::from(d));
        at += 1;
    }
    let int_digits = at - int_start;
    if int_digits == 0 || int_digits > 16 || int_digits > 1 && bytes.get(int_start) == Some(&b'0') {
        return None;
    }
    match bytes.get(at) {
        Some(b'.') => {
            let first = at + 1;
            let mut end = first;
            while let Some(b'0'..=b'9') = bytes.get(end) {
                end += 1;
            }
            let places = end - first;
            let last = bytes.get(end.checked_sub(1)?)?;
            if places == 0 || int_digits + places > 15 || *last == b'0' {
                return None;
            }
            if matches!(bytes.get(end), Some(b'e' | b'E')) {
                return None;
            }
            if value == 0 {
                // `0.` then at most five zeros before a digit.
                let zeros = bytes
                    .get(first..end)?
                    .iter()
                    .take_while(|&&b| b == b'0')
                    .count();
                if zeros > 5 {
                    return None;
                }
            }
            Some(end)
        }
        Some(b'e' | b'E') => None,
        // `-0` writes as `0`.
        _ => (value <= 1 << 53 && !(negative && value == 0)).then_some(at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(json: &str) -> Option<String> {
        let mut c = Canonical::default();
        c.write(json.as_bytes())
            .ok()
            .map(|out| String::from_utf8_lossy(out).into_owned())
    }

    #[test]
    fn members_out_of_order_are_moved_only_as_far_as_needed() {
        for (json, expected) in [
            (r#"{"b":1,"a":2}"#, r#"{"a":2,"b":1}"#),
            (
                r#"{"a":1,"c":[3,{"z":0,"y":1}],"b":2}"#,
                r#"{"a":1,"b":2,"c":[3,{"y":1,"z":0}]}"#,
            ),
            (
                r#"{"x":0,"b":1,"a":2,"y":3}"#,
                r#"{"a":2,"b":1,"x":0,"y":3}"#,
            ),
            (
                r#"{"d":{"b":1,"a":[]},"c":"q","e":null}"#,
                r#"{"c":"q","d":{"a":[],"b":1},"e":null}"#,
            ),
            (
                r#"[{"b\u0000":1,"b":2},{"\u0062":3,"a":4}]"#,
                "[{\"b\":2,\"b\\u0000\":1},{\"a\":4,\"b\":3}]",
            ),
        ] {
            assert_eq!(canonical(json).as_deref(), Some(expected), "{json}");
        }
    }

    #[test]
    fn duplicates_are_refused_in_order_or_not() {
        for json in [
            r#"{"a":1,"a":2}"#,
            r#"{"b":1,"a":2,"b":3}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"[{"k":{"x":1,"x":1}}]"#,
        ] {
            assert_eq!(canonical(json), None, "{json}");
        }
    }

    #[test]
    fn literals_written_as_they_are_are_their_canonical_form() {
        for (json, expected) in [
            (
                "[1,-1,0,-0,9007199254740992,-9007199254740992]",
                "[1,-1,0,0,9007199254740992,-9007199254740992]",
            ),
            (
                "[3.01,-0.5,0.000001,0.0000001,123456789012.345]",
                "[3.01,-0.5,0.000001,1e-7,123456789012.345]",
            ),
            (
                "[1.50,1.0,1e2,0.0,-0.0,1234567890123.456]",
                "[1.5,1,100,0,0,1234567890123.456]",
            ),
        ] {
            assert_eq!(canonical(json).as_deref(), Some(expected), "{json}");
        }
        for json in [
            "[9007199254740993]",
            "[1.00000000000000000001]",
            "[1e-400]",
            "[01]",
            "[1.]",
            "[-]",
        ] {
            assert_eq!(canonical(json), None, "{json}");
        }
    }
}
