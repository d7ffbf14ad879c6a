"""How good is the gate? False alarms and detections measured on recorded samples.

Sources: every recorded series with enough raw samples (megabench results: `Series.samples`;
pytest-benchmark JSON: per-round `stats.data`), on one GPU. For each source:

- A/A, random halves: shuffle the samples, split into two halves, judge half B against half A
  with the gate's exact rule (microbench.gate.judge). Any "regression" is a false alarm.
  Halves of one run share its conditions, so this is the optimistic case.
- A/A, time-ordered halves: first half vs second half as recorded (one comparison per source):
  catches drift within a run (clock, temperature).
- A/A, across runs: the same case recorded by two different runs of the same build (a result
  series and a pytest-benchmark case whose `extra_info.case` names that series): bootstrap
  resamples of each run judged against each other. The realistic case, when such pairs exist.
- Injected slowdowns (2%, 5%, 10%): halves as in random A/A, the candidate half multiplied by
  1 + s (divided for rates). The fraction judged "regression" is the detection rate.

Rates are pooled over all trials; their spread is a 90% Wilson interval. The output is a typed
Result `gate.quality` (saved under reports/results/gate/), which the report shows.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ResultsFileError
from .gate import GateConfig, Measurement, direction_of, judge, pytest_gpu_key
from .results import REPO_ROOT, Derived, Env, Result, Series, find, load, results_root

SLOWDOWNS = (0.02, 0.05, 0.10)
MAX_HALF = 200  # cap on samples per side: bounds the cost of a trial, keeps realistic gate sizes
MAX_SOURCES = 40  # cap on recorded series used: bounds the whole estimate to seconds


@dataclass(frozen=True)
class Source:
    name: str
    samples: np.ndarray
    unit: str
    direction: str
    origin: str  # file it came from
    case: str | None = None  # series name (for pairing runs)


def wilson(k: int, n: int, z: float = 1.6449) -> tuple[float, float]:
    """Wilson score interval (default 90%) for k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, c - h), min(1.0, c + h)


def _m(key, x, unit, direction) -> Measurement:
    x = np.asarray(x, dtype=np.float64)
    return Measurement(key, tuple(x.tolist()), float(np.median(x)), None, unit, direction, "g", "synthetic", "")


def _flag(a, b, src: Source, cfg: GateConfig) -> bool:
    return judge(_m(src.name, a, src.unit, src.direction), _m(src.name, b, src.unit, src.direction),
                 cfg).verdict == "regression"


def _halves(x: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    perm = rng.permutation(x.size)
    h = min(x.size // 2, MAX_HALF)
    return x[perm[:h]], x[perm[h:2 * h]]


def _inject(b: np.ndarray, s: float, direction: str) -> np.ndarray:
    return b * (1.0 + s) if direction == "lower" else b / (1.0 + s)


def aa_random(src: Source, cfg: GateConfig, trials: int, rng) -> int:
    return sum(_flag(*_halves(src.samples, rng), src, cfg) for _ in range(trials))


def aa_time(src: Source, cfg: GateConfig) -> int:
    h = min(src.samples.size // 2, MAX_HALF)
    x = src.samples
    return int(_flag(x[:h], x[x.size - h:], src, cfg))


def injected(src: Source, s: float, cfg: GateConfig, trials: int, rng) -> int:
    hits = 0
    for _ in range(trials):
        a, b = _halves(src.samples, rng)
        hits += _flag(a, _inject(b, s, src.direction), src, cfg)
    return hits


def aa_cross(a: Source, b: Source, cfg: GateConfig, trials: int, rng) -> int:
    na, nb = min(a.samples.size, MAX_HALF), min(b.samples.size, MAX_HALF)
    flags = 0
    for _ in range(trials):
        x = rng.choice(a.samples, size=na, replace=True)
        y = rng.choice(b.samples, size=nb, replace=True)
        flags += _flag(x, y, a, cfg) or _flag(y, x, a, cfg)  # either order raising an alarm counts
    return flags


# ----------------------------------------------------------------------------- sources
def gather_sources(root: Path | None = None, bench_dir: Path | None = None, gpu: str | None = None,
                   cfg: GateConfig = GateConfig(), assume_gpu: str | None = None):
    """(gpu, results sources, pytest sources, envs): every usable recorded series on one GPU model.

    pytest-benchmark files are attributed to a GPU by their machine_info (megabench hook), by
    --assume-gpu, or by the slug reports/benchmarks file names carry ('...-nvidia-h200-<sha>.json').
    """
    from .tune import gpu_slug

    root = Path(root) if root else results_root()
    bench_dir = Path(bench_dir) if bench_dir else REPO_ROOT / "reports" / "benchmarks"
    need = cfg.min_samples  # halves need twice this: estimate() filters those
    results = []
    for p in find(None, root):
        r = load(p)
        if r.benchmark.startswith("gate.") or not r.env.gpu:
            continue
        results.append((p, r))
    if gpu is None:
        dated = sorted((r.env.date, r.env.gpu) for _, r in results)
        gpu = dated[-1][1] if dated else None
    envs, res_src, py_src = [], [], []
    for p, r in results:
        if r.env.gpu != gpu:
            continue
        envs.append(r.env)
        for s in r.series:
            d = direction_of(s.unit, s.metrics.get("gate_direction"))
            if s.timer == "static" or d == "none" or len(s.samples) < need:
                continue
            res_src.append(Source(f"{r.benchmark}:{s.name}", np.asarray(s.samples), s.unit, d, _rel(p), s.name))
    if bench_dir.is_dir() and gpu:
        for p in sorted(bench_dir.glob("*.json")):
            try:
                d = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ResultsFileError(f"{p}: not valid JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("benchmarks"), list):
                continue
            key = pytest_gpu_key(d) or assume_gpu
            same = key.startswith(gpu + "@") if key else (f"-{gpu_slug(gpu)}-" in p.name)
            if not same:
                continue
            for b in d["benchmarks"]:
                data = (b.get("stats") or {}).get("data") or []
                if len(data) < need:
                    continue
                case = (b.get("extra_info") or {}).get("case")
                py_src.append(Source(b.get("fullname", b.get("name")), np.asarray(data, dtype=np.float64), "s",
                                     "lower", _rel(p), case))
    return gpu, res_src, py_src, envs


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


# ----------------------------------------------------------------------------- the estimate
@dataclass
class Tally:
    mode: str
    slowdown: float
    per_source: dict[str, tuple[int, int]]  # name -> (flagged, trials)

    @property
    def flagged(self) -> int:
        return sum(k for k, _ in self.per_source.values())

    @property
    def trials(self) -> int:
        return sum(n for _, n in self.per_source.values())

    @property
    def rate(self) -> float:
        return self.flagged / self.trials if self.trials else float("nan")


def spread_pick(items: Sequence, n: int) -> list:
    """n items evenly spaced through `items` (deterministic), all of them if there are fewer."""
    if len(items) <= n:
        return list(items)
    idx = np.unique(np.linspace(0, len(items) - 1, n).round().astype(int))
    return [items[i] for i in idx]


def estimate(sources: Sequence[Source], cfg: GateConfig = GateConfig(), trials: int = 200,
             slowdowns: Sequence[float] = SLOWDOWNS, seed: int = 0,
             pairs: Sequence[tuple[Source, Source]] = (), max_sources: int = MAX_SOURCES) -> list[Tally]:
    """Tallies per mode. At most `max_sources` series (evenly spaced by name) keep the cost bounded:
    each trial is one Mann-Whitney test of up to MAX_HALF samples a side (~0.5 ms)."""
    rng = np.random.default_rng(seed)
    sources = [s for s in sources if s.samples.size >= 2 * cfg.min_samples]  # two halves of min_samples
    sources = spread_pick(sorted(sources, key=lambda s: s.name), max_sources)
    pairs = spread_pick(sorted(pairs, key=lambda p: p[0].name), max_sources)
    out = [Tally("aa_random_halves", 0.0, {s.name: (aa_random(s, cfg, trials, rng), trials) for s in sources}),
           Tally("aa_time_halves", 0.0, {s.name: (aa_time(s, cfg), 1) for s in sources})]
    if pairs:
        out.append(Tally("aa_across_runs", 0.0, {f"{a.name} vs {b.name}": (aa_cross(a, b, cfg, trials, rng), trials)
                                                 for a, b in pairs}))
    for sd in slowdowns:
        out.append(Tally("injected", sd, {s.name: (injected(s, sd, cfg, trials, rng), trials) for s in sources}))
    return out


def pair_runs(res_src: Sequence[Source], py_src: Sequence[Source]) -> list[tuple[Source, Source]]:
    """The same case recorded by a result series and by a pytest-benchmark run."""
    by_case = {}
    for s in res_src:
        by_case.setdefault(s.case, s)
    return [(by_case[p.case], p) for p in py_src if p.case and p.case in by_case]


def derived_key(t: Tally) -> str:
    if t.mode == "injected":
        return f"detection_rate_{round(t.slowdown * 100):d}pct"
    return {"aa_random_halves": "false_alarm_rate", "aa_time_halves": "false_alarm_rate_time_halves",
            "aa_across_runs": "false_alarm_rate_across_runs"}[t.mode]


def to_result(gpu: str, tallies: Sequence[Tally], cfg: GateConfig, trials: int, envs: Sequence[Env],
              origins: Sequence[str]) -> Result:
    series, derived = [], {}
    for t in tallies:
        per = {n: (k / n_ if n_ else float("nan")) for n, (k, n_) in t.per_source.items()}
        if not per:
            continue
        name = t.mode if t.mode != "injected" else f"injected/{t.slowdown:.0%}"
        series.append(Series.from_samples(
            name, list(per.values()), timer="derived", unit="fraction",
            params={"mode": t.mode, "slowdown": t.slowdown, "trials_per_source": trials if t.mode != "aa_time_halves"
                    else 1, "sources": len(per)},
            metrics={"flagged": t.flagged, "trials": t.trials, "per_source": per, "gate_direction": "none"}))
        lo, hi = wilson(t.flagged, t.trials)
        what = "false alarms" if t.slowdown == 0 else f"detections of an injected {t.slowdown:.0%} slowdown"
        derived[derived_key(t)] = Derived(
            t.rate, "fraction",
            f"{what}: {t.flagged} of {t.trials} gate verdicts over {len(per)} recorded series ({t.mode}); "
            f"gate rule: {cfg.describe()}; spread: 90% Wilson interval", (lo, hi), (name,))
    if not envs:
        raise ResultsFileError(f"no recorded results for {gpu}: nothing to estimate the gate's quality from")
    src_env = max(envs, key=lambda e: e.date)
    from .results import _dirty, git_sha

    env = dataclasses.replace(
        src_env, date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        git_sha=git_sha(full=True),
        git_dirty=_dirty(os.environ.get("MEGABENCH_SOURCE_TREE")),
        host=socket.gethostname(), python=platform.python_version(), machine_kind="analysis of recorded samples")
    notes = (f"Computed from samples recorded on {gpu}; GPU fields of env describe where they were measured, "
             f"date/git/host/python the analysis. Sources: {', '.join(sorted(set(origins)))}.",
             "Random halves of one run share its conditions (optimistic); time-ordered halves and across-runs "
             "pairs include drift.",
             "Across-runs pairs put the harness's chunked series beside pytest-benchmark's one-sample rounds of "
             "the same case: their difference includes the two procedures', so that rate bounds from above what "
             "repeated runs of one procedure would show.")
    return Result("gate.quality", env, tuple(series), derived, quick=True, notes=notes)


def run_quality(root: Path | None = None, bench_dir: Path | None = None, cfg: GateConfig = GateConfig(),
                trials: int = 200, save: bool = False, gpu: str | None = None, assume_gpu: str | None = None,
                seed: int = 0, save_root: Path | None = None) -> tuple[Result, str]:
    gpu, res_src, py_src, envs = gather_sources(root, bench_dir, gpu, cfg, assume_gpu)
    if gpu is None or not any(s.samples.size >= 2 * cfg.min_samples for s in [*res_src, *py_src]):
        raise ResultsFileError(f"no recorded series with >= {2 * cfg.min_samples} samples under "
                               f"{root or results_root()}: nothing to estimate the gate's quality from")
    pairs = pair_runs(res_src, py_src)
    tallies = estimate([*res_src, *py_src], cfg, trials, SLOWDOWNS, seed, pairs)
    res = to_result(gpu, tallies, cfg, trials, envs, [s.origin for s in [*res_src, *py_src]])
    n_split = min(MAX_SOURCES, sum(s.samples.size >= 2 * cfg.min_samples for s in [*res_src, *py_src]))
    lines = [f"gate quality on {gpu}: {n_split} recorded series, {len(pairs)} cross-run pairs, "
             f"{trials} trials each", f"rule: {cfg.describe()}"]
    for k, d in res.derived.items():
        lines.append(f"  {k:32s} {d.value:7.2%}  (90% CI {d.spread[0]:.2%}-{d.spread[1]:.2%})")
    if save:
        p = res.save(save_root)
        lines.append(f"saved {p}")
    return res, "\n".join(lines)
