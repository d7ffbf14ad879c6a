"""SASS checks of the poll loops: every iteration must issue a strong load of the flag.

A poll compiled into a weak load (LDG.E without .STRONG) may be served from L1 forever, and a
poll hoisted out of its loop spins on a register: both hang. So the check reads the machine
code: for each loop (a backward branch) that is a poll loop, it looks for LDG.E.STRONG.GPU (or
.SYS) between the branch target and the branch.

The disassembler and its parse are microbench/sass.py's; none found: callers skip.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..compiler import compile_cuda
from ..sass import Insn, disassemble, find_disassembler  # noqa: F401  (callers use sass.find_disassembler)
from .params import source

STRONG_LOAD = {"gpu": re.compile(r"\bLDG\.E\.STRONG\.GPU\b"), "sys": re.compile(r"\bLDG\.E\.STRONG\.SYS\b")}


def loops(insns: list[Insn]) -> list[tuple[int, int]]:
    """(first, last) address of every loop body: a branch back to an earlier address. A branch
    to itself (the padding after EXIT) is not a loop body."""
    return [(i.target, i.addr) for i in insns if i.target is not None and i.target < i.addr]


def body(insns: list[Insn], lo: int, hi: int) -> list[str]:
    return [i.text for i in insns if lo <= i.addr <= hi]


@dataclass(frozen=True)
class PollLoopReport:
    kernel: str
    scope: str
    poll_loops: int  # loops identified as poll loops
    strong_in_every_poll_loop: bool
    detail: str


def check_poll_loops(insns: list[Insn], kernel: str, scope: str, marker: str | None = "NANOSLEEP") -> PollLoopReport:
    """Poll loops = loops whose body contains `marker` (the back-off sleep every project poll
    loop has), or every loop when marker is None. Each must contain a strong load of `scope`."""
    pat = STRONG_LOAD[scope]
    found = []
    for lo, hi in loops(insns):
        b = body(insns, lo, hi)
        if marker is None or any(marker in t for t in b):
            found.append((lo, hi, any(pat.search(t) for t in b)))
    ok = bool(found) and all(f[2] for f in found)
    detail = ", ".join(f"[0x{lo:04x}..0x{hi:04x}] {'strong load' if s else 'NO strong load'}" for lo, hi, s in found)
    return PollLoopReport(kernel, scope, len(found), ok, detail or "no poll loop found")


POLL_KERNELS = (("sync_pingpong_gpu_acq", "gpu"), ("sync_pingpong_gpu_rlxacq", "gpu"), ("sync_pingpong_sys_acq", "sys"),
                ("sync_pingpong_sys_rlxacq", "sys"))
PROBE_KERNELS = (("sync_poll_probe_gpu", "gpu"), ("sync_poll_probe_sys", "sys"))


def check_sync_poll_loops(tool: str, arch: str = "sm_90a") -> list[PollLoopReport]:
    """Reports for every ping-pong kernel (poll loops = loops with the back-off NANOSLEEP) and the
    two minimal probes (every loop is the poll) of microbench/sync/flags.cu."""
    d = disassemble(compile_cuda(source("flags.cu"), arch=arch).cubin, tool)
    out = [check_poll_loops(d[k], k, scope) for k, scope in POLL_KERNELS]
    out += [check_poll_loops(d[k], k, scope, marker=None) for k, scope in PROBE_KERNELS]
    return out
