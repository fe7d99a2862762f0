"""Shared helpers of the Mooncake suites: a fake Mooncake client, payloads, the skip when Mooncake
is missing, and a Mooncake client in another process (``mooncake_util.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mooncake_util
import pytest
from aostore import BlockObject

NBYTES = 5888  # one GLM-4.5-Air block of routed-expert ids


SUBPROCESS_TIMEOUT = 60.0  # seconds; only reached when something is broken


TESTS_DIR = Path(__file__).resolve().parent  # the helpers run as scripts from here


def require_mooncake() -> None:
    reason = mooncake_util.missing_reason()
    if reason is None:
        return
    if os.environ.get("AOSTORE_REQUIRE_MOONCAKE"):
        pytest.fail(f"AOSTORE_REQUIRE_MOONCAKE is set but {reason}")
    pytest.skip(reason)


@dataclass
class Obj:
    """An object with ``.key`` and ``.payload`` that checks nothing (for bad input)."""

    key: Any
    payload: Any


def blob(fill: int, nbytes: int = NBYTES) -> bytes:
    return bytes([fill % 256]) * nbytes


def objects(prefix: str, fills: range) -> list[Any]:
    return [BlockObject(f"{prefix}{i}", blob(i)) for i in fills]


class FakeClient:
    """The parts of ``MooncakeDistributedStore`` that aostore calls, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.put_code = 0
        self.exist_code: int | None = None
        self.unread: set[str] = set()  # present, but batch_get_buffer returns None for them
        self.put_calls: list[list[str]] = []
        self.upsert_calls: list[list[str]] = []
        self.get_calls: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def put_batch(self, keys: list[str], values: list[Any]) -> int:
        self.gate.wait(SUBPROCESS_TIMEOUT)
        self.put_calls.append(list(keys))
        if self.put_code:
            return self.put_code
        for key, value in zip(keys, values, strict=True):
            self.data.setdefault(key, bytes(value))
        return 0

    def upsert_batch(self, keys: list[str], values: list[Any]) -> int:
        self.gate.wait(SUBPROCESS_TIMEOUT)
        self.upsert_calls.append(list(keys))
        if self.put_code:
            return self.put_code
        given: set[str] = set()
        for key, value in zip(keys, values, strict=True):
            if key not in given:  # as Mooncake: a key given twice keeps its first value
                given.add(key)
                self.data[key] = bytes(value)
        return 0

    def batch_get_buffer(self, keys: list[str]) -> list[bytes | None]:
        assert len(set(keys)) == len(keys), "a key repeated in one batch_get_buffer call"
        self.get_calls.append(list(keys))
        return [None if key in self.unread else self.data.get(key) for key in keys]

    def get_buffer(self, key: str) -> bytes | None:
        return self.data.get(key)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if self.exist_code is not None:
            return [self.exist_code] * len(keys)
        return [int(key in self.data) for key in keys]

    def health_check(self) -> int:
        return 0

    def remove(self, key: str, force: bool = False) -> int:
        return 0 if self.data.pop(key, None) is not None else -704

    def close(self) -> int:
        return 0


def run_worker(mode: str, config: dict[str, Any], prefix: str, count: int) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            str(TESTS_DIR / "mooncake_util.py"),
            mode,
            json.dumps(config),
            prefix,
            str(count),
            str(NBYTES),
        ],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd=TESTS_DIR,
    )
    assert done.returncode == 0, f"{mode} worker failed:\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
