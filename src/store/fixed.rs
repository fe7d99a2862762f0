//! The fixed store's allocator: fixed-size slots in one arena, profile `grow` with in-place
//! replacement, and a one-lock read that prefetches every slot before copying.

use super::core::{BlockRef, Charge, Core, Counters, Placement, Scratch, Written};
use super::{Allocator, BlockStore, Profile, Store, StoreOptions};
use crate::arena::{Arena, Prefault};
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

/// The fixed store's arena and slots.
#[derive(Debug)]
pub struct FixedSlots {
    arena: Option<Arena>,
    object_nbytes: usize,
    num_slots: usize,
    profile: Profile,
    /// Slots freed by eviction, reused before fresh ones so touched pages are reused.
    free_slots: Vec<u32>,
    /// Slots below this were handed out; above it the arena is untouched.
    next_slot: u32,
    /// The size `reserve_room` mapped for the put under way, taken by `make_room`.
    reserved: Option<usize>,
}

/// Every victim frees one slot.
pub struct OneSlot;

impl Charge<()> for OneSlot {
    const UNIT: bool = true;

    #[inline]
    fn charge(&self, _: &Scratch, _: Option<usize>, _: &Entry) -> usize {
        1
    }
}

/// Largest slot count: slot indices are `u32` and two values are reserved markers.
pub const MAX_SLOTS: usize = (PENDING_SLOT - 1) as usize;

/// Keys the slab reserves: twice the slots, for a put's new keys before its victims go and for
/// keys referenced before stored; a reallocation inside a put would copy every entry (cost in
/// docs/performance.md). Address space only: pages commit as entries are first used.
fn slab_reserve(num_slots: usize) -> usize {
    num_slots.saturating_mul(2).saturating_add(1024).min(MAX_SLOTS)
}

/// Keys the index holds before it rehashes: 1.875 times the slots, so a full store uses 40% of
/// its buckets, where probes stay short (docs/performance.md). Real memory, capped at 8M keys.
fn index_reserve(num_slots: usize) -> usize {
    (num_slots + num_slots * 7 / 8 + 1024).min(8 << 20)
}

impl BlockStore {
    /// A store of `max_bytes / object_nbytes` slots of `object_nbytes` bytes each.
    pub fn new(max_bytes: usize, object_nbytes: usize) -> Result<Self, StoreError> {
        Self::with_options(max_bytes, object_nbytes, StoreOptions::default())
    }

    /// A store built as `options` say (`chunk_nbytes` must be unset).
    pub fn with_options(
        max_bytes: usize,
        object_nbytes: usize,
        options: StoreOptions,
    ) -> Result<Self, StoreError> {
        if options.chunk_nbytes.is_some() {
            return Err(StoreError::InvalidArgument(
                "chunk_nbytes applies to the variable-size store only".to_owned(),
            ));
        }
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
        let arena = Arena::with_commit(num_slots, object_nbytes, options.prefault)?;
        let mut keys = KeyTable::with_reserve(index_reserve(num_slots), slab_reserve(num_slots))?;
        if options.prefault != Prefault::OnWrite {
            // Committed now, or the first puts fault on the entries every 32 keys.
            keys.slab.commit(num_slots.saturating_add(1024));
        }
        let slots = FixedSlots {
            arena: Some(arena),
            object_nbytes,
            num_slots,
            profile: options.profile,
            free_slots: Vec::new(),
            next_slot: 0,
            reserved: None,
        };
        Ok(Store::from_parts(Core::new(keys), slots))
    }

    /// The store's profile.
    pub fn profile(&self) -> Profile {
        self.alloc.profile
    }

    /// Bytes per object.
    pub fn object_nbytes(&self) -> usize {
        self.alloc.object_nbytes
    }

    /// Objects the store holds at most.
    pub fn num_slots(&self) -> usize {
        self.alloc.num_slots
    }

    /// Copies the payloads of `keys` into `out`, keys to the LRU tail; a miss changes nothing.
    pub fn get_into(&mut self, keys: &[&str], out: &mut [u8]) -> Result<(), StoreError> {
        if self.alloc.arena.is_none() {
            return Err(StoreError::Closed);
        }
        assert_eq!(out.len(), keys.len() * self.alloc.object_nbytes, "output size");
        self.with_scratch(|store, s| store.read_into(s, keys, out))
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
                limit: self.alloc.num_slots,
                hint: self.alloc.profile == Profile::FailClosed,
            });
        }
        self.prefetch_for_read(&s.entries);
        let arena = self.alloc.arena.as_ref().expect("checked open");
        for (chunk, &idx) in out.chunks_exact_mut(self.alloc.object_nbytes).zip(&s.entries) {
            chunk.copy_from_slice(arena.slot(self.core.keys.slab[idx].slot));
        }
        self.core.touch_read(&s.entries);
        self.core.counters.reads += keys.len() as u64;
        self.core.counters.bytes_read += out.len() as u64;
        Ok(())
    }

    /// Starts every miss a read of `entries` takes (slots, LRU links) at once, so they overlap.
    fn prefetch_for_read(&self, entries: &[u32]) {
        let (Some(arena), slab) = (self.alloc.arena.as_ref(), &self.core.keys.slab) else { return };
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

    /// Copies the stored keys' payloads to the front of `out`, missing positions to `missing`.
    pub fn get_many_into(
        &mut self,
        keys: &[&str],
        out: &mut [u8],
        missing: &mut Vec<usize>,
    ) -> Result<usize, StoreError> {
        if self.alloc.arena.is_none() {
            return Err(StoreError::Closed);
        }
        assert_eq!(out.len(), keys.len() * self.alloc.object_nbytes, "output size");
        self.with_scratch(|store, s| {
            store.core.keys.resolve(keys, &mut s.probes, &mut s.entries, None);
            store.prefetch_for_read(&s.entries);
            let (core, object_nbytes) = (&mut store.core, store.alloc.object_nbytes);
            let arena = store.alloc.arena.as_ref().expect("checked open");
            let mut written = 0;
            let first_missing = missing.len();
            for (i, &idx) in s.entries.iter().enumerate() {
                if !core.is_stored(idx) {
                    missing.push(i);
                    continue;
                }
                out[written..written + object_nbytes]
                    .copy_from_slice(arena.slot(core.keys.slab[idx].slot));
                written += object_nbytes;
            }
            core.touch_read(&s.entries);
            let misses = missing.len() - first_missing;
            core.counters.reads += (keys.len() - misses) as u64;
            core.counters.read_misses += misses as u64;
            core.counters.bytes_read += written as u64;
            Ok(written)
        })
    }

    /// The payloads of `keys`, concatenated; see `get_into`.
    pub fn get_concatenated(&mut self, keys: &[&str]) -> Result<Vec<u8>, StoreError> {
        let mut out = vec![0; keys.len() * self.alloc.object_nbytes];
        self.get_into(keys, &mut out)?;
        Ok(out)
    }

    /// Start address and length of the arena, or `None` when closed.
    pub fn arena_span(&self) -> Option<(usize, usize)> {
        self.alloc.arena.as_ref().map(|a| (a.as_ptr() as usize, a.len()))
    }

    /// Occupancy and counters.
    pub fn stats(&self) -> Stats {
        Stats {
            capacity: self.alloc.num_slots,
            stored: self.core.stored,
            referenced: self.core.referenced,
            evictable: self.core.keys.slab.lru_len(),
            free_slots: self.alloc.num_slots - self.core.stored,
            object_nbytes: self.alloc.object_nbytes,
            counters: self.core.counters,
        }
    }
}

impl Allocator for FixedSlots {
    type Meta = ();
    type Report = PutReport;
    type Charge = OneSlot;
    const UNDO: bool = false;
    const REPLACES_STORED: bool = false;

    fn is_open(&self) -> bool {
        self.arena.is_some()
    }

    fn close(&mut self) -> bool {
        self.free_slots = Vec::new();
        self.arena.take().is_some()
    }

    fn admit(&mut self, objects: &[BlockRef<'_>]) -> Result<(), StoreError> {
        if self.arena.is_none() {
            return Err(StoreError::Closed);
        }
        if let Some(bad) = objects.iter().find(|o| o.payload.len() != self.object_nbytes) {
            return Err(StoreError::PayloadSize {
                key: bad.key.to_owned(),
                expected: self.object_nbytes,
                actual: bad.payload.len(),
            });
        }
        self.free_slots.try_reserve(objects.len()).map_err(|_| StoreError::OutOfMemory {
            what: "free slot list",
            bytes: objects.len() * std::mem::size_of::<u32>(),
        })
    }

    fn charge_batch(
        &mut self,
        core: &Core<()>,
        s: &mut Scratch,
        _: &[BlockRef<'_>],
    ) -> Result<(), StoreError> {
        if self.profile == Profile::Grow {
            // vLLM 0.33 replaces a re-put unreferenced object; its bytes stay until it cannot fail
            // (`write_batch`), and counting it as stored gives vLLM's need and LRU order.
            for &(idx, position) in &s.batch {
                if core.keys.slab[idx].is_evictable() {
                    s.replaced.push((idx, position));
                }
            }
        }
        Ok(())
    }

    fn reserve_room(&mut self, core: &Core<()>, s: &Scratch) -> Result<(), StoreError> {
        self.reserved = None;
        if self.profile != Profile::Grow {
            return Ok(());
        }
        let new_keys = core.new_batch_keys(s);
        let need = (core.stored + new_keys).saturating_sub(self.num_slots);
        if need == 0 {
            return Ok(());
        }
        // Each retain and each batch key takes at most one key out of the eligible ones: the
        // common evicting put is decided without counting.
        let floor = core.keys.slab.lru_len().saturating_sub(s.retains.len() + s.batch.len());
        if floor >= need {
            return Ok(());
        }
        let eligible = core.eligible_after_references(s)?;
        if eligible >= need {
            return Ok(());
        }
        let num_slots = grown_size(core.stored + new_keys - eligible, self.num_slots);
        self.map_slots(num_slots)?;
        self.reserved = Some(num_slots);
        Ok(())
    }

    #[inline]
    fn need(&self, core: &Core<()>, placed: &Placement) -> usize {
        (core.stored + placed.new_keys).saturating_sub(self.num_slots)
    }

    fn charges(&self) -> OneSlot {
        OneSlot
    }

    fn refusal(&self) -> StoreError {
        StoreError::CannotRetain { limit: self.num_slots }
    }

    fn make_room(
        &mut self,
        core: &Core<()>,
        placed: &Placement,
        eligible: usize,
    ) -> Result<PutReport, StoreError> {
        if self.profile != Profile::Grow {
            return Err(self.refusal());
        }
        let num_slots = grown_size(core.stored + placed.new_keys - eligible, self.num_slots);
        // `reserve_room` mapped it before the put's reference changes; mapping here is a bug.
        let reserved = self.reserved.take();
        debug_assert_eq!(reserved, Some(num_slots), "reserve_room predicts every growth");
        self.map_slots(num_slots)?;
        self.num_slots = num_slots;
        Ok(PutReport { grown_to: Some(num_slots) })
    }

    fn check(&self, core: &Core<()>) -> Result<(), String> {
        let used = self.next_slot as usize;
        if used > self.num_slots {
            return Err(format!("slots are in range: {used} handed out, {} exist", self.num_slots));
        }
        let mut owner = vec![NIL; used];
        let (stored, referenced) = core.check_entries(|idx, entry| {
            let slot = entry.slot as usize;
            if slot >= used {
                return Err(format!(
                    "slots are in range: {:?} has slot {slot} of {used} handed out",
                    core.keys.slab.key(idx)
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
        core.check_counts(stored, referenced)
    }

    fn grown_to(report: &PutReport) -> Option<usize> {
        report.grown_to
    }

    fn object<'a>(&'a self, entry: &Entry) -> Cow<'a, [u8]> {
        Cow::Borrowed(self.arena.as_ref().expect("checked open").slot(entry.slot))
    }

    #[inline]
    fn free(&mut self, slot: u32, (): ()) {
        self.free_slots.push(slot);
    }

    /// Writes the new keys into free slots and, profile `grow`, replaced keys' bytes in place.
    fn write_batch(
        &mut self,
        core: &mut Core<()>,
        s: &Scratch,
        objects: &[BlockRef<'_>],
    ) -> Written {
        let mut written = Written::default();
        debug_assert_eq!(self.reserved.take(), None, "a growth reserve_room predicted happened");
        let arena = self.arena.as_mut().expect("checked open");
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
            written.add(self.object_nbytes, false);
        }
        for &(idx, position) in &s.replaced {
            // A replaced key this call released may have been evicted.
            if core.keys.slab.is_live(idx) && core.keys.slab[idx].has_slot() {
                arena.write_slot(core.keys.slab[idx].slot, objects[position].payload);
                written.add(self.object_nbytes, true);
            }
        }
        arena.flush_writes();
        written
    }
}

/// As vLLM 0.33: every eligible key goes, and the arena holds the rest, at least doubled.
fn grown_size(kept: usize, num_slots: usize) -> usize {
    kept.max(num_slots * 2)
}

impl FixedSlots {
    /// Maps at least `num_slots` slots, keeping every byte at its slot; `num_slots`, the
    /// capacity the store reports and fills, is the caller's to raise once the put is sure.
    fn map_slots(&mut self, num_slots: usize) -> Result<(), StoreError> {
        if num_slots > MAX_SLOTS {
            return Err(StoreError::CapacityTooLarge {
                num_slots: num_slots as u64,
                object_nbytes: self.object_nbytes as u64,
            });
        }
        let arena = self.arena.as_mut().expect("checked open");
        if arena.num_slots() < num_slots {
            arena.grow(num_slots)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slab::NO_SLOT;

    fn block<'a>(key: &'a str, payload: &'a [u8]) -> BlockRef<'a> {
        BlockRef { key, payload }
    }

    /// Puts `key` retained once, then sets its count directly (2^32 retains would take minutes).
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
        // Retains that are the objects' keys reuse their entries, other orders resolve: alike.
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
        // A rollback that drops a stored key's slot and forgets it, structural counts kept.
        let idx = store.core.keys.lookup("a").unwrap();
        let slot = store.core.keys.slab[idx].slot;
        store.core.keys.slab.unlink(idx);
        store.core.keys.slab[idx].slot = NO_SLOT;
        store.alloc.free_slots.push(slot);
        store.core.stored -= 1;
        store.core.keys.forget(idx);
        let message = store.check().unwrap_err();
        assert!(message.contains("not evicted or replaced is stored"), "{message}");
    }

    #[test]
    fn grow_replaces_in_place_and_keeps_the_ledger() {
        let mut store =
            BlockStore::with_options(2, 1, StoreOptions::default().profile(Profile::Grow)).unwrap();
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
