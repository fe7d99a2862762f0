//! `RowPages`: one request's routed-experts rows in the frontend, held in pages that never move
//! (`aostore.vllm.transport.frontend.RowChunks` keeps vLLM's list semantics over it).
//!
//! Rows arrive a chunk at a time, one chunk a step: from vLLM's loop (`append`, a chunk that is
//! an `ndarray`) or, with the packed hop, straight from a step's message (`packed_rows.rs`,
//! no Python object per row). The pages are `bytearray`s, so the finish's views and
//! `copy_pages` read them as they are; a page is never resized, so a view of it stays valid
//! while later rows are written past its end.

use foldhash::HashMap;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyTuple};
use pyo3::PyTraverseError;

use super::holds_objects;
use super::lock::GilBooks;

/// The largest page: a request's rows live in pages of at most this many bytes (whole rows), so
/// at most one page per request is part full.
const PAGE: usize = 64 * 1024;
/// Dimensions of a row's shape kept inline (routed experts: 2, layers and top-k).
const INLINE_SHAPE: usize = 4;
/// The first page; each next one is as large as all before it, up to `PAGE`.
const FIRST_PAGE: usize = 4 * 1024;

/// The pages bound to an owner (`bind`), by the owner's address: the `RowPages` object's
/// address. The frontend's `RequestState` binds its pages when it makes them, so the packed
/// hop finds a request's pages from the state's address (which `request_states` gives without
/// touching the state) instead of through three Python objects scattered in a large heap,
/// each a cache miss per output per step. An entry lives exactly as long as both: the pages'
/// `Drop` (or `unbind`) removes it; a new binding of the same owner replaces it.
pub(super) static OWNERS: GilBooks<HashMap<usize, usize>> = GilBooks::new();

/// One request's rows: pages, each chunk's end, and the rows' dtype and shape once the first
/// chunk set them.
#[pyclass(module = "aostore._native")]
pub(crate) struct RowPages {
    pages: Vec<Py<PyByteArray>>,
    /// Each page's first byte, over all pages.
    starts: Vec<usize>,
    /// Each chunk's end, in bytes.
    ends: Vec<usize>,
    /// Bytes held.
    size: usize,
    /// The last page's end, over all pages.
    room_end: usize,
    /// The last page, exported for as long as it is the last: rows are written through this
    /// address without touching the `bytearray` object (a cache line per output in the
    /// frontend's loop), and the export keeps Python from resizing the page under it.
    tail: Option<Tail>,
    dtype: Option<Py<PyAny>>,
    /// One row's shape (the chunk's shape after its first dimension).
    shape: Vec<usize>,
    /// The same, beside the fields each write reads, when it has at most `INLINE_SHAPE`
    /// dimensions (`shape`'s own block is elsewhere on the heap: a cache miss per output).
    inline_shape: [usize; INLINE_SHAPE],
    /// One row's bytes.
    row: usize,
    /// The last page's first byte, over all pages (`starts`' last, kept beside the fields each
    /// write reads: `starts` lives elsewhere on the heap).
    tail_start: usize,
    /// The address of the owner it is bound to (0: none) and its own object's address.
    owner: usize,
    this: usize,
}

/// An export of a page and its first byte's address.
struct Tail {
    export: PyUntypedBuffer,
    data: *mut u8,
}

// SAFETY: the address is the export's, which pyo3 lets cross threads; it is written only under
// the GIL, through `&mut RowPages`.
unsafe impl Send for Tail {}
// SAFETY: as for `Send`: a shared `Tail` is only read (its address), never written through.
unsafe impl Sync for Tail {}

impl Tail {
    fn of(page: &Bound<'_, PyByteArray>) -> PyResult<Self> {
        let export = PyUntypedBuffer::get(page)?;
        let data = export.buf_ptr().cast::<u8>();
        Ok(Self { export, data })
    }
}

impl RowPages {
    /// Whether `dtype` is the rows' (the same object, or equal to it).
    fn same_dtype(&self, dtype: &Bound<'_, PyAny>) -> PyResult<bool> {
        match &self.dtype {
            Some(held) if held.is(dtype) => Ok(true),
            Some(held) => held.bind(dtype.py()).eq(dtype),
            None => Ok(false),
        }
    }

    fn set_shape(&mut self, shape: Vec<usize>) {
        self.inline_shape = [0; INLINE_SHAPE];
        if shape.len() <= INLINE_SHAPE {
            self.inline_shape[..shape.len()].copy_from_slice(&shape);
        }
        self.shape = shape;
    }

    /// Whether `shape` is one row's, read inline where it fits (`shape`'s length lives in the
    /// `Vec` header, beside the fields).
    fn same_shape(&self, shape: &[usize]) -> bool {
        if shape.len() != self.shape.len() {
            return false;
        }
        if shape.len() <= INLINE_SHAPE {
            return shape == &self.inline_shape[..shape.len()];
        }
        shape == self.shape.as_slice()
    }

    /// Appends `rows` (whole rows of the held dtype and shape) as one chunk.
    pub(crate) fn push_bytes(&mut self, py: Python<'_>, rows: &[u8]) -> PyResult<()> {
        self.write(py, rows)?;
        self.ends.push(self.size);
        Ok(())
    }

    /// Appends a chunk of `dtype` and row `shape` from a step's message: false (nothing
    /// written) when the rows' dtype or shape differ, so the caller hands vLLM's list an array.
    pub(crate) fn push_step_rows(
        &mut self,
        dtype: &Bound<'_, PyAny>,
        shape: &[usize],
        row: usize,
        rows: &[u8],
    ) -> PyResult<bool> {
        if self.dtype.is_none() {
            if row == 0 || self.size != 0 {
                return Ok(false);
            }
            self.dtype = Some(dtype.clone().unbind());
            self.set_shape(shape.to_vec());
            self.row = row;
        } else if row != self.row || !self.same_dtype(dtype)? || !self.same_shape(shape) {
            return Ok(false);
        }
        self.push_bytes(dtype.py(), rows)?;
        Ok(true)
    }

    fn write(&mut self, py: Python<'_>, mut data: &[u8]) -> PyResult<()> {
        while !data.is_empty() {
            if self.size >= self.room_end {
                self.open_page(py, data.len())?;
            }
            let tail = self.tail.as_ref().expect("a page");
            let at = self.size - self.tail_start;
            let take = (self.room_end - self.size).min(data.len());
            debug_assert!(at + take <= tail.export.len_bytes());
            // SAFETY: the GIL is held and the page is exported (Python cannot resize it), so
            // `at + take` bytes from `data` stay inside it; these bytes are past every chunk
            // written, which no reader has been given.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), tail.data.add(at), take) };
            data = &data[take..];
            self.size += take;
        }
        Ok(())
    }

    /// A new last page, with room for at least a row.
    fn open_page(&mut self, py: Python<'_>, wanted: usize) -> PyResult<()> {
        let row = self.row.max(1);
        // A large chunk gets a page of its own size.
        let size = PAGE.min(FIRST_PAGE.max(self.size)).max(wanted);
        let page = unwritten_bytearray(py, row.max(size / row * row))?;
        self.tail = Some(Tail::of(&page)?);
        self.room_end = self.size + page.len();
        self.starts.push(self.size);
        self.tail_start = self.size;
        self.pages.push(page.unbind());
        Ok(())
    }

    fn truncate(&mut self, py: Python<'_>, size: usize) {
        while let Some(&start) = self.starts.last() {
            if start >= size && start > 0 {
                self.starts.pop();
                self.pages.pop();
            } else {
                break;
            }
        }
        self.room_end = match (self.starts.last(), self.pages.last()) {
            (Some(&start), Some(page)) => start + page.bind(py).len(),
            _ => 0,
        };
        self.tail_start = self.starts.last().copied().unwrap_or(0);
        // The last page's export is held, or no page is: a page with an export cannot have
        // been resized, so it is exported again as it is.
        self.tail = self.pages.last().and_then(|page| Tail::of(page.bind(py)).ok());
        if self.tail.is_none() {
            self.room_end = size;
        }
        self.size = size;
    }

    /// The bytes of a C-contiguous chunk of the rows' dtype and shape, or None.
    fn chunk_buffer(&self, chunk: &Bound<'_, PyAny>) -> PyResult<Option<PyUntypedBuffer>> {
        let py = chunk.py();
        if self.dtype.is_none() || !chunk.get_type().is(ndarray(py)?) {
            return Ok(None);
        }
        if !self.same_dtype(&chunk.getattr(intern!(py, "dtype"))?)? {
            return Ok(None);
        }
        let Ok(buffer) = PyUntypedBuffer::get(chunk) else {
            return Ok(None); // a dtype numpy exports no buffer for
        };
        let shape = buffer.shape();
        let fits = buffer.is_c_contiguous()
            && !holds_objects(&buffer)
            && shape.len() == self.shape.len() + 1
            && shape[1..] == self.shape[..];
        Ok(fits.then_some(buffer))
    }
}

/// A `bytearray` of `len` bytes left as the allocator gives them: every byte is written (a
/// row) before any is read, and zeroing first would write a fresh page twice.
fn uninitialized_bytearray(py: Python<'_>, len: usize) -> PyResult<Bound<'_, PyByteArray>> {
    let len = pyo3::ffi::Py_ssize_t::try_from(len)
        .map_err(|_| PyValueError::new_err("a page too large"))?;
    // SAFETY: a null source asks CPython for `len` bytes it leaves unwritten; the result is a
    // new reference or null with an exception set.
    unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            pyo3::ffi::PyByteArray_FromStringAndSize(std::ptr::null(), len),
        )
        .map(|page| page.cast_into_unchecked::<PyByteArray>())
    }
}

/// `unwritten_bytearray(size)`: a `bytearray` of `size` bytes, left unwritten (not zeroed), its
/// memory committed in one call (`MADV_POPULATE_WRITE`, where the kernel has it) rather than a
/// fault per page as the rows are copied in. For buffers written whole before they are read:
/// a finish's rows, a request's pages. Not numpy's `empty`: numpy asks for huge pages for
/// arrays of 4 MiB and more, and with the kernel's `defrag=madvise` a frontend whose heap holds
/// every running request's rows stalls in compaction for them (64 16k samples finishing
/// together: 14.6 ms a finish against 2-3).
#[pyfunction]
pub(super) fn unwritten_bytearray(py: Python<'_>, size: usize) -> PyResult<Bound<'_, PyByteArray>> {
    let page = uninitialized_bytearray(py, size)?;
    // SAFETY: a bytearray just made, `size` bytes long; committing its pages changes no byte.
    let start = unsafe { pyo3::ffi::PyByteArray_AsString(page.as_ptr()) }.cast::<u8>();
    crate::arena::commit_pages(start, size);
    Ok(page)
}

/// numpy's `ndarray` type, looked up once (here and by the packed hop).
pub(super) fn ndarray(py: Python<'_>) -> PyResult<&Bound<'_, pyo3::types::PyType>> {
    static NDARRAY: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();
    NDARRAY.import(py, "numpy", "ndarray")
}

pub(super) fn bytes_of(buffer: &PyUntypedBuffer) -> &[u8] {
    // SAFETY: a C-contiguous export of `len_bytes` bytes, held while the slice is used.
    unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes()) }
}

#[pymethods]
impl RowPages {
    #[new]
    fn new() -> Self {
        Self {
            pages: Vec::new(),
            starts: Vec::new(),
            ends: Vec::new(),
            size: 0,
            room_end: 0,
            tail: None,
            dtype: None,
            shape: Vec::new(),
            inline_shape: [0; INLINE_SHAPE],
            row: 0,
            tail_start: 0,
            owner: 0,
            this: 0,
        }
    }

    /// Binds the pages to `owner` (the `RequestState` whose `routed_experts_chunks` they hold):
    /// the packed hop then writes a step's rows for that state here directly. Replaces any
    /// binding of either.
    fn bind(slf: &Bound<'_, Self>, owner: &Bound<'_, PyAny>) {
        let mut pages = slf.borrow_mut();
        pages.unbind(slf.py());
        let (owner, this) = (owner.as_ptr() as usize, slf.as_ptr() as usize);
        pages.owner = owner;
        pages.this = this;
        OWNERS.lock(slf.py()).insert(owner, this);
    }

    /// Ends the binding, if any (the owner's chunks are no longer these pages).
    fn unbind(&mut self, py: Python<'_>) {
        if self.owner != 0 {
            let mut owners = OWNERS.lock(py);
            if owners.get(&self.owner) == Some(&self.this) {
                owners.remove(&self.owner);
            }
            self.owner = 0;
        }
    }

    /// Whether the pages are bound to an owner.
    #[getter]
    fn bound(&self) -> bool {
        self.owner != 0
    }

    /// Sets the rows' dtype and one row's shape and bytes (the first chunk's); once only.
    fn begin(&mut self, dtype: Bound<'_, PyAny>, shape: Vec<usize>, row: usize) -> PyResult<()> {
        if self.dtype.is_some() || row == 0 {
            return Err(PyValueError::new_err("the rows' dtype is set once, to rows of bytes"));
        }
        self.dtype = Some(dtype.unbind());
        self.set_shape(shape);
        self.row = row;
        Ok(())
    }

    /// Appends `chunk` when it is an `ndarray` (not a subclass) of the rows' dtype and shape,
    /// C-contiguous: true; else false and nothing written.
    fn append(&mut self, chunk: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Some(buffer) = self.chunk_buffer(chunk)? else {
            return Ok(false);
        };
        self.push_bytes(chunk.py(), bytes_of(&buffer))?;
        Ok(true)
    }

    /// Appends whole rows' bytes as one chunk (a caller that checked their dtype and shape).
    fn push(&mut self, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let buffer = plain_bytes(data)?;
        let bytes = bytes_of(&buffer);
        if self.row == 0 || bytes.len() % self.row != 0 {
            return Err(PyValueError::new_err(format!(
                "{} bytes are not whole rows of {} bytes",
                bytes.len(),
                self.row
            )));
        }
        self.push_bytes(data.py(), bytes)
    }

    /// Replaces the last chunk with whole rows' bytes (vLLM's `chunks[-1] = rows`).
    fn replace_last(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let buffer = plain_bytes(data)?;
        let bytes = bytes_of(&buffer);
        if self.ends.is_empty() || bytes.len() % self.row.max(1) != 0 {
            return Err(PyValueError::new_err("no last chunk, or not whole rows"));
        }
        let n = self.ends.len();
        let start = if n > 1 { self.ends[n - 2] } else { 0 };
        self.truncate(py, start);
        self.write(py, bytes)?;
        self.ends[n - 1] = self.size;
        Ok(())
    }

    /// The bytes of chunk `index` (0 to len - 1), copied.
    fn chunk<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        let Some(&end) = self.ends.get(index) else {
            return Err(PyIndexError::new_err("chunk index out of range"));
        };
        let start = if index > 0 { self.ends[index - 1] } else { 0 };
        PyBytes::new_with(py, end - start, |out| {
            let mut at = 0;
            for (page, &first) in self.pages.iter().zip(&self.starts) {
                let page = page.bind(py);
                // SAFETY: read under the GIL; nothing writes these bytes meanwhile.
                let bytes = unsafe { page.as_bytes() };
                let (a, b) = (start.max(first), end.min(first + bytes.len()));
                if a < b {
                    out[at..at + b - a].copy_from_slice(&bytes[a - first..b - first]);
                    at += b - a;
                }
            }
            Ok(())
        })
    }

    /// `(page, bytes used)` per page, in order.
    fn pages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let used =
            self.pages.iter().zip(&self.starts).map(|(page, &start)| {
                (page.clone_ref(py), page.bind(py).len().min(self.size - start))
            });
        PyList::new(py, used)
    }

    /// Every row's bytes, in order, into `out` (writable, C-contiguous, exactly the rows'
    /// bytes), with streaming stores (`stream`) or plain ones; `start`: from that byte on.
    #[pyo3(signature = (out, stream, start = 0))]
    fn copy_into(&self, out: &Bound<'_, PyAny>, stream: bool, start: usize) -> PyResult<()> {
        let py = out.py();
        let target = PyUntypedBuffer::get(out)
            .map_err(|_| PyTypeError::new_err("out must be a writable buffer"))?;
        if target.readonly() || !target.is_c_contiguous() || holds_objects(&target) {
            return Err(PyTypeError::new_err("out must be a writable C-contiguous buffer"));
        }
        let end = start + target.len_bytes();
        if end > self.size {
            return Err(PyValueError::new_err(format!(
                "out holds {} bytes from byte {start}, past the {} held",
                target.len_bytes(),
                self.size
            )));
        }
        let mut parts = Vec::with_capacity(self.pages.len());
        for (page, &first) in self.pages.iter().zip(&self.starts) {
            // SAFETY: read under the GIL; the pages outlive `parts`, used below.
            let bytes = unsafe { page.bind(py).as_bytes() };
            let (a, b) = (start.max(first), end.min(first + bytes.len()));
            if a < b {
                parts.push(&bytes[a - first..b - first]);
            }
        }
        // SAFETY: writable, C-contiguous, `len_bytes` long, exported until `target` drops; the
        // pages are this object's own bytearrays, never the caller's buffer.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(target.buf_ptr() as *mut u8, target.len_bytes())
        };
        crate::copy_parts(&parts, dst, stream);
        Ok(())
    }

    /// Each chunk's end, in bytes.
    #[getter]
    fn ends(&self) -> Vec<usize> {
        self.ends.clone()
    }

    #[getter]
    fn count(&self) -> usize {
        self.ends.len()
    }

    /// The bytes of rows held.
    #[getter]
    fn nbytes(&self) -> usize {
        self.size
    }

    /// The bytes of the pages that hold them.
    #[getter]
    fn allocated(&self, py: Python<'_>) -> usize {
        self.pages.iter().map(|page| page.bind(py).len()).sum()
    }

    /// The bytes of the books beside the pages: each chunk's end, each page's start and handle.
    #[getter]
    fn books(&self) -> usize {
        std::mem::size_of::<Self>()
            + std::mem::size_of::<usize>() * (self.ends.capacity() + self.starts.capacity())
            + std::mem::size_of::<Py<PyByteArray>>() * self.pages.capacity()
    }

    #[getter]
    fn dtype(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.dtype.as_ref().map(|dtype| dtype.clone_ref(py))
    }

    /// One row's shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// One row's bytes (0 before the first chunk).
    #[getter]
    fn row(&self) -> usize {
        self.row
    }

    // Its pages cannot reach it; its dtype is the caller's object, which might.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for page in &self.pages {
            visit.call(page)?;
        }
        if let Some(dtype) = &self.dtype {
            visit.call(dtype)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.end_binding();
        *self = Self::new();
    }
}

impl RowPages {
    /// `unbind` where no token is at hand (GC's clear, a drop).
    fn end_binding(&mut self) {
        if self.owner != 0 {
            // SAFETY: only bound pages get here, and those are a Python object's, which Python
            // clears and deallocates with the GIL held.
            let py = unsafe { Python::assume_attached() };
            self.unbind(py);
        }
    }

    /// The address of the owner the pages are bound to (0: none).
    pub(super) fn owner_address(&self) -> usize {
        self.owner
    }
}

impl Drop for RowPages {
    fn drop(&mut self) {
        self.end_binding();
    }
}

fn plain_bytes(data: &Bound<'_, PyAny>) -> PyResult<PyUntypedBuffer> {
    let buffer =
        PyUntypedBuffer::get(data).map_err(|_| PyTypeError::new_err("rows must be a buffer"))?;
    if !buffer.is_c_contiguous() || holds_objects(&buffer) {
        return Err(PyTypeError::new_err("rows must be a C-contiguous buffer of plain bytes"));
    }
    Ok(buffer)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RowPages>()?;
    m.add_function(wrap_pyfunction!(unwritten_bytearray, m)?)
}
