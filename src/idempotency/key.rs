//! Parsing the `Idempotency-Key` header.
// STUB: to be implemented by the key/fingerprint helper.
use http::HeaderValue;

/// A validated key: 1..=255 visible ASCII characters, unquoted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidKey {
    #[error("the key is empty")]
    Empty,
}

pub fn parse_key(_value: &HeaderValue) -> Result<IdempotencyKey, InvalidKey> {
    todo!()
}
