//! The real binary: `idemproxy check`, and a smoke run that serves, replays
//! and exits cleanly on SIGTERM.

use crate::support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use idemproxy::config::FlagOverrides;
use idemproxy::Config;
// The binary without the test's `IDEMPROXY_*` variables.
use support::binary::command as idemproxy;
use support::proxy::TestClient;
use support::upstream::TestUpstream;

fn run(cmd: &mut Command) -> (Output, String, String) {
    let out = cmd.output().expect("run idemproxy");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// A configuration text read as the binary reads a file: a route's table
/// inherits `[idempotency]`, which reading it as plain TOML would not do.
fn load(text: &str) -> Config {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(dir.path(), "printed.toml", text);
    Config::load(Some(&file), Vec::new(), &FlagOverrides::default())
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write the config file");
    path
}

const VALID: &str = r#"
listen = "127.0.0.1:18080"

[upstream]
url = "http://127.0.0.1:3001"
timeout = "5s"

[store]
kind = "memory"

[idempotency]
ttl = "1h"
release_statuses = [429]

[[routes]]
name = "payments"
path = "/v1/payments"
require_key = true
"#;

/// A lookup that trusts statuses alone is valid, and `check` says what
/// it risks, naming the field; the default (`"header"`) draws no warning,
/// and a route that inherits `[idempotency]`'s choice is not named twice.
#[test]
fn check_warns_about_a_lookup_that_trusts_statuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let route = "\n[[routes]]\nname = \"refunds\"\npath = \"/v1/refunds\"\n";
    let trusting = VALID.replace(
        "[idempotency]\n",
        "[idempotency]\nreconcile_url = \"/v1/payments/{key}\"\nreconcile_proof = \"status\"\n",
    ) + route;
    let file = write(dir.path(), "trusting.toml", &trusting);
    let (out, _, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file));
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    assert_eq!(
        stderr.matches("warning: ").count(),
        1,
        "one warning, for [idempotency]: {stderr}"
    );
    assert!(
        stderr.contains("warning: idempotency.reconcile_proof = \"status\"")
            && stderr.contains("Idempotency-Lookup"),
        "{stderr}"
    );
    let by_header = VALID.replace(
        "[idempotency]\n",
        "[idempotency]\nreconcile_url = \"/v1/payments/{key}\"\n",
    );
    let file = write(dir.path(), "by-header.toml", &by_header);
    let (out, _, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file));
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    // A route's own choice is named by the route.
    let own = by_header + route + "reconcile_proof = \"status\"\n";
    let file = write(dir.path(), "own.toml", &own);
    let (_, _, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file));
    assert!(
        stderr.contains("warning: routes[1].reconcile_proof = \"status\""),
        "{stderr}"
    );
}

/// The proxy says the same in its log when it starts: an operator who
/// never runs `check` sees it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_trusts_lookup_statuses_warns_when_it_starts() {
    let upstream = TestUpstream::start().await;
    let mut c = support::proxy::config(&upstream.url());
    c.idempotency.reconcile_url = "/v1/payments/{key}".into();
    c.idempotency.reconcile_proof = idemproxy::config::ReconcileProof::Status;
    let proxy = support::binary::ProxyProcess::start(c).await;
    let logs = proxy
        .logs_when(|logs| logs.contains("reconcile_proof"))
        .await;
    assert!(
        logs.contains("WARN") && logs.contains("idempotency.reconcile_proof = \"status\""),
        "{logs}"
    );
}

#[test]
fn check_prints_the_effective_configuration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(dir.path(), "idemproxy.toml", VALID);
    let (out, stdout, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file));
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);

    // The output is itself a complete, valid configuration: the file's values
    // and every default.
    let printed = load(&stdout);
    idemproxy::validate(&printed).expect("printed configuration is valid");
    assert_eq!(printed.listen.to_string(), "127.0.0.1:18080");
    assert_eq!(printed.upstream.url, "http://127.0.0.1:3001");
    assert_eq!(printed.upstream.timeout, Duration::from_secs(5));
    assert_eq!(printed.idempotency.ttl, Duration::from_secs(3600));
    assert_eq!(printed.idempotency.release_statuses, vec![429]);
    assert_eq!(printed.idempotency.methods, vec!["POST", "PATCH"]);
    assert_eq!(printed.admin_listen.to_string(), "127.0.0.1:9090");
    assert_eq!(printed.routes.len(), 1);
    assert_eq!(printed.routes[0].name, "payments");
    assert!(printed.routes[0].idempotency.require_key);
    assert!(stdout.contains("max_response_bytes"), "defaults are shown");
}

#[test]
fn check_applies_environment_and_flag_overrides() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(dir.path(), "idemproxy.toml", VALID);
    let (out, stdout, stderr) = run(idemproxy()
        .arg("check")
        .arg("--config")
        .arg(&file)
        .arg("--listen")
        .arg("127.0.0.1:18081")
        .env("IDEMPROXY_UPSTREAM__TIMEOUT", "7s")
        .env("IDEMPROXY_LISTEN", "127.0.0.1:18082")
        .env("IDEMPROXY_IDEMPOTENCY__ON_IN_FLIGHT", "wait"));
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    let printed = load(&stdout);
    assert_eq!(printed.upstream.timeout, Duration::from_secs(7), "{stdout}");
    assert!(stdout.contains("timeout = \"7s\""), "{stdout}");
    assert_eq!(
        printed.idempotency.on_in_flight,
        idemproxy::config::OnInFlight::Wait
    );
    // Flags win over the environment, which wins over the file.
    assert_eq!(printed.listen.to_string(), "127.0.0.1:18081");

    // Every other flag, as docs/stores.md's replica example uses them.
    let (out, stdout, stderr) = run(idemproxy()
        .arg("check")
        .arg("--config")
        .arg(&file)
        .args(["--admin-listen", "127.0.0.1:19091"])
        .args(["--upstream", "http://10.1.2.3:8000/base"])
        .args(["--store", "redis"])
        .args(["--redis-url", "redis://10.1.2.4:6380/2"]));
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    let printed = load(&stdout);
    assert_eq!(printed.admin_listen.to_string(), "127.0.0.1:19091");
    assert_eq!(printed.upstream.url, "http://10.1.2.3:8000/base");
    assert_eq!(printed.store.kind, idemproxy::config::StoreKind::Redis);
    assert_eq!(printed.store.url, "redis://10.1.2.4:6380/2");
    let (out, stdout, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file).args([
        "--store",
        "embedded",
        "--store-path",
        "/var/lib/idemproxy",
    ]));
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    let printed = load(&stdout);
    assert_eq!(printed.store.kind, idemproxy::config::StoreKind::Embedded);
    assert_eq!(printed.store.path, Path::new("/var/lib/idemproxy"));
    let (out, _, stderr) = run(idemproxy().arg("check").args(["--store", "etcd"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("etcd"), "{stderr}");
}

/// `idemproxy probe`, the image's health check: exit 0 on a 2xx answer
/// only.
#[test]
fn probe_exits_zero_on_2xx_only() {
    use std::io::{Read, Write};
    let answer_once = |status: &'static str| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut request = [0; 1024];
            let _ = conn.read(&mut request);
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            );
        });
        (format!("http://{addr}/readyz"), server)
    };
    for (status, healthy) in [("200 OK", true), ("503 Service Unavailable", false)] {
        let (url, server) = answer_once(status);
        let (out, _, stderr) = run(idemproxy().args(["probe", "--url", &url]));
        server.join().expect("server thread");
        assert_eq!(out.status.success(), healthy, "{status}: {stderr}");
    }
    // Nothing listening (port 1: no test binds it, unlike a port that was
    // free a moment ago).
    let (out, _, _) = run(idemproxy().args(["probe", "--url", "http://127.0.0.1:1/readyz"]));
    assert!(!out.status.success(), "no server, yet healthy");
}

#[test]
fn check_ignores_variables_that_name_no_field_and_says_so() {
    // Kubernetes sets these in every pod of a namespace with a Service
    // named `idemproxy`; `IDEMPROXY_CONFIG` is the `--config` flag's own.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(dir.path(), "idemproxy.toml", VALID);
    let (out, stdout, stderr) = run(idemproxy()
        .arg("check")
        .env("IDEMPROXY_CONFIG", &file)
        .env("IDEMPROXY_PORT", "tcp://10.0.0.7:8080")
        .env("IDEMPROXY_SERVICE_HOST", "10.0.0.7")
        .env("IDEMPROXY_ADMIN_TOKEN", "12345678901234567890123456789012"));
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    assert!(stderr.contains("ignored IDEMPROXY_PORT"), "{stderr}");
    assert!(
        stderr.contains("ignored IDEMPROXY_SERVICE_HOST"),
        "{stderr}"
    );
    assert!(!stderr.contains("IDEMPROXY_CONFIG"), "{stderr}");
    assert!(!stderr.contains("12345678") && !stdout.contains("12345678"));
    let printed = load(&stdout);
    // The file was read through IDEMPROXY_CONFIG.
    let from_file = load(VALID);
    assert_eq!(printed.upstream.url, from_file.upstream.url);
}

#[test]
fn check_refuses_invalid_files_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases = [
        (
            "[idempotency]\nrelease_statuses = [1000]\n",
            "idempotency.release_statuses",
        ),
        ("[upstream]\nurll = \"http://x\"\n", "urll"),
        (
            "[[routes]]\nname = \"r\"\npath = \"/r\"\nmax_request_bytes = 0\n",
            "routes[0].max_request_bytes",
        ),
        ("[upstream]\ntimeout = \"soon\"\n", "timeout"),
    ];
    for (text, field) in cases {
        let file = write(dir.path(), "bad.toml", text);
        let (out, stdout, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file));
        assert_eq!(out.status.code(), Some(2), "{text:?}:\n{stdout}{stderr}");
        assert!(stderr.contains(field), "{text:?}: {stderr}");
        assert!(stdout.is_empty(), "nothing printed for an invalid file");
    }

    // An invalid value from the environment is named as well.
    let file = write(dir.path(), "ok.toml", VALID);
    let (out, _, stderr) = run(idemproxy()
        .arg("check")
        .arg("--config")
        .arg(&file)
        .env("IDEMPROXY_STORE__TIMEOUT", "0s"));
    assert!(!out.status.success());
    assert!(stderr.contains("store.timeout"), "{stderr}");

    // A missing file is an error, not the defaults.
    let (out, _, stderr) = run(idemproxy()
        .arg("check")
        .arg("--config")
        .arg(dir.path().join("missing.toml")));
    assert!(!out.status.success());
    assert!(stderr.contains("missing.toml"), "{stderr}");
}

/// Every string of `value` that is a URL, with where it is
/// (`store.sentinels[1]`).
fn urls_in(value: &toml::Value, at: &str, found: &mut Vec<(String, String)>) {
    match value {
        toml::Value::String(text) if text.contains("://") => {
            found.push((at.to_owned(), text.clone()))
        }
        toml::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                urls_in(item, &format!("{at}[{i}]"), found);
            }
        }
        toml::Value::Table(table) => {
            for (name, item) in table {
                let at = if at.is_empty() {
                    name.clone()
                } else {
                    format!("{at}.{name}")
                };
                urls_in(item, &at, found);
            }
        }
        _ => {}
    }
}

/// `check` prints no credential of any URL in the configuration: Redis,
/// cluster seeds, Sentinels, the OTLP collector, in userinfo or in a
/// token-like query parameter. The printed configuration is walked for
/// every URL it holds, so that a URL field the test did not seed fails it.
/// Before, Sentinel and OTLP URLs were printed as they were.
#[test]
fn check_redacts_the_credentials_of_every_url() {
    const SECRETS: [&str; 8] = [
        "store-url-secret",
        "cluster-secret-1",
        "cluster-token-2",
        "sentinel-secret-1",
        "sentinel-secret-2",
        "otlp-secret",
        "otlp-query-secret",
        "admin-token-secret-0123456789abcdef",
    ];
    let text = format!(
        r#"
admin_token = "{admin}"

[upstream]
url = "http://127.0.0.1:3001"

[store]
kind = "redis-sentinel"
url = "redis://app:{store}@10.0.0.1:6379/0"
urls = ["redis://app:{c1}@10.0.0.2:7000", "rediss://{c2}@10.0.0.3:7000"]
sentinels = ["redis://sentinel:{s1}@10.0.0.4:26379", "redis://:{s2}@10.0.0.5:26379"]
master_name = "mymaster"

[telemetry]
otlp_endpoint = "https://collector:{o1}@otel.example:4318/v1/traces?token={o2}&tenant=t1"
"#,
        admin = SECRETS[7],
        store = SECRETS[0],
        c1 = SECRETS[1],
        c2 = SECRETS[2],
        s1 = SECRETS[3],
        s2 = SECRETS[4],
        o1 = SECRETS[5],
        o2 = SECRETS[6],
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(dir.path(), "secrets.toml", &text);
    let (out, stdout, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file));
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    for secret in SECRETS {
        assert!(
            !stdout.contains(secret) && !stderr.contains(secret),
            "{secret} printed:\n{stdout}{stderr}"
        );
    }
    let printed: toml::Value = toml::from_str(&stdout).unwrap_or_else(|e| panic!("{e}\n{stdout}"));
    let mut found = Vec::new();
    urls_in(&printed, "", &mut found);
    let mut places: Vec<&str> = found.iter().map(|(at, _)| at.as_str()).collect();
    places.sort();
    assert_eq!(
        places,
        [
            "store.sentinels[0]",
            "store.sentinels[1]",
            "store.url",
            "store.urls[0]",
            "store.urls[1]",
            "telemetry.otlp_endpoint",
            "upstream.url",
        ],
        "every URL the configuration holds was seeded with a secret: {found:?}"
    );
    // Where each points is still shown.
    let shown: std::collections::BTreeMap<_, _> = found.into_iter().collect();
    assert_eq!(
        shown["store.sentinels[1]"],
        "redis://:<redacted>@10.0.0.5:26379"
    );
    assert_eq!(
        shown["telemetry.otlp_endpoint"],
        "https://collector:<redacted>@otel.example:4318/v1/traces?token=<redacted>&tenant=t1"
    );

    // Refused URLs are named without their secrets either.
    for bad in [
        "[upstream]\nurl = \"https://svc:upstream-secret@api.internal\"\n",
        "[telemetry]\notlp_endpoint = \"ftp://u:upstream-secret@collector\"\n",
        "[store]\nkind = \"redis-sentinel\"\nmaster_name = \"m\"\nsentinels = [\"http://u:upstream-secret@h\"]\n",
    ] {
        let file = write(dir.path(), "bad.toml", bad);
        let (out, stdout, stderr) = run(idemproxy().arg("check").arg("--config").arg(&file));
        assert_eq!(out.status.code(), Some(2), "{bad}:\n{stdout}{stderr}");
        assert!(
            !stdout.contains("upstream-secret") && !stderr.contains("upstream-secret"),
            "{bad}:\n{stdout}{stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_replays_and_exits_cleanly_on_sigterm() {
    use support::binary::ProxyProcess;
    let upstream = TestUpstream::start().await;
    let mut c = support::proxy::config(&upstream.url());
    c.drain_timeout = Duration::from_secs(3);
    c.log.level = "warn".into();
    // Started on ports below the ephemeral range, healthy on /healthz.
    let mut proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();
    let health = client
        .send(http::Method::GET, &proxy.admin_url("/healthz"), &[], "")
        .await;
    assert_eq!(health.status, 200, "{health:?}");

    let url = proxy.url("/v1/orders");
    let first = client.post_json(&url, "smoke-1", r#"{"amount":5}"#).await;
    assert_eq!(first.status, 201, "{first:?}\n{}", proxy.logs());
    assert!(!first.replayed());
    let retry = client.post_json(&url, "smoke-1", r#"{"amount":5}"#).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.executions("/v1/orders"), 1);
    drop(client);

    proxy.terminate();
    let status = proxy.wait_exit(Duration::from_secs(5)).await;
    assert!(status.success(), "exit status {status}:\n{}", proxy.logs());
}

/// The one line per request, as the binary writes it to a file in each
/// format: the JSON lines parse, both carry the outcome and the key's hash,
/// and neither the raw key nor a terminal colour code shows up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_logs_one_line_per_request_in_either_format() {
    use idemproxy::config::LogFormat;
    use support::binary::ProxyProcess;

    let upstream = TestUpstream::start().await;
    for format in [LogFormat::Json, LogFormat::Human] {
        let mut c = support::proxy::config(&upstream.url());
        c.log.format = format;
        c.log.level = "info".into();
        let proxy = ProxyProcess::start(c).await;
        let client = TestClient::new();
        let url = proxy.url("/v1/orders");
        let key = "raw-key-never-logged";
        assert_eq!(client.post_json(&url, key, "{}").await.status, 201);
        assert!(client.post_json(&url, key, "{}").await.replayed());

        let logs = proxy
            .logs_when(|logs| logs.matches("idemproxy::request").count() >= 2)
            .await;
        assert!(!logs.contains(key), "{format:?}: {logs}");
        assert!(!logs.contains('\x1b'), "{format:?}: {logs}");
        let requests: Vec<&str> = logs
            .lines()
            .filter(|line| line.contains("idemproxy::request"))
            .collect();
        assert_eq!(requests.len(), 2, "{format:?}: {logs}");
        match format {
            LogFormat::Json => {
                for line in logs.lines() {
                    let value: serde_json::Value = serde_json::from_str(line)
                        .unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                    let timestamp = value["timestamp"].as_str().unwrap_or_default();
                    assert!(timestamp.len() == 27 && timestamp.ends_with('Z'), "{line}");
                    assert!(
                        value["level"].is_string() && value["target"].is_string(),
                        "{line}"
                    );
                }
                for (line, outcome) in requests.iter().zip(["executed", "replayed"]) {
                    let value: serde_json::Value = serde_json::from_str(line).expect("JSON");
                    assert_eq!(value["outcome"], outcome, "{line}");
                    assert_eq!(value["status"], 201, "{line}");
                    assert_eq!(value["route"], "default", "{line}");
                    let hash = value["key_hash"].as_str().unwrap_or_default();
                    assert!(
                        hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                        "{line}"
                    );
                    assert!(value["total_ms"].is_f64(), "{line}");
                }
            }
            LogFormat::Human => {
                for (line, outcome) in requests.iter().zip(["executed", "replayed"]) {
                    assert!(
                        line.contains(&format!(
                            " INFO idemproxy::request: route=default method=POST outcome=\"{outcome}\" status=201 key_hash=\""
                        )),
                        "{line}"
                    );
                    assert_eq!(line.as_bytes().get(26), Some(&b'Z'), "{line}");
                }
            }
        }
    }
}

/// `--version` names the release (Cargo.toml's, which the CHANGELOG's
/// latest version matches) and the commit it was built from.
#[test]
fn version_names_the_release_and_the_commit() {
    let (out, stdout, stderr) = run(idemproxy().arg("--version"));
    assert!(out.status.success(), "{stdout}{stderr}");
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run git");
    assert!(commit.status.success(), "git rev-parse failed");
    let commit = String::from_utf8_lossy(&commit.stdout).trim().to_owned();
    assert_eq!(
        stdout.trim(),
        format!("idemproxy {} ({commit})", env!("CARGO_PKG_VERSION"))
    );
    let changelog =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("CHANGELOG.md"))
            .expect("read CHANGELOG.md");
    let released = changelog
        .lines()
        .filter_map(|line| line.strip_prefix("## [")?.split(']').next())
        .find(|version| *version != "Unreleased");
    assert_eq!(
        released,
        Some(env!("CARGO_PKG_VERSION")),
        "CHANGELOG.md's latest release"
    );
}

/// A route scoped by the raw `Authorization` header (the default) says
/// nothing at startup; the first covered request that carries a bearer
/// token, which a refresh would move to a new scope, is warned about once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bearer_token_on_a_route_scoped_by_it_is_warned_about_once() {
    use support::binary::ProxyProcess;
    const WARNING: &str = "scopes keys by the raw Authorization header";
    let upstream = TestUpstream::start().await;
    let mut c = support::proxy::config(&upstream.url());
    c.log.level = "info".into();
    let proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();
    let url = proxy.url("/v1/orders");
    let post = |key: &'static str, authorization: &'static str| {
        let (client, url) = (&client, &url);
        async move {
            let headers = [("idempotency-key", key), ("authorization", authorization)];
            let reply = client.post_json_with(url, &headers, "{}").await;
            assert_eq!(reply.status, 201, "{reply:?}");
        }
    };
    post("k1", "Basic YWxhZGRpbjpvcGVu").await;
    post("k2", "sk_live_api_key").await;
    let logs = proxy
        .logs_when(|logs| logs.matches("idemproxy::request").count() >= 2)
        .await;
    assert!(!logs.contains(WARNING), "{logs}");
    post("k3", "Bearer eyJ.first").await;
    post("k4", "bearer eyJ.refreshed").await;
    let logs = proxy
        .logs_when(|logs| logs.matches("idemproxy::request").count() >= 4)
        .await;
    assert_eq!(logs.matches(WARNING).count(), 1, "{logs}");
    assert!(logs.contains("route `default`"), "{logs}");
}
