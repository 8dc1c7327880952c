//! The PostgreSQL store beyond the contract (`store_contract.rs`): TLS
//! with a private CA (`sslmode=require` and `ca_file`, the certificate
//! verified), and a certificate the store does not trust failing at once.

use crate::support;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use idemproxy::config::{StoreKind, StoreSettings};
use idemproxy::store::{BeginOutcome, OnStale, PostgresStore, Store, StoreError};
use support::postgres_server::{self, PostgresServer};
use support::store_fixtures::{begin, new_key};

/// A server that serves TLS with a certificate for `localhost`, and the
/// certificate's file (its own CA).
fn tls_server(dir: &std::path::Path) -> (PostgresServer, std::path::PathBuf) {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
        .expect("generate a certificate");
    let cert = dir.join("server.crt");
    let key = dir.join("server.key");
    std::fs::write(&cert, certified.cert.pem()).expect("write cert");
    std::fs::write(&key, certified.key_pair.serialize_pem()).expect("write key");
    // PostgreSQL reads the key only if its user owns it, mode 0600.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    postgres_server::give_to_server_user(&[dir, &cert, &key]);
    let server = PostgresServer::start_with(&[
        "ssl=on",
        &format!("ssl_cert_file={}", cert.display()),
        &format!("ssl_key_file={}", key.display()),
    ]);
    (server, cert)
}

fn settings(url: String) -> StoreSettings {
    StoreSettings {
        kind: StoreKind::Postgres,
        url,
        table_prefix: postgres_server::unique_prefix("tls"),
        ..StoreSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_with_a_private_ca_verifies_the_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, cert) = tokio::task::block_in_place(|| tls_server(dir.path()));
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=require",
        server.port()
    );
    let trusted = StoreSettings {
        ca_file: Some(cert),
        ..settings(url.clone())
    };
    let store = PostgresStore::connect(&trusted)
        .await
        .expect("connect over TLS");
    let key = new_key();
    let claimed = store
        .begin(&begin(key, 1, Duration::from_secs(30), OnStale::Store))
        .await
        .expect("begin");
    assert!(
        matches!(claimed, BeginOutcome::Acquired { .. }),
        "{claimed:?}"
    );
    let ssl = tokio::task::block_in_place(|| {
        server.sql(
            "SELECT bool_and(ssl) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
                    WHERE application_name = 'idemproxy'",
        )
    });
    assert_eq!(ssl.trim(), "t", "the store's connections use TLS");

    // The system roots do not know the private CA; waiting would not
    // change that, so even a store allowed to wait fails at once.
    let started = Instant::now();
    match PostgresStore::connect_within(&settings(url), Duration::from_secs(10)).await {
        Err(StoreError::Unavailable(message)) => println!("untrusted: {message}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "a TLS failure was retried for {:?}",
        started.elapsed()
    );
}
