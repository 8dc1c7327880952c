//! Which tools are protected, what the listing tells the model about the
//! key, and what the proxy remembers of the listings it has seen.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// Tools remembered per route: a server lists tens, and a bound keeps a
/// server that lists a new name every time from growing the proxy.
pub const MAX_REMEMBERED_TOOLS: usize = 4096;

/// What the model reads about the key argument in each protected tool.
pub const KEY_DESCRIPTION: &str = "A unique value for this one intended action, e.g. a new UUID. \
To retry the same action (after a timeout or an error), call again with the same value: \
the action runs at most once per value and the retry gets its original result. \
A new action needs a new value.";

/// How a tool's calls are protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// Every call needs a key.
    Required,
    /// A call with a key is protected, one without passes through (the
    /// tool says it is idempotent: `idempotentHint: true`).
    Optional,
    /// Calls pass through untouched (a read-only tool, or skipped).
    None,
}

/// The annotations that decide protection under `protect = "auto"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hints {
    pub read_only: bool,
    pub idempotent: bool,
}

impl Hints {
    fn of(tool: &Map<String, Value>) -> Hints {
        let hint = |name: &str| {
            tool.get("annotations")
                .and_then(|a| a.get(name))
                .and_then(Value::as_bool)
                .unwrap_or(false)
        };
        Hints {
            read_only: hint("readOnlyHint"),
            idempotent: hint("idempotentHint"),
        }
    }
}

/// Which tools `[mcp]` protects before the globs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protect {
    /// Every tool not annotated `readOnlyHint: true`.
    Auto,
    All,
    /// Only `protect_tools`.
    Listed,
}

/// `[mcp]`'s tool classification.
#[derive(Debug, Clone)]
pub struct ToolRules {
    pub key_argument: String,
    protect: Protect,
    protect_tools: GlobSet,
    skip_tools: GlobSet,
}

impl ToolRules {
    /// Fails naming the first glob that does not parse.
    pub fn new(
        key_argument: &str,
        protect: Protect,
        protect_tools: &[String],
        skip_tools: &[String],
    ) -> Result<ToolRules, String> {
        Ok(ToolRules {
            key_argument: key_argument.to_owned(),
            protect,
            protect_tools: globs("protect_tools", protect_tools)?,
            skip_tools: globs("skip_tools", skip_tools)?,
        })
    }

    /// How calls of `name` are protected; `hints` are its annotations if
    /// a listing showed it (a tool never listed is protected).
    pub fn protection(&self, name: &str, hints: Option<Hints>) -> Protection {
        if self.skip_tools.is_match(name) {
            return Protection::None;
        }
        if self.protect_tools.is_match(name) {
            return Protection::Required;
        }
        let hints = hints.unwrap_or_default();
        match self.protect {
            Protect::Listed => Protection::None,
            Protect::All => Protection::Required,
            Protect::Auto if hints.read_only => Protection::None,
            Protect::Auto if hints.idempotent => Protection::Optional,
            Protect::Auto => Protection::Required,
        }
    }

    /// Rewrites a `tools/list` result: each protected tool's `inputSchema`
    /// gains the key argument (listed in `required` unless the key is
    /// optional); everything else is kept. Every listed tool's hints go to
    /// `catalog`. Returns whether anything changed.
    pub fn rewrite_listing(&self, result: &mut Value, catalog: &ToolCatalog) -> bool {
        let Some(tools) = result.get_mut("tools").and_then(Value::as_array_mut) else {
            return false;
        };
        let mut changed = false;
        for tool in tools.iter_mut().filter_map(Value::as_object_mut) {
            let Some(name) = tool.get("name").and_then(Value::as_str).map(str::to_owned) else {
                continue;
            };
            let hints = Hints::of(tool);
            catalog.remember(&name, hints);
            let protection = self.protection(&name, Some(hints));
            if protection == Protection::None {
                continue;
            }
            changed |= self.add_key_argument(tool, protection == Protection::Required);
        }
        changed
    }

    /// The protected tools of a `tools/list` result whose `inputSchema`
    /// already has a property named as the key argument: the proxy would
    /// take the server's own argument for the key and strip it.
    pub fn shadowed_tools(&self, result: &Value) -> Vec<String> {
        let tools = result.get("tools").and_then(Value::as_array);
        tools
            .into_iter()
            .flatten()
            .filter_map(Value::as_object)
            .filter(|tool| {
                tool.get("inputSchema")
                    .and_then(|schema| schema.get("properties"))
                    .and_then(|properties| properties.get(&self.key_argument))
                    .is_some()
            })
            .filter_map(|tool| {
                let name = tool.get("name").and_then(Value::as_str)?;
                let protection = self.protection(name, Some(Hints::of(tool)));
                (protection != Protection::None).then(|| name.to_owned())
            })
            .collect()
    }

    fn add_key_argument(&self, tool: &mut Map<String, Value>, required: bool) -> bool {
        let schema = tool
            .entry("inputSchema")
            .or_insert_with(|| json!({"type": "object"}));
        let Some(schema) = schema.as_object_mut() else {
            return false;
        };
        let properties = schema
            .entry("properties")
            .or_insert_with(|| Value::Object(Map::new()));
        let Some(properties) = properties.as_object_mut() else {
            return false;
        };
        properties.insert(
            self.key_argument.clone(),
            json!({"type": "string", "minLength": 1, "maxLength": 255, "description": KEY_DESCRIPTION}),
        );
        if required {
            let list = schema
                .entry("required")
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Some(list) = list.as_array_mut() {
                if !list.iter().any(|r| r.as_str() == Some(&self.key_argument)) {
                    list.push(Value::String(self.key_argument.clone()));
                }
            }
        }
        true
    }
}

fn globs(field: &str, patterns: &[String]) -> Result<GlobSet, String> {
    let mut set = GlobSetBuilder::new();
    for pattern in patterns {
        let glob = Glob::new(pattern).map_err(|e| format!("{field}: `{pattern}`: {e}"))?;
        set.add(glob);
    }
    set.build().map_err(|e| format!("{field}: {e}"))
}

/// The hints of the tools a route's listings showed, by name (bounded by
/// [`MAX_REMEMBERED_TOOLS`]: past it, new names are not remembered and
/// their calls are protected as tools never listed).
#[derive(Debug, Default)]
pub struct ToolCatalog {
    tools: Mutex<HashMap<String, Hints>>,
    /// Bumped whenever what the catalog says changes, so that what a
    /// listing taught is shared only when it taught something.
    revision: AtomicU64,
}

/// One tool's hints as the shared catalog record holds them.
#[derive(Debug, Serialize, Deserialize)]
struct SharedHints {
    #[serde(rename = "readOnlyHint")]
    read_only: bool,
    #[serde(rename = "idempotentHint")]
    idempotent: bool,
}

impl ToolCatalog {
    pub fn remember(&self, name: &str, hints: Hints) {
        let Ok(mut tools) = self.tools.lock() else {
            return;
        };
        let room = tools.len() < MAX_REMEMBERED_TOOLS || tools.contains_key(name);
        if room && tools.insert(name.to_owned(), hints) != Some(hints) {
            self.revision.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Changes whenever what the catalog says does.
    pub fn revision(&self) -> u64 {
        self.revision.load(Ordering::Relaxed)
    }

    /// The catalog as the shared record holds it: JSON, names sorted, so
    /// the same catalog is the same bytes on every replica.
    pub fn to_shared(&self) -> Vec<u8> {
        let Ok(tools) = self.tools.lock() else {
            return b"{}".to_vec();
        };
        let sorted: BTreeMap<&str, SharedHints> = tools
            .iter()
            .map(|(name, hints)| {
                let hints = SharedHints {
                    read_only: hints.read_only,
                    idempotent: hints.idempotent,
                };
                (name.as_str(), hints)
            })
            .collect();
        serde_json::to_vec(&sorted).unwrap_or_else(|_| b"{}".to_vec())
    }

    /// Learns the tools of a shared record (another replica's listings)
    /// that this catalog does not know: what a listing showed here is
    /// newer or as new. Whether anything was learned.
    pub fn learn_shared(&self, record: &[u8]) -> bool {
        let Ok(shared) = serde_json::from_slice::<BTreeMap<String, SharedHints>>(record) else {
            return false;
        };
        let Ok(mut tools) = self.tools.lock() else {
            return false;
        };
        let mut learned = false;
        for (name, hints) in shared {
            if tools.len() >= MAX_REMEMBERED_TOOLS {
                break;
            }
            if let std::collections::hash_map::Entry::Vacant(entry) = tools.entry(name) {
                entry.insert(Hints {
                    read_only: hints.read_only,
                    idempotent: hints.idempotent,
                });
                learned = true;
            }
        }
        if learned {
            self.revision.fetch_add(1, Ordering::Relaxed);
        }
        learned
    }

    pub fn hints(&self, name: &str) -> Option<Hints> {
        self.tools.lock().ok()?.get(name).copied()
    }

    /// Whether `name` was seen in a listing: the `tool` metric label is
    /// bounded to these.
    pub fn knows(&self, name: &str) -> bool {
        self.hints(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(protect: Protect, protect_tools: &[&str], skip_tools: &[&str]) -> ToolRules {
        let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        ToolRules::new(
            "idempotency_key",
            protect,
            &own(protect_tools),
            &own(skip_tools),
        )
        .expect("valid rules")
    }

    #[test]
    fn auto_protects_all_but_read_only_tools_and_the_globs_decide_first() {
        let read_only = Some(Hints {
            read_only: true,
            idempotent: false,
        });
        let idempotent = Some(Hints {
            read_only: false,
            idempotent: true,
        });
        let auto = rules(Protect::Auto, &["get_*"], &["send_test_*"]);
        assert_eq!(auto.protection("send_email", None), Protection::Required);
        assert_eq!(auto.protection("lookup", read_only), Protection::None);
        assert_eq!(auto.protection("put", idempotent), Protection::Optional);
        assert_eq!(
            auto.protection("get_thing", read_only),
            Protection::Required
        );
        assert_eq!(auto.protection("send_test_x", None), Protection::None);
        let listed = rules(Protect::Listed, &["charge_*"], &[]);
        assert_eq!(listed.protection("charge_card", None), Protection::Required);
        assert_eq!(listed.protection("send_email", None), Protection::None);
        let all = rules(Protect::All, &[], &[]);
        assert_eq!(all.protection("lookup", read_only), Protection::Required);
        let bad = ToolRules::new("k", Protect::Auto, &["[".into()], &[]).expect_err("bad glob");
        assert!(
            bad.contains("protect_tools") && bad.contains("`[`"),
            "{bad}"
        );
    }

    #[test]
    fn a_listing_gains_the_key_on_protected_tools_only() {
        let mut result = json!({"tools": [
            {"name": "send_email", "inputSchema": {"type": "object",
                "properties": {"to": {"type": "string"}}, "required": ["to"]}},
            {"name": "get_weather", "annotations": {"readOnlyHint": true},
                "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}}},
            {"name": "set_flag", "annotations": {"idempotentHint": true}},
        ], "nextCursor": "c"});
        let catalog = ToolCatalog::default();
        let rules = rules(Protect::Auto, &[], &[]);
        assert!(rules.rewrite_listing(&mut result, &catalog));
        let send = &result["tools"][0]["inputSchema"];
        assert_eq!(send["required"], json!(["to", "idempotency_key"]));
        assert_eq!(send["properties"]["to"], json!({"type": "string"}));
        assert_eq!(send["properties"]["idempotency_key"]["type"], "string");
        assert_eq!(
            result["tools"][1]["inputSchema"],
            json!({"type": "object", "properties": {"city": {"type": "string"}}})
        );
        let flag = &result["tools"][2]["inputSchema"];
        assert_eq!(flag["properties"]["idempotency_key"]["type"], "string");
        assert!(
            flag.get("required").is_none(),
            "optional for an idempotent tool"
        );
        assert_eq!(result["nextCursor"], "c");
        assert!(catalog.knows("get_weather"));
        assert_eq!(
            rules.protection("get_weather", catalog.hints("get_weather")),
            Protection::None
        );
        // Rewriting twice adds nothing twice.
        let once = result.clone();
        rules.rewrite_listing(&mut result, &catalog);
        assert_eq!(result, once);
    }

    #[test]
    fn protected_tools_that_declare_the_key_argument_are_named() {
        let result = json!({"tools": [
            {"name": "send", "inputSchema": {"properties": {"idempotency_key": {"type": "string"}}}},
            {"name": "read", "annotations": {"readOnlyHint": true},
                "inputSchema": {"properties": {"idempotency_key": {"type": "string"}}}},
            {"name": "plain", "inputSchema": {"properties": {"to": {"type": "string"}}}},
        ]});
        let rules = rules(Protect::Auto, &[], &[]);
        assert_eq!(rules.shadowed_tools(&result), ["send"]);
    }

    #[test]
    fn a_shared_catalog_fills_in_what_this_one_does_not_know() {
        let here = ToolCatalog::default();
        let read_only = Hints {
            read_only: true,
            idempotent: false,
        };
        here.remember("get", read_only);
        here.remember("send", Hints::default());
        let revision = here.revision();
        here.remember("get", read_only);
        assert_eq!(here.revision(), revision, "nothing new");
        let shared = here.to_shared();
        assert_eq!(
            String::from_utf8_lossy(&shared),
            r#"{"get":{"readOnlyHint":true,"idempotentHint":false},"send":{"readOnlyHint":false,"idempotentHint":false}}"#
        );
        let there = ToolCatalog::default();
        there.remember("send", read_only);
        assert!(there.learn_shared(&shared));
        assert_eq!(there.hints("get"), Some(read_only));
        assert_eq!(there.hints("send"), Some(read_only), "its own listing wins");
        assert!(!there.learn_shared(&shared), "nothing new the second time");
        assert!(!there.learn_shared(b"not json"));
    }

    #[test]
    fn the_catalog_is_bounded() {
        let catalog = ToolCatalog::default();
        for i in 0..MAX_REMEMBERED_TOOLS + 10 {
            catalog.remember(&format!("t{i}"), Hints::default());
        }
        assert!(catalog.knows("t0"));
        assert!(!catalog.knows(&format!("t{}", MAX_REMEMBERED_TOOLS + 5)));
    }
}
