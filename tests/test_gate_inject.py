"""The gate's injected slowdown (mb/inject.cuh): compiled out of every normal build, byte for byte,
and compiled in, with its spin and its counter, only under MB_INJECT_PPM (the compiler takes it
from $MEGABENCH_INJECT_PPM)."""
from __future__ import annotations

import pytest

from microbench.compiler import INJECT_ENV, REPO_ROOT, compile_cuda, inject_ppm
from microbench.cubin import elf_sections
from microbench.errors import CompileError

HOOK = "MB_INJECT_SCOPE();"
# every source whose kernels carry the hook, and the kernels that do
HOOKED = {
    "microbench/basics/copy.cu": ["mb_copy_v4"],
    "microbench/weights/read.cu": [f"mb_read_{k}" for k in ("nc_u2", "nc_u4", "nc_u8", "cg_u4", "cg_u8", "hint_u4")],
    "microbench/sync/flags.cu": [f"sync_pingpong_{k}" for k in ("gpu_acq", "gpu_rlxacq", "sys_acq", "sys_rlxacq")],
    "microbench/sync/publish.cu": [f"sync_pub_{m}_{s}" for m in ("fence_flag", "release_flag", "sentinel_bf16",
                                                                  "sentinel_f32") for s in ("gpu", "sys")],
    "microbench/sync/fences.cu": ["sync_fence_cost"],
    "microbench/sync/barriers.cu": ["sync_grid_wait"],
    "microbench/clocks/launch.cu": ["clk_chain"],
}


def _text(mod, kernel) -> bytes:
    _t, off, size = elf_sections(mod.cubin)[f".text.{kernel}"]
    return mod.cubin[off:off + size]


def _without_hook(path: str) -> str:
    src = (REPO_ROOT / path).read_text()
    assert HOOK in src, f"{path} lost its {HOOK}"
    return src.replace(HOOK, "")


@pytest.mark.parametrize("path", sorted(HOOKED))
def test_hook_leaves_no_code_by_default(path, monkeypatch):
    """Each hooked source's default build is the build of the same source with the hook deleted;
    with MB_INJECT_PPM its hooked kernels change (and the others do not)."""
    monkeypatch.delenv(INJECT_ENV, raising=False)
    p = REPO_ROOT / path
    name = p.stem
    default = compile_cuda(p, name=name)
    bare = compile_cuda(_without_hook(path), name=name, include_dirs=[p.parent])
    for k in default.resources:
        assert _text(default, k) == _text(bare, k), f"{path}:{k}: the empty hook changed the code"
        assert default.resources[k].registers == bare.resources[k].registers
    monkeypatch.setenv(INJECT_ENV, "50000")
    injected = compile_cuda(p, name=name)
    assert injected.defines["MB_INJECT_PPM"] == "50000" and injected.key != default.key
    for k in HOOKED[path]:
        assert _text(injected, k) != _text(default, k), f"{path}:{k}: MB_INJECT_PPM compiled nothing in"
        assert injected.resources[k].spills == 0
    for k in sorted(set(default.resources) - set(HOOKED[path])):  # kernels without the hook stay what they were
        assert _text(injected, k) == _text(default, k), f"{path}:{k} has no hook but changed"


SRC = r'''
#include "mb/types.cuh"
extern "C" __global__ void k(const float* __restrict__ x, float* __restrict__ y, int n) {
  %s
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = x[i] * 2.f + 1.f;
}
'''


def test_injected_build_has_the_counter_and_its_own_key(monkeypatch):
    monkeypatch.delenv(INJECT_ENV, raising=False)
    plain = compile_cuda(SRC % "", name="inj_probe")
    off = compile_cuda(SRC % HOOK, name="inj_probe")
    on = compile_cuda(SRC % HOOK, name="inj_probe", defines={"MB_INJECT_PPM": 20000})
    on10 = compile_cuda(SRC % HOOK, name="inj_probe", defines={"MB_INJECT_PPM": 100000})
    assert _text(off, "k") == _text(plain, "k")
    assert _text(on, "k") != _text(off, "k") and len(_text(on, "k")) > len(_text(off, "k"))
    assert _text(on10, "k") != _text(on, "k")  # the ppm is a constant of the code
    secs = elf_sections(on.cubin)
    assert any(s.startswith(".nv.global") for s in secs), "the injected build has no blocks_done counter"
    assert not any(s.startswith(".nv.global") for s in elf_sections(off.cubin))


def test_inject_env_is_checked(monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "5%")
    with pytest.raises(CompileError, match="integer number of parts per million"):
        inject_ppm()
    monkeypatch.setenv(INJECT_ENV, "2000000")
    with pytest.raises(CompileError, match="0..1000000"):
        inject_ppm()
    monkeypatch.setenv(INJECT_ENV, "")
    assert inject_ppm() == 0


@pytest.mark.slow
def test_megakernel_default_build_unchanged_by_the_hook(monkeypatch):
    """megakernel.cu's hook: the default (tiny) build's code is the build without the hook line;
    the injected build differs and does not spill."""
    from megakernel import build
    from megakernel.config import preset
    from megakernel.plan import make_plan

    monkeypatch.delenv(INJECT_ENV, raising=False)
    plan = make_plan(preset("tiny"), 132)
    default = build.build_gpu(plan)
    src = build.source(plan)
    assert src.count(HOOK) == 1
    bare = compile_cuda(src.replace(HOOK, ""), name=f"megakernel-{plan.cfg.name}", include_dirs=[build.CSRC, build.MB_INC])
    assert _text(default.module, build.KERNEL) == _text(bare, build.KERNEL)
    assert default.usage.registers == bare.usage(build.KERNEL).registers
    monkeypatch.setenv(INJECT_ENV, "50000")
    inj = build.build_gpu(plan)
    assert _text(inj.module, build.KERNEL) != _text(default.module, build.KERNEL)
    assert inj.usage.spills == 0
