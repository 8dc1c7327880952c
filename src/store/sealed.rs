//! Encryption at rest (`store.encryption_keys_env`, DESIGN §7): a store
//! wrapper that seals every stored response (status, headers, body) with
//! AES-256-GCM before it reaches the store, and opens it on the way back.
//!
//! - The record key is the associated data: a sealed response copied under
//!   another key does not open, so a store operator cannot move one
//!   caller's answer into another caller's replay.
//! - Each seal draws a fresh 96-bit nonce from the system's CSPRNG. Random
//!   nonces are safe for about 2^32 seals per key; rotate keys well before
//!   (the README says how).
//! - The first key seals; every key opens, found by a 4-byte id derived
//!   from the key (never the key): rotation is "put the new key first,
//!   keep the old one until its records expired (`ttl`)".
//! - Lease metadata (claims, fingerprints, instants, outcome kinds) stays
//!   readable: the stores' atomic scripts work on it.
//! - A sealed response no configured key opens is reported as a corrupt
//!   record, which the middleware treats like any record it cannot read:
//!   fail closed, 503, the request behind it never executed again.
//! - Responses stored before encryption was turned on still replay (they
//!   are read as they are); new ones are sealed.
//! - The local replay cache sits in front of this wrapper: it holds opened
//!   responses, in process memory only.

use std::sync::Arc;

use async_trait::async_trait;
use base64::Engine;
use bytes::Bytes;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

use super::{RemovalWatcher, SharedStore, Store, StoreError};
use crate::core::{
    Begin, BeginOutcome, CompletedRecord, FencingToken, Outcome, Record, RecordKey, Removal,
    Removed, StoredResponse,
};

/// The first byte of a sealed response: its layout, should it change.
const SEALED_V1: u8 = 1;
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

    /// `plain` sealed with the first key, bound to `record`.
    fn seal(&self, record: &RecordKey, plain: &[u8]) -> Result<Bytes, StoreError> {
        let sealing = self
            .keys
            .first()
            .ok_or_else(|| StoreError::Unavailable("no encryption key".into()))?;
        let mut nonce = [0; NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .map_err(|_| StoreError::Unavailable("the system's random source failed".into()))?;
        let mut out = Vec::with_capacity(HEADER_LEN + plain.len() + AES_256_GCM.tag_len());
        out.push(SEALED_V1);
        out.extend_from_slice(&sealing.id);
        out.extend_from_slice(&nonce);
        let mut sealed = plain.to_vec();
        sealing
            .key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(record.as_bytes()),
                &mut sealed,
            )
            .map_err(|_| StoreError::Unavailable("sealing failed".into()))?;
        out.extend_from_slice(&sealed);
        Ok(Bytes::from(out))
    }

    /// The plaintext of `sealed`, if a configured key opens it for `record`.
    fn open(&self, record: &RecordKey, sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < HEADER_LEN || sealed[0] != SEALED_V1 {
            return None;
        }
        let (id, rest) = sealed[1..].split_at(KEY_ID_LEN);
        let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
        let key = self.keys.iter().find(|k| k.id == id)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buffer = ciphertext.to_vec();
        let plain = key
            .key
            .open_in_place(nonce, Aad::from(record.as_bytes()), &mut buffer)
            .ok()?;
        let len = plain.len();
        buffer.truncate(len);
        Some(buffer)
    }
}

/// `record`'s instants and fingerprint with another outcome.
fn with_outcome(record: &CompletedRecord, outcome: Outcome) -> CompletedRecord {
    CompletedRecord {
        fingerprint: record.fingerprint,
        created_at: record.created_at,
        completed_at: record.completed_at,
        expires_at: record.expires_at,
        outcome,
    }
}

/// A store whose stored responses are sealed (see the module docs).
pub struct SealedStore {
    inner: SharedStore,
    keys: Arc<Keyring>,
}

impl std::fmt::Debug for SealedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedStore")
            .field("kind", &self.inner.kind())
            .field("keys", &self.keys)
            .finish()
    }
}

impl SealedStore {
    pub fn new(inner: SharedStore, keys: Keyring) -> Self {
        Self {
            inner,
            keys: Arc::new(keys),
        }
    }

    fn sealed(
        &self,
        key: &RecordKey,
        record: &CompletedRecord,
    ) -> Result<Option<CompletedRecord>, StoreError> {
        let Outcome::Response(response) = &record.outcome else {
            return Ok(None);
        };
        let sealed = self.keys.seal(key, &response.encode())?;
        Ok(Some(with_outcome(record, Outcome::Sealed(sealed))))
    }

    /// `record` with its response opened; `Err` when no key opens it.
    fn opened(
        &self,
        key: &RecordKey,
        record: &CompletedRecord,
    ) -> Result<Option<CompletedRecord>, ()> {
        let Outcome::Sealed(sealed) = &record.outcome else {
            return Ok(None);
        };
        let plain = self.keys.open(key, sealed).ok_or(())?;
        let response = StoredResponse::decode(&plain).map_err(|_| ())?;
        Ok(Some(with_outcome(record, Outcome::Response(response))))
    }

    fn open_for_replay(
        &self,
        key: &RecordKey,
        record: Arc<CompletedRecord>,
    ) -> Result<Arc<CompletedRecord>, StoreError> {
        match self.opened(key, &record) {
            Ok(Some(opened)) => Ok(Arc::new(opened)),
            Ok(None) => Ok(record),
            Err(()) => Err(StoreError::Corrupt(format!(
                "record {} holds a sealed response that no configured encryption key opens",
                key.to_hex()
            ))),
        }
    }
}

#[async_trait]
impl Store for SealedStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        Ok(match self.inner.begin(begin).await? {
            BeginOutcome::Completed(record) => {
                BeginOutcome::Completed(self.open_for_replay(&begin.key, record)?)
            }
            BeginOutcome::Settled(record) => {
                BeginOutcome::Settled(self.open_for_replay(&begin.key, record)?)
            }
            other => other,
        })
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        match self.sealed(key, record)? {
            Some(sealed) => self.inner.complete(key, token, &sealed).await,
            None => self.inner.complete(key, token, record).await,
        }
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }

    /// Opened when a key opens it; else as stored (the admin API shows it
    /// as `sealed`).
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        Ok(match self.inner.get(key).await? {
            Some(Record::Completed(record)) => match self.opened(key, &record) {
                Ok(Some(opened)) => Some(Record::Completed(opened)),
                _ => Some(Record::Completed(record)),
            },
            other => other,
        })
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        self.inner.remove(key, removal).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn local_cache_hits(&self) -> Option<u64> {
        self.inner.local_cache_hits()
    }

    fn local_cache_live(&self) -> Option<bool> {
        self.inner.local_cache_live()
    }

    fn watch_removals(&self, watcher: Arc<dyn RemovalWatcher>) {
        self.inner.watch_removals(watcher);
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
        let sealed = keys.seal(&here, b"card 4242").expect("seal");
        assert!(!sealed.windows(4).any(|w| w == b"4242"), "no plaintext");
        assert_eq!(
            keys.open(&here, &sealed).as_deref(),
            Some(&b"card 4242"[..])
        );
        assert_eq!(keys.open(&there, &sealed), None, "bound to its record key");
        let again = keys.seal(&here, b"card 4242").expect("seal");
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
        let old = ring(&[1]).seal(&record, b"old").expect("seal");
        let rotated = ring(&[2, 1]);
        assert_eq!(rotated.open(&record, &old).as_deref(), Some(&b"old"[..]));
        let new = rotated.seal(&record, b"new").expect("seal");
        assert_eq!(ring(&[2]).open(&record, &new).as_deref(), Some(&b"new"[..]));
        assert_eq!(ring(&[1]).open(&record, &new), None, "sealed by the first");
        assert_eq!(ring(&[2]).open(&record, &old), None, "its key was removed");
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
