//! A store wrapper that rewrites the stored response of every completed
//! record on its way into the store and back: compression
//! ([`super::compression`]) and encryption at rest ([`super::sealed`]) are
//! each an [`OutcomeCodec`] behind one [`CodecStore`].
//!
//! Only a completion's outcome is rewritten. Claims, fingerprints,
//! instants and outcome kinds pass as they are: the stores' atomic steps
//! read them. A record the codec finds its own but cannot read back is a
//! corrupt record to a request (the middleware answers 500 `record-unreadable` and never runs
//! the request behind it again) and is shown as stored to an operator
//! (`get`, `scan`).

use std::sync::Arc;

use async_trait::async_trait;

use super::{
    Completion, ListPage, ListWant, RemovalWatcher, ScanCursor, ScanPage, SharedStore, Store,
    StoreError,
};
use crate::core::{
    Begin, BeginOutcome, CompletedRecord, FencingToken, Outcome, Record, RecordKey, Removal,
    Removed,
};

/// How a [`CodecStore`] rewrites stored outcomes.
pub trait OutcomeCodec: std::fmt::Debug + Send + Sync + 'static {
    /// What to store for `outcome` under `key`; `None` stores it as it is.
    fn encode(&self, key: &RecordKey, outcome: &Outcome) -> Result<Option<Outcome>, StoreError>;

    /// What a stored `outcome` stands for: `None` when it is not one this
    /// codec wrote (it reads as it is), `Err` saying why when it is but
    /// does not read back.
    fn decode(&self, key: &RecordKey, outcome: &Outcome) -> Option<Result<Outcome, String>>;

    /// A record to read from the store below before `outcome` decodes (a
    /// dictionary this process has not loaded yet); none by default.
    fn needs(&self, outcome: &Outcome) -> Option<RecordKey> {
        let _ = outcome;
        None
    }

    /// Takes the record [`OutcomeCodec::needs`] named, as the store holds
    /// it.
    fn learn(&self, record: Option<Record>) {
        let _ = record;
    }

    /// Whether the record under `key` (`record`, when the walk read it) is
    /// the codec's own, not a request's: left out of operators' walks.
    fn internal(&self, key: &RecordKey, record: Option<&Record>) -> bool {
        let _ = (key, record);
        false
    }
}

/// A store whose completed records' outcomes `C` rewrites (see the
/// module docs).
pub struct CodecStore<C> {
    inner: SharedStore,
    codec: Arc<C>,
}

impl<C: OutcomeCodec> std::fmt::Debug for CodecStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodecStore")
            .field("kind", &self.inner.kind())
            .field("codec", &self.codec)
            .finish()
    }
}

/// `record`'s instants and fingerprint with another outcome.
fn with_outcome(record: &CompletedRecord, outcome: Outcome) -> CompletedRecord {
    CompletedRecord {
        fingerprint: record.fingerprint,
        created_at: record.created_at,
        completed_at: record.completed_at,
        expires_at: record.expires_at,
        outcome,
    }
}

impl<C: OutcomeCodec> CodecStore<C> {
    pub fn new(inner: SharedStore, codec: C) -> Self {
        Self::shared(inner, Arc::new(codec))
    }

    /// A codec that is shared with whoever made it.
    pub fn shared(inner: SharedStore, codec: Arc<C>) -> Self {
        Self { inner, codec }
    }

    /// Reads what the codec needs first to decode `record` (a store that
    /// does not answer is an error as any read's).
    async fn prepare_decode(&self, record: &CompletedRecord) -> Result<(), StoreError> {
        if let Some(needed) = self.codec.needs(&record.outcome) {
            let found = self.inner.get(&needed).await?;
            self.codec.learn(found);
        }
        Ok(())
    }

    /// `record` read back; `None` when the codec leaves it as it is.
    fn decoded(
        &self,
        key: &RecordKey,
        record: &CompletedRecord,
    ) -> Option<Result<CompletedRecord, String>> {
        let decoded = self.codec.decode(key, &record.outcome)?;
        Some(decoded.map(|outcome| with_outcome(record, outcome)))
    }

    fn for_replay(
        &self,
        key: &RecordKey,
        record: Arc<CompletedRecord>,
    ) -> Result<Arc<CompletedRecord>, StoreError> {
        match self.decoded(key, &record) {
            None => Ok(record),
            Some(Ok(decoded)) => Ok(Arc::new(decoded)),
            Some(Err(why)) => Err(StoreError::Corrupt(format!(
                "record {}: {why}",
                key.to_hex()
            ))),
        }
    }

    /// `record` read back where it reads, else as stored: what an operator
    /// is shown.
    fn for_operator(&self, key: &RecordKey, record: &mut Record) {
        if let Record::Completed(completed) = record {
            if let Some(Ok(decoded)) = self.decoded(key, completed) {
                *completed = decoded;
            }
        }
    }
}

#[async_trait]
impl<C: OutcomeCodec> Store for CodecStore<C> {
    async fn begin(&self, begin: &Begin) -> Result<BeginOutcome, StoreError> {
        Ok(match self.inner.begin(begin).await? {
            BeginOutcome::Completed(record) => {
                self.prepare_decode(&record).await?;
                BeginOutcome::Completed(self.for_replay(&begin.key, record)?)
            }
            BeginOutcome::Settled(record) => {
                self.prepare_decode(&record).await?;
                BeginOutcome::Settled(self.for_replay(&begin.key, record)?)
            }
            other => other,
        })
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        record: &CompletedRecord,
    ) -> Result<(), StoreError> {
        match self.codec.encode(key, &record.outcome)? {
            Some(outcome) => {
                let encoded = with_outcome(record, outcome);
                self.inner.complete(key, token, &encoded).await
            }
            None => self.inner.complete(key, token, record).await,
        }
    }

    fn prepare(&self, key: &RecordKey, record: CompletedRecord) -> Result<Completion, StoreError> {
        let Some(outcome) = self.codec.encode(key, &record.outcome)? else {
            return self.inner.prepare(key, record);
        };
        let below = self.inner.prepare(key, with_outcome(&record, outcome))?;
        let stored = below
            .stored
            .unwrap_or_else(|| Arc::unwrap_or_clone(below.record));
        Ok(Completion {
            record: Arc::new(record),
            stored: Some(stored),
        })
    }

    /// Passed down as it was prepared: encoding it again here would make
    /// other bytes for the same completion.
    async fn complete_prepared(
        &self,
        key: &RecordKey,
        token: FencingToken,
        completion: &Completion,
    ) -> Result<(), StoreError> {
        self.inner.complete_prepared(key, token, completion).await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let mut record = self.inner.get(key).await?;
        if let Some(record) = &mut record {
            if let Record::Completed(completed) = record {
                self.prepare_decode(completed).await?;
            }
            self.for_operator(key, record);
        }
        Ok(record)
    }

    async fn remove(&self, key: &RecordKey, removal: Removal) -> Result<Removed, StoreError> {
        self.inner.remove(key, removal).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn list(&self, cursor: &ScanCursor, want: &ListWant<'_>) -> Result<ListPage, StoreError> {
        let mut page = self.inner.list(cursor, want).await?;
        page.records
            .retain(|(key, _)| !self.codec.internal(key, None));
        Ok(page)
    }

    async fn scan(&self, cursor: &ScanCursor, count: usize) -> Result<ScanPage, StoreError> {
        let mut page = self.inner.scan(cursor, count).await?;
        page.records
            .retain(|(key, record)| !self.codec.internal(key, Some(record)));
        for (key, record) in &mut page.records {
            if let Record::Completed(completed) = record {
                // Shown as stored when its dictionary cannot be read now.
                let _ = self.prepare_decode(completed).await;
            }
            self.for_operator(key, record);
        }
        Ok(page)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn local_cache_hits(&self) -> Option<u64> {
        self.inner.local_cache_hits()
    }

    fn local_cache_live(&self) -> Option<bool> {
        self.inner.local_cache_live()
    }

    fn watch_removals(&self, watcher: Arc<dyn RemovalWatcher>) {
        self.inner.watch_removals(watcher);
    }
}
