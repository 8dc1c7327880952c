//! What one layer learns about an exchange and hands to another through
//! request and response extensions, so that neither imports the other.

/// On an upstream response whose body has neither a length nor chunked
/// framing: it ends where the upstream closes its connection, so a plain
/// FIN halfway through looks exactly like its end. The forward client sets
/// it; the idempotency layer then cannot vouch for the body and stores the
/// response as not stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CloseDelimited;
