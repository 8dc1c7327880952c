//! `idemproxy store train-dictionary`: a zstd dictionary for
//! `store.compression_dictionary`, trained from a sample of the responses
//! the configured store holds (or from files): small JSON responses
//! compress several times better against one trained on the API's own
//! responses.

use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::core::{Outcome, Record, StoredResponse};
use crate::store::compression::{self, Dictionary, Packer};
use crate::store::ScanCursor;
use crate::{open_store, Error};

/// What `train-dictionary` learns from, and how much.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Response bodies, one per file, instead of the store's responses.
    pub from_dir: Option<PathBuf>,
    /// At most this many samples.
    pub samples: usize,
    /// The dictionary's size at most, in bytes.
    pub max_len: usize,
}

/// What training made, and how well it does on samples it did not see.
#[derive(Clone, Debug)]
pub struct TrainReport {
    pub dictionary: Vec<u8>,
    /// Samples trained on, and held out to measure the result.
    pub trained: usize,
    pub held_out: usize,
    /// The held-out samples' bytes: as stored without compression, packed
    /// without the dictionary, and with it.
    pub plain_bytes: usize,
    pub zstd_bytes: usize,
    pub dictionary_bytes: usize,
}

impl std::fmt::Display for TrainReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id = compression::DictionaryId::of(&self.dictionary);
        writeln!(
            f,
            "dictionary {id}: {} bytes, trained on {} responses",
            self.dictionary.len(),
            self.trained
        )?;
        if self.held_out > 0 {
            let ratio = |bytes: usize| bytes as f64 / self.plain_bytes.max(1) as f64;
            writeln!(
                f,
                "on {} responses held out: {:.2} of their size packed without it, {:.2} with it",
                self.held_out,
                ratio(self.zstd_bytes),
                ratio(self.dictionary_bytes)
            )?;
        }
        Ok(())
    }
}

/// Every tenth sample is held out of training to measure the dictionary.
const HOLD_OUT_EVERY: usize = 10;

/// Trains a dictionary from the store `config` names (walked a page at a
/// time, never all at once) or from `options.from_dir`.
pub async fn train_dictionary(
    config: &Config,
    options: &TrainOptions,
) -> Result<TrainReport, Error> {
    let responses = match &options.from_dir {
        Some(dir) => read_bodies(dir, options.samples)?,
        None => stored_responses(config, options.samples).await?,
    };
    // Trained on what packing compresses.
    let payloads: Vec<Vec<u8>> = responses.iter().map(compression::payload).collect();
    let (held_out, training): (Vec<_>, Vec<_>) = payloads
        .iter()
        .enumerate()
        .partition(|(i, _)| payloads.len() >= 2 * HOLD_OUT_EVERY && i % HOLD_OUT_EVERY == 0);
    let training: Vec<&Vec<u8>> = training.into_iter().map(|(_, p)| p).collect();
    if training.is_empty() {
        return Err("no stored responses to train from (records that are claims, outcome-unknown or not stored carry none)".into());
    }
    let dictionary = compression::train(&training, options.max_len)?;
    let plain = Packer::new(false, None, Vec::new(), usize::MAX);
    let with = Packer::new(
        true,
        Some(Dictionary::new(&dictionary)?),
        Vec::new(),
        usize::MAX,
    );
    let without = Packer::new(true, None, Vec::new(), usize::MAX);
    let mut report = TrainReport {
        trained: training.len(),
        held_out: held_out.len(),
        plain_bytes: 0,
        zstd_bytes: 0,
        dictionary_bytes: 0,
        dictionary,
    };
    for (i, _) in held_out {
        let response = &responses[i];
        report.plain_bytes += plain.pack(response).len();
        report.zstd_bytes += without.pack(response).len();
        report.dictionary_bytes += with.pack(response).len();
    }
    Ok(report)
}

/// Up to `limit` stored responses, a page of the store's walk at a time.
async fn stored_responses(config: &Config, limit: usize) -> Result<Vec<StoredResponse>, Error> {
    let store = open_store(config).await.map_err(|e| {
        format!("cannot open the {:?} store: {e} (the embedded store's file is locked while a proxy serves from it: stop it, or train from a copy)", config.store.kind)
    })?;
    let mut responses = Vec::new();
    let mut cursor = ScanCursor::start();
    let mut progress = super::progress::Progress::new("store train-dictionary");
    while responses.len() < limit {
        let page = match store.scan(&cursor, 500).await {
            Ok(page) => page,
            Err(e) => {
                progress.finish();
                return Err(e.into());
            }
        };
        let examined = page.records.len() + page.unreadable.len();
        responses.extend(
            page.records
                .into_iter()
                .filter_map(|(key, record)| match record {
                    Record::Completed(completed) => match completed.outcome {
                        // The proxy's own learned dictionaries are
                        // records too: not responses to learn from.
                        Outcome::Response(response)
                            if !compression::is_dictionary_record(&key, &response) =>
                        {
                            Some(response)
                        }
                        _ => None,
                    },
                    Record::Pending(_) => None,
                }),
        );
        progress.advance(
            examined as u64,
            format_args!(
                "{} of {limit} responses sampled",
                responses.len().min(limit)
            ),
        );
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    progress.finish();
    responses.truncate(limit);
    Ok(responses)
}

/// Up to `limit` files of `dir`, in name order, each a response body.
fn read_bodies(dir: &Path, limit: usize) -> Result<Vec<StoredResponse>, Error> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.is_file())
        .collect();
    paths.sort();
    paths.truncate(limit);
    paths
        .into_iter()
        .map(|path| {
            let body =
                std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            Ok(StoredResponse {
                status: 200,
                headers: Vec::new(),
                body: body.into(),
            })
        })
        .collect()
}
