//! STUB: in-memory store, to be implemented by the store helper.
pub struct MemoryStore;
