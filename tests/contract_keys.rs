//! DESIGN.md §1, the key rows: which requests are covered, a missing key,
//! malformed keys, the accepted forms of a key, and per-route overrides.

use crate::support;

use std::str::FromStr;

use http::Method;
use idemproxy::config::{IdempotencySettings, RouteConfig};
use idemproxy::request::key::{IdempotencyKey, InvalidKey};
use support::proxy::{config, Reply, TestClient, TestProxy};
use support::raw;
use support::upstream::TestUpstream;

const JSON: (&str, &str) = ("content-type", "application/json");

fn assert_invalid_key(reply: &Reply, what: &str) {
    assert_eq!(reply.status, 400, "{what}: {reply:?}");
    assert_eq!(reply.problem(), "invalid-key", "{what}");
    assert_eq!(reply.header("x-should-retry"), Some("false"), "{what}");
    assert!(!reply.replayed(), "{what}");
}

#[tokio::test]
async fn covered_request_without_a_key_on_a_required_route_is_400_missing_key() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.require_key = true;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    for method in [Method::POST, Method::PATCH] {
        let reply = client
            .send(method.clone(), &proxy.url("/v1/orders"), &[JSON], "{}")
            .await;
        assert_eq!(reply.status, 400, "{method}: {reply:?}");
        assert_eq!(reply.problem(), "missing-key", "{method}");
        assert_eq!(reply.header("x-should-retry"), Some("false"));
        assert_eq!(reply.header("stripe-should-retry"), Some("false"));
    }
    assert_eq!(upstream.executions("/v1/orders"), 0);

    // Requiring a key does not extend to methods the route does not cover.
    let reply = client
        .send(Method::GET, &proxy.url("/v1/orders"), &[], "")
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn covered_request_without_a_key_is_forwarded_untouched_every_time() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let body = r#"{"amount": 5,   "currency":"eur"}"#;

    for n in 1..=2 {
        let reply = client
            .send(
                Method::POST,
                &proxy.url("/v1/orders"),
                &[JSON, ("x-custom", "kept")],
                body,
            )
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.header("x-upstream-execution"), Some(&*n.to_string()));
        assert!(reply.header("idempotent-replayed").is_none());
        assert!(reply.header("idempotency-original-date").is_none());
        assert_eq!(upstream.executions("/v1/orders"), n);
    }
    // Untouched: the body byte for byte (not canonicalized), the headers.
    assert_eq!(
        upstream.last_body("/v1/orders").expect("a request arrived"),
        body.as_bytes()
    );
    let headers = upstream.last_headers("/v1/orders").expect("headers");
    assert_eq!(headers["x-custom"], "kept");
    assert_eq!(headers["content-type"], "application/json");
}

#[tokio::test]
async fn malformed_keys_are_400_invalid_key_and_never_execute() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");
    let too_long = "k".repeat(256);

    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("empty", vec![("idempotency-key", "")]),
        ("256 characters", vec![("idempotency-key", &too_long)]),
        ("a tab inside", vec![("idempotency-key", "ab\tcd")]),
        ("a space inside", vec![("idempotency-key", "ab cd")]),
        (
            "an unterminated sf-string",
            vec![("idempotency-key", "\"abc")],
        ),
        (
            "an sf-string with a tail",
            vec![("idempotency-key", "\"abc\"x")],
        ),
        (
            "two Idempotency-Key headers",
            vec![("idempotency-key", "one"), ("idempotency-key", "two")],
        ),
        (
            "two headers with the same key",
            vec![("idempotency-key", "same"), ("idempotency-key", "same")],
        ),
    ];
    for (what, key_headers) in &cases {
        let mut headers = key_headers.clone();
        headers.push(JSON);
        let reply = client.send(Method::POST, &url, &headers, "{}").await;
        assert_invalid_key(&reply, what);
    }

    // obs-text (bytes 0x80-0xFF) is legal on the wire but not in a key; no
    // client library sends it, so it goes over a bare socket.
    let reply = raw::exchange(
        proxy.addr,
        &raw::request(
            "POST",
            "/v1/orders",
            &[
                b"idempotency-key: caf\xc3\xa9",
                b"content-type: application/json",
            ],
            b"{}",
        ),
    )
    .await;
    assert_invalid_key(&reply, "obs-text");

    // DEL (0x7F) is not even a legal field-value byte: the HTTP parser
    // refuses the request before the middleware sees it. Still a 400, still
    // never executed; the key parser refuses it as well (below).
    let reply = raw::exchange(
        proxy.addr,
        &raw::request(
            "POST",
            "/v1/orders",
            &[
                b"idempotency-key: ab\x7fcd",
                b"content-type: application/json",
            ],
            b"{}",
        ),
    )
    .await;
    assert_eq!(reply.status, 400, "DEL: {reply:?}");
    assert!(matches!(
        IdempotencyKey::from_str("ab\x7fcd"),
        Err(InvalidKey::InvalidChar {
            offset: 2,
            byte: 0x7f
        })
    ));

    assert_eq!(upstream.executions("/v1/orders"), 0);
    assert_eq!(upstream.total(), 0);
}

#[tokio::test]
async fn a_255_character_key_is_accepted() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let key = "k".repeat(255);

    let first = client.post_json(&proxy.url("/v1/orders"), &key, "{}").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    let second = client.post_json(&proxy.url("/v1/orders"), &key, "{}").await;
    assert_eq!(second.status, 201, "{second:?}");
    assert!(second.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 1);
}

#[tokio::test]
async fn an_sf_string_key_is_unquoted_and_names_the_same_key_as_the_bare_one() {
    let upstream = TestUpstream::start().await;
    let proxy = TestProxy::start(config(&upstream.url())).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");

    let first = client.post_json(&url, "\"abc\"", "{}").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    let bare = client.post_json(&url, "abc", "{}").await;
    assert_eq!(bare.status, 201, "{bare:?}");
    assert!(bare.replayed(), "`abc` replays `\"abc\"`: {bare:?}");
    assert_eq!(bare.body, first.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);

    // Inside an sf-string a space is allowed, and the quotes are not part of
    // the key: `"a b"` is a fresh key that then replays.
    let spaced = client.post_json(&url, "\"a b\"", "{}").await;
    assert_eq!(spaced.status, 201, "{spaced:?}");
    assert!(!spaced.replayed());
    assert_eq!(upstream.executions("/v1/orders"), 2);
    let again = client.post_json(&url, "\"a b\"", "{}").await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(upstream.executions("/v1/orders"), 2);
}

#[tokio::test]
async fn uncovered_methods_pass_through_even_with_a_key() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    // Even a route that requires keys only requires them on its methods.
    c.idempotency.require_key = true;
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    for (method, path) in [
        (Method::GET, "/v1/get"),
        (Method::PUT, "/v1/put"),
        (Method::DELETE, "/v1/delete"),
    ] {
        for n in 1..=2 {
            let reply = client
                .send(
                    method.clone(),
                    &proxy.url(path),
                    &[("idempotency-key", "k1"), JSON],
                    "{}",
                )
                .await;
            assert_eq!(reply.status, 201, "{method} #{n}: {reply:?}");
            assert!(!reply.replayed(), "{method} #{n}");
            assert_eq!(reply.header("x-upstream-execution"), Some(&*n.to_string()));
        }
        assert_eq!(upstream.executions(path), 2, "{method} executes every time");
    }
    // A key with characters the proxy would refuse is not even looked at on
    // an uncovered method.
    let reply = client
        .send(
            Method::GET,
            &proxy.url("/v1/get"),
            &[("idempotency-key", "")],
            "",
        )
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
}

#[tokio::test]
async fn routes_override_the_defaults_by_prefix_and_the_first_match_wins() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.routes = vec![
        RouteConfig {
            name: "payments".into(),
            path: "/v1/payments".into(),
            idempotency: IdempotencySettings {
                require_key: true,
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
        // Shadowed by `payments`, which comes first, although longer.
        RouteConfig {
            name: "refunds".into(),
            path: "/v1/payments/refunds".into(),
            idempotency: IdempotencySettings {
                require_key: false,
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
        RouteConfig {
            name: "things".into(),
            path: "/v1/things".into(),
            idempotency: IdempotencySettings {
                methods: vec!["PUT".into()],
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
    ];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();

    // `payments` requires a key, below its prefix too.
    for path in ["/v1/payments", "/v1/payments/p_1", "/v1/payments/refunds"] {
        let reply = client
            .send(Method::POST, &proxy.url(path), &[JSON], "{}")
            .await;
        assert_eq!(reply.status, 400, "{path}: {reply:?}");
        assert_eq!(reply.problem(), "missing-key", "{path}");
        assert_eq!(upstream.executions(path), 0, "{path}");
    }
    // A prefix matches on segment boundaries only: `/v1/paymentsx` is not
    // `payments` and falls back to the defaults (key not required).
    let reply = client
        .send(Method::POST, &proxy.url("/v1/paymentsx"), &[JSON], "{}")
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    // Elsewhere the defaults apply.
    let reply = client
        .send(Method::POST, &proxy.url("/v1/orders"), &[JSON], "{}")
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");

    // `things` covers PUT (and only PUT).
    let url = proxy.url("/v1/things/t_1");
    for n in 1..=2 {
        let reply = client
            .send(
                Method::PUT,
                &url,
                &[("idempotency-key", "put-1"), JSON],
                "{}",
            )
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.replayed(), n == 2, "PUT #{n}");
    }
    assert_eq!(upstream.executions("/v1/things/t_1"), 1);
    for n in 1..=2 {
        let reply = client
            .send(
                Method::POST,
                &url,
                &[("idempotency-key", "post-1"), JSON],
                "{}",
            )
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(!reply.replayed(), "POST #{n} is not covered on `things`");
    }
    assert_eq!(upstream.executions("/v1/things/t_1"), 3);
}

/// A route is matched on the path as upstream routers read it: spelled
/// with a doubled slash, an encoded letter or a dot segment, a keyless POST
/// to `payments` still gets its 400, instead of falling to the default
/// policy and passing unprotected. The path is forwarded as it was sent.
#[tokio::test]
async fn a_route_matches_its_path_however_it_is_spelled() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.routes = vec![RouteConfig {
        name: "payments".into(),
        path: "/v1/payments".into(),
        idempotency: IdempotencySettings {
            require_key: true,
            ..c.idempotency.clone()
        },
        ..Default::default()
    }];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    for path in [
        "/v1//payments",
        "/v1/%70ayments",
        "/v1/./payments",
        "/v1/x/../payments",
        "/v1/%2e/payments/p_1",
    ] {
        let reply = client
            .send(Method::POST, &proxy.url(path), &[JSON], "{}")
            .await;
        assert_eq!(reply.status, 400, "{path}: {reply:?}");
        assert_eq!(reply.problem(), "missing-key", "{path}");
    }
    assert_eq!(upstream.total(), 0, "nothing was forwarded");

    // With a key, protected and forwarded as sent.
    for n in 1..=2 {
        let reply = client
            .send(
                Method::POST,
                &proxy.url("/v1//payments"),
                &[("idempotency-key", "spelled-1"), JSON],
                "{}",
            )
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.replayed(), n == 2, "POST #{n}");
    }
    assert_eq!(upstream.executions("/v1//payments"), 1);
}
