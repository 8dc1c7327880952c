//! The answer to a retry, built from the key's completed record; and what
//! of an executed response is kept to build it from.

use axum::body::Body;
use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{HeaderName, HeaderValue, Response};
use serde_json::{json, Map, Value};

use super::policy::Policy;
use super::rejection::Rejection;
use crate::core::{from_millis, CompletedRecord, Outcome, StoredResponse};
use crate::http::headers::{IDEMPOTENCY_ORIGINAL_DATE, IDEMPOTENT_REPLAYED};

/// Builds the answer to a retry from the key's completed record.
pub(super) fn replay(record: &CompletedRecord, policy: &Policy) -> Response<Body> {
    let mut response = match &record.outcome {
        Outcome::Response(stored) => {
            let marked = policy
                .replay_body_field
                .as_deref()
                .and_then(|field| marked_body(stored, field, record.completed_at));
            let body = marked.clone().unwrap_or_else(|| stored.body.clone());
            let mut response = Response::new(Body::from(body));
            *response.status_mut() =
                http::StatusCode::from_u16(stored.status).unwrap_or(http::StatusCode::BAD_GATEWAY);
            let headers = response.headers_mut();
            headers.reserve(stored.headers.len() + 2);
            for (name, value) in &stored.headers {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_maybe_shared(value.clone()),
                ) {
                    headers.append(name, value);
                }
            }
            if let Some(marked) = marked {
                headers.insert(CONTENT_LENGTH, HeaderValue::from(marked.len()));
            }
            response
        }
        Outcome::NotStored { status } => {
            Rejection::ResponseNotStored { status: *status }.into_response(policy.settings.profile)
        }
        Outcome::Unknown { cause } => Rejection::OutcomeUnknown {
            cause: *cause,
            released: false,
        }
        .into_response(policy.settings.profile),
        // The stores open what they sealed and unpack what they packed
        // before answering; a record still sealed or packed here cannot be
        // read, and the request behind it ran: an error of the proxy's,
        // never a second execution.
        Outcome::Sealed(_) | Outcome::Packed(_) => {
            Rejection::Internal.into_response(policy.settings.profile)
        }
    };
    let headers = response.headers_mut();
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let date = httpdate::fmt_http_date(from_millis(record.completed_at));
    // The formatted text becomes the value as it is, not a copy of it.
    if let Ok(date) = HeaderValue::from_maybe_shared(Bytes::from(date)) {
        headers.insert(IDEMPOTENCY_ORIGINAL_DATE, date);
    }
    response
}

/// The stored body with `field` set to `{"replayed": true,
/// "original_date": "<RFC 3339>"}`, for tool wrappers that hand the model
/// only the body (the SOP's `was_replay`); `None` (untouched) unless the
/// body is a JSON object labelled as JSON. The member is spliced in before
/// the closing brace, so the body's own bytes and member order stay as
/// the upstream wrote them; an object that already has `field` gets it
/// replaced.
fn marked_body(stored: &StoredResponse, field: &str, completed_at: u64) -> Option<Bytes> {
    let json_type = stored.headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("content-type")
            && std::str::from_utf8(value).is_ok_and(|ct| {
                let media = ct.split(';').next().unwrap_or_default().trim();
                media.eq_ignore_ascii_case("application/json") || media.ends_with("+json")
            })
    });
    if !json_type {
        return None;
    }
    let mut object: Map<String, Value> = serde_json::from_slice(&stored.body).ok()?;
    let date = humantime::format_rfc3339_seconds(from_millis(completed_at)).to_string();
    let marker = json!({"replayed": true, "original_date": date});
    if object.contains_key(field) {
        object.insert(field.to_owned(), marker);
        return serde_json::to_vec(&object).ok().map(Bytes::from);
    }
    let text = &stored.body[..];
    let close = text.iter().rposition(|b| *b == b'}')?;
    let member = serde_json::to_string(&json!({ field: marker })).ok()?;
    // `{"f":{...}}` without its braces: the member to splice in.
    let member = &member[1..member.len() - 1];
    let mut out = Vec::with_capacity(text.len() + member.len() + 1);
    out.extend_from_slice(&text[..close]);
    if !object.is_empty() {
        out.push(b',');
    }
    out.extend_from_slice(member.as_bytes());
    out.extend_from_slice(&text[close..]);
    Some(Bytes::from(out))
}

/// The headers a replay carries: the upstream's end-to-end headers (the
/// upstream client already removed hop-by-hop ones).
pub(super) fn stored_headers(headers: &http::HeaderMap) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

/// What is kept of an executed request: the whole response, or only its
/// status when the body was too large or broke off.
pub(super) fn stored_outcome(
    status: u16,
    headers: Vec<(String, Bytes)>,
    body: Option<Bytes>,
) -> Outcome {
    match body {
        Some(body) => Outcome::Response(StoredResponse {
            status,
            headers,
            body,
        }),
        None => Outcome::NotStored { status },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(content_type: &str, body: &str) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), Bytes::from(content_type.to_owned()))],
            body: Bytes::from(body.to_owned()),
        }
    }

    const AT: u64 = 1_796_000_000_000;

    #[test]
    fn only_json_objects_gain_the_replay_member() {
        let marked = |ct: &str, body: &str| {
            marked_body(&stored(ct, body), "_idempotency", AT)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        };
        let body = marked("application/json", r#"{"z": 1, "a": [1, 2]} "#).expect("object");
        assert!(
            body.starts_with(r#"{"z": 1, "a": [1, 2],"_idempotency":{"#),
            "the body's own bytes stay: {body}"
        );
        let value: Value = serde_json::from_str(&body).expect("still JSON");
        assert_eq!(value["_idempotency"]["replayed"], true);
        assert_eq!(
            value["_idempotency"]["original_date"],
            "2026-11-30T00:53:20Z"
        );
        let empty: Value =
            serde_json::from_str(&marked("application/problem+json", "{}").expect("object"))
                .expect("JSON");
        assert_eq!(empty["_idempotency"]["replayed"], true);
        let replaced: Value = serde_json::from_str(
            &marked("application/json", r#"{"_idempotency": 1}"#).expect("object"),
        )
        .expect("JSON");
        assert_eq!(replaced["_idempotency"]["replayed"], true);
        assert_eq!(marked("application/json", "[1, 2]"), None);
        assert_eq!(marked("application/json", r#""text""#), None);
        assert_eq!(marked("application/json", "{broken"), None);
        assert_eq!(marked("text/plain", r#"{"a": 1}"#), None);
    }
}
