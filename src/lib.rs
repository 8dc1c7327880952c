pub mod config;
pub mod idempotency;
pub mod store;
pub mod upstream;
