"""The megakernel's measurements on a GPU, each a function of (preset, tokens, context, plan):
correctness (`check_point`: mega == chain bitwise on logits and KV caches, repeated runs
identical, within REL_TOL of the torch reference; `greedy_check`), the step's time replayed from a
CUDA graph (`bench_point`, against the roofline), the build's resources (`build_result`,
`code_result`), the ablation and the profiled timeline. Every timed engine is checked against the
reference before its timing counts.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from microbench.clocks.profiler import edge_series
from microbench.errors import CompileError, CorrectnessError
from microbench.results import Bound, Derived, Result, Series, results_root

from .bench_baselines import step_context, weights_for
from .build import build_gpu, code_bytes_by_op
from .kernel_count import count_kernels
from .plan import Plan
from .plans import (PROFILE_SAMPLE_EVERY, REL_TOL, ablation_names, ablation_variants, constants_env, middle_launch,
                    plan_for, profile_samples, slot_units)
from .profile_events import TOPK_STEPS
from .reference import KVCache, greedy
from .results_names import step_params, step_series_name
from .roofline import read_ceiling, roofline
from .runtime import Engine, check_close
from .spans import (BOUNDARY_SEGMENTS, SEGMENTS, detail_by_op, end_tails, layer_segments, slot_crossings, topk_steps,
                    unit_boundaries)


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


def timeline(h, preset: str, n_tokens: int, ctx: int, constants, out_dir=None, log=print,
             detail: bool = False) -> Result:
    """One profiled step of the default build (the tuned constants' techniques, what the `mega`
    rows time): per-block op phases as megakernel.timeline series, a
    Perfetto trace and a PNG, the profiler's cost (profiled vs unprofiled step, same graph method)
    and the bitwise identity of the profiled outputs. detail: the build also stamps staging and
    ring waits inside units (megakernel.timeline_detail, with each op's time in them; more
    stamps, so more overhead than the plain timeline)."""


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
