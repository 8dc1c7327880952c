//! A record as Redis holds it: the header the scripts read in front of the
//! record's own bytes (see "Layout" in the [`super`] docs), reading a value
//! back against its header, and the scripts' replies.

use bytes::Bytes;
use redis::Value;

use crate::core::{CompletedRecord, KeyState, PendingRecord, Record, RecordMeta, UnixMillis};
use crate::store::StoreError;

/// Longest relative expiry handed to `PX`. Redis refuses expiries that
/// overflow its own clock arithmetic; a `ttl` this long (about 35,000 years)
/// means "keep", so clamping changes nothing real.
const MAX_PEXPIRE_MS: u64 = 1 << 50;

/// Bytes before the record in a stored value (see "Layout" in the
/// [`super`] docs).
const HEADER_LEN: usize = 25;

/// The header's first bytes, state and fencing token: what `settle.lua`
/// compares with the caller's claim.
pub(super) const CLAIM_ID_LEN: usize = 17;

/// The header of a stored value (see "Layout" in the [`super`] docs),
/// with room for the `record_len` bytes of the record that follow it.
pub(super) fn header(state: u8, token: u128, expires_at: UnixMillis, record_len: usize) -> Vec<u8> {
    let mut value = Vec::with_capacity(HEADER_LEN + record_len);
    value.extend_from_slice(&claim_id(state, token));
    value.extend_from_slice(&expires_at.to_be_bytes());
    value
}

/// A header's first [`CLAIM_ID_LEN`] bytes.
pub(super) fn claim_id(state: u8, token: u128) -> [u8; CLAIM_ID_LEN] {
    let mut id = [state; CLAIM_ID_LEN];
    id[1..].copy_from_slice(&token.to_be_bytes());
    id
}

/// A pending claim as Redis holds it.
pub(super) fn stored_pending(claim: &PendingRecord) -> Vec<u8> {
    claim.encode_after(header(
        b'p',
        claim.token.0,
        claim.expires_at,
        PendingRecord::ENCODED_LEN_MAX,
    ))
}

/// A completed record as Redis holds it.
pub(super) fn stored_completed(record: &CompletedRecord) -> Vec<u8> {
    record.encode_after(header(b'c', 0, record.expires_at, record.encoded_len_max()))
}

pub(super) fn stored(record: &Record) -> Vec<u8> {
    match record {
        Record::Pending(claim) => stored_pending(claim),
        Record::Completed(done) => stored_completed(done),
    }
}

/// `expires_at` from a stored value's header, if it has one.
pub(super) fn stored_expires_at(value: &[u8]) -> Option<UnixMillis> {
    let exp: [u8; 8] = value.get(CLAIM_ID_LEN..HEADER_LEN)?.try_into().ok()?;
    matches!(value.first(), Some(b'p' | b'c')).then(|| UnixMillis::from_be_bytes(exp))
}

/// The record in a stored value, checked against its header: the scripts
/// trust the header, so a value whose header says something else than its
/// record is corrupt. The record shares `value` (`Record::decode_shared`):
/// a replay's body is a slice of the reply Redis sent, not a copy of it.
pub(super) fn read_stored(value: &Bytes) -> Result<Record, StoreError> {
    let (Some(expires_at), Some(record)) = (stored_expires_at(value), value.get(HEADER_LEN..))
    else {
        return Err(corrupt("the value is not a record"));
    };
    let record = Record::decode_shared(&value.slice_ref(record))
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let id = match &record {
        Record::Pending(claim) => claim_id(b'p', claim.token.0),
        Record::Completed(_) => claim_id(b'c', 0),
    };
    if value.get(..CLAIM_ID_LEN) != Some(&id[..]) || record.expires_at() != expires_at {
        return Err(corrupt("the header of a record disagrees with the record"));
    }
    Ok(record)
}

/// How much of a stored value [`read_stored_meta`] reads: the header and
/// the front of the record.
pub(super) const META_FRONT_LEN: usize = HEADER_LEN + RecordMeta::ENCODED_FRONT_MAX;

/// The metadata of the record a stored value's first [`META_FRONT_LEN`]
/// bytes (`front`) begin, checked against its header as [`read_stored`]
/// checks a whole record (a claim's token aside, which a listing does not
/// show).
pub(super) fn read_stored_meta(front: &[u8]) -> Result<RecordMeta, StoreError> {
    let (Some(expires_at), Some(record)) = (stored_expires_at(front), front.get(HEADER_LEN..))
    else {
        return Err(corrupt("the value is not a record"));
    };
    let meta = RecordMeta::read(record).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let state = match meta.state {
        KeyState::Pending => b'p',
        KeyState::Completed => b'c',
    };
    if front.first() != Some(&state) || meta.expires_at != expires_at {
        return Err(corrupt("the header of a record disagrees with the record"));
    }
    Ok(meta)
}

/// A script reply: a status word, then its values in order.
pub(super) struct Reply {
    pub(super) status: String,
    values: std::vec::IntoIter<Value>,
}

impl Reply {
    pub(super) fn new(reply: Value) -> Result<Reply, StoreError> {
        let Value::Array(values) = reply else {
            return Err(unexpected("script reply is not an array"));
        };
        let mut values = values.into_iter();
        let status = match values.next() {
            Some(Value::BulkString(s)) => String::from_utf8_lossy(&s).into_owned(),
            Some(Value::SimpleString(s)) => s,
            _ => return Err(unexpected("script reply has no status")),
        };
        Ok(Reply { status, values })
    }

    fn bytes(&mut self) -> Result<Vec<u8>, StoreError> {
        match self.values.next() {
            Some(Value::BulkString(b)) => Ok(b),
            Some(Value::SimpleString(s)) => Ok(s.into_bytes()),
            _ => Err(unexpected("script reply lacks a string")),
        }
    }

    pub(super) fn corrupt(&mut self) -> StoreError {
        let why = self.bytes().unwrap_or_default();
        corrupt(&String::from_utf8_lossy(&why))
    }
}

/// The relative expiry of a key that should live until `expires_at`. At
/// least 1 ms: `PX 0` is an error, while a record that
/// is due already reads as absent anyway.
pub(super) fn pexpire_ms(expires_at: UnixMillis, now: UnixMillis) -> u64 {
    expires_at.saturating_sub(now).clamp(1, MAX_PEXPIRE_MS)
}

pub(super) fn corrupt(why: &str) -> StoreError {
    StoreError::Corrupt(why.to_string())
}

pub(super) fn unexpected(what: &str) -> StoreError {
    StoreError::Unavailable(format!("unexpected reply from redis: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{FencingToken, Fingerprint, Outcome};

    #[test]
    fn pexpire_is_relative_and_bounded() {
        assert_eq!(pexpire_ms(1_500, 1_000), 500);
        assert_eq!(pexpire_ms(1_000, 1_000), 1);
        assert_eq!(pexpire_ms(900, 1_000), 1);
        assert_eq!(pexpire_ms(u64::MAX, 1_000), MAX_PEXPIRE_MS);
    }

    #[test]
    fn stored_values_read_back_and_check_their_header() {
        let claim = PendingRecord {
            fingerprint: Fingerprint([3; 32]),
            token: FencingToken(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
            created_at: 10,
            lease_expires_at: 20,
            expires_at: 0x0000_0123_4567_89ab,
        };
        let value = stored_pending(&claim);
        // The layout the scripts read: state, token, expires_at, then the
        // record's own bytes.
        assert_eq!(value[0], b'p');
        assert_eq!(value[1..17], claim.token.0.to_be_bytes());
        assert_eq!(value[17..25], [0, 0, 1, 0x23, 0x45, 0x67, 0x89, 0xab]);
        assert_eq!(value[HEADER_LEN..], claim.encode());
        assert_eq!(stored_expires_at(&value), Some(claim.expires_at));
        let pending = Record::Pending(claim);
        assert_eq!(
            read_stored(&value.clone().into()).ok(),
            Some(pending.clone())
        );
        assert_eq!(stored(&pending), value);

        let done = CompletedRecord {
            fingerprint: Fingerprint([3; 32]),
            created_at: 10,
            completed_at: 25,
            expires_at: 99,
            outcome: Outcome::NotStored { status: 201 },
        };
        let value = stored_completed(&done);
        assert_eq!(
            value[..17],
            [b'c', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            read_stored(&value.clone().into()).ok(),
            Some(Record::Completed(done))
        );

        // A header that says something else than its record is corrupt, as
        // are values too short to hold one and garbage after a valid one.
        let mut other_state = value.clone();
        other_state[0] = b'p';
        let mut other_expiry = value.clone();
        other_expiry[24] ^= 1;
        let mut garbage = value[..HEADER_LEN].to_vec();
        garbage.extend_from_slice(b"\x01junk");
        for bad in [
            &other_state[..],
            &other_expiry,
            &value[..HEADER_LEN],
            b"hello",
            &garbage,
        ] {
            assert!(matches!(
                read_stored(&Bytes::copy_from_slice(bad)),
                Err(StoreError::Corrupt(_))
            ));
        }
        for bad in [&other_state[..], &other_expiry, b"hello"] {
            assert!(matches!(read_stored_meta(bad), Err(StoreError::Corrupt(_))));
        }
        let meta = read_stored_meta(&value[..value.len().min(META_FRONT_LEN)]).expect("meta");
        assert_eq!(meta.expires_at, 99);
        assert_eq!(stored_expires_at(b"hello"), None);
        assert_eq!(stored_expires_at(&garbage), Some(99));
    }
}
