"""`megabench gate --ab REV`: the in-run A/B gate, the gate's main mode.

Two builds are timed interleaved in one run on one GPU and judged on paired round ratios, so
whatever drifts over the run (clocks, temperature, a neighbour on the host) falls on both alike:

1. The baseline is a git revision (`--ab REV`, checked out with `git worktree add --detach` in a
   temporary folder and removed afterwards) or a second tree (`--ab-tree PATH`); the candidate is
   the working tree (`--candidate-tree PATH` to choose another).
2. Each side is `--replicas` (default 3) long-lived worker processes (microbench/ab_worker.py),
   each of which imports its own tree, holds its own CUDA context, and prepares and checks its
   cases once: the tree's own
   pytest-benchmark cases (tests/bench/test_bench_<class>.py), chosen with `--classes`, `-k` and
   `--marker` because rounds cost GPU time (default: DEFAULT_SELECTION, every class but the torch
   baselines, no shard8 point: two processes cannot both hold shard8 on one H200). A case that
   fails its check or does not build on a side is named.
3. The controller then runs `--rounds` rounds. In each round every case is timed once by every
   worker, one at a time, the sides interleaved (A1,B1,A2,B2,...) and the order reversed from
   round to round. A
   timing request runs one warm-up round of the case and then K rounds, K the same on both sides
   (enough for ~2 ms of device time, 3..16) and reports their median: one figure per side per
   round. The rounds, not the samples inside one, are the independent repeats.

Verdict per case, unit seconds (rates are inverted). A side's figure in round i is the geometric
mean over its r workers, a_i = exp(mean_p log a_pi), and likewise b_i:

  d_i       = log(b_i / a_i)                         the round's log ratio
  slowdown  = exp(median d) - 1                       reported with a 95% bootstrap interval over rounds
  p_rounds  = one-sided Wilcoxon signed-rank p of d > 0 (exact without ties; microbench.stats)
  p_process = one-sided two-sample t-test of the workers' own medians m_p = median_i log x_pi,
              B's r against A's r, pooled within-side variance, df = 2 (r - 1)
  REGRESSION   slowdown > floor (default 3%), p_rounds < alpha (default 0.01) and
               p_process < process_alpha (default 0.005)
  IMPROVEMENT  the mirror image; SAME otherwise
  UNKNOWN      fewer than --min-rounds (default 8) rounds, with the count: below 8 rounds the
               test cannot reach alpha = 0.01 at all (its smallest p is 2^-R); or slower than
               the floor over the rounds (p_rounds < alpha) but not by the process test: two
               workers of one build differ as much, so the figure can neither confirm nor rule
               out a regression of that size; the reason says how many workers a side
               (--replicas) would resolve it. A faster case the process test cannot confirm
               stays SAME: the gate is for regressions.

Why the process test: two processes of the same build differ by a steady offset of their own
(their memory placement and code layout), steady for the whole run and several times larger than
the spread of one process's rounds (the recorded gate.quality_run results show it, aa_offsets).
Rounds cannot see such an offset: they are
all of one pair of processes, and the signed-rank test calls it significant at once. The
independent units of that noise are the processes, so the verdict also asks whether B's workers
differ from A's by more than the workers within each side differ from each other. With one
worker a side (`--replicas 1`) only the rounds are tested, and the report says so.
Where such an offset has a known cause the case removes it at the source: the ping-pong and
publish cases average each sample over 8 flag placements (one allocation's flags sit steadily off
another's), the fence probe is pinned to one SM (a lone block's SM moves its time), and the sync
cases keep their runners alive (a freed runner's loader stops early: runners.KEEP_NOTE); see
microbench/sync/bench.py. Offsets without a known cause remain (the empty launch's workers), so
the process test stays, and such a case reads unknown rather than same or regression.

Why a floor: even so, two builds of the same code differ by their code layout (layout placebos of
the megakernel moved its step by -0.5..+1.1%, megakernel/ab.py), so a significant 1% is real but
not what a CI gate should fail on. Its measured false-alarm and detection rates are
`gate.quality` (microbench/gate_quality.py).

Bad input exits non-zero and names it: a revision that does not exist or does not build (its
worker cannot import the tree, or a case fails to compile or check: exit 2), sides on different
GPUs or built for different architectures (exit 3), a case present on one side only or skipped
on one side (listed; unknown, exit 4), too few rounds (unknown with the count, exit 4).

On a CPU everything above runs with the worker's synthetic backend (`--backend synthetic:SPEC`,
a JSON of fake cases per side; tests/test_gate_ab.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tabulate import tabulate

from . import atomic
from .compiler import INJECT_ENV
from .errors import MegabenchError
from .gate import EXIT_GPU, EXIT_INPUT, EXIT_OK, EXIT_REGRESSION, EXIT_UNKNOWN, Verdict, direction_of, fmt_value
from .results import Derived, Env, Result, Series, git_dirty, git_sha, read_json
from .stats import student_t_quantile, student_t_sf, wilcoxon_signed_rank

WORKER = Path(__file__).resolve().with_name("ab_worker.py")
# Without --classes / -k / --marker: every class's cases but the torch baselines and shard8 points.
# Two processes cannot both hold shard8 (its ~60 GB of weights and the kernel's copies of them) on
# one 141 GB H200, and the baselines' module teardown frees their weights and resets torch.compile
# while the worker still holds their cases. Name them to include them (`--classes baselines`,
# `-k shard8`) on a GPU with the memory; the megakernel's own in-process A/B (megakernel/ab.py)
# compares kernel variants at shard8 in one process.
DEFAULT_SELECTION = {"classes": ["basics", "clocks", "icache", "sync", "weights", "megakernel"], "k": "not shard8"}
REPO_ROOT = Path(__file__).resolve().parent.parent


class ABInputError(MegabenchError):
    """Bad input to the A/B gate: a revision that does not exist or does not build, a worker
    that fails, a case that fails its check."""


class ABGpuMismatch(MegabenchError):
    """The two sides run on different GPUs or are built for different architectures."""


@dataclass(frozen=True)
class ABConfig:
    floor: float = 0.03
    alpha: float = 0.01
    min_rounds: int = 8
    replicas: int = 3  # worker processes a side: the process-level test's units
    # the process-level test's one-sided level: half of alpha, so that an A/A comparison read both
    # ways (what gate.quality counts) stays within alpha
    process_alpha: float = 0.005
    ci: float = 0.95
    round_target_s: float = 0.002  # device time one timing request should hold
    min_samples: int = 3
    max_samples: int = 16
    prepare_timeout_s: float = 1800.0
    time_timeout_s: float = 300.0

    def describe(self) -> str:
        proc = (f" and a one-sided t-test of the {self.replicas} workers a side (their own medians, df "
                f"{2 * (self.replicas - 1)}) p < {self.process_alpha:g}" if self.replicas > 1 else
                " (one worker a side: no process-level test)")
        return (f"paired rounds: regression = exp(median log(B/A)) - 1 > floor {self.floor:.0%} and one-sided "
                f"Wilcoxon signed-rank p < {self.alpha:g} over the rounds{proc}; unknown with fewer than "
                f"{self.min_rounds} rounds" + (", or when the rounds call a regression the process-level test does not"
                                               if self.replicas > 1 else ""))


# ----------------------------------------------------------------------------- the verdict

def print_report(rep, markdown: str | None, json_path: str | None) -> str:
    """Print a gate report's markdown, and write it (markdown) and its JSON where asked
    (atomically). Returns the markdown."""
    md = rep.to_markdown()
    print(md)
    if markdown:
        atomic.write_text(markdown, md)
    if json_path:
        atomic.write_json(json_path, rep.to_json())
    return md


def _bootstrap_median(d: np.ndarray, ci: float, seed: int = 0, n_boot: int = 2000) -> tuple[float, float]:
    if d.size < 2:
        return float(d[0]), float(d[0])
    rng = np.random.default_rng(seed)
    meds = np.median(d[rng.integers(0, d.size, size=(n_boot, d.size))], axis=1)
    lo, hi = np.percentile(meds, [(1 - ci) / 2 * 100, (1 + ci) / 2 * 100])
    return float(lo), float(hi)


@dataclass(frozen=True)
class PairedVerdict(Verdict):
    ci: tuple[float, float] | None = None  # bootstrap interval of the slowdown
    replicas: int = 1  # worker processes a side
    process_sd: float | None = None  # sd of one worker's log offset, pooled within the sides
    p_process: float | None = None  # the process-level test's one-sided p (slower)
    resolution: float | None = None  # the smallest slowdown the process-level test could call at alpha


def paired_verdict(key: str, a: Sequence[float], b: Sequence[float], unit: str = "s",
                   cfg: ABConfig = ABConfig()) -> PairedVerdict:
    """The module docstring's rule on paired figures a[i], b[i] (same round)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"{key}: {a.size} baseline figures but {b.size} candidate figures; rounds pair them")
    n = int(a.size)
    common = dict(key=key, base_median=float(np.median(a)) if n else None,
                  cand_median=float(np.median(b)) if n else None, unit=unit, n_base=n, n_cand=n)
    direction = direction_of(unit)
    if direction == "none":
        return PairedVerdict(**common, verdict="not gated", slowdown=None, noise=None, threshold=None,
                             p_slower=None, reason=f"unit {unit!r} has no direction")
    if n and (np.any(a <= 0) or np.any(b <= 0) or not np.all(np.isfinite(a)) or not np.all(np.isfinite(b))):
        return PairedVerdict(**common, verdict="unknown", slowdown=None, noise=None, threshold=None, p_slower=None,
                             reason="non-positive or non-finite figures")
    if n < cfg.min_rounds:
        sd = float(np.expm1(np.median(np.log(b / a) if direction == "lower" else np.log(a / b)))) if n else None
        return PairedVerdict(**common, verdict="unknown", slowdown=sd, noise=None, threshold=None, p_slower=None,
                             reason=f"{n} rounds (need {cfg.min_rounds}: the test cannot reach p < {cfg.alpha:g} "
                                    f"with fewer)")
    d = np.log(b / a) if direction == "lower" else np.log(a / b)
    est = float(np.median(d))
    slowdown = float(np.expm1(est))
    _, p_slow = wilcoxon_signed_rank(d, "greater")
    _, p_fast = wilcoxon_signed_rank(d, "less")
    lo, hi = _bootstrap_median(d, cfg.ci)
    ci = (float(np.expm1(lo)), float(np.expm1(hi)))
    r = np.exp(d)
    q1, q3 = np.percentile(r, [25, 75])
    noise = float((q3 - q1) / np.median(r))
    tol = 1 + 1e-9
    where = f"{cfg.ci:.0%} interval {ci[0]:+.2%}..{ci[1]:+.2%}"
    if slowdown > cfg.floor * tol and p_slow < cfg.alpha:
        v, why = "regression", where
    elif float(np.expm1(-est)) > cfg.floor * tol and p_fast < cfg.alpha:
        v, why = "improvement", f"{-float(np.expm1(-est)) / (1 + float(np.expm1(-est))):.1%} less cost; " + where
    else:
        v = "same"
        if slowdown > cfg.floor:
            why = f"slower by more than the floor, but the signed-rank test disagrees (p={p_slow:.2g}); " + where
        elif slowdown > 0 and p_slow < cfg.alpha:
            why = f"significantly slower (p={p_slow:.2g}) but within the floor {cfg.floor:.0%}; " + where
        else:
            why = where
    return PairedVerdict(**common, verdict=v, slowdown=slowdown, noise=noise, threshold=cfg.floor, p_slower=p_slow,
                         reason=why, ci=ci)


def replicated_verdict(key: str, a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], unit: str = "s",
                       cfg: ABConfig = ABConfig()) -> PairedVerdict:
    """The module docstring's rule on r workers a side: a[p][i], b[p][i] (worker p, round i)."""
    a = [np.asarray(x, dtype=np.float64) for x in a]
    b = [np.asarray(x, dtype=np.float64) for x in b]
    if not a or len(a) != len(b):
        raise ValueError(f"{key}: {len(a)} baseline workers but {len(b)} candidate workers; want the same r >= 1")
    if len({x.shape for x in a + b}) != 1:
        raise ValueError(f"{key}: the workers timed different numbers of rounds: {[x.size for x in a + b]}")
    r = len(a)
    if r == 1:
        return paired_verdict(key, a[0], b[0], unit, cfg)
    bad = any(np.any(x <= 0) or not np.all(np.isfinite(x)) for x in a + b)
    if bad:
        return dataclasses.replace(paired_verdict(key, a[0], b[0], unit, cfg), replicas=r)
    la, lb = np.log(np.stack(a)), np.log(np.stack(b))
    base = paired_verdict(key, np.exp(la.mean(axis=0)), np.exp(lb.mean(axis=0)), unit, cfg)
    if base.verdict in ("unknown", "not gated"):
        return dataclasses.replace(base, replicas=r)
    sign = 1.0 if direction_of(unit) == "lower" else -1.0
    ma, mb = np.median(la, axis=1), np.median(lb, axis=1)
    df = 2 * (r - 1)
    s = math.sqrt((float(((ma - ma.mean()) ** 2).sum()) + float(((mb - mb.mean()) ** 2).sum())) / df)
    se = s * math.sqrt(2.0 / r)
    diff = sign * float(mb.mean() - ma.mean())
    if se > 0:
        p_slow, p_fast = student_t_sf(diff / se, df), student_t_sf(-diff / se, df)
    else:  # the workers of each side agree exactly (synthetic figures): the rounds decide
        p_slow, p_fast = (0.0, 1.0) if diff > 0 else (1.0, 0.0) if diff < 0 else (1.0, 1.0)
    resolution = process_resolution(s, r, cfg)
    spread = f"workers a side differ by {s:.2%} (sd, {r} a side; this test calls no less than {resolution:+.2%})"
    v, why = base.verdict, base.reason
    if v == "regression" and not p_slow < cfg.process_alpha:
        # the rounds saw a slowdown over the floor that the workers' spread can neither confirm nor
        # rule out: not "same" (a real regression of this size would read the same), but unknown,
        # with how many workers a side would resolve it
        need = replicas_to_resolve(s, base.slowdown, cfg)
        more = (f"--replicas {need} would resolve {base.slowdown:+.1%}" if need else
                f"no --replicas up to {MAX_REPLICAS_HINT} would resolve {base.slowdown:+.1%}")
        v, why = "unknown", (f"slower over the rounds, but within what separates two workers of one build "
                             f"(process test p={p_slow:.2g}): {more}; {base.reason}")
    elif v == "improvement" and not p_fast < cfg.process_alpha:
        v, why = "same", (f"faster over the rounds, but within what separates two workers of one build "
                          f"(process test p={p_fast:.2g}); {base.reason}")
    return dataclasses.replace(base, verdict=v, reason=f"{why}; {spread}", replicas=r, process_sd=s,
                               p_process=p_slow, threshold=max(cfg.floor, resolution), resolution=resolution)


MAX_REPLICAS_HINT = 32


def process_resolution(sd: float, r: int, cfg: ABConfig = ABConfig()) -> float:
    """The smallest slowdown the process test calls at process_alpha with r workers a side whose
    log offsets are spread by `sd` (pooled, df 2 (r - 1))."""
    return float(np.expm1(student_t_quantile(1.0 - cfg.process_alpha, 2 * (r - 1)) * sd * math.sqrt(2.0 / r)))


def replicas_to_resolve(sd: float, slowdown: float, cfg: ABConfig = ABConfig()) -> int | None:
    """The fewest workers a side whose process test, with the workers' log offsets spread by `sd`,
    calls `slowdown` (process_resolution below it); None when more than MAX_REPLICAS_HINT would be
    needed."""
    if slowdown <= 0:
        return None
    return next((r for r in range(2, MAX_REPLICAS_HINT + 1) if process_resolution(sd, r, cfg) < slowdown), None)


def replica_names(name: str, r: int) -> list[str]:
    """The workers of one side: `name`, `name#2`, ... `name#r`."""
    return [name] + [f"{name}#{p}" for p in range(2, r + 1)]


def replicate(spec: SideSpec, r: int) -> list[SideSpec]:
    if r < 1:
        raise ABInputError(f"--replicas must be >= 1, got {r}")
    return [dataclasses.replace(spec, name=n) for n in replica_names(spec.name, r)]


# ----------------------------------------------------------------------------- trees
def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


@contextmanager
def checkout(rev: str, repo: Path = REPO_ROOT) -> Iterator[tuple[Path, str]]:
    """A detached `git worktree` of `rev` in a temporary folder, removed afterwards. Raises
    ABInputError when the revision does not exist (or the repository has no git)."""
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    sha = r.stdout.strip()
    if r.returncode != 0 or not sha:
        raise ABInputError(f"baseline revision {rev!r} does not exist in {repo} (git rev-parse: "
                           f"{(r.stderr or r.stdout).strip() or 'no such commit'})")
    tmp = Path(tempfile.mkdtemp(prefix="megabench-ab-"))
    path = tmp / f"baseline-{sha[:12]}"
    r = _git(repo, "worktree", "add", "--detach", "--force", str(path), sha)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ABInputError(f"could not check out {rev!r} ({sha[:12]}) into {path}: {r.stderr.strip()}")
    try:
        yield path, sha
    finally:
        _git(repo, "worktree", "remove", "--force", str(path))
        shutil.rmtree(tmp, ignore_errors=True)
        _git(repo, "worktree", "prune")


def tree_label(root: Path) -> str:
    """`<sha>` of a tree's HEAD, `+dirty` when its tracked files differ; 'no git' without one.
    This checkout run as a copy (MEGABENCH_GIT_SHA set, as on the GPU machine, whose .git may be
    an earlier commit's): the commit its results are credited to, dirty by MEGABENCH_SOURCE_TREE
    (microbench/results.py), as the result files say."""
    if os.environ.get("MEGABENCH_GIT_SHA") and root.resolve() == REPO_ROOT.resolve():
        return git_sha(full=True)[:12] + ("+dirty" if git_dirty() else "")
    r = _git(root, "rev-parse", "--short=12", "HEAD")
    if r.returncode != 0:
        return f"{root} (no git)"
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


# ----------------------------------------------------------------------------- workers
@dataclass
class SideSpec:
    name: str  # "baseline" / "candidate" (or "A" / "B" in the quality run)
    root: Path
    label: str = ""
    backend: str = "pytest"  # "pytest" | "synthetic"
    spec: dict | None = None  # synthetic backend: the cases
    variants: list[dict] = field(default_factory=list)  # [{"name", "env"}]: the same cases prepared again


class Worker:
    """One side's worker process and its JSON-lines channel (module docstring of ab_worker)."""

    def __init__(self, side: SideSpec, workdir: Path, python: str = sys.executable):
        self.side = side
        self.workdir = workdir
        self.log_path = workdir / f"worker-{side.name}.log"
        args = [python, str(WORKER), "--root", str(side.root), "--backend", side.backend, "--name", side.name]
        if side.backend == "synthetic":
            sp = workdir / f"spec-{side.name}.json"
            sp.write_text(json.dumps(side.spec or {}))
            args += ["--spec", str(sp)]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(side.root)  # the side's packages only: never the controller's tree
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["MEGABENCH_RESULTS"] = str(workdir / f"results-{side.name}")  # results a case writes stay out of trees
        env["PYTHONUNBUFFERED"] = "1"
        for k in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID",
                  "PYTEST_CURRENT_TEST"):
            env.pop(k, None)  # the worker's pytest runs the cases itself, in its own process
        if side.root.resolve() != REPO_ROOT:
            env.pop("MEGABENCH_GIT_SHA", None)  # those describe the controller's checkout
            env.pop("MEGABENCH_SOURCE_TREE", None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=str(side.root), env=env)
        self._buf = b""
        self.hello: dict | None = None

    def log_tail(self, n: int = 3000) -> str:
        try:
            if not self._log.closed:
                self._log.flush()
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _readline(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ABInputError(f"{self.side.name} worker ({self.side.root}) gave no answer in {timeout:.0f} s; "
                                   f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 5.0))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                rc = self.proc.wait(timeout=10)
                raise ABInputError(f"{self.side.name} worker ({self.side.root}) exited (rc={rc}); its log ends:\n"
                                   f"{self.log_tail()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def receive(self, timeout: float) -> dict:
        line = self._readline(timeout)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise ABInputError(f"{self.side.name} worker sent a line that is not JSON: {line[:200]!r}") from None

    def request(self, obj: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            rc = self.proc.poll()
            raise ABInputError(f"{self.side.name} worker is gone (rc={rc}); its log ends:\n{self.log_tail()}") from None
        rep = self.receive(timeout)
        if not rep.get("ok"):
            raise ABInputError(f"{self.side.name} worker ({self.side.root}): {obj.get('cmd')} "
                               f"{obj.get('case', '')} failed: {rep.get('error')}\n{rep.get('traceback', '')}")
        return rep

    def start(self, timeout: float = 600.0) -> dict:
        rep = self.receive(timeout)
        if not rep.get("ok"):
            raise ABInputError(f"the {self.side.name} tree {self.side.label or self.side.root} does not build: "
                               f"{rep.get('error')}\n{rep.get('traceback', '')}")
        self.hello = rep["hello"]
        return self.hello

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.request({"cmd": "quit"}, 30.0)
                except MegabenchError:
                    pass
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=30)
        finally:
            self._log.close()


def check_same_gpu(hellos: Mapping[str, dict]) -> list[str]:
    """Refuse (ABGpuMismatch) sides on different GPUs or built for different architectures.
    Returns notes (e.g. that there is no GPU at all: synthetic or host-timed cases)."""
    def ident(h):
        d = h.get("device")
        return None if d is None else (d.get("name"), tuple(d.get("cc") or ()), d.get("sm_count"),
                                       d.get("sm_clock_max_mhz"))

    ids = {n: ident(h) for n, h in hellos.items()}
    if len(set(ids.values())) > 1:
        raise ABGpuMismatch("the sides run on different GPUs: " + "; ".join(
            f"{n}: {'no GPU' if i is None else f'{i[0]} cc {i[1]} {i[2]} SMs {i[3]} MHz'}" for n, i in ids.items()))
    arches = {n: h.get("arch") for n, h in hellos.items()}
    if len(set(arches.values())) > 1:
        raise ABGpuMismatch("the sides build for different GPU architectures: " +
                            ", ".join(f"{n}: {a}" for n, a in arches.items()))
    notes = []
    if all(i is None for i in ids.values()):
        notes.append("no GPU on either side: the figures are the cases' own timers (host or synthetic)")
    return notes


# ----------------------------------------------------------------------------- the rounds
@dataclass
class Entry:
    side: str  # worker name
    case: str  # case id on that worker
    group: str = ""  # what the verdict pools: a side (and variant) across its workers; default the worker
    replica: int = 1

    def __post_init__(self):
        self.group = self.group or self.side


@dataclass
class Comparison:
    """One row of a round: every worker's entry of one case (entries[0] sets K). Entries of one
    `group` (a side, or a side's variant) are that group's workers, pooled by the verdict."""

    key: str
    unit: str
    entries: list[Entry]
    k: int = 1
    values: list[list[float]] = field(default_factory=list)  # per entry, one figure per round

    def group_values(self, group: str) -> list[list[float]]:
        """The figures of one group's workers, in replica order."""
        got = sorted((e.replica, v) for e, v in zip(self.entries, self.values) if e.group == group)
        return [v for _, v in got]


def run_rounds(workers: Mapping[str, Worker], comps: Sequence[Comparison], rounds: int, cfg: ABConfig = ABConfig(),
               log: Callable[[str], None] = print) -> float:
    """Time every comparison `rounds` times (module docstring). Returns the wall seconds spent."""
    t0 = time.monotonic()
    for c in comps:  # calibration: one request of one figure per entry, discarded; K from the reference's
        c.values = [[] for _ in c.entries]
        first = None
        for e in c.entries:
            rep = workers[e.side].request({"cmd": "time", "case": e.case, "samples": 1, "round": -1, "slot": 0},
                                          cfg.time_timeout_s)
            first = rep["value"] if first is None else first
        c.k = int(min(cfg.max_samples, max(cfg.min_samples, math.ceil(cfg.round_target_s / max(first, 1e-9)))))
    for r in range(rounds):
        for c in comps:
            order = list(range(len(c.entries)))
            if r % 2:
                order.reverse()  # alternate: A first in even rounds, last in odd ones
            for slot, i in enumerate(order):
                e = c.entries[i]
                rep = workers[e.side].request({"cmd": "time", "case": e.case, "samples": c.k, "round": r,
                                               "slot": slot}, cfg.time_timeout_s)
                c.values[i].append(float(rep["value"]))
        if (r + 1) % 10 == 0 or r + 1 == rounds:
            log(f"  round {r + 1}/{rounds} ({time.monotonic() - t0:.0f} s)")
    return time.monotonic() - t0


# ----------------------------------------------------------------------------- one A/B
@dataclass
class ABReport:
    verdicts: list[PairedVerdict]
    cfg: ABConfig
    rounds: int
    sides: dict[str, dict]  # name -> {"label", "root", "hello"}
    only: dict[str, list[str]] = field(default_factory=dict)  # side -> cases only it has
    failed: dict[str, list[dict]] = field(default_factory=dict)  # side -> [{"id", "error"}]
    skipped: dict[str, list[dict]] = field(default_factory=dict)
    missing_classes: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, v: str) -> int:
        return sum(x.verdict == v for x in self.verdicts)

    @property
    def one_sided(self) -> list[str]:
        """Cases that cannot be compared because one side lacks them or skipped them."""
        return sorted({c for cs in self.only.values() for c in cs})

    def exit_code(self, allow_unknown: bool = False) -> int:
        if any(self.failed.values()):
            return EXIT_INPUT
        if self.count("regression"):
            return EXIT_REGRESSION
        judged = [v for v in self.verdicts if v.verdict != "not gated"]
        if (self.count("unknown") or self.one_sided or not judged) and not allow_unknown:
            return EXIT_UNKNOWN
        return EXIT_OK

    def summary_line(self) -> str:
        parts = [f"{self.count(v)} {v}" for v in ("regression", "improvement", "same", "unknown", "not gated")
                 if self.count(v)]
        if self.one_sided:
            parts.append(f"{len(self.one_sided)} on one side only")
        nf = sum(len(v) for v in self.failed.values())
        if nf:
            parts.append(f"{nf} FAILED to build/check")
        a, b = list(self.sides)[:2]
        return (f"in-run A/B, {self.rounds} rounds: {b} {self.sides[b].get('label', '')} vs {a} "
                f"{self.sides[a].get('label', '')}: " + (", ".join(parts) or "nothing compared"))

    def rows(self) -> list[dict]:
        out = []
        for v in self.verdicts:
            out.append({"case": v.key, "baseline": fmt_value(v.base_median, v.unit),
                        "candidate": fmt_value(v.cand_median, v.unit),
                        "change (median of round ratios)": "" if v.slowdown is None else f"{v.slowdown:+.2%}",
                        f"{self.cfg.ci:.0%} interval": "" if v.ci is None else f"{v.ci[0]:+.2%}..{v.ci[1]:+.2%}",
                        "p (slower)": "" if v.p_slower is None else f"{v.p_slower:.2g}",
                        "rounds": v.n_base,
                        "verdict": v.verdict.upper() if v.verdict in ("regression", "unknown") else v.verdict,
                        "why": v.reason})
        return out

    def to_markdown(self) -> str:
        lines = [f"**{self.summary_line()}**", "", f"Rule: {self.cfg.describe()}.", ""]
        for name, s in self.sides.items():
            lines.append(f"- {name}: {s.get('label', '')} ({s.get('root')})")
        lines += [f"- {n}" for n in self.notes]
        lines.append("")
        for side, fs in self.failed.items():
            for f in fs:
                lines.append(f"- **FAILED on {side}**: `{f['id']}`: {f['error'].splitlines()[0][:300]}")
        for side, cs in self.only.items():
            if cs:
                lines.append(f"- **only on {side}** (not compared, unknown): " + ", ".join(f"`{c}`" for c in cs))
        for side, cs in self.missing_classes.items():
            if cs:
                lines.append(f"- {side} has no pytest-benchmark file for class(es) {', '.join(cs)}")
        for side, ss in self.skipped.items():
            if ss:
                lines.append(f"- skipped on {side}: {len(ss)} case(s), e.g. `{ss[0]['id']}`: {ss[0]['reason'][:200]}")
        order = {"REGRESSION": 0, "UNKNOWN": 1, "improvement": 2, "same": 3, "not gated": 4}
        rows = sorted(self.rows(), key=lambda r: (order.get(r["verdict"], 9), r["case"]))
        if rows:
            lines += ["", tabulate(rows, headers="keys", tablefmt="github")]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"schema": "megabench.gate_ab", "version": 1, "config": dataclasses.asdict(self.cfg),
                "rule": self.cfg.describe(), "summary": self.summary_line(), "rounds": self.rounds,
                "sides": {n: {k: v for k, v in s.items()} for n, s in self.sides.items()},
                "verdicts": [dataclasses.asdict(v) for v in self.verdicts], "only": self.only, "failed": self.failed,
                "skipped": self.skipped, "notes": self.notes, "wall_s": self.wall_s,
                "figures": {c.key: {"k": c.k, "entries": [dataclasses.asdict(e) for e in c.entries], "values": c.values}
                            for c in self.comparisons}}

    def to_result(self, env=None):
        """A typed Result `gate.ab`: per case the round figures of each side (not gated across runs:
        they only mean something beside each other) and the change as a derived value."""
        env = env or Env.capture()
        series, derived = [], {}
        by_key = {v.key: v for v in self.verdicts}
        for c in self.comparisons:
            for e, xs in zip(c.entries, c.values):
                series.append(Series.from_samples(
                    f"{c.key}/{e.side}", xs, timer="cuda_event" if env.gpu else "host", unit=c.unit,
                    params={"case": e.case, "side": e.side, "samples_per_round": c.k, "order": "alternating rounds",
                            "label": self.sides.get(e.side, {}).get("label", "")},
                    metrics={"gate_direction": "none"}))
            v = by_key.get(c.key)
            if v is not None and v.slowdown is not None:
                derived[f"change/{c.key}"] = Derived(v.slowdown, "ratio", f"{self.cfg.describe()} -> {v.verdict}",
                                                     spread=v.ci, inputs=tuple(f"{c.key}/{e.side}" for e in c.entries))
        notes = (self.summary_line(), *self.notes)
        return Result("gate.ab", env, tuple(series), derived, quick=False, notes=tuple(notes))


def prepare_sides(specs: Sequence[SideSpec], select_: dict, workdir: Path, cfg: ABConfig,
                  log: Callable[[str], None] = print) -> tuple[dict[str, Worker], dict[str, dict], list[str]]:
    """Start every side's worker, check they share a GPU, prepare their cases (the workers start
    together and prepare in parallel: each is its own process). Returns (workers, prepared, notes);
    closes the workers on failure."""
    workers: dict[str, Worker] = {}
    try:
        for s in specs:
            workers[s.name] = Worker(s, workdir)
        hellos = {n: w.start() for n, w in workers.items()}
        notes = check_same_gpu(hellos)
        for n, w in workers.items():
            log(f"{n}: {w.side.label or w.side.root} on {(hellos[n].get('device') or {}).get('gpu_key', 'no GPU')}, "
                f"preparing ...")
            w.proc.stdin.write((json.dumps({"cmd": "prepare", "select": select_, "variants": w.side.variants})
                                + "\n").encode())
            w.proc.stdin.flush()
        prepared = {}
        for n, w in workers.items():
            rep = w.receive(cfg.prepare_timeout_s)
            if not rep.get("ok"):
                raise ABInputError(f"the {n} tree {w.side.label or w.side.root} could not prepare its cases: "
                                   f"{rep.get('error')}\n{rep.get('traceback', '')}")
            prepared[n] = rep
            log(f"{n}: {len(rep['cases'])} case(s) ready, {len(rep['failed'])} failed, {len(rep['skipped'])} skipped")
        return workers, prepared, notes
    except BaseException:
        for w in workers.values():
            w.close()
        raise


def pool_prepared(prepared: Mapping[str, dict], names: Sequence[str]) -> dict:
    """One side's preparation from its workers': a case counts as ready only where every worker
    has it; a case that failed on any worker is failed (named with the worker)."""
    reps = [prepared[n] for n in names]
    ready = set.intersection(*({c["id"] for c in p["cases"]} for p in reps))
    failed = list(reps[0]["failed"])
    seen = {f["id"] for f in failed}
    for n, p in zip(names[1:], reps[1:]):
        for f in p["failed"]:
            if f["id"] not in seen:
                failed.append({**f, "error": f"(worker {n}) {f['error']}"})
                seen.add(f["id"])
    for n, p in zip(names, reps):
        for c in p["cases"]:
            if c["id"] not in ready and c["id"] not in seen:
                failed.append({"id": c["id"], "error": f"prepared by worker {n} but not by every worker of its side"})
                seen.add(c["id"])
    return {**reps[0], "cases": [c for c in reps[0]["cases"] if c["id"] in ready], "failed": failed}


def run_ab(baseline: SideSpec, candidate: SideSpec, select_: dict | None = None, rounds: int = 10,
           cfg: ABConfig = ABConfig(), workdir: Path | None = None,
           log: Callable[[str], None] = print) -> ABReport:
    """The in-run A/B of two trees (module docstring). Raises ABInputError / ABGpuMismatch."""
    select_ = dict(select_ or {})
    own_tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="megabench-ab-run-")) if own_tmp else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    workers: dict[str, Worker] = {}
    try:
        a, b = baseline.name, candidate.name
        specs_a, specs_b = replicate(baseline, cfg.replicas), replicate(candidate, cfg.replicas)
        workers, prepared_w, notes = prepare_sides([*specs_a, *specs_b], select_, workdir, cfg, log)
        prepared = {a: pool_prepared(prepared_w, [x.name for x in specs_a]),
                    b: pool_prepared(prepared_w, [x.name for x in specs_b])}
        ca = {c["id"]: c for c in prepared[a]["cases"]}
        cb = {c["id"]: c for c in prepared[b]["cases"]}
        failed = {n: p["failed"] for n, p in prepared.items()}
        skipped = {n: p["skipped"] for n, p in prepared.items()}
        failed_ids = {f["id"] for fs in failed.values() for f in fs}
        only = {a: sorted(set(ca) - set(cb) - failed_ids), b: sorted(set(cb) - set(ca) - failed_ids)}
        keys = sorted(set(ca) & set(cb))
        if not keys and not any(failed.values()):
            raise ABInputError(
                "no case to compare: " + "; ".join(
                    f"{n} prepared {len(p['cases'])}, skipped {len(p['skipped'])}"
                    + (f" (e.g. {p['skipped'][0]['id']}: {p['skipped'][0]['reason'][:200]})" if p["skipped"] else "")
                    for n, p in prepared.items()) + f" (selection {select_ or 'all'})")
        comps = [Comparison(k, cb[k].get("unit", "s"),
                            [Entry(x.name, k, side, p + 1) for p, pair in enumerate(zip(specs_a, specs_b))
                             for x, side in zip(pair, (a, b))]) for k in keys]
        log(f"timing {len(comps)} case(s), {rounds} rounds, {cfg.replicas} worker(s) a side, interleaved ...")
        wall = run_rounds(workers, comps, rounds, cfg, log) if comps else 0.0
        verdicts = [replicated_verdict(c.key, c.group_values(a), c.group_values(b), c.unit, cfg) for c in comps]
        if cfg.replicas == 1:
            notes.append("one worker a side: only the rounds are tested, not the process-to-process offsets "
                         "(gate.quality measured up to 7.6% between two processes of one build)")
        sides = {s.name: {"label": s.label, "root": str(s.root), "hello": prepared_hello(workers[s.name]),
                          "workers": [x.name for x in (specs_a if s is baseline else specs_b)]}
                 for s in (baseline, candidate)}
        return ABReport(verdicts, cfg, rounds, sides, only, failed, skipped,
                        {n: p.get("missing_classes", []) for n, p in prepared.items()}, notes, comps, wall)
    finally:
        for w in workers.values():
            w.close()
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)


def prepared_hello(w: Worker) -> dict:
    h = dict(w.hello or {})
    h.pop("pid", None)
    return h


# ----------------------------------------------------------------------------- CLI
def synthetic_specs(path: Path) -> tuple[dict, dict]:
    """`--backend synthetic:SPEC`: {"baseline": {...}, "candidate": {...}} (ab_worker.SyntheticBackend)."""
    d = read_json(path)  # a missing or malformed file: ResultsFileError naming it
    if not isinstance(d, dict) or not isinstance(d.get("baseline"), dict) or not isinstance(d.get("candidate"), dict):
        raise ABInputError(f"{path}: a synthetic spec needs 'baseline' and 'candidate' objects")
    return d["baseline"], d["candidate"]


def cmd_ab(args) -> int:
    """`megabench gate --ab REV | --ab-tree PATH` (gate.add_parser)."""
    cfg = ABConfig(floor=args.ab_floor, alpha=args.alpha, min_rounds=args.min_rounds, replicas=args.replicas)
    if args.replicas < 1:
        print(f"megabench gate: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return EXIT_INPUT
    atomic.check_writable(args.markdown, args.json)  # before the work: a typo'd folder writes neither
    args.rounds = 10 if args.rounds is None else args.rounds
    if args.rounds < 1:
        print(f"megabench gate: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return EXIT_INPUT
    select_ = {"classes": [c for x in (args.classes or []) for c in x.split(",") if c], "k": args.select_k,
               "m": args.marker}
    if not (select_["classes"] or select_["k"] or select_["m"]):
        select_.update(DEFAULT_SELECTION)
    backend, spec_b, spec_c = "pytest", None, None
    if args.backend and args.backend != "pytest":
        kind, _, sp = args.backend.partition(":")
        if kind != "synthetic" or not sp:
            print(f"megabench gate: --backend {args.backend!r}: 'pytest' or 'synthetic:SPEC.json'", file=sys.stderr)
            return EXIT_INPUT
        backend = "synthetic"
        spec_b, spec_c = synthetic_specs(Path(sp))
    cand_root = Path(args.candidate_tree or REPO_ROOT).resolve()
    if not cand_root.is_dir():
        raise ABInputError(f"candidate tree {cand_root} does not exist")
    candidate = SideSpec("candidate", cand_root, tree_label(cand_root), backend, spec_c)
    if args.inject_ppm:
        candidate.variants = [{"name": "", "env": {INJECT_ENV: str(args.inject_ppm)}}]
        candidate.label += f" with MB_INJECT_PPM={args.inject_ppm}"

    def go(base_root: Path, label: str) -> int:
        baseline = SideSpec("baseline", base_root, label, backend, spec_b)
        try:
            rep = run_ab(baseline, candidate, select_, args.rounds, cfg)
        except ABGpuMismatch as e:
            print(f"megabench gate: refused: {e}", file=sys.stderr)
            return EXIT_GPU
        md = print_report(rep, args.markdown, args.json)
        if args.out:
            p = rep.to_result().save(Path(args.out))
            atomic.write_text(p.with_name(p.name.split(".json")[0] + ".md"), md)
            print(f"saved {p}")
        code = rep.exit_code(args.allow_unknown)
        if code == EXIT_UNKNOWN:
            print("gate: some cases are unknown (too few rounds, on one side only, or a slowdown the workers cannot "
                  "confirm); not a pass. --allow-unknown accepts that.", file=sys.stderr)
        elif code == EXIT_INPUT:
            print("gate: a case failed to build or check on a side (listed above)", file=sys.stderr)
        return code

    if args.ab_tree:
        root = Path(args.ab_tree).resolve()
        if not root.is_dir():
            raise ABInputError(f"baseline tree {root} does not exist")
        return go(root, tree_label(root))
    with checkout(args.ab, REPO_ROOT) as (root, sha):
        return go(root, f"{args.ab} ({sha[:12]})")
