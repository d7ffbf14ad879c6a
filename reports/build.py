"""Render reports/REPORT.md (GitHub-flavoured markdown) and reports/figures/*.png from results.

Inputs, all JSON already on disk (committed or fresh): megabench results under the results root
(default reports/results), pytest-benchmark JSON under reports/benchmarks, the study's figures
(reports/paper_figures.json) and, for comparison, the committed constants file. Nothing is
measured here, so the report renders on a machine without a GPU and says so at the top.

Layout (the first screen answers "how fast is the megakernel against what, and how sure are we"):
  Summary      the megakernel against every baseline (step time, launches, fraction of roofline),
               one row per overhead class beside the study, a trust box (reports/summary.py)
  1..N         one section per overhead class: its derived values (rules and long notes as
               numbered notes, never repeated per row), the study's figures that have a
               counterpart here, the results' notes, its figures; then the megakernel
  then         what changed since the baseline (the gate), the tuned constants
  Appendices   ablations and A/B runs, timelines and traces, raw series, the study's figures with
               no counterpart here, the gate's quality in detail, environment and commits
No line of the summary, class and megakernel sections is longer than MAX_LINE characters (prose is
wrapped; a table too wide for it is written without padding). A class without results says "not
measured yet" instead of failing. Output is deterministic for the same inputs (no render
timestamp), so a committed report only changes with its data.

Writing is atomic: everything renders into a temporary folder next to the destination, and only
once every input has parsed do REPORT.md and figures/ replace the old ones. A results folder that
does not exist or a malformed result raises ResultsFileError naming the path, and every existing
file stays as it was.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megakernel import critical_path
from megakernel.results_names import TP_WAITS
from microbench import rederive
from microbench.adopt import load_adopted, load_adoption
from microbench.constants import BY_NAME, SPECS, constants_dir, gpu_slug
from microbench.device import no_gpu_reason
from microbench.errors import ResultsFileError
from microbench.fmt import MAX_LINE, Footnotes, fmt, fmt_fraction, fmt_params, fmt_spread, md_escape, md_table, wrap
from microbench.gate import GateConfig, GpuMismatchError, compare, load_measurements
from microbench.gate_quality import report_lines
from microbench.pins import load_pins
from microbench.results import REPO_ROOT, Result, find, load, results_root
from microbench.tune import collect, load_constants

from . import constants_cli, crosscheck, paper, plots, study, summary
from . import megakernel as mk
from .classes import NAMES as CLASSES

CLASS_INFO = {
    "basics": ("Launch overhead and copy bandwidth",
               "The harness's reference figures: what an empty launch costs (host submission, device "
               "back-to-back, CUDA-graph node) and copy bandwidth against the driver's memcpy."),
    "icache": ("Instruction cache",
               "Cycles per instruction against code bytes (each cache level a fitted step), spliced code "
               "blocks, the code a launch brings near the SM, code against data in L2."),
    "weights": ("Weight ring and L2 prefetch",
                "Read ceiling; shared-memory ring depth x stage bytes fed by bulk copies; L2 hit curve and "
                "eviction hints; prefetch into L2; the hot-expert bet."),
    "sync": ("Synchronisation: flags, fences and sentinels",
             "Acquire polls and one-way flags between SMs, polls behind bulk copies, fences idle and "
             "loaded, publishing by fence+flag / release flag / sentinel slots, grid-wide waits."),
    "clocks": ("Clocks, skew and in-kernel profiling",
               "%globaltimer tick and %clock64 rate, SM-to-SM skew and its calibration, launch-to-launch "
               "gaps, and what an in-kernel profiler stamp costs."),
    "xgpu": ("Between GPUs: flags, sentinel collectives, clocks",
             "One process per GPU (`megabench xgpu`, torchrun, NVLink multicast off): one-way flags between SMs of "
             "two GPUs, idle and with bulk copies in flight; sentinel all-reduce / all-gather over peer memory "
             "against NCCL; each GPU's %globaltimer against the host and the other GPUs; how far apart the GPUs "
             "reach common sync stops. Needs a node with 2 or more GPUs."),
}
SPECIAL = ("gate", "model", "megakernel")
# Classes measured outside `megabench bench` (their own launcher) that always get a section, so the
# study's figures for them show even before they are measured.
EXTRA_CLASSES = ("xgpu",)
# One GPU beside several: (quantity, (benchmark, derived key) on one GPU, (benchmark, key) between GPUs)
XGPU_BESIDE = (
    ("one-way flag", ("sync.flags", "flag_latency_s"), ("xgpu.flags", "flag_latency_gpu_to_gpu_s")),
    ("one-way flag, bulk copies in flight (worst case measured)", ("sync.flags", "flag_latency_all_sms_loaded_s"),
     ("xgpu.flags", "flag_latency_gpu_to_gpu_loaded_s")),
    ("flag delay per byte of bulk copies in flight (one GPU: per byte each SM keeps in flight; GPUs: per byte in "
     "flight per GPU, every other SM reading over the link)",
     ("sync.flags", "poll_delay_per_inflight_byte_all_sms_loaded_s"),
     ("xgpu.flags", "poll_delay_per_inflight_byte_gpu_to_gpu_s")),
    ("sync stop (one GPU: per-dependency flag stop; GPUs: wait from arrival to every GPU's flag)",
     ("sync.barriers", "sync_stop_cost_s"), ("xgpu.clocks", "stop_wait_hbm_s")),
    ("skew (one GPU: SM clocks p90-p10; GPUs: arrival spread at stops, p99)", ("clocks.skew", "sm_skew_ns"),
     ("xgpu.clocks", "gpu_drift_s")),
    ("%globaltimer step", ("clocks.timers", "globaltimer_tick_ns"), ("xgpu.clocks", "globaltimer_step_ns")),
)
MAX_SERIES_ROWS = 40
# results whose every series is a comparison point the text refers to (every size x implementation)
SERIES_ROWS = {"xgpu.collectives": 100}
APPENDIX = "## Appendix"  # every heading from the first of these on is an appendix
# megakernel results shown in an appendix instead of the megakernel section
APPENDIX_RESULTS = ("megakernel.ab", "megakernel.timeline_detail")


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


# ----------------------------------------------------------------------------- catalogue
@dataclass
class Catalog:
    root: Path
    gpu: str | None
    runs: dict[str, list[tuple[Path, Result]]]  # benchmark -> runs on `gpu`, oldest first
    other_gpus: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, root: Path | None = None, gpu: str | None = None) -> Catalog:
        """Every result under `root`, parsed (a malformed one raises ResultsFileError naming it)."""
        root = Path(root) if root else results_root()
        if not root.is_dir():
            raise ResultsFileError(f"{root}: no such results folder (pass --results DIR, or set MEGABENCH_RESULTS)")
        allr = [(p, load(p)) for p in find(None, root)]
        gpus = sorted({r.env.gpu for _, r in allr if r.env.gpu})
        if gpu is None:
            # the GPU whose results cover the most benchmarks, the newest among equals: a partial run
            # on another GPU (a few benchmarks) does not turn the whole report over to it
            cover: dict[str, tuple[set, str]] = {}
            for _, r in allr:
                if r.env.gpu and not r.benchmark.startswith("gate."):
                    names, date = cover.setdefault(r.env.gpu, (set(), ""))
                    names.add(r.benchmark)
                    cover[r.env.gpu] = (names, max(date, r.env.date))
            ranked = sorted(cover, key=lambda g: (len(cover[g][0]), cover[g][1]))
            gpu = ranked[-1] if ranked else (gpus[-1] if gpus else None)
        runs: dict[str, list] = {}
        for p, r in allr:
            if r.env.gpu == gpu:
                runs.setdefault(r.benchmark, []).append((p, r))
        return cls(root, gpu, runs, [g for g in gpus if g != gpu])

    def latest(self, bench: str) -> tuple[Path, Result] | None:
        rs = self.runs.get(bench)
        return rs[-1] if rs else None

    def latest_all(self) -> list[Result]:
        return [rs[-1][1] for rs in self.runs.values()]

    def step_sources(self) -> list[Result]:
        """What the step rows come from: the newest result of every benchmark, and the earlier
        megakernel.peer runs and the peer's rows of earlier megakernel.step runs (a run of some
        points only, e.g. `--points small:16:512`, or one without the peer, MEGABENCH_PEER=0, must
        not hide the rows an earlier run has: megakernel.with_fastest_baselines keeps the newest
        row per implementation and configuration, its date and commit shown)."""
        older = [r for _, r in self.runs.get("megakernel.peer", [])[:-1]]
        for _, r in self.runs.get("megakernel.step", [])[:-1]:
            peer = tuple(s for s in r.series if s.params.get("impl") == "peer")
            if peer:
                older.append(dataclasses.replace(r, series=peer, derived={}))
        return self.latest_all() + older

    def of_class(self, cls: str) -> list[tuple[Path, Result]]:
        return [rs[-1] for b, rs in sorted(self.runs.items()) if b.split(".")[0] == cls]

    def classes(self) -> list[str]:
        present = sorted({b.split(".")[0] for b in self.runs} - set(CLASSES) - set(SPECIAL) - set(EXTRA_CLASSES))
        return list(CLASSES) + list(EXTRA_CLASSES) + present

    def envs(self):
        return [r.env for rs in self.runs.values() for _, r in rs if not r.benchmark.startswith("gate.")]


@dataclass
class Context:
    cat: Catalog
    fig_dir: Path
    out_dir: Path
    tune_entries: dict
    tune_error: str | None
    step_rows: list
    timeline: Result | None
    figures: list = field(default_factory=list)
    built: dict = field(default_factory=dict)  # constant -> what the default build renders (built_text)

    def fig_link(self, path: Path, caption: str) -> list[str]:
        rel = Path(path).resolve().relative_to(self.out_dir.resolve())
        return [f"![{md_escape(caption)}]({rel.as_posix()})", "", *wrap(f"*{md_escape(caption)}*"), ""]


# ----------------------------------------------------------------------------- the study beside ours
def paper_value(ctx: Context, f: dict) -> tuple[str, str]:
    """(ours, how ours is obtained) for one of the study's figures; ours is "-" where nothing here
    corresponds to it and "not measured yet" where something would (reports/study.py: the rules,
    pinned constants and values re-derived with the current rule)."""
    ours, how = study._ours(ctx, f)
    for extra in (f.get("note_ours"), f.get("note") if f.get("ours") is not None else None):
        if extra:
            how = (how + "; " if how else "") + extra
    return ours, how


def _paper_rows(ctx: Context, figs: Sequence[dict], notes: Footnotes) -> list[dict]:
    """The study's figures that have a counterpart here (the others are listed in an appendix)."""
    rows = []
    for f in figs:
        if f.get("ours") is None:
            continue

        ours, how = paper_value(ctx, f)
        rows.append({"quantity": f["quantity"], f"study ({paper.setup('gb300')['short']})": paper.value_text(f),
                     f"ours ({ctx.cat.gpu or 'no GPU yet'})": ours, "like for like?": notes.cell(study.like_for_like(f), 60),
                     "how ours is obtained": notes.cell(how, 80)})
    return rows


def _study_table(ctx: Context, figs: Sequence[dict], lead: str) -> list[str]:
    notes = Footnotes("How ours is obtained")
    rows = _paper_rows(ctx, figs, notes)
    if not rows:
        return []
    return [*wrap(lead), "", md_table(rows), "", *notes.lines()]


# ----------------------------------------------------------------------------- derived values
def _derived_rows(results: Sequence[Result], notes: Footnotes, keep=lambda r, k: True) -> list[dict]:
    tuned = {(s.benchmark, s.derived_key): s.name for s in SPECS}
    rows = []
    for r in results:
        redone = rederive.rederived_keys(r)
        for k, d in rederive.derived(r).items():
            if not keep(r, k):
                continue
            t = tuned.get((r.benchmark, k))
            rows.append({"result": f"`{r.benchmark}`", "derived": k + (f" (tuned `{t}`)" if t else "")
                         + (" (re-derived with the current rule)" if k in redone else ""),
                         "value": fmt(d.value, d.unit), "spread": fmt_spread(d.spread, d.unit),
                         "rule": notes.ref(d.rule), "note": notes.cell(d.note, 60)})
    return rows


def _pivot(result: Result, notes: Footnotes, ops: Sequence[str]) -> tuple[list[str], set[str]]:
    """Per-op derived values of one result as one table (rows: ops; columns: what was measured);
    returns (lines, the keys it shows)."""
    cols, table, _ = mk.op_pivot(result.derived, ops)
    if not cols:
        return [], set()

    rows, shown = [], set()
    heads = {}
    for c in cols:
        k0 = next(t[c] for t in table.values() if c in t)
        op0 = next(op for op, t in table.items() if t.get(c) == k0)
        generic = re.sub(r"(?<![A-Za-z0-9])" + re.escape(op0) + r"(?![A-Za-z0-9])", "<op>", result.derived[k0].rule)
        heads[c] = f"{c} {notes.ref(generic)}"
    for op, t in table.items():
        row = {"op": op}
        for c in cols:
            k = t.get(c)
            row[heads[c]] = fmt(result.derived[k].value, result.derived[k].unit) if k else ""
            if k:
                shown.add(k)
        rows.append(row)
    return [md_table(rows), ""], shown


def _ops(result: Result) -> list[str]:
    try:
        from megakernel.plan import OP_KINDS  # heavy: torch (megakernel.plan)

        return list(OP_KINDS)
    except ImportError:  # the report also renders results without the megakernel package
        return sorted({str(s.params["phase"]) for s in result.series if "phase" in s.params
                       and not str(s.params["phase"]).startswith("wait_")})


# ----------------------------------------------------------------------------- sections
def _banner(ctx: Context, gpu_present: bool) -> list[str]:
    cat = ctx.cat
    dates = sorted(e.date for e in cat.envs())
    span = f"{dates[0][:10]} to {dates[-1][:10]}" if dates else "no dates"
    src = _rel(cat.root)
    if not gpu_present:
        lines = [f"> **Rendered without a GPU** from the committed results in `{src}` "
                 f"(measured on {cat.gpu or 'no GPU'}, {span}); nothing was re-measured for this report."]
    else:
        lines = [f"> Rendered on a machine with a GPU from the results in `{src}` (measured on {cat.gpu}, {span})."]
    if cat.other_gpus:
        lines.append(f"> Results for other GPUs exist ({', '.join(cat.other_gpus)}): render them with `--gpu`.")
    return lines


def section_summary(ctx: Context) -> list[str]:
    out = ["## Summary", "", "### The megakernel against every baseline", ""]
    if ctx.step_rows:
        out += [md_table(summary.step_table(ctx.step_rows)), "", *wrap(summary.step_caption(ctx.step_rows)), ""]
        v = summary.study_verify_line(ctx.step_rows)
        if v:
            out += [*wrap(v), ""]
    else:
        out += [f"**Not measured yet** on {ctx.cat.gpu or 'any GPU'}: no step-time series in `model.*` / "
                "`megakernel.*` results.", ""]
    st = paper.setup("gb300")
    out += ["### The overhead classes beside the study", "",
            *wrap(f"One key figure per class, ours ({ctx.cat.gpu or 'not measured'}) beside the study's ({st['hardware']}): "
                  "different hardware, so read them side by side. Every figure of a class is in its section."), "",
            md_table(summary.class_rows(ctx, paper_value)), "", *wrap(summary.FEEDS_CAPTION), "",
            "### How sure we are", ""]
    for line in summary.trust_lines(ctx):
        out += wrap(line, first="- ", rest="  ")
    return out + [""]


def _results_line(results: Sequence[tuple[Path, Result]]) -> list[str]:
    parts = [f"`{r.benchmark}` {r.env.date[:16].replace('T', ' ')}Z, {r.env.git_sha[:7]}"
             f"{' (dirty)' if r.env.git_dirty else ''}, {'quick' if r.quick else 'full'}" for _, r in results]
    return [*wrap("Latest results: " + "; ".join(parts) + ". Raw series: Appendix C."), ""]


def _notes_lines(results: Sequence[tuple[Path, Result]]) -> list[str]:
    out = []
    for _, r in results:
        if r.notes:
            out += [f"Notes of `{r.benchmark}`:", ""]
            for n in r.notes:
                out += wrap(md_escape(n), first="- ", rest="  ")
            out.append("")
    return out


def _byte_marks(r: Result) -> dict[str, float]:
    return {k: d.value for k, d in r.derived.items() if d.unit == "B" and d.value > 0}


def section_class(ctx: Context, cls: str, n: int) -> list[str]:
    title, what = CLASS_INFO.get(cls, (cls, ""))
    out = [f"## {n}. {title} (`{cls}`)", ""]
    if what:
        out += [*wrap(what), ""]
    results = ctx.cat.of_class(cls)
    if not results:
        how = ("Run `megabench xgpu` on a node with 2 or more GPUs (`megabench run` does when it finds them)"
               if cls in EXTRA_CLASSES else f"Run `megabench bench {cls}` on a GPU, or `megabench run`")
        out += [*wrap(f"**Not measured yet** on {ctx.cat.gpu or 'any GPU'}: no `{cls}.*` results under "
                      f"`{_rel(ctx.cat.root)}`. {how}."), ""]
    else:
        out += _results_line(results)
        notes = Footnotes("Rules and notes")
        rows = _derived_rows([r for _, r in results], notes)
        if rows:
            out += ["### Derived values", "", md_table(rows), "", *notes.lines()]
    st = paper.setup("gb300")
    study = _study_table(ctx, paper.figures(cls), f"The study's figures ({st['hardware']}; {st['config']}) beside ours "
                                                  f"({ctx.cat.gpu or 'not measured'}); different hardware, so read "
                                                  "them side by side, never as one series:")
    if study:
        out += ["### The study beside ours", "", *study]
    if cls == "xgpu" and results:
        notes = Footnotes("What each side measures")
        rows = _xgpu_beside_rows(ctx, notes)
        out += [*wrap("One GPU beside several (latest results of each; the machines are named in each result's "
                      "environment):"), "", md_table(rows), "", *notes.lines()]
    out += _notes_lines(results)
    for _, r in results:
        for p, cap in plots.curve_plots(r, cls, ctx.fig_dir, _byte_marks(r)) + plots.hist_plots(r, ctx.fig_dir):
            out += ctx.fig_link(p, cap)
    return out


def _xgpu_beside_rows(ctx: Context, notes: Footnotes) -> list[dict]:
    rows = []
    for what, one, many in XGPU_BESIDE:
        if " (" in what:  # the parenthesis says what each side measures: a note, so the row stays short
            head, tail = what.split(" (", 1)
            what = f"{head} {notes.ref(tail.rstrip(')'))}"
        cells = []
        for bench, key in (one, many):
            got = ctx.cat.latest(bench)
            d = got[1].derived.get(key) if got else None
            if d is None:
                cells.append("not measured")
            else:
                kind = got[1].env.machine_kind or "?"
                cells.append(f"{fmt(d.value, d.unit)} (`{bench}` `{key}`, {kind})")
        rows.append({"quantity": what, "one GPU": cells[0], "between GPUs": cells[1]})
    return rows


def _mk_results(ctx: Context) -> list[tuple[Path, Result]]:
    return [rs[-1] for b, rs in sorted(ctx.cat.runs.items())
            if b.split(".")[0] in ("model", "megakernel") and b not in APPENDIX_RESULTS]


def section_megakernel(ctx: Context, n: int) -> list[str]:
    out = [f"## {n}. The megakernel and its baselines", ""]
    results = _mk_results(ctx)
    main = summary.main_rows(ctx.step_rows)
    if not main:
        out += [f"**Not measured yet** on {ctx.cat.gpu or 'any GPU'}: no step-time series in `model.*` / "
                "`megakernel.*` results (conventions: `reports/megakernel.py`).", ""]
    else:
        out += [*wrap("Step times, launches and fractions of the roofline of every implementation are in the "
                      "Summary; the ablation's builds are in Appendix A."), ""]
        for p, cap in plots.step_bars(main, ctx.fig_dir):
            out += ctx.fig_link(p, cap)
    out += ["### Larger batches", ""]
    curve = mk.batch_curve(ctx.step_rows)
    if curve:
        out += [*wrap("B requests in one step (each its own tree, context and KV cache; the megakernel's each "
                      "bitwise its own B=1 step, the peer's within the reference's bound), the study's claim that "
                      "a megakernel finds larger batches easier as measured: step time and tokens processed per "
                      "second (B x T a step) against the same implementation at B=1, and the fraction of the "
                      "batch's roofline (the union of routed experts, the dense weights once, each request's KV "
                      "reads); the peer (megakernel.peer.BatchPeerRunner) at the B its results hold, and mega's "
                      "speed-up over the chain and the peer at the same B. Past 16 rows the megakernel runs in row "
                      "groups of 16 whose routed experts run once over the union of the groups' routing; "
                      "mega_per_group and chain_per_group run the ablation's build, whose every group streams its own "
                      "experts; "
                      "'expert streams' is how many expert weight streams a layer the build makes (a model from the "
                      "routing, against the roofline's distinct experts)."), "", md_table(curve), ""]
    else:
        out += [*wrap("Not measured yet: no batched step (params batch > 1) in the results. `megabench run --full` "
                      "times B = 2, 4, 8 at T = 1 and the B x T = 16 points (B = 2 T = 8, B = 4 T = 4) against B = 1, "
                      "chain and mega (megakernel/plans.py BATCH_FULL); the study's claim that a megakernel finds "
                      "larger batches easier then shows here as a measured curve."), ""]
    out += _section_decode(ctx)
    out += _section_stress(ctx)
    if results:
        out += _results_line(results)
    st = paper.setup("gb300")
    for group, title in (("headline", "The study's headline"), ("breakdown", "Where the study's 5.9 ms still goes"),
                         ("shape", "The study's megakernel shape"), ("model", "The study's model")):
        study = _study_table(ctx, paper.figures(group=group), f"Study: {st['hardware']}; {st['config']}.")
        if study:
            out += [f"### {title} beside ours", "", *study]
    notes = Footnotes("Rules and notes")
    # the ablation's speed-ups are in Appendix A; a timeline's per-op values in their own table below
    pivots, shown = [], set()
    tl = ctx.timeline
    if tl is not None and tl.benchmark.startswith("megakernel."):
        pivots, shown = _pivot(tl, notes, _ops(tl))
    rows = _derived_rows([r for _, r in results], notes,
                         keep=lambda r, k: "mega+" not in k and not (r is tl and k in shown))
    if rows or pivots:
        out += ["### Derived values", "", md_table(rows), ""]
        if pivots:
            out += [*wrap(f"Per op, from `{tl.benchmark}` (one column per quantity; its rule in the notes, "
                          "`<op>` standing for the row's op):"), "", *pivots]
        out += notes.lines()
    out += _notes_lines(results)
    if tl is not None:
        phases = mk.timeline_phases(tl)
        if phases:
            out += ["### In-kernel timeline", "", *wrap(f"From `{tl.benchmark}` of {tl.env.date[:10]} "
                                                         f"({tl.env.git_sha[:7]}), one launch, per block:"), "",
                    md_table([{"phase": a["phase"], "blocks": a["blocks"], "start (median)": fmt(a["start"], "s"),
                             "end p10": fmt(a["end_p10"], "s"), "end (median)": fmt(a["end"], "s"),
                             "end p90": fmt(a["end_p90"], "s")} for a in phases]), ""]
            for p, cap in plots.timeline_plot(phases, ctx.fig_dir, tl.benchmark):
                out += ctx.fig_link(p, cap)
    else:
        out += ["In-kernel timeline: not measured yet (`megakernel.timeline`).", ""]
    out += section_tp(ctx)
    out += section_critical_path(ctx)
    return out


def _section_decode(ctx: Context) -> list[str]:
    """Speculative decoding on the device (`megabench decode`, megakernel.decode): the GPU runs with
    their acceptance, accepted tokens/s and the step's split beside the study's draft and verify
    halves, and the accepted tokens/s against acceptance figure (measured points, the projection
    of the T=16 step labelled)."""
    rows = mk.decode_rows([r for _, r in ctx.cat.runs.get("megakernel.decode", [])])
    out = ["### Speculative decoding on the device", ""]
    out += [*wrap("A step is three parts, all megakernel launches with nothing read back between steps "
                  "(megakernel/decode.py): the drafter's pass (5 layers over 15 slots, one launch per layer in mega "
                  "mode, the target's embedding and LM head; its rows' tokens from the root and its own successor "
                  "table, which agrees with the target's backbone on a fraction `agree` of the tokens), the target's "
                  "verify of a 16-token tree built on the device from the draft's top-2, and a launch of greedy "
                  "acceptance, KV compaction and the next step's state. The acceptance is measured from the device's "
                  "counts (tokens committed per step, bonus included) and is a property of the synthetic "
                  "draft/target pair: the named 'study' agreement per preset gives 6.6 +- 0.5 of 16 "
                  "(reports/notes/acceptance-calibration.md says how it was reached)."), ""]
    if rows:
        out += [md_table(mk.decode_table(rows)), ""]
        mega = mk.pick_decode(rows, "mega")
        if mega is not None:
            def part(k: str) -> str:
                t, n = mega.metric(f"{k}_s"), mega.metric(f"{k}_launches")
                return "not measured" if t is None else fmt(t, "s") + (
                    f" ({n:g} launch{'' if n == 1 else 'es'})" if n is not None else "")

            side = [{"half": "draft", "study (GB300, TP8)": "1.16 ms (175 kernels) -> 0.44 ms (8)", "ours": part("draft")},
                    {"half": "verify", "study (GB300, TP8)": "10.9 ms (~1,450 kernels) -> 5.3 ms (97)",
                     "ours": part("verify")},
                    {"half": "accept and compaction", "study (GB300, TP8)": "in its 8 draft launches",
                     "ours": part("accept")},
                    {"half": "accepted tokens/s", "study (GB300, TP8)": "517 -> 1,109 tok/s at 6.6 accepted",
                     "ours": f"{fmt(mega.tok_s, 'tok/s')} at {mega.mean:.2f} accepted ({mega.preset}, one GPU, the "
                             "synthetic pair's acceptance)"}]
            out += [*wrap(f"The study's halves beside ours ({mega.preset}, mega mode, {mega.date[:10]} {mega.commit}):"),
                    "", md_table(side), ""]
    else:
        out += [*wrap(f"Not measured yet on {ctx.cat.gpu or 'any GPU'}: no GPU run of `megabench decode` in the results "
                      "(`megabench decode --preset shard8 --tokens 256 --check` saves one; the CPU emulation checks the "
                      "device loop against plain greedy decoding in tests/test_megakernel_spec*.py, with no timing). "
                      "Until then every accepted-tokens rate here is a projection at the study's 6.6, labelled as one."),
                ""]
    curve = mk.acceptance_curve(ctx.step_rows, rows)
    for p, cap in plots.acceptance_plot(curve, ctx.fig_dir):
        out += ctx.fig_link(p, cap)
    return out


def _section_stress(ctx: Context) -> list[str]:
    """The newest twin-engine stress run (megakernel.stress, `megabench mk stress`): its counts."""
    got = ctx.cat.latest("megakernel.stress")
    out = ["### Long decode, mega and chain alternating", ""]
    if got is None:
        return out + [*wrap("Not run yet on a GPU (`megabench mk stress --preset shard8 --steps 2000 --save`: twin "
                            "engines decoding with real routing, one in mega and one in chain mode, swapped every "
                            "step; logits, tokens and KV caches compared bitwise)."), ""]
    r = got[1]
    s = r.series[0]
    m = s.metrics
    verdict = "passed" if not m.get("mismatches") and not m.get("hangs") else "FAILED"
    return out + [*wrap(f"{s.params.get('steps')} decode steps of {s.params.get('preset')} (T=1, real routing), twin "
                        f"engines alternating mega and chain: {m.get('mismatches')} mismatches, {m.get('hangs')} "
                        f"waits that gave up, {m.get('kv_checks')} KV-cache comparisons; {verdict} "
                        f"({r.env.gpu}, {r.env.date[:10]} {r.env.git_sha[:7]})."), ""]


def _critical_path(ctx: Context) -> list[str]:
    """The critical-path model of a megakernel layer (each segment's predicted bound beside its
    measured time): megakernel.critical_path.table over the results folder; prose lines are
    wrapped here, tables kept. Results without the timelines the model reads: said, not hidden."""
    try:
        text = critical_path.table(ctx.cat.root)
    except ResultsFileError as e:
        return [*wrap(f"Not measured yet: {e}."), ""]
    out = []
    for line in text.splitlines():
        out += [line] if line.startswith("|") or not line.strip() else wrap(line)
    return out + [""]


CRITICAL_PATH = "### Critical path of a layer"
# the study's figures the tensor-parallel waits stand beside: (paper_figures id, our quantity, our
# derived key in megakernel.tp_waits)
TP_BESIDE = (("sync.gpu_drift", "skew between ranks at a collective (the largest)", "tp_skew_max_s"),
             ("breakdown.idle_after_gemm2", "stalls at the collectives per layer (the worst rank's median)",
              "tp_stall_per_layer_s"))


def section_tp(ctx: Context) -> list[str]:
    """Tensor parallelism's collectives (megakernel.tp_waits, megakernel/ranks.py) beside the
    study's drift and idle time, or "not measured yet"."""
    out = ["### Tensor parallelism's collectives", ""]
    got = ctx.cat.latest(TP_WAITS)
    figs = {f["id"]: f for f in paper.figures()}
    rows = []
    for fid, what, key in TP_BESIDE:
        d = got[1].derived.get(key) if got else None
        rows.append({"quantity": what, "ours": fmt(d.value, d.unit) if d else "not measured yet",
                     "study": f"{paper.value_text(figs[fid])}: {figs[fid]['quantity']}"})
    out += [md_table(rows), ""]
    if got:
        r = got[1]
        out += wrap(f"From `{TP_WAITS}` of {r.env.date[:10]} ({r.env.git_sha[:7]}): " + "; ".join(r.notes) + ".")
    else:
        out += wrap(f"Not measured yet (`{TP_WAITS}`): `megabench mk step --ranks R --profile --save` on a GPU "
                    "(one GPU: the ranks share its SMs; R GPUs: one process each under torchrun).")
    return out + [""]


def section_critical_path(ctx: Context) -> list[str]:
    """The critical-path block in the megakernel's section, or a pointer to Appendix B when its
    tables are wider than the section's lines may be."""
    block = _critical_path(ctx)
    if max((len(line) for line in block), default=0) <= MAX_LINE:
        return [CRITICAL_PATH, "", *block]
    return [CRITICAL_PATH, "", "Its tables are wider than this section's lines: see Appendix B.", ""]


def section_changes(ctx: Context, bench_dir: Path | None, baseline: Path | None) -> list[str]:
    out = ["## What changed since the baseline", ""]
    cfg = GateConfig()
    comparisons = []
    gpu_key = None
    envs = ctx.cat.envs()
    if envs:
        gpu_key = max(envs, key=lambda e: e.date).gpu_key
    newest = []
    for b, rs in sorted(ctx.cat.runs.items()):
        if b.startswith("gate."):
            continue
        (p_new, r_new) = rs[-1]
        newest += load_measurements(p_new)
        if baseline is None and len(rs) >= 2:  # the run before it, named: not a folder's whole history
            p_old, r_old = rs[-2]
            comparisons.append((f"`{b}`: {_run_name(r_new)} vs the run before it, {_run_name(r_old)}",
                                load_measurements(p_old), load_measurements(p_new)))
    if baseline is not None:
        comparisons = [(f"newest results vs baseline `{_rel(baseline)}`", load_measurements(baseline, gpu_key), newest)]
    elif bench_dir is not None and bench_dir.is_dir() and ctx.cat.gpu:
        files = []
        for p in sorted(bench_dir.glob("*.json")):
            ms = load_measurements(p, gpu_key if f"-{gpu_slug(ctx.cat.gpu)}-" in p.name else None)
            if ms and all(m.gpu_key == gpu_key for m in ms):
                files.append((max(m.date for m in ms), p, ms))
        files.sort(key=lambda t: (t[0], str(t[1])))
        # the newest file against the newest earlier one that has any of its cases (files hold one
        # class each, or all: the file just before a sync run may be a megakernel run)
        if files:
            keys = {m.key for m in files[-1][2]}
            older = [f for f in files[:-1] if keys & {m.key for m in f[2]}]
            if older:
                comparisons.append((f"pytest-benchmark: `{files[-1][1].name}` vs the newest earlier file with any of "
                                    f"its cases, `{older[-1][1].name}`", older[-1][2], files[-1][2]))
    if not comparisons:
        out += [*wrap("Only one run of each benchmark so far on this GPU: nothing to compare yet. "
                      "(`megabench gate BASELINE CANDIDATE` compares any two runs; see docs/COMMANDS.md.)"), ""]
        return out
    rows, lines = [], []
    notes = Footnotes("Why")
    for title, base, cand in comparisons:
        try:
            rep = compare(base, cand, cfg)
        except GpuMismatchError as e:
            lines += wrap(f"{title}: refused ({e})", first="- ", rest="  ")
            continue
        lines += wrap(f"{title}: {rep.summary_line()}", first="- ", rest="  ")
        for r in rep.rows():
            if r["verdict"].lower() not in ("same", "not gated"):
                rows.append({**r, "why": notes.cell(r.get("why"), 40)})
    out += lines + ["", *wrap(f"Rule: {cfg.describe()}."), ""]
    out += [md_table(rows), "", *notes.lines()] if rows else ["Every compared series is the same within its noise.", ""]
    return out


def _run_name(r: Result) -> str:
    return f"{r.env.git_sha[:7]} ({r.env.date[:16].replace('T', ' ')}Z)"


def section_constants(ctx: Context) -> list[str]:
    out = ["## Tuned constants", ""]
    if ctx.tune_error:
        return out + [*wrap(f"**Could not tune from these results:** {ctx.tune_error}"), ""]
    ents = ctx.tune_entries
    defaults = [n for n, e in ents.items() if e.source == "default"]
    if defaults:
        out += [*wrap(f"> **Warning: {len(defaults)} of {len(ents)} constants are conservative defaults, not "
                      f"measurements:** {', '.join(f'`{n}`' for n in defaults)}. The megakernel build runs with them "
                      "(correct, not fast) until their benchmarks report.", rest="> "), ""]
    out += [*wrap("What `megabench tune` derives from these results, each with the current rule (re-derived from the "
                  "recorded samples where a rule changed since the run), pinned constants held at their pin. The "
                  "megakernel build reads an adopted revision, not these (below). Near-ties follow each benchmark's "
                  "stated rule."), ""]
    notes = Footnotes("Rules")
    rows = []
    for n, e in ents.items():
        p = e.provenance
        measured = e.source in ("measured", "pinned")
        pinned = (f"; measured {fmt(p.get('measured_value'), e.spec.unit)}" if e.source == "pinned" else "")
        rows.append({"constant": n, "value": fmt(e.value, e.spec.unit),
                     "source": {"measured": "measured", "pinned": "**pinned**"}.get(e.source, "**default**"),
                     "benchmark": p["benchmark"] + ":" + p["derived_key"],
                     "result": ((f"`{Path(p['result_file']).name}`" if p.get("result_file") else "") + pinned
                                if measured else notes.cell(p.get("reason", ""), 60)),
                     "spread": fmt_spread(p.get("spread"), e.spec.unit),
                     "rule": notes.ref(p["rule"] if measured else "documented default (microbench/constants.py)")})
    out += [md_table(rows), "", *notes.lines()]
    if ctx.cat.gpu:
        cf = constants_dir() / f"{gpu_slug(ctx.cat.gpu)}.json"
        if cf.exists():
            try:
                c = load_constants(cf)
                diff = [n for n, e in ents.items() if getattr(c, n) != e.value]
                out += [*wrap(f"The committed `{_rel(cf)}` (revision {c.revision}) matches." if not diff else
                              f"The committed `{_rel(cf)}` (revision {c.revision}) differs in {', '.join(diff)}: "
                              "run `megabench tune` to record a new revision."), ""]
            except Exception as e:  # shown, not hidden: the report is where a broken file gets noticed
                out += [*wrap(f"**The committed `{_rel(cf)}` is invalid:** {e}"), ""]
        else:
            out += [f"No committed constants file for {ctx.cat.gpu} yet (`megabench tune` writes `{_rel(cf)}`).", ""]
    return out


# ----------------------------------------------------------------------------- appendices
def appendix_ablations(ctx: Context) -> list[str]:
    out = [f"{APPENDIX} A. Ablations and A/B runs", ""]
    abl = [r for r in ctx.step_rows if mk.is_ablation(r.impl)]
    if abl:
        mega = {r.config: r for r in ctx.step_rows if r.impl == "mega"}
        rows = []
        for cfg in sorted({r.config for r in abl}, key=mk.config_rank):
            for r in sorted((x for x in abl if x.config == cfg), key=lambda x: x.impl):
                m = mega.get(cfg)
                rows.append({"configuration": mk.config_label(cfg), "build": r.impl,
                             "step time (IQR)": f"{fmt(r.step_s, 's')} ({r.series.summary.rel_iqr:.1%})",
                             "vs mega": f"{r.step_s / m.step_s - 1:+.1%}" if m else "",
                             "of roofline": f"{r.roofline_fraction:.1%}" if r.roofline_fraction else "",
                             "launches": "" if r.launches is None else str(r.launches),
                             "measured": f"{r.date[:10]} {r.commit}"})
        out += [*wrap("The megakernel with its techniques switched off one at a time (`all_but_<t>`), on one at a "
                      "time (`only_<t>`), all (`all`), none (`none`); `vs mega` against the default build of the same "
                      "run."), "", md_table(rows), ""]
    got = ctx.cat.latest("megakernel.ab")
    if got is not None:
        path, r = got
        first = {}
        rows = []
        for s in r.series:
            p = s.params
            point = f"{p.get('preset')} T={p.get('T')} ctx={p.get('ctx')}"
            first.setdefault(point, s)
            key = f"change_{p.get('preset')}_T{p.get('T')}_ctx{p.get('ctx')}_{p.get('variant')}"
            d = r.derived.get(key)
            rows.append({"point": point, "variant": p.get("variant"), "switches": str(p.get("switches") or ""),
                         "median of rounds": fmt(s.summary.median, s.unit),
                         "change": f"{d.value:+.2%}" if d else "", "same bits as first": p.get("same_bits_as_first", "")})
        n_ab = len(ctx.cat.runs.get("megakernel.ab", []))
        out += ["### The latest in-run A/B", "",
                *wrap(f"`{path.name}` ({r.env.date[:16].replace('T', ' ')}Z, {r.env.git_sha[:7]}); "
                      f"{n_ab} A/B result(s) in the results folder; the notes of each A/B are "
                      "`reports/results/megakernel/ab-*.md`, indexed by `reports/LEVERS.md`."), "",
                md_table(rows), ""]
    if len(out) == 2:
        out += ["No ablation or A/B results yet.", ""]
    return out


def appendix_timelines(ctx: Context) -> list[str]:
    out = [f"{APPENDIX} B. Timelines and traces", ""]
    got = ctx.cat.latest("megakernel.timeline_detail")
    if got is not None:
        path, r = got
        notes = Footnotes("Rules")
        pivots, shown = _pivot(r, notes, _ops(r))
        rows = _derived_rows([r], notes, keep=lambda _, k: k not in shown)
        phases = mk.timeline_phases(r)
        out += [f"### `{r.benchmark}`", "",
                *wrap(f"The profiler's detail build (every sub-phase stamped): `{path.name}`, "
                      f"{r.env.date[:16].replace('T', ' ')}Z, {r.env.git_sha[:7]}. Its per-op values:"), "",
                *pivots, md_table(rows), "", *notes.lines()]
        if phases:
            out += ["Its phases, per block:", "",
                    md_table([{"phase": a["phase"], "blocks": a["blocks"], "start (median)": fmt(a["start"], "s"),
                             "end (median)": fmt(a["end"], "s"), "end p90": fmt(a["end_p90"], "s")} for a in phases]), ""]
        out += _notes_lines([got])
    block = _critical_path(ctx)
    if max((len(line) for line in block), default=0) > MAX_LINE:
        out += [CRITICAL_PATH, "", *block]
    traces = sorted(p for p in ctx.cat.root.rglob("*") if p.is_file() and (
        ".trace." in p.name or p.name.startswith("ncu-") or p.name.endswith(".png")))
    if traces:
        out += ["### Traces and profiles in the results folder", "",
                *wrap("Perfetto traces (open in ui.perfetto.dev), their plots and Nsight Compute dumps; the retention "
                      "rule (`megabench prune-results`) keeps the newest of each kind and every one a note names."), ""]
        out += [f"- `{_rel(p)}` ({fmt(p.stat().st_size, 'B')})" for p in traces] + [""]
    if len(out) == 2:
        out += ["No timelines yet.", ""]
    return out


def _row_limit(r: Result) -> int:
    return SERIES_ROWS.get(r.benchmark, MAX_SERIES_ROWS)


def _series_rows(r: Result, skip=lambda s: False) -> tuple[list[dict], list[str], int]:
    rows, sources = [], []
    ss = [s for s in r.series if not skip(s)]
    any_warn = any(s.warnings for s in ss)
    for s in ss[:_row_limit(r)]:
        b = s.bound
        btxt = ""
        if b is not None:
            if b.source not in sources:
                sources.append(b.source)
            btxt = f"{b.kind} {fmt(b.value, b.unit)} [{sources.index(b.source) + 1}]"
        row = {"series": s.name, "params": fmt_params(s.params), "n": s.summary.n,
               "median": fmt(s.summary.median, s.unit),
               "IQR": f"{fmt(s.summary.iqr, s.unit)} ({s.summary.rel_iqr:.1%})" if s.summary.median else fmt(s.summary.iqr, s.unit),
               "timer": s.timer, "bound": btxt,
               "achieved": fmt(s.achieved, b.unit) if (b is not None and s.achieved is not None) else "",
               "fraction of bound": fmt_fraction(s)}
        if any_warn:
            row["warnings"] = "; ".join(s.warnings)
        rows.append(row)
    return rows, sources, max(0, len(ss) - _row_limit(r))


def _shown_elsewhere(r: Result, s) -> bool:
    """Series the report already shows: step times (summary, Appendix A), timeline phases."""
    if r.benchmark.split(".")[0] not in ("model", "megakernel"):
        return False
    step = "impl" in s.params and s.unit == "s" and s.timer != "static"
    return step or ("phase" in s.params and "edge" in s.params)


def appendix_series(ctx: Context) -> list[str]:
    out = [f"{APPENDIX} C. Raw series", "",
           *wrap("Every series of the latest result of each benchmark (up to the first "
                 f"{MAX_SERIES_ROWS}; the rest are in the JSON file) with its sample count, median, IQR, timer and "
                 "bound. Step times and timeline phases are not repeated here."), ""]
    classes = [c for c in ctx.cat.classes() if c not in SPECIAL] + ["model", "megakernel"]
    shown = []
    for cls in classes:
        for path, r in ctx.cat.of_class(cls):
            if r.benchmark.startswith("gate."):
                continue
            rows, sources, more = _series_rows(r, skip=lambda s: _shown_elsewhere(r, s))
            if not rows:
                shown.append(f"`{r.benchmark}` (`{_rel(path)}`)")
                continue
            e = r.env
            out += [f"### `{r.benchmark}`", "",
                    *wrap(f"Measured {e.date} on {e.gpu} ({'quick' if r.quick else 'full'} sweep), commit "
                          f"`{e.git_sha[:7]}`{' (dirty)' if e.git_dirty else ''}; file `{_rel(path)}`."), "",
                    md_table(rows), ""]
            if more:
                out += [f"({more} more series in the JSON file.)", ""]
            if sources:
                out += wrap("Bounds: " + "; ".join(f"[{i + 1}] {md_escape(s)}" for i, s in enumerate(sources)) + ".")
                out.append("")
    if shown:
        out += [*wrap("Shown in full above (summary, the megakernel's section, Appendix A or B): "
                      + ", ".join(shown) + "."), ""]
    return out


def appendix_no_counterpart(ctx: Context) -> list[str]:
    figs = [f for f in paper.load()["figures"] if f.get("ours") is None]
    out = [f"{APPENDIX} D. The study's figures with no counterpart here", ""]
    if not figs:
        return out + ["Every figure of the study has a counterpart here.", ""]
    out += [*wrap(f"{len(figs)} figures of the study ({paper.setup('gb300')['hardware']} unless named) that nothing "
                  "here measures: its draft model, its model's shape, its megakernel's warp layout, its hosted "
                  "endpoint."), ""]
    for f in figs:
        out += wrap(f"`{f['id']}`: {f['quantity']}: {paper.value_text(f)}" + (f" ({f['note']})" if f.get("note") else ""),
                    first="- ", rest="  ")
    return out + [""]


def appendix_quality(ctx: Context) -> list[str]:
    """The gate's measured false-alarm and detection rates (microbench/gate_quality.py owns the text)."""
    return report_lines(ctx.cat.root, heading=f"{APPENDIX} E. How much to trust the gate")


def appendix_environment(ctx: Context) -> list[str]:
    envs = ctx.cat.envs()
    out = [f"{APPENDIX} F. Environment and commits", ""]
    if not envs:
        return out + ["No results yet: nothing was measured on any GPU.", ""]
    e = max(envs, key=lambda x: x.date)

    def vals(attr):
        return sorted({str(getattr(x, attr)) for x in envs if getattr(x, attr) is not None})

    clocks = [v for rs in ctx.cat.runs.values() for _, r in rs for s in r.series
              for k, v in s.clocks.items() if k in ("sm_mhz_before", "sm_mhz_after") and v]
    rows = [
        {"": "GPU", "value": f"{e.gpu} (compute capability {e.cc}, {e.sm_count} SMs, L2 {fmt(e.l2_bytes, 'B')})"},
        {"": "max clocks", "value": f"SM {e.sm_clock_max_mhz} MHz, memory {e.mem_clock_max_mhz} MHz"},
        {"": "SM clock during the series",
         "value": (f"{min(clocks):.0f}-{max(clocks):.0f} MHz (NVML, before/after each series)" if clocks
                   else "not recorded")},
        {"": "driver", "value": ", ".join(vals("driver"))},
        {"": "compiler", "value": "NVRTC " + ", ".join(vals("nvrtc")) + "; cuda-core " + ", ".join(vals("cuda_core"))},
        {"": "torch / Python", "value": ", ".join(vals("torch")) + " / " + ", ".join(vals("python"))},
        {"": "measured", "value": f"{min(x.date for x in envs)} to {max(x.date for x in envs)}"},
        {"": "machine", "value": ", ".join(sorted({f"{x.machine_kind or '?'} ({x.host})" for x in envs}))},
        {"": "baseline key", "value": f"`{e.gpu_key}` (gate baselines are per GPU model and max SM clock)"},
    ]
    commits = sorted({x.git_sha[:7] + (" (dirty)" if x.git_dirty else "") for x in envs})
    out += [md_table(rows), "", *wrap(f"Commits of the results ({len(commits)}): " + ", ".join(commits) + "."), ""]
    return out


# ----------------------------------------------------------------------------- driver
def render(ctx: Context, gpu_present: bool, bench_dir: Path | None, baseline: Path | None) -> str:
    cat = ctx.cat
    head = [f"# megabench report{(': ' + cat.gpu) if cat.gpu else ''}", ""]
    head += _banner(ctx, gpu_present) + [""]
    head += section_summary(ctx)
    body = []
    n = 1
    for cls in (c for c in cat.classes() if c not in SPECIAL):  # model.* belongs to the megakernel's section
        body += section_class(ctx, cls, n)
        n += 1
    body += section_megakernel(ctx, n)
    body += section_changes(ctx, bench_dir, baseline)

    body += crosscheck.section(ctx)
    body += section_constants(ctx) + crosscheck.adoption_lines(ctx)
    body += appendix_ablations(ctx) + appendix_timelines(ctx) + appendix_series(ctx)
    body += appendix_no_counterpart(ctx) + appendix_quality(ctx) + appendix_environment(ctx)
    toc = [f"- [{h.lstrip('#').strip()}](#{_anchor(h)})" for h in body if h.startswith("## ")]
    intro = wrap("Generated by `megabench report` (or `python -m reports`) from typed results; every figure names "
                 "its timer, its physical bound and the share of it achieved. The study's numbers are from "
                 f"{paper.setup('gb300')['hardware']} and appear beside ours, labelled, never mixed.")
    return "\n".join(head + ["## Contents", ""] + toc + ["", *intro, ""] + body).rstrip() + "\n"


def build(root: Path | None = None, out_dir: Path | None = None, bench_dir: Path | None = None,
          baseline: Path | None = None, gpu: str | None = None, gpu_present: bool | None = None) -> Path:
    """Render the report atomically; returns the path of REPORT.md. Raises ResultsFileError (naming
    the path) on a missing results/benchmarks/baseline path or a malformed input, before anything
    under `out_dir` changes."""
    out_dir = Path(out_dir) if out_dir else REPO_ROOT / "reports"
    if bench_dir is not None and not Path(bench_dir).is_dir():
        raise ResultsFileError(f"{bench_dir}: no such pytest-benchmark folder (--benchmarks)")
    if baseline is not None and not Path(baseline).exists():
        raise ResultsFileError(f"{baseline}: no such baseline file or folder (--baseline)")
    bench_dir = Path(bench_dir) if bench_dir else REPO_ROOT / "reports" / "benchmarks"
    if gpu_present is None:
        gpu_present = no_gpu_reason() is None
    cat = Catalog.load(root, gpu)  # parses every result: a bad one stops here, nothing written yet
    if gpu is not None and cat.gpu != gpu:
        raise ResultsFileError(f"{cat.root}: no results for GPU {gpu!r} (there are: {', '.join(cat.other_gpus) or 'none'})")
    tune_err = None
    try:
        _, entries = collect(cat.root, cat.gpu, pins=load_pins(cat.gpu))
    except Exception as e:
        entries, tune_err = {}, str(e)
    tl = cat.latest("megakernel.timeline")
    timeline = tl[1] if tl else next((r for r in sorted(cat.latest_all(), key=lambda r: r.benchmark)
                                      if any("phase" in s.params and "edge" in s.params for s in r.series)), None)
    baseline_runs = [r for b, rs in cat.runs.items() if b.startswith("model.") for _, r in rs]
    rows = mk.with_fastest_baselines(mk.step_rows(cat.step_sources()), baseline_runs)
    anchor = next(p for p in (out_dir, *out_dir.parents) if p.is_dir())  # nearest existing folder
    stage = Path(tempfile.mkdtemp(prefix=".report-", dir=anchor))
    try:
        ctx = Context(cat, stage / "figures", stage, entries, tune_err, rows, timeline, built=built_text(cat))
        ctx.fig_dir.mkdir()
        text = render(ctx, gpu_present, bench_dir, baseline)
        _validate(text, stage)
        (stage / "REPORT.md").write_text(text)
        _commit(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out_dir / "REPORT.md"


def _validate(text: str, stage: Path) -> None:
    """Every figure the text links exists in the staged folder."""
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        if not (stage / link).is_file():
            raise ResultsFileError(f"report: figure {link} is linked but was not written")


def _commit(stage: Path, out_dir: Path) -> None:
    """Replace out_dir/figures and out_dir/REPORT.md by the staged ones (renames on one file system).
    Files in the old figures folder that the report does not write (anything but *.png) move over."""
    out_dir.mkdir(parents=True, exist_ok=True)
    new_figs, figs = stage / "figures", out_dir / "figures"
    old = None
    if figs.exists():
        for p in figs.iterdir():
            if not p.name.endswith(".png"):
                os.replace(p, new_figs / p.name)
        old = stage / "old-figures"
        os.replace(figs, old)
    os.replace(new_figs, figs)
    os.replace(stage / "REPORT.md", out_dir / "REPORT.md")


def _anchor(h: str) -> str:
    t = h.lstrip("#").strip().lower()
    t = re.sub(r"[^\w\- ]", "", t)
    return t.replace(" ", "-")


def built_text(cat: Catalog) -> dict[str, str]:
    """{constant: what the default build renders from the adopted revision, as text} for the
    constants that feed the build (reports/constants_cli.py), planned for the SMs of the newest
    megakernel.build result's GPU and shown at the headline preset (shard8); {} without an adoption
    or such a result."""
    got = cat.latest("megakernel.build")
    if not cat.gpu or got is None or not got[1].env.sm_count or load_adoption(cat.gpu) is None:
        return {}
    vals = constants_cli.build_values(load_adopted(cat.gpu), got[1].env.sm_count)
    return {n: constants_cli.value_text(v["shard8"], BY_NAME[n].unit) for n, v in vals.items()}


def readme_block(root: Path | None = None, gpu: str | None = None) -> str:
    """The README's headline block (reports/summary.py), from the same rows as the report's summary."""
    cat = Catalog.load(root, gpu)
    try:
        _, entries = collect(cat.root, cat.gpu, pins=load_pins(cat.gpu))
    except Exception:
        entries = {}
    baseline_runs = [r for b, rs in cat.runs.items() if b.startswith("model.") for _, r in rs]
    rows = mk.with_fastest_baselines(mk.step_rows(cat.step_sources()), baseline_runs)
    tl = cat.latest("megakernel.timeline")
    ctx = Context(cat, Path("."), Path("."), entries, None, rows, tl[1] if tl else None, built=built_text(cat))
    return summary.readme_block(ctx, paper_value, md_table)
