"""``aostore vllm-check``: the plugin's dry run, on the throwaway trees of test_plugin.py and on a
real vLLM.

The trees are imported in this process (the dry run must swap nothing, which these tests check);
the command itself runs in subprocesses. The real-vLLM cases skip when ``vllm`` is not
installed; ``make test-vllm`` runs this file in its vLLM 0.33.0 environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest

aostore = pytest.importorskip("aostore")
from aostore import __main__ as cli  # noqa: E402
from aostore import vllm_plugin  # noqa: E402
from aostore.vllm import report as vllm_report  # noqa: E402
from aostore.vllm import settings as vllm_settings  # noqa: E402
from vllm_trees import (  # noqa: E402
    STORE,
    TreeMaker,
    make_tree,
    tree_sources,
)

__all__ = ["make_tree"]  # the fixture, used by name

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# vLLM 0.33's layout with a fixed store whose constructor takes positional arguments: the
# class-by-class check keeps vLLM's store, and with it everything that depends on it.
KEPT = {"store_params": "max_bytes, object_nbytes"}


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = cli.main(["vllm-check", *argv])
    return status, capsys.readouterr().out


def _untouched(module: Any, originals: dict[str, Any]) -> None:
    for name, value in originals.items():
        assert vars(module)[name] is value, name
    assert not hasattr(module, "__aostore_originals__")


@pytest.mark.parametrize(
    ("kind", "profile", "store"),
    [("grow", "grow", "GrowBlockObjectStore"), ("fail-closed", "fail-closed", "Engine")],
)
def test_release_swaps_everything_and_says_how(
    make_tree: TreeMaker, capsys: pytest.CaptureFixture[str], kind: str, profile: str, store: str
) -> None:
    tree = make_tree(kind, known=True)
    status, out = _check(capsys)
    assert status == 0, out
    assert f"is fake vLLM ({kind})'s, which CI proves" in out
    for name in ("BlockObject", "BlockObjectStoreError", "BackgroundBlockObjectStore"):
        assert f"replace:     {name} -> aostore." in out
    assert f"replace:     BlockObjectStore -> aostore.vllm_plugin.{store}" in out
    assert f"profile:     {profile} (vLLM's store " in out
    assert "prefault:    background" in out
    assert "keep:" not in out
    # A fake release has a store record and no data-plane record: the verdict says so.
    assert "data plane:  data plane off (no record for fake vLLM" in out
    assert out.rstrip().endswith("result: aostore would be used, data plane off (exit status 0)")
    _untouched(tree.modules[STORE], tree.originals)


def test_tree_that_keeps_vllms_classes_exits_1_and_says_why(
    make_tree: TreeMaker, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = make_tree("grow", **KEPT)
    status, out = _check(capsys)
    assert status == 1, out
    assert "is not a release CI proves: checked class by class" in out
    assert "keep:        vLLM's BlockObjectStore: BlockObjectStore(): parameter max_bytes" in out
    assert "keep:        vLLM's BackgroundBlockObjectStore: it would wrap vLLM's" in out
    assert "replace:" not in out and "profile:" not in out
    assert "result: aostore would not be used: every vLLM class would be kept" in out
    _untouched(tree.modules[STORE], tree.originals)


def test_dry_run_is_what_register_does(make_tree: TreeMaker) -> None:
    """The dry run and the plugin take the same decision (they share ``_decide``)."""
    for kind, options in (("grow", {}), ("variable", {}), ("fail-closed", KEPT)):
        tree = make_tree(kind, **options)
        store_module = tree.modules[STORE]
        result = vllm_plugin.dry_run()
        assert result.decision is not None
        planned = dict(result.decision.replace)
        assert set(planned) | set(result.decision.keep) == set(result.decision.vllm)
        vllm_plugin.register()
        swapped = {
            name for name, value in tree.originals.items() if vars(store_module)[name] is not value
        }
        assert swapped == set(planned), kind
        for name, cls in planned.items():
            assert vars(store_module)[name] is cls
        # Once the plugin ran, the dry run reports what it replaced.
        again = vllm_plugin.dry_run()
        assert again.registered is not None
        assert set(again.registered) == set(planned)
        assert again.replaced == list(planned)
        for name in list(sys.modules):
            if name == "vllm" or name.startswith("vllm."):
                del sys.modules[name]


def test_plugin_off_exits_1(
    make_tree: TreeMaker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tree("grow", known=True)
    monkeypatch.setenv(vllm_settings.ENV_DISABLE, "off")
    status, out = _check(capsys)
    assert status == 1
    assert "plugin:      off (AOSTORE_VLLM_PLUGIN='off')" in out
    assert "the plugin is off (AOSTORE_VLLM_PLUGIN)" in out


@pytest.mark.parametrize(("value", "status"), [("other", 1), ("other,aostore", 0), ("", 1)])
def test_vllms_allowlist_decides_whether_vllm_loads_it(
    make_tree: TreeMaker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    status: int,
) -> None:
    make_tree("grow", known=True)
    monkeypatch.setenv("VLLM_PLUGINS", value)
    got, out = _check(capsys)
    assert got == status, out
    if status:
        assert "VLLM_PLUGINS leaves the plugin out" in out


def test_missing_entry_point_exits_1(
    make_tree: TreeMaker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tree("grow", known=True)
    monkeypatch.setattr(vllm_report.importlib.metadata, "entry_points", lambda group: [])
    status, out = _check(capsys)
    assert status == 1
    assert "the aostore wheel is not installed in this environment" in out
    assert "replace:     BlockObjectStore" in out  # what it would do if vLLM loaded it


def test_vllm_without_the_store_module_exits_1(
    make_tree: TreeMaker, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tree("grow")
    sys.modules[STORE] = None  # type: ignore[assignment]  # make_tree removes it afterwards
    status, out = _check(capsys)
    assert status == 1
    assert f"{STORE} cannot be imported (ModuleNotFoundError" in out


@pytest.mark.parametrize(
    ("value", "said"),
    [("1", "1: the arena is committed before"), ("0", "0: the arena's pages are committed on")],
)
def test_profile_and_prefault_settings_are_reported(
    make_tree: TreeMaker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    said: str,
) -> None:
    make_tree("grow", known=True)
    monkeypatch.setenv(vllm_settings.ENV_PREFAULT, value)
    monkeypatch.setenv(vllm_settings.ENV_PROFILE, "Fail_Closed")
    status, out = _check(capsys)
    assert status == 0
    assert "replace:     BlockObjectStore -> aostore.vllm_plugin.EngineBlockObjectStore" in out
    assert "profile:     fail-closed (AOSTORE_VLLM_PROFILE=Fail_Closed)" in out
    assert f"prefault:    {said}" in out and f"(AOSTORE_VLLM_PREFAULT='{value}')" in out


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"AOSTORE_VLLM_R3_BUDGET": "abc"}, "AOSTORE_VLLM_R3_BUDGET='abc' is not a size"),
        ({"AOSTORE_VLLM_R3_DELIVERY": "refrence"}, "'refrence' is not rows or reference"),
        ({"AOSTORE_VLLM_R3_TTL": "-5"}, "AOSTORE_VLLM_R3_TTL='-5' is not a positive"),
        ({}, "R3 by reference refused (AOSTORE_VLLM_R3_DELIVERY=reference): it needs the"),
    ],
)
def test_r3_settings_are_reported_with_why_they_were_refused(
    make_tree: TreeMaker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    settings: dict[str, str],
    said: str,
) -> None:
    """Issue 47: ``aostore vllm-check`` said nothing about R3 by reference, in text or JSON."""
    make_tree("grow", known=True)
    monkeypatch.setenv("AOSTORE_VLLM_R3_DELIVERY", "reference")
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    _, out = _check(capsys)
    assert "  R3:          " in out and said in out, out
    _, out = _check(capsys, "--json")
    report = json.loads(out)
    assert said in report["r3"] and report["r3_delivery"] is None
    # The delivery asked for is in the ignored settings, with why, as the engine warns of it.
    row = report["settings"]["AOSTORE_VLLM_R3_DELIVERY"]
    assert row["effective"] == "off (rows in the answer)" and said in row["ignored"], row
    assert said in report["ignored"]["AOSTORE_VLLM_R3_DELIVERY"]


BAD_SETTINGS = {
    "AOSTORE_VLLM_PLUGIN": ("maybe", "on", "not one of 0/false/no/off or 1/true/yes/on"),
    "AOSTORE_VLLM_DATA_PLANE": ("nah", "on where vLLM is recognized", "not one of 0/false"),
    "AOSTORE_VLLM_TRANSPORT": ("2", "on where vLLM is recognized", "not one of 0/false"),
    "AOSTORE_VLLM_PREFAULT": ("eager", "background", "not background, 0/false/no/off or 1/true"),
    "AOSTORE_VLLM_PROFILE": ("elastic", "probed (vLLM's store decides)", "not one of"),
    "AOSTORE_VLLM_MOONCAKE": ("/nonexistent/mooncake.json", "off", "Mooncake tier off"),
    "AOSTORE_VLLM_R3_BUDGET": ("abc", "1073741824 bytes (unused", "is not a size of at least"),
    "AOSTORE_VLLM_R3_TTL": ("inf", "600 s (unused", "not a positive, finite number"),
    "AOSTORE_VLLM_R3_DELIVERY": ("refrence", "off (rows in the answer)", "not rows or reference"),
    "AOSTORE_VLLM_R3_MOONCAKE": ("/nonexistent/r3.json", "off (references are read on", "R3 off"),
}


def test_every_setting_is_listed_with_its_effective_value(
    make_tree: TreeMaker, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 47: every variable the plugin reads, in text and JSON, set or not."""
    make_tree("grow", known=True)
    _, out = _check(capsys, "--json")
    report = json.loads(out)
    assert list(report["settings"]) == list(vllm_settings.VARIABLES)
    assert report["ignored"] == {}
    for name, said in report["settings"].items():
        assert said["set"] is None and said["ignored"] is None and said["effective"], name
    _, out = _check(capsys)
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    AOSTORE_")]
    assert listed == list(vllm_settings.VARIABLES)
    assert "WARNING" not in out and "setting(s) ignored" not in out


@pytest.mark.parametrize("name", list(BAD_SETTINGS))
def test_an_ignored_setting_is_named_with_why_and_what_is_in_force(
    make_tree: TreeMaker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    """A value that is neither on nor off (and the like) was taken silently as on; now each
    is said, with the value in force."""
    value, effective, why = BAD_SETTINGS[name]
    make_tree("grow", known=True)
    monkeypatch.setenv(name, value)
    _, out = _check(capsys, "--json")
    report = json.loads(out)
    said = report["settings"][name]
    assert said["set"] == value and said["effective"].startswith(effective), said
    assert why in said["ignored"] and list(report["ignored"]) == [name], report["ignored"]
    _, out = _check(capsys)
    (line,) = [line for line in out.splitlines() if line.startswith(f"    {name} ")]
    assert f"(set to {value!r}): WARNING " in line and why in line, line
    assert "  warning:     1 setting(s) ignored" in out


def test_json_report(make_tree: TreeMaker, capsys: pytest.CaptureFixture[str]) -> None:
    make_tree("fail-closed", known=True)
    status, out = _check(capsys, "--json")
    assert status == 0
    report = json.loads(out)
    assert report["use"] is True
    assert report["release"] == "fake vLLM (fail-closed)"
    assert report["profile"] == "fail-closed"
    assert report["replace"]["BlockObjectStore"] == "aostore.vllm_plugin.EngineBlockObjectStore"
    assert report["keep"] == {}


def _subprocess_env(extra_path: str = "", **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AOSTORE_", "VLLM_PLUGINS"))}
    paths = [p for p in (extra_path, env.get("PYTHONPATH", "")) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(settings)
    return env


def _command(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aostore", "vllm-check", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT / "tests",
        check=False,
    )


def test_command_on_a_tree_that_keeps_vllms_classes(tmp_path: Path) -> None:
    for name, text in tree_sources("grow", **KEPT).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    done = _command(env=_subprocess_env(str(tmp_path)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"at {tmp_path / 'vllm'}" in done.stdout
    assert "keep:        vLLM's BlockObjectStore:" in done.stdout
    assert "result: aostore would not be used" in done.stdout


def test_console_script_is_the_same_command(capsys: pytest.CaptureFixture[str]) -> None:
    # ``aostore`` is ``aostore.__main__:main``, which ``python -m aostore`` runs too.
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"aostore": "aostore.__main__:main"}
    # The other subcommand still works beside it.
    assert cli.main(["churn", "--slots", "64", "--batches", "1"]) == 0
    assert "aostore: 64 slots x 5,888 B, 1 batches" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make test-vllm runs this)")
def test_real_vllm_would_be_swapped_and_is_not_touched() -> None:
    script = textwrap.dedent(
        """
        import importlib, json
        from aostore.vllm import report as vllm_report
        report = vllm_report.check()
        store = importlib.import_module("vllm.distributed.aux_output_connector.store")
        report["untouched"] = (
            not hasattr(store, "__aostore_originals__")
            and store.BlockObjectStore.__module__ == store.__name__
        )
        print(json.dumps(report))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=_subprocess_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["untouched"]
    assert report["use"], report
    assert set(report["replace"]) == {
        "BlockObject",
        "BlockObjectStoreError",
        "BackgroundBlockObjectStore",
        "BlockObjectStore",
    }
    assert report["keep"] == {}
    if report["vllm"].split("+")[0] in ("0.31.0", "0.32.0", "0.33.0", "0.34.0"):
        # A release CI proves: the data plane goes in on both sides, and the JSON says so.
        assert report["data_plane_on"] == ["worker plane", "scheduler side"], report
    if report["vllm"].startswith("0.33.0"):
        assert report["release"] == "vLLM 0.33.0"
        assert report["profile"] == "grow"
        assert report["replace"]["BlockObjectStore"] == "aostore.vllm_plugin.GrowBlockObjectStore"


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make test-vllm runs this)")
def test_real_vllm_command_exit_status() -> None:
    done = _command(env=_subprocess_env())
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    verdict = "result: aostore would be used, data plane on for the worker plane and the "
    assert f"{verdict}scheduler side (exit status 0)" in done.stdout
    # What importing vLLM and torch writes (deprecation lines) is held back, not shown first.
    assert "deprecated" not in done.stderr, done.stderr[-2000:]
    off = _command(env=_subprocess_env(AOSTORE_VLLM_PLUGIN="0"))
    assert off.returncode == 1, off.stdout + off.stderr[-4000:]
    assert "the plugin is off" in off.stdout
