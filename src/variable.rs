//! The variable-size store (SPEC section 13): objects of any size, zero included, under one byte
//! budget, with reference counts and an LRU of evictable keys.
//!
//! It shares the fixed store's pieces (the key index, the slab and its intrusive LRU, the
//! arena) and differs where the contract does:
//! - capacity is in bytes, counted in chunks of `chunk_nbytes` (see `chunks.rs`): an object of
//!   `n` bytes takes `ceil(n / chunk_nbytes)` of the `max_bytes / chunk_nbytes` chunks;
//! - a batch key that is stored is replaced by its new payload (the size may change), whether or
//!   not it is referenced;
//! - a put that cannot be held changes nothing at all: its count changes and LRU moves are
//!   undone (from a log of the moves, newest first) along with everything else.
//!
//! Eviction walks the LRU from the front, past the victims only: the keys running requests hold
//! are not in it, and the batch's own keys sit in one block that the walk jumps over. It stops at
//! the first prefix whose chunks cover the shortfall; since objects need not be contiguous, that
//! prefix always makes room.

use crate::arena::Prefault;
use crate::chunks::{ChunkArena, EMPTY_CHAIN, MAX_CHUNKS};
use crate::error::StoreError;
use crate::keys::KeyTable;
use crate::slab::{Entry, Slab, NIL, NO_SLOT, PENDING_SLOT};
use crate::store::{BlockRef, Counters, RemoveReason, VictimPolicy};

/// Key bytes kept inside a variable-store entry: vLLM's logprob keys
/// (`vllm-logprobs/v1/{generation}/{fingerprint}/{block hash}/{token}`) are 110-130 bytes.
pub const VARIABLE_INLINE_KEY_BYTES: usize = 159;

/// Entries carry the payload length (`u32`) and keys up to 159 bytes inline: three cache lines.
type Keys = KeyTable<u32, VARIABLE_INLINE_KEY_BYTES>;
type VariableSlab = Slab<u32, VARIABLE_INLINE_KEY_BYTES>;

const _: () = assert!(std::mem::size_of::<Entry<u32, VARIABLE_INLINE_KEY_BYTES>>() == 192);

/// The chunk size of a store of 1 MiB or more: the unused tail of an object's last chunk
/// averages 128 bytes, about 4% of a 3 KB logprob block.
pub const DEFAULT_CHUNK_NBYTES: usize = 256;

/// Smaller stores use smaller chunks so that they still have this many (small test stores count
/// exact bytes).
const MIN_DEFAULT_CHUNKS: usize = 4096;

/// The arena has this fraction more chunks than the budget (1/16): room the allocator uses to
/// keep objects in one piece. At 100% the free space is only what the last eviction freed, and
/// under churn with reads objects split into more and more pieces (3.7 per object after 12,000
/// W2-shaped batches); with 1/32 or more they stay whole (1.00 after 30,000). The budget, and so
/// every eviction, is unchanged.
pub const SLACK_DIVISOR: usize = 16;

/// The largest payload: lengths are kept in 32 bits. A larger one can never be held.
pub const MAX_OBJECT_NBYTES: usize = u32::MAX as usize;

/// The chunk size a store of `max_bytes` gets by default: `DEFAULT_CHUNK_NBYTES`, halved until
/// the store has at least 4,096 chunks (down to 1 byte, i.e. exact byte accounting).
pub fn default_chunk_nbytes(max_bytes: usize) -> usize {
    let mut chunk = DEFAULT_CHUNK_NBYTES;
    while chunk > 1 && max_bytes / chunk < MIN_DEFAULT_CHUNKS {
        chunk /= 2;
    }
    chunk
}

/// Occupancy and counters of a variable-size store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VariableStats {
    /// Bytes the store may hold: `capacity_chunks * chunk_nbytes`.
    pub capacity_bytes: usize,
    /// Bytes per chunk.
    pub chunk_nbytes: usize,
    /// Keys stored.
    pub stored: usize,
    /// Payload bytes stored (the sum of the stored objects' lengths).
    pub stored_bytes: u64,
    /// Bytes of the chunks the stored objects take.
    pub used_bytes: usize,
    /// Keys with a reference count above zero (stored or not).
    pub referenced: usize,
    /// Keys stored and unreferenced (the LRU's length).
    pub evictable: usize,
    /// Counters since construction (`growths` stays 0).
    pub counters: Counters,
}

/// A read resolved under the lock: where each key's bytes go in the output. Filled by
/// `plan_read`; `read_planned` copies it while the store is unchanged.
#[derive(Debug, Default)]
pub struct ReadPlan {
    hashes: Vec<u32>,
    entries: Vec<u32>,
    offsets: Vec<usize>,
    missing: Vec<usize>,
    version: u64,
}

impl ReadPlan {
    /// Bytes the read returns.
    pub fn total(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// `keys.len() + 1` offsets: key `i`'s bytes are `offsets[i]..offsets[i + 1]` of the output,
    /// an empty range for a missing key.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Positions (in `keys`) of the keys that are not stored, in order.
    pub fn missing(&self) -> &[usize] {
        &self.missing
    }
}

/// One LRU change of the put in progress, so a refused put can undo it.
#[derive(Debug, Clone, Copy)]
enum Undo {
    /// `idx` left the LRU from between `prev` and `next`.
    Unlinked { idx: u32, prev: u32, next: u32 },
    /// `idx` was appended at the tail.
    Pushed { idx: u32 },
}

/// Scratch vectors reused by every call.
#[derive(Debug, Default)]
struct Scratch {
    hashes: Vec<u32>,
    entries: Vec<u32>,
    /// Unique batch keys in first-occurrence order: (entry, index of the last payload).
    batch: Vec<(u32, usize)>,
    /// Chunks each unique batch key's new payload takes.
    charges: Vec<usize>,
    retains: Vec<u32>,
    releases: Vec<u32>,
    /// Keys whose count reached zero in this call and that are in the LRU, in release order.
    released: Vec<u32>,
    /// Released keys that are neither stored nor in the batch: forgotten if the put succeeds.
    orphans: Vec<u32>,
    /// Entries created by this call.
    created: Vec<u32>,
    /// (entry, chunks its eviction frees).
    victims: Vec<(u32, usize)>,
    undo: Vec<Undo>,
}

impl Scratch {
    fn clear(&mut self) {
        self.hashes.clear();
        self.entries.clear();
        self.batch.clear();
        self.charges.clear();
        self.retains.clear();
        self.releases.clear();
        self.released.clear();
        self.orphans.clear();
        self.created.clear();
        self.victims.clear();
        self.undo.clear();
    }
}

// `Entry::mark` during a put: a batch key's position in `Scratch::batch` (with `RELEASED` when
// this call released it, which makes it a possible victim), or `CHOSEN | i` for the victim at
// `Scratch::victims[i]`. Marks of keys outside the call are stale, so every reading confirms
// the position it names.
const RELEASED: u32 = 1 << 31;
const CHOSEN: u32 = 1 << 30;
const POSITION: u32 = CHOSEN - 1;

/// The batch position of `idx`, if it is in the batch and not chosen as a victim.
#[inline]
fn batch_position(slab: &VariableSlab, batch: &[(u32, usize)], idx: u32) -> Option<usize> {
    let mark = slab[idx].mark;
    let position = (mark & POSITION) as usize;
    (mark & CHOSEN == 0 && batch.get(position).is_some_and(|&(i, _)| i == idx)).then_some(position)
}

#[inline]
fn is_chosen(slab: &VariableSlab, victims: &[(u32, usize)], idx: u32) -> bool {
    let mark = slab[idx].mark;
    mark & CHOSEN != 0
        && mark & RELEASED == 0
        && victims.get((mark & POSITION) as usize).is_some_and(|&(i, _)| i == idx)
}

/// A lazy walk of the keys a put may evict, oldest first: the LRU's older keys, then the keys
/// this put released; the batch's own keys are skipped without being visited, and so are keys
/// already chosen.
struct Walk<'a> {
    slab: &'a VariableSlab,
    cursor: u32,
    older_left: usize,
    released: &'a [u32],
    victims: &'a [(u32, usize)],
    visited: usize,
}

impl<'a> Walk<'a> {
    fn new(slab: &'a VariableSlab, older: usize, s: &'a Scratch) -> Self {
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

impl Iterator for Walk<'_> {
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

/// A bounded store of variable-size objects with reference counts and O(1) eviction of
/// unreferenced keys.
#[derive(Debug)]
pub struct VariableStore {
    chunks: Option<ChunkArena>,
    chunk_nbytes: usize,
    capacity_chunks: usize,
    keys: Keys,
    stored: usize,
    stored_bytes: u64,
    used_chunks: usize,
    referenced: usize,
    counters: Counters,
    /// Ledger for `check()`, as the fixed store's: stored objects removed by eviction, and
    /// objects whose chain a re-put replaced. `stored == objects_written - evicted_stored -
    /// replaced`: a stored key lost any other way breaks the equation.
    ledger: crate::ledger::Ledger,
    /// Changes whenever a put may have changed entries or chains, so a read planned under one
    /// lock can be copied under the next only if nothing changed in between.
    version: u64,
    scratch: Scratch,
}

impl VariableStore {
    /// A store of `max_bytes` with the default chunk size.
    pub fn new(max_bytes: usize) -> Result<Self, StoreError> {
        Self::with_options(max_bytes, None, false)
    }

    /// A store of `max_bytes` counted in chunks of `chunk_nbytes` (default:
    /// `default_chunk_nbytes`); with `prefault` the arena is committed now.
    pub fn with_options(
        max_bytes: usize,
        chunk_nbytes: Option<usize>,
        prefault: bool,
    ) -> Result<Self, StoreError> {
        let prefault = if prefault { Prefault::Now } else { Prefault::OnWrite };
        Self::with_commit(max_bytes, chunk_nbytes, prefault)
    }

    /// As `with_options`, with the arena's pages committed as `prefault` says.
    pub fn with_commit(
        max_bytes: usize,
        chunk_nbytes: Option<usize>,
        prefault: Prefault,
    ) -> Result<Self, StoreError> {
        if max_bytes == 0 {
            return Err(StoreError::InvalidArgument(
                "auxiliary output store max_bytes must be positive".to_owned(),
            ));
        }
        let chunk_nbytes = chunk_nbytes.unwrap_or_else(|| default_chunk_nbytes(max_bytes));
        if chunk_nbytes == 0 {
            return Err(StoreError::InvalidArgument(
                "auxiliary output store chunk size must be positive".to_owned(),
            ));
        }
        if chunk_nbytes > max_bytes {
            return Err(StoreError::InvalidArgument(format!(
                "auxiliary output store must fit at least one chunk of chunk_nbytes={chunk_nbytes}"
            )));
        }
        let capacity_chunks = max_bytes / chunk_nbytes;
        if capacity_chunks > MAX_CHUNKS {
            return Err(StoreError::CapacityTooLarge {
                num_slots: capacity_chunks as u64,
                object_nbytes: chunk_nbytes as u64,
            });
        }
        let arena_chunks = capacity_chunks + capacity_chunks / SLACK_DIVISOR;
        if arena_chunks > MAX_CHUNKS {
            return Err(StoreError::CapacityTooLarge {
                num_slots: arena_chunks as u64,
                object_nbytes: chunk_nbytes as u64,
            });
        }
        let chunks = ChunkArena::with_commit(arena_chunks, chunk_nbytes, prefault)?;
        // Sized for about one key per eight chunks (3 KB objects); the index grows if needed.
        let reserve = (capacity_chunks / 8).clamp(16, 1 << 20);
        Ok(Self {
            chunks: Some(chunks),
            chunk_nbytes,
            capacity_chunks,
            keys: Keys::with_capacity(reserve),
            stored: 0,
            stored_bytes: 0,
            used_chunks: 0,
            referenced: 0,
            counters: Counters::default(),
            ledger: crate::ledger::Ledger::default(),
            version: 0,
            scratch: Scratch::default(),
        })
    }

    /// Bytes per chunk.
    pub fn chunk_nbytes(&self) -> usize {
        self.chunk_nbytes
    }

    /// Bytes the store holds at most: whole chunks of `max_bytes`.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity_chunks * self.chunk_nbytes
    }

    /// Whether `close` was called.
    pub fn is_closed(&self) -> bool {
        self.chunks.is_none()
    }

    /// Frees the arena and every key; later calls fail with `Closed`. Idempotent.
    pub fn close(&mut self) {
        if self.chunks.take().is_some() {
            self.keys = Keys::with_capacity(0);
            self.scratch = Scratch::default();
            self.stored = 0;
            self.stored_bytes = 0;
            self.used_chunks = 0;
            self.referenced = 0;
            self.version += 1;
        }
    }

    #[inline]
    fn chunks_for(&self, nbytes: usize) -> usize {
        nbytes.div_ceil(self.chunk_nbytes)
    }

    /// Whether entry `idx` holds an object (not a key that is only referenced or pending).
    #[inline]
    fn is_stored(&self, idx: u32) -> bool {
        !matches!(self.keys.slab[idx].slot, NO_SLOT | PENDING_SLOT)
    }

    /// Stores a batch and applies reference changes, evicting as needed (SPEC section 13).
    /// Bad input (a release below zero) and a batch that cannot be held change nothing.
    pub fn put(
        &mut self,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
    ) -> Result<(), StoreError> {
        self.put_with_policy(objects, retain_keys, release_keys, None)
    }

    /// `put`, with a victim policy consulted for reference changes, victims and removals.
    pub fn put_with_policy(
        &mut self,
        objects: &[BlockRef<'_>],
        retain_keys: &[&str],
        release_keys: &[&str],
        policy: Option<&mut dyn VictimPolicy>,
    ) -> Result<(), StoreError> {
        if self.chunks.is_none() {
            return Err(StoreError::Closed);
        }
        self.version += 1;
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
    ) -> Result<(), StoreError> {
        // Resolve every key once; entries created here are invisible until they get a count or
        // a slot, and are forgotten again if the call fails.
        self.keys.resolve(retain_keys, &mut s.hashes, &mut s.retains, Some(&mut s.created));
        self.keys.resolve(release_keys, &mut s.hashes, &mut s.releases, Some(&mut s.created));
        if let Err(error) = self.keys.validate_references(&s.retains, &s.releases) {
            self.keys.forget_orphans(&s.created);
            return Err(error);
        }
        let keys: Vec<&str> = objects.iter().map(|o| o.key).collect();
        self.keys.resolve(&keys, &mut s.hashes, &mut s.entries, Some(&mut s.created));
        s.batch.extend(s.entries.iter().enumerate().map(|(position, &idx)| (idx, position)));
        assert!(s.batch.len() < POSITION as usize, "batch too large");
        self.keys.dedupe_batch(&mut s.batch, &s.releases);
        let refused = StoreError::CannotRetainBytes { limit: self.capacity_bytes() };
        if s.batch.iter().any(|&(_, position)| objects[position].payload.len() > MAX_OBJECT_NBYTES)
        {
            self.keys.forget_orphans(&s.created);
            self.counters.capacity_errors += 1;
            return Err(refused);
        }
        s.charges.extend(s.batch.iter().map(|&(_, p)| self.chunks_for(objects[p].payload.len())));
        // Chunks in use once the batch replaces what it replaces.
        let replaced: usize = s
            .batch
            .iter()
            .filter(|&&(idx, _)| self.is_stored(idx))
            .map(|&(idx, _)| self.chunks_for(self.keys.slab[idx].meta as usize))
            .sum();
        let used_after = self.used_chunks - replaced + s.charges.iter().sum::<usize>();

        let referenced_before = self.referenced;
        for i in 0..s.retains.len() {
            self.retain(s, s.retains[i]);
        }
        for i in 0..s.releases.len() {
            let idx = s.releases[i];
            if self.release(s, idx) {
                s.released.push(idx);
            }
        }
        if let Some(policy) = policy.as_deref_mut() {
            if let Err(error) = self.notify_reference_changes(s, policy, false) {
                self.roll_back(s, referenced_before);
                self.keys.forget_orphans(&s.created);
                return Err(error);
            }
        }
        let older = self.order_batch_and_released(s);
        let need = used_after.saturating_sub(self.capacity_chunks);
        if need > 0 {
            let chosen = match policy.as_deref_mut() {
                None => self.take_victims(s, older, need),
                Some(policy) => self.ask_victims(s, older, need, policy),
            };
            if let Err(error) = chosen {
                return Err(self.refuse(s, referenced_before, error, policy));
            }
        }
        let removed = self.commit(s, objects, policy.is_some());
        self.counters.retains += s.retains.len() as u64;
        self.counters.releases += s.releases.len() as u64;
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
        Ok(())
    }

    fn lru_unlink(&mut self, s: &mut Scratch, idx: u32) {
        let (prev, next) = self.keys.slab.lru_neighbours(idx);
        self.keys.slab.unlink(idx);
        s.undo.push(Undo::Unlinked { idx, prev, next });
    }

    fn lru_push_back(&mut self, s: &mut Scratch, idx: u32) {
        self.keys.slab.push_back(idx);
        s.undo.push(Undo::Pushed { idx });
    }

    fn lru_move_to_back(&mut self, s: &mut Scratch, idx: u32) {
        if self.keys.slab.lru_tail() != idx {
            self.lru_unlink(s, idx);
            self.lru_push_back(s, idx);
        }
    }

    fn retain(&mut self, s: &mut Scratch, idx: u32) {
        let entry = &mut self.keys.slab[idx];
        entry.refs += 1;
        if entry.refs == 1 {
            self.referenced += 1;
            if entry.has_slot() {
                self.lru_unlink(s, idx);
            }
        }
    }

    /// Returns whether the count reached zero.
    fn release(&mut self, s: &mut Scratch, idx: u32) -> bool {
        let entry = &mut self.keys.slab[idx];
        debug_assert!(entry.refs > 0, "validated release below zero");
        entry.refs -= 1;
        if entry.refs > 0 {
            return false;
        }
        self.referenced -= 1;
        if entry.has_slot() {
            self.lru_push_back(s, idx);
        }
        true
    }

    /// Moves unreferenced batch keys to the LRU tail in batch order (new ones enter as pending),
    /// then released keys in release order. Released keys that are neither stored nor in the
    /// batch wait in `s.orphans`; `s.released` keeps the ones in the LRU. Returns how many
    /// eligible keys are older than the batch, at the LRU front.
    fn order_batch_and_released(&mut self, s: &mut Scratch) -> usize {
        let mut unreferenced_in_batch = 0usize;
        for i in 0..s.batch.len() {
            let idx = s.batch[i].0;
            let entry = &mut self.keys.slab[idx];
            let was_stored = entry.has_slot();
            if !was_stored {
                entry.slot = PENDING_SLOT;
            }
            if entry.refs == 0 {
                unreferenced_in_batch += 1;
                if was_stored {
                    self.lru_move_to_back(s, idx);
                } else {
                    self.lru_push_back(s, idx);
                }
            }
        }
        let mut released_in_batch = 0usize;
        let mut kept = 0usize;
        for i in 0..s.released.len() {
            let idx = s.released[i];
            if self.keys.slab[idx].has_slot() {
                self.lru_move_to_back(s, idx);
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
        self.keys.slab.lru_len() - protected - kept
    }

    /// Chunks that evicting `idx` frees: its new payload's if it is in the batch, else its own.
    #[inline]
    fn charge(&self, s: &Scratch, idx: u32) -> usize {
        match batch_position(&self.keys.slab, &s.batch, idx) {
            Some(position) => s.charges[position],
            None => self.chunks_for(self.keys.slab[idx].meta as usize),
        }
    }

    /// Victims without a policy: the shortest prefix of the eligible keys, oldest first, whose
    /// chunks cover `need`. The walk visits those keys and no other.
    fn take_victims(
        &mut self,
        s: &mut Scratch,
        older: usize,
        need: usize,
    ) -> Result<(), StoreError> {
        let mut freed = 0usize;
        let mut cursor = self.keys.slab.lru_head();
        for _ in 0..older {
            if freed >= need {
                break;
            }
            let charge = self.charge(s, cursor);
            s.victims.push((cursor, charge));
            freed += charge;
            cursor = self.keys.slab.lru_next(cursor);
        }
        for i in 0..s.released.len() {
            if freed >= need {
                break;
            }
            let idx = s.released[i];
            let charge = self.charge(s, idx);
            s.victims.push((idx, charge));
            freed += charge;
        }
        self.counters.eviction_visits += s.victims.len() as u64;
        if freed < need {
            return Err(StoreError::CannotRetainBytes { limit: self.capacity_bytes() });
        }
        for &(victim, _) in &s.victims {
            self.keys.slab.prefetch(victim);
        }
        Ok(())
    }

    /// Victims chosen by a policy, each round from a lazy walk of the eligible keys not chosen
    /// yet, for as many keys as the LRU order would still take; checked to be that many
    /// distinct eligible keys.
    fn ask_victims(
        &mut self,
        s: &mut Scratch,
        older: usize,
        need: usize,
        policy: &mut dyn VictimPolicy,
    ) -> Result<(), StoreError> {
        let refused = StoreError::CannotRetainBytes { limit: self.capacity_bytes() };
        let mut freed = 0usize;
        while freed < need {
            let (mut count, mut covered) = (0usize, freed);
            let mut walk = Walk::new(&self.keys.slab, older, s);
            for idx in walk.by_ref() {
                if covered >= need {
                    break;
                }
                covered += self.charge(s, idx);
                count += 1;
            }
            self.counters.eviction_visits += walk.visited as u64;
            if covered < need {
                return Err(refused);
            }
            let slab = &self.keys.slab;
            let mut walk = Walk::new(slab, older, s);
            let chosen = {
                let mut keys = walk.by_ref().map(|idx| slab[idx].key());
                policy.select_victims(&mut keys, count)
            };
            self.counters.eviction_visits += walk.visited as u64;
            let chosen = chosen.map_err(StoreError::Policy)?.ok_or(refused.clone())?;
            if chosen.len() != count {
                return Err(refused);
            }
            for key in &chosen {
                let idx = self.keys.lookup(key).ok_or(refused.clone())?;
                let slab = &self.keys.slab;
                let eligible = slab[idx].is_evictable()
                    && !is_chosen(slab, &s.victims, idx)
                    && batch_position(slab, &s.batch, idx)
                        .is_none_or(|_| slab[idx].mark & RELEASED != 0);
                if !eligible {
                    return Err(refused);
                }
                let charge = self.charge(s, idx);
                self.keys.slab[idx].mark = CHOSEN | s.victims.len() as u32;
                s.victims.push((idx, charge));
                freed += charge;
            }
        }
        Ok(())
    }

    /// Undoes everything the put in progress did: LRU moves newest first, pending slots and
    /// counts. The entries it created are left for the caller to forget (a policy may still
    /// need their keys).
    fn roll_back(&mut self, s: &mut Scratch, referenced_before: usize) {
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
        s.victims.clear();
    }

    /// A refused put: everything undone; a policy hears of the new keys (`Rollback`) and of each
    /// count change undone, unless it caused the refusal by failing.
    fn refuse(
        &mut self,
        s: &mut Scratch,
        referenced_before: usize,
        error: StoreError,
        policy: Option<&mut dyn VictimPolicy>,
    ) -> StoreError {
        let new_keys: Vec<String> = match (&policy, &error) {
            (Some(_), StoreError::CannotRetainBytes { .. }) => s
                .batch
                .iter()
                .filter(|&&(idx, _)| self.keys.slab[idx].slot == PENDING_SLOT)
                .map(|&(idx, _)| self.keys.slab[idx].key().to_owned())
                .collect(),
            _ => Vec::new(),
        };
        self.roll_back(s, referenced_before);
        let error = match (policy, error) {
            (Some(policy), error @ StoreError::CannotRetainBytes { .. }) => {
                self.counters.capacity_errors += 1;
                let keys: Vec<&str> = new_keys.iter().map(String::as_str).collect();
                let removed = if keys.is_empty() {
                    Ok(())
                } else {
                    policy.on_remove(&keys, RemoveReason::Rollback).map_err(StoreError::Policy)
                };
                removed
                    .and_then(|()| self.notify_reference_changes(s, policy, true))
                    .err()
                    .unwrap_or(error)
            }
            (None, error @ StoreError::CannotRetainBytes { .. }) => {
                self.counters.capacity_errors += 1;
                error
            }
            (_, error) => error,
        };
        self.keys.forget_orphans(&s.created);
        error
    }

    /// Replays the call's count changes to a policy, each with its old and new value: forward
    /// (the counts are final now) or, with `undone`, backward, newest first (the counts are the
    /// original ones again).
    fn notify_reference_changes(
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
                policy.on_reference_change(slab[idx].key(), old, new).map_err(StoreError::Policy)
            },
        )
    }

    /// Applies a put that fits: evicts the victims, frees the chains of replaced keys, then
    /// writes every batch key that was not evicted. Returns the victims' keys when a policy
    /// wants to hear of them.
    fn commit(&mut self, s: &Scratch, objects: &[BlockRef<'_>], keep_keys: bool) -> Vec<String> {
        let chunks = self.chunks.as_mut().expect("checked open");
        let mut removed = Vec::new();
        for &(victim, _) in &s.victims {
            let entry = &self.keys.slab[victim];
            debug_assert!(entry.is_evictable());
            if keep_keys {
                removed.push(entry.key().to_owned());
            }
            let (slot, nbytes) = (entry.slot, entry.meta as usize);
            self.keys.slab.unlink(victim);
            if slot != PENDING_SLOT {
                chunks.free(slot, nbytes);
                self.stored -= 1;
                self.stored_bytes -= nbytes as u64;
                self.used_chunks -= nbytes.div_ceil(self.chunk_nbytes);
                self.ledger.evicted_stored += 1;
            }
            self.keys.slab[victim].slot = NO_SLOT;
            self.counters.evictions += 1;
            self.keys.forget(victim);
        }
        // Free every replaced chain before writing any, so the writes always find their room.
        for &(idx, _) in &s.batch {
            if !self.keys.slab.is_live(idx) {
                continue; // evicted above
            }
            let entry = &mut self.keys.slab[idx];
            if entry.slot != PENDING_SLOT {
                let nbytes = entry.meta as usize;
                chunks.free(entry.slot, nbytes);
                entry.slot = PENDING_SLOT;
                self.stored -= 1;
                self.stored_bytes -= nbytes as u64;
                self.used_chunks -= nbytes.div_ceil(self.chunk_nbytes);
                self.ledger.replaced += 1;
            }
        }
        for (&(idx, position), &charge) in s.batch.iter().zip(&s.charges) {
            if !self.keys.slab.is_live(idx) {
                continue;
            }
            let payload = objects[position].payload;
            let entry = &mut self.keys.slab[idx];
            entry.slot = chunks.store(payload);
            entry.meta = payload.len() as u32;
            self.stored += 1;
            self.stored_bytes += payload.len() as u64;
            self.used_chunks += charge;
            self.counters.objects_written += 1;
            self.counters.bytes_written += payload.len() as u64;
        }
        chunks.flush_writes();
        debug_assert!(self.used_chunks <= self.capacity_chunks);
        self.keys.forget_orphans(&s.orphans);
        self.keys.forget_orphans(&s.created);
        removed
    }

    /// Resolves `keys` for a read, without touching the LRU: where each stored key's bytes go
    /// in the output, and which keys are missing.
    pub fn plan_read(&mut self, keys: &[&str], plan: &mut ReadPlan) -> Result<(), StoreError> {
        if self.chunks.is_none() {
            return Err(StoreError::Closed);
        }
        plan.entries.clear();
        plan.offsets.clear();
        plan.missing.clear();
        self.keys.resolve(keys, &mut plan.hashes, &mut plan.entries, None);
        let mut total = 0usize;
        plan.offsets.push(0);
        for i in 0..plan.entries.len() {
            let idx = plan.entries[i];
            if idx == NIL || !self.is_stored(idx) {
                plan.entries[i] = NIL;
                plan.missing.push(i);
            } else {
                total += self.keys.slab[idx].meta as usize;
            }
            plan.offsets.push(total);
        }
        plan.version = self.version;
        Ok(())
    }

    /// Copies a planned read into `out` (`plan.total()` bytes) and moves each evictable key read
    /// to the LRU tail, in order. Returns `false`, copying nothing, if a put ran since the plan.
    pub fn read_planned(&mut self, plan: &ReadPlan, out: &mut [u8]) -> Result<bool, StoreError> {
        let Some(chunks) = self.chunks.as_ref() else {
            return Err(StoreError::Closed);
        };
        if plan.version != self.version {
            return Ok(false);
        }
        assert_eq!(out.len(), plan.total(), "output size");
        let slab = &self.keys.slab;
        for (i, &idx) in plan.entries.iter().enumerate() {
            if idx != NIL {
                chunks.read(slab[idx].slot, &mut out[plan.offsets[i]..plan.offsets[i + 1]]);
            }
        }
        for &idx in &plan.entries {
            if idx != NIL && self.keys.slab[idx].refs == 0 {
                self.keys.slab.move_to_back(idx);
            }
        }
        self.counters.reads += (plan.entries.len() - plan.missing.len()) as u64;
        self.counters.read_misses += plan.missing.len() as u64;
        self.counters.bytes_read += out.len() as u64;
        Ok(true)
    }

    /// The error for a read that needs every key and planned some missing (counted as a miss).
    pub fn missing_error(&mut self, keys: &[&str], plan: &ReadPlan) -> StoreError {
        self.counters.read_misses += 1;
        let first = plan.missing.first().copied().expect("a key is missing");
        StoreError::MissingObject {
            key: keys[first].to_owned(),
            used: self.stored_bytes as usize,
            limit: self.capacity_bytes(),
        }
    }

    /// The payloads of `keys`, concatenated, and where each one starts; a key that is not
    /// stored fails with `MissingObject` and changes nothing. Reads move evictable keys to the
    /// LRU tail.
    pub fn get_concatenated(&mut self, keys: &[&str]) -> Result<Vec<u8>, StoreError> {
        let mut plan = ReadPlan::default();
        self.plan_read(keys, &mut plan)?;
        if !plan.missing.is_empty() {
            return Err(self.missing_error(keys, &plan));
        }
        let mut out = vec![0; plan.total()];
        self.read_planned(&plan, &mut out)?;
        Ok(out)
    }

    /// The payloads of the stored keys among `keys`, concatenated in order, and the plan that
    /// says where each key's bytes are (`offsets`) and which keys are missing (`missing`).
    /// Missing keys touch nothing.
    pub fn get_many(&mut self, keys: &[&str]) -> Result<(Vec<u8>, ReadPlan), StoreError> {
        let mut plan = ReadPlan::default();
        self.plan_read(keys, &mut plan)?;
        let mut out = vec![0; plan.total()];
        self.read_planned(&plan, &mut out)?;
        Ok((out, plan))
    }

    /// Whether each key is stored; touches no LRU position.
    pub fn contains_many(&self, keys: &[&str]) -> Result<Vec<bool>, StoreError> {
        if self.chunks.is_none() {
            return Err(StoreError::Closed);
        }
        Ok(keys.iter().map(|key| self.contains(key)).collect())
    }

    /// Whether `key` is stored.
    pub fn contains(&self, key: &str) -> bool {
        self.keys.lookup(key).is_some_and(|idx| self.is_stored(idx))
    }

    /// The reference count of `key` (0 when unknown).
    pub fn reference_count(&self, key: &str) -> u32 {
        self.keys.reference_count(key)
    }

    /// Occupancy and counters.
    pub fn stats(&self) -> VariableStats {
        VariableStats {
            capacity_bytes: self.capacity_bytes(),
            chunk_nbytes: self.chunk_nbytes,
            stored: self.stored,
            stored_bytes: self.stored_bytes,
            used_bytes: self.used_chunks * self.chunk_nbytes,
            referenced: self.referenced,
            evictable: self.keys.slab.lru_len(),
            counters: self.counters,
        }
    }

    /// Bytes of the arena (0 when closed): the budget in whole chunks plus 1/16 of slack.
    pub fn arena_bytes(&self) -> usize {
        self.chunks.as_ref().map_or(0, ChunkArena::arena_bytes)
    }

    /// Mean number of runs of adjacent chunks per stored object (1.0: every object contiguous).
    /// O(stored chunks); for figures and tests.
    pub fn mean_runs(&self) -> f64 {
        let Some(chunks) = self.chunks.as_ref() else { return 0.0 };
        let slab = &self.keys.slab;
        let (mut objects, mut runs) = (0usize, 0usize);
        for idx in slab.live_indices().filter(|&idx| self.is_stored(idx)) {
            objects += 1;
            runs += chunks.runs(slab[idx].slot, slab[idx].meta as usize);
        }
        if objects == 0 {
            0.0
        } else {
            runs as f64 / objects as f64
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

    /// Every stored key with a copy of its bytes, in no particular order. Touches no LRU
    /// position.
    pub fn objects(&self) -> Vec<(&str, Vec<u8>)> {
        let Some(chunks) = self.chunks.as_ref() else {
            return Vec::new();
        };
        let slab = &self.keys.slab;
        slab.live_indices()
            .filter(|&idx| self.is_stored(idx))
            .map(|idx| {
                let entry = &slab[idx];
                let mut bytes = vec![0; entry.meta as usize];
                chunks.read(entry.slot, &mut bytes);
                (entry.key(), bytes)
            })
            .collect()
    }

    /// Checks every invariant: the key table's and the LRU's (SPEC section 11), each stored
    /// object's chain, and the allocator's (no overlap; free space accounted for exactly). The
    /// error names the broken one.
    pub fn check(&self) -> Result<(), String> {
        let Some(chunks) = self.chunks.as_ref() else {
            return Ok(());
        };
        self.keys.validate()?;
        let slab = &self.keys.slab;
        let (mut stored, mut stored_bytes, mut used, mut referenced) = (0usize, 0u64, 0usize, 0);
        let mut objects = Vec::new();
        for idx in slab.live_indices() {
            let entry = &slab[idx];
            if entry.slot == PENDING_SLOT {
                return Err(format!("no put is in progress: {:?} is pending", entry.key()));
            }
            if entry.refs > 0 {
                referenced += 1;
            }
            if entry.has_slot() {
                let nbytes = entry.meta as usize;
                if (nbytes == 0) != (entry.slot == EMPTY_CHAIN) {
                    return Err(format!(
                        "every stored key has its chain: {:?} ({nbytes} bytes) has chunk {}",
                        entry.key(),
                        entry.slot
                    ));
                }
                objects.push((entry.slot, nbytes));
                stored += 1;
                stored_bytes += nbytes as u64;
                used += self.chunks_for(nbytes);
            } else if entry.refs == 0 {
                return Err(format!(
                    "counts are >= 1 where present: {:?} is neither stored nor referenced",
                    entry.key()
                ));
            }
        }
        chunks.validate(objects.into_iter())?;
        self.ledger.check(self.counters.objects_written, stored)?;
        if stored != self.stored
            || stored_bytes != self.stored_bytes
            || used != self.used_chunks
            || referenced != self.referenced
        {
            return Err(format!(
                "counters match contents: stored {stored} vs {}, bytes {stored_bytes} vs {}, \
                 chunks {used} vs {}, referenced {referenced} vs {}",
                self.stored, self.stored_bytes, self.used_chunks, self.referenced
            ));
        }
        if used > self.capacity_chunks || used + chunks.available() != chunks.num_chunks() {
            return Err(format!(
                "free space is accounted for exactly: {used} chunks used, {} available, {} in \
                 the arena",
                chunks.available(),
                self.capacity_chunks
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj<'a>(key: &'a str, payload: &'a [u8]) -> BlockRef<'a> {
        BlockRef { key, payload }
    }

    #[test]
    fn default_chunks_count_exact_bytes_in_small_stores() {
        assert_eq!(default_chunk_nbytes(4), 1);
        assert_eq!(default_chunk_nbytes(8_191), 1);
        assert_eq!(default_chunk_nbytes(8_192), 2);
        assert_eq!(default_chunk_nbytes(1 << 20), 256);
        assert_eq!(default_chunk_nbytes(1 << 30), 256);
    }

    #[test]
    fn replace_changes_size_and_eviction_frees_bytes() {
        let mut store = VariableStore::with_options(10, Some(1), false).unwrap();
        store.put(&[obj("a", b"aaaa"), obj("b", b"bb")], &[], &[]).unwrap();
        store.put(&[obj("a", b"A")], &["a"], &[]).unwrap();
        assert_eq!(store.get_concatenated(&["a", "b"]).unwrap(), b"Abb");
        store.check().unwrap();
        // 3 used; 8 more needs 1 freed: "b" is the only evictable key.
        store.put(&[obj("c", b"cccccccc")], &[], &[]).unwrap();
        assert!(!store.contains("b"));
        assert_eq!(store.stats().stored_bytes, 9);
        store.check().unwrap();
    }

    #[test]
    fn refused_put_changes_nothing() {
        let mut store = VariableStore::with_options(4, Some(1), false).unwrap();
        store.put(&[obj("first", b"1111")], &["first"], &[]).unwrap();
        let before = (store.lru_keys().len(), store.references().len());
        let err = store.put(&[obj("second", b"2222")], &["second", "first"], &[]).unwrap_err();
        assert!(err.to_string().contains("cannot retain"), "{err}");
        assert_eq!(store.reference_count("first"), 1);
        assert_eq!(store.reference_count("second"), 0);
        assert_eq!((store.lru_keys().len(), store.references().len()), before);
        store.check().unwrap();
        store.put(&[], &[], &["first"]).unwrap();
        store.put(&[obj("third", b"3333")], &[], &[]).unwrap();
        assert_eq!(store.get_concatenated(&["third"]).unwrap(), b"3333");
        store.check().unwrap();
    }

    #[test]
    fn retain_at_the_count_limit_fails_and_changes_nothing() {
        let mut store = VariableStore::with_options(64, Some(1), false).unwrap();
        store.put(&[obj("k", b"a")], &["k"], &[]).unwrap();
        let idx = store.keys.lookup("k").unwrap();
        store.keys.slab[idx].refs = u32::MAX;
        let refs = |s: &VariableStore| {
            s.references().iter().map(|&(k, c)| (k.to_owned(), c)).collect::<Vec<_>>()
        };
        let before = (store.stats(), store.lru_keys().len(), refs(&store));
        let error = store.put(&[obj("other", b"b")], &["other", "k"], &[]).unwrap_err();
        assert_eq!(error, StoreError::ReferenceOverflow { key: "k".to_owned() });
        assert_eq!((store.stats(), store.lru_keys().len(), refs(&store)), before);
        assert!(!store.contains("other"));
        store.check().unwrap();
        // A release first does not help: retains count first.
        let error = store.put(&[], &["k"], &["k"]).unwrap_err();
        assert!(matches!(error, StoreError::ReferenceOverflow { .. }));
        store.put(&[], &[], &["k"]).unwrap();
        store.put(&[], &["k"], &[]).unwrap();
        assert_eq!(store.reference_count("k"), u32::MAX);
        store.check().unwrap();
    }

    #[test]
    fn reads_report_missing_keys_and_offsets() {
        let mut store = VariableStore::with_options(100, Some(4), false).unwrap();
        store.put(&[obj("a", b"xyz"), obj("e", b"")], &[], &[]).unwrap();
        let (bytes, plan) = store.get_many(&["a", "zz", "e", "a"]).unwrap();
        assert_eq!(bytes, b"xyzxyz");
        assert_eq!(plan.offsets(), [0, 3, 3, 3, 6]);
        assert_eq!(plan.missing(), [1]);
        assert_eq!(store.contains_many(&["a", "zz", "e"]).unwrap(), [true, false, true]);
        let err = store.get_concatenated(&["a", "zz"]).unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
    }

    #[test]
    fn check_catches_a_stored_key_lost_outside_eviction() {
        let mut store = VariableStore::with_options(100, Some(4), false).unwrap();
        store.put(&[obj("a", b"xyz"), obj("b", b"12345")], &[], &[]).unwrap();
        store.put(&[obj("a", b"replaced")], &[], &[]).unwrap();
        store.check().unwrap();
        // Drop a stored key's chain and forget it, every structural count kept consistent:
        // only the ledger can tell.
        let idx = store.keys.lookup("b").unwrap();
        let (slot, nbytes) = (store.keys.slab[idx].slot, store.keys.slab[idx].meta as usize);
        store.chunks.as_mut().unwrap().free(slot, nbytes);
        store.keys.slab.unlink(idx);
        store.keys.slab[idx].slot = NO_SLOT;
        store.stored -= 1;
        store.stored_bytes -= nbytes as u64;
        store.used_chunks -= nbytes.div_ceil(store.chunk_nbytes);
        store.keys.forget(idx);
        let message = store.check().unwrap_err();
        assert!(message.contains("not evicted or replaced is stored"), "{message}");
    }
}
