"""How good is the gate? Its false-alarm and detection rates, measured on the H200 by the gate itself.

Measurement (`megabench gate --quality-run --out DIR`, one command, ~2-3 minutes on an H200; run it
on two fresh machines). One in-run A/B session of the working tree against itself:
- two sides of the same tree, A and B, each of `replicas` worker processes (the gate's default,
  gate_ab.ABConfig.replicas), as `megabench gate --ab` runs them. Every worker of both sides holds
  each case of QUALITY_CASES several times: as built, and, for cases whose kernels carry the
  injection hook (mb/inject.cuh), built with MB_INJECT_PPM = 20000 / 50000 / 100000: the last
  block of every launch spins 2 / 5 / 10% of its own run time (`@p2`, `@p5`, `@p10`). The sides
  hold the same builds, so they differ by nothing but their processes (were only B to hold the
  injected builds, that asymmetry, not noise, would be counted by the A/A trials as false alarms);
- every round times, per worker, A's case as built and B's case as built and injected, the
  workers interleaved and the order reversed every other round (microbench/gate_ab.py), ROUNDS
  rounds; the run's figures are saved as a typed result
  `gate.quality_run` (under DIR/gate/, the workers' logs beside it). Megakernel cases are the small
  preset: two workers each holding shard8's ~120 GB of weights and kernel copies do not fit one H200.

Analysis (`megabench gate --quality RUN RUN [--save]`, CPU), of two such runs:
- a trial is one gate verdict on BLOCK (10) consecutive rounds, the size a CI run uses;
- in-run A/B mode: A/A trials are verdicts of A's workers against B's, detection trials of A's
  against B@pN's (gate_ab.replicated_verdict, its default floor and alpha). Runs with another
  number of workers a side are tallied apart, their measures
  suffixed `_<r>w`. An A/A trial is two-sided: a false
  alarm when either orientation (A vs B, B vs A) is called a regression, so the one-sided rate a
  CI run meets is about half of it;
- stored mode: the stored rule (gate.judge, its default floor, k and alpha) on the same blocks
  as unpaired samples: A/A across the two machines (A of one run against A of the other, and B
  against B) and on one machine (A against B); detection across machines (A of one run against
  B@pN of the other). Its cross-run noise term is the A/A spread of the *other* series
  (leave-one-out), so no series is judged with a threshold fitted to itself;
- each injected slowdown is verified by its own measured size: exp(median log(B@pN / A)) over
  all rounds of the run, less the same for B (the A/A offset). A case whose measured injection
  is under half its nominal size is left out of that detection rate and listed;
- counting independent units honestly: trials of one (run, case) share that case's conditions,
  so rates carry a 95% Wilson interval on the effective number of trials n / (1 + (m - 1) ICC)
  (m trials per cluster; ICC from a one-way ANOVA of the outcomes, or, when they all agree (no
  false alarm at all), of the trials' estimated slowdowns, which the alarms follow; 1, i.e. n_eff
  = the number of clusters, when neither varies), and beside it the conservative interval with
  one trial per cluster;
- the per-series A/A cross-run spreads become the typed result `gate.aa_spread` the stored gate
  uses (max over the four cross-machine pairs of the same build: A/A, B/B, A/B, B/A).
The result `gate.quality` (reports/results/gate/) holds every rate with its counts; the report
shows it (report_lines, trust_rows).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import platform
import re
import socket
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tabulate import tabulate

from . import atomic
from .clocks.probes import LAUNCH_DEFINES
from .compiler import compile_cuda
from .device import no_gpu_reason
from .errors import NoGPUError, ResultsFileError
from .gate import CrossRun, GateConfig, Measurement, judge, key_class
from .gate_ab import (ABConfig, Comparison, Entry, SideSpec, pool_prepared, prepare_sides, replicate,
                      replicated_verdict, run_rounds, tree_label)
from .results import REPO_ROOT, Derived, Env, Result, Series, find, git_dirty, git_sha, load, results_root

PPMS = (20000, 50000, 100000)
# 20 rounds: two trials of BLOCK per case; with three workers a side, a few minutes of rounds on an H200
ROUNDS = 20
BLOCK = 10
MIN_INJECT_FRACTION = 0.5  # a measured injection under this share of nominal is not counted as injected
TARGETS = {"false_alarm_rate_ab": ("<=", 0.01), "detection_rate_ab_5pct": (">=", 0.95),
           "detection_rate_ab_10pct": (">=", 1.0)}
METHOD = "two quality runs (gate.quality_run) on fresh machines, trials of 10 rounds, clusters (run, case)"

# (pytest nodeid, kernels carry the injection hook). Every worker holds each hooked case four times
# (as built and at each injection) with its own buffers; the two 2 GiB cases (the 1 GiB copy's source
# and destination, the read ceiling's buffer) are timed as built only: hooked, each worker would hold
# every copy of them, and six workers of three a side do not fit one H200's memory.
QUALITY_CASES = (
    ("tests/bench/test_bench_basics.py::test_copy[mb_copy_v4-64MiB]", True),
    ("tests/bench/test_bench_basics.py::test_copy[mb_copy_v4-1024MiB]", False),
    ("tests/bench/test_bench_basics.py::test_copy[memcpy-64MiB]", False),
    ("tests/bench/test_bench_basics.py::test_empty_kernel_launch", False),
    ("tests/bench/test_bench_weights.py::test_read_ceiling", False),
    ("tests/bench/test_bench_weights.py::test_l2_read[16MiB]", True),
    ("tests/bench/test_bench_sync.py::test_sync[sync/pingpong/gpu_acq/128rounds/8flags]", True),
    ("tests/bench/test_bench_sync.py::test_sync[sync/publish/ping/release_flag/256B/8flags]", True),
    ("tests/bench/test_bench_sync.py::test_sync[sync/grid/depflags/D=1/1000stops]", True),
    ("tests/bench/test_bench_sync.py::test_sync[sync/fences/all_kinds/1blk_pinned/65536B]", True),
    ("tests/bench/test_bench_clocks.py::test_launch_chain[plain]", True),
    ("tests/bench/test_bench_icache.py::test_capacity_loop[16KiB-w4]", False),
    ("tests/bench/test_bench_icache.py::test_prefetch_probe[warm]", False),
    ("tests/bench/test_bench_megakernel.py::test_megakernel_step[small-1-512-chain]", True),
    ("tests/bench/test_bench_megakernel.py::test_megakernel_step[small-1-512-mega]", True),
    ("tests/bench/test_bench_megakernel.py::test_megakernel_step[small-16-512-chain]", True),
    ("tests/bench/test_bench_megakernel.py::test_megakernel_step[small-16-512-mega]", True),
)


# the microbench sources the quality cases' hooked kernels come from (precompile)
HOOKED_SOURCES = ("microbench/basics/copy.cu", "microbench/weights/read.cu", "microbench/sync/flags.cu",
                  "microbench/sync/publish.cu", "microbench/sync/fences.cu", "microbench/sync/barriers.cu",
                  "microbench/clocks/launch.cu")


def variant_name(ppm: int) -> str:
    return f"p{ppm // 10000}" if ppm % 10000 == 0 else f"ppm{ppm}"


# ----------------------------------------------------------------------------- statistics
def wilson(k: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (default 95%) for k successes in n trials (n may be fractional: an
    effective number of trials)."""
    if n <= 0:
        return 0.0, 1.0
    p = min(1.0, max(0.0, k / n))
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    # at p = 0 (or 1) c and h are equal in exact arithmetic; their rounding is the platform's
    # (1.4e-17 on the H200's Python 3.12, 0 here), so the ends are set, not computed
    return (0.0 if p == 0.0 else max(0.0, c - h)), (1.0 if p == 1.0 else min(1.0, c + h))


def anova_icc(clusters: Sequence[Sequence[float]]) -> float | None:
    """One-way ANOVA estimate of the intra-cluster correlation, clipped to [0, 1]; None when it
    cannot be estimated (fewer than two clusters, or no variation at all)."""
    cs = [np.asarray(c, dtype=np.float64) for c in clusters if len(c)]
    k = len(cs)
    n = sum(c.size for c in cs)
    if k < 2 or n <= k:
        return None
    grand = float(np.concatenate(cs).mean())
    m0 = (n - sum(c.size ** 2 for c in cs) / n) / (k - 1)
    msb = sum(c.size * (c.mean() - grand) ** 2 for c in cs) / (k - 1)
    msw = sum(((c - c.mean()) ** 2).sum() for c in cs) / (n - k)
    den = msb + (m0 - 1) * msw
    if den <= 0:
        return None if msb <= 0 else 1.0
    return float(min(1.0, max(0.0, (msb - msw) / den)))


def effective_n(clusters: Sequence[Sequence[bool]], values: Sequence[Sequence[float]] | None = None
                ) -> tuple[float, float]:
    """(n_eff, ICC) of binary trials grouped in clusters: n / (1 + (m - 1) ICC). ICC is estimated
    from the outcomes when they vary; when every outcome is the same it cannot be, and the ICC of
    the trials' continuous statistic (`values`, e.g. each verdict's estimated slowdown: alarms
    follow it) is used instead; without one, ICC = 1 (n_eff = the number of clusters)."""
    cs = [list(map(bool, c)) for c in clusters if len(c)]
    n = sum(len(c) for c in cs)
    if n == 0:
        return 0.0, float("nan")
    mbar = n / len(cs)
    icc = anova_icc([[float(x) for x in c] for c in cs])
    if icc is None and values is not None:
        icc = anova_icc([v for v in values if len(v)])
    icc = 1.0 if icc is None else icc
    return n / (1 + (mbar - 1) * icc), icc


@dataclass
class Tally:
    """Trials of one measure: outcomes per cluster (a (run, case) or a case)."""

    measure: str  # derived key, e.g. detection_rate_ab_5pct
    mode: str  # "in-run A/B" | "stored"
    what: str
    slowdown: float  # nominal injected slowdown, 0 for A/A
    clusters: dict[str, list[bool]] = field(default_factory=dict)
    values: dict[str, list[float]] = field(default_factory=dict)  # each trial's estimated slowdown
    excluded: dict[str, str] = field(default_factory=dict)  # cluster -> why it is not counted

    def add(self, cluster: str, flagged: bool, value: float | None = None) -> None:
        self.clusters.setdefault(cluster, []).append(bool(flagged))
        if value is not None and math.isfinite(value):
            self.values.setdefault(cluster, []).append(float(value))

    @property
    def flagged(self) -> int:
        return sum(sum(c) for c in self.clusters.values())

    @property
    def trials(self) -> int:
        return sum(len(c) for c in self.clusters.values())

    @property
    def rate(self) -> float:
        return self.flagged / self.trials if self.trials else float("nan")

    def interval(self) -> tuple[float, float, float, float]:
        """(lo, hi, n_eff, icc): 95% Wilson on the effective number of trials (effective_n)."""
        n_eff, icc = effective_n(list(self.clusters.values()), list(self.values.values()) or None)
        lo, hi = wilson(self.rate * n_eff, n_eff) if self.trials else (0.0, 1.0)
        return lo, hi, n_eff, icc

    def conservative(self) -> tuple[float, float]:
        """95% Wilson with one trial per cluster: what the rate claims if nothing within a
        cluster were independent."""
        k = len(self.clusters)
        return wilson(self.rate * k, k) if k else (0.0, 1.0)


# ----------------------------------------------------------------------------- the GPU run
def quality_sides(root: Path, cases: Sequence[tuple[str, bool]] = QUALITY_CASES, ppms: Sequence[int] = PPMS,
                  backend: str = "pytest", spec: dict | None = None) -> tuple[SideSpec, SideSpec]:
    """Sides A and B of one tree, holding the same builds (as built and every injection)."""
    label = tree_label(root)
    inject = [c for c, hooked in cases if hooked]
    variants = [{"name": "", "env": {}}] + [{"name": variant_name(p), "env": {"MEGABENCH_INJECT_PPM": str(p)},
                                             "only": inject} for p in ppms]
    return (SideSpec("A", root, label, backend, spec, [dict(v) for v in variants]),
            SideSpec("B", root, label, backend, spec, [dict(v) for v in variants]))


def _precompile_one(task: tuple) -> str:
    """One build of the precompile: (build, args, ppm) with `build(*args)` a module-level function
    (spawned processes pickle it by name) run with the injection set to `ppm`."""
    build, args, ppm = task
    if ppm:
        os.environ["MEGABENCH_INJECT_PPM"] = str(ppm)
    else:
        os.environ.pop("MEGABENCH_INJECT_PPM", None)
    return f"{build(*args)} ppm={ppm}"


def compile_source(path: str, defines: dict) -> str:
    """A hooked microbench source of the quality cases, compiled into the kernel cache."""
    compile_cuda(REPO_ROOT / path, arch="sm_90a", defines=defines)
    return path


def precompile(ppms: Sequence[int] = PPMS, jobs: int | None = None, log: Callable[[str], None] = print,
               builds: Sequence[tuple[Callable[..., str], tuple]] = ()) -> float:
    """Compile, in parallel, the builds the quality run's B side will ask for (the hooked microbench
    sources, and `builds`: (function, args) pairs the caller adds, e.g. the megakernel cases'
    builds), each plain and at every ppm, into the kernel cache: the workers prepare sequentially,
    and builds compiled one after another cost GPU-machine time. A build not listed here is simply
    compiled by its worker."""
    tasks = [(fn, args, p) for p in (0, *ppms) for fn, args in builds]
    tasks += [(compile_source, (path, dict(LAUNCH_DEFINES) if path.endswith("launch.cu") else {}), p)
              for p in (0, *ppms) for path in HOOKED_SOURCES]
    t0 = time.monotonic()
    jobs = jobs or max(1, min(len(tasks), (os.cpu_count() or 2) - 1))
    # spawned, not forked: the parent has initialised CUDA (its GPU check), and a forked child's
    # driver calls fail
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        done = list(ex.map(_precompile_one, tasks))
    dt = time.monotonic() - t0
    log(f"precompiled {len(done)} builds with {jobs} processes in {dt:.0f} s")
    return dt


def quality_run(out: Path, rounds: int = ROUNDS, cfg: ABConfig = ABConfig(), backend: str = "pytest",
                spec: dict | None = None, cases: Sequence[tuple[str, bool]] = QUALITY_CASES,
                ppms: Sequence[int] = PPMS, root: Path = REPO_ROOT, log: Callable[[str], None] = print,
                do_precompile: bool = True, env: Env | None = None,
                builds: Sequence[tuple[Callable[..., str], tuple]] = ()) -> tuple[Result, Path]:
    """The measurement (module docstring). Writes DIR/gate/gate.quality_run-*.json (+ .md) and
    returns (result, path). `builds`: extra builds to precompile (precompile)."""
    t_start = time.monotonic()
    if backend == "pytest":
        reason = no_gpu_reason()
        if reason:
            raise NoGPUError(f"the gate's quality run times kernels on a GPU: {reason}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if backend == "pytest" and do_precompile:
        precompile(ppms, log=log, builds=builds)
    a, b = quality_sides(Path(root), cases, ppms, backend, spec)
    sa, sb = replicate(a, cfg.replicas), replicate(b, cfg.replicas)
    work = Path(tempfile.mkdtemp(prefix="quality-run-logs-", dir=out))  # worker logs come back with the result
    ids = [c for c, _ in cases]
    workers, prepared_w, notes = prepare_sides([*sa, *sb], {"ids": ids}, work, cfg, log)
    try:
        prepared = {"A": pool_prepared(prepared_w, [x.name for x in sa]),
                    "B": pool_prepared(prepared_w, [x.name for x in sb])}
        ca = {c["id"]: c for c in prepared["A"]["cases"]}
        cb = {c["id"]: c for c in prepared["B"]["cases"]}
        comps, missing = [], []
        hooked = dict(cases)
        for cid in ids:
            if cid not in ca or cid not in cb:
                missing.append(cid)
                continue
            entries = []
            for rep_i, (wa, wb) in enumerate(zip(sa, sb), start=1):
                entries += [Entry(wa.name, cid, "A", rep_i), Entry(wb.name, cid, "B", rep_i)]
                entries += [Entry(wb.name, f"{cid}@{variant_name(p)}", f"B@{variant_name(p)}", rep_i) for p in ppms
                            if f"{cid}@{variant_name(p)}" in cb]
            comps.append(Comparison(cid, "s", entries))
        log(f"timing {len(comps)} case(s) x {rounds} rounds ({sum(len(c.entries) for c in comps)} figures a round)")
        wall = run_rounds(workers, comps, rounds, cfg, log)
        hellos = {n: dict(w.hello or {}) for n, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    failed = [f for p in prepared.values() for f in p["failed"]]
    skipped = [s for p in prepared.values() for s in p["skipped"]]
    env = env or Env.capture()
    series = []
    for c in comps:
        info = ca[c.key].get("info", {})
        for e, xs in zip(c.entries, c.values):
            variant = e.case.split("@", 1)[1] if "@" in e.case else ""
            ppm = next((p for p in ppms if variant_name(p) == variant), 0)
            side = e.group.split("@", 1)[0]
            series.append(Series.from_samples(
                f"{c.key}/{e.side}{'@' + variant if variant else ''}", xs,
                timer="cuda_event" if env.gpu else "host", unit="s",
                params={"case": c.key, "side": side, "worker": e.side, "replica": e.replica, "variant": variant,
                        "inject_ppm": ppm,
                        "samples_per_round": c.k, "class": ca[c.key].get("class"), "hooked": bool(hooked.get(c.key)),
                        "case_name": info.get("case"), "order": "alternating rounds"},
                metrics={"gate_direction": "none", "independent_repeats": len(xs)}))
    total = time.monotonic() - t_start
    res_notes = (f"gate quality run: {len(comps)} cases, {rounds} rounds, {cfg.replicas} worker(s) a side holding the "
                 f"same builds, {wall:.0f} s of rounds, {total:.0f} s in all "
                 f"(precompile, workers, prepare, rounds); tree {a.label}",
                 f"injected (MB_INJECT_PPM): {', '.join(str(p) for p in ppms)} ppm on hooked cases",
                 *(f"missing on a side: {m}" for m in missing),
                 *(f"failed: {f['id']}: {f['error'].splitlines()[0][:300]}" for f in failed),
                 *(f"skipped: {s['id']}: {s['reason'][:200]}" for s in skipped), *notes)
    res = Result("gate.quality_run", env, tuple(series),
                 {"rounds": Derived(float(rounds), "count", "rounds of the run"),
                  "replicas": Derived(float(cfg.replicas), "count", "worker processes a side, both sides holding "
                                      "the same builds"),
                  "wall_s": Derived(float(total), "s", "seconds the command took, all of it")},
                 quick=False, notes=res_notes)
    path = res.save(out)
    one = analyse([load_run(res, str(path))], BLOCK)
    md = "\n".join([f"# gate quality run {env.date} on {env.gpu} ({env.host})", "", *res_notes, "",
                    *summary_lines(one), ""])
    atomic.write_text(path.with_name(path.name.split(".json")[0] + ".md"), md)
    (work / "hellos.json").write_text(json.dumps(hellos, indent=1))
    log(md)
    log(f"saved {path} ({total:.0f} s)")
    return res, path


# ----------------------------------------------------------------------------- the analysis
@dataclass
class RunData:
    source: str
    env: Env
    figures: dict[str, dict[str, np.ndarray]]  # case -> {"A", "B", "p2", ...} -> round figures of the first worker
    hooked: dict[str, bool]
    ppm_of: dict[str, int]  # variant -> ppm
    reps: dict[str, dict[str, list[np.ndarray]]] = field(default_factory=dict)  # the same, every worker in order
    replicas: int = 1  # workers a side
    symmetric: bool = False  # both sides held the same builds

    def workers(self, case: str, key: str) -> list[np.ndarray]:
        return self.reps.get(case, {}).get(key) or [self.figures[case][key]]

    @property
    def label(self) -> str:
        return f"{self.env.host} {self.env.date[:16]}"


def load_run(res: Result, source: str = "") -> RunData:
    if res.benchmark != "gate.quality_run":
        raise ResultsFileError(f"{source or res.benchmark}: a {res.benchmark} result, not gate.quality_run")
    figs: dict[str, dict[str, np.ndarray]] = {}
    reps: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    hooked, ppm_of = {}, {}
    for s in res.series:
        p = s.params
        try:
            case, side, variant = str(p["case"]), str(p["side"]), str(p.get("variant") or "")
        except KeyError as e:
            raise ResultsFileError(f"{source}: series {s.name} lacks {e}") from None
        x = np.asarray(s.samples, dtype=np.float64)
        replica = int(p.get("replica") or 1)
        if replica == 1:
            figs.setdefault(case, {})[variant or side] = x
        reps.setdefault(case, {}).setdefault(variant or side, {})[replica] = x
        hooked[case] = bool(p.get("hooked"))
        if variant:
            ppm_of[variant] = int(p.get("inject_ppm") or 0)
    r = res.derived.get("replicas")
    replicas = int(r.value) if r is not None else 1
    for case, by in reps.items():
        for key, per in by.items():
            if sorted(per) != list(range(1, len(per) + 1)) or (replicas > 1 and len(per) != replicas):
                raise ResultsFileError(f"{source}: {case} {key}: workers {sorted(per)} of {replicas} a side")
    return RunData(source, res.env, figs, hooked, ppm_of,
                   {c: {k: [per[i] for i in sorted(per)] for k, per in by.items()} for c, by in reps.items()},
                   replicas, r is not None)


def find_runs(paths: Sequence[Path] | None = None) -> list[RunData]:
    """Quality runs from files or folders (default: the committed reports/results/gate); a file
    reached twice counts once."""
    paths = list(paths or [REPO_ROOT / "reports" / "results" / "gate"])
    out, seen = [], set()
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise ResultsFileError(f"{p}: no such file or folder")
        files = [p] if p.is_file() else find("gate.quality_run", p)
        for f in files:
            if f.resolve() in seen:
                continue
            seen.add(f.resolve())
            out.append(load_run(load(f), str(f)))
    return sorted(out, key=lambda r: r.env.date)


def _two_sided(verdicts) -> tuple[bool, float | None]:
    """One A/A trial from both orientations of a comparison: a false alarm when either calls a
    regression (the one-sided rate a CI run sees is about half), its size the larger |slowdown|."""
    sds = [abs(v.slowdown) for v in verdicts if v.slowdown is not None]
    return any(v.verdict == "regression" for v in verdicts), (max(sds) if sds else None)


def _blocks(n: int, block: int) -> list[slice]:
    return [slice(i, i + block) for i in range(0, n - block + 1, block)]


def _m(key: str, x: np.ndarray) -> Measurement:
    return Measurement(key, tuple(float(v) for v in x), float(np.median(x)), None, "s", "lower", "g", "q", "")


def measured_injection(run: RunData, case: str, variant: str) -> float:
    """exp(mean over workers of median log(B@v / A) less median log(B / A)) - 1: the injected
    build's own slowdown, each worker's A/A offset taken out (a worker's builds share its process)."""
    a, b, v = run.workers(case, "A"), run.workers(case, "B"), run.workers(case, variant)
    per = [float(np.median(np.log(x / y)) - np.median(np.log(z / y))) for x, z, y in zip(v, b, a)]
    return float(np.expm1(np.mean(per)))


def _suffix(run: RunData) -> str:
    """In-run measures of runs made as the gate runs now (its default workers a side, both sides
    holding the same builds) carry no suffix; others are tallied apart."""
    return "" if (run.replicas == ABConfig().replicas and run.symmetric) else f"_{run.replicas}w"


def machine_of(run: RunData) -> tuple:
    """The machine a run was made on: every device VM is called "vm", so its GPU's UUID tells them apart."""
    return (run.env.gpu_uuid, run.env.host)


def run_pairs(runs: Sequence[RunData]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(pairs of runs on different machines, pairs of runs on one machine), each pair i < j."""
    apart, same = [], []
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            (apart if machine_of(runs[i]) != machine_of(runs[j]) else same).append((i, j))
    return apart, same


def aa_spreads(runs: Sequence[RunData], pairs: Sequence[tuple[int, int]] | None = None) -> dict[str, float]:
    """Per case: the largest relative difference of run medians of the same build across two
    different runs (A/A, B/B, A/B, B/A over the given pairs of runs; default every pair)."""
    if pairs is None:
        pairs = [(i, j) for i in range(len(runs)) for j in range(i + 1, len(runs))]
    out: dict[str, float] = {}
    for i, j in pairs:
        for case in set(runs[i].figures) & set(runs[j].figures):
            fi, fj = runs[i].figures[case], runs[j].figures[case]
            for x in ("A", "B"):
                for y in ("A", "B"):
                    if x in fi and y in fj:
                        s = abs(float(np.median(fi[x]) / np.median(fj[y])) - 1.0)
                        out[case] = max(out.get(case, 0.0), s)
    return out


CALIBRATION_LEVELS = (0.05, 0.10, 0.25, 0.50)


def ks_uniform(ps: Sequence[float]) -> tuple[float, float]:
    """Kolmogorov-Smirnov test of p-values against Uniform(0, 1): (D, asymptotic p-value)."""
    x = np.sort(np.asarray(ps, dtype=np.float64))
    n = x.size
    if n == 0:
        return float("nan"), float("nan")
    i = np.arange(1, n + 1)
    d = float(max(np.max(i / n - x), np.max(x - (i - 1) / n)))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2.0 * sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return d, float(min(1.0, max(0.0, p)))


def process_calibration(runs: Sequence[RunData], ab_cfg: ABConfig = ABConfig()) -> dict[str, float]:
    """The in-run rule's process test under A/A, one p-value per (run, case): the test of A's
    workers against B's over all of the run's rounds (gate_ab.replicated_verdict's p_process).
    A false alarm needs that p under process_alpha in one orientation, so a calibrated test caps
    the two-sided A/A rate at 2 x process_alpha whatever the rounds say. The p-values should be
    uniform: {cluster: p}. 68 clusters test that at the 5-50% levels, where 136 trials cannot
    resolve a 1% rate by counting alarms."""
    out: dict[str, float] = {}
    for ri, run in enumerate(runs):
        if run.replicas < 2:
            continue
        for case, f in sorted(run.figures.items()):
            if "A" in f and "B" in f:
                v = replicated_verdict(case, run.workers(case, "A"), run.workers(case, "B"), "s", ab_cfg)
                if v.p_process is not None and math.isfinite(v.p_process):
                    out[f"run{ri + 1}:{case}"] = float(v.p_process)
    return out


@dataclass
class Analysis:
    tallies: list[Tally]
    injections: dict[str, dict[str, dict[str, float]]]  # run label -> case -> variant -> measured
    spreads: dict[str, float]
    runs: list[RunData]
    block: int
    ab_cfg: ABConfig
    st_cfg: GateConfig
    detection_by_measured: dict[str, tuple[int, int]] = field(default_factory=dict)
    calibration: dict[str, float] = field(default_factory=dict)  # process_calibration

    def tally(self, measure: str) -> Tally | None:
        return next((t for t in self.tallies if t.measure == measure), None)


def _pct(ppm: int) -> str:
    return f"{round(ppm / 10000)}pct" if ppm % 10000 == 0 else f"{ppm}ppm"


MEASURED_BINS = ((0.0, 0.03), (0.03, 0.045), (0.045, 0.075), (0.075, 1e9))


def machines_apart(runs: Sequence[RunData]) -> bool:
    """Whether some two runs are on different machines: the stored mode's cross-machine rows and
    gate.aa_spread then come from those pairs (pairs on one machine are tallied apart)."""
    return len({machine_of(r) for r in runs}) >= 2


# the stored mode's tallies of pairs of runs on one machine, when other pairs are on two machines
ONE_MACHINE = "_one_machine"


def analyse(runs: Sequence[RunData], block: int = BLOCK, ab_cfg: ABConfig = ABConfig(),
            st_cfg: GateConfig = GateConfig()) -> Analysis:
    """Every tally of the module docstring from one or more runs (the across-machine ones need two)."""
    runs = list(runs)
    if not runs:
        raise ResultsFileError("no gate.quality_run results to analyse")
    ppms = sorted({p for r in runs for p in r.ppm_of.values() if p})
    T: dict[str, Tally] = {}

    def t(measure, mode, what, sd=0.0) -> Tally:
        if measure not in T:
            T[measure] = Tally(measure, mode, what, sd)
        return T[measure]

    aa_st1 = t("false_alarm_rate_stored_same_machine", "stored", "A/A on one machine: two workers' figures, unpaired")
    injections: dict[str, dict[str, dict[str, float]]] = {}
    by_measured = {f"{lo:.3f}-{hi:.3f}": [0, 0] for lo, hi in MEASURED_BINS}
    for ri, run in enumerate(runs):
        sfx = _suffix(run)
        how = (f"{run.replicas} workers a side" if run.replicas > 1 else "one worker a side") + (
            "" if run.symmetric else ", B alone holding the injected builds")
        aa_ab = t(f"false_alarm_rate_ab{sfx}", "in-run A/B", f"A/A: the same tree on both sides ({how})")
        aa_unk = t(f"unknown_rate_ab{sfx}", "in-run A/B", f"A/A: unknown, a slowdown over the floor that the "
                   f"workers' spread could not confirm ({how})")
        inj = injections.setdefault(run.label, {})
        for case, f in sorted(run.figures.items()):
            if "A" not in f or "B" not in f:
                continue
            cl = f"run{ri + 1}:{case}"
            n = min(len(v) for v in f.values())
            wa, wb = run.workers(case, "A"), run.workers(case, "B")
            for sl in _blocks(n, block):
                a, b = [x[sl] for x in wa], [x[sl] for x in wb]
                vs = [replicated_verdict(case, x, y, "s", ab_cfg) for x, y in ((a, b), (b, a))]
                aa_ab.add(cl, *_two_sided(vs))
                aa_unk.add(cl, any(v.verdict == "unknown" for v in vs))
                aa_st1.add(cl, *_two_sided([judge(_m(case, x), _m(case, y), st_cfg)
                                            for x, y in ((f["A"][sl], f["B"][sl]), (f["B"][sl], f["A"][sl]))]))
            for variant in sorted(v for v in f if v not in ("A", "B")):
                ppm = run.ppm_of.get(variant, 0)
                nominal = ppm / 1e6
                got = measured_injection(run, case, variant)
                inj.setdefault(case, {})[variant] = got
                tt = t(f"detection_rate_ab_{_pct(ppm)}{sfx}", "in-run A/B", f"injected {nominal:.0%} ({how})", nominal)
                if got < MIN_INJECT_FRACTION * nominal:
                    tt.excluded[cl] = f"measured injection {got:+.2%} of a nominal {nominal:.0%}"
                    continue
                wv = run.workers(case, variant)
                tu = t(f"unknown_rate_ab_{_pct(ppm)}{sfx}", "in-run A/B", f"injected {nominal:.0%}: unknown instead of "
                       f"caught ({how})", nominal)
                for sl in _blocks(n, block):
                    pv = replicated_verdict(case, [x[sl] for x in wa], [x[sl] for x in wv], "s", ab_cfg)
                    v = pv.verdict == "regression"
                    tt.add(cl, v, pv.slowdown)
                    tu.add(cl, pv.verdict == "unknown")
                    if sfx:
                        continue
                    for lo, hi in MEASURED_BINS:
                        if lo <= got < hi:
                            by_measured[f"{lo:.3f}-{hi:.3f}"][0] += v
                            by_measured[f"{lo:.3f}-{hi:.3f}"][1] += 1
    apart, same = run_pairs(runs)
    # the spread the stored gate reads is the one across machines; only without such pairs, one machine's
    spreads = aa_spreads(runs, apart if apart else same)
    if len(runs) >= 2:
        cross = CrossRun(dict(spreads), runs[0].env.gpu)
        # pairs on two machines make the main stored rows; pairs on one machine beside them get the
        # ONE_MACHINE suffix, or, when every run is on one machine, make the main rows, labelled so
        groups = [(apart, "", True), (same, ONE_MACHINE, False)] if apart else [(same, "", False)]
        for pairs, sfx, across in groups:
            if not pairs:
                continue
            aa_x = t(f"false_alarm_rate_stored{sfx}", "stored",
                     "A/A across two machines, unpaired" if across else
                     "A/A across two runs on one machine (the runs share a GPU), unpaired")
            for i0, j0 in pairs:
                for i, j in ((i0, j0), (j0, i0)):
                    for case in sorted(set(runs[i].figures) & set(runs[j].figures)):
                        fi, fj = runs[i].figures[case], runs[j].figures[case]
                        if not all(k in fi and k in fj for k in ("A", "B")):
                            continue
                        spread, how = cross.for_key(case, exclude_self=True)
                        n = min(min(len(v) for v in fi.values()), min(len(v) for v in fj.values()))
                        for sl in _blocks(n, block):
                            for side in ("A", "B"):
                                if i < j:  # each unordered pair of runs once, both orientations in one trial
                                    x, y = fi[side][sl], fj[side][sl]
                                    aa_x.add(case, *_two_sided([judge(_m(case, u), _m(case, w), st_cfg, spread, how)
                                                                for u, w in ((x, y), (y, x))]))
                            for variant in sorted(v for v in fj if v not in ("A", "B")):
                                ppm = runs[j].ppm_of.get(variant, 0)
                                nominal = ppm / 1e6
                                tt = t(f"detection_rate_stored_{_pct(ppm)}{sfx}", "stored",
                                       f"injected {nominal:.0%}, baseline from the other "
                                       f"{'machine' if across else 'run on the same machine'}", nominal)
                                got = measured_injection(runs[j], case, variant)
                                if got < MIN_INJECT_FRACTION * nominal:
                                    tt.excluded[case] = f"measured injection {got:+.2%} of a nominal {nominal:.0%}"
                                    continue
                                v = judge(_m(case, fi["A"][sl]), _m(case, fj[variant][sl]), st_cfg, spread, how)
                                tt.add(case, v.verdict == "regression", v.slowdown)
    sfxs = sorted({_suffix(r) for r in runs}, key=lambda x: (x != "", x))
    order = [k for x in sfxs for k in (f"false_alarm_rate_ab{x}", *[f"detection_rate_ab_{_pct(p)}{x}" for p in ppms],
                                       f"unknown_rate_ab{x}", *[f"unknown_rate_ab_{_pct(p)}{x}" for p in ppms])]
    order += ["false_alarm_rate_stored", "false_alarm_rate_stored_same_machine",
              *[f"detection_rate_stored_{_pct(p)}" for p in ppms],
              f"false_alarm_rate_stored{ONE_MACHINE}", *[f"detection_rate_stored_{_pct(p)}{ONE_MACHINE}" for p in ppms]]
    tallies = [T[k] for k in order if k in T]
    return Analysis(tallies, injections, spreads, runs, block, ab_cfg, st_cfg,
                    {k: (v[0], v[1]) for k, v in by_measured.items() if v[1]}, process_calibration(runs, ab_cfg))


def calibration_line(an: Analysis) -> str | None:
    """The process test's calibration under A/A in one sentence (None without multi-worker runs)."""
    ps = list(an.calibration.values())
    if not ps:
        return None
    d, pk = ks_uniform(ps)
    a = an.ab_cfg.process_alpha
    below = ", ".join(f"{sum(p < lv for p in ps)} under {lv:g} ({lv * len(ps):.1f} expected)" for lv in CALIBRATION_LEVELS)
    return (f"in-run A/B, the process test under A/A (one p-value per run and case, {len(ps)}): {below}; "
            f"against uniform KS D={d:.3f}, p={pk:.2f}. A false alarm needs p < {a:g} in one orientation, so a "
            f"calibrated test caps the two-sided A/A rate at {2 * a:.0%}")


def _fmt_rate(t: Tally) -> str:
    lo, hi, n_eff, _ = t.interval()
    clo, chi = t.conservative()
    return (f"{t.rate:.1%} ({t.flagged}/{t.trials}; 95% {lo:.1%}-{hi:.1%} on n_eff {n_eff:.0f}, "
            f"{clo:.1%}-{chi:.1%} on {len(t.clusters)} clusters)")


def summary_lines(an: Analysis) -> list[str]:
    lines = [f"Trials of {an.block} rounds; in-run rule: {an.ab_cfg.describe()}; stored rule: {an.st_cfg.describe()}.",
             ""]
    for t in an.tallies:
        lines.append(f"- {t.mode}, {t.what}: {_fmt_rate(t)}" + (f"; left out: {len(t.excluded)}" if t.excluded else ""))
    cal = calibration_line(an)
    if cal:
        lines.append(f"- {cal}")
    return lines


def to_results(an: Analysis) -> tuple[Result, Result]:
    """(gate.quality, gate.aa_spread) from an analysis of two or more runs."""
    runs = an.runs
    src_env = max((r.env for r in runs), key=lambda e: e.date)

    env = dataclasses.replace(
        src_env, date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), git_sha=git_sha(full=True),
        git_dirty=git_dirty(), host=socket.gethostname(),
        python=platform.python_version(), machine_kind="analysis of recorded quality runs")
    series, derived = [], {}
    for t in an.tallies:
        per = {c: float(np.mean(v)) for c, v in t.clusters.items()}
        if not per:
            continue
        lo, hi, n_eff, icc = t.interval()
        clo, chi = t.conservative()
        series.append(Series.from_samples(
            t.measure, list(per.values()), timer="derived", unit="fraction",
            params={"mode": t.mode, "what": t.what, "slowdown": t.slowdown, "block_rounds": an.block,
                    "method": METHOD, "fresh_machines": machines_apart(an.runs), "runs": len(an.runs),
                    "machines": len({machine_of(r) for r in an.runs})},
            metrics={"flagged": t.flagged, "trials": t.trials, "clusters": len(per), "n_eff": n_eff, "icc": icc,
                     "interval_by_clusters": [clo, chi], "per_cluster": per, "excluded": t.excluded,
                     "gate_direction": "none"}))
        target = TARGETS.get(t.measure)
        note = ""
        if target:
            ok = t.rate <= target[1] if target[0] == "<=" else t.rate >= target[1]
            note = f"target {target[0]} {target[1]:.0%}: {'met' if ok else 'NOT met'} by the point estimate"
        flag = "unknown" if t.measure.startswith("unknown_") else "regression"
        derived[t.measure] = Derived(
            t.rate, "fraction", f"{t.mode}: {t.what}: {t.flagged} of {t.trials} trials of {an.block} rounds flagged "
            f"'{flag}', {len(per)} clusters, n_eff {n_eff:.1f} (ICC {icc:.2f}); 95% Wilson interval on n_eff "
            f"(on the clusters alone: {clo:.1%}-{chi:.1%})", (lo, hi), (t.measure,), note)
    for p_var in sorted({v for inj in an.injections.values() for c in inj.values() for v in c}):
        vals = [c[p_var] for inj in an.injections.values() for c in inj.values() if p_var in c]
        ppm = next((r.ppm_of[p_var] for r in runs if p_var in r.ppm_of), 0)
        derived[f"injected_{_pct(ppm)}_measured"] = Derived(
            float(np.median(vals)), "ratio", f"median over (run, case) of the measured injected slowdown at nominal "
            f"{ppm / 1e6:.0%}: exp(median log(B@{p_var}/A)) less B's own offset, all rounds",
            (float(np.min(vals)), float(np.max(vals))))
    if an.calibration:
        ps = list(an.calibration.values())
        d, pk = ks_uniform(ps)
        for lv in CALIBRATION_LEVELS:
            k = sum(p < lv for p in ps)
            derived[f"process_test_below_{round(lv * 100)}pct"] = Derived(
                k / len(ps), "fraction", f"in-run A/B under A/A: share of the {len(ps)} (run, case) process tests "
                f"(all rounds) with p < {lv:g}; {lv:g} if calibrated", wilson(k, len(ps)),
                note=f"KS against uniform D={d:.3f} p={pk:.2f}")
    for k, (hit, n) in an.detection_by_measured.items():
        lo, hi = (float(x) for x in k.split("-"))
        derived[f"detection_ab_measured_{round(lo * 1000)}_{round(min(hi, 9.99) * 1000)}permille"] = Derived(
            hit / n, "fraction", f"in-run detection of trials whose case's measured injection lies in "
            f"[{lo:.1%}, {hi:.1%}): {hit} of {n}", wilson(hit, n))
    inj_series = []
    for run_label, cases in an.injections.items():
        for case, vs in cases.items():
            inj_series.append(Series.from_samples(
                f"injection/{run_label}/{case}", list(vs.values()), timer="derived", unit="ratio",
                params={"run": run_label, "case": case, "variants": list(vs)},
                metrics={"measured": vs, "gate_direction": "none"}))
    sources = [r.source for r in runs]
    notes = (f"Method: {METHOD}. Runs: " + "; ".join(f"{r.label} ({_rel(r.source)})" for r in runs) + ".",
             "In-run A/B: A and B are two worker processes of the same tree on one GPU, timed in alternating rounds "
             "(microbench/gate_ab.py); an injected build spins MB_INJECT_PPM of each launch in its last block "
             "(mb/inject.cuh), its measured size listed per case.",
             "Stored: the stored rule on the same figures taken as unpaired samples; its cross-run noise for a case "
             "is the pooled A/A spread of the other cases (leave-one-out).",
             "An A/A trial is two-sided (either orientation called a regression): a CI run, one orientation, meets "
             "about half the rate.",
             "Confidence: trials of one cluster share its conditions; 95% Wilson intervals on n_eff = n / (1 + (m-1) "
             "ICC), ICC from the outcomes (one-way ANOVA) or, when every outcome agrees, from the trials' estimated "
             "slowdowns; 1 (n_eff = clusters) when neither varies. The interval on the clusters alone is beside it.",
             *(["Only one run: the across-machine rates need two."] if len(runs) < 2 else []))
    q = Result("gate.quality", env, tuple(series + inj_series), derived, quick=False, notes=notes)
    aa = []
    for case, s in sorted(an.spreads.items()):
        meds = [float(np.median(r.figures[case][x])) for r in runs if case in r.figures for x in ("A", "B")
                if x in r.figures[case]]
        aa.append(Series.from_samples(case, meds, timer="derived", unit="s",
                                      params={"key": case, "class": key_class(case), "runs": sources},
                                      metrics={"spread": s, "gate_direction": "none"}))
    pooled = float(np.percentile(list(an.spreads.values()), 90)) if an.spreads else float("nan")
    aa_res = Result("gate.aa_spread", env, tuple(aa),
                    {"pooled_p90": Derived(pooled, "ratio", "90th percentile of the per-series A/A cross-run spreads",
                                           inputs=tuple(an.spreads))},
                    quick=False, notes=(f"A/A cross-run spreads from {len(runs)} quality runs of one build on "
                                        f"{len({machine_of(r) for r in runs})} machines: "
                                        f"{', '.join(r.label for r in runs)}; per series the largest "
                                        "|median_i / median_j - 1| over the pairs of runs on different machines",))
    return q, aa_res


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def aa_offsets(runs: Sequence[RunData]) -> dict[str, list[float]]:
    """{case: [the A/A offset of each run that has both sides]}: exp(median log(B / A)) over all of
    a run's rounds. Two processes of one tree differ by a steady offset per process (where their
    flags and buffers landed, their launch path), which paired rounds cannot average away: it is
    what the in-run A/A false alarms are made of."""
    out: dict[str, list[float]] = {}
    for run in runs:
        for case, f in sorted(run.figures.items()):
            if "A" in f and "B" in f:
                n = min(len(f["A"]), len(f["B"]))
                if n:
                    lr = np.log(np.asarray(f["B"][:n], dtype=np.float64) / np.asarray(f["A"][:n], dtype=np.float64))
                    out.setdefault(case, []).append(float(np.expm1(np.median(lr))))
    return out


def run_analysis(paths: Sequence[Path] | None = None, save: bool = False, save_root: Path | None = None,
                 block: int = BLOCK) -> tuple[Result, Result, str]:
    runs = find_runs(paths)
    if len(runs) < 2:
        raise ResultsFileError(f"{len(runs)} gate.quality_run result(s) found in {paths or 'reports/results/gate'}: "
                               "the across-machine rates need two (run `megabench gate --quality-run` on two fresh "
                               "machines)")
    gpus = {r.env.gpu for r in runs}
    if len(gpus) > 1:
        raise ResultsFileError(f"quality runs on different GPUs {sorted(map(str, gpus))}: analyse one GPU at a time")
    machines = [machine_of(r) for r in runs]
    an = analyse(runs, block)
    q, aa = to_results(an)
    lines = [f"gate quality from {len(runs)} runs on {runs[0].env.gpu}: " + ", ".join(r.label for r in runs), ""]
    apart, same = run_pairs(runs)
    if not apart:
        lines.append(f"WARNING: runs share a GPU ({machines}): not fresh machines")
    elif same:
        lines.append(f"{len(runs)} runs on {len(set(machines))} machines: the stored rows across machines come from the "
                     f"{len(apart)} pairs of runs on different machines; the {len(same)} pairs on one machine are "
                     f"tallied apart (one machine)")
    lines += summary_lines(an)
    lines += ["", "A/A offsets, the same tree in two worker processes (exp(median log(B/A)) over every round; "
              "the in-run rule's floor is {:.0%}):".format(ABConfig().floor)]
    for c, per in sorted(aa_offsets(runs).items()):
        lines.append(f"  {c}: " + ", ".join(f"{x:+.2%}" for x in per))
    lines += ["", "Measured injections (median over runs):"]
    cases = sorted({c for inj in an.injections.values() for c in inj})
    for c in cases:
        vs: dict[str, list[float]] = {}
        for inj in an.injections.values():
            for v, x in inj.get(c, {}).items():
                vs.setdefault(v, []).append(x)
        lines.append(f"  {c}: " + ", ".join(f"{v} {np.median(x):+.2%}" for v, x in sorted(vs.items())))
    offs = aa_offsets(runs)
    if offs:
        worst = sorted(offs.items(), key=lambda kv: -max(abs(x) for x in kv[1]))[:5]
        q = dataclasses.replace(q, notes=tuple(q.notes) + (
            "A/A offsets between two worker processes of one tree, largest first (per run): " + "; ".join(
                f"{c.split('::')[-1]} " + "/".join(f"{x:+.1%}" for x in v) for c, v in worst)
            + ". A steady per-process offset is what paired rounds cannot average away.",))
    if not apart:
        q = dataclasses.replace(q, notes=tuple(q.notes) + (
            f"The runs share a GPU ({machines}): the stored mode's cross-run rows are of one machine, and "
            "gate.aa_spread was not saved from them (it is the spread across fresh machines).",))
    elif same:
        q = dataclasses.replace(q, notes=tuple(q.notes) + (
            f"{len(runs)} runs on {len(set(machines))} machines: the stored mode's rows across machines (and "
            f"gate.aa_spread) come from the {len(apart)} pairs of runs on different machines; the {len(same)} pairs "
            "on one machine are the rows marked one machine.",))
    if save:
        p1 = q.save(save_root)
        lines += ["", f"saved {p1}"]
        if apart:
            lines.append(f"saved {aa.save(save_root)}")
        else:
            lines.append("gate.aa_spread not saved: the runs share a GPU, so their spread is not the one across "
                         "machines the stored gate needs (run the quality run on fresh machines)")
    return q, aa, "\n".join(lines)


def newest_build(runs: Sequence[RunData]) -> list[RunData]:
    """The runs of the newest build (commit, dirty or not) that has two or more: one build's runs
    measure one gate and one set of cases. Runs of earlier builds timed other cases under the same
    names (a case's kernel or runner can change under one name: runners.KEEP_NOTE)."""
    groups: dict[tuple, list[RunData]] = {}
    for r in sorted(runs, key=lambda r: r.env.date, reverse=True):
        groups.setdefault((r.env.git_sha, r.env.git_dirty), []).append(r)
    for g in groups.values():  # in order of each build's newest run
        if len(g) >= 2:
            return sorted(g, key=lambda r: r.env.date)
    return []


def pipeline_step(root: Path) -> str:
    """`megabench run`'s gate-quality item: the analysis of the newest build's quality runs (under
    the run's results root and the committed reports/results/gate), saved into the root when that
    build has two; the measurement itself is its own GPU command (about 3 minutes, twice)."""
    paths = [p for p in dict.fromkeys([Path(root), REPO_ROOT / "reports" / "results" / "gate"]) if p.is_dir()]
    every = find_runs(paths)
    runs = newest_build(every)
    if len(runs) < 2:
        return (f"gate quality: {len(every)} quality run(s) recorded, no build with two; it is measured by "
                "`megabench gate --quality-run --out DIR` on two fresh machines (about 3 minutes each), then "
                "`megabench gate --quality --save`")
    _, _, text = run_analysis([Path(r.source) for r in runs], save=True, save_root=root)
    return (f"gate quality from the newest build with two or more runs ({runs[0].env.git_sha}, {len(runs)} of "
            f"{len(every)} recorded runs)\n" + text)


# ----------------------------------------------------------------------------- the report
WHAT = {"false_alarm_rate_ab": "false alarms (A/A)", "false_alarm_rate_stored": "false alarms (A/A across machines)",
        "false_alarm_rate_stored_same_machine": "false alarms (A/A, one machine)",
        "unknown_rate_ab": "unknown (A/A): a slowdown the workers could not confirm"}


def one_machine(r: Result) -> bool:
    """Whether a gate.quality result comes from runs that share a GPU (its stored cross-run rows
    are then of one machine)."""
    return any(s.params.get("fresh_machines") is False for s in r.series)


def _what(key: str, one: bool = False) -> str:
    m = re.fullmatch(r"(.*?)(?:_(\d+)w)?", key)
    base, workers = m.group(1), m.group(2)
    tail = "" if workers is None else f", {workers} worker{'s' if workers != '1' else ''} a side (earlier method)"
    if (one and base == "false_alarm_rate_stored") or base == f"false_alarm_rate_stored{ONE_MACHINE}":
        return "false alarms (A/A, two runs on one machine)" + tail
    if base.startswith("detection_rate_stored_") and base.endswith(ONE_MACHINE):
        pct = base[:-len(ONE_MACHINE)].rsplit("_", 1)[1].replace("pct", "%")
        return f"detection of an injected {pct}, baseline from the other run on the same machine" + tail
    if base in WHAT:
        return WHAT[base] + tail
    for p in ("ab", "stored"):
        if base.startswith(f"detection_rate_{p}_"):
            return (f"detection of an injected {base.rsplit('_', 1)[1].replace('pct', '%')}"
                    + (", baseline from the other run on the same machine" if one and p == "stored" else "") + tail)
    if base.startswith("unknown_rate_ab_"):
        return f"unknown, not caught, at an injected {base.rsplit('_', 1)[1].replace('pct', '%')}" + tail
    return key


def latest_quality(root: Path | None = None) -> tuple[Path, Result] | None:
    """The newest gate.quality result of this method (a measurement from quality runs)."""
    roots = list(dict.fromkeys([Path(root)] if root else [results_root(), REPO_ROOT / "reports" / "results"]))
    best = None
    for r in roots:
        if not r.is_dir():
            continue
        for f in find("gate.quality", r):
            res = load(f)
            if res.benchmark == "gate.quality" and any(s.params.get("method") == METHOD for s in res.series):
                if best is None or res.env.date > best[1].env.date:
                    best = (f, res)
    return best


def trust_rows(root: Path | None = None) -> list[dict]:
    """Rows for the report's trust box: one per mode, its false alarms and detections with their
    intervals; empty when the gate's quality has not been measured by this method yet."""
    got = latest_quality(root)
    if got is None:
        return []
    _, r = got
    rows = []
    for mode, prefix in (("in-run A/B (`megabench gate --ab`)", "ab"), ("stored results", "stored")):
        fa = r.derived.get("false_alarm_rate_ab" if prefix == "ab" else "false_alarm_rate_stored")
        row = {"mode": mode}
        row["false alarms"] = "" if fa is None else f"{fa.value:.1%} ({fa.spread[0]:.1%}-{fa.spread[1]:.1%})"
        for pct in (2, 5, 10):
            d = r.derived.get(f"detection_rate_{prefix}_{pct}pct")
            row[f"detects {pct}%"] = "" if d is None else f"{d.value:.0%} ({d.spread[0]:.0%}-{d.spread[1]:.0%})"
        row["measured"] = f"{r.env.date[:10]}, {r.env.gpu}"
        rows.append(row)
    return rows


def trust_line(root: Path | None = None) -> str:
    """One line for the report's trust box (under 300 characters): the measured rates of both
    modes, or that they are not measured yet."""
    got = latest_quality(root)
    if got is None:
        return ("Gate: its false-alarm and detection rates are not measured yet (`megabench gate --quality-run` on two "
                "fresh machines, then `megabench gate --quality --save`).")
    _, r = got

    def rate(key, digits=1):
        d = r.derived.get(key)
        return "n/a" if d is None else f"{d.value:.{digits}%} ({d.spread[0]:.{digits}%}-{d.spread[1]:.{digits}%})"

    return (f"Gate: in-run A/B false alarms {rate('false_alarm_rate_ab')}, detects 5% {rate('detection_rate_ab_5pct', 0)}"
            f", 10% {rate('detection_rate_ab_10pct', 0)}; stored "
            f"{'(two runs on one machine)' if one_machine(r) else 'across machines'}: false alarms "
            f"{rate('false_alarm_rate_stored')}, detects 5% {rate('detection_rate_stored_5pct', 0)} "
            f"(`gate.quality` of {r.env.date[:10]}, 95% intervals).")


def _wrap(text: str, width: int = 160) -> list[str]:
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]


def report_lines(root: Path | None = None, heading: str = "## How much to trust the gate") -> list[str]:
    """The report's section on the gate's measured quality (markdown lines; prose wrapped at 160)."""
    out = [heading, ""]
    got = latest_quality(root)
    if got is None:
        return out + _wrap(
            "Not measured yet by the current method: run `megabench gate --quality-run --out DIR` on two fresh H200 "
            "machines (about 3 minutes each), commit both `gate.quality_run` results, then `megabench gate --quality "
            "--save`. Earlier `gate.quality` files (2026-11-29) replayed the gate on halves of recorded samples: a 5% "
            "floor guaranteed their 0% false alarms and SMs of one launch counted as trials, so they did not measure "
            "this gate.") + [""]
    path, r = got
    rows = []
    for k, d in r.derived.items():
        s = next((s for s in r.series if s.name == k), None)
        if s is None:
            continue
        by_cl = s.metrics.get("interval_by_clusters") or [None, None]
        rows.append({"mode": s.params.get("mode"), "measure": _what(k, one_machine(r)), "rate": f"{d.value:.1%}",
                     "95% interval (n_eff)": f"{d.spread[0]:.1%}-{d.spread[1]:.1%}" if d.spread else "",
                     "95% (clusters only)": f"{by_cl[0]:.1%}-{by_cl[1]:.1%}" if by_cl[0] is not None else "",
                     "trials": f"{s.metrics.get('flagged')} of {s.metrics.get('trials')}",
                     "clusters / n_eff": f"{s.metrics.get('clusters')} / {s.metrics.get('n_eff', 0):.0f}",
                     "target": d.note.replace("target ", "") if d.note else ""})
    p0 = next((s.params for s in r.series if "method" in s.params), {})
    n_runs, n_machines = p0.get("runs", 2), p0.get("machines", 1 if one_machine(r) else 2)
    where = ("on one machine (not fresh machines)" if one_machine(r) else
             "on fresh machines" if n_machines == n_runs else f"on {n_machines} machines")
    out += _wrap(f"Measured {r.env.date[:10]} on {r.env.gpu} (`{_rel(path)}`): the gate's own verdicts on {n_runs} quality "
                 f"runs of one build {where}, with slowdowns injected into the kernels (`megabench gate "
                 "--quality-run`; method in `microbench/gate_quality.py`).")
    out += ["", tabulate(rows, headers="keys", tablefmt="github"), ""]
    inj = [(k, d) for k, d in r.derived.items() if k.startswith("injected_")]
    if inj:
        out += _wrap("Injected slowdowns as measured (median over runs and cases, min-max): " + "; ".join(
            f"nominal {k.split('_')[1].replace('pct', '%')}: {d.value:+.2%} ({d.spread[0]:+.2%}..{d.spread[1]:+.2%})"
            for k, d in inj) + ".") + [""]
    cal = [(k, d) for k, d in r.derived.items() if k.startswith("process_test_below_")]
    if cal:
        out += _wrap("The in-run rule's process test under A/A (one p-value per run and case, all rounds; uniform if "
                     "calibrated): " + "; ".join(f"{d.value:.1%} under {int(k.rsplit('_', 1)[1][:-3]) / 100:g}"
                                                 for k, d in cal) + f" ({cal[0][1].note}). A false alarm needs its p "
                     f"under {ABConfig().process_alpha:g} in one orientation, so a calibrated test caps the two-sided "
                     f"A/A rate at {2 * ABConfig().process_alpha:.0%}, below what the trials alone can resolve.") + [""]
    for n in r.notes:
        out += _wrap(f"Note: {n}") + [""]
    return out
