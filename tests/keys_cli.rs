//! `idemproxy keys` against the real binary on every store, and the
//! runbook (docs/runbook.md) end to end: an upstream that does not answer
//! in time leaves an `outcome-unknown` key; `keys list` finds it, `keys
//! show` looks it up by the raw key, `keys forget` frees it once the
//! operator checked the upstream, and the retry executes. A running claim
//! is listed as pending and not forgotten without `--force`. `keys
//! reconcile` settles such keys by the upstream's lookup: found, absent,
//! failed; a route without `reconcile_url` is refused.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use idemproxy::config::{Config, StoreKind};
use serde_json::Value;
use support::binary::{ProxyProcess, BIN};
use support::keys::{json_post, record_key};
use support::proxy::{config, TestClient};
use support::redis_server::{shared, shared_cluster, unique_prefix, RedisCluster};
use support::upstream::TestUpstream;

const TOKEN: &str = "runbook-admin-token-7d1e-4b9a2c58e0f3a6d1";

/// What `idemproxy keys ARGS` printed, and whether it succeeded.
struct Ran {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", self.stdout, self.stderr))
    }
}

async fn keys(proxy: &ProxyProcess, token: Option<&str>, args: &[&str]) -> Ran {
    let mut command = tokio::process::Command::new(BIN);
    command
        .arg("keys")
        .args(args)
        .arg("--admin")
        .arg(proxy.admin_url(""))
        .env_remove("IDEMPROXY_ADMIN_TOKEN")
        .stdin(std::process::Stdio::null());
    if let Some(token) = token {
        command.env("IDEMPROXY_ADMIN_TOKEN", token);
    }
    let output = tokio::time::timeout(Duration::from_secs(30), command.output())
        .await
        .expect("idemproxy keys finishes")
        .expect("idemproxy keys runs");
    Ran {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// The proxy on `kind`, its upstream answering within 3 s or counted as
/// an unknown outcome (`on_ambiguous = "store"`, the default). The timeout
/// is also how long a held request's claim runs: the runbook test lists
/// it and is refused its `forget` within that time, two runs of the CLI
/// that took more than 300 ms on a loaded machine.
fn proxy_config(upstream: &TestUpstream, kind: StoreKind, dir: &std::path::Path) -> Config {
    let mut c = config(&upstream.url());
    c.admin_token = Some(TOKEN.into());
    c.upstream.timeout = Duration::from_secs(3);
    c.store.kind = kind;
    c.store.key_prefix = unique_prefix("runbook");
    match kind {
        StoreKind::Embedded => c.store.path = dir.join("data"),
        StoreKind::Redis => c.store.url = shared().url(),
        StoreKind::RedisCluster => c.store.urls = shared_cluster().urls(),
        _ => {}
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runbook_reconciles_an_unknown_outcome_on_every_store() {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    for kind in [
        StoreKind::Memory,
        StoreKind::Embedded,
        StoreKind::Redis,
        StoreKind::RedisCluster,
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = tokio::task::block_in_place(|| proxy_config(&upstream, kind, dir.path()));
        let proxy = ProxyProcess::start(c).await;
        let name = format!("{kind:?}").to_lowercase();
        let charge = proxy.url(&format!("/v1/charges/{name}?hold=late-{name}"));
        let key = format!("runbook-{name}");

        // The alert: a charge whose upstream did not answer in time.
        let first = client.post_json(&charge, &key, "{}").await;
        assert_eq!(first.status, 504, "{name}: {first:?}");
        let path = format!("/v1/charges/{name}");
        assert_eq!(upstream.executions(&path), 1);

        // Find the keys.
        let listed = keys(
            &proxy,
            Some(TOKEN),
            &["list", "--state", "outcome-unknown", "--json"],
        )
        .await;
        assert!(listed.ok, "{name}: {}", listed.stderr);
        // Not a terminal: the walk's progress is a plain line on stderr,
        // and stdout stays the JSON answer.
        assert!(
            listed.stderr.contains("keys list: ") && listed.stderr.contains(", 1 listed ("),
            "{name}: {}",
            listed.stderr
        );
        let found = listed.json();
        let found = found.as_array().expect("a list");
        assert_eq!(found.len(), 1, "{name}: {found:?}");
        assert_eq!(found[0]["outcome"], "outcome-unknown (timeout)", "{name}");
        let hash = found[0]["key_hash"].as_str().expect("a hash").to_owned();
        let text = keys(&proxy, Some(TOKEN), &["list", "--state", "outcome-unknown"]).await;
        assert!(
            text.ok && text.stdout.contains(&hash) && text.stdout.contains("\n1 key\n"),
            "{}",
            text.stdout
        );
        let none = keys(
            &proxy,
            Some(TOKEN),
            &[
                "list",
                "--state",
                "outcome-unknown",
                "--older-than",
                "1h",
                "--json",
            ],
        )
        .await;
        assert_eq!(
            none.json(),
            Value::Array(Vec::new()),
            "{name}: none is an hour old"
        );

        // The key a caller reports is the same record.
        let shown = keys(&proxy, Some(TOKEN), &["show", "--key", &key, "--json"]).await;
        assert!(shown.ok, "{name}: {}", shown.stderr);
        assert_eq!(shown.json()["key_hash"], hash.as_str());

        // A running claim is pending, and is not forgotten unless forced.
        let held = proxy.url(&format!("/v1/charges/{name}-held?hold=running-{name}"));
        let running = {
            let (client, held, key) = (client.clone(), held.clone(), format!("{key}-held"));
            tokio::spawn(async move { client.post_json(&held, &key, "{}").await })
        };
        let mut pending = Vec::new();
        for _ in 0..50 {
            let listed = keys(
                &proxy,
                Some(TOKEN),
                &["list", "--state", "pending", "--json"],
            )
            .await;
            pending = listed.json().as_array().cloned().unwrap_or_default();
            if !pending.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(pending.len(), 1, "{name}: the running claim is listed");
        let pending_hash = pending[0]["key_hash"].as_str().expect("a hash");
        let refused = keys(&proxy, Some(TOKEN), &["forget", "--hash", pending_hash]).await;
        assert!(
            !refused.ok && refused.stderr.contains("lease runs"),
            "{name}: {}",
            refused.stderr
        );
        upstream.release(&format!("running-{name}"));
        let _ = running.await;

        // Without the token, nothing is forgotten, and the error says why.
        let anonymous = keys(&proxy, None, &["forget", "--hash", &hash]).await;
        assert!(
            !anonymous.ok && anonymous.stderr.contains("IDEMPROXY_ADMIN_TOKEN"),
            "{}",
            anonymous.stderr
        );

        // Checked with the upstream: the charge never happened. Forget it,
        // and the retry executes.
        let forgot = keys(&proxy, Some(TOKEN), &["forget", "--hash", &hash]).await;
        assert!(
            forgot.ok && forgot.stdout.contains(&format!("forgot {hash}")),
            "{name}: {}",
            forgot.stderr
        );
        upstream.release(&format!("late-{name}"));
        let retry = client.post_json(&charge, &key, "{}").await;
        assert_eq!(retry.status, 201, "{name}: {retry:?}");
        assert!(!retry.replayed());
        assert_eq!(upstream.executions(&path), 2, "{name}: the retry executed");
        let after = keys(&proxy, Some(TOKEN), &["show", "--hash", &hash]).await;
        assert!(
            after.ok && after.stdout.contains("outcome: response"),
            "{name}: {}",
            after.stdout
        );
        drop(proxy);
    }
}

/// A record that does not read (corrupt bytes, or a hash an earlier build
/// left under a key) is listed in every listing, whatever its filter, with
/// why; `keys show` says it does not read (500 `record-unreadable`, not a
/// store that is down), and requests with its key are refused with 500
/// `record-unreadable`; `keys forget` clears it, and the retry executes.
/// Before, a walk passed over the first in silence and ended at the second
/// with a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_record_is_listed_shown_and_forgotten() {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let c = tokio::task::block_in_place(|| proxy_config(&upstream, StoreKind::Redis, dir.path()));
    let prefix = c.store.key_prefix.clone();
    let proxy = ProxyProcess::start(c).await;
    const TARGET: &str = "/v1/charges/unreadable";
    let done = client.post_json(&proxy.url(TARGET), "fine", "{}").await;
    assert_eq!(done.status, 201, "{done:?}");

    let key_of = |key: &str| record_key(&json_post(TARGET), key);
    let (garbled, old_layout) = (key_of("garbled"), key_of("old-layout"));
    let name = |key| idemproxy::store::redis::redis_key(&prefix, &key);
    shared().cli(&["SET", &name(garbled), "garbage"]);
    shared().cli(&["HSET", &name(old_layout), "st", "x"]);
    let mut both = vec![garbled.to_hex(), old_layout.to_hex()];
    both.sort();

    for filter in [
        &["--state", "any"][..],
        &["--state", "outcome-unknown"],
        &["--state", "pending", "--older-than", "1h"],
    ] {
        let listed = keys(
            &proxy,
            Some(TOKEN),
            &[&["list", "--json"][..], filter].concat(),
        )
        .await;
        assert!(listed.ok, "{filter:?}: {}", listed.stderr);
        let found = listed.json();
        let unreadable: BTreeMap<String, String> = found
            .as_array()
            .expect("a list")
            .iter()
            .filter(|k| k["state"] == "unreadable")
            .map(|k| {
                (
                    k["key_hash"].to_string().replace('"', ""),
                    k["error"].to_string(),
                )
            })
            .collect();
        assert_eq!(
            unreadable.keys().cloned().collect::<Vec<_>>(),
            both,
            "{filter:?}: {found}"
        );
        assert!(
            unreadable[&old_layout.to_hex()].contains("WRONGTYPE"),
            "{found}"
        );
    }
    let text = keys(&proxy, Some(TOKEN), &["list"]).await;
    let line = text
        .stdout
        .lines()
        .find(|line| line.starts_with(&garbled.to_hex()))
        .unwrap_or_else(|| panic!("{}", text.stdout));
    assert!(
        line.contains("unreadable") && line.contains("not a record"),
        "{line}"
    );

    let shown = keys(&proxy, Some(TOKEN), &["show", "--hash", &garbled.to_hex()]).await;
    assert!(
        !shown.ok
            && shown.stderr.contains("500")
            && shown.stderr.contains("does not read")
            && shown.stderr.contains("keys forget"),
        "{}{}",
        shown.stdout,
        shown.stderr
    );
    // Requests with the key are refused as permanent (500, not a 503 that
    // SDKs retry for a day), never executed: garbage bytes, and a value
    // of another type.
    for key in ["garbled", "old-layout"] {
        let refused = client.post_json(&proxy.url(TARGET), key, "{}").await;
        refused.assert_record_unreadable();
    }
    assert_eq!(upstream.executions(TARGET), 1);

    for key in [garbled, old_layout] {
        let forgot = keys(
            &proxy,
            Some(TOKEN),
            &["forget", "--yes", "--hash", &key.to_hex()],
        )
        .await;
        assert!(forgot.ok, "{}", forgot.stderr);
    }
    let listed = keys(&proxy, Some(TOKEN), &["list", "--state", "any", "--json"]).await;
    assert_eq!(
        listed.json().as_array().map(Vec::len),
        Some(1),
        "{}",
        listed.stdout
    );
    let retry = client.post_json(&proxy.url(TARGET), "garbled", "{}").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(upstream.executions(TARGET), 2);
}

/// A listing across a resharding, through the binary: the admin API
/// answers a cursor from before the primaries changed with 409
/// `walk-interrupted` rather than going on from another node, every key
/// still replays from where its record moved, and `keys list` walks the
/// new layout whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_across_a_resharding_starts_again_and_misses_nothing() {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    let mut cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = proxy_config(&upstream, StoreKind::RedisCluster, dir.path());
    c.store.urls = cluster.urls();
    let proxy = ProxyProcess::start(c).await;
    const TARGET: &str = "/v1/charges/reshard";
    for i in 0..40 {
        let done = client
            .post_json(&proxy.url(TARGET), &format!("reshard-{i}"), "{}")
            .await;
        assert_eq!(done.status, 201, "{done:?}");
    }
    let admin = |path: String| {
        let (client, url) = (client.clone(), proxy.admin_url(&path));
        async move {
            client
                .send(
                    http::Method::GET,
                    &url,
                    &[("authorization", &format!("Bearer {TOKEN}"))],
                    String::new(),
                )
                .await
        }
    };
    let first = admin("/v1/keys?limit=1".into()).await;
    assert_eq!(first.status, 200, "{first:?}");
    let cursor = first.json()["next_cursor"]
        .as_str()
        .expect("40 keys on 3 nodes take more than one page")
        .to_owned();

    tokio::task::block_in_place(|| {
        let added = cluster.add_master();
        cluster.reshard_to(added, 4096);
    });
    let interrupted = admin(format!("/v1/keys?cursor={cursor}")).await;
    interrupted.assert_problem(409, "walk-interrupted");

    for i in 0..40 {
        let replay = client
            .post_json(&proxy.url(TARGET), &format!("reshard-{i}"), "{}")
            .await;
        assert!(replay.replayed(), "{replay:?}");
    }
    assert_eq!(upstream.executions(TARGET), 40);
    let listed = keys(
        &proxy,
        Some(TOKEN),
        &["list", "--state", "any", "--limit", "1000", "--json"],
    )
    .await;
    assert!(listed.ok, "{}", listed.stderr);
    let hashes: std::collections::BTreeSet<String> = listed
        .json()
        .as_array()
        .expect("a list")
        .iter()
        .map(|k| k["key_hash"].as_str().expect("a hash").to_owned())
        .collect();
    assert_eq!(hashes.len(), 40, "{}", listed.stdout);
}

/// Arguments as `keys` takes them.
fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `keys reconcile` against the real binary on `kind`: three keys left
/// `outcome-unknown` by an upstream that did not answer in time, each
/// reconciled past its lease by the CLI, given the request as its client
/// sent it, with the lookup answering found (200, `Idempotency-Lookup:
/// found`), absent (404, `absent`) or neither (a bare 404, a 500), as
/// `x-lookup-status` and `x-lookup-said` (headers the route's
/// `reconcile_url` names) ask; another request than the key's, and a
/// route without `reconcile_url`, are refused. Nothing executes on the
/// CLI's account.
async fn keys_reconcile_settles_found_absent_and_failed(kind: StoreKind) {
    let upstream = TestUpstream::start().await;
    let client = TestClient::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let name = format!("{kind:?}").to_lowercase();
    let mut c = tokio::task::block_in_place(|| proxy_config(&upstream, kind, dir.path()));
    // Lease: 300 ms upstream timeout + 1.4 s margin + 300 ms lookup.
    c.upstream.timeout = Duration::from_millis(300);
    c.idempotency.lease_margin = Duration::from_millis(1400);
    c.routes = vec![idemproxy::config::RouteConfig {
        name: "plain".into(),
        path: "/v1/plain".into(),
        idempotency: c.idempotency.clone(),
        ..idemproxy::config::RouteConfig::default()
    }];
    c.idempotency.reconcile_url =
        "/lookup/{key}?status={header:x-lookup-status}&header=idempotency-lookup:{header:x-lookup-said}"
            .into();
    let proxy = ProxyProcess::start(c).await;
    let charge = proxy.url(&format!("/v1/charges/{name}?delay_ms=1000"));
    let path = format!("/v1/charges/{name}");
    // The charges as their client sent them, for `keys reconcile`.
    let sent = format!("/v1/charges/{name}?delay_ms=1000");
    let body_file = dir.path().join("body.json");
    std::fs::write(&body_file, "{}").expect("body file");
    let body_file = body_file.to_str().expect("utf-8 path");
    let reconcile = |key: &str, lookup: &[&str]| {
        let mut args = vec!["reconcile".to_owned(), "--key".into(), key.into()];
        for arg in [
            "--path",
            &sent,
            "--header",
            "content-type: application/json",
        ] {
            args.push(arg.into());
        }
        args.extend(["--body".into(), body_file.into()]);
        for header in lookup {
            args.extend(["--header".into(), (*header).to_owned()]);
        }
        args
    };
    const FOUND: [&str; 2] = ["x-lookup-status: 200", "x-lookup-said: found"];
    const ABSENT: [&str; 2] = ["x-lookup-status: 404", "x-lookup-said: absent"];
    for outcome in ["found", "absent", "failed"] {
        let key = format!("reconcile-{outcome}-{name}");
        let first = client.post_json(&charge, &key, "{}").await;
        first.assert_problem(504, "outcome-unknown");
    }
    let plain_key = format!("reconcile-plain-{name}");
    let plain = client
        .post_json(&proxy.url("/v1/plain?delay_ms=1000"), &plain_key, "{}")
        .await;
    plain.assert_problem(504, "outcome-unknown");
    assert_eq!(upstream.executions(&path), 3, "{name}");

    // Within the lease the upstream may still be at work: nothing taken.
    let mut args = reconcile(&format!("reconcile-found-{name}"), &FOUND);
    args.push("--json".into());
    let early = keys(&proxy, Some(TOKEN), &strs(&args)).await;
    assert!(early.ok, "{name}: {}", early.stderr);
    assert_eq!(
        early.json()["result"],
        "unchanged",
        "{name}: {}",
        early.stdout
    );
    assert_eq!(
        upstream.executions(&format!("/lookup/reconcile-found-{name}")),
        0
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;

    // Found: stored, replayed to the retry, marked reconciled.
    let key = format!("reconcile-found-{name}");
    // Not the key's request (another path): refused, nothing looked up.
    let mut args = reconcile(&key, &FOUND);
    args[4] = path.clone();
    let mismatch = keys(&proxy, Some(TOKEN), &strs(&args)).await;
    assert!(
        !mismatch.ok
            && mismatch.stderr.contains("409")
            && mismatch.stderr.contains("not the request"),
        "{name}: {}",
        mismatch.stderr
    );
    assert_eq!(upstream.executions(&format!("/lookup/{key}")), 0);
    let found = keys(&proxy, Some(TOKEN), &strs(&reconcile(&key, &FOUND))).await;
    assert!(found.ok, "{name}: {}", found.stderr);
    assert!(
        found.stdout.starts_with("found: the upstream answered 200"),
        "{name}: {}",
        found.stdout
    );
    let retry = client.post_json(&charge, &key, "{}").await;
    assert_eq!(retry.status, 200, "{name}: {retry:?}");
    assert!(retry.replayed(), "{name}: {retry:?}");
    assert_eq!(retry.header("idempotency-reconciled"), Some("true"));
    assert_eq!(retry.json()["path"], format!("/lookup/{key}"));

    // Absent: the key is free, the next retry executes.
    let key = format!("reconcile-absent-{name}");
    let mut args = reconcile(&key, &ABSENT);
    args.push("--json".into());
    let absent = keys(&proxy, Some(TOKEN), &strs(&args)).await;
    assert!(absent.ok, "{name}: {}", absent.stderr);
    assert_eq!(absent.json()["result"], "absent", "{name}");
    let text = keys(&proxy, Some(TOKEN), &["show", "--key", &key]).await;
    assert!(
        !text.ok && text.stderr.contains("404"),
        "{name}: {}",
        text.stdout
    );

    // Failed: why, and the key stays outcome-unknown.
    let key = format!("reconcile-failed-{name}");
    // A bare 404 is no proof that the charge never happened (a lookup
    // route the upstream lacks answers one too); neither is a 500.
    let bare = keys(
        &proxy,
        Some(TOKEN),
        &strs(&reconcile(
            &key,
            &["x-lookup-status: 404", "x-lookup-said: none"],
        )),
    )
    .await;
    assert!(
        bare.ok && bare.stdout.contains("neither `found` nor `absent`"),
        "{name}: {}",
        bare.stdout
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let failed = keys(
        &proxy,
        Some(TOKEN),
        &strs(&reconcile(
            &key,
            &["x-lookup-status: 500", "x-lookup-said: absent"],
        )),
    )
    .await;
    assert!(failed.ok, "{name}: {}", failed.stderr);
    assert!(
        failed.stdout.contains("the lookup answered 500")
            && failed.stdout.contains("the key stays outcome-unknown"),
        "{name}: {}",
        failed.stdout
    );
    let shown = keys(&proxy, Some(TOKEN), &["show", "--key", &key, "--json"]).await;
    assert_eq!(
        shown.json()["outcome"],
        "outcome-unknown (timeout)",
        "{name}"
    );

    // A value the template names missing, or a key with no record:
    // refused, nothing looked up.
    let incomplete = keys(&proxy, Some(TOKEN), &strs(&reconcile(&key, &[]))).await;
    assert!(
        !incomplete.ok && incomplete.stderr.contains("422"),
        "{name}: {}",
        incomplete.stderr
    );
    let unknown = keys(&proxy, Some(TOKEN), &strs(&reconcile("never-sent", &FOUND))).await;
    assert!(
        !unknown.ok && unknown.stderr.contains("404"),
        "{name}: {}",
        unknown.stderr
    );
    assert_eq!(upstream.executions("/lookup/never-sent"), 0, "{name}");

    // A route without reconcile_url: refused, nothing changed.
    let refused = keys(
        &proxy,
        Some(TOKEN),
        &[
            "reconcile",
            "--key",
            &plain_key,
            "--route",
            "plain",
            "--path",
            "/v1/plain?delay_ms=1000",
        ],
    )
    .await;
    assert!(
        !refused.ok
            && refused.stderr.contains("409")
            && refused.stderr.contains("no reconcile_url"),
        "{name}: {}",
        refused.stderr
    );
    assert_eq!(upstream.executions("/v1/plain"), 1, "{name}");
    assert_eq!(
        upstream.executions(&path),
        3,
        "{name}: the CLI executed nothing"
    );
    // The absent key's retry executes, once.
    let key = format!("reconcile-absent-{name}");
    let retry = client.post_json(&proxy.url(&path), &key, "{}").await;
    assert_eq!(retry.status, 201, "{name}: {retry:?}");
    assert!(!retry.replayed(), "{name}: {retry:?}");
    assert_eq!(upstream.executions(&path), 4, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reconcile_on_the_memory_store() {
    keys_reconcile_settles_found_absent_and_failed(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reconcile_on_the_embedded_store() {
    keys_reconcile_settles_found_absent_and_failed(StoreKind::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reconcile_on_redis() {
    keys_reconcile_settles_found_absent_and_failed(StoreKind::Redis).await;
}
