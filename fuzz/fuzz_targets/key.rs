//! `Idempotency-Key` parsing (crates/idemproxy-core/src/request/key.rs):
//! `parse_key` on any header value and `IdempotencyKey::from_str` on any
//! text never panic, and what they accept and refuse obeys the rules that
//! file documents.

#![no_main]

use http::HeaderValue;
use idemproxy_core::request::key::{parse_key, IdempotencyKey, InvalidKey, MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let header = HeaderValue::from_bytes(data).ok();
    let from_header = header.as_ref().map(parse_key);
    if let Some(result) = &from_header {
        check(data, result);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let from_text = text.parse::<IdempotencyKey>();
        check(data, &from_text);
        // "Parses a key given as text by the same rules as the header, so
        // both name the same record."
        if let Some(from_header) = &from_header {
            assert_eq!(&from_text, from_header, "FromStr and parse_key disagree");
        }
    }
});

/// RFC 9110 OWS, as `parse_key` trims it.
fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

fn check(raw: &[u8], result: &Result<IdempotencyKey, InvalidKey>) {
    let value = trim_ows(raw);
    match result {
        Ok(key) => check_key(value, key),
        Err(err) => check_error(value, err),
    }
}

/// "A key is 1..=255 visible ASCII characters (0x21-0x7E), sent either bare
/// or as an RFC 8941 sf-string ... (an sf-string key may also contain
/// spaces)"; "A key made only of spaces is still rejected as blank".
fn check_key(value: &[u8], key: &IdempotencyKey) {
    let s = key.as_str();
    assert!(
        (1..=MAX_KEY_LEN).contains(&s.len()),
        "accepted a key of {} bytes",
        s.len()
    );
    assert_eq!(s.chars().count(), s.len(), "a key is ASCII");
    assert!(
        s.bytes().all(|b| (0x20..=0x7E).contains(&b)),
        "a key is visible ASCII or space: {s:?}"
    );
    assert!(s.bytes().any(|b| b != b' '), "a blank key was accepted");
    assert_eq!(key.as_ref(), s);
    assert_eq!(key.clone().into_string(), s);
    // `Debug` never shows the key.
    let debug = format!("{key:?}");
    assert_eq!(debug, format!("IdempotencyKey(<{} chars>)", s.len()));

    if value.first() == Some(&b'"') {
        // The sf-string form: the quotes are framing, the content is the key.
        assert!(value.len() >= 2 && value.last() == Some(&b'"'));
        assert_eq!(unquote(value).as_deref(), Some(s), "sf-string content");
    } else {
        // A bare key is the trimmed value itself, without spaces.
        assert_eq!(s.as_bytes(), value, "a bare key is the value as sent");
        assert!(!s.contains(' '), "a space in a bare key");
    }
    // Both forms name the same key: quoting it and, when it has a bare
    // form, sending it bare, parse back to it.
    let quoted = quote(s);
    let requoted =
        parse_key(&HeaderValue::from_str(&quoted).expect("a quoted key is a header value"));
    assert_eq!(requoted.as_ref(), Ok(key), "quoted form of {quoted:?}");
    if !s.starts_with('"') && !s.contains(' ') {
        let bare = parse_key(&HeaderValue::from_str(s).expect("visible ASCII"));
        assert_eq!(bare.as_ref(), Ok(key), "bare form");
    }
}

/// "Offsets are 0-based byte offsets into the header value after trimming
/// surrounding whitespace."
fn check_error(value: &[u8], err: &InvalidKey) {
    let message = err.to_string();
    assert!(message.starts_with("the "), "{message}");
    match err {
        InvalidKey::Empty => {
            assert!(
                value.is_empty() || value.first() == Some(&b'"'),
                "Empty for {value:?}"
            )
        }
        InvalidKey::Blank => assert_eq!(value.first(), Some(&b'"')),
        InvalidKey::TooLong { len, max } => {
            assert_eq!(*max, MAX_KEY_LEN);
            assert!(*len > MAX_KEY_LEN && *len <= value.len(), "TooLong {len}");
        }
        InvalidKey::InvalidChar { offset, byte } => {
            assert_eq!(value.get(*offset), Some(byte), "InvalidChar offset");
            assert!(*byte < 0x21 || *byte == 0x7F, "InvalidChar {byte:#x}");
        }
        InvalidKey::NonAscii { offset, byte } => {
            assert_eq!(value.get(*offset), Some(byte), "NonAscii offset");
            assert!(*byte >= 0x80);
        }
        InvalidKey::Unterminated => assert_eq!(value.first(), Some(&b'"')),
        InvalidKey::InvalidEscape { offset } => {
            assert_eq!(value.first(), Some(&b'"'));
            assert_eq!(value.get(*offset), Some(&b'\\'), "InvalidEscape offset");
        }
        InvalidKey::TrailingCharacters { offset } => {
            assert_eq!(value.first(), Some(&b'"'));
            assert!(
                *offset > 0 && *offset < value.len(),
                "TrailingCharacters offset"
            );
            assert_eq!(value.get(*offset - 1), Some(&b'"'));
        }
        // Never produced by parsing one value (documented per variant).
        _ => panic!("parse_key produced {err:?}"),
    }
}

/// RFC 8941 §4.1.6.
fn quote(s: &str) -> String {
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

/// The content of a well-formed sf-string (`"`, escapes `\"` and `\\`).
fn unquote(value: &[u8]) -> Option<String> {
    let inner = value.get(1..value.len().checked_sub(1)?)?;
    let mut out = String::new();
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => out.push(char::from(*bytes.next()?)),
            b'"' => return None,
            _ => out.push(char::from(b)),
        }
    }
    Some(out)
}
