//! The background writer in Rust: `put` hands a batch over and returns; a plain OS thread applies
//! it to the store without ever taking the GIL, so the engine thread keeps the interpreter.
//!
//! Python objects cannot be released without the GIL, so the thread never drops them: finished
//! batches go to a "done" list that the next call from Python (which holds the GIL) drops.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::gather::{Gathered, OwnedViews, Owner};
use super::{to_py_err, BlockObjectStoreError, NativeStore};
use crate::error::StoreError;
use crate::store::BlockRef;

/// One queued `put` or `put_blocks`: views into Python memory, and the objects that own it.
struct Job {
    views: OwnedViews,
    /// Never read: held so the memory stays alive and in place until a thread holding the GIL
    /// drops the job.
    #[expect(dead_code, reason = "held only so the memory stays alive and in place")]
    owners: Vec<Owner>,
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
    let views = &job.views;
    // SAFETY: every view borrows from `job.owners`, alive until the job is dropped (on a thread
    // holding the GIL, after this returns).
    let (blocks, retains, releases) = unsafe {
        let blocks: Vec<BlockRef<'_>> = views
            .blocks
            .iter()
            .map(|&(key, payload)| BlockRef { key: key.text(), payload: payload.get() })
            .collect();
        let retains: Vec<&str> = views.retains.iter().map(|k| k.text()).collect();
        let releases: Vec<&str> = views.releases.iter().map(|k| k.text()).collect();
        (blocks, retains, releases)
    };
    let mut held = store.lock()?;
    held.guard.put(&blocks, &retains, &releases).map(|report| report.grown_to)
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
        // With room in the queue, hand the job over without releasing the GIL: the writer thread
        // never waits for the GIL, and other callers hold this lock only briefly, so taking it
        // with the GIL held cannot deadlock.
        let job = {
            let mut state = shared.lock();
            if state.closed {
                return Err(PyRuntimeError::new_err("auxiliary output store is closed"));
            }
            if state.queue.len() < shared.capacity {
                state.queue.push_back(job);
                drop(state);
                shared.work.notify_one();
                return self.raise_if_failed(py);
            }
            job
        };
        // A full queue: wait for room with the GIL released.
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
        let mut batch = Gathered::default();
        let gathered =
            batch.objects(objects).and_then(|()| batch.references(retain_keys, release_keys));
        self.submit(py, gathered.map(|()| batch))
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
        let object_nbytes = self.store.get().object_nbytes();
        let mut batch = Gathered::default();
        let gathered = batch
            .rows_of(keys, blocks, object_nbytes)
            .and_then(|()| batch.references(retain_keys, release_keys));
        self.submit(py, gathered.map(|()| batch))
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
    fn submit(&self, py: Python<'_>, gathered: PyResult<Gathered<'_>>) -> PyResult<()> {
        // As vLLM: an empty update is a no-op, even on a closed store.
        if gathered.as_ref().is_ok_and(Gathered::is_empty) {
            return Ok(());
        }
        if self.is_closed() {
            return Err(PyRuntimeError::new_err("auxiliary output store is closed"));
        }
        match gathered {
            Ok(batch) => {
                let (views, owners) = batch.into_owned();
                self.enqueue(py, Job { views, owners })
            }
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
