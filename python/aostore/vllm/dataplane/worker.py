"""The worker side: aostore's subclass of vLLM's ``AuxOutputWorkerConnector``.

It runs vLLM's constructor (and, from 0.34.0 on, vLLM's ``initialize_output_storage``, which
builds the store and buffer once the KV cache is laid out); if that built aostore's installed
store, Rust writer and buffer and nothing hooks what the plane stands in for
(:func:`.installed.why_not`), the connector hands each call to ``aostore._native.NativeDataPlane``,
which keeps vLLM's behaviour exactly (docs/data-plane.md); otherwise vLLM's code runs.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from aostore._native import Layout, NativeDataPlane

from ..transport import StepRows, crosses_unpacked, why_not_packed
from .installed import BUFFER, CONNECTOR, NO_STORE, Installed, why_not
from .report import report_once

logger = logging.getLogger("vllm.plugins.aostore")

NO_STORAGE_YET = "output storage not initialized (vLLM builds it after the KV cache)"


def subclasses(vllm_connector: type, vllm_buffer: type, layout: Layout) -> tuple[type, type]:
    """aostore's connector and buffer classes over this vLLM's, in the shape ``layout`` (the
    release record's) names."""
    buffer = type(
        BUFFER,
        (vllm_buffer,),
        {
            "__module__": __name__,
            "__qualname__": BUFFER,
            "__doc__": "vLLM's buffer, unchanged: its class tells the connector that aostore "
            "built it (the data plane stages rows itself; vLLM's code uses it when the plane is "
            "off).",
        },
    )
    # vLLM 0.34.0 builds its storage in a second phase; earlier releases in __init__: the
    # record's layout says which (the release is recognized by its files, not by probing).
    bases = (TwoPhaseConnector,) if layout.builds_storage_in_two_phases else (DataPlaneConnector,)
    connector = type(
        CONNECTOR,
        (*bases, vllm_connector),
        {"__module__": __name__, "__qualname__": CONNECTOR, "__doc__": DataPlaneConnector.__doc__},
    )
    return connector, buffer


class DataPlaneConnector:
    """vLLM's connector; with aostore's store, writer and buffer, its calls run natively.

    The methods of the subclass of vLLM's ``AuxOutputWorkerConnector`` that
    :func:`.install.install` makes (this class first in its bases, so ``super()`` is vLLM's).
    """

    _aostore_installed: Installed
    # vLLM's fields, as its code sets them.
    _store: Any
    _buffer: Any
    _capturer: Any
    _step_metadata: Any

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._aostore_plane: Any = None
        self._aostore_why_not: str | None = NO_STORAGE_YET
        if self._aostore_installed.report:
            atexit.register(report_once, self, self._aostore_installed.report)
        if not isinstance(self, TwoPhaseConnector):
            self._aostore_decide(kwargs["vllm_config"])

    def _aostore_decide(self, config: Any) -> None:
        """Builds the plane over the store vLLM's code just built, or says why not."""
        installed = self._aostore_installed
        why = why_not(self)
        plane = None
        packed = None
        if why is None:
            buffer = self._buffer
            packed = why_not_packed(config) if installed.transport else "transport off"
            plane = NativeDataPlane(
                self._store._writer,
                layout=installed.layout.name,
                block_size=buffer.block_size,
                shape_per_token=tuple(buffer.shape_per_token),
                dtype=buffer.dtype,
                max_num_seqs=config.scheduler_config.max_num_seqs,
                max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                max_concurrent_batches=config.max_concurrent_batches,
                output_class=vars(installed.worker)["AuxRequestOutput"],
                step_rows=StepRows.packed if packed is None else None,
            )
        self._aostore_plane = plane
        self._aostore_why_not = why
        # Why a step's rows go as vLLM's dict (None: packed, one StepRows a step).
        self._aostore_why_unpacked = packed
        if not installed.said.is_set() and why != NO_STORE:
            installed.said.set()
            if plane is not None:
                rows = "one buffer a step" if packed is None else f"vLLM's dict ({packed})"
                # A hop that pickles but where the two ends may not run the same aostore (Ray,
                # nodes) deserves a warning; one process (uni) has no hop to change.
                level = logging.WARNING if crosses_unpacked(config, packed) else logging.INFO
                logger.log(
                    level, "aostore data plane: on for vLLM's worker connector; rows as %s", rows
                )
            else:
                logger.info("aostore data plane: off for this connector (%s)", why)

    def begin_step(self, metadata: Any) -> None:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().begin_step(metadata)  # type: ignore[misc, no-any-return]
        self._step_metadata = metadata
        if metadata is not None:
            plane.begin_step(metadata)
        return None

    def prepare_output(self, input_batch: Any) -> Any:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().prepare_output(input_batch)  # type: ignore[misc]
        if self._step_metadata is None:
            return None
        # vLLM's own snapshot, as its prepare_output takes it; the rows are read only in
        # process_output, after vLLM has synchronized the asynchronous copy.
        request_ids = list(input_batch.req_ids)
        query_start_loc = input_batch.query_start_loc_np[: len(request_ids) + 1]
        num_rows = int(query_start_loc[-1])
        pending = vars(self._aostore_installed.worker)["PendingAuxOutput"](
            connector=self,
            request_ids=request_ids,
            token_starts=input_batch.num_computed_tokens_np,
            query_start_loc=query_start_loc,
            routed_experts_gpu=self._capturer.snapshot_routing_data(num_rows),
        )
        pending._aostore_step = plane.prepare_output(request_ids)
        return pending

    def process_output(self, pending: Any) -> Any:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().process_output(pending)  # type: ignore[misc]
        token = pending.__dict__.get("_aostore_step", 2**64 - 1)
        return plane.process_output(pending, token)

    def close(self) -> None:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().close()  # type: ignore[misc, no-any-return]
        if self._aostore_installed.report:
            report_once(self, self._aostore_installed.report)
        plane.close()
        store = self._store
        if store is not None:
            try:
                store.close()
            finally:
                self._store = None
        return None


class TwoPhaseConnector(DataPlaneConnector):
    """vLLM 0.34.0's shape: ``profile_run`` builds the connector (capture only) and KV-cache
    initialization calls ``initialize_output_storage`` on that same object, which builds the
    store and buffer on the first TP rank. The plane is decided there; until then vLLM's own
    methods run (``begin_step`` records the metadata, ``prepare_output`` returns ``None``)."""

    _vllm_config: Any

    def initialize_output_storage(self, kv_cache_config: Any) -> None:
        previous = self.__dict__.get("_aostore_plane")
        super().initialize_output_storage(kv_cache_config)  # type: ignore[misc]
        if previous is not None:
            # A second call: vLLM builds a new store and buffer (its request states stay); the
            # plane is rebuilt over the new store, empty (docs/data-plane.md).
            previous.close()
            self._aostore_plane = None
        self._aostore_decide(self._vllm_config)
