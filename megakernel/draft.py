"""A stand-in for the study's drafter (DFlash V2: guesses the next 15 tokens in ONE pass, 5 draft
layers; PAPER.md "The model"). Its real architecture and weights are not available.

What the stand-in is (assumptions, each with its reason):
- One forward pass over `n_slots` = 15 query slots, `n_layers` = 5 bf16 decoder layers (dense
  GQA attention with RoPE, causal among the slots; SiLU-gated MLP): the study's shape.
- It shares the target's embedding, final norm and LM head (drafters of this family read the
  target's vocabulary projections), and has its own random weights (seeded from the target's seed).
- It knows the target's successor backbone (`ModelWeights.succ`), as a trained drafter would
  learn the target's dominant transitions: slot j is seeded with the embedding of succ^j(root)
  (15 table look-ups, no model evaluation), so slot j's top-1 tends to be succ^(j+1)(root), the
  token at depth j+1. Its 5 random layers perturb the slots with strength `mix`, so it is often,
  not always, right; what it cannot know is the target's context-dependent deviation from the
  backbone, which is where real drafters fail too.
- It does not read the target's KV cache or hidden states (DFlash conditions on target
  features; the stand-in conditions on the root token and its position only).
- Alternatives for a tree: the top-2 tokens of every slot.
Acceptance measured with this stand-in depends on these assumptions (and on the synthetic
target's `backbone` strength): it exercises the speculative machinery; it is not a prediction
of the study's 6.6.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .config import ConfigError
from .reference import rmsnorm, rope
from .weights import BF16, ModelWeights, _gain, _randn

STUDY_DRAFT_TOKENS = 15  # PAPER.md: DFlash V2 guesses the next 15 tokens in a single pass
STUDY_DRAFT_LAYERS = 5  # PAPER.md: 5 draft layers


@dataclass(frozen=True)
class DraftConfig:
    n_layers: int = STUDY_DRAFT_LAYERS
    n_slots: int = STUDY_DRAFT_TOKENS
    ffn_mult: int = 2  # MLP width = ffn_mult * d_model (assumed)
    mix: float | None = None  # residual scale of each draft block; None: the target's residual_scale
    seed_offset: int = 7919  # draft weights use the target seed + this (independent of the target's draws)
    assumptions: tuple[tuple[str, str], ...] = field(default=(
        ("shape", "15 slots, 5 layers, one pass: the study's DFlash V2 figures"),
        ("MLP width", "2 x d_model, SiLU-gated (not stated)"),
        ("inputs", "slot j seeded with embed[succ^j(root)]: the drafter knows the target's backbone"),
        ("shared", "embedding, final norm and LM head are the target's"),
    ), compare=False)

    def validate(self) -> DraftConfig:
        if self.n_layers < 1 or self.n_slots < 1 or self.ffn_mult < 1:
            raise ConfigError(f"draft config needs n_layers, n_slots, ffn_mult >= 1, got {self}")
        if self.mix is not None and not (math.isfinite(self.mix) and self.mix >= 0):
            raise ConfigError(f"draft mix must be a finite number >= 0, got {self.mix}")
        return self


@dataclass
class DraftLayer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 F, d]: rows 0..F-1 gate, F..2F-1 up
    w_down: torch.Tensor  # [d, F]


class DraftModel:
    """`propose(history, ctx)` -> long [n_slots, 2]: row j holds the top-1 and top-2 guesses for
    the token at depth j+1 below the root (history[-1]). Each call is one forward pass
    (`self.passes` counts them)."""

    def __init__(self, target: ModelWeights, dcfg: DraftConfig | None = None):
        self.dcfg = (dcfg or DraftConfig()).validate()
        self.target = target
        cfg = target.cfg
        self.cfg = cfg
        dev = target.device
        g = torch.Generator(device=dev)
        g.manual_seed(cfg.seed + self.dcfg.seed_offset)
        mix = cfg.residual_scale if self.dcfg.mix is None else self.dcfg.mix
        self.mix = mix
        d, ff = cfg.d_model, self.dcfg.ffn_mult * cfg.d_model
        self.layers = [DraftLayer(
            attn_norm=_gain(d, g, dev),
            wqkv=_randn((cfg.qkv_rows, d), 1 / math.sqrt(d), g, dev),
            wo=_randn((d, cfg.attn_width), mix / math.sqrt(cfg.attn_width), g, dev),
            ffn_norm=_gain(d, g, dev),
            w_gate_up=_randn((2 * ff, d), 1 / math.sqrt(d), g, dev),
            w_down=_randn((d, ff), mix / math.sqrt(ff), g, dev),
        ) for _ in range(self.dcfg.n_layers)]
        self.passes = 0

    @property
    def n_slots(self) -> int:
        return self.dcfg.n_slots

    def seeds(self, root: int) -> torch.Tensor:
        """succ^j(root) for j = 0..n_slots-1 (long [n_slots])."""
        out = [torch.as_tensor(int(root), device=self.target.device)]
        for _ in range(self.n_slots - 1):
            out.append(self.target.succ[out[-1]])
        return torch.stack(out)

    def forward(self, root: int, ctx: int) -> torch.Tensor:
        """Logits [n_slots, V] fp32 of one pass. Slot j sits at position ctx + j (clamped to the RoPE
        table), attends causally to slots 0..j."""
        cfg, w = self.cfg, self.target
        if not 0 <= int(root) < cfg.vocab:
            raise ConfigError(f"draft root token {root} outside the vocabulary 0..{cfg.vocab - 1}")
        self.passes += 1
        s = self.n_slots
        dev = w.device
        pos = (torch.arange(s, device=dev) + int(ctx)).clamp(max=cfg.max_context - 1)
        cos, sin = w.rope_cos[pos], w.rope_sin[pos]
        x = w.embed[self.seeds(root)].float()
        hq, hk, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
        for lw in self.layers:
            h = rmsnorm(x, lw.attn_norm, cfg.rms_eps)
            qkv = h.float() @ lw.wqkv.float().T
            q = rope(qkv[:, :hq * hd].reshape(s, hq, hd), cos, sin).to(BF16)
            k = rope(qkv[:, hq * hd:(hq + hk) * hd].reshape(s, hk, hd), cos, sin).to(BF16)
            v = qkv[:, (hq + hk) * hd:].reshape(s, hk, hd).to(BF16)
            qf = q.float().reshape(s, hk, cfg.group, hd)
            sc = torch.einsum("tkjd,nkd->tkjn", qf, k.float()) * hd ** -0.5
            sc = sc.masked_fill(~causal[:, None, None, :], float("-inf"))
            o = torch.einsum("tkjn,nkd->tkjd", torch.softmax(sc, dim=-1), v.float()).reshape(s, cfg.attn_width)
            x = x + o.to(BF16).float() @ lw.wo.float().T
            h2 = rmsnorm(x, lw.ffn_norm, cfg.rms_eps)
            gu = h2.float() @ lw.w_gate_up.float().T
            ff = gu.shape[1] // 2
            a = (torch.nn.functional.silu(gu[:, :ff]) * gu[:, ff:]).to(BF16)
            x = x + a.float() @ lw.w_down.float().T
        hf = rmsnorm(x, w.final_norm, cfg.rms_eps)
        return hf.float() @ w.lm_head.float().T

    def propose(self, history: Sequence[int], ctx: int) -> torch.Tensor:
        """Top-2 guesses per slot for the tokens after history[-1] (the tree's root), one pass."""
        if len(history) == 0:
            raise ConfigError("the drafter needs at least one token of history (the root)")
        logits = self.forward(int(history[-1]), ctx)
        # top-2 by (logit desc, index asc), as the target's argmax breaks ties
        return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :2].cpu()


def weight_bytes(model: DraftModel) -> int:
    """bf16 bytes of the draft layers (the shared embedding / LM head not included)."""
    return sum(t.numel() * t.element_size() for lw in model.layers for t in vars(lw).values())


def describe(model: DraftModel) -> str:
    c = model.dcfg
    return (f"draft stand-in: {c.n_layers} layers x d={model.cfg.d_model} (MLP {c.ffn_mult}x), {c.n_slots} slots per "
            f"pass, mix {model.mix}, {weight_bytes(model) / 1e6:.1f} MB own weights")

