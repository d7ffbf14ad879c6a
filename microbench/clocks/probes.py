"""GPU probes of the clocks class. Every function takes a device index and, where a flag is
involved, optional flag/counter pointers, so the multi-GPU benchmarks (GPU-to-GPU skew) call the
same code per device with a peer-mapped flag instead of assuming device 0.
"""
from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..compiler import CompiledModule, compile_cuda
from ..device import device_info, read_clocks
from ..errors import CorrectnessError
from ..launch import LaunchSpec, ensure_context, launch
from ..watchdog import Watchdog
from .analysis import TickStats, analyse_rate, analyse_tick, check_skew
from .events import LAUNCH, TIMERS
from .profiler import PROFILE_OFF, ProfileBuffer, ProfileLayout, Timeline

SRC = Path(__file__).resolve().parent
SPIN_BOUND_NS = 500_000_000  # a skew/chain wait that takes longer than 0.5 s is broken, not slow

# timers.cu is always built with the profiler on (clk_stamp_cost needs it; the other kernels
# in it do not use it), so the benchmark and the ncu subprocess share one cached cubin.
TIMERS_DEFINES = {"MB_PROFILE": 1, "MB_PROF_CLOCK64": 1}
TIMERS_DEFINES_NO_CLOCK64 = {"MB_PROFILE": 1, "MB_PROF_CLOCK64": 0}
LAUNCH_DEFINES = {"MB_PROFILE": 1, "MB_PROF_CLOCK64": 1}


def module(name: str, device: int = 0, defines: dict | None = None) -> CompiledModule:
    return compile_cuda(SRC / f"{name}.cu", arch=device_info(device).arch, defines=defines or {})


@contextlib.contextmanager
def on_device(device: int):
    """Make `device` current for torch (allocations, the current stream) and cuda.core."""
    import torch  # heavy: torch

    ensure_context(device)
    with torch.cuda.device(device):
        yield


def _u64(n: int, device: int):
    import torch  # heavy: torch

    return torch.zeros(n, dtype=torch.int64, device=f"cuda:{device}")


def _np_u64(t) -> np.ndarray:
    return t.cpu().numpy().view(np.uint64)


# ====================================================================================== timers
def tick_probe(device: int = 0, blocks: int = 8, max_changes: int = 1024, max_reads: int = 1 << 24,
               max_ns: int = 50_000_000) -> TickStats:
    """Back-to-back %globaltimer reads on lane 0 of `blocks` blocks; every change logged."""
    import torch  # heavy: torch

    with on_device(device):
        k = module("timers", device, TIMERS_DEFINES).kernel("clk_tick_probe")
        inc = _u64(blocks * max_changes, device)
        cyc = _u64(blocks * max_changes, device)
        info = torch.zeros(blocks * 4, dtype=torch.int32, device=f"cuda:{device}")
        launch(k, LaunchSpec(grid=blocks, block=32), np.uint32(max_changes), np.uint32(max_reads),
               np.uint64(max_ns), inc, cyc, info)
        torch.cuda.synchronize(device)
        return analyse_tick(_np_u64(inc).reshape(blocks, max_changes), _np_u64(cyc).reshape(blocks, max_changes),
                            info.cpu().numpy().reshape(blocks, 4))


@dataclass(frozen=True)
class RateProbe:
    mhz: np.ndarray  # per block (one per SM), effective SM clock over the interval
    cycles: np.ndarray
    ns: np.ndarray
    sm: np.ndarray
    nvml_mhz: tuple[int, ...]  # NVML SM clock sampled while the kernel ran
    nvml_max_mhz: int


def clock_rate_probe(device: int = 0, interval_ns: int = 50_000_000, nvml_samples: int = 3) -> RateProbe:
    """%clock64 cycles against %globaltimer ns over `interval_ns`, one block per SM, with NVML
    read from the host while the kernel runs."""
    import torch  # heavy: torch

    info = device_info(device)
    with on_device(device):
        k = module("timers", device, TIMERS_DEFINES).kernel("clk_rate_probe")
        out = _u64(info.sm_count * 5, device)
        launch(k, LaunchSpec(grid=info.sm_count, block=32), np.uint64(interval_ns), out)
        nv = []
        for _ in range(nvml_samples):
            time.sleep(interval_ns * 1e-9 / (nvml_samples + 1))
            nv.append(read_clocks(device).sm_mhz)
        torch.cuda.synchronize(device)
        r = analyse_rate(_np_u64(out).reshape(info.sm_count, 5))
    return RateProbe(r["mhz"], r["cycles"], r["ns"], r["sm"], tuple(nv), read_clocks(device).sm_max_mhz)


READ_MODES = {0: "loop", 1: "globaltimer", 2: "clock64", 3: "globaltimer+clock64"}
READS_PER_ITER = 32  # CLK_READS_PER_ITER in timers.cu (mode 3 reads a pair per slot)


def read_cost_probe(device: int = 0, iters: int = 256, reps: int = 16) -> dict[str, np.ndarray]:
    """Cycles per read (per pair for mode 3), minus the same loop without reads; `reps` launches
    per mode after one warm-up launch (instruction cache), paired rep by rep with the baseline."""
    import torch  # heavy: torch

    with on_device(device):
        k = module("timers", device, TIMERS_DEFINES).kernel("clk_read_cost")
        out = _u64(2, device)
        cyc: dict[int, list[int]] = {m: [] for m in READ_MODES}
        for r in range(reps + 1):
            for m in READ_MODES:
                launch(k, LaunchSpec(grid=1, block=32), np.uint32(m), np.uint32(iters), out)
                torch.cuda.synchronize(device)
                if r:
                    cyc[m].append(int(_np_u64(out)[0]))
    base = np.asarray(cyc[0], dtype=np.float64)
    n = iters * READS_PER_ITER
    res = {READ_MODES[m]: (np.asarray(cyc[m], dtype=np.float64) - base) / n for m in (1, 2, 3)}
    res["loop"] = base / n
    return res


def stamp_cost_probe(device: int = 0, n: int = 256, reps: int = 16, clock64: bool = True) -> np.ndarray:
    """Cycles per profiler stamp (lane 0, back to back, records in capacity) minus the same loop
    with the profiler given a null buffer. The recorded stamps are decoded and checked first."""
    import torch  # heavy: torch

    defines = TIMERS_DEFINES if clock64 else TIMERS_DEFINES_NO_CLOCK64
    with on_device(device):
        k = module("timers", device, defines).kernel("clk_stamp_cost")
        pb = ProfileBuffer(ProfileLayout(blocks=1, warps=1, cap=n), device=device)
        out = _u64(1, device)
        on, off = [], []
        for r in range(reps + 1):
            pb.reset()
            launch(k, LaunchSpec(grid=1, block=32), np.uint32(n), out, *pb.args())
            torch.cuda.synchronize(device)
            if r == 0:
                tl = Timeline.build(pb.read(), TIMERS, strict=True)
                args = [i.arg for i in tl.instants]
                if args != list(range(n)) or any(i.name != "mark" for i in tl.instants):
                    raise CorrectnessError(f"stamp-cost loop: expected {n} 'mark' stamps with args 0..{n - 1}, "
                                           f"decoded {len(args)}")
                if clock64 != tl.stamps.has_clock64:
                    raise CorrectnessError(f"stamp-cost loop: clock64 recorded={tl.stamps.has_clock64}, "
                                           f"built with MB_PROF_CLOCK64={int(clock64)}")
            else:
                on.append(int(_np_u64(out)[0]))
            launch(k, LaunchSpec(grid=1, block=32), np.uint32(n), out, *PROFILE_OFF)
            torch.cuda.synchronize(device)
            if r:
                off.append(int(_np_u64(out)[0]))
    return (np.asarray(on, dtype=np.float64) - np.asarray(off, dtype=np.float64)) / n


# ====================================================================================== skew
def skew_wait_names() -> dict[int, str]:
    """What each watchdog id of skew.cu waits for, parsed from its SkewWait enum (one copy)."""
    text = (SRC / "skew.cu").read_text()
    return {int(m.group(2)): f"skew_wait_{m.group(1).lower()}"
            for m in re.finditer(r"SKEW_WAIT_([A-Z_]+)\s*=\s*(\d+)u", text)}


@dataclass
class SkewRun:
    """An enqueued skew launch; collect() synchronises, checks and returns the stamps."""

    device: int
    trials: int
    gt: object
    c64: object
    sm: object
    wd: object
    flag: object
    arrive: object
    sm_count: int | None
    keep: list = field(default_factory=list)


class SkewProbe:
    """One stamper block per SM (dynamic smem above half the SM's, so no two share an SM)."""

    def __init__(self, device: int = 0):
        self.device = device
        self.info = device_info(device)
        self.kernel = None
        with on_device(device):
            self.kernel = module("skew", device).kernel("clk_skew")
        self.spec = LaunchSpec(grid=self.info.sm_count, block=64, smem=self.info.smem_per_block_optin)

    def launch(self, trials: int, *, flag=None, arrive=None, expected: int | None = None, releaser: bool = True,
               sys_scope: bool = False, min_delay_cycles: int = 2000, jitter_cycles: int = 4000,
               bound_ns: int = SPIN_BOUND_NS) -> SkewRun:
        """Enqueue one skew kernel of `trials` trials. flag/arrive: u32 pointers (int or tensor)
        shared with other grids (then set `expected` to all their stampers, releaser=False on all
        but one, sys_scope=True); default: fresh zeroed counters on this device."""
        import torch  # heavy: torch

        blocks = self.spec.blocks
        expected = blocks if expected is None else int(expected)
        if trials < 1 or trials * expected >= 2**31:
            raise ValueError(f"trials={trials} x expected={expected} must be in [1, 2^31)")
        with on_device(self.device):
            dev = f"cuda:{self.device}"
            keep = []
            if flag is None:
                flag = torch.zeros(1, dtype=torch.int32, device=dev)
            if arrive is None:
                arrive = torch.zeros(1, dtype=torch.int32, device=dev)
            gt = _u64(trials * blocks, self.device)
            c64 = _u64(trials * blocks, self.device)
            sm = torch.full((blocks,), -1, dtype=torch.int32, device=dev)
            wd = Watchdog(bound_ns, device=dev)
            launch(self.kernel, self.spec, flag, arrive, np.uint32(expected), np.uint32(trials),
                   np.uint32(1 if releaser else 0), np.uint32(1 if sys_scope else 0), np.uint32(min_delay_cycles),
                   np.uint32(jitter_cycles), gt, c64, sm, wd.ptr, np.uint64(bound_ns), persistent=True)
            keep += [flag, arrive]
        return SkewRun(self.device, trials, gt, c64, sm, wd, flag, arrive, self.info.sm_count, keep)

    @staticmethod
    def collect(run: SkewRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gt[T, B], c64[T, B], sm[B]) after synchronising; raises on a watchdog trip or bad data."""
        import torch  # heavy: torch

        torch.cuda.synchronize(run.device)
        names = skew_wait_names()
        run.wd.check(lambda w: names.get(w, f"wait id {w}"), context=f"skew kernel on GPU {run.device}")
        T = run.trials
        gt = _np_u64(run.gt).reshape(T, -1)
        c64 = _np_u64(run.c64).reshape(T, -1)
        sm = run.sm.cpu().numpy().astype(np.int64)
        check_skew(gt, c64, sm, run.sm_count)
        return gt, c64, sm

    def run(self, trials: int, **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.collect(self.launch(trials, **kw))


# ====================================================================================== launch chains
CHAIN_CONFIGS = ("exclusive", "shared")  # one block per SM at a time / two can share an SM


def chain_smem(info, config: str) -> int:
    """Dynamic smem per block. 'exclusive': the opt-in maximum, so a block of launch k+1 cannot
    land on an SM until launch k's block there has left. 'shared': just under half an SM's, so one
    block of k and one of k+1 fit on an SM together (the SM ids recorded show where they went)."""
    if config == "exclusive":
        return info.smem_per_block_optin
    if config == "shared":
        return (info.smem_per_sm // 2 - info.reserved_smem_per_block) // 1024 * 1024 - 4096
    raise ValueError(f"chain config {config!r}: use one of {CHAIN_CONFIGS}")


def chain_run(h, *, launches: int = 8, pdl: bool = False, config: str = "exclusive", work_ns: int = 20_000,
              jitter_ns: int = 1_000, device: int = 0):
    """`launches` back-to-back launches of clk_chain (the first plain, the rest plain or PDL),
    queued behind the harness's blocking kernel so the host's submission rate is not measured.
    Returns the decoded Timeline (globaltimer clock; clock64 recorded too)."""
    import torch  # heavy: torch

    if device != h.device_index:
        raise ValueError(f"chain_run on GPU {device} needs a Harness of that GPU (got GPU {h.device_index})")
    info = h.info
    with on_device(device):
        k = module("launch", device, LAUNCH_DEFINES).kernel("clk_chain")
        smem = chain_smem(info, config)
        first = LaunchSpec(grid=info.sm_count, block=32, smem=smem)
        rest = LaunchSpec(grid=info.sm_count, block=32, smem=smem, pdl=pdl)
        pb = ProfileBuffer(ProfileLayout(blocks=info.sm_count, warps=1, cap=4), launches=launches, device=device)
        sink = torch.zeros(info.sm_count, dtype=torch.int32, device=f"cuda:{device}")
        # load/check outside the chain (module load, co-residency, smem opt-in)
        launch(k, first, np.uint64(1000), np.uint64(0), sink, *PROFILE_OFF, persistent=True)
        launch(k, rest, np.uint64(1000), np.uint64(0), sink, *PROFILE_OFF, persistent=True)
        torch.cuda.synchronize(device)
        h._block()  # the harness's blocking kernel: the whole chain is queued before any of it runs
        try:
            for i in range(launches):
                launch(k, first if i == 0 else rest, np.uint64(work_ns), np.uint64(jitter_ns), sink, *pb.args(i))
        finally:
            h._release()
        torch.cuda.synchronize(device)
        if int(h._status.item()) != 0:
            raise CorrectnessError("blocking kernel timed out before the chain was queued: gaps would be host time")
        names = [f"{'pdl' if (pdl and i) else 'plain'} launch {i}" for i in range(launches)]
        return Timeline.build(pb.read(), LAUNCH, strict=True, launch_names=names)
