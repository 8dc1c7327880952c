//! The real `idemproxy` binary as a child process, for tests that crash it,
//! signal it, or need it to be a separate process from the test.
//!
//! [`ProxyProcess::start`] writes a [`Config`] to a TOML file in a private
//! directory (traffic and admin listeners on free ports), runs
//! `idemproxy --config FILE` with its output in a log file of that
//! directory, and waits until `GET /healthz` answers 200 on the admin port.
//! The process is stopped only by its PID: [`ProxyProcess::terminate`]
//! (SIGTERM, a graceful drain), [`ProxyProcess::kill`] (SIGKILL, a crash),
//! and on drop (SIGKILL, so that a failing test leaves nothing running).

#![allow(unreachable_pub)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use idemproxy::Config;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

pub const BIN: &str = env!("CARGO_BIN_EXE_idemproxy");

/// How long the binary gets to answer `/healthz` after it was started.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(15);

/// The binary, with nothing from the test's environment that could change
/// its configuration or its log (`IDEMPROXY_*`, `RUST_LOG`).
pub fn command() -> Command {
    let mut cmd = Command::new(BIN);
    for (name, _) in std::env::vars() {
        if name.starts_with("IDEMPROXY_") {
            cmd.env_remove(name);
        }
    }
    cmd.env_remove("RUST_LOG");
    cmd
}

/// A port free on 127.0.0.1 now, drawn below the ephemeral range (Linux:
/// from 32768) so that no outgoing connection of the test takes it before
/// the child binds it, and below the range `redis_server` draws from.
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = 10_000 + rand::random::<u16>() % 10_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port found for idemproxy");
}

/// A running `idemproxy` process.
pub struct ProxyProcess {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pid: u32,
    child: Option<Child>,
    exit: Option<ExitStatus>,
    log: PathBuf,
    /// Holds the configuration file and the log; removed on drop.
    _dir: TempDir,
}

/// What the binary's error says when its port was taken
/// (`cannot listen on …: Address already in use (os error 98)`).
const PORT_TAKEN: &str = "Address already in use";

impl ProxyProcess {
    /// Starts the binary with `config`; its `listen` and `admin_listen` are
    /// replaced by free ports. Panics, with the log, if it does not become
    /// healthy.
    pub async fn start(config: Config) -> ProxyProcess {
        Self::start_with_env(config, &[]).await
    }

    /// [`ProxyProcess::start`] with `env` set for the process (after the
    /// test's own `IDEMPROXY_*` variables are removed).
    pub async fn start_with_env(config: Config, env: &[(&str, String)]) -> ProxyProcess {
        let mut last_error = String::new();
        // A free port can be taken between the check and the child's bind:
        // try again on other ports then, and only then (any other failure to
        // start is what a test must see).
        for _ in 0..3 {
            match Self::try_start(config.clone(), env).await {
                Ok(process) => return process,
                Err(e) if e.contains(PORT_TAKEN) => last_error = e,
                Err(e) => panic!("idemproxy did not start: {e}"),
            }
        }
        panic!("idemproxy did not start: {last_error}");
    }

    async fn try_start(mut config: Config, env: &[(&str, String)]) -> Result<ProxyProcess, String> {
        config.listen = ([127, 0, 0, 1], free_port()).into();
        config.admin_listen = ([127, 0, 0, 1], free_port()).into();
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-bin-")
            .tempdir()
            .map_err(|e| format!("tempdir: {e}"))?;
        let file = dir.path().join("idemproxy.toml");
        let text = toml::to_string(&config).map_err(|e| format!("render config: {e}"))?;
        std::fs::write(&file, &text).map_err(|e| format!("write config: {e}"))?;
        let log = dir.path().join("idemproxy.log");
        let log_file = std::fs::File::create(&log).map_err(|e| format!("log file: {e}"))?;
        let log_err = log_file.try_clone().map_err(|e| format!("log file: {e}"))?;

        let mut cmd = command();
        for (name, value) in env {
            cmd.env(name, value);
        }
        let child = cmd
            .arg("--config")
            .arg(&file)
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err)
            .spawn()
            .map_err(|e| format!("cannot run {BIN}: {e}"))?;
        let mut process = ProxyProcess {
            addr: config.listen,
            admin_addr: config.admin_listen,
            pid: child.id(),
            child: Some(child),
            exit: None,
            log,
            _dir: dir,
        };

        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if get_status(process.admin_addr, "/healthz").await == Some(200) {
                return Ok(process);
            }
            if let Some(status) = process.try_exit() {
                return Err(format!(
                    "idemproxy exited early with {status}:\n{}",
                    process.logs()
                ));
            }
            if Instant::now() > deadline {
                // Dropping `process` kills it.
                return Err(format!(
                    "no healthy /healthz within {STARTUP_TIMEOUT:?}:\n{}",
                    process.logs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin_addr, path)
    }

    /// The process's output so far (its log lines).
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process's output once `ready` says it holds what the caller
    /// waits for, or as it is after 5 s. Lines reach the file in batches
    /// (every 100 ms at the latest), so a line logged just before a
    /// response may not be there yet when the response arrives.
    pub async fn logs_when(&self, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let logs = self.logs();
            if ready(&logs) || Instant::now() > deadline {
                return logs;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The exit status if the process has exited (reaping it).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            if let Some(child) = &mut self.child {
                if let Ok(Some(status)) = child.try_wait() {
                    self.exit = Some(status);
                    self.child = None;
                }
            }
        }
        self.exit
    }

    pub fn is_running(&mut self) -> bool {
        self.try_exit().is_none()
    }

    /// Sends SIGTERM (graceful drain) to this process, by PID. Panics if it
    /// already exited: its PID may belong to someone else by now.
    pub fn terminate(&mut self) {
        assert!(
            self.is_running(),
            "idemproxy {} already exited:\n{}",
            self.pid,
            self.logs()
        );
        let sent = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid.to_string())
            .status()
            .expect("run kill -TERM");
        assert!(sent.success(), "kill -TERM {} failed", self.pid);
    }

    /// Crashes the process: SIGKILL by PID, then reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            if let Ok(status) = child.wait() {
                self.exit = Some(status);
            }
        }
    }

    /// Waits for the process to exit on its own; panics after `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.try_exit() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "idemproxy {} still running after {within:?}:\n{}",
                self.pid,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The status of `GET path` on `addr`, or `None` if nothing answered
/// within a second.
pub async fn get_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.ok()?;
        super::fault::status_of(&raw)
    };
    tokio::time::timeout(Duration::from_secs(1), exchange)
        .await
        .ok()
        .flatten()
}
