//! `config/idemproxy.toml` promises every option with its default and a
//! comment. Each field of `Config` (and of the parts' settings it is
//! composed of) must appear there, set or commented out, under its
//! section; and nothing may be documented there that is no field.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use idemproxy::config::{Config, FlagOverrides, RouteConfig, TlsConfig};

fn shipped() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config/idemproxy.toml")
}

/// Every field's dotted path (`store.compression`, `routes.name`): a
/// configuration with every optional table present, as JSON, walked down
/// to its leaves. An unset `Option` is a leaf (`null`), so it counts too;
/// a list of tables (`routes`) counts by its entries' fields.
fn config_paths() -> BTreeSet<String> {
    let mut config = Config::default();
    let mut tls = TlsConfig::new("cert.pem".into(), "key.pem".into());
    tls.client_ca_file = Some("clients-ca.pem".into());
    config.tls = Some(tls);
    config.routes = vec![RouteConfig::default()];
    let value = serde_json::to_value(&config).expect("a config serializes");
    let mut paths = BTreeSet::new();
    walk("", &value, &mut paths);
    paths
}

fn walk(at: &str, value: &serde_json::Value, paths: &mut BTreeSet<String>) {
    let nested = |field: &str| match at {
        "" => field.to_owned(),
        _ => format!("{at}.{field}"),
    };
    match value {
        serde_json::Value::Object(fields) => {
            for (field, value) in fields {
                walk(&nested(field), value, paths);
            }
        }
        serde_json::Value::Array(items) if items.iter().any(|i| i.is_object()) => {
            for item in items {
                walk(at, item, paths);
            }
        }
        _ => {
            paths.insert(at.to_owned());
        }
    }
}

/// Every `key = value` line of the file, set or commented out, as the
/// dotted path its section (`[store]`, `# [tls]`, `# [[routes]]`) gives it.
fn documented_paths(text: &str) -> BTreeSet<String> {
    let mut section = String::new();
    let mut paths = BTreeSet::new();
    for line in text.lines() {
        let line = line.trim_start().trim_start_matches('#').trim_start();
        if let Some(header) = line.strip_prefix('[') {
            let name: String = header
                .trim_start_matches('[')
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || *c == '.')
                .collect();
            if header.trim_start_matches('[').starts_with(&name) && !name.is_empty() {
                section = name;
            }
            continue;
        }
        let Some((key, _)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        if !key.is_empty()
            && key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            paths.insert(match section.as_str() {
                "" => key.to_owned(),
                section => format!("{section}.{key}"),
            });
        }
    }
    paths
}

#[test]
fn every_field_of_the_config_is_in_the_shipped_file() {
    let text = std::fs::read_to_string(shipped()).expect("config/idemproxy.toml");
    let documented = documented_paths(&text);
    let fields = config_paths();
    // A route may set any field of `[idempotency]`, which documents them.
    let in_file = |path: &String| {
        documented.contains(path)
            || path
                .strip_prefix("routes.")
                .is_some_and(|field| documented.contains(&format!("idempotency.{field}")))
    };
    let missing: Vec<&String> = fields.iter().filter(|path| !in_file(path)).collect();
    assert!(
        missing.is_empty(),
        "fields config/idemproxy.toml does not document (add each, set to its default \
         or commented out, with a comment): {missing:?}"
    );
    let unknown: Vec<&String> = documented.difference(&fields).collect();
    assert!(
        unknown.is_empty(),
        "config/idemproxy.toml documents what is no field: {unknown:?}"
    );
    // The walk itself sees the fields that only some configurations have.
    for path in [
        "tls.client_ca_file",
        "routes.protocol",
        "routes.ttl",
        "mcp.protect",
    ] {
        assert!(fields.contains(path), "{path} in {fields:?}");
    }
}

/// docs/configuration.md indexes every option by its dotted path
/// (`store.compression`), each section's in one row, so a field added to
/// the code and to config/idemproxy.toml is also found from the docs.
#[test]
fn every_field_of_the_config_is_in_the_configuration_reference() {
    let reference = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
    let text = std::fs::read_to_string(reference).expect("docs/configuration.md");
    let indexed = |path: &String| {
        let route_setting = path
            .strip_prefix("routes.")
            .filter(|field| !["name", "path", "protocol"].contains(field));
        match route_setting {
            Some(field) => text.contains(&format!("`idempotency.{field}`")),
            None => text.contains(&format!("`{path}`")),
        }
    };
    let missing: Vec<String> = config_paths().into_iter().filter(|p| !indexed(p)).collect();
    assert!(
        missing.is_empty(),
        "options docs/configuration.md does not index (add each to its section's row of \
         \"Every option\"): {missing:?}"
    );
}

/// The file loads as it is, and what it sets is valid.
#[test]
fn the_shipped_file_loads_and_validates() {
    let config = Config::load(Some(&shipped()), Vec::new(), &FlagOverrides::default())
        .expect("config/idemproxy.toml loads");
    idemproxy::validate(&config).expect("config/idemproxy.toml is valid");
}

/// The README's setups a newcomer copies whole (each `toml` block with an
/// `[upstream]`) load and validate as they are printed.
#[test]
fn the_readmes_setups_load_and_validate() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut checked = 0;
    for block in readme.split("```toml\n").skip(1) {
        let text = block.split("```").next().unwrap_or_default();
        if !text.contains("[upstream]") {
            continue;
        }
        let file = dir.path().join("setup.toml");
        std::fs::write(&file, text).expect("write");
        let config = Config::load(Some(&file), Vec::new(), &FlagOverrides::default())
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        idemproxy::validate(&config).unwrap_or_else(|e| panic!("{e}\n{text}"));
        checked += 1;
    }
    assert_eq!(checked, 2, "the embedded sidecar and the MCP server");
}
