//! Reconciling one key on an operator's word (`POST /v1/keys/reconcile`,
//! `idemproxy keys reconcile`): the same claim, lookup and settling as a
//! retry on the request path makes (see [`super::reconcile`]), for a key
//! named by its raw value and the attributes its route's `reconcile_url`
//! names. Only an `outcome-unknown` record past its request's lease, or a
//! claim past its lease, is taken over; anything else the key holds is
//! reported and left as it is.
//!
//! The lookup goes through the proxy's upstream by a [`LookupSender`] the
//! composition root builds, so that this layer needs no upstream client.

use std::sync::Arc;

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::request::Parts;
use http::{Request, Response};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::context::{Claim, RequestContext};
use super::dialect::{settle_looked_up, Http};
use super::layer::{IdempotencyLayer, Settings};
use super::mcp_call::reconciled_result;
use super::mcp_request::fingerprint_of_call;
use super::policy::Policy;
use super::reconcile::{look_up, lookup_of, Lookup};
use super::settle::Holder;
use super::store_call::{bounded, owned_begin, release_unanswered_claim};
use crate::core::{
    Begin, BeginOutcome, CompletedRecord, FencingToken, Fingerprint, Outcome, Record, RecordKey,
    UnknownCause, UpstreamFailure,
};
use crate::observe::RequestOutcome;
use crate::request::key::IdempotencyKey;
use crate::store::StoreError;

/// The fingerprint the request `parts`, `body` has on the route of
/// `policy`, as the request path takes it; `None` for an MCP route's body
/// that is no `tools/call`.
fn request_fingerprint(policy: &Policy, parts: &Parts, body: &[u8]) -> Option<Fingerprint> {
    match &policy.mcp {
        Some(route) => fingerprint_of_call(parts, body, route),
        None => Some(policy.fingerprint.fingerprint(parts, body)),
    }
}

/// Sends a lookup to the upstream, as the traffic's requests are sent.
pub type LookupSender = Arc<
    dyn Fn(Request<Body>) -> BoxFuture<'static, Result<Response<Body>, UpstreamFailure>>
        + Send
        + Sync,
>;

/// Reconciles keys for the admin API (see the module's documentation).
#[derive(Clone)]
pub struct KeyReconciler {
    settings: Arc<Settings>,
    send: LookupSender,
}

impl std::fmt::Debug for KeyReconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyReconciler").finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A reconciler over this layer's store, settings and metrics, sending
    /// its lookups with `send`.
    pub fn key_reconciler(&self, send: LookupSender) -> KeyReconciler {
        KeyReconciler {
            settings: self.settings.clone(),
            send,
        }
    }
}

/// What reconciling a key did.
#[derive(Debug)]
pub enum KeyReconciliation {
    /// The lookup found the operation: its answer is now the key's stored
    /// outcome, replayed (marked `Idempotency-Reconciled: true`) as here.
    Found(Response<Body>),
    /// The operation never happened: the claim is released, the key is
    /// free and the next retry executes.
    Absent,
    /// The lookup gave no answer to go by (`why`): the key is settled
    /// back to `outcome-unknown`.
    Failed { why: String },
    /// Nothing to reconcile: what the key holds (unchanged).
    Holds(Record),
    /// A request holds the key and its lease runs (unchanged).
    InFlight { lease_expires_at: u64 },
    /// The key was freed meanwhile; nothing to reconcile (unchanged).
    Free,
    /// The key now holds another request's record (unchanged).
    Changed,
}

/// Why a key was not reconciled.
#[derive(Debug)]
pub enum ReconcileRefusal {
    /// The route has no `reconcile_url`.
    NotConfigured,
    /// The call lacks a value the route's `reconcile_url` names.
    Incomplete,
    /// No record for the key.
    NoRecord,
    /// The record does not read.
    Unreadable(String),
    /// The request given (method, path, headers, body) does not
    /// fingerprint to the key's record under the route's rules: it is
    /// not the request the key was used for. `not_a_call`: on an MCP
    /// route, the body is no `tools/call`.
    Mismatch { not_a_call: bool },
    /// The store failed or did not answer in time.
    Store(String),
    /// `max_in_flight` requests are being served.
    Overloaded,
}

impl KeyReconciler {
    /// Reconciles `key` (whose record is `record_key`) on the route of
    /// `policy`, with the request attributes `parts` and `body` the
    /// route's `reconcile_url` names.
    pub async fn reconcile(
        &self,
        policy: Arc<Policy>,
        parts: &Parts,
        body: &[u8],
        key: &IdempotencyKey,
        record_key: RecordKey,
    ) -> Result<KeyReconciliation, ReconcileRefusal> {
        if policy.reconcile.is_none() {
            return Err(ReconcileRefusal::NotConfigured);
        }
        let lookup = lookup_of(&policy, parts, body, key).ok_or(ReconcileRefusal::Incomplete)?;
        let settings = &self.settings;
        let fingerprint = request_fingerprint(&policy, parts, body);
        let store_timeout = settings.store_timeout;
        let record = tokio::time::timeout(store_timeout, settings.store.get(&record_key))
            .await
            .map_err(|_| ReconcileRefusal::Store("no answer in time".into()))?
            .map_err(|e| match e {
                StoreError::Corrupt(why) => ReconcileRefusal::Unreadable(why.to_string()),
                e => ReconcileRefusal::Store(e.to_string()),
            })?
            .ok_or(ReconcileRefusal::NoRecord)?;
        // The lookup is rendered from the operator's account of the
        // request; one that is not the key's request would settle the key
        // by another operation's lookup (its "absent" runs the payment
        // again). Held to the record as a retry is: by its fingerprint.
        match fingerprint {
            Some(fingerprint) if fingerprint == *record.fingerprint() => {}
            Some(_) => return Err(ReconcileRefusal::Mismatch { not_a_call: false }),
            None => return Err(ReconcileRefusal::Mismatch { not_a_call: true }),
        }
        let permit = settings
            .in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| ReconcileRefusal::Overloaded)?;
        // The lease a retry's claim would have: long enough for the lookup
        // and then the execution it may allow.
        let lookup_within = policy.lookup_timeout(settings.upstream_timeout);
        let lease = policy.lease + lookup_within;
        let begin = Begin {
            key: record_key,
            // The record's own: the claim is the same request's.
            fingerprint: *record.fingerprint(),
            lease,
            ttl: policy.settings.ttl,
            on_stale: policy.settings.on_stale,
            token: FencingToken::random(),
            reconcile: true,
        };
        let asked_at = Instant::now();
        let (token, took_over, cause) = match self.claim(&begin).await? {
            Ok(held) => held,
            Err(unchanged) => return Ok(unchanged),
        };
        // Logged and counted like the retry that would have done it; a
        // call that changed nothing is no request on the route.
        let mut log = settings.request_log(&policy, &lookup);
        log.set_key(record_key);
        let cx = RequestContext {
            settings: settings.clone(),
            policy,
            log,
            permit,
        };
        if took_over {
            cx.log.metrics().lease_expired();
            tracing::warn!(key = %record_key.to_hex(), "took over a stale key to reconcile it (keys reconcile)");
        }
        let claim = Claim {
            arrived_at: settings.clock.now_millis(),
            key: record_key,
            fingerprint: begin.fingerprint,
            lease_ends: asked_at + lease,
        };
        let holder = Holder { cx, claim, token };
        Ok(self.settle(holder, cause, lookup).await)
    }

    /// Claims the key as a retry would (`begin` with `reconcile`): the
    /// claim's token, whether it took over a stale claim, and the unknown
    /// outcome's cause; or, without a claim to reconcile, what the key
    /// holds.
    async fn claim(
        &self,
        begin: &Begin,
    ) -> Result<Result<(FencingToken, bool, UnknownCause), KeyReconciliation>, ReconcileRefusal>
    {
        let settings = &self.settings;
        let store_timeout = settings.store_timeout;
        let asked_at = Instant::now();
        let mut call = owned_begin(&settings.store, begin);
        let begun = match bounded(settings, "begin", store_timeout, &mut call).await {
            Ok(begun) => begun,
            Err(e) => {
                // Failed or late, the call may have claimed the key all the
                // same, over the unknown outcome it came to reconcile:
                // settled back to it, never freed (see
                // `release_unanswered_claim`), until the claim's own lease
                // (the lookup's time included) is over.
                if !matches!(e, StoreError::Corrupt(_)) {
                    release_unanswered_claim(settings, begin, call, asked_at + begin.lease);
                }
                return Err(ReconcileRefusal::Store(e.to_string()));
            }
        };
        let store = &settings.store;
        Ok(match begun {
            BeginOutcome::Acquired {
                token,
                took_over,
                reconcile: Some(cause),
            } => Ok((token, took_over, cause)),
            BeginOutcome::Acquired { token, .. } => {
                // The key was freed since it was read: this claim is no
                // one's to execute, so it goes at once.
                let _ = tokio::time::timeout(store_timeout, store.release(&begin.key, token)).await;
                Err(KeyReconciliation::Free)
            }
            BeginOutcome::Completed(record) | BeginOutcome::Settled(record) => Err(
                KeyReconciliation::Holds(Record::Completed(CompletedRecord::clone(&record))),
            ),
            BeginOutcome::InFlight { lease_expires_at } => {
                Err(KeyReconciliation::InFlight { lease_expires_at })
            }
            BeginOutcome::Mismatch { .. } => Err(KeyReconciliation::Changed),
        })
    }

    /// Holding the claim, asks the lookup and settles the key by its
    /// answer as the request path does (see [`super::reconcile`]).
    async fn settle(
        &self,
        holder: Holder,
        cause: UnknownCause,
        lookup: Request<Body>,
    ) -> KeyReconciliation {
        let Holder { cx, claim, token } = holder;
        let record_key = claim.key;
        let send = self.send.clone();
        let inner = tower::service_fn(move |request: Request<Body>| send(request));
        let outcome = match look_up(inner, &cx, record_key, lookup).await {
            Lookup::Absent => {
                let mut holder = Holder { cx, claim, token };
                holder.release().await;
                let (respond, _) = oneshot::channel();
                let released = http::Response::new(Body::empty());
                holder
                    .cx
                    .answer(respond, RequestOutcome::Released, released);
                return KeyReconciliation::Absent;
            }
            // Stored in the form the route's retries replay.
            Lookup::Found(answer) if cx.policy.mcp.is_some() => Ok(reconciled_result(&answer)),
            Lookup::Found(answer) => Ok(answer.as_response()),
            Lookup::Failed { why } => Err(why),
        };
        let (respond, answered) = oneshot::channel();
        let outcome = match outcome {
            Ok(found) => found,
            Err(why) => {
                settle_looked_up(
                    Holder { cx, claim, token },
                    &Http,
                    Outcome::Unknown { cause },
                    respond,
                )
                .await;
                return KeyReconciliation::Failed { why };
            }
        };
        settle_looked_up(Holder { cx, claim, token }, &Http, outcome, respond).await;
        let response = answered
            .await
            .unwrap_or_else(|_| http::Response::new(Body::empty()));
        KeyReconciliation::Found(response)
    }
}
