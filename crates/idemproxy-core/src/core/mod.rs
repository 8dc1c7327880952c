//! What every layer shares, and nothing else: the ids ([`RecordKey`],
//! [`Fingerprint`], [`FencingToken`]), the record model and its versioned
//! codec, the [`Clock`] records are timed by, and the begin decision every
//! store makes. No HTTP and no I/O, and no import of any other module of
//! the crate: everything else may build on it.

pub mod begin;
pub mod clock;
pub mod failure;
pub mod ids;
pub mod record;
pub mod redact;

pub use begin::{
    decide_begin, new_claim, running_lease, settled_back, Begin, BeginOutcome, OnStale, Removal,
    Removed,
};
pub use clock::{from_millis, millis, now_millis, to_millis, Clock, UnixMillis, LAST_DATE_MILLIS};
pub use failure::UpstreamFailure;
pub use ids::{ClientCertificate, FencingToken, Fingerprint, KeyHex, RecordKey};
pub use record::{
    CompletedRecord, DecodeError, KeyState, Outcome, OutcomeMeta, PendingRecord, Record,
    RecordMeta, StoredResponse, UnknownCause, FORMAT_VERSION,
};
pub use redact::redact_url;
