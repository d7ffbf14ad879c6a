"""CPU tests of the instruction-cache derivations: synthetic curves with known steps must give
back the steps, and the sweeps cover what the issue asks for."""
from __future__ import annotations

import numpy as np
import pytest

from microbench.icache import bench, derive
from microbench.icache.derive import SplicePoint, derive_capacity, derive_max_code, derive_prefetch

KiB = 1024


def _curve(sizes, edges, levels, noise, rng):
    """cycles/instr: levels[i] for sizes <= edges[i] (last level beyond), times (1 + noise)."""
    y = []
    for s in sizes:
        i = int(np.searchsorted(edges, s, side="left"))
        y.append(levels[i] * (1 + rng.normal(0, noise)))
    return list(zip(map(float, sizes), y))


@pytest.mark.parametrize("quick", [True, False])
def test_capacity_recovers_known_steps(quick):
    rng = np.random.default_rng(7)
    sizes = np.asarray(bench.capacity_sizes(quick), dtype=float)
    l1, l2 = 24 * KiB, 128 * KiB
    curves = {1: _curve(sizes, [l1, l2], [1.0, 1.9, 11.0], 0.01, rng),
              4: _curve(sizes, [l1, l2], [1.05, 1.6, 6.0], 0.01, rng),
              8: _curve(sizes, [l1, l2], [2.0, 2.5, 4.0], 0.01, rng)}
    d, notes = derive_capacity(curves)
    # the value is the largest size measured at the cheaper side; the spread brackets the truth
    want_l1 = sizes[sizes <= l1].max()
    want_l2 = sizes[sizes <= l2].max()
    assert d["icache_l1_bytes"].value == want_l1
    assert d["icache_l1_bytes"].spread[0] <= l1 < d["icache_l1_bytes"].spread[1]
    assert d["icache_l2_bytes"].value == want_l2
    assert d["icache_l2_bytes"].spread[0] <= l2 < d["icache_l2_bytes"].spread[1]
    assert d["icache_l2_miss_cpi_w1"].value == pytest.approx(11.0 - 1.9, rel=0.05)
    assert d["icache_level0_cpi_w1"].value == pytest.approx(1.0, rel=0.03)
    assert d["icache_level2_cpi_w8"].value == pytest.approx(4.0, rel=0.03)
    assert "icache_l3_bytes" not in d
    assert d["icache_l1_bytes"].unit == "B" and d["icache_l1_bytes"].rule


def test_capacity_level_seen_by_one_curve_only_still_counts():
    rng = np.random.default_rng(3)
    sizes = np.asarray(bench.capacity_sizes(False), dtype=float)
    curves = {1: _curve(sizes, [32 * KiB, 128 * KiB], [1.0, 1.5, 9.0], 0.005, rng),
              8: _curve(sizes, [128 * KiB], [2.0, 3.0], 0.005, rng)}  # the L0 step hidden by 8 warps
    d, _ = derive_capacity(curves)
    assert d["icache_l1_bytes"].spread[0] <= 32 * KiB < d["icache_l1_bytes"].spread[1]
    assert d["icache_l2_bytes"].spread[0] <= 128 * KiB < d["icache_l2_bytes"].spread[1]
    assert "icache_l2_miss_cpi_w8" in d and "icache_l1_miss_cpi_w8" not in d


def test_capacity_flat_curve_derives_nothing_and_says_so():
    rng = np.random.default_rng(0)
    sizes = bench.capacity_sizes(True)
    d, notes = derive_capacity({1: _curve(sizes, [], [1.0], 0.01, rng)})
    assert "icache_l1_bytes" not in d and "icache_l2_bytes" not in d
    assert any("no upward step" in n for n in notes)


def test_capacity_needs_points():
    with pytest.raises(ValueError, match="need >= 4"):
        derive_capacity({1: [(2048.0, 1.0), (4096.0, 1.0)]})


def _sp(a, b, ratio, w=12):
    return SplicePoint(a * KiB, b * KiB, (a + b) * KiB + 1600, ratio, (ratio - 0.01, ratio + 0.01), w)


def test_max_code_rule():
    pts = [_sp(16, 16, 1.00), _sp(32, 32, 1.01), _sp(48, 48, 1.03), _sp(64, 64, 1.22), _sp(100, 20, 1.15),
           _sp(100, 100, 1.6)]
    d, notes = derive_max_code(pts)
    assert d.value == 96 * KiB + 1600
    assert d.spread == (96 * KiB + 1600, 120 * KiB + 1600)  # the (100, 20) pair broke first
    # a pass after a failure does not extend the limit
    d2, _ = derive_max_code(pts + [_sp(140, 20, 1.0)])
    assert d2.value == d.value
    # the smaller answer over warp counts wins
    d3, _ = derive_max_code(pts + [_sp(16, 16, 1.0, w=1), _sp(32, 32, 1.2, w=1)])
    assert d3.value == 32 * KiB + 1600 and "1 warp" in d3.note


def test_max_code_nothing_breaks_is_a_lower_bound():
    d, notes = derive_max_code([_sp(16, 16, 1.0), _sp(100, 100, 1.02)])
    assert d.value == 200 * KiB + 1600 and "lower bound" in d.note


def test_max_code_everything_breaks():
    d, notes = derive_max_code([_sp(16, 16, 1.3), _sp(100, 100, 1.5)])
    assert d is None and any("not derived" in n for n in notes)


def test_prefetch_recovers_window():
    seg = 2 * KiB
    ends = np.arange(1, 65) * seg
    window = 40 * KiB
    cold = np.where(ends <= window, 1.1, 6.0)
    cold[0] = 20.0  # the first segment also pays the warp's start
    warm = np.full_like(cold, 1.0)
    d, notes = derive_prefetch(ends, cold, warm, 128 * KiB)
    assert d.value == window and d.spread == (window, window + seg)


def test_prefetch_flat_cases():
    ends = np.arange(1, 33) * 2048
    d, _ = derive_prefetch(ends, np.full(32, 1.1), np.full(32, 1.0), 64 * KiB)
    assert d.value == 64 * KiB and "whole probe" in d.note
    d, _ = derive_prefetch(ends, np.full(32, 5.0), np.full(32, 1.0), 64 * KiB)
    assert d.value == 0


def test_bootstrap_ratio():
    rng = np.random.default_rng(0)
    a = rng.normal(10, 0.1, 500)
    b = rng.normal(5, 0.1, 500)
    r, (lo, hi) = derive.bootstrap_ratio([a], [b])
    assert r == pytest.approx(2.0, rel=0.01) and lo <= r <= hi and hi - lo < 0.05
    r2, _ = derive.bootstrap_ratio([a + b], [a, b])
    assert r2 == pytest.approx(1.0, rel=0.01)


# ---------------------------------------------------------------------- sweeps
def test_sweeps_match_the_issue():
    q, f = bench.sweep(True), bench.sweep(False)
    for sw, n in ((q, 12), (f, 30)):
        assert len(sw.capacity_sizes) == n
        assert sw.capacity_sizes[0] == 2 * KiB and sw.capacity_sizes[-1] == 1024 * KiB
        assert all(s % 256 == 0 for s in sw.capacity_sizes)
        assert sw.capacity_warps[0] == 1 and max(sw.capacity_warps) >= 4
        assert (100 * KiB, 100 * KiB) in sw.splice_pairs and (100 * KiB, 20 * KiB) in sw.splice_pairs
        assert all(bench.STREAM_STAGES_PER_WARP % s == 0 for s in sw.stream_stages)
        assert sw.probe_bytes % sw.probe_seg_bytes == 0
    assert bench.issue_floor_cpi(1) == 1 and bench.issue_floor_cpi(4) == 1 and bench.issue_floor_cpi(8) == 2
    assert bench.issue_floor_cpi(12) == 3


def test_benchmark_names_and_constants_agree():
    from microbench.constants import SPECS
    from microbench.registry import CLASSES

    assert CLASSES["icache"] == "microbench.icache.bench"
    for s in SPECS:
        if s.benchmark.startswith("icache."):
            assert s.benchmark in bench.BENCHMARKS, s


def test_pass_counts_stay_exact():
    """Every kernel the sweeps launch keeps its float32 sums exact (else the check is invalid)."""
    from microbench.icache.gen import check_exact_range

    for quick in (True, False):
        sw = bench.sweep(quick)
        for g in bench.capacity_generators(sw, "sm_90a"):
            check_exact_range(g, bench.passes_for(g.params["block_sass"][0], sw.capacity_instr_per_launch) + 1)
        alone, spl = bench.splice_generators(sw, "sm_90a")
        for g in [*alone.values(), *spl.values()]:
            n = sum(g.params["block_sass"])
            check_exact_range(g, bench.passes_for(n, sw.splice_instr_per_launch, lo=4, hi=1024) + 1)
