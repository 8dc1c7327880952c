//! The JSON-RPC responses the proxy makes itself: replays of a stored
//! result and tool errors the model can act on, framed as the client
//! accepts.

use bytes::Bytes;
use serde_json::{json, Map, Value};

/// `_meta` member marking a replay.
pub const META_REPLAYED: &str = "io.idemproxy/replayed";
/// `_meta` member with the original call's date (RFC 3339).
pub const META_ORIGINAL_DATE: &str = "io.idemproxy/original-date";
/// `_meta` member marking a result the server's lookup (`reconcile_url`)
/// gave for a call whose own result was lost.
pub const META_RECONCILED: &str = "io.idemproxy/reconciled";

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

/// The tool result stored for a call whose own result was lost and which
/// the server's lookup (`reconcile_url`) found: what the lookup answered
/// (`status`, `body`), said so in a first text item, since the model must
/// know it did not get the tool's own result; a JSON object body is also
/// the `structuredContent`.
pub fn reconciled_result(status: u16, body: &[u8]) -> Value {
    let said = format!(
        "The result of this call was lost (the server timed out or the proxy in front of it \
         stopped), so the server was asked whether the action happened. It did, and it was not \
         run again. What the server's lookup answered ({status}) follows."
    );
    let mut result = json!({
        "content": [
            {"type": "text", "text": said},
            {"type": "text", "text": String::from_utf8_lossy(body)},
        ],
        "isError": false,
        "_meta": {META_RECONCILED: true},
    });
    if let Ok(found @ Value::Object(_)) = serde_json::from_slice::<Value>(body) {
        result["structuredContent"] = found;
    }
    result
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
    fn a_reconciled_result_says_so_and_keeps_what_the_lookup_answered() {
        let found = reconciled_result(200, br#"{"id":"pay_1","status":"paid"}"#);
        assert_eq!(found["isError"], false);
        assert_eq!(found["_meta"][META_RECONCILED], true);
        assert_eq!(
            found["structuredContent"],
            json!({"id": "pay_1", "status": "paid"})
        );
        let content = found["content"].as_array().expect("content");
        assert!(content[0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("not run again") && t.contains("(200)")));
        assert_eq!(content[1]["text"], r#"{"id":"pay_1","status":"paid"}"#);
        // A body that is no JSON object is text alone.
        for body in [&b"sent"[..], b"[1,2]", b"\xff"] {
            let found = reconciled_result(200, body);
            assert!(found.get("structuredContent").is_none(), "{found}");
            assert!(found["content"][1]["text"].is_string());
        }
        // Replayed as any stored result is.
        let stored = serde_json::to_vec(&found).expect("json");
        let replayed = replay(&json!(3), &stored, "d", false).expect("replay");
        assert_eq!(replayed["result"]["_meta"][META_RECONCILED], true);
        assert_eq!(replayed["result"]["_meta"][META_REPLAYED], true);
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
