//! vLLM's worker-side routed-experts data plane, natively: what `AuxOutputWorkerConnector`
//! (`begin_step`, `prepare_output`, `process_output`) and `RoutedExpertsBuffer` do per request
//! per step, with the same observable behaviour (outputs, store calls in order, the error kind
//! at the same point). The engine's Python hands over a step's arrays once; the per-request
//! loops run here. No PyO3: the binding (`python/dataplane.rs`) converts and locks.
//!
//! Names follow vLLM's: a *request state* (cursors, keys, staged blocks), a *tail* (a request's
//! incomplete block, staged in a slot), *slots* (the staging pool, sized as vLLM's buffer, whose
//! exhaustion is the same assertion), *steps in flight* (prepared, not yet processed).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::ops::{Deref, DerefMut, Range};
use std::sync::{Arc, Mutex, PoisonError};

use foldhash::HashMap;

use crate::layout::Layout;

/// What the connector was built with (vLLM's `RoutedExpertsBuffer` arguments, in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaneConfig {
    /// Tokens per hash block (vLLM's `hash_block_size`).
    pub block_size: usize,
    /// Bytes of one token's routed experts (`prod(shape_per_token) * itemsize`).
    pub row_nbytes: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_concurrent_batches: usize,
    /// The vLLM release's shape of the connector (`Layout`).
    pub layout: Layout,
}

impl PlaneConfig {
    /// Staging slots: in-flight full blocks plus one incomplete tail per request, as vLLM's.
    pub fn max_blocks(&self) -> usize {
        let step_blocks = self.max_num_batched_tokens.div_ceil(self.block_size) + self.max_num_seqs;
        self.max_concurrent_batches * step_blocks + self.max_num_seqs
    }

    pub fn block_nbytes(&self) -> usize {
        self.block_size * self.row_nbytes
    }
}

/// Why a call failed, by the Python exception vLLM's code raises at that point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlaneError<E> {
    /// vLLM's `assert` (`AssertionError`), with its message.
    Assertion(String),
    /// `ValueError`.
    Value(String),
    /// A request id the worker does not know (`KeyError`).
    UnknownRequest(String),
    /// `process_output` of a step that is not in flight (`list.remove`'s `ValueError`).
    NotInFlight,
    /// The store's error (its `put` or `get_concatenated`).
    Sink(E),
}

fn assertion<T, E>(message: &str) -> Result<T, PlaneError<E>> {
    Err(PlaneError::Assertion(message.to_owned()))
}

/// One store call (vLLM's `store.put(objects, retain_keys=, release_keys=)`), owned: the
/// payloads are copied out of the staging slots and the step's rows at hand-over, so the slots
/// may be reused at once while a writer applies the call later.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Publication {
    /// Every key of the call, back to back.
    pub text: String,
    /// (key in `text`, payload in `payload`) per object, in vLLM's order.
    pub objects: Vec<(Range<usize>, Range<usize>)>,
    pub payload: Payload,
    pub retains: Vec<Range<usize>>,
    pub releases: Vec<Range<usize>>,
}

impl Publication {
    pub fn key(&self, range: &Range<usize>) -> &str {
        &self.text[range.clone()]
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty() && self.retains.is_empty() && self.releases.is_empty()
    }

    fn push_key(&mut self, key: &str) -> Range<usize> {
        let start = self.text.len();
        self.text.push_str(key);
        start..self.text.len()
    }
}

/// Payload buffers pooled: at most this many, of at most this capacity each.
const POOLED_PAYLOADS: usize = 4;
const POOLED_PAYLOAD_BYTES: usize = 2 << 20;

/// Payload buffers back from applied calls, for the next calls: a call's payloads are then
/// copied into pages already committed, not into a fresh allocation's (which the kernel
/// zeroes page by page as the copy faults them in).
#[derive(Debug, Default)]
struct PayloadPool {
    buffers: Mutex<Vec<Vec<u8>>>,
}

impl PayloadPool {
    /// An empty buffer with room for `bytes`.
    fn take(&self, bytes: usize) -> Vec<u8> {
        let pooled = self.buffers.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let mut buffer = pooled.unwrap_or_default();
        buffer.clear();
        buffer.reserve(bytes);
        buffer
    }

    fn give(&self, buffer: Vec<u8>) {
        if buffer.capacity() == 0 || buffer.capacity() > POOLED_PAYLOAD_BYTES {
            return;
        }
        let mut buffers = self.buffers.lock().unwrap_or_else(PoisonError::into_inner);
        if buffers.len() < POOLED_PAYLOADS {
            buffers.push(buffer);
        }
    }
}

/// A call's payloads, back to back (a `Vec<u8>` to read and write). The plane's calls take
/// their buffer from its pool, and it goes back there when the call is dropped (by the
/// writer's thread, once applied).
#[derive(Default)]
pub struct Payload {
    bytes: Vec<u8>,
    pool: Option<Arc<PayloadPool>>,
}

impl Deref for Payload {
    type Target = Vec<u8>;

    fn deref(&self) -> &Vec<u8> {
        &self.bytes
    }
}

impl DerefMut for Payload {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(std::mem::take(&mut self.bytes));
        }
    }
}

impl Clone for Payload {
    fn clone(&self) -> Self {
        Self { bytes: self.bytes.clone(), pool: None }
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Payload {}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.bytes.fmt(f)
    }
}

/// The store behind the connector: vLLM's `BackgroundBlockObjectStore`.
pub trait Sink {
    type Error;
    /// Queues one call (never made for an empty one).
    fn put(&mut self, publication: Publication) -> Result<(), Self::Error>;
    /// Waits for queued calls, then the payloads of `keys`, concatenated, into `out`.
    fn get_concatenated(&mut self, keys: &[&str], out: &mut Vec<u8>) -> Result<(), Self::Error>;
}

/// A step's metadata (vLLM's `AuxOutputConnectorMetadata`), borrowed from the caller's.
#[derive(Debug, Default, Clone)]
pub struct StepMetadata<'a> {
    pub generation: i64,
    /// (request id, emit start) in the metadata's order.
    pub requests: Vec<(&'a str, i64)>,
    /// (request id, the block hashes that became known), in order.
    pub block_hashes: Vec<(&'a str, Vec<&'a [u8]>)>,
    pub finished: Vec<&'a str>,
    /// 0.33.0's KV-cached retains and releases (empty on 0.32.0).
    pub retained: Vec<&'a [u8]>,
    pub released: Vec<&'a [u8]>,
}

/// What `process_output` reads of a step, once its copy is complete.
pub struct StepInput<'a> {
    /// `pending.token_starts`, `query_start_loc`, `num_sampled`, `num_rejected`.
    pub token_starts: &'a [i64],
    pub query_start_loc: &'a [i64],
    pub num_sampled: &'a [i64],
    pub num_rejected: &'a [i64],
    /// The copied routed experts, `row_nbytes` per token.
    pub rows: &'a [u8],
    /// Whether the rows' dtype and shape per token are the capture profile's.
    pub profile_matches: bool,
    /// Whether `enqueue_cpu_copy` ran (the rows and counts exist).
    pub copied: bool,
}

/// Where an emitted request's rows are: rows of the step's input (a view, as vLLM's output
/// is), or rows of `Processed::owned` (read back from the store or the staging slots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmittedRows {
    Input(Range<usize>),
    Owned(Range<usize>),
}

/// One `AuxRequestOutput(token_start, rows)`, for the request at `position` in the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emitted {
    pub position: usize,
    pub token_start: i64,
    /// vLLM's emit cursor was last set by a step (`token_end`, a numpy integer there), not by
    /// the scheduler's metadata (a Python `int`): from a request's second output on.
    pub cursor_from_step: bool,
    /// vLLM's rows are a slice of `np.frombuffer` over the store's `bytes`: read-only.
    pub read_only: bool,
    pub rows: EmittedRows,
}

/// A processed step's outputs, in the order vLLM inserts them into its dict.
#[derive(Debug, Default)]
pub struct Processed {
    pub emitted: Vec<Emitted>,
    /// Rows (`row_nbytes` each) that `EmittedRows::Owned` ranges index.
    pub owned: Vec<u8>,
}

type Slot = u32;

#[derive(Debug, Clone, Copy)]
struct Tail {
    slot: Slot,
    block_start: i64,
    length: usize,
}

/// `bytes` zeros, allocated zeroed: a large one is fresh pages, committed only as slots are
/// written, like vLLM's `np.empty` (writing the zeros would commit it all at construction).
fn zeroed(bytes: usize) -> Option<Vec<u8>> {
    if bytes == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(bytes).ok()?;
    // SAFETY: the layout's size is not zero.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `bytes` initialized bytes from the global allocator with `u8`'s layout, owned here.
    Some(unsafe { Vec::from_raw_parts(ptr, bytes, bytes) })
}

/// A full block: still rows of the step's input (aligned, never staged), or a staging slot.
#[derive(Debug, Clone, Copy)]
enum Block {
    Input(usize),
    Staged(Slot),
}

#[derive(Debug)]
struct RequestState {
    id: Box<str>,
    /// Insertion order of the request map (Python dict order).
    seq: u64,
    keys: Vec<Box<str>>,
    /// Full blocks whose hash has not arrived: always staged.
    pending_blocks: Vec<(i64, Slot)>,
    capture_cursor: Option<i64>,
    scheduled_cursor: i64,
    emit_cursor: i64,
    /// `emit_cursor` came from a step, not from the metadata (see `Emitted::cursor_from_step`).
    cursor_from_step: bool,
    pending_outputs: u32,
    finished: bool,
    tail: Option<Tail>,
}

/// Rows of staged slots, in order: a slot and the rows of it to read.
type Pieces = Vec<(Slot, Range<usize>)>;

impl RequestState {
    /// 0.32.0 and 0.33.0: rows `[from, to)` of the request's tail.
    fn tail_rows<E>(&self, rows: Range<i64>) -> Result<Pieces, PlaneError<E>> {
        let Some(tail) = self.tail else {
            return assertion("auxiliary output buffer is missing the request");
        };
        let (local_start, local_end) = (rows.start - tail.block_start, rows.end - tail.block_start);
        if !(0 <= local_start && local_start < local_end && local_end <= tail.length as i64) {
            return assertion("auxiliary output range is unavailable");
        }
        Ok(vec![(tail.slot, local_start as usize..local_end as usize)])
    }

    /// 0.34.0: the request's unkeyed full blocks (of `block` rows), then its tail, taken as one
    /// run of rows from the first block's start (vLLM concatenates them and assumes they are
    /// contiguous), and rows `[from, to)` of it, sliced as Python slices it. No staged row:
    /// vLLM's `np.concatenate([])`, a `ValueError`.
    fn staged_rows<E>(&self, rows: Range<i64>, block: usize) -> Result<Pieces, PlaneError<E>> {
        let Range { start: from, end: to } = rows;
        let parts: Vec<(i64, Slot, usize)> = self
            .pending_blocks
            .iter()
            .map(|&(start, slot)| (start, slot, block))
            .chain(self.tail.map(|tail| (tail.block_start, tail.slot, tail.length)))
            .collect();
        let first = parts.first().map_or(from, |part| part.0);
        let available: usize = parts.iter().map(|part| part.2).sum();
        if !(first <= from && to <= first + available as i64) {
            return assertion("auxiliary output range is unavailable");
        }
        if parts.is_empty() {
            return Err(PlaneError::Value("need at least one array to concatenate".to_owned()));
        }
        let wanted = python_slice(available, from - first, to - first);
        let mut at = 0;
        let mut pieces = Vec::with_capacity(parts.len());
        for (_, slot, length) in parts {
            let (lo, hi) = (wanted.start.max(at), wanted.end.min(at + length));
            if lo < hi {
                pieces.push((slot, lo - at..hi - at));
            }
            at += length;
        }
        Ok(pieces)
    }
}

struct InFlight {
    token: u64,
    requests: Vec<u32>,
}

/// The data plane of one connector (the output rank's).
pub struct DataPlane {
    config: PlaneConfig,
    staging: Vec<u8>,
    free_slots: Vec<Slot>,
    states: Vec<Option<RequestState>>,
    free_states: Vec<u32>,
    by_id: HashMap<Box<str>, u32>,
    next_seq: u64,
    generation: i64,
    /// `vllm-artifact/<generation>/`, the prefix of every key made in this generation.
    key_prefix: String,
    in_flight: VecDeque<InFlight>,
    next_token: u64,
    store_open: bool,
    /// Buffers of the calls' payloads, reused (`PayloadPool`).
    payloads: Arc<PayloadPool>,
    /// The last prefix read's buffer, reused by the next (at most `POOLED_PAYLOAD_BYTES`).
    read_buffer: Vec<u8>,
}

type Batches = Vec<(u32, Vec<(i64, Block)>)>;

impl DataPlane {
    pub fn new(config: PlaneConfig) -> Result<Self, String> {
        if config.block_size == 0 || config.row_nbytes == 0 {
            return Err("block size and row size must be positive".to_owned());
        }
        let slots = config.max_blocks();
        let bytes = slots
            .checked_mul(config.block_nbytes())
            .filter(|&b| slots <= Slot::MAX as usize && b <= isize::MAX as usize)
            .ok_or_else(|| format!("{slots} staging blocks do not fit in memory"))?;
        let staging =
            zeroed(bytes).ok_or_else(|| format!("cannot allocate {bytes} bytes of staging"))?;
        Ok(Self {
            config,
            staging,
            free_slots: (0..slots as Slot).rev().collect(),
            states: Vec::new(),
            free_states: Vec::new(),
            by_id: HashMap::default(),
            next_seq: 0,
            generation: 0,
            key_prefix: key_prefix(0),
            in_flight: VecDeque::new(),
            next_token: 0,
            store_open: true,
            payloads: Arc::default(),
            read_buffer: Vec::new(),
        })
    }

    pub fn config(&self) -> &PlaneConfig {
        &self.config
    }

    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// Requests the worker tracks.
    pub fn num_requests(&self) -> usize {
        self.by_id.len()
    }

    pub fn steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Staging slots not in use.
    pub fn free_slots(&self) -> usize {
        self.free_slots.len()
    }

    fn state(&self, index: u32) -> &RequestState {
        self.states[index as usize].as_ref().expect("live request index")
    }

    fn state_mut(&mut self, index: u32) -> &mut RequestState {
        self.states[index as usize].as_mut().expect("live request index")
    }

    fn lookup<E>(&self, id: &str) -> Result<u32, PlaneError<E>> {
        self.by_id.get(id).copied().ok_or_else(|| PlaneError::UnknownRequest(id.to_owned()))
    }

    fn insert_state(&mut self, id: &str, emit_cursor: i64) -> u32 {
        let state = RequestState {
            id: id.into(),
            seq: self.next_seq,
            keys: Vec::new(),
            pending_blocks: Vec::new(),
            capture_cursor: None,
            scheduled_cursor: 0,
            emit_cursor,
            cursor_from_step: false,
            pending_outputs: 0,
            finished: false,
            tail: None,
        };
        self.next_seq += 1;
        let index = match self.free_states.pop() {
            Some(index) => {
                self.states[index as usize] = Some(state);
                index
            }
            None => {
                self.states.push(Some(state));
                (self.states.len() - 1) as u32
            }
        };
        self.by_id.insert(id.into(), index);
        index
    }

    fn remove_state(&mut self, index: u32) -> RequestState {
        let state = self.states[index as usize].take().expect("live request index");
        self.by_id.remove(&state.id);
        self.free_states.push(index);
        state
    }

    fn key_text(&self, hash: &[u8]) -> Box<str> {
        // Sized exactly, so the boxed text keeps the allocation (no shrinking copy).
        let mut key = String::with_capacity(self.key_prefix.len() + 2 * hash.len());
        key.push_str(&self.key_prefix);
        push_hex(&mut key, hash);
        key.into_boxed_str()
    }

    fn slot_bytes(&mut self, slot: Slot) -> &mut [u8] {
        let n = self.config.block_nbytes();
        let at = slot as usize * n;
        &mut self.staging[at..at + n]
    }

    fn take_slot<E>(&mut self) -> Result<Slot, PlaneError<E>> {
        match self.free_slots.pop() {
            Some(slot) => Ok(slot),
            None => assertion("auxiliary output block pool is exhausted"),
        }
    }

    /// `begin_step(metadata)` past vLLM's two checks before its lock (made by the caller).
    pub fn begin_step<S: Sink>(
        &mut self,
        metadata: &StepMetadata<'_>,
        sink: &mut S,
    ) -> Result<(), PlaneError<S::Error>> {
        let runs_and_finishes = if metadata.finished.len() > 8 {
            let finished: foldhash::HashSet<&str> = metadata.finished.iter().copied().collect();
            metadata.requests.iter().any(|(id, _)| finished.contains(id))
        } else {
            metadata.requests.iter().any(|(id, _)| metadata.finished.contains(id))
        };
        if runs_and_finishes {
            return assertion("auxiliary output request cannot run and finish in one step");
        }
        if metadata.generation < self.generation {
            return assertion("auxiliary output metadata generation moved backwards");
        }
        // 0.33.0: KV-cached retains and releases, keyed in the namespace before any reset.
        let mut retains: Vec<Box<str>> =
            metadata.retained.iter().map(|hash| self.key_text(hash)).collect();
        let mut releases: Vec<Box<str>> =
            metadata.released.iter().map(|hash| self.key_text(hash)).collect();
        if metadata.generation > self.generation {
            // The scheduler resets the prefix cache only once all model output is consumed.
            if !self.in_flight.is_empty() {
                return assertion("auxiliary output generation changed with output in flight");
            }
            let mut live: Vec<&RequestState> = self.states.iter().flatten().collect();
            live.sort_unstable_by_key(|state| state.seq);
            for state in live {
                releases.extend(state.keys.iter().rev().cloned());
            }
            self.reset();
            self.generation = metadata.generation;
            self.key_prefix = key_prefix(metadata.generation);
        }
        for &(id, emit_start) in &metadata.requests {
            let index = match self.by_id.get(id) {
                Some(&index) => index,
                None => self.insert_state(id, emit_start),
            };
            let state = self.state(index);
            // In-flight steps leave the worker's cursor behind the scheduler's view.
            if state.pending_outputs == 0 && emit_start > state.emit_cursor {
                return assertion("auxiliary output Scheduler emit cursor moved ahead");
            }
        }
        let mut batches: Batches = Vec::with_capacity(metadata.block_hashes.len());
        for &(id, ref hashes) in &metadata.block_hashes {
            let index = self.lookup(id)?;
            let keys: Vec<Box<str>> = hashes.iter().map(|hash| self.key_text(hash)).collect();
            retains.extend(keys.iter().cloned());
            self.state_mut(index).keys.extend(keys);
            batches.push((index, Vec::new()));
        }
        let mut finished_now = Vec::new();
        for &id in &metadata.finished {
            let index = self.lookup(id)?;
            let state = self.state_mut(index);
            state.finished = true;
            if state.pending_outputs > 0 {
                continue;
            }
            releases.extend(state.keys.iter().rev().cloned());
            finished_now.push(index);
        }
        self.publish(batches, &[], &retains, &releases, sink)?;
        self.teardown(&finished_now);
        Ok(())
    }

    /// `prepare_output`'s bookkeeping under vLLM's lock: the step joins those in flight (at
    /// most `max_concurrent_batches`); returns the token that `process_output` names it by.
    pub fn prepare_output<'a, E>(
        &mut self,
        request_ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<u64, PlaneError<E>> {
        if self.in_flight.len() >= self.config.max_concurrent_batches {
            return assertion("auxiliary output step outputs are not consumed in order");
        }
        let token = self.next_token;
        self.next_token += 1;
        self.in_flight.push_back(InFlight { token, requests: Vec::new() });
        for id in request_ids {
            // As vLLM: the step stays in flight with the counts made before an unknown id.
            let index = self.lookup(id)?;
            self.state_mut(index).pending_outputs += 1;
            self.in_flight.back_mut().expect("just pushed").requests.push(index);
        }
        Ok(token)
    }

    /// `process_output(pending)`: commits the step's rows, then tears down requests whose
    /// finish waited for it.
    pub fn process_output<S: Sink>(
        &mut self,
        token: u64,
        input: &StepInput<'_>,
        sink: &mut S,
    ) -> Result<Processed, PlaneError<S::Error>> {
        let committed = self.commit(token, input, sink);
        // vLLM's `finally`: the step leaves those in flight even when the commit failed.
        let Some(at) = self.in_flight.iter().position(|step| step.token == token) else {
            return Err(PlaneError::NotInFlight);
        };
        let step = self.in_flight.remove(at).expect("found");
        let mut teardown = Vec::new();
        let mut releases = Vec::new();
        for &index in &step.requests {
            let state = self.state_mut(index);
            state.pending_outputs -= 1;
            if state.pending_outputs == 0 && state.finished {
                releases.extend(state.keys.iter().rev().cloned());
                teardown.push(index);
            }
        }
        let processed = committed?;
        if !teardown.is_empty() {
            self.publish(Vec::new(), &[], &[], &releases, sink)?;
            self.teardown(&teardown);
        }
        Ok(processed)
    }

    fn commit<S: Sink>(
        &mut self,
        token: u64,
        input: &StepInput<'_>,
        sink: &mut S,
    ) -> Result<Processed, PlaneError<S::Error>> {
        if !self.store_open {
            return assertion("auxiliary output store is closed");
        }
        if !input.copied {
            return assertion("auxiliary output CPU copy was not enqueued");
        }
        let requests = match self.in_flight.iter().find(|step| step.token == token) {
            Some(step) => step.requests.clone(),
            None => Vec::new(),
        };
        let row = self.config.row_nbytes;
        let num_rows = input.rows.len() / row;
        let starts = input.query_start_loc;
        // vLLM zips six sequences with `strict=True`: the common length runs, then a
        // mismatch raises.
        let count = [
            requests.len(),
            input.token_starts.len(),
            starts.len().saturating_sub(1),
            input.num_sampled.len(),
            input.num_rejected.len(),
        ];
        let common = *count.iter().min().expect("five lengths");
        let mut batches: Batches = Vec::with_capacity(common);
        let mut processed = Processed::default();
        let mut materialize: Vec<(usize, u32, i64, i64)> = Vec::new();
        for position in 0..common {
            let index = requests[position];
            let (token_start, start, end) =
                (input.token_starts[position], starts[position], starts[position + 1]);
            let num_tokens = end - start;
            if num_tokens <= 0 {
                return assertion("auxiliary output request token count must be positive");
            }
            let rejected = input.num_rejected[position];
            if !(0..=num_tokens).contains(&rejected) {
                return assertion("auxiliary output rejected-token count is invalid");
            }
            let rows = python_slice(num_rows, start, end - rejected);
            let state = self.state(index);
            let mut capture_start = token_start;
            let capture_cursor = state.capture_cursor.unwrap_or(capture_start);
            if capture_start < capture_cursor {
                return assertion("auxiliary output capture moved backwards");
            }
            if capture_start > capture_cursor {
                // Reattach after an optimistically scheduled suffix was rejected.
                if capture_cursor >= state.scheduled_cursor {
                    return assertion("auxiliary output capture has an unbacked token gap");
                }
                capture_start = capture_cursor;
            }
            let emit_start = state.emit_cursor;
            if !input.profile_matches {
                return assertion("routed-experts capture profile changed");
            }
            let completed = self.capture(index, capture_start, rows.clone(), input.rows)?;
            let token_end = capture_start + rows.len() as i64;
            let state = self.state_mut(index);
            state.capture_cursor = Some(token_end);
            state.scheduled_cursor = token_start + num_tokens;
            batches.push((index, completed));
            if input.num_sampled[position] > 0 && emit_start <= token_end {
                if emit_start >= capture_start {
                    let from = rows.start + (emit_start - capture_start) as usize;
                    processed.emitted.push(Emitted {
                        position,
                        token_start: emit_start,
                        cursor_from_step: state.cursor_from_step,
                        read_only: false,
                        rows: EmittedRows::Input(from..rows.end),
                    });
                    state.emit_cursor = token_end;
                    state.cursor_from_step = true;
                } else {
                    materialize.push((position, index, emit_start, token_end));
                }
            }
        }
        if count.iter().any(|&n| n != common) {
            return Err(PlaneError::Value(
                "zip() arguments of the auxiliary output step differ in length".to_owned(),
            ));
        }
        // A consumer may reuse a block produced earlier in the same batch: publish first.
        self.publish(batches, input.rows, &[], &[], sink)?;
        let block = self.config.block_size as i64;
        let mut stored = std::mem::take(&mut self.read_buffer);
        for (position, index, emit_start, token_end) in materialize {
            let state = self.state(index);
            let stored_end = (token_end / block).min(state.keys.len() as i64) * block;
            let first = processed.owned.len() / row;
            let read_only = emit_start < stored_end && stored_end >= token_end;
            if emit_start < stored_end {
                let first_block = (emit_start / block) as usize;
                let keys: Vec<&str> = state.keys[first_block..(stored_end / block) as usize]
                    .iter()
                    .map(|k| &**k)
                    .collect();
                stored.clear();
                sink.get_concatenated(&keys, &mut stored).map_err(PlaneError::Sink)?;
                let local = (emit_start % block) as usize;
                let wanted = (stored_end - emit_start) as usize;
                let have = (stored.len() / row).saturating_sub(local).min(wanted);
                processed.owned.extend_from_slice(&stored[local * row..(local + have) * row]);
                if stored_end < token_end {
                    self.read(index, stored_end..token_end, &mut processed.owned)?;
                }
            } else {
                self.read(index, emit_start..token_end, &mut processed.owned)?;
            }
            let last = processed.owned.len() / row;
            let state = self.state_mut(index);
            processed.emitted.push(Emitted {
                position,
                token_start: emit_start,
                cursor_from_step: state.cursor_from_step,
                read_only,
                rows: EmittedRows::Owned(first..last),
            });
            state.emit_cursor = token_end;
            state.cursor_from_step = true;
        }
        if stored.capacity() <= POOLED_PAYLOAD_BYTES {
            self.read_buffer = stored;
        }
        Ok(processed)
    }

    /// `RoutedExpertsBuffer.capture`: stages `rows` (of `input`) from `token_start`; returns
    /// the blocks it completed, not yet retained.
    fn capture<E>(
        &mut self,
        index: u32,
        token_start: i64,
        rows: Range<usize>,
        input: &[u8],
    ) -> Result<Vec<(i64, Block)>, PlaneError<E>> {
        if token_start < 0 {
            return Err(PlaneError::Value(
                "auxiliary output token start must be non-negative".to_owned(),
            ));
        }
        let (block, row) = (self.config.block_size, self.config.row_nbytes);
        let len = rows.len();
        let mut completed = Vec::new();
        let mut offset = 0;
        while offset < len {
            let position = token_start + offset as i64;
            let block_start = position / block as i64 * block as i64;
            let local_start = (position - block_start) as usize;
            let has_tail = self.state(index).tail.is_some();
            // Full aligned input blocks need no staging.
            if !has_tail && local_start == 0 && len - offset >= block {
                completed.push((block_start, Block::Input(rows.start + offset)));
                offset += block;
                continue;
            }
            let tail = match self.state(index).tail {
                Some(tail) => {
                    if tail.block_start != block_start {
                        return assertion("auxiliary output capture skipped an incomplete block");
                    }
                    tail
                }
                None => {
                    let slot = self.take_slot()?;
                    let tail = Tail { slot, block_start, length: 0 };
                    self.state_mut(index).tail = Some(tail);
                    tail
                }
            };
            if local_start != tail.length {
                return assertion("auxiliary output capture is not contiguous");
            }
            let count = (block - local_start).min(len - offset);
            let from = (rows.start + offset) * row;
            let staged = self.slot_bytes(tail.slot);
            staged[local_start * row..(local_start + count) * row]
                .copy_from_slice(&input[from..from + count * row]);
            offset += count;
            let state = self.state_mut(index);
            let length = tail.length + count;
            if length == block {
                state.tail = None;
                completed.push((block_start, Block::Staged(tail.slot)));
            } else {
                state.tail = Some(Tail { length, ..tail });
            }
        }
        Ok(completed)
    }

    /// `RoutedExpertsBuffer.read(request_id, from, to, ...)` for the request at `index`, rows
    /// `from..to`, appended to `out`, as the layout's vLLM reads.
    fn read<E>(
        &self,
        index: u32,
        rows: Range<i64>,
        out: &mut Vec<u8>,
    ) -> Result<(), PlaneError<E>> {
        let state = self.state(index);
        let pieces = if self.config.layout.reads_pending_blocks() {
            state.staged_rows(rows, self.config.block_size)?
        } else {
            state.tail_rows(rows)?
        };
        let (n, row) = (self.config.block_nbytes(), self.config.row_nbytes);
        for (slot, rows) in pieces {
            let base = slot as usize * n;
            out.extend_from_slice(&self.staging[base + rows.start * row..base + rows.end * row]);
        }
        Ok(())
    }

    /// `_publish_blocks`: blocks whose key is known go to the store in one call with the
    /// retains and releases; the others stay staged until their hash arrives.
    fn publish<S: Sink>(
        &mut self,
        batches: Batches,
        input: &[u8],
        retains: &[Box<str>],
        releases: &[Box<str>],
        sink: &mut S,
    ) -> Result<(), PlaneError<S::Error>> {
        if !self.store_open {
            return assertion("auxiliary output store is closed");
        }
        let (block, n) = (self.config.block_size as i64, self.config.block_nbytes());
        let row = self.config.row_nbytes;
        let mut ready: Vec<(u32, i64, Block)> = Vec::new();
        for (index, completed) in batches {
            let keyed_end = self.state(index).keys.len() as i64 * block;
            if self.state(index).pending_blocks.is_empty()
                && completed.iter().all(|&(start, _)| start < keyed_end)
            {
                // Nothing staged and every completed block keyed (a decode's usual step): all
                // ready, nothing stays pending.
                ready.extend(completed.into_iter().map(|(start, data)| (index, start, data)));
                continue;
            }
            let blocks: Vec<(i64, Block)> = {
                let state = self.state(index);
                state
                    .pending_blocks
                    .iter()
                    .map(|&(start, slot)| (start, Block::Staged(slot)))
                    .chain(completed)
                    .collect()
            };
            let mut still_pending = Vec::new();
            for &(start, data) in &blocks {
                if start < keyed_end {
                    ready.push((index, start, data));
                    continue;
                }
                // Retained until its hash arrives: rows of the input are copied to a slot.
                let slot = match data {
                    Block::Staged(slot) => slot,
                    Block::Input(first) => {
                        let slot = self.take_slot()?;
                        self.slot_bytes(slot).copy_from_slice(&input[first * row..first * row + n]);
                        slot
                    }
                };
                still_pending.push((start, slot));
            }
            self.state_mut(index).pending_blocks = still_pending;
        }
        if ready.is_empty() && retains.is_empty() && releases.is_empty() {
            return Ok(());
        }
        let mut call = Publication {
            payload: Payload {
                bytes: self.payloads.take(ready.len() * n),
                pool: Some(Arc::clone(&self.payloads)),
            },
            ..Default::default()
        };
        for &(index, start, data) in &ready {
            let key = call.push_key(&self.state(index).keys[(start / block) as usize]);
            let at = call.payload.len();
            match data {
                Block::Input(first) => {
                    call.payload.extend_from_slice(&input[first * row..first * row + n])
                }
                Block::Staged(slot) => {
                    let from = slot as usize * n;
                    call.payload.extend_from_slice(&self.staging[from..from + n]);
                }
            }
            call.objects.push((key, at..at + n));
        }
        call.retains = retains.iter().map(|key| call.push_key(key)).collect();
        call.releases = releases.iter().map(|key| call.push_key(key)).collect();
        sink.put(call).map_err(PlaneError::Sink)?;
        // Copied at hand-over: the slots are free again.
        for (_, _, data) in ready {
            if let Block::Staged(slot) = data {
                self.free_slots.push(slot);
            }
        }
        Ok(())
    }

    /// `_teardown`: drops finished requests with their staged blocks and tails.
    fn teardown(&mut self, finished: &[u32]) {
        for &index in finished {
            let state = self.remove_state(index);
            self.free_slots.extend(state.pending_blocks.iter().map(|&(_, slot)| slot));
            if let Some(tail) = state.tail {
                self.free_slots.push(tail.slot);
            }
        }
    }

    /// A generation change: every request and staged row dropped (vLLM's `buffer.reset()` and
    /// `requests.clear()`).
    fn reset(&mut self) {
        self.states.clear();
        self.free_states.clear();
        self.by_id.clear();
        let slots = self.config.max_blocks() as Slot;
        self.free_slots.clear();
        self.free_slots.extend((0..slots).rev());
    }

    /// `close()`: no step stays in flight; later commits and publications fail as vLLM's
    /// (its store is `None`).
    pub fn close(&mut self) {
        self.in_flight.clear();
        self.store_open = false;
    }
}

/// vLLM's key for a block hash: `vllm-artifact/<generation>/<hash as hex>`.
pub fn key_for(generation: i64, hash: &[u8]) -> Box<str> {
    let mut key = key_prefix(generation);
    push_hex(&mut key, hash);
    key.into_boxed_str()
}

fn key_prefix(generation: i64) -> String {
    let mut prefix = String::with_capacity(24);
    let _ = write!(prefix, "vllm-artifact/{generation}/");
    prefix
}

/// `hash.hex()`: two lowercase digits a byte, appended (a table, not a format call a byte).
fn push_hex(key: &mut String, hash: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    key.reserve(2 * hash.len());
    for &byte in hash {
        key.push(char::from(DIGITS[usize::from(byte >> 4)]));
        key.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
}

/// The rows `sequence[start:stop]` selects in Python, for a sequence of `len` rows.
fn python_slice(len: usize, start: i64, stop: i64) -> Range<usize> {
    let clamp = |i: i64| -> usize {
        let i = if i < 0 { i + len as i64 } else { i };
        i.clamp(0, len as i64) as usize
    };
    let (lo, hi) = (clamp(start), clamp(stop));
    lo..hi.max(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_slices_clamp_and_wrap() {
        assert_eq!(python_slice(5, 1, 3), 1..3);
        assert_eq!(python_slice(5, 3, 9), 3..5);
        assert_eq!(python_slice(5, -2, 5), 3..5);
        assert_eq!(python_slice(5, 4, 2), 4..4);
        assert_eq!(python_slice(5, -9, 1), 0..1);
    }

    #[test]
    fn keys_are_vllms() {
        assert_eq!(&*key_for(3, &[0x00, 0xab, 0x10]), "vllm-artifact/3/00ab10");
        let every: Vec<u8> = (0..=255).collect();
        let hex: String = every.iter().map(|byte| format!("{byte:02x}")).collect();
        assert_eq!(&*key_for(-1, &every), format!("vllm-artifact/-1/{hex}"));
    }

    #[test]
    fn staging_is_sized_as_vllms_buffer() {
        let config = PlaneConfig {
            block_size: 16,
            row_nbytes: 368,
            max_num_seqs: 256,
            max_num_batched_tokens: 16384,
            max_concurrent_batches: 2,
            layout: crate::Layout::V0_33,
        };
        assert_eq!(config.max_blocks(), 2 * (1024 + 256) + 256);
    }
}
