//! `idemproxy demo` and `idemproxy demo --mcp` as a newcomer runs them: the
//! real binary, its first screen read until it serves (no warning there),
//! then every curl command it printed run as printed, by `sh`, each
//! answering what its step says.

use crate::support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::binary::free_port;

/// A running demo, stopped by its PID on drop.
struct Demo {
    child: Child,
    out: PathBuf,
    /// The `--store-path` it was given, which its walkthrough names.
    store: PathBuf,
    _dir: tempfile::TempDir,
}

impl Demo {
    /// `idemproxy demo ARGS` on free ports with a private store, once it
    /// has logged that it serves.
    fn start(args: &[&str]) -> Demo {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("out");
        let store = dir.path().join("store");
        let file = std::fs::File::create(&out).expect("output file");
        let err = file.try_clone().expect("output file");
        let child = support::binary::command()
            .arg("demo")
            .args(args)
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", free_port()))
            .arg("--admin-listen")
            .arg(format!("127.0.0.1:{}", free_port()))
            .arg("--store-path")
            .arg(&store)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .expect("run idemproxy demo");
        let mut demo = Demo {
            child,
            out,
            store,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while !demo.output().contains("idemproxy serving") {
            if let Ok(Some(status)) = demo.child.try_wait() {
                panic!("the demo exited with {status}:\n{}", demo.output());
            }
            assert!(Instant::now() < deadline, "not serving:\n{}", demo.output());
            std::thread::sleep(Duration::from_millis(20));
        }
        demo
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// What it printed before it served, and each numbered step's commands
    /// (the lines that start with `curl`, or run one after `sleep`).
    fn first_screen_and_steps(&self) -> (String, Vec<String>) {
        let output = self.output();
        let screen = output[..output.find("idemproxy serving").unwrap_or(0)].to_owned();
        let mut steps: Vec<String> = Vec::new();
        for line in screen.lines() {
            let line = line.trim();
            if line.starts_with(|c: char| c.is_ascii_digit()) && line.contains(". ") {
                steps.push(String::new());
            } else if line.starts_with("curl") || line.starts_with("sleep") {
                let step = steps.last_mut().expect("a command under a numbered step");
                step.push_str(line);
                step.push('\n');
            }
        }
        (screen, steps)
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A step's commands run by `sh`, as a reader would paste them; their
/// output, which must be a success.
fn run(step: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(step)
        .output()
        .expect("run sh");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{step}\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_demo_starts_without_a_warning_and_its_five_steps_do_what_they_say() {
    let demo = Demo::start(&[]);
    let (screen, steps) = demo.first_screen_and_steps();
    assert!(!screen.contains("WARN"), "{screen}");
    assert_eq!(steps.len(), 5, "{screen}");
    let store = format!("The store lives in {}:", demo.store.display());
    assert!(screen.contains(&store), "{screen}");

    let first = run(&steps[0]);
    assert!(first.starts_with("HTTP/1.1 201"), "{first}");
    assert!(first.contains(r#""id":"pay_0001""#), "{first}");
    let again = run(&steps[1]);
    assert!(again.starts_with("HTTP/1.1 201"), "{again}");
    assert!(again.contains("idempotent-replayed: true"), "{again}");
    assert!(again.contains(r#""id":"pay_0001""#), "{again}");
    let other = run(&steps[2]);
    assert!(other.starts_with("HTTP/1.1 409"), "{other}");
    assert!(other.contains("key-reused"), "{other}");
    let duplicate = run(&steps[3]);
    assert!(duplicate.contains("HTTP/1.1 425"), "{duplicate}");
    assert!(duplicate.contains("retry-after"), "{duplicate}");
    let count = run(&steps[4]);
    // order-42 once, slow-1 once.
    assert!(count.starts_with(r#"{"charges":2,"#), "{count}");
    assert!(!demo.output().contains("WARN"), "{}", demo.output());
}

/// The JSON-RPC result a step printed.
fn result(step: &str) -> serde_json::Value {
    let out = run(step);
    let message: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    message["result"].clone()
}

fn text(result: &serde_json::Value) -> String {
    result["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_mcp_demo_works_as_printed() {
    let demo = Demo::start(&["--mcp"]);
    let (screen, steps) = demo.first_screen_and_steps();
    assert!(!screen.contains("WARN"), "{screen}");
    assert_eq!(steps.len(), 5, "{screen}");

    let listing = result(&steps[0]);
    let tools = listing["tools"].as_array().expect("tools");
    let schema = |name: &str| {
        tools
            .iter()
            .find(|tool| tool["name"] == name)
            .map(|tool| tool["inputSchema"].clone())
            .unwrap_or_else(|| panic!("no {name}: {listing}"))
    };
    assert!(schema("send_email")["required"]
        .as_array()
        .is_some_and(|r| r.contains(&"idempotency_key".into())));
    assert!(schema("outbox")["properties"]["idempotency_key"].is_null());

    let sent = result(&steps[1]);
    assert_eq!(sent["isError"], false, "{sent}");
    assert!(text(&sent).contains("sent email #1"), "{sent}");
    let retry = result(&steps[2]);
    assert_eq!(retry["_meta"]["io.idemproxy/replayed"], true, "{retry}");
    assert!(
        text(&retry).starts_with("Note: this call already ran"),
        "{retry}"
    );
    assert!(text(&retry).contains("sent email #1"), "{retry}");
    let reused = result(&steps[3]);
    assert_eq!(reused["isError"], true, "{reused}");
    assert!(text(&reused).contains("already used"), "{reused}");
    let outbox = result(&steps[4]);
    assert!(text(&outbox).starts_with("1 email(s) sent"), "{outbox}");
}
