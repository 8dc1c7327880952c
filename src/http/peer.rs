//! What the server learned about a connection's peer that requests carry
//! to the layers above it.

/// The SHA-256 of the client certificate a connection's TLS handshake
/// verified against `[tls] client_ca_file` (the leaf, DER). The server puts
/// it on every request of the connection; the `client_cert` scope reads
/// it. Absent on plain-text connections and when no certificate was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClientCertificate(pub(crate) [u8; 32]);
