//! `widen_routes`: vLLM's uint8 routes into a trainer's wider integers as they are copied
//! (`aostore.r3.layouts`), the GIL released around the copy. The copy is `crate::widen`'s.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{holds_objects, type_name};

/// `widen_routes(routes, out, stream)`: `routes`' bytes (a C-contiguous buffer of uint8 routes,
/// their range already checked) zero-extended into `out` (a writable C-contiguous buffer of
/// 1-, 2-, 4- or 8-byte little-endian integers, one per route), with streaming stores
/// (`stream`) or plain ones. `TypeError`/`ValueError` write nothing.
#[pyfunction]
fn widen_routes(
    py: Python<'_>,
    routes: Bound<'_, PyAny>,
    out: Bound<'_, PyAny>,
    stream: bool,
) -> PyResult<()> {
    let source = PyUntypedBuffer::get(&routes).map_err(|_| {
        PyTypeError::new_err(format!("routes must be a buffer, not {}", type_name(&routes)))
    })?;
    let target = PyUntypedBuffer::get(&out).map_err(|_| {
        PyTypeError::new_err(format!("out must be a writable buffer, not {}", type_name(&out)))
    })?;
    if source.item_size() != 1 || !source.is_c_contiguous() || holds_objects(&source) {
        return Err(PyTypeError::new_err("routes are a C-contiguous buffer of uint8"));
    }
    if target.readonly() || !target.is_c_contiguous() || holds_objects(&target) {
        return Err(PyTypeError::new_err("out must be a writable C-contiguous buffer of integers"));
    }
    let width = target.item_size();
    if !crate::widen::WIDTHS.contains(&width) || target.len_bytes() != source.len_bytes() * width {
        return Err(PyValueError::new_err(format!(
            "out holds {} bytes of {width}-byte items, not {} routes widened",
            target.len_bytes(),
            source.len_bytes()
        )));
    }
    let (src_ptr, src_len) = (source.buf_ptr() as usize, source.len_bytes());
    let (dst_ptr, dst_len) = (target.buf_ptr() as usize, target.len_bytes());
    py.detach(|| {
        // SAFETY: both buffers are C-contiguous exports of these lengths, held (with their
        // objects) until `source` and `target` drop after this call; the caller's routes are
        // never its output (a reference's mapping or vLLM's array, against a fresh layout or
        // its `out`).
        let (src, dst) = unsafe {
            (
                std::slice::from_raw_parts(src_ptr as *const u8, src_len),
                std::slice::from_raw_parts_mut(dst_ptr as *mut u8, dst_len),
            )
        };
        crate::widen::widen_u8(src, dst, width, stream);
    });
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(widen_routes, m)?)
}
