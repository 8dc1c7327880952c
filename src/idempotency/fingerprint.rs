//! The request fingerprint.
// STUB: to be implemented by the key/fingerprint helper.
use http::request::Parts;
use http::HeaderName;

use super::record::Fingerprint;

/// What goes into a fingerprint besides method, path, query, content type and body.
#[derive(Clone, Debug, Default)]
pub struct FingerprintRules {
    pub headers: Vec<HeaderName>,
    /// RFC 6901 JSON pointers removed from a JSON body before hashing.
    pub ignore: Vec<String>,
}

impl FingerprintRules {
    pub fn fingerprint(&self, _parts: &Parts, _body: &[u8]) -> Fingerprint {
        todo!()
    }
}
