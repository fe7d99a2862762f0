//! aostore: the block store behind an LLM engine's auxiliary outputs.
//!
//! Fixed-size slots in one arena, reference counts per key, and an O(1) LRU that holds only
//! evictable (stored, unreferenced) keys. The core has no Python in it; the PyO3 binding lives in
//! `python` behind the `python` feature.

pub mod arena;
pub mod chunks;
mod core;
pub mod digest;
pub mod error;
pub mod index;
pub mod keys;
mod ledger;
mod references;
pub mod sched;
pub mod slab;
pub mod store;
pub mod variable;

#[cfg(feature = "python")]
mod python;

pub use arena::Prefault;
pub use error::StoreError;
pub use store::{
    BlockRef, BlockStore, Counters, Profile, PutReport, RemoveReason, Stats, VictimPolicy,
};
pub use variable::{ReadPlan, VariableStats, VariableStore};
