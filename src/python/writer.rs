//! `NativeWriter`, the pyclass over the core's writer (`crate::writer`): `put` hands a batch
//! over and returns; the core's thread applies it without ever taking the GIL. Rules, each from
//! a deadlock or crash: the thread never owns a Python reference (jobs with Python owners are
//! parked and dropped by a GIL holder, soon via a pending call); no Python object is made,
//! dropped or called under the writer's lock, which a GIL holder takes only through
//! `lock_attached`; the thread holds the store's core, not the Python store, and dropping the
//! writer joins it with the GIL released.

use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyBaseException;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::PyTraverseError;

use super::gather::{batch_views, Gathered, OwnedViews, Owners};
use super::lock::{detach, lock_attached, try_lock, DetachedMutex, Unattached};
use super::variable::NativeVariableStore;
use super::{fork_generation, log_growth, to_py_err, BlockObjectStoreError, NativeStore};
use crate::dataplane::Publication;
use crate::error::StoreError;
use crate::writer::{Closing, Keep, Refusal, State, Target, Work, Writer};

/// What a queued job applies.
pub(crate) enum Batch {
    /// A `put` or `put_blocks`: views into Python memory, owned by the job's `Owners`.
    Borrowed(OwnedViews),
    /// A data-plane call: its own keys and payloads, no Python object (no owners), read as
    /// they are, and dropped on the writer thread once applied.
    Owned(Publication),
}

impl Work for Batch {
    fn apply(&self, target: &dyn Target) -> Result<Option<usize>, StoreError> {
        match self {
            Batch::Borrowed(views) => {
                // SAFETY: the views borrow from this job's owners, which the writer keeps
                // (`State::in_flight`) until after this.
                let (blocks, retains, releases) =
                    unsafe { batch_views(&views.blocks, &views.retains, &views.releases) }?;
                target.put(&blocks, &retains, &releases)
            }
            Batch::Owned(publication) => publication.apply(target),
        }
    }
}

impl From<Publication> for Batch {
    fn from(publication: Publication) -> Self {
        Batch::Owned(publication)
    }
}

/// Python owners are dropped with the GIL: parked for the main thread.
impl Keep for Owners {
    fn must_park(&self) -> bool {
        self.hold_python()
    }
}

/// The binding's writer: jobs of Python puts and data-plane calls.
pub(crate) type PlaneWriter = Writer<Batch, Owners>;
type Job = crate::writer::Job<Batch, Owners>;

/// The core writer, with what the pending-call release needs.
struct Shared {
    writer: PlaneWriter,
    /// A pending call that drops `done` is scheduled and has not run yet.
    release_scheduled: AtomicBool,
    /// `fork_generation()` at creation: a child runs the parent's pending calls, with a dead lock.
    generation: u64,
}

impl Shared {
    /// The writer's state, taken with the GIL held (released if it must wait).
    fn lock<'a>(&'a self, py: Python<'_>) -> std::sync::MutexGuard<'a, State<Batch, Owners>> {
        lock_attached(py, self.writer.state())
    }

    /// Finished jobs and growths, taken under the lock and dropped after it.
    fn take_done(&self, py: Python<'_>) -> (Vec<Job>, Vec<usize>) {
        self.lock(py).take_done()
    }
}

/// A writer thread in front of one aostore store (see `aostore.BackgroundBlockObjectStore`).
#[pyclass(module = "aostore._native", frozen, name = "NativeWriter")]
pub struct NativeWriter {
    shared: Arc<Shared>,
    /// The Python store (`NativeStore` or `NativeVariableStore`), closed by `close()`.
    store: Py<PyAny>,
    /// The fixed store's object size, for `put_blocks`; `None` for the variable store.
    object_nbytes: Option<usize>,
    thread: DetachedMutex<Option<JoinHandle<()>>>,
    /// An argument error from a caller's thread, latched; touched only with the GIL.
    input_error: PyOnceLock<Py<PyBaseException>>,
    /// `fork_generation()` at construction: in a forked child the thread does not exist.
    generation: u64,
}

/// How long a `put` on a full queue waits with the GIL held (the writer frees room in µs).
const FULL_QUEUE_WAIT_WITH_GIL: Duration = Duration::from_millis(1);

/// Whether the interpreter may still take a pending call, and how many writer threads are
/// inside that check. `interpreter_exiting` (atexit) closes the gate and waits for none inside;
/// with SeqCst, once it returns no writer enters the interpreter (`Py_IsFinalizing()` races).
/// No lock spans the call, as a forked child would inherit it held; the child resets the count.
static INTERPRETER_ALIVE: AtomicBool = AtomicBool::new(true);
static SCHEDULING: AtomicUsize = AtomicUsize::new(0);

/// Registered with `atexit`: no pending call is scheduled after it ran.
#[pyfunction]
pub(crate) fn interpreter_exiting() {
    INTERPRETER_ALIVE.store(false, Ordering::SeqCst);
    // A thread inside holds no lock the main thread needs, so it returns promptly.
    while SCHEDULING.load(Ordering::SeqCst) != 0 {
        std::thread::yield_now();
    }
}

/// In a forked child: no writer thread exists, so none is inside.
pub(crate) fn forget_scheduling_threads() {
    SCHEDULING.store(0, Ordering::SeqCst);
}

/// Asks the main thread to drop finished jobs soon (`Py_AddPendingCall` needs no GIL), so
/// exports are released once applied. At most one outstanding; if refused, the next call collects.
fn schedule_release(shared: &Arc<Shared>) {
    SCHEDULING.fetch_add(1, Ordering::SeqCst);
    if !INTERPRETER_ALIVE.load(Ordering::SeqCst)
        || shared.release_scheduled.swap(true, Ordering::AcqRel)
    {
        SCHEDULING.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let arg = Arc::into_raw(Arc::clone(shared)).cast_mut().cast::<c_void>();
    // SAFETY: `release_done` takes `arg` back once; the interpreter lives while we are counted.
    let status = unsafe { ffi::Py_AddPendingCall(Some(release_done), arg) };
    SCHEDULING.fetch_sub(1, Ordering::SeqCst);
    if status != 0 {
        shared.release_scheduled.store(false, Ordering::Release);
        // SAFETY: not taken by the interpreter: take back the reference (the writer holds another).
        drop(unsafe { Arc::from_raw(arg.cast_const().cast::<Shared>()) });
    }
}

/// The pending call: runs on the main thread with the GIL held.
extern "C" fn release_done(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the reference `schedule_release` made with `Arc::into_raw`.
    let shared = unsafe { Arc::from_raw(arg.cast_const().cast::<Shared>()) };
    if shared.generation != fork_generation() {
        // The parent's call in a forked child: the owners are the parent's; lock and drop nothing.
        std::mem::forget(shared);
        return 0;
    }
    shared.release_scheduled.store(false, Ordering::Release);
    // SAFETY: pending calls run with the GIL held.
    let py = unsafe { Python::assume_attached() };
    let (done, growths) = shared.take_done(py);
    drop(done);
    if !growths.is_empty() {
        for num_slots in growths {
            log_growth(py, num_slots);
        }
    }
    // The last reference drops the shared state here, with the GIL held as owners require.
    drop(shared);
    0
}

impl NativeWriter {
    /// The writer's `RuntimeError` in a forked child, before any lock (a parent thread may have
    /// held one at the fork).
    pub(crate) fn ensure_same_process(&self) -> PyResult<()> {
        match self.generation == fork_generation() {
            true => Ok(()),
            false => Err(forked_error()),
        }
    }

    /// The core writer, for the data plane's calls (made with the GIL released).
    pub(crate) fn core(&self) -> &PlaneWriter {
        &self.shared.writer
    }

    /// Drops finished jobs and logs growths; needs the GIL, which every caller holds.
    fn collect(&self, py: Python<'_>) {
        self.drop_finished(py, self.shared.take_done(py));
    }

    fn drop_finished(&self, py: Python<'_>, (done, growths): (Vec<Job>, Vec<usize>)) {
        drop(done);
        for num_slots in growths {
            log_growth(py, num_slots);
        }
    }

    /// `BlockObjectStoreError("auxiliary output publication failed")` from the latched cause.
    fn raise_if_failed(&self, py: Python<'_>) -> PyResult<()> {
        let cause = if let Some(error) = self.input_error.get(py) {
            Some(PyErr::from_value(error.bind(py).clone().into_any()))
        } else {
            let (error, panic) = {
                let state = self.shared.lock(py);
                (state.error.clone(), state.panic.clone())
            };
            match (error, panic) {
                (_, Some(panic)) => Some(PyRuntimeError::new_err(format!(
                    "the aostore writer thread panicked: {panic}"
                ))),
                (Some(error), None) => Some(to_py_err(error)),
                (None, None) => None,
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
        let writer = &self.shared.writer;
        let input_failed = self.input_error.get(py).is_some();
        // Checks, drops and hand-over share this one lock a put.
        let mut state = self.shared.lock(py);
        let finished = state.take_done();
        let refusal = match PlaneWriter::refusal(&state) {
            None if input_failed => Some(Refusal::Failed),
            refusal => refusal,
        };
        if let Some(refusal) = refusal {
            drop(state);
            drop(job);
            self.drop_finished(py, finished);
            return match refusal {
                Refusal::Closed => Err(closed_error()),
                _ => self.raise_if_failed(py),
            };
        }
        let job = match writer.offer(state, job) {
            Ok(()) => {
                self.drop_finished(py, finished);
                self.settle_if_synchronous(py);
                return Ok(());
            }
            Err(job) => job,
        };
        self.drop_finished(py, finished);
        // Full: the writer frees a place without the GIL, so wait briefly with it held;
        // getting a released GIL back can cost a whole switch interval (5 ms). The one wait on
        // this lock with the GIL: the condvar takes it back from a holder that never waits for
        // the GIL (the writer thread, or a caller for microseconds).
        let deadline = Instant::now() + FULL_QUEUE_WAIT_WITH_GIL;
        let state = writer.wait_for_room(self.shared.lock(py), Some(deadline));
        if state.closing {
            drop(state);
            drop(job);
            return Err(closed_error());
        }
        let job = match writer.offer(state, job) {
            Ok(()) => {
                self.settle_if_synchronous(py);
                return self.raise_if_failed(py);
            }
            Err(job) => job,
        };
        // Still full: wait with the GIL released; a refused job comes back and is dropped with
        // the GIL.
        if let Some(job) = detach(py, move |_| writer.push(job).err()) {
            drop(job);
            return Err(closed_error());
        }
        self.settle_if_synchronous(py);
        self.raise_if_failed(py)
    }

    /// Latches an argument error like a writer error and raises "publication failed".
    fn latch_input(&self, py: Python<'_>, error: PyErr) -> PyErr {
        // A second error is dropped here, with no lock held.
        let _ = self.input_error.set(py, error.into_value(py));
        self.raise_if_failed(py).expect_err("just latched")
    }

    /// For tests (`_synchronous`): waits for the queue with the GIL released; a plain put
    /// keeps the GIL (releasing it costs every put, and getting it back can cost 5 ms).
    fn settle_if_synchronous(&self, py: Python<'_>) {
        if self.shared.writer.is_synchronous() {
            detach(py, |_| self.shared.writer.wait_idle());
        }
    }

    /// Waits until every queued job is applied, with the GIL released.
    fn wait_idle(&self, py: Python<'_>) {
        detach(py, |unattached| self.wait_idle_detached(unattached));
    }

    fn wait_idle_detached(&self, _: Unattached) {
        self.shared.writer.wait_idle();
    }

    /// Whether the writer can take a data-plane call: a fixed store, in this process.
    pub(crate) fn serves_data_plane(&self) -> bool {
        self.object_nbytes.is_some() && self.generation == fork_generation()
    }

    /// Whether an argument error from a Python caller is latched (needs the GIL).
    pub(crate) fn input_failed(&self, py: Python<'_>) -> bool {
        self.input_error.get(py).is_some()
    }

    /// The Python error for a refusal (with the GIL).
    pub(crate) fn refusal_error(&self, py: Python<'_>, refusal: Refusal) -> PyErr {
        match refusal {
            Refusal::Closed => closed_error(),
            Refusal::Failed => match self.raise_if_failed(py) {
                Err(error) => error,
                Ok(()) => PyRuntimeError::new_err("the aostore writer refused the call"),
            },
            Refusal::Store(error) => to_py_err(error),
        }
    }

    fn is_closed(&self, py: Python<'_>) -> bool {
        self.shared.lock(py).closing
    }

    /// Stops the thread once the queue is empty and joins it, with the GIL released.
    fn stop_and_join(&self, py: Python<'_>) {
        let thread = self.thread.lock(py).take();
        detach(py, |_| {
            self.shared.writer.stop();
            if let Some(thread) = thread {
                // A panic outside `apply` is a bug here; `apply`'s are latched.
                let _ = thread.join();
            }
        });
    }
}

fn forked_error() -> PyErr {
    PyRuntimeError::new_err(
        "this aostore background writer was created in the parent process before fork(); \
         its thread does not exist here: create a new store and writer in the child",
    )
}

fn closed_error() -> PyErr {
    PyRuntimeError::new_err("auxiliary output store is closed")
}

#[pymethods]
impl NativeWriter {
    #[new]
    fn new(store: &Bound<'_, PyAny>, max_pending_batches: usize) -> PyResult<Self> {
        if max_pending_batches == 0 {
            return Err(PyValueError::new_err("max_pending_batches must be at least 1"));
        }
        let (core, object_nbytes): (Arc<dyn Target>, _) =
            if let Ok(fixed) = store.cast::<NativeStore>() {
                let core = fixed.get().handle.core()?;
                (core, Some(fixed.get().object_nbytes()))
            } else if let Ok(variable) = store.cast::<NativeVariableStore>() {
                (variable.get().handle.core()?, None)
            } else {
                return Err(PyTypeError::new_err(format!(
                    "NativeWriter needs an aostore store, not {}",
                    store.get_type().name()?
                )));
            };
        let shared = Arc::new(Shared {
            writer: Writer::new(core, max_pending_batches),
            release_scheduled: AtomicBool::new(false),
            generation: fork_generation(),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("aostore-writer".to_owned())
            .spawn(move || {
                // Never attached to Python: the cue schedules a pending call, which needs no GIL.
                thread_shared.writer.run(&|| schedule_release(&thread_shared));
            })
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the writer thread: {e}")))?;
        Ok(Self {
            shared,
            store: store.clone().unbind(),
            object_nbytes,
            thread: DetachedMutex::new(Some(thread)),
            input_error: PyOnceLock::new(),
            generation: fork_generation(),
        })
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
        self.ensure_same_process()?;
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
        self.ensure_same_process()?;
        let Some(object_nbytes) = self.object_nbytes else {
            let error = PyTypeError::new_err("put_blocks needs a fixed-size store");
            return Err(self.latch_input(py, error));
        };
        let mut batch = Gathered::default();
        let gathered = batch
            .rows_of(keys, blocks, object_nbytes)
            .and_then(|()| batch.references(retain_keys, release_keys));
        self.submit(py, gathered.map(|()| batch))
    }

    /// Waits for queued puts, then raises a latched error, if any.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.ensure_same_process()?;
        self.wait_idle(py);
        self.collect(py);
        self.raise_if_failed(py)
    }

    /// Drains the queue, stops the thread, closes the store once, raises a latched error.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.ensure_same_process()?;
        let me = std::thread::current().id();
        let writer = &self.shared.writer;
        let closing = writer.begin_close(&mut self.shared.lock(py), me);
        match closing {
            Closing::Done => return Ok(()),
            Closing::Wait => {
                detach(py, |_| writer.wait_closed());
                self.collect(py);
                return self.raise_if_failed(py);
            }
            Closing::First => {}
        }
        // Wake writers blocked on a full queue: they see `closing` and refuse.
        writer.wake_waiting_callers();
        self.stop_and_join(py);
        self.collect(py);
        let closed = self.store.bind(py).call_method0("close");
        writer.finish_close(self.shared.lock(py));
        closed?;
        self.raise_if_failed(py)
    }

    /// For tests: the writer waits `seconds` before applying each queued job, so callers run
    /// ahead of it (as behind a slow store); 0 restores normal service.
    fn _hold_back(&self, seconds: f64) -> PyResult<()> {
        if !(0.0..=10.0).contains(&seconds) {
            return Err(PyValueError::new_err("seconds must be within [0, 10]"));
        }
        self.shared.writer.hold_back(Duration::from_secs_f64(seconds));
        Ok(())
    }

    /// For tests: each put (and data-plane hand-over) returns once its job is applied, so a
    /// failed put is reported by the next call, never by itself, however fast the thread runs
    /// (vLLM's writer may or may not have applied a put before its own error check; the
    /// connector differential makes vLLM's do the same). `False` restores normal service.
    fn _synchronous(&self, on: bool) {
        self.shared.writer.set_synchronous(on);
    }

    /// For tests: once the queue is applied, how many applied jobs that hold no Python object
    /// (a data-plane call's own bytes) are still parked for the main thread to drop; the writer
    /// thread drops those itself, so 0. Collects nothing (`wait` would drop them).
    fn _parked_owned_jobs(&self, py: Python<'_>) -> PyResult<usize> {
        self.ensure_same_process()?;
        detach(py, |unattached| self.wait_idle_detached(unattached));
        Ok(self.shared.lock(py).done.iter().filter(|job| !job.keep.must_park()).count())
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        self.is_closed(py)
    }

    /// The store the writer applies batches to.
    #[getter]
    fn store(&self, py: Python<'_>) -> Py<PyAny> {
        self.store.clone_ref(py)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.store)?;
        if let Some(error) = self.input_error.get(unsafe_py_for_traverse()) {
            visit.call(error)?;
        }
        // Skipped while the writer holds the lock (traversal must not block), for this pass only.
        if let Some(state) = try_lock(self.shared.writer.state()) {
            let jobs = state.queue.iter().chain(&state.done).map(|job| &job.keep);
            for owners in jobs.chain(&state.in_flight) {
                for object in &owners.objects {
                    visit.call(object)?;
                }
            }
        }
        Ok(())
    }
}

/// A GIL token for `__traverse__`, which holds the GIL but may not create one.
fn unsafe_py_for_traverse() -> Python<'static> {
    // SAFETY: only from `__traverse__`, run with the GIL held; used for one cell read.
    unsafe { Python::assume_attached() }
}

impl NativeWriter {
    fn submit(&self, py: Python<'_>, gathered: PyResult<Gathered<'_>>) -> PyResult<()> {
        // As vLLM: an empty update is a no-op, even on a closed store.
        match gathered {
            Ok(batch) if batch.is_empty() => Ok(()),
            Ok(batch) => {
                // `enqueue` refuses it on a closed store, under its lock.
                let (views, owners) = batch.into_owned();
                self.enqueue(py, Job { work: Batch::Borrowed(views), keep: owners })
            }
            Err(_) if self.is_closed(py) => Err(closed_error()),
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
        if self.generation != fork_generation() {
            // A forked child: the thread is not here and its lock may be held: leak the handle.
            if let Some(mut thread) = self.thread.try_lock() {
                std::mem::forget(thread.take());
            }
            return;
        }
        // An abandoned writer: the thread finishes the queue and exits; jobs drop with the GIL.
        Python::attach(|py| {
            self.stop_and_join(py);
            self.collect(py);
        });
    }
}
