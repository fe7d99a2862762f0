//! The store: keys, reference counts, the LRU of evictable keys, and the arena.
//!
//! Semantics are SPEC section 2 (`fail-closed`). The one idea that matters for speed: only
//! evictable keys (stored, unreferenced) are in the LRU, so an evicting put walks victims, never
//! the keys that running requests hold.

use crate::arena::{Arena, Prefault};
use crate::error::StoreError;
use crate::keys::{KeyTable, NOT_IN_BATCH};
use crate::slab::{Slab, INLINE_KEY_BYTES, NIL, NO_SLOT, PENDING_SLOT};

/// One object of a batch: a key and exactly `object_nbytes` bytes.
#[derive(Debug, Clone, Copy)]
pub struct BlockRef<'a> {
    /// The object's key.
    pub key: &'a str,
    /// The object's bytes.
    pub payload: &'a [u8],
}

/// Monotonic counters, for `stats()`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Successful `put` calls.
    pub puts: u64,
    /// Objects copied into slots.
    pub objects_written: u64,
    /// Applied retains (+1 each).
    pub retains: u64,
    /// Applied releases (-1 each).
    pub releases: u64,
    /// Keys evicted.
    pub evictions: u64,
    /// Puts refused with `cannot retain`.
    pub capacity_errors: u64,
    /// Arena growths (profile `grow`).
    pub growths: u64,
    /// Objects read.
    pub reads: u64,
    /// Reads refused because a key was not stored.
    pub read_misses: u64,
    /// Payload bytes copied into the arena.
    pub bytes_written: u64,
    /// Payload bytes copied out of the arena.
    pub bytes_read: u64,
    /// LRU entries visited while choosing victims (the seed's "no rescan" property).
    pub eviction_visits: u64,
}

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

/// Scratch vectors reused by every call, so a put allocates only for new keys' text.
#[derive(Debug, Default)]
struct Scratch {
    hashes: Vec<u32>,
    /// Entries of the keys being resolved (a batch's keys, a read's keys), in call order.
    entries: Vec<u32>,
    /// Unique batch keys in first-occurrence order: (entry, index of the last payload).
    batch: Vec<(u32, usize)>,
    retains: Vec<u32>,
    releases: Vec<u32>,
    /// Keys whose count reached zero in this call, in release order.
    released: Vec<u32>,
    /// Entries created by this call, freed again when validation fails.
    created: Vec<u32>,
    victims: Vec<u32>,
    /// Profile `grow`: batch keys stored and unreferenced when the call started, whose bytes
    /// are replaced in place once the put is sure to succeed.
    replaced: Vec<(u32, usize)>,
}

impl Scratch {
    fn clear(&mut self) {
        self.hashes.clear();
        self.entries.clear();
        self.batch.clear();
        self.retains.clear();
        self.releases.clear();
        self.released.clear();
        self.created.clear();
        self.victims.clear();
        self.replaced.clear();
    }
}

/// Where a put's keys landed in the LRU.
struct Placement {
    /// Keys of the batch that were not stored.
    new_keys: usize,
    /// Eligible keys older than the batch, at the LRU front.
    older: usize,
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

/// Why keys left the store, for `VictimPolicy::on_remove`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveReason {
    /// Evicted to make room.
    Eviction,
    /// New keys of a refused put.
    Rollback,
}

/// vLLM's `ExpertCachePolicy` contract, the one policy trait of both stores. An `Err` fails the
/// put with that message; the store stays consistent.
///
/// The fixed store asks `select_victims` once for the number of keys it must evict. The
/// variable store, whose budget is bytes, asks for the number of keys the LRU order would take
/// to cover what is still missing, and asks again while the keys chosen free too little; a put
/// it refuses changes nothing, and the policy then hears each reference change undone (old and
/// new swapped), newest first.
pub trait VictimPolicy {
    /// After each applied retain (+1) or release (-1), in call order.
    fn on_reference_change(&mut self, key: &str, old: u32, new: u32) -> Result<(), String>;
    /// Exactly `count` distinct keys from `candidates` (eligible keys, oldest first, none
    /// chosen yet), or `None` to refuse the put. Only on the policy's path: a call per
    /// candidate through `dyn` costs nothing next to the policy's own code.
    fn select_victims(
        &mut self,
        candidates: &mut dyn Iterator<Item = &str>,
        count: usize,
    ) -> Result<Option<Vec<String>>, String>;
    /// After keys were evicted, or (`Rollback`) for the new keys of a refused put.
    fn on_remove(&mut self, keys: &[&str], reason: RemoveReason) -> Result<(), String>;
}

/// A lazy walk of the keys a put may evict, oldest first: the LRU's older keys, then the keys
/// this put released. The batch's own keys are skipped without being visited.
pub struct Candidates<'a> {
    slab: &'a Slab,
    cursor: u32,
    older_left: usize,
    released: &'a [u32],
    visited: usize,
}

impl<'a> Iterator for Candidates<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let idx = if self.older_left > 0 {
            self.older_left -= 1;
            let idx = self.cursor;
            self.cursor = self.slab.lru_next(idx);
            idx
        } else {
            let (&idx, rest) = self.released.split_first()?;
            self.released = rest;
            idx
        };
        self.visited += 1;
        Some(self.slab[idx].key())
    }
}

/// A bounded block store with reference counts and O(1) eviction of unreferenced keys.
#[derive(Debug)]
pub struct BlockStore {
    arena: Option<Arena>,
    object_nbytes: usize,
    num_slots: usize,
    profile: Profile,
    /// Keys to entries (the one key table, shared with the variable store): the entries hold
    /// each key's text, count, slot and LRU links.
    keys: KeyTable<(), INLINE_KEY_BYTES>,
    /// Slots released by eviction, reused before fresh ones so touched pages are reused.
    free_slots: Vec<u32>,
    /// Slots below this were handed out at least once; above it the arena is untouched.
    next_slot: u32,
    stored: usize,
    referenced: usize,
    counters: Counters,
    /// Ledger for `check()`: stored objects removed by eviction, and objects whose bytes a
    /// `grow` re-put replaced in place. Every object written and not yet removed is stored, so
    /// `stored == objects_written - evicted_stored - replaced`: a stored key lost any other way
    /// (a rollback forgetting it) breaks the equation.
    ledger: crate::ledger::Ledger,
    scratch: Scratch,
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

/// Keys the index holds before it rehashes: 1.25 times the slots (its buckets are written at
/// construction, so this is real memory: 8 bytes a bucket, 10-21 bytes a slot after rounding
/// to a power of two), capped at 8M keys (128 MiB of buckets). A store past that rehashes once.
fn index_reserve(num_slots: usize) -> usize {
    (num_slots + num_slots / 4 + 1024).min(8 << 20)
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
        let mut keys = KeyTable::with_reserve(index_reserve(num_slots), slab_reserve(num_slots));
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
            keys,
            free_slots: Vec::new(),
            next_slot: 0,
            stored: 0,
            referenced: 0,
            counters: Counters::default(),
            ledger: crate::ledger::Ledger::default(),
            scratch: Scratch::default(),
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
            self.keys = KeyTable::with_capacity(0);
            self.free_slots = Vec::new();
            self.scratch = Scratch::default();
            self.stored = 0;
            self.referenced = 0;
        }
    }

    /// Stores a batch and applies reference changes, evicting as needed (SPEC section 2).
    ///
    /// Validation comes first: a wrong-sized payload or a release below zero returns an error
    /// and changes nothing.
    pub fn put(
        &mut self,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
    ) -> Result<PutReport, StoreError> {
        self.put_with_policy(objects, retain_keys, release_keys, None)
    }

    /// `put`, with a victim policy consulted for reference changes, victims and removals.
    pub fn put_with_policy(
        &mut self,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
        policy: Option<&mut dyn VictimPolicy>,
    ) -> Result<PutReport, StoreError> {
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
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = self.put_inner(&mut scratch, objects, retain_keys, release_keys, policy);
        scratch.clear();
        self.scratch = scratch;
        if result.is_ok() {
            self.counters.puts += 1;
        }
        result
    }

    fn put_inner(
        &mut self,
        s: &mut Scratch,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
        mut policy: Option<&mut dyn VictimPolicy>,
    ) -> Result<PutReport, StoreError> {
        // Resolve every key to an entry once. Entries created here are unreferenced and have no
        // slot, so they are invisible until something below gives them a count or a slot.
        self.keys.resolve(retain_keys, &mut s.hashes, &mut s.retains, Some(&mut s.created));
        self.keys.resolve(release_keys, &mut s.hashes, &mut s.releases, Some(&mut s.created));
        if let Err(error) = self.keys.validate_references(&s.retains, &s.releases) {
            self.keys.forget_orphans(&s.created);
            return Err(error);
        }
        let keys: Vec<&str> = objects.iter().map(|o| o.key).collect();
        self.keys.resolve(&keys, &mut s.hashes, &mut s.entries, Some(&mut s.created));
        s.batch.extend(s.entries.iter().enumerate().map(|(position, &idx)| (idx, position)));
        self.keys.dedupe_batch(&mut s.batch, &s.releases);
        if self.profile == Profile::Grow {
            // vLLM 0.33 replaces a re-put object that nothing references. The old bytes stay in
            // their slot until the put cannot fail any more (`write_batch`), so a refused put
            // leaves them readable. Counting the key as stored rather than dropped and re-added
            // gives the same `need`, LRU order and growth size as vLLM.
            for &(idx, position) in &s.batch {
                if self.keys.slab[idx].is_evictable() {
                    s.replaced.push((idx, position));
                }
            }
        }
        for &idx in &s.retains {
            self.retain(idx);
        }
        for &idx in &s.releases {
            if self.release(idx) {
                s.released.push(idx);
            }
        }
        if let Some(policy) = policy.as_deref_mut() {
            if let Err(error) = self.notify_reference_changes(s, policy) {
                self.keys.forget_orphans(&s.created);
                self.keys.forget_orphans(&s.released);
                return Err(error);
            }
        }
        let placed = self.order_batch_and_released(s);
        let need = (self.stored + placed.new_keys).saturating_sub(self.num_slots);
        let mut report = PutReport::default();
        if need > 0 {
            let eligible = placed.older + s.released.len();
            if eligible >= need {
                match policy.as_deref_mut() {
                    None => self.take_victims(s, placed.older, need),
                    Some(policy) => {
                        if let Err(error) = self.ask_victims(s, placed.older, need, policy) {
                            return Err(self.refuse_batch(s, error, Some(policy)));
                        }
                    }
                }
            } else if self.profile == Profile::Grow {
                // As vLLM 0.33: every eligible key goes, and the arena holds what is left,
                // at least doubled.
                let num_slots = (self.stored + placed.new_keys - eligible).max(self.num_slots * 2);
                if let Err(error) = self.grow_arena(num_slots) {
                    return Err(self.refuse_batch(s, error, policy));
                }
                report.grown_to = Some(num_slots);
                self.take_victims(s, placed.older, eligible);
            } else {
                let error = StoreError::CannotRetain { limit: self.num_slots };
                return Err(self.refuse_batch(s, error, policy));
            }
        }
        let removed = self.evict_victims(s, policy.is_some());
        self.write_batch(s, objects);
        if let Some(policy) = policy {
            if !removed.is_empty() {
                let keys: Vec<&str> = removed.iter().map(String::as_str).collect();
                if let Err(error) = policy.on_remove(&keys, RemoveReason::Eviction) {
                    // The put is applied (its victims are gone, its objects written): it counts
                    // as one, and the policy's exception is raised after it.
                    self.counters.puts += 1;
                    return Err(StoreError::Policy(error));
                }
            }
        }
        Ok(report)
    }

    /// Whether `idx` is a batch key that this call did not release: such keys are never victims.
    #[inline]
    fn is_protected(&self, s: &Scratch, idx: u32) -> bool {
        let mark = self.keys.slab[idx].mark as usize;
        // Marks of entries outside this call are stale, so confirm the position.
        mark < s.batch.len() && s.batch[mark].0 == idx
    }

    /// Moves unreferenced batch keys to the LRU tail in batch order (new ones enter as pending),
    /// then released keys in release order, so a finishing request's tail block (released first)
    /// goes first. Released keys that are neither stored nor in the batch are forgotten, and
    /// `s.released` keeps only the ones in the LRU.
    fn order_batch_and_released(&mut self, s: &mut Scratch) -> Placement {
        let mut new_keys = 0usize;
        let mut unreferenced_in_batch = 0usize;
        for &(idx, _) in &s.batch {
            let entry = &mut self.keys.slab[idx];
            let was_stored = entry.has_slot();
            if !was_stored {
                entry.slot = PENDING_SLOT;
                new_keys += 1;
            }
            if entry.refs == 0 {
                unreferenced_in_batch += 1;
                if was_stored {
                    self.keys.slab.move_to_back(idx);
                } else {
                    self.keys.slab.push_back(idx);
                }
            }
        }
        let mut released_in_batch = 0usize;
        let mut kept = 0usize;
        for i in 0..s.released.len() {
            let idx = s.released[i];
            if self.keys.slab[idx].has_slot() {
                self.keys.slab.move_to_back(idx);
                s.released[kept] = idx;
                kept += 1;
                if self.is_protected(s, idx) {
                    released_in_batch += 1;
                    self.keys.slab[idx].mark = NOT_IN_BATCH;
                }
            } else {
                self.keys.forget(idx);
            }
        }
        s.released.truncate(kept);
        // The LRU now reads: older keys, the batch's protected keys, the released keys.
        let protected = unreferenced_in_batch - released_in_batch;
        Placement { new_keys, older: self.keys.slab.lru_len() - protected - kept }
    }

    /// Victims without a policy: the oldest keys, then released ones. The walk touches victims
    /// only, however many keys are referenced.
    fn take_victims(&mut self, s: &mut Scratch, older: usize, count: usize) {
        let mut cursor = self.keys.slab.lru_head();
        for _ in 0..count.min(older) {
            s.victims.push(cursor);
            cursor = self.keys.slab.lru_next(cursor);
        }
        let from_released = count - s.victims.len();
        s.victims.extend_from_slice(&s.released[..from_released]);
        self.counters.eviction_visits += count as u64;
        // The walk read only the dense links; fetch the victims' entries and index buckets all
        // at once.
        for &victim in &s.victims {
            self.keys.slab.prefetch(victim);
            self.keys.index.prefetch(self.keys.slab.hash(victim));
        }
    }

    /// Victims chosen by a policy from a lazy walk of the eligible keys, checked to be exactly
    /// `count` distinct eligible keys.
    fn ask_victims(
        &mut self,
        s: &mut Scratch,
        older: usize,
        count: usize,
        policy: &mut dyn VictimPolicy,
    ) -> Result<(), StoreError> {
        let mut candidates = Candidates {
            slab: &self.keys.slab,
            cursor: self.keys.slab.lru_head(),
            older_left: older,
            released: &s.released,
            visited: 0,
        };
        let chosen = policy.select_victims(&mut candidates, count);
        self.counters.eviction_visits += candidates.visited as u64;
        let refused = StoreError::CannotRetain { limit: self.num_slots };
        let chosen = chosen.map_err(StoreError::Policy)?.ok_or(refused.clone())?;
        if chosen.len() != count {
            return Err(refused);
        }
        for key in &chosen {
            let idx = self.keys.find(key, self.keys.hash_key(key)).ok_or(refused.clone())?;
            if !self.keys.slab[idx].is_evictable() || self.is_protected(s, idx) {
                return Err(refused);
            }
            s.victims.push(idx);
        }
        let mut sorted = s.victims.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            s.victims.clear();
            return Err(refused);
        }
        Ok(())
    }

    /// Evicts `s.victims`; returns their keys when a policy wants to hear of them.
    fn evict_victims(&mut self, s: &Scratch, keep_keys: bool) -> Vec<String> {
        let mut removed = Vec::new();
        for &victim in &s.victims {
            if keep_keys {
                removed.push(self.keys.slab[victim].key().to_owned());
            }
            self.evict(victim);
        }
        removed
    }

    /// A refused put stores none of its new keys; its count changes and LRU moves stay. The
    /// policy hears of the rolled-back keys when the store refused (not when the policy failed).
    fn refuse_batch(
        &mut self,
        s: &mut Scratch,
        error: StoreError,
        policy: Option<&mut dyn VictimPolicy>,
    ) -> StoreError {
        if matches!(error, StoreError::CannotRetain { .. }) {
            self.counters.capacity_errors += 1;
        }
        s.victims.clear();
        let rolled_back: Vec<String> = s
            .batch
            .iter()
            .filter(|&&(idx, _)| self.keys.slab[idx].slot == PENDING_SLOT)
            .map(|&(idx, _)| self.keys.slab[idx].key().to_owned())
            .collect();
        self.roll_back_new_keys(s);
        if let (Some(policy), StoreError::CannotRetain { .. }) = (policy, &error) {
            if !rolled_back.is_empty() {
                let keys: Vec<&str> = rolled_back.iter().map(String::as_str).collect();
                if let Err(message) = policy.on_remove(&keys, RemoveReason::Rollback) {
                    return StoreError::Policy(message);
                }
            }
        }
        error
    }

    fn notify_reference_changes(
        &self,
        s: &Scratch,
        policy: &mut dyn VictimPolicy,
    ) -> Result<(), StoreError> {
        let slab = &self.keys.slab;
        crate::references::replay(
            &s.retains,
            &s.releases,
            false,
            |idx| slab[idx].refs,
            |idx, old, new| {
                policy.on_reference_change(slab[idx].key(), old, new).map_err(StoreError::Policy)
            },
        )
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
        self.counters.growths += 1;
        Ok(())
    }

    #[inline]
    fn retain(&mut self, idx: u32) {
        let entry = &mut self.keys.slab[idx];
        entry.refs += 1;
        if entry.refs == 1 {
            self.referenced += 1;
            if entry.has_slot() {
                self.keys.slab.unlink(idx);
            }
        }
        self.counters.retains += 1;
    }

    /// Returns whether the count reached zero.
    #[inline]
    fn release(&mut self, idx: u32) -> bool {
        let entry = &mut self.keys.slab[idx];
        debug_assert!(entry.refs > 0, "validated release below zero");
        entry.refs -= 1;
        self.counters.releases += 1;
        if entry.refs > 0 {
            return false;
        }
        self.referenced -= 1;
        if entry.has_slot() {
            self.keys.slab.push_back(idx);
        }
        true
    }

    /// Removes an evictable key (stored, or pending in this put).
    fn evict(&mut self, idx: u32) {
        let slot = self.keys.slab[idx].slot;
        debug_assert!(self.keys.slab[idx].is_evictable());
        self.keys.slab.unlink(idx);
        if slot != PENDING_SLOT {
            self.free_slots.push(slot);
            self.stored -= 1;
            self.ledger.evicted_stored += 1;
        }
        self.keys.slab[idx].slot = NO_SLOT;
        self.counters.evictions += 1;
        self.keys.forget(idx);
    }

    /// A refused put stores none of its new keys.
    fn roll_back_new_keys(&mut self, s: &Scratch) {
        for &(idx, _) in &s.batch {
            let entry = &self.keys.slab[idx];
            if entry.slot != PENDING_SLOT {
                continue;
            }
            let unreferenced = entry.refs == 0;
            if unreferenced {
                self.keys.slab.unlink(idx);
            }
            self.keys.slab[idx].slot = NO_SLOT;
            if unreferenced {
                self.keys.forget(idx);
            }
        }
    }

    /// Writes the batch's new keys into free slots and, profile `grow`, the replaced keys'
    /// new bytes into their own slots (those that were not evicted by this call).
    fn write_batch(&mut self, s: &Scratch, objects: &[BlockRef<'_>]) {
        let arena = self.arena.as_mut().expect("checked open");
        for &(idx, position) in &s.batch {
            let entry = &mut self.keys.slab[idx];
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
            self.stored += 1;
            self.counters.objects_written += 1;
            self.counters.bytes_written += self.object_nbytes as u64;
        }
        for &(idx, position) in &s.replaced {
            // A replaced key this call released may have been evicted; its entry is gone then.
            if self.keys.slab.is_live(idx) && self.keys.slab[idx].has_slot() {
                arena.write_slot(self.keys.slab[idx].slot, objects[position].payload);
                self.ledger.replaced += 1;
                self.counters.objects_written += 1;
                self.counters.bytes_written += self.object_nbytes as u64;
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
        let mut s = std::mem::take(&mut self.scratch);
        let result = self.read_into(&mut s, keys, out);
        s.clear();
        self.scratch = s;
        result
    }

    fn read_into(
        &mut self,
        s: &mut Scratch,
        keys: &[&str],
        out: &mut [u8],
    ) -> Result<(), StoreError> {
        self.keys.resolve(keys, &mut s.hashes, &mut s.entries, None);
        let missing = s.entries.iter().position(|&idx| {
            idx == NIL || matches!(self.keys.slab[idx].slot, NO_SLOT | PENDING_SLOT)
        });
        if let Some(at) = missing {
            self.counters.read_misses += 1;
            return Err(StoreError::Missing {
                key: keys[at].to_owned(),
                used: self.stored,
                limit: self.num_slots,
                hint: self.profile == Profile::FailClosed,
            });
        }
        self.prefetch_for_read(&s.entries);
        let arena = self.arena.as_ref().expect("checked open");
        for (chunk, &idx) in out.chunks_exact_mut(self.object_nbytes).zip(&s.entries) {
            chunk.copy_from_slice(arena.slot(self.keys.slab[idx].slot));
        }
        for &idx in &s.entries {
            if self.keys.slab[idx].refs == 0 {
                self.keys.slab.move_to_back(idx);
            }
        }
        self.counters.reads += keys.len() as u64;
        self.counters.bytes_read += out.len() as u64;
        Ok(())
    }

    /// Starts the cache misses a read of `entries` will take after `resolve`: each stored key's
    /// slot, and for an evictable one the LRU links its move to the tail rewrites. Cold keys (a
    /// finished request's) miss at each; started together, the misses overlap instead of coming
    /// one after the other (the interleaving of a hash join).
    fn prefetch_for_read(&self, entries: &[u32]) {
        let (Some(arena), slab) = (self.arena.as_ref(), &self.keys.slab) else { return };
        let stored = |idx: u32| idx != NIL && !matches!(slab[idx].slot, NO_SLOT | PENDING_SLOT);
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
        let mut s = std::mem::take(&mut self.scratch);
        self.keys.resolve(keys, &mut s.hashes, &mut s.entries, None);
        self.prefetch_for_read(&s.entries);
        let arena = self.arena.as_ref().expect("checked open");
        let mut written = 0;
        let first_missing = missing.len();
        for (i, &idx) in s.entries.iter().enumerate() {
            if idx == NIL || matches!(self.keys.slab[idx].slot, NO_SLOT | PENDING_SLOT) {
                missing.push(i);
                continue;
            }
            out[written..written + self.object_nbytes]
                .copy_from_slice(arena.slot(self.keys.slab[idx].slot));
            written += self.object_nbytes;
        }
        for &idx in &s.entries {
            if idx != NIL && self.keys.slab[idx].slot != NO_SLOT && self.keys.slab[idx].refs == 0 {
                self.keys.slab.move_to_back(idx);
            }
        }
        let misses = missing.len() - first_missing;
        self.counters.reads += (keys.len() - misses) as u64;
        self.counters.read_misses += misses as u64;
        self.counters.bytes_read += written as u64;
        s.clear();
        self.scratch = s;
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
            stored: self.stored,
            referenced: self.referenced,
            evictable: self.keys.slab.lru_len(),
            free_slots: self.num_slots - self.stored,
            object_nbytes: self.object_nbytes,
            counters: self.counters,
        }
    }

    /// Evictable keys, oldest first. For tests and debugging: O(n).
    pub fn lru_keys(&self) -> Vec<&str> {
        self.keys.lru_keys()
    }

    /// Every key with a reference count above zero, with its count, in no particular order.
    pub fn references(&self) -> Vec<(&str, u32)> {
        self.keys.references()
    }

    /// Every stored key with its bytes, in no particular order. Touches no LRU position.
    pub fn objects(&self) -> Vec<(&str, &[u8])> {
        let Some(arena) = self.arena.as_ref() else {
            return Vec::new();
        };
        self.keys
            .slab
            .live_indices()
            .map(|idx| &self.keys.slab[idx])
            .filter(|e| e.has_slot())
            .map(|e| (e.key(), arena.slot(e.slot)))
            .collect()
    }

    /// The reference count of `key` (0 when unknown).
    pub fn reference_count(&self, key: &str) -> u32 {
        self.keys.reference_count(key)
    }

    /// Whether `key` is stored.
    pub fn contains(&self, key: &str) -> bool {
        self.keys
            .find(key, self.keys.hash_key(key))
            .is_some_and(|idx| self.keys.slab[idx].has_slot())
    }

    /// Checks every invariant of SPEC section 11; the error names the broken one.
    pub fn check(&self) -> Result<(), String> {
        if self.arena.is_none() {
            return Ok(());
        }
        self.keys.slab.validate()?;
        let used = self.next_slot as usize;
        if used > self.num_slots {
            return Err(format!("slots are in range: {used} handed out, {} exist", self.num_slots));
        }
        let mut owner = vec![NIL; used];
        let mut stored = 0usize;
        let mut referenced = 0usize;
        let mut indexed = 0usize;
        for idx in self.keys.slab.live_indices() {
            let entry = &self.keys.slab[idx];
            if self.keys.find(entry.key(), self.keys.slab.hash(idx)) != Some(idx) {
                return Err(format!(
                    "every key has one entry: {:?} is not found by its key",
                    entry.key()
                ));
            }
            if self.keys.slab.hash(idx) != self.keys.hash_key(entry.key()) {
                return Err(format!("every key has one entry: {:?} has a stale hash", entry.key()));
            }
            indexed += 1;
            if entry.slot == PENDING_SLOT {
                return Err(format!("no put is in progress: {:?} is pending", entry.key()));
            }
            if entry.refs > 0 {
                referenced += 1;
            }
            if entry.has_slot() {
                let slot = entry.slot as usize;
                if slot >= used {
                    return Err(format!(
                        "slots are in range: {:?} has slot {slot} of {used} handed out",
                        entry.key()
                    ));
                }
                if owner[slot] != NIL {
                    return Err(format!("slots are unique: slot {slot} is held twice"));
                }
                owner[slot] = idx;
                stored += 1;
            } else if entry.refs == 0 {
                return Err(format!(
                    "counts are >= 1 where present: {:?} is neither stored nor referenced",
                    entry.key()
                ));
            }
        }
        if indexed != self.keys.index.len() {
            return Err(format!(
                "every key has one entry: {} indexed, {indexed} live",
                self.keys.index.len()
            ));
        }
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
        self.ledger.check(self.counters.objects_written, stored)?;
        if stored != self.stored || referenced != self.referenced {
            return Err(format!(
                "counters match contents: stored {stored} vs {}, referenced {referenced} vs {}",
                self.stored, self.referenced
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block<'a>(key: &'a str, payload: &'a [u8]) -> BlockRef<'a> {
        BlockRef { key, payload }
    }

    /// Puts `key` retained once, then sets its count to `count` directly (2^32 real retains
    /// would take minutes).
    fn store_with_count(key: &str, count: u32) -> BlockStore {
        let mut store = BlockStore::new(4, 1).unwrap();
        store.put(&[block(key, b"a")], &[key], &[]).unwrap();
        let idx = store.keys.lookup(key).unwrap();
        store.keys.slab[idx].refs = count;
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
    fn check_catches_a_stored_key_lost_outside_eviction() {
        let mut store = BlockStore::new(4, 1).unwrap();
        store.put(&[block("a", b"1"), block("b", b"2")], &[], &[]).unwrap();
        store.check().unwrap();
        // What the old `grow` rollback did: drop a stored key's slot and forget the entry, with
        // every structural count kept consistent.
        let idx = store.keys.lookup("a").unwrap();
        let slot = store.keys.slab[idx].slot;
        store.keys.slab.unlink(idx);
        store.keys.slab[idx].slot = NO_SLOT;
        store.free_slots.push(slot);
        store.stored -= 1;
        store.keys.forget(idx);
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
