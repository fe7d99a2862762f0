//! Argument conversion shared by the native classes: keys, buffers, sizes, `prefault=`.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyMemoryError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::arena::Prefault;

pub(crate) fn key_text<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
    match key.cast::<PyString>() {
        Ok(text) => text.to_str().map_err(|_| {
            PyValueError::new_err(format!(
                "auxiliary output keys must be valid UTF-8 text, got {}",
                key.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string())
            ))
        }),
        Err(_) => Err(PyTypeError::new_err(format!(
            "auxiliary output keys must be str, not {}",
            type_name(key)
        ))),
    }
}

pub(crate) fn type_name(value: &Bound<'_, PyAny>) -> String {
    value.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// Whether a buffer holds Python object references (numpy `dtype=object`, format "O"): copying
/// those as bytes would store pointers, and writing into them would corrupt the interpreter.
pub(crate) fn holds_objects(buffer: &PyUntypedBuffer) -> bool {
    format_holds_objects(buffer.format().to_bytes())
}

/// Whether a PEP 3118 format has an `O` item (field names between colons are not items).
pub(crate) fn format_holds_objects(format: &[u8]) -> bool {
    let mut in_name = false;
    for &c in format {
        match c {
            b':' => in_name = !in_name,
            b'O' if !in_name => return true,
            _ => {}
        }
    }
    false
}

/// A capacity hint from `len()`: exact for a list or tuple, capped for a `__len__` that may lie.
pub(crate) fn size_hint(value: &Bound<'_, PyAny>) -> usize {
    let len = value.len().unwrap_or(0);
    if value.is_exact_instance_of::<PyList>() || value.is_exact_instance_of::<PyTuple>() {
        len
    } else {
        len.min(4_096)
    }
}

/// Room for `additional` more items, or `MemoryError` before anything changes (never an abort).
pub(crate) fn reserve<T>(v: &mut Vec<T>, additional: usize) -> PyResult<()> {
    v.try_reserve(additional).map_err(|_| {
        PyMemoryError::new_err(format!("cannot allocate room for a call of {additional} items"))
    })
}

pub(crate) fn collect_keys<'py>(keys: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut out = Vec::new();
    reserve(&mut out, size_hint(keys))?;
    for key in keys.try_iter()? {
        let key = key?;
        key_text(&key)?;
        out.push(key);
    }
    Ok(out)
}

pub(crate) fn as_texts<'a>(keys: &'a [Bound<'_, PyAny>]) -> PyResult<Vec<&'a str>> {
    let mut texts = Vec::new();
    reserve(&mut texts, keys.len())?;
    // key_text already succeeded for every key in `collect_keys`.
    texts.extend(keys.iter().map(|k| key_text(k).expect("validated key")));
    Ok(texts)
}

/// `prefault=` as both constructors take it, checked once (omitted: `False`).
pub(crate) struct PrefaultArg(pub(crate) Prefault);

impl<'a, 'py> FromPyObject<'a, 'py> for PrefaultArg {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        prefault_arg(&obj).map(PrefaultArg)
    }
}

/// `prefault=`: `False` (on first write), `True` (all now), or `"background"` (by a thread).
pub(crate) fn prefault_arg(value: &Bound<'_, PyAny>) -> PyResult<Prefault> {
    if let Ok(flag) = value.cast::<pyo3::types::PyBool>() {
        return Ok(if flag.is_true() { Prefault::Now } else { Prefault::OnWrite });
    }
    // Exactly a str (not a subclass that may compare equal): the one check of this argument.
    match value.cast_exact::<PyString>().ok().and_then(|s| s.to_str().ok().map(str::to_owned)) {
        Some(text) if text == "background" => Ok(Prefault::Background),
        _ => Err(PyValueError::new_err(format!(
            "prefault must be True, False or 'background', not {}",
            value.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string())
        ))),
    }
}

pub(crate) fn size_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!("{name} must be an int, not bool")));
    }
    let value = value.cast::<pyo3::types::PyInt>().map_err(|_| {
        PyTypeError::new_err(format!("{name} must be an int, not {}", type_name(value)))
    })?;
    value.extract::<i128>().map_err(|_| {
        PyOverflowError::new_err(format!("{name} is too large for an auxiliary output store"))
    })
}

pub(crate) fn too_large(value: i128) -> PyErr {
    PyOverflowError::new_err(format!("auxiliary output store size {value} is too large"))
}

pub(crate) fn new_uninit_bytes(py: Python<'_>, len: usize) -> PyResult<Bound<'_, PyBytes>> {
    let len =
        ffi::Py_ssize_t::try_from(len).map_err(|_| PyOverflowError::new_err("read too large"))?;
    // SAFETY: a NULL source gives an uninitialised bytes object, filled whole before it is shared.
    let raw = unsafe { ffi::PyBytes_FromStringAndSize(std::ptr::null(), len) };
    // SAFETY: `raw` is a new reference or NULL with an exception set.
    let any = unsafe { Bound::from_owned_ptr_or_err(py, raw)? };
    Ok(any.cast_into::<PyBytes>().expect("PyBytes_FromStringAndSize returns bytes"))
}

pub(crate) fn bytes_ptr(bytes: &Bound<'_, PyBytes>) -> *mut u8 {
    // SAFETY: `bytes` is a live bytes object; its storage is inline and never moves.
    unsafe { ffi::PyBytes_AsString(bytes.as_ptr()).cast::<u8>() }
}
