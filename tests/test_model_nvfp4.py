"""NVFP4 (megakernel/nvfp4.py) against decoders written here from the bit layout alone:
every E2M1 code, every E4M3 bit pattern, packing, round trips, rounding ties, error bounds,
saturation (documented and counted) and refusal of NaN/Inf."""
from __future__ import annotations

import math

import pytest
import torch

from megakernel import nvfp4
from megakernel.nvfp4 import NVFP4Tensor, QuantizationError


# ---------------------------------------------------------------------- independent decoders
def e2m1_ref(c: int, bias: int = 1) -> float:
    """E2M1: sign bit 3, exponent bits 2..1, mantissa bit 0; exponent bias 1, no inf/nan."""
    s, e, m = (c >> 3) & 1, (c >> 1) & 3, c & 1
    mag = m * 2.0 ** (1 - bias - 1) if e == 0 else (1 + m / 2) * 2.0 ** (e - bias)
    return -mag if s else mag


def e4m3_ref(b: int, bias: int = 7) -> float:
    """E4M3FN: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; S.1111.111 is NaN,
    no infinities; exponent 0 is subnormal (m/8 * 2^(1-bias))."""
    s, e, m = (b >> 7) & 1, (b >> 3) & 0xF, b & 7
    if e == 0xF and m == 7:
        return math.nan
    mag = (m / 8) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias)
    return -mag if s else mag


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))
               for x, y in zip(a, b, strict=True))


def test_every_e2m1_code_matches_the_bit_formula():
    got = nvfp4.e2m1_table().tolist()
    want = [e2m1_ref(c) for c in range(16)]
    assert _same(got, want), (got, want)
    assert want[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # through the tensor path too: all 16 codes, block scale 1.0 (E4M3 0x38), tensor scale 1
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    t = NVFP4Tensor(nvfp4.pack_codes(codes), torch.full((1, 1), 0x38, dtype=torch.uint8), 1.0, (1, 16))
    assert _same(t.dequant_bf16_exact()[0].tolist(), want)


def test_every_e4m3_pattern_matches_the_bit_formula():
    pats = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = nvfp4.e4m3_decode(pats).tolist()
    want = [e4m3_ref(b) for b in range(256)]
    assert _same(got, want)
    assert [b for b in range(256) if math.isnan(want[b])] == [0x7F, 0xFF]
    assert want[0x7E] == 448.0 and want[0x01] == 2.0 ** -9 and want[0x08] == 2.0 ** -6
    if hasattr(torch, "float8_e4m3fn"):  # a third opinion: torch's own fp8 dtype
        assert _same(pats.view(torch.float8_e4m3fn).float().tolist(), want)


def test_the_decoder_comparison_can_fail():
    """A decoder with the wrong bias, or a table with one wrong entry, is caught."""
    assert not _same(nvfp4.e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8)).tolist(),
                     [e4m3_ref(b, bias=8) for b in range(256)])
    bad = nvfp4.e2m1_table().tolist()
    bad[5] = 2.5
    assert not _same(bad, [e2m1_ref(c) for c in range(16)])
    assert not _same([0.0], [-0.0])  # the sign of zero counts


def test_e4m3_products_with_e2m1_are_exact_in_bf16():
    """The numerics contract: e2m1 x e4m3 needs no rounding in bf16."""
    e2 = nvfp4.e2m1_table()
    e4 = nvfp4.e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    e4 = e4[torch.isfinite(e4)]
    prod = (e2[:, None].double() * e4[None, :].double())
    assert torch.equal(prod.to(torch.bfloat16).double(), prod)


def test_pack_layout_and_round_trip():
    assert nvfp4.pack_codes(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)).tolist() == [[0x21, 0x43]]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (24, 64), generator=g, dtype=torch.uint8)
    t = NVFP4Tensor(nvfp4.pack_codes(codes), torch.zeros(24, 4, dtype=torch.uint8), 1.0, (24, 64))
    assert torch.equal(t.unpack_codes(), codes)
    swapped = torch.stack([codes[:, 1::2], codes[:, 0::2]], -1).reshape(24, 64)  # nibble order swapped
    assert not torch.equal(NVFP4Tensor(nvfp4.pack_codes(swapped), t.scales, 1.0, (24, 64)).unpack_codes(), codes)


def test_pack_and_tensor_refuse_bad_input():
    with pytest.raises(QuantizationError, match="4-bit"):
        nvfp4.pack_codes(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(QuantizationError, match="even"):
        nvfp4.pack_codes(torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(QuantizationError, match="divisible by 16"):
        NVFP4Tensor(torch.zeros(1, 4, dtype=torch.uint8), torch.zeros(1, 0, dtype=torch.uint8), 1.0, (1, 8))
    with pytest.raises(QuantizationError, match="codes must be uint8"):
        NVFP4Tensor(torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.uint8), 1.0, (1, 16))
    with pytest.raises(QuantizationError, match="scales must be uint8"):
        NVFP4Tensor(torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.uint8), 1.0, (1, 16))


def test_e4m3_encode_round_trips_every_finite_pattern_and_rounds_ties_to_even():
    pats = [b for b in range(256) if b not in (0x7F, 0xFF, 0x80)]  # NaNs; -0 encodes as +0 (documented)
    vals = torch.tensor([e4m3_ref(b) for b in pats])
    assert nvfp4.e4m3_encode(vals).tolist() == pats
    assert nvfp4.e4m3_encode(torch.tensor([-0.0])).tolist() == [0x00]
    ties = torch.tensor([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 464.0 - 1e-3])
    # 1.0625: 1.0 (even) vs 1.125 -> 1.0; 1.1875: 1.125 vs 1.25 (even) -> 1.25; 2^-10: 0 vs 2^-9 -> 0;
    # 3*2^-10: 2^-9 (odd) vs 2^-8 (even) -> 2^-8; just under 464 -> 448
    assert nvfp4.e4m3_encode(ties).tolist() == [0x38, 0x3A, 0x00, 0x02, 0x7E]


def test_e4m3_encode_saturates_and_refuses_nan_inf():
    assert nvfp4.e4m3_encode(torch.tensor([1000.0, -1e30])).tolist() == [0x7E, 0xFE]  # +-448, documented
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(QuantizationError, match="NaN or Inf"):
            nvfp4.e4m3_encode(torch.tensor([1.0, bad]))


def test_e2m1_encode_ties_to_even_and_counts_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.3, 2.9])
    codes, sat = nvfp4.e2m1_encode(x)
    want_vals = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0, 0.5, 3.0]
    assert [e2m1_ref(int(c)) for c in codes] == want_vals and sat == 0
    assert int(codes[7]) == 0  # -0.25 rounds to +0: no negative-zero code is produced
    codes, sat = nvfp4.e2m1_encode(torch.tensor([6.0, 6.5, -100.0, 3.0]))
    assert [e2m1_ref(int(c)) for c in codes] == [6.0, 6.0, -6.0, 3.0] and sat == 2


def _representable(n_blocks: int, g) -> torch.Tensor:
    """A [2, 16*n_blocks] tensor that NVFP4 can hold exactly with tensor scale 2^-10: every block
    contains +-6 x its scale, one block has scale 448 (so amax / (6*448) recovers the tensor scale)."""
    codes = torch.randint(0, 16, (2, 16 * n_blocks), generator=g)
    codes[codes == 8] = 0  # -0 would come back as +0
    codes[:, ::16] = 7  # +6 in every block
    sc_bits = torch.randint(0x08, 0x7E, (2, n_blocks), generator=g)  # normal scales below 448
    sc_bits[0, 0] = 0x7E
    vals = torch.tensor([e2m1_ref(int(c)) for c in codes.flatten()]).reshape(codes.shape)
    sc = torch.tensor([e4m3_ref(int(b)) for b in sc_bits.flatten()]).reshape(sc_bits.shape)
    ts = 2.0 ** -10
    return (vals * sc.repeat_interleave(16, dim=1) * ts).float(), codes.to(torch.uint8), sc_bits.to(torch.uint8), ts


def test_quantize_round_trips_representable_tensors_exactly():
    g = torch.Generator().manual_seed(1)
    w, codes, sc_bits, ts = _representable(6, g)
    t, st = nvfp4.quantize(w)
    assert t.tensor_scale == ts and st.saturated == 0 and st.max_abs_error == 0.0
    assert torch.equal(t.scales, sc_bits)
    assert torch.equal(t.unpack_codes(), codes)
    assert torch.equal(t.dequantize(), w)


def test_quantize_error_bound_on_gaussian_data():
    """|error| <= (1 + 2^-4) * block max / 6 per element (half an E2M1 step at the top of the grid,
    scaled by the block scale's own rounding), and the RMS error is small."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    t, st = nvfp4.quantize(w)
    err = (t.dequantize() - w).abs()
    bmax = w.abs().reshape(64, 16, 16).amax(-1).repeat_interleave(16, dim=1)
    assert bool((err <= (1 + 2 ** -4) * bmax / 6 + 1e-12).all())
    assert float(err.pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) < 0.12
    assert st.max_abs_error == pytest.approx(float(err.max()))


def test_quantize_saturation_is_counted():
    """Block 1's scale 6.375/6 = 1.0625 ties between E4M3 1.0 and 1.125 and rounds to even (1.0):
    its 6.375 then exceeds the E2M1 grid and saturates to 6 (documented), counted once."""
    w = torch.zeros(1, 32)
    w[0, 0] = 2688.0  # block 0: amax -> tensor scale 2688 / (6 * 448) = 1
    w[0, 16] = 6.375
    w[0, 17] = 1.0
    t, st = nvfp4.quantize(w)
    assert t.tensor_scale == 1.0 and t.scales[0, 1].item() == 0x38
    assert st.saturated == 1
    assert float(t.dequantize()[0, 16]) == 6.0 and st.max_abs_error == pytest.approx(0.375)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_refuses_nan_and_inf_naming_the_position(bad):
    w = torch.ones(2, 16)
    w[1, 5] = bad
    with pytest.raises(QuantizationError, match=r"non-finite value at \[1, 5\]"):
        nvfp4.quantize(w)


def test_quantize_refuses_bad_shapes():
    with pytest.raises(QuantizationError, match="not divisible by 16"):
        nvfp4.quantize(torch.ones(2, 24))
    with pytest.raises(QuantizationError, match=r"expects \[N, K\]"):
        nvfp4.quantize(torch.ones(16))


def test_random_nvfp4_hits_its_rms_and_never_draws_nan_scales():
    g = torch.Generator().manual_seed(3)
    t = nvfp4.random_nvfp4(256, 512, 0.02, g)
    v = t.dequantize()
    assert abs(float(v.pow(2).mean().sqrt()) / 0.02 - 1) < 0.05
    assert not bool(((t.scales & 0x7F) == 0x7F).any())
    assert torch.isfinite(v).all()
    with pytest.raises(QuantizationError, match="normal range"):
        nvfp4.random_nvfp4(16, 16, 1.0, g, scale_log2_range=(-7, 0))
