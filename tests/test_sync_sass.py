"""SASS of the poll loops (CPU, when a disassembler is found; CI has none and skips): every
poll loop issues a strong load (LDG.E.STRONG.GPU / .SYS) each iteration, and the check fails
on a poll the compiler was allowed to hoist or serve from L1."""
from __future__ import annotations

import functools
import os

import pytest

from microbench.compiler import compile_cuda
from microbench.sync import sass
from microbench.sync.params import source

TOOL = sass.find_disassembler()
pytestmark = pytest.mark.skipif(TOOL is None, reason="no nvdisasm/cuobjdump (set MEGABENCH_NVDISASM to run)")

KERNELS = [("sync_pingpong_gpu_acq", "gpu"), ("sync_pingpong_gpu_rlxacq", "gpu"), ("sync_pingpong_sys_acq", "sys"),
           ("sync_pingpong_sys_rlxacq", "sys")]


@functools.lru_cache(maxsize=None)
def flags_sass(tool):
    return sass.disassemble(compile_cuda(source("flags.cu")).cubin, tool)


def check_flags_module(tool):
    d = flags_sass(tool)
    for k, scope in KERNELS:
        r = sass.check_poll_loops(d[k], k, scope)
        assert r.strong_in_every_poll_loop and r.poll_loops >= 2, r
    for k, scope in (("sync_poll_probe_gpu", "gpu"), ("sync_poll_probe_sys", "sys")):
        r = sass.check_poll_loops(d[k], k, scope, marker=None)  # its only loops are the poll
        assert r.strong_in_every_poll_loop, r
    # a gpu-scope probe has no sys-scope flag load in its loop (the pattern tells them apart)
    assert not sass.check_poll_loops(d["sync_poll_probe_gpu"], "x", "sys", marker=None).strong_in_every_poll_loop


def test_poll_loops_issue_strong_loads():
    check_flags_module(TOOL)
    reps = sass.check_sync_poll_loops(TOOL)
    assert len(reps) == 6 and all(r.strong_in_every_poll_loop for r in reps), reps


BROKEN = r'''
#include "mb/ptx.cuh"
extern "C" __global__ void weak_poll(const unsigned* flag, unsigned target, unsigned* out) {
  unsigned n = 0;
  while (*flag < target) { mb::nanosleep(32); ++n; }  // weak load: may be hoisted or hit L1 forever
  out[0] = n;
}
'''


def test_check_fails_on_a_weak_poll():
    m = compile_cuda(BROKEN, name="weak_poll_probe")
    d = sass.disassemble(m.cubin, TOOL)
    r = sass.check_poll_loops(d["weak_poll"], "weak_poll", "gpu")
    assert not r.strong_in_every_poll_loop, r


def test_both_disassembler_formats_parse_alike():
    cands = [os.path.join(os.path.dirname(TOOL), n) for n in ("cuobjdump", "nvdisasm")]
    tools = [t for t in cands if os.path.isfile(t)]
    if len(tools) < 2:
        pytest.skip("needs both cuobjdump and nvdisasm next to each other")
    a, b = (flags_sass(t) for t in tools)
    k = "sync_pingpong_gpu_acq"
    assert sass.loops(a[k]) == sass.loops(b[k]) and len(sass.loops(a[k])) >= 3
