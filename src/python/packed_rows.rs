//! The packed hop, engine core to frontend, for `aostore.vllm.transport.wire`: a step's
//! routed-experts rows as one trailing frame of the message, delivered into each request's
//! `RowPages` by one call per `process_outputs`, with no Python object per row.
//!
//! The frame's layout is specified once, in `python/aostore/vllm/transport/wire.py` (its
//! `PACKED_FORMAT`); a change here is a change of that format.
//!
//! The engine core (`pack_step_rows`) takes each output's rows out of the message (its
//! `routed_experts` set to None while vLLM's encoder runs, then put back) and writes them into
//! the frame. The frontend's decoder hands the frame and the decoded outputs to `rows_arrived`,
//! which keeps each output's rows until `deliver_rows`, called before vLLM's
//! `OutputProcessor.process_outputs` loop, writes them where vLLM's loop would have appended
//! them: the request's `RowChunks`.

// foldhash, not SipHash: the keys are addresses of our own objects, not anyone's input.
use foldhash::{HashMap, HashSet};
use std::sync::Arc;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView, PyType};
use pyo3::PyTraverseError;

use super::lock::GilBooks;
use super::row_pages::{bytes_of, ndarray, RowPages, OWNERS};
use super::step_rows::StepRowsSpan;
use super::{holds_objects, type_name};

/// The frame's first bytes: what tells it from any frame of vLLM's (an array's raw bytes).
pub(crate) const MAGIC: &[u8; 16] = b"\x93aostore-r3rows\x00";
/// The layout's version (`wire.PACKED_FORMAT`).
const FORMAT: u32 = 1;

/// A step's frame, shared by the outputs whose rows it holds.
struct Step {
    _frame: Py<PyAny>,
    buffer: PyUntypedBuffer,
    dtype: Py<PyAny>,
    shape: Vec<usize>,
    row: usize,
    data: usize,
}

/// One output's rows, waiting for `deliver_rows`.
struct Pending {
    _output: Py<PyAny>,
    step: Arc<Step>,
    rows: std::ops::Range<usize>,
}

/// Outputs decoded and not yet processed, by the address of their (alive) object.
static PENDING: GilBooks<HashMap<usize, Pending>> = GilBooks::new();
/// Outputs whose rows the current `process_outputs` call delivered (its `_trim_surplus_tokens`
/// asks), by address; emptied by `end_delivery` when the call returns.
static DELIVERED: GilBooks<HashSet<usize>> = GilBooks::new();

/// What `pack_step_rows` took out of the outputs: the frame, and the rows to put back.
#[pyclass(module = "aostore._native")]
pub(crate) struct PackedRows {
    frame: Py<PyBytes>,
    taken: Vec<(Py<PyAny>, Py<PyAny>)>,
}

#[pymethods]
impl PackedRows {
    /// The frame to send after vLLM's frames.
    #[getter]
    fn frame(&self, py: Python<'_>) -> Py<PyBytes> {
        self.frame.clone_ref(py)
    }

    /// Puts each output's rows back (once; later calls do nothing).
    fn restore(&mut self, py: Python<'_>) -> PyResult<()> {
        for (output, rows) in self.taken.drain(..) {
            output.bind(py).setattr(intern!(py, "routed_experts"), rows)?;
        }
        Ok(())
    }

    // The outputs may hold this object (a caller may keep it on one).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.frame)?;
        for (output, rows) in &self.taken {
            visit.call(output)?;
            visit.call(rows)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.taken.clear();
    }
}

/// Whether `rows` is a plain `ndarray` over a step buffer (its base, or its base's base, is of
/// `step_array`): routed experts from aostore's worker, nothing else.
fn is_step_rows(
    rows: &Bound<'_, PyAny>,
    ndarray: &Bound<'_, PyType>,
    step_array: &Bound<'_, PyType>,
) -> PyResult<bool> {
    if !rows.get_type().is(ndarray) {
        return Ok(false);
    }
    let py = rows.py();
    let base = rows.getattr(intern!(py, "base"))?;
    if base.get_type().is(step_array) {
        return Ok(true);
    }
    Ok(base.get_type().is(ndarray) && base.getattr(intern!(py, "base"))?.get_type().is(step_array))
}

/// Where one taken output's rows are: bytes `range` of `sources[source]`.
struct Taken<'py> {
    position: usize,
    output: Bound<'py, PyAny>,
    rows: Bound<'py, PyAny>,
    source: usize,
    range: std::ops::Range<usize>,
}

/// `pack_step_rows(outputs, step_array, version)`: the rows of step buffers in `outputs` (vLLM's
/// `EngineCoreOutput`s; views of a step buffer, or `StepRowsSpan`s) as one frame, each taken
/// output's `routed_experts` set to None; None when no output has such rows. Rows of another
/// dtype or row shape than the first's stay in their output as arrays (vLLM's wire carries them).
#[pyfunction]
fn pack_step_rows(
    outputs: &Bound<'_, PyList>,
    step_array: &Bound<'_, PyType>,
    version: &str,
) -> PyResult<Option<PackedRows>> {
    let py = outputs.py();
    let ndarray = ndarray(py)?;
    let name = intern!(py, "routed_experts");
    // Each distinct buffer read: a span's step buffer (one a step, exported once) or a view.
    let mut sources: Vec<(usize, PyUntypedBuffer)> = Vec::new();
    let mut taken: Vec<Taken<'_>> = Vec::new();
    let mut first: Option<(Bound<'_, PyAny>, Vec<usize>, usize)> = None;
    for (position, output) in outputs.iter().enumerate() {
        let rows = output.getattr(name)?;
        if rows.is_none() {
            continue;
        }
        let (holder, rows_range) = match rows.cast::<StepRowsSpan>() {
            Ok(span) => {
                let span = span.get();
                (span.rows.bind(py).clone(), Some(span.begin..span.end))
            }
            Err(_) if is_step_rows(&rows, ndarray, step_array)? => (rows.clone(), None),
            Err(_) => continue,
        };
        let source = match sources.iter().position(|(at, _)| *at == holder.as_ptr() as usize) {
            Some(source) => source,
            None => {
                let Ok(buffer) = PyUntypedBuffer::get(&holder) else {
                    unspan(&output, &rows)?;
                    continue;
                };
                if !buffer.is_c_contiguous() || holds_objects(&buffer) || buffer.shape().is_empty()
                {
                    unspan(&output, &rows)?;
                    continue;
                }
                sources.push((holder.as_ptr() as usize, buffer));
                sources.len() - 1
            }
        };
        let buffer = &sources[source].1;
        let shape = &buffer.shape()[1..];
        let row = buffer.item_size() * shape.iter().product::<usize>();
        match &first {
            None => first = Some((holder.getattr(intern!(py, "dtype"))?, shape.to_vec(), row)),
            Some((held, held_shape, _)) => {
                if !held.is(&holder.getattr(intern!(py, "dtype"))?) || shape != &held_shape[..] {
                    unspan(&output, &rows)?;
                    continue;
                }
            }
        }
        let range = match rows_range {
            Some(rows) => rows.start * row..rows.end * row,
            None => 0..buffer.len_bytes(),
        };
        if range.end > buffer.len_bytes() {
            return Err(PyValueError::new_err("a StepRowsSpan past its step buffer's end"));
        }
        taken.push(Taken { position, output, rows, source, range });
    }
    let Some((dtype, shape, row)) = first else { return Ok(None) };
    let dtype_str: String = dtype.getattr(intern!(py, "str"))?.extract()?;
    let mut head = Vec::with_capacity(64 + 16 * taken.len());
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&FORMAT.to_le_bytes());
    for text in [version.as_bytes(), dtype_str.as_bytes()] {
        head.extend_from_slice(&(text.len() as u16).to_le_bytes());
        head.extend_from_slice(text);
    }
    head.push(shape.len() as u8);
    for &dim in &shape {
        head.extend_from_slice(&(dim as u64).to_le_bytes());
    }
    head.extend_from_slice(&(taken.len() as u64).to_le_bytes());
    let mut end = 0u64;
    for taken in &taken {
        end += (taken.range.len() / row.max(1)) as u64;
        head.extend_from_slice(&(taken.position as u64).to_le_bytes());
        head.extend_from_slice(&end.to_le_bytes());
    }
    let data: usize = taken.iter().map(|taken| taken.range.len()).sum();
    let frame = PyBytes::new_with(py, head.len() + data, |out| {
        out[..head.len()].copy_from_slice(&head);
        let mut at = head.len();
        for taken in &taken {
            let bytes = &bytes_of(&sources[taken.source].1)[taken.range.clone()];
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        }
        Ok(())
    })?;
    let mut put_back = Vec::with_capacity(taken.len());
    for Taken { output, rows, .. } in taken {
        output.setattr(name, py.None())?;
        put_back.push((output.unbind(), rows.unbind()));
    }
    Ok(Some(PackedRows { frame: frame.unbind(), taken: put_back }))
}

/// Gives `output` its rows as the view `take_output` makes where nothing packs, if they are a
/// `StepRowsSpan` (vLLM's encoder knows arrays, not spans).
fn unspan(output: &Bound<'_, PyAny>, rows: &Bound<'_, PyAny>) -> PyResult<()> {
    if let Ok(span) = rows.cast::<StepRowsSpan>() {
        output.setattr(intern!(output.py(), "routed_experts"), span.get().array(output.py())?)?;
    }
    Ok(())
}

/// `unspan_outputs(outputs)`: every `StepRowsSpan` among the outputs' rows made the view, for a
/// message that vLLM's encoder sends without packing (a path other than the output thread's).
#[pyfunction]
fn unspan_outputs(outputs: &Bound<'_, PyList>) -> PyResult<()> {
    let name = intern!(outputs.py(), "routed_experts");
    for output in outputs.iter() {
        unspan(&output, &output.getattr(name)?)?;
    }
    Ok(())
}

/// A frame's bytes: its own buffer, or a `memoryview`'s of it (pyzmq's `Frame` exports only
/// simple requests, which a memoryview makes for it).
fn frame_buffer(frame: &Bound<'_, PyAny>) -> PyResult<PyUntypedBuffer> {
    let buffer = match PyUntypedBuffer::get(frame) {
        Ok(buffer) => buffer,
        Err(_) => PyUntypedBuffer::get(PyMemoryView::from(frame)?.as_any())?,
    };
    if !buffer.is_c_contiguous() {
        return Err(PyValueError::new_err("a packed frame is C-contiguous"));
    }
    Ok(buffer)
}

/// Whether `frame` (any buffer) is a packed step's frame.
#[pyfunction]
fn is_packed_rows(frame: &Bound<'_, PyAny>) -> bool {
    frame_buffer(frame).is_ok_and(|buffer| bytes_of(&buffer).starts_with(MAGIC))
}

/// Reads the frame's header: (format's fields, where the data starts, the index).
struct Header {
    version: String,
    dtype: String,
    shape: Vec<usize>,
    index: Vec<(usize, usize)>,
    data: usize,
}

fn read_header(bytes: &[u8]) -> Result<Header, String> {
    let mut at = MAGIC.len();
    let mut take = |n: usize| -> Result<&[u8], String> {
        let part = bytes.get(at..at + n).ok_or("the frame ends inside its header")?;
        at += n;
        Ok(part)
    };
    let format = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
    if format != FORMAT {
        return Err(format!("format {format}"));
    }
    let mut text = || -> Result<String, String> {
        let n = u16::from_le_bytes(take(2)?.try_into().expect("2 bytes")) as usize;
        String::from_utf8(take(n)?.to_vec()).map_err(|_| "a header field is not UTF-8".to_owned())
    };
    let version = text()?;
    let dtype = text()?;
    let ndim = take(1)?[0] as usize;
    let mut word = || -> Result<usize, String> {
        Ok(u64::from_le_bytes(take(8)?.try_into().expect("8 bytes")) as usize)
    };
    let shape = (0..ndim).map(|_| word()).collect::<Result<Vec<_>, _>>()?;
    let count = word()?;
    if count > bytes.len() / 16 {
        return Err(format!("an index of {count} outputs in {} bytes", bytes.len()));
    }
    let index = (0..count).map(|_| Ok((word()?, word()?))).collect::<Result<Vec<_>, String>>()?;
    Ok(Header { version, dtype, shape, index, data: at })
}

/// `rows_arrived(outputs, frame, version)`: keeps each output's rows from a packed step's
/// frame until `deliver_rows`; returns how many outputs have rows. `RuntimeError` for a frame
/// of another format or aostore version (both ends must run the same aostore), `ValueError`
/// for one that does not fit `outputs`: nothing is kept then.
#[pyfunction]
fn rows_arrived(
    outputs: &Bound<'_, PyList>,
    frame: &Bound<'_, PyAny>,
    version: &str,
) -> PyResult<usize> {
    let py = outputs.py();
    let buffer = frame_buffer(frame).map_err(|_| {
        PyValueError::new_err(format!("a packed frame is a buffer, not {}", type_name(frame)))
    })?;
    let bytes = bytes_of(&buffer);
    let header = read_header(bytes).map_err(|why| {
        if why.starts_with("format") {
            PyRuntimeError::new_err(format!(
                "aostore transport: this frontend reads packed step rows of format {FORMAT}, got {why}: \
                 the engine core and the frontend must run the same aostore \
                 (AOSTORE_VLLM_TRANSPORT=0 on both uses vLLM's own transport)"
            ))
        } else {
            PyValueError::new_err(format!("aostore transport: a corrupt packed frame ({why})"))
        }
    })?;
    if header.version != version {
        return Err(PyRuntimeError::new_err(format!(
            "aostore transport: this frontend runs aostore {version}, the engine core packed its \
             rows with aostore {}: both must run the same aostore \
             (AOSTORE_VLLM_TRANSPORT=0 on both uses vLLM's own transport)",
            header.version
        )));
    }
    let dtype =
        py.import(intern!(py, "numpy"))?.call_method1(intern!(py, "dtype"), (&header.dtype,))?;
    let itemsize: usize = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
    let row = itemsize * header.shape.iter().product::<usize>();
    let corrupt = |why: String| {
        PyValueError::new_err(format!("aostore transport: a corrupt packed frame ({why})"))
    };
    let (mut last_position, mut last_end) = (None, 0usize);
    for &(position, end) in &header.index {
        if position >= outputs.len()
            || last_position.is_some_and(|last| position <= last)
            || end < last_end
        {
            return Err(corrupt(format!("output {position} of {}, rows to {end}", outputs.len())));
        }
        last_position = Some(position);
        last_end = end;
    }
    if row == 0 || header.data + last_end * row != bytes.len() {
        return Err(corrupt(format!(
            "{} bytes of rows for {last_end} rows of {row} bytes",
            bytes.len() - header.data
        )));
    }
    let step = Arc::new(Step {
        _frame: frame.clone().unbind(),
        buffer,
        dtype: dtype.unbind(),
        shape: header.shape,
        row,
        data: header.data,
    });
    let mut arrived = Vec::with_capacity(header.index.len());
    let mut start = 0;
    for &(position, end) in &header.index {
        let output = outputs.get_item(position)?;
        arrived.push((output.as_ptr() as usize, output.unbind(), start..end));
        start = end;
    }
    let mut replaced = Vec::new(); // dropped once the books are let go
    {
        let mut pending = PENDING.lock(py);
        for (key, output, rows) in arrived {
            let step = Arc::clone(&step);
            replaced.extend(pending.insert(key, Pending { _output: output, step, rows }));
        }
    }
    drop(replaced);
    Ok(header.index.len())
}

/// `deliver_rows(outputs, request_states, row_chunks)`: before vLLM's `process_outputs` loop
/// over `outputs`, appends each output's packed rows where that loop would have (the request's
/// `routed_experts_chunks`; a `row_chunks` in pages natively, anything else an array over a
/// copy of the rows); an output of a request no longer in `request_states` is dropped, as
/// vLLM ignores it. Returns how many outputs' rows were appended.
#[pyfunction]
fn deliver_rows(
    outputs: &Bound<'_, PyAny>,
    request_states: &Bound<'_, PyDict>,
    row_chunks: &Bound<'_, PyType>,
) -> PyResult<usize> {
    let py = outputs.py();
    let mut arrived = Vec::new();
    {
        let mut pending = PENDING.lock(py);
        if pending.is_empty() {
            return Ok(0);
        }
        for output in outputs.try_iter()? {
            let output = output?;
            if let Some(rows) = pending.remove(&(output.as_ptr() as usize)) {
                arrived.push((output, rows));
            }
        }
    }
    // First every output's request state, by address, without touching the state: a state
    // whose pages are bound to it (`RowPages.bind`) is written without reading it or its
    // chunks, and the pages of the whole batch are fetched together (one wait for memory per
    // batch, not three per output in a frontend whose heap holds every running request's rows).
    let mut states = Vec::with_capacity(arrived.len());
    for (output, _) in &arrived {
        let request_id = output.getattr(intern!(py, "request_id"))?;
        // SAFETY: a dict and a key, both alive; a borrowed reference or null.
        let state =
            unsafe { ffi::PyDict_GetItemWithError(request_states.as_ptr(), request_id.as_ptr()) };
        if state.is_null() {
            if let Some(error) = PyErr::take(py) {
                return Err(error);
            }
            states.push(None); // a late output: vLLM ignores it
            continue;
        }
        // vLLM 0.33's loop skips a rejected request's output before it appends rows: such an
        // output (rare) goes the way that reads the state.
        let rejected = match output.getattr(intern!(py, "error")) {
            Ok(error) => !error.is_none(),
            Err(_) => false,
        };
        states.push(Some((state as usize, rejected)));
    }
    let bound: Vec<Option<usize>> = {
        let owners = OWNERS.lock(py);
        states
            .iter()
            .map(|state| match state {
                Some((state, false)) => owners.get(state).copied(),
                _ => None,
            })
            .collect()
    };
    let mut targets = Vec::with_capacity(arrived.len());
    for (state, pages) in states.iter().zip(&bound) {
        targets.push(match (state, pages) {
            (None, _) => Target::Gone,
            // SAFETY: a bound `RowPages` is alive (its drop ends the binding); the reference
            // taken keeps it so while this call runs Python.
            (_, Some(pages)) => Target::Pages(unsafe {
                let pages = Bound::from_borrowed_ptr(py, *pages as *mut ffi::PyObject);
                prefetch_object(pages.as_ptr().cast());
                pages.cast_into_unchecked::<RowPages>()
            }),
            (Some((state, _)), None) => {
                // SAFETY: the state is alive: `request_states` holds it and no Python ran since.
                let state = unsafe { Bound::from_borrowed_ptr(py, *state as *mut ffi::PyObject) };
                Target::State(state)
            }
        });
    }
    let mut delivered = Vec::with_capacity(arrived.len());
    for ((output, rows), target) in arrived.into_iter().zip(targets) {
        let step = &rows.step;
        let bytes = &bytes_of(&step.buffer)
            [step.data + rows.rows.start * step.row..step.data + rows.rows.end * step.row];
        let dtype = step.dtype.bind(py);
        match target {
            Target::Gone => continue,
            Target::Pages(pages) => {
                if !pages.borrow_mut().push_step_rows(dtype, &step.shape, step.row, bytes)? {
                    append_array(
                        py,
                        &pages_owner_chunks(&pages)?,
                        bytes,
                        &rows,
                        dtype,
                        &step.shape,
                    )?;
                }
            }
            Target::State(state) => {
                if !deliver_to_state(&output, &state, row_chunks, bytes, &rows, dtype, &step.shape)?
                {
                    continue;
                }
            }
        }
        delivered.push(output.as_ptr() as usize);
    }
    let count = delivered.len();
    DELIVERED.lock(py).extend(delivered);
    Ok(count)
}

/// Where `deliver_rows` writes an output's rows.
enum Target<'py> {
    /// Nowhere: the request is no longer in `request_states` (vLLM ignores the output).
    Gone,
    /// The pages bound to the output's request state.
    Pages(Bound<'py, RowPages>),
    /// A state with no bound pages, read as vLLM's loop reads it.
    State(Bound<'py, PyAny>),
}

/// What `deliver_rows` does for a state whose pages are not bound to it (vLLM's own list, a
/// `RowChunks` turned into a list, a rejected request's output): reads the state as vLLM's
/// loop would. False when vLLM's loop would skip the output.
fn deliver_to_state(
    output: &Bound<'_, PyAny>,
    state: &Bound<'_, PyAny>,
    row_chunks: &Bound<'_, PyType>,
    bytes: &[u8],
    rows: &Pending,
    dtype: &Bound<'_, PyAny>,
    shape: &[usize],
) -> PyResult<bool> {
    let py = output.py();
    if let Ok(error) = output.getattr(intern!(py, "error")) {
        if !error.is_none() && !state.getattr(intern!(py, "queue"))?.is_none() {
            return Ok(false);
        }
    }
    let chunks = state.getattr(intern!(py, "routed_experts_chunks"))?;
    if chunks.get_type().is(row_chunks) {
        if let Ok(pages) = chunks.getattr(intern!(py, "_pages"))?.cast::<RowPages>() {
            if pages.borrow_mut().push_step_rows(dtype, shape, rows.step.row, bytes)? {
                return Ok(true);
            }
        }
    }
    append_array(py, &chunks, bytes, rows, dtype, shape)?;
    Ok(true)
}

/// The chunks of the state bound pages belong to (rows the pages cannot hold: another dtype
/// or shape than theirs).
fn pages_owner_chunks<'py>(pages: &Bound<'py, RowPages>) -> PyResult<Bound<'py, PyAny>> {
    let py = pages.py();
    let owner = pages.borrow().owner_address();
    // SAFETY: a bound owner is alive while `request_states` holds it, which `deliver_rows`
    // found it in.
    let state = unsafe { Bound::from_borrowed_ptr(py, owner as *mut ffi::PyObject) };
    state.getattr(intern!(py, "routed_experts_chunks"))
}

/// Appends to `chunks` what vLLM's decoder gives for an inline array of a read-only message.
fn append_array(
    py: Python<'_>,
    chunks: &Bound<'_, PyAny>,
    bytes: &[u8],
    rows: &Pending,
    dtype: &Bound<'_, PyAny>,
    row_shape: &[usize],
) -> PyResult<()> {
    let numpy = py.import(intern!(py, "numpy"))?;
    let mut shape = vec![rows.rows.len()];
    shape.extend_from_slice(row_shape);
    let array = numpy
        .call_method1(intern!(py, "frombuffer"), (PyBytes::new(py, bytes), dtype))?
        .call_method1(intern!(py, "reshape"), (shape,))?;
    chunks.call_method1(intern!(py, "append"), (array,))?;
    Ok(())
}

/// Asks for an object's first cache lines (a `RowPages`: its header and the fields a write
/// reads) ahead of their use; a hint only.
#[inline]
fn prefetch_object(object: *const u8) {
    #[cfg(target_arch = "x86_64")]
    for line in 0..4 {
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                object.wrapping_add(64 * line).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = object;
}

/// Whether the current `process_outputs` call delivered `output`'s rows from a packed frame.
#[pyfunction]
fn rows_delivered(output: &Bound<'_, PyAny>) -> bool {
    DELIVERED.lock(output.py()).contains(&(output.as_ptr() as usize))
}

/// Ends a `process_outputs` call: `rows_delivered` answers no for its outputs.
#[pyfunction]
fn end_delivery(py: Python<'_>) {
    DELIVERED.lock(py).clear();
}

/// Outputs whose packed rows wait for `deliver_rows`.
#[pyfunction]
fn pending_step_rows(py: Python<'_>) -> usize {
    PENDING.lock(py).len()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PackedRows>()?;
    m.add_function(wrap_pyfunction!(pack_step_rows, m)?)?;
    m.add_function(wrap_pyfunction!(unspan_outputs, m)?)?;
    m.add_function(wrap_pyfunction!(is_packed_rows, m)?)?;
    m.add_function(wrap_pyfunction!(rows_arrived, m)?)?;
    m.add_function(wrap_pyfunction!(deliver_rows, m)?)?;
    m.add_function(wrap_pyfunction!(rows_delivered, m)?)?;
    m.add_function(wrap_pyfunction!(end_delivery, m)?)?;
    m.add_function(wrap_pyfunction!(pending_step_rows, m)?)
}
