//! vLLM's worker-side routed-experts data plane, natively: what `AuxOutputWorkerConnector`
//! (`begin_step`, `prepare_output`, `process_output`) and `RoutedExpertsBuffer` do per request
//! per step, with the same observable behaviour (outputs, store calls in order, the error kind
//! at the same point). The engine's Python hands over a step's arrays once; the per-request
//! loops run here. No PyO3: the binding (`python/dataplane/`) converts and locks.
//!
//! Names follow vLLM's: a *request state* (cursors, keys, staged blocks), a *tail* (a request's
//! incomplete block, staged in a slot), *slots* (the staging pool, sized as vLLM's buffer, whose
//! exhaustion is the same assertion), *steps in flight* (prepared, not yet processed).
//!
//! The house: `connector` (requests in `requests`, steps in flight, the three calls), `staging`
//! (the slots, capture, reads over unkeyed blocks and the tail), `publication` (keys, payloads,
//! the `Sink`), `step` (what a step hands over and gets back), and `capture`, the sealed trait
//! that holds what is routed experts' own.

mod capture;
mod connector;
mod publication;
mod requests;
mod staging;
mod step;

use std::ops::Range;

pub use capture::{key_for, Capture, RoutedExperts};
pub use connector::{DataPlane, Plane};
pub use publication::{Payload, Publication, Sink};
pub use step::{Emitted, EmittedRows, Processed, StepInput, StepMetadata};

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

    /// Bytes of the full blocks one step can complete: the largest payload of a step's call.
    pub fn step_nbytes(&self) -> usize {
        self.max_num_batched_tokens.div_ceil(self.block_size).saturating_mul(self.block_nbytes())
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
