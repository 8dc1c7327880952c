//! The traffic listener's TLS: the acceptor built from PEM files (with the
//! CAs of client certificates for mTLS), and the handshake each connection
//! makes in its own task.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use sha2::{Digest, Sha256};

use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::core::ClientCertificate;

/// A client gets this long to finish its TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether the listener asks its clients for certificates (mTLS), and the
/// CAs it verifies them against.
#[derive(Clone, Copy, Debug)]
pub enum ClientCertificates<'a> {
    /// None asked for.
    Ignored,
    /// A client without a verified certificate fails the handshake.
    Required { ca_file: &'a Path },
    /// A certificate, when sent, must verify; a client may send none.
    Optional { ca_file: &'a Path },
}

/// Builds the traffic listener's TLS acceptor from PEM files.
pub fn tls_acceptor(
    cert_file: &Path,
    key_file: &Path,
    clients: ClientCertificates<'_>,
) -> Result<TlsAcceptor, String> {
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
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls: {e}"))?
        .with_client_cert_verifier(client_verifier(clients, &provider)?)
        .with_single_cert(certs, key)
        .map_err(|e| format!("tls: {e}"))?;
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(tls)))
}

/// Verifies client certificates against the CA bundle, when one is set.
fn client_verifier(
    clients: ClientCertificates<'_>,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ClientCertVerifier>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;

    let (ca_file, required) = match clients {
        ClientCertificates::Ignored => return Ok(WebPkiClientVerifier::no_client_auth()),
        ClientCertificates::Required { ca_file } => (ca_file, true),
        ClientCertificates::Optional { ca_file } => (ca_file, false),
    };
    let field = "tls.client_ca_file";
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca_file)
        .map_err(|e| format!("{field} {}: {e}", ca_file.display()))?
    {
        let cert = cert.map_err(|e| format!("{field} {}: {e}", ca_file.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("{field} {}: {e}", ca_file.display()))?;
    }
    if roots.is_empty() {
        return Err(format!(
            "{field} {}: no CA certificate in it",
            ca_file.display()
        ));
    }
    let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
    let builder = if required {
        builder
    } else {
        builder.allow_unauthenticated()
    };
    builder
        .build()
        .map_err(|e| format!("{field} {}: {e}", ca_file.display()))
}

/// The handshake of one connection, bounded by [`TLS_HANDSHAKE_TIMEOUT`],
/// and the client certificate it verified; `None` (logged) when it fails
/// or times out.
pub(super) async fn handshake(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
    peer: std::net::SocketAddr,
) -> Option<(TlsStream<TcpStream>, Option<ClientCertificate>)> {
    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => {
            // The verifier checked the chain; the leaf names the client.
            let certificate = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|leaf| ClientCertificate(Sha256::digest(leaf.as_ref()).into()));
            Some((stream, certificate))
        }
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
