//! idemproxy: an HTTP reverse proxy that enforces `Idempotency-Key`
//! semantics, so at-least-once callers get at-most-once side effects.
//!
//! The request path, outside in:
//! 1. [`server`] accepts connections (HTTP/1.1, h2c, TLS) and tags each
//!    request with the peer address;
//! 2. [`observe`]'s request ids are set and propagated;
//! 3. [`idempotency`] decides per request: pass through, reject, replay from
//!    the [`store`], or execute once and store the outcome;
//! 4. [`forward`] sends it to the upstream and classifies failures by
//!    whether the request could have executed.
//!
//! The modules are layers that import one way only (docs/development.md, "Layout";
//! `tests/architecture.rs` holds them to it): [`core`] is the leaf;
//! [`http`], [`observe`], [`store`], [`forward`], [`idempotency`],
//! [`server`] and [`admin`] build on the ones before them; each part owns
//! the serde type of its settings, and [`config`] is the file's shape made
//! of them; this file and [`settings`] are the composition root, the only
//! readers of [`Config`].
//!
//! [`app`] builds that stack from a [`Config`] without any socket, so tests
//! drive it in-process; [`run`] binds the listeners and serves until
//! shutdown.

pub mod admin;
pub mod config;
pub mod demo;
pub mod forward;
mod http;
pub mod idempotency;
pub mod mcp;
pub mod observe;
pub mod server;
mod settings;
pub mod store;
#[cfg(test)]
mod testing;
pub mod tools;

// The pure layers live in crates/idemproxy-core (its docs say why); named
// here as they always were, `crate::core::…` and `idemproxy::request::…`.
// `mcp` re-exports that crate's and adds what waits on tokio.
pub use idemproxy_core::{core, request};

use std::future::Future;
use std::sync::Arc;

use ::http::Request;
use axum::body::Body;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;
use tower::util::MapRequest;
use tower::{ServiceBuilder, ServiceExt};
use tower_http::request_id::{
    PropagateRequestId, PropagateRequestIdLayer, SetRequestId, SetRequestIdLayer,
};

use admin::{AdminState, AdminToken};
pub use config::Config;
use config::{ConfigError, StoreKind};
use forward::{Forward, Upstream, UpstreamSettings};
use idempotency::{Idempotency, IdempotencyLayer, Policies};
use observe::request_id::{drop_oversized_request_id, MakeRequestUuidV4};
use observe::Metrics;
use store::{EmbeddedStore, MemoryStore, SharedStore};

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The traffic service: request ids (generated when absent or too long,
/// forwarded to the upstream, returned to the client), then idempotency,
/// then the upstream.
pub type ProxyService = MapRequest<
    SetRequestId<PropagateRequestId<Idempotency<Forward>>, MakeRequestUuidV4>,
    fn(Request<Body>) -> Request<Body>,
>;

/// Everything `run` serves, built without sockets.
pub struct App {
    pub proxy: ProxyService,
    pub admin: axum::Router,
    pub store: SharedStore,
    pub metrics: Arc<Metrics>,
    /// Set when the traffic listener serves TLS (`[tls]`).
    pub tls: Option<server::TlsAcceptor>,
    /// Executions in flight; shutdown waits for them to store their outcome.
    pub tasks: TaskTracker,
    /// Traffic threads [`serve_app`] starts (`workers`, resolved).
    pub workers: usize,
    stack: Stack,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").finish_non_exhaustive()
    }
}

/// What a worker thread needs to build its own traffic stack.
struct Stack {
    layer: IdempotencyLayer,
    upstream: UpstreamSettings,
}

impl Stack {
    /// The stack over a new upstream client: the layer (store, metrics,
    /// executions) is shared, the upstream connection pool is not, so a
    /// worker's requests use connections its own event loop drives.
    fn build(&self) -> Result<ProxyService, Error> {
        let upstream = Upstream::new(&self.upstream)?;
        let bound_request_id: fn(Request<Body>) -> Request<Body> = drop_oversized_request_id;
        Ok(ServiceBuilder::new()
            .map_request(bound_request_id)
            .layer(SetRequestIdLayer::x_request_id(MakeRequestUuidV4))
            .layer(PropagateRequestIdLayer::x_request_id())
            .layer(self.layer.clone())
            .service(Forward::new(upstream, self.upstream.timeout)))
    }
}

/// Checks `config` whole: its own checks and every value the parts parse,
/// each problem named by its field.
pub fn validate(config: &Config) -> Result<(), ConfigError> {
    let problems = settings::problems(config);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid(problems))
    }
}

/// The effective configuration as `idemproxy check` prints it, secrets
/// redacted.
pub fn effective_toml(config: &Config) -> String {
    settings::effective_toml(config)
}

/// The routes' policies as `config` sets them.
pub fn policies(config: &Config) -> Result<Policies, ConfigError> {
    settings::policies(config).map_err(ConfigError::Invalid)
}

/// Builds the service stack for `config` on `store`.
pub fn app(config: &Config, store: SharedStore) -> Result<App, Error> {
    let policies = policies(config)?;
    let metrics = Metrics::new();
    let layer = IdempotencyLayer::new(policies.clone(), store.clone())
        .store_timeout(config.store.timeout)
        .max_in_flight(config.max_in_flight)
        .upstream_timeout(config.upstream.timeout)
        .request_body_timeout(config.request_body_timeout)
        .metrics(metrics.clone());
    let tasks = layer.tasks();
    let stack = Stack {
        layer,
        upstream: config.upstream.clone(),
    };
    let proxy = stack.build()?;
    // `keys reconcile` sends its lookups as the traffic's requests go, on
    // an upstream client of its own.
    let forward = Forward::new(Upstream::new(&config.upstream)?, config.upstream.timeout);
    let send: idempotency::LookupSender = Arc::new(move |request| {
        let forward = forward.clone();
        Box::pin(async move { forward.oneshot(request).await.map_err(Into::into) })
    });
    let reconciler = stack.layer.key_reconciler(send);
    let admin = admin::router(AdminState {
        reconciler,
        tasks: tasks.clone(),
        store: store.clone(),
        store_timeout: config.store.timeout,
        metrics: metrics.clone(),
        policies: Arc::new(policies),
        token: Arc::new(AdminToken::new(config.admin_token.as_deref())),
    });
    let tls = config
        .tls
        .as_ref()
        .map(|tls| {
            let clients = match (&tls.client_ca_file, tls.client_auth) {
                (None, _) => server::ClientCertificates::Ignored,
                (Some(ca_file), config::ClientAuth::Required) => {
                    server::ClientCertificates::Required { ca_file }
                }
                (Some(ca_file), config::ClientAuth::Optional) => {
                    server::ClientCertificates::Optional { ca_file }
                }
            };
            server::tls_acceptor(&tls.cert_file, &tls.key_file, clients)
        })
        .transpose()?;
    Ok(App {
        proxy,
        admin,
        store,
        metrics,
        tls,
        tasks,
        workers: config.worker_threads(),
        stack,
    })
}

/// Opens the store `config.store` names, behind the local replay cache when
/// `store.local_cache_entries` is set (the embedded store always has one,
/// the memory store never: see [`store::cache`]).
pub async fn open_store(config: &Config) -> Result<SharedStore, Error> {
    let mut cache_entries = config.store.local_cache_entries;
    let store: SharedStore = match config.store.kind {
        StoreKind::Memory => {
            let store = MemoryStore::new();
            store.spawn_purger(config.store.purge_interval);
            // Its records are in this process's memory already: with
            // responses stored as they came, a cache in front of it would
            // hold a second, decoded copy of the latest ones and save no
            // replay any CPU (measured: docs/performance.md). Compressed,
            // a replay from the store decompresses, which the cache saves.
            if config.store.compression == config::Compression::Off {
                cache_entries = 0;
            }
            Arc::new(store)
        }
        StoreKind::Embedded => {
            let store = Arc::new(EmbeddedStore::open(&config.store.path)?);
            store.spawn_purger(config.store.purge_interval);
            cache_entries = cache_entries.max(store::cache::EMBEDDED_ENTRIES);
            store
        }
        StoreKind::Redis | StoreKind::RedisCluster | StoreKind::RedisSentinel => {
            store::redis::open(&config.store).await?
        }
        StoreKind::Postgres => store::postgres::open(&config.store).await?,
    };
    // Sealed below the cache: the cache keeps opened responses, in this
    // process's memory only. Always in place, keys or not: a response
    // sealed before encryption was turned off must read as unreadable
    // (500 `record-unreadable`), not reach a replay still sealed.
    let keys = settings::keyring(&config.store)?.unwrap_or_else(store::sealed::Keyring::none);
    let store: SharedStore = Arc::new(store::sealed::SealedStore::new(store, keys));
    // Packed above the seal (what is sealed is the packed response) and
    // below the cache (which keeps unpacked ones, so a cached replay costs
    // no decompression). Always in place, whatever `compression` says:
    // records packed earlier must unpack.
    // Learned dictionaries are shared below compression: their records are
    // sealed as any, never packed.
    let compression = store::compression::Compression::new(
        settings::packer(config)?,
        config
            .store
            .learn_dictionary
            .then(|| store::compression::LearnSettings {
                store: store.clone(),
                store_timeout: config.store.timeout,
                record_lifetime: settings::record_lifetime(config),
            }),
    );
    compression.adopt_shared();
    let store: SharedStore = Arc::new(store::compression::LearningStore::shared(
        store,
        compression,
    ));
    Ok(store::cache::wrap(store, cache_entries))
}

/// Binds the traffic and admin listeners and serves until `shutdown`.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
    let store = open_store(&config).await?;
    let app = app(&config, store)?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let admin_listener = TcpListener::bind(config.admin_listen)
        .await
        .map_err(|e| format!("cannot listen on {} (admin): {e}", config.admin_listen))?;
    tracing::info!(
        listen = %config.listen,
        admin = %config.admin_listen,
        upstream = %config.upstream.url,
        store = app.store.kind(),
        "idemproxy serving"
    );
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    serve_app(
        app,
        listener,
        admin_listener,
        shutdown,
        config.drain_timeout,
    )
    .await
}

/// Serves a built [`App`] on bound listeners until `shutdown`, then drains:
/// connections finish, and executions store their outcomes, within `drain`.
pub async fn serve_app(
    app: App,
    listener: TcpListener,
    admin_listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    drain: std::time::Duration,
) -> Result<(), Error> {
    let mut services = vec![app.proxy];
    for _ in 1..app.workers.max(1) {
        services.push(app.stack.build()?);
    }
    let workers = server::Workers::start(services)
        .map_err(|e| format!("cannot start the worker threads: {e}"))?;
    let (stop_admin, admin_stopped) = tokio::sync::oneshot::channel::<()>();
    let admin = tokio::spawn(async move {
        let stopped = async {
            let _ = admin_stopped.await;
        };
        // With each connection's peer: the key API limits failed token
        // attempts per address.
        let admin = app
            .admin
            .into_make_service_with_connect_info::<std::net::SocketAddr>();
        if let Err(e) = axum::serve(admin_listener, admin)
            .with_graceful_shutdown(stopped)
            .await
        {
            tracing::error!(error = %e, "admin listener failed");
        }
    });
    // One deadline for the whole drain, connections and executions
    // together, from the moment shutdown begins: a process manager's grace
    // period (Kubernetes': `terminationGracePeriodSeconds`) is one budget.
    // Closing the tracker then is also what tells the covered requests
    // still to come (a body that was arriving) to start nothing.
    let began = Arc::new(std::sync::OnceLock::new());
    let shutdown = {
        let (began, tasks) = (began.clone(), app.tasks.clone());
        async move {
            shutdown.await;
            let _ = began.set(tokio::time::Instant::now());
            tasks.close();
        }
    };
    server::serve(listener, app.tls, &workers, shutdown, drain).await;
    app.tasks.close();
    let deadline = began
        .get()
        .copied()
        .unwrap_or_else(tokio::time::Instant::now)
        + drain;
    if tokio::time::timeout_at(deadline, app.tasks.wait())
        .await
        .is_err()
    {
        let releases = app.stack.layer.releases_pending();
        let executions = app.tasks.len().saturating_sub(releases);
        if executions > 0 {
            tracing::warn!(
                remaining = executions,
                "executions still running after the drain timeout; their keys settle by lease"
            );
        }
        if releases > 0 {
            tracing::warn!(
                remaining = releases,
                "claims of requests answered 503 still being released after the drain timeout; each key is named below"
            );
        }
    }
    workers.stop().await;
    let _ = stop_admin.send(());
    let _ = admin.await;
    tracing::info!("idemproxy stopped");
    Ok(())
}
