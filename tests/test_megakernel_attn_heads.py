"""Plan.attn_heads (issue 48, fewer dependent hops): attention units by q head over runs of the keys,
each head's partials merged by the last of its units to take a ticket (attention.cuh run_attn_head),
so the attn_combine op and its hop go. The plan and program, the torch interpreter in random orders,
the emulated kernel in mega and chain mode under the adversarial schedules (rounds, splits, steps in a
row on the same tickets), against the reference, and mutations the tests must catch."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from megakernel import tree
from megakernel.build import CSRC
from megakernel.config import preset
from megakernel.interp import Interpreter
from megakernel.plan import ATTN_HEAD_KEYS, make_plan, render
from megakernel.program import DEP_ALL, SIGNAL_GROUPS, SIGNAL_TOTAL, build, n_units, splits
from megakernel.reference import KVCache, Trace, step
from megakernel.runtime import Engine, check_close
from megakernel.weights import generate

GEO = dict(spin_bound_ns=3_000_000_000)


def _inputs(cfg, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (t,), generator=g), tree.binary_ish(t) if t > 1 else [-1]


def _reference(w, cache, toks, par, ctx):
    tr = Trace()
    logits = step(w, cache, toks, par, ctx, trace=tr)
    return logits, [tr.tensors[f"L{l}.route"] for l in range(w.cfg.n_layers)]


@pytest.fixture(scope="module")
def wide():
    """tiny with a 512-position cache: a global layer's split runs past two rounds of keys."""
    cfg = dataclasses.replace(preset("tiny"), max_context=512)
    return cfg, generate(cfg), KVCache(cfg).fill_random(torch.Generator().manual_seed(5))


def test_the_switch_renders_defaults_off_and_refuses_bad_values():
    cfg = preset("tiny")
    assert not make_plan(cfg, 4).attn_heads and "constexpr bool ATTN_HEADS = false;" in render(make_plan(cfg, 4))
    on = make_plan(cfg, 8, attn_heads=1)
    assert "constexpr bool ATTN_HEADS = true;" in render(on)
    assert f"constexpr int HEAD_SPLITS = {on.head_splits}, ATTN_HEAD_KEYS = {ATTN_HEAD_KEYS};" in render(on)
    with pytest.raises(ValueError, match="attn_heads 2"):
        make_plan(cfg, 4, attn_heads=2)


@pytest.mark.parametrize("ctx,t", [(2048, 16), (2048, 1), (0, 1), (16000, 16)])
def test_shard8_program_has_no_combine_and_one_round_of_units(ctx, t):
    """shard8 on 132 SMs: 8 q heads x at most 16 splits (128 units, one per block), no attn_combine,
    oproj waits for all of attention, whose group counters are tickets nobody waits for. At ctx 2048
    a split is 128 or 129 keys: two rounds of 64, or three with a last of one key."""
    plan = make_plan(preset("shard8"), 132, attn_heads=True)
    cfg = plan.cfg
    assert plan.head_splits == 16
    prog = build(plan)
    kinds = [o.kind for o in prog.ops]
    assert "attn_combine" not in kinds and kinds.count("attn") == cfg.n_layers
    for o in prog.ops:
        if o.kind == "attn":
            assert o.n_groups == cfg.n_heads and not o.signal & SIGNAL_GROUPS and o.signal & SIGNAL_TOTAL
            ns = splits(cfg, plan, o.layer, ctx, t)
            assert n_units(plan, "attn", o.layer, t, ctx, 0) == cfg.n_heads * ns <= 132
            nkeys = min(ctx, cfg.window - 1 if not cfg.is_global(o.layer) else ctx) + t
            assert ns == min(16, -(-nkeys // ATTN_HEAD_KEYS))
            if ctx == 2048:
                assert ns == 16 and -(-nkeys // ns) in (128, 129)  # 2,047 or 2,048 cached keys and the T new
        if o.kind == "oproj":
            (dep,) = o.deps
            assert prog.ops[dep.producer].kind == "attn" and dep.mode == DEP_ALL


@pytest.mark.parametrize("seed", [0, 1])
def test_interpreter_in_random_orders_matches_program_order_and_reference(wide, seed):
    """The torch interpreter merges a head when its last unit runs, in any order the program allows."""
    cfg, w, base = wide
    plan = make_plan(cfg, 8, attn_heads=True, **GEO)
    toks, par = _inputs(cfg, 16, seed)
    ref, routes = _reference(w, base.clone(), toks, par, 300)
    in_order = Interpreter(w, build(plan), base.clone()).run(toks, par, 300, routes=routes, order="program")
    check_close(in_order, ref, "interpreter, attention by q head", rel=5e-3)
    shuffled = Interpreter(w, build(plan), base.clone()).run(toks, par, 300, routes=routes, seed=seed)
    assert torch.equal(in_order, shuffled)


# (grid, ctx, T, schedule): one split a head (4 blocks) and two (8 blocks); ctx 300 puts 316 keys in
# a global layer's splits (158 or 316 keys: three and five rounds of 64), ctx 40 one round; T=5
# leaves rows of the m16 tile empty
POINTS = [(4, 40, 16, "last"), (8, 40, 16, "block"), (8, 300, 16, "last"), (8, 300, 5, "random"),
          (3, 300, 1, "last")]


@pytest.mark.parametrize("grid,ctx,t,schedule", POINTS)
def test_emulated_mega_equals_chain_and_the_reference_two_steps_in_a_row(wide, grid, ctx, t, schedule):
    """Mega and chain steps bitwise equal (logits, tokens, the KV cache, the last layer's attention
    output), from poisoned buffers; each mode twice on one engine, the second step on the tickets the
    first left (chain mode clears no counters: the winner's reset is what makes it work), equal to
    the first. Forced to the reference's routing, within the pipeline's 1e-2 of the reference."""
    cfg, w, base = wide
    plan = make_plan(cfg, grid, attn_heads=True, **GEO)
    toks, par = _inputs(cfg, t, ctx + grid)
    outs = {}
    for mode in ("chain", "mega"):
        cache = base.clone()
        eng = Engine(w, plan, cache, backend="emu", grid=grid, emu_seed=ctx + 7, emu_schedule=schedule)
        eng.poison()
        first = eng.step(toks, par, ctx, mode=mode)
        att = eng.buf["att_out"][:t].clone()
        cache_after = cache.clone()
        again = eng.step(toks, par, ctx, mode=mode)  # the same step again (the cache's tree rows rewritten alike)
        assert torch.equal(first.logits, again.logits) and torch.equal(eng.buf["att_out"][:t], att), mode
        outs[mode] = (first, att, cache_after)
    (c, c_att, c_cache), (m, m_att, m_cache) = outs["chain"], outs["mega"]
    assert torch.equal(c.logits, m.logits) and torch.equal(c.tokens, m.tokens) and torch.equal(c_att, m_att)
    assert c_cache.equal(m_cache)
    ref, routes = _reference(w, base.clone(), toks, par, ctx)
    forced = Engine(w, plan, base.clone(), backend="emu", grid=grid).step(toks, par, ctx, mode="mega", routes=routes)
    check_close(forced.logits, ref, "attention by q head vs reference", rel=1e-2)
    assert torch.equal(forced.tokens, ref.argmax(-1))
    kv_heads = Engine(w, make_plan(cfg, grid, **GEO), base.clone(), backend="emu", grid=grid)
    check_close(forced.logits, kv_heads.step(toks, par, ctx, mode="mega", routes=routes).logits,
                "attention by q head vs by kv head", rel=1e-2)


def _mutated(tmp_path, old: str, new: str):
    tree_dir = tmp_path / "csrc"
    shutil.copytree(CSRC, tree_dir)
    f = tree_dir / "ops" / "attention.cuh"
    assert old in f.read_text(), f"attention.cuh no longer has {old!r}"
    f.write_text(f.read_text().replace(old, new))
    return tree_dir


_TICKET = "const bool fin = atom_add_relaxed(tickets + h, 1u) + 1u == static_cast<uint32_t>(nsplit);"


def test_a_merge_not_decided_by_the_ticket_is_caught(wide, tmp_path, monkeypatch):
    """The unit of a head's last split merges, whoever finishes last: under the schedule that
    delays one block per op, some head's last split finishes before another of its splits and
    merges a poisoned partial (or skips it), in every seed tried in one mode or the other. (Every
    unit merging is no mutation to catch: the last merge overwrites the others'.)"""
    from megakernel import build as buildmod

    cfg, w, base = wide
    plan = make_plan(cfg, 8, attn_heads=True, **GEO)
    toks, par = _inputs(cfg, 16, 3)
    good = Engine(w, plan, base.clone(), backend="emu", grid=8).step(toks, par, 300, mode="chain")
    monkeypatch.setattr(buildmod, "CSRC", _mutated(
        tmp_path, _TICKET, "const bool fin = (atom_add_relaxed(tickets + h, 1u), split == nsplit - 1);"))
    for seed in range(3):
        caught = []
        for mode in ("chain", "mega"):
            eng = Engine(w, plan, base.clone(), backend="emu", grid=8, emu_schedule="block", emu_seed=seed)
            eng.poison()
            caught.append(not torch.equal(eng.step(toks, par, 300, mode=mode).logits, good.logits))
        assert any(caught), f"seed {seed}"


def test_a_ticket_left_set_is_caught_by_the_next_step(wide, tmp_path, monkeypatch):
    """Without the winner's reset the second chain step's units never reach the head's count (chain
    mode clears no counters), no head merges, and the step reads the first step's attention output:
    the logits differ from a fresh engine's second step."""
    from megakernel import build as buildmod

    cfg, w, base = wide
    plan = make_plan(cfg, 8, attn_heads=True, **GEO)
    (t1, p1), (t2, p2) = _inputs(cfg, 16, 3), _inputs(cfg, 16, 4)
    fresh = Engine(w, plan, base.clone(), backend="emu", grid=8).step(t2, p2, 300, mode="chain")

    def second_step():  # the step rewrites the tree's KV rows itself: the first step leaves no trace in them
        eng = Engine(w, plan, base.clone(), backend="emu", grid=8)
        eng.step(t1, p1, 300, mode="chain")
        return eng.step(t2, p2, 300, mode="chain").logits

    assert torch.equal(second_step(), fresh.logits)  # the kernel as it is
    monkeypatch.setattr(buildmod, "CSRC", _mutated(tmp_path, "st_relaxed(tickets + h, 0u);", ""))
    assert not torch.equal(second_step(), fresh.logits)
