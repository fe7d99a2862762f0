"""The plan: which of vLLM's store classes aostore replaces, and with which class.

docs/vllm-plugin.md gives the rules; :func:`decide` is what ``register`` swaps in and what the
dry run reports, from the one :class:`~aostore.vllm.settings.Settings` read for it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import sys
import textwrap
from collections.abc import Mapping
from typing import Any, cast

import aostore
from aostore import BlockObjectStore, ShmBlockObjectStore, _log

from . import probe
from .compat import differential, releases
from .compat.compare import compare, private_gap, private_names
from .compat.fingerprint import package_directory, recognize
from .compat.hazards import source_hazards
from .compat.names import (
    COMPANIONS,
    ERROR,
    FIXED_STORE,
    OBJECT,
    PACKAGE,
    PEER_MODULES,
    SHM_STORE,
    STORE_METHODS,
    STORE_MODULE,
    WRAPPER,
)
from .compat.references import hidden_references
from .compat.surface import surface
from .compat.usage import usage, vllm_sources
from .settings import (
    ENV_DATA_PLANE,
    ENV_MOONCAKE,
    ENV_R3_DELIVERY,
    ENV_TRANSPORT,
    MooncakeTier,
    Settings,
)
from .stores import (
    EngineBlockObjectStore,
    EngineShmBlockObjectStore,
    GrowBlockObjectStore,
    TieredEngineBlockObjectStore,
    TieredGrowBlockObjectStore,
)


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
    record: releases.Release | None = None
    """``release``'s record, taken once at recognition and carried to install; ``None`` where
    there is none (a name known only for its store files, as tests' fake trees are)."""
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
    """vLLM store name -> the ``aostore.vllm.compat.differential.Verdict`` of its differential."""
    data_plane: tuple[str, ...] = ()
    """The data-plane features that go in (``aostore.vllm.dataplane``; the worker plane, the
    scheduler side: ``aostore.vllm.compat.releases.FEATURES``), each where the release record
    recognizes its files; set by :func:`decide`."""
    data_plane_said: str = ""
    """Why the data plane is on or off, for the start-up line and ``aostore vllm-check``."""
    transport: bool = False
    """Whether aostore's transport (``aostore.vllm.transport``) goes in; set by :func:`decide`."""
    transport_said: str = ""
    """Why the transport is on or off, for the start-up line."""
    r3_delivery: str | None = None
    """R3 delivery by reference's default mode where it goes in (``None``: off)."""
    r3_said: str = ""
    """Why it is on or off (``""``: not asked for)."""


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
    directory = package_directory(module)
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


def _behaviour_gap(result: Plan, name: str, settings: Settings) -> str | None:
    """Runs the scripted differential (``aostore.vllm.compat.differential``) between vLLM's store
    ``name`` and the class the plugin would install for it; why it stays vLLM's, or ``None``."""
    theirs = result.vllm[name]
    object_cls = result.vllm.get(OBJECT)
    if object_cls is None:
        return f"behaviour not proven: the differential needs vLLM's {OBJECT}"
    if name == FIXED_STORE:
        if result.profile_choice is None:
            result.profile_choice = probe.choose_profile(result.vllm, settings)
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
    silenced = probe.quiet(theirs.__module__, STORE_MODULE, _log.logger.name)
    try:
        verdict = differential.differential(
            theirs, ours, make_object=object_cls, errors=errors,
            names=(f"vLLM's {name}", installed),
        )  # fmt: skip
    finally:
        for one in silenced:
            one.removeFilter(probe.drop)
    result.differentials[name] = verdict
    if verdict.failed:
        return f"behaviour not proven: the scripted differential could not run ({verdict.failed})"
    if verdict.difference:
        return f"behaves unlike {installed} in the scripted differential: {verdict.difference}"
    return None


def plan(module: Any, settings: Settings | None = None) -> Plan:
    """Decides which of ``module``'s classes aostore replaces (docs/vllm-plugin.md); ``settings``
    (an empty environment's unless given) choose the profile the differential runs."""
    settings = Settings() if settings is None else settings
    release = recognize(module)
    record = None if release is None else releases.BY_NAME.get(release)
    result = Plan(_layout_classes(module), release=release, record=record)
    ours = aostore_classes(result.vllm)
    covered: dict[str, type] = {}
    strict = result.release is None
    directory = package_directory(module)
    # vLLM's files on disk, whatever this process has imported; on a release CI proves, the
    # package's own files are CI's and only the code outside it is looked at.
    sources = vllm_sources(module, result.vllm)
    hazards, unparsed = source_hazards(sources, result.vllm, package=directory, inside=strict)
    # On a release CI proves, outside code matters for the private names of vLLM's classes
    # (the public ones are compared name by name): only files that read one are parsed.
    private = None if strict else {n for c in result.vllm.values() for n in private_names(c)}
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
                gap = private_gap(cls, ours[name], used)
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
            grows = probe.original_grows(result.vllm, SHM_STORE)
            if grows is not False:
                gap = f"vLLM's {SHM_STORE} " + ("grows" if grows else "could not be probed")
        if gap is None and name in (FIXED_STORE, SHM_STORE):
            # Same names and signatures; now the same behaviour (docs/vllm-plugin.md).
            gap = _behaviour_gap(result, name, settings)
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


def decide(store_module: Any, settings: Settings) -> tuple[Plan, str, str, bool]:
    """What :func:`register` swaps in (and :func:`dry_run` reports): the plan, with the fixed
    store's class chosen, and the profile, why, and whether that deserves a warning. The
    Mooncake tier's verdict is in ``plan.mooncake`` and ``plan.mooncake_said``."""
    decision = plan(store_module, settings)
    profile = reason = ""
    warn = False
    tier, said = settings.tier, settings.tier_said
    if FIXED_STORE in decision.replace:
        choice = decision.profile_choice or probe.choose_profile(decision.vllm, settings)
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
    decision.data_plane, decision.data_plane_said = _data_plane(decision, settings)
    decision.transport, decision.transport_said = _transport(decision, settings)
    decision.r3_delivery, decision.r3_said = _r3(decision, settings)
    return decision, profile, reason, warn


RUST_FRONTEND = "VLLM_USE_RUST_FRONTEND"


def _r3(decision: Plan, settings: Settings) -> tuple[str | None, str]:
    """Whether R3 delivery by reference goes in (its default mode), and what to say."""
    if settings.r3_said:
        return None, settings.r3_said
    if settings.r3_delivery is None:
        return None, ""
    asked = f"{ENV_R3_DELIVERY}={settings.r3_delivery}"
    if not decision.transport:
        return None, f"R3 by reference refused ({asked}): it needs the transport, which is off"
    if os.environ.get(RUST_FRONTEND, "").strip().lower() in ("1", "true", "yes", "on"):
        return None, (
            f"R3 by reference refused ({asked}): {RUST_FRONTEND}=1, and vLLM's Rust frontend "
            "finishes requests where aostore cannot keep their rows"
        )
    published = ""
    if settings.r3_mooncake is not None:
        published = (
            "; published for other nodes to Mooncake master "
            f"{settings.r3_mooncake.config.master_server_address}"
        )
    return settings.r3_delivery, (
        f"R3 by reference on (default {settings.r3_delivery}; arena of "
        f"{settings.r3_budget:,} bytes, unread references kept {settings.r3_ttl:g} s"
        f"{published})"
    )


def _unrecognized(decision: Plan, feature: str) -> str | None:
    """``None`` when the installed vLLM's files for ``feature`` are the decision's record's;
    else why not, in words."""
    if decision.record is None and decision.release is not None:
        return f"no record for {decision.release}"
    return releases.recognized(decision.record, feature)


def _transport(decision: Plan, settings: Settings) -> tuple[bool, str]:
    """Whether the transport goes in, and the start-up line's words for it."""
    if not settings.transport:
        return False, f"transport off ({ENV_TRANSPORT}={settings.raw.get(ENV_TRANSPORT, '')})"
    why = _unrecognized(decision, releases.TRANSPORT)
    if why is not None:
        return False, f"transport off ({why})"
    packs = "" if releases.WORKER in decision.data_plane else ", rows unpacked: no data plane"
    return True, f"transport on ({decision.release}'s transport files recognized{packs})"


def _data_plane(decision: Plan, settings: Settings) -> tuple[tuple[str, ...], str]:
    """The data-plane features that go in, and the start-up line's words for them."""
    if not settings.data_plane:
        return (), f"data plane off ({ENV_DATA_PLANE}={settings.raw.get(ENV_DATA_PLANE, '')})"
    if FIXED_STORE not in decision.replace or WRAPPER not in decision.replace:
        return (), "data plane off (vLLM's store is kept)"
    if decision.mooncake is not None:
        return (), "data plane off (the Mooncake tier is on; its blocks go through the tier)"
    why = {
        feature: _unrecognized(decision, feature)
        for feature in (releases.WORKER, releases.SCHEDULER)
    }
    on = tuple(feature for feature, reason in why.items() if reason is None)
    if not on:
        return (), f"data plane off ({why[releases.WORKER]})"
    if len(on) == len(why):
        return on, f"data plane on ({decision.release}'s worker and scheduler files recognized)"
    off = ", ".join(f"{feature} off: {reason}" for feature, reason in why.items() if reason)
    return on, f"data plane on for the {on[0]} only ({off})"
