//! The traffic listener's TLS: the acceptor built from PEM files, and the
//! handshake each connection makes in its own task.

use std::path::Path;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// A client gets this long to finish its TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds the traffic listener's TLS acceptor from PEM files.
pub fn tls_acceptor(cert_file: &Path, key_file: &Path) -> Result<TlsAcceptor, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};

    let certs = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("tls.cert_file {}: {e}", cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "tls.cert_file {}: no certificate in it",
            cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| format!("tls.key_file {}: {e}", key_file.display()))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("tls: {e}"))?;
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(std::sync::Arc::new(tls)))
}

/// The handshake of one connection, bounded by [`TLS_HANDSHAKE_TIMEOUT`];
/// `None` (logged) when it fails or times out.
pub(super) async fn handshake(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
    peer: std::net::SocketAddr,
) -> Option<TlsStream<TcpStream>> {
    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, peer = %peer, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(peer = %peer, "TLS handshake timed out");
            None
        }
    }
}
