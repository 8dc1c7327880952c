//! Names the commit the binary was built from, for `idemproxy --version`:
//! `git rev-parse --short HEAD` when the source is a git checkout, and
//! "unknown" when it is not (a tarball, a crate download).

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let text = text.trim();
    (output.status.success() && !text.is_empty()).then(|| text.to_owned())
}

fn main() {
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=IDEMPROXY_COMMIT={commit}");
    // Rebuilt when HEAD moves: HEAD itself (a checkout), the branch it
    // names (a commit), packed refs. Asked of git rather than assumed at
    // .git/HEAD, which a worktree's `.git` file does not have.
    let mut watched = vec!["build.rs".to_owned()];
    watched.extend(git(&["rev-parse", "--git-path", "HEAD"]));
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.extend(git(&["rev-parse", "--git-path", &branch]));
    }
    watched.extend(git(&["rev-parse", "--git-path", "packed-refs"]));
    for path in watched.iter().filter(|path| Path::new(path).exists()) {
        println!("cargo:rerun-if-changed={path}");
    }
}
