//! The upstream's lookup for a key whose outcome is unknown
//! (`reconcile_url`): a path-and-query template filled from the request
//! being retried. Every value is percent-encoded the one way that is safe
//! in a path segment and in a query value alike (everything but RFC 3986's
//! unreserved characters), so a value can never add a segment, a
//! parameter or a fragment to the lookup. A value the request lacks means
//! there is no lookup to make: the caller fails closed, as without one.
//!
//! A lookup that asks about another record than the request's is worse
//! than none: its "found" stores another operation's answer, its "absent"
//! runs the payment again. So the value is the request's own, exactly:
//! a JSON number as the body wrote it (`12345678901234567890123`, not the
//! nearest double), and never a value a router would read as no segment
//! at all (empty, `.`, `..`: `/payments/../refunds` is `/refunds` to a
//! normalizing router). Such a request has no lookup.

use std::fmt;
use std::str::FromStr;

use http::request::Parts;
use http::HeaderName;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::fingerprint::validate_pointer;

/// A parsed `reconcile_url`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupTemplate {
    pieces: Vec<Piece>,
    source: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Literal(String),
    Key,
    Header(HeaderName),
    Json(String),
    Query(String),
}

/// What the request being retried offers the template.
#[derive(Debug)]
pub struct LookupInput<'a> {
    pub parts: &'a Parts,
    pub body: &'a [u8],
    /// The raw `Idempotency-Key`, as the client sent it.
    pub key: &'a str,
}

impl LookupTemplate {
    /// The lookup's path-and-query for `input`, or `None` when the request
    /// lacks a value the template names (or the body is not JSON for a
    /// `{json:…}`).
    pub fn render(&self, input: &LookupInput<'_>) -> Option<String> {
        let mut out = String::new();
        for piece in &self.pieces {
            let value = match piece {
                Piece::Literal(text) => {
                    out.push_str(text);
                    continue;
                }
                Piece::Key => input.key.to_owned(),
                Piece::Header(name) => input.parts.headers.get(name)?.to_str().ok()?.to_owned(),
                Piece::Query(name) => query_value(input.parts, name)?,
                Piece::Json(pointer) => scalar(member_at(input.body, pointer)?)?,
            };
            if names_no_segment(&value) {
                return None;
            }
            encode_into(&mut out, &value);
        }
        Some(out)
    }
}

/// Whether `value` would put an empty or dot segment into the lookup's
/// path, which a router removes or resolves (`/a/../b` is `/b`), or an
/// empty value into its query: either way it names no record.
fn names_no_segment(value: &str) -> bool {
    matches!(value, "" | "." | "..")
}

/// A string unescaped; a number exactly as written (no trip through a
/// double); anything else names no record.
fn scalar(value: &RawValue) -> Option<String> {
    let text = value.get();
    match text.as_bytes().first()? {
        b'"' => serde_json::from_str(text).ok(),
        b'-' | b'0'..=b'9' => Some(text.to_owned()),
        _ => None,
    }
}

/// The value at `pointer` (RFC 6901, checked when the template was
/// parsed) in the JSON document `body`, as written. Walked over raw
/// values rather than a `serde_json::Value`, which would hold every
/// number as an `f64` or a 64-bit integer. A member named twice on the
/// way is ambiguous (parsers disagree on which one counts): no value.
fn member_at<'a>(body: &'a [u8], pointer: &str) -> Option<&'a RawValue> {
    let text = std::str::from_utf8(body).ok()?;
    let mut value: &RawValue = serde_json::from_str(text).ok()?;
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        value = match value.get().as_bytes().first()? {
            b'{' => {
                let mut document = serde_json::Deserializer::from_str(value.get());
                document.deserialize_map(OneMember(&token)).ok()??
            }
            b'[' => {
                let items: Vec<&RawValue> = serde_json::from_str(value.get()).ok()?;
                let index: usize = token.parse().ok()?;
                // RFC 6901: no leading zeros ("01" is no index).
                if token != index.to_string() {
                    return None;
                }
                items.get(index).copied()?
            }
            _ => return None,
        };
    }
    Some(value)
}

/// Reads an object for the one member named `.0`: `Some` of its raw
/// value, `None` when it is missing or named twice.
struct OneMember<'n>(&'n str);

impl<'de> Visitor<'de> for OneMember<'_> {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        let mut twice = false;
        while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if name == self.0 {
                twice |= found.is_some();
                found = Some(map.next_value::<&'de RawValue>()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found.filter(|_| !twice))
    }
}

fn query_value(parts: &Parts, name: &str) -> Option<String> {
    let query = parts.uri.query()?;
    form_urlencoded::parse(query.as_bytes())
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.into_owned())
}

/// Percent-encodes every byte of `value` but the unreserved ones.
fn encode_into(out: &mut String, value: &str) {
    for &byte in value.as_bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
}

impl FromStr for LookupTemplate {
    type Err = String;

    fn from_str(source: &str) -> Result<Self, String> {
        if !source.starts_with('/') || source.starts_with("//") {
            return Err(format!(
                "`{source}` must be an absolute path on the upstream, e.g. `/v1/payments?ref={{key}}`"
            ));
        }
        if source.contains('#') || source.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "`{source}` must be a path and query only (no fragment, no spaces)"
            ));
        }
        let mut pieces = Vec::new();
        let mut rest = source;
        while let Some(open) = rest.find(['{', '}']) {
            if rest.as_bytes()[open] == b'}' {
                return Err(format!("`{source}` has a `}}` without its `{{`"));
            }
            if open > 0 {
                pieces.push(Piece::Literal(rest[..open].to_owned()));
            }
            let after = &rest[open + 1..];
            let close = after
                .find(['{', '}'])
                .filter(|&i| after.as_bytes()[i] == b'}')
                .ok_or_else(|| format!("`{source}` has a `{{` without its `}}`"))?;
            pieces.push(placeholder(&after[..close])?);
            rest = &after[close + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Literal(rest.to_owned()));
        }
        Ok(Self {
            pieces,
            source: source.to_owned(),
        })
    }
}

fn placeholder(inner: &str) -> Result<Piece, String> {
    if inner == "key" {
        return Ok(Piece::Key);
    }
    let unknown = || {
        format!("`{{{inner}}}` is not a placeholder: use {{key}}, {{header:<name>}}, {{json:<pointer>}} or {{query:<name>}}")
    };
    let (kind, arg) = inner.split_once(':').ok_or_else(unknown)?;
    match kind {
        "header" => HeaderName::from_bytes(arg.as_bytes())
            .map(Piece::Header)
            .map_err(|_| format!("`{{{inner}}}`: `{arg}` is not a header name")),
        "json" => {
            validate_pointer(arg)?;
            Ok(Piece::Json(arg.to_owned()))
        }
        "query" if !arg.is_empty() => Ok(Piece::Query(arg.to_owned())),
        _ => Err(unknown()),
    }
}

impl fmt::Display for LookupTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut builder = http::Request::builder().uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).map(|r| r.into_parts().0).expect("request")
    }

    fn render(template: &str, uri: &str, headers: &[(&str, &str)], body: &str) -> Option<String> {
        let template: LookupTemplate = template.parse().expect("template");
        let parts = parts(uri, headers);
        template.render(&LookupInput {
            parts: &parts,
            body: body.as_bytes(),
            key: "k 1/?&#",
        })
    }

    #[test]
    fn every_placeholder_is_filled_and_percent_encoded() {
        let looked_up = render(
            "/v1/lookup/{key}?to={json:/to}&n={json:/n}&t={header:x-tenant}&d={query:day}",
            "/v1/send?day=2026-12-04%2010%3A00",
            &[("x-tenant", "acme corp")],
            r#"{"to":"a+b@example.com","n":12.50}"#,
        );
        assert_eq!(
            looked_up.as_deref(),
            Some("/v1/lookup/k%201%2F%3F%26%23?to=a%2Bb%40example.com&n=12.50&t=acme%20corp&d=2026-12-04%2010%3A00")
        );
    }

    #[test]
    fn a_missing_attribute_means_no_lookup() {
        assert_eq!(render("/x?t={header:x-tenant}", "/", &[], "{}"), None);
        assert_eq!(render("/x?q={query:q}", "/?other=1", &[], "{}"), None);
        assert_eq!(render("/x/{json:/order}", "/", &[], "{}"), None);
        assert_eq!(render("/x/{json:/order}", "/", &[], "not json"), None);
        // An object or a boolean names no record.
        assert_eq!(render("/x/{json:/o}", "/", &[], r#"{"o":{}}"#), None);
        assert_eq!(render("/x/{json:/o}", "/", &[], r#"{"o":true}"#), None);
    }

    #[test]
    fn a_number_is_looked_up_as_the_body_wrote_it() {
        // Through an f64 this was `1.2345678901234568e20`: another order.
        for (body, rendered) in [
            (
                r#"{"id":123456789012345678901}"#,
                "/p/123456789012345678901",
            ),
            (r#"{"id":-0.10}"#, "/p/-0.10"),
            (r#"{"id":1e2}"#, "/p/1e2"),
            (r#"{"id":9007199254740993}"#, "/p/9007199254740993"),
            (r#"{"id":"x\u00e9"}"#, "/p/x%C3%A9"),
            (r#" { "a" : [ 0, { "id" : 7 } ] , "id" : 1 } "#, "/p/1"),
        ] {
            assert_eq!(
                render("/p/{json:/id}", "/", &[], body).as_deref(),
                Some(rendered),
                "{body}"
            );
        }
        assert_eq!(
            render(
                "/p/{json:/a/1/id}",
                "/",
                &[],
                r#"{"a":[0,{"id":70000000000000000001}]}"#
            )
            .as_deref(),
            Some("/p/70000000000000000001")
        );
        assert_eq!(
            render("/p/{json:/a~1b~0c}", "/", &[], r#"{"a/b~c":5}"#).as_deref(),
            Some("/p/5")
        );
    }

    #[test]
    fn an_ambiguous_or_unaddressable_member_means_no_lookup() {
        // Named twice: parsers disagree on which one is the order.
        assert_eq!(
            render("/p/{json:/id}", "/", &[], r#"{"id":1,"id":2}"#),
            None
        );
        assert_eq!(render("/p/{json:/a/01}", "/", &[], r#"{"a":[1,2]}"#), None);
        assert_eq!(render("/p/{json:/a/2}", "/", &[], r#"{"a":[1,2]}"#), None);
        assert_eq!(render("/p/{json:/a/-}", "/", &[], r#"{"a":[1,2]}"#), None);
        assert_eq!(render("/p/{json:/id/x}", "/", &[], r#"{"id":"abc"}"#), None);
        assert_eq!(render("/p/{json:/id}", "/", &[], r#"{"id":null}"#), None);
        assert_eq!(
            render("/p/{json:/id}", "/", &[], r#"{"id":1} trailing"#),
            None
        );
    }

    #[test]
    fn a_value_that_is_no_segment_means_no_lookup() {
        // `/v1/payments/..` is `/v1` to a normalizing router: another
        // route's 200 would be stored as the payment's answer.
        for value in ["", ".", ".."] {
            let body = serde_json::json!({ "id": value }).to_string();
            assert_eq!(
                render("/v1/payments/{json:/id}", "/", &[], &body),
                None,
                "{value:?}"
            );
            assert_eq!(
                render("/v1/payments?id={json:/id}", "/", &[], &body),
                None,
                "{value:?}"
            );
            let headers = [("x-order", value)];
            assert_eq!(
                render("/v1/p/{header:x-order}", "/", &headers, ""),
                None,
                "{value:?}"
            );
        }
        assert_eq!(render("/v1/p/{query:id}", "/?id=..", &[], ""), None);
        assert_eq!(render("/v1/p/{query:id}", "/?id=", &[], ""), None);
        // Dots inside a value are plain characters.
        assert_eq!(
            render("/v1/p/{query:id}", "/?id=...", &[], "").as_deref(),
            Some("/v1/p/...")
        );
        assert_eq!(
            render("/v1/p/{query:id}", "/?id=a..b", &[], "").as_deref(),
            Some("/v1/p/a..b")
        );
    }

    #[test]
    fn a_template_without_placeholders_is_used_as_written() {
        assert_eq!(
            render("/v1/status?all=1", "/", &[], "").as_deref(),
            Some("/v1/status?all=1")
        );
    }

    #[test]
    fn malformed_templates_are_refused() {
        for bad in [
            "",
            "v1/lookup/{key}",
            "//evil.example/{key}",
            "https://evil.example/{key}",
            "/x/{key",
            "/x/key}",
            "/x/{{key}}",
            "/x/{id}",
            "/x/{json:order}",
            "/x/{header:bad name}",
            "/x/{query:}",
            "/x/{key}#frag",
            "/x/ {key}",
        ] {
            assert!(bad.parse::<LookupTemplate>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn a_template_prints_as_written() {
        let source = "/v1/payments?ref={json:/order_id}";
        let template: LookupTemplate = source.parse().expect("template");
        assert_eq!(template.to_string(), source);
    }
}
