//! vLLM's `AuxOutputWorkerConnector`: the requests it tracks, the steps in flight, and its
//! three calls (`begin_step`, `prepare_output`, `process_output`), in vLLM's order of checks
//! and store calls. The rows go to `Staging`, the calls through `Publisher` to a `Sink`.

use std::collections::VecDeque;
use std::marker::PhantomData;

use super::capture::{Capture, RoutedExperts};
use super::publication::{Publisher, Sink, POOLED_PAYLOAD_BYTES};
use super::requests::Requests;
use super::staging::{Block, Staging};
use super::step::{Emitted, EmittedRows, Processed, StepInput, StepMetadata};
use super::{assertion, python_slice, PlaneConfig, PlaneError};

/// A prepared step, named by its token: the requests it counts as pending, in its order.
struct InFlight {
    token: u64,
    requests: Vec<u32>,
}

/// Each request's completed blocks of a step (or none: its new hashes alone).
type Batches = Vec<(u32, Vec<(i64, Block)>)>;

/// The data plane of one connector (the output rank's), for the output `C`.
pub struct Plane<C: Capture> {
    config: PlaneConfig,
    staging: Staging,
    requests: Requests,
    generation: i64,
    publisher: Publisher,
    in_flight: VecDeque<InFlight>,
    next_token: u64,
    store_open: bool,
    /// The last prefix read's buffer, reused by the next (at most `POOLED_PAYLOAD_BYTES`).
    read_buffer: Vec<u8>,
    capture: PhantomData<C>,
}

/// vLLM's routed-experts connector: the one plane there is.
pub type DataPlane = Plane<RoutedExperts>;

impl<C: Capture> Plane<C> {
    pub fn new(config: PlaneConfig) -> Result<Self, String> {
        if config.block_size == 0 || config.row_nbytes == 0 {
            return Err("block size and row size must be positive".to_owned());
        }
        Ok(Self {
            config,
            staging: Staging::new(&config)?,
            requests: Requests::default(),
            generation: 0,
            publisher: Publisher::new(C::key_prefix(0), config.step_nbytes()),
            in_flight: VecDeque::new(),
            next_token: 0,
            store_open: true,
            read_buffer: Vec::new(),
            capture: PhantomData,
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
        self.requests.len()
    }

    pub fn steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Staging slots not in use.
    pub fn free_slots(&self) -> usize {
        self.staging.free()
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
            metadata.retained.iter().map(|hash| self.publisher.key(hash)).collect();
        let mut releases: Vec<Box<str>> =
            metadata.released.iter().map(|hash| self.publisher.key(hash)).collect();
        if metadata.generation > self.generation {
            // The scheduler resets the prefix cache only once all model output is consumed.
            if !self.in_flight.is_empty() {
                return assertion("auxiliary output generation changed with output in flight");
            }
            for state in self.requests.in_order() {
                releases.extend(state.keys.iter().rev().cloned());
            }
            self.reset();
            self.generation = metadata.generation;
            self.publisher.set_prefix(C::key_prefix(metadata.generation));
        }
        for &(id, emit_start) in &metadata.requests {
            let index = match self.requests.find(id) {
                Some(index) => index,
                None => self.requests.insert(id, emit_start),
            };
            let state = &self.requests[index];
            // In-flight steps leave the worker's cursor behind the scheduler's view.
            if state.pending_outputs == 0 && emit_start > state.emit_cursor {
                return assertion("auxiliary output Scheduler emit cursor moved ahead");
            }
        }
        let mut batches: Batches = Vec::with_capacity(metadata.block_hashes.len());
        for &(id, ref hashes) in &metadata.block_hashes {
            let index = self.requests.lookup(id)?;
            let keys: Vec<Box<str>> = hashes.iter().map(|hash| self.publisher.key(hash)).collect();
            retains.extend(keys.iter().cloned());
            self.requests[index].keys.extend(keys);
            batches.push((index, Vec::new()));
        }
        let mut finished_now = Vec::new();
        for &id in &metadata.finished {
            let index = self.requests.lookup(id)?;
            let state = &mut self.requests[index];
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
            let index = self.requests.lookup(id)?;
            self.requests[index].pending_outputs += 1;
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
            let state = &mut self.requests[index];
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
        let num_rows = input.rows.len() / self.config.row_nbytes;
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
            let state = &self.requests[index];
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
                return assertion(C::PROFILE_CHANGED);
            }
            let state = &mut self.requests[index];
            let completed =
                self.staging.capture(&mut state.staged, capture_start, rows.clone(), input.rows)?;
            let token_end = capture_start + rows.len() as i64;
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
        let mut stored = std::mem::take(&mut self.read_buffer);
        for behind in materialize {
            self.emit_behind(&mut processed, &mut stored, behind, sink)?;
        }
        if stored.capacity() <= POOLED_PAYLOAD_BYTES {
            self.read_buffer = stored;
        }
        Ok(processed)
    }

    /// The rows of a request whose emit cursor is behind this step's capture: its keyed blocks
    /// read back from the store, the rest from staging.
    fn emit_behind<S: Sink>(
        &mut self,
        processed: &mut Processed,
        stored: &mut Vec<u8>,
        (position, index, emit_start, token_end): (usize, u32, i64, i64),
        sink: &mut S,
    ) -> Result<(), PlaneError<S::Error>> {
        let (block, row) = (self.config.block_size as i64, self.config.row_nbytes);
        let pending_blocks = self.config.layout.reads_pending_blocks();
        let state = &self.requests[index];
        let stored_end = (token_end / block).min(state.keys.len() as i64) * block;
        let first = processed.owned.len() / row;
        let read_only = emit_start < stored_end && stored_end >= token_end;
        let staged = if emit_start < stored_end {
            let first_block = (emit_start / block) as usize;
            let keys: Vec<&str> = state.keys[first_block..(stored_end / block) as usize]
                .iter()
                .map(|k| &**k)
                .collect();
            stored.clear();
            sink.get_concatenated(&keys, stored).map_err(PlaneError::Sink)?;
            let local = (emit_start % block) as usize;
            let wanted = (stored_end - emit_start) as usize;
            let have = (stored.len() / row).saturating_sub(local).min(wanted);
            processed.owned.extend_from_slice(&stored[local * row..(local + have) * row]);
            (stored_end < token_end).then_some(stored_end..token_end)
        } else {
            Some(emit_start..token_end)
        };
        if let Some(rows) = staged {
            self.staging.read(&state.staged, rows, pending_blocks, &mut processed.owned)?;
        }
        let last = processed.owned.len() / row;
        let state = &mut self.requests[index];
        processed.emitted.push(Emitted {
            position,
            token_start: emit_start,
            cursor_from_step: state.cursor_from_step,
            read_only,
            rows: EmittedRows::Owned(first..last),
        });
        state.emit_cursor = token_end;
        state.cursor_from_step = true;
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
        let block = self.config.block_size as i64;
        let mut ready: Vec<(u32, i64, Block)> = Vec::new();
        for (index, completed) in batches {
            let state = &mut self.requests[index];
            self.staging.settle(
                &mut state.staged,
                state.keys.len(),
                completed,
                input,
                |start, data| ready.push((index, start, data)),
            )?;
        }
        if ready.is_empty() && retains.is_empty() && releases.is_empty() {
            return Ok(());
        }
        let objects = ready.iter().map(|&(index, start, data)| {
            let key = &*self.requests[index].keys[(start / block) as usize];
            (key, self.staging.block(data, input))
        });
        let bytes = ready.len() * self.config.block_nbytes();
        let call = self.publisher.call(objects, bytes, retains, releases);
        sink.put(call).map_err(PlaneError::Sink)?;
        // Copied at hand-over: the slots are free again.
        for (_, _, data) in ready {
            if let Block::Staged(slot) = data {
                self.staging.give(slot);
            }
        }
        Ok(())
    }

    /// `_teardown`: drops finished requests with their staged blocks and tails.
    fn teardown(&mut self, finished: &[u32]) {
        for &index in finished {
            let state = self.requests.remove(index);
            self.staging.release(&state.staged);
        }
    }

    /// A generation change: every request and staged row dropped (vLLM's `buffer.reset()` and
    /// `requests.clear()`).
    fn reset(&mut self) {
        self.requests.clear();
        self.staging.reset();
    }

    /// `close()`: no step stays in flight; later commits and publications fail as vLLM's
    /// (its store is `None`).
    pub fn close(&mut self) {
        self.in_flight.clear();
        self.store_open = false;
    }
}
