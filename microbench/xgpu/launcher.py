"""`megabench xgpu`: start the cross-GPU benchmarks under torchrun, one process per GPU.

Refuses clearly with fewer than 2 GPUs (the single-GPU classes cover one GPU). The child
processes inherit the environment with NVLink multicast switched off (world.check_multicast_off).
"""
from __future__ import annotations

import os
import subprocess
import sys

from ..device import gpu_count, no_gpu_reason
from ..errors import MegabenchError
from .world import check_multicast_off


def command(nproc: int, full: bool = False, save: bool = True, summary: str | None = None,
            selftest: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "microbench.xgpu"]
    if selftest:
        cmd.append("--selftest")
    if full:
        cmd.append("--full")
    if not save:
        cmd.append("--no-save")
    if summary:
        cmd += ["--summary", summary]
    return cmd


def gpus_or_reason() -> tuple[int, str | None]:
    """(GPU count, why the cross-GPU benchmarks cannot run here or None)."""
    reason = no_gpu_reason()
    if reason:
        return 0, f"no GPU ({reason})"
    n = gpu_count()
    if n < 2:
        return n, f"{n} GPU on this node; the cross-GPU benchmarks need 2 or more"
    return n, None


def run(nproc: int | None = None, full: bool = False, save: bool = True, summary: str | None = None,
        timeout: float | None = None, selftest: bool = False) -> int:
    n, reason = gpus_or_reason()
    if reason:
        raise MegabenchError(f"xgpu: {reason}")
    nproc = nproc or n
    if not 2 <= nproc <= n:
        raise MegabenchError(f"xgpu: --nproc {nproc} must be between 2 and the node's {n} GPUs")
    env = os.environ.copy()
    check_multicast_off(env)
    return subprocess.run(command(nproc, full, save, summary, selftest), env=env, timeout=timeout).returncode


def add_parser(sub) -> None:
    s = sub.add_parser("xgpu", help="cross-GPU flags, sentinel collectives vs NCCL, clock offsets and sync stops "
                                    "(torchrun, one process per GPU; needs 2+ GPUs)")
    s.add_argument("--nproc", type=int, help="processes (GPUs); default: every GPU of the node")
    s.add_argument("--full", action="store_true", help="full sweeps")
    s.add_argument("--no-save", action="store_true", help="do not write result files")
    s.add_argument("--summary", help="rank 0 writes a JSON summary here")
    s.set_defaults(fn=lambda a: run(a.nproc, a.full, not a.no_save, a.summary))
