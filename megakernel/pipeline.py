"""The megakernel stage of `megabench run` (and of `python -m megakernel.cli check-and-bench`).

On the GPU, per preset: build with the tuned constants (megakernel.build: code bytes, registers,
spills, smem against the instruction-cache budget), check correctness (mega == chain bitwise on
logits and KV caches at several contexts incl. past the sliding window, T=1 and a 16-token tree,
repeated runs identical, within a bf16 tolerance of the torch reference with the reference's
routing, greedy decoding equal to the reference's), then time the step (megakernel.step): chain
mode and mega mode, each replayed from a CUDA graph so the host's launch cost is out of both, in
device time, with kernel launches per step counted by the profiler and the roofline as the bound.

Stage lays this out as progress items (microbench.progress) for `megabench run`: enumerated before
anything runs so the run's estimate is known up front; its first item compiles every build in
parallel processes. The default run (quick, 5-minute budget) takes the checks and the headline
points (QUICK) for chain, mega, the torch baselines and PEERS; --full adds FULL's long contexts,
the ablation, the timeline and the detail timeline. `run` (`python -m megakernel.cli
check-and-bench`) executes the same items in order and raises on the first failure.
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from microbench.errors import CompileError, CorrectnessError
from microbench.results import Bound, Derived, Env, Result, Series

from .config import preset as get_preset
from .plan import Plan, fuses_experts, make_plan
from .results_names import step_params, step_series_name
from .runtime import Engine, check_close

QUICK = {"small": [(1, 512), (16, 512)], "shard8": [(1, 2048), (16, 2048)]}
FULL = {"small": [(t, c) for c in (512, 4096) for t in (1, 16)],
        "shard8": [(t, c) for c in (2048, 8192) for t in (1, 16)]}
CHECK_POINTS = {"tiny": [(1, 0), (16, 20), (16, 100)], "small": [(1, 300), (16, 1500)],
                "shard8": [(1, 300), (16, 2500)]}
REL_TOL = 1e-2  # bf16 activations between ops, fp32 accumulation: observed ~3e-3 on tiny


# The tuned spin bound covers latency-bound waits only (its rule says so); a megakernel block also
# waits on a producer's whole compute phase, at most one step. 1 s stays far above any step here
# (< 30 ms on the H200) and under compute-sanitizer, yet still turns a hang into a report.
PHASE_ALLOWANCE_NS = 1_000_000_000


def tuned(constants=None):
    """The tuned constants a build reads: the revision adopted for this GPU (microbench/adopt.py:
    reports/constants/adopted/<gpu>.json, changed only with a measurement of the build), never
    straight from whatever `megabench tune` wrote last. MEGABENCH_CONSTANTS=<revision file> builds
    from a candidate revision instead (to measure it before adopting it; results record which), as
    load_constants reads it (=defaults: the documented defaults). Without an adoption: with a GPU
    present, only its own model's current file (constants never cross GPU models), with a warning
    that no measurement adopted it; a GPU without one is an error naming the GPUs that have one.
    Without a GPU (precompiling, CI) the single adoption, else the folder's single file; several
    are an error naming them, and only a folder with no constants file at all falls back to the
    defaults, with a warning. A malformed file raises ResultsFileError naming the problem."""
    if constants is not None:
        return constants
    import os

    from microbench.adopt import has_adoption, load_adopted
    from microbench.device import device_info, gpu_count
    from microbench.tune import DEFAULTS_ENV, NoConstantsFileError, TunedConstants, load_constants

    gpu = device_info().name if gpu_count() else None
    cand = os.environ.get("MEGABENCH_CONSTANTS")
    if cand and cand != DEFAULTS_ENV:  # a candidate revision, to measure it before adopting it
        return load_constants(cand, gpu=gpu)
    if not cand and has_adoption(gpu):
        return load_adopted(gpu)
    try:
        c = load_constants(gpu=gpu)
    except NoConstantsFileError as e:
        if gpu is not None:
            raise
        warnings.warn(f"{e}; the megakernel builds with the documented defaults", stacklevel=2)
        return TunedConstants.defaults()
    if not os.environ.get("MEGABENCH_CONSTANTS"):
        warnings.warn(f"no adopted constants revision for {gpu or 'this machine'}: building from the current file "
                      f"{c.path} (revision {c.revision}), which no measurement of this build adopted", stacklevel=2)
    return c


def constants_env(env=None, constants=None):
    """`env` (default Env.capture()) recording which constants revision the build read."""
    import dataclasses
    from pathlib import Path

    from microbench.results import REPO_ROOT

    c = tuned(constants)
    env = env if env is not None else Env.capture()
    path = getattr(c, "path", None)
    if path:
        try:
            path = str(Path(path).resolve().relative_to(REPO_ROOT))
        except ValueError:
            pass
    return dataclasses.replace(env, constants_revision=getattr(c, "revision", None),
                               constants_file=path or "documented defaults")


def _get(constants, key):
    return constants[key] if isinstance(constants, dict) else getattr(constants, key)


# Per-role register budgets (Plan.compute_registers; technique 1's "register budgets per role"):
# the compute warps take 224 registers, the loader's warpgroup keeps 56. The builds stop being 3
# registers short of a spill (the profiled builds spilled 44 B at shard8 T=1, 42 B in the detail
# build: none does now). In-run A/Bs on the H200, 2026-12-01, 7 rounds each, against 9 warps of 168
# (shard8 T=16 / shard8 T=1 / small T=16): 05:23Z -0.06 / -0.69 / +0.87%, 05:30Z -0.37 / -0.75 /
# -0.05%, 05:35Z -0.59 / -0.83 / +0.07% (512 B layout placebos -0.49..+0.76%); profiled, every launch
# recorded: +3.04 / +9.50 / +4.94% over the unprofiled build without them, +3.00 / +4.34 / +4.93%
# with them (05:23Z)
ROLE_REGISTERS = 224


def plan_for(preset: str, constants=None, n_sm: int | None = None, **switches) -> Plan:
    """Plan from the tuned constants (documented defaults where no constants file exists)."""
    from microbench.device import device_info
    from microbench.errors import KernelDoesNotFitError

    cfg = get_preset(preset)
    n_sm = n_sm or device_info().sm_count
    c = tuned(constants)
    # the tuned ring is the least that streams at full rate; spare shared memory adds stages of
    # its size (plan.make_plan fill_ring)
    kw = dict(ring_stages=int(_get(c, "ring_stages")), ring_stage_bytes=int(_get(c, "ring_stage_bytes")),
              spin_bound_ns=int(_get(c, "spin_bound_ns")) + PHASE_ALLOWANCE_NS,
              poll_backoff_ns=int(_get(c, "poll_backoff_ns")), fill_ring=True,
              # weights.l2 measured whether an evict-first stream keeps reused data in L2
              stream_evict_first=bool(int(_get(c, "evict_first_pays"))),
              # clocks.launch measured whether PDL shortens a chain of persistent launches (the step's
              # per-layer launches: megakernel ablation, every H200 run of 2026-11-29, all but PDL
              # 0.1-1.7% slower than all)
              pdl=bool(int(_get(c, "pdl_pays"))),
              # sync.publish measured whether sentinel slots beat a release flag for small payloads
              # (the router's logits are 512 B per unit at shard8 T=16)
              sentinel_route=bool(int(_get(c, "sentinel_pays"))),
              # the fused expert unit wherever the model's shapes allow it (plan.fuses_experts).
              # In-run A/B on the H200 (2026-11-30 23:15Z, 5 rounds, against the split GEMMs; a
              # layout placebo of the split build -0.19 / +0.76 / -0.33%): shard8 T=16 -1.26%,
              # T=1 -2.92%, small T=16 +0.06%
              fused_experts=fuses_experts(cfg),
              compute_registers=ROLE_REGISTERS)
    kw.update(switches)  # a technique switch overrides the constant
    if "fused_experts" not in switches and kw["fused_experts"]:
        try:  # the default only: a unit of too few gate rows for a K-part builds the split GEMMs
            make_plan(cfg, n_sm, **kw)
        except ValueError as e:
            if "fused_experts" not in str(e):
                raise
            kw["fused_experts"] = False
    try:
        return make_plan(cfg, n_sm, **kw)
    except KernelDoesNotFitError as e:
        warnings.warn(f"{preset}: the tuned ring does not fit ({e}); building with the default ring", stacklevel=2)
        kw.pop("ring_stages"), kw.pop("ring_stage_bytes")
        return make_plan(cfg, n_sm, **kw)


def code_budget(constants=None) -> int:
    return int(_get(tuned(constants), "max_code_bytes_per_launch"))


# ---------------------------------------------------------------------- correctness
@dataclass
class Check:
    preset: str
    n_tokens: int
    ctx: int
    rel_err: float
    bitwise_chain: bool
    bitwise_repeat: bool
    bitwise_kv: bool
    bitwise_real_routing: bool


def check_point(preset: str, n_tokens: int, ctx: int, plan: Plan) -> Check:
    from .bench_baselines import step_context, weights_for

    sc = step_context(preset, n_tokens, ctx)
    w = weights_for(preset)
    routes = [r.cuda() for r in sc.routes]
    outs, caches = [], []
    for mode in ("mega", "chain", "mega"):
        cache = sc.cache0.clone()
        eng = Engine(w, plan, cache, backend="gpu")
        eng.poison()
        outs.append(eng.step(sc.tokens, sc.parents, ctx, mode=mode, routes=routes))
        caches.append(cache)
    err = check_close(outs[0].logits, sc.ref_logits, f"{preset} T={n_tokens} ctx={ctx}: megakernel vs reference",
                      rel=REL_TOL)
    chain_eq = torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].tokens, outs[1].tokens)
    rep_eq = torch.equal(outs[0].logits, outs[2].logits)
    kv_eq = caches[0].equal(caches[1]) and caches[0].equal(caches[2])
    for a, b in zip(caches[0].k + caches[0].v, sc.ref_cache.k + sc.ref_cache.v):
        check_close(a, b, f"{preset} T={n_tokens} ctx={ctx}: KV cache vs reference", rel=REL_TOL)
    real, real_caches = [], []
    for mode in ("mega", "chain"):  # the kernel's own routing (top-k on its logits): logits and KV caches
        real_caches.append(sc.cache0.clone())
        eng = Engine(w, plan, real_caches[-1], backend="gpu")
        real.append(eng.step(sc.tokens, sc.parents, ctx, mode=mode))
    real_eq = (torch.equal(real[0].logits, real[1].logits) and torch.equal(real[0].tokens, real[1].tokens)
               and real_caches[0].equal(real_caches[1]))
    c = Check(preset, n_tokens, ctx, err, chain_eq, rep_eq, kv_eq, real_eq)
    if not (chain_eq and rep_eq and kv_eq and real_eq):
        raise CorrectnessError(f"{preset} T={n_tokens} ctx={ctx}: mega and chain modes differ bitwise: {c}")
    return c


def greedy_check(preset: str, plan: Plan, steps: int = 64, prompt=(3, 14, 15, 92)) -> int:
    """Greedy decoding with the megakernel (T=1 steps, prefill token by token) against the
    reference's greedy tokens. Returns the number of steps compared."""
    from .bench_baselines import weights_for
    from .reference import KVCache, greedy

    w = weights_for(preset)
    ref = greedy(w, KVCache(w.cfg, device="cuda"), list(prompt), steps)
    eng = Engine(w, plan, KVCache(w.cfg, device="cuda"), backend="gpu")
    ctx, last, got = 0, None, []
    for tok in prompt:
        last = int(eng.step([tok], [-1], ctx, mode="mega").tokens[0])
        ctx += 1
    for _ in range(steps):
        got.append(last)
        last = int(eng.step([last], [-1], ctx, mode="mega").tokens[0])
        ctx += 1
    if got != ref:
        first = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        raise CorrectnessError(f"{preset}: greedy decoding diverges from the reference at step {first}: "
                               f"{got[first:first + 5]} vs {ref[first:first + 5]}")
    return steps


# ---------------------------------------------------------------------- timing
def graph_of(eng: Engine, mode: str, pairs: int = 1):
    """A CUDA graph of 2*pairs steps of `mode` (two, so the dependency counters' parities
    alternate and every replay starts from clean counters). Returns (graph, steps per replay)."""
    eng.counters.zero_()
    eng._dirty = [False, False]
    eng.parity = 0
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up (module load, smem attribute, co-residency check) outside capture
            eng.launch_step(mode)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    eng.counters.zero_()
    eng._dirty = [False, False]
    eng.parity = 0
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(2 * pairs):
            eng.launch_step(mode)
    eng._dirty = [False, True]  # after an even number of steps (see launch_step)
    eng.parity = 0
    return g, 2 * pairs


def bench_point(h, preset: str, n_tokens: int, ctx: int, plan: Plan, mode: str, ceiling, impl: str | None = None,
                program_mode: str = "layer") -> Series:
    from .bench_baselines import step_context, weights_for
    from .kernel_count import count_kernels
    from .roofline import roofline

    sc = step_context(preset, n_tokens, ctx)
    w = weights_for(preset)
    eng = Engine(w, plan, sc.cache0.clone(), backend="gpu", program_mode=program_mode)
    routes = [r.cuda() for r in sc.routes]
    eng.prepare(sc.tokens, sc.parents, ctx, routes)
    out = eng.step(sc.tokens, sc.parents, ctx, mode=mode, routes=routes)  # correctness of this very engine
    check_close(out.logits, sc.ref_logits, f"{preset}/{mode}: before timing", rel=REL_TOL)
    kc = count_kernels(lambda: eng.launch_step(mode))
    g, per = graph_of(eng, mode)
    t = h.time(g.replay)
    rf = roofline(w.cfg, n_tokens, ctx, sc.distinct, ceiling=ceiling)
    samples = np.asarray(t.samples_s) / per
    bound = Bound("time", rf.seconds, "s", f"roofline: {rf.bytes.total} B / {rf.read_ceiling:.3e} B/s ({rf.source})")
    impl = impl or mode
    return Series.from_samples(
        step_series_name(preset, n_tokens, ctx, impl), samples, timer="cuda_event", unit="s",
        params=step_params(preset, n_tokens, ctx, impl, sc.distinct, launch="cuda_graph"), bound=bound,
        clocks=t.clocks, warnings=t.warnings,
        metrics={"launches_per_step": kc.kernels_per_step, "bytes_per_step": rf.bytes.total, "roofline_s": rf.seconds,
                 "tokens_per_step": n_tokens, "grid": eng.grid, "smem_bytes": plan.smem_bytes})


def build_result(plans: dict[str, Plan], budget: int | None, constants=None) -> Result:
    from .build import build_gpu

    series, derived = [], {}
    worst = 0
    for name, plan in plans.items():
        u = build_gpu(plan, code_budget=budget).usage
        worst = max(worst, u.code_bytes)
        series.append(Series.from_samples(f"build/{name}", [u.code_bytes], timer="static", unit="B",
                                          params={"preset": name, "smem_bytes": plan.smem_bytes,
                                                  "ring_stages": plan.ring_stages, "stage_bytes": plan.stage_bytes},
                                          metrics={**u.to_dict(), "icache_budget_bytes": budget}))
    derived["launch_code_bytes_max"] = Derived(worst, "B", "largest per-launch machine code over the presets "
                                               "(every launch runs the same kernel)")
    return Result("megakernel.build", constants_env(None, constants), tuple(series), derived, quick=True)


def code_result(points: Sequence[tuple[str, int]], n_sm: int = 132, constants=None, arch: str = "sm_90a") -> Result:
    """`megakernel.code`: the machine-code bytes of each op of the build for each (preset, tokens),
    as the tuned constants plan it for `n_sm` SMs (build.code_bytes_by_op; needs nvdisasm). The
    code is the compiler's, not the GPU's: NVRTC on a CPU machine gives the GPU's cubin when the
    versions match (Env.nvrtc), and critical_path checks each total against the H200's own
    megakernel.build. Every op's code is fetched from L2 once per layer when the layer's code
    overflows the SM's instruction cache (icache_sm_bytes)."""
    from .build import build_gpu, code_bytes_by_op

    series = []
    for preset, tokens in points:
        plan = plan_for(preset, constants, n_sm, tokens=tokens)
        b = build_gpu(plan, arch=arch)
        by = code_bytes_by_op(b)
        if sum(by.values()) != b.usage.code_bytes:
            raise CompileError(f"{preset} T={tokens}: code by op sums to {sum(by.values())} B, the kernel has "
                               f"{b.usage.code_bytes} B")
        for op, n in by.items():
            series.append(Series.from_samples(f"code/{preset}/{tokens}/{op}", [n], timer="static", unit="B",
                                              params={"preset": preset, "tokens": tokens, "op": op, "arch": arch,
                                                      "n_sm": n_sm},
                                              metrics={"kernel_code_bytes": b.usage.code_bytes}))
    return Result("megakernel.code", constants_env(None, constants), tuple(series), {}, quick=True,
                  notes=(f"machine code per op (the innermost csrc/ops/<op>.cuh of each instruction's inline chain, "
                         f"'schedule' for the unit loops, waits and entry), {arch}; the compiler is the env's nvrtc",))


# ---------------------------------------------------------------------- techniques
def technique_switches(constants=None, n_sm: int = 132) -> dict[str, dict]:
    """Each technique as plan switches. The "all" build uses every one; the ablation switches one
    on at a time (from none) and one off at a time (from all)."""
    return {"loader_ahead": {"loader_ahead": True}, "pdl": {"pdl": True},
            "evict_first": {"stream_evict_first": True}, "sentinel": {"sentinel_route": True},
            "role_registers": {"compute_registers": ROLE_REGISTERS}}


NONE = {"loader_ahead": False, "pdl": False, "stream_evict_first": False, "sentinel_route": False,
        "compute_registers": 0}


def ablation_variants(constants=None, n_sm: int = 132) -> dict[str, tuple[dict, str]]:
    """{impl: (plan switches, program mode)}: no technique, all, each one alone, all but each one,
    and all in a single whole-step launch instead of one launch per layer."""
    tech = technique_switches(constants, n_sm)
    allsw = {k: v for d in tech.values() for k, v in d.items()}
    variants = {"mega+none": (NONE, "layer"), "mega+all": (allsw, "layer")}
    for name, sw in tech.items():
        variants[f"mega+only_{name}"] = ({**NONE, **sw}, "layer")
        variants[f"mega+all_but_{name}"] = ({**allsw, **{k: NONE[k] for k in sw}}, "layer")
    variants["mega+all_single_launch"] = ({**allsw, "pdl": False}, "step")  # one launch: nothing to chain
    return variants


def ablation_names() -> list[str]:
    """The ablation's variant names (they do not depend on the constants' values)."""
    from microbench.tune import TunedConstants

    return list(ablation_variants(TunedConstants.defaults()))


def ablation_point(h, preset: str, n_tokens: int, ctx: int, constants, ceiling, impl: str, log=print) -> Series:
    """One ablation variant timed (same bits every time: bench_point checks against the reference)."""
    sw, mode = ablation_variants(constants, h.info.sm_count)[impl]
    s = bench_point(h, preset, n_tokens, ctx, plan_for(preset, constants, h.info.sm_count, tokens=n_tokens, **sw),
                    "mega", ceiling, impl=impl, program_mode=mode)
    log(f"  {s.name}: {s.summary.median * 1e3:.3f} ms ({s.fraction_of_bound:.1%} of roofline)")
    return s


def ablation(h, preset: str, n_tokens: int, ctx: int, constants, ceiling, log=print) -> list[Series]:
    """Step time with every ablation variant (ablation_variants)."""
    return [ablation_point(h, preset, n_tokens, ctx, constants, ceiling, impl, log) for impl in ablation_names()]


def _op_phases(df):
    """The rows of a Timeline.spans_df() that are ops' phases: not the detail phases inside units
    (profile_events.DETAIL_PHASES), not the wait_* phases before them."""
    from .profile_events import DETAIL_PHASES

    return df[~df["phase"].isin(DETAIL_PHASES) & ~df["phase"].str.startswith("wait_")]


def _detail_spans(df):
    """The detail spans (profile_events.DETAIL_PHASES) of `df` (Timeline.spans_df()), each with
    the op it belongs to: the op phase that began last before it on the same block and launch
    (units run inside their op's phase)."""
    import pandas as pd

    from .profile_events import DETAIL_PHASES

    det = df[df["phase"].isin(DETAIL_PHASES)].sort_values("begin_ns")
    ops = _op_phases(df)
    ops = ops[["launch", "block", "begin_ns", "phase"]].rename(columns={"phase": "op"}).sort_values("begin_ns")
    if det.empty or ops.empty:
        return det.iloc[0:0].assign(op=None)
    return pd.merge_asof(det, ops, on="begin_ns", by=["launch", "block"], direction="backward").dropna(subset=["op"])


def detail_by_op(df) -> dict[tuple[str, str], float]:
    """{(detail phase, op kind): seconds}: the median over blocks of each op kind's total time in
    each detail phase of a step. `df`: Timeline.spans_df()."""
    m = _detail_spans(df)
    if m.empty:
        return {}
    per_block = m.groupby(["phase", "op", "block"])["dur_ns"].sum()
    return {k: float(v) * 1e-9 for k, v in per_block.groupby(level=["phase", "op"]).median().items()}


def topk_steps(df) -> dict[int, float]:
    """{step: seconds}: the median over layers of each of top-k's steps after its poll
    (profile_events.TOPK_STEPS; one block, once per layer), from a detail build's topk_step spans.
    `df`: Timeline.spans_df()."""
    m = _detail_spans(df)
    if m.empty:
        return {}
    m = m[m["phase"] == "topk_step"]
    return {int(a): float(g["dur_ns"].median()) * 1e-9 for a, g in m.groupby("arg")}


# the segments of a unit boundary (unit_boundaries), in order
BOUNDARY_SEGMENTS = {
    "close": "the closing barrier of the unit before and thread 0's signal bookkeeping (unit_close)",
    "loop": "from the end of that to the next unit's opening (the unit loop)",
    "open": "the next unit's opening: its dependency wait and the barrier after it (unit_open)",
    "start": "from the opening to the unit's first staging pass or ring wait",
    "direct": "where the next unit does not open (program.cuh unit_opens: nothing to wait for, the same "
              "slot), from the closing to its first staging pass or ring wait",
}


def unit_boundaries(df) -> dict[tuple[str, str], float]:
    """{(segment, op kind): seconds}: the median over a step's inner unit boundaries of each op
    (a block's second and later units of an op instance) of each BOUNDARY_SEGMENTS segment, from
    the detail phases unit_close, unit_open, stage and ring_wait (builds since 06e76fe, which stamp
    unit_open from a block's second unit of an op on, and only where the unit opens). "start" and
    "direct" only where the unit stages or streams. `df`: Timeline.spans_df()."""
    m = _detail_spans(df)
    m = m[m["phase"].isin(("unit_close", "unit_open", "stage", "ring_wait"))]
    seg: dict[tuple[str, str], list[float]] = {}
    for _, g in m.sort_values("begin_ns").groupby(["launch", "block"], sort=False):
        close = opened = None
        for ph, op, b, e in zip(g["phase"], g["op"], g["begin_ns"], g["end_ns"]):
            if ph == "unit_close":
                close, opened = (op, b, e), None
            elif ph == "unit_open":
                if close is not None and close[0] == op:
                    seg.setdefault(("close", op), []).append(close[2] - close[1])
                    seg.setdefault(("loop", op), []).append(b - close[2])
                    seg.setdefault(("open", op), []).append(e - b)
                    opened = (op, e)
                close = None
            elif opened is not None and opened[0] == op:  # the unit's first stage or ring wait
                seg.setdefault(("start", op), []).append(b - opened[1])
                opened = None
            elif close is not None and close[0] == op:  # a unit of the same op that did not open
                seg.setdefault(("close", op), []).append(close[2] - close[1])
                seg.setdefault(("direct", op), []).append(b - close[2])
                close = None
    return {k: float(np.median(v)) * 1e-9 for k, v in sorted(seg.items())}


def end_tails(df) -> dict[str, float]:
    """{op kind: seconds}: the median over launches of how long after the median block the last
    block ends the op (its phase end), for ops that two or more blocks run in a launch. A layer
    waits for its slowest block at each all-dependency, so this is what the op's imbalance costs.
    `df`: Timeline.spans_df()."""
    ops = _op_phases(df)
    out: dict[str, list[float]] = {}
    for (op, _), g in ops.groupby(["phase", "launch"]):
        ends = g.groupby("block")["end_ns"].max()
        if len(ends) >= 2:
            out.setdefault(op, []).append(float(ends.max() - ends.median()))
    return {op: float(np.median(v)) * 1e-9 for op, v in sorted(out.items())}


SEGMENTS = {"front": "the launch's start (median over blocks of each block's first phase) to the first "
                     "gate/up unit: attention, its merge, oproj, router and pooler, top-k",
            "experts": "the first gate/up unit's start to the last down-projection unit's end",
            "back": "the last down-projection unit's end to the launch's end (the last block's last phase): "
                    "the MoE combine, unpool, qkv"}


def layer_segments(df) -> dict[str, float]:
    """{segment: seconds}, the medians over the launches that run the expert GEMMs of the three
    segments a layer launch falls into around its expert phase (SEGMENTS): the expert phase is
    where the step's bytes are, the segments around it are a chain of dependent ops whose bytes
    take a few us at the read ceiling. `df`: Timeline.spans_df(); op phases only (not wait_*)."""
    ops = _op_phases(df)
    out: dict[str, list[float]] = {k: [] for k in SEGMENTS}
    for _, g in ops.groupby("launch"):
        e1, e2 = g[g["phase"] == "expert1"], g[g["phase"] == "expert2"]
        if e1.empty or e2.empty:
            continue
        start = float(df[df["launch"] == g["launch"].iloc[0]].groupby("block")["begin_ns"].min().median())
        first, last = float(e1["begin_ns"].min()), float(e2["end_ns"].max())
        out["front"].append(first - start)
        out["experts"].append(last - first)
        out["back"].append(float(g["end_ns"].max()) - last)
    return {k: float(np.median(v)) * 1e-9 for k, v in out.items() if v}


def slot_units(plan: Plan) -> dict[str, int]:
    """Units of one routed slot per routed op: gate/up units of d_expert / (a unit's gate rows),
    down-projection units of d_pool / (a unit's rows) (program.cuh EXP1_TILES, EXP2_TILES)."""
    c = plan.cfg
    e1 = c.d_expert // (plan.tiles["expert1"].rows // 2)
    return {"expert1": e1, "expert2": e1 if plan.fused_experts else c.d_pool // plan.tiles["expert2"].rows}


def slot_crossings(df, units_per_slot: dict[str, int]) -> dict[tuple[str, str], float]:
    """{(statistic, op): value} for the routed ops of a detail timeline (unit_close stamps carry
    the unit). A block runs consecutive units of a routed op (contiguous assignment), so they lie
    in one slot or cross into the next, which costs an opening (slot record, dependency wait,
    barrier) and a staging pass. Among the op phases with the most common unit count (like against
    like): "cross_fraction", the share whose units span two or more slots, and "cross_extra_s",
    the median duration of those minus the median of the one-slot ones (only where both occur)."""
    m = _detail_spans(df)
    m = m[(m["phase"] == "unit_close") & m["op"].isin(list(units_per_slot))]
    ops = df[df["phase"].isin(list(units_per_slot))].groupby(["launch", "block", "phase"])["dur_ns"].sum()
    out: dict[tuple[str, str], float] = {}
    for op, g in m.groupby("op"):
        per = g.groupby(["launch", "block"])["arg"].agg(
            n="nunique", slots=lambda a: len({int(u) // units_per_slot[op] for u in a}))
        per = per[per["n"] == per["n"].mode().iloc[0]]
        dur = [float(ops.get((lb[0], lb[1], op), np.nan)) for lb in per.index]
        per = per.assign(dur=dur).dropna(subset=["dur"])
        if per.empty:
            continue
        cross = per["slots"] > 1
        out[("cross_fraction", op)] = float(cross.mean())
        if cross.any() and (~cross).any():
            out[("cross_extra_s", op)] = float(per.loc[cross, "dur"].median() - per.loc[~cross, "dur"].median()) * 1e-9
    return dict(sorted(out.items()))


# the sampled profile the timeline also times: one launch in this many. A prime, so the sample
# does not step with the global-attention layers' regular spacing (shard8: 9 of 63 launches, 2
# of them with a global layer; small: 1 of 13)
PROFILE_SAMPLE_EVERY = 7


def middle_launch(n_launch: int) -> int:
    """A middle layer's launch (attention of layer L through qkv of L + 1): the one the timeline
    traces and samples around."""
    return n_launch // 2


def profile_samples(n_launch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two sampled profiles the timeline times (Engine.profile_launches): one launch in
    PROFILE_SAMPLE_EVERY through the middle launch, and as many consecutive launches around it.
    The window switches between the profiled and the unprofiled build twice a step instead of
    twice per recorded launch (each switch ~2.6 us: scratch run of 2026-11-30 12:31Z,
    reports/results/megakernel/diag-profiler-sampling-20261130T1231Z-a87fec0.md)."""
    mid = middle_launch(n_launch)
    spread = tuple(range(mid % PROFILE_SAMPLE_EVERY, n_launch, PROFILE_SAMPLE_EVERY))
    lo = max(0, min(mid - len(spread) // 2, n_launch - len(spread)))
    return spread, tuple(range(lo, lo + len(spread)))


def timeline(h, preset: str, n_tokens: int, ctx: int, constants, out_dir=None, log=print,
             detail: bool = False) -> Result:
    """One profiled step of the default build (the tuned constants' techniques, what the `mega`
    rows time): per-block op phases as megakernel.timeline series, a
    Perfetto trace and a PNG, the profiler's cost (profiled vs unprofiled step, same graph method)
    and the bitwise identity of the profiled outputs. detail: the build also stamps staging and
    ring waits inside units (megakernel.timeline_detail, with each op's time in them; more
    stamps, so more overhead than the plain timeline)."""
    from pathlib import Path

    from microbench.clocks.profiler import edge_series
    from microbench.results import results_root

    from .bench_baselines import step_context, weights_for

    sc = step_context(preset, n_tokens, ctx)
    w = weights_for(preset)
    routes = [r.cuda() for r in sc.routes]
    outs, graphs, engs = {}, {}, {}
    for prof in (False, True):
        extra = {"profile_detail": True, "profile_cap": 1024} if prof and detail else {"profile_cap": 128}
        plan = plan_for(preset, constants, h.info.sm_count, tokens=n_tokens, profile=prof, **extra)
        eng = engs[prof] = Engine(w, plan, sc.cache0.clone(), backend="gpu")
        outs[prof] = eng.step(sc.tokens, sc.parents, ctx, mode="mega", routes=routes)
        graphs[prof] = graph_of(eng, "mega")
    same = torch.equal(outs[False].logits, outs[True].logits) and torch.equal(outs[False].tokens, outs[True].tokens)
    if not same:
        raise CorrectnessError(f"{preset}: profiled outputs differ from unprofiled ones")
    # the same profiled engine recording one launch in PROFILE_SAMPLE_EVERY (the middle one among
    # them); its graph bakes in which launches get a buffer and the profiled kernel (the others
    # run the unprofiled build: Engine.profile_launches)
    n_launch = len(engs[True].program.launches)
    mid = middle_launch(n_launch)
    sampled, window = profile_samples(n_launch)
    for k, sel in (("sampled", sampled), ("window", window)):
        engs[True].profile_launches = sel
        graphs[k] = graph_of(engs[True], "mega")
    engs[True].profile_launches = None
    # interleaved passes, rotating which goes first: timed one after the other, a drift of the
    # clocks between passes would count as the profiler's cost
    kinds = (False, True, "sampled", "window")
    samples = {k: [] for k in kinds}
    for rnd in range(6):
        for k in kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]:
            g, per = graphs[k]
            samples[k] += [x / per for x in h.time(g.replay).samples_s]
    off, on, smp, win = (float(np.median(samples[k])) for k in kinds)
    eng = engs[True]  # after the replays, as graph_of wants: the step whose stamps we read
    eng.step(sc.tokens, sc.parents, ctx, mode="mega", routes=routes)
    tl = eng.timeline("mega")
    import dataclasses

    series = list(edge_series(tl, launch=mid))
    series.append(Series.from_samples(f"profiler_cost/{preset}/off", np.asarray(samples[False]),
                                      timer="cuda_event", unit="s", params={"preset": preset, "profile": 0}))
    series.append(Series.from_samples(f"profiler_cost/{preset}/on", np.asarray(samples[True]),
                                      timer="cuda_event", unit="s", params={"preset": preset, "profile": 1}))
    series.append(Series.from_samples(f"profiler_cost/{preset}/sampled", np.asarray(samples["sampled"]),
                                      timer="cuda_event", unit="s",
                                      params={"preset": preset, "profile": 1, "recorded_launches": len(sampled)}))
    series.append(Series.from_samples(f"profiler_cost/{preset}/window", np.asarray(samples["window"]),
                                      timer="cuda_event", unit="s",
                                      params={"preset": preset, "profile": 1, "recorded_launches": len(window),
                                              "first_recorded": window[0]}))
    df = tl.spans_df()
    derived = {
        "profiler_overhead_fraction": Derived((on - off) / off, "", "median profiled step, every launch recorded / "
                                              "median unprofiled step - 1 (CUDA-graph replays, six interleaved passes "
                                              "each; outputs bitwise identical)"),
        "profiler_cost_per_launch_s": Derived((on - off) / n_launch, "s", "(median profiled step, every launch "
                                              f"recorded - median unprofiled step) / {n_launch} launches"),
        "profiler_overhead_fraction_sampled": Derived(
            (smp - off) / off, "", f"as profiler_overhead_fraction, recording {len(sampled)} of {n_launch} launches "
            f"(one in {PROFILE_SAMPLE_EVERY}, Engine.profile_launches); the others run the unprofiled build of "
            "the same plan"),
        "profiler_overhead_fraction_window": Derived(
            (win - off) / off, "", f"as profiler_overhead_fraction_sampled, recording {len(window)} consecutive "
            f"launches ({window[0]}..{window[-1]} of {n_launch})"),
        "stamps_per_step": Derived(float(len(tl.stamps)), "", "profiler records of one step"),
    }
    span = float(df["end_ns"].max() - df["begin_ns"].min()) if len(df) else float("nan")
    waits = df[df["phase"].str.startswith("wait_")]
    for ph, g in waits.groupby("phase"):  # where each block's idle time goes, per op kind, per step
        per_block = g.groupby("block")["dur_ns"].sum()
        derived[f"idle_{ph}_s"] = Derived(float(per_block.median()) * 1e-9, "s",
                                          f"median over blocks of the step's total time in {ph} phases")
    if len(waits):
        derived["idle_fraction_of_step"] = Derived(float(waits.groupby("block")["dur_ns"].sum().median() / span), "",
                                                   "median over blocks of total wait_* time / profiled step span")
    for (ph, op), v in sorted(detail_by_op(df).items()):
        derived[f"{ph}_{op}_s"] = Derived(v, "s", f"median over blocks of the step's total {ph} time inside {op} units")
    from .profile_events import TOPK_STEPS

    for a, v in topk_steps(df).items():
        derived[f"topk_step{a}_s"] = Derived(v, "s", f"median over layers of top-k's step {a}: {TOPK_STEPS[a]}")
    for (sg, op), v in unit_boundaries(df).items():
        derived[f"boundary_{sg}_{op}_s"] = Derived(
            v, "s", f"median over the step's inner {op} unit boundaries (a block's second and later units of an op) "
                    f"of {BOUNDARY_SEGMENTS[sg]}")
    for op, v in end_tails(df).items():
        derived[f"end_tail_{op}_s"] = Derived(v, "s", f"median over launches of the last block's end of {op} minus "
                                                      "the median block's")
    segs = layer_segments(df)
    for k, v in segs.items():
        derived[f"layer_{k}_s"] = Derived(v, "s", f"median over the expert layers' launches of {SEGMENTS[k]}")
    if "experts" in segs:
        from .roofline import read_ceiling

        ceiling, src = read_ceiling(h.info.name)
        rate = sc.distinct * w.cfg.expert_bytes / segs["experts"]
        derived["expert_phase_read_rate"] = Derived(
            rate, "B/s", f"{sc.distinct} distinct experts x {w.cfg.expert_bytes} B / layer_experts_s; "
                         f"{rate / ceiling:.1%} of the read ceiling {ceiling:.4g} B/s ({src})")
    for (st, op), v in slot_crossings(df, slot_units(plan)).items():
        if st == "cross_fraction":
            derived[f"cross_fraction_{op}"] = Derived(
                v, "", f"share of the {op} phases (blocks x launches, the most common unit count) whose units span "
                       "two or more routed slots")
        else:
            derived[f"cross_extra_{op}_s"] = Derived(
                v, "s", f"median {op} phase of the blocks whose units span two or more slots minus that of the "
                        "one-slot blocks (same unit count): what crossing into the next slot costs")
    out_dir = Path(out_dir or results_root() / "megakernel")
    out_dir.mkdir(parents=True, exist_ok=True)
    keep = {mid - 1, mid, mid + 1}  # three launches keep the trace file small
    part = dataclasses.replace(tl, spans=tuple(x for x in tl.spans if x.launch in keep),
                               instants=tuple(x for x in tl.instants if x.launch in keep))
    env = constants_env(None, constants)
    # named like the result (date, commit): a later run never replaces an earlier run's trace
    stem = (f"timeline{'-detail' if detail else ''}-{preset}-T{n_tokens}-"
            f"{env.date.replace('-', '').replace(':', '')}-{env.git_sha[:7]}")
    trace = part.write_trace(out_dir / f"{stem}.trace.json")
    png = part.plot(out_dir / f"{stem}.png")
    log(f"  timeline {preset}: {len(tl.stamps)} stamps, profiler overhead {(on - off) / off:.2%} "
        f"({(smp - off) / off:.2%} recording {len(sampled)} of {n_launch} launches one in {PROFILE_SAMPLE_EVERY}, "
        f"{(win - off) / off:.2%} recording {len(window)} consecutive), trace {trace.name}")
    notes = (f"Perfetto trace (launches {sorted(keep)} of {n_launch}): {trace.name}; plot: {png.name}",
             "timer: globaltimer, stamped by thread 0 of each block", f"problems: {list(tl.problems)[:5]}")
    return Result("megakernel.timeline_detail" if detail else "megakernel.timeline", env, tuple(series), derived,
                  quick=True, notes=notes)


# ---------------------------------------------------------------------- the stage, as items
PRESETS = ("tiny", "small", "shard8")

# Other implementations timed beside mega and chain at every timed point of the stage (the torch
# baselines have items of their own): name -> fn(h, preset, n_tokens, ctx, ceiling, constants=...)
# returning a Series named results_names.step_series_name(preset, n_tokens, ctx, name), saved in
# megakernel.step. Each is the progress item "<preset> T=<T> ctx=<ctx> <name>", estimated as kind
# "peer" (PEER_SEED_S a point) until a run has measured it; a failure is reported and skips only that
# preset's later peer items. The default `megabench run` has about 25 s of its 300 s budget left for
# them. A peer fn may carry `quick_tokens`: the quick run times it at those T only. The peer here is
# its step alone at T=16 (block sizes from the last megakernel.peer run's sweep, else the defaults);
# `python -m megakernel.peer_bench` times it at every point with the sweep, torch.compile, real
# routing, chain_nopdl and the per-kernel accounting (megakernel.peer). MEGABENCH_PEER=0: none.
def _peer_row(h, preset, n_tokens, ctx, ceiling, constants=None):
    from .peer_bench import peer_point

    return peer_point(h, preset, n_tokens, ctx, ceiling)


_peer_row.quick_tokens = (16,)  # two items of ~10 s: what the default run's budget has left
PEERS: dict[str, object] = {} if os.environ.get("MEGABENCH_PEER", "1") == "0" else {"peer": _peer_row}
PEER_SEED_S = 10.0

# Seconds per item before any run.wall result has measured it (microbench.progress.Estimates), from
# committed evidence. model.baselines (reports/results/model, quick, 2026-11-29): wall 123-131 s for
# its 12 cases with acceptance and weights; torch.compile's compile_s 14-21 s for the first case of a
# process (small T=1), 7-16 s for the others; shard8 weights generated in 4.4-26.5 s. The megakernel
# stage of those days: build saved at 05:44:30, step at 05:47:12 (2026-12-01, run of 58f75e5): 162 s
# for checks, timings, the 38-variant ablation and the timeline with a warm kernel cache. One NVRTC
# build of shard8: 10.1 s (CPU machine, 2026-12-01). Names are Stage.items()'s.
SEEDS = {
    "build": 2.0, "save": 2.0,
    "tiny weights": 1.0, "small weights": 2.0, "shard8 weights": 10.0,
    "tiny greedy": 3.0, "small greedy": 5.0,
    "small acceptance": 1.5, "shard8 acceptance": 4.5,
    "small T=1 ctx=512 eager": 3.0, "small T=1 ctx=512 graph": 3.0, "small T=1 ctx=512 compile": 20.0,
    "small T=16 ctx=512 eager": 3.0, "small T=16 ctx=512 graph": 3.0, "small T=16 ctx=512 compile": 10.0,
    "shard8 T=1 ctx=2048 eager": 5.0, "shard8 T=1 ctx=2048 graph": 4.0, "shard8 T=1 ctx=2048 compile": 11.0,
    "shard8 T=16 ctx=2048 eager": 8.0, "shard8 T=16 ctx=2048 graph": 8.0, "shard8 T=16 ctx=2048 compile": 13.0,
}
KIND_SEEDS = {"compile": 15.0,  # a round of parallel NVRTC builds (the slowest, shard8, ~10 s) + process start
              "check/tiny": 1.5, "check/small": 3.0, "check/shard8": 5.0,
              "time/tiny": 2.0, "time/small": 2.5, "time/shard8": 3.5,
              "baseline": 8.0, "acceptance": 3.0, "weights": 10.0, "greedy": 5.0,
              "peer": PEER_SEED_S, "ablation/small": 3.0, "ablation/shard8": 4.0,
              "timeline": 15.0, "release": 1.0, "": 5.0}



class Stage:
    """The megakernel stage as progress items (microbench.progress.Item), enumerated before anything
    runs: per preset the weights, the correctness checks (timing is refused after a failed one: the
    preset's later megakernel items are skipped), greedy decoding (tiny, small), chain and mega at
    the timed points, then optionally the torch baselines (model.baselines, one weights generation
    and one reference step per point shared with the megakernel), the PEERS, the ablation, the
    timeline and the detail timeline; last, `save` collects and saves the Results (self.results).
    A first item compiles every build the stage will ask for in parallel processes into the kernel
    cache, so a cold cache costs the slowest build, not their sum.

    `constants` may be set after construction (megabench run tunes first) and is read when the
    items run. quick: QUICK points (the default `megabench run`'s headline: shard8 T=16 / T=1 at
    ctx 2048, small T=16 / T=1 at 512), else FULL."""

    def __init__(self, quick: bool = True, constants=None, save: bool = True, presets=PRESETS, log=print,
                 ablate: bool = True, timeline: bool | None = None, detail: bool = False, baselines: bool = False,
                 compile_workers: int | None = None):
        self.quick, self.constants, self.save, self.presets, self.log = quick, constants, save, tuple(presets), log
        self.ablate, self.timeline = ablate, ablate if timeline is None else timeline
        self.detail, self.baselines, self.compile_workers = detail, baselines, compile_workers
        self.results: list[Result] = []
        self.series: list[Series] = []
        self.checks: list[Check] = []
        self.notes: list[str] = []
        self._h = self._ceiling = self._col = None
        self._plans: dict = {}

    # ------------------------------------------------------------------ what it runs
    def points(self, p: str) -> list[tuple[int, int]]:
        return (QUICK if self.quick else FULL).get(p, [])

    def baseline_points(self, p: str) -> list[tuple[int, int]]:
        from .bench_baselines import FULL_POINTS, QUICK_POINTS

        return (QUICK_POINTS if self.quick else FULL_POINTS).get(p, []) if self.baselines else []

    def tokens(self, p: str) -> list[int]:
        return sorted({t for t, _ in CHECK_POINTS.get(p, [])} | {t for t, _ in self.points(p)})

    def _ablated(self, p: str) -> bool:
        return self.ablate and p in ("small", "shard8") and bool(self.points(p))

    def _timelined(self, p: str) -> bool:
        return p == "shard8" and bool(self.points(p))

    def _n_builds(self) -> int:
        n = 0
        for p in self.presets:
            n += 1 + len(self.tokens(p))
            n += len(ablation_names()) if self._ablated(p) else 0
            n += (2 if self.timeline and self._timelined(p) else 0) + (1 if self.detail and self._timelined(p) else 0)
        return n

    def items(self, stage: str = "megakernel") -> list:
        import math
        import os
        from functools import partial

        from microbench.progress import Item

        from . import baselines as B
        from .bench_baselines import release, weights_for

        def item(name, fn, kind, groups=(), size=1.0, always=False):
            return Item(stage, name, fn, kind, size, tuple(groups), always)

        n = self._n_builds()
        workers = self.compile_workers or max(1, min(n, os.cpu_count() or 1, 16))
        out = [item("compile", self._compile, "compile", size=math.ceil(n / workers)),
               item("build", self._build, "build")]
        for p in self.presets:
            g, gb, gp = f"megakernel/{p}", f"baselines/{p}", f"peers/{p}"
            out.append(item(f"{p} weights", partial(weights_for, p), "weights", (g, gb, gp)))
            for t, c in CHECK_POINTS.get(p, []):
                out.append(item(f"{p} check T={t} ctx={c}", partial(self._check, p, t, c), f"check/{p}", (g,)))
            if p in ("tiny", "small"):
                out.append(item(f"{p} greedy", partial(self._greedy, p), "greedy", (g,)))
            for t, c in self.points(p):
                for mode in ("chain", "mega"):
                    out.append(item(f"{p} T={t} ctx={c} {mode}", partial(self._time, p, t, c, mode), f"time/{p}",
                                    (g,)))
            bpts = self.baseline_points(p)
            if bpts:
                out.append(item(f"{p} acceptance", partial(self._acceptance, p), "acceptance", (gb,)))
                for t, c in bpts:
                    for b in B.BASELINES:
                        out.append(item(f"{p} T={t} ctx={c} {b}", partial(self._baseline, p, t, c, b), "baseline",
                                        (gb,)))
            for name, fn in PEERS.items():
                only = getattr(fn, "quick_tokens", None) if self.quick else None
                for t, c in self.points(p):
                    if only is None or t in only:
                        out.append(item(f"{p} T={t} ctx={c} {name}", partial(self._peer, name, p, t, c), "peer",
                                        (gp,)))
            if self._ablated(p):
                for impl in ablation_names():
                    out.append(item(f"{p} ablation {impl}", partial(self._ablation, p, impl), f"ablation/{p}", (g,)))
            if self.timeline and self._timelined(p):
                out.append(item(f"{p} timeline", partial(self._timeline, p, False), "timeline", (g,)))
            if self.detail and self._timelined(p):
                out.append(item(f"{p} timeline detail", partial(self._timeline, p, True), "timeline", (g,)))
            out.append(item(f"{p} release", partial(release, p), "release", always=True))
        out.append(item("save", self._save, "save", always=True))
        return out

    # ------------------------------------------------------------------ state
    @property
    def h(self):
        if self._h is None:
            from microbench.harness import Harness, Policy

            q = self.quick
            self._h = Harness(policy=Policy(budget_s=0.3 if q else 1.0, max_samples=100 if q else 400, chunk=8))
        return self._h

    @property
    def ceiling(self):
        if self._ceiling is None:
            from .roofline import read_ceiling

            self._ceiling = read_ceiling(self.h.info.name)
        return self._ceiling

    def plan(self, p: str, t: int | None = None) -> Plan:
        """The build for max_tree tokens (t None) or the one a t-token step runs (plan.expert1_unit_rows)."""
        if (p, t) not in self._plans:
            kw = {} if t is None else {"tokens": t}
            self._plans[(p, t)] = plan_for(p, self.constants, self.h.info.sm_count, **kw)
        return self._plans[(p, t)]

    def plans_needed(self) -> list[Plan]:
        """Every build the items will ask for (the compile item's list)."""
        sm = self.h.info.sm_count
        out = []
        for p in self.presets:
            out.append(self.plan(p))
            out += [self.plan(p, t) for t in self.tokens(p)]
            if not self.points(p):
                continue
            t = self.points(p)[-1][0]
            if self._ablated(p):
                for sw, _ in ablation_variants(self.constants, sm).values():
                    out.append(plan_for(p, self.constants, sm, tokens=t, **sw))
            if (self.timeline or self.detail) and self._timelined(p):  # timeline(): unprofiled and profiled
                out.append(plan_for(p, self.constants, sm, tokens=t, profile=False, profile_cap=128))
            if self.timeline and self._timelined(p):
                out.append(plan_for(p, self.constants, sm, tokens=t, profile=True, profile_cap=128))
            if self.detail and self._timelined(p):
                out.append(plan_for(p, self.constants, sm, tokens=t, profile=True, profile_detail=True,
                                    profile_cap=1024))
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------ the items' work
    def _compile(self) -> int:
        import multiprocessing as mp
        import os
        from concurrent.futures import ProcessPoolExecutor

        from microbench.compiler import cache_dir

        from .precompile import _one

        plans = self.plans_needed()
        workers = self.compile_workers or max(1, min(len(plans), os.cpu_count() or 1, 16))
        t0 = time.perf_counter()
        if workers == 1:
            for pl in plans:
                _one(pl)
        else:  # spawned, not forked: this process holds a CUDA context
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
                list(ex.map(_one, plans))
        self.log(f"  {len(plans)} builds compiled or found in {cache_dir()} by {workers} processes in "
                 f"{time.perf_counter() - t0:.1f} s")
        return len(plans)

    def _build(self) -> None:
        import dataclasses

        r = build_result({p: self.plan(p) for p in self.presets}, code_budget(self.constants))
        self.results.append(dataclasses.replace(r, env=constants_env(r.env, self.constants)))
        from microbench.sass import find_nvdisasm

        # the critical-path model's cold-code column reads the code per op of the build it timed
        if find_nvdisasm() is not None and "shard8" in self.presets:
            try:  # an aid to the report's model, not a measurement: its failure is a note, not a failed build
                self.results.append(code_result([("shard8", 16)], self.h.info.sm_count, self.constants))
            except Exception as e:  # noqa: BLE001 (named in the run's notes)
                self.notes.append(f"megakernel.code not made: {type(e).__name__}: {e}")
        else:
            self.notes.append("megakernel.code not made (no nvdisasm, or no shard8 preset): the critical path's "
                              "cold-code column reads the newest one (`python -m megakernel.cli code --save`)")

    def _check(self, p: str, t: int, ctx: int) -> None:
        c = check_point(p, t, ctx, self.plan(p, t))
        self.checks.append(c)
        self.log(f"  check {p} T={t} ctx={ctx}: rel err {c.rel_err:.2e}, mega == chain bitwise (logits, KV), "
                 f"repeat identical, real routing bitwise (logits, KV)")

    def _greedy(self, p: str) -> None:
        n = greedy_check(p, self.plan(p))
        self.notes.append(f"{p}: greedy decoding over {n} steps equals the reference's tokens")
        self.log(f"  greedy {p}: {n} steps equal")

    def _time(self, p: str, t: int, ctx: int, mode: str) -> None:
        s = bench_point(self.h, p, t, ctx, self.plan(p, t), mode, self.ceiling)
        self.series.append(s)
        self._say(s)

    def _collector(self):
        if self._col is None:
            from .bench_baselines import Collector

            self._col = Collector(quick=self.quick, strict=True)  # the harness policy model.baselines always had
        return self._col

    def _acceptance(self, p: str) -> None:
        self._collector().acceptance(p)

    def _baseline(self, p: str, t: int, ctx: int, b: str) -> None:
        s = self._collector().case(p, t, ctx, b)
        self._say(s)

    def _peer(self, name: str, p: str, t: int, ctx: int) -> None:
        s = PEERS[name](self.h, p, t, ctx, self.ceiling, constants=self.constants)
        self.series.append(s)
        self._say(s)

    def _say(self, s: Series) -> None:
        launches = f", {s.metrics['launches_per_step']} launches" if "launches_per_step" in s.metrics else ""
        frac = f", {s.fraction_of_bound:.1%} of roofline" if s.fraction_of_bound else ""
        self.log(f"  {s.name}: {s.summary.median * 1e3:.3f} ms{launches}{frac}")

    def _ablation(self, p: str, impl: str) -> None:
        t, ctx = self.points(p)[-1]
        self.series.append(ablation_point(self.h, p, t, ctx, self.constants, self.ceiling, impl, self.log))

    def _timeline(self, p: str, detail: bool) -> None:
        t, ctx = self.points(p)[-1]
        self.results.append(timeline(self.h, p, t, ctx, self.constants, log=self.log, detail=detail))

    def _save(self) -> list:
        derived = {}
        by = {(s.params["preset"], s.params["T"], s.params["ctx"], s.params["impl"]): s for s in self.series}
        for (p, t, ctx, impl), s in by.items():
            if impl.startswith("mega") and (p, t, ctx, "chain") in by:
                ch = by[(p, t, ctx, "chain")]
                derived[f"speedup_vs_chain/{p}/T{t}/ctx{ctx}/{impl}"] = Derived(
                    ch.summary.median / s.summary.median, "x", "median chain step time / median mega step time "
                    "(both replayed from CUDA graphs)", inputs=(ch.name, s.name))
        if self.checks:
            derived["max_rel_err_vs_reference"] = Derived(
                max(c.rel_err for c in self.checks), "", "max over the checked points of ||mega - reference|| / "
                "||reference|| (reference routing forced)")
        notes = self.notes + [f"checked {c.preset} T={c.n_tokens} ctx={c.ctx}: rel err {c.rel_err:.2e}; mega == chain "
                              f"bitwise (logits, KV caches), repeated mega run bitwise identical, bitwise with the "
                              f"kernel's own routing (logits, tokens, KV caches)" for c in self.checks]
        if self.series or self.checks:
            env = constants_env(None, self.constants)  # which constants revision the builds read
            self.results.append(Result("megakernel.step", env, tuple(self.series), derived,
                                       quick=self.quick, notes=tuple(notes)))
        if self._col is not None and self._col.series:
            self.results.append(self._col.result(save=False))
        if self.save:
            for r in self.results:
                self.log(f"  saved {r.save()}")
        return self.results


def run(quick: bool = True, constants=None, save: bool = True, presets=PRESETS, log=print, ablate: bool = True,
        timeline: bool | None = None, detail: bool = False, baselines: bool = False):
    """Checks, then timings (Stage), every item in order; the first failure raises. Returns the
    Results (saved unless save=False)."""
    st = Stage(quick, constants, save, presets, log, ablate, timeline, detail, baselines)
    for it in st.items():
        it.fn()
    return st.results
