"""Every .cu in the repository compiles for sm_90a through NVRTC (no GPU needed), and the
resource report is parsed into typed records that agree with the cubin."""
from __future__ import annotations

import dataclasses

import pytest

from microbench.compiler import REPO_ROOT, all_cuda_sources, compile_cuda, compile_ptx, cuda_to_ptx
from microbench.cubin import parse_ptxas_log, text_sizes
from microbench.errors import CompileError, KernelDoesNotFitError

SOURCES = all_cuda_sources()


def test_sources_found():
    assert any(p.name == "harness.cu" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_cu_compiles_for_sm90a(path):
    mod = compile_cuda(path, arch="sm_90a")
    assert mod.cubin[:4] == b"\x7fELF"
    assert mod.resources, f"{path}: no kernel entries reported"
    for name, u in mod.resources.items():
        assert u.registers > 0 or u.code_bytes > 0
        assert u.code_bytes == text_sizes(mod.cubin)[name]
        assert u.code_bytes % 16 == 0  # SASS instructions are 16 bytes


SRC = r'''
extern "C" __global__ void __launch_bounds__(128, 1) spills(float* x, int n) {
  float loc[512];
  for (int i = 0; i < 512; i++) loc[i] = x[i * n + threadIdx.x];
  float s = 0; for (int i = 0; i < 512; i++) s += loc[(i * n) & 511] * loc[i];
  x[threadIdx.x] = s;
}
extern "C" __global__ void small(float* x) { __shared__ float s[64]; s[threadIdx.x] = x[threadIdx.x];
  __syncthreads(); x[threadIdx.x] = s[63 - threadIdx.x]; }
'''


def test_resource_report_fields():
    mod = compile_cuda(SRC, name="resources_probe", max_registers=32)
    small = mod.usage("small")
    assert small.static_smem_bytes == 256
    assert small.barriers == 1
    sp = mod.usage("spills")
    assert sp.stack_frame_bytes >= 512 * 4 or sp.spills > 0
    with pytest.raises(KernelDoesNotFitError, match="spills|code"):
        mod.check_limits("spills", max_spill_bytes=0, max_code_bytes=16)
    mod.check_limits("small", max_code_bytes=1 << 20)


def test_parse_ptxas_log_sample():
    log = """ptxas info    : 16 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 1024 bytes smem
"""
    got = parse_ptxas_log(log)
    assert parse_ptxas_log(log.replace(", 1024 bytes smem", ""))["k"].get("smem") is None
    stacked = log.replace("1024 bytes smem", "2048 bytes cumulative stack size, 128 bytes smem")
    assert parse_ptxas_log(stacked)["k"]["smem"] == 128
    assert got == {"k": {"stack": 8, "spill_st": 4, "spill_ld": 12, "regs": 80, "barriers": 1, "smem": 1024}}


def test_defines_change_the_cache_key_and_code():
    src = 'extern "C" __global__ void k(int* x) { x[0] = VALUE; }'
    a = compile_cuda(src, name="defprobe", defines={"VALUE": 1})
    b = compile_cuda(src, name="defprobe", defines={"VALUE": 2})
    a2 = compile_cuda(src, name="defprobe", defines={"VALUE": 1})
    assert a.key != b.key and a.key == a2.key
    assert a.path.name.startswith("defprobe-sm_90a-")
    assert a.cubin != b.cubin and a.cubin == a2.cubin


def test_cache_hit_reads_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGABENCH_CACHE", str(tmp_path))
    src = 'extern "C" __global__ void k(int* x) { x[0] = 7; }'
    a = compile_cuda(src, name="cacheprobe")
    assert a.path.is_file() and a.path.parent == tmp_path
    # corrupt the cached cubin: a hit must come from disk, so the bytes we wrote come back
    a.path.write_bytes(a.cubin)
    b = compile_cuda(src, name="cacheprobe")
    assert b.cubin == a.cubin and b.key == a.key
    # a header change in a project include dir invalidates: covered by key material
    c = compile_cuda(src, name="cacheprobe", use_cache=False)
    assert c.cubin == a.cubin


def test_compile_error_names_the_problem():
    with pytest.raises(CompileError, match="undefined_thing"):
        compile_cuda('extern "C" __global__ void k(int* x) { x[0] = undefined_thing; }', name="bad", use_cache=False)
    with pytest.raises(CompileError, match="does not exist"):
        compile_cuda(REPO_ROOT / "nope.cu")
    with pytest.raises(CompileError, match="C identifier"):
        compile_cuda("__global__ void k(){}", defines={"not valid": 1})


def test_ptx_roundtrip_through_nvjitlink():
    ptx = cuda_to_ptx('extern "C" __global__ void k(int* x) { x[threadIdx.x] = threadIdx.x; }')
    assert ".entry k" in ptx
    mod = compile_ptx(ptx, name="ptxprobe")
    assert "k" in mod.resources and mod.resources["k"].code_bytes > 0


def test_ptx_generation_writes_only_its_own_buffers():
    """NVRTC writes its log and PTX into the buffers cuda_to_ptx hands it. A source that compiles
    cleanly has an empty log (one NUL): handed the interpreter's shared one-byte b" ", NVRTC
    would write that NUL into every b" " of the process. The shared objects stay intact, and a
    failing source's log still comes back in the error."""
    one_byte = bytes(range(256))
    cuda_to_ptx('extern "C" __global__ void k(int* x) { x[threadIdx.x] = threadIdx.x; }')
    assert [i for i in range(256) if one_byte[i:i + 1][0] != i] == []
    with pytest.raises(CompileError, match="undefined"):
        cuda_to_ptx('extern "C" __global__ void k(int* x) { x[0] = undefined_thing; }')


def test_racecheck_ring_probe_compiles_for_sm90a():
    """The ring-protocol probes compute-sanitizer runs on the GPU (microbench/sanitize) build here."""
    from pathlib import Path

    import microbench.sanitize.ring_probe as rp
    from microbench.compiler import compile_cuda

    mod = compile_cuda(Path(rp.__file__).with_suffix(".cu"))
    for k in rp.KERNELS:
        u = mod.usage(k)
        assert u.spills == 0 and u.code_bytes > 0, u


def test_cache_key_covers_headers_outside_the_repository(tmp_path, monkeypatch):
    """Two kernel trees outside the repository (A/B variant copies of megakernel/csrc) with the same
    top-level source and different headers must not share a cached cubin: before 2026-12-01 only
    in-repository headers were hashed, and a variant tree outside it built as another tree's cubin."""
    monkeypatch.setenv("MEGABENCH_CACHE", str(tmp_path / "cache"))
    src = '#include "v.cuh"\nextern "C" __global__ void k(int* x) { x[threadIdx.x] = V; }\n'
    mods = []
    for v in (3, 5):
        d = tmp_path / f"tree{v}"
        d.mkdir()
        (d / "v.cuh").write_text(f"#define V {v}\n")
        mods.append(compile_cuda(src, name="tree_probe", include_dirs=[d]))
    assert mods[0].key != mods[1].key and mods[0].cubin != mods[1].cubin
    # the same tree again is a cache hit
    again = compile_cuda(src, name="tree_probe", include_dirs=[tmp_path / "tree5"])
    assert again.key == mods[1].key and again.cubin == mods[1].cubin


def test_an_empty_ptxas_report_with_lineinfo_is_taken_again_without_it(monkeypatch, tmp_path):
    # NVRTC on the H200 machine (2026-12-01) returned an empty log for sources compiled with
    # -lineinfo and -v together: every kernel looked as if it had no entries, and 103 tests failed
    # there. compile_cuda then takes the report from a compile without line info, keeps the image
    # with it, and refuses a cached entry without a report.
    from microbench import compiler

    monkeypatch.setenv("MEGABENCH_CACHE", str(tmp_path))
    real = compiler._nvrtc_cubin
    calls = []

    def lineinfo_eats_the_log(text, options, what):
        image, log = real(text, options, what)
        calls.append(bool(options.lineinfo))
        return image, ("" if options.lineinfo else log)

    monkeypatch.setattr(compiler, "_nvrtc_cubin", lineinfo_eats_the_log)
    src = REPO_ROOT / "microbench" / "clocks" / "skew.cu"
    mod = compile_cuda(src, arch="sm_90a")
    assert calls == [True, False] and "clk_skew" in mod.resources and mod.resources["clk_skew"].registers > 0
    assert compile_cuda(src, arch="sm_90a").resources == mod.resources and calls == [True, False]  # cached
    # a cache entry written without a report (as on the H200 before the fix) is compiled again
    meta = mod.path.with_suffix(".json")
    import json

    d = json.loads(meta.read_text())
    d["log"] = ""
    del d["report"]  # what the fallback found: an entry written before it has no such key
    meta.write_text(json.dumps(d))
    again = compile_cuda(src, arch="sm_90a")
    # the numbers agree; which report holds them need not (NVRTC on the H200 returned an empty log
    # for the second compile without line info too: the cubin's own attributes then gave them)
    strip = lambda rs: {k: dataclasses.replace(r, report="") for k, r in rs.items()}  # noqa: E731
    assert calls == [True, False, True, False] and strip(again.resources) == strip(mod.resources)


@pytest.mark.parametrize("src", ["microbench/clocks/skew.cu", "microbench/sync/flags.cu", "microbench/sync/barriers.cu",
                                 "microbench/weights/read.cu"])
def test_the_cubins_own_attributes_agree_with_the_ptxas_report(src):
    # the fallback where a compiler's log is empty (nvJitLink and NVRTC on the H200 machine,
    # 2026-12-01: every icache kernel then had "no kernel"): registers, stack frame, static smem and
    # code bytes from the cubin's .nv.info and section table, the same numbers as ptxas -v gives
    from microbench.cubin import resource_usage

    mod = compile_cuda(REPO_ROOT / src, arch="sm_90a")
    elf = resource_usage(mod.cubin, "")
    assert set(elf) == set(mod.resources) and mod.resources
    for k, r in mod.resources.items():
        e = elf[k]
        assert r.report == "ptxas" and e.report == "elf"
        assert (e.registers, e.stack_frame_bytes, e.code_bytes) == (r.registers, r.stack_frame_bytes, r.code_bytes), k
        if "smem" in parse_ptxas_log(mod.log)[k]:  # else the ptxas path shows the section, reserve included
            assert e.static_smem_bytes == r.static_smem_bytes, k


def test_ptx_kernels_report_their_resources_without_a_linker_log(monkeypatch, tmp_path):
    import cuda.core

    real = cuda.core.Linker

    class Quiet:  # a linker whose info log is empty, as nvJitLink's was on the H200
        def __init__(self, *a, **kw):
            self._linker = real(*a, **kw)

        def link(self, target):
            return self._linker.link(target)

        def get_info_log(self):
            return ""

    monkeypatch.setenv("MEGABENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cuda.core, "Linker", Quiet)
    ptx = cuda_to_ptx((REPO_ROOT / "microbench" / "basics" / "copy.cu").read_text())
    mod = compile_ptx(ptx, name="ptx_nolog")
    u = mod.usage("mb_copy_v4")
    assert u.report == "elf" and u.registers > 0 and u.code_bytes > 0
