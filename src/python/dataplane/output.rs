//! vLLM's outputs built from the plane's: the emit cursor's numpy scalars and the dict of
//! `AuxRequestOutput`s (or the transport's one buffer a step).

use std::sync::PoisonError;

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PySlice, PyTuple, PyType};

use super::NativeDataPlane;
use crate::dataplane::{EmittedRows, Processed};

/// `type(token_starts[i] + len(rows))`, the type vLLM's emit cursor takes from a step (under
/// NumPy 2, `numpy.int32`), with its value's width when a scalar of it can be made directly.
pub(super) struct CursorType {
    pub(super) kind: Py<PyType>,
    /// 4 or 8: a numpy integer scalar, laid out as NumPy's `arrayscalars.h` declares (the
    /// object header, then the value), checked on a probe value when first seen.
    pub(super) width: Option<usize>,
}

impl CursorType {
    pub(super) fn of(
        py: Python<'_>,
        numpy: &Bound<'_, PyModule>,
        kind: Bound<'_, PyType>,
    ) -> PyResult<Self> {
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

    pub(super) fn make<'py>(&self, py: Python<'py>, value: i64) -> PyResult<Bound<'py, PyAny>> {
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
    /// vLLM's outputs dict, built with the GIL and without the plane's lock.
    pub(super) fn outputs_dict<'py>(
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
pub(super) fn plain_dataclass(class: &Bound<'_, PyAny>) -> PyResult<bool> {
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
