//! Sending the request spans ([`super::trace`]) to an OpenTelemetry
//! collector over OTLP/HTTP with protobuf.
//!
//! The SDK batches spans and exports each batch from a thread of its own,
//! blocking on the export there; the OTLP exporter asks an
//! [`HttpClient`] to send it. Ours is the proxy's own hyper client, driven
//! by a one-thread runtime kept for the exporter alone: the SDK's thread
//! has no runtime, and the traffic runtimes must never wait on a
//! collector. A collector that is slow or gone costs the batch (the SDK
//! drops spans past its queue, 2,048 by default), never a request.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{SpanExporter, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetryLayer;

/// Why the exporter could not be set up (a runtime, TLS, the exporter).
pub type SetupError = Box<dyn std::error::Error + Send + Sync>;

/// Where spans go and how many new traces are kept (`[telemetry]`).
#[derive(Clone, Debug)]
pub struct TraceExport {
    /// The collector's OTLP/HTTP base URL; spans go to its `/v1/traces`.
    pub endpoint: String,
    pub service_name: String,
    /// Share of new traces kept; a caller's sampled flag wins.
    pub sample_ratio: f64,
}

/// One export's limit, the answer included.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most of a collector's answer read: it is a status and a few bytes.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Keeps the exporter running; dropping it sends what is still batched
/// (within [`EXPORT_TIMEOUT`]) and stops the exporter's thread.
pub struct TraceGuard {
    provider: SdkTracerProvider,
    /// Drives the exporter's HTTP client; dropped after the provider's
    /// last export.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for TraceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceGuard").finish_non_exhaustive()
    }
}

impl Drop for TraceGuard {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown_with_timeout(EXPORT_TIMEOUT) {
            eprintln!("idemproxy: traces not all sent at exit: {e}");
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The layer that turns the request spans into OpenTelemetry spans and
/// sends them to `export.endpoint`, and the guard that keeps it sending.
pub fn layer<S>(
    export: &TraceExport,
) -> Result<(OpenTelemetryLayer<S, SdkTracer>, TraceGuard), SetupError>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    super::trace::set_sample_ratio(export.sample_ratio);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("idemproxy-otlp")
        .enable_all()
        .build()?;
    let client = ExportClient {
        client: Client::builder(TokioExecutor::new()).build(https_connector()?),
        runtime: runtime.handle().clone(),
    };
    let exporter = SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(traces_url(&export.endpoint))
        .with_timeout(EXPORT_TIMEOUT)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        // Requests are sampled before their spans exist
        // (`trace::request_span`): every span that reaches the SDK is kept.
        .with_sampler(Sampler::AlwaysOn)
        .with_resource(
            Resource::builder()
                .with_service_name(export.service_name.clone())
                .build(),
        )
        .build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("idemproxy"))
        // Nothing reads OpenTelemetry's own current context; attaching it
        // on every poll would cost every request for nothing.
        .with_context_activation(false)
        .with_tracked_inactivity(false)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_level(false);
    Ok((
        layer,
        TraceGuard {
            provider,
            runtime: Some(runtime),
        },
    ))
}

/// `endpoint` is the collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT`
/// is: traces go to its `/v1/traces`, unless it names that path already.
fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    }
}

/// `https://` collectors are checked against the system's roots and the
/// webpki (Mozilla) ones.
fn https_connector() -> Result<HttpsConnector<HttpConnector>, SetupError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    // A broken system store leaves the webpki roots.
    let _ = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let tls = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build())
}

/// The OTLP exporter's HTTP client: each export runs on the exporter's
/// runtime, and the SDK's thread waits for it.
#[derive(Debug)]
struct ExportClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let export = async move {
            let answer = client.request(request.map(Full::new)).await?;
            let (head, body) = answer.into_parts();
            let body = Limited::new(body, MAX_ANSWER_BYTES)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, HttpError>(Response::from_parts(head, body))
        };
        // The timer too is the exporter runtime's: this thread has none.
        let export = self
            .runtime
            .spawn(async move { tokio::time::timeout(EXPORT_TIMEOUT, export).await });
        match export.await? {
            Ok(answer) => answer,
            Err(_) => Err(format!("no answer from the collector within {EXPORT_TIMEOUT:?}").into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_is_a_base_url() {
        assert_eq!(
            traces_url("http://collector:4318"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://collector:4318/"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://example.com/otlp/"),
            "https://example.com/otlp/v1/traces"
        );
        assert_eq!(
            traces_url("http://collector:4318/v1/traces"),
            "http://collector:4318/v1/traces"
        );
    }
}
