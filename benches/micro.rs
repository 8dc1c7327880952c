//! Micro-benchmarks of the per-request work: key parsing, fingerprints
//! (canonicalization included), record encoding, the middleware's
//! overhead on the memory store, in-process (no sockets), and the
//! request's log line.
//!
//! `cargo bench --bench micro`

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use idemproxy::config::Config;
use idemproxy::core::{CompletedRecord, Fingerprint, Outcome, Record, StoredResponse};
use idemproxy::forward::UpstreamError;
use idemproxy::idempotency::fingerprint::FingerprintRules;
use idemproxy::idempotency::key::parse_key;
use idemproxy::idempotency::IdempotencyLayer;
use idemproxy::store::MemoryStore;
use tower::{Layer, ServiceExt};

/// A JSON object of about `size` bytes with nested fields, like a tool call's
/// arguments.
fn json_body(size: usize) -> Bytes {
    let mut items = Vec::new();
    let mut len = 0;
    let mut i = 0;
    while len < size {
        let item = format!(
            r#"{{"sku":"item-{i:05}","qty":{},"price":{}.{:02},"tags":["a","b"],"meta":{{"note":"line {i}"}}}}"#,
            i % 7 + 1,
            i * 3,
            i % 100
        );
        len += item.len() + 1;
        items.push(item);
        i += 1;
    }
    Bytes::from(format!(
        r#"{{"customer":"cus_123","currency":"eur","items":[{}],"metadata":{{"sent_at":"2026-11-30T12:00:00Z"}}}}"#,
        items.join(",")
    ))
}

fn key_parsing(c: &mut Criterion) {
    let bare = HeaderValue::from_static("3f2c9a4e-8b1d-4f6a-9c2e-7d5b1a0e4c3f");
    let quoted = HeaderValue::from_static("\"3f2c9a4e-8b1d-4f6a-9c2e-7d5b1a0e4c3f\"");
    let mut group = c.benchmark_group("key");
    group.bench_function("bare uuid", |b| b.iter(|| parse_key(black_box(&bare))));
    group.bench_function("sf-string uuid", |b| {
        b.iter(|| parse_key(black_box(&quoted)))
    });
    group.finish();
}

fn fingerprints(c: &mut Criterion) {
    let rules = FingerprintRules::parse(&[], &["/metadata/sent_at".into()]).expect("rules");
    let mut group = c.benchmark_group("fingerprint");
    for size in [1024, 64 * 1024] {
        let body = json_body(size);
        let (parts, ()) = Request::post("/v1/payments?x=1")
            .header("content-type", "application/json")
            .body(())
            .expect("request")
            .into_parts();
        group.throughput(Throughput::Bytes(body.len() as u64));
        // A first request: parse, canonicalize, hash, remember. The rules
        // keep a memo of canonical fingerprints by raw fingerprint, so each
        // iteration gets a body the memo has not seen: the same document
        // with another `sent_at`, a field the rules ignore, so the
        // canonicalization work is the same every time.
        let mut sent = 0u64;
        let mut fresh_body = || {
            sent += 1;
            let at = format!("2026-11-30T12:00:00.{sent:09}Z");
            Bytes::from(String::from_utf8_lossy(&body).replace("2026-11-30T12:00:00Z", &at))
        };
        group.bench_function(BenchmarkId::new("json", size), |b| {
            b.iter_batched_ref(
                &mut fresh_body,
                |fresh| rules.fingerprint(black_box(&parts), black_box(fresh)),
                BatchSize::SmallInput,
            )
        });
        // A byte-identical retry: the raw fingerprint finds the memo entry.
        rules.fingerprint(&parts, &body);
        group.bench_with_input(BenchmarkId::new("json retry", size), &body, |b, body| {
            b.iter(|| rules.fingerprint(black_box(&parts), black_box(body)))
        });
        let (raw_parts, ()) = Request::post("/v1/payments")
            .header("content-type", "application/octet-stream")
            .body(())
            .expect("request")
            .into_parts();
        group.bench_with_input(BenchmarkId::new("raw", size), &body, |b, body| {
            b.iter(|| rules.fingerprint(black_box(&raw_parts), black_box(body)))
        });
    }
    group.finish();
}

fn records(c: &mut Criterion) {
    let record = Record::Completed(CompletedRecord {
        fingerprint: Fingerprint([7; 32]),
        created_at: 1_764_500_000_000,
        completed_at: 1_764_500_000_050,
        expires_at: 1_764_586_400_050,
        outcome: Outcome::Response(StoredResponse {
            status: 201,
            headers: vec![
                (
                    "content-type".into(),
                    Bytes::from_static(b"application/json"),
                ),
                ("x-request-id".into(), Bytes::from_static(b"5b1a0e4c")),
            ],
            body: json_body(1024),
        }),
    });
    let encoded = record.encode();
    let mut group = c.benchmark_group("record");
    group.bench_function("encode 1KB", |b| b.iter(|| black_box(&record).encode()));
    group.bench_function("decode 1KB", |b| {
        b.iter(|| Record::decode(black_box(&encoded)))
    });
    // How the Redis store reads a reply: the body and header values become
    // slices of the buffer instead of copies.
    let shared = Bytes::from(encoded.clone());
    group.bench_function("decode_shared 1KB", |b| {
        b.iter(|| Record::decode_shared(black_box(&shared)))
    });
    group.finish();
}

/// The middleware around an upstream that answers at once: what the
/// protection itself costs per request. On a current-thread runtime, as the
/// proxy's workers run: on a multi-thread one, each request's execution
/// task would wake a parked worker thread, and the benchmark would measure
/// that wake-up (tens of µs) instead of the middleware.
fn middleware(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let config = Config::default();
    let policies = idemproxy::policies(&config).expect("policies");
    let upstream = tower::service_fn(|_req: Request<Body>| async {
        let mut response = Response::new(Body::from(r#"{"id":"pay_1","status":"succeeded"}"#));
        *response.status_mut() = http::StatusCode::CREATED;
        Ok::<_, UpstreamError>(response)
    });
    let direct = upstream;
    let service = IdempotencyLayer::new(policies, Arc::new(MemoryStore::new())).layer(upstream);
    let body = json_body(1024);
    let request = |key: Option<String>| {
        let mut builder = Request::post("/v1/payments").header("content-type", "application/json");
        if let Some(key) = key {
            builder = builder.header("idempotency-key", key);
        }
        builder.body(Body::from(body.clone())).expect("request")
    };
    async fn drain(response: Response<Body>) -> usize {
        let bytes = response.into_body().collect().await.map(|c| c.to_bytes());
        bytes.map(|b| b.len()).unwrap_or(0)
    }

    let mut group = c.benchmark_group("middleware");
    group.bench_function("baseline: upstream alone", |b| {
        b.to_async(&runtime).iter(|| async {
            let response: Result<_, UpstreamError> = direct.oneshot(request(None)).await;
            drain(response.expect("ok")).await
        })
    });
    // A first execution: a key and a body of its own (distinct operations
    // have distinct bodies; a repeated body would hit the fingerprint memo),
    // built outside the measurement.
    let counter = AtomicU64::new(0);
    let unique = || {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        let at = format!("2026-11-30T12:00:00.{n:09}Z");
        let body = String::from_utf8_lossy(&body).replace("2026-11-30T12:00:00Z", &at);
        Request::post("/v1/payments")
            .header("content-type", "application/json")
            .header("idempotency-key", format!("k-{n}"))
            .body(Body::from(body))
            .expect("request")
    };
    group.bench_function("first request (unique key)", |b| {
        b.to_async(&runtime).iter_batched(
            unique,
            |req| async {
                let response: Result<_, Infallible> = service.clone().oneshot(req).await;
                drain(response.expect("infallible")).await
            },
            BatchSize::SmallInput,
        )
    });
    runtime.block_on(async {
        let response = service
            .clone()
            .oneshot(request(Some("warm".into())))
            .await
            .expect("infallible");
        drain(response).await
    });
    group.bench_function("replay", |b| {
        b.to_async(&runtime).iter(|| async {
            let response = service
                .clone()
                .oneshot(request(Some("warm".into())))
                .await
                .expect("infallible");
            drain(response).await
        })
    });
    group.finish();
}

/// The one line a request logs, formatted into a sink: tracing-subscriber's
/// human and JSON formats as they come, and idemproxy's (what the binary
/// uses: the human one when stdout is no terminal).
fn log_line(c: &mut Criterion) {
    use idemproxy::observe::log_format::{JsonLines, PlainFields, PlainLines};
    let route: Arc<str> = "payments".into();
    let event = || {
        tracing::info!(
            target: "idemproxy::request",
            route = %route,
            method = %http::Method::POST,
            outcome = "replayed",
            status = 201u16,
            key_hash = "cf724e8ae701f4d5eb0b3b8e2783d452a12455f3c507ea61cd1b90bbd97f7cc5",
            request_id = "8f01c1aa-9ec9-4b95-a270-9aeac63e9f0c",
            // Whole microseconds, as the proxy logs durations.
            store_ms = 0.002,
            upstream_ms = 1.454,
            total_ms = 1.47,
        );
    };
    let human = || {
        tracing_subscriber::fmt()
            .with_writer(std::io::sink)
            .with_ansi(false)
    };
    let mut group = c.benchmark_group("log line");
    tracing::subscriber::with_default(human().finish(), || {
        group.bench_function("tracing-subscriber human", |b| b.iter(event))
    });
    let plain = human()
        .fmt_fields(PlainFields)
        .event_format(PlainLines::new())
        .finish();
    tracing::subscriber::with_default(plain, || {
        group.bench_function("idemproxy human", |b| b.iter(event))
    });
    let json = || tracing_subscriber::fmt().with_writer(std::io::sink).json();
    tracing::subscriber::with_default(json().flatten_event(true).finish(), || {
        group.bench_function("tracing-subscriber json", |b| b.iter(event))
    });
    let lines = json()
        .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
        .event_format(JsonLines::new())
        .finish();
    tracing::subscriber::with_default(lines, || {
        group.bench_function("idemproxy json", |b| b.iter(event))
    });
    group.finish();
}

criterion_group!(
    benches,
    key_parsing,
    fingerprints,
    records,
    middleware,
    log_line
);
criterion_main!(benches);
