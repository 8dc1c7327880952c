//! Encryption at rest (`store.encryption_keys_env`, DESIGN §7): a store
//! wrapper that seals every stored response (status, headers, body) with
//! AES-256-GCM before it reaches the store, and opens it on the way back.
//!
//! - The record key is the associated data: a sealed response copied under
//!   another key does not open, so a store operator cannot move one
//!   caller's answer into another caller's replay.
//! - Each seal draws a fresh 96-bit nonce from the system's CSPRNG. Random
//!   nonces are safe for about 2^32 seals per key; rotate keys well before
//!   (docs/stores.md says how).
//! - The first key seals; every key opens, found by a 4-byte id derived
//!   from the key (never the key): rotation is "put the new key first,
//!   keep the old one until its records expired (`ttl`)".
//! - Lease metadata (claims, fingerprints, instants, outcome kinds) stays
//!   readable: the stores' atomic scripts work on it.
//! - A sealed response no configured key opens is reported as a corrupt
//!   record, which the middleware treats like any record it cannot read:
//!   fail closed, 500 `record-unreadable`, the request behind it never
//!   executed again.
//! - Responses stored before encryption was turned on still replay (they
//!   are read as they are); new ones are sealed.
//! - With compression on ([`super::compression`], above this wrapper), what
//!   is sealed is the packed response (layout 2, which the associated data
//!   also binds); without, the response in the record codec's layout
//!   (layout 1, as every build before compression wrote it).
//! - The local replay cache sits in front of this wrapper: it holds opened
//!   responses, in process memory only.

use base64::Engine;
use bytes::Bytes;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

use super::codec::{CodecStore, OutcomeCodec};
use super::StoreError;
use crate::core::{Outcome, RecordKey, StoredResponse};

/// The first byte of a sealed response: what its plaintext is. Layout 1:
/// a [`StoredResponse`] in the record codec's layout.
const SEALED_V1: u8 = 1;
/// Layout 2: a packed response (`Outcome::Packed`).
const SEALED_PACKED: u8 = 2;
const KEY_ID_LEN: usize = 4;
const HEADER_LEN: usize = 1 + KEY_ID_LEN + NONCE_LEN;

/// One AES-256 key and its id.
struct SealingKey {
    id: [u8; KEY_ID_LEN],
    key: LessSafeKey,
}

/// The configured keys: the first seals, every one opens.
pub struct Keyring {
    keys: Vec<SealingKey>,
    random: SystemRandom,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.debug_struct("Keyring")
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl Keyring {
    /// Parses comma-separated base64 (standard alphabet, padded) 32-byte
    /// keys. The error says which entry is wrong, never what it holds.
    pub fn parse(text: &str) -> Result<Keyring, String> {
        let mut keys = Vec::new();
        for (i, entry) in text.split(',').map(str::trim).enumerate() {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(entry)
                .map_err(|_| format!("key {} is not base64", i + 1))?;
            let unbound = UnboundKey::new(&AES_256_GCM, &raw)
                .map_err(|_| format!("key {} is {} bytes; AES-256 takes 32", i + 1, raw.len()))?;
            let digest = Sha256::new()
                .chain_update(b"idemproxy.key-id.v1\0")
                .chain_update(&raw)
                .finalize();
            let mut id = [0; KEY_ID_LEN];
            id.copy_from_slice(&digest[..KEY_ID_LEN]);
            keys.push(SealingKey {
                id,
                key: LessSafeKey::new(unbound),
            });
        }
        Ok(Keyring {
            keys,
            random: SystemRandom::new(),
        })
    }

    /// No key: encryption is off. Stored responses are written as they
    /// are, and one sealed earlier is a record this deployment cannot read
    /// (fail closed, like one sealed with a key rotated away), never one
    /// the replay path finds still sealed.
    pub fn none() -> Keyring {
        Keyring {
            keys: Vec::new(),
            random: SystemRandom::new(),
        }
    }

    /// `plain` sealed with the first key, bound to `record` and `layout`.
    fn seal(&self, record: &RecordKey, layout: u8, plain: &[u8]) -> Result<Bytes, StoreError> {
        let sealing = self
            .keys
            .first()
            .ok_or_else(|| StoreError::Unavailable("no encryption key".into()))?;
        let mut nonce = [0; NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .map_err(|_| StoreError::Unavailable("the system's random source failed".into()))?;
        let mut out = Vec::with_capacity(HEADER_LEN + plain.len() + AES_256_GCM.tag_len());
        out.push(layout);
        out.extend_from_slice(&sealing.id);
        out.extend_from_slice(&nonce);
        let mut sealed = plain.to_vec();
        sealing
            .key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(associated_data(record, layout)),
                &mut sealed,
            )
            .map_err(|_| StoreError::Unavailable("sealing failed".into()))?;
        out.extend_from_slice(&sealed);
        Ok(Bytes::from(out))
    }

    /// The layout and plaintext of `sealed`, if a configured key opens it
    /// for `record`.
    fn open(&self, record: &RecordKey, sealed: &[u8]) -> Option<(u8, Vec<u8>)> {
        let layout = *sealed.first()?;
        if sealed.len() < HEADER_LEN || !matches!(layout, SEALED_V1 | SEALED_PACKED) {
            return None;
        }
        let (id, rest) = sealed[1..].split_at(KEY_ID_LEN);
        let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
        let key = self.keys.iter().find(|k| k.id == id)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buffer = ciphertext.to_vec();
        let plain = key
            .key
            .open_in_place(
                nonce,
                Aad::from(associated_data(record, layout)),
                &mut buffer,
            )
            .ok()?;
        let len = plain.len();
        buffer.truncate(len);
        Some((layout, buffer))
    }
}

/// What a seal is bound to: the record key, and a layout after the first
/// (layout 1 was sealed with the key alone, and must keep opening).
fn associated_data(record: &RecordKey, layout: u8) -> Vec<u8> {
    let mut aad = record.as_bytes().to_vec();
    if layout != SEALED_V1 {
        aad.push(layout);
    }
    aad
}

/// A store whose stored responses are sealed (see the module docs).
pub type SealedStore = CodecStore<Keyring>;

impl OutcomeCodec for Keyring {
    fn encode(&self, key: &RecordKey, outcome: &Outcome) -> Result<Option<Outcome>, StoreError> {
        if self.keys.is_empty() {
            return Ok(None);
        }
        let sealed = match outcome {
            Outcome::Response(response) => self.seal(key, SEALED_V1, &response.encode())?,
            Outcome::Packed(packed) => self.seal(key, SEALED_PACKED, packed)?,
            _ => return Ok(None),
        };
        Ok(Some(Outcome::Sealed(sealed)))
    }

    /// Opened into what was sealed: a response, or a packed one for the
    /// compression above to unpack.
    fn decode(&self, key: &RecordKey, outcome: &Outcome) -> Option<Result<Outcome, String>> {
        let Outcome::Sealed(sealed) = outcome else {
            return None;
        };
        let unreadable = || "a sealed response that no configured encryption key opens".to_string();
        Some(match self.open(key, sealed) {
            Some((SEALED_PACKED, packed)) => Ok(Outcome::Packed(Bytes::from(packed))),
            Some((_, plain)) => StoredResponse::decode(&plain)
                .map(Outcome::Response)
                .map_err(|_| unreadable()),
            None => Err(unreadable()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_text(byte: u8) -> String {
        base64::engine::general_purpose::STANDARD.encode([byte; 32])
    }

    fn ring(keys: &[u8]) -> Keyring {
        let text: Vec<String> = keys.iter().map(|b| key_text(*b)).collect();
        Keyring::parse(&text.join(",")).expect("keys")
    }

    #[test]
    fn a_sealed_response_opens_under_its_record_key_only() {
        let keys = ring(&[1]);
        let here = RecordKey::from_bytes([7; 32]);
        let there = RecordKey::from_bytes([8; 32]);
        let sealed = keys.seal(&here, SEALED_V1, b"card 4242").expect("seal");
        assert!(!sealed.windows(4).any(|w| w == b"4242"), "no plaintext");
        assert_eq!(
            keys.open(&here, &sealed),
            Some((SEALED_V1, b"card 4242".to_vec()))
        );
        assert_eq!(keys.open(&there, &sealed), None, "bound to its record key");
        let again = keys.seal(&here, SEALED_V1, b"card 4242").expect("seal");
        assert_ne!(sealed, again, "a fresh nonce per seal");
        let mut tampered = sealed.to_vec();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        assert_eq!(keys.open(&here, &tampered), None);
        assert_eq!(keys.open(&here, b"short"), None);
    }

    #[test]
    fn the_first_key_seals_and_every_key_opens() {
        let record = RecordKey::from_bytes([3; 32]);
        let old = ring(&[1]).seal(&record, SEALED_V1, b"old").expect("seal");
        let rotated = ring(&[2, 1]);
        assert_eq!(
            rotated.open(&record, &old),
            Some((SEALED_V1, b"old".to_vec()))
        );
        let new = rotated.seal(&record, SEALED_PACKED, b"new").expect("seal");
        assert_eq!(
            ring(&[2]).open(&record, &new),
            Some((SEALED_PACKED, b"new".to_vec()))
        );
        assert_eq!(ring(&[1]).open(&record, &new), None, "sealed by the first");
        assert_eq!(ring(&[2]).open(&record, &old), None, "its key was removed");
    }

    #[test]
    fn the_layout_is_bound_to_the_seal() {
        let keys = ring(&[1]);
        let record = RecordKey::from_bytes([5; 32]);
        let packed = keys.seal(&record, SEALED_PACKED, b"packed").expect("seal");
        assert_eq!(
            keys.open(&record, &packed),
            Some((SEALED_PACKED, b"packed".to_vec()))
        );
        // Relabelled as the other layout, it no longer opens: a store
        // operator cannot make one layout be read as the other.
        let mut relabelled = packed.to_vec();
        relabelled[0] = SEALED_V1;
        assert_eq!(keys.open(&record, &relabelled), None);
        let old = keys.seal(&record, SEALED_V1, b"plain").expect("seal");
        let mut relabelled = old.to_vec();
        relabelled[0] = SEALED_PACKED;
        assert_eq!(keys.open(&record, &relabelled), None);
        relabelled[0] = 3;
        assert_eq!(keys.open(&record, &relabelled), None, "an unknown layout");
    }

    #[test]
    fn bad_keys_are_named_by_position_and_not_echoed() {
        let short = base64::engine::general_purpose::STANDARD.encode([9; 16]);
        let err = Keyring::parse(&format!("{},{short}", key_text(1))).expect_err("short");
        assert!(err.contains("key 2 is 16 bytes"), "{err}");
        assert!(!err.contains(&short));
        let err = Keyring::parse("not base64!").expect_err("garbage");
        assert!(err.contains("key 1 is not base64"), "{err}");
        assert!(format!("{:?}", ring(&[1, 2])).contains("keys: 2"));
    }
}
