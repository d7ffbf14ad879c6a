"""The profiler compiles out completely: with MB_PROFILE=0 a stamped kernel is byte-for-byte the
kernel without any profiler code; with MB_PROFILE=1 it differs and (when a disassembler exists)
reads %globaltimer. Also: every clocks kernel builds, without spills, in each benchmark variant."""
from __future__ import annotations

import pytest

from microbench.compiler import REPO_ROOT, compile_cuda
from microbench.cubin import elf_sections

SRC = r'''
#include "mb/profile.cuh"
%(events)s
extern "C" __global__ void k(const float* __restrict__ x, float* __restrict__ y, int n %(params)s) {
  %(init)s
  %(begin)s
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = x[i] * 2.f + 1.f;
  %(end)s
  %(span)s
}
'''


def _events():
    from microbench.clocks.profiler import ProfileEvents

    ev = ProfileEvents("compile_probe", prefix="CP_EV")
    ev.phase("body")
    ev.phase("tail")
    return ev


def _src(profiled: bool) -> str:
    """The same kernel with stamps (and a Span) or with no profiler code at all."""
    if not profiled:
        return SRC % dict(events="", params="", init="", begin="", end="", span="{ y[0] += 1.f; }")
    return SRC % dict(events=_events().header_text(), params=", MB_PROF_PARAMS",
                      init="mb::prof::Profiler prof(MB_PROF_ARGS);", begin="prof.stamp(CP_EV_BODY_BEGIN, n);",
                      end="prof.stamp(CP_EV_BODY_END);",
                      span="{ mb::prof::Span s(prof, CP_EV_TAIL_BEGIN, CP_EV_TAIL_END, 7u); y[0] += 1.f; }")


def _text(mod, kernel="k") -> bytes:
    _t, off, size = elf_sections(mod.cubin)[f".text.{kernel}"]
    return mod.cubin[off:off + size]


def test_disabled_profiler_is_no_code_at_all():
    free = compile_cuda(_src(False), name="prof_free")  # no profiler parameters either
    off = compile_cuda(_src(True), name="prof_off", defines={"MB_PROFILE": 0})
    on = compile_cuda(_src(True), name="prof_on", defines={"MB_PROFILE": 1})
    on64 = compile_cuda(_src(True), name="prof_on", defines={"MB_PROFILE": 1, "MB_PROF_CLOCK64": 1})
    assert _text(off) == _text(free), "MB_PROFILE=0 must leave no instruction behind"
    assert _text(on) != _text(off) and len(_text(on)) > len(_text(off))
    assert _text(on64) != _text(on)
    assert on.usage("k").spills == 0


def test_enabled_profiler_reads_the_timers_in_sass():
    from microbench.sass import count_matching, find_disassembler, sass_by_kernel

    if find_disassembler() is None:
        pytest.skip("no nvdisasm/cuobjdump (set MEGABENCH_NVDISASM)")
    off = sass_by_kernel(compile_cuda(_src(True), name="prof_off", defines={"MB_PROFILE": 0}).cubin)["k"]
    on = sass_by_kernel(compile_cuda(_src(True), name="prof_on", defines={"MB_PROFILE": 1}).cubin)["k"]
    on64 = sass_by_kernel(compile_cuda(_src(True), name="prof_on",
                                       defines={"MB_PROFILE": 1, "MB_PROF_CLOCK64": 1}).cubin)["k"]
    assert count_matching(off, "GLOBALTIMER|SR_CLOCK") == 0
    assert count_matching(on, "SR_GLOBALTIMER") == 4 and count_matching(on, "SR_CLOCKLO") == 0
    assert count_matching(on64, "SR_GLOBALTIMER") == 4 and count_matching(on64, "SR_CLOCKLO") == 4
    assert count_matching(on, r"STG\.E\.EF\.128") == 8  # two 16-byte streaming stores per stamp


VARIANTS = {
    "timers.cu": [{"MB_PROFILE": 1, "MB_PROF_CLOCK64": 1}, {"MB_PROFILE": 1, "MB_PROF_CLOCK64": 0}],
    "skew.cu": [{}],
    "launch.cu": [{"MB_PROFILE": 1, "MB_PROF_CLOCK64": 1}],
    "instr.cu": [{"INSTR_PHASES": 4, "INSTR_THREADS": 256, "MB_PROFILE": p, "INSTR_STAMP_REPEAT": r, "INSTR_BROKEN": br}
                 for p, r, br in ((0, 1, 0), (1, 1, 0), (1, 8, 0), (0, 1, 1))],
}


@pytest.mark.parametrize("name,defines", [(n, d) for n, ds in VARIANTS.items() for d in ds],
                         ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_benchmark_variants_build_without_spills(name, defines):
    mod = compile_cuda(REPO_ROOT / "microbench" / "clocks" / name, defines=defines)
    for k, u in mod.resources.items():
        assert u.spills == 0, (k, u)  # a small stack frame is the noinline watchdog report call


def test_read_cost_kernel_really_unrolls_the_reads():
    from microbench.sass import count_matching, find_disassembler, sass_by_kernel

    if find_disassembler() is None:
        pytest.skip("no nvdisasm/cuobjdump (set MEGABENCH_NVDISASM)")
    mod = compile_cuda(REPO_ROOT / "microbench" / "clocks" / "timers.cu", defines={"MB_PROFILE": 1,
                                                                                  "MB_PROF_CLOCK64": 1})
    sass = sass_by_kernel(mod.cubin)["clk_read_cost"]
    # at least CLK_READS_PER_ITER reads per mode in straight-line code (the compiler may unroll further)
    assert count_matching(sass, "SR_GLOBALTIMER") >= 2 * 32
    assert count_matching(sass, "SR_CLOCKLO") >= 2 * 32
