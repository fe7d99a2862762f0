//! `BlockObject`: one immutable key and payload, as vLLM's store takes and returns them.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use pyo3::PyTraverseError;

/// One immutable auxiliary-output object: a key and its payload bytes.
#[pyclass(module = "aostore", frozen, name = "BlockObject")]
pub struct BlockObject {
    #[pyo3(get)]
    pub(crate) key: Py<PyAny>,
    #[pyo3(get)]
    pub(crate) payload: Py<PyAny>,
}

#[pymethods]
impl BlockObject {
    #[new]
    fn new(key: Py<PyAny>, payload: Py<PyAny>) -> Self {
        Self { key, payload }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "BlockObject(key={}, payload={})",
            self.key.bind(py).repr()?,
            self.payload.bind(py).repr()?
        ))
    }

    /// Equal when both fields are, as a frozen dataclass compares `(key, payload)`.
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let Ok(other) = other.cast::<BlockObject>() else {
            return Ok(py.NotImplemented());
        };
        let other = other.get();
        let equal = self.key.bind(py).eq(other.key.bind(py))?
            && self.payload.bind(py).eq(other.payload.bind(py))?;
        Ok(equal.into_pyobject(py)?.to_owned().into_any().unbind())
    }

    /// `hash((key, payload))`, a `TypeError` for an unhashable payload, as a frozen dataclass.
    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        PyTuple::new(py, [self.key.bind(py), self.payload.bind(py)])?.hash()
    }

    fn __getnewargs__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, [self.key.clone_ref(py), self.payload.clone_ref(py)])
    }

    // The fields never change, so clearing the other objects of a cycle breaks it.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.key)?;
        visit.call(&self.payload)
    }
}
