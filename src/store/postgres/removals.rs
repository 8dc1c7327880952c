//! Removals heard across replicas, as on Redis (`store::redis`'s
//! `removals`), over `LISTEN`/`NOTIFY`: every `remove` notifies
//! `<table_prefix>removed` with the record key in hex, and each cache in
//! front of a PostgreSQL store has a task here that listens on a
//! connection of its own (not the pool's) and drops what it hears.
//!
//! `NOTIFY` reaches only connected listeners, so the cache answers nothing
//! until the first `LISTEN` is confirmed, stops answering when the
//! connection breaks (it ends, or a heartbeat goes unanswered), and starts
//! over empty once it listens again.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, NoTls, Socket};

use super::tls::MakeRustls;

use crate::core::RecordKey;
use crate::store::RemovalWatcher;

/// How often the listening connection is checked with a query: one that
/// broke without the socket saying so is noticed within this plus the I/O
/// timeout.
pub(super) const HEARTBEAT: Duration = Duration::from_secs(5);

/// Waits between attempts to listen, doubling up to the last.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Where removals are announced, and how to listen there.
pub(super) struct RemovalFeed {
    pg: tokio_postgres::Config,
    tls: Option<MakeRustls>,
    channel: String,
    io_timeout: Duration,
}

impl RemovalFeed {
    pub(super) fn new(
        pg: tokio_postgres::Config,
        tls: Option<MakeRustls>,
        channel: String,
        io_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            pg,
            tls,
            channel,
            io_timeout,
        })
    }

    /// Reports removals to `watcher` for as long as it is open.
    pub(super) fn follow(self: &Arc<Self>, watcher: Arc<dyn RemovalWatcher>) {
        let feed = Arc::clone(self);
        tokio::spawn(async move {
            let mut backoff = MIN_BACKOFF;
            while watcher.suspend() {
                match feed.listen(&*watcher).await {
                    Ok(()) => return,
                    Err(why) => {
                        tracing::warn!(channel = %feed.channel, error = %why, "not hearing removals; the local replay cache is off until it listens again");
                    }
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        });
    }

    /// Listens until the connection breaks (an error) or the watcher is
    /// gone (`Ok`).
    async fn listen(&self, watcher: &dyn RemovalWatcher) -> Result<(), String> {
        match &self.tls {
            Some(tls) => self.listen_over(tls.clone(), watcher).await,
            None => self.listen_over(NoTls, watcher).await,
        }
    }

    async fn listen_over<T>(&self, tls: T, watcher: &dyn RemovalWatcher) -> Result<(), String>
    where
        T: MakeTlsConnect<Socket>,
        T::Stream: Send + 'static,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        // Patient: a heartbeat missed on a busy machine turns the cache off
        // and empties it; a connection truly gone is noticed within
        // `HEARTBEAT` twice all the same.
        let io = self.io_timeout.max(HEARTBEAT);
        let (client, mut connection) = tokio::time::timeout(io, self.pg.connect(tls))
            .await
            .map_err(|_| format!("connecting took over {io:?}"))?
            .map_err(|e| e.to_string())?;
        let (heard, mut hearing) = mpsc::unbounded_channel();
        // Drives the connection; ends when the client is dropped or the
        // connection breaks, which closes `hearing`.
        tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(n) = message {
                    if heard.send(n.payload().to_owned()).is_err() {
                        return;
                    }
                }
            }
        });
        let ask = |sql: String| {
            let client = &client;
            async move {
                tokio::time::timeout(io, client.simple_query(&sql))
                    .await
                    .map_err(|_| format!("`{sql}` took over {io:?}"))?
                    .map_err(|e| e.to_string())
            }
        };
        ask(format!("LISTEN {}", self.channel)).await?;
        if !watcher.resume() {
            return Ok(());
        }
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        loop {
            tokio::select! {
                payload = hearing.recv() => {
                    let Some(payload) = payload else {
                        return Err("the connection ended".into());
                    };
                    let Some(key) = RecordKey::from_hex(&payload) else {
                        tracing::warn!(%payload, "a removal announced with no record key in it");
                        continue;
                    };
                    if !watcher.removed(&key) {
                        return Ok(());
                    }
                }
                _ = heartbeat.tick() => {
                    if !watcher.is_open() {
                        return Ok(());
                    }
                    ask("SELECT 1".into()).await?;
                }
            }
        }
    }
}
