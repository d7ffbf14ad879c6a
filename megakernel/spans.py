"""Where a profiled step's time goes: reductions of a Timeline.spans_df() (one row per stamped
phase: launch, block, phase, arg, begin_ns, end_ns, dur_ns) into per-op, per-segment and per-slot
medians for the megakernel.timeline results. Pure functions of the frame; no GPU.
"""
from __future__ import annotations

import numpy as np

from .profile_events import DETAIL_PHASES


def _op_phases(df):
    """The rows of a Timeline.spans_df() that are ops' phases: not the detail phases inside units
    (profile_events.DETAIL_PHASES), not the wait_* phases before them."""

    return df[~df["phase"].isin(DETAIL_PHASES) & ~df["phase"].str.startswith("wait_")]


def _detail_spans(df):
    """The detail spans (profile_events.DETAIL_PHASES) of `df` (Timeline.spans_df()), each with
    the op it belongs to: the op phase that began last before it on the same block and launch
    (units run inside their op's phase)."""
    import pandas as pd  # heavy: pandas


    det = df[df["phase"].isin(DETAIL_PHASES)].sort_values("begin_ns")
    ops = _op_phases(df)
    ops = ops[["launch", "block", "begin_ns", "phase"]].rename(columns={"phase": "op"}).sort_values("begin_ns")
    if det.empty or ops.empty:
        return det.iloc[0:0].assign(op=None)
    return pd.merge_asof(det, ops, on="begin_ns", by=["launch", "block"], direction="backward").dropna(subset=["op"])


def detail_by_op(df) -> dict[tuple[str, str], float]:
    """{(detail phase, op kind): seconds}: the median over blocks of each op kind's total time in
    each detail phase of a step. `df`: Timeline.spans_df()."""
    m = _detail_spans(df)
    if m.empty:
        return {}
    per_block = m.groupby(["phase", "op", "block"])["dur_ns"].sum()
    return {k: float(v) * 1e-9 for k, v in per_block.groupby(level=["phase", "op"]).median().items()}


def topk_steps(df) -> dict[int, float]:
    """{step: seconds}: the median over layers of each of top-k's steps after its poll
    (profile_events.TOPK_STEPS; one block, once per layer), from a detail build's topk_step spans.
    `df`: Timeline.spans_df()."""
    m = _detail_spans(df)
    if m.empty:
        return {}
    m = m[m["phase"] == "topk_step"]
    return {int(a): float(g["dur_ns"].median()) * 1e-9 for a, g in m.groupby("arg")}


# the segments of a unit boundary (unit_boundaries), in order
BOUNDARY_SEGMENTS = {
    "close": "the closing barrier of the unit before and thread 0's signal bookkeeping (unit_close)",
    "loop": "from the end of that to the next unit's opening (the unit loop)",
    "open": "the next unit's opening: its dependency wait and the barrier after it (unit_open)",
    "start": "from the opening to the unit's first staging pass or ring wait",
    "direct": "where the next unit does not open (program.cuh unit_opens: nothing to wait for, the same "
              "slot), from the closing to its first staging pass or ring wait",
}


def unit_boundaries(df) -> dict[tuple[str, str], float]:
    """{(segment, op kind): seconds}: the median over a step's inner unit boundaries of each op
    (a block's second and later units of an op instance) of each BOUNDARY_SEGMENTS segment, from
    the detail phases unit_close, unit_open, stage and ring_wait (builds since 06e76fe, which stamp
    unit_open from a block's second unit of an op on, and only where the unit opens). "start" and
    "direct" only where the unit stages or streams. `df`: Timeline.spans_df()."""
    m = _detail_spans(df)
    m = m[m["phase"].isin(("unit_close", "unit_open", "stage", "ring_wait"))]
    seg: dict[tuple[str, str], list[float]] = {}
    for _, g in m.sort_values("begin_ns").groupby(["launch", "block"], sort=False):
        close = opened = None
        for ph, op, b, e in zip(g["phase"], g["op"], g["begin_ns"], g["end_ns"]):
            if ph == "unit_close":
                close, opened = (op, b, e), None
            elif ph == "unit_open":
                if close is not None and close[0] == op:
                    seg.setdefault(("close", op), []).append(close[2] - close[1])
                    seg.setdefault(("loop", op), []).append(b - close[2])
                    seg.setdefault(("open", op), []).append(e - b)
                    opened = (op, e)
                close = None
            elif opened is not None and opened[0] == op:  # the unit's first stage or ring wait
                seg.setdefault(("start", op), []).append(b - opened[1])
                opened = None
            elif close is not None and close[0] == op:  # a unit of the same op that did not open
                seg.setdefault(("close", op), []).append(close[2] - close[1])
                seg.setdefault(("direct", op), []).append(b - close[2])
                close = None
    return {k: float(np.median(v)) * 1e-9 for k, v in sorted(seg.items())}


def end_tails(df) -> dict[str, float]:
    """{op kind: seconds}: the median over launches of how long after the median block the last
    block ends the op (its phase end), for ops that two or more blocks run in a launch. A layer
    waits for its slowest block at each all-dependency, so this is what the op's imbalance costs.
    `df`: Timeline.spans_df()."""
    ops = _op_phases(df)
    out: dict[str, list[float]] = {}
    for (op, _), g in ops.groupby(["phase", "launch"]):
        ends = g.groupby("block")["end_ns"].max()
        if len(ends) >= 2:
            out.setdefault(op, []).append(float(ends.max() - ends.median()))
    return {op: float(np.median(v)) * 1e-9 for op, v in sorted(out.items())}


SEGMENTS = {"front": "the launch's start (median over blocks of each block's first phase) to the first "
                     "gate/up unit: attention, its merge, oproj, router and pooler, top-k",
            "experts": "the first gate/up unit's start to the last down-projection unit's end",
            "back": "the last down-projection unit's end to the launch's end (the last block's last phase): "
                    "the MoE combine, unpool, qkv"}


def layer_segments(df) -> dict[str, float]:
    """{segment: seconds}, the medians over the launches that run the expert GEMMs of the three
    segments a layer launch falls into around its expert phase (SEGMENTS): the expert phase is
    where the step's bytes are, the segments around it are a chain of dependent ops whose bytes
    take a few us at the read ceiling. `df`: Timeline.spans_df(); op phases only (not wait_*)."""
    ops = _op_phases(df)
    out: dict[str, list[float]] = {k: [] for k in SEGMENTS}
    for _, g in ops.groupby("launch"):
        e1, e2 = g[g["phase"] == "expert1"], g[g["phase"] == "expert2"]
        if e1.empty or e2.empty:
            continue
        start = float(df[df["launch"] == g["launch"].iloc[0]].groupby("block")["begin_ns"].min().median())
        first, last = float(e1["begin_ns"].min()), float(e2["end_ns"].max())
        out["front"].append(first - start)
        out["experts"].append(last - first)
        out["back"].append(float(g["end_ns"].max()) - last)
    return {k: float(np.median(v)) * 1e-9 for k, v in out.items() if v}


def slot_crossings(df, units_per_slot: dict[str, int]) -> dict[tuple[str, str], float]:
    """{(statistic, op): value} for the routed ops of a detail timeline (unit_close stamps carry
    the unit). A block runs consecutive units of a routed op (contiguous assignment), so they lie
    in one slot or cross into the next, which costs an opening (slot record, dependency wait,
    barrier) and a staging pass. Among the op phases with the most common unit count (like against
    like): "cross_fraction", the share whose units span two or more slots, and "cross_extra_s",
    the median duration of those minus the median of the one-slot ones (only where both occur)."""
    m = _detail_spans(df)
    m = m[(m["phase"] == "unit_close") & m["op"].isin(list(units_per_slot))]
    ops = df[df["phase"].isin(list(units_per_slot))].groupby(["launch", "block", "phase"])["dur_ns"].sum()
    out: dict[tuple[str, str], float] = {}
    for op, g in m.groupby("op"):
        per = g.groupby(["launch", "block"])["arg"].agg(
            n="nunique", slots=lambda a: len({int(u) // units_per_slot[op] for u in a}))
        per = per[per["n"] == per["n"].mode().iloc[0]]
        dur = [float(ops.get((lb[0], lb[1], op), np.nan)) for lb in per.index]
        per = per.assign(dur=dur).dropna(subset=["dur"])
        if per.empty:
            continue
        cross = per["slots"] > 1
        out[("cross_fraction", op)] = float(cross.mean())
        if cross.any() and (~cross).any():
            out[("cross_extra_s", op)] = float(per.loc[cross, "dur"].median() - per.loc[~cross, "dur"].median()) * 1e-9
    return dict(sorted(out.items()))


def op_time_by_group(spans, program) -> list[tuple[str, int, float, float]]:
    """(op kind, row group, work, wait) in block-microseconds: each op kind's work phases and its
    wait phases summed over blocks and layers, split by the group of the op instance that stamped
    them (a work phase's arg is its op index in `program`; a wait phase's too). From a profiled
    step's Timeline.spans_df(); program: the step's (GroupEngine.program, or an Engine's)."""
    ops = program.ops
    acc: dict[tuple[str, int], list[float]] = {}
    for ph, arg, dur in zip(spans["phase"], spans["arg"], spans["dur_ns"]):
        wait = ph.startswith("wait_")
        kind = ph[5:] if wait else ph
        i = int(arg)
        if not 0 <= i < len(ops) or ops[i].kind != kind:
            continue  # a detail phase (staging, ring waits), not an op's own
        a = acc.setdefault((kind, ops[i].group), [0.0, 0.0])
        a[1 if wait else 0] += float(dur) * 1e-3
    order = {k: n for n, k in enumerate(dict.fromkeys(o.kind for o in ops))}
    return [(k, g, w, x) for (k, g), (w, x) in sorted(acc.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))]
