//! The ~1 KB JSON body `examples/loadgen` sends (a payment of twelve
//! items), up to its metadata's last field, so that each request can close
//! it with a sequence number of its own. Included by path, not a crate: the
//! fingerprint harness (`crates/idemproxy-core/examples/fingerprint.rs`)
//! measures exactly the bodies the instruction and load benchmarks send.

/// The JSON body up to its metadata's last field.
pub(crate) fn body_head() -> String {
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
    format!(
        r#"{{"customer":"cus_123","currency":"eur","items":[{}],"metadata":{{"sent_at":"2026-11-30T12:00:00Z""#,
        items.join(",")
    )
}
