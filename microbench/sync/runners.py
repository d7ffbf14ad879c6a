"""Host side of the sync kernels: buffers, parameter blocks, launches, record parsing, checks.

Each runner allocates fresh random inputs, launches, synchronises, checks the watchdog and every
block's status, and only then returns numbers. Failures raise SpinTimeoutError (a bounded wait
gave up: the message names what it waited for, and for sentinel slots which slot and value) or
CorrectnessError (a role never ran, data arrived wrong). Needs a GPU; analysis.py does the math.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import CorrectnessError, SpinTimeoutError
from .params import Layout, parse_enum, source
from .params import upload as _upload
from .sentinel import BF16, F32, SentinelRule

NONE = 0xFFFFFFFF
MiB = 1 << 20
DEVICE = "cuda"  # the CPU dry-run test (tests/test_sync_dryrun.py) points this at "cpu"
DEFAULT_BOUND_NS = 200_000_000  # a launch-wide watchdog bound for benchmarks: 0.2 s, far above any wait here

SYNC_WAIT = parse_enum(source("sync_common.cuh"), "SyncWait")
_WAIT_TEXT = {
    "SW_PING": "the responder's poll for ping of round {i} (did the initiator's SM run?)",
    "SW_PONG": "the initiator's poll for pong of round {i} (did the responder's SM run?)",
    "SW_BYSTANDER": "bystander block {i}'s poll for the end-of-launch flag",
    "SW_LOADER_MBAR": "a bulk copy of loader stage {i} to land",
    "SW_LOADER_RUN": "the bulk loader's stop signal",
    "SW_GO": "the start signal of block/role {i}",
    "SW_FLAG": "a publish flag of round {i}",
    "SW_SLOT": "a sentinel slot of round {i}",
    "SW_ACK": "the consumer's ack freeing a copy for round {i}",
    "SW_BARRIER": "the atomic-counter barrier of stop {i}",
    "SW_DEP": "a producer's dependency flag of stop {i}",
}


def describe_what(what: int) -> str:
    kind, idx = (what >> 24) & 0xFF, what & 0xFFFFFF
    for k, v in SYNC_WAIT.items():
        if v == kind:
            return _WAIT_TEXT.get(k, k).format(i=idx)
    return f"unknown wait id 0x{what:x}"


def check_watchdog(wd, context: str, addr_text=None) -> None:
    """Raise SpinTimeoutError if a wait gave up; `addr_text(addr)` may name the polled slot."""
    from ..watchdog import fields

    rec = wd.rec.cpu().tolist()
    f = fields()
    if rec[f["TRIPPED"]] == 0:
        return
    extra = ""
    if addr_text is not None:
        extra = addr_text(rec[f["ADDR"]] & (2**64 - 1)) or ""
    wd.check(lambda w: describe_what(w) + (f" [{extra}]" if extra else ""), context=context)


def module(name: str, arch: str):
    from ..compiler import inject_ppm

    return _module(name, arch, inject_ppm())  # a quality run's injected build is another module


@functools.lru_cache(maxsize=None)
def _module(name: str, arch: str, inject: int):
    from ..compiler import compile_cuda

    return compile_cuda(source(f"{name}.cu"), arch=arch)


def one_per_sm_smem(info) -> int:
    """Dynamic smem that leaves room for only one block per SM (more than half of it, counting
    the per-block reservation), so a grid of sm_count blocks lands on every SM exactly once."""
    need = info.smem_per_sm // 2 + info.reserved_smem_per_block + 16
    if need > info.smem_per_block_optin:
        raise ValueError(f"cannot force one block per SM: need {need} B > opt-in {info.smem_per_block_optin} B")
    return int(need)


def heat_and_read_clock(h, mod, kname: str, ms: float = 40.0) -> float:
    """Busy every SM for `ms`, read the NVML SM clock while it runs, return MHz (0: no NVML).
    The caller queues its measurements right after, so the clock has no idle gap to fall in."""
    import torch

    from ..launch import LaunchSpec, launch

    sink = torch.zeros(1, device=DEVICE)
    launch(mod.kernel(kname), LaunchSpec(grid=h.info.sm_count * 2, block=256), np.uint64(int(ms * 1e6)), sink)
    time.sleep(ms * 0.6e-3)
    return float(h.clocks()["sm_mhz"])


def upload(blocks):
    return _upload(blocks, DEVICE)


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _u64(t) -> np.ndarray:
    return t.cpu().numpy().view(np.uint64)


def random_src(nbytes: int, seed: int):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=DEVICE, generator=g)


# ============================================================================ single-load latency
PL = Layout(source("flags.cu"), "PLParam", "PL_", "PL_NPARAMS")
LOAD_KINDS = parse_enum(source("flags.cu"), "LoadKind")
LK_NAMES = [k[3:].lower() for k, v in sorted(LOAD_KINDS.items(), key=lambda kv: kv[1]) if k != "LK_KINDS"]


@dataclass
class PollLoad:
    cycles: np.ndarray  # [block, kind, address] cycles per load
    smids: np.ndarray  # [block]
    offsets_bytes: np.ndarray  # [address]
    kinds: list


def run_poll_load(h, naddr: int = 64, chain: int = 16, buf_bytes: int = 64 * MiB, seed: int = 0) -> PollLoad:
    import torch

    from ..launch import LaunchSpec, launch

    if naddr < 1 or chain < 1:
        raise ValueError("naddr and chain must be positive")
    info = h.info
    mod = module("flags", info.arch)
    rng = np.random.default_rng(seed)
    pages = rng.choice(buf_bytes // 4096, size=naddr, replace=False)
    offs = (pages * 4096 + rng.integers(0, 32, size=naddr) * 128).astype(np.int64)
    flags = torch.zeros(buf_bytes // 4, dtype=torch.int32, device=DEVICE)  # every polled word holds 0
    offs_t = torch.from_numpy((offs // 4).astype(np.int32)).to(DEVICE)
    G = info.sm_count
    out = torch.zeros(G * LOAD_KINDS["LK_KINDS"] * naddr, dtype=torch.int32, device=DEVICE)
    smids = torch.full((G,), -1, dtype=torch.int32, device=DEVICE)
    pt, ptrs = upload([PL.pack(dict(flags=flags, offs=offs_t, naddr=naddr, chain=chain, out=out, smids=smids))])
    launch(mod.kernel("sync_poll_load"), LaunchSpec(grid=G, block=32, smem=one_per_sm_smem(info)), ptrs[0])
    _sync()
    cyc = out.cpu().numpy().astype(np.uint32).reshape(G, LOAD_KINDS["LK_KINDS"], naddr).astype(np.float64) / chain
    sm = smids.cpu().numpy()
    if (sm < 0).any() or len(set(sm.tolist())) != G or (cyc <= 0).any():
        raise CorrectnessError(f"poll-load probe: {int((sm < 0).sum())} blocks did not run, "
                               f"{G - len(set(sm.tolist()))} SMs hosted two blocks, {int((cyc <= 0).sum())} empty chains")
    return PollLoad(cyc, sm, offs, LK_NAMES)


# ============================================================================ GPC inference
def probe_clusters(h, sizes=(2, 4, 8), waves: int = 3) -> list[list[int]]:
    """SM sets that shared a thread-block cluster (same GPC), from cluster launches with one
    block per SM. Raises CorrectnessError when the cluster ranks come back wrong."""
    import torch

    from ..launch import LaunchSpec, launch

    info = h.info
    mod = module("flags", info.arch)
    k = mod.kernel("sync_cluster_probe")
    smem = one_per_sm_smem(info)
    groups = []
    for c in sizes:
        n = (info.sm_count // c) * waves
        out = torch.full((n * c,), -1, dtype=torch.int32, device=DEVICE)
        launch(k, LaunchSpec(grid=n, block=32, smem=smem, cluster=c), out)
        _sync()
        o = out.cpu().numpy().astype(np.int64).reshape(n, c)
        if (o < 0).any() or not np.array_equal(o >> 16, np.tile(np.arange(c), (n, 1))):
            raise CorrectnessError(f"cluster probe (size {c}): ranks/SMs came back wrong: {o[:2].tolist()}")
        groups += [sorted(set((row & 0xFFFF).tolist())) for row in o]
    return groups


# KEEP_NOTE. A `prepared()` launch function keeps its runner alive (`go.keep` holds `self`): the
# parameter block points at the runner's watchdog record, loader source and data. Until
# 2026-12-02 it did not, and a pytest case that kept only its launch freed the runner at once;
# torch's allocator then handed the freed blocks to the next allocations. In the A/B gate's
# workers (many cases prepared in one process) the fence probe's loader read a reused watchdog
# word as "tripped" and stopped after 80 KiB instead of streaming 17.8 MB, so the case timed
# fences with no bulk loads in flight: 171 or 181 us in the workers against 263 us in a fresh
# process (H200, reports/notes/h200-sessions.md). Kept alive, a launch's memory is its own.

# ============================================================================ ping-pong
PP = Layout(source("flags.cu"), "PPParam", "PP_", "PP_NPARAMS")
PM = parse_enum(source("flags.cu"), "PPMeta")
PST = {v: k for k, v in parse_enum(source("flags.cu"), "PPStatus").items()}
BYST = parse_enum(source("flags.cu"), "BystMode")
PP_THREADS = 256
BYST_LINES = 16


@dataclass(frozen=True)
class PPConfig:
    sm_init: int
    sm_resp: int
    ping_line: int = 0  # 128-byte line index in the flag buffer
    pong_line: int = 1
    warmup: int = 32
    calib: int = 16
    settle: int = 0
    rounds: int = 128
    release: bool = True
    backoff_ns: int = 0
    load_sides: int = 0  # bit 0 initiator, bit 1 responder
    load_bytes: int = 0
    byst: str = "none"  # none | poll | load
    byst_warps: int = 0
    byst_backoff_ns: int = 0
    scope: str = "gpu"
    poll: str = "acq"  # acq | rlxacq

    @property
    def kernel(self) -> str:
        return f"sync_pingpong_{self.scope}_{self.poll}"

    @property
    def nrec(self) -> int:
        return self.calib + self.settle + self.rounds


@dataclass
class PPRun:
    config: PPConfig
    init: np.ndarray  # [nrec, 2] initiator (send, receive) clock64
    resp: np.ndarray  # [nrec, 2] responder (receive, send) clock64
    polls: tuple[int, int]  # probes during the measured rounds (initiator, responder)
    gt_ns: float  # initiator %globaltimer over the measured rounds
    cycles: float  # initiator %clock64 over the same span
    load_bytes: tuple[int, int]
    load_ns: tuple[int, int]
    bystanders: int


class PingPong:
    """Runs many ping-pong launches back to back; flags stay monotonic across launches."""

    def __init__(self, h, flag_lines: int = 1 << 15, src_bytes: int = 256 * MiB, bound_ns: int = DEFAULT_BOUND_NS):
        import torch

        from ..watchdog import Watchdog

        self.h = h
        self.info = h.info
        self.mod = module("flags", h.info.arch)
        self.flags = torch.zeros(flag_lines * 32, dtype=torch.int32, device=DEVICE)
        self.flag_lines = flag_lines
        self.lines = torch.zeros(h.info.sm_count * BYST_LINES * 32, dtype=torch.int32, device=DEVICE)
        self.src_bytes = src_bytes
        self._src = None
        self.base = 0
        self.target = 0
        self.wd = Watchdog(bound_ns, device=DEVICE)

    @property
    def src(self):
        if self._src is None:
            self._src = random_src(self.src_bytes, 1234)
        return self._src

    def line_ptr(self, line: int) -> int:
        if not 0 <= line < self.flag_lines:
            raise ValueError(f"flag line {line} outside 0..{self.flag_lines - 1}")
        return self.flags.data_ptr() + line * 128

    def run(self, configs: Sequence[PPConfig]) -> list[PPRun]:
        import torch

        from ..launch import LaunchSpec, launch

        if not configs:
            return []
        G = self.info.sm_count
        nrec = max(c.nrec for c in configs)
        kmax = max(c.load_bytes for c in configs)
        rec_bytes = (2 * nrec * 8 + 127) // 128 * 128
        smem = max(one_per_sm_smem(self.info), rec_bytes + 128 + kmax)
        if smem > self.info.smem_per_block_optin:
            raise ValueError(f"ping-pong needs {smem} B smem (k={kmax}, {nrec} rounds recorded): over the opt-in limit")
        n = len(configs)
        out = torch.zeros((n, 2, 2 * nrec), dtype=torch.int64, device=DEVICE)
        meta = torch.zeros((n, 2 * PM["PM_FIELDS"] + 1), dtype=torch.int64, device=DEVICE)
        claims = torch.zeros(2 * n, dtype=torch.int32, device=DEVICE)
        blocks = []
        for i, c in enumerate(configs):
            if c.sm_init == c.sm_resp or not all(0 <= x < 65536 or x == NONE for x in (c.sm_init, c.sm_resp)):
                raise ValueError(f"ping-pong config {i}: bad SM pair {c.sm_init}, {c.sm_resp} (distinct SM ids or NONE)")
            if c.ping_line == c.pong_line:
                raise ValueError(f"ping-pong config {i}: ping and pong share line {c.ping_line}")
            if c.byst not in BYST_NAMES or c.poll not in ("acq", "rlxacq") or c.scope not in ("gpu", "sys"):
                raise ValueError(f"ping-pong config {i}: unknown byst/poll/scope in {c}")
            if c.byst_warps > PP_THREADS // 32:
                raise ValueError(f"ping-pong config {i}: at most {PP_THREADS // 32} polling warps per bystander")
            self.target += 1
            blocks.append(PP.pack(dict(
                ping=self.line_ptr(c.ping_line), pong=self.line_ptr(c.pong_line), sm_init=c.sm_init, sm_resp=c.sm_resp,
                warmup=c.warmup, calib=c.calib, settle=c.settle, rounds=c.rounds, base=self.base,
                write_release=int(c.release), backoff_ns=c.backoff_ns, out=out[i].data_ptr(), meta=meta[i].data_ptr(),
                claim=claims.data_ptr() + 8 * i, wd=self.wd.ptr, bound_ns=self.wd.bound_ns, smem_bytes=smem,
                load_sides=c.load_sides, load_bytes=c.load_bytes,
                load_src=self.src if (c.load_bytes and (c.load_sides or c.byst == "load")) else 0,
                load_src_bytes=self.src_bytes, byst_mode=BYST_NAMES[c.byst], byst_warps=c.byst_warps,
                byst_backoff_ns=c.byst_backoff_ns, byst_flags=self.lines, byst_target=self.target)))
            self.base += c.warmup + c.nrec
            if self.base >= 2**31:
                raise RuntimeError("flag counters near wrap-around: make a new PingPong")
        pt, ptrs = upload(blocks)
        spec = LaunchSpec(grid=G, block=PP_THREADS, smem=smem)
        for c, p in zip(configs, ptrs):
            launch(self.mod.kernel(c.kernel), spec, p, persistent=True)
        _sync()
        check_watchdog(self.wd, "sync ping-pong")
        o = _u64(out).astype(np.int64)
        m = _u64(meta).astype(np.int64)
        F = PM["PM_FIELDS"]
        runs = []
        for i, c in enumerate(configs):
            side = [m[i, s * F:(s + 1) * F] for s in (0, 1)]
            for s, want in ((0, c.sm_init), (1, c.sm_resp)):
                if want == NONE:
                    continue  # that role is played elsewhere (another launch or GPU)
                st = PST.get(int(side[s][PM["PM_STATUS"]]), "?")
                if st != "ST_OK" or int(side[s][PM["PM_SMID"]]) != want:
                    raise CorrectnessError(f"ping-pong launch {i} ({c}): {'initiator' if s == 0 else 'responder'} "
                                           f"status {st}, SM {int(side[s][PM['PM_SMID']])} (wanted SM {want})")
            if c.load_bytes and c.load_sides:
                for s in (0, 1):
                    if (c.load_sides >> s) & 1 and side[s][PM["PM_LOAD_BYTES"]] < c.load_bytes:
                        raise CorrectnessError(f"ping-pong launch {i}: side {s} was to keep {c.load_bytes} B in flight "
                                               f"but landed only {int(side[s][PM['PM_LOAD_BYTES']])} B")
            k = c.nrec
            row = o[i].reshape(-1)  # the kernel writes side s at s * 2 * nrec of its own config
            init = row[:2 * k].reshape(k, 2)
            resp = row[2 * k:4 * k].reshape(k, 2)
            if (init[:, 1] <= init[:, 0]).any():
                raise CorrectnessError(f"ping-pong launch {i}: a round trip with non-positive duration")
            runs.append(PPRun(c, init, resp, (int(side[0][PM["PM_POLLS"]]), int(side[1][PM["PM_POLLS"]])),
                              float(side[0][PM["PM_GT_END"]] - side[0][PM["PM_GT_START"]]),
                              float(side[0][PM["PM_CYC_END"]] - side[0][PM["PM_CYC_START"]]),
                              (int(side[0][PM["PM_LOAD_BYTES"]]), int(side[1][PM["PM_LOAD_BYTES"]])),
                              (int(side[0][PM["PM_LOAD_NS"]]), int(side[1][PM["PM_LOAD_NS"]])), int(m[i, 2 * F])))
        return runs


    def prepared(self, c: PPConfig):
        """(launch, reset, check) for one configuration relaunched with base 0: `reset` zeroes its
        flags and claims (stream-ordered, untimed), `check` synchronises and validates the last run."""
        import torch

        from ..launch import LaunchSpec, launch

        if c.byst != "none" or c.load_bytes:
            raise ValueError("prepared ping-pong cases run without load or bystanders")
        smem = max(one_per_sm_smem(self.info), (2 * c.nrec * 8 + 127) // 128 * 128 + 128)
        out = torch.zeros((2, 2 * c.nrec), dtype=torch.int64, device=DEVICE)
        meta = torch.zeros(2 * PM["PM_FIELDS"] + 1, dtype=torch.int64, device=DEVICE)
        claims = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        pt, ptrs = upload([PP.pack(dict(
            ping=self.line_ptr(c.ping_line), pong=self.line_ptr(c.pong_line), sm_init=c.sm_init, sm_resp=c.sm_resp,
            warmup=c.warmup, calib=c.calib, settle=c.settle, rounds=c.rounds, base=0, write_release=int(c.release),
            backoff_ns=c.backoff_ns, out=out, meta=meta, claim=claims, wd=self.wd.ptr, bound_ns=self.wd.bound_ns,
            smem_bytes=smem, load_sides=0, load_bytes=0, load_src=0, load_src_bytes=0, byst_mode=BYST["BY_NONE"],
            byst_warps=0, byst_backoff_ns=0, byst_flags=self.lines, byst_target=0))])
        rows = self.flags.view(-1, 32)
        spec = LaunchSpec(grid=self.info.sm_count, block=PP_THREADS, smem=smem)
        k = self.mod.kernel(c.kernel)

        def go():
            launch(k, spec, ptrs[0], persistent=True)

        def reset():
            rows[c.ping_line].zero_()
            rows[c.pong_line].zero_()
            claims.zero_()
            meta.zero_()

        def check():
            _sync()
            check_watchdog(self.wd, "sync ping-pong case")
            m = _u64(meta).astype(np.int64)
            F = PM["PM_FIELDS"]
            for s in (0, 1):
                st = PST.get(int(m[s * F + PM["PM_STATUS"]]), "?")
                if st != "ST_OK":
                    raise CorrectnessError(f"ping-pong case {c}: side {s} status {st}")

        # what every launch reads or writes must outlive it: the parameter block, the records, and
        # the runner itself (its watchdog record and loader source; KEEP_NOTE)
        go.keep = (self, pt, out, meta, claims)
        return go, reset, check


BYST_NAMES = {"none": BYST["BY_NONE"], "poll": BYST["BY_POLL"], "load": BYST["BY_LOAD"]}

# ============================================================================ fences
FC = Layout(source("fences.cu"), "FCParam", "FC_", "FC_NPARAMS")
FK = parse_enum(source("fences.cu"), "FenceKind")
FK_NAMES = [k[3:].lower() for k, v in sorted(FK.items(), key=lambda kv: kv[1]) if k != "FK_KINDS"]
FMETA = parse_enum(source("fences.cu"), "FCMeta")
FSTAT = {v: k for k, v in parse_enum(source("fences.cu"), "FCStatus").items()}
# the loader's running time (FM_LOAD_NS, from its first copy's issue to its drain) must cover this
# fraction of the fence thread's timed section (FM_GT); it starts a few copies' latency after it
LOADER_COVER = 0.9


@dataclass
class FenceRun:
    nblocks: int
    load_bytes: int
    cycles: np.ndarray  # [block, kind, body(0 fence only, 1 store+fence), loop] cycles per rep
    smids: np.ndarray
    load_bytes_landed: np.ndarray
    load_ns: np.ndarray
    cycles_total: np.ndarray
    gt_total_ns: np.ndarray

    def cost(self, kind: str, body: int) -> np.ndarray:
        """Per (block, loop): cycles per fence minus the empty-body loop of the same body."""
        k, n = FK_NAMES.index(kind), FK_NAMES.index("none")
        return self.cycles[:, k, body, :] - self.cycles[:, n, body, :]


class Fences:
    def __init__(self, h, src_bytes: int = 512 * MiB, bound_ns: int = DEFAULT_BOUND_NS):
        from ..watchdog import Watchdog

        self.h = h
        self.info = h.info
        self.mod = module("fences", h.info.arch)
        self.src_bytes = src_bytes
        self._src = None
        self.wd = Watchdog(bound_ns, device=DEVICE)

    @property
    def src(self):
        if self._src is None:
            self._src = random_src(self.src_bytes, 99)
        return self._src

    def _params(self, scratch, out, meta, k: int, reps: int, loops: int, smem: int, claim=0, smid: int = 0):
        """The probe's parameter block (fences.cu FCParam); claim 0: not pinned."""
        return FC.pack(dict(scratch=scratch, reps=reps, loops=loops, load_bytes=k, load_src=self.src if k else 0,
                            load_src_bytes=self.src_bytes, out=out, meta=meta, wd=self.wd.ptr,
                            bound_ns=self.wd.bound_ns, smem_bytes=smem, pin_claim=claim, pin_smid=smid))

    def prepared_pinned(self, smid: int, k: int, reps: int, loops: int):
        """(launch, reset, check) of one block's fence probe on SM `smid`: a block on every SM
        (one_per_sm_smem), of which the first on `smid` to claim the word runs the probe and the
        others return at once (fences.cu). `reset` zeroes the claim and the records (untimed,
        stream-ordered); `check` synchronises and validates the last launch, its SM included."""
        import torch

        from ..launch import LaunchSpec, launch

        nk = FK["FK_KINDS"]
        smem = max(one_per_sm_smem(self.info), (nk * 2 * loops * 8 + 127) // 128 * 128 + 128 + k)
        scratch = torch.zeros(16 * 32, dtype=torch.int32, device=DEVICE)
        out = torch.zeros((1, nk, 2, loops), dtype=torch.int64, device=DEVICE)
        meta = torch.zeros((1, FMETA["FM_FIELDS"]), dtype=torch.int64, device=DEVICE)
        claim = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        pt, ptrs = upload([self._params(scratch, out, meta, k, reps, loops, smem, claim, smid)])
        kern, spec = self.mod.kernel("sync_fence_cost"), LaunchSpec(grid=self.info.sm_count, block=128, smem=smem)

        def go():
            launch(kern, spec, ptrs[0])

        def reset():
            claim.zero_()
            meta.zero_()

        def check():
            _sync()
            check_watchdog(self.wd, "sync fence case (pinned)")
            m = _u64(meta).astype(np.int64)[0]
            st = FSTAT.get(int(m[FMETA["FM_STATUS"]]), "?")
            if st != "FS_OK":
                raise CorrectnessError(f"pinned fence probe on SM {smid}: status {st} (no block claimed the SM?)")
            if int(m[FMETA["FM_SMID"]]) != smid:
                raise CorrectnessError(f"pinned fence probe: ran on SM {int(m[FMETA['FM_SMID']])}, not {smid}")
            if k and m[FMETA["FM_LOAD_BYTES"]] < k:
                raise CorrectnessError(f"pinned fence probe: the loader landed less than its k={k} B")
            if k and m[FMETA["FM_LOAD_NS"]] < LOADER_COVER * m[FMETA["FM_GT"]]:
                raise CorrectnessError(f"pinned fence probe: the loader ran {m[FMETA['FM_LOAD_NS']] / 1e3:.1f} us of the "
                                       f"{m[FMETA['FM_GT']] / 1e3:.1f} us timed ({m[FMETA['FM_LOAD_BYTES']]} B): the "
                                       "fences were not timed with loads in flight")

        go.keep = (self, pt, scratch, out, meta, claim)  # KEEP_NOTE
        return go, reset, check

    def run(self, configs: Sequence[tuple[int, int]], reps: int, loops: int) -> list[FenceRun]:
        """configs: (nblocks, k bytes in flight per block)."""
        import torch

        from ..launch import LaunchSpec, launch

        nk = FK["FK_KINDS"]
        rec_bytes = (nk * 2 * loops * 8 + 127) // 128 * 128
        res = []
        pending = []
        keep = []
        for nb, k in configs:
            if not 1 <= nb <= self.info.sm_count:
                raise ValueError(f"fence probe: {nb} blocks (1..{self.info.sm_count})")
            smem = max(one_per_sm_smem(self.info), rec_bytes + 128 + k)
            scratch = torch.zeros(nb * 16 * 32, dtype=torch.int32, device=DEVICE)
            out = torch.zeros((nb, nk, 2, loops), dtype=torch.int64, device=DEVICE)
            meta = torch.zeros((nb, FMETA["FM_FIELDS"]), dtype=torch.int64, device=DEVICE)
            pt, ptrs = upload([self._params(scratch, out, meta, k, reps, loops, smem)])
            launch(self.mod.kernel("sync_fence_cost"), LaunchSpec(grid=nb, block=128, smem=smem), ptrs[0])
            pending.append((nb, k, out, meta))
            keep.append((pt, scratch))
        _sync()
        check_watchdog(self.wd, "sync fence probe")
        for nb, k, out, meta in pending:
            m = _u64(meta).astype(np.int64)
            st = [FSTAT.get(int(x), "?") for x in m[:, FMETA["FM_STATUS"]]]
            if any(s != "FS_OK" for s in st):
                raise CorrectnessError(f"fence probe ({nb} blocks, k={k}): block statuses {sorted(set(st))}")
            if k and (m[:, FMETA["FM_LOAD_BYTES"]] < k).any():
                raise CorrectnessError(f"fence probe: a loader landed less than its k={k} B")
            if k and (m[:, FMETA["FM_LOAD_NS"]] < LOADER_COVER * m[:, FMETA["FM_GT"]]).any():
                raise CorrectnessError(f"fence probe ({nb} blocks, k={k}): a loader stopped before the timed loops "
                                       "ended: the fences were not timed with loads in flight")
            cyc = _u64(out).astype(np.float64) / reps
            res.append(FenceRun(nb, k, cyc, m[:, FMETA["FM_SMID"]], m[:, FMETA["FM_LOAD_BYTES"]],
                                m[:, FMETA["FM_LOAD_NS"]], m[:, FMETA["FM_CYC"]], m[:, FMETA["FM_GT"]]))
        return res


# ============================================================================ publish
PB = Layout(source("publish.cu"), "PBParam", "PB_", "PB_NPARAMS")
AG = parse_enum(source("publish.cu"), "AgentField")
PAT = {k[4:].lower(): v for k, v in parse_enum(source("publish.cu"), "Pattern").items()}
PBM = parse_enum(source("publish.cu"), "PBMeta")
PBS = {v: k for k, v in parse_enum(source("publish.cu"), "PBStatus").items()}
BRK = {k[4:].lower(): v for k, v in parse_enum(source("publish.cu"), "BreakMode").items()}
PUB_MODES = ("fence_flag", "release_flag", "sentinel_f32", "sentinel_bf16")
PUB_RULE: dict[str, SentinelRule | None] = {"fence_flag": None, "release_flag": None, "sentinel_f32": F32,
                                            "sentinel_bf16": BF16}
PB_THREADS = 256


@dataclass(frozen=True)
class PubConfig:
    mode: str
    pattern: str  # ping | stream | alltoall
    sms: tuple[int, ...]  # SM of each agent
    bytes: int
    copies: int = 2
    warmup: int = 16
    rounds: int = 128
    nosync: bool = False
    scope: str = "gpu"

    @property
    def n(self) -> int:
        return len(self.sms)

    @property
    def kernel(self) -> str:
        return f"sync_pub_{self.mode}_{self.scope}"

    @property
    def stride(self) -> int:
        return max(128, (self.bytes + 127) // 128 * 128)

    def pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver) of every message of one round."""
        if self.pattern == "alltoall":
            return [(s, r) for s in range(self.n) for r in range(self.n) if s != r]
        if self.pattern == "ping":
            return [(0, 1), (1, 0)]
        return [(0, 1)]

    def validate(self) -> None:
        problems = []
        if self.mode not in PUB_MODES:
            problems.append(f"mode {self.mode!r} not one of {PUB_MODES}")
        if self.pattern not in PAT:
            problems.append(f"pattern {self.pattern!r} not one of {sorted(PAT)}")
        if self.pattern != "alltoall" and self.n != 2:
            problems.append(f"{self.pattern} needs 2 agents, got {self.n}")
        if not 2 <= self.n <= 16 or len(set(self.sms)) != self.n:
            problems.append(f"agents must be 2..16 distinct SMs, got {self.sms}")
        if self.bytes % 16 or self.bytes < 0:
            problems.append(f"payload {self.bytes} B is not a multiple of 16")
        if self.mode.startswith("sentinel") and (self.bytes == 0 or self.nosync):
            problems.append("sentinel slots need a payload and synchronisation (nosync/0 B are flag-kernel modes)")
        if self.copies not in (2, 3):
            problems.append(f"copies must be 2 or 3, got {self.copies}")
        if self.scope not in ("gpu", "sys"):
            problems.append(f"scope {self.scope!r}")
        if problems:
            raise ValueError(f"publish config {self}: " + "; ".join(problems))


@dataclass
class PubState:
    config: PubConfig
    slots: object
    flags: object
    acks: object
    agents: object
    base: int = 0


@dataclass
class PubRun:
    config: PubConfig
    stamps: np.ndarray  # [agent, rounds] clock64 at the end of each recorded round
    start: np.ndarray  # [agent] clock64 at the start of the first recorded round
    gt_ns: np.ndarray  # [agent] %globaltimer span of the recorded rounds (+ tail)
    cycles: np.ndarray  # [agent] %clock64 over the same span

    def round_cycles(self, agent: int) -> np.ndarray:
        s = np.concatenate([[self.start[agent]], self.stamps[agent]]).astype(np.int64)
        return np.diff(s).astype(np.float64)


def fill_word(mode: str) -> int:
    r = PUB_RULE[mode]
    return r.fill_word if r else 0x5A5A5A5A


class Publish:
    def __init__(self, h, bound_ns: int = DEFAULT_BOUND_NS):
        from ..watchdog import Watchdog

        self.h = h
        self.info = h.info
        self.mod = module("publish", h.info.arch)
        self.wd = Watchdog(bound_ns, device=DEVICE)
        self.states: list[PubState] = []  # every live state, to name a slot from a watchdog address

    def setup(self, cfg: PubConfig) -> PubState:
        import torch

        cfg.validate()
        n, C = cfg.n, cfg.copies
        per = n * C * cfg.stride  # receive slots of one agent: [sender][copy][stride]
        fw = fill_word(cfg.mode)
        fw = fw - (1 << 32) if fw >= 1 << 31 else fw
        slots = torch.full((n, per // 4), fw, dtype=torch.int32, device=DEVICE)
        flags = torch.zeros((n, n * 32), dtype=torch.int32, device=DEVICE)
        acks = torch.zeros((n, n * 32), dtype=torch.int32, device=DEVICE)
        table = np.zeros((n, AG["AG_FIELDS"]), dtype=np.uint64)
        for a in range(n):
            table[a, AG["AG_SM"]] = cfg.sms[a]
            table[a, AG["AG_SLOTS"]] = slots[a].data_ptr()
            table[a, AG["AG_FLAGS"]] = flags[a].data_ptr()
            table[a, AG["AG_ACKS"]] = acks[a].data_ptr()
        agents = torch.from_numpy(table.view(np.int64)).to(DEVICE)
        st = PubState(cfg, slots, flags, acks, agents)
        self.states.append(st)
        return st

    def slot_text(self, st: PubState | None, addr: int) -> str:
        """Name the slot at a device address: receiver, sender, copy, element (searching `st`
        first, then every state this object set up)."""
        for cand in ([st] if st is not None else []) + self.states:
            t = self._slot_text(cand, addr)
            if t:
                return t
        return ""

    def _slot_text(self, st: PubState, addr: int) -> str:
        cfg = st.config
        for a in range(cfg.n):
            lo = st.slots[a].data_ptr()
            hi = lo + st.slots[a].numel() * 4
            if lo <= addr < hi:
                off = addr - lo
                s, rem = divmod(off, cfg.copies * cfg.stride)
                c, byte = divmod(rem, cfg.stride)
                esize = 2 if cfg.mode == "sentinel_bf16" else 4
                word = int(np.asarray(st.slots[a].view(-1)[off // 4].item(), dtype=np.int64)) & 0xFFFFFFFF
                return (f"slot of receiver agent {a} (SM {cfg.sms[a]}) from sender {s} (SM {cfg.sms[s]}), copy {c}, "
                        f"byte {byte} (element {byte // esize}); it now holds 0x{word:08x}")
        return ""

    def launch(self, st: PubState, warmup: int, rounds: int, src=None, dst=None, brk: str = "none",
               keep: list | None = None):
        """Queue one launch; returns (out, meta) device tensors (read after synchronising)."""
        import torch

        from ..launch import LaunchSpec, launch

        cfg = st.config
        smem = max(one_per_sm_smem(self.info), rounds * 8)
        out = torch.zeros((cfg.n, rounds), dtype=torch.int64, device=DEVICE)
        meta = torch.zeros((cfg.n, PBM["PBM_FIELDS"]), dtype=torch.int64, device=DEVICE)
        claims = torch.zeros(cfg.n, dtype=torch.int32, device=DEVICE)
        pt, ptrs = upload([PB.pack(dict(
            agents=st.agents, n=cfg.n, pattern=PAT[cfg.pattern], bytes=cfg.bytes, stride=cfg.stride, copies=cfg.copies,
            warmup=warmup, rounds=rounds, base=st.base, src=src if src is not None else 0,
            dst=dst if dst is not None else 0, out=out, meta=meta, claim=claims, wd=self.wd.ptr,
            bound_ns=self.wd.bound_ns, smem_bytes=smem, **{"break": BRK[brk]}, nosync=int(cfg.nosync)))])
        launch(self.mod.kernel(cfg.kernel), LaunchSpec(grid=self.info.sm_count, block=PB_THREADS, smem=smem), ptrs[0],
               persistent=True)
        st.base += warmup + rounds
        if keep is not None:
            keep.append((pt, claims, src, dst))
        return out, meta

    def finish(self, st: PubState, out, meta, what: str) -> PubRun:
        import torch

        _sync()
        check_watchdog(self.wd, f"sync publish {what}", lambda addr: self.slot_text(st, addr))
        m = _u64(meta).astype(np.int64)
        cfg = st.config
        for a in range(cfg.n):
            s = PBS.get(int(m[a, PBM["PBM_STATUS"]]), "?")
            if s != "PBS_OK" or int(m[a, PBM["PBM_SMID"]]) != cfg.sms[a]:
                raise CorrectnessError(f"publish {what} ({cfg}): agent {a} status {s} on SM {int(m[a, PBM['PBM_SMID']])} "
                                       f"(wanted SM {cfg.sms[a]})")
        o = _u64(out).astype(np.int64)
        return PubRun(cfg, o, m[:, PBM["PBM_CYC_START"]], (m[:, PBM["PBM_GT_END"]] - m[:, PBM["PBM_GT_START"]]).astype(float),
                      (m[:, PBM["PBM_CYC_END"]] - m[:, PBM["PBM_CYC_START"]]).astype(float))

    def verify(self, st: PubState, rounds: int, seed: int, brk: str = "none", src_words=None) -> dict:
        """Move randomised payloads (special values included) for `rounds` rounds with slot reuse
        and compare every received message bit-exactly with the Python rule's encoding.
        Raises CorrectnessError naming the first wrong element. Returns coverage counts."""
        import torch

        cfg = st.config
        nw = cfg.bytes // 4
        if src_words is None:
            src_words = payload_words(PUB_RULE[cfg.mode], (rounds, cfg.n, cfg.n, nw), np.random.default_rng(seed))
        if src_words.shape != (rounds, cfg.n, cfg.n, nw):
            raise ValueError(f"payload shape {src_words.shape} != {(rounds, cfg.n, cfg.n, nw)}")
        src = torch.from_numpy(src_words.view(np.int32)).to(DEVICE)
        dst = torch.full_like(src, 0x13579BD)
        keep = []
        out, meta = self.launch(st, 0, rounds, src, dst, brk, keep)
        self.finish(st, out, meta, f"verify ({brk})")
        got = dst.cpu().numpy().view(np.uint32)
        rule = PUB_RULE[cfg.mode]
        pairs = cfg.pairs()
        checked = 0
        for s, r in pairs:
            want = src_words[:, s, r]
            have = got[:, s, r]
            if rule is not None:
                want = rule.encode(want.view(rule.dtype)).view(np.uint32)
            bad = np.nonzero(have != want)
            if bad[0].size:
                it, w = int(bad[0][0]), int(bad[1][0])
                raise CorrectnessError(
                    f"publish {cfg.mode}/{cfg.pattern} {cfg.bytes} B: {bad[0].size} words wrong from agent {s} to "
                    f"agent {r}; first at round {it}, word {w}: sent 0x{int(src_words[it, s, r, w]):08x}, expected "
                    f"0x{int(want[it, w]):08x}, received 0x{int(have[it, w]):08x}")
            checked += want.size
        return {"words_checked": checked, "rounds": rounds}

    def prepared(self, cfg: PubConfig):
        """(launch, reset, check) for one configuration relaunched from a fresh state each sample:
        `reset` refills the slots and zeroes flags, acks and claims (untimed, stream-ordered)."""
        import torch

        from ..launch import LaunchSpec, launch

        st = self.setup(cfg)
        rounds, warmup = cfg.rounds, cfg.warmup
        smem = max(one_per_sm_smem(self.info), rounds * 8)
        out = torch.zeros((cfg.n, rounds), dtype=torch.int64, device=DEVICE)
        meta = torch.zeros((cfg.n, PBM["PBM_FIELDS"]), dtype=torch.int64, device=DEVICE)
        claims = torch.zeros(cfg.n, dtype=torch.int32, device=DEVICE)
        pt, ptrs = upload([PB.pack(dict(
            agents=st.agents, n=cfg.n, pattern=PAT[cfg.pattern], bytes=cfg.bytes, stride=cfg.stride, copies=cfg.copies,
            warmup=warmup, rounds=rounds, base=0, src=0, dst=0, out=out, meta=meta, claim=claims, wd=self.wd.ptr,
            bound_ns=self.wd.bound_ns, smem_bytes=smem, **{"break": BRK["none"]}, nosync=int(cfg.nosync)))])
        fw = fill_word(cfg.mode)
        fw = fw - (1 << 32) if fw >= 1 << 31 else fw
        kern = self.mod.kernel(cfg.kernel)
        spec = LaunchSpec(grid=self.info.sm_count, block=PB_THREADS, smem=smem)

        def go():
            launch(kern, spec, ptrs[0], persistent=True)

        def reset():
            st.slots.fill_(fw)
            st.flags.zero_()
            st.acks.zero_()
            claims.zero_()
            meta.zero_()

        def check():
            self.finish(st, out, meta, "case")

        go.keep = (self, pt, out, meta, claims, st)  # KEEP_NOTE
        return go, reset, check

    def timed(self, st: PubState, warmup: int, rounds: int, launches: int = 1) -> list[PubRun]:
        keep = []
        pend = [self.launch(st, warmup, rounds, keep=keep) for _ in range(launches)]
        return [self.finish(st, o, m, "timed") for o, m in pend]


def payload_words(rule: SentinelRule | None, shape, rng) -> np.ndarray:
    """Random 32-bit words with every special class mixed in (for the element format of `rule`):
    the sentinel itself (often), its replacement, +-0, +-inf, NaNs with random and extreme
    payloads, subnormals, extremes of the normal range, and random bits."""
    n = int(np.prod(shape))
    if rule is not None and rule.bits == 16:
        h = special_bf16(rng, 2 * n)
        return h.view(np.uint32).reshape(shape)
    return special_f32(rng, n).reshape(shape)


def special_f32(rng, n: int) -> np.ndarray:
    x = rng.integers(0, 2**32, size=n, dtype=np.uint32)
    cls = rng.integers(0, 10, size=n, dtype=np.uint8)
    sign = x & np.uint32(0x80000000)
    mant = ((x >> np.uint32(7)) & np.uint32(0x7FFFFF)) | (x & np.uint32(1))  # bits of x reused; mostly nonzero
    mant = np.where(mant == 0, np.uint32(1), mant)
    fixed = np.array([0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF,
                      0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,
                      0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF], dtype=np.uint32)
    out = x.copy()
    sel = cls == 0
    out[sel] = 0x80000000  # the sentinel, 10%
    sel = cls == 1
    out[sel] = fixed[x[sel] % fixed.size]
    sel = cls == 2
    out[sel] = sign[sel] | np.uint32(0x7F800000) | mant[sel]  # NaN, random payload and sign
    sel = cls == 3
    out[sel] = sign[sel] | mant[sel]  # subnormal
    return out


def special_bf16(rng, n: int) -> np.ndarray:
    """n bf16 patterns: every one of the 65536 (shuffled, when n allows) plus specials."""
    x = rng.integers(0, 2**16, size=n, dtype=np.uint16)
    cls = rng.integers(0, 8, size=n, dtype=np.uint8)
    out = x.copy()
    out[cls == 0] = 0xFFFF  # the sentinel
    sel = cls == 1  # NaN with random sign and payload
    out[sel] = (x[sel] & np.uint16(0x8000)) | np.uint16(0x7F80) | np.maximum(x[sel] & np.uint16(0x7F), 1).astype(np.uint16)
    sel = cls == 2
    fixed = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7FFF, 0x0001, 0x807F], dtype=np.uint16)
    out[sel] = fixed[x[sel] % fixed.size]
    if n >= 2 * 65536:
        pos = rng.choice(n, size=65536, replace=False)
        out[pos] = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    return out


# ============================================================================ grid-wide waits
BR = Layout(source("barriers.cu"), "BRParam", "BR_", "BR_NPARAMS")
BM = {k[3:].lower(): v for k, v in parse_enum(source("barriers.cu"), "BRMode").items() if k != "BM_MODES"}
BO = parse_enum(source("barriers.cu"), "BROut")
BST = {v: k for k, v in parse_enum(source("barriers.cu"), "BRStatus").items()}


@dataclass
class BarrierRun:
    mode: str
    stops: int
    d: int
    cycles: np.ndarray  # [block]
    gt_start: np.ndarray
    gt_end: np.ndarray
    smids: np.ndarray
    errors: int
    first_error: tuple = ()


class Barriers:
    """Persistent grid of one block per SM; counters and flags monotonic across launches."""

    def __init__(self, h, bound_ns: int = DEFAULT_BOUND_NS):
        import torch

        from ..watchdog import Watchdog

        self.h = h
        self.info = h.info
        self.G = h.info.sm_count
        self.mod = module("barriers", h.info.arch)
        self.counter = torch.zeros(32, dtype=torch.int32, device=DEVICE)
        self.flags = torch.zeros(self.G * 32, dtype=torch.int32, device=DEVICE)
        self.data = torch.zeros(2 * self.G, dtype=torch.int32, device=DEVICE)
        # Stops count per mode family: the atomic counter advances only in atomic launches and the
        # flags only in depflags launches, so one shared base would set targets never reached.
        self.bases = {"gridsync": 0, "atomic": 0, "flags": 0}
        self.wd = Watchdog(bound_ns, device=DEVICE)

    @staticmethod
    def family(mode: str) -> str:
        return "atomic" if mode == "atomic" else ("flags" if mode.startswith("depflags") else "gridsync")

    def deps(self, d: int, seed: int) -> np.ndarray:
        if not 1 <= d <= self.G - 1:
            raise ValueError(f"dependencies per block must be 1..{self.G - 1}, got {d}")
        rng = np.random.default_rng(seed)
        out = np.zeros((self.G, d), dtype=np.int32)
        for b in range(self.G):
            others = np.delete(np.arange(self.G), b)
            out[b] = rng.choice(others, size=d, replace=False)
        return out

    def launch(self, mode: str, stops: int, d: int = 0, seed: int = 0, verify: bool = False,
               delay: tuple[int, int, int] = (NONE, 0, 0), keep: list | None = None):
        import torch

        from ..launch import LaunchSpec, launch

        if mode not in BM:
            raise ValueError(f"barrier mode {mode!r} not one of {sorted(BM)}")
        dep = mode.startswith("depflags")
        deps = torch.from_numpy(self.deps(d, seed)).to(DEVICE) if dep else torch.zeros(1, dtype=torch.int32, device=DEVICE)
        errors = torch.zeros(4, dtype=torch.int32, device=DEVICE)
        out = torch.zeros((self.G, BO["BO_FIELDS"]), dtype=torch.int64, device=DEVICE)
        pt, ptrs = upload([BR.pack(dict(
            mode=BM[mode], stops=stops, base=self.bases[self.family(mode)], counter=self.counter, flags=self.flags,
            deps=deps, d=d if dep else 0,
            data=self.data, verify=int(verify), errors=errors, out=out, wd=self.wd.ptr, bound_ns=self.wd.bound_ns,
            delay_block=delay[0], delay_stop=delay[1], delay_ns=delay[2]))])
        launch(self.mod.kernel("sync_grid_wait"),
               LaunchSpec(grid=self.G, block=128, smem=one_per_sm_smem(self.info), cooperative=True), ptrs[0])
        self.bases[self.family(mode)] += stops
        if keep is not None:
            keep.append((pt, deps))
        return mode, stops, d if dep else 0, out, errors

    def finish(self, pending) -> BarrierRun:
        import torch

        mode, stops, d, out, errors = pending
        _sync()
        check_watchdog(self.wd, f"sync grid wait ({mode})")
        o = _u64(out).astype(np.int64)
        st = [BST.get(int(x), "?") for x in o[:, BO["BO_STATUS"]]]
        if any(s != "BS_OK" for s in st):
            raise CorrectnessError(f"grid wait {mode} (D={d}): block statuses {sorted(set(st))}")
        sm = o[:, BO["BO_SMID"]]
        if len(set(sm.tolist())) != self.G:
            raise CorrectnessError(f"grid wait {mode}: {self.G} blocks landed on only {len(set(sm.tolist()))} SMs")
        e = errors.cpu().numpy()
        return BarrierRun(mode, stops, d, o[:, BO["BO_CYCLES"]].astype(float), o[:, BO["BO_GT_START"]],
                          o[:, BO["BO_GT_END"]], sm, int(e[0]), tuple(int(v) for v in e[1:]) if e[0] else ())

    def prepared(self, mode: str, stops: int, d: int = 0, seed: int = 0):
        """(launch, reset, check): one launch from base 0; `reset` zeroes counter, flags, data."""
        import torch

        from ..launch import LaunchSpec, launch

        dep = mode.startswith("depflags")
        deps = torch.from_numpy(self.deps(d, seed)).to(DEVICE) if dep else torch.zeros(1, dtype=torch.int32, device=DEVICE)
        errors = torch.zeros(4, dtype=torch.int32, device=DEVICE)
        out = torch.zeros((self.G, BO["BO_FIELDS"]), dtype=torch.int64, device=DEVICE)
        pt, ptrs = upload([BR.pack(dict(
            mode=BM[mode], stops=stops, base=0, counter=self.counter, flags=self.flags, deps=deps, d=d if dep else 0,
            data=self.data, verify=0, errors=errors, out=out, wd=self.wd.ptr, bound_ns=self.wd.bound_ns,
            delay_block=NONE, delay_stop=0, delay_ns=0))])
        kern = self.mod.kernel("sync_grid_wait")
        spec = LaunchSpec(grid=self.G, block=128, smem=one_per_sm_smem(self.info), cooperative=True)

        def go():
            launch(kern, spec, ptrs[0])

        def reset():
            self.counter.zero_()
            self.flags.zero_()
            self.data.zero_()
            out.zero_()
            self.bases = dict.fromkeys(self.bases, 0)

        def check():
            self.finish((mode, stops, d if dep else 0, out, errors))

        go.keep = (self, pt, deps, errors, out)  # KEEP_NOTE (and the barrier's data)
        return go, reset, check

    def run(self, mode: str, stops: int, d: int = 0, seed: int = 0, verify: bool = False,
            delay: tuple[int, int, int] = (NONE, 0, 0)) -> BarrierRun:
        keep = []
        return self.finish(self.launch(mode, stops, d, seed, verify, delay, keep))

    def verify(self, mode: str, stops: int = 64, d: int = 0, seed: int = 0, delay_ns: int = 50_000) -> BarrierRun:
        """Correctness of one mode: block 0 stalls at stop 3, every block checks its producers'
        words after every stop; CorrectnessError on any mismatch."""
        r = self.run(mode, stops, d, seed, verify=True, delay=(0, 3, delay_ns))
        if r.errors:
            b, s, v = r.first_error
            raise CorrectnessError(f"grid wait {mode} (D={d}): {r.errors} stale reads; first: block {b} after stop {s} "
                                   f"read {v} (expected the stop's epoch, base-relative)")
        return r


__all__ = ["PingPong", "PPConfig", "Fences", "Publish", "PubConfig", "Barriers", "run_poll_load", "probe_clusters",
           "heat_and_read_clock", "describe_what", "payload_words", "special_bf16", "special_f32", "replace", "field",
           "SpinTimeoutError"]
