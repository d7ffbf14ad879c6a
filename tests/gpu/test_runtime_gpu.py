"""GPU checks of the foundation: correctness checks can fail, the harness measures device time
of the right magnitude, bounded waits end in a clear error, co-residency is enforced."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_copy_is_checked_and_broken_copy_is_caught(harness):
    from microbench.basics.bench import copy_case
    from microbench.errors import CorrectnessError

    copy_case(8 << 20).prepare(harness)  # passes its own check
    with pytest.raises(CorrectnessError, match="differ"):
        copy_case(8 << 20, kernel="mb_copy_broken").prepare(harness)


def test_harness_copy_time_is_physically_plausible(harness):
    """A 1 GiB copy moves 2 GiB: its device time must sit between the datasheet-rate time
    (can't be faster) and 20x that (we'd be timing something else)."""
    from microbench.basics.bench import copy_case
    from microbench.datasheet import hbm_peak
    from microbench.harness import run_case
    from microbench.results import Bound

    peak = hbm_peak(harness.info.name) or 8e12
    s = run_case(harness, copy_case(1 << 30, bound=Bound("bandwidth", peak, "B/s", "datasheet")))
    floor = 2 * (1 << 30) / peak
    assert s.summary.n >= 10 and s.timer == "cuda_event"
    assert floor * 0.9 < s.summary.median < 20 * floor, (s.summary.median, floor)
    assert s.fraction_of_bound is not None and 0.3 < s.fraction_of_bound < 1.3


def test_blocking_kernel_removes_submission_time(harness):
    """Empty launches queued behind the blocking kernel cost far less device time than the
    host needs to submit them; without the block we would be timing the host."""
    from microbench.basics.bench import empty_launch_case, host_submit_samples

    p = empty_launch_case(100).prepare(harness)
    t = harness.time(p.launch, batch=p.batch)
    host = float(np.median(host_submit_samples(harness, n=100, reps=5)))
    assert t.median_s < host, (t.median_s, host)
    assert 0.2e-6 < t.median_s < 20e-6


def test_spin_wait_gives_up_with_a_clear_message(harness):
    import torch

    from microbench.compiler import compile_cuda
    from microbench.errors import SpinTimeoutError
    from microbench.launch import LaunchSpec, launch
    from microbench.watchdog import Watchdog

    mod = compile_cuda(harness_src("selftest.cu"), arch=harness.info.arch)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    done = torch.zeros(4, dtype=torch.int32, device="cuda")
    wd = Watchdog(bound_ns=2_000_000)
    launch(mod.kernel("mb_spin_never"), LaunchSpec(grid=4, block=32), flag, np.uint32(1), wd.ptr,
           np.uint64(wd.bound_ns), done, persistent=True)
    torch.cuda.synchronize()
    assert sorted(done.tolist()) == [2, 2, 2, 2]  # every waiter gave up, none claimed success
    with pytest.raises(SpinTimeoutError, match=r"flag 42.*expected 1, last saw 0"):
        wd.check(lambda w: f"flag {w}")


def test_persistent_grid_that_cannot_be_resident_is_refused(harness):
    from microbench.errors import KernelDoesNotFitError
    from microbench.launch import LaunchSpec, check_coresident

    k = harness.empty_kernel()
    too_many = LaunchSpec(grid=harness.info.sm_count * 64 + 1, block=1024)
    with pytest.raises(KernelDoesNotFitError, match="cannot all be resident"):
        check_coresident(k, too_many)
    check_coresident(k, LaunchSpec(grid=harness.info.sm_count, block=256))


def test_device_info_is_sane(harness):
    d = harness.info
    assert d.sm_count > 0 and d.l2_bytes > 1 << 20 and d.cc >= (9, 0)
    assert d.arch.startswith("sm_")


def harness_src(name):
    from microbench.compiler import REPO_ROOT

    return REPO_ROOT / "microbench" / "cuda" / name


def _selftest(harness, name="selftest.cu"):
    from microbench.compiler import compile_cuda

    return compile_cuda(harness_src(name), arch=harness.info.arch)


def test_dynamic_smem_above_48k(harness):
    import torch

    from microbench.launch import LaunchSpec, launch

    nwords = 200 * 1024 // 4
    inp = torch.randint(0, 2**31 - 1, (2 * nwords,), dtype=torch.int32, device="cuda")
    out = torch.full_like(inp, -1)
    launch(_selftest(harness).kernel("mb_big_smem"), LaunchSpec(grid=2, block=256, smem=nwords * 4), inp, out,
           np.uint32(nwords))
    assert torch.equal(out.view(2, nwords), inp.view(2, nwords).flip(1))


def test_cluster_launch_and_dsmem(harness):
    import torch

    from microbench.launch import LaunchSpec, launch

    out = torch.full((8 * 3,), -1, dtype=torch.int32, device="cuda")
    launch(_selftest(harness).kernel("mb_cluster_probe"), LaunchSpec(grid=2, block=64, cluster=4), out)
    o = out.view(8, 3).cpu().tolist()
    for b, (rank, nrank, v) in enumerate(o):
        assert nrank == 4 and rank == b % 4 and v == 1000 + (b // 4) * 4


def test_bulk_copy_on_mbarrier(harness):
    import torch

    from microbench.launch import LaunchSpec, launch
    from microbench.watchdog import Watchdog

    nbytes = 64 * 1024
    inp = torch.randint(-2**31, 2**31 - 1, (4 * nbytes // 4,), dtype=torch.int32, device="cuda")
    out = torch.full_like(inp, 7)
    wd = Watchdog(100_000_000)
    launch(_selftest(harness).kernel("mb_bulk_probe"), LaunchSpec(grid=4, block=128, smem=nbytes), inp, out,
           np.uint32(nbytes), wd.ptr)
    wd.check()
    assert torch.equal(inp, out)


def test_programmatic_dependent_launch(harness):
    import torch

    from microbench.launch import LaunchSpec, launch

    n = 1 << 22
    buf = torch.zeros(n, dtype=torch.int32, device="cuda")
    out = torch.zeros(n, dtype=torch.int32, device="cuda")
    m = _selftest(harness)
    for _ in range(3):
        buf.zero_()
        launch(m.kernel("mb_pdl_primary"), LaunchSpec(grid=264, block=256), buf, np.uint32(n))
        launch(m.kernel("mb_pdl_secondary"), LaunchSpec(grid=264, block=256, pdl=True), buf, out, np.uint32(n))
        idx = torch.arange(n, device="cuda", dtype=torch.int64)
        assert torch.equal(out.to(torch.int64), (idx * 3 + 2) & 0xFFFFFFFF)


def test_cooperative_launch_grid_sync(harness):
    import torch

    from microbench.launch import LaunchSpec, launch

    grid, block = harness.info.sm_count, 128
    n = grid * block
    data = torch.zeros(n, dtype=torch.int32, device="cuda")
    out = torch.zeros(n, dtype=torch.int32, device="cuda")
    launch(_selftest(harness, "selftest_coop.cu").kernel("mb_coop_probe"),
           LaunchSpec(grid=grid, block=block, cooperative=True), data, out)
    expect = (torch.arange(n, device="cuda") + 1) % n + 1
    assert torch.equal(out.to(torch.int64), expect)
