"""GPU checks of the instruction-cache kernels: each correctness check passes on the real kernel
and fails on a deliberately broken one, one block lands on each SM, timings respect the issue
floor, the in-kernel clock agrees with NVML, and the prefetch probe's stamps are sane.
Small kernels only (the evictor is the largest, 512 KiB), to stay within ~30 s."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

KiB = 1024


def _kernel(harness, blocks, warps=4, passes=4, **kw):
    from microbench.icache.bench import GenKernel
    from microbench.icache.gen import compile_many, loop_kernel

    g = loop_kernel(blocks, arch=harness.info.arch, **kw)
    return GenKernel(harness, g, compile_many([g])[g.name], warps, passes)


def test_loop_kernel_checked_and_broken_one_caught(harness):
    from microbench.errors import CorrectnessError
    from microbench.icache.gen import REC_WORDS

    k = _kernel(harness, [1024])
    rec = k.run_checked()
    assert rec.shape == (harness.info.sm_count * 4, REC_WORDS)
    with pytest.raises(CorrectnessError, match="accumulators wrong"):
        _kernel(harness, [1024], drop_last=1).run_checked()


def test_issue_floor_one_block_per_sm_and_clock(harness):
    """A 16 KiB body cannot beat one instruction per cycle per warp; every SM gets a block;
    %clock64 / %globaltimer over the launch agrees with NVML's SM clock."""
    from microbench.icache.bench import WARP_ISSUE_FLOOR_CPI, issue_floor_cpi, measure_loop
    from microbench.icache.gen import R_TIMED0

    for w in (1, 8):
        k = _kernel(harness, [1024], warps=w, passes=512)
        recs, clk, distinct = measure_loop(harness, k, 2)
        assert distinct == harness.info.sm_count
        cpi = np.concatenate(recs)[:, R_TIMED0] / (k.iters * k.gen.params["block_sass"][0])
        # per-warp windows only bound by the warp's own issue limit (warps drift: 1.66 seen at 8)
        assert 0.9 * WARP_ISSUE_FLOOR_CPI <= np.median(cpi) < 20 * issue_floor_cpi(w), (w, np.median(cpi))
        assert clk.inkernel is not None
        assert abs(clk.inkernel - clk.mhz) < 0.1 * clk.mhz, (clk.inkernel, clk.mhz)


def test_spliced_small_blocks_cost_their_parts(harness):
    """4 KiB + 4 KiB fits any instruction cache level: spliced ~= sum of the parts. One warp per
    SM: with 12, warps' timed windows drift apart (seen on the H200: 'alone' windows ran solo at
    ~1 CPI, spliced ones overlapped), which is the benchmark's business, not this check's."""
    from microbench.icache.bench import measure_loop
    from microbench.icache.gen import R_TIMED0

    def per_pass(blocks):
        k = _kernel(harness, blocks, warps=1, passes=64)
        rec = np.concatenate(measure_loop(harness, k, 2)[0])
        return [np.median(rec[:, R_TIMED0 + i]) / k.iters for i in range(len(blocks))]

    a, b = per_pass([256])[0], per_pass([256])[0]
    sa, sb = per_pass([256, 256])
    assert 0.8 < (sa + sb) / (a + b) < 1.25


def test_prefetch_probe_states(harness):
    from microbench.icache.bench import PREFETCH_STATES, PrefetchRig, evictor_generator
    from microbench.icache.gen import compile_many, probe_kernel

    probe = probe_kernel(2048, 128, arch=harness.info.arch)  # 32 KiB in 2 KiB segments
    ev = evictor_generator(harness.info.arch)
    rig = PrefetchRig(harness, probe, ev, compile_many([probe, ev]))
    for s in PREFETCH_STATES:
        st = rig.sample(s)  # asserts accumulators and increasing stamps
        assert st.shape == (harness.info.sm_count, 17)
        cpi = (st[:, -1] - st[:, 0]) / sum(probe.params["seg_sass"])
        assert np.median(cpi) >= 0.95, (s, np.median(cpi))  # a lone warp issues <= 1 per cycle


def test_stream_checked_and_wrong_pass_count_caught(harness):
    from microbench.errors import CorrectnessError
    from microbench.icache.bench import stream_case

    p = stream_case(16, stages_per_warp=64).prepare(harness)
    assert p.work == 64 * harness.info.sm_count * 8 * 4096
    with pytest.raises(CorrectnessError, match="sums wrong"):
        stream_case(16, stages_per_warp=64, passes_override=3).prepare(harness)
