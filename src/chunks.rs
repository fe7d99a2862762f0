//! The variable-size store's allocator: the arena cut into equal chunks, each object a chain of
//! them.
//!
//! An object of `n` bytes takes `ceil(n / chunk_nbytes)` chunks, which need not be adjacent: a
//! dense `next` array (4 bytes a chunk) links them in order. So any set of objects whose chunk
//! counts sum to at most the arena's fits, whatever the history: there is no external
//! fragmentation, eviction never has to free more than the bytes it needs, and nothing ever moves.
//! The only waste is the unused tail of each object's last chunk.
//!
//! Free chunks form one list threaded through the same `next` array. Freeing an object splices
//! its whole chain onto the front of that list, in order, and allocation pops from the front, so
//! an object written after an eviction gets its victim's chunks in the victim's order: chains
//! stay contiguous as long as the objects that replace each other are alike, and reads and writes
//! copy whole runs of adjacent chunks at once. Chunks past `fresh` were never handed out; they
//! are taken last, so an arena sized for the worst case costs memory only for what was used.
//! Nothing here allocates per object: `next` grows with `fresh`, once per chunk, ever.

use crate::arena::Arena;
use crate::error::StoreError;

/// End of a chain, and of the free list.
pub const NIL: u32 = u32::MAX;
/// The chain of a zero-byte object: no chunk at all (distinct from the slab's markers).
pub const EMPTY_CHAIN: u32 = u32::MAX - 2;
/// Largest chunk count: chunk indices stay below the markers.
pub const MAX_CHUNKS: usize = (u32::MAX - 3) as usize;

/// Equal chunks in one arena, chained per object.
#[derive(Debug)]
pub struct ChunkArena {
    arena: Arena,
    chunk_nbytes: usize,
    num_chunks: usize,
    /// The chunk after each handed-out chunk in its object's chain or in the free list.
    next: Vec<u32>,
    free_head: u32,
    free_chunks: usize,
    /// Chunks from here on were never handed out.
    fresh: u32,
}

impl ChunkArena {
    /// An arena of `num_chunks` chunks of `chunk_nbytes` bytes (committed now with `prefault`).
    pub fn new(num_chunks: usize, chunk_nbytes: usize, prefault: bool) -> Result<Self, StoreError> {
        if num_chunks > MAX_CHUNKS {
            return Err(StoreError::CapacityTooLarge {
                num_slots: num_chunks as u64,
                object_nbytes: chunk_nbytes as u64,
            });
        }
        let arena = Arena::with_prefault(num_chunks, chunk_nbytes, prefault)?;
        Ok(Self {
            arena,
            chunk_nbytes,
            num_chunks,
            next: Vec::new(),
            free_head: NIL,
            free_chunks: 0,
            fresh: 0,
        })
    }

    /// Bytes per chunk.
    pub fn chunk_nbytes(&self) -> usize {
        self.chunk_nbytes
    }

    /// Chunks in the arena.
    pub fn num_chunks(&self) -> usize {
        self.num_chunks
    }

    /// Bytes mapped.
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

    /// Takes one chunk: the front of the free list, else the next untouched one.
    #[inline]
    fn take(&mut self) -> u32 {
        if self.free_head != NIL {
            let chunk = self.free_head;
            self.free_head = self.next[chunk as usize];
            self.free_chunks -= 1;
            return chunk;
        }
        assert!((self.fresh as usize) < self.num_chunks, "the arena has no chunk left");
        let chunk = self.fresh;
        self.fresh += 1;
        self.next.push(NIL);
        chunk
    }

    /// Stores `payload` in a new chain and returns its first chunk (`EMPTY_CHAIN` for no bytes).
    /// The caller made sure that `available()` covers it. Call `flush_writes` before another
    /// thread reads.
    pub fn store(&mut self, payload: &[u8]) -> u32 {
        let count = self.chunks_for(payload.len());
        if count == 0 {
            return EMPTY_CHAIN;
        }
        assert!(count <= self.available(), "the arena has no room for {count} chunks");
        let first = self.take();
        let mut last = first;
        // Copy run by run: a run of adjacent chunks is one copy.
        let (mut run_start, mut run_chunks, mut copied) = (first, 1usize, 0usize);
        for _ in 1..count {
            let chunk = self.take();
            self.next[last as usize] = chunk;
            last = chunk;
            if chunk as usize == run_start as usize + run_chunks {
                run_chunks += 1;
                continue;
            }
            let bytes = run_chunks * self.chunk_nbytes;
            self.arena.write_span(run_start, &payload[copied..copied + bytes]);
            copied += bytes;
            (run_start, run_chunks) = (chunk, 1);
        }
        self.next[last as usize] = NIL;
        self.arena.write_span(run_start, &payload[copied..]);
        first
    }

    /// Orders earlier streaming stores before later loads and stores (see `Arena::flush_writes`).
    #[inline]
    pub fn flush_writes(&self) {
        self.arena.flush_writes();
    }

    /// Returns the chain of an object of `nbytes` bytes to the front of the free list, in order.
    pub fn free(&mut self, first: u32, nbytes: usize) {
        let count = self.chunks_for(nbytes);
        if count == 0 {
            debug_assert_eq!(first, EMPTY_CHAIN);
            return;
        }
        let mut last = first;
        for _ in 1..count {
            last = self.next[last as usize];
        }
        debug_assert_eq!(self.next[last as usize], NIL, "chain longer than its object");
        self.next[last as usize] = self.free_head;
        self.free_head = first;
        self.free_chunks += count;
    }

    /// Copies the `out.len()` bytes of the object whose chain starts at `first` into `out`.
    #[inline]
    pub fn read(&self, first: u32, out: &mut [u8]) {
        if out.is_empty() {
            return;
        }
        let count = self.chunks_for(out.len());
        let (mut run_start, mut run_chunks, mut copied) = (first, 1usize, 0usize);
        let mut chunk = first;
        for _ in 1..count {
            chunk = self.next[chunk as usize];
            if chunk as usize == run_start as usize + run_chunks {
                run_chunks += 1;
                continue;
            }
            let bytes = run_chunks * self.chunk_nbytes;
            out[copied..copied + bytes].copy_from_slice(self.arena.span(run_start, bytes));
            copied += bytes;
            (run_start, run_chunks) = (chunk, 1);
        }
        let rest = out.len() - copied;
        out[copied..].copy_from_slice(self.arena.span(run_start, rest));
    }

    /// Runs of adjacent chunks in the chain of an object of `nbytes` bytes, for tests and
    /// figures: how contiguous objects stay.
    pub fn runs(&self, first: u32, nbytes: usize) -> usize {
        let count = self.chunks_for(nbytes);
        let (mut runs, mut chunk) = (usize::from(count > 0), first);
        for _ in 1..count {
            let after = self.next[chunk as usize];
            if after != chunk + 1 {
                runs += 1;
            }
            chunk = after;
        }
        runs
    }

    /// Checks the allocator's invariants against the stored objects, given as (first chunk,
    /// bytes): every chain has exactly its object's chunk count, no chunk is held twice or is
    /// both held and free, and the held and free chunks are exactly the handed-out ones.
    pub fn validate(&self, objects: impl Iterator<Item = (u32, usize)>) -> Result<(), String> {
        let fresh = self.fresh as usize;
        if fresh > self.num_chunks || self.next.len() != fresh {
            return Err(format!(
                "chunks are in range: {fresh} handed out, {} linked, {} exist",
                self.next.len(),
                self.num_chunks
            ));
        }
        const FREE: u8 = 2;
        let mut owner = vec![0u8; fresh];
        let mut held = 0usize;
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
                owner[at] = 1;
                chunk = self.next[at];
            }
            if chunk != NIL {
                return Err(format!("a chain is longer than its object of {nbytes} bytes"));
            }
            held += count;
        }
        let mut free = 0usize;
        let mut chunk = self.free_head;
        while chunk != NIL {
            let at = chunk as usize;
            if at >= fresh {
                return Err(format!("free space: the free list reaches chunk {chunk} of {fresh}"));
            }
            match owner[at] {
                0 => owner[at] = FREE,
                FREE => return Err(format!("free space: chunk {chunk} is free twice (a cycle)")),
                _ => return Err(format!("no overlap: chunk {chunk} is both held and free")),
            }
            free += 1;
            chunk = self.next[at];
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
        debug_assert_eq!(held + free, fresh);
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
        let mut arena = ChunkArena::new(10, 4, false).unwrap();
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
        let mut arena = ChunkArena::new(12, 4, false).unwrap();
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
    fn validate_names_overlap_and_lost_chunks() {
        let mut arena = ChunkArena::new(4, 2, false).unwrap();
        let a = arena.store(&bytes(0, 4));
        let err = arena.validate([(a, 4), (a, 2)].into_iter()).unwrap_err();
        assert!(err.contains("no overlap"), "{err}");
        let err = arena.validate([(a, 2)].into_iter()).unwrap_err();
        assert!(err.contains("longer than its object"), "{err}");
        let err = arena.validate(std::iter::empty()).unwrap_err();
        assert!(err.contains("accounted for exactly"), "{err}");
    }
}
