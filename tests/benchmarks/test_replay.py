"""W3's schedule (``aostore.bench.replay.generate``): the step token budget bounds each step's
prefill as vLLM's scheduler does, and changes when work happens, not what work there is."""

from __future__ import annotations

from collections import Counter

import pytest
from aostore.bench import measure, replay, report
from aostore.bench.replay import BLOCK_TOKENS, RolloutShape, generate

SMALL = {
    "prompts": 16,
    "samples": 4,
    "prompt_tokens": (200, 1200),
    "output_tokens": (64, 256),
    "kv_blocks": 4_000,
    "max_running": 64,
}


def admissions(
    shape: RolloutShape, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[int, int, int, int]]:
    """(step, release step, prompt, prompt tokens) of each admission ``generate`` makes."""
    seen: list[tuple[int, int, int, int]] = []
    original = replay.admit

    def record(request, start, steps, published):  # type: ignore[no-untyped-def]
        release = original(request, start, steps, published)
        seen.append((start, release, request.prompt, request.prompt_len))
        return release

    monkeypatch.setattr(replay, "admit", record)
    generate(shape)
    return seen


def test_a_step_schedules_no_more_tokens_than_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = 2_048
    shape = RolloutShape(**SMALL, max_num_batched_tokens=budget)
    seen = admissions(shape, monkeypatch)
    tokens: Counter[int] = Counter()
    admitted: Counter[int] = Counter()
    for i, (step, _, prompt, prompt_len) in enumerate(seen):
        # A running sample of the prompt (admitted before, not yet released) holds its full
        # blocks: this one computes what is left after them (vLLM keeps at least one token).
        cached = any(p == prompt and r > step for _, r, p, _ in seen[:i])
        full = min(prompt_len // BLOCK_TOKENS * BLOCK_TOKENS, prompt_len - 1)
        tokens[step] += prompt_len - full // BLOCK_TOKENS * BLOCK_TOKENS if cached else prompt_len
        admitted[step] += 1
    for step in tokens:
        decodes = sum(1 for s, r, _, _ in seen if s < step < r)
        assert decodes + tokens[step] <= budget or admitted[step] == 1, step
    # The bound binds: the first requests start over several steps, not all in the first.
    assert 1 < len([s for s in tokens if s < 10])


def test_without_a_budget_every_fitting_request_starts_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shape = RolloutShape(**SMALL, max_num_batched_tokens=0)
    starts = Counter(step for step, _, _, _ in admissions(shape, monkeypatch))
    assert starts[0] == SMALL["max_running"]


@pytest.mark.parametrize("budget", [0, 2_048, 16_384])
def test_the_budget_moves_work_in_time_but_keeps_it(budget: int) -> None:
    steps = generate(RolloutShape(**SMALL, max_num_batched_tokens=budget))
    unbounded = generate(RolloutShape(**SMALL, max_num_batched_tokens=0))

    def totals(steps: list[replay.Step]) -> tuple[Counter[int], Counter[int], Counter[int]]:
        published, retained, released = Counter[int](), Counter[int](), Counter[int]()
        for step in steps:
            published.update(step.publish)
            retained.update(step.retain)
            released.update(step.release)
        return published, retained, released

    published, retained, released = totals(steps)
    assert (published, retained, released) == totals(unbounded)
    assert set(published.values()) == {1}, "every block published once"
    assert retained == released, "every retain released"
    # A block's key is retained before (never after) its data is published.
    retained_at: dict[int, int] = {}
    for i, step in enumerate(steps):
        for key in step.retain:
            retained_at.setdefault(key, i)
        for key in step.publish:
            assert retained_at[key] < i


def test_the_replay_tells_a_put_off_the_cpu_from_the_store_s_work() -> None:
    """``run`` reads each put's CPU time and page faults beside its wall time, so a stall of the
    machine (the thread off its CPU) shows as a put far above its CPU time, and memory committed
    inside a put as its faults. The stall is a sleep inside one put of a real store, the faults
    the first writes to a new mapping in the next: the machine's cannot be made on purpose."""
    import mmap
    import time

    from aostore import BlockObjectStore

    shape = RolloutShape(**SMALL)
    steps = generate(shape)
    rows = measure.pool(shape.object_nbytes)
    stalled = len(steps) // 2

    class Stalling:
        def __init__(self) -> None:
            self.store = BlockObjectStore(
                max_bytes=shape.store_slots * shape.object_nbytes,
                object_nbytes=shape.object_nbytes,
            )
            self.puts = 0

        def put(self, batch: list[object], **references: list[str]) -> None:
            if self.puts == stalled:
                time.sleep(0.02)
            if self.puts == stalled + 1:
                fresh = mmap.mmap(-1, 1 << 22)
                for offset in range(0, len(fresh), mmap.PAGESIZE):
                    fresh[offset] = 1
                fresh.close()
            self.puts += 1
            self.store.put(batch, **references)

        def get_concatenated(self, keys: list[str]) -> bytes:
            return self.store.get_concatenated(keys)

    result = measure.run("stalling", Stalling(), steps, rows, as_bytes=True)
    assert len(result.cpu_ns) == len(result.put_ns) == len(result.faults) == len(steps)
    assert result.faults[stalled + 1] > 0
    assert all(count >= 0 for count in result.faults)
    assert result.put_ns[stalled] >= 20_000_000
    assert result.cpu_ns[stalled] < result.put_ns[stalled] / 2
    assert all(ns >= 0 for ns in result.cpu_ns)


def test_the_replay_table_gives_the_worst_put_on_the_cpu_beside_the_worst_put() -> None:
    """``python -m aostore``'s table: a put stalled 9 ms off the CPU is the worst put (marked as
    a stall), while the row of time on the CPU shows the store's worst work (50 µs here), and
    both ratios read what the stores did."""

    def result(name: str, scale: int) -> measure.ReplayResult:
        return measure.ReplayResult(
            name=name,
            puts=2,
            objects=2,
            writer_seconds=0.009,
            put_ns=[1_000 * scale, 9_000_000 * scale],
            read_seconds=0.0,
            objects_read=0,
            evictions=0,
            label=name,
            cpu_ns=[1_000 * scale, 50_000 * scale],
            faults=[0, 0],
        )

    table = report.replay_table([result("aostore", 1), result("replica", 3)], "")
    worst = next(line for line in table.splitlines() if line.startswith("worst put"))
    on_cpu = next(line for line in table.splitlines() if line.startswith("worst on CPU"))
    assert "9,000.000 us*" in worst and "3.0x" in worst
    assert on_cpu.split()[3:] == ["50.000", "us", "150.000", "us", "3.0x", "-", "not", "judged"]
