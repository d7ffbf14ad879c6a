"""`python -m microbench.sanitize.ring_probe`: run the four ring-protocol probes (ring_probe.cu)
once each, checking their sums, so `compute-sanitizer --tool racecheck` can report on each.

Read the racecheck log per kernel name: a hazard on probe_*_raw is on the read-after-copy edge
(ordered only by the mbarrier's complete_tx), on probe_*_ring also the copy-after-read edge;
probe_cta_ring_otherlane issues the copy from a lane other than the one that waited.
"""
from __future__ import annotations

import sys
from pathlib import Path

from microbench.compiler import compile_cuda
from microbench.device import no_gpu_reason
from microbench.launch import LaunchSpec, launch

KERNELS = ("probe_cluster_raw", "probe_cluster_ring", "probe_cta_raw", "probe_cta_ring", "probe_cta_ring_otherlane")
ROUNDS = {"raw": 1, "ring": 3}
WORDS = 256


def expected(src, rounds: int):
    import torch  # heavy: torch

    t = torch.arange(32, device=src.device)
    acc = torch.zeros(32, dtype=torch.float32, device=src.device)
    for r in range(rounds):
        blk = src[WORDS * r: WORDS * (r + 1)]
        acc = acc + (blk[t] + blk[(t * 7 + 3) % WORDS])
    return acc


def main(argv=None) -> int:
    reason = no_gpu_reason()
    if reason:
        print(f"ring_probe needs a GPU: {reason}", file=sys.stderr)
        return 2
    import torch  # heavy: torch

    mod = compile_cuda(Path(__file__).with_suffix(".cu"))
    g = torch.Generator(device="cuda").manual_seed(7)
    src = torch.rand(WORDS * 3, generator=g, device="cuda") + 0.5  # fresh, non-zero
    bad = 0
    for name in KERNELS:
        out = torch.full((32,), float("nan"), device="cuda")
        launch(mod.kernel(name), LaunchSpec(grid=1, block=64, smem=0), src, out)
        torch.cuda.synchronize()
        want = expected(src, ROUNDS["raw" if name.endswith("_raw") else "ring"])
        ok = torch.allclose(out, want, rtol=0, atol=1e-5)  # same additions in the same order
        bad += not ok
        print(f"{name}: {'sums correct' if ok else f'WRONG: {out[:4].tolist()} vs {want[:4].tolist()}'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
