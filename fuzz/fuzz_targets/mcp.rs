//! The MCP route's message handling (crates/idemproxy-core/src/mcp/):
//! `McpRequest::parse`, `answer_to` and the incremental SSE parser never
//! panic on any bytes.
//!
//! - `EventParser`: "Splits a stream of chunks into events", keeping each
//!   event's bytes. The events (raw bytes, data, id) and the bytes left
//!   over must be the same however the stream is cut into chunks: whole,
//!   one byte at a time, and at cut points taken from the input. And no
//!   byte is lost or added: the events' raw bytes, then `rest()`, are the
//!   stream.
//! - `McpRequest::parse`: a `Call` is a JSON-RPC 2.0 `tools/call` with a
//!   string or number id; its key comes from the key argument, else
//!   `params.idempotencyKey`; its forwarded body is the JSON it came as,
//!   without `params.idempotencyKey` (and without the key argument when
//!   stripped); whatever serde_json refuses is `Unparsable`.
//! - `answer_to`: an answer is an object with that very id (or an error
//!   with a null id) and no method.
//!
//! The input is read as a request body, as an SSE stream, and each event's
//! data as a message, as the proxy reads a server's stream.

#![no_main]

use bytes::Bytes;
use idemproxy_core::mcp::message::{answer_to, Answer, KeySource};
use idemproxy_core::mcp::{Event, EventParser, McpRequest};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const KEY_ARGUMENT: &str = "idempotency_key";

fuzz_target!(|data: &[u8]| {
    let id = request(data).unwrap_or_else(|| Value::from(1));
    check_answer(data, &id);

    let (whole, rest) = feed(data, &[data.len()]);
    assert_eq!(reassemble(&whole, &rest), data, "bytes lost or added");
    for event in &whole {
        check_event(event);
        // What the relay does with a server's events.
        let message = event.data.as_bytes();
        let _ = request(message);
        check_answer(message, &id);
    }
    let ones: Vec<usize> = (1..=data.len()).collect();
    assert_eq!(
        feed(data, &ones),
        (whole.clone(), rest.clone()),
        "byte by byte"
    );
    let cuts = cuts(data);
    assert_eq!(feed(data, &cuts), (whole, rest), "cut at {cuts:?}");
});

/// Feeds `stream` in chunks ending at `ends` (increasing; the last chunk
/// runs to the end of the stream).
fn feed(stream: &[u8], ends: &[usize]) -> (Vec<Event>, Vec<u8>) {
    let mut parser = EventParser::default();
    let mut events = Vec::new();
    let mut start = 0;
    for &end in ends.iter().chain([stream.len()].iter()) {
        let end = end.clamp(start, stream.len());
        events.extend(parser.feed(&stream[start..end]));
        start = end;
    }
    (events, parser.rest().to_vec())
}

/// Up to 16 cut points, from the input's bytes: a cheap hash walk, so
/// that the fuzzer moves them by changing the input.
fn cuts(data: &[u8]) -> Vec<usize> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15 ^ data.len() as u64;
    for &b in data.iter().take(64) {
        state = (state ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
    }
    let n = (state % 17) as usize;
    let mut cuts: Vec<usize> = (0..n)
        .map(|i| {
            state = state.rotate_left(13).wrapping_mul(0x2545_F491_4F6C_DD1D) ^ i as u64;
            (state % (data.len() as u64 + 1)) as usize
        })
        .collect();
    cuts.sort_unstable();
    cuts
}

fn reassemble(events: &[Event], rest: &[u8]) -> Vec<u8> {
    let mut out: Vec<u8> = events.iter().flat_map(|e| e.raw.iter().copied()).collect();
    out.extend_from_slice(rest);
    out
}

/// An event ends at an empty line (LF or CRLF).
fn check_event(event: &Event) {
    let raw = &event.raw[..];
    assert!(
        raw == b"\n" || raw == b"\r\n" || raw.ends_with(b"\n\n") || raw.ends_with(b"\n\r\n"),
        "an event that does not end with an empty line: {raw:?}"
    );
    if event.id.is_none() && event.data.is_empty() {
        return;
    }
    assert!(
        raw.windows(2).any(|w| w == b"id" || w == b"da"),
        "an id or data without its field: {raw:?}"
    );
}

/// Parses `body` as a request, checks what a call says, and returns its id.
fn request(body: &[u8]) -> Option<Value> {
    match McpRequest::parse(body) {
        McpRequest::Call(call) => {
            let message: Value = serde_json::from_slice(body).expect("a call is JSON");
            assert_eq!(message["method"], "tools/call");
            assert_eq!(message["jsonrpc"], "2.0");
            assert!(call.id.is_string() || call.id.is_number(), "id {}", call.id);
            assert_eq!(message["id"], call.id);
            assert_eq!(message["params"]["name"].as_str(), Some(call.name.as_str()));
            let params_key = message["params"].get("idempotencyKey");
            match call.key(KEY_ARGUMENT) {
                Some(KeySource::Argument(v)) => {
                    assert_eq!(call.arguments.get(KEY_ARGUMENT), Some(&v))
                }
                Some(KeySource::Params(v)) => {
                    assert!(!call.arguments.contains_key(KEY_ARGUMENT));
                    assert_eq!(params_key, Some(&v));
                }
                None => {
                    assert!(!call.arguments.contains_key(KEY_ARGUMENT));
                    assert!(params_key.is_none());
                }
            }
            assert!(!call
                .arguments_without(KEY_ARGUMENT)
                .contains_key(KEY_ARGUMENT));
            for strip in [true, false] {
                let whole = Bytes::copy_from_slice(body);
                let forwarded: Value =
                    serde_json::from_slice(&call.forwarded_body(&whole, KEY_ARGUMENT, strip))
                        .expect("the forwarded body is JSON");
                assert_eq!(forwarded["id"], call.id);
                assert_eq!(forwarded["method"], "tools/call");
                let params = &forwarded["params"];
                assert!(
                    params.get("idempotencyKey").is_none(),
                    "params key forwarded"
                );
                assert_eq!(params["name"].as_str(), Some(call.name.as_str()));
                let arguments = params.get("arguments").and_then(Value::as_object);
                if strip {
                    assert!(!arguments.is_some_and(|a| a.contains_key(KEY_ARGUMENT)));
                } else if let Some(v) = call.arguments.get(KEY_ARGUMENT) {
                    assert_eq!(arguments.and_then(|a| a.get(KEY_ARGUMENT)), Some(v));
                }
            }
            Some(call.id)
        }
        McpRequest::List { id } => {
            assert!(id.is_string() || id.is_number());
            Some(id)
        }
        McpRequest::Cancel { request_id } => {
            assert!(request_id.is_string() || request_id.is_number());
            Some(request_id)
        }
        McpRequest::Batch(items) => {
            let message: Value = serde_json::from_slice(body).expect("a batch is JSON");
            assert_eq!(message.as_array().map(Vec::len), Some(items.len()));
            None
        }
        McpRequest::MalformedCall { .. } => {
            let message: Value = serde_json::from_slice(body).expect("a malformed call is JSON");
            assert_eq!(message["method"], "tools/call");
            None
        }
        McpRequest::Unparsable(_) => {
            assert!(serde_json::from_slice::<Value>(body).is_err());
            None
        }
        McpRequest::Other => None,
    }
}

fn check_answer(message: &[u8], id: &Value) {
    let Some(answer) = answer_to(message, id) else {
        return;
    };
    let message: Value = serde_json::from_slice(message).expect("an answer is JSON");
    let object = message.as_object().expect("an answer is an object");
    let unread = object.get("id") == Some(&Value::Null) && object.contains_key("error");
    assert!(object.get("id") == Some(id) || unread);
    assert!(!object.contains_key("method"));
    match answer {
        Answer::Error => assert!(object.contains_key("error")),
        Answer::InputRequired => {
            assert!(!object.contains_key("error"));
            assert_eq!(object["result"]["resultType"], "input_required");
        }
        Answer::Result(result) => {
            assert!(!object.contains_key("error"));
            assert_eq!(object.get("result"), Some(&result));
        }
    }
}
