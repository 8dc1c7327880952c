//! Signed bearer tokens and the JWKS that verifies them, from keys made
//! for the test (ES256 and EdDSA, by rcgen) or kept for it (RS256, in
//! `tests/fixtures`: rcgen makes no RSA keys).

#![allow(unreachable_pub)]

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

/// One signing key and its public JWK.
pub struct Signer {
    kid: String,
    algorithm: Algorithm,
    key: EncodingKey,
    jwk: Value,
}

impl Signer {
    pub fn es256(kid: &str) -> Self {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
        // Uncompressed point: 0x04, then x and y.
        let point = pair.public_key_raw();
        let jwk = json!({
            "kty": "EC", "crv": "P-256", "kid": kid, "alg": "ES256", "use": "sig",
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..65]),
        });
        Self {
            kid: kid.into(),
            algorithm: Algorithm::ES256,
            key: EncodingKey::from_ec_der(&pair.serialize_der()),
            jwk,
        }
    }

    pub fn eddsa(kid: &str) -> Self {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
        let jwk = json!({
            "kty": "OKP", "crv": "Ed25519", "kid": kid, "alg": "EdDSA", "use": "sig",
            "x": URL_SAFE_NO_PAD.encode(pair.public_key_raw()),
        });
        Self {
            kid: kid.into(),
            algorithm: Algorithm::EdDSA,
            key: EncodingKey::from_ed_der(&pair.serialize_der()),
            jwk,
        }
    }

    /// The test RSA key `fixture` (`rsa-a` or `rsa-b` in `tests/fixtures`).
    pub fn rs256(kid: &str, fixture: &str) -> Self {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let pem = std::fs::read(dir.join(format!("{fixture}.pem"))).expect("RSA test key");
        let jwk =
            std::fs::read_to_string(dir.join(format!("{fixture}.jwk.json"))).expect("RSA test JWK");
        let mut jwk: Value = serde_json::from_str(&jwk).expect("JWK is JSON");
        jwk["kid"] = kid.into();
        jwk["alg"] = "RS256".into();
        jwk["use"] = "sig".into();
        Self {
            kid: kid.into(),
            algorithm: Algorithm::RS256,
            key: EncodingKey::from_rsa_der(rsa_der(&pem).secret_der()),
            jwk,
        }
    }

    /// A token with `claims`, signed with this key and naming it by `kid`.
    pub fn token(&self, claims: Value) -> String {
        let mut header = Header::new(self.algorithm);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, &claims, &self.key).expect("sign")
    }
}

/// The PKCS#1 key in `pem`.
fn rsa_der(pem: &[u8]) -> rustls_pki_types::PrivateKeyDer<'static> {
    use rustls_pki_types::pem::PemObject;
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(pem).expect("a PEM private key");
    assert!(
        matches!(key, rustls_pki_types::PrivateKeyDer::Pkcs1(_)),
        "the RSA test keys are PKCS#1"
    );
    key
}

/// The JWKS document of `signers`.
pub fn jwks(signers: &[&Signer]) -> String {
    json!({ "keys": signers.iter().map(|s| s.jwk.clone()).collect::<Vec<_>>() }).to_string()
}

/// Seconds since the Unix epoch, `offset` from now.
pub fn at(offset: i64) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs() as i64;
    now + offset
}
