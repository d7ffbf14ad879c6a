"""GPU checks of the weights kernels: every checker passes on correct kernels and fails on the
deliberately broken ones, every ring wait is bounded, refused rings are refused before launch,
and the L2 policy experiments leave the device as they found it. Small buffers: a few seconds."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("kernel", ["mb_read_nc_u2", "mb_read_nc_u4", "mb_read_nc_u8", "mb_read_cg_u4",
                                    "mb_read_cg_u8", "mb_read_hint_u4"])
def test_read_kernels_sum_every_word(harness, kernel):
    from microbench.weights.kernels import ReadJob

    # odd word count and several passes: the virtual-index wrap and the tail loop both run
    job = ReadJob(harness, 8 * MiB + 48, kernel, 256, reps=3, policy_kind=1 if "hint" in kernel else 0)
    job.first_check()
    small = ReadJob(harness, 4096, kernel, 512, reps=5)  # fewer words than threads
    small.first_check()


def test_broken_read_is_caught(harness):
    from microbench.errors import CorrectnessError
    from microbench.weights.kernels import ReadJob

    with pytest.raises(CorrectnessError, match="lanes differ"):
        ReadJob(harness, 8 * MiB, "mb_read_broken", 256).first_check()


@pytest.mark.parametrize("stages,stage_kib,chunks", [(2, 4, 1001), (3, 48, 500), (5, 32, 700), (7, 32, 265),
                                                     (8, 16, 131)])
def test_ring_streams_every_byte(harness, stages, stage_kib, chunks):
    """Chunk counts not divisible by the grid (and fewer chunks than blocks) included."""
    from microbench.weights.kernels import RingJob
    from microbench.weights.plan import RingConfig

    RingJob(harness, RingConfig(stages, stage_kib * KiB), nbytes=chunks * stage_kib * KiB).first_check()


def test_ring_with_more_consumer_warps(harness):
    from microbench.weights.kernels import RingJob
    from microbench.weights.plan import RingConfig

    RingJob(harness, RingConfig(4, 16 * KiB), nbytes=64 * MiB, consumer_warps=8).first_check()


@pytest.mark.parametrize("pieces", [1, 16, 32])
def test_ring_filled_in_pieces_streams_every_byte(harness, pieces):
    """mb_ring_stream_pieces: each stage as `pieces` bulk copies from that many lanes, same sums."""
    from microbench.weights.kernels import RingJob
    from microbench.weights.plan import KiB, MiB, RingConfig

    RingJob(harness, RingConfig(4, 16 * KiB), nbytes=64 * MiB, pieces=pieces).first_check()


def test_ring_pieces_refuses_copies_that_are_not_whole_16_byte_units(harness):
    from microbench.weights.kernels import RingJob
    from microbench.weights.plan import KiB, MiB, RingConfig

    with pytest.raises(ValueError, match="pieces"):
        RingJob(harness, RingConfig(4, 16 * KiB), nbytes=16 * MiB, pieces=48)


def test_ring_consumer_that_skips_bytes_is_caught(harness):
    from microbench.errors import CorrectnessError
    from microbench.weights.kernels import RingJob
    from microbench.weights.plan import RingConfig

    with pytest.raises(CorrectnessError, match="blocks differ"):
        RingJob(harness, RingConfig(4, 16 * KiB), nbytes=32 * MiB, kernel="mb_ring_stream_skip").first_check()


def test_ring_copy_that_never_completes_ends_in_a_watchdog_report(harness):
    import torch

    from microbench.errors import SpinTimeoutError
    from microbench.weights.kernels import RingJob
    from microbench.weights.plan import RingConfig

    job = RingJob(harness, RingConfig(3, 8 * KiB), nbytes=16 * MiB, kernel="mb_ring_stream_short",
                  bound_ns=2_000_000)
    job()
    torch.cuda.synchronize()  # returns: the waits gave up instead of hanging
    with pytest.raises(SpinTimeoutError, match=r"ring slot \d barrier (full|empty)"):
        job.rk.check_watchdog()


def test_ring_that_does_not_fit_is_refused_before_launch(harness):
    from microbench.errors import KernelDoesNotFitError
    from microbench.weights.kernels import RingKernel
    from microbench.weights.plan import RingConfig

    with pytest.raises(KernelDoesNotFitError, match="opt-in shared memory"):
        RingKernel(harness, RingConfig(8, 32 * KiB))


def test_phase_kernel_checks_both_phases(harness):
    """Partial last chunks (expert not a multiple of the stage), prefetch on, phase A streaming."""
    from microbench.weights.kernels import PhaseJob
    from microbench.weights.plan import RingConfig

    cfg = RingConfig(4, 32 * KiB)
    x = 1 * MiB + 48 * KiB
    busy = 20_000  # cycles, ~10 us
    job = PhaseJob(harness, cfg, x, 12, prefetch=[1, 3, 5], read=[3, 7, 0, 11, 5], busy_cycles=busy,
                   pa_bytes=160 * cfg.stage_bytes)
    times = job.first_check()
    assert times["phase_a_ns_median_globaltimer"] > 0 and times["phase_b_ns_median_globaltimer"] > 0
    nopf = PhaseJob(harness, cfg, x, 12, prefetch=[], read=[2], busy_cycles=0, pool=job.pool)
    nopf.first_check()


def test_phase_kernel_checker_fails_on_a_wrong_reference(harness):
    import torch

    from microbench.errors import CorrectnessError
    from microbench.weights.kernels import PhaseJob
    from microbench.weights.plan import RingConfig

    job = PhaseJob(harness, RingConfig(4, 32 * KiB), 1 * MiB, 8, prefetch=[], read=[1, 2], busy_cycles=0)
    job.expected_b = job.expected_b.clone()
    job.expected_b[5] ^= 1  # the kernel is right; a wrong expectation must be reported
    job()
    torch.cuda.synchronize()
    with pytest.raises(CorrectnessError, match="phase B"):
        job.check()


def test_pointer_chase_is_checked_and_plausible(harness):
    import torch

    from microbench.errors import CorrectnessError
    from microbench.weights.kernels import Chase

    rng = np.random.default_rng(0)
    ch = Chase(harness, 4 * MiB, rng)
    lat = torch.zeros(64, dtype=torch.int32, device="cuda")
    r = ch.run(5, 4000, 64, lat)
    ns = r["ns"] / 4000
    assert 50 < ns < 5000, ns  # an L2 or DRAM latency, not a skipped loop
    assert r["cycles"] > 0 and (lat > 0).all()
    # break the cycle at the start: it now points at itself, so the chase never moves
    words = ch.buf.view(torch.int64).view(ch.n, ch.stride // 8)
    words[5, 0] = ch.base + 5 * ch.stride
    with pytest.raises(CorrectnessError, match="pointer chase"):
        ch.run(5, 4000)


def test_persisting_window_leaves_the_device_as_found(harness):
    import torch

    from microbench.weights.kernels import ReadJob
    from microbench.weights.l2policy import persisting_limit, persisting_window, stream_window

    if harness.info.persisting_l2_max_bytes == 0:
        pytest.skip("device has no persisting L2")
    before = persisting_limit()
    job = ReadJob(harness, 8 * MiB, "mb_read_cg_u4", 512)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with persisting_window(side.cuda_stream, job.buf.data_ptr(), 8 * MiB, 8 * MiB,
                               harness.info.persisting_l2_max_bytes) as st:
            assert stream_window(side.cuda_stream)[1] == 8 * MiB
            assert st["granted_limit"] > 0
            job()
            torch.cuda.synchronize()
            job.check()
    assert persisting_limit() == before
    assert stream_window(side.cuda_stream)[1] == 0


def test_evict_last_lines_can_be_reset(harness):
    """Smoke: lines loaded evict_last, then the applypriority reset kernel over them (priority is
    not observable directly; the l2 benchmark's protection measurements show its effect)."""
    import torch

    from microbench.launch import LaunchSpec, launch
    from microbench.weights.kernels import ReadJob, module

    job = ReadJob(harness, 8 * MiB, "mb_read_hint_u4", 512, policy_kind=2)
    job.first_check()
    k = module("read", harness.info.arch).kernel("mb_l2_priority_normal")
    launch(k, LaunchSpec(grid=harness.info.sm_count, block=256), job.buf, np.uint64(8 * MiB // 128))
    torch.cuda.synchronize()
