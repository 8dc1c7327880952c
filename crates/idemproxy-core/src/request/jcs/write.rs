//! The canonical form (RFC 8785 §3.2): members in UTF-16 order, numbers
//! as ECMAScript writes them, strings escaped as `JSON.stringify` does,
//! streamed into a [`Sink`] so that nothing needs the whole of it at once.

use std::borrow::Cow;

use super::{Document, Entry, NodeId, Sink};

impl Document<'_> {
    /// Writes the canonical form to `out`.
    pub(crate) fn write<S: Sink + ?Sized>(&self, out: &mut S) {
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
}

/// Numbers are IEEE 754 doubles serialized as ECMAScript's
/// `Number.prototype.toString` does (RFC 8785 §3.2.2.3), which is what
/// ryu-js implements; the common short numbers skip it (see
/// [`short_decimal`]).
pub(super) fn write_number<S: Sink + ?Sized>(value: f64, out: &mut S) {
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
pub(super) fn write_string<S: Sink + ?Sized>(s: &str, out: &mut S) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::jcs::tests::canonical;
    use proptest::prelude::*;

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
    fn numbers_follow_ecmascript() {
        assert_eq!(
            canonical("[0, -0.0, 1.0, 1e21, 1e-7, 1.2345678901234568e20, 0.1]"),
            "[0,0,1,1e+21,1e-7,123456789012345680000,0.1]"
        );
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
