"""The drafter: a small model of the target's own family, so that the megakernel's source and
machinery run it unchanged (a model config of its own, rendered into its own build).

The study's drafter (DFlash V2) guesses the next 15 tokens in one pass with 5 layers; its
architecture and weights are not available. Ours, with each assumption and its reason:
- shape: `DraftConfig.n_layers` = 5 decoder layers of the target's attention shape and expert
  widths, with `n_experts` = 8 experts of which each token takes 2 (a far smaller expert set than
  the target's, so a pass moves a few percent of a verify step's bytes); every layer attends over
  its own 16-position cache, so a pass is one step of a chain of `n_slots` = 15 tokens at context
  0: the same kernel, one launch per draft layer;
- shared: the target's embedding, final norm and LM head, the same tensors (drafters of this
  family read the target's vocabulary projections);
- inputs: slot j holds s_j, where s_0 is the root (the target's last emitted token) and
  s_{j+1} = succ_d(s_j), succ_d being the drafter's successor table; the top-2 tokens of slot j's
  logits are its guesses for the token at depth j + 1 below the root;
- what it is conditioned on: the root token and its successor table, which agrees with the
  target's backbone (weights.py `succ`) on a fraction `agree` of the tokens. It does not read the
  target's hidden states or KV cache (DFlash conditions on target features). Where succ_d
  disagrees with the target, the drafter's guesses after that token are wrong, so `agree` is the
  knob that sets how often the synthetic target departs from what the drafter can guess.
Acceptance measured with this pair is a property of the synthetic pair, not a prediction of the
study's 6.6 on GSM8K.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import reference, tree
from .config import ConfigError, ModelConfig
from .weights import ModelWeights, disagreeing_successors, generate, weight_bytes as _all_bytes

STUDY_DRAFT_TOKENS = 15  # PAPER.md: DFlash V2 guesses the next 15 tokens in a single pass
STUDY_DRAFT_LAYERS = 5  # PAPER.md: 5 draft layers
DRAFT_CONTEXT = 16  # positions of a draft layer's cache: one pass of at most 16 slots at context 0


@dataclass(frozen=True)
class DraftConfig:
    n_layers: int = STUDY_DRAFT_LAYERS
    n_slots: int = STUDY_DRAFT_TOKENS
    n_experts: int = 8
    top_k: int = 2
    agree: float = 1.0  # fraction of tokens whose successor the drafter's table gets right
    mix: float | None = None  # residual scale of each draft block; None: the target's residual_scale
    seed_offset: int = 7919  # draft weights use the target seed + this (independent of the target's draws)
    assumptions: tuple[tuple[str, str], ...] = field(default=(
        ("shape", "15 slots, 5 layers, one pass: the study's DFlash V2 figures"),
        ("layers", "the target's attention shape and expert widths, 8 experts, top 2 (not stated)"),
        ("inputs", "slot j holds succ_d^j(root); succ_d agrees with the target's backbone on `agree` of the tokens"),
        ("shared", "embedding, final norm and LM head are the target's"),
    ), compare=False)

    def validate(self) -> DraftConfig:
        if self.n_layers < 1 or self.n_experts < 1 or self.top_k < 1:
            raise ConfigError(f"draft config needs n_layers, n_experts, top_k >= 1, got {self}")
        if not 1 <= self.n_slots < DRAFT_CONTEXT:
            raise ConfigError(f"draft n_slots {self.n_slots}: want 1..{DRAFT_CONTEXT - 1} (one pass over a "
                              f"{DRAFT_CONTEXT}-position cache)")
        if self.top_k > self.n_experts:
            raise ConfigError(f"draft top_k {self.top_k} exceeds its {self.n_experts} experts")
        if self.mix is not None and not (math.isfinite(self.mix) and self.mix >= 0):
            raise ConfigError(f"draft mix must be a finite number >= 0, got {self.mix}")
        if not (isinstance(self.agree, (int, float)) and math.isfinite(self.agree) and 0 <= self.agree <= 1):
            raise ConfigError(f"draft agree {self.agree!r}: want a fraction of tokens from 0 to 1")
        return self


def draft_model_config(target: ModelConfig, dcfg: DraftConfig | None = None) -> ModelConfig:
    """The drafter's model config: the target's vocabulary, width, attention shape and expert
    widths; its own layers, experts and a 16-position cache in every layer (all global)."""
    d = (dcfg or DraftConfig()).validate()
    n_exp = min(d.n_experts, target.n_experts)
    return ModelConfig(
        name=f"{target.name}-draft", vocab=target.vocab, d_model=target.d_model, n_layers=d.n_layers,
        global_layers=tuple(range(d.n_layers)), window=DRAFT_CONTEXT, n_heads=target.n_heads,
        n_kv_heads=target.n_kv_heads, head_dim=target.head_dim, n_experts=n_exp, top_k=min(d.top_k, n_exp),
        d_pool=target.d_pool, d_expert=target.d_expert, max_context=DRAFT_CONTEXT, max_tree=min(16, DRAFT_CONTEXT),
        rope_theta=target.rope_theta, rms_eps=target.rms_eps, seed=target.seed + d.seed_offset,
        backbone=target.backbone, residual_scale=target.residual_scale if d.mix is None else d.mix,
        assumptions=d.assumptions).validate()


def top2(logits: torch.Tensor) -> torch.Tensor:
    """long [n, 2]: the two largest logits of each row by (logit desc, index asc), the order the
    target's argmax breaks ties in (the kernel's top-2 gives the same pair)."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :2]


class DraftModel:
    """`propose(history, ctx)` -> long [n_slots, 2]: row j holds the top-1 and top-2 guesses for
    the token at depth j+1 below the root (history[-1]). Each call is one forward pass
    (`self.passes` counts them). `self.w` is the drafter's ModelWeights (its succ is succ_d), which
    the megakernel's Engine runs as it runs the target's."""

    def __init__(self, target: ModelWeights, dcfg: DraftConfig | None = None):
        self.dcfg = (dcfg or DraftConfig()).validate()
        self.target = target
        self.cfg = draft_model_config(target.cfg, self.dcfg)
        succ_d, self.n_disagree = disagreeing_successors(target.succ, self.dcfg.agree, self.cfg.seed)
        w = generate(self.cfg, target.device, share=target)
        w.succ = succ_d
        self.w = w
        self.passes = 0

    @property
    def n_slots(self) -> int:
        return self.dcfg.n_slots

    @property
    def agree(self) -> float:
        """The fraction of tokens whose successor the drafter's table gets right (exact)."""
        return 1.0 - self.n_disagree / self.cfg.vocab

    @property
    def layers(self):
        return self.w.layers

    def seeds(self, root: int) -> torch.Tensor:
        """s_j = succ_d^j(root) for j = 0..n_slots-1 (long [n_slots])."""
        if not 0 <= int(root) < self.cfg.vocab:
            raise ConfigError(f"draft root token {root} outside the vocabulary 0..{self.cfg.vocab - 1}")
        out = [torch.as_tensor(int(root), device=self.w.device)]
        for _ in range(self.n_slots - 1):
            out.append(self.w.succ[out[-1]])
        return torch.stack(out)

    def forward(self, root: int, acc: torch.dtype = torch.float32) -> torch.Tensor:
        """Logits [n_slots, V] fp32 of one pass: a chain of the seeds at context 0 through the
        drafter's layers, on a fresh cache (the pass's slots are all the keys it attends to)."""
        seeds = self.seeds(root)
        self.passes += 1
        cache = reference.KVCache(self.cfg, device=self.w.device)
        return reference.step(self.w, cache, seeds, tree.chain(self.n_slots), 0, acc=acc)

    def propose(self, history: Sequence[int], ctx: int) -> torch.Tensor:
        """Top-2 guesses per slot for the tokens after history[-1] (the tree's root), one pass.
        `ctx` is the target's context, which this drafter does not read."""
        if len(history) == 0:
            raise ConfigError("the drafter needs at least one token of history (the root)")
        return top2(self.forward(int(history[-1]))).cpu()


def weight_bytes(model: DraftModel) -> int:
    """Bytes of the drafter's own layers (the shared embedding / LM head not included)."""
    shared = model.w.embed.numel() * 2 + model.w.final_norm.numel() * 2 + model.w.lm_head.numel() * 2
    return _all_bytes(model.w) - shared


def describe(model: DraftModel) -> str:
    c, m = model.dcfg, model.cfg
    return (f"drafter: {c.n_layers} layers x d={m.d_model}, {m.top_k} of {m.n_experts} experts, {c.n_slots} slots "
            f"per pass, agree {model.agree:.3f}, {weight_bytes(model) / 1e6:.1f} MB own weights")
