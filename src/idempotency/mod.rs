pub mod fingerprint;
pub mod key;
pub mod record;
pub mod scope;
