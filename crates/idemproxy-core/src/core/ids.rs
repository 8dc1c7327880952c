//! The identities every layer passes around: the store key of a (scope,
//! key) pair, the fingerprint of a request, the fencing token of a claim
//! and the client certificate a connection verified. Raw keys and credentials never get past these hashes.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Identity of a record in the store: SHA-256 over the scope and the raw key,
/// so the store never holds a raw key or a credential.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey([u8; 32]);

impl RecordKey {
    /// Derives the store identity of `key` within `scope` (a scope digest).
    pub fn new(scope: &[u8; 32], key: &str) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"idemproxy.record.v1\0");
        hasher.update(scope);
        hasher.update(key.as_bytes());
        Self(hasher.finalize().into())
    }

    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex: how the key appears in logs, metrics and admin URLs.
    pub fn to_hex(&self) -> String {
        self.hex().as_str().to_owned()
    }

    /// [`RecordKey::to_hex`] on the stack, for the request log line and the
    /// Redis key written on every request.
    pub fn hex(&self) -> KeyHex {
        let mut out = [0u8; 64];
        // Cannot fail: `out` is exactly twice the key's length.
        let _ = hex::encode_to_slice(self.0, &mut out);
        KeyHex(out)
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(Self(out))
    }
}

/// A [`RecordKey`] in lower-case hex (see [`RecordKey::hex`]).
#[derive(Clone, Copy)]
pub struct KeyHex([u8; 64]);

impl KeyHex {
    pub fn as_str(&self) -> &str {
        // Hex digits are ASCII; the fallback is unreachable.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for KeyHex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHex({})", self.as_str())
    }
}

impl fmt::Display for KeyHex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordKey({})", self.to_hex())
    }
}

/// SHA-256 of what makes two requests "the same request" (see `fingerprint`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

/// Random token that proves ownership of a pending record. Only its holder may
/// complete or release the record, so a proxy whose lease expired cannot
/// overwrite the record of the owner that took the key over.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FencingToken(pub u128);

impl FencingToken {
    pub fn random() -> Self {
        Self(rand::random())
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Tokens are not secrets, but a short form is enough to correlate logs.
        write!(f, "FencingToken({:08x})", (self.0 >> 96) as u32)
    }
}

/// The SHA-256 of the client certificate a connection's TLS handshake
/// verified against `[tls] client_ca_file` (the leaf, DER). The server puts
/// it on every request of the connection (a request extension); the
/// `client_cert` scope and the admin API read it. Absent on plain-text
/// connections and when no certificate was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientCertificate(pub [u8; 32]);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_key_depends_on_scope_and_key() {
        let a = RecordKey::new(&[0; 32], "k1");
        assert_eq!(a, RecordKey::new(&[0; 32], "k1"));
        assert_ne!(a, RecordKey::new(&[1; 32], "k1"));
        assert_ne!(a, RecordKey::new(&[0; 32], "k2"));
        assert_eq!(RecordKey::from_hex(&a.to_hex()), Some(a));
        assert_eq!(a.hex().as_str(), hex::encode(a.as_bytes()));
        assert_eq!(a.hex().to_string(), a.to_hex());
    }
}
