//! Reading the configuration: defaults, then the file, then `IDEMPROXY_*`
//! variables, then flags. The environment is read leniently (Kubernetes
//! adds variables of its own under the same prefix) and errors are
//! stripped of secrets before anyone prints them.

use std::path::Path;

use figment::providers::{Format, Serialized, Toml};
use figment::Figment;

use super::{Config, ConfigError, FlagOverrides, RouteConfig};

impl Config {
    /// Loads defaults, then `file` (if any), then `IDEMPROXY_*` variables from
    /// `env`, then `flags`, each value checked against its field's type.
    /// What the values mean is checked by `idemproxy::validate`, which
    /// runs [`Config::validate`] and parses what the parts take.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &FlagOverrides,
    ) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            // A directory (the volume a ConfigMap is mounted on, say)
            // would read as an empty file to figment: defaults, silently.
            if !file.is_file() {
                let why = if file.exists() {
                    "is not a file"
                } else {
                    "does not exist"
                };
                return Err(ConfigError::Invalid(vec![format!(
                    "config file {} {why}",
                    file.display()
                )]));
            }
            figment = figment.merge(Toml::file(file));
        }
        let mut vars: Vec<(String, String)> = env
            .into_iter()
            // The `--config` flag's own variable, read by the command line.
            .filter(|(k, _)| k.starts_with("IDEMPROXY_") && k != "IDEMPROXY_CONFIG")
            .collect();
        // The file's own types are checked strictly: a file that says
        // `workers = "2"` is wrong, whatever the environment does.
        read(&figment, |file| file.extract().map_err(Box::new))
            .map_err(|e| ConfigError::Load(Box::new(without_secrets(*e))))?;
        // What the variables are laid over: `IDEMPROXY_ROUTES__0__TTL`
        // patches the file's first route.
        let base: figment::value::Dict = figment
            .extract()
            .map_err(|e| ConfigError::Load(Box::new(without_secrets(e))))?;
        let mut ignored_env = Vec::new();
        let mut config: Config = loop {
            let layered = figment
                .clone()
                .merge(EnvVars {
                    vars: vars.clone(),
                    base: base.clone(),
                })
                .merge(flags.as_provider());
            // Lossy: a variable's value is a string, read as a number or a
            // boolean where the field is one (see `EnvVars`).
            match read(&layered, |all| all.extract_lossy().map_err(Box::new)) {
                Ok(config) => break config,
                Err(e) => {
                    let e = *e;
                    // A variable that names no field is not ours: Kubernetes
                    // gives every pod `IDEMPROXY_PORT`, `IDEMPROXY_SERVICE_HOST`...
                    // for a Service named `idemproxy`. Ignored (and logged),
                    // not a reason to refuse to start.
                    let strangers = unknown_env_vars(&e, &vars);
                    if strangers.is_empty() {
                        return Err(ConfigError::Load(Box::new(without_secrets(e))));
                    }
                    vars.retain(|(k, _)| !strangers.contains(k));
                    ignored_env.extend(strangers);
                }
            }
        };
        config.ignored_env = ignored_env;
        Ok(config)
    }

    /// Loads from the process environment.
    pub fn load_from_process(
        file: Option<&Path>,
        flags: &FlagOverrides,
    ) -> Result<Config, ConfigError> {
        Self::load(file, std::env::vars(), flags)
    }
}

/// Each `[[routes]]` table as its route reads it: its own fields
/// ([`RouteConfig::OWN_FIELDS`]), and under `idempotency` the whole
/// `[idempotency]` table with the fields the route sets laid over it.
/// Merged as values, once every layer is in (a variable that changes
/// `[idempotency]` changes what the routes inherit), before anything is
/// typed: a route overrides any field of `[idempotency]`, one added there
/// included, and its values are read as strictly, or as leniently, as the
/// rest of their layer.
fn routes_over_defaults(figment: &Figment) -> Result<Figment, Box<figment::Error>> {
    use figment::value::{Dict, Value};
    let all: Dict = figment.extract()?;
    let Some(Value::Array(_, routes)) = all.get("routes") else {
        return Ok(figment.clone());
    };
    let defaults = match all.get("idempotency") {
        Some(Value::Dict(_, defaults)) => defaults.clone(),
        _ => Dict::new(),
    };
    let routes: Vec<Value> = routes
        .iter()
        .map(|route| match route {
            Value::Dict(tag, table) => {
                let (mut own, overrides): (Dict, Dict) = table
                    .clone()
                    .into_iter()
                    .partition(|(field, _)| RouteConfig::OWN_FIELDS.contains(&field.as_str()));
                let mut settings = defaults.clone();
                settings.extend(overrides);
                own.insert("idempotency".into(), Value::from(settings));
                Value::Dict(*tag, own)
            }
            // Not a table: reported as such when the route is read.
            other => other.clone(),
        })
        .collect();
    let routes = Dict::from([("routes".to_owned(), Value::from(routes))]);
    Ok(figment.clone().merge(Serialized::defaults(routes)))
}

/// `layers` read as a [`Config`] by `extract` (strictly, or leniently),
/// each route over `[idempotency]` ([`routes_over_defaults`]), an error in
/// a route named as the file writes it ([`as_written`]).
fn read(
    layers: &Figment,
    extract: impl Fn(&Figment) -> Result<Config, Box<figment::Error>>,
) -> Result<Config, Box<figment::Error>> {
    extract(&routes_over_defaults(layers)?).map_err(|e| Box::new(as_written(*e, layers)))
}

/// An error in a route named by the field as the file writes it,
/// `routes.0.ttl` (the route's settings sit beside its own fields in its
/// table, see [`routes_over_defaults`]), and by where `layers` took the
/// value from: the route's own table, or `[idempotency]` it inherits.
fn as_written(error: figment::Error, layers: &Figment) -> figment::Error {
    map_each(error, |mut e| {
        if e.path.first().is_none_or(|p| p != "routes") {
            return e;
        }
        if e.path.get(2).is_some_and(|p| p == "idempotency") {
            e.path.remove(2);
        }
        let route = e.path.get(1).and_then(|i| i.parse::<usize>().ok());
        let route = match (route, layers.find_value("routes")) {
            (Some(i), Ok(figment::value::Value::Array(_, routes))) => routes.get(i).cloned(),
            _ => None,
        };
        let field = e.path.get(2);
        // The route's own value, else `[idempotency]`'s, else the route.
        let value = field
            .and_then(|field| route.as_ref()?.find_ref(field).cloned())
            .or_else(|| layers.find_value(&format!("idempotency.{}", field?)).ok())
            .or(route);
        let source = value.and_then(|value| layers.get_metadata(value.tag()));
        if let Some(source) = source {
            e.metadata = Some(source.clone());
        }
        e
    })
}

/// `error` with `f` applied to each error it chains.
fn map_each(
    error: figment::Error,
    f: impl FnMut(figment::Error) -> figment::Error,
) -> figment::Error {
    error
        .into_iter()
        .map(f)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .reduce(|older, newer| older.chain(newer))
        .expect("an error holds at least one")
}

/// figment's error without anything secret in it: a TOML syntax error
/// quotes the offending line (`password = "p4ss\word"`), a type error the
/// value it found (`admin_token = 12345678`). The first loses its quoted
/// lines (line and column stay); the second, for a secret field, its value.
fn without_secrets(error: figment::Error) -> figment::Error {
    use figment::error::Kind;
    map_each(error, |mut e| {
        // A secret field, or the section holding some given as a plain
        // value (`IDEMPROXY_STORE=redis://:pw@h`).
        let secret = e
            .path
            .iter()
            .any(|field| matches!(field.as_str(), "admin_token" | "password" | "url" | "urls"))
            || e.path.last().is_some_and(|field| field == "store");
        let replacement = match &e.kind {
            Kind::Message(message) => Some(Kind::Message(
                message
                    .lines()
                    .filter(|line| {
                        !line
                            .trim_start()
                            .trim_start_matches(|c: char| c.is_ascii_digit())
                            .trim_start()
                            .starts_with('|')
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            )),
            Kind::InvalidType(_, expected) | Kind::InvalidValue(_, expected) if secret => Some(
                Kind::Message(format!("invalid value (not shown), expected {expected}")),
            ),
            _ => None,
        };
        if let Some(kind) = replacement {
            e.kind = kind;
        }
        e
    })
}

impl FlagOverrides {
    fn as_provider(&self) -> Serialized<serde_json::Value> {
        let mut root = serde_json::Map::new();
        if let Some(v) = self.listen {
            root.insert("listen".into(), v.to_string().into());
        }
        if let Some(v) = self.admin_listen {
            root.insert("admin_listen".into(), v.to_string().into());
        }
        if let Some(v) = &self.upstream_url {
            root.insert("upstream".into(), serde_json::json!({ "url": v }));
        }
        let mut store = serde_json::Map::new();
        if let Some(v) = self.store_kind {
            store.insert("kind".into(), serde_json::to_value(v).unwrap_or_default());
        }
        if let Some(v) = &self.store_path {
            store.insert("path".into(), v.display().to_string().into());
        }
        if let Some(v) = &self.redis_url {
            store.insert("url".into(), v.clone().into());
        }
        if !store.is_empty() {
            root.insert("store".into(), store.into());
        }
        Serialized::defaults(serde_json::Value::Object(root))
    }
}

/// The variables among `vars` that `error` says name no field, and that
/// may be someone else's: a name without `__`. Kubernetes names its
/// service variables with single underscores (`IDEMPROXY_PORT`,
/// `IDEMPROXY_SERVICE_HOST`); `__` is this configuration's own nesting, so
/// `IDEMPROXY_IDEMPOTENCY__REQUIRE_KEYS` is a typo to refuse, as in the
/// file, not a stranger to ignore.
fn unknown_env_vars(error: &figment::Error, vars: &[(String, String)]) -> Vec<String> {
    error
        .clone()
        .into_iter()
        .filter(|e| e.metadata.as_ref().is_some_and(|m| m.name == ENV_SOURCE))
        .flat_map(|e| match &e.kind {
            // Only a top-level field can be a stranger's: a variable under
            // a section has `__` in its name. (The path ends with the field,
            // or is empty.)
            figment::error::Kind::UnknownField(field, _)
                if e.path.len() <= 1 && e.path.iter().all(|p| p == field) =>
            {
                vars.iter()
                    .filter(|(k, _)| {
                        k.strip_prefix("IDEMPROXY_")
                            .is_some_and(|rest| rest.eq_ignore_ascii_case(field))
                    })
                    .map(|(k, _)| k.clone())
                    .collect()
            }
            _ => Vec::new(),
        })
        .collect()
}

const ENV_SOURCE: &str = "environment variable(s)";

/// `IDEMPROXY_A__B=v` sets field `a.b`. Figment's own `Env` provider reads
/// the process environment; this one reads an explicit list, so tests and
/// `check` see exactly the variables they pass in.
///
/// A value stays the string it is, unless it is an array or a table
/// (`[429, 503]`: so a secret that starts with `[` or `{` belongs in the
/// file, or in `password_env`); [`Config::load`] reads it as a number or a
/// boolean where the field is one. Parsed up front, `IDEMPROXY_ADMIN_TOKEN=12345678` would
/// have become a number that no string field takes (and the error would
/// have shown the secret), and quotes or spaces around a password would
/// have been dropped.
struct EnvVars {
    vars: Vec<(String, String)>,
    /// Defaults and file, for the lists a variable indexes into: such a list
    /// is given whole, with the variable's change (figment merges tables,
    /// not list items).
    base: figment::value::Dict,
}

impl figment::Provider for EnvVars {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(ENV_SOURCE)
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        use figment::value::{Dict, Map, Value};
        let mut dict = Dict::new();
        // Whole values before the fields set inside them, whatever the
        // environment's order: `IDEMPROXY_ROUTES` first, then
        // `IDEMPROXY_ROUTES__0__TTL` changes its first route.
        let mut vars: Vec<&(String, String)> = self.vars.iter().collect();
        vars.sort_by_key(|(k, _)| k.matches("__").count());
        let base = Value::from(self.base.clone());
        for (k, v) in vars {
            let Some(rest) = k.strip_prefix("IDEMPROXY_") else {
                continue;
            };
            let path: Vec<String> = rest.split("__").map(|p| p.to_ascii_lowercase()).collect();
            let value = match v.parse::<Value>() {
                Ok(parsed @ (Value::Array(..) | Value::Dict(..))) => parsed,
                _ => Value::from(v.clone()),
            };
            insert_path(&mut dict, Some(&base), &path, value)
                .map_err(|why| figment::Error::from(format!("{k}: {why}")))?;
        }
        let mut map = Map::new();
        map.insert(figment::Profile::Default, dict);
        Ok(map)
    }
}

/// Sets `path` to `value` in `dict`. A list that `path` indexes into (the
/// next part is a number) starts as `base`'s list at that place, so that
/// `routes.0.ttl` changes the first route and keeps the others.
fn insert_path(
    dict: &mut figment::value::Dict,
    base: Option<&figment::value::Value>,
    path: &[String],
    value: figment::value::Value,
) -> Result<(), String> {
    use figment::value::{Dict, Value};
    let [first, rest @ ..] = path else {
        return Ok(());
    };
    if rest.is_empty() {
        dict.insert(first.clone(), value);
        return Ok(());
    }
    let base = base.and_then(|b| b.find_ref(first));
    let indexes = rest[0].parse::<usize>().is_ok();
    let entry = dict.entry(first.clone()).or_insert_with(|| match base {
        Some(list @ Value::Array(..)) if indexes => list.clone(),
        _ => Value::from(Dict::new()),
    });
    match entry {
        Value::Dict(_, inner) => insert_path(inner, base, rest, value),
        Value::Array(_, items) => {
            let len = items.len();
            let [index, rest @ ..] = rest else {
                return Ok(());
            };
            let item = index
                .parse::<usize>()
                .ok()
                .and_then(|i| items.get_mut(i))
                .ok_or_else(|| format!("`{first}` has no item {index} (it has {len})"))?;
            match item {
                Value::Dict(_, inner) if !rest.is_empty() => insert_path(inner, None, rest, value),
                _ if rest.is_empty() => {
                    *item = value;
                    Ok(())
                }
                _ => Err(format!("`{first}` item {index} is not a table")),
            }
        }
        _ => Err(format!(
            "`{first}` is set whole by another variable: it has no fields to set"
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::tests::env;

    /// `config/idemproxy.toml` claims to list every option with its
    /// default: loading it must give exactly the defaults.
    #[test]
    fn the_shipped_config_file_is_the_defaults() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/idemproxy.toml");
        let shipped =
            Config::load(Some(&file), env(&[]), &FlagOverrides::default()).expect("file loads");
        let toml = |c: &Config| toml::to_string_pretty(c).expect("renders");
        assert_eq!(toml(&shipped), toml(&Config::default()));
    }

    #[test]
    fn variables_that_name_no_field_are_ignored_and_reported() {
        // What Kubernetes gives every pod for a Service named `idemproxy`,
        // and the `--config` flag's own variable.
        let c = Config::load(
            None,
            env(&[
                ("IDEMPROXY_PORT", "tcp://10.0.0.7:8080"),
                ("IDEMPROXY_SERVICE_HOST", "10.0.0.7"),
                ("IDEMPROXY_PORT_8080_TCP_ADDR", "10.0.0.7"),
                ("IDEMPROXY_CONFIG", "/etc/idemproxy/idemproxy.toml"),
                ("IDEMPROXY_WORKERS", "3"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.workers, 3);
        let mut ignored = c.ignored_env.clone();
        ignored.sort();
        assert_eq!(
            ignored,
            [
                "IDEMPROXY_PORT",
                "IDEMPROXY_PORT_8080_TCP_ADDR",
                "IDEMPROXY_SERVICE_HOST"
            ]
        );
        // A name with this configuration's nesting (`__`) is ours, so one
        // that names no field is a typo, refused as in the file: under a
        // section that exists or one that does not, beside strangers.
        for typo in [
            "IDEMPROXY_IDEMPOTENCY__REQUIRE_KEYS",
            "IDEMPROXY_STORE__NO_SUCH_FIELD",
            "IDEMPROXY_FOO__BAR",
        ] {
            let err = Config::load(
                None,
                env(&[("IDEMPROXY_PORT", "tcp://10.0.0.7:8080"), (typo, "1")]),
                &FlagOverrides::default(),
            )
            .expect_err(typo)
            .to_string();
            // The unknown part is named: the field, or the section.
            let named = typo["IDEMPROXY_".len()..]
                .split("__")
                .any(|part| err.contains(&format!("`{}`", part.to_ascii_lowercase())));
            assert!(err.contains("unknown field") && named, "{typo}: {err}");
        }
        // A bad value for a field that exists is still an error.
        let err = Config::load(
            None,
            env(&[("IDEMPROXY_WORKERS", "many")]),
            &FlagOverrides::default(),
        )
        .expect_err("not a number");
        assert!(err.to_string().contains("workers"), "{err}");
    }

    #[test]
    fn the_file_is_typed_strictly_whatever_the_environment_reads_loosely() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "workers = \"2\"\n").expect("write");
        let err = Config::load(Some(&file), env(&[]), &FlagOverrides::default())
            .expect_err("a string for a number")
            .to_string();
        assert!(err.contains("workers") || err.contains("string"), "{err}");
        std::fs::write(&file, "[idempotency]\nrequire_key = \"on\"\n").expect("write");
        assert!(Config::load(Some(&file), env(&[]), &FlagOverrides::default()).is_err());
        // The same values from the environment are read as intended.
        let c = Config::load(
            None,
            env(&[
                ("IDEMPROXY_WORKERS", "2"),
                ("IDEMPROXY_IDEMPOTENCY__REQUIRE_KEY", "true"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.workers, 2);
        assert!(c.idempotency.require_key);
    }

    #[test]
    fn secrets_from_the_environment_are_taken_as_written() {
        let c = Config::load(
            None,
            env(&[
                ("IDEMPROXY_ADMIN_TOKEN", "12345678"),
                ("IDEMPROXY_STORE__PASSWORD", " \"true\" "),
                ("IDEMPROXY_STORE__USERNAME", "007"),
                ("IDEMPROXY_IDEMPOTENCY__REQUIRE_KEY", "true"),
                ("IDEMPROXY_MAX_IN_FLIGHT", "64"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.admin_token.as_deref(), Some("12345678"));
        assert_eq!(c.store.password.as_deref(), Some(" \"true\" "));
        assert_eq!(c.store.username.as_deref(), Some("007"));
        assert!(c.idempotency.require_key);
        assert_eq!(c.max_in_flight, 64);
    }

    /// DESIGN: every field can be set from the environment, a route's too:
    /// `IDEMPROXY_ROUTES__<i>__<field>` changes the file's route `i` and
    /// leaves the rest of it, and the other routes, as they are.
    #[test]
    fn a_route_field_can_be_set_from_the_environment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            r#"
[[routes]]
name = "payments"
path = "/v1/payments"
require_key = true
[[routes]]
name = "emails"
path = "/v1/emails"
"#,
        )
        .expect("write");
        let c = Config::load(
            Some(&file),
            env(&[
                ("IDEMPROXY_ROUTES__1__REQUIRE_KEY", "true"),
                ("IDEMPROXY_ROUTES__0__TTL", "2h"),
                ("IDEMPROXY_ROUTES__0__RELEASE_STATUSES", "[429]"),
            ]),
            &FlagOverrides::default(),
        )
        .expect("loads");
        assert_eq!(c.routes.len(), 2);
        let (payments, emails) = (&c.routes[0], &c.routes[1]);
        assert_eq!(
            (payments.name.as_str(), emails.name.as_str()),
            ("payments", "emails")
        );
        let (payments, emails) = (&payments.idempotency, &emails.idempotency);
        assert!(payments.require_key, "kept from the file");
        assert_eq!(payments.ttl, Duration::from_secs(7200));
        assert_eq!(payments.release_statuses, vec![429]);
        assert!(emails.require_key);
        assert_eq!(c.routes[1].path, "/v1/emails");

        let err = Config::load(
            Some(&file),
            env(&[("IDEMPROXY_ROUTES__2__TTL", "2h")]),
            &FlagOverrides::default(),
        )
        .expect_err("there is no third route")
        .to_string();
        assert!(err.contains("IDEMPROXY_ROUTES__2__TTL"), "{err}");

        // The whole list from the environment, and a field of it, in either
        // order: the field applies to the list the variable gave.
        for reversed in [false, true] {
            let mut vars = env(&[
                ("IDEMPROXY_ROUTES", r#"[{name = "env", path = "/env"}]"#),
                ("IDEMPROXY_ROUTES__0__TTL", "2h"),
            ]);
            if reversed {
                vars.reverse();
            }
            let c = Config::load(Some(&file), vars, &FlagOverrides::default()).expect("loads");
            assert_eq!(c.routes.len(), 1, "reversed: {reversed}");
            assert_eq!(c.routes[0].name, "env");
            assert_eq!(c.routes[0].idempotency.ttl, Duration::from_secs(7200));
        }
        // A section given as a plain value has no fields to set.
        let err = Config::load(
            None,
            env(&[
                ("IDEMPROXY_STORE", "x"),
                ("IDEMPROXY_STORE__URL", "redis://h"),
            ]),
            &FlagOverrides::default(),
        )
        .expect_err("store is a value and a table")
        .to_string();
        assert!(err.contains("IDEMPROXY_STORE__URL"), "{err}");
    }

    #[test]
    fn file_then_env_then_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            r#"
listen = "127.0.0.1:1111"
[upstream]
url = "http://127.0.0.1:4000"
timeout = "5s"
[idempotency]
ttl = "1h"
[[routes]]
name = "payments"
path = "/v1/payments"
require_key = true
"#,
        )
        .expect("write");
        let c = Config::load(
            Some(&file),
            env(&[
                ("IDEMPROXY_UPSTREAM__TIMEOUT", "7s"),
                ("IDEMPROXY_IDEMPOTENCY__RELEASE_STATUSES", "[429]"),
                ("IDEMPROXY_LISTEN", "127.0.0.1:2222"),
                ("OTHER", "ignored"),
            ]),
            &FlagOverrides {
                listen: Some("127.0.0.1:3333".parse().expect("addr")),
                ..Default::default()
            },
        )
        .expect("loads");
        assert_eq!(c.listen.to_string(), "127.0.0.1:3333");
        assert_eq!(c.upstream.url, "http://127.0.0.1:4000");
        assert_eq!(c.upstream.timeout, Duration::from_secs(7));
        assert_eq!(c.idempotency.release_statuses, vec![429]);
        assert_eq!(c.idempotency.ttl, Duration::from_secs(3600));
        let route = &c.routes[0].idempotency;
        assert!(route.require_key);
        assert_eq!(route.ttl, Duration::from_secs(3600));
    }

    #[test]
    fn a_config_path_that_is_a_directory_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = Config::load(Some(dir.path()), env(&[]), &FlagOverrides::default())
            .expect_err("a directory is no config file")
            .to_string();
        assert!(err.contains("is not a file"), "{err}");
    }

    /// Load errors are printed: a TOML syntax error must not quote the line
    /// with the secret in it, nor a type error a secret's value.
    #[test]
    fn load_errors_do_not_repeat_secrets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("c.toml");
        for (text, secret, still_said) in [
            ("[store]\npassword = \"p4ss\\word\"\n", "p4ss", "line 2"),
            ("admin_token = s3cret\n", "s3cret", "line 1"),
            ("admin_token = 12345678\n", "12345678", "admin_token"),
            ("[store]\nurl = 42424242\n", "42424242", "url"),
            (
                "[store]\nurls = \"redis://:s3cretpw@node:6379\"\n",
                "s3cretpw",
                "urls",
            ),
        ] {
            std::fs::write(&file, text).expect("write");
            let err = Config::load(Some(&file), env(&[]), &FlagOverrides::default())
                .expect_err("invalid")
                .to_string();
            assert!(!err.contains(secret), "{text:?} repeated: {err}");
            assert!(err.contains(still_said), "{text:?}: {err}");
        }
        // A field that holds no secret keeps the value in its message.
        std::fs::write(&file, "workers = \"many\"\n").expect("write");
        let err = Config::load(Some(&file), env(&[]), &FlagOverrides::default())
            .expect_err("invalid")
            .to_string();
        assert!(err.contains("many"), "{err}");

        // A URL given to the store section itself, from the environment.
        let err = Config::load(
            None,
            env(&[("IDEMPROXY_STORE", "redis://:s3cretpw@h:6379")]),
            &FlagOverrides::default(),
        )
        .expect_err("store is a table")
        .to_string();
        assert!(!err.contains("s3cretpw") && err.contains("store"), "{err}");
    }
}
