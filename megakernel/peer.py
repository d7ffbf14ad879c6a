"""The peer baseline: one decode/verify step on Hopper from a serving engine's generic pieces, for
one request (PeerRunner) or B requests a step (BatchPeerRunner). Not what a serving engine runs for NVFP4 experts on Hopper (a Marlin-class MoE kernel:
reports/notes/peer-baseline.md). Built from:
  - experts: a Triton fused-MoE in the style of vLLM's generic Triton fused-MoE kernel
    (peer_kernels.moe_up / moe_down) that touches only the routed experts and dequantises NVFP4
    in registers, after a routing kernel that does top-k and the generic kernel's sort/align of
    token-expert pairs (peer_kernels.route); its block sizes are tuned on the GPU by a small
    sweep (`tune_moe`);
  - dense projections: cuBLAS through torch.mm (bf16 x bf16 -> fp32, the reference's precision);
    the router and the pooler are one GEMM (their weights stacked once, the pooler's rows in the
    experts' plane order);
  - attention over the tree: a Triton flash-decoding kernel (split keys, tree mask, sliding
    windows through the ring, log-sum-exp merge);
  - fused norms: residual add + RMSNorm in one Triton kernel; RoPE fused with the KV write;
  - the whole step captured in ONE CUDA graph (`StepGraph`); positions, the context and the tree
    come from device buffers, so one capture serves any context up to its read bound.

B requests a step (BatchPeerRunner; the contract of reference.step_batch: each request its own
tree, context and KVCache, rows concatenated, any number of rows that fits memory):
  - norms, dense GEMMs (qkv, o-proj, router+pool, unpool, lm_head) and the fused MoE (route,
    moe_up, moe_down, combine): one launch each over all the batch's rows (the experts read are
    the union over the batch: the sorted ids group every request's pairs by expert);
  - RoPE + KV write: one launch per request over its rows (its context, its cache);
  - attention: one launch (partial + combine) per request over its rows (its context, its tree
    mask, its cache), the requests' launches in order on one stream sharing one scratch.
Each request agrees with its B=1 step within the bound, not bitwise: the dense GEMMs run over
another row count. B = 1 is the single-request step.

Two flavours of the small ops: "triton" (the kernels above: the peer) and "torch" (the same
maths as torch expressions, for `compile=True`: torch.compile of the peer's torch parts, mode
"max-autotune-no-cudagraphs", because the step is already one CUDA graph of ours; inductor's
max-autotune has no Triton template for a bf16 x bf16 -> fp32 (out_dtype) GEMM, so the GEMMs stay
cuBLAS and what it fuses and tunes are the norms, RoPE, the KV write and the combine).

Numerics follow reference.py's contract (its rounding points): residual fp32, norm outputs, q/k/v,
pooled, expert activations and outputs, combine and attention outputs bf16, fp32 accumulation
everywhere. Validated with runtime.check_close at the megakernel's bound (plans.REL_TOL).

    m = PeerModel(weights)                       # up_cfg / down_cfg from tune_moe
    r = PeerRunner(m, cache, parents, r_read=ctx, forced=True)
    r.set_inputs(tokens, ctx, routes); logits = r.run()          # un-graphed
    g = StepGraph(r); g.replay()                                  # the timed form
    rb = BatchPeerRunner(m, caches, [q.parents for q in reqs], r_read=[q.ctx for q in reqs], forced=True)
    rb.set_requests(reqs, routes); logits = rb.run()              # [sum T_r, V]; check_batch_step
"""
from __future__ import annotations

import contextlib
import types
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from microbench.errors import CorrectnessError

from . import tree as treelib
from .baselines import _prepare_dynamo, capture_graph, first_run_s, out_dtype_supported, route_agreement, step_tokens
from .config import ConfigError, ModelConfig
from .reference import KVCache, Request
from .roofline import kv_row_bytes, kv_rows_read
from .runtime import check_close
from .weights import BF16, ModelWeights


def available() -> str | None:
    """None when the peer can run here, else why not (no triton, no GPU)."""
    try:
        import triton  # noqa: F401; heavy: triton
    except ImportError as e:
        return f"triton is not installed ({e})"
    if not torch.cuda.is_available():
        return "no CUDA GPU (the peer's kernels run on the CPU only through Triton's interpreter, in tests)"
    return None


def _kernels():
    from . import peer_kernels  # heavy: triton (megakernel.peer_kernels)

    return peer_kernels


def _opaque_kernels():
    """The Triton launchers as dynamo graph breaks (torch.compiler.disable), for the compiled
    flavour: torch.compile compiles the torch parts between them and the tuned kernels launch as
    they are. Traced into, inductor re-compiled the user kernels under its own settings, and the
    attention kernel's failed to compile there."""
    K = _kernels()
    names = ("attention", "route", "moe_up", "moe_down", "add_rmsnorm", "rope_kv", "moe_combine")
    return types.SimpleNamespace(**{n: torch.compiler.disable(getattr(K, n)) for n in names if hasattr(K, n)},
                                 BLOCK_M=K.BLOCK_M)


@torch.library.custom_op("megabench::peer_mm32", mutates_args=())
def _peer_mm32(a: torch.Tensor, w: torch.Tensor, out_dtype: bool) -> torch.Tensor:
    """a [M, K] bf16 @ w [N, K].T -> fp32: cuBLAS with out_dtype, or fp32 maths where torch has
    no out_dtype mm (the CPU)."""
    if out_dtype:
        return torch.mm(a, w.t(), out_dtype=torch.float32)
    return a.float() @ w.float().t()


@_peer_mm32.register_fake
def _(a, w, out_dtype):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=torch.float32)


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the peer cannot run `cfg` (None: it can). Its expert kernels split a K step into 8
    planes of at least 16 words (a tensor-core k step), so both expert GEMMs need K % 128 == 0."""
    if cfg.d_pool % 128 or cfg.d_expert % 128:
        return (f"{cfg.name}: the peer's fused MoE needs d_pool and d_expert multiples of 128 (have {cfg.d_pool}, "
                f"{cfg.d_expert})")
    return None


def default_moe_configs():
    """(up, down) before any tuning: 64 rows, 128-wide K steps, 4 warps, 3 stages (no spill at
    sm_90a: peer_kernels.compile_sm90)."""
    K = _kernels()
    return K.MoeConfig(64, 128, 4, 3), K.MoeConfig(64, 128, 4, 3)


# the sweep tune_moe runs on the GPU (both kernels): rows per program x K step x warps x stages
SWEEP = ((64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3))


# ---------------------------------------------------------------------- the model's prepared weights
class PeerModel:
    """References to the model's weights (no copies of the experts or dense projections) plus
    the stacked router+pooler weight [E + p, d] (pooler rows in plane order) per layer."""

    def __init__(self, w: ModelWeights, up_cfg=None, down_cfg=None):
        K = _kernels()
        self.w, self.cfg = w, w.cfg
        cfg = w.cfg
        why = unsupported(cfg)
        if why:
            raise ConfigError(why)
        idx = K.plane_index(cfg.d_pool, device=w.device)
        self.rp = [torch.cat([lw.router, lw.pool.index_select(0, idx)]).contiguous() for lw in w.layers]
        d_up, d_down = default_moe_configs()
        self.up_cfg = (up_cfg or d_up).validate(cfg.d_expert, cfg.d_pool)
        self.down_cfg = (down_cfg or d_down).validate(cfg.d_pool, cfg.d_expert)
        self.out_dtype = out_dtype_supported(w.device)

    def mm32(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a [M, K] bf16 @ w [N, K].T with fp32 accumulation and output (cuBLAS on the GPU).

        Under torch.compile the GEMM is an opaque custom op (`megabench::peer_mm32`, no graph
        break): max-autotune turns on inductor's coordinate-descent tuning, whose decomposition of
        an M = 1 mm into a multiply and a sum drops out_dtype. At T = 1 the router's logits would come
        back bf16, and the routing kernel fails to compile on them."""
        if torch.compiler.is_compiling():
            return _peer_mm32(a, w, bool(self.out_dtype))
        if self.out_dtype:
            return torch.mm(a, w.t(), out_dtype=torch.float32)
        return a.float() @ w.float().t()

    @property
    def extra_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rp)


# ---------------------------------------------------------------------- per-op labels
OPS = ("attn_norm", "qkv", "rope_kv", "attn", "oproj", "ffn_norm", "router_pool", "route", "moe_up", "moe_down",
       "moe_combine", "unpool", "final_norm", "lm_head", "argmax")


def op_bytes(cfg: ModelConfig, n_tokens: int, ctx: int, distinct: Sequence[int]) -> dict[str, int]:
    """Bytes each op of the peer's step must move (summed over layers): the weights it reads
    (routed experts only), the KV rows it reads / writes, and its activations in and out. The
    per-op floor for the per-kernel roofline fractions."""
    t, d, p, f, e, k = n_tokens, cfg.d_model, cfg.d_pool, cfg.d_expert, cfg.n_experts, cfg.top_k
    L, row = cfg.n_layers, kv_row_bytes(cfg)
    fp4 = lambda n, kk: n * kk // 2 + n * kk // 16  # noqa: E731  codes + E4M3 scales
    x = t * d * 4
    kv_read = sum(kv_rows_read(cfg, l, t, ctx) for l in range(L)) * row
    return {
        "attn_norm": L * (3 * x + 2 * d + t * d * 2) - x,  # layer 0 reads embedding rows instead of x + delta
        "qkv": L * (cfg.qkv_rows * d * 2 + t * d * 2 + t * cfg.qkv_rows * 4),
        "rope_kv": L * (t * cfg.qkv_rows * 4 + t * cfg.attn_width * 2 + t * row),
        "attn": kv_read + L * 2 * t * cfg.attn_width * 2,
        "oproj": L * (d * cfg.attn_width * 2 + t * cfg.attn_width * 2 + t * d * 4),
        "ffn_norm": L * (3 * x + 2 * d + t * d * 2),
        "router_pool": L * ((e + p) * d * 2 + t * d * 2 + t * (e + p) * 4),
        "route": L * (t * e * 4 + t * k * 8),
        "moe_up": sum(distinct) * (fp4(2 * f, p) + 4) + L * (t * p * 4 + t * k * f * 2),
        "moe_down": sum(distinct) * (fp4(p, f) + 4) + L * (t * k * f * 2 + t * k * p * 2),
        "moe_combine": L * (t * k * p * 2 + t * p * 2),
        "unpool": L * (d * p * 2 + t * p * 2 + t * d * 4),
        "final_norm": 3 * x + 2 * d + t * d * 2,
        "lm_head": cfg.vocab * d * 2 + t * d * 2 + t * cfg.vocab * 4,
        "argmax": t * cfg.vocab * 4,
    }


# ---------------------------------------------------------------------- the torch flavour of the small ops
def _torch_norm(x, delta, g, eps):
    if delta is not None:
        x.add_(delta)
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * r * g.float()).to(BF16)


def _torch_rope_kv(qkv, cos_t, sin_t, pos, slots, kc, vc, hq, hk, hd):
    t = qkv.shape[0]
    c, s = cos_t.index_select(0, pos)[:, None, :], sin_t.index_select(0, pos)[:, None, :]

    def rot(v):
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)

    q = rot(qkv[:, :hq * hd].reshape(t, hq, hd)).to(BF16)
    k = rot(qkv[:, hq * hd:(hq + hk) * hd].reshape(t, hk, hd)).to(BF16)
    v = qkv[:, (hq + hk) * hd:].reshape(t, hk, hd).to(BF16)
    kc.index_copy_(1, slots, k.transpose(0, 1))
    vc.index_copy_(1, slots, v.transpose(0, 1))
    return q


def _torch_combine(y, w, t, k):
    return (w.view(t, k, 1) * y.view(t, k, -1).float()).sum(1).to(BF16)


# ---------------------------------------------------------------------- one step
@dataclass(eq=False)
class PeerRequest:
    """One request of a runner's step: its cache, its tree, its read bound, its rows of the step
    (rows: a slice of every [rows, ...] buffer) and its device views (ctx_t [1], depth_t / anc_t
    [T_r] int32: slices of the runner's buffers), and its attention's split configs."""
    cache: KVCache
    parents: list[int]
    r_read: int
    rows: slice
    ctx_t: torch.Tensor
    depth_t: torch.Tensor
    anc_t: torch.Tensor
    ar_t: torch.Tensor
    attn_cfg: dict

    @property
    def n_tokens(self) -> int:
        return len(self.parents)


class PeerRunner:
    """Static buffers and the step for one tree shape and read bound. set_inputs() (outside any
    graph) fills the inputs; run() only enqueues device work and returns the logits [T, V] fp32
    (inside a captured graph: the graph's output tensor). forced: routes come from set_inputs
    (the timed points' synthetic routing) instead of top-k; routes[l] after a step holds the
    routing each layer used. BatchPeerRunner: the same step over B requests."""

    def __init__(self, model: PeerModel, cache: KVCache, parents: Sequence[int], *, r_read: int, forced: bool,
                 small_ops: str = "triton", compile: bool = False, n_sm: int = 132):
        self._setup(model, [cache], [parents], [r_read], forced, small_ops, compile, n_sm)
        rq = self.requests[0]
        self.cache, self.parents, self.r_read = rq.cache, rq.parents, rq.r_read

    def _setup(self, model: PeerModel, caches: Sequence[KVCache], trees: Sequence[Sequence[int]],
               r_reads: Sequence[int], forced: bool, small_ops: str, compile: bool, n_sm: int) -> None:
        K = _kernels()
        cfg = model.cfg
        if not len(caches) == len(trees) == len(r_reads) >= 1:
            raise ConfigError(f"{len(caches)} caches, {len(trees)} trees and {len(r_reads)} read bounds: want one of "
                              "each per request, at least one request")
        for i, cache in enumerate(caches):
            if not isinstance(cache, KVCache):
                raise ConfigError(f"request {i}: cache must be a reference.KVCache, got {type(cache).__name__}")
            if cache.cfg != cfg:
                raise ConfigError(f"KV cache is for {cache.cfg.name}, weights for {cfg.name}"
                                  + (f" (request {i})" if len(caches) > 1 else ""))
            if any(cache is c for c in caches[:i]):  # two requests writing one cache: each step's rows collide
                raise ConfigError(f"requests {next(j for j in range(i) if caches[j] is cache)} and {i} share one KV "
                                  "cache: each request needs its own")
        if small_ops not in ("triton", "torch"):
            raise ConfigError(f"small_ops {small_ops!r}: 'triton' or 'torch'")
        if compile and small_ops != "torch":
            raise ConfigError("compile=True compiles the torch flavour (small_ops='torch')")
        who = (lambda i: f"request {i}: ") if len(caches) > 1 else (lambda i: "")  # noqa: E731
        trees = [treelib.validate(p) for p in trees]
        for i, (pa, rr) in enumerate(zip(trees, r_reads)):
            t = len(pa)
            if not 1 <= t <= cfg.max_tree:
                raise ConfigError(f"{who(i)}{t} tree tokens; {cfg.name} verifies 1..{cfg.max_tree}")
            if not isinstance(rr, (int, np.integer)) or not 0 <= rr <= cfg.max_context - t:
                raise ConfigError(f"{who(i)}read bound {rr} outside 0..{cfg.max_context - t}")
        t = sum(len(pa) for pa in trees)  # the step's rows: the requests' trees concatenated
        self.model, self.cfg, self.n_tokens = model, cfg, t
        self.forced, self.small_ops, self.compiled = forced, small_ops, compile
        self._K = _opaque_kernels() if compile else _kernels()  # the layer's launchers (see _opaque_kernels)
        dev = model.w.device
        self.device = dev
        i32 = dict(dtype=torch.int32, device=dev)
        depth, anc_bits = [], []
        for pa in trees:
            anc = treelib.ancestor_mask(pa)
            depth += treelib.depths(pa)
            anc_bits += [sum(1 << j for j in range(len(pa)) if anc[i, j]) for i in range(len(pa))]
        self.depth = depth
        self.tokens_t = torch.zeros(t, dtype=torch.long, device=dev)
        self.ctx_t = torch.zeros(len(trees), **i32)  # request r's context at [r]
        self.depth_t = torch.tensor(depth, **i32)
        self.anc_t = torch.tensor(anc_bits, **i32)  # bit j: the request's own tree token j (its rows' ancestors)
        self.routes_in = torch.zeros(cfg.n_layers, t, cfg.top_k, **i32)
        self.routes = torch.zeros(cfg.n_layers, t, cfg.top_k, **i32)  # what each layer used
        self.route_w = torch.zeros(cfg.n_layers, t, cfg.top_k, dtype=torch.float32, device=dev)
        n_pairs = t * cfg.top_k
        self.n_pairs = n_pairs
        mb = K.max_blocks(n_pairs, cfg.n_experts, K.BLOCK_M, t)
        self.sorted_ids = torch.zeros(mb * K.BLOCK_M, **i32)
        self.block_expert = torch.zeros(mb, **i32)
        self.n_blocks = torch.zeros(1, **i32)
        f32 = dict(dtype=torch.float32, device=dev)
        self.x = torch.zeros(t, cfg.d_model, **f32)
        self.h = torch.zeros(t, cfg.d_model, dtype=BF16, device=dev)
        self.q = torch.zeros(t, cfg.n_heads, cfg.head_dim, dtype=BF16, device=dev)
        self.att = torch.zeros(t, cfg.attn_width, dtype=BF16, device=dev)
        self.act = torch.zeros(n_pairs, cfg.d_expert, dtype=BF16, device=dev)
        self.y = torch.zeros(n_pairs, cfg.d_pool, dtype=BF16, device=dev)
        self.z = torch.zeros(t, cfg.d_pool, dtype=BF16, device=dev)
        self.requests: list[PeerRequest] = []
        row = 0
        for i, (cache, pa, rr) in enumerate(zip(caches, trees, r_reads)):
            tr, rows = len(pa), slice(row, row + len(pa))
            attn_cfg = {g: K.attn_config(self._n_read(g, int(rr), tr), tr * cfg.group, cfg.n_kv_heads, n_sm)
                        for g in (True, False)}
            self.requests.append(PeerRequest(cache, pa, int(rr), rows, self.ctx_t[i:i + 1], self.depth_t[rows],
                                             self.anc_t[rows], torch.arange(tr, device=dev), attn_cfg))
            row += tr
        # the attention scratch: one request's launch at a time (the launches of one stream run in order)
        part = max(c.n_splits * (-(-(rq.n_tokens * cfg.group) // c.block_q)) * c.block_q
                   for rq in self.requests for c in rq.attn_cfg.values())
        self.attn_cfg = self.requests[0].attn_cfg
        self.o_part = torch.zeros(cfg.n_kv_heads * part * cfg.head_dim, **f32)
        self.ml_part = torch.zeros(cfg.n_kv_heads * part * 2, **f32)
        self.ctxs: list[int] | None = None
        self.profiling: str | None = None  # kernel_times: "cupti" (profiler ranges) | "cuda_event" (events per op)
        self.op_events: list = []
        self.keep_rpo: dict | None = None  # set to {} to keep each layer's router/pool output (tune_moe)
        self._layer = self._layer_eager
        self.compile_s: float | None = None
        if compile:
            self._compile()

    @property
    def n_requests(self) -> int:
        return len(self.requests)

    @property
    def ctx(self):
        """The context set_inputs gave (None before): an int for one request, a tuple for a batch."""
        if self.ctxs is None:
            return None
        return self.ctxs[0] if self.n_requests == 1 else tuple(self.ctxs)

    def _n_read(self, is_global: bool, r_read: int, n_tokens: int) -> int:
        c = self.cfg
        return min(c.max_context, r_read + n_tokens) if is_global else min(c.ring_slots, r_read + n_tokens)

    def n_read(self, is_global: bool) -> int:
        """Key slots a layer of this kind may read at most (the grid covers them; programs past
        the step's live rows exit at once); for a batch, the most over its requests."""
        return max(self._n_read(is_global, rq.r_read, rq.n_tokens) for rq in self.requests)

    # ------------------------------------------------------------------ inputs
    def set_inputs(self, tokens, ctx: int, routes: Sequence[torch.Tensor] | None = None) -> None:
        if self.n_requests != 1:
            raise ConfigError(f"a batch of {self.n_requests} requests: BatchPeerRunner.set_inputs takes a token list "
                              "and a context per request")
        self._set_inputs([tokens], [ctx], routes)

    def _set_inputs(self, tokens: Sequence, ctxs: Sequence[int], routes: Sequence[torch.Tensor] | None) -> None:
        """Every check before anything is written: a refused call leaves the runner's inputs as they were."""
        cfg, t, n = self.cfg, self.n_tokens, self.n_requests
        if len(tokens) != n or len(ctxs) != n:
            raise ConfigError(f"{len(tokens)} token lists and {len(ctxs)} contexts for {n} requests")
        who = (lambda i: f"request {i}: ") if n > 1 else (lambda i: "")  # noqa: E731
        toks = []
        for i, (rq, tk, ctx) in enumerate(zip(self.requests, tokens, ctxs)):
            if not isinstance(ctx, (int, np.integer)) or isinstance(ctx, bool):
                raise ConfigError(f"{who(i)}ctx {ctx!r} is not an integer")
            try:
                toks.append(step_tokens(cfg, tk, rq.n_tokens, ctx))
            except ConfigError as e:
                raise ConfigError(f"{who(i)}{e}") from None
            if ctx > rq.r_read:
                raise ConfigError(f"{who(i)}ctx {ctx} exceeds this runner's read bound {rq.r_read}")
            top = ctx + max(self.depth[rq.rows])
            if top >= cfg.max_context:
                raise ConfigError(f"{who(i)}position {top} outside the RoPE table ({cfg.max_context})")
        if (routes is not None) != self.forced:
            raise ConfigError("routes given to a runner with real routing, or missing for a forced one")
        if routes is not None:
            if len(routes) != cfg.n_layers:
                raise ConfigError(f"routes for {len(routes)} layers, model has {cfg.n_layers}")
            r = torch.stack([torch.as_tensor(x).to(torch.int64).cpu() for x in routes])
            if tuple(r.shape) != (cfg.n_layers, t, cfg.top_k) or int(r.min()) < 0 or int(r.max()) >= cfg.n_experts:
                raise ConfigError(f"each route must be [{t}, {cfg.top_k}] expert ids in 0..{cfg.n_experts - 1}"
                                  + (f" (the batch's {t} rows)" if n > 1 else ""))
            if any(len(set(row.tolist())) != cfg.top_k for row in r.reshape(-1, cfg.top_k)):
                raise ConfigError("a token is routed to the same expert twice")
            self.routes_in.copy_(r.to(torch.int32))
        self.tokens_t.copy_(torch.cat(toks))
        self.ctx_t.copy_(torch.tensor([int(c) for c in ctxs], dtype=torch.int32))
        self.ctxs = [int(c) for c in ctxs]

    # ------------------------------------------------------------------ the step
    def _op(self, name: str):
        if self.profiling == "cupti":
            return torch.profiler.record_function(f"peer.{name}")
        if self.profiling == "cuda_event":
            return self._event_range(name)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _event_range(self, name: str):
        a = torch.cuda.Event(enable_timing=True)
        a.record()
        yield
        b = torch.cuda.Event(enable_timing=True)
        b.record()
        self.op_events.append((name, a, b))

    def run(self) -> torch.Tensor:
        if self.ctx is None:
            raise ConfigError("set_inputs() before run()")
        K, cfg, m, w = _kernels(), self.cfg, self.model, self.model.w
        delta = None
        if self.small_ops == "torch":  # the embedding outside the layer: one compiled layer per layer kind
            with self._op("attn_norm"):
                self.x.copy_(w.embed.index_select(0, self.tokens_t).float())
                delta = torch.zeros_like(self.x)
        for l, lw in enumerate(w.layers):
            rpo, delta = self._layer(cfg.is_global(l), l == 0 and self.small_ops == "triton", delta, lw.attn_norm, lw.wqkv, lw.wo, lw.ffn_norm, m.rp[l],
                                     lw.w1.codes, lw.w1.scales, lw.w1.tensor_scale, lw.w2.codes, lw.w2.scales,
                                     lw.w2.tensor_scale, lw.unpool, tuple(rq.cache.k[l] for rq in self.requests),
                                     tuple(rq.cache.v[l] for rq in self.requests), self.routes[l],
                                     self.route_w[l], self.routes_in[l])
            if self.keep_rpo is not None:
                self.keep_rpo[l] = rpo
        with self._op("final_norm"):
            if self.small_ops == "triton":
                K.add_rmsnorm(self.x, w.final_norm, self.h, cfg.rms_eps, delta=delta)
                h = self.h
            else:
                h = _torch_norm(self.x, delta, w.final_norm, cfg.rms_eps)
        with self._op("lm_head"):
            logits = m.mm32(h, w.lm_head)
        with self._op("argmax"):
            self.out_tokens = torch.argmax(logits, dim=-1)
        return logits

    def _layer_eager(self, glob: bool, first: bool, delta, attn_norm, wqkv, wo, ffn_norm, rp, w1c, w1s, w1t, w2c, w2s,
                     w2t, unpool, kcs, vcs, routes, route_w, routes_in):
        """One decoder layer (weights and caches as arguments, so torch.compile compiles it once per
        layer kind; `first` matters to the Triton flavour only, whose first norm also gathers the
        embedding). kcs / vcs: the layer's K / V cache of each request. The norms, GEMMs and the
        fused MoE run once over all the step's rows; RoPE + the KV write and attention once per
        request over its rows (request r's rows read and write only caches r). Returns (the
        router/pool GEMM's output, the unpooler's fp32 output)."""
        K, cfg, m = self._K, self.cfg, self.model
        tri = self.small_ops == "triton"
        with self._op("attn_norm"):
            if tri:
                if first:
                    K.add_rmsnorm(self.x, attn_norm, self.h, cfg.rms_eps, tokens=self.tokens_t, embed=m.w.embed)
                else:
                    K.add_rmsnorm(self.x, attn_norm, self.h, cfg.rms_eps, delta=delta)
                h = self.h
            else:  # the embedding is in x already (run), delta zeros for the first layer
                h = _torch_norm(self.x, delta, attn_norm, cfg.rms_eps)
        with self._op("qkv"):
            qkv = m.mm32(h, wqkv)
        with self._op("rope_kv"):  # one launch per request: its rows, its context, its cache
            if tri:
                for rq, kc, vc in zip(self.requests, kcs, vcs):
                    K.rope_kv(qkv[rq.rows], m.w.rope_cos, m.w.rope_sin, rq.ctx_t, rq.depth_t, self.q[rq.rows], kc, vc,
                              n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim, is_global=glob,
                              ring=cfg.ring_slots)
                q = self.q
            else:
                qs = []
                for rq, kc, vc in zip(self.requests, kcs, vcs):
                    pos = (rq.ctx_t + rq.depth_t).long()
                    seq = rq.ctx_t.long() + rq.ar_t
                    slots = seq if glob else seq.remainder(cfg.ring_slots)
                    qs.append(_torch_rope_kv(qkv[rq.rows], m.w.rope_cos, m.w.rope_sin, pos, slots, kc, vc,
                                             cfg.n_heads, cfg.n_kv_heads, cfg.head_dim))
                q = qs[0] if len(qs) == 1 else torch.cat(qs)
        with self._op("attn"):  # one launch (partial + combine) per request, its own tree mask and context
            for rq, kc, vc in zip(self.requests, kcs, vcs):
                K.attention(q[rq.rows], kc, vc, rq.ctx_t, rq.depth_t, rq.anc_t, self.att[rq.rows], self.o_part,
                            self.ml_part, rq.attn_cfg[glob], n_tokens=rq.n_tokens, group=cfg.group,
                            head_dim=cfg.head_dim, is_global=glob, ring=cfg.ring_slots, window=cfg.window)
        with self._op("oproj"):
            o = m.mm32(self.att, wo)
        with self._op("ffn_norm"):
            if tri:
                K.add_rmsnorm(self.x, ffn_norm, self.h, cfg.rms_eps, delta=o)
                h2 = self.h
            else:
                h2 = _torch_norm(self.x, o, ffn_norm, cfg.rms_eps)
        with self._op("router_pool"):
            rpo = m.mm32(h2, rp)  # [T, E + p]: router logits, then pooled (plane order)
        ld = cfg.n_experts + cfg.d_pool
        with self._op("route"):
            K.route(rpo, ld, self.n_tokens, cfg.n_experts, cfg.top_k, routes, route_w, self.sorted_ids,
                    self.block_expert, self.n_blocks, block_m=K.BLOCK_M, max_per_expert=self.n_tokens,
                    forced=routes_in if self.forced else None)
        with self._op("moe_up"):
            K.moe_up(rpo, ld, cfg.n_experts, True, self.sorted_ids, self.block_expert, self.n_blocks, w1c, w1s, w1t,
                     self.act, self.n_pairs, cfg.top_k, m.up_cfg)
        with self._op("moe_down"):
            K.moe_down(self.act, self.sorted_ids, self.block_expert, self.n_blocks, w2c, w2s, w2t, self.y,
                       self.n_pairs, m.down_cfg)
        with self._op("moe_combine"):
            if tri:
                K.moe_combine(self.y, route_w, self.z, cfg.top_k)
                z = self.z
            else:
                z = _torch_combine(self.y, route_w, self.n_tokens, cfg.top_k)
        with self._op("unpool"):
            return rpo, m.mm32(z, unpool)

    def _compile(self) -> None:
        """torch.compile the layer (the torch flavour's norms, RoPE, KV write and combine around
        the Triton kernels and cuBLAS GEMMs), max-autotune without its own CUDA graphs: the step
        is captured whole by StepGraph."""
        _prepare_dynamo()
        self._layer = torch.compile(self._layer_eager, mode="max-autotune-no-cudagraphs", dynamic=False)

    def compile_now(self) -> float:
        """Run (and so compile) one step; returns its wall time (compile included)."""
        self.compile_s = first_run_s(self.run, self.device)
        return self.compile_s


class BatchPeerRunner(PeerRunner):
    """The peer's step over B requests (the contract of reference.step_batch): request r has its
    own tree (parents[r], T_r tokens), its own context and read bound and its own KVCache; the
    step's rows are the requests' trees concatenated (rows = sum T_r, no tile limit: whatever fits
    memory). The norms, the dense GEMMs (qkv, o-proj, router+pool, unpool, lm_head) and the fused
    MoE (route, moe_up, moe_down, combine) run once over all rows, so the experts read are the
    union over the batch; RoPE + the KV write and attention: one launch per request over its rows.

        r = BatchPeerRunner(m, caches, [q.parents for q in reqs], r_read=[q.ctx for q in reqs], forced=True)
        r.set_requests(reqs, routes)       # routes: per layer [rows, top_k]; logits = r.run()  [rows, V]
    """

    def __init__(self, model: PeerModel, caches: Sequence[KVCache], parents: Sequence[Sequence[int]], *,
                 r_read, forced: bool, small_ops: str = "triton", compile: bool = False, n_sm: int = 132):
        caches, parents = list(caches), list(parents)
        if parents and not all(isinstance(p, Sequence) and not isinstance(p, (str, bytes)) for p in parents):
            raise ConfigError("parents: one parent list per request (a list of lists)")
        r_reads = [r_read] * len(parents) if isinstance(r_read, (int, np.integer)) else list(r_read)
        self._setup(model, caches, parents, r_reads, forced, small_ops, compile, n_sm)
        self.caches = [rq.cache for rq in self.requests]
        self.row0 = [rq.rows.start for rq in self.requests] + [self.n_tokens]

    def set_inputs(self, tokens: Sequence, ctxs: Sequence[int], routes: Sequence[torch.Tensor] | None = None) -> None:
        """tokens[r]: request r's T_r token ids; ctxs[r]: its context; routes (forced runners):
        per layer [rows, top_k] over the batch's rows in request order."""
        self._set_inputs(list(tokens), list(ctxs), routes)

    def set_requests(self, requests: Sequence[Request], routes: Sequence[torch.Tensor] | None = None) -> None:
        """set_inputs from reference.Request objects, whose trees must be this runner's."""
        requests = list(requests)
        if len(requests) != self.n_requests:
            raise ConfigError(f"{len(requests)} requests for a runner of {self.n_requests}")
        for i, (q, rq) in enumerate(zip(requests, self.requests)):
            if list(q.parents) != rq.parents:
                raise ConfigError(f"request {i}: its tree is not the one this runner was built for")
        self._set_inputs([q.tokens for q in requests], [int(q.ctx) for q in requests], routes)

    def request_logits(self, logits: torch.Tensor, r: int) -> torch.Tensor:
        return logits[self.requests[r].rows]


class StepGraph:
    """One CUDA graph of a runner's whole step (warm-up x3 on a side stream, capture, replay)."""

    def __init__(self, runner: PeerRunner, warmup: int = 3):
        if runner.ctx is None:
            raise ConfigError("set_inputs() before capturing")

        self.runner = runner
        self.graph, self.logits = capture_graph(runner.run, warmup)
        self.tokens = runner.out_tokens

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


# ---------------------------------------------------------------------- checks
@dataclass(frozen=True)
class PeerCheck:
    what: str
    rel_err: float  # logits vs the reference
    kv_rel_err: float  # worst layer's K or V cache vs the reference's
    routes_equal: bool  # the step's routing equals the reference's (real routing; True when forced)

    def describe(self) -> str:
        return (f"{self.what}: logits rel err {self.rel_err:.2e}, KV caches rel err <= {self.kv_rel_err:.2e}"
                + ("" if self.routes_equal else " (routing differs from the reference's: see the note)"))


def _check_request(what: str, parents, got_routes, logits, cache: KVCache, ref_logits, ref_cache: KVCache, rel: float,
                   ref_routes) -> PeerCheck:
    """One request's check (check_step's docstring); got_routes / ref_routes: per layer [T, k]
    of this request's rows (ref_routes None: forced routing, nothing to compare)."""
    n_layers = len(got_routes)
    same = True
    first_diff = n_layers
    if ref_routes is not None:
        got = [g.long().cpu() for g in got_routes]
        for l, (a, b) in enumerate(zip(got, ref_routes)):
            if not torch.equal(a.sort(dim=-1).values, b.long().cpu().sort(dim=-1).values):
                same, first_diff = False, l
                break
    rows = slice(None)
    if not same:
        agree = route_agreement(parents, got, [r.cpu() for r in ref_routes])
        if not bool(agree.any()):
            raise CorrectnessError(f"{what}: real routing differs from the reference's at layer {first_diff} for "
                                   "every token: nothing left to compare")
        rows = agree.nonzero()[:, 0]
    err = check_close(logits[rows], ref_logits[rows], f"{what}: peer vs reference (logits)", rel=rel)
    kv = 0.0
    for l in range(first_diff):
        for name, a, b in (("K", cache.k[l], ref_cache.k[l]), ("V", cache.v[l], ref_cache.v[l])):
            kv = max(kv, check_close(a, b, f"{what}: peer vs reference ({name} cache of layer {l})", rel=rel))
    return PeerCheck(what, err, kv, same)


def check_step(runner: PeerRunner, logits: torch.Tensor, cache: KVCache, ref_logits: torch.Tensor,
               ref_cache: KVCache, what: str, rel: float, ref_routes: Sequence[torch.Tensor] | None = None) -> PeerCheck:
    """The megakernel's bound (runtime.check_close) on the logits and on every layer's K and V
    cache. With real routing (ref_routes: the reference's own top-k per layer), a routing that
    differs from the reference's (a near tie flipped by rounding) limits the check to what the
    difference cannot reach: the layers before the first differing one (KV) and the tokens whose
    routes, and their ancestors', agree everywhere (logits); CorrectnessError if none is left.
    One request; check_batch_step for a BatchPeerRunner."""
    if runner.n_requests != 1:
        raise ConfigError(f"check_step checks one request; this runner has {runner.n_requests}: check_batch_step")
    return _check_request(what, runner.requests[0].parents, [runner.routes[l] for l in range(runner.cfg.n_layers)],
                          logits, cache, ref_logits, ref_cache, rel, ref_routes)


def check_batch_step(runner: PeerRunner, logits: torch.Tensor, caches: Sequence[KVCache], ref_logits: torch.Tensor,
                     ref_caches: Sequence[KVCache], what: str, rel: float,
                     ref_routes: Sequence[torch.Tensor] | None = None) -> list[PeerCheck]:
    """check_step per request of a batched step: request r's rows of the logits against the
    reference's (reference.step_batch: [rows, V] in request order), its cache caches[r] against
    ref_caches[r], each layer, and with real routing (ref_routes: per layer [rows, k]) the near-tie
    rule on its own rows and tree. Raises on the first request that fails, naming it."""
    n = runner.n_requests
    if len(caches) != n or len(ref_caches) != n:
        raise ConfigError(f"{len(caches)} caches and {len(ref_caches)} reference caches for {n} requests")
    if logits.shape[0] != runner.n_tokens or ref_logits.shape[0] != runner.n_tokens:
        raise ConfigError(f"logits of {logits.shape[0]} rows, reference's {ref_logits.shape[0]}: the step has "
                          f"{runner.n_tokens}")
    out = []
    for r, rq in enumerate(runner.requests):
        rows = rq.rows
        out.append(_check_request(
            f"{what} request {r}", rq.parents, [runner.routes[l][rows] for l in range(runner.cfg.n_layers)],
            logits[rows], caches[r], ref_logits[rows], ref_caches[r], rel,
            None if ref_routes is None else [x[rows] for x in ref_routes]))
    return out


def route_tie_gap(ref_router_logits: torch.Tensor, routes: torch.Tensor) -> float:
    """How far `routes` (a layer's [T, k] choice) is from a top-k of the reference's router logits
    [T, E], as a share of each row's logit spread (max - min): 0 when every choice is a top-k, small
    when it swapped near-tied experts (a rounding flip), large when it chose experts the reference
    ranks well below its k-th. The worst row's value."""
    lg = ref_router_logits.float().cpu()
    sel = routes.long().cpu()
    k = sel.shape[1]
    kth = lg.topk(k, dim=-1).values[:, -1]
    chosen_min = lg.gather(1, sel).min(dim=-1).values
    spread = (lg.max(dim=-1).values - lg.min(dim=-1).values).clamp_min(1e-30)
    return float(((kth - chosen_min).clamp_min(0) / spread).max())


TIE_GAP = 0.02  # a routing flip counts as a near tie when the swapped experts lie within 2% of the row's spread


def greedy(model: PeerModel, prompt: Sequence[int], steps: int, small_ops: str = "triton") -> list[int]:
    """Plain greedy decoding with the peer (T=1, prefill token by token), every step a replay of
    one captured graph (the context moves through its device buffer)."""
    cfg = model.cfg
    cache = KVCache(cfg, device=model.w.device)
    r = PeerRunner(model, cache, [-1], r_read=len(prompt) + steps, forced=False, small_ops=small_ops)
    r.set_inputs([prompt[0]], 0)
    g = StepGraph(r) if model.w.device.type == "cuda" else None
    ctx, last, out = 0, None, []
    for tok in list(prompt) + [None] * steps:
        if tok is None:
            out.append(last)
            tok = last
        r.set_inputs([tok], ctx)
        if g is not None:
            g.replay()
            last = int(g.tokens[0])
        else:
            r.run()
            last = int(r.out_tokens[0])
        ctx += 1
    return out


# ---------------------------------------------------------------------- the block-size sweep
@dataclass(frozen=True)
class TuneRecord:
    kernel: str  # "moe_up" | "moe_down"
    config: str  # MoeConfig.label()
    median_s: float | None  # per layer launch (None: failed)
    samples: tuple[float, ...]
    error: str = ""  # why it was dropped


def pick_config(records: Sequence[TuneRecord]) -> TuneRecord:
    """The fastest config that ran and checked (ties: the first in sweep order)."""
    ok = [r for r in records if r.median_s is not None]
    if not ok:
        raise RuntimeError("every config of the sweep failed: " + "; ".join(f"{r.config}: {r.error}" for r in records))
    return min(ok, key=lambda r: r.median_s)


def tune_moe(h, runner: PeerRunner, sweep=None, log=print, rel: float = 2e-3):
    """Times moe_up and moe_down over `sweep` on the GPU with the inputs of one un-graphed step of
    `runner` (each layer's router/pool output and routing, and moe_up's activations from the
    current config): a sample runs the kernel once per layer, every layer on its own experts, so
    the weights stream from HBM as in a step. Every config's output (the last layer's) must agree
    with the current config's within `rel` (bf16 outputs: other K steps only flip roundings).
    Sets the fastest of each on runner.model; returns (records, up config, down config). sweep:
    (block_n, block_k, warps, stages) tuples, default SWEEP."""
    K = _kernels()
    sweep = SWEEP if sweep is None else sweep
    m, cfg = runner.model, runner.cfg
    ld = cfg.n_experts + cfg.d_pool
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    runner.keep_rpo = {}
    try:
        runner.run()
        rpo = [runner.keep_rpo[l] for l in range(cfg.n_layers)]
    finally:
        runner.keep_rpo = None
    per_layer, acts = [], []
    for l in range(cfg.n_layers):  # the routing of each layer again (the runner's step shares its buffers)
        s, b, n = runner.sorted_ids.clone(), runner.block_expert.clone(), runner.n_blocks.clone()
        K.route(rpo[l], ld, runner.n_tokens, cfg.n_experts, cfg.top_k, runner.routes[l].clone(),
                runner.route_w[l].clone(), s, b, n, block_m=K.BLOCK_M, max_per_expert=runner.n_tokens,
                forced=runner.routes[l])
        per_layer.append((s, b, n))
        a = torch.empty_like(runner.act)
        lw = m.w.layers[l]
        K.moe_up(rpo[l], ld, cfg.n_experts, True, s, b, n, lw.w1.codes, lw.w1.scales, lw.w1.tensor_scale, a,
                 runner.n_pairs, cfg.top_k, m.up_cfg)
        acts.append(a)
    act_out, y_out = torch.empty_like(runner.act), torch.empty_like(runner.y)

    def up(c):
        for l in range(cfg.n_layers):
            lw = m.w.layers[l]
            K.moe_up(rpo[l], ld, cfg.n_experts, True, *per_layer[l], lw.w1.codes, lw.w1.scales, lw.w1.tensor_scale,
                     act_out, runner.n_pairs, cfg.top_k, c)

    def down(c):
        for l in range(cfg.n_layers):
            lw = m.w.layers[l]
            K.moe_down(acts[l], *per_layer[l], lw.w2.codes, lw.w2.scales, lw.w2.tensor_scale, y_out, runner.n_pairs, c)

    records = []
    for kind, fn, out, current, dims in (("moe_up", up, act_out, m.up_cfg, (cfg.d_expert, cfg.d_pool)),
                                         ("moe_down", down, y_out, m.down_cfg, (cfg.d_pool, cfg.d_expert))):
        fn(current)
        sync()
        ref = out.float().clone()
        mine = []
        for spec in sweep:
            c = K.MoeConfig(*spec)
            try:
                c.validate(*dims)
                fn(c)  # compiles on the first call
                sync()
                err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                if not err <= rel:
                    raise RuntimeError(f"output differs from {current.label()}'s by {err:.2e} > {rel:.0e}")
                t = h.time(lambda c=c: fn(c))
                samples = tuple(float(x) / cfg.n_layers for x in t.samples_s)
                mine.append(TuneRecord(kind, c.label(), float(np.median(samples)), samples))
                log(f"    tune {kind} {c.label()}: {mine[-1].median_s * 1e6:.1f} us per layer")
            except Exception as e:  # a config that does not compile, fit or agree is dropped, and said so
                mine.append(TuneRecord(kind, c.label(), None, (), f"{e.__class__.__name__}: {str(e)[:200]}"))
                log(f"    tune {kind} {c.label()}: dropped ({mine[-1].error})")
        best = pick_config(mine)
        chosen = next(K.MoeConfig(*sp) for sp in sweep if K.MoeConfig(*sp).label() == best.config)
        if kind == "moe_up":
            m.up_cfg = chosen
        else:
            m.down_cfg = chosen
        records += mine
    return records, m.up_cfg, m.down_cfg


# ---------------------------------------------------------------------- per-kernel accounting
def _kernels_under(e) -> list[tuple[str, float]]:
    """(kernel name, device us) of every kernel launched under a CPU-side profiler event."""
    out = [(k.name, float(k.duration)) for k in e.kernels]
    for ch in e.cpu_children:
        out += _kernels_under(ch)
    return out


def _per_step(raw: dict[str, list[float]], steps: int) -> dict[str, list[float]]:
    """{op: [seconds of each range, in order]} -> {op: [seconds per step]} (an op's ranges of one
    step are consecutive: one per layer)."""
    out = {}
    for op, v in raw.items():
        per = len(v) // steps or 1
        out[op] = [sum(v[i * per:(i + 1) * per]) for i in range(steps)]
    return out


def op_kernel_sums(events, steps: int) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """From profiler FunctionEvents: ({op: [device seconds per step]}, {op: {kernel: seconds per step}}).
    An op's time is the sum of the durations of the kernels (and copies) that ran on the GPU inside
    its `peer.<op>` range's GPU-side annotation: the annotation's own span would also hold the gaps
    an un-graphed step waits for the host (a Triton launch from Python takes tens of us), which the
    first accounting counted (its ops summed to 19.6 ms for a 15.4 ms graph step). Without GPU-side
    annotations, the kernels launched under each CPU-side range (kernels that Triton launches
    itself have no CPU-side parent there, so the GPU side comes first)."""
    def add(raw, names, op, ks):
        raw.setdefault(op, []).append(sum(d for _, d in ks) * 1e-6)
        for n, d in ks:
            n = n if len(n) <= 80 else n[:77] + "..."
            names.setdefault(op, {})[n] = names.get(op, {}).get(n, 0.0) + d * 1e-6 / steps

    gpu = [e for e in events if e.device_type != DeviceType.CPU and not e.is_async]
    ann = sorted(((e.time_range.start, e.time_range.end, e.name[5:]) for e in gpu if e.name.startswith("peer.")))
    raw: dict[str, list[float]] = {}
    names: dict[str, dict[str, float]] = {}
    if ann:
        starts = [a[0] for a in ann]
        per_range: list[list[tuple[str, float]]] = [[] for _ in ann]
        for e in gpu:
            if e.name.startswith("peer.") or getattr(e, "is_user_annotation", False):
                continue
            i = bisect_right(starts, e.time_range.start) - 1
            if i >= 0 and e.time_range.start < ann[i][1]:
                per_range[i].append((e.name, float(e.time_range.end - e.time_range.start)))
        for (_, _, op), ks in zip(ann, per_range):
            add(raw, names, op, ks)
    else:
        for e in events:
            if e.name.startswith("peer.") and e.device_type == DeviceType.CPU and not e.is_async:
                add(raw, names, e.name[5:], _kernels_under(e))
    return _per_step(raw, steps), names


def kernel_times(runner: PeerRunner, steps: int = 3,
                 breakdown: dict | None = None) -> tuple[dict[str, list[float]], str]:
    """({op: [device seconds per step]}, timer) over `steps` un-graphed steps, per op label (OPS).
    Timer "cupti": the profiler's CUPTI durations of the kernels that ran inside each op's
    record_function range (op_kernel_sums), summed per step; `breakdown`, where given, receives
    {op: {kernel name: seconds per step}}. Where the profiler attributes no kernel to the ranges,
    timer "cuda_event": events around each op, whose intervals also hold the launch gap before the
    op (an un-graphed short op waits for the host): an upper bound for short ops."""
    runner.run()
    torch.cuda.synchronize()
    runner.profiling = "cupti"
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.run()
            torch.cuda.synchronize()
        per_step, names = op_kernel_sums(prof.events(), steps)
    finally:
        runner.profiling = None
    timer = "cupti"
    if not per_step or all(sum(v) == 0 for v in per_step.values()):
        timer, out, names = "cuda_event", {}, {}
        runner.profiling, runner.op_events = "cuda_event", []
        try:
            for _ in range(steps):
                runner.run()
            torch.cuda.synchronize()
            for name, a, b in runner.op_events:
                out.setdefault(name, []).append(a.elapsed_time(b) * 1e-3)
        finally:
            runner.profiling, runner.op_events = None, []
        per_step = _per_step(out, steps)
    if breakdown is not None:
        breakdown.update(names)
    return per_step, timer


def distinct_of(routes: Sequence[torch.Tensor]) -> list[int]:
    return [int(torch.unique(torch.as_tensor(r)).numel()) for r in routes]


def free_compiled() -> None:
    """Drop dynamo's compiled graphs (the compiled runner's)."""
    try:
        import torch._dynamo  # heavy: torch._dynamo (seconds to import; only where something compiled)

        torch._dynamo.reset()
    except Exception:
        pass
