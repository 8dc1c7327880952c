//! Removals heard across replicas: what keeps each replica's local replay
//! cache (`store::cache`) from replaying a record another replica removed.
//!
//! Every `remove` that deleted something publishes the record key (its 32
//! bytes) on `<key_prefix>removed`. Each cache in front of a Redis store
//! has a task here that subscribes to that channel on a connection of its
//! own and drops what it hears from the cache.
//!
//! Pub/sub delivers only to connected subscribers, so the task tells the
//! cache when it cannot hear: the cache answers nothing until the first
//! subscription is confirmed, stops answering when the connection breaks
//! (the message stream ends, or a heartbeat `PING` goes unanswered), and
//! starts over empty when it is subscribed again. A Redis Cluster forwards
//! every `PUBLISH` to all its nodes, so subscribing on one seed node hears
//! removals of every slot; the task moves to the next seed when its node
//! stops answering.
//!
//! A user whose ACL does not allow the channel (Redis 7 gives new users no
//! channels unless `acl-pubsub-default allchannels`) cannot subscribe: the
//! cache then stays off, replays ask Redis, and the log says why.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use redis::{Client, RedisError};

use super::sentinel::SentinelPrimary;
use crate::core::RecordKey;
use crate::store::RemovalWatcher;

/// How often a subscription is checked with a `PING`: a connection that
/// broke without the socket saying so (a partition, a dropped NAT entry)
/// is noticed within this plus the I/O timeout.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Waits between subscription attempts, doubling up to the last.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Which node to subscribe on.
enum Nodes {
    /// One client per node to try, in turn: the Redis itself, or a
    /// cluster's seed nodes.
    Fixed(Vec<Client>),
    /// The primary the Sentinels name at each attempt: the subscription
    /// moves with a failover.
    Primary(Arc<SentinelPrimary>),
}

impl Nodes {
    async fn client(&self, turn: usize) -> Result<Client, RedisError> {
        match self {
            Nodes::Fixed(clients) => clients
                .get(turn % clients.len().max(1))
                .cloned()
                .ok_or_else(|| {
                    RedisError::from(std::io::Error::other("no Redis node to subscribe on"))
                }),
            Nodes::Primary(primary) => primary.client().await,
        }
    }
}

/// Where removals are published, and how to subscribe there. Shared by a
/// store's clones.
pub(super) struct RemovalChannel {
    nodes: Nodes,
    name: String,
    io_timeout: Duration,
}

impl RemovalChannel {
    pub(super) fn new(clients: Vec<Client>, key_prefix: &str, io_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            nodes: Nodes::Fixed(clients),
            name: channel_name(key_prefix),
            io_timeout,
        })
    }

    /// On the primary the Sentinels name, whichever it is at each attempt.
    pub(super) fn following(
        primary: Arc<SentinelPrimary>,
        key_prefix: &str,
        io_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            nodes: Nodes::Primary(primary),
            name: channel_name(key_prefix),
            io_timeout,
        })
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// Follows the channel on a task of its own until the cache behind
    /// `invalidator` is gone.
    pub(super) fn follow(self: &Arc<Self>, invalidator: Arc<dyn RemovalWatcher>) {
        // Until the first subscription is confirmed, removals go unheard.
        invalidator.suspend();
        tokio::spawn(Arc::clone(self).run(invalidator));
    }

    async fn run(self: Arc<Self>, invalidator: Arc<dyn RemovalWatcher>) {
        let mut backoff = MIN_BACKOFF;
        let mut failing = false;
        for turn in 0.. {
            if !invalidator.is_open() {
                return;
            }
            let subscribed = match self.nodes.client(turn).await {
                Ok(client) => self.subscribe(&client).await,
                Err(e) => Err(e),
            };
            match subscribed {
                Ok((sink, stream)) => {
                    if !invalidator.resume() {
                        return;
                    }
                    if failing {
                        tracing::info!(channel = %self.name, "local replay cache on again: removals are heard");
                    }
                    failing = false;
                    backoff = MIN_BACKOFF;
                    let lost = self.listen(sink, stream, &*invalidator).await;
                    if !invalidator.suspend() {
                        return;
                    }
                    tracing::warn!(channel = %self.name, cause = %lost, "local replay cache off until removals are heard again");
                }
                Err(e) => {
                    // Said once per outage; the cache stays off meanwhile.
                    if !failing {
                        tracing::warn!(channel = %self.name, error = %e, "cannot hear removals; the local replay cache stays off until it can");
                    }
                    failing = true;
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn subscribe(&self, client: &Client) -> Result<(PubSubSink, PubSubStream), RedisError> {
        let attempt = async {
            let (mut sink, stream) = client.get_async_pubsub().await?.split();
            sink.subscribe(&self.name).await?;
            Ok((sink, stream))
        };
        match tokio::time::timeout(self.io_timeout, attempt).await {
            Ok(subscribed) => subscribed,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer to SUBSCRIBE",
            ))),
        }
    }

    /// Drops every removal heard from the cache until the subscription
    /// breaks or the cache is gone; returns what broke it.
    async fn listen(
        &self,
        mut sink: PubSubSink,
        mut stream: PubSubStream,
        invalidator: &dyn RemovalWatcher,
    ) -> String {
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await;
        loop {
            tokio::select! {
                message = stream.next() => {
                    let Some(message) = message else {
                        return "the connection closed".into();
                    };
                    match <[u8; 32]>::try_from(message.get_payload_bytes()) {
                        Ok(key) => {
                            let key = RecordKey::from_bytes(key);
                            if !invalidator.removed(&key) {
                                return "the cache is gone".into();
                            }
                        }
                        // Someone else's message on our channel: whatever it
                        // meant, start over empty, as after a gap.
                        Err(_) => {
                            if !invalidator.resume() {
                                return "the cache is gone".into();
                            }
                        }
                    }
                }
                _ = heartbeat.tick() => {
                    if !invalidator.is_open() {
                        return "the cache is gone".into();
                    }
                    match tokio::time::timeout(self.io_timeout, sink.ping::<()>()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return format!("PING failed: {e}"),
                        Err(_) => return "no answer to PING".into(),
                    }
                }
            }
        }
    }
}

/// The channel removals are published on: under the store's prefix, so
/// that proxies sharing a Redis with different prefixes (different
/// deployments) do not hear each other.
pub(super) fn channel_name(key_prefix: &str) -> String {
    format!("{key_prefix}removed")
}
