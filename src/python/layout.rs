//! `Layout`: the core's layout type, for the plugin's release records (what a layout answers is
//! decided in `crate::layout` alone; Python only asks).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// One shape of vLLM's aux-output connectors, by the name a release record gives it.
#[pyclass(name = "Layout", module = "aostore._native", frozen, eq, hash)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PyLayout(pub(crate) crate::Layout);

/// The layout `name` names, or `ValueError` listing the known ones.
pub(crate) fn layout(name: &str) -> PyResult<crate::Layout> {
    crate::Layout::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = crate::Layout::ALL.iter().map(|layout| layout.name()).collect();
        PyValueError::new_err(format!("unknown vLLM layout '{name}' (known: {})", known.join(", ")))
    })
}

#[pymethods]
impl PyLayout {
    #[new]
    fn new(name: &str) -> PyResult<Self> {
        layout(name).map(Self)
    }

    /// Every layout's name, oldest first.
    #[staticmethod]
    fn names() -> Vec<&'static str> {
        crate::Layout::ALL.iter().map(|layout| layout.name()).collect()
    }

    #[getter]
    fn name(&self) -> &'static str {
        self.0.name()
    }

    /// The scheduler connector sends KV-cached retains and releases (0.33.0 on).
    #[getter]
    fn kv_events(&self) -> bool {
        self.0.kv_events()
    }

    /// A read behind the capture covers unkeyed full blocks, then the tail (0.34.0).
    #[getter]
    fn reads_pending_blocks(&self) -> bool {
        self.0.reads_pending_blocks()
    }

    /// The worker connector builds its storage after the KV cache (0.34.0).
    #[getter]
    fn builds_storage_in_two_phases(&self) -> bool {
        self.0.builds_storage_in_two_phases()
    }

    /// A request's emit start is its prompt start capped at the prompt (0.32.0 on).
    #[getter]
    fn caps_prompt_start(&self) -> bool {
        self.0.caps_prompt_start()
    }

    fn __repr__(&self) -> String {
        format!("Layout({:?})", self.0.name())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLayout>()
}
