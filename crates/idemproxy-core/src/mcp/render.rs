//! The JSON-RPC responses the proxy makes itself: replays of a stored
//! result and tool errors the model can act on, framed as the client
//! accepts.

use bytes::Bytes;
use serde_json::{json, Map, Value};

/// `_meta` member marking a replay.
pub const META_REPLAYED: &str = "io.idemproxy/replayed";
/// `_meta` member with the original call's date (RFC 3339).
pub const META_ORIGINAL_DATE: &str = "io.idemproxy/original-date";

/// How a response is framed for the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `application/json`: the message alone.
    Json,
    /// `text/event-stream`: one `message` event.
    Sse,
}

impl Framing {
    /// JSON when the client accepts it (every MCP client does), else SSE.
    pub fn for_accept(accept: Option<&str>) -> Framing {
        let accepts = |wanted: &str| {
            accept.is_none_or(|a| {
                a.split(',').any(|item| {
                    let media = item.split(';').next().unwrap_or("").trim();
                    media.eq_ignore_ascii_case(wanted)
                        || media == "*/*"
                        || media.eq_ignore_ascii_case("application/*")
                            && wanted.starts_with("application/")
                })
            })
        };
        if accepts("application/json") || !accepts("text/event-stream") {
            Framing::Json
        } else {
            Framing::Sse
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Framing::Json => "application/json",
            Framing::Sse => "text/event-stream",
        }
    }
}

/// `message` framed as `framing` says.
pub fn encode(message: &Value, framing: Framing) -> Bytes {
    let json = message.to_string();
    match framing {
        Framing::Json => Bytes::from(json),
        Framing::Sse => Bytes::from(format!("event: message\ndata: {json}\n\n")),
    }
}

/// The answer to request `id` from a stored `result`: marked in `_meta`
/// (which the model does not see) and, with `note`, by a first text item
/// (which it does). `structuredContent` is kept as it was.
pub fn replay(id: &Value, stored: &[u8], original_date: &str, note: bool) -> Option<Value> {
    let Ok(Value::Object(mut result)) = serde_json::from_slice::<Value>(stored) else {
        return None;
    };
    let meta = result
        .entry("_meta")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Some(meta) = meta.as_object_mut() {
        meta.insert(META_REPLAYED.into(), Value::Bool(true));
        meta.insert(
            META_ORIGINAL_DATE.into(),
            Value::String(original_date.into()),
        );
    }
    if note {
        let text = format!(
            "Note: this call already ran at {original_date} with the same idempotency key; \
             it was not executed again. Its original result follows."
        );
        let item = json!({"type": "text", "text": text});
        match result.get_mut("content").and_then(Value::as_array_mut) {
            Some(content) => content.insert(0, item),
            None => {
                result.insert("content".into(), Value::Array(vec![item]));
            }
        }
    }
    Some(response(id, Value::Object(result)))
}

/// A tool result with `isError: true` and `text`, the form in which a model
/// sees a failure it must act on (an HTTP error would reach it, if at all,
/// as an opaque transport failure).
pub fn tool_error(id: &Value, text: &str) -> Value {
    response(
        id,
        json!({"content": [{"type": "text", "text": text}], "isError": true}),
    )
}

fn response(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_answers_the_new_id_with_the_stored_result_marked() {
        let stored = br#"{"content":[{"type":"text","text":"sent #1"}],"structuredContent":{"n":1},"_meta":{"x":1}}"#;
        let replayed = replay(&json!(9), stored, "2026-12-02T10:00:00Z", true).expect("replay");
        assert_eq!(replayed["id"], 9);
        assert_eq!(replayed["jsonrpc"], "2.0");
        let result = &replayed["result"];
        assert_eq!(result["_meta"]["x"], 1);
        assert_eq!(result["_meta"][META_REPLAYED], true);
        assert_eq!(result["_meta"][META_ORIGINAL_DATE], "2026-12-02T10:00:00Z");
        assert_eq!(result["structuredContent"], json!({"n": 1}));
        let content = result["content"].as_array().expect("content");
        assert_eq!(content.len(), 2);
        assert!(content[0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("not executed again")));
        assert_eq!(content[1]["text"], "sent #1");
        let quiet = replay(&json!("a"), stored, "d", false).expect("replay");
        assert_eq!(quiet["result"]["content"].as_array().map(Vec::len), Some(1));
        assert!(replay(&json!(1), b"[1]", "d", true).is_none());
    }

    #[test]
    fn framing_follows_accept() {
        assert_eq!(
            Framing::for_accept(Some("application/json, text/event-stream")),
            Framing::Json
        );
        assert_eq!(Framing::for_accept(Some("text/event-stream")), Framing::Sse);
        assert_eq!(Framing::for_accept(None), Framing::Json);
        assert_eq!(Framing::for_accept(Some("*/*")), Framing::Json);
        let error = tool_error(&json!(1), "no");
        assert_eq!(
            encode(&error, Framing::Sse),
            Bytes::from(format!("event: message\ndata: {error}\n\n"))
        );
        assert_eq!(error["result"]["isError"], true);
    }
}
