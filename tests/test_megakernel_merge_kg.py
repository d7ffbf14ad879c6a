"""Attention's key groups merged inside the block (Plan.merge_key_groups): each split writes one
partial, the block having merged its key groups' (O, m, l) in key-group order, and the combine
reads that many fewer. tiny has four key groups a block (two of them see a 32-key split's keys);
tiny with four q heads a kv head has two, both scoring, as small has. A merged build must pass the batch check
(each request bitwise its own B=1 step, mega bitwise chain at the random and adversarial
schedules, each request within the reference's bound) from poisoned buffers. Mutations (a key group left out of the sum, the barrier before group 0
reads the others' O dropped, the scales taken from the wrong group) must fail it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel import ab
from megakernel.batch import check_batch, engine_for, make_requests, random_caches
from megakernel.config import preset
from megakernel.plan import make_plan
from megakernel.weights import generate

from megakernel_cases import mutated_csrc, tiny  # noqa: F401 (fixture)

# (T_r, ctx_r): mixed trees, a context at 0 and ones past tiny's window of 16
SHAPES = {"3": ((1, 17), (8, 0), (4, 100)), "4": ((4, 3), (1, 0), (6, 64), (5, 20))}


def _plan(cfg, **kw):
    return make_plan(cfg, 4, spin_bound_ns=3_000_000_000, **kw)


@pytest.fixture(scope="module")
def tiny_g4():
    """tiny with 8 q heads over its 2 kv heads: 4 a kv head, so 2 key groups a block (small's)."""
    cfg = dataclasses.replace(preset("tiny"), n_heads=8)
    return cfg, generate(cfg)


def _model(request, which):
    return request.getfixturevalue(which)[:2]


@pytest.mark.parametrize("which,name", [("tiny", "3"), ("tiny", "4"), ("tiny_g4", "4")])
def test_merged_key_groups_pass_the_batch_check(request, which, name):
    cfg, w = _model(request, which)
    plan = _plan(cfg, merge_key_groups=True)
    kg = plan.attn_key_groups
    assert kg == {"tiny": 4, "tiny_g4": 2}[which] and plan.attn_parts * kg == _plan(cfg).attn_parts
    shape = SHAPES[name]
    res = check_batch(w, plan, random_caches(cfg, len(shape), seed=5), make_requests(cfg, shape, seed=5),
                      schedules=("random", "last", "block"), grid=plan.n_sm, seed=5)
    assert res.ok, res.lines()


def test_merged_build_writes_one_partial_a_split(tiny):
    """From poisoned buffers: a merged step's buffers hold one partial a split (a quarter of the
    unmerged build's at tiny's four key groups), and its logits are finite and close to the
    unmerged build's (the same sums in another order)."""
    cfg, w = tiny[0], tiny[1]
    shape = SHAPES["4"]
    outs = {}
    for merged in (False, True):
        plan = _plan(cfg, merge_key_groups=merged)
        eng = engine_for(w, plan, random_caches(cfg, len(shape), seed=9), backend="emu", emu_schedule="random",
                         emu_seed=9)
        eng.poison()
        out = eng.step_batch(make_requests(cfg, shape, seed=9), mode="mega")
        outs[merged] = (out.logits.clone(), eng.buf["att_ml"].clone(), plan)
    lm, mlm, plan = outs[True]
    lu = outs[False][0]
    assert torch.isfinite(lm).all() and (lm - lu).abs().max() <= 0.05 * lu.abs().max()
    assert mlm.shape[1] == plan.max_splits  # PARTS = splits x 1
    assert mlm.shape[1] * 4 == outs[False][1].shape[1]


MUTATIONS = {
    # key group 1: at tiny's 32-key splits and 64-key rounds, groups 2 and 3 see no key of a split
    "key group 1 left out of the sum": ("ops/attention.cuh", "            for (int k = 1; k < ATT_KG; ++k) {",
                                        "            for (int k = 2; k < ATT_KG; ++k) {"),
    "no barrier before group 0 reads the others' O": ("ops/attention.cuh", "      sync_compute();\n      if (kg == 0) {",
                                                      "      if (kg == 0) {"),
    "the scale taken from group 0 for every group": ("ops/attention.cuh", "        if (k == kg) a_mine[h] = a;",
                                                    "        if (k == 0) a_mine[h] = a;"),
}


@pytest.mark.parametrize("which,name", [("tiny", n) for n in MUTATIONS] + [("tiny_g4", n) for n in MUTATIONS])
def test_merge_mutations_fail_the_batch_check(request, tmp_path, which, name):
    cfg, w = _model(request, which)
    plan = _plan(cfg, merge_key_groups=True)
    shape = SHAPES["3"]
    with ab.kernel_tree(mutated_csrc(tmp_path, *MUTATIONS[name])):
        res = check_batch(w, plan, random_caches(cfg, len(shape), seed=5), make_requests(cfg, shape, seed=5),
                          schedules=("random", "block"), grid=plan.n_sm, seed=5)
    assert not res.ok, name


def test_merge_key_groups_is_refused_unless_on_or_off():
    with pytest.raises(ValueError, match="merge_key_groups 2"):
        _plan(preset("tiny"), merge_key_groups=2)


def test_the_interpreter_reads_one_partial_a_split(tiny):
    """The torch interpreter of a merged program (one partial a split, all its keys) gives the
    unmerged program's logits bitwise: there the other key groups' partials are empty."""
    from megakernel.interp import Interpreter
    from megakernel.program import build

    cfg, w = tiny[0], tiny[1]
    shape = SHAPES["4"]
    reqs = make_requests(cfg, shape, seed=4)
    outs = [Interpreter(w, build(_plan(cfg, merge_key_groups=m)), random_caches(cfg, len(shape), seed=4))
            .run_batch(reqs, order="program") for m in (False, True)]
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


def test_mk_step_checks_the_merged_build(capsys):
    """`mk step --merge-key-groups --check` (the build a GPU session profiles and checks) runs the
    merged build through the batch check; the tensor-parallel steps refuse the switch by name."""
    from megakernel import cli
    from microbench.device import no_gpu_reason

    if not no_gpu_reason():
        pytest.skip("a GPU is present: tiny runs there, not in the emulation")
    assert cli.main(["step", "--preset", "tiny", "--batch", "2", "--merge-key-groups", "--check"]) == 0
    out = capsys.readouterr().out
    assert "attention's key groups merged in the block" in out and "check: passed" in out
    assert cli.main(["step", "--ranks", "2", "--merge-key-groups"]) == 2
    assert "--merge-key-groups" in capsys.readouterr().err
