"""vLLM general plugin: puts aostore's classes into vLLM's auxiliary-output store module.

Installed as the ``aostore`` entry point of the ``vllm.general_plugins`` group, so vLLM calls
:func:`register` in every process it starts (``vllm.plugins.load_general_plugins``). It then

1. imports ``vllm.distributed.aux_output_connector.store`` and checks its surface before
   replacing anything. Each public class the module holds from vLLM's aux-output package is
   compared with aostore's class of the same name (:func:`aostore_classes`): every name in
   :func:`surface` of vLLM's class (public methods and attributes, annotated fields, the
   attributes its methods assign on ``self``, its constructor keywords) must exist on aostore's.
   vLLM's worker code can only call what vLLM's classes define, so this covers it too. A class
   is replaced only when aostore covers it and, for the classes that only make sense beside
   aostore's stores, when those are replaced as well (see :func:`plan`). Anything else stays
   vLLM's, and the start-up line says why;
2. scans every module under ``vllm`` that is already imported (the worker, routed-experts and
   connector modules import these names at import time) and replaces each global that *is* a
   replaced original, whatever its name there; other globals are left alone;
3. picks the profile for the fixed store. It runs vLLM's own store once on a one-slot arena with
   two referenced objects: a store that grows (vLLM 0.33) gets ``profile="grow"``, one that
   raises ``BlockObjectStoreError`` gets ``"fail-closed"``. Testing the behaviour rather than a
   version number keeps working across releases that change neither. If the probe cannot
   tell, ``"fail-closed"`` is used with a warning; ``AOSTORE_VLLM_PROFILE=grow|fail-closed``
   forces a profile and skips the probe;
4. sends aostore's growth warnings to the store module's ``logger`` too (looked up at each
   growth), where vLLM's users and tests look for them.

Calling :func:`register` again does nothing (the store module is marked), and
``AOSTORE_VLLM_PLUGIN=0`` (also ``false``, ``no``, ``off``) turns the plugin off. What it did is
said once per process, in one line on the ``vllm.plugins.aostore`` logger: vLLM's default
logging shows ``vllm.*`` loggers at INFO with its own handler. The line is at INFO when every
class was replaced and at WARNING when any class stays vLLM's, or when nothing would show INFO
yet (vLLM's front end loads plugins before it configures logging).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import os
import sys
import textwrap
import threading
from typing import Any, Literal, Self, cast

import aostore
from aostore import _log
from aostore._store import BlockObjectStore

__all__ = [
    "ENV_DISABLE",
    "ENV_PREFAULT",
    "ENV_PROFILE",
    "LOGGER",
    "STORE_MODULE",
    "EngineBlockObjectStore",
    "GrowBlockObjectStore",
    "Plan",
    "aostore_classes",
    "plan",
    "register",
    "surface",
]

STORE_MODULE = "vllm.distributed.aux_output_connector.store"
"""The vLLM module whose classes the plugin replaces."""
PACKAGE = "vllm.distributed.aux_output_connector"
"""The package whose classes the plugin compares (those of the store module and its peers)."""
ENV_DISABLE = "AOSTORE_VLLM_PLUGIN"
"""Set to ``0``/``false``/``no``/``off`` to turn the plugin off."""
ENV_PROFILE = "AOSTORE_VLLM_PROFILE"
"""Set to ``grow`` or ``fail-closed`` to force a profile instead of probing vLLM's store."""
ENV_PREFAULT = "AOSTORE_VLLM_PREFAULT"
"""How stores built by vLLM commit their arena: ``background`` (the default), ``1`` (at
construction) or ``0`` (on first write)."""
LOGGER = "vllm.plugins.aostore"
"""The plugin's logger: under ``vllm``, so vLLM's default logging configuration shows it."""

FIXED_STORE = "BlockObjectStore"
WRAPPER = "BackgroundBlockObjectStore"
# Replaced only beside a store of aostore's: alone they would change vLLM for nothing.
COMPANIONS = ("BlockObject", "BlockObjectStoreError")
# What makes a class a store (the wrapper aside): the calls vLLM's writer makes on it.
STORE_METHODS = frozenset({"put", "get_concatenated", "close"})

_MARK = "__aostore_originals__"
_PROFILES = ("fail-closed", "grow")

_logger = logging.getLogger(LOGGER)
_lock = threading.Lock()


def _engine_prefault() -> bool | Literal["background"]:
    value = os.environ.get(ENV_PREFAULT, "background").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return "background"


class EngineBlockObjectStore(BlockObjectStore):
    """``aostore.BlockObjectStore`` as the vLLM plugin installs it (profile ``fail-closed``).

    The one default that differs: ``prefault`` comes from ``AOSTORE_VLLM_PREFAULT`` and is
    ``"background"`` unless set. vLLM sizes the arena to be filled (1.1x the KV cache's blocks
    in an RL run), and a page fault on the writer thread costs more than the copy it precedes
    (W3: a fresh arena costs about 4x the memcpy floor in faults), so a thread commits every
    page from engine start while start-up goes on. The memory effect: the whole arena is
    resident from the start instead of as it fills. Other keyword arguments (``max_bytes`` and
    ``object_nbytes`` in bytes, ``policy``, ``profile``, ``pin_memory``) pass on unchanged.
    """

    __slots__ = ()
    _default_profile = "fail-closed"

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        policy: Any | None = None,
        profile: str | None = None,
        pin_memory: bool = False,
        prefault: bool | Literal["background"] | None = None,
    ) -> Self:
        store = super().__new__(
            cls,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            policy=policy,
            profile=cls._default_profile if profile is None else profile,
            pin_memory=pin_memory,
            prefault=_engine_prefault() if prefault is None else prefault,
        )
        return cast(Self, store)


class GrowBlockObjectStore(EngineBlockObjectStore):
    """``EngineBlockObjectStore`` whose ``profile`` defaults to ``"grow"`` (vLLM 0.33)."""

    __slots__ = ()
    _default_profile = "grow"


# -- The surface check -------------------------------------------------------------------------


def _public(names: Any) -> set[str]:
    return {name for name in names if isinstance(name, str) and not name.startswith("_")}


def _assigned_on_self(cls: type) -> set[str]:
    """Names that ``cls``'s own methods assign on ``self`` (instance attributes); best effort."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return _public(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _keywords(cls: type) -> set[str]:
    """The constructor's parameters a caller may pass by keyword."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {f"{p.name}=" for p in parameters if p.kind in kinds}


def surface(cls: type) -> frozenset[str]:
    """What code may use on ``cls`` or its instances.

    Public names from ``dir(cls)``, public annotated fields (dataclass fields), public
    attributes that the class's methods assign on ``self``, and constructor keywords written
    ``"name="``.
    """
    names = _public(dir(cls))
    for klass in cls.__mro__:
        names |= _public(vars(klass).get("__annotations__", {}))
        if klass.__module__ not in ("builtins", "abc", "typing"):
            names |= _assigned_on_self(klass)
    if dataclasses.is_dataclass(cls):
        names |= _public(field.name for field in dataclasses.fields(cls))
    return frozenset(names | _keywords(cls))


def aostore_classes(names: Any = ()) -> dict[str, type]:
    """aostore's class for each of ``names`` it has (same name), plus the four it always has.

    ``BlockObjectStore`` is aostore's fixed store (the profile is chosen later); a name aostore
    does not define (``VariableBlockObjectStore`` before aostore has one) is simply absent.
    """
    table: dict[str, type] = {
        FIXED_STORE: BlockObjectStore,
        WRAPPER: aostore.BackgroundBlockObjectStore,
        "BlockObject": aostore.BlockObject,
        "BlockObjectStoreError": aostore.BlockObjectStoreError,
    }
    for name in names:
        value = getattr(aostore, name, None)
        if name not in table and isinstance(value, type):
            table[name] = value
    return table


@dataclasses.dataclass
class Plan:
    """What the plugin does with one store module: vLLM's classes, and the verdict on each."""

    vllm: dict[str, type]
    """Public classes of vLLM's aux-output package that the store module holds, by name."""
    replace: dict[str, type] = dataclasses.field(default_factory=dict)
    """vLLM name -> aostore's class to put in its place."""
    keep: dict[str, str] = dataclasses.field(default_factory=dict)
    """vLLM name -> why it stays vLLM's."""
    note: str = ""
    """Something about the layout worth saying (the fixed store missing from the module)."""


def _module_classes(module: Any) -> dict[str, type]:
    return {
        name: value
        for name, value in dict(getattr(module, "__dict__", {})).items()
        if not name.startswith("_")
        and isinstance(value, type)
        and (value.__module__ == PACKAGE or value.__module__.startswith(PACKAGE + "."))
    }


def _stores_elsewhere(store_module_name: str) -> list[str]:
    """Store-like classes that other imported modules of the package define."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name == store_module_name or not name.startswith(PACKAGE + "."):
            continue
        for class_name, cls in _module_classes(module).items():
            if cls.__module__ == name and class_name != WRAPPER and STORE_METHODS <= surface(cls):
                found.append(f"{name}.{class_name}")
    return sorted(found)


def plan(module: Any) -> Plan:
    """Decides, from the two surfaces, which of ``module``'s classes aostore replaces."""
    result = Plan(_module_classes(module))
    ours = aostore_classes(result.vllm)
    covered: dict[str, type] = {}
    for name, cls in result.vllm.items():
        if name not in ours:
            result.keep[name] = f"aostore has no {name}"
            continue
        missing = surface(cls) - surface(ours[name])
        if missing:
            result.keep[name] = f"aostore's {name} lacks {', '.join(sorted(missing))}"
        else:
            covered[name] = ours[name]
    stores = [
        name
        for name, cls in result.vllm.items()
        if name != WRAPPER and STORE_METHODS <= surface(cls)
    ]
    our_stores = [name for name in stores if name in covered]
    for name, replacement in covered.items():
        if name in COMPANIONS and not our_stores:
            result.keep[name] = "no store is replaced by aostore's"
        elif name == WRAPPER and (not our_stores or our_stores != stores):
            kept = [store for store in stores if store not in covered]
            why = f"it would wrap vLLM's {', '.join(kept)}" if kept else "no store is replaced"
            result.keep[name] = why
        else:
            result.replace[name] = replacement
    if FIXED_STORE not in result.vllm:
        elsewhere = _stores_elsewhere(getattr(module, "__name__", STORE_MODULE))
        where = f" (stores elsewhere: {', '.join(elsewhere)})" if elsewhere else ""
        result.note = f"{STORE_MODULE} defines no {FIXED_STORE}{where}"
    return result


# -- The profile -------------------------------------------------------------------------------


def _drop(record: logging.LogRecord) -> bool:
    return False


def _original_grows(originals: dict[str, Any]) -> bool | None:
    """Whether vLLM's own store grows when every object is referenced; ``None``: cannot tell."""
    store_cls, object_cls = originals.get(FIXED_STORE), originals.get("BlockObject")
    error_cls = originals.get("BlockObjectStoreError")
    if store_cls is None or object_cls is None or error_cls is None:
        return None
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


def _store_module_logger() -> logging.Logger | None:
    """The store module's ``logger`` as it is now (a test may have patched it)."""
    return cast("logging.Logger | None", getattr(sys.modules.get(STORE_MODULE), "logger", None))


# -- Registration ------------------------------------------------------------------------------


def _swap(originals: dict[str, Any], replacements: dict[str, Any]) -> list[str]:
    """Replaces every global of an imported vLLM module that *is* one of the replaced originals."""
    # By identity: the originals stay alive in ``originals``, so their ids are unique.
    swaps = {id(originals[name]): (originals[name], new) for name, new in replacements.items()}
    patched: list[str] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "vllm" or module_name.startswith("vllm.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        hit = False
        for name, value in list(namespace.items()):
            original, new = swaps.get(id(value), (None, None))
            if original is not None and value is original:
                namespace[name] = new
                hit = True
        if hit:
            patched.append(module_name)
    return sorted(patched)


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
        decision = plan(store_module)
        originals = dict(decision.vllm)
        profile = reason = ""
        if FIXED_STORE in decision.replace:
            profile, reason = _choose_profile(originals)
            decision.replace[FIXED_STORE] = (
                GrowBlockObjectStore if profile == "grow" else EngineBlockObjectStore
            )
        patched = _swap(originals, decision.replace)
        setattr(store_module, _MARK, {name: originals[name] for name in decision.replace})
        if FIXED_STORE in decision.replace:
            _log.add_growth_target(_store_module_logger)
        _say(decision, patched, profile, reason)


def _say(decision: Plan, patched: list[str], profile: str, reason: str) -> None:
    parts = []
    if decision.replace:
        replaced = ", ".join(decision.replace)
        parts.append(f"replaced {replaced} in {len(patched)} module(s) ({', '.join(patched)})")
        if profile:
            parts.append(f"profile {profile!r} ({reason})")
    else:
        parts.append("replaced nothing")
    if decision.note:
        parts.append(decision.note)
    parts += [f"kept vLLM's {name}: {why}" for name, why in decision.keep.items()]
    level = logging.WARNING if decision.keep or not decision.replace else logging.INFO
    if not (_logger.isEnabledFor(level) and _logger.hasHandlers()):
        # Nothing would show it (vLLM's front end loads plugins before it configures logging):
        # at WARNING, Python's last-resort handler does.
        level = logging.WARNING
    _logger.log(level, "aostore vLLM plugin: %s", "; ".join(parts))
