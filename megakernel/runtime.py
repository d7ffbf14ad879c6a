"""Running the megakernel: buffers, the parameter block, chain and mega modes, on the GPU or in
the host emulation.

    eng = Engine(weights, plan, cache, backend="gpu")     # or backend="emu" (CPU tensors)
    out = eng.step(tokens, parents, ctx, mode="mega")     # or mode="chain" / "chain_nopdl"
    out.logits [T, V] fp32, out.tokens [T] (greedy), cache updated in place like reference.step

A batch: B requests in one step, each with its own tree, context and KV cache:

    eng = Engine(weights, plan, [cache0, cache1, ...], backend="gpu")
    out = eng.step_batch([Request(tokens0, parents0, ctx0), Request(tokens1, parents1, ctx1)])
    out.request(r).logits [T_r, V], out.request(r).tokens [T_r]; cache r updated in place

The requests' rows are concatenated (at most T_MAX = 16 rows in all: one m16 token tile in every
GEMM). Every op but attention is row-independent and attention splits each request's keys as if
it ran alone, so request r's logits, tokens and cache are bitwise those of its own B=1 step.

A speculative pair (megakernel/decode.py builds it): the drafter's Engine (`spec=SpecLink("draft",
...)`, its program the draft pass) and the verifier's (`spec=SpecLink("verify", ...)`: its plain
program for prefill and plain steps, and the spec step, `launch_step(spec=True)`) share the speculative state
and the drafter's top-2 (SpecLink), so a run of steps needs nothing from the host between steps.

Chain mode launches one op instance per kernel launch in program order (the study's baseline
structure: our own kernel chain), with programmatic dependent launch where the plan has it and the
op allows (launch_pdl_flags; "chain_nopdl": the same chain without); mega mode launches each `Program.launches` range as one
persistent kernel whose units order themselves through dependency counters. The same kernel
binary runs both.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from microbench.clocks.profiler import ProfileBuffer, ProfileLayout, Timeline
from microbench.errors import CorrectnessError, DeviceMemoryError, GpuTooSmallError, SpinTimeoutError
from microbench.launch import LaunchSpec, launch
from microbench.sync.sentinel import BF16 as BF16_SLOT, F32 as F32_SLOT
from microbench.watchdog import Watchdog

from . import abi, tiling, tree as treelib
from .build import build_emu, build_gpu
from .config import ConfigError
from .fp4_layout import is_canonical
from .plan import Plan
from .profile_events import EVENTS
from .program import (WHAT_AR, WHAT_GATHER_ACT, WHAT_GATHER_Y, WHAT_LOADER_GATE, WHAT_LOADER_PACE, WHAT_LOADER_ROUTE,
                      WHAT_NORM_ROWS, WHAT_RING_EMPTY, WHAT_RING_FULL, WHAT_SENTINEL, UNION_SHARED, Program,
                      build as build_program)
from .reference import KVCache, Request
from .weights import BF16, ModelWeights, weight_bytes


def _as_i32(word: int) -> int:
    """A 32-bit word as the int32 a tensor holds."""
    return word - (1 << 32) if word >= 1 << 31 else word


# an empty fp32 sentinel slot as an int32 word (the rule's single source: microbench/sync/sentinel.py)
_EMPTY_F32_SLOT = _as_i32(F32_SLOT.fill_word)


def stack_k_groups(w: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G * k] -> [G * N, k]: the K groups of a matrix stacked, group-major (TP oproj's copy:
    unit g * (N / rows) + tile is tile `tile` of group g; ops/tp_oproj.cuh)."""
    n, kk = w.shape
    if kk % k:
        raise ConfigError(f"stack_k_groups: {kk} columns are not whole groups of {k}")
    return w.reshape(n, kk // k, k).permute(1, 0, 2).reshape(-1, k).contiguous()


class EmulationError(RuntimeError):
    """The host emulation found a deadlock or an illegal operation."""


# The host emulation's schedules (emu.cpp emu_set_schedule): "random", every pick a live fiber
# drawn from the seed; "last", the block running the last unit of each op instance is delayed
# (it runs only when every other block is blocked) until its next unit; "block", one block per op
# instance, drawn from the seed, is delayed while it runs that op's units. The random schedule
# rarely starves a block, so a missing wait mostly goes unnoticed there; the delayed producers
# make the consumers run first wherever a dependency lets them. "rank": every block of one rank
# of a launch (Plan.launch_ranks; drawn from the seed) is delayed, so that the other ranks wait for
# its data until only it can run.
EMU_SCHEDULES = {"random": 0, "last": 1, "block": 2, "rank": 3}


@dataclass(frozen=True)
class RankLink:
    """What a rank's engine shares with the other ranks of its plan (runtime's RankEngine, or one
    process per GPU): its rank, the watchdog record of its launch (every rank of a launch writes
    one record, so a wait that gives up ends the others' waits too), and with tensor parallelism
    its receive slots (`recv`: .ptr, and .fill(offset, bytes, word)) and the table of every rank's
    receive slots as this rank addresses them (`peers`: int64 [tp_ranks] on its device)."""

    rank: int
    watchdog: Watchdog
    recv: object | None = None
    peers: torch.Tensor | None = None


@dataclass
class SpecLink:
    """What a speculative engine shares with its partner (decode.py SpecPair makes both links).
    role "draft": its program is the draft pass (`seed` first), `table` the seed table
    [V][SEED_COLS] (abi.py), `top2` the buffer its argmax writes the top-2 into; role "verify": its
    spec program is the verify step (`tree` first, then accept / compact / advance), `table` the tree
    table [T_MAX][TREE_INTS], `top2` the drafter's (the tree op's input). `state`: int32 [n_req,
    SPEC_INTS], the requests' speculative state (abi.py SPEC_FIELDS); `rows`: this engine's rows
    per request in a spec step (draft: the tree's tokens less one; verify: the tree's tokens)."""
    role: str
    state: torch.Tensor
    rows: tuple[int, ...]
    table: torch.Tensor
    top2: torch.Tensor

    def __post_init__(self):
        if self.role not in ("draft", "verify"):
            raise ConfigError(f"spec role {self.role!r}: 'draft' or 'verify'")
        n = len(self.rows)
        if not 1 <= n <= abi.B_MAX or tuple(self.state.shape) != (n, abi.SPEC_INTS) or self.state.dtype != torch.int32:
            raise ConfigError(f"spec state {tuple(self.state.shape)} {self.state.dtype}: want int32 [{n}, {abi.SPEC_INTS}] "
                              f"for {n} requests (1..{abi.B_MAX})")
        if self.top2.dtype != torch.int32 or self.top2.numel() < 2 * sum(self.rows):
            raise ConfigError("spec top2: want int32 with two entries per draft row")


@dataclass
class StepOut:
    logits: torch.Tensor  # [rows, V] fp32
    tokens: torch.Tensor  # [rows] int64: greedy token after each tree position
    row0: tuple[int, ...] = ()  # each request's first row, then the row count (empty: one request)

    @property
    def n_requests(self) -> int:
        return max(1, len(self.row0) - 1)

    def request(self, r: int) -> StepOut:
        """Request r's rows (views)."""
        b = self.row0 or (0, self.logits.shape[0])
        if not 0 <= r < len(b) - 1:
            raise IndexError(f"request {r}: this step has {len(b) - 1}")
        return StepOut(self.logits[b[r]:b[r + 1]], self.tokens[b[r]:b[r + 1]])


def _ptr(t: torch.Tensor | None) -> int:
    """A tensor's address for the kernel's Params. Bulk copies and L2 prefetches need 16-byte
    alignment (the PTX cp.async.bulk rule): an unaligned view is refused here, not faulted on."""
    if t is None:
        return 0
    if t.data_ptr() % 16:
        raise ConfigError(f"tensor {tuple(t.shape)} {t.dtype} at {t.data_ptr():#x}: the megakernel needs 16-byte "
                          "aligned buffers (bulk copies); pass a contiguous copy")
    return t.data_ptr()


def step_launches(owner, e, mode: str, spec: bool, part: range | None):
    """The prepared step's program, params blob, launches (with their PDL flags) and the part of
    them to enqueue, for Engine.launch_step, RankEngine.launch_step and GroupEngine.launch_step
    (`owner` holds the prepared program and params, `e` the engine whose launch table every rank,
    or every row group, shares). Refused: no step prepared, or a
    part that is not a consecutive run of the step's launches (the counters' clean and the parity
    turn assume the parts of one step go in order)."""
    prog = owner.spec_program if spec else owner.program
    params = owner._spec_params_dev if spec else owner._params_dev
    if params is None:
        raise ConfigError("launch_step: no step prepared (prepare / prepare_batch first)")
    todo = list(zip(e.launches(mode, prog), e.launch_pdl(mode, prog)))
    part = range(len(todo)) if part is None else part
    if part and (part[0] < 0 or part[-1] >= len(todo) or part.step != 1):
        raise ValueError(f"part {part}: launches 0..{len(todo) - 1}, consecutive")
    return prog, params, todo, part


# Headroom the copies leave for what a step allocates after them (scratch, graphs, the caller's
# tensors): below it, a run would fail later, deep in an allocation, instead of here by name.
COPY_HEADROOM = 2 << 30


def check_copies_fit(need: int, free: int, total: int, gpu: str, model: str, resident: int = 0) -> None:
    """Raise DeviceMemoryError, naming the model, the bytes and the GPU, when the tiled weight copies
    an engine is about to allocate (need) do not fit the free memory (free) with COPY_HEADROOM;
    GpuTooSmallError where they would not fit even a GPU holding nothing but the model's own
    weights (resident bytes): no run of this model fits this GPU, a GPU test's reason to skip."""
    if need + COPY_HEADROOM <= free:
        return
    never = need + COPY_HEADROOM + resident > total
    raise (GpuTooSmallError if never else DeviceMemoryError)(
        f"{model}: the megakernel's tiled weight copies need {need / 2**30:.1f} GiB (+ {COPY_HEADROOM >> 30} GiB "
        f"headroom) of GPU memory, {gpu} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
        + (f", and the model's weights take {resident / 2**30:.1f} GiB of it: it cannot run on this GPU"
           if never else "")
        + ". Run this model on a GPU with more memory, or a smaller preset")


class Engine:
    def __init__(self, weights: ModelWeights, plan: Plan, cache: KVCache | Sequence[KVCache], *, backend: str = "gpu",
                 program_mode: str = "layer", grid: int | None = None, emu_seed: int = 1,
                 code_budget: int | None = None, profile_launches: Iterable[int] | None = None,
                 emu_schedule: str = "random", spec: SpecLink | None = None, share: Engine | None = None,
                 link: RankLink | None = None, group_member: bool = False):
        if backend not in ("gpu", "emu"):
            raise ValueError(f"backend {backend!r}: 'gpu' or 'emu'")
        if emu_schedule not in EMU_SCHEDULES:
            raise ValueError(f"emu_schedule {emu_schedule!r}: one of {', '.join(EMU_SCHEDULES)}")
        if plan.cfg != weights.cfg:
            raise ConfigError("plan and weights are for different model configs")
        if link is None and (plan.launch_ranks > 1 or plan.tp_ranks):
            raise ConfigError(f"a plan of {max(plan.launch_ranks, plan.tp_ranks)} ranks runs in a RankEngine (ranks.py), "
                              "or one process per GPU (ranks.run_torchrun): an Engine alone is one rank")
        if plan.row_groups > 1 and not group_member:
            raise ConfigError(f"a plan of {plan.row_groups} row groups runs in a groups.GroupEngine (its kernel reads "
                              "a parameter block per group): an Engine alone is one group")
        self.link = link
        self.rank = link.rank if link else 0
        # one KV cache per request a step may hold (request r reads and writes caches[r])
        self.caches = [cache] if isinstance(cache, KVCache) else list(cache)
        if not 1 <= len(self.caches) <= abi.B_MAX or not all(isinstance(c, KVCache) for c in self.caches):
            raise ConfigError(f"Engine takes a KVCache or a list of 1..{abi.B_MAX} of them (one per request)")
        if any(c.cfg != weights.cfg for c in self.caches):
            raise ConfigError("a KV cache is for another model config than the weights")
        if len({id(c) for c in self.caches}) != len(self.caches):
            raise ConfigError("the same KV cache twice: each request needs its own (one writes the other's rows)")
        self.w, self.plan, self.cfg, self.cache = weights, plan, weights.cfg, self.caches[0]
        self.backend = backend
        self.spec = spec
        # the drafter's only program is its pass; the verifier keeps the plain step (prefill, plain
        # decoding) beside its spec step: both run the same kernel on the same buffers and counters
        role = spec.role if spec else None
        self.program: Program = (build_program(plan, program_mode, spec="draft") if role == "draft"
                                 else build_program(plan, program_mode))
        self.spec_program: Program | None = (build_program(plan, program_mode, spec="verify") if role == "verify"
                                             else self.program if role == "draft" else None)
        if spec is not None and len(spec.rows) > len(self.caches):
            raise ConfigError(f"a speculative step of {len(spec.rows)} requests needs as many KV caches, this engine "
                              f"has {len(self.caches)}")
        if spec is not None and sum(spec.rows) > self.cfg.max_tree:
            raise ConfigError(f"a speculative step of {'+'.join(map(str, spec.rows))} rows: at most "
                              f"{self.cfg.max_tree} (one m16 tile of tokens)")
        self._last_program = self.program  # the program the last launch ran (describe_wait)
        self.dev = weights.device
        if backend == "gpu" and self.dev.type != "cuda":
            raise ConfigError("backend 'gpu' needs weights on a CUDA device")
        if backend == "emu" and self.dev.type != "cpu":
            raise ConfigError("backend 'emu' runs on CPU tensors")
        self.grid = grid or (plan.n_sm if backend == "gpu" else 4)
        self.prof = None
        if plan.profile:
            progs = [self.program] + ([self.spec_program] if self.spec_program is not None else [])
            n = max(max(len(p.launches), len(p.ops)) for p in progs)  # a slice per launch of either mode
            self.prof = ProfileBuffer(ProfileLayout(self.grid, 1, plan.profile_cap), launches=n,
                                      device="cpu" if backend == "emu" else (self.dev.index or 0))
        self._prof_launches = None
        self._plain = None  # the unprofiled build's kernel (gpu) or library (emu): see profile_launches
        self._code_budget = code_budget
        self.emu_seed = emu_seed
        self.emu_schedule = emu_schedule  # the emulation's schedule (EMU_SCHEDULES); the GPU ignores it
        self._check_weights()
        self._alloc()
        self._keep: list[torch.Tensor] = []  # the tiled dense weights the kernel points into
        self._share = share
        if backend == "gpu":
            free, total = torch.cuda.mem_get_info(self.dev)
            pool = torch.cuda.memory_reserved(self.dev) - torch.cuda.memory_allocated(self.dev)
            check_copies_fit(self.copies_needed(), free + pool, total, torch.cuda.get_device_name(self.dev),
                             self.cfg.name, resident=weight_bytes(self.w))
        self._layers_blob = self._layer_ptrs()
        self._kv_blob = self._kv_table()
        self.wd = link.watchdog if link else Watchdog(plan.spin_bound_ns, device=self.dev)
        self.parity = 0
        self._dirty = [False, False]
        if backend == "gpu":
            self.build = build_gpu(plan, code_budget=code_budget)
            self.kernel = self.build.kernel()
        else:
            self.dll = build_emu(plan)
        self.profile_launches = profile_launches  # after the build: a sample also loads the plain one
        self._params_dev = None
        self._spec_params_dev = None
        if spec is not None:
            self._spec_params_dev = self._params(False, self.spec_program)
            if spec.role == "draft":  # its pass is its step: launch_step runs it
                self._params_dev = self._spec_params_dev
            self.set_spec_rows([0] * len(spec.rows))

    @property
    def profile_launches(self) -> frozenset[int] | None:
        """The launch indices the profiler records (None: every launch). A launch that is not
        recorded runs the unprofiled build of the same plan (the same op code, so the same bits),
        loaded when a sample is first set: the profiled code costs even where it records nothing.
        Set it before capturing a graph (the kernels and buffer pointers are baked into the graph)."""
        return self._prof_launches

    @profile_launches.setter
    def profile_launches(self, launches) -> None:
        if launches is None:
            self._prof_launches = None
            return
        if self.prof is None:
            raise ConfigError("profile_launches needs a plan built with profile=True")
        sel = frozenset(int(i) for i in launches)
        bad = sorted(i for i in sel if not 0 <= i < self.prof.launches)
        if bad:
            raise ConfigError(f"profile_launches {bad[:8]}: launch indices run 0..{self.prof.launches - 1}")
        if self._plain is None:
            plain = replace(self.plan, profile=False, profile_detail=False)
            if plain.smem_bytes != self.plan.smem_bytes:  # _launch gives both builds one size
                raise ConfigError(f"profile_launches: the unprofiled build needs {plain.smem_bytes} B of shared "
                                  f"memory, the profiled one {self.plan.smem_bytes} B")
            if self.backend == "gpu":
                self._plain_build = build_gpu(plain, code_budget=self._code_budget)
                self._plain = self._plain_build.kernel()
            else:
                self._plain = build_emu(plain)
        self._prof_launches = sel

    # ------------------------------------------------------------------ setup
    def _check_weights(self):
        for l, lw in enumerate(self.w.layers):
            for name, bank in (("w1", lw.w1), ("w2", lw.w2)):
                if not is_canonical(bank.scales):
                    raise ConfigError(f"layer {l} {name}: block scales must be positive, nonzero and finite "
                                      "(build banks with ExpertBank.from_natural, fp4_layout.canonical_scales)")
                if not torch.isfinite(bank.tensor_scale).all():
                    raise ConfigError(f"layer {l} {name}: non-finite tensor scale")

    def _alloc(self):
        c, p, dev = self.cfg, self.plan, self.dev
        tm = c.max_tree
        parts = p.attn_parts
        z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
        self.buf = {
            "x": z(tm, c.d_model), "ss_part": z(2, tm, c.d_model // 8),
            "xg": z(2, c.d_model // p.norm_k, tm, p.xg_row, dt=BF16),  # gemm.cuh xg_at
            "q": z(tm, c.n_heads, c.head_dim, dt=BF16),
            "att_o": z(c.n_kv_heads, parts, c.group * 16, c.head_dim),
            "att_ml": z(c.n_kv_heads, parts, c.group * 16, 2), "att_out": z(tm, c.attn_width, dt=BF16),
            "router_logits": z(tm, c.n_experts), "route_sel": z(tm, c.top_k, dt=torch.int32),
            "route_w": z(tm, c.top_k), "route_slot": z(tm, c.top_k, dt=torch.int32),
            "route_pos": z(tm, c.top_k, dt=torch.int32), "slot_expert": z(p.max_slots, dt=torch.int32),
            "slot_ntok": z(p.max_slots, dt=torch.int32), "slot_tok": z(p.max_slots, 16, dt=torch.int32),
            "n_slots": z(1, dt=torch.int32), "pooled": z(tm, c.d_pool, dt=BF16),
            "act": z(p.max_slots, 16, c.d_expert, dt=BF16), "yexp": z(p.max_slots, 16, c.d_pool, dt=BF16),
            # Plan.fused_experts: each down-projection unit's fp32 partial (a slot's K-parts)
            "ypart": (z(p.max_slots, p.fused_parts, 16, c.d_pool) if p.fused_experts else z(1)),
            "z": z(tm, c.d_pool, dt=BF16), "logits": z(tm, c.vocab), "amax_val": z(c.vocab // 16, tm),
            "amax_idx": z(c.vocab // 16, tm, dt=torch.int32), "amax_val2": z(c.vocab // 16, tm),
            "amax_idx2": z(c.vocab // 16, tm, dt=torch.int32), "out_tokens": z(tm, dt=torch.int32),
            # the drafter's top-2 lives in the pair's shared buffer (SpecLink.top2): the verifier reads it
            "top2": (self.spec.top2 if self.spec is not None and self.spec.role == "draft"
                     else z(tm, 2, dt=torch.int32)),
            "rank_slots": z(1 + p.max_slots, dt=torch.int32),  # TP expert_parallel: this rank's slots
            # Plan.union_experts: this group's expert -> slot map and (group 0's) the union tables
            # (groups.GroupEngine stacks every group's pooled and yexp and sizes group 0's act)
            "expert_slot": z(c.n_experts, dt=torch.int32), "u_nslots": z(1, dt=torch.int32),
            "u_expert": z(max(p.max_uslots, 1), dt=torch.int32), "u_ntok": z(max(p.max_uslots, 1), dt=torch.int32),
            "u_row": z(max(p.max_uslots, 1), 16, dt=torch.int32), "u_dst": z(max(p.max_uslots, 1), 16, dt=torch.int32),
        }
        self.empty_sentinel_slots()
        # one pair of counter halves for every program of this engine (argmax clears the other half whole)
        n_ctr = max(self.program.n_counters, self.spec_program.n_counters if self.spec_program else 0)
        self.counters = z(2, n_ctr, dt=torch.int32)
        self.prog_t = torch.from_numpy(self.program.encode()).to(dev)
        self.spec_prog_t = (torch.from_numpy(self.spec_program.encode()).to(dev)
                            if self.spec_program is not None else None)
        self.step_t = z(abi.STEP_INTS, dt=torch.int32)  # the step block (abi.STEP_FIELDS)
        self.tokens_t = z(tm, dt=torch.int32)
        self.depth_t = z(tm, dt=torch.int32)
        self.anc_t = z(tm, dt=torch.int32)
        self.row_req_t = z(tm, dt=torch.int32)
        self.route_t = z(c.n_layers, tm, c.top_k, dt=torch.int32)

    def copies_needed(self) -> int:
        """Bytes of the tiled weight copies _layer_ptrs will allocate (those the tiling cache does
        not hold yet): the LM head unless shared, each layer's dense projections and both expert
        banks' codes and scales."""
        n = 0
        sh = self._share
        if not (sh is not None and sh.plan.tiles["lm_head"] == self.plan.tiles["lm_head"] and sh.dev == self.dev):
            n += tiling.copy_bytes(self.w.lm_head, tiling.weight_tile(self.plan, "lm_head"))
        for lw in self.w.layers:
            for field in tiling.LAYER_WEIGHTS:
                n += tiling.copy_bytes(getattr(lw, field), tiling.weight_tile(self.plan, field))
            for bank, op in ((lw.w1, "expert1"), (lw.w2, "expert2")):
                t = self.plan.tiles[op]
                n += tiling.copy_bytes(bank.codes, t) + tiling.copy_bytes(bank.scales, t)
        return n

    def _tiled(self, w: torch.Tensor, field: str) -> torch.Tensor:
        """The kernel's copy of dense weight `w` (tiling.py), kept alive with this engine."""
        t = tiling.tiled(w, tiling.weight_tile(self.plan, field))
        self._keep.append(t)
        return t

    def _fp4_copies(self, bank, op: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's copies of an expert bank's codes and scales for op's tile (tiling.fp4_copies),
        kept with this engine."""
        out = tiling.fp4_copies(bank.codes, bank.scales, self.plan.tiles[op])
        self._keep.extend(out)
        return out

    def _layer_ptrs(self) -> torch.Tensor:
        sh = self._share
        if sh is not None and (sh.w.embed is not self.w.embed or sh.w.lm_head is not self.w.lm_head):
            raise ConfigError("share: the engine whose LM head this one reads must hold the same embedding and "
                              "LM head tensors (a drafter shares the target's)")
        if sh is not None and sh.plan.tiles["lm_head"] == self.plan.tiles["lm_head"] and sh.dev == self.dev:
            self._lm_head = sh._lm_head  # the same tiled copy: one LM head in device memory, not two
        else:
            self._lm_head = self._tiled(self.w.lm_head, "lm_head")
        arr = (abi.LayerPtrs * self.cfg.n_layers)()
        for l, lw in enumerate(self.w.layers):
            s = arr[l]
            s.attn_norm, s.ffn_norm = _ptr(lw.attn_norm), _ptr(lw.ffn_norm)
            for field in tiling.LAYER_WEIGHTS:  # tiled: a ring chunk is one copy
                w = getattr(lw, field)
                if field == "wo" and self.plan.tp_ranks:  # TP: the rank's K groups stacked (ops/tp_oproj.cuh)
                    w = stack_k_groups(w, self.plan.tiles["oproj"].k)
                setattr(s, field, _ptr(self._tiled(w, field)))
            w1c, w1s = self._fp4_copies(lw.w1, "expert1")
            w2c, w2s = self._fp4_copies(lw.w2, "expert2")
            s.w1_codes, s.w1_scales, s.w1_ts = _ptr(w1c), _ptr(w1s), _ptr(lw.w1.tensor_scale)
            s.w2_codes, s.w2_scales, s.w2_ts = _ptr(w2c), _ptr(w2s), _ptr(lw.w2.tensor_scale)
        blob = torch.frombuffer(bytearray(ctypes.string_at(ctypes.addressof(arr), ctypes.sizeof(arr))),
                                dtype=torch.uint8)
        return blob.to(self.dev)

    def _kv_table(self) -> torch.Tensor:
        """Params.kv: [L][B_MAX][2] addresses of each request's K and V cache per layer (0 past the
        engine's caches: a step never has more requests than caches, _set_inputs checks)."""
        tab = torch.zeros(self.cfg.n_layers, abi.B_MAX, 2, dtype=torch.int64)
        for r, cache in enumerate(self.caches):
            for l in range(self.cfg.n_layers):
                for i, t in enumerate((cache.k[l], cache.v[l])):
                    if t.device.type != self.dev.type or t.dtype != BF16 or not t.is_contiguous():
                        raise ConfigError(f"KV cache {r} layer {l}: want contiguous bf16 on {self.dev}")
                    tab[l, r, i] = _ptr(t)
        return tab.to(self.dev)

    def _params(self, override: bool, program: Program | None = None,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None, n_active: int = 1) -> torch.Tensor:
        """The parameter block of `program` (default the plain one; the spec program's reads and
        writes the speculative state and the pair's top-2 and tables, SpecLink). shared: (encoded
        program, counters) of a groups.GroupEngine, which every group's block points to instead of
        this engine's own; n_active: its step's row groups."""
        b = self.buf
        P = abi.Params()
        P.layers = _ptr(self._layers_blob)
        P.embed, P.final_norm = _ptr(self.w.embed), _ptr(self.w.final_norm)
        P.lm_head = _ptr(self._lm_head)
        P.rope_cos, P.rope_sin = _ptr(self.w.rope_cos), _ptr(self.w.rope_sin)
        prog = program or self.program
        P.program = _ptr(self.spec_prog_t if prog is self.spec_program and prog is not self.program else self.prog_t)
        if prog.spec is not None:
            P.spec = _ptr(self.spec.state)
            if self.spec.role == "draft":
                P.spec_seed = _ptr(self.spec.table)
            else:
                P.spec_tree, P.spec_top2 = _ptr(self.spec.table), _ptr(self.spec.top2)
        P.step, P.kv = _ptr(self.step_t), _ptr(self._kv_blob)
        P.tokens, P.depth, P.anc = _ptr(self.tokens_t), _ptr(self.depth_t), _ptr(self.anc_t)
        P.row_req = _ptr(self.row_req_t)
        P.route_override = _ptr(self.route_t) if override else 0
        for name in ("x", "ss_part", "xg", "q", "att_o", "att_ml", "att_out", "router_logits", "route_sel",
                     "route_w", "route_slot", "route_pos", "slot_expert", "slot_ntok", "slot_tok", "n_slots",
                     "pooled", "act", "yexp", "ypart", "z", "logits", "amax_val", "amax_idx", "amax_val2",
                     "amax_idx2", "out_tokens", "top2", "expert_slot", "u_nslots", "u_expert", "u_ntok", "u_row",
                     "u_dst"):
            setattr(P, name, _ptr(b[name]))
        P.n_active = n_active
        counters = self.counters if shared is None else shared[1]
        if shared is not None:
            P.program = _ptr(shared[0])
        P.counters = _ptr(counters)
        P.watchdog = self.wd.ptr
        P.n_counters = counters.shape[1]
        P.rank = self.rank
        if self.plan.tp_ranks:
            P.recv, P.peers = self.link.recv.ptr, _ptr(self.link.peers)
            P.rank_slots = _ptr(b["rank_slots"])
        blob = torch.frombuffer(bytearray(abi.pack(P)), dtype=torch.uint8)
        return blob.to(self.dev)

    # ------------------------------------------------------------------ helpers
    def poison(self) -> None:
        """NaN in every float scratch buffer (ints 0: an index must never go out of bounds), so a
        read of data no unit of this step wrote shows up in the result."""
        for t in self.buf.values():
            if t.is_floating_point():
                t.fill_(float("nan"))
            else:
                t.zero_()
        self.empty_sentinel_slots()  # "not yet written" is the sentinel there, not NaN

    def empty_sentinel_slots(self) -> None:
        """Sentinel slots (plan.sentinel_route: the router logits) hold -0.0 when empty; their
        reader resets them after each use. Danger: a slot left written (an aborted step, a poison
        fill) would be read as fresh data by the next step, so every such path calls this."""
        if self.plan.sentinel_route:
            self.buf["router_logits"].view(torch.int32).fill_(_EMPTY_F32_SLOT)
        if self.plan.tp_ranks:  # TP: this rank's receive slots (mk/tp.cuh)
            for name, (off, n) in self.plan.recv_layout.items():
                self.link.recv.fill(off, n, F32_SLOT.fill_word if name == "ar" else BF16_SLOT.fill_word)

    def unemptied_sentinel_slots(self) -> int:
        """How many sentinel slots hold data (0 after a step: every reader resets what it read);
        with TP, this rank's receive slots count too (words of them, where the engine can read them)."""
        n = 0
        if self.plan.sentinel_route:
            n += int((self.buf["router_logits"].view(torch.int32) != _EMPTY_F32_SLOT).sum())
        if self.plan.tp_ranks:
            n += sum(self.recv_words_written().values())
        return n

    def recv_words_written(self) -> dict[str, int]:
        """TP: 32-bit words of each receive-slot region of this rank that hold data (not empty)."""
        out = {}
        for name, (off, nbytes) in self.plan.recv_layout.items():
            words = self.link.recv.words(off, nbytes)
            empty = F32_SLOT.fill_word if name == "ar" else BF16_SLOT.fill_word
            out[name] = int((words != _as_i32(empty)).sum())
        return out

    def describe_wait(self, what: int) -> str:
        i, code = what >> 4, what & 15
        prog = self._last_program
        if self.plan.tp_ranks and code in (WHAT_AR, WHAT_GATHER_ACT, WHAT_GATHER_Y):  # mk/tp.cuh what_x
            i, src, slot = i & 0xFFF, (what >> 16) & 15, what >> 20
            if not 0 <= i < len(prog.ops):
                return f"wait id {what}"
            o = prog.ops[i]
            thing = {WHAT_AR: f"rank {src}'s oproj partial of K group {slot} (all-reduce)",
                     WHAT_GATHER_ACT: f"rank {src}'s gate/up activations of expert slot {slot} (gather)",
                     WHAT_GATHER_Y: f"rank {src}'s expert outputs of expert slot {slot} (gather)"}[code]
            return (f"{o.kind}(L{o.layer}) [op {i}]: {thing} in the waiting rank's receive slots (still empty: rank "
                    f"{src} never pushed them, or a slot was reset after its push, or the wait read the idle copy)")
        if not 0 <= i < len(prog.ops):
            return f"wait id {what}"
        o = prog.ops[i]
        name = (f"{o.kind}(L{o.layer}) [op {i}" + (f" of the {prog.spec} program" if prog.spec else "")
                + (f", row group {o.group}]" if prog.groups > 1 else "]"))
        if code < WHAT_RING_FULL and code < len(o.deps):
            pr = prog.ops[o.deps[code].producer]
            if self.plan.union_experts and pr.kind in UNION_SHARED and o.deps[code].mode == 0:
                # one counter for every group's instance (program.grouped)
                return (f"{name} dependency {code}: all units of every row group's {pr.kind}(L{pr.layer}) "
                        f"[op {pr.index}'s counter]")
            mode = "all units" if o.deps[code].mode == 0 else "one group"
            return f"{name} dependency {code}: {mode} of {pr.kind}(L{pr.layer}) [op {pr.index}]"
        return {WHAT_RING_FULL: f"{name}: a weight chunk in the ring (consumer)",
                WHAT_RING_EMPTY: f"{name}: a free ring stage (loader)",
                WHAT_LOADER_ROUTE: f"{name}: the routing of this layer (loader)",
                WHAT_LOADER_GATE: f"{name}: the compute warps finishing the previous op (loader, no run-ahead)",
                WHAT_SENTINEL: f"{name}: the router logits in their sentinel slots (still -0.0: a router unit "
                               "never wrote them, or a slot was not reset)",
                WHAT_NORM_ROWS: f"{name}: the bulk copies of the normed operand's rows (consumer)",
                WHAT_LOADER_PACE: f"{name}: the first weight chunk of the routed op landing (loader, opening pace)",
                }.get(code, f"{name} code {code}")

    def _route_table(self, routes, rows: int) -> torch.Tensor:
        """Forced routing, per layer [rows, top_k] expert ids, as the kernel's route table
        [L][max_tree][top_k] (rows past `rows` zero). Refused: a layer count, a shape, an id out of
        range, or a token routed to the same expert twice (the kernel's slots assume distinct)."""
        c = self.cfg
        if len(routes) != c.n_layers:
            raise ConfigError(f"routes for {len(routes)} layers, model has {c.n_layers}")
        rt = torch.zeros(c.n_layers, c.max_tree, c.top_k, dtype=torch.int32)
        for l, rl in enumerate(routes):
            rl = torch.as_tensor(rl).to(torch.int64).cpu()
            if rl.shape != (rows, c.top_k):
                raise ConfigError(f"layer {l}: route shape {tuple(rl.shape)} != ({rows}, {c.top_k})")
            if (rl < 0).any() or (rl >= c.n_experts).any():
                raise ConfigError(f"layer {l}: expert ids outside [0, {c.n_experts})")
            if any(len(set(row.tolist())) != c.top_k for row in rl):
                raise ConfigError(f"layer {l}: a token is routed to the same expert twice")
            rt[l, :rows] = rl.to(torch.int32)
        return rt

    def _set_inputs(self, requests: Sequence[Request], routes) -> tuple[int, ...]:
        """Check a step's requests and copy their rows, the step block and the forced routing (if
        any) to the device. Returns each request's first row, then the row count."""
        c = self.cfg
        reqs = list(requests)
        if not reqs:
            raise ConfigError("a step needs at least one request")
        if len(reqs) > len(self.caches):
            raise ConfigError(f"{len(reqs)} requests but this engine has {len(self.caches)} KV caches (one per request)")
        toks_all, depth_all, anc_all, req_all, ctxs, counts = [], [], [], [], [], []
        for r, q in enumerate(reqs):
            what = f"request {r}: " if len(reqs) > 1 else ""
            tokens = [int(x) for x in (q.tokens.tolist() if torch.is_tensor(q.tokens) else q.tokens)]
            t, ctx = len(tokens), int(q.ctx)
            try:
                c.check_step(ctx, t)
            except ConfigError as e:
                raise ConfigError(f"{what}{e}") from None
            if len(q.parents) != t:
                raise ConfigError(f"{what}{t} tokens but {len(q.parents)} parents")
            if any(not 0 <= x < c.vocab for x in tokens):
                raise ConfigError(f"{what}token ids must be in [0, {c.vocab})")
            depth = treelib.depths(q.parents)
            if ctx + max(depth) >= c.max_context:
                raise ConfigError(f"{what}position {ctx + max(depth)} outside the RoPE table ({c.max_context})")
            anc = treelib.ancestor_mask(q.parents)  # bits relative to the request's first row
            toks_all += tokens
            depth_all += depth
            anc_all += [int(sum(1 << j for j in range(t) if anc[i, j])) for i in range(t)]
            req_all += [r] * t
            ctxs.append(ctx)
            counts.append(t)
        rows = len(toks_all)
        if rows > c.max_tree:
            raise ConfigError(f"{len(reqs)} requests of {'+'.join(map(str, counts))} = {rows} token rows in one step; "
                              f"an Engine's step holds at most {c.max_tree} (B x T <= {c.max_tree}: one m16 tile of "
                              "tokens in every GEMM). More rows run as row groups: groups.GroupEngine")
        pad = c.max_tree - rows
        rt = self._route_table(routes, rows) if routes is not None else None
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        self.step_t.copy_(i32(abi.pack_step(ctxs, counts)))
        self.tokens_t.copy_(i32(toks_all + [0] * pad))
        self.depth_t.copy_(i32(depth_all + [0] * pad))
        self.anc_t.copy_(i32(anc_all + [0] * pad))
        self.row_req_t.copy_(i32(req_all + [0] * pad))
        if routes is not None:
            self.route_t.copy_(rt)
        return tuple(int(sum(counts[:r])) for r in range(len(counts) + 1))

    # ------------------------------------------------------------------ running
    def launches(self, mode: str, program: Program | None = None) -> list[tuple[int, int, int, int]]:
        """(first op, ops, wait, grid) of each kernel launch of one step of `program` (default the
        plain one). Modes: "mega", "chain" (one launch per op instance, with PDL where the plan has
        it: launch_pdl) and "chain_nopdl" (the same launches, none with PDL)."""
        prog = program or self.program
        if mode == "mega":
            return [(f, n, 1, self.grid) for f, n in prog.launches]
        if mode in CHAIN_MODES:
            n_req = len(self.spec.rows) if self.spec is not None else 1
            static = {"topk": 1, "argmax": 1, "advance": 1, "seed": n_req, "tree": n_req, "accept": n_req}
            return [(o.index, 1, 0, min(self.grid, static[o.kind]) if o.kind in static else self.grid)
                    for o in prog.ops]
        raise ValueError(f"mode {mode!r}: 'mega', 'chain' or 'chain_nopdl'")

    def launch_pdl(self, mode: str, program: Program | None = None) -> list[bool]:
        """Whether each launch of `mode` is a programmatic dependent launch (launch_pdl_flags)."""
        return launch_pdl_flags(program or self.program, self.plan.pdl, mode)

    def set_spec_rows(self, ctxs: Sequence[int]) -> None:
        """The spec step's shape (SpecLink.rows per request, each request's context `ctxs[r]`) into
        the step block and the rows' requests; the drafter's rows also get their fixed chains (depth
        j, ancestors 0..j: its pass is a chain of seeds at context 0). The verifier's plain steps
        share these buffers: call this again before spec steps that follow plain ones."""
        if self.spec is None:
            raise ConfigError("set_spec_rows: this engine has no speculative role")
        rows = list(self.spec.rows)
        if len(ctxs) != len(rows):
            raise ConfigError(f"{len(ctxs)} contexts for {len(rows)} requests")
        for r, (c, t) in enumerate(zip(ctxs, rows)):
            try:
                self.cfg.check_step(int(c), t)
            except ConfigError as e:
                raise ConfigError(f"request {r}: {e}") from None
        pad = self.cfg.max_tree - sum(rows)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        self.step_t.copy_(i32(abi.pack_step([int(c) for c in ctxs], rows)))
        self.row_req_t.copy_(i32([r for r, t in enumerate(rows) for _ in range(t)] + [0] * pad))
        if self.spec.role == "draft":
            self.depth_t.copy_(i32([j for t in rows for j in range(t)] + [0] * pad))
            self.anc_t.copy_(i32([(1 << (j + 1)) - 1 for t in rows for j in range(t)] + [0] * pad))
        self._row0 = tuple(int(sum(rows[:r])) for r in range(len(rows) + 1))

    def prepare(self, tokens, parents, ctx: int, routes=None) -> int:
        """Copy a one-request step's inputs to the device and pack the parameter block. Returns T."""
        return self.prepare_batch([Request(tokens, parents, ctx)], routes)

    def prepare_batch(self, requests: Sequence[Request], routes=None) -> int:
        """Copy a step of these requests (request r on caches[r]) to the device and pack the
        parameter block. `routes` (forced routing): per layer [rows, top_k] over the requests'
        rows in order. Returns the step's rows."""
        if self.spec is not None and self.spec.role == "draft":
            raise ConfigError("the drafter's step is its pass (its rows' tokens come from its seed op): launch_step "
                              "runs it, force_routes forces its routing")
        self._row0 = self._set_inputs(requests, routes)
        self._params_dev = self._params(routes is not None)
        return self._row0[-1]

    def note_replayed(self, steps: int, mode: str) -> None:
        """A CUDA graph of captured steps ran `steps` more steps than launch_step saw (each a whole
        step): bring the host's counter bookkeeping (parity, which half is dirty) along, as if
        launch_step had launched them. Danger: without it, the next launch_step after an odd
        number of replayed steps would use a half its last step left dirty, and its waits would
        pass early."""
        if mode == "mega":
            for _ in range(steps):
                self._dirty[self.parity] = True
                self._dirty[self.parity ^ 1] = False
                self.parity ^= 1

    def force_routes(self, routes: Sequence[torch.Tensor] | None) -> None:
        """The spec step's routing forced (per layer [rows, top_k] over its rows in order, as
        prepare's `routes`), or the kernel's own top-k again (None). For checks against a reference
        whose router near-ties could flip an expert."""
        if self.spec is None:
            raise ConfigError("force_routes: this engine has no speculative role (prepare takes routes)")
        if routes is not None:
            self.route_t.copy_(self._route_table(routes, sum(self.spec.rows)))
        self._spec_params_dev = self._params(routes is not None, self.spec_program)
        if self.spec.role == "draft":
            self._params_dev = self._spec_params_dev

    def launch_step(self, mode: str = "mega", *, spec: bool = False, part: range | None = None) -> None:
        """Enqueue the kernels of the prepared step (nothing else: this is what timing measures).
        spec: the verifier's spec step instead of the plain one (the drafter's step is its pass
        either way). part: only these launch indices of the step, in order (a step's split into
        draft / verify / accept: decode.py); the counters are cleaned before its first launch and
        the parity turns after its last, so the parts of one step must be launched in order."""
        if spec and self.spec_program is None:
            raise ConfigError("launch_step(spec=True): this engine has no spec program (SpecLink)")
        prog, params, todo, part = step_launches(self, self, mode, spec, part)
        if not part:
            return
        if part[0] == 0:
            if mode == "mega" and self._dirty[self.parity]:
                self.counters[self.parity].zero_()
            if self.prof is not None:
                self.prof.reset()
        self._last_program = prog
        for li in part:
            (first, n, wait, grid), pdl = todo[li]
            self._launch(first, n, wait, grid, li, pdl=pdl, params=params)
        if mode == "mega" and part[-1] == len(todo) - 1:
            self._dirty[self.parity] = True
            self._dirty[self.parity ^ 1] = False  # the step's argmax cleared it
            self.parity ^= 1

    def enqueue(self, tokens, parents, ctx: int, *, mode: str = "mega", routes=None) -> int:
        """prepare() + launch_step() (no synchronisation). Returns T."""
        return self.enqueue_batch([Request(tokens, parents, ctx)], mode=mode, routes=routes)

    def enqueue_batch(self, requests: Sequence[Request], *, mode: str = "mega", routes=None) -> int:
        """prepare_batch() + launch_step() (no synchronisation). Returns the step's rows."""
        rows = self.prepare_batch(requests, routes)
        self.launch_step(mode)
        return rows

    def _launch(self, first, n, wait, grid, li=0, pdl=False, params=None):
        params = self._params_dev if params is None else params
        recorded = self.prof is not None and (self._prof_launches is None or li in self._prof_launches)
        pb, pm = self.prof.args(li) if recorded else (0, np.uint64(0))
        plain = self.prof is not None and not recorded  # a sampled profile: the unprofiled build
        if self.backend == "gpu":
            # one shared-memory size for both builds (the profile_launches setter checks it)
            spec = LaunchSpec(grid=grid, block=self.plan.threads, smem=self.plan.smem_bytes, pdl=pdl)
            kernel = self._plain if plain else self.kernel
            launch(kernel, spec, params, np.int32(first), np.int32(n), np.int32(wait),
                   np.int32(self.parity), pb, pm, persistent=bool(wait))
        else:
            err = ctypes.create_string_buffer(2048)
            dll = self._plain if plain else self.dll
            if dll.emu_set_schedule(EMU_SCHEDULES[self.emu_schedule]):  # the library's state: set every launch
                raise EmulationError(f"the emulation does not know schedule {self.emu_schedule!r}")
            rc = dll.mk_emu_run(params.data_ptr(), grid, first, n, wait, self.parity,
                                self.emu_seed, err, len(err), pb, int(pm))
            self.emu_seed += 1
            if rc:
                self._check_watchdog(wait)
                raise EmulationError(f"ops {first}..{first + n - 1}: {err.value.decode(errors='replace')}")

    def timeline(self, mode: str = "mega", program: Program | None = None):
        """The profiler's stamps of the last step as a microbench.clocks Timeline (needs a plan
        built with profile=True); its launches named from `program`'s (default the plain one)."""
        if self.prof is None:
            raise ConfigError("this engine was built without the profiler (make_plan(..., profile=True))")
        names = [f"launch {i}: ops {f}..{f + n - 1}" for i, (f, n, _, _) in enumerate(self.launches(mode, program))]
        n = len(names)
        stamps = self.prof.read()
        return Timeline.build(stamps, EVENTS, launch_names=names + [f"unused {i}" for i in range(n, self.prof.launches)])

    def _check_watchdog(self, wait):
        try:
            self.wd.check(self.describe_wait, context=f"megakernel ({self.cfg.name}, {self.backend})")
        except SpinTimeoutError:
            self.wd.reset()
            self.counters.zero_()
            self.empty_sentinel_slots()
            self._dirty = [False, False]
            raise

    def step(self, tokens, parents: Sequence[int], ctx: int, *, mode: str = "mega", routes=None) -> StepOut:
        """One request's step on caches[0]."""
        return self.step_batch([Request(tokens, parents, ctx)], mode=mode, routes=routes)

    def step_batch(self, requests: Sequence[Request], *, mode: str = "mega", routes=None) -> StepOut:
        """A step of these requests (request r on caches[r]); out.request(r) is request r's."""
        rows = self.enqueue_batch(requests, mode=mode, routes=routes)
        if self.backend == "gpu":
            torch.cuda.synchronize()
        self._check_watchdog(mode == "mega")
        return StepOut(self.buf["logits"][:rows].clone(), self.buf["out_tokens"][:rows].to(torch.int64).clone(),
                       self._row0)


CHAIN_MODES = ("chain", "chain_nopdl")
# the ops whose loader reads this step's routing (slot records, slot count) before the compute
# warps' griddepcontrol.wait (program.cuh loader_loop, chain mode: b.wait == 0)
ROUTED_OPS = ("expert1", "expert2")


def launch_pdl_flags(program: Program, plan_pdl: bool, mode: str) -> list[bool]:
    """PDL per launch of a step. The kernel built with Plan.pdl makes its compute warps wait for
    the previous grid (griddepcontrol.wait) before touching its outputs,
    while its loader warp streams weights at once; so a launch may overlap the tail of the one
    before whenever its loader reads nothing that launch writes.
      mega         every launch after the first (all persistent: the tuned pdl_pays constant)
      chain        every launch after the first except the routed ops': in chain mode their
                   loader reads the routing (written by top-k) before any wait. Danger: with PDL
                   it could start while top-k still runs and stream the wrong experts' weights
      chain_nopdl  none (the chain as it ran before PDL)
    Without plan_pdl (a build whose kernels do not wait) none."""
    if mode == "mega":
        return [plan_pdl and i > 0 for i in range(len(program.launches))]
    if mode == "chain":
        return [plan_pdl and i > 0 and o.kind not in ROUTED_OPS for i, o in enumerate(program.ops)]
    if mode == "chain_nopdl":
        return [False] * len(program.ops)
    raise ValueError(f"mode {mode!r}: 'mega', 'chain' or 'chain_nopdl'")


def check_close(got: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 2e-2) -> float:
    """||got - ref|| / ||ref||, raising CorrectnessError above `rel` or on any NaN."""
    g, r = got.double().cpu(), ref.double().cpu()
    if torch.isnan(g).any():
        raise CorrectnessError(f"{what}: NaN in the output ({int(torch.isnan(g).sum())} elements)")
    err = float((g - r).norm() / r.norm().clamp_min(1e-30))
    if err > rel:
        raise CorrectnessError(f"{what}: relative error {err:.3e} exceeds {rel:.1e}")
    return err

