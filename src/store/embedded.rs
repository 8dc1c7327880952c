//! STUB: embedded durable store, to be implemented by the store helper.
pub struct EmbeddedStore;
