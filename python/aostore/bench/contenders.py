"""The stores a replay or benchmark measures, each a :class:`Contender` with the classes it
ships: aostore's store (as built directly, or as the vLLM plugin builds it), vLLM's own store
(when ``vllm`` is importable; :func:`vllm_contender` imports it lazily) and the pure-Python
replica of it (``aostore.bench.baseline``), each with its own ``BlockObject`` and background
writer classes.
"""

from __future__ import annotations

import importlib
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore

VLLM_STORE_MODULE = "vllm.distributed.aux_output_connector.store"
"""vLLM's auxiliary-output store module: the store aostore replaces."""


def commit_pages(arena: mmap.mmap) -> None:
    """Commits every page of an mmap arena (in huge pages where the kernel allows), as
    aostore's ``prefault=True`` does, for stores that have no such option (vLLM's)."""
    madvise = getattr(arena, "madvise", None)
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if madvise is not None and huge is not None:
        madvise(huge)
    for offset in range(0, len(arena), mmap.PAGESIZE):
        arena[offset] = 0


@dataclass(frozen=True)
class Contender:
    """One store implementation a replay or benchmark measures, with the classes it ships.

    ``name`` keys results (``"aostore"``, ``"vllm"``, ``"replica"``); ``label`` is for people
    (``"vLLM 0.33.0"``). ``block_object(key, payload)`` makes a batch entry and
    ``background(store, max_pending_batches=n)`` a writer thread, both the implementation's own.
    """

    name: str
    label: str
    store_class: Any
    block_object: Any
    background: Any
    options: Mapping[str, Any] = field(default_factory=dict)
    takes_prefault: bool = True

    def build(self, *, max_bytes: int, object_nbytes: int, prefault: bool = False) -> Any:
        """A new store of ``max_bytes`` bytes of ``object_nbytes``-byte objects. ``prefault``
        commits the arena now: through the constructor where it has the option, otherwise
        by touching every page of the store's mmap arena (vLLM's ``_arena``)."""
        if self.takes_prefault:
            return self.store_class(
                max_bytes=max_bytes, object_nbytes=object_nbytes, prefault=prefault, **self.options
            )
        store = self.store_class(max_bytes=max_bytes, object_nbytes=object_nbytes, **self.options)
        if prefault:
            arena = getattr(store, "_arena", None)
            if not isinstance(arena, mmap.mmap):
                store.close()
                raise ValueError(f"{self.label}: cannot prefault a store without an mmap _arena")
            commit_pages(arena)
        return store


def aostore_contender(profile: str = "fail-closed") -> Contender:
    """aostore's store with ``profile``; ``"grow"`` is what the vLLM plugin builds for 0.33."""
    return Contender(
        name="aostore",
        label="aostore",
        store_class=BlockObjectStore,
        block_object=BlockObject,
        background=BackgroundBlockObjectStore,
        options={"profile": profile},
    )


def plugin_contender() -> Contender:
    """aostore's store as vLLM builds its store once the aostore plugin is in: the class the
    plugin installs for vLLM 0.33 (``profile="grow"``), called as vLLM's worker calls it, with
    ``max_bytes`` and ``object_nbytes`` only (so whatever arena defaults it has apply).
    ``build(prefault=True)`` is refused: use :func:`aostore_contender` for that."""
    from aostore.vllm_plugin import GrowBlockObjectStore

    return Contender(
        name="aostore",
        label="aostore",
        store_class=GrowBlockObjectStore,
        block_object=BlockObject,
        background=BackgroundBlockObjectStore,
        takes_prefault=False,
    )


def replica_contender() -> Contender:
    """The pure-Python replica of vLLM's store (``aostore.bench.baseline``), behind aostore's Python
    writer thread (the same queue-and-thread design as vLLM's)."""
    from aostore.bench.baseline import PythonBlockObjectStore

    return Contender(
        name="replica",
        label="replica",
        store_class=PythonBlockObjectStore,
        block_object=BlockObject,
        background=BackgroundBlockObjectStore,
    )


def vllm_contender() -> tuple[Contender | None, str]:
    """vLLM's own store, imported now; ``(None, why)`` when vLLM cannot be imported.

    If the aostore plugin already replaced the module's classes, vLLM's originals (which the
    plugin keeps on the module) are used; a module that holds no vLLM class is refused.
    """
    try:
        module = importlib.import_module(VLLM_STORE_MODULE)
    except ModuleNotFoundError as error:
        if error.name == "vllm":
            return None, "not installed"
        if error.name is not None and VLLM_STORE_MODULE.startswith(error.name):
            return None, f"not usable (this vLLM has no {VLLM_STORE_MODULE})"
        return None, f"not importable ({type(error).__name__}: {error})"
    except Exception as error:  # vLLM's import can fail in many ways (torch, CUDA libraries)
        return None, f"not importable ({type(error).__name__}: {error})"
    names = ("BlockObjectStore", "BlockObject", "BackgroundBlockObjectStore")
    originals = getattr(module, "__aostore_originals__", None) or {}
    classes = {name: originals.get(name) or getattr(module, name, None) for name in names}
    for name, value in classes.items():
        if value is None or not getattr(value, "__module__", "").startswith("vllm"):
            return None, f"not usable ({VLLM_STORE_MODULE}.{name} is not vLLM's)"
    try:
        from importlib.metadata import version

        release = version("vllm")
    except Exception:
        release = str(getattr(importlib.import_module("vllm"), "__version__", "?"))
    return (
        Contender(
            name="vllm",
            label=f"vLLM {release}",
            store_class=classes["BlockObjectStore"],
            block_object=classes["BlockObject"],
            background=classes["BackgroundBlockObjectStore"],
            takes_prefault=False,
        ),
        "",
    )


def contenders(*, vllm: bool = True, profile: str = "fail-closed") -> tuple[list[Contender], str]:
    """aostore, vLLM's store (when ``vllm`` and importable) and the replica, in that order;
    with why vLLM is missing (``""`` when it is there)."""
    found, why = vllm_contender() if vllm else (None, "not requested")
    chosen = [aostore_contender(profile)]
    if found is not None:
        chosen.append(found)
    chosen.append(replica_contender())
    return chosen, why
