//! Dictionaries the proxy learns from its own first responses, so that the
//! default `compression = "zstd"` (no `compression_dictionary`) compresses
//! small JSON responses as well as a trained dictionary does: without one,
//! a ~1 KB response barely shrinks (zstd has nothing to match it against).
//!
//! - The first [`SAMPLES`] responses worth compressing are kept as samples
//!   (responses too small to gain, or already `content-encoding`d, are not);
//!   then one blocking task trains a dictionary on them. One that gains
//!   too little on its own samples (random bodies) is dropped, and the
//!   process stops learning: such responses stay as they were.
//! - The dictionary is shared through the store, with no new store call:
//!   its bytes under a record keyed by its id ([`dictionary_key`]), and the
//!   one to compress with under a fixed key ([`CURRENT`]), each written
//!   with begin/complete as any record (the MCP catalog does the same). The
//!   first replica to publish wins; the others adopt its dictionary, so
//!   replicas compress alike. A proxy adopts the current one at start, so a
//!   restart keeps compressing with it.
//! - A record names its dictionary (packed layout 3). A replica that meets
//!   an id it has not loaded reads the dictionary's record first
//!   ([`OutcomeCodec::needs`](crate::store::codec::OutcomeCodec::needs)); a store that does not answer is the store
//!   being unavailable (retry later), never a corrupt record.
//! - A dictionary compresses new records for [`USABLE_FOR`]; its records
//!   outlive that by the longest record lifetime, so every record written
//!   with it reads. Past it, the proxy learns anew.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::{compressed_len, payload, train, worth_compressing, Dictionary, DictionaryId, Packer};
use crate::core::{
    millis, now_millis, CompletedRecord, Outcome, Record, RecordKey, Removal, StoredResponse,
    UnixMillis,
};
use crate::store::fixed_record::{self, Written};
use crate::store::SharedStore;

/// Responses trained on: ~300 KB of ~1 KB JSON, about what zstd's trainer
/// wants for a dictionary of [`DICTIONARY_LEN`].
pub const SAMPLES: usize = 256;

/// The most of one response kept as a sample: a dictionary holds what
/// responses share, which a large one's start shows as well as its whole.
const MAX_SAMPLE: usize = 8 << 10;

/// The learned dictionary's size: larger ones gained little on JSON API
/// responses and cost the trainer more samples.
const DICTIONARY_LEN: usize = 4 << 10;

/// A dictionary is kept only when its samples compress to at most this
/// fraction (in percent) of their size with it.
const WORTH_KEEPING_PERCENT: usize = 80;

/// How long one dictionary compresses new records.
pub const USABLE_FOR: Duration = Duration::from_secs(30 * 24 * 3600);

/// Where the dictionary to compress with is shared: a fixed record key in a
/// domain of its own (no key a caller sends can hash to it).
pub static CURRENT: std::sync::LazyLock<RecordKey> = std::sync::LazyLock::new(|| {
    RecordKey::from_bytes(
        Sha256::new()
            .chain_update(b"idemproxy.compression.dictionary.current.v1\0")
            .finalize()
            .into(),
    )
});

/// Where the dictionary `id` is kept for replicas that meet its records.
pub fn dictionary_key(id: DictionaryId) -> RecordKey {
    RecordKey::from_bytes(
        Sha256::new()
            .chain_update(b"idemproxy.compression.dictionary.v1\0")
            .chain_update(id.as_bytes())
            .finalize()
            .into(),
    )
}

/// Whether the record under `key` is one of the learned dictionaries'
/// (the current one's, or one kept for its records), not a response.
pub fn is_dictionary_record(key: &RecordKey, response: &StoredResponse) -> bool {
    *key == *CURRENT || *key == dictionary_key(DictionaryId::of(&response.body))
}

/// The dictionary new records are compressed with, and until when.
#[derive(Debug, Clone)]
struct Current {
    dictionary: Arc<Dictionary>,
    usable_until: UnixMillis,
}

/// Learning a dictionary: what the proxy has sampled, and the store it
/// shares the result through.
struct Learning {
    /// The store below compression and encryption's wrapper: the
    /// dictionary records are sealed as any record, never packed.
    store: SharedStore,
    store_timeout: Duration,
    /// How long records live at most: a dictionary's records outlive its
    /// use by this much.
    record_lifetime: Duration,
    samples: Mutex<Vec<Vec<u8>>>,
    /// A training or a publication is under way, or learning gave up.
    busy: AtomicBool,
}

impl std::fmt::Debug for Learning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learning")
            .field("busy", &self.busy.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// The codec of `store.compression`: the configured [`Packer`] with the
/// dictionaries learned (see the module docs).
#[derive(Debug)]
pub struct Compression {
    packer: Packer,
    /// Every learned dictionary this process has loaded, by id.
    known: RwLock<HashMap<DictionaryId, Arc<Dictionary>>>,
    current: RwLock<Option<Current>>,
    /// `None`: not learning (compression off, or a configured dictionary).
    learning: Option<Learning>,
    /// Itself, for the tasks it starts.
    this: Weak<Compression>,
}

/// What [`Compression::new`] learns with.
pub struct LearnSettings {
    pub store: SharedStore,
    pub store_timeout: Duration,
    pub record_lifetime: Duration,
}

impl std::fmt::Debug for LearnSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LearnSettings")
            .field("store", &self.store.kind())
            .field("record_lifetime", &self.record_lifetime)
            .finish_non_exhaustive()
    }
}

impl Compression {
    /// `learn`: where to share learned dictionaries, when the proxy learns
    /// them (compression on, no configured dictionary).
    pub fn new(packer: Packer, learn: Option<LearnSettings>) -> Arc<Self> {
        let learning = learn
            .filter(|_| packer.compresses() && !packer.has_dictionary())
            .map(|learn| Learning {
                store: learn.store,
                store_timeout: learn.store_timeout,
                record_lifetime: learn.record_lifetime,
                samples: Mutex::new(Vec::new()),
                busy: AtomicBool::new(false),
            });
        Arc::new_cyclic(|this| Self {
            packer,
            known: RwLock::new(HashMap::new()),
            current: RwLock::new(None),
            learning,
            this: this.clone(),
        })
    }

    /// Adopts the shared dictionary, if there is a usable one, in a task of
    /// its own (the proxy starts without waiting for it).
    pub fn adopt_shared(&self) {
        let (Some(learning), Some(this)) = (&self.learning, self.this.upgrade()) else {
            return;
        };
        if learning.busy.swap(true, Ordering::AcqRel) {
            return;
        }
        spawn(async move {
            this.adopt_current().await;
            this.learning_done();
        });
    }

    /// The dictionary to compress with now, if any.
    fn for_writing(&self) -> Option<Arc<Dictionary>> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        let current = current.as_ref()?;
        (now_millis() < current.usable_until).then(|| current.dictionary.clone())
    }

    pub(super) fn pack(&self, response: &StoredResponse) -> Bytes {
        if let Some(dictionary) = self.for_writing() {
            return self.packer.pack_with(response, Some(&dictionary));
        }
        if worth_compressing(response) {
            self.sample(response);
        }
        self.packer.pack(response)
    }

    pub(super) fn unpack(&self, packed: &Bytes) -> Result<StoredResponse, super::UnpackError> {
        self.packer.unpack_with(packed, |id| self.known(id))
    }

    pub(super) fn compresses(&self) -> bool {
        self.packer.compresses()
    }

    fn known(&self, id: DictionaryId) -> Option<Arc<Dictionary>> {
        let known = self.known.read().unwrap_or_else(PoisonError::into_inner);
        known.get(&id).cloned()
    }

    /// Whether `key` is where a dictionary this process knows is kept.
    pub(super) fn is_dictionary_key(&self, key: &RecordKey) -> bool {
        if *key == *CURRENT {
            return true;
        }
        let known = self.known.read().unwrap_or_else(PoisonError::into_inner);
        known.keys().any(|id| dictionary_key(*id) == *key)
    }

    /// The record to read before `packed` unpacks: its dictionary's, when
    /// this process has not loaded it.
    pub(super) fn needs(&self, packed: &[u8]) -> Option<RecordKey> {
        let id = super::dictionary_of(packed)?;
        let loaded = self.packer.configured(id).is_some() || self.known(id).is_some();
        (!loaded).then(|| dictionary_key(id))
    }

    /// Loads the dictionary a record read for [`Compression::needs`] holds.
    /// One that is not there leaves its records unreadable (corrupt).
    pub(super) fn learn(&self, record: Option<Record>) {
        if let Some(Record::Completed(completed)) = record {
            self.load(&completed);
        }
    }

    /// The dictionary `record` holds, loaded and known by its id.
    fn load(&self, record: &CompletedRecord) -> Option<Arc<Dictionary>> {
        let Outcome::Response(stored) = &record.outcome else {
            return None;
        };
        let id = DictionaryId::of(&stored.body);
        if let Some(known) = self.known(id) {
            return Some(known);
        }
        let dictionary = Arc::new(Dictionary::new(&stored.body).ok()?);
        let mut known = self.known.write().unwrap_or_else(PoisonError::into_inner);
        known.insert(id, dictionary.clone());
        Some(dictionary)
    }

    fn sample(&self, response: &StoredResponse) {
        let Some(learning) = &self.learning else {
            return;
        };
        if learning.busy.load(Ordering::Acquire) {
            return;
        }
        let mut payload = payload(response);
        payload.truncate(MAX_SAMPLE);
        let samples = {
            let mut samples = learning
                .samples
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            samples.push(payload);
            if samples.len() < SAMPLES || learning.busy.swap(true, Ordering::AcqRel) {
                return;
            }
            std::mem::take(&mut *samples)
        };
        let Some(this) = self.this.upgrade() else {
            return;
        };
        spawn(async move {
            let trained = tokio::task::spawn_blocking(move || trained(&samples)).await;
            let Ok(Some(bytes)) = trained else {
                // Nothing worth keeping: stay busy, learning no more.
                tracing::info!(
                    "no compression dictionary gains on these responses; not learning one"
                );
                return;
            };
            this.share(bytes).await;
            this.learning_done();
        });
    }

    /// Learning may start again: it samples afresh once no dictionary is
    /// current (this one failed to publish, or a current one is past its
    /// use).
    fn learning_done(&self) {
        if let Some(learning) = &self.learning {
            learning.busy.store(false, Ordering::Release);
        }
    }

    /// Publishes a trained dictionary, or adopts the one another replica
    /// published first. Whether a dictionary is now current.
    async fn share(&self, bytes: Vec<u8>) -> bool {
        let Some(learning) = &self.learning else {
            return false;
        };
        let lifetime = USABLE_FOR.saturating_add(learning.record_lifetime);
        let id = DictionaryId::of(&bytes);
        let body = Bytes::from(bytes);
        // Its bytes first: a record is written with it only once it is
        // current, by which time every replica can read it.
        if !learning.write(dictionary_key(id), &body, lifetime).await {
            return false;
        }
        for _ in 0..2 {
            match learning.claim(*CURRENT, &body, lifetime).await {
                Written::Now(record) | Written::Held(record) => return self.adopt(&record),
                Written::Other => {
                    if self.adopt_current().await {
                        return true;
                    }
                    // An old dictionary past its use: replaced.
                    let remove = learning.store.remove(&CURRENT, Removal::UnlessLeased);
                    if learning.within_timeout(remove).await.is_none() {
                        return false;
                    }
                }
                Written::Failed => return false,
            }
        }
        false
    }

    /// Adopts the shared current dictionary when it is usable.
    async fn adopt_current(&self) -> bool {
        let Some(learning) = &self.learning else {
            return false;
        };
        match learning.within_timeout(learning.store.get(&CURRENT)).await {
            Some(Some(Record::Completed(record))) => self.adopt(&record),
            _ => false,
        }
    }

    fn adopt(&self, record: &CompletedRecord) -> bool {
        let Some(learning) = &self.learning else {
            return false;
        };
        let usable_until = record
            .expires_at
            .saturating_sub(millis(learning.record_lifetime));
        if now_millis() >= usable_until {
            return false;
        }
        let Some(dictionary) = self.load(record) else {
            return false;
        };
        tracing::info!(dictionary = %dictionary.id(), "compressing stored responses with a learned dictionary");
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        *current = Some(Current {
            dictionary,
            usable_until,
        });
        true
    }
}

impl Learning {
    async fn within_timeout<T, E>(&self, call: impl Future<Output = Result<T, E>>) -> Option<T> {
        match tokio::time::timeout(self.store_timeout, call).await {
            Ok(Ok(value)) => Some(value),
            _ => None,
        }
    }

    /// Writes `body` under `key` for `lifetime`; true when the record holds
    /// it.
    async fn write(&self, key: RecordKey, body: &Bytes, lifetime: Duration) -> bool {
        matches!(
            self.claim(key, body, lifetime).await,
            Written::Now(_) | Written::Held(_)
        )
    }

    async fn claim(&self, key: RecordKey, body: &Bytes, lifetime: Duration) -> Written {
        let response = StoredResponse {
            status: 200,
            headers: Vec::new(),
            body: body.clone(),
        };
        let (store, timeout) = (self.store.as_ref(), self.store_timeout);
        fixed_record::write(store, key, response, lifetime, now_millis(), timeout).await
    }
}

/// A dictionary trained on `samples`, when it gains enough on them.
fn trained(samples: &[Vec<u8>]) -> Option<Vec<u8>> {
    let bytes = train(samples, DICTIONARY_LEN)
        .map_err(|why| tracing::info!("learning a compression dictionary: {why}"))
        .ok()?;
    let dictionary = Dictionary::new(&bytes).ok()?;
    let (mut before, mut after) = (0, 0);
    for sample in samples {
        before += sample.len();
        after += compressed_len(sample, &dictionary);
    }
    (after * 100 <= before * WORTH_KEEPING_PERCENT).then_some(bytes)
}

/// Runs `task` on the runtime, when there is one (the codec is called from
/// requests, always within it).
fn spawn(task: impl Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(i: usize) -> Vec<u8> {
        format!(
            r#"{{"id":"pi_{:024x}","object":"payment_intent","amount":{},"currency":"eur","status":"succeeded","customer":"cus_{:014}","metadata":{{"order_id":"{}"}},"shipping":{{"address":{{"city":"Lyon","country":"FR","line1":"{} rue de la Paix","postal_code":"69002"}},"name":"Camille Martin"}},"livemode":false}}"#,
            i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            100 + i * 13,
            i * 7919,
            500_000 + i,
            i % 97
        )
        .into_bytes()
    }

    fn noise(i: usize) -> Vec<u8> {
        let mut x = 0x2545_f491_u64 ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (0..1000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_dictionary_is_learned_from_json_and_none_from_noise() {
        let samples: Vec<_> = (0..SAMPLES).map(json).collect();
        let bytes = trained(&samples).expect("a dictionary gains on JSON");
        assert!(bytes.len() <= DICTIONARY_LEN);
        let dictionary = Dictionary::new(&bytes).expect("it loads");
        let unseen = json(SAMPLES * 10);
        let with = compressed_len(&unseen, &dictionary);
        assert!(with * 3 < unseen.len(), "{with} of {}", unseen.len());

        let samples: Vec<_> = (0..SAMPLES).map(noise).collect();
        assert_eq!(trained(&samples), None);
    }

    #[test]
    fn dictionary_records_are_told_from_responses() {
        let response = |body: &[u8]| StoredResponse {
            status: 200,
            headers: Vec::new(),
            body: Bytes::copy_from_slice(body),
        };
        let bytes = json(1);
        let id = DictionaryId::of(&bytes);
        assert!(is_dictionary_record(&CURRENT, &response(&bytes)));
        assert!(is_dictionary_record(&dictionary_key(id), &response(&bytes)));
        assert!(!is_dictionary_record(
            &dictionary_key(id),
            &response(b"{\"other\":1}")
        ));
        assert!(!is_dictionary_record(
            &RecordKey::from_bytes([9; 32]),
            &response(&bytes)
        ));
    }
}
