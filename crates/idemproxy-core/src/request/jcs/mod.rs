//! RFC 8785 (JSON Canonicalization Scheme): a body parsed into a
//! [`Document`] and written in canonical form.
//!
//! Written here rather than taken from `serde_json_canonicalizer` because
//! fingerprinting sits on every covered request: that crate re-parses every
//! object key and buffers every value separately, about fifty times the cost
//! of hashing the raw body. Even a `serde_json::Value` costs an allocation
//! per key, string and container, a recursive drop, and a map per object.
//! So a parser of our own (`parse.rs`) reads the body in one pass, into a
//! flat document that borrows every string without escapes from the body;
//! it accepts exactly what serde_json accepts (UTF-8, escapes, lone
//! surrogates, control characters, nesting depth, trailing data) and reads
//! every number as the same double, held to serde_json's deserializer by a
//! differential property test. Each object's members are sorted once, while
//! parsing, which is also where duplicate names show up, as neighbours. The
//! writer streams into any [`Sink`], so a fingerprint hashes the canonical
//! form without buffering it, and writes the usual short numbers without
//! ryu.
//!
//! The crate stays as the test oracle: a property test checks that both
//! produce the same bytes for arbitrary values, besides the RFC's own
//! vectors in `fingerprint.rs`.

mod parse;
mod scan;
mod stream;
mod write;

pub(super) use stream::with_canonical;

use std::borrow::Cow;
use std::cmp::Ordering;

/// A parsed I-JSON document, borrowing from the body it was parsed from.
///
/// Every value sits in one `Vec` in document order: an array or object is a
/// header followed by its contents, and the header records where they end.
/// So containers cost no allocation of their own (only strings with escapes
/// do), and dropping the document is a loop, not a recursion. An object's
/// members stay in document order; the order they are written in is the
/// sorted list of their positions, kept for all objects in a second `Vec`.
#[derive(Debug)]
pub(super) struct Document<'a> {
    tape: Vec<Entry<'a>>,
    /// Positions of object member names, each object's run sorted.
    order: Vec<usize>,
    /// Whether any [`Entry::Inexact`] was parsed.
    inexact: bool,
}

/// A value in a [`Document`]; the root is [`Document::root`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NodeId(usize);

/// What a JSON pointer can step into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
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
    /// A number literal whose canonical form would not be its value (see
    /// `parse::EXACT_INTEGERS`): the document is not
    /// I-JSON unless an ignore pointer removes it ([`Document::is_exact`]).
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

impl Document<'_> {
    /// False while the document still holds a number literal whose
    /// canonical form is not its value: it is not I-JSON, and its canonical
    /// form would make `9007199254740993` and `9007199254740992` (or `1e-400`
    /// and `0`) alike. Checked after
    /// the ignore pointers are removed, so that such a number in an ignored
    /// member (a nanosecond timestamp) does not matter. Free for documents
    /// without one.
    pub(super) fn is_exact(&self) -> bool {
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

    pub(super) fn root(&self) -> NodeId {
        NodeId(0)
    }

    pub(super) fn kind(&self, node: NodeId) -> Kind {
        match self.tape.get(node.0) {
            Some(Entry::Object { .. }) => Kind::Object,
            Some(Entry::Array { .. }) => Kind::Array,
            _ => Kind::Scalar,
        }
    }

    /// The value of `object`'s member `name`.
    pub(super) fn member(&self, object: NodeId, name: &str) -> Option<NodeId> {
        let names = self.members(object);
        let i = names
            .binary_search_by(|&at| utf16_cmp(self.name(at), name))
            .ok()?;
        names.get(i).map(|&at| NodeId(at + 1))
    }

    /// Element `index` of `array`, counting only elements not removed.
    pub(super) fn element(&self, array: NodeId, index: usize) -> Option<NodeId> {
        self.elements(array).nth(index).map(NodeId)
    }

    /// Removes `object`'s member `name`; false if there is none.
    pub(super) fn remove_member(&mut self, object: NodeId, name: &str) -> bool {
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
    pub(super) fn remove_element(&mut self, array: NodeId, index: usize) -> bool {
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
pub(super) trait Sink {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    /// The canonical form of `json` from the tape, checked against the one
    /// written while parsing.
    pub(super) fn canonical(json: &str) -> String {
        let doc = Document::parse(json.as_bytes()).expect("JSON");
        assert!(doc.is_exact(), "I-JSON: {json}");
        let mut out = Vec::new();
        doc.write(&mut out);
        let mut streamed = stream::Canonical::default();
        assert_eq!(
            streamed.write(json.as_bytes()).map(<[u8]>::to_vec),
            Ok(out.clone()),
            "{json}"
        );
        String::from_utf8(out).expect("UTF-8")
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
}
