//! Criterion benches for the core: puts of 1 and 64 objects (all evicting in steady state) at
//! 10k, 300k and 1M slots with 0%, 90% and 99% of the keys referenced; reads; retain/release;
//! and the slab's LRU operations alone.

use aostore::slab::Slab;
use aostore::{BlockRef, BlockStore};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

const OBJECT_NBYTES: usize = 64;

fn key(i: usize) -> String {
    format!("vllm-artifact/0/{:064x}", (i as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// A full store of `slots` keys whose oldest `referenced_pct`% are referenced.
fn full_store(slots: usize, referenced_pct: usize) -> BlockStore {
    let mut store = BlockStore::new(slots * OBJECT_NBYTES, OBJECT_NBYTES).unwrap();
    let payload = [7u8; OBJECT_NBYTES];
    let referenced = slots * referenced_pct / 100;
    for start in (0..slots).step_by(1024) {
        let keys: Vec<String> = (start..(start + 1024).min(slots)).map(key).collect();
        let objects: Vec<BlockRef<'_>> =
            keys.iter().map(|k| BlockRef { key: k, payload: &payload }).collect();
        store.put(&objects, &[], &[]).unwrap();
    }
    for start in (0..referenced).step_by(4096) {
        let keys: Vec<String> = (start..(start + 4096).min(referenced)).map(key).collect();
        let retains: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.put(&[], &retains, &[]).unwrap();
    }
    store
}

fn evicting_put(c: &mut Criterion) {
    let mut group = c.benchmark_group("evicting_put");
    group.sample_size(20);
    for &slots in &[10_000usize, 300_000, 1_000_000] {
        for &pct in &[0usize, 90, 99] {
            for &batch in &[1usize, 64] {
                let mut store = full_store(slots, pct);
                let payload = [3u8; OBJECT_NBYTES];
                let mut next = slots;
                let id = BenchmarkId::new(format!("slots={slots}/batch={batch}"), pct);
                group.bench_function(id, |b| {
                    b.iter(|| {
                        let keys: Vec<String> = (next..next + batch).map(key).collect();
                        next += batch;
                        let objects: Vec<BlockRef<'_>> =
                            keys.iter().map(|k| BlockRef { key: k, payload: &payload }).collect();
                        store.put(&objects, &[], &[]).unwrap();
                    });
                });
            }
        }
    }
    group.finish();
}

fn read(c: &mut Criterion) {
    let slots = 300_000;
    let mut store = full_store(slots, 0);
    let keys: Vec<String> = (0..64).map(|i| key(i * 4_649 % slots)).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut out = vec![0u8; keys.len() * OBJECT_NBYTES];
    c.bench_function("get_into/64 of 300k", |b| {
        b.iter(|| store.get_into(&keys, &mut out).unwrap())
    });
}

fn retain_release(c: &mut Criterion) {
    let slots = 300_000;
    let mut store = full_store(slots, 0);
    let keys: Vec<String> = (0..64).map(|i| key(i * 4_649 % slots)).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.bench_function("retain+release/64 of 300k", |b| {
        b.iter(|| {
            store.put(&[], &keys, &[]).unwrap();
            store.put(&[], &[], &keys).unwrap();
        });
    });
}

fn lru_alone(c: &mut Criterion) {
    let n = 100_000u32;
    let mut slab = Slab::with_capacity(n as usize);
    let idx: Vec<u32> = (0..n)
        .map(|i| {
            let key = key(i as usize);
            let probe = slab.codec.probe_for_insert(&key);
            let e = slab.insert(&key, &probe);
            slab[e].slot = i;
            slab.push_back(e);
            e
        })
        .collect();
    let mut i = 0usize;
    c.bench_function("slab/move_to_back", |b| {
        b.iter(|| {
            i = (i + 7_919) % idx.len();
            slab.move_to_back(idx[i]);
        });
    });
    c.bench_function("slab/unlink+push_back", |b| {
        b.iter(|| {
            i = (i + 7_919) % idx.len();
            slab.unlink(idx[i]);
            slab.push_back(idx[i]);
        });
    });
}

criterion_group!(benches, evicting_put, read, retain_release, lru_alone);
criterion_main!(benches);
