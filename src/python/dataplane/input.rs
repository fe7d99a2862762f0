//! vLLM's arguments read into the plane's form: integers, strings and block hashes borrowed
//! from the Python objects that hold them.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use super::NativeDataPlane;
use crate::dataplane::StepMetadata;

impl NativeDataPlane {
    /// A 1-d sequence of integers (vLLM passes int32 numpy arrays): read from the buffer
    /// when it is a contiguous one of 32- or 64-bit integers, else through numpy.
    pub(super) fn integers(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
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

/// `str` items of a list as borrowed text (the list keeps them alive).
pub(super) fn texts<'a>(items: &'a [Bound<'_, PyAny>]) -> PyResult<Vec<&'a str>> {
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

pub(super) use held::Held;

mod held {
    //! Python objects kept alive (and unmoved) while Rust borrows from them: append-only, so a
    //! borrow of an item lives as long as the `Held`.
    use pyo3::prelude::*;
    use std::cell::RefCell;

    /// Items of the first chunk; each next chunk holds twice the one before, up to `MAX_CHUNK`.
    const FIRST_CHUNK: usize = 64;
    const MAX_CHUNK: usize = 4096;

    pub(crate) struct Held<'py> {
        // Chunks that never grow past their capacity: a borrow of an item survives later
        // pushes (a new chunk is started instead), and one allocation serves many items.
        chunks: RefCell<Vec<Vec<Bound<'py, PyAny>>>>,
    }

    impl<'py> Held<'py> {
        pub(crate) fn new() -> Self {
            Self { chunks: RefCell::new(Vec::new()) }
        }

        pub(crate) fn keep<'a>(&'a self, object: Bound<'py, PyAny>) -> &'a Bound<'py, PyAny> {
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
pub(super) fn metadata<'a, 'py>(
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
