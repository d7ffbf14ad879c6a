"""Row groups (groups.GroupEngine, program.grouped, Plan.row_groups): steps of more token rows than
one m16 tile, whole requests packed into groups of at most 16 rows whose op instances interleave in
one launch. Through the host emulation at random and adversarial schedules: mega bitwise chain,
each request bitwise its own B=1 step (logits, tokens, KV cache) and close to the reference, with
the split and the fused expert GEMMs. Mutations (a group's cached operand or slot record reused by
another group, in the compute warps or the loader, the groups sharing one pair of routed-count
copies, a group's dependency pointing at group 0's producer) must make those checks fail."""
from __future__ import annotations

import pytest
import torch

from microbench.errors import SpinTimeoutError

from megakernel import ab
from megakernel.batch import check_batch, engine_for, make_requests, random_caches
from megakernel.config import ConfigError
from megakernel.groups import GroupEngine, pack_groups
from megakernel.plan import make_plan
from megakernel.plans import rows_switches
from megakernel.interp import Interpreter
from megakernel.program import DEP_LOCAL, Dep, build, check, grouped
from megakernel.runtime import EmulationError, Engine
from megakernel.spans import op_time_by_group

from megakernel_cases import fusable, mutated_csrc, tiny  # noqa: F401 (fixtures)

# (T_r, ctx_r) per request, past 16 rows: two full trees; three requests packing into 3 groups
# (16 | 9 | 12: 9 + 12 > 16), contexts past tiny's window of 16 and at 0; four full trees
SHAPES = {"2x16": ((16, 5), (16, 40)), "mixed": ((16, 5), (9, 40), (12, 0)),
          "4x16": ((16, 3), (16, 0), (16, 64), (16, 20))}


def _grouped_plan(plan, groups):
    # the per-group build (union_experts off, the ablation): every op once per group, the structure
    # the default union build keeps for all but the routed experts (tests/test_megakernel_union.py)
    return make_plan(plan.cfg, plan.n_sm, spin_bound_ns=plan.spin_bound_ns, ring_stage_bytes=plan.ring_stage_bytes,
                     fused_experts=plan.fused_experts, row_groups=groups, union_experts=False)


def test_pack_groups_keeps_requests_whole_and_in_order():
    assert pack_groups([16, 16], 16) == [range(0, 1), range(1, 2)]
    assert pack_groups([16, 9, 12], 16) == [range(0, 1), range(1, 2), range(2, 3)]
    assert pack_groups([4, 4, 4, 4, 8, 8], 16) == [range(0, 4), range(4, 6)]
    assert pack_groups([1] * 17, 16) == [range(0, 16), range(16, 17)]
    with pytest.raises(ConfigError, match="request 1: 17 token rows"):
        pack_groups([1, 17], 16)


def test_rows_switches_name_the_build_of_a_row_count(tiny):
    cfg = tiny[0]
    assert rows_switches(cfg, 16) == {"tokens": 16}
    assert rows_switches(cfg, 32) == {"tokens": 16, "row_groups": 2}
    assert rows_switches(cfg, 128) == {"tokens": 16, "row_groups": 8}
    with pytest.raises(ConfigError, match="at most 128"):
        rows_switches(cfg, 129)


def test_grouped_program_keeps_each_group_to_itself(fusable):
    """Each instance once per group, dependencies inside the group, counters disjoint, launches
    the plain program's (each `groups` times as long), and a fused gate/up right before its own
    group's down projection; program.check refuses a dependency across groups."""
    _, _, _, base_plan = fusable
    plan = _grouped_plan(base_plan, 3)
    assert plan.fused_experts
    one = build(plan)
    prog = grouped(one, 3)
    assert len(prog.ops) == 3 * len(one.ops) and prog.groups == 3 and prog.n_counters == 3 * one.n_counters
    assert [n for _, n in prog.launches] == [3 * n for _, n in one.launches]
    seen = {}
    for o in prog.ops:
        assert all(prog.ops[d.producer].group == o.group for d in o.deps)
        seen.setdefault((o.kind, o.layer), []).append(o.group)
        ctrs = {o.counter} | (set(range(o.group_base, o.group_base + o.n_groups)) if o.n_groups else set())
        assert all(o.group * one.n_counters <= c < (o.group + 1) * one.n_counters for c in ctrs)
        if any(d.mode == DEP_LOCAL for d in o.deps):
            assert prog.ops[o.index - 1].kind == "expert1" and prog.ops[o.index - 1].group == o.group
    assert all(sorted(g) == [0, 1, 2] * (len(g) // 3) for g in seen.values())
    # each group a third of the grid further round, both assignments (a fused pair together)
    for o in prog.ops:
        base = next(b for b in one.ops if (b.kind, b.layer) == (o.kind, o.layer))
        assert o.rot == (base.rot + o.group * plan.n_sm // 3) % plan.n_sm
    assert [int(r[15]) for r in prog.encode().reshape(len(prog.ops), -1)] == [o.group for o in prog.ops]
    bad = list(prog.ops)
    i = next(o.index for o in prog.ops if o.group == 1 and o.kind == "oproj")
    bad[i] = type(bad[i])(**{**bad[i].__dict__, "deps": (Dep(bad[i].deps[0].producer - 1, bad[i].deps[0].mode),)})
    with pytest.raises(AssertionError, match="of group 1 waits for group 0"):
        check(type(prog)(**{**prog.__dict__, "ops": tuple(bad)}))
    with pytest.raises(ValueError, match="1..3"):
        grouped(one, 4)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_grouped_requests_are_bitwise_their_own_b1_steps(tiny, shape):
    """batch.check_batch past 16 rows: each request against its own B=1 step (bitwise), mega
    against chain at the random and adversarial schedules (bitwise), and against the reference."""
    cfg, w, _, base_plan = tiny
    reqs_shape = SHAPES[shape]
    n = len(reqs_shape)
    plan = _grouped_plan(base_plan, len(pack_groups([t for t, _ in reqs_shape], cfg.max_tree)))
    scheds = ("random", "last", "block") if shape == "4x16" else ("random", "last")
    res = check_batch(w, plan, random_caches(cfg, n, seed=n + 20), make_requests(cfg, reqs_shape, seed=n + 20),
                      schedules=scheds, seed=n)
    assert res.ok, res.lines()
    assert all(res.alone) and all(res.greedy) and len(res.chain) == len(scheds)


def test_grouped_fused_experts_keep_their_own_groups_units(fusable):
    """The fused expert unit keeps gate/up activations in shared memory for its down projection:
    across interleaved groups a kept unit must serve its own group only."""
    cfg, w, _, base_plan = fusable
    plan = _grouped_plan(base_plan, 2)
    assert plan.fused_experts and plan.keep_units > 0
    shape = ((16, 7), (16, 30))
    res = check_batch(w, plan, random_caches(cfg, 2, seed=5), make_requests(cfg, shape, seed=5),
                      schedules=("random", "last"), seed=2)
    assert res.ok, res.lines()


def test_a_grouped_step_launched_one_launch_at_a_time_gives_its_own_bits(tiny):
    """The profiling path (cli.ncu-mega --batch: _launches_profiled over GroupEngine.launches and
    _launch) runs the prepared step's launches one by one, PDL off: the step's logits, tokens and
    caches must be bitwise launch_step's. Before a step is prepared it has no launches."""
    cfg, w, _, base_plan = tiny
    plan = _grouped_plan(base_plan, 2)
    reqs = make_requests(cfg, SHAPES["2x16"], seed=3)
    whole = engine_for(w, plan, random_caches(cfg, 2, seed=3), backend="emu", emu_schedule="last")
    with pytest.raises(ConfigError, match="prepare_batch first"):
        whole.launches()
    ref = whole.step_batch(reqs, routes=None)
    eng = engine_for(w, plan, random_caches(cfg, 2, seed=3), backend="emu", emu_schedule="last")
    eng.prepare_batch(reqs)
    launches = eng.launches("mega")
    assert len(launches) == len(eng.program.launches) > 1
    eng.counters[eng.parity].zero_()
    for li, (first, n, wait, grid) in enumerate(launches):
        eng._launch(first, n, wait, grid, li)
    eng._check_watchdog(True)
    for g, m in zip(eng._groups, eng.members):
        n = sum(eng._rows[r] for r in g)
        mine = m.buf["logits"][:n]
        assert torch.equal(mine, ref.logits[ref.row0[g.start]:ref.row0[g.start] + n])
    for a, b in zip(eng.caches, whole.caches):
        assert all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v))


def test_a_profiled_grouped_step_keeps_its_bits_and_records_every_groups_ops(tiny):
    """GroupEngine with the in-kernel profiler: one buffer, a slice per launch of the grouped
    program (chain: groups times the plain step's launches). Each step, chain then mega, is bitwise
    the unprofiled build's; every op instance of every group has its work phase in the timeline
    (arg: its op index); and the mega step's timeline holds its own launches only, not the slices
    the longer chain step before it recorded (the buffer's epoch is reset per step)."""
    cfg, w, _, base_plan = tiny
    plan = _grouped_plan(base_plan, 2)
    prof_plan = make_plan(cfg, base_plan.n_sm, spin_bound_ns=base_plan.spin_bound_ns, row_groups=2, profile=True,
                          profile_cap=512)
    reqs = make_requests(cfg, SHAPES["2x16"], seed=9)
    eng = engine_for(w, prof_plan, random_caches(cfg, 2, seed=9), backend="emu")
    for mode in ("chain", "mega"):
        ref = engine_for(w, plan, random_caches(cfg, 2, seed=9), backend="emu").step_batch(reqs, mode=mode)
        eng.caches = random_caches(cfg, 2, seed=9)
        out = eng.step_batch(reqs, mode=mode)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens), mode
        tl = eng.timeline(mode)
        assert not tl.problems, tl.problems[:3]
        df = tl.spans_df()
        ops = eng.program.ops
        assert {o.group for o in ops} == {0, 1}
        assert {(o.kind, o.index) for o in ops} <= {(ph, int(a)) for ph, a in zip(df["phase"], df["arg"])}, mode
        assert int(df["launch"].max()) < len(eng.launches(mode)), mode
        by = {(k, g): (work, wait) for k, g, work, wait in op_time_by_group(df, eng.program)}
        assert set(by) == {(o.kind, o.group) for o in ops} and all(work > 0 for work, _ in by.values())


def test_the_layer_weight_model_counts_dense_per_group_and_experts_as_streamed(tiny):
    """batch.layer_weight_model (ncu-mega --batch prints it beside a launch's DRAM reads): dense
    bytes once and once per group; experts as each build streams them, the roofline's distinct
    count the least of them."""
    from megakernel.batch import layer_weight_model

    cfg = tiny[0]
    g = torch.Generator().manual_seed(4)
    routes = [torch.randint(0, cfg.n_experts, (32, cfg.top_k), generator=g) for _ in range(cfg.n_layers)]
    per = layer_weight_model(cfg, [1], routes, [16, 16], union=False)
    uni = layer_weight_model(cfg, [1], routes, [16, 16], union=True)
    assert per["dense_once"] == cfg.dense_layer_bytes() and per["dense_per_group"] == 2 * cfg.dense_layer_bytes()
    n0, n1 = (int(torch.unique(routes[1][a:a + 16]).numel()) for a in (0, 16))
    assert per["experts_streamed"] == (n0 + n1) * cfg.expert_bytes
    assert uni["experts_distinct"] == per["experts_distinct"] == int(torch.unique(routes[1]).numel()) * cfg.expert_bytes
    assert per["experts_distinct"] <= uni["experts_streamed"] and per["experts_distinct"] < per["experts_streamed"]
    two = layer_weight_model(cfg, [0, 1, 1], routes, [32], union=False)
    assert two["dense_once"] == two["dense_per_group"] == 2 * cfg.dense_layer_bytes()
    with pytest.raises(ConfigError, match="layers"):
        layer_weight_model(cfg, [cfg.n_layers], routes, [32], union=False)


def test_a_grouped_build_refuses_what_it_cannot_hold(tiny):
    cfg, w, _, base_plan = tiny
    plan = _grouped_plan(base_plan, 2)
    with pytest.raises(ConfigError, match="runs in a groups.GroupEngine"):
        Engine(w, plan, random_caches(cfg, 1), backend="emu")
    with pytest.raises(ConfigError, match="2 or more row groups"):
        GroupEngine(w, base_plan, random_caches(cfg, 1), backend="emu")
    eng = engine_for(w, plan, random_caches(cfg, 3), backend="emu")
    with pytest.raises(ConfigError, match=r"16\+9\+12 = 37 token rows pack into 3 groups.*this build has 2"):
        eng.step_batch(make_requests(cfg, SHAPES["mixed"]))
    with pytest.raises(ValueError, match="row_groups 9"):
        _grouped_plan(base_plan, 9)
    with pytest.raises(ConfigError, match="one row group; a program of 2 row groups"):
        Interpreter(w, grouped(build(plan), 2), random_caches(cfg, 2))


# Two full groups: every expert op has about 8 slots, a unit or more of each group on every block.
TWO_FULL = ((16, 5), (16, 40))
# A one-row group (2 slots: its token's 2 experts) before a full one. On tiny's 4 blocks
# (a slot is one unit of each expert op) group 0's routed ops leave blocks without a unit where
# group 1's have some: warp 0 of such a block passes the routing barrier and goes straight on to
# group 1's routing wait while the other warps have yet to read group 0's slot count. On 2 blocks
# the groups' rotation (half of the plan's 4 blocks) is a whole turn, so block 0 runs slot 0 of
# group 0 and then slot 0 of group 1 of one (layer, expert op) back to back: a slot record kept
# across the change of group names the wrong expert wherever the two groups' first experts differ.
SMALL_THEN_FULL = ((1, 5), (16, 40))

# name: (file under csrc/, old, new, schedule, shape, emulated grid (None: the Engine's 4)). Mega
# runs every group in one launch, chain one op instance per launch (nothing a block keeps outlives
# a launch): a mutation shows as mega against chain, or mega (the forced-routing run) against the
# reference, or (a block's warps disagreeing on an op's units) as a barrier the emulation refuses
MUTATIONS = {
    # a group's units take the operand (and norm factors) another group staged for the same layer
    "staged operand kept across groups": (
        "mk/block.cuh", "      b.misc[MISC_TAG] = -1;\n      b.misc[MISC_RTAG] = -1;\n", "", "random", TWO_FULL, None),
    # the compute warps' slot record (expert, token count, token rows) of another group's same slot
    "compute slot record kept across groups": (
        "mk/block.cuh", "      b.misc[MISC_SLOT + 2] = -1;\n", "", "random", SMALL_THEN_FULL, 2),
    # the loader streams the expert of another group's same slot
    "loader slot record kept across groups": (
        "mk/program.cuh", "        ls = LoaderSlot{};\n", "", "random", SMALL_THEN_FULL, 2),
    # every group's routed ops keep their slot count in one pair of copies: group 1's routing wait
    # overwrites group 0's count before the warps that warp 0 left behind read it
    "routed-count copies shared by the groups": (
        "mk/program.cuh", "  if constexpr (GROUPS > 1) return MISC_GROUTED + 2 * b.group + copy;\n", "", "random",
        SMALL_THEN_FULL, None),
}


def _caught(res) -> bool:
    return not res.ok and (not all(res.chain.values()) or not all(res.alone)
                           or any("vs reference" in p for p in res.problems))


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_group_checks_catch_a_mutated_kernel(tiny, tmp_path, name):
    """The real kernel passes check_batch on the mutation's shape and grid; the mutated one fails it."""
    rel, old, new, schedule, shape, grid = MUTATIONS[name]
    cfg, w, _, base_plan = tiny
    plan = _grouped_plan(base_plan, 2)
    reqs, caches0 = make_requests(cfg, shape, seed=7), random_caches(cfg, 2, seed=7)
    assert len(pack_groups([t for t, _ in shape], cfg.max_tree)) == 2
    good = check_batch(w, plan, caches0, reqs, schedules=(schedule,), seed=3, grid=grid)
    assert good.ok, good.lines()
    with ab.kernel_tree(mutated_csrc(tmp_path, rel, old, new)):
        try:
            bad = check_batch(w, plan, caches0, reqs, schedules=(schedule,), seed=3, grid=grid)
        except EmulationError as e:  # warps of one block running different units of an op
            assert "different barrier instructions" in str(e)
            return
    assert _caught(bad), bad.lines()


def test_group_dependencies_on_group_0_are_caught(tiny, monkeypatch):
    """program.grouped with every group's dependencies pointing at group 0's producers (and the
    structural check off): under the adversarial schedule a later group runs before its own
    producers and mega differs from chain or the reference, or a wait runs into the watchdog."""
    import megakernel.groups as groups_mod
    import megakernel.program as program_mod

    cfg, w, _, base_plan = tiny
    plan = _grouped_plan(base_plan, 2)
    shape = ((16, 5), (16, 40))
    reqs, caches0 = make_requests(cfg, shape, seed=7), random_caches(cfg, 2, seed=7)
    real = program_mod.grouped

    def to_group0(prog, groups):
        out = real(prog, groups)
        at = {(o.kind, o.layer, o.group): o.index for o in out.ops}
        ops = tuple(o.__class__(**{**o.__dict__, "deps": tuple(
            Dep(at[(out.ops[d.producer].kind, out.ops[d.producer].layer, 0)], d.mode) for d in o.deps)})
            for o in out.ops)
        return out.__class__(**{**out.__dict__, "ops": ops})

    monkeypatch.setattr(groups_mod, "grouped", to_group0)
    try:
        bad = check_batch(w, plan, caches0, reqs, schedules=("last",), seed=3)
    except SpinTimeoutError as e:  # a wait for a count its producers never reach: the watchdog names it
        assert "row group" in str(e)
        return
    assert _caught(bad), bad.lines()


def test_one_group_step_through_a_grouped_build_is_the_plain_step(tiny):
    """A step of 16 rows or fewer on a grouped build is one group: bitwise the plain build's step."""
    cfg, w, _, base_plan = tiny
    plan = _grouped_plan(base_plan, 2)
    (q,) = make_requests(cfg, [(12, 33)], seed=9)
    c1, c2 = random_caches(cfg, 1, seed=9)[0], random_caches(cfg, 1, seed=9)[0]
    a = Engine(w, base_plan, [c1], backend="emu").step_batch([q])
    b = GroupEngine(w, plan, [c2], backend="emu").step_batch([q])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens) and c1.equal(c2)
