"""Compile, without a GPU, every megakernel build the pipeline and the GPU tests will ask for, into
the on-disk cache (MEGABENCH_CACHE). The cache key names content, not machine paths, so a cache
filled here is reused on a GPU machine with the same NVRTC: device time is not spent compiling.

    MEGABENCH_CACHE=.carry/kcache python -m megakernel.precompile [--sm 132] [-j 2]
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor

from .build import build_gpu
from .config import preset
from .plan import make_plan
from .plans import BATCH_FULL, CHECK_POINTS, FULL, NONE, QUICK, plan_for, rows_switches, technique_switches


def plans(n_sm: int = 132):
    out = []
    tech = technique_switches(None, n_sm)
    allsw = {k: v for d in tech.values() for k, v in d.items()}
    for p in ("tiny", "small", "shard8"):
        out.append(plan_for(p, None, n_sm))
        rows = {t for pts in (CHECK_POINTS, QUICK, FULL) for t, _ in pts.get(p, [])}
        rows |= {b * t for b, t, _ in BATCH_FULL.get(p, [])}  # a batched step runs the build of its B x T rows
        for t in sorted(rows):  # the build each checked / timed step of t rows runs (past 16: row groups)
            out.append(plan_for(p, None, n_sm, **rows_switches(preset(p), t)))
        if p == "tiny":
            continue
        variants = [NONE, allsw, {**allsw, "pdl": False}]
        for sw in tech.values():
            variants.append({**NONE, **sw})
            variants.append({**allsw, **{k: NONE[k] for k in sw}})
        for sw in variants:
            out.append(plan_for(p, None, n_sm, **sw))
        out.append(plan_for(p, None, n_sm, profile=False, profile_cap=128))  # measure.timeline: the default build
        out.append(plan_for(p, None, n_sm, profile=True, profile_cap=128))
        if p == "shard8":  # cli timeline-detail
            out.append(plan_for(p, None, n_sm, profile=True, profile_detail=True, profile_cap=1024))
    cfg = preset("tiny")
    out.append(make_plan(cfg, 4))  # sanitize-step
    out.append(make_plan(cfg, n_sm, spin_bound_ns=50_000_000))  # the GPU watchdog test
    return list(dict.fromkeys(out))


def _one(plan) -> str:
    u = build_gpu(plan).usage
    return f"{plan.cfg.name}: {u.code_bytes} B, {u.registers} regs, spills {u.spills}"


def quality_build(preset: str, tokens: int) -> str:
    """The build tests/bench/test_bench_megakernel.py times at (preset, tokens) on this GPU,
    compiled into the kernel cache (`megabench gate --quality-run` precompiles it, each injection)."""
    build_gpu(plan_for(preset, tokens=tokens))
    return f"megakernel {preset} T={tokens}"


def main(argv=None, prog: str = "python -m megakernel.precompile") -> int:
    a = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--sm", type=int, default=132)
    a.add_argument("-j", type=int, default=2)
    args = a.parse_args(argv)
    ps = plans(args.sm)
    print(f"{len(ps)} builds", flush=True)
    with ProcessPoolExecutor(args.j) as ex:
        for line in ex.map(_one, ps):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
