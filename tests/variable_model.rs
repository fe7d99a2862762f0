//! Model-based test of the variable-size store: random operation sequences run against
//! `VariableStore` and a naive model written straight from SPEC section 13 (a Vec LRU, HashMaps,
//! a snapshot to roll back to), with `check()` after every step and the full contents compared.

use std::collections::HashMap;

use aostore::{BlockRef, StoreError, VariableStore};
use proptest::prelude::*;

#[derive(Debug, Clone, Default)]
struct Model {
    capacity_chunks: usize,
    chunk: usize,
    objects: HashMap<String, Vec<u8>>,
    refs: HashMap<String, u32>,
    lru: Vec<String>,
}

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Bytes(Vec<u8>),
    Many { bytes: Vec<u8>, offsets: Vec<usize>, missing: Vec<usize> },
    Contains(Vec<bool>),
    NotReferenced(String),
    CannotRetain,
    Missing(String),
}

impl Model {
    fn charge(&self, nbytes: usize) -> usize {
        nbytes.div_ceil(self.chunk)
    }

    fn touch(&mut self, key: &str) {
        self.lru.retain(|k| k != key);
        self.lru.push(key.to_owned());
    }

    fn put(
        &mut self,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome {
        let mut counts: HashMap<&str, i64> = HashMap::new();
        for key in retains.iter().chain(releases) {
            counts.insert(key, i64::from(*self.refs.get(key).unwrap_or(&0)));
        }
        for key in retains {
            *counts.get_mut(key.as_str()).unwrap() += 1;
        }
        for key in releases {
            let count = counts.get_mut(key.as_str()).unwrap();
            if *count == 0 {
                return Outcome::NotReferenced(key.clone());
            }
            *count -= 1;
        }
        let before = self.clone();
        let mut unique: Vec<(String, Vec<u8>)> = Vec::new();
        for (key, payload) in objects {
            match unique.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = payload.clone(),
                None => unique.push((key.clone(), payload.clone())),
            }
        }
        for key in retains {
            let count = self.refs.entry(key.clone()).or_insert(0);
            *count += 1;
            if *count == 1 {
                self.lru.retain(|k| k != key);
            }
        }
        let mut released = Vec::new();
        for key in releases {
            let count = self.refs.get_mut(key).unwrap();
            *count -= 1;
            if *count == 0 {
                self.refs.remove(key);
                released.push(key.clone());
            }
        }
        for (key, _) in &unique {
            if !self.refs.contains_key(key) {
                self.touch(key);
            }
        }
        for key in &released {
            if self.objects.contains_key(key) || unique.iter().any(|(k, _)| k == key) {
                self.touch(key);
            }
        }
        // Every batch key holds its new payload; what is not in the batch keeps its own.
        let new_bytes = |key: &str| unique.iter().find(|(k, _)| k == key).map(|(_, p)| p.len());
        let charge_of = |model: &Self, key: &str| {
            model.charge(new_bytes(key).unwrap_or_else(|| model.objects[key].len()))
        };
        let used: usize = self
            .objects
            .keys()
            .filter(|k| new_bytes(k).is_none())
            .map(|k| self.charge(self.objects[k].len()))
            .chain(unique.iter().map(|(_, p)| self.charge(p.len())))
            .sum();
        let need = used.saturating_sub(self.capacity_chunks);
        let mut victims: Vec<String> = Vec::new();
        if need > 0 {
            let protected: Vec<&String> =
                unique.iter().map(|(k, _)| k).filter(|k| !released.contains(k)).collect();
            let mut freed = 0;
            for key in self.lru.iter().filter(|k| !protected.contains(k)) {
                if freed >= need {
                    break;
                }
                freed += charge_of(self, key);
                victims.push(key.clone());
            }
            if freed < need {
                *self = before;
                return Outcome::CannotRetain;
            }
        }
        self.lru.retain(|k| !victims.contains(k));
        for victim in &victims {
            self.objects.remove(victim);
        }
        for (key, payload) in &unique {
            if !victims.contains(key) {
                self.objects.insert(key.clone(), payload.clone());
            }
        }
        Outcome::Ok
    }

    fn touch_read(&mut self, keys: &[String]) {
        for key in keys {
            if self.objects.contains_key(key) && !self.refs.contains_key(key) {
                self.touch(key);
            }
        }
    }

    fn get(&mut self, keys: &[String]) -> Outcome {
        if let Some(missing) = keys.iter().find(|k| !self.objects.contains_key(*k)) {
            return Outcome::Missing(missing.clone());
        }
        let bytes = keys.iter().flat_map(|k| self.objects[k].clone()).collect();
        self.touch_read(keys);
        Outcome::Bytes(bytes)
    }

    fn get_many(&mut self, keys: &[String]) -> Outcome {
        let (mut bytes, mut offsets, mut missing) = (Vec::new(), vec![0], Vec::new());
        for (i, key) in keys.iter().enumerate() {
            match self.objects.get(key) {
                Some(payload) => bytes.extend_from_slice(payload),
                None => missing.push(i),
            }
            offsets.push(bytes.len());
        }
        self.touch_read(keys);
        Outcome::Many { bytes, offsets, missing }
    }
}

fn outcome(result: Result<(), StoreError>) -> Outcome {
    match result {
        Ok(()) => Outcome::Ok,
        Err(StoreError::NotReferenced { key }) => Outcome::NotReferenced(key),
        Err(StoreError::CannotRetainBytes { .. }) => Outcome::CannotRetain,
        Err(StoreError::MissingObject { key, .. }) => Outcome::Missing(key),
        Err(other) => panic!("unexpected error {other:?}"),
    }
}

#[derive(Debug, Clone)]
enum Op {
    Put { objects: Vec<(u8, u8, usize)>, retains: Vec<u8>, releases: Vec<u8> },
    Get(Vec<u8>),
    GetMany(Vec<u8>),
    Contains(Vec<u8>),
}

/// Key `k`: short, logprob-like (about 120 bytes, inline) and over-long (heap) keys mixed.
fn key(k: u8) -> String {
    match k % 3 {
        0 => format!("block-{k}"),
        1 => format!("vllm-logprobs/v1/0/(temperature=1.0, 'top_k': 20)/{:064x}/{k}", k),
        _ => format!("{}-{k}", "x".repeat(170)),
    }
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || prop::collection::vec(0u8..8, 0..5);
    let object =
        (0u8..8, any::<u8>(), prop_oneof![1 => Just(0usize), 6 => 1usize..12, 1 => 12usize..40]);
    prop_oneof![
        5 => (prop::collection::vec(object, 0..5), keys(), keys())
            .prop_map(|(objects, retains, releases)| Op::Put { objects, retains, releases }),
        1 => keys().prop_map(Op::Get),
        1 => keys().prop_map(Op::GetMany),
        1 => keys().prop_map(Op::Contains),
    ]
}

fn assert_same(store: &VariableStore, model: &Model) {
    store.check().unwrap();
    let lru: Vec<&str> = store.lru_keys();
    assert_eq!(lru, model.lru.iter().map(String::as_str).collect::<Vec<_>>(), "LRU order");
    let refs: HashMap<String, u32> =
        store.references().into_iter().map(|(k, c)| (k.to_owned(), c)).collect();
    assert_eq!(refs, model.refs, "reference counts");
    let objects: HashMap<String, Vec<u8>> =
        store.objects().into_iter().map(|(k, p)| (k.to_owned(), p)).collect();
    assert_eq!(objects, model.objects, "stored objects");
    let stored_bytes: usize = model.objects.values().map(Vec::len).sum();
    assert_eq!(store.stats().stored_bytes, stored_bytes as u64);
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000)
}

fn strs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn variable_store_matches_model(
        max_bytes in 1usize..64,
        chunk in prop_oneof![Just(1usize), Just(3), Just(8)],
        ops in prop::collection::vec(op(), 1..40),
    ) {
        prop_assume!(chunk <= max_bytes);
        let mut store = VariableStore::with_options(max_bytes, Some(chunk), false).unwrap();
        let mut model = Model { capacity_chunks: max_bytes / chunk, chunk, ..Model::default() };
        for op in ops {
            match op {
                Op::Put { objects, retains, releases } => {
                    let objects: Vec<(String, Vec<u8>)> =
                        objects.iter().map(|&(k, v, n)| (key(k), vec![v; n])).collect();
                    let retains: Vec<String> = retains.into_iter().map(key).collect();
                    let releases: Vec<String> = releases.into_iter().map(key).collect();
                    let blocks: Vec<BlockRef<'_>> = objects
                        .iter()
                        .map(|(k, p)| BlockRef { key: k, payload: p })
                        .collect();
                    let got = outcome(store.put(&blocks, &strs(&retains), &strs(&releases)));
                    let want = model.put(&objects, &retains, &releases);
                    prop_assert_eq!(got, want);
                }
                Op::Get(keys) => {
                    let keys: Vec<String> = keys.into_iter().map(key).collect();
                    let got = match store.get_concatenated(&strs(&keys)) {
                        Ok(bytes) => Outcome::Bytes(bytes),
                        Err(e) => outcome(Err(e)),
                    };
                    prop_assert_eq!(got, model.get(&keys));
                }
                Op::GetMany(keys) => {
                    let keys: Vec<String> = keys.into_iter().map(key).collect();
                    let (bytes, plan) = store.get_many(&strs(&keys)).unwrap();
                    let got = Outcome::Many {
                        bytes,
                        offsets: plan.offsets().to_vec(),
                        missing: plan.missing().to_vec(),
                    };
                    prop_assert_eq!(got, model.get_many(&keys));
                }
                Op::Contains(keys) => {
                    let keys: Vec<String> = keys.into_iter().map(key).collect();
                    let got = Outcome::Contains(store.contains_many(&strs(&keys)).unwrap());
                    let want = keys.iter().map(|k| model.objects.contains_key(k)).collect();
                    prop_assert_eq!(got, Outcome::Contains(want));
                }
            }
            assert_same(&store, &model);
        }
    }
}

/// With most keys referenced, an evicting put visits only its victims.
#[test]
fn evicting_put_does_not_visit_referenced_keys() {
    let keys: Vec<String> = (0..10_000).map(|i| format!("k{i}")).collect();
    let mut store = VariableStore::with_options(10_000 * 8, Some(8), false).unwrap();
    let refs: Vec<&str> = keys[..9_000].iter().map(String::as_str).collect();
    store.put(&[], &refs, &[]).unwrap();
    let blocks: Vec<BlockRef<'_>> =
        keys.iter().map(|k| BlockRef { key: k, payload: b"12345678" }).collect();
    store.put(&blocks, &[], &[]).unwrap();
    for round in 0..100 {
        let fresh: Vec<String> = (0..64).map(|i| format!("new-{round}-{i}")).collect();
        let batch: Vec<BlockRef<'_>> =
            fresh.iter().map(|k| BlockRef { key: k, payload: b"abcdefgh" }).collect();
        let before = store.stats().counters.eviction_visits;
        store.put(&batch, &[], &[]).unwrap();
        let visits = store.stats().counters.eviction_visits - before;
        assert_eq!(visits, 64, "round {round}: {visits} visits");
    }
    store.check().unwrap();
    assert!(refs.iter().all(|k| store.contains(k)));
    assert!(!store.contains("k9000"));
}

/// Objects of mixed sizes replace each other for a long time: the arena stays exactly
/// accounted for, and a re-put that grows a key evicts only what it must.
#[test]
fn churn_keeps_the_allocator_exact() {
    let mut store = VariableStore::with_options(64 << 10, Some(256), false).unwrap();
    let mut state = 7u64;
    let mut next = || {
        state =
            state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    for step in 0..3_000 {
        let keys: Vec<String> = (0..8).map(|_| format!("key-{}", next() % 200)).collect();
        let payloads: Vec<Vec<u8>> =
            (0..8).map(|i| vec![i as u8; 1_300 + next() % 3_200]).collect();
        let blocks: Vec<BlockRef<'_>> =
            keys.iter().zip(&payloads).map(|(k, p)| BlockRef { key: k, payload: p }).collect();
        store.put(&blocks, &[], &[]).unwrap();
        if step % 97 == 0 {
            store.check().unwrap();
        }
    }
    store.check().unwrap();
    let stats = store.stats();
    assert!(stats.used_bytes <= stats.capacity_bytes);
    // Nearly full after eviction: less than one largest object's chunks are left free.
    assert!(stats.capacity_bytes - stats.used_bytes < 4_500 + 256, "{stats:?}");
}

#[test]
fn closed_store_refuses_everything() {
    let mut store = VariableStore::new(64).unwrap();
    store.close();
    store.close();
    assert_eq!(store.put(&[], &["a"], &[]), Err(StoreError::Closed));
    assert_eq!(store.get_concatenated(&[]), Err(StoreError::Closed));
    assert!(store.get_many(&["a"]).is_err());
    assert!(store.contains_many(&["a"]).is_err());
    store.check().unwrap();
}

#[test]
fn constructor_rejects_bad_sizes() {
    assert!(matches!(VariableStore::new(0), Err(StoreError::InvalidArgument(_))));
    assert!(matches!(
        VariableStore::with_options(4, Some(0), false),
        Err(StoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        VariableStore::with_options(4, Some(8), false),
        Err(StoreError::InvalidArgument(_))
    ));
    assert!(matches!(VariableStore::new(usize::MAX), Err(StoreError::CapacityTooLarge { .. })));
}

#[test]
fn an_object_larger_than_the_store_is_refused_and_changes_nothing() {
    let mut store = VariableStore::with_options(16, Some(4), false).unwrap();
    store.put(&[BlockRef { key: "a", payload: b"aaaa" }], &[], &[]).unwrap();
    let big = vec![0u8; 17];
    let err = store.put(&[BlockRef { key: "b", payload: &big }], &["a"], &[]).unwrap_err();
    assert_eq!(err, StoreError::CannotRetainBytes { limit: 16 });
    assert_eq!(store.reference_count("a"), 0);
    assert_eq!(store.lru_keys(), ["a"]);
    assert_eq!(store.stats().counters.capacity_errors, 1);
    store.check().unwrap();
}
