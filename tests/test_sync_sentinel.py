"""Sentinel encoding rules (microbench/sync/sentinel.py) over every bf16 bit pattern and the
structured fp32 classes; the generated header against the Python rules; the header's own
element functions, compiled for the host, against the same rules; the device API compiles."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from microbench.sync.sentinel import BF16, F32, HEADER, RULES, SentinelRule, render_header

CUDA_INC = HEADER.parent.parent  # microbench/cuda


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def f32_classes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    mant = np.concatenate([np.array([1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF], dtype=np.uint32),
                           rng.integers(1, 2**23, size=20000, dtype=np.uint32)])
    signs = (np.uint32(0), np.uint32(0x80000000))
    exps = np.arange(1, 255, dtype=np.uint32) << 23
    return {
        "zeros": np.array([0x00000000, 0x80000000], dtype=np.uint32),
        "infinities": np.array([0x7F800000, 0xFF800000], dtype=np.uint32),
        "nans": np.concatenate([s | np.uint32(0x7F800000) | mant for s in signs]),
        "subnormals": np.concatenate([s | mant for s in signs]),
        "normals_every_exponent": np.concatenate([s | exps | np.uint32(m) for s in signs for m in (0, 1, 0x7FFFFF)]),
        "random_bits": rng.integers(0, 2**32, size=200000, dtype=np.uint32),
        "neighbours_of_sentinel": np.array([0x7FFFFFFF, 0x80000001, 0xFFFFFFFF, 0x00000001, 0x8000FFFF, 0x80010000],
                                           dtype=np.uint32),
    }


def test_generated_header_is_current():
    assert HEADER.read_text() == render_header(), (
        "mb/sentinel_rules.cuh differs from the Python rules: run `python -m microbench.sync.sentinel --write`")


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_invariants(rule: SentinelRule):
    assert rule.encode(rule.sentinel) == rule.replacement
    assert rule.encode(rule.replacement) == rule.replacement
    assert not rule.ready(rule.sentinel) and rule.ready(rule.replacement)
    w = rule.fill_word
    assert w.bit_length() <= 32 and (w & ((1 << rule.bits) - 1)) == rule.sentinel


def test_every_bf16_pattern():
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    e = BF16.encode(x)
    assert e.dtype == np.uint16
    assert BF16.ready(e).all(), "an encoded value must never look empty"
    changed = np.nonzero(e != x)[0]
    assert changed.tolist() == [0xFFFF], "exactly the sentinel pattern is rewritten"
    assert (BF16.encode(e) == e).all(), "encoding is idempotent"
    fx, fe = bf16_to_f32(x), bf16_to_f32(e)
    nan = np.isnan(fx)
    assert nan.sum() == 2 * 127, "254 NaN patterns in bf16"
    assert np.isnan(fe[nan]).all(), "NaN stays NaN (0xFFFF becomes the canonical quiet NaN)"
    assert np.array_equal(fx[~nan], fe[~nan]) and np.array_equal(x[~nan], e[~nan]), "every non-NaN kept bit-exact"
    assert (e[nan & (x != 0xFFFF)] == x[nan & (x != 0xFFFF)]).all(), "other NaN payloads are kept"
    assert int(e[0xFFFF]) == 0x7FC0
    assert (BF16.ready(x) == (x != 0xFFFF)).all()


@pytest.mark.parametrize("cls", list(f32_classes()))
def test_fp32_classes(cls):
    x = f32_classes()[cls]
    e = F32.encode(x)
    assert e.dtype == np.uint32
    assert F32.ready(e).all()
    assert (F32.encode(e) == e).all()
    keep = x != 0x80000000
    assert np.array_equal(e[keep], x[keep]), f"{cls}: only -0.0 may change"
    assert (e[~keep] == 0).all(), "-0.0 is written as +0.0"
    fx, fe = x.view(np.float32), e.view(np.float32)
    same = np.isnan(fx) & np.isnan(fe) | (fx == fe)
    assert same.all(), f"{cls}: a value changed meaning"


def test_bad_rule_is_refused():
    with pytest.raises(ValueError, match="differ"):
        SentinelRule("x", 16, 0xFFFF, 0xFFFF, "broken")
    with pytest.raises(ValueError, match="fit"):
        SentinelRule("x", 16, 0x1FFFF, 0, "broken")


HOST_PROG = r'''
#include <cstdio>
#include "mb/sentinel.cuh"
using namespace mb::sentinel;
int main() {
  // bf16: every pattern, element rules
  for (unsigned v = 0; v < 65536; ++v) {
    unsigned short h = (unsigned short)v;
    std::printf("%u %u\n", (unsigned)bf16_encode(h), (unsigned)bf16_ready(h));
  }
  // packed words and fp32 words from stdin
  unsigned w;
  while (std::scanf("%u", &w) == 1)
    std::printf("%u %u %u %u\n", f32_encode(w), (unsigned)f32_ready(w), bf16x2_encode(w), (unsigned)bf16x2_ready(w));
  static_assert(F32::encode(F32::FILL) == F32_REPLACEMENT, "");
  return 0;
}
'''


def _host_compiler():
    return shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")


@pytest.mark.skipif(_host_compiler() is None, reason="no host C++ compiler (g++/clang++) on this machine")
def test_header_element_functions_match_python(tmp_path):
    """The header's own encode/ready code, compiled for the host, agrees with the Python rules on
    every bf16 pattern and on the fp32 classes (and as packed bf16 pairs)."""
    src = tmp_path / "t.cpp"
    src.write_text(HOST_PROG)
    exe = tmp_path / "t"
    subprocess.run([_host_compiler(), "-std=c++17", "-O1", f"-I{CUDA_INC}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    words = np.concatenate(list(f32_classes().values()))
    rng = np.random.default_rng(3)
    pairs = rng.integers(0, 2**16, size=(5000, 2), dtype=np.uint32)
    pairs[::5, 0] = 0xFFFF
    pairs[::7, 1] = 0xFFFF
    words = np.concatenate([words, pairs[:, 0] | (pairs[:, 1] << 16), np.array([0xFFFFFFFF, 0x7FC0FFFF], dtype=np.uint32)])
    out = subprocess.run([str(exe)], input="\n".join(map(str, words.tolist())), capture_output=True, text=True,
                         check=True).stdout.split("\n")
    bf = np.array([list(map(int, ln.split())) for ln in out[:65536]], dtype=np.int64)
    allh = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(bf[:, 0], BF16.encode(allh).astype(np.int64))
    assert np.array_equal(bf[:, 1], BF16.ready(allh).astype(np.int64))
    rest = np.array([list(map(int, ln.split())) for ln in out[65536:] if ln.strip()], dtype=np.int64)
    assert rest.shape == (words.size, 4)
    assert np.array_equal(rest[:, 0], F32.encode(words).astype(np.int64))
    assert np.array_equal(rest[:, 1], F32.ready(words).astype(np.int64))
    halves = words.view(np.uint16).reshape(-1, 2)
    enc2 = BF16.encode(halves).astype(np.uint32)
    assert np.array_equal(rest[:, 2], (enc2[:, 0] | (enc2[:, 1] << 16)).astype(np.int64))
    assert np.array_equal(rest[:, 3], BF16.ready(halves).all(axis=1).astype(np.int64))


DEVICE_USE = r'''
#include "mb/sentinel.cuh"
namespace sn = mb::sentinel;
template <class F, mb::Scope S> __device__ void use(uint4* slot, const uint4* src, uint4* dst, unsigned long long* wd) {
  const mb::Watchdog w{wd, 1000000ull};
  sn::put16<F, S>(slot, src[0]);
  uint4 v;
  if (sn::wait16<F, S>(w, slot, v, 1u, 32u)) dst[0] = v;
  sn::reset16<F, S>(slot);
  sn::put<F, S>(slot + 1, src, 4, threadIdx.x, blockDim.x);
  if (sn::wait<F, S>(w, slot + 1, dst + 1, 4, threadIdx.x, blockDim.x, 2u)) sn::reset<F, S>(slot + 1, 4, threadIdx.x, blockDim.x);
  sn::reuse_fence<S>();
  dst[9].x = static_cast<uint32_t>(sn::copy_offset(7, 3, 128));
}
extern "C" __global__ void k(uint4* slot, const uint4* src, uint4* dst, unsigned long long* wd) {
  use<sn::F32, mb::Scope::gpu>(slot, src, dst, wd);
  use<sn::BF16, mb::Scope::gpu>(slot, src, dst, wd);
  use<sn::F32, mb::Scope::sys>(slot, src, dst, wd);
  use<sn::BF16, mb::Scope::sys>(slot, src, dst, wd);
}
'''


def test_device_api_compiles_for_both_formats_and_scopes():
    from microbench.compiler import compile_cuda

    m = compile_cuda(DEVICE_USE, name="sentinel_api_probe")
    assert "k" in m.resources and m.resources["k"].spills == 0
