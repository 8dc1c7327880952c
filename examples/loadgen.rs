//! A fixed-rate (open-loop) load generator for `benches/load.sh`.
//!
//! wrk measures throughput; its latencies suffer from coordinated omission
//! (a stalled response delays the next request, hiding the stall). Here
//! requests are scheduled at a fixed rate and each latency is measured from
//! the instant the request was *due*, not when it was sent, so a stall shows
//! in the percentiles as it would for real callers.
//!
//! ```sh
//! cargo run --release --example loadgen -- URL RATE SECONDS MODE [RUN]
//! # MODE: unique (a new Idempotency-Key per request) or replay (1,000 warm keys)
//! ```
//! Prints one line: `rate=… sent=… ok=… errors=… p50_ms=… p99_ms=… p999_ms=… max_ms=…`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Mutex;
use tokio::time::Instant;

fn body() -> Bytes {
    let items: Vec<String> = (1..=12)
        .map(|i| {
            format!(
                r#"{{"sku":"item-{i:05}","qty":{},"price":{}.{:02},"tags":["a","b"],"meta":{{"note":"line {i}"}}}}"#,
                i % 7 + 1,
                i * 3,
                i % 100
            )
        })
        .collect();
    Bytes::from(format!(
        r#"{{"customer":"cus_123","currency":"eur","items":[{}],"metadata":{{"sent_at":"2026-11-30T12:00:00Z"}}}}"#,
        items.join(",")
    ))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: loadgen URL RATE SECONDS unique|replay [RUN]");
        std::process::exit(2);
    }
    let url: http::Uri = args[1].parse()?;
    let rate: f64 = args[2].parse()?;
    let seconds: f64 = args[3].parse()?;
    let replay = args[4] == "replay";
    let run = args.get(5).cloned().unwrap_or_else(|| "fixed".into());

    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build_http::<Full<Bytes>>();
    let body = body();
    let histogram = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let interval = Duration::from_secs_f64(1.0 / rate);
    let total = (rate * seconds) as u64;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        let due = start + interval.mul_f64(i as f64);
        tokio::time::sleep_until(due).await;
        let key = if replay {
            format!("warm-{}", i % 1000)
        } else {
            format!("{run}-{i}")
        };
        let request = http::Request::post(url.clone())
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(body.clone()))?;
        let client = client.clone();
        let histogram = histogram.clone();
        let errors = errors.clone();
        tasks.spawn(async move {
            let ok = match client.request(request).await {
                Ok(response) => {
                    let success = response.status().is_success();
                    success && response.into_body().collect().await.is_ok()
                }
                Err(_) => false,
            };
            // From when the request was due: coordinated omission corrected.
            let micros = due.elapsed().as_micros() as u64;
            if ok {
                let _ = histogram.lock().await.record(micros.max(1));
            } else {
                errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let h = histogram.lock().await;
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "rate={rate} sent={total} ok={} errors={} p50_ms={:.3} p99_ms={:.3} p999_ms={:.3} max_ms={:.3}",
        h.len(),
        errors.load(std::sync::atomic::Ordering::Relaxed),
        ms(0.5),
        ms(0.99),
        ms(0.999),
        h.max() as f64 / 1000.0
    );
    Ok(())
}
