//! The background writer in Rust: `put` hands a batch over and returns; a plain OS thread applies
//! it to the store without ever taking the GIL, so the engine thread keeps the interpreter.
//!
//! Python objects cannot be released without the GIL, so the thread never drops them: finished
//! batches go to a "done" list that the next call from Python (which holds the GIL) drops.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{
    block_parts, collect_keys, key_text, readable_buffer, to_py_err, BlockObjectStoreError,
    NativeStore, Payload,
};
use crate::error::StoreError;
use crate::store::BlockRef;

/// Bytes owned by a Python object that a `Keep` holds alive.
#[derive(Clone, Copy)]
struct RawBytes {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes belong to immutable `str`/`bytes` objects or exported buffers that the same
// job keeps alive (`Job::keep`); they are only read, on one thread at a time.
unsafe impl Send for RawBytes {}

impl RawBytes {
    fn of(bytes: &[u8]) -> Self {
        Self { ptr: bytes.as_ptr(), len: bytes.len() }
    }

    /// # Safety
    /// The owner recorded in the job's `keep` list must still be alive.
    unsafe fn get<'a>(self) -> &'a [u8] {
        // SAFETY: per the contract above, the memory is live and not written.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// As `get`; the bytes came from a `&str`.
    unsafe fn text<'a>(self) -> &'a str {
        // SAFETY: as `get`, and the bytes were valid UTF-8 when recorded.
        unsafe { std::str::from_utf8_unchecked(self.get()) }
    }
}

/// Something a queued job borrows memory from.
#[expect(dead_code, reason = "held only so the memory stays alive and in place")]
enum Keep {
    Object(Py<PyAny>),
    Buffer(PyUntypedBuffer),
}

/// One queued `put` or `put_blocks`.
struct Job {
    blocks: Vec<(RawBytes, RawBytes)>,
    retains: Vec<RawBytes>,
    releases: Vec<RawBytes>,
    /// The owners of every `RawBytes` above.
    #[expect(dead_code, reason = "held only so the memory stays alive and in place")]
    keep: Vec<Keep>,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    busy: bool,
    stop: bool,
    closed: bool,
    /// The first error; later jobs are skipped.
    error: Option<StoreError>,
    /// An argument error raised on the caller's thread, latched like a writer error.
    input_error: Option<PyErr>,
    /// Finished jobs, to be dropped by a thread holding the GIL.
    done: Vec<Job>,
    /// Profile `grow`: arena growths to log from a thread holding the GIL.
    growths: Vec<usize>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued or the writer must stop.
    work: Condvar,
    /// Signalled when a job finishes (room in the queue; maybe idle).
    finished: Condvar,
    capacity: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A writer thread in front of one aostore store (see `aostore.BackgroundBlockObjectStore`).
#[pyclass(module = "aostore._native", frozen, name = "NativeWriter")]
pub struct NativeWriter {
    shared: Arc<Shared>,
    store: Py<NativeStore>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn run(shared: &Shared, store: &NativeStore) {
    loop {
        let job = {
            let mut state = shared.lock();
            loop {
                if let Some(job) = state.queue.pop_front() {
                    state.busy = true;
                    break job;
                }
                if state.stop {
                    return;
                }
                state = shared.work.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let skip = shared.lock().error.is_some();
        let outcome = if skip { None } else { Some(apply(store, &job)) };
        let mut state = shared.lock();
        match outcome {
            Some(Ok(Some(num_slots))) => state.growths.push(num_slots),
            Some(Err(error)) => {
                state.error.get_or_insert(error);
            }
            _ => {}
        }
        state.done.push(job);
        state.busy = false;
        drop(state);
        shared.finished.notify_all();
    }
}

fn apply(store: &NativeStore, job: &Job) -> Result<Option<usize>, StoreError> {
    // SAFETY: every RawBytes of the job borrows from `job.keep`, alive until the job is dropped
    // (on a thread holding the GIL, after this returns).
    let blocks: Vec<BlockRef<'_>> = job
        .blocks
        .iter()
        .map(|&(key, payload)| unsafe { BlockRef { key: key.text(), payload: payload.get() } })
        .collect();
    // SAFETY: as above.
    let retains: Vec<&str> = job.retains.iter().map(|k| unsafe { k.text() }).collect();
    // SAFETY: as above.
    let releases: Vec<&str> = job.releases.iter().map(|k| unsafe { k.text() }).collect();
    let mut held = store.lock()?;
    held.guard.put(&blocks, &retains, &releases).map(|report| report.grown_to)
}

/// Records `keys` (already validated as `str`) as raw text kept alive by `keep`.
fn raw_keys(keys: Vec<Bound<'_, PyAny>>, keep: &mut Vec<Keep>) -> Vec<RawBytes> {
    keys.into_iter()
        .map(|key| {
            let text = RawBytes::of(key_text(&key).expect("validated key").as_bytes());
            keep.push(Keep::Object(key.unbind()));
            text
        })
        .collect()
}

fn raw_payload(payload: Payload<'_>, keep: &mut Vec<Keep>) -> RawBytes {
    let raw = RawBytes::of(payload.as_slice());
    keep.push(match payload {
        Payload::Bytes(bytes) => Keep::Object(bytes.into_any().unbind()),
        Payload::Buffer(buffer) => Keep::Buffer(buffer),
    });
    raw
}

impl NativeWriter {
    /// Drops finished jobs and logs growths; needs the GIL, which every caller holds.
    fn collect(&self, py: Python<'_>) -> PyResult<()> {
        let (done, growths) = {
            let mut state = self.shared.lock();
            (std::mem::take(&mut state.done), std::mem::take(&mut state.growths))
        };
        drop(done);
        if !growths.is_empty() {
            let logger = py.import("logging")?.call_method1("getLogger", ("aostore",))?;
            for num_slots in growths {
                logger.call_method1(
                    "warning",
                    (
                        "auxiliary output store grew to %d slots: every object is referenced",
                        num_slots,
                    ),
                )?;
            }
        }
        Ok(())
    }

    /// `BlockObjectStoreError("auxiliary output publication failed")` from the latched cause.
    fn raise_if_failed(&self, py: Python<'_>) -> PyResult<()> {
        let cause = {
            let state = self.shared.lock();
            if let Some(error) = &state.input_error {
                Some(error.clone_ref(py))
            } else {
                state.error.clone().map(to_py_err)
            }
        };
        match cause {
            None => Ok(()),
            Some(cause) => {
                let error = BlockObjectStoreError::new_err("auxiliary output publication failed");
                error.set_cause(py, Some(cause));
                Err(error)
            }
        }
    }

    fn enqueue(&self, py: Python<'_>, job: Job) -> PyResult<()> {
        self.collect(py)?;
        self.raise_if_failed(py)?;
        let shared = &self.shared;
        let closed = py.detach(move || {
            let mut state = shared.lock();
            while state.queue.len() >= shared.capacity && !state.closed {
                state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            if state.closed {
                return Err(job);
            }
            state.queue.push_back(job);
            drop(state);
            shared.work.notify_one();
            Ok(())
        });
        if closed.is_err() {
            return Err(PyRuntimeError::new_err("auxiliary output store is closed"));
        }
        self.raise_if_failed(py)
    }

    /// Latches an argument error like a writer error and raises "publication failed".
    fn latch_input(&self, py: Python<'_>, error: PyErr) -> PyErr {
        self.shared.lock().input_error.get_or_insert(error);
        self.raise_if_failed(py).expect_err("just latched")
    }

    fn wait_idle(&self, py: Python<'_>) {
        let shared = &self.shared;
        py.detach(|| {
            let mut state = shared.lock();
            while !state.queue.is_empty() || state.busy {
                state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
        });
    }

    fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }
}

#[pymethods]
impl NativeWriter {
    #[new]
    fn new(store: Py<NativeStore>, max_pending_batches: usize) -> PyResult<Self> {
        if max_pending_batches == 0 {
            return Err(PyValueError::new_err("max_pending_batches must be at least 1"));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            finished: Condvar::new(),
            capacity: max_pending_batches,
        });
        let thread_shared = Arc::clone(&shared);
        let thread_store = Python::attach(|py| store.clone_ref(py));
        let thread = std::thread::Builder::new()
            .name("aostore-writer".to_owned())
            .spawn(move || run(&thread_shared, thread_store.get()))
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the writer thread: {e}")))?;
        Ok(Self { shared, store, thread: Mutex::new(Some(thread)) })
    }

    /// Queues one `put`; see `aostore.BackgroundBlockObjectStore.put`.
    #[pyo3(signature = (objects, *, retain_keys = None, release_keys = None))]
    fn put(
        &self,
        py: Python<'_>,
        objects: &Bound<'_, PyAny>,
        retain_keys: Option<&Bound<'_, PyAny>>,
        release_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let converted = (|| -> PyResult<Job> {
            let mut keep = Vec::new();
            let mut blocks = Vec::with_capacity(objects.len().unwrap_or(0));
            for object in objects.try_iter()? {
                let (key, payload) = block_parts(&object?)?;
                let key = raw_keys(vec![key], &mut keep)[0];
                blocks.push((key, raw_payload(payload, &mut keep)));
            }
            let retains = retain_keys.map(collect_keys).transpose()?.unwrap_or_default();
            let releases = release_keys.map(collect_keys).transpose()?.unwrap_or_default();
            let retains = raw_keys(retains, &mut keep);
            let releases = raw_keys(releases, &mut keep);
            Ok(Job { blocks, retains, releases, keep })
        })();
        self.submit(py, converted)
    }

    /// Queues one `put_blocks` of a C-contiguous buffer. The writer reads `blocks` later.
    #[pyo3(signature = (keys, blocks, *, retain_keys = None, release_keys = None))]
    fn put_blocks(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        retain_keys: Option<&Bound<'_, PyAny>>,
        release_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let object_nbytes = self.store.get().object_nbytes(py)?;
        let converted = (|| -> PyResult<Job> {
            let mut keep = Vec::new();
            let keys = collect_keys(keys)?;
            let data = readable_buffer(blocks, "blocks")?;
            let len = data.as_slice().len();
            if len != keys.len() * object_nbytes {
                return Err(PyValueError::new_err(format!(
                    "blocks hold {len} bytes; {} keys of object_nbytes={object_nbytes} need {}",
                    keys.len(),
                    keys.len() * object_nbytes
                )));
            }
            let keys = raw_keys(keys, &mut keep);
            let data = raw_payload(data, &mut keep);
            let blocks = keys
                .into_iter()
                .enumerate()
                .map(|(i, key)| {
                    // SAFETY: in bounds of the buffer just checked; kept alive by `keep`.
                    let ptr = unsafe { data.ptr.add(i * object_nbytes) };
                    (key, RawBytes { ptr, len: object_nbytes })
                })
                .collect();
            let retains = retain_keys.map(collect_keys).transpose()?.unwrap_or_default();
            let releases = release_keys.map(collect_keys).transpose()?.unwrap_or_default();
            let retains = raw_keys(retains, &mut keep);
            let releases = raw_keys(releases, &mut keep);
            Ok(Job { blocks, retains, releases, keep })
        })();
        self.submit(py, converted)
    }

    /// Waits for queued puts, then raises a latched error, if any.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.wait_idle(py);
        self.collect(py)?;
        self.raise_if_failed(py)
    }

    /// Drains the queue, stops the thread, closes the store once, raises a latched error.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        {
            let mut state = self.shared.lock();
            if state.closed {
                return Ok(());
            }
            state.closed = true;
        }
        self.shared.finished.notify_all();
        self.wait_idle(py);
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
        let thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(thread) = thread {
            py.detach(|| thread.join())
                .map_err(|_| PyRuntimeError::new_err("the aostore writer thread panicked"))?;
        }
        self.collect(py)?;
        self.store.bind(py).call_method0("close")?;
        self.raise_if_failed(py)
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.is_closed()
    }

    /// The store the writer applies batches to.
    #[getter]
    fn store(&self, py: Python<'_>) -> Py<NativeStore> {
        self.store.clone_ref(py)
    }
}

impl NativeWriter {
    fn submit(&self, py: Python<'_>, converted: PyResult<Job>) -> PyResult<()> {
        if self.is_closed() {
            return Err(PyRuntimeError::new_err("auxiliary output store is closed"));
        }
        match converted {
            Ok(job) => self.enqueue(py, job),
            Err(error)
                if error.is_instance_of::<PyTypeError>(py)
                    || error.is_instance_of::<PyValueError>(py) =>
            {
                Err(self.latch_input(py, error))
            }
            Err(error) => Err(error),
        }
    }
}

impl Drop for NativeWriter {
    fn drop(&mut self) {
        // An abandoned writer: let the thread finish what is queued and exit on its own.
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
    }
}
