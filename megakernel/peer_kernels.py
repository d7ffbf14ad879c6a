"""Triton kernels of the peer baseline (peer.py): a fused MoE in the style of vLLM's generic Triton
fused-MoE kernel, and the small ops around it.

Kernels (one launch each, per layer unless said):
  add_rmsnorm    x += delta (fp32 residual), h = bf16(rmsnorm(x) * g); or x = embed[token] first
  rope_kv        qkv fp32 -> q bf16 (RoPE), k (RoPE) and v bf16 written into the layer's KV cache
  attn_partial   flash decoding over the tree: one program per (kv head, query rows, key split)
                 reads its split of the cached rows and the tree's new rows under the tree mask
                 (sliding layers: the window, through the ring), online softmax, fp32 partials
  attn_combine   merges the splits' partials (log-sum-exp) -> bf16 [T, Hq hd]
  route          one program: top-k of the router logits (ties to the lower index, like
                 reference.topk_route) or the forced routes, softmax of the k logits, then the
                 "align" of vLLM's generic fused MoE: token-expert pairs sorted by expert, each
                 expert's run padded to whole BLOCK_M blocks, the expert of every block, the block
                 count; rows and pairs in chunks (ROUTE_ROWS, ROUTE_PAIRS), so a batch's 128 rows
                 keep one chunk's registers
  moe_up         fused MoE gate/up for the routed experts only: one program per (BLOCK_N gate
                 rows and the same up rows, expert block; the static grid's padding blocks exit
                 at once, after the live ones in launch order); NVFP4 dequantised in registers, bf16
                 tensor-core dots, fp32 accumulators, bf16(silu(gate) * up) out
  moe_down       the down projection of the same blocks: bf16(acc * tensor scale) per pair
  moe_combine    z[t] = bf16(sum over ranks r in order of w[t, r] * y[t, r])
The dense projections are cuBLAS (torch.mm, peer.py); nothing here touches an expert that no
token of the step routes to.

NVFP4 in registers. The expert banks stay as the megakernel stores them (weights.ExpertBank:
fp4_layout's storage words, canonical E4M3 scales), read in place: no copy of the 56 GB of shard8
experts. A 32-bit word holds codes k..k+7; pair e (codes k+e and k+e+4) is two shifts and two
masks away from an fp16x2 whose halves are e2m1 * 2^-14 (3 magnitude bits at fp16 bits 9..11,
sign at 15; e2m1's 0.5 lands on an fp16 subnormal, which the conversion to fp32 keeps exactly).
The E4M3 scale << 7 is an fp16 of scale * 2^-8 (subnormal scales included). Their fp32 product
is exact (<= 6 significant bits), and so is its bf16: the dot sees value * scale * 2^-22, and the
epilogue multiplies by 2^22 * tensor scale. PAIR_SHIFTS is derived from fp4_layout.BIT_MAP.

K order. A word's 8 codes feed 8 dots ("planes": plane j holds code k = 8w + j of word w). The
activations are stored plane-major (column j * K/8 + w holds k = 8w + j), so every plane's
operand is a contiguous tile: the pooler's rows are permuted once (peer.py) and moe_up writes its
output in that order. `to_planes` / `from_planes` convert. Where the dots are mma.sync (BLOCK_N
< 64: no wgmma) and a plane is 16 words (BLOCK_K 128), planes e and e + 4 go into one dot of
K = 32 instead (MoeConfig.pair_dots): Triton 3.6 lays those operands out 32 k values wide, and
its dots of K = 16 computed wrong outputs on the H200.

Interpreter. `interpreted()` runs these kernels on the CPU with Triton's numpy interpreter
(tests): it also makes nested @triton.jit helpers callable there and fixes two interpreter bugs
(Triton 3.6): its bf16 dot multiplies the raw uint16 bits of bf16 operands, its fp32 -> bf16 cast
truncates (the GPU rounds to nearest even; its own round-to-nearest mode loses the carry into the
exponent, 0.1248 -> 0.0625), and a loop bound computed from a scalar argument fails
under numpy >= 2.4 (int() of a 1-element array). The kernels do no bf16
arithmetic: bf16 is only loaded, stored and fed to dots, which the fixed interpreter upcasts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime import interpreter as I
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .fp4_layout import BIT_MAP

# ---------------------------------------------------------------------- the storage word's pairs


def _pair_shifts() -> tuple[tuple[int, int], ...]:
    """(magnitude shift, sign shift) of each pair e = 0..3 of a storage word (left; negative =
    right): code k+e's 3 magnitude bits go to fp16 bits 9..11 and its sign to 15, and the same
    shifts move code k+e+4 to bits 25..27 and 31."""
    ker = dict(BIT_MAP)  # natural bit (4 * code + bit) -> storage bit
    out = []
    for e in range(4):
        lo = [ker[4 * e + b] for b in range(4)]
        hi = [ker[4 * (e + 4) + b] for b in range(4)]
        if lo[1] != lo[0] + 1 or lo[2] != lo[0] + 2 or [h - 16 for h in hi] != lo:
            raise AssertionError(f"fp4 storage word: pair {e} is not two shifts of one word ({lo}, {hi})")
        out.append((9 - lo[0], 15 - lo[3]))
    return tuple(out)


PAIR_SHIFTS = _pair_shifts()  # ((9, 6), (6, 3), (3, 4), (-4, 5)) for the storage words
assert all(s >= 0 for _, s in PAIR_SHIFTS), "sign shifts are left shifts"
_M0, _S0 = tl.constexpr(PAIR_SHIFTS[0][0]), tl.constexpr(PAIR_SHIFTS[0][1])
_M1, _S1 = tl.constexpr(PAIR_SHIFTS[1][0]), tl.constexpr(PAIR_SHIFTS[1][1])
_M2, _S2 = tl.constexpr(PAIR_SHIFTS[2][0]), tl.constexpr(PAIR_SHIFTS[2][1])
_M3, _S3 = tl.constexpr(PAIR_SHIFTS[3][0]), tl.constexpr(PAIR_SHIFTS[3][1])
MAG_MASK = 0x0E000E00
SIGN_MASK = 0x80008000 - (1 << 32)  # as int32: the words are int32, shifts of them int32
WEIGHT_SHIFT = 22  # the dot sees value * scale * 2^-22 (2^-14 from the fp16 codes, 2^-8 from the scales)
_UNSHIFT = tl.constexpr(float(1 << WEIGHT_SHIFT))  # what the kernels multiply back in


def to_planes(x: torch.Tensor) -> torch.Tensor:
    """[..., K] natural k order -> plane-major (column j * K/8 + w holds k = 8w + j)."""
    k = x.shape[-1]
    return x.reshape(*x.shape[:-1], k // 8, 8).transpose(-1, -2).reshape(x.shape)


def from_planes(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    return x.reshape(*x.shape[:-1], 8, k // 8).transpose(-1, -2).reshape(x.shape)


def plane_index(k: int, device=None) -> torch.Tensor:
    """idx [K] with to_planes(x) == x[..., idx]."""
    c = torch.arange(k, device=device)
    return 8 * (c % (k // 8)) + c // (k // 8)


# ---------------------------------------------------------------------- interpreter mode
_INTERPRETING = [False]  # a plain flag (torch.compile traces _launch; a threading.local would break its graph)


def interpreting() -> bool:
    return _INTERPRETING[0]


@contextlib.contextmanager
def interpreted(check_overflow: bool = False):
    """Run every launch of this module through Triton's CPU interpreter inside the block.
    check_overflow: the interpreter's int32 overflow assertions on add/sub/mul (address
    arithmetic); several times slower, so off unless asked for."""
    cache: dict = {}
    B = I.InterpreterBuilder
    orig = (JITFunction.__call__, B.create_dot, B.cast_impl, I._patch_lang_tensor, I.interpreter_builder.options)

    def call(self, *a, **kw):  # a nested @triton.jit helper called from an interpreted kernel
        f = cache.get(self.fn)
        if f is None:
            f = cache[self.fn] = I.InterpretedFunction(self.fn)
        scope = I._patch_lang(self.fn)  # what f(*a, **kw) does, which never restores its patches
        try:
            return f.rewrite()(*a, **kw)
        except Exception as e:
            raise I.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def up(h):
            if h.dtype.scalar == tl.bfloat16:
                data = I._convert_float(h.data, tl.bfloat16, tl.float32, None).view(I.np.float32)
                return I.TensorHandle(data, tl.float32)
            return h
        return orig[1](self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):  # fp32 -> bf16 rounds to nearest even, as on the GPU
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            b = I.np.ascontiguousarray(src.data, dtype=I.np.float32).view(I.np.uint32).astype(I.np.uint64)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(I.np.uint16)  # carries into the exponent
            return I.TensorHandle(r.reshape(src.data.shape), tl.bfloat16)
        return orig[2](self, src, dst_type)

    def patch_tensor(tensor, scope):  # scalars are 1-element arrays there; numpy >= 2.4 refuses int() of them
        orig[3](tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    prev = interpreting()
    JITFunction.__call__, B.create_dot, B.cast_impl, I._patch_lang_tensor = call, create_dot, cast_impl, patch_tensor
    I.interpreter_builder.options = dataclasses.replace(orig[4], sanitize_overflow=check_overflow)
    _INTERPRETING[0] = True
    try:
        yield
    finally:
        JITFunction.__call__, B.create_dot, B.cast_impl, I._patch_lang_tensor = orig[:4]
        I.interpreter_builder.options = orig[4]
        _INTERPRETING[0] = prev


def _launch(kernel, grid, *args, **kw):
    if interpreting():
        fn = getattr(kernel, "fn", kernel)
        return InterpretedFunction(fn)[grid](*args, **kw)
    return kernel[grid](*args, **kw)


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---------------------------------------------------------------------- norms
@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, g_ptr, h_ptr, tok_ptr, emb_ptr, D, eps,
                        MODE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < D
    if MODE == 2:  # the first layer: x = embed[token]
        tok = tl.load(tok_ptr + t).to(tl.int64)
        x = tl.load(emb_ptr + tok * D + i, mask=m, other=0.0).to(tl.float32)
        tl.store(x_ptr + t * D + i, x, mask=m)
    elif MODE == 1:  # x += delta (a projection's fp32 output)
        x = tl.load(x_ptr + t * D + i, mask=m, other=0.0) + tl.load(d_ptr + t * D + i, mask=m, other=0.0)
        tl.store(x_ptr + t * D + i, x, mask=m)
    else:
        x = tl.load(x_ptr + t * D + i, mask=m, other=0.0)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)  # IEEE sqrt (tl.sqrt is sqrt.approx.ftz)
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + t * D + i, (x * r * g).to(tl.bfloat16), mask=m)


def add_rmsnorm(x, g, h, eps: float, delta=None, tokens=None, embed=None) -> None:
    """In place: x [T, D] fp32 (+= delta, or = embed[tokens]); h [T, D] bf16 = rmsnorm(x) * g."""
    t, d = x.shape
    mode = 2 if tokens is not None else 1 if delta is not None else 0
    _launch(_add_rmsnorm_kernel, (t,), x, x if delta is None else delta, g, h,
            x if tokens is None else tokens, x if embed is None else embed, d, eps,
            MODE=mode, BLOCK=_p2(d), num_warps=4 if d <= 2048 else 8)


# ---------------------------------------------------------------------- RoPE and the KV write
@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, ctx_ptr, depth_ptr, q_ptr, kc_ptr, vc_ptr, ring, slots,
                    HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, IS_GLOBAL: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, HD // 2)
    rows: tl.constexpr = (HQ + 2 * HKV) * HD
    ctx = tl.load(ctx_ptr)
    a = tl.load(qkv_ptr + t * rows + h * HD + 2 * i)
    b = tl.load(qkv_ptr + t * rows + h * HD + 2 * i + 1)
    if h < HQ + HKV:  # q and k heads rotate; v heads do not
        pos = ctx + tl.load(depth_ptr + t)
        c = tl.load(cos_ptr + pos * (HD // 2) + i)
        s = tl.load(sin_ptr + pos * (HD // 2) + i)
        ra = a * c - b * s
        rb = a * s + b * c
    else:
        ra = a
        rb = b
    seq = ctx + t
    if IS_GLOBAL:
        slot = seq
    else:
        slot = seq % ring
    if h < HQ:
        dst = q_ptr + (t * HQ + h) * HD
    elif h < HQ + HKV:
        dst = kc_ptr + ((h - HQ) * slots + slot).to(tl.int64) * HD
    else:
        dst = vc_ptr + ((h - HQ - HKV) * slots + slot).to(tl.int64) * HD
    tl.store(dst + 2 * i, ra.to(tl.bfloat16))
    tl.store(dst + 2 * i + 1, rb.to(tl.bfloat16))


def rope_kv(qkv, cos, sin, ctx_t, depth_t, q, k_cache, v_cache, *, n_heads: int, n_kv: int, head_dim: int,
            is_global: bool, ring: int) -> None:
    t = qkv.shape[0]
    _launch(_rope_kv_kernel, (t, n_heads + 2 * n_kv), qkv, cos, sin, ctx_t, depth_t, q, k_cache, v_cache, ring,
            k_cache.shape[1], HQ=n_heads, HKV=n_kv, HD=head_dim, IS_GLOBAL=is_global, num_warps=1)


# ---------------------------------------------------------------------- tree attention (flash decoding)
@dataclass(frozen=True)
class AttnConfig:
    block_q: int  # query rows (token x head-in-group) per program
    block_n: int  # keys per inner step
    chunk: int  # keys per split (a multiple of block_n)
    n_splits: int  # splits the grid covers (static: the read bound / chunk)
    num_warps: int = 4


def attn_config(n_read: int, q_rows: int, n_kv: int, n_sm: int = 132, block_n: int = 64) -> AttnConfig:
    """Splits for `n_read` key slots (the static bound a captured step may read): about two
    programs per SM over (kv heads x query blocks x splits), splits of whole key blocks."""
    bq = 64 if q_rows > 32 else max(16, _p2(q_rows))
    qb = -(-q_rows // bq)
    want = max(1, (2 * n_sm) // (n_kv * qb))
    blocks = -(-max(n_read, 1) // block_n)
    chunk = block_n * max(1, -(-blocks // want))
    return AttnConfig(bq, block_n, chunk, -(-max(n_read, 1) // chunk))


@triton.jit
def _attn_partial_kernel(q_ptr, k_ptr, v_ptr, ctx_ptr, depth_ptr, anc_ptr, o_ptr, ml_ptr, T, slots, ring, window,
                         scale, n_splits, G: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
                         IS_GLOBAL: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    kv = tl.program_id(0)
    qb = tl.program_id(1)
    sp = tl.program_id(2)
    nqb = tl.num_programs(1)
    ctx = tl.load(ctx_ptr)
    if IS_GLOBAL:
        n_dyn = ctx + T
    else:
        n_dyn = tl.minimum(ring, ctx + T)
    lo = sp * CHUNK
    hi = tl.minimum(lo + CHUNK, n_dyn)
    rows = qb * BQ + tl.arange(0, BQ)  # row r: token r // G, head kv * G + r % G
    tok = rows // G
    rv = tok < T
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + ((tok * HKV + kv) * G + rows % G)[:, None] * HD + d[None, :], mask=rv[:, None], other=0.0)
    pos = ctx + tl.load(depth_ptr + tok, mask=rv, other=0)
    anc = tl.load(anc_ptr + tok, mask=rv, other=0)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, HD], tl.float32)
    kbase = k_ptr + kv.to(tl.int64) * slots * HD
    vbase = v_ptr + kv.to(tl.int64) * slots * HD
    for s0 in range(lo, hi, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        sv = s < hi
        kt = tl.load(kbase + s[None, :] * HD + d[:, None], mask=sv[None, :], other=0.0)
        sc = tl.dot(q, kt) * scale
        if IS_GLOBAL:
            seq = s
        else:  # the newest sequence index the ring slot holds (slots < n_dyn hold written rows)
            seq = s + ring * ((ctx + T - 1 - s) // ring)
        cached = seq < ctx
        j = tl.where(cached, 0, seq - ctx)
        ok_new = (~cached) & (j < T) & (((anc[:, None] >> j[None, :]) & 1) != 0)
        if IS_GLOBAL:
            ok = cached[None, :] | ok_new
        else:
            ok = (cached[None, :] & (seq[None, :] >= pos[:, None] - window + 1)) | ok_new
        ok = ok & sv[None, :] & rv[:, None]
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = tl.load(vbase + s[:, None] * HD + d[None, :], mask=sv[:, None], other=0.0)
        p_hi = p.to(tl.bfloat16)  # p = hi + lo to ~2^-16: fp32-grade p @ v on bf16 tensor cores
        p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(p_hi, v, acc)
        acc = tl.dot(p_lo, v, acc)
        m_i = m_new
    out = (kv * n_splits + sp).to(tl.int64) * (nqb * BQ) + rows
    tl.store(o_ptr + out[:, None] * HD + d[None, :], acc)
    tl.store(ml_ptr + 2 * out, m_i)
    tl.store(ml_ptr + 2 * out + 1, l_i)


@triton.jit
def _attn_combine_kernel(o_ptr, ml_ptr, out_ptr, n_splits, rows_pad, G: tl.constexpr, HKV: tl.constexpr,
                         HD: tl.constexpr, NS: tl.constexpr):
    kv = tl.program_id(0)
    r = tl.program_id(1)
    sp = tl.arange(0, NS)
    sv = sp < n_splits
    idx = (kv * n_splits + sp).to(tl.int64) * rows_pad + r
    m = tl.load(ml_ptr + 2 * idx, mask=sv, other=float("-inf"))
    l = tl.load(ml_ptr + 2 * idx + 1, mask=sv, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
    d = tl.arange(0, HD)
    o = tl.load(o_ptr + idx[:, None] * HD + d[None, :], mask=sv[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.sum(w * l, axis=0)
    tok = r // G
    tl.store(out_ptr + ((tok * HKV + kv) * G + r % G) * HD + d, o.to(tl.bfloat16))


def attention(q, k_cache, v_cache, ctx_t, depth_t, anc_t, out, o_part, ml_part, cfg: AttnConfig, *, n_tokens: int,
              group: int, head_dim: int, is_global: bool, ring: int, window: int) -> None:
    """q [T, Hq, hd] bf16 (RoPE'd), the layer's caches [Hkv, slots, hd] (the T new rows already
    written), ctx / depth [T] / ancestor bits [T] int32 on the device -> out [T, Hq hd] bf16.
    o_part / ml_part: scratch of at least Hkv * n_splits * rows_pad * (hd | 2) fp32."""
    hkv, slots = k_cache.shape[0], k_cache.shape[1]
    rows = n_tokens * group
    qb = -(-rows // cfg.block_q)
    _launch(_attn_partial_kernel, (hkv, qb, cfg.n_splits), q, k_cache, v_cache, ctx_t, depth_t, anc_t, o_part, ml_part,
            n_tokens, slots, ring, window, head_dim ** -0.5, cfg.n_splits, G=group, HKV=hkv, HD=head_dim,
            IS_GLOBAL=is_global, BQ=cfg.block_q, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk, num_warps=cfg.num_warps)
    _launch(_attn_combine_kernel, (hkv, rows), o_part, ml_part, out, cfg.n_splits, qb * cfg.block_q, G=group,
            HKV=hkv, HD=head_dim, NS=_p2(cfg.n_splits), num_warps=4)


# ---------------------------------------------------------------------- routing: top-k and align
@triton.jit(do_not_specialize=["T", "forced"])
def _route_kernel(logits_ptr, ld, forced_ptr, forced, ids_ptr, w_ptr, sorted_ptr, bexp_ptr, nblk_ptr, T, E, max_blocks,
                  K: tl.constexpr, KP: tl.constexpr, TC: tl.constexpr, NTC: tl.constexpr, EP: tl.constexpr,
                  PC: tl.constexpr, NPC: tl.constexpr, BM: tl.constexpr, MAXJ: tl.constexpr, FILL: tl.constexpr):
    # rows in NTC chunks of TC, pairs in NPC chunks of PC: the registers stay those of one chunk
    # (a [TC, EP] logit tile, a [PC, PC] rank compare) whatever the batch's row count
    kk = tl.arange(0, KP)
    kv = kk < K
    for c in range(NTC):
        t = c * TC + tl.arange(0, TC)
        tv = t < T
        if forced != 0:
            sel = tl.load(forced_ptr + t[:, None] * K + kk[None, :], mask=tv[:, None] & kv[None, :], other=0)
            val = tl.load(logits_ptr + t[:, None] * ld + sel, mask=tv[:, None] & kv[None, :], other=float("-inf"))
        else:
            e = tl.arange(0, EP)
            lg = tl.load(logits_ptr + t[:, None] * ld + e[None, :], mask=tv[:, None] & (e < E)[None, :],
                         other=float("-inf"))
            sel = tl.zeros([TC, KP], tl.int32)
            val = tl.full([TC, KP], float("-inf"), tl.float32)
            for r in tl.static_range(K):  # largest first, ties to the lower expert id
                best = tl.argmax(lg, axis=1, tie_break_left=True)
                top = tl.max(lg, axis=1)
                sel = tl.where(kk[None, :] == r, best[:, None], sel)
                val = tl.where(kk[None, :] == r, top[:, None], val)
                lg = tl.where(e[None, :] == best[:, None], float("-inf"), lg)
        val = tl.where(kv[None, :], val, float("-inf"))
        mx = tl.max(val, axis=1)
        ex = tl.exp(val - tl.where(tv, mx, 0.0)[:, None])  # padded rows (all -inf): zeros, not NaN
        ex = tl.where(kv[None, :], ex, 0.0)
        w = ex / tl.where(tv, tl.sum(ex, axis=1), 1.0)[:, None]
        st = tv[:, None] & kv[None, :]
        tl.store(ids_ptr + t[:, None] * K + kk[None, :], sel, mask=st)
        tl.store(w_ptr + t[:, None] * K + kk[None, :], w, mask=st)
    # align: pair p = t * K + r, sorted by expert, each expert's run padded to whole blocks
    n_pairs = T * K
    for i in range(0, max_blocks * BM, FILL):
        f = i + tl.arange(0, FILL)
        tl.store(sorted_ptr + f, tl.zeros([FILL], tl.int32) + n_pairs, mask=f < max_blocks * BM)
    for i in range(0, max_blocks, FILL):
        f = i + tl.arange(0, FILL)
        tl.store(bexp_ptr + f, tl.zeros([FILL], tl.int32) - 1, mask=f < max_blocks)
    tl.debug_barrier()  # the pairs' ids are in memory, the fills before the scatter below
    counts = tl.zeros([EP], tl.int32)
    for c in range(NPC):
        p = c * PC + tl.arange(0, PC)
        pv = p < n_pairs
        ep = tl.load(ids_ptr + p, mask=pv, other=0)
        counts += tl.histogram(ep, EP, mask=pv)
    nb = (counts + BM - 1) // BM
    start = tl.cumsum(nb, axis=0) - nb  # first block of each expert (experts ascending)
    seen = tl.zeros([EP], tl.int32)  # each expert's pairs in the chunks before this one
    for c in range(NPC):
        p = c * PC + tl.arange(0, PC)
        pv = p < n_pairs
        ep = tl.load(ids_ptr + p, mask=pv, other=0)
        rank = tl.gather(seen, ep, axis=0) + tl.sum(
            ((ep[:, None] == ep[None, :]) & (p[None, :] < p[:, None]) & pv[None, :]).to(tl.int32), axis=1)
        pos = tl.gather(start, ep, axis=0) * BM + rank
        tl.store(sorted_ptr + pos, p, mask=pv)
        seen += tl.histogram(ep, EP, mask=pv)
    ee = tl.arange(0, EP)
    for j in tl.static_range(MAXJ):
        tl.store(bexp_ptr + start + j, ee, mask=(j < nb) & (ee < E))
    tl.store(nblk_ptr, tl.sum(nb, axis=0))


ROUTE_ROWS, ROUTE_PAIRS = 16, 128  # the routing kernel's row and pair chunks (one chunk each up to T = 16, k = 8)


def max_blocks(n_pairs: int, n_experts: int, block_m: int, max_per_expert: int) -> int:
    """Static bound on the blocks `align` can make: at most one per pair, and at most
    sum over used experts of ceil(count / BM) <= ceil(n_pairs / BM) + min(E, n_pairs) - 1."""
    used = min(n_experts, n_pairs)
    per = -(-max_per_expert // block_m)
    return max(1, min(n_pairs, used * per, -(-n_pairs // block_m) + used - 1))


def route(logits, ld: int, n_tokens: int, n_experts: int, top_k: int, ids, w, sorted_ids, block_expert, n_blocks, *,
          block_m: int, max_per_expert: int, forced=None) -> None:
    """logits: fp32 rows of `ld` (the first E columns are the router's); forced: int32 [T, k] or
    None. Out: ids / w [T, k] (int32 / fp32), sorted_ids [max_blocks * BM] (pair ids, padding =
    T k), block_expert [max_blocks] (-1 past the last block), n_blocks [1]."""
    if logits.dtype != torch.float32:  # a bf16 table would compile a kernel of mixed types, or route on rounded logits
        raise TypeError(f"route: the router's logits must be fp32, got {logits.dtype}")
    nb_max = block_expert.numel()
    tc = min(ROUTE_ROWS, _p2(max(n_tokens, 2)))
    pc = min(ROUTE_PAIRS, _p2(max(2, n_tokens * top_k)))
    _launch(_route_kernel, (1,), logits, ld, ids if forced is None else forced, int(forced is not None), ids, w,
            sorted_ids, block_expert, n_blocks, n_tokens, n_experts, nb_max, K=top_k, KP=_p2(top_k),
            TC=tc, NTC=-(-n_tokens // tc), EP=_p2(n_experts), PC=pc, NPC=-(-(n_tokens * top_k) // pc), BM=block_m,
            MAXJ=-(-max_per_expert // block_m), FILL=256, num_warps=4)


def align_reference(ids: torch.Tensor, n_experts: int, block_m: int, n_max_blocks: int):
    """The host reference of `route`'s align on ids [T, k]: (sorted pair ids padded with T k,
    block experts padded with -1, block count)."""
    flat = ids.reshape(-1).tolist()
    pad = len(flat)
    sorted_ids, blocks = [], []
    for e in range(n_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        for b in range(0, len(pairs), block_m):
            run = pairs[b:b + block_m]
            sorted_ids += run + [pad] * (block_m - len(run))
            blocks.append(e)
    n = len(blocks)
    if n > n_max_blocks:
        raise ValueError(f"{n} blocks exceed the static bound {n_max_blocks}")
    sorted_ids += [pad] * (block_m * (n_max_blocks - n))
    blocks += [-1] * (n_max_blocks - n)
    return (torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(blocks, dtype=torch.int32), n)


# ---------------------------------------------------------------------- fused MoE
@dataclass(frozen=True)
class MoeConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def label(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"

    def wgmma(self) -> bool:
        """Whether Triton (3.6, sm_90) makes the kernels' dots wgmma: a warpgroup's 64 rows of
        BLOCK_N per dot; else mma.sync (compile_sm90 reports which)."""
        return self.block_n % 64 == 0 and self.num_warps % 4 == 0

    def pair_dots(self) -> bool:
        """Whether each pair of planes feeds one dot of K = BLOCK_K / 4 (PAIR in _plane_dots)
        rather than two of BLOCK_K / 8: where the dots are mma.sync and BLOCK_K / 8 = 16. Triton
        3.6 gives an mma.sync operand that comes from 8-bit loads through a join (the scales)
        kWidth 8, whose layout spans 32 k values; a dot of K = 16 then adds wrong products
        (H200: n32k128 and n16k128 off by 1.74 / 0.99 relative for moe_up / moe_down, every
        num_warps and num_stages; n32k256 right). The wgmma configs keep their two dots."""
        return self.block_k == 128 and not self.wgmma()

    def validate(self, n: int, k: int) -> MoeConfig:
        if self.block_k % 128 or k % self.block_k:
            raise ValueError(f"moe config {self.label()}: BLOCK_K must be a multiple of 128 dividing K={k} "
                             "(planes of BLOCK_K/8 >= 16 words: a tensor-core k step)")
        if n % self.block_n or self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"moe config {self.label()}: BLOCK_N must be a power of two >= 16 dividing N={n}")
        return self


BLOCK_M = 16  # pairs per block: the most tokens one expert can get at T <= 16 (one block each)


@triton.jit
def _fp4_pair(w, MAG: tl.constexpr, SIGN: tl.constexpr):
    """int32 storage words -> (code k+e, code k+e+4) as fp32 e2m1 * 2^-14."""
    if MAG >= 0:
        a = w << MAG
    else:
        a = w >> (-MAG)
    p = (a & 0x0E000E00) | ((w << SIGN) & -2147450880)  # MAG_MASK | SIGN_MASK (int32)
    lo = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _scales(ptr, BN: tl.constexpr, BKW: tl.constexpr):
    """E4M3 scales [BN, BKW/2] at ptr ([BN, 1] row pointers + column offsets) -> fp32 scale * 2^-8
    per word [BN, BKW] (two words of 8 codes per 16-value block)."""
    b = tl.load(ptr).to(tl.int16)
    s = ((b & 0x7F) << 7).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.join(s, s), [BN, BKW])


@triton.jit
def _plane_dots(acc, w, s, x_ptrs, xm, plane, X_F32: tl.constexpr, MAG: tl.constexpr, SIGN: tl.constexpr,
                PAIR: tl.constexpr):
    """acc += planes e and e + 4 of the words w (scales s) against the activation planes at
    x_ptrs + plane offsets. PAIR: both planes in one dot of K = 2 BKW (weight column 2w + h is
    word w of plane e + 4h, and so is activation row 2w + h: the kernels' x_ptrs are then
    [2 BKW, BM] of those rows); else one dot of K = BKW each (x_ptrs [BKW, BM], plane e)."""
    lo, hi = _fp4_pair(w, MAG, SIGN)
    if PAIR:
        x = tl.load(x_ptrs, mask=xm, other=0.0)
        if X_F32:
            x = x.to(tl.bfloat16)
        a = tl.reshape(tl.join(lo * s, hi * s), [lo.shape[0], 2 * lo.shape[1]])
        acc = tl.dot(a.to(tl.bfloat16), x, acc)
    else:
        xl = tl.load(x_ptrs, mask=xm, other=0.0)
        xh = tl.load(x_ptrs + 4 * plane, mask=xm, other=0.0)
        if X_F32:
            xl = xl.to(tl.bfloat16)
            xh = xh.to(tl.bfloat16)
        acc = tl.dot((lo * s).to(tl.bfloat16), xl, acc)
        acc = tl.dot((hi * s).to(tl.bfloat16), xh, acc)
    return acc


@triton.jit
def _x_rows(KW, BKW: tl.constexpr, PAIR: tl.constexpr):
    """Column offsets of the activation tile's rows from plane e's first word (_plane_dots):
    PAIR, [2 BKW]: row 2w + h is word w of plane e + 4h; else [BKW]: word w of plane e."""
    if PAIR:
        r = tl.arange(0, 2 * BKW)
        return r // 2 + (r % 2) * (4 * KW)
    else:
        return tl.arange(0, BKW)


@triton.jit(do_not_specialize=["n_pairs"])
def _moe_up_kernel(x_ptr, x_stride, x_off, sorted_ptr, bexp_ptr, nblk_ptr, codes_ptr, scales_ptr, ts_ptr, act_ptr,
                   n_pairs, F, K, TOPK: tl.constexpr, X_F32: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PAIR: tl.constexpr):
    pid_m = tl.program_id(1)  # the expert block (axis 1: the live blocks launch before the padding's)
    if pid_m >= tl.load(nblk_ptr):
        return
    pid_n = tl.program_id(0)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    m = tl.arange(0, BM)
    pair = tl.load(sorted_ptr + pid_m * BM + m)
    pv = pair < n_pairs
    tok = tl.where(pv, pair // TOPK, 0)
    BKW: tl.constexpr = BK // 8
    KW = K // 8
    n = pid_n * BN + tl.arange(0, BN)
    wi = tl.arange(0, BKW)
    si = tl.arange(0, BKW // 2)
    g_rows = ex * 2 * F + n
    u_rows = g_rows + F
    g_w = codes_ptr + g_rows.to(tl.int64)[:, None] * KW + wi[None, :]
    u_w = codes_ptr + u_rows.to(tl.int64)[:, None] * KW + wi[None, :]
    g_s = scales_ptr + g_rows.to(tl.int64)[:, None] * (K // 16) + si[None, :]
    u_s = scales_ptr + u_rows.to(tl.int64)[:, None] * (K // 16) + si[None, :]
    x_p = x_ptr + x_off + tok[None, :] * x_stride + _x_rows(KW, BKW, PAIR)[:, None]  # plane 0 of the first step
    xm = pv[None, :]
    acc_g = tl.zeros([BN, BM], tl.float32)
    acc_u = tl.zeros([BN, BM], tl.float32)
    for kw0 in range(0, KW, BKW):
        wg = tl.load(g_w + kw0)
        wu = tl.load(u_w + kw0)
        sg = _scales(g_s + kw0 // 2, BN, BKW)
        su = _scales(u_s + kw0 // 2, BN, BKW)
        xp = x_p + kw0
        acc_g = _plane_dots(acc_g, wg, sg, xp, xm, KW, X_F32, _M0, _S0, PAIR)
        acc_u = _plane_dots(acc_u, wu, su, xp, xm, KW, X_F32, _M0, _S0, PAIR)
        acc_g = _plane_dots(acc_g, wg, sg, xp + KW, xm, KW, X_F32, _M1, _S1, PAIR)
        acc_u = _plane_dots(acc_u, wu, su, xp + KW, xm, KW, X_F32, _M1, _S1, PAIR)
        acc_g = _plane_dots(acc_g, wg, sg, xp + 2 * KW, xm, KW, X_F32, _M2, _S2, PAIR)
        acc_u = _plane_dots(acc_u, wu, su, xp + 2 * KW, xm, KW, X_F32, _M2, _S2, PAIR)
        acc_g = _plane_dots(acc_g, wg, sg, xp + 3 * KW, xm, KW, X_F32, _M3, _S3, PAIR)
        acc_u = _plane_dots(acc_u, wu, su, xp + 3 * KW, xm, KW, X_F32, _M3, _S3, PAIR)
    ts = tl.load(ts_ptr + ex) * _UNSHIFT
    g = acc_g * ts
    u = acc_u * ts
    a = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up
    col = (n % 8) * (F // 8) + n // 8  # plane-major: down's operand
    tl.store(act_ptr + pair.to(tl.int64)[None, :] * F + col[:, None], a.to(tl.bfloat16), mask=pv[None, :])


@triton.jit(do_not_specialize=["n_pairs"])
def _moe_down_kernel(act_ptr, sorted_ptr, bexp_ptr, nblk_ptr, codes_ptr, scales_ptr, ts_ptr, y_ptr, n_pairs, N, K,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PAIR: tl.constexpr):
    pid_m = tl.program_id(1)  # the expert block (axis 1: the live blocks launch before the padding's)
    if pid_m >= tl.load(nblk_ptr):
        return
    pid_n = tl.program_id(0)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    m = tl.arange(0, BM)
    pair = tl.load(sorted_ptr + pid_m * BM + m)
    pv = pair < n_pairs
    pr = tl.where(pv, pair, 0).to(tl.int64)
    BKW: tl.constexpr = BK // 8
    KW = K // 8
    n = pid_n * BN + tl.arange(0, BN)
    wi = tl.arange(0, BKW)
    si = tl.arange(0, BKW // 2)
    rows = (ex * N + n).to(tl.int64)
    c_w = codes_ptr + rows[:, None] * KW + wi[None, :]
    c_s = scales_ptr + rows[:, None] * (K // 16) + si[None, :]
    x_p = act_ptr + pr[None, :] * K + _x_rows(KW, BKW, PAIR)[:, None]
    xm = pv[None, :]
    acc = tl.zeros([BN, BM], tl.float32)
    for kw0 in range(0, KW, BKW):
        w = tl.load(c_w + kw0)
        s = _scales(c_s + kw0 // 2, BN, BKW)
        xp = x_p + kw0
        acc = _plane_dots(acc, w, s, xp, xm, KW, False, _M0, _S0, PAIR)
        acc = _plane_dots(acc, w, s, xp + KW, xm, KW, False, _M1, _S1, PAIR)
        acc = _plane_dots(acc, w, s, xp + 2 * KW, xm, KW, False, _M2, _S2, PAIR)
        acc = _plane_dots(acc, w, s, xp + 3 * KW, xm, KW, False, _M3, _S3, PAIR)
    y = acc * (tl.load(ts_ptr + ex) * _UNSHIFT)
    tl.store(y_ptr + pr[None, :] * N + n[:, None], y.to(tl.bfloat16), mask=pv[None, :])


def _words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K/2] storage-word codes -> int32 [E, N, K/8] (the same bytes)."""
    return codes.view(torch.int32)


def moe_up(x, x_stride: int, x_off: int, x_f32: bool, sorted_ids, block_expert, n_blocks, codes, scales, tscale,
           act, n_pairs: int, top_k: int, cfg: MoeConfig) -> None:
    """Gate/up of the routed experts: act [pairs, F] bf16 (plane-major) for every routed pair.
    x: activations plane-major, row t of token t at x_off + t * x_stride (fp32 rounded to bf16
    when x_f32, as the reference rounds `pooled`); codes uint8 [E, 2F, K/2] storage words,
    scales uint8 [E, 2F, K/16], tscale fp32 [E]."""
    e, n2, kh = codes.shape
    f, k = n2 // 2, 2 * kh
    cfg.validate(f, k)
    _launch(_moe_up_kernel, (f // cfg.block_n, block_expert.numel()), x, x_stride, x_off, sorted_ids, block_expert,
            n_blocks, _words(codes), scales, tscale, act, n_pairs, f, k, TOPK=top_k, X_F32=x_f32, BM=BLOCK_M,
            BN=cfg.block_n, BK=cfg.block_k, PAIR=cfg.pair_dots(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def moe_down(act, sorted_ids, block_expert, n_blocks, codes, scales, tscale, y, n_pairs: int, cfg: MoeConfig) -> None:
    """Down projection: y [pairs, N] bf16 = bf16(act[pair] @ W2[expert].T * tensor scale)."""
    e, n, kh = codes.shape
    k = 2 * kh
    cfg.validate(n, k)
    _launch(_moe_down_kernel, (n // cfg.block_n, block_expert.numel()), act, sorted_ids, block_expert, n_blocks,
            _words(codes), scales, tscale, y, n_pairs, n, k, BM=BLOCK_M, BN=cfg.block_n, BK=cfg.block_k,
            PAIR=cfg.pair_dots(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, z_ptr, N, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nm = n < N
    z = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(K):  # rank order, as the reference sums
        wr = tl.load(w_ptr + t * K + r)
        z = z + wr * tl.load(y_ptr + (t * K + r).to(tl.int64) * N + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(z_ptr + t * N + n, z.to(tl.bfloat16), mask=nm)


def moe_combine(y, w, z, top_k: int) -> None:
    t, n = z.shape
    block = min(1024, _p2(n))
    _launch(_moe_combine_kernel, (t, -(-n // block)), y, w, z, n, K=top_k, BLOCK=block, num_warps=4)


# ---------------------------------------------------------------------- compile-only checks (no GPU)
_MOE_SIGNATURES = {
    "up": {"x_ptr": "*fp32", "x_stride": "i32", "x_off": "i32", "sorted_ptr": "*i32", "bexp_ptr": "*i32",
           "nblk_ptr": "*i32", "codes_ptr": "*i32", "scales_ptr": "*u8", "ts_ptr": "*fp32", "act_ptr": "*bf16",
           "n_pairs": "i32", "F": "i32", "K": "i32"},
    "down": {"act_ptr": "*bf16", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "nblk_ptr": "*i32", "codes_ptr": "*i32",
             "scales_ptr": "*u8", "ts_ptr": "*fp32", "y_ptr": "*bf16", "n_pairs": "i32", "N": "i32", "K": "i32"},
}


def moe_compile_args(kind: str, cfg: MoeConfig, top_k: int = 8) -> tuple:
    """(kernel, signature, constexprs, aligned) of moe_up ("up") or moe_down ("down") at `cfg`, as
    moe_up / moe_down launch it, for compile_sm90 / compile_sm90_ir."""
    sig = _MOE_SIGNATURES[kind]
    ce = {"BM": BLOCK_M, "BN": cfg.block_n, "BK": cfg.block_k, "PAIR": cfg.pair_dots()}
    if kind == "up":
        ce = {"TOPK": top_k, "X_F32": True, **ce}
    aligned = tuple(a for a in sig if a.endswith("_ptr") or a in ("x_stride", "F", "N", "K"))
    return (_moe_up_kernel if kind == "up" else _moe_down_kernel), sig, ce, aligned


def compile_sm90_ir(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                    aligned: tuple[str, ...] = ()):
    """Triton's compiled kernel for sm_90a, no GPU needed (its .asm holds ttir / ttgir / ptx).
    `aligned`: argument names assumed 16-byte aligned / divisible by 16, as the JIT specialises
    real launches."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                    constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                        "num_stages": num_stages})


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                 aligned: tuple[str, ...] = ()) -> dict:
    """Compile `kernel` for sm_90a without a GPU (Triton's own ptxas) and report the machine code:
    registers, spill bytes, shared memory, wgmma use (compile_sm90_ir's arguments)."""
    c = compile_sm90_ir(kernel, signature, constexprs, num_warps, num_stages, aligned)
    ptx = c.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        arch = re.search(r"\.target\s+(\S+)", ptx).group(1)
        r = subprocess.run([get_ptxas(90).path, f"-arch={arch}", "-v", p, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    st = re.search(r"(\d+) bytes spill stores", log)
    ld = re.search(r"(\d+) bytes spill loads", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(st.group(1)) if st else 0, "spill_load_bytes": int(ld.group(1)) if ld else 0,
            "shared_bytes": int(c.metadata.shared), "wgmma": "wgmma" in ptx, "mma": "mma.sync" in ptx,
            "ftz": ".ftz" in ptx, "ptxas": log.strip().splitlines()[-3:]}
