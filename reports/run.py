"""`megabench run`: the whole pipeline, one command, with progress and a time budget.

With a GPU (default: quick, within BUDGET_S = 5 minutes on one H200):
               1 microbenchmarks: every class but `model` (reports/classes.py, quick sweeps), each
                 result saved as a new file; they feed every tuned constant
               2 cross-GPU microbenchmarks (microbench/xgpu under torchrun) with 2+ GPUs, else skipped
               3 gate quality from the recorded quality runs (gate.quality result; the GPU runs are
                 `megabench gate --quality-run`, microbench/gate_quality.py)
               4 tune (a new constants revision when anything changed; the megakernel builds
                 the ADOPTED revision, microbench/adopt.py, not necessarily this one)
               5 megakernel (megakernel.pipeline.Stage): its builds compiled in parallel, checks
                 (bitwise mega == chain, the reference, greedy decoding), then chain and mega timed at
                 the headline points (shard8 T=16 / T=1 at ctx 2048, small T=16 / T=1 at 512), the
                 torch baselines at the same points (model.baselines; the `model` class, run here so
                 the weights and reference steps are shared) and any peer implementation
                 (megakernel.pipeline.PEERS)
               6 report
             --full: full sweeps of every class, both contexts per preset, and what the default
               leaves out: the ablation (38 variants), the profiled timeline and the detail timeline.
Without a GPU: says so, tunes from the committed results into a temporary folder (the committed
               constants stay untouched unless --write-constants), skips the GPU stages and
               renders the report from the committed H200 results.

Progress: the items of every stage are listed before anything runs, each with an estimate (the
newest run.wall result of this GPU and mode under the results root or reports/results, else the
seeds in code: microbench/progress.py); a line as each item starts and ends gives the stage, the
item, the elapsed time, the estimated remainder and total against the budget. With a GPU the run's
own durations are saved as a typed result, `run.wall` (a series per item and per stage, `total`
bound by the budget: achieved vs bound like any other figure), which the next run estimates from.
An item that fails is reported and the later ones still run (a preset's timings are skipped after
its failed check); the exit code is 1 if any failed, 2 for a bad argument.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

from microbench.adopt import load_adopted, load_adoption
from microbench.device import device_info, no_gpu_reason
from microbench.gate_quality import pipeline_step
from microbench.harness import Harness
from microbench.progress import Estimates, Item, Progress
from microbench.results import REPO_ROOT, results_root
from microbench.teardown import leave
from microbench.tune import load_constants, summary, tune
from microbench.xgpu import launcher

from . import classes as classes_
from .build import build

BUDGET_S = 300.0
BUDGET_NOTE = ("`megabench run` (default) finishes on one H200 in 5 minutes or less; wall time on the "
               "host monotonic clock")

# Seconds per item before a run.wall result has measured it (microbench/progress.py): estimates only,
# read off the committed results (their saved times one after the other, the baselines' own
# wall-time notes); a run.wall result of this GPU and mode replaces them. Danger: too low a seed
# only makes the first run's plan optimistic, it never stops an item.
SEEDS = {
    "microbenchmarks/basics.copy": 4.0, "microbenchmarks/basics.launch": 6.0,
    "microbenchmarks/icache.capacity": 6.0, "microbenchmarks/icache.spliced": 1.0,
    "microbenchmarks/icache.prefetch": 2.0, "microbenchmarks/icache.code_vs_data": 1.0,
    "microbenchmarks/weights.read_ceiling": 5.0, "microbenchmarks/weights.ring": 4.0,
    "microbenchmarks/weights.l2": 3.0, "microbenchmarks/weights.prefetch": 1.0,
    "microbenchmarks/weights.hot_experts": 2.0,
    "microbenchmarks/sync.flags": 12.0, "microbenchmarks/sync.fences": 1.0, "microbenchmarks/sync.publish": 6.0,
    "microbenchmarks/sync.barriers": 2.0,
    "microbenchmarks/clocks.timers": 4.0, "microbenchmarks/clocks.skew": 1.0, "microbenchmarks/clocks.launch": 1.0,
    "microbenchmarks/clocks.instrumentation": 5.0,
    "gate quality/gate quality": 3.0, "tune/tune": 3.0, "report/report": 20.0,
    "cross-GPU microbenchmarks/xgpu": 60.0,  # one session of xgpu.*, read off the committed results' times
}
KIND_SEEDS = {"microbenchmark": 4.0}


def add_parser(sub) -> None:
    s = sub.add_parser("run", help="the pipeline: microbenchmarks, tune, megakernel, report (default within "
                       f"{BUDGET_S:.0f} s on one H200; --full: everything)", description=__doc__,
                       formatter_class=_raw())
    g = s.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="full", action="store_false", help="quick: the budgeted default")
    g.add_argument("--full", dest="full", action="store_true",
                   help="full sweeps, both contexts, the ablation, the timeline and the detail timeline")
    s.add_argument("--classes", nargs="*", default=None, help="overhead classes to run (default: all present; "
                   "`model`, the torch baselines, runs in the megakernel stage)")
    s.add_argument("--results", type=Path, default=None, help="results root (default $MEGABENCH_RESULTS or reports/results)")
    s.add_argument("--out", type=Path, default=None, help="report folder (default reports/)")
    s.add_argument("--constants-out", type=Path, default=None, help="constants folder (default reports/constants; "
                   "without a GPU a temporary folder unless --write-constants)")
    s.add_argument("--write-constants", action="store_true",
                   help="without a GPU: write the tuned constants into reports/constants anyway")
    s.add_argument("--no-report", action="store_true", help="skip the report stage")
    s.add_argument("--plan", action="store_true", help="print the items and their estimates, run nothing")
    s.set_defaults(fn=_cmd, full=False)


def _raw():
    return argparse.RawDescriptionHelpFormatter


# ---------------------------------------------------------------------- the stages' items
def megakernel_stage(**kw):
    """megakernel.pipeline.Stage(**kw): the megakernel stage's items."""
    from megakernel.pipeline import Stage  # heavy: torch (megakernel.plan)

    return Stage(**kw)


class _Run:
    """The state the items hand on: the harness (made on first use), the constants tune wrote."""

    def __init__(self, args, root: Path):
        self.args, self.root = args, root
        self._h = None
        self.mega = None

    @property
    def h(self):
        if self._h is None:
            self._h = Harness()
        return self._h

    def bench(self, fn) -> None:
        res = fn(self.h, quick=not self.args.full, save=True)
        for k, d in res.derived.items():
            print(f"      -> {k} = {d.value:.4g} {d.unit}")

    def tune(self, out_dir: Path | None) -> Path:
        cur = _tune(self.root, out_dir)
        if self.mega is not None:
            self.mega.constants = build_constants(cur)  # the adopted revision, not necessarily the fresh one
        return cur


def build_constants(current: Path):
    """The constants the megakernel stage builds from: the revision adopted in the constants folder
    of `current` (microbench/adopt.py), not the one tune has just written. A re-tuned ring or budget
    reaches the build only after it has been measured and adopted, never unmeasured. Without an
    adoption there, the fresh revision, said out loud."""
    fresh = load_constants(current)
    rec = load_adoption(fresh.gpu, current.parent)
    if rec is None:
        print(f"megakernel: WARNING: no adopted constants revision in {current.parent / 'adopted'}; building from "
              f"revision {fresh.revision}, which tune has just written and nothing has measured", flush=True)
        return fresh
    if rec["revision"] != fresh.revision:
        print(f"megakernel: builds the adopted revision {rec['revision']}, not revision {fresh.revision} that tune has "
              f"just written; to move the build: MEGABENCH_CONSTANTS={current.parent}/history/<its file> "
              "megabench mk check-and-bench, then `megabench adopt`", flush=True)
    return load_adopted(fresh.gpu, current.parent)


def _selected(classes) -> tuple[dict, bool]:
    """({benchmark: run} for the microbenchmark stage, whether the naive torch baselines were asked
    for by name: `--classes model`; `--full` runs them too). The default run leaves them out: they
    are the model written plainly in torch, not what anyone would run (the peer is the competent
    baseline, and runs by default), they would take a large share of the budget, and at shard8 they
    do not fit in memory beside the megakernel's tiled weights."""
    todo = classes_.benchmarks(classes)
    return {k: v for k, v in todo.items() if not k.startswith("model.")}, bool(classes and "model" in classes)


def items(args, root: Path, gpu: bool):
    """Every item of the run, in order (microbench.progress.Item); skipped stages are items with
    the reason."""
    run = _Run(args, root)
    out = []
    if not gpu:
        out.append(Item("microbenchmarks", "all", None, skip="no GPU"))
        out.append(Item("cross-GPU microbenchmarks", "xgpu", None, skip="no GPU; they need 2 or more"))
        out.append(Item("tune", "tune", partial(_tune_cpu, root, args)))
        out.append(Item("megakernel", "all", None, skip="no GPU"))
    else:
        micro, baselines = _selected(args.classes)
        out += [Item("microbenchmarks", name, partial(run.bench, fn), "microbenchmark") for name, fn in micro.items()]
        _, why = launcher.gpus_or_reason()
        out.append(Item("cross-GPU microbenchmarks", "xgpu", partial(_xgpu, args.full), skip=why or None))
        out.append(Item("gate quality", "gate quality", partial(_quality, root)))
        run.mega = megakernel_stage(quick=not args.full, ablate=args.full, timeline=args.full, detail=args.full,
                                    baselines=baselines or args.full)
        out.append(Item("tune", "tune", partial(run.tune, args.constants_out)))
        out += run.mega.items("megakernel")
    out.append(Item("report", "report", partial(_report, root, args.out),
                    skip="--no-report" if args.no_report else None))
    return out


def estimates(gpu_name: str | None, quick: bool, root: Path):
    from megakernel import pipeline as mk  # heavy: torch (megakernel.plan)

    seeds, kinds = dict(SEEDS), dict(KIND_SEEDS)
    seeds.update({f"megakernel/{k}": v for k, v in mk.SEEDS.items()})
    kinds.update(mk.KIND_SEEDS)
    return Estimates.load(gpu_name, quick, [root, REPO_ROOT / "reports" / "results"], seeds, kinds)


# ---------------------------------------------------------------------- the command
def _cmd(args) -> int:
    unknown = sorted(set(args.classes or ()) - set(classes_.NAMES))
    if unknown:
        print(f"megabench run: unknown classes {unknown}; known: {list(classes_.NAMES)}", file=sys.stderr)
        return 2
    reason = no_gpu_reason()
    root = args.results or results_root()
    gpu_name = None
    if reason is None:
        gpu_name = device_info().name
        os.environ["MEGABENCH_RESULTS"] = str(root)  # benchmarks save where tune and report read
    else:
        print(f"megabench run: no GPU here ({reason}).\n"
              f"Running the CPU part only: tune from the committed results in {root} (into a temporary folder"
              f"{'' if not args.write_constants else ' -- no: into reports/constants, as asked'}) and render the "
              "report from them. Microbenchmarks and the megakernel need a GPU.", flush=True)
    its = items(args, root, gpu=reason is None)
    budget = BUDGET_S if (reason is None and not args.full) else None
    pr = Progress(its, estimates(gpu_name, not args.full, root), budget_s=budget, out=_say)
    if args.plan:
        for line in pr.plan_lines():
            print(line)
        for it in its:
            e = pr.estimates.of(it)
            print(f"  {it.key}: " + (f"skipped ({it.skip})" if it.skip else f"{e.seconds:.1f} s ({e.source})"))
        return 0
    pr.run()
    if reason is None:  # the run's own wall time, measured like any other figure
        r = pr.result(quick=not args.full, budget_note=BUDGET_NOTE if budget else "")
        wall = r.series_named("total").summary.median
        verdict = (f"{wall:.0f} s of the {budget:.0f} s budget ({'within' if wall <= budget else 'OVER'})"
                   if budget else f"{wall:.0f} s (--full: no budget)")
        _say(f"megabench run: wall {verdict}; estimated {pr.total_estimate():.0f} s; saved {r.save(root)}")
    else:
        _say(f"megabench run: wall {pr.elapsed():.0f} s (without a GPU: not recorded)")
        return _finish(pr)
    rc = _finish(pr)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # every result is saved by now: leave without the interpreter's teardown (microbench.teardown)
        leave(rc)
    return rc


def _say(line: str) -> None:
    print(line, flush=True)


def _xgpu(full: bool) -> None:
    rc = launcher.run(full=full)
    if rc:
        raise RuntimeError(f"torchrun exited with {rc} (the ranks' output above names the failure)")


def _quality(root: Path):
    print(pipeline_step(root))  # the analysis of recorded quality runs: seconds, no GPU


def _tune_cpu(root: Path, args) -> Path:
    out = args.constants_out
    if out is None and not args.write_constants:
        out = Path(tempfile.mkdtemp(prefix="megabench-constants-"))
    return _tune(root, out)


def _tune(root: Path, out_dir: Path | None) -> Path:
    doc, cur, rev, created = tune(root, None, out_dir)
    print(summary(doc, cur, rev, created))
    return cur


def _report(root: Path, out: Path | None) -> Path:
    p = build(root, out)
    print(f"    report: {p}")
    return p


def _finish(pr) -> int:
    if pr.failed:
        names = ", ".join(d.item.key for d in pr.failed)
        print(f"megabench run: {len(pr.failed)} item(s) failed: {names}", file=sys.stderr)
        return 1
    print("megabench run: done")
    return 0
