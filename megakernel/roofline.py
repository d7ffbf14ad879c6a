"""The bytes one decode/verify step must move, and the time that takes at the measured read ceiling.

What a step must touch (each counted once, as if nothing stayed in L2 between steps):
  dense      bf16 weights of every layer outside the experts: two norm gains, qkv, o, router,
             pooler, unpooler (ModelConfig.dense_layer_bytes)
  experts    NVFP4 bytes (codes + E4M3 block scales + the two fp32 tensor scales) of the experts
             the step routes to, counted once per layer however many tree tokens use them: the
             union over the tree (the study's "49 distinct experts per layer")
  kv_read    per layer, K and V rows read: global layers the whole prefix plus the T new rows
             (ctx + T); sliding layers the union of the tree tokens' windows, i.e. the
             min(ctx, W - 1) cached rows the root can see plus the T new rows (<= W rows for T = 1)
  kv_write   T new K and V rows per layer
  lm_head    the LM head and the final norm gain
  embed      T embedding rows
A batch of B requests (batch_step_bytes) moves the dense weights and the LM head once, the union of
the experts every row of the batch routes to (per layer), each request's own KV reads (its
context, its tree) and writes, and an embedding row per token row: what B separate steps would
read B times, a batched step reads once, except each request's KV.
Ignored (< 0.01% at every preset): RoPE table rows, routing metadata, activations that a fused
kernel keeps on chip. Activations that torch materialises (the baselines' dequantised expert
weights, intermediate tensors) are deliberately NOT counted: the roofline is the floor for any
implementation, and the gap to it is what the baselines lose.

Read ceiling: the `read_ceiling_bytes_per_s` constant of `weights.read_ceiling` when a result
exists for this GPU, else the D2D memcpy bandwidth of `basics.copy` (bytes read + written per
second: a copy's combined rate, used as a proxy for the read ceiling and labelled as such), else
the conservative default in microbench.constants, labelled DEFAULT. `Roofline.source` says which.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from microbench.constants import BY_NAME
from microbench.results import REPO_ROOT, latest, results_root

from .config import ConfigError, ModelConfig


@dataclass(frozen=True)
class StepBytes:
    dense: int
    experts: int
    kv_read: int
    kv_write: int
    lm_head: int
    embed: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.kv_read + self.kv_write + self.lm_head + self.embed

    def as_dict(self) -> dict[str, int]:
        return {"dense": self.dense, "experts": self.experts, "kv_read": self.kv_read, "kv_write": self.kv_write,
                "lm_head": self.lm_head, "embed": self.embed, "total": self.total}


@dataclass(frozen=True)
class Roofline:
    bytes: StepBytes
    read_ceiling: float  # B/s
    source: str  # where read_ceiling came from

    @property
    def seconds(self) -> float:
        return self.bytes.total / self.read_ceiling


def kv_row_bytes(cfg: ModelConfig) -> int:
    """Bytes of one sequence position's K and V in one layer (bf16)."""
    return 2 * cfg.n_kv_heads * cfg.head_dim * 2


def kv_rows_read(cfg: ModelConfig, layer: int, n_tokens: int, ctx: int) -> int:
    if cfg.is_global(layer):
        return ctx + n_tokens
    return min(ctx, cfg.window - 1) + n_tokens


def step_bytes(cfg: ModelConfig, n_tokens: int, ctx: int, distinct_per_layer: Sequence[int] | int) -> StepBytes:
    """Bytes a step over `n_tokens` tree tokens at context `ctx` must move, given how many distinct
    experts each layer routes to (one int for every layer, or one per layer)."""
    return batch_step_bytes(cfg, [(n_tokens, ctx)], distinct_per_layer)


def batch_step_bytes(cfg: ModelConfig, requests: Sequence[tuple[int, int]],
                     distinct_per_layer: Sequence[int] | int) -> StepBytes:
    """Bytes a step of B requests, (tree tokens, context) each, must move, given how many distinct
    experts each layer routes to over all of the step's rows (the union; one int for every layer,
    or one per layer)."""
    if not requests:
        raise ConfigError(f"{cfg.name}: a step needs at least one request")
    for t, c in requests:
        cfg.check_step(c, t)
    # any row count: the megakernel's 16-row step is refused where it is built (batch.mix,
    # abi.pack_step); the peer's batched steps take more
    n_tokens = sum(t for t, _ in requests)
    if isinstance(distinct_per_layer, int):
        distinct = [distinct_per_layer] * cfg.n_layers
    else:
        distinct = [int(x) for x in distinct_per_layer]
    if len(distinct) != cfg.n_layers:
        raise ConfigError(f"{cfg.name}: distinct experts given for {len(distinct)} layers, model has {cfg.n_layers}")
    hi = min(cfg.n_experts, n_tokens * cfg.top_k)
    for l, d in enumerate(distinct):
        if not cfg.top_k <= d <= hi:
            raise ConfigError(f"{cfg.name}: layer {l} routes to {d} distinct experts; {n_tokens} tokens x top-"
                              f"{cfg.top_k} of {cfg.n_experts} allow {cfg.top_k}..{hi}")
    row = kv_row_bytes(cfg)
    return StepBytes(
        dense=cfg.n_layers * cfg.dense_layer_bytes(),
        experts=sum(distinct) * cfg.expert_bytes,
        kv_read=sum(kv_rows_read(cfg, l, t, c) for l in range(cfg.n_layers) for t, c in requests) * row,
        kv_write=cfg.n_layers * n_tokens * row,
        lm_head=2 * cfg.vocab * cfg.d_model + 2 * cfg.d_model,
        embed=2 * n_tokens * cfg.d_model,
    )


def _result_roots(roots: Sequence[Path] | None) -> list[Path]:
    if roots is not None:
        return [Path(r) for r in roots]
    out = [results_root()]
    committed = REPO_ROOT / "reports" / "results"
    if committed.resolve() != out[0].resolve():
        out.append(committed)  # tests point MEGABENCH_RESULTS elsewhere; the committed H200 runs still count
    return out


def read_ceiling(gpu: str | None = None, roots: Sequence[Path] | None = None) -> tuple[float, str]:
    """(bytes/s, source) of the best available read-bandwidth measurement for `gpu` (any GPU when
    None), searching `roots` (default: the results folder and the committed reports/results)."""
    def pick(bench: str):
        best = None
        for root in _result_roots(roots):
            if not root.exists():
                continue
            r = latest(bench, root=root, gpu=gpu)
            if r is not None and (best is None or r.env.date > best.env.date):
                best = r
        return best

    spec = BY_NAME["read_ceiling_bytes_per_s"]
    r = pick(spec.benchmark)
    if r is not None and spec.derived_key in r.derived:
        d = r.derived[spec.derived_key]
        return d.value, f"{spec.benchmark} {spec.derived_key} measured {r.env.date} on {r.env.gpu}"
    r = pick("basics.copy")
    if r is not None and "memcpy_bandwidth" in r.derived:
        d = r.derived["memcpy_bandwidth"]
        return d.value, (f"basics.copy memcpy_bandwidth measured {r.env.date} on {r.env.gpu} (D2D copy, bytes read + "
                         f"written per second: a proxy, {spec.benchmark} not measured yet)")
    return spec.default, f"DEFAULT {spec.default:.3g} B/s from microbench.constants (no measurement found)"


def roofline(cfg: ModelConfig, n_tokens: int, ctx: int, distinct_per_layer: Sequence[int] | int,
             ceiling: tuple[float, str] | None = None, gpu: str | None = None) -> Roofline:
    return batch_roofline(cfg, [(n_tokens, ctx)], distinct_per_layer, ceiling, gpu)


def batch_roofline(cfg: ModelConfig, requests: Sequence[tuple[int, int]], distinct_per_layer: Sequence[int] | int,
                   ceiling: tuple[float, str] | None = None, gpu: str | None = None) -> Roofline:
    """The roofline of a step of B requests, (tree tokens, context) each (batch_step_bytes)."""
    value, source = ceiling if ceiling is not None else read_ceiling(gpu)
    if not value > 0:
        raise ConfigError(f"read ceiling must be positive, got {value} ({source})")
    return Roofline(batch_step_bytes(cfg, requests, distinct_per_layer), float(value), source)
