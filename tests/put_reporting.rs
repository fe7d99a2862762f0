//! `put_reporting` names exactly the payloads a put stored, checked against what each store's
//! rules say it writes, over random calls on small stores that evict, refuse and (profile
//! `grow`) grow.

use std::collections::{HashMap, HashSet};

use aostore::{BlockRef, BlockStore, Profile, StoreError, StoreOptions, VariableStore};
use proptest::prelude::*;

/// One call: objects (key id, payload byte, length), retains and releases (key ids).
type Call = (Vec<(u8, u8, usize)>, Vec<u8>, Vec<u8>);

fn key(id: u8) -> String {
    format!("vllm-artifact/0/{id}")
}

/// What the test needs of either store.
trait Reporting {
    fn put_reporting(
        &mut self,
        objects: &[BlockRef<'_>],
        retains: &[&str],
        releases: &[&str],
        written: &mut Vec<usize>,
    ) -> Result<(), StoreError>;
    fn stored(&self) -> HashMap<String, Vec<u8>>;
    fn count(&self, key: &str) -> u32;
}

impl Reporting for BlockStore {
    fn put_reporting(
        &mut self,
        objects: &[BlockRef<'_>],
        retains: &[&str],
        releases: &[&str],
        written: &mut Vec<usize>,
    ) -> Result<(), StoreError> {
        BlockStore::put_reporting(self, objects, retains, releases, None, written).map(|_| ())
    }
    fn stored(&self) -> HashMap<String, Vec<u8>> {
        self.objects().into_iter().map(|(k, p)| (k.into_owned(), p.into_owned())).collect()
    }
    fn count(&self, key: &str) -> u32 {
        self.reference_count(key)
    }
}

impl Reporting for VariableStore {
    fn put_reporting(
        &mut self,
        objects: &[BlockRef<'_>],
        retains: &[&str],
        releases: &[&str],
        written: &mut Vec<usize>,
    ) -> Result<(), StoreError> {
        VariableStore::put_reporting(self, objects, retains, releases, None, written)
    }
    fn stored(&self) -> HashMap<String, Vec<u8>> {
        self.objects().into_iter().map(|(k, p)| (k.into_owned(), p.into_owned())).collect()
    }
    fn count(&self, key: &str) -> u32 {
        self.reference_count(key)
    }
}

/// How a store treats a batch key that is already stored.
#[derive(Clone, Copy)]
enum Rewrites {
    /// Never (`fail-closed`).
    Never,
    /// When nothing referenced it as the call began (`grow`).
    Unreferenced,
    /// Always (the variable store).
    Always,
}

/// Runs `calls`, checking after each what `put_reporting` said against the store's rule: the
/// keys written are the batch keys stored after the call that were new, or stored and
/// rewritten; each position is its key's last payload, in first-occurrence order; a refused
/// call reports nothing.
fn check_calls(store: &mut impl Reporting, rewrites: Rewrites, calls: &[Call], fixed_len: bool) {
    for (n, (objects, retains, releases)) in calls.iter().enumerate() {
        let payloads: Vec<Vec<u8>> = objects
            .iter()
            .map(|&(_, byte, len)| vec![byte; if fixed_len { 4 } else { len }])
            .collect();
        let keys: Vec<String> = objects.iter().map(|&(id, _, _)| key(id)).collect();
        let blocks: Vec<BlockRef<'_>> =
            keys.iter().zip(&payloads).map(|(k, p)| BlockRef { key: k, payload: p }).collect();
        let retains: Vec<String> = retains.iter().map(|&id| key(id)).collect();
        // Release only what the store holds a reference on, once, so most calls validate.
        let mut releases: Vec<String> =
            releases.iter().map(|&id| key(id)).filter(|k| store.count(k) > 0).collect();
        releases.sort();
        releases.dedup();
        let before = store.stored();
        let unreferenced: HashSet<String> =
            keys.iter().filter(|k| store.count(k) == 0).cloned().collect();
        let retain_refs: Vec<&str> = retains.iter().map(String::as_str).collect();
        let release_refs: Vec<&str> = releases.iter().map(String::as_str).collect();
        let mut written = vec![usize::MAX]; // appended to, not replaced
        let result = store.put_reporting(&blocks, &retain_refs, &release_refs, &mut written);
        let after = store.stored();
        if result.is_err() {
            assert_eq!(written, [usize::MAX], "call {n}: a failed put reports nothing");
            continue;
        }
        let mut expected = vec![usize::MAX];
        let mut seen = HashSet::new();
        for k in &keys {
            if !seen.insert(k) {
                continue;
            }
            let last = keys.iter().rposition(|other| other == k).unwrap();
            let rewritten = match rewrites {
                Rewrites::Never => false,
                Rewrites::Unreferenced => unreferenced.contains(k),
                Rewrites::Always => true,
            };
            let stored_after = after.contains_key(k);
            if stored_after && (!before.contains_key(k) || rewritten) {
                expected.push(last);
            }
        }
        assert_eq!(written, expected, "call {n}");
        for &position in &written[1..] {
            assert_eq!(after[&keys[position]], payloads[position], "call {n}: {}", keys[position]);
        }
    }
}

fn calls() -> impl Strategy<Value = Vec<Call>> {
    let object = (0u8..24, any::<u8>(), 0usize..12);
    let call = (
        prop::collection::vec(object, 0..10),
        prop::collection::vec(0u8..24, 0..4),
        prop::collection::vec(0u8..24, 0..4),
    );
    prop::collection::vec(call, 1..40)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn the_fixed_store_reports_new_keys(calls in calls()) {
        let mut store = BlockStore::new(8 * 4, 4).unwrap();
        check_calls(&mut store, Rewrites::Never, &calls, true);
        store.check().unwrap();
    }

    #[test]
    fn profile_grow_reports_replaced_keys_too(calls in calls()) {
        let options = StoreOptions::default().profile(Profile::Grow);
        let mut store = BlockStore::with_options(8 * 4, 4, options).unwrap();
        check_calls(&mut store, Rewrites::Unreferenced, &calls, true);
        store.check().unwrap();
    }

    #[test]
    fn the_variable_store_reports_every_stored_batch_key(calls in calls()) {
        let mut store =
            VariableStore::with_options(48, StoreOptions::default().chunk_nbytes(4)).unwrap();
        check_calls(&mut store, Rewrites::Always, &calls, false);
        store.check().unwrap();
    }
}

#[test]
fn a_key_written_twice_in_one_call_reports_its_last_payload_once() {
    let mut store = BlockStore::new(4 * 2, 2).unwrap();
    let (a, b) = (key(1), key(2));
    let batch = [
        BlockRef { key: &a, payload: b"a1" },
        BlockRef { key: &b, payload: b"b1" },
        BlockRef { key: &a, payload: b"a2" },
    ];
    let mut written = Vec::new();
    store.put_reporting(&batch, &[], &[], None, &mut written).unwrap();
    assert_eq!(written, [2, 1]);
    // Stored already: fail-closed keeps the first bytes and reports nothing.
    written.clear();
    store.put_reporting(&batch[..1], &[], &[], None, &mut written).unwrap();
    assert!(written.is_empty());
    assert_eq!(store.get_concatenated(&[&a]).unwrap(), b"a2");
}
