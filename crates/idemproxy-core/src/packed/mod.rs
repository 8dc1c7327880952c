//! The packed layout of a stored response, and the codec that writes and
//! reads it: what `store.compression` stores (DESIGN §2; the main crate's
//! `store::compression` wraps a store in it and says why and when). Pure:
//! zstd and postcard over bytes, no store and no I/O but
//! [`Dictionary::load`]'s one file read.
//!
//! ```text
//! packed   = layout payload                       layout 1: payload as is
//!          | layout zstd-frame(payload)           layout 2: zstd
//!          | layout dictionary-id zstd-frame(payload)  layout 3: zstd with
//!                                                      the dictionary whose
//!                                                      4-byte id follows
//! payload  = postcard(status, [(name, value)], body)
//! name     = Known(index into KNOWN_NAMES) | Other(text)
//! ```
//!
//! zstd frames carry their content size (what unpacking allocates, checked
//! against a ceiling first) and a checksum (a flipped bit is an error, never
//! a different response), and no zstd dictionary id (the layout names the
//! dictionary). Layout bytes and [`KNOWN_NAMES`] indices are never reused
//! or reordered: records written by every build since must keep reading.

use std::cell::RefCell;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use zstd::zstd_safe::{self, CCtx, CParameter, DCtx};

use crate::core::StoredResponse;

mod dictionary;

pub use dictionary::{Dictionary, DictionaryId, DICTIONARY_LEVEL};

const LAYOUT_PLAIN: u8 = 1;
const LAYOUT_ZSTD: u8 = 2;
const LAYOUT_ZSTD_DICTIONARY: u8 = 3;

/// zstd's level for stored responses: its fastest standard level. Higher
/// levels gained nothing on JSON API responses of 1-16 KB and cost up to
/// twice the time (docs/performance.md, "Stored bytes").
pub const LEVEL: i32 = 1;

/// Payloads shorter than this are stored as they are without a dictionary:
/// a zstd frame's own 13 bytes (header, block header, checksum) outweigh
/// what it saves on so little.
const MIN_COMPRESSED: usize = 128;

/// With a dictionary, a frame costs its header, block header and checksum
/// and the dictionary's id (~18 bytes): shorter payloads cannot gain.
const MIN_COMPRESSED_WITH_DICTIONARY: usize = 32;

/// Header names stored as their index (two bytes) instead of their text:
/// the ones API responses carry most. Append only; never reorder.
pub const KNOWN_NAMES: [&str; 33] = [
    "content-type",
    "content-length",
    "date",
    "server",
    "cache-control",
    "etag",
    "location",
    "vary",
    "x-request-id",
    "request-id",
    "content-encoding",
    "last-modified",
    "expires",
    "access-control-allow-origin",
    "strict-transport-security",
    "x-content-type-options",
    "set-cookie",
    "link",
    "content-language",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "idempotency-key",
    "x-frame-options",
    "referrer-policy",
    "content-security-policy",
    "access-control-allow-credentials",
    "access-control-expose-headers",
    "x-powered-by",
    "retry-after",
    "content-disposition",
    "age",
    "pragma",
];

#[derive(Serialize, Deserialize)]
enum Name<'a> {
    Known(u8),
    Other(&'a str),
}

impl<'a> Name<'a> {
    fn of(name: &'a str) -> Self {
        match KNOWN_NAMES.iter().position(|known| *known == name) {
            // KNOWN_NAMES is far shorter than 256.
            Some(index) => Name::Known(index as u8),
            None => Name::Other(name),
        }
    }

    fn text(&self) -> Option<&'a str> {
        match self {
            Name::Known(index) => KNOWN_NAMES.get(usize::from(*index)).copied(),
            Name::Other(text) => Some(text),
        }
    }
}

/// The headers of a response as the payload writes them, without
/// collecting them into a second vector first.
struct PayloadHeaders<'a>(&'a [(String, Bytes)]);

impl Serialize for PayloadHeaders<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|(name, value)| (Name::of(name), value)))
    }
}

#[derive(Serialize)]
struct PayloadRef<'a> {
    status: u16,
    headers: PayloadHeaders<'a>,
    body: &'a Bytes,
}

#[derive(Deserialize)]
struct PayloadView<'a> {
    status: u16,
    #[serde(borrow)]
    headers: Vec<(Name<'a>, &'a [u8])>,
    body: &'a [u8],
}

/// Why a packed response does not unpack. Every one is a corrupt record to
/// the store wrapper: fail closed, never a second execution.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UnpackError {
    #[error("packed response layout {0} is unknown to this build")]
    UnknownLayout(u8),
    #[error("the packed response is cut short")]
    Truncated,
    #[error("written with compression dictionary {0}, which is not configured")]
    MissingDictionary(DictionaryId),
    #[error("the compressed response declares {0} bytes, over the {1}-byte ceiling")]
    TooLarge(u64, usize),
    #[error("the compressed response does not decompress: {0}")]
    Zstd(&'static str),
    #[error("the packed response is corrupt: {0}")]
    Corrupt(String),
}

/// Packs and unpacks stored responses (see the module docs).
#[derive(Debug)]
pub struct Packer {
    /// Whether packing compresses (`store.compression = "zstd"`); unpacking
    /// reads every layout either way.
    compress: bool,
    /// The dictionary new records are compressed with.
    dictionary: Option<Dictionary>,
    /// Dictionaries kept only to read records written with them.
    previous: Vec<Dictionary>,
    /// The most a compressed payload may declare (`Unpack` allocates it).
    max_unpacked: usize,
}

thread_local! {
    /// One compression and one decompression context per thread: a context
    /// holds zstd's tables (hundreds of KiB), which a one-shot call would
    /// otherwise allocate and clear per record. `None` when zstd could not
    /// allocate one, which packing survives by storing the response plain.
    static COMPRESSOR: RefCell<Option<CCtx<'static>>> = RefCell::new(compressor());
    static DECOMPRESSOR: RefCell<Option<DCtx<'static>>> = RefCell::new(DCtx::try_create());
}

fn compressor() -> Option<CCtx<'static>> {
    let mut context = CCtx::try_create()?;
    for parameter in [
        CParameter::CompressionLevel(LEVEL),
        CParameter::ChecksumFlag(true),
        CParameter::ContentSizeFlag(true),
        CParameter::DictIdFlag(false),
    ] {
        context.set_parameter(parameter).ok()?;
    }
    Some(context)
}

impl Packer {
    /// `compress`: whether new records are compressed; `dictionary`: with
    /// what; `previous`: dictionaries only read. Unpacking allocates at most
    /// `max_unpacked` bytes per record.
    pub fn new(
        compress: bool,
        dictionary: Option<Dictionary>,
        previous: Vec<Dictionary>,
        max_unpacked: usize,
    ) -> Self {
        Self {
            compress,
            dictionary,
            previous,
            max_unpacked,
        }
    }

    /// Whether packing compresses.
    pub fn compresses(&self) -> bool {
        self.compress
    }

    /// `response` in the packed layout: compressed (with the configured
    /// dictionary, if any) when that is shorter.
    pub fn pack(&self, response: &StoredResponse) -> Bytes {
        self.pack_with(response, self.dictionary.as_ref())
    }

    /// [`Packer::pack`] with `dictionary` instead of the configured one:
    /// one the proxy learned.
    pub fn pack_with(&self, response: &StoredResponse, dictionary: Option<&Dictionary>) -> Bytes {
        let plain = payload_after(response, vec![LAYOUT_PLAIN]);
        let payload = plain.get(1..).unwrap_or_default();
        let least = match dictionary {
            Some(_) => MIN_COMPRESSED_WITH_DICTIONARY,
            None => MIN_COMPRESSED,
        };
        if self.compress && payload.len() >= least && worth_compressing(response) {
            if let Some(compressed) = compressed(payload, dictionary) {
                if compressed.len() < plain.len() {
                    return Bytes::from(compressed);
                }
            }
        }
        Bytes::from(plain)
    }

    /// The response `packed` holds. A plain payload's header values and
    /// body are slices of `packed`; a compressed one's, of one buffer it
    /// decompresses into.
    pub fn unpack(&self, packed: &Bytes) -> Result<StoredResponse, UnpackError> {
        self.unpack_with(packed, |_| None)
    }

    /// [`Packer::unpack`], asking `learned` for a dictionary the record
    /// names that is not configured.
    pub fn unpack_with(
        &self,
        packed: &Bytes,
        learned: impl FnOnce(DictionaryId) -> Option<Arc<Dictionary>>,
    ) -> Result<StoredResponse, UnpackError> {
        let (&layout, rest) = packed.split_first().ok_or(UnpackError::Truncated)?;
        match layout {
            LAYOUT_PLAIN => read_payload(&packed.slice_ref(rest)),
            LAYOUT_ZSTD => read_payload(&self.decompressed(rest, None)?),
            LAYOUT_ZSTD_DICTIONARY => {
                let id = rest
                    .get(..DictionaryId::LEN)
                    .and_then(DictionaryId::from_slice)
                    .ok_or(UnpackError::Truncated)?;
                let frame = rest.get(DictionaryId::LEN..).unwrap_or_default();
                if let Some(dictionary) = self.configured(id) {
                    return read_payload(&self.decompressed(frame, Some(dictionary))?);
                }
                let dictionary = learned(id).ok_or(UnpackError::MissingDictionary(id))?;
                read_payload(&self.decompressed(frame, Some(&dictionary))?)
            }
            other => Err(UnpackError::UnknownLayout(other)),
        }
    }

    /// The configured dictionary (current or previous) whose id is `id`.
    pub fn configured(&self, id: DictionaryId) -> Option<&Dictionary> {
        self.dictionary
            .iter()
            .chain(&self.previous)
            .find(|d| d.id() == id)
    }

    /// Whether new records are compressed with a configured dictionary.
    pub fn has_dictionary(&self) -> bool {
        self.dictionary.is_some()
    }

    fn decompressed(
        &self,
        frame: &[u8],
        dictionary: Option<&Dictionary>,
    ) -> Result<Bytes, UnpackError> {
        let declared = zstd_safe::get_frame_content_size(frame)
            .map_err(|_| UnpackError::Zstd("no frame header"))?
            .ok_or(UnpackError::Zstd("the frame declares no size"))?;
        let len = usize::try_from(declared)
            .ok()
            .filter(|len| *len <= self.max_unpacked)
            .ok_or(UnpackError::TooLarge(declared, self.max_unpacked))?;
        let mut out = Vec::with_capacity(len);
        DECOMPRESSOR.with_borrow_mut(|context| {
            let context = context
                .as_mut()
                .ok_or(UnpackError::Zstd("no decompression context"))?;
            let written = match dictionary {
                Some(dictionary) => {
                    context.decompress_using_ddict(&mut out, frame, dictionary.decompression())
                }
                None => context.decompress(&mut out, frame),
            };
            written.map_err(|code| UnpackError::Zstd(zstd_safe::get_error_name(code)))
        })?;
        if out.len() != len {
            return Err(UnpackError::Zstd("the frame is not its declared size"));
        }
        Ok(Bytes::from(out))
    }
}

/// `payload` compressed, with its layout byte (and dictionary id) first;
/// `None` if zstd failed, which leaves the payload stored plain.
fn compressed(payload: &[u8], dictionary: Option<&Dictionary>) -> Option<Vec<u8>> {
    let mut out =
        Vec::with_capacity(1 + DictionaryId::LEN + zstd_safe::compress_bound(payload.len()));
    match dictionary {
        Some(dictionary) => {
            out.push(LAYOUT_ZSTD_DICTIONARY);
            out.extend_from_slice(dictionary.id().as_bytes());
        }
        None => out.push(LAYOUT_ZSTD),
    }
    let start = out.len() as u64;
    COMPRESSOR.with_borrow_mut(|context| {
        let context = context.as_mut()?;
        let mut frame = std::io::Cursor::new(&mut out);
        frame.set_position(start);
        let written = match dictionary {
            Some(dictionary) => {
                // Referenced for this frame only: the context outlives
                // any one store, its dictionary must not.
                context.ref_cdict(dictionary.compression()).ok()?;
                let written = context.compress2(&mut frame, payload);
                context.disable_dictionary().ok()?;
                written
            }
            None => context.compress2(&mut frame, payload),
        };
        written.ok()
    })?;
    Some(out)
}

/// Whether zstd may gain on `response`: not when it says its body is
/// compressed already (`content-encoding`), so that is never tried.
pub fn worth_compressing(response: &StoredResponse) -> bool {
    !response
        .headers
        .iter()
        .any(|(name, value)| name == "content-encoding" && value.as_ref() != b"identity")
}

/// What `payload` takes compressed with `dictionary` (its length when zstd
/// fails): how a learned dictionary is judged.
pub fn compressed_len(payload: &[u8], dictionary: &Dictionary) -> usize {
    compressed(payload, Some(dictionary)).map_or(payload.len(), |packed| packed.len())
}

/// The dictionary `packed` was compressed with, if it names one.
pub fn dictionary_of(packed: &[u8]) -> Option<DictionaryId> {
    match packed.split_first() {
        Some((&LAYOUT_ZSTD_DICTIONARY, rest)) => rest
            .get(..DictionaryId::LEN)
            .and_then(DictionaryId::from_slice),
        _ => None,
    }
}

/// What packing compresses: `response` as the payload (see the module
/// docs). Dictionaries are trained on these.
pub fn payload(response: &StoredResponse) -> Vec<u8> {
    payload_after(response, Vec::new())
}

/// [`payload`], appended to `out`.
fn payload_after(response: &StoredResponse, mut out: Vec<u8>) -> Vec<u8> {
    let view = PayloadRef {
        status: response.status,
        headers: PayloadHeaders(&response.headers),
        body: &response.body,
    };
    let headers: usize = response
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + 4)
        .sum();
    out.reserve(16 + headers + response.body.len());
    // Serializing plain data into a Vec cannot fail.
    postcard::to_extend(&view, out).unwrap_or_default()
}

/// The response in `payload`, its values slices of it.
fn read_payload(payload: &Bytes) -> Result<StoredResponse, UnpackError> {
    let view: PayloadView<'_> =
        postcard::from_bytes(payload).map_err(|e| UnpackError::Corrupt(e.to_string()))?;
    let mut headers = Vec::with_capacity(view.headers.len());
    for (name, value) in view.headers {
        let name = name
            .text()
            .ok_or_else(|| UnpackError::Corrupt("an unknown header name index".into()))?;
        headers.push((name.to_owned(), payload.slice_ref(value)));
    }
    Ok(StoredResponse {
        status: view.status,
        headers,
        body: payload.slice_ref(view.body),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JSON API response as upstreams send it: `body` with a content
    /// type, a date, an unknown header and an empty value.
    fn response(body: &[u8]) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                (
                    "content-type".into(),
                    Bytes::from_static(b"application/json"),
                ),
                (
                    "date".into(),
                    Bytes::from_static(b"Thu, 03 Dec 2026 09:21:51 GMT"),
                ),
                ("x-upstream-shard".into(), Bytes::from_static(b"eu-7")),
                ("x-empty".into(), Bytes::new()),
                ("content-type".into(), Bytes::from_static(b"second")),
            ],
            body: Bytes::copy_from_slice(body),
        }
    }

    fn payment(i: u32) -> Vec<u8> {
        format!(
            r#"{{"id":"pi_{i:024}","object":"payment_intent","amount":{},"currency":"usd","status":"succeeded","customer":"cus_{:014}","metadata":{{"order_id":"{}"}},"shipping":{{"address":{{"city":"Portland","country":"US","line1":"{} Main St","postal_code":"97214"}},"name":"Jane Doe"}},"livemode":true,"payment_method_types":["card"]}}"#,
            499 + i * 7,
            i * 7919,
            100_000 + i,
            i % 9000
        )
        .into_bytes()
    }

    fn raw_dictionary() -> Dictionary {
        Dictionary::new(&payment(0).repeat(4)).expect("raw content is a dictionary")
    }

    fn packer(compress: bool, dictionary: Option<Dictionary>) -> Packer {
        Packer::new(compress, dictionary, Vec::new(), 1 << 20)
    }

    #[test]
    fn every_layout_round_trips_headers_in_order_and_the_body() {
        let json = payment(1);
        let binary: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        for body in [&b""[..], b"{}", &json, &binary] {
            let original = response(body);
            for (packer, layouts) in [
                (packer(false, None), &[LAYOUT_PLAIN][..]),
                (packer(true, None), &[LAYOUT_PLAIN, LAYOUT_ZSTD][..]),
                (
                    packer(true, Some(raw_dictionary())),
                    &[LAYOUT_ZSTD_DICTIONARY, LAYOUT_PLAIN][..],
                ),
            ] {
                let packed = packer.pack(&original);
                assert!(layouts.contains(&packed[0]), "layout {}", packed[0]);
                assert_eq!(packer.unpack(&packed).as_ref(), Ok(&original));
            }
        }
    }

    #[test]
    fn json_is_compressed_and_a_dictionary_compresses_it_further() {
        let original = response(&payment(42));
        let plain = packer(false, None).pack(&original);
        let zstd = packer(true, None).pack(&original);
        let dictionary = packer(true, Some(raw_dictionary())).pack(&original);
        assert_eq!((plain[0], zstd[0], dictionary[0]), (1, 2, 3));
        assert!(zstd.len() < plain.len(), "{} < {}", zstd.len(), plain.len());
        assert!(
            dictionary.len() * 2 < zstd.len(),
            "{} vs {}",
            dictionary.len(),
            zstd.len()
        );
        // Known names cost their index; the plain layout is still shorter
        // than the record codec's own encoding of the response.
        assert!(plain.len() + 20 < original.encode().len());
    }

    #[test]
    fn small_or_incompressible_payloads_stay_plain() {
        let packer = packer(true, None);
        assert_eq!(packer.pack(&response(b"{}"))[0], LAYOUT_PLAIN);
        let mut noise = vec![0u8; 2000];
        let mut x = 0x2545_f491_u32;
        for byte in &mut noise {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *byte = x as u8;
        }
        assert_eq!(packer.pack(&response(&noise))[0], LAYOUT_PLAIN);
    }

    #[test]
    fn an_encoded_body_is_stored_plain_without_trying_zstd() {
        let mut encoded = response(&payment(5));
        encoded
            .headers
            .push(("content-encoding".into(), Bytes::from_static(b"gzip")));
        for packer in [packer(true, None), packer(true, Some(raw_dictionary()))] {
            assert_eq!(packer.pack(&encoded)[0], LAYOUT_PLAIN);
        }
    }

    #[test]
    fn a_record_names_the_dictionary_it_needs_and_a_learned_one_reads_it() {
        let learned = raw_dictionary();
        let id = learned.id();
        let original = response(&payment(11));
        let packed = packer(true, None).pack_with(&original, Some(&learned));
        assert_eq!(dictionary_of(&packed), Some(id));
        assert_eq!(dictionary_of(&packer(true, None).pack(&original)), None);
        let reader = packer(true, None);
        assert_eq!(
            reader.unpack(&packed),
            Err(UnpackError::MissingDictionary(id))
        );
        let shared = Arc::new(learned);
        let found = reader.unpack_with(&packed, |wanted| (wanted == id).then(|| shared.clone()));
        assert_eq!(found.as_ref(), Ok(&original));
    }

    #[test]
    fn the_plain_layout_is_the_payload_dictionaries_are_trained_on() {
        let original = response(&payment(4));
        let packed = packer(false, None).pack(&original);
        assert_eq!(packed[1..], payload(&original)[..]);
    }

    #[test]
    fn a_plain_payload_is_read_in_place() {
        let packed = packer(false, None).pack(&response(b"{\"in\":\"place\"}"));
        let unpacked = packer(false, None).unpack(&packed).expect("unpacks");
        let range = packed.as_ptr_range();
        assert!(
            range.contains(&unpacked.body.as_ptr()),
            "the body was copied"
        );
    }

    #[test]
    fn records_name_their_dictionary_and_previous_ones_still_read() {
        let old = raw_dictionary();
        let old_id = old.id();
        let new = Dictionary::new(&payment(7).repeat(3)).expect("dictionary");
        assert_ne!(old_id, new.id());
        let original = response(&payment(3));
        let packed = packer(true, Some(old)).pack(&original);
        assert_eq!(&packed[1..5], old_id.as_bytes());

        let without = packer(true, Some(new));
        assert_eq!(
            without.unpack(&packed),
            Err(UnpackError::MissingDictionary(old_id))
        );
        let rotated = Packer::new(
            true,
            Some(Dictionary::new(&payment(7).repeat(3)).expect("dictionary")),
            vec![raw_dictionary()],
            1 << 20,
        );
        assert_eq!(rotated.unpack(&packed).as_ref(), Ok(&original));
        // Compression off still reads what a dictionary compressed.
        let off = Packer::new(false, None, vec![raw_dictionary()], 1 << 20);
        assert_eq!(off.unpack(&packed).as_ref(), Ok(&original));
    }

    #[test]
    fn corruption_is_an_error_never_another_response() {
        let original = response(&payment(9));
        for packer in [packer(true, None), packer(true, Some(raw_dictionary()))] {
            let packed = packer.pack(&original);
            assert_ne!(packed[0], LAYOUT_PLAIN);
            // Every single flipped bit after the layout byte and id: the
            // frame header, the compressed blocks, the checksum.
            let start = if packed[0] == LAYOUT_ZSTD { 1 } else { 5 };
            let mut unread_bits = 0;
            for at in start..packed.len() {
                for bit in 0..8 {
                    let mut bytes = packed.to_vec();
                    bytes[at] ^= 1 << bit;
                    match packer.unpack(&Bytes::from(bytes)) {
                        Err(_) => {}
                        // A bit zstd does not read (the frame header's
                        // unused one, padding in a block): the same bytes.
                        Ok(same) if same == original => unread_bits += 1,
                        Ok(other) => panic!("byte {at} bit {bit}: {other:?}"),
                    }
                }
            }
            assert!(unread_bits <= 8, "{unread_bits} flipped bits read back");
            for cut in 0..packed.len() {
                assert!(packer.unpack(&packed.slice(..cut)).is_err(), "cut at {cut}");
            }
        }
        assert_eq!(
            packer(true, None).unpack(&Bytes::from_static(&[9, 1, 2])),
            Err(UnpackError::UnknownLayout(9))
        );
    }

    #[test]
    fn a_declared_size_over_the_ceiling_is_refused_before_allocating() {
        let big = response(&vec![b'a'; 100_000]);
        let packed = packer(true, None).pack(&big);
        assert_eq!(packed[0], LAYOUT_ZSTD);
        let small = Packer::new(true, None, Vec::new(), 50_000);
        assert!(matches!(
            small.unpack(&packed),
            Err(UnpackError::TooLarge(n, 50_000)) if n > 100_000
        ));
    }

    #[test]
    fn known_names_are_unique_and_lower_case() {
        let mut seen = std::collections::HashSet::new();
        for name in KNOWN_NAMES {
            assert!(seen.insert(name), "{name} twice");
            assert_eq!(name, name.to_ascii_lowercase());
            assert!(http::HeaderName::from_static(name).as_str() == name);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Whatever a store hands back, unpacking returns, never panics.
        #[test]
        fn any_bytes_unpack_or_fail_without_panicking(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            layout in 0u8..5,
        ) {
            let packer = Packer::new(true, Some(raw_dictionary()), Vec::new(), 1 << 20);
            let mut bytes = bytes;
            if let Some(first) = bytes.first_mut() {
                *first = layout;
            }
            let _ = packer.unpack(&Bytes::from(bytes));
        }
    }
}
