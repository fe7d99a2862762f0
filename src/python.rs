//! The PyO3 binding: argument conversion, the GIL, and the one mapping from `StoreError` to
//! Python exceptions. No store logic lives here.

use std::sync::{Mutex, MutexGuard};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{
    PyAssertionError, PyKeyError, PyMemoryError, PyOverflowError, PyRuntimeError, PyTypeError,
    PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use pyo3::{ffi, intern};

use crate::error::StoreError;
use crate::store::{BlockRef, BlockStore};

pyo3::create_exception!(
    aostore,
    BlockObjectStoreError,
    PyRuntimeError,
    "Auxiliary-output storage or retrieval failed."
);

fn to_py_err(error: StoreError) -> PyErr {
    let message = error.to_string();
    match error {
        StoreError::Closed => PyRuntimeError::new_err(message),
        StoreError::ObjectSizeNotPositive
        | StoreError::CapacityBelowOneObject
        | StoreError::PayloadSize { .. } => PyValueError::new_err(message),
        StoreError::CapacityTooLarge { .. } => PyOverflowError::new_err(message),
        StoreError::ArenaUnavailable { .. } => PyMemoryError::new_err(message),
        StoreError::NotReferenced { key } => PyKeyError::new_err(key),
        StoreError::CannotRetain { .. } | StoreError::Missing { .. } | StoreError::Policy(_) => {
            BlockObjectStoreError::new_err(message)
        }
    }
}

/// One immutable auxiliary-output object: a key and its payload bytes.
#[pyclass(module = "aostore", frozen, eq, hash, name = "BlockObject")]
pub struct BlockObject {
    #[pyo3(get)]
    key: Py<PyAny>,
    #[pyo3(get)]
    payload: Py<PyAny>,
}

impl PartialEq for BlockObject {
    fn eq(&self, other: &Self) -> bool {
        Python::attach(|py| {
            let a = (self.key.bind(py), self.payload.bind(py));
            let b = (other.key.bind(py), other.payload.bind(py));
            a.0.eq(b.0).unwrap_or(false) && a.1.eq(b.1).unwrap_or(false)
        })
    }
}

impl std::hash::Hash for BlockObject {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Python::attach(|py| {
            let pair = PyTuple::new(py, [self.key.bind(py), self.payload.bind(py)]);
            let hash = pair.and_then(|p| p.hash()).unwrap_or(-1);
            state.write_isize(hash);
        });
    }
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

    fn __getnewargs__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, [self.key.clone_ref(py), self.payload.clone_ref(py)])
    }
}

/// A payload kept alive (and its buffer exported) while the store copies it without the GIL.
enum Payload<'py> {
    Bytes(Bound<'py, PyBytes>),
    Buffer(PyUntypedBuffer),
}

impl Payload<'_> {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Bytes(bytes) => bytes.as_bytes(),
            // SAFETY: the buffer is C-contiguous (checked in `payload`) and stays exported, so
            // its memory stays valid and in place, for as long as `self` lives.
            Self::Buffer(buffer) => unsafe {
                std::slice::from_raw_parts(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes())
            },
        }
    }
}

fn key_text<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
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

fn payload<'py>(key: &Bound<'py, PyAny>, value: Bound<'py, PyAny>) -> PyResult<Payload<'py>> {
    let value = match value.cast_into::<PyBytes>() {
        Ok(bytes) => return Ok(Payload::Bytes(bytes)),
        Err(error) => error.into_inner(),
    };
    let not_a_buffer = || {
        PyTypeError::new_err(format!(
            "payload of auxiliary output object {} must be a C-contiguous buffer, not {}",
            key.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string()),
            type_name(&value)
        ))
    };
    let buffer = PyUntypedBuffer::get(&value).map_err(|_| not_a_buffer())?;
    if !buffer.is_c_contiguous() {
        return Err(not_a_buffer());
    }
    Ok(Payload::Buffer(buffer))
}

/// The key and payload of one object of a batch: our `BlockObject`, or anything with
/// `.key` and `.payload` (vLLM's `BlockObject` among them).
fn block_parts<'py>(object: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, Payload<'py>)> {
    let py = object.py();
    let (key, value) = match object.cast::<BlockObject>() {
        Ok(block) => {
            let block = block.get();
            (block.key.bind(py).clone(), block.payload.bind(py).clone())
        }
        Err(_) => {
            let parts = object
                .getattr(intern!(py, "key"))
                .and_then(|key| Ok((key, object.getattr(intern!(py, "payload"))?)));
            parts.map_err(|_| {
                PyTypeError::new_err(format!(
                    "put() takes objects with .key and .payload, not {}",
                    type_name(object)
                ))
            })?
        }
    };
    key_text(&key)?;
    let payload = payload(&key, value)?;
    Ok((key, payload))
}

fn collect_keys<'py>(keys: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut out = Vec::with_capacity(keys.len().unwrap_or(0));
    for key in keys.try_iter()? {
        let key = key?;
        key_text(&key)?;
        out.push(key);
    }
    Ok(out)
}

fn as_texts<'a>(keys: &'a [Bound<'_, PyAny>]) -> Vec<&'a str> {
    // key_text already succeeded for every key in `collect_keys`.
    keys.iter().map(|k| key_text(k).expect("validated key")).collect()
}

/// The native store: a `BlockStore` behind a mutex, so one store can be shared by threads.
///
/// The mutex is only ever taken with the GIL released, so a thread holding it can always get
/// the GIL back and no two threads wait on each other.
#[pyclass(module = "aostore._native", subclass, frozen, name = "NativeStore")]
pub struct NativeStore {
    inner: Mutex<BlockStore>,
}

impl NativeStore {
    fn lock(&self) -> MutexGuard<'_, BlockStore> {
        // A panic inside the core is a bug; the store's state is still memory-safe to use, and
        // `check()` tells whether it is consistent.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn with_store<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut BlockStore) -> T + Send,
    ) -> T {
        py.detach(|| f(&mut self.lock()))
    }
}

#[pymethods]
impl NativeStore {
    #[new]
    #[pyo3(signature = (*args, max_bytes, object_nbytes, policy = None, profile = "fail-closed", **kwargs))]
    fn new(
        args: &Bound<'_, PyTuple>,
        max_bytes: &Bound<'_, PyAny>,
        object_nbytes: &Bound<'_, PyAny>,
        policy: Option<&Bound<'_, PyAny>>,
        profile: &str,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        // Subclasses may add constructor keywords of their own; they are theirs to use.
        let _ = (args, kwargs);
        let object_nbytes = size_arg(object_nbytes, "object_nbytes")?;
        let max_bytes = size_arg(max_bytes, "max_bytes")?;
        if object_nbytes <= 0 {
            return Err(to_py_err(StoreError::ObjectSizeNotPositive));
        }
        if max_bytes < object_nbytes {
            return Err(to_py_err(StoreError::CapacityBelowOneObject));
        }
        if profile != "fail-closed" {
            return Err(PyValueError::new_err(format!(
                "unknown profile {profile:?}; this build supports \"fail-closed\""
            )));
        }
        if policy.is_some_and(|p| !p.is_none()) {
            return Err(PyValueError::new_err(
                "victim policies are not supported by this build; pass policy=None",
            ));
        }
        let to_usize = |v: i128| usize::try_from(v).map_err(|_| too_large(v));
        let store = BlockStore::new(to_usize(max_bytes)?, to_usize(object_nbytes)?)
            .map_err(to_py_err)?;
        Ok(Self { inner: Mutex::new(store) })
    }

    /// Bytes per object.
    #[getter]
    fn object_nbytes(&self, py: Python<'_>) -> usize {
        self.with_store(py, |s| s.object_nbytes())
    }

    /// Objects the store holds at most.
    #[getter]
    fn num_slots(&self, py: Python<'_>) -> usize {
        self.with_store(py, |s| s.num_slots())
    }

    /// Stores `objects` (each with `.key` and a payload of exactly `object_nbytes` bytes) and
    /// applies `retain_keys` (+1 each), then `release_keys` (-1 each), evicting unreferenced
    /// keys as needed. Bad input raises and changes nothing.
    #[pyo3(signature = (objects, *, retain_keys = None, release_keys = None))]
    fn put(
        &self,
        py: Python<'_>,
        objects: &Bound<'_, PyAny>,
        retain_keys: Option<&Bound<'_, PyAny>>,
        release_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut parts = Vec::with_capacity(objects.len().unwrap_or(0));
        for object in objects.try_iter()? {
            parts.push(block_parts(&object?)?);
        }
        let retains = retain_keys.map(collect_keys).transpose()?.unwrap_or_default();
        let releases = release_keys.map(collect_keys).transpose()?.unwrap_or_default();
        let blocks: Vec<BlockRef<'_>> = parts
            .iter()
            .map(|(key, payload)| BlockRef {
                key: key_text(key).expect("validated key"),
                payload: payload.as_slice(),
            })
            .collect();
        let retains = as_texts(&retains);
        let releases = as_texts(&releases);
        self.with_store(py, |s| s.put(&blocks, &retains, &releases)).map_err(to_py_err)
    }

    /// The payloads of `keys`, concatenated in order, as `bytes`; a key that is not stored
    /// raises `BlockObjectStoreError` and changes nothing.
    fn get_concatenated<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let keys = collect_keys(keys)?;
        let texts = as_texts(&keys);
        let object_nbytes = self.object_nbytes(py);
        let len = texts
            .len()
            .checked_mul(object_nbytes)
            .ok_or_else(|| PyOverflowError::new_err("read too large"))?;
        let bytes = new_uninit_bytes(py, len)?;
        let ptr = bytes_ptr(&bytes) as usize;
        self.with_store(py, |s| {
            // SAFETY: `bytes` is a fresh object of `len` bytes that no one else can see yet; we
            // hold it for the duration of the call.
            let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
            if s.object_nbytes() != object_nbytes {
                return Err(StoreError::Closed);
            }
            s.get_into(&texts, out)
        })
        .map_err(to_py_err)?;
        Ok(bytes)
    }

    /// Frees the arena; later calls raise `RuntimeError`. Idempotent.
    fn close(&self, py: Python<'_>) {
        self.with_store(py, BlockStore::close);
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        self.with_store(py, |s| s.is_closed())
    }

    /// Raises `AssertionError` naming the first broken store invariant.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.with_store(py, |s| s.check()).map_err(PyAssertionError::new_err)
    }

    /// Occupancy and counters as a dict of ints.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.with_store(py, |s| s.stats());
        let c = stats.counters;
        let dict = PyDict::new(py);
        for (name, value) in [
            ("capacity", stats.capacity as u64),
            ("object_nbytes", stats.object_nbytes as u64),
            ("stored", stats.stored as u64),
            ("referenced", stats.referenced as u64),
            ("evictable", stats.evictable as u64),
            ("free_slots", stats.free_slots as u64),
            ("puts", c.puts),
            ("objects_written", c.objects_written),
            ("retains", c.retains),
            ("releases", c.releases),
            ("evictions", c.evictions),
            ("capacity_errors", c.capacity_errors),
            ("growths", c.growths),
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

    /// Every key the store knows, without touching LRU order (O(n); for tests and debugging):
    /// `{"lru": [evictable keys, oldest first], "references": {key: count},
    /// "objects": {key: payload bytes}}`.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        type Contents = (Vec<String>, Vec<(String, u32)>, Vec<(String, Vec<u8>)>);
        let (lru, refs, objects): Contents = self.with_store(py, |s| {
            (
                s.lru_keys().into_iter().map(str::to_owned).collect(),
                s.references().into_iter().map(|(k, c)| (k.to_owned(), c)).collect(),
                s.objects().into_iter().map(|(k, p)| (k.to_owned(), p.to_vec())).collect(),
            )
        });
        let dict = PyDict::new(py);
        let lru = PyList::new(py, lru)?;
        let references = PyDict::new(py);
        for (key, count) in refs {
            references.set_item(key, count)?;
        }
        let payloads = PyDict::new(py);
        for (key, payload) in objects {
            payloads.set_item(key, PyBytes::new(py, &payload))?;
        }
        let objects = payloads;
        dict.set_item("lru", lru)?;
        dict.set_item("references", references)?;
        dict.set_item("objects", objects)?;
        Ok(dict)
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
    let len = ffi::Py_ssize_t::try_from(len).map_err(|_| PyOverflowError::new_err("read too large"))?;
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

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeStore>()?;
    m.add_class::<BlockObject>()?;
    m.add("BlockObjectStoreError", m.py().get_type::<BlockObjectStoreError>())?;
    Ok(())
}
