//! `NativeStore`: the fixed-size store's Python class.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::*;
use crate::arena::Prefault;
use crate::error::StoreError;
use crate::store::{BlockStore, FixedSlots, Profile, StoreOptions};
use gather::Gathered;
use handle::Handle;

/// The native fixed-size store: a `BlockStore` behind the handle both stores share.
#[pyclass(module = "aostore._native", subclass, frozen, name = "NativeStore")]
pub struct NativeStore {
    pub(crate) handle: Handle<FixedSlots>,
    /// Fixed at construction, so size checks need neither the lock nor a GIL release.
    object_nbytes: usize,
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
    pub(crate) fn object_nbytes(&self) -> usize {
        self.object_nbytes
    }

    /// Objects the store holds at most.
    #[getter]
    fn num_slots(&self, py: Python<'_>) -> PyResult<usize> {
        self.handle.with_store(py, |s| s.num_slots())
    }

    /// Stores `blocks[i]` under `keys[i]` from one C-contiguous buffer of `len(keys) *
    /// object_nbytes` bytes, with `put`'s semantics, one copy per block straight into its slot.
    /// With `report` (the façade's `put_blocks_reporting`), returns the distinct keys whose
    /// payload it stored, as `put_reporting`; else `None`.
    #[pyo3(signature = (keys, blocks, *, retain_keys = None, release_keys = None, report = false))]
    fn put_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        retain_keys: Option<&Bound<'_, PyAny>>,
        release_keys: Option<&Bound<'_, PyAny>>,
        report: bool,
    ) -> PyResult<Option<Vec<String>>> {
        self.handle.ensure_open()?;
        let mut batch = Gathered::default();
        batch.rows_of(keys, blocks, self.object_nbytes)?;
        batch.references(retain_keys, release_keys)?;
        let mut written = report.then(Vec::new);
        self.handle.put_gathered_reporting(py, &batch, written.as_mut())?;
        Ok(written)
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
            // SAFETY: writable, C-contiguous, `len` bytes, exported until `buffer` drops.
            let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
            s.get_into(&texts, out)
        })?
        .map_err(to_py_err)?;
        drop(buffer);
        Ok(out)
    }

    /// Start and length of the arena, for `cudaHostRegister`; valid until `close()` or a growth.
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


    /// Reads what is stored and reports what is not: `(data, missing)`, the stored keys' payloads
    /// in order and the missing keys in order. Only keys read move in the LRU.
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
                // SAFETY: for `len > 0` a new object of `len` bytes no one else sees, held for the
                // call; for `len == 0` CPython's shared empty bytes, and nothing is written.
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
                // SAFETY: for `len > 0` a new object of `len` bytes no one else sees, held for the
                // call; for `len == 0` CPython's shared empty bytes, and nothing is written.
                let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                s.get_into(texts, out)
            })?
            .map_err(to_py_err)?;
        Ok(bytes)
    }
}
