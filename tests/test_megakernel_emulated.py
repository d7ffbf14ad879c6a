"""The megakernel through the host emulation (the GPU's source, one fiber per CUDA thread): mega mode
bitwise equal to chain mode, both close to the reference, over schedules, routings and builds."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megakernel.interp import Interpreter
from megakernel.plan import make_plan
from megakernel.program import ROUTE_SHIFT, build
from megakernel.reference import KVCache, step, topk_route
from megakernel.routing import synthetic_routes
from megakernel.runtime import Engine, check_close

from megakernel_cases import fusable, reference_logits, step_inputs, tiny


# The emulated mega steps of the mega == chain tests: the random schedule from a seed, and the
# adversarial ones (runtime.EMU_SCHEDULES) that delay producers, so that a missing wait shows
# (test_adversarial_schedule_catches_gate_up_without_its_pool_wait).
MEGA_SCHEDULES = {(0, 1): ("random", "last"), (33, 1): ("random", "last"), (20, 8): ("random", "last"),
                  (40, 16): ("random", "last", "block")}


@pytest.mark.parametrize("ctx,t", list(MEGA_SCHEDULES))
def test_emulated_mega_equals_chain_bitwise_and_matches_reference(tiny, ctx, t):
    cfg, w, base, plan = tiny
    toks, par = step_inputs(cfg, t, ctx)
    ref_cache = base.clone()
    ref, routes = reference_logits(w, ref_cache, toks, par, ctx)
    outs = {}
    for mode in ("chain",) + tuple(f"mega-{s}" for s in MEGA_SCHEDULES[(ctx, t)]):
        cache = base.clone()
        eng = Engine(w, plan, cache, backend="emu", emu_seed=ctx + 7, emu_schedule=mode.partition("-")[2] or "random")
        eng.poison()
        outs[mode] = (eng.step(toks, par, ctx, mode=mode.partition("-")[0]), cache)
    c_out, c_cache = outs.pop("chain")
    for name, (m_out, m_cache) in outs.items():
        assert torch.equal(c_out.logits, m_out.logits), name  # real routing, both modes
        assert torch.equal(c_out.tokens, m_out.tokens), name
        assert c_cache.equal(m_cache), name
    m_cache = outs["mega-random"][1]
    forced = Engine(w, plan, base.clone(), backend="emu").step(toks, par, ctx, mode="mega", routes=routes)
    check_close(forced.logits, ref, "emulated megakernel vs reference", rel=1e-2)
    assert torch.equal(forced.tokens, ref.argmax(-1))
    for a, b in zip(m_cache.k + m_cache.v, ref_cache.k + ref_cache.v):  # the KV writes agree too
        check_close(a, b, "KV cache", rel=1e-2)


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), 1])  # seed 0: ~40 s, CI runs it
def test_fused_experts_interpreter_orders_and_emulated_bits(fusable, seed):
    """The fused schedule in random orders that respect only its declared dependencies (DEP_LOCAL:
    the producer's unit of the same index) gives the program order's bits, close to the reference;
    in the emulated kernel mega == chain bitwise (random and adversarial schedules), the kept
    activations give the staged ones' bits
    (keep_units default, 1: most units staged, 0: none kept), and the logits stay within 1e-2 of the
    split GEMMs'."""
    cfg, w, base, plan = fusable
    toks, par = step_inputs(cfg, 16 if seed == 0 else 5, seed)
    ref, routes = reference_logits(w, base.clone(), toks, par, 40)
    in_order = Interpreter(w, build(plan), base.clone()).run(toks, par, 40, routes=routes, order="program")
    check_close(in_order, ref, "fused interpreter", rel=5e-3)
    shuffled = Interpreter(w, build(plan), base.clone()).run(toks, par, 40, routes=routes, seed=seed)
    assert torch.equal(in_order, shuffled)
    grid = 4 if seed == 0 else 2
    out = {}
    for name, p, mode in (("mega", plan, "mega"), ("chain", plan, "chain"), ("last", plan, "mega"),
                          ("keep1", dataclasses.replace(plan, keep_units=1), "mega"),
                          ("keep0", dataclasses.replace(plan, keep_units=0), "mega"),
                          ("split", make_plan(cfg, 4, spin_bound_ns=3_000_000_000, ring_stage_bytes=16384), "mega")):
        eng = Engine(w, p, base.clone(), backend="emu", grid=grid, emu_schedule="last" if name == "last" else "random")
        out[name] = eng.step(toks, par, 40, mode=mode)
    for name in ("chain", "last", "keep1", "keep0"):
        assert torch.equal(out[name].logits, out["mega"].logits) and torch.equal(out[name].tokens, out["mega"].tokens), name
    check_close(out["mega"].logits, out["split"].logits, "fused vs split", rel=1e-2)
    check_close(out["mega"].logits, ref, "fused vs reference", rel=1e-2)


def test_every_technique_switch_computes_the_same_bits(tiny):
    """Profiler on, loader not running ahead, PDL, weight copies with the evict-first hint,
    sentinel slots, per-role register budgets: the arithmetic is unchanged, so the outputs are
    bitwise those of the default build; the profiler's timeline is consistent."""
    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 2)
    default = Engine(w, make_plan(cfg, 4), base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    eng = Engine(w, make_plan(cfg, 4, profile=True, loader_ahead=False, pdl=True, stream_evict_first=True,
                              sentinel_route=True, compute_registers=224),
                 base.clone(), backend="emu")
    out = eng.step(toks, par, 40, mode="mega")
    assert torch.equal(default.logits, out.logits) and torch.equal(default.tokens, out.tokens)
    tl = eng.timeline("mega")
    assert not tl.problems
    phases = set(tl.spans_df()["phase"])
    assert {"qkv", "attn", "expert1", "expert2", "wait_expert2", "lm_head"} <= phases


@pytest.mark.parametrize("routing", ["router", "forced"])
def test_sentinel_route_gives_the_same_bits_and_leaves_the_slots_empty(tiny, routing):
    """sentinel_route: top-k polls the router logits in sentinel slots instead of waiting for the
    router's counter, and resets them. Mega and chain keep the default build's bits over two
    consecutive steps (the second reuses the slots the first reset), with the router's own
    routing and with forced routing; afterwards every slot is empty (-0.0) again; the program
    marks the edge and drops the router's unused counter."""
    from megakernel.program import DEP_SENTINEL

    cfg, w, base, _ = tiny
    plan = make_plan(cfg, 4, sentinel_route=True)
    prog = build(plan)
    topk = [o for o in prog.ops if o.kind == "topk"]
    assert all(o.deps[0].mode == DEP_SENTINEL and prog.ops[o.deps[0].producer].kind == "router" for o in topk)
    assert not any(o.signal for o in prog.ops if o.kind == "router")
    assert all(o.signal for o in prog.ops if o.kind in ("oproj", "topk", "pool"))
    routes = None
    if routing == "forced":
        g = torch.Generator().manual_seed(3)
        routes = [torch.stack([torch.randperm(cfg.n_experts, generator=g)[:cfg.top_k] for _ in range(8)])
                  for _ in range(cfg.n_layers)]
    for mode in ("mega", "chain"):
        ref_eng = Engine(w, make_plan(cfg, 4), base.clone(), backend="emu")
        eng = Engine(w, plan, base.clone(), backend="emu", emu_seed=5)
        eng.poison()
        for ctx, seed in ((30, 1), (38, 2)):
            toks, par = step_inputs(cfg, 8, seed)
            want = ref_eng.step(toks, par, ctx, mode=mode, routes=routes)
            got = eng.step(toks, par, ctx, mode=mode, routes=routes)
            assert torch.equal(want.logits, got.logits) and torch.equal(want.tokens, got.tokens), (mode, ctx)
            left = eng.unemptied_sentinel_slots()
            assert left == 0, f"{mode}: {left} router logit slots left written"


def test_any_ring_geometry_keeps_mega_bitwise_equal_to_chain(tiny):
    """Two stages of 2 KB (oproj and lm_head then stream in several k-chunks and the ring wraps every
    other chunk, as the tuned H200 ring's 2 stages do). The bits are a function of the plan (each
    k-chunk's second accumulator is folded in at the chunk's end), so the promise is: mega == chain
    bitwise for the same plan, and within bf16 rounding of the default geometry."""
    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 5)
    ref = Engine(w, make_plan(cfg, 4), base.clone(), backend="emu").step(toks, par, 40, mode="chain")
    plan = make_plan(cfg, 4, ring_stages=2, ring_stage_bytes=2048)
    assert plan.tiles["oproj"].kc < plan.tiles["oproj"].k and plan.tiles["lm_head"].kc < plan.tiles["lm_head"].k
    chain = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="chain")
    mega = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    assert torch.equal(chain.logits, mega.logits) and torch.equal(chain.tokens, mega.tokens)
    assert not torch.equal(ref.logits, chain.logits)  # the geometry really changed the summation
    check_close(chain.logits, ref.logits, "2-stage ring vs default ring", rel=1e-2)


def test_emulated_top_k_counter_carries_the_slot_count(tiny):
    # program.ROUTE_SHIFT: top-k adds 1 + (slots << 16) to its counter and the routed ops take
    # their unit count from the value that ends their routing wait; the low half stays the units-
    # done count every other waiter compares with top-k's one unit
    cfg, w, base, plan = tiny
    toks, par = step_inputs(cfg, 16, 3)
    _, routes = reference_logits(w, base.clone(), toks, par, 40)
    eng = Engine(w, plan, base.clone(), backend="emu")
    eng.step(toks, par, 40, mode="mega", routes=routes)
    row = eng.counters[eng._dirty.index(True)]  # the step's parity (its argmax cleared the other)
    topk = [o for o in eng.program.ops if o.kind == "topk"]
    assert len(topk) == cfg.n_layers
    for o in topk:
        v = int(row[o.counter])
        assert v & ((1 << ROUTE_SHIFT) - 1) == 1, (o.layer, hex(v))
        assert v >> ROUTE_SHIFT == len(torch.unique(routes[o.layer])), (o.layer, hex(v))


def test_emulated_synthetic_routing(tiny):
    cfg, w, base, plan = tiny
    toks, par = step_inputs(cfg, 16, 5)
    routes = synthetic_routes(cfg, 16, 6, torch.Generator().manual_seed(0))
    ref = step(w, base.clone(), toks, par, 20, routes=routes)
    eng = Engine(w, plan, base.clone(), backend="emu")
    out = eng.step(toks, par, 20, mode="mega", routes=routes)
    check_close(out.logits, ref, "synthetic routing", rel=1e-2)
    assert int(eng.buf["n_slots"][0]) == 6  # the last layer's distinct experts


def test_topk_breaks_exact_ties_toward_the_lower_expert(tiny):
    """The last layer's router rows 1, 4 and 6 made equal (scaled x4, exact in bf16) and rows 0
    and 3 zero: bitwise-equal logits compete for the top-2 ranks. The kernel's top-k (redux
    max, then the lowest expert holding it) must keep the lower experts, as the reference's stable
    sort does, in both modes."""
    cfg, w, base, plan = tiny
    w = copy.deepcopy(w)
    r = w.layers[-1].router
    r[1] = r[1] * 4
    r[4], r[6] = r[1], r[1]
    r[0], r[3] = 0, 0
    toks, par = step_inputs(cfg, 16, 8)
    for mode in ("chain", "mega"):
        eng = Engine(w, plan, base.clone(), backend="emu")
        eng.step(toks, par, 20, mode=mode)
        logits = eng.buf["router_logits"][:16].cpu()
        assert torch.equal(logits[:, 1], logits[:, 4]) and torch.equal(logits[:, 1], logits[:, 6])
        top = torch.sort(logits, dim=-1, descending=True, stable=True).values
        ties = (top[:, cfg.top_k - 1] == top[:, cfg.top_k]).sum().item()
        assert ties >= 4, f"only {ties} tokens with a tie at the top-{cfg.top_k} boundary"
        assert torch.equal(eng.buf["route_sel"][:16].cpu().long(), topk_route(logits, cfg.top_k)), mode


def test_experts_with_more_than_8_tokens_use_the_second_token_tile(tiny):
    """gemm_fp4 multiplies tokens 8..15 only when a slot has more than 8: every token routed to
    experts 0 and 1 (16 tokens each) next to the default routing (few tokens per expert)."""
    cfg, w, base, plan = tiny
    toks, par = step_inputs(cfg, 16, 11)
    crowd = [torch.tensor([[0, 1]] * 16) for _ in range(cfg.n_layers)]
    ref = step(w, base.clone(), toks, par, 20, routes=crowd)
    outs = {m: Engine(w, plan, base.clone(), backend="emu").step(toks, par, 20, mode=m, routes=crowd)
            for m in ("chain", "mega")}
    assert torch.equal(outs["chain"].logits, outs["mega"].logits)
    check_close(outs["mega"].logits, ref, "16 tokens per expert", rel=1e-2)


def test_emulated_greedy_decoding_matches_reference(tiny):
    cfg, w, base, plan = tiny
    eng = Engine(w, plan, KVCache(cfg), backend="emu")
    ref_cache = KVCache(cfg)
    tok, ref_tok = 7, 7
    for ctx in range(5):
        out = eng.step([tok], [-1], ctx, mode="mega")
        ref_tok = int(step(w, ref_cache, [ref_tok], [-1], ctx).argmax(-1)[0])
        tok = int(out.tokens[0])
        assert tok == ref_tok
