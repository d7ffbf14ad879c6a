"""GPU checks of the clocks class: the profiler writes exactly what the host reads (and nothing
out of bounds), the timer probes are sane, skew and chain runs pass their checkers, a missing
stamper trips the watchdog instead of hanging, and the instrumented kernel's output is bitwise
identical to the uninstrumented one while a broken variant is caught. Budget: well under 30 s."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

KERNEL = r'''
#include "mb/profile.cuh"
%(events)s
// every warp stamps 5 times: begin(phase) ... end(phase), 3 instants in between; block 5 of the
// grid is outside the layout when the host says so
extern "C" __global__ void prof_probe(unsigned int* sm_out, MB_PROF_PARAMS) {
  mb::prof::Profiler prof(MB_PROF_ARGS);
  const unsigned int w = threadIdx.x / 32;
  prof.stamp(PP_EV_WORK_BEGIN, 100 * blockIdx.x + w);
  for (unsigned int i = 0; i < 3; ++i) prof.stamp(PP_EV_TICK, i);
  prof.stamp(PP_EV_WORK_END, 1000 + w);
  if (threadIdx.x == 0) sm_out[blockIdx.x] = mb::smid();
}
'''


def _probe_events():
    from microbench.clocks.profiler import ProfileEvents

    ev = ProfileEvents("prof_probe", prefix="PP_EV")
    ev.phase("work")
    ev.instant("tick")
    return ev


def _probe_kernel(harness, profile: int):
    from microbench.compiler import compile_cuda

    src = KERNEL % {"events": _probe_events().header_text()}
    return compile_cuda(src, name="prof_probe", arch=harness.info.arch,
                        defines={"MB_PROFILE": profile, "MB_PROF_CLOCK64": 1}).kernel("prof_probe")


def test_profiler_round_trip_bounds_and_overflow(harness):
    import torch

    from microbench.clocks.profiler import PROFILE_OFF, ProfileBuffer, ProfileFormatError, ProfileLayout, Timeline
    from microbench.launch import LaunchSpec, launch

    ev = _probe_events()
    k = _probe_kernel(harness, 1)
    spec = LaunchSpec(grid=5, block=96)  # 3 warps; the layout lets only warps 0-1 record
    lay = ProfileLayout(blocks=5, warps=2, cap=3)  # 5 stamps per warp: 2 overflow
    lay.check_launch(spec)
    with pytest.raises(ProfileFormatError, match="6 blocks"):
        lay.check_launch(LaunchSpec(grid=6, block=96))
    pb = ProfileBuffer(lay, launches=2)  # slice 1 is the canary: launch 0 must not touch it
    canary = pb.tensor.view(2, -1)[1].clone()
    sm = torch.full((5,), -1, dtype=torch.int32, device="cuda")
    launch(k, spec, sm, *pb.args(0))
    torch.cuda.synchronize()
    assert torch.equal(pb.tensor.view(2, -1)[1], canary), "profiler wrote outside its launch slice"
    st = pb.read()
    tl = Timeline.build(st, ev)
    assert st.counts()[0].tolist() == [[3, 3]] * 5 and st.counts()[1].sum() == 0
    assert st.overflow[0].tolist() == [[2, 2]] * 5
    assert st.has_clock64 and set(st.sm.tolist()) <= set(range(harness.info.sm_count))
    assert [int(s) for s in st.sm[st.warp == 0][::3]] == sm.cpu().tolist()
    for b in range(5):
        for w in range(2):
            m = (st.block == b) & (st.warp == w)
            assert st.arg[m].tolist() == [100 * b + w, 0, 1]
            assert np.all(np.diff(st.gt[m].astype(np.int64)) >= 0) and np.all(np.diff(st.c64[m].astype(np.int64)) > 0)
    assert len(tl.spans) == 0 and sum("never ended" in p for p in tl.problems) == 10
    assert sum("overflowed" in p for p in tl.problems) == 10
    # a reset buffer reused: new epoch, records of the first use are stale, not read as new. The
    # reset writes nothing; the launch resets its slice: counters of the blocks that ran, the
    # header epoch (blocks 2-4 did not run: their old overflow counts are not read as this epoch's)
    kept = pb.tensor.clone()
    pb.reset()
    torch.cuda.synchronize()
    assert torch.equal(pb.tensor, kept), "ProfileBuffer.reset() wrote to the device"
    launch(k, LaunchSpec(grid=2, block=32), sm, *pb.args(0))
    torch.cuda.synchronize()
    st2 = pb.read()
    assert st2.counts()[0].sum() == 2 * 3 and st2.stale == 5 * 2 * 3 - 2 * 3
    assert st2.overflow[0].tolist() == [[2, 0], [2, 0], [0, 0], [0, 0], [0, 0]]  # warp 1 of blocks 0-1 did not exist
    # null buffer: records nothing, touches nothing
    before = pb.tensor.clone()
    launch(k, spec, sm, *PROFILE_OFF)
    torch.cuda.synchronize()
    assert torch.equal(pb.tensor, before)


def test_compiled_out_profiler_writes_nothing(harness):
    import torch

    from microbench.clocks.profiler import ProfileBuffer, ProfileLayout
    from microbench.launch import LaunchSpec, launch

    k = _probe_kernel(harness, 0)
    pb = ProfileBuffer(ProfileLayout(blocks=4, warps=1, cap=8))
    before = pb.tensor.clone()
    sm = torch.full((4,), -1, dtype=torch.int32, device="cuda")
    launch(k, LaunchSpec(grid=4, block=32), sm, *pb.args())
    torch.cuda.synchronize()
    assert torch.equal(pb.tensor, before) and len(pb.read()) == 0 and int(sm.min()) >= 0


def test_timer_probes_are_sane(harness):
    from microbench.clocks.probes import clock_rate_probe, read_cost_probe, stamp_cost_probe, tick_probe

    t = tick_probe(blocks=2, max_changes=128)
    assert 0 < t.tick_ns <= 100_000 and t.reads_per_change >= 1
    r = clock_rate_probe(interval_ns=10_000_000, nvml_samples=1)
    assert r.mhz.size == harness.info.sm_count and 100 < float(np.median(r.mhz)) < 3000
    c = read_cost_probe(iters=16, reps=2)
    assert all(0 < float(np.median(c[m])) < 500 for m in ("globaltimer", "clock64"))
    s = stamp_cost_probe(n=64, reps=2)
    assert 0 < float(np.median(s)) < 2000


def test_skew_probe_and_its_calibration(harness):
    from microbench.clocks.analysis import analyse_skew
    from microbench.clocks.probes import SkewProbe, tick_probe

    tick = tick_probe(blocks=2, max_changes=64).tick_ns
    gt, c64, sm = SkewProbe().run(48, jitter_cycles=8000)
    assert gt.shape == (48, harness.info.sm_count) and len(set(sm.tolist())) == harness.info.sm_count
    st = analyse_skew(gt, c64, sm, tick)
    assert 0 <= st.sm_skew_ns < 50_000 and np.isfinite(st.residual_rms_ns)
    assert st.residual_rms_ns < max(4 * tick, 2000)


def test_missing_stamper_trips_the_watchdog_not_the_gpu(harness):
    from microbench.clocks.probes import SkewProbe
    from microbench.errors import SpinTimeoutError

    p = SkewProbe()
    # whichever waiter's bound expires first reports: the releaser (arrivals) or a stamper (flag)
    with pytest.raises(SpinTimeoutError, match="skew_wait_arrivals|skew_wait_release"):
        p.run(4, expected=p.spec.blocks + 1, bound_ns=20_000_000)


def test_chain_runs_plain_launches_in_stream_order(harness):
    from microbench.clocks.analysis import analyse_chain
    from microbench.clocks.probes import chain_run, tick_probe

    tick = tick_probe(blocks=2, max_changes=64).tick_ns
    m = analyse_chain(chain_run(harness, launches=4, pdl=False, config="exclusive", work_ns=10_000))
    # a plain launch starts after the previous grid completed (up to the timer's resolution)
    assert float(m["land_after_last_exit"].min()) > -(2 * tick + 2000)
    p = analyse_chain(chain_run(harness, launches=4, pdl=True, config="shared", work_ns=10_000))
    assert np.all(np.isfinite(p["wait_in_griddepcontrol"])) and float(p["wait_in_griddepcontrol"].min()) >= -tick


def test_instrumented_output_is_bitwise_identical_and_broken_is_caught(harness):
    from microbench.clocks.bench import InstrKernel, check_bitwise_identical
    from microbench.errors import CorrectnessError

    assert check_bitwise_identical(harness, per_block=4096) == 4096 * harness.info.sm_count
    tl = InstrKernel(harness, "stamps_x8", 4096).run_and_check()
    assert tl is not None and not tl.problems
    with pytest.raises(CorrectnessError, match="differ from the reference"):
        InstrKernel(harness, "broken", 4096).run_and_check()
