//! W2's steady churn on the core alone (no Python): ns per object for put and get, to split a
//! Python-level figure into core and binding. `cargo bench --bench w2_core -- [slots]
//! [object_nbytes] [batches] [prefault: 0 or 1]`

use std::time::Instant;

use aostore::{BlockRef, BlockStore, Prefault, StoreOptions};

fn key(i: u64) -> String {
    format!("vllm-artifact/0/{:064x}", u128::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn main() {
    // cargo bench adds flags such as --bench; the numbers are ours.
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .map(|a| a.parse().expect("a number"))
        .collect();
    let slots = args.first().copied().unwrap_or(167_341);
    let nbytes = args.get(1).copied().unwrap_or(64);
    let batches = args.get(2).copied().unwrap_or(4_000);
    let prefault =
        if args.get(3).copied().unwrap_or(0) == 1 { Prefault::Now } else { Prefault::OnWrite };
    let mut store = BlockStore::with_options(
        slots * nbytes,
        nbytes,
        StoreOptions::default().prefault(prefault),
    )
    .unwrap();
    let payload = vec![7u8; nbytes];
    let mut next = 0u64;
    while (next as usize) < slots {
        let keys: Vec<String> = (0..64).map(|i| key(next + i)).collect();
        let blocks: Vec<BlockRef<'_>> =
            keys.iter().map(|k| BlockRef { key: k, payload: &payload }).collect();
        store.put(&blocks, &[], &[]).unwrap();
        next += 64;
    }
    // Keys are made just before their put, as an engine makes them: hot in cache.
    let plan = (0..batches as u64).map(|b| {
        let fresh: Vec<String> = (0..64).map(|i| key(next + b * 64 + i)).collect();
        let old: Vec<String> = if b == 0 {
            Vec::new()
        } else {
            (0..64).map(|i| key(next + (b - 1) * 64 + i)).collect()
        };
        (fresh, old)
    });
    let mut state = 1u64;
    let mut put_ns = 0u128;
    let mut get_ns = 0u128;
    let mut out = vec![0u8; 64 * nbytes];
    for (b, (fresh, old)) in plan.enumerate() {
        let blocks: Vec<BlockRef<'_>> =
            fresh.iter().map(|k| BlockRef { key: k, payload: &payload }).collect();
        let retains: Vec<&str> = fresh.iter().map(String::as_str).collect();
        let releases: Vec<&str> = old.iter().map(String::as_str).collect();
        let t = Instant::now();
        store.put(&blocks, &retains, &releases).unwrap();
        put_ns += t.elapsed().as_nanos();
        let newest = next + (b as u64 + 1) * 64;
        let wanted: Vec<String> = (0..64)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                key(newest - 1 - (state >> 33) % (slots as u64 / 2))
            })
            .collect();
        let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();
        let t = Instant::now();
        store.get_into(&wanted, &mut out).unwrap();
        get_ns += t.elapsed().as_nanos();
    }
    let objects = (batches * 64) as f64;
    println!(
        "core put {:.0} ns/object, get {:.0} ns/object",
        put_ns as f64 / objects,
        get_ns as f64 / objects
    );
}
