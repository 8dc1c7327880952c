//! The byte-level pieces of the parser ([`super::parse`]): where a
//! string's plain run stops and how its escapes decode, how a number's
//! digits and exponent read and whether its literal is exact, and the sort
//! key of a member name. Each takes the bytes and a position and gives
//! back a value and the position after it.

use std::borrow::Cow;
use std::fmt;

/// Why a body is not I-JSON, and where that showed. Only for debugging:
/// the caller hashes such a body raw whatever the reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ParseError {
    /// Byte offset into the body.
    at: usize,
    reason: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.reason, self.at)
    }
}

impl std::error::Error for ParseError {}

/// A string from the end of its first plain run, at `stop`, on: an
/// escape, or no JSON string at all.
#[inline(never)]
pub(super) fn escaped(
    text: &str,
    start: usize,
    mut stop: usize,
) -> Result<(Cow<'_, str>, usize), ParseError> {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(stop - start + 16);
    let mut from = start;
    loop {
        let run = text
            .get(from..stop)
            .ok_or_else(|| error(stop, "not a character boundary"))?;
        out.push_str(run);
        match bytes.get(stop) {
            Some(b'"') => return Ok((Cow::Owned(out), stop + 1)),
            Some(b'\\') => {
                let (c, next) = escape(bytes, stop + 1)?;
                out.push(c);
                from = next;
            }
            Some(_) => return Err(error(stop, "control character in a string")),
            None => return Err(error(stop, "unterminated string")),
        }
        stop = plain_run(bytes, from);
    }
}

/// The character an escape stands for, from just after its backslash,
/// and the position after it.
pub(super) fn escape(bytes: &[u8], at: usize) -> Result<(char, usize), ParseError> {
    let c = match bytes.get(at) {
        Some(b'"') => '"',
        Some(b'\\') => '\\',
        Some(b'/') => '/',
        Some(b'b') => '\u{8}',
        Some(b'f') => '\u{c}',
        Some(b'n') => '\n',
        Some(b'r') => '\r',
        Some(b't') => '\t',
        Some(b'u') => return unicode_escape(bytes, at + 1),
        Some(_) => return Err(error(at, "invalid escape")),
        None => return Err(error(at, "unterminated string")),
    };
    Ok((c, at + 1))
}

/// A `\u` escape, from just after the `u`. Like serde_json reading into
/// a string, a high surrogate must be followed at once by a low one
/// (escaped), and a low one must not come first.
pub(super) fn unicode_escape(bytes: &[u8], at: usize) -> Result<(char, usize), ParseError> {
    let unit = hex4(bytes, at)?;
    let (code, next) = match unit {
        0xD800..=0xDBFF => {
            if bytes.get(at + 4..at + 6) != Some(b"\\u") {
                return Err(error(at, "lone leading surrogate"));
            }
            let low = hex4(bytes, at + 6)?;
            if !(0xDC00..=0xDFFF).contains(&low) {
                return Err(error(at, "lone leading surrogate"));
            }
            (0x1_0000 + ((unit - 0xD800) << 10) + (low - 0xDC00), at + 10)
        }
        0xDC00..=0xDFFF => return Err(error(at, "lone trailing surrogate")),
        _ => (unit, at + 4),
    };
    let c = char::from_u32(code).ok_or_else(|| error(at, "invalid code point"))?;
    Ok((c, next))
}

pub(super) fn hex4(bytes: &[u8], at: usize) -> Result<u32, ParseError> {
    let digits = bytes
        .get(at..at + 4)
        .ok_or_else(|| error(at, "unterminated string"))?;
    let mut unit = 0;
    for &d in digits {
        let Some(v) = char::from(d).to_digit(16) else {
            return Err(error(at, "invalid escape"));
        };
        unit = unit << 4 | v;
    }
    Ok(unit)
}

#[cold]
pub(super) fn error(at: usize, reason: &'static str) -> ParseError {
    ParseError { at, reason }
}

/// The literal from `start` to `end`, without its sign, correctly
/// rounded, as serde_json's `float_roundtrip` reads it.
#[inline(never)]
pub(super) fn slow_double(text: &str, start: usize, end: usize) -> Result<f64, ParseError> {
    text.get(start..end)
        .and_then(|literal| literal.parse::<f64>().ok())
        .ok_or_else(|| error(start, "invalid number"))
}

/// The position of the first byte from `at` on that is not whitespace.
#[inline(always)]
pub(super) fn skip_space(bytes: &[u8], mut at: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\t' | b'\r') = bytes.get(at) {
        at += 1;
    }
    at
}

/// The digits from `at` on appended to `mantissa` (wrapping), and where
/// they stop.
#[inline(always)]
pub(super) fn digits(bytes: &[u8], mut at: usize, mut mantissa: u64) -> (u64, usize) {
    while let Some(&b) = bytes.get(at) {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        mantissa = mantissa.wrapping_mul(10).wrapping_add(u64::from(d));
        at += 1;
    }
    (mantissa, at)
}

/// An exponent's sign and digits from `at` on added to `scale`, and where
/// they stop.
pub(super) fn exponent_of(
    bytes: &[u8],
    mut at: usize,
    scale: i64,
) -> Result<(i64, usize), ParseError> {
    let negative = bytes.get(at) == Some(&b'-');
    if matches!(bytes.get(at), Some(b'-' | b'+')) {
        at += 1;
    }
    let first = at;
    let mut value = 0i64;
    while let Some(&b) = bytes.get(at) {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        // Saturates far beyond any double, where only the slow path looks.
        value = value.saturating_mul(10).saturating_add(i64::from(d));
        at += 1;
    }
    if at == first {
        return Err(error(at, "expected a digit"));
    }
    let scale = if negative {
        scale.saturating_sub(value)
    } else {
        scale.saturating_add(value)
    };
    Ok((scale, at))
}

/// Decimal digits as a `u64`, if it holds them.
pub(super) fn exact_integer(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |m, &b| {
        m.checked_mul(10)?
            .checked_add(u64::from(b.wrapping_sub(b'0')))
    })
}

/// Significant digits a decimal may have and still be the only decimal
/// that short to read as its double, in the normal range (`DBL_DIG`).
pub(super) const DBL_DIG: usize = 15;

/// Whether `literal` (unsigned) has the value of what `value`, the double
/// it reads as, writes as in RFC 8785 (the shortest decimal that reads as
/// it). If every literal does, two with the same canonical form have the
/// same value; one that does not would share its canonical form with
/// another number.
#[inline(never)]
pub(super) fn writes_as(literal: &str, value: f64) -> bool {
    let mut buffer = ryu_js::Buffer::new();
    let written = if value == 0.0 {
        "0"
    } else {
        buffer.format_finite(value)
    };
    Decimal::of(literal.as_bytes()) == Decimal::of(written.as_bytes())
}

/// A decimal literal (unsigned, valid) by its value: its digits without
/// leading or trailing zeros, and the power of ten of the last one, so
/// that equal values compare equal however written. Exponents saturate:
/// that far out, the literal read as zero or infinity already.
#[derive(Debug)]
pub(super) struct Decimal<'t> {
    int: &'t [u8],
    fraction: &'t [u8],
    /// Leading zeros, then the significant digits.
    lead: usize,
    len: usize,
    exponent: i64,
}

impl<'t> Decimal<'t> {
    fn of(text: &'t [u8]) -> Self {
        let digits = |from: &'t [u8]| {
            let n = from
                .iter()
                .position(|b| !b.is_ascii_digit())
                .unwrap_or(from.len());
            from.split_at(n)
        };
        let (int, rest) = digits(text);
        let (fraction, rest) = match rest.split_first() {
            Some((b'.', rest)) => digits(rest),
            _ => (&[][..], rest),
        };
        let exponent = match rest.first() {
            Some(b'e' | b'E') => exponent_of(rest, 1, 0).map_or(0, |(e, _)| e),
            _ => 0,
        };
        let all = || int.iter().chain(fraction);
        let total = int.len() + fraction.len();
        let lead = all().take_while(|&&d| d == b'0').count();
        let trail = if lead < total {
            all().rev().take_while(|&&d| d == b'0').count()
        } else {
            0
        };
        let places = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        Decimal {
            int,
            fraction,
            lead,
            len: total - lead - trail,
            exponent: exponent
                .saturating_sub(places(fraction.len()))
                .saturating_add(places(trail)),
        }
    }

    fn significant(&self) -> impl Iterator<Item = &u8> + '_ {
        self.int
            .iter()
            .chain(self.fraction)
            .skip(self.lead)
            .take(self.len)
    }
}

impl PartialEq for Decimal<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len
            && (self.len == 0
                || self.exponent == other.exponent && self.significant().eq(other.significant()))
    }
}

/// Powers of ten a double holds exactly.
pub(super) const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// `mantissa * 10^scale` when one multiplication or division of two
/// doubles that hold their operands exactly gives it, correctly rounded
/// (Clinger's fast path): most decimals in bodies. `None` otherwise, for
/// `str::parse`, which reads the literal's text again.
#[inline(always)]
pub(super) fn fast_double(mantissa: u64, scale: i64) -> Option<f64> {
    if mantissa > 1 << 53 {
        return None;
    }
    let m = mantissa as f64;
    let pow = POW10.get(usize::try_from(scale.unsigned_abs()).ok()?)?;
    Some(if scale < 0 { m / pow } else { m * pow })
}

/// Bytes with their high bit set, in a word of eight.
pub(super) const HIGH: u64 = u64::MAX / 255 * 0x80;

/// The first eight bytes of a member name as a number that orders names
/// as [`utf16_cmp`](super::utf16_cmp) does, where it tells them apart: so sorting compares
/// numbers, and strings only for names alike in those bytes (or a prefix
/// padded with NULs). UTF-8 byte order is UTF-16 order but for U+E000 to
/// U+FFFF (lead bytes EE, EF), which sort after the surrogate pairs (F0
/// to F4): they count as F5, F6, which UTF-8 never uses.
#[inline(always)]
pub(super) fn sort_key(name: &[u8]) -> u64 {
    let key = match name.get(..8).map(<[u8; 8]>::try_from) {
        Some(Ok(first)) => u64::from_be_bytes(first),
        _ => name
            .iter()
            .fold(0u64, |key, &b| key << 8 | u64::from(b))
            .checked_shl(8 * (8 - name.len() as u32))
            .unwrap_or(0),
    };
    utf16_key(key)
}

/// A name's first eight bytes, big-endian and padded with zeros, made
/// into its [`sort_key`].
#[inline(always)]
pub(super) fn utf16_key(key: u64) -> u64 {
    if key & HIGH == 0 {
        return key;
    }
    u64::from_be_bytes(
        key.to_be_bytes()
            .map(|b| if matches!(b, 0xEE | 0xEF) { b + 7 } else { b }),
    )
}

/// The position of the first `"`, `\` or control character from `from`
/// on, or the end of `bytes`: where a string's plain run stops. Eight
/// bytes at a time (as serde_json does): each test flags the bytes it
/// matches in their high bits, and a borrow can only flag a byte above
/// one really matched, so the lowest flag is the answer.
#[inline(always)]
pub(super) fn plain_run(bytes: &[u8], from: usize) -> usize {
    const ONES: u64 = u64::MAX / 255;
    let mut at = from;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let Ok(chunk) = <[u8; 8]>::try_from(chunk) else {
            break;
        };
        let word = u64::from_le_bytes(chunk);
        let quote = word ^ (ONES * u64::from(b'"'));
        let backslash = word ^ (ONES * u64::from(b'\\'));
        let found = (word.wrapping_sub(ONES * 0x20) & !word
            | quote.wrapping_sub(ONES) & !quote
            | backslash.wrapping_sub(ONES) & !backslash)
            & HIGH;
        if found != 0 {
            return at + (found.trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    while let Some(&b) = bytes.get(at) {
        if b == b'"' || b == b'\\' || b < 0x20 {
            break;
        }
        at += 1;
    }
    at
}
