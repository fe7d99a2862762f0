"""Putting the plan into vLLM: the swap of module globals, its undo, the mark, the start-up line.

:func:`register` is the ``vllm.general_plugins`` entry point (through ``aostore.vllm_plugin``);
docs/vllm-plugin.md says what it does and what it says.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Mapping
from typing import Any, cast

from aostore import _log

from . import dataplane, stores, transport
from .compat.names import FIXED_STORE, PACKAGE, STORE_MODULE, WRAPPER
from .compat.usage import vllm_modules
from .plan import Plan, decide
from .settings import ENV_DISABLE, Settings
from .transport.delivery import Delivery

LOGGER = "vllm.plugins.aostore"
"""The plugin's logger: under ``vllm``, so vLLM's default logging configuration shows it."""
MARK = "__aostore_originals__"
"""The store module's attribute that holds vLLM's classes the plugin replaced, by name."""

logger = logging.getLogger(LOGGER)
# One register or dry run at a time: vLLM may load plugins from several threads.
lock = threading.Lock()


def store_module_logger() -> logging.Logger | None:
    """The store module's ``logger`` as it is now (a test may have patched it)."""
    return cast("logging.Logger | None", getattr(sys.modules.get(STORE_MODULE), "logger", None))


# (module namespace, or a class's attributes; global name, the value it had): what undoing a
# swap puts back.
_Undo = list[tuple[Any, str, Any]]


def patch_namespace(
    namespace: dict[str, Any], swaps: Mapping[int, tuple[Any, Any]], undo: _Undo
) -> bool:
    """Replaces the globals of one module that are replaced originals; records each in ``undo``."""
    hit = False
    for name, value in list(namespace.items()):
        original, new = swaps.get(id(value), (None, None))
        if original is not None and value is original:
            undo.append((namespace, name, value))
            namespace[name] = new
            hit = True
    return hit


def swap(originals: dict[str, Any], replacements: dict[str, Any], undo: _Undo) -> list[str]:
    """Replaces every global of an imported vLLM module that *is* one of the replaced originals."""
    # By identity: the originals stay alive in ``originals``, so their ids are unique.
    swaps = {id(originals[name]): (originals[name], new) for name, new in replacements.items()}
    patched: list[str] = []
    for module_name, module in vllm_modules():
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and patch_namespace(namespace, swaps, undo):
            patched.append(module_name)
    return sorted(patched)


def undo_swap(undo: _Undo) -> None:
    for namespace, name, value in reversed(undo):
        namespace[name] = value
    undo.clear()


def register() -> None:
    """Entry point for ``vllm.general_plugins``: swap aostore's classes into vLLM.

    Never raises (vLLM calls it unguarded, and an exception would stop every vLLM process at
    start-up): on any failure vLLM's classes stay, anything already swapped is put back, and
    one WARNING says why. Safe to call many times and from several threads; only the first
    effective call changes anything. Does nothing when ``AOSTORE_VLLM_PLUGIN=0`` or when the
    installed vLLM has no ``vllm.distributed.aux_output_connector.store`` module.
    """
    try:
        settings = Settings.from_env()
        if not settings.enabled:
            logger.debug("aostore vLLM plugin disabled by %s", ENV_DISABLE)
            return
        with lock:
            _register(settings)
    except Exception as error:
        try:
            why = f"{type(error).__name__}: {error}"
        except Exception:
            why = type(error).__name__
        try:
            logger.warning("aostore vLLM plugin: replaced nothing, vLLM's classes kept: %s", why)
        except Exception:
            pass


def _register(settings: Settings) -> None:
    try:
        store_module = importlib.import_module(STORE_MODULE)
    except ImportError:
        logger.debug("aostore vLLM plugin: %s not found; nothing to do", STORE_MODULE)
        return
    if hasattr(store_module, MARK):
        return
    decision, profile, reason, warn = decide(store_module, settings)
    originals = dict(decision.vllm)
    undo: _Undo = []
    targeted = False
    unbind = None
    try:
        # Bound first: vLLM may build a store as soon as the swap makes the class visible.
        unbind = stores.bind(prefault=settings.prefault, tier=decision.mooncake)
        patched = swap(originals, decision.replace, undo)
        setattr(store_module, MARK, {name: originals[name] for name in decision.replace})
        if decision.data_plane:
            installed = {name: decision.replace[name] for name in (FIXED_STORE, WRAPPER)}
            # The data plane goes in only where a record recognized its files.
            assert decision.record is not None
            planes = dataplane.install(
                installed,
                decision.record,
                decision.data_plane,
                swap,
                undo,
                settings.data_plane_report,
                transport=decision.transport,
            )
            patched = sorted({*patched, *planes})
        if decision.transport:
            delivery = None
            if decision.r3_delivery is not None:
                delivery = Delivery(
                    decision.r3_delivery,
                    settings.r3_budget,
                    settings.r3_ttl,
                    settings.r3_mooncake.config if settings.r3_mooncake else None,
                )
            patched = sorted({*patched, *transport.install(swap, undo, delivery)})
        if FIXED_STORE in decision.replace:
            targeted = _log.add_growth_target(store_module_logger)
    except BaseException:
        undo_swap(undo)
        if unbind is not None:
            unbind()
        if targeted:
            _log.remove_growth_target(store_module_logger)
        if MARK in vars(store_module):
            delattr(store_module, MARK)
        dataplane.remove_mark()
        raise
    _say(decision, patched, profile, reason, warn, settings)


def _say(
    decision: Plan,
    patched: list[str],
    profile: str,
    reason: str,
    warn: bool,
    settings: Settings | None = None,
) -> None:
    parts = []
    if decision.replace:
        planes = [name for f in decision.data_plane for name in dataplane.BY_FEATURE[f]]
        names = [*decision.replace, *planes]
        replaced = ", ".join(names)
        parts.append(f"replaced {replaced} in {len(patched)} module(s) ({', '.join(patched)})")
        if profile:
            parts.append(f"profile {profile!r} ({reason})")
    else:
        parts.append("replaced nothing")
    if decision.release:
        parts.append(f"{PACKAGE} is {decision.release}'s, which CI proves")
    else:
        parts.append(f"{PACKAGE} is not a release CI proves: checked class by class")
    if decision.mooncake_said:
        parts.append(decision.mooncake_said)
    if decision.data_plane_said:
        parts.append(decision.data_plane_said)
    if decision.transport_said:
        parts.append(decision.transport_said)
    if decision.r3_said:
        parts.append(decision.r3_said)
    if decision.note:
        parts.append(decision.note)
    parts += [f"kept vLLM's {name}: {why}" for name, why in decision.keep.items()]
    # Every other ignored setting (a switch, the prefault) is said, and warned of, here.
    said = " ".join(parts)
    ignored = dict(settings.ignored) if settings is not None else {}
    parts += [f"{name}: {why}" for name, why in ignored.items() if why not in said]
    # A Mooncake setting that was asked for and is not used deserves a warning.
    tier_ignored = bool(decision.mooncake_said) and decision.mooncake is None
    # So does R3 by reference asked for and refused (a bad setting, the transport off).
    r3_refused = bool(decision.r3_said) and decision.r3_delivery is None
    warn = warn or tier_ignored or r3_refused or bool(ignored)
    level = logging.WARNING if decision.keep or not decision.replace or warn else logging.INFO
    if not (logger.isEnabledFor(level) and logger.hasHandlers()):
        # Nothing would show it (vLLM's front end loads plugins before it configures logging):
        # at WARNING, Python's last-resort handler does.
        level = logging.WARNING
    logger.log(level, "aostore vLLM plugin: %s", "; ".join(parts))
