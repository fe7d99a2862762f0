"""vLLM general plugin: puts aostore's classes into vLLM's auxiliary-output store module.

Installed as the ``aostore`` entry point of the ``vllm.general_plugins`` group, so vLLM calls
:func:`register` in every process it starts (``vllm.plugins.load_general_plugins``). It then

1. imports ``vllm.distributed.aux_output_connector.store`` and replaces its
   ``BlockObjectStore``, ``BlockObject``, ``BlockObjectStoreError`` and
   ``BackgroundBlockObjectStore`` with aostore's;
2. scans every module under ``vllm`` that is already imported (the worker, routed-experts and
   connector modules import these names at import time) and replaces each global that *is*
   one of vLLM's original objects; other globals, even with the same name, are left alone;
3. picks the profile matching the installed vLLM. It runs vLLM's own store once on a one-slot
   arena with two referenced objects: a store that grows (vLLM 0.33) gets ``profile="grow"``,
   one that raises ``BlockObjectStoreError`` gets ``"fail-closed"``. Testing the behaviour
   rather than a version number or a signature keeps working across releases that change
   neither. If the probe cannot tell, the default ``"fail-closed"`` is used with a warning;
   ``AOSTORE_VLLM_PROFILE=grow|fail-closed`` forces a profile and skips the probe.

Calling :func:`register` again does nothing (the store module is marked), and
``AOSTORE_VLLM_PLUGIN=0`` (also ``false``, ``no``, ``off``) turns the plugin off. What it did
is logged once, at INFO, on the ``aostore`` logger.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from typing import Any, cast

import aostore
from aostore._store import BlockObjectStore

__all__ = ["ENV_DISABLE", "ENV_PROFILE", "STORE_MODULE", "GrowBlockObjectStore", "register"]

STORE_MODULE = "vllm.distributed.aux_output_connector.store"
"""The vLLM module whose classes the plugin replaces."""
ENV_DISABLE = "AOSTORE_VLLM_PLUGIN"
"""Set to ``0``/``false``/``no``/``off`` to turn the plugin off."""
ENV_PROFILE = "AOSTORE_VLLM_PROFILE"
"""Set to ``grow`` or ``fail-closed`` to force a profile instead of probing vLLM's store."""

_NAMES = ("BlockObjectStore", "BlockObject", "BlockObjectStoreError", "BackgroundBlockObjectStore")
_MARK = "__aostore_originals__"
_PROFILES = ("fail-closed", "grow")

_logger = logging.getLogger("aostore")
_lock = threading.Lock()


class GrowBlockObjectStore(BlockObjectStore):
    """``aostore.BlockObjectStore`` whose ``profile`` defaults to ``"grow"`` (vLLM 0.33).

    Takes the same keyword arguments (``max_bytes`` and ``object_nbytes`` in bytes, ``policy``,
    ``profile``, ...) and passes them on unchanged.
    """

    __slots__ = ()

    def __new__(cls, *, profile: str = "grow", **kwargs: Any) -> GrowBlockObjectStore:
        return cast(GrowBlockObjectStore, super().__new__(cls, profile=profile, **kwargs))


def _drop(record: logging.LogRecord) -> bool:
    return False


def _original_grows(originals: dict[str, Any]) -> bool | None:
    """Whether vLLM's own store grows when every object is referenced; ``None``: cannot tell."""
    store_cls, object_cls = originals["BlockObjectStore"], originals["BlockObject"]
    error_cls = originals["BlockObjectStoreError"]
    keys = ["aostore-probe-0", "aostore-probe-1"]
    # vLLM's store warns when it grows: keep the probe out of the user's log.
    quiet = logging.getLogger(STORE_MODULE)
    quiet.addFilter(_drop)
    try:
        store = store_cls(max_bytes=1, object_nbytes=1)
        try:
            store.put([object_cls(key, b"\0") for key in keys], retain_keys=keys)
            return int(store.num_slots) >= len(keys)
        except error_cls:
            return False
        finally:
            store.close()
    except Exception:
        return None
    finally:
        quiet.removeFilter(_drop)


def _choose_profile(originals: dict[str, Any]) -> tuple[str, str]:
    """The profile to install and why."""
    forced = os.environ.get(ENV_PROFILE, "").strip()
    if forced:
        if forced not in _PROFILES:
            raise ValueError(f"{ENV_PROFILE} must be one of {_PROFILES}, not {forced!r}")
        return forced, f"{ENV_PROFILE}={forced}"
    grows = _original_grows(originals)
    if grows is None:
        _logger.warning(
            "aostore vLLM plugin: could not probe vLLM's BlockObjectStore; using profile "
            "'fail-closed' (set %s to choose)",
            ENV_PROFILE,
        )
        return "fail-closed", "probe inconclusive"
    if grows:
        return "grow", "vLLM's store grows"
    return "fail-closed", "vLLM's store fails closed"


def register() -> None:
    """Entry point for ``vllm.general_plugins``: swap aostore's classes into vLLM.

    Safe to call many times and from several threads; only the first effective call changes
    anything. Does nothing when ``AOSTORE_VLLM_PLUGIN=0`` or when the installed vLLM has no
    ``vllm.distributed.aux_output_connector.store`` module.
    """
    if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        _logger.debug("aostore vLLM plugin disabled by %s", ENV_DISABLE)
        return
    with _lock:
        try:
            store_module = importlib.import_module(STORE_MODULE)
        except ImportError:
            _logger.debug("aostore vLLM plugin: %s not found; nothing to do", STORE_MODULE)
            return
        if hasattr(store_module, _MARK):
            return
        originals = {name: getattr(store_module, name, None) for name in _NAMES}
        missing = [name for name, value in originals.items() if value is None]
        if missing:
            _logger.warning(
                "aostore vLLM plugin: %s has no %s; this vLLM is not supported, nothing replaced",
                STORE_MODULE,
                ", ".join(missing),
            )
            setattr(store_module, _MARK, {})  # warn once
            return
        profile, reason = _choose_profile(originals)
        replacements: dict[str, Any] = {
            "BlockObjectStore": GrowBlockObjectStore if profile == "grow" else BlockObjectStore,
            "BlockObject": aostore.BlockObject,
            "BlockObjectStoreError": aostore.BlockObjectStoreError,
            "BackgroundBlockObjectStore": aostore.BackgroundBlockObjectStore,
        }
        patched: list[str] = []
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == "vllm" or module_name.startswith("vllm.")):
                continue
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            hit = False
            for name in _NAMES:
                if namespace.get(name, None) is originals[name]:
                    namespace[name] = replacements[name]
                    hit = True
            if hit:
                patched.append(module_name)
        setattr(store_module, _MARK, originals)
        _logger.info(
            "aostore vLLM plugin: replaced %s in %d module(s) (%s); profile %r (%s)",
            ", ".join(_NAMES),
            len(patched),
            ", ".join(sorted(patched)),
            profile,
            reason,
        )
