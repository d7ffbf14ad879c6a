"""`megabench run`: the whole pipeline, one command.

With a GPU:    1 microbenchmarks (registry, quick or full; results saved as new files)
               2 cross-GPU microbenchmarks (microbench/xgpu under torchrun) with 2+ GPUs, else skipped
               3 gate quality from the recorded samples (gate.quality result)
               4 tune (a new constants revision when anything changed)
               5 megakernel build + benchmarks, if `megakernel.pipeline` exists, from the
                 ADOPTED constants revision (microbench/adopt.py), not the one step 4 wrote
               6 report
Without a GPU: says so, tunes from the committed results into a temporary folder (the committed
               constants stay untouched unless --write-constants), skips the GPU stages and
               renders the report from the committed H200 results.
A stage that fails is reported and the next ones still run; the exit code is non-zero if any did.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import tempfile
import time
import traceback
from pathlib import Path


def add_parser(sub) -> None:
    s = sub.add_parser("run", help="the pipeline: microbenchmarks, tune, megakernel, report", description=__doc__)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="full", action="store_false", help="quick sweeps (default)")
    g.add_argument("--full", dest="full", action="store_true", help="full sweeps")
    s.add_argument("--classes", nargs="*", default=None, help="overhead classes to run (default: all present)")
    s.add_argument("--results", type=Path, default=None, help="results root (default $MEGABENCH_RESULTS or reports/results)")
    s.add_argument("--out", type=Path, default=None, help="report folder (default reports/)")
    s.add_argument("--constants-out", type=Path, default=None, help="constants folder (default reports/constants; "
                   "without a GPU a temporary folder unless --write-constants)")
    s.add_argument("--write-constants", action="store_true",
                   help="without a GPU: write the tuned constants into reports/constants anyway")
    s.add_argument("--no-report", action="store_true", help="skip the report stage")
    s.set_defaults(fn=_cmd, full=False)


class _Stages:
    def __init__(self, total: int):
        self.total, self.i, self.failed = total, 0, []

    def run(self, name: str, fn, *a, **kw):
        self.i += 1
        t0 = time.monotonic()
        print(f"[{self.i}/{self.total}] {name} ...", flush=True)
        try:
            out = fn(*a, **kw)
        except Exception as e:
            self.failed.append(name)
            print(f"[{self.i}/{self.total}] {name} FAILED after {time.monotonic() - t0:.1f} s: "
                  f"{e.__class__.__name__}: {e}", flush=True)
            traceback.print_exc(limit=4)
            return None
        print(f"[{self.i}/{self.total}] {name} done in {time.monotonic() - t0:.1f} s", flush=True)
        return out

    def skip(self, name: str, why: str):
        self.i += 1
        print(f"[{self.i}/{self.total}] {name}: skipped ({why})", flush=True)


def _microbenchmarks(classes, full: bool):
    from .harness import Harness
    from .registry import CLASSES, benchmarks

    unknown = sorted(set(classes or ()) - set(CLASSES))
    if unknown:
        raise ValueError(f"unknown classes {unknown}; known: {list(CLASSES)}")
    h = Harness()
    todo = benchmarks(classes)
    failed = []
    for name, fn in todo.items():
        t0 = time.monotonic()
        print(f"    {name} ...", flush=True)
        try:
            res = fn(h, quick=not full, save=True)
        except Exception as e:  # one broken benchmark must not hide the others' results
            failed.append(name)
            print(f"    {name} FAILED: {e.__class__.__name__}: {e}", flush=True)
            continue
        for k, d in res.derived.items():
            print(f"      -> {k} = {d.value:.4g} {d.unit}")
        print(f"    {name} done in {time.monotonic() - t0:.1f} s", flush=True)
    missing = [c for c in (classes or CLASSES) if not any(n.startswith(c + ".") for n in todo)]
    if missing:
        print(f"    classes with no benchmarks yet: {', '.join(missing)}")
    if failed:
        raise RuntimeError(f"{len(failed)} benchmark(s) failed: {', '.join(failed)}")


def megakernel_entry():
    """megakernel.pipeline.run if that module exists, else None (the stage is not available yet)."""
    if importlib.util.find_spec("megakernel") is None or importlib.util.find_spec("megakernel.pipeline") is None:
        return None
    mod = importlib.import_module("megakernel.pipeline")
    return getattr(mod, "run", None)


def _megakernel(entry, full: bool, constants_path: Path | None):
    """The megakernel stage builds from the constants revision adopted in the constants folder
    (microbench/adopt.py), not the one tune has just written: a re-tuned ring or budget reaches the
    build only after it has been measured and adopted. Without an adoption there, the fresh
    revision, said out loud."""
    kw = {"quick": not full}
    params = inspect.signature(entry).parameters
    if "constants" in params and constants_path is not None:
        from .adopt import load_adopted, load_adoption
        from .tune import load_constants

        fresh = load_constants(constants_path)
        rec = load_adoption(fresh.gpu, constants_path.parent)
        if rec is None:
            print(f"megakernel: WARNING: no adopted constants revision in {constants_path.parent / 'adopted'}; building "
                  f"from revision {fresh.revision}, which tune has just written and nothing has measured", flush=True)
            kw["constants"] = fresh
        else:
            kw["constants"] = load_adopted(fresh.gpu, constants_path.parent)
            if rec["revision"] != fresh.revision:
                print(f"megakernel: builds the adopted revision {rec['revision']}, not revision {fresh.revision} that "
                      f"tune has just written; to move the build: MEGABENCH_CONSTANTS={constants_path.parent}/"
                      f"history/<its file> python -m megakernel.cli check-and-bench, then `megabench adopt`", flush=True)
    return entry(**kw)


def _cmd(args) -> int:
    from .device import no_gpu_reason
    from .results import results_root

    reason = no_gpu_reason()
    root = args.results or results_root()
    if reason is None:
        return _with_gpu(args, root)
    print(f"megabench run: no GPU here ({reason}).\n"
          f"Running the CPU part only: tune from the committed results in {root} (into a temporary folder"
          f"{'' if not args.write_constants else ' -- no: into reports/constants, as asked'}) and render the report "
          "from them. Microbenchmarks and the megakernel need a GPU.", flush=True)
    st = _Stages(5)
    st.skip("microbenchmarks", "no GPU")
    st.skip("cross-GPU microbenchmarks", "no GPU; they need 2 or more")
    out_c = args.constants_out or (None if args.write_constants else Path(tempfile.mkdtemp(prefix="megabench-constants-")))
    st.run("tune", _tune, root, out_c)
    st.skip("megakernel", "no GPU" if megakernel_entry() is not None else "no GPU; megakernel.pipeline not available yet")
    if args.no_report:
        st.skip("report", "--no-report")
    else:
        st.run("report", _report, root, args.out)
    return _finish(st)


def _with_gpu(args, root: Path) -> int:
    import os

    os.environ["MEGABENCH_RESULTS"] = str(root)  # benchmarks save where tune and report read
    st = _Stages(6)
    st.run("microbenchmarks", _microbenchmarks, args.classes, args.full)
    from .xgpu import launcher

    _, why = launcher.gpus_or_reason()
    if why:
        st.skip("cross-GPU microbenchmarks", why)
    else:
        st.run("cross-GPU microbenchmarks", _xgpu, args.full)
    st.run("gate quality", _quality, root)
    cur = st.run("tune", _tune, root, args.constants_out)
    entry = megakernel_entry()
    if entry is None:
        st.skip("megakernel", "megakernel.pipeline is not available yet")
    else:
        st.run("megakernel", _megakernel, entry, args.full, cur)
    if args.no_report:
        st.skip("report", "--no-report")
    else:
        st.run("report", _report, root, args.out)
    return _finish(st)


def _xgpu(full: bool) -> None:
    from .xgpu import launcher

    rc = launcher.run(full=full)
    if rc:
        raise RuntimeError(f"torchrun exited with {rc} (the ranks' output above names the failure)")


def _quality(root: Path):
    from .gate_quality import run_quality

    _, text = run_quality(root, None, trials=100, save=True, save_root=root)  # seconds, not minutes
    print(text)


def _tune(root: Path, out_dir: Path | None) -> Path:
    from .tune import summary, tune

    doc, cur, rev, created = tune(root, None, out_dir)
    print(summary(doc, cur, rev, created))
    return cur


def _report(root: Path, out: Path | None) -> Path:
    from reports.build import build

    p = build(root, out)
    print(f"    report: {p}")
    return p


def _finish(st: _Stages) -> int:
    if st.failed:
        print(f"megabench run: {len(st.failed)} stage(s) failed: {', '.join(st.failed)}", file=sys.stderr)
        return 1
    print("megabench run: done")
    return 0
