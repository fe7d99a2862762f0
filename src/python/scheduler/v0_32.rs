//! vLLM 0.32.0's scheduler connector: no KV-cache tracking; a request sends every hash it has
//! not sent (`_pack_new_hashes`), and the metadata carries no retains or releases.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PySlice;

use super::{int, missing, pack, shrank, Call, Sent};

pub(super) struct Shape32;

/// `_pack_new_hashes(block_hashes, num_sent)`.
fn pack_new_hashes<'py>(
    call: &Call<'py>,
    block_hashes: &Bound<'py, PyAny>,
    num_sent: i64,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = block_hashes.py();
    if num_sent > block_hashes.len()? as i64 {
        return Err(shrank());
    }
    let new = block_hashes.get_item(PySlice::new(py, num_sent as isize, isize::MAX, 1))?;
    pack(&call.classes, &new)
}

impl<'py> super::Shape<'py> for Shape32 {
    fn new(_: &Call<'py>) -> PyResult<Self> {
        Ok(Self)
    }

    fn schedule(
        &self,
        call: &Call<'py>,
        request_id: &Bound<'py, PyAny>,
        _: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = request_id.py();
        let num_sent = match call.sent.get_item(request_id)? {
            Some(count) => int(&count)?,
            None => {
                call.sent.set_item(request_id, 0)?;
                0
            }
        };
        let request = call.requests.get_item(request_id)?;
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        if let Some(packed) = pack_new_hashes(call, &block_hashes, num_sent)? {
            call.by_request.set_item(request_id, packed)?;
        }
        call.sent.set_item(request_id, block_hashes.len()?)?;
        Ok(request)
    }

    fn settle(&self, call: &Call<'py>, request_id: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = request_id.py();
        let request = call.requests.get_item(request_id)?;
        let num_sent = int(&call.sent.get_item(request_id)?.ok_or_else(|| missing(request_id))?)?;
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        if let Some(packed) = pack_new_hashes(call, &block_hashes, num_sent)? {
            call.by_request.set_item(request_id, packed)?;
            call.sent.set_item(request_id, block_hashes.len()?)?;
        }
        Ok(())
    }

    fn metadata(&self, call: &Call<'py>, sent: Sent<'py>) -> PyResult<Bound<'py, PyAny>> {
        let Sent { generation, scheduled, finished } = sent;
        call.classes.metadata.call1((generation, scheduled, &call.by_request, finished))
    }
}
