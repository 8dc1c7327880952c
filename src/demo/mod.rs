//! `idemproxy demo`: small APIs to put the proxy in front of, so a newcomer
//! sees with curl what it does: for a write API, a first call, a replay, a
//! mismatch and an in-flight duplicate (`payments`); with `--mcp`, the same
//! for an agent's tool calls through an MCP route (`mcp`).

mod mcp;
mod payments;

use axum::Router;

/// The path of the demo MCP server, and of the MCP route in front of it.
pub const MCP_PATH: &str = "/mcp";

/// Both demo APIs on one listener: the payments API and the MCP server.
pub fn router() -> Router {
    payments::router().merge(mcp::router(MCP_PATH))
}

/// The walkthrough `idemproxy demo` prints when it starts, for a proxy
/// listening on `proxy`; `store` says where its records live.
pub fn walkthrough(proxy: &str, store: &str) -> String {
    format!(
        r#"
idemproxy demo: proxy on http://{proxy}  (embedded store, demo payments API behind it)

1. A first call executes (201, a new payment id):
   curl -i -X POST http://{proxy}/v1/payments -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' -d '{{"amount": 1000, "currency": "eur"}}'

2. The same call again is a replay: same body, `Idempotent-Replayed: true`, no second charge:
   curl -i -X POST http://{proxy}/v1/payments -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' -d '{{"currency": "eur", "amount": 1000}}'

3. The same key with a different request is a caller bug: 409 key-reused:
   curl -i -X POST http://{proxy}/v1/payments -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' -d '{{"amount": 9999, "currency": "eur"}}'

4. A duplicate while the first is still running: 425 in-flight with Retry-After:
   curl -s -X POST 'http://{proxy}/v1/payments?delay_ms=5000' -H 'Idempotency-Key: slow-1' -d '{{}}' -H 'Content-Type: application/json' &
   sleep 1; curl -i -X POST 'http://{proxy}/v1/payments?delay_ms=5000' -H 'Idempotency-Key: slow-1' -d '{{}}' -H 'Content-Type: application/json'

5. Count the charges the API really made:
   curl -s http://{proxy}/v1/payments

Stop with Ctrl-C. {store}
"#
    )
}

/// The walkthrough `idemproxy demo --mcp` prints: an agent's tool calls
/// through the MCP route at [`MCP_PATH`].
pub fn mcp_walkthrough(proxy: &str, store: &str) -> String {
    let post = format!(
        "curl -s http://{proxy}{MCP_PATH} -H 'Content-Type: application/json' \
         -H 'Accept: application/json, text/event-stream' -d"
    );
    let call = |id: u32, subject: &str| {
        format!(
            r#"{post} '{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"send_email","arguments":{{"to":"ana@example.com","subject":"{subject}","idempotency_key":"receipt-42"}}}}}}'"#
        )
    };
    format!(
        r#"
idemproxy demo --mcp: an MCP route on http://{proxy}{MCP_PATH}  (embedded store, a demo MCP server with two tools behind it)

1. List the tools: send_email gains a required `idempotency_key` argument; outbox (read-only) does not:
   {post} '{{"jsonrpc":"2.0","id":1,"method":"tools/list"}}'

2. The model calls send_email with a key: the server sends email #1:
   {first}

3. The answer was lost; the client sends the call again under a new JSON-RPC id: the stored result,
   with a first text item telling the model the call already ran, and `io.idemproxy/replayed` in `_meta`:
   {again}

4. The model reuses the key for another email: a tool result with isError: true, nothing sent:
   {other}

5. Read the outbox (read-only: passes through, no key needed): one email, not two:
   {post} '{{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{{"name":"outbox","arguments":{{}}}}}}'

Stop with Ctrl-C. {store}
"#,
        first = call(2, "Your receipt"),
        again = call(3, "Your receipt"),
        other = call(4, "Your refund"),
    )
}
