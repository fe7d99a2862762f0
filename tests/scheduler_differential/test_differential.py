"""vLLM's scheduler-side aux-output connector against other contenders, call by call, over
seeded random schedules (schedule.py), compared by harness.py.

``AOSTORE_SD_SCHEDULES`` sets how many schedules run (default 1,000, seeds from
``AOSTORE_SD_SEED``, default 0); ``AOSTORE_SD_SEEDS=7,41`` replays those seeds only;
``AOSTORE_SD_CONTENDERS`` names the contenders (default: every one of
``contenders.CONTENDERS``, vLLM's class first as the reference, then aostore's native one).
A failure names each failing seed and how to replay it.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.aux_output_connector.connector")
    pytest.importorskip("vllm.v1.request")

from . import contenders, harness, schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KV_EVENTS = contenders.kv_events()
LAYOUT = contenders.release().layout
CAPS_PROMPT_START = LAYOUT != "0.31"
"""vLLM 0.31.0's scheduler sends a prompt start past the prompt as asked; later ones cap it."""
CHUNK = 250


def _seeds() -> list[int]:
    listed = os.environ.get("AOSTORE_SD_SEEDS", "").strip()
    if listed:
        return [int(seed) for seed in listed.split(",")]
    first = int(os.environ.get("AOSTORE_SD_SEED", "0"))
    return list(range(first, first + int(os.environ.get("AOSTORE_SD_SCHEDULES", "1000"))))


def _chosen() -> list[str]:
    names = os.environ.get("AOSTORE_SD_CONTENDERS", "")
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    return chosen or list(contenders.CONTENDERS)


SEEDS = _seeds()
CHUNKS = [SEEDS[i : i + CHUNK] for i in range(0, len(SEEDS), CHUNK)]
TOTALS: Counter[str] = Counter()


def _run(
    seeds: list[int], factories: list[contenders.Factory], names: list[str]
) -> list[harness.Outcome]:
    outcomes = []
    for seed in seeds:
        plan = schedule.generate(seed, KV_EVENTS, CAPS_PROMPT_START)
        outcome = harness.run_schedule(plan, factories, names)
        TOTALS["schedules"] += 1
        TOTALS["operations"] += outcome.ops
        TOTALS["connector calls"] += outcome.calls
        TOTALS.update({f"generated: {k}": v for k, v in plan.features.items()})
        TOTALS.update({f"observed: {k}": v for k, v in outcome.events.items()})
        if plan.bad:
            TOTALS[f"rejected input {plan.bad}: raised {outcome.raised or 'nothing'}"] += 1
        elif outcome.raised:
            TOTALS[f"valid schedule ended by {outcome.raised}"] += 1
        outcomes.append(outcome)
    return outcomes


def _report(outcomes: list[harness.Outcome]) -> str:
    failing = [outcome for outcome in outcomes if outcome.differences]
    lines = [f"{len(failing)} of {len(outcomes)} schedules differ:"]
    for outcome in failing[:20]:
        lines += [f"  {difference}" for difference in outcome.differences[:3]]
    seeds = ",".join(str(outcome.seed) for outcome in failing[:20])
    lines.append(f"replay: AOSTORE_SD_SEEDS={seeds} python3 tests/scheduler_differential/run.py")
    return "\n".join(lines)


@pytest.mark.parametrize("seeds", CHUNKS, ids=[f"seeds{c[0]}-{c[-1]}" for c in CHUNKS])
def test_contenders_agree(seeds: list[int]) -> None:
    names = _chosen()
    factories = [contenders.CONTENDERS[name] for name in names]
    labels = [f"{name}#{i}" for i, name in enumerate(names)]
    outcomes = _run(seeds, factories, labels)
    assert not any(outcome.differences for outcome in outcomes), _report(outcomes)


def test_coverage(capsys: pytest.CaptureFixture[str]) -> None:
    """The schedules that ran reached every path they are meant to (printed as a table)."""
    if TOTALS["schedules"] < 200:
        pytest.skip("fewer than 200 schedules ran (a replay)")
    with capsys.disabled():
        print(f"\nscheduler differential, vLLM {_vllm_version()}:")
        for name, count in sorted(TOTALS.items()):
            print(f"  {count:8d}  {name}")
    wanted = [
        "generated: shared prefix",
        "generated: prompt start past 0",
        "generated: prompt start past the prompt",
        "generated: prefix hit",
        "generated: chunked prefill",
        "generated: speculative rejection",
        "generated: preemption",
        "generated: abort",
        "generated: finish",
        "generated: reset",
        "observed: hash-only update",
        "observed: final hashes with a finish",
        "observed: metadata past generation 0",
        "observed: take_output None",
        "observed: take_output empty rows",
    ]
    if KV_EVENTS:
        wanted += [
            "observed: metadata with retains",
            "observed: metadata with releases",
            "observed: max_cache_hit > 0",
            "observed: cap_external_hit kept",
            "generated: request_loading",
        ]
    assert all(TOTALS[name] > 0 for name in wanted), {name: TOTALS[name] for name in wanted}
    raised = [n for n in TOTALS if n.startswith("rejected input") and "raised nothing" not in n]
    assert len(raised) >= 5, raised


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


# -- The harness catches differences --------------------------------------------------------


def _patched(name: str, method: str, wrap: Any) -> contenders.Factory:
    def factory(setup: contenders.Setup) -> Any:
        connector = contenders.vllm_contender(setup)
        setattr(connector, method, wrap(connector, getattr(connector, method)))
        return connector

    factory.contender_name = name  # type: ignore[attr-defined]
    factory.__name__ = name
    return factory


def _drop_hash_only(connector: Any, original: Any) -> Any:
    def build(scheduler_output: Any, requests: Any) -> Any:
        metadata = original(scheduler_output, requests)
        keep = set(metadata.requests) | set(metadata.finished_requests)
        metadata.block_hashes = {r: h for r, h in metadata.block_hashes.items() if r in keep}
        return metadata

    return build


def _reverse_finishes(connector: Any, original: Any) -> Any:
    def build(scheduler_output: Any, requests: Any) -> Any:
        metadata = original(scheduler_output, requests)
        metadata.finished_requests = tuple(reversed(metadata.finished_requests))
        return metadata

    return build


def _one_row_short(connector: Any, original: Any) -> Any:
    def take(request: Any, output: Any) -> Any:
        rows = original(request, output)
        return rows[:-1] if rows is not None and len(rows) > 1 else rows

    return take


def _stale_generation(connector: Any, original: Any) -> Any:
    def reset() -> None:
        original()
        connector._generation -= 1

    return reset


def _uncapped_hit(connector: Any, original: Any) -> Any:
    def max_cache_hit(request: Any) -> int:
        hit = original(request)
        return hit + 1 if hit and hit == request.num_tokens - 1 else hit

    return max_cache_hit


def _never_retains(connector: Any, original: Any) -> Any:
    def request_finished(request: Any) -> None:
        pool = connector._block_pool
        cached = pool.cached
        pool.cached = set()
        try:
            original(request)
        finally:
            pool.cached = cached

    return request_finished


BROKEN = [
    _patched("drops-hash-only-updates", "build_connector_meta", _drop_hash_only),
    _patched("reverses-finishes", "build_connector_meta", _reverse_finishes),
    _patched("takes-one-row-short", "take_output", _one_row_short),
    _patched("stale-generation", "reset", _stale_generation),
]
if KV_EVENTS:
    BROKEN += [
        _patched("uncapped-max-cache-hit", "max_cache_hit", _uncapped_hit),
        _patched("never-retains", "request_finished", _never_retains),
    ]


def _other_prompt_start_rule() -> contenders.Factory:
    """aostore's native connector with the neighbouring release's prompt-start rule (0.32.0's
    cap on 0.31.0, 0.31.0's none on 0.32.0): the harness must see the layout's one difference."""
    from aostore.vllm.dataplane import scheduler_subclass
    from vllm.distributed.aux_output_connector import connector as module

    other = "0.32" if LAYOUT == "0.31" else "0.31"
    cls = scheduler_subclass(module.AuxOutputSchedulerConnector, module, layout=other)

    def factory(setup: contenders.Setup) -> Any:
        return cls()

    factory.__name__ = f"prompt-start-as-{other}"
    return factory


if LAYOUT in ("0.31", "0.32"):
    BROKEN.append(_other_prompt_start_rule())


@pytest.mark.parametrize("broken", BROKEN, ids=[b.__name__ for b in BROKEN])
def test_harness_reports_a_broken_contender(broken: contenders.Factory) -> None:
    """Each deliberately broken contender is reported within 60 schedules (so the harness
    compares what it says it compares), and only it."""
    names = ["vllm", broken.__name__]
    outcomes = _run(list(range(60)), [contenders.vllm_contender, broken], names)
    differences = [d for outcome in outcomes for d in outcome.differences]
    assert differences, f"{broken.__name__}: no difference reported"
    assert all(broken.__name__ in d.contender for d in differences)


def test_same_contender_twice_agrees() -> None:
    """vLLM against itself, three instances: the harness is deterministic (no false
    differences), on seeds the chunks do not use."""
    factories = [contenders.vllm_contender] * 3
    outcomes = _run(list(range(1_000_000, 1_000_100)), factories, ["a", "b", "c"])
    assert not any(outcome.differences for outcome in outcomes), _report(outcomes)
