"""The peer baseline's Triton kernels on the CPU, through Triton's interpreter
(peer_kernels.interpreted), on fresh random data against the references: the storage word's pair
decode, routing (top-k, the align of token-expert pairs), the fused MoE's gate/up and down
(against the dequantised matmul), tree attention (global and sliding layers, the ring wrapped,
several splits), RoPE + the KV write, the norms, the combine; and the sm_90a compile of the
kernels the sweep can pick (registers, spills, wgmma). ~1-2 min here (2 shared cores)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from megakernel import peer_kernels as K  # noqa: E402
from megakernel import reference, tree  # noqa: E402
from megakernel.config import preset  # noqa: E402
from megakernel.fp4_layout import from_kernel_words  # noqa: E402
from megakernel.nvfp4 import e2m1_table, random_nvfp4  # noqa: E402
from megakernel.runtime import check_close  # noqa: E402
from megakernel.weights import BF16, ExpertBank, rope_tables  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------- the storage word
def _decode(words: torch.Tensor, shifts) -> torch.Tensor:
    """Host emulation of _fp4_pair over int32 words: [..., 8] e2m1 values in k order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = [None] * 8
    for e, (mag, sign) in enumerate(shifts):
        a = (w << mag) if mag >= 0 else (w >> -mag)
        p = ((a & K.MAG_MASK) | ((w << sign) & 0x80008000)) & 0xFFFFFFFF
        for half, j in ((p & 0xFFFF, e), (p >> 16, e + 4)):
            f16 = half.to(torch.int32).to(torch.int16).view(torch.float16).float()
            out[j] = f16 * 2.0 ** 14
    return torch.stack(out, dim=-1)


def test_pair_shifts_decode_the_storage_words():
    g = _gen(1)
    codes = torch.randint(0, 256, (64, 32), generator=g, dtype=torch.uint8)  # storage words
    nat = from_kernel_words(codes)
    vals = e2m1_table()[torch.stack([nat & 0xF, nat >> 4], dim=-1).reshape(64, -1).long()]  # [64, 64] k order
    got = _decode(codes.view(torch.int32), K.PAIR_SHIFTS).reshape(64, -1)
    assert torch.equal(got, vals)
    assert K.PAIR_SHIFTS == ((9, 6), (6, 3), (3, 4), (-4, 5))
    broken = (K.PAIR_SHIFTS[1], K.PAIR_SHIFTS[0]) + K.PAIR_SHIFTS[2:]  # the checker can fail
    assert not torch.equal(_decode(codes.view(torch.int32), broken).reshape(64, -1), vals)


def test_planes_round_trip():
    x = torch.randn(3, 256, generator=_gen(2))
    p = K.to_planes(x)
    assert torch.equal(K.from_planes(p), x) and torch.equal(p, x[:, K.plane_index(256)])
    assert torch.equal(p[:, 1 * 32 + 5], x[:, 8 * 5 + 1])  # plane 1, word 5 holds k = 41


# ---------------------------------------------------------------------- routing
def _routes(t, k, e, g):
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)


def _route(logits, t, e, k, bm, forced=None):
    mb = K.max_blocks(t * k, e, bm, t)
    ids, w = torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, k)
    s, b, n = torch.zeros(mb * bm, dtype=torch.int32), torch.zeros(mb, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with K.interpreted():
        K.route(logits, logits.shape[1], t, e, k, ids, w, s, b, n, block_m=bm, max_per_expert=t, forced=forced)
    return ids, w, s, b, int(n), mb


# (128, 8, 64, 16): a batch's 128 rows, 8 row chunks and 8 pair chunks (K.ROUTE_ROWS / ROUTE_PAIRS),
# up to 128 tokens on one expert; (40, 3, 8, 4): a ragged last chunk of each
@pytest.mark.parametrize("t,k,e,bm", [(16, 8, 64, 16), (5, 2, 6, 4), (1, 8, 256, 16), (7, 3, 5, 2), (128, 8, 64, 16),
                                      (40, 3, 8, 4)])
def test_route_forced_aligns_like_the_host_reference(t, k, e, bm):
    g = _gen(3 + t)
    routes = _routes(t, k, e, g)
    logits = torch.randn(t, e + 40, generator=g)  # rows wider than E: the router's columns come first
    ids, w, s, b, n, mb = _route(logits, t, e, k, bm, forced=routes)
    rs, rb, rn = K.align_reference(routes, e, bm, mb)
    assert torch.equal(ids, routes) and (torch.equal(s, rs), torch.equal(b, rb), n) == (True, True, rn)
    ref_w = torch.softmax(logits[:, :e].gather(1, routes.long()), dim=-1)
    assert torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)
    # invariants: every pair exactly once, blocks in expert order, each block one expert's pairs
    live = s[s < t * k]
    assert sorted(live.tolist()) == list(range(t * k))
    assert b[:n].tolist() == sorted(b[:n].tolist()) and (b[n:] == -1).all()
    for blk in range(n):
        pairs = s[blk * bm:(blk + 1) * bm]
        assert all(int(routes.view(-1)[p]) == int(b[blk]) for p in pairs if p < t * k)


@pytest.mark.parametrize("t", [9, 37])  # 37: three chunks of rows, three of pairs
def test_route_topk_breaks_ties_like_the_reference(t):
    g = _gen(4)
    e, k = 32, 8
    logits = torch.randint(-3, 4, (t, e), generator=g).float()  # many exact ties
    ids, w, s, b, n, mb = _route(logits, t, e, k, 16)
    assert torch.equal(ids.long(), reference.topk_route(logits, k))
    rs, rb, rn = K.align_reference(ids, e, 16, mb)
    assert torch.equal(s, rs) and torch.equal(b, rb) and n == rn


def test_max_blocks_bounds_every_routing():
    g = _gen(5)
    for t, k, e, bm in ((16, 8, 256, 16), (16, 8, 64, 4), (3, 2, 2, 1), (16, 4, 8, 16)):
        mb = K.max_blocks(t * k, e, bm, t)
        for _ in range(20):
            _, _, n = K.align_reference(_routes(t, k, e, g), e, bm, mb)
            assert n <= mb


# ---------------------------------------------------------------------- fused MoE
def _bank(e, n, k, g):
    return ExpertBank.from_natural([random_nvfp4(n, k, 1 / math.sqrt(k), g) for _ in range(e)], "cpu")


def _moe_case(seed, t=5, k=2, e=6, f=128, p=256):
    g = _gen(seed)
    w1, w2 = _bank(e, 2 * f, p, g), _bank(e, p, f, g)
    routes = _routes(t, k, e, g)
    logits = torch.randn(t, e + p, generator=g)  # [router logits | pooled (fp32)]
    ids, w, s, b, n, mb = _route(logits, t, e, k, K.BLOCK_M, forced=routes)
    x = logits.clone()
    x[:, e:] = K.to_planes(logits[:, e:])
    return g, w1, w2, routes, logits, x, (s, b, torch.tensor([n], dtype=torch.int32))


def _ref_up(w1, routes, pooled, f):
    xb = pooled.to(BF16).double()
    out = torch.zeros(routes.numel(), f, dtype=torch.float64)
    for pr, ex in enumerate(routes.reshape(-1).tolist()):
        wd = w1.expert(ex).dequant_bf16_exact().double() * float(w1.tensor_scale[ex])
        gu = xb[pr // routes.shape[1]] @ wd.T
        out[pr] = torch.nn.functional.silu(gu[:f]) * gu[f:]
    return out.to(BF16)


def _ref_down(w2, routes, act):
    out = torch.zeros(routes.numel(), w2.codes.shape[1], dtype=torch.float64)
    for pr, ex in enumerate(routes.reshape(-1).tolist()):
        wd = w2.expert(ex).dequant_bf16_exact().double() * float(w2.tensor_scale[ex])
        out[pr] = act[pr].double() @ wd.T
    return out.to(BF16)


@pytest.mark.parametrize("cfg", [K.MoeConfig(64, 128, 4, 3), K.MoeConfig(32, 256, 4, 3)], ids=lambda c: c.label())
def test_moe_up_and_down_match_the_dequantised_reference(cfg):
    t, k, e, f, p = 5, 2, 6, 128, 256
    g, w1, w2, routes, logits, x, (s, b, n) = _moe_case(7, t, k, e, f, p)
    act = torch.full((t * k, f), float("nan"), dtype=BF16)
    with K.interpreted():
        K.moe_up(x, e + p, e, True, s, b, n, w1.codes, w1.scales, w1.tensor_scale, act, t * k, k, cfg)
    ref = _ref_up(w1, routes, logits[:, e:], f)
    got = K.from_planes(act)
    assert (got == ref).float().mean() > 0.999  # bf16 outputs: at most rare one-ulp flips (fp32 order)
    check_close(got, ref, "moe_up", rel=1e-3)
    act_in = K.to_planes(torch.randn(t * k, f, generator=g).to(BF16))  # down's own fresh input
    y = torch.full((t * k, p), float("nan"), dtype=BF16)
    down = K.MoeConfig(cfg.block_n, 128, cfg.num_warps, cfg.num_stages)
    with K.interpreted():
        K.moe_down(act_in, s, b, n, w2.codes, w2.scales, w2.tensor_scale, y, t * k, down)
    ref2 = _ref_down(w2, routes, K.from_planes(act_in))
    assert (y == ref2).float().mean() > 0.999
    check_close(y, ref2, "moe_down", rel=1e-3)


def test_moe_with_a_broken_pair_decode_is_caught(monkeypatch):
    t, k, e, f, p = 3, 2, 4, 128, 128
    _, w1, _, routes, logits, x, (s, b, n) = _moe_case(8, t, k, e, f, p)
    monkeypatch.setattr(K, "_M1", K._M0)  # pair 1 decoded with pair 0's magnitude shift
    act = torch.zeros(t * k, f, dtype=BF16)
    with K.interpreted():
        K.moe_up(x, e + p, e, True, s, b, n, w1.codes, w1.scales, w1.tensor_scale, act, t * k, k,
                 K.MoeConfig(64, 128, 4, 3))
    from microbench.errors import CorrectnessError

    with pytest.raises(CorrectnessError):
        check_close(K.from_planes(act), _ref_up(w1, routes, logits[:, e:], f), "broken moe_up", rel=1e-2)


def test_moe_config_validation():
    with pytest.raises(ValueError, match="BLOCK_K"):
        K.MoeConfig(64, 64, 4, 3).validate(1024, 1024)
    with pytest.raises(ValueError, match="BLOCK_N"):
        K.MoeConfig(48, 128, 4, 3).validate(1024, 1024)
    assert K.MoeConfig(64, 256, 8, 3).validate(1024, 2048).label() == "n64k256w8s3"


# ---------------------------------------------------------------------- attention, RoPE, norms
def _small_cfg():
    return preset("tiny")  # 4 query / 2 KV heads of 64, window 16 (ring 32), layer 2 global


@pytest.mark.parametrize("layer,ctx,t", [(2, 20, 16), (0, 40, 16), (0, 5, 1), (2, 0, 1), (0, 100, 7)])
def test_tree_attention_matches_the_reference(layer, ctx, t):
    cfg = _small_cfg()
    g = _gen(10 + ctx + t)
    cache = reference.KVCache(cfg).fill_random(g)
    parents = tree.binary_ish(t) if t > 1 else [-1]
    depth, anc = tree.depths(parents), tree.ancestor_mask(parents)
    q = torch.randn(t, cfg.n_heads, cfg.head_dim, generator=g).to(BF16)
    ref = reference.attention(cfg, layer, q, cache, ctx, depth, anc)
    glob = cfg.is_global(layer)
    n_read = min(cfg.max_context, ctx + t) if glob else min(cfg.ring_slots, ctx + t)
    ac = K.attn_config(n_read, t * cfg.group, cfg.n_kv_heads, n_sm=4, block_n=16)
    assert ac.n_splits > 1 or n_read <= ac.block_n  # the merge of several splits is exercised
    rows_pad = -(-t * cfg.group // ac.block_q) * ac.block_q
    o_part = torch.zeros(cfg.n_kv_heads * ac.n_splits * rows_pad * cfg.head_dim)
    ml = torch.zeros(cfg.n_kv_heads * ac.n_splits * rows_pad * 2)
    out = torch.zeros(t, cfg.attn_width, dtype=BF16)
    i32 = dict(dtype=torch.int32)
    bits = torch.tensor([sum(1 << j for j in range(t) if anc[i, j]) for i in range(t)], **i32)
    with K.interpreted():
        K.attention(q, cache.k[layer], cache.v[layer], torch.tensor([ctx], **i32), torch.tensor(depth, **i32), bits,
                    out, o_part, ml, ac, n_tokens=t, group=cfg.group, head_dim=cfg.head_dim, is_global=glob,
                    ring=cfg.ring_slots, window=cfg.window)
    check_close(out, ref, f"attention layer {layer} ctx {ctx} T {t}", rel=4e-3)


def test_tree_attention_without_the_tree_mask_is_caught():
    cfg = _small_cfg()
    g = _gen(11)
    t, ctx, layer = 16, 20, 2
    cache = reference.KVCache(cfg).fill_random(g)
    parents = tree.binary_ish(t)
    depth, anc = tree.depths(parents), tree.ancestor_mask(parents)
    q = torch.randn(t, cfg.n_heads, cfg.head_dim, generator=g).to(BF16)
    ref = reference.attention(cfg, layer, q, cache, ctx, depth, anc)
    ac = K.attn_config(ctx + t, t * cfg.group, cfg.n_kv_heads, n_sm=4, block_n=16)
    rows_pad = -(-t * cfg.group // ac.block_q) * ac.block_q
    out = torch.zeros(t, cfg.attn_width, dtype=BF16)
    i32 = dict(dtype=torch.int32)
    with K.interpreted():  # every new row visible to every token: not the tree's attention
        K.attention(q, cache.k[layer], cache.v[layer], torch.tensor([ctx], **i32), torch.tensor(depth, **i32),
                    torch.full((t,), (1 << t) - 1, **i32), out,
                    torch.zeros(cfg.n_kv_heads * ac.n_splits * rows_pad * cfg.head_dim),
                    torch.zeros(cfg.n_kv_heads * ac.n_splits * rows_pad * 2), ac, n_tokens=t, group=cfg.group,
                    head_dim=cfg.head_dim, is_global=True, ring=cfg.ring_slots, window=cfg.window)
    from microbench.errors import CorrectnessError

    with pytest.raises(CorrectnessError):
        check_close(out, ref, "attention without the tree mask", rel=4e-3)


@pytest.mark.parametrize("layer,ctx", [(2, 30), (0, 25)])  # global; sliding with the ring wrapped (25 + 16 > 32)
def test_rope_kv_matches_the_reference(layer, ctx):
    cfg = _small_cfg()
    g = _gen(12 + ctx)
    t = 16
    parents = tree.binary_ish(t)
    depth = tree.depths(parents)
    cos, sin = rope_tables(cfg, "cpu")
    qkv = torch.randn(t, cfg.qkv_rows, generator=g)
    cache = reference.KVCache(cfg).fill_random(g)
    ref_cache = cache.clone()
    hq, hk, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = torch.tensor(depth) + ctx
    c, s = cos[pos], sin[pos]
    rq = reference.rope(qkv[:, :hq * hd].reshape(t, hq, hd), c, s).to(BF16)
    rk = reference.rope(qkv[:, hq * hd:(hq + hk) * hd].reshape(t, hk, hd), c, s).to(BF16)
    rv = qkv[:, (hq + hk) * hd:].reshape(t, hk, hd).to(BF16)
    slots = ref_cache.slot(layer, torch.arange(ctx, ctx + t))
    ref_cache.k[layer][:, slots] = rk.transpose(0, 1)
    ref_cache.v[layer][:, slots] = rv.transpose(0, 1)
    q = torch.zeros(t, hq, hd, dtype=BF16)
    i32 = dict(dtype=torch.int32)
    with K.interpreted():
        K.rope_kv(qkv, cos, sin, torch.tensor([ctx], **i32), torch.tensor(depth, **i32), q, cache.k[layer],
                  cache.v[layer], n_heads=hq, n_kv=hk, head_dim=hd, is_global=cfg.is_global(layer), ring=cfg.ring_slots)
    check_close(q, rq, "rope q", rel=4e-3)
    for a, b in zip(cache.k + cache.v, ref_cache.k + ref_cache.v):
        check_close(a, b, "rope_kv cache", rel=4e-3)
    assert cache.equal(ref_cache) or (q != rq).sum() < 4  # rare FMA-contraction roundings only


@pytest.mark.parametrize("mode", ["plain", "delta", "embed"])
def test_add_rmsnorm(mode):
    g = _gen(13)
    t, d, eps = 4, 384, 1e-5  # d not a power of two: the masked tail
    x = torch.randn(t, d, generator=g)
    delta = torch.randn(t, d, generator=g)
    gain = (1 + 0.1 * torch.randn(d, generator=g)).to(BF16)
    emb = torch.randn(50, d, generator=g).to(BF16)
    tok = torch.tensor([3, 9, 0, 49])
    want_x = {"plain": x, "delta": x + delta, "embed": emb[tok].float()}[mode]
    want_h = reference.rmsnorm(want_x, gain, eps)
    xx, h = x.clone(), torch.zeros(t, d, dtype=BF16)
    with K.interpreted():
        K.add_rmsnorm(xx, gain, h, eps, delta=delta if mode == "delta" else None,
                      tokens=tok if mode == "embed" else None, embed=emb if mode == "embed" else None)
    assert torch.allclose(xx, want_x)
    check_close(h, want_h, f"rmsnorm {mode}", rel=4e-3)


def test_moe_combine_sums_ranks_in_order():
    g = _gen(14)
    t, k, p = 3, 4, 200
    y = torch.randn(t * k, p, generator=g).to(BF16)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    z = torch.zeros(t, p, dtype=BF16)
    with K.interpreted():
        K.moe_combine(y, w, z, k)
    ref = torch.zeros(t, p)
    for r in range(k):
        ref = ref + w[:, r:r + 1] * y.view(t, k, p)[:, r].float()
    assert torch.equal(z, ref.to(BF16))


# ---------------------------------------------------------------------- sm_90a without a GPU
@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    from megakernel.peer_bench import compile_report

    rep = compile_report(log=lambda *_: None)
    assert rep and not [r for r in rep if "error" in r], [r for r in rep if "error" in r]
    by = {r["kernel"]: r for r in rep}
    for name in ("moe_up n64k128w4s3", "moe_down n64k128w4s3"):  # the defaults (peer.default_moe_configs)
        assert by[name]["wgmma"], by[name]
    assert all(r["spill_store_bytes"] == 0 for r in rep), [r for r in rep if r["spill_store_bytes"]]  # the sweep too
    assert not any(r["ftz"] for r in rep)  # no flush-to-zero anywhere: e2m1's 0.5 is an fp16 subnormal
