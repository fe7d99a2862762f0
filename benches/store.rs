//! Criterion benches for the core: evicting puts with many referenced keys, and reads.

use aostore::{BlockRef, BlockStore};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

const OBJECT_NBYTES: usize = 64;

/// A full store of `slots` keys whose oldest `referenced_pct`% are referenced.
fn full_store(slots: usize, referenced_pct: usize) -> BlockStore {
    let mut store = BlockStore::new(slots * OBJECT_NBYTES, OBJECT_NBYTES).unwrap();
    let payload = [7u8; OBJECT_NBYTES];
    let referenced = slots * referenced_pct / 100;
    let keys: Vec<String> = (0..slots).map(|i| format!("key-{i:016x}")).collect();
    for chunk in keys.chunks(1024) {
        let objects: Vec<BlockRef<'_>> =
            chunk.iter().map(|k| BlockRef { key: k, payload: &payload }).collect();
        store.put(&objects, &[], &[]).unwrap();
    }
    let retains: Vec<&str> = keys[..referenced].iter().map(String::as_str).collect();
    store.put(&[], &retains, &[]).unwrap();
    store
}

fn evicting_put(c: &mut Criterion) {
    let mut group = c.benchmark_group("evicting_put");
    for &slots in &[10_000usize, 300_000] {
        for &pct in &[0usize, 90, 99] {
            for &batch in &[1usize, 64] {
                let mut store = full_store(slots, pct);
                let payload = [3u8; OBJECT_NBYTES];
                let mut next = 0u64;
                let id = BenchmarkId::new(format!("slots={slots}/batch={batch}"), pct);
                group.bench_function(id, |b| {
                    b.iter(|| {
                        let keys: Vec<String> =
                            (0..batch).map(|i| format!("new-{next:x}-{i}")).collect();
                        next += 1;
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
    let slots = 100_000;
    let mut store = full_store(slots, 0);
    let keys: Vec<String> = (0..64).map(|i| format!("key-{:016x}", i * 1_531 % slots)).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut out = vec![0u8; keys.len() * OBJECT_NBYTES];
    c.bench_function("get_into/64", |b| b.iter(|| store.get_into(&keys, &mut out).unwrap()));
}

criterion_group!(benches, evicting_put, read);
criterion_main!(benches);
