"""CUDA paths of the tensor façade (docs/api.md).

Tests marked ``cuda`` run where ``torch.cuda.is_available()``; elsewhere they are skipped with
a reason. The pinned-arena argument checks, and the register/unregister bookkeeping (against a
recording stand-in for ``torch.cuda.cudart()``), run everywhere.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from aostore import BlockObjectStore

torch = pytest.importorskip("torch")

HAS_CUDA = bool(torch.cuda.is_available())
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device; torch.cuda.is_available() is False"
)

BLOCK_SHAPE = (16, 46, 8)
N = 4
DTYPES = [torch.uint8, torch.int16, torch.int32, torch.bfloat16]


def nbytes_of(dtype: Any) -> int:
    return int(np.prod(BLOCK_SHAPE)) * torch.empty((), dtype=dtype).element_size()


def random_bits(dtype: Any, shape: tuple[int, ...], seed: int) -> Any:
    """Random raw bits as ``dtype`` on the CPU (every bf16 pattern, NaNs included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(tensor: Any) -> bytes:
    return bytes(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


@pytest.fixture
def stores() -> Iterator[list[BlockObjectStore]]:
    made: list[BlockObjectStore] = []
    yield made
    for store in made:
        store.close()


def make(stores: list[BlockObjectStore], dtype: Any, **kwargs: Any) -> BlockObjectStore:
    nbytes = nbytes_of(dtype)
    store = BlockObjectStore(max_bytes=2 * N * nbytes, object_nbytes=nbytes, **kwargs)
    stores.append(store)
    return store


def arena_is_pinned(store: BlockObjectStore) -> bool:
    """Whether CUDA sees the arena as page-locked host memory (asks without reading it)."""
    address, length = store.arena_span()
    view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
    return bool(torch.from_numpy(view).is_pinned())


class RecordingCudart:
    """Stands in for ``torch.cuda.cudart()``: records calls, answers with ``error``."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def cudaHostRegister(self, *args: Any) -> int:
        self.calls.append(("register", args))
        return self.error

    def cudaHostUnregister(self, *args: Any) -> int:
        self.calls.append(("unregister", args))
        return 0


# --------------------------------------------------------------------------- everywhere


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is present: pin_memory=True is valid here")
def test_pin_memory_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="pin_memory=True needs a CUDA device"):
        BlockObjectStore(max_bytes=64, object_nbytes=8, pin_memory=True)


def test_pin_memory_with_grow_profile_is_a_value_error():
    with pytest.raises(ValueError, match="pin_memory=True needs a fixed arena"):
        BlockObjectStore(max_bytes=64, object_nbytes=8, profile="grow", pin_memory=True)


def test_pin_memory_registers_the_arena_once_and_close_unregisters(monkeypatch):
    cudart = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    store = BlockObjectStore(max_bytes=4 * 64, object_nbytes=64, pin_memory=True)
    address, length = store.arena_span()
    assert length >= 4 * 64
    assert cudart.calls == [("register", (address, length, 0))]
    store.put_blocks(["a"], np.ones((1, 64), dtype=np.uint8))
    assert store.get_concatenated(["a"]) == bytes([1]) * 64
    store.close()
    assert cudart.calls[1:] == [("unregister", (address,))]
    store.close()  # idempotent: no second unregister
    assert len(cudart.calls) == 2
    assert store.closed


def test_pin_memory_register_failure_is_a_runtime_error(monkeypatch):
    cudart = RecordingCudart(error=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        BlockObjectStore(max_bytes=64, object_nbytes=8, pin_memory=True)


def test_unpinned_store_never_touches_cudart(monkeypatch):
    cudart = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    store = BlockObjectStore(max_bytes=64, object_nbytes=8)
    store.close()
    assert cudart.calls == []


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pin_memory", [False, True], ids=["pageable", "pinned"])
def test_put_blocks_from_cuda_and_read_back(stores, dtype, pin_memory):
    store = make(stores, dtype, pin_memory=pin_memory)
    host = random_bits(dtype, (N, *BLOCK_SHAPE), seed=1)
    keys = [f"k{i}" for i in range(N)]
    store.put_blocks(keys, host.to("cuda"))
    assert store.get_concatenated(keys) == bits(host)

    on_device = store.get_tensor(keys, dtype=dtype, shape_per_token=BLOCK_SHAPE[1:], device="cuda")
    assert on_device.device.type == "cuda"
    assert on_device.dtype == dtype
    assert tuple(on_device.shape) == (N * BLOCK_SHAPE[0], *BLOCK_SHAPE[1:])
    assert bits(on_device) == bits(host)

    pinned = store.get_tensor(keys, dtype=dtype, shape_per_token=BLOCK_SHAPE, pin_memory=True)
    assert pinned.is_pinned()
    assert bits(pinned) == bits(host)

    out = torch.zeros((N, *BLOCK_SHAPE), dtype=dtype, device="cuda")
    pointer = out.data_ptr()
    assert store.get_into(keys, out) is out
    assert out.data_ptr() == pointer
    assert bits(out) == bits(host)


@pytest.mark.cuda
@needs_cuda
def test_cuda_bad_input_changes_nothing(stores):
    store = make(stores, torch.uint8)
    store.put_blocks(["a"], torch.ones((1, *BLOCK_SHAPE), dtype=torch.uint8, device="cuda"))
    snapshot, stats = store.snapshot(), store.stats()
    strided = torch.zeros((2, 16, 46, 16), dtype=torch.uint8, device="cuda")[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        store.put_blocks(["b", "c"], strided)
    with pytest.raises(ValueError):
        store.put_blocks(["b"], torch.zeros((1, 5), dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError):
        store.put_blocks(
            ["b", "c"], torch.zeros((1, *BLOCK_SHAPE), dtype=torch.uint8, device="cuda")
        )
    with pytest.raises(ValueError):
        store.get_into(["a"], torch.zeros(3, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        store.get_into(["a"], torch.zeros((16, 46, 16), dtype=torch.uint8, device="cuda")[..., ::2])
    assert store.snapshot() == snapshot
    assert store.stats() == stats


@pytest.mark.cuda
@needs_cuda
def test_pinned_arena_is_registered_while_open(stores):
    store = make(stores, torch.uint8, pin_memory=True)
    assert arena_is_pinned(store)
    host = random_bits(torch.uint8, (N, *BLOCK_SHAPE), seed=2)
    keys = [f"k{i}" for i in range(N)]
    store.put_blocks(keys, host.to("cuda"))
    assert store.get_concatenated(keys) == bits(host)
    store.close()  # unregisters, then frees; a crash or CUDA error here fails the test
    store.close()
    torch.cuda.synchronize()
    unpinned = make(stores, torch.uint8)
    assert not arena_is_pinned(unpinned)


@pytest.mark.cuda
@needs_cuda
def test_pinned_close_unregisters_for_real(monkeypatch):
    """close() calls the real cudaHostUnregister with the arena's address, and it succeeds."""
    real = torch.cuda.cudart()
    results: list[tuple[str, int]] = []

    class Spy:
        def cudaHostRegister(self, *args: Any) -> Any:
            error = real.cudaHostRegister(*args)
            results.append(("register", int(error)))
            return error

        def cudaHostUnregister(self, *args: Any) -> Any:
            error = real.cudaHostUnregister(*args)
            results.append(("unregister", int(error)))
            return error

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Spy())
    store = BlockObjectStore(max_bytes=8 * 4096, object_nbytes=4096, pin_memory=True)
    store.close()
    assert results == [("register", 0), ("unregister", 0)]


@pytest.mark.cuda
@needs_cuda
def test_pinned_reads_do_not_alias_slots(stores):
    store = BlockObjectStore(max_bytes=2 * 64, object_nbytes=64, pin_memory=True)
    stores.append(store)
    store.put_blocks(["a", "b"], torch.full((2, 64), 1, dtype=torch.uint8, device="cuda"))
    on_device = store.get_tensor(
        ["a", "b"], dtype=torch.uint8, shape_per_token=(64,), device="cuda"
    )
    on_host = store.get_tensor(["a", "b"], dtype=torch.uint8, shape_per_token=(64,))
    store.put_blocks(["c", "d"], torch.full((2, 64), 2, dtype=torch.uint8, device="cuda"))
    assert store.stats()["evictions"] == 2
    assert bool((on_device == 1).all())
    assert bool((on_host == 1).all())


# ------------------------------------------------- concurrent and missing closes of a pinned arena


class FakeCudart:
    """Counts cudaHostRegister/Unregister calls (no GPU here) and checks the arena is mapped."""

    def __init__(self) -> None:
        self.unregistered: list[int] = []
        self.lock = threading.Lock()

    def cudaHostUnregister(self, address: int) -> int:
        time.sleep(0.05)  # widen the window for a second closer
        with self.lock:
            self.unregistered.append(address)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    torch = pytest.importorskip("torch")
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def pinned_store() -> BlockObjectStore:
    store = BlockObjectStore(max_bytes=8 * N, object_nbytes=N)
    store._pinned = True  # as _pin_arena leaves it after cudaHostRegister
    return store


def test_concurrent_closes_of_a_pinned_store_unregister_once(fake_cuda):
    store = pinned_store()
    address, _ = store.arena_span()
    threads = [threading.Thread(target=store.close) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fake_cuda.unregistered == [address]
    assert store.closed


def test_a_pinned_store_collected_without_close_is_unregistered_first(fake_cuda):
    store = pinned_store()
    address, _ = store.arena_span()
    del store
    gc.collect()
    assert fake_cuda.unregistered == [address]
