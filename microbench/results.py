"""Typed benchmark results, serialised to versioned JSON.

Every file carries the environment it was measured in, the raw samples, their summary, which
timer produced them and the physical bound the benchmark states. Writing is atomic and never
replaces an existing file; reading a malformed or future-version file raises ResultsFileError
naming the file and the problem. A result of more than GZIP_MIN_BYTES is written gzipped
(`<name>.json.gz`, ~9x smaller: the committed megakernel results were most of the repository,
whose whole tree the GPU machine receives); every reader here takes either form.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import gzip
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import write_bytes
from .compiler import toolchain_versions
from .device import device_info, gpu_count
from .errors import OutputError, ResultsFileError
from .stats import Summary

SCHEMA = "megabench.result"
VERSION = 1
GZIP_MIN_BYTES = 64 * 1024  # a result's JSON above this is saved as .json.gz
RESULT_SUFFIXES = (".json", ".json.gz")
REPO_ROOT = Path(__file__).resolve().parent.parent
# cupti: kernel durations from the CUDA profiling interface (torch.profiler), e.g. the peer
# baseline's per-kernel accounting (megakernel/peer_bench.py)
TIMERS = ("cuda_event", "globaltimer", "clock64", "host", "derived", "static", "cupti")


def results_root() -> Path:
    return Path(os.environ.get("MEGABENCH_RESULTS", REPO_ROOT / "reports" / "results"))


def _git(*args: str, env: Mapping[str, str] | None = None) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                              env={**os.environ, **env} if env else None).stdout.strip()
    except Exception:
        return ""


# What a measurement depends on: the code, the tests that drive it and the tuned constants (not
# the results and reports a run writes beside them).
SOURCE_PATHS = ("megakernel", "microbench", "tests", "conftest.py", "pyproject.toml", ".ci", "reports/constants")


@functools.lru_cache(maxsize=None)
def source_tree_id() -> str:
    """The git tree id of SOURCE_PATHS as they are on disk (tracked or not, unless git ignores
    them), through a throwaway index; "" without git. Writes blobs into the object store, nothing
    else. Cached per process: a run does not edit its own sources."""
    paths = [p for p in SOURCE_PATHS if (REPO_ROOT / p).exists()]
    with tempfile.TemporaryDirectory() as d:
        env = {"GIT_INDEX_FILE": os.path.join(d, "index")}
        _git("add", "-A", "--", *paths, env=env)
        tree = _git("write-tree", env=env)
    return tree if re.fullmatch(r"[0-9a-f]{40,64}", tree) else ""


def git_sha(full: bool = False) -> str:
    """The commit results are credited to: MEGABENCH_GIT_SHA when set (a run on a copy of the
    checkout), else HEAD (short unless `full`); "unknown" when neither is a hex sha (a copy without
    history answers `rev-parse HEAD` with the word "HEAD")."""
    sha = os.environ.get("MEGABENCH_GIT_SHA") or _git("rev-parse", *(() if full else ("--short",)), "--verify", "-q",
                                                       "HEAD")
    return sha if re.fullmatch(r"[0-9a-f]{7,64}", sha or "") else "unknown"


def _dirty(expected: str | None) -> bool:
    """Whether the sources differ from the commit the results are credited to. With
    MEGABENCH_SOURCE_TREE (`python -m microbench.results source-tree` at that commit) the sources'
    tree id on disk is compared with it, so a copy whose .git lags behind its files is judged by
    its files (a machine that receives the caller's files beside the .git of an earlier commit
    would otherwise call every result dirty). Without it, `git status` of the tracked files."""
    if expected:
        got = source_tree_id()
        return not got or got != expected.strip()
    return bool(_git("status", "--porcelain", "--untracked-files=no"))


def git_dirty() -> bool:
    """Whether the sources differ from the commit git_sha() credits results to (by
    MEGABENCH_SOURCE_TREE when set: _dirty)."""
    return _dirty(os.environ.get("MEGABENCH_SOURCE_TREE"))


@dataclass(frozen=True)
class Env:
    gpu: str | None
    gpu_uuid: str | None
    cc: str | None
    sm_count: int | None
    l2_bytes: int | None
    sm_clock_max_mhz: int | None
    mem_clock_max_mhz: int | None
    driver: str | None
    nvrtc: str
    cuda_core: str
    torch: str
    python: str
    git_sha: str
    git_dirty: bool
    host: str
    date: str  # ISO 8601 UTC
    machine_kind: str | None = None  # e.g. "nvidia-h200" (MEGABENCH_MACHINE_KIND)
    # the tuned constants a megakernel build read (megakernel results only; None elsewhere):
    # the revision number and the file, as megakernel/plans.py tuned() loaded them
    constants_revision: int | None = None
    constants_file: str | None = None

    @classmethod
    def capture(cls, gpu_index: int | None = 0) -> Env:
        tv = toolchain_versions()
        try:
            import torch  # heavy: torch

            tver = torch.__version__
        except Exception:
            tver = "unavailable"
        info = None
        if gpu_index is not None and gpu_count() > gpu_index:
            info = device_info(gpu_index)
        sha = git_sha()
        dirty = git_dirty()
        return cls(
            gpu=info.name if info else None,
            gpu_uuid=info.uuid if info else None,
            cc=f"{info.cc[0]}.{info.cc[1]}" if info else None,
            sm_count=info.sm_count if info else None,
            l2_bytes=info.l2_bytes if info else None,
            sm_clock_max_mhz=info.sm_clock_max_mhz if info else None,
            mem_clock_max_mhz=info.mem_clock_max_mhz if info else None,
            driver=info.driver_version if info else None,
            nvrtc=tv.get("nvrtc", "?"),
            cuda_core=tv.get("cuda-core", "?"),
            torch=tver,
            python=platform.python_version(),
            git_sha=sha,
            git_dirty=dirty,
            host=socket.gethostname(),
            date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            machine_kind=os.environ.get("MEGABENCH_MACHINE_KIND"),
        )

    @property
    def gpu_key(self) -> str:
        """Baselines are kept and compared per GPU model and max clock."""
        return f"{self.gpu or 'cpu'}@{self.sm_clock_max_mhz or 0}MHz"


@dataclass(frozen=True)
class Bound:
    """The physical limit a benchmark is judged against."""

    kind: str  # "bandwidth" | "latency" | "throughput" | "time"
    value: float
    unit: str  # e.g. "B/s", "s", "ns"
    source: str  # how the value was obtained (measured run, datasheet, fitted)


@dataclass(frozen=True)
class Series:
    name: str
    params: Mapping[str, object]
    timer: str
    unit: str
    samples: tuple[float, ...]
    summary: Summary
    bound: Bound | None = None
    achieved: float | None = None  # the summary median expressed in bound.unit
    fraction_of_bound: float | None = None  # achieved/bound for rates, bound/achieved for times
    clocks: Mapping[str, float] = field(default_factory=dict)
    metrics: Mapping[str, object] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.timer not in TIMERS:
            raise ValueError(f"series {self.name}: timer {self.timer!r} not one of {TIMERS}")

    @classmethod
    def from_samples(cls, name: str, samples: Iterable[float], *, timer: str, unit: str,
                     params: Mapping[str, object] | None = None, bound: Bound | None = None,
                     work: float | None = None, clocks: Mapping[str, float] | None = None,
                     metrics: Mapping[str, object] | None = None, warnings: Iterable[str] = ()) -> Series:
        """Summarise samples; with a bound, express the median against it.

        For a bandwidth/throughput bound, `work` (bytes, flops, items per sample) turns the
        median time into a rate. For a latency/time bound the median itself is compared.
        """
        s = tuple(float(v) for v in samples)
        summ = Summary.of(s)
        achieved = frac = None
        warnings = tuple(warnings)
        if bound is not None:
            if bound.kind in ("bandwidth", "throughput"):
                if work is None:
                    raise ValueError(f"series {name}: a {bound.kind} bound needs `work` per sample")
                achieved = work / summ.median if summ.median > 0 else None
                frac = achieved / bound.value if achieved is not None else None
            else:
                achieved = summ.median
                # a time at or below zero (an empty loop subtracted, below the timer's resolution)
                # has no fraction of any bound: reported as None, never as a negative percentage
                frac = bound.value / summ.median if summ.median > 0 else None
            warnings += bound_warnings(frac, summ.median, bound)
        return cls(name, dict(params or {}), timer, unit, s, summ, bound, achieved, frac, dict(clocks or {}),
                   dict(metrics or {}), warnings)


BEATEN_TOLERANCE = 0.01  # a measurement this far past its bound is noise; further, the bound is not one


def bound_warnings(frac: float | None, median: float, bound: Bound) -> tuple[str, ...]:
    """What a reader must know about a fraction of bound: a median at or below zero has none, and
    a fraction above 100% (beyond noise) means the stated bound is not a bound of this quantity."""
    if median <= 0:
        return (f"median {median:.3g} <= 0 (below the timer's resolution after subtraction): no fraction of bound",)
    if frac is not None and frac > 1.0 + BEATEN_TOLERANCE:
        return (f"beats its stated bound ({bound.kind} {bound.value:.4g} {bound.unit}) by x{frac:.2f}: not a bound "
                "of this quantity",)
    return ()


def spread_contains(d: Derived, rel: float = 1e-9) -> bool:
    """Whether a derived value lies inside its own spread (True when it has none)."""
    if not d.spread:
        return True
    lo, hi = d.spread
    tol = rel * max(abs(d.value), abs(lo), abs(hi), 1e-300)
    return lo - tol <= d.value <= hi + tol


@dataclass(frozen=True)
class Derived:
    """A constant derived from series, with its spread and the rule that produced it."""

    value: float
    unit: str
    rule: str
    spread: tuple[float, float] | None = None  # (lo, hi), e.g. a bootstrap interval
    inputs: tuple[str, ...] = ()  # series names it was derived from
    note: str = ""


@dataclass(frozen=True)
class Result:
    benchmark: str  # "<class>.<name>", e.g. "icache.capacity"
    env: Env
    series: tuple[Series, ...]
    derived: Mapping[str, Derived] = field(default_factory=dict)
    quick: bool = True
    notes: tuple[str, ...] = ()

    def series_named(self, name: str) -> Series:
        for s in self.series:
            if s.name == name:
                return s
        raise KeyError(f"{self.benchmark}: no series {name!r}")

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> dict:
        def conv(o):
            if dataclasses.is_dataclass(o) and not isinstance(o, type):
                if isinstance(o, Summary):
                    return o.to_dict()
                return {f.name: conv(getattr(o, f.name)) for f in dataclasses.fields(o)}
            if isinstance(o, Mapping):
                return {str(k): conv(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)):
                return [conv(v) for v in o]
            if isinstance(o, float) and not math.isfinite(o):
                return repr(o)  # 'nan'/'inf' as strings: JSON has no such numbers
            if hasattr(o, "item") and callable(o.item):  # numpy scalars
                return conv(o.item())
            return o

        return {"schema": SCHEMA, "version": VERSION, **conv(self)}

    @classmethod
    def from_json(cls, d: dict, source: str = "<dict>") -> Result:
        def bad(msg):
            return ResultsFileError(f"{source}: {msg}")

        if not isinstance(d, dict):
            raise bad("top level is not a JSON object")
        if d.get("schema") != SCHEMA:
            raise bad(f"schema is {d.get('schema')!r}, expected {SCHEMA!r}")
        v = d.get("version")
        if not isinstance(v, int):
            raise bad(f"version is {v!r}, expected an integer")
        if v > VERSION:
            raise bad(f"written by a newer megabench (result version {v}, this reads up to {VERSION}); upgrade")
        try:
            env = Env(**d["env"])
            series = []
            for s in d["series"]:
                bound = Bound(**s["bound"]) if s.get("bound") else None
                series.append(Series(
                    name=s["name"], params=s.get("params", {}), timer=s["timer"], unit=s["unit"],
                    samples=tuple(float(x) for x in s["samples"]), summary=Summary.from_dict(s["summary"]),
                    bound=bound, achieved=_num(s.get("achieved")), fraction_of_bound=_num(s.get("fraction_of_bound")),
                    clocks=s.get("clocks", {}), metrics=s.get("metrics", {}), warnings=tuple(s.get("warnings", ()))))
            derived = {}
            for k, x in d.get("derived", {}).items():
                sp = x.get("spread")
                derived[k] = Derived(value=float(x["value"]), unit=x["unit"], rule=x["rule"],
                                     spread=tuple(float(t) for t in sp) if sp else None,
                                     inputs=tuple(x.get("inputs", ())), note=x.get("note", ""))
            return cls(benchmark=d["benchmark"], env=env, series=tuple(series), derived=derived,
                       quick=bool(d.get("quick", True)), notes=tuple(d.get("notes", ())))
        except ResultsFileError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"malformed result ({e.__class__.__name__}: {e})") from None

    def with_spreads_checked(self) -> Result:
        """This result, every derived spread made to contain its value: a spread that does not
        (a rule's bug) is widened to include it and says so in the note, so a run's data is never
        lost over it. tests/test_spreads.py fails on any committed or re-derived value outside its
        spread, so a widened spread is a bug to fix, not a state to keep."""
        fixed = {}
        for k, d in self.derived.items():
            if spread_contains(d):
                fixed[k] = d
                continue
            lo, hi = d.spread
            fixed[k] = dataclasses.replace(d, spread=(min(lo, d.value), max(hi, d.value)), note=(
                (d.note + "; " if d.note else "") + f"SPREAD WIDENED: the rule's interval [{lo:.6g}, {hi:.6g}] did not "
                "contain the value"))
        return dataclasses.replace(self, derived=fixed) if fixed != dict(self.derived) else self

    def save(self, root: Path | None = None) -> Path:
        """Write atomically under <root>/<class>/; never replaces an existing file. A derived
        spread that does not contain its value is widened first (with_spreads_checked)."""
        self = self.with_spreads_checked()
        root = Path(root) if root else results_root()
        cls_dir = root / self.benchmark.split(".")[0]
        cls_dir.mkdir(parents=True, exist_ok=True)
        stamp = self.env.date.replace("-", "").replace(":", "")
        gpu = re.sub(r"[^A-Za-z0-9]+", "-", self.env.gpu or "cpu").strip("-").lower()
        base = f"{self.benchmark}-{stamp}-{gpu}-{self.env.git_sha[:7]}"
        data = json.dumps(self.to_json(), indent=1, sort_keys=False).encode()
        suffix = ".json"
        if len(data) > GZIP_MIN_BYTES:
            data, suffix = gzip.compress(data, compresslevel=9, mtime=0), ".json.gz"

        for i in range(1000):
            stem = base + (f"-{i}" if i else "")
            if any((cls_dir / (stem + x)).exists() for x in RESULT_SUFFIXES):
                continue  # one name, one result, in either form
            try:
                return write_bytes(cls_dir / (stem + suffix), data, replace=False)  # never overwrites
            except OutputError:  # taken meanwhile
                continue
        raise ResultsFileError(f"could not find a free file name for {base} in {cls_dir}")


def _num(x):
    if x is None:
        return None
    return float(x)


def read_json(path: str | Path):
    """A results file's JSON document, gzipped (`.gz`) or not."""
    p = Path(path)
    try:
        raw = p.read_bytes()
        if p.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except FileNotFoundError:
        raise ResultsFileError(f"{p}: no such results file") from None
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError; a corrupt stream, zlib.error
        what = "not a readable gzip file" if p.name.endswith(".gz") else "cannot be read"
        raise ResultsFileError(f"{p}: {what} ({e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsFileError(f"{p}: not valid JSON ({e})") from None


def load(path: str | Path) -> Result:
    return Result.from_json(read_json(path), source=str(path))


def scan(root: Path | None = None, benchmark: str | None = None, strict: bool = False) -> list[tuple[Path, dict | None]]:
    """Every results file (.json or .json.gz) under `root` with its JSON document, optionally of one
    benchmark; documents that are not results (other JSON) are left out. A file that cannot be read
    comes back with None (it surfaces when loaded, not silently dropped); with `strict` it raises
    ResultsFileError naming the file instead. Perfetto traces (`*.trace.json.gz`) are not results."""
    root = Path(root) if root else results_root()
    out = []
    for p in sorted(root.rglob("*.json")) + sorted(root.rglob("*.json.gz")):
        if p.name.startswith(".tmp-") or p.name.endswith(".trace.json.gz"):
            continue
        if benchmark and not p.name.startswith(benchmark + "-"):
            continue
        try:
            d = read_json(p)
        except ResultsFileError:
            if strict:
                raise
            out.append((p, None))
            continue
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:  # another kind of JSON: not a result
            continue
        if strict and not isinstance(d.get("env"), dict):
            raise ResultsFileError(f"{p}: malformed result (no 'env' object)")
        out.append((p, d))
    return out


def find(benchmark: str | None = None, root: Path | None = None, gpu: str | None = None,
         strict: bool = False) -> list[Path]:
    """Result files, .json or .json.gz (oldest first by recorded date), optionally for one
    benchmark / GPU model (scan: unreadable files first, or ResultsFileError with `strict`)."""
    rows = []
    for p, d in scan(root, benchmark, strict):
        if d is None:
            rows.append(("", p))
            continue
        env = d.get("env") if isinstance(d.get("env"), dict) else {}
        if gpu and env.get("gpu") != gpu:
            continue
        rows.append((env.get("date", ""), p))
    return [p for _, p in sorted(rows, key=lambda r: (r[0], str(r[1])))]


def latest(benchmark: str, root: Path | None = None, gpu: str | None = None) -> Result | None:
    files = find(benchmark, root, gpu)
    return load(files[-1]) if files else None


def _main(argv: list[str] | None = None) -> int:
    """`python -m microbench.results source-tree`: the tree id to pass as MEGABENCH_SOURCE_TREE
    (with MEGABENCH_GIT_SHA) to a run on a copy of this checkout."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["source-tree"]:
        print("usage: python -m microbench.results source-tree", file=sys.stderr)
        return 2
    tree = source_tree_id()
    if not tree:
        print("source-tree: no git repository (or git) here", file=sys.stderr)
        return 1
    if _git("status", "--porcelain", "--", *[p for p in SOURCE_PATHS if (REPO_ROOT / p).exists()]):
        print("source-tree: warning: the sources differ from HEAD; the id is of the files on disk", file=sys.stderr)
    print(tree)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
