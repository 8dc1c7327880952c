//! RFC 8785 (JSON Canonicalization Scheme) serialization of a parsed value.
//!
//! Written here rather than taken from `serde_json_canonicalizer` because
//! fingerprinting sits on every covered request: that crate re-parses every
//! object key and buffers every value separately, about fifty times the cost
//! of hashing the raw body. This one writes into one buffer and sorts keys
//! with a lazy UTF-16 comparison. The crate stays as the test oracle: a
//! property test checks that both produce the same bytes for arbitrary
//! values, besides the RFC's own vectors in `fingerprint.rs`.

use std::cmp::Ordering;

use serde_json::{Map, Number, Value};

/// Appends the canonical form of `value` to `out`.
pub fn write(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => write_object(map, out),
    }
}

/// Properties sorted by their names' UTF-16 code units (RFC 8785 §3.2.3).
/// UTF-8 byte order, which `Map` may iterate in, differs from it for
/// characters above U+E000 next to supplementary ones, so sort explicitly.
fn write_object(map: &Map<String, Value>, out: &mut Vec<u8>) {
    let mut entries: Vec<(&String, &Value)> = map.iter().collect();
    entries.sort_unstable_by(|(a, _), (b, _)| utf16_cmp(a, b));
    out.push(b'{');
    for (i, (key, value)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(key, out);
        out.push(b':');
        write(value, out);
    }
    out.push(b'}');
}

fn utf16_cmp(a: &str, b: &str) -> Ordering {
    // ASCII-only prefixes compare the same in both encodings: skip them
    // without decoding.
    let common = a
        .bytes()
        .zip(b.bytes())
        .take_while(|(x, y)| x == y && x.is_ascii())
        .count();
    a[common..].encode_utf16().cmp(b[common..].encode_utf16())
}

/// Numbers are IEEE 754 doubles serialized as ECMAScript's
/// `Number.prototype.toString` does (RFC 8785 §3.2.2.3); integers beyond
/// 2^53 therefore round, as they would in any I-JSON reader.
fn write_number(n: &Number, out: &mut Vec<u8>) {
    let value = if let Some(i) = n.as_i64() {
        i as f64
    } else if let Some(u) = n.as_u64() {
        u as f64
    } else {
        n.as_f64().unwrap_or(0.0)
    };
    if value == 0.0 {
        // Both zeros are "0".
        out.push(b'0');
        return;
    }
    let mut buffer = ryu_js::Buffer::new();
    out.extend_from_slice(buffer.format_finite(value).as_bytes());
}

/// Strings as ECMAScript's `JSON.stringify` writes them (RFC 8785
/// §3.2.2.2): only `"`, `\` and control characters are escaped, with the
/// short forms where they exist and lower-case `\u00xx` otherwise.
fn write_string(s: &str, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\x08' => b"\\b",
            b'\t' => b"\\t",
            b'\n' => b"\\n",
            b'\x0c' => b"\\f",
            b'\r' => b"\\r",
            0x00..=0x1f => &[],
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canonical(v: &Value) -> String {
        let mut out = Vec::new();
        write(v, &mut out);
        String::from_utf8(out).expect("UTF-8")
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
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
                    "[a-c\u{e000}\u{ffff}\u{10000}\u{1f600}é]{0,3}",
                    inner,
                    0..6
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The oracle: the `serde_json_canonicalizer` crate.
        #[test]
        fn matches_the_reference_implementation(v in arb_json()) {
            let reference = serde_json_canonicalizer::to_string(&v).expect("serializes");
            prop_assert_eq!(canonical(&v), reference);
        }
    }

    #[test]
    fn keys_sort_by_utf16_code_units() {
        // U+1F600 (surrogates D83D DE00) sorts before U+E000 in UTF-16,
        // after it in UTF-8.
        let v: Value = serde_json::from_str(r#"{"\ue000":1,"😀":2,"a":3}"#).expect("json");
        assert_eq!(canonical(&v), "{\"a\":3,\"😀\":2,\"\u{e000}\":1}");
    }

    #[test]
    fn numbers_follow_ecmascript() {
        let v: Value =
            serde_json::from_str("[0, -0.0, 1.0, 1e21, 1e-7, 123456789012345678901, 0.1]")
                .expect("json");
        assert_eq!(
            canonical(&v),
            "[0,0,1,1e+21,1e-7,123456789012345680000,0.1]"
        );
    }
}
