//! Micro-benchmarks of the per-request work: key parsing, fingerprints
//! (canonicalization included), record encoding, packing stored responses
//! (compression, with and without a dictionary), the middleware's overhead
//! on the memory store, in-process (no sockets), and the request's log line.
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
use idemproxy::idempotency::IdempotencyLayer;
use idemproxy::request::fingerprint::FingerprintRules;
use idemproxy::request::key::parse_key;
use idemproxy::store::compression::{self, Dictionary, Packer};
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

/// A payment object of about 1.1 KB as a payments API answers, varied as
/// real ones are (random ids and secrets, amounts, names, addresses): the
/// same model as `examples/api_upstream.rs`, since what compression saves
/// depends on how much responses differ.
fn payment(i: u64) -> String {
    let mut state = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    const ALPHANUMERIC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut id = |n: usize| -> String {
        (0..n)
            .map(|_| ALPHANUMERIC[(next() % 62) as usize] as char)
            .collect()
    };
    let (pi, secret, customer, charge, method, run, call) = (
        id(24),
        id(25),
        id(14),
        id(24),
        id(24),
        id(8).to_lowercase(),
        id(7),
    );
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        state >> 33
    };
    let pick =
        |options: &'static [&'static str], n: u64| options[(n % options.len() as u64) as usize];
    let amount = [499, 999, 1999, 4999, 12_900, 100 + next() % 500_000][(next() % 6) as usize];
    let (first, last) = (
        pick(
            &[
                "Jane", "John", "Amara", "Wei", "Lucas", "Sofia", "Noah", "Priya",
            ],
            next(),
        ),
        pick(
            &[
                "Doe", "Smith", "Okafor", "Chen", "Martin", "Rossi", "Kim", "Patel",
            ],
            next(),
        ),
    );
    let city = pick(
        &[
            "Portland", "Austin", "Denver", "Boston", "Seattle", "Chicago",
        ],
        next(),
    );
    format!(
        r#"{{"id":"pi_{pi}","object":"payment_intent","amount":{amount},"amount_capturable":0,"amount_received":{amount},"canceled_at":null,"cancellation_reason":null,"capture_method":"automatic","client_secret":"pi_{pi}_secret_{secret}","confirmation_method":"automatic","created":{},"currency":"{}","customer":"cus_{customer}","description":"Order #{} - {} items","last_payment_error":null,"latest_charge":"ch_{charge}","livemode":true,"metadata":{{"order_id":"{}","agent_run":"run_{run}","tool_call":"call_{call}"}},"next_action":null,"payment_method":"pm_{method}","payment_method_options":{{"card":{{"installments":null,"mandate_options":null,"network":null,"request_three_d_secure":"automatic"}}}},"payment_method_types":["card"],"receipt_email":"{}.{}{}@example.com","setup_future_usage":null,"shipping":{{"address":{{"city":"{city}","country":"US","line1":"{} Main St","line2":null,"postal_code":"97214","state":"OR"}},"carrier":null,"name":"{first} {last}","phone":null,"tracking_number":null}},"status":"succeeded","transfer_group":null}}"#,
        1_764_758_400 + i * 3,
        pick(&["usd", "usd", "usd", "eur", "gbp"], next()),
        100_000 + i,
        1 + next() % 5,
        100_000 + i,
        first.to_lowercase(),
        last.to_lowercase(),
        next() % 100,
        1 + next() % 9999,
    )
}

fn api_response(body: String) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("content-length".into(), Bytes::from(body.len().to_string())),
            (
                "date".into(),
                Bytes::from_static(b"Thu, 03 Dec 2026 09:21:51 GMT"),
            ),
            (
                "request-id".into(),
                Bytes::from_static(b"req_c6Y7h96vOjouJk"),
            ),
        ],
        body: Bytes::from(body),
    }
}

/// What a first execution pays to pack its response (`store.compression`)
/// and a replay read from the store to unpack it, for a ~1.1 KB payment
/// and a ~17 KB list of 15: off, zstd, and zstd with a dictionary trained
/// on 2,000 other payments (as `idemproxy store train-dictionary` trains).
fn packing(c: &mut Criterion) {
    let plain = Packer::new(false, None, Vec::new(), usize::MAX);
    let training: Vec<Vec<u8>> = (10_000..12_000)
        .map(|i| compression::payload(&api_response(payment(i))))
        .collect();
    let dictionary = compression::train(&training, 16 * 1024).expect("a dictionary");
    let packers = [
        ("off", plain),
        ("zstd", Packer::new(true, None, Vec::new(), usize::MAX)),
        (
            "dictionary",
            Packer::new(
                true,
                Some(Dictionary::new(&dictionary).expect("dictionary")),
                Vec::new(),
                usize::MAX,
            ),
        ),
    ];
    let list = (0..15).map(payment).collect::<Vec<_>>().join(",");
    let responses = [
        ("1KB", api_response(payment(7))),
        (
            "16KB",
            api_response(format!(
                r#"{{"object":"list","data":[{list}],"has_more":true,"url":"/v1/payment_intents"}}"#
            )),
        ),
    ];
    let mut group = c.benchmark_group("pack");
    for (size, response) in &responses {
        for (mode, packer) in &packers {
            let packed = packer.pack(response);
            eprintln!(
                "pack {size} {mode}: {} bytes of body stored as {} ({:.2})",
                response.body.len(),
                packed.len(),
                packed.len() as f64 / response.body.len() as f64
            );
            group.bench_function(BenchmarkId::new(*mode, size), |b| {
                b.iter(|| packer.pack(black_box(response)))
            });
        }
    }
    group.finish();
    let mut group = c.benchmark_group("unpack");
    for (size, response) in &responses {
        for (mode, packer) in &packers {
            let packed = packer.pack(response);
            group.bench_function(BenchmarkId::new(*mode, size), |b| {
                b.iter(|| packer.unpack(black_box(&packed)))
            });
        }
    }
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
    packing,
    middleware,
    log_line
);
criterion_main!(benches);
