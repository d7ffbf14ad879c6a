"""SASS of a cubin, when a disassembler exists (CI may have none: callers skip cleanly).

Looked up in order: $MEGABENCH_NVDISASM (a path to nvdisasm or cuobjdump), cuobjdump / nvdisasm
on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, /work/tools.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .cubin import SASS_INSTRUCTION_BYTES


def _find_tool(names: tuple[str, ...]) -> str | None:
    """The first of `names` on PATH, else in the CUDA bin directories or /work/tools, or None."""
    for name in names:
        p = shutil.which(name)
        if p:
            return p
    dirs = [os.path.join(h, "bin") for h in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if h] + ["/work/tools"]
    for d in dirs:
        for name in names:
            p = Path(d) / name
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    return None


def find_disassembler(only_path: bool = False) -> str | None:
    """A disassembler for sm_90a cubins, or None. `only_path`: PATH only (the GPU machine's own)."""
    if only_path:
        return shutil.which("cuobjdump") or shutil.which("nvdisasm")
    env = os.environ.get("MEGABENCH_NVDISASM")
    if env and Path(env).is_file():
        return env
    return _find_tool(("cuobjdump", "nvdisasm"))


def find_nvdisasm() -> str | None:
    """nvdisasm, the one disassembler that prints inlined source lines (-gi), or None."""
    env = os.environ.get("MEGABENCH_NVDISASM")
    if env and Path(env).name.startswith("nvdisasm") and Path(env).is_file():
        return env
    return _find_tool(("nvdisasm",))


@dataclass(frozen=True)
class Insn:
    addr: int
    text: str  # predicate + opcode + operands, without the trailing ';'
    target: int | None  # branch target address, for BRA


def _run_on_cubin(tool: str, args: list[str], cubin: bytes, timeout: int) -> subprocess.CompletedProcess:
    """`tool args <cubin written to a temporary file>`; RuntimeError (with its stderr) if it fails."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [tool, *args, f.name]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr[-500:]}")
    return res


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def disassemble(cubin: bytes, tool: str) -> dict[str, list[Insn]]:
    """{function: [Insn]} from cuobjdump -sass or nvdisasm -c output."""
    is_cuobjdump = "cuobjdump" in Path(tool).name
    res = _run_on_cubin(tool, ["-sass"] if is_cuobjdump else ["-c"], cubin, timeout=120)
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


def sass_by_kernel(cubin: bytes, tool: str | None = None) -> dict[str, list[str]]:
    """{function name: [instruction text, ...]} (predicates kept, addresses and encodings dropped)."""
    tool = tool or find_disassembler()
    if tool is None:
        raise FileNotFoundError("no nvdisasm/cuobjdump found (set MEGABENCH_NVDISASM)")
    return {fn: [i.text for i in insns] for fn, insns in disassemble(cubin, tool).items()}


def count_matching(insns: list[str], pattern: str) -> int:
    r = re.compile(pattern)
    return sum(1 for i in insns if r.search(i))


def instruction_chains(lines: Iterable[str], kernel: str | None = None) -> list[tuple[int, str, list[str]]]:
    """(offset, instruction text, inline chain) of each instruction in a `nvdisasm -gi -c` listing, in
    order. nvdisasm annotates an instruction whose source position changed with its whole inline
    chain, innermost first, one `//## File "f", line n [inlined at ...]` line per level; the
    instructions after it share that chain (["f:n", ...]; [] before any annotation).
    kernel: only that function's instructions (all functions when None)."""
    out: list[tuple[int, str, list[str]]] = []
    chain: list[str] = []
    cur: list[str] = []
    in_chain, inside = False, kernel is None
    for line in lines:
        m = re.match(r"^\.text\.(\S+):", line)
        if m:
            inside = kernel is None or m.group(1) == kernel
            continue
        ma = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if ma:
            if not in_chain:
                chain = []
            chain.append(f"{Path(ma.group(1)).as_posix()}:{ma.group(2)}")
            in_chain = True
            continue
        if in_chain:
            cur, in_chain = chain, False
        mi = _LINE.search(line)
        if inside and mi:
            out.append((int(mi.group(1), 16), mi.group(2), cur))
    return out


def _bytes_by(chains: Iterable[tuple[int, str, list[str]]], label: Callable[[list[str]], str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, _, chain in chains:
        k = label(chain) if chain else "?"
        out[k] = out.get(k, 0) + SASS_INSTRUCTION_BYTES
    return out


def code_bytes_by(lines: Iterable[str], label: Callable[[list[str]], str], kernel: str | None = None) -> dict[str, int]:
    """Machine-code bytes per label(chain) of instruction_chains (instructions before any chain
    count as "?")."""
    return _bytes_by(instruction_chains(lines, kernel), label)


def cubin_instruction_chains(cubin: bytes, kernel: str | None = None,
                             tool: str | None = None) -> list[tuple[int, str, list[str]]]:
    """instruction_chains over the cubin's `nvdisasm -gi -c` listing (the cubin needs line info)."""
    tool = tool or find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("source positions of SASS need nvdisasm (set MEGABENCH_NVDISASM)")
    return instruction_chains(_run_on_cubin(tool, ["-gi", "-c"], cubin, timeout=300).stdout.splitlines(), kernel)


def code_bytes_by_source(cubin: bytes, label: Callable[[list[str]], str], kernel: str | None = None,
                         tool: str | None = None) -> dict[str, int]:
    """code_bytes_by over the cubin's `nvdisasm -gi -c` listing (the cubin needs line info)."""
    return _bytes_by(cubin_instruction_chains(cubin, kernel, tool), label)
