//! JSON-RPC messages as an MCP client sends them, and the one message of
//! an answer that responds to a given request.

use serde_json::{Map, Value};

/// The name of the member of `params` that SEP-3182 proposed for a key.
const PARAMS_KEY: &str = "idempotencyKey";

/// What a request body is, as far as protection goes.
#[derive(Debug)]
pub enum McpRequest {
    /// A `tools/call` request.
    Call(ToolCall),
    /// A `tools/list` request, whose answer is rewritten.
    List { id: Value },
    /// A `notifications/cancelled` for the request `request_id`.
    Cancel { request_id: Value },
    /// A JSON array: a batch, passed through unprotected.
    Batch,
    /// Anything else: another method, a notification, a response, or not
    /// JSON-RPC at all. Passed through untouched.
    Other,
}

impl McpRequest {
    pub fn parse(body: &[u8]) -> McpRequest {
        let Ok(message) = serde_json::from_slice::<Value>(body) else {
            return McpRequest::Other;
        };
        let mut message = match message {
            Value::Object(message) => message,
            Value::Array(_) => return McpRequest::Batch,
            _ => return McpRequest::Other,
        };
        if message.get("method").and_then(Value::as_str) == Some("notifications/cancelled") {
            return match message.get("params").and_then(|p| p.get("requestId")) {
                Some(id @ (Value::String(_) | Value::Number(_))) => McpRequest::Cancel {
                    request_id: id.clone(),
                },
                _ => McpRequest::Other,
            };
        }
        // A request has an id (string or number); a notification has none.
        let id = match message.get("id") {
            Some(id @ (Value::String(_) | Value::Number(_))) => id.clone(),
            _ => return McpRequest::Other,
        };
        match message.get("method").and_then(Value::as_str) {
            Some("tools/list") => McpRequest::List { id },
            Some("tools/call") => {
                let Some(Value::Object(params)) = message.remove("params") else {
                    return McpRequest::Other;
                };
                let Some(name) = params.get("name").and_then(Value::as_str) else {
                    return McpRequest::Other;
                };
                let arguments = match params.get("arguments") {
                    None | Some(Value::Null) => Some(Map::new()),
                    Some(Value::Object(arguments)) => Some(arguments.clone()),
                    Some(_) => None,
                };
                let Some(arguments) = arguments else {
                    return McpRequest::Other;
                };
                McpRequest::Call(ToolCall {
                    id,
                    name: name.to_owned(),
                    arguments,
                    params,
                    message,
                })
            }
            _ => McpRequest::Other,
        }
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
    /// The message without `params`.
    message: Map<String, Value>,
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

    /// The arguments without the key argument: what the fingerprint covers.
    pub fn arguments_without(&self, key_argument: &str) -> Map<String, Value> {
        let mut arguments = self.arguments.clone();
        arguments.remove(key_argument);
        arguments
    }

    /// The request as forwarded: without the key argument (when `strip`)
    /// and without `params.idempotencyKey`, which no server knows.
    pub fn forwarded_body(&self, key_argument: &str, strip: bool) -> Vec<u8> {
        let mut params = self.params.clone();
        if strip {
            if let Some(Value::Object(arguments)) = params.get_mut("arguments") {
                arguments.remove(key_argument);
            }
        }
        params.remove(PARAMS_KEY);
        let mut message = self.message.clone();
        message.insert("params".into(), Value::Object(params));
        serde_json::to_vec(&message).unwrap_or_default()
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

/// The answer to the request `id` in `message`, if that is what it is.
pub fn answer_to(message: &[u8], id: &Value) -> Option<Answer> {
    let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(message) else {
        return None;
    };
    if message.get("id") != Some(id) || message.contains_key("method") {
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

    fn call(body: Value) -> ToolCall {
        match McpRequest::parse(body.to_string().as_bytes()) {
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
            McpRequest::Batch
        ));
        assert!(matches!(
            parse(json!({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"r7","reason":"timeout"}})),
            McpRequest::Cancel { request_id } if request_id == json!("r7")
        ));
        for other in [
            json!({"jsonrpc":"2.0","method":"notifications/initialized"}),
            json!({"jsonrpc":"2.0","method":"notifications/cancelled","params":{}}),
            json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}),
            json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}),
            json!({"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"x"}}),
            json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":[1]}}),
            json!("text"),
        ] {
            assert!(matches!(parse(other.clone()), McpRequest::Other), "{other}");
        }
        assert!(matches!(McpRequest::parse(b"{not json"), McpRequest::Other));
        let c = call(json!({"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"t"}}));
        assert_eq!(c.arguments, Map::new());
    }

    #[test]
    fn the_key_comes_from_the_argument_then_params() {
        let c = call(json!({"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"name":"send","arguments":{"to":"a","idempotency_key":"k1"},"idempotencyKey":"k2"}}));
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
    fn the_forwarded_body_loses_the_key_and_keeps_the_rest() {
        let c = call(json!({"jsonrpc":"2.0","id":7,"method":"tools/call",
            "params":{"name":"send","arguments":{"to":"a","idempotency_key":"k1"},
                      "idempotencyKey":"k2","_meta":{"progressToken":3}}}));
        let forwarded: Value =
            serde_json::from_slice(&c.forwarded_body("idempotency_key", true)).expect("json");
        assert_eq!(
            forwarded,
            json!({"jsonrpc":"2.0","id":7,"method":"tools/call",
                "params":{"name":"send","arguments":{"to":"a"},"_meta":{"progressToken":3}}})
        );
        let kept: Value =
            serde_json::from_slice(&c.forwarded_body("idempotency_key", false)).expect("json");
        assert_eq!(kept["params"]["arguments"]["idempotency_key"], "k1");
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
        assert_eq!(answer(json!({"jsonrpc":"2.0","id":4,"result":{}})), None);
        assert_eq!(answer(json!({"jsonrpc":"2.0","id":"3","result":{}})), None);
        assert_eq!(
            answer(json!({"jsonrpc":"2.0","method":"notifications/progress","params":{}})),
            None
        );
    }
}
