"""The megakernel's NVFP4 storage (fp4_layout): a value-preserving rearrangement of nvfp4's
natural layout, decoded by the kernel's shift-and-mask pairs."""
import itertools

import pytest
import torch

from megakernel import fp4_layout as L
from megakernel.nvfp4 import NVFP4Tensor, QuantizationError, e2m1_table, e4m3_decode, random_nvfp4


def _rand_codes(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def test_kernel_words_round_trip_and_keep_bytes():
    c = _rand_codes((5, 64))
    k = L.to_kernel_words(c)
    assert k.shape == c.shape and k.dtype == torch.uint8
    assert not torch.equal(k, c)
    assert torch.equal(L.from_kernel_words(k), c)


def test_kernel_decode_gives_each_pair_exactly():
    """The kernel's decode (PAIRS) of every kernel word gives, per pair e, the bf16x2 bit patterns
    of values (k+e, k+e+4) * 2^-126 with the magnitude at bits 8..6 and the sign at 15."""
    nat = _rand_codes((4096, 4), seed=1)
    words = L._words(L.to_kernel_words(nat))
    pairs = L.decode_pairs(words)  # [4096, 1, 4]
    nw = L._words(nat)
    for e in range(4):
        lo, hi = (nw >> (4 * e)) & 0xF, (nw >> (4 * (e + 4))) & 0xF
        want = lambda c: ((c & 7) << 6) | ((c >> 3) << 15)  # noqa: E731
        assert torch.equal(pairs[..., e], want(lo) | (want(hi) << 16))
    # and those bit patterns are the E2M1 values * 2^-126 as bf16
    bits = (pairs[..., 0] & 0xFFFF).to(torch.int32)
    as_f = (bits << 16).view(torch.float32)
    assert torch.equal(as_f, e2m1_table()[(nw & 0xF)] * 2.0 ** -126)


def test_half_word_table_decodes_kernel_words_in_k_order():
    nat = _rand_codes((64, 32), seed=2)
    t = NVFP4Tensor(nat, torch.full((64, 4), 0x38, dtype=torch.uint8), 1.0, (64, 64))
    lut = L.half_word_table("cpu", torch.float32)
    half = L.to_kernel_words(nat).view(torch.uint16).reshape(-1).to(torch.int32)
    got = lut.index_select(0, half).view(64, 64)
    assert torch.equal(got, e2m1_table()[t.unpack_codes().long()])


def test_canonical_scales_keep_every_value():
    g = torch.Generator().manual_seed(3)
    t = random_nvfp4(16, 128, 1.0, g)
    sc = t.scales.clone()
    sc[0, :4] = torch.tensor([0x00, 0x80, 0x80 | 0x3A, 0x81], dtype=torch.uint8)  # +0, -0, negative normal, negative subnormal
    sc[1, 0] = 0x01  # positive subnormal stays as it is
    bad = NVFP4Tensor(t.codes, sc, t.tensor_scale, t.shape)
    c, s = L.canonical_scales(bad.codes, bad.scales)
    assert L.is_canonical(s) and not L.is_canonical(sc)
    assert s[1, 0] == 0x01 and s[0, 0] == L.CANONICAL_ZERO_SCALE
    assert torch.equal(NVFP4Tensor(c, s, t.tensor_scale, t.shape).dequant_bf16_exact(), bad.dequant_bf16_exact())


def test_canonical_scales_refuse_nan_and_mismatched_shapes():
    c = _rand_codes((2, 8))
    with pytest.raises(QuantizationError, match="NaN"):
        L.canonical_scales(c, torch.tensor([[0x7F], [0x38]], dtype=torch.uint8))
    with pytest.raises(QuantizationError, match="same blocks"):
        L.canonical_scales(c, torch.full((2, 2), 0x38, dtype=torch.uint8))
    with pytest.raises(QuantizationError, match="K % 8"):
        L.to_kernel_words(_rand_codes((2, 6)))


@pytest.mark.parametrize("x", [119, -117])
def test_scale_conversion_integer_steps_are_exact_on_canonical_scales(x):
    """arch.cuh ue4m3x2_to_bf16x2_scaled: f16 bits >> 3 + (112 + X) << 7 is the bf16 of value * 2^X
    for every positive nonzero finite E4M3 (the f16 bits from torch's exact conversion)."""
    b = torch.arange(1, 127, dtype=torch.int32).to(torch.uint8)
    v = e4m3_decode(b)
    h = v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    got = (h >> 3) + ((112 + x) << 7)
    want = (v.double() * 2.0 ** x).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(got, want)
    assert torch.equal((v.double() * 2.0 ** x).to(torch.bfloat16).double(), v.double() * 2.0 ** x)  # exact


def test_header_renders_the_pairs_as_rotations():
    h = L.render_header()  # storage words: the right shift by 7 is a rotation by 25
    assert "FP4_PAIRS[4][2]" in h and "{25, 0x01C001C0u}" in h and "storage word" in h
    d = L.render_header(rotated=True)
    assert "device word" in d and "{12, 0x81C081C0u}" in d and "{26, 0x01000100u}" in d


def test_device_words_decode_to_the_same_pairs_and_cross_half_words():
    """to_rotated_words keeps every value: the kernel's decode of the device words (ROT_PAIRS)
    gives the same bf16x2 pairs as that of the storage words, in passes or in place."""
    nat = _rand_codes((300, 64), seed=4)
    k = L.to_kernel_words(nat)
    d = L.to_rotated_words(k, rows_per_pass=7)  # passes that do not divide the rows
    assert d.shape == k.shape and not torch.equal(d, k)
    assert torch.equal(L.decode_pairs(L._words(d), rotated=True), L.decode_pairs(L._words(k)))
    kk = k.clone()
    assert L.to_rotated_words(kk, in_place=True) is kk and torch.equal(kk, d)
    # the device words are not self-contained per half-word (why the baselines keep the storage)
    assert any(nat_bit // 16 != dev_bit // 16 for nat_bit, dev_bit in L.ROT_BIT_MAP)
    with pytest.raises(QuantizationError, match="contiguous"):
        L.to_rotated_words(k.t(), in_place=True)


def test_device_words_take_fewer_terms_than_the_storage_words():
    """9 SASS per word: 4 single-term pairs need 4 rotations that tile the word, which none do,
    so the best is 5 terms with 4 nonzero rotations (the storage words: 6 terms, 5 shifts)."""
    n_terms = sum(len(t) for t in L.ROT_PAIRS)
    rotations = {r for t in L.ROT_PAIRS for r, _ in t if r}
    assert (n_terms, len(rotations)) == (5, 4)
    S = [t for t in range(32) if (L.PAIR_BITS >> t) & 1]
    tiles = [R for R in itertools.combinations(range(32), 4)
             if len({(t - r) % 32 for r in R for t in S}) == 32]
    assert tiles == []


def test_swizzle_refusals():
    c = torch.zeros(2, 8, 64, dtype=torch.uint8)
    assert torch.equal(L.swizzle_units(c, 1), c)
    for bad in (0, 3, 8):  # not a power of two, or not dividing the row's 4 units
        with pytest.raises(QuantizationError, match="width"):
            L.swizzle_units(c, bad)
    with pytest.raises(QuantizationError, match="16-byte units"):
        L.swizzle_units(torch.zeros(2, 8, 24, dtype=torch.uint8), 2)


def test_scale_planes_put_each_k16_half_of_a_run_of_steps_together():
    """scale_planes: byte 2s + h of a run of 8 steps (step s, k16 half h) moves to 8h + s, so
    gemm_fp4 finds the scales thread t uses (half t >> 1) side by side, steps 2m and 2m + 1 in one
    half-word."""
    sc = _rand_codes((3, 5, 32), seed=5)  # rows of 2 runs
    pl = L.scale_planes(sc, 8)
    for u in range(2):
        for s_ in range(8):
            for h in range(2):
                assert torch.equal(pl[..., 16 * u + 8 * h + s_], sc[..., 16 * u + 2 * s_ + h])
    with pytest.raises(QuantizationError, match="whole runs of 8 steps"):
        L.scale_planes(_rand_codes((2, 8)), 8)
