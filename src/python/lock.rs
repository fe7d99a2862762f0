//! The locks of the binding: `StoreLock` in front of a store's core, shared by both native
//! stores, and `DetachedMutex` for state that threads without the GIL share.
//!
//! The store lock is taken only with the GIL released, so a thread holding it can always get the GIL back.
//! The one exception is a victim policy, which runs Python while the lock is held; two rules
//! keep that from deadlocking: a policy that calls back into its own store (same thread) gets
//! an error at once, and a thread that waits while a policy callback holds the lock gives up
//! after `POLICY_WAIT_LIMIT` (the callback may be waiting for that very thread).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use pyo3::Python;

use crate::error::StoreError;

/// How long a thread waits on a store whose lock a victim policy callback holds.
pub(crate) const POLICY_WAIT_LIMIT: Duration = Duration::from_secs(2);

thread_local! {
    /// Stores whose lock this thread holds, by address.
    static HELD: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A store's core behind its mutex, with what the lock rules need to know.
pub(crate) struct StoreLock<'a, T> {
    pub(crate) mutex: &'a Mutex<T>,
    /// The store object's address: identifies it in this thread's `HELD` list.
    pub(crate) owner: usize,
    /// Whether the store has a victim policy (only then can Python run under the lock).
    pub(crate) has_policy: bool,
    /// Set while a policy callback runs.
    pub(crate) in_policy: &'a AtomicBool,
}

/// The guard plus this thread's record of holding it.
pub(crate) struct Held<'a, T> {
    pub(crate) guard: MutexGuard<'a, T>,
    address: usize,
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(at) = held.iter().rposition(|&a| a == self.address) {
                held.remove(at);
            }
        });
    }
}

impl<'a, T> StoreLock<'a, T> {
    pub(crate) fn acquire(&self) -> Result<Held<'a, T>, StoreError> {
        if HELD.with(|held| held.borrow().contains(&self.owner)) {
            return Err(StoreError::Policy(
                "a victim policy must not call back into its store".to_owned(),
            ));
        }
        // A panic in the core is a bug; the state stays memory-safe and `check()` tells the rest.
        let guard = match self.mutex.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => self.wait()?,
        };
        HELD.with(|held| held.borrow_mut().push(self.owner));
        Ok(Held { guard, address: self.owner })
    }

    /// Waits for the lock: plainly without a policy (nothing but the core runs under it); with
    /// one, giving up after `POLICY_WAIT_LIMIT` spent waiting while a policy callback runs.
    fn wait(&self) -> Result<MutexGuard<'a, T>, StoreError> {
        if !self.has_policy {
            return Ok(self.mutex.lock().unwrap_or_else(PoisonError::into_inner));
        }
        let (mut waited_in_policy, mut last) = (Duration::ZERO, Instant::now());
        loop {
            match self.mutex.try_lock() {
                Ok(guard) => return Ok(guard),
                Err(TryLockError::Poisoned(poisoned)) => return Ok(poisoned.into_inner()),
                Err(TryLockError::WouldBlock) => {}
            }
            std::thread::sleep(Duration::from_micros(100));
            let now = Instant::now();
            if self.in_policy.load(Ordering::Acquire) {
                waited_in_policy += now - last;
                if waited_in_policy >= POLICY_WAIT_LIMIT {
                    return Err(StoreError::Policy(format!(
                        "the store is held by a victim policy callback on another thread and \
                         was not released within {} s: a policy must not wait for a thread \
                         that uses its store",
                        POLICY_WAIT_LIMIT.as_secs()
                    )));
                }
            }
            last = now;
        }
    }
}

/// Proof that this thread does not hold the GIL: given by `detach` to the code it runs with the
/// GIL released.
/// Not `Send`, so it cannot be carried out of the place that made it.
#[derive(Clone, Copy)]
pub(crate) struct Unattached(PhantomData<*const ()>);

/// `py.detach(f)`, with the proof that `f` runs without the GIL.
pub(crate) fn detach<T: Send>(py: Python<'_>, f: impl Send + FnOnce(Unattached) -> T) -> T {
    py.detach(|| f(Unattached(PhantomData)))
}

/// A mutex that a thread holding the GIL never blocks on (tokenizers' `DetachedRwLock` is the
/// model): with the GIL, `lock` tries, spins briefly, then waits with the GIL released for the
/// lock to come free, without keeping it, and tries again with the GIL; without the GIL,
/// `lock_unattached` asks for the proof. So no holder ever waits for the GIL, and a thread
/// with the GIL never waits for a holder. A holder must still not run Python under it.
pub(crate) struct DetachedMutex<T>(Mutex<T>);

/// `try_lock`s before the GIL is released to wait: the holders keep it for microseconds, and
/// getting a released GIL back can cost a switch interval (5 ms).
const SPINS: usize = 64;

impl<T: Send> DetachedMutex<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(Mutex::new(value))
    }

    /// Takes the lock from a thread holding the GIL, which it releases if it must wait.
    pub(crate) fn lock(&self, py: Python<'_>) -> MutexGuard<'_, T> {
        lock_attached(py, &self.0)
    }

    /// Takes the lock where the GIL is not held.
    pub(crate) fn lock_unattached(&self, _: Unattached) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock if it is free now (`__traverse__`, a forked child's drop: they must not block).
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        try_lock(&self.0)
    }
}

/// `DetachedMutex::lock` over a mutex the core owns (the writer's state): tries, spins, then
/// waits with the GIL released for it to come free, and tries again with the GIL.
pub(crate) fn lock_attached<'a, T: Send>(py: Python<'_>, mutex: &'a Mutex<T>) -> MutexGuard<'a, T> {
    loop {
        for _ in 0..SPINS {
            if let Some(guard) = try_lock(mutex) {
                return guard;
            }
            std::hint::spin_loop();
        }
        // Not kept across getting the GIL back: a holder waiting for the GIL would deadlock
        // with a GIL holder waiting for this lock.
        py.detach(|| drop(mutex.lock()));
    }
}

/// The lock if it is free now.
pub(crate) fn try_lock<T>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Books kept only with the GIL held and no call into Python under them (the frontend's tables
/// of bindings and pending rows): the `Python` token each `lock` asks for is the proof, so the
/// lock is never contended, and never poisoned half written. Made on first use.
pub(crate) struct GilBooks<T>(Mutex<Option<T>>);

/// The books, borrowed for as long as the token's GIL is held.
pub(crate) struct Books<'a, T>(MutexGuard<'a, Option<T>>);

impl<T: Default> GilBooks<T> {
    pub(crate) const fn new() -> Self {
        Self(Mutex::new(None))
    }

    pub(crate) fn lock<'a>(&'a self, _: Python<'a>) -> Books<'a, T> {
        let mut guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        guard.get_or_insert_with(T::default);
        Books(guard)
    }
}

impl<T> std::ops::Deref for Books<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("made by lock")
    }
}

impl<T> std::ops::DerefMut for Books<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_mut().expect("made by lock")
    }
}
