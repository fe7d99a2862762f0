//! vLLM's scheduler-side connector (`AuxOutputSchedulerConnector`): `build_connector_meta`, its
//! loop over the step's requests, in Rust over vLLM's own state.
//!
//! The connector's bookkeeping (`_sent_hash_counts`, `_finished_requests`, `_loading`, the KV
//! retains and releases) stays in vLLM's dicts and lists on the connector, because vLLM's other
//! methods (`request_finished`, `reset`, `max_cache_hit`, ...) keep running and share it; these
//! functions read and update those same objects in vLLM's order, so dict order, counts and
//! exceptions are vLLM's. There is no Rust state and no lock: the scheduler is one thread.

use pyo3::exceptions::PyAssertionError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySlice, PyTuple};

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

/// 0.33.0's `_take_new_hashes(request, num_computed_tokens)`.
fn take_new_hashes<'py>(
    classes: &Classes<'py>,
    sent: &Bound<'py, PyDict>,
    request: &Bound<'py, PyAny>,
    num_computed_tokens: i64,
    hash_block_size: i64,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = request.py();
    let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
    let request_id = request.getattr(intern!(py, "request_id"))?;
    let request_id = &request_id;
    let num_sent = int(&sent.get_item(request_id)?.ok_or_else(|| missing(request_id))?)?;
    let len = block_hashes.len()? as i64;
    if num_sent > len {
        return Err(PyAssertionError::new_err("KV block-hash history shrank"));
    }
    let num_keyed = len.min(num_computed_tokens.div_euclid(hash_block_size));
    if num_keyed <= num_sent {
        return Ok(None);
    }
    sent.set_item(request_id, num_keyed)?;
    let new = block_hashes.get_item(PySlice::new(py, num_sent as isize, num_keyed as isize, 1))?;
    pack(classes, &new)
}

/// 0.32.0's `_pack_new_hashes(block_hashes, num_sent)`.
fn pack_new_hashes<'py>(
    classes: &Classes<'py>,
    block_hashes: &Bound<'py, PyAny>,
    num_sent: i64,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = block_hashes.py();
    if num_sent > block_hashes.len()? as i64 {
        return Err(PyAssertionError::new_err("KV block-hash history shrank"));
    }
    let new = block_hashes.get_item(PySlice::new(py, num_sent as isize, isize::MAX, 1))?;
    pack(classes, &new)
}

fn missing(key: &Bound<'_, PyAny>) -> PyErr {
    pyo3::exceptions::PyKeyError::new_err(key.clone().unbind())
}

/// The emit start vLLM sends for a scheduled request: the prompt start (capped at the prompt)
/// or, once it has output, its last token.
fn emit_start(request: &Bound<'_, PyAny>) -> PyResult<i64> {
    let py = request.py();
    let params = request.getattr(intern!(py, "sampling_params"))?;
    if params.is_none() {
        return Err(PyAssertionError::new_err("sampling_params is None"));
    }
    let prompt_start = int(&params.getattr(intern!(py, "routed_experts_prompt_start"))?)?;
    let prompt = int(&request.getattr(intern!(py, "num_prompt_tokens"))?)?;
    let outputs = int(&request.getattr(intern!(py, "num_output_tokens"))?)?;
    let last =
        if outputs == 0 { 0 } else { int(&request.getattr(intern!(py, "num_tokens"))?)? - 1 };
    Ok(prompt_start.min(prompt).max(last))
}

/// `AuxOutputSchedulerConnector.build_connector_meta(scheduler_output, requests)` for the
/// connector `this`, as the release of `layout` computes it (with KV-cache events from 0.33.0
/// on, `Layout::kv_events`); `module` is vLLM's connector module.
#[pyfunction]
pub(crate) fn build_connector_meta<'py>(
    this: &Bound<'py, PyAny>,
    scheduler_output: &Bound<'py, PyAny>,
    requests: &Bound<'py, PyAny>,
    module: &Bound<'py, PyAny>,
    layout: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let py = this.py();
    let kv_events = super::layout::layout(layout)?.kv_events();
    let classes = classes(module)?;
    let sent = this.getattr(intern!(py, "_sent_hash_counts"))?.cast_into::<PyDict>()?;
    let scheduled = PyDict::new(py);
    let by_request = PyDict::new(py);
    let tokens = scheduler_output.getattr(intern!(py, "num_scheduled_tokens"))?;
    let tokens = tokens.cast::<PyDict>()?;
    let hash_block_size =
        if kv_events { int(&this.getattr(intern!(py, "_hash_block_size"))?)? } else { 1 };
    let loading = if kv_events {
        Some(this.getattr(intern!(py, "_loading"))?.cast_into::<PyDict>()?)
    } else {
        None
    };
    for (request_id, num_tokens) in tokens.iter() {
        let request;
        let packed = if kv_events {
            if !sent.contains(&request_id)? {
                sent.set_item(&request_id, 0)?;
            }
            request = requests.get_item(&request_id)?;
            let computed = int(&request.getattr(intern!(py, "num_computed_tokens"))?)?;
            take_new_hashes(
                &classes,
                &sent,
                &request,
                computed + int(&num_tokens)?,
                hash_block_size,
            )?
        } else {
            let num_sent = match sent.get_item(&request_id)? {
                Some(count) => int(&count)?,
                None => {
                    sent.set_item(&request_id, 0)?;
                    0
                }
            };
            request = requests.get_item(&request_id)?;
            let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
            let packed = pack_new_hashes(&classes, &block_hashes, num_sent)?;
            if packed.is_some() {
                by_request.set_item(&request_id, packed.as_ref())?;
            }
            sent.set_item(&request_id, block_hashes.len()?)?;
            scheduled.set_item(&request_id, emit_start(&request)?)?;
            continue;
        };
        if let Some(packed) = packed {
            by_request.set_item(&request_id, packed)?;
        }
        if let Some(loading) = &loading {
            if loading.contains(&request_id)? {
                loading.del_item(&request_id)?;
            }
        }
        scheduled.set_item(&request_id, emit_start(&request)?)?;
    }
    // A settled token can complete a hash block after the next schedule was built: a
    // hash-only update for a request that was not scheduled again.
    if sent.len() != scheduled.len() {
        let ids: Vec<Bound<'py, PyAny>> = sent.keys().iter().collect();
        for request_id in ids {
            if scheduled.contains(&request_id)? {
                continue;
            }
            let request = requests.get_item(&request_id)?;
            if kv_events {
                let computed = int(&request.getattr(intern!(py, "num_computed_tokens"))?)?;
                let packed = take_new_hashes(&classes, &sent, &request, computed, hash_block_size)?;
                if let Some(packed) = packed {
                    by_request.set_item(&request_id, packed)?;
                }
            } else {
                let num_sent =
                    int(&sent.get_item(&request_id)?.ok_or_else(|| missing(&request_id))?)?;
                let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
                let Some(packed) = pack_new_hashes(&classes, &block_hashes, num_sent)? else {
                    continue;
                };
                by_request.set_item(&request_id, packed)?;
                sent.set_item(&request_id, block_hashes.len()?)?;
            }
        }
    }
    // Sending transfers ownership of the one-shot finish events.
    let finished = this.getattr(intern!(py, "_finished_requests"))?.cast_into::<PyDict>()?;
    let finished_ids = PyTuple::new(py, finished.keys().iter())?;
    for (request_id, hashes) in finished.iter() {
        if !hashes.is_none() {
            by_request.set_item(request_id, hashes)?;
        }
    }
    this.setattr(intern!(py, "_finished_requests"), PyDict::new(py))?;
    let generation = this.getattr(intern!(py, "_generation"))?;
    if !kv_events {
        return classes.metadata.call1((generation, scheduled, by_request, finished_ids));
    }
    let retained = this.getattr(intern!(py, "_retained_hashes"))?;
    let released = this.getattr(intern!(py, "_released_hashes"))?;
    let metadata = classes.metadata.call1((
        generation,
        scheduled,
        by_request,
        finished_ids,
        pack(&classes, &retained)?,
        pack(&classes, &released)?,
    ))?;
    this.setattr(intern!(py, "_retained_hashes"), PyList::empty(py))?;
    this.setattr(intern!(py, "_released_hashes"), PyList::empty(py))?;
    Ok(metadata)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(build_connector_meta, m)?)?;
    Ok(())
}
