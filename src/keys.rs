//! The key table both stores use: index, slab and hasher, with the batched lookup that overlaps
//! a call's cache misses; generic over the per-key data `M`.

use std::borrow::Cow;

use crate::digest::Probe;
use crate::error::StoreError;
use crate::index::KeyIndex;
use crate::slab::{Slab, NIL};

/// Keys `KeyTable::resolve` takes through its passes at a time.
pub(crate) const RESOLVE_CHUNK: usize = 256;

/// `Entry::mark` of a key that is not in the current batch (see `KeyTable::dedupe_batch`).
pub const NOT_IN_BATCH: u32 = u32::MAX;

/// What a call's keys come as: key strings, or objects that carry one.
pub trait Keyed {
    fn key(&self) -> &str;
}

impl Keyed for &str {
    #[inline]
    fn key(&self) -> &str {
        self
    }
}

/// Keys to entries: an index by 32-bit hash, and the entries (key, count, slot, `M`).
#[derive(Debug)]
pub struct KeyTable<M> {
    pub index: KeyIndex,
    /// The entries, and the LRU over them.
    pub slab: Slab<M>,
}

impl<M: Copy + Default> KeyTable<M> {
    /// A table that holds `capacity` keys without growing.
    pub fn with_capacity(capacity: usize) -> Result<Self, StoreError> {
        Self::with_reserve(capacity, capacity)
    }

    /// A table whose index holds `index_capacity` keys and whose slab reserves `slab_reserve`.
    pub fn with_reserve(index_capacity: usize, slab_reserve: usize) -> Result<Self, StoreError> {
        Ok(Self {
            index: KeyIndex::with_capacity(index_capacity)?,
            slab: Slab::with_reserve(slab_reserve)?,
        })
    }

    /// Makes room for `additional` new keys: a call short of memory is refused unchanged.
    pub fn reserve(&mut self, additional: usize) -> Result<(), StoreError> {
        self.index.reserve(additional)?;
        self.slab.try_reserve(additional)
    }

    /// The entry of `key`, prepared as `probe`, if the table knows it.
    #[inline]
    pub fn find(&self, key: &str, probe: &Probe) -> Option<u32> {
        let slab = &self.slab;
        self.index.find(probe.hash, |idx| slab[idx].is_key(key, probe))
    }

    pub fn lookup(&self, key: &str) -> Option<u32> {
        self.find(key, &self.slab.codec.probe(key))
    }

    /// The entry of `key`, created (unreferenced, no slot) and recorded in `created` when missing.
    pub fn find_or_insert(&mut self, key: &str, probe: &Probe, created: &mut Vec<u32>) -> u32 {
        if let Some(idx) = self.find(key, probe) {
            return idx;
        }
        let idx = self.slab.insert(key, probe);
        self.index.insert(probe.hash, idx);
        created.push(idx);
        idx
    }

    /// Resolves `keys` to entries (appended to `out`) in passes that overlap their cache misses:
    /// prepare each key and prefetch its bucket, pick each candidate from the bucket hashes and
    /// prefetch its entry, then confirm. Missing: new entries with `created`, else `NIL`.
    /// `RESOLVE_CHUNK` keys a pass: plenty of misses in flight, probes kept in cache, and no large
    /// scratch to page-fault in (docs/performance.md).
    pub fn resolve<K: Keyed>(
        &mut self,
        keys: &[K],
        probes: &mut Vec<Probe>,
        out: &mut Vec<u32>,
        mut created: Option<&mut Vec<u32>>,
    ) {
        out.reserve(keys.len());
        for chunk in keys.chunks(RESOLVE_CHUNK) {
            self.resolve_chunk(chunk, probes, out, created.as_deref_mut());
        }
    }

    fn resolve_chunk<K: Keyed>(
        &mut self,
        keys: &[K],
        probes: &mut Vec<Probe>,
        out: &mut Vec<u32>,
        mut created: Option<&mut Vec<u32>>,
    ) {
        let first = out.len();
        probes.clear();
        let codec = &mut self.slab.codec;
        let index = &self.index;
        let for_insert = created.is_some();
        probes.extend(keys.iter().map(|key| {
            let probe =
                if for_insert { codec.probe_for_insert(key.key()) } else { codec.probe(key.key()) };
            index.prefetch(probe.hash);
            probe
        }));
        for probe in probes.iter() {
            let candidate = self.index.find(probe.hash, |_| true).unwrap_or(NIL);
            if candidate != NIL {
                self.slab.prefetch(candidate);
            }
            out.push(candidate);
        }
        for (i, key) in keys.iter().enumerate() {
            let (key, candidate) = (key.key(), out[first + i]);
            if candidate != NIL && self.slab[candidate].is_key(key, &probes[i]) {
                continue;
            }
            // No candidate, a 32-bit hash collision, or a key this loop just created.
            out[first + i] = match created.as_deref_mut() {
                Some(created) => self.find_or_insert(key, &probes[i], created),
                None => self.find(key, &probes[i]).unwrap_or(NIL),
            };
        }
    }

    /// Counts retains, then releases, against each key; the first count out of `u32` is the error.
    pub fn validate_references(
        &mut self,
        retains: &[u32],
        releases: &[u32],
    ) -> Result<(), StoreError> {
        if releases.is_empty() && retains.is_empty() {
            return Ok(());
        }
        let slab = &mut self.slab;
        for &idx in retains.iter().chain(releases) {
            let entry = &mut slab[idx];
            entry.mark = entry.refs;
        }
        for &idx in retains {
            let entry = &mut slab[idx];
            match entry.mark.checked_add(1) {
                Some(count) => entry.mark = count,
                None => return Err(StoreError::ReferenceOverflow { key: slab.key(idx).into() }),
            }
        }
        for &idx in releases {
            let entry = &mut slab[idx];
            if entry.mark == 0 {
                return Err(StoreError::NotReferenced { key: slab.key(idx).into() });
            }
            entry.mark -= 1;
        }
        Ok(())
    }

    /// Dedupes `(entry, payload index)` in place (first occurrence fixes the position, last payload
    /// wins); then a batch key's `mark` is its position, a released key's `NOT_IN_BATCH` otherwise.
    pub fn dedupe_batch(&mut self, batch: &mut Vec<(u32, usize)>, releases: &[u32]) {
        let slab = &mut self.slab;
        for &(idx, _) in batch.iter() {
            slab[idx].mark = NOT_IN_BATCH;
        }
        for &idx in releases {
            slab[idx].mark = NOT_IN_BATCH;
        }
        let mut unique = 0;
        for i in 0..batch.len() {
            let (idx, position) = batch[i];
            let mark = slab[idx].mark;
            if mark == NOT_IN_BATCH {
                slab[idx].mark = unique as u32;
                batch[unique] = (idx, position);
                unique += 1;
            } else {
                batch[mark as usize].1 = position;
            }
        }
        batch.truncate(unique);
    }

    /// Forgets entries among `indices` that ended up neither stored nor referenced.
    pub fn forget_orphans(&mut self, indices: &[u32]) {
        for &idx in indices {
            let slab = &self.slab;
            if slab.is_live(idx) && slab[idx].refs == 0 && !slab[idx].has_slot() {
                self.forget(idx);
            }
        }
    }

    /// Evictable keys, oldest first (O(n), for tests).
    pub fn lru_keys(&self) -> Vec<Cow<'_, str>> {
        self.slab.lru_iter().map(|idx| self.slab.key(idx)).collect()
    }

    /// Every referenced key with its count, in no particular order.
    pub fn references(&self) -> Vec<(Cow<'_, str>, u32)> {
        let slab = &self.slab;
        slab.live_indices()
            .filter(|&idx| slab[idx].refs > 0)
            .map(|idx| (slab.key(idx), slab[idx].refs))
            .collect()
    }

    /// The reference count of `key` (0 when unknown).
    pub fn reference_count(&self, key: &str) -> u32 {
        self.lookup(key).map_or(0, |idx| self.slab[idx].refs)
    }

    /// Frees an entry that is neither stored nor referenced (and so not in the LRU).
    pub fn forget(&mut self, idx: u32) {
        self.forget_hashed(idx, self.slab.hash(idx));
    }

    /// `forget`, for a caller that has the key's hash already.
    pub fn forget_hashed(&mut self, idx: u32, hash: u32) {
        self.index.remove(hash, idx);
        self.slab.remove(idx);
    }

    /// Checks that every live entry is found by its key and the index holds nothing else.
    pub fn validate(&self) -> Result<(), String> {
        self.slab.validate()?;
        let mut live = 0usize;
        for idx in self.slab.live_indices() {
            let key = self.slab.key(idx);
            let probe = self.slab.codec.probe(&key);
            if self.slab.hash(idx) != probe.hash {
                return Err(format!("every key has one entry: {key:?} has a stale hash"));
            }
            if self.find(&key, &probe) != Some(idx) {
                return Err(format!("every key has one entry: {key:?} is not found by its key"));
            }
            live += 1;
        }
        if live != self.index.len() {
            return Err(format!(
                "every key has one entry: {} indexed, {live} live",
                self.index.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_repeated_in_a_later_chunk_resolves_to_its_first_entry() {
        let mut table: KeyTable<u32> = KeyTable::with_capacity(16).unwrap();
        let half = RESOLVE_CHUNK + 44;
        let texts: Vec<String> =
            (0..2 * half).map(|i| format!("vllm-artifact/0/{:064x}", (i % half) * 7919)).collect();
        let keys: Vec<&str> = texts.iter().map(String::as_str).collect();
        let (mut probes, mut out, mut created) = (Vec::new(), Vec::new(), Vec::new());
        table.resolve(&keys, &mut probes, &mut out, Some(&mut created));
        assert_eq!(created.len(), half);
        assert_eq!(out[..half], out[half..]);
        assert_eq!(table.slab.key(out[half + 1]), keys[1]);
        let mut again = Vec::new();
        table.resolve(&keys[half..], &mut probes, &mut again, None);
        assert_eq!(again, out[..half]);
    }

    #[test]
    fn resolve_finds_creates_and_misses() {
        let mut table: KeyTable<u32> = KeyTable::with_capacity(4).unwrap();
        let long = "k".repeat(150);
        let digest = format!("vllm-artifact/0/{}", "0a".repeat(32));
        let other = format!("vllm-artifact/1/{}", "0a".repeat(32));
        let (mut probes, mut out, mut created) = (Vec::new(), Vec::new(), Vec::new());
        let keys = ["a", &long, "a", &digest];
        table.resolve(&keys, &mut probes, &mut out, Some(&mut created));
        assert_eq!(created.len(), 3);
        assert_eq!(out[0], out[2]);
        assert_eq!(table.slab.key(out[1]), long);
        assert_eq!(table.slab.key(out[3]), digest);
        let mut again = Vec::new();
        table.resolve(&[&long, "b", &digest, &other], &mut probes, &mut again, None);
        assert_eq!(again, [out[1], NIL, out[3], NIL]);
        for &idx in &created {
            table.slab[idx].refs = 1;
        }
        table.validate().unwrap();
        table.slab[out[0]].refs = 0;
        table.forget(out[0]);
        assert_eq!(table.lookup("a"), None);
        table.validate().unwrap();
    }
}
