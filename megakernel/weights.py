"""Model weights generated from a seed (the real model's weights are not available).

Scales keep every activation O(1) through any depth: projections have std 1/sqrt(fan_in), each
block adds `residual_scale` times an O(1) vector to the residual stream, norm gains are 1 +- 0.1.
Expert weights are drawn at the bit level in NVFP4 (random E2M1 codes, random E4M3 block scales,
a per-expert FP32 tensor scale), so every code and many scale values are exercised.

Predictable structure ("backbone"): a random successor permutation `succ` over the vocabulary,
built into the LM head (row v leans towards the embedding of succ^-1(v)), so that the model tends
to continue token t with succ(t) and a drafter that knows the backbone is often, not always,
right. `backbone` scales that pull; the layers' context-dependent contributions compete with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ConfigError, ModelConfig
from .fp4_layout import canonical_scales, from_kernel_words, to_kernel_words
from .nvfp4 import NVFP4Tensor, random_nvfp4

BF16 = torch.bfloat16


@dataclass
class ExpertBank:
    """All experts of one layer for one GEMM, stacked, in the megakernel's storage (fp4_layout):
    codes [E, N, K/2] in kernel words, scales [E, N, K/16] canonical (positive, nonzero). Build it
    with `from_natural`; `expert(e)` gives expert e back in nvfp4's natural layout."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor  # float32 [E]

    @classmethod
    def from_natural(cls, experts: list[NVFP4Tensor], device) -> "ExpertBank":
        """Stack natural-layout experts, converting one at a time (no whole-bank temporaries)."""
        codes, scales = [], []
        for t in experts:
            c, s = canonical_scales(t.codes, t.scales)
            codes.append(to_kernel_words(c))
            scales.append(s)
        ts = torch.tensor([t.tensor_scale for t in experts], dtype=torch.float32, device=device)
        return cls(torch.stack(codes), torch.stack(scales), ts)

    def expert(self, e: int) -> NVFP4Tensor:
        n, kh = self.codes.shape[1:]
        return NVFP4Tensor(from_kernel_words(self.codes[e]), self.scales[e], float(self.tensor_scale[e]), (n, 2 * kh))

    @property
    def nbytes_per_expert(self) -> int:
        return self.codes[0].numel() + self.scales[0].numel() + 4


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [d] bf16
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) hd, d] bf16; rows: q heads, then k heads, then v heads
    wo: torch.Tensor  # [d, Hq hd] bf16
    ffn_norm: torch.Tensor  # [d] bf16
    router: torch.Tensor  # [E, d] bf16
    pool: torch.Tensor  # [p, d] bf16
    w1: ExpertBank  # [E][2f, p]: rows 0..f-1 gate, f..2f-1 up
    w2: ExpertBank  # [E][p, f]
    unpool: torch.Tensor  # [d, p] bf16


@dataclass
class ModelWeights:
    cfg: ModelConfig
    embed: torch.Tensor  # [V, d] bf16
    final_norm: torch.Tensor  # [d] bf16
    lm_head: torch.Tensor  # [V, d] bf16
    layers: list[LayerWeights]
    rope_cos: torch.Tensor  # [max_context, hd/2] float32
    rope_sin: torch.Tensor
    succ: torch.Tensor  # [V] int64, the backbone's successor of each token

    @property
    def device(self) -> torch.device:
        return self.embed.device


def rope_tables(cfg: ModelConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of pos * theta^(-2i/hd) for every position: computed in float64, stored as float32,
    read by the reference and the kernels alike (no trig differences between them)."""
    half = cfg.head_dim // 2
    inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / cfg.head_dim)
    ang = torch.arange(cfg.max_context, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float().to(device), torch.sin(ang).float().to(device)


def _randn(shape, std, g, device):
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(BF16)


def _gain(n, g, device):
    return (1.0 + 0.1 * torch.randn(n, generator=g, device=device, dtype=torch.float32)).to(BF16)


def _bank(cfg: ModelConfig, n: int, k: int, std: float, g, device) -> ExpertBank:
    return ExpertBank.from_natural([random_nvfp4(n, k, std, g, device=device) for _ in range(cfg.n_experts)], device)


def generate(cfg: ModelConfig, device="cpu", seed: int | None = None,
             share: ModelWeights | None = None) -> ModelWeights:
    """Deterministic weights for `cfg` on `device` (the same seed on another device type draws
    different numbers: generators are per device type). `share`: another model's weights whose
    embedding, final norm, LM head and successor table this model uses as they are (the same
    tensors, not copies: a drafter reads the target's vocabulary projections); its vocabulary and
    width must be cfg's."""
    cfg.validate()
    device = torch.device(device)
    if share is not None and (share.cfg.vocab, share.cfg.d_model) != (cfg.vocab, cfg.d_model):
        raise ConfigError(f"{cfg.name} shares {share.cfg.name}'s embedding and LM head: vocab x d_model "
                          f"{cfg.vocab} x {cfg.d_model} != {share.cfg.vocab} x {share.cfg.d_model}")
    if share is not None and share.device != device:
        raise ConfigError(f"{cfg.name} shares {share.cfg.name}'s tensors: both must be on one device "
                          f"({device} != {share.device})")
    g = torch.Generator(device=device)
    g.manual_seed(cfg.seed if seed is None else seed)
    d, p, f, rs = cfg.d_model, cfg.d_pool, cfg.d_expert, cfg.residual_scale
    layers = []
    for _ in range(cfg.n_layers):
        layers.append(LayerWeights(
            attn_norm=_gain(d, g, device),
            wqkv=_randn((cfg.qkv_rows, d), 1 / math.sqrt(d), g, device),
            wo=_randn((d, cfg.attn_width), rs / math.sqrt(cfg.attn_width), g, device),
            ffn_norm=_gain(d, g, device),
            router=_randn((cfg.n_experts, d), 1 / math.sqrt(d), g, device),
            pool=_randn((p, d), 1 / math.sqrt(d), g, device),
            w1=_bank(cfg, 2 * f, p, 1 / math.sqrt(p), g, device),
            w2=_bank(cfg, p, f, 2 / math.sqrt(f), g, device),
            unpool=_randn((d, p), rs / math.sqrt(p), g, device),
        ))
    cos, sin = rope_tables(cfg, device)
    if share is not None:
        return ModelWeights(cfg, share.embed, share.final_norm, share.lm_head, layers, cos, sin, share.succ)
    embed = torch.randn((cfg.vocab, d), generator=g, device=device, dtype=torch.float32)
    succ = torch.randperm(cfg.vocab, generator=g, device=device)
    pred = torch.empty_like(succ)
    pred[succ] = torch.arange(cfg.vocab, device=device)
    noise = torch.randn((cfg.vocab, d), generator=g, device=device, dtype=torch.float32)
    lm_head = (cfg.backbone * embed[pred] + noise) / math.sqrt(d)
    return ModelWeights(cfg, embed.to(BF16), _gain(d, g, device), lm_head.to(BF16), layers, cos, sin, succ)


def disagreeing_successors(succ: torch.Tensor, agree: float, seed: int) -> tuple[torch.Tensor, int]:
    """A successor permutation equal to `succ` on a fraction `agree` of the tokens and different on
    the rest: (table, number of tokens where it differs). The tokens that differ, a seeded random
    set S, take each other's successors in a cycle (S[i] -> succ[S[i-1]]), so the table stays a
    permutation and no token of S keeps its own successor. |S| is (1 - agree) x vocab rounded to a
    count a cycle can derange (0 or at least 2)."""
    if not (isinstance(agree, (int, float)) and math.isfinite(agree) and 0.0 <= agree <= 1.0):
        raise ConfigError(f"agree {agree!r}: want a fraction of tokens from 0 to 1")
    n = succ.numel()
    k = int(round((1.0 - agree) * n))
    k = 0 if k < 1 else max(k, 2)
    out = succ.clone()
    if k:
        g = torch.Generator().manual_seed(seed)
        s = torch.randperm(n, generator=g)[:k].to(succ.device)
        out[s] = succ[s.roll(1)]
    return out, k


def weight_bytes(w: ModelWeights) -> int:
    """Bytes of every weight tensor (what must sit in device memory)."""
    n = w.embed.numel() * 2 + w.final_norm.numel() * 2 + w.lm_head.numel() * 2
    for lw in w.layers:
        for t in (lw.attn_norm, lw.wqkv, lw.wo, lw.ffn_norm, lw.router, lw.pool, lw.unpool):
            n += t.numel() * t.element_size()
        for b in (lw.w1, lw.w2):
            n += b.codes.numel() + b.scales.numel() + b.tensor_scale.numel() * 4
    return n


def _bank_rows(bank: ExpertBank, rows: list[slice]) -> ExpertBank:
    """The bank with only these rows of every expert (in this order)."""
    return ExpertBank(torch.cat([bank.codes[:, r] for r in rows], 1).contiguous(),
                      torch.cat([bank.scales[:, r] for r in rows], 1).contiguous(), bank.tensor_scale)


def _bank_experts(bank: ExpertBank, experts: list[int]) -> ExpertBank:
    """The bank with only these experts (in this order)."""
    idx = torch.tensor(experts, device=bank.codes.device)
    return ExpertBank(bank.codes[idx].contiguous(), bank.scales[idx].contiguous(), bank.tensor_scale[idx].contiguous())


def shard(w: ModelWeights, rank: int, ranks: int, expert_parallel: bool = False) -> ModelWeights:
    """Rank `rank`'s share of the weights at tensor parallelism `ranks` (the study's sharding;
    Plan.tp_ranks): wqkv holds the rows of its q heads, then of its k heads, then of its v heads
    (heads rank * H / R ..); wo the columns of its q heads (its K-share of the output projection);
    the expert banks, N-sharded, the gate rows rank * f / R .. and the matching up rows of w1
    (gate rows first, as the model's) and the rows rank * p / R .. of w2, of every expert; with
    `expert_parallel`, whole experts e = rank, rank + R, ... (both banks, their tensor scales too).
    Everything else is the model's own tensor (replicated: norms, router, pooler, unpooler,
    embedding, LM head). The config stays the model's: the shapes of a rank are the plan's
    (Plan.rcfg, Plan.expert_rows)."""
    c = w.cfg
    if not (isinstance(ranks, int) and ranks >= 1 and c.n_kv_heads % ranks == 0 and 0 <= rank < ranks):
        raise ConfigError(f"{c.name}: shard {rank} of {ranks}: want 0 <= rank < ranks and ranks dividing the "
                          f"{c.n_kv_heads} kv heads")
    if c.d_expert % ranks or c.d_pool % ranks or (expert_parallel and c.n_experts % ranks):
        raise ConfigError(f"{c.name}: {ranks} ranks do not divide d_expert {c.d_expert}, d_pool {c.d_pool}"
                          + (f" and {c.n_experts} experts" if expert_parallel else ""))
    f, fr, pr = c.d_expert, c.d_expert // ranks, c.d_pool // ranks
    mine = list(range(rank, c.n_experts, ranks))
    hd, hq, hkv = c.head_dim, c.n_heads // ranks, c.n_kv_heads // ranks

    def heads(first: int, n: int) -> slice:
        return slice(first * hd, (first + n) * hd)

    layers = []
    for lw in w.layers:
        q = lw.wqkv[heads(rank * hq, hq)]
        k = lw.wqkv[heads(c.n_heads + rank * hkv, hkv)]
        v = lw.wqkv[heads(c.n_heads + c.n_kv_heads + rank * hkv, hkv)]
        if expert_parallel:
            w1, w2 = _bank_experts(lw.w1, mine), _bank_experts(lw.w2, mine)
        else:
            w1 = _bank_rows(lw.w1, [slice(rank * fr, (rank + 1) * fr), slice(f + rank * fr, f + (rank + 1) * fr)])
            w2 = _bank_rows(lw.w2, [slice(rank * pr, (rank + 1) * pr)])
        layers.append(LayerWeights(lw.attn_norm, torch.cat([q, k, v]).contiguous(),
                                   lw.wo[:, heads(rank * hq, hq)].contiguous(), lw.ffn_norm, lw.router, lw.pool,
                                   w1, w2, lw.unpool))
    return ModelWeights(c, w.embed, w.final_norm, w.lm_head, layers, w.rope_cos, w.rope_sin, w.succ)
