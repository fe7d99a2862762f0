//! What a step hands the plane and what the plane hands back: the scheduler's metadata
//! (`begin_step`), the copied step (`process_output`), and vLLM's outputs over its rows.

use std::ops::Range;

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
