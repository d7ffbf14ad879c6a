"""Which SM each block of a step's launches ran on, launch after launch.

An SM's instruction cache keeps what the block before it ran, so a launch starts with warm code
only on the SMs whose block runs what the SM's last block ran. The hardware places the blocks, not
the kernel (one block per SM; with PDL the next grid's blocks take SMs while the previous grid's
leave), so this measures the placement from the profiler's records (each carries %smid,
mb/profile.cuh), on a profiled step, every launch recorded:

  same_sm     share of (launch, block) on the SM the block had in the launch before
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from microbench.results import Derived, Result, Series

from .bench_baselines import step_context, weights_for
from .plans import constants_env, plan_for
from .runtime import Engine


BENCHMARK = "megakernel.sm_map"


@dataclass(frozen=True)
class Placement:
    launches: int  # launch transitions counted
    blocks: int
    same_sm: float
    per_launch: tuple = ()  # same_sm of each launch transition


def placement(launch: np.ndarray, block: np.ndarray, sm: np.ndarray, n_blocks: int) -> Placement:
    """From per-record (launch, block, sm) arrays: the share of the module docstring, over every
    pair of consecutive launches that both recorded every block. A block whose records name two
    SMs in one launch is an error (blocks do not migrate)."""
    if not (len(launch) == len(block) == len(sm)):
        raise ValueError("placement: launch, block and sm arrays of different lengths")
    if n_blocks < 1:
        raise ValueError(f"placement: {n_blocks} blocks")
    where: dict[int, dict[int, int]] = {}
    for lc, b, s in zip(launch.tolist(), block.tolist(), sm.tolist()):
        seen = where.setdefault(lc, {})
        if seen.setdefault(b, s) != s:
            raise ValueError(f"placement: block {b} of launch {lc} recorded on SMs {seen[b]} and {s}")
    full = sorted(lc for lc, m in where.items() if len(m) == n_blocks)
    pairs = [(a, b) for a, b in zip(full, full[1:]) if b == a + 1]
    if not pairs:
        raise ValueError("placement: no two consecutive launches recorded every block")
    same_sm = total = 0
    per = []
    for a, b in pairs:
        prev, cur = where[a], where[b]
        here = sum(prev[blk] == s for blk, s in cur.items())
        per.append(here / len(cur))
        total += len(cur)
        same_sm += here
    return Placement(len(pairs), n_blocks, same_sm / total, tuple(per))


def to_result(rows, env=None):
    """A megabench Result (megakernel.sm_map) of [(preset, T, ctx, variant name, switches, Placement)]:
    one series per row, its samples each launch transition's same-SM share; derived
    same_sm_<preset>_T<t>_ctx<ctx>_<variant>. Not gated (a placement, not a time)."""
    if env is None:
        env = constants_env()
    series, derived = [], {}
    for preset, t, ctx, name, switches, m in rows:
        sname = f"{preset}/T{t}/ctx{ctx}/{name}"
        series.append(Series.from_samples(
            sname, m.per_launch, timer="static", unit="ratio",
            params={"preset": preset, "T": t, "ctx": ctx, "variant": name, "switches": dict(switches),
                    "blocks": m.blocks, "launch_transitions": m.launches,
                    "source": "profiler records' %smid (mb/profile.cuh), every launch of a mega step"},
            metrics={"gate_direction": "none"}))
        key = f"{preset}_T{t}_ctx{ctx}_{name}"
        derived[f"same_sm_{key}"] = Derived(m.same_sm, "ratio", "share of blocks on the SM they had the launch before",
                                            inputs=(sname,))
    return Result(BENCHMARK, env, tuple(series), derived, quick=False)


def measure(preset: str, n_tokens: int, ctx: int, switches: dict, steps: int = 3) -> Placement:
    """On the GPU: `steps` profiled mega steps of the build (plan_for with `switches`); the last
    one's records."""
    sc = step_context(preset, n_tokens, ctx)
    plan = plan_for(preset, None, None, tokens=n_tokens, profile=True, profile_cap=128, **switches)
    eng = Engine(weights_for(preset), plan, sc.cache0.clone(), backend="gpu")
    routes = [r.cuda() for r in sc.routes]
    for _ in range(steps):
        eng.step(sc.tokens, sc.parents, ctx, mode="mega", routes=routes)
    st = eng.prof.read()
    return placement(np.asarray(st.launch), np.asarray(st.block), np.asarray(st.sm), eng.grid)
