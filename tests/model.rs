//! Model-based test of both stores: random operation sequences run against `BlockStore` and
//! `VariableStore` and against naive models written from docs/semantics.md (Vec LRUs,
//! HashMaps, a snapshot to roll back to), with `check()` after every step and the full contents
//! compared. One runner, one set of operation generators and one `Subject` trait serve both.

use std::borrow::Cow;
use std::collections::HashMap;

use aostore::{BlockRef, BlockStore, Profile, StoreError, StoreOptions, VariableStore};
use proptest::prelude::*;

/// The fixed store's object size in the model runs.
const NBYTES: usize = 2;

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Closed,
    Bytes(Vec<u8>),
    Many { bytes: Vec<u8>, offsets: Vec<usize>, missing: Vec<usize> },
    Contains(Vec<bool>),
    NotReferenced(String),
    CannotRetain,
    Missing(String),
    PayloadSize(String),
}

/// What is compared after every step; `gauge` is the store's own extra figure (the fixed
/// store's slot count, the variable store's stored bytes).
#[derive(Debug)]
struct State {
    lru: Vec<String>,
    refs: HashMap<String, u32>,
    objects: HashMap<String, Vec<u8>>,
    gauge: (&'static str, u64),
}

/// A store or its model, as the runner drives it.
trait Subject {
    fn put(
        &mut self,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome;
    fn get(&mut self, keys: &[String]) -> Outcome;
    fn get_many(&mut self, keys: &[String]) -> Outcome;
    fn contains(&mut self, keys: &[String]) -> Outcome;
    fn check(&self) -> Result<(), String>;
    fn state(&self) -> State;
}

fn strs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

fn blocks(objects: &[(String, Vec<u8>)]) -> Vec<BlockRef<'_>> {
    objects.iter().map(|(k, p)| BlockRef { key: k, payload: p }).collect()
}

fn owned<'a>(pairs: impl IntoIterator<Item = (Cow<'a, str>, u32)>) -> HashMap<String, u32> {
    pairs.into_iter().map(|(k, c)| (k.into_owned(), c)).collect()
}

impl Subject for BlockStore {
    fn put(
        &mut self,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome {
        let put = BlockStore::put(self, &blocks(objects), &strs(retains), &strs(releases));
        put.map_or_else(fixed_error, |_| Outcome::Ok)
    }

    fn get(&mut self, keys: &[String]) -> Outcome {
        self.get_concatenated(&strs(keys)).map_or_else(fixed_error, Outcome::Bytes)
    }

    fn get_many(&mut self, keys: &[String]) -> Outcome {
        let mut bytes = vec![0; keys.len() * self.object_nbytes()];
        let mut missing = Vec::new();
        let written = match self.get_many_into(&strs(keys), &mut bytes, &mut missing) {
            Ok(written) => written,
            Err(e) => return fixed_error(e),
        };
        bytes.truncate(written);
        let mut offsets = vec![0];
        for i in 0..keys.len() {
            let size = if missing.contains(&i) { 0 } else { self.object_nbytes() };
            offsets.push(offsets[i] + size);
        }
        Outcome::Many { bytes, offsets, missing }
    }

    fn contains(&mut self, keys: &[String]) -> Outcome {
        self.contains_many(&strs(keys)).map_or_else(fixed_error, Outcome::Contains)
    }

    fn check(&self) -> Result<(), String> {
        BlockStore::check(self)
    }

    fn state(&self) -> State {
        State {
            lru: self.lru_keys().into_iter().map(Cow::into_owned).collect(),
            refs: owned(self.references()),
            objects: self
                .objects()
                .into_iter()
                .map(|(k, p)| (k.into_owned(), p.to_vec()))
                .collect(),
            gauge: ("num_slots", self.num_slots() as u64),
        }
    }
}

/// The fixed store's errors, as its model names them; any other error fails the test.
fn fixed_error(error: StoreError) -> Outcome {
    match error {
        StoreError::Closed => Outcome::Closed,
        StoreError::NotReferenced { key } => Outcome::NotReferenced(key),
        StoreError::CannotRetain { .. } => Outcome::CannotRetain,
        StoreError::PayloadSize { key, .. } => Outcome::PayloadSize(key),
        StoreError::Missing { key, .. } => Outcome::Missing(key),
        other => panic!("unexpected error {other:?}"),
    }
}

impl Subject for VariableStore {
    fn put(
        &mut self,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome {
        let put = VariableStore::put(self, &blocks(objects), &strs(retains), &strs(releases));
        put.map_or_else(variable_error, |()| Outcome::Ok)
    }

    fn get(&mut self, keys: &[String]) -> Outcome {
        self.get_concatenated(&strs(keys)).map_or_else(variable_error, Outcome::Bytes)
    }

    fn get_many(&mut self, keys: &[String]) -> Outcome {
        let read = VariableStore::get_many(self, &strs(keys));
        read.map_or_else(variable_error, |(bytes, plan)| Outcome::Many {
            bytes,
            offsets: plan.offsets().to_vec(),
            missing: plan.missing().to_vec(),
        })
    }

    fn contains(&mut self, keys: &[String]) -> Outcome {
        self.contains_many(&strs(keys)).map_or_else(variable_error, Outcome::Contains)
    }

    fn check(&self) -> Result<(), String> {
        VariableStore::check(self)
    }

    fn state(&self) -> State {
        State {
            lru: self.lru_keys().into_iter().map(Cow::into_owned).collect(),
            refs: owned(self.references()),
            objects: self
                .objects()
                .into_iter()
                .map(|(k, p)| (k.into_owned(), p.into_owned()))
                .collect(),
            gauge: ("stored_bytes", self.stats().stored_bytes),
        }
    }
}

/// The variable store's errors, as its model names them; any other error fails the test.
fn variable_error(error: StoreError) -> Outcome {
    match error {
        StoreError::Closed => Outcome::Closed,
        StoreError::NotReferenced { key } => Outcome::NotReferenced(key),
        StoreError::CannotRetainBytes { .. } => Outcome::CannotRetain,
        StoreError::MissingObject { key, .. } => Outcome::Missing(key),
        other => panic!("unexpected error {other:?}"),
    }
}

/// What both models share: the contents, the counts, the LRU, the reads and the part of a
/// put before capacity is looked at.
#[derive(Debug, Clone, Default)]
struct Contents {
    objects: HashMap<String, Vec<u8>>,
    refs: HashMap<String, u32>,
    lru: Vec<String>,
}

impl Contents {
    fn touch(&mut self, key: &str) {
        self.lru.retain(|k| k != key);
        self.lru.push(key.to_owned());
    }

    /// The first release that would drop a count below zero, counting the call's retains first.
    fn refused_release(&self, retains: &[String], releases: &[String]) -> Option<Outcome> {
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
                return Some(Outcome::NotReferenced(key.clone()));
            }
            *count -= 1;
        }
        None
    }

    /// The batch with each key once, holding its last payload, in first-seen order.
    fn dedup(objects: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
        let mut unique: Vec<(String, Vec<u8>)> = Vec::new();
        for (key, payload) in objects {
            match unique.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = payload.clone(),
                None => unique.push((key.clone(), payload.clone())),
            }
        }
        unique
    }

    /// Applies the call's retains and releases and its LRU moves; returns the keys whose
    /// count reached zero.
    fn count(
        &mut self,
        unique: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Vec<String> {
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
        for (key, _) in unique {
            if !self.refs.contains_key(key) {
                self.touch(key);
            }
        }
        for key in &released {
            if self.objects.contains_key(key) || unique.iter().any(|(k, _)| k == key) {
                self.touch(key);
            }
        }
        released
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

    fn contains(&self, keys: &[String]) -> Outcome {
        Outcome::Contains(keys.iter().map(|k| self.objects.contains_key(k)).collect())
    }

    fn state(&self, gauge: (&'static str, u64)) -> State {
        State {
            lru: self.lru.clone(),
            refs: self.refs.clone(),
            objects: self.objects.clone(),
            gauge,
        }
    }
}

/// A model: the contents both models share and one store's rule for what a put may hold.
#[derive(Debug, Clone, Default)]
struct Model<R> {
    rule: R,
    c: Contents,
}

/// What differs between the two models: the put (given the contents) and the extra gauge.
trait Rule {
    fn put(
        &mut self,
        c: &mut Contents,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome;
    fn gauge(&self, c: &Contents) -> (&'static str, u64);
}

impl<R: Rule> Subject for Model<R> {
    fn put(
        &mut self,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome {
        self.rule.put(&mut self.c, objects, retains, releases)
    }

    fn get(&mut self, keys: &[String]) -> Outcome {
        self.c.get(keys)
    }

    fn get_many(&mut self, keys: &[String]) -> Outcome {
        self.c.get_many(keys)
    }

    fn contains(&mut self, keys: &[String]) -> Outcome {
        self.c.contains(keys)
    }

    fn check(&self) -> Result<(), String> {
        Ok(())
    }

    fn state(&self) -> State {
        self.c.state(self.rule.gauge(&self.c))
    }
}

/// The fixed store (docs/semantics.md): a refused put keeps its reference changes and LRU
/// moves, as vLLM does; `grow` is vLLM 0.33's profile.
#[derive(Debug, Clone, Default)]
struct Fixed {
    num_slots: usize,
    grow: bool,
}

impl Rule for Fixed {
    fn put(
        &mut self,
        c: &mut Contents,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome {
        if let Some((key, _)) = objects.iter().find(|(_, p)| p.len() != NBYTES) {
            return Outcome::PayloadSize(key.clone());
        }
        if let Some(refused) = c.refused_release(retains, releases) {
            return refused;
        }
        let unique = Contents::dedup(objects);
        if self.grow {
            // vLLM 0.33: before any count changes, a re-put of an unreferenced stored object replaces it.
            for (key, _) in &unique {
                if c.lru.contains(key) {
                    c.lru.retain(|k| k != key);
                    c.objects.remove(key);
                }
            }
        }
        let new: Vec<String> = unique
            .iter()
            .filter(|(k, _)| !c.objects.contains_key(k))
            .map(|(k, _)| k.clone())
            .collect();
        let released = c.count(&unique, retains, releases);
        let need = (c.objects.len() + new.len()).saturating_sub(self.num_slots);
        let protected: Vec<&String> =
            unique.iter().map(|(k, _)| k).filter(|k| !released.contains(k)).collect();
        let eligible: Vec<String> =
            c.lru.iter().filter(|k| !protected.contains(k)).cloned().collect();
        if eligible.len() < need && !self.grow {
            c.lru.retain(|k| !new.contains(k));
            return Outcome::CannotRetain;
        }
        if eligible.len() < need {
            // vLLM 0.33 sizes the arena after evicting every eligible key.
            let left = c.objects.len() + new.len() - eligible.len();
            self.num_slots = left.max(2 * self.num_slots);
        }
        let victims = &eligible[..need.min(eligible.len())];
        c.lru.retain(|k| !victims.contains(k));
        for victim in victims {
            c.objects.remove(victim);
        }
        for (key, payload) in &unique {
            if new.contains(key) && !victims.contains(key) {
                c.objects.insert(key.clone(), payload.clone());
            }
        }
        Outcome::Ok
    }

    fn gauge(&self, _: &Contents) -> (&'static str, u64) {
        ("num_slots", self.num_slots as u64)
    }
}

/// The variable store (docs/semantics.md): whole chunks are charged; a refusal changes nothing.
#[derive(Debug, Clone, Default)]
struct Variable {
    capacity_chunks: usize,
    chunk: usize,
}

impl Variable {
    fn charge(&self, nbytes: usize) -> usize {
        nbytes.div_ceil(self.chunk)
    }
}

impl Rule for Variable {
    fn put(
        &mut self,
        c: &mut Contents,
        objects: &[(String, Vec<u8>)],
        retains: &[String],
        releases: &[String],
    ) -> Outcome {
        if let Some(refused) = c.refused_release(retains, releases) {
            return refused;
        }
        let before = c.clone();
        let unique = Contents::dedup(objects);
        let released = c.count(&unique, retains, releases);
        // Every batch key holds its new payload; what is not in the batch keeps its own.
        let new_bytes = |key: &str| unique.iter().find(|(k, _)| k == key).map(|(_, p)| p.len());
        let charge_of = |c: &Contents, key: &str| {
            self.charge(new_bytes(key).unwrap_or_else(|| c.objects[key].len()))
        };
        let used: usize = c
            .objects
            .keys()
            .filter(|k| new_bytes(k).is_none())
            .map(|k| self.charge(c.objects[k].len()))
            .chain(unique.iter().map(|(_, p)| self.charge(p.len())))
            .sum();
        let need = used.saturating_sub(self.capacity_chunks);
        let mut victims: Vec<String> = Vec::new();
        if need > 0 {
            let protected: Vec<&String> =
                unique.iter().map(|(k, _)| k).filter(|k| !released.contains(k)).collect();
            let mut freed = 0;
            for key in c.lru.iter().filter(|k| !protected.contains(k)) {
                if freed >= need {
                    break;
                }
                freed += charge_of(c, key);
                victims.push(key.clone());
            }
            if freed < need {
                *c = before;
                return Outcome::CannotRetain;
            }
        }
        c.lru.retain(|k| !victims.contains(k));
        for victim in &victims {
            c.objects.remove(victim);
        }
        for (key, payload) in &unique {
            if !victims.contains(key) {
                c.objects.insert(key.clone(), payload.clone());
            }
        }
        Outcome::Ok
    }

    fn gauge(&self, c: &Contents) -> (&'static str, u64) {
        ("stored_bytes", c.objects.values().map(Vec::len).sum::<usize>() as u64)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Objects are (key, fill byte, payload length).
    Put {
        objects: Vec<(u8, u8, usize)>,
        retains: Vec<u8>,
        releases: Vec<u8>,
    },
    Get(Vec<u8>),
    GetMany(Vec<u8>),
    Contains(Vec<u8>),
}

/// Key `k`: short (inline), logprob-like and routed-experts-like (held as digests) and over-long
/// (heap) keys mixed.
fn key(k: u8) -> String {
    match k % 4 {
        0 => format!("block-{k}"),
        1 => format!("vllm-logprobs/v1/0/(temperature=1.0, 'top_k': 20)/{:064x}/{k}", k),
        // vLLM's routed-experts keys, held as digests, under two prefixes.
        2 => format!("vllm-artifact/{}/{:064x}", k % 2, u64::from(k) * 0x9E37_79B9),
        _ => format!("{}-{k}", "x".repeat(170)),
    }
}

fn keys() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..8, 0..5)
}

/// Puts of up to four objects whose lengths come from `length`, with up to four retains and
/// releases.
fn put(length: impl Strategy<Value = usize>) -> impl Strategy<Value = Op> {
    (prop::collection::vec((0u8..8, any::<u8>(), length), 0..5), keys(), keys())
        .prop_map(|(objects, retains, releases)| Op::Put { objects, retains, releases })
}

/// Fixed-store runs: mostly puts of `NBYTES`-byte objects (3% a byte short), and reads. The
/// draws are those of the first fixed-store model test, so its saved regression seeds replay.
fn fixed_ops() -> impl Strategy<Value = Vec<Op>> {
    let length = prop::bool::weighted(0.03).prop_map(|short| if short { 1 } else { NBYTES });
    prop::collection::vec(prop_oneof![4 => put(length), 1 => keys().prop_map(Op::Get)], 1..40)
}

/// Every operation, objects of 0 to 39 bytes; `length` narrows that for the fixed store.
fn all_ops(length: impl Strategy<Value = usize>) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            5 => put(length),
            1 => keys().prop_map(Op::Get),
            1 => keys().prop_map(Op::GetMany),
            1 => keys().prop_map(Op::Contains),
        ],
        1..40,
    )
}

fn variable_length() -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 6 => 1usize..12, 1 => 12usize..40]
}

fn assert_same(store: &impl Subject, model: &impl Subject) {
    store.check().unwrap();
    let (got, want) = (store.state(), model.state());
    assert_eq!(got.lru, want.lru, "LRU order");
    assert_eq!(got.refs, want.refs, "reference counts");
    assert_eq!(got.objects, want.objects, "stored objects");
    assert_eq!(got.gauge, want.gauge);
}

/// Runs `ops` against the store and its model, comparing every outcome and, after every step,
/// the whole state.
fn run(
    store: &mut impl Subject,
    model: &mut impl Subject,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let names = |keys: Vec<u8>| keys.into_iter().map(key).collect::<Vec<String>>();
    for op in ops {
        match op {
            Op::Put { objects, retains, releases } => {
                let objects: Vec<(String, Vec<u8>)> =
                    objects.iter().map(|&(k, v, n)| (key(k), vec![v; n])).collect();
                let (retains, releases) = (names(retains), names(releases));
                let got = store.put(&objects, &retains, &releases);
                prop_assert_eq!(got, model.put(&objects, &retains, &releases));
            }
            Op::Get(keys) => {
                let keys = names(keys);
                prop_assert_eq!(store.get(&keys), model.get(&keys));
            }
            Op::GetMany(keys) => {
                let keys = names(keys);
                prop_assert_eq!(store.get_many(&keys), model.get_many(&keys));
            }
            Op::Contains(keys) => {
                let keys = names(keys);
                prop_assert_eq!(store.contains(&keys), model.contains(&keys));
            }
        }
        assert_same(store, model);
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000)
}

fn fixed_pair(num_slots: usize, grow: bool) -> (BlockStore, Model<Fixed>) {
    let profile = if grow { Profile::Grow } else { Profile::FailClosed };
    let store = BlockStore::with_options(
        num_slots * NBYTES,
        NBYTES,
        StoreOptions::default().profile(profile),
    )
    .unwrap();
    (store, Model { rule: Fixed { num_slots, grow }, c: Contents::default() })
}

proptest! {
    // 2,000 cases by default; PROPTEST_CASES runs longer (the figures are in the CHANGELOG).
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(num_slots in 1usize..6, grow in any::<bool>(), ops in fixed_ops()) {
        let (mut store, mut model) = fixed_pair(num_slots, grow);
        run(&mut store, &mut model, ops)?;
    }

    /// The fixed store under the variable store's operation mix: reads that do not fail and
    /// membership among the puts.
    #[test]
    fn store_matches_model_with_every_read(
        num_slots in 1usize..6,
        grow in any::<bool>(),
        ops in all_ops(prop::bool::weighted(0.03).prop_map(|short| if short { 1 } else { NBYTES })),
    ) {
        let (mut store, mut model) = fixed_pair(num_slots, grow);
        run(&mut store, &mut model, ops)?;
    }

    #[test]
    fn variable_store_matches_model(
        max_bytes in 1usize..64,
        chunk in prop_oneof![Just(1usize), Just(3), Just(8)],
        ops in all_ops(variable_length()),
    ) {
        prop_assume!(chunk <= max_bytes);
        let mut store = VariableStore::with_options(max_bytes, StoreOptions::default().chunk_nbytes(chunk)).unwrap();
        let rule = Variable { capacity_chunks: max_bytes / chunk, chunk };
        let mut model = Model { rule, c: Contents::default() };
        run(&mut store, &mut model, ops)?;
    }
}

/// Eviction counters and membership, for the tests below that are not model runs.
trait Evicting: Subject {
    fn eviction_visits(&self) -> u64;
    fn has(&self, key: &str) -> bool;
    fn close(&mut self);
}

impl Evicting for BlockStore {
    fn eviction_visits(&self) -> u64 {
        self.stats().counters.eviction_visits
    }
    fn has(&self, key: &str) -> bool {
        self.contains(key)
    }
    fn close(&mut self) {
        BlockStore::close(self);
    }
}

impl Evicting for VariableStore {
    fn eviction_visits(&self) -> u64 {
        self.stats().counters.eviction_visits
    }
    fn has(&self, key: &str) -> bool {
        self.contains(key)
    }
    fn close(&mut self) {
        VariableStore::close(self);
    }
}

/// The eviction bound (docs/semantics.md, "Eviction"): with 9,000 of 10,000 keys referenced, an
/// evicting put of 64 fresh `nbytes`-byte objects visits only about its victims (`visits_ok`).
fn evicting_put_visits_only_victims(
    store: &mut impl Evicting,
    nbytes: usize,
    visits_ok: impl Fn(u64) -> bool,
) {
    let keys: Vec<String> = (0..10_000).map(|i| format!("k{i}")).collect();
    assert_eq!(store.put(&[], &keys[..9_000], &[]), Outcome::Ok);
    let fill: Vec<(String, Vec<u8>)> =
        keys.iter().map(|k| (k.clone(), vec![b'x'; nbytes])).collect();
    assert_eq!(store.put(&fill, &[], &[]), Outcome::Ok);
    for round in 0..100 {
        let fresh: Vec<(String, Vec<u8>)> =
            (0..64).map(|i| (format!("new-{round}-{i}"), vec![b'a'; nbytes])).collect();
        let before = store.eviction_visits();
        assert_eq!(store.put(&fresh, &[], &[]), Outcome::Ok);
        let visits = store.eviction_visits() - before;
        assert!(visits_ok(visits), "round {round}: {visits} visits");
    }
    store.check().unwrap();
    // Every referenced key survived; the unreferenced ones went oldest first.
    assert!(keys[..9_000].iter().all(|k| store.has(k)));
    assert!(!store.has("k9000"));
}

#[test]
fn evicting_put_does_not_visit_referenced_keys() {
    let mut fixed = BlockStore::new(10_000 * NBYTES, NBYTES).unwrap();
    evicting_put_visits_only_victims(&mut fixed, NBYTES, |visits| visits <= 64 + 64);
    let mut variable =
        VariableStore::with_options(10_000 * 8, StoreOptions::default().chunk_nbytes(8)).unwrap();
    evicting_put_visits_only_victims(&mut variable, 8, |visits| visits == 64);
}

/// A closed store refuses every operation with `Closed`, closes twice, and still checks.
fn refuses_everything_once_closed(store: &mut impl Evicting) {
    store.close();
    store.close();
    let a = ["a".to_owned()];
    assert_eq!(store.put(&[], &a, &[]), Outcome::Closed);
    assert_eq!(store.get(&[]), Outcome::Closed);
    assert_eq!(store.get_many(&a), Outcome::Closed);
    assert_eq!(store.contains(&a), Outcome::Closed);
    store.check().unwrap();
}

#[test]
fn closed_store_refuses_everything() {
    refuses_everything_once_closed(&mut BlockStore::new(4, 2).unwrap());
    refuses_everything_once_closed(&mut VariableStore::new(64).unwrap());
}

// Each store's constructor arguments, and what only the variable store has: sizes.

#[test]
fn constructor_rejects_bad_sizes() {
    assert_eq!(BlockStore::new(4, 0).unwrap_err(), StoreError::ObjectSizeNotPositive);
    assert_eq!(BlockStore::new(3, 4).unwrap_err(), StoreError::CapacityBelowOneObject);
    assert!(matches!(
        BlockStore::new(usize::MAX, 1).unwrap_err(),
        StoreError::CapacityTooLarge { .. }
    ));
    assert!(matches!(VariableStore::new(0), Err(StoreError::InvalidArgument(_))));
    assert!(matches!(
        VariableStore::with_options(4, StoreOptions::default().chunk_nbytes(0)),
        Err(StoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        VariableStore::with_options(4, StoreOptions::default().chunk_nbytes(8)),
        Err(StoreError::InvalidArgument(_))
    ));
    assert!(matches!(VariableStore::new(usize::MAX), Err(StoreError::CapacityTooLarge { .. })));
}

/// Objects of mixed sizes replace each other for a long time: the arena stays exactly
/// accounted for, and a re-put that grows a key evicts only what it must.
#[test]
fn churn_keeps_the_allocator_exact() {
    let mut store =
        VariableStore::with_options(64 << 10, StoreOptions::default().chunk_nbytes(256)).unwrap();
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
fn an_object_larger_than_the_store_is_refused_and_changes_nothing() {
    let mut store =
        VariableStore::with_options(16, StoreOptions::default().chunk_nbytes(4)).unwrap();
    store.put(&[BlockRef { key: "a", payload: b"aaaa" }], &[], &[]).unwrap();
    let big = vec![0u8; 17];
    let err = store.put(&[BlockRef { key: "b", payload: &big }], &["a"], &[]).unwrap_err();
    assert_eq!(err, StoreError::CannotRetainBytes { limit: 16 });
    assert_eq!(store.reference_count("a"), 0);
    assert_eq!(store.lru_keys(), ["a"]);
    assert_eq!(store.stats().counters.capacity_errors, 1);
    store.check().unwrap();
}
