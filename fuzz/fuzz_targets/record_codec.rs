//! The record codec (crates/idemproxy-core/src/core/record.rs): what a store hands back is bytes
//! anyone with access to Redis or the data file could have written, so
//! decoding must report, never panic.
//!
//! - `Record::decode` and `Record::decode_shared` never panic, and agree
//!   (they differ only in how the stored bytes are held);
//! - a decoded record encodes to bytes that decode to an equal record
//!   (`Record: PartialEq`), and encoding is then a fixed point: postcard
//!   may accept more than one spelling of a record (trailing bytes), but
//!   writes exactly one;
//! - an encoding fits the buffer sized for it (`encoded_len_max`,
//!   `PendingRecord::ENCODED_LEN_MAX`), and `CompletedRecord::encode` /
//!   `PendingRecord::encode` write what `Record::encode` writes;
//! - `StoredResponse::decode` (the layout of a sealed response once opened:
//!   the record codec without the version byte) never panics, on the input
//!   itself and on a decoded record's sealed bytes, and round-trips the
//!   same way; a stored response encodes and decodes to itself.

#![no_main]

use bytes::Bytes;
use idemproxy_core::core::{
    DecodeError, Outcome, PendingRecord, Record, StoredResponse, FORMAT_VERSION,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check_response(data);
    let decoded = Record::decode(data);
    let shared = Record::decode_shared(&Bytes::copy_from_slice(data));
    assert_eq!(decoded, shared, "decode and decode_shared disagree");

    // Errors say which kind of bad the bytes are.
    match &decoded {
        Err(DecodeError::Empty) => assert!(data.is_empty()),
        Err(DecodeError::UnknownVersion(v)) => {
            assert_eq!(data.first(), Some(v));
            assert_ne!(*v, FORMAT_VERSION);
        }
        Err(e) => {
            assert_eq!(data.first(), Some(&FORMAT_VERSION), "{e}");
            assert!(!e.to_string().is_empty());
        }
        Ok(_) => assert_eq!(data.first(), Some(&FORMAT_VERSION)),
    }

    let Ok(record) = decoded else {
        return;
    };
    let encoded = record.encode();
    assert_eq!(encoded.first(), Some(&FORMAT_VERSION));
    assert!(encoded.len() <= data.len(), "re-encoding grew the record");
    let again = Record::decode(&encoded).expect("an encoded record decodes");
    assert_eq!(again, record, "round trip changed the record");
    assert_eq!(again.encode(), encoded, "encoding is not a fixed point");
    let again_shared =
        Record::decode_shared(&Bytes::from(encoded.clone())).expect("an encoded record decodes");
    assert_eq!(again_shared, record);

    // The accessors are total.
    let _ = (
        record.fingerprint(),
        record.expires_at(),
        record.state().as_str(),
    );

    match &record {
        Record::Pending(pending) => {
            assert_eq!(pending.encode(), encoded);
            assert!(encoded.len() <= PendingRecord::ENCODED_LEN_MAX);
        }
        Record::Completed(completed) => {
            assert_eq!(completed.encode(), encoded);
            assert!(
                encoded.len() <= completed.encoded_len_max(),
                "{} > encoded_len_max {}",
                encoded.len(),
                completed.encoded_len_max()
            );
            // Appending after a frame writes the same bytes after it.
            let framed = completed.encode_after(b"frame".to_vec());
            assert_eq!(framed.get(..5), Some(&b"frame"[..]));
            assert_eq!(framed.get(5..), Some(&encoded[..]));
            match &completed.outcome {
                Outcome::Response(response) => {
                    let bytes = response.encode();
                    assert_eq!(StoredResponse::decode(&bytes).as_ref(), Ok(response));
                }
                Outcome::Sealed(sealed) => check_response(sealed),
                _ => {}
            }
        }
    }
});

/// `StoredResponse::decode` on any bytes: no panic, and what it accepts
/// re-encodes to a fixed point no longer than the input.
fn check_response(bytes: &[u8]) {
    let Ok(response) = StoredResponse::decode(bytes) else {
        return;
    };
    let encoded = response.encode();
    assert!(
        encoded.len() <= bytes.len(),
        "re-encoding grew the response"
    );
    let again = StoredResponse::decode(&encoded).expect("an encoded response decodes");
    assert_eq!(again, response, "round trip changed the response");
    assert_eq!(again.encode(), encoded, "encoding is not a fixed point");
}
