"""What an FP8 tensor-core path for the expert GEMMs would cost in accuracy, on the CPU.

The expert k-loop holds the expert phase (reports/notes/megakernel-structure.md): decoding NVFP4 into bf16 pairs
for mma.m16n8k16 costs about 9 integer instructions and 4 bf16x2 multiplies per 8 weights, and at
shard8 T=16 a chunk's compute already equals its stream time. Hopper's other tensor-core input for
such weights is E4M3 (mma.m16n8k32.e4m3): an E2M1 code is an E4M3 byte with its bits moved (the
value * 2^-6), about 5 instructions per 8 weights and no per-pair multiply. But both operands of
that mma are E4M3, so the activations (the pooled operand of gate/up, silu(gate) * up of the down
projection) would be rounded to E4M3 too, with one scale per token row.

This module measures that rounding's effect on what the pipeline checks: the step's logits
against the torch reference (`megakernel.reference`), ||fp8 - ref|| / ||ref||, the same measure
as `megakernel.runtime.check_close` with the pipeline's REL_TOL. The FP8 step is the reference
with both expert operands rounded to E4M3 per token (`reference.step(..., expert_operand=)`;
scale 448 / the row's max |x|, the products accumulated in fp32, as the mma does). Everything else
is the reference's. Activations are the model's own (random weights, `megakernel.weights.generate`), so
they have none of a trained model's outliers; a trained model's error would be larger.

    python -m megakernel.fp8_budget [--preset tiny|small] [--tokens 16] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys

import torch

from . import reference
from .config import PRESETS
from .plans import REL_TOL
from .weights import generate

E4M3_MAX = 448.0


def e4m3_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] rounded to E4M3 with one scale per row (448 / the row's max |x|), back in fp32."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    scale = E4M3_MAX / amax
    return (x * scale).to(torch.float8_e4m3fn).float() / scale


def measure(preset: str = "tiny", tokens: int = 16, seed: int = 0) -> dict:
    """The logits' relative error of the E4M3-activation step against the reference, one step of
    `tokens` chained tokens at context 8 on random weights and a random cache."""
    cfg = PRESETS[preset]
    w = generate(cfg, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    toks = torch.randint(0, cfg.vocab, (tokens,), generator=g)
    parents = [-1] + list(range(tokens - 1))
    ctx = 8
    base = reference.KVCache(cfg).fill_random(torch.Generator().manual_seed(seed + 2), std=0.5)
    ref = reference.step(w, base.clone(), toks, parents, ctx)
    got = reference.step(w, base.clone(), toks, parents, ctx, expert_operand=e4m3_per_token)
    err = float((got.double() - ref.double()).norm() / ref.double().norm())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"preset": preset, "tokens": tokens, "seed": seed, "rel_err": err, "rel_tol": REL_TOL,
            "argmax_agree": agree}


def main(argv=None, prog: str = "python -m megakernel.fp8_budget") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    r = measure(a.preset, a.tokens, a.seed)
    print(f"{r['preset']} T={r['tokens']} seed {r['seed']}: logits of the E4M3-activation step vs the reference: "
          f"relative error {r['rel_err']:.3e} (the pipeline's budget {r['rel_tol']:.0e}, of which the kernel's own "
          f"rounding points use about 8.6e-3 at shard8), argmax agreement {r['argmax_agree']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
