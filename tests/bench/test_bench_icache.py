"""pytest-benchmark cases of the instruction-cache class, in device time (`pytest --benchmark-only`).
Quick by default; --megabench-full (or MEGABENCH_FULL=1) widens every sweep."""
from __future__ import annotations

import pytest

from microbench.harness import full_sweeps

pytestmark = pytest.mark.gpu
KiB = 1024
FULL = full_sweeps()

CAP_SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB] if FULL else [16 * KiB, 256 * KiB]
CAP_WARPS = [1, 4, 8] if FULL else [4]
SPLICES = ([(100 * KiB,), (100 * KiB, 100 * KiB), (100 * KiB, 20 * KiB), (20 * KiB,), (64 * KiB, 64 * KiB)]
           if FULL else [(100 * KiB,), (100 * KiB, 100 * KiB), (100 * KiB, 20 * KiB)])
SPLICE_WARPS = [1, 12] if FULL else [12]
STATES = ["warm", "icache_cold", "l2_cold"] if FULL else ["warm", "icache_cold"]
STAGES = [16, 64, 128, 256, 384] if FULL else [16, 384]


def _loop_case(blocks_bytes, warps, instr_per_launch):
    from microbench.icache.bench import loop_case, passes_for
    from microbench.icache.gen import instructions_for, loop_kernel

    n = [instructions_for(b) for b in blocks_bytes]
    return loop_case(loop_kernel(n), warps, passes_for(sum(n), instr_per_launch, lo=4, hi=1024))


@pytest.mark.parametrize("warps", CAP_WARPS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("nbytes", CAP_SIZES, ids=lambda n: f"{n // KiB}KiB")
def test_capacity_loop(device_bench, nbytes, warps):
    device_bench(_loop_case([nbytes], warps, 1 << 19))


@pytest.mark.parametrize("warps", SPLICE_WARPS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("blocks", SPLICES, ids=lambda b: "+".join(f"{x // KiB}KiB" for x in b))
def test_spliced(device_bench, blocks, warps):
    device_bench(_loop_case(list(blocks), warps, 1 << 18))


@pytest.mark.parametrize("state", STATES)
def test_prefetch_probe(device_bench, state):
    from microbench.icache.bench import probe_case

    device_bench(probe_case(state=state))


@pytest.mark.parametrize("stages", STAGES)
def test_code_vs_data_stream(device_bench, stages):
    from microbench.datasheet import hbm_peak
    from microbench.device import device_info
    from microbench.icache.bench import stream_case
    from microbench.results import Bound

    peak = hbm_peak(device_info().name)
    bound = Bound("bandwidth", peak, "B/s", "datasheet HBM peak") if peak else None
    device_bench(stream_case(stages, bound))
