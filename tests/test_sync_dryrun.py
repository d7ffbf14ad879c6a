"""CPU dry run of the sync benchmarks: every run function end to end, with the kernels replaced
by Python emulations that read their parameter blocks and write their records exactly where
the CUDA code does (through the raw pointers, into CPU tensors), and a harness that reports a
fixed SM clock. It checks the plumbing (layouts, record parsing, checks, derivations, result
files), not the GPU. Emulated kernels that break their contract must be caught."""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
import torch

from microbench.constants import SPECS
from microbench.errors import CorrectnessError, SpinTimeoutError
from microbench.results import load

G = 132
MHZ = 1755.0


class FakeInfo:
    name = "NVIDIA H200"
    sm_count = G
    smem_per_block_optin = 232448
    smem_per_sm = 233472
    reserved_smem_per_block = 1024
    sm_clock_max_mhz = 1980
    l2_bytes = 62914560
    arch = "sm_90a"


class FakeHarness:
    device_index = 0

    def __init__(self):
        self.info = FakeInfo()

    def clocks(self):
        return {"sm_mhz": MHZ, "mem_mhz": 3201, "sm_max_mhz": 1980}


class FakeModule:
    def kernel(self, name):
        return types.SimpleNamespace(name=name)


def mem(ptr, dtype, n):
    dt = np.dtype(dtype)
    buf = (ctypes.c_char * (int(n) * dt.itemsize)).from_address(int(ptr))
    return np.frombuffer(buf, dtype=dt)


class Params:
    def __init__(self, layout, ptr):
        self.a = mem(ptr, np.uint64, layout.n)
        self.ix = layout.index

    def __getitem__(self, k):
        return int(self.a[self.ix[k]])


def trip(wd_ptr, what, addr, expected, seen, bound):
    from microbench.watchdog import fields

    f = fields()
    rec = mem(wd_ptr, np.uint64, f["FIELDS"])
    if rec[f["TRIPPED"]]:
        return
    rec[f["TRIPPED"]] = 1
    rec[f["WHAT"]] = what
    rec[f["ADDR"]] = addr
    rec[f["EXPECTED"]] = expected
    rec[f["SEEN"]] = seen
    rec[f["ELAPSED_NS"]] = bound


def emulate(state):
    from microbench.sync import runners as R

    broken = state["broken"]

    def pingpong(spec, p):
        P = Params(R.PP, p)
        W, C, S, Rn = P["warmup"], P["calib"], P["settle"], P["rounds"]
        nrec = C + S + Rn
        si, sr, k = P["sm_init"], P["sm_resp"], P["load_bytes"]
        F = R.PM["PM_FIELDS"]
        meta = mem(P["meta"], np.int64, 2 * F + 1)
        if sr == R.NONE:  # nobody answers: the initiator's first wait gives up
            trip(P["wd"], (R.SYNC_WAIT["SW_PONG"] << 24) | 0, P["pong"], P["base"] + 1, 0, P["bound_ns"])
            meta[R.PM["PM_STATUS"]] = 2
            return
        j = np.arange(nrec)
        fwd = 700 + 3 * abs(si - sr) + (P["ping"] // 128 % 2) * 60 + P["backoff_ns"] * 0.9 + (j % 5)
        back = 700 + 3 * abs(si - sr) + P["backoff_ns"] * 0.9 + (j % 3)
        loaded = j >= C
        if P["load_sides"] & 2:
            fwd = fwd + loaded * k / 64
            back = back + loaded * k / 160
        if P["byst_mode"] == R.BYST["BY_LOAD"]:
            fwd, back = fwd + loaded * k / 100, back + loaded * k / 100
        if P["byst_mode"] == R.BYST["BY_POLL"]:
            fwd, back = fwd + 300 / (1 + P["byst_backoff_ns"] / 32), back + 300 / (1 + P["byst_backoff_ns"] / 32)
        off = 10_000 + 17 * sr
        t0 = 1_000_000 + np.arange(nrec) * 5000.0
        out = mem(P["out"], np.int64, 4 * nrec)
        out[0:2 * nrec:2] = t0
        out[1:2 * nrec:2] = t0 + fwd + 10 + back
        out[2 * nrec::2] = t0 + fwd + off
        out[2 * nrec + 1::2] = t0 + fwd + off + 10
        for s, sm in ((0, si), (1, sr)):
            m = meta[s * F:(s + 1) * F]
            m[R.PM["PM_SMID"]] = sm + (1 if "pp_smid" in broken and s == 1 else 0)
            m[R.PM["PM_CYC_START"]] = 1_000_000
            m[R.PM["PM_CYC_END"]] = 1_000_000 + nrec * 5000
            m[R.PM["PM_GT_START"]] = 0
            m[R.PM["PM_GT_END"]] = int(nrec * 5000 / MHZ * 1e3)
            m[R.PM["PM_POLLS"]] = Rn * 3
            if (P["load_sides"] >> s) & 1:
                m[R.PM["PM_LOAD_BYTES"]] = 50 * k
                m[R.PM["PM_LOAD_NS"]] = 2_000_000
            m[R.PM["PM_STATUS"]] = 1
        if P["byst_mode"] != R.BYST["BY_NONE"]:
            meta[2 * F] = G - 2

    def fence(spec, p):
        P = Params(R.FC, p)
        nb, k, reps, loops = spec.grid, P["load_bytes"], P["reps"], P["loops"]
        nk = R.FK["FK_KINDS"]
        state["fence_grids"].append(nb)
        if P["pin_claim"]:  # pinned: the block on SM pin_smid runs as block 0 unless claimed already
            claim = mem(P["pin_claim"], np.int32, 1)
            if "fence_pin_lost" in broken or claim[0]:
                return  # no block claimed the SM: block 0's records stay as reset
            claim[0] = 1
            nb = 1
        out = mem(P["out"], np.int64, nb * nk * 2 * loops).reshape(nb, nk, 2, loops)
        for kind in range(nk):
            per = 0 if kind == 0 else (100 + 50 * kind + k / 100)
            out[:, kind, 0, :] = reps * (12 + per)
            out[:, kind, 1, :] = reps * (20 + per * 1.2)
        meta = mem(P["meta"], np.int64, nb * R.FMETA["FM_FIELDS"]).reshape(nb, -1)
        meta[:, R.FMETA["FM_SMID"]] = np.arange(nb)
        if P["pin_claim"]:
            meta[0, R.FMETA["FM_SMID"]] = P["pin_smid"] + ("fence_pin_wrong_sm" in broken)
        gt = int(5_000_000 / MHZ * 1e3)
        meta[:, R.FMETA["FM_LOAD_BYTES"]] = 100 * k
        # the loader runs from before the timed loops to after them; stopped early (a tripped
        # watchdog word) it lands its first copies and drains
        meta[:, R.FMETA["FM_LOAD_NS"]] = 3_000 if "fence_loader_stopped" in broken else gt + 2_000
        meta[:, R.FMETA["FM_CYC"]] = 5_000_000
        meta[:, R.FMETA["FM_GT"]] = gt
        meta[:, R.FMETA["FM_STATUS"]] = 1

    def publish(name, spec, p):
        P = Params(R.PB, p)
        N, pat, nb, stride, C = P["n"], P["pattern"], P["bytes"], P["stride"], P["copies"]
        W, Rn, base, brk = P["warmup"], P["rounds"], P["base"], P["break"]
        ag = mem(P["agents"], np.uint64, N * R.AG["AG_FIELDS"]).reshape(N, -1)
        mode = name[len("sync_pub_"):-4]
        rule = R.PUB_RULE[mode]
        nw = nb // 4
        pairs = {R.PAT["alltoall"]: [(s, r) for s in range(N) for r in range(N) if s != r],
                 R.PAT["ping"]: [(0, 1), (1, 0)], R.PAT["stream"]: [(0, 1)]}[pat]
        meta = mem(P["meta"], np.int64, N * R.PBM["PBM_FIELDS"]).reshape(N, -1)
        if P["src"]:
            src = mem(P["src"], np.uint32, (W + Rn) * N * N * nw).reshape(W + Rn, N, N, nw)
            dst = mem(P["dst"], np.uint32, (W + Rn) * N * N * nw).reshape(W + Rn, N, N, nw)
            for it in range(W + Rn):
                for s, r in pairs:
                    raw = src[it, s, r]
                    val = raw
                    if rule is not None:
                        h = raw.view(rule.dtype)
                        if brk == R.BRK["skip_encode"] and (h == rule.sentinel).any():
                            e = int(np.nonzero(h == rule.sentinel)[0][0]) * (rule.bits // 8)
                            slot = int(ag[r, R.AG["AG_SLOTS"]]) + (s * C + (base + it) % C) * stride
                            mem(slot, np.uint32, nw)[:] = raw
                            trip(P["wd"], (R.SYNC_WAIT["SW_SLOT"] << 24) | it, slot + e, rule.fill_word, rule.fill_word,
                                 P["bound_ns"])
                            meta[r, R.PBM["PBM_STATUS"]] = 2
                            return
                        if brk != R.BRK["skip_encode"]:
                            val = rule.encode(h).view(np.uint32)
                    val = val.copy()
                    if brk == R.BRK["corrupt"] and it == Rn // 2 and s == 0:
                        val[0] ^= 0x10000
                    if "pub_data" in broken and it == 1:
                        val[-1] ^= 1
                    dst[it, s, r] = val
        cyc = {"fence_flag": 3200, "release_flag": 3000, "sentinel_f32": 2100, "sentinel_bf16": 2150}[mode]
        cyc = (cyc - (300 if C == 3 else 0) + nb / 6) if nb else 2400
        if pat == R.PAT["stream"]:
            cyc = 400 + nb / (60 if P["nosync"] else 40)
        if pat == R.PAT["alltoall"]:
            cyc = 4000 + nb * N / 30
        out = mem(P["out"], np.int64, N * Rn).reshape(N, Rn)
        for a in range(N):
            start = 5000 * (a + 1)
            out[a] = start + np.cumsum(cyc + (np.arange(Rn) % 7) * 3)
            meta[a, R.PBM["PBM_SMID"]] = ag[a, R.AG["AG_SM"]]
            meta[a, R.PBM["PBM_STATUS"]] = 1
            meta[a, R.PBM["PBM_CYC_START"]] = start
            meta[a, R.PBM["PBM_CYC_END"]] = out[a, -1]
            meta[a, R.PBM["PBM_GT_START"]] = 0
            meta[a, R.PBM["PBM_GT_END"]] = int((out[a, -1] - start) / MHZ * 1e3)

    def grid(spec, p):
        P = Params(R.BR, p)
        mode, stops, d = P["mode"], P["stops"], P["d"]
        cost = {R.BM["none"]: 40, R.BM["gridsync"]: 4000, R.BM["atomic"]: 3000}.get(mode, 1500 + 30 * d)
        out = mem(P["out"], np.int64, G * R.BO["BO_FIELDS"]).reshape(G, -1)
        out[:, R.BO["BO_SMID"]] = np.arange(G)
        out[:, R.BO["BO_CYCLES"]] = stops * cost + np.arange(G)
        out[:, R.BO["BO_GT_START"]] = 0
        out[:, R.BO["BO_GT_END"]] = int(stops * cost / MHZ * 1e3)
        out[:, R.BO["BO_STATUS"]] = 1
        if P["verify"] and (mode == R.BM["depflags_nowait"] or "grid_stale" in broken):
            e = mem(P["errors"], np.int32, 4)
            e[:] = [7, 1, 4, 2]

    def launch(kernel, spec, *args, persistent=False, stream=None):
        n = kernel.name
        state["launches"] += 1
        state["params"].append(int(args[0]) if isinstance(args[0], int) else None)
        if n.endswith("heat"):
            return
        if n == "sync_poll_load":
            P = Params(R.PL, args[0])
            na, ch = P["naddr"], P["chain"]
            mem(P["smids"], np.int32, G)[:] = np.arange(G)
            out = mem(P["out"], np.uint32, G * R.LOAD_KINDS["LK_KINDS"] * na).reshape(G, -1, na)
            base = np.array([600, 650, 560, 600, 580, 40, 550])[None, :, None]
            out[:] = (base + (np.arange(na)[None, None, :] % 2) * 80 + (np.arange(G)[:, None, None] % 8) * 5) * ch
        elif n == "sync_cluster_probe":
            c, nclu = spec.cluster, spec.grid
            o = args[0].numpy()
            for i in range(nclu):
                g = i % 7
                for r in range(c):
                    o[i * c + r] = (g * 17 + ((i // 7) * c + r) % 17) % G | (r << 16)
        elif n.startswith("sync_pingpong_"):
            pingpong(spec, args[0])
        elif n == "sync_fence_cost":
            fence(spec, args[0])
        elif n.startswith("sync_pub_"):
            publish(n, spec, args[0])
        elif n == "sync_grid_wait":
            grid(spec, args[0])
        else:
            raise AssertionError(f"no emulation for {n}")

    return launch


@pytest.fixture
def dry(monkeypatch, tmp_path):
    import microbench.launch as L
    from microbench.sync import bench as B
    from microbench.sync import runners as R

    monkeypatch.setenv("MEGABENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(R, "DEVICE", "cpu")
    monkeypatch.setattr(R, "module", lambda name, arch: FakeModule())
    monkeypatch.setattr(R, "_sync", lambda: None)
    monkeypatch.setattr(R, "random_src", lambda nbytes, seed: torch.zeros(1024, dtype=torch.int32))
    monkeypatch.setattr(R.time, "sleep", lambda s: None)
    state = {"broken": set(), "launches": 0, "fence_grids": [], "params": []}
    fake_launch = emulate(state)
    monkeypatch.setattr(L, "launch", fake_launch)
    monkeypatch.setattr(R, "launch", fake_launch)  # runners import launch at their top
    yield types.SimpleNamespace(h=FakeHarness(), B=B, R=R, state=state)


def test_every_sync_constant_is_derived_end_to_end(dry):
    B, h = dry.B, dry.h
    results = {}
    for name, fn in B.BENCHMARKS.items():
        results[name] = fn(h, quick=True, save=True)
    for spec in SPECS:
        if not spec.benchmark.startswith("sync."):
            continue
        d = results[spec.benchmark].derived.get(spec.derived_key)
        assert d is not None, f"{spec.benchmark} did not derive {spec.derived_key}"
        assert d.rule and np.isfinite(d.value) and d.spread is not None, spec.name
        if spec.integer:
            assert float(d.value).is_integer(), (spec.name, d.value)
    r = results
    # the emulated latencies make every rule decide something specific
    assert 0.3e-6 < r["sync.flags"].derived["flag_latency_s"].value < 0.6e-6
    sb = r["sync.flags"].derived["spin_bound_ns"].value
    assert 1_000_000 <= sb < 10_000_000 and sb % 1000 == 0  # 1000 x the slowest emulated round trips (~3.6 us)
    assert r["sync.publish"].derived["sentinel_pays"].value == 1
    assert r["sync.barriers"].derived["sync_stop_cost_s"].value > 0
    for res in results.values():
        assert all(s.timer == "clock64" for s in res.series)
        assert all(s.clocks["sm_mhz_used"] == MHZ for s in res.series)
    # the offset-calibrated split gives the loaded poller its extra delay, not the writer
    fl = r["sync.flags"]
    pol = fl.series_named("bulk/poller_loaded/196608B").summary.median
    wri = fl.series_named("bulk/writer_loaded/196608B").summary.median
    assert pol > wri > fl.series_named("bulk/writer_loaded/0B").summary.median
    from microbench.results import find

    for name in results:
        files = find(name)
        assert files and load(files[-1]).derived.keys() == results[name].derived.keys()


def test_broken_emulations_are_caught(dry):
    R, h = dry.R, dry.h
    pp = R.PingPong(h)
    dry.state["broken"].add("pp_smid")
    with pytest.raises(CorrectnessError, match="responder status ST_OK, SM 2 .wanted SM 1"):
        pp.run([R.PPConfig(0, 1)])
    dry.state["broken"].clear()
    with pytest.raises(SpinTimeoutError, match="pong of round 0"):
        R.PingPong(h).run([R.PPConfig(0, R.NONE)])
    pb = R.Publish(h)
    cfg = R.PubConfig("sentinel_f32", "ping", (3, 70), 256)
    pb.verify(pb.setup(cfg), 8, seed=1)
    dry.state["broken"].add("pub_data")
    with pytest.raises(CorrectnessError, match="words wrong"):
        pb.verify(pb.setup(cfg), 8, seed=1)
    dry.state["broken"].clear()
    with pytest.raises(CorrectnessError, match="words wrong from agent 0 to agent 1"):
        pb.verify(pb.setup(cfg), 8, seed=1, brk="corrupt")
    br = R.Barriers(h)
    br.verify("depflags", d=4)
    with pytest.raises(CorrectnessError, match="stale reads"):
        br.verify("depflags_nowait", d=4)


@pytest.mark.parametrize("mode", ["sentinel_f32", "sentinel_bf16"])
def test_unencoded_sentinel_times_out_naming_slot_and_value(dry, mode):
    R, h = dry.R, dry.h
    pb = R.Publish(h)
    cfg = R.PubConfig(mode, "alltoall", (5, 40, 80, 120), 1024)
    st = pb.setup(cfg)
    fill = R.PUB_RULE[mode].fill_word
    with pytest.raises(SpinTimeoutError, match=rf"sentinel slot of round \d+ \[slot of receiver agent \d \(SM \d+\) "
                                               rf"from sender \d \(SM \d+\), copy \d, byte \d+ \(element \d+\); it now "
                                               rf"holds 0x[0-9a-f]*(ffff|80000000)"):
        pb.verify(st, 8, seed=2, brk="skip_encode")
    assert str(fill) in str(pb.wd.rec.tolist())


def test_gate_cases_average_placements_and_pin_the_fence_probe(dry):
    """The pytest cases the A/B gate times: ping-pong and publish launch once on each of
    PLACEMENTS separately allocated copies per sample (batch), and the fence probe is one block
    pinned to the first SM, its launch a block per SM."""
    B, h, st = dry.B, dry.h, dry.state
    by = {c.name.split("/")[1]: c for c in B.cases()}
    for kind in ("pingpong", "publish"):
        case = by[kind]
        assert case.name.endswith(f"/{B.PLACEMENTS}flags") and case.params["placements"] == B.PLACEMENTS
        p = case.prepare(h)
        assert p.batch == B.PLACEMENTS
        st["params"].clear()
        p.before_each()
        for _ in range(p.batch):
            p.launch()
        assert len(set(st["params"])) == B.PLACEMENTS, f"{kind}: a sample must launch every placement once"
        st["params"].clear()
        p.launch()
        p.before_each()
        for _ in range(p.batch):  # a sample that starts mid-cycle still covers each copy once
            p.launch()
        assert len(set(st["params"][1:])) == B.PLACEMENTS
    fence = by["fences"]
    assert "1blk_pinned" in fence.name
    st["fence_grids"].clear()
    p = fence.prepare(h)
    assert st["fence_grids"][-1] == G and p.metrics["smid"] == 0  # the dry run's SMs are 0..131
    assert p.before_each is not None and p.batch == 1


def test_gate_cases_keep_their_runners_alive(dry, monkeypatch):
    """A prepared case must keep alive everything its launches touch. Its parameter block points
    at the runner's watchdog record, loader source and data; a case that kept only its launch
    freed the runner, and in the gate's workers the fence probe's loader then read a reused
    watchdog word as tripped and stopped (runners.KEEP_NOTE)."""
    import gc
    import weakref

    B, R, h = dry.B, dry.R, dry.h
    made = []
    for cls in (R.PingPong, R.Fences, R.Publish, R.Barriers):
        init = cls.__init__

        def tracked(self, *a, _init=init, **k):
            _init(self, *a, **k)
            made.append(weakref.ref(self))
        monkeypatch.setattr(cls, "__init__", tracked)
    for case in B.cases():
        made.clear()
        p = case.prepare(h)
        gc.collect()
        assert made, case.name
        dead = sum(r() is None for r in made)
        assert dead == 0, f"{case.name}: {dead} of {len(made)} runners freed while the prepared case lives"
        p.launch()  # the emulated kernel reads the runner's records through the parameter block
        del p


@pytest.mark.parametrize("broken, match", [("fence_pin_lost", "status FS_NOT_RUN .no block claimed"),
                                           ("fence_pin_wrong_sm", "ran on SM 6, not 5"),
                                           ("fence_loader_stopped", "loader ran 3.0 us of the .* not timed with loads")])
def test_pinned_fence_probe_checks_its_sm(dry, broken, match):
    R, h = dry.R, dry.h
    go, reset, check = R.Fences(h).prepared_pinned(5, 4096, 16, 2)
    reset()
    go()
    check()  # the emulation runs the block on SM 5
    dry.state["broken"].add(broken)
    reset()
    go()
    with pytest.raises(CorrectnessError, match=match):
        check()
