//! The floor of idemproxy's stack, for `benches/load.sh`: a reverse proxy
//! built from the same parts (hyper's HTTP/1 server, hyper-util's pooled
//! client, one current-thread tokio runtime per CPU) that does nothing but
//! forward. No idempotency, no log line, no request id, no metrics, no
//! header rewriting beyond `Host`.
//!
//! What it costs per request against nginx is what any proxy on this stack
//! pays before doing any work of its own, so it bounds how close idemproxy
//! can come to nginx on the same machine: its row in the load table is the
//! ceiling, and the gap between it and idemproxy's passthrough row is what
//! idemproxy's own features cost.
//!
//! ```sh
//! cargo run --release --example bare_forward -- LISTEN_ADDR UPSTREAM_URL [WORKERS]
//! ```
//! Each worker binds `LISTEN_ADDR` with `SO_REUSEPORT`, so the kernel spreads
//! connections over them, and keeps its own upstream pool.

use std::net::SocketAddr;

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: bare_forward LISTEN_ADDR UPSTREAM_URL [WORKERS]");
        std::process::exit(2);
    }
    let listen: SocketAddr = args[1].parse()?;
    let upstream: Uri = args[2].parse()?;
    let authority = upstream
        .authority()
        .cloned()
        .ok_or("the upstream URL has no host")?;
    let workers = match args.get(3) {
        Some(n) => n.parse()?,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let threads: Vec<_> = (0..workers)
        .map(|_| {
            let authority = authority.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                runtime
                    .block_on(serve(listen, authority))
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for thread in threads {
        thread.join().map_err(|_| "a worker panicked")??;
    }
    Ok(())
}

async fn serve(listen: SocketAddr, authority: Authority) -> Result<(), Error> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseport(true)?;
    socket.bind(listen)?;
    let listener = socket.listen(1024)?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Incoming> = Client::builder(TokioExecutor::new()).build(connector);
    let host = HeaderValue::from_str(authority.as_str())?;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let (client, authority, host) = (client.clone(), authority.clone(), host.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (client, authority, host) = (client.clone(), authority.clone(), host.clone());
                async move {
                    let (mut parts, body) = req.into_parts();
                    let mut uri = parts.uri.into_parts();
                    uri.scheme = Some(Scheme::HTTP);
                    uri.authority = Some(authority);
                    parts.uri = Uri::from_parts(uri).map_err(|e| e.to_string())?;
                    parts.headers.insert(http::header::HOST, host);
                    client
                        .request(Request::from_parts(parts, body))
                        .await
                        .map_err(|e| e.to_string())
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
