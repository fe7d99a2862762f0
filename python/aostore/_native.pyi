"""Type stubs for the Rust extension module (kept by hand; checked by mypy.stubtest)."""

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, Self, TypeAlias, final, overload

from typing_extensions import disjoint_base

# Any C-contiguous buffer: bytes, bytearray, memoryview, numpy arrays (which type checkers do
# not all see as Buffer).
_Buffer: TypeAlias = Any

__all__ = [
    "BlockObject",
    "BlockObjectStoreError",
    "NativeStore",
    "NativeVariableStore",
    "NativeWriter",
    "ObjectMissingError",
    "VictimCandidates",
]

class BlockObjectStoreError(RuntimeError):
    """Auxiliary-output storage or retrieval failed."""

class ObjectMissingError(BlockObjectStoreError):
    """A requested auxiliary-output object is not stored (never put, or evicted)."""

@final
class BlockObject:
    """One immutable auxiliary-output object: a key and its payload bytes."""

    def __new__(cls, key: str, payload: _Buffer) -> BlockObject: ...
    @property
    def key(self) -> str: ...
    @property
    def payload(self) -> _Buffer: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __getnewargs__(self) -> tuple[str, _Buffer]: ...

@final
class VictimCandidates(Iterator[str]):
    """Eligible keys, oldest first; valid only during ``select_victims``."""

    def __iter__(self) -> VictimCandidates: ...
    def __next__(self) -> str: ...

@disjoint_base
class NativeStore:
    """The Rust store; see ``aostore.BlockObjectStore``."""

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        policy: Any | None = None,
        profile: str = "fail-closed",
        prefault: bool | Literal["background"] = ...,
    ) -> Self: ...
    @property
    def object_nbytes(self) -> int: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def policy(self) -> Any | None: ...
    @property
    def profile(self) -> Literal["fail-closed", "grow"]: ...
    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
    ) -> None: ...
    @overload
    def put_blocks(
        self,
        keys: Iterable[str],
        blocks: _Buffer,
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
        report: Literal[False] = False,
    ) -> None: ...
    @overload
    def put_blocks(
        self,
        keys: Iterable[str],
        blocks: _Buffer,
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
        report: Literal[True],
    ) -> list[str]: ...
    def put_reporting(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
    ) -> list[str]: ...
    def get_concatenated(self, keys: Iterable[str]) -> bytes: ...
    def get_into(self, keys: Iterable[str], out: _Buffer) -> _Buffer: ...
    def get_many(self, keys: Iterable[str]) -> tuple[bytes, list[str]]: ...
    def contains(self, keys: Iterable[str]) -> list[bool]: ...
    def arena_span(self) -> tuple[int, int]: ...
    def close(self) -> None: ...
    def reference_counts(self, keys: Iterable[str]) -> list[int]: ...
    def check(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def snapshot(self) -> dict[str, Any]: ...

@disjoint_base
class NativeVariableStore:
    """The Rust variable-size store; see ``aostore.VariableBlockObjectStore``."""

    def __new__(
        cls,
        *,
        max_bytes: int,
        policy: Any | None = None,
        chunk_nbytes: int | None = None,
        prefault: bool | Literal["background"] = ...,
    ) -> Self: ...
    @property
    def max_bytes(self) -> int: ...
    @property
    def chunk_nbytes(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def policy(self) -> Any | None: ...
    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
    ) -> None: ...
    def put_reporting(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
    ) -> list[str]: ...
    def get_concatenated(self, keys: Iterable[str]) -> bytes: ...
    def get_many(self, keys: Iterable[str]) -> tuple[bytes, list[str], list[int]]: ...
    def get_optional(self, key: str) -> bytes | None: ...
    def contains(self, keys: Iterable[str]) -> list[bool]: ...
    def reference_counts(self, keys: Iterable[str]) -> list[int]: ...
    def close(self) -> None: ...
    def check(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def mean_runs(self) -> float: ...
    def snapshot(self) -> dict[str, Any]: ...

@final
class NativeWriter:
    """The Rust writer thread behind ``aostore.BackgroundBlockObjectStore``."""

    def __new__(
        cls, store: NativeStore | NativeVariableStore, max_pending_batches: int
    ) -> NativeWriter: ...
    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
    ) -> None: ...
    def put_blocks(
        self,
        keys: Iterable[str],
        blocks: _Buffer,
        *,
        retain_keys: Iterable[str] | None = None,
        release_keys: Iterable[str] | None = None,
    ) -> None: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...
    def _hold_back(self, seconds: float) -> None: ...
    def _synchronous(self, on: bool) -> None: ...
    def _parked_owned_jobs(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def store(self) -> NativeStore | NativeVariableStore: ...

def build_connector_meta(
    this: Any, scheduler_output: Any, requests: Any, module: Any, layout: Layout
) -> Any: ...

@final
class Layout:
    """One shape of vLLM's aux-output connectors (``aostore.vllm.compat.releases``)."""

    def __new__(cls, name: str) -> Layout: ...
    @staticmethod
    def names() -> list[str]: ...
    @property
    def name(self) -> str: ...
    @property
    def kv_events(self) -> bool: ...
    @property
    def reads_pending_blocks(self) -> bool: ...
    @property
    def caps_prompt_start(self) -> bool: ...
    @property
    def builds_storage_in_two_phases(self) -> bool: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class NativeDataPlane:
    """vLLM's worker connector calls in Rust (``aostore.vllm.dataplane``)."""

    def __new__(
        cls,
        writer: NativeWriter,
        *,
        layout: str,
        block_size: int,
        shape_per_token: Sequence[int],
        dtype: Any,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_concurrent_batches: int,
        output_class: Any,
        step_rows: Any = None,
    ) -> NativeDataPlane: ...
    def begin_step(self, metadata: Any) -> None: ...
    def prepare_output(self, request_ids: list[str]) -> int: ...
    def process_output(self, pending: Any, token: int) -> Any:
        """vLLM's ``dict[str, AuxRequestOutput]``, or with ``step_rows`` what it returns for the
        step packed (``aostore.vllm.transport.StepRows.packed``)."""
    def close(self) -> None: ...
    def counts(self) -> tuple[int, int, int]: ...
    @property
    def steps(self) -> int: ...
    @property
    def outputs(self) -> int: ...

def splice_json(parts: list[str]) -> bytes | None:
    """``parts[0] + '"' + parts[1] + '"' + parts[2] + ...`` as UTF-8 in one allocation (odd
    parts spliced in quotes); None when an odd part holds what JSON escapes."""

def copy_pages(pages: Sequence[_Buffer], nbytes: int, out: _Buffer, stream: bool = True) -> None:
    """The first ``nbytes`` of ``pages``' bytes, in order, into ``out`` (writable, C-contiguous,
    exactly ``nbytes``), with streaming stores or plain ones; ``TypeError``/``ValueError``
    write nothing."""

def unwritten_bytearray(size: int) -> bytearray:
    """A ``bytearray`` of ``size`` bytes left unwritten, its memory committed in one call: for
    buffers written whole before they are read."""

@final
class RowPages:
    """One request's routed-experts rows in the frontend, in pages that never move
    (``aostore.vllm.transport.frontend.RowChunks`` keeps vLLM's list semantics over it)."""

    def __new__(cls) -> RowPages: ...
    def begin(self, dtype: Any, shape: list[int], row: int) -> None: ...
    def append(self, chunk: Any) -> bool: ...
    def push(self, data: _Buffer) -> None: ...
    def replace_last(self, data: _Buffer) -> None: ...
    def chunk(self, index: int) -> bytes: ...
    def pages(self) -> list[tuple[bytearray, int]]: ...
    def copy_into(self, out: _Buffer, stream: bool, start: int = 0) -> None: ...
    def bind(self, owner: Any) -> None:
        """Binds the pages to ``owner`` (the request state holding them), replacing any
        binding of either: the packed hop writes that state's rows here directly."""
    def unbind(self) -> None: ...
    @property
    def bound(self) -> bool: ...
    @property
    def ends(self) -> list[int]: ...
    @property
    def count(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def allocated(self) -> int: ...
    @property
    def books(self) -> int: ...
    @property
    def dtype(self) -> Any:
        """The rows' numpy dtype (None before the first chunk)."""
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def row(self) -> int: ...

@final
class PackedRows:
    """A step's rows taken out of its outputs by :func:`pack_step_rows`."""

    @property
    def frame(self) -> bytes: ...
    def restore(self) -> None: ...

def pack_step_rows(outputs: list[Any], step_array: type, version: str) -> PackedRows | None:
    """The rows of step buffers in ``outputs`` as one packed frame (the outputs' rows set to
    None until :meth:`PackedRows.restore`); None when no output has such rows."""

def unspan_outputs(outputs: list[Any]) -> None:
    """Each :class:`StepRowsSpan` among the outputs' rows made the view it stands for."""

def is_packed_rows(frame: Any) -> bool:
    """Whether ``frame`` is a packed step's frame."""

def rows_arrived(outputs: list[Any], frame: Any, version: str) -> int:
    """Keeps each output's rows from a packed frame until :func:`deliver_rows`."""

def deliver_rows(outputs: Iterable[Any], request_states: dict[str, Any], row_chunks: type) -> int:
    """Appends each output's packed rows to its request's ``routed_experts_chunks``."""

def rows_delivered(output: Any) -> bool:
    """Whether the current ``process_outputs`` call delivered ``output``'s rows."""

def end_delivery() -> None:
    """Ends a ``process_outputs`` call's deliveries."""

def pending_step_rows() -> int:
    """Outputs whose packed rows wait for :func:`deliver_rows`."""

def take_step_rows(step_rows: Any, request: Any) -> Any:
    """``StepRows.take``: vLLM's ``take_output`` checks and messages over a packed step."""

@final
class TakeOutput:
    """The scheduler connector's ``take_output`` (set on the connector), one native call per
    request: a packed step read by :func:`take_step_rows`, anything else by vLLM's method."""

    def __new__(
        cls,
        connector: Any,
        vllm_class: Any,
        vllm_take_output: Any,
        step_rows: type,
        spans: bool = False,
    ) -> TakeOutput: ...
    def __call__(self, request: Any, output: Any) -> Any: ...

@final
class StepIndex:
    """A step's index as ``take_output`` reads it (made by it, once a step)."""

@final
class StepRowsSpan:
    """Rows of a step buffer, what ``take_output`` gives where the engine core packs its steps
    (no numpy view a request); :meth:`array` is the view it stands for."""

    def array(self) -> Any: ...
    def __len__(self) -> int: ...

def widen_routes(routes: _Buffer, out: _Buffer, stream: bool) -> None:
    """``routes`` (C-contiguous uint8, their range checked) zero-extended into ``out`` (writable,
    C-contiguous, 1-, 2-, 4- or 8-byte little-endian integers, one per route), with streaming
    stores or plain ones; ``TypeError``/``ValueError`` write nothing."""
