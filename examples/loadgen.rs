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
//! # MODE: unique (a new Idempotency-Key per request), replay (1,000 warm
//! #       keys), or passthrough (unique bodies without a key: forwarded
//! #       unprotected, the proxy without its idempotency work)
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

#[path = "common/loadgen_body.rs"]
mod loadgen_body;

/// The body of a request: the same bytes for every replay of the warmed
/// keys; for a first execution (`seq`) a body of its own, as distinct
/// operations have (the same bytes every time would let the proxy reuse one
/// canonical fingerprint for all of them).
fn body(head: &str, seq: Option<&str>) -> Bytes {
    Bytes::from(match seq {
        Some(seq) => format!(r#"{head},"seq":"{seq}"}}}}"#),
        None => format!("{head}}}}}"),
    })
}

#[tokio::main(worker_threads = 1)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: loadgen URL RATE SECONDS unique|replay|passthrough [RUN]");
        std::process::exit(2);
    }
    let url: http::Uri = args[1].parse()?;
    let rate: f64 = args[2].parse()?;
    let seconds: f64 = args[3].parse()?;
    let replay = args[4] == "replay";
    let keyed = args[4] != "passthrough";
    let run = args.get(5).cloned().unwrap_or_else(|| "fixed".into());

    // wrk2's model: a fixed set of connections, each sending its share of
    // the rate on its own schedule, one request at a time. A connection that
    // falls behind sends at once, and the time it was late counts in the
    // latency of every request it delays.
    let connections: usize = std::env::var("CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32);
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(connections)
        .build_http::<Full<Bytes>>();
    let head = Arc::new(loadgen_body::body_head());
    let replay_body = body(&head, None);
    let histogram = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let total = (rate * seconds) as u64;
    let interval = Duration::from_secs_f64(connections as f64 / rate);
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..connections as u64 {
        let (client, head, replay_body, histogram, errors, url, run) = (
            client.clone(),
            head.clone(),
            replay_body.clone(),
            histogram.clone(),
            errors.clone(),
            url.clone(),
            run.clone(),
        );
        // Offsets spread the connections' schedules over one interval.
        let offset = interval.mul_f64(worker as f64 / connections as f64);
        workers.spawn(async move {
            let mut local =
                Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).map_err(|e| e.to_string())?;
            let mut i = worker;
            let mut n = 0u64;
            while i < total {
                let due = start + offset + interval.mul_f64(n as f64);
                tokio::time::sleep_until(due).await;
                let (key, payload) = if replay {
                    (format!("warm-{}", i % 1000), replay_body.clone())
                } else {
                    let key = format!("{run}-{i}");
                    let payload = body(&head, Some(&key));
                    (key, payload)
                };
                let mut request =
                    http::Request::post(url.clone()).header("content-type", "application/json");
                if keyed {
                    request = request.header("idempotency-key", key);
                }
                let request = request
                    .body(Full::new(payload))
                    .map_err(|e| e.to_string())?;
                let ok = match client.request(request).await {
                    Ok(response) => {
                        let success = response.status().is_success();
                        response.into_body().collect().await.is_ok() && success
                    }
                    Err(_) => false,
                };
                if ok {
                    // From when the request was due: coordinated omission
                    // corrected.
                    let _ = local.record((due.elapsed().as_micros() as u64).max(1));
                } else {
                    errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                i += connections as u64;
                n += 1;
            }
            histogram
                .lock()
                .await
                .add(&local)
                .map_err(|e| e.to_string())?;
            Ok::<(), String>(())
        });
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
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
