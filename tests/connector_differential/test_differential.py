"""vLLM's worker connector with vLLM's store and with aostore's, step by step, over seeded
random schedules (schedule.py), compared by harness.py.

``AOSTORE_CD_SCHEDULES`` sets how many schedules run (default 1,000, seeds from
``AOSTORE_CD_SEED``, default 0); ``AOSTORE_CD_SEEDS=7,41`` replays those seeds only;
``AOSTORE_CD_CONTENDERS`` names the contenders (default: all of ``contenders.CONTENDERS``, the
first is the reference). A failure names each failing seed and how to replay it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.aux_output_connector.worker")
    pytest.importorskip("aostore.vllm_plugin")
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata

from . import contenders, harness, schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KV_EVENTS = "retained_block_hashes" in {
    f.name for f in dataclasses.fields(AuxOutputConnectorMetadata)
}
"""Whether this vLLM's metadata carries KV-cached retains and releases (0.33.0's does)."""
PENDING_READS = contenders.layout().reads_pending_blocks
"""Whether this vLLM reads unkeyed full blocks back (0.34.0), from its release record."""
CAPS_PROMPT_START = contenders.layout().caps_prompt_start
"""Whether this vLLM's scheduler caps a prompt start at the prompt (0.32.0 on)."""

CHUNK = 100


def _seeds() -> list[int]:
    listed = os.environ.get("AOSTORE_CD_SEEDS", "").strip()
    if listed:
        return [int(seed) for seed in listed.split(",")]
    first = int(os.environ.get("AOSTORE_CD_SEED", "0"))
    return list(range(first, first + int(os.environ.get("AOSTORE_CD_SCHEDULES", "1000"))))


def _factories() -> list[contenders.Factory]:
    names = os.environ.get("AOSTORE_CD_CONTENDERS", "")
    chosen = [name.strip() for name in names.split(",") if name.strip()] or list(
        contenders.CONTENDERS
    )
    return [contenders.CONTENDERS[name] for name in chosen]


SEEDS = _seeds()
CHUNKS = [SEEDS[i : i + CHUNK] for i in range(0, len(SEEDS), CHUNK)]
TOTALS: Counter[str] = Counter()


@pytest.fixture(autouse=True, scope="module")
def quiet_growth() -> Iterator[None]:
    """Both stores log a warning each time they grow; hundreds of schedules make them grow."""
    loggers = [logging.getLogger(name) for name in ("vllm", "aostore")]
    levels = [one.level for one in loggers]
    for one in loggers:
        one.setLevel(logging.ERROR)
    yield
    for one, level in zip(loggers, levels, strict=True):
        one.setLevel(level)


def _run(seeds: list[int], factories: list[contenders.Factory]) -> list[harness.Outcome]:
    outcomes = []
    for seed in seeds:
        plan = schedule.generate(seed, KV_EVENTS, PENDING_READS, CAPS_PROMPT_START)
        outcome = harness.run_schedule(plan, factories)
        TOTALS["schedules"] += 1
        TOTALS["operations"] += outcome.ops
        TOTALS["outputs compared"] += outcome.outputs
        TOTALS.update(plan.features)
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
    lines.append(f"replay: AOSTORE_CD_SEEDS={seeds} python tests/connector_differential/run.py")
    return "\n".join(lines)


@pytest.mark.parametrize("seeds", CHUNKS, ids=[f"seeds{c[0]}-{c[-1]}" for c in CHUNKS])
def test_contenders_agree(seeds: list[int]) -> None:
    outcomes = _run(seeds, _factories())
    assert not any(outcome.differences for outcome in outcomes), _report(outcomes)


def test_coverage(capsys: pytest.CaptureFixture[str]) -> None:
    """The schedules that ran reached every path they are meant to (printed as a table)."""
    if TOTALS["schedules"] < 200:
        pytest.skip("fewer than 200 schedules ran (a replay)")
    with capsys.disabled():
        print(f"\nconnector differential, vLLM {_vllm_version()}:")
        for name, count in sorted(TOTALS.items()):
            print(f"  {count:8d}  {name}")
    wanted = [
        "chunked prefill",
        "speculative rejection",
        "reattach",
        "hashes after their rows",
        "prefix hit",
        "finish in flight",
        "generation reset",
        "prompt start past 0",
        "max_concurrent_batches 1",
        "max_concurrent_batches 2",
    ]
    if KV_EVENTS:
        wanted += ["KV-cached retain", "KV-cached release"]
    if PENDING_READS:
        wanted += ["prompt hashes after a prefix hit's rows"]
    if not CAPS_PROMPT_START:
        wanted += ["prompt start past the prompt, uncapped"]
    assert all(TOTALS[name] > 0 for name in wanted), {name: TOTALS[name] for name in wanted}
    rejected = [name for name in TOTALS if name.startswith("rejected input")]
    raised = [name for name in rejected if not name.endswith("raised nothing")]
    assert len(raised) >= 10, rejected


def test_the_records_layout_says_how_this_vllm_builds_storage() -> None:
    """The plugin picks the two-phase connector from the record's layout, never by probing
    vLLM's class; here the class is probed, to hold the record to it."""
    assert contenders.layout().builds_storage_in_two_phases == contenders.two_phase()


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


# -- The harness catches differences --------------------------------------------------------


def _drops_one_release(params: contenders.Params) -> contenders.Built:
    """vLLM's contender whose writer drops the first release it is given."""
    built = contenders.vllm_contender(params)
    background = built.connector._store
    put = background.put
    dropped = [False]

    def lossy(objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        releases = list(release_keys)
        if releases and not dropped[0]:
            dropped[0] = True
            releases = releases[1:]
        put(objects, retain_keys=retain_keys, release_keys=releases)

    background.put = lossy
    built.name = "drops-one-release"
    return built


def _shifts_token_start(params: contenders.Params) -> contenders.Built:
    """vLLM's contender whose outputs start one token late."""
    built = contenders.vllm_contender(params)
    connector = built.connector
    process = connector.process_output

    def shifted(pending: Any) -> Any:
        outputs = process(pending)
        for output in outputs.values():
            output.token_start += 1
        return outputs

    connector.process_output = shifted
    built.name = "shifts-token-start"
    return built


def _aliases_rows(params: contenders.Params) -> contenders.Built:
    """vLLM's contender whose outputs are overwritten by the next step (a reused buffer)."""
    built = contenders.vllm_contender(params)
    connector = built.connector
    process = connector.process_output
    previous: list[Any] = []

    def reused(pending: Any) -> Any:
        outputs = process(pending)
        for rows in previous:
            rows[...] = rows + 1 if rows.size else rows
        previous[:] = [output.rows for output in outputs.values() if output.rows.flags.writeable]
        return outputs

    connector.process_output = reused
    built.name = "aliases-rows"
    return built


def _reads_the_tail_only(params: contenders.Params) -> contenders.Built:
    """The data plane with the read of the release before (the tail only) on a vLLM that reads
    unkeyed full blocks back (0.34.0): the schedules must reach those reads."""
    from aostore._native import NativeDataPlane

    built = contenders.dataplane_contender(params)
    connector = built.connector
    buffer, config = connector._buffer, contenders._configs(params)[0]
    connector._aostore_plane.close()
    connector._aostore_plane = NativeDataPlane(
        connector._store._writer,
        layout="0.33",
        block_size=buffer.block_size,
        shape_per_token=tuple(buffer.shape_per_token),
        dtype=buffer.dtype,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        max_concurrent_batches=config.max_concurrent_batches,
        output_class=contenders.worker_module().AuxRequestOutput,
    )
    built.name = "reads-the-tail-only"
    return built


BROKEN = [_drops_one_release, _shifts_token_start, _aliases_rows]
if PENDING_READS:
    BROKEN.append(_reads_the_tail_only)


@pytest.mark.parametrize("broken", BROKEN)
def test_harness_reports_a_broken_contender(broken: contenders.Factory) -> None:
    """Each deliberately broken contender is reported within 30 schedules (so the harness
    compares what it says it compares)."""
    outcomes = _run(list(range(30)), [contenders.vllm_contender, broken])
    differences = [d for outcome in outcomes for d in outcome.differences]
    assert differences, f"{broken.__name__}: no difference reported"
    assert all(broken.__name__.strip("_").replace("_", "-") in d.contender for d in differences)


def test_same_contender_twice_agrees() -> None:
    """vLLM against itself: the harness itself is deterministic (no false differences)."""
    outcomes = _run(list(range(1_000_000, 1_000_030)), [contenders.vllm_contender] * 2)
    assert not any(outcome.differences for outcome in outcomes), _report(outcomes)
