"""What the weights benchmarks run, decided on the CPU: ring configurations that fit in shared
memory (and why the others are refused), sweep grids, synthetic routing, chase permutations.

The ring's layout constants come from microbench/cuda/mb/ring.cuh (parsed, never retyped), so
the planner and the kernel cannot disagree about how many bytes a ring needs.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
RING_HEADER = Path(__file__).resolve().parent.parent / "cuda" / "mb" / "ring.cuh"


# ---------------------------------------------------------------------------------- ring layout
@dataclass(frozen=True)
class RingLimits:
    max_stages: int
    header_bytes: int
    max_stage_bytes: int


@functools.lru_cache(maxsize=1)
def ring_limits(header: Path = RING_HEADER) -> RingLimits:
    """kRingMaxStages / kRingHeaderBytes / kRingMaxStageBytes as ring.cuh defines them."""
    text = header.read_text()

    def grab(name: str) -> int:
        m = re.search(rf"constexpr\s+uint32_t\s+{name}\s*=\s*([^;]+);", text)
        if not m:
            raise RuntimeError(f"{header}: cannot find `constexpr uint32_t {name} = ...;`")
        expr = m.group(1).replace("u", "")
        if not re.fullmatch(r"[0-9()<>\-+* ]+", expr):
            raise RuntimeError(f"{header}: {name} = {m.group(1)!r} is not a plain integer expression")
        return int(eval(expr, {"__builtins__": {}}))  # digits and operators only (checked above)

    return RingLimits(grab("kRingMaxStages"), grab("kRingHeaderBytes"), grab("kRingMaxStageBytes"))


@dataclass(frozen=True)
class RingConfig:
    stages: int
    stage_bytes: int

    @property
    def ring_bytes(self) -> int:
        return self.stages * self.stage_bytes

    def smem_bytes(self, limits: RingLimits | None = None) -> int:
        """Dynamic shared memory the kernel must be launched with (ring_smem_bytes in ring.cuh)."""
        return (limits or ring_limits()).header_bytes + self.ring_bytes

    @property
    def label(self) -> str:
        b = self.stage_bytes
        return f"S{self.stages}xB{b // KiB}K" if b % KiB == 0 else f"S{self.stages}xB{b}"


@dataclass(frozen=True)
class SmemBudget:
    """What one block may use: the opt-in per-block limit, the per-SM capacity, the per-block
    reservation the driver keeps, and the kernel's own static shared memory."""

    optin_per_block: int
    per_sm: int
    reserved_per_block: int
    static_bytes: int

    @classmethod
    def from_device(cls, info, static_bytes: int) -> SmemBudget:
        return cls(info.smem_per_block_optin, info.smem_per_sm, info.reserved_smem_per_block, static_bytes)


# The H200's shared memory as device.py reads it; CPU tests plan against it.
H200_SMEM = SmemBudget(optin_per_block=232448, per_sm=233472, reserved_per_block=1024, static_bytes=128)


def refusal(cfg: RingConfig, budget: SmemBudget, limits: RingLimits | None = None) -> str | None:
    """Why `cfg` cannot run (one clear sentence), or None when it fits."""
    lim = limits or ring_limits()
    if cfg.stages < 2:
        return f"{cfg.label}: a ring needs >= 2 stages to overlap a copy with its consumption"
    if cfg.stages > lim.max_stages:
        return f"{cfg.label}: {cfg.stages} stages > kRingMaxStages = {lim.max_stages} barriers in ring.cuh"
    if cfg.stage_bytes <= 0 or cfg.stage_bytes % 16:
        return f"{cfg.label}: stage_bytes {cfg.stage_bytes} is not a positive multiple of 16 (bulk-copy granule)"
    if cfg.stage_bytes > lim.max_stage_bytes:
        return (f"{cfg.label}: stage_bytes {cfg.stage_bytes} > {lim.max_stage_bytes}, the most one mbarrier "
                f"transaction count can hold")
    dyn = cfg.smem_bytes(lim)
    need = dyn + budget.static_bytes
    if need > budget.optin_per_block:
        return (f"{cfg.label}: {cfg.stages} x {cfg.stage_bytes} B ring + {lim.header_bytes} B barriers + "
                f"{budget.static_bytes} B static = {need} B > {budget.optin_per_block} B opt-in shared memory "
                f"per block")
    if need + budget.reserved_per_block > budget.per_sm:
        return (f"{cfg.label}: {need} B + {budget.reserved_per_block} B reserved > {budget.per_sm} B shared "
                f"memory per SM (one block per SM would not be resident)")
    return None


@dataclass(frozen=True)
class RingPlan:
    fits: tuple[RingConfig, ...]
    refused: tuple[tuple[RingConfig, str], ...]


FULL_STAGES = tuple(range(2, 9))
FULL_STAGE_BYTES = tuple(k * KiB for k in (4, 8, 12, 16, 24, 32, 48, 64))
# The ring rule chooses among these only (weights/rules.py choose_ring): 2-8 stages of 8, 16, 32 or
# 64 KiB. The quick grid measures every one that fits and the full grid adds 4, 12, 24 and 48 KiB
# stages to show the curve: the choice must not depend on which grid ran (a candidate only one grid
# measures can be chosen by that grid alone).
CANDIDATE_STAGE_BYTES = tuple(k * KiB for k in (8, 16, 32, 64))
QUICK_RING = tuple(RingConfig(s, b) for b in CANDIDATE_STAGE_BYTES for s in FULL_STAGES)


def ring_candidate(cfg: RingConfig) -> bool:
    """Whether the ring rule may choose `cfg` (both grids measure every candidate that fits)."""
    return cfg.stage_bytes in CANDIDATE_STAGE_BYTES and cfg.stages in FULL_STAGES


def plan_ring(configs, budget: SmemBudget, limits: RingLimits | None = None) -> RingPlan:
    fits, refused = [], []
    for cfg in configs:
        why = refusal(cfg, budget, limits)
        if why is None:
            fits.append(cfg)
        else:
            refused.append((cfg, why))
    return RingPlan(tuple(fits), tuple(refused))


def ring_sweep(quick: bool, budget: SmemBudget, limits: RingLimits | None = None) -> RingPlan:
    if quick:
        return plan_ring(QUICK_RING, budget, limits)
    grid = [RingConfig(s, b) for s in FULL_STAGES for b in FULL_STAGE_BYTES]
    return plan_ring(grid, budget, limits)


def ring_buffer_bytes(stage_bytes: int, target: int = 1 << 30) -> int:
    """Largest multiple of the stage size <= target (the ring streams whole stages)."""
    if stage_bytes <= 0:
        raise ValueError("stage_bytes must be positive")
    return (target // stage_bytes) * stage_bytes


def ring_wait_description(what: int) -> str:
    """Decode a ring watchdog wait id (ring_wait_id in ring.cuh) for SpinTimeoutError messages."""
    if (what & 0xFF000000) != 0x52000000:
        return f"wait id {what}"
    kind = (what >> 20) & 0xF
    stage = (what >> 16) & 0xF
    lap = what & 0xFFFF
    name = {1: "full (bulk copy landed)", 2: "empty (consumers released)"}.get(kind, f"kind {kind}")
    return f"ring slot {stage} barrier {name}, lap {lap}"


# ---------------------------------------------------------------------------------- read sweeps
@dataclass(frozen=True)
class ReadConfig:
    load: str  # "nc" (ld.global.nc.L1::no_allocate) or "cg" (ld.global.cg)
    unroll: int
    threads: int
    blocks_per_sm: int | None = None  # None: as many as the occupancy calculator allows

    @property
    def kernel(self) -> str:
        return f"mb_read_{self.load}_u{self.unroll}"

    @property
    def label(self) -> str:
        bps = "max" if self.blocks_per_sm is None else str(self.blocks_per_sm)
        return f"{self.load}_u{self.unroll}_{bps}x{self.threads}"


READ_KERNELS = ("mb_read_nc_u2", "mb_read_nc_u4", "mb_read_nc_u8", "mb_read_cg_u4", "mb_read_cg_u8")


def ceiling_sweep(quick: bool) -> tuple[ReadConfig, ...]:
    if quick:
        return (ReadConfig("nc", 4, 512), ReadConfig("nc", 8, 256), ReadConfig("cg", 4, 512),
                ReadConfig("nc", 2, 1024))
    out = [ReadConfig(ld, u, t) for ld, u in (("nc", 2), ("nc", 4), ("nc", 8), ("cg", 4), ("cg", 8))
           for t in (256, 512, 1024)]
    out.append(ReadConfig("nc", 4, 512, blocks_per_sm=1))
    return tuple(out)


def check_read_size(nbytes: int) -> int:
    """n16 for a read buffer; refuses sizes the 32-bit physical index cannot address."""
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"read buffer of {nbytes} B: must be a positive multiple of 16")
    n16 = nbytes // 16
    if n16 >= 1 << 31:
        raise ValueError(f"read buffer of {nbytes} B: at most 32 GiB (the kernel's word index is 32-bit)")
    return n16


def l2_sizes(quick: bool) -> tuple[int, ...]:
    mib = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 256) if quick else (
        1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 72, 80, 96, 128, 192, 256)
    return tuple(m * MiB for m in mib)


def chase_sizes(quick: bool) -> tuple[int, ...]:
    mib = (1, 4, 16, 32, 48, 64, 128, 256) if quick else (
        1, 2, 4, 8, 16, 24, 32, 40, 44, 48, 52, 56, 60, 64, 80, 96, 128, 192, 256)
    return tuple(m * MiB for m in mib)


def reps_for(working_set: int, target: int = 1 << 30) -> int:
    """Passes over a working set so one launch reads about `target` bytes (>= 1)."""
    return max(1, round(target / working_set))


# ---------------------------------------------------------------------------------- chase
CHASE_STRIDE = 128  # one L2 line per element: no two chase steps share a line


def chase_elements(working_set: int, stride: int = CHASE_STRIDE) -> int:
    if stride < 128 or stride % 8:
        raise ValueError(f"chase stride {stride} B: must be >= 128 (one L2 line) and a multiple of 8")
    n = working_set // stride
    if n < 2:
        raise ValueError(f"chase working set {working_set} B holds fewer than 2 elements of {stride} B")
    return n


def cyclic_order(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random visiting order of 0..n-1; next[order[i]] = order[i+1 mod n] is ONE cycle of length n
    (a random permutation would split into many short cycles and the chase would stay in one)."""
    return rng.permutation(n)


def next_from_order(order: np.ndarray) -> np.ndarray:
    nxt = np.empty_like(order)
    nxt[order] = np.roll(order, -1)
    return nxt


def chase_expected(order: np.ndarray, start: int, steps: int) -> int:
    """Element reached from `start` after `steps` loads on the cycle given by `order`."""
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size)
    return int(order[(int(pos[start]) + steps) % order.size])


# ---------------------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Routing:
    """One synthetic step pair: the experts prefetched (the previous step's hottest) and the
    experts this step reads; `shared` of the prefetched ones are among those read."""

    prefetch: tuple[int, ...]
    read: tuple[int, ...]
    shared: int

    @property
    def overlap(self) -> float:
        return self.shared / len(self.prefetch) if self.prefetch else 0.0


def make_routing(n_experts: int, k_prefetch: int, m_read: int, overlap: float, rng: np.random.Generator) -> Routing:
    """k prefetched experts; m read experts of which round(overlap*k) are prefetched ones, the
    rest drawn from experts never prefetched. Order of reads shuffled."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap {overlap} must be in [0, 1]")
    if k_prefetch < 0 or m_read < 1:
        raise ValueError(f"need k_prefetch >= 0 and m_read >= 1 (got {k_prefetch}, {m_read})")
    shared = round(overlap * k_prefetch)
    if shared > m_read:
        raise ValueError(f"overlap {overlap} of {k_prefetch} prefetched = {shared} experts > {m_read} read")
    if k_prefetch + (m_read - shared) > n_experts:
        raise ValueError(f"{k_prefetch} prefetched + {m_read - shared} other read experts > {n_experts} experts")
    perm = rng.permutation(n_experts)
    pf = perm[:k_prefetch]
    others = perm[k_prefetch:k_prefetch + (m_read - shared)]
    hits = rng.choice(pf, size=shared, replace=False) if shared else np.empty(0, dtype=perm.dtype)
    rd = np.concatenate([hits, others])
    rng.shuffle(rd)
    return Routing(tuple(int(x) for x in pf), tuple(int(x) for x in rd), shared)


def expert_pool(expert_bytes: int, k_prefetch: int, m_read: int, l2_bytes: int, min_l2_multiple: float = 3.0) -> int:
    """Experts in the pool: enough for the routing, and >= min_l2_multiple x L2 bytes in total."""
    if expert_bytes <= 0 or expert_bytes % 16:
        raise ValueError(f"expert size {expert_bytes} B must be a positive multiple of 16")
    return max(k_prefetch + m_read, math.ceil(min_l2_multiple * l2_bytes / expert_bytes))


def chunks_per_expert(expert_bytes: int, stage_bytes: int) -> int:
    return -(-expert_bytes // stage_bytes)
