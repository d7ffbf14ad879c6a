"""pytest-benchmark cases of the foundation, in device time (`pytest --benchmark-only`)."""
from __future__ import annotations

import pytest

from microbench.harness import full_sweeps

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SIZES = [64 * MiB, 1024 * MiB] if not full_sweeps() else [4 * MiB, 64 * MiB, 512 * MiB, 2048 * MiB]


@pytest.mark.parametrize("nbytes", SIZES, ids=lambda n: f"{n // MiB}MiB")
@pytest.mark.parametrize("kernel", ["mb_copy_v4", "memcpy"])
def test_copy(device_bench, kernel, nbytes):
    from microbench.basics.bench import copy_case
    from microbench.datasheet import hbm_peak
    from microbench.device import device_info
    from microbench.results import Bound

    peak = hbm_peak(device_info().name)
    bound = Bound("bandwidth", peak, "B/s", "datasheet HBM peak") if peak else None
    device_bench(copy_case(nbytes, kernel, bound))


def test_empty_kernel_launch(device_bench):
    from microbench.basics.bench import empty_launch_case

    device_bench(empty_launch_case(200))
