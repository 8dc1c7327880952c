//! Every integration test, in one test binary (`[[test]] integration` in
//! Cargo.toml, with `autotests = false`): one file a module, each where it
//! always was (`tests/NAME.rs`, run alone with
//! `cargo test --test integration NAME::`), sharing `support/` compiled once.
//!
//! One binary instead of one per file: each of the ~35 binaries compiled
//! `support/` again, monomorphised hyper and tokio again and linked every
//! dependency (5-8 s apiece on 2 cores, over half of the test build), and
//! cargo ran them one after another, while the tests mostly wait on real
//! processes (Redis, the binary, Python). In one binary the harness runs
//! them all on its threads at once (`RUST_TEST_THREADS`, .cargo/config.toml).
//!
//! So the tests share one process: nothing in here may set an environment
//! variable, install a global `tracing` subscriber or hold process-wide
//! state that another test reads (see tests/admin.rs's log-reading test).

mod support;

mod admin;
mod agent_keys;
mod architecture;
mod body_framing;
mod chaos;
mod cli;
mod compression;
mod compression_learned;
mod concurrency;
mod config_file;
mod contract_conflicts;
mod contract_failures;
mod contract_keys;
mod contract_replay;
mod demo;
mod deploy;
mod differential_json;
mod doc_links;
mod embedded_crash;
mod embedded_migration;
mod embedded_restart;
mod encryption;
mod fault_garbage;
mod fault_postgres;
mod fault_process;
mod fault_redis;
mod fault_storm;
mod fault_upstream;
mod identity;
mod keys_cli;
mod limits;
mod mcp;
mod metrics;
mod middleware;
mod observe_mode;
mod passthrough;
mod postgres_store;
mod reconcile;
mod redis_store;
mod replicas;
mod sentinel_failover;
mod store_contract;
mod tls;
mod traces;
mod upstream_client;

/// With `autotests = false` a file in tests/ that no `mod` above names is
/// never compiled nor run, silently: each must be declared here.
#[test]
fn every_test_file_is_a_module_of_this_binary() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let main = std::fs::read_to_string(dir.join("main.rs")).expect("read tests/main.rs");
    let declared: std::collections::BTreeSet<&str> = main
        .lines()
        .filter_map(|line| line.strip_prefix("mod ")?.strip_suffix(';'))
        .collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("read tests/") {
        let name = entry.expect("a tests/ entry").file_name();
        let name = name.to_string_lossy();
        if let Some(module) = name.strip_suffix(".rs") {
            if module != "main" && !declared.contains(module) {
                missing.push(format!("mod {module};"));
            }
        }
    }
    missing.sort();
    assert!(
        missing.is_empty(),
        "tests/ files that tests/main.rs does not declare (so never run): add {}",
        missing.join(" ")
    );
}
