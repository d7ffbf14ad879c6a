"""CPU tests of the instruction-cache kernel generator and its code-size check: the generated
PTX means what the reference assumes, every template assembles to the intended size, and a
body the compiler can fold (or expand) is refused."""
from __future__ import annotations

import re

import numpy as np
import pytest

from microbench.errors import CompileError
from microbench.icache import gen
from microbench.icache.gen import (CodeSizeError, check_code_size, check_exact_range, compile_checked, compile_many,
                                   instructions_for, loop_kernel, loop_reference, probe_kernel, stream_kernel)

ADD = re.compile(r"add\.rn\.f32 \t%f(\d+), %f(\d+), %f(\d+);")


def _emulate_loop(g: gen.Generated, x: np.ndarray, b: tuple[float, float], passes: int) -> np.ndarray:
    """Run the generated body's FADD lines in float32, in order, as the GPU would."""
    regs = {k: x[:, k].astype(np.float32).copy() for k in range(gen.NACC)}
    body = g.ptx.split("$L_pass:")[1].split("$L_done:")[0]
    ops = [(int(d), int(a), int(s)) for d, a, s in ADD.findall(body)]
    consts = {32: np.float32(b[0]), 33: np.float32(b[1])}
    for _ in range(passes):
        for d, a, s in ops:
            assert d == a and s in consts, "body instruction is not acc += b"
            regs[d] = (regs[a] + consts[s]).astype(np.float32)
    return np.stack([regs[k] for k in range(gen.NACC)], axis=1)


@pytest.mark.parametrize("blocks", [[200], [1100], [96, 70]])
def test_loop_reference_matches_an_emulation_of_the_ptx(blocks):
    g = loop_kernel(blocks)
    rng = np.random.default_rng(1)
    x = rng.integers(-gen.X_MAX, gen.X_MAX + 1, size=(5, gen.NACC)).astype(np.float32)
    b = (3.0, 7.0)
    got = _emulate_loop(g, x, b, passes=3)
    ref = loop_reference(g, x, *b, passes=3)
    assert np.array_equal(got.astype(np.float64), ref)
    assert sum(g.params["count_b0"]) + sum(g.params["count_b1"]) == sum(blocks)


def test_counts_and_guards():
    g = loop_kernel([3000])
    nguards = g.ptx.count("@%p3 bra")
    assert nguards == (3000 - 1) // gen.GUARD_EVERY
    assert g.body_instructions == 3000 + 2 * nguards
    assert g.guarded and not loop_kernel([500]).guarded
    # guards test different registers (a repeated test could be threaded away by ptxas)
    tested = re.findall(r"setp\.gt\.f32 \t%p3, %f(\d+), %f34", g.ptx)
    assert len(set(tested)) == len(tested) == nguards
    # no neighbour depends on the previous instruction's result
    ops = ADD.findall(g.ptx)
    assert all(ops[i][0] != ops[i + 1][0] for i in range(len(ops) - 1))
    assert '.pragma "nounroll"' in g.ptx


def test_drop_last_breaks_the_kernel_but_not_the_reference():
    good, bad = loop_kernel([256]), loop_kernel([256], drop_last=1)
    assert good.params["count_b0"] == bad.params["count_b0"] and good.params["count_b1"] == bad.params["count_b1"]
    assert len(ADD.findall(bad.ptx)) == len(ADD.findall(good.ptx)) - 1
    x = np.zeros((1, gen.NACC), np.float32) + 5
    assert not np.array_equal(_emulate_loop(bad, x, (1.0, 2.0), 2).astype(np.float64),
                              loop_reference(bad, x, 1.0, 2.0, 2))


def test_probe_layout():
    g = probe_kernel(4096, 256)
    assert g.params["nseg"] == 16 and g.params["rec_words"] == 18
    assert g.ptx.count("%clock64") == 17
    assert sum(g.params["seg_sass"]) + 2 == g.body_instructions  # +2: the first stamp
    with pytest.raises(ValueError, match="multiple"):
        probe_kernel(1000, 256)


def test_stream_offsets_and_limits():
    g = stream_kernel(3)
    offs = [int(m) for m in re.findall(r"ld\.global\.nc\.v4\.f32 \t\{[^}]*\}, \[%rd9\+(\d+)\]", g.ptx)]
    assert offs == [s * 4096 + j * 512 for s in range(3) for j in range(8)]
    assert g.body_instructions == 3 * (8 + 32)
    with pytest.raises(ValueError, match="2048"):
        stream_kernel(2048)


def test_instructions_for_and_exact_range():
    assert instructions_for(16 * 1024) == 1024
    with pytest.raises(ValueError, match="1 KiB"):
        instructions_for(512)
    g = loop_kernel([4096])
    check_exact_range(g, 100)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        check_exact_range(g, 20000)


# ---------------------------------------------------------------------- assembled size
@pytest.mark.parametrize("make", [
    lambda: loop_kernel([100]), lambda: loop_kernel([2048]), lambda: loop_kernel([1500]),
    lambda: loop_kernel([300, 200]), lambda: loop_kernel([1100, 1100]),
    lambda: probe_kernel(2048, 128), lambda: stream_kernel(4), lambda: stream_kernel(40),
], ids=["loop100", "loop2048", "loop1500-guarded", "splice", "splice-guarded", "probe", "stream4",
        "stream40-guarded"])
def test_generated_kernels_assemble_to_the_intended_size(make):
    g = make()
    mod = compile_checked(g)  # raises CodeSizeError otherwise
    u = mod.usage(g.name)
    assert u.code_bytes >= g.body_bytes and u.code_bytes % 16 == 0
    assert u.spills == 0


def test_foldable_body_is_rejected():
    """Integer adds of immediates fold (r+1+2+1... = r+k): the check must refuse the kernel."""
    g = loop_kernel([2048], op="iadd_imm")
    with pytest.raises(CodeSizeError, match="folded"):
        compile_checked(g)


def test_expanding_body_is_rejected():
    """div.rn.f32 is one PTX instruction but many SASS ones: refused as expanded."""
    g = loop_kernel([256], op="fdiv")
    with pytest.raises(CodeSizeError, match="expanded"):
        compile_checked(g)


def test_check_code_size_arithmetic():
    g, cal = loop_kernel([1000]), loop_kernel([32])
    base = 1664
    want = base + g.body_bytes - cal.body_bytes
    assert check_code_size(g, want, cal, base) == 0
    assert check_code_size(g, want + 256, cal, base) == 256
    with pytest.raises(CodeSizeError, match="expanded"):
        check_code_size(g, want + 16 * 64, cal, base)
    with pytest.raises(CodeSizeError, match="folded") as e:
        check_code_size(g, want - 16 * 64, cal, base)
    assert isinstance(e.value, CompileError) and g.name in str(e.value)


def test_compile_many_dedupes_and_returns_by_name():
    gs = [loop_kernel([128]), loop_kernel([128]), loop_kernel([160])]
    mods = compile_many(gs, workers=2)
    assert set(mods) == {gs[0].name, gs[2].name}
    assert all(m.usage(n).code_bytes > 0 for n, m in mods.items())


def test_bad_arguments():
    with pytest.raises(ValueError):
        loop_kernel([1, 2, 3])
    with pytest.raises(ValueError):
        loop_kernel([100], op="fma")


def test_cache_probe_agrees_with_compile_ptx(tmp_path, monkeypatch):
    """compile_many skips the process pool for cached kernels by mirroring compile_ptx's key."""
    from microbench.compiler import compile_ptx

    monkeypatch.setenv("MEGABENCH_CACHE", str(tmp_path))
    g = loop_kernel([96], _calibrate=False)
    assert not gen._ptx_cache_hit(g.ptx, g.name, "sm_90a")
    compile_ptx(g.ptx, name=g.name, arch="sm_90a")
    assert gen._ptx_cache_hit(g.ptx, g.name, "sm_90a")


def test_compile_many_in_processes_fills_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGABENCH_CACHE", str(tmp_path))
    gs = [loop_kernel([192]), loop_kernel([224])]
    mods = compile_many(gs, workers=2)  # spawned workers assemble, the parent checks
    assert all(gen._ptx_cache_hit(g.ptx, g.name, "sm_90a") for g in gs)
    assert {n: m.usage(n).code_bytes > 0 for n, m in mods.items()} == {g.name: True for g in gs}


def test_sass_holds_every_generated_instruction():
    """Where a disassembler exists: the SASS has exactly the generated FADDs, guards and clock
    reads (the byte check's premise, 16 B per instruction, seen instruction by instruction)."""
    from microbench.sass import count_matching, find_disassembler, sass_by_kernel

    if find_disassembler() is None:
        pytest.skip("no nvdisasm/cuobjdump (set MEGABENCH_NVDISASM)")
    g = loop_kernel([1500, 700])
    insns = sass_by_kernel(compile_checked(g).cubin)[g.name]
    assert count_matching(insns, r"^FADD ") == 2200
    assert count_matching(insns, r"^FSETP") == g.ptx.count("@%p3 bra") == 2
    assert count_matching(insns, r"SR_CLOCKLO") == 5  # before the loop, 3 around the two blocks, 1 after
    s = stream_kernel(30)
    insns = sass_by_kernel(compile_checked(s).cubin)[s.name]
    assert count_matching(insns, r"^LDG\.E\.128\.CONSTANT") == 30 * 8
    assert count_matching(insns, r"^FADD ") == 30 * 32
