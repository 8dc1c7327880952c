//! Private PostgreSQL servers for tests: `initdb` into a temporary
//! directory, `postgres` on a free port of its own, never the machine's
//! shared instance. Run as the `postgres` user when the tests run as root
//! (PostgreSQL refuses root), under the supervisor of
//! [`redis_server`](super::redis_server): dropping the handle (or the test
//! process ending) stops the server (fast shutdown) and removes its
//! directory; [`PostgresServer::crash`] stops it as a crash would
//! (immediate shutdown, no checkpoint) and [`PostgresServer::restart`]
//! starts it again on the same port and data.
//!
//! Nothing here skips: if the binaries cannot be run, the test panics and
//! says so. `PG_BIN_DIR` names their directory; else `initdb` on `PATH`,
//! else Debian's `/usr/lib/postgresql/<version>/bin`.

#![allow(unreachable_pub)]
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::redis_server::{free_port, Supervised};

const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The directory of `initdb`, `postgres`, `pg_ctl`, `pg_basebackup`.
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Ok(dir) = std::env::var("PG_BIN_DIR") {
            return PathBuf::from(dir);
        }
        let on_path = Command::new("sh")
            .args(["-c", "command -v initdb"])
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        // Debian links /usr/local/bin/initdb (or not at all) to the
        // versioned directory, where pg_basebackup lives too.
        let resolved = on_path.and_then(|p| std::fs::canonicalize(p).ok());
        if let Some(dir) = resolved.and_then(|p| p.parent().map(Path::to_path_buf)) {
            return dir;
        }
        let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .map(|dir| dir.flatten().map(|e| e.path().join("bin")).collect())
            .unwrap_or_default();
        versions.sort();
        versions.pop().unwrap_or_else(|| {
            panic!(
                "no PostgreSQL binaries (initdb): the PostgreSQL tests need Debian's \
                 `postgresql` package, or PG_BIN_DIR; they never skip"
            )
        })
    })
}

fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// The user the server runs as: `postgres` when the tests run as root.
fn server_user() -> Option<(u32, u32)> {
    let out = Command::new("id").arg("-u").output().expect("run id -u");
    if String::from_utf8_lossy(&out.stdout).trim() != "0" {
        return None;
    }
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("run id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| {
                panic!("running as root, the PostgreSQL tests need a `postgres` user to run the server as")
            })
    };
    Some((id("-u"), id("-g")))
}

/// Makes `paths` the server user's (when the tests run as root), so that
/// it can read them: a TLS key must be its own.
pub fn give_to_server_user(paths: &[&Path]) {
    if let Some((uid, gid)) = server_user() {
        for path in paths {
            std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown to postgres");
        }
    }
}

/// `program` run as the server's user.
fn as_server_user(program: PathBuf) -> Command {
    let mut command = Command::new(program);
    if let Some((uid, gid)) = server_user() {
        command.uid(uid).gid(gid);
    }
    command
}

/// A private PostgreSQL server (trust authentication, user `postgres`).
pub struct PostgresServer {
    port: u16,
    dir: TempDir,
    /// More `postgres` arguments (`-c name=value`), for this server only
    /// (a standby copies the configuration files, not these).
    extra_args: Vec<String>,
    process: Option<Supervised>,
}

impl PostgresServer {
    /// A fresh cluster from `initdb`.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`Self::start`] with `settings` (`name=value`) on the command line.
    pub fn start_with(settings: &[&str]) -> Self {
        let extra_args = settings.iter().flat_map(|s| ["-c".into(), s.to_string()]);
        Self::start_from(extra_args.collect(), |data| {
            run(as_server_user(bin("initdb"))
                .args([
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "-E",
                    "UTF8",
                    "--no-sync",
                    "-D",
                ])
                .arg(data));
        })
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), which
    /// [`Self::promote`] makes a primary.
    pub fn standby_of(primary: &PostgresServer) -> Self {
        Self::start_from(Vec::new(), |data| {
            run(as_server_user(bin("pg_basebackup"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-U",
                    "postgres",
                    "-R",
                    "-X",
                    "stream",
                    "-p",
                ])
                .arg(primary.port.to_string())
                .arg("-D")
                .arg(data));
        })
    }

    fn start_from(extra_args: Vec<String>, make_data: impl Fn(&Path)) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-pg-")
            .tempdir()
            .expect("create a directory for postgres");
        if let Some((uid, gid)) = server_user() {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown to postgres");
        }
        make_data(&dir.path().join("data"));
        let mut server = PostgresServer {
            port: 0,
            dir,
            extra_args,
            process: None,
        };
        let mut last_error = String::new();
        // A free port can be taken between the check and the bind.
        for _ in 0..5 {
            server.port = free_port();
            match server.spawn() {
                Ok(()) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("postgres did not start: {last_error}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Stops the server as a crash would: immediate shutdown (SIGQUIT: every
    /// backend exits at once, no checkpoint; recovery replays the WAL on
    /// the next start). Waits until it is gone.
    pub fn crash(&mut self) {
        if let Some(process) = self.process.take() {
            process.signal("QUIT");
        }
    }

    /// Starts the server again on the same port and data.
    pub fn restart(&mut self) {
        self.crash();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => {
                    panic!("postgres did not restart on port {}: {e}", self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Freezes the server (SIGSTOP to the postmaster and every backend)
    /// until the guard is dropped (SIGCONT): what a stalled host or a
    /// slow disk look like to a client. Statements sent meanwhile run once
    /// it goes on, after their callers gave up.
    pub fn suspend(&self) -> Suspended {
        // The guard first: whatever happens next, the server goes on.
        let suspended = Suspended(self.pids());
        let postmaster_stopped = signal_all(&suspended.0, "STOP");
        assert!(postmaster_stopped, "kill -STOP {:?}", suspended.0);
        suspended
    }

    /// [`Self::suspend`] for `pause`.
    pub fn freeze(&self, pause: Duration) {
        let suspended = self.suspend();
        std::thread::sleep(pause);
        drop(suspended);
    }

    /// The postmaster's pid and its children's.
    fn pids(&self) -> Vec<String> {
        let pid_file = std::fs::read_to_string(self.data_dir().join("postmaster.pid"))
            .expect("postmaster.pid");
        let postmaster = pid_file
            .lines()
            .next()
            .expect("the postmaster's pid")
            .trim();
        let children = Command::new("pgrep")
            .args(["-P", postmaster])
            .output()
            .expect("pgrep");
        let mut pids = vec![postmaster.to_owned()];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .split_whitespace()
                .map(str::to_owned),
        );
        pids
    }

    /// Makes a standby the primary (`pg_ctl promote`), and waits until it
    /// accepts writes.
    pub fn promote(&self) {
        run(as_server_user(bin("pg_ctl"))
            .args(["promote", "-w", "-D"])
            .arg(self.data_dir()));
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while self.sql("SELECT pg_is_in_recovery()").trim() != "f" {
            assert!(Instant::now() < deadline, "the standby was not promoted");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `sql` with psql and returns its unaligned output. Panics if it
    /// fails.
    pub fn sql(&self, sql: &str) -> String {
        let out = self.psql(sql);
        assert!(
            out.status.success(),
            "psql {sql:?} failed: {}{}\nserver log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn psql(&self, sql: &str) -> std::process::Output {
        Command::new(bin("psql"))
            .args([
                "-X",
                "-A",
                "-t",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
            ])
            .args(["-v", "ON_ERROR_STOP=1", "-p"])
            .arg(self.port.to_string())
            .arg("-c")
            .arg(sql)
            .output()
            .expect("run psql")
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.out")).unwrap_or_default()
    }

    /// Starts the server under its supervisor and waits until it answers.
    fn spawn(&mut self) -> Result<(), String> {
        let mut server = Command::new(bin("postgres"));
        server.arg("-D").arg(self.data_dir());
        server
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path());
        // Tests crash the process, never the machine: the page cache
        // keeps what was written, so fsync only costs time.
        server.args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]);
        server.args(["-c", "max_connections=200", "-c", "wal_level=replica"]);
        server.args(&self.extra_args);
        let mut shell = Supervised::shell(self.dir.path(), &server);
        // Fast shutdown when the handle goes: clients still connected
        // (a store's pool) are disconnected rather than waited for.
        shell.env("STOP_SIGNAL", "INT");
        if let Some((uid, gid)) = server_user() {
            shell.uid(uid).gid(gid);
        }
        self.process = Some(Supervised::spawn(&mut shell)?);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if self.psql("SELECT 1").status.success() {
                return Ok(());
            }
            let exited = self.process.as_mut().is_some_and(Supervised::exited);
            if exited || Instant::now() > deadline {
                let log = self.log();
                self.crash();
                return Err(format!(
                    "postgres on port {} {}; its log:\n{log}",
                    self.port,
                    if exited { "exited" } else { "did not answer" }
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            process.stop();
        }
    }
}

/// Runs `command`; panics with its output if it fails.
fn run(command: &mut Command) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One private server for the whole test binary (kept in a `static`; the
/// supervisor stops it when the process exits). Keep data private per
/// test with a table prefix of its own ([`unique_prefix`]).
pub fn shared() -> &'static PostgresServer {
    static SERVER: OnceLock<PostgresServer> = OnceLock::new();
    SERVER.get_or_init(PostgresServer::start)
}

/// A table prefix no other test uses.
pub fn unique_prefix(name: &str) -> String {
    format!("t_{name}_{:016x}_", rand::random::<u64>())
}

/// A server frozen by [`PostgresServer::suspend`]; dropping it lets the
/// server go on (so a test that panics leaves no frozen server behind).
pub struct Suspended(Vec<String>);

impl Drop for Suspended {
    fn drop(&mut self) {
        // Never a panic here: a server left stopped hangs the test's
        // shutdown of it, and every later test's.
        signal_all(&self.0, "CONT");
    }
}

/// Sends `signal` to every process of `pids` (the postmaster first);
/// whether the postmaster got it. A backend may have exited since it was
/// listed: that is no failure.
fn signal_all(pids: &[String], signal: &str) -> bool {
    let mut sent = pids.iter().map(|pid| {
        Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid)
            .status()
            .is_ok_and(|status| status.success())
    });
    let postmaster = sent.next().unwrap_or(false);
    sent.for_each(drop);
    postmaster
}
