//! The packed layout of stored responses (crates/idemproxy-core/src/packed/): what
//! a store hands back is bytes anyone with access to Redis or the data file
//! could have written, zstd frames included, so unpacking must report,
//! never panic, and never allocate past its ceiling.
//!
//! - `Packer::unpack` never panics, whatever the layout byte, dictionary
//!   id, frame header (a declared size over the ceiling is refused before
//!   anything is allocated) or compressed blocks;
//! - what unpacks packs again, with and without the dictionary and with
//!   compression off, into bytes that unpack to the same response.

#![no_main]

use std::sync::OnceLock;

use bytes::Bytes;
use idemproxy_core::packed::{Dictionary, Packer};
use libfuzzer_sys::fuzz_target;

/// The ceiling on what a frame may declare: small, so that a frame
/// declaring more is exercised often.
const MAX_UNPACKED: usize = 64 * 1024;

/// Raw-content dictionary (zstd accepts any bytes as one): JSON.
const DICTIONARY: &[u8] = br#"{"id":"pay_0001","object":"payment","amount":4999,"currency":"usd","status":"succeeded","metadata":{"order_id":"100482"},"created":1764758400,"livemode":true}"#;

fn packers() -> &'static [Packer; 3] {
    static PACKERS: OnceLock<[Packer; 3]> = OnceLock::new();
    PACKERS.get_or_init(|| {
        let dictionary = || Dictionary::new(DICTIONARY).expect("a raw-content dictionary");
        [
            Packer::new(true, Some(dictionary()), Vec::new(), MAX_UNPACKED),
            Packer::new(true, None, vec![dictionary()], MAX_UNPACKED),
            Packer::new(false, None, vec![dictionary()], MAX_UNPACKED),
        ]
    })
}

fuzz_target!(|data: &[u8]| {
    let packers = packers();
    let Ok(response) = packers[0].unpack(&Bytes::copy_from_slice(data)) else {
        return;
    };
    for packer in packers {
        let packed = packer.pack(&response);
        for reader in packers {
            assert_eq!(
                reader.unpack(&packed).as_ref(),
                Ok(&response),
                "a packed response does not unpack to itself"
            );
        }
    }
});
