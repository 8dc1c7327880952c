//! The Markdown in the repository root and docs/ links only to what
//! exists: each relative link's file or directory, and each `#anchor` to
//! a heading of its page as GitHub slugs it. Pages are read as a reader
//! follows them, so a moved section or a renamed page fails here, in
//! `cargo test`, not on GitHub.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `*.md` of the root and of docs/.
fn pages() -> Vec<PathBuf> {
    let mut pages = Vec::new();
    for dir in [root().to_path_buf(), root().join("docs")] {
        for entry in std::fs::read_dir(&dir).expect("read a docs directory") {
            let path = entry.expect("a directory entry").path();
            if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages
}

/// The page's lines outside fenced code blocks, with inline code blanked
/// out (a link inside either is an example, not a link).
fn prose(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut in_code = false;
        lines.push(
            line.chars()
                .map(|c| {
                    if c == '`' {
                        in_code = !in_code;
                        return c;
                    }
                    if in_code {
                        ' '
                    } else {
                        c
                    }
                })
                .collect(),
        );
    }
    lines
}

/// The target of every inline link `[text](target)` in `line`.
fn links(line: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        match after.find(')') {
            Some(end) => {
                found.push(after[..end].trim().to_owned());
                rest = &after[end..];
            }
            None => break,
        }
    }
    found
}

/// A heading's anchor as GitHub makes it: the rendered text lower-cased,
/// every character that is not a letter, digit, space, `-` or `_`
/// dropped, spaces made `-`.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // A link in a heading renders as its text.
    while let Some(open) = rest.find('[') {
        text.push_str(&rest[..open]);
        let inner = &rest[open + 1..];
        match (inner.find("]("), inner.find(')')) {
            (Some(close), Some(end)) if close < end => {
                text.push_str(&inner[..close]);
                rest = &inner[end + 1..];
            }
            _ => {
                text.push('[');
                rest = inner;
            }
        }
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a page's headings; a repeated heading gets `-1`, `-2`...
fn anchors(page: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(page).unwrap_or_default();
    let mut seen = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let heading = line.trim_start_matches('#');
        if fenced || heading.len() == line.len() || !heading.starts_with(' ') {
            continue;
        }
        let base = slug(heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// What is wrong with `target`, linked from `page`.
fn broken(page: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        page.to_path_buf()
    } else {
        page.parent().unwrap_or(root()).join(path)
    };
    if !file.exists() {
        return Some(format!("{path} does not exist"));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|e| e != "md") {
        return Some(format!("#{anchor} on a file that has no headings"));
    }
    let known = anchors(&file);
    (!known.contains(anchor)).then(|| format!("no heading #{anchor} in {}", file.display()))
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let mut wrong = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read a page");
        let name = page
            .strip_prefix(root())
            .unwrap_or(&page)
            .display()
            .to_string();
        for (n, line) in prose(&text).iter().enumerate() {
            for target in links(line) {
                checked += 1;
                if let Some(why) = broken(&page, &target) {
                    wrong.push(format!("{name}:{}: ({target}) {why}", n + 1));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: the parser reads nothing"
    );
    assert!(wrong.is_empty(), "broken links:\n{}", wrong.join("\n"));
}

/// The checker on planted pages: a broken file, a broken anchor and a
/// link inside code are told apart from good ones.
#[test]
fn the_link_checker_finds_what_is_broken() {
    let dir = tempfile::tempdir().expect("tempdir");
    let page = dir.path().join("page.md");
    std::fs::write(
        &page,
        "# The `contract` (v2)\n\n## Every case\n## Every case\n\n```\n## not a heading\n```\n",
    )
    .expect("write");
    for good in [
        "#the-contract-v2",
        "#every-case",
        "#every-case-1",
        "page.md#every-case",
    ] {
        assert_eq!(broken(&page, good), None, "{good}");
    }
    for bad in [
        "#not-a-heading",
        "#every-case-2",
        "missing.md",
        "page.md#nope",
    ] {
        assert!(broken(&page, bad).is_some(), "{bad}");
    }
    assert_eq!(links("see [a](b.md) and [c](#d)"), ["b.md", "#d"]);
    assert!(prose("`[a](b.md)`")
        .iter()
        .all(|line| links(line).is_empty()));
}
