"""One process per GPU: the process group and memory every GPU can address.

Started by torchrun (`megabench xgpu` does it): RANK, WORLD_SIZE and LOCAL_RANK come from its
environment, the process group is NCCL's (used for the host-side exchanges and as the
collectives' reference), and each process drives the GPU of its LOCAL_RANK.

Peer memory is legacy CUDA IPC: each rank allocates with cuMemAlloc, exports a handle, the
64-byte handles travel through the process group, and every other rank opens them (peer access
enabled lazily by the driver). One allocation per PeerBuffer, so a handle always names the base
of its allocation (cuIpcGetMemHandle requires that; torch's caching allocator would not give it).

NVLink multicast stays off: a program that uses it can take the
host's shared GPUs out of service. `check_multicast_off` sets the three switches where they are
unset and refuses to start where one is set to enable it; nothing here calls cuMulticastCreate.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import MegabenchError, NoGPUError
from ..launch import ensure_context

# variable -> the value that keeps multicast off
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
IPC_HANDLE_BYTES = 64


class WorldError(MegabenchError):
    """The multi-GPU set-up cannot start (not under torchrun, too few GPUs, multicast on)."""


def check_multicast_off(env: dict | None = None) -> dict[str, str]:
    """Set the multicast switches to 'off' where unset; raise WorldError where one turns it on.
    Returns what it set (for the run's notes)."""
    env = os.environ if env is None else env
    set_now = {}
    for k, off in MULTICAST_OFF.items():
        v = env.get(k)
        if v is None or v == "":
            env[k] = off
            set_now[k] = off
        elif v != off:
            raise WorldError(f"{k}={v!r} would let NVLink multicast run; this suite keeps it off ({k}={off}): "
                             "a multicast program can put the host's shared GPUs out of service")
    return set_now


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int

    @property
    def device(self) -> int:
        return self.local_rank


def world_from_env(env: dict | None = None, gpu_count: int | None = None) -> World:
    """The rank layout torchrun gives this process; clear errors when it does not fit."""
    env = os.environ if env is None else env
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in env]
    if missing:
        raise WorldError(f"{', '.join(missing)} not set: start the cross-GPU benchmarks with "
                         "`megabench xgpu` (or torchrun --nproc-per-node=<GPUs> -m microbench.xgpu)")
    try:
        w = World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))
    except ValueError:
        raise WorldError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers, got {env['RANK']!r}, "
                         f"{env['WORLD_SIZE']!r}, {env['LOCAL_RANK']!r}") from None
    if w.size < 2:
        raise WorldError(f"WORLD_SIZE={w.size}: the cross-GPU benchmarks need 2 or more processes, one per GPU")
    if not 0 <= w.rank < w.size:
        raise WorldError(f"RANK={w.rank} outside 0..{w.size - 1}")
    if gpu_count is not None:
        if gpu_count < 1:
            raise NoGPUError("no CUDA GPU visible to this process")
        if w.local_rank >= gpu_count:
            raise WorldError(f"LOCAL_RANK={w.local_rank} but this node shows {gpu_count} GPU(s): "
                             "one process per GPU (--nproc-per-node at most the GPU count)")
    if int(env.get("LOCAL_WORLD_SIZE", w.size)) != w.size:
        raise WorldError("the ranks span several nodes: these benchmarks measure GPUs of one node "
                         "(peer memory through CUDA IPC)")
    return w


def init(backend: str = "nccl") -> World:
    """Join the process group (NCCL) on this rank's GPU, multicast off."""
    check_multicast_off()
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    w = world_from_env(gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0)

    ensure_context(w.device)
    if not dist.is_initialized():
        kw = {"device_id": torch.device("cuda", w.device)} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=w.rank, world_size=w.size, **kw)
    return w


# ------------------------------------------------------------------ CUDA IPC
class CudaIpc:
    """The driver calls PeerBuffer needs, on the current context (tests substitute a fake)."""

    def __init__(self):
        from cuda.bindings import driver  # heavy: cuda

        self.d = driver

    def _ok(self, res, what: str):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if err != self.d.CUresult.CUDA_SUCCESS:
            raise WorldError(f"{what} failed: {err.name}")
        return rest[0] if len(rest) == 1 else rest

    def alloc(self, nbytes: int) -> int:
        return int(self._ok(self.d.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))

    def free(self, ptr: int) -> None:
        self._ok(self.d.cuMemFree(ptr), "cuMemFree")

    def handle(self, ptr: int) -> bytes:
        h = self._ok(self.d.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
        return ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)

    def open(self, data: bytes) -> int:
        if len(data) != IPC_HANDLE_BYTES:
            raise WorldError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(data)}")
        h = self.d.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), data, IPC_HANDLE_BYTES)
        flag = self.d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return int(self._ok(self.d.cuIpcOpenMemHandle(h, flag), "cuIpcOpenMemHandle (is peer access possible "
                                                                  "between these GPUs?)"))

    def close(self, ptr: int) -> None:
        self._ok(self.d.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")

    def memset32(self, ptr: int, word: int, nwords: int, stream: int) -> None:
        self._ok(self.d.cuMemsetD32Async(ptr, word & 0xFFFFFFFF, nwords, stream), "cuMemsetD32Async")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._ok(self.d.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def all_gather_object(obj) -> list:
    import torch.distributed as dist  # heavy: torch

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class PeerBuffer:
    """`nbytes` of device memory on every rank; `ptrs[d]` is rank d's buffer as this rank
    addresses it (`ptrs[rank]` is the local allocation). Collective: every rank calls it with the
    same size, in the same order."""

    def __init__(self, w: World, nbytes: int, *, ipc=None, gather: Callable[[object], Sequence] = all_gather_object):
        if nbytes <= 0 or nbytes % 4:
            raise ValueError(f"peer buffer of {nbytes} B: need a positive multiple of 4")
        self.w, self.nbytes = w, int(nbytes)
        self.ipc = ipc or CudaIpc()
        self.local = self.ipc.alloc(self.nbytes)
        got = list(gather((w.rank, self.nbytes, self.ipc.handle(self.local))))
        if len(got) != w.size or sorted(g[0] for g in got) != list(range(w.size)):
            raise WorldError(f"peer-buffer exchange returned ranks {[g[0] for g in got]} for a world of {w.size}")
        sizes = {g[1] for g in got}
        if sizes != {self.nbytes}:
            raise WorldError(f"ranks allocated different peer-buffer sizes {sorted(sizes)}: calls out of step")
        by_rank = {g[0]: g[2] for g in got}
        self.ptrs: list[int] = []
        self._opened: list[int] = []
        for d in range(w.size):
            if d == w.rank:
                self.ptrs.append(self.local)
            else:
                p = self.ipc.open(by_rank[d])
                self._opened.append(p)
                self.ptrs.append(p)

    def ptr(self, rank: int, offset: int = 0) -> int:
        if not 0 <= offset < self.nbytes:
            raise ValueError(f"offset {offset} outside the {self.nbytes}-byte peer buffer")
        return self.ptrs[rank] + offset

    def fill32(self, word: int, stream: int) -> None:
        """Fill the local buffer with a 32-bit word (stream-ordered)."""
        self.ipc.memset32(self.local, word, self.nbytes // 4, stream)

    def close(self) -> None:
        """Unmap the peers' buffers, then free this one. Every rank must have stopped using the
        buffers (callers synchronise and barrier first)."""
        for p in self._opened:
            self.ipc.close(p)
        self._opened = []
        if self.local:
            self.ipc.free(self.local)
            self.local = 0
