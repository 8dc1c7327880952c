//! The files in deploy/ parse, and every metric a Prometheus rule or a
//! Grafana panel uses is one the proxy exports, so dashboards cannot drift
//! from the code silently.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idemproxy::config::{Config, FlagOverrides};
use idemproxy::observe::Metrics;
use idemproxy::observe::RequestOutcome;
use yaml_rust2::{Yaml, YamlLoader};

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn yaml_docs(path: &str) -> Vec<Yaml> {
    let text = std::fs::read_to_string(deploy(path)).expect("deploy file exists");
    YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"))
}

/// Every series name the proxy exports, read from a real exposition after
/// each metric has been touched once.
fn exported_series() -> BTreeSet<String> {
    let m = Metrics::new();
    let route = m.route("default");
    for outcome in RequestOutcome::ALL {
        route.request(outcome, Duration::from_millis(1), None);
    }
    route.upstream(Duration::from_millis(1));
    m.store_call("begin", Duration::from_micros(200), false);
    route.key_released();
    route.lease_expired();
    m.sync_cache_hits(1);
    m.set_cache_live("redis", true);
    drop(m.executing());
    m.render()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// `idemproxy_*` names in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("idemproxy_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

fn check_exprs(source: &str, exprs: &[String]) {
    let exported = exported_series();
    assert!(!exprs.is_empty(), "{source} has no expressions");
    for expr in exprs {
        let names = metric_names(expr);
        assert!(
            !names.is_empty(),
            "{source}: `{expr}` uses no idemproxy metric"
        );
        for name in names {
            assert!(
                exported.contains(&name),
                "{source}: `{name}` is not exported; exported: {exported:?}"
            );
        }
    }
}

#[test]
fn alert_rules_use_exported_metrics() {
    let docs = yaml_docs("prometheus/alerts.yaml");
    let mut exprs = Vec::new();
    for group in docs[0]["groups"].as_vec().expect("groups") {
        for rule in group["rules"].as_vec().expect("rules") {
            assert!(rule["alert"].as_str().is_some(), "every rule is an alert");
            assert!(rule["annotations"]["summary"].as_str().is_some());
            exprs.push(rule["expr"].as_str().expect("expr").to_string());
        }
    }
    assert!(
        exprs.len() >= 4,
        "store errors, outcome unknown, stuck, p99"
    );
    check_exprs("alerts.yaml", &exprs);
}

#[test]
fn dashboard_panels_use_exported_metrics() {
    let text = std::fs::read_to_string(deploy("grafana/idemproxy.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let mut exprs = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    check_exprs("idemproxy.json", &exprs);
}

/// The latency panel shows trace exemplars (`[telemetry]`), and asks for
/// them only from the one histogram the proxy attaches them to.
#[test]
fn dashboard_asks_for_exemplars_where_the_proxy_writes_them() {
    let text = std::fs::read_to_string(deploy("grafana/idemproxy.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let with_exemplars: Vec<String> = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|panel| panel["targets"].as_array().expect("targets"))
        .filter(|target| target["exemplar"] == serde_json::Value::Bool(true))
        .map(|target| target["expr"].as_str().expect("expr").to_string())
        .collect();
    assert!(!with_exemplars.is_empty(), "no panel shows exemplars");
    for expr in &with_exemplars {
        assert_eq!(
            metric_names(expr),
            ["idemproxy_request_duration_seconds_bucket"],
            "exemplars asked of a series without them: {expr}"
        );
    }
    // And the proxy writes them there: a sampled request's trace id.
    let metrics = idemproxy::observe::Metrics::new();
    let trace = opentelemetry::trace::TraceId::from_hex("0af7651916cd43dd8448eb211c80319c")
        .expect("a trace id");
    metrics.route("payments").request(
        RequestOutcome::Executed,
        Duration::from_millis(2),
        Some(trace),
    );
    let rendered = metrics.render();
    // The data sources' provisioning links that label to a trace store.
    let sources = &yaml_docs("grafana/datasources.yaml")[0]["datasources"];
    let links: Vec<(String, String)> = sources
        .as_vec()
        .expect("datasources")
        .iter()
        .flat_map(|source| {
            source["jsonData"]["exemplarTraceIdDestinations"]
                .as_vec()
                .cloned()
                .unwrap_or_default()
        })
        .map(|link| {
            let field = |name: &str| link[name].as_str().expect(name).to_owned();
            (field("name"), field("datasourceUid"))
        })
        .collect();
    assert_eq!(links.len(), 1, "{links:?}");
    let (label, uid) = &links[0];
    assert_eq!(label, "trace_id", "the label the proxy writes");
    assert!(
        sources
            .as_vec()
            .expect("datasources")
            .iter()
            .any(|source| source["uid"].as_str() == Some(uid.as_str())),
        "exemplars link to {uid}, which is not provisioned"
    );
    assert!(
        rendered.lines().any(
            |line| line.starts_with("idemproxy_request_duration_seconds_bucket")
                && line.contains(r#"# {trace_id="0af7651916cd43dd8448eb211c80319c"}"#)
        ),
        "{rendered}"
    );
}

#[test]
fn metric_name_extraction_finds_every_name() {
    assert_eq!(
        metric_names("rate(idemproxy_a_total[5m]) / idemproxy_b_bucket{le=\"1\"}"),
        vec!["idemproxy_a_total", "idemproxy_b_bucket"]
    );
    // The check itself must be able to fail.
    assert!(!exported_series().contains("idemproxy_made_up_total"));
}

/// What both Kubernetes forms share: a ConfigMap the proxy accepts, a
/// Deployment whose proxy container (found by `sidecar_in`, `initContainers`
/// or `containers`) has probes, limits and its Redis password from a
/// Secret, and a PodMonitor. Returns the pod spec, the proxy container and
/// the proxy's configuration.
fn kubernetes_pod(file: &str, sidecar_in: &str) -> (Yaml, Yaml, Config) {
    let docs = yaml_docs(file);
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(kinds, ["ConfigMap", "Deployment", "PodMonitor"], "{file}");

    // The ConfigMap's configuration is one the proxy accepts.
    let toml = docs[0]["data"]["idemproxy.toml"].as_str().expect("config");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idemproxy.toml");
    std::fs::write(&path, toml).expect("write");
    let config = Config::load(Some(&path), Vec::new(), &FlagOverrides::default())
        .unwrap_or_else(|e| panic!("{file}: the ConfigMap's config is invalid: {e}"));
    assert_eq!(config.upstream.url, "http://127.0.0.1:3000");

    let pod = docs[1]["spec"]["template"]["spec"].clone();
    let sidecar = pod[sidecar_in]
        .as_vec()
        .into_iter()
        .flatten()
        .find(|c| c["name"].as_str() == Some("idemproxy"))
        .unwrap_or_else(|| panic!("{file}: no idemproxy container in {sidecar_in}"))
        .clone();
    assert_eq!(
        sidecar["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        sidecar["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert_eq!(
        sidecar["startupProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert!(sidecar["resources"]["limits"]["memory"].as_str().is_some());
    let env = sidecar["env"].as_vec().expect("env");
    assert!(
        env.iter().any(
            |e| e["valueFrom"]["secretKeyRef"]["name"].as_str().is_some()
                && e["name"].as_str() == Some("REDIS_PASSWORD")
        ),
        "{file}: the Redis password comes from a Secret"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let app = pod["containers"]
        .as_vec()
        .into_iter()
        .flatten()
        .find(|c| c["name"].as_str() == Some("app"));
    assert!(app.is_some(), "{file}: the application is a container");
    (pod, sidecar, config)
}

fn grace_period(pod: &Yaml) -> Duration {
    let seconds = pod["terminationGracePeriodSeconds"]
        .as_i64()
        .expect("grace period");
    Duration::from_secs(u64::try_from(seconds).expect("a positive grace period"))
}

/// Kubernetes 1.29 or later: the proxy is a native sidecar, an init
/// container that keeps running (`restartPolicy: Always`), so it is ready
/// (its startupProbe passed) before the application starts and gets
/// SIGTERM after the application exited; no preStop pause is needed.
#[test]
fn kubernetes_native_sidecar_starts_first_and_stops_last() {
    let (pod, sidecar, config) = kubernetes_pod("kubernetes/sidecar.yaml", "initContainers");
    assert_eq!(sidecar["restartPolicy"].as_str(), Some("Always"));
    assert!(
        sidecar["lifecycle"]["preStop"].is_badvalue(),
        "a native sidecar stops after the app: no preStop pause"
    );
    assert!(grace_period(&pod) > config.drain_timeout);
    let containers = pod["containers"].as_vec().expect("containers");
    assert!(
        containers
            .iter()
            .all(|c| c["name"].as_str() != Some("idemproxy")),
        "the proxy is not also a plain container"
    );
}

/// Older clusters: the proxy is a plain container, and both get SIGTERM at
/// once, so a preStop pause keeps it serving while the application
/// finishes the writes it sends through it.
#[test]
fn kubernetes_plain_sidecar_pauses_before_draining() {
    let (pod, sidecar, config) = kubernetes_pod("kubernetes/sidecar-plain.yaml", "containers");
    // The preStop pause comes out of the same grace period.
    let pause: u64 = sidecar["lifecycle"]["preStop"]["exec"]["command"]
        .as_vec()
        .and_then(|c| c.get(1))
        .and_then(Yaml::as_str)
        .and_then(|s| s.parse().ok())
        .expect("a preStop sleep");
    assert!(
        grace_period(&pod) > config.drain_timeout + Duration::from_secs(pause),
        "the pod outlives the pause and the drain"
    );
}

#[test]
fn compose_runs_redis_with_aof_and_health_checks() {
    let docs = yaml_docs("compose.yaml");
    let services = &docs[0]["services"];
    let redis_cmd: Vec<&str> = services["redis"]["command"]
        .as_vec()
        .expect("redis command")
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert!(redis_cmd.windows(2).any(|w| w == ["--appendonly", "yes"]));
    for name in ["redis", "payments-api", "idemproxy"] {
        assert!(
            services[name]["healthcheck"]["test"].as_vec().is_some(),
            "{name} has a health check"
        );
    }
}

#[test]
fn dockerfile_is_multi_stage_and_non_root() {
    let text = std::fs::read_to_string(deploy("Dockerfile")).expect("Dockerfile");
    assert!(text.matches("\nFROM ").count() + usize::from(text.starts_with("FROM ")) >= 2);
    let user = text
        .lines()
        .rfind(|l| l.starts_with("USER "))
        .expect("a USER line");
    assert!(!user.contains("root") && !user.ends_with(" 0"), "{user}");
}
