"""The sentinel collectives with every GPU of the node driven by one process (peer access, no
torchrun), as harness Cases: `pytest --benchmark-only` times them in device time like every other
class (tests/bench/test_bench_xgpu.py, marked multigpu).

The reference measurement is the torchrun suite (bench.py: one process per GPU, as a
tensor-parallel program runs, and NCCL beside it). Here the same kernel runs on every GPU from one
host thread: a sample is one launch of ROUNDS rounds on every GPU, timed with CUDA events on GPU 0's
stream (GPU 0's kernel ends only once every GPU's last round has reached it). Each launch runs a
multiple of the slots' copies in rounds, so every launch starts on copy 0 and on the fence schedule
and ends with every slot empty: the parameter blocks are uploaded once and nothing is reset between
samples.
"""
from __future__ import annotations

import numpy as np

from ..device import device_info
from ..errors import CorrectnessError
from ..harness import Case, Prepared
from ..launch import LaunchSpec, launch
from ..results import Bound
from ..sync.params import upload
from ..watchdog import Watchdog
from . import analysis as A
from . import runners as X
from .bench import _latest, _payload
from .world import WorldError

ROUNDS = 96  # rounds per timed launch: a multiple of every copy count used here (module docstring)


def enable_peer_access(n: int) -> None:
    """Let each of GPUs 0..n-1 address the others' memory (refusing clearly where it cannot)."""
    import torch  # heavy: torch
    from cuda.bindings import runtime as rt  # heavy: cuda

    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            if not torch.cuda.can_device_access_peer(a, b):
                raise WorldError(f"GPU {a} cannot address GPU {b}'s memory (no peer access between them)")
            with torch.cuda.device(a):
                (err,) = rt.cudaDeviceEnablePeerAccess(b, 0)
                if err not in (rt.cudaError_t.cudaSuccess, rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
                    raise WorldError(f"cudaDeviceEnablePeerAccess({a} -> {b}) failed: {err.name}")


class LocalCollective:
    """Slots, watchdogs and parameter blocks of one collective on GPUs 0..n-1."""

    def __init__(self, op: str, nbytes: int, n: int = 2, copies: int = 2, fence_every: int = 1):
        import torch  # heavy: torch

        if op not in X.OPS:
            raise ValueError(f"unknown collective {op!r} (one of {sorted(X.OPS)})")
        X.check_reuse(copies, fence_every, X.Collectives.MAX_COPIES)
        self.op, self.nbytes, self.n, self.copies, self.fence_every = op, int(nbytes), n, copies, fence_every
        self.blocks = X.blocks_for(self.nbytes)
        enable_peer_access(n)
        self.mod = X.module(device_info(0).arch)
        fill = np.array([X.OPS[op][1]], dtype=np.uint32).view(np.int32)[0]
        self.slots = [torch.full((copies * n * self.nbytes // 4,), int(fill), dtype=torch.int32,
                                 device=f"cuda:{d}") for d in range(n)]
        ptrs = np.array([s.data_ptr() for s in self.slots], dtype=np.uint64).view(np.int64)
        self.tables = [torch.tensor(ptrs, device=f"cuda:{d}") for d in range(n)]
        self.wds = [Watchdog(X.BOUND_NS, device=f"cuda:{d}") for d in range(n)]
        self.sinks = [torch.zeros(1, dtype=torch.int32, device=f"cuda:{d}") for d in range(n)]
        self.keep = []
        for d in range(n):
            torch.cuda.synchronize(d)

    def params(self, warmup: int, rounds: int, srcs=None, dsts=None) -> list[int]:
        """Upload one parameter block per GPU (each on its own GPU); returns their pointers."""
        import torch  # heavy: torch

        out = []
        for d in range(self.n):
            o = torch.zeros((max(rounds, 1), 3), dtype=torch.int64, device=f"cuda:{d}")
            m = torch.zeros(X.XM["XM_FIELDS"], dtype=torch.int64, device=f"cuda:{d}")
            t, (p,) = upload([X.XC.pack(dict(
                rank=d, n=self.n, slots=self.tables[d], bytes=self.nbytes, copies=self.copies, fence_every=self.fence_every,
                warmup=warmup, rounds=rounds, base=0, src=srcs[d] if srcs else 0, dst=dsts[d] if dsts else 0,
                out=o, meta=m, wd=self.wds[d].ptr, bound_ns=self.wds[d].bound_ns, sink=self.sinks[d]))],
                device=f"cuda:{d}")
            self.keep += [t, o, m]
            out.append(p)
        return out

    def launch(self, ptrs: list[int]) -> None:
        """One launch on every GPU, each on its own current stream (GPU 0's last, so the harness's
        events on GPU 0 bracket a launch whose partners are already queued)."""
        import torch  # heavy: torch

        spec = LaunchSpec(grid=self.blocks, block=X.XC_THREADS)
        k = self.mod.kernel(X.OPS[self.op][0])
        for d in reversed(range(self.n)):
            with torch.cuda.device(d):
                launch(k, spec, ptrs[d])

    def check(self, context: str) -> None:
        import torch  # heavy: torch

        for d in range(self.n):
            torch.cuda.synchronize(d)
        for d, wd in enumerate(self.wds):
            wd.check(X.describe_what, context=f"GPU {d}: {context}")

    def verify(self, rounds: int | None = None, seed: int = 0) -> None:
        """Random payloads with every special class through slot reuse (every copy used twice by
        default), compared bit-for-bit."""
        import torch  # heavy: torch

        rounds = rounds or 2 * self.copies
        if rounds % self.copies:
            raise ValueError(f"{rounds} rounds: a multiple of the {self.copies} copies keeps launches in step")

        host = [_payload(self.op, rounds, self.nbytes, seed=seed + 1000 * d) for d in range(self.n)]
        srcs = [torch.from_numpy(h.copy()).to(f"cuda:{d}") for d, h in enumerate(host)]
        per = self.nbytes if self.op == "allreduce" else self.n * self.nbytes
        dsts = [torch.zeros(rounds * per, dtype=torch.uint8, device=f"cuda:{d}") for d in range(self.n)]
        self.launch(self.params(0, rounds, srcs, dsts))
        self.check(f"sentinel {self.op} of {self.nbytes} B (verify)")
        everyone = np.stack(host)  # [ranks, rounds, bytes]
        for d in range(self.n):
            ref, got = A.collective_expected(self.op, everyone, dsts[d].cpu().numpy())
            bad = int((got != ref).sum())
            if bad:
                raise CorrectnessError(f"sentinel {self.op} of {self.nbytes} B on GPU {d} (one process): {bad} of "
                                       f"{ref.size} elements differ from the rule's reference")


def collective_case(op: str, nbytes: int, rounds: int = ROUNDS, copies: int = 2, fence_every: int = 1) -> Case:
    if rounds % copies:
        raise ValueError(f"{rounds} rounds a launch: a multiple of the {copies} copies keeps launches in step")

    def prepare(h) -> Prepared:
        import torch  # heavy: torch

        if torch.cuda.device_count() < 2:
            raise WorldError(f"the cross-GPU cases need 2 GPUs; this process sees {torch.cuda.device_count()}")
        lc = LocalCollective(op, nbytes, copies=copies, fence_every=fence_every)
        lc.verify()
        ptrs = lc.params(0, rounds)
        lc.launch(ptrs)
        lc.check(f"sentinel {op} of {nbytes} B (first timed launch)")

        flag = _latest("xgpu.flags", "flag_latency_gpu_to_gpu_s", h.info.name)
        bw = _latest("xgpu.collectives", "xgpu_peer_copy_bw", h.info.name)
        bound = None
        if flag and bw:
            bound = Bound("time", rounds * (flag + (lc.n - 1) * nbytes / bw), "s",
                          f"{rounds} rounds x (one cross-GPU one-way flag {flag * 1e6:.2f} us + (N-1) x payload at "
                          f"{bw / 1e9:.0f} GB/s), both from the latest xgpu results on this GPU model")

        def go():
            lc.launch(ptrs)

        return Prepared(go, bound=bound, metrics={"gpus": lc.n, "blocks": lc.blocks, "rounds_per_launch": rounds})

    tag = "" if (copies, fence_every) == (2, 1) else f"/c{copies}f{fence_every}"
    return Case(f"xgpu.local/{op}/{nbytes}{tag}", {"op": op, "bytes": nbytes, "rounds": rounds, "copies": copies,
                                                   "fence_every": fence_every, "impl": "sentinel"}, prepare)


def cases() -> list[Case]:
    """Double-buffered slots for both ops, and the batched reuse (8 copies, a fence every 4 rounds)."""
    return ([collective_case(op, nb) for op in ("allreduce", "allgather") for nb in (1024, 65536)]
            + [collective_case("allreduce", nb, copies=8, fence_every=4) for nb in (1024, 65536)])
