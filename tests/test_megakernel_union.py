"""Union experts (Plan.union_experts): a grouped step's routed experts run once over the union of
every row group's routing, an expert's tokens of every group in slots of at most 16, instead of
once per group. Through the host emulation at random and adversarial schedules, with the split and
the fused expert GEMMs: each request bitwise its own B=1 step and close to the reference, mega
bitwise chain, experts with more than 16 tokens split over several union slots. Mutations (a union
row read from the wrong group, outputs written to group 0's rows, the pooler waited for one group
only, the union built by the last group instead of the last ticket) must make those checks fail."""
from __future__ import annotations

import pytest

from microbench.errors import SpinTimeoutError

from megakernel import ab
from megakernel.batch import check_batch, engine_for, make_requests, random_caches
from megakernel.plan import make_plan
from megakernel.program import UNION_OPS, UNION_SHARED, build, grouped

from megakernel_cases import fusable, mutated_csrc, tiny  # noqa: F401 (fixtures)

SHAPES = {"4x16": ((16, 3), (16, 0), (16, 64), (16, 20)), "mixed": ((16, 5), (9, 40), (12, 0))}


def _union_plan(plan, groups, n_sm=None):
    return make_plan(plan.cfg, n_sm or plan.n_sm, spin_bound_ns=plan.spin_bound_ns,
                     ring_stage_bytes=plan.ring_stage_bytes, row_groups=groups, union_experts=True)


def test_union_experts_need_row_groups_and_are_their_default(tiny):
    cfg = tiny[0]
    with pytest.raises(ValueError, match="row_groups >= 2"):
        make_plan(cfg, 4, union_experts=True)
    # row groups run the union unless the per-group ablation is asked for; one group has none
    assert make_plan(cfg, 4, row_groups=2).union_experts and not make_plan(cfg, 4).union_experts
    assert not make_plan(cfg, 4, row_groups=2, union_experts=False).union_experts
    plan = _union_plan(tiny[3], 4)
    # 4 groups x 16 rows x top-2 picks over 8 experts: at most 128 / 16 + 8 slots of 16 tokens
    assert (cfg.n_experts, cfg.top_k) == (8, 2) and plan.max_uslots == 16


def test_union_program_runs_the_experts_once_per_layer(tiny):
    """Each layer's gate/up and down projection once (group 0's), after every group's top-k; each
    group's MoE combine waits for that down projection; every group's top-k and pooler bump group
    0's counter; the rest is program.grouped's."""
    cfg, _, _, base_plan = tiny
    plan = _union_plan(base_plan, 3)
    one = build(plan)
    prog = grouped(one, 3)
    per_group = sum(o.kind not in UNION_OPS for o in one.ops)
    assert len(prog.ops) == 3 * per_group + (len(one.ops) - per_group)
    for l in range(cfg.n_layers):
        union = [o for o in prog.ops if o.layer == l and o.kind in UNION_OPS]
        assert [(o.kind, o.group) for o in union] == [("expert1", 0), ("expert2", 0)]
        topks = [o for o in prog.ops if o.layer == l and o.kind == "topk"]
        assert max(o.index for o in topks) < union[0].index
        for kind in UNION_SHARED:
            shared = {o.counter for o in prog.ops if o.layer == l and o.kind == kind}
            assert len(shared) == 1 and shared == {next(o.counter for o in one.ops if (o.kind, o.layer) == (kind, l))}
        assert len({o.group_base for o in topks}) == 1  # the union's one ticket
        combines = [o for o in prog.ops if o.layer == l and o.kind == "moe_combine"]
        assert sorted(o.group for o in combines) == [0, 1, 2]
        assert all(union[1].index in {d.producer for d in o.deps} for o in combines)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_union_requests_are_bitwise_their_own_b1_steps(tiny, shape):
    """batch.check_batch through a union build: each request against its own B=1 step (which has
    no union: one group's slots), mega against chain at the random and adversarial schedules."""
    cfg, w, _, base_plan = tiny
    reqs_shape = SHAPES[shape]
    n = len(reqs_shape)
    plan = _union_plan(base_plan, n)
    scheds = ("random", "last", "block") if shape == "4x16" else ("random", "last")
    reqs = make_requests(cfg, reqs_shape, seed=n + 30)
    res = check_batch(w, plan, random_caches(cfg, n, seed=n + 30), reqs, schedules=scheds, seed=n)
    assert res.ok, res.lines()
    assert all(res.alone) and all(res.greedy) and len(res.chain) == len(scheds)
    if shape == "4x16":  # 64 rows x top-2 over 8 experts: some expert has more than 16 tokens
        eng = engine_for(w, plan, random_caches(cfg, n, seed=n + 30), backend="emu")
        eng.step_batch(reqs)
        b = eng.lead.buf
        k = int(b["u_nslots"][0])
        experts, ntok = b["u_expert"][:k].tolist(), b["u_ntok"][:k].tolist()
        assert experts == sorted(experts) and len(set(experts)) < k  # an expert split over slots
        assert all(1 <= t <= 16 for t in ntok) and sum(ntok) == 64 * cfg.top_k


def test_union_fused_experts_write_each_tokens_own_partials(fusable):
    """The fused expert unit over union slots: its down projection writes each token's fp32
    partials to its own group's slot and position (the stacked ypart), and kept gate/up units
    serve the union slot they were computed for."""
    cfg, w, _, base_plan = fusable
    plan = make_plan(cfg, 4, spin_bound_ns=base_plan.spin_bound_ns, ring_stage_bytes=base_plan.ring_stage_bytes,
                     fused_experts=True, row_groups=3, union_experts=True)
    assert plan.fused_experts and plan.keep_units > 0
    shape = ((16, 7), (16, 30), (16, 3))
    res = check_batch(w, plan, random_caches(cfg, 3, seed=5), make_requests(cfg, shape, seed=5),
                      schedules=("random", "last"), seed=2)
    assert res.ok, res.lines()


# name: (file under csrc/, old, new). Two groups on 4 and on 8 blocks under the `last` schedule: on
# 8, blocks without a top-k instance run pool units the union's builder does not wait for
MUTATIONS = {
    "union row from group 0's pooled": (
        "ops/topk.cuh", "g0->u_row[us * 16 + k % 16] = g * T_MAX + t[pos];", "g0->u_row[us * 16 + k % 16] = t[pos];"),
    "pooler waited for one group only": (
        "mk/program.cuh", "if ((UNION_SHARED_MASK >> pr.kind) & 1u) n *=", "if (pr.kind == OP_TOPK) n *="),
    "down projection's outputs to group 0's slot rows": (
        "ops/expert_gemm2.cuh", "const int row = UNION_EXPERTS ? b.misc[MISC_ROWS + r] : s * 16 + r;",
        "const int row = UNION_EXPERTS ? b.misc[MISC_ROWS + r] % (MAX_SLOTS * 16) : s * 16 + r;"),
    "union built by the last group, not the last ticket": (
        "ops/topk.cuh", "last = atom_add_acq_rel(ticket, 1u) == static_cast<uint32_t>(groups - 1);",
        "atom_add_acq_rel(ticket, 1u);"),
    # each group's MoE combine waits for the union's down projection units by the union's count;
    # from its own block (never written: 0) it waits for nothing where a block runs group 1's
    # combine units but none of group 0's: tiny has 4 combine units, group 1's rotated onto blocks
    # 4..7. Found on a GPU (NaN in groups >= 1) before this shape was here
    "the union's slot count read from the reader's group": (
        "mk/slot.cuh", "return UNION_EXPERTS ? b.p0->u_nslots :", "return UNION_EXPERTS ? b.p->u_nslots :"),
}


@pytest.fixture(scope="module")
def two_groups(tiny):
    cfg, w, _, base_plan = tiny
    plan = _union_plan(base_plan, 2, n_sm=8)
    shape = ((16, 3), (16, 40))
    reqs, caches = make_requests(cfg, shape, seed=7), random_caches(cfg, 2, seed=7)
    for grid in (4, 8):  # 8: more blocks than MoE combine units
        good = check_batch(w, plan, caches, reqs, schedules=("last",), seed=3, grid=grid)
        assert good.ok, (grid, good.lines())
    return w, plan, caches, reqs


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_union_checks_catch_a_mutated_kernel(two_groups, tmp_path, name):
    rel, old, new = MUTATIONS[name]
    w, plan, caches, reqs = two_groups
    with ab.kernel_tree(mutated_csrc(tmp_path, rel, old, new)):
        try:
            bad = [check_batch(w, plan, caches, reqs, schedules=("last",), seed=3, grid=g) for g in (4, 8)]
        except SpinTimeoutError:  # a wait that can never be met: the watchdog names it
            return
    assert any(not b.ok and (not all(b.chain.values()) or not all(b.alone)) for b in bad), [b.lines() for b in bad]


def test_union_fused_checks_catch_partials_in_group_0s_rows(fusable, tmp_path):
    """The fused down projection writing every token's partials into group 0's slot rows: the
    other groups' MoE combines read stale partials (the inputs of the fused test above)."""
    cfg, w, _, base_plan = fusable
    plan = make_plan(cfg, 4, spin_bound_ns=base_plan.spin_bound_ns, ring_stage_bytes=base_plan.ring_stage_bytes,
                     fused_experts=True, row_groups=3, union_experts=True)
    shape = ((16, 7), (16, 30), (16, 3))
    tree = mutated_csrc(tmp_path, "ops/expert_gemm2.cuh", "dofs[k] = ((d / 16) * EXP2_TILES + j) * 16 + d % 16;",
                        "dofs[k] = ((d / 16 % MAX_SLOTS) * EXP2_TILES + j) * 16 + d % 16;")
    with ab.kernel_tree(tree):
        bad = check_batch(w, plan, random_caches(cfg, 3, seed=5), make_requests(cfg, shape, seed=5),
                          schedules=("random",), seed=2)
    assert not bad.ok and not all(bad.alone), bad.lines()


def test_mk_step_runs_the_union_past_16_rows_and_the_ablation_by_name(capsys):
    """`megabench mk step`: past 16 rows the union build's step (the emulation without a GPU);
    `--per-group-experts` (the ablation) at 16 rows or fewer, or with --ranks, refused by name
    (exit 2)."""
    from megakernel import cli
    from microbench.device import no_gpu_reason

    assert cli.main(["step", "--batch", "2", "--tree-sizes", "4,4", "--per-group-experts"]) == 2
    assert "8 token rows are one row group" in capsys.readouterr().err
    assert cli.main(["step", "--ranks", "2", "--per-group-experts"]) == 2
    assert "--ranks with --per-group-experts" in capsys.readouterr().err
    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")
    assert cli.main(["step", "--batch", "2", "--tree-sizes", "16,9", "--ctxs", "5,40"]) == 0
    assert "25 rows in 2 row groups, experts over the union of their routing" in capsys.readouterr().out


def test_expert_streams_model_counts_groups_and_union_slots():
    """routing.expert_streams_per_layer: row groups stream each group's distinct experts, union
    slots an expert once per 16 of its tokens over every row."""
    import torch

    from megakernel.routing import expert_streams_per_layer

    # 40 rows of top-1: expert 0 for rows 0..19 and 30..39, expert 1 for rows 20..29
    r = torch.tensor([0] * 20 + [1] * 10 + [0] * 10).reshape(40, 1)
    assert expert_streams_per_layer([r], [16, 16, 8], union=False) == [1 + 2 + 1]
    assert expert_streams_per_layer([r], [16, 16, 8], union=True) == [2 + 1]  # 30 tokens of 0: 2 slots
    assert expert_streams_per_layer([r, r[:16]], [40], union=False) == [2, 1]


def test_union_build_runs_fewer_groups_than_it_has(tiny):
    """A 4-group union build runs a step of 2 groups (the ticket counts the step's groups, not the
    build's) bitwise, and a step of one group bitwise the plain build's step."""
    import torch

    from megakernel.groups import GroupEngine
    from megakernel.runtime import Engine

    cfg, w, _, base_plan = tiny
    plan = _union_plan(base_plan, 4)
    res = check_batch(w, plan, random_caches(cfg, 2, seed=41), make_requests(cfg, ((16, 5), (12, 40)), seed=41),
                      schedules=("last",), seed=1)
    assert res.ok, res.lines()
    (q,) = make_requests(cfg, [(12, 33)], seed=9)
    c1, c2 = random_caches(cfg, 1, seed=9)[0], random_caches(cfg, 1, seed=9)[0]
    a = Engine(w, base_plan, [c1], backend="emu").step_batch([q])
    b = GroupEngine(w, plan, [c2], backend="emu").step_batch([q])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens) and c1.equal(c2)


def test_a_union_wait_that_cannot_complete_names_every_groups_producer(two_groups, tmp_path):
    """The union's units wait for every group's top-k and pooler on one counter: a target one too
    high is never met, and the watchdog stops the step naming the wait (bounded, not a hang)."""
    w, plan, caches, reqs = two_groups
    tree = mutated_csrc(tmp_path, "mk/program.cuh", "n *= static_cast<uint32_t>(b.p0->n_active);",
                        "n *= static_cast<uint32_t>(b.p0->n_active) + 1u;")
    with ab.kernel_tree(tree), pytest.raises(SpinTimeoutError) as e:
        check_batch(w, plan, caches, reqs, schedules=("random",), seed=3)
    msg = str(e.value)
    assert "row group" in msg and ("all units of every row group's" in msg or "routing of this layer" in msg), msg

