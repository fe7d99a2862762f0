//! `Store<A>`: the put sequence once, over the engine of `core.rs` and an allocator (`fixed.rs`
//! slots, `variable.rs` chunk chains) that supplies only what differs (docs/semantics.md).

mod core;
mod fixed;
mod variable;

use std::borrow::Cow;

pub use self::core::{BlockRef, Counters, RemoveReason, VictimPolicy};
use self::core::{Call, Charge, Core, Placement, Scratch, Written};
use crate::arena::Prefault;
use crate::error::StoreError;
pub use fixed::{FixedSlots, PutReport, Stats, MAX_SLOTS};
pub use variable::{ChunkChains, ReadPlan, VariableStats, MAX_OBJECT_NBYTES};

/// The fixed store: objects of one size in the slots of one arena.
pub type BlockStore = Store<FixedSlots>;
/// The variable-size store: objects of any size under one byte budget.
pub type VariableStore = Store<ChunkChains>;

/// Which contract the fixed store follows when a batch does not fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Profile {
    /// Refuse the batch with `CannotRetain` (the default).
    #[default]
    FailClosed,
    /// Evict what is eligible, then grow the arena (vLLM 0.33).
    Grow,
}

/// How a store is built beyond its size; a field the store does not read must keep its default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// Fixed store: what a batch that does not fit does.
    pub profile: Profile,
    /// Both: when the arena's pages are committed.
    pub prefault: Prefault,
    /// Variable store: bytes per chunk (default: `default_chunk_nbytes(max_bytes)`).
    pub chunk_nbytes: Option<usize>,
}

impl StoreOptions {
    pub fn profile(self, profile: Profile) -> Self {
        Self { profile, ..self }
    }

    pub fn prefault(self, prefault: Prefault) -> Self {
        Self { prefault, ..self }
    }

    pub fn chunk_nbytes(self, chunk_nbytes: usize) -> Self {
        Self { chunk_nbytes: Some(chunk_nbytes), ..self }
    }
}

mod sealed {
    use std::borrow::Cow;

    use super::{BlockRef, Charge, Core, Placement, Scratch, StoreError, Written};
    use crate::slab::Entry;

    /// What an allocator supplies to the put sequence; monomorphized, so no `dyn` call per object.
    pub trait Allocator: Sized + Send + 'static {
        /// What each key entry carries for the allocator.
        type Meta: Copy + Default + Send + 'static;
        /// What a successful put reports.
        type Report: Default;
        /// What evicting a key frees.
        type Charge: Charge<Self::Meta>;
        /// Whether a refused put undoes its count changes and LRU moves (vLLM's fixed store keeps them).
        const UNDO: bool;
        /// Whether a put rewrites every stored batch key (else only `grow`'s `Scratch::replaced`).
        const REPLACES_STORED: bool;

        fn is_open(&self) -> bool;
        /// Frees the arena; returns whether it was open.
        fn close(&mut self) -> bool;
        /// Checks of the whole call, and room it needs, before anything changes.
        fn admit(&mut self, objects: &[BlockRef<'_>]) -> Result<(), StoreError>;
        /// What the batch takes, before any count changes; an error is a capacity refusal.
        fn charge_batch(
            &mut self,
            core: &Core<Self::Meta>,
            s: &mut Scratch,
            objects: &[BlockRef<'_>],
        ) -> Result<(), StoreError>;
        /// Before any reference change: maps the room the put will grow to, so that a failure
        /// to map changes nothing and tells no policy of changes that never happened.
        fn reserve_room(
            &mut self,
            _core: &Core<Self::Meta>,
            _s: &Scratch,
        ) -> Result<(), StoreError> {
            Ok(())
        }
        /// What the put lacks once its keys are placed, in charge units.
        fn need(&self, core: &Core<Self::Meta>, placed: &Placement) -> usize;
        /// What a victim frees.
        fn charges(&self) -> Self::Charge;
        /// The refusal of a batch that does not fit.
        fn refusal(&self) -> StoreError;
        /// Too few eligible keys for unit charges: grow (then all eligible go) or refuse. The
        /// core counts a growth the report names.
        fn make_room(
            &mut self,
            core: &Core<Self::Meta>,
            placed: &Placement,
            eligible: usize,
        ) -> Result<Self::Report, StoreError>;
        /// Frees a victim's room.
        fn free(&mut self, slot: u32, meta: Self::Meta);
        /// The allocator's half of `check()`, on an open store.
        fn check(&self, core: &Core<Self::Meta>) -> Result<(), String>;
        /// The arena's size after a put that grew it.
        fn grown_to(report: &Self::Report) -> Option<usize>;
        /// The bytes of the stored object `entry`.
        fn object<'a>(&'a self, entry: &Entry<Self::Meta>) -> Cow<'a, [u8]>;
        /// Writes the batch; the put can no longer fail. Reports what it wrote: the core
        /// counts it.
        fn write_batch(
            &mut self,
            core: &mut Core<Self::Meta>,
            s: &Scratch,
            objects: &[BlockRef<'_>],
        ) -> Written;
    }
}
pub(crate) use sealed::Allocator;

/// A bounded store with reference counts and O(1) eviction of unreferenced keys.
#[derive(Debug)]
pub struct Store<A: Allocator> {
    core: Core<A::Meta>,
    alloc: A,
}

impl<A: Allocator> Store<A> {
    fn from_parts(core: Core<A::Meta>, alloc: A) -> Self {
        Self { core, alloc }
    }

    /// Stores a batch, applies retains then releases, and evicts as needed; bad input changes
    /// nothing (docs/semantics.md says what a refused batch keeps).
    pub fn put(
        &mut self,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
    ) -> Result<A::Report, StoreError> {
        self.put_with_policy(objects, retain_keys, release_keys, None)
    }

    /// `put`, with a victim policy consulted for reference changes, victims and removals.
    pub fn put_with_policy(
        &mut self,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
        policy: Option<&mut dyn VictimPolicy>,
    ) -> Result<A::Report, StoreError> {
        self.put_call((objects, retain_keys, release_keys), policy, None)
    }

    /// `put_with_policy`, appending the position in `objects` of each payload it stored (new or
    /// replaced), one per distinct key in first-occurrence order; nothing when it fails.
    pub fn put_reporting(
        &mut self,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
        policy: Option<&mut dyn VictimPolicy>,
        written: &mut Vec<usize>,
    ) -> Result<A::Report, StoreError> {
        self.put_call((objects, retain_keys, release_keys), policy, Some(written))
    }

    fn put_call(
        &mut self,
        call: Call<'_>,
        policy: Option<&mut dyn VictimPolicy>,
        written: Option<&mut Vec<usize>>,
    ) -> Result<A::Report, StoreError> {
        self.alloc.admit(call.0)?;
        let mut scratch = std::mem::take(&mut self.core.scratch);
        let result = match A::UNDO {
            true => self.put_sequence::<true>(&mut scratch, call, policy, written),
            false => self.put_sequence::<false>(&mut scratch, call, policy, written),
        };
        self.core.end_put(scratch, result)
    }

    fn put_sequence<const UNDO: bool>(
        &mut self,
        s: &mut Scratch,
        (objects, retain_keys, release_keys): Call<'_>,
        mut policy: Option<&mut dyn VictimPolicy>,
        written: Option<&mut Vec<usize>>,
    ) -> Result<A::Report, StoreError> {
        let (core, alloc) = (&mut self.core, &mut self.alloc);
        core.resolve_call(s, objects, retain_keys, release_keys)?;
        if let Err(error) = alloc.charge_batch(core, s, objects) {
            core.keys.forget_orphans(&s.created);
            core.counters.capacity_errors += 1;
            return Err(error);
        }
        if let Err(error) = alloc.reserve_room(core, s) {
            core.keys.forget_orphans(&s.created);
            return Err(error);
        }
        let referenced_before = core.referenced;
        core.apply_references::<UNDO>(s);
        if !UNDO {
            core.count_references(s);
        }
        if let Some(policy) = policy.as_deref_mut() {
            if let Err(error) = core.notify_reference_changes(s, policy, false) {
                if UNDO {
                    core.roll_back::<true>(s, referenced_before);
                }
                core.keys.forget_orphans(&s.created);
                if !UNDO {
                    core.keys.forget_orphans(&s.released);
                }
                return Err(error);
            }
        }
        let placed = core.order_batch_and_released::<UNDO>(s);
        if !UNDO {
            core.keys.forget_orphans(&s.orphans);
        }
        let need = alloc.need(core, &placed);
        let mut report = A::Report::default();
        if need > 0 {
            let charge = alloc.charges();
            let eligible = placed.older + s.released.len();
            let chosen = if A::Charge::UNIT && eligible < need {
                alloc.make_room(core, &placed, eligible).map(|grown| {
                    if A::grown_to(&grown).is_some() {
                        core.counters.growths += 1;
                    }
                    report = grown;
                    core.take_victims(s, placed.older, eligible, &charge);
                })
            } else {
                match policy.as_deref_mut() {
                    None if core.take_victims(s, placed.older, need, &charge) => Ok(()),
                    None => Err(alloc.refusal()),
                    Some(policy) => {
                        core.ask_victims(s, placed.older, need, policy, &charge, &alloc.refusal())
                    }
                }
            };
            if let Err(error) = chosen {
                return Err(core.refuse::<UNDO>(s, referenced_before, error, policy));
            }
        }
        let removed = core.evict_victims(s, policy.is_some(), |slot, meta| alloc.free(slot, meta));
        if let Some(written) = written {
            core.writes_ahead::<A>(s, written);
        }
        let written = alloc.write_batch(core, s, objects);
        core.count_written(written);
        if UNDO {
            core.keys.forget_orphans(&s.orphans);
            core.keys.forget_orphans(&s.created);
            core.count_references(s);
        }
        match policy {
            Some(policy) => core.report_evicted(policy, &removed).map(|()| report),
            None => Ok(report),
        }
    }

    pub fn is_closed(&self) -> bool {
        !self.alloc.is_open()
    }

    /// Frees the arena and every key; later calls fail with `Closed`. Idempotent.
    pub fn close(&mut self) {
        if self.alloc.close() {
            self.core.clear();
        }
    }

    pub fn contains(&self, key: &str) -> bool {
        self.core.contains(key)
    }

    /// Whether each of `keys` is stored; touches no LRU position.
    pub fn contains_many(&self, keys: &[&str]) -> Result<Vec<bool>, StoreError> {
        if !self.alloc.is_open() {
            return Err(StoreError::Closed);
        }
        Ok(keys.iter().map(|key| self.contains(key)).collect())
    }

    /// 0 for an unknown key.
    pub fn reference_count(&self, key: &str) -> u32 {
        self.core.keys.reference_count(key)
    }

    /// Evictable keys, oldest first. For tests and debugging: O(n).
    pub fn lru_keys(&self) -> Vec<Cow<'_, str>> {
        self.core.keys.lru_keys()
    }

    /// Referenced keys with their counts, in no particular order.
    pub fn references(&self) -> Vec<(Cow<'_, str>, u32)> {
        self.core.keys.references()
    }

    /// Stored keys with their bytes, in no particular order; touches no LRU position.
    pub fn objects(&self) -> Vec<(Cow<'_, str>, Cow<'_, [u8]>)> {
        if !self.alloc.is_open() {
            return Vec::new();
        }
        let slab = &self.core.keys.slab;
        slab.live_indices()
            .filter(|&idx| self.core.is_stored(idx))
            .map(|idx| (slab.key(idx), self.alloc.object(&slab[idx])))
            .collect()
    }

    /// Checks every invariant (docs/semantics.md lists them); the error names the broken one.
    pub fn check(&self) -> Result<(), String> {
        match self.alloc.is_open() {
            true => self.alloc.check(&self.core),
            false => Ok(()),
        }
    }

    pub fn counters(&self) -> Counters {
        self.core.counters
    }

    /// Runs a read under the store's scratch vectors, returning them cleared.
    fn with_scratch<T>(&mut self, read: impl FnOnce(&mut Self, &mut Scratch) -> T) -> T {
        let mut s = std::mem::take(&mut self.core.scratch);
        let result = read(self, &mut s);
        s.clear();
        self.core.scratch = s;
        result
    }
}
