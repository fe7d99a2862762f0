//! The variable-size store's allocator: chunk chains (`chunks.rs`) under one byte budget. Where
//! it differs from the fixed store (capacity in chunks, replacement of any stored key, a refused
//! put undone whole) is in docs/semantics.md; eviction walks past the victims only, and since
//! objects need not be contiguous, the first prefix whose chunks cover the shortfall makes room.

use super::core::{BlockRef, Charge, Core, Counters, Placement, Scratch, Written};
use super::{Allocator, Store, StoreOptions, VariableStore};
use crate::chunks::{ChunkArena, EMPTY_CHAIN, MAX_CHUNKS};
use crate::digest::Probe;
use crate::error::StoreError;
use crate::keys::KeyTable;
use crate::slab::{Entry, NIL, PENDING_SLOT};
use std::borrow::Cow;

/// Entries carry the payload length; vLLM's logprob keys fit the entry as digest and tail.
type Keys = KeyTable<u32>;

/// The chunk size of a store of 1 MiB or more (tail waste: docs/performance.md).
pub const DEFAULT_CHUNK_NBYTES: usize = 256;

/// Smaller stores use smaller chunks so they still have this many.
const MIN_DEFAULT_CHUNKS: usize = 4096;

/// Extra arena chunks beyond the budget (1/16), room that keeps objects in one piece under
/// churn (docs/performance.md); the budget, and so every eviction, is unchanged.
pub const SLACK_DIVISOR: usize = 16;

/// The largest payload: lengths are kept in 32 bits. A larger one can never be held.
pub const MAX_OBJECT_NBYTES: usize = u32::MAX as usize;

/// The default chunk size for `max_bytes`: halved until the store has 4,096 chunks (down to 1).
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

/// A read resolved under the lock (`plan_read`), copied by `read_planned` if nothing changed.
#[derive(Debug, Default)]
pub struct ReadPlan {
    probes: Vec<Probe>,
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

    /// `keys.len() + 1` offsets: key `i` is `offsets[i]..offsets[i + 1]` (empty if missing).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Positions (in `keys`) of the keys that are not stored, in order.
    pub fn missing(&self) -> &[usize] {
        &self.missing
    }
}

/// A victim frees its new payload's chunks if in the batch, else its own (field: chunk size).
pub struct Chunks(usize);

impl Charge<u32> for Chunks {
    const UNIT: bool = false;

    #[inline]
    fn charge(&self, s: &Scratch, position: Option<usize>, entry: &Entry<u32>) -> usize {
        match position {
            Some(position) => s.charges[position],
            None => (entry.meta as usize).div_ceil(self.0),
        }
    }
}

/// The variable-size store's chunk chains and byte accounting.
#[derive(Debug)]
pub struct ChunkChains {
    chunks: Option<ChunkArena>,
    chunk_nbytes: usize,
    capacity_chunks: usize,
    stored_bytes: u64,
    used_chunks: usize,
    /// Chunks in use once the put in progress replaces what it replaces.
    used_after: usize,
    /// Bumped by every put that may change entries or chains, so a stale read plan is detected.
    version: u64,
}

impl VariableStore {
    /// A store of `max_bytes` with the default chunk size.
    pub fn new(max_bytes: usize) -> Result<Self, StoreError> {
        Self::with_options(max_bytes, StoreOptions::default())
    }

    /// A store of `max_bytes` built as `options` say (`profile` must keep its default).
    pub fn with_options(max_bytes: usize, options: StoreOptions) -> Result<Self, StoreError> {
        if options.profile != super::Profile::default() {
            return Err(StoreError::InvalidArgument(
                "profile applies to the fixed-size store only".to_owned(),
            ));
        }
        if max_bytes == 0 {
            return Err(StoreError::InvalidArgument(
                "auxiliary output store max_bytes must be positive".to_owned(),
            ));
        }
        let chunk_nbytes = options.chunk_nbytes.unwrap_or_else(|| default_chunk_nbytes(max_bytes));
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
        let chunks = ChunkArena::with_commit(arena_chunks, chunk_nbytes, options.prefault)?;
        // About one key per eight chunks (3 KB objects); the index grows if needed.
        let reserve = (capacity_chunks / 8).clamp(16, 1 << 20);
        let chains = ChunkChains {
            chunks: Some(chunks),
            chunk_nbytes,
            capacity_chunks,
            stored_bytes: 0,
            used_chunks: 0,
            used_after: 0,
            version: 0,
        };
        Ok(Store::from_parts(Core::new(Keys::with_capacity(reserve)?), chains))
    }

    /// Bytes per chunk.
    pub fn chunk_nbytes(&self) -> usize {
        self.alloc.chunk_nbytes
    }

    /// Bytes the store holds at most: whole chunks of `max_bytes`.
    pub fn capacity_bytes(&self) -> usize {
        self.alloc.capacity_bytes()
    }

    /// Resolves `keys` for a read without touching the LRU: where each key's bytes go, which miss.
    pub fn plan_read(&mut self, keys: &[&str], plan: &mut ReadPlan) -> Result<(), StoreError> {
        if self.alloc.chunks.is_none() {
            return Err(StoreError::Closed);
        }
        plan.entries.clear();
        plan.offsets.clear();
        plan.missing.clear();
        self.core.keys.resolve(keys, &mut plan.probes, &mut plan.entries, None);
        let mut total = 0usize;
        plan.offsets.push(0);
        for i in 0..plan.entries.len() {
            let idx = plan.entries[i];
            if !self.core.is_stored(idx) {
                plan.entries[i] = NIL;
                plan.missing.push(i);
            } else {
                total += self.core.keys.slab[idx].meta as usize;
            }
            plan.offsets.push(total);
        }
        plan.version = self.alloc.version;
        Ok(())
    }

    /// Copies a planned read into `out`, keys to the LRU tail; `false` if a put ran since the plan.
    pub fn read_planned(&mut self, plan: &ReadPlan, out: &mut [u8]) -> Result<bool, StoreError> {
        let Some(chunks) = self.alloc.chunks.as_ref() else {
            return Err(StoreError::Closed);
        };
        if plan.version != self.alloc.version {
            return Ok(false);
        }
        assert_eq!(out.len(), plan.total(), "output size");
        let slab = &self.core.keys.slab;
        for (i, &idx) in plan.entries.iter().enumerate() {
            if idx != NIL {
                chunks.read(slab[idx].slot, &mut out[plan.offsets[i]..plan.offsets[i + 1]]);
            }
        }
        self.core.touch_read(&plan.entries);
        self.core.counters.reads += (plan.entries.len() - plan.missing.len()) as u64;
        self.core.counters.read_misses += plan.missing.len() as u64;
        self.core.counters.bytes_read += out.len() as u64;
        Ok(true)
    }

    /// The error for a read that needs every key and planned some missing (counted as a miss).
    pub fn missing_error(&mut self, keys: &[&str], plan: &ReadPlan) -> StoreError {
        self.core.counters.read_misses += 1;
        let first = plan.missing.first().copied().expect("a key is missing");
        StoreError::MissingObject {
            key: keys[first].to_owned(),
            used: self.alloc.stored_bytes as usize,
            limit: self.alloc.capacity_bytes(),
        }
    }

    /// The payloads of `keys`, concatenated; a missing key fails with `MissingObject`, no change.
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

    /// The stored keys' payloads, concatenated in order, and the plan (`offsets`, `missing`).
    pub fn get_many(&mut self, keys: &[&str]) -> Result<(Vec<u8>, ReadPlan), StoreError> {
        let mut plan = ReadPlan::default();
        self.plan_read(keys, &mut plan)?;
        let mut out = vec![0; plan.total()];
        self.read_planned(&plan, &mut out)?;
        Ok((out, plan))
    }

    /// Occupancy and counters.
    pub fn stats(&self) -> VariableStats {
        VariableStats {
            capacity_bytes: self.alloc.capacity_bytes(),
            chunk_nbytes: self.alloc.chunk_nbytes,
            stored: self.core.stored,
            stored_bytes: self.alloc.stored_bytes,
            used_bytes: self.alloc.used_chunks * self.alloc.chunk_nbytes,
            referenced: self.core.referenced,
            evictable: self.core.keys.slab.lru_len(),
            counters: self.core.counters,
        }
    }

    /// Bytes of the arena (0 when closed): the budget in whole chunks plus 1/16 of slack.
    pub fn arena_bytes(&self) -> usize {
        self.alloc.chunks.as_ref().map_or(0, ChunkArena::arena_bytes)
    }

    /// Mean runs of adjacent chunks per stored object (1.0: all contiguous); O(stored chunks).
    pub fn mean_runs(&self) -> f64 {
        let Some(chunks) = self.alloc.chunks.as_ref() else { return 0.0 };
        let slab = &self.core.keys.slab;
        let (mut objects, mut runs) = (0usize, 0usize);
        for idx in slab.live_indices().filter(|&idx| self.core.is_stored(idx)) {
            objects += 1;
            runs += chunks.runs(slab[idx].slot, slab[idx].meta as usize);
        }
        if objects == 0 {
            0.0
        } else {
            runs as f64 / objects as f64
        }
    }
}

impl ChunkChains {
    fn capacity_bytes(&self) -> usize {
        self.capacity_chunks * self.chunk_nbytes
    }

    #[inline]
    fn chunks_for(&self, nbytes: usize) -> usize {
        nbytes.div_ceil(self.chunk_nbytes)
    }
}

impl Allocator for ChunkChains {
    type Meta = u32;
    type Report = ();
    type Charge = Chunks;
    const UNDO: bool = true;
    const REPLACES_STORED: bool = true;

    fn is_open(&self) -> bool {
        self.chunks.is_some()
    }

    fn close(&mut self) -> bool {
        self.version += 1;
        self.stored_bytes = 0;
        self.used_chunks = 0;
        self.chunks.take().is_some()
    }

    fn admit(&mut self, _: &[BlockRef<'_>]) -> Result<(), StoreError> {
        if self.chunks.is_none() {
            return Err(StoreError::Closed);
        }
        self.version += 1;
        Ok(())
    }

    fn charge_batch(
        &mut self,
        core: &Core<u32>,
        s: &mut Scratch,
        objects: &[BlockRef<'_>],
    ) -> Result<(), StoreError> {
        if s.batch.iter().any(|&(_, position)| objects[position].payload.len() > MAX_OBJECT_NBYTES)
        {
            return Err(self.refusal());
        }
        let chunk_nbytes = self.chunk_nbytes;
        s.charges
            .extend(s.batch.iter().map(|&(_, p)| objects[p].payload.len().div_ceil(chunk_nbytes)));
        let replaced: usize = s
            .batch
            .iter()
            .filter(|&&(idx, _)| core.is_stored(idx))
            .map(|&(idx, _)| (core.keys.slab[idx].meta as usize).div_ceil(chunk_nbytes))
            .sum();
        self.used_after = self.used_chunks - replaced + s.charges.iter().sum::<usize>();
        Ok(())
    }

    fn need(&self, _: &Core<u32>, _: &Placement) -> usize {
        self.used_after.saturating_sub(self.capacity_chunks)
    }

    fn charges(&self) -> Chunks {
        Chunks(self.chunk_nbytes)
    }

    fn refusal(&self) -> StoreError {
        StoreError::CannotRetainBytes { limit: self.capacity_bytes() }
    }

    fn make_room(&mut self, _: &Core<u32>, _: &Placement, _: usize) -> Result<(), StoreError> {
        Err(self.refusal())
    }

    fn check(&self, core: &Core<u32>) -> Result<(), String> {
        let chunks = self.chunks.as_ref().expect("checked open");
        let (mut stored_bytes, mut used) = (0u64, 0usize);
        let mut objects = Vec::new();
        let (stored, referenced) = core.check_entries(|idx, entry| {
            let nbytes = entry.meta as usize;
            if (nbytes == 0) != (entry.slot == EMPTY_CHAIN) {
                return Err(format!(
                    "every stored key has its chain: {:?} ({nbytes} bytes) has chunk {}",
                    core.keys.slab.key(idx),
                    entry.slot
                ));
            }
            objects.push((entry.slot, nbytes));
            stored_bytes += nbytes as u64;
            used += self.chunks_for(nbytes);
            Ok(())
        })?;
        chunks.validate(objects.into_iter())?;
        core.check_counts(stored, referenced)?;
        if stored_bytes != self.stored_bytes || used != self.used_chunks {
            return Err(format!(
                "counters match contents: bytes {stored_bytes} vs {}, chunks {used} vs {}",
                self.stored_bytes, self.used_chunks
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

    fn grown_to((): &()) -> Option<usize> {
        None
    }

    fn object<'a>(&'a self, entry: &Entry<u32>) -> Cow<'a, [u8]> {
        let mut bytes = vec![0; entry.meta as usize];
        self.chunks.as_ref().expect("checked open").read(entry.slot, &mut bytes);
        Cow::Owned(bytes)
    }

    fn free(&mut self, slot: u32, nbytes: u32) {
        self.chunks.as_mut().expect("checked open").free(slot, nbytes as usize);
        self.stored_bytes -= u64::from(nbytes);
        self.used_chunks -= self.chunks_for(nbytes as usize);
    }

    /// Frees the chains of replaced keys, then writes every batch key that was not evicted.
    fn write_batch(
        &mut self,
        core: &mut Core<u32>,
        s: &Scratch,
        objects: &[BlockRef<'_>],
    ) -> Written {
        let mut written = Written::default();
        let mut replaced = 0;
        let chunks = self.chunks.as_mut().expect("checked open");
        // Free every replaced chain before writing any, so the writes always find their room.
        for &(idx, _) in &s.batch {
            if !core.keys.slab.is_live(idx) {
                continue; // evicted
            }
            let entry = &mut core.keys.slab[idx];
            if entry.slot != PENDING_SLOT {
                let nbytes = entry.meta as usize;
                chunks.free(entry.slot, nbytes);
                entry.slot = PENDING_SLOT;
                self.stored_bytes -= nbytes as u64;
                self.used_chunks -= nbytes.div_ceil(self.chunk_nbytes);
                replaced += 1;
            }
        }
        for (&(idx, position), &charge) in s.batch.iter().zip(&s.charges) {
            if !core.keys.slab.is_live(idx) {
                continue;
            }
            let payload = objects[position].payload;
            let entry = &mut core.keys.slab[idx];
            entry.slot = chunks.store(payload);
            entry.meta = payload.len() as u32;
            self.stored_bytes += payload.len() as u64;
            self.used_chunks += charge;
            written.add(payload.len(), false);
        }
        chunks.flush_writes();
        debug_assert!(self.used_chunks <= self.capacity_chunks);
        // Every replaced chain was freed above and is written again below.
        written.replaced = replaced;
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slab::NO_SLOT;

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
        let mut store =
            VariableStore::with_options(10, StoreOptions::default().chunk_nbytes(1)).unwrap();
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
        let mut store =
            VariableStore::with_options(4, StoreOptions::default().chunk_nbytes(1)).unwrap();
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
        let mut store =
            VariableStore::with_options(64, StoreOptions::default().chunk_nbytes(1)).unwrap();
        store.put(&[obj("k", b"a")], &["k"], &[]).unwrap();
        let idx = store.core.keys.lookup("k").unwrap();
        store.core.keys.slab[idx].refs = u32::MAX;
        let refs = |s: &VariableStore| {
            s.references().into_iter().map(|(k, c)| (k.into_owned(), c)).collect::<Vec<_>>()
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
        let mut store =
            VariableStore::with_options(100, StoreOptions::default().chunk_nbytes(4)).unwrap();
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
        let mut store =
            VariableStore::with_options(100, StoreOptions::default().chunk_nbytes(4)).unwrap();
        store.put(&[obj("a", b"xyz"), obj("b", b"12345")], &[], &[]).unwrap();
        store.put(&[obj("a", b"replaced")], &[], &[]).unwrap();
        store.check().unwrap();
        // Drop a stored key's chain and forget it: only the ledger can tell.
        let idx = store.core.keys.lookup("b").unwrap();
        let (slot, nbytes) =
            (store.core.keys.slab[idx].slot, store.core.keys.slab[idx].meta as usize);
        store.alloc.chunks.as_mut().unwrap().free(slot, nbytes);
        store.core.keys.slab.unlink(idx);
        store.core.keys.slab[idx].slot = NO_SLOT;
        store.core.stored -= 1;
        store.alloc.stored_bytes -= nbytes as u64;
        store.alloc.used_chunks -= nbytes.div_ceil(store.alloc.chunk_nbytes);
        store.core.keys.forget(idx);
        let message = store.check().unwrap_err();
        assert!(message.contains("not evicted or replaced is stored"), "{message}");
    }
}
