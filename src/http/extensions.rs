//! What one layer learns about an exchange and hands to another through
//! request and response extensions, so that neither imports the other.

/// The SHA-256 of the client certificate a connection's TLS handshake
/// verified against `[tls] client_ca_file` (the leaf, DER). The server puts
/// it on every request of the connection; the `client_cert` scope reads
/// it. Absent on plain-text connections and when no certificate was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClientCertificate(pub(crate) [u8; 32]);

/// On an upstream response whose body has neither a length nor chunked
/// framing: it ends where the upstream closes its connection, so a plain
/// FIN halfway through looks exactly like its end. The forward client sets
/// it; the idempotency layer then cannot vouch for the body and stores the
/// response as not stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CloseDelimited;
