"""pytest-benchmark cases of the clocks class, in device time (`pytest --benchmark-only`):
the instrumentation kernel with stamps compiled out and in, and a chain of 8 launches plain
and with programmatic dependent launch."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["off", "stamps_x1"])
def test_instrumentation(device_bench, variant):
    from microbench.clocks.bench import instr_case

    device_bench(instr_case(variant))


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_launch_chain(device_bench, pdl):
    from microbench.clocks.bench import chain_case

    device_bench(chain_case(pdl, "exclusive"))
