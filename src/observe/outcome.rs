//! How a request ended, from the idempotency point of view: the `outcome`
//! label of `idemproxy_requests_total` and the `outcome` field of the request
//! log. Every request gets exactly one.

use std::fmt;

/// Declared in the order of [`RequestOutcome::ALL`], so `index` is the
/// discriminant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestOutcome {
    /// First request for its key: the upstream ran it.
    Executed,
    /// Answered from the key's completed record.
    Replayed,
    /// The key belongs to a different request.
    Mismatch,
    /// The same request is still running (answered 425, or 409 under `ietf`).
    InFlight,
    MissingKey,
    InvalidKey,
    /// The request body was over `max_request_bytes` or broke off.
    BadBody,
    /// Not covered by idempotency: forwarded untouched.
    Passthrough,
    /// The store failed; the request was rejected.
    StoreUnavailable,
    /// The store failed and the request was forwarded without protection
    /// (`on_store_error = "pass"`): a side effect that may run again.
    Unprotected,
    /// The upstream could not be reached; the key was released.
    UpstreamUnreachable,
    /// The upstream timed out or broke after the request was sent.
    OutcomeUnknown,
    /// The upstream answered a `release_statuses` status; the key was released.
    Released,
    /// The proxy itself failed (a bug).
    Internal,
    /// Turned away because `max_in_flight` requests were being served.
    Overloaded,
    /// Turned away before claiming its key: the proxy is draining.
    ShuttingDown,
    /// The client went away before it had an answer, while the request was
    /// still the proxy's to drop: its body arriving, or a passthrough
    /// waiting for the upstream (which is cancelled). A covered execution
    /// whose client leaves runs on and gets its own outcome.
    ClientClosed,
    /// A covered request that could not say who calls: a bearer token that
    /// did not verify, or none under `anonymous = "reject"` (401).
    Unauthenticated,
    /// `mode = "observe"`: forwarded, where enforcement would have replayed.
    ObservedReplay,
    /// `mode = "observe"`: forwarded, where enforcement would have refused
    /// a key reused for another request.
    ObservedMismatch,
    /// `mode = "observe"`: forwarded while the same request ran under its
    /// key, where enforcement would have answered 425 (or waited).
    ObservedInFlight,
    /// `mode = "observe"`: a keyless covered request whose (scope,
    /// fingerprint) was seen within `observe_window`: a duplicate no key
    /// would catch.
    ObservedUnkeyedDuplicate,
    /// The key's stored record does not read (500 `record-unreadable`):
    /// refused, never executed, until an operator removes the record.
    RecordUnreadable,
}

impl RequestOutcome {
    pub const ALL: [RequestOutcome; 23] = [
        RequestOutcome::Executed,
        RequestOutcome::Replayed,
        RequestOutcome::Mismatch,
        RequestOutcome::InFlight,
        RequestOutcome::MissingKey,
        RequestOutcome::InvalidKey,
        RequestOutcome::BadBody,
        RequestOutcome::Passthrough,
        RequestOutcome::StoreUnavailable,
        RequestOutcome::Unprotected,
        RequestOutcome::UpstreamUnreachable,
        RequestOutcome::OutcomeUnknown,
        RequestOutcome::Released,
        RequestOutcome::Internal,
        RequestOutcome::Overloaded,
        RequestOutcome::ShuttingDown,
        RequestOutcome::ClientClosed,
        RequestOutcome::Unauthenticated,
        RequestOutcome::ObservedReplay,
        RequestOutcome::ObservedMismatch,
        RequestOutcome::ObservedInFlight,
        RequestOutcome::ObservedUnkeyedDuplicate,
        RequestOutcome::RecordUnreadable,
    ];

    /// Position in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Executed => "executed",
            RequestOutcome::Replayed => "replayed",
            RequestOutcome::Mismatch => "mismatch",
            RequestOutcome::InFlight => "in_flight",
            RequestOutcome::MissingKey => "missing_key",
            RequestOutcome::InvalidKey => "invalid_key",
            RequestOutcome::BadBody => "bad_body",
            RequestOutcome::Passthrough => "passthrough",
            RequestOutcome::StoreUnavailable => "store_unavailable",
            RequestOutcome::Unprotected => "unprotected",
            RequestOutcome::UpstreamUnreachable => "upstream_unreachable",
            RequestOutcome::OutcomeUnknown => "outcome_unknown",
            RequestOutcome::Released => "released",
            RequestOutcome::Internal => "internal",
            RequestOutcome::Overloaded => "overloaded",
            RequestOutcome::ShuttingDown => "shutting_down",
            RequestOutcome::ClientClosed => "client_closed",
            RequestOutcome::Unauthenticated => "unauthenticated",
            RequestOutcome::ObservedReplay => "observed_replay",
            RequestOutcome::ObservedMismatch => "observed_mismatch",
            RequestOutcome::ObservedInFlight => "observed_in_flight",
            RequestOutcome::ObservedUnkeyedDuplicate => "observed_unkeyed_duplicate",
            RequestOutcome::RecordUnreadable => "record_unreadable",
        }
    }
}

impl fmt::Display for RequestOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_is_the_position_in_all() {
        for (i, outcome) in RequestOutcome::ALL.iter().enumerate() {
            assert_eq!(outcome.index(), i, "{outcome}");
        }
    }
}
