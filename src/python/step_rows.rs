//! A step's outputs packed for `aostore.vllm.transport`: one fresh buffer of every emitted
//! request's rows, in vLLM's dict order, and an index, handed to `StepRows.packed`.
//!
//! The layout is `StepRows`'s, specified once in `python/aostore/vllm/transport/rows.py` (its
//! `FORMAT`); a change here is a change of that format. The buffer is a new `bytearray` each
//! step: vLLM keeps the rows (views of it) past the step.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyAssertionError, PyRuntimeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PySlice, PyTuple, PyType};
use pyo3::{PyTraverseError, PyVisit};

use crate::dataplane::{EmittedRows, Processed};

use super::row_pages::bytes_of;

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

/// `StepRows.take(request)`: vLLM's `AuxOutputSchedulerConnector.take_output` over a packed
/// step, with vLLM's checks and messages (`AssertionError`, raised whatever `-O` says), without
/// an `AuxRequestOutput` per request: the request's rows up to its last token, a view of the
/// step's buffer, or None where the step has none for it yet.
fn take<'py>(
    step: &Bound<'py, PyAny>,
    request: &Bound<'py, PyAny>,
    as_span: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = step.py();
    let mut found = step.getattr(intern!(py, "_native_index"))?;
    if found.is_none() {
        let index = StepIndex::new(step)?;
        found = Bound::new(py, index)?.into_any();
        step.setattr(intern!(py, "_native_index"), &found)?;
    }
    let index = found.cast::<StepIndex>()?.get();
    let request_id = request.getattr(intern!(py, "request_id"))?;
    let Some((token_start, begin, end)) = index.find(&request_id)? else {
        return Err(PyAssertionError::new_err(format!(
            "auxiliary output worker output is missing {request_id}"
        )));
    };
    let token_end = request.getattr(intern!(py, "num_tokens"))?.extract::<i64>()? - 1;
    let local_end = token_end - token_start;
    let range = |what: &str| {
        format!(
            "{what}: request={request_id}, token_end={token_end}, output_start={token_start}, \
             output_end={}",
            token_start + end - begin
        )
    };
    if local_end < 0 {
        if request.call_method0(intern!(py, "is_finished"))?.is_truthy()? {
            return Err(PyAssertionError::new_err(range(
                "finished auxiliary output output has no accepted token range",
            )));
        }
        return Ok(py.None().into_bound(py));
    }
    if local_end > end - begin {
        return Err(PyAssertionError::new_err(range(
            "auxiliary output worker output has an invalid token range",
        )));
    }
    let rows = step.getattr(intern!(py, "_rows"))?;
    if as_span {
        let (begin, end) = (begin as usize, (begin + local_end) as usize);
        return Ok(Bound::new(py, StepRowsSpan { rows: rows.unbind(), begin, end })?.into_any());
    }
    rows.get_item(PySlice::new(py, begin as isize, (begin + local_end) as isize, 1))
}

/// A step's index as `take` reads it, made once a step: each request's (token start, first
/// row, row end) in the worker's order, and where the last request taken was. vLLM's scheduler
/// takes the requests in the order the worker emitted them, so the next one is almost always
/// the one after the last; any other is found through a dict made the first time one is.
#[pyclass(module = "aostore._native", frozen)]
pub(crate) struct StepIndex {
    ids: Py<PyTuple>,
    spans: Vec<(i64, i64, i64)>,
    next: std::sync::atomic::AtomicUsize,
    by_id: std::sync::OnceLock<Py<PyDict>>,
}

impl StepIndex {
    fn new(step: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = step.py();
        let ids = step.getattr(intern!(py, "_ids"))?.cast_into::<PyTuple>()?;
        let index = step.getattr(intern!(py, "_index"))?;
        // `StepRows` made it: little-endian int64 pairs (rows.py's `FORMAT`), one per id.
        let buffer = PyUntypedBuffer::get(&index)?;
        let bytes = bytes_of(&buffer);
        if !buffer.is_c_contiguous() || bytes.len() != ids.len() * 16 {
            return Err(PyAssertionError::new_err("a step's index and ids differ in length"));
        }
        let int = |at: usize| i64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let mut begin = 0;
        let spans = (0..ids.len())
            .map(|i| {
                let span = (int(16 * i), begin, int(16 * i + 8));
                begin = span.2;
                span
            })
            .collect();
        Ok(Self {
            ids: ids.unbind(),
            spans,
            next: std::sync::atomic::AtomicUsize::new(0),
            by_id: std::sync::OnceLock::new(),
        })
    }

    fn find(&self, request_id: &Bound<'_, PyAny>) -> PyResult<Option<(i64, i64, i64)>> {
        use std::sync::atomic::Ordering::Relaxed;
        let py = request_id.py();
        let ids = self.ids.bind(py);
        let next = self.next.load(Relaxed);
        let position = if next < ids.len() && ids.get_item(next)?.eq(request_id)? {
            Some(next)
        } else {
            let by_id = match self.by_id.get() {
                Some(by_id) => by_id.bind(py).clone(),
                None => {
                    let by_id = PyDict::new(py);
                    for (position, id) in ids.iter().enumerate() {
                        by_id.set_item(id, position)?;
                    }
                    self.by_id.get_or_init(|| by_id.clone().unbind());
                    by_id
                }
            };
            match by_id.get_item(request_id)? {
                Some(position) => Some(position.extract::<usize>()?),
                None => None,
            }
        };
        Ok(position.map(|position| {
            self.next.store(position + 1, Relaxed);
            self.spans[position]
        }))
    }
}

#[pymethods]
impl StepIndex {
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.ids)?;
        if let Some(by_id) = self.by_id.get() {
            visit.call(by_id)?;
        }
        Ok(())
    }
}

/// Rows `begin..end` of a step buffer (`StepRows._rows`), for an engine core whose encoder packs
/// them (`aostore.vllm.transport.wire`): what `take_output` gives vLLM's `EngineCoreOutput`
/// there instead of a numpy view, which would cost an array object per request a step, made
/// and freed, and a buffer export when packed. Nothing in vLLM reads it before the encoder
/// (its scheduler hands it straight to `EngineCoreOutput`); an encoder that does not pack
/// makes it the view first (`array`). Kept on a free list: a class of PyO3's is a collected
/// type, whose every allocation counts toward the collector's next run, and ~500 made a step
/// set off collections, full ones among them; reused from the list, they count nothing.
#[pyclass(module = "aostore._native", frozen, freelist = 4096)]
pub(crate) struct StepRowsSpan {
    pub(crate) rows: Py<PyAny>,
    pub(crate) begin: usize,
    pub(crate) end: usize,
}

#[pymethods]
impl StepRowsSpan {
    /// The rows as `take_output` gives them where nothing packs: a view of the step buffer.
    pub(crate) fn array<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.rows.bind(py).get_item(PySlice::new(py, self.begin as isize, self.end as isize, 1))
    }

    fn __len__(&self) -> usize {
        self.end - self.begin
    }
}

/// `take_step_rows(step_rows, request)`: `StepRows.take`, natively.
#[pyfunction]
fn take_step_rows<'py>(
    step_rows: &Bound<'py, PyAny>,
    request: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    take(step_rows, request, false)
}

/// The scheduler connector's `take_output`, one native call per request: a packed step
/// (`step_rows`, while vLLM's class keeps its own `take_output`) read by `take`, anything else
/// by vLLM's method. Set on the connector itself, where vLLM's scheduler looks it up.
#[pyclass(module = "aostore._native")]
pub(crate) struct TakeOutput {
    connector: Option<Py<PyAny>>,
    vllm_class: Py<PyAny>,
    vllm_take_output: Py<PyAny>,
    step_rows: Py<PyType>,
    /// Whether to give `StepRowsSpan`s (this process's encoder packs them) rather than views.
    spans: bool,
}

#[pymethods]
impl TakeOutput {
    #[new]
    #[pyo3(signature = (connector, vllm_class, vllm_take_output, step_rows, spans = false))]
    fn new(
        connector: Py<PyAny>,
        vllm_class: Py<PyAny>,
        vllm_take_output: Py<PyAny>,
        step_rows: Py<PyType>,
        spans: bool,
    ) -> Self {
        Self { connector: Some(connector), vllm_class, vllm_take_output, step_rows, spans }
    }

    fn __call__<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        output: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = request.py();
        let vllms = self.vllm_class.bind(py).getattr(intern!(py, "take_output"))?;
        if output.get_type().is(self.step_rows.bind(py)) && vllms.is(self.vllm_take_output.bind(py))
        {
            return take(output, request, self.spans);
        }
        let Some(connector) = &self.connector else {
            return Err(PyRuntimeError::new_err("take_output: its connector is gone"));
        };
        vllms.call1((connector, request, output))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(connector) = &self.connector {
            visit.call(connector)?;
        }
        visit.call(&self.vllm_class)?;
        visit.call(&self.vllm_take_output)?;
        visit.call(&self.step_rows)
    }

    fn __clear__(&mut self) {
        // The connector holds this object: the cycle the collector breaks here.
        self.connector = None;
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TakeOutput>()?;
    m.add_class::<StepRowsSpan>()?;
    m.add_class::<StepIndex>()?;
    m.add_function(wrap_pyfunction!(take_step_rows, m)?)
}
