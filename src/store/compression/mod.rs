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
//! - without one (the default), learns a dictionary from the proxy's own
//!   first responses and shares it through the store ([`learned`]): a
//!   ~1.1 KB payment object then packs to ~0.22 of its size for ~19k
//!   instructions, where zstd alone took ~93k for ~0.6;
//! - leaves a body that is `content-encoding`d as it is, without trying;
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
//! dictionary training, operators' (`train`) and the proxy's own
//! ([`learned`]).

pub use idemproxy_core::packed::{
    compressed_len, dictionary_of, payload, worth_compressing, Dictionary, DictionaryId, Packer,
    UnpackError, KNOWN_NAMES, LEVEL,
};

mod learned;

pub use learned::{
    dictionary_key, is_dictionary_record, Compression, LearnSettings, CURRENT, SAMPLES, USABLE_FOR,
};

use super::codec::{CodecStore, OutcomeCodec};
use super::StoreError;
use bytes::Bytes;

use crate::core::{Outcome, Record, RecordKey, StoredResponse};

/// A store whose stored responses are packed (see the module docs).
pub type CompressedStore = CodecStore<Packer>;

/// A store whose stored responses are packed, with learned dictionaries
/// ([`learned`]): the proxy's own.
pub type LearningStore = CodecStore<Compression>;

impl OutcomeCodec for Compression {
    fn encode(&self, _: &RecordKey, outcome: &Outcome) -> Result<Option<Outcome>, StoreError> {
        Ok(packed(outcome, self.compresses(), |r| self.pack(r)))
    }

    fn decode(&self, _: &RecordKey, outcome: &Outcome) -> Option<Result<Outcome, String>> {
        unpacked(outcome, |p| self.unpack(p))
    }

    fn needs(&self, outcome: &Outcome) -> Option<RecordKey> {
        match outcome {
            Outcome::Packed(packed) => Compression::needs(self, packed),
            _ => None,
        }
    }

    fn learn(&self, record: Option<Record>) {
        Compression::learn(self, record);
    }

    fn internal(&self, key: &RecordKey, record: Option<&Record>) -> bool {
        match record {
            Some(Record::Completed(completed)) => match &completed.outcome {
                Outcome::Response(response) => is_dictionary_record(key, response),
                _ => false,
            },
            Some(Record::Pending(_)) => false,
            None => self.is_dictionary_key(key),
        }
    }
}

impl OutcomeCodec for Packer {
    fn encode(&self, _: &RecordKey, outcome: &Outcome) -> Result<Option<Outcome>, StoreError> {
        Ok(packed(outcome, self.compresses(), |r| self.pack(r)))
    }

    fn decode(&self, _: &RecordKey, outcome: &Outcome) -> Option<Result<Outcome, String>> {
        unpacked(outcome, |p| self.unpack(p))
    }
}

/// A response packed when packing compresses; with compression off,
/// responses are stored as they are, as every build before it stored them.
fn packed(
    outcome: &Outcome,
    compresses: bool,
    pack: impl FnOnce(&StoredResponse) -> Bytes,
) -> Option<Outcome> {
    match outcome {
        Outcome::Response(response) if compresses => Some(Outcome::Packed(pack(response))),
        _ => None,
    }
}

/// What a packed response stands for; `None` for any other outcome.
fn unpacked(
    outcome: &Outcome,
    unpack: impl FnOnce(&Bytes) -> Result<StoredResponse, UnpackError>,
) -> Option<Result<Outcome, String>> {
    let Outcome::Packed(packed) = outcome else {
        return None;
    };
    Some(
        unpack(packed)
            .map(Outcome::Response)
            .map_err(|e| format!("a packed response that does not unpack: {e}")),
    )
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
