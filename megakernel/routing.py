"""Synthetic routing: a fixed number of distinct experts per layer per step.

The study profiled with the routing it measured on GSM8K (49 distinct experts per layer per
step at 16 tokens x top-8 of 256) replayed synthetically, so timings are reproducible. Here:
per layer, draw `distinct` experts at random, then give token t the experts at positions
(t*k + j) mod distinct of that draw, j = 0..k-1 — every drawn expert is used (T*k >= distinct),
each token's k experts are different (k <= distinct), and the union is exactly `distinct`.
"""
from __future__ import annotations

import torch

from .config import ConfigError, ModelConfig


def synthetic_routes(cfg: ModelConfig, n_tokens: int, distinct: int, generator: torch.Generator,
                     device="cpu") -> list[torch.Tensor]:
    k, e = cfg.top_k, cfg.n_experts
    if not k <= distinct <= min(e, n_tokens * k):
        raise ConfigError(f"{distinct} distinct experts impossible with {n_tokens} tokens x top-{k} of {e} "
                          f"(need {k} <= distinct <= {min(e, n_tokens * k)})")
    out = []
    for _ in range(cfg.n_layers):
        chosen = torch.randperm(e, generator=generator)[:distinct]
        idx = (torch.arange(n_tokens)[:, None] * k + torch.arange(k)[None, :]) % distinct
        out.append(chosen[idx].to(device))
    return out


def distinct_per_layer(routes: list[torch.Tensor]) -> list[int]:
    return [int(torch.unique(r).numel()) for r in routes]


def expert_streams_per_layer(routes: list[torch.Tensor], group_rows: list[int], union: bool) -> list[int]:
    """How many times a build streams routed experts' weights in each layer (a model, from the
    forced routing): one row group's step streams each distinct expert of its rows once, so row
    groups of these row counts stream the sum of their distinct experts; union slots
    (Plan.union_experts) stream an expert once per 16 of its tokens over every row. The roofline
    (roofline.batch_step_bytes) counts the distinct experts of all rows: one group's count."""
    out = []
    for r in routes:
        if union:
            cnt = torch.bincount(r.flatten().long().cpu())
            out.append(int(((cnt + 15) // 16).sum()))
            continue
        n, at = 0, 0
        for k in group_rows:
            n += int(torch.unique(r[at:at + k]).numel())
            at += k
        out.append(n)
    return out

