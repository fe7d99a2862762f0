//! The key index: open addressing from a key's 32-bit hash to its slab entry, `(hash << 32) |
//! entry` per 8-byte bucket, linear probing and backward-shift deletion (no tombstones, so churn
//! never degrades it). A key's home follows from its hash alone, so a batch prefetches all its
//! buckets first; the bucket count is not rounded to a power of two (`home`).

use crate::error::StoreError;

/// An empty bucket (entry index `u32::MAX` is never used).
const EMPTY: u64 = u64::MAX;

/// The table grows when more than this fraction of its buckets is used.
const MAX_LOAD_NUM: usize = 3;
const MAX_LOAD_DEN: usize = 4;

/// Entry indices by 32-bit key hash.
#[derive(Debug)]
pub struct KeyIndex {
    buckets: Vec<u64>,
    len: usize,
}

#[inline]
fn pack(hash: u32, idx: u32) -> u64 {
    (u64::from(hash) << 32) | u64::from(idx)
}

#[inline]
fn bucket_hash(bucket: u64) -> u32 {
    (bucket >> 32) as u32
}

#[inline]
fn bucket_idx(bucket: u64) -> u32 {
    bucket as u32
}

/// `n` empty buckets, advised onto huge pages before their first write.
fn empty_buckets(n: usize) -> Result<Vec<u64>, StoreError> {
    let mut buckets = Vec::new();
    buckets.try_reserve_exact(n).map_err(|_| StoreError::OutOfMemory {
        what: "key index",
        bytes: n.saturating_mul(std::mem::size_of::<u64>()),
    })?;
    crate::arena::advise_huge_pages_for(&buckets);
    buckets.resize(n, EMPTY);
    Ok(buckets)
}

impl KeyIndex {
    /// An index that holds `capacity` keys without growing.
    pub fn with_capacity(capacity: usize) -> Result<Self, StoreError> {
        Ok(Self { buckets: empty_buckets(Self::buckets_for(capacity))?, len: 0 })
    }

    fn buckets_for(keys: usize) -> usize {
        (keys.saturating_mul(MAX_LOAD_DEN) / MAX_LOAD_NUM + 1).max(16)
    }

    /// Makes room for `additional` more keys, so that inserting them never allocates.
    pub fn reserve(&mut self, additional: usize) -> Result<(), StoreError> {
        let wanted = self.len.saturating_add(additional);
        if wanted.saturating_mul(MAX_LOAD_DEN) <= self.buckets.len() * MAX_LOAD_NUM {
            return Ok(());
        }
        let mut buckets = self.buckets.len() * 2;
        while wanted.saturating_mul(MAX_LOAD_DEN) > buckets.saturating_mul(MAX_LOAD_NUM) {
            buckets = buckets.saturating_mul(2);
        }
        self.rehash_into(empty_buckets(buckets)?);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The bucket where a probe for `hash` starts: the hash scaled to the table.
    #[inline]
    fn home(&self, hash: u32) -> usize {
        ((u64::from(hash) * self.buckets.len() as u64) >> 32) as usize
    }

    #[inline]
    fn next(&self, at: usize) -> usize {
        if at + 1 == self.buckets.len() {
            0
        } else {
            at + 1
        }
    }

    #[inline]
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from {
            to - from
        } else {
            to + self.buckets.len() - from
        }
    }

    /// Starts loading the home bucket of `hash` into cache.
    #[inline]
    pub fn prefetch(&self, hash: u32) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let bucket = &self.buckets[self.home(hash)];
            // SAFETY: a prefetch never faults or writes; the address is a live bucket.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(bucket).cast::<i8>()) };
        }
    }

    /// The first entry with `hash` for which `accept` holds.
    #[inline]
    pub fn find(&self, hash: u32, mut accept: impl FnMut(u32) -> bool) -> Option<u32> {
        let mut at = self.home(hash);
        loop {
            let bucket = self.buckets[at];
            if bucket == EMPTY {
                return None;
            }
            if bucket_hash(bucket) == hash && accept(bucket_idx(bucket)) {
                return Some(bucket_idx(bucket));
            }
            at = self.next(at);
        }
    }

    /// Adds an entry; the caller knows its key is not indexed yet.
    pub fn insert(&mut self, hash: u32, idx: u32) {
        debug_assert_ne!(pack(hash, idx), EMPTY);
        if (self.len + 1) * MAX_LOAD_DEN > self.buckets.len() * MAX_LOAD_NUM {
            self.grow();
        }
        self.place(pack(hash, idx));
        self.len += 1;
    }

    fn place(&mut self, bucket: u64) {
        let mut at = self.home(bucket_hash(bucket));
        while self.buckets[at] != EMPTY {
            at = self.next(at);
        }
        self.buckets[at] = bucket;
    }

    /// Doubles the table; puts `reserve` first, so only other callers get here.
    fn grow(&mut self) {
        let n = self.buckets.len() * 2;
        let doubled = empty_buckets(n).unwrap_or_else(|_| {
            std::alloc::handle_alloc_error(std::alloc::Layout::array::<u64>(n).expect("size"))
        });
        self.rehash_into(doubled);
    }

    fn rehash_into(&mut self, buckets: Vec<u64>) {
        let old = std::mem::replace(&mut self.buckets, buckets);
        for bucket in old.into_iter().filter(|&b| b != EMPTY) {
            self.place(bucket);
        }
    }

    /// Removes entry `idx`, shifting later buckets of its probe run back (no tombstone).
    pub fn remove(&mut self, hash: u32, idx: u32) {
        let wanted = pack(hash, idx);
        let mut hole = self.home(hash);
        while self.buckets[hole] != wanted {
            assert_ne!(self.buckets[hole], EMPTY, "entry {idx} is not indexed");
            hole = self.next(hole);
        }
        let mut at = hole;
        loop {
            at = self.next(at);
            let bucket = self.buckets[at];
            if bucket == EMPTY {
                break;
            }
            // A bucket may move back to the hole if the hole lies on its probe path.
            let home = self.home(bucket_hash(bucket));
            if self.distance(home, at) >= self.distance(hole, at) {
                self.buckets[hole] = bucket;
                hole = at;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
    }

    /// Every (hash, entry) pair, in bucket order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.buckets.iter().filter(|&&b| b != EMPTY).map(|&b| (bucket_hash(b), bucket_idx(b)))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn insert_find_remove_against_a_map() {
        let mut index = KeyIndex::with_capacity(4).unwrap();
        let mut model: HashMap<u32, u32> = HashMap::new();
        let mut state = 12_345u64;
        for step in 0..20_000u32 {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            // Few distinct hashes spread over 32 bits: long probe runs that wrap around.
            let hash = ((state >> 40) % 97) as u32 * (u32::MAX / 96);
            let present: Vec<u32> =
                model.iter().filter(|(_, &h)| h == hash).map(|(&i, _)| i).collect();
            if present.is_empty() || state % 3 == 0 {
                index.insert(hash, step);
                model.insert(step, hash);
            } else {
                let idx = present[(state >> 20) as usize % present.len()];
                index.remove(hash, idx);
                model.remove(&idx);
            }
            assert_eq!(index.len(), model.len());
        }
        for (&idx, &hash) in &model {
            assert_eq!(index.find(hash, |i| i == idx), Some(idx));
        }
        let mut listed: Vec<(u32, u32)> = index.iter().map(|(h, i)| (i, h)).collect();
        let mut expected: Vec<(u32, u32)> = model.into_iter().collect();
        listed.sort_unstable();
        expected.sort_unstable();
        assert_eq!(listed, expected);
    }

    #[test]
    fn find_skips_rejected_candidates() {
        let mut index = KeyIndex::with_capacity(8).unwrap();
        index.insert(7, 1);
        index.insert(7, 2);
        assert_eq!(index.find(7, |i| i == 2), Some(2));
        assert_eq!(index.find(7, |_| false), None);
        assert_eq!(index.find(8, |_| true), None);
    }
}
