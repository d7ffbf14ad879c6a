"""The megakernel's profiler: deferred and immediate op records, sampled launches, where waits end,
the detail stamps inside units, and the host's reading of them (pipeline's segments, tails and
unit boundaries) on emulated steps and handmade timelines."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megakernel.config import ConfigError
from megakernel.plan import make_plan, render
from megakernel.program import assigned_units, n_units
from megakernel.runtime import Engine

from megakernel_cases import step_inputs, tiny


def test_profiler_event_layout_is_pinned():
    from megakernel.plan import OP_KINDS
    from megakernel.profile_events import EVENTS

    base = EVENTS.id("wait_embed_begin")
    for i, k in enumerate(OP_KINDS):
        assert EVENTS.id(f"wait_{k}_begin") == base + 4 * i and EVENTS.id(f"{k}_begin") == base + 4 * i + 2


@pytest.mark.parametrize("program_mode", ["layer", "step"])
def test_deferred_op_stamps_are_the_immediate_ones(tiny, program_mode):
    """A profiled build writes its op phase records late (program.cuh prof_flush, every PROF_OPS
    ops and at launch end); a detail build writes them where they happen. Per block, the op
    records must be the same events with the same op indices in the same order, and their times
    nondecreasing. The whole-step launch (~40 ops) also flushes in the middle."""
    from megakernel.profile_events import DETAIL_PHASES, EVENTS

    detail_ids = {EVENTS.id(f"{ph}_{e}") for ph in DETAIL_PHASES for e in ("begin", "end")}
    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 4)
    stamps = {}
    for detail in (False, True):
        plan = make_plan(cfg, 4, profile=True, profile_detail=detail, profile_cap=1024)
        eng = Engine(w, plan, base.clone(), backend="emu", program_mode=program_mode)
        eng.step(toks, par, 40, mode="mega")
        assert not eng.timeline("mega").problems
        st = eng.prof.read()
        keep = np.array([e not in detail_ids for e in st.event.tolist()], dtype=bool)
        stamps[detail] = {f: getattr(st, f)[keep] for f in ("launch", "block", "warp", "event", "arg", "gt")}
    a, b = stamps[False], stamps[True]
    assert len(a["event"]) > 4 * 3 * 4  # op records of several launches and blocks
    for f in ("launch", "block", "warp", "event", "arg"):
        assert np.array_equal(a[f], b[f]), f
    same = (a["launch"][1:] == a["launch"][:-1]) & (a["block"][1:] == a["block"][:-1])
    assert (a["gt"][1:][same] >= a["gt"][:-1][same]).all()
    # a deferred op's wait ends at the instant its work begins (one saved time for both)
    rel = a["event"].astype(np.int64) - EVENTS.id("wait_embed_begin")
    wait_end = np.flatnonzero((rel >= 0) & (rel % 4 == 1))
    assert len(wait_end) and (a["event"][wait_end + 1] == a["event"][wait_end] + 1).all()
    assert np.array_equal(a["gt"][wait_end], a["gt"][wait_end + 1])
    assert (a["gt"][wait_end - 1] <= a["gt"][wait_end]).all() and (a["gt"][wait_end + 2] >= a["gt"][wait_end]).all()


def test_profile_launches_records_only_the_chosen_launches(tiny):
    """Engine.profile_launches samples launches: the others run the unprofiled build of the same
    plan (no buffer, no profiler code). The recorded launches hold the same op records (events,
    op indices, order) as when every launch is recorded, the rest hold none, and the outputs keep
    the bits of an unprofiled engine's."""
    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 4)
    plan = make_plan(cfg, 4, profile=True, profile_cap=1024)
    full = Engine(w, plan, base.clone(), backend="emu")
    out_full = full.step(toks, par, 40, mode="mega")
    assert full._plain is None  # every launch recorded: no second build
    n = len(full.program.launches)
    assert n >= 3
    pick = {1, n - 1}
    some = Engine(w, plan, base.clone(), backend="emu", profile_launches=pick)
    assert some._plain is not None and some._plain is not some.dll
    out_some = some.step(toks, par, 40, mode="mega")
    out_plain = Engine(w, make_plan(cfg, 4), base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    assert torch.equal(out_full.logits, out_some.logits) and torch.equal(out_full.tokens, out_some.tokens)
    assert torch.equal(out_plain.logits, out_some.logits)
    a, b = full.prof.read(), some.prof.read()
    assert set(np.unique(b.launch).tolist()) == pick
    assert set(np.unique(a.launch).tolist()) == set(range(n))
    for li in pick:
        ka, kb = a.launch == li, b.launch == li
        assert kb.sum() > 4
        for f in ("block", "warp", "slot", "event", "arg"):
            assert np.array_equal(getattr(a, f)[ka], getattr(b, f)[kb]), (li, f)
    assert not some.timeline("mega").problems
    some.profile_launches = None  # every launch again
    some.step(toks, par, 40, mode="mega")
    assert set(np.unique(some.prof.read().launch).tolist()) == set(range(n))
    with pytest.raises(ConfigError, match="launch indices run 0"):
        some.profile_launches = [some.prof.launches]
    with pytest.raises(ConfigError, match="profile=True"):
        Engine(w, make_plan(cfg, 4), base.clone(), backend="emu", profile_launches=[0])


@pytest.mark.parametrize("detail", [False, True])
def test_sentinel_topk_wait_ends_when_its_poll_does(tiny, detail):
    """With sentinel slots top-k has no counter to wait for: its wait is the poll inside the op.
    The profiler must still show it as top-k's wait, not its work: in each layer top-k's wait
    ends only after every router unit has begun (the poll cannot finish before they write).
    Stamped at op start, as for a counter wait, it ended before them. Both record kinds: deferred
    (the timeline's) and immediate (detail builds)."""
    from megakernel.profile_events import EVENTS

    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 4)
    eng = Engine(w, make_plan(cfg, 4, profile=True, profile_cap=1024, sentinel_route=True, profile_detail=detail),
                 base.clone(), backend="emu")
    eng.step(toks, par, 40, mode="mega")
    st = eng.prof.read()
    ev, arg, gt = st.event, st.arg, st.gt.astype(np.int64)
    for o in (o for o in eng.program.ops if o.kind == "topk"):
        router = o.deps[0].producer
        wait_end = gt[(ev == EVENTS.id("wait_topk_end")) & (arg == o.index)]
        router_begin = gt[(ev == EVENTS.id("router_begin")) & (arg == router)]
        assert len(wait_end) == 1 and len(router_begin) > 0
        assert wait_end[0] >= router_begin.max(), f"layer {o.layer}: top-k's wait ended before the router began"


def test_a_dynamic_ops_routing_wait_is_part_of_its_wait_phase(tiny):
    """An expert op first waits for the layer's routing, then for its units' inputs. Both are its
    wait phase: a block's op records leave no gap that long between one op's end and the next
    op's wait begin (stamped at the first unit, the routing wait fell in such a gap)."""
    from megakernel.profile_events import EVENTS

    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 4)
    eng = Engine(w, make_plan(cfg, 4, profile=True, profile_cap=1024), base.clone(), backend="emu")
    eng.step(toks, par, 40, mode="mega")
    st = eng.prof.read()
    ev, gt = st.event.astype(np.int64), st.gt.astype(np.int64)
    rel = ev - EVENTS.id("wait_embed_begin")
    topk = EVENTS.id("topk_begin")
    topk_dur = [gt[i + 1] - gt[i] for i in np.flatnonzero(ev == topk)]
    worst = 0
    for launch in np.unique(st.launch):
        for blk in np.unique(st.block):
            k = np.flatnonzero((st.launch == launch) & (st.block == blk) & (rel >= 0))
            ends, begins = k[rel[k] % 4 == 3], k[rel[k] % 4 == 0]
            for e in ends:  # each op's end -> the next op's wait begin on this block
                nxt = begins[begins > e]
                if len(nxt):
                    worst = max(worst, gt[nxt[0]] - gt[e])
    assert topk_dur and worst < 0.5 * min(topk_dur), (worst, topk_dur)


def test_profile_detail_stamps_staging_and_ring_waits_per_op(tiny):
    """profile_detail: the profiler also stamps each staging pass and each ring wait inside the
    units, each unit's opening and closing, and top-k's steps; the host assigns them to the op
    phase around them and splits the unit boundaries. The outputs keep their bits."""
    from megakernel.spans import BOUNDARY_SEGMENTS, detail_by_op, unit_boundaries

    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 3)
    default = Engine(w, make_plan(cfg, 4), base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    plan = make_plan(cfg, 4, profile=True, profile_detail=True, profile_cap=1024)
    assert "constexpr int PROFILE_DETAIL = 1;" in render(plan)
    assert "constexpr int PROFILE_DETAIL = 0;" in render(make_plan(cfg, 4, profile=True))
    eng = Engine(w, plan, base.clone(), backend="emu")
    out = eng.step(toks, par, 40, mode="mega")
    assert torch.equal(default.logits, out.logits) and torch.equal(default.tokens, out.tokens)
    tl = eng.timeline("mega")
    assert not tl.problems
    df = tl.spans_df()
    by = detail_by_op(df)
    # every op that stages an operand or streams weights shows up under its own name
    for op in ("qkv", "oproj", "router", "pool", "expert1", "expert2", "unpool", "lm_head"):
        assert by.get(("ring_wait", op), -1) >= 0, op
    for op in ("qkv", "oproj", "pool", "expert1", "expert2", "unpool", "lm_head"):
        assert by.get(("stage", op), -1) >= 0, op
    assert ("stage", "attn") not in by and ("ring_wait", "topk") not in by  # they stage nothing
    # each detail span lies inside the op phase it was assigned to; a unit's opening is stamped
    # from a block's second unit of an op on (the first's is the op's wait phase, before it)
    from megakernel.profile_events import DETAIL_PHASES

    ops = df[~df["phase"].isin(DETAIL_PHASES) & ~df["phase"].str.startswith("wait_")]
    for phases in (("stage", "ring_wait"), ("unit_open",), ("unit_close",)):
        det = df[df["phase"].isin(phases)]
        assert len(det), phases
        for _, d in det.head(200).iterrows():
            host = ops[(ops.launch == d.launch) & (ops.block == d.block) & (ops.begin_ns <= d.begin_ns)
                       & (ops.end_ns >= d.end_ns)]
            assert len(host) == 1, (phases, d.launch, d.block, d.begin_ns)
    # one closing per unit; an opening exactly for the units that open (program.cuh unit_opens):
    # a block's later unit of an op with a group dependency, or of a routed op's next slot
    from megakernel.spans import _detail_spans
    from megakernel.program import DEP_GROUP

    group_ops = {o.kind for o in eng.program.ops if any(d.mode == DEP_GROUP for d in o.deps)}
    tiles = {"expert1": cfg.d_expert // (plan.tiles["expert1"].rows // 2),
             "expert2": cfg.d_pool // plan.tiles["expert2"].rows}  # units of a slot
    m = _detail_spans(df).sort_values("begin_ns")
    want, got = set(), {(r.launch, r.block, r.op, r.arg) for r in m[m.phase == "unit_open"].itertuples()}
    for (launch, block, op), g in m[m.phase == "unit_close"].groupby(["launch", "block", "op"]):
        us = list(g["arg"])
        for prev, u in zip(us, us[1:]):
            if op in group_ops or (op in tiles and u // tiles[op] != prev // tiles[op]):
                want.add((launch, block, op, u))
    assert got == want and any(op in ("expert1", "expert2") for *_, op, _ in want)
    # top-k's three steps, once per layer, in order, not overlapping, inside its op phase
    steps = m[m.phase == "topk_step"]
    assert set(steps["op"]) == {"topk"} and len(steps) == 3 * cfg.n_layers
    for _, g in steps.groupby(["launch", "block"]):
        assert list(g["arg"]) == [0, 1, 2] * (len(g) // 3)
        assert (g["end_ns"].to_numpy()[:-1] <= g["begin_ns"].to_numpy()[1:]).all()
    from megakernel.spans import topk_steps

    ts = topk_steps(df)
    assert sorted(ts) == [0, 1, 2] and all(v >= 0 for v in ts.values())
    assert ts[1] == float(steps[steps.arg == 1]["dur_ns"].median()) * 1e-9
    # the unit boundaries split from them: an inner boundary has its closing and either the
    # segments up to its opening or, not opening, the direct one; ops that stage or stream weights
    # the segment after the opening
    bd = unit_boundaries(df)
    assert bd and {sg for sg, _ in bd} <= set(BOUNDARY_SEGMENTS) and min(bd.values()) >= 0
    opened = {op for sg, op in bd if sg == "open"}
    assert opened and all(("close", op) in bd and ("loop", op) in bd for op in opened)
    assert {op for sg, op in bd if sg == "start"} & {"expert1", "expert2"}
    assert {op for sg, op in bd if sg == "direct"} & {"oproj", "unpool", "lm_head"}
    # the slot crossings from the same closings: each routed op phase's units span one slot or more
    import pandas as pd

    from megakernel.plans import slot_units
    from megakernel.spans import end_tails, slot_crossings

    assert slot_units(plan) == tiles
    cr = slot_crossings(df, tiles)
    assert {op for _, op in cr} == {"expert1", "expert2"} and all(0 <= cr[("cross_fraction", op)] <= 1
                                                                  for op in ("expert1", "expert2"))
    # recounted from the closings (tiny's slots are one unit each, so here every block with more
    # than one unit crosses: the handmade test below tells crossings from one-slot runs)
    for op in ("expert1", "expert2"):
        units: dict = {}
        for r in m[(m.phase == "unit_close") & (m.op == op)].itertuples():
            units.setdefault((r.launch, r.block), set()).add(r.arg)
        n = pd.Series([len(v) for v in units.values()]).mode().iloc[0]
        like = [v for v in units.values() if len(v) == n]
        assert cr[("cross_fraction", op)] == pytest.approx(
            sum(len({u // tiles[op] for u in v}) > 1 for v in like) / len(like))
    tails = end_tails(df)
    assert {"expert1", "expert2", "oproj"} <= set(tails) and min(tails.values()) >= 0
    from megakernel.spans import layer_segments

    segs = layer_segments(df)
    assert set(segs) == {"front", "experts", "back"} and min(segs.values()) > 0
    with pytest.raises(ValueError, match="profile_detail needs profile=True"):
        make_plan(cfg, 4, profile_detail=True)


def test_end_tails_and_slot_crossings_on_a_handmade_timeline():
    """Two launches of three blocks: the tail is the last block's end after the median block's, per
    launch, then the median over launches; a block whose expert units span two slots (4 units a
    slot) is compared with the one-slot blocks of the same unit count only."""
    import pandas as pd

    from megakernel.spans import end_tails, slot_crossings

    rows = []
    for launch, ends in ((0, (10, 12, 19)), (1, (10, 11, 14))):
        for block, end in enumerate(ends):
            rows.append((launch, block, "expert1", 0, 0, end))
    # launch 0: block 0 units 0..2 (slot 0), block 1 units 3..5 (slots 0, 1), block 2 units 6, 7 (two units)
    for block, units in enumerate(((0, 1, 2), (3, 4, 5), (6, 7))):
        for u in units:
            rows.append((0, block, "unit_close", u, 1 + u, 2 + u))
    df = pd.DataFrame(rows, columns=["launch", "block", "phase", "arg", "begin_ns", "end_ns"])
    df["dur_ns"] = df["end_ns"] - df["begin_ns"]
    assert end_tails(df) == pytest.approx({"expert1": 5e-9})  # median of 19 - 12 and 14 - 11
    cr = slot_crossings(df, {"expert1": 4, "expert2": 4})
    # three-unit phases: block 0 (one slot, 10 ns) and block 1 (two slots, 12 ns); block 2 left out
    assert cr == pytest.approx({("cross_extra_s", "expert1"): 2e-9, ("cross_fraction", "expert1"): 0.5})
    assert slot_crossings(df, {"expert1": 8, "expert2": 8}) == {("cross_fraction", "expert1"): 0.0}


def test_layer_segments_on_a_handmade_timeline():
    """A layer launch splits around its expert phase: from the launch's start (median over blocks
    of each block's first phase) to the first gate/up unit, from there to the last down-projection
    unit's end, and on to the last phase's end; medians over the launches that run experts (the
    LM head's launch has none). Waits are not phases of an op."""
    import pandas as pd

    from megakernel.spans import layer_segments

    rows = []
    # launch 0: blocks start at 0, 2, 4 (median 2); experts 12..45; the last phase ends at 50
    for block, (b0, e1, e2) in enumerate(((0, (12, 30), (30, 40)), (2, (14, 32), (33, 45)), (4, (15, 31), (31, 41)))):
        rows += [(0, block, "wait_attn", b0, b0 + 1), (0, block, "attn", b0 + 1, 10),
                 (0, block, "expert1", *e1), (0, block, "expert2", *e2), (0, block, "qkv", 46, 50 - block)]
    # launch 1: start 100; experts 110..130; end 140 (a wait after it does not count)
    for block in range(3):
        rows += [(1, block, "attn", 100, 105), (1, block, "expert1", 110 + block, 120),
                 (1, block, "expert2", 120, 128 + block), (1, block, "unpool", 131, 140 - block),
                 (1, block, "wait_qkv", 140, 150)]
    rows += [(2, 0, "lm_head", 200, 260)]
    df = pd.DataFrame(rows, columns=["launch", "block", "phase", "begin_ns", "end_ns"])
    df["arg"], df["dur_ns"] = 0, df["end_ns"] - df["begin_ns"]
    segs = layer_segments(df)
    # front: 12 - 2, 110 - 100; experts: 45 - 12, 130 - 110; back: 50 - 45, 140 - 130
    assert segs == pytest.approx({"front": 10e-9, "experts": 26.5e-9, "back": 7.5e-9})
    assert layer_segments(df[df["launch"] == 2]) == {}


def test_placement_counts_blocks_that_keep_their_sm():
    """sm_map.placement on handmade records: launch 1 keeps every block on its SM, launch 2 swaps
    blocks 0 and 5, launch 3 misses a block (not counted); a block recorded on two SMs in one
    launch, or no two consecutive complete launches, are refused."""
    from megakernel.sm_map import placement

    sms = {0: [10, 11, 12, 13, 14, 15], 1: [10, 11, 12, 13, 14, 15], 2: [15, 11, 12, 13, 14, 10]}
    launch, block, sm = [], [], []
    for lc, row in sms.items():
        for b, s in enumerate(row):
            launch += [lc, lc]  # two records a block
            block += [b, b]
            sm += [s, s]
    launch.append(3), block.append(0), sm.append(10)
    m = placement(np.asarray(launch), np.asarray(block), np.asarray(sm), 6)
    assert m.launches == 2 and m.blocks == 6 and m.same_sm == pytest.approx(10 / 12)
    assert m.per_launch == pytest.approx((1.0, 4 / 6))
    with pytest.raises(ValueError, match="recorded on SMs"):
        placement(np.asarray([0, 0]), np.asarray([1, 1]), np.asarray([3, 4]), 6)
    with pytest.raises(ValueError, match="no two consecutive"):
        placement(np.asarray([0]), np.asarray([0]), np.asarray([0]), 6)


def test_the_placement_result_round_trips(tmp_path):
    """sm_map.to_result saves a typed megakernel.sm_map: a series per build whose samples are the
    launch transitions' same-SM shares, and the share as a derived value, never gated."""
    from megakernel.sm_map import BENCHMARK, Placement, to_result
    from microbench.results import Env, latest

    m = Placement(3, 132, 0.02, (0.01, 0.02, 0.03))
    to_result([("shard8", 16, 2048, "k48", (("keys_per_split", 48),), m)], env=Env.capture()).save(tmp_path)
    r = latest(BENCHMARK, root=tmp_path)
    (s,) = r.series
    assert list(s.samples) == [0.01, 0.02, 0.03] and s.params["switches"] == {"keys_per_split": 48}
    assert s.metrics["gate_direction"] == "none"
    assert r.derived["same_sm_shard8_T16_ctx2048_k48"].value == pytest.approx(0.02)


def test_sm_map_refuses_a_source_tree_a_bad_point_and_no_gpu(capsys, monkeypatch):
    from megakernel import cli

    assert cli.main(["sm-map", "--point", "shard8:16"]) == 2
    assert "PRESET:T:CTX" in capsys.readouterr().err
    assert cli.main(["sm-map", "--variant", f"v={cli.__file__.rsplit('/', 1)[0]}/csrc"]) == 2
    assert "not a source tree" in capsys.readouterr().err
    monkeypatch.setattr("megakernel.cli.no_gpu_reason", lambda: "no CUDA device (test)")
    assert cli.main(["sm-map", "--variant", "k48:keys_per_split=48"]) == 2
    assert "sm-map needs a GPU: no CUDA device (test)" in capsys.readouterr().err


def test_the_kernel_runs_each_op_on_the_blocks_program_py_names(tiny):
    """The profiled emulation's op phases, per (launch, block), are exactly the op instances
    program.assigned_units gives that block: the kernel's my_units and its mirror agree (the
    routed ops, whose unit counts follow the routing, left out)."""
    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 16, 40)
    t, ctx, grid = 16, 40, 4
    plan = make_plan(cfg, grid, spin_bound_ns=3_000_000_000, profile=True, profile_cap=1024)
    eng = Engine(w, plan, base.clone(), backend="emu", grid=grid)
    eng.step(toks, par, ctx, mode="mega")
    static = {o.kind for o in eng.program.ops} - {"expert1", "expert2"}
    ran = {(s.arg, s.block) for s in eng.timeline("mega").spans if s.phase in static}
    want = set()
    for o in eng.program.ops:
        if o.kind in static:
            total = n_units(plan, o.kind, o.layer, t, ctx, 0)
            want |= {(o.index, b) for b in range(grid) if assigned_units(o, b, grid, total)}
    assert ran == want and len({b for _, b in ran}) == grid
