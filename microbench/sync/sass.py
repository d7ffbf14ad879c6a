"""SASS checks of the poll loops: every iteration must issue a strong load of the flag.

A poll compiled into a weak load (LDG.E without .STRONG) may be served from L1 forever, and a
poll hoisted out of its loop spins on a register: both hang. So the check reads the machine
code: for each loop (a backward branch) that is a poll loop, it looks for LDG.E.STRONG.GPU (or
.SYS) between the branch target and the branch.

Disassembler lookup: $MEGABENCH_NVDISASM (path to nvdisasm or cuobjdump), then nvdisasm /
cuobjdump on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, /work/tools. None found: callers skip.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

STRONG_LOAD = {"gpu": re.compile(r"\bLDG\.E\.STRONG\.GPU\b"), "sys": re.compile(r"\bLDG\.E\.STRONG\.SYS\b")}


def find_disassembler(only_path: bool = False) -> str | None:
    """A disassembler for sm_90a cubins, or None. `only_path`: PATH only (the GPU machine's own)."""
    if only_path:
        return shutil.which("cuobjdump") or shutil.which("nvdisasm")
    env = os.environ.get("MEGABENCH_NVDISASM")
    if env and Path(env).is_file():
        return env
    for name in ("cuobjdump", "nvdisasm"):
        p = shutil.which(name)
        if p:
            return p
    dirs = [os.path.join(h, "bin") for h in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if h] + ["/work/tools"]
    for d in dirs:
        for name in ("cuobjdump", "nvdisasm"):
            p = Path(d) / name
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    return None


@dataclass(frozen=True)
class Insn:
    addr: int
    text: str  # predicate + opcode + operands, without the trailing ';'
    target: int | None  # branch target address, for BRA


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def disassemble(cubin: bytes, tool: str) -> dict[str, list[Insn]]:
    """{function: [Insn]} from cuobjdump -sass or nvdisasm -c output."""
    is_cuobjdump = "cuobjdump" in Path(tool).name
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [tool, "-sass", f.name] if is_cuobjdump else [tool, "-c", f.name]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr[-500:]}")
    funcs: dict[str, list[tuple[int, str]]] = {}
    labels: dict[str, dict[str, int]] = {}
    cur = None
    pending: list[str] = []
    for line in res.stdout.splitlines():
        m = re.match(r"\s*Function : (\S+)", line) if is_cuobjdump else re.match(r"^\.text\.(\S+):", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            labels[cur] = {}
            pending = []
            continue
        if cur is None:
            continue
        ml = _LABEL.match(line)
        if ml:
            pending.append(ml.group(1))
            continue
        mi = _LINE.search(line)
        if mi:
            addr = int(mi.group(1), 16)
            for lab in pending:
                labels[cur][lab] = addr
            pending = []
            funcs[cur].append((addr, mi.group(2)))
    out = {}
    for fn, insns in funcs.items():
        lst = []
        for addr, text in insns:
            tgt = None
            if re.search(r"\bBRA\b", text):
                mt = re.search(r"`\((\.L_x_\d+)\)", text)
                if mt:
                    tgt = labels[fn].get(mt.group(1))
                else:
                    mh = re.search(r"(0x[0-9a-f]+)\s*$", text)
                    tgt = int(mh.group(1), 16) if mh else None
            lst.append(Insn(addr, text, tgt))
        out[fn] = lst
    return out


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
    from ..compiler import compile_cuda
    from .params import source

    d = disassemble(compile_cuda(source("flags.cu"), arch=arch).cubin, tool)
    out = [check_poll_loops(d[k], k, scope) for k, scope in POLL_KERNELS]
    out += [check_poll_loops(d[k], k, scope, marker=None) for k, scope in PROBE_KERNELS]
    return out
