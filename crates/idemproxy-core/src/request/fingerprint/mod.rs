//! The request fingerprint: what makes a retry "the same request".
//!
//! A key reused with a different request is a client bug that must surface
//! (409/422) instead of silently replaying someone else's response, so the
//! fingerprint covers everything that changes what the upstream would do:
//! method, path and query, content type, the operator's chosen headers, and
//! the body. It must also be stable across harmless re-serialization, or a
//! retrying SDK that rebuilds its JSON would be told it reused the key; hence
//! JSON bodies are hashed in their RFC 8785 (JCS) canonical form.
//!
//! # Hash input
//!
//! SHA-256 over a version tag, then each field framed so that no two
//! different requests produce the same byte stream:
//!
//! 1. method, length-prefixed (u64 big-endian);
//! 2. path and query exactly as sent (no query reordering, no
//!    percent-decoding: upstreams differ in how they read these, so only
//!    byte equality is safe), length-prefixed;
//! 3. the `content-type` values (header framing below);
//! 4. the number of configured headers, then for each its name
//!    (length-prefixed) and values (header framing);
//! 5. the body: a tag (`J` canonical JSON, `R` raw bytes), then the bytes and
//!    their length.
//!
//! Header framing: each value is `0x01`, its length, its bytes, in the order
//! received; the list ends with `0x00`. An absent header is therefore `0x00`
//! alone and differs from a header present with an empty value.
//!
//! # JSON bodies
//!
//! A body is canonicalized only when the content type says JSON
//! (`application/json` or any `+json` subtype, parameters ignored,
//! case-insensitive) *and* it is I-JSON (RFC 7493, which RFC 8785 requires):
//! it parses, has no duplicate object keys and no numbers outside the double
//! range. Anything else, including a JSON body sent under another content
//! type, is hashed as raw bytes: the proxy cannot know that the upstream
//! reads such a body as JSON, and raw hashing can only cause a spurious
//! mismatch, never a wrong replay. Duplicate keys are treated as not JSON for
//! the same reason: parsers disagree on which duplicate wins.
//!
//! As RFC 8785 prescribes, every number is an IEEE 754 double: `1`, `1.0`
//! and `1e0` fingerprint alike. An integer literal beyond ±2^53, which a
//! double cannot hold exactly (a 64-bit id, say), makes the body not
//! I-JSON, so it is hashed raw: two ids past 2^53 never fingerprint alike.
//! So does any other literal whose value is not that of its double's
//! canonical form (`1.00000000000000000001`, `1e-400`, `4.9e-324`,
//! `333333333.33333329`): it would fingerprint like the number the double
//! writes as. APIs that need exact big numbers send them as strings, which
//! JCS keeps exact.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use http::header::{GetAll, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderName, HeaderValue};
use quick_cache::sync::Cache;
use quick_cache::Equivalent;
use sha2::{Digest, Sha256};

use super::jcs::{with_canonical, Document, Kind, NodeId, Sink};
use super::key::trim_ows;
use crate::core::Fingerprint;

/// Bumping this changes every fingerprint, which turns every in-flight
/// retry across a deploy into a mismatch; do it only with the record format.
const DOMAIN: &[u8] = b"idemproxy.fingerprint.v1\0";

/// What goes into a fingerprint besides method, path, query, content type and body.
#[derive(Clone, Debug, Default)]
pub struct FingerprintRules {
    pub headers: Vec<HeaderName>,
    /// RFC 6901 JSON pointers removed from a JSON body before hashing.
    /// Applied in order; removing an array element shifts the later ones,
    /// so a second pointer into the same array sees the shifted indices.
    pub ignore: Vec<String>,
    memo: CanonicalMemo,
}

/// Canonical fingerprints of recent JSON requests, by what was sent.
///
/// A retry is almost always the same bytes sent again, and canonicalizing
/// a body costs several times as much as hashing it raw. So a JSON request
/// seen before gets its canonical fingerprint from here. Sound because the
/// canonical fingerprint is a function of exactly those bytes under this
/// route's rules (one memo per rules). Shared by clones.
///
/// Up to [`MEMO_EXACT_MAX`] bytes, an entry is keyed by the bytes
/// themselves (the framed fields, then the body), found by a fast hash and
/// confirmed by comparing them: no SHA-256 over the body at all, which was
/// a fifth of an in-process replay. Larger requests are keyed by their raw
/// SHA-256 fingerprint (SHA-256 does not collide), so the memo's memory
/// stays bounded by [`MEMO_BYTES`].
#[derive(Clone)]
struct CanonicalMemo(Arc<Cache<MemoKey, Fingerprint, MemoWeight>>);

#[derive(Clone, PartialEq, Eq)]
enum MemoKey {
    Exact(Box<[u8]>),
    Digest(Fingerprint),
}

/// Hashed as its bytes alone, as [`ExactBytes`] is: a lookup borrows the
/// request's bytes instead of copying them into a key it then drops.
impl Hash for MemoKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        match self {
            MemoKey::Exact(bytes) => bytes.hash(state),
            MemoKey::Digest(digest) => digest.0.hash(state),
        }
    }
}

/// A request's bytes, looked up as a [`MemoKey::Exact`].
struct ExactBytes<'a>(&'a [u8]);

impl Hash for ExactBytes<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl Equivalent<MemoKey> for ExactBytes<'_> {
    fn equivalent(&self, key: &MemoKey) -> bool {
        matches!(key, MemoKey::Exact(bytes) if **bytes == *self.0)
    }
}

thread_local! {
    /// Where a request's framed fields (and, for a JSON request the memo
    /// keeps by its bytes, its body) are put together: one buffer per
    /// thread, reused, instead of an allocation per request.
    static REQUEST_BYTES: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Requests up to this size are remembered by their bytes.
const MEMO_EXACT_MAX: usize = 4 * 1024;

/// What the entries of one memo may hold in all: a retry window's worth of
/// distinct requests at a few thousand a second (~3,000 of 1 KB).
const MEMO_BYTES: u64 = 4 * 1024 * 1024;

/// An entry's weight: its key's bytes and the bookkeeping around them.
#[derive(Clone)]
struct MemoWeight;

impl quick_cache::Weighter<MemoKey, Fingerprint> for MemoWeight {
    fn weight(&self, key: &MemoKey, _: &Fingerprint) -> u64 {
        let bytes = match key {
            MemoKey::Exact(bytes) => bytes.len(),
            MemoKey::Digest(_) => 0,
        };
        // usize is at most 64 bits on every supported target.
        bytes as u64 + 96
    }
}

impl Default for CanonicalMemo {
    fn default() -> Self {
        Self(Arc::new(Cache::with_weighter(
            (MEMO_BYTES / 1024) as usize,
            MEMO_BYTES,
            MemoWeight,
        )))
    }
}

impl fmt::Debug for CanonicalMemo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CanonicalMemo")
            .field("entries", &self.0.len())
            .finish()
    }
}

impl FingerprintRules {
    /// The rules from parsed parts: header names (see [`parse_header`])
    /// and JSON pointers checked by [`validate_pointer`].
    pub fn new(headers: Vec<HeaderName>, ignore: Vec<String>) -> Self {
        Self {
            headers,
            ignore,
            memo: CanonicalMemo::default(),
        }
    }

    /// Parses configuration strings, naming the first bad one: for tests
    /// and tools. The proxy's configuration is parsed field by field at the
    /// composition root, with the same [`parse_header`] and
    /// [`validate_pointer`], so that every bad entry is reported.
    pub fn parse(headers: &[String], ignore: &[String]) -> Result<Self, String> {
        let headers = headers
            .iter()
            .map(|h| parse_header(h))
            .collect::<Result<Vec<_>, _>>()?;
        for ptr in ignore {
            validate_pointer(ptr)?;
        }
        Ok(Self::new(headers, ignore.to_vec()))
    }

    pub fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        REQUEST_BYTES.with(|buffer| match buffer.try_borrow_mut() {
            Ok(mut bytes) => {
                bytes.clear();
                self.fingerprint_with(parts, body, &mut bytes)
            }
            // Only if fingerprinting ever ran inside itself: a buffer of its
            // own rather than a panic.
            Err(_) => self.fingerprint_with(parts, body, &mut Vec::new()),
        })
    }

    /// [`FingerprintRules::fingerprint`], with `bytes` (empty) to put the
    /// request together in.
    fn fingerprint_with(&self, parts: &Parts, body: &[u8], bytes: &mut Vec<u8>) -> Fingerprint {
        // The fields before the body, framed: hashed as they are, and the
        // start of the memo's key for a JSON request.
        bytes.extend_from_slice(DOMAIN);
        put_field(bytes, parts.method.as_str().as_bytes());
        // `None` only for authority-form targets (CONNECT), never proxied here.
        let target = parts.uri.path_and_query().map_or("", |pq| pq.as_str());
        put_field(bytes, target.as_bytes());
        put_values(bytes, parts.headers.get_all(CONTENT_TYPE));
        put_len(bytes, self.headers.len());
        for name in &self.headers {
            put_field(bytes, name.as_str().as_bytes());
            put_values(bytes, parts.headers.get_all(name));
        }
        // The fields hashed, once the memo has not answered: a retry the
        // memo knows never starts SHA-256 at all.
        let fields = bytes.len();
        let hashed = |bytes: &[u8]| {
            let mut h = Sha256::new();
            h.update(bytes.get(..fields).unwrap_or_default());
            h
        };
        if !declares_json(parts.headers.get_all(CONTENT_TYPE)) {
            return raw_fingerprint(hashed(bytes), body);
        }
        // The fields are framed, so they and the body that follows them
        // read back one way only: equal keys are equal requests.
        let digest = if body.len() <= MEMO_EXACT_MAX {
            bytes.extend_from_slice(body);
            if let Some(canonical) = self.memo.0.get(&ExactBytes(bytes)) {
                return canonical;
            }
            None
        } else {
            let raw = raw_fingerprint(hashed(bytes), body);
            if let Some(canonical) = self.memo.0.get(&MemoKey::Digest(raw)) {
                return canonical;
            }
            Some(raw)
        };
        let mut h = hashed(bytes);
        let hashed_json = if self.ignore.is_empty() {
            // Without pointers to remove, the canonical form is written
            // while parsing, and hashed in one call.
            with_canonical(body, |canonical| {
                h.update(b"J");
                h.update(canonical);
                // usize is at most 64 bits on every supported target.
                h.update((canonical.len() as u64).to_be_bytes());
            })
            .is_some()
        } else {
            match parse_ijson(body, &self.ignore) {
                Some(doc) => {
                    h.update(b"J");
                    let mut sink = HashSink::new(&mut h);
                    doc.write(&mut sink);
                    let len = sink.finish();
                    h.update(len.to_be_bytes());
                    true
                }
                None => false,
            }
        };
        if !hashed_json {
            return digest.unwrap_or_else(|| raw_fingerprint(h, body));
        }
        let canonical = Fingerprint(h.finalize().into());
        let key = match digest {
            Some(raw) => MemoKey::Digest(raw),
            None => MemoKey::Exact(bytes.as_slice().into()),
        };
        self.memo.0.insert(key, canonical);
        canonical
    }
}

/// The fingerprint with the body hashed as the bytes sent (tag `R`).
fn raw_fingerprint(mut h: Sha256, body: &[u8]) -> Fingerprint {
    h.update(b"R");
    // usize is at most 64 bits on every supported target.
    h.update((body.len() as u64).to_be_bytes());
    h.update(body);
    Fingerprint(h.finalize().into())
}

/// The RFC 8785 canonical form of `body` minus the `ignore` pointers, or
/// `None` when `body` is not I-JSON (and so would be hashed raw).
///
/// Exactly what [`FingerprintRules::fingerprint`] hashes for a JSON body,
/// exposed so tests and tooling can show an operator why two bodies do or
/// do not count as the same request.
pub fn canonical_json(body: &[u8], ignore: &[String]) -> Option<Vec<u8>> {
    if ignore.is_empty() {
        return with_canonical(body, <[u8]>::to_vec);
    }
    let doc = parse_ijson(body, ignore)?;
    let mut out = Vec::with_capacity(body.len());
    doc.write(&mut out);
    Some(out)
}

/// Duplicate keys are rejected while parsing, before any pointer applies:
/// one inside an ignored member still makes the body not I-JSON. An integer
/// a double cannot hold exactly counts only if it is not ignored (a
/// nanosecond timestamp in an ignored member is common).
fn parse_ijson<'a>(body: &'a [u8], ignore: &[String]) -> Option<Document<'a>> {
    let mut doc = Document::parse(body).ok()?;
    for ptr in ignore {
        remove_pointer(&mut doc, ptr);
    }
    doc.is_exact().then_some(doc)
}

/// Feeds the canonical form to the hasher in large chunks: it is written a
/// few bytes at a time, and `Sha256::update` costs more per call than a
/// copy into this buffer. Counts the bytes for the length that follows.
struct HashSink<'h> {
    hasher: &'h mut Sha256,
    buf: [u8; 1024],
    filled: usize,
    total: u64,
}

impl<'h> HashSink<'h> {
    fn new(hasher: &'h mut Sha256) -> Self {
        Self {
            hasher,
            buf: [0; 1024],
            filled: 0,
            total: 0,
        }
    }

    fn flush(&mut self) {
        let pending = self.buf.get(..self.filled).unwrap_or_default();
        self.hasher.update(pending);
        // usize is at most 64 bits on every supported target.
        self.total += pending.len() as u64;
        self.filled = 0;
    }

    /// Kept out of line so that `put`, inlined, is a bounds check and a
    /// copy of a length often known at compile time.
    #[cold]
    #[inline(never)]
    fn put_slow(&mut self, bytes: &[u8]) {
        self.flush();
        match self.buf.get_mut(..bytes.len()) {
            Some(dst) => {
                dst.copy_from_slice(bytes);
                self.filled = bytes.len();
            }
            None => {
                self.hasher.update(bytes);
                self.total += bytes.len() as u64;
            }
        }
    }

    /// Hashes what is buffered; returns the number of bytes written.
    fn finish(mut self) -> u64 {
        self.flush();
        self.total
    }
}

impl Sink for HashSink<'_> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        let end = self.filled + bytes.len();
        match self.buf.get_mut(self.filled..end) {
            Some(dst) => {
                dst.copy_from_slice(bytes);
                self.filled = end;
            }
            None => self.put_slow(bytes),
        }
    }
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    // usize is at most 64 bits on every supported target.
    out.extend_from_slice(&(len as u64).to_be_bytes());
}

fn put_field(out: &mut Vec<u8>, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.extend_from_slice(bytes);
}

fn put_values(out: &mut Vec<u8>, values: GetAll<'_, HeaderValue>) {
    for v in values {
        out.push(1);
        put_field(out, v.as_bytes());
    }
    out.push(0);
}

/// Only a single `content-type` counts: with several, which one the
/// upstream obeys is anyone's guess, so the body is treated as opaque.
fn declares_json(values: GetAll<'_, HeaderValue>) -> bool {
    let mut it = values.iter();
    match (it.next(), it.next()) {
        (Some(v), None) => is_json_media_type(v.as_bytes()),
        _ => false,
    }
}

fn is_json_media_type(value: &[u8]) -> bool {
    let essence = value.split(|&b| b == b';').next().unwrap_or_default();
    let essence = trim_ows(essence);
    if essence.eq_ignore_ascii_case(b"application/json") {
        return true;
    }
    let Some(slash) = essence.iter().position(|&b| b == b'/') else {
        return false;
    };
    let (ty, subtype) = essence.split_at(slash);
    let subtype = subtype.get(1..).unwrap_or_default();
    const SUFFIX: &[u8] = b"+json";
    !ty.is_empty()
        && subtype.len() > SUFFIX.len()
        && subtype
            .get(subtype.len() - SUFFIX.len()..)
            .is_some_and(|s| s.eq_ignore_ascii_case(SUFFIX))
}

/// A `fingerprint_headers` entry as a header name (lower-cased).
pub fn parse_header(name: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("`{name}` is not a valid header name"))
}

/// Checks what `remove_pointer` would otherwise silently ignore, so a typo
/// in the configuration is reported instead of never matching.
pub fn validate_pointer(ptr: &str) -> Result<(), String> {
    if ptr.is_empty() {
        return Err("`` (the empty JSON pointer) would ignore the whole body; \
                    name a member, e.g. `/metadata/sent_at`"
            .to_owned());
    }
    if !ptr.starts_with('/') {
        return Err(format!(
            "`{ptr}` is not a JSON pointer: it must start with `/` (RFC 6901)"
        ));
    }
    let bytes = ptr.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'~' && !matches!(bytes.get(i + 1), Some(b'0' | b'1')) {
            return Err(format!(
                "`{ptr}` is not a JSON pointer: `~` must be followed by `0` or `1` \
                 (write `~0` for `~` and `~1` for `/`)"
            ));
        }
    }
    Ok(())
}

/// Removes the member or element `ptr` points to; a pointer that does not
/// resolve is a no-op, because the ignored field is often optional.
fn remove_pointer(doc: &mut Document<'_>, ptr: &str) {
    if !ptr.starts_with('/') {
        return;
    }
    let Some((parent, last)) = ptr.rsplit_once('/') else {
        return;
    };
    let Some(parent) = resolve(doc, parent) else {
        return;
    };
    match doc.kind(parent) {
        Kind::Object => {
            doc.remove_member(parent, &unescape_token(last));
        }
        Kind::Array => {
            if let Some(i) = array_index(last) {
                doc.remove_element(parent, i);
            }
        }
        Kind::Scalar => {}
    }
}

/// The value `pointer` refers to, resolved as `serde_json::Value::pointer_mut`
/// did when bodies were parsed into `Value`s: what an ignore rule matches
/// must not change across versions.
fn resolve(doc: &Document<'_>, pointer: &str) -> Option<NodeId> {
    if pointer.is_empty() {
        return Some(doc.root());
    }
    if !pointer.starts_with('/') {
        return None;
    }
    pointer
        .split('/')
        .skip(1)
        .try_fold(doc.root(), |at, token| {
            let token = parent_token(token);
            match doc.kind(at) {
                Kind::Object => doc.member(at, &token),
                // serde_json's index rule is `array_index`'s: digits only, no
                // sign, no leading zero.
                Kind::Array => array_index(&token).and_then(|i| doc.element(at, i)),
                Kind::Scalar => None,
            }
        })
}

/// serde_json's decoding of the parent path's tokens: `~1` then `~0`
/// replaced throughout. It equals `unescape_token` for every pointer that
/// configuration validation accepts; only invalid escapes, possible when
/// the rules are built without `new`, decode differently, and those keep
/// their old meaning too.
fn parent_token(token: &str) -> Cow<'_, str> {
    if token.contains('~') {
        Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
    } else {
        Cow::Borrowed(token)
    }
}

/// RFC 6901 §4: `~1` is `/` and `~0` is `~`, decoded left to right so that
/// `~01` is `~1`, not `/`.
fn unescape_token(token: &str) -> Cow<'_, str> {
    if !token.contains('~') {
        return Cow::Borrowed(token);
    }
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        if c != '~' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('0') => out.push('~'),
            Some('1') => out.push('/'),
            // Invalid escapes are kept literally, as serde_json does for
            // the parent path; configuration validation rejects them.
            Some(other) => {
                out.push('~');
                out.push(other);
            }
            None => out.push('~'),
        }
    }
    Cow::Owned(out)
}

/// RFC 6901 array index: `0` or digits without a leading zero. `-` (the
/// element past the end) never exists, so it resolves to nothing.
fn array_index(token: &str) -> Option<usize> {
    let bytes = token.as_bytes();
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    if bytes.len() > 1 && bytes.first() == Some(&b'0') {
        return None;
    }
    token.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Method, Request};
    use proptest::prelude::*;
    use serde_json::{Number, Value};

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("valid request").into_parts().0
    }

    fn json_parts() -> Parts {
        parts(
            "POST",
            "/v1/payments",
            &[("content-type", "application/json")],
        )
    }

    fn rules(headers: &[&str], ignore: &[&str]) -> FingerprintRules {
        let h: Vec<String> = headers.iter().map(|s| s.to_string()).collect();
        let i: Vec<String> = ignore.iter().map(|s| s.to_string()).collect();
        FingerprintRules::parse(&h, &i).expect("valid rules")
    }

    fn fp(r: &FingerprintRules, p: &Parts, body: &str) -> Fingerprint {
        r.fingerprint(p, body.as_bytes())
    }

    fn canon(body: &str) -> String {
        let out = canonical_json(body.as_bytes(), &[]).expect("I-JSON");
        String::from_utf8(out).expect("UTF-8")
    }

    fn ptrs(ps: &[&str]) -> Vec<String> {
        ps.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn deterministic() {
        let r = rules(&["x-tenant"], &["/a"]);
        let p = parts(
            "POST",
            "/x?b=1&a=2",
            &[("content-type", "application/json"), ("x-tenant", "t")],
        );
        assert_eq!(
            fp(&r, &p, r#"{"a":1,"b":2}"#),
            fp(&r, &p, r#"{"a":1,"b":2}"#)
        );
    }

    #[test]
    fn method_changes_fingerprint() {
        let r = FingerprintRules::default();
        let a = parts("POST", "/x", &[]);
        let b = parts("PATCH", "/x", &[]);
        assert_ne!(fp(&r, &a, "{}"), fp(&r, &b, "{}"));
        let c = parts("PUT", "/x", &[]);
        assert_ne!(fp(&r, &a, "{}"), fp(&r, &c, "{}"));
        let ext = Method::from_bytes(b"POSTX").expect("extension method");
        let mut d = parts("POST", "/x", &[]);
        d.method = ext;
        assert_ne!(fp(&r, &a, "{}"), fp(&r, &d, "{}"));
    }

    #[test]
    fn path_changes_fingerprint() {
        let r = FingerprintRules::default();
        assert_ne!(
            fp(&r, &parts("POST", "/v1/a", &[]), ""),
            fp(&r, &parts("POST", "/v1/b", &[]), "")
        );
        assert_ne!(
            fp(&r, &parts("POST", "/v1/a", &[]), ""),
            fp(&r, &parts("POST", "/v1/a/", &[]), "")
        );
        // As sent: no percent-decoding.
        assert_ne!(
            fp(&r, &parts("POST", "/v1/a%62", &[]), ""),
            fp(&r, &parts("POST", "/v1/ab", &[]), "")
        );
    }

    #[test]
    fn query_changes_fingerprint_and_is_not_reordered() {
        let r = FingerprintRules::default();
        let base = fp(&r, &parts("POST", "/x?a=1&b=2", &[]), "");
        assert_ne!(base, fp(&r, &parts("POST", "/x?a=1&b=3", &[]), ""));
        assert_ne!(base, fp(&r, &parts("POST", "/x?b=2&a=1", &[]), ""));
        assert_ne!(base, fp(&r, &parts("POST", "/x", &[]), ""));
        assert_ne!(
            fp(&r, &parts("POST", "/x", &[]), ""),
            fp(&r, &parts("POST", "/x?", &[]), "")
        );
    }

    #[test]
    fn absolute_form_uses_path_and_query_only() {
        let r = FingerprintRules::default();
        assert_eq!(
            fp(&r, &parts("POST", "http://a.example/x?q=1", &[]), ""),
            fp(&r, &parts("POST", "/x?q=1", &[]), "")
        );
    }

    #[test]
    fn content_type_changes_fingerprint() {
        let r = FingerprintRules::default();
        let body = r#"{"a":1}"#;
        let json = fp(
            &r,
            &parts("POST", "/x", &[("content-type", "application/json")]),
            body,
        );
        let charset = fp(
            &r,
            &parts(
                "POST",
                "/x",
                &[("content-type", "application/json; charset=utf-8")],
            ),
            body,
        );
        let text = fp(
            &r,
            &parts("POST", "/x", &[("content-type", "text/plain")]),
            body,
        );
        let none = fp(&r, &parts("POST", "/x", &[]), body);
        let empty = fp(&r, &parts("POST", "/x", &[("content-type", "")]), body);
        let all = [json, charset, text, none, empty];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn configured_header_changes_fingerprint() {
        let r = rules(&["X-Tenant"], &[]);
        let a = fp(&r, &parts("POST", "/x", &[("x-tenant", "a")]), "");
        let b = fp(&r, &parts("POST", "/x", &[("x-tenant", "b")]), "");
        assert_ne!(a, b);
        // Header names are case-insensitive on the wire.
        let c = fp(&r, &parts("POST", "/x", &[("X-TENANT", "a")]), "");
        assert_eq!(a, c);
    }

    #[test]
    fn configured_header_all_values_in_order() {
        let r = rules(&["x-tag"], &[]);
        let one = fp(&r, &parts("POST", "/x", &[("x-tag", "a")]), "");
        let two = fp(
            &r,
            &parts("POST", "/x", &[("x-tag", "a"), ("x-tag", "b")]),
            "",
        );
        let swapped = fp(
            &r,
            &parts("POST", "/x", &[("x-tag", "b"), ("x-tag", "a")]),
            "",
        );
        let joined = fp(&r, &parts("POST", "/x", &[("x-tag", "ab")]), "");
        assert_ne!(one, two);
        assert_ne!(two, swapped);
        assert_ne!(two, joined);
    }

    #[test]
    fn unconfigured_header_does_not_change_fingerprint() {
        let r = rules(&["x-tenant"], &[]);
        let a = fp(&r, &parts("POST", "/x", &[("x-request-id", "1")]), "");
        let b = fp(&r, &parts("POST", "/x", &[("x-request-id", "2")]), "");
        let c = fp(&r, &parts("POST", "/x", &[]), "");
        assert_eq!(a, b);
        assert_eq!(a, c);
    }

    #[test]
    fn absent_and_empty_header_differ() {
        let r = rules(&["x-tenant"], &[]);
        let absent = fp(&r, &parts("POST", "/x", &[]), "");
        let empty = fp(&r, &parts("POST", "/x", &[("x-tenant", "")]), "");
        assert_ne!(absent, empty);
    }

    #[test]
    fn configured_header_list_is_part_of_the_fingerprint() {
        // Same request, different rules: must not compare equal by accident.
        let p = parts("POST", "/x", &[]);
        assert_ne!(
            fp(&rules(&[], &[]), &p, ""),
            fp(&rules(&["x-a"], &[]), &p, "")
        );
        assert_ne!(
            fp(&rules(&["x-a"], &[]), &p, ""),
            fp(&rules(&["x-b"], &[]), &p, "")
        );
    }

    #[test]
    fn body_changes_fingerprint() {
        let r = FingerprintRules::default();
        let p = json_parts();
        assert_ne!(fp(&r, &p, r#"{"amount":1}"#), fp(&r, &p, r#"{"amount":2}"#));
        let t = parts("POST", "/x", &[]);
        assert_ne!(fp(&r, &t, "a"), fp(&r, &t, "b"));
        assert_ne!(fp(&r, &t, ""), fp(&r, &t, "\0"));
    }

    #[test]
    fn json_key_order_and_whitespace_do_not_matter() {
        let r = FingerprintRules::default();
        let p = json_parts();
        let a = fp(&r, &p, r#"{"a":1,"b":{"c":[1,2],"d":"x"}}"#);
        let b = fp(
            &r,
            &p,
            "{ \"b\" : {\n\t\"d\": \"x\", \"c\": [ 1 , 2 ] },\r\n \"a\": 1 }\n",
        );
        assert_eq!(a, b);
        // But array order does.
        assert_ne!(a, fp(&r, &p, r#"{"a":1,"b":{"c":[2,1],"d":"x"}}"#));
    }

    #[test]
    fn json_escapes_do_not_matter() {
        let r = FingerprintRules::default();
        let p = json_parts();
        assert_eq!(
            fp(&r, &p, r#"{"k":"é/"}"#),
            fp(&r, &p, r#"{"\u006b":"\u00e9\/"}"#)
        );
    }

    #[test]
    fn json_suffix_and_parameters_and_case() {
        let r = FingerprintRules::default();
        for ct in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "application/problem+json",
            "application/vnd.api+JSON ; q=1",
            "application/merge-patch+json",
        ] {
            let p = parts("POST", "/x", &[("content-type", ct)]);
            assert_eq!(
                fp(&r, &p, r#"{"a":1,"b":2}"#),
                fp(&r, &p, r#"{"b":2, "a":1}"#),
                "{ct} should be canonicalized"
            );
        }
        for ct in [
            "text/plain",
            "application/jsonx",
            "application/json-seq",
            "application/x-json-stream",
            "+json",
            "application/+json",
            "/foo+json",
        ] {
            let p = parts("POST", "/x", &[("content-type", ct)]);
            assert_ne!(
                fp(&r, &p, r#"{"a":1,"b":2}"#),
                fp(&r, &p, r#"{"b":2, "a":1}"#),
                "{ct} should be hashed raw"
            );
        }
    }

    #[test]
    fn json_without_json_content_type_is_hashed_raw() {
        let r = FingerprintRules::default();
        let p = parts("POST", "/x", &[]);
        assert_ne!(
            fp(&r, &p, r#"{"a":1,"b":2}"#),
            fp(&r, &p, r#"{"b":2,"a":1}"#)
        );
        let p = parts("POST", "/x", &[("content-type", "text/plain")]);
        assert_ne!(fp(&r, &p, r#"{"a":1}"#), fp(&r, &p, r#"{ "a":1}"#));
    }

    #[test]
    fn duplicate_content_type_is_hashed_raw() {
        let r = FingerprintRules::default();
        let p = parts(
            "POST",
            "/x",
            &[
                ("content-type", "application/json"),
                ("content-type", "application/json"),
            ],
        );
        assert_ne!(
            fp(&r, &p, r#"{"a":1,"b":2}"#),
            fp(&r, &p, r#"{"b":2,"a":1}"#)
        );
    }

    #[test]
    fn unparsable_json_is_hashed_raw() {
        let r = FingerprintRules::default();
        let p = json_parts();
        // Distinct, deterministic, and no panic.
        let a = fp(&r, &p, r#"{"a":1"#);
        assert_eq!(a, fp(&r, &p, r#"{"a":1"#));
        assert_ne!(a, fp(&r, &p, r#"{"a": 1"#));
        assert_eq!(canonical_json(br#"{"a":1"#, &[]), None);
        assert_eq!(canonical_json(b"{} {}", &[]), None);
        assert_eq!(canonical_json(b"", &[]), None);
        assert_eq!(canonical_json(b"\xEF\xBB\xBF{}", &[]), None);
        assert_eq!(canonical_json(b"[1e400]", &[]), None);
        assert_eq!(canonical_json(br#"["\ud800"]"#, &[]), None);
        assert_eq!(canonical_json(b"{\"a\":\"\xFF\"}", &[]), None);
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(canonical_json(deep.as_bytes(), &[]), None);
        let _ = fp(&r, &p, &deep);
    }

    #[test]
    fn a_repeated_json_request_is_answered_from_the_memo_alike() {
        let r = rules(&[], &["/ts"]);
        let p = json_parts();
        let body = r#"{"b":1,"a":[1,2.50],"ts":"now"}"#;
        let first = fp(&r, &p, body);
        assert_eq!(r.memo.0.len(), 1);
        // What the memo answered is what canonicalizing computes.
        assert_eq!(fp(&rules(&[], &["/ts"]), &p, body), first);
        // The same bytes again are answered from the memo, not recomputed.
        let marker = Fingerprint([0xee; 32]);
        mark_memo(&r, marker);
        assert_eq!(fp(&r, &p, body), marker, "answered from the memo");
        // Other bytes with the same canonical form: a miss, the same answer.
        assert_eq!(fp(&r, &p, r#"{"a":[1,2.5],"b":1,"ts":"later"}"#), first);
        assert_eq!(r.memo.0.len(), 2);
        // Rules are part of what the memo answers for: each rules has its own.
        assert_ne!(fp(&rules(&[], &[]), &p, body), first);
        // Not I-JSON: the raw fingerprint, nothing memoized.
        let dup = r#"{"a":1,"a":2}"#;
        assert_eq!(fp(&r, &p, dup), fp(&r, &p, dup));
        assert_eq!(r.memo.0.len(), 2);
        // The same request with another target or content type is another
        // entry, not a hit on this one.
        let mut other_target = json_parts();
        other_target.uri = "/other".parse().expect("uri");
        assert_ne!(fp(&r, &other_target, body), first);
        let mut other_type = json_parts();
        other_type.headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/merge-patch+json"),
        );
        assert_ne!(fp(&r, &other_type, body), first);
        assert_eq!(r.memo.0.len(), 4);
        // Past the size kept by bytes, entries go by their raw SHA-256, with
        // the same answers.
        let large = format!(r#"{{"pad":"{}","b":1}}"#, "x".repeat(MEMO_EXACT_MAX));
        let reordered = format!(r#"{{"b":1,"pad":"{}"}}"#, "x".repeat(MEMO_EXACT_MAX));
        let large_fp = fp(&r, &p, &large);
        assert_eq!(r.memo.0.len(), 5);
        assert_eq!(fp(&rules(&[], &["/ts"]), &p, &reordered), large_fp);
        mark_memo(&r, marker);
        assert_eq!(fp(&r, &p, &large), marker, "answered from the memo");
    }

    /// Makes every entry of `r`'s memo answer `marker`, which only a call
    /// answered from the memo returns.
    fn mark_memo(r: &FingerprintRules, marker: Fingerprint) {
        let keys: Vec<MemoKey> = r.memo.0.iter().map(|(key, _)| key).collect();
        for key in keys {
            r.memo.0.insert(key, marker);
        }
    }

    #[test]
    fn borrowed_bytes_find_the_entry_kept_for_them() {
        let memo = CanonicalMemo::default();
        let bytes = b"fields, then a body".to_vec();
        memo.0
            .insert(MemoKey::Exact(bytes.clone().into()), Fingerprint([1; 32]));
        memo.0
            .insert(MemoKey::Digest(Fingerprint([2; 32])), Fingerprint([3; 32]));
        assert_eq!(memo.0.get(&ExactBytes(&bytes)), Some(Fingerprint([1; 32])));
        assert_eq!(memo.0.get(&ExactBytes(b"fields, then a bod")), None);
        // A digest's bytes are not a request's bytes.
        assert_eq!(memo.0.get(&ExactBytes(&[2; 32])), None);
    }

    #[test]
    fn the_memo_holds_a_bounded_number_of_bytes() {
        let r = rules(&[], &[]);
        let p = json_parts();
        let pad = "y".repeat(MEMO_EXACT_MAX - 64);
        for i in 0..2 * MEMO_BYTES as usize / MEMO_EXACT_MAX {
            let body = format!(r#"{{"i":{i},"pad":"{pad}"}}"#);
            let _ = fp(&r, &p, &body);
        }
        assert!(r.memo.0.weight() <= MEMO_BYTES, "{}", r.memo.0.weight());
        assert!(
            (r.memo.0.len() as u64) < MEMO_BYTES / MEMO_EXACT_MAX as u64,
            "{}",
            r.memo.0.len()
        );
    }

    #[test]
    fn duplicate_keys_are_not_ijson() {
        assert_eq!(canonical_json(br#"{"a":1,"a":2}"#, &[]), None);
        assert_eq!(canonical_json(br#"[{"x":{"a":1,"a":1}}]"#, &[]), None);
        let r = FingerprintRules::default();
        let p = json_parts();
        assert_ne!(fp(&r, &p, r#"{"a":1,"a":2}"#), fp(&r, &p, r#"{"a":2}"#));
    }

    #[test]
    fn raw_and_canonical_bodies_do_not_collide() {
        // The canonical form of a JSON body and the same bytes hashed raw
        // are tagged differently.
        let r = FingerprintRules::default();
        let p = json_parts();
        let canonical = fp(&r, &p, r#"{"a":1}"#);
        let raw = fp(&r, &p, r#"{"a":1}garbage"#);
        assert_ne!(canonical, raw);
    }

    #[test]
    fn numbers_canonicalize_as_doubles() {
        assert_eq!(canon("[1.0, 1, 1e0, 10e-1, 0.1e1]"), "[1,1,1,1,1]");
        assert_eq!(canon("[-0, -0.0, 0e5]"), "[0,0,0]");
        let r = FingerprintRules::default();
        let p = json_parts();
        assert_eq!(fp(&r, &p, r#"{"n":1}"#), fp(&r, &p, r#"{"n":1.0}"#));
        assert_eq!(fp(&r, &p, r#"{"n":1}"#), fp(&r, &p, r#"{"n":1e0}"#));
        // Integer literals up to 2^53 are doubles of their own.
        assert_eq!(canon("[9007199254740992]"), "[9007199254740992]");
        // Past it a double holds only some of them: 2^53 + 1 would read as
        // 2^53, and another account number under the same key would be
        // replayed instead of refused. Such a body is not I-JSON: raw.
        for big in [
            "9007199254740993",
            "18446744073709551615",
            "-9223372036854775808",
        ] {
            assert_eq!(
                canonical_json(format!("[{big}]").as_bytes(), &[]),
                None,
                "{big}"
            );
        }
        assert_ne!(
            fp(&r, &p, r#"{"to_account":9007199254740993}"#),
            fp(&r, &p, r#"{"to_account":9007199254740992}"#)
        );
        // In an ignored member it does not matter: a nanosecond timestamp
        // there leaves the rest canonicalized.
        let ignoring = rules(&[], &["/meta/sent_at_ns"]);
        let sent = |ns: &str, order_swapped: bool| {
            let body = if order_swapped {
                format!(r#"{{"meta":{{"sent_at_ns":{ns}}},"amount":5}}"#)
            } else {
                format!(r#"{{"amount":5,"meta":{{"sent_at_ns":{ns}}}}}"#)
            };
            fp(&ignoring, &p, &body)
        };
        assert_eq!(
            sent("1764633600123456789", false),
            sent("1764633600987654321", true)
        );
        assert_eq!(
            canonical_json(
                br#"{"meta":{"sent_at_ns":1764633600123456789},"amount":5}"#,
                &ptrs(&["/meta/sent_at_ns"])
            ),
            Some(br#"{"amount":5,"meta":{}}"#.to_vec())
        );
        // Literals beyond 64 bits, or that round (too many digits, or
        // underflow), would share their double's canonical form with
        // other numbers: not I-JSON either, raw. The same double written
        // as it writes is canonical.
        for (rounds, written) in [
            ("123456789012345678901234567890", "1.2345678901234568e+29"),
            ("-9223372036854775809", "-9.223372036854776e18"),
            ("1.00000000000000000001", "1"),
            ("0.1000000000000000055511151231257827", "0.1"),
            ("1e-400", "0"),
            ("4.9e-324", "5e-324"),
        ] {
            assert_eq!(
                canonical_json(format!("[{rounds}]").as_bytes(), &[]),
                None,
                "{rounds}"
            );
            assert!(canonical_json(format!("[{written}]").as_bytes(), &[]).is_some());
            assert_ne!(
                fp(&r, &p, &format!(r#"{{"amount":{rounds}}}"#)),
                fp(&r, &p, &format!(r#"{{"amount":{written}}}"#)),
                "{rounds}"
            );
        }
        assert_eq!(
            canon("[1e21, 1e20, 1e-6, 1e-7]"),
            "[1e+21,100000000000000000000,0.000001,1e-7]"
        );
        // Exact big numbers survive only as strings.
        assert_eq!(canon(r#"["9007199254740993"]"#), r#"["9007199254740993"]"#);
    }

    #[test]
    fn rfc8785_section_3_2_3_vector() {
        let input = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50,
              2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        // `333333333.33333329` is not the value of the double it reads as
        // (which writes as `333333333.3333333`), so the body is hashed raw
        // rather than made alike to one with the other number; the writer
        // still gives the RFC's output for it.
        assert_eq!(canonical_json(input.as_bytes(), &[]), None);
        let doc = Document::parse(input.as_bytes()).expect("JSON");
        let mut out = Vec::new();
        doc.write(&mut out);
        assert_eq!(String::from_utf8(out).expect("UTF-8"), expected);
        assert_eq!(
            canon(&input.replace("333333333.33333329", "333333333.3333333")),
            expected
        );
    }

    #[test]
    fn rfc8785_section_3_2_3_sorting_vector() {
        // RFC 8785 §3.2.3: keys sort by UTF-16 code units, not by UTF-8 bytes
        // or code points ("\ud83d\ude00" sorts before "\ufb33").
        let input = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}"#;
        let expected = "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
            \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
            \"\u{1f600}\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}";
        assert_eq!(canon(input), expected);
    }

    #[test]
    fn rfc8785_number_vectors() {
        // From RFC 8785 Appendix B (IEEE 754 hex → canonical text); here the
        // input is decimal text that parses to the same double.
        let cases = [
            ("0", "0"),
            ("-0", "0"),
            ("5e-324", "5e-324"),
            ("-5e-324", "-5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("-1.7976931348623157e308", "-1.7976931348623157e+308"),
            ("9007199254740992", "9007199254740992"),
            ("-9007199254740992", "-9007199254740992"),
            // Integer literals past 2^53 are not I-JSON: the same doubles
            // as decimals.
            ("2.9514790517935283e20", "295147905179352830000"),
            ("9.999999999999997e22", "9.999999999999997e+22"),
            ("1e23", "1e+23"),
            ("1.0000000000000001e23", "1.0000000000000001e+23"),
            ("9.999999999999997e20", "999999999999999700000"),
            ("9.999999999999999e20", "999999999999999900000"),
            ("1e21", "1e+21"),
            ("9.999999999999997e-7", "9.999999999999997e-7"),
            ("0.000001", "0.000001"),
            ("333333333.3333332", "333333333.3333332"),
            ("333333333.33333325", "333333333.33333325"),
            ("333333333.3333333", "333333333.3333333"),
            ("333333333.3333334", "333333333.3333334"),
            ("333333333.33333343", "333333333.33333343"),
            ("-0.0000033333333333333333", "-0.0000033333333333333333"),
            ("1424953923781206.2", "1424953923781206.2"),
        ];
        for (input, expected) in cases {
            assert_eq!(
                canon(&format!("[{input}]")),
                format!("[{expected}]"),
                "{input}"
            );
        }
    }

    #[test]
    fn ignored_pointer_does_not_change_fingerprint() {
        let r = rules(&[], &["/metadata/sent_at"]);
        let p = json_parts();
        let a = fp(
            &r,
            &p,
            r#"{"amount":5,"metadata":{"sent_at":"10:00","note":"x"}}"#,
        );
        let b = fp(
            &r,
            &p,
            r#"{"amount":5,"metadata":{"sent_at":"10:01","note":"x"}}"#,
        );
        let c = fp(&r, &p, r#"{"amount":5,"metadata":{"note":"x"}}"#);
        assert_eq!(a, b);
        assert_eq!(a, c);
        // Other fields still count.
        let d = fp(
            &r,
            &p,
            r#"{"amount":5,"metadata":{"sent_at":"10:00","note":"y"}}"#,
        );
        assert_ne!(a, d);
        // And without the rule the timestamp counts.
        let plain = FingerprintRules::default();
        assert_ne!(
            fp(&plain, &p, r#"{"metadata":{"sent_at":"1"}}"#),
            fp(&plain, &p, r#"{"metadata":{"sent_at":"2"}}"#)
        );
    }

    #[test]
    fn ignored_pointer_does_not_apply_to_raw_bodies() {
        let r = rules(&[], &["/t"]);
        let p = parts("POST", "/x", &[("content-type", "text/plain")]);
        assert_ne!(fp(&r, &p, r#"{"t":1}"#), fp(&r, &p, r#"{"t":2}"#));
    }

    #[test]
    fn pointer_escapes() {
        let body = br#"{"a/b":1,"m~n":2,"~1":3,"keep":4}"#;
        assert_eq!(
            canonical_json(body, &ptrs(&["/a~1b"])).as_deref(),
            Some(&br#"{"keep":4,"m~n":2,"~1":3}"#[..])
        );
        assert_eq!(
            canonical_json(body, &ptrs(&["/m~0n"])).as_deref(),
            Some(&br#"{"a/b":1,"keep":4,"~1":3}"#[..])
        );
        // `~01` is `~1`, not `~/` or `/`.
        assert_eq!(
            canonical_json(body, &ptrs(&["/~01"])).as_deref(),
            Some(&br#"{"a/b":1,"keep":4,"m~n":2}"#[..])
        );
        // Escapes in the parent path too.
        let nested = br#"{"x/y":{"z":1,"w":2}}"#;
        assert_eq!(
            canonical_json(nested, &ptrs(&["/x~1y/z"])).as_deref(),
            Some(&br#"{"x/y":{"w":2}}"#[..])
        );
        let r = rules(&[], &["/a~1b"]);
        let p = json_parts();
        assert_eq!(
            fp(&r, &p, r#"{"a/b":1,"c":2}"#),
            fp(&r, &p, r#"{"a/b":9,"c":2}"#)
        );
    }

    #[test]
    fn pointer_into_arrays() {
        let body = br#"{"items":[{"id":1,"ts":5},{"id":2,"ts":6}],"list":[10,20,30]}"#;
        assert_eq!(
            canonical_json(body, &ptrs(&["/items/0/ts", "/items/1/ts"])).as_deref(),
            Some(&br#"{"items":[{"id":1},{"id":2}],"list":[10,20,30]}"#[..])
        );
        assert_eq!(
            canonical_json(body, &ptrs(&["/list/1"])).as_deref(),
            Some(&br#"{"items":[{"id":1,"ts":5},{"id":2,"ts":6}],"list":[10,30]}"#[..])
        );
        // Applied in order: the second removal sees shifted indices.
        assert_eq!(
            canonical_json(body, &ptrs(&["/list/0", "/list/0"])).as_deref(),
            Some(&br#"{"items":[{"id":1,"ts":5},{"id":2,"ts":6}],"list":[30]}"#[..])
        );
        // Not indices: out of range, `-`, leading zero, sign.
        for p in [
            "/list/3", "/list/-", "/list/01", "/list/+1", "/list/", "/list/x",
        ] {
            assert_eq!(
                canonical_json(body, &ptrs(&[p])),
                canonical_json(body, &[]),
                "{p}"
            );
        }
    }

    #[test]
    fn unresolvable_pointers_are_no_ops() {
        let body = br#"{"a":{"b":1},"s":"str","n":null}"#;
        let plain = canonical_json(body, &[]);
        for p in [
            "/missing",
            "/a/missing",
            "/a/b/c",
            "/s/0",
            "/n/x",
            "/missing/deep",
            "no-slash",
            "",
        ] {
            assert_eq!(canonical_json(body, &ptrs(&[p])), plain, "{p}");
        }
        // A scalar document has nothing to remove.
        assert_eq!(
            canonical_json(b"5", &ptrs(&["/a"])).as_deref(),
            Some(&b"5"[..])
        );
        // The empty key is a real member name.
        assert_eq!(
            canonical_json(br#"{"":1,"a":2}"#, &ptrs(&["/"])).as_deref(),
            Some(&br#"{"a":2}"#[..])
        );
    }

    #[test]
    fn new_parses_and_lowercases_header_names() {
        let r = FingerprintRules::parse(&["X-Tenant".into(), "accept".into()], &[]).expect("valid");
        assert_eq!(
            r.headers,
            vec![
                HeaderName::from_static("x-tenant"),
                HeaderName::from_static("accept")
            ]
        );
    }

    #[test]
    fn new_rejects_bad_values_by_name() {
        let err = FingerprintRules::parse(&["bad header".into()], &[]).expect_err("rejected");
        assert!(err.contains("`bad header`"), "{err}");
        let err = FingerprintRules::parse(&[String::new()], &[]).expect_err("rejected");
        assert!(err.contains("``"), "{err}");
        for bad in ["metadata/sent_at", "", "/a~2", "/a~", "/~"] {
            let err = FingerprintRules::parse(&[], &[bad.to_owned()]).expect_err(bad);
            assert!(err.contains(&format!("`{bad}`")), "{err}");
        }
        for good in ["/", "/a", "/a~0b~1c", "/0/-", "/a//b"] {
            FingerprintRules::parse(&[], &[good.to_owned()]).expect(good);
        }
    }

    /// Fingerprints are persisted in stores: these were computed by the
    /// `serde_json::Value`-based implementation this one replaced, so any
    /// change to the hash input across a deploy fails here first.
    #[test]
    fn fingerprints_are_pinned() {
        // Several kilobytes, with a string longer than the hashing buffer.
        let items: Vec<String> = (0..60)
            .map(|i| {
                format!(
                    r#"{{"sku":"item-{i:05}","qty":{},"price":{}.{:02},"tags":["a","\u00e9\n"],"meta":{{"note":"line {i}","ts":{i}}}}}"#,
                    i % 7 + 1,
                    i * 3,
                    i % 100
                )
            })
            .collect();
        let large = format!(
            r#"{{"customer":"cus_123","items":[{}],"blob":"{}","metadata":{{"sent_at":"2026-11-30T12:00:00Z"}}}}"#,
            items.join(","),
            r#"x\\y\"z\u0001"#.repeat(300)
        );
        let cases: &[(&[&str], &str, &str)] = &[
            (
                &[],
                r#"{"b":{"y":[1,2,{"z":null}],"x":true,"w":[]},"a":"s","c":{}}"#,
                "9f05846edc5b75e24949f87b28c64239c5392fcca8253f1d5dcb8f9dccba879d",
            ),
            (
                &[],
                r#"{"k\u0065y":"line\nbreak \"q\" \\ \u00e9 \ud83d\ude00 \/ \u001f","\t":"\u0001\b\f\r","é\"":[""]}"#,
                "ec93e2b464aeb691c9c7c315c35585606ed0b41f5e3d53046917d9a6da94c6da",
            ),
            (
                &[],
                r#"{"\ue000":1,"😀":2,"a":3,"é":4,"\ufb33":5,"ab":6,"":7,"\u0080":8,"\r":9}"#,
                "dec79b2cd4d2d0c9c52532dab5e5229456c31b91fd54ce692a9707c5e5047201",
            ),
            (
                &[],
                "[1e21,1e-7,-0.0,1.2345678901234568e20,0.1,5e-324,-1.5e300,\
                 9007199254740992,-9007199254740992,4.50,1E30,-0,1e20]",
                "ff80341d549b86516abfe0b3310d896c65b5b24034113941478783e627656a1d",
            ),
            // Before 2026-12-04 `123456789012345678901` above (past 64
            // bits) and literals that round were canonicalized as their
            // nearest double; now raw.
            (
                &[],
                "[1e21,123456789012345678901,1.00000000000000000001]",
                "6b47b72d49265520fac5f729081504afed36f21d7fd43efd720a4a6c12b6abec",
            ),
            // An integer literal past 2^53: not I-JSON, hashed raw (since
            // 2026-12-02; canonicalized as its nearest double before).
            (
                &[],
                "[1, 9007199254740993]",
                "b4d4d49e2077ef469eaf85aeba6217fba32f24bb40e18fd28df6a52a2030963e",
            ),
            (
                &[
                    "/metadata/sent_at",
                    "/items/0/ts",
                    "/a~1b",
                    "/m~0n",
                    "/missing/x",
                    "/",
                ],
                r#"{"metadata":{"sent_at":"x","note":"n"},"items":[{"id":1,"ts":5},{"id":2,"ts":6}],"a/b":1,"m~n":2,"":0,"~1":3}"#,
                "e3024d6a664b04946aeabd923eeb015cb1454aff5849be4fc7308db9b0637ec7",
            ),
            (
                &[
                    "/list/0", "/list/0", "/list/01", "/list/-", "/x~1y/z", "/s/0",
                ],
                r#"{"list":[10,20,30,40],"x/y":{"z":1,"w":2},"s":"str"}"#,
                "50c8acb9e7ee6e021ef1d317792a9eec6de0676237955fe49b392d81073b250f",
            ),
            (
                &[],
                "[0.5,-12.34,0.000001,0.0000015,123456789.123456,99999999999999.9,\
                 0.1e1,2.675,1.005,1234.5678e-2,-7,1e15,0.30000000000000004,1e-6]",
                "36fae1de5ebfdb8d627294c5bb4517d2894ec02351f0f965dda0de4449dea5b4",
            ),
            (
                &["/a/0", "/a/0/1", "/a/1/x", "/a/5"],
                r#"{"a":[[1,2],[3,4,5],{"x":1,"y":2}]}"#,
                "bab61caa7a584b191f2c3b6769212c3a397041752538b376ed019351a3a0d450",
            ),
            (
                &[],
                " \"top\\u0000level\" ",
                "1b4efef39f2fe850443e5c54b8a3ab1b19ac223e6a000902361db29e7730f34b",
            ),
            (
                &["/metadata/sent_at", "/items/3"],
                &large,
                "974fac6547fe9fd476409745211e461027ce269453304bf2d764cf0fee6e4449",
            ),
            // Not I-JSON, hashed raw: a duplicate key, even inside an
            // ignored member, and a number out of the double range.
            (
                &["/m"],
                r#"{"m":{"a":1,"a":2},"k":1}"#,
                "41ffa37fe886d93a464d674f02fda06388c7e1907d7d16ff75cee42d57f30b56",
            ),
            (
                &[],
                "[1e400]",
                "ca67471c69683b552dd8e79b2b59c52009bdfef945603c7b6beb583d15560393",
            ),
        ];
        let p = parts(
            "POST",
            "/v1/payments?b=1&a=2",
            &[
                ("content-type", "application/json; charset=utf-8"),
                ("x-tenant", "t1"),
            ],
        );
        for (ignore, body, expected) in cases {
            let r = rules(&["x-tenant"], ignore);
            assert_eq!(hex::encode(fp(&r, &p, body).0), *expected, "{body}");
        }
    }

    // ---- property tests ----

    fn arb_string() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z]{0,6}",
            // Characters that need escaping, plus pointer-special ones.
            "[\"\\\\/~\\x00-\\x1f\\x7f a]{0,6}",
            // Arbitrary Unicode scalar values, astral planes included.
            any::<String>().prop_map(|s| s.chars().take(8).collect()),
        ]
    }

    fn arb_number() -> impl Strategy<Value = Number> {
        prop_oneof![
            // Integer literals a double holds exactly (larger ones make the
            // body raw, see `canonical::EXACT_INTEGERS`).
            (-(1i64 << 53)..=(1 << 53)).prop_map(Number::from),
            (0u64..=(1 << 53)).prop_map(Number::from),
            (-1000i64..1000).prop_map(Number::from),
            any::<f64>().prop_filter_map("finite", Number::from_f64),
            (-1e6f64..1e6).prop_filter_map("finite", Number::from_f64),
        ]
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            arb_number().prop_map(Value::Number),
            arb_string().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map(arb_string(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Tiny deterministic PRNG so one proptest seed drives every choice of
    /// the alternative serialization.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            // xorshift64*
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn ws(rng: &mut Rng, out: &mut String) {
        for _ in 0..rng.below(3) {
            out.push([' ', '\t', '\n', '\r'][rng.below(4)]);
        }
    }

    fn write_string(rng: &mut Rng, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 || rng.below(4) == 0 => {
                    if c == '/' && rng.below(2) == 0 {
                        out.push_str("\\/");
                        continue;
                    }
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        if rng.below(2) == 0 {
                            out.push_str(&format!("\\u{u:04x}"));
                        } else {
                            out.push_str(&format!("\\u{u:04X}"));
                        }
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn write_number(rng: &mut Rng, n: &Number, out: &mut String) {
        let text = n.to_string();
        if n.is_f64() {
            out.push_str(&text);
            return;
        }
        // Integers: equivalent spellings of the same double.
        match rng.below(4) {
            0 => out.push_str(&text),
            1 => out.push_str(&format!("{text}.0")),
            2 => out.push_str(&format!("{text}e0")),
            _ => out.push_str(&format!("{text}.000E+0")),
        }
    }

    /// Serializes `v` with shuffled object members, random whitespace,
    /// random `\u` escapes and alternative number spellings.
    fn write_shuffled(rng: &mut Rng, v: &Value, out: &mut String) {
        ws(rng, out);
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => write_number(rng, n, out),
            Value::String(s) => write_string(rng, s, out),
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_shuffled(rng, item, out);
                }
                ws(rng, out);
                out.push(']');
            }
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                for i in (1..entries.len()).rev() {
                    entries.swap(i, rng.below(i + 1));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(rng, out);
                    write_string(rng, k, out);
                    ws(rng, out);
                    out.push(':');
                    write_shuffled(rng, item, out);
                }
                ws(rng, out);
                out.push('}');
            }
        }
        ws(rng, out);
    }

    /// JSON-pointer paths to every leaf and every object member.
    fn paths(
        v: &Value,
        prefix: &mut Vec<String>,
        leaves: &mut Vec<Vec<String>>,
        members: &mut Vec<Vec<String>>,
    ) {
        match v {
            Value::Array(items) if !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    prefix.push(i.to_string());
                    paths(item, prefix, leaves, members);
                    prefix.pop();
                }
            }
            Value::Object(map) if !map.is_empty() => {
                for (k, item) in map {
                    prefix.push(k.clone());
                    members.push(prefix.clone());
                    paths(item, prefix, leaves, members);
                    prefix.pop();
                }
            }
            _ => leaves.push(prefix.clone()),
        }
    }

    fn to_pointer(path: &[String]) -> String {
        path.iter()
            .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
            .collect()
    }

    fn get_mut<'a>(v: &'a mut Value, path: &[String]) -> &'a mut Value {
        path.iter().fold(v, |v, t| match v {
            Value::Array(items) => &mut items[t.parse::<usize>().expect("index")],
            Value::Object(map) => map.get_mut(t).expect("member"),
            _ => panic!("path through scalar"),
        })
    }

    proptest! {
        #[test]
        fn reserialization_keeps_fingerprint(v in arb_json(), seed in 1u64..) {
            let r = FingerprintRules::default();
            let p = json_parts();
            let plain = serde_json::to_string(&v).expect("serializable");
            let mut shuffled = String::new();
            write_shuffled(&mut Rng(seed), &v, &mut shuffled);
            prop_assert!(canonical_json(shuffled.as_bytes(), &[]).is_some(), "{}", shuffled);
            prop_assert_eq!(
                canonical_json(plain.as_bytes(), &[]),
                canonical_json(shuffled.as_bytes(), &[]),
                "{} vs {}", plain, shuffled
            );
            prop_assert_eq!(
                r.fingerprint(&p, plain.as_bytes()),
                r.fingerprint(&p, shuffled.as_bytes())
            );
        }

        #[test]
        fn changed_leaf_changes_fingerprint(v in arb_json(), pick in any::<prop::sample::Index>()) {
            let r = FingerprintRules::default();
            let p = json_parts();
            let (mut leaves, mut members) = (Vec::new(), Vec::new());
            paths(&v, &mut Vec::new(), &mut leaves, &mut members);
            let path = pick.get(&leaves);
            let mut changed = v.clone();
            let leaf = get_mut(&mut changed, path);
            *leaf = match leaf.take() {
                Value::Null => Value::Bool(false),
                Value::Bool(b) => Value::Bool(!b),
                // A different type can never canonicalize equal.
                Value::Number(n) => Value::String(n.to_string()),
                Value::String(s) => Value::String(s + "x"),
                Value::Array(_) => Value::Array(vec![Value::Null]),
                Value::Object(_) => Value::Array(Vec::new()),
            };
            let a = serde_json::to_vec(&v).expect("serializable");
            let b = serde_json::to_vec(&changed).expect("serializable");
            prop_assert_ne!(r.fingerprint(&p, &a), r.fingerprint(&p, &b));
        }

        #[test]
        fn ignoring_a_member_equals_removing_it(
            // A non-empty object at the root, so there is always a member.
            v in proptest::collection::btree_map(arb_string(), arb_json(), 1..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())), pick in any::<prop::sample::Index>(), seed in 1u64..) {
            let (mut leaves, mut members) = (Vec::new(), Vec::new());
            paths(&v, &mut Vec::new(), &mut leaves, &mut members);
            let path = pick.get(&members);
            let mut removed = v.clone();
            let (last, parent) = path.split_last().expect("non-empty path");
            if let Value::Object(map) = get_mut(&mut removed, parent) {
                map.remove(last);
            }
            let pointer = to_pointer(path);
            let mut shuffled = String::new();
            write_shuffled(&mut Rng(seed), &v, &mut shuffled);
            let r = rules(&[], &[pointer.as_str()]);
            let p = json_parts();
            prop_assert_eq!(
                r.fingerprint(&p, shuffled.as_bytes()),
                FingerprintRules::default().fingerprint(&p, &serde_json::to_vec(&removed).expect("ok"))
            );
        }

        #[test]
        fn never_panics_on_arbitrary_bodies(
            body in proptest::collection::vec(any::<u8>(), 0..200),
            ptr in "(/[a-z0-9~\\-]{0,3}){0,3}",
        ) {
            let r = FingerprintRules { ignore: vec![ptr], ..FingerprintRules::default() };
            let _ = r.fingerprint(&json_parts(), &body);
            let _ = canonical_json(&body, &r.ignore);
        }
    }
}
