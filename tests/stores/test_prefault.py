"""prefault=: when the arena's pages are committed (False: on first write; True: at
construction; "background": by a thread, without making the constructor wait)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from aostore import BlockObject, BlockObjectStore

SCRIPT = """
import os, sys, time
from aostore import BlockObject, BlockObjectStore

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

ARENA = 256 << 20
mode = {"False": False, "True": True, "background": "background"}[sys.argv[1]]
before = rss()
t0 = time.perf_counter()
store = BlockObjectStore(max_bytes=ARENA, object_nbytes=1 << 20, prefault=mode)
built = time.perf_counter() - t0
store.put([BlockObject("k", bytes([7]) * (1 << 20))])
deadline = time.monotonic() + 20
while rss() - before < 0.9 * ARENA and time.monotonic() < deadline and mode:
    time.sleep(0.01)
committed = (rss() - before) / ARENA
assert store.get_concatenated(["k"]) == bytes([7]) * (1 << 20)
store.check()
print(f"{committed:.2f} {built:.4f}")
"""


def committed_fraction(mode: str) -> tuple[float, float]:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    fraction, built = result.stdout.split()
    return float(fraction), float(built)


def test_pages_are_committed_on_first_write_by_default():
    fraction, _ = committed_fraction("False")
    assert fraction < 0.2


@pytest.mark.parametrize("mode", ["True", "background"])
def test_prefault_commits_the_whole_arena(mode):
    fraction, _ = committed_fraction(mode)
    assert fraction >= 0.9


def test_a_bad_prefault_value_is_a_clear_error():
    for bad in ("yes", 1, None.__class__):
        with pytest.raises((ValueError, TypeError), match="prefault"):
            BlockObjectStore(max_bytes=64, object_nbytes=8, prefault=bad)


def test_a_background_prefaulted_store_closes_while_populating():
    for _ in range(3):
        store = BlockObjectStore(max_bytes=1 << 30, object_nbytes=1 << 16, prefault="background")
        store.put([BlockObject("k", bytes(1 << 16))])
        store.close()
        assert store.closed
