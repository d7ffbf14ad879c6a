"""Several ranks of one plan: tensor parallelism (Plan.tp_ranks) and launches shared by ranks
(Plan.launch_ranks).

    eng = RankEngine(weights, plan, cache, backend="emu")   # plan.launch_ranks ranks, one launch
    out = eng.step(tokens, parents, ctx, mode="mega")       # rank 0's StepOut; eng.rank_outputs(): all

Each rank is an Engine (runtime.py) with its own parameter block, counters, buffers and, with
tensor parallelism, its shard of the weights (weights.shard), its kv heads' view of the KV cache
and its receive slots; a launch of R ranks passes their parameter blocks in rank order and block
b of the launch's grid runs rank b * R / grid (csrc/mk/arch.cuh). Where the ranks run:
  emulation      R groups of emulated blocks in one emulated launch over host buffers
  one GPU        R partitions of the SMs in one launch (timings are those of R ranks sharing a
                 GPU, and say so)
  torchrun       one process per GPU, one rank each (Plan.launch_ranks = 1), receive slots in
                 peer memory (rank_main, started by run_torchrun; the decode loop's is decode.py's,
                 built from the same parts: rank_role, open_rank, rank_engine, the RankRecord that
                 rank 0 gathers and gather_problems checks, launch_torchrun)
where_ranks picks among them by what is present, and step_ranks runs decode steps wherever that is
(`megabench mk step --ranks R`; the decode loop's hook). A profiled step's collective waits come out
of its timeline (collective_waits) and go into `megakernel.tp_waits` (tp_waits_result).
Without tensor parallelism (tp_ranks 0) a launch of R ranks runs R copies of the unsharded model,
each on its own cache: the plumbing of rank-local block indices and parameter blocks alone.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from microbench.atomic import write_json
from microbench.clocks.profiler import ProfileBuffer, ProfileLayout, Timeline
from microbench.device import device_info, gpu_count, no_gpu_reason
from microbench.errors import CorrectnessError, MegabenchError, SpinTimeoutError
from microbench.launch import LaunchSpec, launch
from microbench.results import Derived, Env, Result, Series
from microbench.watchdog import Watchdog, fields as wd_fields
from microbench.xgpu import world
from microbench.xgpu.world import check_multicast_off

from .config import ConfigError, preset as get_preset
from .plan import Plan, make_plan, tp_problem
from .plans import REL_TOL
from .profile_events import EVENTS
from .reference import KVCache, Request, Trace, step as reference_step
from .results_names import TP_WAITS
from .runtime import EMU_SCHEDULES, EmulationError, Engine, RankLink, SpecLink, StepOut, check_close, step_launches
from .weights import ModelWeights, generate, shard


class RecvSlots:
    """A rank's receive slots (Plan.recv_layout) in one tensor of its device: the emulation's and
    one GPU's (one process per GPU: PeerRecv)."""

    def __init__(self, nbytes: int, device):
        self.t = torch.empty(max(4, nbytes) // 4, dtype=torch.int32, device=device)

    @property
    def ptr(self) -> int:
        return self.t.data_ptr()

    def fill(self, offset: int, nbytes: int, word: int) -> None:
        self.t[offset // 4:(offset + nbytes) // 4].fill_(word - (1 << 32) if word >= 1 << 31 else word)

    def words(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.t[offset // 4:(offset + nbytes) // 4]


def rank_cache(cache: KVCache, rank: int, ranks: int) -> KVCache:
    """Rank `rank`'s view of `cache` at tensor parallelism `ranks`: its kv heads (a contiguous
    slice of every layer's [Hkv, slots, hd] K and V), written in place by its qkv units."""
    h = cache.cfg.n_kv_heads // ranks
    v = KVCache.__new__(KVCache)
    v.cfg = cache.cfg
    v.k = [t[rank * h:(rank + 1) * h] for t in cache.k]
    v.v = [t[rank * h:(rank + 1) * h] for t in cache.v]
    return v


class RankEngine:
    """The plan's launch_ranks ranks in one launch (emulation or one GPU), with the step API of
    Engine (step, step_batch). `cache`, with tensor parallelism: the model's KV cache, or a list of
    one per request (Engine's batches); each rank writes its kv heads of them in place. Without
    tensor parallelism: a list of one per rank (each a KVCache or a list per request). `grid`:
    blocks per rank (default: the GPU's SMs shared out, or 2 in the emulation). `spec`: one
    SpecLink("verify", ...) per rank (each its own copy of the speculative state): every rank gets
    the verifier's spec program beside its plain one, and launch_step(spec=True) runs it on every
    rank (decode.py SpecPair at --ranks R)."""

    def __init__(self, weights: ModelWeights, plan: Plan, cache, *,
                 backend: str = "emu", program_mode: str = "layer", grid: int | None = None, emu_seed: int = 1,
                 emu_schedule: str = "random", spec: Sequence[SpecLink] | None = None):
        r = plan.launch_ranks
        if spec is not None and (len(spec) != r or any(x.role != "verify" for x in spec)
                                 or len({id(x.state) for x in spec}) != r):
            raise ConfigError(f"a speculative RankEngine of {r} ranks: one SpecLink('verify', ...) per rank, each with "
                              "its own state (every rank's accept and advance write theirs)")
        if plan.tp_ranks and plan.tp_ranks != r:
            raise ConfigError(f"a plan of {plan.tp_ranks} TP ranks with {r} a launch: one launch holds every rank "
                              "(RankEngine) or one (a process per GPU: run_torchrun)")
        if emu_schedule not in EMU_SCHEDULES:
            raise ValueError(f"emu_schedule {emu_schedule!r}: one of {', '.join(EMU_SCHEDULES)}")
        if plan.tp_ranks:
            reqs = [cache] if isinstance(cache, KVCache) else list(cache)
            if not reqs or not all(isinstance(c, KVCache) for c in reqs):
                raise ConfigError("tensor parallelism: the model's KV cache (or one per request); each rank writes "
                                  "its kv heads of it")
            caches = [[rank_cache(c, k, r) for c in reqs] for k in range(r)]
        else:
            caches = [cache] * r if isinstance(cache, KVCache) and r == 1 else list(cache)
            if len(caches) != r or len({id(c) for c in caches}) != r:
                raise ConfigError(f"{r} ranks of the unsharded model: one KV cache each (got {len(caches)} distinct)")
        self.plan, self.ranks, self.backend = plan, r, backend
        dev = weights.device
        if grid is None:
            grid = max(1, plan.n_sm // r) if backend == "gpu" else 2
        self.grid = grid
        self.wd = Watchdog(plan.spin_bound_ns, device=dev)
        self.recv = [RecvSlots(plan.recv_bytes, dev) for _ in range(r)] if plan.tp_ranks else [None] * r
        peers = torch.tensor([x.ptr for x in self.recv], dtype=torch.int64, device=dev) if plan.tp_ranks else None
        self.engines: list[Engine] = []
        for k in range(r):
            link = RankLink(k, self.wd, self.recv[k], peers)
            w = shard(weights, k, r, plan.expert_parallel) if plan.tp_ranks else weights
            self.engines.append(Engine(w, plan, caches[k], backend=backend, program_mode=program_mode,
                                       grid=grid, emu_seed=emu_seed, emu_schedule=emu_schedule, link=link,
                                       spec=None if spec is None else spec[k]))
        self.emu_seed, self.emu_schedule = emu_seed, emu_schedule
        self.program = self.engines[0].program
        self.spec_program = self.engines[0].spec_program
        self.spec = spec
        self._params_dev = None
        # every rank's spec parameter block, in rank order (pointers only: packed once, as Engine's)
        self._spec_params_dev = None if spec is None else torch.cat([e._spec_params_dev for e in self.engines])
        self._outs: list[StepOut] = []
        self.prof = None  # the profiler's buffer of the whole launch (every rank's blocks)
        if plan.profile:
            n = max(len(self.program.launches), len(self.program.ops))  # a slice per launch of either mode
            self.prof = ProfileBuffer(ProfileLayout(grid * r, 1, plan.profile_cap), launches=n,
                                      device="cpu" if backend == "emu" else (dev.index or 0))

    # ------------------------------------------------------------------ helpers
    def poison(self) -> None:
        for e in self.engines:
            e.poison()

    def describe(self) -> str:
        where = {"emu": "the CPU emulation", "gpu": "one GPU (the ranks share its SMs)"}[self.backend]
        return f"{self.ranks} ranks in one launch on {where}, {self.grid} blocks each"

    # ------------------------------------------------------------------ running
    def prepare(self, tokens, parents, ctx: int, routes=None) -> int:
        """A one-request step: prepare_batch."""
        return self.prepare_batch([Request(tokens, parents, ctx)], routes)

    def prepare_batch(self, requests: Sequence[Request], routes=None) -> int:
        """Every rank's inputs and parameter block (the same step on each); one device copy of
        the blocks in rank order. Returns the step's rows."""
        for e in self.engines:
            rows = e.prepare_batch(requests, routes)
        self._params_dev = torch.cat([e._params_dev for e in self.engines])
        return rows

    @property
    def parity(self) -> int:
        """The counters' parity of the next step (every rank's: launch_step turns them together)."""
        return self.engines[0].parity

    def launches(self, mode: str, program=None) -> list[tuple[int, int, int, int]]:
        """(first op, ops, wait, grid per rank) of each launch of `program` (Engine.launches; every
        rank's program is the same)."""
        return self.engines[0].launches(mode, program)

    def set_spec_rows(self, ctxs: Sequence[int]) -> None:
        """Every rank's spec step shape (Engine.set_spec_rows): the same contexts on each."""
        for e in self.engines:
            e.set_spec_rows(ctxs)

    def note_replayed(self, steps: int, mode: str) -> None:
        """Engine.note_replayed on every rank (a CUDA graph of whole steps ran `steps` more)."""
        for e in self.engines:
            e.note_replayed(steps, mode)

    def launch_step(self, mode: str = "mega", *, spec: bool = False, part: range | None = None) -> None:
        """Every rank's launches of the prepared step (Engine.launch_step: spec, the verifier's spec
        step; part, only these launch indices, in order). Every rank's counters are cleaned before
        the step's first launch and every rank's parity turns after its last, so the parts of a
        step are launched in order, and all ranks stay at one parity (one launch holds them all)."""
        e0 = self.engines[0]
        if spec and self._spec_params_dev is None:
            raise ConfigError("launch_step(spec=True): this RankEngine has no spec program (spec links)")
        prog, params, todo, part = step_launches(self, e0, mode, spec, part)
        if not part:
            return
        if part[0] == 0:
            for e in self.engines:
                if mode == "mega" and e._dirty[e.parity]:
                    e.counters[e.parity].zero_()
            if self.prof is not None:
                self.prof.reset()
        for e in self.engines:
            e._last_program = prog
        for li in part:
            (first, n, wait, grid), pdl = todo[li]
            self._launch(first, n, wait, grid, li, pdl=pdl, params=params)
        if mode == "mega" and part[-1] == len(todo) - 1:
            for e in self.engines:
                e._dirty[e.parity] = True
                e._dirty[e.parity ^ 1] = False
                e.parity ^= 1

    def _launch(self, first: int, n: int, wait: int, grid: int, li: int = 0, pdl: bool = False,
                params: torch.Tensor | None = None) -> None:
        """One launch of every rank: `grid` blocks per rank, the blocks of rank k after rank k-1's."""
        e0 = self.engines[0]
        params = self._params_dev if params is None else params
        total = grid * self.ranks
        pb, pm = self.prof.args(li) if self.prof is not None else (0, np.uint64(0))
        if self.backend == "gpu":
            spec = LaunchSpec(grid=total, block=self.plan.threads, smem=self.plan.smem_bytes, pdl=pdl)
            launch(e0.kernel, spec, params, np.int32(first), np.int32(n), np.int32(wait),
                   np.int32(e0.parity), pb, pm, persistent=bool(wait))
            return
        err = ctypes.create_string_buffer(2048)
        if e0.dll.emu_set_schedule(EMU_SCHEDULES[self.emu_schedule]):
            raise EmulationError(f"the emulation does not know schedule {self.emu_schedule!r}")
        rc = e0.dll.mk_emu_run(params.data_ptr(), total, first, n, wait, e0.parity, self.emu_seed,
                               err, len(err), pb, int(pm))
        self.emu_seed += 1
        if rc:
            self._check_watchdog()
            raise EmulationError(f"ops {first}..{first + n - 1}: {err.value.decode(errors='replace')}")

    def _check_watchdog(self, wait: bool = True) -> None:
        """SpinTimeoutError naming the rank, the op and what it waited for, when a wait gave up;
        then every rank's counters and sentinel slots are reset, as Engine does for one. `wait`:
        unused (Engine._check_watchdog's signature, so a pair checks either kind alike)."""
        rec = self.wd.rec.cpu().tolist()
        f = wd_fields()
        if rec[f["TRIPPED"]] == 0:
            return
        thread, rank = rec[f["THREAD"]] & 0xFFFF, rec[f["THREAD"]] >> 16
        e = self.engines[rank] if 0 <= rank < self.ranks else self.engines[0]
        msg = (f"megakernel ({self.plan.cfg.name}, {self.describe()}): rank {rank} block {rec[f['BLOCK']]} thread "
               f"{thread} gave up waiting for {e.describe_wait(rec[f['WHAT']])} at "
               f"0x{rec[f['ADDR']] & (2**64 - 1):x}: expected {rec[f['EXPECTED']]}, last saw {rec[f['SEEN']]} after "
               f"{rec[f['ELAPSED_NS']] / 1e3:.1f} us (bound {self.wd.bound_ns / 1e3:.1f} us)")
        self.wd.reset()
        for x in self.engines:
            x.counters.zero_()
            x.empty_sentinel_slots()
            x._dirty = [False, False]
        raise SpinTimeoutError(msg)

    def step(self, tokens, parents: Sequence[int], ctx: int, *, mode: str = "mega", routes=None) -> StepOut:
        """One request's step on every rank: step_batch."""
        return self.step_batch([Request(tokens, parents, ctx)], mode=mode, routes=routes)

    def step_batch(self, requests: Sequence[Request], *, mode: str = "mega", routes=None) -> StepOut:
        """A step of these requests on every rank; rank 0's logits and tokens (rank_outputs():
        every rank's; out.request(r): request r's rows)."""
        rows = self.prepare_batch(requests, routes)
        self.launch_step(mode)
        if self.backend == "gpu":
            torch.cuda.synchronize()
        self._check_watchdog()
        self._outs = [StepOut(e.buf["logits"][:rows].clone(), e.buf["out_tokens"][:rows].to(torch.int64).clone(),
                              e._row0) for e in self.engines]
        return self._outs[0]

    def check_slots_empty(self) -> None:
        """CorrectnessError naming each rank and receive region (Plan.recv_layout) that holds data
        after a step: every reader resets what it read, so a slot left written is a reset that was
        never done, and the reader of that copy two layers on would take the stale data for fresh."""
        left = {k: {n: c for n, c in e.recv_words_written().items() if c} for k, e in enumerate(self.engines)}
        bad = {k: v for k, v in left.items() if v}
        if bad:
            raise CorrectnessError("receive slots left written after the step (32-bit words): " + "; ".join(
                f"rank {k}: " + ", ".join(f"{n} {c}" for n, c in v.items()) for k, v in bad.items()))

    def rank_outputs(self) -> list[StepOut]:
        """Each rank's logits and tokens of the last step (with tensor parallelism every rank
        computes the same bits)."""
        return list(self._outs)

    def timeline(self, mode: str = "mega") -> Timeline:
        """The profiler's stamps of the last step (a plan built with profile=True), every rank's
        blocks: block b of launch i is rank b * ranks / (its grid) (rank_of)."""
        if self.prof is None:
            raise ConfigError("this engine was built without the profiler (make_plan(..., profile=True))")
        names = [f"launch {i}: ops {f}..{f + n - 1}" for i, (f, n, _, _) in enumerate(self.engines[0].launches(mode))]
        names += [f"unused {i}" for i in range(len(names), self.prof.launches)]
        return Timeline.build(self.prof.read(), EVENTS, launch_names=names)

    def rank_of(self, mode: str = "mega"):
        """block -> rank of each launch of `mode` (launch index, launch block)."""
        grids = [g for (_, _, _, g) in self.engines[0].launches(mode)]
        return lambda launch, block: block // grids[launch]


# ---------------------------------------------------------------------- collective waits
# Tensor parallelism's collectives: (key, what it is, the op that pushes, the op that polls)
COLLECTIVES = (("allreduce", "the attention all-reduce", "oproj", "attn_reduce"),
               ("gather_act", "the gate/up activations' gather", "expert1", "expert2"),
               ("gather_y", "the expert outputs' gather", "expert2", "moe_combine"))


@dataclass(frozen=True)
class CollectiveWait:
    """One rank at one collective of one layer, from a profiled step's timeline."""

    layer: int
    collective: str  # a COLLECTIVES key
    rank: int
    ready_ns: float | None  # the end of the rank's last unit of the pushing op (None: it ran none)
    wait_ns: float | None  # the longest wait of its blocks at the polling op: wait_<op>, which a TP
    # build ends at the block's first poll of the other ranks' data (csrc/mk/tp.cuh xwait_end)


def collective_waits(tl: Timeline, program, rank_of) -> list[CollectiveWait]:
    """Each (layer, collective, rank) of a profiled TP step: when the rank was ready (pushed its
    last data) and how long its blocks waited for the others'. rank_of(launch, block) -> rank
    (RankEngine.rank_of; one process per GPU: its own rank for every block)."""
    ops = program.ops
    ready: dict[tuple, float] = {}
    wait: dict[tuple, float] = {}
    ranks = set()
    for s in tl.spans:
        if not 0 <= s.arg < len(ops):
            continue
        o, r = ops[s.arg], rank_of(s.launch, s.block)
        ranks.add(r)
        for key, _, prod, cons in COLLECTIVES:
            k = (o.layer, key, r)
            if s.phase == prod == o.kind:
                ready[k] = max(ready.get(k, s.end_ns), s.end_ns)
            if s.phase == f"wait_{cons}" and o.kind == cons:
                wait[k] = max(wait.get(k, s.dur_ns), s.dur_ns)
    keys = sorted(set(ready) | set(wait))
    return [CollectiveWait(l, c, r, ready.get((l, c, r)), wait.get((l, c, r))) for l, c, r in keys]


def skews(waits: Sequence[CollectiveWait]) -> dict[tuple[int, str], float]:
    """(layer, collective) -> the spread of the ranks' readiness (latest minus earliest), where
    every rank's clock is one (one GPU; across GPUs the clocks' offsets are not applied here)."""
    by: dict[tuple[int, str], list[float]] = {}
    for w in waits:
        if w.ready_ns is not None:
            by.setdefault((w.layer, w.collective), []).append(w.ready_ns)
    return {k: max(v) - min(v) for k, v in by.items() if len(v) > 1}


def stalls(waits: Sequence[CollectiveWait]) -> dict[tuple[int, int], float]:
    """(layer, rank) -> the rank's waits at the layer's collectives, summed (its stalls per layer)."""
    out: dict[tuple[int, int], float] = {}
    for w in waits:
        if w.wait_ns is not None:
            out[(w.layer, w.rank)] = out.get((w.layer, w.rank), 0.0) + w.wait_ns
    return out


def tp_waits_result(waits: Sequence[CollectiveWait], *, preset: str, ranks: int, where: str, one_clock: bool,
                    tokens: int, ctx: int, env: Env) -> Result:
    """A profiled TP step's collective waits as `megakernel.tp_waits`: per collective and rank the
    waits over the layers, per rank the stalls per layer, and (one_clock: the ranks share a
    GPU's clock) per collective the ranks' skew; derived: the largest skew and the worst rank's
    median stall per layer, beside the study's 4 us drift and 12.5 us idle after GEMM 2 (the report)."""
    base = {"preset": preset, "ranks": ranks, "where": where, "tokens": tokens, "context": ctx}
    series = []
    for key, what, _, _ in COLLECTIVES:
        for r in range(ranks):
            v = [w.wait_ns * 1e-9 for w in waits if w.collective == key and w.rank == r and w.wait_ns is not None]
            if v:
                series.append(Series.from_samples(f"{preset}/R{ranks}/{key}/rank{r}/wait", v, timer="globaltimer",
                                                  unit="s", params={**base, "collective": key, "rank": r}))
    st = stalls(waits)
    for r in range(ranks):
        v = [st[k] * 1e-9 for k in sorted(st) if k[1] == r]
        if v:
            series.append(Series.from_samples(f"{preset}/R{ranks}/rank{r}/stall", v, timer="globaltimer", unit="s",
                                              params={**base, "rank": r}))
    derived = {}
    per_rank = [np.median([st[k] for k in st if k[1] == r]) * 1e-9 for r in range(ranks) if any(k[1] == r for k in st)]
    if per_rank:
        derived["tp_stall_per_layer_s"] = Derived(float(max(per_rank)), "s", "the worst rank's median over layers of "
                                                  "its summed waits at the layer's collectives")
    notes = [f"{ranks} ranks {where}"]
    if one_clock:
        sk = skews(waits)
        for key, _, _, _ in COLLECTIVES:
            v = [sk[k] * 1e-9 for k in sorted(sk) if k[1] == key]
            if v:
                series.append(Series.from_samples(f"{preset}/R{ranks}/{key}/skew", v, timer="globaltimer", unit="s",
                                                  params={**base, "collective": key}))
        if sk:
            derived["tp_skew_max_s"] = Derived(max(sk.values()) * 1e-9, "s", "the largest spread of the ranks' "
                                               "readiness at a collective (latest minus earliest rank), over layers")
    else:
        notes.append("skew not measured: the ranks' clocks are different GPUs' (their offsets are not applied)")
    return Result(TP_WAITS, env, tuple(series), derived, True, tuple(notes))


# ---------------------------------------------------------------------- where R ranks run
WHERE = ("emu", "gpu", "torchrun")


def where_ranks(ranks: int, prefer: str | None = None) -> tuple[str, str]:
    """Where `ranks` ranks run here, and why: "torchrun" (one process per GPU) where the node has
    that many GPUs, else "gpu" (the ranks share one GPU's SMs in one launch), else "emu" (the CPU
    emulation). `prefer` forces one, refused with the reason when it cannot run here."""
    if prefer is not None and prefer not in WHERE:
        raise ConfigError(f"where {prefer!r}: one of {', '.join(WHERE)}")
    reason = no_gpu_reason()
    n = 0 if reason else gpu_count()
    if prefer == "emu" or (prefer is None and reason):
        why = f"no GPU ({reason})" if reason else "asked for"
        return "emu", f"the CPU emulation ({why}): {ranks} ranks as groups of emulated blocks in one launch"
    if reason:
        raise ConfigError(f"{prefer} needs a GPU: {reason}")
    if prefer == "torchrun" or (prefer is None and 1 < ranks <= n):
        if n < ranks:
            raise ConfigError(f"torchrun: {ranks} ranks need {ranks} GPUs, this node has {n}")
        return "torchrun", f"torchrun, one process per GPU ({ranks} of the node's {n}), peer memory through CUDA IPC"
    return "gpu", (f"one GPU ({n} present for {ranks} ranks): the ranks share its SMs in one launch, and its timings "
                   "are those of ranks sharing a GPU")


def step_inputs(cfg, tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """A step's tokens (seeded) and its tree (a chain of `tokens`), the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (tokens,), generator=g).tolist(), [i - 1 for i in range(tokens)]


def check_step(outs: Sequence[StepOut], want: StepOut, what: str) -> None:
    """CorrectnessError unless every rank's logits and tokens are bitwise `want`'s."""
    for k, o in enumerate(outs):
        if not (torch.equal(o.logits.cpu(), want.logits.cpu()) and torch.equal(o.tokens.cpu(), want.tokens.cpu())):
            d = (o.logits.cpu().double() - want.logits.cpu().double()).abs().max().item()
            raise CorrectnessError(f"{what}: rank {k}'s logits differ from the unsharded step's (max |diff| {d:.3g})")


@dataclass(frozen=True)
class RanksRun:
    """What step_ranks did: where, the tokens of each step, the checks passed, and the collective
    waits of a profiled step (CollectiveWait rows; empty without --profile)."""

    where: str
    why: str
    tokens: list[list[int]]
    checks: list[str]
    waits: list[CollectiveWait]


def step_ranks(preset_name: str, ranks: int, *, tokens: int = 8, ctx: int = 40, mode: str = "mega", steps: int = 1,
               expert_parallel: bool = False, check: bool = False, profile: bool = False, where: str | None = None,
               seed: int = 3, log=print) -> RanksRun:
    """Decode steps of the TP build at `ranks` ranks where they can run here (where_ranks, said
    through `log`): the first step over a seeded chain of `tokens` tokens at context `ctx`, then
    greedy steps of one token. check: the first step's logits, on every rank, bitwise those of the
    unsharded build (R = 1) and of the expert-parallel arrangement, within the megakernel's
    tolerance of the torch reference (its routing forced on all three), and every receive slot
    empty afterwards. The decode loop's hook: `megabench decode --ranks R` runs here."""
    where, why = where_ranks(ranks, where)
    log(f"{ranks} ranks: {why}")
    if where == "torchrun":
        return run_torchrun(ranks, preset_name, tokens=tokens, ctx=ctx, mode=mode, steps=steps,
                            expert_parallel=expert_parallel, check=check, profile=profile, seed=seed, log=log)
    cfg = get_preset(preset_name)
    dev = torch.device("cpu" if where == "emu" else "cuda")
    w = generate(cfg, device=dev)
    cache0 = KVCache(cfg, device=dev).fill_random(torch.Generator(device=dev).manual_seed(seed))
    toks, par = step_inputs(cfg, tokens, seed)
    n_sm = 4 if where == "emu" else device_info().sm_count
    backend = "emu" if where == "emu" else "gpu"
    bound = 60_000_000_000 if where == "emu" else 2_000_000_000

    def engine(r: int, ep: bool, prof: bool = False):
        plan = make_plan(cfg, n_sm, tp_ranks=r, launch_ranks=r, expert_parallel=ep, spin_bound_ns=bound, profile=prof,
                         profile_cap=256)
        return RankEngine(w, plan, cache0.clone(), backend=backend, grid=2 if where == "emu" else None)

    checks: list[str] = []
    routes = None
    if check:
        tr = Trace()
        ref = reference_step(w, cache0.clone(), toks, par, ctx, trace=tr)
        routes = [tr.tensors[f"L{l}.route"] for l in range(cfg.n_layers)]
        one = engine(1, False).step(toks, par, ctx, mode=mode, routes=routes)
        check_close(one.logits, ref, f"{preset_name} TP build, R = 1, vs the reference", rel=REL_TOL)
        checks.append(f"R = 1 within {REL_TOL:g} of the torch reference (its routing forced)")
    eng = engine(ranks, expert_parallel, profile)
    out = eng.step(toks, par, ctx, mode=mode, routes=routes)
    done = [out.tokens.tolist()]
    waits = collective_waits(eng.timeline(mode), eng.program, eng.rank_of(mode)) if profile else []
    if check:
        check_step(eng.rank_outputs(), one, f"R = {ranks}")
        eng.check_slots_empty()
        checks.append(f"R = {ranks}: every rank bitwise R = 1's, every receive slot empty")
        other = engine(ranks, not expert_parallel)
        other.step(toks, par, ctx, mode=mode, routes=routes)
        check_step(other.rank_outputs(), one, f"R = {ranks}, {'N-sharded' if expert_parallel else 'expert-parallel'}")
        other.check_slots_empty()
        checks.append(f"R = {ranks} {'N-sharded' if expert_parallel else 'expert-parallel'}: bitwise R = 1's")
    pos = ctx + tokens
    for _ in range(steps - 1):
        nxt = int(eng.step([done[-1][-1]], [-1], pos, mode=mode).tokens[0])
        done.append([nxt])
        pos += 1
    for c in checks:
        log(f"check passed: {c}")
    return RanksRun(where, why, done, checks, waits)


# ---------------------------------------------------------------------- one process per GPU
class PeerRecv:
    """A rank's receive slots in peer memory (microbench.xgpu.world.PeerBuffer: CUDA IPC, every
    rank's buffer mapped in every process), as Engine's RankLink.recv."""

    def __init__(self, buf):
        self.buf = buf

    @property
    def ptr(self) -> int:
        return self.buf.local

    def fill(self, offset: int, nbytes: int, word: int) -> None:
        self.buf.ipc.memset32(self.buf.local + offset, word, nbytes // 4, torch.cuda.current_stream().cuda_stream)

    def words(self, offset: int, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
        self.buf.ipc.copy(out.data_ptr(), self.buf.local + offset, nbytes, torch.cuda.current_stream().cuda_stream)
        return out


@dataclass(frozen=True)
class RankRole:
    """What one process of a torchrun world builds: its rank of `ranks`, the GPU it drives, the kv
    heads of the model's cache its engine writes (rank_cache), and whether it is rank 0, which
    gathers every rank's outputs, checks them and writes the summary (`gathers`) and, with a check,
    also builds the unsharded build (R = 1) on its GPU as the check's reference (`unsharded`)."""

    rank: int
    ranks: int
    device: int
    kv_heads: range
    gathers: bool
    unsharded: bool


def rank_role(cfg, rank: int, ranks: int, local_rank: int, *, check: bool) -> RankRole:
    """The role of process `rank` of a torchrun world of `ranks` (torchrun's RANK, WORLD_SIZE,
    LOCAL_RANK) for the TP build of `cfg`; ConfigError where `cfg` does not shard so or the
    numbers do not make a world (one process per GPU, two or more)."""
    if ranks < 2:
        raise ConfigError(f"a torchrun world of {ranks} process(es): one process per GPU, 2 or more")
    if not 0 <= rank < ranks or local_rank < 0:
        raise ConfigError(f"rank {rank} (local {local_rank}) outside a world of {ranks}")
    bad = tp_problem(cfg, ranks)
    if bad:
        raise ConfigError(f"{cfg.name} does not shard over {ranks} ranks: {bad}")
    h = cfg.n_kv_heads // ranks
    return RankRole(rank, ranks, local_rank, range(rank * h, (rank + 1) * h), rank == 0, check and rank == 0)


def open_rank(wld, plan: Plan, dev) -> tuple[RankLink, object]:
    """This process's RankLink: its receive slots in peer memory (a PeerBuffer of plan.recv_bytes,
    every rank's mapped here) and its watchdog. Collective: every rank calls it, in the same order.
    Returns the link and the buffer (close it after the last step, every rank past a barrier)."""
    buf = world.PeerBuffer(wld, plan.recv_bytes)
    peers = torch.tensor(buf.ptrs, dtype=torch.int64, device=dev)
    return RankLink(wld.rank, Watchdog(plan.spin_bound_ns, device=dev), PeerRecv(buf), peers), buf


def rank_engine(w: ModelWeights, plan: Plan, cache, link: RankLink, *, expert_parallel: bool = False,
                backend: str = "gpu", spec: SpecLink | None = None, **kw) -> Engine:
    """Rank link.rank's engine of the TP build `plan` (one rank a launch: a process of its own):
    its shard of `w`, its kv heads of `cache` (the model's KVCache or one per request) and `spec`
    (a SpecLink of the verify role: the rank's copy of the speculative state)."""
    if not plan.tp_ranks or plan.launch_ranks != 1:
        raise ConfigError(f"a rank of its own process: a TP plan of one rank a launch, got tp_ranks {plan.tp_ranks}, "
                          f"launch_ranks {plan.launch_ranks}")
    r = plan.tp_ranks
    caches = [cache] if isinstance(cache, KVCache) else list(cache)
    return Engine(shard(w, link.rank, r, expert_parallel), plan, [rank_cache(c, link.rank, r) for c in caches],
                  backend=backend, link=link, spec=spec, **kw)


@dataclass(frozen=True)
class RankRecord:
    """What one rank sends rank 0 at the end of a run: its error (None: it ran) and its outputs
    (`data`: name -> value, the same on every rank where the ranks agree)."""

    rank: int
    error: str | None
    data: dict


def first_difference(a, b) -> str | None:
    """Where `a` differs from `b` (tensors bitwise, lists and numbers by value), None where equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} against {tuple(b.shape)}"
        if torch.equal(a, b):
            return None
        ne = ~((a == b) | (a.isnan() & b.isnan())) if a.is_floating_point() else a != b
        if not ne.any():
            return None
        i = tuple(int(x) for x in ne.nonzero()[0])
        return f"at {list(i)}: {a[i].item()} against {b[i].item()}"
    if a == b:
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{len(a)} entries against {len(b)}"
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        return f"entry {i}: {first_difference(a[i], b[i]) or a[i]}"
    return f"{a!r} against {b!r}"


def gather_problems(records: Sequence[RankRecord], ranks: int, compare: dict | None = None) -> list[str]:
    """What is wrong with every rank's record as rank 0 gathered them: a rank missing or twice, a
    rank's error, and every output of rank k (k > 0) that is not rank 0's: rank 0's keys, each
    compared by compare[key](rank k's, rank 0's) -> a difference, a list of them (a problem each)
    or None (default first_difference).
    Empty: every rank ran and agrees with rank 0."""
    seen = sorted(r.rank for r in records)
    if seen != list(range(ranks)):
        missing = sorted(set(range(ranks)) - set(seen))
        twice = sorted({k for k in seen if seen.count(k) > 1})
        out = [f"gathered ranks {seen} for a world of {ranks}" + (f": missing {missing}" if missing else "")
               + (f", twice {twice}" if twice else "")]
    else:
        out = []
    by = {r.rank: r for r in records}
    out += [f"rank {k}: {by[k].error}" for k in sorted(by) if by[k].error]
    if 0 not in by or by[0].error:
        return out
    ref = by[0].data
    compare = compare or {}
    for k in sorted(by):
        if k == 0 or by[k].error:
            continue
        for key, want in ref.items():
            if key not in by[k].data:
                out.append(f"rank {k} sent no {key}")
                continue
            d = compare.get(key, first_difference)(by[k].data[key], want)
            out += [f"rank {k}'s {key} differs from rank 0's: {x}" for x in ([d] if isinstance(d, str) else d or [])]
    return out


TORCHRUN_MODULE = "megakernel.ranks"


def torchrun_command(ranks: int, args: Sequence[str], module: str = TORCHRUN_MODULE) -> list[str]:
    """The command line that starts `ranks` processes of `module` on this node (one per GPU)."""
    if ranks < 2:
        raise ConfigError(f"torchrun of {ranks} process(es): one process per GPU, 2 or more")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
            module, *args]


def torchrun_outcome(rc: int, summary: dict | None, ranks: int, what: str) -> dict:
    """Rank 0's summary of a torchrun of `ranks` processes that ended with exit code `rc`;
    MegabenchError where there is none, where it names an error, or where a process failed
    (rc != 0) after rank 0 wrote it."""
    if summary is None:
        raise MegabenchError(f"{what} across {ranks} GPUs (torchrun) ended with exit code {rc} and no summary from "
                             "rank 0")
    if summary.get("error"):
        raise MegabenchError(f"{what} across {ranks} GPUs (torchrun): {summary['error']}")
    if rc != 0:
        raise MegabenchError(f"{what} across {ranks} GPUs (torchrun): rank 0 wrote its summary but torchrun ended "
                             f"with exit code {rc} (a process failed)")
    return summary


def launch_torchrun(ranks: int, args: Sequence[str], *, module: str = TORCHRUN_MODULE, what: str = "steps",
                    timeout: float | None = 1800) -> dict:
    """`module` under torchrun across `ranks` GPUs of this node, NVLink multicast off
    (microbench.xgpu.world.check_multicast_off), `args` and `--summary PATH` on its command line;
    rank 0's summary (torchrun_outcome). Danger: a process that dies without its rank's gather
    leaves the others waiting in it; `timeout` bounds the whole run."""
    n = gpu_count()
    if n < ranks:
        raise ConfigError(f"torchrun: {ranks} ranks need {ranks} GPUs, this node has {n}")
    env = os.environ.copy()
    check_multicast_off(env)
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "summary.json"
        rc = subprocess.run(torchrun_command(ranks, [*args, "--summary", str(out)], module), env=env,
                            timeout=timeout).returncode
        summary = json.loads(out.read_text()) if out.is_file() else None
    return torchrun_outcome(rc, summary, ranks, what)


def torchrun_why(ranks: int) -> str:
    return f"torchrun, one process per GPU ({ranks} of the node's {gpu_count()}), peer memory through CUDA IPC"


def run_torchrun(ranks: int, preset_name: str, *, tokens: int, ctx: int, mode: str, steps: int, expert_parallel: bool,
                 check: bool, profile: bool, seed: int, log=print, timeout: float | None = 1800) -> RanksRun:
    """step_ranks across `ranks` GPUs of this node, one process each (rank_main under torchrun);
    rank 0's summary comes back."""
    args = ["--preset", preset_name, "--tokens", str(tokens), "--ctx", str(ctx), "--mode", mode, "--steps",
            str(steps), "--seed", str(seed)]
    args += ["--expert-parallel"] * expert_parallel + ["--check"] * check + ["--profile"] * profile
    s = launch_torchrun(ranks, args, what="steps", timeout=timeout)
    for c in s["checks"]:
        log(f"check passed: {c}")
    return RanksRun("torchrun", torchrun_why(ranks), s["tokens"], s["checks"],
                    [CollectiveWait(**w) for w in s["waits"]])


def start_rank():
    """This torchrun process's world (microbench.xgpu.world.init: RANK, WORLD_SIZE, LOCAL_RANK,
    multicast off) on its GPU: (world, device)."""
    wld = world.init()
    torch.cuda.set_device(wld.device)
    return wld, torch.device("cuda", wld.device)


def end_rank(buf) -> None:
    """After a rank's last step: every rank past a barrier (no rank reads or pushes into a peer's
    slots any more), then its peer buffer closed and the process group left."""
    torch.cuda.synchronize()
    dist.barrier()
    buf.close()
    dist.destroy_process_group()


def rank_main(argv=None) -> int:
    """One rank of step_ranks under torchrun (RANK, WORLD_SIZE, LOCAL_RANK from its environment):
    the TP build's engine of this rank on its GPU, its receive slots in peer memory. Every rank
    runs the same steps; rank 0 gathers every rank's outputs, checks them (--check: bitwise the
    unsharded build's, computed on its GPU) and writes the summary."""
    ap = argparse.ArgumentParser(prog="torchrun ... -m megakernel.ranks", description=rank_main.__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinytp")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=40)
    ap.add_argument("--mode", default="mega", choices=["mega", "chain"])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--summary", help="rank 0 writes its summary (JSON) here")
    a = ap.parse_args(argv)
    wld, dev = start_rank()
    cfg = get_preset(a.preset)
    role = rank_role(cfg, wld.rank, wld.size, wld.local_rank, check=a.check)
    w = generate(cfg, device=dev)
    cache0 = KVCache(cfg, device=dev).fill_random(torch.Generator(device=dev).manual_seed(a.seed))
    toks, par = step_inputs(cfg, a.tokens, a.seed)
    r, me = role.ranks, role.rank
    plan = make_plan(cfg, device_info(wld.device).sm_count, tp_ranks=r, expert_parallel=a.expert_parallel,
                     spin_bound_ns=2_000_000_000, profile=a.profile, profile_cap=256)
    link, buf = open_rank(wld, plan, dev)
    eng = rank_engine(w, plan, cache0.clone(), link, expert_parallel=a.expert_parallel)
    routes, ref, one = None, None, None
    if role.unsharded:  # the reference's routing (forced on every rank) and the unsharded step
        tr = Trace()
        ref = reference_step(w, cache0.clone(), toks, par, a.ctx, trace=tr)
        routes = [tr.tensors[f"L{l}.route"].cpu() for l in range(cfg.n_layers)]  # gathered to every rank
        p1 = make_plan(cfg, plan.n_sm, tp_ranks=1, spin_bound_ns=2_000_000_000)
        one = RankEngine(w, p1, cache0.clone(), backend="gpu").step(toks, par, a.ctx, mode=a.mode, routes=routes)
    routes = world.all_gather_object(routes)[0]  # rank 0's
    torch.cuda.synchronize()
    dist.barrier()  # every rank's receive slots are empty before any rank pushes into them
    err, out, done = None, None, []
    try:
        out = eng.step(toks, par, a.ctx, mode=a.mode, routes=[x.to(dev) for x in routes] if routes else None)
        done.append(out.tokens.tolist())
        pos = a.ctx + a.tokens
        left = {k: v for k, v in eng.recv_words_written().items() if v}
        for _ in range(a.steps - 1):
            done.append([int(eng.step([done[-1][-1]], [-1], pos, mode=a.mode).tokens[0])])
            pos += 1
    except MegabenchError as e:  # a bounded wait that gave up: said by rank 0, the others may wait on it
        err, left = str(e), {}
    waits = []
    if a.profile and err is None:
        waits = [dataclasses.asdict(x) for x in collective_waits(eng.timeline(a.mode), eng.program, lambda l, b: me)]
    data = {} if out is None else {"logits": out.logits.cpu(), "tokens": out.tokens.cpu(), "steps' tokens": done}
    got = world.all_gather_object((RankRecord(me, err, data), left, waits))
    if role.gathers:
        s = {"ranks": r, "preset": a.preset, "error": None, "checks": [], "tokens": done,
             "waits": [x for g in got for x in g[2]]}
        try:
            bad = gather_problems([g[0] for g in got], r)
            if bad:  # a rank's error (a wait that gave up) or a rank unlike rank 0
                raise MegabenchError("; ".join(bad))
            s["checks"].append(f"R = {r}: every rank's logits and tokens alike")
            if a.check:
                check_close(one.logits, ref, f"{a.preset} TP build, R = 1, vs the reference", rel=REL_TOL)
                s["checks"].append(f"R = 1 within {REL_TOL:g} of the torch reference (its routing forced)")
                outs = [StepOut(g[0].data["logits"], g[0].data["tokens"]) for g in sorted(got, key=lambda g: g[0].rank)]
                check_step(outs, one, f"R = {r} across GPUs")
                bad = {g[0].rank: g[1] for g in got if g[1]}
                if bad:
                    raise CorrectnessError(f"receive slots left written after the step: {bad}")
                s["checks"].append(f"R = {r} across GPUs: every rank bitwise R = 1's, every receive slot empty")
        except MegabenchError as e:
            s["error"] = str(e)
        if a.summary:
            write_json(a.summary, s)
        print(json.dumps({k: s[k] for k in ("ranks", "error", "checks", "tokens")}))
    end_rank(buf)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
