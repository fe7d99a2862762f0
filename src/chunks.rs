//! The variable store's allocator: equal chunks, each object a chain of them (a dense `next`
//! array), so any objects whose chunk counts fit the arena fit, with no external fragmentation
//! and nothing ever moved. Adjacent chunks copy fastest, so free chunks are kept as maximal runs
//! (boundary tags and a free bitmap) in size bins (exact up to 64, then powers of two) and an
//! object takes the smallest run that holds it, else fresh chunks, else the largest runs.

use crate::arena::{Arena, Prefault};
use crate::error::StoreError;

/// End of a chain, and of a bin's list.
pub const NIL: u32 = u32::MAX;
/// The chain of a zero-byte object: no chunk at all (distinct from the slab's markers).
pub const EMPTY_CHAIN: u32 = u32::MAX - 2;
/// Largest chunk count: chunk indices stay below the markers.
pub const MAX_CHUNKS: usize = (u32::MAX - 3) as usize;

/// Runs of up to this many chunks have a bin each; longer ones share one per power of two.
const EXACT_BINS: u32 = 64;
const BINS: usize = EXACT_BINS as usize + 32;

/// The bin of a free run of `len` chunks.
#[inline]
fn bin_of(len: u32) -> usize {
    debug_assert!(len > 0);
    if len <= EXACT_BINS {
        (len - 1) as usize
    } else {
        (EXACT_BINS + (31 - len.leading_zeros()) - EXACT_BINS.trailing_zeros()) as usize
    }
}

/// Equal chunks in one arena, chained per object, free ones in coalesced runs.
#[derive(Debug)]
pub struct ChunkArena {
    arena: Arena,
    chunk_nbytes: usize,
    num_chunks: usize,
    /// In an object: the chunk after each. In a free run's first chunk: the next run of its bin.
    next: Vec<u32>,
    /// In a free run's first chunk: the previous run of its bin.
    prev: Vec<u32>,
    /// In a free run's first and last chunk: its length.
    run_len: Vec<u32>,
    /// One bit per handed-out chunk, set while it is free.
    free_bits: Vec<u64>,
    /// The first run of each bin, or `NIL`.
    bins: [u32; BINS],
    /// Bit `b` set when bin `b` is not empty.
    nonempty: u128,
    free_chunks: usize,
    /// Chunks from here on were never handed out.
    fresh: u32,
}

impl ChunkArena {
    #[cfg(test)]
    pub fn new(num_chunks: usize, chunk_nbytes: usize) -> Result<Self, StoreError> {
        Self::with_commit(num_chunks, chunk_nbytes, Prefault::OnWrite)
    }

    pub fn with_commit(
        num_chunks: usize,
        chunk_nbytes: usize,
        prefault: Prefault,
    ) -> Result<Self, StoreError> {
        if num_chunks > MAX_CHUNKS {
            return Err(StoreError::CapacityTooLarge {
                num_slots: num_chunks as u64,
                object_nbytes: chunk_nbytes as u64,
            });
        }
        let arena = Arena::with_commit(num_chunks, chunk_nbytes, prefault)?;
        Ok(Self {
            arena,
            chunk_nbytes,
            num_chunks,
            next: Vec::new(),
            prev: Vec::new(),
            run_len: Vec::new(),
            free_bits: Vec::new(),
            bins: [NIL; BINS],
            nonempty: 0,
            free_chunks: 0,
            fresh: 0,
        })
    }

    pub fn num_chunks(&self) -> usize {
        self.num_chunks
    }

    pub fn arena_bytes(&self) -> usize {
        self.arena.len()
    }

    /// Chunks that an object of `nbytes` bytes takes.
    #[inline]
    pub fn chunks_for(&self, nbytes: usize) -> usize {
        nbytes.div_ceil(self.chunk_nbytes)
    }

    /// Chunks not held by any object (freed or never used).
    pub fn available(&self) -> usize {
        self.free_chunks + (self.num_chunks - self.fresh as usize)
    }

    #[inline]
    fn is_free(&self, chunk: u32) -> bool {
        self.free_bits[(chunk / 64) as usize] & (1 << (chunk % 64)) != 0
    }

    fn mark(&mut self, start: u32, len: u32, free: bool) {
        let (mut at, end) = (start, start + len);
        while at < end {
            let word = (at / 64) as usize;
            let low = at % 64;
            let span = (64 - low).min(end - at);
            let bits = if span == 64 { u64::MAX } else { ((1u64 << span) - 1) << low };
            if free {
                self.free_bits[word] |= bits;
            } else {
                self.free_bits[word] &= !bits;
            }
            at += span;
        }
    }

    /// Files a free run in its bin (its chunks are marked free already).
    fn link_run(&mut self, head: u32, len: u32) {
        self.run_len[head as usize] = len;
        self.run_len[(head + len - 1) as usize] = len;
        let bin = bin_of(len);
        let first = self.bins[bin];
        self.prev[head as usize] = NIL;
        self.next[head as usize] = first;
        if first != NIL {
            self.prev[first as usize] = head;
        }
        self.bins[bin] = head;
        self.nonempty |= 1 << bin;
    }

    /// Takes a free run out of its bin (its chunks stay marked free).
    fn unlink_run(&mut self, head: u32, len: u32) {
        let bin = bin_of(len);
        let (before, after) = (self.prev[head as usize], self.next[head as usize]);
        if before == NIL {
            self.bins[bin] = after;
            if after == NIL {
                self.nonempty &= !(1 << bin);
            }
        } else {
            self.next[before as usize] = after;
        }
        if after != NIL {
            self.prev[after as usize] = before;
        }
    }

    /// Hands out `want` chunks from the head of free run `head..head + len`; the rest stays free.
    fn take_from_run(&mut self, head: u32, len: u32, want: u32) {
        self.unlink_run(head, len);
        self.mark(head, want, false);
        self.free_chunks -= want as usize;
        if len > want {
            self.link_run(head + want, len - want);
        }
    }

    /// Hands out `want` chunks never handed out before.
    fn take_fresh(&mut self, want: u32) -> u32 {
        let head = self.fresh;
        self.fresh += want;
        let fresh = self.fresh as usize;
        self.next.resize(fresh, NIL);
        self.prev.resize(fresh, NIL);
        self.run_len.resize(fresh, 0);
        self.free_bits.resize(fresh.div_ceil(64), 0);
        head
    }

    /// `want` adjacent chunks if possible: the smallest free run that holds them, else fresh ones.
    fn take_whole(&mut self, want: u32) -> Option<u32> {
        let mut bin = bin_of(want);
        // A shared bin may hold shorter runs: try its first, then the next bin, which is sure.
        if want > EXACT_BINS {
            let head = self.bins[bin];
            if head != NIL && self.run_len[head as usize] >= want {
                let len = self.run_len[head as usize];
                self.take_from_run(head, len, want);
                return Some(head);
            }
            bin += 1;
        }
        let fits = self.nonempty & (u128::MAX << bin);
        if fits != 0 {
            let head = self.bins[fits.trailing_zeros() as usize];
            let len = self.run_len[head as usize];
            self.take_from_run(head, len, want);
            return Some(head);
        }
        if self.num_chunks - self.fresh as usize >= want as usize {
            return Some(self.take_fresh(want));
        }
        None
    }

    /// Allocates `count` chunks as one chain: one run if possible, else the largest runs first.
    fn allocate(&mut self, count: usize) -> u32 {
        assert!(count <= self.available(), "the arena has no room for {count} chunks");
        let want = count as u32;
        if let Some(head) = self.take_whole(want) {
            for chunk in head..head + want - 1 {
                self.next[chunk as usize] = chunk + 1;
            }
            self.next[(head + want - 1) as usize] = NIL;
            return head;
        }
        let (mut first, mut last, mut left) = (NIL, NIL, want);
        while left > 0 {
            let (head, len) = if (self.fresh as usize) < self.num_chunks {
                let len = (self.num_chunks as u32 - self.fresh).min(left);
                (self.take_fresh(len), len)
            } else {
                let bin = 127 - self.nonempty.leading_zeros() as usize;
                let head = self.bins[bin];
                let len = self.run_len[head as usize].min(left);
                self.take_from_run(head, self.run_len[head as usize], len);
                (head, len)
            };
            if last == NIL {
                first = head;
            } else {
                self.next[last as usize] = head;
            }
            for chunk in head..head + len - 1 {
                self.next[chunk as usize] = chunk + 1;
            }
            last = head + len - 1;
            left -= len;
        }
        self.next[last as usize] = NIL;
        first
    }

    /// Stores `payload` in a new chain (`EMPTY_CHAIN` if empty) the caller checked room for.
    pub fn store(&mut self, payload: &[u8]) -> u32 {
        let count = self.chunks_for(payload.len());
        if count == 0 {
            return EMPTY_CHAIN;
        }
        let first = self.allocate(count);
        let mut copied = 0;
        let mut run = first;
        while copied < payload.len() {
            let (chunks, after) = self.run_at(run, count);
            let bytes = (chunks * self.chunk_nbytes).min(payload.len() - copied);
            let piece = &payload[copied..copied + bytes];
            copied += bytes;
            if copied == payload.len() && self.chunk_nbytes % 64 == 0 {
                // The rest of the last chunk is this object's: stream the last line whole.
                self.arena.write_span_padded(run, piece);
            } else {
                self.arena.write_span(run, piece);
            }
            run = after;
        }
        first
    }

    /// The run of adjacent chunks at `chunk` in a chain (at most `limit`): its length and the next.
    #[inline]
    fn run_at(&self, chunk: u32, limit: usize) -> (usize, u32) {
        let mut len = 1;
        let mut at = chunk;
        loop {
            let after = self.next[at as usize];
            if after != at + 1 || len == limit {
                return (len, after);
            }
            at = after;
            len += 1;
        }
    }

    /// Orders earlier streaming stores before later loads and stores (see `Arena::flush_writes`).
    #[inline]
    pub fn flush_writes(&self) {
        self.arena.flush_writes();
    }

    /// Frees the chain of an object of `nbytes` bytes, merging its runs with free neighbours.
    pub fn free(&mut self, first: u32, nbytes: usize) {
        let count = self.chunks_for(nbytes);
        if count == 0 {
            debug_assert_eq!(first, EMPTY_CHAIN);
            return;
        }
        let (mut run, mut left) = (first, count);
        while left > 0 {
            let (len, after) = self.run_at(run, left);
            self.release_run(run, len as u32);
            left -= len;
            run = after;
        }
        debug_assert_eq!(run, NIL, "chain longer than its object");
        self.free_chunks += count;
    }

    fn release_run(&mut self, head: u32, len: u32) {
        self.mark(head, len, true);
        let (mut start, mut total) = (head, len);
        if start > 0 && self.is_free(start - 1) {
            let before = self.run_len[(start - 1) as usize];
            start -= before;
            self.unlink_run(start, before);
            total += before;
        }
        let end = head + len;
        if end < self.fresh && self.is_free(end) {
            let after = self.run_len[end as usize];
            self.unlink_run(end, after);
            total += after;
        }
        self.link_run(start, total);
    }

    #[inline]
    pub fn read(&self, first: u32, out: &mut [u8]) {
        let count = self.chunks_for(out.len());
        let (mut run, mut copied) = (first, 0);
        while copied < out.len() {
            let (chunks, after) = self.run_at(run, count);
            let bytes = (chunks * self.chunk_nbytes).min(out.len() - copied);
            out[copied..copied + bytes].copy_from_slice(self.arena.span(run, bytes));
            copied += bytes;
            run = after;
        }
    }

    /// Runs of adjacent chunks in an object's chain: how contiguous objects stay.
    pub fn runs(&self, first: u32, nbytes: usize) -> usize {
        let (mut left, mut run, mut runs) = (self.chunks_for(nbytes), first, 0);
        while left > 0 {
            let (len, after) = self.run_at(run, left);
            left -= len;
            run = after;
            runs += 1;
        }
        runs
    }

    /// Checks the allocator against the stored objects, given as (first chunk, bytes).
    pub fn validate(&self, objects: impl Iterator<Item = (u32, usize)>) -> Result<(), String> {
        let fresh = self.fresh as usize;
        if fresh > self.num_chunks
            || self.next.len() != fresh
            || self.prev.len() != fresh
            || self.run_len.len() != fresh
            || self.free_bits.len() != fresh.div_ceil(64)
        {
            return Err(format!(
                "chunks are in range: {fresh} handed out of {}, arrays of {}/{}/{}/{} words",
                self.num_chunks,
                self.next.len(),
                self.prev.len(),
                self.run_len.len(),
                self.free_bits.len()
            ));
        }
        const HELD: u8 = 1;
        const FREE: u8 = 2;
        let mut owner = vec![0u8; fresh];
        for (first, nbytes) in objects {
            let count = self.chunks_for(nbytes);
            if count == 0 {
                if first != EMPTY_CHAIN {
                    return Err(format!("a zero-byte object has chunk {first}"));
                }
                continue;
            }
            let mut chunk = first;
            for i in 0..count {
                let at = chunk as usize;
                if at >= fresh {
                    return Err(format!(
                        "chunks are in range: a chain of {count} reaches chunk {chunk} at {i} of \
                         {fresh} handed out"
                    ));
                }
                if owner[at] != 0 {
                    return Err(format!("no overlap: chunk {chunk} is held twice"));
                }
                if self.is_free(chunk) {
                    return Err(format!("no overlap: chunk {chunk} is held and marked free"));
                }
                owner[at] = HELD;
                chunk = self.next[at];
            }
            if chunk != NIL {
                return Err(format!("a chain is longer than its object of {nbytes} bytes"));
            }
        }
        let mut free = 0usize;
        for (bin, &first) in self.bins.iter().enumerate() {
            if (first != NIL) != (self.nonempty & (1 << bin) != 0) {
                return Err(format!("free space: bin {bin} and its non-empty bit disagree"));
            }
            let (mut head, mut before) = (first, NIL);
            while head != NIL {
                let at = head as usize;
                if at >= fresh {
                    return Err(format!("free space: bin {bin} reaches chunk {head} of {fresh}"));
                }
                let len = self.run_len[at];
                let end = at + len as usize;
                if len == 0 || end > fresh || self.run_len[end - 1] != len || bin_of(len) != bin {
                    return Err(format!(
                        "free space: the run at {head} in bin {bin} has length {len}, tag {}",
                        if len == 0 || end > fresh { 0 } else { self.run_len[end - 1] }
                    ));
                }
                if self.prev[at] != before {
                    return Err(format!("free space: the run at {head} has a broken back link"));
                }
                for (chunk, state) in owner.iter_mut().enumerate().take(end).skip(at) {
                    match *state {
                        0 if self.is_free(chunk as u32) => *state = FREE,
                        0 => {
                            return Err(format!("free space: chunk {chunk} is listed, not marked"))
                        }
                        FREE => return Err(format!("free space: chunk {chunk} is listed twice")),
                        _ => return Err(format!("no overlap: chunk {chunk} is held and free")),
                    }
                }
                if (at > 0 && self.is_free(head - 1)) || (end < fresh && self.is_free(end as u32)) {
                    return Err(format!(
                        "free runs are maximal: the run at {head} has a free neighbour"
                    ));
                }
                free += len as usize;
                before = head;
                head = self.next[at];
            }
        }
        if free != self.free_chunks {
            return Err(format!(
                "free space is accounted for exactly: {free} chunks listed, {} counted",
                self.free_chunks
            ));
        }
        if let Some(lost) = owner.iter().position(|&o| o == 0) {
            return Err(format!(
                "free space is accounted for exactly: chunk {lost} is neither held nor free"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(seed: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| seed.wrapping_add(i as u8)).collect()
    }

    #[test]
    fn objects_round_trip_and_chunks_come_back() {
        let mut arena = ChunkArena::new(10, 4).unwrap();
        let a = arena.store(&bytes(1, 9)); // 3 chunks
        let e = arena.store(&[]);
        let b = arena.store(&bytes(50, 8)); // 2 chunks
        assert_eq!(e, EMPTY_CHAIN);
        assert_eq!(arena.available(), 5);
        arena.validate([(a, 9), (e, 0), (b, 8)].into_iter()).unwrap();
        arena.free(a, 9);
        assert_eq!(arena.available(), 8);
        let c = arena.store(&bytes(9, 12)); // reuses a's chunks, in order
        assert_eq!(c, a);
        assert_eq!(arena.runs(c, 12), 1);
        let mut out = vec![0; 12];
        arena.read(c, &mut out);
        assert_eq!(out, bytes(9, 12));
        let mut out = vec![0; 8];
        arena.read(b, &mut out);
        assert_eq!(out, bytes(50, 8));
        arena.validate([(c, 12), (b, 8)].into_iter()).unwrap();
    }

    #[test]
    fn scattered_chains_read_back_whole() {
        let mut arena = ChunkArena::new(12, 4).unwrap();
        let small: Vec<u32> = (0..6).map(|i| arena.store(&bytes(i, 7))).collect();
        for &first in small.iter().step_by(2) {
            arena.free(first, 7);
        }
        // Six free chunks in three separate pairs, plus none fresh beyond 12.
        let big = arena.store(&bytes(77, 24));
        assert!(arena.runs(big, 24) >= 3);
        let mut out = vec![0; 24];
        arena.read(big, &mut out);
        assert_eq!(out, bytes(77, 24));
        let held: Vec<(u32, usize)> =
            small.iter().skip(1).step_by(2).map(|&f| (f, 7)).chain([(big, 24)]).collect();
        arena.validate(held.into_iter()).unwrap();
        assert_eq!(arena.available(), 0);
    }

    #[test]
    fn freed_neighbours_merge_into_one_run_and_fit_whole() {
        let mut arena = ChunkArena::new(16, 4).unwrap();
        let a = arena.store(&bytes(1, 8)); // chunks 0-1
        let b = arena.store(&bytes(2, 12)); // 2-4
        let c = arena.store(&bytes(3, 8)); // 5-6
        let d = arena.store(&bytes(4, 4)); // 7
        arena.free(b, 12);
        arena.free(a, 8);
        arena.free(c, 8);
        arena.validate([(d, 4)].into_iter()).unwrap();
        // One free run 0..7 now: seven chunks fit in one piece, where fresh chunks would too.
        let e = arena.store(&bytes(5, 28));
        assert_eq!((e, arena.runs(e, 28)), (0, 1));
        // Freed chunks are used before fresh ones.
        arena.free(d, 4);
        let f = arena.store(&bytes(6, 4));
        assert_eq!(f, 7);
        arena.validate([(e, 28), (f, 4)].into_iter()).unwrap();
    }

    #[test]
    fn random_churn_keeps_bytes_and_invariants() {
        for chunk in [1, 4, 64, 256] {
            let mut arena = ChunkArena::new(4_096 / chunk * 8, chunk).unwrap();
            let mut live: Vec<(u32, Vec<u8>)> = Vec::new();
            let mut state = 11u64;
            for step in 0..3_000u32 {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let len = (state >> 40) as usize % (chunk * 90); // past 64 chunks sometimes
                while arena.available() < arena.chunks_for(len) {
                    let at = (state >> 20) as usize % live.len();
                    let (first, old) = live.swap_remove(at);
                    arena.free(first, old.len());
                }
                let payload = bytes(step as u8, len);
                live.push((arena.store(&payload), payload));
                if step % 101 == 0 {
                    arena.flush_writes();
                    arena.validate(live.iter().map(|(f, p)| (*f, p.len()))).unwrap();
                    for (first, payload) in &live {
                        let mut out = vec![0; payload.len()];
                        arena.read(*first, &mut out);
                        assert_eq!(&out, payload, "chunk {chunk}, step {step}");
                    }
                }
            }
        }
    }

    #[test]
    fn validate_names_overlap_and_lost_chunks() {
        let mut arena = ChunkArena::new(4, 2).unwrap();
        let a = arena.store(&bytes(0, 4));
        let err = arena.validate([(a, 4), (a, 2)].into_iter()).unwrap_err();
        assert!(err.contains("no overlap"), "{err}");
        let err = arena.validate([(a, 2)].into_iter()).unwrap_err();
        assert!(err.contains("longer than its object"), "{err}");
        let err = arena.validate(std::iter::empty()).unwrap_err();
        assert!(err.contains("accounted for exactly"), "{err}");
    }
}
