"""pytest-benchmark cases of the cross-GPU class in device time (`pytest --benchmark-only`, a node
with 2+ GPUs): the sentinel collectives with both GPUs driven by one process (microbench/xgpu/
local.py). Each case first moves random payloads with every special class and compares them
bit-for-bit; a round is one launch of 100 collective rounds on every GPU."""
from __future__ import annotations

import pytest

from microbench.xgpu.local import cases

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_xgpu(device_bench, case):
    device_bench(case)
