//! JSON canonicalization and request fingerprints
//! (crates/idemproxy-core/src/request/fingerprint/mod.rs over
//! crates/idemproxy-core/src/request/jcs/).
//!
//! - `canonical_json(body, &[])` never panics, and is differential-tested
//!   against `serde_json_canonicalizer` (the test oracle the crate itself
//!   uses): where both accept the body, the bytes are equal.
//! - What it accepts is exactly what it documents: JSON text serde_json
//!   accepts, minus I-JSON violations (duplicate member names, integer
//!   literals beyond ±2^53, other number literals whose value is not that
//!   of the shortest decimal their double writes as). Numbers beyond the
//!   double range (`1e400`) are refused by serde_json already.
//! - `FingerprintRules::fingerprint` never panics and is deterministic:
//!   the same request twice, from the memo and from fresh rules, gives the
//!   same fingerprint; whitespace appended to a JSON body (which takes it
//!   past the memo's 4 KiB exact-bytes limit, onto its digest path) changes
//!   nothing; and a JSON body fingerprints as its canonical form does.
//!
//! Excluded on purpose, as the code documents them:
//! - Duplicate names: serde_json's `Value` keeps the last one and the
//!   reference canonicalizes that; `canonical_json` refuses the body
//!   ("parsers disagree on which duplicate wins"). Checked as a refusal
//!   instead of compared.
//! - Integer literals beyond ±2^53: the reference canonicalizes the nearest
//!   double; `canonical_json` refuses the body (2026-12-02 change, so two
//!   64-bit ids never fingerprint alike). Checked as a refusal.
//! - Other literals that round (`1.00000000000000000001`, `1e-400`,
//!   `4.9e-324`): likewise refused since 2026-12-04, so that no two
//!   numbers share a canonical form. serde_json's visitors see only the
//!   double, so the scan takes the literals from the text and decides with
//!   ryu-js, the writer RFC 8785 names. Checked as a refusal.
//! - Canonical output re-read: a double of 2^53 or more is written as an
//!   integer literal (`9007199254740994.0` -> `9007199254740994`), which,
//!   read again, is such a literal and is refused. So `canonical_json` of
//!   its own output is either that output or a refusal of exactly this
//!   kind, not always the output.

#![no_main]

use std::collections::HashSet;
use std::fmt;
use std::sync::OnceLock;

use http::request::Parts;
use idemproxy_core::request::fingerprint::{canonical_json, FingerprintRules};
use libfuzzer_sys::fuzz_target;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

fuzz_target!(|data: &[u8]| {
    let ours = canonical_json(data, &[]);
    assert_eq!(ours, canonical_json(data, &[]), "not deterministic");

    let scan = Scan::of(data);
    let reference = serde_json::from_slice::<serde_json::Value>(data);
    // Both parse with serde_json, so they accept the same JSON text.
    assert_eq!(
        scan.is_some(),
        reference.is_ok(),
        "the scan and serde_json disagree on JSON text: {:?}",
        reference.as_ref().err()
    );
    match (&ours, &reference, &scan) {
        (Some(ours), Ok(value), Some(scan)) => {
            assert!(
                !scan.duplicate && !scan.inexact,
                "accepted a body that is not I-JSON"
            );
            let expected = serde_json_canonicalizer::to_vec(value)
                .expect("the reference canonicalizes every serde_json value");
            assert!(
                ours == &expected,
                "canonical forms differ:\n ours:      {}\n reference: {}",
                String::from_utf8_lossy(ours),
                String::from_utf8_lossy(&expected)
            );
        }
        (Some(_), Err(e), _) => panic!("accepted a body serde_json refuses: {e}"),
        (None, Ok(_), Some(scan)) => assert!(
            scan.duplicate || scan.inexact,
            "refused I-JSON (no duplicate name, no number that rounds)"
        ),
        _ => {}
    }

    if let Some(canonical) = &ours {
        assert!(
            std::str::from_utf8(canonical).is_ok(),
            "output is not UTF-8"
        );
        match canonical_json(canonical, &[]) {
            Some(again) => assert_eq!(&again, canonical, "canonical form is not a fixed point"),
            None => assert!(
                Scan::of(canonical).is_some_and(|s| s.inexact && !s.duplicate),
                "the canonical form is refused for another reason than a large integer"
            ),
        }
    }

    fingerprints(data, ours.as_deref());
});

/// The rule sets fingerprints are taken under: none, and a configured
/// header plus ignore pointers (members, array elements, escapes, a
/// pointer that resolves nowhere).
struct Rules {
    plain: FingerprintRules,
    ignoring: FingerprintRules,
    /// `ignoring`'s headers without its pointers: what an ignoring
    /// fingerprint of a body equals on the body's canonical form.
    ignoring_headers: FingerprintRules,
    json: Parts,
}

const HEADERS: &[&str] = &["x-tenant"];
const IGNORE: &[&str] = &[
    "/a",
    "/items/0",
    "/x~1y/z",
    "/m~0n",
    "/0",
    "/meta/ts",
    "/nowhere/x",
];

fn rules() -> &'static Rules {
    static RULES: OnceLock<Rules> = OnceLock::new();
    RULES.get_or_init(|| {
        let headers: Vec<String> = HEADERS.iter().map(|s| s.to_string()).collect();
        let ignore: Vec<String> = IGNORE.iter().map(|s| s.to_string()).collect();
        let json = http::Request::builder()
            .method("POST")
            .uri("/v1/payments?x=1")
            .header("content-type", "application/json; charset=utf-8")
            .header("x-tenant", "t1")
            .body(())
            .expect("a valid request")
            .into_parts()
            .0;
        Rules {
            plain: FingerprintRules::new(Vec::new(), Vec::new()),
            ignoring: FingerprintRules::parse(&headers, &ignore).expect("valid rules"),
            ignoring_headers: FingerprintRules::parse(&headers, &[]).expect("valid rules"),
            json,
        }
    })
}

/// Bytes appended to a body to take it past the memo's exact-bytes limit
/// (`MEMO_EXACT_MAX`, 4 KiB): trailing whitespace, which no JSON parser
/// reads as content.
const PAD: [u8; 4100] = [b' '; 4100];

fn fingerprints(body: &[u8], canonical: Option<&[u8]>) {
    let r = rules();
    let mut padded = body.to_vec();
    padded.extend_from_slice(&PAD);
    for (rules, ignore) in [(&r.plain, &[][..]), (&r.ignoring, IGNORE)] {
        // Computed, then answered from the memo (JSON), then by rules with
        // a memo of their own: always the same.
        let first = rules.fingerprint(&r.json, body);
        assert_eq!(
            first,
            rules.fingerprint(&r.json, body),
            "memo answer differs"
        );
        let fresh = FingerprintRules::new(rules.headers.clone(), rules.ignore.clone());
        assert_eq!(
            first,
            fresh.fingerprint(&r.json, body),
            "fresh rules differ"
        );

        let ignore: Vec<String> = ignore.iter().map(|s| s.to_string()).collect();
        let canonical_here = canonical_json(body, &ignore);
        if ignore.is_empty() {
            assert_eq!(canonical_here.as_deref(), canonical);
        }
        // Trailing whitespace is nothing: the same canonical form, and the
        // same fingerprint when it is one, now through the digest memo.
        assert_eq!(
            canonical_json(&padded, &ignore),
            canonical_here,
            "padding changed it"
        );
        let padded_fp = rules.fingerprint(&r.json, &padded);
        assert_eq!(
            padded_fp,
            rules.fingerprint(&r.json, &padded),
            "digest memo differs"
        );
        assert_eq!(
            padded_fp,
            fresh.fingerprint(&r.json, &padded),
            "fresh rules differ (padded)"
        );
        if let Some(c) = canonical_here {
            assert_eq!(first, padded_fp, "padded JSON fingerprints differently");
            // A JSON body fingerprints as its canonical form does, when
            // that form is itself I-JSON (see the exclusions above).
            if canonical_json(&c, &[]).as_deref() == Some(&c[..]) {
                let on_canonical = if ignore.is_empty() {
                    &r.plain
                } else {
                    &r.ignoring_headers
                };
                assert_eq!(
                    first,
                    on_canonical.fingerprint(&r.json, &c),
                    "the body and its canonical form fingerprint differently"
                );
            }
        }
    }
}

/// What serde_json reads in a body, as far as I-JSON goes: whether some
/// object repeats a member name, and whether some number literal is not
/// exact (see [`exact`]). `None` when serde_json refuses the text.
#[derive(Default)]
struct Scan {
    duplicate: bool,
    inexact: bool,
    /// The number literals not yet visited, last first.
    literals: Vec<String>,
}

const EXACT_INTEGERS: u64 = 1 << 53;

impl Scan {
    fn of(body: &[u8]) -> Option<Scan> {
        let mut scan = Scan {
            literals: literals(body),
            ..Scan::default()
        };
        scan.literals.reverse();
        let mut de = serde_json::Deserializer::from_slice(body);
        ScanSeed(&mut scan).deserialize(&mut de).ok()?;
        de.end().ok()?;
        Some(scan)
    }

    fn number(&mut self, value: f64) {
        let literal = self.literals.pop().unwrap_or_default();
        self.inexact |= !exact(&literal, value);
    }
}

/// The number literals in `body`, in order: right for any text serde_json
/// accepts, where only they start with `-` or a digit outside strings.
fn literals(body: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(&b) = body.get(at) {
        at += 1;
        match b {
            b'"' => {
                while let Some(&c) = body.get(at) {
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
                while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = body.get(at) {
                    at += 1;
                }
                found.push(String::from_utf8_lossy(&body[start..at]).into_owned());
            }
            _ => {}
        }
    }
    found
}

/// Whether `literal`, read as `value`, is a number of I-JSON: an integer
/// literal up to 2^53 in magnitude, or a decimal with the value of the
/// shortest decimal that reads as `value` (what RFC 8785 writes).
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

/// A decimal as its significant digits and the power of ten of the last
/// one; zero as no digits.
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
    let exponent = exponent - fraction.len() as i128 + (digits.len() - significant.len()) as i128;
    (significant.to_owned(), exponent)
}

struct ScanSeed<'a>(&'a mut Scan);

impl<'de> DeserializeSeed<'de> for ScanSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ScanSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JSON")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.0.number(v as f64);
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.0.number(v as f64);
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        // As `serde_json::Value` does: no infinities (serde_json reports
        // those as errors before a visitor sees them anyway).
        if v.is_finite() {
            self.0.number(v);
            Ok(())
        } else {
            Err(E::custom("number out of range"))
        }
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(ScanSeed(&mut *self.0))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut names = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            self.0.duplicate |= !names.insert(name);
            map.next_value_seed(ScanSeed(&mut *self.0))?;
        }
        Ok(())
    }
}
