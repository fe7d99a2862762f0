//! The PyO3 binding, one concern per file (docs/layout.md lists them); no store logic lives here.

mod answer;
mod args;
mod dataplane;
mod errors;
mod fixed;
mod fork;
mod gather;
mod handle;
mod layout;
mod lock;
mod object;
mod packed_rows;
mod pages;
mod policy;
mod row_pages;
mod scheduler;
mod step_rows;
mod variable;
mod widen;
mod writer;

use pyo3::intern;
use pyo3::prelude::*;

pub(crate) use args::*;
pub(crate) use errors::*;
pub(crate) use fixed::NativeStore;
pub(crate) use fork::*;
pub(crate) use handle::log_growth;
pub(crate) use object::BlockObject;
pub(crate) use policy::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    refuse_subinterpreters()?;
    AT_FORK.call_once(|| {
        // SAFETY: registers a handler that only writes atomics, which is async-signal-safe as
        // a child-after-fork handler must be.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
    // Before finalization tears the interpreter down, writer threads stop calling into it.
    let exiting = wrap_pyfunction!(writer::interpreter_exiting, m)?;
    m.py()
        .import(intern!(m.py(), "atexit"))?
        .call_method1(intern!(m.py(), "register"), (exiting,))?;
    m.add_class::<NativeStore>()?;
    m.add_class::<BlockObject>()?;
    m.add_class::<CandidateKeys>()?;
    m.add_class::<writer::NativeWriter>()?;
    m.add("BlockObjectStoreError", m.py().get_type::<BlockObjectStoreError>())?;
    m.add("ObjectMissingError", m.py().get_type::<ObjectMissingError>())?;
    variable::register(m)?;
    dataplane::register(m)?;
    scheduler::register(m)?;
    layout::register(m)?;
    answer::register(m)?;
    pages::register(m)?;
    row_pages::register(m)?;
    packed_rows::register(m)?;
    step_rows::register(m)?;
    widen::register(m)?;
    Ok(())
}
