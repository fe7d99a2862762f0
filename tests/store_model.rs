//! Model-based test of the core: random operation sequences run against `BlockStore` and a
//! naive model written straight from SPEC section 2 (Vec LRU, HashMaps), with `check()` after
//! every step and the full contents compared.

use std::collections::HashMap;

use aostore::{BlockRef, BlockStore, Profile, StoreError};
use proptest::prelude::*;

const NBYTES: usize = 2;

#[derive(Debug, Default)]
struct Model {
    num_slots: usize,
    grow: bool,
    objects: HashMap<String, Vec<u8>>,
    refs: HashMap<String, u32>,
    lru: Vec<String>,
}

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Bytes(Vec<u8>),
    NotReferenced(String),
    CannotRetain,
    Missing(String),
    PayloadSize(String),
}

impl Model {
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
        if let Some((key, _)) = objects.iter().find(|(_, p)| p.len() != NBYTES) {
            return Outcome::PayloadSize(key.clone());
        }
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
        let mut unique: Vec<(String, Vec<u8>)> = Vec::new();
        for (key, payload) in objects {
            match unique.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = payload.clone(),
                None => unique.push((key.clone(), payload.clone())),
            }
        }
        if self.grow {
            // vLLM 0.33: before any count changes, a re-put of an unreferenced stored object replaces it.
            for (key, _) in &unique {
                if self.lru.contains(key) {
                    self.lru.retain(|k| k != key);
                    self.objects.remove(key);
                }
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
        let new: Vec<String> = unique
            .iter()
            .filter(|(k, _)| !self.objects.contains_key(k))
            .map(|(k, _)| k.clone())
            .collect();
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
        let need = (self.objects.len() + new.len()).saturating_sub(self.num_slots);
        let protected: Vec<&String> =
            unique.iter().map(|(k, _)| k).filter(|k| !released.contains(k)).collect();
        let eligible: Vec<String> =
            self.lru.iter().filter(|k| !protected.contains(k)).cloned().collect();
        if eligible.len() < need && !self.grow {
            self.lru.retain(|k| !new.contains(k));
            return Outcome::CannotRetain;
        }
        if eligible.len() < need {
            // vLLM 0.33 sizes the arena after evicting every eligible key.
            let left = self.objects.len() + new.len() - eligible.len();
            self.num_slots = left.max(2 * self.num_slots);
        }
        let victims = &eligible[..need.min(eligible.len())];
        self.lru.retain(|k| !victims.contains(k));
        for victim in victims {
            self.objects.remove(victim);
        }
        for (key, payload) in &unique {
            if new.contains(key) && !victims.contains(key) {
                self.objects.insert(key.clone(), payload.clone());
            }
        }
        Outcome::Ok
    }

    fn get(&mut self, keys: &[String]) -> Outcome {
        if let Some(missing) = keys.iter().find(|k| !self.objects.contains_key(*k)) {
            return Outcome::Missing(missing.clone());
        }
        let bytes = keys.iter().flat_map(|k| self.objects[k].clone()).collect();
        for key in keys {
            if !self.refs.contains_key(key) {
                self.touch(key);
            }
        }
        Outcome::Bytes(bytes)
    }
}

fn outcome(result: Result<(), StoreError>) -> Outcome {
    match result {
        Ok(()) => Outcome::Ok,
        Err(StoreError::NotReferenced { key }) => Outcome::NotReferenced(key),
        Err(StoreError::CannotRetain { .. }) => Outcome::CannotRetain,
        Err(StoreError::PayloadSize { key, .. }) => Outcome::PayloadSize(key),
        Err(StoreError::Missing { key, .. }) => Outcome::Missing(key),
        Err(other) => panic!("unexpected error {other:?}"),
    }
}

#[derive(Debug, Clone)]
enum Op {
    Put { objects: Vec<(u8, u8, bool)>, retains: Vec<u8>, releases: Vec<u8> },
    Get(Vec<u8>),
}

fn key(k: u8) -> String {
    format!("block-{k}")
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || prop::collection::vec(0u8..8, 0..5);
    prop_oneof![
        4 => (prop::collection::vec((0u8..8, any::<u8>(), prop::bool::weighted(0.03)), 0..5), keys(), keys())
            .prop_map(|(objects, retains, releases)| Op::Put { objects, retains, releases }),
        1 => keys().prop_map(Op::Get),
    ]
}

fn assert_same(store: &BlockStore, model: &Model) {
    store.check().unwrap();
    let lru: Vec<&str> = store.lru_keys();
    assert_eq!(lru, model.lru.iter().map(String::as_str).collect::<Vec<_>>(), "LRU order");
    let refs: HashMap<String, u32> =
        store.references().into_iter().map(|(k, c)| (k.to_owned(), c)).collect();
    assert_eq!(refs, model.refs, "reference counts");
    let objects: HashMap<String, Vec<u8>> =
        store.objects().into_iter().map(|(k, p)| (k.to_owned(), p.to_vec())).collect();
    assert_eq!(objects, model.objects, "stored objects");
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000)
}

proptest! {
    // 2,000 cases by default; PROPTEST_CASES runs longer (the figures are in the CHANGELOG).
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(
        num_slots in 1usize..6,
        grow in any::<bool>(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let profile = if grow { Profile::Grow } else { Profile::FailClosed };
        let mut store = BlockStore::with_profile(num_slots * NBYTES, NBYTES, profile).unwrap();
        let mut model = Model { num_slots, grow, ..Model::default() };
        for op in ops {
            match op {
                Op::Put { objects, retains, releases } => {
                    let objects: Vec<(String, Vec<u8>)> = objects
                        .iter()
                        .map(|&(k, v, short)| (key(k), vec![v; if short { 1 } else { NBYTES }]))
                        .collect();
                    let retains: Vec<String> = retains.into_iter().map(key).collect();
                    let releases: Vec<String> = releases.into_iter().map(key).collect();
                    let blocks: Vec<BlockRef<'_>> = objects
                        .iter()
                        .map(|(k, p)| BlockRef { key: k, payload: p })
                        .collect();
                    let r: Vec<&str> = retains.iter().map(String::as_str).collect();
                    let l: Vec<&str> = releases.iter().map(String::as_str).collect();
                    let got = outcome(store.put(&blocks, &r, &l).map(drop));
                    let want = model.put(&objects, &retains, &releases);
                    prop_assert_eq!(got, want);
                }
                Op::Get(keys) => {
                    let keys: Vec<String> = keys.into_iter().map(key).collect();
                    let k: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let got = match store.get_concatenated(&k) {
                        Ok(bytes) => Outcome::Bytes(bytes),
                        Err(e) => outcome(Err(e)),
                    };
                    prop_assert_eq!(got, model.get(&keys));
                }
            }
            assert_same(&store, &model);
            prop_assert_eq!(store.num_slots(), model.num_slots);
        }
    }
}

/// The seed's property: with most keys referenced, an evicting put visits only its victims.
#[test]
fn evicting_put_does_not_visit_referenced_keys() {
    let slots = 10_000;
    let mut store = BlockStore::new(slots * NBYTES, NBYTES).unwrap();
    let keys: Vec<String> = (0..slots).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys[..9_000].iter().map(String::as_str).collect();
    store.put(&[], &refs, &[]).unwrap();
    let blocks: Vec<BlockRef<'_>> =
        keys.iter().map(|k| BlockRef { key: k, payload: b"xy" }).collect();
    store.put(&blocks, &[], &[]).unwrap();
    for round in 0..100 {
        let fresh: Vec<String> = (0..64).map(|i| format!("new-{round}-{i}")).collect();
        let batch: Vec<BlockRef<'_>> =
            fresh.iter().map(|k| BlockRef { key: k, payload: b"ab" }).collect();
        let before = store.stats().counters.eviction_visits;
        store.put(&batch, &[], &[]).unwrap();
        let visits = store.stats().counters.eviction_visits - before;
        assert!(visits <= 64 + 64, "round {round}: {visits} visits");
    }
    store.check().unwrap();
    // Every referenced key survived; the unreferenced ones went oldest first.
    assert!(refs.iter().all(|k| store.contains(k)));
    assert!(!store.contains("k9000"));
}

#[test]
fn closed_store_refuses_everything() {
    let mut store = BlockStore::new(4, 2).unwrap();
    store.close();
    store.close();
    assert_eq!(store.put(&[], &["a"], &[]), Err(StoreError::Closed));
    assert_eq!(store.get_concatenated(&[]), Err(StoreError::Closed));
}

#[test]
fn constructor_rejects_bad_sizes() {
    assert_eq!(BlockStore::new(4, 0).unwrap_err(), StoreError::ObjectSizeNotPositive);
    assert_eq!(BlockStore::new(3, 4).unwrap_err(), StoreError::CapacityBelowOneObject);
    assert!(matches!(
        BlockStore::new(usize::MAX, 1).unwrap_err(),
        StoreError::CapacityTooLarge { .. }
    ));
}
