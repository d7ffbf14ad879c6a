"""PTX generators for the instruction-cache benchmarks, and the check that the code survived.

Every kernel here is straight-line code whose *size* is the experiment, so each generator
states how many SASS instructions it means to produce and `check_code_size` refuses a cubin
whose `.text` differs from that (the compiler folded or expanded the body). PTX, not C++, so
nothing above ptxas can fold it, and every instruction is one we chose.

Loop and probe bodies are `add.rn.f32 acc[i % 32], acc[i % 32], b[(i / 32) % 2]`:
- no two neighbours depend on each other (a register is rewritten every 32 instructions, far
  past the FADD latency), so a warp can issue one per cycle;
- IEEE round-to-nearest adds cannot be reassociated, so ptxas cannot fold `x + b + b`;
- with integer-valued inputs (|x| <= 1024, 1 <= b <= 8) every partial sum is an integer below
  2**24, so float32 arithmetic is exact and the result has a closed form the host checks.
A guard `setp.gt.f32 p, acc, never; @p bra BAIL` (never = +inf, a kernel parameter) every
GUARD_EVERY instructions splits the body into basic blocks: ptxas's scheduler is superlinear in
block size (1 MiB as one block took 78 s to assemble, in 1024-instruction blocks 8 s). Each guard
tests a different, changing register, so ptxas cannot prove it never fires. BAIL stores only the
accumulators: an exit edge that kept the timing registers live doubled the assembly time.

Kinds:
- loop kernel: a loop of `iters + 1` passes over 1 or 2 blocks (pass 0 is the warm pass);
  %clock64 before/between/after the blocks; per warp: timed cycles per block, first-pass
  cycles per block, total cycles and %globaltimer ns (SM clock cross-check), %smid.
- probe kernel: one pass over a body with a %clock64 stamp stored every `seg` instructions
  (cost of code at increasing offsets from the entry on its first execution).
- stream kernel: a loop over a body of `stages`, each stage 8 x 16-byte loads per lane of a
  weights-like buffer (immediate offsets, one pointer step per pass) + 32 FADDs folding them in;
  the body size sets the code footprint while bytes and instructions per byte stay the same.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..compiler import CACHE_FORMAT, cache_dir, compile_ptx, toolchain_versions
from ..cubin import SASS_INSTRUCTION_BYTES
from ..errors import CompileError

PTX_HEADER = ".version 8.0\n.target {arch}\n.address_size 64\n"
NACC = 32  # accumulator registers (%f0..%f31)
GUARD_EVERY = 1024  # body instructions between guards (compile-time, see module doc)
REC_WORDS = 8  # u64 per warp in a loop kernel's record
STAGE_LOADS = 8  # 16-byte loads per lane per stream stage
STAGE_BYTES_PER_WARP = STAGE_LOADS * 16 * 32  # 4 KiB
# Data bounds that keep every partial sum an exact float32 integer (see module doc).
X_MAX = 1024
B_MAX = 8
EXACT_LIMIT = 1 << 24
# Code-size check: growth over the calibration kernel = intended instructions x 16 B, within
# this slack (ptxas's fixed code around the body shifts by a few instructions and NOP padding).
SIZE_TOL_BYTES = 256
SIZE_TOL_FRAC = 0.005
# Per-warp record layout of a loop kernel (u64 words).
R_TIMED0, R_TIMED1, R_FIRST0, R_FIRST1, R_TOTAL_CYC, R_TOTAL_NS, R_SMID, R_PASSES = range(REC_WORDS)


class CodeSizeError(CompileError):
    """The cubin's machine code is not the size the generator intended: folded or expanded."""


@dataclass(frozen=True)
class Generated:
    """PTX text plus what the generator meant to produce."""

    name: str  # kernel entry name (also the module name)
    ptx: str
    body_instructions: int  # SASS instructions the sized region should assemble to
    kind: str  # "loop" | "probe" | "stream"
    params: dict = field(default_factory=dict)
    calibration: Generated | None = None  # same template, small body, same guard structure
    guarded: bool = False  # the body contains guards (they change the fixed code around the loop)

    @property
    def body_bytes(self) -> int:
        return self.body_instructions * SASS_INSTRUCTION_BYTES


def instructions_for(nbytes: int) -> int:
    """Body instructions (guards included) whose code is closest to `nbytes`."""
    if nbytes < SASS_INSTRUCTION_BYTES * 64:
        raise ValueError(f"body of {nbytes} B is below 1 KiB: too small to time against loop overhead")
    return max(1, round(nbytes / SASS_INSTRUCTION_BYTES))


def _name(prefix: str, *parts) -> str:
    h = hashlib.sha1(repr(parts).encode()).hexdigest()[:8]
    return f"{prefix}_{h}"


class _Body:
    """Emits FADDs (and guards) while counting what each register received."""

    def __init__(self, op: str = "fadd", guard_every: int = GUARD_EVERY):
        if op not in ("fadd", "iadd_imm", "fdiv"):
            raise ValueError(f"unknown body op {op!r} (fadd, iadd_imm, fdiv)")
        self.op = op
        self.guard_every = guard_every
        self.lines: list[str] = []
        self.i = 0  # arithmetic instructions emitted (drives register/b selection)
        self.nguard = 0
        self.since_guard = 0
        self.sass = 0  # intended SASS instructions
        self.count_b0 = [0] * NACC
        self.count_b1 = [0] * NACC

    def guard(self, k: int | None = None) -> None:
        # default: a different accumulator at each guard, changed since the previous guard, so
        # ptxas cannot thread one guard's outcome into the next (it may stall a few cycles on a
        # fresh result once per GUARD_EVERY instructions)
        k = (self.i + self.nguard) % NACC if k is None else k % NACC
        self.lines.append(f"\tsetp.gt.f32 \t%p3, %f{k}, %f34;\n\t@%p3 bra \t$L_bail;")
        self.sass += 2
        self.nguard += 1
        self.since_guard = 0

    def arith(self, n: int) -> None:
        for _ in range(n):
            if self.since_guard >= self.guard_every:
                self.guard()
            k = self.i % NACC
            sel = (self.i // NACC) % 2
            if self.op == "fadd":
                self.lines.append(f"\tadd.rn.f32 \t%f{k}, %f{k}, %f{32 + sel};")
                (self.count_b1 if sel else self.count_b0)[k] += 1
            elif self.op == "iadd_imm":  # deliberately foldable: ptxas sums the constants
                self.lines.append(f"\tadd.u32 \t%r{k + 40}, %r{k + 40}, {sel + 1};")
            else:  # fdiv: one PTX instruction, a subroutine's worth of SASS
                self.lines.append(f"\tdiv.rn.f32 \t%f{k}, %f{k}, %f{32 + sel};")
            self.i += 1
            self.since_guard += 1
            self.sass += 1

    def raw(self, text: str, sass: int) -> None:
        """Instructions the generator counts as `sass` SASS instructions (stamps, loads)."""
        self.lines.append(text)
        self.sass += sass
        self.since_guard += sass


_DECLS = """\t.reg .pred \t%p<8>;
\t.reg .f32 \t%f<80>;
\t.reg .b32 \t%r<80>;
\t.reg .b64 \t%rd<64>;
"""

# Thread/warp identity, record pointer (%rd8), accumulators (%f0..31) from x, b0/b1/never.
_PROLOGUE = """\tmov.u32 \t%r1, %tid.x;
\tmov.u32 \t%r2, %ctaid.x;
\tmov.u32 \t%r3, %ntid.x;
\tmad.lo.u32 \t%r4, %r2, %r3, %r1;
\tshr.u32 \t%r5, %r4, 5;
\tand.b32 \t%r6, %r1, 31;
\tsetp.eq.u32 \t%p6, %r6, 0;
\tld.param.u64 \t%rd1, [p_x];
\tcvta.to.global.u64 \t%rd1, %rd1;
\tld.param.u64 \t%rd2, [p_out];
\tcvta.to.global.u64 \t%rd2, %rd2;
\tld.param.u64 \t%rd3, [p_rec];
\tcvta.to.global.u64 \t%rd3, %rd3;
\tmul.wide.u32 \t%rd4, %r4, 128;
\tadd.s64 \t%rd5, %rd1, %rd4;
\tadd.s64 \t%rd6, %rd2, %rd4;
\tmul.wide.u32 \t%rd7, %r5, {rec_bytes};
\tadd.s64 \t%rd8, %rd3, %rd7;
\tld.param.f32 \t%f32, [p_b0];
\tld.param.f32 \t%f33, [p_b1];
\tld.param.f32 \t%f34, [p_never];
""" + "".join(f"\tld.global.v4.f32 \t{{%f{4 * j}, %f{4 * j + 1}, %f{4 * j + 2}, %f{4 * j + 3}}}, [%rd5+{16 * j}];\n"
              for j in range(8))


def _prologue(rec_bytes: int) -> str:
    return _PROLOGUE.replace("{rec_bytes}", str(rec_bytes))


_STORE_ACC = "".join(f"\tst.global.v4.f32 \t[%rd6+{16 * j}], "
                     f"{{%f{4 * j}, %f{4 * j + 1}, %f{4 * j + 2}, %f{4 * j + 3}}};\n" for j in range(8))


def loop_kernel(block_instructions: Sequence[int], *, arch: str = "sm_90a", op: str = "fadd",
                drop_last: int = 0, guard_every: int = GUARD_EVERY, _calibrate: bool = True) -> Generated:
    """A loop of iters+1 passes over 1 or 2 straight-line blocks of the given instruction counts.

    Params: (x f32[T*32], out f32[T*32], rec u64[warps*8], iters u32, b0 f32, b1 f32, never f32).
    `drop_last` removes that many FADDs from the last block *without* telling the reference: a
    deliberately broken kernel for proving the correctness check can fail.
    """
    blocks = [int(n) for n in block_instructions]
    if not 1 <= len(blocks) <= 2 or any(n < 0 for n in blocks):
        raise ValueError(f"loop kernel takes 1 or 2 non-negative block sizes, got {block_instructions}")
    name = _name("ic_loop", tuple(blocks), op, drop_last, guard_every, arch)
    body = _Body(op, guard_every)
    block_sass = []
    parts = []
    for bi, n in enumerate(blocks):
        before = body.sass
        body.lines.append(f"\tmov.u64 \t%rd{22 + bi}, %clock64;")
        if op == "iadd_imm":  # integer view of the accumulators (free in SASS: one register file)
            body.raw("".join(f"\tmov.b32 \t%r{40 + k}, %f{k};\n" for k in range(NACC)), 0)
        body.arith(n - (drop_last if bi == len(blocks) - 1 else 0))
        if op == "iadd_imm":
            body.raw("".join(f"\tmov.b32 \t%f{k}, %r{40 + k};\n" for k in range(NACC)), 0)
        block_sass.append(body.sass - before)
        parts.append(bi)
    counts = (list(body.count_b0), list(body.count_b1))
    if drop_last:  # the reference believes the full body ran
        ref = _Body(op, guard_every)
        for n in blocks:
            ref.arith(n)
        counts = (list(ref.count_b0), list(ref.count_b1))
    nb = len(blocks)
    lines = [PTX_HEADER.format(arch=arch),
             f".visible .entry {name}(\n\t.param .u64 p_x,\n\t.param .u64 p_out,\n\t.param .u64 p_rec,\n"
             "\t.param .u32 p_iters,\n\t.param .f32 p_b0,\n\t.param .f32 p_b1,\n\t.param .f32 p_never\n)\n{",
             _DECLS, _prologue(REC_WORDS * 8),
             "\tld.param.u32 \t%r7, [p_iters];",
             "\tmov.u64 \t%rd10, 0;\n\tmov.u64 \t%rd11, 0;\n\tmov.u64 \t%rd12, 0;\n\tmov.u64 \t%rd13, 0;",
             "\tmov.u32 \t%r8, 0;",
             "\tmov.u64 \t%rd20, %globaltimer;\n\tmov.u64 \t%rd21, %clock64;",
             "$L_pass:",
             '\t.pragma "nounroll";',  # an unrolled loop would multiply the code we size
             *body.lines,
             f"\tmov.u64 \t%rd{22 + nb}, %clock64;",
             # pass 0 is the warm pass: its cycles go to the first-pass slots, the rest accumulate
             "\tsetp.eq.u32 \t%p1, %r8, 0;"]
    for bi in range(nb):
        lines += [f"\tsub.s64 \t%rd{30 + bi}, %rd{23 + bi}, %rd{22 + bi};",
                  f"\t@%p1 mov.u64 \t%rd{12 + bi}, %rd{30 + bi};",
                  f"\t@!%p1 add.s64 \t%rd{10 + bi}, %rd{10 + bi}, %rd{30 + bi};"]
    lines += ["\tadd.u32 \t%r8, %r8, 1;",
              "\tsetp.le.u32 \t%p2, %r8, %r7;",
              "\t@%p2 bra \t$L_pass;",
              "$L_done:",
              "\tmov.u64 \t%rd26, %clock64;\n\tmov.u64 \t%rd27, %globaltimer;",
              _STORE_ACC,
              "\tsub.s64 \t%rd28, %rd26, %rd21;\n\tsub.s64 \t%rd29, %rd27, %rd20;",
              "\tmov.u32 \t%r9, %smid;\n\tcvt.u64.u32 \t%rd33, %r9;\n\tcvt.u64.u32 \t%rd34, %r8;",
              "\t@%p6 st.global.v2.u64 \t[%rd8+0], {%rd10, %rd11};",
              "\t@%p6 st.global.v2.u64 \t[%rd8+16], {%rd12, %rd13};",
              "\t@%p6 st.global.v2.u64 \t[%rd8+32], {%rd28, %rd29};",
              "\t@%p6 st.global.v2.u64 \t[%rd8+48], {%rd33, %rd34};",
              "\tret;", "$L_bail:", _STORE_ACC, "\tret;\n}\n"]
    ptx = "\n".join(lines)
    guarded = body.nguard > 0
    cal = None
    if _calibrate:
        n_cal = guard_every + NACC if guarded else NACC
        cal = loop_kernel([n_cal] * nb, arch=arch, guard_every=guard_every, _calibrate=False)
    return Generated(name, ptx, body.sass, "loop",
                     {"blocks": tuple(blocks), "block_sass": tuple(block_sass), "op": op, "drop_last": drop_last,
                      "count_b0": counts[0], "count_b1": counts[1]}, cal, guarded)


def probe_kernel(total_instructions: int, seg_instructions: int, *, arch: str = "sm_90a",
                 guard_every: int = GUARD_EVERY, _calibrate: bool = True) -> Generated:
    """One pass over a straight-line body with a %clock64 stamp every `seg_instructions` FADDs.

    Params: (x, out, rec u64[warps * (nseg+2)], b0, b1, never). Record per warp: nseg+1 stamps,
    then %smid. Stamps are stored by lane 0 as they are taken (fire-and-forget stores, so the
    warp does not wait on them).
    """
    if seg_instructions < 16 or total_instructions < 0 or total_instructions % seg_instructions:
        raise ValueError(f"probe: total {total_instructions} must be a multiple of seg {seg_instructions} >= 16")
    nseg = total_instructions // seg_instructions
    rec_words = nseg + 2
    name = _name("ic_probe", total_instructions, seg_instructions, guard_every, arch)
    body = _Body("fadd", guard_every)
    stamp = "\tmov.u64 \t%rd22, %clock64;\n\t@%p6 st.global.u64 \t[%rd8+{off}], %rd22;"
    body.raw(stamp.format(off=0), 2)
    seg_sass = []
    for s in range(nseg):
        before = body.sass
        body.arith(seg_instructions)
        body.raw(stamp.format(off=8 * (s + 1)), 2)
        seg_sass.append(body.sass - before)
    lines = [PTX_HEADER.format(arch=arch),
             f".visible .entry {name}(\n\t.param .u64 p_x,\n\t.param .u64 p_out,\n\t.param .u64 p_rec,\n"
             "\t.param .f32 p_b0,\n\t.param .f32 p_b1,\n\t.param .f32 p_never\n)\n{",
             _DECLS, _prologue(rec_words * 8),
             *body.lines,
             "$L_done:",
             _STORE_ACC,
             "\tmov.u32 \t%r9, %smid;\n\tcvt.u64.u32 \t%rd33, %r9;",
             f"\t@%p6 st.global.u64 \t[%rd8+{8 * (nseg + 1)}], %rd33;",
             "\tret;", "$L_bail:", _STORE_ACC, "\tret;\n}\n"]
    guarded = body.nguard > 0
    cal = None
    if _calibrate:
        n_cal = seg_instructions * (guard_every // seg_instructions + 1) if guarded else seg_instructions
        cal = probe_kernel(n_cal, seg_instructions, arch=arch, guard_every=guard_every, _calibrate=False)
    return Generated(name, "\n".join(lines), body.sass, "probe",
                     {"total": total_instructions, "seg": seg_instructions, "nseg": nseg, "rec_words": rec_words,
                      "seg_sass": tuple(seg_sass), "count_b0": body.count_b0, "count_b1": body.count_b1}, cal,
                     guarded)


def stream_kernel(stages: int, *, arch: str = "sm_90a", guard_every: int = GUARD_EVERY,
                  _calibrate: bool = True) -> Generated:
    """A loop of `passes` over `stages` stream stages (see module doc).

    Params: (w f32 weights, out f32[T*32], passes u32, stride u64 (bytes per pass over all
    warps = warps_total * stages * 4 KiB), never f32). In pass p, warp g, lane l, stage s,
    load j reads 16 B at ((p * warps_total + g) * stages + s) * 4096 + j * 512 + l * 16 into
    acc[4j + c] (c = 0..3): each warp streams one contiguous stages * 4 KiB run per pass.
    Immediate offsets reach stages * 4 KiB, within LDG's signed 24-bit range up to 2047 stages.
    """
    if not 0 <= stages < 2048:
        raise ValueError(f"stages must be in [0, 2048) (LDG immediate offset range), got {stages}")
    name = _name("ic_stream", stages, guard_every, arch)
    body = _Body("fadd", guard_every)
    for st in range(stages):
        if body.since_guard >= guard_every:
            body.guard(body.nguard)
        for j in range(STAGE_LOADS):  # immediate offsets: no address arithmetic in the body
            body.raw(f"\tld.global.nc.v4.f32 \t{{%f{40 + 4 * j}, %f{41 + 4 * j}, %f{42 + 4 * j}, %f{43 + 4 * j}}}, "
                     f"[%rd9+{st * STAGE_BYTES_PER_WARP + 512 * j}];", 1)
        for k in range(NACC):
            body.raw(f"\tadd.rn.f32 \t%f{k}, %f{k}, %f{40 + k};", 1)
    lines = [PTX_HEADER.format(arch=arch),
             f".visible .entry {name}(\n\t.param .u64 p_w,\n\t.param .u64 p_out,\n\t.param .u32 p_passes,\n"
             "\t.param .u64 p_stride,\n\t.param .f32 p_never\n)\n{",
             _DECLS,
             "\tmov.u32 \t%r1, %tid.x;\n\tmov.u32 \t%r2, %ctaid.x;\n\tmov.u32 \t%r3, %ntid.x;",
             "\tmad.lo.u32 \t%r4, %r2, %r3, %r1;\n\tshr.u32 \t%r5, %r4, 5;\n\tand.b32 \t%r6, %r1, 31;",
             "\tld.param.u64 \t%rd1, [p_w];\n\tcvta.to.global.u64 \t%rd1, %rd1;",
             "\tld.param.u64 \t%rd2, [p_out];\n\tcvta.to.global.u64 \t%rd2, %rd2;",
             "\tmul.wide.u32 \t%rd4, %r4, 128;\n\tadd.s64 \t%rd6, %rd2, %rd4;",
             f"\tmul.wide.u32 \t%rd10, %r5, {STAGE_BYTES_PER_WARP * max(stages, 1)};\n\tmul.wide.u32 \t%rd11, %r6, 16;",
             "\tadd.s64 \t%rd9, %rd1, %rd10;\n\tadd.s64 \t%rd9, %rd9, %rd11;",
             "\tld.param.u64 \t%rd15, [p_stride];\n\tld.param.f32 \t%f34, [p_never];",
             "\tld.param.u32 \t%r7, [p_passes];\n\tmov.u32 \t%r8, 0;",
             *[f"\tmov.f32 \t%f{k}, 0f00000000;" for k in range(NACC)],
             "\tsetp.eq.u32 \t%p1, %r7, 0;\n\t@%p1 bra \t$L_done;",
             "$L_pass:",
             '\t.pragma "nounroll";',
             *body.lines,
             "\tadd.s64 \t%rd9, %rd9, %rd15;",
             "\tadd.u32 \t%r8, %r8, 1;\n\tsetp.lt.u32 \t%p2, %r8, %r7;\n\t@%p2 bra \t$L_pass;",
             "$L_done:",
             _STORE_ACC,
             "\tret;", "$L_bail:", _STORE_ACC, "\tret;\n}\n"]
    guarded = body.nguard > 0
    cal = None
    if _calibrate:
        per_stage = STAGE_LOADS + NACC
        cal = stream_kernel(guard_every // per_stage + 2 if guarded else 1, arch=arch, guard_every=guard_every,
                            _calibrate=False)
    return Generated(name, "\n".join(lines), body.sass, "stream", {"stages": stages}, cal, guarded)


# ------------------------------------------------------------------------- compile + check
def check_code_size(gen: Generated, code_bytes: int, cal: Generated, cal_code_bytes: int) -> int:
    """Raise CodeSizeError unless the code grew from the calibration kernel's by exactly the
    instructions the generator added (16 B each), within SIZE_TOL_BYTES + SIZE_TOL_FRAC of the
    body: what ptxas folded away or expanded would show here. Returns the difference (bytes).

    The calibration is the same template with a small body and the same guard structure, so
    the fixed code around the body (prologue, loop control, epilogue) cancels."""
    want = cal_code_bytes + gen.body_bytes - cal.body_bytes
    diff = code_bytes - want
    tol = SIZE_TOL_BYTES + SIZE_TOL_FRAC * gen.body_bytes
    if abs(diff) > tol:
        what = ("folded (fewer instructions than generated)" if diff < 0
                else "expanded (more instructions than generated)")
        size = gen.params.get("blocks", gen.params.get("total", gen.params.get("stages")))
        raise CodeSizeError(
            f"{gen.name} ({gen.kind} {size}, op {gen.params.get('op', 'fadd')}): machine code is {code_bytes} B; "
            f"the generator intended {gen.body_instructions} SASS instructions ({gen.body_bytes} B) where its "
            f"calibration kernel {cal.name} intended {cal.body_instructions} and assembled to {cal_code_bytes} B, "
            f"so {want} B were expected; off by {diff:+d} B (tolerance {tol:.0f} B): the compiler {what}")
    return diff


def compile_checked(gen: Generated, *, use_cache: bool = True):
    """Assemble (nvJitLink) and check the code size; returns the CompiledModule."""
    mod = compile_ptx(gen.ptx, name=gen.name, arch=_arch_of(gen), use_cache=use_cache)
    if gen.calibration is not None:
        c = gen.calibration
        cal = compile_ptx(c.ptx, name=c.name, arch=_arch_of(gen), use_cache=use_cache)
        check_code_size(gen, mod.usage(gen.name).code_bytes, c, cal.usage(c.name).code_bytes)
    return mod


def compile_many(gens: Sequence[Generated], *, workers: int | None = None) -> dict[str, object]:
    """compile_checked for many kernels; what the cache lacks is assembled in a process pool first.

    Processes, not threads: nvJitLink through cuda.core holds the GIL (two threads took as long
    as one). Children are spawned, never forked: the parent may hold a CUDA context, and they only
    run nvJitLink. They write the compile cache; the parent then loads and size-checks each kernel.
    """
    uniq = {g.name: g for g in gens}
    cals = {g.calibration.name: g.calibration for g in uniq.values() if g.calibration is not None}
    todo = [g for g in [*cals.values(), *uniq.values()] if not _ptx_cache_hit(g.ptx, g.name, _arch_of(g))]
    todo.sort(key=lambda g: -g.body_instructions)  # biggest first: the longest assembly starts at once
    workers = workers or min(len(todo), os.cpu_count() or 1)
    if len(todo) > 1 and workers > 1:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(_assemble, [(g.ptx, g.name, _arch_of(g)) for g in todo]))
    else:
        for g in todo:
            _assemble((g.ptx, g.name, _arch_of(g)))
    return {name: compile_checked(g) for name, g in uniq.items()}


def _assemble(job: tuple[str, str, str]) -> int:
    """Pool worker: PTX -> cubin into the compile cache; returns the code bytes."""
    ptx, name, arch = job
    return compile_ptx(ptx, name=name, arch=arch).usage(name).code_bytes


def _ptx_cache_hit(ptx: str, name: str, arch: str) -> bool:
    """Whether compile_ptx would find this PTX in the cache. Mirrors compile_ptx's key; a CPU test
    checks the two stay in step (if they drift, kernels are only assembled twice, never wrong)."""
    tv = toolchain_versions()
    key = hashlib.sha256(json.dumps({"fmt": CACHE_FORMAT, "ptx": ptx, "arch": arch,
                                     "tool": {"nvrtc": tv.get("nvrtc"), "cuda-core": tv.get("cuda-core")}}
                                    ).encode()).hexdigest()[:20]
    base = cache_dir() / f"{name}-{arch}-{key}"
    return base.with_suffix(".cubin").is_file() and base.with_suffix(".json").is_file()


def _arch_of(gen: Generated) -> str:
    line = gen.ptx.split("\n", 3)[1]
    return line.split()[1]


# ------------------------------------------------------------------------- reference
def loop_reference(gen: Generated, x, b0: float, b1: float, passes: int):
    """Expected accumulators after `passes` passes (float64, exact for integer data)."""
    c0 = np.asarray(gen.params["count_b0"], dtype=np.float64)
    c1 = np.asarray(gen.params["count_b1"], dtype=np.float64)
    x = np.asarray(x, dtype=np.float64).reshape(-1, NACC)
    return x + passes * (c0 * b0 + c1 * b1)[None, :]


def check_exact_range(gen: Generated, passes: int) -> None:
    """Refuse a launch whose partial sums could leave the exact-float32-integer range."""
    adds = passes * max((a + b) for a, b in zip(gen.params["count_b0"], gen.params["count_b1"]))
    if X_MAX + adds * B_MAX >= EXACT_LIMIT:
        raise ValueError(f"{gen.name}: {passes} passes of {adds // max(passes, 1)} adds per register could "
                         f"exceed 2**24 (float32 stops being exact); use fewer passes")
