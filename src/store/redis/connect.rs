//! Reaching Redis: the credentials, TLS roots and timeouts every
//! connection gets, the three topologies (one node, a cluster, a primary
//! found through Sentinel), and checking at startup that it can serve.
//! The connections themselves are in [`super::connections`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;
use redis::cluster::ClusterClientBuilder;
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{
    Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisError, TlsCertificates,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use super::connections::{Conn, Connector, LoopConnections};
use super::removals::RemovalChannel;
use super::sentinel::{SentinelConn, SentinelPrimary};
use super::RedisStore;
use crate::core::Clock;
use crate::store::settings::StoreSettings;
use crate::store::StoreError;

/// Floor of the connect and response timeouts. `store.timeout` (250 ms by
/// default) already bounds every call at the caller; these only stop a
/// connection attempt or an answer from hanging forever, e.g. against a
/// host that drops packets, and let a reconnection that outlives one
/// request's timeout still finish for the next one.
const MIN_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// Reconnection attempts per failed connection (single node). Kept low so
/// that a dead Redis fails calls quickly; the next call starts a new round.
const RECONNECT_RETRIES: usize = 2;

impl RedisStore {
    /// Connects to the standalone Redis at `config.url` (`redis://` or
    /// `rediss://`), with the credentials, database and CA of `config`, and
    /// loads the scripts. Fails if Redis cannot be reached or refuses the
    /// credentials; once connected, the store reconnects by itself.
    pub async fn connect(config: &StoreSettings) -> Result<RedisStore, StoreError> {
        Self::connect_within(config, Duration::ZERO).await
    }

    /// [`RedisStore::connect`], trying again for up to `wait` while Redis is
    /// not up yet (see [`open`](super::open)).
    pub async fn connect_within(
        config: &StoreSettings,
        wait: Duration,
    ) -> Result<RedisStore, StoreError> {
        let info = config
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| config_error("store.url", e))?;
        let client = node_client(info, config, config.database, "store.url")?;
        let io_timeout = io_timeout(config);
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(io_timeout))
            .set_response_timeout(Some(io_timeout))
            .set_number_of_retries(RECONNECT_RETRIES)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let removals = RemovalChannel::new(vec![client.clone()], &config.key_prefix, io_timeout);
        let connector = Connector::Single(client, manager_config);
        let conn = connector.start(&redact_url(&config.url), wait).await?;
        Self::ready(conn, connector, removals, config, "redis").await
    }

    /// Connects to the Redis Cluster whose seed nodes are `config.urls`
    /// (`config.url` alone when `urls` is empty), with the credentials and CA
    /// of `config`, and loads the scripts on every primary.
    pub async fn connect_cluster(config: &StoreSettings) -> Result<RedisStore, StoreError> {
        Self::connect_cluster_within(config, Duration::ZERO).await
    }

    /// [`RedisStore::connect_cluster`], trying again for up to `wait` while
    /// the cluster is not up yet (see [`open`](super::open)).
    pub async fn connect_cluster_within(
        config: &StoreSettings,
        wait: Duration,
    ) -> Result<RedisStore, StoreError> {
        let urls: Vec<&str> = if config.urls.is_empty() {
            vec![config.url.as_str()]
        } else {
            config.urls.iter().map(String::as_str).collect()
        };
        if config.key_prefix.contains(['{', '}']) {
            // Redis hashes the first `{...}` of a key: braces in the prefix
            // would make them the hash tag, and put every record in one slot.
            tracing::warn!(
                prefix = %config.key_prefix,
                "store.key_prefix contains braces: records may not spread over the cluster"
            );
        }
        if config.database.is_some_and(|db| db != 0) {
            return Err(StoreError::Unavailable(
                "store.database: a Redis Cluster has database 0 only".into(),
            ));
        }
        let mut infos: Vec<ConnectionInfo> = Vec::with_capacity(urls.len());
        for url in &urls {
            infos.push(
                url.into_connection_info()
                    .map_err(|e| config_error("store.urls", e))?,
            );
        }
        let tls = infos
            .first()
            .is_some_and(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. }));
        let io_timeout = io_timeout(config);
        // Removals are followed on one node at a time (see [`super::removals`]).
        let nodes = infos
            .iter()
            .map(|info| node_client(info.clone(), config, None, "store.urls"))
            .collect::<Result<Vec<_>, _>>()?;
        let removals = RemovalChannel::new(nodes, &config.key_prefix, io_timeout);
        let mut builder = ClusterClientBuilder::new(infos)
            .connection_timeout(io_timeout)
            .response_timeout(io_timeout)
            // MOVED/ASK redirections during resharding are retried within
            // these; a dead cluster fails calls after them.
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(200)
            .tcp_settings(tcp_settings());
        if let Some(username) = &config.username {
            builder = builder.username(username);
        }
        if let Some(password) = password(config)? {
            builder = builder.password(password);
        }
        if let Some(certs) = tls_certificates(config, tls)? {
            builder = builder.certs(certs);
        }
        let client = builder.build().map_err(|e| config_error("store.urls", e))?;
        let connector = Connector::Cluster(client);
        let conn = connector.start(&redacted_list(&urls), wait).await?;
        Self::ready(conn, connector, removals, config, "redis-cluster").await
    }

    /// Connects to the primary the Sentinels at `config.sentinels` name for
    /// `config.master_name`, with the credentials, database and CA of
    /// `config` for the data nodes (and the same user and password for the
    /// Sentinels), and follows it across failovers.
    pub async fn connect_sentinel_within(
        config: &StoreSettings,
        wait: Duration,
    ) -> Result<RedisStore, StoreError> {
        let mut addrs = Vec::with_capacity(config.sentinels.len());
        for url in &config.sentinels {
            let info = url
                .as_str()
                .into_connection_info()
                .map_err(|e| config_error("store.sentinels", e))?;
            addrs.push(info.addr().clone());
        }
        let tls = addrs
            .iter()
            .any(|addr| matches!(addr, ConnectionAddr::TcpTls { .. }));
        let mut builder =
            SentinelClientBuilder::new(addrs, &config.master_name, SentinelServerType::Master)
                .map_err(|e| config_error("store.sentinels", e))?
                .set_client_to_redis_tcp_settings(tcp_settings())
                .set_client_to_sentinel_tcp_settings(tcp_settings());
        if let Some(db) = config.database {
            builder = builder.set_client_to_redis_db(db);
        }
        if let Some(username) = &config.username {
            builder = builder
                .set_client_to_redis_username(username)
                .set_client_to_sentinel_username(username);
        }
        if let Some(password) = password(config)? {
            builder = builder
                .set_client_to_redis_password(&password)
                .set_client_to_sentinel_password(&password);
        }
        if tls {
            builder = builder
                .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
            if let Some(certs) = tls_certificates(config, true)? {
                builder = builder
                    .set_client_to_redis_certificates(certs.clone())
                    .set_client_to_sentinel_certificates(certs);
            }
        }
        let sentinel = builder
            .build()
            .map_err(|e| config_error("store.sentinels", e))?;
        let io_timeout = io_timeout(config);
        let connection = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(io_timeout))
            .set_response_timeout(Some(io_timeout));
        let primary = Arc::new(SentinelPrimary::new(
            sentinel,
            connection,
            config.database.unwrap_or(0),
        ));
        let removals =
            RemovalChannel::following(Arc::clone(&primary), &config.key_prefix, io_timeout);
        let connector = Connector::Sentinel(SentinelConn(primary));
        let target = format!(
            "{} ({})",
            redacted_list(
                &config
                    .sentinels
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>()
            ),
            config.master_name
        );
        let conn = connector.start(&target, wait).await?;
        Self::ready(conn, connector, removals, config, "redis-sentinel").await
    }

    /// Checks that Redis takes `SET ... NX GET` (7.0 or later) and can be
    /// written to.
    async fn ready(
        conn: Conn,
        connector: Connector,
        removals: Arc<RemovalChannel>,
        config: &StoreSettings,
        kind: &'static str,
    ) -> Result<RedisStore, StoreError> {
        let store = RedisStore {
            shared: conn,
            loops: LoopConnections::new(connector),
            removals,
            prefix: config.key_prefix.clone(),
            kind,
            clock: Clock::wall(),
            min_replica_acks: config.min_replica_acks,
            replica_ack_timeout: config.replica_ack_timeout,
        };
        // A key of our own that lives 1 ms: asking is the only check that
        // works the same through ACLs, proxies and managed Redis services.
        redis::cmd("SET")
            .arg(format!("{}{{version-check}}", store.prefix))
            .arg("")
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(1)
            .query_async::<Option<Vec<u8>>>(&mut store.shared.clone())
            .await
            .map_err(|e| {
                // Before 7.0, NX and GET together are a syntax error; any
                // other failure (a read-only replica, an ACL) says itself.
                let hint = if e.to_string().contains("syntax error") {
                    " (SET with both NX and GET needs Redis 7.0 or later)"
                } else {
                    ""
                };
                StoreError::Unavailable(format!("cannot write a test key to redis: {e}{hint}"))
            })?;
        store.check_eviction_policy().await;
        Ok(store)
    }

    /// Warns when Redis may evict records to make room. Every record has an
    /// expiry, so every `volatile-*` policy can evict it, as can the
    /// `allkeys-*` ones: an evicted claim or completion is a key forgotten,
    /// and its retry executes again. Only `noeviction` (Redis's default),
    /// or no `maxmemory`, is safe. A warning, not a refusal: managed
    /// services often hide `CONFIG` (then this says it could not check) or
    /// default to `volatile-lru` with room to spare, and the operator is
    /// the one who knows.
    async fn check_eviction_policy(&self) {
        // Several parameters in one CONFIG GET: Redis 7.0, which `ready`
        // requires anyway. On a cluster this asks one node.
        let asked: Result<HashMap<String, String>, _> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .arg("maxmemory")
            .query_async(&mut self.shared.clone())
            .await;
        match asked {
            Ok(config) => {
                let policy = config.get("maxmemory-policy").map(String::as_str);
                let maxmemory = config.get("maxmemory").map(String::as_str);
                if let Some(warning) = eviction_warning(policy, maxmemory) {
                    tracing::error!(store = self.kind, "{warning}");
                }
            }
            Err(e) => tracing::warn!(
                store = self.kind,
                error = %e,
                "cannot read redis's maxmemory-policy (CONFIG GET): make sure it is noeviction, or that maxmemory is 0, or records may be evicted and their retries executed again"
            ),
        }
    }
}

/// What to tell the operator about Redis's `maxmemory-policy` and
/// `maxmemory` (`CONFIG GET` values), if anything: see
/// [`RedisStore::check_eviction_policy`].
fn eviction_warning(policy: Option<&str>, maxmemory: Option<&str>) -> Option<String> {
    let policy = policy?;
    if policy == "noeviction" || maxmemory == Some("0") {
        return None;
    }
    Some(format!(
        "redis runs with maxmemory-policy {policy} and maxmemory {}: when it fills up it evicts idempotency records, and the retry of an evicted key executes again; set maxmemory-policy noeviction (writes then fail with 503 store-unavailable instead)",
        maxmemory.unwrap_or("unknown")
    ))
}

/// A client of one node, with `config`'s credentials, TLS CA and TCP
/// settings (and `database`, standalone only). `field` names the setting
/// the address came from, for errors.
fn node_client(
    info: ConnectionInfo,
    config: &StoreSettings,
    database: Option<i64>,
    field: &str,
) -> Result<Client, StoreError> {
    let mut settings = info.redis_settings().clone();
    if let Some(username) = &config.username {
        settings = settings.set_username(username);
    }
    if let Some(password) = password(config)? {
        settings = settings.set_password(password);
    }
    if let Some(db) = database {
        settings = settings.set_db(db);
    }
    let info = info
        .set_redis_settings(settings)
        .set_tcp_settings(tcp_settings());
    let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
    match tls_certificates(config, tls)? {
        Some(certs) => Client::build_with_tls(info, certs),
        None => Client::open(info),
    }
    .map_err(|e| config_error(field, e))
}

/// `TCP_NODELAY`, which redis-rs leaves off: with Nagle's algorithm a small
/// write waits while an earlier one is unacknowledged, and on a multiplexed
/// connection under load one usually is. Redis sets it on its side.
fn tcp_settings() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

fn io_timeout(config: &StoreSettings) -> Duration {
    config.timeout.saturating_mul(4).max(MIN_IO_TIMEOUT)
}

/// The password `config` asks for (see [`StoreSettings::resolved_password`]).
fn password(config: &StoreSettings) -> Result<Option<String>, StoreError> {
    config.resolved_password()
}

/// The trust roots for `rediss://` when `ca_file` is set: its certificates
/// in addition to the system roots (the ones redis-rs uses without it).
/// redis-rs takes a single PEM bundle, which then replaces the system roots,
/// so the system roots are appended to it here.
fn tls_certificates(
    config: &StoreSettings,
    tls: bool,
) -> Result<Option<TlsCertificates>, StoreError> {
    let Some(path) = &config.ca_file else {
        return Ok(None);
    };
    let shown = path.display();
    if !tls {
        return Err(StoreError::Unavailable(format!(
            "store.ca_file ({shown}) is set, but the Redis URL is not rediss:// (TLS)"
        )));
    }
    let mut pem = std::fs::read(path)
        .map_err(|e| StoreError::Unavailable(format!("store.ca_file {shown}: {e}")))?;
    let mut found = 0usize;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| StoreError::Unavailable(format!("store.ca_file {shown}: {e}")))?;
        found += 1;
    }
    if found == 0 {
        return Err(StoreError::Unavailable(format!(
            "store.ca_file {shown}: no PEM certificate in it"
        )));
    }
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        // A broken system store must not stop the proxy: `ca_file` applies.
        tracing::warn!(error = %e, "cannot load some system CA certificates");
    }
    pem.push(b'\n');
    for cert in &native.certs {
        append_pem(&mut pem, cert);
    }
    Ok(Some(TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }))
}

/// Appends `cert` to `pem` as a PEM `CERTIFICATE` block.
fn append_pem(pem: &mut Vec<u8>, cert: &[u8]) {
    use base64::Engine;
    let body = base64::engine::general_purpose::STANDARD.encode(cert);
    pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.extend_from_slice(line);
        pem.push(b'\n');
    }
    pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
}

/// A Redis URL fit to print: the one redaction of URLs (see
/// [`crate::core::redact`]), for errors, logs and `idemproxy check` alike.
pub use crate::core::redact_url;

/// The one check of a Redis URL's scheme before connecting, naming `at`.
pub fn check_url(at: &str, url: &str) -> Result<(), String> {
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        Ok(())
    } else {
        Err(format!(
            "{at}: `{}` must be a redis:// or rediss:// URL",
            redact_url(url)
        ))
    }
}

fn redacted_list(urls: &[&str]) -> String {
    urls.iter()
        .map(|u| redact_url(u))
        .collect::<Vec<_>>()
        .join(", ")
}

fn config_error(field: &str, e: RedisError) -> StoreError {
    StoreError::Unavailable(format!("{field}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_evicting_policy_with_a_memory_limit_is_warned_about() {
        assert_eq!(eviction_warning(Some("noeviction"), Some("1000")), None);
        // No limit, nothing is ever evicted.
        assert_eq!(eviction_warning(Some("volatile-lru"), Some("0")), None);
        for policy in [
            "volatile-lru",
            "allkeys-lru",
            "volatile-ttl",
            "allkeys-random",
        ] {
            let warning = eviction_warning(Some(policy), Some("104857600")).unwrap_or_default();
            assert!(warning.contains(policy), "{warning}");
            assert!(warning.contains("executes again"), "{warning}");
        }
        // Nothing said, nothing known: the caller logs that it cannot check.
        assert_eq!(eviction_warning(None, None), None);
    }

    #[test]
    fn appended_pem_parses_back() {
        let der: Vec<u8> = (0..=255u8).cycle().take(700).collect();
        let mut pem = Vec::new();
        append_pem(&mut pem, &der);
        append_pem(&mut pem, &der[..10]);
        let parsed: Vec<_> = CertificateDer::pem_slice_iter(&pem)
            .map(|c| c.map(|c| c.to_vec()).ok())
            .collect();
        assert_eq!(parsed, vec![Some(der.clone()), Some(der[..10].to_vec())]);
    }

    #[test]
    fn redacts_credentials() {
        assert_eq!(
            redact_url("redis://u:p@h:1/2"),
            "redis://u:<redacted>@h:1/2"
        );
        assert_eq!(redact_url("rediss://h:1"), "rediss://h:1");
        assert_eq!(
            redact_url("redis://app:pw@127.0.0.1:6379/2"),
            "redis://app:<redacted>@127.0.0.1:6379/2"
        );
        assert!(!redact_url("idemproxy:S3cret@redis:6379").contains("S3cret"));
        assert_eq!(
            check_url("store.url", "http://u:S3cret@h").expect_err("not redis"),
            "store.url: `http://u:<redacted>@h` must be a redis:// or rediss:// URL"
        );
    }

    #[test]
    fn password_precedence() {
        let mut config = StoreSettings::default();
        assert_eq!(password(&config).ok().flatten(), None);
        config.password_env = Some("IDEMPROXY_TEST_SURELY_UNSET_VARIABLE".into());
        assert!(matches!(
            password(&config),
            Err(StoreError::Unavailable(m)) if m.contains("IDEMPROXY_TEST_SURELY_UNSET_VARIABLE")
        ));
        config.password = Some("direct".into());
        assert_eq!(password(&config).ok().flatten().as_deref(), Some("direct"));
    }
}
