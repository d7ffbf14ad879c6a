"""The megakernel on the GPU: the bitwise twin property, agreement with the reference, a
bounded wait that trips instead of hanging. (The full sweep of checks runs in
megakernel.pipeline, which `megabench run` calls.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


# small at ctx 4000: the global layers' 33 splits (the cap) hold ~122 keys each (two staged rounds)
# and attn_combine sums 33 parts per slice (its early load round and one more)
@pytest.mark.parametrize("preset,T,ctx", [("tiny", 16, 100), ("tiny", 1, 0), ("small", 16, 1500), ("small", 16, 4000)])
def test_mega_equals_chain_and_matches_reference(preset, T, ctx):
    from megakernel.measure import check_point
    from megakernel.plans import plan_for

    c = check_point(preset, T, ctx, plan_for(preset))
    assert c.bitwise_chain and c.bitwise_repeat and c.bitwise_kv and c.bitwise_real_routing
    assert c.rel_err < 1e-2


def test_every_technique_keeps_the_bits_on_the_gpu():
    """small, T=16, real routing: no technique (9 warps of 168 registers), every technique
    (sentinel slots and the 12-warp block's per-role register budgets included) and the tuned
    default compute the same logits over two consecutive steps (the second reuses the sentinel
    slots), in mega and chain mode, and the sentinel slots are empty (-0.0) after each step."""
    from megakernel.bench_baselines import step_context, weights_for
    from megakernel.plans import NONE, plan_for, technique_switches
    from megakernel.runtime import Engine

    sc = step_context("small", 16, 1500)
    w = weights_for("small")
    allsw = {k: v for d in technique_switches(None, torch.cuda.get_device_properties(0).multi_processor_count).values()
             for k, v in d.items()}
    ref = None
    for sw in (NONE, allsw, {}):
        plan = plan_for("small", **sw)
        for mode in ("mega", "chain"):
            eng = Engine(w, plan, sc.cache0.clone(), backend="gpu")
            for _ in range(2):
                out = eng.step(sc.tokens, sc.parents, 1500, mode=mode)
                ref = out.logits.clone() if ref is None else ref
                assert torch.equal(out.logits, ref), (sw, mode)
                assert eng.unemptied_sentinel_slots() == 0, (sw, mode)
    assert allsw["sentinel_route"] and allsw["compute_registers"] > 0


# B requests in one step on the GPU (megakernel.batch.check_batch): each request bitwise its own B=1
# step (on the GPU this also rests on an mma's result for a token not depending on its column in
# the tile), mega == chain, each within the reference's bound; mixed contexts, past the window too
@pytest.mark.parametrize("preset,shape,union", [("tiny", ((4, 3), (1, 0), (6, 64), (5, 20)), False),
                                                ("small", ((1, 3000), (1, 0), (1, 1500), (1, 700), (2, 5000), (2, 100)),
                                                 False),
                                                ("small", ((8, 1200), (8, 40)), False),
                                                # past 16 rows: row groups (groups.GroupEngine), their
                                                # experts over the union of their routing, and the
                                                # per-group ablation
                                                ("small", ((16, 1200), (16, 40), (9, 3000), (12, 0)), True),
                                                ("small", ((16, 1200), (16, 40), (9, 3000), (12, 0)), False)])
def test_batched_requests_are_bitwise_their_own_b1_steps_on_the_gpu(preset, shape, union):
    from megakernel.batch import check_batch, make_requests, random_caches
    from megakernel.bench_baselines import weights_for
    from megakernel.groups import groups_needed
    from megakernel.plans import plan_for

    w = weights_for(preset)
    rows = [t for t, _ in shape]
    kw = {"tokens": sum(rows)} if sum(rows) <= w.cfg.max_tree else {"row_groups": groups_needed(w.cfg.max_tree, rows),
                                                                    "union_experts": union}
    res = check_batch(w, plan_for(preset, **kw), random_caches(w.cfg, len(shape), device="cuda"),
                      make_requests(w.cfg, shape), backend="gpu")
    assert res.ok, res.lines()


def test_greedy_tokens_equal_reference_tiny():
    from megakernel.measure import greedy_check
    from megakernel.plans import plan_for

    assert greedy_check("tiny", plan_for("tiny"), steps=16) == 16


def test_wait_that_can_never_complete_trips_the_watchdog():
    from megakernel import tree
    from megakernel.config import preset
    from megakernel.plan import make_plan
    from megakernel.program import DEP_ALL
    from megakernel.reference import KVCache
    from megakernel.runtime import Engine
    from megakernel.weights import generate
    from microbench.errors import SpinTimeoutError

    cfg = preset("tiny")
    w = generate(cfg, device="cuda")
    eng = Engine(w, make_plan(cfg, 132, spin_bound_ns=50_000_000), KVCache(cfg, device="cuda"), backend="gpu")
    enc = eng.program.encode().reshape(-1, 16)
    i = len(enc) - 1
    enc[i, 7], enc[i, 8], enc[i, 9] = 1, i, DEP_ALL  # the last op waits for itself
    eng.prog_t.copy_(torch.from_numpy(np.ascontiguousarray(enc.reshape(-1))))
    with pytest.raises(SpinTimeoutError, match=r"argmax\(L2\).*dependency 0"):
        eng.step([1, 2, 3], tree.chain(3), 5, mode="mega")
    eng.prog_t.copy_(torch.from_numpy(eng.program.encode()))  # healthy again: the GPU is not stuck
    out = eng.step([1, 2, 3], tree.chain(3), 5, mode="mega")
    assert out.tokens.numel() == 3


def test_ab_tool_checks_and_times_variants_on_the_gpu(tmp_path):
    """megakernel/ab.py's GPU path (step contexts, CUDA-graph timer): tiny, the repository's tree
    against a copy of it and a plan switch, two rounds; the copy gives the same bits."""
    import shutil

    from megakernel import ab
    from megakernel.build import CSRC

    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    variants = [ab.Variant("base"), ab.Variant("copy", copy), ab.Variant("k16", None, (("keys_per_split", 16),))]
    (r,) = ab.run_ab([("tiny", 16, 100)], variants, rounds=2, log=lambda s: None)
    assert r.checks["copy"].same_as_first and all(c.rel_err < 1e-2 for c in r.checks.values())
    assert all(len(x) == 2 and all(0 < s < 0.1 for s in x) for x in r.rounds.values())
    assert "| tiny T=16 ctx=100 | copy" in ab.table([r])
    # the GPU's context gives each point its roofline, which `ab --save` keeps as the bound
    assert r.bound is not None and 0 < r.bound[0] < min(min(x) for x in r.rounds.values())
    from microbench.results import load

    back = load(ab.to_result([r], variants).save(tmp_path / "results"))
    assert back.env.gpu and back.series_named("tiny/T16/ctx100/k16").bound.value == r.bound[0]
