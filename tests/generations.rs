//! Keys over an RL run: vLLM bumps the key's namespace (`vllm-artifact/{generation}/`) at every
//! prefix-cache reset, i.e. every weight sync. The heap a key costs, counted by a global
//! allocator, must be the same at generation 10,000 as at generation 0, and the same with
//! keys of hundreds of generations stored at once.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use aostore::{BlockRef, BlockStore};

struct Counting;

static HEAP: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HEAP.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HEAP.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The count is process-wide: one test measures at a time.
static MEASURING: Mutex<()> = Mutex::new(());

const SLOTS: usize = 1_024;
const NBYTES: usize = 64;

fn key(generation: usize, i: usize) -> String {
    let digest = (i as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    format!("vllm-artifact/{generation}/{digest:032x}{:032x}", generation as u128 ^ digest)
}

/// Puts keys `first..first + count` of `generation` (64 a call), each evicting once the store
/// is full.
fn fill(store: &mut BlockStore, generation: usize, first: usize, count: usize) {
    let payload = [7u8; NBYTES];
    let end = first + count;
    for start in (first..end).step_by(64) {
        let keys: Vec<String> =
            (start..(start + 64).min(end)).map(|i| key(generation, i)).collect();
        let blocks: Vec<BlockRef<'_>> =
            keys.iter().map(|k| BlockRef { key: k, payload: &payload }).collect();
        store.put(&blocks, &[], &[]).unwrap();
    }
}

/// Heap bytes a store holds once full of keys of `generation`, after `churn` took it through
/// earlier generations.
fn heap_of_a_full_store(churn: impl FnOnce(&mut BlockStore), generation: usize) -> isize {
    let before = HEAP.load(Ordering::Relaxed);
    let mut store = BlockStore::new(SLOTS * NBYTES, NBYTES).unwrap();
    churn(&mut store);
    fill(&mut store, generation, 0, SLOTS);
    let after = HEAP.load(Ordering::Relaxed);
    store.check().unwrap();
    for i in [0, SLOTS / 2, SLOTS - 1] {
        assert_eq!(store.get_concatenated(&[key(generation, i).as_str()]).unwrap().len(), NBYTES);
    }
    after - before
}

#[test]
fn a_key_costs_the_same_heap_at_generation_ten_thousand_as_at_zero() {
    let _one = MEASURING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let at_zero = heap_of_a_full_store(|_| {}, 0);
    // A put of 16 keys a generation: 64 generations are stored at any time.
    let at_ten_thousand = heap_of_a_full_store(
        |store| {
            for generation in 1..10_000 {
                fill(store, generation, 0, 16);
            }
        },
        10_000,
    );
    // The prefix table's room for 64 prefixes (about 170 bytes each) is all it may add; a key
    // held as text costs about 100 bytes more.
    assert!(
        at_ten_thousand <= at_zero + 64 * 256,
        "generation 10,000: {at_ten_thousand} heap bytes, generation 0: {at_zero}"
    );
}

#[test]
fn keys_of_hundreds_of_live_generations_cost_no_more_heap() {
    let _one = MEASURING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let at_zero = heap_of_a_full_store(|_| {}, 0);
    // 512 generations of 2 keys each fill the store; all of them stay stored.
    let before = HEAP.load(Ordering::Relaxed);
    let mut many = BlockStore::new(SLOTS * NBYTES, NBYTES).unwrap();
    for generation in 0..512 {
        fill(&mut many, generation, 0, SLOTS / 512);
    }
    let after = HEAP.load(Ordering::Relaxed);
    many.check().unwrap();
    assert_eq!(many.stats().stored, SLOTS);
    // The prefix table (about 130 bytes a prefix: its text twice, its number, its count) is
    // all the extra heap; a key held as text would cost 100 bytes more each.
    let heap = after - before;
    assert!(heap <= at_zero + 512 * 160, "{heap} heap bytes, generation 0: {at_zero}");
}
