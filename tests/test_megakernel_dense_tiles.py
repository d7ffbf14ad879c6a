"""Dense token tiles (Plan.dense_tiles): the bf16 projections of each run of consecutive row groups
as one set of units, each weight chunk streamed once and multiplied by every group's 16-row token
tile in its own region of abuf. Through the host emulation at random and adversarial schedules:
each request bitwise its own B=1 step and close to the reference, mega bitwise chain, with whole
runs, a group left alone past the last run, a one-row group in a run, operands in panels, the
fused expert GEMMs (speculative full trees: tests/test_megakernel_spec_groups.py). Mutations (a
follower's dependencies not waited for, the regions' tags kept from the last run, every group
multiplied by region 0's rows, region 0's norm factors for every group, a follower running its
units again) must make those checks fail."""
from __future__ import annotations

import pytest

from microbench.errors import SpinTimeoutError

from megakernel import ab
from megakernel.batch import check_batch, make_requests, random_caches
from megakernel.plan import DENSE_TILED, KernelDoesNotFitError, make_plan
from megakernel.program import TILE_FOLLOW, TILE_LEAD, TILE_SHIFT, build, check, grouped
from megakernel.runtime import EmulationError

from megakernel_cases import fusable, mutated_csrc, tiny  # noqa: F401 (fixtures)

SHAPES = {"2x16": ((16, 5), (16, 40)), "mixed": ((16, 5), (9, 40), (12, 0)),
          "4x16": ((16, 3), (16, 0), (16, 64), (16, 20)), "1+16": ((1, 5), (16, 40))}


def _tiles_plan(plan, groups, nt=2, **kw):
    return make_plan(plan.cfg, plan.n_sm, spin_bound_ns=plan.spin_bound_ns, ring_stage_bytes=plan.ring_stage_bytes,
                     fused_experts=plan.fused_experts, row_groups=groups, dense_tiles=nt, **kw)


def test_dense_tiles_refuse_what_they_cannot_build(tiny):
    cfg = tiny[0]
    assert make_plan(cfg, 4).dense_tiles == 1 and make_plan(cfg, 4, row_groups=2).dense_tiles == 1
    with pytest.raises(ValueError, match="dense_tiles 3: want 1"):
        make_plan(cfg, 4, row_groups=4, dense_tiles=3)
    with pytest.raises(ValueError, match="need row_groups >= 4"):
        make_plan(cfg, 4, row_groups=2, dense_tiles=4)
    with pytest.raises(KernelDoesNotFitError, match="for 2 dense token tiles"):
        make_plan(cfg, 4, row_groups=2, dense_tiles=2, smem_limit=make_plan(cfg, 4, row_groups=2).smem_bytes)
    # a region per group of a run, each 16 rows of the widest dense operand it stages at once
    p = make_plan(cfg, 4, row_groups=4, dense_tiles=4)
    assert p.abuf_bytes >= 4 * p.abuf_region == 4 * 16 * (max(p.norm_k, p.tile_kp("oproj"), p.tile_kp("unpool")) * 2 + 16)


def test_tiled_program_runs_each_run_from_its_leader(tiny):
    """Whole runs of DENSE_TILED instances: the leader first, its followers right after, one
    rotation for the run (unit u of each on one block), the role above the group in the record;
    groups past the last whole run alone; program.check refuses a run whose blocks differ."""
    plan = _tiles_plan(tiny[3], 3)
    prog = grouped(build(plan), 3)
    tiled = [o for o in prog.ops if o.tile]
    assert {o.kind for o in tiled} == set(DENSE_TILED)
    for o in prog.ops:
        if o.kind not in DENSE_TILED:
            assert o.tile == 0
        elif o.group == 2:  # the third group has no run: it goes alone, a third of the grid round
            assert o.tile == 0
        else:
            assert o.tile == (TILE_LEAD if o.group == 0 else TILE_FOLLOW)
            lead = prog.ops[o.index - o.group]
            assert (lead.kind, lead.layer, lead.rot, lead.tile) == (o.kind, o.layer, o.rot, TILE_LEAD)
    rec = prog.encode().reshape(len(prog.ops), -1)[:, 15]
    assert [int(r) & ((1 << TILE_SHIFT) - 1) for r in rec] == [o.group for o in prog.ops]
    assert [int(r) >> TILE_SHIFT for r in rec] == [o.tile for o in prog.ops]
    bad = list(prog.ops)
    i = next(o.index for o in prog.ops if o.tile == TILE_FOLLOW and o.kind == "oproj")
    bad[i] = type(bad[i])(**{**bad[i].__dict__, "rot": bad[i].rot + 1})
    with pytest.raises(AssertionError, match="differ in op, blocks or groups"):
        check(type(prog)(**{**prog.__dict__, "ops": tuple(bad)}))


@pytest.mark.parametrize("shape,nt", [("2x16", 2), ("mixed", 2), ("4x16", 2), ("4x16", 4), ("1+16", 2)])
def test_tiled_requests_are_bitwise_their_own_b1_steps(tiny, shape, nt):
    """batch.check_batch with dense token tiles: each request against its own B=1 step (bitwise),
    mega against chain at random and adversarial schedules (bitwise), and against the reference.
    "mixed" leaves its third group alone; "1+16" runs a one-row group beside a full one."""
    cfg, w, _, base_plan = tiny
    reqs_shape = SHAPES[shape]
    n = len(reqs_shape)
    plan = _tiles_plan(base_plan, n, nt)
    scheds = ("random", "last", "block") if shape == "4x16" else ("random", "last")
    res = check_batch(w, plan, random_caches(cfg, n, seed=n + 30), make_requests(cfg, reqs_shape, seed=n + 30),
                      schedules=scheds, seed=n + nt)
    assert res.ok, res.lines()
    assert all(res.alone) and all(res.greedy) and len(res.chain) == len(scheds)


def test_tiled_operands_in_panels_and_fused_experts(tiny, fusable):
    """oproj's operand in two panels of a region (a 4 KB ring stage: 64-column chunks, oproj's K
    of 256 staged 128 columns at a time), and a fused expert build (kept gate/up units beside the
    regions): both bitwise their B=1 steps and mega == chain."""
    cfg, w, _, base_plan = tiny
    plan = make_plan(cfg, base_plan.n_sm, spin_bound_ns=base_plan.spin_bound_ns, ring_stage_bytes=4096, row_groups=2,
                     dense_tiles=2)
    assert plan.tile_kp("oproj") < plan.cfg.attn_width
    res = check_batch(w, plan, random_caches(cfg, 2, seed=11), make_requests(cfg, SHAPES["2x16"], seed=11),
                      schedules=("random",), seed=5)
    assert res.ok, res.lines()
    fcfg, fw, _, fplan = fusable
    plan = _tiles_plan(fplan, 2)
    assert plan.fused_experts and plan.keep_units > 0
    res = check_batch(fw, plan, random_caches(fcfg, 2, seed=12), make_requests(fcfg, SHAPES["2x16"], seed=12),
                      schedules=("random", "last"), seed=6)
    assert res.ok, res.lines()


# name: (file under csrc/, old, new, schedule, shape, groups, emulated grid)
MUTATIONS = {
    # the leader computes its followers' groups without waiting for their producers
    "followers' dependencies not waited for": (
        "mk/program.cuh", "&& op_role(*b.p, i) == TILE_LEAD) fail = !wait_run(b, i, u);",
        "&& op_role(*b.p, i) == TILE_LEAD) fail = false;", "last", "2x16", 2, None),
    # region 1 keeps the last run's operand (router of groups 2 and 3) for this run's (pool of 0 and 1)
    "regions' tags kept from the last run": (
        "mk/program.cuh", "  for (int k = 0; k < 2 * (DENSE_TILES - 1); ++k) b.misc[MISC_TTAG + k] = -1;\n", "",
        "random", "4x16", 4, None),
    # every group's sums from region 0's token rows (the GEMM core's region address)
    "every group multiplied by region 0": (
        "mk/gemm.cuh", "const SAddr bn = bb + n * ABUF_REGION + j * 32;", "const SAddr bn = bb + j * 32;",
        "random", "2x16", 2, None),
    # every group's epilogue scaled by region 0's norm factors (its own group's)
    "region 0's norm factors for every group": (
        "mk/gemm.cuh", "{ return rnorm_at(b)[t]; }", "{ return reinterpret_cast<const float*>(b.misc + MISC_RNORM)[t]; }",
        "random", "2x16", 2, None),
    # a follower runs its units again: it waits for weight chunks the loader never streams (the
    # watchdog names the ring wait)
    "a follower computing its units": (
        "mk/program.cuh", "        else if (role != TILE_FOLLOW) run_unit(b, i, o0, u);", "        else run_unit(b, i, o0, u);",
        "random", "2x16", 2, None),
}


def _caught(res) -> bool:
    return not res.ok and (not all(res.chain.values()) or not all(res.alone)
                           or any("vs reference" in p for p in res.problems))


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_tiles_checks_catch_a_mutated_kernel(tiny, tmp_path, name):
    """The real kernel passes check_batch on the mutation's shape; the mutated one fails it (or a
    wait runs into the watchdog, or the emulation refuses a divergent barrier)."""
    rel, old, new, schedule, shape, groups, grid = MUTATIONS[name]
    cfg, w, _, base_plan = tiny
    plan = make_plan(cfg, base_plan.n_sm, spin_bound_ns=1_000_000_000, row_groups=groups, dense_tiles=2)
    reqs, caches0 = make_requests(cfg, SHAPES[shape], seed=7), random_caches(cfg, groups, seed=7)
    good = check_batch(w, plan, caches0, reqs, schedules=(schedule,), seed=3, grid=grid)
    assert good.ok, good.lines()
    with ab.kernel_tree(mutated_csrc(tmp_path, rel, old, new)):
        try:
            bad = check_batch(w, plan, caches0, reqs, schedules=(schedule,), seed=3, grid=grid)
        except SpinTimeoutError:
            return
        except EmulationError as e:
            assert "different barrier instructions" in str(e) or "timed out" in str(e), e
            return
    assert _caught(bad), bad.lines()
