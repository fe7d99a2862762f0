//! The one put engine under both stores: keys, counts, the LRU, the victim policy, batch dedup
//! and ordering, victim choice, rollback and the entry half of `check()`. Where the contracts
//! differ a phase takes a parameter: what a victim frees (`Charge`) and what a refused put undoes
//! (`UNDO`: false for the fixed store, which keeps vLLM's count changes and so logs nothing).

use std::borrow::Cow;

use crate::digest::Probe;
use crate::error::StoreError;
use crate::keys::{KeyTable, Keyed};
use crate::ledger::Ledger;
use crate::slab::{Entry, Slab, NIL, NO_SLOT, PENDING_SLOT};

/// One object of a batch: a key and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct BlockRef<'a> {
    /// The object's key.
    pub key: &'a str,
    /// The object's bytes.
    pub payload: &'a [u8],
}

/// One call's arguments: its objects, the keys it retains and the keys it releases.
pub type Call<'a> = (&'a [BlockRef<'a>], &'a [&'a str], &'a [&'a str]);

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
    /// LRU entries visited while choosing victims (bounded: docs/semantics.md, "Eviction").
    pub eviction_visits: u64,
}

/// Why keys left the store, for `VictimPolicy::on_remove`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveReason {
    /// Evicted to make room.
    Eviction,
    /// New keys of a refused put.
    Rollback,
}

/// vLLM's `ExpertCachePolicy` contract, the one policy trait of both stores; an `Err` fails the
/// put with its message and leaves the store consistent (docs/semantics.md, "Victim policy").
pub trait VictimPolicy {
    /// After each applied retain (+1) or release (-1), in call order.
    fn on_reference_change(&mut self, key: &str, old: u32, new: u32) -> Result<(), String>;
    /// Exactly `count` distinct keys from `candidates` (oldest first), or `None` to refuse.
    fn select_victims(
        &mut self,
        candidates: &mut dyn Iterator<Item = Cow<'_, str>>,
        count: usize,
    ) -> Result<Option<Vec<String>>, String>;
    /// After keys were evicted, or (`Rollback`) for the new keys of a refused put.
    fn on_remove(&mut self, keys: &[&str], reason: RemoveReason) -> Result<(), String>;
}

// `Entry::mark` during a put: a batch key's position in `Scratch::batch` (`| RELEASED` if this
// call released it, making it a possible victim) or `CHOSEN | i` for `Scratch::victims[i]`. Marks
// of keys outside the call are stale, so every reading confirms the position it names.
const RELEASED: u32 = 1 << 31;
const CHOSEN: u32 = 1 << 30;
const POSITION: u32 = CHOSEN - 1;

/// One LRU change of the put in progress, so a refused put can undo it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Undo {
    /// `idx` left the LRU from between `prev` and `next`.
    Unlinked { idx: u32, prev: u32, next: u32 },
    /// `idx` was appended at the tail.
    Pushed { idx: u32 },
}

/// Vectors reused by every call, so a put allocates only for keys too long for their entry.
#[derive(Debug, Default)]
pub struct Scratch {
    pub(super) probes: Vec<Probe>,
    pub(super) entries: Vec<u32>,
    /// Unique batch keys in first-occurrence order: (entry, index of the last payload).
    pub(super) batch: Vec<(u32, usize)>,
    /// What each unique batch key's new payload takes (variable store: chunks).
    pub(super) charges: Vec<usize>,
    pub(super) retains: Vec<u32>,
    pub(super) releases: Vec<u32>,
    /// Keys whose count reached zero in this call and that are in the LRU, in release order.
    pub(super) released: Vec<u32>,
    /// Released keys that are neither stored nor in the batch: forgotten by the store.
    pub(super) orphans: Vec<u32>,
    pub(super) created: Vec<u32>,
    /// (entry, what its eviction frees).
    pub(super) victims: Vec<(u32, usize)>,
    /// Index hashes of the first victims, kept from `take_victims`'s prefetch to avoid rehashing.
    pub(super) victim_hashes: Vec<u32>,
    /// Profile `grow`: batch keys stored and unreferenced at the start, replaced once it is safe.
    pub(super) replaced: Vec<(u32, usize)>,
    undo: Vec<Undo>,
}

impl Scratch {
    /// Room for a put's scratch, taken first so a refusal of memory refuses the put whole.
    fn reserve(
        &mut self,
        objects: usize,
        retains: usize,
        releases: usize,
    ) -> Result<(), StoreError> {
        fn room<T>(v: &mut Vec<T>, n: usize) -> Result<(), StoreError> {
            v.try_reserve(n).map_err(|_| StoreError::OutOfMemory {
                what: "put's scratch",
                bytes: n.saturating_mul(std::mem::size_of::<T>()),
            })
        }
        let keys = objects + retains + releases;
        room(&mut self.probes, keys.min(crate::keys::RESOLVE_CHUNK))?;
        room(&mut self.entries, objects)?;
        room(&mut self.batch, objects)?;
        room(&mut self.charges, objects)?;
        room(&mut self.retains, retains)?;
        room(&mut self.releases, releases)?;
        room(&mut self.released, releases)?;
        room(&mut self.orphans, releases)?;
        room(&mut self.created, keys)?;
        room(&mut self.victims, objects)?;
        room(&mut self.victim_hashes, objects)?;
        room(&mut self.replaced, objects)?;
        room(&mut self.undo, 2 * keys)
    }

    pub(super) fn clear(&mut self) {
        self.probes.clear();
        self.entries.clear();
        self.batch.clear();
        self.charges.clear();
        self.retains.clear();
        self.releases.clear();
        self.released.clear();
        self.orphans.clear();
        self.created.clear();
        self.victims.clear();
        self.victim_hashes.clear();
        self.replaced.clear();
        self.undo.clear();
    }
}

/// What evicting a key frees, in the units the store's capacity is counted in.
pub trait Charge<M> {
    /// Every key frees one unit (one slot), so the count of victims is the need itself.
    const UNIT: bool;
    /// What evicting `entry` frees: its new payload's charge at batch `position`, else its own.
    fn charge(&self, s: &Scratch, position: Option<usize>, entry: &Entry<M>) -> usize;
}

/// Where a put's keys landed in the LRU.
pub struct Placement {
    /// Keys of the batch that were not stored.
    pub(super) new_keys: usize,
    /// Eligible keys older than the batch, at the LRU front.
    pub(super) older: usize,
}

/// The batch position of `idx`, if it is in the batch and not chosen as a victim.
#[inline]
fn batch_position<M: Copy + Default>(
    slab: &Slab<M>,
    batch: &[(u32, usize)],
    idx: u32,
) -> Option<usize> {
    let mark = slab[idx].mark;
    let position = (mark & POSITION) as usize;
    (mark & CHOSEN == 0 && batch.get(position).is_some_and(|&(i, _)| i == idx)).then_some(position)
}

#[inline]
fn is_chosen<M: Copy + Default>(slab: &Slab<M>, victims: &[(u32, usize)], idx: u32) -> bool {
    let mark = slab[idx].mark;
    mark & CHOSEN != 0
        && mark & RELEASED == 0
        && victims.get((mark & POSITION) as usize).is_some_and(|&(i, _)| i == idx)
}

/// A lazy walk of the keys a put may evict, oldest first, skipping batch keys and chosen ones.
struct Walk<'a, M: Copy + Default> {
    slab: &'a Slab<M>,
    cursor: u32,
    older_left: usize,
    released: &'a [u32],
    victims: &'a [(u32, usize)],
    visited: usize,
}

impl<'a, M: Copy + Default> Walk<'a, M> {
    fn new(slab: &'a Slab<M>, older: usize, s: &'a Scratch) -> Self {
        Self {
            slab,
            cursor: slab.lru_head(),
            older_left: older,
            released: &s.released,
            victims: &s.victims,
            visited: 0,
        }
    }
}

impl<M: Copy + Default> Iterator for Walk<'_, M> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        loop {
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
            if !is_chosen(self.slab, self.victims, idx) {
                self.visited += 1;
                return Some(idx);
            }
        }
    }
}

impl Keyed for BlockRef<'_> {
    #[inline]
    fn key(&self) -> &str {
        self.key
    }
}

/// Whether the objects' keys are `keys`, in order: comparing bytes is cheaper than resolving.
fn same_keys(objects: &[BlockRef<'_>], keys: &[&str]) -> bool {
    objects.len() == keys.len() && objects.iter().zip(keys).all(|(o, k)| o.key == *k)
}

/// What an allocator's `write_batch` wrote, for the core to count: objects written (new keys
/// and replaced ones), how many of them replaced a stored key's bytes, and their bytes.
#[derive(Debug, Default, Clone, Copy)]
pub struct Written {
    pub(super) objects: usize,
    pub(super) replaced: usize,
    pub(super) bytes: u64,
}

impl Written {
    /// One object of `nbytes`, new or (`replaced`) over a stored key's bytes.
    #[inline]
    pub(super) fn add(&mut self, nbytes: usize, replaced: bool) {
        self.objects += 1;
        self.replaced += usize::from(replaced);
        self.bytes += nbytes as u64;
    }
}

/// Keys, counts, the LRU and the figures every store keeps about them.
#[derive(Debug)]
pub struct Core<M> {
    /// Keys to entries: each key's text, count, slot, allocator data (`M`) and LRU links.
    pub(super) keys: KeyTable<M>,
    pub(super) stored: usize,
    pub(super) referenced: usize,
    pub(super) counters: Counters,
    pub(super) ledger: Ledger,
    pub(super) scratch: Scratch,
}

impl<M: Copy + Default> Core<M> {
    pub(super) fn new(keys: KeyTable<M>) -> Self {
        Self {
            keys,
            stored: 0,
            referenced: 0,
            counters: Counters::default(),
            ledger: Ledger::default(),
            scratch: Scratch::default(),
        }
    }

    /// Puts back the scratch a put borrowed out of the core, and counts the put if it succeeded.
    pub(super) fn end_put<T>(
        &mut self,
        mut scratch: Scratch,
        result: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        scratch.clear();
        self.scratch = scratch;
        if result.is_ok() {
            self.counters.puts += 1;
        }
        result
    }

    /// Counts what `write_batch` wrote: a replaced object was stored before and is again.
    pub(super) fn count_written(&mut self, written: Written) {
        self.stored += written.objects - written.replaced;
        self.ledger.replaced += written.replaced as u64;
        self.counters.objects_written += written.objects as u64;
        self.counters.bytes_written += written.bytes;
    }

    pub(super) fn count_references(&mut self, s: &Scratch) {
        self.counters.retains += s.retains.len() as u64;
        self.counters.releases += s.releases.len() as u64;
    }

    /// Frees every key (the store was closed).
    pub(super) fn clear(&mut self) {
        self.keys = KeyTable::with_capacity(0).expect("an empty key table's 16 buckets");
        self.scratch = Scratch::default();
        self.stored = 0;
        self.referenced = 0;
    }

    /// Whether entry `idx` holds an object (not a key that is only referenced or pending).
    #[inline]
    pub(super) fn is_stored(&self, idx: u32) -> bool {
        idx != NIL && !matches!(self.keys.slab[idx].slot, NO_SLOT | PENDING_SLOT)
    }

    pub(super) fn contains(&self, key: &str) -> bool {
        self.keys.lookup(key).is_some_and(|idx| self.is_stored(idx))
    }

    /// Resolves a call's keys once, checks its reference changes and dedupes its batch.
    pub(super) fn resolve_call(
        &mut self,
        s: &mut Scratch,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
    ) -> Result<(), StoreError> {
        s.reserve(objects.len(), retain_keys.len(), release_keys.len())?;
        self.keys.reserve(objects.len() + retain_keys.len() + release_keys.len())?;
        self.keys.resolve(retain_keys, &mut s.probes, &mut s.retains, Some(&mut s.created));
        self.keys.resolve(release_keys, &mut s.probes, &mut s.releases, Some(&mut s.created));
        // A key whose last reference goes joins the LRU: start the misses on its links now.
        for &idx in &s.releases {
            self.keys.slab.prefetch_links(idx);
        }
        if let Err(error) = self.keys.validate_references(&s.retains, &s.releases) {
            self.keys.forget_orphans(&s.created);
            return Err(error);
        }
        if same_keys(objects, retain_keys) {
            // A put that retains exactly its own objects: they were resolved a moment ago.
            s.entries.extend_from_slice(&s.retains);
        } else {
            self.keys.resolve(objects, &mut s.probes, &mut s.entries, Some(&mut s.created));
        }
        s.batch.extend(s.entries.iter().enumerate().map(|(position, &idx)| (idx, position)));
        assert!(s.batch.len() < POSITION as usize, "batch too large");
        self.keys.dedupe_batch(&mut s.batch, &s.releases);
        Ok(())
    }

    #[inline]
    fn lru_unlink<const UNDO: bool>(&mut self, undo: &mut Vec<Undo>, idx: u32) {
        if UNDO {
            let (prev, next) = self.keys.slab.lru_neighbours(idx);
            undo.push(Undo::Unlinked { idx, prev, next });
        }
        self.keys.slab.unlink(idx);
    }

    #[inline]
    fn lru_push_back<const UNDO: bool>(&mut self, undo: &mut Vec<Undo>, idx: u32) {
        self.keys.slab.push_back(idx);
        if UNDO {
            undo.push(Undo::Pushed { idx });
        }
    }

    #[inline]
    fn lru_move_to_back<const UNDO: bool>(&mut self, undo: &mut Vec<Undo>, idx: u32) {
        if self.keys.slab.lru_tail() != idx {
            self.lru_unlink::<UNDO>(undo, idx);
            self.lru_push_back::<UNDO>(undo, idx);
        }
    }

    /// Batch keys not stored yet: `Placement::new_keys`, known before any change.
    pub(super) fn new_batch_keys(&self, s: &Scratch) -> usize {
        s.batch.iter().filter(|&&(idx, _)| !self.keys.slab[idx].has_slot()).count()
    }

    /// The keys a put's victims would be chosen from once its reference changes apply
    /// (`Placement::older` plus the kept released keys), counted before any change, so a put
    /// that must grow can map its arena first (a failure then changes nothing). Those are the
    /// stored keys that end unreferenced outside the batch, and the batch keys released to zero.
    pub(super) fn eligible_after_references(&self, s: &Scratch) -> Result<usize, StoreError> {
        let slab = &self.keys.slab;
        let in_batch = |idx: u32| batch_position(slab, &s.batch, idx).is_some();
        // Stored batch keys that are evictable now: the LRU holds them, the count excludes them.
        let lru_in_batch = s.batch.iter().filter(|&&(idx, _)| slab[idx].is_evictable()).count();
        let mut eligible = (slab.lru_len() - lru_in_batch) as isize;
        // Net change and whether a release touched it, per key; retains apply before releases,
        // so a released key reaches zero exactly when its final count is zero.
        let mut tally: Vec<(u32, i64, bool)> = Vec::new();
        tally.try_reserve_exact(s.retains.len() + s.releases.len()).map_err(|_| {
            StoreError::OutOfMemory {
                what: "put's reference tally",
                bytes: (s.retains.len() + s.releases.len())
                    * std::mem::size_of::<(u32, i64, bool)>(),
            }
        })?;
        tally.extend(s.retains.iter().map(|&idx| (idx, 1, false)));
        tally.extend(s.releases.iter().map(|&idx| (idx, -1, true)));
        tally.sort_unstable_by_key(|&(idx, ..)| idx);
        for run in tally.chunk_by(|a, b| a.0 == b.0) {
            let idx = run[0].0;
            let net: i64 = run.iter().map(|&(_, d, _)| d).sum();
            let released = run.iter().any(|&(.., r)| r);
            let entry = &slab[idx];
            let ends_unreferenced = i64::from(entry.refs) + net == 0;
            if in_batch(idx) {
                eligible += isize::from(released && ends_unreferenced);
            } else if entry.has_slot() {
                eligible += isize::from(ends_unreferenced) - isize::from(entry.refs == 0);
            }
        }
        Ok(eligible.max(0) as usize)
    }

    /// Applies retains, then releases; keys whose count reached zero go to `s.released`.
    pub(super) fn apply_references<const UNDO: bool>(&mut self, s: &mut Scratch) {
        for &idx in &s.retains {
            let entry = &mut self.keys.slab[idx];
            entry.refs += 1;
            if entry.refs == 1 {
                self.referenced += 1;
                if entry.has_slot() {
                    self.lru_unlink::<UNDO>(&mut s.undo, idx);
                }
            }
        }
        for &idx in &s.releases {
            let entry = &mut self.keys.slab[idx];
            debug_assert!(entry.refs > 0, "validated release below zero");
            entry.refs -= 1;
            if entry.refs > 0 {
                continue;
            }
            self.referenced -= 1;
            if entry.has_slot() {
                self.lru_push_back::<UNDO>(&mut s.undo, idx);
            }
            s.released.push(idx);
        }
    }

    /// Moves unreferenced batch keys to the LRU tail in batch order, then released keys in release
    /// order (a finishing request's tail block goes first); unstored ones go to `s.orphans`.
    pub(super) fn order_batch_and_released<const UNDO: bool>(
        &mut self,
        s: &mut Scratch,
    ) -> Placement {
        let mut new_keys = 0usize;
        let mut unreferenced_in_batch = 0usize;
        for i in 0..s.batch.len() {
            let idx = s.batch[i].0;
            let entry = &mut self.keys.slab[idx];
            let was_stored = entry.has_slot();
            if !was_stored {
                entry.slot = PENDING_SLOT;
                new_keys += 1;
            }
            if entry.refs == 0 {
                unreferenced_in_batch += 1;
                if was_stored {
                    self.lru_move_to_back::<UNDO>(&mut s.undo, idx);
                } else {
                    self.lru_push_back::<UNDO>(&mut s.undo, idx);
                }
            }
        }
        let mut released_in_batch = 0usize;
        let mut kept = 0usize;
        for i in 0..s.released.len() {
            let idx = s.released[i];
            if self.keys.slab[idx].has_slot() {
                self.lru_move_to_back::<UNDO>(&mut s.undo, idx);
                s.released[kept] = idx;
                kept += 1;
                if batch_position(&self.keys.slab, &s.batch, idx).is_some() {
                    released_in_batch += 1;
                    self.keys.slab[idx].mark |= RELEASED;
                }
            } else {
                s.orphans.push(idx);
            }
        }
        s.released.truncate(kept);
        // The LRU now reads: older keys, the batch's protected keys, the released keys.
        let protected = unreferenced_in_batch - released_in_batch;
        Placement { new_keys, older: self.keys.slab.lru_len() - protected - kept }
    }

    #[inline]
    fn victim_charge(&self, s: &Scratch, idx: u32, charge: &impl Charge<M>) -> usize {
        charge.charge(s, batch_position(&self.keys.slab, &s.batch, idx), &self.keys.slab[idx])
    }

    /// Victims without a policy: the shortest oldest-first prefix of eligible keys covering `need`.
    pub(super) fn take_victims(
        &mut self,
        s: &mut Scratch,
        older: usize,
        need: usize,
        charge: &impl Charge<M>,
    ) -> bool {
        let mut freed = 0usize;
        let mut cursor = self.keys.slab.lru_head();
        for _ in 0..older {
            if freed >= need {
                break;
            }
            let cost = self.victim_charge(s, cursor, charge);
            s.victims.push((cursor, cost));
            freed += cost;
            cursor = self.keys.slab.lru_next(cursor);
        }
        for i in 0..s.released.len() {
            if freed >= need {
                break;
            }
            let idx = s.released[i];
            let cost = self.victim_charge(s, idx, charge);
            s.victims.push((idx, cost));
            freed += cost;
        }
        self.counters.eviction_visits += s.victims.len() as u64;
        // The walk read only the dense links: prefetch the victims' entries, then their buckets.
        for &(victim, _) in &s.victims {
            self.keys.slab.prefetch(victim);
        }
        for &(victim, _) in &s.victims[s.victim_hashes.len()..] {
            let hash = self.keys.slab.hash(victim);
            self.keys.index.prefetch(hash);
            s.victim_hashes.push(hash);
        }
        freed >= need
    }

    /// Victims from a policy, asked each round for what the LRU order would still take; checked.
    pub(super) fn ask_victims<C: Charge<M>>(
        &mut self,
        s: &mut Scratch,
        older: usize,
        need: usize,
        policy: &mut dyn VictimPolicy,
        charge: &C,
        refused: &StoreError,
    ) -> Result<(), StoreError> {
        let mut freed = 0usize;
        while freed < need {
            let count = if C::UNIT {
                need - freed
            } else {
                let (mut count, mut covered) = (0usize, freed);
                let mut walk = Walk::new(&self.keys.slab, older, s);
                for idx in walk.by_ref() {
                    if covered >= need {
                        break;
                    }
                    covered += self.victim_charge(s, idx, charge);
                    count += 1;
                }
                self.counters.eviction_visits += walk.visited as u64;
                if covered < need {
                    return Err(refused.clone());
                }
                count
            };
            let slab = &self.keys.slab;
            let mut walk = Walk::new(slab, older, s);
            let chosen = {
                let mut keys = walk.by_ref().map(|idx| slab.key(idx));
                policy.select_victims(&mut keys, count)
            };
            self.counters.eviction_visits += walk.visited as u64;
            let chosen = chosen.map_err(StoreError::Policy)?.ok_or_else(|| refused.clone())?;
            if chosen.len() != count {
                return Err(refused.clone());
            }
            for key in &chosen {
                let idx = self.keys.lookup(key).ok_or_else(|| refused.clone())?;
                let slab = &self.keys.slab;
                let eligible = slab[idx].is_evictable()
                    && !is_chosen(slab, &s.victims, idx)
                    && batch_position(slab, &s.batch, idx)
                        .is_none_or(|_| slab[idx].mark & RELEASED != 0);
                if !eligible {
                    return Err(refused.clone());
                }
                let cost = self.victim_charge(s, idx, charge);
                self.keys.slab[idx].mark = CHOSEN | s.victims.len() as u32;
                s.victims.push((idx, cost));
                freed += cost;
            }
        }
        Ok(())
    }

    /// Replays the call's count changes to a policy, forward or (`undone`) newest first.
    pub(super) fn notify_reference_changes(
        &self,
        s: &Scratch,
        policy: &mut dyn VictimPolicy,
        undone: bool,
    ) -> Result<(), StoreError> {
        let slab = &self.keys.slab;
        crate::references::replay(
            &s.retains,
            &s.releases,
            undone,
            |idx| slab[idx].refs,
            |idx, old, new| {
                policy.on_reference_change(&slab.key(idx), old, new).map_err(StoreError::Policy)
            },
        )
    }

    /// The keys of the batch's new (pending) entries, for a policy's `Rollback`.
    pub(super) fn pending_keys(&self, s: &Scratch) -> Vec<String> {
        let slab = &self.keys.slab;
        s.batch
            .iter()
            .filter(|&&(idx, _)| slab[idx].slot == PENDING_SLOT)
            .map(|&(idx, _)| slab.key(idx).into_owned())
            .collect()
    }

    /// Undoes a refused put: with `UNDO` every LRU move and count change, without only the new keys
    /// (counts stay, as vLLM keeps them). Created entries are left to the caller.
    pub(super) fn roll_back<const UNDO: bool>(
        &mut self,
        s: &mut Scratch,
        referenced_before: usize,
    ) {
        s.victims.clear();
        s.victim_hashes.clear();
        if !UNDO {
            for &(idx, _) in &s.batch {
                let entry = &mut self.keys.slab[idx];
                if entry.slot != PENDING_SLOT {
                    continue;
                }
                entry.slot = NO_SLOT;
                if entry.refs == 0 {
                    self.keys.slab.unlink(idx);
                    self.keys.forget(idx);
                }
            }
            return;
        }
        let slab = &mut self.keys.slab;
        while let Some(change) = s.undo.pop() {
            match change {
                Undo::Pushed { idx } => slab.unlink(idx),
                Undo::Unlinked { idx, prev, next } => slab.relink(idx, prev, next),
            }
        }
        for &(idx, _) in &s.batch {
            if slab[idx].slot == PENDING_SLOT {
                slab[idx].slot = NO_SLOT;
            }
        }
        for &idx in &s.releases {
            slab[idx].refs += 1;
        }
        for &idx in &s.retains {
            slab[idx].refs -= 1;
        }
        self.referenced = referenced_before;
    }

    /// A refused put: rolled back, counted and told to the policy, created entries forgotten.
    pub(super) fn refuse<const UNDO: bool>(
        &mut self,
        s: &mut Scratch,
        referenced_before: usize,
        error: StoreError,
        policy: Option<&mut dyn VictimPolicy>,
    ) -> StoreError {
        let refused =
            matches!(error, StoreError::CannotRetain { .. } | StoreError::CannotRetainBytes { .. });
        let policy = policy.filter(|_| refused);
        let new_keys = if policy.is_some() { self.pending_keys(s) } else { Vec::new() };
        self.roll_back::<UNDO>(s, referenced_before);
        let mut error = error;
        if refused {
            self.counters.capacity_errors += 1;
        }
        if let Some(policy) = policy {
            let keys: Vec<&str> = new_keys.iter().map(String::as_str).collect();
            let heard = match keys.is_empty() {
                true => Ok(()),
                false => {
                    policy.on_remove(&keys, RemoveReason::Rollback).map_err(StoreError::Policy)
                }
            };
            let heard = match UNDO {
                true => heard.and_then(|()| self.notify_reference_changes(s, policy, true)),
                false => heard,
            };
            if let Err(failed) = heard {
                error = failed;
            }
        }
        self.keys.forget_orphans(&s.created);
        error
    }

    /// Evicts `s.victims`, handing each stored one's slot and data to `free`; returns their keys.
    pub(super) fn evict_victims(
        &mut self,
        s: &Scratch,
        keep_keys: bool,
        mut free: impl FnMut(u32, M),
    ) -> Vec<String> {
        let mut removed = Vec::new();
        for (i, &(idx, _)) in s.victims.iter().enumerate() {
            // Hashed by `take_victims`; a policy's victims are hashed here.
            let hash = s.victim_hashes.get(i).copied().unwrap_or_else(|| self.keys.slab.hash(idx));
            debug_assert_eq!(hash, self.keys.slab.hash(idx));
            let entry = &self.keys.slab[idx];
            debug_assert!(entry.is_evictable());
            if keep_keys {
                removed.push(self.keys.slab.key(idx).into_owned());
            }
            let (slot, meta) = (entry.slot, entry.meta);
            self.keys.slab.unlink(idx);
            self.keys.slab[idx].slot = NO_SLOT;
            self.counters.evictions += 1;
            self.keys.forget_hashed(idx, hash);
            if slot != PENDING_SLOT {
                self.stored -= 1;
                self.ledger.evicted_stored += 1;
                free(slot, meta);
            }
        }
        removed
    }

    /// Before `write_batch`: the batch positions it will write (live pending keys, and the
    /// stored keys it replaces), in batch order.
    pub(super) fn writes_ahead<A: super::Allocator<Meta = M>>(
        &self,
        s: &Scratch,
        written: &mut Vec<usize>,
    ) {
        let slab = &self.keys.slab;
        let mut replaced = s.replaced.iter().peekable();
        for &(idx, position) in &s.batch {
            let in_place = replaced.next_if(|&&(r, _)| r == idx).is_some();
            if !slab.is_live(idx) {
                continue;
            }
            let entry = &slab[idx];
            if entry.slot == PENDING_SLOT || (entry.has_slot() && (A::REPLACES_STORED || in_place))
            {
                written.push(position);
            }
        }
    }

    /// Tells a policy of the evicted keys; the put is applied, so it counts if the policy fails.
    pub(super) fn report_evicted(
        &mut self,
        policy: &mut dyn VictimPolicy,
        removed: &[String],
    ) -> Result<(), StoreError> {
        if removed.is_empty() {
            return Ok(());
        }
        let keys: Vec<&str> = removed.iter().map(String::as_str).collect();
        policy.on_remove(&keys, RemoveReason::Eviction).map_err(|error| {
            self.counters.puts += 1;
            StoreError::Policy(error)
        })
    }

    /// After a read: moves each evictable key read (`NIL`: missing) to the LRU tail, in order.
    pub(super) fn touch_read(&mut self, entries: &[u32]) {
        for &idx in entries {
            if self.is_stored(idx) && self.keys.slab[idx].refs == 0 {
                self.keys.slab.move_to_back(idx);
            }
        }
    }

    /// The entry half of `check()`, `stored_entry` per stored entry; returns (stored, referenced).
    pub(super) fn check_entries(
        &self,
        mut stored_entry: impl FnMut(u32, &Entry<M>) -> Result<(), String>,
    ) -> Result<(usize, usize), String> {
        self.keys.validate()?;
        let (mut stored, mut referenced) = (0usize, 0usize);
        for idx in self.keys.slab.live_indices() {
            let entry = &self.keys.slab[idx];
            if entry.slot == PENDING_SLOT {
                let key = self.keys.slab.key(idx);
                return Err(format!("no put is in progress: {key:?} is pending"));
            }
            if entry.refs > 0 {
                referenced += 1;
            }
            if entry.has_slot() {
                stored_entry(idx, entry)?;
                stored += 1;
            } else if entry.refs == 0 {
                return Err(format!(
                    "counts are >= 1 where present: {:?} is neither stored nor referenced",
                    self.keys.slab.key(idx)
                ));
            }
        }
        Ok((stored, referenced))
    }

    /// `check()`'s closing equations: the ledger, and the counters against the contents.
    pub(super) fn check_counts(&self, stored: usize, referenced: usize) -> Result<(), String> {
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
