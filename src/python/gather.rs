//! Batch arguments as raw byte views taken with the GIL, owners kept, read without it.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyAttributeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple, PyTupleMethods};
use pyo3::PyTypeInfo;
use pyo3::{ffi, intern};

use super::{holds_objects, key_text, reserve, size_hint, type_name, BlockObject};
use crate::error::StoreError;
use crate::store::BlockRef;
use crate::writer::{reserved, BatchViews};

/// Bytes owned by a Python object that the same batch keeps alive.
#[derive(Clone, Copy)]
pub(crate) struct RawBytes {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

// SAFETY: the bytes belong to owners the batch keeps alive (an export also stops a resize), and
// are only read; a concurrent writer races as a `memcpy` of shared memory would.
unsafe impl Send for RawBytes {}

impl RawBytes {
    pub(crate) fn of(bytes: &[u8]) -> Self {
        Self { ptr: bytes.as_ptr(), len: bytes.len() }
    }

    /// # Safety
    /// The owner recorded with these bytes must still be alive.
    pub(crate) unsafe fn get<'a>(self) -> &'a [u8] {
        // SAFETY: the contract above: the memory is live and not written.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// As `get`; the bytes came from a `&str`.
    pub(crate) unsafe fn text<'a>(self) -> &'a str {
        // SAFETY: as `get`, and the bytes were valid UTF-8 when recorded.
        unsafe { std::str::from_utf8_unchecked(self.get()) }
    }
}

/// The owners of a batch's bytes and the views into them.
#[derive(Default)]
pub(crate) struct Gathered<'py> {
    /// Unbound, so a batch handed to the writer moves them whole.
    objects: Vec<Py<PyAny>>,
    buffers: Vec<PyUntypedBuffer>,
    /// (key, payload) per object, in call order.
    pub(crate) blocks: Vec<(RawBytes, RawBytes)>,
    pub(crate) retains: Vec<RawBytes>,
    pub(crate) releases: Vec<RawBytes>,
    /// Made and dropped with the GIL held, as its owners need.
    gil: std::marker::PhantomData<Python<'py>>,
}

/// `memoryview(value).cast("B")`: the same bytes as a 1-d buffer (C-contiguous input only).
pub(crate) fn flat_view<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = value.py();
    let view = py.import("builtins")?.getattr("memoryview")?.call1((value,))?;
    view.call_method1("cast", ("B",))
}

/// Calls `f` with each item of `sequence`. A list or tuple is read by index, making no Python
/// object (so no GC or finalizer runs mid-put), its length re-read each item as `f` may change
/// it; any other iterable is iterated.
fn for_each_item<'py>(
    sequence: &Bound<'py, PyAny>,
    mut f: impl FnMut(Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    let py = sequence.py();
    if let Ok(list) = sequence.cast_exact::<PyList>() {
        let mut i = 0;
        while i < list.len() {
            // SAFETY: `i` is below the length, GIL held; the item is owned before code runs.
            f(unsafe {
                Bound::from_borrowed_ptr(
                    py,
                    ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t),
                )
            })?;
            i += 1;
        }
        return Ok(());
    }
    if let Ok(tuple) = sequence.cast_exact::<PyTuple>() {
        for item in tuple.iter_borrowed() {
            f(item.to_owned())?;
        }
        return Ok(());
    }
    for item in sequence.try_iter()? {
        f(item?)?;
    }
    Ok(())
}

/// Whether `object`'s type is exactly `kind` (a pointer comparison).
fn is_exactly(object: &Bound<'_, PyAny>, kind: *mut ffi::PyTypeObject) -> bool {
    // SAFETY: a live object; its type pointer is part of the stable ABI's object header.
    unsafe { ffi::Py_TYPE(object.as_ptr()) == kind }
}

/// A batch's owners, moved out whole for the writer thread; dropping them needs the GIL.
#[derive(Default)]
pub(crate) struct Owners {
    pub(crate) objects: Vec<Py<PyAny>>,
    /// Held only so the exports stay alive and in place.
    buffers: Vec<PyUntypedBuffer>,
}

impl Owners {
    /// Whether dropping these needs the GIL (a Python object or buffer export among them).
    pub(crate) fn hold_python(&self) -> bool {
        !self.objects.is_empty() || !self.buffers.is_empty()
    }
}

impl<'py> Gathered<'py> {
    /// Records the objects of a `put`: our `BlockObject` (recognized by type pointer, the class is
    /// final, so a list of them makes no Python object) or anything with `.key`/`.payload`.
    pub(crate) fn objects(&mut self, objects: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = objects.py();
        let block_type = BlockObject::type_object_raw(py);
        let hint = size_hint(objects);
        reserve(&mut self.blocks, hint)?;
        reserve(&mut self.objects, hint)?;
        for_each_item(objects, |item| {
            let block = if is_exactly(&item, block_type) {
                // SAFETY: its type is exactly `BlockObject`, a final class.
                let block = unsafe { item.cast_unchecked::<BlockObject>() }.get();
                let key = self.key(block.key.bind(py))?;
                (key, self.payload(block.key.bind(py), block.payload.bind(py))?)
            } else {
                self.duck_typed(&item)?
            };
            self.objects.push(item.unbind());
            self.blocks.push(block);
            Ok(())
        })
    }

    /// Key and payload through `.key` and `.payload`; what they return is kept with the batch.
    fn duck_typed(&mut self, item: &Bound<'py, PyAny>) -> PyResult<(RawBytes, RawBytes)> {
        let py = item.py();
        let parts = item
            .getattr(intern!(py, "key"))
            .and_then(|key| Ok((key, item.getattr(intern!(py, "payload"))?)));
        let (key_object, payload_object) = parts.map_err(|error| {
            // A missing attribute is a wrong type; the object's own errors propagate as they were.
            if !error.is_instance_of::<PyAttributeError>(py) {
                return error;
            }
            let wrong = PyTypeError::new_err(format!(
                "put() takes objects with .key and .payload, not {}",
                type_name(item)
            ));
            wrong.set_cause(py, Some(error));
            wrong
        })?;
        let key = self.key(&key_object)?;
        let payload = self.payload(&key_object, &payload_object)?;
        self.objects.push(key_object.unbind());
        self.objects.push(payload_object.unbind());
        Ok((key, payload))
    }

    /// Records one C-contiguous buffer of `count * object_nbytes` bytes as `count` payloads.
    fn rows(&mut self, keys: &[RawBytes], data: RawBytes, object_nbytes: usize) {
        self.blocks.extend(keys.iter().enumerate().map(|(i, &key)| {
            // SAFETY: the caller checked that `data` holds keys.len() * object_nbytes bytes.
            let ptr = unsafe { data.ptr.add(i * object_nbytes) };
            (key, RawBytes { ptr, len: object_nbytes })
        }));
    }

    /// Records `retain_keys` and `release_keys` (each an iterable of `str`, or `None`).
    pub(crate) fn references(
        &mut self,
        retain_keys: Option<&Bound<'py, PyAny>>,
        release_keys: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        if let Some(keys) = retain_keys {
            self.retains = self.keys(keys)?;
        }
        if let Some(keys) = release_keys {
            self.releases = self.keys(keys)?;
        }
        Ok(())
    }

    /// Records `put_blocks`' `keys` and its one buffer of `len(keys) * object_nbytes` bytes.
    pub(crate) fn rows_of(
        &mut self,
        keys: &Bound<'py, PyAny>,
        blocks: &Bound<'py, PyAny>,
        object_nbytes: usize,
    ) -> PyResult<()> {
        let keys = self.keys(keys)?;
        let data = self.blocks(blocks, keys.len(), object_nbytes)?;
        self.keep(blocks.clone());
        if keys.len().checked_mul(object_nbytes) != Some(data.len) {
            return Err(PyValueError::new_err(format!(
                "blocks hold {} bytes; {} keys of object_nbytes={object_nbytes} need more",
                data.len,
                keys.len(),
            )));
        }
        self.rows(&keys, data, object_nbytes);
        Ok(())
    }

    /// `put_blocks`' buffer, checked only here: C-contiguous plain data, flat or shaped
    /// `(count, ...)` with rows of `object_nbytes` bytes; each error says which it is not.
    fn blocks(
        &mut self,
        blocks: &Bound<'py, PyAny>,
        count: usize,
        object_nbytes: usize,
    ) -> PyResult<RawBytes> {
        if let Ok(bytes) = blocks.cast::<PyBytes>() {
            return Ok(RawBytes::of(bytes.as_bytes()));
        }
        let wrong_shape = |shape: &[usize]| {
            let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
            let comma = if dims.len() == 1 { "," } else { "" };
            PyValueError::new_err(format!(
                "blocks must have shape ({count}, ...), got ({}{comma})",
                dims.join(", ")
            ))
        };
        let Ok(buffer) = PyUntypedBuffer::get(blocks) else {
            // A 0-d array exports no shape; any other failure means no buffer at all.
            return Err(match flat_view(blocks) {
                Ok(_) => wrong_shape(&[]),
                Err(_) => PyTypeError::new_err(format!(
                    "blocks must be a numpy array, a torch tensor or a buffer, not {}",
                    type_name(blocks)
                )),
            });
        };
        if holds_objects(&buffer) {
            return Err(PyTypeError::new_err(
                "blocks must hold plain data, not Python object references",
            ));
        }
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(
                "blocks must be C-contiguous (use numpy.ascontiguousarray)",
            ));
        }
        let shape = buffer.shape();
        let flat_bytes = shape.len() == 1 && buffer.item_size() == 1;
        if !flat_bytes {
            if shape.first() != Some(&count) {
                return Err(wrong_shape(shape));
            }
            if count > 0 && buffer.len_bytes() / count != object_nbytes {
                return Err(PyValueError::new_err(format!(
                    "each block holds {} bytes, expected object_nbytes={object_nbytes}",
                    buffer.len_bytes() / count
                )));
            }
        }
        Ok(self.hold(buffer))
    }

    /// Records a sequence of keys (each must be `str`).
    pub(crate) fn keys(&mut self, keys: &Bound<'py, PyAny>) -> PyResult<Vec<RawBytes>> {
        let hint = size_hint(keys);
        let mut out = Vec::new();
        reserve(&mut out, hint)?;
        reserve(&mut self.objects, hint)?;
        for_each_item(keys, |key| {
            out.push(self.key(&key)?);
            self.objects.push(key.unbind());
            Ok(())
        })?;
        Ok(out)
    }

    /// The text of one key; the caller keeps its owner.
    fn key(&mut self, key: &Bound<'py, PyAny>) -> PyResult<RawBytes> {
        let mut len: ffi::Py_ssize_t = 0;
        // SAFETY: a live object, GIL held: a `str` gives its cached UTF-8, else NULL and an error.
        let text = unsafe { ffi::PyUnicode_AsUTF8AndSize(key.as_ptr(), &raw mut len) };
        if text.is_null() {
            // Not a str, or one that is not valid UTF-8: the message says which.
            drop(PyErr::take(key.py()));
            return key_text(key).map(|text| RawBytes::of(text.as_bytes()));
        }
        Ok(RawBytes { ptr: text.cast::<u8>(), len: len as usize })
    }

    /// The bytes of one payload (bytes, or any C-contiguous buffer of plain data).
    fn payload(
        &mut self,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<RawBytes> {
        self.buffer(value, || {
            format!(
                "payload of auxiliary output object {}",
                key.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string())
            )
        })
    }

    /// The bytes of a readable C-contiguous buffer, exported while the batch lives.
    fn buffer(
        &mut self,
        value: &Bound<'py, PyAny>,
        what: impl Fn() -> String,
    ) -> PyResult<RawBytes> {
        if let Ok(bytes) = value.cast::<PyBytes>() {
            return Ok(RawBytes::of(bytes.as_bytes()));
        }
        let not_a_buffer = || {
            PyTypeError::new_err(format!(
                "{} must be a C-contiguous buffer, not {}",
                what(),
                type_name(value)
            ))
        };
        let buffer = match PyUntypedBuffer::get(value) {
            Ok(buffer) => buffer,
            // Some exporters (a 0-d array) give no shape; a flat byte view of them has one.
            Err(_) => flat_view(value)
                .and_then(|view| PyUntypedBuffer::get(&view))
                .map_err(|_| not_a_buffer())?,
        };
        if !buffer.is_c_contiguous() || holds_objects(&buffer) {
            return Err(not_a_buffer());
        }
        Ok(self.hold(buffer))
    }

    fn hold(&mut self, buffer: PyUntypedBuffer) -> RawBytes {
        // SAFETY: C-contiguous (the caller checked), exported until `buffer` drops with the batch.
        let bytes = unsafe {
            std::slice::from_raw_parts(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes())
        };
        let raw = RawBytes::of(bytes);
        self.buffers.push(buffer);
        raw
    }

    /// Keeps `value` alive with the batch (for bytes recorded through `buffer`).
    fn keep(&mut self, value: Bound<'py, PyAny>) {
        self.objects.push(value.unbind());
    }

    /// The batch as the store takes it.
    /// # Safety
    /// `self` must outlive the returned views.
    pub(crate) unsafe fn views(&self) -> Result<BatchViews<'_>, StoreError> {
        // SAFETY: every RawBytes was recorded from an owner held by `self`.
        unsafe { batch_views(&self.blocks, &self.retains, &self.releases) }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty() && self.retains.is_empty() && self.releases.is_empty()
    }

    /// Splits into the raw views and owned owners, for a batch that another thread applies.
    pub(crate) fn into_owned(self) -> (OwnedViews, Owners) {
        let owners = Owners { objects: self.objects, buffers: self.buffers };
        (OwnedViews { blocks: self.blocks, retains: self.retains, releases: self.releases }, owners)
    }
}

/// The store's view of recorded keys and payloads; a batch too large for memory is refused
/// (`OutOfMemory`) rather than aborting.
/// # Safety
/// Every `RawBytes` must point into memory alive and unchanged for `'a`.
pub(crate) unsafe fn batch_views<'a>(
    blocks: &'a [(RawBytes, RawBytes)],
    retains: &'a [RawBytes],
    releases: &'a [RawBytes],
) -> Result<BatchViews<'a>, StoreError> {
    let (mut block_refs, mut retain_keys, mut release_keys) =
        (reserved(blocks.len())?, reserved(retains.len())?, reserved(releases.len())?);
    // SAFETY: the caller's contract: every view stays valid for `'a`.
    unsafe {
        block_refs.extend(
            blocks
                .iter()
                .map(|&(key, payload)| BlockRef { key: key.text(), payload: payload.get() }),
        );
        retain_keys.extend(retains.iter().map(|k| k.text()));
        release_keys.extend(releases.iter().map(|k| k.text()));
    }
    Ok((block_refs, retain_keys, release_keys))
}

/// A batch's views without their owners (those travel as `Owners`).
#[derive(Default)]
pub(crate) struct OwnedViews {
    pub(crate) blocks: Vec<(RawBytes, RawBytes)>,
    pub(crate) retains: Vec<RawBytes>,
    pub(crate) releases: Vec<RawBytes>,
}
