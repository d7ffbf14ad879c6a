"""megakernel.peer: the competent baselines beside the megakernel, in one run on the GPU.

    megabench mk peer-bench [--points shard8:16:2048,...] [--compile-budget S] [--no-save]
    megabench mk peer-bench --compile-only      # no GPU: sm_90a registers / spills of every kernel
    MEGABENCH_CACHE=.cache-mb megabench mk peer-bench --precompile   # no GPU: the megakernel builds
    megabench mk peer-bench --markdown RESULT.json   # no GPU: a saved result as the note's tables

Per point (preset, T, ctx; default the pipeline's quick points shard8 T=16, T=1 and small T=16):
  impl           what                                                        routing
  peer           peer.py: Triton fused MoE (NVFP4 in registers, routed experts  forced, real
                 only, tuned block sizes), cuBLAS, Triton flash-decoding tree
                 attention, fused norms, one CUDA graph
  peer_compile   the same step, its torch parts through torch.compile           forced
                 (max-autotune-no-cudagraphs; the whole step still one graph)
  chain          our kernel chain, one launch per op, with PDL (launch_pdl_flags) forced, real
  chain_nopdl    the same chain without PDL                                      forced, real
  mega           the megakernel                                                 forced, real
"forced" replays the synthetic routing the other timings use (49 distinct experts per layer at
shard8 T=16, the study's count); "real" lets each build's own top-k route (random weights: about
as many distinct experts as uniform routing gives), each row's roofline from the reference's
own routing of the same inputs. Every row is checked before it is timed: the peer against
reference.step with the megakernel's bound (plans.REL_TOL) on logits and every layer's KV cache
(forced and real routing; runtime.check_close), the chain's and chain_nopdl's logits bitwise equal
to mega's. Greedy decoding with the peer over 64 steps equals the reference's on small.

The fused MoE's block sizes come from a sweep (peer.SWEEP) run first at every point on its real
routing and weights, recorded as series; the chosen config is in the step series' metrics.
Per-kernel accounting of the peer (un-graphed steps, CUPTI kernel durations from torch.profiler:
timer "cupti"; CUDA events per op where the profiler attributes nothing): each op's time per step and its bytes' fraction of the read ceiling, the target for
the fused MoE at T=16 being >= 40%.

Step series follow reports/megakernel.py: params impl / preset / tokens / context / routing,
metrics launches_per_step, bytes_per_step, roofline_s, Bound("time", roofline_s). Derived:
mega's speed-up over each other row at the same point and routing.

In `megabench run` (megakernel.pipeline.PEERS), within its time budget: `peer_point` (the peer's
step, block sizes from the newest megakernel.peer sweep) and chain_nopdl at every timed point,
saved in megakernel.step beside chain (now with PDL) and mega; at the batched points
(megakernel.pipeline.BATCH_PEERS, full runs or --batches) `peer_batch_point`: the peer at B
requests a step (peer.BatchPeerRunner) beside batch.bench_batch_point's mega and chain.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from microbench.device import no_gpu_reason
from microbench.errors import CorrectnessError
from microbench.fmt import fmt
from microbench.harness import Harness, Policy
from microbench.results import REPO_ROOT, Bound, Derived, Env, Result, Series, latest, load, results_root

from . import bench_baselines, reference
from .baselines import compile_stats
from .bench_baselines import step_context, weights_for
from .build import build_gpu
from .config import preset as get_preset
from .kernel_count import count_kernels
from .measure import graph_of
from .batch import batch_context, batch_series_name
from .peer import (OPS, SWEEP, TIE_GAP, BatchPeerRunner, PeerModel, PeerRunner, StepGraph, available, check_batch_step,
                   check_step, default_moe_configs, distinct_of, free_compiled, greedy, kernel_times, op_bytes,
                   route_tie_gap, tune_moe, unsupported)
from .plans import REL_TOL, plan_for
from .results_names import step_params, step_series_name
from .roofline import batch_roofline, read_ceiling, roofline
from .runtime import Engine, check_close

BENCHMARK = "megakernel.peer"
POINTS = (("shard8", 16, 2048), ("shard8", 1, 2048), ("small", 16, 512))  # the pipeline's quick points (not small T=1)
GREEDY_PRESETS = ("small",)
GREEDY_STEPS, GREEDY_PROMPT = 64, (3, 14, 15, 92)
COMPILE_BUDGET_S = 60.0  # torch.compile wall time per run, over all points; later points skip it past this
FUSED_MOE_TARGET = 0.40  # the target: the fused MoE at >= 40% of the read ceiling at T=16
ACCOUNTING_SLACK = 1.05  # the peer's kernels may sum to this much of its graph step (clocks of profiled passes)
TIMER_NOTES = {"cupti": "CUPTI durations (torch.profiler) of the kernels launched under the op's range, summed "
                        "per un-graphed step (the gaps between them not counted)",
               "cuda_event": "CUDA events around the op in an un-graphed step (the profiler attributed no time to the "
                             "ops' ranges): includes the launch gap before the op, an upper bound for short ops"}


@dataclass
class _Ctx:
    """What one run collects."""
    h: object
    ceiling: tuple[float, str]
    log: object
    series: list
    notes: list
    failures: list
    compile_left: float


def _sync():
    if bench_baselines.DEVICE.startswith("cuda"):  # the CPU dry run sets "cpu"
        torch.cuda.synchronize()


def _real_reference(preset: str, n_tokens: int, ctx: int):
    """reference.step with its own top-k on the point's inputs: (logits, cache, routes per layer)."""
    key = (preset, n_tokens, ctx)
    if key not in _REAL:
        sc = step_context(preset, n_tokens, ctx)
        w = weights_for(preset)
        cache = sc.cache0.clone()
        tr = reference.Trace()
        logits = reference.step(w, cache, sc.tokens, sc.parents, ctx, trace=tr)
        routes = [tr.tensors[f"L{l}.route"].cpu() for l in range(w.cfg.n_layers)]
        del tr
        _REAL[key] = (logits, cache, routes)
    return _REAL[key]


_REAL: dict = {}


def _reference_on_routes(preset: str, n_tokens: int, ctx: int, routes):
    """reference.step with `routes` forced: (logits, cache, the worst route_tie_gap over layers,
    measured on the router logits the reference computes on that very history)."""
    sc = step_context(preset, n_tokens, ctx)
    w = weights_for(preset)
    cache = sc.cache0.clone()
    tr = reference.Trace()
    logits = reference.step(w, cache, sc.tokens, sc.parents, ctx, routes=[r.to(w.device) for r in routes], trace=tr)
    gap = max(route_tie_gap(tr.tensors[f"L{l}.router_logits"], routes[l]) for l in range(w.cfg.n_layers))
    return logits, cache, gap


def _step_series(c: _Ctx, preset, n_tokens, ctx, impl, routing, samples, distinct, launches, extra_metrics=None,
                 clocks=None, warnings=(), params_extra=None) -> Series:
    cfg = get_preset(preset)
    rf = roofline(cfg, n_tokens, ctx, distinct, ceiling=c.ceiling)
    dmean = float(np.mean(distinct)) if not isinstance(distinct, int) else float(distinct)
    name = step_series_name(preset, n_tokens, ctx, impl if routing == "forced" else f"{impl}@real")
    bound = Bound("time", rf.seconds, "s", f"roofline: {rf.bytes.total} B / {rf.read_ceiling:.4g} B/s ({rf.source})")
    metrics = {"launches_per_step": launches, "bytes_per_step": rf.bytes.total, "roofline_s": rf.seconds,
               "tokens_per_step": n_tokens, "distinct_experts_mean": dmean, **(extra_metrics or {})}
    s = Series.from_samples(name, samples, timer="cuda_event", unit="s",
                            params=step_params(preset, n_tokens, ctx, impl, round(dmean), routing=routing,
                                               launch="cuda_graph", **(params_extra or {})),
                            bound=bound, clocks=clocks or {}, warnings=warnings, metrics=metrics)
    c.series.append(s)
    c.log(f"  {name}: {s.summary.median * 1e3:.3f} ms, {launches:g} launches, {s.fraction_of_bound:.1%} of roofline")
    return s


def _attempt(c: _Ctx, what: str, fn):
    """Run one row's work; a failure is reported (note + stderr) and the run goes on."""
    try:
        return fn()
    except Exception as e:
        msg = f"{what}: FAILED: {e.__class__.__name__}: {e}"
        c.notes.append(msg)
        c.failures.append(msg)
        print(msg, file=sys.stderr)
        return None
    finally:
        gc.collect()


# ---------------------------------------------------------------------- the megakernel's rows
def megakernel_rows(c: _Ctx, preset: str, n_tokens: int, ctx: int, constants=None, rows=None) -> None:
    """mega / chain (PDL) / chain_nopdl from one engine. rows: {routing: modes to time}
    (default every mode, forced and real). Every mode run is checked bitwise against mega's
    logits and tokens first; forced mega against the reference (plans.REL_TOL)."""
    rows = rows or {"forced": ("mega", "chain", "chain_nopdl"), "real": ("mega", "chain", "chain_nopdl")}
    sc = step_context(preset, n_tokens, ctx)
    w = weights_for(preset)
    plan = plan_for(preset, constants, c.h.info.sm_count, tokens=n_tokens)
    eng = Engine(w, plan, sc.cache0.clone(), backend="gpu")
    for routing, modes in rows.items():
        routes = [r.cuda() for r in sc.routes] if routing == "forced" else None
        outs = {m: eng.step(sc.tokens, sc.parents, ctx, mode=m, routes=routes) for m in ("mega", *modes)}
        for m in modes:
            if not (torch.equal(outs[m].logits, outs["mega"].logits) and torch.equal(outs[m].tokens, outs["mega"].tokens)):
                raise RuntimeError(f"{preset} T={n_tokens} ctx={ctx} {routing} routing: {m} differs bitwise from mega")
        if routing == "forced":
            check_close(outs["mega"].logits, sc.ref_logits, f"{preset} T={n_tokens} ctx={ctx}: megakernel vs "
                        "reference", rel=REL_TOL)
            distinct = sc.distinct
        else:
            distinct = _distinct(_real_reference(preset, n_tokens, ctx)[2])
        for m in modes:
            eng.prepare(sc.tokens, sc.parents, ctx, routes)
            kc = count_kernels(lambda: eng.launch_step(m))
            g, per = graph_of(eng, m)
            t = c.h.time(g.replay)
            _step_series(c, preset, n_tokens, ctx, m, routing, np.asarray(t.samples_s) / per, distinct,
                         kc.kernels_per_step, {"pdl_launches_per_step": int(sum(eng.launch_pdl(m))), "grid": eng.grid,
                                               "smem_bytes": plan.smem_bytes}, t.clocks, t.warnings)
            del g
    del eng


def _distinct(routes) -> list[int]:
    return distinct_of(routes)


# ---------------------------------------------------------------------- the peer's rows
def _peer_model(preset: str):
    if preset not in _MODELS:
        _MODELS[preset] = PeerModel(weights_for(preset))
    return _MODELS[preset]


_MODELS: dict = {}


def release(preset: str | None = None) -> None:
    """Forget the peer models and real-routing references of a preset (all when None); the GPU
    memory goes with the next collection (bench_baselines.release calls this)."""
    for k in [k for k in _MODELS if preset is None or k == preset]:
        del _MODELS[k]
    for k in [k for k in _REAL if preset is None or k[0] == preset]:
        del _REAL[k]


bench_baselines.RELEASE_HOOKS.append(release)  # bench_baselines.release frees the peer's models too


def _restore(cache, cache0) -> None:
    """cache's contents back to cache0's, in place (runners keep pointers to its tensors)."""
    for a, b in zip(cache.k + cache.v, cache0.k + cache0.v):
        a.copy_(b)


def _time_runner(c: _Ctx, runner, check):
    """Capture the runner's step in one graph, check what a replay computed (check(logits): the
    reference check of the un-graphed step, on the replay's logits and caches), time the
    replays. Returns (timing, the kernel count of one un-graphed step)."""
    kc = count_kernels(runner.run)  # un-graphed: CUPTI sees every kernel (a graph replay may hide them)
    g = StepGraph(runner)
    g.replay()
    _sync()
    check(g.logits)
    t = c.h.time(g.replay)
    return t, kc


def _check_and_time(c: _Ctx, r, cache, sc, what: str, replay_what: str):
    """Run the forced-routing step once and check it against the reference (logits and every
    layer's KV cache), then capture, check a replay the same way and time the replays: (check,
    timing, kernel count)."""
    logits = r.run()
    _sync()
    chk = check_step(r, logits, cache, sc.ref_logits, sc.ref_cache, what, REL_TOL)
    t, kc = _time_runner(c, r, lambda lg: check_step(r, lg, cache, sc.ref_logits, sc.ref_cache, replay_what, REL_TOL))
    return chk, t, kc


def peer_rows(c: _Ctx, preset: str, n_tokens: int, ctx: int, *, tune: bool = True, compile: bool = True,
              routings=("forced", "real"), accounting: bool = True) -> None:
    sc = step_context(preset, n_tokens, ctx)
    m = _peer_model(preset)
    tag = f"{preset}/T{n_tokens}/ctx{ctx}"
    cache = sc.cache0.clone()
    r = PeerRunner(m, cache, sc.parents, r_read=ctx, forced=True, n_sm=c.h.info.sm_count)
    r.set_inputs(sc.tokens, ctx, sc.routes)
    if tune:
        c.log(f"  {tag}: fused-MoE block sizes sweep")
        t0 = time.perf_counter()
        records, up, down = tune_moe(c.h, r, log=c.log)
        for rec in records:
            if rec.median_s is not None:
                c.series.append(Series.from_samples(
                    f"{tag}/tune/{rec.kernel}/{rec.config}", rec.samples, timer="cuda_event", unit="s",
                    params={"preset": preset, "tokens": n_tokens, "context": ctx, "kernel": rec.kernel,
                            "config": rec.config, "kind": "peer_tune"},
                    metrics={"chosen": int(rec.config == (up if rec.kernel == "moe_up" else down).label()),
                             "per": "device time of one sample (the kernel once for every layer, each on its own "
                                    "experts, launches queued behind the harness's blocking kernel) / layers"}))
            else:
                c.notes.append(f"{tag} tune {rec.kernel} {rec.config}: dropped ({rec.error})")
        c.notes.append(f"{tag}: fused MoE tuned in {time.perf_counter() - t0:.0f} s: moe_up {up.label()}, "
                       f"moe_down {down.label()} (sweep {len(records)} configs, CUDA-event timed)")
        _restore(cache, sc.cache0)  # the sweep's step wrote the tree's rows: fresh for the check
    cfg_metrics = {"moe_up_config": m.up_cfg.label(), "moe_down_config": m.down_cfg.label()}
    chk, t, kc = _check_and_time(c, r, cache, sc, f"{tag} peer (forced routing)", f"{tag} peer graph replay")
    c.notes.append(f"checked {chk.describe()} (bound {REL_TOL:.0e})")
    _step_series(c, preset, n_tokens, ctx, "peer", "forced", t.samples_s, sc.distinct, kc.kernels_per_step,
                 {**cfg_metrics, "host_launch_calls_per_step": kc.launch_calls, "ref_rel_err": chk.rel_err,
                  "ref_kv_rel_err": chk.kv_rel_err, "extra_weight_bytes": m.extra_bytes}, t.clocks, t.warnings)
    if accounting:
        _attempt(c, f"{tag} peer per-kernel accounting", lambda: kernel_rows(c, r, preset, n_tokens, ctx, sc.distinct,
                                                                           float(np.median(t.samples_s))))
    del r
    if "real" in routings:
        def real():
            ref_logits, ref_cache, ref_routes = _real_reference(preset, n_tokens, ctx)
            cache_r = sc.cache0.clone()
            rr = PeerRunner(m, cache_r, sc.parents, r_read=ctx, forced=False, n_sm=c.h.info.sm_count)
            rr.set_inputs(sc.tokens, ctx)
            out = rr.run()
            _sync()
            got = [rr.routes[l].long().cpu() for l in range(rr.cfg.n_layers)]
            if all(torch.equal(a.sort(-1).values, b.long().cpu().sort(-1).values) for a, b in zip(got, ref_routes)):
                ch = check_step(rr, out, cache_r, ref_logits, ref_cache, f"{tag} peer (real routing)", REL_TOL,
                                ref_routes)
            else:
                # the peer's own top-k flipped a near tie (bf16 router input against the reference's
                # fp32): the reference run on the peer's routes must match it whole (logits, every
                # layer's KV), and every flip must be a near tie of the reference's router logits
                ref_logits, ref_cache, gap = _reference_on_routes(preset, n_tokens, ctx, got)
                if gap > TIE_GAP:
                    raise CorrectnessError(f"{tag} peer (real routing): its routing chose experts the reference ranks "
                                           f"{gap:.1%} of a row's logit spread below its k-th (near ties: <= {TIE_GAP:.0%})")
                ch = check_step(rr, out, cache_r, ref_logits, ref_cache, f"{tag} peer (real routing, the reference on "
                                f"the peer's routes; flips within {gap:.2%} of the spread)", REL_TOL)
                ref_routes = got
            c.notes.append(f"checked {ch.describe()} (bound {REL_TOL:.0e})")
            tr, kcr = _time_runner(c, rr, lambda lg: check_step(rr, lg, cache_r, ref_logits, ref_cache,
                                                                f"{tag} peer graph replay (real routing)", REL_TOL,
                                                                ref_routes))
            _step_series(c, preset, n_tokens, ctx, "peer", "real", tr.samples_s, _distinct(ref_routes),
                         kcr.kernels_per_step, {**cfg_metrics, "routes_equal_reference": int(ch.routes_equal),
                                                "ref_rel_err": ch.rel_err, "ref_kv_rel_err": ch.kv_rel_err},
                         tr.clocks, tr.warnings)
        _attempt(c, f"{tag} peer real routing", real)
    if compile:
        if c.compile_left <= 0:
            c.notes.append(f"{tag} peer_compile: skipped (this run's torch.compile budget of {COMPILE_BUDGET_S:.0f} s "
                           "is spent)")
        else:
            _attempt(c, f"{tag} peer_compile", lambda: compile_rows(c, preset, n_tokens, ctx))


def compile_rows(c: _Ctx, preset: str, n_tokens: int, ctx: int) -> None:
    sc = step_context(preset, n_tokens, ctx)
    m = _peer_model(preset)
    tag = f"{preset}/T{n_tokens}/ctx{ctx}"
    cache = sc.cache0.clone()
    r = PeerRunner(m, cache, sc.parents, r_read=ctx, forced=True, small_ops="torch", compile=True,
                   n_sm=c.h.info.sm_count)
    r.set_inputs(sc.tokens, ctx, sc.routes)
    try:
        secs = r.compile_now()
        c.compile_left -= secs
        st = compile_stats()
        _restore(cache, sc.cache0)
        chk, t, kc = _check_and_time(c, r, cache, sc, f"{tag} peer_compile", f"{tag} peer_compile graph replay")
        c.notes.append(f"checked {chk.describe()} (bound {REL_TOL:.0e}); compiled in {secs:.1f} s, {st}")
        _step_series(c, preset, n_tokens, ctx, "peer_compile", "forced", t.samples_s, sc.distinct, kc.kernels_per_step,
                     {"compile_s": secs, **{f"compile_{k}": v for k, v in st.items()},
                      "compile_mode": "max-autotune-no-cudagraphs (the step: one CUDA graph of ours)",
                      "moe_up_config": m.up_cfg.label(), "moe_down_config": m.down_cfg.label(),
                      "ref_rel_err": chk.rel_err, "ref_kv_rel_err": chk.kv_rel_err}, t.clocks, t.warnings)
    finally:
        del r
        free_compiled()


def kernel_rows(c: _Ctx, runner, preset: str, n_tokens: int, ctx: int, distinct, step_s: float) -> None:
    """Per-op device time of the peer (CUPTI, un-graphed) and its bytes' fraction of the read ceiling."""
    cfg = runner.cfg
    per = distinct if not isinstance(distinct, int) else [distinct] * cfg.n_layers
    kernels: dict = {}
    times, timer = kernel_times(runner, steps=3, breakdown=kernels)
    nbytes = op_bytes(cfg, n_tokens, ctx, per)
    ceiling, src = c.ceiling
    tag = f"{preset}/T{n_tokens}/ctx{ctx}"
    med = {op: float(np.median(times[op])) for op in OPS if op in times}
    total = sum(med.values())
    for op, mt in med.items():
        b = nbytes[op]
        c.series.append(Series.from_samples(
            f"{tag}/peer_kernel/{op}", times[op], timer=timer, unit="s",
            params={"preset": preset, "tokens": n_tokens, "context": ctx, "op": op, "kind": "peer_kernel"},
            bound=Bound("time", b / ceiling, "s", f"{b} B the op must move per step / read ceiling {ceiling:.4g} B/s "
                                                   f"({src})"),
            metrics={"bytes_per_step": b, "read_fraction": b / mt / ceiling if mt else 0.0,
                     "share_of_kernel_time": mt / total if total else 0.0,
                     "kernels": kernels.get(op, {}),
                     "timer_note": TIMER_NOTES[timer], "gated": False,
                     "not_gated_reason": "per-kernel accounting of 3 un-graphed, profiled passes; the step "
                                         "series beside it carries the peer's timing"}))
    moe = [s for s in c.series if s.name in (f"{tag}/peer_kernel/moe_up", f"{tag}/peer_kernel/moe_down")]
    if moe:
        b = sum(s.metrics["bytes_per_step"] for s in moe)
        tm = sum(s.summary.median for s in moe)
        frac = b / tm / ceiling if tm else 0.0  # 0: the profiler attributed no kernel to the MoE's ranges
        c.notes.append(f"{tag}: peer fused MoE (up + down) {b / 1e6:.1f} MB in {tm * 1e3:.3f} ms per step = "
                       f"{frac:.1%} of the read ceiling (target >= {FUSED_MOE_TARGET:.0%} at T=16)"
                       + ("" if frac >= FUSED_MOE_TARGET or n_tokens != 16 else
                          " -- SHORT of the target: see reports/notes/peer-baseline.md"))
    c.notes.append(f"{tag}: peer kernels sum to {total * 1e3:.3f} ms of device time per step ({timer}, un-graphed) "
                   f"vs {step_s * 1e3:.3f} ms per graph replay: {max(0.0, 1 - total / step_s):.1%} of the step "
                   "between kernels (launch gaps, tails)")
    if timer == "cupti" and total > ACCOUNTING_SLACK * step_s:
        # one stream: the kernels of a step cannot sum to more than the step, beyond the clocks an
        # un-graphed, profiled pass may run at
        c.notes.append(f"WARNING {tag}: the per-kernel accounting ({total * 1e3:.3f} ms) exceeds the graph step "
                          f"({step_s * 1e3:.3f} ms) by more than {ACCOUNTING_SLACK - 1:.0%}: its op times are suspect")


# ---------------------------------------------------------------------- derived ratios
def ratios(series, measured=()) -> dict[str, Derived]:
    """mega's speed-up over every other impl at the same point and routing (median / median)."""
    rows = {}
    for s in list(measured) + list(series):
        p = s.params
        if "impl" in p and s.unit == "s" and p.get("kind") is None:
            rows[(p["preset"], p["tokens"], p["context"], p.get("routing", "forced"), p["impl"])] = s
    out = {}
    for (pr, t, ctx, routing, impl), s in sorted(rows.items()):
        mega = rows.get((pr, t, ctx, routing, "mega"))
        if mega is None or impl == "mega":
            continue
        out[f"mega_speedup/{pr}/T{t}/ctx{ctx}/{routing}/vs_{impl}"] = Derived(
            s.summary.median / mega.summary.median, "x", f"median {impl} step / median mega step ({routing} routing, "
            "both CUDA-graph replays, device time)", inputs=(s.name, mega.name))
    return out


# ---------------------------------------------------------------------- entry points
def _harness(quick: bool = True):
    return Harness(policy=Policy(budget_s=0.3 if quick else 1.0, max_samples=100 if quick else 400, chunk=8))


def greedy_rows(c: _Ctx, preset: str) -> None:
    w = weights_for(preset)
    ref = reference.greedy(w, reference.KVCache(w.cfg, device=w.device), list(GREEDY_PROMPT), GREEDY_STEPS)
    got = greedy(_peer_model(preset), list(GREEDY_PROMPT), GREEDY_STEPS)
    _sync()
    if got != ref:
        i = next(k for k, (a, b) in enumerate(zip(got, ref)) if a != b)
        raise CorrectnessError(f"{preset}: the peer's greedy decoding diverges from the reference at step {i}: "
                               f"{got[i:i + 5]} vs {ref[i:i + 5]}")
    c.notes.append(f"{preset}: the peer's greedy decoding over {GREEDY_STEPS} steps (one CUDA graph replayed per "
                   "step) equals the reference's tokens")
    c.log(f"  greedy {preset}: peer {GREEDY_STEPS} steps equal to the reference")


def run(points=POINTS, save: bool = True, log=print, constants=None, compile: bool = True, mega: bool = True,
        quick: bool = True, compile_budget_s: float = COMPILE_BUDGET_S, greedy_presets=None,
        h=None) -> Result:
    """The standalone run: every row at every point (see the module docstring). greedy_presets:
    default GREEDY_PRESETS; h: a harness (default a fresh one, which needs the GPU)."""
    if h is None:
        why = available()
        if why:
            raise RuntimeError(f"the peer baseline cannot run here: {why}")
        h = _harness(quick)
    c = _Ctx(h, read_ceiling(h.info.name), log, [], [], [], compile_budget_s)
    greedy_presets = GREEDY_PRESETS if greedy_presets is None else greedy_presets
    t_start = time.perf_counter()
    for i, (p, T, ctx) in enumerate(points):
        t0 = time.perf_counter()
        if mega:
            _attempt(c, f"{p}/T{T}/ctx{ctx} megakernel rows", lambda: megakernel_rows(c, p, T, ctx, constants))
        _attempt(c, f"{p}/T{T}/ctx{ctx} peer rows", lambda: peer_rows(c, p, T, ctx, compile=compile))
        log(f"  {p} T={T} ctx={ctx}: {time.perf_counter() - t0:.1f} s")
        if not any(q == p for q, _, _ in points[i + 1:]):
            if p in greedy_presets:
                _attempt(c, f"{p} peer greedy", lambda: greedy_rows(c, p))
            _MODELS.pop(p, None)
            for k in [k for k in _REAL if k[0] == p]:
                del _REAL[k]
            bench_baselines.release(p)
    c.notes.append(f"read ceiling {c.ceiling[0]:.4g} B/s: {c.ceiling[1]}")
    c.notes.append(f"wall time {time.perf_counter() - t_start:.0f} s")
    res = Result(BENCHMARK, Env.capture(h.device_index), tuple(c.series), ratios(c.series), quick=quick,
                 notes=tuple(c.notes))
    if save:
        path = res.save()
        log(f"  saved {path}")
    return res


def tuned_configs(preset: str, n_tokens: int, roots=None, gpu: str | None = None):
    """(up, down, source): the block sizes the newest megakernel.peer run's sweep on GPU model `gpu`
    (None: any, for tools without a GPU) chose for this preset and T (its peer_tune series with
    chosen=1), else peer.default_moe_configs(). Tuned block sizes never cross GPU models, as the
    megakernel's constants do not: another model's sweep timed other SMs and another memory."""
    from . import peer_kernels as K  # heavy: triton (megakernel.peer_kernels)

    best = None
    for root in roots or (results_root(), REPO_ROOT / "reports" / "results"):
        r = latest(BENCHMARK, root=Path(root), gpu=gpu) if Path(root).exists() else None
        if r is not None and (best is None or r.env.date > best.env.date):
            best = r
    got = {}
    if best is not None:
        for s in best.series:
            p = s.params
            if (p.get("kind") == "peer_tune" and p.get("preset") == preset and p.get("tokens") == n_tokens
                    and s.metrics.get("chosen")):
                m = re.fullmatch(r"n(\d+)k(\d+)w(\d+)s(\d+)", str(p.get("config", "")))
                if m:
                    got[p["kernel"]] = K.MoeConfig(*map(int, m.groups()))
    up, down = default_moe_configs()
    if "moe_up" in got and "moe_down" in got:
        return got["moe_up"], got["moe_down"], f"the sweep of {BENCHMARK} {best.env.date} ({best.env.git_sha[:7]})"
    return up, down, f"defaults (no megakernel.peer sweep of this preset and T{f' on {gpu}' if gpu else ''} found)"


def peer_point(h, preset: str, n_tokens: int, ctx: int, ceiling, log=print) -> Series:
    """The pipeline's peer row (megakernel.pipeline.PEERS): the peer's step at one point, forced
    routing, block sizes from tuned_configs; checked (logits and KV caches, the megakernel's bound)
    before and after its graph capture, then timed. Raises where the peer cannot run."""
    why = available() or unsupported(get_preset(preset))
    if why:
        raise RuntimeError(f"the peer baseline cannot run: {why}")
    up, down, src = tuned_configs(preset, n_tokens, gpu=h.info.name)
    sc = step_context(preset, n_tokens, ctx)
    m = PeerModel(weights_for(preset), up, down)
    c = _Ctx(h, ceiling, log, [], [], [], 0.0)
    cache = sc.cache0.clone()
    r = PeerRunner(m, cache, sc.parents, r_read=ctx, forced=True, n_sm=h.info.sm_count)
    r.set_inputs(sc.tokens, ctx, sc.routes)
    tag = f"{preset}/T{n_tokens}/ctx{ctx}"
    chk = check_step(r, r.run(), cache, sc.ref_logits, sc.ref_cache, f"{tag} peer", REL_TOL)
    t, kc = _time_runner(c, r, lambda lg: check_step(r, lg, cache, sc.ref_logits, sc.ref_cache,
                                                      f"{tag} peer graph replay", REL_TOL))
    return _step_series(c, preset, n_tokens, ctx, "peer", "forced", t.samples_s, sc.distinct, kc.kernels_per_step,
                        {"moe_up_config": up.label(), "moe_down_config": down.label(), "moe_configs_from": src,
                         "ref_rel_err": chk.rel_err, "ref_kv_rel_err": chk.kv_rel_err,
                         "host_launch_calls_per_step": kc.launch_calls}, t.clocks, t.warnings)


def peer_batch_point(h, preset: str, batch: int, tokens: int, ctx: int, ceiling, log=print) -> Series:
    """The peer at B requests a step (peer.BatchPeerRunner) beside batch.bench_batch_point's mega
    and chain: batch.batch_context's requests, caches and forced routes; block sizes from
    tuned_configs at the step's B x T rows; every request checked against reference.step_batch
    (logits and every layer's KV cache, plans.REL_TOL) before and after the graph capture, then
    one CUDA graph of the whole step replayed; bound roofline.batch_roofline. Raises where the peer
    cannot run."""
    why = available() or unsupported(get_preset(preset))
    if why:
        raise RuntimeError(f"the peer baseline cannot run: {why}")
    up, down, src = tuned_configs(preset, batch * tokens, gpu=h.info.name)
    bc = batch_context(preset, batch, tokens, ctx, max_rows=batch * tokens)  # the peer takes any B x T
    w = weights_for(preset)
    m = PeerModel(w, up, down)
    c = _Ctx(h, ceiling, log, [], [], [], 0.0)
    caches = [x.clone() for x in bc.caches0]
    r = BatchPeerRunner(m, caches, [q.parents for q in bc.requests], r_read=[int(q.ctx) for q in bc.requests],
                        forced=True, n_sm=h.info.sm_count)
    r.set_requests(bc.requests, bc.routes)
    tag = f"{preset}/B{batch}/T{tokens}/ctx{ctx}"
    chks = check_batch_step(r, r.run(), caches, bc.ref_logits, bc.ref_caches, f"{tag} peer", REL_TOL)
    t, kc = _time_runner(c, r, lambda lg: check_batch_step(r, lg, caches, bc.ref_logits, bc.ref_caches,
                                                            f"{tag} peer graph replay", REL_TOL))
    rf = batch_roofline(w.cfg, bc.shape, bc.distinct, ceiling=ceiling)
    bound = Bound("time", rf.seconds, "s", f"roofline of {batch} requests: {rf.bytes.total} B (experts: the union "
                  f"over the batch, dense weights once, each request's KV) / {rf.read_ceiling:.3e} B/s ({rf.source})")
    s = Series.from_samples(
        batch_series_name(preset, batch, tokens, ctx, "peer"), t.samples_s, timer="cuda_event", unit="s",
        params=step_params(preset, tokens, ctx, "peer", int(round(float(np.mean(bc.distinct)))), batch=batch,
                           launch="cuda_graph"),
        bound=bound, clocks=t.clocks, warnings=t.warnings,
        metrics={"launches_per_step": kc.kernels_per_step, "host_launch_calls_per_step": kc.launch_calls,
                 "bytes_per_step": rf.bytes.total, "roofline_s": rf.seconds, "tokens_per_step": batch * tokens,
                 "requests": batch, "distinct_experts_union_max": max(bc.distinct),
                 "moe_up_config": up.label(), "moe_down_config": down.label(), "moe_configs_from": src,
                 "ref_rel_err": max(x.rel_err for x in chks), "ref_kv_rel_err": max(x.kv_rel_err for x in chks)})
    log(f"  {s.name}: {s.summary.median * 1e3:.3f} ms, {kc.kernels_per_step:g} launches, "
        f"{s.fraction_of_bound:.1%} of roofline")
    return s


def table(res: Result) -> str:
    """A short text table of the step rows and mega's ratios."""
    rows = [s for s in res.series if "impl" in s.params and s.params.get("kind") is None]
    lines = [f"{'point':22s} {'routing':7s} {'impl':13s} {'step ms':>9s} {'launches':>8s} {'roofline':>8s} "
             f"{'mega x':>7s}"]
    by = {(s.params["preset"], s.params["tokens"], s.params["context"], s.params.get("routing", "forced"),
           s.params["impl"]): s for s in rows}
    for (p, t, ctx, routing, impl), s in by.items():
        mega = by.get((p, t, ctx, routing, "mega"))
        ratio = f"{s.summary.median / mega.summary.median:6.2f}x" if mega is not None else ""
        lines.append(f"{p + ' T=' + str(t) + ' ctx=' + str(ctx):22s} {routing:7s} {impl:13s} "
                     f"{s.summary.median * 1e3:9.3f} {s.metrics.get('launches_per_step', 0):8.0f} "
                     f"{(s.fraction_of_bound or 0):8.1%} {ratio:>7s}")
    for s in res.series:
        if s.params.get("kind") == "peer_kernel" and s.params["op"] in ("moe_up", "moe_down", "attn", "lm_head"):
            lines.append(f"  {s.name}: {s.summary.median * 1e6:.1f} us per step, "
                         f"{s.metrics['read_fraction']:.1%} of the read ceiling")
    return "\n".join(lines)


def markdown(res: Result) -> str:
    """The result as the note's markdown: every row's step time, launches, fraction of the
    roofline and mega's ratio to it (same point and routing), the peer's per-kernel accounting,
    the chosen block sizes and the checks, with the run's date, commit and GPU."""
    e = res.env
    out = [f"Run {e.date}, commit {e.git_sha[:7]}, {e.gpu or 'no GPU'} ({BENCHMARK}).", ""]
    rows = [s for s in res.series if "impl" in s.params and s.params.get("kind") is None]
    by = {(s.params["preset"], s.params["tokens"], s.params["context"], s.params.get("routing", "forced"),
           s.params["impl"]): s for s in rows}
    out += ["| point | routing | impl | step time | launches/step | fraction of roofline | mega speed-up |",
            "|---|---|---|---|---|---|---|"]
    for (p, t, ctx, routing, impl), s in by.items():
        mega = by.get((p, t, ctx, routing, "mega"))
        ratio = f"{s.summary.median / mega.summary.median:.2f}x" if mega is not None and impl != "mega" else ""
        out.append(f"| {p} T={t} ctx={ctx} | {routing} | {impl} | {fmt(s.summary.median, 's')} | "
                   f"{s.metrics.get('launches_per_step', 0):.0f} | {(s.fraction_of_bound or 0):.1%} | {ratio} |")
    kern = [s for s in res.series if s.params.get("kind") == "peer_kernel"]
    if kern:
        out += ["", "The peer's kernels (un-graphed steps; timer per row):", "",
                "| point | op | time per step | bytes per step | fraction of the read ceiling | share | timer |",
                "|---|---|---|---|---|---|---|"]
        for s in kern:
            p = s.params
            out.append(f"| {p['preset']} T={p['tokens']} ctx={p['context']} | {p['op']} | {fmt(s.summary.median, 's')} | "
                       f"{fmt(s.metrics['bytes_per_step'], 'B')} | {s.metrics['read_fraction']:.1%} | "
                       f"{s.metrics['share_of_kernel_time']:.1%} | {s.timer} |")
    out += ["", "Notes of the run:", ""] + [f"- {n}" for n in res.notes]
    return "\n".join(out) + "\n"


def compile_report(log=print) -> list[dict]:
    """Without a GPU: compile every peer kernel (the sweep's MoE configs included) for sm_90a and
    report registers, spills, shared memory and whether the dots became wgmma."""
    from . import peer_kernels as K  # heavy: triton (megakernel.peer_kernels)

    ptr = lambda t: f"*{t}"  # noqa: E731
    attn_sig = {"q_ptr": ptr("bf16"), "k_ptr": ptr("bf16"), "v_ptr": ptr("bf16"), "ctx_ptr": ptr("i32"),
                "depth_ptr": ptr("i32"), "anc_ptr": ptr("i32"), "o_ptr": ptr("fp32"), "ml_ptr": ptr("fp32"),
                "T": "i32", "slots": "i32", "ring": "i32", "window": "i32", "scale": "fp32", "n_splits": "i32"}
    out = []
    jobs = []
    for spec in SWEEP:
        cfg = K.MoeConfig(*spec)
        for kind in ("up", "down"):
            fn, sig, ce, al = K.moe_compile_args(kind, cfg)
            jobs.append((f"moe_{kind} {cfg.label()}", fn, sig, ce, cfg.num_warps, cfg.num_stages, al))
    for glob in (True, False):
        for bq in (16, 64):
            jobs.append((f"attn_partial global={glob} BQ={bq}", K._attn_partial_kernel, attn_sig,
                         {"G": 8, "HKV": 1, "HD": 128, "IS_GLOBAL": glob, "BQ": bq, "BLOCK_N": 64, "CHUNK": 128},
                         4, 3, [k for k in attn_sig if k.endswith("_ptr")]))
    aligned = lambda sig: [k for k in sig if k.endswith("_ptr")]  # noqa: E731
    norm_sig = {"x_ptr": ptr("fp32"), "d_ptr": ptr("fp32"), "g_ptr": ptr("bf16"), "h_ptr": ptr("bf16"),
                "tok_ptr": ptr("i64"), "emb_ptr": ptr("bf16"), "D": "i32", "eps": "fp32"}
    for mode in (0, 1, 2):
        jobs.append((f"add_rmsnorm mode={mode}", K._add_rmsnorm_kernel, norm_sig, {"MODE": mode, "BLOCK": 4096}, 8, 3,
                     aligned(norm_sig)))
    rope_sig = {"qkv_ptr": ptr("fp32"), "cos_ptr": ptr("fp32"), "sin_ptr": ptr("fp32"), "ctx_ptr": ptr("i32"),
                "depth_ptr": ptr("i32"), "q_ptr": ptr("bf16"), "kc_ptr": ptr("bf16"), "vc_ptr": ptr("bf16"),
                "ring": "i32", "slots": "i32"}
    for glob in (True, False):
        jobs.append((f"rope_kv global={glob}", K._rope_kv_kernel, rope_sig,
                     {"HQ": 8, "HKV": 1, "HD": 128, "IS_GLOBAL": glob}, 1, 3, aligned(rope_sig)))
    route_sig = {"logits_ptr": ptr("fp32"), "ld": "i32", "forced_ptr": ptr("i32"), "forced": "i32",
                 "ids_ptr": ptr("i32"), "w_ptr": ptr("fp32"), "sorted_ptr": ptr("i32"), "bexp_ptr": ptr("i32"),
                 "nblk_ptr": ptr("i32"), "T": "i32", "E": "i32", "max_blocks": "i32"}
    for t in (1, 16, 128):  # 128: a batch of 8 requests of 16 rows (peer.BatchPeerRunner)
        tc, pc = min(K.ROUTE_ROWS, K._p2(max(t, 2))), min(K.ROUTE_PAIRS, K._p2(max(2, 8 * t)))
        jobs.append((f"route T={t}", K._route_kernel, route_sig,
                     {"K": 8, "KP": 8, "TC": tc, "NTC": -(-t // tc), "EP": 256, "PC": pc, "NPC": -(-8 * t // pc),
                      "BM": K.BLOCK_M, "MAXJ": -(-t // K.BLOCK_M), "FILL": 256}, 4, 3, aligned(route_sig)))
    comb_sig = {"o_ptr": ptr("fp32"), "ml_ptr": ptr("fp32"), "out_ptr": ptr("bf16"), "n_splits": "i32",
                "rows_pad": "i32"}
    jobs.append(("attn_combine", K._attn_combine_kernel, comb_sig, {"G": 8, "HKV": 1, "HD": 128, "NS": 64}, 4, 3,
                 aligned(comb_sig)))
    mc_sig = {"y_ptr": ptr("bf16"), "w_ptr": ptr("fp32"), "z_ptr": ptr("bf16"), "N": "i32"}
    jobs.append(("moe_combine", K._moe_combine_kernel, mc_sig, {"K": 8, "BLOCK": 1024}, 4, 3, aligned(mc_sig)))
    for name, fn, sig, ce, nw, ns, al in jobs:
        try:
            r = K.compile_sm90(fn, sig, ce, nw, ns, aligned=tuple(al))
            r = {"kernel": name, **{k: v for k, v in r.items() if k != "ptxas"}}
        except Exception as e:
            r = {"kernel": name, "error": f"{e.__class__.__name__}: {str(e)[:300]}"}
        out.append(r)
        log(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "kernel"))
    return out


def main(argv=None, prog: str = "python -m megakernel.peer_bench") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=",".join(f"{p}:{t}:{c}" for p, t, c in POINTS),
                    help="comma-separated preset:T:ctx (default: %(default)s)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--compile-budget", type=float, default=COMPILE_BUDGET_S,
                    help="seconds of torch.compile wall time over the run; later points skip it (default %(default)s)")
    ap.add_argument("--no-mega", action="store_true", help="skip the megakernel's rows (peer only)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: compile the peer's kernels for sm_90a, print registers / spills / smem")
    ap.add_argument("--markdown", metavar="RESULT", help="no GPU: print a saved megakernel.peer result as markdown")
    ap.add_argument("--precompile", action="store_true",
                    help="no GPU: build the megakernel builds these points run into MEGABENCH_CACHE (carry it)")
    a = ap.parse_args(argv)
    points = []
    for item in a.points.split(","):
        p, t, ctx = item.split(":")
        points.append((p, int(t), int(ctx)))
    if a.markdown:
        print(markdown(load(a.markdown)), end="")
        return 0
    if a.compile_only:
        rep = compile_report()
        return 1 if any("error" in r for r in rep) else 0
    if a.precompile:
        for p, t in dict.fromkeys((p, t) for p, t, _ in points):
            u = build_gpu(plan_for(p, None, 132, tokens=t)).usage
            print(f"  megakernel {p} T={t}: {u.code_bytes} B, {u.registers} registers, spills {u.spills}")
        return 0

    reason = no_gpu_reason()
    if reason:
        print(f"peer_bench needs a GPU: {reason} (--compile-only works without one)", file=sys.stderr)
        return 2
    if "MEGABENCH_CACHE" in os.environ and "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["MEGABENCH_CACHE"], "triton")
    res = run(tuple(points), save=not a.no_save, compile=not a.no_compile, mega=not a.no_mega,
              compile_budget_s=a.compile_budget)
    print(table(res))
    for k, d in res.derived.items():
        print(f"  -> {k} = {d.value:.3f} {d.unit}")
    for n in res.notes:
        print(f"  note: {n}")
    return 1 if any("FAILED" in n for n in res.notes) else 0


if __name__ == "__main__":
    sys.exit(main())
