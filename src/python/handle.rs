//! What both native stores are built on: the store behind its lock, the fork check, the closed
//! state, the victim policy, and the Python methods they share (`store_methods!`).

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::exceptions::PyAssertionError;
use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::PyTraverseError;

use super::gather::Gathered;
use super::lock::{Held, StoreLock};
use super::{as_texts, collect_keys, fork_generation, forked_error, to_py_err, PyPolicy};
use crate::error::StoreError;
use crate::store::{Allocator, Counters, Store, VictimPolicy};

/// `retain_keys` and `release_keys` as a put takes them.
pub(crate) type References<'a, 'py> =
    (Option<&'a Bound<'py, PyAny>>, Option<&'a Bound<'py, PyAny>>);

/// Every key a store knows, copied out under the lock: LRU (oldest first), counts, bytes.
pub(crate) type Contents = (Vec<String>, Vec<(String, u32)>, Vec<(String, Vec<u8>)>);

/// A store behind its mutex, which is only taken with the GIL released (a victim policy is the
/// one exception: see `lock.rs`).
pub(crate) struct Handle<A: Allocator> {
    /// Shared with a `NativeWriter` thread, which never holds the Python object.
    inner: Arc<Mutex<Store<A>>>,
    /// Behind its own lock only so `__clear__` can drop it (never under the store lock).
    policy: Mutex<Option<Py<PyAny>>>,
    /// Without a policy, a put never takes the policy lock nor watches `in_policy`.
    has_policy: bool,
    in_policy: AtomicBool,
    /// Set by `close()`; read without the lock so a closed store fails before argument checks.
    closed: AtomicBool,
    /// A forked child must not touch a lock another thread of the parent may have held.
    generation: u64,
}

impl<A: Allocator> Handle<A> {
    pub(crate) fn new(core: Store<A>, policy: Option<Py<PyAny>>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(core)),
            has_policy: policy.is_some(),
            policy: Mutex::new(policy),
            in_policy: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            generation: fork_generation(),
        }
    }

    fn lock(&self) -> Result<Held<'_, Store<A>>, StoreError> {
        StoreLock {
            mutex: &self.inner,
            owner: std::ptr::from_ref(self) as usize,
            has_policy: self.has_policy,
            in_policy: &self.in_policy,
        }
        .acquire()
    }

    fn ensure_same_process(&self) -> PyResult<()> {
        if self.generation != fork_generation() {
            return Err(forked_error());
        }
        Ok(())
    }

    pub(crate) fn core(&self) -> PyResult<Arc<Mutex<Store<A>>>> {
        self.ensure_same_process()?;
        Ok(Arc::clone(&self.inner))
    }

    /// Fails on a store made before `fork()` or closed, before any argument is looked at.
    pub(crate) fn ensure_open(&self) -> PyResult<()> {
        self.ensure_same_process()?;
        if self.closed.load(Ordering::Acquire) {
            return Err(to_py_err(StoreError::Closed));
        }
        Ok(())
    }

    /// Runs `f` on the core with the GIL released: the lock is only ever taken without the GIL.
    pub(crate) fn with_store<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Store<A>) -> T + Send,
    ) -> PyResult<T> {
        self.ensure_same_process()?;
        py.detach(|| self.lock().map(|mut held| f(&mut held.guard))).map_err(to_py_err)
    }

    /// Taken with the GIL held, so a put can use it while `__clear__` runs; dropped after the lock.
    pub(crate) fn policy_ref(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        if !self.has_policy {
            return None;
        }
        let policy = self.policy.lock().unwrap_or_else(PoisonError::into_inner);
        policy.as_ref().map(|p| p.clone_ref(py))
    }

    /// `put` and `put_reporting`: `objects` gathered, then put.
    pub(crate) fn put_objects(
        &self,
        py: Python<'_>,
        objects: &Bound<'_, PyAny>,
        (retain_keys, release_keys): References<'_, '_>,
        written: Option<&mut Vec<String>>,
    ) -> PyResult<()> {
        self.ensure_open()?;
        let mut batch = Gathered::default();
        batch.objects(objects)?;
        batch.references(retain_keys, release_keys)?;
        self.put_gathered_reporting(py, &batch, written)
    }

    /// Every put's tail: the store call without the GIL, the policy's own exception, the growth
    /// warning, and with `written` the keys whose payload the put stored.
    pub(crate) fn put_gathered_reporting(
        &self,
        py: Python<'_>,
        batch: &Gathered<'_>,
        written: Option<&mut Vec<String>>,
    ) -> PyResult<()> {
        // SAFETY: `batch` outlives the views, which are dropped at the end of this call.
        let (blocks, retains, releases) = unsafe { batch.views() }.map_err(to_py_err)?;
        let policy_object = self.policy_ref(py);
        let mut policy = policy_object.as_ref().map(|policy| PyPolicy {
            policy,
            active: &self.in_policy,
            error: None,
        });
        let reporting = written.is_some();
        let (result, positions) = self.with_store(py, |s| {
            let policy = policy.as_mut().map(|p| p as &mut dyn VictimPolicy);
            let mut positions = Vec::new();
            let result = match reporting {
                true => s.put_reporting(&blocks, &retains, &releases, policy, &mut positions),
                false => s.put_with_policy(&blocks, &retains, &releases, policy),
            };
            (result.map(|r| A::grown_to(&r)), positions)
        })?;
        if let Some(error) = policy.and_then(|p| p.error) {
            return Err(error);
        }
        if let Some(num_slots) = result.map_err(to_py_err)? {
            log_growth(py, num_slots);
        }
        if let Some(written) = written {
            written.extend(positions.into_iter().map(|i| blocks[i].key.to_owned()));
        }
        Ok(())
    }

    pub(crate) fn close(&self, py: Python<'_>) -> PyResult<()> {
        // Closed for good only once the core has closed (a policy calling back in is refused).
        self.with_store(py, Store::close)?;
        self.closed.store(true, Ordering::Release);
        Ok(())
    }

    pub(crate) fn closed(&self) -> bool {
        // Needs neither the lock nor a GIL release: the façade checks it before every tensor call.
        self.closed.load(Ordering::Acquire)
    }

    pub(crate) fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        // A policy being cleared or read right now is skipped this time, not waited for.
        if let Ok(policy) = self.policy.try_lock() {
            if let Some(policy) = policy.as_ref() {
                visit.call(policy)?;
            }
        }
        Ok(())
    }

    pub(crate) fn clear(&self) {
        let policy = self.policy.lock().unwrap_or_else(PoisonError::into_inner).take();
        // Dropped here, after the lock above is released.
        drop(policy);
    }

    pub(crate) fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.with_store(py, |s| s.check())?.map_err(PyAssertionError::new_err)
    }

    pub(crate) fn contains<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys)?;
        let found = self.with_store(py, |s| s.contains_many(&texts))?.map_err(to_py_err)?;
        PyList::new(py, found)
    }

    pub(crate) fn reference_counts(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        self.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys)?;
        self.with_store(py, |s| texts.iter().map(|key| s.reference_count(key)).collect())
    }

    pub(crate) fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The payloads are copied out under the lock: fallibly, so a snapshot that does not fit
        // in memory raises `MemoryError` instead of aborting the process.
        let (lru, refs, objects) = self
            .with_store(py, |s| -> Result<Contents, StoreError> {
                let listed = s.objects();
                let mut objects = Vec::new();
                objects.try_reserve_exact(listed.len()).map_err(|_| out_of_memory(listed.len()))?;
                for (key, payload) in listed {
                    let mut copy = Vec::new();
                    copy.try_reserve_exact(payload.len())
                        .map_err(|_| out_of_memory(payload.len()))?;
                    copy.extend_from_slice(&payload);
                    objects.push((key.into_owned(), copy));
                }
                Ok((
                    s.lru_keys().into_iter().map(Cow::into_owned).collect(),
                    s.references().into_iter().map(|(k, c)| (k.into_owned(), c)).collect(),
                    objects,
                ))
            })?
            .map_err(to_py_err)?;
        let references = PyDict::new(py);
        for (key, count) in refs {
            references.set_item(key, count)?;
        }
        let payloads = PyDict::new(py);
        for (key, payload) in objects {
            // Each copy is freed once its `bytes` exists; a failed `bytes` is a `MemoryError`.
            // SAFETY: a pointer and length of a live buffer; the result is checked for NULL.
            let bytes = unsafe {
                let made = ffi::PyBytes_FromStringAndSize(
                    payload.as_ptr().cast(),
                    payload.len() as ffi::Py_ssize_t,
                );
                Bound::from_owned_ptr_or_err(py, made)?
            };
            drop(payload);
            payloads.set_item(key, bytes)?;
        }
        let dict = PyDict::new(py);
        dict.set_item("lru", PyList::new(py, lru)?)?;
        dict.set_item("references", references)?;
        dict.set_item("objects", payloads)?;
        Ok(dict)
    }
}

fn out_of_memory(bytes: usize) -> StoreError {
    StoreError::OutOfMemory { what: "snapshot's copy", bytes }
}

/// `stats()`: occupancy, then the counters (`growths` only where the store can grow).
pub(crate) fn stats_dict<'py>(
    py: Python<'py>,
    occupancy: &[(&str, u64)],
    c: &Counters,
    growths: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for &(name, value) in occupancy {
        dict.set_item(name, value)?;
    }
    let head = [
        ("puts", c.puts),
        ("objects_written", c.objects_written),
        ("retains", c.retains),
        ("releases", c.releases),
        ("evictions", c.evictions),
        ("capacity_errors", c.capacity_errors),
    ];
    let tail = [
        ("reads", c.reads),
        ("read_misses", c.read_misses),
        ("bytes_written", c.bytes_written),
        ("bytes_read", c.bytes_read),
        ("eviction_visits", c.eviction_visits),
    ];
    let grown = growths.then_some(("growths", c.growths));
    for (name, value) in head.into_iter().chain(grown).chain(tail) {
        dict.set_item(name, value)?;
    }
    Ok(dict)
}

/// A store class's one `#[pymethods]` block (as pyo3 wants): its `$extra` methods, then the shared ones.
macro_rules! store_methods {
    ($class:ty { $($extra:tt)* }) => {
        #[pymethods]
        impl $class {
            $($extra)*

            /// Stores `objects`, applies `retain_keys` (+1) then `release_keys` (-1), evicting
            /// unreferenced keys as needed. Bad input raises and changes nothing.
            #[pyo3(signature = (objects, *, retain_keys = None, release_keys = None))]
            fn put(
                &self,
                py: Python<'_>,
                objects: &Bound<'_, PyAny>,
                retain_keys: Option<&Bound<'_, PyAny>>,
                release_keys: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<()> {
                self.handle.put_objects(py, objects, (retain_keys, release_keys), None)
            }

            /// `put`, returning the distinct keys whose payload it stored (a new key, or bytes
            /// replaced), in first-occurrence order; nothing is stored when it raises.
            #[pyo3(signature = (objects, *, retain_keys = None, release_keys = None))]
            fn put_reporting(
                &self,
                py: Python<'_>,
                objects: &Bound<'_, PyAny>,
                retain_keys: Option<&Bound<'_, PyAny>>,
                release_keys: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<Vec<String>> {
                let mut written = Vec::new();
                let references = (retain_keys, release_keys);
                self.handle.put_objects(py, objects, references, Some(&mut written))?;
                Ok(written)
            }

            /// The payloads of `keys`, concatenated in order, as `bytes`; a key that is not
            /// stored raises `BlockObjectStoreError` and changes nothing.
            fn get_concatenated<'py>(
                &self,
                py: Python<'py>,
                keys: &Bound<'py, PyAny>,
            ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
                self.handle.ensure_open()?;
                let keys = $crate::python::collect_keys(keys)?;
                self.concatenated(py, &$crate::python::as_texts(&keys)?)
            }

            /// Whether each key is stored, without reading it or touching LRU order.
            fn contains<'py>(
                &self,
                py: Python<'py>,
                keys: &Bound<'py, PyAny>,
            ) -> PyResult<Bound<'py, pyo3::types::PyList>> {
                self.handle.contains(py, keys)
            }

            /// The reference count of each of `keys` (0 for a key the store does not know), in
            /// order, without touching LRU order.
            fn reference_counts(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
                self.handle.reference_counts(py, keys)
            }

            /// Frees the arena; later calls raise `RuntimeError`. Idempotent.
            fn close(&self, py: Python<'_>) -> PyResult<()> {
                self.handle.close(py)
            }

            /// Whether `close()` was called (and finished).
            #[getter]
            fn closed(&self) -> bool {
                self.handle.closed()
            }

            /// The victim policy given to the constructor, or None.
            #[getter]
            fn policy(&self, py: Python<'_>) -> Option<Py<PyAny>> {
                self.handle.policy_ref(py)
            }

            /// Raises `AssertionError` naming the first broken store invariant.
            fn check(&self, py: Python<'_>) -> PyResult<()> {
                self.handle.check(py)
            }

            /// Every key the store knows, without touching LRU order (O(n); for tests and
            /// debugging): `{"lru": [evictable keys, oldest first], "references": {key: count},
            /// "objects": {key: payload bytes}}`.
            fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
                self.handle.snapshot(py)
            }

            fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
                self.handle.traverse(&visit)
            }

            fn __clear__(&self) {
                self.handle.clear();
            }
        }
    };
}

pub(crate) use store_methods;

/// Profile `grow`'s warning via `aostore._log.store_grew`; a logging failure is unraisable, so it
/// never loses a batch or skips a close.
pub(crate) fn log_growth(py: Python<'_>, num_slots: usize) {
    let logged = py
        .import(intern!(py, "aostore._log"))
        .and_then(|log| log.call_method1(intern!(py, "store_grew"), (num_slots,)));
    if let Err(error) = logged {
        error.write_unraisable(py, None);
    }
}
