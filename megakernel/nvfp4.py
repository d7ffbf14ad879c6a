"""NVFP4: 4-bit E2M1 values, one FP8 E4M3 scale per 16 values along K, one FP32 tensor scale.

Natural storage layout (the megakernel stores expert banks rearranged: fp4_layout.py):
  codes  uint8 [N, K/2]   element k of row n is nibble (k % 2) of byte k // 2: low nibble = even k
  scales uint8 [N, K/16]  E4M3 (the "FN" variant: no infinities, S.1111.111 is NaN) bit patterns
  tensor_scale float32    multiplies everything
  value(n, k) = e2m1(code) * e4m3(scale[n, k // 16]) * tensor_scale

Numerics contract shared with the kernels: e2m1 * e4m3 is exact in bf16 (<= 2 + 4 significant
bits), so the kernels dequantise to bf16 without rounding and apply the tensor scale to the fp32
accumulator. `dequant_bf16_exact` returns exactly those bf16-exact values.

Quantisation refuses NaN/Inf (QuantizationError) and saturates finite values that exceed what a
block's rounded scale can express to +-6 (documented; counted in `QuantStats.saturated`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from microbench.errors import MegabenchError

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude codes 0..7; bit 3 is the sign
E2M1_MAX = 6.0
E4M3_MAX = 448.0


class QuantizationError(MegabenchError, ValueError):
    pass


def e2m1_table() -> torch.Tensor:
    """float32 value of each of the 16 codes."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3FN bit patterns -> float32 (NaN for S.1111.111)."""
    b = bits.to(torch.int32)
    s = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = torch.ldexp(1.0 + m.float() / 8.0, (e - 7).float())
    sub = torch.ldexp(m.float() / 8.0, torch.full_like(e, -6).float())
    v = torch.where(e == 0, sub, normal)
    v = torch.where((e == 0xF) & (m == 0x7), torch.full_like(v, float("nan")), v)
    return torch.where(s == 1, -v, v)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3FN bits, round-to-nearest-even, saturating at +-448 (NaN/Inf refused)."""
    x = x.float()
    if not torch.isfinite(x).all():
        raise QuantizationError("e4m3_encode: NaN or Inf in input")
    # exhaustive nearest search over the 254 finite codes: tiny tables, exact tie handling
    codes = torch.arange(256, dtype=torch.int32)
    vals = e4m3_decode(codes.to(torch.uint8))
    finite = torch.isfinite(vals)
    codes, vals = codes[finite], vals[finite]
    xs = x.clamp(-E4M3_MAX, E4M3_MAX).reshape(-1, 1)
    d = (xs - vals.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    # tie: even mantissa (lowest bit 0) wins; -0 vs +0 resolved by the sign of x
    even = (codes & 1) == 0
    sign_ok = ((codes >> 7) & 1) == (xs < 0).to(torch.int32)
    score = cand.to(torch.int32) * 4 + (cand & even).to(torch.int32) * 2 + (cand & sign_ok).to(torch.int32)
    idx = score.argmax(dim=1)
    return codes[idx].to(torch.uint8).reshape(x.shape)


@dataclass(frozen=True)
class NVFP4Tensor:
    codes: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # uint8 [N, K/16]
    tensor_scale: float
    shape: tuple[int, int]  # logical (N, K)

    def __post_init__(self):
        n, k = self.shape
        if k % BLOCK:
            raise QuantizationError(f"NVFP4 needs K divisible by {BLOCK}, got K={k}")
        if tuple(self.codes.shape) != (n, k // 2) or self.codes.dtype != torch.uint8:
            raise QuantizationError(f"codes must be uint8 [{n}, {k // 2}], got {self.codes.dtype} "
                                    f"{tuple(self.codes.shape)}")
        if tuple(self.scales.shape) != (n, k // BLOCK) or self.scales.dtype != torch.uint8:
            raise QuantizationError(f"scales must be uint8 [{n}, {k // BLOCK}], got {self.scales.dtype} "
                                    f"{tuple(self.scales.shape)}")

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + 4

    def unpack_codes(self) -> torch.Tensor:
        """uint8 [N, K] of 4-bit codes (low nibble first)."""
        lo = self.codes & 0xF
        hi = self.codes >> 4
        return torch.stack([lo, hi], dim=-1).reshape(self.shape)

    def dequant_bf16_exact(self) -> torch.Tensor:
        """float32 [N, K] of e2m1 * e4m3 (exactly representable in bf16), tensor scale NOT applied."""
        vals = e2m1_table().to(self.codes.device)[self.unpack_codes().long()]
        sc = e4m3_decode(self.scales).repeat_interleave(BLOCK, dim=1)
        return vals * sc

    def dequantize(self) -> torch.Tensor:
        return self.dequant_bf16_exact() * self.tensor_scale

    def to(self, device) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes.to(device), self.scales.to(device), self.tensor_scale, self.shape)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] 4-bit codes -> uint8 [N, K/2] (low nibble = even k)."""
    if codes.shape[-1] % 2:
        raise QuantizationError("pack_codes: K must be even")
    if (codes > 15).any():
        raise QuantizationError("pack_codes: codes must be 4-bit (0..15)")
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def e2m1_encode(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """float32 -> 4-bit codes, round-to-nearest-even on the E2M1 grid, saturating at +-6.
    Returns (codes uint8, number of saturated elements)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    a = x.abs().reshape(-1, 1)
    d = (a - mags.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    even = (torch.arange(8, device=x.device) & 1) == 0  # code's mantissa bit is its lowest bit
    idx = (cand.to(torch.int32) * 2 + (cand & even).to(torch.int32)).argmax(dim=1).reshape(x.shape)
    saturated = int((x.abs() > E2M1_MAX).sum())
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3  # no negative zero code produced
    return (idx.to(torch.uint8) | sign), saturated


@dataclass(frozen=True)
class QuantStats:
    saturated: int
    max_abs_error: float


def quantize(w: torch.Tensor) -> tuple[NVFP4Tensor, QuantStats]:
    """Quantise float [N, K] to NVFP4 (tensor scale = amax / (6 * 448), block scales rounded
    to E4M3). NaN/Inf raise QuantizationError; an all-zero tensor gets tensor scale 1."""
    if w.dim() != 2:
        raise QuantizationError(f"quantize expects [N, K], got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise QuantizationError(f"quantize: non-finite value at {bad}; refusing (NVFP4 has no NaN/Inf)")
    n, k = w.shape
    if k % BLOCK:
        raise QuantizationError(f"quantize: K={k} not divisible by {BLOCK}")
    amax = float(w.abs().max())
    ts = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    sc_bits = e4m3_encode(bmax / (E2M1_MAX * ts))
    sc = e4m3_decode(sc_bits)
    sc = torch.where(sc > 0, sc, torch.ones_like(sc))  # an all-zero block: any scale; codes are 0
    codes, sat = e2m1_encode((blocks / (sc.unsqueeze(-1) * ts)).reshape(n, k))
    t = NVFP4Tensor(pack_codes(codes), sc_bits, float(ts), (n, k))
    err = float((t.dequantize() - w).abs().max()) if w.numel() else 0.0
    return t, QuantStats(sat, err)


def random_nvfp4(n: int, k: int, target_std: float, generator: torch.Generator, device="cpu",
                 scale_log2_range: tuple[int, int] = (-2, 2)) -> NVFP4Tensor:
    """Random NVFP4 weights straight from the bit level (uniform codes, block scales 2^U(range)
    times random E4M3 mantissas), with the tensor scale chosen so the values' RMS is target_std."""
    lo, hi = scale_log2_range
    if not -6 <= lo <= hi <= 8:
        raise QuantizationError(f"scale exponent range {scale_log2_range} outside E4M3's normal range")
    codes = torch.randint(0, 256, (n, k // 2), generator=generator, device=device, dtype=torch.uint8)
    e = torch.randint(lo + 7, hi + 8, (n, k // BLOCK), generator=generator, device=device, dtype=torch.int32)
    m = torch.randint(0, 8, (n, k // BLOCK), generator=generator, device=device, dtype=torch.int32)
    scales = ((e << 3) | m).to(torch.uint8)  # biased exponent 1..15 and never S.1111.111 (NaN)
    # RMS of the values: E[e2m1^2] over uniform codes times E[scale^2] over the drawn distribution
    e2 = float(np.mean(np.square(E2M1_VALUES)))
    s2 = float(np.mean([4.0 ** x for x in range(lo, hi + 1)]) * np.mean([(1 + j / 8) ** 2 for j in range(8)]))
    ts = target_std / (e2 * s2) ** 0.5
    return NVFP4Tensor(codes, scales, float(ts), (n, k))
