//! `NativeDataPlane`: vLLM's worker connector calls, handed to `crate::dataplane` once a step.
//!
//! Rules, from `docs/data-plane.md`: the plane's lock is taken only with the GIL released, and
//! no Python object is made or dropped while it is held (the arguments are read into Rust
//! first, the outputs built after); calls go to the store through the Rust writer, owned
//! (copied at hand-over); the rows and counts are read in `process_output` only. The
//! arguments are read in `input`, the outputs built in `output`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyAssertionError, PyKeyError, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::PyTraverseError;

use super::lock::{detach, DetachedMutex};
use super::writer::{NativeWriter, PlaneWriter};
use crate::dataplane::{
    Capture, DataPlane, PlaneConfig, PlaneError, Publication, RoutedExperts, Sink, StepInput,
};
use crate::writer::Refusal;

mod input;
mod output;

use input::{metadata, texts, Held};
use output::{plain_dataclass, CursorType};

/// The store side of the plane: the connector's Rust writer, used with the GIL released.
struct WriterSink<'a> {
    writer: &'a PlaneWriter,
    /// A Python caller's argument error is latched: the writer takes nothing more.
    input_failed: bool,
}

impl Sink for WriterSink<'_> {
    type Error = Refusal;

    fn put(&mut self, publication: Publication) -> Result<(), Refusal> {
        match self.input_failed {
            true => Err(Refusal::Failed),
            false => self.writer.put(publication),
        }
    }

    fn get_concatenated(&mut self, keys: &[&str], out: &mut Vec<u8>) -> Result<(), Refusal> {
        match self.input_failed {
            true => Err(Refusal::Failed),
            false => self.writer.get_concatenated(keys, out),
        }
    }
}

/// The data plane of one `AuxOutputWorkerConnector` (see `aostore.vllm.dataplane`).
#[pyclass(module = "aostore._native", frozen, name = "NativeDataPlane")]
pub struct NativeDataPlane {
    plane: DetachedMutex<DataPlane>,
    writer: Py<NativeWriter>,
    /// vLLM's `AuxRequestOutput`.
    output_class: Py<PyAny>,
    /// It is a plain dataclass of `token_start` and `rows`: made without running its
    /// `__init__` (the same instance, a Python frame less per request).
    plain_output: bool,
    /// The capture dtype (a numpy dtype) and shape per token, and one row's bytes.
    dtype: Py<PyAny>,
    shape: Py<PyTuple>,
    row_nbytes: usize,
    /// The layout's metadata carries KV-cached retains and releases (asked once, at `new`).
    kv_events: bool,
    /// `aostore.vllm.transport.StepRows.packed`: outputs go as one buffer a step
    /// (`super::step_rows`); `None`: as vLLM's dict.
    step_rows: Option<Py<PyAny>>,
    numpy: Py<PyModule>,
    /// Steps processed and outputs emitted natively: the proof that the plane ran.
    steps: AtomicU64,
    outputs: AtomicU64,
    /// The type of vLLM's emit cursor once a step set it, and how to make one (touched only
    /// with the GIL held, never with the plane's lock). A plain mutex: only GIL holders take
    /// it and none runs Python or lets the GIL go while holding it, so it is never contended.
    cursor: Mutex<Option<CursorType>>,
}

impl NativeDataPlane {
    /// Runs `f` on the plane with the writer as its sink, under the lock, GIL released.
    fn with_plane<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut DataPlane, &mut WriterSink<'_>) -> Result<T, PlaneError<Refusal>> + Send,
    ) -> PyResult<T> {
        let writer = self.writer.get();
        // In a forked child the writer's thread is the parent's, and the plane's lock may be
        // held by a parent thread that no longer exists: refuse before taking it.
        writer.ensure_same_process()?;
        let input_failed = writer.input_failed(py);
        let result = detach(py, |unattached| {
            let mut sink = WriterSink { writer: writer.core(), input_failed };
            f(&mut self.plane.lock_unattached(unattached), &mut sink)
        });
        result.map_err(|error| plane_error(py, writer, error))
    }
}

fn plane_error(py: Python<'_>, writer: &NativeWriter, error: PlaneError<Refusal>) -> PyErr {
    match error {
        PlaneError::Assertion(message) => PyAssertionError::new_err(message),
        PlaneError::Value(message) => PyValueError::new_err(message),
        PlaneError::UnknownRequest(id) => PyKeyError::new_err(id),
        PlaneError::NotInFlight => PyValueError::new_err("list.remove(x): x not in list"),
        PlaneError::Sink(refusal) => writer.refusal_error(py, refusal),
    }
}
#[pymethods]
impl NativeDataPlane {
    #[new]
    #[pyo3(signature = (writer, *, layout, block_size, shape_per_token, dtype, max_num_seqs, max_num_batched_tokens, max_concurrent_batches, output_class, step_rows = None))]
    #[expect(clippy::too_many_arguments, reason = "the connector's own configuration, by name")]
    fn new(
        py: Python<'_>,
        writer: &Bound<'_, PyAny>,
        layout: &str,
        block_size: usize,
        shape_per_token: Vec<usize>,
        dtype: &Bound<'_, PyAny>,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_concurrent_batches: usize,
        output_class: &Bound<'_, PyAny>,
        step_rows: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let writer = writer.cast::<NativeWriter>().map_err(|_| {
            PyTypeError::new_err("NativeDataPlane needs aostore's Rust writer (NativeWriter)")
        })?;
        if !writer.get().serves_data_plane() {
            return Err(PyTypeError::new_err(
                "NativeDataPlane needs a writer in front of a fixed-size aostore store",
            ));
        }
        let layout = super::layout::layout(layout)?;
        let numpy = py.import(intern!(py, "numpy"))?;
        let dtype = numpy.call_method1(intern!(py, "dtype"), (dtype,))?;
        let itemsize: usize = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
        let row_nbytes = RoutedExperts::row_nbytes(&shape_per_token, itemsize);
        let config = PlaneConfig {
            block_size,
            row_nbytes,
            max_num_seqs,
            max_num_batched_tokens,
            max_concurrent_batches,
            layout,
        };
        let kv_events = layout.kv_events();
        let plane = DataPlane::new(config).map_err(PyValueError::new_err)?;
        let plain_output = plain_dataclass(output_class)?;
        Ok(Self {
            plane: DetachedMutex::new(plane),
            writer: writer.clone().unbind(),
            output_class: output_class.clone().unbind(),
            plain_output,
            dtype: dtype.unbind(),
            shape: PyTuple::new(py, &shape_per_token)?.unbind(),
            row_nbytes,
            kv_events,
            step_rows: step_rows.map(Bound::unbind),
            numpy: numpy.unbind(),
            steps: AtomicU64::new(0),
            outputs: AtomicU64::new(0),
            cursor: Mutex::new(None),
        })
    }

    /// `begin_step(metadata)` for a metadata that is not `None`.
    fn begin_step(&self, py: Python<'_>, metadata: &Bound<'_, PyAny>) -> PyResult<()> {
        let held = Held::new();
        let metadata = self::metadata(metadata, &held, self.kv_events)?;
        self.with_plane(py, |plane, sink| plane.begin_step(&metadata, sink))
    }

    /// `prepare_output`'s bookkeeping for the step's request ids; returns the step's token.
    fn prepare_output(&self, py: Python<'_>, request_ids: &Bound<'_, PyList>) -> PyResult<u64> {
        let items: Vec<Bound<'_, PyAny>> = request_ids.iter().collect();
        let ids = texts(&items)?;
        self.with_plane(py, |plane, _| plane.prepare_output(ids.iter().copied()))
    }

    /// `process_output(pending)`: the step's outputs as vLLM's dict of `AuxRequestOutput`.
    fn process_output<'py>(
        &self,
        py: Python<'py>,
        pending: &Bound<'py, PyAny>,
        token: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let routed = pending.getattr(intern!(py, RoutedExperts::ROWS))?;
        let sampled = pending.getattr(intern!(py, "num_sampled"))?;
        let rejected = pending.getattr(intern!(py, "num_rejected"))?;
        let copied = !(routed.is_none() || sampled.is_none() || rejected.is_none());
        let numpy = self.numpy.bind(py);
        let (mut rows_array, mut profile_matches) = (None, false);
        let (mut num_sampled, mut num_rejected) = (Vec::new(), Vec::new());
        if copied {
            let array = numpy.call_method1(intern!(py, "asarray"), (&routed,))?;
            let shape = array.getattr(intern!(py, "shape"))?.cast_into::<PyTuple>()?;
            profile_matches = array.getattr(intern!(py, "dtype"))?.eq(self.dtype.bind(py))?
                && !shape.is_empty()
                && shape.get_slice(1, shape.len()).eq(self.shape.bind(py))?;
            rows_array = Some(array);
            num_sampled = self.integers(py, &sampled)?;
            num_rejected = self.integers(py, &rejected)?;
        }
        let token_starts_object = pending.getattr(intern!(py, "token_starts"))?;
        let token_starts = self.integers(py, &token_starts_object)?;
        let query_start_loc =
            self.integers(py, &pending.getattr(intern!(py, "query_start_loc"))?)?;
        let request_ids = pending.getattr(intern!(py, "request_ids"))?;
        // The rows as bytes: a C-contiguous export (a strided array is copied once).
        let contiguous = match &rows_array {
            Some(array) if profile_matches => {
                Some(numpy.call_method1(intern!(py, "ascontiguousarray"), (array,))?)
            }
            _ => None,
        };
        let buffer = contiguous.as_ref().map(PyUntypedBuffer::get).transpose()?;
        let rows: &[u8] = match &buffer {
            // SAFETY: a C-contiguous export, alive (and not resized) while `buffer` is.
            Some(buffer) => unsafe {
                std::slice::from_raw_parts(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes())
            },
            None => &[],
        };
        let input = StepInput {
            token_starts: &token_starts,
            query_start_loc: &query_start_loc,
            num_sampled: &num_sampled,
            num_rejected: &num_rejected,
            rows,
            profile_matches,
            copied,
        };
        let processed =
            self.with_plane(py, |plane, sink| plane.process_output(token, &input, sink))?;
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.outputs.fetch_add(processed.emitted.len() as u64, Ordering::Relaxed);
        if let Some(step_rows) = &self.step_rows {
            let packed = super::step_rows::pack(
                step_rows.bind(py),
                &processed,
                rows,
                self.row_nbytes,
                &request_ids,
                self.dtype.bind(py),
                self.shape.bind(py),
            );
            drop(buffer);
            return packed;
        }
        drop(buffer);
        Ok(self
            .outputs_dict(py, processed, contiguous.as_ref(), &request_ids, &token_starts_object)?
            .into_any())
    }

    /// `close()`: nothing stays in flight; the connector closes its store itself.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.writer.get().ensure_same_process()?;
        detach(py, |unattached| self.plane.lock_unattached(unattached).close());
        Ok(())
    }

    /// Steps processed natively.
    #[getter]
    fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }

    /// Outputs emitted natively.
    #[getter]
    fn outputs(&self) -> u64 {
        self.outputs.load(Ordering::Relaxed)
    }

    /// Requests the plane tracks, steps in flight and free staging slots (for tests).
    fn counts(&self, py: Python<'_>) -> PyResult<(usize, usize, usize)> {
        self.writer.get().ensure_same_process()?;
        Ok(detach(py, |unattached| {
            let plane = self.plane.lock_unattached(unattached);
            (plane.num_requests(), plane.steps_in_flight(), plane.free_slots())
        }))
    }

    // The fields never change (the cursor's type is set once), so the collector breaks a
    // cycle through the plane (the connector holds it; `step_rows` is a bound method of an
    // object that may hold the connector) by clearing the other objects of it.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.writer)?;
        visit.call(&self.output_class)?;
        visit.call(&self.dtype)?;
        visit.call(&self.shape)?;
        visit.call(&self.step_rows)?;
        visit.call(&self.numpy)?;
        // Skipped while this thread sets it (traversal must not block), for this pass only.
        if let Ok(cursor) = self.cursor.try_lock() {
            if let Some(cursor) = cursor.as_ref() {
                visit.call(&cursor.kind)?;
            }
        }
        Ok(())
    }
}
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeDataPlane>()
}
