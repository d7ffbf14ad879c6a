"""`megabench gate`: the performance-regression gate, and the deterministic kernel-metrics gate.

Timing gate (`megabench gate BASELINE CANDIDATE`): each side is a megabench result file, a
pytest-benchmark JSON written with `--benchmark-json` (per-round data kept), or a folder of them
(newest measurement per benchmark and GPU wins). A pair is judged like this:

  slowdown  = median(candidate) / median(baseline) - 1   (inverted for rates, unit ".../s")
  noise     = max(relative IQR of baseline, relative IQR of candidate,
                  spread of the medians of several baseline runs when the baseline holds them)
  threshold = max(floor, k * noise)                      (defaults: floor 5%, k = 1)
  REGRESSION  when slowdown > threshold AND a one-sided Mann-Whitney U test on the raw samples
              says candidate is slower with p < alpha    (default alpha = 0.01)
  IMPROVEMENT the mirror image; SAME otherwise;
  UNKNOWN     when either side has no raw samples or fewer than `min_samples` (default 8): a
              verdict needs both a noise estimate and a rank test, and unknown is not a pass.
Series whose unit has no direction (dimensionless, or `metrics["gate_direction"] == "none"`)
and static (`timer == "static"`) series are listed as "not gated".

Baselines are per GPU model and max SM clock (`Env.gpu_key`). A pytest-benchmark JSON records
its GPU in `machine_info["megabench"]["gpu_key"]`; one that does not is refused unless
`--assume-gpu KEY` says which GPU it came from. Comparing different GPUs is refused.

Kernel-metrics gate (`megabench gate --kernels`): recompiles every .cu in the repository on the
CPU (NVRTC, the defines recorded in the baseline; none for a new source) and compares registers,
spills, static shared memory and code bytes with reports/kernel_metrics.json. Fails when spills
grow by more than --max-spill-increase bytes (default 0), registers by more than
--max-reg-increase (default 0), static smem by more than --max-smem-increase bytes (default 0), or
code bytes by more than --max-code-increase percent (default 10). `--update` rewrites the baseline.

Exit codes (both gates):
  0  no regression (and every verdict known, or --allow-unknown)
  1  at least one regression (timing) / metric increase beyond its threshold (kernels)
  2  bad input: unreadable, malformed or unknown files, bad arguments, a kernel that fails to compile
  3  refused: baseline and candidate come from different GPU models/clocks, or a side's GPU is unknown
  4  no regression, but some verdicts are unknown (or nothing could be compared), without --allow-unknown
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import atomic
from .errors import ResultsFileError
from .results import REPO_ROOT, SCHEMA as RESULT_SCHEMA, load, read_json
from .stats import Summary, mann_whitney

EXIT_OK, EXIT_REGRESSION, EXIT_INPUT, EXIT_GPU, EXIT_UNKNOWN = 0, 1, 2, 3, 4
DIMENSIONLESS = {"", "1", "fraction", "ratio", "%", "count", "bool", "x"}


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
                f"Mann-Whitney p < {self.alpha:g}; noise = max relative IQR of the two sides (and the spread of "
                f"baseline run medians when there are several); "
                f"unknown without >= {self.min_samples} raw samples a side")


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


# ----------------------------------------------------------------------------- loading
def _kind(d) -> str | None:
    if isinstance(d, dict) and d.get("schema") == RESULT_SCHEMA:
        return "result"
    if isinstance(d, dict) and isinstance(d.get("benchmarks"), list) and "machine_info" in d:
        return "pytest-benchmark"
    return None


def _from_result(path: Path) -> list[Measurement]:
    r = load(path)
    out, seen = [], {}
    for s in r.series:
        key = f"{r.benchmark}:{s.name}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            key += f"#{seen[key]}"
        out.append(Measurement(key, tuple(s.samples) or None, s.summary.median, s.summary.rel_iqr if s.summary.median
                               else None, s.unit, direction_of(s.unit, s.metrics.get("gate_direction")),
                               r.env.gpu_key if r.env.gpu else None, str(path), r.env.date, s.timer == "static"))
    return out


def pytest_gpu_key(d: dict) -> str | None:
    mb = (d.get("machine_info") or {}).get("megabench") or {}
    return mb.get("gpu_key") if isinstance(mb, dict) else None


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
        samples = tuple(float(v) for v in data) if data else None
        rel = (float(iqr) / med) if (iqr is not None and med) else None
        out.append(Measurement(b.get("fullname") or b["name"], samples, med, rel, "s", "lower", key, str(path),
                               str(d.get("datetime", ""))))
    return out


def load_measurements(path: str | Path, assume_gpu: str | None = None, ignored: list | None = None) -> list[Measurement]:
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
            kind = None  # the gate's own analyses (gate.quality) are not performance figures
        if kind == "result":
            out += _from_result(f)
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
    """Newest measurement per (key, GPU)."""
    best: dict[tuple[str, str | None], Measurement] = {}
    for m in ms:
        k = (m.key, m.gpu_key)
        if k not in best or (m.date, m.source) > (best[k].date, best[k].source):
            best[k] = m
    return best


# ----------------------------------------------------------------------------- judging
def judge(base: Measurement, cand: Measurement, cfg: GateConfig = GateConfig(), run_noise: float = 0.0) -> Verdict:
    """One verdict. `run_noise`: relative spread of the medians of earlier baseline runs of the same
    benchmark (0 with one run); it raises the noise term, because within-run IQR does not see
    run-to-run variation."""
    nb = len(base.samples or ())
    nc = len(cand.samples or ())
    common = dict(key=cand.key, base_median=base.median, cand_median=cand.median, unit=cand.unit, n_base=nb, n_cand=nc)
    direction = cand.direction
    if direction == "none" or cand.static or base.static:
        why = ("static value" if (cand.static or base.static) else f"unit {cand.unit!r} has no direction"
               if direction_of(cand.unit) == "none" else "its result marks it not gated (gate_direction none)")
        return Verdict(**common, verdict="not gated", slowdown=None, noise=None, threshold=None, p_slower=None,
                       reason=why)
    if base.unit != cand.unit:
        return Verdict(**common, verdict="unknown", slowdown=None, noise=None, threshold=None, p_slower=None,
                       reason=f"units differ ({base.unit!r} vs {cand.unit!r})")
    if base.median <= 0 or cand.median <= 0 or not (math.isfinite(base.median) and math.isfinite(cand.median)):
        return Verdict(**common, verdict="unknown", slowdown=None, noise=None, threshold=None, p_slower=None,
                       reason="non-positive median")
    slowdown = (cand.median / base.median - 1.0) if direction == "lower" else (base.median / cand.median - 1.0)
    missing = [side for side, n in (("baseline", nb), ("candidate", nc)) if n < cfg.min_samples]
    if missing:
        why = "; ".join(f"{side} has {'no raw samples' if n == 0 else f'{n} samples'} (need {cfg.min_samples})"
                        for side, n in (("baseline", nb), ("candidate", nc)) if n < cfg.min_samples)
        return Verdict(**common, verdict="unknown", slowdown=slowdown, noise=None, threshold=None, p_slower=None,
                       reason=why)
    b = np.asarray(base.samples, dtype=np.float64)
    c = np.asarray(cand.samples, dtype=np.float64)
    noise = max(Summary.of(b).rel_iqr, Summary.of(c).rel_iqr, run_noise)
    threshold = max(cfg.floor, cfg.k * noise)
    slower_alt = "greater" if direction == "lower" else "less"
    faster_alt = "less" if direction == "lower" else "greater"
    _, p_slow = mann_whitney(c, b, slower_alt)
    # a hair of tolerance: a slowdown of exactly the floor must not pass on floating-point rounding
    if slowdown > threshold * (1 + 1e-9) and p_slow < cfg.alpha:
        v, why = "regression", ""
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
                "noise (rel. IQR)": "" if v.noise is None else f"{v.noise:.1%}",
                "threshold": "" if v.threshold is None else f"{v.threshold:.1%}",
                "p (slower)": "" if v.p_slower is None else f"{v.p_slower:.2g}",
                "n": f"{v.n_base}/{v.n_cand}",
                "verdict": v.verdict.upper() if v.verdict in ("regression", "unknown") else v.verdict,
                "why": v.reason,
            })
        return out

    def to_markdown(self) -> str:
        from tabulate import tabulate

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


def run_spread(runs: Sequence[Measurement]) -> float:
    """(max - min) / median of the medians of several runs of one benchmark; 0 for fewer than two."""
    meds = [m.median for m in runs if m.median > 0]
    if len(meds) < 2:
        return 0.0
    return (max(meds) - min(meds)) / float(np.median(meds))


def compare(base: Sequence[Measurement], cand: Sequence[Measurement], cfg: GateConfig = GateConfig()) -> GateReport:
    """Judge every candidate measurement against the newest baseline measurement of the same key on
    the same GPU. Raises GpuMismatchError when the GPUs differ or are unknown."""
    unlabeled = sorted({m.source for m in [*base, *cand] if m.gpu_key is None})
    if unlabeled:
        raise GpuMismatchError("these files do not record which GPU measured them, so the gate cannot check it "
                               "compares like with like: " + ", ".join(unlabeled[:5]) + (" ..." if len(unlabeled) > 5
                               else "") + ". Pass --assume-gpu 'MODEL@CLOCKMHz' (e.g. 'NVIDIA H200@1980MHz') "
                               "if you know it")
    cand_keys = sorted({m.gpu_key for m in cand})
    if len(cand_keys) > 1:
        raise GpuMismatchError(f"the candidate mixes GPUs {cand_keys}: gate one GPU at a time")
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
    verdicts = [judge(b[k], c[k], cfg, run_spread([m for m in base if m.key == k and m.gpu_key == g]))
                for k in sorted(set(b) & set(c))]
    return GateReport(verdicts, g, cfg, sorted(set(b) - set(c)), sorted(set(c) - set(b)), notes)


# ----------------------------------------------------------------------------- kernel metrics
KM_SCHEMA = "megabench.kernel_metrics"
KM_VERSION = 1
KM_FIELDS = ("registers", "spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "static_smem_bytes",
             "barriers", "code_bytes")


def kernel_metrics_path() -> Path:
    return REPO_ROOT / "reports" / "kernel_metrics.json"


@dataclass(frozen=True)
class KernelThresholds:
    max_spill_increase: int = 0  # bytes (stores + loads)
    max_reg_increase: int = 0  # registers per thread
    max_smem_increase: int = 0  # bytes of static shared memory
    max_code_increase_pct: float = 10.0

    def describe(self) -> str:
        return (f"fail when spills grow > {self.max_spill_increase} B, registers > +{self.max_reg_increase}, "
                f"static smem > +{self.max_smem_increase} B, or code bytes > +{self.max_code_increase_pct:g}%")


def _tracked_cu(root: Path) -> set[str] | None:
    from .results import _git

    out = _git("ls-files", "*.cu")
    return set(out.splitlines()) if out else None


def _build_key(source: str, defines: Mapping[str, str]) -> str:
    return source + ("" if not defines else "[" + ",".join(f"{k}={v}" for k, v in sorted(defines.items())) + "]")


def load_kernel_baseline(path: Path | None = None) -> dict:
    p = Path(path) if path else kernel_metrics_path()
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ResultsFileError(f"{p}: no kernel-metrics baseline; create it with `megabench gate --kernels --update`") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != KM_SCHEMA:
        raise ResultsFileError(f"{p}: schema is {d.get('schema') if isinstance(d, dict) else None!r}, expected {KM_SCHEMA!r}")
    v = d.get("version")
    if not isinstance(v, int) or v > KM_VERSION:
        raise ResultsFileError(f"{p}: kernel-metrics version {v!r} (this reads up to {KM_VERSION})")
    if not isinstance(d.get("builds"), list):
        raise ResultsFileError(f"{p}: no 'builds' list")
    for i, b in enumerate(d["builds"]):
        if not isinstance(b, dict) or not isinstance(b.get("source"), str) or not isinstance(b.get("kernels"), dict):
            raise ResultsFileError(f"{p}: build #{i} malformed (needs source, defines, kernels)")
        for kname, m in b["kernels"].items():
            lacking = [f for f in KM_FIELDS if not isinstance(m.get(f) if isinstance(m, dict) else None, int)]
            if lacking:
                raise ResultsFileError(f"{p}: {b['source']} kernel {kname}: missing/non-integer {lacking}")
    return d


def measure_kernels(builds: Sequence[tuple[str, Mapping[str, str]]], arch: str = "sm_90a") -> dict[str, dict]:
    """{build key: {"source", "defines", "kernels": {kernel: metrics}}} compiled now (NVRTC, CPU)."""
    from .compiler import compile_cuda

    out = {}
    for src, defs in builds:
        p = REPO_ROOT / src
        mod = compile_cuda(p, arch=arch, defines=dict(defs))
        kernels = {k: {f: int(getattr(u, f)) for f in KM_FIELDS} for k, u in sorted(mod.resources.items())}
        out[_build_key(src, defs)] = {"source": src, "defines": dict(defs), "kernels": kernels}
    return out


def planned_builds(baseline: dict | None, tracked_only: bool = False,
                   only: Sequence[str] | None = None) -> tuple[list[tuple[str, dict]], list[str]]:
    """Builds to compile: the baseline's (source, defines) records whose source still exists, plus
    every other .cu with no defines. Returns (builds, baseline sources that vanished)."""
    from .compiler import all_cuda_sources

    # never a virtual environment's or another hidden folder's sources (a CI venv inside the checkout
    # ships numba/torch .cu files that are not ours)
    present = [str(p.relative_to(REPO_ROOT)) for p in all_cuda_sources()
               if not any(part.startswith(".") or part == "site-packages" for part in p.relative_to(REPO_ROOT).parts)]
    if tracked_only:
        tracked = _tracked_cu(REPO_ROOT)
        if tracked is not None:
            present = [p for p in present if p in tracked]
    if only:
        missing = sorted(set(only) - set(present))
        if missing:
            raise ResultsFileError(f"no such .cu in the repository: {missing}")
        present = [p for p in present if p in only]
    builds, gone, covered = [], [], set()
    for b in (baseline or {}).get("builds", []):
        if only and b["source"] not in only:
            continue
        if b["source"] in present:
            builds.append((b["source"], {str(k): str(v) for k, v in (b.get("defines") or {}).items()}))
            covered.add(b["source"])
        else:
            gone.append(b["source"])
    builds += [(s, {}) for s in present if s not in covered]
    return builds, gone


def compare_kernels(baseline: dict, current: Mapping[str, dict], th: KernelThresholds = KernelThresholds()):
    """Rows of every kernel whose metrics changed, appeared or vanished, and the failures among them."""
    base = {_build_key(b["source"], b.get("defines") or {}): b for b in baseline.get("builds", [])}
    rows, failures = [], []
    for bk in sorted(set(base) | set(current)):
        bk_base = base.get(bk, {}).get("kernels", {})
        bk_cur = current.get(bk, {}).get("kernels", {})
        for kname in sorted(set(bk_base) | set(bk_cur)):
            o, n = bk_base.get(kname), bk_cur.get(kname)
            if o is None or n is None:
                if bk not in current and bk in base:
                    continue  # vanished sources are reported separately
                rows.append({"build": bk, "kernel": kname, "change": "new kernel" if o is None else "kernel removed",
                             "verdict": "info"})
                continue
            diffs, fails = [], []
            ospill = o["spill_store_bytes"] + o["spill_load_bytes"]
            nspill = n["spill_store_bytes"] + n["spill_load_bytes"]
            if nspill != ospill:
                diffs.append(f"spills {ospill}->{nspill} B")
                if nspill - ospill > th.max_spill_increase:
                    fails.append("spills")
            if n["registers"] != o["registers"]:
                diffs.append(f"registers {o['registers']}->{n['registers']}")
                if n["registers"] - o["registers"] > th.max_reg_increase:
                    fails.append("registers")
            if n["static_smem_bytes"] != o["static_smem_bytes"]:
                diffs.append(f"smem {o['static_smem_bytes']}->{n['static_smem_bytes']} B")
                if n["static_smem_bytes"] - o["static_smem_bytes"] > th.max_smem_increase:
                    fails.append("smem")
            if n["code_bytes"] != o["code_bytes"]:
                pct = 100.0 * (n["code_bytes"] - o["code_bytes"]) / max(1, o["code_bytes"])
                diffs.append(f"code {o['code_bytes']}->{n['code_bytes']} B ({pct:+.1f}%)")
                if pct > th.max_code_increase_pct:
                    fails.append("code bytes")
            for f in ("stack_frame_bytes", "barriers"):
                if n[f] != o[f]:
                    diffs.append(f"{f.replace('_', ' ')} {o[f]}->{n[f]}")
            if diffs:
                row = {"build": bk, "kernel": kname, "change": "; ".join(diffs),
                       "verdict": ("FAIL: " + ", ".join(fails)) if fails else "ok"}
                rows.append(row)
                if fails:
                    failures.append(row)
    return rows, failures


def kernel_gate(update: bool = False, path: Path | None = None, th: KernelThresholds = KernelThresholds(),
                tracked_only: bool = False, out=sys.stdout, only: Sequence[str] | None = None) -> int:
    from tabulate import tabulate

    from .compiler import DEFAULT_ARCH, toolchain_versions

    p = Path(path) if path else kernel_metrics_path()
    if update:
        atomic.check_writable(p)  # a baseline path in a folder that is not there: refused before compiling
    baseline = None
    if p.exists() or not update:
        baseline = load_kernel_baseline(p)
    if update and only:
        raise ResultsFileError("--update rewrites the whole baseline: do not combine it with --source")
    builds, gone = planned_builds(baseline, tracked_only, only)
    arch = (baseline or {}).get("arch", DEFAULT_ARCH)
    current = measure_kernels(builds, arch)
    tool = toolchain_versions()
    nk = sum(len(b["kernels"]) for b in current.values())
    if only and baseline:
        baseline = {**baseline, "builds": [b for b in baseline["builds"] if b["source"] in only]}
    rows, failures = compare_kernels(baseline or {"builds": []}, current, th)
    print(f"kernel metrics: {len(current)} builds, {nk} kernels compiled for {arch} (NVRTC {tool.get('nvrtc')})",
          file=out)
    if baseline and baseline.get("toolchain", {}).get("nvrtc") != tool.get("nvrtc"):
        print(f"WARNING: baseline was compiled with NVRTC {baseline.get('toolchain', {}).get('nvrtc')}, this is "
              f"{tool.get('nvrtc')}: differences may be the compiler's, not the code's", file=out)
    if gone:
        print(f"sources in the baseline that no longer exist: {', '.join(gone)}", file=out)
    if rows:
        print(tabulate(rows, headers="keys", tablefmt="github"), file=out)
    else:
        print("no kernel changed", file=out)
    print(th.describe(), file=out)
    if update:
        doc = {"schema": KM_SCHEMA, "version": KM_VERSION, "arch": arch,
               "toolchain": {k: v for k, v in tool.items()},
               "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "note": "Deterministic compile metrics per kernel (NVRTC -> cubin, ptxas -v and ELF sections). "
                       "CI recompiles every .cu and fails on increases: `megabench gate --kernels`. "
                       "Regenerate deliberately with `megabench gate --kernels --update` and commit it with the change.",
               "builds": [current[k] for k in sorted(current)]}
        atomic.write_json(p, doc)  # every kernel compiled and measured above: nothing half-written
        print(f"wrote {p} ({len(current)} builds, {nk} kernels)", file=out)
        return EXIT_OK
    if failures:
        print(f"FAIL: {len(failures)} kernel(s) grew beyond the thresholds; if intended, run "
              "`megabench gate --kernels --update` and commit reports/kernel_metrics.json", file=out)
        return EXIT_REGRESSION
    new = [r for r in rows if r["change"] == "new kernel"]
    if new:
        print(f"{len(new)} kernel(s) have no baseline yet (not a failure): record them with --update", file=out)
    return EXIT_OK


# ----------------------------------------------------------------------------- CLI
def add_parser(sub) -> None:
    s = sub.add_parser("gate", help="performance-regression gate (timing and kernel metrics)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("baseline", nargs="?", type=Path, help="baseline: result file, pytest-benchmark JSON or folder")
    s.add_argument("candidate", nargs="?", type=Path, help="candidate: result file, pytest-benchmark JSON or folder")
    s.add_argument("--floor", type=float, default=GateConfig.floor, help="minimum slowdown that can count (default 0.05)")
    s.add_argument("--k", type=float, default=GateConfig.k, help="noise multiple the slowdown must exceed (default 1)")
    s.add_argument("--alpha", type=float, default=GateConfig.alpha, help="Mann-Whitney significance level (default 0.01)")
    s.add_argument("--min-samples", type=int, default=GateConfig.min_samples, help="raw samples needed a side (default 8)")
    s.add_argument("--allow-unknown", action="store_true", help="unknown verdicts do not fail the gate")
    s.add_argument("--assume-gpu", default=None, metavar="KEY",
                   help="GPU key for pytest-benchmark files that do not record one, e.g. 'NVIDIA H200@1980MHz'")
    s.add_argument("--markdown", type=Path, default=None, help="also write the verdict table here (job summary)")
    s.add_argument("--json", type=Path, default=None, help="also write the verdicts as JSON here")
    s.add_argument("--kernels", action="store_true", help="gate deterministic kernel metrics instead (CPU)")
    s.add_argument("--update", action="store_true", help="with --kernels: rewrite the baseline file")
    s.add_argument("--kernel-baseline", type=Path, default=None, help="default reports/kernel_metrics.json")
    s.add_argument("--tracked-only", action="store_true", help="with --kernels: only .cu files git tracks")
    s.add_argument("--source", action="append", default=None, metavar="PATH.cu",
                   help="with --kernels: check only this source (repeatable; repository-relative path)")
    s.add_argument("--max-spill-increase", type=int, default=KernelThresholds.max_spill_increase)
    s.add_argument("--max-reg-increase", type=int, default=KernelThresholds.max_reg_increase)
    s.add_argument("--max-smem-increase", type=int, default=KernelThresholds.max_smem_increase)
    s.add_argument("--max-code-increase", type=float, default=KernelThresholds.max_code_increase_pct, metavar="PCT")
    s.add_argument("--quality", action="store_true",
                   help="estimate the gate's false-alarm and detection rates from recorded samples")
    s.add_argument("--results", type=Path, default=None, help="with --quality: results root")
    s.add_argument("--benchmarks", type=Path, default=None, help="with --quality: pytest-benchmark JSON folder")
    s.add_argument("--trials", type=int, default=200, help="with --quality: trials per recorded series")
    s.add_argument("--save", action="store_true", help="with --quality: save the gate.quality result")
    s.set_defaults(fn=_cmd)


def _cmd(args) -> int:
    cfg = GateConfig(args.floor, args.k, args.alpha, args.min_samples)
    if args.kernels:
        th = KernelThresholds(args.max_spill_increase, args.max_reg_increase, args.max_smem_increase,
                              args.max_code_increase)
        return kernel_gate(args.update, args.kernel_baseline, th, args.tracked_only, only=args.source)
    if args.quality:
        from .gate_quality import run_quality

        res, text = run_quality(args.results, args.benchmarks, cfg, trials=args.trials, save=args.save,
                                assume_gpu=args.assume_gpu)
        print(text)
        return EXIT_OK
    if args.baseline is None or args.candidate is None:
        print("megabench gate: give BASELINE and CANDIDATE (or --kernels / --quality)", file=sys.stderr)
        return EXIT_INPUT
    atomic.check_writable(args.markdown, args.json)  # before the work: a typo'd folder writes neither
    ignored: list[str] = []
    base = load_measurements(args.baseline, args.assume_gpu, ignored)
    cand = load_measurements(args.candidate, args.assume_gpu, ignored)
    try:
        rep = compare(base, cand, cfg)
    except GpuMismatchError as e:
        print(f"megabench gate: {e}", file=sys.stderr)
        return EXIT_GPU
    if ignored:
        rep.notes.append(f"ignored {len(ignored)} JSON file(s) that are not performance results "
                         "(gate analyses, constants, other JSON)")
    md = rep.to_markdown()
    print(md)
    if args.markdown:
        atomic.write_text(args.markdown, md)
    if args.json:
        atomic.write_json(args.json, rep.to_json())
    code = rep.exit_code(args.allow_unknown)
    if code == EXIT_UNKNOWN:
        print("gate: some verdicts are unknown (no raw samples or too few); not a pass. Use --allow-unknown to "
              "accept that.", file=sys.stderr)
    return code
