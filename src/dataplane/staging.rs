//! vLLM's `RoutedExpertsBuffer`: the staging slots (a block of rows each, sized as vLLM's
//! buffer, whose exhaustion is the same assertion), capture into a request's tail, and the reads
//! over a request's unkeyed blocks and tail. Rows are bytes here: what they hold is `Capture`'s.

use std::ops::Range;

use super::{assertion, python_slice, PlaneConfig, PlaneError};

pub(super) type Slot = u32;

/// A request's incomplete block, staged in a slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tail {
    slot: Slot,
    block_start: i64,
    length: usize,
}

/// A request's rows in the buffer: its full blocks whose hash has not arrived (always staged)
/// and its incomplete block. The request state holds it; only the staging reads or changes it.
#[derive(Debug, Default)]
pub(super) struct Staged {
    pending_blocks: Vec<(i64, Slot)>,
    tail: Option<Tail>,
}

/// A full block: still rows of the step's input (aligned, never staged), or a staging slot.
#[derive(Debug, Clone, Copy)]
pub(super) enum Block {
    Input(usize),
    Staged(Slot),
}

/// Rows of staged slots, in order: a slot and the rows of it to read.
type Pieces = Vec<(Slot, Range<usize>)>;

/// The slots, back to back, and those free (a stack: the last freed is the next taken).
pub(super) struct Staging {
    bytes: Vec<u8>,
    free: Vec<Slot>,
    slots: usize,
    block_size: usize,
    row_nbytes: usize,
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

impl Staging {
    pub(super) fn new(config: &PlaneConfig) -> Result<Self, String> {
        let slots = config.max_blocks();
        let bytes = slots
            .checked_mul(config.block_nbytes())
            .filter(|&b| slots <= Slot::MAX as usize && b <= isize::MAX as usize)
            .ok_or_else(|| format!("{slots} staging blocks do not fit in memory"))?;
        let staging =
            zeroed(bytes).ok_or_else(|| format!("cannot allocate {bytes} bytes of staging"))?;
        Ok(Self {
            bytes: staging,
            free: (0..slots as Slot).rev().collect(),
            slots,
            block_size: config.block_size,
            row_nbytes: config.row_nbytes,
        })
    }

    /// Slots not in use.
    pub(super) fn free(&self) -> usize {
        self.free.len()
    }

    fn block_nbytes(&self) -> usize {
        self.block_size * self.row_nbytes
    }

    fn slot_bytes(&mut self, slot: Slot) -> &mut [u8] {
        let n = self.block_nbytes();
        let at = slot as usize * n;
        &mut self.bytes[at..at + n]
    }

    fn take<E>(&mut self) -> Result<Slot, PlaneError<E>> {
        match self.free.pop() {
            Some(slot) => Ok(slot),
            None => assertion("auxiliary output block pool is exhausted"),
        }
    }

    /// A slot back in the pool: its block was handed over or its request dropped.
    pub(super) fn give(&mut self, slot: Slot) {
        self.free.push(slot);
    }

    /// The bytes of a full block, where they are now.
    pub(super) fn block<'a>(&'a self, block: Block, input: &'a [u8]) -> &'a [u8] {
        let (n, row) = (self.block_nbytes(), self.row_nbytes);
        match block {
            Block::Input(first) => &input[first * row..first * row + n],
            Block::Staged(slot) => {
                let from = slot as usize * n;
                &self.bytes[from..from + n]
            }
        }
    }

    /// A full block kept until its hash arrives: rows of the input are copied to a slot.
    fn keep<E>(&mut self, block: Block, input: &[u8]) -> Result<Slot, PlaneError<E>> {
        match block {
            Block::Staged(slot) => Ok(slot),
            Block::Input(first) => {
                let slot = self.take()?;
                let from = first * self.row_nbytes;
                let n = self.block_nbytes();
                self.slot_bytes(slot).copy_from_slice(&input[from..from + n]);
                Ok(slot)
            }
        }
    }

    /// `RoutedExpertsBuffer.capture`: stages `rows` (of `input`) from `token_start` into a
    /// request's `state`; returns the blocks it completed, not yet retained.
    pub(super) fn capture<E>(
        &mut self,
        state: &mut Staged,
        token_start: i64,
        rows: Range<usize>,
        input: &[u8],
    ) -> Result<Vec<(i64, Block)>, PlaneError<E>> {
        if token_start < 0 {
            return Err(PlaneError::Value(
                "auxiliary output token start must be non-negative".to_owned(),
            ));
        }
        let (block, row) = (self.block_size, self.row_nbytes);
        let len = rows.len();
        let mut completed = Vec::new();
        let mut offset = 0;
        while offset < len {
            let position = token_start + offset as i64;
            let block_start = position / block as i64 * block as i64;
            let local_start = (position - block_start) as usize;
            // Full aligned input blocks need no staging.
            if state.tail.is_none() && local_start == 0 && len - offset >= block {
                completed.push((block_start, Block::Input(rows.start + offset)));
                offset += block;
                continue;
            }
            let tail = match state.tail {
                Some(tail) => {
                    if tail.block_start != block_start {
                        return assertion("auxiliary output capture skipped an incomplete block");
                    }
                    tail
                }
                None => {
                    let slot = self.take()?;
                    let tail = Tail { slot, block_start, length: 0 };
                    state.tail = Some(tail);
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

    /// A step's completed blocks of `state`, after those it kept unkeyed: each keyed one (below
    /// `keyed_blocks`, the hashes the request has) goes to `ready`, the others stay (in a slot, copied there if still rows of `input`) until their
    /// hash arrives. A failure leaves the request's unkeyed blocks as they were.
    pub(super) fn settle<E>(
        &mut self,
        state: &mut Staged,
        keyed_blocks: usize,
        completed: Vec<(i64, Block)>,
        input: &[u8],
        mut ready: impl FnMut(i64, Block),
    ) -> Result<(), PlaneError<E>> {
        let keyed_end = keyed_blocks as i64 * self.block_size as i64;
        if state.pending_blocks.is_empty() && completed.iter().all(|&(start, _)| start < keyed_end)
        {
            // Nothing staged and every completed block keyed (a decode's usual step): all
            // ready, nothing stays pending.
            completed.into_iter().for_each(|(start, data)| ready(start, data));
            return Ok(());
        }
        let blocks: Vec<(i64, Block)> = state
            .pending_blocks
            .iter()
            .map(|&(start, slot)| (start, Block::Staged(slot)))
            .chain(completed)
            .collect();
        let mut still_pending = Vec::new();
        for (start, data) in blocks {
            if start < keyed_end {
                ready(start, data);
                continue;
            }
            still_pending.push((start, self.keep(data, input)?));
        }
        state.pending_blocks = still_pending;
        Ok(())
    }

    /// `RoutedExpertsBuffer.read(request_id, from, to, ...)` of `state`, rows `from..to`,
    /// appended to `out`: over its unkeyed blocks and tail where `pending_blocks` (0.34.0), else
    /// over its tail alone.
    pub(super) fn read<E>(
        &self,
        state: &Staged,
        rows: Range<i64>,
        pending_blocks: bool,
        out: &mut Vec<u8>,
    ) -> Result<(), PlaneError<E>> {
        let pieces = if pending_blocks {
            staged_rows(state, rows, self.block_size)?
        } else {
            tail_rows(state, rows)?
        };
        let (n, row) = (self.block_nbytes(), self.row_nbytes);
        for (slot, rows) in pieces {
            let base = slot as usize * n;
            out.extend_from_slice(&self.bytes[base + rows.start * row..base + rows.end * row]);
        }
        Ok(())
    }

    /// A dropped request's unkeyed blocks and tail back in the pool.
    pub(super) fn release(&mut self, state: &Staged) {
        self.free.extend(state.pending_blocks.iter().map(|&(_, slot)| slot));
        if let Some(tail) = state.tail {
            self.free.push(tail.slot);
        }
    }

    /// Every slot free (vLLM's `buffer.reset()`).
    pub(super) fn reset(&mut self) {
        self.free.clear();
        self.free.extend((0..self.slots as Slot).rev());
    }
}

/// 0.32.0 and 0.33.0: rows `[from, to)` of the request's tail.
fn tail_rows<E>(state: &Staged, rows: Range<i64>) -> Result<Pieces, PlaneError<E>> {
    let Some(tail) = state.tail else {
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
fn staged_rows<E>(state: &Staged, rows: Range<i64>, block: usize) -> Result<Pieces, PlaneError<E>> {
    let Range { start: from, end: to } = rows;
    let parts: Vec<(i64, Slot, usize)> = state
        .pending_blocks
        .iter()
        .map(|&(start, slot)| (start, slot, block))
        .chain(state.tail.map(|tail| (tail.block_start, tail.slot, tail.length)))
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
