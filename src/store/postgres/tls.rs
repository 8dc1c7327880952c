//! TLS to PostgreSQL (`sslmode=require`): rustls, the certificate always
//! verified against the system's and webpki's roots and `store.ca_file`,
//! as for Redis's `rediss://` (libpq's `verify-full`, not its `require`,
//! which takes any certificate). Without `sslmode=require` the connection
//! is plain: a `prefer` that tried TLS would fail against the self-signed
//! certificate many servers ship with, instead of falling back.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

use crate::store::settings::StoreSettings;
use crate::store::StoreError;

/// Makes a verifying TLS connector per host.
#[derive(Clone)]
pub(super) struct MakeRustls {
    config: Arc<rustls::ClientConfig>,
}

impl MakeRustls {
    /// Trusting the system's roots, webpki's, and `ca_file`'s.
    pub(super) fn new(config: &StoreSettings) -> Result<MakeRustls, StoreError> {
        let mut roots = RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        // A broken system store leaves the others.
        let _ = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        if let Some(path) = &config.ca_file {
            let shown = path.display();
            let unreadable = |e: &dyn std::fmt::Display| {
                StoreError::Unavailable(format!("store.ca_file {shown}: {e}"))
            };
            let mut found = 0;
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
                roots
                    .add(cert.map_err(|e| unreadable(&e))?)
                    .map_err(|e| unreadable(&e))?;
                found += 1;
            }
            if found == 0 {
                return Err(unreadable(&"no PEM certificate in it"));
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(
            rustls::crypto::ring::default_provider().into(),
        )
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Unavailable(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(MakeRustls {
            config: Arc::new(tls),
        })
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> MakeTlsConnect<S> for MakeRustls {
    type Stream = Verified<S>;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, io::Error> {
        let name = ServerName::try_from(domain)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?
            .to_owned();
        Ok(RustlsConnect {
            config: Arc::clone(&self.config),
            name,
        })
    }
}

/// Connects to one host, verifying its certificate for its name.
pub(super) struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> TlsConnect<S> for RustlsConnect {
    type Stream = Verified<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Verified<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config);
        Box::pin(async move { connector.connect(self.name, stream).await.map(Verified) })
    }
}

/// A TLS stream whose server certificate was verified.
pub(super) struct Verified<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Verified<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Verified<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for Verified<S> {
    /// None: SCRAM without channel binding (`SCRAM-SHA-256`, not `-PLUS`);
    /// the verified certificate already binds the server.
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}
