"""The plugin's settings, read from the environment once per ``register`` or dry run.

docs/vllm-plugin.md describes each variable; :class:`Settings` is the one value that carries
what they say to the plan, the probe and the installed classes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Literal

from aostore.mooncake import MOONCAKE_PIP_PACKAGE, MooncakeConfig
from aostore.mooncake.config import parse_size

ENV_DISABLE = "AOSTORE_VLLM_PLUGIN"
"""Set to ``0``/``false``/``no``/``off`` to turn the plugin off."""
ENV_PROFILE = "AOSTORE_VLLM_PROFILE"
"""Set to ``grow`` or ``fail-closed`` (any case, ``_`` for ``-``) to force a profile instead of
probing vLLM's store; any other value is ignored with a warning."""
ENV_PREFAULT = "AOSTORE_VLLM_PREFAULT"
"""How stores built by vLLM commit their arena: ``background`` (the default), ``1`` (at
construction) or ``0`` (on first write)."""
ENV_MOONCAKE = "AOSTORE_VLLM_MOONCAKE"
"""The path of a Mooncake client config (``mooncake.json``): stores that vLLM builds through the
plugin are then ``TieredBlockObjectStore`` s in front of Mooncake. Unset or empty: no tier."""

ENV_DATA_PLANE = "AOSTORE_VLLM_DATA_PLANE"
"""Set to ``0``/``false``/``no``/``off`` to keep vLLM's worker connector code (the data plane
off) while the plugin's store stays."""

ENV_DATA_PLANE_REPORT = "AOSTORE_VLLM_DATA_PLANE_REPORT"
"""A file that each data-plane connector appends one JSON line to at close or exit (tests'
proof from inside vLLM's processes): whether its data plane was on, why not, its steps."""

ENV_TRANSPORT = "AOSTORE_VLLM_TRANSPORT"
"""Set to ``0``/``false``/``no``/``off`` to keep vLLM's own transport of routed-experts rows
across its processes (``aostore.vllm.transport``) while the store and data plane stay."""

ENV_R3_DELIVERY = "AOSTORE_VLLM_R3_DELIVERY"
"""``reference`` or ``rows``: R3 rows by reference (``aostore.r3``) on, with that default for
requests (a request chooses with ``aostore_r3_delivery`` in its ``extra_args``). Unset: off."""
ENV_R3_BUDGET = "AOSTORE_VLLM_R3_BUDGET"
"""The R3 arena's bytes, reserved in ``/dev/shm`` at start (a number, or with ``K``/``M``/``G``
as the Mooncake tier's sizes: ``parse_size``; default ``1G``)."""
ENV_R3_TTL = "AOSTORE_VLLM_R3_TTL"
"""Seconds an unread reference's rows are kept (default 600; a reader can renew)."""
ENV_R3_MOONCAKE = "AOSTORE_VLLM_R3_MOONCAKE"
"""A Mooncake client config file (``MooncakeConfig``'s keys) for R3 across nodes: the frontend
publishes every reference's rows to Mooncake, in a segment of its own sized from the budget
(``aostore.r3.offnode``). Its own setting: ``AOSTORE_VLLM_MOONCAKE`` is vLLM's store's tier."""

R3_BUDGET = 1 << 30
R3_TTL = 600.0

VARIABLES = (
    ENV_DISABLE,
    ENV_PROFILE,
    ENV_PREFAULT,
    ENV_MOONCAKE,
    ENV_DATA_PLANE,
    ENV_DATA_PLANE_REPORT,
    ENV_TRANSPORT,
    ENV_R3_DELIVERY,
    ENV_R3_BUDGET,
    ENV_R3_TTL,
    ENV_R3_MOONCAKE,
)
PROFILES = ("fail-closed", "grow")

Prefault = bool | Literal["background"]


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


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the variables say, validated; the defaults are those of an empty environment."""

    enabled: bool = True
    """``AOSTORE_VLLM_PLUGIN`` leaves the plugin on."""
    profile: str | None = None
    """The profile ``AOSTORE_VLLM_PROFILE`` forces; ``None``: the probe decides."""
    profile_said: str = ""
    """What to say about ``AOSTORE_VLLM_PROFILE`` (forced, or ignored and why); ``""``: unset."""
    prefault: Prefault = "background"
    """How stores built by vLLM commit their arena (``AOSTORE_VLLM_PREFAULT``)."""
    tier: MooncakeTier | None = None
    """The Mooncake tier ``AOSTORE_VLLM_MOONCAKE`` names; ``None``: unset or ignored."""
    tier_said: str = ""
    """Why ``AOSTORE_VLLM_MOONCAKE`` is ignored; ``""``: unset or valid."""
    data_plane: bool = True
    """``AOSTORE_VLLM_DATA_PLANE`` leaves the native data plane on (where vLLM is recognized)."""
    data_plane_report: str | None = None
    """``AOSTORE_VLLM_DATA_PLANE_REPORT``'s file; ``None``: unset or empty."""
    transport: bool = True
    """``AOSTORE_VLLM_TRANSPORT`` leaves aostore's transport on (where vLLM is recognized)."""
    r3_delivery: str | None = None
    """``AOSTORE_VLLM_R3_DELIVERY``: ``reference``/``rows`` (delivery by reference on, with that
    default), or ``None`` (off: unset, or ignored and ``r3_said`` says why)."""
    r3_budget: int = R3_BUDGET
    r3_ttl: float = R3_TTL
    r3_said: str = ""
    """Why an R3 setting is ignored; ``""``: none is."""
    r3_mooncake: MooncakeTier | None = None
    """``AOSTORE_VLLM_R3_MOONCAKE``: where references are published for other nodes; ``None``:
    unset (references are read on this node only) or ignored."""
    ignored: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Every variable whose value was not taken, with why (the switches, the prefault, the
    profile, the tier and the R3 settings alike): ``aostore vllm-check`` lists them and a
    running engine's start-up line is a WARNING while any is here."""
    raw: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    """The variables that were set, as found (what ``aostore vllm-check`` quotes)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Reads and validates the variables (``os.environ`` unless given). Never raises for
        a bad value: it is ignored and ``profile_said``/``tier_said`` say why."""
        env = os.environ if environ is None else environ
        ignored: dict[str, str] = {}
        switches = {}
        for name in (ENV_DISABLE, ENV_DATA_PLANE, ENV_TRANSPORT):
            switches[name], why = _switch(env.get(name, ""))
            if why:
                ignored[name] = why
        prefault, why = _prefault(env.get(ENV_PREFAULT, ""))
        if why:
            ignored[ENV_PREFAULT] = why
        profile, profile_said = _profile(env.get(ENV_PROFILE, ""))
        if profile_said.startswith("ignored"):
            ignored[ENV_PROFILE] = profile_said
        tier, tier_said = _mooncake(env.get(ENV_MOONCAKE, ""))
        if tier_said:
            ignored[ENV_MOONCAKE] = tier_said
        r3_delivery, r3_budget, r3_ttl, r3_said, r3_ignored = _r3(env)
        ignored |= r3_ignored
        r3_mooncake, why = _config_file(ENV_R3_MOONCAKE, env.get(ENV_R3_MOONCAKE, ""), "R3 off")
        if why:
            ignored[ENV_R3_MOONCAKE] = why
            if r3_delivery is not None:
                # Not rows readable on this node only when other nodes were asked for.
                ignored.setdefault(ENV_R3_DELIVERY, f"ignored {r3_delivery!r}: R3 off: {why}")
                r3_delivery, r3_said = None, f"R3 by reference off: {why}"
        return cls(
            enabled=switches[ENV_DISABLE],
            profile=profile,
            profile_said=profile_said,
            prefault=prefault,
            tier=tier,
            tier_said=tier_said,
            data_plane=switches[ENV_DATA_PLANE],
            data_plane_report=env.get(ENV_DATA_PLANE_REPORT) or None,
            transport=switches[ENV_TRANSPORT],
            r3_delivery=r3_delivery,
            r3_budget=r3_budget,
            r3_ttl=r3_ttl,
            r3_said=r3_said,
            r3_mooncake=r3_mooncake,
            ignored=ignored,
            raw={name: env[name] for name in VARIABLES if name in env},
        )

    def effective(self) -> dict[str, str]:
        """Every variable's value in force, in words (``aostore vllm-check``'s table)."""
        tier = self.tier
        delivery = self.r3_delivery
        prefault = "background" if self.prefault == "background" else str(int(self.prefault))
        unused = "" if delivery else " (unused: R3 by reference is off)"
        return {
            ENV_DISABLE: "on" if self.enabled else "off",
            ENV_PROFILE: self.profile or "probed (vLLM's store decides)",
            ENV_PREFAULT: prefault,
            ENV_MOONCAKE: tier.describe() if tier else "off",
            ENV_DATA_PLANE: "on where vLLM is recognized" if self.data_plane else "off",
            ENV_DATA_PLANE_REPORT: self.data_plane_report or "off",
            ENV_TRANSPORT: "on where vLLM is recognized" if self.transport else "off",
            ENV_R3_DELIVERY: f"{delivery} by default" if delivery else "off (rows in the answer)",
            ENV_R3_BUDGET: f"{self.r3_budget} bytes{unused}",
            ENV_R3_TTL: f"{self.r3_ttl:g} s{unused}",
            ENV_R3_MOONCAKE: (
                f"published to Mooncake master {self.r3_mooncake.config.master_server_address}"
                f"{unused}"
                if self.r3_mooncake
                else "off (references are read on this node only)"
            ),
        }


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _switch(raw: str) -> tuple[bool, str]:
    """An on/off variable: (on, why its value was ignored). Unset or empty is on; a value that
    is neither on nor off is ignored (on) and said, rather than read as either."""
    value = raw.strip().lower()
    if value in _OFF:
        return False, ""
    if not value or value in _ON:
        return True, ""
    return True, f"ignored {raw!r} (not one of {'/'.join(_OFF)} or {'/'.join(_ON)}); on"


def _r3(env: Mapping[str, str]) -> tuple[str | None, int, float, str, dict[str, str]]:
    """The R3 settings, validated: (delivery, budget, ttl, what to say about a bad one, each
    bad variable with why; a bad one turns delivery by reference off rather than guess)."""
    delivery = env.get(ENV_R3_DELIVERY, "").strip().lower() or None
    budget_raw = env.get(ENV_R3_BUDGET, "").strip()
    ttl_raw = env.get(ENV_R3_TTL, "").strip()
    said: list[str] = []
    if delivery is not None and delivery not in ("rows", "reference"):
        said.append(f"{ENV_R3_DELIVERY}={env[ENV_R3_DELIVERY]!r} is not rows or reference")
    budget = R3_BUDGET
    if budget_raw:
        try:
            budget = parse_size(ENV_R3_BUDGET, budget_raw)
        except ValueError:
            budget = 0
        if budget < 4096:
            said.append(f"{ENV_R3_BUDGET}={budget_raw!r} is not a size of at least 4K")
    ttl = R3_TTL
    if ttl_raw:
        try:
            ttl = float(ttl_raw)
        except ValueError:
            ttl = 0.0
        if not (ttl > 0 and math.isfinite(ttl)):  # inf would keep unread rows for ever
            said.append(f"{ENV_R3_TTL}={ttl_raw!r} is not a positive, finite number of seconds")
    ignored = {
        name: f"ignored: {why}"
        for why in said
        for name in (ENV_R3_DELIVERY, ENV_R3_BUDGET, ENV_R3_TTL)
        if why.startswith(name + "=")
    }
    if said and delivery is not None:
        refused = "R3 by reference off: " + "; ".join(said)
        ignored.setdefault(ENV_R3_DELIVERY, f"ignored {delivery!r}: {refused}")
        return None, R3_BUDGET, R3_TTL, refused, ignored
    return delivery, budget if not said else R3_BUDGET, ttl if not said else R3_TTL, "", ignored


def _prefault(raw: str) -> tuple[Prefault, str]:
    """``AOSTORE_VLLM_PREFAULT``: (the mode, why its value was ignored)."""
    value = raw.strip().lower()
    if value in _OFF:
        return False, ""
    if value in _ON:
        return True, ""
    if value in ("", "background"):
        return "background", ""
    return "background", (
        f"ignored {raw!r} (not background, {'/'.join(_OFF)} or {'/'.join(_ON)}); background"
    )


def _profile(raw: str) -> tuple[str | None, str]:
    """``AOSTORE_VLLM_PROFILE`` normalised: (profile or ``None``, what to say about it)."""
    value = raw.strip().lower().replace("_", "-")
    if not value:
        return None, ""
    if value in PROFILES:
        return value, f"{ENV_PROFILE}={raw.strip()}"
    return None, f"ignored {ENV_PROFILE}={raw!r} (not one of {', '.join(PROFILES)}); probed"


def _mooncake(raw: str) -> tuple[MooncakeTier | None, str]:
    """``AOSTORE_VLLM_MOONCAKE`` read and validated: (the tier or ``None``, what to say).

    The file is read with ``MooncakeConfig.from_file`` and the ``mooncake`` package must be
    installed (found, not imported); nothing connects here: an unreachable master is found
    when the first store is built (``MooncakeError`` naming the setting).
    """
    return _config_file(ENV_MOONCAKE, raw, "Mooncake tier off")


def _config_file(name: str, raw: str, off: str) -> tuple[MooncakeTier | None, str]:
    """A Mooncake config file's variable read and validated: (it or ``None``, what to say)."""
    value = raw.strip()
    if not value:
        return None, ""
    path = os.path.abspath(os.path.expanduser(value))

    def ignored(why: str) -> tuple[None, str]:
        return None, f"ignored {name}={raw!r} ({why}); {off}"

    try:
        installed = importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return ignored(f"Mooncake is not installed: pip install '{MOONCAKE_PIP_PACKAGE}'")
    try:
        config = MooncakeConfig.from_file(path)
    except Exception as error:
        detail = str(error) if path in str(error) else f"{path}: {error}"
        return ignored(f"{type(error).__name__}: {detail}")
    return MooncakeTier(path, config), ""
