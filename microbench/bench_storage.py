"""Committed pytest-benchmark baselines in pytest-benchmark's own storage layout, so that its
`--benchmark-compare` and `--benchmark-compare-fail` work against them:

    pytest tests/bench --benchmark-only --benchmark-storage=reports/benchmarks \\
        --benchmark-compare=0001 --benchmark-compare-fail=median:5%

pytest-benchmark (5.2/5.3, storage/file.py) keeps runs under `<storage>/<machine_id>/NNNN_<name>.json`,
machine_id = `{platform.system()}-{python_implementation()}-{major.minor}-{bits}` (utils.get_machine_id),
e.g. `Linux-CPython-3.12-64bit` on the H200 machine; `--benchmark-compare=0001` looks in the current
machine's folder only. From another Python, name the folder: `--benchmark-compare='Linux-CPython-3.12-64bit/0001'`
(a `platform-glob/filename-glob`), or pass the file's path. Only cases whose fullname is in the
baseline are compared (a new case is not a failure there).

`python -m microbench.bench_storage FILE... --name NAME` writes one such baseline from the
flat JSON files `--benchmark-json` wrote into reports/benchmarks (the newest record of each case
across the files, its provenance in extra_info), numbered after the folder's existing runs. Rounds
of several steps (extra_info `steps_per_round` without `time_per: step`, megakernel cases before
the round-is-one-step change) are divided into per-step figures, and the statistics are recomputed
from the divided data with pytest-benchmark's own Stats, so the table and the compare read one step.

Save new runs with `--benchmark-save=NAME --benchmark-save-data` (without -data the file has no
per-round figures and `megabench gate` calls its verdicts unknown).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from pytest_benchmark.stats import Stats

from . import atomic
from .errors import OutputError, ResultsFileError
from .gate import steps_divisor
from .results import REPO_ROOT, read_json

STORAGE = REPO_ROOT / "reports" / "benchmarks"
GPU_MACHINE_ID = "Linux-CPython-3.12-64bit"  # the H200 machine runs Python 3.12 (shared/TOOLCHAIN.md)


def machine_id() -> str:
    """This interpreter's pytest-benchmark machine_id (the same formula as pytest_benchmark.utils)."""
    return "{}-{}-{}-{}".format(platform.system(), platform.python_implementation(),
                                ".".join(platform.python_version_tuple()[:2]), platform.architecture()[0])


def _stats_of(data: Sequence[float]) -> dict:
    s = Stats()
    for x in data:
        s.update(float(x))
    out = s.as_dict()
    out["data"] = [float(x) for x in data]
    return out


def per_step(bench: dict) -> dict:
    """A benchmark record whose figures are per step (a copy; unchanged when already so)."""
    div = steps_divisor(bench.get("extra_info") or {})
    b = json.loads(json.dumps(bench))
    if div == 1:
        return b
    data = (b.get("stats") or {}).get("data")
    if not data:
        raise ResultsFileError(f"{b.get('fullname')}: {div} steps a round but no per-round data to divide")
    b["stats"] = {**b["stats"], **_stats_of([x / div for x in data])}
    b["extra_info"] = {**b["extra_info"], "time_per": "step",
                       "converted": f"per-step figures: the recorded rounds timed {div} steps each"}
    return b


def _load(path: Path) -> dict:
    d = read_json(path)  # a missing or malformed file: ResultsFileError naming it
    if not isinstance(d, dict) or not isinstance(d.get("benchmarks"), list) or "machine_info" not in d:
        raise ResultsFileError(f"{path}: not pytest-benchmark JSON (--benchmark-json)")
    return d


def merge(files: Sequence[Path]) -> dict:
    """One pytest-benchmark document holding the newest record of every case in `files` (by the
    files' `datetime`), per step; machine/commit info of the newest file; each record's origin in
    extra_info `baseline_source` / `baseline_datetime`."""
    docs = sorted(((_load(f), Path(f)) for f in files), key=lambda t: (str(t[0].get("datetime", "")), str(t[1])))
    if not docs:
        raise ResultsFileError("no pytest-benchmark files given")
    best: dict[str, tuple[dict, dict, Path]] = {}
    for d, p in docs:
        for b in d["benchmarks"]:
            best[b.get("fullname") or b["name"]] = (b, d, p)
    newest_doc = docs[-1][0]
    benches = []
    for name in sorted(best):
        b, d, p = best[name]
        b = per_step(b)
        try:
            src = str(p.resolve().relative_to(REPO_ROOT))
        except ValueError:
            src = str(p)
        b["extra_info"] = {**(b.get("extra_info") or {}), "baseline_source": src,
                           "baseline_datetime": str(d.get("datetime", ""))}
        benches.append(b)
    out = {k: v for k, v in newest_doc.items() if k != "benchmarks"}
    out["benchmarks"] = benches
    return out


def next_number(folder: Path) -> str:
    nums = [int(m.group(1)) for f in folder.glob("[0-9][0-9][0-9][0-9]_*.json")
            if (m := re.match(r"(\d{4})_", f.name))]
    return f"{max(nums, default=0) + 1:04d}"


def write_baseline(files: Sequence[Path], name: str, storage: Path = STORAGE, mid: str = GPU_MACHINE_ID) -> Path:
    """Write `<storage>/<mid>/NNNN_<name>.json` (atomically; never replaces a file)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ResultsFileError(f"baseline name {name!r}: letters, digits, '_', '.', '-' only")
    doc = merge(files)
    folder = Path(storage) / mid
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{next_number(folder)}_{name}.json"
    try:
        return atomic.write_json(path, doc, indent=4, replace=False)  # a numbered run is never replaced
    except OutputError as e:
        raise ResultsFileError(str(e)) from None


def main(argv=None, prog: str = "python -m microbench.bench_storage") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="pytest-benchmark JSON files (--benchmark-json)")
    ap.add_argument("--name", required=True, help="the run's name: NNNN_<name>.json")
    ap.add_argument("--storage", type=Path, default=STORAGE, help="default reports/benchmarks")
    ap.add_argument("--machine-id", default=GPU_MACHINE_ID,
                    help=f"pytest-benchmark machine folder (default {GPU_MACHINE_ID}, the H200 machine's; this "
                         f"interpreter's is {machine_id()})")
    args = ap.parse_args(argv)
    try:
        p = write_baseline(args.files, args.name, args.storage, args.machine_id)
    except ResultsFileError as e:
        print(f"bench_storage: {e}", file=sys.stderr)
        return 2
    n = len(json.loads(p.read_text())["benchmarks"])
    print(f"wrote {p} ({n} cases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
