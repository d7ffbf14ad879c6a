"""The peer baseline's step (megakernel/peer.py) on the CPU: every kernel through Triton's
interpreter, the dense projections through torch, on a small model with a global and a sliding
layer, against reference.step with the megakernel's bound on logits and every layer's KV cache:
forced and real routing (a near-tie routing flip handled), the torch flavour of the small ops,
greedy decoding, a broken tree mask caught; the host logic (bytes per op, the sweep's choice,
input checks). ~1-2 min here (2 shared cores)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megakernel import peer, reference, routing, tree  # noqa: E402
from megakernel import peer_kernels as K  # noqa: E402
from megakernel.config import ConfigError, preset  # noqa: E402
from megakernel.plans import REL_TOL  # noqa: E402
from megakernel.roofline import step_bytes  # noqa: E402
from megakernel.weights import generate  # noqa: E402
from microbench.errors import CorrectnessError  # noqa: E402


def micro():
    """Two layers (0 sliding with window 8, 1 global), 2/1 heads of 64, 4 experts top-2 of 128 x 128."""
    return preset("tiny").replace(name="micro", n_layers=2, global_layers=(1,), window=8, n_heads=2, n_kv_heads=1,
                                  n_experts=4, top_k=2, d_pool=128, d_expert=128, max_context=64)


@pytest.fixture(scope="module")
def model():
    return peer.PeerModel(generate(micro()))


def _point(cfg, t, ctx, seed, distinct=None):
    g = torch.Generator().manual_seed(seed)
    parents = tree.binary_ish(t) if t > 1 else [-1]
    tokens = torch.randint(0, cfg.vocab, (t,), generator=g)
    cache0 = reference.KVCache(cfg).fill_random(g)
    routes = routing.synthetic_routes(cfg, t, distinct or cfg.top_k, g)
    return parents, tokens, cache0, routes


def _run(model, parents, tokens, ctx, cache, routes=None, small_ops="triton", r_read=None):
    r = peer.PeerRunner(model, cache, parents, r_read=ctx if r_read is None else r_read, forced=routes is not None,
                        small_ops=small_ops, n_sm=4)
    r.set_inputs(tokens, ctx, routes)
    with K.interpreted():
        logits = r.run()
    return r, logits


# ctx 12: no wrap; ctx 30: the sliding layer's ring (24 slots) wrapped, past its window
@pytest.mark.parametrize("t,ctx", [(4, 12), (6, 30), (1, 9)])
def test_peer_step_matches_the_reference_forced_routing(model, t, ctx):
    cfg = model.cfg
    parents, tokens, cache0, routes = _point(cfg, t, ctx, seed=t + ctx, distinct=min(4, t * cfg.top_k))
    ref_cache = cache0.clone()
    ref = reference.step(model.w, ref_cache, tokens, parents, ctx, routes=routes)
    cache = cache0.clone()
    r, logits = _run(model, parents, tokens, ctx, cache, routes, r_read=ctx + 3)  # a read bound past ctx
    c = peer.check_step(r, logits, cache, ref, ref_cache, f"micro T={t} ctx={ctx}", REL_TOL)
    assert c.rel_err < 5e-3 and c.kv_rel_err < 5e-3 and c.routes_equal
    assert torch.equal(r.routes.long(), torch.stack(routes)), "forced routing not used"
    assert torch.equal(r.out_tokens, reference.argmax(logits))


@pytest.mark.parametrize("t,ctx", [(6, 30), (3, 5)])
def test_peer_step_matches_the_reference_real_routing(model, t, ctx):
    cfg = model.cfg
    parents, tokens, cache0, _ = _point(cfg, t, ctx, seed=100 + t)
    ref_cache = cache0.clone()
    tr = reference.Trace()
    ref = reference.step(model.w, ref_cache, tokens, parents, ctx, trace=tr)
    ref_routes = [tr.tensors[f"L{l}.route"] for l in range(cfg.n_layers)]
    cache = cache0.clone()
    r, logits = _run(model, parents, tokens, ctx, cache)
    c = peer.check_step(r, logits, cache, ref, ref_cache, "micro real routing", REL_TOL, ref_routes)
    assert c.routes_equal and c.rel_err < 5e-3 and c.kv_rel_err < 5e-3


def test_torch_flavour_matches_too(model):
    cfg = model.cfg
    parents, tokens, cache0, routes = _point(cfg, 6, 30, seed=7, distinct=4)
    ref_cache = cache0.clone()
    ref = reference.step(model.w, ref_cache, tokens, parents, 30, routes=routes)
    cache = cache0.clone()
    r, logits = _run(model, parents, tokens, 30, cache, routes, small_ops="torch")
    c = peer.check_step(r, logits, cache, ref, ref_cache, "micro torch flavour", REL_TOL)
    assert c.rel_err < 5e-3 and c.kv_rel_err < 5e-3


def test_a_wrong_tree_mask_is_caught(model):
    cfg = model.cfg
    parents, tokens, cache0, routes = _point(cfg, 6, 12, seed=8, distinct=4)
    ref_cache = cache0.clone()
    ref = reference.step(model.w, ref_cache, tokens, parents, 12, routes=routes)
    cache = cache0.clone()
    r = peer.PeerRunner(model, cache, parents, r_read=12, forced=True, n_sm=4)
    r.set_inputs(tokens, 12, routes)
    r.anc_t.fill_((1 << 6) - 1)  # every tree token sees every other: a chain's mask, not the tree's
    with K.interpreted():
        logits = r.run()
    with pytest.raises(CorrectnessError):
        peer.check_step(r, logits, cache, ref, ref_cache, "micro broken mask", REL_TOL)


def test_a_routing_flip_limits_the_check_to_what_it_cannot_reach(model):
    """Real routing that differs from the reference's in the last layer for one token (as a near
    tie would): its logits are left out, the other tokens' logits and the earlier layer's KV are
    still checked; a flip for every token leaves nothing and is refused."""
    cfg = model.cfg
    parents = [-1, 0, 0]  # root and two children: token 2 is nobody's ancestor
    _, tokens, cache0, _ = _point(cfg, 3, 5, seed=103)
    ref_cache = cache0.clone()
    tr = reference.Trace()
    ref = reference.step(model.w, ref_cache, tokens, parents, 5, trace=tr)
    ref_routes = [tr.tensors[f"L{l}.route"].clone() for l in range(cfg.n_layers)]
    cache = cache0.clone()
    r, logits = _run(model, parents, tokens, 5, cache)
    assert peer.check_step(r, logits, cache, ref, ref_cache, "same", REL_TOL, ref_routes).routes_equal
    flipped = [x.clone() for x in ref_routes]
    used = flipped[1][2].tolist()
    flipped[1][2, 1] = next(x for x in range(cfg.n_experts) if x not in used)  # token 2, last layer
    c = peer.check_step(r, logits, cache, ref, ref_cache, "flip", REL_TOL, flipped)
    assert not c.routes_equal and c.rel_err < 5e-3
    everyone = [x.clone() for x in ref_routes]
    everyone[0] = torch.stack([torch.tensor([e for e in range(cfg.n_experts) if e not in row.tolist()][:cfg.top_k])
                               for row in everyone[0]])  # layer 0: every token on other experts
    with pytest.raises(CorrectnessError, match="every token"):
        peer.check_step(r, logits, cache, ref, ref_cache, "flip all", REL_TOL, everyone)


def test_greedy_decoding_equals_the_reference(model):
    prompt, steps = [3, 14, 15], 4
    ref = reference.greedy(model.w, reference.KVCache(model.cfg), prompt, steps)
    with K.interpreted():
        got = peer.greedy(model, prompt, steps)
    assert got == ref


# ---------------------------------------------------------------------- host logic
def test_op_bytes_cover_the_roofline_experts_and_dense_weights():
    cfg = preset("shard8")
    distinct = [49] * cfg.n_layers
    b = peer.op_bytes(cfg, 16, 2048, distinct)
    sb = step_bytes(cfg, 16, 2048, distinct)
    fp4 = lambda n, k: n * k // 2 + n * k // 16  # noqa: E731
    weights_up = sum(distinct) * (fp4(2 * cfg.d_expert, cfg.d_pool) + 4)
    weights_down = sum(distinct) * (fp4(cfg.d_pool, cfg.d_expert) + 4)
    assert weights_up + weights_down == sb.experts  # the routed experts' codes, scales and tensor scales
    assert b["moe_up"] > weights_up and b["moe_down"] > weights_down  # plus activations
    assert b["attn"] >= sb.kv_read and b["lm_head"] >= sb.lm_head - 2 * cfg.d_model
    dense = sum(b[k] for k in ("qkv", "oproj", "router_pool", "unpool"))
    assert dense >= sb.dense - cfg.n_layers * 4 * cfg.d_model  # the norm gains are the norms' bytes
    assert set(b) == set(peer.OPS)


def test_pick_config_takes_the_fastest_that_ran():
    recs = [peer.TuneRecord("moe_up", "a", 3e-6, (3e-6,)), peer.TuneRecord("moe_up", "b", None, (), "spill"),
            peer.TuneRecord("moe_up", "c", 2e-6, (2e-6,)), peer.TuneRecord("moe_up", "d", 2e-6, (2e-6,))]
    assert peer.pick_config(recs).config == "c"  # ties: the first in sweep order
    with pytest.raises(RuntimeError, match="spill"):
        peer.pick_config([recs[1]])


def test_sweep_configs_fit_the_timed_presets():
    for name in ("small", "shard8"):
        cfg = preset(name)
        assert peer.unsupported(cfg) is None
        for spec in peer.SWEEP:
            K.MoeConfig(*spec).validate(cfg.d_expert, cfg.d_pool)
            K.MoeConfig(*spec).validate(cfg.d_pool, cfg.d_expert)
    assert "multiples of 128" in peer.unsupported(preset("tiny"))
    with pytest.raises(ConfigError, match="multiples of 128"):
        peer.PeerModel(generate(preset("tiny")))


def test_runner_refuses_bad_inputs(model):
    cfg = model.cfg
    parents, tokens, cache0, routes = _point(cfg, 4, 12, seed=9, distinct=4)
    r = peer.PeerRunner(model, cache0, parents, r_read=12, forced=True, n_sm=4)
    with pytest.raises(ConfigError, match="read bound"):
        r.set_inputs(tokens, 13, routes)
    with pytest.raises(ConfigError, match="missing"):
        r.set_inputs(tokens, 12)
    bad = [x.clone() for x in routes]
    bad[0][0, 1] = bad[0][0, 0]
    with pytest.raises(ConfigError, match="twice"):
        r.set_inputs(tokens, 12, bad)
    with pytest.raises(ConfigError, match="set_inputs"):
        peer.PeerRunner(model, cache0, parents, r_read=12, forced=True).run()
    with pytest.raises(ConfigError, match="small_ops"):
        peer.PeerRunner(model, cache0, parents, r_read=12, forced=True, compile=True)


def test_route_tie_gap_tells_a_rounding_flip_from_a_wrong_choice():
    # the peer's real-routing check (peer_bench): where its top-k differs from the reference's, the
    # reference runs on the peer's routes, and every flip must be a near tie of the reference's logits
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 32, generator=g)
    top = logits.topk(4, dim=-1).indices
    assert peer.route_tie_gap(logits, top) == 0.0
    near = logits.clone()
    fifth = logits.topk(5, dim=-1).indices[:, 4]
    near[torch.arange(4), fifth] = logits.gather(1, top[:, 3:4])[:, 0] - 1e-4  # a hair below the 4th
    flipped = top.clone()
    flipped[:, 3] = fifth
    assert 0 < peer.route_tie_gap(near, flipped) < peer.TIE_GAP
    worst = logits.topk(32, dim=-1).indices[:, -4:]  # the four lowest
    assert peer.route_tie_gap(logits, worst) > 0.5


def test_op_accounting_counts_each_range_once_without_its_gaps():
    # profiler events as torch.profiler gives them: CPU-side `peer.<op>` ranges, their GPU-side
    # annotations (first kernel start to last kernel end, the host's launch gaps included), and the
    # kernels on the GPU timeline; Triton's own launches have no CPU-side parent
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    def ev(name, dev, t0=0.0, t1=0.0, kernels=(), children=(), ann=False):
        return NS(name=name, device_type=dev, is_async=False, time_range=NS(start=t0, end=t1), kernels=list(kernels),
                  cpu_children=list(children), is_user_annotation=ann)

    events, t = [], 0.0
    for _ in range(2):  # steps
        for _ in range(3):  # layers: two Triton kernels 30 us apart (the host's launch gap), then a cuBLAS GEMM
            events.append(ev("peer.attn", DeviceType.CPU, t, t + 40))
            events.append(ev("peer.attn", DeviceType.CUDA, t, t + 35, ann=True))
            events += [ev("_attn_partial_kernel", DeviceType.CUDA, t, t + 4),
                       ev("_attn_combine_kernel", DeviceType.CUDA, t + 34, t + 35)]
            t += 40
            gemm = ev("gemm", DeviceType.CUDA, t + 1, t + 11)
            events.append(ev("peer.lm_head", DeviceType.CPU, t, t + 12, children=[
                ev("aten::mm", DeviceType.CPU, kernels=[Kernel("gemm", 0, 10.0)])]))
            events += [ev("peer.lm_head", DeviceType.CUDA, t + 1, t + 11, ann=True), gemm]
            t += 12
        events.append(ev("stray", DeviceType.CUDA, t + 1, t + 2))  # outside every range: no op's
        t += 5
    per_step, names = peer.op_kernel_sums(events, steps=2)
    assert per_step == {"attn": [pytest.approx(15e-6)] * 2, "lm_head": [pytest.approx(30e-6)] * 2}
    assert names["attn"] == {"_attn_partial_kernel": pytest.approx(12e-6), "_attn_combine_kernel": pytest.approx(3e-6)}
    # without GPU-side annotations: the kernels launched under the CPU-side ranges
    cpu_only = [e for e in events if e.device_type == DeviceType.CPU]
    per_step, _ = peer.op_kernel_sums(cpu_only, steps=2)
    assert per_step == {"attn": [0.0, 0.0], "lm_head": [pytest.approx(30e-6)] * 2}


def test_the_compiled_flavour_keeps_its_gemms_fp32_at_one_row():
    """Under torch.compile the dense GEMMs are the opaque op `megabench::peer_mm32`: max-autotune
    turns on inductor's coordinate-descent tuning, and its decomposition of an M = 1 mm into a
    multiply and a sum returns the inputs' dtype, not the out_dtype asked for (on the H200,
    2026-12-01, the router's logits came back bf16 at T = 1 and the routing kernel failed to
    compile). Traced here without inductor: the graph holds the op, the output is fp32 and
    equal to the eager GEMM; the routing refuses a bf16 logit table by name."""
    from types import SimpleNamespace

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    stub = SimpleNamespace(out_dtype=False)  # the CPU's path: fp32 maths (no out_dtype mm here)
    g = torch.Generator().manual_seed(11)
    a = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    torch._dynamo.reset()
    f = torch.compile(lambda x, y: peer.PeerModel.mm32(stub, x, y), backend=capture, fullgraph=True)
    out = f(a, w)
    assert out.dtype == torch.float32 and torch.equal(out, a.float() @ w.float().t())
    assert any("peer_mm32" in str(n.target) for gm in graphs for n in gm.graph.nodes), graphs[0].graph
    assert peer.PeerModel.mm32(stub, a, w).dtype == torch.float32  # eager: unchanged
    torch._dynamo.reset()
    i32 = dict(dtype=torch.int32)
    with pytest.raises(TypeError, match="logits must be fp32, got torch.bfloat16"):
        K.route(torch.zeros(1, 8, dtype=torch.bfloat16), 8, 1, 4, 2, torch.zeros(1, 2, **i32), torch.zeros(1, 2),
                torch.zeros(16, **i32), torch.zeros(1, **i32), torch.zeros(1, **i32), block_m=16, max_per_expert=1)
