"""SASS of a cubin per kernel, when a disassembler exists (CI has none: callers skip cleanly).

Looked up in order: $MEGABENCH_NVDISASM (a path to nvdisasm or cuobjdump), nvdisasm / cuobjdump
on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, /work/tools.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path


def find_disassembler() -> str | None:
    env = os.environ.get("MEGABENCH_NVDISASM")
    if env and Path(env).is_file():
        return env
    for name in ("nvdisasm", "cuobjdump"):
        p = shutil.which(name)
        if p:
            return p
    dirs = [os.path.join(h, "bin") for h in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if h] + ["/work/tools"]
    for d in dirs:
        for name in ("nvdisasm", "cuobjdump"):
            p = Path(d) / name
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    return None


_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def sass_by_kernel(cubin: bytes, tool: str | None = None) -> dict[str, list[str]]:
    """{function name: [instruction text, ...]} (predicates kept, addresses and encodings dropped)."""
    tool = tool or find_disassembler()
    if tool is None:
        raise FileNotFoundError("no nvdisasm/cuobjdump found (set MEGABENCH_NVDISASM)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        is_cuobjdump = "cuobjdump" in Path(tool).name
        cmd = [tool, "-sass", f.name] if is_cuobjdump else [tool, "-c", f.name]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    kernels: dict[str, list[str]] = {}
    cur = None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line) if is_cuobjdump else re.match(r"^\.text\.(\S+):", line)
        if m:
            cur = m.group(1)
            kernels[cur] = []
            continue
        if cur is not None and (mi := _INSN.search(line)):
            kernels[cur].append(mi.group(1))
    return kernels


def count_matching(insns: list[str], pattern: str) -> int:
    r = re.compile(pattern)
    return sum(1 for i in insns if r.search(i))
