//! `NativeDataPlane`: vLLM's worker connector calls, handed to `crate::dataplane` once a step.
//!
//! Rules, from `docs/data-plane.md`: the plane's lock is taken only with the GIL released, and
//! no Python object is made or dropped while it is held (the arguments are read into Rust
//! first, the outputs built after); calls go to the store through the Rust writer, owned
//! (copied at hand-over); the rows and counts are read in `process_output` only.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyAssertionError, PyKeyError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PySlice, PyString, PyTuple, PyType};
use pyo3::PyTraverseError;

use super::lock::{detach, DetachedMutex};
use super::writer::{NativeWriter, PlaneWriter};
use crate::dataplane::{
    Capture, DataPlane, EmittedRows, PlaneConfig, PlaneError, Processed, Publication,
    RoutedExperts, Sink, StepInput, StepMetadata,
};
use crate::writer::Refusal;

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

/// `type(token_starts[i] + len(rows))`, the type vLLM's emit cursor takes from a step (under
/// NumPy 2, `numpy.int32`), with its value's width when a scalar of it can be made directly.
struct CursorType {
    kind: Py<PyType>,
    /// 4 or 8: a numpy integer scalar, laid out as NumPy's `arrayscalars.h` declares (the
    /// object header, then the value), checked on a probe value when first seen.
    width: Option<usize>,
}

impl CursorType {
    fn of(py: Python<'_>, numpy: &Bound<'_, PyModule>, kind: Bound<'_, PyType>) -> PyResult<Self> {
        let mut cursor = Self { kind: kind.clone().unbind(), width: None };
        let dtype = numpy.call_method1(intern!(py, "dtype"), (&kind,));
        let Ok(dtype) = dtype else { return Ok(cursor) };
        let exact = dtype.getattr(intern!(py, "type"))?.is(&kind);
        let signed = dtype.getattr(intern!(py, "kind"))?.extract::<String>()? == "i";
        let width: usize = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
        if !(exact && signed && matches!(width, 4 | 8)) {
            return Ok(cursor);
        }
        let probe = 0x1234_5678_i64;
        // SAFETY: a numpy integer type of that width, checked against the type's own result.
        let made = unsafe { numpy_integer(py, &kind, width, probe) }?;
        if made.get_type().is(&kind) && made.eq(kind.call1((probe,))?)? {
            cursor.width = Some(width);
        }
        Ok(cursor)
    }

    fn make<'py>(&self, py: Python<'py>, value: i64) -> PyResult<Bound<'py, PyAny>> {
        let kind = self.kind.bind(py);
        match self.width {
            // SAFETY: `of` made and checked one of this width.
            Some(width) => unsafe { numpy_integer(py, kind, width, value) },
            None => kind.call1((value,)),
        }
    }
}

/// A numpy integer scalar as NumPy makes one (`PyArray_Scalar`): the type's `tp_alloc`, then
/// the value after the object header (`PyInt32ScalarObject`'s `obval`), wrapping as NumPy does.
/// # Safety
/// `kind` must be a numpy signed integer scalar type whose value is `width` bytes.
unsafe fn numpy_integer<'py>(
    py: Python<'py>,
    kind: &Bound<'py, PyType>,
    width: usize,
    value: i64,
) -> PyResult<Bound<'py, PyAny>> {
    let tp = kind.as_type_ptr();
    // SAFETY: a live type object; `Py_tp_alloc` is always filled in for a ready type.
    let alloc: ffi::allocfunc =
        unsafe { std::mem::transmute(ffi::PyType_GetSlot(tp, ffi::Py_tp_alloc)) };
    // SAFETY: as `PyArray_Scalar` calls it.
    let object = unsafe { alloc(tp, 0) };
    if object.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: the value follows the header in a scalar of at least header + width bytes.
    unsafe {
        let at = object.cast::<u8>().add(std::mem::size_of::<ffi::PyObject>());
        match width {
            4 => at.cast::<i32>().write_unaligned(value as i32),
            _ => at.cast::<i64>().write_unaligned(value),
        }
        Ok(Bound::from_owned_ptr(py, object))
    }
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

    /// A 1-d sequence of integers (vLLM passes int32 numpy arrays): read from the buffer
    /// when it is a contiguous one of 32- or 64-bit integers, else through numpy.
    fn integers(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        if let Ok(buffer) = PyUntypedBuffer::get(value) {
            let format = buffer.format().to_bytes();
            let kind = format.strip_prefix(b"=").or(format.strip_prefix(b"<")).unwrap_or(format);
            let aligned = buffer.buf_ptr() as usize % buffer.item_size().max(1) == 0;
            if buffer.dimensions() == 1 && buffer.is_c_contiguous() && aligned {
                let len = buffer.shape()[0];
                let ptr = buffer.buf_ptr();
                match (kind, buffer.item_size()) {
                    (b"i" | b"l", 4) => {
                        // SAFETY: a contiguous buffer of `len` 4-byte integers, alive here.
                        let items = unsafe { std::slice::from_raw_parts(ptr.cast::<i32>(), len) };
                        return Ok(items.iter().map(|&v| i64::from(v)).collect());
                    }
                    (b"l" | b"q", 8) => {
                        // SAFETY: as above, 8-byte integers.
                        let items = unsafe { std::slice::from_raw_parts(ptr.cast::<i64>(), len) };
                        return Ok(items.to_vec());
                    }
                    _ => {}
                }
            }
        }
        let numpy = self.numpy.bind(py);
        let array = numpy.call_method1(
            intern!(py, "ascontiguousarray"),
            (value, numpy.getattr(intern!(py, "int64"))?),
        )?;
        let flat = array.call_method0(intern!(py, "ravel"))?;
        let buffer = PyUntypedBuffer::get(&flat)?;
        let len = buffer.len_bytes() / 8;
        let mut out = vec![0i64; len];
        // SAFETY: a C-contiguous int64 buffer of `len` items, alive while `buffer` is.
        unsafe {
            std::ptr::copy_nonoverlapping(buffer.buf_ptr().cast::<i64>(), out.as_mut_ptr(), len)
        };
        Ok(out)
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

/// `str` items of a list as borrowed text (the list keeps them alive).
fn texts<'a>(items: &'a [Bound<'_, PyAny>]) -> PyResult<Vec<&'a str>> {
    items.iter().map(|item| item.cast::<PyString>()?.to_str()).collect()
}

/// Block hashes as vLLM's `PackedBlockHashes` iterates them (`data` in `item_size` pieces),
/// borrowed from its bytes; or, for any other iterable, the items' own bytes.
fn hashes<'a, 'py>(value: &Bound<'py, PyAny>, held: &'a Held<'py>) -> PyResult<Vec<&'a [u8]>> {
    let py = value.py();
    if value.is_none() {
        return Ok(Vec::new());
    }
    if let (Ok(data), Ok(size)) =
        (value.getattr(intern!(py, "data")), value.getattr(intern!(py, "item_size")))
    {
        if let Ok(data) = data.cast_into::<PyBytes>() {
            let size: isize = size.extract()?;
            if size == 0 {
                return Err(PyValueError::new_err("range() arg 3 must not be zero"));
            }
            if size < 0 {
                return Ok(Vec::new());
            }
            let data = held.keep(data.into_any());
            let bytes = data.cast::<PyBytes>()?.as_bytes();
            return Ok(bytes.chunks(size as usize).collect());
        }
    }
    let mut out = Vec::new();
    for item in value.try_iter()? {
        let item = held.keep(item?);
        out.push(item.cast::<PyBytes>()?.as_bytes());
    }
    Ok(out)
}

use held::Held;

mod held {
    //! Python objects kept alive (and unmoved) while Rust borrows from them: append-only, so a
    //! borrow of an item lives as long as the `Held`.
    use pyo3::prelude::*;
    use std::cell::RefCell;

    /// Items of the first chunk; each next chunk holds twice the one before, up to `MAX_CHUNK`.
    const FIRST_CHUNK: usize = 64;
    const MAX_CHUNK: usize = 4096;

    pub(super) struct Held<'py> {
        // Chunks that never grow past their capacity: a borrow of an item survives later
        // pushes (a new chunk is started instead), and one allocation serves many items.
        chunks: RefCell<Vec<Vec<Bound<'py, PyAny>>>>,
    }

    impl<'py> Held<'py> {
        pub(super) fn new() -> Self {
            Self { chunks: RefCell::new(Vec::new()) }
        }

        pub(super) fn keep<'a>(&'a self, object: Bound<'py, PyAny>) -> &'a Bound<'py, PyAny> {
            let mut chunks = self.chunks.borrow_mut();
            let capacity = match chunks.last() {
                Some(chunk) if chunk.len() < chunk.capacity() => None,
                Some(chunk) => Some((2 * chunk.capacity()).min(MAX_CHUNK)),
                None => Some(FIRST_CHUNK),
            };
            if let Some(capacity) = capacity {
                chunks.push(Vec::with_capacity(capacity));
            }
            let chunk = chunks.last_mut().expect("a chunk with room");
            chunk.push(object);
            let at: *const Bound<'py, PyAny> = chunk.last().expect("just pushed");
            // SAFETY: a chunk is pushed to only below its capacity, so its items never move
            // (moving the outer vector moves no chunk's buffer), and no item is dropped or
            // moved out before the `Held`.
            unsafe { &*at }
        }
    }
}

fn text<'a>(value: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
    value.cast::<PyString>()?.to_str()
}

/// vLLM's metadata read into the plane's form, borrowing its strings and hashes.
fn metadata<'a, 'py>(
    value: &Bound<'py, PyAny>,
    held: &'a Held<'py>,
    kv_events: bool,
) -> PyResult<StepMetadata<'a>> {
    let py = value.py();
    let mut out = StepMetadata {
        generation: value.getattr(intern!(py, "generation"))?.extract()?,
        ..Default::default()
    };
    let requests =
        held.keep(value.getattr(intern!(py, "requests"))?.cast_into::<PyDict>()?.into_any());
    let requests = requests.cast::<PyDict>()?;
    out.requests.reserve(requests.len());
    for (id, emit_start) in requests.iter() {
        out.requests.push((text(held.keep(id))?, emit_start.extract()?));
    }
    let block_hashes = held.keep(value.getattr(intern!(py, "block_hashes"))?);
    for (id, packed) in block_hashes.cast::<PyDict>()?.iter() {
        let packed = held.keep(packed);
        out.block_hashes.push((text(held.keep(id))?, hashes(packed, held)?));
    }
    for id in value.getattr(intern!(py, "finished_requests"))?.try_iter()? {
        out.finished.push(text(held.keep(id?))?);
    }
    // The layout says whether the fields exist (0.33.0 on): a metadata without them on such
    // a release is an error, not a step without events.
    if kv_events {
        let retained = value.getattr(intern!(py, "retained_block_hashes"))?;
        out.retained = hashes(held.keep(retained), held)?;
        let released = value.getattr(intern!(py, "released_block_hashes"))?;
        out.released = hashes(held.keep(released), held)?;
    }
    Ok(out)
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

impl NativeDataPlane {
    /// vLLM's outputs dict, built with the GIL and without the plane's lock.
    fn outputs_dict<'py>(
        &self,
        py: Python<'py>,
        processed: Processed,
        rows: Option<&Bound<'py, PyAny>>,
        request_ids: &Bound<'py, PyAny>,
        token_starts: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let outputs = PyDict::new(py);
        let mut cursor = None;
        if processed.emitted.iter().any(|emitted| emitted.cursor_from_step) {
            // vLLM's cursor from a step is `token_start + len(rows)`, `token_start` an item of
            // `pending.token_starts`: its type is that sum's, under the installed NumPy.
            let kind = token_starts.get_item(0)?.add(1)?.get_type();
            // The lock is held only to copy or store (no Python runs under it: a thread that
            // waits for it holds the GIL).
            let known = self
                .cursor
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .map(|known| CursorType { kind: known.kind.clone_ref(py), width: known.width });
            cursor = match known {
                Some(known) if known.kind.bind(py).is(&kind) => Some(known),
                _ => {
                    let found = CursorType::of(py, self.numpy.bind(py), kind)?;
                    let copy = CursorType { kind: found.kind.clone_ref(py), width: found.width };
                    let old =
                        self.cursor.lock().unwrap_or_else(PoisonError::into_inner).replace(found);
                    drop(old);
                    Some(copy)
                }
            };
        }
        let output_class = self.output_class.bind(py);
        let new = py.get_type::<pyo3::types::PyAny>().getattr(intern!(py, "__new__"))?;
        let (token_start, rows_name) = (intern!(py, "token_start"), intern!(py, "rows"));
        let owned = if processed.owned.is_empty() {
            None
        } else {
            let numpy = self.numpy.bind(py);
            let data = PyByteArray::new(py, &processed.owned);
            let array =
                numpy.call_method1(intern!(py, "frombuffer"), (data, self.dtype.bind(py)))?;
            let mut shape = vec![-1isize];
            shape.extend(
                self.shape
                    .bind(py)
                    .iter()
                    .map(|d| d.extract::<isize>())
                    .collect::<PyResult<Vec<_>>>()?,
            );
            Some(array.call_method1(intern!(py, "reshape"), (PyTuple::new(py, shape)?,))?)
        };
        for emitted in processed.emitted {
            let (source, range) = match &emitted.rows {
                EmittedRows::Input(range) => (rows, range),
                EmittedRows::Owned(range) => (owned.as_ref(), range),
            };
            let source = source.expect("rows exist for every emitted range");
            let slice = PySlice::new(py, range.start as isize, range.end as isize, 1);
            let view = source.get_item(slice)?;
            if emitted.read_only {
                view.call_method1(intern!(py, "setflags"), (false,))?;
            }
            let start = match (&cursor, emitted.cursor_from_step) {
                (Some(cursor), true) => cursor.make(py, emitted.token_start)?,
                _ => emitted.token_start.into_pyobject(py)?.into_any(),
            };
            let output = if self.plain_output {
                let output = new.call1((output_class,))?;
                output.setattr(token_start, start)?;
                output.setattr(rows_name, view)?;
                output
            } else {
                output_class.call1((start, view))?
            };
            outputs.set_item(request_ids.get_item(emitted.position)?, output)?;
        }
        Ok(outputs)
    }
}

/// Whether `class` is a dataclass whose fields are exactly `token_start` and `rows`, with
/// nothing run at construction beyond setting them (no `__post_init__`, not frozen, no slots).
fn plain_dataclass(class: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = class.py();
    let Ok(params) = class.getattr(intern!(py, "__dataclass_params__")) else {
        return Ok(false);
    };
    let dataclasses = py.import(intern!(py, "dataclasses"))?;
    let names: Vec<String> = dataclasses
        .call_method1(intern!(py, "fields"), (class,))?
        .try_iter()?
        .map(|field| field?.getattr(intern!(py, "name"))?.extract())
        .collect::<PyResult<_>>()?;
    Ok(names == ["token_start", "rows"]
        && !params.getattr(intern!(py, "frozen"))?.extract::<bool>()?
        && !class.hasattr(intern!(py, "__post_init__"))?
        && !class.hasattr(intern!(py, "__slots__"))?)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeDataPlane>()
}
