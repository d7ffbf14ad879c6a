"""What a compiled kernel costs in registers, spills, shared memory and code bytes.

Two sources, cross-checked: the ptxas `-v` report (registers, spills, stack, barriers) and the
cubin's ELF section table (machine-code bytes per kernel, static shared memory). Code bytes are
what the instruction-cache budget is compared against, so they come from the ELF, not a guess.
"""
from __future__ import annotations

import re
import struct
from dataclasses import asdict, dataclass

from .errors import CompileError

SASS_INSTRUCTION_BYTES = 16  # Volta..Blackwell encode every SASS instruction in 128 bits


@dataclass(frozen=True)
class ResourceUsage:
    kernel: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    static_smem_bytes: int
    barriers: int
    code_bytes: int  # .text.<kernel> of the cubin (machine code of the kernel body)

    @property
    def sass_instructions(self) -> int:
        return self.code_bytes // SASS_INSTRUCTION_BYTES

    @property
    def spills(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def elf_sections(image: bytes) -> dict[str, tuple[int, int, int]]:
    """{section name: (type, offset, size)} of an ELF64 little-endian image (a cubin)."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise CompileError("not an ELF64 little-endian cubin")
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    heads = []
    for i in range(shnum):
        off = shoff + i * shentsize
        name, typ, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", image, off)
        heads.append((name, typ, offset, size))
    _, _, str_off, str_size = heads[shstrndx]
    strtab = image[str_off:str_off + str_size]
    out = {}
    for name, typ, offset, size in heads:
        end = strtab.index(b"\0", name)
        out[strtab[name:end].decode()] = (typ, offset, size)
    return out


def text_sizes(image: bytes) -> dict[str, int]:
    """Machine-code bytes of every function (kernels and non-inlined device functions)."""
    return {n[len(".text."):]: s for n, (_t, _o, s) in elf_sections(image).items() if n.startswith(".text.")}


def static_smem_sizes(image: bytes) -> dict[str, int]:
    return {n[len(".nv.shared."):]: s for n, (_t, _o, s) in elf_sections(image).items()
            if n.startswith(".nv.shared.")}


_FN = re.compile(r"Function properties for (\S+)")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")  # anywhere in the line: "cumulative stack size" may come first


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per-entry numbers from `ptxas -v` output. Entries without a 'Used N registers' line are skipped."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
            out.setdefault(current, {})
        elif m := _FN.search(line):
            current = m.group(1)
            out.setdefault(current, {})
        elif current and (m := _STACK.search(line)):
            out[current].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        elif current and (m := _USED.search(line)):
            b = _BARRIERS.search(line)
            out[current].update(regs=int(m.group(1)), barriers=int(b.group(1)) if b else 0)
            if sm := _SMEM.search(line):
                out[current]["smem"] = int(sm.group(1))
    return {k: v for k, v in out.items() if "regs" in v}


def resource_usage(image: bytes, ptxas_log: str) -> dict[str, ResourceUsage]:
    """Typed resource report for every kernel entry in a cubin."""
    texts = text_sizes(image)
    smem = static_smem_sizes(image)
    parsed = parse_ptxas_log(ptxas_log)
    out = {}
    for kernel, v in parsed.items():
        if kernel not in texts:
            continue  # a non-entry function reported by ptxas (e.g. noinline device function)
        out[kernel] = ResourceUsage(
            kernel=kernel,
            registers=v["regs"],
            spill_store_bytes=v.get("spill_st", 0),
            spill_load_bytes=v.get("spill_ld", 0),
            stack_frame_bytes=v.get("stack", 0),
            # ptxas counts the user's static smem; the ELF section adds the 1 KB the system reserves
            static_smem_bytes=v["smem"] if "smem" in v else smem.get(kernel, 0),
            barriers=v.get("barriers", 0),
            code_bytes=texts[kernel],
        )
    return out
