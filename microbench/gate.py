"""The stored-results gate: a verdict per series from two sets of saved results.

The stored rule, per series present on both sides:

  slowdown  = median(candidate) / median(baseline) - 1   (inverted for rates, unit ".../s")
  noise     = max(relative IQR of the baseline's independent repeats, the same of the candidate,
                  the A/A cross-run spread of this series on this GPU model: gate.aa_spread)
  threshold = max(floor, k * noise)                      (defaults: floor 5%, k = 1)
  REGRESSION  when slowdown > threshold AND a one-sided Mann-Whitney U test on the independent
              repeats says the candidate is slower with p < alpha    (default alpha = 0.01)
  IMPROVEMENT the mirror image; SAME otherwise.

Independent repeats: a launch, never one SM of a launch. A CUDA-event or host series holds one
launch (or one timed batch) per sample. An in-kernel series (clock64 / globaltimer) holds many
samples per launch (132 SMs x 3 launches for icache.capacity): its repeats are its launches
(`metrics["independent_repeats"]` when the benchmark records it, else params/metrics `repeats`,
`runs` or `launches`, else one launch), and where the layout is recorded
(`metrics["repeat_layout"] == "contiguous"`) the gate compares per-launch medians.

Fit to gate, else listed as "not gated" with the reason (never a failure, never silent):
  - an in-kernel series with fewer than `min_samples` (8) independent launches;
  - a duration (s, ns, cycles) whose median is negative or under 4 ticks of its timer (the fence
    and PDL series: differences of two timings, or offsets that can be negative). Timer ticks:
    cuda_event 0.5 us per event pair (divided by the samples' batch), globaltimer the recorded
    `tick_ns` (32 ns measured on the H200; 1 us assumed elsewhere), clock64 one SM cycle, host 0.1 us;
  - a unit without a direction, `metrics["gate_direction"] == "none"`, `metrics["gated"] is False`,
    static values, and profiler accounting (timer `cupti`: per-kernel times of profiled, un-graphed
    passes).
UNKNOWN (not a pass) when a side has no raw samples, or a CUDA-event / host series has fewer than
`min_samples` samples on a side: the run was too short to judge.

The cross-run term comes from recorded A/A runs (the same build on two fresh machines, `megabench
gate --quality-run`, combined by `megabench gate --quality`): per series when that series was in
them, else the 90th percentile over its class's series, else over all. Without any gate.aa_spread
for the GPU the report says so: within-run noise alone under-states what a second run shows.

Baselines are per GPU model and max SM clock (`Env.gpu_key`). A pytest-benchmark JSON records
its GPU in `machine_info["megabench"]["gpu_key"]`; one that does not is refused unless
`--assume-gpu KEY` says which GPU it came from. Comparing different GPUs is refused. A
pytest-benchmark case whose round covered several steps (extra_info `steps_per_round`, before
`time_per: step`) is compared per step.

Exit codes (every gate):
  0  no regression (and every verdict known, or --allow-unknown)
  1  at least one regression (timing) / metric increase beyond its threshold (kernels)
  2  bad input: unreadable, malformed or unknown files, bad arguments, a kernel that fails to compile;
     in-run A/B: a revision that does not exist or does not build, a case failing its check
  3  refused: baseline and candidate come from different GPU models/clocks, or a side's GPU is unknown
  4  no regression, but some verdicts are unknown (or nothing could be compared, or a case is on one
     side only), without --allow-unknown
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tabulate import tabulate

from .errors import ResultsFileError
from .results import REPO_ROOT, find, load, read_json, results_root
from .results import SCHEMA as RESULT_SCHEMA
from .stats import Summary, mann_whitney

EXIT_OK, EXIT_REGRESSION, EXIT_INPUT, EXIT_GPU, EXIT_UNKNOWN = 0, 1, 2, 3, 4
DIMENSIONLESS = {"", "1", "fraction", "ratio", "%", "count", "bool", "x"}
IN_KERNEL_TIMERS = ("clock64", "globaltimer")
MIN_TICKS = 4  # a duration must span at least this many ticks of its timer to be gated
CUDA_EVENT_RESOLUTION_S = 0.5e-6  # CUDA's documented event resolution, per event pair
HOST_RESOLUTION_S = 1e-7
GLOBALTIMER_TICK_NS = {"NVIDIA H200": 32.0}  # measured (clocks.timers); elsewhere assume 1 us
GLOBALTIMER_UNKNOWN_TICK_NS = 1000.0
DURATION_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}  # unit -> seconds


class GpuMismatchError(ResultsFileError):
    """Baseline and candidate are from different GPUs (or one side's GPU is unknown)."""


@dataclass(frozen=True)
class GateConfig:
    floor: float = 0.05
    k: float = 1.0
    alpha: float = 0.01
    min_samples: int = 8

    def describe(self) -> str:
        return (f"regression = slowdown > max(floor {self.floor:.0%}, k={self.k:g} x noise) and one-sided "
                f"Mann-Whitney p < {self.alpha:g} on independent repeats; noise = max relative IQR of the two "
                f"sides' independent repeats and the series' A/A cross-run spread (gate.aa_spread); "
                f"unknown without >= {self.min_samples} independent repeats a side")


@dataclass(frozen=True)
class Measurement:
    key: str  # what is compared with what: "<benchmark>:<series>" or a pytest-benchmark fullname
    samples: tuple[float, ...] | None
    median: float
    rel_iqr: float | None
    unit: str
    direction: str  # "lower" | "higher" | "none"
    gpu_key: str | None
    source: str
    date: str
    static: bool = False
    run: str = ""  # the benchmark whose newest run a folder keeps ("" : the key itself)
    repeats: int | None = None  # independent repeats the samples hold (None: one per sample)
    repeats_how: str = ""
    contiguous: bool = False  # samples of one repeat are contiguous: per-repeat medians can be formed
    not_gated: str = ""  # why the series is not fit to gate ("" = fit)
    timer: str = ""

    @property
    def n_repeats(self) -> int:
        return len(self.samples or ()) if self.repeats is None else int(self.repeats)

    def units(self) -> np.ndarray | None:
        """The independent repeats' values: the samples, or per-repeat medians of contiguous blocks;
        None when the repeats cannot be separated (their count alone is known)."""
        if not self.samples:
            return None
        x = np.asarray(self.samples, dtype=np.float64)
        r = self.repeats
        if r is None or r == x.size:
            return x
        if self.contiguous and 0 < r < x.size and x.size % r == 0:
            return np.median(x.reshape(r, -1), axis=1)
        return None


@dataclass(frozen=True)
class Verdict:
    key: str
    verdict: str  # regression | improvement | same | unknown | not gated
    base_median: float | None
    cand_median: float | None
    unit: str
    slowdown: float | None  # > 0 slower, < 0 faster (direction-aware)
    noise: float | None
    threshold: float | None
    p_slower: float | None
    n_base: int
    n_cand: int
    reason: str = ""


def direction_of(unit: str, override: object = None) -> str:
    if override in ("lower", "higher", "none"):
        return str(override)
    u = (unit or "").strip()
    if u in DIMENSIONLESS:
        return "none"
    if u.endswith("/s"):
        return "higher"
    return "lower"  # times, latencies, cycles: smaller is better


# ----------------------------------------------------------------------------- fitness
def _int_field(s, *names) -> tuple[str, int] | None:
    for src in (s.metrics, s.params):
        for n in names:
            v = src.get(n)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1 and float(v).is_integer():
                return n, int(v)
    return None


def timer_tick(s, env) -> float | None:
    """One tick of the series' timer in the series' unit (None: not a duration unit)."""
    unit = (s.unit or "").strip()
    if s.timer == "clock64":
        if unit == "cycles":
            return 1.0
        mhz = s.clocks.get("sm_mhz_after") or (env.sm_clock_max_mhz if env is not None else None)
        sec = 1.0 / (float(mhz) * 1e6) if mhz else None
    elif s.timer == "globaltimer":
        got = _int_field(s, "tick_ns")
        tick_ns = float(got[1]) if got else GLOBALTIMER_TICK_NS.get(env.gpu if env is not None else "",
                                                                  GLOBALTIMER_UNKNOWN_TICK_NS)
        sec = tick_ns * 1e-9
    elif s.timer == "cuda_event":
        b = _int_field(s, "batch", "nodes", "launches_per_sample")  # a sample is one event pair / this
        sec = CUDA_EVENT_RESOLUTION_S / (b[1] if b else 1)
    elif s.timer == "host":
        b = _int_field(s, "launches", "batch")
        sec = HOST_RESOLUTION_S / (b[1] if b else 1)
    else:
        return None
    if sec is None or unit not in DURATION_SCALE:
        return None
    return sec / DURATION_SCALE[unit]


def fitness(s, env, min_repeats: int = 8) -> tuple[int | None, str, bool, str]:
    """(independent repeats or None for one per sample, how they were counted, contiguous layout,
    reason it is not fit to gate or ""): the module docstring's rules for one typed Series."""
    m, n = s.metrics, len(s.samples)
    if m.get("gated") is False:
        return None, "", False, str(m.get("not_gated_reason") or "its benchmark marks it not gated")
    if s.timer == "cupti":  # older peer results do not mark these gated=False
        return None, "", False, ("profiler accounting (CUPTI) of un-graphed passes: a diagnostic of where a step's "
                                 "time goes, not a timing to gate (its step series is)")
    contiguous = m.get("repeat_layout") == "contiguous"
    rec = _int_field(s, "independent_repeats")
    if rec:
        reps, how = rec[1], f"{rec[1]} independent repeats (recorded)"
    elif s.timer in IN_KERNEL_TIMERS:
        got = _int_field(s, "repeats", "runs", "launches")
        if got:
            reps, how = got[1], f"{got[1]} launches ({got[0]}), {n} in-kernel samples"
        else:
            reps, how = 1, f"{n} in-kernel samples of one launch (no launch count recorded)"
    else:
        reps, how = None, ""
    why = ""
    if s.timer in IN_KERNEL_TIMERS and reps is not None and reps < min_repeats and n:
        why = (f"{how}: fewer than {min_repeats} independent launches, and the spread of samples within a launch "
               f"(SMs, iterations) is not run-to-run noise")
    tick = timer_tick(s, env)
    med = s.summary.median if n else None
    if not why and tick is not None and med is not None and (med <= 0 or med < MIN_TICKS * tick):
        why = (f"median {med:.4g} {s.unit} is not a duration of at least {MIN_TICKS} ticks of its timer "
               f"({s.timer}: {tick:.3g} {s.unit} a tick)")
    return reps, how, contiguous, why


# ----------------------------------------------------------------------------- loading
def _kind(d) -> str | None:
    if isinstance(d, dict) and d.get("schema") == RESULT_SCHEMA:
        return "result"
    if isinstance(d, dict) and isinstance(d.get("benchmarks"), list) and "machine_info" in d:
        return "pytest-benchmark"
    return None


def _from_result(path: Path, min_repeats: int = 8) -> list[Measurement]:
    r = load(path)
    out, seen = [], {}
    for s in r.series:
        key = f"{r.benchmark}:{s.name}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            key += f"#{seen[key]}"
        reps, how, contiguous, why = fitness(s, r.env if r.env.gpu else None, min_repeats)
        out.append(Measurement(key, tuple(s.samples) or None, s.summary.median, s.summary.rel_iqr if s.summary.median
                               else None, s.unit, direction_of(s.unit, s.metrics.get("gate_direction")),
                               r.env.gpu_key if r.env.gpu else None, str(path), r.env.date, s.timer == "static",
                               run=r.benchmark, repeats=reps, repeats_how=how, contiguous=contiguous, not_gated=why,
                               timer=s.timer))
    return out


def pytest_gpu_key(d: dict) -> str | None:
    mb = (d.get("machine_info") or {}).get("megabench") or {}
    return mb.get("gpu_key") if isinstance(mb, dict) else None


def steps_divisor(extra_info: Mapping) -> int:
    """How many steps one round of a pytest-benchmark case timed (1 when it is already per step:
    conftest's device_bench records `time_per: step` since the round-is-one-step change)."""
    steps = (extra_info or {}).get("steps_per_round")
    if (extra_info or {}).get("time_per") == "step" or not isinstance(steps, (int, float)) or steps <= 1:
        return 1
    return int(steps)


def _from_pytest(path: Path, d: dict, assume_gpu: str | None) -> list[Measurement]:
    key = pytest_gpu_key(d) or assume_gpu
    out = []
    for b in d["benchmarks"]:
        try:
            st = b["stats"]
            data = st.get("data")
            med = float(st["median"])
            iqr = st.get("iqr")
        except (KeyError, TypeError, ValueError) as e:
            raise ResultsFileError(f"{path}: benchmark {b.get('fullname', '?')!r} malformed ({e})") from None
        div = steps_divisor(b.get("extra_info") or {})
        samples = tuple(float(v) / div for v in data) if data else None
        rel = (float(iqr) / med) if (iqr is not None and med) else None
        name = b.get("fullname") or b["name"]
        out.append(Measurement(name, samples, med / div, rel, "s", "lower", key, str(path),
                               str(d.get("datetime", "")), run=name, timer="cuda_event",
                               repeats_how=f"per step ({div} steps a round)" if div > 1 else ""))
    return out


def load_measurements(path: str | Path, assume_gpu: str | None = None, ignored: list | None = None,
                      min_repeats: int = 8) -> list[Measurement]:
    """Every measurement in a file or folder. A folder's JSON files that are neither results nor
    pytest-benchmark output are listed in `ignored` (never silently); an explicit file must be one."""
    p = Path(path)
    if not p.exists():
        raise ResultsFileError(f"{p}: no such file or folder")
    files = sorted(x for x in [*p.rglob("*.json"), *p.rglob("*.json.gz")]
                   if not x.name.startswith(".tmp-") and not x.name.endswith(".trace.json.gz")) if p.is_dir() else [p]
    out = []
    for f in files:
        d = read_json(f)  # .json or .json.gz (results.GZIP_MIN_BYTES)
        kind = _kind(d)
        if kind == "result" and str(d.get("benchmark", "")).startswith("gate."):
            kind = None  # the gate's own analyses (gate.quality, gate.ab, ...) are not performance figures
        if kind == "result":
            out += _from_result(f, min_repeats)
        elif kind == "pytest-benchmark":
            out += _from_pytest(f, d, assume_gpu)
        elif p.is_dir():
            if ignored is not None:
                ignored.append(str(f))
        elif _kind(d) == "result":
            raise ResultsFileError(f"{f}: the gate's own analysis ({d.get('benchmark')}), not a performance result")
        else:
            raise ResultsFileError(f"{f}: neither a megabench result nor pytest-benchmark JSON (--benchmark-json)")
    if not out and not p.is_dir():
        raise ResultsFileError(f"{p}: contains no measurements")
    return out


def newest(ms: Iterable[Measurement]) -> dict[tuple[str, str | None], Measurement]:
    """The newest run of each benchmark, per GPU: for every (run, GPU) the file with the latest
    date (then name) wins, and all of that file's series of that benchmark form the baseline.
    Older runs are history and take no part (not even as noise)."""
    ms = list(ms)
    best: dict[tuple[str, str | None], tuple[str, str]] = {}
    for m in ms:
        g = (m.run or m.key, m.gpu_key)
        if g not in best or (m.date, m.source) > best[g]:
            best[g] = (m.date, m.source)
    return {(m.key, m.gpu_key): m for m in ms if best[(m.run or m.key, m.gpu_key)] == (m.date, m.source)}


# ----------------------------------------------------------------------------- A/A cross-run spread
def key_class(key: str) -> str:
    """The overhead class of a measurement key: 'sync.flags:...' -> 'sync',
    'tests/bench/test_bench_sync.py::...' -> 'sync'."""
    head = key.split("::", 1)[0]
    if head.endswith(".py"):
        stem = Path(head).stem
        return stem[len("test_bench_"):] if stem.startswith("test_bench_") else stem
    return key.split(":", 1)[0].split(".", 1)[0]


AA_QUANTILE = 90  # the pooled cross-run spread: this percentile of the recorded series' spreads


@dataclass
class CrossRun:
    """Recorded A/A cross-run spreads (gate.aa_spread) on one GPU model: relative |difference| of
    the medians of the same build's series across separate runs on fresh machines."""

    per_key: dict[str, float]
    gpu: str | None = None
    source: str = ""
    date: str = ""

    def pooled(self, cls: str | None = None, exclude: str | None = None) -> float | None:
        xs = [v for k, v in self.per_key.items() if (cls is None or key_class(k) == cls) and k != exclude]
        return float(np.percentile(xs, AA_QUANTILE)) if xs else None

    def for_key(self, key: str, exclude_self: bool = False) -> tuple[float, str]:
        """(spread, where it came from). `exclude_self`: leave the key's own record out (the quality
        analysis measures the rule on series it did not calibrate on)."""
        cls = key_class(key)
        own = None if exclude_self else self.per_key.get(key)
        pc = self.pooled(cls, key if exclude_self else None)
        pa = self.pooled(None, key if exclude_self else None)
        if own is not None:
            return max(own, pc or 0.0), f"A/A spread {own:.2%} (pooled p{AA_QUANTILE} of {cls} {pc or 0:.2%})"
        if pc is not None:
            return pc, f"A/A p{AA_QUANTILE} of class {cls} {pc:.2%}"
        if pa is not None:
            return pa, f"A/A p{AA_QUANTILE} of all series {pa:.2%}"
        return 0.0, ""


def load_cross_run(path: str | Path | None = None, gpu: str | None = None) -> CrossRun | None:
    """The newest gate.aa_spread result (a file, or under a results folder; default the results
    root and the committed reports/results) for `gpu` (a model name, e.g. 'NVIDIA H200')."""
    if path is not None and Path(path).is_file():
        files = [Path(path)]
    else:
        roots = [Path(path)] if path is not None else list(dict.fromkeys([results_root(), REPO_ROOT / "reports" /
                                                                          "results"]))
        files = [f for r in roots if r.is_dir() for f in find("gate.aa_spread", r, gpu)]
    best = None
    for f in files:
        r = load(f)
        if r.benchmark != "gate.aa_spread":
            raise ResultsFileError(f"{f}: a {r.benchmark} result, not gate.aa_spread")
        if gpu and r.env.gpu != gpu:
            continue
        if best is None or r.env.date > best.env.date:
            best, best_path = r, f
    if best is None:
        return None
    per = {}
    for s in best.series:
        v = s.metrics.get("spread")
        if isinstance(v, (int, float)) and math.isfinite(v):
            per[str(s.params.get("key", s.name))] = float(v)
    return CrossRun(per, best.env.gpu, str(best_path), best.env.date)


# ----------------------------------------------------------------------------- judging
def judge(base: Measurement, cand: Measurement, cfg: GateConfig = GateConfig(), cross: float = 0.0,
          cross_how: str = "") -> Verdict:
    """One verdict (module docstring). `cross`: the series' A/A cross-run spread (gate.aa_spread),
    0 when none is recorded; it raises the noise term, because within-run spread does not see what
    a second run on a second machine shows."""
    nb, nc = base.n_repeats, cand.n_repeats
    common = dict(key=cand.key, base_median=base.median, cand_median=cand.median, unit=cand.unit, n_base=nb, n_cand=nc)
    direction = cand.direction
    nothing = dict(slowdown=None, noise=None, threshold=None, p_slower=None)
    if direction == "none" or cand.static or base.static:
        why = ("static value" if (cand.static or base.static) else f"unit {cand.unit!r} has no direction"
               if direction_of(cand.unit) == "none" else "its result marks it not gated (gate_direction none)")
        return Verdict(**common, verdict="not gated", **nothing, reason=why)
    if cand.not_gated or base.not_gated:
        return Verdict(**common, verdict="not gated", **nothing, reason=cand.not_gated or base.not_gated)
    if base.unit != cand.unit:
        return Verdict(**common, verdict="unknown", **nothing, reason=f"units differ ({base.unit!r} vs {cand.unit!r})")
    if base.median <= 0 or cand.median <= 0 or not (math.isfinite(base.median) and math.isfinite(cand.median)):
        return Verdict(**common, verdict="unknown", **nothing, reason="non-positive median")
    slowdown = (cand.median / base.median - 1.0) if direction == "lower" else (base.median / cand.median - 1.0)
    short = [(side, m) for side, m in (("baseline", base), ("candidate", cand))
             if not m.samples or m.n_repeats < cfg.min_samples]
    if short:
        why = "; ".join(f"{side} has " + ("no raw samples" if not m.samples else
                                         f"{m.n_repeats} independent repeats") + f" (need {cfg.min_samples})"
                        for side, m in short)
        return Verdict(**common, verdict="unknown", slowdown=slowdown, noise=None, threshold=None, p_slower=None,
                       reason=why)
    b, c = base.units(), cand.units()
    if b is None or c is None:
        return Verdict(**common, verdict="unknown", slowdown=slowdown, noise=None, threshold=None, p_slower=None,
                       reason="the samples' independent repeats cannot be separated (no recorded layout)")
    within = max(Summary.of(b).rel_iqr, Summary.of(c).rel_iqr)
    noise = max(within, cross)
    threshold = max(cfg.floor, cfg.k * noise)
    slower_alt = "greater" if direction == "lower" else "less"
    faster_alt = "less" if direction == "lower" else "greater"
    _, p_slow = mann_whitney(c, b, slower_alt)
    noise_note = f"noise: {cross_how}" if cross_how and cross >= within and cross > 0 else ""
    # a hair of tolerance: a slowdown of exactly the floor must not pass on floating-point rounding
    if slowdown > threshold * (1 + 1e-9) and p_slow < cfg.alpha:
        v, why = "regression", noise_note
    else:
        speedup = -slowdown / (1.0 + slowdown)  # fraction of the baseline's cost saved
        _, p_fast = mann_whitney(c, b, faster_alt)
        if (1.0 / (1.0 + slowdown) - 1.0) > threshold * (1 + 1e-9) and p_fast < cfg.alpha:
            v, why = "improvement", f"{speedup:.1%} less cost"
        else:
            v = "same"
            if slowdown > threshold:
                why = f"slower by more than the threshold, but the rank test disagrees (p={p_slow:.2g})"
            elif slowdown > 0 and p_slow < cfg.alpha:
                why = f"significantly slower (p={p_slow:.2g}) but within the threshold {threshold:.1%}"
            else:
                why = ""
            if noise_note and slowdown > cfg.floor:
                why = "; ".join(x for x in (why, noise_note) if x)
    return Verdict(**common, verdict=v, slowdown=slowdown, noise=noise, threshold=threshold, p_slower=p_slow,
                   reason=why)


@dataclass
class GateReport:
    verdicts: list[Verdict]
    gpu_key: str | None
    config: GateConfig
    only_baseline: list[str] = dataclasses.field(default_factory=list)
    only_candidate: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def count(self, verdict: str) -> int:
        return sum(v.verdict == verdict for v in self.verdicts)

    def exit_code(self, allow_unknown: bool = False) -> int:
        if self.count("regression"):
            return EXIT_REGRESSION
        judged = [v for v in self.verdicts if v.verdict != "not gated"]
        if (self.count("unknown") or not judged) and not allow_unknown:
            return EXIT_UNKNOWN
        return EXIT_OK

    def summary_line(self) -> str:
        parts = [f"{self.count(v)} {v}" for v in ("regression", "improvement", "same", "unknown", "not gated")
                 if self.count(v)]
        return f"gate on {self.gpu_key}: " + (", ".join(parts) or "nothing compared")

    def rows(self) -> list[dict]:
        out = []
        for v in self.verdicts:
            out.append({
                "benchmark": v.key,
                "baseline": fmt_value(v.base_median, v.unit),
                "candidate": fmt_value(v.cand_median, v.unit),
                "change": "" if v.slowdown is None else (f"{v.slowdown:+.1%}" + ("" if abs(v.slowdown) < 5e-4 else
                                                                       " slower" if v.slowdown > 0 else " faster")),
                "noise": "" if v.noise is None else f"{v.noise:.1%}",
                "threshold": "" if v.threshold is None else f"{v.threshold:.1%}",
                "p (slower)": "" if v.p_slower is None else f"{v.p_slower:.2g}",
                "n": f"{v.n_base}/{v.n_cand}",
                "verdict": v.verdict.upper() if v.verdict in ("regression", "unknown") else v.verdict,
                "why": v.reason,
            })
        return out

    def to_markdown(self) -> str:
        lines = [f"**{self.summary_line()}**", "", f"Rule: {self.config.describe()}.", ""]
        lines += [f"- {n}" for n in self.notes]
        if self.notes:
            lines.append("")
        order = {"regression": 0, "unknown": 1, "improvement": 2, "same": 3, "not gated": 4}
        rows = sorted(self.rows(), key=lambda r: (order.get(r["verdict"].lower(), 9), r["benchmark"]))
        if rows:
            lines.append(tabulate(rows, headers="keys", tablefmt="github"))
        if self.only_baseline:
            lines += ["", f"Only in the baseline (not run by the candidate): {', '.join(sorted(self.only_baseline))}"]
        if self.only_candidate:
            lines += ["", f"New in the candidate (no baseline yet): {', '.join(sorted(self.only_candidate))}"]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"schema": "megabench.gate", "version": 1, "gpu_key": self.gpu_key,
                "config": dataclasses.asdict(self.config), "rule": self.config.describe(),
                "summary": self.summary_line(), "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
                "only_baseline": self.only_baseline, "only_candidate": self.only_candidate, "notes": self.notes}


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return ""
    if unit == "fraction":
        return f"{v:.1%}"
    if unit == "s":
        for scale, u in ((1, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
            if abs(v) >= scale or u == "ns":
                return f"{v / scale:.4g} {u}"
    return f"{v:.4g} {unit}".strip()


def compare(base: Sequence[Measurement], cand: Sequence[Measurement], cfg: GateConfig = GateConfig(),
            cross: CrossRun | None = None, cross_exclude_self: bool = False) -> GateReport:
    """Judge every candidate measurement against the newest baseline run of its benchmark on the
    same GPU (module docstring); `cross`: the recorded A/A spreads (None: none recorded, said in the
    notes). Raises GpuMismatchError when the GPUs differ or are unknown."""
    unlabeled = sorted({m.source for m in [*base, *cand] if m.gpu_key is None})
    if unlabeled:
        raise GpuMismatchError("these files do not record which GPU measured them, so the gate cannot check it "
                               "compares like with like: " + ", ".join(unlabeled[:5]) + (" ..." if len(unlabeled) > 5
                               else "") + ". Pass --assume-gpu 'MODEL@CLOCKMHz' (e.g. 'NVIDIA H200@1980MHz') "
                               "if you know it")
    cand_keys = sorted({m.gpu_key for m in cand})
    if len(cand_keys) > 1:
        raise GpuMismatchError(f"the candidate mixes GPUs {cand_keys}: gate one GPU at a time (--gpu KEY)")
    if not cand_keys:
        raise ResultsFileError("the candidate holds no measurements")
    g = cand_keys[0]
    base_keys = sorted({m.gpu_key for m in base})
    if g not in base_keys:
        raise GpuMismatchError(f"refusing to compare across GPUs: the candidate ran on {g}, the baseline only has "
                               f"{base_keys or 'nothing'}. Baselines are kept per GPU model and max clock")
    notes = []
    if len(base_keys) > 1:
        notes.append(f"baseline also holds results for {[k for k in base_keys if k != g]}: ignored (other GPUs)")
    b = {k: m for (k, gk), m in newest(base).items() if gk == g}
    c = {k: m for (k, gk), m in newest(cand).items() if gk == g}
    model = g.split("@", 1)[0]
    if cross is not None and cross.gpu not in (None, model):
        notes.append(f"A/A spreads {cross.source} are of {cross.gpu}, not {model}: not used")
        cross = None
    if cross is None:
        notes.append(f"no A/A cross-run spread recorded for {model} (gate.aa_spread; `megabench gate --quality-run` "
                     "on two fresh machines, then `megabench gate --quality`): thresholds see within-run noise only")
    else:
        notes.append(f"cross-run noise: A/A spreads of {len(cross.per_key)} series on {cross.gpu} ({cross.date[:10]}, "
                     f"`{_short(cross.source)}`)")
    verdicts = []
    for k in sorted(set(b) & set(c)):
        spread, how = cross.for_key(k, cross_exclude_self) if cross is not None else (0.0, "")
        verdicts.append(judge(b[k], c[k], cfg, spread, how))
    return GateReport(verdicts, g, cfg, sorted(set(b) - set(c)), sorted(set(c) - set(b)), notes)


def _short(p: str) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)
