//! aostore: the block store behind an LLM engine's auxiliary outputs.
//!
//! Fixed-size slots in one arena, reference counts per key, and an O(1) LRU that holds only
//! evictable (stored, unreferenced) keys. The core has no Python in it; the PyO3 binding lives in
//! `python` behind the `python` feature.

mod arena;
mod chunks;
mod digest;
mod error;
mod index;
mod keys;
mod ledger;
mod references;
mod sched;
// Public only for the slab benchmark in benches/store.rs; not part of the API.
#[doc(hidden)]
pub mod slab;
mod store;

#[cfg(feature = "python")]
mod python;

pub use arena::Prefault;
pub use error::StoreError;
pub use store::{
    BlockRef, BlockStore, ChunkChains, Counters, FixedSlots, Profile, PutReport, ReadPlan,
    RemoveReason, Stats, Store, StoreOptions, VariableStats, VariableStore, VictimPolicy,
    MAX_OBJECT_NBYTES, MAX_SLOTS,
};
