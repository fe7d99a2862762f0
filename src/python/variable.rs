//! The binding of the variable-size store: the same conventions as `NativeStore` (arguments
//! gathered as raw views with the GIL held, the store lock taken only with the GIL released, one
//! error mapping), plus the two-phase read that lets a result of unknown size be one `bytes`
//! object filled in place.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::exceptions::{PyAssertionError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::PyTraverseError;

use super::gather::Gathered;
use super::lock::{Held, StoreLock};
use super::{
    as_texts, bytes_ptr, collect_keys, fork_generation, forked_error, key_text, new_uninit_bytes,
    prefault_arg, size_arg, to_py_err, too_large, PyPolicy,
};
use crate::arena::Prefault;
use crate::error::StoreError;
use crate::store::VictimPolicy;
use crate::variable::{ReadPlan, VariableStore};

/// A planned read that a put overtook is planned again this many times before it is copied in
/// one locked call through a private buffer instead.
const READ_ATTEMPTS: usize = 3;

/// The native variable-size store: a `VariableStore` behind a mutex, shared by threads.
#[pyclass(module = "aostore._native", subclass, frozen, name = "NativeVariableStore")]
pub struct NativeVariableStore {
    /// Shared with a Rust writer thread (`NativeWriter`), which applies batches to it directly.
    inner: Arc<Mutex<VariableStore>>,
    /// The victim policy; behind its own small lock only so `__clear__` can drop it (never
    /// while the store lock is held).
    policy: Mutex<Option<Py<PyAny>>>,
    /// Whether a policy was given: then a thread waiting for the lock must watch `in_policy`.
    has_policy: bool,
    /// Set while a policy callback runs (with the lock held).
    in_policy: AtomicBool,
    closed: AtomicBool,
    max_bytes: usize,
    chunk_nbytes: usize,
    /// `fork_generation()` at construction: a forked child must not touch the lock.
    generation: u64,
}

impl NativeVariableStore {
    fn lock(&self) -> Result<Held<'_, VariableStore>, StoreError> {
        StoreLock {
            mutex: &self.inner,
            owner: std::ptr::from_ref(self) as usize,
            has_policy: self.has_policy,
            in_policy: &self.in_policy,
        }
        .acquire()
    }

    /// The core, for a writer thread.
    pub(crate) fn core(&self) -> PyResult<Arc<Mutex<VariableStore>>> {
        if self.generation != fork_generation() {
            return Err(forked_error());
        }
        Ok(Arc::clone(&self.inner))
    }

    fn ensure_open(&self) -> PyResult<()> {
        if self.generation != fork_generation() {
            return Err(forked_error());
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(to_py_err(StoreError::Closed));
        }
        Ok(())
    }

    /// Runs `f` on the store with the GIL released: the lock is only ever taken without the GIL.
    fn with_store<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut VariableStore) -> T + Send,
    ) -> PyResult<T> {
        if self.generation != fork_generation() {
            return Err(forked_error());
        }
        py.detach(|| self.lock().map(|mut held| f(&mut held.guard))).map_err(to_py_err)
    }

    /// A new reference to the policy, taken with the GIL held so that the put can use it while
    /// `__clear__` may run; dropped by the caller after the store lock is released.
    fn policy_ref(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let policy = self.policy.lock().unwrap_or_else(PoisonError::into_inner);
        policy.as_ref().map(|p| p.clone_ref(py))
    }

    /// Reads `keys` into one new `bytes` object: plan under the lock (sizes and places), make the
    /// object with the GIL, copy into it under the lock if no put ran in between. With
    /// `require_all`, a missing key raises.
    fn read<'py>(
        &self,
        py: Python<'py>,
        keys: &[&str],
        require_all: bool,
    ) -> PyResult<(Bound<'py, PyBytes>, ReadPlan)> {
        let mut plan = ReadPlan::default();
        for _ in 0..READ_ATTEMPTS {
            let planned = self.with_store(py, move |s| {
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
            let (returned, copied) = self.with_store(py, move |s| {
                // SAFETY: for `len > 0`, `bytes` is a new object of `len` bytes that no one else
                // can see yet, held for the duration of the call; for `len == 0` CPython returns
                // its shared empty bytes object, and the empty slice writes nothing.
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

#[pymethods]
impl NativeVariableStore {
    #[new]
    #[pyo3(signature = (*, max_bytes, policy = None, chunk_nbytes = None, prefault = None))]
    fn new(
        max_bytes: &Bound<'_, PyAny>,
        policy: Option<&Bound<'_, PyAny>>,
        chunk_nbytes: Option<&Bound<'_, PyAny>>,
        prefault: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let prefault = prefault.map_or(Ok(Prefault::OnWrite), prefault_arg)?;
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
        let store =
            VariableStore::with_commit(max_bytes, chunk_nbytes, prefault).map_err(to_py_err)?;
        let chunk_nbytes = store.chunk_nbytes();
        let policy = policy.filter(|p| !p.is_none()).map(|p| p.clone().unbind());
        Ok(Self {
            inner: Arc::new(Mutex::new(store)),
            has_policy: policy.is_some(),
            policy: Mutex::new(policy),
            in_policy: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            max_bytes,
            chunk_nbytes,
            generation: fork_generation(),
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // A policy being cleared or read right now is skipped this time, not waited for.
        if let Ok(policy) = self.policy.try_lock() {
            if let Some(policy) = policy.as_ref() {
                visit.call(policy)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let policy = self.policy.lock().unwrap_or_else(PoisonError::into_inner).take();
        // Dropped here, after the lock above is released.
        drop(policy);
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

    /// Whether `close()` was called (and finished).
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The victim policy given to the constructor, or None.
    #[getter]
    fn policy(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.policy_ref(py)
    }

    /// Stores `objects` (each with `.key` and a payload of any size, zero included), replacing
    /// the payload of a key that is stored, then applies `retain_keys` (+1 each) and
    /// `release_keys` (-1 each), evicting unreferenced keys by bytes as needed. Bad input raises
    /// and changes nothing; so does a batch that cannot be held (`cannot retain`).
    #[pyo3(signature = (objects, *, retain_keys = None, release_keys = None))]
    fn put(
        &self,
        py: Python<'_>,
        objects: &Bound<'_, PyAny>,
        retain_keys: Option<&Bound<'_, PyAny>>,
        release_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.ensure_open()?;
        let mut batch = Gathered::default();
        batch.objects(objects)?;
        batch.references(retain_keys, release_keys)?;
        // SAFETY: `batch` outlives the views, which are dropped at the end of this call.
        let (blocks, retains, releases) = unsafe { batch.views() };
        let policy_object = self.policy_ref(py);
        let mut policy = policy_object.as_ref().map(|policy| PyPolicy {
            policy,
            active: &self.in_policy,
            error: None,
        });
        let result = self.with_store(py, |s| {
            let policy = policy.as_mut().map(|p| p as &mut dyn VictimPolicy);
            s.put_with_policy(&blocks, &retains, &releases, policy)
        })?;
        if let Some(error) = policy.and_then(|p| p.error) {
            return Err(error);
        }
        result.map_err(to_py_err)
    }

    /// The payloads of `keys`, concatenated in order, as `bytes`; a key that is not stored
    /// raises `BlockObjectStoreError` ("does not exist") and changes nothing.
    fn get_concatenated<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys);
        Ok(self.read(py, &texts, true)?.0)
    }

    /// Reads what is stored and reports what is not, in one call:
    /// `(data, missing, offsets)`. `data` holds the payloads of the stored keys in order;
    /// key `i`'s bytes are `data[offsets[i]:offsets[i + 1]]` (`len(keys) + 1` offsets; a
    /// missing key has an empty range); `missing` lists the keys that are not stored, once per
    /// occurrence, in order. Keys read move to the LRU tail as a successful read does; missing
    /// ones touch nothing.
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>, Bound<'py, PyList>)> {
        self.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys);
        let (data, plan) = self.read(py, &texts, false)?;
        let missing = PyList::new(py, plan.missing().iter().map(|&i| &keys[i]))?;
        let offsets = PyList::new(py, plan.offsets())?;
        Ok((data, missing, offsets))
    }

    /// The payload of `key`, or `None` when it is not stored (no error; a miss moves nothing and
    /// counts as a read miss). vLLM's background wrapper has this method; a wrapper around this
    /// store calls it.
    fn get_optional<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        self.ensure_open()?;
        let text = key_text(key)?;
        let (data, plan) = self.read(py, &[text], false)?;
        Ok(plan.missing().is_empty().then_some(data))
    }

    /// Whether each key is stored, without reading it or touching LRU order.
    fn contains<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys);
        let found = self.with_store(py, |s| s.contains_many(&texts))?.map_err(to_py_err)?;
        PyList::new(py, found)
    }

    /// Frees the arena; later calls raise `RuntimeError`. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.with_store(py, VariableStore::close)?;
        self.closed.store(true, Ordering::Release);
        Ok(())
    }

    /// Raises `AssertionError` naming the first broken invariant (keys, LRU, allocator).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.with_store(py, |s| s.check())?.map_err(PyAssertionError::new_err)
    }

    /// Occupancy and counters as a dict of ints (sizes in bytes).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (stats, arena_bytes) = self.with_store(py, |s| (s.stats(), s.arena_bytes()))?;
        let c = stats.counters;
        let dict = PyDict::new(py);
        for (name, value) in [
            ("capacity", stats.capacity_bytes as u64),
            ("chunk_nbytes", stats.chunk_nbytes as u64),
            ("arena_bytes", arena_bytes as u64),
            ("stored", stats.stored as u64),
            ("stored_bytes", stats.stored_bytes),
            ("used_bytes", stats.used_bytes as u64),
            ("free_bytes", (stats.capacity_bytes - stats.used_bytes) as u64),
            ("referenced", stats.referenced as u64),
            ("evictable", stats.evictable as u64),
            ("puts", c.puts),
            ("objects_written", c.objects_written),
            ("retains", c.retains),
            ("releases", c.releases),
            ("evictions", c.evictions),
            ("capacity_errors", c.capacity_errors),
            ("reads", c.reads),
            ("read_misses", c.read_misses),
            ("bytes_written", c.bytes_written),
            ("bytes_read", c.bytes_read),
            ("eviction_visits", c.eviction_visits),
        ] {
            dict.set_item(name, value)?;
        }
        Ok(dict)
    }

    /// Mean runs of adjacent chunks per stored object (1.0: every object in one piece).
    fn mean_runs(&self, py: Python<'_>) -> PyResult<f64> {
        self.with_store(py, |s| s.mean_runs())
    }

    /// Every key the store knows, without touching LRU order (O(n); for tests and debugging):
    /// `{"lru": [evictable keys, oldest first], "references": {key: count},
    /// "objects": {key: payload bytes}}`.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        type Contents = (Vec<String>, Vec<(String, u32)>, Vec<(String, Vec<u8>)>);
        let (lru, refs, objects): Contents = self.with_store(py, |s| {
            (
                s.lru_keys().into_iter().map(str::to_owned).collect(),
                s.references().into_iter().map(|(k, c)| (k.to_owned(), c)).collect(),
                s.objects().into_iter().map(|(k, p)| (k.to_owned(), p)).collect(),
            )
        })?;
        let dict = PyDict::new(py);
        let references = PyDict::new(py);
        for (key, count) in refs {
            references.set_item(key, count)?;
        }
        let payloads = PyDict::new(py);
        for (key, payload) in objects {
            payloads.set_item(key, PyBytes::new(py, &payload))?;
        }
        dict.set_item("lru", PyList::new(py, lru)?)?;
        dict.set_item("references", references)?;
        dict.set_item("objects", payloads)?;
        Ok(dict)
    }
}

/// Registers the classes of this module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeVariableStore>()?;
    Ok(())
}
