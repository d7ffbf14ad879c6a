"""pytest-benchmark cases of the torch baselines (eager, CUDA graph, torch.compile) on small and
shard8 at T=1 and T=16, in device time (`pytest tests/bench/test_bench_baselines.py --benchmark-only`).
Each case checks the baseline against reference.step before timing, counts its kernels with the
profiler, and carries launches per step and the roofline in extra_info. Weights (shard8 ~60 GB)
are generated on the GPU once per process and freed at the end of the module."""
from __future__ import annotations

import pytest

from megakernel.baselines import BASELINES
from megakernel.bench_baselines import QUICK_POINTS

pytestmark = pytest.mark.gpu
POINTS = [(p, t, c) for p, pts in QUICK_POINTS.items() for t, c in pts]


@pytest.fixture(scope="module", autouse=True)
def _free_weights():
    yield
    from megakernel import bench_baselines as bb

    bb.release()


@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("preset, n_tokens, ctx", POINTS, ids=[f"{p}-T{t}-ctx{c}" for p, t, c in POINTS])
def test_step(device_bench, preset, n_tokens, ctx, baseline):
    from megakernel.bench_baselines import baseline_case

    device_bench(baseline_case(preset, n_tokens, ctx, baseline))
