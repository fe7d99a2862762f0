//! One anonymous mapping cut into fixed-size slots; the kernel commits a page on its first write.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::error::StoreError;

/// When the arena's pages are committed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Prefault {
    /// On first write to each page.
    #[default]
    OnWrite,
    /// All of them at construction.
    Now,
    /// All of them, from a thread: construction does not wait, a put may take a fault itself.
    Background,
}

/// The thread committing the arena's pages in the background, and its stop flag.
struct Populator {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
    /// The process that started the thread: a forked child must neither join nor query it.
    pid: u32,
}

impl Populator {
    fn in_this_process(&self) -> bool {
        self.pid == std::process::id()
    }
}

/// Fixed-size byte slots in one anonymous mapping.
pub struct Arena {
    base: NonNull<u8>,
    len: usize,
    object_nbytes: usize,
    num_slots: usize,
    populator: Option<Populator>,
}

// SAFETY: the arena owns its mapping; reads take `&self`, writes `&mut self`, as for a `Vec<u8>`.
unsafe impl Send for Arena {}
// SAFETY: see `Send`: `&Arena` gives read-only access.
unsafe impl Sync for Arena {}

impl Arena {
    #[cfg(test)]
    pub fn new(num_slots: usize, object_nbytes: usize) -> Result<Self, StoreError> {
        Self::with_prefault(num_slots, object_nbytes, false)
    }

    /// As `new`; with `prefault`, every page is committed now (in huge pages where allowed).
    #[cfg(test)]
    pub fn with_prefault(
        num_slots: usize,
        object_nbytes: usize,
        prefault: bool,
    ) -> Result<Self, StoreError> {
        let prefault = if prefault { Prefault::Now } else { Prefault::OnWrite };
        Self::with_commit(num_slots, object_nbytes, prefault)
    }

    pub fn with_commit(
        num_slots: usize,
        object_nbytes: usize,
        prefault: Prefault,
    ) -> Result<Self, StoreError> {
        let len = Self::checked_len(num_slots, object_nbytes)?;
        let base = map_anonymous(len)?;
        let mut arena = Self { base, len, object_nbytes, num_slots, populator: None };
        match prefault {
            Prefault::OnWrite => {}
            Prefault::Now => arena.populate(),
            Prefault::Background => arena.populate_in_background(),
        }
        Ok(arena)
    }

    /// Commits every page: huge pages first (fewer faults and TLB misses), then a write per page.
    fn populate(&self) {
        self.advise_huge_pages();
        let base = self.base.as_ptr().cast::<libc::c_void>();
        // SAFETY: our own mapping; MADV_POPULATE_WRITE faults pages in, bytes unchanged.
        let populated = unsafe { libc::madvise(base, self.len, MADV_POPULATE_WRITE) } == 0;
        if !populated {
            let page = 4096;
            for offset in (0..self.len).step_by(page) {
                // SAFETY: offset < len, inside our mapping; writing a zero keeps the contents.
                unsafe { self.base.as_ptr().add(offset).write_volatile(0) };
            }
        }
    }

    fn advise_huge_pages(&self) {
        // SAFETY: our own mapping; madvise changes only how it is backed.
        unsafe {
            libc::madvise(self.base.as_ptr().cast(), self.len, libc::MADV_HUGEPAGE);
        }
    }

    /// Commits the pages from a thread with `MADV_POPULATE_WRITE`, which puts may race safely.
    /// In 4 KiB pages: huge pages asked for here are made while the engine runs its first
    /// steps, and the kernel compacts memory for them (`defrag=madvise` by default), which
    /// stalled vLLM's engine thread: the first 100 steps of `benches/worker.py --schedule
    /// vllm-scheduler --cold` took 470-590 ms with the advice, 90-110 ms without (97 ms once
    /// the commit is over), and reads are no slower once committed.
    fn populate_in_background(&mut self) {
        let stop = Arc::new(AtomicBool::new(false));
        let (base, len) = (self.base.as_ptr() as usize, self.len);
        let flag = Arc::clone(&stop);
        let spawned =
            std::thread::Builder::new().name("aostore-prefault".to_owned()).spawn(move || {
                crate::sched::yield_to_running_threads();
                // 2 MiB a call: the call holds the address space's lock, and a thread that maps
                // or unmaps meanwhile (numpy freeing a large array in vLLM's engine thread)
                // waits for the whole call, and every fault after it waits too.
                const CHUNK: usize = 2 << 20;
                let mut offset = 0;
                while offset < len && !flag.load(Ordering::Acquire) {
                    let n = CHUNK.min(len - offset);
                    // SAFETY: mapped until this thread is joined (before munmap/mremap).
                    let rc = unsafe {
                        libc::madvise((base + offset) as *mut libc::c_void, n, MADV_POPULATE_WRITE)
                    };
                    if rc != 0 {
                        return;
                    }
                    offset += n;
                }
            });
        // No thread (a process at its thread limit): pages are committed on first write.
        if let Ok(thread) = spawned {
            self.populator = Some(Populator { stop, thread, pid: std::process::id() });
        }
    }

    /// Stops and joins the populator; a forked child forgets the handle (the thread is not there).
    fn stop_populating(&mut self) {
        if let Some(populator) = self.populator.take() {
            if !populator.in_this_process() {
                std::mem::forget(populator.thread);
                return;
            }
            populator.stop.store(true, Ordering::Release);
            let _ = populator.thread.join();
        }
    }

    /// Whether a background populator is still committing pages (never in a forked child).
    #[cfg(test)]
    pub fn is_populating(&self) -> bool {
        self.populator.as_ref().is_some_and(|p| p.in_this_process() && !p.thread.is_finished())
    }

    fn checked_len(num_slots: usize, object_nbytes: usize) -> Result<usize, StoreError> {
        num_slots.checked_mul(object_nbytes).filter(|&len| len <= isize::MAX as usize).ok_or(
            StoreError::CapacityTooLarge {
                num_slots: num_slots as u64,
                object_nbytes: object_nbytes as u64,
            },
        )
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Start of the mapping, for registering it with a device driver.
    pub fn as_ptr(&self) -> *const u8 {
        self.base.as_ptr()
    }

    /// Starts loading the first 256 bytes of `slot` (the hardware prefetcher follows the rest).
    #[inline]
    pub fn prefetch_slot(&self, slot: u32) {
        #[cfg(target_arch = "x86_64")]
        if (slot as usize) < self.num_slots {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let start = (slot as usize) * self.object_nbytes;
            let lines = self.object_nbytes.min(256);
            for offset in (0..lines).step_by(64) {
                // SAFETY: a prefetch never faults or writes; the address is in the mapping.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(
                        self.base.as_ptr().add(start + offset).cast::<i8>(),
                    );
                }
            }
        }
    }

    #[inline]
    pub fn slot(&self, slot: u32) -> &[u8] {
        let slot = slot as usize;
        assert!(slot < self.num_slots, "slot {slot} out of range");
        // SAFETY: slot < num_slots, so the range lies inside the live mapping.
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(slot * self.object_nbytes),
                self.object_nbytes,
            )
        }
    }

    #[inline]
    pub fn slot_mut(&mut self, slot: u32) -> &mut [u8] {
        let slot = slot as usize;
        assert!(slot < self.num_slots, "slot {slot} out of range");
        // SAFETY: in range as in `slot`; `&mut self` makes this the only live reference.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.as_ptr().add(slot * self.object_nbytes),
                self.object_nbytes,
            )
        }
    }

    /// Copies `payload` into a slot, streaming when large: it is read much later, so loading its
    /// old lines only costs bandwidth. Call `flush_writes` before another thread reads it.
    #[inline]
    pub fn write_slot(&mut self, slot: u32, payload: &[u8]) {
        let dst = self.slot_mut(slot);
        assert_eq!(dst.len(), payload.len(), "payload size");
        #[cfg(target_arch = "x86_64")]
        if payload.len() >= STREAMING_MIN_BYTES {
            stream_copy(dst, payload);
            return;
        }
        dst.copy_from_slice(payload);
    }

    #[inline]
    pub fn span(&self, first: u32, len: usize) -> &[u8] {
        let start = first as usize * self.object_nbytes;
        assert!(start.checked_add(len).is_some_and(|end| end <= self.len), "span out of range");
        // SAFETY: start + len <= self.len, inside the live mapping.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(start), len) }
    }

    /// `write_slot` for a payload that runs on through the slots after `first`.
    #[inline]
    pub fn write_span(&mut self, first: u32, payload: &[u8]) {
        let start = first as usize * self.object_nbytes;
        let len = payload.len();
        assert!(start.checked_add(len).is_some_and(|end| end <= self.len), "span out of range");
        // SAFETY: in range as checked above; `&mut self` makes this the only live reference.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(start), len) };
        #[cfg(target_arch = "x86_64")]
        if len >= STREAMING_MIN_BYTES {
            stream_copy(dst, payload);
            return;
        }
        dst.copy_from_slice(payload);
    }

    /// As `write_span`, streaming the last partial line whole, zero-padded (no read-modify-write).
    #[inline]
    pub fn write_span_padded(&mut self, first: u32, payload: &[u8]) {
        let start = first as usize * self.object_nbytes;
        let len = payload.len();
        let padded = len.next_multiple_of(64);
        let aligned = (self.base.as_ptr() as usize + start) % 64 == 0;
        if !cfg!(target_arch = "x86_64") || len < STREAMING_MIN_BYTES || !aligned {
            self.write_span(first, payload);
            return;
        }
        assert!(start.checked_add(padded).is_some_and(|end| end <= self.len), "span out of range");
        // SAFETY: in range as checked above; `&mut self` makes this the only live reference.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(start), padded) };
        let whole = len / 64 * 64;
        #[cfg(target_arch = "x86_64")]
        {
            stream_copy(&mut dst[..whole], &payload[..whole]);
            if whole < len {
                let mut line = [0u8; 64];
                line[..len - whole].copy_from_slice(&payload[whole..]);
                stream_copy(&mut dst[whole..], &line);
            }
        }
    }

    /// Orders earlier streaming stores before later accesses, for a reader behind the lock.
    #[inline]
    pub fn flush_writes(&self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: sfence has no preconditions; SSE is part of the x86_64 baseline.
        unsafe {
            std::arch::x86_64::_mm_sfence();
        }
    }

    /// Grows the arena to `num_slots` slots, keeping each slot's bytes; the base may move.
    pub fn grow(&mut self, num_slots: usize) -> Result<(), StoreError> {
        assert!(num_slots >= self.num_slots, "an arena never shrinks");
        let len = Self::checked_len(num_slots, self.object_nbytes)?;
        self.stop_populating();
        // SAFETY: our own live mapping; MREMAP_MAYMOVE may move it, and `base` is replaced at once.
        let moved =
            unsafe { libc::mremap(self.base.as_ptr().cast(), self.len, len, libc::MREMAP_MAYMOVE) };
        if moved == libc::MAP_FAILED {
            return Err(StoreError::ArenaUnavailable { bytes: len, errno: last_errno() });
        }
        self.base = NonNull::new(moved.cast()).expect("mremap returned null");
        self.len = len;
        self.num_slots = num_slots;
        Ok(())
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("num_slots", &self.num_slots)
            .field("object_nbytes", &self.object_nbytes)
            .finish_non_exhaustive()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.stop_populating();
        // SAFETY: a mapping we own, not borrowed past `drop`.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0, "munmap failed");
    }
}

/// Copies `parts`, one after another, into `dst` (exactly as long as all of them). With
/// `streaming`, each large part goes past the cache and the stores are ordered before what
/// follows: for bytes that another process reads later (an R3 arena's rows), where loading the
/// destination's old lines and evicting the caller's working set for them only costs.
///
/// # Panics
/// When `dst` is not as long as the parts together.
pub fn copy_parts(parts: &[&[u8]], dst: &mut [u8], streaming: bool) {
    let total: usize = parts.iter().map(|part| part.len()).sum();
    assert_eq!(dst.len(), total, "the destination is not as long as the parts");
    let mut at = 0;
    for part in parts {
        let to = &mut dst[at..at + part.len()];
        at += part.len();
        #[cfg(target_arch = "x86_64")]
        if streaming && part.len() >= STREAMING_MIN_BYTES {
            stream_copy(to, part);
            continue;
        }
        to.copy_from_slice(part);
    }
    #[cfg(target_arch = "x86_64")]
    if streaming {
        // SAFETY: sfence has no preconditions; SSE is part of the x86_64 baseline.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
}

/// Payloads below this size are copied with plain stores: the stream setup is not worth it.
const STREAMING_MIN_BYTES: usize = 512;

/// `dst.copy_from_slice(src)`, streaming the aligned middle 32 bytes a time with AVX2, else 16.
#[cfg(target_arch = "x86_64")]
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        unsafe { stream_copy_avx2(dst, src) }
    } else {
        stream_copy_sse2(dst, src)
    }
}

/// Copies `src` to `dst`: plain copies outside `dst`'s `LANE`-aligned middle, `stream` within.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn copy_by_lanes<const LANE: usize>(dst: &mut [u8], src: &[u8], stream: impl Fn(&mut [u8], &[u8])) {
    let head = dst.as_ptr().align_offset(LANE).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / LANE * LANE;
    let (dst_body, src_body) = (&mut dst[head..head + body], &src[head..head + body]);
    for (d, s) in dst_body.chunks_exact_mut(LANE).zip(src_body.chunks_exact(LANE)) {
        stream(d, s);
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

#[cfg(target_arch = "x86_64")]
fn stream_copy_sse2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{_mm_loadu_si128, _mm_stream_si128};
    copy_by_lanes::<16>(dst, src, |d, s| {
        // SAFETY: `d` is 16 aligned bytes, `s` 16 readable (`copy_by_lanes`); SSE2 is baseline.
        unsafe { _mm_stream_si128(d.as_mut_ptr().cast(), _mm_loadu_si128(s.as_ptr().cast())) }
    });
}

/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_copy_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{_mm256_loadu_si256, _mm256_stream_si256};
    copy_by_lanes::<32>(dst, src, |d, s| {
        // SAFETY: `d` is 32 aligned bytes and `s` 32 readable ones; the caller vouches for AVX2.
        unsafe { _mm256_stream_si256(d.as_mut_ptr().cast(), _mm256_loadu_si256(s.as_ptr().cast())) }
    });
}

fn map_anonymous(len: usize) -> Result<NonNull<u8>, StoreError> {
    // SAFETY: a fresh private anonymous mapping aliases nothing; we check the result.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            // NORESERVE: overcommit limits must not refuse pages a worst-case arena never touches.
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(StoreError::ArenaUnavailable { bytes: len, errno: last_errno() });
    }
    Ok(NonNull::new(base.cast()).expect("mmap returned null"))
}

/// `madvise` advice that faults pages in for writing (Linux 5.14; older kernels refuse it).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Commits the pages under `[start, start + len)` without changing a byte; whether it could.
pub(crate) fn commit_pages(start: *const u8, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let page = 4096;
    let first = (start as usize) & !(page - 1);
    let end = (start as usize).saturating_add(len).next_multiple_of(page);
    // SAFETY: the advice only faults pages in, never changes their bytes; an unmapped range fails.
    unsafe { libc::madvise(first as *mut libc::c_void, end - first, MADV_POPULATE_WRITE) == 0 }
}

/// Asks for huge pages under `[start, start + len)`: random reads there miss the TLB otherwise.
pub(crate) fn advise_huge_pages(start: *const u8, len: usize) {
    const HUGE: usize = 2 << 20;
    let first = (start as usize).next_multiple_of(HUGE);
    let end = (start as usize).saturating_add(len) & !(HUGE - 1);
    if end > first {
        // SAFETY: the advice changes only how the caller's pages are backed; unmapped fails.
        unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
    }
}

/// `advise_huge_pages` over a `Vec`'s capacity.
pub(crate) fn advise_huge_pages_for<T>(v: &Vec<T>) {
    advise_huge_pages(v.as_ptr().cast(), v.capacity() * std::mem::size_of::<T>());
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn background_prefault_keeps_what_puts_write_meanwhile() {
        let slots = 4096;
        let mut arena = Arena::with_commit(slots, 4096, Prefault::Background).unwrap();
        for slot in 0..slots as u32 {
            arena.write_slot(slot, &[(slot % 251) as u8; 4096]);
        }
        arena.flush_writes();
        while arena.is_populating() {
            std::thread::yield_now();
        }
        for slot in 0..slots as u32 {
            assert!(arena.slot(slot).iter().all(|&b| b == (slot % 251) as u8), "slot {slot}");
        }
        // Dropped (and grown) while populating: the thread is stopped before the unmap.
        let mut arena = Arena::with_commit(1 << 14, 1 << 14, Prefault::Background).unwrap();
        arena.grow(1 << 15).unwrap();
        drop(arena);
    }

    #[test]
    fn slots_are_disjoint_and_zeroed() {
        let mut arena = Arena::new(4, 3).unwrap();
        assert_eq!(arena.len(), 12);
        assert!(arena.slot(3).iter().all(|&b| b == 0));
        arena.slot_mut(1).copy_from_slice(b"abc");
        arena.slot_mut(2).copy_from_slice(b"xyz");
        assert_eq!(arena.slot(1), b"abc");
        assert_eq!(arena.slot(2), b"xyz");
        assert_eq!(arena.slot(0), b"\0\0\0");
    }

    #[test]
    fn grow_keeps_bytes_at_their_slot() {
        let mut arena = Arena::new(2, 4096).unwrap();
        arena.slot_mut(1).fill(7);
        arena.grow(1000).unwrap();
        assert_eq!(arena.num_slots(), 1000);
        assert!(arena.slot(1).iter().all(|&b| b == 7));
        arena.slot_mut(999).fill(9);
        assert!(arena.slot(999).iter().all(|&b| b == 9));
    }

    #[test]
    fn prefaulted_arena_is_zeroed_and_writable() {
        let mut arena = Arena::with_prefault(1000, 5000, true).unwrap();
        assert!(arena.slot(999).iter().all(|&b| b == 0));
        arena.slot_mut(500).fill(1);
        assert!(arena.slot(500).iter().all(|&b| b == 1));
    }

    #[test]
    fn copy_parts_streaming_joins_parts_of_any_size_at_any_alignment() {
        let source: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for offset in [0, 1, 13, 64] {
            for cuts in [vec![], vec![5], vec![511, 512, 513], vec![4096, 65_536, 69_000]] {
                let mut parts = Vec::new();
                let mut from = 0;
                for &cut in &cuts {
                    parts.push(&source[from..cut]);
                    from = cut;
                }
                parts.push(&source[from..]);
                let mut buffer = vec![0u8; source.len() + offset];
                copy_parts(&parts, &mut buffer[offset..], true);
                assert_eq!(&buffer[offset..], &source[..], "offset {offset}, cuts {cuts:?}");
                assert!(buffer[..offset].iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    #[should_panic(expected = "not as long as the parts")]
    fn copy_parts_refuses_a_destination_of_another_length() {
        copy_parts(&[b"abc"], &mut [0u8; 4], true);
    }

    #[test]
    fn streaming_writes_copy_every_byte_at_any_alignment() {
        for object_nbytes in [1, 15, 511, 512, 513, 5_888, 4_097] {
            let mut arena = Arena::new(3, object_nbytes).unwrap();
            let payload: Vec<u8> = (0..object_nbytes).map(|i| (i * 7 + 3) as u8).collect();
            arena.write_slot(1, &payload);
            arena.flush_writes();
            assert_eq!(arena.slot(1), &payload[..], "object_nbytes={object_nbytes}");
            assert!(arena.slot(0).iter().chain(arena.slot(2)).all(|&b| b == 0));
        }
    }

    /// Both stream copies, at every alignment within 32 bytes and lengths around the store sizes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_stream_copies_write_exactly_the_destination() {
        let src: Vec<u8> = (0..6_000).map(|i| (i * 13 + 1) as u8).collect();
        type CopyFn = fn(&mut [u8], &[u8]);
        let mut copies: Vec<(&str, CopyFn)> = vec![("sse2", stream_copy_sse2)];
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present, checked just above.
            copies.push(("avx2", |d, s| unsafe { stream_copy_avx2(d, s) }));
        }
        for (name, copy) in copies {
            for offset in 0..32 {
                for len in [0, 1, 15, 16, 31, 32, 33, 63, 64, 65, 127, 511, 512, 5_888] {
                    let mut buffer = vec![0xAAu8; 64 + len + 64];
                    // `offset` bytes past a 32-byte boundary; at most 63 bytes in.
                    let start = buffer.as_ptr().align_offset(32) + offset;
                    copy(&mut buffer[start..start + len], &src[..len]);
                    assert_eq!(&buffer[start..start + len], &src[..len], "{name} {offset} {len}");
                    assert!(buffer[..start].iter().all(|&b| b == 0xAA), "{name} before");
                    assert!(buffer[start + len..].iter().all(|&b| b == 0xAA), "{name} after");
                }
            }
        }
    }

    #[test]
    fn spans_run_across_slots() {
        let mut arena = Arena::new(4, 3).unwrap();
        arena.write_span(1, b"abcdefg");
        arena.flush_writes();
        assert_eq!(arena.span(1, 7), b"abcdefg");
        assert_eq!(arena.slot(2), b"def");
        assert_eq!(arena.span(0, 0), b"");
        let big: Vec<u8> = (0..4_000u32).map(|i| (i % 251) as u8).collect();
        let mut arena = Arena::new(20, 256).unwrap();
        arena.write_span(3, &big);
        arena.flush_writes();
        assert_eq!(arena.span(3, big.len()), &big[..]);
    }

    #[test]
    fn padded_spans_fill_the_last_line() {
        let mut arena = Arena::new(8, 256).unwrap();
        arena.write_span(0, &[9; 2048]);
        let payload: Vec<u8> = (0..700u32).map(|i| (i % 253) as u8).collect();
        arena.write_span_padded(1, &payload);
        arena.flush_writes();
        assert_eq!(arena.span(1, 700), &payload[..]);
        assert!(arena.span(1, 704)[700..].iter().all(|&b| b == 0), "padded to the line");
        assert!(arena.span(1, 768)[704..].iter().all(|&b| b == 9), "nothing past the line");
        arena.write_span_padded(7, &payload[..100]); // short: plain copy
        assert_eq!(arena.span(7, 100), &payload[..100]);
    }

    #[test]
    #[should_panic(expected = "span out of range")]
    fn span_past_the_end_panics() {
        let arena = Arena::new(2, 8).unwrap();
        let _ = arena.span(1, 9);
    }

    #[test]
    fn overflowing_size_is_an_error_not_a_crash() {
        assert!(matches!(Arena::new(usize::MAX / 2, 4), Err(StoreError::CapacityTooLarge { .. })));
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn slot_out_of_range_panics() {
        let arena = Arena::new(2, 8).unwrap();
        let _ = arena.slot(2);
    }
}
