//! Key namespaces (tenants).
// STUB: to be implemented by the key/fingerprint helper.
use std::str::FromStr;

use http::request::Parts;
use http::HeaderName;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScopeAttribute {
    Header(HeaderName),
}

impl FromStr for ScopeAttribute {
    type Err = String;
    fn from_str(_s: &str) -> Result<Self, String> {
        todo!()
    }
}

#[derive(Clone, Debug, Default)]
pub struct ScopeRules {
    pub attributes: Vec<ScopeAttribute>,
}

impl ScopeRules {
    pub fn scope(&self, _parts: &Parts) -> [u8; 32] {
        todo!()
    }
}
