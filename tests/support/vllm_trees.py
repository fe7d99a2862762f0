"""Throwaway ``vllm`` trees for the plugin's tests: each is written to disk and imported like the
real package, so the plugin sees real modules, source files and classes (the layouts are listed
in tests/plugin/test_plugin.py's docstring); ``make_tree`` and ``tree`` are their fixtures."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

aostore = pytest.importorskip("aostore")
vllm_plugin = pytest.importorskip("aostore.vllm_plugin")
from aostore import _log  # noqa: E402
from aostore.vllm import settings as vllm_settings  # noqa: E402
from aostore.vllm import stores as vllm_stores  # noqa: E402
from aostore.vllm.compat import fingerprint as compat_fingerprint  # noqa: E402

STORE = "vllm.distributed.aux_output_connector.store"


PACKAGE = "vllm.distributed.aux_output_connector"


NAMES = ("BlockObjectStore", "BlockObject", "BlockObjectStoreError", "BackgroundBlockObjectStore")


LOGGER = "vllm.plugins.aostore"


# The parts of a fake vLLM store module. Each imitates vLLM's class of that name closely enough
# for the surface check: the same public methods, instance attributes and constructor keywords.
_HEADER = """
import logging
import queue
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockObject:
    key: str
    payload: bytes


class BlockObjectStoreError(RuntimeError):
    pass
"""


_WRAPPER = """
class BackgroundBlockObjectStore:
    def __init__(self, store, *, max_pending_batches):
        self._store = store
        self._queue = queue.Queue(maxsize=max_pending_batches)
        self._error = None

    def _raise_if_failed(self):
        if self._error is not None:
            raise BlockObjectStoreError("auxiliary output publication failed") from self._error

    def put(self, objects, *, retain_keys=(), release_keys=()):
        self._raise_if_failed()
        self._store.put(objects, retain_keys=retain_keys, release_keys=release_keys)

    def get_concatenated(self, keys):
        return self._store.get_concatenated(keys)

    def close(self):
        self._store.close()
"""


_WRAPPER_EXTRAS = """
    def get_optional(self, key):
        return self._store.get_optional(key)

    def flush(self):
        pass
"""


# The fixed store, written from vLLM's behaviour (the plugin's behavioural differential runs it
# against aostore's): with ``grows`` vLLM 0.33.0's (one LRU of unreferenced keys, a re-put of
# a stored unreferenced key replaces it, a batch that cannot be held grows the arena), else
# vLLM 0.32.0's (one LRU of every key, a batch that cannot be held is refused).
_FIXED = """
class {name}:
    _UNALLOCATED_SLOT = -1

    def __init__(self, {params}{keywords}):
        if {broken}:
            raise TypeError("this store needs arguments the probe does not know")
        if object_nbytes <= 0:
            raise ValueError("auxiliary output object size must be positive")
        if max_bytes < object_nbytes:
            raise ValueError("auxiliary output store must fit at least one object")
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self._slots = {{}}
        self._lru = {{}}
        self._references = {{}}
        self._free_slots = []
        self._next_slot = 0
        self._arena = bytearray(self.num_slots * object_nbytes)

    def _tail(self, key):
        self._lru.pop(key, None)
        self._lru[key] = None

    def _evict_to_fit(self, protected):
        excess = len(self._slots) - self.num_slots
        if excess <= 0:
            return
        victims = [k for k in self._lru if k not in self._references and k not in protected]
        if len(victims) < excess and not {grows}:
            raise BlockObjectStoreError(
                "auxiliary output store cannot retain the requested batch: "
                f"limit={{self.num_slots}} objects"
            )
        for victim in victims[:excess]:
            del self._lru[victim]
            slot = self._slots.pop(victim)
            if slot != self._UNALLOCATED_SLOT:
                self._free_slots.append(slot)

    def _allocate_slot(self):
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def put(self, objects, *, retain_keys=(), release_keys=()):
        if self._arena is None:
            raise RuntimeError("auxiliary output store is closed")
        unique = {{obj.key: obj for obj in objects}}
        if {grows}:
            for key in unique.keys() & self._lru.keys():
                del self._lru[key]
                slot = self._slots.pop(key)
                if slot != self._UNALLOCATED_SLOT:
                    self._free_slots.append(slot)
        for key in retain_keys:
            count = self._references.get(key, 0)
            if not count and {grows}:
                self._lru.pop(key, None)
            self._references[key] = count + 1
        released = []
        for key in release_keys:
            count = self._references[key] - 1
            if count:
                self._references[key] = count
                continue
            del self._references[key]
            if key in self._slots and {grows}:
                self._lru[key] = None
            released.append(key)
        for key in unique:
            self._slots.setdefault(key, self._UNALLOCATED_SLOT)
            if not {grows} or key not in self._references:
                self._tail(key)
        for key in released:
            if key in self._lru:
                self._tail(key)
        try:
            self._evict_to_fit(set(unique) - set(released))
        except BlockObjectStoreError:
            for key in unique:
                if self._slots.get(key) == self._UNALLOCATED_SLOT:
                    del self._slots[key]
                    self._lru.pop(key, None)
            raise
        size = self.object_nbytes
        if len(self._slots) * size > len(self._arena):
            nbytes = max(len(self._slots) * size, 2 * len(self._arena))
            logger.warning("fake vLLM store grows to %d bytes", nbytes)
            self._arena += bytearray(nbytes - len(self._arena))
            self.num_slots = nbytes // size
        for key, obj in unique.items():
            if self._slots.get(key) == self._UNALLOCATED_SLOT:
                slot = self._allocate_slot()
                self._arena[slot * size : (slot + 1) * size] = obj.payload
                self._slots[key] = slot

    def get_concatenated(self, keys):
        if self._arena is None:
            raise RuntimeError("auxiliary output store is closed")
        try:
            slots = [self._slots[key] for key in keys]
        except KeyError as error:
            raise BlockObjectStoreError(
                "auxiliary output object does not exist; the object may have been evicted"
            ) from error
        size = self.object_nbytes
        data = b"".join(bytes(self._arena[s * size : (s + 1) * size]) for s in slots)
        for key in keys:
            if key in self._lru:
                self._tail(key)
        return data

    def close(self):
        self._arena = None
"""


_VARIABLE = """
class VariableBlockObjectStore:
    def __init__(self, *, max_bytes):
        self.max_bytes = max_bytes
        self._objects = {}

    def put(self, objects, *, retain_keys=(), release_keys=()):
        self._objects.update((obj.key, obj.payload) for obj in objects)

    def get_concatenated(self, keys):
        return b"".join(self._objects[key] for key in keys)

    def get_optional(self, key):
        return self._objects.get(key)

    def close(self):
        pass
"""


# The Mooncake branch's classes, imitated for aostore (written from their behaviour).
_BRANCH_STORE = """
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from {package}.mooncake import MooncakeBlockObjectStore
    from {package}.shm import ShmBlockObjectStore


@dataclass(frozen=True)
class BlockObject:
    key: str
    payload: bytes


class BlockObjectStoreError(RuntimeError):
    pass


class BackgroundBlockObjectStore:
    def __init__(
        self, store: ShmBlockObjectStore | MooncakeBlockObjectStore, *, max_pending_batches
    ):
        self._store = store
        self._queue = queue.Queue(maxsize=max_pending_batches)
        self._error = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            update = self._queue.get()
            try:
                if update is None:
                    return
                if self._error is None:
                    objects, retains, releases = update
                    self._store.put(objects, retain_keys=retains, release_keys=releases)
            except BaseException as error:
                self._error = error
            finally:
                self._queue.task_done()

    def _raise_if_failed(self):
        if self._error is not None:
            raise BlockObjectStoreError("auxiliary output publication failed") from self._error

    def put(self, objects, *, retain_keys=(), release_keys=()):
        retains, releases = tuple(retain_keys), tuple(release_keys)
        if not objects and not retains and not releases:
            return
        if self._closed:
            raise RuntimeError("auxiliary output store is closed")
        self._queue.put((objects, retains, releases))
        self._raise_if_failed()

    def flush(self):
        self._queue.join()
        self._raise_if_failed()

    def get_concatenated(self, keys):
        self.flush()
        return self._store.get_concatenated(keys)

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._queue.join()
        self._queue.put(None)
        self._thread.join()
        self._store.close()
        self._raise_if_failed()
"""


_BRANCH_SHM = """
from collections import OrderedDict

from {store} import BlockObject, BlockObjectStoreError


class ShmBlockObjectStore:
    _UNALLOCATED_SLOT = -1

    def __init__(self, *, max_bytes, object_nbytes):
        if object_nbytes <= 0:
            raise ValueError("auxiliary output object size must be positive")
        if max_bytes < object_nbytes:
            raise ValueError("auxiliary output store must fit at least one object")
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self._lru = OrderedDict()  # every stored key, referenced or not
        self._references = {{}}
        self._free_slots = []
        self._next_slot = 0
        self._arena = bytearray(self.num_slots * object_nbytes)

    def _evict_to_fit(self, protected):
        excess = len(self._lru) - self.num_slots
        if excess <= 0:
            return
        victims = [k for k in self._lru if k not in self._references and k not in protected]
        if len(victims) < excess:
            if {grows}:
                self.num_slots = len(self._lru)
                return
            raise BlockObjectStoreError(
                f"auxiliary output store cannot retain the requested batch: "
                f"limit={{self.num_slots}} objects"
            )
        for key in victims[:excess]:
            slot = self._lru.pop(key)
            if slot != self._UNALLOCATED_SLOT:
                self._free_slots.append(slot)

    def _allocate_slot(self):
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def _retain(self, keys):
        for key in keys:
            self._references[key] = self._references.get(key, 0) + 1

    def _release(self, keys):
        released = []
        for key in keys:
            count = self._references[key] - 1
            if count:
                self._references[key] = count
            else:
                del self._references[key]
                released.append(key)
        return released

    def put(self, objects, *, retain_keys=(), release_keys=()):
        if self._arena is None:
            raise RuntimeError("auxiliary output store is closed")
        unique = {{obj.key: obj for obj in objects}}
        self._retain(retain_keys)
        released = self._release(release_keys)
        for key in unique:
            self._lru.setdefault(key, self._UNALLOCATED_SLOT)
            self._lru.move_to_end(key)
        for key in released:
            if key in self._lru:
                self._lru.move_to_end(key)
        try:
            self._evict_to_fit(set(unique) - set(released))
        except BlockObjectStoreError:
            for key in unique:
                if self._lru.get(key) == self._UNALLOCATED_SLOT:
                    del self._lru[key]
            raise
        size = self.object_nbytes
        for key, obj in unique.items():
            if self._lru.get(key) == self._UNALLOCATED_SLOT:
                slot = self._allocate_slot()
                self._arena[slot * size : (slot + 1) * size] = obj.payload
                self._lru[key] = slot

    def get_concatenated(self, keys):
        if self._arena is None:
            raise RuntimeError("auxiliary output store is closed")
        try:
            slots = [self._lru[key] for key in keys]
        except KeyError as error:
            raise BlockObjectStoreError(
                "auxiliary output object does not exist; the object may have been evicted "
                f"(used={{len(self._lru)}}, limit={{self.num_slots}} objects). Increase "
                "aux_output_config.max_bytes when a KV cache hit requires it."
            ) from error
        size = self.object_nbytes
        data = b"".join(bytes(self._arena[s * size : (s + 1) * size]) for s in slots)
        for key in keys:
            self._lru.move_to_end(key)
        return data

    def close(self):
        self._arena = None
"""


_BRANCH_MOONCAKE = """
from {store} import BlockObject, BlockObjectStoreError


class MooncakeBlockObjectStore:
    def __init__(self, store, *, object_nbytes, max_batch_bytes):
        if not 0 < object_nbytes <= max_batch_bytes:
            raise ValueError("Mooncake batch must fit at least one auxiliary block")
        self._store = store
        self.object_nbytes = object_nbytes
        self._batch_size = max_batch_bytes // object_nbytes

    def put(self, objects, *, retain_keys=(), release_keys=()):
        unique = {{obj.key: obj.payload for obj in objects}}
        keys = list(unique)
        for start in range(0, len(keys), self._batch_size):
            batch = keys[start : start + self._batch_size]
            result = self._store.put_batch(batch, [unique[key] for key in batch])
            if result != 0:
                raise BlockObjectStoreError(f"Mooncake publication failed: {{result}}")

    def get_concatenated(self, keys):
        chunks = []
        for start in range(0, len(keys), self._batch_size):
            batch = keys[start : start + self._batch_size]
            for key, buffer in zip(batch, self._store.batch_get_buffer(batch), strict=True):
                if buffer is None:
                    raise BlockObjectStoreError(f"Mooncake object unavailable: {{key}}")
                chunks.append(bytes(buffer))
        return b"".join(chunks)

    def close(self):
        self._store.close()


class MooncakeOutputPublisher:
    def __init__(self, output, block_size):
        self._block_size = block_size
        self._store = create_mooncake_block_store(object_nbytes=block_size)

    def take_output(self, request, output):
        keys = list(output.block_keys)
        self._store.put([BlockObject(f"r3-tail:{{request}}", output.tail)])
        return [*keys, f"r3-tail:{{request}}"]

    def discard(self, request_id):
        pass

    def close(self):
        self._store.close()


def create_mooncake_block_store(*, object_nbytes, max_batch_bytes=64 * 1024**2):
    from mooncake.store import MooncakeDistributedStore

    return MooncakeBlockObjectStore(
        MooncakeDistributedStore(), object_nbytes=object_nbytes, max_batch_bytes=max_batch_bytes
    )
"""


_BRANCH_WORKER = """
from {package}.mooncake import MooncakeBlockObjectStore
from {package}.routed_experts import materialize_routed_experts, publish_routed_experts
from {package}.shm import ShmBlockObjectStore
from {store} import BackgroundBlockObjectStore

OTHER = 42


class AuxOutputWorkerConnector:
    def __init__(self, *, backend, max_bytes, object_nbytes, native=None):
        if backend == "mooncake":
            store = MooncakeBlockObjectStore(
                native, object_nbytes=object_nbytes, max_batch_bytes=4 * object_nbytes
            )
        else:
            store = ShmBlockObjectStore(max_bytes=max_bytes, object_nbytes=object_nbytes)
        self._store = BackgroundBlockObjectStore(store, max_pending_batches=2)

    def publish(self, keys, rows, *, retain_keys=(), release_keys=()):
        publish_routed_experts(
            self._store,
            batches=[(keys, rows)],
            retain_keys=retain_keys,
            release_keys=release_keys,
        )

    def materialize(self, keys):
        return materialize_routed_experts(self._store, keys)

    def close(self):
        self._store.close()
"""


_BRANCH_ROUTED_EXPERTS = """
from {store} import BlockObject


def publish_routed_experts(store, *, batches, retain_keys=(), release_keys=()):
    objects = [BlockObject(key, row) for keys, rows in batches for key, row in zip(keys, rows)]
    store.put(objects, retain_keys=retain_keys, release_keys=release_keys)


def materialize_routed_experts(store, keys):
    return store.get_concatenated(keys)
"""


def _fixed(
    kind: str,
    name: str = "BlockObjectStore",
    keywords: str = "",
    params: str = "*, max_bytes, object_nbytes",
) -> str:
    return _FIXED.format(
        name=name,
        params=params,
        keywords=keywords,
        broken=kind == "broken",
        grows=kind != "fail-closed",
    )


def tree_sources(
    kind: str,
    *,
    store_keywords: str = "",
    store_params: str = "*, max_bytes, object_nbytes",
    store_extra: str = "",
    wrapper_extra: str = "",
    worker_extra: str = "",
    store_edits: tuple[tuple[str, str], ...] = (),
    extra_files: dict[str, str] | None = None,
) -> dict[str, str]:
    """The files of a fake ``vllm`` package of one layout, relative to its parent directory.

    ``store_params``/``store_keywords``/``store_extra`` change the fixed store's constructor
    and add to its body, ``wrapper_extra`` adds to the background wrapper's body, and
    ``worker_extra`` is appended to ``worker.py`` (a "worker" that uses vLLM's classes).
    ``store_edits`` are ``(old, new)`` replacements in the fixed store's source (each must
    match: a store that behaves differently), ``extra_files`` more files by path (written,
    not imported).
    """
    files = _tree_files(
        kind, store_keywords, store_params, store_extra, wrapper_extra, worker_extra
    )
    fixed = "vllm/distributed/aux_output_connector/" + (
        "shm.py" if kind in ("shm", "shm_grows") else "store.py"
    )
    for old, new in store_edits:
        assert old in files[fixed], old
        files[fixed] = files[fixed].replace(old, new)
    files.update(extra_files or {})
    return files


def _tree_files(
    kind: str,
    store_keywords: str,
    store_params: str,
    store_extra: str,
    wrapper_extra: str,
    worker_extra: str,
) -> dict[str, str]:
    base = "vllm/distributed/aux_output_connector/"
    wrapper = _WRAPPER + (_WRAPPER_EXTRAS if kind == "variable" else "") + wrapper_extra
    fixed = _fixed(kind, keywords=store_keywords, params=store_params) + store_extra
    files = {
        "vllm/__init__.py": "",
        "vllm/distributed/__init__.py": "",
        base + "__init__.py": "",
        "vllm/unrelated.py": "class BlockObjectStore:  # same name, another class\n    pass\n",
        "vllm_user_outside.py": f"from {STORE} import BlockObject\n",
        base + "connector.py": f"from {STORE} import BlockObjectStoreError\n",
    }
    if kind in ("shm", "shm_grows"):
        names = {"package": PACKAGE, "store": STORE, "grows": kind == "shm_grows"}
        files[base + "store.py"] = _BRANCH_STORE.format(**names) + wrapper_extra
        files[base + "shm.py"] = _BRANCH_SHM.format(**names) + store_extra
        files[base + "mooncake.py"] = _BRANCH_MOONCAKE.format(**names)
        files[base + "worker.py"] = _BRANCH_WORKER.format(**names) + textwrap.dedent(worker_extra)
        files[base + "routed_experts.py"] = _BRANCH_ROUTED_EXPERTS.format(**names)
        return files
    files[base + "store.py"] = _HEADER + wrapper + fixed + (_VARIABLE if kind == "variable" else "")
    files[base + "worker.py"] = (
        f"from {STORE} import BackgroundBlockObjectStore, BlockObjectStore\nOTHER = 42\n"
    )
    files[base + "routed_experts.py"] = (
        f"from {STORE} import BackgroundBlockObjectStore, BlockObject, BlockObjectStore\n"
    )
    if kind == "variable":
        files[base + "worker.py"] += f"from {STORE} import VariableBlockObjectStore\n"
    files[base + "worker.py"] += textwrap.dedent(worker_extra)
    return files


def _ours(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.") or name == "vllm_user_outside"


@dataclasses.dataclass
class FakeTree:
    kind: str
    originals: dict[str, Any]
    modules: dict[str, types.ModuleType]


@dataclasses.dataclass
class TreeMaker:
    root: Path
    monkeypatch: pytest.MonkeyPatch

    def __call__(self, kind: str, *, known: bool = False, **options: Any) -> FakeTree:
        """Writes a fake vLLM of layout ``kind`` and imports it as vLLM would be imported.

        ``known``: the plugin recognizes its files as a release CI proves (as it does vLLM
        0.32.0's and 0.33.0's), so it swaps everything aostore has; otherwise the tree is an
        unknown vLLM and gets the class-by-class check.
        """
        where = self.root / kind
        for name, text in tree_sources(kind, **options).items():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            (where / name).write_text(textwrap.dedent(text))
        self.monkeypatch.syspath_prepend(str(where))
        importlib.invalidate_caches()
        branch = ["shm", "mooncake"] if kind.startswith("shm") else []
        parts = ["connector", "worker", "routed_experts", *branch]
        modules = {part: importlib.import_module(f"{PACKAGE}.{part}") for part in parts}
        modules[STORE] = sys.modules[STORE]
        modules["unrelated"] = importlib.import_module("vllm.unrelated")
        modules["outside"] = importlib.import_module("vllm_user_outside")
        sys.modules["vllm.placeholder"] = None  # type: ignore[assignment]  # a failed import
        store_module = modules[STORE]
        originals = {
            name: value for name, value in vars(store_module).items() if isinstance(value, type)
        }
        if known:
            files = compat_fingerprint.fingerprint(store_module)
            assert files is not None
            releases = {**compat_fingerprint.KNOWN_RELEASES, f"fake vLLM ({kind})": files}
            self.monkeypatch.setattr(compat_fingerprint, "KNOWN_RELEASES", releases)
        return FakeTree(kind, originals, modules)


@pytest.fixture
def make_tree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[TreeMaker]:
    """Removes any ``vllm`` modules for the test and puts them back afterwards."""
    monkeypatch.delenv(vllm_settings.ENV_DISABLE, raising=False)
    monkeypatch.delenv(vllm_settings.ENV_PROFILE, raising=False)
    saved = {name: mod for name, mod in sys.modules.items() if _ours(name)}
    for name in saved:
        del sys.modules[name]
    targets = _log.growth_targets()
    # Each test starts from the installed classes' defaults; what its register() binds goes.
    unbind = vllm_stores.bind(prefault="background", tier=None)
    try:
        yield TreeMaker(tmp_path, monkeypatch)
    finally:
        unbind()
        for target in _log.growth_targets():
            if target not in targets:
                _log.remove_growth_target(target)
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture(params=["grow", "fail-closed"])
def tree(request: pytest.FixtureRequest, make_tree: TreeMaker) -> FakeTree:
    """vLLM 0.33's and 0.32's layouts, recognized as releases CI proves."""
    return make_tree(request.param, known=True)


def plugin_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]
