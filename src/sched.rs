//! Scheduling of the store's own threads (the Rust writer, the background prefault).

/// Marks the calling thread `SCHED_BATCH`, so its wake-up never preempts the running engine
/// thread (measured in docs/performance.md).
pub fn yield_to_running_threads() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is this thread, SCHED_BATCH takes priority 0; a refusal only costs speed.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &raw const param) };
    }
}
