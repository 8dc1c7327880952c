//! The upstream's lookup for a key whose outcome is unknown
//! (`reconcile_url`): a path-and-query template filled from the request
//! being retried. Every value is percent-encoded the one way that is safe
//! in a path segment and in a query value alike (everything but RFC 3986's
//! unreserved characters), so a value can never add a segment, a
//! parameter or a fragment to the lookup. A value the request lacks means
//! there is no lookup to make: the caller fails closed, as without one.

use std::fmt;
use std::str::FromStr;

use http::request::Parts;
use http::HeaderName;
use serde_json::Value;

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
        let mut body: Option<Option<Value>> = None;
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
                Piece::Json(pointer) => {
                    let json = body.get_or_insert_with(|| serde_json::from_slice(input.body).ok());
                    scalar(json.as_ref()?.pointer(pointer)?)?
                }
            };
            encode_into(&mut out, &value);
        }
        Some(out)
    }
}

/// A string as it is, a number as written; anything else names no record.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
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
            Some("/v1/lookup/k%201%2F%3F%26%23?to=a%2Bb%40example.com&n=12.5&t=acme%20corp&d=2026-12-04%2010%3A00")
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
