//! JSON-RPC messages as an MCP client sends them, and the one message of
//! an answer that responds to a given request.

use std::ops::Range;

use bytes::Bytes;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// The name of the member of `params` that SEP-3182 proposed for a key.
const PARAMS_KEY: &str = "idempotencyKey";

/// What a request body is, as far as protection goes.
#[derive(Debug)]
pub enum McpRequest {
    /// A `tools/call` request in the shape JSON-RPC 2.0 and MCP give it.
    Call(ToolCall),
    /// A message whose `method` is `tools/call` but which is no valid
    /// request: not JSON-RPC 2.0, no usable id, `params`, `name` or
    /// `arguments` of the wrong type, or a member name given twice. The
    /// proxy cannot protect it as sent; whether it may pass depends on the
    /// tool (`name`, when there is one).
    MalformedCall {
        /// The request's id when it has a usable one, else `null` (what a
        /// JSON-RPC error answers when it cannot tell).
        id: Value,
        name: Option<String>,
        why: String,
    },
    /// A `tools/list` request, whose answer is rewritten.
    List { id: Value },
    /// A `notifications/cancelled` for the request `request_id`.
    Cancel { request_id: Value },
    /// A JSON array: a batch, what each element is.
    Batch(Vec<BatchItem>),
    /// A body serde_json does not take as JSON: invalid syntax, or what
    /// lenient parsers accept and JSON does not (`NaN`, `Infinity`, lone
    /// surrogate escapes such as `"\ud800"`). Python's `json`, and so the
    /// MCP Python SDK, runs such a call, so it must not pass unread.
    Unparsable(String),
    /// Anything else: another method, a notification, a response, a JSON
    /// value that is no object. Passed through untouched.
    Other,
}

/// What one element of a batch is.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchItem {
    /// A message with `"method": "tools/call"`, whatever its shape, and
    /// its tool's name if it has one.
    Call {
        name: Option<String>,
    },
    /// A `notifications/cancelled` for the request `request_id`.
    Cancel {
        request_id: Value,
    },
    Other,
}

impl McpRequest {
    pub fn parse(body: &[u8]) -> McpRequest {
        let message = match serde_json::from_slice::<Value>(body) {
            Ok(message) => message,
            Err(e) => return McpRequest::Unparsable(e.to_string()),
        };
        let message = match message {
            Value::Object(message) => message,
            Value::Array(items) => {
                return McpRequest::Batch(items.iter().map(BatchItem::of).collect())
            }
            _ => return McpRequest::Other,
        };
        if let Some(request_id) = cancelled_request(&message) {
            return McpRequest::Cancel { request_id };
        }
        // A request has an id (string or number); a notification has none.
        let id = match message.get("id") {
            Some(id @ (Value::String(_) | Value::Number(_))) => Some(id.clone()),
            _ => None,
        };
        match message.get("method").and_then(Value::as_str) {
            Some("tools/list") => match id {
                Some(id) => McpRequest::List { id },
                None => McpRequest::Other,
            },
            Some("tools/call") => ToolCall::parse(body, &message, id),
            _ => McpRequest::Other,
        }
    }
}

impl BatchItem {
    fn of(item: &Value) -> BatchItem {
        let Some(message) = item.as_object() else {
            return BatchItem::Other;
        };
        if let Some(request_id) = cancelled_request(message) {
            return BatchItem::Cancel { request_id };
        }
        if message.get("method").and_then(Value::as_str) != Some("tools/call") {
            return BatchItem::Other;
        }
        let name = message
            .get("params")
            .and_then(|p| p.get("name"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        BatchItem::Call { name }
    }
}

/// The request a `notifications/cancelled` cancels, when `message` is one
/// that names it.
fn cancelled_request(message: &Map<String, Value>) -> Option<Value> {
    if message.get("method").and_then(Value::as_str) != Some("notifications/cancelled") {
        return None;
    }
    match message.get("params").and_then(|p| p.get("requestId")) {
        Some(id @ (Value::String(_) | Value::Number(_))) => Some(id.clone()),
        _ => None,
    }
}

/// A `tools/call` request, taken apart.
#[derive(Debug, Clone)]
pub struct ToolCall {
    /// The JSON-RPC id: a replay answers with the new request's.
    pub id: Value,
    /// The tool's name (`params.name`).
    pub name: String,
    /// `params.arguments` (an absent one is empty).
    pub arguments: Map<String, Value>,
    /// `params`, whole.
    params: Map<String, Value>,
    /// Where `params`' members sit in the body.
    params_members: Vec<Member>,
    /// Where `arguments`' members sit in the body, and the whole object
    /// (`None` when the call has no `arguments` object).
    arguments_members: Vec<Member>,
    arguments_span: Option<Range<usize>>,
}

/// One member of an object, where it sits in the body: from its name's
/// opening quote to its value's last byte.
#[derive(Debug, Clone)]
struct Member {
    name: String,
    span: Range<usize>,
}

impl ToolCall {
    /// `body`'s call, already read as `message`; or why it is no request
    /// the proxy can protect as sent.
    fn parse(body: &[u8], message: &Map<String, Value>, id: Option<Value>) -> McpRequest {
        let name = message
            .get("params")
            .and_then(|p| p.get("name"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let malformed = |why: &str| McpRequest::MalformedCall {
            id: id.clone().unwrap_or(Value::Null),
            name: name.clone(),
            why: format!("this tools/call is not a valid JSON-RPC 2.0 request: {why}"),
        };
        if message.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return malformed("`jsonrpc` must be \"2.0\"");
        }
        let Some(id) = id.clone() else {
            return malformed("`id` must be a string or a number");
        };
        let Some(Value::Object(params)) = message.get("params") else {
            return malformed("`params` must be an object");
        };
        let Some(name) = name.clone() else {
            return malformed("`params.name` must be a string");
        };
        let arguments = match params.get("arguments") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(arguments)) => arguments.clone(),
            Some(_) => return malformed("`params.arguments` must be an object"),
        };
        let spelled = match Spelled::read(body) {
            Ok(spelled) => spelled,
            Err(why) => return malformed(&why),
        };
        McpRequest::Call(ToolCall {
            id,
            name,
            arguments,
            params: params.clone(),
            params_members: spelled.params,
            arguments_members: spelled.arguments,
            arguments_span: spelled.arguments_span,
        })
    }
}

/// The members of a call's `params` and `params.arguments` as the body
/// spells them, which splicing the key argument out works from, and where
/// the arguments are in the body.
struct Spelled {
    params: Vec<Member>,
    arguments: Vec<Member>,
    arguments_span: Option<Range<usize>>,
}

impl Spelled {
    /// Reads them from `body`; why not, when a part is not an object or a
    /// name is given twice.
    fn read(body: &[u8]) -> Result<Self, String> {
        // serde_json took the body, so it is UTF-8 and its objects parse
        // again, member by member.
        let text = std::str::from_utf8(body).map_err(|_| "the body is not UTF-8")?;
        let top = members(text, text).ok_or("the message is not an object")?;
        // Parsers differ on a name given twice (the first or the last
        // wins): the proxy would key and fingerprint another call than
        // the server runs.
        if let Some(twice) = repeated(&top) {
            return Err(format!("the member `{twice}` is given twice"));
        }
        let raw_params = top
            .iter()
            .find(|(m, _)| m.name == "params")
            .map(|(_, v)| *v);
        let params = raw_params
            .and_then(|raw| members(text, raw.get()))
            .ok_or("`params` must be an object")?;
        if let Some(twice) = repeated(&params) {
            return Err(format!("the member `params.{twice}` is given twice"));
        }
        let raw_arguments = params
            .iter()
            .find(|(m, _)| m.name == "arguments")
            .map(|(_, v)| *v)
            .filter(|raw| raw.get().starts_with('{'));
        let (arguments, arguments_span) = match raw_arguments {
            Some(raw) => {
                let members =
                    members(text, raw.get()).ok_or("`params.arguments` must be an object")?;
                if let Some(twice) = repeated(&members) {
                    return Err(format!(
                        "the member `params.arguments.{twice}` is given twice"
                    ));
                }
                let start = offset(text, raw.get());
                (members, Some(start..start + raw.get().len()))
            }
            None => (Vec::new(), None),
        };
        let strip =
            |members: Vec<(Member, &RawValue)>| members.into_iter().map(|(m, _)| m).collect();
        Ok(Self {
            params: strip(params),
            arguments: strip(arguments),
            arguments_span,
        })
    }
}

/// Where the member list of an object's text lies, with each value raw.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> Visitor<'de> for InOrder {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, &'de RawValue>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(InOrder)
    }
}

/// The members of `object` (a JSON object's text, a slice of `text`) in
/// the order written, each with where it sits in `text`; `None` if
/// `object` is no object.
fn members<'a>(text: &'a str, object: &'a str) -> Option<Vec<(Member, &'a RawValue)>> {
    let Members(raw) = serde_json::from_str(object).ok()?;
    // Past the opening brace; between one member's value and the next
    // member's name there is only white space and a comma, so the next
    // quote opens the name.
    let mut cursor = offset(text, object) + object.find('{')? + 1;
    let mut out = Vec::with_capacity(raw.len());
    for (name, value) in raw {
        let start = cursor + text.get(cursor..)?.find('"')?;
        let end = offset(text, value.get()) + value.get().len();
        out.push((
            Member {
                name,
                span: start..end,
            },
            value,
        ));
        cursor = end;
    }
    Some(out)
}

/// Where `part`, a slice of `text`, starts in it.
fn offset(text: &str, part: &str) -> usize {
    (part.as_ptr() as usize).saturating_sub(text.as_ptr() as usize)
}

/// A member name given more than once.
fn repeated(members: &[(Member, &RawValue)]) -> Option<String> {
    let mut seen = std::collections::HashSet::with_capacity(members.len());
    members
        .iter()
        .find(|(m, _)| !seen.insert(m.name.as_str()))
        .map(|(m, _)| m.name.clone())
}

/// The byte ranges that take the members `remove` says out of an object,
/// each with one comma next to it, so that what stays is the object
/// as written without them.
fn removals(members: &[Member], remove: impl Fn(&str) -> bool) -> Vec<Range<usize>> {
    let first_kept = members.iter().position(|m| !remove(&m.name));
    let mut out = Vec::new();
    for (i, member) in members.iter().enumerate() {
        if !remove(&member.name) {
            continue;
        }
        let range = match first_kept {
            // A member after a kept one goes with the comma before it.
            Some(kept) if i > kept => members[i - 1].span.end..member.span.end,
            // One before every kept member goes with the comma after it
            // (up to the next member's name); the last of all alone.
            _ => match members.get(i + 1) {
                Some(next) => member.span.start..next.span.start,
                None => member.span.clone(),
            },
        };
        out.push(range);
    }
    out
}

/// `body` without the bytes in `ranges` (which may overlap).
fn splice(body: &[u8], mut ranges: Vec<Range<usize>>) -> Vec<u8> {
    ranges.sort_by_key(|r| r.start);
    let mut out = Vec::with_capacity(body.len());
    let mut at = 0;
    for range in ranges {
        if range.start > at {
            out.extend_from_slice(body.get(at..range.start).unwrap_or_default());
        }
        at = at.max(range.end);
    }
    out.extend_from_slice(body.get(at..).unwrap_or_default());
    out
}

/// Where a call's key came from, and its value as sent.
#[derive(Debug, Clone, PartialEq)]
pub enum KeySource {
    /// `params.arguments.<key_argument>`.
    Argument(Value),
    /// `params.idempotencyKey`.
    Params(Value),
}

impl KeySource {
    pub fn value(&self) -> &Value {
        match self {
            KeySource::Argument(v) | KeySource::Params(v) => v,
        }
    }
}

impl ToolCall {
    /// The key the call carries in its body: the key argument, else
    /// `params.idempotencyKey` (the header is the caller's to look at).
    pub fn key(&self, key_argument: &str) -> Option<KeySource> {
        if let Some(value) = self.arguments.get(key_argument) {
            return Some(KeySource::Argument(value.clone()));
        }
        self.params
            .get(PARAMS_KEY)
            .map(|value| KeySource::Params(value.clone()))
    }

    /// The arguments without the key argument.
    pub fn arguments_without(&self, key_argument: &str) -> Map<String, Value> {
        let mut arguments = self.arguments.clone();
        arguments.remove(key_argument);
        arguments
    }

    /// `params.arguments` as written in `body` (the body this call was
    /// parsed from), without the key argument; `{}` when there is none.
    pub fn arguments_text(&self, body: &[u8], key_argument: &str) -> Vec<u8> {
        let Some(span) = &self.arguments_span else {
            return b"{}".to_vec();
        };
        let Some(arguments) = body.get(span.clone()) else {
            return b"{}".to_vec();
        };
        let key = removals(&self.arguments_members, |name| name == key_argument);
        let key = key
            .into_iter()
            .map(|r| r.start.saturating_sub(span.start)..r.end.saturating_sub(span.start))
            .collect();
        splice(arguments, key)
    }

    /// The request as forwarded: `body` (the body this call was parsed
    /// from) without the key argument (when `strip`) and without
    /// `params.idempotencyKey`, which no server knows. Every other byte is
    /// kept as the client wrote it: a number no double holds, member order
    /// and white space reach the server as sent.
    pub fn forwarded_body(&self, body: &Bytes, key_argument: &str, strip: bool) -> Bytes {
        let mut cut = removals(&self.params_members, |name| name == PARAMS_KEY);
        if strip {
            cut.extend(removals(&self.arguments_members, |name| {
                name == key_argument
            }));
        }
        if cut.is_empty() {
            return body.clone();
        }
        Bytes::from(splice(body, cut))
    }
}

/// How a server answered a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// A final `result`: the tool ran (even with `isError: true`).
    Result(Value),
    /// A `result` that asks the client for more (`resultType:
    /// "input_required"`): not final, the call continues in a new request.
    InputRequired,
    /// A JSON-RPC `error`: the server did not run the tool.
    Error,
}

/// The answer to the request `id` in `message`, if that is what it is
/// (read from the call's own HTTP response: a JSON-RPC error with a null
/// id there answers it too).
pub fn answer_to(message: &[u8], id: &Value) -> Option<Answer> {
    let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(message) else {
        return None;
    };
    if message.contains_key("method") {
        return None;
    }
    // An error whose id is null is the server saying it could not read
    // the request far enough to tell its id (a parse error, an invalid
    // request): on the call's own response, that is this call, not run.
    let unread = message.get("id") == Some(&Value::Null) && message.contains_key("error");
    if message.get("id") != Some(id) && !unread {
        return None;
    }
    if message.contains_key("error") {
        return Some(Answer::Error);
    }
    let result = message.remove("result")?;
    if result.get("resultType").and_then(Value::as_str) == Some("input_required") {
        return Some(Answer::InputRequired);
    }
    Some(Answer::Result(result))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(body: &str) -> ToolCall {
        match McpRequest::parse(body.as_bytes()) {
            McpRequest::Call(call) => call,
            other => panic!("not a call: {other:?}"),
        }
    }

    #[test]
    fn tells_calls_listings_batches_and_the_rest_apart() {
        let parse = |v: Value| McpRequest::parse(v.to_string().as_bytes());
        assert!(matches!(
            parse(json!({"jsonrpc":"2.0","id":1,"method":"tools/list"})),
            McpRequest::List { id } if id == json!(1)
        ));
        assert!(matches!(
            parse(json!([{"jsonrpc":"2.0"}])),
            McpRequest::Batch(items) if items == [BatchItem::Other]
        ));
        assert!(matches!(
            parse(json!([
                {"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send"}},
                {"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":3}},
                {"method":"tools/call"},
            ])),
            McpRequest::Batch(items) if items == [
                BatchItem::Call { name: Some("send".into()) },
                BatchItem::Cancel { request_id: json!(3) },
                BatchItem::Call { name: None },
            ]
        ));
        assert!(matches!(
            parse(json!({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"r7","reason":"timeout"}})),
            McpRequest::Cancel { request_id } if request_id == json!("r7")
        ));
        for other in [
            json!({"jsonrpc":"2.0","method":"notifications/initialized"}),
            json!({"jsonrpc":"2.0","method":"notifications/cancelled","params":{}}),
            json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}),
            json!("text"),
        ] {
            assert!(matches!(parse(other.clone()), McpRequest::Other), "{other}");
        }
        let c = call(r#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"t"}}"#);
        assert_eq!(c.arguments, Map::new());
    }

    #[test]
    fn a_body_that_is_not_json_is_unparsable() {
        for body in [
            "{not json",
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"n":NaN}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"n":Infinity}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"n":-Infinity}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"s":"\ud800"}}}"#,
        ] {
            assert!(
                matches!(
                    McpRequest::parse(body.as_bytes()),
                    McpRequest::Unparsable(_)
                ),
                "{body}"
            );
        }
    }

    #[test]
    fn a_call_in_an_odd_shape_is_malformed_not_other() {
        for (body, id, name) in [
            (
                json!({"id":1,"method":"tools/call","params":{"name":"x"}}),
                json!(1),
                Some("x"),
            ),
            (
                json!({"jsonrpc":"1.0","id":1,"method":"tools/call","params":{"name":"x"}}),
                json!(1),
                Some("x"),
            ),
            (
                json!({"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"x"}}),
                json!(null),
                Some("x"),
            ),
            (
                json!({"jsonrpc":"2.0","method":"tools/call","params":{"name":"x"}}),
                json!(null),
                Some("x"),
            ),
            (
                json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}),
                json!(1),
                None,
            ),
            (
                json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":[1]}),
                json!(1),
                None,
            ),
            (
                json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":[1]}}),
                json!(1),
                Some("x"),
            ),
        ] {
            match McpRequest::parse(body.to_string().as_bytes()) {
                McpRequest::MalformedCall {
                    id: got,
                    name: said,
                    why,
                } => {
                    assert_eq!((got, said.as_deref()), (id, name), "{body}");
                    assert!(why.contains("not a valid JSON-RPC 2.0 request"), "{why}");
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        for twice in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"},"params":{"name":"y"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{},"arguments":{"a":1}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"k":"a","k":"b"}}}"#,
        ] {
            match McpRequest::parse(twice.as_bytes()) {
                McpRequest::MalformedCall { why, .. } => assert!(why.contains("twice"), "{why}"),
                other => panic!("{twice}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_key_comes_from_the_argument_then_params() {
        let c = call(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"name":"send","arguments":{"to":"a","idempotency_key":"k1"},"idempotencyKey":"k2"}}"#,
        );
        assert_eq!(
            c.key("idempotency_key"),
            Some(KeySource::Argument(json!("k1")))
        );
        assert_eq!(c.key("other"), Some(KeySource::Params(json!("k2"))));
        assert_eq!(
            c.arguments_without("idempotency_key"),
            json!({"to":"a"}).as_object().cloned().unwrap_or_default()
        );
    }

    #[test]
    fn the_forwarded_body_loses_the_key_and_keeps_every_other_byte() {
        let forwarded = |body: &str, strip: bool| {
            let bytes = Bytes::from(body.to_owned());
            let c = call(body);
            String::from_utf8(c.forwarded_body(&bytes, "idempotency_key", strip).to_vec())
                .expect("UTF-8")
        };
        let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call",
            "params":{"name":"send","arguments":{"z":123456789012345678901234567890, "idempotency_key":"k1" ,"a":1.50},
                      "idempotencyKey":"k2","_meta":{"progressToken":3}}}"#;
        assert_eq!(
            forwarded(body, true),
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call",
            "params":{"name":"send","arguments":{"z":123456789012345678901234567890 ,"a":1.50},"_meta":{"progressToken":3}}}"#
        );
        assert_eq!(
            forwarded(body, false),
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call",
            "params":{"name":"send","arguments":{"z":123456789012345678901234567890, "idempotency_key":"k1" ,"a":1.50},"_meta":{"progressToken":3}}}"#
        );
        // First, last, alone, and a name spelled with an escape.
        for (arguments, left) in [
            (
                r#"{ "idempotency_key" : "k", "b" : [1, {"c": 2}] }"#,
                r#"{ "b" : [1, {"c": 2}] }"#,
            ),
            (r#"{"b":"}\"{","idempotency_key":"k"}"#, r#"{"b":"}\"{"}"#),
            (r#"{"idempotency_key":"k"}"#, r#"{}"#),
            (r#"{"idempotency\u005fkey":"k","b":1}"#, r#"{"b":1}"#),
        ] {
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"t","arguments":{arguments}}}}}"#
            );
            let want = format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"t","arguments":{left}}}}}"#
            );
            assert_eq!(forwarded(&body, true), want);
            assert_eq!(
                call(&body).arguments_text(body.as_bytes(), "idempotency_key"),
                left.as_bytes()
            );
        }
        let untouched = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}"#;
        assert_eq!(forwarded(untouched, true), untouched);
        assert_eq!(
            call(untouched).arguments_text(untouched.as_bytes(), "k"),
            b"{}"
        );
    }

    #[test]
    fn removing_members_keeps_the_object_valid_whichever_go() {
        let object = r#"{"a":1, "b":2 ,"c":3}"#;
        let members: Vec<Member> = members(object, object)
            .expect("object")
            .into_iter()
            .map(|(m, _)| m)
            .collect();
        for gone in 0..8u8 {
            let remove = |name: &str| {
                let bit = match name {
                    "a" => 1,
                    "b" => 2,
                    _ => 4,
                };
                gone & bit != 0
            };
            let left = splice(object.as_bytes(), removals(&members, remove));
            let left: Map<String, Value> = serde_json::from_slice(&left)
                .unwrap_or_else(|e| panic!("{gone}: {e}: {}", String::from_utf8_lossy(&left)));
            let names: Vec<&str> = left.keys().map(String::as_str).collect();
            let want: Vec<&str> = ["a", "b", "c"].into_iter().filter(|n| !remove(n)).collect();
            assert_eq!(names, want);
        }
    }

    #[test]
    fn an_answer_is_the_response_to_the_same_id() {
        let id = json!(3);
        let answer = |v: Value| answer_to(v.to_string().as_bytes(), &id);
        assert_eq!(
            answer(json!({"jsonrpc":"2.0","id":3,"result":{"content":[]}})),
            Some(Answer::Result(json!({"content":[]})))
        );
        assert_eq!(
            answer(json!({"jsonrpc":"2.0","id":3,"result":{"resultType":"input_required"}})),
            Some(Answer::InputRequired)
        );
        assert_eq!(
            answer(json!({"jsonrpc":"2.0","id":3,"error":{"code":-32602,"message":"x"}})),
            Some(Answer::Error)
        );
        assert_eq!(
            answer(
                json!({"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}})
            ),
            Some(Answer::Error),
            "the server could not read the call: it did not run it"
        );
        assert_eq!(answer(json!({"jsonrpc":"2.0","id":null,"result":{}})), None);
        assert_eq!(answer(json!({"jsonrpc":"2.0","id":4,"result":{}})), None);
        assert_eq!(answer(json!({"jsonrpc":"2.0","id":"3","result":{}})), None);
        assert_eq!(
            answer(json!({"jsonrpc":"2.0","method":"notifications/progress","params":{}})),
            None
        );
    }
}
