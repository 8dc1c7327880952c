//! What a request is, before anything is done with it: its key, where the
//! key comes from, whose it is, and what makes two requests the same. Pure:
//! no I/O, no store and no HTTP responses; a request it cannot read comes
//! back as this layer's own error type ([`key::InvalidKey`],
//! [`key_source::KeyRefusal`], [`scope::ScopeError`]), and the
//! idempotency layer decides how to answer it. It knows `core` only.
//!
//! - [`key`]: a key's form (the `Idempotency-Key` header's grammar);
//! - [`key_source`]: where a key comes from (`key_from`, `derive_key`);
//! - [`scope`]: whose key it is (the caller's namespace), over
//!   [`identity`] (verified bearer tokens);
//! - [`fingerprint`]: what "the same request" means, over `jcs`
//!   (RFC 8785 canonical JSON);
//! - [`reconcile`]: the upstream's lookup for a key whose outcome is
//!   unknown (`reconcile_url`).

pub mod fingerprint;
pub mod identity;
mod jcs;
pub mod key;
pub mod key_source;
pub mod reconcile;
pub mod scope;
