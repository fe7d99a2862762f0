//! `copy_pages`: bytes held in pages, copied in order into one buffer, with streaming stores
//! where the copy is read later by another process or is larger than a cache. Two callers: a
//! finished request's pages (`aostore.vllm.transport.frontend.RowChunks`) into the answer's
//! buffer or its slot of the frontend's R3 arena, and a slot's page runs into a reader's `out`
//! (`aostore.r3`).

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{holds_objects, type_name};

/// `copy_pages(pages, nbytes, out, stream=True)`: the first `nbytes` of the pages' bytes, in
/// order, into `out` (a writable C-contiguous buffer of exactly `nbytes`), with streaming stores
/// (`stream`) or plain ones. Raises `TypeError` for a page or `out` that is no such buffer,
/// `ValueError` for sizes that do not match; nothing is written then.
#[pyfunction]
#[pyo3(signature = (pages, nbytes, out, stream = true))]
fn copy_pages(
    pages: Vec<Bound<'_, PyAny>>,
    nbytes: usize,
    out: Bound<'_, PyAny>,
    stream: bool,
) -> PyResult<()> {
    let target = PyUntypedBuffer::get(&out).map_err(|_| {
        PyTypeError::new_err(format!("out must be a writable buffer, not {}", type_name(&out)))
    })?;
    if target.readonly() || !target.is_c_contiguous() || holds_objects(&target) {
        return Err(PyTypeError::new_err(
            "out must be a writable C-contiguous buffer of plain bytes",
        ));
    }
    if target.len_bytes() != nbytes {
        return Err(PyValueError::new_err(format!(
            "out holds {} bytes, not the {nbytes} to copy",
            target.len_bytes()
        )));
    }
    let mut buffers = Vec::with_capacity(pages.len());
    for page in &pages {
        let buffer = PyUntypedBuffer::get(page).map_err(|_| {
            PyTypeError::new_err(format!("a page is a buffer, not {}", type_name(page)))
        })?;
        if !buffer.is_c_contiguous() || holds_objects(&buffer) {
            return Err(PyTypeError::new_err("a page is a C-contiguous buffer of plain bytes"));
        }
        buffers.push(buffer);
    }
    let mut parts = Vec::with_capacity(buffers.len());
    let mut left = nbytes;
    for buffer in &buffers {
        if left == 0 {
            break;
        }
        let take = buffer.len_bytes().min(left);
        // SAFETY: a C-contiguous export of `len_bytes` bytes, held until `buffers` drops.
        let bytes = unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, take) };
        parts.push(bytes);
        left -= take;
    }
    if left != 0 {
        return Err(PyValueError::new_err(format!(
            "the pages hold {} bytes, not the {nbytes} to copy",
            nbytes - left
        )));
    }
    // SAFETY: writable, C-contiguous, `nbytes` long, exported until `target` drops; a page may
    // not overlap it (the caller's pages are its own bytearrays).
    let out = unsafe { std::slice::from_raw_parts_mut(target.buf_ptr() as *mut u8, nbytes) };
    crate::copy_parts(&parts, out, stream);
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(copy_pages, m)?)
}
