//! Where a covered request's key comes from (DESIGN §6): `key_from`, the
//! sources tried in order (the first present wins), and `derive_key`, the
//! attributes a key is made of when no source is present.
//!
//! Agent stacks rarely send an `Idempotency-Key`, but they carry stable
//! ids: an OpenAI `tool_call_id` in the body, a run id in a header. A key
//! from `json:/tool_call_id` or one derived from `(header:x-run-id,
//! json:/tool_call_id)` keys on the intent (this tool call of this run),
//! not on the content, which is what the SOP's Case 2 asks for.
//!
//! Choices:
//! - A JSON source reads a string or an integer member (its decimal text);
//!   `null` counts as absent; any other value is an invalid key naming the
//!   source, since silently falling through would key the request by a
//!   later source the caller did not mean.
//! - A derived attribute may be any JSON value but `null` (its RFC 8785
//!   text, so `"42"` and `42` differ); a header attribute takes every value
//!   of the header, in order. Every attribute is required: a request that
//!   lacks one has no key (`require_key` then applies), since a key made of
//!   fewer attributes would merge calls the operator meant to keep apart.
//! - A derived key is `derived:` and the hex SHA-256 of the route's name
//!   and the attributes, each framed by a tag and a length, so two lists
//!   never collide, and neither do two routes that derive alike.
//! - A body that a JSON source or attribute must read and that does not
//!   parse refuses the request ([`KeyRefusal::UnreadableBody`]): the
//!   upstream's parser may well read a key in it (Python's `json` takes
//!   `NaN` and lone surrogate escapes), so calling it keyless would run it
//!   unprotected. Only an empty body is read as holding no member: no
//!   parser finds a key in nothing.

use std::fmt;
use std::str::FromStr;

use http::request::Parts;
use http::{HeaderName, HeaderValue};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::fingerprint::{canonical_json, validate_pointer};
use super::key::{parse_key, IdempotencyKey, InvalidKey, IDEMPOTENCY_KEY};

/// Bumping this moves every derived key (retries of calls made before
/// would execute again). v2 hashes the route's name in.
const DERIVE_DOMAIN: &[u8] = b"idemproxy.derived-key.v2\0";

/// A `key_from` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    Header(HeaderName),
    /// An RFC 6901 pointer into a JSON body.
    Json(String),
    Query(String),
}

/// A `derive_key` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyAttribute {
    Header(HeaderName),
    Json(String),
    Method,
    Path,
}

/// What the request head alone says of the key.
#[derive(Debug, PartialEq, Eq)]
pub enum HeadKey {
    Key(IdempotencyKey),
    Invalid(InvalidKey),
    /// No source is present and none can be derived.
    Keyless,
    /// A JSON source or attribute is next: the body decides.
    NeedsBody,
}

/// Why a covered request's key cannot be had from its body.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyRefusal {
    Invalid(InvalidKey),
    /// `at` (a `json:` source or attribute) needed the body, and the body
    /// is not JSON the proxy can read.
    UnreadableBody {
        at: String,
    },
}

/// A route's `key_from` and `derive_key`.
#[derive(Clone, Debug)]
pub struct KeyRules {
    from: Vec<KeySource>,
    derive: Vec<KeyAttribute>,
    /// Hashed into every derived key: the same ids on another route name
    /// another action.
    route: String,
}

impl Default for KeyRules {
    /// The `Idempotency-Key` header, nothing derived.
    fn default() -> Self {
        Self::new(vec![KeySource::Header(IDEMPOTENCY_KEY)], Vec::new())
    }
}

impl KeyRules {
    pub fn new(from: Vec<KeySource>, derive: Vec<KeyAttribute>) -> Self {
        Self {
            from,
            derive,
            route: String::new(),
        }
    }

    /// The rules of the route named `route`, whose derived keys are its own.
    pub fn for_route(mut self, route: &str) -> Self {
        route.clone_into(&mut self.route);
        self
    }

    /// The key as far as the head decides it, without reading the body.
    pub fn from_head(&self, parts: &Parts) -> HeadKey {
        // Without a body, no member is read, so none is found unreadable.
        self.lookup(parts, None).unwrap_or(HeadKey::NeedsBody)
    }

    /// The key of a request whose body was read.
    pub fn from_request(
        &self,
        parts: &Parts,
        body: &[u8],
    ) -> Result<Option<IdempotencyKey>, KeyRefusal> {
        match self.lookup(parts, Some(body)) {
            Ok(HeadKey::Key(key)) => Ok(Some(key)),
            Ok(HeadKey::Invalid(invalid)) => Err(KeyRefusal::Invalid(invalid)),
            Ok(HeadKey::Keyless | HeadKey::NeedsBody) => Ok(None),
            Err(NotJson) => Err(KeyRefusal::UnreadableBody {
                at: self.first_body_reader(),
            }),
        }
    }

    /// The `json:` source or attribute that read the body first.
    fn first_body_reader(&self) -> String {
        let source = self.from.iter().find(|s| matches!(s, KeySource::Json(_)));
        let attribute = self
            .derive
            .iter()
            .find(|a| matches!(a, KeyAttribute::Json(_)));
        source
            .map(ToString::to_string)
            .or_else(|| attribute.map(ToString::to_string))
            .unwrap_or_default()
    }

    fn lookup(&self, parts: &Parts, body: Option<&[u8]>) -> Result<HeadKey, NotJson> {
        let mut json = LazyJson::new(body);
        for source in &self.from {
            let found = match source {
                KeySource::Header(name) => header_key(parts, name),
                KeySource::Query(name) => query_value(parts, name).map(|v| text_key(&v)),
                KeySource::Json(pointer) => match json.member(pointer)? {
                    Err(NeedsBody) => return Ok(HeadKey::NeedsBody),
                    Ok(None) => None,
                    Ok(Some(Value::String(s))) => Some(text_key(s)),
                    Ok(Some(Value::Number(n))) if n.is_i64() || n.is_u64() => {
                        Some(text_key(&n.to_string()))
                    }
                    Ok(Some(_)) => Some(Err(InvalidKey::NotText)),
                },
            };
            let Some(found) = found else { continue };
            return Ok(match found {
                Ok(key) => HeadKey::Key(key),
                // The header the default names keeps its own messages.
                Err(why) if *source == KeySource::Header(IDEMPOTENCY_KEY) => HeadKey::Invalid(why),
                Err(why) => HeadKey::Invalid(InvalidKey::From {
                    at: source.to_string(),
                    why: Box::new(why),
                }),
            });
        }
        if self.derive.is_empty() {
            return Ok(HeadKey::Keyless);
        }
        let mut h = Sha256::new();
        h.update(DERIVE_DOMAIN);
        put_hashed_field(&mut h, self.route.as_bytes());
        for attribute in &self.derive {
            let value: Vec<u8> = match attribute {
                KeyAttribute::Method => parts.method.as_str().as_bytes().to_vec(),
                KeyAttribute::Path => parts.uri.path().as_bytes().to_vec(),
                KeyAttribute::Header(name) => {
                    let values: Vec<&HeaderValue> = parts.headers.get_all(name).iter().collect();
                    if values.is_empty() {
                        return Ok(HeadKey::Keyless);
                    }
                    let mut joined = Vec::new();
                    for v in values {
                        put_field(&mut joined, v.as_bytes());
                    }
                    joined
                }
                KeyAttribute::Json(pointer) => match json.member(pointer)? {
                    Err(NeedsBody) => return Ok(HeadKey::NeedsBody),
                    Ok(None) => return Ok(HeadKey::Keyless),
                    Ok(Some(value)) => {
                        let raw = serde_json::to_vec(value).unwrap_or_default();
                        canonical_json(&raw, &[]).unwrap_or(raw)
                    }
                },
            };
            let mut field = Vec::with_capacity(value.len() + 16);
            put_field(&mut field, attribute.to_string().as_bytes());
            put_field(&mut field, &value);
            h.update(&field);
        }
        Ok(
            match format!("derived:{}", hex::encode(h.finalize())).parse() {
                Ok(key) => HeadKey::Key(key),
                Err(why) => HeadKey::Invalid(why),
            },
        )
    }
}

fn put_hashed_field(h: &mut Sha256, bytes: &[u8]) {
    let mut field = Vec::with_capacity(bytes.len() + 8);
    put_field(&mut field, bytes);
    h.update(&field);
}

/// `bytes`, prefixed by their length: fields framed so, one after the
/// other, can be read back only one way.
fn put_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// At most one value of `name`: two would make the key ambiguous.
fn header_key(parts: &Parts, name: &HeaderName) -> Option<Result<IdempotencyKey, InvalidKey>> {
    let mut values = parts.headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => None,
        (Some(v), None) => Some(parse_key(v)),
        (Some(_), Some(_)) => Some(Err(InvalidKey::Repeated)),
    }
}

fn text_key(text: &str) -> Result<IdempotencyKey, InvalidKey> {
    text.parse()
}

/// The first value of the query parameter `name`, percent-decoded.
fn query_value(parts: &Parts, name: &str) -> Option<String> {
    let query = parts.uri.query()?;
    form_urlencoded::parse(query.as_bytes())
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.into_owned())
}

/// The body asked for before it was read.
struct NeedsBody;

/// The body was read and is not JSON the proxy can parse.
struct NotJson;

/// A body parsed as JSON once, on the first member asked for.
struct LazyJson<'a> {
    body: Option<&'a [u8]>,
    /// `None` for an empty body: no document, so no member.
    parsed: Option<Result<Option<Value>, NotJson>>,
}

impl<'a> LazyJson<'a> {
    fn new(body: Option<&'a [u8]>) -> Self {
        Self { body, parsed: None }
    }

    /// The member at `pointer`; `None` when the body is empty or has no
    /// such member (or it is `null`); the outer error when the body does
    /// not parse.
    fn member(&mut self, pointer: &str) -> Result<Result<Option<&Value>, NeedsBody>, NotJson> {
        let Some(body) = self.body else {
            return Ok(Err(NeedsBody));
        };
        let doc = self.parsed.get_or_insert_with(|| {
            if body.is_empty() {
                return Ok(None);
            }
            serde_json::from_slice(body).map(Some).map_err(|_| NotJson)
        });
        match doc {
            Err(NotJson) => Err(NotJson),
            Ok(doc) => Ok(Ok(doc
                .as_ref()
                .and_then(|doc| doc.pointer(pointer))
                .filter(|v| !v.is_null()))),
        }
    }
}

const HEADER: &str = "header:";
const JSON: &str = "json:";
const QUERY: &str = "query:";

/// `prefix` and what follows it, the prefix case-insensitive.
fn strip<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    s.get(..prefix.len())
        .filter(|p| p.eq_ignore_ascii_case(prefix))
        .and_then(|_| s.get(prefix.len()..))
}

fn header_name(s: &str, name: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("`{s}`: `{name}` is not a header name"))
}

fn pointer(s: &str, pointer: &str) -> Result<String, String> {
    validate_pointer(pointer)
        .map(|()| pointer.to_owned())
        .map_err(|why| format!("`{s}`: {why}"))
}

impl FromStr for KeySource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(name) = strip(s, HEADER) {
            return header_name(s, name).map(KeySource::Header);
        }
        if let Some(p) = strip(s, JSON) {
            return pointer(s, p).map(KeySource::Json);
        }
        if let Some(name) = strip(s, QUERY).filter(|n| !n.is_empty()) {
            return Ok(KeySource::Query(name.to_owned()));
        }
        Err(format!(
            "`{s}` is not a key source; the forms are `header:<name>`, `json:<pointer>` \
             (e.g. `json:/tool_call_id`) and `query:<name>`"
        ))
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(name) => write!(f, "{HEADER}{name}"),
            KeySource::Json(pointer) => write!(f, "{JSON}{pointer}"),
            KeySource::Query(name) => write!(f, "{QUERY}{name}"),
        }
    }
}

impl FromStr for KeyAttribute {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("method") {
            return Ok(KeyAttribute::Method);
        }
        if s.eq_ignore_ascii_case("path") {
            return Ok(KeyAttribute::Path);
        }
        if let Some(name) = strip(s, HEADER) {
            return header_name(s, name).map(KeyAttribute::Header);
        }
        if let Some(p) = strip(s, JSON) {
            return pointer(s, p).map(KeyAttribute::Json);
        }
        Err(format!(
            "`{s}` is not a key attribute; the forms are `header:<name>`, `json:<pointer>`, \
             `method` and `path`"
        ))
    }
}

impl fmt::Display for KeyAttribute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyAttribute::Header(name) => write!(f, "{HEADER}{name}"),
            KeyAttribute::Json(pointer) => write!(f, "{JSON}{pointer}"),
            KeyAttribute::Method => f.write_str("method"),
            KeyAttribute::Path => f.write_str("path"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut req = Request::post(uri);
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        req.body(()).expect("request").into_parts().0
    }

    fn rules(from: &[&str], derive: &[&str]) -> KeyRules {
        KeyRules::new(
            from.iter().map(|s| s.parse().expect("source")).collect(),
            derive
                .iter()
                .map(|s| s.parse().expect("attribute"))
                .collect(),
        )
    }

    fn key(rules: &KeyRules, parts: &Parts, body: &str) -> Option<String> {
        rules
            .from_request(parts, body.as_bytes())
            .expect("valid")
            .map(IdempotencyKey::into_string)
    }

    #[test]
    fn the_first_present_source_wins() {
        let r = rules(&["header:x-key", "json:/tool_call_id", "query:k"], &[]);
        let body = r#"{"tool_call_id": "call_1"}"#;
        assert_eq!(
            key(&r, &parts("/t?k=q1", &[("x-key", "h1")]), body),
            Some("h1".into())
        );
        assert_eq!(key(&r, &parts("/t?k=q1", &[]), body), Some("call_1".into()));
        assert_eq!(key(&r, &parts("/t?k=q%2F1", &[]), "{}"), Some("q/1".into()));
        assert_eq!(
            key(&r, &parts("/t", &[]), r#"{"tool_call_id": 42}"#),
            Some("42".into())
        );
        assert_eq!(
            key(&r, &parts("/t", &[]), r#"{"tool_call_id": null}"#),
            None
        );
        assert_eq!(
            key(&r, &parts("/t", &[]), ""),
            None,
            "an empty body holds no key"
        );
    }

    #[test]
    fn a_body_a_json_source_cannot_parse_refuses_the_request() {
        let r = rules(&["header:x-key", "json:/id", "query:k"], &[]);
        for body in [
            "not json",
            r#"{"id": "a", "n": NaN}"#,
            r#"{"id": "\ud800"}"#,
        ] {
            assert_eq!(
                r.from_request(&parts("/t?k=q", &[]), body.as_bytes()),
                Err(KeyRefusal::UnreadableBody {
                    at: "json:/id".into()
                }),
                "{body}"
            );
            // A source before it that has the key never reads the body.
            assert!(r
                .from_request(&parts("/t", &[("x-key", "h")]), body.as_bytes())
                .is_ok_and(|k| k.is_some()));
        }
        let derived = rules(&[], &["method", "json:/run/id"]);
        assert_eq!(
            derived.from_request(&parts("/t", &[]), b"{\"run\": {\"id\": Infinity}}"),
            Err(KeyRefusal::UnreadableBody {
                at: "json:/run/id".into()
            })
        );
    }

    #[test]
    fn the_head_decides_until_a_json_source_is_next() {
        let r = rules(&["header:x-key", "json:/id"], &[]);
        assert!(matches!(
            r.from_head(&parts("/t", &[("x-key", "h1")])),
            HeadKey::Key(_)
        ));
        assert_eq!(r.from_head(&parts("/t", &[])), HeadKey::NeedsBody);
        assert_eq!(
            KeyRules::default().from_head(&parts("/t", &[])),
            HeadKey::Keyless
        );
        let derived = rules(&["header:idempotency-key"], &["method", "header:x-run"]);
        assert_eq!(derived.from_head(&parts("/t", &[])), HeadKey::Keyless);
        assert!(matches!(
            derived.from_head(&parts("/t", &[("x-run", "r1")])),
            HeadKey::Key(_)
        ));
    }

    #[test]
    fn an_unusable_member_is_an_invalid_key_naming_its_source() {
        let r = rules(&["json:/tool_call_id", "header:x-key"], &[]);
        for body in [
            r#"{"tool_call_id": {"a": 1}}"#,
            r#"{"tool_call_id": 1.5}"#,
            r#"{"tool_call_id": true}"#,
            r#"{"tool_call_id": ""}"#,
        ] {
            let Err(KeyRefusal::Invalid(invalid)) =
                r.from_request(&parts("/t", &[("x-key", "h")]), body.as_bytes())
            else {
                panic!("{body}: not an invalid key")
            };
            assert!(
                invalid.to_string().contains("`json:/tool_call_id`"),
                "{body}: {invalid}"
            );
        }
        let long = format!(r#"{{"tool_call_id": "{}"}}"#, "a".repeat(256));
        assert!(r.from_request(&parts("/t", &[]), long.as_bytes()).is_err());
        // The default header keeps its own words.
        let twice = parts("/t", &[("idempotency-key", "a"), ("idempotency-key", "b")]);
        assert_eq!(
            KeyRules::default().from_request(&twice, b""),
            Err(KeyRefusal::Invalid(InvalidKey::Repeated))
        );
    }

    #[test]
    fn a_derived_key_needs_every_attribute_and_tells_them_apart() {
        let r = rules(
            &["header:idempotency-key"],
            &["header:x-run-id", "json:/tool_call_id"],
        );
        let run = |id: &str| parts("/v1/tools", &[("x-run-id", id)]);
        let call = |id: &str| format!(r#"{{"tool_call_id": "{id}", "arguments": {{}}}}"#);
        let a = key(&r, &run("r1"), &call("c1")).expect("derived");
        assert!(a.starts_with("derived:") && a.len() == 8 + 64, "{a}");
        assert_eq!(key(&r, &run("r1"), &call("c1")), Some(a.clone()));
        assert_ne!(key(&r, &run("r2"), &call("c1")), Some(a.clone()));
        assert_ne!(key(&r, &run("r1"), &call("c2")), Some(a.clone()));
        assert_eq!(key(&r, &parts("/v1/tools", &[]), &call("c1")), None);
        assert_eq!(key(&r, &run("r1"), r#"{"arguments": {}}"#), None);
        // A key sent outright still wins.
        let sent = parts("/v1/tools", &[("x-run-id", "r1"), ("idempotency-key", "k")]);
        assert_eq!(key(&r, &sent, &call("c1")), Some("k".into()));
        // Framing: ("ab", "c") and ("a", "bc") are different pairs.
        let two = rules(&[], &["header:x-a", "header:x-b"]);
        let ab_c = key(&two, &parts("/", &[("x-a", "ab"), ("x-b", "c")]), "");
        let a_bc = key(&two, &parts("/", &[("x-a", "a"), ("x-b", "bc")]), "");
        assert_ne!(ab_c, a_bc);
        // The same ids on two routes are two actions.
        let on = |route: &str| {
            let rules = rules(&[], &["header:x-run-id"]).for_route(route);
            key(&rules, &run("r1"), "")
        };
        assert_ne!(on("email"), on("sms"));
        assert_eq!(on("email"), on("email"));
        // A string and a number are different values.
        let typed = rules(&[], &["json:/id"]);
        assert_ne!(
            key(&typed, &parts("/", &[]), r#"{"id": "42"}"#),
            key(&typed, &parts("/", &[]), r#"{"id": 42}"#)
        );
    }

    #[test]
    fn sources_and_attributes_parse_and_print_back() {
        for s in ["header:x-run-id", "json:/tool_call_id", "query:key"] {
            assert_eq!(s.parse::<KeySource>().expect(s).to_string(), s);
        }
        for s in ["method", "path", "header:x-run-id", "json:/a/b"] {
            assert_eq!(s.parse::<KeyAttribute>().expect(s).to_string(), s);
        }
        for bad in [
            "json:tool_call_id",
            "header:",
            "query:",
            "cookie:x",
            "method",
        ] {
            assert!(bad.parse::<KeySource>().is_err(), "{bad}");
        }
        assert!("query:k".parse::<KeyAttribute>().is_err());
    }
}
