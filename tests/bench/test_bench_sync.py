"""pytest-benchmark cases of the sync class, in device time (`pytest --benchmark-only`). Each
case verifies its kernel first (statuses, payloads bit-exact, grid waits with a stalled block),
then times one whole launch per round with its flags/slots reset untimed before each."""
from __future__ import annotations

import pytest

from microbench.sync.bench import cases

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_sync(device_bench, case):
    device_bench(case)
