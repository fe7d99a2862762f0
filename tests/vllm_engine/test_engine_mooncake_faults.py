"""A real vLLM engine with aostore's Mooncake tier on while the master is stalled, killed and
restarted in the middle of its generation.

A Mooncake master and a segment holder start on 127.0.0.1 (``tests/support/mooncake_util.py``).
``engine_run.py`` runs the engine with ``AOSTORE_VLLM_MOONCAKE`` naming a config for that
master, the multi-turn workload of ``test_engine_mooncake.py`` over four rounds, and stops at
four milestones (after fixed engine steps) until this test has acted on the master, by PID:
SIGSTOP (a stalled master: its port accepts, nothing answers), SIGCONT, SIGKILL, and a restart
on the same ports (empty: a master keeps its data in memory). The engine steps on between
the milestones while the master is stalled or dead; the second round's prefill falls in the
stall and the third round's in the outage, so there are puts to publish during both. Inside
the worker (``engine_probe.py``) the tier's counters are sampled every 20 ms, the store calls
of the engine thread and of the background writer are timed and any exception they raise is
caught, and after the generation the tier is flushed (at most ``SETTLE_TIMEOUT_S``, the wait
for the outage to end included) and its counters, local contents and record of unpublished
keys are taken. After the engine has exited, ``mooncake_reader.py`` reads every key back from
Mooncake with Mooncake's own calls.

A fault-free run of the same workload, plugin on and tier off, is the reference: the tier
never changes what the engine computes (prefix-cache hits read the local tier, which holds
every block here), so the faulted run must give the same token ids and routed experts for
every request, not merely well-formed ones. The test then checks the promises of
docs/mooncake.md ("Faults: the tier never stops inference"): no store call raised or waited
past the read deadline; every key the local tier held is in Mooncake with exactly the
engine's bytes or in the tier's unpublished record, and no key reads back other bytes; and,
the master answering again, what the local tier holds was republished. The figures (the
outage, objects unpublished and republished, times to recover) are printed and, where
``AOSTORE_ENGINE_SUMMARY`` points, written under ``mooncake_faults``.

Runs only under ``make test-engine`` (``AOSTORE_REQUIRE_ENGINE=1``), and skips with the
install command when the engine's environment has no Mooncake.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("AOSTORE_REQUIRE_ENGINE") != "1":
    pytest.skip(
        "real vLLM engine test: runs under `make test-engine` (AOSTORE_REQUIRE_ENGINE=1)",
        allow_module_level=True,
    )
for _module in ("vllm", "aostore", "numpy"):
    if importlib.util.find_spec(_module) is None:
        pytest.fail(f"AOSTORE_REQUIRE_ENGINE=1 but {_module} is not importable here", pytrace=False)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))  # tests/support/mooncake_util.py
import mooncake_util  # noqa: E402

_missing = mooncake_util.missing_reason()
if _missing is not None:
    pytest.skip(
        f"the engine's environment cannot run Mooncake: {_missing}", allow_module_level=True
    )

RUN_TIMEOUT_S = 900
READ_TIMEOUT_S = 120
SETTLE_TIMEOUT_S = 60.0  # for the tier to see the master again and republish; ~10 s here
SLACK_S = 3.0  # a loaded 2-core machine's scheduling, on top of any bound the tier promises
BLOCK_TOKENS = 32  # engine_run.py's block size
# Round 0 plus three multi-turn rounds plus the repeat: about 32 engine steps a round.
WORKLOAD = ("--rounds", "3", "--async-scheduling", "off")
# (after engine step, fault): the stall covers round 1's prefill (step ~33), the outage
# round 2's (step ~65); the restart leaves the rest of round 2 and the repeat to recover in.
FAULTS = ((26, "sigstop"), (44, "sigcont"), (58, "kill"), (74, "restart"))
_summary = os.environ.get("AOSTORE_ENGINE_SUMMARY")
SUMMARY = Path(_summary) if _summary else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    with mooncake_util.cluster(
        tmp_path_factory.mktemp("mooncake-faults"), holder_segment="256MB"
    ) as started:
        yield started


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("engine-mooncake-faults")
    subprocess.run(
        [sys.executable, str(HERE / "tiny_moe.py"), str(work / "tiny-moe")],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return work


def engine_command(work: Path, out: Path, *extra: str) -> list[str]:
    command = [sys.executable, str(HERE / "engine_run.py"), "--model", str(work / "tiny-moe")]
    return [*command, "--out", str(out), *WORKLOAD, *extra]


@pytest.fixture(scope="module")
def reference(work: Path) -> dict[str, Any]:
    """The same workload, plugin on, no tier and no fault."""
    out, log = work / "reference.pkl", work / "reference.log"
    env = dict(os.environ, AOSTORE_VLLM_PLUGIN="1")
    env.pop("AOSTORE_VLLM_MOONCAKE", None)
    with log.open("wb") as sink:
        process = subprocess.run(
            engine_command(work, out),
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_S,
        )
    if process.returncode != 0:
        pytest.fail(f"reference engine_run exited {process.returncode}\n{log.read_text()[-6000:]}")
    result: dict[str, Any] = pickle.loads(out.read_bytes())
    return result


def drive_faults(
    process: subprocess.Popen[bytes], milestones: Path, cluster: mooncake_util.Cluster
) -> dict[str, tuple[int, float, float]]:
    """Acts on the master at each milestone the engine reaches, then lets it go on; returns
    each fault's (engine step, start, end) on ``time.monotonic()``, the worker's clock too.
    Runs on this thread: a master started from a helper thread would get setpriv's pdeathsig
    when that thread ends."""
    actions: dict[str, Callable[[], None]] = {
        "sigstop": cluster.pause_master,
        "sigcont": cluster.resume_master,
        "kill": cluster.kill_master,
        "restart": cluster.restart_master,
    }
    acted: dict[str, tuple[int, float, float]] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for index, (step, name) in enumerate(FAULTS):
        reached = milestones / f"milestone-{index}"
        ack = milestones / f"milestone-{index}.ack"
        while not reached.exists():
            if process.poll() is not None:
                return acted  # the engine ended before this milestone: the caller fails
            if time.monotonic() > deadline:
                pytest.fail(f"the engine did not reach step {step} in {RUN_TIMEOUT_S} s")
            time.sleep(0.002)
        assert json.loads(reached.read_text())["step"] == step
        began = time.monotonic()
        if name == "restart":
            ack.touch()  # the engine steps on while the new master starts (about a second)
            actions[name]()
        else:
            actions[name]()  # a signal, delivered before the engine's next step
            ack.touch()
        acted[name] = (step, began, time.monotonic())
    return acted


@pytest.fixture(scope="module")
def run(cluster: mooncake_util.Cluster, work: Path) -> dict[str, Any]:
    """The faulted engine run, then the reader's run; what both wrote, and the figures."""
    config_path = work / "mooncake.json"
    config_path.write_text(json.dumps(cluster.config()))
    milestones = work / "milestones"
    milestones.mkdir()
    out, log = work / "engine.pkl", work / "engine.log"
    env = dict(os.environ, AOSTORE_VLLM_PLUGIN="1", AOSTORE_VLLM_MOONCAKE=str(config_path))
    command = engine_command(
        work,
        out,
        "--tier",
        "--tier-timeout-s",
        str(SETTLE_TIMEOUT_S),
        "--watch-tier",
        "--milestones",
        ",".join(str(step) for step, _ in FAULTS),
        "--milestone-dir",
        str(milestones),
    )
    started = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            acted = drive_faults(process, milestones, cluster)
            returncode = process.wait(max(1.0, RUN_TIMEOUT_S - (time.monotonic() - started)))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = log.read_text(errors="replace")
    if returncode != 0:
        pytest.fail(f"engine_run exited {returncode}\n{text[-6000:]}")
    assert list(acted) == [name for _, name in FAULTS], f"faults acted: {list(acted)}"
    result: dict[str, Any] = pickle.loads(out.read_bytes())
    tier = result["tier"]
    assert tier is not None and result["tier_watch"] is not None

    # Every key the local tier holds, and every recorded one, read back from Mooncake.
    keys = sorted(set(tier["objects"]) | set(tier["unpublished"]))
    keys_path, read_path = work / "keys.json", work / "read.pkl"
    keys_path.write_text(json.dumps(keys))
    reader = subprocess.run(
        [
            sys.executable,
            str(HERE / "mooncake_reader.py"),
            *(str(config_path), str(keys_path), str(result["classes"]["object_nbytes"])),
            str(read_path),
        ],
        capture_output=True,
        text=True,
        timeout=READ_TIMEOUT_S,
    )
    assert reader.returncode == 0, reader.stderr[-3000:]
    read: dict[str, bytes | None] = pickle.loads(read_path.read_bytes())
    run: dict[str, Any] = {"result": result, "log": text, "acted": acted, "read": read}
    run["figures"] = figures(run)
    report(run["figures"])
    return run


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """What the faults did, from the worker's samples and the fault times (one clock)."""
    result, acted, read = run["result"], run["acted"], run["read"]
    tier, watch = result["tier"], result["tier_watch"]
    stats = tier["stats"]
    fields = watch["fields"]
    samples = [dict(zip(fields, row, strict=True)) for row in watch["samples"]]
    origin: float = acted["sigstop"][1]

    def rel(t: float) -> float:
        return round(t - origin, 2)

    outages: list[tuple[float, float]] = []  # (start, end) as the samples saw them
    for a, b in itertools.pairwise(samples):
        if not a["mooncake_down"] and b["mooncake_down"]:
            outages.append((b["t"], samples[-1]["t"]))
        elif a["mooncake_down"] and not b["mooncake_down"] and outages:
            outages[-1] = (outages[-1][0], b["t"])

    def first_after(t: float, test: Callable[[dict[str, Any]], bool]) -> float | None:
        found = next((s["t"] for s in samples if s["t"] >= t and test(s)), None)
        return None if found is None else round(found - t, 2)

    def at(t: float) -> int | None:
        return next((s["unpublished_objects"] for s in samples if s["t"] >= t), None)

    def most(t0: float, t1: float, field: str = "unpublished_objects") -> int:
        return max((s[field] for s in samples if t0 <= s["t"] <= t1), default=0)

    def queued(t0: float, t1: float) -> int:
        inside = [s["queued_objects"] + s["dropped_objects"] for s in samples if t0 <= s["t"] <= t1]
        return inside[-1] - inside[0] if inside else 0

    def settled(s: dict[str, Any]) -> bool:
        return not s["mooncake_down"] and not s["unpublished_objects"] and not s["pending_batches"]

    restarted = acted["restart"][2]
    calls = watch["calls"]
    in_mooncake = sum(read.get(key) == payload for key, payload in tier["objects"].items())
    step_s = result["step_s"]
    return {
        "requests": len(result["requests"]),
        "steps": len(step_s),
        "objects": len(tier["objects"]),
        "fault_steps": {name: step for name, (step, _, _) in acted.items()},
        "fault_at_s": {name: rel(began) for name, (_, began, _) in acted.items()},
        "stall_s": round(acted["sigcont"][1] - acted["sigstop"][1], 2),
        "master_dead_s": round(restarted - acted["kill"][1], 2),
        "restart_s": round(restarted - acted["restart"][1], 2),
        "outages_seen": [(rel(a), round(b - a, 2)) for a, b in outages],
        "put_in_stall": queued(acted["sigstop"][1], acted["sigcont"][1]),
        "put_while_dead": queued(acted["kill"][1], restarted),
        "pending_max_stall": most(acted["sigstop"][1], acted["sigcont"][1], "pending_batches"),
        "unpublished_at": {name: at(began) for name, (_, began, _) in acted.items()},
        "unpublished_max_stall": most(acted["sigstop"][1], acted["sigcont"][2]),
        "unpublished_max_outage": most(acted["kill"][1], samples[-1]["t"]),
        "sigcont_to_settled_s": first_after(acted["sigcont"][2], settled),
        "restart_to_settled_s": first_after(
            restarted, lambda s: settled(s) and s["master_restarts"] > 0
        ),
        "unpublished_end": stats["unpublished_objects"],
        "in_mooncake_end": in_mooncake,
        "published": stats["published_objects"],
        "republished": stats["republished_objects"],
        "dropped": stats["dropped_objects"],
        "publish_failures": stats["publish_failures"],
        "outages": stats["outages"],
        "master_restarts": stats["master_restarts"],
        "flush_s": round(tier["flush_s"], 2),
        "worst_engine_put_s": round(calls.get("engine.put", {}).get("worst_s", 0.0), 4),
        "worst_engine_read_s": round(
            max(
                (v["worst_s"] for k, v in calls.items() if k.startswith("engine.get")),
                default=0.0,
            ),
            4,
        ),
        "worst_writer_put_s": round(calls.get("writer.put", {}).get("worst_s", 0.0), 4),
        "worst_step_s": round(max(step_s), 3),
        "worst_milestone_wait_s": round(max(m["waited_s"] for m in result["milestones"]), 3),
        "median_step_s": round(sorted(step_s)[len(step_s) // 2], 3),
        "tier_warnings": run["log"].count("aostore Mooncake tier:"),
    }


def report(row: dict[str, Any]) -> None:
    print("\n[engine mooncake faults] " + ", ".join(f"{k}={v}" for k, v in row.items()))
    if SUMMARY is not None:
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
        existing["mooncake_faults"] = row
        SUMMARY.write_text(json.dumps(existing, indent=1, sort_keys=True))


def test_faults_landed_mid_generation_on_the_tier(run: dict[str, Any]) -> None:
    result, row = run["result"], run["figures"]
    assert result["classes"]["store"] == "aostore.mooncake.TieredBlockObjectStore"
    assert [m["step"] for m in result["milestones"]] == [step for step, _ in FAULTS]
    assert len(result["step_s"]) > FAULTS[-1][0], "the engine ended at the restart"
    # The engine put blocks for the tier to publish while the master was stalled and dead.
    assert row["put_in_stall"] > 0, row
    assert row["put_while_dead"] > 0, row


def test_engine_outputs_are_the_fault_free_runs(
    run: dict[str, Any], reference: dict[str, Any]
) -> None:
    import numpy as np

    faulted = {r["id"]: r for r in run["result"]["requests"]}
    clean = {r["id"]: r for r in reference["requests"]}
    assert sorted(faulted) == sorted(clean), "the faulted run did not finish every request"
    for request_id, expected in clean.items():
        got = faulted[request_id]
        assert got["tokens"] == expected["tokens"], request_id
        assert isinstance(got["routed_experts"], np.ndarray), request_id
        assert got["routed_experts"].dtype == expected["routed_experts"].dtype, request_id
        np.testing.assert_array_equal(got["routed_experts"], expected["routed_experts"])
        assert got["num_cached_tokens"] == expected["num_cached_tokens"], request_id


def test_no_store_call_raised_or_waited_past_the_deadline(run: dict[str, Any]) -> None:
    tier, watch = run["result"]["tier"], run["result"]["tier_watch"]
    calls = watch["calls"]
    assert calls["engine.put"]["count"] > 0 and calls["writer.put"]["count"] > 0, calls
    raised = {name: call["errors"] for name, call in calls.items() if call["errors"]}
    assert not raised, f"store calls raised: {raised}"
    assert tier["writer_error"] is None
    assert not watch["sample_errors"], watch["sample_errors"][:3]
    deadline = tier["read_deadline_s"] + SLACK_S
    for name, call in calls.items():
        # A put never waits for Mooncake; a read waits at most the read deadline.
        bound = deadline if ".get" in name else SLACK_S
        assert call["worst_s"] < bound, f"{name} took {call['worst_s']:.3f} s"
    assert tier["stats"]["read_misses"] == 0


def test_the_tier_saw_the_outage_and_the_restart(run: dict[str, Any]) -> None:
    tier = run["result"]["tier"]
    stats = tier["stats"]
    assert stats["outages"] >= 1, stats
    assert stats["publish_failures"] >= 1, stats
    assert stats["master_restarts"] >= 1, stats
    # The master answers again: the tier's outage ended and its flush finished.
    assert stats["mooncake_down"] == 0, stats
    assert tier["flushed"], f"flush did not finish in {SETTLE_TIMEOUT_S} s"
    assert stats["pending_batches"] == 0


def test_every_key_is_in_mooncake_with_the_engines_bytes_or_recorded(
    run: dict[str, Any],
) -> None:
    tier, read = run["result"]["tier"], run["read"]
    assert tier["objects"], "the engine stored nothing"
    assert tier["stats"]["unpublished_not_recorded"] == 0
    record = set(tier["unpublished"])
    for key, payload in tier["objects"].items():
        got = read.get(key)
        if got is None:
            assert key in record, f"{key} is neither in Mooncake nor recorded as unpublished"
        else:
            # Recorded keys too: nothing is evicted here, so the engine wrote each key once
            # and Mooncake can hold no other bytes under it.
            assert got == payload, f"Mooncake holds other bytes under {key}"


def test_what_the_local_tier_holds_was_republished(run: dict[str, Any]) -> None:
    """The master answering again and the flush finished, no recorded key is one the local
    tier holds (it holds every block here), so Mooncake has every one of them."""
    tier, read = run["result"]["tier"], run["read"]
    assert tier["flushed"] and tier["stats"]["mooncake_down"] == 0
    held = sorted(set(tier["unpublished"]) & set(tier["objects"]))
    assert not held, f"{len(held)} keys held locally stay unpublished, e.g. {held[:3]}"
    missing = sorted(key for key in tier["objects"] if read.get(key) is None)
    assert not missing, f"{len(missing)} keys not in Mooncake, e.g. {missing[:3]}"


def test_published_objects_are_the_routed_experts_the_engine_returned(
    run: dict[str, Any],
) -> None:
    blocks = set()
    for request in run["result"]["requests"]:
        rows = request["routed_experts"]
        for start in range(0, len(rows) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            blocks.add(rows[start : start + BLOCK_TOKENS].tobytes())
    for key, payload in run["read"].items():
        assert payload is None or payload in blocks, key
