//! The fixed store: the put engine of `core.rs` over one arena of fixed-size slots.
//!
//! Semantics are SPEC section 2 (`fail-closed`). The one idea that matters for speed: only
//! evictable keys (stored, unreferenced) are in the LRU, so an evicting put walks victims, never
//! the keys that running requests hold. What is its own: the slots (a free list, then fresh
//! ones), profile `grow` with its in-place replacement, and a read under one lock that
//! prefetches every key's slot before copying.

use crate::arena::{Arena, Prefault};
pub use crate::core::{BlockRef, Counters, RemoveReason, VictimPolicy};
use crate::core::{Call, Charge, Core, Scratch};
use crate::error::StoreError;
use crate::keys::KeyTable;
use crate::slab::{Entry, NIL, PENDING_SLOT};
use std::borrow::Cow;

/// A point-in-time view of the store's occupancy and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Slots in the arena.
    pub capacity: usize,
    /// Keys stored.
    pub stored: usize,
    /// Keys with a reference count above zero (stored or not).
    pub referenced: usize,
    /// Keys stored and unreferenced (the LRU's length).
    pub evictable: usize,
    /// Slots not holding an object.
    pub free_slots: usize,
    /// Bytes per object.
    pub object_nbytes: usize,
    /// Counters since construction.
    pub counters: Counters,
}

/// What a successful put did beyond the obvious.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Profile `grow`: the arena grew to this many slots.
    pub grown_to: Option<usize>,
}

/// Which contract the store follows when a batch does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// Refuse the batch with `CannotRetain` (the default; vLLM main after the seed).
    FailClosed,
    /// Evict what is eligible, then grow the arena (vLLM 0.33).
    Grow,
}

/// A bounded block store with reference counts and O(1) eviction of unreferenced keys.
#[derive(Debug)]
pub struct BlockStore {
    arena: Option<Arena>,
    object_nbytes: usize,
    num_slots: usize,
    profile: Profile,
    /// Keys, counts and the LRU (the core shared with the variable store); the fixed store's
    /// entries carry no allocator data: a slot index says where the bytes are.
    core: Core<()>,
    /// Slots released by eviction, reused before fresh ones so touched pages are reused.
    free_slots: Vec<u32>,
    /// Slots below this were handed out at least once; above it the arena is untouched.
    next_slot: u32,
}

/// Every victim frees one slot.
struct OneSlot;

impl Charge<()> for OneSlot {
    const UNIT: bool = true;

    #[inline]
    fn charge(&self, _: &Scratch, _: Option<usize>, _: &Entry) -> usize {
        1
    }
}

/// Largest slot count: slot indices are `u32` and two values are reserved markers.
pub const MAX_SLOTS: usize = (PENDING_SLOT - 1) as usize;

/// Keys the slab holds before it reallocates: twice the slots. A full store needs entries for
/// a put's new keys before its victims free theirs, and for keys referenced before they are
/// stored (the engine retains a block's key before its data exists); a reallocation would copy
/// every entry inside one put (13 ms at 167k slots, 104 ms at 1M). The reservation is address
/// space only: pages are committed as entries are first used, so it costs no memory until the
/// keys exist.
fn slab_reserve(num_slots: usize) -> usize {
    num_slots.saturating_mul(2).saturating_add(1024).min(MAX_SLOTS)
}

/// Keys the index holds before it rehashes: 1.875 times the slots, so that a full store uses 40%
/// of its buckets (2.5 a slot, 20 bytes), where linear probes stay short (at 64% a W2 put costs
/// 25% more), with room for a put's new keys and for keys referenced before they are stored.
/// The buckets are written at construction, so this is real memory. Capped at 8M keys (85 MiB
/// of buckets); a store past that rehashes once.
fn index_reserve(num_slots: usize) -> usize {
    (num_slots + num_slots * 7 / 8 + 1024).min(8 << 20)
}

impl BlockStore {
    /// A store of `max_bytes / object_nbytes` slots of `object_nbytes` bytes each.
    pub fn new(max_bytes: usize, object_nbytes: usize) -> Result<Self, StoreError> {
        Self::with_profile(max_bytes, object_nbytes, Profile::FailClosed)
    }

    /// A store following `profile` when a batch does not fit.
    pub fn with_profile(
        max_bytes: usize,
        object_nbytes: usize,
        profile: Profile,
    ) -> Result<Self, StoreError> {
        Self::with_options(max_bytes, object_nbytes, profile, false)
    }

    /// A store following `profile`; with `prefault` the arena's pages are committed now rather
    /// than on first write (see `Arena::with_prefault`).
    pub fn with_options(
        max_bytes: usize,
        object_nbytes: usize,
        profile: Profile,
        prefault: bool,
    ) -> Result<Self, StoreError> {
        let prefault = if prefault { Prefault::Now } else { Prefault::OnWrite };
        Self::with_commit(max_bytes, object_nbytes, profile, prefault)
    }

    /// A store following `profile`, whose arena's pages are committed as `prefault` says.
    pub fn with_commit(
        max_bytes: usize,
        object_nbytes: usize,
        profile: Profile,
        prefault: Prefault,
    ) -> Result<Self, StoreError> {
        if object_nbytes == 0 {
            return Err(StoreError::ObjectSizeNotPositive);
        }
        if max_bytes < object_nbytes {
            return Err(StoreError::CapacityBelowOneObject);
        }
        let num_slots = max_bytes / object_nbytes;
        if num_slots > MAX_SLOTS {
            return Err(StoreError::CapacityTooLarge {
                num_slots: num_slots as u64,
                object_nbytes: object_nbytes as u64,
            });
        }
        let arena = Arena::with_commit(num_slots, object_nbytes, prefault)?;
        let mut keys = KeyTable::with_reserve(index_reserve(num_slots), slab_reserve(num_slots))?;
        if prefault != Prefault::OnWrite {
            // The entries a full store uses, committed now (a few ms at vLLM's size, also for
            // "background"): otherwise the first puts after construction first-touch them,
            // a page fault every 32 new keys.
            keys.slab.commit(num_slots.saturating_add(1024));
        }
        Ok(Self {
            arena: Some(arena),
            object_nbytes,
            num_slots,
            profile,
            core: Core::new(keys),
            free_slots: Vec::new(),
            next_slot: 0,
        })
    }

    /// The store's profile.
    pub fn profile(&self) -> Profile {
        self.profile
    }

    /// Bytes per object.
    pub fn object_nbytes(&self) -> usize {
        self.object_nbytes
    }

    /// Objects the store holds at most.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Whether `close` was called.
    pub fn is_closed(&self) -> bool {
        self.arena.is_none()
    }

    /// Frees the arena and every key; later calls fail with `Closed`. Idempotent.
    pub fn close(&mut self) {
        if self.arena.take().is_some() {
            self.core.clear();
            self.free_slots = Vec::new();
        }
    }

    crate::core::put_entry_points!(
        PutReport,
        "Stores a batch and applies reference changes, evicting as needed (SPEC section 2). \
         Validation comes first: a wrong-sized payload or a release below zero returns an \
         error and changes nothing."
    );

    /// `put`'s checks of the whole call before anything changes.
    fn admit(&self, objects: &[BlockRef<'_>]) -> Result<(), StoreError> {
        if self.arena.is_none() {
            return Err(StoreError::Closed);
        }
        match objects.iter().find(|o| o.payload.len() != self.object_nbytes) {
            Some(bad) => Err(StoreError::PayloadSize {
                key: bad.key.to_owned(),
                expected: self.object_nbytes,
                actual: bad.payload.len(),
            }),
            None => Ok(()),
        }
    }

    fn put_inner(
        &mut self,
        s: &mut Scratch,
        (objects, retain_keys, release_keys): Call<'_>,
        mut policy: Option<&mut dyn VictimPolicy>,
    ) -> Result<PutReport, StoreError> {
        // Evictions free at most one slot per new key of the batch.
        self.free_slots.try_reserve(objects.len()).map_err(|_| StoreError::OutOfMemory {
            what: "free slot list",
            bytes: objects.len() * std::mem::size_of::<u32>(),
        })?;
        let core = &mut self.core;
        core.resolve_call(s, objects, retain_keys, release_keys)?;
        if self.profile == Profile::Grow {
            // vLLM 0.33 replaces a re-put object that nothing references. The old bytes stay in
            // their slot until the put cannot fail any more (`write_batch`), so a refused put
            // leaves them readable. Counting the key as stored rather than dropped and re-added
            // gives the same `need`, LRU order and growth size as vLLM.
            for &(idx, position) in &s.batch {
                if core.keys.slab[idx].is_evictable() {
                    s.replaced.push((idx, position));
                }
            }
        }
        // As in vLLM, the count changes stay applied even when the put is refused below.
        core.apply_references::<false>(s);
        core.counters.retains += s.retains.len() as u64;
        core.counters.releases += s.releases.len() as u64;
        if let Some(policy) = policy.as_deref_mut() {
            if let Err(error) = core.notify_reference_changes(s, policy, false) {
                core.keys.forget_orphans(&s.created);
                core.keys.forget_orphans(&s.released);
                return Err(error);
            }
        }
        let placed = core.order_batch_and_released::<false>(s);
        core.keys.forget_orphans(&s.orphans);
        let need = (core.stored + placed.new_keys).saturating_sub(self.num_slots);
        let mut report = PutReport::default();
        if need > 0 {
            let eligible = placed.older + s.released.len();
            if eligible >= need {
                if let Some(policy) = policy.as_deref_mut() {
                    let refused = StoreError::CannotRetain { limit: self.num_slots };
                    let chosen =
                        core.ask_victims(s, placed.older, need, policy, &OneSlot, &refused);
                    if let Err(error) = chosen {
                        return Err(core.refuse::<false>(s, 0, error, Some(policy)));
                    }
                } else {
                    core.take_victims(s, placed.older, need, &OneSlot);
                }
            } else if self.profile == Profile::Grow {
                // As vLLM 0.33: every eligible key goes, and the arena holds what is left,
                // at least doubled.
                let num_slots = (core.stored + placed.new_keys - eligible).max(self.num_slots * 2);
                if let Err(error) = self.grow_arena(num_slots) {
                    return Err(self.core.refuse::<false>(s, 0, error, policy));
                }
                report.grown_to = Some(num_slots);
                self.core.take_victims(s, placed.older, eligible, &OneSlot);
            } else {
                let error = StoreError::CannotRetain { limit: self.num_slots };
                return Err(self.core.refuse::<false>(s, 0, error, policy));
            }
        }
        let free_slots = &mut self.free_slots;
        let removed =
            self.core.evict_victims(s, policy.is_some(), |slot, ()| free_slots.push(slot));
        self.write_batch(s, objects);
        match policy {
            Some(policy) => self.core.report_evicted(policy, &removed).map(|()| report),
            None => Ok(report),
        }
    }

    fn grow_arena(&mut self, num_slots: usize) -> Result<(), StoreError> {
        if num_slots > MAX_SLOTS {
            return Err(StoreError::CapacityTooLarge {
                num_slots: num_slots as u64,
                object_nbytes: self.object_nbytes as u64,
            });
        }
        self.arena.as_mut().expect("checked open").grow(num_slots)?;
        self.num_slots = num_slots;
        self.core.counters.growths += 1;
        Ok(())
    }

    /// Writes the batch's new keys into free slots and, profile `grow`, the replaced keys'
    /// new bytes into their own slots (those that were not evicted by this call).
    fn write_batch(&mut self, s: &Scratch, objects: &[BlockRef<'_>]) {
        let arena = self.arena.as_mut().expect("checked open");
        let core = &mut self.core;
        for &(idx, position) in &s.batch {
            let entry = &mut core.keys.slab[idx];
            if entry.slot != PENDING_SLOT {
                continue;
            }
            let slot = match self.free_slots.pop() {
                Some(slot) => slot,
                None => {
                    let slot = self.next_slot;
                    self.next_slot += 1;
                    slot
                }
            };
            entry.slot = slot;
            arena.write_slot(slot, objects[position].payload);
            core.stored += 1;
            core.counters.objects_written += 1;
            core.counters.bytes_written += self.object_nbytes as u64;
        }
        for &(idx, position) in &s.replaced {
            // A replaced key this call released may have been evicted; its entry is gone then.
            if core.keys.slab.is_live(idx) && core.keys.slab[idx].has_slot() {
                arena.write_slot(core.keys.slab[idx].slot, objects[position].payload);
                core.ledger.replaced += 1;
                core.counters.objects_written += 1;
                core.counters.bytes_written += self.object_nbytes as u64;
            }
        }
        arena.flush_writes();
    }

    /// Copies the payloads of `keys`, in order, into `out` (`keys.len() * object_nbytes` bytes),
    /// then moves each evictable key to the LRU tail. A missing key fails with `Missing` and
    /// changes nothing.
    pub fn get_into(&mut self, keys: &[&str], out: &mut [u8]) -> Result<(), StoreError> {
        if self.arena.is_none() {
            return Err(StoreError::Closed);
        }
        assert_eq!(out.len(), keys.len() * self.object_nbytes, "output size");
        let mut s = std::mem::take(&mut self.core.scratch);
        let result = self.read_into(&mut s, keys, out);
        s.clear();
        self.core.scratch = s;
        result
    }

    fn read_into(
        &mut self,
        s: &mut Scratch,
        keys: &[&str],
        out: &mut [u8],
    ) -> Result<(), StoreError> {
        self.core.keys.resolve(keys, &mut s.probes, &mut s.entries, None);
        let missing = s.entries.iter().position(|&idx| !self.core.is_stored(idx));
        if let Some(at) = missing {
            self.core.counters.read_misses += 1;
            return Err(StoreError::Missing {
                key: keys[at].to_owned(),
                used: self.core.stored,
                limit: self.num_slots,
                hint: self.profile == Profile::FailClosed,
            });
        }
        self.prefetch_for_read(&s.entries);
        let arena = self.arena.as_ref().expect("checked open");
        for (chunk, &idx) in out.chunks_exact_mut(self.object_nbytes).zip(&s.entries) {
            chunk.copy_from_slice(arena.slot(self.core.keys.slab[idx].slot));
        }
        self.core.touch_read(&s.entries);
        self.core.counters.reads += keys.len() as u64;
        self.core.counters.bytes_read += out.len() as u64;
        Ok(())
    }

    /// Starts the cache misses a read of `entries` will take after `resolve`: each stored key's
    /// slot, and for an evictable one the LRU links its move to the tail rewrites. Cold keys (a
    /// finished request's) miss at each; started together, the misses overlap instead of coming
    /// one after the other (the interleaving of a hash join).
    fn prefetch_for_read(&self, entries: &[u32]) {
        let (Some(arena), slab) = (self.arena.as_ref(), &self.core.keys.slab) else { return };
        let stored = |idx: u32| self.core.is_stored(idx);
        for &idx in entries.iter().filter(|&&idx| stored(idx)) {
            arena.prefetch_slot(slab[idx].slot);
            if slab[idx].refs == 0 {
                slab.prefetch_links(idx);
            }
        }
        for &idx in entries.iter().filter(|&&idx| stored(idx)) {
            if slab[idx].refs == 0 {
                slab.prefetch_lru_neighbourhood(idx);
            }
        }
    }

    /// Reads that do not fail on a missing key: copies the payloads of the stored keys among
    /// `keys`, in order, to the front of `out` (`keys.len() * object_nbytes` bytes), appends the
    /// positions of the keys that are not stored to `missing`, and returns the bytes written.
    /// Each key read that is evictable moves to the LRU tail, as a successful read does;
    /// missing keys touch nothing.
    pub fn get_many_into(
        &mut self,
        keys: &[&str],
        out: &mut [u8],
        missing: &mut Vec<usize>,
    ) -> Result<usize, StoreError> {
        if self.arena.is_none() {
            return Err(StoreError::Closed);
        }
        assert_eq!(out.len(), keys.len() * self.object_nbytes, "output size");
        let mut s = std::mem::take(&mut self.core.scratch);
        self.core.keys.resolve(keys, &mut s.probes, &mut s.entries, None);
        self.prefetch_for_read(&s.entries);
        let arena = self.arena.as_ref().expect("checked open");
        let mut written = 0;
        let first_missing = missing.len();
        for (i, &idx) in s.entries.iter().enumerate() {
            if !self.core.is_stored(idx) {
                missing.push(i);
                continue;
            }
            out[written..written + self.object_nbytes]
                .copy_from_slice(arena.slot(self.core.keys.slab[idx].slot));
            written += self.object_nbytes;
        }
        self.core.touch_read(&s.entries);
        let misses = missing.len() - first_missing;
        self.core.counters.reads += (keys.len() - misses) as u64;
        self.core.counters.read_misses += misses as u64;
        self.core.counters.bytes_read += written as u64;
        s.clear();
        self.core.scratch = s;
        Ok(written)
    }

    /// Whether each of `keys` is stored; touches no LRU position.
    pub fn contains_many(&self, keys: &[&str]) -> Result<Vec<bool>, StoreError> {
        if self.arena.is_none() {
            return Err(StoreError::Closed);
        }
        Ok(keys.iter().map(|key| self.contains(key)).collect())
    }

    /// The payloads of `keys`, concatenated; see `get_into`.
    pub fn get_concatenated(&mut self, keys: &[&str]) -> Result<Vec<u8>, StoreError> {
        let mut out = vec![0; keys.len() * self.object_nbytes];
        self.get_into(keys, &mut out)?;
        Ok(out)
    }

    /// Start address and length of the arena, or `None` when closed.
    pub fn arena_span(&self) -> Option<(usize, usize)> {
        self.arena.as_ref().map(|a| (a.as_ptr() as usize, a.len()))
    }

    /// Occupancy and counters.
    pub fn stats(&self) -> Stats {
        Stats {
            capacity: self.num_slots,
            stored: self.core.stored,
            referenced: self.core.referenced,
            evictable: self.core.keys.slab.lru_len(),
            free_slots: self.num_slots - self.core.stored,
            object_nbytes: self.object_nbytes,
            counters: self.core.counters,
        }
    }

    /// Evictable keys, oldest first. For tests and debugging: O(n).
    pub fn lru_keys(&self) -> Vec<Cow<'_, str>> {
        self.core.keys.lru_keys()
    }

    /// Every key with a reference count above zero, with its count, in no particular order.
    pub fn references(&self) -> Vec<(Cow<'_, str>, u32)> {
        self.core.keys.references()
    }

    /// Every stored key with its bytes, in no particular order. Touches no LRU position.
    pub fn objects(&self) -> Vec<(Cow<'_, str>, &[u8])> {
        let Some(arena) = self.arena.as_ref() else {
            return Vec::new();
        };
        let slab = &self.core.keys.slab;
        slab.live_indices()
            .filter(|&idx| slab[idx].has_slot())
            .map(|idx| (slab.key(idx), arena.slot(slab[idx].slot)))
            .collect()
    }

    /// The reference count of `key` (0 when unknown).
    pub fn reference_count(&self, key: &str) -> u32 {
        self.core.keys.reference_count(key)
    }

    /// Whether `key` is stored.
    pub fn contains(&self, key: &str) -> bool {
        self.core.contains(key)
    }

    /// Checks every invariant of SPEC section 11; the error names the broken one.
    pub fn check(&self) -> Result<(), String> {
        if self.arena.is_none() {
            return Ok(());
        }
        let used = self.next_slot as usize;
        if used > self.num_slots {
            return Err(format!("slots are in range: {used} handed out, {} exist", self.num_slots));
        }
        let mut owner = vec![NIL; used];
        let (stored, referenced) = self.core.check_entries(|idx, entry| {
            let slot = entry.slot as usize;
            if slot >= used {
                return Err(format!(
                    "slots are in range: {:?} has slot {slot} of {used} handed out",
                    self.core.keys.slab.key(idx)
                ));
            }
            if owner[slot] != NIL {
                return Err(format!("slots are unique: slot {slot} is held twice"));
            }
            owner[slot] = idx;
            Ok(())
        })?;
        for &slot in &self.free_slots {
            let slot = slot as usize;
            if slot >= used {
                return Err(format!("the free list is in the used range: slot {slot} of {used}"));
            }
            if owner[slot] != NIL {
                return Err(format!(
                    "the free list and the stored slots partition the used range: slot {slot} is \
                     both"
                ));
            }
            owner[slot] = NIL - 1;
        }
        if let Some(slot) = owner.iter().position(|&o| o == NIL) {
            return Err(format!(
                "the free list and the stored slots partition the used range: slot {slot} is \
                 neither"
            ));
        }
        self.core.check_counts(stored, referenced)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slab::NO_SLOT;

    fn block<'a>(key: &'a str, payload: &'a [u8]) -> BlockRef<'a> {
        BlockRef { key, payload }
    }

    /// Puts `key` retained once, then sets its count to `count` directly (2^32 real retains
    /// would take minutes).
    fn store_with_count(key: &str, count: u32) -> BlockStore {
        let mut store = BlockStore::new(4, 1).unwrap();
        store.put(&[block(key, b"a")], &[key], &[]).unwrap();
        let idx = store.core.keys.lookup(key).unwrap();
        store.core.keys.slab[idx].refs = count;
        store.check().unwrap();
        store
    }

    #[test]
    fn retain_at_the_count_limit_fails_and_changes_nothing() {
        let mut store = store_with_count("k", u32::MAX);
        let before = (store.stats(), store.lru_keys().len());
        let error = store.put(&[block("other", b"b")], &["other", "k"], &[]).unwrap_err();
        assert_eq!(error, StoreError::ReferenceOverflow { key: "k".to_owned() });
        assert_eq!((store.stats(), store.lru_keys().len()), before);
        assert_eq!(store.reference_count("k"), u32::MAX);
        assert_eq!(store.reference_count("other"), 0);
        assert!(!store.contains("other"));
        store.check().unwrap();
        // Two retains from one below the limit overflow on the second: still nothing changes.
        let mut store = store_with_count("k", u32::MAX - 1);
        let error = store.put(&[], &["k", "k"], &[]).unwrap_err();
        assert!(matches!(error, StoreError::ReferenceOverflow { .. }));
        assert_eq!(store.reference_count("k"), u32::MAX - 1);
        // A retain and a release in one call at the limit is still an overflow (retains first).
        let error = store.put(&[], &["k", "k"], &["k"]).unwrap_err();
        assert!(matches!(error, StoreError::ReferenceOverflow { .. }));
        // One retain reaches the limit exactly; a release brings it back.
        store.put(&[], &["k"], &[]).unwrap();
        assert_eq!(store.reference_count("k"), u32::MAX);
        store.put(&[], &[], &["k"]).unwrap();
        assert_eq!(store.reference_count("k"), u32::MAX - 1);
        store.check().unwrap();
    }

    #[test]
    fn a_put_that_retains_its_own_keys_in_order_acts_as_in_another_order() {
        // The core reuses the retains' entries for the objects when the retains are the
        // objects' keys in order; retained in another order, the objects are resolved again.
        // Both must end alike, duplicates in the batch, refusals and evictions included.
        let calls: [&[(&str, u8)]; 5] = [
            &[("a", 1), ("b", 2), ("a", 3)],
            &[("c", 4), ("d", 5)],
            &[("e", 6), ("e", 7), ("f", 8)],
            &[("g", 9), ("h", 10), ("i", 11), ("j", 12), ("k", 13)], // refused: too many
            &[("a", 14)],
        ];
        let mut shared = BlockStore::new(6, 1).unwrap();
        let mut resolved = BlockStore::new(6, 1).unwrap();
        for (n, call) in calls.iter().enumerate() {
            let payloads: Vec<[u8; 1]> = call.iter().map(|&(_, v)| [v]).collect();
            let objects: Vec<BlockRef<'_>> = call
                .iter()
                .zip(&payloads)
                .map(|(&(key, _), payload)| block(key, payload))
                .collect();
            let own: Vec<&str> = call.iter().map(|&(key, _)| key).collect();
            let mut rotated = own.clone();
            rotated.rotate_left(1);
            let released: &[&str] = if n == 2 { &["a", "b"] } else { &[] };
            let a = shared.put(&objects, &own, released).map(|_| ());
            let b = resolved.put(&objects, &rotated, released).map(|_| ());
            assert_eq!(a, b, "call {n}");
            shared.check().unwrap();
            assert_eq!(shared.lru_keys(), resolved.lru_keys(), "call {n}");
            let mut refs = (shared.references(), resolved.references());
            refs.0.sort();
            refs.1.sort();
            assert_eq!(refs.0, refs.1, "call {n}");
            assert_eq!(shared.stats(), resolved.stats(), "call {n}");
        }
        // A key's last payload in its first put wins; a stored key is not rewritten.
        assert_eq!(shared.get_concatenated(&["a", "c", "e"]).unwrap(), [3, 4, 7]);
        assert_eq!(resolved.get_concatenated(&["a", "c", "e"]).unwrap(), [3, 4, 7]);
        // The refused put kept its retains (as vLLM does); the last one added to a's.
        assert_eq!(shared.reference_count("a"), 2);
        assert_eq!(shared.reference_count("k"), 1);
    }

    #[test]
    fn check_catches_a_stored_key_lost_outside_eviction() {
        let mut store = BlockStore::new(4, 1).unwrap();
        store.put(&[block("a", b"1"), block("b", b"2")], &[], &[]).unwrap();
        store.check().unwrap();
        // What the old `grow` rollback did: drop a stored key's slot and forget the entry, with
        // every structural count kept consistent.
        let idx = store.core.keys.lookup("a").unwrap();
        let slot = store.core.keys.slab[idx].slot;
        store.core.keys.slab.unlink(idx);
        store.core.keys.slab[idx].slot = NO_SLOT;
        store.free_slots.push(slot);
        store.core.stored -= 1;
        store.core.keys.forget(idx);
        let message = store.check().unwrap_err();
        assert!(message.contains("not evicted or replaced is stored"), "{message}");
    }

    #[test]
    fn grow_replaces_in_place_and_keeps_the_ledger() {
        let mut store = BlockStore::with_profile(2, 1, Profile::Grow).unwrap();
        store.put(&[block("a", b"1"), block("b", b"2")], &[], &[]).unwrap();
        store.put(&[block("a", b"3")], &[], &[]).unwrap();
        assert_eq!(store.lru_keys(), ["b", "a"]);
        assert_eq!(store.get_concatenated(&["a", "b"]).unwrap(), b"32");
        // Replaced, retained and released in one call, and evicted by the same call's need.
        store.put(&[block("a", b"4"), block("c", b"5")], &["a"], &["a"]).unwrap();
        store.check().unwrap();
        assert_eq!(store.stats().stored, 2);
    }
}
