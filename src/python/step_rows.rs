//! A step's outputs packed for `aostore.vllm.transport`: one fresh buffer of every emitted
//! request's rows, in vLLM's dict order, and an index, handed to `StepRows.packed`.
//!
//! The layout is `StepRows`'s, specified once in `python/aostore/vllm/transport/rows.py` (its
//! `FORMAT`); a change here is a change of that format. The buffer is a new `bytearray` each
//! step: vLLM keeps the rows (views of it) past the step.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyTuple};

use crate::dataplane::{EmittedRows, Processed};

/// `step_rows(ids, index, data, dtype, shape)` over `processed`; `input` is the step's rows as
/// bytes (what `EmittedRows::Input` ranges index), `row_nbytes` one row's bytes.
pub(crate) fn pack<'py>(
    step_rows: &Bound<'py, PyAny>,
    processed: &Processed,
    input: &[u8],
    row_nbytes: usize,
    request_ids: &Bound<'py, PyAny>,
    dtype: &Bound<'py, PyAny>,
    shape: &Bound<'py, PyTuple>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = step_rows.py();
    let source = |rows: &EmittedRows| -> (&[u8], std::ops::Range<usize>) {
        match rows {
            EmittedRows::Input(range) => (input, range.clone()),
            EmittedRows::Owned(range) => (&processed.owned, range.clone()),
        }
    };
    let total: usize = processed.emitted.iter().map(|e| source(&e.rows).1.len()).sum();
    let mut index = Vec::with_capacity(processed.emitted.len() * 16);
    let mut ids = Vec::with_capacity(processed.emitted.len());
    let mut end = 0usize;
    for emitted in &processed.emitted {
        end += source(&emitted.rows).1.len();
        index.extend_from_slice(&emitted.token_start.to_le_bytes());
        index.extend_from_slice(&(end as i64).to_le_bytes());
        ids.push(request_ids.get_item(emitted.position)?);
    }
    let data = PyByteArray::new_with(py, total * row_nbytes, |out| {
        let mut at = 0;
        for emitted in &processed.emitted {
            let (bytes, rows) = source(&emitted.rows);
            let part = &bytes[rows.start * row_nbytes..rows.end * row_nbytes];
            out[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        Ok(())
    })?;
    step_rows.call1((PyTuple::new(py, ids)?, PyBytes::new(py, &index), data, dtype, shape))
}
