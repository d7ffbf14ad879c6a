"""Render reports/REPORT.md (GitHub-flavoured markdown) and reports/figures/*.png from results.

Inputs, all JSON already on disk (committed or fresh): megabench results under the results root
(default reports/results), pytest-benchmark JSON under reports/benchmarks, the study's figures
(reports/paper_figures.json) and, for comparison, the committed constants file. Nothing is
measured here, so the report renders on a machine without a GPU and says so at the top.

Sections: environment; one per overhead class (series with bound/achieved/fraction, derived
constants with spread and rule, the study's GB300 figures beside ours, plots); the megakernel
(step time, tokens/s, ratio, launches, roofline fraction, timeline); what changed since the
baseline (the gate); the gate's measured quality; the tuned constants with provenance.
A class without results says "not measured yet" instead of failing. Output is deterministic
for the same inputs (no render timestamp), so a committed report only changes with its data.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from microbench.results import REPO_ROOT, Result, find, load, results_root

from . import megakernel as mk
from . import paper, plots
from .fmt import fmt, fmt_params, fmt_range, fmt_spread, md_escape

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


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def _table(rows: Sequence[dict]) -> str:
    import pandas as pd

    if not rows:
        return ""
    df = pd.DataFrame([{k: md_escape(v) if isinstance(v, str) else v for k, v in r.items()} for r in rows])
    return df.to_markdown(index=False, tablefmt="github")


# ----------------------------------------------------------------------------- catalogue
@dataclass
class Catalog:
    root: Path
    gpu: str | None
    runs: dict[str, list[tuple[Path, Result]]]  # benchmark -> runs on `gpu`, oldest first
    other_gpus: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, root: Path | None = None, gpu: str | None = None) -> Catalog:
        root = Path(root) if root else results_root()
        allr = [(p, load(p)) for p in find(None, root)] if root.is_dir() else []
        gpus = sorted({r.env.gpu for _, r in allr if r.env.gpu})
        if gpu is None:
            dated = sorted((r.env.date, r.env.gpu) for _, r in allr if r.env.gpu and not r.benchmark.startswith("gate."))
            gpu = dated[-1][1] if dated else (gpus[-1] if gpus else None)
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

    def of_class(self, cls: str) -> list[tuple[Path, Result]]:
        return [rs[-1] for b, rs in sorted(self.runs.items()) if b.split(".")[0] == cls]

    def classes(self) -> list[str]:
        from microbench.registry import CLASSES

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

    def fig_link(self, path: Path, caption: str) -> str:
        rel = Path(path).resolve().relative_to(self.out_dir.resolve())
        return f"![{md_escape(caption)}]({rel.as_posix()})\n\n*{caption}*"


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
    defaults = [n for n, e in ctx.tune_entries.items() if e.source == "default"]
    if defaults:
        lines.append(f"> **Warning:** {len(defaults)} of {len(ctx.tune_entries)} tuned constants are conservative "
                     f"defaults, not measurements (see [Tuned constants](#tuned-constants)).")
    return lines


def section_environment(ctx: Context) -> list[str]:
    envs = ctx.cat.envs()
    if not envs:
        return ["## Environment", "", "No results yet: nothing was measured on any GPU.", ""]
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
        {"": "commits", "value": ", ".join(sorted({x.git_sha[:7] + (" (dirty)" if x.git_dirty else "") for x in envs}))},
        {"": "machine", "value": ", ".join(sorted({f"{x.machine_kind or '?'} ({x.host})" for x in envs}))},
        {"": "baseline key", "value": f"`{e.gpu_key}` (gate baselines are per GPU model and max SM clock)"},
    ]
    return ["## Environment", "", _table(rows), ""]


def _paper_rows(ctx: Context, figs: Sequence[dict]) -> list[dict]:
    rows = []
    latest = ctx.cat.latest_all()
    for f in figs:
        st = paper.setup(f["setup"])
        theirs = fmt(f["value"], f["unit"]) if "value" in f else fmt_range(f["low"], f["high"], f["unit"])
        if f["setup"] != "gb300":
            theirs += f" ({st['short']})"
        ours, how = "not measured yet", ""
        o = f.get("ours")
        if o is None:
            ours, how = "-", f.get("note", "no counterpart measured here")
        elif o["kind"] == "constant":
            e = ctx.tune_entries.get(o["name"])
            if e is not None and e.source == "measured":
                sp = e.provenance.get("spread")
                ours = fmt(e.value, e.spec.unit) + (f" ({fmt_spread(sp, e.spec.unit)})" if sp else "")
                how = f"tuned `{o['name']}` from `{e.spec.benchmark}`"
            else:
                how = f"tuned `{o['name']}` (default {fmt(e.value, e.spec.unit)} until measured)" if e else o["name"]
        elif o["kind"] == "derived":
            import re

            found = []
            for r in latest:
                if o.get("benchmark") is not None and r.benchmark != o["benchmark"]:
                    continue
                for k in sorted(r.derived):
                    if k == o["key"] or (o.get("key_regex") and re.fullmatch(o["key_regex"], k)):
                        found.append((k != o["key"], k, r))
            if found:
                _, k, r = min(found, key=lambda t: (t[0], t[1]))  # the exact key first, else the first match
                d = r.derived[k]
                unit = o.get("unit") or ("fraction" if f["unit"] in ("fraction", "x") and d.unit in ("", "fraction")
                                         and f["unit"] == "fraction" else ("x" if f["unit"] == "x" and d.unit == ""
                                                                           else d.unit))
                ours = fmt(d.value, unit) + (f" ({fmt_spread(d.spread, unit)})" if d.spread else "")
                how = f"`{r.benchmark}` derived `{k}`"
            else:
                what = o["key"] if not o.get("key_regex") else f"{o['key']}` or `{o['key_regex']}"
                how = f"expects derived `{what}`" + (f" in `{o['benchmark']}`" if o.get("benchmark") else "")
            if o.get("unit") or f.get("note_ours"):
                how += f"; {f['note_ours']}" if f.get("note_ours") else ""
        elif o["kind"] == "env":
            envs = ctx.cat.envs()
            if envs:
                e = max(envs, key=lambda x: x.date)
                v = getattr(e, o["field"], None)
                if v is not None:
                    ours, how = fmt(v, f["unit"]), f"driver attribute `{o['field']}`"
        elif o["kind"] == "megakernel":
            got = mk.figure_value(ctx.step_rows, ctx.timeline, o)
            if got:
                ours, how = fmt(got[0], got[1]), got[2]
            else:
                how = f"from model.* / megakernel.* results ({o['metric']})"
        if f.get("note") and o is not None:
            how = (how + "; " if how else "") + f["note"]
        rows.append({"quantity": f["quantity"], f"study ({paper.setup('gb300')['short']})": theirs,
                     f"ours ({ctx.cat.gpu or 'no GPU yet'})": ours, "how ours is obtained": how})
    return rows


def _row_limit(r: Result) -> int:
    return SERIES_ROWS.get(r.benchmark, MAX_SERIES_ROWS)


def _series_rows(r: Result) -> tuple[list[dict], list[str]]:
    rows, sources = [], []
    any_warn = any(s.warnings for s in r.series)
    for s in r.series[:_row_limit(r)]:
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
               "fraction of bound": f"{s.fraction_of_bound:.1%}" if s.fraction_of_bound is not None else ""}
        if any_warn:
            row["warnings"] = "; ".join(s.warnings)
        rows.append(row)
    return rows, sources


def _derived_rows(r: Result) -> list[dict]:
    from microbench.constants import SPECS

    tuned = {(s.benchmark, s.derived_key): s.name for s in SPECS}
    rows = []
    for k, d in r.derived.items():
        t = tuned.get((r.benchmark, k))
        rows.append({"derived": k + (f" (tuned `{t}`)" if t else ""), "value": fmt(d.value, d.unit),
                     "spread": fmt_spread(d.spread, d.unit), "rule": d.rule,
                     "from": ", ".join(d.inputs[:4]) + (" ..." if len(d.inputs) > 4 else ""), "note": d.note})
    return rows


def _byte_marks(r: Result) -> dict[str, float]:
    return {k: d.value for k, d in r.derived.items() if d.unit == "B" and d.value > 0}


def _result_block(ctx: Context, cls: str, path: Path, r: Result, level: str = "###", plot: bool = True) -> list[str]:
    e = r.env
    out = [f"{level} `{r.benchmark}`", "",
           f"Measured {e.date} on {e.gpu} ({'quick' if r.quick else 'full'} sweep), commit `{e.git_sha[:7]}`"
           f"{' (dirty)' if e.git_dirty else ''}; file `{_rel(path)}`.", ""]
    rows, sources = _series_rows(r)
    out += [_table(rows), ""]
    if len(r.series) > _row_limit(r):
        out += [f"({len(r.series) - _row_limit(r)} more series in the JSON file.)", ""]
    if sources:
        out += ["Bounds: " + "; ".join(f"[{i + 1}] {md_escape(s)}" for i, s in enumerate(sources)) + ".", ""]
    if r.derived:
        out += [_table(_derived_rows(r)), ""]
    for note in r.notes:
        out += [f"Note: {note}", ""]
    figs = (plots.curve_plots(r, cls, ctx.fig_dir, _byte_marks(r)) + plots.hist_plots(r, ctx.fig_dir)) if plot else []
    for p, cap in figs:
        out += [ctx.fig_link(p, cap), ""]
    return out


def section_class(ctx: Context, cls: str, n: int) -> list[str]:
    title, what = CLASS_INFO.get(cls, (cls, ""))
    out = [f"## {n}. {title} (`{cls}`)", ""]
    if what:
        out += [what, ""]
    figs = paper.figures(cls)
    results = ctx.cat.of_class(cls)
    if not results:
        how = ("Run `megabench xgpu` on a node with 2 or more GPUs (`megabench run` does when it finds them)"
               if cls in EXTRA_CLASSES else f"Run `megabench bench {cls}` on a GPU, or `megabench run`")
        out += [f"**Not measured yet** on {ctx.cat.gpu or 'any GPU'}: no `{cls}.*` results under "
                f"`{_rel(ctx.cat.root)}`. {how}.", ""]
    if figs:
        st = paper.setup("gb300")
        out += [f"The study's figures ({st['hardware']}; {st['config']}) beside ours ({ctx.cat.gpu or 'not measured'}); "
                "different hardware, so read them side by side, never as one series:", "",
                _table(_paper_rows(ctx, figs)), ""]
    if cls == "xgpu" and results:
        out += ["One GPU beside several (latest results of each; the machines are named in each result's "
                "environment):", "", _table(_xgpu_beside_rows(ctx)), ""]
    for path, r in results:
        out += _result_block(ctx, cls, path, r)
    return out


def _xgpu_beside_rows(ctx: Context) -> list[dict]:
    rows = []
    for what, one, many in XGPU_BESIDE:
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


def section_megakernel(ctx: Context, n: int) -> list[str]:
    out = [f"## {n}. The megakernel and its baselines", ""]
    rows = ctx.step_rows
    mk_results = [(p, r) for b, rs in sorted(ctx.cat.runs.items()) for p, r in rs[-1:]
                  if b.split(".")[0] in ("model", "megakernel")]
    if not rows:
        out += [f"**Not measured yet** on {ctx.cat.gpu or 'any GPU'}: no step-time series in `model.*` / "
                "`megakernel.*` results (conventions: `reports/megakernel.py`).", ""]
    else:
        by_cfg: dict[tuple, list] = {}
        for r in rows:
            by_cfg.setdefault(r.config, []).append(r)
        table = []
        yields_measured = all(r.tokens_per_step[1] for r in rows)
        for cfg in sorted(by_cfg):
            rs = sorted(by_cfg[cfg], key=lambda r: (r.is_mega, r.impl))
            megas = [r for r in rs if r.is_mega]
            best_mega = min(megas, key=lambda r: r.step_s) if megas else None
            for r in rs:
                table.append({
                    "impl": r.impl, "preset": r.preset, "T": r.tokens, "context": r.context, "batch": r.batch,
                    "routing": r.routing,
                    "step time (median)": fmt(r.step_s, "s"),
                    "IQR": f"{r.series.summary.rel_iqr:.1%}",
                    "tokens/s": f"{r.tokens_per_s:,.0f}" + ("" if r.tokens_per_step[1] else "*"),
                    "launches/step": "" if r.launches is None else str(r.launches),
                    "roofline": fmt(r.roofline_s, "s") if r.roofline_s else "",
                    "fraction of roofline": f"{r.roofline_fraction:.1%}" if r.roofline_fraction else "",
                    "megakernel speed-up": (f"{r.step_s / best_mega.step_s:.2f}x" if best_mega and not r.is_mega
                                            else ""),
                    "run": r.commit,
                })
        out += [_table(table), ""]
        if not yields_measured:
            out += ["\\* tokens processed per second (T x batch / step time), not accepted tokens: the series "
                    "carry no measured `tokens_per_step`.", ""]
        out += ["Speed-up = this implementation's step time / the fastest megakernel variant's at the same "
                "configuration. Roofline = bytes the step must touch / the measured read ceiling. Megakernel "
                "rows are the latest run's; each torch baseline row is its fastest committed run at that "
                "configuration (`run`: the commit that measured it), so no slower later run of a baseline "
                "inflates a speed-up.", ""]
        for p, cap in plots.step_bars(rows, ctx.fig_dir):
            out += [ctx.fig_link(p, cap), ""]
    if ctx.timeline is not None:
        phases = mk.timeline_phases(ctx.timeline)
        if phases:
            out += ["### In-kernel timeline", "",
                    _table([{"phase": a["phase"], "blocks": a["blocks"], "start (median)": fmt(a["start"], "s"),
                             "end p10": fmt(a["end_p10"], "s"), "end (median)": fmt(a["end"], "s"),
                             "end p90": fmt(a["end_p90"], "s")} for a in phases]), ""]
            for p, cap in plots.timeline_plot(phases, ctx.fig_dir, ctx.timeline.benchmark):
                out += [ctx.fig_link(p, cap), ""]
    else:
        out += ["In-kernel timeline: not measured yet (`megakernel.timeline`).", ""]
    st = paper.setup("gb300")
    for group, title in (("headline", "The study's headline"), ("breakdown", "Where the study's 5.9 ms still goes"),
                         ("shape", "The study's megakernel shape"), ("model", "The study's model")):
        figs = paper.figures(group=group)
        if figs:
            out += [f"### {title} ({st['short']}) beside ours", "", _table(_paper_rows(ctx, figs)), ""]
    for path, r in mk_results:
        out += _result_block(ctx, r.benchmark.split(".")[0], path, r, level="###", plot=False)  # own figures above
    return out


def section_changes(ctx: Context, bench_dir: Path | None, baseline: Path | None) -> list[str]:
    from microbench.gate import GateConfig, GpuMismatchError, compare, load_measurements

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
        p_new = rs[-1][0]
        newest += load_measurements(p_new)
        if baseline is None and len(rs) >= 2:
            prev = [m for p, _ in rs[:-1] for m in load_measurements(p)]
            comparisons.append((f"`{b}`: newest run vs {len(rs) - 1} earlier run(s)", prev, load_measurements(p_new)))
    if baseline is not None:
        comparisons = [(f"newest results vs baseline `{_rel(baseline)}`", load_measurements(baseline, gpu_key), newest)]
    elif bench_dir is not None and bench_dir.is_dir() and ctx.cat.gpu:
        from microbench.tune import gpu_slug

        files = []
        for p in sorted(bench_dir.glob("*.json")):
            ms = load_measurements(p, gpu_key if f"-{gpu_slug(ctx.cat.gpu)}-" in p.name else None)
            if ms and all(m.gpu_key == gpu_key for m in ms):
                files.append((max(m.date for m in ms), p, ms))
        files.sort(key=lambda t: (t[0], str(t[1])))
        if len(files) >= 2:
            comparisons.append((f"pytest-benchmark: `{files[-1][1].name}` vs {len(files) - 1} earlier file(s)",
                                [m for _, _, ms in files[:-1] for m in ms], files[-1][2]))
    if not comparisons:
        out += ["Only one run of each benchmark so far on this GPU: nothing to compare yet. "
                "(`megabench gate BASELINE CANDIDATE` compares any two runs; see README.)", ""]
        return out
    rows, lines = [], []
    for title, base, cand in comparisons:
        try:
            rep = compare(base, cand, cfg)
        except GpuMismatchError as e:
            lines.append(f"- {title}: refused ({e})")
            continue
        lines.append(f"- {title}: {rep.summary_line()}")
        rows += [r for r in rep.rows() if r["verdict"].lower() not in ("same", "not gated")]
    out += lines + ["", f"Rule: {cfg.describe()}.", ""]
    out += [_table(rows), ""] if rows else ["Every compared series is the same within its noise.", ""]
    return out


def section_quality(ctx: Context) -> list[str]:
    out = ["## How much to trust the gate", ""]
    got = ctx.cat.latest("gate.quality")
    if got is None:
        return out + ["Not computed yet for this GPU: run `megabench gate --quality --save`.", ""]
    path, r = got
    what = {"false_alarm_rate": "false alarms, A/A on random halves of one run",
            "false_alarm_rate_time_halves": "false alarms, A/A first half vs second half (drift)",
            "false_alarm_rate_across_runs": "false alarms, A/A across two runs of the same build",
            "detection_rate_2pct": "detection of an injected 2% slowdown",
            "detection_rate_5pct": "detection of an injected 5% slowdown",
            "detection_rate_10pct": "detection of an injected 10% slowdown"}
    rows = []
    for k, d in r.derived.items():
        s = next((s for s in r.series if s.name in d.inputs), None)
        rows.append({"measure": what.get(k, k), "rate": f"{d.value:.1%}",
                     "90% interval": f"{d.spread[0]:.1%}-{d.spread[1]:.1%}" if d.spread else "",
                     "verdicts": f"{s.metrics.get('flagged')} of {s.metrics.get('trials')}" if s else "",
                     "series": s.params.get("sources") if s else ""})
    out += [f"Estimated {r.env.date[:10]} from samples recorded on {r.env.gpu} (`{_rel(path)}`). "
            f"Gate rule: {next(iter(r.derived.values())).rule.split('gate rule: ')[-1].split('; spread')[0]}.", "",
            _table(rows), ""]
    across = next((s for s in r.series if s.params.get("mode") == "aa_across_runs"), None)
    if across is not None:
        out += ["Across-runs pairs (the same case recorded by two runs of one build):", "",
                _table([{"pair": k, "flagged": f"{v:.0%}"} for k, v in across.metrics.get("per_source", {}).items()]),
                ""]
    out += [f"Note: {n}" for n in r.notes] + [""]
    for p, cap in plots.quality_plot(r, ctx.fig_dir):
        out += [ctx.fig_link(p, cap), ""]
    return out


def section_constants(ctx: Context) -> list[str]:
    from microbench.tune import gpu_slug, load_constants

    out = ["## Tuned constants", ""]
    if ctx.tune_error:
        return out + [f"**Could not tune from these results:** {ctx.tune_error}", ""]
    ents = ctx.tune_entries
    defaults = [n for n, e in ents.items() if e.source == "default"]
    if defaults:
        out += [f"> **Warning: {len(defaults)} of {len(ents)} constants are conservative defaults, not "
                f"measurements:** {', '.join(f'`{n}`' for n in defaults)}. The megakernel build runs with them "
                "(correct, not fast) until their benchmarks report.", ""]
    out += ["What `megabench tune` derives from these results (the megakernel build reads the same values "
            "from `reports/constants/<gpu>.json`). Near-ties follow each benchmark's stated rule.", ""]
    rows = []
    for n, e in ents.items():
        p = e.provenance
        rows.append({"constant": n, "value": fmt(e.value, e.spec.unit), "source": e.source if e.source == "measured"
                     else "**default**", "benchmark": p["benchmark"] + ":" + p["derived_key"],
                     "result": (f"`{p['result_file']}` ({p['date']}, {p['gpu']}, `{str(p['git_sha'])[:7]}`)"
                                if e.source == "measured" else p.get("reason", "")),
                     "spread": fmt_spread(p.get("spread"), e.spec.unit),
                     "rule": p["rule"] if e.source == "measured" else "documented default (microbench/constants.py)"})
    out += [_table(rows), ""]
    if ctx.cat.gpu:
        cf = REPO_ROOT / "reports" / "constants" / f"{gpu_slug(ctx.cat.gpu)}.json"
        if cf.exists():
            try:
                c = load_constants(cf)
                diff = [n for n, e in ents.items() if getattr(c, n) != e.value]
                out += [(f"The committed `{_rel(cf)}` (revision {c.revision}) matches." if not diff else
                         f"The committed `{_rel(cf)}` (revision {c.revision}) differs in {', '.join(diff)}: "
                         "run `megabench tune` to record a new revision."), ""]
            except Exception as e:  # shown, not hidden: the report is where a broken file gets noticed
                out += [f"**The committed `{_rel(cf)}` is invalid:** {e}", ""]
        else:
            out += [f"No committed constants file for {ctx.cat.gpu} yet (`megabench tune` writes `{_rel(cf)}`).", ""]
    return out


# ----------------------------------------------------------------------------- driver
def build(root: Path | None = None, out_dir: Path | None = None, bench_dir: Path | None = None,
          baseline: Path | None = None, gpu: str | None = None, gpu_present: bool | None = None) -> Path:
    """Render the report; returns the path of REPORT.md."""
    from microbench.tune import collect

    out_dir = Path(out_dir) if out_dir else REPO_ROOT / "reports"
    bench_dir = Path(bench_dir) if bench_dir else REPO_ROOT / "reports" / "benchmarks"
    fig_dir = out_dir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    for old in fig_dir.glob("*.png"):  # generated output only: stale figures would mislead
        old.unlink()
    if gpu_present is None:
        from microbench.device import no_gpu_reason

        gpu_present = no_gpu_reason() is None
    cat = Catalog.load(root, gpu)
    tune_err = None
    try:
        _, entries = collect(cat.root, cat.gpu)
    except Exception as e:
        entries, tune_err = {}, str(e)
    tl = cat.latest("megakernel.timeline")
    timeline = tl[1] if tl else next((r for r in sorted(cat.latest_all(), key=lambda r: r.benchmark)
                                      if any("phase" in s.params and "edge" in s.params for s in r.series)), None)
    baseline_runs = [r for b, rs in cat.runs.items() if b.startswith("model.") for _, r in rs]
    rows = mk.with_fastest_baselines(mk.step_rows(cat.latest_all()), baseline_runs)
    ctx = Context(cat, fig_dir, out_dir, entries, tune_err, rows, timeline)
    lines = [f"# megabench report{(': ' + cat.gpu) if cat.gpu else ''}", ""]
    lines += _banner(ctx, gpu_present) + [""]
    lines += ["Generated by `megabench report` (or `python -m reports`) from typed results; every figure names "
              "its timer, its physical bound and the share of it achieved. The study's numbers are from "
              f"{paper.setup('gb300')['hardware']} and appear beside ours, labelled, never mixed.", ""]
    body = section_environment(ctx)
    n = 1
    for cls in cat.classes():
        body += section_class(ctx, cls, n)
        n += 1
    body += section_megakernel(ctx, n)
    body += section_changes(ctx, bench_dir, baseline)
    body += section_quality(ctx)
    body += section_constants(ctx)
    toc = [f"- [{h.lstrip('#').strip()}](#{_anchor(h)})" for h in body if h.startswith("## ")]
    text = "\n".join(lines + ["## Contents", ""] + toc + [""] + body).rstrip() + "\n"
    out = out_dir / "REPORT.md"
    out.write_text(text)
    return out


def _anchor(h: str) -> str:
    import re

    t = h.lstrip("#").strip().lower()
    t = re.sub(r"[^\w\- ]", "", t)
    return t.replace(" ", "-")
