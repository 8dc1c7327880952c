//! Reaching PostgreSQL: the URL and credentials, the pool and its
//! timeouts, and at startup the tables migrated, waiting for a database
//! that is not up yet.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};
use tokio::sync::watch;
use tokio_postgres::config::SslMode;
use tokio_postgres::NoTls;

use super::conn::{setting_millis, Reclaim};
use super::pools::{LoopPools, MakePool};
use super::removals::{self, RemovalFeed};
use super::statements::Statements;
use super::tls::MakeRustls;
use super::{pg_error, schema, PostgresStore};
use crate::core::{redact_url, Clock};
use crate::store::settings::StoreSettings;
use crate::store::StoreError;

/// How long [`open`] waits for a PostgreSQL that is not up yet.
pub const STARTUP_WAIT: Duration = Duration::from_secs(30);

/// Floor of the connect and pool timeouts (`store.timeout` bounds every
/// call at the caller; these only keep a connection attempt from hanging,
/// and let one that outlives a request's timeout finish for the next).
const MIN_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// Opens the store, its tables migrated, waiting up to [`STARTUP_WAIT`] for
/// a database that refuses connections or is still starting, and starts
/// its sweep of expired rows every `purge_interval`.
pub async fn open(config: &StoreSettings) -> Result<Arc<PostgresStore>, StoreError> {
    open_within(config, STARTUP_WAIT).await
}

/// [`open`] with another bound on the wait.
pub async fn open_within(
    config: &StoreSettings,
    wait: Duration,
) -> Result<Arc<PostgresStore>, StoreError> {
    let store = Arc::new(PostgresStore::connect_within(config, wait).await?);
    store.spawn_sweeper(config.purge_interval);
    Ok(store)
}

/// What `store.url` and the settings beside it are wrong about, if
/// anything (`idemproxy check` and startup).
pub fn check_settings(config: &StoreSettings) -> Vec<String> {
    let mut problems = Vec::new();
    if let Err(StoreError::Unavailable(why)) = pg_config(config) {
        problems.push(why);
    }
    if let Err(why) = schema::check_prefix(&config.table_prefix) {
        problems.push(why);
    }
    if config.pool_size == 0 {
        problems.push("store.pool_size: must be at least 1".into());
    }
    problems
}

impl PostgresStore {
    /// Connects to the database at `config.url` and migrates its tables.
    /// Fails if it cannot be reached; once connected, the store reconnects
    /// by itself. No sweeper runs (see [`open`]).
    pub async fn connect(config: &StoreSettings) -> Result<PostgresStore, StoreError> {
        Self::connect_within(config, Duration::ZERO).await
    }

    /// [`PostgresStore::connect`], trying again for up to `wait` while the
    /// database is not up yet.
    pub async fn connect_within(
        config: &StoreSettings,
        wait: Duration,
    ) -> Result<PostgresStore, StoreError> {
        let problems = check_settings(config);
        if !problems.is_empty() {
            return Err(StoreError::Unavailable(problems.join("; ")));
        }
        let pg = pg_config(config)?;
        let io = io_timeout(config);
        let tls = match pg.get_ssl_mode() {
            SslMode::Require => Some(MakeRustls::new(config)?),
            _ => None,
        };
        // Every pooled connection: store calls, and the sweep, migrations
        // and walks, which lift the statement limit for their own
        // transaction (`SET LOCAL`).
        let (statement_limit, lock_limit) = pool_limits(config);
        let pooled = with_server_limits(&pg, statement_limit, lock_limit);
        let pool = build_pool(&pooled, tls.as_ref(), config.pool_size, io)?;
        let make: MakePool = {
            let (pooled, tls) = (pooled.clone(), tls.clone());
            Box::new(move |size| build_pool(&pooled, tls.as_ref(), size, io).ok())
        };
        migrate_when_up(&pool, config, wait).await?;
        let sql = Arc::new(Statements::new(&config.table_prefix));
        // The `LISTEN` connection is patient by design (see `removals`):
        // its own statements are bounded by its own I/O timeout.
        let feed_limit = io.max(removals::HEARTBEAT);
        let feed = RemovalFeed::new(
            with_server_limits(&pg, feed_limit, feed_limit),
            tls.clone(),
            sql.channel.clone(),
            io,
        );
        let (sweep_stop, _) = watch::channel(());
        Ok(PostgresStore {
            pools: Arc::new(LoopPools::new(pool, make, config.pool_size)),
            reclaim: Arc::new(Reclaim::new(tls, io)),
            sql,
            clock: Clock::wall(),
            feed,
            sweep_stop: Arc::new(sweep_stop),
        })
    }
}

/// A pool of at most `size` connections to `pg`, each checked when handed
/// out, its waits bounded by `io`.
fn build_pool(
    pg: &tokio_postgres::Config,
    tls: Option<&MakeRustls>,
    size: usize,
    io: Duration,
) -> Result<Pool, StoreError> {
    // A connection a restart closed is noticed when it is handed out,
    // without a round trip per call.
    let recycling = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match tls {
        Some(tls) => Manager::from_config(pg.clone(), tls.clone(), recycling),
        None => Manager::from_config(pg.clone(), NoTls, recycling),
    };
    Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(io))
        .create_timeout(Some(io))
        .recycle_timeout(Some(io))
        .build()
        .map_err(|e| StoreError::Unavailable(format!("postgres pool: {e}")))
}

/// Migrates the tables, trying again until `wait` is up while the database
/// refuses connections or is starting; credentials, a missing database or
/// a failed migration fail at once.
async fn migrate_when_up(
    pool: &Pool,
    config: &StoreSettings,
    wait: Duration,
) -> Result<(), StoreError> {
    let deadline = Instant::now() + wait;
    loop {
        let failed = match pool.get().await {
            Ok(mut client) => {
                let client: &mut tokio_postgres::Client = &mut client;
                return schema::migrate(client, &config.table_prefix).await;
            }
            Err(e) => e,
        };
        let shown = redact_url(&config.url);
        if !worth_waiting(&failed) || Instant::now() >= deadline {
            let why = match failed {
                PoolError::Backend(e) => match pg_error(e) {
                    StoreError::Unavailable(why) => why,
                    other => other.to_string(),
                },
                other => other.to_string(),
            };
            return Err(StoreError::Unavailable(format!(
                "cannot connect to PostgreSQL at {shown}: {why}"
            )));
        }
        tracing::info!(url = %shown, error = %failed, "PostgreSQL is not up yet; waiting");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether a failed connection may succeed later by itself: refused, reset
/// or timed out, or a server still starting or shutting down (SQLSTATE
/// 57P0x). Credentials, a missing database, a certificate that does not
/// verify fail at once.
fn worth_waiting(e: &PoolError) -> bool {
    let e = match e {
        PoolError::Timeout(_) => return true,
        PoolError::Backend(e) => e,
        _ => return false,
    };
    if let Some(db) = e.as_db_error() {
        return db.code().code().starts_with("57P0");
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            return matches!(
                io.kind(),
                ConnectionRefused
                    | ConnectionReset
                    | ConnectionAborted
                    | NotConnected
                    | TimedOut
                    | UnexpectedEof
                    | BrokenPipe
                    | AddrNotAvailable
            );
        }
        source = cause.source();
    }
    // No cause: tokio-postgres's own connect timeout.
    true
}

/// The connection settings: the URL's, with `username` and the password
/// (`password`, else `password_env`) over it.
fn pg_config(config: &StoreSettings) -> Result<tokio_postgres::Config, StoreError> {
    let shown = redact_url(&config.url);
    if !(config.url.starts_with("postgres://") || config.url.starts_with("postgresql://")) {
        return Err(StoreError::Unavailable(format!(
            "store.url: `{shown}` must be a postgres:// URL"
        )));
    }
    let mut pg: tokio_postgres::Config = config
        .url
        .parse()
        .map_err(|e| StoreError::Unavailable(format!("store.url: `{shown}`: {e}")))?;
    if config.ca_file.is_some() && pg.get_ssl_mode() != SslMode::Require {
        return Err(StoreError::Unavailable(format!(
            "store.ca_file is set, but `{shown}` does not ask for TLS (?sslmode=require)"
        )));
    }
    if let Some(user) = &config.username {
        pg.user(user);
    }
    if let Some(password) = config.resolved_password()? {
        pg.password(password);
    }
    if pg.get_user().is_none() {
        return Err(StoreError::Unavailable(format!(
            "store.url: `{shown}` names no user (postgres://user@host/db, or store.username)"
        )));
    }
    pg.application_name("idemproxy")
        .connect_timeout(io_timeout(config))
        .keepalives_idle(Duration::from_secs(30));
    Ok(pg)
}

fn io_timeout(config: &StoreSettings) -> Duration {
    config.timeout.saturating_mul(4).max(MIN_IO_TIMEOUT)
}

/// The pools' connections' server-side limits, `(statement_timeout,
/// lock_timeout)`: PostgreSQL ends by itself what a caller has given up
/// on, so that no statement keeps its connection, and the calls queued
/// behind it, for long after its caller stopped waiting.
///
/// `lock_timeout` is `store.timeout`, the bound every call has at its
/// caller: a claim waiting on a row another session holds (an operator's
/// `SELECT … FOR UPDATE` left open, a stuck transaction) lets go of its
/// connection after that instead of holding it until the lock goes. Not
/// lower: the wait starts after the caller's clock did, so the server
/// never gives up on a lock its caller would still have waited for; a
/// caller that waits past `store.timeout` (a `begin` followed until its
/// lease ends, a completion settled in the background) takes the error as
/// any other and retries, or releases by its token.
///
/// `statement_timeout` is twice that, the backstop for the rest (a slow
/// disk, a plan gone wrong): above `lock_timeout`, so that a statement
/// waiting on a lock ends by that and says so (SQLSTATE 55P03, "canceling
/// statement due to lock timeout", in the log), and a slow statement of a
/// caller that waits longer gets one more `store.timeout` to finish; below
/// the proxy's own wait for a statement given up on (`io_timeout`: 4 ×
/// `store.timeout`, at least 1 s), so that the server ends it before the
/// proxy has to cancel it and close its connection ([`conn`](super::conn)).
fn pool_limits(config: &StoreSettings) -> (Duration, Duration) {
    (config.timeout.saturating_mul(2), config.timeout)
}

/// `pg` with PostgreSQL's own bounds on every statement of its sessions
/// (`statement_timeout`) and on any wait for a lock (`lock_timeout`), set
/// in the startup packet's `options`: no round trip, and they hold from
/// the first statement. An `options` of the URL's comes after them, so an
/// operator's own `-c lock_timeout=…` there wins.
fn with_server_limits(
    pg: &tokio_postgres::Config,
    statement: Duration,
    lock: Duration,
) -> tokio_postgres::Config {
    let mut options = format!(
        "-c statement_timeout={}ms -c lock_timeout={}ms",
        setting_millis(statement),
        setting_millis(lock)
    );
    if let Some(theirs) = pg.get_options() {
        options.push(' ');
        options.push_str(theirs);
    }
    let mut pg = pg.clone();
    pg.options(options);
    pg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str) -> StoreSettings {
        StoreSettings {
            url: url.into(),
            ..StoreSettings::default()
        }
    }

    #[test]
    fn urls_are_checked_and_their_passwords_never_shown() {
        assert!(check_settings(&settings("postgres://app@127.0.0.1:5432/db")).is_empty());
        let wrong = check_settings(&settings("redis://user:secret@127.0.0.1"));
        assert_eq!(wrong.len(), 1, "{wrong:?}");
        assert!(!wrong[0].contains("secret"), "{wrong:?}");
        assert!(check_settings(&settings("postgres://app@db/x?sslmode=require")).is_empty());
        let ca_without_tls = StoreSettings {
            ca_file: Some("/etc/ca.pem".into()),
            ..settings("postgres://app@db/x")
        };
        let plain = check_settings(&ca_without_tls);
        assert!(plain[0].contains("sslmode=require"), "{plain:?}");
        let nobody = check_settings(&settings("postgres://127.0.0.1/db"));
        assert!(nobody[0].contains("names no user"), "{nobody:?}");
    }

    #[test]
    fn the_server_limits_come_before_the_urls_own_options() {
        let config = settings("postgres://app@db/x?options=-c%20search_path%3Dpay");
        let pg = pg_config(&config).expect("a valid URL");
        // store.timeout's default, 250 ms.
        let (statement, lock) = pool_limits(&config);
        let limited = with_server_limits(&pg, statement, lock);
        assert_eq!(
            limited.get_options(),
            Some("-c statement_timeout=500ms -c lock_timeout=250ms -c search_path=pay")
        );
        let plain = pg_config(&settings("postgres://app@db/x")).expect("a valid URL");
        let limited = with_server_limits(&plain, Duration::from_micros(1), Duration::ZERO);
        assert_eq!(
            limited.get_options(),
            Some("-c statement_timeout=1ms -c lock_timeout=1ms"),
            "never 0, which would mean no limit"
        );
        assert_eq!(setting_millis(Duration::from_micros(250_001)), 251);
        assert_eq!(
            setting_millis(Duration::from_secs(u64::MAX)),
            i32::MAX as u64
        );
    }
}
