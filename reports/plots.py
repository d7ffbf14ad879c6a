"""PNG figures for the report (matplotlib, Agg backend: no display needed).

Hooks are keyed on what a series carries, not on its benchmark's internals, so a class's plots
appear as soon as its results do:
- curve: series of one result that share a unit and vary a numeric parameter over >= 3 values:
  median (or achieved rate, when every series has a rate bound) against that parameter, one line
  per combination of the other parameters, IQR as error bars. The x parameter is the first of
  the class's preferred names that varies (PREFERRED_X), else the one with most values. Bytes
  on the x axis get vertical markers at the class's derived byte constants (cache levels...).
  A series can force its x with metrics["plot_x"] = "<param>", or opt out with metrics["plot"] = "none".
- hist: series named "*skew*" or with metrics["plot"] == "hist": histogram of the raw samples.
- the megakernel's step-time bars and timeline (from reports/megakernel.py data).
Every function returns [(path, caption)] and never raises on odd data: it skips it.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from microbench.fmt import fmt

from .megakernel import config_label, config_rank, impl_rank

PREFERRED_X = {
    "basics": ("bytes",),
    "icache": ("code_bytes", "offset_bytes", "bytes", "block_bytes", "warps"),
    "weights": ("stage_bytes", "working_set_bytes", "prefetch_bytes", "bytes", "overlap", "stages", "experts"),
    "sync": ("k_bytes", "bytes_in_flight", "payload_bytes", "bytes", "blocks", "backoff_ns"),
    "clocks": ("stamps", "blocks", "launches"),
}
MAX_LINES = 10
MAX_PLOTS_PER_RESULT = 4


def _plt():
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    return plt


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-").lower()


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    _plt().close(fig)
    return path


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def curve_plots(result, cls: str, fig_dir: Path, byte_marks: dict[str, float] | None = None):
    groups: dict[tuple, list] = defaultdict(list)
    for s in result.series:
        if s.metrics.get("plot") in ("none", "hist") or not s.params or s.timer == "static":
            continue
        # list/dict params (a tree's parent list) label a series but are no axis or facet
        groups[(s.unit, tuple(k for k in sorted(s.params) if not isinstance(s.params[k], (list, dict))))].append(s)
    out = []
    for (unit, keys), ss in groups.items():
        varying = {k: sorted({s.params[k] for s in ss}, key=str) for k in keys}
        numeric = [k for k in keys if all(_num(s.params[k]) for s in ss) and len(varying[k]) >= 3]
        forced = {s.metrics.get("plot_x") for s in ss} - {None}
        x = next(iter(forced)) if len(forced) == 1 and next(iter(forced)) in keys else None
        if x is None:
            pref = [k for k in PREFERRED_X.get(cls, ()) if k in numeric]
            x = pref[0] if pref else (max(numeric, key=lambda k: len(varying[k])) if numeric else None)
        if x is None:
            continue
        # too many lines for one figure: one figure per value of the parameter with fewest values
        facets, fkeys = [((), ss)], []
        while True:
            others = [k for k in keys if k != x and k not in fkeys and len(varying[k]) > 1]
            nlines = max(len({tuple(s.params[k] for k in others) for s in fs}) for _, fs in facets)
            if nlines <= MAX_LINES or not others:
                break
            f = min(others, key=lambda k: len(varying[k]))
            fkeys.append(f)
            facets = [(fv + ((f, v),), [s for s in fs if s.params[f] == v]) for fv, fs in facets
                      for v in sorted({s.params[f] for s in fs}, key=str)]
        for fv, fs in facets:
            if len(out) >= MAX_PLOTS_PER_RESULT:
                break
            got = _curve(result, fs, x, others, unit, fv, fig_dir, byte_marks)
            if got:
                out.append(got)
    return out


def _curve(result, ss, x, others, unit, facet, fig_dir, byte_marks):
    lines: dict[tuple, list] = defaultdict(list)
    for s in ss:
        lines[tuple((k, s.params[k]) for k in others)].append(s)
    if len(lines) > MAX_LINES or len({s.params[x] for s in ss}) < 3:
        return None
    rate = all(s.bound is not None and s.achieved is not None and s.bound.kind in ("bandwidth", "throughput")
               for s in ss) and len({s.bound.unit for s in ss}) == 1
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, pts in sorted(lines.items(), key=lambda kv: str(kv[0])):
        pts = sorted(pts, key=lambda s: s.params[x])
        xs = np.array([s.params[x] for s in pts], dtype=float)
        lab = ", ".join(f"{k}={v}" for k, v in label) or None
        if rate:
            ax.plot(xs, np.array([s.achieved for s in pts]), marker="o", label=lab)
        else:
            ys = np.array([s.summary.median for s in pts])
            lo = ys - np.array([s.summary.q1 for s in pts])
            hi = np.array([s.summary.q3 for s in pts]) - ys
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=2, label=lab)
    xs_all = np.array([s.params[x] for s in ss], dtype=float)
    is_bytes = x.endswith("bytes") or x == "bytes"
    if xs_all.min() > 0 and xs_all.max() / xs_all.min() > 20:
        ax.set_xscale("log", base=2 if is_bytes else 10)
    if is_bytes:
        for name, v in (byte_marks or {}).items():
            if xs_all.min() / 2 <= v <= xs_all.max() * 2:
                ax.axvline(v, color="grey", linestyle="--", linewidth=0.8)
                ax.annotate(f"{name}\n{fmt(v, 'B')}", (v, ax.get_ylim()[1]), fontsize=7, ha="left", va="top")
    ax.set_xlabel(x)
    yunit = ss[0].bound.unit if rate else unit
    ax.set_ylabel(("achieved " if rate else "median ") + f"({yunit})")
    ftxt = ", ".join(f"{k}={v}" for k, v in facet)
    ax.set_title(f"{result.benchmark}: {'achieved' if rate else 'median'} vs {x}" + (f" [{ftxt}]" if ftxt else ""),
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=6)
    name = f"{_slug(result.benchmark)}-{_slug(x)}-{_slug(unit or 'unitless')}" + (f"-{_slug(ftxt)}" if ftxt else "")
    path = _save(fig, fig_dir / f"{name}.png")
    cap = (f"{result.benchmark}: {'achieved rate' if rate else 'median (IQR bars)'} against {x}"
           + (f" for {ftxt}" if ftxt else "") + (f", one line per {', '.join(others)}" if others else ""))
    return path, cap


def hist_plots(result, fig_dir: Path):
    out = []
    for s in result.series:
        if not ("skew" in s.name.lower() or s.metrics.get("plot") == "hist") or len(s.samples) < 5:
            continue
        if len(out) >= MAX_PLOTS_PER_RESULT:
            break
        plt = _plt()
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        ax.hist(np.asarray(s.samples), bins=min(50, max(10, len(s.samples) // 10)))
        ax.set_xlabel(f"{s.name} ({s.unit}, timer {s.timer})")
        ax.set_ylabel("count")
        ax.set_title(f"{result.benchmark}: {s.name}", fontsize=10)
        p = _save(fig, fig_dir / f"{_slug(result.benchmark)}-{_slug(s.name)}-hist.png")
        out.append((p, f"{result.benchmark}: distribution of {s.name} ({len(s.samples)} samples, "
                       f"p10-p90 {fmt(np.percentile(s.samples, 10), s.unit)}-{fmt(np.percentile(s.samples, 90), s.unit)})"))
    return out


def step_bars(rows: Sequence, fig_dir: Path):
    if not rows:
        return []

    plt = _plt()
    cfgs = sorted({r.config for r in rows}, key=config_rank, reverse=True)  # the headline point on top
    impls = sorted({r.impl for r in rows}, key=impl_rank, reverse=True)  # the megakernel's bar on top
    fig, ax = plt.subplots(figsize=(7.0, 0.6 + 0.5 * len(cfgs) * max(1, len(impls)) ** 0.5 + 1.5))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        ys = []
        for c in cfgs:
            r = [x for x in rows if x.config == c and x.impl == impl]
            ys.append(min(x.step_s for x in r) * 1e3 if r else np.nan)
        ax.barh(np.arange(len(cfgs)) + j * width, ys, height=width, label=impl)
    ax.set_yticks(np.arange(len(cfgs)) + 0.4 - width / 2)
    ax.set_yticklabels([config_label(c) for c in cfgs], fontsize=8)
    ax.set_xlabel("step time (ms, median)")
    finite = [r.step_s for r in rows]
    if max(finite) / min(finite) > 20:  # naive torch rows are ~50x the megakernel's
        ax.set_xscale("log")
        ax.set_xlabel("step time (ms, median; log scale)")
    ax.legend(fontsize=7)
    ax.grid(True, axis="x", alpha=0.3)
    p = _save(fig, fig_dir / "megakernel-step-times.png")
    return [(p, "decode step time per implementation and configuration (median, device time)")]


def timeline_plot(phases: Sequence[dict], fig_dir: Path, title: str):
    if not phases:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.0, 0.6 + 0.35 * len(phases) + 1.0))
    for i, a in enumerate(phases):
        ax.barh(i, (a["end"] - a["start"]) * 1e6, left=a["start"] * 1e6, height=0.6, color="tab:blue", alpha=0.7)
        ax.plot([a["end_p10"] * 1e6, a["end_p90"] * 1e6], [i, i], color="black", linewidth=1)
        ax.plot([a["start_p10"] * 1e6, a["start_p90"] * 1e6], [i, i], color="grey", linewidth=1)
    ax.set_yticks(range(len(phases)))
    ax.set_yticklabels([a["phase"] for a in phases], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us since the launch's first stamp (bar: median start to median end; lines: p10-p90)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    p = _save(fig, fig_dir / "megakernel-timeline.png")
    return [(p, f"{title}: per-phase timeline across blocks (in-kernel %globaltimer stamps)")]


def acceptance_plot(curve: dict | None, fig_dir: Path):
    """Accepted tokens/s against the mean acceptance (megakernel.acceptance_curve): the projection
    line of the megakernel's T=16 step, the study's 6.6 marked on it, the measured runs as points."""
    if not curve:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    xs, ys = zip(*curve["projection"])
    ax.plot(xs, ys, color="tab:blue", linestyle="--",
            label=f"PROJECTION: a / the T=16 step ({fmt(curve['step_s'], 's')}), no draft half")
    a, v = curve["study"]
    ax.plot([a], [v], "o", color="tab:blue", fillstyle="none")
    ax.annotate(f"projection at the study's {a:g}: {v:,.0f} tok/s", (a, v), textcoords="offset points", xytext=(6, -12),
                fontsize=7)
    for m, t, label in curve["measured"]:
        ax.plot([m], [t], "s", markersize=6, label=f"measured: {label}")
    if not curve["measured"]:
        ax.text(0.02, 0.95, "no measured run yet (megabench decode on a GPU)", transform=ax.transAxes, fontsize=8,
                va="top")
    ax.set_xlabel("mean tokens committed per step (acceptance, bonus included)")
    ax.set_ylabel("accepted tokens/s")
    ax.set_title(f"{curve['preset']}: accepted tokens/s against acceptance", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    p = _save(fig, fig_dir / "megakernel-acceptance.png")
    return [(p, f"{curve['preset']}: accepted tokens/s against acceptance: measured speculative runs (points) and "
                "the projection of the T=16 step alone (dashed, labelled), the study's 6.6 marked")]
