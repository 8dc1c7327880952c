//! The crate's layers point one way (README, "Layout"). This test reads
//! every `crate::<module>` path in `src/` and fails on one that points the
//! wrong way: `store` naming `idempotency`, `config` naming anything,
//! `core` naming anything, `idempotency` naming `forward`, and so on.
//!
//! Each top-level module may name only the modules listed for it below;
//! the composition root (`lib.rs`, `main.rs`, `settings.rs`, `demo.rs`)
//! may name any. `testing` (unit-test helpers) may be named from anywhere.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every layer and what it may import, bottom up. A module missing from
/// this list fails the test, so a new one takes a deliberate place.
const LAYERS: &[(&str, &[&str])] = &[
    ("core", &[]),
    ("config", &[]),
    ("http", &["core"]),
    ("observe", &["core", "http"]),
    ("store", &["core"]),
    ("forward", &["core", "http", "observe"]),
    ("request", &["core"]),
    ("mcp", &[]),
    (
        "idempotency",
        &["core", "http", "observe", "store", "request", "mcp"],
    ),
    ("server", &["core", "http", "observe", "forward"]),
    (
        "admin",
        &["core", "http", "observe", "store", "request", "idempotency"],
    ),
];

/// The composition root: it reads `Config` and builds every part.
const ROOT: &[&str] = &["lib", "main", "settings", "demo", "tools"];

/// Named from anywhere: helpers compiled for unit tests only.
const ANYWHERE: &[&str] = &["testing"];

#[test]
fn imports_point_down_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    for file in rust_files(&src) {
        let module = top_module(&src, &file);
        let text = std::fs::read_to_string(&file).expect("read a source file");
        let relative = file.strip_prefix(&src).unwrap_or(&file).display();
        for (line, target) in crate_paths(&text) {
            if let Err(why) = allowed(&module, &target) {
                wrong.push(format!("src/{relative}:{line}: {why}"));
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
        ("config", "use crate::core::OnStale;\n"),
        ("core", "    let x = crate::store::MemoryStore::new();\n"),
        (
            "idempotency",
            "use crate::{core::RecordKey, forward::Upstream};\n",
        ),
        (
            "http",
            "use crate::{\n    core::Record,\n    observe::Metrics,\n};\n",
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
    let fine = "// see crate::idempotency\n/// [`crate::forward`]\nuse crate::core::Record;\n";
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

/// Every `crate::<module>` the code names, with its line: in `use` lines
/// (grouped ones too, `use crate::{a::X, b::Y}`) and in paths written
/// inline. Comments are skipped.
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
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + "crate::".len()..];
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
    assert!(files.len() > 10, "src/ holds the crate: {files:?}");
    files.sort();
    files
}

#[test]
fn every_top_level_module_has_a_place() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules: BTreeSet<String> = rust_files(&src)
        .iter()
        .map(|f| top_module(&src, f))
        .collect();
    for module in &modules {
        let placed = ROOT.contains(&module.as_str())
            || ANYWHERE.contains(&module.as_str())
            || LAYERS.iter().any(|(name, _)| name == module);
        assert!(placed, "src/{module} has no layer in tests/architecture.rs");
    }
}
