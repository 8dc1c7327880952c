//! Compression of stored responses (`store.compression`, DESIGN §2): a
//! store wrapper that packs every stored response before it reaches the
//! store, and unpacks it on the way back.
//!
//! Stored bytes are the price of the promise: a record lives `ttl` (24 h by
//! default), so a store holds rate × `ttl` of them. JSON API responses are
//! repetitive; packed, a ~1 KB payment object takes about 0.6 of its size,
//! and about 0.17 with a dictionary trained on the API's own responses
//! (docs/performance.md, "Stored bytes"). Packing:
//!
//! - writes headers compactly (common names as a one-byte index) and the
//!   whole response as one zstd frame at the fastest standard level,
//!   checksummed, when that is shorter than the plain layout;
//! - with `compression_dictionary`, compresses against it and names it in
//!   the record; dictionaries replaced since
//!   (`previous_compression_dictionaries`) still read their records;
//! - happens once per first execution, above encryption at rest
//!   ([`super::sealed`]): what is sealed is the packed response, so
//!   ciphertext, which does not compress, is never what zstd sees;
//! - leaves lease metadata (claims, fingerprints, instants, outcome kinds)
//!   as it was: the stores' atomic steps read it.
//!
//! Reading never depends on the setting: records written with compression
//! off, or before it existed, are plain [`Outcome::Response`]s and read as
//! they are; packed ones unpack whatever `compression` says now, so turning
//! it off loses nothing. A packed response that does not unpack (a flipped
//! byte fails the checksum, a dictionary no longer configured) is a corrupt
//! record: the middleware answers 500 `record-unreadable` and never executes the request behind
//! it again.
//!
//! The local replay cache sits above this wrapper and keeps unpacked
//! responses: a cached replay costs no decompression.
//!
//! The packed layout and its codec ([`Packer`], [`Dictionary`]) are pure
//! and live in `idemproxy_core::packed`, where the fuzz targets reach them
//! without building the proxy; this module adds the store wrapper and
//! dictionary training.

pub use idemproxy_core::packed::{
    payload, Dictionary, DictionaryId, Packer, UnpackError, KNOWN_NAMES, LEVEL,
};

use super::codec::{CodecStore, OutcomeCodec};
use super::StoreError;
use crate::core::{Outcome, RecordKey};

/// A store whose stored responses are packed (see the module docs).
pub type CompressedStore = CodecStore<Packer>;

impl OutcomeCodec for Packer {
    /// Packed when packing compresses; with compression off, responses are
    /// stored as they are, as every build before it stored them.
    fn encode(&self, _: &RecordKey, outcome: &Outcome) -> Result<Option<Outcome>, StoreError> {
        Ok(match outcome {
            Outcome::Response(response) if self.compresses() => {
                Some(Outcome::Packed(self.pack(response)))
            }
            _ => None,
        })
    }

    fn decode(&self, _: &RecordKey, outcome: &Outcome) -> Option<Result<Outcome, String>> {
        let Outcome::Packed(packed) = outcome else {
            return None;
        };
        Some(
            self.unpack(packed)
                .map(Outcome::Response)
                .map_err(|e| format!("a packed response that does not unpack: {e}")),
        )
    }
}

/// Trains a dictionary of at most `max_len` bytes from `samples` (zstd's
/// COVER trainer). zstd wants about a hundred times the dictionary's size
/// in samples; it refuses far fewer, which the error says.
pub fn train<S: AsRef<[u8]>>(samples: &[S], max_len: usize) -> Result<Vec<u8>, String> {
    zstd::dict::from_samples(samples, max_len).map_err(|e| {
        format!(
            "zstd could not train a dictionary from {} samples ({e}); give it more samples",
            samples.len()
        )
    })
}
