//! Key namespaces (tenants).
//!
//! The same key sent by two callers must name two records, or one caller
//! could read (or block) another's response just by guessing a key. The
//! scope is a digest of the request attributes that identify the caller,
//! by default the `Authorization` header. Only the digest leaves this
//! module: it is combined with the key into the store identity
//! (`RecordKey`), so credentials are never stored, logged or compared in
//! the clear.
//!
//! Header values are hashed as received, byte for byte: `Bearer x` and
//! `bearer x` are different scopes. A spurious split is not harmless: a
//! retry that lands in another scope executes again. So the scope must
//! name *who calls*, not the credential it calls with: a bearer token is
//! refreshed between a lost response and the retry, and
//! `header:authorization` then splits one caller's keys. `jwt:<claim>`
//! (see [`identity`](super::identity)) names the caller by a claim of its
//! verified token, the same across refreshes; `client_cert` by the client
//! certificate the TLS handshake verified (a renewed certificate is a new
//! caller, so renew between retries, not during them).

use std::fmt;
use std::str::FromStr;
use std::sync::LazyLock;

use http::request::Parts;
use http::HeaderName;
use sha2::{Digest, Sha256};

use super::identity::{bearer, TokenVerifier};
use crate::core::ClientCertificate;

/// Bumping this moves every key to a new namespace (all stored records
/// become unreachable); do it only with the record format.
const DOMAIN: &[u8] = b"idemproxy.scope.v1\0";

static ANONYMOUS: LazyLock<[u8; 32]> = LazyLock::new(|| {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    h.update(b"anonymous");
    h.finalize().into()
});

/// The scope shared by every request that carries none of the configured
/// attributes. Keys there are only as private as they are unguessable.
pub fn anonymous_scope() -> [u8; 32] {
    *ANONYMOUS
}

const HEADER_PREFIX: &str = "header:";
const JWT_PREFIX: &str = "jwt:";
const CLIENT_CERT: &str = "client_cert";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScopeAttribute {
    /// A request header's values, as sent.
    Header(HeaderName),
    /// A claim of the verified bearer token (`Authorization: Bearer`).
    Jwt(String),
    /// The client certificate the connection's TLS handshake verified
    /// (`[tls] client_ca_file`), by its SHA-256.
    ClientCert,
}

/// Accepts `header:<name>` (the prefix is case-insensitive, the name is
/// lower-cased), `jwt:<claim>` (the claim as named in the token) and
/// `client_cert`, the forms used in the `scope` configuration list.
impl FromStr for ScopeAttribute {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case(CLIENT_CERT) {
            return Ok(ScopeAttribute::ClientCert);
        }
        if let Some(claim) = s
            .get(..JWT_PREFIX.len())
            .filter(|p| p.eq_ignore_ascii_case(JWT_PREFIX))
            .and_then(|_| s.get(JWT_PREFIX.len()..))
        {
            if claim.is_empty() || claim.contains(char::is_whitespace) {
                return Err(format!(
                    "`{s}` names no claim; expected `jwt:<claim>`, e.g. `jwt:sub`"
                ));
            }
            return Ok(ScopeAttribute::Jwt(claim.to_owned()));
        }
        let prefix = s.get(..HEADER_PREFIX.len());
        match prefix {
            Some(p) if p.eq_ignore_ascii_case(HEADER_PREFIX) => {
                let name = s.get(HEADER_PREFIX.len()..).unwrap_or_default();
                if name.is_empty() {
                    return Err(format!(
                        "`{s}` names no header; expected `header:<name>`, e.g. `header:authorization`"
                    ));
                }
                HeaderName::from_bytes(name.as_bytes())
                    .map(ScopeAttribute::Header)
                    .map_err(|_| {
                        format!(
                            "`{s}`: `{name}` is not a valid header name; expected \
                             `header:<name>`, e.g. `header:authorization`"
                        )
                    })
            }
            _ => Err(format!(
                "`{s}` is not a scope attribute; the accepted forms are `jwt:<claim>` \
                 (e.g. `jwt:sub`), `client_cert` and `header:<name>` (e.g. `header:x-tenant-id`)"
            )),
        }
    }
}

/// The configuration form, so `idemproxy check` can print it back.
impl fmt::Display for ScopeAttribute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScopeAttribute::Header(name) => write!(f, "{HEADER_PREFIX}{name}"),
            ScopeAttribute::Jwt(claim) => write!(f, "{JWT_PREFIX}{claim}"),
            ScopeAttribute::ClientCert => f.write_str(CLIENT_CERT),
        }
    }
}

/// What a request without any identity gets (`anonymous`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Anonymous {
    /// The shared anonymous scope: keys there are only as private as they
    /// are unguessable.
    #[default]
    Shared,
    /// 401 `missing-identity`: every covered request must say who calls.
    Reject,
}

/// Why a request has no scope to run under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScopeError {
    /// A bearer token that does not verify (401 `invalid-token`).
    InvalidToken(String),
    /// None of the attributes is present and `anonymous = "reject"`
    /// (401 `missing-identity`).
    MissingIdentity,
}

impl fmt::Display for ScopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScopeError::InvalidToken(why) => write!(f, "the bearer token does not verify: {why}"),
            ScopeError::MissingIdentity => f.write_str("no caller identity"),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ScopeRules {
    pub attributes: Vec<ScopeAttribute>,
    /// Verifies tokens for `jwt:` attributes; set when one is configured.
    pub verifier: Option<TokenVerifier>,
    pub anonymous: Anonymous,
}

impl ScopeRules {
    pub fn new(attributes: Vec<ScopeAttribute>) -> Self {
        Self {
            attributes,
            verifier: None,
            anonymous: Anonymous::Shared,
        }
    }

    /// Tokens for `jwt:` attributes are verified by `verifier`.
    pub fn verifier(mut self, verifier: TokenVerifier) -> Self {
        self.verifier = Some(verifier);
        self
    }

    /// What a request without any identity gets.
    pub fn anonymous(mut self, anonymous: Anonymous) -> Self {
        self.anonymous = anonymous;
        self
    }

    /// Parses a `scope` list, naming the first bad entry: for tests and
    /// tools (the composition root parses the configuration entry by entry,
    /// to report every bad one).
    pub fn parse(attrs: &[String]) -> Result<Self, String> {
        let attributes = attrs
            .iter()
            .map(|s| s.parse())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(attributes))
    }

    /// The namespace of the request: SHA-256 over a version tag and, per
    /// configured attribute in order, its kind, name and values (each
    /// value length-prefixed, the list terminated, so an absent header and
    /// an empty one differ). Order matters: `[a, b]` and `[b, a]` are
    /// different namespaces, which is deterministic for a given config.
    ///
    /// When no attribute is present the request has no identity to scope
    /// by: it lands in [`anonymous_scope`] regardless of configuration, so
    /// anonymous callers of differently configured routes still agree, or
    /// is refused under `anonymous = "reject"`. A bearer token that a
    /// `jwt:` attribute needs and that does not verify is refused.
    pub fn scope(&self, parts: &Parts) -> Result<[u8; 32], ScopeError> {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        let mut any_present = false;
        // Verified once, whatever the number of `jwt:` attributes.
        let mut claims = None;
        for attr in &self.attributes {
            match attr {
                ScopeAttribute::Header(name) => {
                    h.update(b"H");
                    put_field(&mut h, name.as_str().as_bytes());
                    for value in parts.headers.get_all(name) {
                        any_present = true;
                        h.update([1]);
                        put_field(&mut h, value.as_bytes());
                    }
                    h.update([0]);
                }
                ScopeAttribute::Jwt(claim) => {
                    h.update(b"J");
                    put_field(&mut h, claim.as_bytes());
                    if claims.is_none() {
                        claims = Some(self.verified_claims(parts)?);
                    }
                    // A request without a token names no caller by it; one
                    // with a verified token must name one, or its stored
                    // answers would sit in the anonymous scope for anyone.
                    if let Some(Some(verified)) = &claims {
                        any_present = true;
                        h.update([1]);
                        match verified.get(claim) {
                            Some(serde_json::Value::String(s)) => put_field(&mut h, s.as_bytes()),
                            Some(n @ serde_json::Value::Number(_)) => {
                                put_field(&mut h, n.to_string().as_bytes())
                            }
                            None | Some(serde_json::Value::Null) => {
                                return Err(ScopeError::InvalidToken(format!(
                                    "token has no `{claim}`"
                                )))
                            }
                            Some(_) => {
                                return Err(ScopeError::InvalidToken(format!(
                                    "the token's `{claim}` is not a string or a number, so it \
                                     names no caller"
                                )))
                            }
                        }
                    }
                    h.update([0]);
                }
                ScopeAttribute::ClientCert => {
                    h.update(b"C");
                    if let Some(certificate) = parts.extensions.get::<ClientCertificate>() {
                        any_present = true;
                        h.update([1]);
                        put_field(&mut h, &certificate.0);
                    }
                    h.update([0]);
                }
            }
        }
        match (any_present, self.anonymous) {
            (true, _) => Ok(h.finalize().into()),
            (false, Anonymous::Shared) => Ok(anonymous_scope()),
            (false, Anonymous::Reject) => Err(ScopeError::MissingIdentity),
        }
    }

    /// The claims of the request's bearer token; `None` without one.
    fn verified_claims(
        &self,
        parts: &Parts,
    ) -> Result<Option<serde_json::Map<String, serde_json::Value>>, ScopeError> {
        let Some(header) = parts.headers.get(http::header::AUTHORIZATION) else {
            return Ok(None);
        };
        let token = bearer(header.as_bytes())
            .ok_or_else(|| ScopeError::InvalidToken("not a bearer token".into()))?;
        let verifier = self
            .verifier
            .as_ref()
            .ok_or_else(|| ScopeError::InvalidToken("no key set to verify it with".into()))?;
        verifier
            .verify(token)
            .map(Some)
            .map_err(ScopeError::InvalidToken)
    }
}

fn put_field(h: &mut Sha256, bytes: &[u8]) {
    // usize is at most 64 bits on every supported target.
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;
    use proptest::prelude::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::builder().method("POST").uri("/v1/payments");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("valid request").into_parts().0
    }

    fn rules(attrs: &[&str]) -> ScopeRules {
        let attrs: Vec<String> = attrs.iter().map(|s| s.to_string()).collect();
        ScopeRules::parse(&attrs).expect("valid attributes")
    }

    fn default_rules() -> ScopeRules {
        rules(&["header:authorization"])
    }

    #[test]
    fn parses_header_attributes() {
        assert_eq!(
            "header:authorization".parse::<ScopeAttribute>(),
            Ok(ScopeAttribute::Header(HeaderName::from_static(
                "authorization"
            )))
        );
        assert_eq!(
            "Header:X-Tenant-Id".parse::<ScopeAttribute>(),
            Ok(ScopeAttribute::Header(HeaderName::from_static(
                "x-tenant-id"
            )))
        );
    }

    #[test]
    fn display_round_trips() {
        let attr: ScopeAttribute = "header:X-Tenant".parse().expect("valid");
        assert_eq!(attr.to_string(), "header:x-tenant");
        assert_eq!(attr.to_string().parse::<ScopeAttribute>(), Ok(attr));
    }

    #[test]
    fn rejects_bad_attributes_naming_them() {
        for bad in [
            "",
            "authorization",
            "cookie:session",
            "header",
            "header:",
            "header:bad name",
            "header:x\u{e9}",
            " header:authorization",
            "héader:x",
        ] {
            let err = bad.parse::<ScopeAttribute>().expect_err(bad);
            assert!(err.contains(&format!("`{bad}`")), "{err}");
            assert!(err.contains("header:<name>"), "{err}");
        }
    }

    #[test]
    fn new_reports_first_bad_entry() {
        let err = ScopeRules::parse(&["header:a".into(), "nope".into()]).expect_err("rejected");
        assert!(err.contains("`nope`"), "{err}");
        let ok = ScopeRules::parse(&["header:A".into(), "header:b".into()]).expect("valid");
        assert_eq!(
            ok.attributes,
            vec![
                ScopeAttribute::Header(HeaderName::from_static("a")),
                ScopeAttribute::Header(HeaderName::from_static("b")),
            ]
        );
    }

    #[test]
    fn different_authorization_different_scope() {
        let r = default_rules();
        assert_ne!(
            r.scope(&parts(&[("authorization", "Bearer alice")]))
                .expect("scope"),
            r.scope(&parts(&[("authorization", "Bearer bob")]))
                .expect("scope")
        );
        // Byte for byte: no scheme normalization.
        assert_ne!(
            r.scope(&parts(&[("authorization", "Bearer alice")]))
                .expect("scope"),
            r.scope(&parts(&[("authorization", "bearer alice")]))
                .expect("scope")
        );
    }

    #[test]
    fn same_authorization_same_scope() {
        let r = default_rules();
        let a = r
            .scope(&parts(&[
                ("authorization", "Bearer alice"),
                ("x-other", "1"),
            ]))
            .expect("scope");
        let b = r
            .scope(&parts(&[
                ("authorization", "Bearer alice"),
                ("x-other", "2"),
            ]))
            .expect("scope");
        assert_eq!(a, b);
        // And it is stable across rule instances (replicas, restarts).
        assert_eq!(
            a,
            default_rules()
                .scope(&parts(&[("authorization", "Bearer alice")]))
                .expect("scope")
        );
    }

    #[test]
    fn absent_is_the_anonymous_scope() {
        let r = default_rules();
        let a = r.scope(&parts(&[])).expect("scope");
        let b = r.scope(&parts(&[("x-other", "1")])).expect("scope");
        assert_eq!(a, anonymous_scope());
        assert_eq!(a, b);
        assert_eq!(
            ScopeRules::default()
                .scope(&parts(&[("authorization", "x")]))
                .expect("scope"),
            a
        );
        assert_eq!(
            rules(&["header:x-a", "header:x-b"])
                .scope(&parts(&[]))
                .expect("scope"),
            a
        );
    }

    #[test]
    fn empty_credential_is_not_anonymous() {
        let r = default_rules();
        assert_ne!(
            r.scope(&parts(&[("authorization", "")])).expect("scope"),
            anonymous_scope()
        );
    }

    #[test]
    fn scope_does_not_contain_the_credential() {
        let r = default_rules();
        let secret = "Bearer sk_live_0123456789abcdef";
        let scope = r
            .scope(&parts(&[("authorization", secret)]))
            .expect("scope");
        assert_ne!(&scope[..], secret.as_bytes().get(..32).unwrap_or_default());
        assert!(!hex::encode(scope).contains("0123456789abcdef"));
    }

    #[test]
    fn attribute_order_matters_deterministically() {
        let p = parts(&[("x-a", "1"), ("x-b", "2")]);
        let ab = rules(&["header:x-a", "header:x-b"]);
        let ba = rules(&["header:x-b", "header:x-a"]);
        assert_ne!(ab.scope(&p), ba.scope(&p));
        assert_eq!(ab.scope(&p), ab.scope(&p));
        assert_eq!(ba.scope(&p), rules(&["header:x-b", "header:x-a"]).scope(&p));
    }

    #[test]
    fn attributes_are_framed() {
        // Values cannot slide between attributes.
        let r = rules(&["header:x-a", "header:x-b"]);
        assert_ne!(
            r.scope(&parts(&[("x-a", "12")])).expect("scope"),
            r.scope(&parts(&[("x-a", "1"), ("x-b", "2")]))
                .expect("scope")
        );
        assert_ne!(
            r.scope(&parts(&[("x-a", "1")])).expect("scope"),
            r.scope(&parts(&[("x-b", "1")])).expect("scope")
        );
        // Multiple values: all count, in order.
        let one = rules(&["header:x-a"]);
        assert_ne!(
            one.scope(&parts(&[("x-a", "1"), ("x-a", "2")]))
                .expect("scope"),
            one.scope(&parts(&[("x-a", "2"), ("x-a", "1")]))
                .expect("scope")
        );
        assert_ne!(
            one.scope(&parts(&[("x-a", "1"), ("x-a", "2")]))
                .expect("scope"),
            one.scope(&parts(&[("x-a", "12")])).expect("scope")
        );
    }

    #[test]
    fn partially_present_is_not_anonymous() {
        let r = rules(&["header:authorization", "header:x-tenant"]);
        let only_tenant = r.scope(&parts(&[("x-tenant", "t1")])).expect("scope");
        assert_ne!(only_tenant, anonymous_scope());
        assert_ne!(
            only_tenant,
            r.scope(&parts(&[("x-tenant", "t2")])).expect("scope")
        );
    }

    #[test]
    fn client_cert_scopes_by_the_verified_certificate_alone() {
        assert_eq!(
            "Client_Cert".parse::<ScopeAttribute>(),
            Ok(ScopeAttribute::ClientCert)
        );
        assert_eq!(ScopeAttribute::ClientCert.to_string(), "client_cert");
        let with = |digest: Option<u8>, auth: &str| {
            let mut p = parts(&[("authorization", auth)]);
            if let Some(d) = digest {
                p.extensions.insert(ClientCertificate([d; 32]));
            }
            p
        };
        let r = rules(&["client_cert"]);
        let alice = r.scope(&with(Some(1), "Bearer a")).expect("scope");
        // A refreshed token is the same caller; another certificate is not.
        assert_eq!(alice, r.scope(&with(Some(1), "Bearer b")).expect("scope"));
        assert_ne!(alice, r.scope(&with(Some(2), "Bearer a")).expect("scope"));
        assert_ne!(alice, anonymous_scope());
        // Without a certificate: anonymous, or refused.
        assert_eq!(r.scope(&with(None, "Bearer a")), Ok(anonymous_scope()));
        let strict = rules(&["client_cert"]).anonymous(Anonymous::Reject);
        assert_eq!(
            strict.scope(&with(None, "Bearer a")),
            Err(ScopeError::MissingIdentity)
        );
        // Not the same namespace as a header carrying the same bytes.
        let header = rules(&["header:x-cert"]);
        let digest = String::from_utf8(vec![b'a'; 32]).expect("ascii");
        assert_ne!(
            r.scope(&with(Some(b'a'), "x")).expect("scope"),
            header
                .scope(&parts(&[("x-cert", digest.as_str())]))
                .expect("scope")
        );
    }

    proptest! {
        #[test]
        fn distinct_credentials_distinct_scopes(a in "[ -~]{0,40}", b in "[ -~]{0,40}") {
            let r = default_rules();
            let sa = r.scope(&parts(&[("authorization", a.as_str())])).expect("scope");
            let sb = r.scope(&parts(&[("authorization", b.as_str())])).expect("scope");
            // HeaderValue parsing trims nothing, so equal iff equal bytes.
            prop_assert_eq!(sa == sb, a == b);
            prop_assert_ne!(sa, anonymous_scope());
        }
    }
}
