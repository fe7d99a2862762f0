//! vLLM 0.33.0's scheduler connector (and 0.34.0's, byte for byte the same): it tracks the KV
//! cache, so a request sends the hashes of the blocks its computed tokens cover (in hash
//! blocks of `_hash_block_size`), a KV load in flight (`_loading`) ends when it is scheduled,
//! and the metadata carries the KV-cached retains and releases.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice};

use super::{int, missing, pack, shrank, Call, Sent};

pub(super) struct Shape33<'py> {
    hash_block_size: i64,
    loading: Bound<'py, PyDict>,
}

impl<'py> Shape33<'py> {
    /// `_take_new_hashes(request, num_computed_tokens)`: the new hashes of the blocks the
    /// computed tokens cover, packed, and the count sent updated.
    fn take_new_hashes(
        &self,
        call: &Call<'py>,
        request: &Bound<'py, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = request.py();
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        let request_id = request.getattr(intern!(py, "request_id"))?;
        let request_id = &request_id;
        let sent = &call.sent;
        let num_sent = int(&sent.get_item(request_id)?.ok_or_else(|| missing(request_id))?)?;
        let len = block_hashes.len()? as i64;
        if num_sent > len {
            return Err(shrank());
        }
        let num_keyed = len.min(num_computed_tokens.div_euclid(self.hash_block_size));
        if num_keyed <= num_sent {
            return Ok(None);
        }
        sent.set_item(request_id, num_keyed)?;
        let new =
            block_hashes.get_item(PySlice::new(py, num_sent as isize, num_keyed as isize, 1))?;
        pack(&call.classes, &new)
    }
}

impl<'py> super::Shape<'py> for Shape33<'py> {
    fn new(call: &Call<'py>) -> PyResult<Self> {
        let (py, this) = (call.this.py(), &call.this);
        Ok(Self {
            hash_block_size: int(&this.getattr(intern!(py, "_hash_block_size"))?)?,
            loading: this.getattr(intern!(py, "_loading"))?.cast_into::<PyDict>()?,
        })
    }

    fn schedule(
        &self,
        call: &Call<'py>,
        request_id: &Bound<'py, PyAny>,
        num_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = request_id.py();
        if !call.sent.contains(request_id)? {
            call.sent.set_item(request_id, 0)?;
        }
        let request = call.requests.get_item(request_id)?;
        let computed = int(&request.getattr(intern!(py, "num_computed_tokens"))?)?;
        if let Some(packed) = self.take_new_hashes(call, &request, computed + int(num_tokens)?)? {
            call.by_request.set_item(request_id, packed)?;
        }
        if self.loading.contains(request_id)? {
            self.loading.del_item(request_id)?;
        }
        Ok(request)
    }

    fn settle(&self, call: &Call<'py>, request_id: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = request_id.py();
        let request = call.requests.get_item(request_id)?;
        let computed = int(&request.getattr(intern!(py, "num_computed_tokens"))?)?;
        if let Some(packed) = self.take_new_hashes(call, &request, computed)? {
            call.by_request.set_item(request_id, packed)?;
        }
        Ok(())
    }

    fn metadata(&self, call: &Call<'py>, sent: Sent<'py>) -> PyResult<Bound<'py, PyAny>> {
        let Sent { generation, scheduled, finished } = sent;
        let (py, this) = (call.this.py(), &call.this);
        let retained = this.getattr(intern!(py, "_retained_hashes"))?;
        let released = this.getattr(intern!(py, "_released_hashes"))?;
        let metadata = call.classes.metadata.call1((
            generation,
            scheduled,
            &call.by_request,
            finished,
            pack(&call.classes, &retained)?,
            pack(&call.classes, &released)?,
        ))?;
        this.setattr(intern!(py, "_retained_hashes"), PyList::empty(py))?;
        this.setattr(intern!(py, "_released_hashes"), PyList::empty(py))?;
        Ok(metadata)
    }
}
