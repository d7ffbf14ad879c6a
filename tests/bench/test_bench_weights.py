"""pytest-benchmark cases of the weights class, in device time (`pytest --benchmark-only`).

Quick: the read ceiling's first configuration, two rings, two L2 working sets, one prefetch
pair (about 15 s on an H200). Full (--megabench-full): more of each."""
from __future__ import annotations

import pytest

from microbench.harness import full_sweeps

pytestmark = pytest.mark.gpu
KiB, MiB = 1 << 10, 1 << 20
FULL = full_sweeps()

RINGS = [(5, 32), (4, 16)] if not FULL else [(2, 32), (4, 16), (4, 32), (5, 32), (6, 32), (3, 64), (8, 16)]
L2_SIZES = [16 * MiB, 256 * MiB] if not FULL else [4 * MiB, 16 * MiB, 32 * MiB, 48 * MiB, 64 * MiB, 256 * MiB]
PREFETCH = [(40 * MiB, 25.0)] if not FULL else [(8 * MiB, 5.0), (24 * MiB, 25.0), (40 * MiB, 25.0), (56 * MiB, 50.0)]


@pytest.fixture(scope="module")
def ceiling(harness):
    from microbench.weights.bench import ceiling_bound

    return ceiling_bound(harness)


def test_read_ceiling(device_bench, harness):
    from microbench.weights.bench import CEILING_BYTES, _datasheet, read_case
    from microbench.weights.plan import ceiling_sweep

    device_bench(read_case(CEILING_BYTES, ceiling_sweep(True)[0], bound=_datasheet(harness)))


@pytest.mark.parametrize("stages,kib", RINGS, ids=lambda v: str(v))
def test_ring(device_bench, ceiling, stages, kib):
    from microbench.weights.bench import ring_case
    from microbench.weights.plan import RingConfig

    device_bench(ring_case(RingConfig(stages, kib * KiB), bound=ceiling))


@pytest.mark.parametrize("nbytes", L2_SIZES, ids=lambda n: f"{n // MiB}MiB")
def test_l2_read(device_bench, ceiling, nbytes):
    from microbench.weights.bench import L2_READ, read_case
    from microbench.weights.plan import reps_for

    device_bench(read_case(nbytes, L2_READ, reps_for(nbytes), ceiling, name=f"l2_bandwidth/{nbytes // MiB}MiB"))


@pytest.mark.parametrize("prefetch", [False, True], ids=["nopf", "pf"])
@pytest.mark.parametrize("nbytes,overlap_us", PREFETCH, ids=lambda v: str(v))
def test_prefetch(device_bench, harness, ceiling, nbytes, overlap_us, prefetch):
    from microbench.results import Bound
    from microbench.weights.bench import STUDY_RING, phase_case
    from microbench.weights.kernels import Scrubber

    scrub = Scrubber(harness)
    b = Bound("time", overlap_us * 1e-6 + nbytes / ceiling.value, "s", f"busy + bytes at {ceiling.source}")
    case = phase_case(f"prefetch/{nbytes // MiB}MiB/t{overlap_us:g}us/{'pf' if prefetch else 'nopf'}",
                      {"prefetch_bytes": nbytes, "overlap_us": overlap_us, "prefetch": prefetch}, STUDY_RING, nbytes,
                      1, [0] if prefetch else [], [0], overlap_us, 0, scrub, b)
    device_bench(case)
