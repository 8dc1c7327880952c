//! Private `redis-server` processes for tests: standalone servers (optionally
//! with a password, ACL users or TLS) and 3-master clusters, on free ports of
//! their own, never the machine's shared Redis.
//!
//! Every server runs under a tiny `sh` supervisor whose stdin is a pipe from
//! this process. When the pipe closes (the handle is dropped, or the test
//! process exits or dies, which matters for servers kept in a `static`), the
//! supervisor stops the server it started, by PID, and removes its directory.
//! Writing `kill` to the pipe instead sends SIGKILL (a crash), after which
//! [`RedisServer::restart`] starts the server again on the same port, with
//! the same directory (and so the same cluster identity).
//!
//! Nothing here skips: if `redis-server` or `redis-cli` cannot be run, the
//! test panics and says so. `REDIS_SERVER_BIN` and `REDIS_CLI_BIN` override
//! the binaries (default: `redis-server` and `redis-cli` from `PATH`; on
//! Debian, the `redis-server` package).

#![allow(unreachable_pub)]
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tempfile::TempDir;

const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);

/// The supervisor: starts the server in the background, prints its PID,
/// then waits for a line (a signal's name, e.g. `KILL`: a crash) or end of
/// input (`$STOP_SIGNAL`, TERM unless set, then removes the directory).
/// `$1` is the directory, the rest the command.
pub const SUPERVISOR: &str = r#"
dir=$1; shift
"$@" </dev/null >>"$dir/server.out" 2>&1 &
child=$!
echo "$child"
if read -r line; then
  kill -s "$line" "$child" 2>/dev/null
  wait "$child"
else
  kill -s "${STOP_SIGNAL:-TERM}" "$child" 2>/dev/null
  wait "$child"
  rm -rf "$dir"
fi
"#;

pub fn server_bin() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into())
}

pub fn cli_bin() -> String {
    std::env::var("REDIS_CLI_BIN").unwrap_or_else(|_| "redis-cli".into())
}

/// Fails the test unless `redis-server` and `redis-cli` run.
pub fn require_binaries() {
    static CHECKED: OnceLock<()> = OnceLock::new();
    CHECKED.get_or_init(|| {
        for bin in [server_bin(), cli_bin()] {
            match Command::new(&bin).arg("--version").output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => panic!(
                    "`{bin} --version` failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ),
                Err(e) => panic!(
                    "cannot run `{bin}` ({e}): the Redis tests need redis-server and \
                     redis-cli (Debian package `redis-server`); they never skip"
                ),
            }
        }
    });
}

/// A connection of the test's own to the Redis at `url` (to read or write
/// behind the store's back), patient as the tests must be on a loaded
/// machine: redis-rs gives up on an answer after 500 ms by default.
pub async fn connection(url: &str) -> redis::aio::MultiplexedConnection {
    let patient = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(10)))
        .set_response_timeout(Some(Duration::from_secs(30)));
    redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection_with_config(&patient)
        .await
        .expect("connect to redis")
}

/// A port that is free on 127.0.0.1 now, as is port + 10000 (a cluster
/// node's bus port). Drawn below Linux's ephemeral range, so that outgoing
/// connections do not take it in the meantime.
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = 20_000 + rand::random::<u16>() % 12_000;
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
    panic!("no free port pair found for redis-server");
}

/// TLS files for a server (PEM paths).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// How to start a server.
#[derive(Clone, Debug, Default)]
pub struct RedisOptions {
    /// `requirepass`: the password of the `default` user.
    pub requirepass: Option<String>,
    /// ACL users with full access, as (name, password).
    pub users: Vec<(String, String)>,
    /// Serve TLS only (`--tls-port`, plain port 0), no client certificates.
    pub tls: Option<TlsFiles>,
    /// `--cluster-enabled yes`, with `nodes.conf` in the server's directory.
    pub cluster: bool,
    /// More `redis-server` arguments, as separate argv entries.
    pub extra_args: Vec<String>,
}

/// A server process under [`SUPERVISOR`].
pub struct Supervised {
    shell: Child,
    stdin: Option<ChildStdin>,
    pub pid: u32,
}

impl Supervised {
    /// Starts `server` (a command whose program and arguments the
    /// supervisor runs) under the supervisor, with `dir` as its directory.
    pub fn start(dir: &Path, server: &Command) -> Result<Supervised, String> {
        Self::spawn(&mut Self::shell(dir, server))
    }

    /// The supervisor's command for `server`, to spawn once it is
    /// configured further (its user, `STOP_SIGNAL`).
    pub fn shell(dir: &Path, server: &Command) -> Command {
        let mut shell = Command::new("sh");
        shell.arg("-c").arg(SUPERVISOR).arg("sh").arg(dir);
        shell.arg(server.get_program()).args(server.get_args());
        shell
    }

    /// Spawns `shell`, the supervisor command with its arguments.
    pub fn spawn(shell: &mut Command) -> Result<Supervised, String> {
        let mut shell = shell
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run sh for a server: {e}"))?;
        let stdin = shell.stdin.take();
        let mut pid_line = String::new();
        if let Some(stdout) = shell.stdout.take() {
            let _ = BufReader::new(stdout).read_line(&mut pid_line);
        }
        let pid = pid_line.trim().parse().unwrap_or(0);
        Ok(Supervised { shell, stdin, pid })
    }

    /// Sends the server `signal` (`KILL`, `QUIT`) and waits until it and
    /// its supervisor are gone; the directory stays.
    pub fn signal(mut self, signal: &str) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "{signal}");
        }
        let _ = self.shell.wait();
    }

    /// Whether the supervisor (and so the server) has exited.
    pub fn exited(&mut self) -> bool {
        self.shell.try_wait().ok().flatten().is_some()
    }

    /// Stops the server (`$STOP_SIGNAL`) and removes its directory.
    pub fn stop(mut self) {
        drop(self.stdin.take());
        let _ = self.shell.wait();
    }
}

/// A private `redis-server`. Dropping it stops the server.
pub struct RedisServer {
    port: u16,
    dir: TempDir,
    options: RedisOptions,
    process: Option<Supervised>,
}

impl RedisServer {
    /// A plain standalone server, no auth, no persistence.
    pub fn start() -> Self {
        Self::start_with(RedisOptions::default())
    }

    pub fn start_with(options: RedisOptions) -> Self {
        require_binaries();
        let mut last_error = String::new();
        // A free port can be taken between the check and the bind; try again
        // on another one then.
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("idemproxy-redis-")
                .tempdir()
                .expect("create a directory for redis-server");
            let mut server = RedisServer {
                port: free_port(),
                dir,
                options: options.clone(),
                process: None,
            };
            match server.spawn() {
                Ok(()) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("redis-server did not start: {last_error}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `redis://127.0.0.1:PORT` (`rediss://localhost:PORT` with TLS, the
    /// name the test certificate is issued for), without credentials.
    pub fn url(&self) -> String {
        match self.options.tls {
            Some(_) => format!("rediss://localhost:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.pid)
    }

    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    /// Crashes the server (SIGKILL) and waits until it is gone.
    pub fn kill(&mut self) {
        if let Some(process) = self.process.take() {
            process.signal("KILL");
        }
    }

    /// Starts the server again on the same port, with the same options and
    /// directory. Panics if it does not come up.
    pub fn restart(&mut self) {
        self.kill();
        // The port may linger for a moment after the kill.
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => {
                    panic!("redis-server did not restart on port {}: {e}", self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Runs `redis-cli` against this server (as `default`, with
    /// `requirepass` if set) and returns its stdout. Panics if it fails.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut cmd = Command::new(cli_bin());
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(password) = &self.options.requirepass {
            cmd.args(["-a", password, "--no-auth-warning"]);
        }
        if let Some(tls) = &self.options.tls {
            cmd.arg("--tls").arg("--cacert").arg(&tls.ca);
            cmd.args(["--sni", "localhost"]);
        }
        let out = cmd
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", cli_bin()));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "redis-cli {args:?} failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        let mut log = String::new();
        for name in ["server.out", "redis.log"] {
            if let Ok(text) = std::fs::read_to_string(self.dir.path().join(name)) {
                log.push_str(&text);
            }
        }
        log
    }

    fn args(&self) -> Vec<String> {
        let dir = self.dir.path().display().to_string();
        let mut args: Vec<String> = Vec::new();
        let mut push = |a: &[&str]| args.extend(a.iter().map(|s| s.to_string()));
        let port = self.port.to_string();
        match &self.options.tls {
            Some(tls) => {
                push(&["--port", "0", "--tls-port", &port]);
                push(&["--tls-cert-file", &tls.cert.display().to_string()]);
                push(&["--tls-key-file", &tls.key.display().to_string()]);
                push(&["--tls-ca-cert-file", &tls.ca.display().to_string()]);
                push(&["--tls-auth-clients", "no"]);
                if self.options.cluster {
                    push(&["--tls-cluster", "yes"]);
                }
            }
            None => push(&["--port", &port]),
        }
        push(&["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
        push(&["--dir", &dir, "--logfile", "redis.log", "--daemonize", "no"]);
        if let Some(password) = &self.options.requirepass {
            push(&["--requirepass", password]);
        }
        for (user, password) in &self.options.users {
            let pass = format!(">{password}");
            push(&["--user", user, "on", &pass, "~*", "&*", "+@all"]);
        }
        if self.options.cluster {
            push(&["--cluster-enabled", "yes"]);
            push(&["--cluster-config-file", "nodes.conf"]);
            push(&["--cluster-node-timeout", "2000"]);
        }
        args.extend(self.options.extra_args.iter().cloned());
        args
    }

    /// Starts the server under its supervisor and waits until it answers.
    fn spawn(&mut self) -> Result<(), String> {
        let mut server = Command::new(server_bin());
        server.args(self.args());
        self.process = Some(Supervised::start(self.dir.path(), &server)?);

        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if self.answers() {
                return Ok(());
            }
            let exited = self.process.as_mut().is_some_and(Supervised::exited);
            if exited || Instant::now() > deadline {
                let log = self.log();
                self.kill();
                return Err(format!(
                    "redis-server on port {} {}; its log:\n{log}",
                    self.port,
                    if exited { "exited" } else { "did not answer" }
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether the server answers on its port: a reply to an inline PING,
    /// even `-NOAUTH`, means it is serving. A TLS server counts once it
    /// accepts connections.
    fn answers(&self) -> bool {
        let addr: SocketAddr = ([127, 0, 0, 1], self.port).into();
        let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
            return false;
        };
        if self.options.tls.is_some() {
            return true;
        }
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        if stream.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut first = [0u8; 1];
        matches!(stream.read(&mut first), Ok(1) if first[0] == b'+' || first[0] == b'-')
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            // End of input: the supervisor stops the server (SIGTERM) and
            // removes the directory.
            process.stop();
        }
    }
}

/// A Redis Cluster of `n` masters, no replicas.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(masters: usize) -> Self {
        Self::start_with(masters, RedisOptions::default())
    }

    pub fn start_with(masters: usize, options: RedisOptions) -> Self {
        let options = RedisOptions {
            cluster: true,
            ..options
        };
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| RedisServer::start_with(options.clone()))
            .collect();
        let cluster = RedisCluster { nodes };
        let mut create = vec!["--cluster".to_string(), "create".to_string()];
        create.extend(cluster.nodes.iter().map(RedisServer::addr));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let create: Vec<&str> = create.iter().map(String::as_str).collect();
        cluster.nodes[0].cli(&create);
        cluster.wait_ok();
        cluster
    }

    /// Waits until every node reports `cluster_state:ok`.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + CLUSTER_TIMEOUT;
        for node in &self.nodes {
            loop {
                let info = node.cli(&["cluster", "info"]);
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster node {} is not ok: {info}",
                    node.addr()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Adds a master without slots (`redis-cli --cluster add-node`) and
    /// waits until every node knows it and the cluster is up on it; its
    /// index in `nodes` is returned.
    pub fn add_master(&mut self) -> usize {
        let added = RedisServer::start_with(RedisOptions {
            cluster: true,
            ..RedisOptions::default()
        });
        let seed = self.nodes[0].addr();
        self.nodes[0].cli(&["--cluster", "add-node", &added.addr(), &seed]);
        self.nodes.push(added);
        let masters = self.nodes.len();
        let deadline = Instant::now() + CLUSTER_TIMEOUT;
        for node in &self.nodes {
            // A migration to a node that does not see the cluster up yet
            // fails with CLUSTERDOWN.
            while node.cli(&["cluster", "nodes"]).matches("master").count() < masters
                || !node.cli(&["cluster", "info"]).contains("cluster_state:ok")
            {
                assert!(
                    Instant::now() < deadline,
                    "{} never met the new master",
                    node.addr()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        masters - 1
    }

    /// Moves `slots` slots, with their keys, from the other masters to
    /// `nodes[to]` (`redis-cli --cluster reshard`).
    pub fn reshard_to(&self, to: usize, slots: usize) {
        let id = self.nodes[to].cli(&["cluster", "myid"]);
        let (seed, slots) = (self.nodes[0].addr(), slots.to_string());
        self.nodes[0].cli(&[
            "--cluster",
            "reshard",
            &seed,
            "--cluster-from",
            "all",
            "--cluster-to",
            id.trim(),
            "--cluster-slots",
            &slots,
            "--cluster-yes",
        ]);
        self.wait_ok();
    }

    /// The slot of `key`, as the cluster computes it.
    pub fn keyslot(&self, key: &str) -> u16 {
        self.nodes[0]
            .cli(&["cluster", "keyslot", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT answers a number")
    }

    /// The node serving `key`'s slot.
    pub fn node_for(&self, key: &str) -> &RedisServer {
        let slot = self.keyslot(key);
        self.nodes
            .iter()
            .find(|node| node.owns(slot))
            .expect("a node serves every slot")
    }
}

impl RedisServer {
    /// Whether this cluster node serves `slot` (from `CLUSTER NODES`, "myself").
    pub fn owns(&self, slot: u16) -> bool {
        let nodes = self.cli(&["cluster", "nodes"]);
        let Some(myself) = nodes.lines().find(|l| l.contains("myself")) else {
            return false;
        };
        myself.split_whitespace().skip(8).any(|range| {
            let mut bounds = range.split('-');
            let (Some(lo), hi) = (bounds.next(), bounds.next()) else {
                return false;
            };
            let (Ok(lo), Ok(hi)) = (lo.parse::<u16>(), hi.unwrap_or(lo).parse::<u16>()) else {
                return false;
            };
            (lo..=hi).contains(&slot)
        })
    }
}

/// One standalone server for the whole test binary, every test file's
/// (kept in a `static`; the supervisor stops it when the process exits). Keep data private per test
/// with a unique key prefix.
pub fn shared() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

/// One 3-master cluster for the whole test binary (see [`shared`]).
pub fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| RedisCluster::start(3))
}

/// A key prefix no other test uses.
pub fn unique_prefix(name: &str) -> String {
    format!("test:{name}:{:016x}:", rand::random::<u64>())
}

/// The name the Sentinels of [`SentinelGroup`] monitor the primary under.
pub const MASTER_NAME: &str = "idemproxy-primary";

/// A primary, one replica of it, and three Sentinels watching it (quorum
/// 2, `down-after-milliseconds` 1000): a real failover in about 2-3 s
/// after the primary dies.
pub struct SentinelGroup {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<SentinelProcess>,
}

impl SentinelGroup {
    pub fn start() -> Self {
        require_binaries();
        let primary = RedisServer::start();
        let replica = RedisServer::start_with(RedisOptions {
            extra_args: vec![
                "--replicaof".into(),
                "127.0.0.1".into(),
                primary.port().to_string(),
                // `DEBUG SLEEP`: a replica that falls behind, on demand.
                "--enable-debug-command".into(),
                "yes".into(),
            ],
            ..RedisOptions::default()
        });
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while !replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
        {
            assert!(
                Instant::now() < deadline,
                "the replica did not sync: {}",
                replica.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let sentinels = (0..3)
            .map(|_| SentinelProcess::start(primary.port()))
            .collect();
        let group = SentinelGroup {
            primary,
            replica,
            sentinels,
        };
        // Every Sentinel knows the replica before anything is failed over.
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while !group
            .sentinels
            .iter()
            .all(|s| s.knows_replica(group.replica.port()))
        {
            assert!(
                Instant::now() < deadline,
                "the Sentinels did not find the replica"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        group
    }

    /// `redis://127.0.0.1:<port>` of each Sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}", s.port))
            .collect()
    }

    /// The port of the primary the first Sentinel names now.
    pub fn primary_port_named(&self) -> Option<u16> {
        let out = self.sentinels[0].cli(&["SENTINEL", "get-master-addr-by-name", MASTER_NAME]);
        out.lines().nth(1)?.trim().parse().ok()
    }
}

/// A `redis-server --sentinel` of a [`SentinelGroup`]. Dropping it stops it.
pub struct SentinelProcess {
    pub port: u16,
    dir: TempDir,
    process: Option<Supervised>,
}

impl SentinelProcess {
    fn start(primary_port: u16) -> Self {
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("idemproxy-sentinel-")
                .tempdir()
                .expect("create a directory for a sentinel");
            let port = free_port();
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile sentinel.log\n\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                     sentinel failover-timeout {MASTER_NAME} 6000\n\
                     sentinel parallel-syncs {MASTER_NAME} 1\n",
                    dir = dir.path().display()
                ),
            )
            .expect("write sentinel.conf");
            let mut server = Command::new(server_bin());
            server.arg(&conf).arg("--sentinel");
            let process = Supervised::start(dir.path(), &server).expect("run a sentinel");
            let sentinel = SentinelProcess {
                port,
                dir,
                process: Some(process),
            };
            let deadline = Instant::now() + STARTUP_TIMEOUT;
            while Instant::now() < deadline {
                if sentinel.answers() {
                    return sentinel;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("no sentinel started");
    }

    fn answers(&self) -> bool {
        let addr: SocketAddr = ([127, 0, 0, 1], self.port).into();
        let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        if stream.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut first = [0u8; 1];
        matches!(stream.read(&mut first), Ok(1) if first[0] == b'+')
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(cli_bin())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", cli_bin()));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn knows_replica(&self, port: u16) -> bool {
        self.cli(&["SENTINEL", "replicas", MASTER_NAME])
            .contains(&port.to_string())
    }

    /// The Sentinel's log (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            process.stop();
        }
    }
}
