//! Bearer tokens (crates/idemproxy-core/src/request/identity.rs): `bearer`
//! and `TokenVerifier::verify` never panic on any input, and nothing verifies
//! that the key set's owners did not sign.
//!
//! The verifier holds the key set of `fixtures/jwt.json`: an Ed25519, a
//! P-256 and an RSA public key (RSA: tests/fixtures/rsa-a), issuer and
//! audience required. The fixture's tokens were signed once with those
//! keys; the private halves of the Ed25519 and P-256 keys were discarded.
//! So the only messages (`header.payload`) that can verify are those of the
//! fixture's signed tokens: a token the fuzzer makes verifies only if its
//! signing input is one of them, and then with that token's claims.
//! Anything else, garbage or a mutated token, must be an `Err`.
//!
//! At start-up the harness checks itself: the `valid` tokens verify, the
//! `refused` ones (expired, not yet valid, wrong issuer or audience, no
//! `exp`, unknown `kid`) do not. The `unchecked` one carries a `crit`
//! header, which RFC 7515 §4.1.11 says to reject when not understood and
//! jsonwebtoken 9 ignores; its outcome is not asserted.

#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use idemproxy_core::request::identity::{bearer, IdentitySettings, TokenVerifier};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};

struct Harness {
    verifier: TokenVerifier,
    /// Signing input (`header.payload`) of every token signed with the
    /// key set -> the claims `verify` returned for it at start-up (`None`:
    /// it did not verify, and a token with that signing input never may).
    signed: HashMap<String, Option<Map<String, Value>>>,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let fixture: Value =
            serde_json::from_str(include_str!("../fixtures/jwt.json")).expect("fixture is JSON");
        let text = |name: &str| fixture[name].as_str().map(str::to_owned);
        let verifier = TokenVerifier::new(&IdentitySettings {
            jwks: fixture["jwks"].to_string(),
            issuer: text("issuer"),
            audience: text("audience"),
            leeway: Duration::from_secs(60),
        })
        .expect("the fixture's key set is usable");
        let tokens = |name: &str| -> Vec<String> {
            fixture[name]
                .as_array()
                .expect("a list of tokens")
                .iter()
                .map(|t| t.as_str().expect("a token").to_owned())
                .collect()
        };
        let mut signed = HashMap::new();
        for token in tokens("valid") {
            let claims = verifier
                .verify(&token)
                .unwrap_or_else(|e| panic!("fixture token does not verify ({e}): {token}"));
            signed.insert(signing_input(&token).to_owned(), Some(claims));
        }
        for token in tokens("refused") {
            assert!(
                verifier.verify(&token).is_err(),
                "fixture token verifies: {token}"
            );
            signed.insert(signing_input(&token).to_owned(), None);
        }
        for token in tokens("unchecked") {
            signed.insert(
                signing_input(&token).to_owned(),
                verifier.verify(&token).ok(),
            );
        }
        for token in tokens("unsigned") {
            assert!(
                verifier.verify(&token).is_err(),
                "unsigned token verifies: {token}"
            );
        }
        Harness { verifier, signed }
    })
}

/// What a JWS signature covers: everything before the last `.`.
fn signing_input(token: &str) -> &str {
    token.rsplit_once('.').map_or(token, |(input, _)| input)
}

fn check_verify(h: &Harness, token: &str) {
    match h.verifier.verify(token) {
        Ok(claims) => match h.signed.get(signing_input(token)) {
            Some(Some(expected)) => assert_eq!(&claims, expected, "other claims for {token}"),
            Some(None) => panic!("a token refused at start-up verifies: {token}"),
            None => panic!("a token the key set's owners never signed verifies: {token}"),
        },
        Err(why) => assert!(!why.is_empty(), "an empty reason for {token}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let h = harness();
    // The `Authorization` value as sent.
    if let Some(token) = bearer(data) {
        let text = std::str::from_utf8(data).expect("a bearer token is UTF-8");
        let (scheme, rest) = text.split_once(' ').expect("scheme, space, token");
        assert!(scheme.eq_ignore_ascii_case("bearer"), "scheme {scheme:?}");
        assert_eq!(token, rest.trim());
        assert!(!token.is_empty());
        check_verify(h, token);
    }
    // And the input as a token itself.
    if let Ok(token) = std::str::from_utf8(data) {
        check_verify(h, token);
    }
});
