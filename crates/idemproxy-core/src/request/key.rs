//! Parsing the `Idempotency-Key` header.
//!
//! A key is 1..=255 visible ASCII characters (0x21-0x7E), sent either bare
//! (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`) or as an RFC 8941
//! sf-string (`Idempotency-Key: "8e03978e-..."`), which is what
//! draft-ietf-httpapi-idempotency-key-header specifies. Both forms name the
//! same key: the quotes are framing, not content, so a client that switches
//! between them still gets its replay.
//!
//! Choices where the sources leave room:
//!
//! - A value that starts with `"` is always read as an sf-string, so it must
//!   be well formed (closed, only `\"` and `\\` escapes, nothing after the
//!   closing quote). Guessing that a broken string was "really" a bare key
//!   would make `"abc` and `"abc"` two different keys for a client that
//!   merely forgot a quote; rejecting tells it so. A `"` elsewhere in a bare
//!   key is just a visible character.
//! - Inside an sf-string, spaces (0x20) are accepted because RFC 8941 §3.3.3
//!   allows them there and a client quoting its key may rely on that. A key
//!   made only of spaces is still rejected as blank: it carries no identity.
//! - Keys are case-sensitive and compared byte for byte after unquoting.
//! - The limit of 255 applies to the unquoted key, not to the header value.

use std::fmt;
use std::str::FromStr;

use http::{HeaderName, HeaderValue};

/// The caller's key (draft-ietf-httpapi-idempotency-key-header).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters (keys are ASCII, so also bytes).
pub const MAX_KEY_LEN: usize = 255;

/// A validated key: 1..=255 visible ASCII characters, unquoted (an sf-string
/// key may also contain spaces).
///
/// `Debug` shows only the length: raw keys must never reach logs, and a
/// `?key` in a tracing macro is the easiest way for one to get there.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<{} chars>)", self.0.len())
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Parses a key given as text (e.g. by the admin API) by the same rules as
/// the header, so both name the same record.
impl FromStr for IdempotencyKey {
    type Err = InvalidKey;

    fn from_str(s: &str) -> Result<Self, InvalidKey> {
        parse_bytes(s.as_bytes())
    }
}

/// Why a key was refused. The `Display` text is sent to the client as the
/// `detail` of the 400 problem, so it says what was wrong and what would be
/// accepted, and never echoes the key itself (it may end up in logs).
/// Offsets are 0-based byte offsets into the header value after trimming
/// surrounding whitespace.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidKey {
    #[error("the Idempotency-Key header is empty; a key is 1 to 255 visible ASCII characters")]
    Empty,
    #[error("the quoted Idempotency-Key contains only spaces; a key must contain at least one visible character")]
    Blank,
    #[error("the Idempotency-Key is {len} characters long; the limit is {max}")]
    TooLong { len: usize, max: usize },
    #[error(
        "the Idempotency-Key contains {} at offset {offset}; a key is visible ASCII \
         (0x21-0x7E), and spaces are allowed only inside a quoted RFC 8941 string",
        describe_byte(*byte)
    )]
    InvalidChar { offset: usize, byte: u8 },
    #[error(
        "the Idempotency-Key contains a non-ASCII byte (0x{byte:02X}) at offset {offset}; \
         a key is visible ASCII (0x21-0x7E)"
    )]
    NonAscii { offset: usize, byte: u8 },
    #[error(
        "the Idempotency-Key starts with a double quote but the RFC 8941 string is not \
         closed; send the key bare or as a complete \"...\" string"
    )]
    Unterminated,
    #[error(
        "the quoted Idempotency-Key has an invalid escape at offset {offset}; inside an \
         RFC 8941 string only \\\" and \\\\ may be escaped"
    )]
    InvalidEscape { offset: usize },
    #[error(
        "the quoted Idempotency-Key has characters after its closing quote (offset {offset}); \
         send the key bare or as a single \"...\" string"
    )]
    TrailingCharacters { offset: usize },
    /// Not produced by [`parse_key`], which sees one value; for callers
    /// that find several `Idempotency-Key` headers on one request.
    #[error("the request carries more than one Idempotency-Key header; send exactly one key")]
    Repeated,
    /// Not produced by [`parse_key`]: a key in a JSON body (an MCP key
    /// argument) that is not a string or an integer.
    #[error("the key is not a string; a key is 1 to 255 visible ASCII characters, e.g. a UUID")]
    NotText,
    /// A key from a `key_from` source other than the `Idempotency-Key`
    /// header, named so the caller knows which value to fix.
    #[error("the key from `{at}` is unusable: {why}")]
    From { at: String, why: Box<InvalidKey> },
}

fn describe_byte(byte: u8) -> String {
    match byte {
        b' ' => "a space".to_owned(),
        b'\t' => "a tab".to_owned(),
        _ => format!("the control byte 0x{byte:02X}"),
    }
}

/// Parses and validates an `Idempotency-Key` header value.
///
/// Works on the raw bytes rather than `to_str()`, because a `HeaderValue`
/// may carry obs-text (0x80-0xFF) and those must become a 400, not a panic
/// or a lossy conversion.
pub fn parse_key(value: &HeaderValue) -> Result<IdempotencyKey, InvalidKey> {
    parse_bytes(value.as_bytes())
}

fn parse_bytes(raw: &[u8]) -> Result<IdempotencyKey, InvalidKey> {
    // The HTTP parser already strips OWS; values built in-process (tests,
    // other front ends) may not have been through it.
    let value = trim_ows(raw);
    match value.first() {
        None => Err(InvalidKey::Empty),
        Some(b'"') => parse_sf_string(value),
        Some(_) => parse_token(value),
    }
}

/// Strips optional whitespace (RFC 9110 OWS: spaces and tabs) around a
/// header value; shared with the content-type check of `fingerprint`.
pub(crate) fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

fn parse_token(value: &[u8]) -> Result<IdempotencyKey, InvalidKey> {
    for (offset, &byte) in value.iter().enumerate() {
        check_char(offset, byte, false)?;
    }
    check_len(value.len())?;
    // Every byte is ASCII here, so each maps to the char of the same value.
    Ok(IdempotencyKey(
        value.iter().map(|&b| char::from(b)).collect(),
    ))
}

/// RFC 8941 §4.2.5 (Parsing a String), with `value[0] == b'"'`.
fn parse_sf_string(value: &[u8]) -> Result<IdempotencyKey, InvalidKey> {
    let mut out = String::with_capacity(value.len().min(MAX_KEY_LEN));
    let mut iter = value.iter().copied().enumerate().skip(1);
    while let Some((offset, byte)) = iter.next() {
        match byte {
            b'\\' => match iter.next() {
                Some((_, escaped @ (b'"' | b'\\'))) => out.push(char::from(escaped)),
                Some(_) => return Err(InvalidKey::InvalidEscape { offset }),
                None => return Err(InvalidKey::Unterminated),
            },
            b'"' => {
                let end = offset + 1;
                if end != value.len() {
                    return Err(InvalidKey::TrailingCharacters { offset: end });
                }
                check_len(out.len())?;
                if out.bytes().all(|b| b == b' ') {
                    return Err(InvalidKey::Blank);
                }
                return Ok(IdempotencyKey(out));
            }
            _ => {
                check_char(offset, byte, true)?;
                out.push(char::from(byte));
            }
        }
    }
    Err(InvalidKey::Unterminated)
}

fn check_char(offset: usize, byte: u8, space_ok: bool) -> Result<(), InvalidKey> {
    match byte {
        0x21..=0x7E => Ok(()),
        b' ' if space_ok => Ok(()),
        0x80..=0xFF => Err(InvalidKey::NonAscii { offset, byte }),
        _ => Err(InvalidKey::InvalidChar { offset, byte }),
    }
}

fn check_len(len: usize) -> Result<(), InvalidKey> {
    if len == 0 {
        Err(InvalidKey::Empty)
    } else if len > MAX_KEY_LEN {
        Err(InvalidKey::TooLong {
            len,
            max: MAX_KEY_LEN,
        })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Result<IdempotencyKey, InvalidKey> {
        parse_key(&HeaderValue::from_str(s).expect("valid header value"))
    }

    fn parse_raw(bytes: &[u8]) -> Result<IdempotencyKey, InvalidKey> {
        parse_key(&HeaderValue::from_bytes(bytes).expect("valid header value"))
    }

    fn ok(s: &str) -> String {
        parse(s).expect("key accepted").into_string()
    }

    /// Serializes `s` as an RFC 8941 sf-string (§4.1.6).
    fn sf_string(s: &str) -> String {
        let mut out = String::from("\"");
        for c in s.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }

    #[test]
    fn accepts_bare_keys() {
        assert_eq!(ok("abc"), "abc");
        assert_eq!(
            ok("8e03978e-40d5-43e8-bc93-6894a57f9324"),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(ok("!"), "!");
        assert_eq!(ok("~"), "~");
        // A quote that does not start the value is an ordinary character.
        assert_eq!(ok("ab\"c"), "ab\"c");
        assert_eq!(ok("a\\b"), "a\\b");
    }

    #[test]
    fn keys_are_case_sensitive() {
        assert_ne!(ok("ABC"), ok("abc"));
    }

    #[test]
    fn accepts_and_unquotes_sf_strings() {
        assert_eq!(ok("\"abc\""), "abc");
        assert_eq!(ok("\"abc\""), ok("abc"));
        assert_eq!(ok(r#""a\"b""#), "a\"b");
        assert_eq!(ok(r#""a\\b""#), "a\\b");
        assert_eq!(ok(r#""\\""#), "\\");
        assert_eq!(ok(r#""\"""#), "\"");
    }

    #[test]
    fn accepts_spaces_inside_sf_strings_only() {
        assert_eq!(ok("\"a b\""), "a b");
        assert_eq!(ok("\" a \""), " a ");
        assert_eq!(
            parse("a b"),
            Err(InvalidKey::InvalidChar {
                offset: 1,
                byte: b' '
            })
        );
    }

    #[test]
    fn trims_surrounding_whitespace() {
        assert_eq!(ok("  abc\t"), "abc");
        assert_eq!(ok("\t\"abc\" "), "abc");
    }

    #[test]
    fn rejects_empty() {
        assert_eq!(parse(""), Err(InvalidKey::Empty));
        assert_eq!(parse("   "), Err(InvalidKey::Empty));
        assert_eq!(parse("\t"), Err(InvalidKey::Empty));
        assert_eq!(parse("\"\""), Err(InvalidKey::Empty));
    }

    #[test]
    fn rejects_blank_sf_string() {
        assert_eq!(parse("\" \""), Err(InvalidKey::Blank));
        assert_eq!(parse("\"   \""), Err(InvalidKey::Blank));
    }

    #[test]
    fn length_limit() {
        let max = "k".repeat(MAX_KEY_LEN);
        assert_eq!(ok(&max), max);
        assert_eq!(ok(&sf_string(&max)), max);
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert_eq!(
            parse(&long),
            Err(InvalidKey::TooLong { len: 256, max: 255 })
        );
        assert_eq!(
            parse(&sf_string(&long)),
            Err(InvalidKey::TooLong { len: 256, max: 255 })
        );
        // The limit is on the unquoted key: escapes do not count twice.
        let escaped = "\"".repeat(MAX_KEY_LEN);
        assert_eq!(ok(&sf_string(&escaped)), escaped);
    }

    #[test]
    fn too_long_message_names_length_and_limit() {
        let msg = parse(&"x".repeat(300)).expect_err("too long").to_string();
        assert!(msg.contains("300"), "{msg}");
        assert!(msg.contains("255"), "{msg}");
    }

    #[test]
    fn rejects_controls_and_tab_inside() {
        assert_eq!(
            parse("a\tb"),
            Err(InvalidKey::InvalidChar {
                offset: 1,
                byte: b'\t'
            })
        );
        assert_eq!(
            parse("\"a\tb\""),
            Err(InvalidKey::InvalidChar {
                offset: 2,
                byte: b'\t'
            })
        );
    }

    #[test]
    fn rejects_obs_text_without_panicking() {
        assert_eq!(
            parse_raw(b"ab\xC3\xA9"),
            Err(InvalidKey::NonAscii {
                offset: 2,
                byte: 0xC3
            })
        );
        assert_eq!(
            parse_raw(b"\xFF"),
            Err(InvalidKey::NonAscii {
                offset: 0,
                byte: 0xFF
            })
        );
        assert_eq!(
            parse_raw(b"\"a\x80\""),
            Err(InvalidKey::NonAscii {
                offset: 2,
                byte: 0x80
            })
        );
    }

    #[test]
    fn rejects_bytes_header_value_cannot_normally_hold() {
        // `HeaderValue` refuses these, but `FromStr` and unchecked
        // constructors do not go through that check.
        assert_eq!(
            "a\x7Fb".parse::<IdempotencyKey>(),
            Err(InvalidKey::InvalidChar {
                offset: 1,
                byte: 0x7F
            })
        );
        assert_eq!(
            "a\nb".parse::<IdempotencyKey>(),
            Err(InvalidKey::InvalidChar {
                offset: 1,
                byte: b'\n'
            })
        );
        assert_eq!(
            "\"a\0\"".parse::<IdempotencyKey>(),
            Err(InvalidKey::InvalidChar { offset: 2, byte: 0 })
        );
    }

    #[test]
    fn rejects_bad_quoting() {
        assert_eq!(parse("\""), Err(InvalidKey::Unterminated));
        assert_eq!(parse("\"abc"), Err(InvalidKey::Unterminated));
        assert_eq!(parse(r#""abc\""#), Err(InvalidKey::Unterminated));
        assert_eq!(parse(r#""abc\"#), Err(InvalidKey::Unterminated));
        assert_eq!(
            parse(r#""a\nb""#),
            Err(InvalidKey::InvalidEscape { offset: 2 })
        );
        assert_eq!(
            parse("\"abc\"def"),
            Err(InvalidKey::TrailingCharacters { offset: 5 })
        );
        assert_eq!(
            parse("\"abc\" \"def\""),
            Err(InvalidKey::TrailingCharacters { offset: 5 })
        );
        assert_eq!(
            parse("\"a\"\""),
            Err(InvalidKey::TrailingCharacters { offset: 3 })
        );
    }

    #[test]
    fn from_str_matches_header_parsing() {
        assert_eq!("\"abc\"".parse::<IdempotencyKey>(), parse("abc"));
        assert_eq!("".parse::<IdempotencyKey>(), Err(InvalidKey::Empty));
    }

    #[test]
    fn debug_does_not_reveal_the_key() {
        let key = parse("secret-key-123").expect("valid");
        let dbg = format!("{key:?}");
        assert!(!dbg.contains("secret"), "{dbg}");
        assert!(dbg.contains("14"), "{dbg}");
    }

    #[test]
    fn every_error_has_a_readable_message_without_the_key() {
        let cases: &[&[u8]] = &[
            b"", b"\" \"", b"a b", b"a\xE9", b"\"x", b"\"\\x\"", b"\"x\"y",
        ];
        for raw in cases {
            let err = parse_raw(raw).expect_err("rejected");
            let msg = err.to_string();
            assert!(msg.starts_with("the "), "{msg}");
            assert!(msg.contains("Idempotency-Key"), "{msg}");
        }
        let long = parse(&"q".repeat(400)).expect_err("rejected").to_string();
        assert!(!long.contains("qq"), "{long}");
        let space = parse("a b").expect_err("rejected").to_string();
        assert!(space.contains("a space at offset 1"), "{space}");
    }

    proptest! {
        #[test]
        fn bare_visible_ascii_round_trips(key in "[!#-~][!-~]{0,254}") {
            // `"` is excluded only as the first character: a leading quote
            // selects the sf-string form (covered below).
            let value = HeaderValue::from_str(&key).expect("visible ASCII is a valid header value");
            let parsed = parse_key(&value).expect("accepted");
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn sf_string_of_visible_ascii_round_trips(key in "[!-~][ -~]{0,254}") {
            let value = HeaderValue::from_str(&sf_string(&key)).expect("valid header value");
            let parsed = parse_key(&value).expect("accepted");
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn too_long_is_rejected(key in "[!#-~][!-~]{255,400}") {
            let value = HeaderValue::from_str(&key).expect("valid header value");
            prop_assert_eq!(
                parse_key(&value),
                Err(InvalidKey::TooLong { len: key.len(), max: MAX_KEY_LEN })
            );
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                let _ = parse_key(&value);
            }
            // Also bypass HeaderValue's own validation.
            if let Ok(s) = std::str::from_utf8(&bytes) {
                let _ = s.parse::<IdempotencyKey>();
            }
        }

        #[test]
        fn never_panics_on_quote_heavy_input(
            bytes in proptest::collection::vec(
                prop::sample::select(vec![b'"', b'\\', b' ', b'\t', b'a', b'~', 0x80u8, 0xFF]),
                0..40,
            )
        ) {
            if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                if let Ok(key) = parse_key(&value) {
                    // Whatever is accepted obeys the key rules.
                    prop_assert!((1..=MAX_KEY_LEN).contains(&key.as_str().len()));
                    prop_assert!(key.as_str().bytes().all(|b| (0x20..=0x7E).contains(&b)));
                    prop_assert!(key.as_str().bytes().any(|b| b != b' '));
                }
            }
        }
    }
}
