//! vLLM's victim policy called from the core, and the lazy candidate keys it is given.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::store::{RemoveReason, VictimPolicy};

/// vLLM's `ExpertCachePolicy`, called with the GIL; the first exception is kept for the put.
pub(crate) struct PyPolicy<'a> {
    pub(crate) policy: &'a Py<PyAny>,
    /// The store's `in_policy` flag, set around each callback.
    pub(crate) active: &'a AtomicBool,
    pub(crate) error: Option<PyErr>,
}

impl PyPolicy<'_> {
    fn keep(&mut self, error: PyErr) -> String {
        let message = error.to_string();
        self.error.get_or_insert(error);
        message
    }

    /// `select_victims(candidates, count)` with a lazy iterator over either core's walk.
    pub(crate) fn ask_for_victims(
        &mut self,
        candidates: &mut dyn Iterator<Item = Cow<'_, str>>,
        count: usize,
    ) -> Result<Option<Vec<String>>, String> {
        let result = self.call(|py| -> PyResult<Option<Vec<String>>> {
            let pointer: *mut (dyn Iterator<Item = Cow<'_, str>> + '_) = candidates;
            // SAFETY: only the lifetimes are erased; the walk is dereferenced only while this
            // call runs (see `CandidateWalk`), and the pointer is cleared before it returns.
            let pointer: *mut (dyn Iterator<Item = Cow<'static, str>> + 'static) =
                unsafe { std::mem::transmute(pointer) };
            let iterator =
                Bound::new(py, CandidateKeys { walk: Mutex::new(Some(CandidateWalk(pointer))) })?;
            // Read while the walk is valid, so a lazy selection (a generator) works.
            let chosen = self
                .policy
                .bind(py)
                .call_method1(intern!(py, "select_victims"), (&iterator, count))
                .and_then(|chosen| selected_keys(&chosen));
            // The walk borrows the store; it ends with this call whatever the policy kept.
            *iterator.get().walk.lock().unwrap_or_else(PoisonError::into_inner) = None;
            chosen
        });
        result.map_err(|e| self.keep(e))
    }

    /// Runs one callback with the GIL, flagged for threads waiting for the store's lock.
    fn call<T>(&self, f: impl FnOnce(Python<'_>) -> PyResult<T>) -> PyResult<T> {
        self.active.store(true, Ordering::Release);
        let result = Python::attach(f);
        self.active.store(false, Ordering::Release);
        result
    }
}

impl VictimPolicy for PyPolicy<'_> {
    fn on_reference_change(&mut self, key: &str, old: u32, new: u32) -> Result<(), String> {
        let result = self.call(|py| {
            self.policy
                .bind(py)
                .call_method1(intern!(py, "on_reference_change"), (key, old, new))
                .map(drop)
        });
        result.map_err(|e| self.keep(e))
    }

    fn select_victims(
        &mut self,
        candidates: &mut dyn Iterator<Item = Cow<'_, str>>,
        count: usize,
    ) -> Result<Option<Vec<String>>, String> {
        self.ask_for_victims(candidates, count)
    }

    fn on_remove(&mut self, keys: &[&str], reason: RemoveReason) -> Result<(), String> {
        let reason = match reason {
            RemoveReason::Eviction => "eviction",
            RemoveReason::Rollback => "rollback",
        };
        let result = self.call(|py| -> PyResult<()> {
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "reason"), reason)?;
            let keys = PyList::new(py, keys)?;
            self.policy
                .bind(py)
                .call_method(intern!(py, "on_remove"), (keys,), Some(&kwargs))
                .map(drop)
        });
        result.map_err(|e| self.keep(e))
    }
}

/// A policy's answer: `None` stays `None`; anything but an iterable of `str` is invalid (empty,
/// which the core refuses); an exception while iterating is the policy's own and propagates.
pub(crate) fn selected_keys(chosen: &Bound<'_, PyAny>) -> PyResult<Option<Vec<String>>> {
    if chosen.is_none() {
        return Ok(None);
    }
    let invalid = Ok(Some(Vec::new()));
    let items = match chosen.try_iter() {
        Ok(items) => items,
        // Not iterable at all: an invalid answer, not a failure of the policy.
        Err(error) if error.is_instance_of::<PyTypeError>(chosen.py()) && !has_iter(chosen) => {
            return invalid;
        }
        Err(error) => return Err(error),
    };
    let mut keys = Vec::new();
    for item in items {
        let item = item?;
        let Ok(text) = item.cast::<PyString>() else { return invalid };
        // A str no key can equal (lone surrogates cannot be UTF-8): invalid, as a missing key.
        let Ok(text) = text.to_str() else { return invalid };
        keys.push(text.to_owned());
    }
    Ok(Some(keys))
}

/// Whether `object`'s type defines `__iter__` or `__getitem__`: then a TypeError is the policy's.
pub(crate) fn has_iter(object: &Bound<'_, PyAny>) -> bool {
    let kind = object.get_type();
    kind.hasattr(intern!(object.py(), "__iter__")).unwrap_or(false)
        || kind.hasattr(intern!(object.py(), "__getitem__")).unwrap_or(false)
}

/// A raw pointer to the core's candidate walk, valid only during `select_victims`.
pub(crate) struct CandidateWalk(*mut (dyn Iterator<Item = Cow<'static, str>> + 'static));

// SAFETY: dereferenced only under the `CandidateKeys` mutex while `select_victims` runs, when
// the core waits and does not touch the walk; cleared under that mutex before it returns.
unsafe impl Send for CandidateWalk {}

/// The lazy iterable of eligible keys given to `select_victims`, oldest first.
#[pyclass(module = "aostore._native", frozen, name = "VictimCandidates")]
pub(crate) struct CandidateKeys {
    /// A plain mutex: taken only with the GIL held, and no Python runs while it is held.
    walk: Mutex<Option<CandidateWalk>>,
}

#[pymethods]
impl CandidateKeys {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyString>>> {
        // Copied under the lock, made a Python string after it: that may run the collector.
        let key: Option<String> = {
            let mut walk = self.walk.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(CandidateWalk(pointer)) = walk.as_mut() else {
                return Err(PyRuntimeError::new_err(
                    "victim candidates are only valid during select_victims()",
                ));
            };
            // SAFETY: see `CandidateWalk`: set only during `select_victims`, read under this mutex.
            let candidates = unsafe { &mut **pointer };
            candidates.next().map(Cow::into_owned)
        };
        Ok(key.map(|key| PyString::new(py, &key)))
    }
}
