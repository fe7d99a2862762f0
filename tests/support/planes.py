"""A ``NativeDataPlane`` in front of a real store and Rust writer, driven as aostore's connector
subclass drives it (the pending objects vLLM's ``prepare_output`` makes), for the tests of the
plane without vLLM."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
from aostore import BackgroundBlockObjectStore, BlockObjectStore
from aostore._native import NativeDataPlane

BLOCK = 4
SHAPE = (2, 3)
ROW = int(np.prod(SHAPE))


@dataclasses.dataclass
class Output:
    """vLLM's ``AuxRequestOutput``, as a plain dataclass."""

    token_start: int
    rows: np.ndarray


@dataclasses.dataclass
class Packed:
    """vLLM's ``PackedBlockHashes``."""

    data: bytes
    item_size: int


def metadata(requests: dict[str, int], hashes: dict[str, list[bytes]], finished=()) -> Any:
    return SimpleNamespace(
        generation=0,
        requests=requests,
        block_hashes={rid: Packed(b"".join(h), len(h[0])) for rid, h in hashes.items()},
        finished_requests=tuple(finished),
        # 0.33.0's metadata fields (the planes here are 0.33's unless told): no events.
        retained_block_hashes=None,
        released_block_hashes=None,
    )


def rows_of(request: int, start: int, count: int) -> np.ndarray:
    """Rows that name their request and token."""
    values = (np.arange(start, start + count) + 100 * request) % 256
    return np.broadcast_to(values[:, None, None], (count, *SHAPE)).astype(np.uint8)


class Plane:
    """A plane in front of a real store and Rust writer, and the pending objects it reads."""

    def __init__(
        self,
        output_class: Any = Output,
        in_flight: int = 1,
        max_pending_batches: int = 4,
        layout: str = "0.33",
    ) -> None:
        self.background = BackgroundBlockObjectStore(
            BlockObjectStore(max_bytes=64 * BLOCK * ROW, object_nbytes=BLOCK * ROW),
            max_pending_batches=max_pending_batches,
        )
        self.plane = NativeDataPlane(
            self.background._writer,
            layout=layout,
            block_size=BLOCK,
            shape_per_token=SHAPE,
            dtype=np.uint8,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_concurrent_batches=in_flight,
            output_class=output_class,
        )

    def step(self, batch: list[tuple[str, int, np.ndarray]], **override: Any) -> Any:
        return self.process(self.prepare(batch, **override))

    def prepare(self, batch: list[tuple[str, int, np.ndarray]], **override: Any) -> Any:
        ids = [rid for rid, _, _ in batch]
        token = self.plane.prepare_output(ids)
        counts = [len(rows) for _, _, rows in batch]
        pending = SimpleNamespace(
            request_ids=ids,
            token_starts=np.asarray([start for _, start, _ in batch], dtype=np.int32),
            query_start_loc=np.concatenate(([0], np.cumsum(counts))).astype(np.int32),
            routed_experts=np.concatenate([rows for _, _, rows in batch]),
            num_sampled=np.ones(len(batch), dtype=np.int32),
            num_rejected=np.zeros(len(batch), dtype=np.int32),
        )
        vars(pending).update(override, token=token)
        return pending

    def process(self, pending: Any) -> Any:
        return self.plane.process_output(pending, pending.token)

    def stored(self) -> dict[str, bytes]:
        self.background.flush()
        return dict(self.background.store.snapshot()["objects"])
