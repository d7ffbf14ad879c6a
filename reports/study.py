"""The study's figures beside ours: one row per figure of reports/paper_figures.json.

A row compares the same quantity under the same conditions (occupancy, bytes in flight, scope,
statistic), or says plainly what ours measures instead and why: every figure carries `compare`
("same", or the difference in words), shown in the "like for like?" column. Where ours is more
than one number read off a result (what the megakernel build runs, an accepted-tokens rate at a
stated acceptance, a share of the time a saving is measured against, the largest drift with the
timer tick it was read with), a named function in COMPUTED produces it from the results.

Ours comes from the results as the current rules derive them from the recorded samples
(microbench/rederive.py), the tuned constants as `megabench tune` resolves them (pins included),
and the megakernel results through reports/megakernel.py.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from microbench import rederive
from microbench.adopt import load_adopted, result_revision
from microbench.errors import ResultsFileError
from microbench.fmt import fmt, fmt_range, fmt_spread
from microbench.weights.bench import STUDY_EXPERT_BYTES

from . import paper
from . import megakernel as mk

STUDY_ACCEPTANCE = 6.6  # tokens the study accepts per 16-token verify step (GSM8K, its draft model)


# ----------------------------------------------------------------------------- lookups
def _latest(ctx, bench: str):
    got = ctx.cat.latest(bench)
    return got[1] if got else None


def _derived(ctx, bench: str, key: str):
    r = _latest(ctx, bench)
    return rederive.derived(r).get(key) if r is not None else None


def _series(ctx, bench: str, name: str):
    r = _latest(ctx, bench)
    if r is None:
        return None, None
    for s in r.series:
        if s.name == name:
            return r, s
    return r, None


def _adopted(ctx):
    try:
        return load_adopted(ctx.cat.gpu) if ctx.cat.gpu else None
    except Exception:  # no or a broken adoption: the constants section says so
        return None


# ----------------------------------------------------------------------------- computed rows
def _ring_built(ctx, f):
    """What the megakernel build runs (megakernel.build, shard8), beside the tuned budget."""
    r = _latest(ctx, "megakernel.build")
    if r is None:
        return None
    rows = {s.params.get("preset"): s for s in r.series}
    s = rows.get("shard8") or next(iter(rows.values()), None)
    if s is None or "ring_stages" not in s.params:
        return None

    rev, how = result_revision(r)
    adopted = _adopted(ctx)
    budget = (f"{adopted.ring_stages} x {fmt(adopted.ring_stage_bytes, 'B')} budget of the adopted revision "
              f"{adopted.revision}" if adopted is not None else "no adopted revision")
    tuned = ctx.tune_entries.get("ring_stages"), ctx.tune_entries.get("ring_stage_bytes")
    tt = (f"; tune now derives {tuned[0].value} x {fmt(tuned[1].value, 'B')}" if all(tuned) else "")
    what = "ring_stages" if f["unit"] == "" else "stage_bytes"
    v = float(s.params[what])
    return (v, f["unit"], f"`megakernel.build` {s.params.get('preset')}: {s.params['ring_stages']} x "
            f"{fmt(s.params['stage_bytes'], 'B')} built (constants revision {rev}: {how}); {budget}, stages of the "
            f"largest tile, spare shared memory filled with more stages{tt}")


def _hot_bet_bytes(ctx, f):
    d = _derived(ctx, "weights.hot_experts", "hot_experts_worth_prefetching")
    be = ctx.tune_entries.get("hot_expert_break_even_overlap")
    if d is None:
        return None

    k = re.search(r"k=(\d+) prefetched \(([\d.]+) MiB\)", d.note or "") or re.search(
        r"k=(\d+) prefetched \(([\d.]+) MiB\)", (_derived(ctx, "weights.hot_experts", "hot_expert_break_even_overlap")
                                                 or d).note)
    tested = f"; the bet measured prefetches {k.group(1)} experts ({k.group(2)} MiB)" if k else ""
    v = d.value * STUDY_EXPERT_BYTES if f["unit"] == "B" else d.value
    why = (f"our rule's break-even overlap {be.value:g} ({'never bet' if be.value >= 1 else 'bet'})" if be else "")
    return v, f["unit"], f"`weights.hot_experts` hot_experts_worth_prefetching: {why}{tested}"


def _hot_saving_share(ctx, f):
    r, nopf = _series(ctx, "weights.hot_experts", "hot/3.5MiB/slack/nopf")
    d = _derived(ctx, "weights.hot_experts", "hot_expert_saving_right_s")
    if nopf is None or d is None:
        return None
    share = d.value / nopf.summary.median
    lo, hi = (x / nopf.summary.median for x in d.spread) if d.spread else (share, share)
    return (share, "fraction", f"`weights.hot_experts`: saving of the fully right bet {fmt(d.value, 's')} / the "
            f"no-prefetch phase {fmt(nopf.summary.median, 's')} (3.5 MiB experts, 20 us of slack) = {lo:.1%}-{hi:.1%}; "
            "the study's is per 5.3 ms step, ours per measured phase: shares compared, not times")


def _xgpu_loaded_local(ctx, f):
    r, s = _series(ctx, "xgpu.flags", "r0-r1/load-all-both/local")
    if s is None:
        return None
    _, peer = _series(ctx, "xgpu.flags", "r0-r1/load-all-both/peer")
    kb = s.params.get("load_bytes")
    extra = (f"; with every SM reading {fmt(kb, 'B')} from the peer instead (a queue for NVLink bandwidth, not the "
             f"study's setup): {fmt(peer.summary.median, 's')}" if peer is not None else "")
    return (s.summary.median, "s", f"`xgpu.flags` r0-r1/load-all-both/local: one-way flag between two H200s while "
            f"every other SM of both GPUs keeps {fmt(kb, 'B')} of bulk copies from local HBM in flight "
            f"(IQR {fmt(s.summary.q1, 's')}-{fmt(s.summary.q3, 's')}){extra}")


def _gpu_drift_max(ctx, f):
    r, s = _series(ctx, "xgpu.clocks", "stops/hbm/gpu_spread")
    if s is None:
        return None
    step = rederive.derived(r).get("globaltimer_step_ns")
    x = np.asarray(s.samples)
    tick = f"%globaltimer stepped every {step.value:g} ns on that machine" if step else "timer step not recorded"
    return (float(x.max()), "s", f"`xgpu.clocks` stops/hbm/gpu_spread: the largest of {x.size} stops (the study's "
            f"'up to'); p99.9 {fmt(float(np.percentile(x, 99.9)), 's')}, p99 {fmt(float(np.percentile(x, 99)), 's')}, "
            f"median {fmt(float(np.median(x)), 's')}; {tick}, so spreads under ~1 us are a few ticks")


def _fence_all_sms(ctx, f):
    d = _derived(ctx, "sync.fences", "fence_acq_rel_gpu_all_sms_loaded_s")
    if d is None:
        return None
    r = _latest(ctx, "sync.fences")
    others = []
    for s in r.series:
        p = s.params
        if p.get("kind") == "acq_rel_gpu" and p.get("body") == "after_store" and p.get("k_bytes"):
            who = "every SM" if p.get("blocks", 1) > 1 else "one SM (the rest idle)"
            others.append(f"{who}, {fmt(p['k_bytes'], 'B')}: {fmt(s.summary.median, 's')}")
    return (d.value, "s", "`sync.fences` fence_acq_rel_gpu_all_sms_loaded_s: fence.acq_rel.gpu after a store with every "
            "SM keeping bulk loads in flight (the megakernel's case); " + "; ".join(others[-4:])
            + "; kinds run in a fixed order")


def _decode_rows(ctx) -> list:
    return mk.decode_rows([r for _, r in ctx.cat.runs.get("megakernel.decode", [])])


def _tok_s(impl: str):
    """Accepted tokens/s: measured by `megabench decode` (megakernel.decode, mega mode for the
    megakernel, chain mode for the baseline kernel chain) where a GPU run exists, the projection at
    the study's acceptance beside it; else that projection alone, labelled (a 4th element: the
    value cell's label)."""
    def fn(ctx, f):
        r = mk.pick(ctx.step_rows, impl, 16)
        proj = None
        if r is not None:
            acc, how = r.acceptance
            proj = (acc / r.step_s, f"{r.impl}, {r.preset}, T={r.tokens}, ctx={r.context}: {acc:g} accepted tokens per "
                    f"step ({how}) / step time {fmt(r.step_s, 's')}; one shard of the model on one GPU, no collectives, "
                    f"no draft half ({r.tokens_per_step[0] / r.step_s:,.0f} tok/s counting every token processed)")
        d = mk.pick_decode(_decode_rows(ctx), "mega" if impl == "mega" else "chain")
        if d is not None:
            beside = f"; beside it the PROJECTION {proj[0]:,.0f} tok/s ({proj[1]})" if proj else ""
            return (d.tok_s, "tok/s", f"MEASURED by `megabench decode` ({d.mode} mode, {d.preset}, {d.date[:10]} "
                    f"{d.commit}): draft, verify and accept on the device, {d.mean:.2f} tokens accepted per step on "
                    f"average (the synthetic pair's '{d.acceptance}' agreement {d.agree:g}){beside}")
        if proj is None:
            return None
        return proj[0], "tok/s", proj[1] + "; no `megabench decode` GPU run yet", "projection"
    return fn


def _decode_part(part: str, mode: str):
    """One part of the measured speculative step (megakernel.decode's median per step), or its launches."""
    def fn(ctx, f):
        d = mk.pick_decode(_decode_rows(ctx), mode)
        if d is None:
            return None
        if f["unit"] == "launches":
            n = d.metric(f"{part}_launches")
            return (n, "launches", f"`megabench decode` {d.mode} mode, {d.preset}: launches of the {part} part") \
                if n is not None else None
        t = d.metric(f"{part}_s")
        return (t, "s", f"`megabench decode` {d.mode} mode, {d.preset}, {d.date[:10]} {d.commit}: median {part} part "
                "per step (CUDA events between the parts' graphs)") if t is not None else None
    return fn


def _tokens_accepted(ctx, f):
    d = mk.pick_decode(_decode_rows(ctx), "mega")
    if d is None:
        return None
    return (d.mean, "tokens", f"`megabench decode` {d.preset}, {d.date[:10]} {d.commit}: mean tokens committed per "
            f"step (bonus included) from the device's counts, the '{d.acceptance}' agreement {d.agree:g}: a property "
            "of the synthetic draft/target pair")


def _verify_ratio(ctx, f):
    base, mega = mk.pick(ctx.step_rows, "best_baseline", 16), mk.pick(ctx.step_rows, "mega", 16)
    if base is None or mega is None or base.config != mega.config:
        return None
    return (base.step_s / mega.step_s, "x", f"{base.impl} {fmt(base.step_s, 's')} / {mega.impl} {fmt(mega.step_s, 's')}, "
            f"{mega.preset} T=16 ctx={mega.context}: the verify step, as the study's 10.9 / 5.3 ms")


COMPUTED: dict[str, Callable] = {
    "ring_built": _ring_built, "hot_bet_bytes": _hot_bet_bytes, "hot_saving_share": _hot_saving_share,
    "xgpu_loaded_local": _xgpu_loaded_local, "gpu_drift_max": _gpu_drift_max, "fence_all_sms": _fence_all_sms,
    "accepted_tok_s_mega": _tok_s("mega"), "accepted_tok_s_baseline": _tok_s("best_baseline"),
    "verify_ratio": _verify_ratio, "tokens_accepted": _tokens_accepted,
    "draft_s_mega": _decode_part("draft", "mega"), "draft_s_chain": _decode_part("draft", "chain"),
    "draft_launches_mega": _decode_part("draft", "mega"), "draft_launches_chain": _decode_part("draft", "chain"),
}


# ----------------------------------------------------------------------------- rows
def _ours(ctx, f) -> tuple[str, str]:
    o = f.get("ours")
    if o is None:
        return "-", f.get("note", "no counterpart measured here")
    kind = o["kind"]
    if kind == "computed":
        got = COMPUTED[o["name"]](ctx, f)
        if not got:
            return "not measured yet", f"needs {o.get('needs', o['name'])}"
        return _fmt(got[0], got[1]) + (f" ({got[3]})" if len(got) > 3 else ""), got[2]
    if kind == "constant":
        e = ctx.tune_entries.get(o["name"])
        if e is not None and e.source in ("measured", "pinned"):
            sp = e.provenance.get("spread")
            ours = fmt(e.value, e.spec.unit) + (f" ({fmt_spread(sp, e.spec.unit)})" if sp and e.source == "measured"
                                                else "")
            how = f"tuned `{o['name']}` from `{e.spec.benchmark}`"
            if e.source == "pinned":
                mv = e.provenance.get("measured_value")
                how += f" (PINNED; the latest result derives {fmt(mv, e.spec.unit)})" if mv is not None else " (PINNED)"
            return ours, how
        return "not measured yet", (f"tuned `{o['name']}` (default {fmt(e.value, e.spec.unit)} until measured)"
                                    if e else o["name"])
    if kind == "derived":
        found = []
        for r in ctx.cat.latest_all():
            if o.get("benchmark") is not None and r.benchmark != o["benchmark"]:
                continue
            for k, d in sorted(rederive.derived(r).items()):
                if k == o["key"] or (o.get("key_regex") and re.fullmatch(o["key_regex"], k)):
                    found.append((k != o["key"], k, r, d))
        if not found:
            what = o["key"] if not o.get("key_regex") else f"{o['key']}` or `{o['key_regex']}"
            return "not measured yet", f"expects derived `{what}`" + (f" in `{o['benchmark']}`" if o.get("benchmark")
                                                                       else "")
        _, k, r, d = min(found, key=lambda t: (t[0], t[1]))  # the exact key first, else the first match
        unit = o.get("unit") or (f["unit"] if f["unit"] in ("x", "fraction") and d.unit in ("", "fraction")
                                 else d.unit)
        sp = (f" ({_fmt(d.spread[0], unit)} - {_fmt(d.spread[1], unit)})" if unit == "x" else
              f" ({fmt_spread(d.spread, unit)})") if d.spread else ""
        return _fmt(d.value, unit) + sp, f"`{r.benchmark}` derived `{k}`"
    if kind == "env":
        envs = ctx.cat.envs()
        if envs:
            e = max(envs, key=lambda x: x.date)
            v = getattr(e, o["field"], None)
            if v is not None:
                return fmt(v, f["unit"]), f"driver attribute `{o['field']}`"
        return "not measured yet", ""
    if kind == "megakernel":
        got = mk.figure_value(ctx.step_rows, ctx.timeline, o)
        return (fmt(got[0], got[1]), got[2]) if got else ("not measured yet",
                                                          f"from model.* / megakernel.* results ({o['metric']})")
    raise ValueError(f"paper figure {f['id']}: unknown ours.kind {kind!r}")


def like_for_like(f) -> str:
    c = f.get("compare")
    if f.get("ours") is None:
        return ""
    if c is None:
        return "not stated"
    if c == "same":
        return "yes"
    if c.startswith("same "):
        return "yes " + c[len("same "):]
    return f"no: {c}"


def _fmt(v, unit: str) -> str:
    """fmt, with ratios near 1 shown to three decimals (1.001x, not 1x: the difference is the point)."""
    if unit == "x" and isinstance(v, (int, float)) and 0.5 < v < 2:
        return f"{v:.3f}x"
    return fmt(v, unit)


def check_computed(figs: Sequence[dict], source: str = str(paper.PATH)) -> None:
    """Every figure whose ours is computed names a function of COMPUTED; else ResultsFileError."""
    for f in figs:
        ours = f.get("ours")
        if ours is not None and ours.get("kind") == "computed" and ours.get("name") not in COMPUTED:
            raise ResultsFileError(f"{source}: {f.get('id')}: computed figure {ours.get('name')!r} is not in "
                                   "reports/study.py COMPUTED")


def rows(ctx, figs: Sequence[dict]) -> list[dict]:
    """The study-vs-ours table rows for `figs` (reports/build.py renders them)."""
    check_computed(figs)
    out = []
    for f in figs:
        st = paper.setup(f["setup"])
        theirs = _fmt(f["value"], f["unit"]) if "value" in f else fmt_range(f["low"], f["high"], f["unit"])
        if f["setup"] != "gb300":
            theirs += f" ({st['short']})"
        ours, how = _ours(ctx, f)
        for extra in (f.get("note_ours"), f.get("note") if f.get("ours") is not None else None):
            if extra:
                how = (how + "; " if how else "") + extra
        out.append({"quantity": f["quantity"], f"study ({paper.setup('gb300')['short']})": theirs,
                    f"ours ({ctx.cat.gpu or 'no GPU yet'})": ours, "like for like?": like_for_like(f),
                    "how ours is obtained": how})
    return out
