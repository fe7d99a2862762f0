"""Shared fixtures: every semantic test runs against aostore and against the model."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# The suites' shared helpers (models, scripts, the Mooncake cluster) live in tests/support/.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
import model

# The differential test pins its own settings (2,000 examples). "ci" is there for a
# longer hunt on demand: `pytest --hypothesis-profile ci`, or CI=1 in the environment.
settings.register_profile("ci", max_examples=2000, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

IMPLEMENTATIONS = ("aostore", "model")


@dataclass(frozen=True)
class Impl:
    """One implementation of the store API, as the tests see it."""

    name: str
    Store: Any
    Error: type[BaseException]
    BlockObject: Any


def load_impl(name: str) -> Impl:
    if name == "model":
        return Impl("model", model.ModelStore, model.BlockObjectStoreError, model.BlockObject)
    import aostore  # imported lazily: the model tests run without the native package

    return Impl(
        "aostore", aostore.BlockObjectStore, aostore.BlockObjectStoreError, aostore.BlockObject
    )


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> Impl:
    return load_impl(request.param)


@pytest.fixture
def make_store(impl: Impl) -> Iterator[Callable[..., Any]]:
    """Factory ``make_store(slots, nbytes=4)``; every store it makes is closed afterwards."""
    made: list[Any] = []

    def factory(slots: int, nbytes: int = 4, **kwargs: Any) -> Any:
        store = impl.Store(max_bytes=slots * nbytes, object_nbytes=nbytes, **kwargs)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


def payload(fill: int, nbytes: int = 4) -> bytes:
    """``nbytes`` copies of one byte: easy to tell apart in a failure message."""
    return bytes([fill % 256]) * nbytes
