//! The demo's MCP server (Streamable HTTP, JSON answers, no sessions): two
//! tools, `send_email`, which has a side effect, and `outbox`, annotated
//! read-only, which shows what was sent. Just enough of MCP for a client
//! or curl to list and call them; the proxy in front does the rest.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

/// Every email "sent"; a std Mutex is enough (never held across an await).
#[derive(Clone, Default)]
struct Outbox(Arc<Mutex<Vec<Value>>>);

impl Outbox {
    fn sent(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        match self.0.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// The server at `path`, with an outbox of its own.
pub(super) fn router(path: &str) -> Router {
    Router::new()
        .route(path, post(message))
        .with_state(Outbox::default())
}

async fn message(State(outbox): State<Outbox>, body: Option<Json<Value>>) -> Response {
    let Some(Json(message)) = body else {
        return error(Value::Null, -32700, "the body is not a JSON-RPC message");
    };
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    let method = message.get("method").and_then(Value::as_str).unwrap_or("");
    let params = message.get("params").cloned().unwrap_or(Value::Null);
    let result = match method {
        "initialize" => initialize(&params),
        "tools/list" => tools(),
        "tools/call" => call(&outbox, &params),
        "ping" => json!({}),
        notification if notification.starts_with("notifications/") => {
            return StatusCode::ACCEPTED.into_response();
        }
        other => return error(id, -32601, &format!("no method `{other}`")),
    };
    Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
}

fn error(id: Value, code: i64, message: &str) -> Response {
    let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}});
    (StatusCode::OK, Json(body)).into_response()
}

fn initialize(params: &Value) -> Value {
    let version = params
        .get("protocolVersion")
        .cloned()
        .unwrap_or_else(|| json!("2025-11-25"));
    json!({
        "protocolVersion": version,
        "capabilities": {"tools": {}},
        "serverInfo": {"name": "idemproxy-demo", "version": env!("CARGO_PKG_VERSION")},
    })
}

fn tools() -> Value {
    json!({"tools": [
        {
            "name": "send_email",
            "description": "Send an email.",
            "inputSchema": {
                "type": "object",
                "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
                "required": ["to", "subject"],
            },
        },
        {
            "name": "outbox",
            "description": "The emails sent so far.",
            "inputSchema": {"type": "object", "properties": {}},
            "annotations": {"readOnlyHint": true},
        },
    ]})
}

fn call(outbox: &Outbox, params: &Value) -> Value {
    let arguments = params.get("arguments").cloned().unwrap_or(Value::Null);
    let text = match params.get("name").and_then(Value::as_str) {
        Some("send_email") => {
            let mut sent = outbox.sent();
            let to = arguments.get("to").and_then(Value::as_str).unwrap_or("");
            let subject = arguments
                .get("subject")
                .and_then(Value::as_str)
                .unwrap_or("");
            sent.push(json!({"to": to, "subject": subject}));
            format!("sent email #{} to {to}: {subject}", sent.len())
        }
        Some("outbox") => {
            let sent = outbox.sent();
            format!(
                "{} email(s) sent: {}",
                sent.len(),
                Value::Array(sent.clone())
            )
        }
        other => {
            return json!({
                "content": [{"type": "text", "text": format!("no tool {other:?}")}],
                "isError": true,
            })
        }
    };
    json!({"content": [{"type": "text", "text": text}], "isError": false})
}
