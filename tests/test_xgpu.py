"""Cross-GPU microbenchmarks without a GPU: the clock and stop analysis, the collectives' bit-exact
references, the set-up (torchrun environment, multicast switches, peer-buffer exchange), the
kernels' compile and layouts, and the result assembly from synthetic stamps."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from microbench.errors import MegabenchError
from microbench.xgpu import analysis as A
from microbench.xgpu import world as W


# ------------------------------------------------------------------ clocks
def _exchanges(n, offset_ns, step, rng, fwd=1150.0, back=1150.0, jitter=60.0):
    t = np.cumsum(rng.uniform(2_000, 4_000, n)) + 1e9  # true send times
    a = fwd + rng.exponential(jitter, n)
    b = back + rng.exponential(jitter, n)
    q = lambda x: np.floor(x / step) * step  # noqa: E731 - a timer that advances in whole steps
    return q(t), q(t + a + b), q(t + a + offset_ns)


def test_exchange_offset_recovers_a_quantised_offset():
    rng = np.random.default_rng(0)
    t0, t1, s = _exchanges(4000, 33_800.3, 256, rng)
    o = A.exchange_offset(t0, t1, s)
    assert abs(o.offset_ns - 33_800.3) < 40, o  # well below the 256 ns step: the mean dithers
    assert o.step_ns == 256
    assert 1100 < o.error_ns < 1300 and o.kept == 2000 and o.total == 4000


def test_exchange_offset_bias_stays_within_its_error_bound():
    rng = np.random.default_rng(1)
    t0, t1, s = _exchanges(2000, -5_000.0, 32, rng, fwd=400.0, back=1900.0)  # very unequal trips
    o = A.exchange_offset(t0, t1, s)
    assert abs(o.offset_ns - (-5_000.0)) <= o.error_ns
    assert abs(o.offset_ns - (-5_000.0)) > 500  # the asymmetry shows: the bound is not decoration


def test_exchange_offset_refuses_bad_input():
    with pytest.raises(ValueError, match="4 exchanges"):
        A.exchange_offset([0, 1], [2, 3], [1, 2])
    with pytest.raises(ValueError, match="ended before"):
        A.exchange_offset([10, 0, 0, 0], [5, 1, 1, 1], [7, 1, 1, 1])
    with pytest.raises(ValueError, match="keep"):
        A.exchange_offset([0] * 4, [1] * 4, [0] * 4, keep=0)


def test_timer_step():
    assert A.timer_step_ns(np.array([0, 512, 1024]), np.array([256 * 7])) == 256
    assert A.timer_step_ns(np.array([64, 96, 160])) == 32
    assert A.timer_step_ns(np.array([5, 5])) == 0


def test_drift_and_one_way():
    assert A.drift_ppm(1_000.0, 3_000.0, 10.0) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        A.drift_ppm(0, 1, 0)
    ow = A.one_way_ns(np.array([[100, 2100], [0, 4000]]), 2000.0)
    assert ow.tolist() == [500.0, 1000.0]
    with pytest.raises(ValueError, match="MHz"):
        A.one_way_ns(np.array([[0, 1]]), 0)


def test_stops_spread_after_offsets():
    # rank 1's clock runs 10 us ahead; its last block arrives 300 ns after rank 0's at stop 0
    arrive = np.zeros((2, 2, 3))
    arrive[0, 0] = [1000, 1100, 1200]
    arrive[1, 0] = [11_000, 11_400, 11_500]
    arrive[0, 1] = [5000, 5000, 5900]
    arrive[1, 1] = [15_000, 15_100, 15_200]
    gpu = np.zeros((2, 2, 2))
    gpu[0, :, 0], gpu[0, :, 1] = [1250, 5950], [3000, 8000]
    gpu[1, :, 0], gpu[1, :, 1] = [11_550, 15_250], [12_900, 17_100]
    st = A.stops(arrive, gpu, [0.0, 10_000.0])
    assert st.gpu_spread_ns.tolist() == [300.0, 700.0]
    assert st.block_spread_ns.tolist() == [500.0, 900.0]
    assert st.slowest.tolist() == [1, 0]
    assert st.wait_ns.tolist() == [[1750.0, 2050.0], [1350.0, 1850.0]]
    assert st.local_spread_ns.tolist() == [[200.0, 900.0], [500.0, 200.0]]
    with pytest.raises(ValueError, match="shapes"):
        A.stops(arrive, gpu[:, :1], [0.0, 0.0])


# ------------------------------------------------------------------ collective references
def test_allreduce_reference_canonicalises_and_keeps_rank_order():
    f = lambda *v: np.array(v, dtype=np.float32).view(np.uint32)  # noqa: E731
    neg0 = np.uint32(0x80000000)
    p = np.stack([f(1e8, 0.0, 1.0), f(1.0, 0.0, 2.0), f(-1e8, 0.0, 3.0)])
    p[:, 1] = neg0  # every rank's element 1 is -0.0: the rule stores +0.0, so the sum is +0.0
    r = A.allreduce_reference(p)
    assert r[1] == 0
    assert r[0] == f(0.0)[0]  # (1e8 + 1) - 1e8 in fp32, rank order; 1 + (1e8 - 1e8) would give 1
    assert r[2] == f(6.0)[0]


def test_allgather_reference():
    p = np.array([[0xFFFF, 0x7FC0, 0xFFC1], [0x0000, 0x8000, 0xFFFF]], dtype=np.uint16)
    assert A.allgather_reference(p).tolist() == [[0x7FC0, 0x7FC0, 0xFFC1], [0x0000, 0x8000, 0x7FC0]]


def test_finite_payload_has_the_special_classes_and_no_nan():
    x = A.finite_f32_payload(np.random.default_rng(3), 20_000)
    f = x.view(np.float32)
    assert np.isfinite(f).all()
    assert (x == 0x80000000).sum() > 1000 and (x == 0).sum() > 1000
    assert ((x & 0x7F800000) == 0).sum() - (x == 0).sum() - (x == 0x80000000).sum() > 1000  # subnormals


def test_nccl_differences_explains_only_the_zero_rule():
    neg0, pos0 = 0x80000000, 0
    payloads = np.array([[neg0, neg0, 0x3F800000], [neg0, pos0, 0x40000000]], dtype=np.uint32)
    ours = np.array([pos0, pos0, 0x40400000], dtype=np.uint32)
    nccl = np.array([neg0, pos0, 0x40400001], dtype=np.uint32)  # last one differs for another reason
    d = A.nccl_differences(ours, nccl, payloads)
    assert d == {"elements": 3, "differ": 2, "differ_by_slot_rule": 1, "differ_otherwise": 1,
                 "max_rel_otherwise": pytest.approx(2**-22 / 3, rel=0.01)}  # one ulp at 3.0


# ------------------------------------------------------------------ set-up
def test_multicast_switches():
    env = {}
    assert W.check_multicast_off(env) == W.MULTICAST_OFF and env == W.MULTICAST_OFF
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert W.check_multicast_off(env) == {}
    with pytest.raises(W.WorldError, match="NCCL_NVLS_ENABLE='1'"):
        W.check_multicast_off({"NCCL_NVLS_ENABLE": "1"})


def test_world_from_env():
    ok = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert W.world_from_env(ok, gpu_count=2) == W.World(1, 2, 1)
    with pytest.raises(W.WorldError, match="megabench xgpu"):
        W.world_from_env({})
    with pytest.raises(W.WorldError, match="2 or more"):
        W.world_from_env({**ok, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    with pytest.raises(W.WorldError, match="shows 1 GPU"):
        W.world_from_env(ok, gpu_count=1)
    with pytest.raises(W.WorldError, match="several nodes"):
        W.world_from_env({**ok, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, gpu_count=2)
    with pytest.raises(W.WorldError, match="integers"):
        W.world_from_env({**ok, "RANK": "x"})


class FakeIpc:
    """Allocations are integers; a handle names its owner's pointer; open maps it to a new address."""

    def __init__(self, rank):
        self.rank, self.calls = rank, []

    def alloc(self, n):
        return 0x10_0000 * (self.rank + 1)

    def handle(self, ptr):
        return ptr.to_bytes(8, "little") + bytes(56)

    def open(self, data):
        assert len(data) == W.IPC_HANDLE_BYTES
        self.calls.append(("open", int.from_bytes(data[:8], "little")))
        return 0x7000_0000 + int.from_bytes(data[:8], "little")

    def close(self, p):
        self.calls.append(("close", p))

    def free(self, p):
        self.calls.append(("free", p))


def _threads(n, fn):
    """Run fn(rank, gather) on n threads with an all-gather between them."""
    box, bar, out, errs = [None] * n, threading.Barrier(n), [None] * n, []

    def gather_for(r):
        def g(obj):
            box[r] = obj
            bar.wait()
            got = list(box)
            bar.wait()
            return got
        return g

    def body(r):
        try:
            out[r] = fn(r, gather_for(r))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errs.append(e)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    return out, errs


def test_peer_buffer_maps_every_rank():
    def make(r, g):
        ipc = FakeIpc(r)
        b = W.PeerBuffer(W.World(r, 3, r), 4096, ipc=ipc, gather=g)
        ptrs = list(b.ptrs)
        b.close()
        return ptrs, ipc.calls

    out, errs = _threads(3, make)
    assert not errs
    for r, (ptrs, calls) in enumerate(out):
        assert ptrs[r] == 0x10_0000 * (r + 1)  # its own allocation
        for d in range(3):
            if d != r:
                assert ptrs[d] == 0x7000_0000 + 0x10_0000 * (d + 1)
        assert [c[0] for c in calls] == ["open", "open", "close", "close", "free"]


def test_peer_buffer_refuses_out_of_step_calls():
    def make(r, g):
        return W.PeerBuffer(W.World(r, 2, r), 4096 if r == 0 else 8192, ipc=FakeIpc(r), gather=g)

    _, errs = _threads(2, make)
    assert len(errs) == 2 and all(isinstance(e, W.WorldError) and "different peer-buffer sizes" in str(e) for e in errs)
    with pytest.raises(ValueError, match="multiple of 4"):
        W.PeerBuffer(W.World(0, 2, 0), 6, ipc=FakeIpc(0), gather=lambda o: [o])


# ------------------------------------------------------------------ kernels and layouts
def test_kernels_compile_for_sm90a():
    from microbench.xgpu import runners as X

    m = X.module("sm_90a")
    names = {"xgpu_allreduce_f32", "xgpu_allgather_bf16", "xgpu_gt_pingpong", "xgpu_host_anchor", "xgpu_stops"}
    assert names <= set(m.resources)
    for k in ("xgpu_gt_pingpong", "xgpu_host_anchor", "xgpu_stops"):
        m.check_limits(k, max_spill_bytes=0)  # the timed single-thread loops and the stops kernel never spill
    for L in (X.XC, X.XT, X.XH, X.XS):
        assert L.n == len(L.index) > 5


def test_describe_what_names_the_wait():
    from microbench.xgpu import runners as X

    assert "rank 1's flag for stop 7" in X.describe_what((6 << 24) | (1 << 16) | 7)
    assert "sender 2" in X.describe_what((1 << 24) | (2 << 16) | 5)
    assert X.describe_what(99 << 24).startswith("unknown")


def test_blocks_for():
    from microbench.xgpu import runners as X

    assert X.blocks_for(1024) == 1 and X.blocks_for(64 * 1024) == 8 and X.blocks_for(1 << 20) == 32
    assert X.blocks_for(48 * 1024) == 6
    with pytest.raises(ValueError):
        X.blocks_for(1000)


# ------------------------------------------------------------------ launcher and configurations
def test_launcher_refuses_without_two_gpus(monkeypatch):
    from microbench.xgpu import launcher

    monkeypatch.setattr(launcher, "gpus_or_reason", lambda: (1, "1 GPU on this node; the cross-GPU benchmarks "
                                                                "need 2 or more"))
    with pytest.raises(MegabenchError, match="need 2 or more"):
        launcher.run()
    cmd = launcher.command(4, full=True, save=False, summary="s.json")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[-4:] == ["--full", "--no-save", "--summary", "s.json"]


def test_ping_configs():
    from microbench.xgpu import bench as B

    cs = B.ping_configs(W.World(0, 3, 0), [[0, 1, 2], [5, 6], [8, 9]], quick=True)
    names = [c.name for c in cs]
    assert len(set(names)) == len(names)
    assert {c.peer for c in cs} == {1, 2}
    assert not any(c.load_bytes for c in cs if c.peer == 2)  # loaded cases between ranks 0 and 1 only
    peer_load = [i for i, c in enumerate(cs) if c.load_from_peer]
    assert peer_load and peer_load == list(range(peer_load[0], peer_load[0] + len(peer_load)))  # together, after local


# ------------------------------------------------------------------ result assembly from synthetic stamps
def _fake_run(n=2):
    from microbench.results import Env

    env = Env.capture(None)
    return SimpleNamespace(w=W.World(0, n, 0), quick=True, notes=["synthetic"], gpus=[], info=SimpleNamespace(sm_count=132),
                           common_params=lambda: {"ranks": n}, env=lambda: env)


def test_results_assemble_and_round_trip(tmp_path):
    from microbench.results import load
    from microbench.xgpu import bench as B
    from microbench.xgpu import runners as X

    rng = np.random.default_rng(5)
    run = _fake_run()
    runs = []
    for c in B.ping_configs(run.w, [[0, 1], [2, 3]], quick=True):
        k = c.nrec
        send = np.cumsum(rng.integers(4000, 6000, k))
        # every SM pulling over the link: the flag waits behind what is in flight (1 ns per 100 B)
        extra = c.load_bytes * 131 // 100 * 2 * 1980 // 1000 if (c.byst_sides == 3 and c.load_from_peer) else 0
        init = np.stack([send, send + 2 * 2600 + extra + rng.integers(0, 50, k)], 1)
        resp = np.stack([send + 2600 + 10_000, send + 2620 + 10_000], 1)
        runs.append(X.XPPRun(c, init, resp, 1e6, 2e6, (10, 10), (c.load_bytes, c.load_bytes)))
    fl = B.flags_result(run, runs, [1980.0, 1980.0], [1980.0, 1980.0], 5.5e-7)
    assert fl.derived["flag_latency_gpu_to_gpu_s"].value == pytest.approx(2600 / 1980e6, rel=0.02)
    assert "flag_latency_gpu_to_gpu_loaded_s" in fl.derived
    assert fl.derived["poll_delay_per_inflight_byte_gpu_to_gpu_s"].value == pytest.approx(1e-11, rel=0.02)
    coll_runs, checks, nccl = {}, {}, {}
    for op in ("allreduce", "allgather"):
        for nb in (1024, 65536):
            rc = rng.uniform(4000, 5000, 50)
            phases = np.stack([rc * 0.1, rc * 0.6, rc * 0.3], 1)
            coll_runs[(op, nb)] = X.CollRun(op, nb, X.blocks_for(nb), rc, phases, 1e5, 2e5, None)
            checks[(op, nb)] = {"verified_rounds": 3, "nccl": {"differ": 0}}
            nccl[(op, nb)] = {"times": {"graph": rng.uniform(9e-6, 11e-6, 5), "eager": rng.uniform(2e-5, 3e-5, 5)},
                              "warnings": []}
    runs8 = {k: X.CollRun(v.op, v.nbytes, v.blocks, v.round_cycles * 0.8, v.phase_cycles * 0.8, 1e5, 2e5, None)
             for k, v in coll_runs.items()}
    co = B.collectives_result(run, coll_runs, checks, nccl, 1.3e-6, 3.8e11, [1980.0, 1980.0],
                              {"sentinel8f4": (runs8, checks)})
    assert co.derived["xgpu_sentinel_allreduce_speedup"].value == pytest.approx(10e-6 / (4500 / 1980e6), rel=0.1)
    assert co.derived["xgpu_sentinel8f4_gain"].value == pytest.approx(1.25)
    assert co.derived["xgpu_sentinel_wait_share"].value == pytest.approx(0.6, rel=0.05)
    assert {s.params["impl"] for s in co.series} == {"sentinel (2 copies)", "sentinel (8 copies, fence every 4 rounds)",
                                                      "NCCL graph", "NCCL eager"}

    def offs(mu):
        return A.exchange_offset(np.arange(8) * 3000.0, np.arange(8) * 3000.0 + 2304, np.arange(8) * 3000.0 + 1152 + mu)

    c0 = {"host_s": 0.0, "pair": {1: offs(33_792)}, "host": [offs(-58_000), offs(-24_000)]}
    c1 = {"host_s": 10.0, "pair": {1: offs(34_304)}, "host": [offs(-58_400), offs(-24_000)]}
    arrive = rng.uniform(0, 300, (2, 20, 4)) + np.array([0, 33_792])[:, None, None]
    gpu = np.stack([arrive.max(2), arrive.max(2) + 2000], -1)
    stop_runs = {"hbm": X.StopsRun(arrive, arrive + 2500, gpu, 4), "spin": X.StopsRun(arrive, arrive + 2500, gpu, 4)}
    ck = B.clocks_result(run, c0, c1, stop_runs, {1: offs(33_792)}, 1.3e-6)
    assert ck.derived["gt_drift_r1_ppm"].value == pytest.approx(512 / 10e9 * 1e6)
    assert 0 < ck.derived["gpu_drift_s"].value < 600e-9
    mx = ck.derived["gpu_drift_max_s"]  # the study's "up to" is a maximum: derived beside the p99, with the step
    assert mx.value >= ck.derived["gpu_drift_s"].value and mx.spread[0] <= mx.value <= mx.spread[1]
    assert "step" in mx.note
    for res in (fl, co, ck):
        p = res.save(tmp_path)
        back = load(p)
        assert back.benchmark == res.benchmark and len(back.series) == len(res.series)


def test_local_cases_keep_copies_in_step():
    from microbench.xgpu import local

    cs = local.cases()
    assert len({c.name for c in cs}) == len(cs) == 6
    # every timed launch starts on copy 0 and the fence schedule, and leaves every slot empty
    assert all(c.params["rounds"] % c.params["copies"] == 0 for c in cs)
    with pytest.raises(ValueError, match="multiple"):
        local.collective_case("allreduce", 1024, rounds=100, copies=8, fence_every=4)


def test_study_figures_come_from_the_one_copy():
    from microbench.xgpu import bench as B

    assert B._study("sync.flag_gpu_to_gpu") == "about 1.9 us"
    assert B._study("xgpu.poll_behind_bulk") == "1.0-2.6 us"
    assert B._study("sync.gpu_drift") == "about 4.0 us"
    assert "unavailable" in B._study("no.such.figure")


def test_rank0_clock_falls_back_and_warns():
    from microbench.errors import CorrectnessError
    from microbench.xgpu import bench as B

    assert B._rank0_mhz(1980.0, [(1_980_000, 1_000_000)]) == (1980.0, ())
    mhz, warn = B._rank0_mhz(0.0, [(1_755_000, 1_000_000), (10, 5)])  # the short span is ignored
    assert mhz == pytest.approx(1755.0) and "in-kernel" in warn[0]
    assert "disagree" in B._rank0_mhz(1980.0, [(1_500_000, 1_000_000)])[1][0]
    with pytest.raises(CorrectnessError, match="no SM clock"):
        B._rank0_mhz(0.0, [(10, 5)])


def test_reuse_schedules():
    from microbench.xgpu import runners as X

    for copies, every in ((2, 1), (3, 1), (4, 2), (8, 4), (8, 2)):
        X.check_reuse(copies, every, 8)
    for copies, every in ((3, 2), (2, 2), (6, 4), (16, 8), (1, 1)):
        with pytest.raises(ValueError, match="reuse rule"):
            X.check_reuse(copies, every, 8)


def test_collective_expected_shapes_and_rules():
    rng = np.random.default_rng(9)
    pay = rng.integers(0, 256, (2, 3, 16), dtype=np.uint8)  # 2 ranks, 3 rounds, 16 bytes
    ref, got = A.collective_expected("allreduce", pay, np.zeros(3 * 16, np.uint8))
    assert ref.shape == got.shape == (3, 4)
    assert (ref[1] == A.allreduce_reference(pay[:, 1].view(np.uint32))).all()
    ref, got = A.collective_expected("allgather", pay, np.zeros(3 * 2 * 16, np.uint8))
    assert ref.shape == got.shape == (3, 2, 8)
    assert (ref[2, 1] == A.allgather_reference(pay[1, 2].view(np.uint16))).all()
    with pytest.raises(ValueError, match="unknown collective"):
        A.collective_expected("scatter", pay, np.zeros(48, np.uint8))
