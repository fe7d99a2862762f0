//! The Rust background writer: `put` hands a batch over and returns; an OS thread applies it
//! without ever taking the GIL. Rules, each from a deadlock or crash: the thread never owns a
//! Python reference (finished jobs are dropped by a GIL holder, soon via a pending call); no
//! Python object is made, dropped or called under the state mutex; the thread holds the core
//! (`SharedCore`), not the Python store, and dropping the writer joins it with the GIL released.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::raw::c_int;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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

use super::gather::{batch_views, BatchViews, Gathered, OwnedViews, Owners};
use super::lock::{detach, DetachedMutex, Unattached};
use super::variable::NativeVariableStore;
use super::{fork_generation, log_growth, to_py_err, BlockObjectStoreError, NativeStore};
use crate::dataplane::Publication;
use crate::error::StoreError;
use crate::store::BlockRef;
use crate::store::{Allocator, BlockStore, ChunkChains, FixedSlots, Store, VariableStore};

/// What a queued job applies.
enum Batch {
    /// A `put` or `put_blocks`: views into Python memory, owned by the job's `owners`.
    Borrowed(OwnedViews),
    /// A data-plane call: its own keys and payloads, no Python object (no owners), read as
    /// they are, and dropped on the writer thread once applied.
    Owned(Publication),
}

/// One queued batch, and the Python objects that own its memory, if any.
struct Job {
    batch: Batch,
    /// Keep the memory alive and in place; dropped only with the GIL.
    owners: Owners,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    busy: bool,
    stop: bool,
    /// The writer polls on a timer (`wait_for_work`), so a `put` need not wake it.
    polling: bool,
    /// `close()` has started: no more puts.
    closing: bool,
    /// `close()` has finished (the store is closed): later closers stop waiting.
    closed: bool,
    /// The thread running `close()`, so a re-entrant close does not wait for itself.
    closer: Option<ThreadId>,
    /// The first error; later jobs are skipped.
    error: Option<StoreError>,
    /// A panic in the writer thread, latched like an error.
    panic: Option<String>,
    /// Owners of the job being applied, off the queue so its length counts waiting jobs as vLLM's.
    in_flight: Option<Owners>,
    done: Vec<Job>,
    /// Profile `grow`: growths to log with the GIL.
    growths: Vec<usize>,
}

struct Shared {
    /// Taken by the writer thread (never attached) and by callers with or without the GIL.
    state: DetachedMutex<State>,
    /// Signalled when a job is queued or the writer must stop.
    work: Condvar,
    /// Signalled when a job finishes or `close()` does.
    finished: Condvar,
    capacity: usize,
    /// A pending call that drops `done` is scheduled and has not run yet.
    release_scheduled: AtomicBool,
    /// `fork_generation()` at creation: a child runs the parent's pending calls, with a dead lock.
    generation: u64,
    /// Tests: how long the thread waits before applying each job (a writer held back).
    apply_delay_us: AtomicU64,
    /// Tests: a put or hand-over returns once its job is applied, so which call reports a
    /// failed put does not depend on how far the thread got (`_synchronous`).
    synchronous: AtomicBool,
}

impl Shared {
    /// Finished jobs and growths, taken under the lock and dropped after it.
    fn take_done(&self, py: Python<'_>) -> (Vec<Job>, Vec<usize>) {
        let mut state = self.state.lock(py);
        (std::mem::take(&mut state.done), std::mem::take(&mut state.growths))
    }
}

/// The store a writer applies batches to, either kind: one `dyn` call per batch. The writer's
/// one handle on it: the thread's puts and the data plane's reads both go through it.
trait Target: Send + Sync {
    /// Applies one batch; the fixed store in profile `grow` reports the slots it grew to.
    fn put(
        &self,
        blocks: &[BlockRef<'_>],
        retains: &[&str],
        releases: &[&str],
    ) -> Result<Option<usize>, StoreError>;

    /// `get_concatenated(keys)` into `out`, for the data plane; `None` from the variable
    /// store, which the plane does not use.
    fn read(&self, keys: &[&str], out: &mut Vec<u8>) -> Option<Result<(), StoreError>>;
}

/// What the data plane may read back from a store kind: the fixed store's
/// `get_concatenated`; the variable store, which the plane does not use, reads nothing.
trait PlaneReads: Allocator + Sized {
    fn read(
        store: &mut Store<Self>,
        keys: &[&str],
        out: &mut Vec<u8>,
    ) -> Option<Result<(), StoreError>>;
}

impl PlaneReads for FixedSlots {
    fn read(
        store: &mut BlockStore,
        keys: &[&str],
        out: &mut Vec<u8>,
    ) -> Option<Result<(), StoreError>> {
        out.clear();
        out.resize(keys.len() * store.object_nbytes(), 0);
        Some(store.get_into(keys, out))
    }
}

impl PlaneReads for ChunkChains {
    fn read(_: &mut VariableStore, _: &[&str], _: &mut Vec<u8>) -> Option<Result<(), StoreError>> {
        None
    }
}

impl<A: PlaneReads> Target for Mutex<Store<A>> {
    fn put(
        &self,
        blocks: &[BlockRef<'_>],
        retains: &[&str],
        releases: &[&str],
    ) -> Result<Option<usize>, StoreError> {
        let mut store = self.lock().unwrap_or_else(PoisonError::into_inner);
        store.put(blocks, retains, releases).map(|report| A::grown_to(&report))
    }

    fn read(&self, keys: &[&str], out: &mut Vec<u8>) -> Option<Result<(), StoreError>> {
        A::read(&mut self.lock().unwrap_or_else(PoisonError::into_inner), keys, out)
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
    /// The store's core, shared with the thread: the data plane's reads without the GIL.
    core: Arc<dyn Target>,
}

/// Why the writer refused a data-plane call; the binding raises it once it holds the GIL.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// `close()` has started ("auxiliary output store is closed").
    Closed,
    /// An error is latched: raised as the writer's `BlockObjectStoreError`.
    Failed,
    /// The store refused a read.
    Store(StoreError),
    /// A forked child: the writer's thread is the parent's.
    Forked,
}

fn run(shared: &Arc<Shared>, core: &dyn Target) {
    let unattached = Unattached::native_thread();
    crate::sched::yield_to_running_threads();
    loop {
        let (batch, skip) = {
            let mut state = shared.state.lock_unattached(unattached);
            let idle_since = Instant::now();
            loop {
                if let Some(Job { batch, owners }) = state.queue.pop_front() {
                    state.busy = true;
                    state.in_flight = Some(owners);
                    break (batch, state.error.is_some() || state.panic.is_some());
                }
                if state.stop {
                    return;
                }
                state = wait_for_work(shared, state, idle_since.elapsed());
            }
        };
        let delay = shared.apply_delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        let outcome = if skip {
            None
        } else {
            Some(std::panic::catch_unwind(AssertUnwindSafe(|| apply(core, &batch))))
        };
        let mut state = shared.state.lock_unattached(unattached);
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
        let job = Job { batch, owners: state.in_flight.take().unwrap_or_default() };
        state.busy = false;
        // A data-plane call owns its bytes and no Python object: this thread drops it at once,
        // not parked until the main thread runs Python (it may wait in C for the whole run).
        let owned = match job.owners.hold_python() {
            true => {
                state.done.push(job);
                None
            }
            false => Some(job),
        };
        let release = owned.is_none() || !state.growths.is_empty();
        drop(state);
        shared.finished.notify_all();
        drop(owned);
        if release {
            schedule_release(shared);
        }
    }
}

/// How long the writer polls after its last job before it sleeps until woken.
const POLL_FOR: Duration = Duration::from_millis(50);

/// Waits for a job: within `POLL_FOR` of the last the writer polls, so `put` need not wake it
/// (waking an idle CPU costs the engine an interrupt: docs/performance.md); then it sleeps.
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

/// How long a `put` on a full queue waits with the GIL held (the writer frees room in µs).
const FULL_QUEUE_WAIT_WITH_GIL: Duration = Duration::from_millis(1);

/// The writer's polling period once the engine has been quiet for 2 ms.
const POLL_PERIOD: Duration = Duration::from_millis(1);

fn apply(core: &dyn Target, batch: &Batch) -> Result<Option<usize>, StoreError> {
    let (blocks, retains, releases) = match batch {
        Batch::Borrowed(views) => {
            // SAFETY: the views borrow from this job's owners, kept in `State::in_flight` until
            // after this.
            unsafe { batch_views(&views.blocks, &views.retains, &views.releases) }?
        }
        Batch::Owned(publication) => publication_views(publication)?,
    };
    core.put(&blocks, &retains, &releases)
}

/// A data-plane call as the store takes it, borrowed from the publication itself; one too
/// large for memory is refused (`OutOfMemory`), as `batch_views` refuses it.
fn publication_views(publication: &Publication) -> Result<BatchViews<'_>, StoreError> {
    let mut blocks = Vec::new();
    let mut keys = Vec::new();
    let wanted = publication.objects.len();
    let references = publication.retains.len() + publication.releases.len();
    if blocks.try_reserve_exact(wanted).is_err() || keys.try_reserve_exact(references).is_err() {
        return Err(StoreError::OutOfMemory {
            what: "call's keys",
            bytes: wanted.saturating_mul(std::mem::size_of::<BlockRef<'_>>()),
        });
    }
    blocks.extend(publication.objects.iter().map(|(key, payload)| BlockRef {
        key: publication.key(key),
        payload: &publication.payload[payload.clone()],
    }));
    keys.extend(
        publication.retains.iter().chain(&publication.releases).map(|k| publication.key(k)),
    );
    let releases = keys.split_off(publication.retains.len());
    Ok((blocks, keys, releases))
}

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
                let state = self.shared.state.lock(py);
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
        let input_failed = self.input_error.get(py).is_some();
        // Checks, drops and hand-over share this one lock a put.
        let mut state = shared.state.lock(py);
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
            // A polling writer finds the job on its next tick; from half full on, wake it now.
            let wake = !state.polling || 2 * state.queue.len() >= shared.capacity;
            drop(state);
            if wake {
                shared.work.notify_one();
            }
            self.drop_finished(py, finished);
            if shared.synchronous.load(Ordering::Relaxed) {
                self.wait_idle(py);
            }
            return Ok(());
        }
        drop(state);
        self.drop_finished(py, finished);
        let job = {
            let mut state = shared.state.lock(py);
            // Full: the writer frees a place without the GIL, so wait briefly with it held;
            // getting a released GIL back can cost a whole switch interval (5 ms). The one wait
            // on this lock with the GIL: the condvar takes it back from a holder that never
            // waits for the GIL (the writer thread, or a caller for microseconds).
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
                if shared.synchronous.load(Ordering::Relaxed) {
                    self.wait_idle(py);
                }
                return self.raise_if_failed(py);
            }
            job
        };
        // Full: wait with the GIL released; a refused job comes back and is dropped with the GIL.
        let refused = detach(py, move |unattached| {
            let mut state = shared.state.lock_unattached(unattached);
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
        if shared.synchronous.load(Ordering::Relaxed) {
            self.wait_idle(py);
        }
        self.raise_if_failed(py)
    }

    /// Latches an argument error like a writer error and raises "publication failed".
    fn latch_input(&self, py: Python<'_>, error: PyErr) -> PyErr {
        // A second error is dropped here, with no lock held.
        let _ = self.input_error.set(py, error.into_value(py));
        self.raise_if_failed(py).expect_err("just latched")
    }

    fn wait_idle(&self, py: Python<'_>) {
        detach(py, |unattached| self.wait_idle_detached(unattached));
    }

    /// Waits until every queued job is applied, with the GIL released.
    fn wait_idle_detached(&self, unattached: Unattached) {
        let shared = &self.shared;
        let mut state = shared.state.lock_unattached(unattached);
        if !state.queue.is_empty() {
            // A reader waits: do not leave the queue to the writer's next poll.
            shared.work.notify_one();
        }
        while !state.queue.is_empty() || state.busy {
            state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Whether the writer can take a data-plane call: a fixed store, in this process.
    pub(crate) fn serves_data_plane(&self) -> bool {
        self.object_nbytes.is_some() && self.generation == fork_generation()
    }

    /// Whether an argument error from a Python caller is latched (needs the GIL).
    pub(crate) fn input_failed(&self, py: Python<'_>) -> bool {
        self.input_error.get(py).is_some()
    }

    /// Queues one data-plane call, owned whole, with the GIL released: the job holds no Python
    /// object, so a refused one may be dropped here. Waits while the queue is full.
    pub(crate) fn hand_over(
        &self,
        publication: Publication,
        unattached: Unattached,
    ) -> Result<(), Refusal> {
        if self.generation != fork_generation() {
            return Err(Refusal::Forked);
        }
        let shared = &self.shared;
        let mut state = shared.state.lock_unattached(unattached);
        loop {
            if state.closing {
                return Err(Refusal::Closed);
            }
            if state.error.is_some() || state.panic.is_some() {
                return Err(Refusal::Failed);
            }
            if state.queue.len() < shared.capacity {
                break;
            }
            shared.work.notify_one();
            state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        state.queue.push_back(Job { batch: Batch::Owned(publication), owners: Owners::default() });
        let wake = !state.polling || 2 * state.queue.len() >= shared.capacity;
        drop(state);
        if wake {
            shared.work.notify_one();
        }
        if shared.synchronous.load(Ordering::Relaxed) {
            self.wait_idle_detached(unattached);
        }
        Ok(())
    }

    /// `get_concatenated(keys)` with the GIL released: waits for queued jobs, refuses after a
    /// latched error, then reads the store.
    pub(crate) fn read_detached(
        &self,
        keys: &[&str],
        out: &mut Vec<u8>,
        unattached: Unattached,
    ) -> Result<(), Refusal> {
        if self.generation != fork_generation() {
            return Err(Refusal::Forked);
        }
        self.wait_idle_detached(unattached);
        {
            let state = self.shared.state.lock_unattached(unattached);
            if state.error.is_some() || state.panic.is_some() {
                return Err(Refusal::Failed);
            }
        }
        match self.core.read(keys, out) {
            Some(read) => read.map_err(Refusal::Store),
            None => Err(Refusal::Closed),
        }
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
            Refusal::Forked => forked_error(),
        }
    }

    fn is_closed(&self, py: Python<'_>) -> bool {
        self.shared.state.lock(py).closing
    }

    /// Stops the thread once the queue is empty and joins it, with the GIL released.
    fn stop_and_join(&self, py: Python<'_>) {
        self.wait_idle(py);
        self.shared.state.lock(py).stop = true;
        self.shared.work.notify_all();
        let thread = self.thread.lock(py).take();
        if let Some(thread) = thread {
            // A panic outside `apply` is a bug here; `apply`'s are latched.
            let _ = py.detach(|| thread.join());
        }
    }

    fn finish_close(&self, py: Python<'_>) {
        let mut state = self.shared.state.lock(py);
        state.closed = true;
        state.closer = None;
        drop(state);
        self.shared.finished.notify_all();
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
            state: DetachedMutex::new(State::default()),
            work: Condvar::new(),
            finished: Condvar::new(),
            capacity: max_pending_batches,
            release_scheduled: AtomicBool::new(false),
            generation: fork_generation(),
            apply_delay_us: AtomicU64::new(0),
            synchronous: AtomicBool::new(false),
        });
        let thread_shared = Arc::clone(&shared);
        let thread_core = Arc::clone(&core);
        let thread = std::thread::Builder::new()
            .name("aostore-writer".to_owned())
            .spawn(move || run(&thread_shared, &*thread_core))
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the writer thread: {e}")))?;
        Ok(Self {
            shared,
            store: store.clone().unbind(),
            object_nbytes,
            thread: DetachedMutex::new(Some(thread)),
            input_error: PyOnceLock::new(),
            generation: fork_generation(),
            core,
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
        let first = {
            let mut state = self.shared.state.lock(py);
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
            detach(py, |unattached| {
                let mut state = shared.state.lock_unattached(unattached);
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
        self.finish_close(py);
        closed?;
        self.raise_if_failed(py)
    }

    /// For tests: the writer waits `seconds` before applying each queued job, so callers run
    /// ahead of it (as behind a slow store); 0 restores normal service.
    fn _hold_back(&self, seconds: f64) -> PyResult<()> {
        if !(0.0..=10.0).contains(&seconds) {
            return Err(PyValueError::new_err("seconds must be within [0, 10]"));
        }
        self.shared.apply_delay_us.store((seconds * 1e6) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// For tests: each put (and data-plane hand-over) returns once its job is applied, so a
    /// failed put is reported by the next call, never by itself, however fast the thread runs
    /// (vLLM's writer may or may not have applied a put before its own error check; the
    /// connector differential makes vLLM's do the same). `False` restores normal service.
    fn _synchronous(&self, on: bool) {
        self.shared.synchronous.store(on, Ordering::Relaxed);
    }

    /// For tests: once the queue is applied, how many applied jobs that hold no Python object
    /// (a data-plane call's own bytes) are still parked for the main thread to drop; the writer
    /// thread drops those itself, so 0. Collects nothing (`wait` would drop them).
    fn _parked_owned_jobs(&self, py: Python<'_>) -> PyResult<usize> {
        self.ensure_same_process()?;
        detach(py, |unattached| self.wait_idle_detached(unattached));
        Ok(self.shared.state.lock(py).done.iter().filter(|job| !job.owners.hold_python()).count())
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
        if let Some(state) = self.shared.state.try_lock() {
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
                self.enqueue(py, Job { batch: Batch::Borrowed(views), owners })
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
