//! What a route's idempotency is configured with, as the file says it:
//! `[idempotency]` holds the defaults, and every `[[routes]]` entry may
//! override any field (the configuration lays the defaults under each
//! route's table before reading it). `[mcp]` says how `protocol = "mcp"`
//! routes protect tool calls. The composition root turns these into a
//! [`Policy`](super::Policy), which carries them as they are
//! (`policy.settings`) beside what it parses from them. Nothing else of
//! this layer is named here.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::core::OnStale;
use crate::mcp::tools::Protect;
use crate::request::scope::Anonymous;

/// `[idempotency]`, and each route's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencySettings {
    pub methods: Vec<String>,
    pub require_key: bool,
    pub profile: Profile,
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    pub on_in_flight: OnInFlight,
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    pub on_store_error: OnStoreError,
    pub on_ambiguous: OnAmbiguous,
    pub on_stale: OnStale,
    /// Added to `upstream.timeout` to make the lease of a pending record.
    #[serde(with = "humantime_serde")]
    pub lease_margin: Duration,
    pub release_statuses: Vec<u16>,
    pub max_request_bytes: usize,
    pub max_response_bytes: usize,
    pub fingerprint_headers: Vec<String>,
    pub fingerprint_ignore: Vec<String>,
    pub scope: Vec<String>,
    pub anonymous: Anonymous,
    /// Where the key comes from, tried in order, the first present wins:
    /// `header:<name>`, `json:<pointer>` (a string or integer member of a
    /// JSON body), `query:<name>`.
    pub key_from: Vec<String>,
    /// When no `key_from` source is present: the key is a hash of these
    /// attributes (`header:<name>`, `json:<pointer>`, `method`, `path`),
    /// every one required, else the request has no key.
    pub derive_key: Vec<String>,
    pub mode: Mode,
    /// In `observe` mode, how long a keyless request's (scope,
    /// fingerprint) is remembered to count the duplicates no key catches.
    #[serde(with = "humantime_serde")]
    pub observe_window: Duration,
    /// When set, a replayed JSON object body gains this member:
    /// `{"replayed": true, "original_date": "<RFC 3339>"}`.
    pub replay_body_field: String,
    /// The upstream's lookup of a request whose outcome is unknown (a
    /// path-and-query template: `{key}`, `{header:<name>}`,
    /// `{json:<pointer>}`, `{query:<name>}`); empty: no lookup, such keys
    /// stay `outcome-unknown`. Plain HTTP routes in enforce mode only.
    pub reconcile_url: String,
    /// What a lookup must say to resolve an unknown outcome: the
    /// `Idempotency-Lookup` header (the default), or its status alone.
    pub reconcile_proof: ReconcileProof,
    /// With `reconcile_proof = "status"`: the lookup statuses that mean
    /// the operation happened (its answer becomes the stored outcome).
    pub reconcile_found_statuses: Vec<u16>,
    /// With `reconcile_proof = "status"`: the lookup statuses that mean
    /// it never happened and never will (the request executes).
    pub reconcile_absent_statuses: Vec<u16>,
    /// How long the lookup may take; 0 means `upstream.timeout`.
    #[serde(with = "humantime_serde")]
    pub reconcile_timeout: Duration,
}

impl Default for IdempotencySettings {
    fn default() -> Self {
        Self {
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            profile: Profile::Default,
            ttl: Duration::from_secs(24 * 3600),
            on_in_flight: OnInFlight::Reject,
            wait_timeout: Duration::from_secs(10),
            on_store_error: OnStoreError::Reject,
            on_ambiguous: OnAmbiguous::Store,
            on_stale: OnStale::Store,
            lease_margin: Duration::from_secs(5),
            release_statuses: vec![429, 503],
            max_request_bytes: 1024 * 1024,
            max_response_bytes: 1024 * 1024,
            fingerprint_headers: Vec::new(),
            fingerprint_ignore: Vec::new(),
            scope: vec!["header:authorization".into()],
            anonymous: Anonymous::Shared,
            key_from: vec!["header:idempotency-key".into()],
            derive_key: Vec::new(),
            mode: Mode::Enforce,
            observe_window: Duration::from_secs(600),
            replay_body_field: String::new(),
            reconcile_url: String::new(),
            reconcile_proof: ReconcileProof::Header,
            reconcile_found_statuses: vec![200],
            reconcile_absent_statuses: vec![404],
            reconcile_timeout: Duration::ZERO,
        }
    }
}

/// What proves a lookup's answer (docs/guarantees.md, "The lookup
/// protocol"). An unknown outcome is resolved only on positive proof: a
/// status alone is no proof, since a lookup route the upstream lacks (a
/// typo in the template, an older deployment) answers 404 too, and
/// reading that as "never happened" runs the payment again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReconcileProof {
    /// Found: a 2xx with `Idempotency-Lookup: found`; absent:
    /// `Idempotency-Lookup: absent` on a 2xx, 404 or 410. Anything else
    /// leaves the outcome unknown.
    #[default]
    Header,
    /// The status alone decides (`reconcile_found_statuses`,
    /// `reconcile_absent_statuses`): for an upstream that cannot add the
    /// header. `idemproxy check` warns about it.
    Status,
}

/// Which status codes the proxy's own answers use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// 409 for a reused key, 425 for a key in flight.
    #[default]
    Default,
    /// draft-ietf-httpapi-idempotency-key-header: 422 reused, 409 in flight.
    Ietf,
}

/// What a duplicate that arrives while its key is in flight gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnInFlight {
    /// 425 (or 409) at once, with `Retry-After`.
    Reject,
    /// Held up to `wait_timeout`, then replayed.
    Wait,
}

/// What a request gets when the store cannot answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// 503 `store-unavailable`.
    Reject,
    /// Forwarded without protection (counted as `unprotected`).
    Pass,
}

/// What happens to a key whose request may have executed (upstream timeout
/// or reset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnAmbiguous {
    /// Stored as `outcome-unknown`: fail closed.
    Store,
    /// Released: a retry executes again.
    Release,
}

/// Whether a route enforces idempotency or only observes what enforcing
/// would do (DESIGN §6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Enforce,
    /// Every request reaches the upstream as if the proxy were plain; what
    /// enforcement would have done is counted (`observed_*` outcomes).
    Observe,
}

/// What a route speaks (a route's own field, not one of `[idempotency]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Any HTTP API: the key is the `Idempotency-Key` header.
    #[default]
    Http,
    /// JSON-RPC over Streamable HTTP: each `tools/call` is keyed.
    Mcp,
}

/// `[mcp]`: how `protocol = "mcp"` routes protect tool calls (DESIGN §5).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpSettings {
    /// The argument each protected tool gains for its key.
    pub key_argument: String,
    pub protect: Protect,
    /// Globs of tool names added to the protected set (`send_*`).
    pub protect_tools: Vec<String>,
    /// Globs of tool names removed from it.
    pub skip_tools: Vec<String>,
    /// Whether the key argument is removed before the call is forwarded.
    pub strip_key_argument: bool,
    /// A model cannot back off: `wait` holds a duplicate, then replays.
    pub on_in_flight: OnInFlight,
    /// Whether a replay's first content item tells the model it is one.
    pub replay_note: bool,
}

impl Default for McpSettings {
    fn default() -> Self {
        Self {
            key_argument: "idempotency_key".into(),
            protect: Protect::Auto,
            protect_tools: Vec::new(),
            skip_tools: Vec::new(),
            strip_key_argument: true,
            on_in_flight: OnInFlight::Wait,
            replay_note: true,
        }
    }
}
