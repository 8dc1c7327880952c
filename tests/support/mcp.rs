//! A real MCP server and real MCP clients, from the official Python SDK
//! (`tests/mcp/`), for the tests of `protocol = "mcp"` routes.
//!
//! The interpreter is the venv `tests/mcp/install.sh` builds (and prints);
//! the script is a no-op when the venv is current, so every test binary
//! may call it. Nothing is skipped when Python or the SDK is missing: the
//! tests fail with the installer's output.

#![allow(unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long the server gets to print `READY` (it imports the SDK: ~1 s).
const SERVER_STARTUP: Duration = Duration::from_secs(30);
/// How long one client scenario may run.
const CLIENT_RUN: Duration = Duration::from_secs(90);

fn mcp_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp")
}

/// The venv's python, installed on first use.
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let output = std::process::Command::new(mcp_dir().join("install.sh"))
            .output()
            .expect("run tests/mcp/install.sh");
        assert!(
            output.status.success(),
            "tests/mcp/install.sh failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let path = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        assert!(
            Path::new(&path).exists(),
            "tests/mcp/install.sh printed {path:?}, which does not exist"
        );
        PathBuf::from(path)
    })
}

/// `tests/mcp/server.py` as a child process, killed (by its PID) on drop.
pub struct McpServer {
    pub port: u16,
    counts: PathBuf,
    _child: Child,
    /// Holds the counts file.
    _dir: TempDir,
}

impl McpServer {
    /// Default: SSE answers and stateful sessions. `flags` are
    /// `--json-response` and/or `--stateless`.
    pub async fn start(flags: &[&str]) -> McpServer {
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-mcp-")
            .tempdir()
            .expect("tempdir");
        let counts = dir.path().join("counts.json");
        let mut child = Command::new(python())
            .arg(mcp_dir().join("server.py"))
            .args(["--port", "0", "--counts"])
            .arg(&counts)
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start tests/mcp/server.py");
        let stdout = child.stdout.take().expect("server stdout");
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(SERVER_STARTUP, async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(port) = line.strip_prefix("READY ") {
                    return port.trim().parse::<u16>().ok();
                }
            }
            None
        })
        .await;
        let port = match ready {
            Ok(Some(port)) => port,
            other => panic!("server.py did not print READY <port>: {other:?}"),
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        McpServer {
            port,
            counts,
            _child: child,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The server's own record: executions per tool, the arguments of
    /// every `tools/call` that reached it, the methods it saw.
    pub fn counts(&self) -> Value {
        let text = std::fs::read_to_string(&self.counts).unwrap_or_else(|_| "{}".into());
        serde_json::from_str(&text).expect("counts file is JSON")
    }

    /// How many times `tool` ran.
    pub fn executions(&self, tool: &str) -> u64 {
        self.counts()[tool].as_u64().unwrap_or(0)
    }

    /// Panics if any `tools/call` reached the server with `argument`.
    pub fn assert_never_saw(&self, argument: &str) {
        let counts = self.counts();
        for arguments in counts["arguments"].as_array().into_iter().flatten() {
            assert!(
                arguments.get(argument).is_none(),
                "the server saw `{argument}` in {arguments}"
            );
        }
    }
}

/// Runs `tests/mcp/client.py` against `url` with `scenario` (a JSON list of
/// steps) as a client of `protocol_version`; one entry per step.
pub async fn run_client(url: &str, protocol_version: &str, scenario: &Value) -> Vec<Value> {
    let run = Command::new(python())
        .arg(mcp_dir().join("client.py"))
        .args(["--url", url, "--protocol-version", protocol_version])
        .arg("--scenario")
        .arg(scenario.to_string())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(CLIENT_RUN, run)
        .await
        .expect("client.py finishes")
        .expect("run client.py");
    assert!(
        output.status.success(),
        "client.py failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    match serde_json::from_slice::<Value>(&output.stdout) {
        Ok(Value::Array(steps)) => steps,
        other => panic!(
            "client.py printed no JSON list ({other:?}):\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// The text of a tool result's content items, in order.
pub fn texts(result: &Value) -> Vec<String> {
    result["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item["text"].as_str().map(str::to_owned))
        .collect()
}
