//! The `idemproxy` command: flags, configuration, telemetry, serve.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use idemproxy::config::{Config, ConfigError, FlagOverrides, LogFormat, StoreKind};
use idemproxy::observe::log_format::{JsonLines, PlainFields, PlainLines};
use idemproxy::observe::log_writer::{BatchedWriter, FlushGuard};
use idemproxy::observe::otlp::{self, TraceExport, TraceGuard};
use idemproxy::observe::trace;
use opentelemetry_sdk::trace::SdkTracer;
use tracing_opentelemetry::OpenTelemetryLayer;
use tracing_subscriber::filter::{Filtered, Targets};
use tracing_subscriber::fmt::format::JsonFields;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

#[derive(Parser)]
#[command(
    name = "idemproxy",
    // The commit too: two builds of one version differ, and a bug report
    // needs to say which (build.rs).
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("IDEMPROXY_COMMIT"), ")"),
    about = "An Idempotency-Key enforcing reverse proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    flags: Flags,
}

#[derive(Subcommand)]
enum Command {
    /// Serve traffic (the default).
    Run,
    /// Validate the configuration and print the effective result.
    Check,
    /// Run the proxy on the embedded store in front of a built-in demo API.
    Demo {
        /// Show an agent's tool calls instead: an MCP route in front of a
        /// demo MCP server.
        #[arg(long)]
        mcp: bool,
    },
    /// Serve only the demo payments API (on --listen, default 127.0.0.1:3000).
    DemoApi,
    /// GET a URL and exit 0 on a 2xx answer: a health check for images
    /// that carry no curl.
    Probe {
        #[arg(long, default_value = "http://127.0.0.1:9090/readyz")]
        url: String,
    },
    /// Work on the store the configuration names.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Find, inspect, reconcile and forget keys through a running proxy's admin API
    /// (its token from IDEMPROXY_ADMIN_TOKEN): docs/runbook.md.
    #[command(subcommand)]
    Keys(idemproxy::tools::keys::KeysCommand),
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Train a zstd dictionary for `store.compression_dictionary` from a
    /// sample of the stored responses (the embedded store's file must not
    /// be in use), or from files of response bodies.
    TrainDictionary {
        /// Where to write the dictionary.
        #[arg(long)]
        out: PathBuf,
        /// Train from the files in this directory, each a response body,
        /// instead of the store.
        #[arg(long)]
        from_dir: Option<PathBuf>,
        /// At most this many responses.
        #[arg(long, default_value_t = 5000)]
        samples: usize,
        /// The dictionary's size at most, in bytes.
        #[arg(long, default_value_t = 16 * 1024)]
        size: usize,
    },
    /// Move an earlier version's embedded store (the redb file in
    /// `store.path`) into the LSM tree now, rather than on the next start
    /// (the store must not be in use).
    Migrate,
}

#[derive(Args)]
struct Flags {
    /// TOML configuration file.
    #[arg(long, global = true, env = "IDEMPROXY_CONFIG")]
    config: Option<PathBuf>,
    /// Traffic listener address.
    #[arg(long, global = true)]
    listen: Option<SocketAddr>,
    /// Admin listener address (health, readiness).
    #[arg(long, global = true)]
    admin_listen: Option<SocketAddr>,
    /// Upstream base URL.
    #[arg(long, global = true)]
    upstream: Option<String>,
    /// Store kind: memory, embedded, redis, redis-cluster, redis-sentinel, postgres.
    #[arg(long, global = true, value_parser = parse_store_kind)]
    store: Option<StoreKind>,
    /// Directory of the embedded store.
    #[arg(long, global = true)]
    store_path: Option<PathBuf>,
    /// The store's URL (Redis, or `postgres://` for the PostgreSQL store).
    #[arg(long, global = true)]
    redis_url: Option<String>,
}

/// mimalloc: the proxy allocates and frees many small buffers per request
/// across threads, where glibc's allocator spends measurably more time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn parse_store_kind(s: &str) -> Result<StoreKind, String> {
    serde_json::from_value(serde_json::Value::String(s.into())).map_err(|_| {
        format!(
            "`{s}`: expected memory, embedded, redis, redis-cluster, redis-sentinel or postgres"
        )
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match &cli.command {
        Some(Command::Probe { url }) => return probe(url),
        Some(Command::Keys(command)) => return block_on(idemproxy::tools::keys::run(command)),
        Some(Command::DemoApi) => {
            let listen = cli.flags.listen.unwrap_or(([127, 0, 0, 1], 3000).into());
            return block_on(serve_demo_api(listen));
        }
        _ => {}
    }
    let demo = match cli.command {
        Some(Command::Demo { mcp }) => Some(mcp),
        _ => None,
    };
    let config = match load_config(&cli.flags, demo.is_some()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("idemproxy: {e}");
            return ExitCode::from(2);
        }
    };
    match cli.command {
        Some(Command::Check) => return check(&config),
        Some(Command::Store(StoreCommand::TrainDictionary {
            out,
            from_dir,
            samples,
            size,
        })) => {
            let options = idemproxy::tools::TrainOptions {
                from_dir,
                samples,
                max_len: size,
            };
            return block_on(train_dictionary(config, options, out));
        }
        Some(Command::Store(StoreCommand::Migrate)) => return migrate_store(&config),
        _ => {}
    }
    let _telemetry = match init_telemetry(&config) {
        Ok(telemetry) => telemetry,
        Err(e) => {
            eprintln!("idemproxy: cannot start telemetry: {e}");
            return ExitCode::from(2);
        }
    };
    for variable in &config.ignored_env {
        tracing::warn!(%variable, "ignored: this IDEMPROXY_* variable names no configuration field");
    }
    block_on(async move {
        match demo {
            Some(mcp) => run_demo(config, mcp).await,
            None => idemproxy::run(config, shutdown_signal()).await,
        }
    })
}

/// The demo payments API alone (`idemproxy demo-api`), for a proxy run
/// apart to stand in front of.
async fn serve_demo_api(listen: SocketAddr) -> Result<(), idemproxy::Error> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("demo payments API on http://{listen}");
    axum::serve(listener, idemproxy::demo::router())
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
}

/// The configuration from the file, the environment and `flags`,
/// validated. The demo's upstream is its own API and its store a local
/// directory.
fn load_config(flags: &Flags, demo: bool) -> Result<Config, ConfigError> {
    let mut overrides = FlagOverrides {
        listen: flags.listen,
        admin_listen: flags.admin_listen,
        upstream_url: flags.upstream.clone(),
        store_kind: flags.store,
        store_path: flags.store_path.clone(),
        redis_url: flags.redis_url.clone(),
    };
    if demo {
        overrides.store_path = overrides.store_path.or(Some("idemproxy-demo-data".into()));
    }
    let config = Config::load_from_process(flags.config.as_deref(), &overrides)?;
    idemproxy::validate(&config)?;
    Ok(config)
}

/// `idemproxy check`: the effective configuration, and what was ignored.
fn check(config: &Config) -> ExitCode {
    print!("{}", idemproxy::effective_toml(config));
    for variable in &config.ignored_env {
        eprintln!("ignored {variable}: it names no configuration field");
    }
    for warning in config.warnings() {
        eprintln!("warning: {warning}");
    }
    eprintln!("configuration is valid");
    ExitCode::SUCCESS
}

/// `idemproxy store train-dictionary`: trains on the store's records (or
/// a directory of samples) and writes the dictionary to `out`.
async fn train_dictionary(
    config: Config,
    options: idemproxy::tools::TrainOptions,
    out: PathBuf,
) -> Result<(), idemproxy::Error> {
    let report = idemproxy::tools::train_dictionary(&config, &options).await?;
    std::fs::write(&out, &report.dictionary)
        .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    print!("{report}");
    println!(
        "wrote {}; set store.compression_dictionary to it (and keep the one it replaces in previous_compression_dictionaries until its records expired)",
        out.display()
    );
    Ok(())
}

/// `idemproxy store migrate`: opens the embedded store, which migrates an
/// earlier version's file, and says what it did.
fn migrate_store(config: &Config) -> ExitCode {
    if config.store.kind != idemproxy::config::StoreKind::Embedded {
        eprintln!("idemproxy: store migrate works on the embedded store only");
        return ExitCode::from(2);
    }
    let dir = &config.store.path;
    match idemproxy::tools::migrate::migrate_embedded(dir) {
        Ok(migrated) => {
            match migrated {
                Some(done) => println!(
                    "migrated {} records ({} unreadable, kept to be listed) into {}",
                    done.records,
                    done.unreadable,
                    dir.display()
                ),
                None => println!("nothing to migrate in {}", dir.display()),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idemproxy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn block_on(work: impl std::future::Future<Output = Result<(), idemproxy::Error>>) -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemproxy: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemproxy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn probe(url: &str) -> ExitCode {
    use http_body_util::Empty;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let url = url.to_string();
    block_on(async move {
        let uri: http::Uri = url.parse()?;
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
        let response = tokio::time::timeout(std::time::Duration::from_secs(3), client.get(uri))
            .await
            .map_err(|_| "no answer within 3 s")??;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("{url} answered {}", response.status()).into())
        }
    })
}

/// The demo APIs on a port of their own, the proxy in front of them; with
/// `mcp`, an MCP route in front of the demo MCP server too.
async fn run_demo(mut config: Config, mcp: bool) -> Result<(), idemproxy::Error> {
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let api_addr = api.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(api, idemproxy::demo::router()).await;
    });
    config.upstream.url = format!("http://{api_addr}");
    if config.store.kind != StoreKind::Embedded && config.store.kind != StoreKind::Memory {
        config.store.kind = StoreKind::Embedded;
    }
    let proxy = config.listen.to_string();
    let store = match config.store.kind {
        StoreKind::Memory => "The store is in memory: it goes when the demo stops.".to_owned(),
        _ => format!(
            "The store lives in {}: restart the demo and step 2 still replays.",
            config.store.path.display()
        ),
    };
    if mcp {
        config.routes.push(idemproxy::config::RouteConfig {
            name: "mcp".into(),
            path: idemproxy::demo::MCP_PATH.into(),
            protocol: idemproxy::config::Protocol::Mcp,
            idempotency: config.idempotency.clone(),
        });
        println!("{}", idemproxy::demo::mcp_walkthrough(&proxy, &store));
    } else {
        println!("{}", idemproxy::demo::walkthrough(&proxy, &store));
    }
    idemproxy::run(config, shutdown_signal()).await
}

/// What keeps logs and traces flowing until `main` returns.
struct Telemetry {
    /// Writes out what is buffered (see `idemproxy::observe::log_writer`).
    _logs: Option<FlushGuard>,
    /// Sends what is batched to the collector (see `idemproxy::observe::otlp`).
    _traces: Option<TraceGuard>,
}

/// The traces' layer: only their spans, at their target, reach it.
type TraceLayer = Filtered<OpenTelemetryLayer<Registry, SdkTracer>, Targets, Registry>;

/// Logs go to stdout in batches; the guard writes out what is buffered
/// when `main` returns. If the writer thread cannot start, logs go to
/// stderr, unbatched. Traces go to `telemetry.otlp_endpoint` when it is
/// set: the request spans are at a target of their own, which the log
/// filter turns off, so log lines stay as they are either way.
fn init_telemetry(config: &Config) -> Result<Telemetry, idemproxy::Error> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&config.log.level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        .add_directive(format!("{}=off", trace::TARGET).parse()?);
    let (traces, trace_guard) = match &config.telemetry.otlp_endpoint {
        Some(endpoint) => {
            let export = TraceExport {
                endpoint: endpoint.clone(),
                service_name: config.telemetry.service_name.clone(),
                sample_ratio: config.telemetry.sample_ratio,
            };
            let (layer, guard) = otlp::layer(&export)?;
            let spans = Targets::new().with_target(trace::TARGET, tracing::Level::INFO);
            (Some(layer.with_filter(spans)), Some(guard))
        }
        None => (None, None),
    };
    let format = config.log.format;
    let log_guard = match BatchedWriter::new(std::io::stdout()) {
        Ok((writer, guard)) => {
            let ansi = std::io::stdout().is_terminal();
            install_subscriber(filter, format, writer, ansi, traces);
            Some(guard)
        }
        Err(e) => {
            eprintln!("idemproxy: cannot start the log writer: {e}; logging to stderr");
            let ansi = std::io::stderr().is_terminal();
            install_subscriber(filter, format, std::io::stderr, ansi, traces);
            None
        }
    };
    Ok(Telemetry {
        _logs: log_guard,
        _traces: trace_guard,
    })
}

/// Without traces, one filter for the whole subscriber, as the log lines
/// alone need: every span and event it turns off is a call site that is
/// never asked again. With traces, each layer filters for itself, so the
/// exporter sees the request spans and the log lines never do.
fn install_subscriber<W>(
    filter: tracing_subscriber::EnvFilter,
    format: LogFormat,
    writer: W,
    ansi: bool,
    traces: Option<TraceLayer>,
) where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    if let Some(traces) = traces {
        let logs = log_layer(format, writer, ansi).with_filter(filter);
        tracing_subscriber::registry()
            .with(traces)
            .with(logs)
            .init();
        return;
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
    match format {
        LogFormat::Json => builder
            .with_ansi(false)
            .fmt_fields(JsonFields::new())
            .event_format(JsonLines::new())
            .init(),
        // Colours are for people at a terminal; output that goes elsewhere
        // (a collector, a file) gets the same lines for less CPU.
        LogFormat::Human if !ansi => builder
            .fmt_fields(PlainFields)
            .event_format(PlainLines::new())
            .init(),
        LogFormat::Human => builder.init(),
    }
}

/// The log lines' layer, as [`install_subscriber`] builds it without traces.
fn log_layer<S, W>(format: LogFormat, writer: W, ansi: bool) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi);
    match format {
        LogFormat::Json => layer
            .with_ansi(false)
            .fmt_fields(JsonFields::new())
            .event_format(JsonLines::new())
            .boxed(),
        LogFormat::Human if !ansi => layer
            .fmt_fields(PlainFields)
            .event_format(PlainLines::new())
            .boxed(),
        LogFormat::Human => layer.boxed(),
    }
}

/// Resolves on SIGINT or SIGTERM: both mean "drain and exit".
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutdown signal received; draining");
}
