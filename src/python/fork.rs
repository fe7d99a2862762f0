//! Process-wide state: the fork generation, and the refusal to load in a subinterpreter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::*;

pub(crate) static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);
pub(crate) static AT_FORK: Once = Once::new();

pub(crate) extern "C" fn after_fork_in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
    writer::forget_scheduling_threads();
}

/// Bumped in a child process after each `fork()`: objects created before it refuse to work.
pub(crate) fn fork_generation() -> u64 {
    FORK_GENERATION.load(Ordering::Relaxed)
}

pub(crate) fn forked_error() -> PyErr {
    PyRuntimeError::new_err(
        "this aostore store was created in the parent process before fork(); its lock and \
         threads are not usable here: create a new store in the child",
    )
}

/// Loads only in the main interpreter: the module's state is process-wide and
/// `Py_AddPendingCall` always reaches the main one, so a subinterpreter's end would stall it.
pub(crate) fn refuse_subinterpreters() -> PyResult<()> {
    // SAFETY: called during import, with the GIL held and a current interpreter.
    let id = unsafe { ffi::PyInterpreterState_GetID(ffi::PyInterpreterState_Get()) };
    if id == 0 {
        return Ok(());
    }
    Err(pyo3::exceptions::PyImportError::new_err(format!(
        "aostore cannot be imported in a subinterpreter (interpreter {id}); import it in the \
         main interpreter"
    )))
}
