"""The store class users construct: the native store with a numpy/torch face."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from aostore import _buffers
from aostore._native import NativeStore
from aostore._reads import BufferReads


class BlockObjectStore(BufferReads, NativeStore):
    """A bounded store of fixed-size objects keyed by string, with reference counts.

    ``BlockObjectStore(*, max_bytes, object_nbytes, policy=None, profile="fail-closed",
    pin_memory=False, prefault=False)`` holds ``num_slots = max_bytes // object_nbytes``
    objects of ``object_nbytes`` bytes. Referenced keys are never evicted; unreferenced ones
    leave in LRU order. The arena's pages are committed on first write; ``prefault=True``
    commits them all at construction (in huge pages where the kernel allows), so no put waits
    for a page fault; ``prefault="background"`` commits them from a thread started by the
    constructor, which returns at once (a put that reaches a page first takes its fault).
    ``pin_memory=True`` registers the arena with CUDA (``cudaHostRegister`` through torch) so
    device-to-host copies into it run at full speed.

    Instances accept attribute assignment (tests replace methods with mocks). All methods are
    safe to call from several threads; payload copies run with the GIL released.
    """

    __slots__ = ("__dict__",)
    _pinned: bool
    _pin_lock: threading.Lock

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        policy: Any | None = None,
        profile: str = "fail-closed",
        pin_memory: bool = False,
        prefault: bool | Literal["background"] = False,
    ) -> BlockObjectStore:
        if pin_memory and profile == "grow":
            raise ValueError("pin_memory=True needs a fixed arena; profile 'grow' may move it")
        self = super().__new__(
            cls,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            policy=policy,
            profile=profile,
            prefault=prefault,
        )
        self._pinned = False
        self._pin_lock = threading.Lock()
        if pin_memory:
            self._pin_arena()
        return self

    def __init__(self, **_: Any) -> None:
        """Construction happens in ``__new__``; see the class docstring."""

    def _pin_arena(self) -> None:
        try:
            import torch
        except ImportError:
            raise RuntimeError("pin_memory=True needs torch (pip install aostore[torch])") from None
        if not torch.cuda.is_available():
            raise RuntimeError("pin_memory=True needs a CUDA device; none is available")
        address, length = self.arena_span()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = cudart.cudaHostRegister(address, length, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of the arena failed with CUDA error {int(error)}")
        self._pinned = True

    def _unpin_arena(self) -> None:
        """Unregisters a pinned arena exactly once, whichever thread or path gets here first."""
        lock = getattr(self, "_pin_lock", None)
        if lock is None:
            return
        with lock:
            if not self._pinned:
                return
            import torch

            address, _ = self.arena_span()
            torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
            self._pinned = False

    def close(self) -> None:
        """Unregisters a pinned arena, then frees it; idempotent."""
        self._unpin_arena()
        super().close()

    def __del__(self) -> None:
        # A pinned store collected without close(): CUDA must forget the arena before the
        # native store unmaps it (which happens right after this, in deallocation).
        if getattr(self, "_pinned", False) and not self.closed:
            self._unpin_arena()

    @property
    def _references(self) -> Mapping[str, int]:
        """Reference count per referenced key, read-only: vLLM's private ``_references`` dict.

        A compatibility shim for code that reads vLLM's store internals (vLLM's own tests do). A
        copy taken from ``snapshot()`` at each access: O(stored bytes), not for hot paths.
        """
        references: dict[str, int] = self.snapshot()["references"]
        return types.MappingProxyType(references)

    def _ensure_open(self) -> None:
        if self.closed:
            raise RuntimeError("auxiliary output store is closed")

    def put_blocks(  # type: ignore[override]  # the native `report` is put_blocks_reporting
        self,
        keys: Iterable[str],
        blocks: Any,
        *,
        retain_keys: Iterable[str] | None = (),
        release_keys: Iterable[str] | None = (),
    ) -> None:
        """Stores ``blocks[i]`` under ``keys[i]`` with ``put``'s semantics.

        ``blocks`` is a numpy array or torch tensor (CPU or CUDA, any dtype) of shape
        ``(len(keys), ...)`` whose rows hold ``object_nbytes`` bytes each. Each row is copied
        once, straight into its slot; a CUDA tensor is first copied to the host once.
        """
        self._ensure_open()
        keys = list(keys)
        data = _buffers.host_rows(blocks, len(keys), self.object_nbytes)
        super().put_blocks(keys, data, retain_keys=retain_keys, release_keys=release_keys)

    def put_blocks_reporting(
        self,
        keys: Iterable[str],
        blocks: Any,
        *,
        retain_keys: Iterable[str] | None = (),
        release_keys: Iterable[str] | None = (),
    ) -> list[str]:
        """``put_blocks``, returning the distinct keys whose payload it stored (new, or
        replaced in profile ``grow``), in first-occurrence order."""
        self._ensure_open()
        keys = list(keys)
        data = _buffers.host_rows(blocks, len(keys), self.object_nbytes)
        return super().put_blocks(
            keys, data, retain_keys=retain_keys, release_keys=release_keys, report=True
        )

    def _check_readable(self) -> None:
        self._ensure_open()

    def _read_into(self, keys: list[str], host: Any) -> None:
        NativeStore.get_into(self, keys, host)

    def get_tensor(
        self,
        keys: Sequence[str],
        *,
        dtype: Any,
        shape_per_token: Sequence[int],
        device: Any = "cpu",
        pin_memory: bool = False,
    ) -> Any:
        """A new torch tensor of the payloads of ``keys``, shape ``(-1, *shape_per_token)``.

        The bytes land in a (optionally pinned) host tensor, then move to ``device``.
        """
        import torch

        self._ensure_open()
        keys = list(keys)
        host = torch.empty(len(keys) * self.object_nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        # Shape the result first: a bad dtype, shape or device fails before the read.
        tensor = host.view(dtype).reshape(-1, *shape_per_token)
        target = torch.device(device)
        self._read_into(keys, host.numpy())
        return tensor if target.type == "cpu" else tensor.to(target)

    def __repr__(self) -> str:
        if self.closed:
            return f"<{type(self).__name__} closed>"
        stats = self.stats()
        return (
            f"<{type(self).__name__} {stats['stored']}/{stats['capacity']} objects of "
            f"{stats['object_nbytes']} B, {stats['referenced']} referenced>"
        )
