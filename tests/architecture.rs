//! The crates' layers point one way (DESIGN §4; docs/development.md, "Layout", quotes
//! the order). [`LAYERS`] below is the one place that order is written,
//! for both crates: the proxy (`src/`) and the pure layers it builds on
//! (`crates/idemproxy-core/src/`: `core`, `request`, `mcp`, `packed`).
//! This test reads every `crate::<module>` path in both, and every
//! `idemproxy_core::<module>` path in the proxy, and fails on one that
//! points the wrong way: `store` naming `idempotency`, `config` naming
//! `admin`, `core` naming anything, `request` naming `http`, `idempotency`
//! naming `forward`, and so on. The core crate cannot name the proxy at
//! all (it is not among its dependencies); [`the_core_crate_stays_pure`]
//! keeps what it does depend on free of runtime, server and store crates.
//!
//! Each top-level module may name only the modules listed for it below;
//! the composition root (`lib.rs`, `main.rs`, `settings.rs`, `demo.rs`)
//! may name any. `testing` (unit-test helpers) may be named from anywhere.
//!
//! Inside a layer: no `super::super::` path, and no import cycle between
//! its files (a ratchet, [`KNOWN_CYCLE`], holds the ones not yet broken).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every layer and what it may import, bottom up. A module missing from
/// this list fails the test, so a new one takes a deliberate place.
const LAYERS: &[(&str, &[&str])] = &[
    ("core", &[]),
    ("http", &["core"]),
    ("observe", &["core", "http"]),
    ("store", &["core", "packed"]),
    ("forward", &["core", "http", "observe"]),
    ("request", &["core"]),
    ("mcp", &[]),
    ("packed", &["core"]),
    (
        "idempotency",
        &["core", "http", "observe", "store", "request", "mcp"],
    ),
    ("server", &["core", "http", "observe", "forward"]),
    (
        "admin",
        &["core", "http", "observe", "store", "request", "idempotency"],
    ),
    // The file's shape, composed of the parts' own settings types; only
    // the composition root reads it.
    (
        "config",
        &["core", "store", "forward", "request", "mcp", "idempotency"],
    ),
];

/// The composition root: it reads `Config` and builds every part.
const ROOT: &[&str] = &["lib", "main", "settings", "demo", "tools"];

/// Named from anywhere: helpers compiled for unit tests only.
const ANYWHERE: &[&str] = &["testing"];

/// The source roots the checks read: the proxy's, then the core crate's.
const SOURCES: &[&str] = &["src", "crates/idemproxy-core/src"];

/// What names a module of either crate: `crate::` in both; in the proxy
/// also `idemproxy_core::`, the core crate's modules by their own name.
const PREFIXES: &[&str] = &["crate::", "idemproxy_core::"];

/// Each source root, as a path, with how its files are named in messages
/// and in [`KNOWN_CYCLE`]: the proxy's relative to `src/` (as they always
/// were), the core crate's from the repository root.
fn roots() -> Vec<(PathBuf, &'static str)> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    SOURCES
        .iter()
        .map(|root| {
            let label = if *root == "src" {
                ""
            } else {
                "crates/idemproxy-core/src/"
            };
            (manifest.join(root), label)
        })
        .collect()
}

#[test]
fn imports_point_down_the_layers() {
    let mut wrong = Vec::new();
    for (src, _) in roots() {
        let root = src.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap_or(&src);
        for file in rust_files(&src) {
            let module = top_module(&src, &file);
            let text = std::fs::read_to_string(&file).expect("read a source file");
            let relative = file.strip_prefix(&src).unwrap_or(&file).display();
            for (line, target) in crate_paths(&text) {
                if let Err(why) = allowed(&module, &target) {
                    wrong.push(format!("{}/{relative}:{line}: {why}", root.display()));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that point the wrong way:\n{}",
        wrong.join("\n")
    );
}

/// The checker itself, on planted sources: a test that passes because it
/// reads nothing would be worth nothing.
#[test]
fn a_wrong_way_import_is_found() {
    let planted = [
        ("store", "use crate::idempotency::Policies;\n"),
        ("config", "use crate::admin::AdminState;\n"),
        ("core", "    let x = crate::store::MemoryStore::new();\n"),
        (
            "idempotency",
            "use crate::{core::RecordKey, forward::Upstream};\n",
        ),
        (
            "http",
            "use crate::{\n    core::Record,\n    observe::Metrics,\n};\n",
        ),
        ("request", "use idemproxy_core::packed::Packer;\n"),
        (
            "mcp",
            "    let r = idemproxy_core::request::key::parse_key(v);\n",
        ),
    ];
    for (module, text) in planted {
        let found: Vec<_> = crate_paths(text)
            .into_iter()
            .filter(|(_, target)| allowed(module, target).is_err())
            .collect();
        assert_eq!(found.len(), 1, "{module}: {text:?} gave {found:?}");
    }
    // Comments and the module's own paths do not count; allowed ones pass.
    let fine = "// see crate::idempotency\n/// [`crate::forward`]\nuse crate::core::Record;\nuse idemproxy_core::packed::Packer;\n";
    assert!(crate_paths(fine)
        .iter()
        .all(|(_, target)| allowed("store", target).is_ok()));
    assert!(allowed("settings", "config").is_ok());
    assert!(
        allowed("brand_new", "core").is_err(),
        "unlisted modules fail"
    );
}

/// Whether `module` may name `target`.
fn allowed(module: &str, target: &str) -> Result<(), String> {
    if module == target || ROOT.contains(&module) || ANYWHERE.contains(&target) {
        return Ok(());
    }
    let Some((_, may)) = LAYERS.iter().find(|(name, _)| *name == module) else {
        return Err(format!(
            "`{module}` has no place in the layers (tests/architecture.rs)"
        ));
    };
    if may.contains(&target) {
        Ok(())
    } else {
        Err(format!("`{module}` imports `{target}`"))
    }
}

/// The top-level module a file belongs to (`src/store/redis/mod.rs` →
/// `store`, `src/admin.rs` → `admin`).
fn top_module(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).expect("a file under src/");
    let first = relative
        .components()
        .next()
        .expect("a path")
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    first.trim_end_matches(".rs").to_owned()
}

/// Every `crate::<module>` (or `idemproxy_core::<module>`, [`PREFIXES`])
/// the code names, with its line: in `use` lines (grouped ones too,
/// `use crate::{a::X, b::Y}`) and in paths written inline. Comments are
/// skipped.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut group: Option<usize> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split("//").next().unwrap_or_default();
        let line_no = i + 1;
        if let Some(depth) = group.as_mut() {
            // Inside `use crate::{ ... }` spread over lines: each entry's
            // first segment is a module of the crate.
            for entry in line.split(',') {
                let entry = entry.trim().trim_start_matches('{').trim();
                if *depth == 1 {
                    if let Some(name) = first_segment(entry) {
                        found.push((line_no, name));
                    }
                }
            }
            *depth += line.matches('{').count();
            *depth -= line.matches('}').count().min(*depth);
            if *depth == 0 {
                group = None;
            }
            continue;
        }
        let mut rest = line;
        while let Some((at, prefix)) = PREFIXES
            .iter()
            .filter_map(|p| rest.find(p).map(|at| (at, p)))
            .min()
        {
            let after = &rest[at + prefix.len()..];
            if let Some(inner) = after.strip_prefix('{') {
                let close = inner.find('}');
                let body = close.map_or(inner, |c| &inner[..c]);
                let mut depth = 1usize;
                for entry in body.split(',') {
                    if depth == 1 {
                        if let Some(name) = first_segment(entry.trim()) {
                            found.push((line_no, name));
                        }
                    }
                    depth += entry.matches('{').count();
                    depth -= entry.matches('}').count().min(depth);
                }
                if close.is_none() {
                    group = Some(depth);
                }
            } else if let Some(name) = first_segment(after) {
                found.push((line_no, name));
            }
            rest = after;
        }
    }
    found
}

/// The leading identifier of a path (`core::Record` → `core`).
fn first_segment(path: &str) -> Option<String> {
    let name: String = path
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty() && name != "self").then_some(name)
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    assert!(
        files.len() > 10,
        "{} holds a crate: {files:?}",
        dir.display()
    );
    files.sort();
    files
}

#[test]
fn every_top_level_module_has_a_place() {
    for (src, _) in roots() {
        let modules: BTreeSet<String> = rust_files(&src)
            .iter()
            .map(|f| top_module(&src, f))
            .collect();
        for module in &modules {
            let placed = ROOT.contains(&module.as_str())
                || ANYWHERE.contains(&module.as_str())
                || LAYERS.iter().any(|(name, _)| name == module);
            assert!(
                placed,
                "{}/{module} has no layer in tests/architecture.rs",
                src.display()
            );
        }
    }
}

/// The core crate is what the fuzz targets build, instrumented: it keeps
/// to pure dependencies, or their build grows back to the proxy's
/// (issue 38). tokio is there for its clock alone, optional.
#[test]
fn the_core_crate_stays_pure() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/idemproxy-core/Cargo.toml");
    let text = std::fs::read_to_string(manifest).expect("read the core crate's Cargo.toml");
    let dependencies = text
        .split("\n[dependencies]\n")
        .nth(1)
        .expect("a [dependencies] table")
        .split("\n[")
        .next()
        .unwrap_or_default();
    let named: Vec<&str> = dependencies
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('=').map(|(name, _)| name.trim()))
        .collect();
    assert!(named.len() > 5, "dependencies read: {named:?}");
    for impure in [
        "idemproxy",
        "hyper",
        "hyper-util",
        "axum",
        "tower",
        "tower-http",
        "redis",
        "redb",
        "opentelemetry",
        "opentelemetry_sdk",
        "tracing",
        "rustls",
        "tokio-util",
    ] {
        assert!(
            !named.contains(&impure),
            "the core crate depends on {impure}"
        );
    }
    let tokio = dependencies
        .lines()
        .find(|l| l.starts_with("tokio ="))
        .unwrap_or_default();
    assert!(
        tokio.is_empty() || (tokio.contains("optional = true") && !tokio.contains("\"rt")),
        "tokio, if at all, only optional and without a runtime: {tokio}"
    );
}

/// `super::super::` paths: a file that reaches two levels up names its
/// grandparent by where it sits, not by what it is, and a move breaks it
/// silently. Name it from the crate root (`crate::request::jcs::...`).
#[test]
fn no_path_climbs_two_levels() {
    let mut found = Vec::new();
    for (src, _) in roots() {
        for file in rust_files(&src) {
            let text = std::fs::read_to_string(&file).expect("read a source file");
            for line in super_super(&text) {
                found.push(format!("{}:{line}", file.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "`super::super::` paths (name the module from `crate::`):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_path_climbing_two_levels_is_found() {
    assert_eq!(super_super("    use super::super::{a, b};\n"), vec![1]);
    assert_eq!(
        super_super("use std::fmt;\nlet x = super::super::f();\n"),
        vec![2]
    );
    assert!(super_super("// super::super:: in a comment\nuse super::x;\n").is_empty());
}

/// The lines of `text` that name `super::super::`, comments skipped.
fn super_super(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, raw)| {
            let line = raw.split("//").next().unwrap_or_default();
            line.contains("super::super::")
        })
        .map(|(i, _)| i + 1)
        .collect()
}

/// The files that import each other in a circle today (the proxy's named
/// from `src/`, the core crate's from the repository root): a ratchet. The test
/// fails if a cycle takes in any other file, and if a file listed here is
/// no longer in one (then take it off the list), so the list only shrinks.
const KNOWN_CYCLE: &[&str] = &[
    // A pair in `store` the check found (the embedded writer ↔ its
    // tables): small, and left for the store's own change.
    "store/embedded/tables.rs",
    "store/embedded/writer.rs",
];

/// No import cycle between the files of one layer (DESIGN §4): a graph of
/// each layer's files, an edge for every `use super::...`, `use self::...`
/// or `use crate::<layer>::...` naming another of its files, and no
/// strongly connected component of more than one file, but for the
/// [`KNOWN_CYCLE`] ratchet. A `mod.rs` naming its own children does not
/// count (it declares them); a child naming its parent does.
#[test]
fn no_import_cycle_inside_a_layer() {
    let mut in_cycles: BTreeSet<String> = BTreeSet::new();
    // Each crate on its own: `crate::` and `super::` stay inside one.
    for (src, label) in roots() {
        let files: Vec<(String, String)> = rust_files(&src)
            .iter()
            .map(|f| {
                let relative = f.strip_prefix(&src).expect("under the source root");
                let name = relative.to_string_lossy().replace('\\', "/");
                (
                    name,
                    std::fs::read_to_string(f).expect("read a source file"),
                )
            })
            .collect();
        for component in cycles(&files) {
            in_cycles.extend(component.into_iter().map(|f| format!("{label}{f}")));
        }
    }
    if let Err(why) = ratchet(&in_cycles, KNOWN_CYCLE) {
        panic!("{why} (all files in cycles: {in_cycles:?})");
    }
}

/// The ratchet: every file in a cycle is listed, and every listed file is
/// still in one.
fn ratchet(in_cycles: &BTreeSet<String>, known: &[&str]) -> Result<(), String> {
    let known: BTreeSet<String> = known.iter().map(|f| f.to_string()).collect();
    let new: Vec<_> = in_cycles.difference(&known).collect();
    let fixed: Vec<_> = known.difference(in_cycles).collect();
    if !new.is_empty() {
        return Err(format!(
            "files in an import cycle inside their layer: {new:?}"
        ));
    }
    if !fixed.is_empty() {
        return Err(format!(
            "no longer in a cycle, take them off KNOWN_CYCLE: {fixed:?}"
        ));
    }
    Ok(())
}

#[test]
fn the_cycle_ratchet_only_shrinks() {
    let cycle = |files: &[&str]| files.iter().map(|f| f.to_string()).collect();
    let listed = ["a/x.rs", "a/y.rs"];
    assert!(ratchet(&cycle(&["a/x.rs", "a/y.rs"]), &listed).is_ok());
    assert!(ratchet(&cycle(&["a/x.rs", "a/y.rs", "a/z.rs"]), &listed).is_err());
    assert!(ratchet(&cycle(&["b/p.rs", "b/q.rs"]), &[]).is_err());
    assert!(
        ratchet(&cycle(&[]), &listed).is_err(),
        "a fixed file must leave the list"
    );
}

/// The checker on planted sources: a cycle of three files is found, and a
/// chain, a `use super::*` of a test module and an import of another
/// layer are not cycles.
#[test]
fn an_import_cycle_is_found() {
    let planted = |files: &[(&str, &str)]| {
        let files: Vec<(String, String)> = files
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect();
        cycles(&files)
    };
    let found = planted(&[
        ("pipe/mod.rs", "mod a;\nmod b;\nmod c;\n"),
        ("pipe/a.rs", "use super::b::B;\n"),
        (
            "pipe/b.rs",
            "use crate::pipe::{\n    c::C,\n    d::D,\n};\n",
        ),
        ("pipe/c.rs", "use super::a;\n"),
        ("pipe/d.rs", "use crate::other::a::A;\n"),
    ]);
    let names: Vec<Vec<&str>> = found
        .iter()
        .map(|c| c.iter().map(String::as_str).collect())
        .collect();
    assert_eq!(names, vec![vec!["pipe/a.rs", "pipe/b.rs", "pipe/c.rs"]]);

    let none = planted(&[
        ("pipe/mod.rs", "mod a;\nmod b;\npub use a::A;\n"),
        (
            "pipe/a.rs",
            "use super::b::B;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        ),
        (
            "pipe/b.rs",
            "// use super::a::A;\nuse crate::other::b::X;\n",
        ),
        ("other/a.rs", "use crate::other::b::B;\n"),
        ("other/b.rs", "use crate::pipe::a::A;\n"),
    ]);
    assert!(none.is_empty(), "{none:?}");

    let nested = planted(&[
        ("pipe/jcs/mod.rs", "mod parse;\n"),
        ("pipe/jcs/parse.rs", "use super::Document;\n"),
        ("pipe/key.rs", "use super::jcs::Document;\n"),
        ("pipe/jcs/write.rs", "use crate::pipe::key;\n"),
        ("pipe/fp.rs", "use super::jcs::write::W;\n"),
    ]);
    assert!(nested.is_empty(), "{nested:?}");
    let nested = planted(&[
        ("pipe/jcs/mod.rs", "use crate::pipe::key::K;\n"),
        ("pipe/key.rs", "use super::jcs::Document;\n"),
    ]);
    assert_eq!(nested.len(), 1, "{nested:?}");
}

/// The module path of a file under `src/` (`request/jcs/mod.rs` →
/// `[request, jcs]`, `request/key.rs` → `[request, key]`).
fn module_path(file: &str) -> Vec<String> {
    let mut parts: Vec<String> = file
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The strongly connected components of more than one file in the import
/// graph of each layer's files (`files`: path under `src/`, text), each
/// sorted, in order.
fn cycles(files: &[(String, String)]) -> Vec<Vec<String>> {
    let paths: Vec<Vec<String>> = files.iter().map(|(f, _)| module_path(f)).collect();
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); files.len()];
    for (from, (_, text)) in files.iter().enumerate() {
        let here = &paths[from];
        for target in layer_uses(here, text) {
            // The file that holds the longest prefix of the path.
            let to = (1..=target.len())
                .rev()
                .find_map(|n| paths.iter().position(|p| p.as_slice() == &target[..n]));
            if let Some(to) = to {
                // A parent naming its own children (which it declares)
                // is structure, not an arrow: only the way up counts.
                let child = paths[to].starts_with(here);
                if to != from && !child && paths[to][0] == here[0] {
                    edges[from].insert(to);
                }
            }
        }
    }
    let mut components: Vec<Vec<String>> = strongly_connected(&edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut names: Vec<String> = c.into_iter().map(|i| files[i].0.clone()).collect();
            names.sort();
            names
        })
        .collect();
    components.sort();
    components
}

/// The module paths (from the crate root) that the `use` statements of the
/// file at module path `here` name through `super::`, `self::` or
/// `crate::<its layer>::`, outside inline modules (`mod tests { ... }`,
/// whose `super` is the file itself). Groups (`{a::X, b::Y}`) give one
/// path per entry at their first level.
fn layer_uses(here: &[String], text: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut statement: Option<String> = None;
    let mut inline: Option<String> = None;
    for raw in text.lines() {
        let line = raw.split("//").next().unwrap_or_default();
        if let Some(indent) = &inline {
            if line.trim_end() == format!("{indent}}}") {
                inline = None;
            }
            continue;
        }
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let body = trimmed
            .strip_prefix("pub ")
            .or_else(|| trimmed.strip_prefix("pub(crate) "))
            .or_else(|| trimmed.strip_prefix("pub(super) "))
            .unwrap_or(trimmed);
        if statement.is_none() && body.starts_with("mod ") && body.trim_end().ends_with('{') {
            inline = Some(indent.to_owned());
            continue;
        }
        let mut text = match statement.take() {
            Some(mut open) => {
                open.push_str(line.trim());
                open
            }
            None => match body.strip_prefix("use ") {
                Some(rest) => rest.to_owned(),
                None => continue,
            },
        };
        if !text.contains(';') {
            statement = Some(text);
            continue;
        }
        text = text.trim_end_matches(';').trim().to_owned();
        for path in expand(&text) {
            let segments: Vec<&str> = path.split("::").map(str::trim).collect();
            let (mut base, rest): (Vec<String>, &[&str]) = match segments.as_slice() {
                ["crate", layer, rest @ ..] if *layer == here[0] => (vec![layer.to_string()], rest),
                ["super", rest @ ..] => {
                    let mut base = here.to_vec();
                    base.pop();
                    let mut rest = rest;
                    while let ["super", tail @ ..] = rest {
                        base.pop();
                        rest = tail;
                    }
                    (base, rest)
                }
                ["self", rest @ ..] => (here.to_vec(), rest),
                _ => continue,
            };
            if base.is_empty() {
                continue;
            }
            base.extend(
                rest.iter()
                    .filter(|s| !s.is_empty() && **s != "*" && **s != "self")
                    .map(|s| s.to_string()),
            );
            found.push(base);
        }
    }
    found
}

/// The paths of a `use` tree, first level of groups expanded
/// (`super::{a::X, b::{Y, Z}}` → `super::a::X`, `super::b`).
fn expand(tree: &str) -> Vec<String> {
    let Some(open) = tree.find('{') else {
        return vec![tree.split(" as ").next().unwrap_or(tree).to_owned()];
    };
    let prefix = &tree[..open];
    let inner = tree[open + 1..].trim_end().trim_end_matches('}');
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut entry = String::new();
    for c in inner.chars().chain(std::iter::once(',')) {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                let e = entry.trim();
                let e = e.split("::{").next().unwrap_or(e);
                let e = e.split(" as ").next().unwrap_or(e);
                if !e.is_empty() {
                    out.push(format!("{prefix}{e}"));
                }
                entry.clear();
                continue;
            }
            _ => {}
        }
        if depth == 0 {
            entry.push(c);
        }
    }
    out
}

/// Tarjan's strongly connected components of a graph given as edge sets.
fn strongly_connected(edges: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.edges[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(i) if s.on_stack[w] => s.low[v] = s.low[v].min(i),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let n = edges.len();
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Non-test lines a source file may hold, and lines a function may span
/// (issue 38): a reader holds each on one screen or two.
const MAX_FILE_LINES: usize = 600;
const MAX_FN_LINES: usize = 80;

/// Every source file of [`SOURCES`], keyed by its path from the
/// repository root.
fn workspace_sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for src in SOURCES {
        for file in rust_files(&root.join(src)) {
            let name = file
                .strip_prefix(root)
                .expect("under the repository")
                .to_string_lossy()
                .replace('\\', "/");
            let text = std::fs::read_to_string(&file).expect("read a source file");
            files.push((name, text));
        }
    }
    files
}

#[test]
fn files_and_functions_fit_on_a_screen() {
    let mut too_long = BTreeSet::new();
    for (name, text) in workspace_sources() {
        too_long.extend(overlong(&name, &text));
    }
    assert!(
        too_long.is_empty(),
        "over {MAX_FILE_LINES} non-test lines (a file) or {MAX_FN_LINES} lines (a function): {too_long:?}"
    );
}

/// What of `text` is over the limits: the file itself (`name`), counting
/// the lines before its `#[cfg(test)] mod`, and each function
/// (`name::function`) from its `fn` line to the `}` at its indentation.
fn overlong(name: &str, text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let code = lines
        .windows(2)
        .position(|pair| {
            pair[0].trim() == "#[cfg(test)]" && {
                let next = pair[1].trim_start();
                next.starts_with("mod ") || next.starts_with("pub(crate) mod ")
            }
        })
        .unwrap_or(lines.len());
    let mut found = Vec::new();
    if code > MAX_FILE_LINES {
        found.push(name.to_owned());
    }
    for (start, line) in lines[..code].iter().enumerate() {
        let Some(function) = function_name(line) else {
            continue;
        };
        let indent = &line[..line.len() - line.trim_start().len()];
        let end = lines[start + 1..code]
            .iter()
            .position(|l| l.strip_prefix(indent) == Some("}"))
            .map(|offset| start + 1 + offset);
        if end.is_some_and(|end| end - start + 1 > MAX_FN_LINES) {
            found.push(format!("{name}::{function}"));
        }
    }
    found
}

/// The name of the function `line` begins with a body, if it does.
fn function_name(line: &str) -> Option<&str> {
    let mut rest = line.trim_start();
    if rest.starts_with("//") || rest.trim_end().ends_with(';') {
        return None;
    }
    if let Some(after) = rest.strip_prefix("pub") {
        rest = match after.strip_prefix('(') {
            Some(scope) => scope.split_once(')')?.1,
            None => after,
        }
        .trim_start();
    }
    for qualifier in ["const ", "async ", "unsafe "] {
        rest = rest.strip_prefix(qualifier).unwrap_or(rest);
    }
    let name = rest.strip_prefix("fn ")?;
    let end = name
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(name.len());
    (end > 0).then(|| &name[..end])
}

/// The checker on planted sources: a long function and a long file are
/// found, a long test module and a declaration are not.
#[test]
fn an_overlong_file_or_function_is_found() {
    let body = |n: usize| "    let x = 1;\n".repeat(n);
    let long_fn = format!("pub(crate) async fn long() {{\n{}}}\n", body(MAX_FN_LINES));
    assert_eq!(overlong("a.rs", &long_fn), ["a.rs::long"]);
    let short_fn = format!("fn short() {{\n{}}}\n", body(MAX_FN_LINES - 2));
    assert!(overlong("a.rs", &short_fn).is_empty());
    let nested = format!(
        "impl A {{\n    fn inner() {{\n    {}    }}\n}}\n",
        body(MAX_FN_LINES)
    );
    assert_eq!(overlong("a.rs", &nested), ["a.rs::inner"]);
    let long_file = "const A: u8 = 1;\n".repeat(MAX_FILE_LINES + 1);
    assert_eq!(overlong("a.rs", &long_file), ["a.rs"]);
    let long_tests = format!(
        "fn f() {{}}\n#[cfg(test)]\nmod tests {{\n{}fn long() {{\n{}}}\n}}\n",
        "const A: u8 = 1;\n".repeat(MAX_FILE_LINES),
        body(MAX_FN_LINES)
    );
    assert!(overlong("a.rs", &long_tests).is_empty());
    assert!(function_name("    fn declared(&self);").is_none());
    assert!(function_name("    // fn commented() {").is_none());
}
