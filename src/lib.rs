//! aostore: a bounded block store for an LLM engine's auxiliary outputs, with reference counts
//! and an O(1) LRU of evictable keys only. The PyO3 binding is `python`, behind its feature.

mod arena;
mod chunks;
pub mod dataplane;
mod digest;
mod error;
mod index;
mod keys;
pub mod layout;
mod ledger;
mod references;
mod sched;
// Public only for the slab benchmark in benches/store.rs; not part of the API.
#[doc(hidden)]
pub mod slab;
mod store;
pub mod widen;
pub mod writer;

#[cfg(feature = "python")]
mod python;

pub use arena::{copy_parts, Prefault};
pub use error::StoreError;
pub use layout::Layout;
pub use store::{
    BlockRef, BlockStore, ChunkChains, Counters, FixedSlots, Profile, PutReport, ReadPlan,
    RemoveReason, Stats, Store, StoreOptions, VariableStats, VariableStore, VictimPolicy,
    MAX_OBJECT_NBYTES, MAX_SLOTS,
};
