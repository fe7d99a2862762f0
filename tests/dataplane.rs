//! The data plane's core against a real `BlockStore`: what vLLM's connector would publish, read
//! back and emit, step by step (the Python differential compares it with vLLM itself; these
//! pin the rules that differential cannot isolate: payload lifetime, the staging pool's bound,
//! key order, the in-flight bound).

use aostore::dataplane::{
    key_for, DataPlane, EmittedRows, PlaneConfig, PlaneError, Processed, Publication, Sink,
    StepInput, StepMetadata,
};
use aostore::{BlockRef, BlockStore, Layout, StoreError};

const BLOCK: usize = 4;
const ROW: usize = 3;

fn config(max_num_seqs: usize, batched: usize) -> PlaneConfig {
    config_for(Layout::V0_33, max_num_seqs, batched)
}

fn config_for(layout: Layout, max_num_seqs: usize, batched: usize) -> PlaneConfig {
    PlaneConfig {
        block_size: BLOCK,
        row_nbytes: ROW,
        max_num_seqs,
        max_num_batched_tokens: batched,
        max_concurrent_batches: 1,
        layout,
    }
}

/// A store behind the plane; `held` queues calls instead of applying them (a writer held back).
struct StoreSink {
    store: BlockStore,
    held: bool,
    queued: Vec<Publication>,
    calls: Vec<Publication>,
}

impl StoreSink {
    fn new(held: bool) -> Self {
        let store = BlockStore::new(64 * BLOCK * ROW, BLOCK * ROW).expect("store");
        Self { store, held, queued: Vec::new(), calls: Vec::new() }
    }

    fn apply(&mut self, call: &Publication) -> Result<(), StoreError> {
        let objects: Vec<BlockRef<'_>> = call
            .objects
            .iter()
            .map(|(key, payload)| BlockRef {
                key: call.key(key),
                payload: &call.payload[payload.clone()],
            })
            .collect();
        let retains: Vec<&str> = call.retains.iter().map(|k| call.key(k)).collect();
        let releases: Vec<&str> = call.releases.iter().map(|k| call.key(k)).collect();
        self.store.put(&objects, &retains, &releases).map(|_| ())
    }

    fn drain(&mut self) -> Result<(), StoreError> {
        for call in std::mem::take(&mut self.queued) {
            self.apply(&call)?;
        }
        Ok(())
    }
}

impl Sink for StoreSink {
    type Error = StoreError;

    fn put(&mut self, publication: Publication) -> Result<(), StoreError> {
        self.calls.push(publication.clone());
        if self.held {
            self.queued.push(publication);
            return Ok(());
        }
        self.apply(&publication)
    }

    fn get_concatenated(&mut self, keys: &[&str], out: &mut Vec<u8>) -> Result<(), StoreError> {
        self.drain()?;
        *out = self.store.get_concatenated(keys)?;
        Ok(())
    }
}

/// Row `token` of request `request`: three bytes that name both.
fn row(request: u8, token: usize) -> [u8; ROW] {
    [request, token as u8, 0xA5]
}

fn hash(request: u8, block: usize) -> Vec<u8> {
    vec![request, block as u8, 7, 9]
}

/// One step of decodes or prefills: (request id byte, token start, tokens).
fn step(
    plane: &mut DataPlane,
    sink: &mut StoreSink,
    batch: &[(u8, i64, usize)],
) -> Result<Processed, PlaneError<StoreError>> {
    let ids: Vec<String> = batch.iter().map(|(r, ..)| format!("req-{r}")).collect();
    let token = plane.prepare_output(ids.iter().map(String::as_str))?;
    let mut rows = Vec::new();
    let mut starts = vec![0i64];
    for &(request, start, count) in batch {
        for t in 0..count {
            rows.extend_from_slice(&row(request, start as usize + t));
        }
        starts.push(starts.last().unwrap() + count as i64);
    }
    let token_starts: Vec<i64> = batch.iter().map(|&(_, start, _)| start).collect();
    let ones = vec![1i64; batch.len()];
    let zeros = vec![0i64; batch.len()];
    let input = StepInput {
        token_starts: &token_starts,
        query_start_loc: &starts,
        num_sampled: &ones,
        num_rejected: &zeros,
        rows: &rows,
        profile_matches: true,
        copied: true,
    };
    plane.process_output(token, &input, sink)
}

fn begin(
    plane: &mut DataPlane,
    sink: &mut StoreSink,
    requests: &[(u8, i64)],
    hashes: &[(u8, Vec<Vec<u8>>)],
    finished: &[u8],
) -> Result<(), PlaneError<StoreError>> {
    let id = |r: &u8| format!("req-{r}");
    let (running, keyed): (Vec<String>, Vec<String>) = (
        requests.iter().map(|(r, _)| id(r)).collect(),
        hashes.iter().map(|(r, _)| id(r)).collect(),
    );
    let done: Vec<String> = finished.iter().map(id).collect();
    let metadata = StepMetadata {
        generation: 0,
        requests: running.iter().zip(requests).map(|(r, &(_, e))| (r.as_str(), e)).collect(),
        block_hashes: keyed
            .iter()
            .zip(hashes)
            .map(|(r, (_, h))| (r.as_str(), h.iter().map(Vec::as_slice).collect()))
            .collect(),
        finished: done.iter().map(String::as_str).collect(),
        ..StepMetadata::default()
    };
    plane.begin_step(&metadata, sink)
}

fn expected_block(request: u8, block: usize) -> Vec<u8> {
    (block * BLOCK..(block + 1) * BLOCK).flat_map(|t| row(request, t)).collect()
}

/// Two requests decode token by token; their blocks complete before their hashes arrive (so
/// they stay staged while the other request's tails reuse freed slots), then publish.
fn decode_run(held: bool) -> StoreSink {
    let mut plane = DataPlane::new(config(2, 8)).expect("plane");
    let mut sink = StoreSink::new(held);
    begin(&mut plane, &mut sink, &[(1, 0), (2, 0)], &[], &[]).expect("begin");
    for token in 0..3 * BLOCK {
        let t = token as i64;
        let hashes: Vec<(u8, Vec<Vec<u8>>)> = if token >= BLOCK && token % BLOCK == 2 {
            // The hash of the block finished two tokens ago.
            let block = token / BLOCK - 1;
            vec![(1, vec![hash(1, block)]), (2, vec![hash(2, block)])]
        } else {
            Vec::new()
        };
        begin(&mut plane, &mut sink, &[(1, t), (2, t)], &hashes, &[]).expect("begin");
        let out = step(&mut plane, &mut sink, &[(1, t, 1), (2, t, 1)]).expect("step");
        assert_eq!(out.emitted.len(), 2);
        assert_eq!(out.emitted[0].rows, EmittedRows::Input(0..1));
        assert_eq!(out.emitted[1].rows, EmittedRows::Input(1..2));
    }
    begin(&mut plane, &mut sink, &[], &[], &[1, 2]).expect("finish");
    assert_eq!(plane.num_requests(), 0);
    assert_eq!(plane.free_slots(), config(2, 8).max_blocks(), "every slot back");
    sink.drain().expect("drain");
    sink
}

#[test]
fn staged_blocks_publish_their_own_bytes_even_when_applied_late() {
    let mut now = decode_run(false);
    let mut late = decode_run(true);
    assert_eq!(now.calls, late.calls, "the plane's calls do not depend on the writer");
    for sink in [&mut now, &mut late] {
        for request in [1, 2] {
            for block in 0..2 {
                let key = key_for(0, &hash(request, block));
                let stored = sink.store.get_concatenated(&[&key]).expect("stored");
                assert_eq!(stored, expected_block(request, block), "{key}");
                // Released at the finish, in reverse: evictable now.
                assert_eq!(sink.store.reference_count(&key), 0);
            }
        }
    }
    // Each hash's retain and its publication come in one call, and the finish releases a
    // request's keys newest first.
    let last = now.calls.last().expect("calls");
    let released: Vec<&str> = last.releases.iter().map(|k| last.key(k)).collect();
    let expected: Vec<Box<str>> =
        [(1, 1), (1, 0), (2, 1), (2, 0)].iter().map(|&(r, b)| key_for(0, &hash(r, b))).collect();
    assert_eq!(released, expected.iter().map(|k| &**k).collect::<Vec<_>>());
}

#[test]
fn an_aligned_prefill_publishes_straight_from_the_step_rows() {
    let mut plane = DataPlane::new(config(1, 16)).expect("plane");
    let mut sink = StoreSink::new(false);
    let hashes = vec![(3, vec![hash(3, 0), hash(3, 1)])];
    begin(&mut plane, &mut sink, &[(3, 0)], &hashes, &[]).expect("begin");
    let out = step(&mut plane, &mut sink, &[(3, 0, 2 * BLOCK + 1)]).expect("prefill");
    assert_eq!(out.emitted[0].rows, EmittedRows::Input(0..2 * BLOCK + 1));
    let call = sink.calls.last().expect("published");
    assert_eq!(call.objects.len(), 2);
    assert_eq!(call.payload[..BLOCK * ROW], expected_block(3, 0)[..]);
    // Only the one-token tail took a slot.
    assert_eq!(plane.free_slots(), config(1, 16).max_blocks() - 1);
}

#[test]
fn a_prefix_hit_is_read_back_from_the_store() {
    let mut plane = DataPlane::new(config(2, 16)).expect("plane");
    let mut sink = StoreSink::new(true);
    let hashes = vec![(1, vec![hash(1, 0)])];
    begin(&mut plane, &mut sink, &[(1, 0)], &hashes, &[]).expect("begin");
    step(&mut plane, &mut sink, &[(1, 0, BLOCK + 1)]).expect("prefill");
    // Request 2 shares request 1's first block: its prefill starts after it, emitting from 0.
    let shared = vec![(2, vec![hash(1, 0)])];
    begin(&mut plane, &mut sink, &[(2, 0)], &shared, &[]).expect("begin");
    let out = step(&mut plane, &mut sink, &[(2, BLOCK as i64, 2)]).expect("hit");
    let EmittedRows::Owned(range) = &out.emitted[0].rows else { panic!("not read back") };
    assert_eq!(range.len(), BLOCK + 2);
    let rows = &out.owned[range.start * ROW..range.end * ROW];
    assert_eq!(rows[..BLOCK * ROW], expected_block(1, 0)[..], "the stored block");
    assert_eq!(rows[BLOCK * ROW..], [row(2, BLOCK), row(2, BLOCK + 1)].concat()[..]);
}

#[test]
fn the_staging_pool_is_bounded_as_vllms() {
    // One sequence, a batch of one block: 2 + 1 = 3 slots (one step in flight).
    let mut plane = DataPlane::new(config(1, 4)).expect("plane");
    assert_eq!(plane.free_slots(), 3);
    let mut sink = StoreSink::new(false);
    begin(&mut plane, &mut sink, &[(1, 0)], &[], &[]).expect("begin");
    // Unkeyed full blocks stay staged until their hashes arrive: the fourth block cannot.
    for block in 0..3 {
        let start = (block * BLOCK) as i64;
        begin(&mut plane, &mut sink, &[(1, start)], &[], &[]).expect("begin");
        step(&mut plane, &mut sink, &[(1, start, BLOCK)]).expect("staged");
    }
    assert_eq!(plane.free_slots(), 0);
    let start = (3 * BLOCK) as i64;
    begin(&mut plane, &mut sink, &[(1, start)], &[], &[]).expect("begin");
    let error = step(&mut plane, &mut sink, &[(1, start, BLOCK)]).expect_err("exhausted");
    assert_eq!(error, PlaneError::Assertion("auxiliary output block pool is exhausted".into()));
    assert!(sink.calls.is_empty(), "nothing was published");
}

#[test]
fn bad_calls_fail_as_vllm_asserts() {
    let mut plane = DataPlane::new(config(2, 8)).expect("plane");
    let mut sink = StoreSink::new(false);
    let unknown = plane.prepare_output::<StoreError>(["req-9"]).expect_err("unknown");
    assert_eq!(unknown, PlaneError::UnknownRequest("req-9".into()));
    // The step stayed in flight (as vLLM's list append precedes the lookup), so a second
    // prepare exceeds max_concurrent_batches = 1.
    let second = plane.prepare_output::<StoreError>(std::iter::empty()).expect_err("bound");
    assert!(matches!(second, PlaneError::Assertion(m) if m.contains("not consumed in order")));
    let reset = StepMetadata { generation: 1, ..StepMetadata::default() };
    let moved = plane.begin_step(&reset, &mut sink).expect_err("in flight");
    assert!(matches!(moved, PlaneError::Assertion(m) if m.contains("with output in flight")));
    let mut fresh = DataPlane::new(config(2, 8)).expect("plane");
    let both =
        StepMetadata { requests: vec![("a", 0)], finished: vec!["a"], ..StepMetadata::default() };
    let run_and_finish = fresh.begin_step(&both, &mut sink).expect_err("run and finish");
    assert!(matches!(run_and_finish, PlaneError::Assertion(m) if m.contains("run and finish")));
    assert_eq!(fresh.num_requests(), 0, "nothing changed");
    assert!(sink.calls.is_empty());
}

#[test]
fn a_generation_change_releases_every_key_in_request_order() {
    let mut plane = DataPlane::new(config(2, 8)).expect("plane");
    let mut sink = StoreSink::new(false);
    let hashes = vec![(1, vec![hash(1, 0), hash(1, 1)]), (2, vec![hash(2, 0)])];
    begin(&mut plane, &mut sink, &[(1, 0), (2, 0)], &hashes, &[]).expect("begin");
    let reset = StepMetadata { generation: 1, ..StepMetadata::default() };
    plane.begin_step(&reset, &mut sink).expect("reset");
    let call = sink.calls.last().expect("releases");
    let released: Vec<&str> = call.releases.iter().map(|k| call.key(k)).collect();
    let expected = [key_for(0, &hash(1, 1)), key_for(0, &hash(1, 0)), key_for(0, &hash(2, 0))];
    assert_eq!(released, expected.iter().map(|k| &**k).collect::<Vec<_>>());
    assert_eq!((plane.num_requests(), plane.generation()), (0, 1));
}

/// Request 2 shares request 1's first block, and its own two full blocks have no hash yet when
/// the step reads its rows back: 0.33.0 reads the tail alone and asserts; 0.34.0 reads the
/// unkeyed full blocks, then the tail.
fn a_prefix_hit_ahead_of_its_hashes(layout: Layout) -> Result<Vec<u8>, PlaneError<StoreError>> {
    let mut plane = DataPlane::new(config_for(layout, 2, 16)).expect("plane");
    let mut sink = StoreSink::new(false);
    let hashes = vec![(1, vec![hash(1, 0)])];
    begin(&mut plane, &mut sink, &[(1, 0)], &hashes, &[]).expect("begin");
    step(&mut plane, &mut sink, &[(1, 0, BLOCK + 1)]).expect("prefill");
    let shared = vec![(2, vec![hash(1, 0)])];
    begin(&mut plane, &mut sink, &[(2, 0)], &shared, &[]).expect("begin");
    let out = step(&mut plane, &mut sink, &[(2, BLOCK as i64, 2 * BLOCK + 1)])?;
    let EmittedRows::Owned(range) = &out.emitted[0].rows else { panic!("not read back") };
    Ok(out.owned[range.start * ROW..range.end * ROW].to_vec())
}

#[test]
fn a_read_over_unkeyed_full_blocks_asserts_before_0_34_and_reads_them_on_it() {
    let error = a_prefix_hit_ahead_of_its_hashes(Layout::V0_33).expect_err("0.33.0 asserts");
    assert_eq!(error, PlaneError::Assertion("auxiliary output range is unavailable".into()));
    let rows = a_prefix_hit_ahead_of_its_hashes(Layout::V0_34).expect("0.34.0 reads");
    let mine: Vec<u8> = (BLOCK..3 * BLOCK + 1).flat_map(|t| row(2, t)).collect();
    assert_eq!(rows, [expected_block(1, 0), mine].concat());
}
