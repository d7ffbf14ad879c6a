"""Synchronisation and clocks between the GPUs of one node (the study's figures for them:
reports/paper_figures.json, sync.flag_gpu_to_gpu, xgpu.poll_behind_bulk, sync.gpu_drift). One process per GPU under torchrun; rank 0 writes results.

- xgpu.flags: one-way flag latency between an SM of rank 0 and an SM of another rank by
  ping-pong (microbench/sync/flags.cu with one role per GPU; st.release.sys writes into the
  poller's memory, ld.acquire.sys polls, or relaxed polls and one acquire), over several SM
  pairs; then with bulk copies in flight: k bytes of cp.async.bulk on the pair's SM of either
  side, read from local HBM or from the other GPU (over NVLink), and every other SM of a side
  streaming bulk copies (local or peer source). Round trip / 2 on rank 0's %clock64; for
  pair-SM load the two trips are split with an offset calibrated on idle rounds. Bound: the
  same protocol between two SMs of one GPU (sync.flags' flag_latency_s).
- xgpu.collectives: sentinel all-reduce (fp32, -0.0 sentinel) and all-gather (bf16, 0xFFFF
  sentinel) across every GPU with double-buffered slots (xgpu.cu). Each size first moves
  random payloads with every special class and is compared bit-for-bit with the Python rule
  (and with NCCL's result on the same data); then timed per round in one persistent launch
  (%clock64 of rank 0), against NCCL's all_reduce / all_gather_into_tensor on the same payload
  sizes (CUDA events over a CUDA graph of back-to-back calls, and eager calls). Bound: one
  one-way flag plus (N-1) x payload at the measured peer-copy bandwidth.
- xgpu.clocks: each GPU's %globaltimer against host CLOCK_REALTIME, and rank d's against rank
  0's by ping-pong, at the start and the end of the run (offset and drift); then a persistent
  grid on every GPU doing the same work between common sync stops (HBM reads, or a timed spin):
  how far apart the GPUs (and all their blocks) reach each stop, and how long each waits.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from ..atomic import write_json
from ..errors import CorrectnessError, SpinTimeoutError
from ..harness import Harness
from ..results import REPO_ROOT, Bound, Derived, Env, Result, Series, latest, read_json, results_root
from ..sync import analysis as SA
from ..sync import bench as SB
from ..sync import runners as SR
from ..sync.sentinel import BF16
from ..teardown import leave
from . import analysis as A
from . import runners as X
from . import world as W
from .world import MULTICAST_OFF, PeerBuffer, World, WorldError, all_gather_object

KiB, MiB = 1024, 1 << 20
LOAD_BYTES = 64 * KiB
PEER_SWEEP_BYTES = (4 * KiB, 16 * KiB)  # with LOAD_BYTES: bulk copies in flight per SM, every SM pulling over the link
CLOCK_SPAN_S = {True: 10.0, False: 60.0}
STUDY_FIGURES = REPO_ROOT / "reports" / "paper_figures.json"

# slot-reuse variants timed beside the double-buffered slots: name -> (copies, fence every m rounds, label)
REUSE_VARIANTS = {"sentinel3": (3, 1, "sentinel (3 copies)"),
                  "sentinel4f2": (4, 2, "sentinel (4 copies, fence every 2 rounds)"),
                  "sentinel8f4": (8, 4, "sentinel (8 copies, fence every 4 rounds)")}  # least host time between the opening and closing clock offsets


def _study(fid: str) -> str:
    """The study's figure `fid` as text, read from the study's figures (reports/paper_figures.json,
    data the report validates; read here as data so the harness does not import the report)."""
    try:
        f = next(x for x in read_json(STUDY_FIGURES)["figures"] if x["id"] == fid)
    except Exception as e:  # a note, not a measurement: say what is missing instead of failing the run
        return f"(study figure {fid} unavailable: {type(e).__name__})"
    if "value" in f:
        return f"about {f['value'] * 1e6:.1f} us" if f["unit"] == "s" else f"{f['value']} {f['unit']}"
    return f"{f['low'] * 1e6:.1f}-{f['high'] * 1e6:.1f} us"


def sizes(quick: bool) -> list[int]:
    return [1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB] if quick else \
        [256, 1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB]


def _series(name, samples_s, timer, params=None, bound=None, work=None, metrics=None, clocks=None, warnings=()):
    return Series.from_samples(name, samples_s, timer=timer, unit="s", params=params or {}, bound=bound, work=work,
                               metrics=metrics or {}, clocks=clocks or {}, warnings=tuple(warnings))


def ping_configs(w: World, smids: list[list[int]], quick: bool) -> list[X.XPP]:
    rng = np.random.default_rng(11)
    out = []
    npairs = 3 if quick else 6
    for d in range(1, w.size):
        for i in range(npairs):
            a, b = int(rng.choice(smids[0])), int(rng.choice(smids[d]))
            out.append(X.XPP(f"r0-r{d}/pair{i}/idle/acq", d, a, b))
        a, b = int(smids[0][0]), int(smids[d][0])
        out.append(X.XPP(f"r0-r{d}/pair0s/idle/rlxacq", d, a, b, poll="rlxacq"))
        if d != 1:
            continue  # the loaded cases between rank 0 and rank 1 only
        k = LOAD_BYTES
        for sides, who in ((1, "r0"), (2, f"r{d}")):
            out.append(X.XPP(f"r0-r{d}/load-pair-{who}/local", d, a, b, load_sides=sides, load_bytes=k))
        for sides, who in ((1, "r0"), (2, f"r{d}"), (3, "both")):
            out.append(X.XPP(f"r0-r{d}/load-all-{who}/local", d, a, b, byst_sides=sides, load_bytes=k))
        # bulk copies that read the other GPU's memory (the link carries them and the flags)
        for sides, who in ((1, "r0"), (2, f"r{d}")):
            out.append(X.XPP(f"r0-r{d}/load-pair-{who}/peer", d, a, b, load_sides=sides, load_bytes=k,
                             load_from_peer=True))
        out.append(X.XPP(f"r0-r{d}/load-all-both/peer", d, a, b, byst_sides=3, load_bytes=k, load_from_peer=True))
        # the same with less in flight per SM: how the flag's delay grows with the bytes ahead of it
        for kk in PEER_SWEEP_BYTES:
            out.append(X.XPP(f"r0-r{d}/load-all-both/peer/k={kk}", d, a, b, byst_sides=3, load_bytes=kk,
                             load_from_peer=True))
    return out


# ============================================================================ the run
class Run:
    """One rank's share of the whole run (every method is collective)."""

    def __init__(self, w: World, quick: bool):
        import torch  # heavy: torch

        self.w, self.quick = w, quick
        self.h = Harness(device_index=w.device)
        self.info = self.h.info
        self.stream = int(torch.cuda.current_stream().cuda_stream)
        self.gpus = all_gather_object(dict(rank=w.rank, gpu=self.info.name, uuid=self.info.uuid, arch=self.info.arch,
                                           sm_count=self.info.sm_count))
        if len({g["arch"] for g in self.gpus}) != 1:
            raise WorldError(f"ranks run different GPU architectures (one cubin serves all): {self.gpus}")
        self.flags = PeerBuffer(w, 64 * KiB)
        self.flags.fill32(0, self.stream)
        self.src = PeerBuffer(w, 256 * MiB)
        self.src.fill32(0x3F803F80 + w.rank, self.stream)  # bulk-copy source (contents unused)
        X.sync_all()
        self.fmod = SR.module("flags", self.info.arch)
        self.clock_pair = X.ClockPair(w, self.flags, 0)
        self.notes: list[str] = []

    def heat(self) -> list[float]:
        mhz = SR.heat_and_read_clock(self.h, self.fmod, "sync_heat")
        return [float(x) for x in all_gather_object(mhz)]

    def env(self) -> Env:
        return Env.capture(self.w.device)

    def common_params(self) -> dict:
        return {"ranks": self.w.size}  # the GPUs themselves are named in the notes

    # ------------------------------------------------------------------ clocks
    def clocks(self, tag: str) -> dict:
        ha = X.host_anchor(self.w)
        t_host = time.time()
        host = all_gather_object(ha.offset())
        pair = self.clock_pair.measure()
        return {"tag": tag, "host_s": t_host, "host": host, "pair": pair}

    # ------------------------------------------------------------------ flags
    def flags_bench(self):
        smids = all_gather_object(SB.sm_ids(self.h))
        pp = X.PingPongX(self.w, self.info, self.flags, 64, self.src)
        runs = []
        mhz = self.heat()
        for c in ping_configs(self.w, smids, self.quick):
            runs.append(pp.run(c))
        mhz_end = self.heat()
        return runs, mhz, mhz_end

    # ------------------------------------------------------------------ peer copy bandwidth
    def peer_bandwidth(self, nbytes: int = 128 * MiB, reps: int = 5) -> float:
        """Rank 0 copies into rank 1's buffer (copy engine over the link), others idle: bytes / s."""
        import torch  # heavy: torch

        half = self.src.nbytes // 2
        nbytes = min(nbytes, half)
        ts = []
        X.sync_all()
        if self.w.rank == 0:
            for _ in range(reps + 1):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                self.src.ipc.copy(self.src.ptr(1, half), self.src.local, nbytes, self.stream)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3)
        X.sync_all()
        bw = all_gather_object(nbytes / float(np.median(ts[1:])) if ts else 0.0)[0]
        return float(bw)

    def close(self):
        X.sync_all()
        self.flags.close()
        self.src.close()


# ============================================================================ collectives
def _payload(op: str, rounds: int, nbytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if op == "allreduce":
        return A.finite_f32_payload(rng, rounds * nbytes // 4).view(np.uint8).reshape(rounds, nbytes)
    return SR.special_bf16(rng, rounds * nbytes // 2).view(np.uint8).reshape(rounds, nbytes)


def verify_collective(run: Run, coll: X.Collectives, op: str, nbytes: int, copies: int = 2,
                      fence_every: int = 1) -> dict:
    """Bit-exact check of one size against the Python rule, and against NCCL on the same data
    (2 x copies + 1 rounds, at least 7: every copy is reused at least twice)."""
    rounds = max(7, 2 * copies + 1)
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    w = run.w
    src_np = _payload(op, rounds, nbytes, seed=1000 * w.rank + nbytes % 997)
    src = torch.from_numpy(src_np.copy()).cuda()
    r = coll.run(op, nbytes, 0, rounds, src=src, copies=copies, fence_every=fence_every)
    everyone = X.gather(src)  # [ranks, rounds, nbytes]
    ref, got = A.collective_expected(op, everyone, r.dst)
    bad = np.flatnonzero((got != ref).ravel())
    if bad.size:
        raise CorrectnessError(f"sentinel {op} of {nbytes} B on rank {w.rank}: {bad.size} of {ref.size} elements "
                               f"differ from the rule's reference (first at flat index {bad[0]}: got "
                               f"{got.ravel()[bad[0]]:#x}, expected {ref.ravel()[bad[0]]:#x})")
    # NCCL on the same data (stream-ordered, eager)
    cmp = {}
    if op == "allreduce":
        nccl = []
        for j in range(rounds):
            t = src[j].view(torch.float32).clone()
            dist.all_reduce(t)
            nccl.append(t.view(torch.int32).cpu().numpy().view(np.uint32))
        cmp = A.nccl_differences(got, np.stack(nccl), everyone.view(np.uint32))
        if w.size == 2 and cmp["differ_otherwise"]:
            raise CorrectnessError(f"sentinel all-reduce of {nbytes} B: {cmp['differ_otherwise']} elements differ "
                                   "from NCCL's two-rank sum beyond the -0.0 rule")
    else:
        raw_all = []
        for j in range(rounds):
            t = src[j].view(torch.bfloat16)
            out = torch.empty(w.size * t.numel(), dtype=torch.bfloat16, device="cuda")
            dist.all_gather_into_tensor(out, t)
            raw_all.append(out.view(torch.int16).cpu().numpy().view(np.uint16).reshape(w.size, -1))
        nccl = np.stack(raw_all)
        if not (nccl == everyone.view(np.uint16).transpose(1, 0, 2)).all():
            raise CorrectnessError(f"NCCL all_gather of {nbytes} B did not return the inputs bit-for-bit")
        diff = got != nccl
        cmp = {"elements": int(got.size), "differ": int(diff.sum()),
               "differ_by_slot_rule": int((diff & (nccl == BF16.sentinel) & (got == BF16.replacement)).sum())}
        cmp["differ_otherwise"] = cmp["differ"] - cmp["differ_by_slot_rule"]
        if cmp["differ_otherwise"]:
            raise CorrectnessError(f"sentinel all-gather of {nbytes} B differs from NCCL beyond the 0xFFFF rule")
    return {"verified_rounds": rounds, "nccl": cmp}


def nccl_time(w: World, op: str, nbytes: int, reps: int = 50, samples: int = 15) -> dict:
    """NCCL per-call device time for one payload: a CUDA graph of `reps` calls (replayed `samples`
    times, CUDA events around each replay) and the same calls issued eagerly from Python."""
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    if op == "allreduce":
        t = torch.randn(nbytes // 4, device="cuda")

        def call():
            dist.all_reduce(t)
    else:
        t = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
        out = torch.empty(w.size * t.numel(), dtype=torch.bfloat16, device="cuda")

        def call():
            dist.all_gather_into_tensor(out, t)

    def timed(fn):
        xs = []
        for _ in range(samples):
            X.sync_all()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            xs.append(e0.elapsed_time(e1) * 1e-3 / reps)
        return np.asarray(xs)

    for _ in range(5):
        call()
    res = {"eager": timed(lambda: [call() for _ in range(reps)])}
    warn, g = [], None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                call()
    except Exception as e:  # recorded, never silent: the eager series stands alone then
        g = None
        warn.append(f"NCCL {op} could not be captured in a CUDA graph ({type(e).__name__}: {e}); eager only")
    # a graph's collectives wait for every rank's: replay only where every rank captured one
    if all(all_gather_object(g is not None)):
        g.replay()
        res["graph"] = timed(g.replay)
    elif g is not None:
        warn.append("another rank could not capture NCCL in a graph: graph timing skipped on every rank")
    return {"times": res, "warnings": warn}


# ============================================================================ results
def _rank0_mhz(nvml_mhz: float, spans) -> tuple[float, tuple[str, ...]]:
    """The SM clock that converts rank 0's %clock64 cycles: sync.bench's Clock (NVML after warm-up,
    checked against cycles / %globaltimer over the launches' own spans; the in-kernel rate where
    NVML gave none). Returns (MHz, warnings)."""
    clk = SB.Clock(nvml_mhz, SB._inkernel_mhz([c for c, _ in spans], [ns for _, ns in spans]))
    if clk.mhz <= 0:
        raise CorrectnessError("no SM clock on rank 0 (neither NVML nor an in-kernel span over 10 us): cycles "
                               "cannot be converted")
    return clk.mhz, clk.warnings()


def flags_result(run: Run, runs, mhz, mhz_end, floor_s) -> Result:
    m0, warn = _rank0_mhz(mhz[0], [(r.cycles, r.gt_ns) for r in runs])
    bound = Bound("latency", floor_s, "s", "one-way flag between two SMs of one GPU (flag_latency_s of the latest "
                                           "sync.flags run on this GPU model): the protocol without the link") \
        if floor_s else None
    series, idle, loaded = [], [], {}
    for r in runs:
        c = r.config
        m = slice(c.calib + c.settle, c.nrec)
        ow = A.one_way_ns(r.init[m], m0) * 1e-9
        metrics = {"rtt_median_s": float(np.median(ow) * 2), "sm_pair": [c.sm0, c.sm1], "polls": list(r.polls),
                   "globaltimer_rtt_s": r.gt_ns / c.rounds * 1e-9,
                   # configurations, not an axis: histograms of the idle pair and the peer-loaded case
                   "plot": "hist" if c.name.endswith(("pair0/idle/acq", "load-all-both/peer")) else "none"}
        if c.load_sides:
            # clocks of two GPUs: bring the responder's cycles to rank 0's rate before splitting
            ratio = m0 / mhz[c.peer] if mhz[c.peer] > 0 else 1.0
            sp = SA.split_one_way(r.init, np.rint(r.resp * ratio).astype(np.int64), c.calib, c.settle)
            metrics.update({"r0_to_peer_s": float(np.median(sp.a_to_b) / (m0 * 1e6)),
                            "peer_to_r0_s": float(np.median(sp.b_to_a) / (m0 * 1e6)),
                            "offset_iqr_cycles": sp.offset_iqr, "load_bytes_landed": list(r.load_bytes)})
        params = {**run.common_params(), "peer": c.peer, "poll": c.poll, "scope": "sys", "load_sides": c.load_sides,
                  "load_from_peer": c.load_from_peer, "bystander_sides": c.byst_sides, "load_bytes": c.load_bytes,
                  "rounds": c.rounds, "samples": "round trip / 2 on rank 0's %clock64"}
        s = _series(c.name, ow, "clock64", params, bound, metrics=metrics, warnings=warn,
                    clocks={"sm_mhz_rank0": m0, "sm_mhz_peer": mhz[c.peer], "sm_mhz_rank0_after": mhz_end[0]})
        series.append(s)
        if "/idle/acq" in c.name:
            idle.append(float(np.median(ow)))
        elif c.load_bytes:
            loaded[c.name] = float(np.median(ow))
    derived = {}
    sweep = sorted(((r.config.load_bytes, r) for r in runs
                    if r.config.byst_sides == 3 and r.config.load_from_peer and r.config.peer == 1), key=lambda t: t[0])
    if len(sweep) >= 2:
        # bytes in flight over the link ahead of the flag: every other SM of both GPUs keeps k bytes
        per_gpu = np.array([k * (run.info.sm_count - 1) for k, _ in sweep], dtype=np.float64)
        med = np.array([loaded.get(r.config.name, np.nan) for _, r in sweep])
        slope, icpt = np.polyfit(per_gpu, med, 1)
        derived["poll_delay_per_inflight_byte_gpu_to_gpu_s"] = Derived(
            float(slope), "s/B", "least-squares slope of the median one-way flag against the bytes of bulk copies in "
            "flight per GPU (every other SM of both GPUs reading the other GPU's memory, k bytes each)", None,
            tuple(r.config.name for _, r in sweep),
            f"intercept {icpt * 1e6:.2f} us; 1/slope = {1 / slope / 1e9:.0f} GB/s" if slope > 0 else "")
    derived["flag_latency_gpu_to_gpu_s"] = Derived(float(np.median(idle)), "s",
                                             "median over SM pairs of each pair's median one-way latency (round trip "
                                             "/ 2, st.release.sys + ld.acquire.sys) between two GPUs",
                                             (min(idle), max(idle)), tuple(s.name for s in series if "/idle/acq" in s.name),
                                             f"the study: {_study('sync.flag_gpu_to_gpu')}")
    if loaded:
        worst = max(loaded, key=loaded.get)
        derived["flag_latency_gpu_to_gpu_loaded_s"] = Derived(
            loaded[worst], "s", "the largest median one-way latency among the loaded configurations (k bytes of "
            "bulk copies in flight on the pair's SM or on every other SM, local or peer source)",
            (min(loaded.values()), max(loaded.values())), tuple(loaded),
            f"worst: {worst}; the study: {_study('xgpu.poll_behind_bulk')}")
    return Result("xgpu.flags", run.env(), tuple(series), derived, quick=run.quick, notes=tuple(run.notes))


def collectives_result(run: Run, coll_runs, checks, nccl, flag_s, bw, mhz, variants=None) -> Result:
    """variants: {name in REUSE_VARIANTS: ({(op, bytes): CollRun}, {(op, bytes): checks})}."""
    m0, warn = _rank0_mhz(mhz[0], [(r.cycles, r.gt_ns) for r in coll_runs.values()])
    n = run.w.size
    series, pays, gains = [], {}, {}
    for (op, nb), r in coll_runs.items():
        x = r.round_cycles / (m0 * 1e6)
        bound = None
        if flag_s and bw:
            bound = Bound("time", flag_s + (n - 1) * nb / bw, "s",
                          f"one cross-GPU one-way flag ({flag_s * 1e6:.2f} us, this run) + (N-1) x payload at the "
                          f"measured peer-copy bandwidth ({bw / 1e9:.0f} GB/s)")
        ph = np.median(r.phase_cycles, axis=0) / (m0 * 1e6)
        metrics = {"blocks": r.blocks, "globaltimer_per_round_s": r.gt_ns / max(len(x), 1) * 1e-9,
                   # where a round goes (block 0 thread 0, medians): its publication, its waits, slot reuse
                   "publish_s": float(ph[0]), "wait_s": float(ph[1]), "reuse_s": float(ph[2]),
                   **{f"check_{k}": v for k, v in checks[(op, nb)].items()}}
        # one parameter set for every implementation, so the report draws them as lines of one figure
        series.append(_series(f"sentinel/{op}/{nb}", x, "clock64", {**run.common_params(), "op": op, "bytes": nb,
                                                                     "impl": "sentinel (2 copies)"},
                              bound, metrics={**metrics, "samples": "per round of one persistent launch, rank 0"},
                              clocks={"sm_mhz_rank0": m0}, warnings=warn))
        for mode, ts in nccl[(op, nb)]["times"].items():
            series.append(_series(f"nccl/{op}/{nb}/{mode}", ts, "cuda_event",
                                  {**run.common_params(), "op": op, "bytes": nb, "impl": f"NCCL {mode}"},
                                  bound, warnings=nccl[(op, nb)]["warnings"],
                                  metrics={"samples": "CUDA events over 50 back-to-back calls / 50"
                                           + (" (includes the host's submission)" if mode == "eager" else "")}))
        for name, (vruns, vchecks) in (variants or {}).items():
            if (op, nb) not in vruns:
                continue
            vr = vruns[(op, nb)]
            xv = vr.round_cycles / (m0 * 1e6)
            phv = np.median(vr.phase_cycles, axis=0) / (m0 * 1e6)
            series.append(_series(f"{name}/{op}/{nb}", xv, "clock64",
                                  {**run.common_params(), "op": op, "bytes": nb, "impl": REUSE_VARIANTS[name][2]},
                                  bound, clocks={"sm_mhz_rank0": m0},
                                  metrics={"blocks": vr.blocks, "samples": "per round of one persistent launch, rank 0",
                                           "publish_s": float(phv[0]), "wait_s": float(phv[1]),
                                           "reuse_s": float(phv[2]),
                                           **{f"check_{k}": v for k, v in vchecks.get((op, nb), {}).items()}}))
            gains.setdefault(name, {})[(op, nb)] = float(np.median(x) / np.median(xv))
        g = nccl[(op, nb)]["times"].get("graph")
        if g is not None:
            pays[(op, nb)] = float(np.median(g) / np.median(x))
    derived = {}
    for op in ("allreduce", "allgather"):
        sp = {nb: v for (o, nb), v in pays.items() if o == op}
        if sp:
            small = [v for nb, v in sp.items() if nb <= 64 * KiB]
            derived[f"xgpu_sentinel_{op}_speedup"] = Derived(
                float(np.median(small)) if small else float("nan"), "x",
                "median over payloads up to 64 KB of NCCL's per-call time (CUDA graph) / the sentinel collective's "
                "per-round time", (min(sp.values()), max(sp.values())),
                tuple(f"sentinel/{op}/{nb}" for nb in sp), "per size: " + ", ".join(f"{nb} B {v:.1f}x" for nb, v in
                                                                                      sorted(sp.items())))
    small = [r for (op, nb), r in coll_runs.items() if nb <= 4 * KiB]
    if small:
        ph = np.median(np.concatenate([r.phase_cycles for r in small]), axis=0) / (m0 * 1e6)
        derived["xgpu_sentinel_wait_share"] = Derived(
            float(ph[1] / ph.sum()), "fraction", "share of a sentinel round (payloads up to 4 KB, both ops, 2 copies; "
            "block 0 thread 0's %clock64, medians) spent waiting for every sender's data", None,
            tuple(f"sentinel/{op}/{nb}" for (op, nb) in coll_runs if nb <= 4 * KiB),
            f"publish {ph[0] * 1e6:.2f} us, wait {ph[1] * 1e6:.2f} us, slot reuse (resets, fence, barriers) "
            f"{ph[2] * 1e6:.2f} us" + (f"; one-way flag {flag_s * 1e6:.2f} us" if flag_s else ""))
    for name, g in gains.items():
        derived[f"xgpu_{name}_gain"] = Derived(
            float(np.median(list(g.values()))), "x", "median over ops and payloads of the double-buffered round "
            f"time / the round time of {REUSE_VARIANTS[name][2]}", (min(g.values()), max(g.values())),
            tuple(f"{name}/{op}/{nb}" for op, nb in g),
            "per op and size: " + ", ".join(f"{op} {nb} B {v:.2f}x" for (op, nb), v in sorted(g.items())))
    if bw:
        derived["xgpu_peer_copy_bw"] = Derived(bw, "B/s", "median of 5 copy-engine copies of 128 MiB from rank 0 "
                                               "into rank 1's memory (CUDA events)", None, ())
    return Result("xgpu.collectives", run.env(), tuple(series), derived, quick=run.quick, notes=tuple(run.notes))


def clocks_result(run: Run, c0, c1, stop_runs, offsets_mid, flag_s) -> Result:
    n = run.w.size
    series, derived = [], {}
    dt = c1["host_s"] - c0["host_s"]
    for d in range(1, n):
        o0, o1 = c0["pair"][d], c1["pair"][d]
        for tag, o in (("start", o0), ("end", o1)):
            series.append(_series(f"gt_offset/r{d}-r0/{tag}", [o.offset_ns * 1e-9], "globaltimer",
                                  {**run.common_params(), "rank": d, "when": tag},
                                  metrics={"error_bound_s": o.error_ns * 1e-9, "rtt_s": o.rtt_ns * 1e-9,
                                           "iqr_s": o.iqr_ns * 1e-9, "kept": o.kept, "exchanges": o.total}))
        derived[f"gt_offset_r{d}_s"] = Derived(o0.offset_ns * 1e-9, "s", A.OFFSET_RULE.format(keep=A.KEEP),
                                               (o0.offset_ns * 1e-9 - o0.error_ns * 1e-9,
                                                o0.offset_ns * 1e-9 + o0.error_ns * 1e-9), (f"gt_offset/r{d}-r0/start",))
        derived[f"gt_drift_r{d}_ppm"] = Derived(A.drift_ppm(o0.offset_ns, o1.offset_ns, dt), "ppm", A.DRIFT_RULE, None,
                                                (f"gt_offset/r{d}-r0/start", f"gt_offset/r{d}-r0/end"),
                                                f"over {dt:.1f} s of host time")
    for r in range(n):
        h0, h1 = c0["host"][r], c1["host"][r]
        for tag, o in (("start", h0), ("end", h1)):
            series.append(_series(f"host_offset/r{r}/{tag}", [o.offset_ns * 1e-9], "globaltimer",
                                  {**run.common_params(), "rank": r, "when": tag},
                                  metrics={"error_bound_s": o.error_ns * 1e-9, "rtt_s": o.rtt_ns * 1e-9}))
        derived[f"host_drift_r{r}_ppm"] = Derived(A.drift_ppm(h0.offset_ns, h1.offset_ns, dt), "ppm",
                                                  "(GPU %globaltimer - host CLOCK_REALTIME) change / host seconds",
                                                  None, (f"host_offset/r{r}/start", f"host_offset/r{r}/end"),
                                                  f"offset at start {h0.offset_ns * 1e-3:.1f} us "
                                                  f"(+-{h0.error_ns * 1e-3:.1f} us)")
    step = max(o.step_ns for o in list(c0["pair"].values()) + list(c0["host"]))
    derived["globaltimer_step_ns"] = Derived(float(step), "ns", "largest over the clock exchanges of the gcd of "
                                             "differences between %globaltimer stamps (A.timer_step_ns)", None,
                                             tuple(f"gt_offset/r{d}-r0/start" for d in range(1, n)),
                                             "spreads and offsets below a few steps are not resolved")
    offs = [0.0] + [offsets_mid[d].offset_ns for d in range(1, n)]
    bound = Bound("latency", flag_s, "s", "one cross-GPU one-way flag (flag_latency_gpu_to_gpu_s, this run): a stop "
                                          "cannot release sooner") if flag_s else None
    for work, sr in stop_runs.items():
        st = A.stops(sr.arrive, sr.gpu, offs)
        p = {**run.common_params(), "work": work, "stops": int(sr.arrive.shape[1]), "blocks_per_gpu": sr.blocks,
             "offsets_ns": offs}
        series.append(_series(f"stops/{work}/gpu_spread", st.gpu_spread_ns * 1e-9, "globaltimer",
                              {**p, "samples": "per stop: latest - earliest GPU arrival (a GPU's last block)"},
                              metrics={"plot": "hist", "p99_s": float(np.percentile(st.gpu_spread_ns, 99) * 1e-9),
                                       "max_s": float(st.gpu_spread_ns.max() * 1e-9),
                                       "slowest_rank_share": np.bincount(st.slowest, minlength=n).tolist()}))
        series.append(_series(f"stops/{work}/block_spread", st.block_spread_ns * 1e-9, "globaltimer",
                              {**p, "samples": "per stop: latest - earliest block arrival over every GPU"}))
        for r in range(n):
            series.append(_series(f"stops/{work}/wait/r{r}", st.wait_ns[r] * 1e-9, "globaltimer",
                                  {**p, "rank": r, "samples": "per stop: from this GPU's arrival until every GPU's "
                                                              "flag was seen"}, bound))
        derived[f"stop_gpu_spread_{work}_s"] = Derived(float(np.median(st.gpu_spread_ns) * 1e-9), "s", A.SPREAD_RULE,
                                                       (float(np.percentile(st.gpu_spread_ns, 1) * 1e-9),
                                                        float(np.percentile(st.gpu_spread_ns, 99) * 1e-9)),
                                                       (f"stops/{work}/gpu_spread",),
                                                       f"max {st.gpu_spread_ns.max() * 1e-3:.2f} us over "
                                                       f"{st.gpu_spread_ns.size} stops; the study: up to {_study('sync.gpu_drift').removeprefix('about ')}")
        derived[f"stop_wait_{work}_s"] = Derived(float(np.median(st.wait_ns) * 1e-9), "s",
                                                 "median over GPUs and stops of the time from a GPU's arrival at a "
                                                 "common stop until it had seen every GPU's flag",
                                                 (float(np.percentile(st.wait_ns, 1) * 1e-9),
                                                  float(np.percentile(st.wait_ns, 99) * 1e-9)),
                                                 tuple(f"stops/{work}/wait/r{r}" for r in range(n)))
        if work == "hbm":
            derived["gpu_drift_s"] = Derived(float(np.percentile(st.gpu_spread_ns, 99) * 1e-9), "s",
                                             "99th percentile over stops of how far apart the GPUs reach a common sync "
                                             "stop after the same HBM work (" + A.SPREAD_RULE + ")",
                                             (float(np.median(st.gpu_spread_ns) * 1e-9),
                                              float(st.gpu_spread_ns.max() * 1e-9)), ("stops/hbm/gpu_spread",),
                                             f"spread shown: median to max; %globaltimer step {step} ns")
            derived["gpu_drift_max_s"] = Derived(
                float(st.gpu_spread_ns.max() * 1e-9), "s", "the largest over stops of how far apart the GPUs reach a "
                "common sync stop after the same HBM work (the study's 'up to'; " + A.SPREAD_RULE + ")",
                (float(np.percentile(st.gpu_spread_ns, 99.9) * 1e-9), float(st.gpu_spread_ns.max() * 1e-9)),
                ("stops/hbm/gpu_spread",), f"%globaltimer step {step} ns: spreads under a few steps are not resolved; "
                f"p99 {np.percentile(st.gpu_spread_ns, 99) * 1e-3:.2f} us over {st.gpu_spread_ns.size} stops")
    return Result("xgpu.clocks", run.env(), tuple(series), derived, quick=run.quick, notes=tuple(run.notes))


# ============================================================================ main
def run_all(w: World, quick: bool = True, save: bool = True) -> dict[str, Result]:
    import torch  # heavy: torch

    run = Run(w, quick)
    run.notes.append(f"{w.size} ranks, one process per GPU (torchrun); GPUs: "
                     + "; ".join(f"rank {g['rank']}: {g['gpu']} {g['uuid'][:8]}" for g in run.gpus))
    run.notes.append("NVLink multicast off: " + ", ".join(f"{k}={os.environ.get(k)}" for k in MULTICAST_OFF))
    topo = _topology()
    if topo:
        run.notes.append("nvidia-smi topo -m: " + topo)
    out = {}

    def keep(res: Result):
        out[res.benchmark] = res
        if save and w.rank == 0:
            print(f"[xgpu] saved {res.save()}", flush=True)

    floor = _latest("sync.flags", "flag_latency_s", run.info.name)
    c0 = run.clocks("start")
    _say(w, f"clock offsets at start: {[(d, round(o.offset_ns), round(o.error_ns)) for d, o in c0['pair'].items()]}")
    runs, mhz, mhz_end = run.flags_bench()
    if w.rank == 0:
        keep(flags_result(run, runs, mhz, mhz_end, floor))
    flag_s = all_gather_object(out["xgpu.flags"].derived["flag_latency_gpu_to_gpu_s"].value if w.rank == 0 else None)[0]
    _say(w, f"flag one-way {flag_s * 1e6:.2f} us")
    bw = run.peer_bandwidth() if w.size >= 2 else 0.0
    _say(w, f"peer copy {bw / 1e9:.0f} GB/s")
    coll = X.Collectives(w, run.info, max(sizes(quick)))
    checks, coll_runs = {}, {}
    variants = {name: ({}, {}) for name in REUSE_VARIANTS}
    mhz_c = run.heat()
    for op in ("allreduce", "allgather"):
        for nb in sizes(quick):
            checks[(op, nb)] = verify_collective(run, coll, op, nb)
            coll_runs[(op, nb)] = coll.run(op, nb, warmup=16, rounds=200 if quick else 1000)
            for name, (copies, every, _) in REUSE_VARIANTS.items():
                variants[name][1][(op, nb)] = verify_collective(run, coll, op, nb, copies=copies, fence_every=every)
                variants[name][0][(op, nb)] = coll.run(op, nb, warmup=16, rounds=200 if quick else 1000,
                                                       copies=copies, fence_every=every)
            _say(w, f"sentinel {op} {nb} B: {np.median(coll_runs[(op, nb)].round_cycles) / mhz_c[0]:.2f} us/round ("
                    + ", ".join(f"{name} {np.median(v[0][(op, nb)].round_cycles) / mhz_c[0]:.2f}"
                                for name, v in variants.items()) + "), bit-exact")
    coll.close()
    offsets_mid = run.clock_pair.measure()
    work_src = SR.random_src(1 << 30, 77)
    stops = 300 if quick else 2000
    sx = X.StopsX(w, run.info, run.flags, 128, work_src)
    stop_runs = {"hbm": sx.run(stops, work_bytes=256 * KiB), "spin": sx.run(stops, work_ns=10_000)}
    del work_src
    span = CLOCK_SPAN_S[quick] - (time.time() - c0["host_s"])
    if span > 0:  # drift needs host time between the two offsets (a 32-256 ns step over seconds)
        _say(w, f"waiting {span:.0f} s before the closing clock measurement")
        time.sleep(span)
    c1 = run.clocks("end")
    if w.rank == 0:
        keep(clocks_result(run, c0, c1, stop_runs, offsets_mid, flag_s))
    nccl = {}
    for op in ("allreduce", "allgather"):
        for nb in sizes(quick):
            nccl[(op, nb)] = nccl_time(w, op, nb)
    if w.rank == 0:
        keep(collectives_result(run, coll_runs, checks, nccl, flag_s, bw, mhz_c, variants))
    run.close()
    torch.cuda.synchronize()
    return out


def _latest(bench: str, key: str, gpu: str) -> float | None:
    """A derived value of the latest `bench` result on this GPU model: from this run's results
    folder, else from the committed ones (a GPU session writes into an empty folder)."""
    for root in dict.fromkeys((results_root(), REPO_ROOT / "reports" / "results")):
        try:
            r = latest(bench, root=root, gpu=gpu)
        except Exception:
            r = None
        d = r.derived.get(key) if r else None
        if d is not None:
            return d.value
    return None


def _topology() -> str:
    try:
        p = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        text = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout)  # nvidia-smi underlines the header with ANSI codes
        rows = [line.rstrip() for line in text.splitlines() if line.strip() and not line.startswith(("Legend", "  "))]
        return " | ".join(rows)[:1000]
    except Exception:
        return ""


def _say(w: World, msg: str) -> None:
    if w.rank == 0:
        print(f"[xgpu] {msg}", flush=True)


def selftest(w: World) -> dict:
    """Checks that must fail do: rank 1 skips its half of a clock ping-pong, so rank 0's bounded
    wait gives up and every rank raises SpinTimeoutError naming the wait (never a hung GPU)."""
    flags = PeerBuffer(w, 64 * KiB)
    flags.fill32(0, X._stream())
    X.sync_all()
    out = {}
    try:
        X.ClockPair(w, flags, 0, bound_ns=50_000_000).measure(rounds=16, absent=1)
        out["lost_partner"] = "no error"
    except SpinTimeoutError as e:
        out["lost_partner"] = str(e)
    X.sync_all()
    flags.close()
    return out


def summary(results: dict[str, Result]) -> dict:
    """What a caller (the GPU test, the CLI) needs to see: every series' median and every constant."""
    return {b: {"series": {s.name: s.summary.median for s in r.series},
                "derived": {k: d.value for k, d in r.derived.items()}} for b, r in results.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m microbench.xgpu", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="full sweeps (default: quick)")
    ap.add_argument("--no-save", action="store_true", help="do not write result files")
    ap.add_argument("--summary", help="rank 0 writes a JSON summary here")
    ap.add_argument("--selftest", action="store_true", help="only the checks that must fail (a lost partner)")
    args = ap.parse_args(argv)

    w = W.init()
    res = {} if args.selftest else run_all(w, quick=not args.full, save=not args.no_save)
    s = summary(res)
    if args.selftest:
        s["selftest"] = selftest(w)  # collective: every rank
    if w.rank == 0:
        if args.summary:
            write_json(args.summary, s)
        for b, r in res.items():
            print(f"[xgpu] {b}")
            for k, d in r.derived.items():
                print(f"    -> {k} = {d.value:.4g} {d.unit}")
        for k, v in s.get("selftest", {}).items():
            print(f"[xgpu] selftest {k}: {v}")
    import torch.distributed as dist  # heavy: torch

    dist.barrier()
    dist.destroy_process_group()

    leave(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
