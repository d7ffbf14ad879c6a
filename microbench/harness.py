"""The one timing harness. Benchmarks supply a launcher; this module owns everything else.

How a sample is taken (device time, CUDA events):
  1. a blocking kernel holds the stream until the host has queued the whole chunk of samples,
     so no event is recorded while the host is still submitting (otherwise a short kernel's
     "time" is the host's launch rate);
  2. per sample: optional L2 flush (>= 2x L2, read-modify-write), start event, `batch` launches,
     stop event; sample = elapsed / batch;
  3. the host releases the stream, synchronises, reads the events.
Warm-up and sampling are time budgets (seconds of device time), with min/max sample counts.
`hold=False` drops step 1 for launchers that enqueue more work than the stream's launch queue
holds (a torch eager step of thousands of kernels would block the host behind the blocking
kernel until it times out): each sample then starts from an idle device, so its time includes
the host's submission of the launches, i.e. the latency a caller of that launcher sees.
The SM clock is read (NVML) before and after each series; a drop below 75% of max, or a
blocking kernel that timed out, becomes a warning carried into the result.

`DeviceClock` lets pytest-benchmark judge device time: its timer returns accumulated device
seconds, advanced by each measured sample (see conftest.py's `device_bench` fixture).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .compiler import compile_cuda
from .device import read_clocks, require_gpu
from .launch import LaunchSpec, ensure_context, launch
from .results import Bound, Series

HARNESS_SRC = Path(__file__).resolve().parent / "cuda" / "harness.cu"
BLOCK_TIMEOUT_NS = 2_000_000_000  # the blocking kernel gives up after 2 s (then samples are suspect)
CLOCK_DROP_FRACTION = 0.75  # nvbench's throttle threshold


def full_sweeps() -> bool:
    """Quick (default) or full sweeps: MEGABENCH_FULL=1 or pytest --megabench-full."""
    return os.environ.get("MEGABENCH_FULL", "0") not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Policy:
    warmup_s: float = 0.02
    budget_s: float = 0.15  # device seconds of samples per series
    min_samples: int = 10
    max_samples: int = 400
    chunk: int = 32  # samples queued behind one blocking kernel
    max_wall_s: float = 20.0  # hard stop for a single series (wall clock)

    @classmethod
    def default(cls) -> Policy:
        return cls(budget_s=0.6, max_samples=2000, min_samples=20) if full_sweeps() else cls()


@dataclass(frozen=True)
class Timing:
    samples_s: np.ndarray  # device seconds per launch (batch-averaged)
    batch: int
    cold: bool
    clocks: Mapping[str, float]
    warnings: tuple[str, ...] = ()

    @property
    def median_s(self) -> float:
        return float(np.median(self.samples_s))


@dataclass
class Harness:
    device_index: int = 0
    policy: Policy = field(default_factory=Policy.default)

    def __post_init__(self):
        self.info = require_gpu(self.device_index)
        ensure_context(self.device_index)
        import torch  # heavy: torch

        self._torch = torch
        mod = compile_cuda(HARNESS_SRC, arch=self.info.arch)
        self._k_block = mod.kernel("mb_block_stream")
        self._k_flush = mod.kernel("mb_flush_l2")
        self._k_empty = mod.kernel("mb_empty")
        self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._status = torch.zeros(1, dtype=torch.int32, device="cuda")
        self._flush_buf = None

    # ------------------------------------------------------------------ building blocks
    def flush_l2(self) -> None:
        """Queue an L2 eviction pass (2x L2 bytes, read-modify-write)."""
        if self._flush_buf is None:
            n = 2 * self.info.l2_bytes
            self._flush_buf = self._torch.empty(n // 4, dtype=self._torch.int32, device="cuda").random_()
        n16 = self._flush_buf.numel() * 4 // 16
        launch(self._k_flush, LaunchSpec(grid=self.info.sm_count * 4, block=512), self._flush_buf, np.uint64(n16))

    def empty_kernel(self):
        return self._k_empty

    def _block(self) -> None:
        self._flag[0] = 0
        self._status.zero_()
        launch(self._k_block, LaunchSpec(grid=1, block=1), self._flag.data_ptr(),
               np.uint64(BLOCK_TIMEOUT_NS), self._status)

    def _release(self) -> None:
        self._flag[0] = 1

    def clocks(self) -> dict:
        c = read_clocks(self.device_index)
        return {"sm_mhz": c.sm_mhz, "mem_mhz": c.mem_mhz, "sm_max_mhz": c.sm_max_mhz}

    # ------------------------------------------------------------------ measuring
    def time(self, launch: Callable[[], None], *, batch: int = 1, cold: bool = False,
             policy: Policy | None = None, before_each: Callable[[], None] | None = None,
             hold: bool = True) -> Timing:
        """Device time per call of `launch` (which must only enqueue work on torch's stream).

        `batch` > 1 averages back-to-back launches inside one event pair (throughput of
        repeated launches, for kernels shorter than the event resolution). `cold` flushes L2
        before every sample. `before_each` enqueues untimed work before every sample (e.g.
        rotating inputs or resetting flags); it runs outside the events. `hold=False`: no
        blocking kernel; every sample starts on an idle device and includes host submission.
        """
        torch = self._torch
        pol = policy or self.policy
        if batch < 1:
            raise ValueError("batch must be >= 1")
        warnings = []
        c0 = self.clocks()
        # warm-up: compile/JIT/module load and clock ramp stay out of the samples
        t_end = time.perf_counter() + pol.warmup_s
        n_warm = 0
        while pol.warmup_s > 0:
            if before_each:
                before_each()
            launch()
            n_warm += 1
            if n_warm >= 3 and time.perf_counter() >= t_end:
                break
            if n_warm % 16 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        samples: list[float] = []
        total = 0.0
        wall0 = time.perf_counter()
        chunk = pol.chunk
        while len(samples) < pol.max_samples:
            k = min(chunk, pol.max_samples - len(samples))
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
            stops = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
            if hold:
                self._block()
            for i in range(k):
                if not hold:
                    torch.cuda.synchronize()  # idle device: the sample includes the host's submission
                if cold:
                    self.flush_l2()
                if before_each:
                    before_each()
                if not hold and (cold or before_each):
                    torch.cuda.synchronize()  # untimed work must not overlap the host's submission
                starts[i].record()
                for _ in range(batch):
                    launch()
                stops[i].record()
            if hold:
                self._release()
            torch.cuda.synchronize()
            if hold and int(self._status.item()) != 0:
                warnings.append(f"blocking kernel timed out with a chunk of {k}: chunk halved and redone")
                if chunk == 1:
                    raise RuntimeError("blocking kernel timed out even for a single sample: "
                                       "the launcher takes longer than 2 s to enqueue")
                chunk = max(1, chunk // 2)
                continue
            got = [s.elapsed_time(e) * 1e-3 / batch for s, e in zip(starts, stops)]
            samples += got
            total += sum(got) * batch
            if len(samples) >= pol.min_samples and (total >= pol.budget_s
                                                    or time.perf_counter() - wall0 > pol.max_wall_s):
                break
        c1 = self.clocks()
        clocks = {"sm_mhz_before": c0["sm_mhz"], "sm_mhz_after": c1["sm_mhz"], "sm_max_mhz": c1["sm_max_mhz"],
                  "mem_mhz_after": c1["mem_mhz"]}
        if c1["sm_max_mhz"] and c1["sm_mhz"] < CLOCK_DROP_FRACTION * c1["sm_max_mhz"]:
            warnings.append(f"SM clock {c1['sm_mhz']} MHz after the series is below "
                            f"{CLOCK_DROP_FRACTION:.0%} of max {c1['sm_max_mhz']} MHz (throttled or idle-clocked)")
        return Timing(np.asarray(samples), batch, cold, clocks, tuple(warnings))

    def series(self, name: str, launch: Callable[[], None], *, params: Mapping[str, object] | None = None,
               bound: Bound | None = None, work: float | None = None, batch: int = 1, cold: bool = False,
               policy: Policy | None = None, before_each: Callable[[], None] | None = None,
               metrics: Mapping[str, object] | None = None, hold: bool = True) -> Series:
        """time() packaged as a typed Series (samples in seconds, timer 'cuda_event')."""
        t = self.time(launch, batch=batch, cold=cold, policy=policy, before_each=before_each, hold=hold)
        p = dict(params or {})
        p.setdefault("batch", batch)
        p.setdefault("cold", cold)
        if not hold:
            p.setdefault("stream_held", False)  # samples include host submission (see time())
        return Series.from_samples(name, t.samples_s, timer="cuda_event", unit="s", params=p, bound=bound,
                                   work=work, clocks=t.clocks, metrics=metrics, warnings=t.warnings)


# ---------------------------------------------------------------------- in-kernel timers
def cycles_to_seconds(cycles, sm_mhz: float) -> np.ndarray:
    """%clock64 deltas -> seconds at a measured SM clock (MHz)."""
    if not sm_mhz or sm_mhz <= 0:
        raise ValueError("converting cycles needs the measured SM clock in MHz")
    return np.asarray(cycles, dtype=np.float64) / (sm_mhz * 1e6)


def globaltimer_seconds(stamps_ns, tick_ns: float | None = None) -> np.ndarray:
    """%globaltimer stamps (ns) -> seconds relative to the first. With a measured tick, values
    shorter than the tick are meaningless; callers report nothing below a few ticks."""
    x = np.asarray(stamps_ns, dtype=np.int64)
    return (x - x.min()).astype(np.float64) * 1e-9


# ---------------------------------------------------------------------- pytest-benchmark bridge
class DeviceClock:
    """A pytest-benchmark timer that returns accumulated device seconds.

    pytest-benchmark calls timer() before and after the target; the target advances the clock by
    the device time it measured, so each round's duration is device time, and min/median/
    --benchmark-compare-fail judge the GPU, not the host.
    """

    __name__ = "megabench.device_clock"

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += float(seconds)

    def __repr__(self):
        return "megabench.device_clock(cuda_event)"


def quick_policy(**kw) -> Policy:
    return replace(Policy(), **kw)


# ---------------------------------------------------------------------- cases
@dataclass
class Prepared:
    """What a benchmark case hands the harness after allocating and checking correctness."""

    launch: Callable[[], None]
    bound: Bound | None = None
    work: float | None = None  # bytes/flops per launch, for bandwidth/throughput bounds
    batch: int = 1
    cold: bool = False
    before_each: Callable[[], None] | None = None
    metrics: Mapping[str, object] = field(default_factory=dict)
    hold: bool = True  # False: time from an idle device without the blocking kernel (Harness.time)
    # checks the last sample's launches once the timing is done (statuses, watchdog: a wait that gave
    # up during the timed samples fails the case instead of its time counting); None: nothing to check
    after: Callable[[], None] | None = None


@dataclass(frozen=True)
class Case:
    """A named benchmark point: `prepare(harness)` allocates fresh random inputs, runs the
    kernel once, asserts its output against a reference (raising CorrectnessError), and only
    then returns the launcher to be timed. The same Case feeds `megabench run` and pytest."""

    name: str
    params: Mapping[str, object]
    prepare: Callable[[Harness], Prepared]


def run_case(h: Harness, case: Case, policy: Policy | None = None) -> Series:
    p = case.prepare(h)
    s = h.series(case.name, p.launch, params=case.params, bound=p.bound, work=p.work, batch=p.batch,
                 cold=p.cold, policy=policy, before_each=p.before_each, metrics=p.metrics, hold=p.hold)
    if p.after is not None:
        p.after()
    return s


def sample_once(h: Harness, p: Prepared) -> float:
    """One blocked, event-timed sample of a prepared case (seconds per launch)."""
    pol = replace(h.policy, warmup_s=0.0, min_samples=1, max_samples=1, chunk=1)
    t = h.time(p.launch, batch=p.batch, cold=p.cold, policy=pol, before_each=p.before_each, hold=p.hold)
    return float(t.samples_s[0])
