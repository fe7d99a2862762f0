"""The store's targets' table (docs/performance.md) from several full runs of
``benches/bench.py``: the middle run's figures, each measure's range over the runs, and in how
many runs its target was met.

    python benches/bench.py --out target/bench-runs/run1   # ... run2, run3, one after another
    python benches/runs_table.py target/bench-runs/run1 target/bench-runs/run2 \
        target/bench-runs/run3
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

# The number a figure's text starts with ("9.4x", "0.81 (0.79-0.85)", "2.06 ms (p99.9 0.36)").
_LEADING_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def leading_number(text: str) -> float | None:
    match = _LEADING_NUMBER.match(text.strip())
    return float(match.group()) if match else None


def load(folder: str) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = json.loads((Path(folder) / "results.json").read_text())[
        "targets"
    ]
    return targets


def table(runs: list[list[dict[str, Any]]]) -> str:
    """One row per measure of the runs, in the order of the middle run."""
    middle = runs[len(runs) // 2]
    by_measure = [{row["measure"]: row for row in run} for run in runs]
    lines = [
        f"| id | measure | aostore (run {len(runs) // 2 + 1}) | aostore, {len(runs)} runs | "
        f"target | met in | vLLM 0.33.0 (run {len(runs) // 2 + 1}) | replica "
        f"(run {len(runs) // 2 + 1}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in middle:
        same = [run[row["measure"]] for run in by_measure if row["measure"] in run]
        numbers = [n for n in (leading_number(r["aostore"]) for r in same) if n is not None]
        spread = f"{min(numbers):g}-{max(numbers):g}" if numbers else "-"
        judged = [r["met"] for r in same if r["met"] is not None]
        met = f"{sum(judged)}/{len(judged)}" if judged else "-"
        lines.append(
            f"| {row['id']} | {row['measure']} | {row['aostore']} | {spread} | {row['target']} "
            f"| {met} | {row['vllm']} | {row['replica']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("runs", nargs="+", help="folders written by bench.py --out, in run order")
    args = parser.parse_args(argv)
    print(table([load(folder) for folder in args.runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
