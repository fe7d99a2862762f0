//! The variable-size store's binding, with a two-phase read into one `bytes` of unknown size.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::handle::{stats_dict, store_methods, Handle};
use super::{
    as_texts, bytes_ptr, collect_keys, key_text, new_uninit_bytes, size_arg, to_py_err, too_large,
    PrefaultArg,
};
use crate::arena::Prefault;
use crate::store::{ChunkChains, ReadPlan, StoreOptions, VariableStore};

/// Replans of a read overtaken by puts before it falls back to one locked private copy.
const READ_ATTEMPTS: usize = 3;

/// The native variable-size store: a `VariableStore` behind the handle both stores share.
#[pyclass(module = "aostore._native", subclass, frozen, name = "NativeVariableStore")]
pub struct NativeVariableStore {
    pub(crate) handle: Handle<ChunkChains>,
    max_bytes: usize,
    chunk_nbytes: usize,
}

impl NativeVariableStore {
    /// `get_concatenated` after its checks; a missing key raises "does not exist".
    fn concatenated<'py>(&self, py: Python<'py>, texts: &[&str]) -> PyResult<Bound<'py, PyBytes>> {
        Ok(self.read(py, texts, true)?.0)
    }

    /// Reads `keys` into one new `bytes`: plan under the lock, make the object with the GIL, copy
    /// under the lock if no put ran between. With `require_all`, a missing key raises.
    fn read<'py>(
        &self,
        py: Python<'py>,
        keys: &[&str],
        require_all: bool,
    ) -> PyResult<(Bound<'py, PyBytes>, ReadPlan)> {
        let mut plan = ReadPlan::default();
        for _ in 0..READ_ATTEMPTS {
            let planned = self.handle.with_store(py, move |s| {
                let result = s.plan_read(keys, &mut plan).and_then(|()| {
                    if require_all && !plan.missing().is_empty() {
                        Err(s.missing_error(keys, &plan))
                    } else {
                        Ok(())
                    }
                });
                (plan, result)
            })?;
            planned.1.map_err(to_py_err)?;
            plan = planned.0;
            let len = plan.total();
            let bytes = new_uninit_bytes(py, len)?;
            let ptr = bytes_ptr(&bytes) as usize;
            let (returned, copied) = self.handle.with_store(py, move |s| {
                // SAFETY: for `len > 0` a new object of `len` bytes no one else sees, held for the
                // call; for `len == 0` CPython's shared empty bytes, and nothing is written.
                let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                let copied = s.read_planned(&plan, out);
                (plan, copied)
            })?;
            plan = returned;
            if copied.map_err(to_py_err)? {
                return Ok((bytes, plan));
            }
        }
        // Puts keep overtaking the plan: read in one locked call into a private buffer.
        let (data, plan) = self
            .handle
            .with_store(py, |s| {
                if require_all {
                    s.get_concatenated(keys).map(|data| (data, None))
                } else {
                    s.get_many(keys).map(|(data, plan)| (data, Some(plan)))
                }
            })?
            .map_err(to_py_err)?;
        Ok((PyBytes::new(py, &data), plan.unwrap_or_default()))
    }
}

store_methods!(NativeVariableStore {
    #[new]
    #[pyo3(signature = (*, max_bytes, policy = None, chunk_nbytes = None, prefault = PrefaultArg(Prefault::OnWrite)))]
    fn new(
        max_bytes: &Bound<'_, PyAny>,
        policy: Option<&Bound<'_, PyAny>>,
        chunk_nbytes: Option<&Bound<'_, PyAny>>,
        prefault: PrefaultArg,
    ) -> PyResult<Self> {
        let prefault = prefault.0;
        let max_bytes = size_arg(max_bytes, "max_bytes")?;
        if max_bytes <= 0 {
            return Err(PyValueError::new_err("auxiliary output store max_bytes must be positive"));
        }
        let chunk_nbytes = match chunk_nbytes.filter(|c| !c.is_none()) {
            None => None,
            Some(value) => {
                let value = size_arg(value, "chunk_nbytes")?;
                if value <= 0 {
                    return Err(PyValueError::new_err(
                        "auxiliary output store chunk size must be positive",
                    ));
                }
                Some(usize::try_from(value).map_err(|_| too_large(value))?)
            }
        };
        let max_bytes = usize::try_from(max_bytes).map_err(|_| too_large(max_bytes))?;
        let options = StoreOptions { chunk_nbytes, prefault, ..StoreOptions::default() };
        let store = VariableStore::with_options(max_bytes, options).map_err(to_py_err)?;
        let chunk_nbytes = store.chunk_nbytes();
        let policy = policy.filter(|p| !p.is_none()).map(|p| p.clone().unbind());
        Ok(Self { handle: Handle::new(store, policy), max_bytes, chunk_nbytes })
    }

    /// The byte budget given to the constructor.
    #[getter]
    fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Bytes per chunk: each object takes its size rounded up to whole chunks of the budget.
    #[getter]
    fn chunk_nbytes(&self) -> usize {
        self.chunk_nbytes
    }

    /// Bytes the store holds at most: `max_bytes` rounded down to whole chunks.
    #[getter]
    fn capacity_bytes(&self) -> usize {
        self.max_bytes / self.chunk_nbytes * self.chunk_nbytes
    }


    /// Reads what is stored and reports what is not: `(data, missing, offsets)`, key `i` at
    /// `data[offsets[i]:offsets[i + 1]]` (empty if missing), the missing keys in order. Only keys
    /// read move in the LRU.
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>, Bound<'py, PyList>)> {
        self.handle.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys)?;
        let (data, plan) = self.read(py, &texts, false)?;
        let missing = PyList::new(py, plan.missing().iter().map(|&i| &keys[i]))?;
        let offsets = PyList::new(py, plan.offsets())?;
        Ok((data, missing, offsets))
    }

    /// The payload of `key`, or `None` when not stored (nothing moves), as vLLM's wrapper has it.
    fn get_optional<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        self.handle.ensure_open()?;
        let text = key_text(key)?;
        let (data, plan) = self.read(py, &[text], false)?;
        Ok(plan.missing().is_empty().then_some(data))
    }

    /// Occupancy and counters as a dict of ints (sizes in bytes).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (stats, arena_bytes) = self.handle.with_store(py, |s| (s.stats(), s.arena_bytes()))?;
        let occupancy = [
            ("capacity", stats.capacity_bytes as u64),
            ("chunk_nbytes", stats.chunk_nbytes as u64),
            ("arena_bytes", arena_bytes as u64),
            ("stored", stats.stored as u64),
            ("stored_bytes", stats.stored_bytes),
            ("used_bytes", stats.used_bytes as u64),
            ("free_bytes", (stats.capacity_bytes - stats.used_bytes) as u64),
            ("referenced", stats.referenced as u64),
            ("evictable", stats.evictable as u64),
        ];
        stats_dict(py, &occupancy, &stats.counters, false)
    }

    /// Mean runs of adjacent chunks per stored object (1.0: every object in one piece).
    fn mean_runs(&self, py: Python<'_>) -> PyResult<f64> {
        self.handle.with_store(py, |s| s.mean_runs())
    }

});

/// Registers the classes of this module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeVariableStore>()?;
    Ok(())
}
