//! Walks of the keyspace: the admin API's listing ([`Store::list`], the
//! front of each value only) and the full scan ([`Store::scan`], whole
//! records), both paged by a cursor any replica can go on with. On a
//! cluster a walk visits every primary in turn and ends, rather than skip
//! or repeat records, when the set of primaries changes under it.
//!
//! [`Store::list`]: crate::store::Store::list
//! [`Store::scan`]: crate::store::Store::scan

use std::collections::VecDeque;

use bytes::Bytes;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

use super::connections::Conn;
use super::value::{read_stored, read_stored_meta, unexpected, META_FRONT_LEN};
use super::{redis_error, RedisStore};
use crate::core::RecordKey;
use crate::store::{ListPage, ListWant, ScanCursor, ScanPage, StoreError};

/// `SCAN` steps one page of a listing takes at most ([`Store::list`](crate::store::Store::list)).
const MAX_SCAN_STEPS: usize = 1000;

/// Where a listing goes on: `<scan cursor>|<hex>,<hex>…`, the `SCAN`
/// position (`end` when `SCAN` was over) and the keys a step met that the
/// last page had no room for.
struct ListCursor {
    position: Option<ScanCursor>,
    pending: VecDeque<RecordKey>,
}

impl ListCursor {
    fn parse(cursor: &ScanCursor) -> Result<Self, StoreError> {
        let bad_cursor = || StoreError::InvalidCursor(cursor.as_str().to_owned());
        let (position, rest) = match cursor.as_str().split_once('|') {
            Some((position, rest)) => (position, rest),
            None => (cursor.as_str(), ""),
        };
        let mut pending = VecDeque::new();
        for hex in rest.split(',').filter(|hex| !hex.is_empty()) {
            pending.push_back(RecordKey::from_hex(hex).ok_or_else(bad_cursor)?);
        }
        Ok(Self {
            position: (position != "end").then(|| ScanCursor::new(position.to_owned())),
            pending,
        })
    }

    /// The cursor of the next page; `None` when the walk is over.
    fn into_next(self) -> Option<ScanCursor> {
        if self.pending.is_empty() && self.position.is_none() {
            return None;
        }
        let at = self.position.as_ref().map_or("end", ScanCursor::as_str);
        let rest: Vec<String> = self.pending.iter().map(RecordKey::to_hex).collect();
        Some(ScanCursor::new(if rest.is_empty() {
            at.to_owned()
        } else {
            format!("{at}|{}", rest.join(","))
        }))
    }
}

impl RedisStore {
    /// One `SCAN` step of a walk from `cursor` (see [`Store::scan`](crate::store::Store::scan)): the
    /// record keys it met with their Redis names, and the cursor after it
    /// (`None`: the walk is over).
    async fn scan_keys(
        &self,
        cursor: &ScanCursor,
        count: usize,
    ) -> Result<(Vec<(RecordKey, String)>, Option<String>), StoreError> {
        let bad_cursor = || StoreError::InvalidCursor(cursor.as_str().to_owned());
        let mut parts = cursor.as_str().splitn(3, ':');
        let (node, position, layout) = match (parts.next(), parts.next(), parts.next()) {
            (Some(""), None, None) => (0, "0", None),
            (Some(position), None, None) => (0, position, None),
            (Some(node), Some(position), layout) => (
                node.parse::<usize>().map_err(|_| bad_cursor())?,
                position,
                layout,
            ),
            _ => return Err(bad_cursor()),
        };
        let position = position.parse::<u64>().map_err(|_| bad_cursor())?;
        let mut scan = redis::cmd("SCAN");
        scan.arg(position)
            .arg("MATCH")
            .arg(format!("{}*", glob_escaped(&self.prefix)))
            .arg("COUNT")
            .arg(count.max(1));
        let mut conn = self.conn();
        let (reply, next) = match &mut conn {
            Conn::Cluster(cluster) => {
                let primaries = cluster_primaries(cluster).await?;
                let now_layout = primaries_layout(&primaries);
                let Some((host, port)) = primaries
                    .get(node)
                    .filter(|_| layout.is_none_or(|began| began == now_layout))
                else {
                    return Err(StoreError::WalkInterrupted(format!(
                        "the cluster's primaries changed since the walk began (a failover, or a node added or removed): now {}",
                        primaries
                            .iter()
                            .map(|(host, port)| format!("{host}:{port}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                };
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let reply = cluster
                    .route_command(scan, routing)
                    .await
                    .map_err(redis_error)?;
                let (position, keys): (u64, Vec<String>) =
                    redis::from_redis_value(reply).map_err(|e| unexpected(&e.to_string()))?;
                let next = match position {
                    0 if node + 1 < primaries.len() => Some(format!("{}:0:{now_layout}", node + 1)),
                    0 => None,
                    position => Some(format!("{node}:{position}:{now_layout}")),
                };
                (keys, next)
            }
            _ if layout.is_some() => return Err(bad_cursor()),
            _ => {
                let (position, keys): (u64, Vec<String>) =
                    scan.query_async(&mut conn).await.map_err(redis_error)?;
                (keys, (position != 0).then(|| position.to_string()))
            }
        };
        let keys = reply
            .into_iter()
            .filter_map(|name| {
                let key = name
                    .strip_prefix(self.prefix.as_str())
                    .and_then(|tagged| tagged.strip_prefix('{')?.strip_suffix('}'))
                    .and_then(RecordKey::from_hex)?;
                Some((key, name))
            })
            .collect();
        Ok((keys, next))
    }

    /// The walk of [`Store::list`](crate::store::Store::list), reading the front of each value alone
    /// (`GETRANGE`, never the stored response). A `SCAN` step may meet more
    /// keys than the page has room for: the cursor then carries the rest
    /// of them (see [`ListCursor`]), which the next page reads first, so no
    /// record is passed over. `SCAN`'s `COUNT` follows the room left (8 to
    /// 32), which keeps that rest, and the cursor, short.
    pub(super) async fn list_page(
        &self,
        cursor: &ScanCursor,
        want: &ListWant<'_>,
    ) -> Result<ListPage, StoreError> {
        let mut at = ListCursor::parse(cursor)?;
        let now = self.clock.now_millis();
        let mut page = ListPage::default();
        let (mut bytes, mut steps) = (0, 0);
        // A keyspace mostly of other keys than this prefix's can take many
        // `SCAN` steps per record found: bounded too.
        while !want.full(page.held(), page.examined, bytes) && steps < MAX_SCAN_STEPS {
            let room = want
                .limit
                .saturating_sub(page.held())
                .min(want.max_examined.saturating_sub(page.examined))
                .max(1);
            if at.pending.is_empty() {
                let Some(position) = at.position.take() else {
                    break;
                };
                steps += 1;
                let (keys, next) = self.scan_keys(&position, room.clamp(8, 32)).await?;
                at.pending.extend(keys.into_iter().map(|(key, _)| key));
                at.position = next.map(ScanCursor::new);
                continue;
            }
            // Read at once (pipelined), as many as the page may still
            // hold; what it has no room for goes back.
            let chunk: Vec<RecordKey> = at
                .pending
                .drain(..room.min(at.pending.len()).min(500))
                .collect();
            let fronts = self.read_fronts(&chunk).await;
            for (i, (key, front)) in chunk.iter().zip(fronts).enumerate() {
                if want.full(page.held(), page.examined, bytes) {
                    for key in chunk[i..].iter().rev() {
                        at.pending.push_front(*key);
                    }
                    break;
                }
                let read = match front {
                    // Expired or removed since SCAN saw it.
                    Ok(front) if front.is_empty() => continue,
                    Ok(front) => {
                        bytes += front.len();
                        read_stored_meta(&front)
                    }
                    Err(e) => Err(redis_error(e)),
                };
                match read {
                    Ok(meta) => page.file(want, *key, Ok(meta), now),
                    Err(StoreError::Corrupt(why)) => page.file(want, *key, Err(why), now),
                    Err(e) => return Err(e),
                }
            }
        }
        page.next = at.into_next();
        Ok(page)
    }

    /// The front of each key's value (`GETRANGE`, the header and the
    /// record's metadata), all at once: the connection pipelines them.
    async fn read_fronts(&self, keys: &[RecordKey]) -> Vec<Result<Vec<u8>, redis::RedisError>> {
        futures_util::future::join_all(keys.iter().map(|key| {
            let (mut conn, name) = (self.conn(), self.redis_key(key));
            async move {
                redis::cmd("GETRANGE")
                    .arg(name)
                    .arg(0)
                    .arg(META_FRONT_LEN - 1)
                    .query_async::<Vec<u8>>(&mut conn)
                    .await
            }
        }))
        .await
    }

    /// `SCAN` with the prefix as its pattern (never `KEYS`, which blocks
    /// Redis for the whole keyspace), then a `GET` per key found. On a
    /// cluster, every primary in turn (ordered by address): the cursor
    /// names the node, its `SCAN` cursor, and the set of primaries the walk
    /// began on. A failover or a node added or removed since then would
    /// move the walk to another node or past one in silence; it ends the
    /// walk with [`StoreError::WalkInterrupted`] instead.
    pub(super) async fn scan_page(
        &self,
        cursor: &ScanCursor,
        count: usize,
    ) -> Result<ScanPage, StoreError> {
        let (keys, next) = self.scan_keys(cursor, count).await?;
        let now = self.clock.now_millis();
        let mut page = ScanPage {
            records: Vec::with_capacity(keys.len()),
            unreadable: Vec::new(),
            next: next.map(ScanCursor::new),
        };
        // All at once: the connection pipelines them, so a page costs
        // about one round trip, not one per key (500 of them to a Redis a
        // millisecond away would outlast any timeout).
        let values = futures_util::future::join_all(keys.iter().map(|(_, name)| {
            let mut conn = self.conn();
            async move {
                redis::cmd("GET")
                    .arg(name)
                    .query_async::<Option<Vec<u8>>>(&mut conn)
                    .await
            }
        }))
        .await;
        for ((key, _), value) in keys.into_iter().zip(values) {
            // A key that does not read is listed apart, not fatal to the
            // page: one bad value must not hide every other record.
            let read = match value {
                Ok(Some(value)) => read_stored(&Bytes::from(value)),
                // Expired or removed since SCAN saw it.
                Ok(None) => continue,
                Err(e) => Err(redis_error(e)),
            };
            match read {
                Ok(record) if record.expires_at() > now => page.records.push((key, record)),
                Ok(_expired) => {}
                Err(StoreError::Corrupt(why)) => page.unreadable.push((key, why)),
                Err(e) => return Err(e),
            }
        }
        Ok(page)
    }
}

/// A short name for a set of primaries (sorted by address), carried in a
/// cluster walk's cursor: 16 hex digits of a SHA-256, the same in every
/// process, so any replica can go on with a walk another began.
fn primaries_layout(primaries: &[(String, u16)]) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for (host, port) in primaries {
        hash.update(format!("{host}:{port},"));
    }
    hex::encode(&hash.finalize()[..8])
}

/// `text` with the characters a `SCAN` pattern treats specially escaped.
fn glob_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 4);
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The cluster's primaries that are up and serve slots, as `(host, port)`
/// ordered by address, from `CLUSTER NODES` (any node answers for all). A
/// master without slots holds no records, and the connection may not know
/// it yet (it learns nodes from the slot map): a walk passes it by.
async fn cluster_primaries(
    cluster: &mut redis::cluster_async::ClusterConnection,
) -> Result<Vec<(String, u16)>, StoreError> {
    let reply = cluster
        .route_command(
            redis::cmd("CLUSTER").arg("NODES").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await
        .map_err(redis_error)?;
    let text: String = redis::from_redis_value(reply).map_err(|e| unexpected(&e.to_string()))?;
    let mut primaries: Vec<(String, u16)> = text
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let address = fields.nth(1)?;
            let flags = fields.next()?;
            // Then master id, ping, pong, epoch, link state, and its
            // slots, if any.
            let serves = fields.nth(5).is_some();
            let up = flags.split(',').any(|f| f == "master")
                && !flags.split(',').any(|f| f == "fail" || f == "noaddr")
                && serves;
            let (host, port) = address.split(['@', ',']).next()?.rsplit_once(':')?;
            up.then(|| Some((host.to_owned(), port.parse().ok()?)))?
        })
        .collect();
    primaries.sort();
    Ok(primaries)
}
