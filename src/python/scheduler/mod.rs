//! vLLM's scheduler-side connector (`AuxOutputSchedulerConnector`): `build_connector_meta`, its
//! loop over the step's requests, in Rust over vLLM's own state.
//!
//! The connector's bookkeeping (`_sent_hash_counts`, `_finished_requests`, `_loading`, the KV
//! retains and releases) stays in vLLM's dicts and lists on the connector, because vLLM's other
//! methods (`request_finished`, `reset`, `max_cache_hit`, ...) keep running and share it; these
//! functions read and update those same objects in vLLM's order, so dict order, counts and
//! exceptions are vLLM's. There is no Rust state and no lock: the scheduler is one thread.
//!
//! The loop is written once, here; what differs between vLLM's layouts (which hashes a request
//! sends, and what the metadata carries) is one module per shape, behind [`Shape`]: `v0_32`
//! (0.32.0) and `v0_33` (0.33.0, and 0.34.0, whose scheduler connector is 0.33.0's).

mod v0_32;
mod v0_33;

use pyo3::exceptions::PyAssertionError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use super::layout::PyLayout;
use crate::Layout;

/// What the connector module provides (looked up at call time, as vLLM's code does).
struct Classes<'py> {
    packed: Bound<'py, PyAny>,
    metadata: Bound<'py, PyAny>,
}

fn classes<'py>(module: &Bound<'py, PyAny>) -> PyResult<Classes<'py>> {
    let py = module.py();
    Ok(Classes {
        packed: module.getattr(intern!(py, "PackedBlockHashes"))?,
        metadata: module.getattr(intern!(py, "AuxOutputConnectorMetadata"))?,
    })
}

/// One `build_connector_meta` call: the connector, vLLM's objects it reads and the dicts it
/// builds.
struct Call<'py> {
    this: Bound<'py, PyAny>,
    classes: Classes<'py>,
    requests: Bound<'py, PyAny>,
    /// The connector's `_sent_hash_counts`.
    sent: Bound<'py, PyDict>,
    /// The metadata's request id -> packed new hashes.
    by_request: Bound<'py, PyDict>,
    layout: Layout,
}

/// What one layout of vLLM's scheduler connector does that another does not.
trait Shape<'py>: Sized {
    /// The connector's fields this layout reads once per call.
    fn new(call: &Call<'py>) -> PyResult<Self>;

    /// A request scheduled this step with `num_tokens`: its new hashes into `by_request` and
    /// the layout's bookkeeping, in vLLM's order; returns the request.
    fn schedule(
        &self,
        call: &Call<'py>,
        request_id: &Bound<'py, PyAny>,
        num_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>>;

    /// A request with sent hashes that was not scheduled: a hash-only update.
    fn settle(&self, call: &Call<'py>, request_id: &Bound<'py, PyAny>) -> PyResult<()>;

    /// The metadata object (and what sending it resets).
    fn metadata(&self, call: &Call<'py>, sent: Sent<'py>) -> PyResult<Bound<'py, PyAny>>;
}

/// What every layout's metadata carries ahead of the request's hashes, whatever the layout.
struct Sent<'py> {
    /// The connector's `_generation`.
    generation: Bound<'py, PyAny>,
    /// Request id -> emit start, for the requests scheduled this step.
    scheduled: Bound<'py, PyDict>,
    /// The ids of the requests whose finish this step sends.
    finished: Bound<'py, PyTuple>,
}

/// `PackedBlockHashes(b"".join(hashes), len(hashes[0]))`, or `None` for no hashes.
fn pack<'py>(
    classes: &Classes<'py>,
    hashes: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = hashes.py();
    if hashes.len()? == 0 {
        return Ok(None);
    }
    let item_size = hashes.get_item(0)?.len()?;
    let data = PyBytes::new(py, b"").call_method1(intern!(py, "join"), (hashes,))?;
    Ok(Some(classes.packed.call1((data, item_size))?))
}

fn int(value: &Bound<'_, PyAny>) -> PyResult<i64> {
    value.extract()
}

fn missing(key: &Bound<'_, PyAny>) -> PyErr {
    pyo3::exceptions::PyKeyError::new_err(key.clone().unbind())
}

fn shrank() -> PyErr {
    PyAssertionError::new_err("KV block-hash history shrank")
}

/// The emit start vLLM sends for a scheduled request: the prompt start (capped at the prompt
/// where the layout caps it) or, once it has output, its last token.
fn emit_start(request: &Bound<'_, PyAny>, layout: Layout) -> PyResult<i64> {
    let py = request.py();
    let params = request.getattr(intern!(py, "sampling_params"))?;
    if params.is_none() {
        return Err(PyAssertionError::new_err("sampling_params is None"));
    }
    let prompt_start = int(&params.getattr(intern!(py, "routed_experts_prompt_start"))?)?;
    // Read only where vLLM reads it: 0.31.0's connector never asks for the prompt's length
    // (vLLM 0.31.0's own test requests do not have it).
    let start = if layout.caps_prompt_start() {
        prompt_start.min(int(&request.getattr(intern!(py, "num_prompt_tokens"))?)?)
    } else {
        prompt_start
    };
    let outputs = int(&request.getattr(intern!(py, "num_output_tokens"))?)?;
    let last =
        if outputs == 0 { 0 } else { int(&request.getattr(intern!(py, "num_tokens"))?)? - 1 };
    Ok(start.max(last))
}

/// `AuxOutputSchedulerConnector.build_connector_meta(scheduler_output, requests)` for the
/// connector `this`, as the release whose record names `layout` computes it (a `Layout` made
/// once, when the connector class is made, not a name parsed each step); `module` is
/// vLLM's connector module.
#[pyfunction]
pub(crate) fn build_connector_meta<'py>(
    this: &Bound<'py, PyAny>,
    scheduler_output: &Bound<'py, PyAny>,
    requests: &Bound<'py, PyAny>,
    module: &Bound<'py, PyAny>,
    layout: PyRef<'py, PyLayout>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = this.py();
    let call = Call {
        this: this.clone(),
        classes: classes(module)?,
        requests: requests.clone(),
        sent: this.getattr(intern!(py, "_sent_hash_counts"))?.cast_into::<PyDict>()?,
        by_request: PyDict::new(py),
        layout: layout.0,
    };
    match call.layout {
        Layout::V0_31 | Layout::V0_32 => run::<v0_32::Shape32>(&call, scheduler_output),
        Layout::V0_33 | Layout::V0_34 => run::<v0_33::Shape33<'py>>(&call, scheduler_output),
    }
}

/// vLLM's loop, once for every layout.
fn run<'py, S: Shape<'py>>(
    call: &Call<'py>,
    scheduler_output: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let (py, this) = (call.this.py(), &call.this);
    let scheduled = PyDict::new(py);
    let tokens = scheduler_output.getattr(intern!(py, "num_scheduled_tokens"))?;
    let tokens = tokens.cast::<PyDict>()?;
    let shape = S::new(call)?;
    for (request_id, num_tokens) in tokens.iter() {
        let request = shape.schedule(call, &request_id, &num_tokens)?;
        scheduled.set_item(&request_id, emit_start(&request, call.layout)?)?;
    }
    // A settled token can complete a hash block after the next schedule was built: a
    // hash-only update for a request that was not scheduled again.
    if call.sent.len() != scheduled.len() {
        let ids: Vec<Bound<'py, PyAny>> = call.sent.keys().iter().collect();
        for request_id in ids {
            if !scheduled.contains(&request_id)? {
                shape.settle(call, &request_id)?;
            }
        }
    }
    // Sending transfers ownership of the one-shot finish events.
    let finished = this.getattr(intern!(py, "_finished_requests"))?.cast_into::<PyDict>()?;
    let finished_ids = PyTuple::new(py, finished.keys().iter())?;
    for (request_id, hashes) in finished.iter() {
        if !hashes.is_none() {
            call.by_request.set_item(request_id, hashes)?;
        }
    }
    this.setattr(intern!(py, "_finished_requests"), PyDict::new(py))?;
    let generation = this.getattr(intern!(py, "_generation"))?;
    shape.metadata(call, Sent { generation, scheduled, finished: finished_ids })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(build_connector_meta, m)?)?;
    Ok(())
}
