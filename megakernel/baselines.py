"""The naive torch expression of the decode/verify step (impl names naive_torch_*): not a
competent baseline. It dequantises a padded set of expert slots to bf16 every step (below), which
no serving engine would run; the competent baseline is the peer (peer.py: a Triton fused MoE over
the routed experts only, cuBLAS, flash-decoding attention, one CUDA graph). Kept, labelled, for
what plain torch gives.

One implementation of reference.step's function, written for a GPU, run three ways:
  eager    the plain kernel chain, one Python-issued launch per op ("the standard kernel chain")
  graph    the same ops captured once in a CUDA graph (warm-up x3 on a side stream,
           torch.cuda.graph, g.replay())
  compile  torch.compile(mode="reduce-overhead") by region: the decoder-layer function is compiled
           once and called for every layer with that layer's weights (nn.Parameter, so static
           graph inputs that are never copied) and KV cache; a per-step prologue (embedding,
           positions, masks) and epilogue (final norm, LM head) are compiled likewise. Each call
           replays its own CUDA graph (cudagraph trees). Compiling one layer keeps compile time
           independent of the layer count.

Graph-capturable by construction: no host syncs, static shapes.
- Positions, cache slots and masks are computed on the device from a 0-d `ctx` tensor, so one
  capture serves any context up to its read sizes: global layers read `r_global` >= ctx cached
  rows (rows >= ctx masked), sliding layers `r_sliding` rows ending at ctx (rows outside a token's
  window masked), plus the T new rows. The timed runs use r_global = ctx, r_sliding = min(ctx, W).
- Routed experts: a padded set of the DISTINCT experts, computed on the device. Its size is the
  static bound C = min(E, T*k) (8 for T=1; 128 for T=16 at shard8, 64 for small): a token-free
  static shape must allow every routing. The routed experts come first (ascending id), the
  C - distinct padding slots repeat the first one (their NVFP4 reads hit L2) and are never
  combined. Every slot is dequantised to bf16 and multiplied with all T rows (FLOPs are free at
  T <= 16). Byte cost per layer: C x (NVFP4 expert read + dequantised bf16 write + bf16 read)
  versus the roofline's distinct x NVFP4 read: at shard8 T=16 with 49 distinct experts, 128
  slots x 6.3 M values x 2 B = 1.6 GB of bf16 weights written and read again per layer. Plain
  torch has no fused NVFP4 GEMM for Hopper; this materialisation is the price of staying in torch
  and what the megakernel's in-register dequantisation avoids. `dequant_bytes_per_step` reports it.

Numerics follow reference.py's contract (its docstring lists the rounding points): every
product of two bf16 values is exact in fp32, matmuls accumulate in fp32 (cuBLAS bf16 GEMMs with
fp32 output where torch has them, `out_dtype`; elsewhere the bf16 operands are upcast), attention
is fp32 with bf16 q/k/v, NVFP4 values are dequantised exactly to bf16 (e2m1 x e4m3 fits bf16) and
the tensor scale is applied to the fp32 accumulator. Only reduction orders differ from the
reference (and RMSNorm is F.rms_norm): results agree to bf16 rounding (checked before timing).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from microbench.errors import CorrectnessError

from . import tree as treelib
from .config import ConfigError, ModelConfig
from .fp4_layout import half_word_table
from .nvfp4 import e4m3_decode
from .reference import KVCache
from .weights import BF16, ModelWeights

BASELINES = ("eager", "graph", "compile")
# "naive": the plain torch expression (every padded expert slot dequantised to bf16 each step), as
# the step rows label it (reports/megakernel.py reads older results' torch_* names as these)
IMPL_NAMES = {"eager": "naive_torch_eager", "graph": "naive_torch_graph", "compile": "naive_torch_compile"}


# ---------------------------------------------------------------------- numerics helpers
def e4m3_lut(device) -> torch.Tensor:
    """bf16 [256]: every E4M3 bit pattern's value (exact in bf16; NaN for S.1111.111)."""
    return e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8)).to(BF16).to(device)


_OUT_DTYPE: dict[str, bool] = {}


def out_dtype_supported(device) -> bool:
    """Does torch.mm(bf16, bf16, out_dtype=float32) work here (and agree with the upcast product)?
    Checked once per device, outside any capture."""
    device = torch.device(device)
    key = str(device)
    if key not in _OUT_DTYPE:
        ok = False
        if device.type == "cuda":
            try:
                g = torch.Generator(device=device).manual_seed(1)
                a = torch.randn(16, 64, generator=g, device=device).to(BF16)
                b = torch.randn(32, 64, generator=g, device=device).to(BF16)
                r = torch.mm(a, b.t(), out_dtype=torch.float32)
                r3 = torch.bmm(a[None], b.t()[None], out_dtype=torch.float32)[0]
                ref = a.double() @ b.double().t()
                ok = (r.dtype == torch.float32 and r3.dtype == torch.float32
                      and float((r - ref).abs().max()) < 1e-4 and float((r3 - ref).abs().max()) < 1e-4)
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
        _OUT_DTYPE[key] = ok
    return _OUT_DTYPE[key]


def _mm_fns(out_dtype: bool):
    if out_dtype:
        def mm32(a, w):  # a [M, K] bf16, w [N, K] bf16 -> a @ w.T, fp32 accumulate and output
            return torch.mm(a, w.t(), out_dtype=torch.float32)

        def bmm32(a, b):  # [B, M, K] x [B, K, N] bf16 -> fp32
            return torch.bmm(a, b, out_dtype=torch.float32)
    else:
        def mm32(a, w):
            return a.float() @ w.float().t()

        def bmm32(a, b):
            return torch.bmm(a.float(), b.float())
    return mm32, bmm32


def _rope(x, cos, sin):
    """Interleaved pairs of x [T, H, hd] fp32 rotated by cos/sin [T, hd/2] (reference.rope's math)."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


def _dequant(codes, scales, lut4, lut_sc):
    """NVFP4 [C, N, K/2] kernel-word codes and [C, N, K/16] E4M3 scales -> bf16 [C, N, K], exact
    (e2m1 x e4m3 without the tensor scale)."""
    c, n, kh = codes.shape
    half = codes.view(torch.uint16).reshape(-1).to(torch.int32)
    vals = lut4.index_select(0, half).view(c, n, kh // 8, 16)
    sc = lut_sc.index_select(0, scales.reshape(-1).to(torch.int32)).view(c, n, kh // 8, 1)
    return (vals * sc).view(c, n, 2 * kh)


# ---------------------------------------------------------------------- the three step regions
def make_prologue(cfg: ModelConfig, n_tokens: int, r_global: int, r_sliding: int):
    """tokens, ctx -> embedded rows, RoPE rows and, per layer kind, (read slots, masked-out, write slots)."""
    t, w_, ring = n_tokens, cfg.window, cfg.ring_slots

    def prologue(tokens, ctx_t, depth_t, anc, ar_t, ar_g, ar_s, rope_cos, rope_sin, embed):
        x = embed.index_select(0, tokens).float()
        pos = ctx_t + depth_t
        cos = rope_cos.index_select(0, pos)
        sin = rope_sin.index_select(0, pos)
        new_seq = ctx_t + ar_t
        g_ok = (ar_g < ctx_t).unsqueeze(0).expand(t, r_global)
        g_idx = torch.cat([ar_g, new_seq])
        g_neg = ~torch.cat([g_ok, anc], dim=1)
        s_seq = ctx_t - r_sliding + ar_s
        s_ok = (s_seq >= 0).unsqueeze(0) & (s_seq.unsqueeze(0) >= (pos - (w_ - 1)).unsqueeze(1))
        s_idx = torch.cat([s_seq, new_seq]).remainder(ring)  # negative seqs land on valid slots, masked
        s_neg = ~torch.cat([s_ok, anc], dim=1)
        return x, cos, sin, g_idx, g_neg, new_seq, s_idx, s_neg, new_seq.remainder(ring)

    return prologue


def make_layer(cfg: ModelConfig, n_tokens: int, out_dtype: bool, with_routes: bool = False):
    """One decoder layer: x fp32 [T, d] -> x (and the routes [T, k] when with_routes). Writes the
    T new K/V rows into the cache in place."""
    mm32, bmm32 = _mm_fns(out_dtype)
    hq, hk, hd, grp = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.group
    d, p, f, k, ne = cfg.d_model, cfg.d_pool, cfg.d_expert, cfg.top_k, cfg.n_experts
    eps, scale, t = cfg.rms_eps, cfg.head_dim ** -0.5, n_tokens
    cap = min(ne, n_tokens * k)

    def layer(x, idx, neg, wr, cos, sin, kc, vc, route, lut4, lut_sc, ar_c, ar_tc,
              attn_g, wqkv, wo, ffn_g, router, pool, c1, s1, t1, c2, s2, t2, unpool):
        # ---- attention
        h = F.rms_norm(x, (d,), attn_g, eps).to(BF16)
        qkv = mm32(h, wqkv)
        q = _rope(qkv[:, :hq * hd].reshape(t, hq, hd), cos, sin).to(BF16)
        kn = _rope(qkv[:, hq * hd:(hq + hk) * hd].reshape(t, hk, hd), cos, sin).to(BF16)
        vn = qkv[:, (hq + hk) * hd:].reshape(t, hk, hd).to(BF16)
        kc.index_copy_(1, wr, kn.transpose(0, 1))
        vc.index_copy_(1, wr, vn.transpose(0, 1))
        kk = kc.index_select(1, idx).float()  # [hk, n, hd]: cached rows, then the T new ones
        vv = vc.index_select(1, idx).float()
        qf = q.float().reshape(t, hk, grp, hd).permute(1, 0, 2, 3).reshape(hk, t * grp, hd)  # head = kv*grp + j
        sc = torch.bmm(qf, kk.transpose(1, 2)) * scale
        sc = sc.view(hk, t, grp, -1).masked_fill(neg[None, :, None, :], float("-inf"))
        pr = torch.softmax(sc, dim=-1).view(hk, t * grp, -1)
        o = torch.bmm(pr, vv).view(hk, t, grp, hd).permute(1, 0, 2, 3).reshape(t, hq * hd).to(BF16)
        x = x + mm32(o, wo)
        # ---- MoE
        h2 = F.rms_norm(x, (d,), ffn_g, eps).to(BF16)
        logits = mm32(h2, router)
        sel = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k] if route is None else route
        wts = torch.softmax(logits.gather(1, sel), dim=-1)
        pooled = mm32(h2, pool).to(BF16)
        used = torch.zeros(ne, dtype=torch.int32, device=x.device).scatter_(0, sel.reshape(-1), 1)
        order = torch.sort(1 - used, stable=True).indices  # routed experts first, ascending id
        live = ar_c < used.sum()
        first = order[:cap]
        slot_e = torch.where(live, first, first[0])  # padding slots repeat a routed expert
        slot_of = torch.zeros(ne + 1, dtype=torch.long, device=x.device).scatter_(
            0, torch.where(live, first, ne), ar_c)  # expert -> slot; padding writes the dump entry ne
        w1 = _dequant(c1.index_select(0, slot_e), s1.index_select(0, slot_e), lut4, lut_sc)  # [C, 2f, p]
        gu = bmm32(pooled.unsqueeze(0).expand(cap, t, p), w1.transpose(1, 2)) * t1.index_select(0, slot_e)[:, None, None]
        a = (F.silu(gu[..., :f]) * gu[..., f:]).to(BF16)
        w2 = _dequant(c2.index_select(0, slot_e), s2.index_select(0, slot_e), lut4, lut_sc)  # [C, p, f]
        y = (bmm32(a, w2.transpose(1, 2)) * t2.index_select(0, slot_e)[:, None, None]).to(BF16)  # [C, T, p]
        ysel = y[slot_of[sel], ar_tc]  # [T, k, p]
        z = (wts.unsqueeze(-1) * ysel.float()).sum(1).to(BF16)
        x = x + mm32(z, unpool)
        return (x, sel) if with_routes else x

    return layer


def make_epilogue(cfg: ModelConfig, out_dtype: bool):
    mm32, _ = _mm_fns(out_dtype)
    d, eps = cfg.d_model, cfg.rms_eps

    def epilogue(x, final_g, lm_head):
        return mm32(F.rms_norm(x, (d,), final_g, eps).to(BF16), lm_head)

    return epilogue


# ---------------------------------------------------------------------- weights as parameters
class TorchModel:
    """The model's weights as nn.Parameters (sharing storage with ModelWeights, no copies), fp32
    copies of the norm gains, and the dequantisation tables, on the weights' device."""

    def __init__(self, w: ModelWeights):
        self.w = w
        self.cfg = w.cfg
        dev = w.device

        def P(t):
            return torch.nn.Parameter(t, requires_grad=False)

        self.layers = [tuple(P(t) for t in (
            lw.attn_norm.float(), lw.wqkv, lw.wo, lw.ffn_norm.float(), lw.router, lw.pool,
            lw.w1.codes, lw.w1.scales, lw.w1.tensor_scale, lw.w2.codes, lw.w2.scales, lw.w2.tensor_scale, lw.unpool))
            for lw in w.layers]
        self.embed = P(w.embed)
        self.final_g = P(w.final_norm.float())
        self.lm_head = P(w.lm_head)
        self.rope_cos, self.rope_sin = w.rope_cos, w.rope_sin
        # lut4: the 4 values of every half-word of the kernel-word codes (fp4_layout)
        self.lut4, self.lut_sc = half_word_table(dev, BF16), e4m3_lut(dev)
        self.out_dtype = out_dtype_supported(dev)


def torch_model(w: ModelWeights) -> TorchModel:
    tm = getattr(w, "_torch_baseline", None)
    if tm is None or tm.w is not w:
        tm = TorchModel(w)
        w._torch_baseline = tm  # cached on the weights: one set of wrappers per ModelWeights
    return tm


def expert_slots(cfg: ModelConfig, n_tokens: int) -> int:
    """C: the static size of the padded distinct-expert set."""
    return cfg.max_distinct_experts(n_tokens)


def dequant_bytes_per_step(cfg: ModelConfig, n_tokens: int) -> int:
    """bf16 bytes of dequantised expert weights the baselines materialise per step (written once,
    read once by the GEMMs): C slots x 3 p f values x 2 B x layers."""
    return expert_slots(cfg, n_tokens) * cfg.expert_params * 2 * cfg.n_layers


# ---------------------------------------------------------------------- running a step
class StepRunner:
    """Static input buffers and the step's regions for one tree shape. `set_inputs` (outside any
    graph) copies tokens / ctx / routes into the buffers; `run()` only enqueues device work and
    returns the logits [T, V] fp32 (for compile mode, a CUDA-graph-owned tensor: clone it before the
    next run)."""

    def __init__(self, tm: TorchModel, cache: KVCache, parents: Sequence[int], *, r_global: int, r_sliding: int,
                 routed: bool, mode: str = "eager"):
        cfg = tm.cfg
        if mode not in ("eager", "compile"):
            raise ConfigError(f"StepRunner mode {mode!r}: 'eager' or 'compile' ('graph' captures an eager runner)")
        if cache.cfg != cfg:
            raise ConfigError(f"KV cache is for {cache.cfg.name}, weights for {cfg.name}")
        if not 0 <= r_global <= cfg.max_context or not 0 <= r_sliding <= cfg.window:
            raise ConfigError(f"read sizes r_global={r_global} (0..{cfg.max_context}), r_sliding={r_sliding} "
                              f"(0..{cfg.window}) out of range")
        self.tm, self.cfg, self.cache, self.mode = tm, cfg, cache, mode
        self.parents = treelib.validate(parents)
        t = len(self.parents)
        if not 1 <= t <= cfg.max_tree:
            raise ConfigError(f"{t} tree tokens; {cfg.name} verifies 1..{cfg.max_tree}")
        self.n_tokens, self.r_global, self.r_sliding, self.routed = t, r_global, r_sliding, routed
        dev = tm.w.device
        self.depth = treelib.depths(self.parents)
        self.tokens = torch.zeros(t, dtype=torch.long, device=dev)
        self.ctx_t = torch.zeros((), dtype=torch.long, device=dev)
        self.depth_t = torch.tensor(self.depth, dtype=torch.long, device=dev)
        self.anc = treelib.ancestor_mask(self.parents).to(dev)
        self.ar_t = torch.arange(t, device=dev)
        self.ar_g = torch.arange(r_global, device=dev)
        self.ar_s = torch.arange(r_sliding, device=dev)
        self.ar_c = torch.arange(expert_slots(cfg, t), device=dev)
        self.ar_tc = torch.arange(t, device=dev)[:, None]
        self.routes = ([torch.zeros(t, cfg.top_k, dtype=torch.long, device=dev) for _ in range(cfg.n_layers)]
                       if routed else None)
        self.ctx: int | None = None
        self.route_log: list[torch.Tensor] | None = None  # eager only: set to [] to collect each layer's routes
        prologue = make_prologue(cfg, t, r_global, r_sliding)
        layer = make_layer(cfg, t, tm.out_dtype, with_routes=mode == "eager")
        epilogue = make_epilogue(cfg, tm.out_dtype)
        self.compile_s: float | None = None
        if mode == "compile":
            _prepare_dynamo()
            for buf in (self.tokens, self.ctx_t, self.depth_t, self.anc, self.ar_t, self.ar_g, self.ar_s, self.ar_c,
                        self.ar_tc, tm.rope_cos, tm.rope_sin, tm.lut4, tm.lut_sc, *cache.k, *cache.v,
                        *(self.routes or ())):
                torch._dynamo.mark_static_address(buf, guard=False)  # never copied into graph inputs
            kw = dict(mode="reduce-overhead", dynamic=False, fullgraph=True)
            prologue, layer, epilogue = (torch.compile(fn, **kw) for fn in (prologue, layer, epilogue))
        self._prologue, self._layer, self._epilogue = prologue, layer, epilogue

    def set_inputs(self, tokens, ctx: int, routes: Sequence[torch.Tensor] | None = None) -> None:
        cfg, t = self.cfg, self.n_tokens
        tok = step_tokens(cfg, tokens, t, ctx)
        if ctx + max(self.depth) >= cfg.max_context:
            raise ConfigError(f"position {ctx + max(self.depth)} outside the RoPE table ({cfg.max_context})")
        if ctx > self.r_global:
            raise ConfigError(f"ctx {ctx} exceeds this runner's global read size {self.r_global}")
        if min(ctx, cfg.window - 1) > self.r_sliding:
            raise ConfigError(f"ctx {ctx} needs {min(ctx, cfg.window - 1)} sliding rows; runner reads {self.r_sliding}")
        if (routes is not None) != self.routed:
            raise ConfigError("routes given to a runner built for real routing (or missing for a routed one)")
        self.tokens.copy_(tok)
        self.ctx_t.fill_(int(ctx))
        if routes is not None:
            if len(routes) != cfg.n_layers:
                raise ConfigError(f"routes for {len(routes)} layers, model has {cfg.n_layers}")
            for dst, r in zip(self.routes, routes):
                r = torch.as_tensor(r)
                if tuple(r.shape) != (t, cfg.top_k) or int(r.min()) < 0 or int(r.max()) >= cfg.n_experts:
                    raise ConfigError(f"each route must be [{t}, {cfg.top_k}] expert ids in 0..{cfg.n_experts - 1}")
                dst.copy_(r)
        self.ctx = int(ctx)

    def run(self) -> torch.Tensor:
        if self.ctx is None:
            raise ConfigError("set_inputs() before run()")
        tm, cfg, c = self.tm, self.cfg, self.cache
        if self.mode == "compile":
            torch.compiler.cudagraph_mark_step_begin()
        x, cos, sin, gi, gn, gw, si, sn, sw = self._prologue(
            self.tokens, self.ctx_t, self.depth_t, self.anc, self.ar_t, self.ar_g, self.ar_s, tm.rope_cos,
            tm.rope_sin, tm.embed)
        for l in range(cfg.n_layers):
            idx, neg, wr = (gi, gn, gw) if cfg.is_global(l) else (si, sn, sw)
            x = self._layer(x, idx, neg, wr, cos, sin, c.k[l], c.v[l], self.routes[l] if self.routed else None,
                            tm.lut4, tm.lut_sc, self.ar_c, self.ar_tc, *tm.layers[l])
            if self.mode == "eager":
                x, sel = x
                if self.route_log is not None:
                    self.route_log.append(sel)
        return self._epilogue(x, tm.final_g, tm.lm_head)


def _prepare_dynamo() -> None:
    """Fresh dynamo state per compiled runner (earlier runners' shapes must not count towards the
    recompile limit, past which dynamo would silently run eager) and a roomy limit."""
    import torch._dynamo  # heavy: torch._dynamo (seconds to import; only where something compiled)

    torch._dynamo.reset()
    try:  # newer torch resets cudagraph trees inside dynamo.reset(); older ones need this
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees  # heavy: torch._inductor

        reset_cudagraph_trees()
    except ImportError:
        pass
    counters.clear()  # compile_stats() then describes this runner only
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    if hasattr(cfg, "automatic_dynamic_shapes"):
        cfg.automatic_dynamic_shapes = False


def first_run_s(run, device) -> float:
    """Wall seconds of one call of `run` (a step that compiles on its first call), the device
    synchronised before and after it."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - t0


def compile_stats() -> dict[str, int]:
    """Dynamo/inductor counters that tell whether compile mode really runs compiled CUDA graphs."""
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def step_tokens(cfg, tokens, n_tokens: int, ctx: int) -> torch.Tensor:
    """A step's token ids as a flat long tensor, refused (ConfigError) when their count is not the
    tree's, an id is outside the vocabulary or the step does not fit the model at `ctx`."""
    tok = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if tok.numel() != n_tokens:
        raise ConfigError(f"{tok.numel()} tokens for a {n_tokens}-token tree")
    if int(tok.min()) < 0 or int(tok.max()) >= cfg.vocab:
        raise ConfigError(f"token ids must be in 0..{cfg.vocab - 1}")
    cfg.check_step(ctx, n_tokens)
    return tok


def capture_graph(run, warmup: int = 3):
    """(a CUDA graph of `run()`, what the captured call returned): `warmup` calls on a side stream
    first (allocations, lazy module loads and autotuning stay out of the capture), then the capture.
    The returned tensors are the graph's outputs, rewritten by every replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


class GraphRunner:
    """A CUDA graph of an eager StepRunner's run(): warm-up 3x on a side stream, capture, replay."""

    def __init__(self, runner: StepRunner, warmup: int = 3):
        if runner.mode != "eager":
            raise ConfigError("GraphRunner captures an eager StepRunner")
        if runner.ctx is None:
            raise ConfigError("set_inputs() before capturing")
        self.runner = runner
        self.graph, self.out = capture_graph(runner.run, warmup)

    def run(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def make_runner(kind: str, w: ModelWeights, cache: KVCache, parents: Sequence[int], tokens, ctx: int,
                routes: Sequence[torch.Tensor] | None = None, r_global: int | None = None,
                r_sliding: int | None = None):
    """A ready-to-run baseline: eager / graph / compile. For compile, the first three runs (compile,
    warm-up, CUDA-graph recording) happen here and `compile_s` holds the first run's wall time."""
    if kind not in BASELINES:
        raise ConfigError(f"unknown baseline {kind!r}; have {BASELINES}")
    cfg = w.cfg
    rg = ctx if r_global is None else r_global
    rs = min(ctx, cfg.window) if r_sliding is None else r_sliding
    r = StepRunner(torch_model(w), cache, parents, r_global=rg, r_sliding=rs, routed=routes is not None,
                   mode="compile" if kind == "compile" else "eager")
    r.set_inputs(tokens, ctx, routes)
    if kind == "graph":
        return GraphRunner(r)
    if kind == "compile":
        sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
        r.compile_s = first_run_s(r.run, w.device)
        for _ in range(2):  # warm-up run, then the run that records the CUDA graphs
            r.run()
        sync()
    return r


def eager_step(w: ModelWeights, cache: KVCache, tokens, parents: Sequence[int], ctx: int,
               routes: Sequence[torch.Tensor] | None = None, trace=None, acc: torch.dtype = torch.float32) -> torch.Tensor:
    """reference.step's signature on the eager baseline (a drop-in verifier for speculative.py)."""
    if acc != torch.float32:
        raise ConfigError(f"the torch baseline accumulates in float32 only (asked for {acc})")
    if trace is not None:
        raise ConfigError("the torch baseline records no trace (use reference.step for op-by-op diffs)")
    r = StepRunner(torch_model(w), cache, parents, r_global=ctx, r_sliding=min(ctx, w.cfg.window),
                   routed=routes is not None)
    r.set_inputs(tokens, ctx, routes)
    return r.run()


# ---------------------------------------------------------------------- checking against the reference
@dataclass(frozen=True)
class Agreement:
    max_row_rel: float  # max over rows of rms(a - b) / rms(b)
    max_abs_diff: float
    rel_tol: float
    argmax_agree: float  # fraction of rows whose argmax matches the reference's
    kv_max_rel: float  # max over layers and K/V of ||a - b|| / ||b|| on the T new rows

    def as_metrics(self) -> dict[str, float]:
        return {"ref_max_row_rel": self.max_row_rel, "ref_max_abs_diff": self.max_abs_diff,
                "ref_rel_tol": self.rel_tol, "ref_argmax_agree": self.argmax_agree, "ref_kv_max_rel": self.kv_max_rel}


def compare(logits: torch.Tensor, ref_logits: torch.Tensor, cache: KVCache | None = None,
            ref_cache: KVCache | None = None, ctx: int = 0, n_tokens: int = 0, rel_tol: float = 5e-2,
            what: str = "baseline") -> Agreement:
    """Agreement with the reference to bf16 rounding, else CorrectnessError naming what differs.

    Two fp32 implementations with the same bf16 rounding points differ only where a reduction-
    order difference flips a bf16 rounding (2^-8 relative), and the flips accumulate down the
    layers: measured on the CPU for a 62-layer d=1024 model (reference.step fp32 vs fp64), the
    residual stream drifts ~1e-4 relative per layer (7e-3 after 60), logit rows by 0.7% of their
    rms and new K/V rows by 0.8%. Sensitivity: one expert of one token changed in one of the 62
    layers moved them 1.7% (below this tolerance); positions off by one, routing changed in every
    layer or one wrong new K row fail it (tests/test_model_baselines.py, tests/gpu/test_model_gpu.py).
    Checks: every row's rms(a - b) <= rel_tol x rms(b); the argmax agrees on every row whose
    reference top-2 margin exceeds 4 x rel_tol x rms(b); when caches are given, the T new K and V
    rows of every layer satisfy ||a - b|| <= rel_tol x ||b||."""
    a, b = logits.detach().double().cpu(), ref_logits.detach().double().cpu()
    if a.shape != b.shape:
        raise CorrectnessError(f"{what}: logits shape {tuple(a.shape)} != reference {tuple(b.shape)}")
    if not torch.isfinite(a).all():
        raise CorrectnessError(f"{what}: non-finite logits at {(~torch.isfinite(a)).nonzero()[0].tolist()}")
    rms_b = b.pow(2).mean(-1).sqrt().clamp_min(1e-30)
    row_rel = (a - b).pow(2).mean(-1).sqrt() / rms_b
    max_rel = float(row_rel.max())
    am, bm = a.argmax(-1), b.argmax(-1)
    agree = float((am == bm).double().mean())
    top2 = b.topk(min(2, b.shape[-1]), dim=-1).values
    decisive = (top2[:, 0] - top2[:, -1]) > 4 * rel_tol * rms_b
    kv, kv_where = 0.0, ""
    if cache is not None and ref_cache is not None:
        for l in range(cache.cfg.n_layers):
            slots = cache.slot(l, torch.arange(ctx, ctx + n_tokens, device=cache.k[l].device))
            for name, x, y in (("K", cache.k[l], ref_cache.k[l]), ("V", cache.v[l], ref_cache.v[l])):
                xs, ys = x[:, slots].double(), y[:, slots].double()
                r = float((xs - ys).norm() / ys.norm().clamp_min(1e-30))
                if r > kv:
                    kv, kv_where = r, f"{name} of layer {l}"
    ag = Agreement(max_rel, float((a - b).abs().max()), rel_tol, agree, kv)
    if max_rel > rel_tol:
        worst = int(row_rel.argmax())
        raise CorrectnessError(f"{what}: logits differ from reference.step: row {worst} rms difference is "
                               f"{max_rel:.3g} of the row's rms > {rel_tol:.3g}; argmax agreement {agree:.0%}")
    bad = decisive & (am != bm)
    if bool(bad.any()):
        raise CorrectnessError(f"{what}: argmax differs from reference.step on rows {bad.nonzero()[:, 0].tolist()} "
                               f"whose top-2 margin is decisive")
    if kv > rel_tol:
        raise CorrectnessError(f"{what}: new {kv_where} rows differ from the reference's by {kv:.3g} (relative) "
                               f"> {rel_tol:.3g}")
    return ag


def route_agreement(parents: Sequence[int], routes_a: Sequence[torch.Tensor], routes_b: Sequence[torch.Tensor]) -> torch.Tensor:
    """bool [T]: a token's routes agree in every layer, and so do all its ancestors' (a token
    sees its ancestors' K/V, so a near-tie routing flip upstream legitimately changes it)."""
    p = treelib.validate(parents)
    same = torch.ones(len(p), dtype=torch.bool)
    for a, b in zip(routes_a, routes_b):
        same &= (a.cpu().sort(dim=-1).values == b.cpu().sort(dim=-1).values).all(dim=-1)
    anc = treelib.ancestor_mask(p)
    return (anc & ~same[None, :]).sum(dim=1) == 0
