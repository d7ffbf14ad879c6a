"""Instruction cache: capacity levels, spliced blocks, launch prefetch window, code vs data in L2.

All kernels are generated straight-line PTX (microbench/icache/gen.py) whose machine-code size
is checked against what was generated before anything runs. Timing is inside the kernel with
%clock64 (per warp, lane 0 stores; timer "clock64"); cycles are converted to seconds with the SM
clock NVML reports after a warm-up (and cross-checked against %clock64/%globaltimer over each
launch). The code-vs-data stream is long enough for CUDA events and goes through the harness.

- icache.capacity: cycles/instruction of a loop over a body of B bytes, B from 2 KiB to 1 MiB,
  at 1, 4 and 8 warps/SM (one block per SM, every SM), plus a denser grid at 1 and 4 warps/SM
  through the two transitions seen on the H200 (16-64 KiB and 96-176 KiB). Bound: one warp issues
  at most one instruction per cycle. Levels are plateaus of the 1-warp curve (derive.py), named
  for what they are -> icache_l0_bytes (the innermost, per sub-partition), icache_sm_bytes (the
  SM's instruction cache, the study's ~128 KB) and the cost of missing each.
- icache.spliced: block A alone, block B alone, A then B in one loop; per-pass time and the ratio
  spliced/(A + B alone), at 1 and 12 warps/SM (12 = the studied megakernel's block shape). The
  study's sizes (100 KiB + 100 KiB, and B shrunk to 20 KiB) are among the parameters; its timings
  are not used here. Each block's own spliced/solo ratio is derived with its spread ->
  max_code_bytes_per_launch (the largest splice whose large block keeps its solo speed).
- icache.prefetch: one pass over a 128 KiB (full: 256 KiB) body with a stamp every 2 KiB; first
  pass cost per segment warm (same kernel just ran), icache-cold (a 512 KiB kernel ran in
  between) and L2-cold (L2 flushed, then the evictor). -> launch_prefetch_bytes.
- icache.code_vs_data: the same weights stream (same bytes, same instructions per byte) run by
  a loop whose body fits the instruction cache and by one that overflows it. Bound: the
  driver's D2D memcpy rate measured in the same run (bytes read + written per second).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..basics.bench import copy_case
from ..datasheet import hbm_peak
from ..errors import CorrectnessError
from ..harness import CLOCK_DROP_FRACTION, Case, Harness, Prepared, full_sweeps, run_case
from ..launch import LaunchSpec, launch
from ..results import Bound, Derived, Env, Result, Series, latest
from . import derive
from .gen import (B_MAX, NACC, REC_WORDS, R_FIRST0, R_PASSES, R_SMID, R_TIMED0, R_TOTAL_CYC, R_TOTAL_NS,
                  STAGE_BYTES_PER_WARP, X_MAX, Generated, check_exact_range, compile_many, instructions_for,
                  loop_kernel, loop_reference, probe_kernel, stream_kernel)

KiB = 1024
MiB = 1 << 20
SCHEDULERS_PER_SM = 4  # Hopper: four sub-partitions, each issues one warp-instruction per cycle
STUDY_BLOCK = 100 * KiB  # the study's block size (a parameter here; its GB300 timings are not)
STUDY_SHRUNK = 20 * KiB
CAPACITY_WARPS = (1, 4, 8)
SPLICE_WARPS = (1, 12)
PROBE_WARPS = 1
STREAM_WARPS = 8
STREAM_STAGES_PER_WARP = 768  # stages each warp streams per launch (4 KiB each): 3.3 GB at 8 warps/SM
EVICTOR_BYTES = 512 * KiB
CLOCK_DISAGREE = 0.05  # NVML vs in-kernel clock, and NVML before vs after, beyond this -> warning
# Where buffers live. Only tests/test_icache_emulated.py changes it (to "cpu"), to run the whole
# pipeline against an emulated device.
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        import torch  # heavy: torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------- sweeps
@dataclass(frozen=True)
class Sweep:
    capacity_sizes: tuple[int, ...]
    capacity_warps: tuple[int, ...]
    capacity_dense_sizes: tuple[int, ...]  # extra bodies at the dense warp counts only
    capacity_dense_warps: tuple[int, ...]
    capacity_instr_per_launch: int  # per warp, over the timed passes
    capacity_launches: int
    splice_pairs: tuple[tuple[int, int], ...]
    splice_warps: tuple[int, ...]
    splice_instr_per_launch: int
    splice_launches: int
    probe_bytes: int
    probe_seg_bytes: int
    probe_samples: int
    stream_stages: tuple[int, ...]


def capacity_sizes(quick: bool) -> tuple[int, ...]:
    """Geometric body sizes, 2 KiB .. 1 MiB (12 quick, 30 full), multiples of 256 B."""
    raw = np.geomspace(2 * KiB, 1 * MiB, 12 if quick else 30)
    return tuple(sorted({int(round(v / 256)) * 256 for v in raw}))


# Where the H200's 1-warp curve changes level (the committed icache.capacity results: tens of KiB,
# and around the SM's instruction cache): a denser grid there tells a plateau from a transition.
DENSE_KIB = (16, 20, 24, 28, 32, 40, 48, 56, 96, 112, 128, 144, 160, 176)
DENSE_WARPS = (1, 4)


def capacity_dense_sizes(quick: bool) -> tuple[int, ...]:
    """Extra bodies (multiples of 256 B) through the transitions, at DENSE_WARPS only; none that
    the geometric grid already has."""
    geo = set(capacity_sizes(quick))
    return tuple(s for s in (k * KiB for k in DENSE_KIB) if s not in geo)


def splice_pairs(quick: bool) -> tuple[tuple[int, int], ...]:
    sym = (16, 32, 48, 64, 100) if quick else (8, 16, 24, 32, 40, 48, 56, 64, 80, 100, 128)
    shrunk = ((100, 20), (100, 40)) if quick else ((100, 20), (20, 100), (100, 40), (100, 60), (100, 80))
    return tuple((a * KiB, b * KiB) for a, b in [(s, s) for s in sym] + list(shrunk))


def sweep(quick: bool) -> Sweep:
    return Sweep(
        capacity_sizes=capacity_sizes(quick), capacity_warps=CAPACITY_WARPS,
        capacity_dense_sizes=capacity_dense_sizes(quick), capacity_dense_warps=DENSE_WARPS,
        capacity_instr_per_launch=(1 << 20) if quick else (1 << 21), capacity_launches=3 if quick else 10,
        splice_pairs=splice_pairs(quick), splice_warps=SPLICE_WARPS,
        splice_instr_per_launch=(1 << 19) if quick else (1 << 20), splice_launches=3 if quick else 10,
        probe_bytes=128 * KiB if quick else 256 * KiB, probe_seg_bytes=2 * KiB, probe_samples=5 if quick else 15,
        # 384 stages = 240 KiB of code, about twice the ~128 KiB the study (and earlier GPUs) show;
        # 512 stages took ptxas 11 s here for little more, so the sweep stops at 384
        stream_stages=(16, 384) if quick else (16, 64, 128, 256, 384))


def passes_for(body_instructions: int, target: int, lo: int = 2, hi: int = 4096) -> int:
    """Timed passes so each warp executes about `target` body instructions."""
    return int(min(hi, max(lo, round(target / max(body_instructions, 1)))))


def issue_floor_cpi(warps_per_sm: int) -> int:
    """Cycles per instruction per warp at the issue limit: warps share 4 schedulers round-robin.
    A floor for a whole launch (all warps of an SM together), not for one warp's own timed
    window: warps drift apart, so a window is partly solo (seen on the H200: 1.66 at 8 warps)."""
    return math.ceil(warps_per_sm / SCHEDULERS_PER_SM)


WARP_ISSUE_FLOOR_CPI = 1  # one warp issues at most one instruction per cycle: the per-window floor


# --------------------------------------------------------------------------- generators
def capacity_generators(sw: Sweep, arch: str) -> list[Generated]:
    """One kernel per body: the geometric grid, then the dense extras."""
    return [loop_kernel([instructions_for(b)], arch=arch) for b in sw.capacity_sizes + sw.capacity_dense_sizes]


def capacity_plan(sw: Sweep) -> list[tuple[int, int, int]]:
    """(warps, requested body bytes, index into capacity_generators) in measurement order."""
    geo = len(sw.capacity_sizes)
    out = []
    for w in sw.capacity_warps:
        sizes = list(enumerate(sw.capacity_sizes))
        if w in sw.capacity_dense_warps:
            sizes += [(geo + i, b) for i, b in enumerate(sw.capacity_dense_sizes)]
        out += [(w, b, i) for i, b in sorted(sizes, key=lambda t: t[1])]
    return out


def splice_generators(sw: Sweep, arch: str) -> tuple[dict[int, Generated], dict[tuple[int, int], Generated]]:
    alone_sizes = sorted({s for p in sw.splice_pairs for s in p})
    alone = {s: loop_kernel([instructions_for(s)], arch=arch) for s in alone_sizes}
    spliced = {p: loop_kernel([instructions_for(p[0]), instructions_for(p[1])], arch=arch) for p in sw.splice_pairs}
    return alone, spliced


def evictor_generator(arch: str) -> Generated:
    return loop_kernel([instructions_for(EVICTOR_BYTES)], arch=arch)


def probe_generator(sw: Sweep, arch: str) -> Generated:
    return probe_kernel(instructions_for(sw.probe_bytes), instructions_for(sw.probe_seg_bytes), arch=arch)


def all_generators(quick: bool, arch: str = "sm_90a") -> dict[str, list[Generated]]:
    sw = sweep(quick)
    alone, spliced = splice_generators(sw, arch)
    return {"icache.capacity": capacity_generators(sw, arch),
            "icache.spliced": [*alone.values(), *spliced.values()],
            "icache.prefetch": [probe_generator(sw, arch), evictor_generator(arch)],
            "icache.code_vs_data": [stream_kernel(s, arch=arch) for s in sw.stream_stages]}


_COMPILED_ALL: set = set()


def _compile(gens: Sequence[Generated], quick: bool, arch: str) -> tuple[dict, float]:
    """Compile `gens`; the first call in a process compiles every icache benchmark's kernels in
    one pool (wall time ~ the largest kernel, not the sum), later calls hit the disk cache."""
    t0 = time.perf_counter()
    if (quick, arch) not in _COMPILED_ALL:
        compile_many([g for gs in all_generators(quick, arch).values() for g in gs])
        _COMPILED_ALL.add((quick, arch))
    mods = compile_many(gens)
    return mods, time.perf_counter() - t0


# --------------------------------------------------------------------------- launching
def one_block_per_sm_smem(info) -> int:
    """Dynamic shared memory that lets only one block onto an SM (so `grid = SMs` covers all)."""
    s = min(info.smem_per_sm // 2 + 1024, info.smem_per_block_optin)
    if 2 * (s + info.reserved_smem_per_block) <= info.smem_per_sm:
        raise RuntimeError(f"{info.name}: cannot force one block per SM with shared memory "
                           f"({s} B requested, {info.smem_per_sm} B per SM)")
    return s


class GenKernel:
    """A compiled loop or probe kernel bound to fresh random inputs on the GPU.

    Inputs: accumulators x ~ integers in [-X_MAX, X_MAX], b0 != b1 in [1, B_MAX], so every
    float32 partial sum is an exact integer and the output has a closed form (gen.py)."""

    def __init__(self, h: Harness, gen: Generated, mod, warps: int, passes: int = 1):
        import torch  # heavy: torch

        if gen.kind not in ("loop", "probe"):
            raise ValueError(f"GenKernel runs loop/probe kernels, not {gen.kind}")
        self.h, self.gen, self.warps = h, gen, warps
        self.kernel = mod.kernel(gen.name)
        self.usage = mod.usage(gen.name)
        self.iters = passes if gen.kind == "loop" else 0  # timed passes (the loop adds a warm pass)
        self.passes = passes + 1 if gen.kind == "loop" else 1
        check_exact_range(gen, self.passes)
        sms = h.info.sm_count
        self.spec = LaunchSpec(grid=sms, block=32 * warps, smem=one_block_per_sm_smem(h.info))
        self.nwarps = sms * warps
        threads = self.nwarps * 32
        self.rec_words = REC_WORDS if gen.kind == "loop" else gen.params["rec_words"]
        rng = np.random.default_rng()
        self.b0, self.b1 = (float(v) for v in rng.choice(np.arange(1, B_MAX + 1), size=2, replace=False))
        self.x = torch.randint(-X_MAX, X_MAX + 1, (threads, NACC), device=DEVICE).float()
        self.ref = torch.from_numpy(loop_reference(gen, self.x.cpu().numpy(), self.b0, self.b1, self.passes)
                                    .astype(np.float32)).to(DEVICE)
        self.out = torch.empty_like(self.x)
        self.rec = torch.empty(self.nwarps * self.rec_words, dtype=torch.int64, device=DEVICE)

    def launch(self, rec=None, out=None) -> None:
        rec = self.rec if rec is None else rec
        out = self.out if out is None else out
        if self.gen.kind == "loop":
            launch(self.kernel, self.spec, self.x, out, rec, np.uint32(self.iters), np.float32(self.b0),
                   np.float32(self.b1), np.float32(np.inf))
        else:
            launch(self.kernel, self.spec, self.x, out, rec, np.float32(self.b0), np.float32(self.b1),
                   np.float32(np.inf))

    def poison(self) -> None:
        self.out.fill_(float("nan"))
        self.rec.fill_(-1)

    def check(self) -> np.ndarray:
        """Assert outputs and records; returns records [warps, words] (int64, host)."""
        import torch  # heavy: torch

        what = f"{self.gen.name} ({self.gen.kind} {self.gen.params.get('blocks', self.gen.params.get('total'))}, " \
               f"{self.warps} warps/SM)"
        if not torch.equal(self.out, self.ref):
            bad = (self.out != self.ref).nonzero()
            t, k = (int(v) for v in bad[0])
            raise CorrectnessError(f"{what}: {bad.shape[0]} of {self.out.numel()} accumulators wrong; first: thread "
                                   f"{t} register {k} = {float(self.out[t, k])}, expected {float(self.ref[t, k])} "
                                   f"({self.passes} passes)")
        rec = self.rec.view(self.nwarps, self.rec_words).cpu().numpy().copy()  # .cpu() of a CPU tensor aliases
        if self.gen.kind == "loop":
            if not np.all(rec[:, R_PASSES] == self.passes):
                raise CorrectnessError(f"{what}: warps report passes {np.unique(rec[:, R_PASSES])[:5]}, "
                                       f"expected {self.passes}")
            nb = len(self.gen.params["blocks"])
            if np.any(rec[:, R_TIMED0:R_TIMED0 + nb] <= 0) or np.any(rec[:, R_FIRST0:R_FIRST0 + nb] <= 0):
                raise CorrectnessError(f"{what}: a warp recorded a non-positive cycle count")
        else:
            st = rec[:, :self.gen.params["nseg"] + 1]
            if np.any(np.diff(st, axis=1) <= 0):
                raise CorrectnessError(f"{what}: %clock64 stamps not increasing along the body")
        return rec

    def smids(self, rec: np.ndarray) -> np.ndarray:
        col = R_SMID if self.gen.kind == "loop" else self.gen.params["nseg"] + 1
        return rec[:, col]

    def run_checked(self) -> np.ndarray:
        self.poison()
        self.launch()
        _sync()
        return self.check()


def spin_up(h: Harness, launch_fn, min_s: float = 0.1, max_s: float = 3.0) -> dict:
    """Launch until at least `min_s` has passed and NVML shows the SM clock ramped (bounded)."""
    t0 = time.perf_counter()
    while True:
        for _ in range(4):
            launch_fn()
        _sync()
        el = time.perf_counter() - t0
        c = h.clocks()
        ramped = not c["sm_max_mhz"] or c["sm_mhz"] >= CLOCK_DROP_FRACTION * c["sm_max_mhz"]
        if (el >= min_s and ramped) or el >= max_s:
            return c


@dataclass
class ClockRecord:
    """SM clock for converting cycles: NVML after warm-up and after timing, and in-kernel."""

    nvml_after_warmup: float
    nvml_after: float
    sm_max: float
    inkernel: float | None
    warnings: list

    @property
    def mhz(self) -> float:
        return 0.5 * (self.nvml_after_warmup + self.nvml_after)

    def as_dict(self) -> dict:
        d = {"sm_mhz_nvml_after_warmup": self.nvml_after_warmup, "sm_mhz_nvml_after": self.nvml_after,
             "sm_max_mhz": self.sm_max, "sm_mhz_used": self.mhz}
        if self.inkernel is not None:
            d["sm_mhz_inkernel"] = self.inkernel
        return d


def _clock_record(c0: dict, c1: dict, inkernel: float | None) -> ClockRecord:
    w = []
    a, b = float(c0["sm_mhz"]), float(c1["sm_mhz"])
    if not a or not b:
        raise RuntimeError("NVML did not report the SM clock: cannot convert %clock64 cycles to seconds")
    if abs(a - b) > CLOCK_DISAGREE * max(a, b):
        w.append(f"SM clock moved from {a:.0f} to {b:.0f} MHz during the series")
    if c1["sm_max_mhz"] and min(a, b) < CLOCK_DROP_FRACTION * c1["sm_max_mhz"]:
        w.append(f"SM clock {min(a, b):.0f} MHz below {CLOCK_DROP_FRACTION:.0%} of max {c1['sm_max_mhz']} MHz")
    if inkernel is not None and abs(inkernel - 0.5 * (a + b)) > CLOCK_DISAGREE * inkernel:
        w.append(f"in-kernel clock ({inkernel:.0f} MHz = %clock64 / %globaltimer) disagrees with NVML "
                 f"({0.5 * (a + b):.0f} MHz)")
    return ClockRecord(a, b, float(c1["sm_max_mhz"] or 0), inkernel, w)


def measure_loop(h: Harness, k: GenKernel, launches: int) -> tuple[list[np.ndarray], ClockRecord, int]:
    """`launches` checked launches (after one untimed); records, clocks, distinct SMs seen."""
    k.launch()  # module load, first touch
    _sync()
    c0 = h.clocks()
    recs = [k.run_checked() for _ in range(launches)]
    c1 = h.clocks()
    cyc = np.concatenate([r[:, R_TOTAL_CYC] for r in recs]).astype(np.float64)
    ns = np.concatenate([r[:, R_TOTAL_NS] for r in recs]).astype(np.float64)
    ok = ns >= 50_000  # only launches long enough for %globaltimer's tick to be negligible
    inkernel = float(np.median(cyc[ok] / ns[ok] * 1e3)) if ok.any() else None
    distinct = min(len(np.unique(k.smids(r))) for r in recs)
    return recs, _clock_record(c0, c1, inkernel), distinct


def per_sm(values: np.ndarray, warps: int) -> np.ndarray:
    """Per-warp values of one or more launches -> the median over each block's (= SM's) warps.
    Keeps result files small (one sample per SM per launch) without hiding SM-to-SM spread."""
    v = np.asarray(values, dtype=np.float64)
    if v.size % warps:
        raise ValueError(f"{v.size} per-warp values do not split into blocks of {warps} warps")
    return np.median(v.reshape(-1, warps), axis=1)


def _sm_warning(k: GenKernel, distinct: int) -> list[str]:
    if distinct != k.spec.grid:
        return [f"blocks landed on {distinct} distinct SMs, not {k.spec.grid}: one-block-per-SM was not achieved"]
    return []


# --------------------------------------------------------------------------- capacity
def loop_case(gen: Generated, warps: int, passes: int, name: str | None = None) -> Case:
    """A loop kernel as a harness Case (event-timed launches; for pytest-benchmark)."""
    def prepare(h: Harness) -> Prepared:
        mod = compile_many([gen])[gen.name]
        k = GenKernel(h, gen, mod, warps, passes)
        k.run_checked()
        instr = k.passes * gen.body_instructions
        bound = None
        if h.info.sm_clock_max_mhz:  # 0 when NVML is unavailable: no clock, no time bound
            floor_s = instr * issue_floor_cpi(warps) / (h.info.sm_clock_max_mhz * 1e6)
            bound = Bound("time", floor_s, "s", f"issue floor: {instr} instructions per warp x "
                          f"{issue_floor_cpi(warps)} cycles at the max SM clock")
        return Prepared(launch=k.launch, bound=bound,
                        metrics={"code_bytes": k.usage.code_bytes, "body_bytes": gen.body_bytes, "warps_per_sm": warps,
                                 "passes": k.passes})

    blocks = "+".join(f"{b * 16}B" for b in gen.params["blocks"])
    return Case(name or f"loop/w{warps}/{blocks}", {"blocks_bytes": blocks, "warps_per_sm": warps,
                                                    "passes": passes}, prepare)


def run_capacity(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = (not full_sweeps()) if quick is None else quick
    sw = sweep(quick)
    gens = capacity_generators(sw, h.info.arch)
    mods, compile_s = _compile(gens, quick, h.info.arch)
    series: list[Series] = []
    warmed = False
    for w, size, gi in capacity_plan(sw):
        g = gens[gi]
        floor = issue_floor_cpi(w)
        n = g.params["block_sass"][0]
        k = GenKernel(h, g, mods[g.name], w, passes_for(n, sw.capacity_instr_per_launch))
        if not warmed:
            spin_up(h, k.launch)
            warmed = True
        recs, clk, distinct = measure_loop(h, k, sw.capacity_launches)
        rec = np.concatenate(recs)
        cpi = per_sm(rec[:, R_TIMED0] / (k.iters * n), w)
        first = per_sm(rec[:, R_FIRST0] / n, w)
        name = f"capacity/w{w}/{size}B"
        s = Series.from_samples(
            name, cpi, timer="clock64", unit="cycles/instr",
            params={"code_bytes": g.body_bytes, "warps_per_sm": w},
            bound=Bound("time", float(WARP_ISSUE_FLOOR_CPI), "cycles/instr",
                        "issue rate: a warp issues <= 1 instruction/cycle (its own timed window; the SM-wide "
                        f"floor of {floor} cycle(s)/instr at {w} warp(s)/SM binds only the whole launch)"),
            clocks=clk.as_dict(),
            metrics={"ns_per_instr": float(np.median(cpi)) / clk.mhz * 1e3,
                     "seconds_per_pass": float(np.median(rec[:, R_TIMED0])) / k.iters / (clk.mhz * 1e6),
                     "cycles_per_pass": float(np.median(rec[:, R_TIMED0])) / k.iters,
                     "first_pass_cpi": float(np.median(first)), "kernel_code_bytes": k.usage.code_bytes,
                     "body_instructions": n, "requested_bytes": size, "timed_passes": k.iters,
                     "launches": sw.capacity_launches, "samples": "median over each SM's warps, per launch",
                     "registers": k.usage.registers, "distinct_sms": distinct, "clock_mhz_used": clk.mhz,
                     "dense": size in sw.capacity_dense_sizes},
            warnings=clk.warnings + _sm_warning(k, distinct))
        series.append(s)
    curves, names = derive.capacity_curves(series)
    derived, notes = derive.derive_capacity(curves, names)
    notes.append(f"compile step {compile_s:.1f} s ({len(gens)} kernels; the first icache benchmark in a process "
                 "compiles all four's kernels in one process pool, cache hits included)")
    res = Result("icache.capacity", Env.capture(h.device_index), tuple(series), derived, quick=quick,
                 notes=tuple(notes))
    if save:
        res.save()
    return res


# --------------------------------------------------------------------------- spliced blocks
def run_spliced(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = (not full_sweeps()) if quick is None else quick
    sw = sweep(quick)
    alone_g, spl_g = splice_generators(sw, h.info.arch)
    mods, compile_s = _compile([*alone_g.values(), *spl_g.values()], quick, h.info.arch)
    series: list[Series] = []
    derived: dict[str, Derived] = {}
    points: list[derive.SplicePoint] = []
    warmed = False
    for w in sw.splice_warps:
        floor = issue_floor_cpi(w)
        alone_cyc: dict[int, np.ndarray] = {}
        for size, g in alone_g.items():
            n = g.params["block_sass"][0]
            k = GenKernel(h, g, mods[g.name], w, passes_for(n, sw.splice_instr_per_launch, lo=4, hi=1024))
            if not warmed:
                spin_up(h, k.launch)
                warmed = True
            recs, clk, distinct = measure_loop(h, k, sw.splice_launches)
            rec = np.concatenate(recs)
            cyc = per_sm(rec[:, R_TIMED0] / k.iters, w)
            alone_cyc[size] = cyc
            series.append(Series.from_samples(
                f"alone/w{w}/{size}B", cyc / (clk.mhz * 1e6), timer="clock64", unit="s",
                params={"code_bytes": g.body_bytes, "warps_per_sm": w},
                bound=Bound("time", n * floor / (clk.mhz * 1e6), "s",
                            f"issue floor: {n} instructions x {floor} cycle(s) at the measured SM clock"),
                clocks=clk.as_dict(),
                metrics={"cycles_per_pass": float(np.median(cyc)), "cpi": float(np.median(cyc)) / n,
                         "first_pass_cycles": float(np.median(rec[:, R_FIRST0])), "a_bytes": size,
                         "timed_passes": k.iters,
                         "kernel_code_bytes": k.usage.code_bytes, "distinct_sms": distinct},
                warnings=clk.warnings + _sm_warning(k, distinct)))
        for (a, b), g in spl_g.items():
            na, nb = g.params["block_sass"]
            k = GenKernel(h, g, mods[g.name], w, passes_for(na + nb, sw.splice_instr_per_launch, lo=4, hi=1024))
            recs, clk, distinct = measure_loop(h, k, sw.splice_launches)
            rec = np.concatenate(recs)
            ca, cb = per_sm(rec[:, R_TIMED0] / k.iters, w), per_sm(rec[:, R_TIMED0 + 1] / k.iters, w)
            ratio, spread = derive.bootstrap_ratio([ca + cb], [alone_cyc[a], alone_cyc[b]])
            ra = float(np.median(ca) / np.median(alone_cyc[a]))
            rb = float(np.median(cb) / np.median(alone_cyc[b]))
            name = f"spliced/w{w}/{a}B+{b}B"
            series.append(Series.from_samples(
                name, (ca + cb) / (clk.mhz * 1e6), timer="clock64", unit="s",
                params={"code_bytes": g.body_bytes, "a_bytes": a, "b_bytes": b, "warps_per_sm": w},
                bound=Bound("time", (na + nb) * floor / (clk.mhz * 1e6), "s",
                            f"issue floor: {na + nb} instructions x {floor} cycle(s) at the measured SM clock"),
                clocks=clk.as_dict(),
                metrics={"ratio_total": ratio, "ratio_total_lo": spread[0], "ratio_total_hi": spread[1],
                         "ratio_a": ra, "ratio_b": rb,
                         "a_seconds_per_pass": float(np.median(ca)) / (clk.mhz * 1e6),
                         "b_seconds_per_pass": float(np.median(cb)) / (clk.mhz * 1e6),
                         "a_alone_seconds_per_pass": float(np.median(alone_cyc[a])) / (clk.mhz * 1e6),
                         "b_alone_seconds_per_pass": float(np.median(alone_cyc[b])) / (clk.mhz * 1e6),
                         "a_cycles_per_pass": float(np.median(ca)), "b_cycles_per_pass": float(np.median(cb)),
                         "first_pass_cycles_a": float(np.median(rec[:, R_FIRST0])),
                         "first_pass_cycles_b": float(np.median(rec[:, R_FIRST0 + 1])),
                         "kernel_code_bytes": k.usage.code_bytes, "distinct_sms": distinct,
                         "timed_passes": k.iters, "plot_x": "code_bytes"},
                warnings=clk.warnings + _sm_warning(k, distinct)))
            tag = f"w{w}_{a // KiB}K_{b // KiB}K"
            derived[f"spliced_ratio_{tag}"] = Derived(
                ratio, "", "median per-pass cycles of A+B in one loop / (median of A alone + median of B alone); "
                "spread: 5-95% of 400 bootstrap resamples", spread,
                (name, f"alone/w{w}/{a}B", f"alone/w{w}/{b}B"), f"A x{ra:.3f}, B x{rb:.3f} of their solo per-pass time")
            for blk, cyc, size, r in (("a", ca, a, ra), ("b", cb, b, rb)):
                _, sp = derive.bootstrap_ratio([cyc], [alone_cyc[size]])
                derived[f"spliced_block_{blk}_ratio_{tag}"] = Derived(
                    r, "", f"block {blk.upper()}'s ({size // KiB} KiB) own median per-pass cycles in the spliced "
                    "loop / its median alone (the study's 'solo speed' is this ratio = 1); spread: 5-95% of 400 "
                    "bootstrap resamples", (min(sp[0], r), max(sp[1], r)), (name, f"alone/w{w}/{size}B"))
            points.append(derive.SplicePoint(a, b, k.usage.code_bytes, ratio, spread, w, ra, rb))
    d, notes = derive.derive_max_code(points, inputs=tuple(s.name for s in series if s.name.startswith("spliced/")))
    if d is not None:
        derived["max_code_bytes_per_launch"] = d
    notes.append(f"compile step {compile_s:.1f} s ({len(alone_g) + len(spl_g)} kernels, cache hits included)")
    res = Result("icache.spliced", Env.capture(h.device_index), tuple(series), derived, quick=quick, notes=tuple(notes))
    if save:
        res.save()
    return res


# --------------------------------------------------------------------------- launch prefetch
PREFETCH_STATES = ("warm", "icache_cold", "l2_cold")


class PrefetchRig:
    """The probe, the evictor and the sequence each state needs before the measured launch."""

    def __init__(self, h: Harness, probe: Generated, evictor: Generated, mods):
        import torch  # heavy: torch

        self.h = h
        self.probe = GenKernel(h, probe, mods[probe.name], PROBE_WARPS)
        self.evictor = GenKernel(h, evictor, mods[evictor.name], PROBE_WARPS, passes=1)
        self.evictor.run_checked()  # the evictor must itself run its whole body
        self.probe.run_checked()
        # the measured launch writes these; the preceding launches write the kernel's own buffers,
        # so no other kernel (a poison fill) runs between the state's setup and the measurement
        self.rec_b = torch.empty_like(self.probe.rec)
        self.out_b = torch.empty_like(self.probe.out)

    def setup(self, state: str) -> None:
        """Enqueue what precedes the measured probe launch for `state`."""
        if state == "warm":
            self.probe.launch()
        elif state == "icache_cold":
            self.evictor.launch()
        elif state == "l2_cold":
            self.h.flush_l2()
            self.evictor.launch()
        else:
            raise ValueError(f"unknown prefetch state {state!r}; have {PREFETCH_STATES}")

    def sample(self, state: str) -> np.ndarray:
        """One measured probe launch in `state`; checked; returns stamps [warps, nseg+1]."""
        import torch  # heavy: torch

        self.out_b.fill_(float("nan"))
        self.rec_b.fill_(-1)
        self.setup(state)
        self.probe.launch(rec=self.rec_b, out=self.out_b)
        _sync()
        p = self.probe
        if not torch.equal(self.out_b, p.ref):
            raise CorrectnessError(f"probe {p.gen.name} in state {state}: accumulators wrong "
                                   f"({int((self.out_b != p.ref).sum())} of {p.out.numel()})")
        rec = self.rec_b.view(p.nwarps, p.rec_words).cpu().numpy().copy()  # .cpu() of a CPU tensor aliases
        st = rec[:, :p.gen.params["nseg"] + 1]
        if np.any(np.diff(st, axis=1) <= 0):
            raise CorrectnessError(f"probe {p.gen.name} in state {state}: stamps not increasing")
        return st


def probe_case(sw_quick: bool | None = None, state: str = "icache_cold") -> Case:
    """The probe's whole first pass, event-timed, with the state's setup before each sample."""
    def prepare(h: Harness) -> Prepared:
        quick = (not full_sweeps()) if sw_quick is None else sw_quick
        sw = sweep(quick)
        probe, ev = probe_generator(sw, h.info.arch), evictor_generator(h.info.arch)
        rig = PrefetchRig(h, probe, ev, compile_many([probe, ev]))
        rig.sample(state)
        return Prepared(launch=rig.probe.launch, before_each=lambda: rig.setup(state),
                        metrics={"probe_bytes": probe.body_bytes, "state": state})

    return Case(f"prefetch/{state}", {"state": state}, prepare)


def run_prefetch(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = (not full_sweeps()) if quick is None else quick
    sw = sweep(quick)
    probe, ev = probe_generator(sw, h.info.arch), evictor_generator(h.info.arch)
    mods, compile_s = _compile([probe, ev], quick, h.info.arch)
    rig = PrefetchRig(h, probe, ev, mods)
    spin_up(h, rig.evictor.launch)
    c0 = h.clocks()
    stamps = {s: [] for s in PREFETCH_STATES}
    for _ in range(sw.probe_samples):  # states interleaved, so drift hits them alike
        for s in PREFETCH_STATES:
            stamps[s].append(rig.sample(s))
    c1 = h.clocks()
    clk = _clock_record(c0, c1, None)
    seg_sass = np.asarray(probe.params["seg_sass"], dtype=np.float64)
    ends = np.cumsum(seg_sass) * 16  # byte offset (from the first stamp) where each segment ends
    starts = ends - seg_sass * 16
    fixed = rig.probe.usage.code_bytes - probe.body_bytes
    bound = Bound("time", float(issue_floor_cpi(PROBE_WARPS)), "cycles/instr",
                  "issue rate: one instruction per cycle for a lone warp")
    series, curves, whole_by_state = [], {}, {}
    for s in PREFETCH_STATES:
        per_launch = [np.diff(x, axis=1) / seg_sass[None, :] for x in stamps[s]]  # [warps, nseg] each
        seg_cpi = np.concatenate(per_launch)
        whole = np.concatenate([(x[:, -1] - x[:, 0]) for x in stamps[s]]) / seg_sass.sum()
        curves[s] = np.median(seg_cpi, axis=0)
        whole_by_state[s] = Series.from_samples(
            f"prefetch/{s}", whole, timer="clock64", unit="cycles/instr", params={"state": s}, bound=bound,
            clocks=clk.as_dict(),
            metrics={"first_pass_seconds": float(np.median(whole)) * seg_sass.sum() / (clk.mhz * 1e6),
                     "probe_bytes": probe.body_bytes, "seg_bytes": sw.probe_seg_bytes, "warps_per_sm": PROBE_WARPS,
                     "launches": sw.probe_samples, "fixed_code_bytes_before_and_after_body": fixed,
                     "kernel_code_bytes": rig.probe.usage.code_bytes},
            warnings=clk.warnings)
        series.append(whole_by_state[s])
        # one series per segment: samples = per-launch medians over the SMs (p10/p90 over SMs kept)
        for i, (lo, hi) in enumerate(zip(starts, ends)):
            series.append(Series.from_samples(
                f"prefetch/{s}/{int(hi)}B", [float(np.median(x[:, i])) for x in per_launch], timer="clock64",
                unit="cycles/instr", params={"offset_bytes": int(hi), "state": s}, bound=bound,
                metrics={"seg_start_bytes": int(lo), "seg_cpi_p10_over_sms": float(np.percentile(seg_cpi[:, i], 10)),
                         "seg_cpi_p90_over_sms": float(np.percentile(seg_cpi[:, i], 90))}))
    inputs = tuple(x.name for x in whole_by_state.values())
    d, notes = derive.derive_prefetch(ends, curves["icache_cold"], curves["warm"], probe.body_bytes, inputs)
    d = Derived(d.value, d.unit, d.rule + f"; offsets count from the first stamp: the kernel's prologue (part of "
                f"{fixed} B of fixed code) comes before it", d.spread, d.inputs, d.note)
    derived = {"launch_prefetch_bytes": d}
    d2, notes2 = derive.derive_prefetch(ends, curves["l2_cold"], curves["warm"], probe.body_bytes, inputs, "l2_cold")
    derived["launch_prefetch_bytes_l2_cold"] = d2
    for s in ("icache_cold", "l2_cold"):
        r, spread = derive.bootstrap_ratio([whole_by_state[s].samples], [whole_by_state["warm"].samples])
        derived[f"first_pass_ratio_{s}_vs_warm"] = Derived(
            r, "", f"median whole-probe first-pass cycles/instr, {s} / warm; spread 5-95% bootstrap", spread, inputs)
    notes = notes + notes2 + [f"compile step {compile_s:.1f} s (2 kernels, cache hits included)"]
    res = Result("icache.prefetch", Env.capture(h.device_index), tuple(series), derived, quick=quick,
                 notes=tuple(notes))
    if save:
        res.save()
    return res


# --------------------------------------------------------------------------- code vs data in L2
def stream_case(stages: int, bound: Bound | None = None, warps: int = STREAM_WARPS,
                stages_per_warp: int | None = None, passes_override: int | None = None) -> Case:
    """The weights stream run by a body of `stages` stages (see gen.stream_kernel).

    `passes_override` runs a different number of passes than the reference expects: a broken
    launch for proving the check can fail."""
    stages_per_warp = STREAM_STAGES_PER_WARP if stages_per_warp is None else stages_per_warp
    if stages <= 0 or stages_per_warp % stages:
        raise ValueError(f"stream: {stages_per_warp} stages per warp must be a multiple of the body's {stages}")
    if passes_override is not None and not 0 <= passes_override < stages_per_warp // stages:
        raise ValueError("passes_override must be fewer passes than the buffer holds (more would read past it)")

    def prepare(h: Harness) -> Prepared:
        import torch  # heavy: torch

        g = stream_kernel(stages, arch=h.info.arch)
        mod = compile_many([g])[g.name]
        kern = mod.kernel(g.name)
        nwarps = h.info.sm_count * warps
        nbytes = stages_per_warp * nwarps * STAGE_BYTES_PER_WARP
        # integer-valued floats: every partial sum is exact, so any summation order agrees
        w = torch.empty(nbytes // 4, dtype=torch.float32, device=DEVICE).random_(-X_MAX, X_MAX + 1)
        ref = (w.view(stages_per_warp // stages, nwarps, stages, 8, 32, 4).sum((0, 2))
               .permute(0, 2, 1, 3).reshape(nwarps * 32, NACC))
        out = torch.empty_like(ref)
        spec = LaunchSpec(grid=h.info.sm_count, block=32 * warps, smem=one_block_per_sm_smem(h.info))
        passes = passes_override if passes_override is not None else stages_per_warp // stages
        stride = np.uint64(nwarps * stages * STAGE_BYTES_PER_WARP)

        def go():
            launch(kern, spec, w, out, np.uint32(passes), stride, np.float32(np.inf))

        for _ in range(2):
            out.fill_(float("nan"))
            go()
            _sync()
            if not torch.equal(out, ref):
                bad = int((out != ref).sum())
                raise CorrectnessError(f"stream {g.name} ({stages} stages x {passes} passes): {bad} of {out.numel()} "
                                       f"sums wrong")
        u = mod.usage(g.name)
        return Prepared(launch=go, bound=bound, work=float(nbytes),
                        metrics={"code_bytes": u.code_bytes, "body_bytes": g.body_bytes, "stages": stages,
                                 "passes": passes, "bytes_read": nbytes, "registers": u.registers,
                                 "warps_per_sm": warps})

    return Case(f"stream/{stages}stages", {"stages": stages, "warps_per_sm": warps,
                                           "stages_per_warp": stages_per_warp}, prepare)


def _overflow_note(h: Harness, over_bytes: int, fit_bytes: int) -> str:
    """Does the 'overflowing' body really exceed the capacity measured on this GPU model?"""
    cap = latest("icache.capacity", gpu=getattr(h.info, "name", None))
    levels = {k: d.value for k, d in (cap.derived.items() if cap else ()) if k in ("icache_l0_bytes",
                                                                                 "icache_sm_bytes")}
    if not levels:
        return (f"no icache.capacity result for this GPU yet: cannot confirm the {over_bytes} B body overflows "
                f"(and the {fit_bytes} B one fits) the instruction cache")
    top = max(levels.values())
    return (f"{over_bytes} B body vs the largest measured level ({top:.0f} B, {cap.env.date[:10]}): "
            + ("overflows" if over_bytes > top else "does NOT overflow it: the comparison shows no capacity effect")
            + f"; the {fit_bytes} B body " + ("fits" if fit_bytes <= top else "does NOT fit"))


def run_code_vs_data(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = (not full_sweeps()) if quick is None else quick
    sw = sweep(quick)
    _, compile_s = _compile([stream_kernel(s, arch=h.info.arch) for s in sw.stream_stages], quick, h.info.arch)
    mem = run_case(h, copy_case(1 << 30, "memcpy"))
    rate = 2.0 * (1 << 30) / mem.summary.median
    bound = Bound("bandwidth", rate, "B/s", "driver D2D memcpy of 1 GiB measured in this run (bytes read + written "
                  "per second); a read-only stream may slightly exceed it")
    series = [mem]
    for st in sw.stream_stages:
        series.append(run_case(h, stream_case(st, bound)))
    streams = series[1:]
    fit, over = streams[0], streams[-1]
    r, spread = derive.bootstrap_ratio([over.samples], [fit.samples])
    derived = {
        "icache_overflow_stream_slowdown": Derived(
            r, "", f"median time of the stream run by a {over.metrics['code_bytes']} B kernel / by a "
            f"{fit.metrics['code_bytes']} B kernel (same bytes, same instructions per byte); spread 5-95% bootstrap",
            spread, (over.name, fit.name)),
    }
    for s in streams:
        derived[f"stream_bandwidth_{s.metrics['stages']}stages"] = Derived(
            s.achieved, "B/s", "bytes read / median event time", None, (s.name,),
            f"{s.metrics['code_bytes']} B of code; {s.fraction_of_bound:.1%} of the measured memcpy rate")
    peak = hbm_peak(h.info.name)
    notes = [f"bound: memcpy {rate / 1e12:.2f} TB/s measured; datasheet HBM peak "
             f"{peak / 1e12 if peak else float('nan'):.2f} TB/s (context only)",
             _overflow_note(h, over.metrics["body_bytes"], fit.metrics["body_bytes"]),
             f"compile step {compile_s:.1f} s ({len(sw.stream_stages)} kernels, cache hits included)"]
    res = Result("icache.code_vs_data", Env.capture(h.device_index), tuple(series), derived, quick=quick,
                 notes=tuple(notes))
    if save:
        res.save()
    return res


BENCHMARKS = {"icache.capacity": run_capacity, "icache.spliced": run_spliced, "icache.prefetch": run_prefetch,
              "icache.code_vs_data": run_code_vs_data}
