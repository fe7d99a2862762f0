//! The writer: one thread in front of a store that applies queued batches in order, latches
//! the first error, and lets a caller wait for it to be idle. foyer's flusher is the model: the
//! writer owns the queue, a submission is typed, and a reader waits for the queue itself.
//!
//! A job is generic over what it applies (`Work`: an owned `Publication` of the data plane, or
//! whatever a binding borrows) and what it keeps alive meanwhile (`Keep`: in the binding, the
//! Python objects whose memory the views borrow). A job whose keep must be dropped elsewhere
//! (with the GIL) is parked in `done` once applied; any other job is dropped on the writer's
//! thread at once, so a caller waiting in C for a whole run does not hold its memory.
//!
//! The state lock is a plain `Mutex`. The methods here that block on it (or on its condvars)
//! are for threads that hold nothing else a writer needs; the binding takes the lock with the
//! GIL through its own helpers and calls the blocking ones with the GIL released.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crate::dataplane::{Publication, Sink};
use crate::error::StoreError;
use crate::store::{
    Allocator, BlockRef, BlockStore, ChunkChains, FixedSlots, Store, VariableStore,
};

/// The store a writer applies batches to, either kind: one `dyn` call per batch. The writer's
/// one handle on it: the thread's puts and the data plane's reads both go through it.
pub trait Target: Send + Sync {
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
pub trait PlaneReads: Allocator + Sized {
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

/// What a queued job applies to the store.
pub trait Work: Send {
    /// Applies the job; the slots a growing store grew to, if it grew.
    fn apply(&self, target: &dyn Target) -> Result<Option<usize>, StoreError>;
}

impl Work for Publication {
    fn apply(&self, target: &dyn Target) -> Result<Option<usize>, StoreError> {
        let (blocks, retains, releases) = publication_views(self)?;
        target.put(&blocks, &retains, &releases)
    }
}

/// A batch as the store takes it: blocks, keys to retain, keys to release.
pub type BatchViews<'a> = (Vec<BlockRef<'a>>, Vec<&'a str>, Vec<&'a str>);

/// A data-plane call as the store takes it, borrowed from the publication itself; one too
/// large for memory is refused (`OutOfMemory`), as a binding's views are.
fn publication_views(publication: &Publication) -> Result<BatchViews<'_>, StoreError> {
    let mut blocks = reserved(publication.objects.len())?;
    let mut keys = reserved(publication.retains.len() + publication.releases.len())?;
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

/// An empty vector with room for `n`, or `OutOfMemory`: a batch's views are made without
/// aborting on a call too large for memory.
pub fn reserved<T>(n: usize) -> Result<Vec<T>, StoreError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| StoreError::OutOfMemory {
        what: "call's keys",
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
    })?;
    Ok(v)
}

/// What a job keeps alive while it waits and while it is applied.
pub trait Keep: Send + Default {
    /// Whether it must be dropped by its owner (parked in `done`), not on the writer thread.
    fn must_park(&self) -> bool;
}

/// One queued batch, and what keeps its memory alive.
pub struct Job<W, K> {
    pub work: W,
    pub keep: K,
}

/// The writer's books, behind its one lock.
pub struct State<W, K> {
    pub queue: VecDeque<Job<W, K>>,
    busy: bool,
    stop: bool,
    /// The writer polls on a timer (`wait_for_work`), so a put need not wake it.
    polling: bool,
    /// `close()` has started: no more puts.
    pub closing: bool,
    /// `close()` has finished (the store is closed): later closers stop waiting.
    closed: bool,
    /// The thread running `close()`, so a re-entrant close does not wait for itself.
    closer: Option<ThreadId>,
    /// The first error; later jobs are skipped.
    pub error: Option<StoreError>,
    /// A panic in the writer thread, latched like an error.
    pub panic: Option<String>,
    /// What the job being applied keeps, off the queue so its length counts waiting jobs as
    /// vLLM's does.
    pub in_flight: Option<K>,
    /// Applied jobs whose keep must be dropped by its owner.
    pub done: Vec<Job<W, K>>,
    /// Profile `grow`: growths for the owner to log.
    pub growths: Vec<usize>,
}

impl<W, K> Default for State<W, K> {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
            busy: false,
            stop: false,
            polling: false,
            closing: false,
            closed: false,
            closer: None,
            error: None,
            panic: None,
            in_flight: None,
            done: Vec::new(),
            growths: Vec::new(),
        }
    }
}

impl<W, K> State<W, K> {
    /// Whether an error or a panic is latched.
    pub fn failed(&self) -> bool {
        self.error.is_some() || self.panic.is_some()
    }

    /// Applied jobs to drop and growths to log, taken for the owner.
    pub fn take_done(&mut self) -> (Vec<Job<W, K>>, Vec<usize>) {
        (std::mem::take(&mut self.done), std::mem::take(&mut self.growths))
    }
}

/// Why the writer refused a call.
#[derive(Debug)]
pub enum Refusal {
    /// `close()` has started ("auxiliary output store is closed").
    Closed,
    /// An error is latched.
    Failed,
    /// The store refused a read.
    Store(StoreError),
}

/// Who `close()`'s caller is among the closers.
pub enum Closing {
    /// The first: it drains, stops and closes.
    First,
    /// Another thread's close is under way: wait for it (`wait_closed`).
    Wait,
    /// Closed before, or this thread's own close calls again: nothing to do.
    Done,
}

/// How long the writer polls after its last job before it sleeps until woken.
const POLL_FOR: Duration = Duration::from_millis(50);

/// The writer's polling period once the engine has been quiet for 2 ms.
const POLL_PERIOD: Duration = Duration::from_millis(1);

/// The queue, its thread's loop, and the calls that meet it.
pub struct Writer<W, K> {
    state: Mutex<State<W, K>>,
    /// Signalled when a job is queued or the writer must stop.
    work: Condvar,
    /// Signalled when a job finishes or `close()` does.
    finished: Condvar,
    capacity: usize,
    /// The store, for the thread's puts and the data plane's reads alike.
    target: std::sync::Arc<dyn Target>,
    /// Tests: how long the thread waits before applying each job (a writer held back).
    apply_delay_us: AtomicU64,
    /// Tests: a put or hand-over returns once its job is applied, so which call reports a
    /// failed put does not depend on how far the thread got.
    synchronous: AtomicBool,
}

impl<W: Work, K: Keep> Writer<W, K> {
    /// A writer of at most `capacity` waiting jobs (at least 1) in front of `target`.
    pub fn new(target: std::sync::Arc<dyn Target>, capacity: usize) -> Self {
        Self {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            finished: Condvar::new(),
            capacity: capacity.max(1),
            target,
            apply_delay_us: AtomicU64::new(0),
            synchronous: AtomicBool::new(false),
        }
    }

    /// The lock, for a binding that takes it its own way (never blocking with the GIL).
    pub fn state(&self) -> &Mutex<State<W, K>> {
        &self.state
    }

    /// Takes the lock where waiting for it blocks no one the holder needs.
    pub fn lock(&self) -> MutexGuard<'_, State<W, K>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The writer thread's loop, until `stop`: `parked` runs after a job is parked in `done`
    /// or a growth is booked (the owner's cue to collect), with no lock held.
    pub fn run(&self, parked: &dyn Fn()) {
        crate::sched::yield_to_running_threads();
        loop {
            let (work, skip) = {
                let mut state = self.lock();
                let idle_since = Instant::now();
                loop {
                    if let Some(Job { work, keep }) = state.queue.pop_front() {
                        state.busy = true;
                        state.in_flight = Some(keep);
                        break (work, state.failed());
                    }
                    if state.stop {
                        return;
                    }
                    state = self.wait_for_work(state, idle_since.elapsed());
                }
            };
            let delay = self.apply_delay_us.load(Ordering::Relaxed);
            if delay > 0 {
                std::thread::sleep(Duration::from_micros(delay));
            }
            let outcome = match skip {
                true => None,
                false => {
                    Some(std::panic::catch_unwind(AssertUnwindSafe(|| work.apply(&*self.target))))
                }
            };
            let mut state = self.lock();
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
            let job = Job { work, keep: state.in_flight.take().unwrap_or_default() };
            state.busy = false;
            let dropped_here = match job.keep.must_park() {
                true => {
                    state.done.push(job);
                    None
                }
                false => Some(job),
            };
            let cue = dropped_here.is_none() || !state.growths.is_empty();
            drop(state);
            self.finished.notify_all();
            drop(dropped_here);
            if cue {
                parked();
            }
        }
    }

    /// Waits for a job: within `POLL_FOR` of the last the writer polls, so a put need not wake
    /// it (waking an idle CPU costs the engine an interrupt: docs/performance.md); then it
    /// sleeps.
    fn wait_for_work<'a>(
        &'a self,
        mut state: MutexGuard<'a, State<W, K>>,
        idle: Duration,
    ) -> MutexGuard<'a, State<W, K>> {
        if idle < POLL_FOR {
            state.polling = true;
            let period = match idle < Duration::from_millis(2) {
                true => Duration::from_micros(200),
                false => POLL_PERIOD,
            };
            self.work.wait_timeout(state, period).unwrap_or_else(PoisonError::into_inner).0
        } else {
            state.polling = false;
            self.work.wait(state).unwrap_or_else(PoisonError::into_inner)
        }
    }

    /// Why a put would be refused now, if it would.
    pub fn refusal(state: &State<W, K>) -> Option<Refusal> {
        match (state.closing, state.failed()) {
            (true, _) => Some(Refusal::Closed),
            (false, true) => Some(Refusal::Failed),
            (false, false) => None,
        }
    }

    /// Queues `job` if there is room (the job back if not), and wakes the thread unless it
    /// polls and the queue is under half full. Releases the lock.
    pub fn offer(
        &self,
        mut state: MutexGuard<'_, State<W, K>>,
        job: Job<W, K>,
    ) -> Result<(), Job<W, K>> {
        if state.queue.len() >= self.capacity {
            return Err(job);
        }
        state.queue.push_back(job);
        // A polling writer finds the job on its next tick; from half full on, wake it now.
        let wake = !state.polling || 2 * state.queue.len() >= self.capacity;
        drop(state);
        if wake {
            self.work.notify_one();
        }
        Ok(())
    }

    /// Waits until there is room for a job, `close()` starts, or `deadline` passes; wakes the
    /// thread first, as a waiting caller must not wait for its next poll.
    pub fn wait_for_room<'a>(
        &'a self,
        mut state: MutexGuard<'a, State<W, K>>,
        deadline: Option<Instant>,
    ) -> MutexGuard<'a, State<W, K>> {
        self.work.notify_one();
        while state.queue.len() >= self.capacity && !state.closing {
            state = match deadline {
                None => self.finished.wait(state).unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                        break;
                    };
                    self.finished
                        .wait_timeout(state, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
        state
    }

    /// Queues `job`, waiting while the queue is full; the job back if `close()` started.
    pub fn push(&self, job: Job<W, K>) -> Result<(), Job<W, K>> {
        let state = self.wait_for_room(self.lock(), None);
        if state.closing {
            return Err(job);
        }
        self.offer(state, job)
    }

    /// Queues a job that keeps nothing its owner must drop (refused ones are dropped here),
    /// waiting while the queue is full; refused after `close()` or a latched error.
    pub fn hand_over(&self, work: W) -> Result<(), Refusal> {
        let mut state = self.lock();
        loop {
            if let Some(refusal) = Self::refusal(&state) {
                return Err(refusal);
            }
            if state.queue.len() < self.capacity {
                break;
            }
            state = self.wait_for_room(state, None);
        }
        let queued = self.offer(state, Job { work, keep: K::default() });
        debug_assert!(queued.is_ok(), "room was made under the lock");
        self.settle_if_synchronous();
        Ok(())
    }

    /// For tests: waits for the queue when puts are synchronous.
    pub fn settle_if_synchronous(&self) {
        if self.is_synchronous() {
            self.wait_idle();
        }
    }

    /// For tests: whether each put returns once its job is applied.
    pub fn is_synchronous(&self) -> bool {
        self.synchronous.load(Ordering::Relaxed)
    }

    /// Waits until every queued job is applied.
    pub fn wait_idle(&self) {
        let mut state = self.lock();
        if !state.queue.is_empty() {
            // A reader waits: do not leave the queue to the writer's next poll.
            self.work.notify_one();
        }
        while !state.queue.is_empty() || state.busy {
            state = self.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// `get_concatenated(keys)` into `out`: waits for queued jobs, refuses after a latched
    /// error, then reads the store.
    pub fn read(&self, keys: &[&str], out: &mut Vec<u8>) -> Result<(), Refusal> {
        self.wait_idle();
        if self.lock().failed() {
            return Err(Refusal::Failed);
        }
        match self.target.read(keys, out) {
            Some(read) => read.map_err(Refusal::Store),
            None => Err(Refusal::Closed),
        }
    }

    /// Once the queue is applied, tells the thread to stop; the caller joins it.
    pub fn stop(&self) {
        self.wait_idle();
        self.lock().stop = true;
        self.work.notify_all();
    }

    /// Marks `close()` begun by thread `me`, unless it was before.
    pub fn begin_close(&self, state: &mut State<W, K>, me: ThreadId) -> Closing {
        if state.closing {
            // Finished before: idempotent, as vLLM's. From inside the first close: return.
            return match state.closed || state.closer == Some(me) {
                true => Closing::Done,
                false => Closing::Wait,
            };
        }
        state.closing = true;
        state.closer = Some(me);
        Closing::First
    }

    /// After `begin_close`: callers waiting for room see `closing` and give up.
    pub fn wake_waiting_callers(&self) {
        self.finished.notify_all();
    }

    /// Waits until the first `close()` has finished.
    pub fn wait_closed(&self) {
        let mut state = self.lock();
        while !state.closed {
            state = self.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The first `close()` has finished.
    pub fn finish_close(&self, mut state: MutexGuard<'_, State<W, K>>) {
        state.closed = true;
        state.closer = None;
        drop(state);
        self.finished.notify_all();
    }

    /// For tests: the thread waits `delay` before applying each job.
    pub fn hold_back(&self, delay: Duration) {
        self.apply_delay_us.store(delay.as_micros() as u64, Ordering::Relaxed);
    }

    /// For tests: each put returns once its job is applied.
    pub fn set_synchronous(&self, on: bool) {
        self.synchronous.store(on, Ordering::Relaxed);
    }
}

/// The data plane's calls go through the writer: a publication is queued owned, a read waits
/// for the queue.
impl<W: Work + From<Publication>, K: Keep> Sink for &Writer<W, K> {
    type Error = Refusal;

    fn put(&mut self, publication: Publication) -> Result<(), Refusal> {
        self.hand_over(W::from(publication))
    }

    fn get_concatenated(&mut self, keys: &[&str], out: &mut Vec<u8>) -> Result<(), Refusal> {
        self.read(keys, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Default)]
    struct Nothing;

    impl Keep for Nothing {
        fn must_park(&self) -> bool {
            false
        }
    }

    #[derive(Default)]
    struct Parked;

    impl Keep for Parked {
        fn must_park(&self) -> bool {
            true
        }
    }

    /// A put of one key.
    struct One(&'static str, Vec<u8>);

    impl Work for One {
        fn apply(&self, target: &dyn Target) -> Result<Option<usize>, StoreError> {
            target.put(&[BlockRef { key: self.0, payload: &self.1 }], &[], &[])
        }
    }

    fn store(num_slots: usize) -> Arc<Mutex<BlockStore>> {
        Arc::new(Mutex::new(BlockStore::new(num_slots * 4, 4).expect("a valid size")))
    }

    fn started<K: Keep + 'static>(
        target: Arc<dyn Target>,
        capacity: usize,
    ) -> (Arc<Writer<One, K>>, std::thread::JoinHandle<()>, Arc<AtomicU64>) {
        let writer = Arc::new(Writer::new(target, capacity));
        let cues = Arc::new(AtomicU64::new(0));
        let (thread_writer, thread_cues) = (Arc::clone(&writer), Arc::clone(&cues));
        let thread = std::thread::spawn(move || {
            thread_writer.run(&|| {
                thread_cues.fetch_add(1, Ordering::Relaxed);
            })
        });
        (writer, thread, cues)
    }

    #[test]
    fn jobs_are_applied_in_order_and_a_read_waits_for_them() {
        let target = store(8);
        let (writer, thread, cues) = started::<Nothing>(target.clone(), 2);
        writer.hold_back(Duration::from_millis(2));
        for (key, byte) in [("a", 1u8), ("b", 2), ("c", 3)] {
            assert!(writer.push(Job { work: One(key, vec![byte; 4]), keep: Nothing }).is_ok());
        }
        let mut out = Vec::new();
        writer.read(&["c", "a"], &mut out).expect("readable");
        assert_eq!(out, [3, 3, 3, 3, 1, 1, 1, 1]);
        assert_eq!(cues.load(Ordering::Relaxed), 0, "each job dropped on the thread, no cue");
        assert!(writer.lock().done.is_empty());
        writer.stop();
        thread.join().expect("the thread ends");
    }

    #[test]
    fn a_job_that_must_be_parked_waits_in_done_for_its_owner() {
        let (writer, thread, cues) = started::<Parked>(store(8), 4);
        assert!(writer.push(Job { work: One("a", vec![7; 4]), keep: Parked }).is_ok());
        writer.wait_idle();
        let (done, growths) = writer.lock().take_done();
        assert_eq!((done.len(), growths.len()), (1, 0));
        // The cue follows the notification: wait for it a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        while cues.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(cues.load(Ordering::Relaxed), 1);
        writer.stop();
        thread.join().expect("the thread ends");
    }

    #[test]
    fn the_first_error_is_latched_and_later_jobs_are_skipped_and_refused() {
        let target = store(8);
        let (writer, thread, _) = started::<Nothing>(target.clone(), 4);
        let wrong_size = Job { work: One("bad", vec![0; 3]), keep: Nothing };
        assert!(writer.push(wrong_size).is_ok());
        writer.wait_idle();
        assert!(matches!(writer.lock().error, Some(StoreError::PayloadSize { .. })));
        assert!(writer.push(Job { work: One("skipped", vec![1; 4]), keep: Nothing }).is_ok());
        writer.wait_idle();
        assert!(!target.lock().unwrap().contains("skipped"), "a job after the error is skipped");
        assert!(matches!(writer.hand_over(One("x", vec![1; 4])), Err(Refusal::Failed)));
        assert!(matches!(writer.read(&["bad"], &mut Vec::new()), Err(Refusal::Failed)));
        writer.stop();
        thread.join().expect("the thread ends");
    }

    #[test]
    fn a_full_queue_waits_for_room_and_close_refuses_what_waits() {
        let writer = Arc::new(Writer::<One, Nothing>::new(store(64), 1));
        let job = |key| Job { work: One(key, vec![1; 4]), keep: Nothing };
        // No thread yet: the queue of one is full after one job.
        assert!(writer.push(job("a")).is_ok());
        let deadline = Instant::now() + Duration::from_millis(1);
        let state = writer.wait_for_room(writer.lock(), Some(deadline));
        assert!(writer.offer(state, job("b")).is_err(), "no room within 1 ms");
        // A thread started later makes the room a waiting push needs.
        let thread_writer = Arc::clone(&writer);
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            thread_writer.run(&|| {});
        });
        assert!(writer.push(job("c")).is_ok());
        let me = std::thread::current().id();
        assert!(matches!(writer.begin_close(&mut writer.lock(), me), Closing::First));
        writer.wake_waiting_callers();
        assert!(writer.push(job("d")).is_err());
        assert!(matches!(writer.hand_over(One("e", vec![1; 4])), Err(Refusal::Closed)));
        assert!(matches!(writer.begin_close(&mut writer.lock(), me), Closing::Done), "re-entrant");
        writer.finish_close(writer.lock());
        writer.wait_closed();
        writer.stop();
        thread.join().expect("the thread ends");
        let mut out = Vec::new();
        writer.read(&["a", "c"], &mut out).expect("both applied before the close");
    }
}
