//! Scopes that survive token refresh: `jwt:<claim>` names the caller by a
//! claim of its verified bearer token, so a retry sent with a refreshed
//! token is the same caller's retry, and a token that does not verify
//! chooses no scope (401 `invalid-token`, nothing forwarded).

use crate::support;

use std::time::Duration;

use http::Method;
use idemproxy::config::{Anonymous, IdempotencySettings, RouteConfig};
use idemproxy::request::identity::{IdentitySettings, TokenVerifier};
use serde_json::json;
use support::proxy::{config, TestClient, TestProxy};
use support::tokens::{at, jwks, Signer};
use support::upstream::TestUpstream;

const JSON: (&str, &str) = ("content-type", "application/json");
const ISSUER: &str = "https://auth.test/";
const AUDIENCE: &str = "payments";
const ADMIN_TOKEN: &str = "identity-admin-token-0123456789abcdef";

fn claims(sub: &str, jti: u32) -> serde_json::Value {
    json!({ "sub": sub, "iss": ISSUER, "aud": AUDIENCE, "iat": at(0), "exp": at(600), "jti": jti })
}

fn verifier(signers: &[&Signer]) -> TokenVerifier {
    TokenVerifier::new(&IdentitySettings {
        jwks: jwks(signers),
        issuer: Some(ISSUER.into()),
        audience: Some(AUDIENCE.into()),
        leeway: Duration::from_secs(5),
    })
    .expect("key set")
}

#[test]
fn tokens_verify_by_key_algorithm_expiry_issuer_and_audience() {
    let (es, ed) = (Signer::es256("es-1"), Signer::eddsa("ed-1"));
    let rs = Signer::rs256("rs-1", "rsa-a");
    let v = verifier(&[&es, &ed, &rs]);
    for signer in [&es, &ed, &rs] {
        let verified = v
            .verify(&signer.token(claims("alice", 1)))
            .expect("verifies");
        assert_eq!(verified["sub"], "alice");
    }
    let refused = |claims: serde_json::Value, signer: &Signer, why: &str| {
        let err = v.verify(&signer.token(claims)).expect_err(why);
        assert!(!err.is_empty(), "{why}");
    };
    let mut expired = claims("alice", 2);
    expired["exp"] = at(-60).into();
    refused(expired, &es, "expired past the leeway");
    let mut early = claims("alice", 3);
    early["nbf"] = at(600).into();
    refused(early, &es, "not yet valid");
    let mut other_issuer = claims("alice", 4);
    other_issuer["iss"] = "https://evil.test/".into();
    refused(other_issuer, &ed, "another issuer");
    let mut other_audience = claims("alice", 5);
    other_audience["aud"] = "mail".into();
    refused(other_audience, &ed, "another audience");
    let mut no_expiry = claims("alice", 6);
    no_expiry.as_object_mut().expect("object").remove("exp");
    refused(no_expiry, &es, "no exp");
    // A key the set does not hold, even under a kid it does.
    refused(claims("alice", 7), &Signer::es256("es-1"), "unknown key");
    refused(claims("alice", 8), &Signer::es256("es-9"), "unknown kid");
    refused(
        claims("alice", 10),
        &Signer::rs256("rs-1", "rsa-b"),
        "another RSA key",
    );
    let mut rs_expired = claims("alice", 11);
    rs_expired["exp"] = at(-60).into();
    refused(rs_expired, &rs, "an expired RS256 token");
    // HS256: a shared secret is no proof of who signed.
    let hs = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims("alice", 9),
        &jsonwebtoken::EncodingKey::from_secret(b"secret"),
    )
    .expect("sign");
    assert!(v.verify(&hs).is_err(), "HS256 refused");
    assert!(v.verify("not.a.token").is_err());
}

#[test]
fn a_key_set_without_usable_keys_is_refused() {
    for bad in [
        "{}",
        r#"{"keys": []}"#,
        r#"{"keys": [{"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}]}"#,
        "not json",
    ] {
        let err = TokenVerifier::new(&IdentitySettings {
            jwks: bad.into(),
            ..IdentitySettings::default()
        })
        .expect_err(bad);
        assert!(!err.is_empty());
    }
}

/// The proxy in front of a counting upstream, scoping by `jwt:sub` on
/// `/v1/payments` and by the raw header on `/v1/legacy`.
async fn proxy_with_identity(signers: &[&Signer]) -> (TestUpstream, TestProxy, tempfile::TempDir) {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let jwks_file = dir.path().join("jwks.json");
    std::fs::write(&jwks_file, jwks(signers)).expect("write the key set");
    let mut c = config(&upstream.url());
    c.admin_token = Some(ADMIN_TOKEN.into());
    c.identity.jwks_file = Some(jwks_file);
    c.identity.issuer = Some(ISSUER.into());
    c.identity.audience = Some(AUDIENCE.into());
    c.routes = vec![
        RouteConfig {
            name: "payments".into(),
            path: "/v1/payments".into(),
            idempotency: IdempotencySettings {
                scope: vec!["jwt:sub".into()],
                anonymous: Anonymous::Reject,
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
        RouteConfig {
            name: "legacy".into(),
            path: "/v1/legacy".into(),
            idempotency: IdempotencySettings {
                scope: vec!["header:authorization".into()],
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
    ];
    let proxy = TestProxy::start(c).await;
    (upstream, proxy, dir)
}

#[tokio::test]
async fn a_retry_with_a_refreshed_token_replays_under_jwt_scope() {
    let signer = Signer::es256("k1");
    let (upstream, proxy, _dir) = proxy_with_identity(&[&signer]).await;
    let client = TestClient::new();
    let post = |path: &'static str, token: String, key: &'static str| {
        let (client, url) = (&client, proxy.url(path));
        async move {
            let auth = format!("Bearer {token}");
            client
                .send(
                    Method::POST,
                    &url,
                    &[("authorization", &auth), ("idempotency-key", key), JSON],
                    "{}",
                )
                .await
        }
    };

    let first = post("/v1/payments", signer.token(claims("alice", 1)), "k").await;
    assert_eq!(first.status, 201, "{first:?}");
    // The token was refreshed between the lost answer and the retry.
    let retry = post("/v1/payments", signer.token(claims("alice", 2)), "k").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(
        retry.replayed(),
        "the same caller's retry replays: {retry:?}"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.executions("/v1/payments"), 1);

    // Another caller, the same key: a key of its own.
    let bob = post("/v1/payments", signer.token(claims("bob", 3)), "k").await;
    assert_eq!(bob.status, 201);
    assert!(!bob.replayed());
    assert_eq!(upstream.executions("/v1/payments"), 2);

    // Under `header:authorization` the refreshed token is another scope:
    // the retry executes again, which is why the scope must name the caller.
    let first = post("/v1/legacy", signer.token(claims("alice", 4)), "k").await;
    let retry = post("/v1/legacy", signer.token(claims("alice", 5)), "k").await;
    assert_eq!((first.status.as_u16(), retry.status.as_u16()), (201, 201));
    assert!(!retry.replayed());
    assert_eq!(upstream.executions("/v1/legacy"), 2);
}

#[tokio::test]
async fn a_token_that_does_not_verify_or_no_caller_is_refused_unforwarded() {
    let signer = Signer::eddsa("k1");
    let (upstream, proxy, _dir) = proxy_with_identity(&[&signer]).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/payments");

    let forged = Signer::eddsa("k1").token(claims("alice", 1));
    let mut expired = claims("alice", 2);
    expired["exp"] = at(-3600).into();
    for (what, auth) in [
        ("another key", format!("Bearer {forged}")),
        ("expired", format!("Bearer {}", signer.token(expired))),
        ("not a bearer token", "Basic YWxpY2U6cHc=".to_owned()),
    ] {
        let reply = client
            .send(
                Method::POST,
                &url,
                &[("authorization", &auth), ("idempotency-key", "k"), JSON],
                "{}",
            )
            .await;
        reply.assert_problem(401, "invalid-token");
        assert!(
            reply
                .header("www-authenticate")
                .is_some_and(|v| v.contains("invalid_token")),
            "{what}: {reply:?}"
        );
        assert_eq!(reply.header("x-should-retry"), Some("false"), "{what}");
    }
    let anonymous = client
        .send(Method::POST, &url, &[("idempotency-key", "k"), JSON], "{}")
        .await;
    anonymous.assert_problem(401, "missing-identity");
    assert_eq!(upstream.total(), 0, "nothing was forwarded");
    // Counted, as every request is, under their own outcome.
    let metrics = client
        .send(Method::GET, &proxy.admin_url("/metrics"), &[], "")
        .await;
    let text = String::from_utf8_lossy(&metrics.body);
    let line = r#"idemproxy_requests_total{route="payments",outcome="unauthenticated"} 4"#;
    assert!(text.lines().any(|l| l == line), "{text}");
}

#[tokio::test]
async fn a_jwt_scope_without_a_key_set_or_a_bad_key_set_is_a_configuration_error() {
    let mut c = config("http://127.0.0.1:9");
    c.idempotency.scope = vec!["jwt:sub".into()];
    let err = idemproxy::validate(&c).expect_err("no key set").to_string();
    assert!(
        err.contains("idempotency.scope") && err.contains("jwks_file"),
        "{err}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("jwks.json");
    std::fs::write(&file, r#"{"keys": []}"#).expect("write");
    c.identity.jwks_file = Some(file);
    let err = idemproxy::validate(&c)
        .expect_err("empty key set")
        .to_string();
    assert!(err.contains("identity.jwks_file"), "{err}");
}

/// The admin lookup names the caller as requests do: a refreshed token of
/// the same caller finds the record, a token that does not verify is
/// refused by name.
#[tokio::test]
async fn the_admin_lookup_is_scoped_by_the_verified_caller() {
    let signer = Signer::es256("k1");
    let (_upstream, proxy, _dir) = proxy_with_identity(&[&signer]).await;
    let client = TestClient::new();
    let auth = format!("Bearer {}", signer.token(claims("alice", 1)));
    let done = client
        .send(
            Method::POST,
            &proxy.url("/v1/payments"),
            &[
                ("authorization", &auth),
                ("idempotency-key", "look-1"),
                JSON,
            ],
            "{}",
        )
        .await;
    assert_eq!(done.status, 201, "{done:?}");
    let lookup = |token: String| {
        let body = json!({
            "key": "look-1",
            "route": "payments",
            "headers": {"authorization": format!("Bearer {token}")},
        });
        let (client, url) = (&client, proxy.admin_url("/v1/keys/lookup"));
        async move {
            let admin = format!("Bearer {ADMIN_TOKEN}");
            client
                .send(
                    Method::POST,
                    &url,
                    &[("authorization", &admin), JSON],
                    body.to_string(),
                )
                .await
        }
    };
    let found = lookup(signer.token(claims("alice", 2))).await;
    assert_eq!(found.status, 200, "{found:?}");
    assert_eq!(found.json()["state"], "completed", "{found:?}");
    let forged = lookup(Signer::es256("k1").token(claims("alice", 3))).await;
    forged.assert_problem(400, "invalid-lookup");
    assert!(
        forged.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("does not verify")),
        "{forged:?}"
    );
}

/// The proxy in front of a counting upstream, scoping `/v1/shared` by
/// `jwt:sub` and `/v1/tenant` by `jwt:tenant`, with the shared anonymous
/// scope (the default).
async fn proxy_sharing_anonymous(signer: &Signer) -> (TestUpstream, TestProxy, tempfile::TempDir) {
    let upstream = TestUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let jwks_file = dir.path().join("jwks.json");
    std::fs::write(&jwks_file, jwks(&[signer])).expect("write the key set");
    let mut c = config(&upstream.url());
    c.identity.jwks_file = Some(jwks_file);
    c.identity.issuer = Some(ISSUER.into());
    c.identity.audience = Some(AUDIENCE.into());
    c.routes = vec![
        RouteConfig {
            name: "shared".into(),
            path: "/v1/shared".into(),
            idempotency: IdempotencySettings {
                scope: vec!["jwt:sub".into()],
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
        RouteConfig {
            name: "tenant".into(),
            path: "/v1/tenant".into(),
            idempotency: IdempotencySettings {
                scope: vec!["jwt:tenant".into()],
                ..c.idempotency.clone()
            },
            ..Default::default()
        },
    ];
    let proxy = TestProxy::start(c).await;
    (upstream, proxy, dir)
}

async fn post_as(
    client: &TestClient,
    url: &str,
    token: Option<String>,
    key: &str,
) -> support::proxy::Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("idempotency-key", key), JSON];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth));
    }
    client.send(Method::POST, url, &headers, "{}").await
}

/// A verified token that lacks the claim the scope is made of names no
/// caller: put in the anonymous scope, its stored answer would replay to
/// any request that sends no token at all.
#[tokio::test]
async fn a_verified_token_without_the_scope_claim_is_refused_not_made_anonymous() {
    let signer = Signer::es256("k1");
    let (upstream, proxy, _dir) = proxy_sharing_anonymous(&signer).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/shared");

    let mut no_sub = claims("alice", 1);
    no_sub.as_object_mut().expect("object").remove("sub");
    let refused = post_as(&client, &url, Some(signer.token(no_sub)), "k").await;
    refused.assert_problem(401, "invalid-token");
    let detail = refused.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(detail.contains("token has no `sub`"), "{detail}");
    // Nothing was stored for the anonymous caller to find.
    let anonymous = post_as(&client, &url, None, "k").await;
    assert_eq!(anonymous.status, 201, "{anonymous:?}");
    assert!(!anonymous.replayed(), "{anonymous:?}");
    assert_eq!(upstream.executions("/v1/shared"), 1);

    // A claim that cannot name a caller is no better than none. (For
    // `sub`, jsonwebtoken already refuses a non-string; a claim of the
    // token's own, such as `tenant`, is the proxy's to refuse.)
    let tenant_url = proxy.url("/v1/tenant");
    for (i, bad) in [json!({"id": 1}), json!(null), json!(["acme"]), json!(true)]
        .into_iter()
        .enumerate()
    {
        let mut c = claims("alice", 10 + i as u32);
        c["sub"] = bad.clone();
        let reply = post_as(&client, &url, Some(signer.token(c.clone())), "k").await;
        reply.assert_problem(401, "invalid-token");
        c["sub"] = json!("alice");
        c["tenant"] = bad.clone();
        let reply = post_as(&client, &tenant_url, Some(signer.token(c)), "k").await;
        reply.assert_problem(401, "invalid-token");
        let detail = reply.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(detail.contains("`tenant`"), "{bad}: {detail}");
    }
    let mut no_tenant = claims("alice", 19);
    no_tenant.as_object_mut().expect("object").remove("tenant");
    post_as(&client, &tenant_url, Some(signer.token(no_tenant)), "k")
        .await
        .assert_problem(401, "invalid-token");
    assert_eq!(upstream.executions("/v1/shared"), 1);
    assert_eq!(upstream.executions("/v1/tenant"), 0);
    // A number names a caller as well as a string does.
    let mut numbered = claims("alice", 20);
    numbered["sub"] = json!(42);
    let first = post_as(&client, &url, Some(signer.token(numbered.clone())), "n").await;
    assert_eq!(first.status, 201, "{first:?}");
    numbered["jti"] = json!(21);
    assert!(post_as(&client, &url, Some(signer.token(numbered)), "n")
        .await
        .replayed());
}

/// A configured issuer or audience is required in the token: jsonwebtoken
/// checks only a claim that is there and parses, so an absent or odd
/// `iss`/`aud` passed.
#[tokio::test]
async fn a_configured_issuer_and_audience_are_required_as_strings() {
    let signer = Signer::es256("k1");
    let (upstream, proxy, _dir) = proxy_with_identity(&[&signer]).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/payments");
    let with = |jti: u32, claim: &str, value: Option<serde_json::Value>| {
        let mut c = claims("alice", jti);
        match value {
            Some(v) => c[claim] = v,
            None => {
                c.as_object_mut().expect("object").remove(claim);
            }
        }
        signer.token(c)
    };
    let cases = [
        ("absent iss", with(1, "iss", None), false),
        ("numeric iss", with(2, "iss", Some(json!(5))), false),
        (
            "iss as an array",
            with(3, "iss", Some(json!([ISSUER]))),
            false,
        ),
        ("absent aud", with(4, "aud", None), false),
        ("numeric aud", with(5, "aud", Some(json!(5))), false),
        (
            "aud array without the audience",
            with(6, "aud", Some(json!(["mail", "billing"]))),
            false,
        ),
        (
            "aud array with a non-string",
            with(7, "aud", Some(json!([AUDIENCE, 5]))),
            false,
        ),
        ("null aud", with(8, "aud", Some(json!(null))), false),
        (
            "aud array holding the audience",
            with(9, "aud", Some(json!(["mail", AUDIENCE]))),
            true,
        ),
        ("aud string", with(10, "aud", Some(json!(AUDIENCE))), true),
    ];
    let mut accepted = 0;
    for (i, (what, token, ok)) in cases.into_iter().enumerate() {
        let key = format!("iss-aud-{i}");
        let reply = post_as(&client, &url, Some(token), &key).await;
        if ok {
            assert_eq!(reply.status, 201, "{what}: {reply:?}");
            accepted += 1;
        } else {
            assert_eq!(reply.status, 401, "{what}: {reply:?}");
            assert_eq!(reply.problem(), "invalid-token", "{what}");
        }
        assert_eq!(upstream.executions("/v1/payments"), accepted, "{what}");
    }
}
