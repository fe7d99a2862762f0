//! Reads that do not fail, on the fixed store: `get_many_into` against per-key reads, and
//! `contains_many` against `contains`, over random contents; neither touches missing keys.

use aostore::{BlockRef, BlockStore, StoreError};
use proptest::prelude::*;

const NBYTES: usize = 3;

fn key(k: u8) -> String {
    format!("k{k}")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn get_many_is_the_stored_keys_in_order(
        stored in prop::collection::vec(0u8..10, 0..8),
        referenced in prop::collection::vec(0u8..10, 0..3),
        wanted in prop::collection::vec(0u8..12, 0..8),
    ) {
        let mut store = BlockStore::new(6 * NBYTES, NBYTES).unwrap();
        let keys: Vec<String> = stored.iter().copied().map(key).collect();
        let retains: Vec<String> = referenced.iter().copied().map(key).collect();
        let retains: Vec<&str> = retains.iter().map(String::as_str).collect();
        for k in &keys {
            let payload = [k.as_bytes()[1]; NBYTES];
            // Some puts are refused when everything is referenced; that is fine here.
            let _ = store.put(&[BlockRef { key: k, payload: &payload }], &retains, &[]);
        }
        let wanted: Vec<String> = wanted.into_iter().map(key).collect();
        let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();
        let present: Vec<bool> = wanted.iter().map(|k| store.contains(k)).collect();
        prop_assert_eq!(&store.contains_many(&wanted).unwrap(), &present);
        let lru_before: Vec<String> = store.lru_keys().into_iter().map(|k| k.into_owned()).collect();

        let mut expected: Vec<u8> = Vec::new();
        let mut expected_missing = Vec::new();
        for (i, k) in wanted.iter().enumerate() {
            if present[i] {
                expected.extend(store.objects().into_iter().find(|(s, _)| s == k).unwrap().1.iter());
            } else {
                expected_missing.push(i);
            }
        }
        let mut out = vec![0; wanted.len() * NBYTES];
        let mut missing = Vec::new();
        let written = store.get_many_into(&wanted, &mut out, &mut missing).unwrap();
        prop_assert_eq!(&out[..written], &expected[..]);
        prop_assert_eq!(&missing, &expected_missing);
        store.check().unwrap();

        // The LRU moves are those of a successful read of the present keys alone.
        let mut reference = lru_before;
        for (k, &here) in wanted.iter().zip(&present) {
            if here && reference.iter().any(|r| r == k) {
                reference.retain(|r| r != k);
                reference.push((*k).to_owned());
            }
        }
        prop_assert_eq!(store.lru_keys(), reference.iter().map(String::as_str).collect::<Vec<_>>());
    }
}

#[test]
fn get_many_counts_reads_and_misses_and_refuses_when_closed() {
    let mut store = BlockStore::new(4 * NBYTES, NBYTES).unwrap();
    store.put(&[BlockRef { key: "a", payload: b"aaa" }], &[], &[]).unwrap();
    let mut out = vec![0; 3 * NBYTES];
    let mut missing = vec![99];
    let written = store.get_many_into(&["x", "a", "y"], &mut out, &mut missing).unwrap();
    assert_eq!((written, &missing[..]), (NBYTES, &[99, 0, 2][..]));
    assert_eq!(&out[..written], b"aaa");
    let counters = store.stats().counters;
    assert_eq!((counters.reads, counters.read_misses, counters.bytes_read), (1, 2, 3));
    store.close();
    assert_eq!(store.get_many_into(&[], &mut [], &mut missing), Err(StoreError::Closed));
    assert_eq!(store.contains_many(&["a"]), Err(StoreError::Closed));
}
