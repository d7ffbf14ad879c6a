"""Launchers, torch references and correctness checks for the weights kernels.

Every launcher here checks its output against a torch reference on fresh random data before it
is timed, and again after (the timed launches overwrite the same outputs, so the last timed
launch is checked too). Reductions are 32-bit wrap-around sums; torch computes them exactly in
int64 and compares mod 2^32.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compiler import compile_cuda
from ..errors import CorrectnessError, KernelDoesNotFitError
from ..harness import Harness, Prepared
from ..launch import LaunchSpec, launch, max_resident_blocks
from ..watchdog import Watchdog
from . import plan

HERE = Path(__file__).resolve().parent
SOURCES = {"read": HERE / "read.cu", "ring": HERE / "ring.cu", "chase": HERE / "chase.cu"}
MASK = 0xFFFFFFFF
POISON = -0x21524111  # 0xDEADBEEF
RING_BOUND_NS = 1_000_000_000  # a ring wait gives up after 1 s (a healthy stage lands in microseconds)
DEVICE = "cuda"  # every tensor of this class lives here (one name, so a dry run can redirect it)


def module(which: str, arch: str):
    return compile_cuda(SOURCES[which], arch=arch)


def random_words(nbytes: int):
    """Fresh random 32-bit words on the GPU (full range, never zeros-only)."""
    import torch  # heavy: torch

    if nbytes % 4:
        raise ValueError(f"{nbytes} B is not a whole number of 32-bit words")
    return torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=DEVICE)


@dataclass
class Checked(Prepared):
    """Prepared plus a check to run after the timed series (watchdog record, last output)."""

    after: Callable[[], None] | None = None


def _mismatch(got, exp, what: str, unit: str) -> None:
    import torch  # heavy: torch

    if not torch.equal(got, exp):
        bad = (got != exp).nonzero().flatten()
        i = int(bad[0])
        raise CorrectnessError(f"{what}: {bad.numel()} of {got.numel()} {unit} differ from the torch reference "
                               f"(first: {unit[:-1]} {i}, got {int(got[i]) & MASK:#x}, "
                               f"expected {int(exp[i]) & MASK:#x})")


# ------------------------------------------------------------------------------------ exact sums
# torch's sum(dtype=int64) of an int32 tensor first makes an int64 copy of it (4 GiB for the 2 GiB
# ceiling buffer), so references are summed in row blocks of at most SUM_BLOCK words.
SUM_BLOCK = 1 << 26


def rowsum64(x):
    """int64 sums of each row of a 2-D int32 tensor, in bounded-memory blocks of rows."""
    import torch  # heavy: torch

    step = max(1, SUM_BLOCK // max(1, x.shape[1]))
    return torch.cat([x[i:i + step].sum(1, dtype=torch.int64) for i in range(0, x.shape[0], step)]) \
        if x.shape[0] else torch.zeros(0, dtype=torch.int64, device=x.device)


def colsum64(x):
    """int64 sums of each column of a 2-D int32 tensor, in bounded-memory blocks of rows."""
    import torch  # heavy: torch

    step = max(1, SUM_BLOCK // max(1, x.shape[1]))
    out = torch.zeros(x.shape[1], dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[0], step):
        out += x[i:i + step].sum(0, dtype=torch.int64)
    return out


# ------------------------------------------------------------------------------------ reads
def read_reference(buf, reps: int = 1):
    """Per-uint4-lane sums of the buffer, `reps` times, mod 2^32 (int64 tensor of 4)."""
    return (colsum64(buf.view(-1, 4)) * reps) & MASK


class ReadKernel:
    """One of read.cu's kernels on a persistent grid (blocks per SM from the occupancy calculator
    unless given), with its per-block output."""

    def __init__(self, h: Harness, kernel: str, threads: int, blocks_per_sm: int | None = None):
        import torch  # heavy: torch

        self.name = kernel
        self.k = module("read", h.info.arch).kernel(kernel)
        fit = max_resident_blocks(self.k, LaunchSpec(grid=1, block=threads)) // h.info.sm_count
        if fit < 1:
            raise KernelDoesNotFitError(f"{kernel} with {threads} threads: no block fits on an SM")
        if blocks_per_sm is not None and blocks_per_sm > fit:
            raise KernelDoesNotFitError(f"{kernel}: {blocks_per_sm} blocks of {threads} threads per SM requested, "
                                        f"{fit} fit ({self.k.attributes.num_regs} registers/thread)")
        self.blocks_per_sm = blocks_per_sm or fit
        self.spec = LaunchSpec(grid=self.blocks_per_sm * h.info.sm_count, block=threads)
        self.out = torch.full((self.spec.blocks * 4,), POISON, dtype=torch.int32, device=DEVICE)

    def launch(self, buf, n16: int, total: int, policy_kind: int = 0) -> None:
        launch(self.k, self.spec, buf, np.uint32(n16), np.uint64(total), self.out, np.uint32(policy_kind),
               persistent=True)

    def result(self):
        return colsum64(self.out.view(-1, 4)) & MASK

    def check(self, expected, what: str) -> None:
        _mismatch(self.result(), expected, f"{what} ({self.name})", "lanes")


class ReadJob:
    """A buffer of fresh random words and a read kernel bound to it, checked before use."""

    def __init__(self, h: Harness, nbytes: int, kernel: str = "mb_read_cg_u4", threads: int = 512,
                 blocks_per_sm: int | None = None, reps: int = 1, policy_kind: int = 0, buf=None):
        self.n16 = plan.check_read_size(nbytes)
        self.nbytes = nbytes
        self.reps = reps
        self.total = self.n16 * reps
        self.policy_kind = policy_kind
        self.rk = ReadKernel(h, kernel, threads, blocks_per_sm)
        self.buf = random_words(nbytes) if buf is None else buf
        self.expected = read_reference(self.buf, reps)
        self.what = f"read of {nbytes} B x {reps}"

    def __call__(self, policy_kind: int | None = None) -> None:
        self.rk.launch(self.buf, self.n16, self.total, self.policy_kind if policy_kind is None else policy_kind)

    def check(self) -> None:
        self.rk.check(self.expected, self.what)

    def first_check(self) -> None:
        """Run, check, poison the output, run again, check (a block that silently stopped writing
        would otherwise pass on the first run's values)."""
        import torch  # heavy: torch

        self()
        torch.cuda.synchronize()
        self.check()
        self.rk.out.fill_(POISON)
        self()
        torch.cuda.synchronize()
        self.check()


class Scrubber:
    """Evicts the L2 with clean reads of a buffer `multiple` x L2 (no dirty lines to write back,
    unlike the harness's read-modify-write flush, so a timed phase after it pays no write-backs)."""

    def __init__(self, h: Harness, multiple: float = 3.0):
        nbytes = int(math.ceil(multiple * h.info.l2_bytes / 4096)) * 4096
        self.job = ReadJob(h, nbytes, "mb_read_cg_u4", 512)
        self.job.first_check()

    def __call__(self) -> None:
        self.job()


def read_case_prepare(h: Harness, nbytes: int, cfg: plan.ReadConfig, reps: int = 1, bound=None,
                      metrics: dict | None = None) -> Checked:
    job = ReadJob(h, nbytes, cfg.kernel, cfg.threads, cfg.blocks_per_sm, reps)
    job.first_check()
    m = {"grid": job.rk.spec.blocks, "threads": cfg.threads, "blocks_per_sm": job.rk.blocks_per_sm,
         "reps": reps, "working_set_bytes": nbytes, "bytes_read": job.total * 16, **(metrics or {})}
    return Checked(launch=job, bound=bound, work=float(job.total * 16), metrics=m, after=job.check)


# ------------------------------------------------------------------------------------ ring
def ring_reference(buf, stage_bytes: int, grid: int, nchunks: int | None = None):
    """Per-block sums (mod 2^32) when block b consumes chunks b, b+grid, ... of `stage_bytes`."""
    import torch  # heavy: torch

    words = stage_bytes // 4
    n = nchunks if nchunks is not None else buf.numel() // words
    if n == 0:
        return torch.zeros(grid, dtype=torch.int64, device=buf.device)
    cs = rowsum64(buf[:n * words].view(n, words))
    idx = torch.arange(n, device=buf.device) % grid
    return torch.zeros(grid, dtype=torch.int64, device=buf.device).index_add_(0, idx, cs) & MASK


class RingKernel:
    """A ring.cu kernel on one block per SM: warp 0 produces, `consumer_warps` warps consume."""

    def __init__(self, h: Harness, cfg: plan.RingConfig, consumer_warps: int = 4, kernel: str = "mb_ring_stream",
                 bound_ns: int = RING_BOUND_NS, outputs_per_block: int = 1, grid: int | None = None):
        import torch  # heavy: torch

        grid = h.info.sm_count if grid is None else grid
        if not 1 <= grid <= h.info.sm_count:
            raise ValueError(f"a ring grid of {grid} blocks: want 1..{h.info.sm_count} (one block per SM)")
        if not 1 <= consumer_warps <= 31:
            raise ValueError(f"consumer_warps {consumer_warps} must be in 1..31 (plus the producer warp <= 32)")
        self.cfg = cfg
        self.name = kernel
        self.k = module("ring", h.info.arch).kernel(kernel)
        budget = plan.SmemBudget.from_device(h.info, int(self.k.attributes.shared_size_bytes))
        why = plan.refusal(cfg, budget)
        if why:
            raise KernelDoesNotFitError(why)
        self.spec = LaunchSpec(grid=grid, block=32 * (1 + consumer_warps), smem=cfg.smem_bytes())
        self.wd = Watchdog(bound_ns, device=DEVICE)
        self.out = torch.full((grid * outputs_per_block,), POISON, dtype=torch.int32, device=DEVICE)

    @property
    def grid(self) -> int:
        return self.spec.blocks

    def check_watchdog(self) -> None:
        self.wd.check(plan.ring_wait_description, context=f"{self.name} {self.cfg.label}")

    def launch(self, *args) -> None:
        launch(self.k, self.spec, *args, persistent=True)


class RingJob:
    """mb_ring_stream (or a broken variant) over fresh random data; with `pieces`, each stage
    arrives as that many bulk copies (mb_ring_stream_pieces)."""

    def __init__(self, h: Harness, cfg: plan.RingConfig, nbytes: int = 1 << 30, consumer_warps: int = 4,
                 kernel: str = "mb_ring_stream", bound_ns: int = RING_BOUND_NS, pieces: int | None = None,
                 grid: int | None = None):
        import torch  # heavy: torch

        if pieces is not None:
            if not (1 <= pieces <= 32 and cfg.stage_bytes % (16 * pieces) == 0):
                raise ValueError(f"{pieces} pieces of a {cfg.stage_bytes} B stage: need 1..32 pieces of a multiple "
                                 "of 16 bytes")
            kernel = "mb_ring_stream_pieces"
        self.pieces = pieces
        self.rk = RingKernel(h, cfg, consumer_warps, kernel, bound_ns, grid=grid)
        self.nbytes = plan.ring_buffer_bytes(cfg.stage_bytes, nbytes)
        self.nchunks = self.nbytes // cfg.stage_bytes
        self.buf = random_words(self.nbytes)
        self.expected = ring_reference(self.buf, cfg.stage_bytes, self.rk.grid)
        self.what = f"ring {cfg.label} over {self.nbytes} B"
        self._torch = torch

    def __call__(self) -> None:
        c = self.rk.cfg
        extra = () if self.pieces is None else (np.uint32(self.pieces),)
        self.rk.launch(self.buf, np.uint64(self.nchunks), np.uint32(c.stages), np.uint32(c.stage_bytes), *extra,
                       self.rk.out, self.rk.wd.rec, np.uint64(self.rk.wd.bound_ns))

    def check(self) -> None:
        self.rk.check_watchdog()
        _mismatch(self.rk.out.to(self._torch.int64) & MASK, self.expected, f"{self.what} ({self.rk.name})",
                  "blocks")

    def first_check(self) -> None:
        self()
        self._torch.cuda.synchronize()
        self.check()
        self.rk.out.fill_(POISON)
        self()
        self._torch.cuda.synchronize()
        self.check()


def ring_case_prepare(h: Harness, cfg: plan.RingConfig, nbytes: int = 1 << 30, consumer_warps: int = 4,
                      bound=None, kernel: str = "mb_ring_stream", pieces: int | None = None,
                      grid: int | None = None) -> Checked:
    job = RingJob(h, cfg, nbytes, consumer_warps, kernel, pieces=pieces, grid=grid)
    job.first_check()
    m = {"stages": cfg.stages, "stage_bytes": cfg.stage_bytes, "ring_bytes": cfg.ring_bytes,
         "smem_bytes": cfg.smem_bytes(), "consumer_warps": consumer_warps, "chunks": job.nchunks,
         "bytes_read": job.nbytes, "grid": job.rk.grid, "copies_per_stage": pieces or 1}
    return Checked(launch=job, bound=bound, work=float(job.nbytes), metrics=m, after=job.check)


# ------------------------------------------------------------------------------------ phases
def item_sums(experts, expert_bytes: int, stage_bytes: int):
    """[experts, chunks_per_expert] int64 sums of each stage-sized chunk of each expert."""
    import torch  # heavy: torch

    n_exp = experts.numel() * 4 // expert_bytes
    cpe = plan.chunks_per_expert(expert_bytes, stage_bytes)
    ex = experts[:n_exp * expert_bytes // 4].view(n_exp, expert_bytes // 4)
    if expert_bytes % stage_bytes:
        padded = torch.zeros((n_exp, cpe * stage_bytes // 4), dtype=torch.int32, device=experts.device)
        padded[:, :expert_bytes // 4] = ex
        ex = padded
    return rowsum64(ex.reshape(n_exp * cpe, stage_bytes // 4)).view(n_exp, cpe)


def phase_reference(sums, read_list: Sequence[int], grid: int):
    """Per-block phase-B sums when item q (chunk q % cpe of expert read_list[q // cpe]) goes to
    block q % grid."""
    import torch  # heavy: torch

    cpe = sums.shape[1]
    if not read_list:
        return torch.zeros(grid, dtype=torch.int64, device=sums.device)
    rd = torch.tensor(list(read_list), dtype=torch.int64, device=sums.device)
    q = torch.arange(len(read_list) * cpe, device=sums.device)
    vals = sums[rd[q // cpe], q % cpe]
    return torch.zeros(grid, dtype=torch.int64, device=sums.device).index_add_(0, q % grid, vals) & MASK


class PhaseJob:
    """mb_ring_phases over a pool of experts: phase A (prefetch `prefetch` experts into L2, stream
    `pa_bytes` of other data through the ring, busy until `busy_cycles`), then phase B (stream
    the `read` experts through the ring). Checked: both phases' per-block sums."""

    def __init__(self, h: Harness, cfg: plan.RingConfig, expert_bytes: int, n_experts: int,
                 prefetch: Sequence[int], read: Sequence[int], busy_cycles: int, pa_bytes: int = 0,
                 consumer_warps: int = 4, pool=None):
        import torch  # heavy: torch

        if expert_bytes % 16:
            raise ValueError(f"expert size {expert_bytes} B must be a multiple of 16 (bulk-copy granule)")
        for lst, nm in ((prefetch, "prefetch"), (read, "read")):
            if any(not 0 <= e < n_experts for e in lst):
                raise ValueError(f"{nm} list names an expert outside 0..{n_experts - 1}: {list(lst)}")
        if pa_bytes % cfg.stage_bytes:
            raise ValueError(f"phase-A bytes {pa_bytes} must be whole stages of {cfg.stage_bytes} B")
        self.rk = RingKernel(h, cfg, consumer_warps, "mb_ring_phases", outputs_per_block=2)
        self.cfg = cfg
        self.expert_bytes = expert_bytes
        self.pool = random_words(n_experts * expert_bytes) if pool is None else pool
        self.pa = random_words(pa_bytes) if pa_bytes else torch.zeros(4, dtype=torch.int32, device=DEVICE)
        self.pa_chunks = pa_bytes // cfg.stage_bytes
        dummy = [0]
        self.pf = torch.tensor(list(prefetch) or dummy, dtype=torch.int32, device=DEVICE)
        self.rd = torch.tensor(list(read) or dummy, dtype=torch.int32, device=DEVICE)
        self.n_pf, self.n_rd = len(prefetch), len(read)
        self.busy_cycles = int(busy_cycles)
        self.stamps = torch.zeros(self.rk.grid * 3, dtype=torch.int64, device=DEVICE)
        g = self.rk.grid
        self.expected_b = phase_reference(item_sums(self.pool, expert_bytes, cfg.stage_bytes), list(read), g)
        self.expected_a = (ring_reference(self.pa, cfg.stage_bytes, g, self.pa_chunks) if self.pa_chunks
                           else torch.zeros(g, dtype=torch.int64, device=DEVICE))
        self.what = (f"phases {cfg.label}: {self.n_pf} prefetched / {self.n_rd} read experts of {expert_bytes} B, "
                     f"{pa_bytes} B phase A")
        self._torch = torch

    def __call__(self) -> None:
        c = self.cfg
        self.rk.launch(self.pool, np.uint64(self.expert_bytes), self.pf, np.uint32(self.n_pf), self.rd,
                       np.uint32(self.n_rd), self.pa, np.uint64(self.pa_chunks), np.uint64(self.busy_cycles),
                       np.uint32(c.stages), np.uint32(c.stage_bytes), self.rk.out, self.stamps, self.rk.wd.rec,
                       np.uint64(self.rk.wd.bound_ns))

    def check(self) -> None:
        self.rk.check_watchdog()
        got = (self.rk.out.to(self._torch.int64) & MASK).view(-1, 2)
        _mismatch(got[:, 0].contiguous(), self.expected_b, f"{self.what}, phase B", "blocks")
        _mismatch(got[:, 1].contiguous(), self.expected_a, f"{self.what}, phase A", "blocks")

    def phase_times(self) -> dict:
        """Phase durations of the last launch from the %globaltimer stamps (ns)."""
        s = self.stamps.view(-1, 3).cpu().numpy().astype(np.int64)
        a = s[:, 1] - s[:, 0]
        b = s[:, 2] - s[:, 1]
        return {"phase_a_ns_median_globaltimer": float(np.median(a)),
                "phase_b_ns_median_globaltimer": float(np.median(b)),
                "phase_b_ns_max_globaltimer": float(b.max()),
                "kernel_span_ns_globaltimer": float(s[:, 2].max() - s[:, 0].min())}

    def first_check(self, before: Callable[[], None] | None = None) -> dict:
        for _ in range(2):
            if before:
                before()
            self()
            self._torch.cuda.synchronize()
            self.check()
            times = self.phase_times()
            self.rk.out.fill_(POISON)
        return times


# ------------------------------------------------------------------------------------ chase
class Chase:
    """A random single-cycle pointer chain over `working_set` bytes (one element per 128-B line)."""

    def __init__(self, h: Harness, working_set: int, rng: np.random.Generator, stride: int = plan.CHASE_STRIDE):
        import torch  # heavy: torch

        self.n = plan.chase_elements(working_set, stride)
        self.stride = stride
        self.order = plan.cyclic_order(self.n, rng)
        self.pos = np.empty_like(self.order)
        self.pos[self.order] = np.arange(self.n)
        nxt = plan.next_from_order(self.order)
        self.buf = random_words(self.n * stride)
        self.base = self.buf.data_ptr()
        words = self.buf.view(torch.int64).view(self.n, stride // 8)
        words[:, 0] = self.base + torch.from_numpy(nxt.astype(np.int64)).to(DEVICE) * stride
        self.k = module("chase", h.info.arch).kernel("mb_chase")
        self.out = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        self._torch = torch

    def expected(self, start: int, steps: int) -> int:
        return int(self.order[(int(self.pos[start]) + steps) % self.n])

    def run(self, start: int, steps: int, n_lat: int = 0, lat=None) -> dict:
        """One chase of n_lat (individually timed) + steps loads from element `start`; checked."""
        torch = self._torch
        if lat is None or n_lat == 0:
            lat = torch.zeros(1, dtype=torch.int32, device=DEVICE)
            n_lat = 0
        launch(self.k, LaunchSpec(grid=1, block=32), np.uint64(self.base + start * self.stride), np.uint64(steps),
               self.out, lat, np.uint32(n_lat))
        torch.cuda.synchronize()
        ptr, cycles, ns, sm = self.out.cpu().tolist()
        off = ptr - self.base
        want = self.expected(start, n_lat + steps)
        if off % self.stride or not 0 <= off // self.stride < self.n or off // self.stride != want:
            raise CorrectnessError(f"pointer chase over {self.n} elements from {start}: after {n_lat + steps} loads "
                                   f"it stopped at byte offset {off}, expected element {want} "
                                   f"(offset {want * self.stride}): loads were skipped, repeated or misread")
        return {"cycles": int(cycles), "ns": int(ns), "smid": int(sm), "end": off // self.stride}
