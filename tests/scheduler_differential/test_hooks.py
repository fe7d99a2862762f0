"""A helper of vLLM's scheduler connector that is not vLLM's own still runs.

aostore's native ``build_connector_meta`` stands in for vLLM's ``_take_new_hashes`` and
``_pack_hashes`` (0.33.0) or ``_pack_new_hashes`` (0.32.0). The connector's state lives in
vLLM's own dicts, so the check is per call: while any of those is a subclass's, an instance's
or a patch, vLLM's ``build_connector_meta`` runs and calls it. Checked over seeded schedules
against vLLM's connector (no difference), with the hook's calls counted.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.aux_output_connector.connector")
    pytest.importorskip("aostore.vllm_plugin")

from . import contenders, harness, schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KV_EVENTS = contenders.kv_events()
HELPER = "_take_new_hashes" if KV_EVENTS else "_pack_new_hashes"
SEEDS = range(12)


def agree(factory: contenders.Factory) -> None:
    for seed in SEEDS:
        plan = schedule.generate(seed, KV_EVENTS)
        outcome = harness.run_schedule(plan, [contenders.vllm_contender, factory], ["vllm", "x"])
        assert not outcome.differences, outcome.differences[:3]


def test_the_native_method_runs_while_the_helpers_are_vllms() -> None:
    built: list[Any] = []
    agree(collecting(contenders.native_contender, built))
    assert sum(c._aostore_steps for c in built) > 0
    assert all(c._aostore_fallbacks == 0 and c._aostore_why_not is None for c in built)


def counting(raw: Any, calls: list[int]) -> Any:
    """``raw`` (a class's attribute: a function or a static method) that counts its calls,
    in the same shape."""
    if isinstance(raw, staticmethod):
        function = raw.__func__

        def static(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return function(*args, **kwargs)

        return staticmethod(static)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return raw(self, *args, **kwargs)

    return method


def collecting(make: Any, built: list[Any]) -> contenders.Factory:
    def factory(setup: contenders.Setup) -> Any:
        built.append(make(setup))
        return built[-1]

    return factory


def test_a_subclass_helper_is_called_by_vllms_method() -> None:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    calls: list[int] = []
    native = contenders._native_class()
    raw = inspect.getattr_static(AuxOutputSchedulerConnector, HELPER)
    Hooked = type("Hooked", (native,), {HELPER: counting(raw, calls)})
    built: list[Any] = []

    def hooked(setup: contenders.Setup) -> Any:
        return Hooked(setup.kv_cache_manager, setup.kv_connector) if KV_EVENTS else Hooked()

    agree(collecting(hooked, built))
    assert calls, "the subclass's helper was never called"
    assert sum(c._aostore_steps for c in built) == 0
    assert sum(c._aostore_fallbacks for c in built) > 0
    assert {c._aostore_why_not for c in built} <= {
        None,
        f"AuxOutputSchedulerConnector.{HELPER} is not vLLM's own",
    }


def test_a_helper_patched_on_vllms_class_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    calls: list[int] = []
    raw = inspect.getattr_static(AuxOutputSchedulerConnector, HELPER)
    monkeypatch.setattr(AuxOutputSchedulerConnector, HELPER, counting(raw, calls))
    built: list[Any] = []
    # Both contenders call the patched helper now: they must still agree.
    agree(collecting(contenders.native_contender, built))
    assert calls
    assert sum(c._aostore_steps for c in built) == 0
    assert sum(c._aostore_fallbacks for c in built) > 0
