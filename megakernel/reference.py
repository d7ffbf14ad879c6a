"""The torch reference of one decode step over a token tree: the numerics contract.

Every rounding point the kernels have is here too, so "agrees within bf16 tolerance" is tight:
  residual stream x          fp32
  norm outputs               bf16( x * rsqrt(mean(x^2) + eps) * g )
  q, k (after RoPE), v       bf16 (RoPE in fp32 from the shared cos/sin tables)
  attention                  fp32 scores * 1/sqrt(hd), fp32 softmax, output bf16
  o-proj / unpool            fp32 accumulate, added to the fp32 residual
  router                     fp32 logits; top-k by (logit desc, index asc); softmax over the k
  pooled                     bf16
  expert gate/up             fp32 accumulate of bf16-exact NVFP4 values, times the tensor scale
  expert activation          bf16( silu(gate) * up )
  expert output              bf16( acc * tensor_scale )
  combine                    bf16( sum over ranks in order of w_r * y_r )
  logits                     fp32; argmax ties -> lowest index
All matmuls upcast to fp32 (TF32 off). Tokens are independent rows everywhere except
attention, where the tree mask decides what each token sees.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import tree as treelib
from .config import ConfigError, ModelConfig
from .weights import BF16, LayerWeights, ModelWeights


def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class KVCache:
    """Per layer K and V, each [Hkv, slots, hd] bf16. Sequence index s lives in slot s (global
    layers) or s mod ring_slots (sliding layers)."""

    def __init__(self, cfg: ModelConfig, device="cpu"):
        self.cfg = cfg
        self.k = [torch.zeros(cfg.n_kv_heads, cfg.cache_slots(l), cfg.head_dim, dtype=BF16, device=device)
                  for l in range(cfg.n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    def slot(self, layer: int, seq) -> torch.Tensor | int:
        return seq if self.cfg.is_global(layer) else seq % self.cfg.ring_slots

    def fill_random(self, generator: torch.Generator, std: float = 1.0) -> KVCache:
        """Stand-in for a prefilled prompt: every slot random (timing and kernel-vs-reference
        checks do not need a real prefix, only a well-defined one)."""
        for t in (*self.k, *self.v):
            t.copy_((torch.randn(t.shape, generator=generator, device=t.device) * std).to(BF16))
        return self

    def clone(self) -> KVCache:
        c = KVCache.__new__(KVCache)
        c.cfg = self.cfg
        c.k = [t.clone() for t in self.k]
        c.v = [t.clone() for t in self.v]
        return c

    def compact(self, ctx: int, accepted: Sequence[int]) -> None:
        """After verification: move the accepted tree tokens (indices in path order, root first)
        to consecutive sequence indices ctx, ctx+1, ... (their RoPE positions already match)."""
        idx = list(accepted)
        if idx != sorted(idx) or (idx and idx[0] != 0):
            raise ConfigError(f"accepted path {idx} must start at the root and increase")
        for l in range(self.cfg.n_layers):
            src = torch.tensor([self.slot(l, ctx + i) for i in idx], device=self.k[l].device)
            dst = torch.tensor([self.slot(l, ctx + j) for j in range(len(idx))], device=self.k[l].device)
            for t in (self.k[l], self.v[l]):
                t[:, dst] = t[:, src].clone()

    def equal(self, other: KVCache) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.k + self.v, other.k + other.v))


def rmsnorm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * r * g.to(x.dtype)).to(BF16)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (2i, 2i+1) of x [T, H, hd] fp32 rotated by per-token cos/sin [T, hd/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def topk_route(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Expert ids [T, k] ordered by (logit desc, index asc)."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # stable: lower index first on ties
    return order[:, :k]


@dataclass
class Trace:
    """Optional per-op intermediates for op-by-op diffs (keys 'L{l}.{name}')."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def put(self, key: str, t: torch.Tensor) -> None:
        self.tensors[key] = t.detach().clone()


def attention(cfg: ModelConfig, layer: int, q: torch.Tensor, cache: KVCache, ctx: int, depth: list[int],
              anc: torch.Tensor, acc: torch.dtype = torch.float32) -> torch.Tensor:
    """q [T, Hq, hd] bf16 -> o [T, Hq*hd] bf16, reading the cached prefix and the tree's new keys
    (already written to the cache at sequence indices ctx..ctx+T-1)."""
    t = q.shape[0]
    dev = q.device
    glob = cfg.is_global(layer)
    lo = 0 if glob else max(0, ctx - cfg.window + 1)
    seqs = torch.arange(lo, ctx, device=dev)
    slots_c = cache.slot(layer, seqs)
    slots_n = cache.slot(layer, torch.arange(ctx, ctx + t, device=dev))
    kc, vc = cache.k[layer][:, slots_c].to(acc), cache.v[layer][:, slots_c].to(acc)  # [Hkv, nc, hd]
    kn, vn = cache.k[layer][:, slots_n].to(acc), cache.v[layer][:, slots_n].to(acc)  # [Hkv, T, hd]
    kk = torch.cat([kc, kn], dim=1)
    vv = torch.cat([vc, vn], dim=1)
    pos = torch.tensor(depth, device=dev) + ctx
    mask_c = torch.ones(t, seqs.numel(), dtype=torch.bool, device=dev)
    if not glob:
        mask_c = seqs[None, :] >= (pos[:, None] - cfg.window + 1)
    mask = torch.cat([mask_c, anc.to(dev)], dim=1)  # [T, nc + T]
    g = cfg.group
    qf = q.to(acc).reshape(t, cfg.n_kv_heads, g, cfg.head_dim)  # head h = kv * g + j
    scores = torch.einsum("tkjd,knd->tkjn", qf, kk) * (cfg.head_dim ** -0.5)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("tkjn,knd->tkjd", p, vv)
    return o.reshape(t, cfg.attn_width).to(BF16)


def moe(cfg: ModelConfig, lw: LayerWeights, h2: torch.Tensor, route: torch.Tensor | None,
        trace: Trace | None, tag: str, acc: torch.dtype = torch.float32,
        operand: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """h2 [T, d] bf16 -> z [T, p] bf16 (the combined expert output, before the unpooler).
    `operand` (default: none) re-rounds both expert GEMMs' activation operands, [n, K] bf16 -> the
    values the GEMM multiplies (megakernel/fp8_budget.py: E4M3 per token)."""
    logits = (h2.to(acc) @ lw.router.to(acc).T).float()  # [T, E]
    sel = topk_route(logits, cfg.top_k) if route is None else route.to(h2.device).long()
    if sel.shape != (h2.shape[0], cfg.top_k):
        raise ConfigError(f"route shape {tuple(sel.shape)} != ({h2.shape[0]}, {cfg.top_k})")
    wts = torch.softmax(logits.gather(1, sel), dim=-1)  # [T, k] fp32
    pooled = (h2.to(acc) @ lw.pool.to(acc).T).to(BF16)  # [T, p]
    f = cfg.d_expert
    y = torch.zeros(h2.shape[0], cfg.top_k, cfg.d_pool, dtype=BF16, device=h2.device)
    for e in torch.unique(sel).tolist():
        tok, rank = (sel == e).nonzero(as_tuple=True)
        w1 = lw.w1.expert(e)
        xin = pooled[tok] if operand is None else operand(pooled[tok])
        gu = (xin.to(acc) @ w1.dequant_bf16_exact().to(acc).T) * w1.tensor_scale  # [n, 2f]
        gate, up = gu[:, :f], gu[:, f:]
        a = (torch.nn.functional.silu(gate) * up).to(BF16)
        w2 = lw.w2.expert(e)
        if operand is not None:
            a = operand(a)
        y[tok, rank] = ((a.to(acc) @ w2.dequant_bf16_exact().to(acc).T) * w2.tensor_scale).to(BF16)
    z = torch.zeros(h2.shape[0], cfg.d_pool, dtype=acc, device=h2.device)
    for r in range(cfg.top_k):  # fixed rank order: the kernels sum in the same order
        z = z + wts[:, r:r + 1].to(acc) * y[:, r].to(acc)
    if trace is not None:
        trace.put(f"{tag}.router_logits", logits)
        trace.put(f"{tag}.route", sel)
        trace.put(f"{tag}.route_w", wts)
        trace.put(f"{tag}.pooled", pooled)
        trace.put(f"{tag}.expert_out", y)
    return z.to(BF16)


def step(w: ModelWeights, cache: KVCache, tokens: Sequence[int] | torch.Tensor, parents: Sequence[int], ctx: int,
         routes: Sequence[torch.Tensor] | None = None, trace: Trace | None = None,
         acc: torch.dtype = torch.float32,
         expert_operand: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One decode/verify step: logits [T, V] fp32. Writes the T tokens' K/V into `cache` at
    sequence indices ctx..ctx+T-1 (not yet accepted: see KVCache.compact). `acc` float64 makes
    the reference independent of reduction order (CPU tests of tree vs sequential decoding).
    `expert_operand`: moe's `operand` (none: the kernels' own rounding points)."""
    _no_tf32()
    cfg = w.cfg
    tokens = torch.as_tensor(tokens, device=w.device).long()
    t = tokens.numel()
    cfg.check_step(ctx, t)
    if len(parents) != t:
        raise ConfigError(f"{t} tokens but {len(parents)} parents")
    depth = treelib.depths(parents)
    anc = treelib.ancestor_mask(parents)
    if ctx + max(depth) >= cfg.max_context:
        raise ConfigError(f"position {ctx + max(depth)} outside the RoPE table ({cfg.max_context})")
    if routes is not None and len(routes) != cfg.n_layers:
        raise ConfigError(f"routes for {len(routes)} layers, model has {cfg.n_layers}")
    pos = torch.tensor(depth, device=w.device) + ctx
    cos, sin = w.rope_cos[pos].to(acc), w.rope_sin[pos].to(acc)
    x = w.embed[tokens].to(acc)
    hq, hk, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for l, lw in enumerate(w.layers):
        tag = f"L{l}"
        h = rmsnorm(x, lw.attn_norm, cfg.rms_eps)
        qkv = h.to(acc) @ lw.wqkv.to(acc).T
        q = rope(qkv[:, :hq * hd].reshape(t, hq, hd), cos, sin).to(BF16)
        k = rope(qkv[:, hq * hd:(hq + hk) * hd].reshape(t, hk, hd), cos, sin).to(BF16)
        v = qkv[:, (hq + hk) * hd:].reshape(t, hk, hd).to(BF16)
        slots = cache.slot(l, torch.arange(ctx, ctx + t, device=w.device))
        cache.k[l][:, slots] = k.transpose(0, 1)
        cache.v[l][:, slots] = v.transpose(0, 1)
        o = attention(cfg, l, q, cache, ctx, depth, anc, acc)
        x = x + o.to(acc) @ lw.wo.to(acc).T
        h2 = rmsnorm(x, lw.ffn_norm, cfg.rms_eps)
        z = moe(cfg, lw, h2, None if routes is None else routes[l], trace, tag, acc, expert_operand)
        x = x + z.to(acc) @ lw.unpool.to(acc).T
        if trace is not None:
            trace.put(f"{tag}.h", h)
            trace.put(f"{tag}.q", q)
            trace.put(f"{tag}.k", k)
            trace.put(f"{tag}.v", v)
            trace.put(f"{tag}.attn", o)
            trace.put(f"{tag}.h2", h2)
            trace.put(f"{tag}.z", z)
            trace.put(f"{tag}.x", x)
    hf = rmsnorm(x, w.final_norm, cfg.rms_eps)
    logits = (hf.to(acc) @ w.lm_head.to(acc).T).float()
    if trace is not None:
        trace.put("final.hf", hf)
        trace.put("final.logits", logits)
    return logits


@dataclass(frozen=True)
class Request:
    """One request of a batched step: its tree's tokens and parents (parent -1: the root) and the
    cached positions of its own KV cache before the step."""
    tokens: Sequence[int] | torch.Tensor
    parents: Sequence[int]
    ctx: int


def step_batch(w: ModelWeights, caches: Sequence[KVCache], requests: Sequence[Request],
               routes: Sequence[torch.Tensor] | None = None, traces: Sequence[Trace] | None = None) -> torch.Tensor:
    """The batched step's contract: each request's own `step` on its own cache (request r on
    caches[r]), nothing shared. Logits [rows, V], the requests' rows in order. `routes` (forced):
    per layer [rows, top_k] over those rows; `traces`: one per request."""
    if len(caches) < len(requests):
        raise ConfigError(f"{len(requests)} requests but {len(caches)} caches (one per request)")
    out, row = [], 0
    for r, q in enumerate(requests):
        t = len(q.tokens)
        rr = None if routes is None else [rl[row:row + t] for rl in routes]
        out.append(step(w, caches[r], q.tokens, q.parents, q.ctx, routes=rr,
                        trace=None if traces is None else traces[r]))
        row += t
    return torch.cat(out)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice per row, ties to the lowest index (torch.argmax's documented behaviour
    returns the first maximal index)."""
    return torch.argmax(logits, dim=-1)


def greedy(w: ModelWeights, cache: KVCache, prompt: Sequence[int], n_new: int,
           acc: torch.dtype = torch.float32) -> list[int]:
    """Plain greedy decoding, one token per step (T=1), prefilling the prompt token by token."""
    out = []
    ctx = 0
    last = None
    for tok in prompt:
        logits = step(w, cache, [tok], [-1], ctx, acc=acc)
        ctx += 1
        last = int(argmax(logits)[0])
    for _ in range(n_new):
        out.append(last)
        logits = step(w, cache, [last], [-1], ctx, acc=acc)
        ctx += 1
        last = int(argmax(logits)[0])
    return out
