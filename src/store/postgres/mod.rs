//! PostgreSQL store (`kind = "postgres"`): many proxy replicas share one
//! database, disk-backed, for records that outgrow a Redis's memory.
//!
//! # Layout
//!
//! One table, `<table_prefix>records`, one row per record (see
//! [`schema`] for its versioned migrations): the 32-byte record key as
//! primary key, the [`Record::encode`] bytes as `value`, and beside them
//! what the statements fence and expire by (`pending`, the claim's fencing
//! `token`, `lease_expires_at`, `expires_at`, Unix ms), so no statement
//! decodes a record.
//!
//! # One statement per state change
//!
//! - `begin` is one `INSERT … ON CONFLICT (key) DO UPDATE … WHERE
//!   expires_at <= now`: it claims a free (or expired) key. When it does not
//!   win, a separate `SELECT` reads what holds the key (under READ
//!   COMMITTED a fallback read inside the same statement can miss a
//!   concurrent commit), and the proxy decides on it with
//!   [`decide_begin`](crate::core::decide_begin), as every store does. Only
//!   a record to replace (a claim whose holder died, an outcome to
//!   reconcile) costs a third statement: an `UPDATE` that applies only if
//!   the row still holds exactly what was read, else `begin` starts over.
//! - `complete` and `release` are one `UPDATE`/`DELETE … WHERE key AND token
//!   AND pending`: 0 rows means the caller was fenced.
//! - The fencing token is the request's own ([`Begin::token`], 128 random
//!   bits drawn once per request), not a per-key counter, which would start
//!   over once a row is swept and let a stale holder's token match again.
//!
//! Statements are prepared once per connection and cached.
//!
//! # Clocks
//!
//! Every instant compared comes from the calling proxy's clock, never the
//! database's (`now()`), so decisions are exactly those of `decide_begin`
//! and the same as on Redis; proxies sharing a database keep their clocks
//! in step (NTP), well under the lease margin.
//!
//! # Expiry
//!
//! Reads leave out rows whose `expires_at` has passed; the sweep
//! ([`sweep`]) deletes them in bounded batches.
//!
//! # Failures
//!
//! A pool of connections ([`deadpool_postgres`]), each checked before it
//! is handed out: one a restart closed is dropped and a new one opened, so
//! the first request after PostgreSQL is back is served. Connecting and
//! waiting for a connection are bounded; a database that cannot be reached
//! or answers an error is [`StoreError::Unavailable`] (503, nothing
//! executed), a row that does not decode [`StoreError::Corrupt`].
//! PostgreSQL ends by itself a statement its caller has given up on
//! (`statement_timeout`, `lock_timeout`, set per connection: see
//! `connect`), and a connection whose call was dropped mid-statement goes
//! to no other call until the server has answered it ([`conn`]).

mod conn;
mod connect;
mod pools;
mod removals;
mod schema;
mod statements;
mod sweep;
mod tls;

pub use connect::{check_settings, open, open_within, STARTUP_WAIT};

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio_postgres::types::ToSql;

use self::conn::{Conn, Reclaim};
use self::removals::RemovalFeed;
use self::statements::Statements;
use super::{
    busy_key, decide_read, note_takeover, Begin, BeginOutcome, ListPage, ListWant, Removal,
    RemovalWatcher, Removed, ScanCursor, ScanPage, Store, StoreError,
};
use crate::core::{
    new_claim, Clock, CompletedRecord, FencingToken, Record, RecordKey, RecordMeta, UnixMillis,
};

/// How many times `begin` reads a key, each read after the first following
/// an `UPDATE` that found the row changed (as on Redis: another proxy wrote
/// it in between, so a second read practically always settles it).
const BEGIN_ATTEMPTS: usize = 5;

/// Reads of a key a guarded removal makes before it gives up.
const REMOVE_ATTEMPTS: usize = 5;

/// A [`Store`] in PostgreSQL. See the module docs for the layout.
#[derive(Clone)]
pub struct PostgresStore {
    pools: Arc<pools::LoopPools>,
    /// What becomes of a connection whose call was dropped mid-statement.
    reclaim: Arc<Reclaim>,
    sql: Arc<Statements>,
    clock: Clock,
    feed: Arc<RemovalFeed>,
    /// Never sent on: dropping the last clone ends the sweeper.
    sweep_stop: Arc<watch::Sender<()>>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("channel", &self.sql.channel)
            .finish_non_exhaustive()
    }
}

/// A row's columns as a record writes them.
struct Columns {
    pending: bool,
    token: Vec<u8>,
    lease_expires_at: i64,
    expires_at: i64,
    value: Vec<u8>,
}

impl Columns {
    fn of(record: &Record) -> Columns {
        let (pending, token, lease_expires_at) = match record {
            Record::Pending(claim) => (true, claim.token, claim.lease_expires_at),
            Record::Completed(_) => (false, FencingToken(0), 0),
        };
        Columns {
            pending,
            token: token_bytes(token),
            lease_expires_at: millis(lease_expires_at),
            expires_at: millis(record.expires_at()),
            value: record.encode(),
        }
    }
}

fn token_bytes(token: FencingToken) -> Vec<u8> {
    token.0.to_be_bytes().to_vec()
}

/// Unix ms as PostgreSQL's `bigint`.
fn millis(at: UnixMillis) -> i64 {
    i64::try_from(at).unwrap_or(i64::MAX)
}

fn decode(value: &[u8]) -> Result<Record, StoreError> {
    Record::decode(value).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// A statement that failed: the database cannot serve it (down, too slow,
/// refusing), so nothing executes.
pub(crate) fn pg_error(e: tokio_postgres::Error) -> StoreError {
    match e.as_db_error() {
        Some(db) => {
            StoreError::Unavailable(format!("postgres: {} ({})", db.message(), db.code().code()))
        }
        // The cause says what the bare error does not ("error performing
        // TLS handshake": which certificate, why).
        None => match std::error::Error::source(&e) {
            Some(cause) => StoreError::Unavailable(format!("postgres: {e}: {cause}")),
            None => StoreError::Unavailable(format!("postgres: {e}")),
        },
    }
}

impl PostgresStore {
    /// Reads the time from `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    async fn client(&self) -> Result<Conn, StoreError> {
        let object = self
            .pools
            .current()
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(format!("postgres: {e}")))?;
        Ok(Conn::new(object, Arc::clone(&self.reclaim)))
    }

    /// Writes `claim` if the key is free or its row expired by `now`.
    async fn claim_free(
        &self,
        client: &mut Conn,
        key: &RecordKey,
        claim: &Record,
        now: UnixMillis,
    ) -> Result<bool, StoreError> {
        let c = Columns::of(claim);
        let params: [&(dyn ToSql + Sync); 6] = [
            &&key.as_bytes()[..],
            &c.token,
            &c.lease_expires_at,
            &c.expires_at,
            &c.value,
            &millis(now),
        ];
        Ok(client.execute(&self.sql.claim, &params).await? == 1)
    }

    async fn read(
        &self,
        client: &mut Conn,
        key: &RecordKey,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let rows = client
            .query(&self.sql.read, &[&&key.as_bytes()[..]])
            .await?;
        rows.first().map(|row| column(row, 0)).transpose()
    }

    /// Replaces the row with `replacement` if it still holds `current`.
    async fn swap(
        &self,
        client: &mut Conn,
        key: &RecordKey,
        current: &[u8],
        replacement: &Record,
    ) -> Result<bool, StoreError> {
        let c = Columns::of(replacement);
        let params: [&(dyn ToSql + Sync); 7] = [
            &&key.as_bytes()[..],
            &c.pending,
            &c.token,
            &c.lease_expires_at,
            &c.expires_at,
            &c.value,
            &current,
        ];
        Ok(client.execute(&self.sql.swap, &params).await? == 1)
    }

    /// Deletes the record unless `removal` keeps it.
    async fn delete(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        let mut client = self.client().await?;
        let key_bytes = &key.as_bytes()[..];
        let force = removal == Removal::Any;
        for _ in 0..REMOVE_ATTEMPTS {
            let now = self.clock.now_millis();
            let params: [&(dyn ToSql + Sync); 3] = [&key_bytes, &force, &millis(now)];
            let rows = client.query(&self.sql.remove, &params).await?;
            if let Some(row) = rows.first() {
                let expires_at: i64 = column(row, 0)?;
                return Ok(if expires_at > millis(now) {
                    Removed::Deleted
                } else {
                    Removed::Absent
                });
            }
            let rows = client.query(&self.sql.lease, &[&key_bytes]).await?;
            let Some(row) = rows.first() else {
                return Ok(Removed::Absent);
            };
            let (pending, until): (bool, i64) = (column(row, 0)?, column(row, 1)?);
            if pending && until > millis(now) {
                return Ok(Removed::Leased {
                    until: UnixMillis::try_from(until).unwrap_or(0),
                });
            }
            // Changed between the two statements (released, claimed,
            // completed): look again.
        }
        Err(StoreError::Unavailable(format!(
            "the record of {} changed under each of {REMOVE_ATTEMPTS} removals",
            key.hex()
        )))
    }

    /// Tells the other proxies' caches that `key` was removed. The record
    /// is gone whatever happens here, so a failure is logged: a cache that
    /// missed it replays for at most its `max_age`.
    async fn announce_removal(&self, key: &RecordKey) {
        let announced = async {
            let mut client = self.client().await?;
            let params: [&(dyn ToSql + Sync); 2] = [&self.sql.channel, &key.to_hex()];
            client.query(&self.sql.notify, &params).await
        }
        .await;
        if let Err(e) = announced {
            tracing::warn!(
                key = %key.hex(),
                error = %e,
                "removed, but other replicas were not told: their local caches may replay it for up to a minute"
            );
        }
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        let mut client = self.client().await?;
        let token = begin.token;
        // As on Redis: whether a takeover (to reconcile) was written, for a
        // claim of this call's read back after it.
        let (mut took_over, mut reconcile) = (false, None);
        for attempt in 1..=BEGIN_ATTEMPTS {
            let now = self.clock.now_millis();
            let claim = Record::Pending(new_claim(begin, now, token));
            if self
                .claim_free(&mut client, &begin.key, &claim, now)
                .await?
            {
                return Ok(BeginOutcome::Acquired {
                    token,
                    took_over: false,
                    reconcile: None,
                });
            }
            // Gone again since the claim lost (released, removed): claim
            // once more.
            let Some(current) = self.read(&mut client, &begin.key).await? else {
                continue;
            };
            let (outcome, replacement) =
                decide_read(begin, decode(&current)?, now, took_over, reconcile);
            let Some(replacement) = replacement else {
                return Ok(outcome);
            };
            if attempt == BEGIN_ATTEMPTS {
                break;
            }
            note_takeover(&outcome, &mut took_over, &mut reconcile);
            if self
                .swap(&mut client, &begin.key, &current, &replacement)
                .await?
            {
                return Ok(outcome);
            }
        }
        Ok(busy_key(
            &begin.key,
            BEGIN_ATTEMPTS,
            self.clock.now_millis(),
        ))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let value = record.encode();
        let params: [&(dyn ToSql + Sync); 5] = [
            &&key.as_bytes()[..],
            &token_bytes(token),
            &millis(record.expires_at),
            &value,
            &millis(self.clock.now_millis()),
        ];
        match client.execute(&self.sql.complete, &params).await? {
            0 => Err(StoreError::Fenced),
            _ => Ok(()),
        }
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let params: [&(dyn ToSql + Sync); 3] = [
            &&key.as_bytes()[..],
            &token_bytes(token),
            &millis(self.clock.now_millis()),
        ];
        match client.execute(&self.sql.release, &params).await? {
            0 => Err(StoreError::Fenced),
            _ => Ok(()),
        }
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let mut client = self.client().await?;
        let now = millis(self.clock.now_millis());
        let rows = client
            .query(&self.sql.get, &[&&key.as_bytes()[..], &now])
            .await?;
        match rows.first() {
            Some(row) => decode(column(row, 0)?).map(Some),
            None => Ok(None),
        }
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        // In a task of its own, as on Redis: a caller that stops waiting
        // once the row is gone must not cancel the announcement.
        let (store, key) = (self.clone(), *key);
        tokio::spawn(async move {
            let removed = store.delete(&key, removal).await?;
            // Announced even when nothing was there: a removal whose answer
            // was lost is retried, and must still reach the other caches.
            if !matches!(removed, Removed::Leased { .. }) {
                store.announce_removal(&key).await;
            }
            Ok(removed)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("remove: {e}")))?
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        client.simple("SELECT 1").await?;
        Ok(())
    }

    /// In key order, live rows only; the cursor is the last key of a page.
    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        let after = super::scan_after(cursor)?;
        let after = after.map(|k| k.as_bytes().to_vec()).unwrap_or_default();
        let count = count.max(1);
        let mut client = self.client().await?;
        let now = millis(self.clock.now_millis());
        let limit = i64::try_from(count).unwrap_or(i64::MAX);
        let params: [&(dyn ToSql + Sync); 3] = [&after, &now, &limit];
        let rows = client.walk_query(&self.sql.scan, &params).await?;
        let mut page = ScanPage::default();
        let mut last = None;
        for row in &rows {
            let key = row_key(row)?;
            last = Some(key);
            match decode(column::<&[u8]>(row, 1)?) {
                Ok(record) => page.records.push((key, record)),
                Err(e) => page.unreadable.push((key, e.to_string())),
            }
        }
        // A short page is the last.
        page.next = last
            .filter(|_| rows.len() == count)
            .map(|key| ScanCursor::new(key.to_hex()));
        Ok(page)
    }

    /// In key order, from the front of each value alone (see
    /// [`Store::list`]).
    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        let after = super::scan_after(cursor)?;
        let after = after.map(|k| k.as_bytes().to_vec()).unwrap_or_default();
        let max_examined = want.max_examined.max(1);
        let mut client = self.client().await?;
        let now = self.clock.now_millis();
        let limit = i64::try_from(max_examined).unwrap_or(i64::MAX);
        let front = i32::try_from(RecordMeta::ENCODED_FRONT_MAX).unwrap_or(i32::MAX);
        let params: [&(dyn ToSql + Sync); 4] = [&after, &millis(now), &limit, &front];
        let rows = client.walk_query(&self.sql.list, &params).await?;
        let (mut found, mut bytes) = (Vec::new(), 0usize);
        let mut more = rows.len() == max_examined;
        for row in &rows {
            if bytes >= want.max_bytes {
                more = true;
                break;
            }
            // What was read: the front, never the stored response.
            let front: &[u8] = column(row, 1)?;
            bytes += front.len();
            let meta = RecordMeta::read(front).map_err(|e| e.to_string());
            found.push((row_key(row)?, meta));
        }
        Ok(ListPage::of_found(want, found, more, now))
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn watch_removals(&self, watcher: Arc<dyn RemovalWatcher>) {
        self.feed.follow(watcher);
    }
}

/// Column `index` of `row`, as `T`: a row of another shape is a table
/// this build did not make.
fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    index: usize,
) -> Result<T, StoreError> {
    row.try_get(index)
        .map_err(|e| StoreError::Corrupt(format!("a row of another shape: {e}")))
}

fn row_key(row: &tokio_postgres::Row) -> Result<RecordKey, StoreError> {
    let key: &[u8] = column(row, 0)?;
    <[u8; 32]>::try_from(key)
        .map(RecordKey::from_bytes)
        .map_err(|_| StoreError::Corrupt(format!("a record key of {} bytes", key.len())))
}
