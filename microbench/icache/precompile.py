"""`megabench icache precompile [--full]` (alias `python -m microbench.icache precompile`): assemble
(and size-check) every kernel the icache benchmarks use into the compile cache (MEGABENCH_CACHE),
printing the time per benchmark. No GPU needed; the cache key is machine-independent, so a cache
filled here can be carried to the GPU machine and the benchmarks there skip nvJitLink entirely."""
from __future__ import annotations

import argparse
import time

from ..compiler import cache_dir
from .bench import all_generators
from .gen import compile_many


def main(argv=None, prog: str = "python -m microbench.icache") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("precompile", help="compile every icache kernel into the cache")
    s.add_argument("--full", action="store_true", help="the full sweeps' kernels (default: quick)")
    s.add_argument("--arch", default="sm_90a")
    args = p.parse_args(argv)
    total = 0.0
    for bench, gens in all_generators(not args.full, args.arch).items():
        t0 = time.perf_counter()
        compile_many(gens)
        dt = time.perf_counter() - t0
        total += dt
        print(f"{bench:22s} {len(gens):3d} kernels {sum(g.body_bytes for g in gens) / 1024:8.0f} KiB of body "
              f"{dt:6.1f} s", flush=True)
    print(f"total {total:.1f} s; cache {cache_dir()}")
    return 0
