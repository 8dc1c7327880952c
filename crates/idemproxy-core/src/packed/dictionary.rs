//! zstd dictionaries (`store.compression_dictionary`): loaded from a file,
//! named by an id derived from their bytes (trained from samples by the
//! main crate's `store::compression::train`).

use std::path::Path;

use sha2::{Digest, Sha256};
use zstd::zstd_safe::{CDict, DDict};

/// What a record stores to name the dictionary it was compressed with: the
/// first four bytes of the SHA-256 of the dictionary file. A different file
/// has a different id (a collision among the few dictionaries one
/// deployment keeps is a 1 in 4 billion chance, and would fail closed: the
/// frame's checksum does not match).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DictionaryId([u8; DictionaryId::LEN]);

impl DictionaryId {
    pub const LEN: usize = 4;

    pub fn of(bytes: &[u8]) -> Self {
        let digest = Sha256::new()
            .chain_update(b"idemproxy.dictionary-id.v1\0")
            .chain_update(bytes)
            .finalize();
        let mut id = [0; Self::LEN];
        id.copy_from_slice(&digest[..Self::LEN]);
        Self(id)
    }

    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }
}

impl std::fmt::Display for DictionaryId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// A dictionary, prepared once for compressing and for decompressing (zstd
/// digests it into tables; a context only references them per record).
pub struct Dictionary {
    id: DictionaryId,
    len: usize,
    compression: CDict<'static>,
    decompression: DDict<'static>,
}

impl std::fmt::Debug for Dictionary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dictionary")
            .field("id", &self.id.to_string())
            .field("len", &self.len)
            .finish()
    }
}

/// zstd's level for compressing with a dictionary: one of its fast
/// levels, which leave literals as they are. Against a dictionary trained on
/// the API's responses most of a response is matches, so Huffman-coding the
/// few literals left gains little: on ~1.1 KB payment objects (4 KB
/// dictionary) level 1 packs to 0.177 of the body for ~27k instructions,
/// -3 to 0.221 for ~19k (cachegrind), and the record's own bytes in Redis
/// dwarf the difference.
pub const DICTIONARY_LEVEL: i32 = -3;

/// Smaller than any dictionary worth having; what zstd accepts as one is
/// at least this.
const MIN_LEN: usize = 8;

impl Dictionary {
    /// A dictionary from its bytes: one `idemproxy store train-dictionary`
    /// wrote, or any zstd dictionary (raw content works too).
    pub fn new(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() < MIN_LEN {
            return Err(format!(
                "{} bytes is too short for a dictionary",
                bytes.len()
            ));
        }
        let compression = CDict::try_create(bytes, DICTIONARY_LEVEL)
            .ok_or("zstd could not prepare the dictionary for compression")?;
        let decompression = DDict::try_create(bytes)
            .ok_or("zstd could not prepare the dictionary for decompression")?;
        Ok(Self {
            id: DictionaryId::of(bytes),
            len: bytes.len(),
            compression,
            decompression,
        })
    }

    /// [`Dictionary::new`] on a file's contents; the error names the file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("cannot read the dictionary {}: {e}", path.display()))?;
        Self::new(&bytes).map_err(|e| format!("dictionary {}: {e}", path.display()))
    }

    pub fn id(&self) -> DictionaryId {
        self.id
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn compression(&self) -> &CDict<'static> {
        &self.compression
    }

    pub(super) fn decompression(&self) -> &DDict<'static> {
        &self.decompression
    }
}
