//! What the store keeps per (scope, key): a pending claim while the first
//! request runs, then the completed outcome every retry is answered from.
//!
//! Records are encoded compactly and versioned: one leading format byte, then
//! a postcard body. Bodies are stored as raw bytes. Decoding an unknown version
//! or a corrupt value is an error, never a panic, so a store can report it.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::clock::UnixMillis;
use super::ids::{FencingToken, Fingerprint};

/// The leading byte of every encoded record. Bump it when the layout changes;
/// old versions must then be decoded explicitly or reported as unknown.
pub const FORMAT_VERSION: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Record {
    Pending(PendingRecord),
    Completed(CompletedRecord),
}

/// [`Record`] by reference, serialized exactly like it (postcard writes a
/// variant's index, not the enum's name): stores are handed a completion by
/// reference and encode it without cloning its headers and body first.
#[derive(Serialize)]
enum RecordRef<'a> {
    Pending(&'a PendingRecord),
    Completed(&'a CompletedRecord),
}

impl RecordRef<'_> {
    /// Appends the encoding to `out`, so a store that frames records (Redis
    /// puts a header first) writes them without a second buffer.
    fn encode_after(&self, mut out: Vec<u8>) -> Vec<u8> {
        out.push(FORMAT_VERSION);
        // Serializing plain data into a Vec cannot fail.
        postcard::to_extend(self, out).unwrap_or_default()
    }
}

/// Bytes of a postcard varint holding `n`.
fn varint_len(n: usize) -> usize {
    // usize is at most 64 bits on every supported target.
    (usize::BITS - n.leading_zeros()).max(1).div_ceil(7) as usize
}

/// The most a `u64` varint takes.
const VARINT_MAX: usize = 10;

/// The format version, the record's variant and the fingerprint, then
/// three instants: what every encoding starts with, at most.
const ENCODED_PREFIX_MAX: usize = 1 + 1 + 32 + 3 * VARINT_MAX;

impl CompletedRecord {
    /// The bytes of `Record::Completed(self)`, without building it.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_after(Vec::with_capacity(self.encoded_len_max()))
    }

    /// At most how long the encoding is, and at most 12 bytes more (the
    /// instants counted at their longest): an encoding written into a
    /// buffer this large never reallocates (postcard's `to_extend` grows a
    /// `Vec` from empty about six times per record), and the buffer wastes
    /// little when kept.
    pub fn encoded_len_max(&self) -> usize {
        let outcome = match &self.outcome {
            Outcome::Response(response) => {
                let headers: usize = response
                    .headers
                    .iter()
                    .map(|(name, value)| {
                        varint_len(name.len()) + name.len() + varint_len(value.len()) + value.len()
                    })
                    .sum();
                // Status, the header count, the body's length and bytes.
                varint_len(usize::from(response.status))
                    + varint_len(response.headers.len())
                    + headers
                    + varint_len(response.body.len())
                    + response.body.len()
            }
            Outcome::NotStored { status } => varint_len(usize::from(*status)),
            // The cause's variant.
            Outcome::Unknown { .. } => 1,
            Outcome::Sealed(bytes) | Outcome::Packed(bytes) => {
                varint_len(bytes.len()) + bytes.len()
            }
        };
        ENCODED_PREFIX_MAX + 1 + outcome
    }

    /// [`CompletedRecord::encode`], appended to `out`.
    pub fn encode_after(&self, out: Vec<u8>) -> Vec<u8> {
        RecordRef::Completed(self).encode_after(out)
    }
}

impl PendingRecord {
    /// The most a claim's encoding takes: the common prefix and a fencing
    /// token (a u128 varint).
    pub const ENCODED_LEN_MAX: usize = ENCODED_PREFIX_MAX + 19;

    /// The bytes of `Record::Pending(self)`, without building it.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_after(Vec::with_capacity(Self::ENCODED_LEN_MAX))
    }

    /// [`PendingRecord::encode`], appended to `out`.
    pub fn encode_after(&self, out: Vec<u8>) -> Vec<u8> {
        RecordRef::Pending(self).encode_after(out)
    }
}

impl Record {
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::Pending(p) => &p.fingerprint,
            Record::Completed(c) => &c.fingerprint,
        }
    }

    /// When the request that made the record claimed its key.
    pub fn created_at(&self) -> UnixMillis {
        match self {
            Record::Pending(p) => p.created_at,
            Record::Completed(c) => c.created_at,
        }
    }

    /// When the store may forget the record.
    pub fn expires_at(&self) -> UnixMillis {
        match self {
            Record::Pending(p) => p.expires_at,
            Record::Completed(c) => c.expires_at,
        }
    }

    pub fn state(&self) -> KeyState {
        match self {
            Record::Pending(_) => KeyState::Pending,
            Record::Completed(_) => KeyState::Completed,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            Record::Pending(p) => p.encode(),
            Record::Completed(c) => c.encode(),
        }
    }

    /// Decodes `bytes`, for a buffer the caller keeps (the memory store's
    /// map, a store's read transaction): a completion's stored header
    /// values and body are copied out of it in one piece, a copy of the
    /// whole encoding that they share, rather than one allocation per value
    /// (and one more per clone a replay takes). A claim carries no stored
    /// bytes and costs no copy.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let view = RecordView::read(bytes)?;
        if let RecordView::Pending(claim) = view {
            return Ok(Record::Pending(claim));
        }
        let copy = Bytes::copy_from_slice(bytes);
        Ok(view.into_record(|part| {
            // `part` lies within `bytes`: the same range of the copy.
            let start = (part.as_ptr() as usize).wrapping_sub(bytes.as_ptr() as usize);
            match copy.get(start..start.saturating_add(part.len())) {
                Some(same) => copy.slice_ref(same),
                None => Bytes::copy_from_slice(part),
            }
        }))
    }

    /// Decodes `bytes` without copying: the stored header values and body
    /// are slices of `bytes`, which they keep alive. A replay then hands the
    /// stored body to the client as it is, whatever its size (and clones of
    /// it, as the response takes them, count references instead of
    /// allocating).
    pub fn decode_shared(bytes: &Bytes) -> Result<Record, DecodeError> {
        Ok(RecordView::read(bytes)?.into_record(|part| bytes.slice_ref(part)))
    }
}

/// A record as postcard reads it, borrowing every string and byte string
/// from the encoding: the owned types' layout, field for field and variant
/// for variant (the round-trip tests hold the two together), so that
/// [`Record::decode`] and [`Record::decode_shared`] differ only in how the
/// borrowed bytes become `Bytes`.
#[derive(Deserialize)]
enum RecordView<'a> {
    Pending(PendingRecord),
    Completed(#[serde(borrow)] CompletedView<'a>),
}

#[derive(Deserialize)]
struct CompletedView<'a> {
    fingerprint: Fingerprint,
    created_at: UnixMillis,
    completed_at: UnixMillis,
    expires_at: UnixMillis,
    #[serde(borrow)]
    outcome: OutcomeView<'a>,
}

#[derive(Deserialize)]
enum OutcomeView<'a> {
    Response(#[serde(borrow)] ResponseView<'a>),
    NotStored { status: u16 },
    Unknown { cause: UnknownCause },
    Sealed(&'a [u8]),
    Packed(&'a [u8]),
}

#[derive(Deserialize)]
struct ResponseView<'a> {
    status: u16,
    #[serde(borrow)]
    headers: Vec<(&'a str, &'a [u8])>,
    body: &'a [u8],
}

impl<'a> RecordView<'a> {
    fn read(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        match bytes.split_first() {
            None => Err(DecodeError::Empty),
            Some((&FORMAT_VERSION, rest)) => {
                postcard::from_bytes(rest).map_err(|e| DecodeError::Corrupt(e.to_string()))
            }
            Some((&v, _)) => Err(DecodeError::UnknownVersion(v)),
        }
    }

    /// The owned record, with `bytes` making each stored byte string.
    fn into_record(self, bytes: impl Fn(&[u8]) -> Bytes) -> Record {
        let completed = match self {
            RecordView::Pending(claim) => return Record::Pending(claim),
            RecordView::Completed(completed) => completed,
        };
        let outcome = match completed.outcome {
            OutcomeView::Response(response) => Outcome::Response(StoredResponse {
                status: response.status,
                headers: response
                    .headers
                    .into_iter()
                    .map(|(name, value)| (name.to_owned(), bytes(value)))
                    .collect(),
                body: bytes(response.body),
            }),
            OutcomeView::NotStored { status } => Outcome::NotStored { status },
            OutcomeView::Unknown { cause } => Outcome::Unknown { cause },
            OutcomeView::Sealed(sealed) => Outcome::Sealed(bytes(sealed)),
            OutcomeView::Packed(packed) => Outcome::Packed(bytes(packed)),
        };
        Record::Completed(CompletedRecord {
            fingerprint: completed.fingerprint,
            created_at: completed.created_at,
            completed_at: completed.completed_at,
            expires_at: completed.expires_at,
            outcome,
        })
    }
}

/// What a listing of keys shows of a record: its state, instants and
/// outcome kind, read from the front of its encoding alone. The stored
/// response (headers, body; sealed or packed) is never read, so a listing
/// costs the same whatever the responses weigh, and lists what no
/// configured key opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordMeta {
    pub state: KeyState,
    pub fingerprint: Fingerprint,
    pub created_at: UnixMillis,
    pub expires_at: UnixMillis,
    /// A pending claim's lease.
    pub lease_expires_at: Option<UnixMillis>,
    /// A completion's instant and outcome kind.
    pub completed_at: Option<UnixMillis>,
    pub outcome: Option<OutcomeMeta>,
}

/// A completion's outcome as its encoding's front says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutcomeMeta {
    /// A response stored as it came: its status leads it.
    Response {
        status: u16,
    },
    NotStored {
        status: u16,
    },
    Unknown {
        cause: UnknownCause,
    },
    /// A response sealed, or packed: its status is inside.
    Sealed,
    Packed,
}

/// The front of an encoded record, as postcard reads it: the owned types'
/// layout up to the outcome's first field (a byte string's length is its
/// leading varint), so a prefix of the encoding is enough.
#[derive(Deserialize)]
enum RecordHead {
    Pending(PendingRecord),
    Completed(CompletedHead),
}

#[derive(Deserialize)]
struct CompletedHead {
    fingerprint: Fingerprint,
    created_at: UnixMillis,
    completed_at: UnixMillis,
    expires_at: UnixMillis,
    outcome: OutcomeHead,
}

#[derive(Deserialize)]
enum OutcomeHead {
    Response(ResponseHead),
    NotStored {
        status: u16,
    },
    Unknown {
        cause: UnknownCause,
    },
    #[allow(dead_code)]
    Sealed(u64),
    #[allow(dead_code)]
    Packed(u64),
}

#[derive(Deserialize)]
struct ResponseHead {
    status: u16,
}

impl RecordMeta {
    /// The longest front of an encoding [`RecordMeta::read`] needs: the
    /// common prefix, a claim's token or an outcome's variant and first
    /// varint.
    pub const ENCODED_FRONT_MAX: usize = ENCODED_PREFIX_MAX + 19 + 1 + VARINT_MAX;

    /// The metadata of the record whose encoding starts with `front` (the
    /// whole encoding, or at least its first
    /// [`ENCODED_FRONT_MAX`](Self::ENCODED_FRONT_MAX) bytes).
    pub fn read(front: &[u8]) -> Result<RecordMeta, DecodeError> {
        let head: RecordHead = match front.split_first() {
            None => return Err(DecodeError::Empty),
            Some((&FORMAT_VERSION, rest)) => postcard::take_from_bytes(rest)
                .map(|(head, _)| head)
                .map_err(|e| DecodeError::Corrupt(e.to_string()))?,
            Some((&v, _)) => return Err(DecodeError::UnknownVersion(v)),
        };
        Ok(match head {
            RecordHead::Pending(claim) => RecordMeta {
                state: KeyState::Pending,
                fingerprint: claim.fingerprint,
                created_at: claim.created_at,
                expires_at: claim.expires_at,
                lease_expires_at: Some(claim.lease_expires_at),
                completed_at: None,
                outcome: None,
            },
            RecordHead::Completed(done) => RecordMeta {
                state: KeyState::Completed,
                fingerprint: done.fingerprint,
                created_at: done.created_at,
                expires_at: done.expires_at,
                lease_expires_at: None,
                completed_at: Some(done.completed_at),
                outcome: Some(match done.outcome {
                    OutcomeHead::Response(response) => OutcomeMeta::Response {
                        status: response.status,
                    },
                    OutcomeHead::NotStored { status } => OutcomeMeta::NotStored { status },
                    OutcomeHead::Unknown { cause } => OutcomeMeta::Unknown { cause },
                    OutcomeHead::Sealed(_) => OutcomeMeta::Sealed,
                    OutcomeHead::Packed(_) => OutcomeMeta::Packed,
                }),
            },
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("empty record")]
    Empty,
    #[error("record format version {0} is unknown to this build")]
    UnknownVersion(u8),
    #[error("corrupt record: {0}")]
    Corrupt(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyState {
    Pending,
    Completed,
}

impl KeyState {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::Pending => "pending",
            KeyState::Completed => "completed",
        }
    }
}

/// The claim of the request that is executing the key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingRecord {
    pub fingerprint: Fingerprint,
    pub token: FencingToken,
    pub created_at: UnixMillis,
    /// Past this instant the holder is presumed dead (see `on_stale`).
    pub lease_expires_at: UnixMillis,
    /// Past this instant the store may forget the claim altogether.
    pub expires_at: UnixMillis,
}

/// The settled outcome of a key: every retry is answered from it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CompletedRecord {
    pub fingerprint: Fingerprint,
    pub created_at: UnixMillis,
    pub completed_at: UnixMillis,
    pub expires_at: UnixMillis,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// The upstream's response, stored whole.
    Response(StoredResponse),
    /// The upstream answered, but the body was over `max_response_bytes` (or
    /// broke off): only its status is known.
    NotStored { status: u16 },
    /// The request may or may not have executed: stored so that no retry can
    /// execute it a second time.
    Unknown { cause: UnknownCause },
    /// A [`StoredResponse`] encrypted at rest (`store.encryption_keys_env`):
    /// opaque bytes to every store, opened by the store wrapper that sealed
    /// it. After the first three, so that they keep their encoding.
    Sealed(Bytes),
    /// A [`StoredResponse`] in the packed layout (`store.compression`:
    /// compact headers, the whole compressed with zstd, optionally with a
    /// dictionary): opaque bytes to every store, unpacked by the store
    /// wrapper that packed it (`store::compression`). Last, so that every
    /// variant before it keeps its encoding: records written before packing
    /// existed still read.
    Packed(Bytes),
}

impl StoredResponse {
    /// The response alone, in the record codec's layout: what is sealed.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data into a Vec cannot fail.
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// The inverse of [`StoredResponse::encode`].
    pub fn decode(bytes: &[u8]) -> Result<StoredResponse, DecodeError> {
        let view: ResponseView<'_> =
            postcard::from_bytes(bytes).map_err(|e| DecodeError::Corrupt(e.to_string()))?;
        Ok(StoredResponse {
            status: view.status,
            headers: view
                .headers
                .into_iter()
                .map(|(name, value)| (name.to_owned(), Bytes::copy_from_slice(value)))
                .collect(),
            body: Bytes::copy_from_slice(view.body),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownCause {
    /// The upstream did not answer within `upstream.timeout`.
    Timeout,
    /// The connection broke after the request was sent.
    Reset,
    /// The proxy that held the key died (its lease expired).
    Abandoned,
}

impl UnknownCause {
    /// The status the client sees for this cause.
    pub fn status(self) -> u16 {
        match self {
            UnknownCause::Timeout => 504,
            UnknownCause::Reset | UnknownCause::Abandoned => 502,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            UnknownCause::Timeout => "timeout",
            UnknownCause::Reset => "reset",
            UnknownCause::Abandoned => "abandoned",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StoredResponse {
    pub status: u16,
    /// End-to-end headers only, in upstream order (names lower-case).
    pub headers: Vec<(String, Bytes)>,
    pub body: Bytes,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::clock::now_millis;

    #[test]
    fn metadata_reads_from_the_front_of_an_encoding_alone() {
        let now = now_millis();
        let claim = PendingRecord {
            fingerprint: Fingerprint([9; 32]),
            token: FencingToken(u128::MAX),
            created_at: now,
            lease_expires_at: now + 30_000,
            expires_at: u64::MAX,
        };
        let done = |outcome| CompletedRecord {
            fingerprint: Fingerprint([4; 32]),
            created_at: now,
            completed_at: now + 5,
            expires_at: u64::MAX - 1,
            outcome,
        };
        let big = Bytes::from(vec![b'x'; 100_000]);
        let cases = [
            (Record::Pending(claim.clone()), None),
            (
                Record::Completed(done(Outcome::Response(StoredResponse {
                    status: 201,
                    headers: vec![("a".into(), Bytes::from_static(b"b"))],
                    body: big.clone(),
                }))),
                Some(OutcomeMeta::Response { status: 201 }),
            ),
            (
                Record::Completed(done(Outcome::NotStored { status: 502 })),
                Some(OutcomeMeta::NotStored { status: 502 }),
            ),
            (
                Record::Completed(done(Outcome::Unknown {
                    cause: UnknownCause::Timeout,
                })),
                Some(OutcomeMeta::Unknown {
                    cause: UnknownCause::Timeout,
                }),
            ),
            (
                Record::Completed(done(Outcome::Sealed(big.clone()))),
                Some(OutcomeMeta::Sealed),
            ),
            (
                Record::Completed(done(Outcome::Packed(big))),
                Some(OutcomeMeta::Packed),
            ),
        ];
        for (record, outcome) in cases {
            let encoded = record.encode();
            let front = &encoded[..encoded.len().min(RecordMeta::ENCODED_FRONT_MAX)];
            let meta = RecordMeta::read(front).expect("reads from the front");
            assert_eq!(meta, RecordMeta::read(&encoded).expect("whole"));
            assert_eq!(meta.outcome, outcome);
            assert_eq!(meta.state, record.state());
            assert_eq!(meta.created_at, record.created_at());
            assert_eq!(meta.expires_at, record.expires_at());
            assert_eq!(&meta.fingerprint, record.fingerprint());
        }
        assert_eq!(RecordMeta::read(&[]), Err(DecodeError::Empty));
        assert_eq!(
            RecordMeta::read(&[7, 0]),
            Err(DecodeError::UnknownVersion(7))
        );
        assert!(matches!(
            RecordMeta::read(&[FORMAT_VERSION, 1, 2]),
            Err(DecodeError::Corrupt(_))
        ));
    }

    #[test]
    fn encodings_fit_the_buffer_sized_for_them() {
        let now = now_millis();
        let response = |headers: usize, body: usize| {
            Outcome::Response(StoredResponse {
                status: 201,
                headers: (0..headers)
                    .map(|i| (format!("x-header-{i}"), Bytes::from(vec![b'v'; i * 37])))
                    .collect(),
                body: Bytes::from(vec![b'b'; body]),
            })
        };
        let mut outcomes = vec![
            Outcome::NotStored { status: 502 },
            Outcome::Unknown {
                cause: UnknownCause::Abandoned,
            },
        ];
        for len in [0, 1, 127, 128, 70_000] {
            outcomes.push(Outcome::Sealed(Bytes::from(vec![b's'; len])));
            outcomes.push(Outcome::Packed(Bytes::from(vec![b'p'; len])));
        }
        for (headers, body) in [(0, 0), (1, 1), (4, 35), (12, 127), (3, 128), (40, 70_000)] {
            outcomes.push(response(headers, body));
        }
        for (i, outcome) in outcomes.into_iter().enumerate() {
            let record = CompletedRecord {
                fingerprint: Fingerprint([9; 32]),
                created_at: now,
                completed_at: now + 5,
                expires_at: now + 86_400_000,
                outcome,
            };
            let bytes = record.encode();
            let max = record.encoded_len_max();
            assert!(bytes.len() <= max, "{i}: {} > {max}", bytes.len());
            // Only the instants are counted at their longest (10 bytes
            // each, 6 for today's milliseconds).
            assert!(max - bytes.len() <= 3 * 4, "{i}: {} for {max}", bytes.len());
            assert_eq!(bytes.capacity(), max, "{i}: the buffer grew");
            assert_eq!(Record::decode(&bytes), Ok(Record::Completed(record)));
        }
        for token in [0, 1, u128::MAX] {
            let claim = PendingRecord {
                fingerprint: Fingerprint([1; 32]),
                token: FencingToken(token),
                created_at: u64::MAX,
                lease_expires_at: u64::MAX,
                expires_at: u64::MAX,
            };
            let bytes = claim.encode();
            assert!(bytes.len() <= PendingRecord::ENCODED_LEN_MAX);
            assert_eq!(bytes.capacity(), PendingRecord::ENCODED_LEN_MAX);
        }
    }

    fn completed() -> Record {
        with_response(StoredResponse {
            status: 201,
            headers: vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            body: Bytes::from_static(b"{\"id\":1}"),
        })
    }

    fn with_response(response: StoredResponse) -> Record {
        Record::Completed(CompletedRecord {
            fingerprint: Fingerprint([7; 32]),
            created_at: 1,
            completed_at: 2,
            expires_at: 3,
            outcome: Outcome::Response(response),
        })
    }

    fn pending(token: u128) -> Record {
        Record::Pending(PendingRecord {
            fingerprint: Fingerprint([1; 32]),
            token: FencingToken(token),
            created_at: 10,
            lease_expires_at: 20,
            expires_at: 30,
        })
    }

    #[test]
    fn encoding_round_trips_every_variant() {
        let pending = pending(u128::MAX - 5);
        let unknown = Record::Completed(CompletedRecord {
            fingerprint: Fingerprint([2; 32]),
            created_at: 1,
            completed_at: 2,
            expires_at: 3,
            outcome: Outcome::Unknown {
                cause: UnknownCause::Timeout,
            },
        });
        let not_stored = Record::Completed(CompletedRecord {
            fingerprint: Fingerprint([3; 32]),
            created_at: 1,
            completed_at: 2,
            expires_at: 3,
            outcome: Outcome::NotStored { status: 200 },
        });
        for record in [pending, completed(), unknown, not_stored] {
            assert_eq!(Record::decode(&record.encode()).as_ref(), Ok(&record));
            // Encoded by reference, yet the owned enum's own serialization:
            // what stores already hold stays readable.
            let mut owned = vec![FORMAT_VERSION];
            owned.extend(postcard::to_stdvec(&record).expect("serializes"));
            assert_eq!(record.encode(), owned);
            match &record {
                Record::Completed(c) => assert_eq!(c.encode(), owned),
                Record::Pending(p) => assert_eq!(p.encode(), owned),
            }
        }
    }

    #[test]
    fn shared_decoding_reads_the_same_records_and_copies_no_stored_bytes() {
        let large = with_response(StoredResponse {
            status: 200,
            headers: vec![
                ("content-type".into(), Bytes::from_static(b"text/plain")),
                ("x-empty".into(), Bytes::new()),
            ],
            body: Bytes::from(vec![b'x'; 70_000]),
        });
        for record in [pending(7), completed(), large] {
            let encoded = Bytes::from(record.encode());
            let shared = Record::decode_shared(&encoded).expect("decodes");
            assert_eq!(shared, record);
            let Record::Completed(CompletedRecord {
                outcome: Outcome::Response(response),
                ..
            }) = &shared
            else {
                continue;
            };
            let within = |part: &Bytes| {
                let range = encoded.as_ptr_range();
                part.is_empty()
                    || (range.start <= part.as_ptr() && part.as_ptr_range().end <= range.end)
            };
            assert!(within(&response.body), "the body was copied");
            for (name, value) in &response.headers {
                assert!(within(value), "{name} was copied");
            }
            // The copying decoder's parts are not in `encoded`, but all in
            // one copy of it: they span no more than its length, in the
            // order they are encoded (headers, then the body).
            let Ok(Record::Completed(CompletedRecord {
                outcome: Outcome::Response(copied),
                ..
            })) = Record::decode(&encoded)
            else {
                panic!("decodes");
            };
            assert!(!within(&copied.body));
            let starts = copied
                .headers
                .iter()
                .map(|(_, value)| value)
                .chain([&copied.body])
                .filter(|part| !part.is_empty())
                .map(|part| part.as_ptr() as usize)
                .collect::<Vec<_>>();
            assert!(starts.is_sorted(), "{starts:?}");
            let span = copied.body.as_ptr_range().end as usize - starts[0];
            assert!(span <= encoded.len(), "{span} > {}", encoded.len());
        }
        assert_eq!(
            Record::decode_shared(&Bytes::from_static(&[99, 0])),
            Err(DecodeError::UnknownVersion(99))
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(5000))]

        /// Whatever a store hands back, corrupt or cut short, both decoders
        /// read it alike, and neither panics.
        #[test]
        fn both_decoders_agree_on_any_bytes(
            which in 0usize..3,
            cut in proptest::prelude::any::<proptest::sample::Index>(),
            flips in proptest::collection::vec(
                (proptest::prelude::any::<proptest::sample::Index>(), 1u8..=255),
                0..4,
            ),
        ) {
            let mut bytes = [pending(3), completed(), with_response(StoredResponse {
                status: 200,
                headers: vec![("x-a".into(), Bytes::from_static(b"1")), ("x-b".into(), Bytes::new())],
                body: Bytes::from_static(b"body"),
            })][which].encode();
            for (at, mask) in flips {
                let i = at.index(bytes.len());
                bytes[i] ^= mask;
            }
            bytes.truncate(cut.index(bytes.len() + 1));
            let copied = Record::decode(&bytes);
            proptest::prop_assert_eq!(copied, Record::decode_shared(&Bytes::from(bytes)));
        }
    }

    #[test]
    fn encoding_starts_with_the_version_and_keeps_the_body_raw() {
        let bytes = completed().encode();
        assert_eq!(bytes[0], FORMAT_VERSION);
        // Raw bytes, not base64 or a JSON array of numbers.
        assert!(bytes.windows(8).any(|w| w == b"{\"id\":1}"));
    }

    #[test]
    fn unknown_version_and_corruption_are_errors() {
        let mut bytes = completed().encode();
        bytes[0] = 99;
        assert_eq!(Record::decode(&bytes), Err(DecodeError::UnknownVersion(99)));
        assert_eq!(Record::decode(&[]), Err(DecodeError::Empty));
        let truncated = &completed().encode()[..10];
        assert!(matches!(
            Record::decode(truncated),
            Err(DecodeError::Corrupt(_))
        ));
    }
}
