"""The model family: a frozen config with named presets. No dimension is hard-coded elsewhere.

Muse-Spark-like decoder (the study's model): RMSNorm, GQA attention with RoPE, each layer
sliding-window (window W) or global, an MoE block per layer with a bf16 router choosing top-k of
E experts, a pooler (d -> p) before the experts and an unpooler (p -> d) after, expert FFNs in
NVFP4 (gate/up: p -> 2f, SiLU-gated; down: f -> p), bf16 elsewhere, final norm and LM head.

Every dimension the study does not state is an assumption, written in `assumptions` with its
reason. `validate()` refuses impossible configs with a message naming the problem.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from microbench.errors import MegabenchError


class ConfigError(MegabenchError, ValueError):
    """A model config or decode request that cannot work."""


NVFP4_BLOCK = 16  # NVFP4: one FP8 E4M3 scale per 16 E2M1 values along K


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab: int
    d_model: int
    n_layers: int
    global_layers: tuple[int, ...]  # indices of global-attention layers; the rest are sliding
    window: int  # sliding-window length W (tokens a query may look back, itself included)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    d_pool: int  # p: pooler output width (expert input/output width)
    d_expert: int  # f: expert intermediate width (gate and up each f wide)
    max_context: int  # positions a global layer's cache holds (prefix + tree)
    max_tree: int = 16  # T_max: tokens verified in one step (the study's 16)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    backbone: float = 1.0  # strength of the predictable successor structure (weights.py)
    residual_scale: float = 0.25  # scale of each block's contribution to the residual stream
    assumptions: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    # ---------------------------------------------------------------- derived sizes
    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def attn_width(self) -> int:
        return self.n_heads * self.head_dim

    def is_global(self, layer: int) -> bool:
        return layer in self.global_layers

    @property
    def ring_slots(self) -> int:
        """Sliding layers keep a ring of W + T_max slots: the tree's T new keys are written
        before they are accepted, so the ring must hold the window of the shallowest tree
        token (W - 1 older keys) plus all T new ones without overwriting either."""
        return self.window + self.max_tree

    def cache_slots(self, layer: int) -> int:
        return self.max_context if self.is_global(layer) else self.ring_slots

    @property
    def expert_params(self) -> int:
        return 3 * self.d_pool * self.d_expert

    @property
    def expert_bytes(self) -> int:
        """NVFP4 bytes of one expert: 4-bit codes + one E4M3 byte per 16 values (+ 2 fp32 scales)."""
        n = self.expert_params
        return n // 2 + n // NVFP4_BLOCK + 8

    def max_distinct_experts(self, n_tokens: int) -> int:
        """The most experts a step of n_tokens tokens can route to (each token picks top_k)."""
        return min(self.n_experts, n_tokens * self.top_k)

    def dense_layer_bytes(self) -> int:
        """bf16 weights of one layer outside the experts (norms, qkv, o, router, pooler, unpooler)."""
        d = self.d_model
        n = 2 * d + self.qkv_rows * d + d * self.attn_width + self.n_experts * d + 2 * self.d_pool * d
        return 2 * n

    def validate(self) -> ModelConfig:
        def bad(msg):
            raise ConfigError(f"model config {self.name!r}: {msg}")

        for f in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts", "top_k",
                  "d_pool", "d_expert", "max_context", "max_tree"):
            if getattr(self, f) <= 0:
                bad(f"{f} must be positive, got {getattr(self, f)}")
        if self.window <= 0:
            bad(f"window must be positive, got {self.window}")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            bad(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.top_k > self.n_experts:
            bad(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        for f in ("d_model", "d_pool", "d_expert", "head_dim", "attn_width"):
            v = getattr(self, f)
            if v % 64:
                bad(f"{f}={v} must be a multiple of 64 (NVFP4 scale blocks of 16; tensor-core k-steps)")
        if self.vocab % 64:
            bad(f"vocab={self.vocab} must be a multiple of 64 (LM-head tiles)")
        if any(not 0 <= g < self.n_layers for g in self.global_layers):
            bad(f"global_layers {self.global_layers} outside 0..{self.n_layers - 1}")
        if len(set(self.global_layers)) != len(self.global_layers):
            bad("global_layers has duplicates")
        if self.max_tree > self.max_context:
            bad(f"max_tree={self.max_tree} exceeds max_context={self.max_context}")
        if self.max_tree > 16:
            bad(f"max_tree={self.max_tree}: the kernels verify at most 16 tokens per step (one mma M tile)")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 1:
            bad("rope_theta must be a finite number > 1")
        return self

    def check_step(self, ctx: int, n_tokens: int) -> None:
        """Refuse a decode step that does not fit the caches."""
        if n_tokens < 1 or n_tokens > self.max_tree:
            raise ConfigError(f"{self.name}: {n_tokens} tokens per step; this config verifies 1..{self.max_tree}")
        if ctx < 0:
            raise ConfigError(f"{self.name}: negative context {ctx}")
        if ctx + n_tokens > self.max_context:
            raise ConfigError(f"{self.name}: context {ctx} + {n_tokens} tree tokens exceeds the cache "
                              f"(max_context={self.max_context})")

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw).validate()

    def describe(self) -> str:
        return (f"{self.name}: {self.n_layers} layers ({len(self.global_layers)} global, window {self.window}), "
                f"d={self.d_model}, heads {self.n_heads}/{self.n_kv_heads}x{self.head_dim}, experts {self.top_k}/"
                f"{self.n_experts} (p={self.d_pool}, f={self.d_expert}, {self.expert_bytes / 1e6:.2f} MB NVFP4 each), "
                f"vocab {self.vocab}")


def spread_globals(n_layers: int, n_global: int) -> tuple[int, ...]:
    """Evenly spaced global layers (the study gives counts, 16 of 62, not positions)."""
    if n_global == 0:
        return ()
    return tuple(sorted({min(n_layers - 1, int((k + 1) * n_layers / n_global) - 1) for k in range(n_global)}))


_COMMON = (
    ("global layer positions", "evenly spaced; the study states only counts (16 global of 62)"),
    ("RoPE", "interleaved pairs (2i, 2i+1), theta 10000: not stated; interleaving keeps pairs inside any "
             "even-row tile of the qkv projection"),
    ("attention scale", "1/sqrt(head_dim)"),
    ("weights", "random from a seed (real weights unavailable), with a predictable successor backbone in the "
                "embedding / LM head so speculative acceptance is measurable (weights.py)"),
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab=512, d_model=128, n_layers=3, global_layers=(2,), window=16, n_heads=4, n_kv_heads=2,
        head_dim=64, n_experts=8, top_k=2, d_pool=64, d_expert=64, max_context=128,
        assumptions=_COMMON + (("size", "smallest config the kernels accept: the whole CPU suite runs in seconds"),),
    ),
    "tinytp": ModelConfig(
        name="tinytp", vocab=512, d_model=128, n_layers=3, global_layers=(2,), window=16, n_heads=16, n_kv_heads=8,
        head_dim=64, n_experts=8, top_k=2, d_pool=128, d_expert=128, max_context=128,
        assumptions=_COMMON + (("size", "tiny's vocabulary, width and depth, with heads and expert widths that shard "
                                        "over up to 8 tensor-parallel ranks (one kv head, 16 gate/up rows and 16 "
                                        "down-projection rows each at 8): the CPU suite's TP model"),),
    ),
    "small": ModelConfig(
        name="small", vocab=32768, d_model=2048, n_layers=12, global_layers=spread_globals(12, 3), window=1024,
        n_heads=16, n_kv_heads=4, head_dim=128, n_experts=64, top_k=8, d_pool=1024, d_expert=1024,
        max_context=8192,
        assumptions=_COMMON + (
            ("size", "H200 dev loop: ~0.66 GB of weights touched per T=1 step and ~1.3 GB per T=16 step, "
                     ">= 4x the 60 MiB L2 so the step streams from HBM like the real model"),),
    ),
    "shard8": ModelConfig(
        name="shard8", vocab=19008, d_model=4096, n_layers=62, global_layers=spread_globals(62, 16), window=2048,
        n_heads=8, n_kv_heads=1, head_dim=128, n_experts=256, top_k=8, d_pool=2048, d_expert=1024,
        max_context=16384,
        assumptions=_COMMON + (
            ("what it is", "one GPU's share at tensor-parallel 8 of a full 62-layer, 256-expert model, run as a "
                           "self-consistent model on one GPU (collectives are the multi-GPU issue's)"),
            ("layers", "62 decoder layers, 46 sliding (window 2,048) + 16 global: stated by the study"),
            ("experts", "top-8 of 256: stated. Full expert p=2048, f=8192 in NVFP4 = 28.3 MB; both MoE GEMMs "
                        "sharded on N over 8 GPUs gives this GPU gate/up rows f/8=1024 each and down rows "
                        "p/8=256 x f: modelled as p=2048 -> 2x1024 -> 2048 per expert, 3.54 MB, the same bytes; "
                        "14 experts = 49.6 MB, matching the study's ~50 MB for 14 hot experts' slices per GPU"),
            ("attention", "64 query / 8 KV heads of 128 in the full model (assumed): 8 / 1 per GPU"),
            ("d_model", "4,096 (assumed); the pooler halves it to p=2,048 (assumed ratio)"),
            ("vocab", "152,064 (assumed) sharded 8 ways: 19,008 rows of the LM head per GPU"),
            ("max_context", "16,384 positions per global-layer cache (assumed; the study's GSM8K prompts are short)"),
        ),
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name].validate()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; have {sorted(PRESETS)}") from None
