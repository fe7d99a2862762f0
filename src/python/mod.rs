//! The PyO3 binding: argument conversion, the GIL, and the one mapping from `StoreError` to
//! Python exceptions. No store logic lives here.

mod gather;
mod handle;
mod lock;
mod variable;
mod writer;

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, Once, PoisonError};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{
    PyKeyError, PyMemoryError, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use pyo3::{ffi, intern, PyTraverseError};

use crate::arena::Prefault;
use crate::error::StoreError;
use crate::store::{BlockStore, FixedSlots, Profile, RemoveReason, StoreOptions, VictimPolicy};
use gather::Gathered;
use handle::Handle;

pyo3::create_exception!(
    aostore,
    BlockObjectStoreError,
    PyRuntimeError,
    "Auxiliary-output storage or retrieval failed."
);

pyo3::create_exception!(
    aostore,
    ObjectMissingError,
    BlockObjectStoreError,
    "A requested auxiliary-output object is not stored (never put, or evicted)."
);

pub(crate) fn to_py_err(error: StoreError) -> PyErr {
    let message = error.to_string();
    match error {
        StoreError::Closed => PyRuntimeError::new_err(message),
        StoreError::ObjectSizeNotPositive
        | StoreError::CapacityBelowOneObject
        | StoreError::PayloadSize { .. }
        | StoreError::InvalidArgument(_) => PyValueError::new_err(message),
        StoreError::CapacityTooLarge { .. } | StoreError::ReferenceOverflow { .. } => {
            PyOverflowError::new_err(message)
        }
        StoreError::ArenaUnavailable { .. } | StoreError::OutOfMemory { .. } => {
            PyMemoryError::new_err(message)
        }
        StoreError::NotReferenced { key } => PyKeyError::new_err(key),
        StoreError::Missing { .. } | StoreError::MissingObject { .. } => {
            ObjectMissingError::new_err(message)
        }
        StoreError::CannotRetain { .. }
        | StoreError::Policy(_)
        | StoreError::CannotRetainBytes { .. } => BlockObjectStoreError::new_err(message),
    }
}

/// One immutable auxiliary-output object: a key and its payload bytes.
#[pyclass(module = "aostore", frozen, name = "BlockObject")]
pub struct BlockObject {
    #[pyo3(get)]
    key: Py<PyAny>,
    #[pyo3(get)]
    payload: Py<PyAny>,
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

    /// `hash((key, payload))`: raises `TypeError` for an unhashable payload (a bytearray), as
    /// a frozen dataclass does.
    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        PyTuple::new(py, [self.key.bind(py), self.payload.bind(py)])?.hash()
    }

    fn __getnewargs__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, [self.key.clone_ref(py), self.payload.clone_ref(py)])
    }

    // The fields never change, so a cycle through a `BlockObject` is broken by clearing one of
    // the other (mutable) objects in it; the collector only needs to see these edges.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.key)?;
        visit.call(&self.payload)
    }
}

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

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// Whether a buffer holds Python object references (numpy `dtype=object`, format "O"): copying
/// those as bytes would store pointers, and writing into them would corrupt the interpreter.
pub(crate) fn holds_objects(buffer: &PyUntypedBuffer) -> bool {
    format_holds_objects(buffer.format().to_bytes())
}

/// Whether a `struct`-module format string (PEP 3118) has an `O` item. Field names, written
/// between colons (`T{B:Open:}` for numpy's `[('Open', 'u1')]`), are not items.
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

/// A capacity hint from `len()`. A list's or tuple's (exactly those types) is its item count, so
/// a call of thousands of keys (W3's first puts) reserves once instead of growing by copies;
/// anything else's is capped: a lying `__len__` must not allocate (or overflow).
pub(crate) fn size_hint(value: &Bound<'_, PyAny>) -> usize {
    let len = value.len().unwrap_or(0);
    if value.is_exact_instance_of::<PyList>() || value.is_exact_instance_of::<PyTuple>() {
        len
    } else {
        len.min(4_096)
    }
}

/// Room for `additional` more items, or `MemoryError`: a call too large for the memory left is
/// refused before it changes anything, not an abort of the process.
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

/// The native fixed-size store: a `BlockStore` behind the handle both stores share.
#[pyclass(module = "aostore._native", subclass, frozen, name = "NativeStore")]
pub struct NativeStore {
    pub(crate) handle: Handle<FixedSlots>,
    /// Fixed at construction, so size checks need neither the lock nor a GIL release.
    object_nbytes: usize,
}

static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);
static AT_FORK: Once = Once::new();

extern "C" fn after_fork_in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
    writer::forget_scheduling_threads();
}

/// Bumped in a child process after each `fork()`: objects created before it refuse to work.
pub(crate) fn fork_generation() -> u64 {
    FORK_GENERATION.load(Ordering::Relaxed)
}

fn forked_error() -> PyErr {
    PyRuntimeError::new_err(
        "this aostore store was created in the parent process before fork(); its lock and \
         threads are not usable here: create a new store in the child",
    )
}

/// vLLM's `ExpertCachePolicy`, called from the core with the GIL re-acquired. The first Python
/// exception is kept so the put raises it as it was.
struct PyPolicy<'a> {
    policy: &'a Py<PyAny>,
    /// The store's `in_policy` flag, set around each callback.
    active: &'a AtomicBool,
    error: Option<PyErr>,
}

impl PyPolicy<'_> {
    fn keep(&mut self, error: PyErr) -> String {
        let message = error.to_string();
        self.error.get_or_insert(error);
        message
    }

    /// `select_victims(candidates, count)` with a lazy Python iterator over the core's walk of
    /// eligible keys (either store's), valid only during the call. Shared by both stores.
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
            // The selection is read while the walk is still valid, so a lazy one (a generator
            // over the candidates) works.
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

/// A policy's answer to `select_victims`: `None` stays `None`; anything but an iterable of
/// `str` is an invalid selection, given to the core as an empty one, which it refuses. An
/// exception raised while iterating the selection is the policy's own and propagates as it is:
/// reporting it as a capacity error would hide the policy's bug.
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

/// Whether `object`'s type defines `__iter__` (or the old `__getitem__` protocol): a TypeError
/// from `iter()` then comes from the policy's own code.
fn has_iter(object: &Bound<'_, PyAny>) -> bool {
    let kind = object.get_type();
    kind.hasattr(intern!(object.py(), "__iter__")).unwrap_or(false)
        || kind.hasattr(intern!(object.py(), "__getitem__")).unwrap_or(false)
}

/// A raw pointer to the core's candidate walk, valid only during `select_victims`.
struct CandidateWalk(*mut (dyn Iterator<Item = Cow<'static, str>> + 'static));

// SAFETY: the walk is dereferenced only under the `CandidateKeys` mutex (one thread at a time,
// whichever thread the policy handed the iterator to) and only while `select_victims` runs,
// during which the core waits for the policy and does not touch the walk; the pointer is
// cleared under the same mutex before `select_victims` returns.
unsafe impl Send for CandidateWalk {}

/// The lazy iterable of eligible keys given to `select_victims`, oldest first.
#[pyclass(module = "aostore._native", frozen, name = "VictimCandidates")]
struct CandidateKeys {
    walk: Mutex<Option<CandidateWalk>>,
}

#[pymethods]
impl CandidateKeys {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyString>>> {
        // The key is copied out under the lock and becomes a Python string after it: creating
        // a Python object may run the collector, and so any Python code.
        let key: Option<String> = {
            let mut walk = self.walk.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(CandidateWalk(pointer)) = walk.as_mut() else {
                return Err(PyRuntimeError::new_err(
                    "victim candidates are only valid during select_victims()",
                ));
            };
            // SAFETY: see `CandidateWalk`: set only while `select_victims` runs, and read under
            // this mutex.
            let candidates = unsafe { &mut **pointer };
            candidates.next().map(Cow::into_owned)
        };
        Ok(key.map(|key| PyString::new(py, &key)))
    }
}

handle::store_methods!(NativeStore {
    #[new]
    #[pyo3(signature = (*, max_bytes, object_nbytes, policy = None, profile = "fail-closed", prefault = PrefaultArg(Prefault::OnWrite)))]
    fn new(
        max_bytes: &Bound<'_, PyAny>,
        object_nbytes: &Bound<'_, PyAny>,
        policy: Option<&Bound<'_, PyAny>>,
        profile: &str,
        prefault: PrefaultArg,
    ) -> PyResult<Self> {
        let prefault = prefault.0;
        let object_nbytes = size_arg(object_nbytes, "object_nbytes")?;
        let max_bytes = size_arg(max_bytes, "max_bytes")?;
        if object_nbytes <= 0 {
            return Err(to_py_err(StoreError::ObjectSizeNotPositive));
        }
        if max_bytes < object_nbytes {
            return Err(to_py_err(StoreError::CapacityBelowOneObject));
        }
        let profile = match profile {
            "fail-closed" => Profile::FailClosed,
            "grow" => Profile::Grow,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown profile {other:?}; expected \"fail-closed\" or \"grow\""
                )))
            }
        };
        let policy = policy.filter(|p| !p.is_none()).map(|p| p.clone().unbind());
        let to_usize = |v: i128| usize::try_from(v).map_err(|_| too_large(v));
        let options = StoreOptions::default().profile(profile).prefault(prefault);
        let store = BlockStore::with_options(to_usize(max_bytes)?, to_usize(object_nbytes)?, options)
            .map_err(to_py_err)?;
        let object_nbytes = store.object_nbytes();
        Ok(Self { handle: Handle::new(store, policy), object_nbytes })
    }

    /// Bytes per object.
    #[getter]
    fn object_nbytes(&self) -> usize {
        self.object_nbytes
    }

    /// Objects the store holds at most.
    #[getter]
    fn num_slots(&self, py: Python<'_>) -> PyResult<usize> {
        self.handle.with_store(py, |s| s.num_slots())
    }

    /// Stores `blocks[i]` under `keys[i]` from one C-contiguous buffer of
    /// `len(keys) * object_nbytes` bytes, with `put`'s semantics: one copy per block, straight
    /// into its slot.
    #[pyo3(signature = (keys, blocks, *, retain_keys = None, release_keys = None))]
    fn put_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        retain_keys: Option<&Bound<'_, PyAny>>,
        release_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.handle.ensure_open()?;
        let object_nbytes = self.object_nbytes;
        let mut batch = Gathered::default();
        batch.rows_of(keys, blocks, object_nbytes)?;
        batch.references(retain_keys, release_keys)?;
        self.handle.put_gathered(py, &batch)
    }

    /// Writes the payloads of `keys`, concatenated, into `out`: a writable C-contiguous buffer
    /// of exactly `len(keys) * object_nbytes` bytes. Returns `out`.
    fn get_into<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        out: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.handle.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys)?;
        let object_nbytes = self.object_nbytes;
        let buffer = PyUntypedBuffer::get(&out)
            .or_else(|_| gather::flat_view(&out).and_then(|view| PyUntypedBuffer::get(&view)))
            .map_err(|_| {
                PyTypeError::new_err(format!(
                    "out must be a writable C-contiguous buffer, not {}",
                    type_name(&out)
                ))
            })?;
        if buffer.readonly() || !buffer.is_c_contiguous() || holds_objects(&buffer) {
            return Err(PyTypeError::new_err(
                "out must be a writable C-contiguous buffer of plain bytes (not objects)",
            ));
        }
        let len = buffer.len_bytes();
        let needed = texts.len().checked_mul(object_nbytes);
        if needed != Some(len) {
            return Err(PyValueError::new_err(format!(
                "out holds {len} bytes; {} keys of object_nbytes={object_nbytes} need more",
                texts.len(),
            )));
        }
        let ptr = buffer.buf_ptr() as usize;
        self.handle.with_store(py, |s| {
            // SAFETY: the buffer is writable, C-contiguous, `len` bytes long and stays exported
            // (so in place) until `buffer` drops after this call.
            let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
            s.get_into(&texts, out)
        })?
        .map_err(to_py_err)?;
        drop(buffer);
        Ok(out)
    }

    /// Start address and length in bytes of the arena, for registering it with a driver
    /// (`cudaHostRegister`). Valid until `close()` or a growth.
    fn arena_span(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.handle.with_store(py, |s| s.arena_span())?.ok_or_else(|| to_py_err(StoreError::Closed))
    }

    /// "fail-closed" or "grow".
    #[getter]
    fn profile(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.handle.with_store(py, |s| match s.profile() {
            Profile::FailClosed => "fail-closed",
            Profile::Grow => "grow",
        })
    }


    /// Reads what is stored and reports what is not, in one call: `(data, missing)`, where
    /// `data` holds the payloads of the stored keys in order (`object_nbytes` each) and
    /// `missing` the keys that are not stored, once per occurrence, in order. Keys read move to
    /// the LRU tail as a successful read does; missing ones touch nothing.
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>)> {
        self.handle.ensure_open()?;
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys)?;
        let len = texts
            .len()
            .checked_mul(self.object_nbytes)
            .ok_or_else(|| PyOverflowError::new_err("read too large"))?;
        // Sized for a full hit, the common case: one copy. A miss copies the shorter prefix.
        let bytes = new_uninit_bytes(py, len)?;
        let ptr = bytes_ptr(&bytes) as usize;
        let (written, missing) = self
            .handle
            .with_store(py, |s| {
                // SAFETY: for `len > 0`, `bytes` is a new object of `len` bytes that no one else
                // can see yet, held for the duration of the call; for `len == 0` CPython returns
                // its shared empty bytes object, and the empty slice writes nothing.
                let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                let mut missing = Vec::new();
                s.get_many_into(&texts, out, &mut missing).map(|written| (written, missing))
            })?
            .map_err(to_py_err)?;
        let data =
            if written == len { bytes } else { PyBytes::new(py, &bytes.as_bytes()[..written]) };
        Ok((data, PyList::new(py, missing.iter().map(|&i| &keys[i]))?))
    }

    /// Occupancy and counters as a dict of ints.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.handle.with_store(py, |s| s.stats())?;
        let occupancy = [
            ("capacity", stats.capacity as u64),
            ("object_nbytes", stats.object_nbytes as u64),
            ("stored", stats.stored as u64),
            ("referenced", stats.referenced as u64),
            ("evictable", stats.evictable as u64),
            ("free_slots", stats.free_slots as u64),
        ];
        handle::stats_dict(py, &occupancy, &stats.counters, true)
    }

});

impl NativeStore {
    /// `get_concatenated` after its checks: one copy per key, straight into the new `bytes`.
    fn concatenated<'py>(&self, py: Python<'py>, texts: &[&str]) -> PyResult<Bound<'py, PyBytes>> {
        let object_nbytes = self.object_nbytes;
        let len = texts
            .len()
            .checked_mul(object_nbytes)
            .ok_or_else(|| PyOverflowError::new_err("read too large"))?;
        let bytes = new_uninit_bytes(py, len)?;
        let ptr = bytes_ptr(&bytes) as usize;
        self.handle
            .with_store(py, |s| {
                // SAFETY: for `len > 0`, `bytes` is a new object of `len` bytes that no one else can
                // see yet, held for the duration of the call; for `len == 0` it may be the shared
                // empty bytes object, and nothing is written.
                let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                s.get_into(texts, out)
            })?
            .map_err(to_py_err)?;
        Ok(bytes)
    }
}

/// `prefault=` as both constructors take it: omitted means `False`, and anything but `True`,
/// `False` or `"background"` (`None` included) is a `ValueError`, checked here once.
pub(crate) struct PrefaultArg(pub(crate) Prefault);

impl<'a, 'py> FromPyObject<'a, 'py> for PrefaultArg {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        prefault_arg(&obj).map(PrefaultArg)
    }
}

/// `prefault=`: `False` (pages committed on first write), `True` (all now), or `"background"`
/// (all, by a thread, without making the constructor wait).
fn prefault_arg(value: &Bound<'_, PyAny>) -> PyResult<Prefault> {
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

fn size_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
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

fn too_large(value: i128) -> PyErr {
    PyOverflowError::new_err(format!("auxiliary output store size {value} is too large"))
}

fn new_uninit_bytes(py: Python<'_>, len: usize) -> PyResult<Bound<'_, PyBytes>> {
    let len =
        ffi::Py_ssize_t::try_from(len).map_err(|_| PyOverflowError::new_err("read too large"))?;
    // SAFETY: a NULL source asks CPython for an uninitialised bytes object of `len` bytes, which
    // the caller fills completely before anyone else sees it.
    let raw = unsafe { ffi::PyBytes_FromStringAndSize(std::ptr::null(), len) };
    // SAFETY: `raw` is a new reference or NULL with an exception set.
    let any = unsafe { Bound::from_owned_ptr_or_err(py, raw)? };
    Ok(any.cast_into::<PyBytes>().expect("PyBytes_FromStringAndSize returns bytes"))
}

fn bytes_ptr(bytes: &Bound<'_, PyBytes>) -> *mut u8 {
    // SAFETY: `bytes` is a live bytes object; its storage is inline and never moves.
    unsafe { ffi::PyBytes_AsString(bytes.as_ptr()).cast::<u8>() }
}

/// The growth warning of profile `grow`, through `aostore._log.store_grew` (which also reaches
/// vLLM's store logger when the plugin asks). Logging must never lose a batch or skip a close,
/// so a failure here is reported as unraisable, never raised.
pub(crate) fn log_growth(py: Python<'_>, num_slots: usize) {
    let logged = py
        .import(intern!(py, "aostore._log"))
        .and_then(|log| log.call_method1(intern!(py, "store_grew"), (num_slots,)));
    if let Err(error) = logged {
        error.write_unraisable(py, None);
    }
}

/// The module's state is process-wide (its classes, the fork generation, the exit hook that
/// stops writer threads from scheduling calls), and `Py_AddPendingCall` always reaches the
/// main interpreter: loaded in a subinterpreter, ending that interpreter would stop payload
/// release for the whole process. So it loads in the main interpreter (id 0) only.
fn refuse_subinterpreters() -> PyResult<()> {
    // SAFETY: called during import, with the GIL held and a current interpreter.
    let id = unsafe { ffi::PyInterpreterState_GetID(ffi::PyInterpreterState_Get()) };
    if id == 0 {
        return Ok(());
    }
    Err(pyo3::exceptions::PyImportError::new_err(format!(
        "aostore cannot be imported in a subinterpreter (interpreter {id}); import it in the \
         main interpreter"
    )))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    refuse_subinterpreters()?;
    AT_FORK.call_once(|| {
        // SAFETY: registers a handler that only writes atomics, which is async-signal-safe as
        // a child-after-fork handler must be.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
    // Before finalization tears the interpreter down, writer threads stop calling into it.
    let exiting = wrap_pyfunction!(writer::interpreter_exiting, m)?;
    m.py()
        .import(intern!(m.py(), "atexit"))?
        .call_method1(intern!(m.py(), "register"), (exiting,))?;
    m.add_class::<NativeStore>()?;
    m.add_class::<BlockObject>()?;
    m.add_class::<CandidateKeys>()?;
    m.add_class::<writer::NativeWriter>()?;
    m.add("BlockObjectStoreError", m.py().get_type::<BlockObjectStoreError>())?;
    m.add("ObjectMissingError", m.py().get_type::<ObjectMissingError>())?;
    variable::register(m)?;
    Ok(())
}
