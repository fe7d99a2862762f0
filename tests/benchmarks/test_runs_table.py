"""``benches/runs_table.py``: the store's targets' table (docs/performance.md) from several
``bench.py`` runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "runs_table.py"


def write_run(folder: Path, put: str, met: bool, t6: str) -> None:
    folder.mkdir()
    targets = [
        {
            "id": "T2",
            "measure": "W2 put",
            "aostore": put,
            "target": ">= 12",
            "met": met,
            "vllm": f"{put} (vs)",
            "replica": "r",
        },
        {
            "id": "T6",
            "measure": "bytes per key",
            "aostore": t6,
            "target": "<= 100 B",
            "met": False,
            "vllm": "280 B",
            "replica": "269 B",
        },
        {
            "id": "-",
            "measure": "hot get",
            "aostore": "18.9x",
            "target": "-",
            "met": None,
            "vllm": "v",
            "replica": "r",
        },
    ]
    (folder / "results.json").write_text(json.dumps({"targets": targets}))


def test_the_middle_run_with_ranges_and_how_often_each_target_was_met(tmp_path: Path) -> None:
    write_run(tmp_path / "a", "9.4x", False, "168 B")
    write_run(tmp_path / "b", "12.3x", True, "167 B")
    write_run(tmp_path / "c", "11.0x", False, "170 B")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *(str(tmp_path / n) for n in "abc")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0].startswith("| id | measure | aostore (run 2) | aostore, 3 runs |")
    assert out[2] == "| T2 | W2 put | 12.3x | 9.4-12.3 | >= 12 | 1/3 | 12.3x (vs) | r |"
    assert out[3] == "| T6 | bytes per key | 167 B | 167-170 | <= 100 B | 0/3 | 280 B | 269 B |"
    assert out[4] == "| - | hot get | 18.9x | 18.9-18.9 | - | - | v | r |"
