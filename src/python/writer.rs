//! The background writer in Rust: `put` hands a batch over and returns; a plain OS thread applies
//! it to the store without ever taking the GIL, so the engine thread keeps the interpreter.
//!
//! Ownership rules (each one a deadlock or a crash we had):
//! - The thread never owns a Python reference. A job's owners (the objects whose memory the views
//!   point into) travel with it, and a finished job goes to a "done" list that only a thread
//!   holding the GIL drops: the main thread through a pending call scheduled right after the job
//!   is applied (so exports such as a bytearray's are released at once), or the next call from
//!   Python, whichever comes first.
//! - No Python object is created, dropped or called while the state mutex is held: what must be
//!   dropped is taken out first and dropped after the guard.
//! - The thread holds the store's core (`SharedCore`), not the Python store object, so an
//!   abandoned writer does not keep a Python object alive from a thread that cannot release it;
//!   dropping the writer joins the thread (with the GIL released) and then drops what is left.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::raw::c_int;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyBaseException;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::PyTraverseError;

use super::gather::{batch_views, Gathered, OwnedViews, Owners};
use super::variable::NativeVariableStore;
use super::{fork_generation, log_growth, to_py_err, BlockObjectStoreError, NativeStore};
use crate::error::StoreError;
use crate::store::BlockRef;
use crate::store::{Allocator, Store};

/// One queued `put` or `put_blocks`: views into Python memory, and the objects that own it.
struct Job {
    views: OwnedViews,
    /// Held so the memory stays alive and in place; dropped only by a thread holding the GIL.
    owners: Owners,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    busy: bool,
    stop: bool,
    /// The writer polls for work on a timer (see `wait_for_work`): a `put` need not wake it.
    polling: bool,
    /// `close()` has started: no more puts.
    closing: bool,
    /// `close()` has finished (the store is closed): later closers stop waiting.
    closed: bool,
    /// The thread running `close()`, so a re-entrant close from that thread does not wait for
    /// itself.
    closer: Option<ThreadId>,
    /// The first error; later jobs are skipped.
    error: Option<StoreError>,
    /// A panic in the writer thread, latched like an error.
    panic: Option<String>,
    /// The owners of the job being applied (taken off the queue, so the queue's length counts
    /// only waiting jobs, as `queue.Queue(maxsize)` does in vLLM).
    in_flight: Option<Owners>,
    /// Finished jobs, to be dropped by a thread holding the GIL.
    done: Vec<Job>,
    /// Profile `grow`: arena growths to log from a thread holding the GIL.
    growths: Vec<usize>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued or the writer must stop.
    work: Condvar,
    /// Signalled when a job finishes (room in the queue; maybe idle) or `close()` finishes.
    finished: Condvar,
    capacity: usize,
    /// A pending call that drops `done` is scheduled and has not run yet.
    release_scheduled: AtomicBool,
    /// `fork_generation()` when the writer was made: a child runs the parent's queued pending
    /// calls, and there the state's lock may be held for ever by a thread that does not exist.
    generation: u64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Finished jobs and growths, taken out under the lock; the caller drops them after it.
    fn take_done(&self) -> (Vec<Job>, Vec<usize>) {
        let mut state = self.lock();
        (std::mem::take(&mut state.done), std::mem::take(&mut state.growths))
    }
}

/// The store a writer applies batches to, either kind, behind its lock: one `dyn` call per
/// batch, none per object.
trait Target: Send + Sync {
    /// Applies one batch; the fixed store in profile `grow` reports the slots it grew to.
    fn put(
        &self,
        blocks: &[BlockRef<'_>],
        retains: &[&str],
        releases: &[&str],
    ) -> Result<Option<usize>, StoreError>;
}

impl<A: Allocator> Target for Mutex<Store<A>> {
    fn put(
        &self,
        blocks: &[BlockRef<'_>],
        retains: &[&str],
        releases: &[&str],
    ) -> Result<Option<usize>, StoreError> {
        let mut store = self.lock().unwrap_or_else(PoisonError::into_inner);
        store.put(blocks, retains, releases).map(|report| A::grown_to(&report))
    }
}

/// A writer thread in front of one aostore store, fixed or variable-size (see
/// `aostore.BackgroundBlockObjectStore`).
#[pyclass(module = "aostore._native", frozen, name = "NativeWriter")]
pub struct NativeWriter {
    shared: Arc<Shared>,
    /// The Python store (`NativeStore` or `NativeVariableStore`), closed by `close()`.
    store: Py<PyAny>,
    /// The fixed store's object size, for `put_blocks`; `None` for the variable store.
    object_nbytes: Option<usize>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// An argument error raised on a caller's thread, latched like a writer error. Read and
    /// written only with the GIL held, never under a Rust mutex.
    input_error: PyOnceLock<Py<PyBaseException>>,
    /// `fork_generation()` at construction: in a forked child the thread does not exist.
    generation: u64,
}

fn run(shared: &Arc<Shared>, core: &dyn Target) {
    crate::sched::yield_to_running_threads();
    loop {
        let (views, skip) = {
            let mut state = shared.lock();
            let idle_since = Instant::now();
            loop {
                if let Some(Job { views, owners }) = state.queue.pop_front() {
                    state.busy = true;
                    state.in_flight = Some(owners);
                    break (views, state.error.is_some() || state.panic.is_some());
                }
                if state.stop {
                    return;
                }
                state = wait_for_work(shared, state, idle_since.elapsed());
            }
        };
        let outcome = if skip {
            None
        } else {
            Some(std::panic::catch_unwind(AssertUnwindSafe(|| apply(core, &views))))
        };
        let mut state = shared.lock();
        match outcome {
            Some(Ok(Ok(Some(num_slots)))) => state.growths.push(num_slots),
            Some(Ok(Err(error))) => {
                state.error.get_or_insert(error);
            }
            Some(Err(panic)) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned());
                state.panic.get_or_insert(message);
            }
            _ => {}
        }
        let owners = state.in_flight.take().unwrap_or_default();
        state.done.push(Job { views, owners });
        state.busy = false;
        drop(state);
        shared.finished.notify_all();
        schedule_release(shared);
    }
}

/// How long the writer keeps polling for work after its last job before it sleeps until woken.
const POLL_FOR: Duration = Duration::from_millis(50);

/// Waits for a job. While the engine is active (a job within `POLL_FOR`), the writer wakes from
/// its own timer (every 200 µs for 2 ms, then every 1 ms) and a `put` need not wake it: waking a
/// thread that sleeps on another, idle CPU costs the waker an inter-processor interrupt, 15 µs
/// of the engine thread's time per put on this project's VM. After that the writer sleeps and the
/// next `put` wakes it (`State::polling` tells which).
fn wait_for_work<'a>(
    shared: &'a Shared,
    mut state: MutexGuard<'a, State>,
    idle: Duration,
) -> MutexGuard<'a, State> {
    if idle < POLL_FOR {
        state.polling = true;
        let period =
            if idle < Duration::from_millis(2) { Duration::from_micros(200) } else { POLL_PERIOD };
        let (state, _) =
            shared.work.wait_timeout(state, period).unwrap_or_else(PoisonError::into_inner);
        state
    } else {
        state.polling = false;
        shared.work.wait(state).unwrap_or_else(PoisonError::into_inner)
    }
}

/// How long a `put` that finds the queue full waits for room with the GIL held before it waits
/// with the GIL released: a job of the burst's size takes the writer microseconds, and a
/// bounded wait keeps a writer stuck on a huge job from holding other Python threads for long.
const FULL_QUEUE_WAIT_WITH_GIL: Duration = Duration::from_millis(1);

/// The writer's polling period once the engine has been quiet for 2 ms.
const POLL_PERIOD: Duration = Duration::from_millis(1);

fn apply(core: &dyn Target, views: &OwnedViews) -> Result<Option<usize>, StoreError> {
    // SAFETY: every view borrows from the owners of this job, kept in `State::in_flight` until
    // this returns and dropped only later, by a thread holding the GIL.
    let (blocks, retains, releases) =
        unsafe { batch_views(&views.blocks, &views.retains, &views.releases) }?;
    core.put(&blocks, &retains, &releases)
}

/// Whether the interpreter may still be asked for a pending call, and how many writer threads
/// are between checking that and `Py_AddPendingCall` returning. `interpreter_exiting`, an
/// `atexit` callback, closes the gate at the start of `Py_FinalizeEx` and waits until none is
/// inside; both sides use sequentially consistent order, so a thread either sees the gate
/// closed or is counted before the callback looks. So once the callback returns, no writer
/// thread is inside the interpreter and none will enter it, however long the process lives on
/// (`Py_IsFinalizing()` alone is racy). No lock is held across the call: a child forked while
/// a thread was inside would inherit that lock held for ever; the count is reset in the child
/// instead (`after_fork_in_child`), where those threads do not exist.
static INTERPRETER_ALIVE: AtomicBool = AtomicBool::new(true);
static SCHEDULING: AtomicUsize = AtomicUsize::new(0);

/// Registered with `atexit` when the module loads: no pending call is scheduled after it ran.
#[pyfunction]
pub(crate) fn interpreter_exiting() {
    INTERPRETER_ALIVE.store(false, Ordering::SeqCst);
    // A thread inside holds no lock the interpreter's main thread needs: it returns promptly.
    while SCHEDULING.load(Ordering::SeqCst) != 0 {
        std::thread::yield_now();
    }
}

/// In a forked child: no writer thread exists, so none is inside.
pub(crate) fn forget_scheduling_threads() {
    SCHEDULING.store(0, Ordering::SeqCst);
}

/// Asks the interpreter to drop finished jobs on its main thread soon (`Py_AddPendingCall`
/// needs neither the GIL nor a thread state), so exports are released once a batch is applied
/// and not at the next call. At most one such call is outstanding; if the interpreter refuses
/// (its queue is full) or is exiting, the next call from Python, if any, collects instead.
fn schedule_release(shared: &Arc<Shared>) {
    SCHEDULING.fetch_add(1, Ordering::SeqCst);
    if !INTERPRETER_ALIVE.load(Ordering::SeqCst)
        || shared.release_scheduled.swap(true, Ordering::AcqRel)
    {
        SCHEDULING.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let arg = Arc::into_raw(Arc::clone(shared)).cast_mut().cast::<c_void>();
    // SAFETY: `release_done` takes back the reference passed as `arg` exactly once; the
    // interpreter exists: `interpreter_exiting` waits while this thread is counted.
    let status = unsafe { ffi::Py_AddPendingCall(Some(release_done), arg) };
    SCHEDULING.fetch_sub(1, Ordering::SeqCst);
    if status != 0 {
        shared.release_scheduled.store(false, Ordering::Release);
        // SAFETY: the interpreter did not take `arg`; take back the reference made above (not
        // the last one: the writer object holds another while this thread runs).
        drop(unsafe { Arc::from_raw(arg.cast_const().cast::<Shared>()) });
    }
}

/// The pending call: runs on the main thread with the GIL held.
extern "C" fn release_done(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the reference `schedule_release` made with `Arc::into_raw`.
    let shared = unsafe { Arc::from_raw(arg.cast_const().cast::<Shared>()) };
    if shared.generation != fork_generation() {
        // The parent's call, run in a forked child: lock nothing and drop nothing (the jobs'
        // owners are the parent's); leak this reference instead.
        std::mem::forget(shared);
        return 0;
    }
    shared.release_scheduled.store(false, Ordering::Release);
    let (done, growths) = shared.take_done();
    drop(done);
    if !growths.is_empty() {
        // SAFETY: pending calls run with the GIL held.
        let py = unsafe { Python::assume_attached() };
        for num_slots in growths {
            log_growth(py, num_slots);
        }
    }
    // Drops the writer's shared state if this was the last reference (the writer object and
    // its thread are gone): with the GIL held, as dropping owners requires.
    drop(shared);
    0
}

impl NativeWriter {
    fn ensure_same_process(&self) -> PyResult<()> {
        if self.generation != fork_generation() {
            return Err(PyRuntimeError::new_err(
                "this aostore background writer was created in the parent process before fork(); \
                 its thread does not exist here: create a new store and writer in the child",
            ));
        }
        Ok(())
    }

    /// Drops finished jobs and logs growths; needs the GIL, which every caller holds.
    fn collect(&self, py: Python<'_>) {
        self.drop_finished(py, self.shared.take_done());
    }

    /// Drops finished jobs taken out under the lock, after it, and logs the growths.
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
                let state = self.shared.lock();
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
        let shared = &self.shared;
        // An argument error latched earlier: a cell read with the GIL, no Rust lock needed.
        let input_failed = self.input_error.get(py).is_some();
        // With room in the queue, hand the job over without releasing the GIL: the writer thread
        // never waits for the GIL, and other holders of this lock hold it only briefly and never
        // wait for the GIL while holding it, so taking it with the GIL held cannot deadlock. The
        // engine thread pays for this lock once per put: the closed and failed checks, the
        // finished jobs to drop and the hand-over all happen under it; what must be dropped or
        // logged waits until it is released.
        let mut state = shared.lock();
        let finished = (std::mem::take(&mut state.done), std::mem::take(&mut state.growths));
        let refused = if state.closing {
            Some(Err(closed_error()))
        } else if input_failed || state.error.is_some() || state.panic.is_some() {
            Some(Ok(()))
        } else {
            None
        };
        if let Some(refusal) = refused {
            drop(state);
            drop(job);
            self.drop_finished(py, finished);
            refusal?;
            return self.raise_if_failed(py);
        }
        if state.queue.len() < shared.capacity {
            state.queue.push_back(job);
            // A polling writer finds the job on its next tick, unless the queue is filling
            // faster than that: from half full on, wake it now, before a put finds no room.
            let wake = !state.polling || 2 * state.queue.len() >= shared.capacity;
            drop(state);
            if wake {
                shared.work.notify_one();
            }
            self.drop_finished(py, finished);
            return Ok(());
        }
        drop(state);
        self.drop_finished(py, finished);
        let job = {
            let mut state = shared.lock();
            // Full: the writer is woken and, since it never takes the GIL, frees a place while
            // this thread keeps the GIL. Waiting here briefly is cheaper than releasing the GIL:
            // another Python thread would take it, and getting it back can cost a whole
            // switch interval (5 ms).
            shared.work.notify_one();
            let deadline = Instant::now() + FULL_QUEUE_WAIT_WITH_GIL;
            while state.queue.len() >= shared.capacity && !state.closing {
                let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
                state = shared
                    .finished
                    .wait_timeout(state, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            if state.closing {
                drop(state);
                drop(job);
                return Err(closed_error());
            }
            if state.queue.len() < shared.capacity {
                state.queue.push_back(job);
                drop(state);
                shared.work.notify_one();
                return self.raise_if_failed(py);
            }
            job
        };
        // A full queue: wait for room with the GIL released. A refused job comes back out and
        // is dropped here, with the GIL held again.
        let refused = py.detach(move || {
            let mut state = shared.lock();
            while state.queue.len() >= shared.capacity && !state.closing {
                state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            if state.closing {
                return Some(job);
            }
            state.queue.push_back(job);
            drop(state);
            shared.work.notify_one();
            None
        });
        if let Some(job) = refused {
            drop(job);
            return Err(closed_error());
        }
        self.raise_if_failed(py)
    }

    /// Latches an argument error like a writer error and raises "publication failed".
    fn latch_input(&self, py: Python<'_>, error: PyErr) -> PyErr {
        // A second error is dropped here, after `set` returned it: no lock is held.
        let _ = self.input_error.set(py, error.into_value(py));
        self.raise_if_failed(py).expect_err("just latched")
    }

    fn wait_idle(&self, py: Python<'_>) {
        let shared = &self.shared;
        py.detach(|| {
            let mut state = shared.lock();
            if !state.queue.is_empty() {
                // A reader waits: do not leave the queue to the writer's next poll.
                shared.work.notify_one();
            }
            while !state.queue.is_empty() || state.busy {
                state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
        });
    }

    fn is_closed(&self) -> bool {
        self.shared.lock().closing
    }

    /// Stops the thread once the queue is empty and joins it, with the GIL released.
    fn stop_and_join(&self, py: Python<'_>) {
        self.wait_idle(py);
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
        let thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(thread) = thread {
            // A panic outside `apply` would be a bug in this file; `apply`'s are latched.
            let _ = py.detach(|| thread.join());
        }
    }

    /// Marks the close finished and wakes the callers waiting for it.
    fn finish_close(&self) {
        let mut state = self.shared.lock();
        state.closed = true;
        state.closer = None;
        drop(state);
        self.shared.finished.notify_all();
    }
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
                (fixed.get().handle.core()?, Some(fixed.get().object_nbytes()))
            } else if let Ok(variable) = store.cast::<NativeVariableStore>() {
                (variable.get().handle.core()?, None)
            } else {
                return Err(PyTypeError::new_err(format!(
                    "NativeWriter needs an aostore store, not {}",
                    store.get_type().name()?
                )));
            };
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            finished: Condvar::new(),
            capacity: max_pending_batches,
            release_scheduled: AtomicBool::new(false),
            generation: fork_generation(),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("aostore-writer".to_owned())
            .spawn(move || run(&thread_shared, &*core))
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the writer thread: {e}")))?;
        Ok(Self {
            shared,
            store: store.clone().unbind(),
            object_nbytes,
            thread: Mutex::new(Some(thread)),
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
    ///
    /// A caller that arrives while another close runs returns only once the store is closed,
    /// and raises the latched error too; a close after a finished one, or from inside the
    /// first one (the store's `close` calling back), returns at once.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.ensure_same_process()?;
        let me = std::thread::current().id();
        let first = {
            let mut state = self.shared.lock();
            if state.closing {
                // Finished before: idempotent, as vLLM's. From inside the first close: return.
                if state.closed || state.closer == Some(me) {
                    return Ok(());
                }
                false
            } else {
                state.closing = true;
                state.closer = Some(me);
                true
            }
        };
        if !first {
            let shared = &self.shared;
            py.detach(|| {
                let mut state = shared.lock();
                while !state.closed {
                    state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
                }
            });
            self.collect(py);
            return self.raise_if_failed(py);
        }
        // Wake writers blocked on a full queue: they see `closing` and refuse.
        self.shared.finished.notify_all();
        self.stop_and_join(py);
        self.collect(py);
        let closed = self.store.bind(py).call_method0("close");
        self.finish_close();
        closed?;
        self.raise_if_failed(py)
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.is_closed()
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
        // Queued and finished jobs' objects; skipped if the writer holds the lock right now
        // (traversal must not block), which only hides them from this one collection.
        if let Ok(state) = self.shared.state.try_lock() {
            let jobs = state.queue.iter().chain(&state.done).map(|job| &job.owners);
            for owners in jobs.chain(&state.in_flight) {
                for object in &owners.objects {
                    visit.call(object)?;
                }
            }
        }
        Ok(())
    }
}

/// `PyOnceLock::get` wants a GIL token, which traversal may not create; the collector holds
/// the GIL while it traverses, so reading the cell is sound.
fn unsafe_py_for_traverse() -> Python<'static> {
    // SAFETY: only called from `__traverse__`, which CPython runs with the GIL held; the token
    // is used for a read of a cell and nothing else.
    unsafe { Python::assume_attached() }
}

impl NativeWriter {
    fn submit(&self, py: Python<'_>, gathered: PyResult<Gathered<'_>>) -> PyResult<()> {
        // As vLLM: an empty update is a no-op, even on a closed store.
        match gathered {
            Ok(batch) if batch.is_empty() => Ok(()),
            Ok(batch) => {
                // `enqueue` refuses it on a closed store, under the lock it takes anyway.
                let (views, owners) = batch.into_owned();
                self.enqueue(py, Job { views, owners })
            }
            Err(_) if self.is_closed() => Err(closed_error()),
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
            // A forked child: the thread does not exist here and its lock may be held forever.
            // Leak the handle rather than join or lock.
            if let Ok(mut thread) = self.thread.try_lock() {
                std::mem::forget(thread.take());
            }
            return;
        }
        // An abandoned writer (never closed): let the thread apply what is queued and exit,
        // then drop every job here. Deallocation runs with the GIL held.
        Python::attach(|py| {
            self.stop_and_join(py);
            self.collect(py);
        });
    }
}
