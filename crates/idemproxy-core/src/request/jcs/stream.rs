//! The canonical form written while parsing, for bodies without ignore
//! pointers: no [`Document`](super::Document), no tape.
//!
//! Most of a body is its own canonical form: strings without escapes
//! (with their quotes), integers up to 2^53, short decimals without an
//! exponent or trailing zeros, punctuation. That text is not copied token
//! by token: the writer keeps where the pending run of it starts, and
//! copies it in one piece when something else must be written (after
//! whitespace, at an escape, at a number written anew) or at the end.
//! An object's members are remembered by their names and where their
//! bytes start and end in the canonical form; when the object closes,
//! and only if its members came out of order, those between the first and
//! the last that move are put in order, copied straight from the body if
//! they are all in the pending run, in place in the output otherwise.
//! The output is the canonical form, which the fingerprint hashes in one
//! call.
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
use super::scan::{error, escaped, plain_run, skip_space, sort_key, utf16_key, ParseError};
use super::utf16_cmp;
use super::write::{write_number, write_string};

/// The buffers of one canonicalization, kept between bodies.
#[derive(Debug, Default)]
pub(crate) struct Canonical {
    /// The canonical form of the body so far, but for the pending run.
    out: Vec<u8>,
    /// Where the pending run starts in the body: the text from there on
    /// read so far is its own canonical form, not yet copied to `out`.
    /// Positions in the canonical form (the members' `start` and `end`)
    /// below `out.len()` are in `out`; a position `p` from it on is in the
    /// run, at `run + (p - out.len())` in the body.
    run: usize,
    /// The members of the objects still open, innermost last.
    members: Vec<Member>,
    /// For each open container, whether it is an object and where its
    /// members start in `members`.
    open: Vec<(bool, usize)>,
    /// Member names that had escapes, decoded.
    names: String,
    /// The order of the members of the object being closed: the index,
    /// in the order they came, of each in sorted order.
    order: Vec<usize>,
    /// The keys of the last object in an array sorted whose keys all
    /// differ, and the order they sorted in. Records repeat their names in the same order,
    /// and the same keys, all different, sort the same way: a comparison
    /// per name instead of a sort.
    last_keys: Vec<u64>,
    last_order: Vec<usize>,
    /// The bytes of the members being put in order, when they are in
    /// `out` already.
    moved: Vec<u8>,
}

/// A member of an open object: its name, by its [`sort_key`] and where the
/// name is (the body, or `names` if it had escapes), and where its bytes,
/// name first, start and end in the canonical form (`end` is known once
/// the next one starts or the object closes).
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
        self.run = 0;
        self.members.clear();
        self.open.clear();
        self.names.clear();
        let end = self.document(text)?;
        self.flush(body, end);
        Ok(&self.out)
    }

    /// Copies the pending run, up to `to` in the body, to `out`.
    #[inline(always)]
    fn flush(&mut self, bytes: &[u8], to: usize) {
        self.out
            .extend_from_slice(bytes.get(self.run..to).unwrap_or_default());
        self.run = to;
    }

    /// Where the body's position `at`, in the pending run, is in the
    /// canonical form.
    #[inline(always)]
    fn pos(&self, at: usize) -> usize {
        self.out.len() + (at - self.run)
    }

    /// Ends the last member of the innermost object at `at`, its comma or
    /// closing brace.
    #[inline(always)]
    fn end_member(&mut self, at: usize) {
        let end = self.pos(at);
        if let Some(member) = self.members.last_mut() {
            member.end = end;
        }
    }

    /// Skips whitespace from `at` on, which ends the pending run. One
    /// comparison when there is none: every byte up to a space is
    /// whitespace or a control character, which no JSON text has outside
    /// strings (and which `skip_space` does not skip).
    #[inline(always)]
    fn space(&mut self, bytes: &[u8], at: usize) -> usize {
        match bytes.get(at) {
            Some(&b) if b <= b' ' => self.skip_space(bytes, at),
            _ => at,
        }
    }

    #[inline(never)]
    fn skip_space(&mut self, bytes: &[u8], at: usize) -> usize {
        self.flush(bytes, at);
        self.run = skip_space(bytes, at);
        self.run
    }

    /// The whole body: one value, whitespace around it; where it ends.
    /// The same loop as `Parser::document`'s, where most values are their
    /// own canonical form and need nothing done.
    fn document(&mut self, text: &str) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        let mut at = 0;
        // Whether the innermost open container is an object, and how many
        // are open (`open`'s length, kept where it is read fastest).
        let mut in_object = false;
        let mut depth = 0;
        loop {
            // A value starts here, or whitespace before it.
            match bytes.get(at) {
                Some(b'"') => at = self.string(text, at + 1)?,
                Some(b'-' | b'0'..=b'9') => at = self.number(text, at)?,
                Some(b'[' | b'{') if depth == MAX_DEPTH => {
                    return Err(error(at, "nested too deep"));
                }
                Some(b'[') => {
                    at = self.space(bytes, at + 1);
                    if bytes.get(at) != Some(&b']') {
                        self.open.push((false, 0));
                        (in_object, depth) = (false, depth + 1);
                        continue;
                    }
                    at += 1;
                }
                Some(b'{') => {
                    at = self.space(bytes, at + 1);
                    if bytes.get(at) != Some(&b'}') {
                        self.open.push((true, self.members.len()));
                        (in_object, depth) = (true, depth + 1);
                        at = self.member_name(text, at)?;
                        continue;
                    }
                    at += 1;
                }
                Some(b't') => at = literal(bytes, at, b"true")?,
                Some(b'f') => at = literal(bytes, at, b"false")?,
                Some(b'n') => at = literal(bytes, at, b"null")?,
                Some(b' ' | b'\n' | b'\t' | b'\r') => {
                    at = self.skip_space(bytes, at);
                    continue;
                }
                _ => return Err(error(at, "expected a value")),
            }
            // A value ended here: a separator follows, or the end of its
            // container, which is a value that ended too, or whitespace.
            loop {
                match (bytes.get(at), in_object) {
                    (Some(b','), false) if depth > 0 => {
                        at += 1;
                        break;
                    }
                    (Some(b','), true) => {
                        self.end_member(at);
                        at = self.space(bytes, at + 1);
                        at = self.member_name(text, at)?;
                        break;
                    }
                    (Some(b']'), false) if depth > 0 => at += 1,
                    (Some(b'}'), true) => {
                        self.end_member(at);
                        let first = self.open.last().map_or(0, |&(_, first)| first);
                        self.close_object(text, first, at)?;
                        at += 1;
                    }
                    (Some(b' ' | b'\n' | b'\t' | b'\r'), _) => {
                        at = self.skip_space(bytes, at);
                        continue;
                    }
                    (None, _) if depth == 0 => return Ok(at),
                    _ if depth == 0 => return Err(error(at, "trailing characters")),
                    _ => return Err(error(at, "expected `,` or the end of the container")),
                }
                self.open.pop();
                depth -= 1;
                in_object = matches!(self.open.last(), Some((true, _)));
            }
        }
    }

    /// A string value from `start`, just after its opening quote; the
    /// position after its closing quote. Without escapes, its text with
    /// its quotes is its canonical form.
    #[inline(always)]
    fn string(&mut self, text: &str, start: usize) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        let stop = plain_run(bytes, start);
        if bytes.get(stop) == Some(&b'"') {
            return Ok(stop + 1);
        }
        let (s, next) = escaped(text, start, stop)?;
        self.flush(bytes, start - 1);
        write_string(&s, &mut self.out);
        self.run = next;
        Ok(next)
    }

    /// An object member's name at `at`, and the colon after it: remembered
    /// as a member of the innermost object; the position after the colon.
    #[inline(always)]
    fn member_name(&mut self, text: &str, at: usize) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        if bytes.get(at) != Some(&b'"') {
            return Err(error(at, "expected a member name"));
        }
        let start = at + 1;
        let stop = plain_run(bytes, start);
        let (member, next) = if bytes.get(stop) == Some(&b'"') {
            let member = Member {
                key: plain_key(bytes, start, stop),
                name: (start, stop),
                decoded: false,
                start: self.pos(at),
                end: 0,
            };
            (member, stop + 1)
        } else {
            let (s, next) = escaped(text, start, stop)?;
            self.flush(bytes, at);
            let member_start = self.out.len();
            write_string(&s, &mut self.out);
            self.run = next;
            let from = self.names.len();
            self.names.push_str(&s);
            let member = Member {
                key: sort_key(s.as_bytes()),
                name: (from, self.names.len()),
                decoded: true,
                start: member_start,
                end: 0,
            };
            (member, next)
        };
        self.members.push(member);
        if bytes.get(next) == Some(&b':') {
            return Ok(next + 1);
        }
        let at = self.space(bytes, next);
        if bytes.get(at) != Some(&b':') {
            return Err(error(at, "expected `:`"));
        }
        Ok(at + 1)
    }

    /// A number at `start`; the position after it. Integers up to 2^53 and
    /// decimals of at most 15 digits without an exponent are their own
    /// canonical form (see [`short_literal`]); the rest are read as
    /// doubles and written as `Document::write` writes them.
    #[inline(always)]
    fn number(&mut self, text: &str, start: usize) -> Result<usize, ParseError> {
        let bytes = text.as_bytes();
        if let Some(end) = short_literal(bytes, start) {
            return Ok(end);
        }
        let (value, exact, end) = read_number(text, start)?;
        if !exact {
            return Err(error(
                start,
                "a number whose canonical form is not its value",
            ));
        }
        self.flush(bytes, start);
        write_number(value, &mut self.out);
        self.run = end;
        Ok(end)
    }

    /// Ends the object whose members start at `first` in `members`, its
    /// closing brace at `at`: refuses duplicate names, and puts the
    /// members in order if they are not.
    fn close_object(&mut self, text: &str, first: usize, at: usize) -> Result<(), ParseError> {
        let Canonical {
            members,
            open,
            names,
            order,
            last_keys,
            last_order,
            ..
        } = self;
        // Only records in arrays come in runs of the same names: the
        // others are not remembered, so as not to forget the records'.
        let in_array = open
            .len()
            .checked_sub(2)
            .and_then(|i| open.get(i))
            .is_some_and(|&(object, _)| !object);
        let own = members.get(first..).unwrap_or_default();
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
            order.clear();
            if own.iter().map(|m| m.key).eq(last_keys.iter().copied()) {
                order.extend_from_slice(last_order);
            } else {
                order.extend(0..own.len());
                let member = |i: usize| own.get(i);
                order.sort_unstable_by(|&i, &j| match (member(i), member(j)) {
                    (Some(a), Some(b)) => compare(a, b),
                    _ => Ordering::Equal,
                });
                let mut distinct = true;
                for pair in order.windows(2) {
                    if let (Some(a), Some(b)) = (
                        pair.first().and_then(|&i| member(i)),
                        pair.get(1).and_then(|&i| member(i)),
                    ) {
                        if a.key == b.key {
                            if name(a) == name(b) {
                                return Err(error(at, "duplicate object key"));
                            }
                            distinct = false;
                        }
                    }
                }
                if distinct && in_array {
                    last_keys.clear();
                    last_keys.extend(own.iter().map(|m| m.key));
                    last_order.clone_from(order);
                }
            }
            self.reorder(text.as_bytes(), first, at);
        }
        self.members.truncate(first);
        Ok(())
    }

    /// Writes the members of the object whose members start at `first`,
    /// its closing brace at `close`, in `order`: only those between the
    /// first and the last that move. Straight from the body when they are
    /// all in the pending run; in `out` otherwise.
    fn reorder(&mut self, bytes: &[u8], first: usize, close: usize) {
        let Canonical {
            out,
            run,
            members,
            order,
            moved,
            ..
        } = self;
        let own = members.get(first..).unwrap_or_default();
        let stays = |&(k, &i): &(usize, &usize)| k == i;
        let lead = order.iter().enumerate().take_while(stays).count();
        let trail = order.iter().enumerate().rev().take_while(stays).count();
        let rewritten = order.get(lead..own.len() - trail).unwrap_or_default();
        let (Some(from), Some(to)) = (
            own.get(lead).map(|m| m.start),
            own.get(own.len() - trail - 1).map(|m| m.end),
        ) else {
            return;
        };
        if from >= out.len() {
            // Where a position of the canonical form in the pending run is
            // in the body. Not a difference of the two: the canonical form
            // so far can be longer than the body read (`1e20`).
            let (base, start) = (out.len(), *run);
            let body_at = |canonical: usize| start + (canonical - base);
            out.extend_from_slice(bytes.get(start..body_at(from)).unwrap_or_default());
            for (k, m) in rewritten.iter().filter_map(|&i| own.get(i)).enumerate() {
                if k > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(
                    bytes
                        .get(body_at(m.start)..body_at(m.end))
                        .unwrap_or_default(),
                );
            }
            *run = body_at(to);
            return;
        }
        out.extend_from_slice(bytes.get(*run..close).unwrap_or_default());
        *run = close;
        let Some(region) = out.get_mut(from..to) else {
            return;
        };
        moved.clear();
        moved.extend_from_slice(region);
        let mut at = 0;
        for (k, m) in rewritten.iter().filter_map(|&i| own.get(i)).enumerate() {
            if k > 0 {
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
}

/// `true`, `false` or `null` at `at`; the position after it.
#[inline(always)]
fn literal(bytes: &[u8], at: usize, word: &[u8]) -> Result<usize, ParseError> {
    let end = at + word.len();
    if bytes.get(at..end) != Some(word) {
        return Err(error(at, "expected a value"));
    }
    Ok(end)
}

/// The [`sort_key`] of the name from `start` to `stop` in the body, which
/// has no escapes: a name shorter than eight bytes is read with what
/// follows it, which is masked off.
#[inline(always)]
fn plain_key(bytes: &[u8], start: usize, stop: usize) -> u64 {
    let len = stop - start;
    match bytes.get(start..start + 8).map(<[u8; 8]>::try_from) {
        Some(Ok(word)) if len < 8 => {
            // Shifted by less than 64.
            let keep = !(u64::MAX >> (8 * len));
            utf16_key(u64::from_be_bytes(word) & keep)
        }
        _ => sort_key(bytes.get(start..stop).unwrap_or_default()),
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
            // Some of the members copied out already: after whitespace,
            // an escape, a number written anew.
            (r#"{"b": 1, "a" :2}"#, r#"{"a":2,"b":1}"#),
            // The canonical form longer than the body read so far.
            (
                r#"{"a":1e20,"c":{"z":1,"y":2}}"#,
                r#"{"a":100000000000000000000,"c":{"y":2,"z":1}}"#,
            ),
            (
                r#"{"c":"\n","b":[ 1 ],"a":1.0,"z":[{"y":1e2,"x":0}]}"#,
                r#"{"a":1,"b":[1],"c":"\n","z":[{"x":0,"y":100}]}"#,
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
