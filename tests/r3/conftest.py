"""What R3's off-node tests share: a Mooncake master on loopback, no segment holder (the
frontend's client holds the only segment)."""

from __future__ import annotations

from collections.abc import Iterator

import mooncake_util
import pytest
from mooncake_fakes import require_mooncake


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    require_mooncake()
    with mooncake_util.cluster(tmp_path_factory.mktemp("r3"), holder_segment=None) as started:
        yield started
