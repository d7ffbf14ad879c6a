"""The megakernel's schedule on the CPU: the program of a step (op instances, launches, units,
dependencies, signals) and the torch interpreter running it in random orders that respect only
the declared dependencies."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel.config import preset
from megakernel.interp import Interpreter
from megakernel.plan import make_plan, render
from megakernel.program import DEP_ALL, OpInst, Program, assigned_units, build, check, n_units
from megakernel.runtime import check_close

from megakernel_cases import fusable, reference_logits, step_inputs, tiny


@pytest.mark.parametrize("mode", ["layer", "step"])
def test_program_structure(tiny, mode):
    cfg, _, _, plan = tiny
    prog = build(plan, mode)
    check(prog)
    assert len(prog.launches) == (cfg.n_layers + 1 if mode == "layer" else 1)
    assert sum(n for _, n in prog.launches) == len(prog.ops)
    kinds = [o.kind for o in prog.ops]
    assert kinds.count("qkv") == cfg.n_layers and kinds[-2:] == ["lm_head", "argmax"]
    assert prog.encode().shape == (len(prog.ops) * 16,)


@pytest.mark.parametrize("name,n_sm,rows,apart", [("shard8", 132, 32, True), ("small", 132, 16, True),
                                                   ("shard8", 80, 16, False)])
def test_router_pool_and_topk_blocks(name, n_sm, rows, apart):
    """Top-k waits for the router, expert GEMM 1 for top-k and the pooler. Where the router's and
    the pooler's units fit the grid side by side (shard8: only with 32-row pool units), no block
    runs both and top-k runs on a block with neither; on a grid too small for that, pool units stay
    16 rows and every block runs at most one pool unit more than another."""
    plan = make_plan(preset(name), n_sm)
    assert plan.tiles["pool"].rows == rows
    prog = build(plan)
    for layer in (0, plan.cfg.n_layers - 1):
        blocks = {}
        for o in prog.ops:
            if o.layer == layer and o.kind in ("router", "pool", "topk"):
                total = n_units(plan, o.kind, layer, 16, 64, 0)
                per = [len(assigned_units(o, b, n_sm, total)) for b in range(n_sm)]
                assert max(per) - min(per) <= 1, o.kind
                blocks[o.kind] = {b for b in range(n_sm) if per[b]}
        assert len(blocks["topk"]) == 1
        assert not blocks["topk"] & (blocks["router"] | blocks["pool"]) or not apart
        assert bool(blocks["router"] & blocks["pool"]) != apart


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interpreter_in_random_orders_matches_program_order_and_reference(tiny, seed):
    cfg, w, base, plan = tiny
    toks, par = step_inputs(cfg, 16, seed)
    ref, routes = reference_logits(w, base.clone(), toks, par, 40)
    in_order = Interpreter(w, build(plan), base.clone()).run(toks, par, 40, routes=routes, order="program")
    check_close(in_order, ref, "interpreter", rel=5e-3)
    shuffled = Interpreter(w, build(plan), base.clone()).run(toks, par, 40, routes=routes, seed=seed)
    assert torch.equal(in_order, shuffled)  # every unit is deterministic: any valid order, same bits


def test_a_missing_dependency_is_caught_by_random_orders(tiny):
    """Drop oproj's wait for the attention combine: some order then reads unwritten (NaN)
    attention output, and the check fails. Proves the random-order check can fail."""
    cfg, w, base, plan = tiny
    prog = build(plan)
    ops = list(prog.ops)
    i = next(o.index for o in ops if o.kind == "oproj")
    ops[i] = OpInst(**{**ops[i].__dict__, "deps": ()})
    broken = Program(plan, tuple(ops), prog.launches, prog.n_counters, prog.mode)
    toks, par = step_inputs(cfg, 8, 0)
    good = Interpreter(w, prog, base.clone()).run(toks, par, 40, order="program")
    caught = 0
    for seed in range(6):
        try:
            got = Interpreter(w, broken, base.clone()).run(toks, par, 40, seed=seed, program=broken)
            caught += not torch.equal(got, good)  # NaN (read before written) or a different value
        except RuntimeError:  # a unit choked on unwritten (NaN) input
            caught += 1
    assert caught > 0


def test_fused_expert_plan_and_program(fusable):
    """Plan.fused_experts: the down projection's unit j of a slot is gate/up unit j's K-part (its
    gate rows' columns of W2, all d_pool rows in chunks), on the same block (DEP_LOCAL: same
    contiguous assignment, same unit count), so gate/up publishes no groups; red holds no down
    projection results; refused, with the reason, where the shapes do not allow it."""
    from megakernel.plans import plan_for, slot_units
    from megakernel.plan import fuses_experts
    from megakernel.program import ASSIGN_CONTIG, DEP_LOCAL, SIGNAL_GROUPS

    cfg, _, _, plan = fusable
    h1 = plan.tiles["expert1"].rows // 2
    t2 = plan.tiles["expert2"]
    assert (t2.kc, t2.k, cfg.d_pool % t2.rows) == (h1, cfg.d_expert, 0) and plan.fused_parts == cfg.d_expert // h1
    wide = dataclasses.replace(plan, tiles={**plan.tiles, "expert2": dataclasses.replace(t2, rows=8 * t2.rows)})
    assert wide.red_bytes == plan.red_bytes  # its results never pass through red
    # kept units: as many as the spare shared memory holds, capped by keep_max
    assert plan.keep_units >= 2
    capped = make_plan(cfg, 4, spin_bound_ns=3_000_000_000, ring_stage_bytes=16384, fused_experts=True, keep_max=1)
    assert capped.keep_units == 1 and dataclasses.replace(capped, keep_units=plan.keep_units) == plan
    for bad in (-1, 17, 1.5):
        with pytest.raises(ValueError, match="keep_max"):
            make_plan(cfg, 4, fused_experts=True, keep_max=bad)
    assert 0 < plan.keep_units and plan.smem_bytes <= 232448
    assert "constexpr bool FUSED_EXPERTS = true;" in render(plan)
    prog = build(plan)
    check(prog)
    by = {o.kind: o for o in prog.ops if o.layer == 1}
    e1, e2 = by["expert1"], by["expert2"]
    assert [(prog.ops[d.producer].kind, d.mode) for d in e2.deps][1] == ("expert1", DEP_LOCAL)
    assert e1.assign == e2.assign == ASSIGN_CONTIG and not e1.signal & SIGNAL_GROUPS
    assert n_units(plan, "expert2", 1, 16, 40, 7) == n_units(plan, "expert1", 1, 16, 40, 7)
    assert slot_units(plan) == {"expert1": plan.fused_parts, "expert2": plan.fused_parts}
    bad = Program(plan, prog.ops, prog.launches, prog.n_counters, prog.mode)
    with pytest.raises(AssertionError, match="block-local"):
        check(dataclasses.replace(bad, plan=dataclasses.replace(plan, fused_experts=False)))
    assert not fuses_experts(preset("tiny")) and fuses_experts(preset("shard8")) and fuses_experts(preset("small"))
    with pytest.raises(ValueError, match="fused_experts"):
        make_plan(preset("tiny"), 4, fused_experts=True)
    assert not plan_for("tiny", None, 4).fused_experts and plan_for("shard8", None, 132).fused_experts


@pytest.mark.parametrize("mode", ["layer", "step"])
@pytest.mark.parametrize("sentinel", [False, True])
def test_an_op_bumps_exactly_the_counters_its_consumers_wait_for(tiny, sentinel, mode):
    """OpInst.signal: the total counter only where some consumer waits for all of the op, the
    group counters only where one waits for a group (each bump is a release fence on its block's
    critical path). The by-group producers (attn, expert1; qkv in one launch per step) must not
    release their total; a consumer whose counter were skipped would hang, which the emulated
    steps elsewhere catch. With a launch per layer no op waits for an earlier launch (stream
    order has it done), so qkv, the last op of a layer's launch, signals nothing."""
    from megakernel.program import DEP_ALL, DEP_GROUP, SIGNAL_GROUPS, SIGNAL_TOTAL

    cfg = tiny[0]
    prog = build(make_plan(cfg, 4, sentinel_route=sentinel), mode)
    check(prog)
    launch_of = {i: li for li, (first, n) in enumerate(prog.launches) for i in range(first, first + n)}
    assert all(launch_of[d.producer] == launch_of[o.index] for o in prog.ops for d in o.deps)
    for o in prog.ops:
        modes = {d.mode for c in prog.ops for d in c.deps if d.producer == o.index}
        want = (SIGNAL_TOTAL if DEP_ALL in modes else 0) | (SIGNAL_GROUPS if DEP_GROUP in modes else 0)
        assert o.signal == want, (o.kind, o.layer, o.signal, modes)
    by_kind = {}
    for o in prog.ops:
        by_kind.setdefault(o.kind, set()).add(o.signal)
    for k in ("attn", "expert1"):
        assert by_kind[k] == {SIGNAL_GROUPS}, k
    assert by_kind["qkv"] == ({0} if mode == "layer" else {SIGNAL_GROUPS})
    attn = [o for o in prog.ops if o.kind == "attn"]
    assert all(not o.deps for o in attn) if mode == "layer" else all(len(o.deps) == 1 for o in attn)
    for k in ("attn_combine", "oproj", "pool", "topk", "expert2", "moe_combine", "unpool"):
        assert by_kind[k] == {SIGNAL_TOTAL}, k
    assert by_kind["router"] == ({0} if sentinel else {SIGNAL_TOTAL})


@pytest.mark.parametrize("name,n_sm", [("shard8", 132), ("small", 132), ("tiny", 4), ("tiny", 3)])
def test_every_unit_runs_once_and_the_blocks_share_an_op_evenly(name, n_sm):
    """assigned_units (program.cuh my_units' mirror): every unit of a static op on exactly one
    block, no block more than one unit ahead of another; a one-block grid (chain mode's launches)
    runs them all."""
    plan = make_plan(preset(name), n_sm)
    prog = build(plan)
    for o in prog.ops:
        if o.kind in ("expert1", "expert2"):
            continue  # their unit count follows the routing (the emulated steps run them)
        total = n_units(plan, o.kind, o.layer, 16, 64, 0)
        runs = [list(assigned_units(o, b, n_sm, total)) for b in range(n_sm)]
        assert sorted(u for us in runs for u in us) == list(range(total)), o.kind
        per = [len(us) for us in runs]
        assert max(per) - min(per) <= 1, o.kind
        assert list(assigned_units(o, 0, 1, total)) == list(range(total))
