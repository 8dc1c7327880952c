//! Who calls, from a verified bearer token: the `jwt:<claim>` scope
//! attribute.
//!
//! Scoping by the raw `Authorization` header splits a caller's keys every
//! time its token is refreshed, and agents and SDKs refresh OAuth tokens
//! between a lost response and the retry: the retry then lands in a new
//! scope and executes again. A claim of a verified token (`sub`, a tenant
//! id) names the caller across refreshes. Tokens are verified against a
//! JWKS file (RS256, ES256, EdDSA; the key by `kid`), with `exp` required
//! and `nbf`, `iss` and `aud` checked as configured: a token that does not
//! verify cannot choose a scope.

use std::sync::Arc;
use std::time::Duration;

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};

/// The algorithms a token may be signed with. Symmetric ones (HS*) are
/// refused: a key the proxy could verify with, it could forge with.
const ALGORITHMS: [Algorithm; 3] = [Algorithm::RS256, Algorithm::ES256, Algorithm::EdDSA];

/// What a token must be to name its caller.
#[derive(Clone, Debug, Default)]
pub struct IdentitySettings {
    /// The JWKS document (`{"keys": [...]}`), as read from `jwks_file`.
    pub jwks: String,
    /// Required `iss`, if set.
    pub issuer: Option<String>,
    /// Required among `aud`, if set.
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Duration,
}

/// Verifies bearer tokens against a key set. Shared by every route.
#[derive(Clone)]
pub struct TokenVerifier {
    keys: Arc<[VerifyingKey]>,
    issuer: Option<Arc<str>>,
    audience: Option<Arc<str>>,
}

struct VerifyingKey {
    kid: Option<String>,
    algorithm: Algorithm,
    key: DecodingKey,
    /// What a token signed with this key must satisfy: built once, not per
    /// request (it holds the issuer and audience sets).
    validation: Validation,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier")
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl TokenVerifier {
    /// The verifier for `settings`; refuses a key set with no usable key
    /// or a key it cannot read, naming it.
    pub fn new(settings: &IdentitySettings) -> Result<Self, String> {
        let set: JwkSet = serde_json::from_str(&settings.jwks)
            .map_err(|e| format!("not a JWKS document ({{\"keys\": [...]}}): {e}"))?;
        let keys = set
            .keys
            .iter()
            .enumerate()
            .map(|(i, jwk)| verifying_key(jwk, settings).map_err(|why| format!("key {i}: {why}")))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err("the key set holds no key".into());
        }
        Ok(Self {
            keys: keys.into(),
            issuer: settings.issuer.as_deref().map(Arc::from),
            audience: settings.audience.as_deref().map(Arc::from),
        })
    }

    /// The claims of `token` once its signature, algorithm, expiry and the
    /// configured issuer and audience check out; why not, otherwise.
    pub fn verify(&self, token: &str) -> Result<Map<String, Value>, String> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| e.to_string())?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err(format!("algorithm {:?} is not accepted", header.alg));
        }
        let key = self
            .keys
            .iter()
            .filter(|k| k.algorithm == header.alg)
            .find(|k| header.kid.is_none() || k.kid == header.kid)
            .ok_or("no key of the key set matches the token's kid and algorithm")?;
        let claims = jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &key.validation)
            .map(|data| data.claims)
            .map_err(|e| e.to_string())?;
        self.check_issuer_and_audience(&claims)?;
        Ok(claims)
    }

    /// jsonwebtoken checks `iss` and `aud` only when they parse as it
    /// expects (and takes an array for `iss`): an `iss` of `5` or an `aud`
    /// of `["payments", 5]` would pass unchecked. A configured issuer must
    /// be the token's `iss` string; a configured audience its `aud` string
    /// or one of an array of strings.
    fn check_issuer_and_audience(&self, claims: &Map<String, Value>) -> Result<(), String> {
        if let Some(issuer) = &self.issuer {
            match claims.get("iss") {
                Some(Value::String(iss)) if iss == issuer.as_ref() => {}
                Some(Value::String(_)) => return Err("the token's `iss` is another issuer".into()),
                None => return Err("token has no `iss`".into()),
                Some(_) => return Err("the token's `iss` is not a string".into()),
            }
        }
        if let Some(audience) = &self.audience {
            let names_audience = match claims.get("aud") {
                None => return Err("token has no `aud`".into()),
                Some(Value::String(aud)) => aud == audience.as_ref(),
                Some(Value::Array(auds)) if auds.iter().all(Value::is_string) => {
                    auds.iter().any(|aud| aud.as_str() == Some(audience))
                }
                Some(_) => {
                    return Err("the token's `aud` is not a string or an array of strings".into())
                }
            };
            if !names_audience {
                return Err("the token's `aud` does not name this audience".into());
            }
        }
        Ok(())
    }
}

/// One JWK as a verifying key, for an accepted algorithm only.
fn verifying_key(jwk: &Jwk, settings: &IdentitySettings) -> Result<VerifyingKey, String> {
    let key = DecodingKey::from_jwk(jwk).map_err(|e| e.to_string())?;
    let declared = jwk
        .common
        .key_algorithm
        .map(|a| {
            a.to_string()
                .parse::<Algorithm>()
                .map_err(|_| format!("algorithm {a} is not accepted (RS256, ES256, EdDSA)"))
        })
        .transpose()?;
    let algorithm = match (&jwk.algorithm, declared) {
        (_, Some(alg)) => alg,
        (jsonwebtoken::jwk::AlgorithmParameters::RSA(_), None) => Algorithm::RS256,
        (jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_), None) => Algorithm::ES256,
        (jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_), None) => Algorithm::EdDSA,
        (jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_), None) => {
            return Err("symmetric keys are not accepted".into())
        }
    };
    if !ALGORITHMS.contains(&algorithm) {
        return Err(format!(
            "algorithm {algorithm:?} is not accepted (RS256, ES256, EdDSA)"
        ));
    }
    Ok(VerifyingKey {
        kid: jwk.common.key_id.clone(),
        algorithm,
        key,
        validation: validation(algorithm, settings),
    })
}

/// The checks of a token signed with `algorithm`: `exp` (required), `nbf`,
/// and the issuer and audience when they are set.
fn validation(algorithm: Algorithm, settings: &IdentitySettings) -> Validation {
    let mut validation = Validation::new(algorithm);
    validation.leeway = settings.leeway.as_secs();
    validation.validate_nbf = true;
    let mut required = vec!["exp"];
    required.extend(settings.issuer.as_ref().map(|_| "iss"));
    required.extend(settings.audience.as_ref().map(|_| "aud"));
    validation.set_required_spec_claims(&required);
    match &settings.audience {
        Some(audience) => validation.set_audience(&[audience]),
        None => validation.validate_aud = false,
    }
    if let Some(issuer) = &settings.issuer {
        validation.set_issuer(&[issuer]);
    }
    validation
}

/// The bearer token of an `Authorization` header value, if it is one.
pub fn bearer(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    let (scheme, token) = value.split_once(' ')?;
    // Auth schemes are case-insensitive (RFC 9110 §11.1).
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}
