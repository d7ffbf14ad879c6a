"""Launching the cross-GPU kernels on this rank and bringing every rank's stamps to rank 0.

Every function here is collective: each rank calls it with the same arguments in the same order
(ranks that play no role in a launch still join its exchanges). Kernels read a u64 parameter
block whose layout is parsed from xgpu.cu (microbench/sync/params.py), so host and device
cannot disagree on it. Every wait on the GPU is bounded by BOUND_NS and a tripped watchdog raises
SpinTimeoutError naming the wait on the rank that tripped; the other ranks see it in the
exchange that follows and raise too.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compiler import compile_cuda
from ..device import device_info
from ..errors import CorrectnessError, SpinTimeoutError
from ..launch import LaunchSpec, launch
from ..sync import runners as SR
from ..sync.params import Layout, parse_enum
from ..sync.params import upload as _upload
from ..sync.sentinel import BF16, F32
from ..watchdog import Watchdog, fields
from . import analysis as A
from .world import PeerBuffer, World

SRC = Path(__file__).resolve().parent / "xgpu.cu"
# The first wait of a launch covers the other processes' launch skew (they start after a host
# barrier, within milliseconds); 2 s still ends a lost partner's launch long before anyone waits.
BOUND_NS = 2_000_000_000
XC = Layout(SRC, "XCParam", "XC_", "XC_NPARAMS")
XT = Layout(SRC, "XTParam", "XT_", "XT_NPARAMS")
XH = Layout(SRC, "XHParam", "XH_", "XH_NPARAMS")
XS = Layout(SRC, "XSParam", "XS_", "XS_NPARAMS")
XM = parse_enum(SRC, "XCMeta")
XSTAT = {v: k for k, v in parse_enum(SRC, "XStatus").items()}
XWAIT = {v: k for k, v in parse_enum(SRC, "XWait").items()}
_SHAPE = parse_enum(SRC, "XShape")
XC_THREADS = _SHAPE["XC_THREADS"]
LINE = 4 * _SHAPE["XS_LINE_WORDS"]  # bytes per flag line
_WAIT_TEXT = {
    "XW_SLOT": "a collective slot chunk (sender {hi}, round {lo} mod 65536)",
    "XW_GT_PING": "the clock ping-pong's ping of round {i}",
    "XW_GT_PONG": "the clock ping-pong's pong of round {i}",
    "XW_HOST": "the host's sequence number {i}",
    "XW_ARRIVE": "this GPU's blocks at stop {i}",
    "XW_PEER": "rank {hi}'s flag for stop {lo}",
    "XW_RELEASE": "block 0's release of stop {i}",
}


def describe_what(what: int) -> str:
    kind, i = what >> 24, what & 0xFFFFFF
    name = XWAIT.get(kind)
    if name is None:
        return f"unknown wait {what:#x}"
    return _WAIT_TEXT.get(name, name).format(i=i, hi=i >> 16, lo=i & 0xFFFF)


@functools.lru_cache(maxsize=None)
def module(arch: str):
    return compile_cuda(SRC, arch=arch)


def _stream() -> int:
    import torch  # heavy: torch

    return int(torch.cuda.current_stream().cuda_stream)


def sync_all() -> None:
    """Finish this rank's GPU work, then wait for every rank (the host-side step boundary)."""
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    torch.cuda.synchronize()
    dist.barrier()


def gather(t):
    """[ranks, *t.shape] of a same-shaped CUDA tensor from every rank (NCCL), as numpy on the host."""
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out).cpu().numpy()


def check_all(wd, context: str, describe=None) -> None:
    """Raise on every rank if any rank's watchdog tripped (the tripping rank names the wait)."""
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    tripped = _tripped(wd)
    flags = gather(torch.tensor([tripped], dtype=torch.int32, device="cuda")).ravel()
    if tripped:
        wd.check(describe or describe_what, context=f"rank {dist.get_rank()}: {context}")
    if flags.any():
        raise SpinTimeoutError(f"{context}: rank(s) {np.flatnonzero(flags).tolist()} gave up waiting "
                               "(their logs name the wait)")


def _tripped(wd) -> int:
    return int(wd.rec.cpu()[fields()["TRIPPED"]].item() != 0)


# ------------------------------------------------------------------ clocks
@dataclass
class HostAnchor:
    host_t0: np.ndarray  # ns, CLOCK_REALTIME before writing number k
    host_t1: np.ndarray  # ns, after seeing its echo
    gt: np.ndarray  # %globaltimer when the device saw number k

    def offset(self, keep: float = A.KEEP) -> A.Offset:
        """This GPU's %globaltimer minus the host's CLOCK_REALTIME (step: of the GPU's stamps alone)."""
        o = A.exchange_offset(self.host_t0, self.host_t1, self.gt, keep)
        return dataclasses.replace(o, step_ns=A.timer_step_ns(self.gt))


def host_anchor(w: World, rounds: int = 400) -> HostAnchor:
    """Every rank at once: its GPU's %globaltimer against host time (pinned-memory exchanges)."""
    import torch  # heavy: torch

    mod = module(_arch())
    seq = torch.zeros(32, dtype=torch.int32, pin_memory=True)
    ack = torch.zeros(32, dtype=torch.int32, pin_memory=True)
    s_np, a_np = seq.numpy(), ack.numpy()
    out = torch.zeros(rounds, dtype=torch.int64, device="cuda")
    meta = torch.zeros(XM["XM_FIELDS"], dtype=torch.int64, device="cuda")
    wd = Watchdog(BOUND_NS)
    pt, (p,) = _upload([XH.pack(dict(seq=seq.data_ptr(), ack=ack.data_ptr(), rounds=rounds, out=out, meta=meta,
                                     wd=wd.ptr, bound_ns=wd.bound_ns))])
    torch.cuda.synchronize()
    launch(mod.kernel("xgpu_host_anchor"), LaunchSpec(grid=1, block=32), p)
    t0 = np.zeros(rounds, dtype=np.int64)
    t1 = np.zeros(rounds, dtype=np.int64)
    limit = time.monotonic() + 5.0
    for k in range(rounds):
        t0[k] = time.time_ns()
        s_np[0] = k + 1
        while a_np[0] < k + 1:
            if time.monotonic() > limit:
                s_np[0] = rounds  # let the kernel finish
                torch.cuda.synchronize()
                raise SpinTimeoutError(f"host anchor: the device did not echo number {k + 1} within 5 s")
        t1[k] = time.time_ns()
    torch.cuda.synchronize()
    wd.check(describe_what, context="host anchor")
    return HostAnchor(t0, t1, out.cpu().numpy())


class ClockPair:
    """%globaltimer offsets of every rank against rank 0 (xgpu_gt_pingpong, rank 0 initiates)."""

    def __init__(self, w: World, flags: PeerBuffer, line0: int, bound_ns: int = BOUND_NS):
        self.w, self.flags, self.line0, self.bound_ns = w, flags, line0, bound_ns
        self.base = 0

    def measure(self, rounds: int = 2000, gap_ns: int = 1000, keep: float = A.KEEP,
                absent: int | None = None) -> dict[int, A.Offset]:
        """`absent`: a rank that skips its launch (the self-test of a lost partner)."""
        import torch  # heavy: torch

        w, mod = self.w, module(_arch())
        res = {}
        for d in range(1, w.size):
            out = torch.zeros(2 * rounds, dtype=torch.int64, device="cuda")
            meta = torch.zeros(XM["XM_FIELDS"], dtype=torch.int64, device="cuda")
            wd = Watchdog(self.bound_ns)
            role = 0 if w.rank == 0 else 1 if w.rank == d else None
            if w.rank == absent:
                role = None
            ping = self.flags.ptr(d, (self.line0 + 2 * d) * LINE)
            pong = self.flags.ptr(0, (self.line0 + 2 * d + 1) * LINE)
            keep_alive = None
            sync_all()
            if role is not None:
                keep_alive, (p,) = _upload([XT.pack(dict(role=role, ping=ping, pong=pong, rounds=rounds, base=self.base,
                                                         gap_ns=gap_ns, out=out, meta=meta, wd=wd.ptr,
                                                         bound_ns=wd.bound_ns))])
                launch(mod.kernel("xgpu_gt_pingpong"), LaunchSpec(grid=1, block=32), p)
            self.base += rounds
            torch.cuda.synchronize()
            check_all(wd, f"clock ping-pong rank 0 <-> {d}")
            g = gather(out).reshape(w.size, rounds, 2)
            del keep_alive
            res[d] = A.exchange_offset(g[0, :, 0], g[0, :, 1], g[d, :, 0], keep)
        return res


# ------------------------------------------------------------------ flag ping-pong (sync/flags.cu)
@dataclass(frozen=True)
class XPP:
    """One cross-GPU ping-pong: rank 0's SM `sm0` against rank `peer`'s SM `sm1`."""

    name: str
    peer: int
    sm0: int
    sm1: int
    poll: str = "acq"  # acq | rlxacq (sys scope always)
    load_sides: int = 0  # bit 0: rank 0's pair SM keeps load_bytes of bulk copies in flight, bit 1: the peer's
    load_from_peer: bool = False  # the loaders read the other GPU's memory (over NVLink) instead of their own
    byst_sides: int = 0  # bit 0: every other SM of rank 0 streams bulk copies, bit 1: of the peer
    load_bytes: int = 0
    warmup: int = 32
    calib: int = 16
    settle: int = 8
    rounds: int = 256

    @property
    def nrec(self) -> int:
        return self.calib + self.settle + self.rounds


@dataclass
class XPPRun:
    config: XPP
    init: np.ndarray  # [nrec, 2] rank 0's (send, receive) %clock64
    resp: np.ndarray  # [nrec, 2] the peer's (receive, send) %clock64
    gt_ns: float
    cycles: float
    polls: tuple[int, int]
    load_bytes: tuple[int, int]


class PingPongX:
    def __init__(self, w: World, info, flags: PeerBuffer, line0: int, src: PeerBuffer):
        import torch  # heavy: torch

        self.w, self.info, self.flags, self.line0, self.src = w, info, flags, line0, src
        self.mod = SR.module("flags", info.arch)
        self.lines = torch.zeros(info.sm_count * SR.BYST_LINES * 32, dtype=torch.int32, device="cuda")
        self.base: dict[int, int] = {}
        self.target = 0
        self.wd = Watchdog(BOUND_NS)

    def run(self, c: XPP) -> XPPRun:
        import torch  # heavy: torch

        w, info = self.w, self.info
        PP, PM = SR.PP, SR.PM
        if not 1 <= c.peer < w.size or c.sm0 < 0 or c.sm1 < 0:
            raise ValueError(f"{c.name}: bad peer {c.peer} or SMs {c.sm0}, {c.sm1}")
        side = 0 if w.rank == 0 else 1 if w.rank == c.peer else None
        nrec = c.nrec
        rec_bytes = (2 * nrec * 8 + 127) // 128 * 128
        smem = max(SR.one_per_sm_smem(info), rec_bytes + 128 + c.load_bytes)
        if smem > info.smem_per_block_optin:
            raise ValueError(f"{c.name}: needs {smem} B of shared memory, over the opt-in limit")
        out = torch.zeros((2, 2 * nrec), dtype=torch.int64, device="cuda")
        meta = torch.zeros(2 * PM["PM_FIELDS"] + 1, dtype=torch.int64, device="cuda")
        claims = torch.zeros(2, dtype=torch.int32, device="cuda")
        base = self.base.get(c.peer, 0)
        self.target += 1
        keep = None
        sync_all()
        if side is not None:
            other = c.peer if side == 0 else 0
            src_ptr = self.src.ptr(other if c.load_from_peer else w.rank)
            byst = (c.byst_sides >> side) & 1
            keep, (p,) = _upload([PP.pack(dict(
                ping=self.flags.ptr(c.peer, (self.line0 + 2 * c.peer) * LINE),
                pong=self.flags.ptr(0, (self.line0 + 2 * c.peer + 1) * LINE),
                sm_init=c.sm0 if side == 0 else SR.NONE, sm_resp=c.sm1 if side == 1 else SR.NONE,
                warmup=c.warmup, calib=c.calib, settle=c.settle, rounds=c.rounds, base=base, write_release=1,
                backoff_ns=0, out=out, meta=meta, claim=claims, wd=self.wd.ptr, bound_ns=self.wd.bound_ns,
                smem_bytes=smem, load_sides=c.load_sides, load_bytes=c.load_bytes,
                load_src=src_ptr if c.load_bytes else 0, load_src_bytes=self.src.nbytes,
                byst_mode=SR.BYST["BY_LOAD"] if byst else SR.BYST["BY_NONE"], byst_warps=0, byst_backoff_ns=0,
                byst_flags=self.lines, byst_target=self.target))])
            launch(self.mod.kernel(f"sync_pingpong_sys_{c.poll}"), LaunchSpec(grid=info.sm_count, block=SR.PP_THREADS,
                                                                           smem=smem), p, persistent=True)
        self.base[c.peer] = base + c.warmup + nrec
        torch.cuda.synchronize()
        check_all(self.wd, f"cross-GPU ping-pong {c.name}", SR.describe_what)
        g_out = gather(out)  # [ranks, 2, 2 * nrec]
        g_meta = gather(meta)
        del keep
        F = PM["PM_FIELDS"]
        m0, m1 = g_meta[0, :F], g_meta[c.peer, F:2 * F]
        for s, (m, want) in enumerate(((m0, c.sm0), (m1, c.sm1))):
            st = SR.PST.get(int(m[PM["PM_STATUS"]]), "?")
            if st != "ST_OK" or int(m[PM["PM_SMID"]]) != want:
                raise CorrectnessError(f"{c.name}: {'initiator' if s == 0 else 'responder'} status {st} on SM "
                                       f"{int(m[PM['PM_SMID']])} (wanted SM {want})")
        for s, m in ((0, m0), (1, m1)):
            if (c.load_sides >> s) & 1 and int(m[PM["PM_LOAD_BYTES"]]) < c.load_bytes:
                raise CorrectnessError(f"{c.name}: side {s} was to keep {c.load_bytes} B in flight but landed "
                                       f"{int(m[PM['PM_LOAD_BYTES']])} B")
        init = g_out[0, 0].reshape(nrec, 2)
        resp = g_out[c.peer, 1].reshape(nrec, 2)
        if (init[:, 1] <= init[:, 0]).any():
            raise CorrectnessError(f"{c.name}: a round trip with non-positive duration")
        return XPPRun(c, init, resp, float(m0[PM["PM_GT_END"]] - m0[PM["PM_GT_START"]]),
                      float(m0[PM["PM_CYC_END"]] - m0[PM["PM_CYC_START"]]),
                      (int(m0[PM["PM_POLLS"]]), int(m1[PM["PM_POLLS"]])),
                      (int(m0[PM["PM_LOAD_BYTES"]]), int(m1[PM["PM_LOAD_BYTES"]])))


# ------------------------------------------------------------------ sentinel collectives
# op -> (kernel, the 32-bit word an empty slot holds: the sentinel rules' single source)
OPS = {"allreduce": ("xgpu_allreduce_f32", F32.fill_word), "allgather": ("xgpu_allgather_bf16", BF16.fill_word)}


def check_reuse(copies: int, fence_every: int, max_copies: int) -> None:
    """The slot-reuse schedules xgpu.cu implements: 3 copies fenced every round before the resets,
    or 2m copies fenced every m rounds after them (m = 1: double buffering)."""
    ok = (copies == 3 and fence_every == 1) or (fence_every >= 1 and copies >= 2 * fence_every and copies != 3)
    if not ok or copies > max_copies:
        raise ValueError(f"{copies} copies fenced every {fence_every} rounds: the reuse rule needs 3 copies fenced "
                         f"every round, or at least 2m copies fenced every m rounds (at most {max_copies} copies)")


def blocks_for(nbytes: int) -> int:
    """Blocks of a collective: 8 KB chunks up to 32 blocks (a chunk is a multiple of 16 B)."""
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"collective payload of {nbytes} B: need a positive multiple of 16")
    b = min(32, max(1, nbytes // 8192))
    while nbytes % (16 * b):
        b -= 1
    return b


@dataclass
class CollRun:
    op: str
    nbytes: int
    blocks: int
    round_cycles: np.ndarray  # rank 0 block 0: %clock64 per recorded round
    phase_cycles: np.ndarray  # [rounds, 3] of those: publishing, waiting for every sender, slot reuse (thread 0)
    gt_ns: float
    cycles: float
    dst: np.ndarray | None  # verify: this rank's received bytes


class Collectives:
    """Sentinel slots of every rank ([2 copies][N][max_bytes]) and the two collective kernels."""

    COPIES = 2  # double buffering, as the study's slots (and the default of every run)
    MAX_COPIES = 8  # the variants the slots are sized for: 3 copies, and 2m copies fenced every m rounds

    def __init__(self, w: World, info, max_bytes: int):
        if not 2 <= w.size <= 255:
            raise ValueError(f"{w.size} ranks: the collectives take 2..255 (a watchdog id holds the sender in 8 bits)")
        self.w, self.info, self.max_bytes = w, info, int(max_bytes)
        self.slots = PeerBuffer(w, self.MAX_COPIES * w.size * self.max_bytes)
        self.mod = module(info.arch)
        self.base = 0
        self.filled = None
        self.wd = Watchdog(BOUND_NS)

    def _fill(self, op: str) -> None:
        if self.filled != op:
            self.slots.fill32(OPS[op][1], _stream())
            self.filled = op
            sync_all()  # every rank's slots are empty before anyone writes into them

    def run(self, op: str, nbytes: int, warmup: int, rounds: int, src=None, copies: int = COPIES,
            fence_every: int = 1) -> CollRun:
        """One launch on every rank. `src` (uint8 CUDA tensor [rounds, nbytes]) switches to verify
        mode: every round's result is written out and returned. Every launch leaves every slot
        empty, so launches with 2 and 3 copies may follow each other."""
        import torch  # heavy: torch

        if op not in OPS:
            raise ValueError(f"unknown collective {op!r} (one of {sorted(OPS)})")
        check_reuse(copies, fence_every, self.MAX_COPIES)
        if nbytes > self.max_bytes:
            raise ValueError(f"{nbytes} B per rank exceeds the slots' {self.max_bytes} B")
        nb = blocks_for(nbytes)
        if src is not None and tuple(src.shape) != (rounds, nbytes):
            raise ValueError(f"src must be [rounds={rounds}, bytes={nbytes}], got {tuple(src.shape)}")
        self._fill(op)
        n = self.w.size
        dst = None
        if src is not None:
            dst = torch.zeros(rounds * (nbytes if op == "allreduce" else n * nbytes), dtype=torch.uint8, device="cuda")
        out = torch.zeros((max(rounds, 1), 3), dtype=torch.int64, device="cuda")
        meta = torch.zeros(XM["XM_FIELDS"], dtype=torch.int64, device="cuda")
        sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        # slot bases of every rank as this rank addresses them (copy stride is n * nbytes inside
        # the kernel, so the layout adapts to the payload size)
        table = torch.tensor(np.array(self.slots.ptrs, dtype=np.uint64).view(np.int64), device="cuda")
        keep, (p,) = _upload([XC.pack(dict(rank=self.w.rank, n=n, slots=table, bytes=nbytes, copies=copies, fence_every=fence_every,
                                           warmup=warmup, rounds=rounds, base=self.base,
                                           src=src if src is not None else 0, dst=dst if dst is not None else 0,
                                           out=out, meta=meta, wd=self.wd.ptr, bound_ns=self.wd.bound_ns, sink=sink))])
        sync_all()
        launch(self.mod.kernel(OPS[op][0]), LaunchSpec(grid=nb, block=XC_THREADS), p)
        self.base += warmup + rounds
        torch.cuda.synchronize()
        check_all(self.wd, f"sentinel {op} of {nbytes} B")
        st = XSTAT.get(int(meta[XM["XM_STATUS"]].item()), "?")
        if st != "XS_OK":
            raise CorrectnessError(f"sentinel {op} of {nbytes} B: status {st}")
        g_out = gather(out)
        g_meta = gather(meta)
        c0 = int(g_meta[0, XM["XM_CYC_START"]])
        o = g_out[0, :rounds].astype(np.int64)  # [rounds, 3]
        ends = np.concatenate([[c0], o[:, 2]])
        phases = np.stack([o[:, 0] - ends[:-1], o[:, 1] - o[:, 0], o[:, 2] - o[:, 1]], 1).astype(np.float64)
        del keep
        return CollRun(op, nbytes, nb, np.diff(ends).astype(np.float64), phases,
                       float(g_meta[0, XM["XM_GT_END"]] - g_meta[0, XM["XM_GT_START"]]),
                       float(g_meta[0, XM["XM_CYC_END"]] - g_meta[0, XM["XM_CYC_START"]]),
                       dst.cpu().numpy() if dst is not None else None)

    def close(self) -> None:
        sync_all()
        self.slots.close()


# ------------------------------------------------------------------ common sync stops
@dataclass
class StopsRun:
    arrive: np.ndarray  # [ranks, stops, blocks] %globaltimer
    depart: np.ndarray
    gpu: np.ndarray  # [ranks, stops, 2]
    blocks: int


class StopsX:
    def __init__(self, w: World, info, flags: PeerBuffer, line0: int, work_src):
        self.w, self.info, self.flags, self.line0, self.work_src = w, info, flags, line0, work_src
        need = (line0 + w.size + 2) * LINE
        if need > flags.nbytes:
            raise ValueError(f"the stop flags need {need} B of the {flags.nbytes}-byte flag buffer")
        self.mod = module(info.arch)
        self.base = 0
        self.wd = Watchdog(BOUND_NS)

    def run(self, stops: int, work_bytes: int = 0, work_ns: int = 0) -> StopsRun:
        import torch  # heavy: torch

        if (work_bytes == 0) == (work_ns == 0):
            raise ValueError("give exactly one of work_bytes (HBM read per block per stop) and work_ns (spin)")
        if work_bytes % (16 * XC_THREADS):
            raise ValueError(f"work_bytes {work_bytes}: a multiple of {16 * XC_THREADS}")
        G = self.info.sm_count
        arrive = torch.zeros((stops, G), dtype=torch.int64, device="cuda")
        depart = torch.zeros((stops, G), dtype=torch.int64, device="cuda")
        gpu = torch.zeros((stops, 2), dtype=torch.int64, device="cuda")
        meta = torch.zeros(XM["XM_FIELDS"], dtype=torch.int64, device="cuda")
        sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        table = torch.tensor(np.array([self.flags.ptr(d, self.line0 * LINE) for d in range(self.w.size)],
                                      dtype=np.uint64).view(np.int64), device="cuda")
        keep, (p,) = _upload([XS.pack(dict(
            rank=self.w.rank, n=self.w.size, stops=stops, base=self.base, flags=table,
            work_src=self.work_src if work_bytes else 0, work_src_bytes=self.work_src.numel() * self.work_src.element_size() if work_bytes else 0,
            work_bytes=work_bytes, work_ns=work_ns, arrive=arrive, depart=depart, gpu=gpu, meta=meta, wd=self.wd.ptr,
            bound_ns=self.wd.bound_ns, sink=sink))])
        sync_all()
        launch(self.mod.kernel("xgpu_stops"), LaunchSpec(grid=G, block=XC_THREADS, smem=SR.one_per_sm_smem(self.info)),
               p, persistent=True)
        self.base += stops
        torch.cuda.synchronize()
        check_all(self.wd, f"cross-GPU sync stops ({stops})")
        st = XSTAT.get(int(meta[XM["XM_STATUS"]].item()), "?")
        if st != "XS_OK":
            raise CorrectnessError(f"cross-GPU sync stops: status {st}")
        del keep
        return StopsRun(gather(arrive), gather(depart), gather(gpu), G)


def _arch() -> str:
    import torch  # heavy: torch

    return device_info(torch.cuda.current_device()).arch
