"""What a compiled kernel costs in registers, spills, shared memory and code bytes.

Two sources, cross-checked: the ptxas `-v` report (registers, spills, stack, barriers) and the
cubin's ELF section table (machine-code bytes per kernel, static shared memory). Code bytes are
what the instruction-cache budget is compared against, so they come from the ELF, not a guess.
Where the compiler's log has no report of an entry (nvJitLink and NVRTC 13.0 can return empty
logs), its registers and stack frame come from the cubin's `.nv.info`
attributes instead (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE; the same numbers where both exist, a CPU
test checks), with `report="elf"`: the ELF holds no spill counts, so those read 0 there.
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
    report: str = "ptxas"  # where registers / spills / stack came from: "ptxas" (-v log) | "elf" (no spill counts)

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


SYSTEM_SMEM_BYTES = 1024  # what the .nv.shared.<kernel> section holds beyond ptxas's static smem (sm_90)
EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x11, 0x2F  # .nv.info attributes (EIFMT_SVAL: symbol index, value)


def elf_kernel_attrs(image: bytes) -> dict[str, dict[str, int]]:
    """{function: {"regs": N, "stack": B}} from the cubin's global `.nv.info` section: records of
    (format u8, attribute u8, size u16) + payload; EIFMT_SVAL (4) payloads start with the symbol's
    index in `.symtab` then its u32 value; other formats carry their value in the size field."""
    secs = elf_sections(image)
    if ".nv.info" not in secs or ".symtab" not in secs or ".strtab" not in secs:
        return {}
    _, so, ss = secs[".symtab"]
    _, sto, _ = secs[".strtab"]

    def sym(i: int) -> str | None:
        if (i + 1) * 24 > ss:
            return None
        nm = struct.unpack_from("<I", image, so + i * 24)[0]
        return image[sto + nm:image.index(b"\0", sto + nm)].decode()

    out: dict[str, dict[str, int]] = {}
    _, o, size = secs[".nv.info"]
    p, end = o, o + size
    while p + 4 <= end:
        fmt, attr, sz = struct.unpack_from("<BBH", image, p)
        if fmt == 4:
            if sz >= 8 and attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE):
                idx, val = struct.unpack_from("<II", image, p + 4)
                name = sym(idx)
                if name:
                    out.setdefault(name, {})["regs" if attr == EIATTR_REGCOUNT else "stack"] = val
            p += 4 + sz
        else:
            p += 4
    return out


def resource_usage(image: bytes, ptxas_log: str) -> dict[str, ResourceUsage]:
    """Typed resource report for every kernel entry in a cubin: from the ptxas report, or, for an
    entry it does not report, from the cubin's own attributes (report="elf")."""
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
    if len(out) < len(texts):
        for kernel, a in elf_kernel_attrs(image).items():
            if kernel in out or kernel not in texts or "regs" not in a:
                continue  # reported by ptxas, a device function, or no entry of its own
            out[kernel] = ResourceUsage(kernel=kernel, registers=a["regs"], spill_store_bytes=0, spill_load_bytes=0,
                                        stack_frame_bytes=a.get("stack", 0),
                                        static_smem_bytes=max(0, smem.get(kernel, 0) - SYSTEM_SMEM_BYTES),
                                        barriers=0, code_bytes=texts[kernel], report="elf")
    return out
