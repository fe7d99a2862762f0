"""``aostore.metrics``: a Prometheus scrape agrees with ``store.stats()``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

aostore = pytest.importorskip("aostore")
metrics = pytest.importorskip("aostore.metrics")
prometheus_client = pytest.importorskip(
    "prometheus_client",
    reason="prometheus_client is not installed (pip install aostore[prometheus])",
)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

BlockObject = aostore.BlockObject


@pytest.fixture
def busy_store() -> Iterator[Any]:
    """A store with every counter moved: puts, retains, releases, evictions, reads, a miss."""
    store = aostore.BlockObjectStore(max_bytes=4 * 8, object_nbytes=8)
    store.put([BlockObject(f"k{i}", bytes([i]) * 8) for i in range(4)], retain_keys=["k0", "k1"])
    store.put([BlockObject("k4", b"4" * 8)], release_keys=["k1"])
    assert store.get_concatenated(["k0", "k4"]) == b"\0" * 8 + b"4" * 8
    with pytest.raises(aostore.BlockObjectStoreError):
        store.get_concatenated(["gone"])
    with pytest.raises(aostore.BlockObjectStoreError):  # capacity error
        store.put([BlockObject(f"n{i}", b"n" * 8) for i in range(5)])
    yield store
    store.close()


def scrape(registry: Any) -> dict[str, tuple[str, dict[str, str], float]]:
    """``{sample name: (family type, labels, value)}`` from the text exposition."""
    text = prometheus_client.generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = (family.type, dict(sample.labels), sample.value)
    return samples


def test_scrape_matches_stats(busy_store: Any) -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics.register_store(busy_store, registry=registry, labels={"engine": "0"})
    samples = scrape(registry)
    stats = busy_store.stats()
    assert stats["evictions"] > 0 and stats["read_misses"] == 1 and stats["capacity_errors"] == 1
    for key, value in stats.items():
        if key in metrics.COUNTERS:
            kind, labels, got = samples[f"aostore_{key}_total"]
            assert kind == "counter"
        else:
            kind, labels, got = samples[f"aostore_{key}"]
            assert kind == "gauge", key
        assert got == value, key
        assert labels == {"engine": "0"}
    assert set(metrics.GAUGES) | set(metrics.COUNTERS) >= set(stats)


def test_every_metric_documents_its_unit() -> None:
    for help_text in [*metrics.GAUGES.values(), *metrics.COUNTERS.values()]:
        assert help_text.endswith(")."), help_text


def test_scrape_follows_the_store(busy_store: Any) -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics.register_store(busy_store, registry=registry)
    before = scrape(registry)["aostore_puts_total"][2]
    busy_store.put([BlockObject("late", b"l" * 8)], release_keys=["k0"])
    after = scrape(registry)
    assert after["aostore_puts_total"][2] == before + 1
    assert after["aostore_stored"][2] == busy_store.stats()["stored"]
    assert after["aostore_referenced"][2] == 0


def test_duplicate_registration_is_refused(busy_store: Any) -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics.register_store(busy_store, registry=registry)
    with pytest.raises(ValueError):
        metrics.register_store(busy_store, registry=registry)
    metrics.register_store(busy_store, registry=registry, prefix="other_")
    assert "other_stored" in scrape(registry)


def test_callable_source_and_unknown_keys() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics.register_store(lambda: {"stored": 3, "puts": 2, "something_new": 7}, registry=registry)
    samples = scrape(registry)
    assert samples["aostore_stored"][2] == 3
    assert samples["aostore_puts_total"][2] == 2
    assert samples["aostore_something_new"][:1] == ("gauge",)
    assert samples["aostore_something_new"][2] == 7
    with pytest.raises(TypeError):
        metrics.AostoreCollector(42)


def test_failing_source_yields_no_samples() -> None:
    def broken() -> dict[str, int]:
        raise RuntimeError("store is closed")

    registry = prometheus_client.CollectorRegistry()
    metrics.register_store(broken, registry=registry)
    assert scrape(registry) == {}


def test_closed_store_still_reports_counters(busy_store: Any) -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics.register_store(busy_store, registry=registry)
    puts = busy_store.stats()["puts"]
    busy_store.close()
    assert scrape(registry)["aostore_puts_total"][2] == puts


def test_default_registry(busy_store: Any) -> None:
    collector = metrics.register_store(busy_store)
    try:
        assert prometheus_client.REGISTRY.get_sample_value("aostore_stored") == 4
    finally:
        prometheus_client.REGISTRY.unregister(collector)


def test_imports_without_prometheus_client() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["prometheus_client"] = None  # as if it were not installed
        import aostore, aostore.metrics
        store = aostore.BlockObjectStore(max_bytes=8, object_nbytes=4)
        try:
            aostore.metrics.register_store(store)
        except ImportError as error:
            print("ImportError:", error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert "ImportError:" in done.stdout
    assert "prometheus_client" in done.stdout
