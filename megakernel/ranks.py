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
                 peer memory (run_rank_process)
Without tensor parallelism (tp_ranks 0) a launch of R ranks runs R copies of the unsharded model,
each on its own cache: the plumbing of rank-local block indices and parameter blocks alone.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from microbench.errors import CorrectnessError, SpinTimeoutError
from microbench.launch import LaunchSpec, launch
from microbench.watchdog import Watchdog, fields as wd_fields

from .config import ConfigError
from .plan import Plan
from .reference import KVCache
from .runtime import EMU_SCHEDULES, EmulationError, Engine, RankLink, StepOut
from .weights import ModelWeights, shard


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
    """The plan's launch_ranks ranks in one launch (emulation or one GPU). `cache`: the model's KV
    cache (tensor parallelism: each rank writes its kv heads in place), or without tensor
    parallelism a list of one cache per rank. `grid`: blocks per rank (default: the GPU's SMs
    shared out, or 2 in the emulation)."""

    def __init__(self, weights: ModelWeights, plan: Plan, cache: KVCache | Sequence[KVCache], *,
                 backend: str = "emu", program_mode: str = "layer", grid: int | None = None, emu_seed: int = 1,
                 emu_schedule: str = "random"):
        r = plan.launch_ranks
        if plan.tp_ranks and plan.tp_ranks != r:
            raise ConfigError(f"a plan of {plan.tp_ranks} TP ranks with {r} a launch: one launch holds every rank "
                              "(RankEngine) or one (a process per GPU: run_rank_process)")
        if emu_schedule not in EMU_SCHEDULES:
            raise ValueError(f"emu_schedule {emu_schedule!r}: one of {', '.join(EMU_SCHEDULES)}")
        if plan.tp_ranks:
            if not isinstance(cache, KVCache):
                raise ConfigError("tensor parallelism: one KV cache, every rank writes its kv heads of it")
            caches = [rank_cache(cache, k, r) for k in range(r)]
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
                                       grid=grid, emu_seed=emu_seed, emu_schedule=emu_schedule, link=link))
        self.emu_seed, self.emu_schedule = emu_seed, emu_schedule
        self.program = self.engines[0].program
        self._params_dev = None
        self._outs: list[StepOut] = []

    # ------------------------------------------------------------------ helpers
    def poison(self) -> None:
        for e in self.engines:
            e.poison()

    def describe(self) -> str:
        where = {"emu": "the CPU emulation", "gpu": "one GPU (the ranks share its SMs)"}[self.backend]
        return f"{self.ranks} ranks in one launch on {where}, {self.grid} blocks each"

    # ------------------------------------------------------------------ running
    def prepare(self, tokens, parents, ctx: int, routes=None) -> int:
        """Every rank's inputs and parameter block (the same step on each); one device copy of
        the blocks in rank order. Returns T."""
        t = 0
        for e in self.engines:
            t = e.prepare(tokens, parents, ctx, routes)
        self._params_dev = torch.cat([e._params_dev for e in self.engines])
        self._step = (t, ctx)
        return t

    def launch_step(self, mode: str = "mega") -> None:
        t, ctx = self._step
        e0 = self.engines[0]
        for e in self.engines:
            if mode == "mega" and e._dirty[e.parity]:
                e.counters[e.parity].zero_()
        for li, ((first, n, wait, grid), pdl) in enumerate(zip(e0.launches(mode), e0.launch_pdl(mode))):
            self._launch(first, n, wait, grid, t, ctx, pdl=pdl)
        if mode == "mega":
            for e in self.engines:
                e._dirty[e.parity] = True
                e._dirty[e.parity ^ 1] = False
                e.parity ^= 1

    def _launch(self, first: int, n: int, wait: int, grid: int, t: int, ctx: int, pdl: bool = False) -> None:
        """One launch of every rank: `grid` blocks per rank, the blocks of rank k after rank k-1's."""
        e0 = self.engines[0]
        total = grid * self.ranks
        self._last_grid = total
        if self.backend == "gpu":
            spec = LaunchSpec(grid=total, block=self.plan.threads, smem=self.plan.smem_bytes, pdl=pdl)
            launch(e0.kernel, spec, self._params_dev, np.int32(first), np.int32(n), np.int32(wait), np.int32(t),
                   np.int32(ctx), np.int32(e0.parity), 0, np.uint64(0), persistent=bool(wait))
            return
        err = ctypes.create_string_buffer(2048)
        if e0.dll.emu_set_schedule(EMU_SCHEDULES[self.emu_schedule]):
            raise EmulationError(f"the emulation does not know schedule {self.emu_schedule!r}")
        rc = e0.dll.mk_emu_run(self._params_dev.data_ptr(), total, first, n, wait, t, ctx, e0.parity, self.emu_seed,
                               err, len(err), 0, 0)
        self.emu_seed += 1
        if rc:
            self._check_watchdog()
            raise EmulationError(f"ops {first}..{first + n - 1}: {err.value.decode(errors='replace')}")

    def _check_watchdog(self) -> None:
        """SpinTimeoutError naming the rank, the op and what it waited for, when a wait gave up;
        then every rank's counters and sentinel slots are reset, as Engine does for one."""
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
        """One step on every rank; rank 0's logits and tokens (rank_outputs(): every rank's)."""
        t = self.prepare(tokens, parents, ctx, routes)
        self.launch_step(mode)
        if self.backend == "gpu":
            torch.cuda.synchronize()
        self._check_watchdog()
        self._outs = [StepOut(e.buf["logits"][:t].clone(), e.buf["out_tokens"][:t].to(torch.int64).clone())
                      for e in self.engines]
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
