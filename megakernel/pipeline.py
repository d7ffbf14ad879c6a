"""The megakernel stage of `megabench run` (and of `megabench mk check-and-bench`), as progress items.

On the GPU, per preset: build with the tuned constants (megakernel.build: code bytes, registers,
spills, smem against the instruction-cache budget), check correctness (megakernel.measure: mega ==
chain bitwise on logits and KV caches at several contexts incl. past the sliding window, T=1 and a
16-token tree, repeated runs identical, within a bf16 tolerance of the torch reference with the
reference's routing, greedy decoding equal to the reference's), then time the step: chain mode and
mega mode, each replayed from a CUDA graph so the host's launch cost is out of both, in device
time, with kernel launches per step counted by the profiler and the roofline as the bound.

Stage lays this out as progress items (microbench.progress) enumerated before anything runs, so the
run's estimate is known up front; its first item compiles every build in parallel processes. The
default run (quick) takes the checks and the headline points (plans.QUICK) for chain, mega, the
torch baselines and PEERS; full adds plans.FULL's long contexts, the batched steps (plans.BATCH_FULL:
B requests in one step, chain and mega, row groups past 16 rows, and BATCH_PEERS: the peer at the
same B), the ablation, the timeline and the detail timeline. `run` executes the same items in order; after a failure only the
`always` items (releases, the save) run, then the failure raises.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch

from microbench.compiler import cache_dir
from microbench.errors import CorrectnessError
from microbench.harness import Harness, Policy
from microbench.progress import Item
from microbench.results import Derived, Result, Series
from microbench.sass import find_nvdisasm

from . import baselines as B, speculative, tiling
from .batch import bench_batch_point
from .bench_baselines import FULL_POINTS, QUICK_POINTS, Collector, release, weights_for
from .config import preset as get_preset
from .decode import SpecPair, decode, prompts_for
from .decode import to_result as decode_result
from .draft import DraftConfig, draft_model_config
from .measure import Check, ablation_point, bench_point, build_result, check_point, code_result, greedy_check, timeline
from .peer_bench import peer_batch_point, peer_point
from .plan import Plan
from .plans import (BATCH_FULL, CHECK_POINTS, FULL, PRESETS, QUICK, ablation_names, ablation_variants,
                    code_budget, constants_env, plan_for, rows_switches)
from .precompile import _one
from .reference import KVCache
from .roofline import read_ceiling

# The speculative decode item (draft, verify, accept and compaction on the device, checked against
# plain greedy decoding, then its accepted tokens/s): these presets, this many tokens
DECODE_PRESETS = ("small", "shard8")
DECODE_TOKENS = 64
# With the batched steps (full runs, or `batches`): B requests a step, each its own tree of 16 / B
# tokens, and each the whole 16-token tree in a row group of its own (decode --full-trees)
DECODE_BATCHES = (4, 8)

# Other implementations timed beside mega and chain at every timed point of the stage (the torch
# baselines have items of their own): name -> fn(h, preset, n_tokens, ctx, ceiling, constants=...)
# returning a Series named results_names.step_series_name(preset, n_tokens, ctx, name), saved in
# megakernel.step. Each is the progress item "<preset> T=<T> ctx=<ctx> <name>", estimated as kind
# "peer" (PEER_SEED_S a point) until a run has measured it; a failure is reported and skips only that
# preset's later peer items. The default `megabench run` has about 25 s of its 300 s budget left for
# them. A peer fn may carry `quick_tokens`: the quick run times it at those T only. The peer here is
# its step alone at T=16 (block sizes from the last megakernel.peer run's sweep, else the defaults);
# `megabench mk peer-bench` times it at every point with the sweep, torch.compile, real
# routing, chain_nopdl and the per-kernel accounting (megakernel.peer). MEGABENCH_PEER=0: none.
def _peer_row(h, preset, n_tokens, ctx, ceiling, constants=None):
    return peer_point(h, preset, n_tokens, ctx, ceiling)


_peer_row.quick_tokens = (16,)  # two items of ~10 s: what the default run's budget has left
PEERS: dict[str, object] = {} if os.environ.get("MEGABENCH_PEER", "1") == "0" else {"peer": _peer_row}
PEER_SEED_S = 10.0


# The peers at the batched points (Stage.batch_points: full runs, or `batches`): name ->
# fn(h, preset, batch, n_tokens, ctx, ceiling) returning a Series named
# batch.batch_series_name(preset, B, T, ctx, name), saved in megakernel.step beside mega and chain at
# the same B. Items "<preset> B=<B> T=<T> ctx=<ctx> <name>", kind "peer" and the PEERS' group (a
# failure skips that preset's later peer items). MEGABENCH_PEER=0: none.
def _peer_batch_row(h, preset, batch, n_tokens, ctx, ceiling):
    return peer_batch_point(h, preset, batch, n_tokens, ctx, ceiling)


BATCH_PEERS: dict[str, object] = {} if os.environ.get("MEGABENCH_PEER", "1") == "0" else {"peer": _peer_batch_row}

# Seconds per item before any run.wall result has measured it (microbench.progress.Estimates): read off
# the committed model.baselines and megakernel results (their wall-time and compile-time notes, their
# saved times); a run.wall result of this GPU and mode replaces them. Names are Stage.items()'s.
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
              "baseline": 8.0, "acceptance": 3.0, "weights": 10.0, "greedy": 5.0, "decode": 8.0,
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
                 compile_workers: int | None = None, batches: bool = False):
        self.batches = batches  # the batched steps in a quick run too (plans.BATCH_FULL)
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
        return (QUICK_POINTS if self.quick else FULL_POINTS).get(p, []) if self.baselines else []

    def batch_points(self, p: str) -> list[tuple[int, int, int]]:
        """(B, T, ctx) of the batched steps timed (full runs, or `batches`)."""
        return BATCH_FULL.get(p, []) if self.batches or not self.quick else []

    def tokens(self, p: str) -> list[int]:
        """Every step size (rows) a build is asked for: a batched step's build is its B x T rows'."""
        return sorted({t for t, _ in CHECK_POINTS.get(p, [])} | {t for t, _ in self.points(p)}
                      | {b * t for b, t, _ in self.batch_points(p)})

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
            if p in DECODE_PRESETS and self.points(p):
                out.append(item(f"{p} speculative decode", partial(self._decode, p), "decode", (g,)))
                for b in DECODE_BATCHES if self.batch_points(p) else ():
                    out.append(item(f"{p} speculative decode B={b}", partial(self._decode, p, b), "decode", (g,)))
                    out.append(item(f"{p} speculative decode B={b} full trees", partial(self._decode, p, b, True),
                                    "decode", (g,)))
            for t, c in self.points(p):
                for mode in ("chain", "mega"):
                    out.append(item(f"{p} T={t} ctx={c} {mode}", partial(self._time, p, t, c, mode), f"time/{p}",
                                    (g,)))
            for b, t, c in self.batch_points(p):
                for mode in ("chain", "mega"):
                    out.append(item(f"{p} B={b} T={t} ctx={c} {mode}", partial(self._time_batch, p, b, t, c, mode),
                                    f"time/{p}", (g,)))
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
            for name in BATCH_PEERS:
                for b, t, c in self.batch_points(p):
                    out.append(item(f"{p} B={b} T={t} ctx={c} {name}", partial(self._peer_batch, name, p, b, t, c),
                                    "peer", (gp,)))
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
            q = self.quick
            self._h = Harness(policy=Policy(budget_s=0.3 if q else 1.0, max_samples=100 if q else 400, chunk=8))
        return self._h

    @property
    def ceiling(self):
        if self._ceiling is None:
            self._ceiling = read_ceiling(self.h.info.name)
        return self._ceiling

    def plan(self, p: str, t: int | None = None) -> Plan:
        """The build for max_tree tokens (t None) or the one a step of t token rows runs
        (plan.expert1_unit_rows; past max_tree rows, row groups over the union of their routing:
        plans.rows_switches)."""
        if (p, t) not in self._plans:
            kw = {} if t is None else rows_switches(get_preset(p), t)
            self._plans[(p, t)] = plan_for(p, self.constants, self.h.info.sm_count, **kw)
        return self._plans[(p, t)]

    def draft_plan(self, p: str, groups: int = 1) -> Plan:
        """The drafter's build for preset p (megakernel/draft.py: a config of the target's family);
        groups > 1: row groups of one request's draft rows each (decode's full trees)."""
        if (p, "draft", groups) not in self._plans:
            dcfg = draft_model_config(get_preset(p), DraftConfig(agree=speculative.agreement("study", p)))
            kw = {"row_groups": groups} if groups > 1 else {}
            self._plans[(p, "draft", groups)] = plan_for(dcfg, self.constants, self.h.info.sm_count,
                                                         tokens=dcfg.max_tree - 1, **kw)
        return self._plans[(p, "draft", groups)]

    def plans_needed(self) -> list[Plan]:
        """Every build the items will ask for (the compile item's list)."""
        sm = self.h.info.sm_count
        out = []
        for p in self.presets:
            out.append(self.plan(p))
            out += [self.plan(p, t) for t in self.tokens(p)]
            if p in DECODE_PRESETS and self.points(p):
                out.append(self.draft_plan(p))
                for b in DECODE_BATCHES if self.batch_points(p) else ():
                    out += [self.plan(p, b * get_preset(p).max_tree), self.draft_plan(p, b)]
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
        r = build_result({p: self.plan(p) for p in self.presets}, code_budget(self.constants))
        self.results.append(dataclasses.replace(r, env=constants_env(r.env, self.constants)))

        # the critical-path model's cold-code column reads the code per op of the build it timed
        if find_nvdisasm() is not None and "shard8" in self.presets:
            try:  # an aid to the report's model, not a measurement: its failure is a note, not a failed build
                self.results.append(code_result([("shard8", 16)], self.h.info.sm_count, self.constants))
            except Exception as e:  # noqa: BLE001 (named in the run's notes)
                self.notes.append(f"megakernel.code not made: {type(e).__name__}: {e}")
        else:
            self.notes.append("megakernel.code not made (no nvdisasm, or no shard8 preset): the critical path's "
                              "cold-code column reads the newest one (`megabench mk code --save`)")

    def _check(self, p: str, t: int, ctx: int) -> None:
        c = check_point(p, t, ctx, self.plan(p, t))
        self.checks.append(c)
        self.log(f"  check {p} T={t} ctx={ctx}: rel err {c.rel_err:.2e}, mega == chain bitwise (logits, KV), "
                 f"repeat identical, real routing bitwise (logits, KV)")

    def _greedy(self, p: str) -> None:
        n = greedy_check(p, self.plan(p))
        self.notes.append(f"{p}: greedy decoding over {n} steps equals the reference's tokens")
        self.log(f"  greedy {p}: {n} steps equal")

    def _decode(self, p: str, batch: int = 1, full: bool = False) -> None:
        """A speculative decode of DECODE_TOKENS tokens per request (mega mode, the named 'study'
        acceptance), checked token for token against plain greedy decoding before its rate counts:
        `batch` requests a step, each a tree of 16 / B tokens, or with `full` each the whole tree in
        a row group of its own (the batch curve's build of B x 16 rows, and the drafter's of B groups)."""
        w = weights_for(p)
        agree = speculative.agreement("study", p)
        groups = batch if full else 1
        pair = SpecPair(w, self.plan(p, w.cfg.max_tree * groups), self.draft_plan(p, groups),
                        [KVCache(w.cfg, device="cuda") for _ in range(batch)], batch=batch, agree=agree, backend="gpu")
        prompts = prompts_for(w.cfg, batch, 8, 0)
        out = decode(pair, prompts, DECODE_TOKENS, "mega", check=True)
        if not out.check.ok:
            raise CorrectnessError(f"{p} B={batch}{' full trees' if full else ''}: speculative decoding differs from "
                                   f"plain greedy: {out.check.problems[:3]}")
        r = decode_result(out, preset=p, batch=batch, mode="mega", agree=agree, acceptance="study",
                          acceptance_source=speculative.agreement_source("study", p), prompt_len=8, n=DECODE_TOKENS,
                          env=constants_env(None, self.constants), emulated=False,
                          launches=pair.part_launches("mega"), row_groups=groups)
        self.results.append(r)
        self.log(f"  decode {p} B={batch} T={pair.T}: {r.derived['accepted_tokens_per_s'].value:.0f} accepted tok/s "
                 f"at {r.derived['mean_acceptance'].value:.2f} tokens a step per request, equal to plain greedy")

    def _time(self, p: str, t: int, ctx: int, mode: str) -> None:
        s = bench_point(self.h, p, t, ctx, self.plan(p, t), mode, self.ceiling)
        self.series.append(s)
        self._say(s)

    def _time_batch(self, p: str, b: int, t: int, ctx: int, mode: str) -> None:
        s = bench_batch_point(self.h, p, b, t, ctx, self.plan(p, b * t), mode, self.ceiling)
        self.series.append(s)
        self._say(s)

    def _collector(self):
        if self._col is None:
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

    def _peer_batch(self, name: str, p: str, b: int, t: int, ctx: int) -> None:
        # the megakernel's tiled weight copies (~57 GB at shard8) are not the peer's: dropped, the
        # peer's largest batches fit beside the weights and the batch contexts
        tiling.clear()
        s = BATCH_PEERS[name](self.h, p, b, t, ctx, self.ceiling)
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
        by = {(s.params["preset"], s.params["T"], s.params["ctx"], s.params["impl"], s.params.get("batch", 1)): s
              for s in self.series}
        for (p, t, ctx, impl, b), s in by.items():
            at = f"B{b}/" if b != 1 else ""
            if not impl.startswith("mega"):
                continue
            for other, how in (("chain", "both replayed from CUDA graphs"), ("peer", "both one CUDA graph a step")):
                o = by.get((p, t, ctx, other, b))
                if o is not None:
                    derived[f"speedup_vs_{other}/{p}/{at}T{t}/ctx{ctx}/{impl}"] = Derived(
                        o.summary.median / s.summary.median, "x", f"median {other} step time / median mega step "
                        f"time ({how})" + (f", {b} requests a step" if b != 1 else ""), inputs=(o.name, s.name))
        if self.checks:
            derived["max_rel_err_vs_reference"] = Derived(
                max(c.rel_err for c in self.checks), "", "max over the checked points of ||mega - reference|| / "
                "||reference|| (reference routing forced)")
        notes = self.notes + [f"checked {c.preset} T={c.n_tokens} ctx={c.ctx}: rel err {c.rel_err:.2e}; mega == chain "
                              f"bitwise (logits, KV caches), repeated mega run bitwise identical, bitwise with the "
                              f"kernel's own routing (logits, tokens, KV caches)" for c in self.checks]
        if any(s.params.get("batch", 1) != 1 for s in self.series):
            notes.append("batched steps (params batch = B requests a step, each its own tree, context and KV cache; "
                         "roofline: the union of routed experts, the dense weights once, each request's KV reads); "
                         "the peer at the same B: megakernel.peer.BatchPeerRunner (norms, dense GEMMs and the fused "
                         "MoE once over all rows; RoPE + KV write and attention one launch per request)")
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
        timeline: bool | None = None, detail: bool = False, baselines: bool = False, batches: bool = False):
    """Checks, then timings (Stage), every item in order. After the first failure only the items
    marked `always` run (releases, and the save of what was measured before it); then that failure
    raises. An interrupt counts as a failure: a run stopped at its time limit by SIGINT
    (`timeout -s INT`) still saves what it measured. Returns the Results (saved unless save=False)."""
    st = Stage(quick, constants, save, presets, log, ablate, timeline, detail, baselines, batches=batches)
    first: BaseException | None = None
    for it in st.items():
        if first is not None and not it.always:
            continue
        try:
            it.fn()
        except (Exception, KeyboardInterrupt) as e:
            if first is not None:
                log(f"  {it.name} failed too, after the first failure: {type(e).__name__}: {e}")
                continue
            first = e
            log(f"  {it.name} FAILED ({type(e).__name__}: {e}); what was measured before it is still saved")
    if first is not None:
        raise first
    return st.results
