//! Instructions per request body spent on the fingerprint, under
//! cachegrind: the harness for the JSON canonicalizer's cost
//! (docs/performance.md, "The fingerprint's instructions").
//!
//! ```sh
//! cargo build --release -p idemproxy-core --example fingerprint
//! target/release/examples/fingerprint            # all modes, under valgrind
//! target/release/examples/fingerprint fingerprint canonical
//! ```
//!
//! Without arguments (or with mode names) it runs itself under
//! `valgrind --tool=cachegrind --cache-sim=no` twice per mode, with
//! `SHORT` and `LONG` bodies, and prints the difference over the bodies
//! between them, so that start-up and the bodies' construction cancel, less
//! sha2's SHA-256 block function (valgrind hides the CPU's SHA extensions,
//! so sha2 runs its portable code there, ~20x what the CPU spends). With
//! `run MODE N` it does the work once, as valgrind runs it.
//!
//! The bodies are examples/loadgen.rs's first executions: ~1 KB of JSON,
//! twelve line items and a metadata object, each with a sequence number of
//! its own, so that the fingerprint's memo never answers. The modes:
//!
//! - `fingerprint`: `FingerprintRules::fingerprint` as a first execution
//!   pays it (the framed fields, the memo's lookup and insertion, the
//!   canonical form into SHA-256);
//! - `ignore`: the same with an ignore pointer (`/metadata/sent_at`);
//! - `canonical`: `canonical_json`, the canonical form into a `Vec` (the
//!   parse and the write alone, plus one allocation).

use std::process::{Command, Stdio};

use idemproxy_core::request::fingerprint::{canonical_json, FingerprintRules};

#[path = "../../../examples/common/loadgen_body.rs"]
mod loadgen_body;

const SHORT: u64 = 2_000;
const LONG: u64 = 12_000;
const MODES: [&str; 3] = ["fingerprint", "ignore", "canonical"];

/// Writes `n` in decimal, zero-padded, over `digits`.
fn number_into(digits: &mut [u8], mut n: u64) {
    for d in digits.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

fn run(mode: &str, n: u64) -> Result<(), String> {
    let head = loadgen_body::body_head();
    // loadgen's `{head},"seq":"{run}-{i}"}}`, the number fixed-width so
    // that it is rewritten in place.
    let mut body = format!(r#"{head},"seq":"ins-unique-fp-0000000000"}}}}"#).into_bytes();
    let digits = body.len() - 3 - 10..body.len() - 3;
    let ignore = match mode {
        "ignore" => vec!["/metadata/sent_at".to_owned()],
        _ => Vec::new(),
    };
    let rules = FingerprintRules::parse(&[], &ignore)?;
    let parts = http::Request::post("/v1/payments")
        .header("content-type", "application/json")
        .body(())
        .map_err(|e| e.to_string())?
        .into_parts()
        .0;
    let mut check = 0u8;
    for i in 0..n {
        if let Some(at) = body.get_mut(digits.clone()) {
            number_into(at, i);
        }
        match mode {
            "fingerprint" | "ignore" => {
                let fp = rules.fingerprint(&parts, std::hint::black_box(&body));
                check ^= fp.0[0];
            }
            "canonical" => {
                let out = canonical_json(std::hint::black_box(&body), &[])
                    .ok_or("the body is not I-JSON")?;
                check ^= out.len() as u8;
            }
            other => return Err(format!("unknown mode {other}")),
        }
    }
    std::hint::black_box(check);
    Ok(())
}

/// Instructions cachegrind counts for `run MODE N`, less SHA-256's block
/// function.
fn measure(exe: &str, mode: &str, n: u64) -> Result<u64, String> {
    let out = std::env::temp_dir().join(format!("cachegrind.fp.{}.{mode}.{n}", std::process::id()));
    let status = Command::new("valgrind")
        .args(["--tool=cachegrind", "--cache-sim=no", "--quiet"])
        .arg(format!("--cachegrind-out-file={}", out.display()))
        .args([exe, "run", mode, &n.to_string()])
        // Its warnings about the cache it does not simulate.
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("valgrind: {e}"))?;
    if !status.success() {
        return Err(format!("{mode} {n}: {status}"));
    }
    let annotated = Command::new("cg_annotate")
        .args(["--auto=no", "--threshold=0"])
        .arg(&out)
        .output()
        .map_err(|e| format!("cg_annotate: {e}"))?;
    let _ = std::fs::remove_file(&out);
    let text = String::from_utf8_lossy(&annotated.stdout);
    let count = |line: &str| -> u64 {
        line.split_whitespace()
            .next()
            .map(|n| n.replace(',', ""))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let total = text
        .lines()
        .find(|l| l.contains("PROGRAM TOTALS"))
        .map(count)
        .ok_or("no PROGRAM TOTALS in cg_annotate's output")?;
    let sha: u64 = text
        .lines()
        .filter(|l| l.contains("sha2::sha256::compress256"))
        .map(count)
        .sum();
    Ok(total - sha)
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    if let (Some("run"), Some(mode), Some(n)) = (
        args.get(1).map(String::as_str),
        args.get(2),
        args.get(3).and_then(|n| n.parse().ok()),
    ) {
        return run(mode, n);
    }
    let exe = args.first().ok_or("no program name")?;
    let modes: Vec<&str> = match args.get(1..) {
        Some(rest) if !rest.is_empty() => rest.iter().map(String::as_str).collect(),
        _ => MODES.to_vec(),
    };
    for mode in modes {
        let short = measure(exe, mode, SHORT)?;
        let long = measure(exe, mode, LONG)?;
        let per_body = (long.saturating_sub(short)) as f64 / (LONG - SHORT) as f64;
        println!(
            "{mode:<12} {per_body:>10.0} instructions per body (SHA-256's block function left out)"
        );
    }
    Ok(())
}
