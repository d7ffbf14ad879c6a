"""How the megakernel stores NVFP4 expert weights: the same bytes as nvfp4's natural layout, with
the 8 codes of every 32-bit word rearranged and the block scales made positive.

Why. The expert GEMMs feed mma.m16n8k16 with bf16 pairs (value k+e, value k+e+4), e = 0..3, of each
word of 8 codes k..k+7 (gemm.cuh). A pair is exact in bf16 with its 3 magnitude bits at bf16 bits
8..6 of each half and its sign at bit 15 (value * 2^-126; the activations carry the 2^126). From the
natural word (nibble j = code k+j) that took 5 integer operations per pair; in this word a pair is
one or two shifted copies of the word under a mask (`PAIRS`): 15 operations for the 4 pairs instead
of 20 (nvcc fuses them into 11 SASS instructions per word on sm_90a).

The word. Pair e's bits come from `PAIRS[e]`: terms (shift, mask), shift > 0 left, < 0 right,
OR-ed. Every source bit of value k+e (k+e+4) lies in the low (high) 16 bits, so each half-word holds
4 whole codes, k..k+3 and k+4..k+7 in order: a 65536-entry table decodes a half-word
(`half_word_table`, the torch baselines' dequantisation). Searched exhaustively: with half-words
self-contained, no arrangement needs fewer than 15 operations.

Device words (`ROT_PAIRS`, Plan.fp4_rotated). The kernel's own copy of the codes (tiling.tile_fp4_codes)
may use a second arrangement in which a pair's bits may come from either half-word: pair e is the
word rotated left by r under a mask, OR-ed over terms (rotation, mask). Three pairs are one term
each (rotations 0, 6 and 12) and the fourth two (2 and 26 = a right shift by 6): 4 shifts and 5
logic operations, 9 SASS per word instead of 10 (sm_90a, nvcc 13.0), and of the shifts only the
rotation by 12 wraps, so the others can run as IMAD on the FMA pipe, off the ALU pipe that the
logic operations fill. No arrangement needs fewer: a single-term pair needs its own rotation, and
4 rotations of the 8 pair bits cannot tile the word (an exhaustive search; 5 terms need 5
rotations, one of which wraps). Half-words are not self-contained, so the table decode of the torch
baselines does not apply: they keep reading the storage words.

Scales. The kernel converts a pair of E4M3 scales with cvt.rn.f16x2.e4m3x2 and one integer add
(f16 bits >> 3 + a constant = bf16 bits of value * 2^X), which is right for positive, nonzero
scales only. `canonical_scales` makes every block so without changing a value: a negative scale
flips the signs of its 16 codes, a zero scale gets scale 1.0 and zero codes; NaN is refused.
"""
from __future__ import annotations

import torch

from .nvfp4 import BLOCK, QuantizationError, e2m1_table

_NIBBLE_TARGET = (6, 7, 8, 15)  # E2M1 bit b (m, e0, e1, sign) -> bf16 bit in the half
# bf16 bits of a pair, in both halves: the 3 magnitude bits at 8..6 and the sign at 15
MAG_BITS = sum(1 << (t + 16 * h) for t in _NIBBLE_TARGET[:3] for h in (0, 1))  # 0x01C001C0
SIGN_BITS = sum(1 << (_NIBBLE_TARGET[3] + 16 * h) for h in (0, 1))  # 0x80008000
PAIR_BITS = MAG_BITS | SIGN_BITS
PAIRS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((6, PAIR_BITS),),
    ((3, PAIR_BITS),),
    ((0, MAG_BITS), (4, SIGN_BITS)),
    ((5, SIGN_BITS), (-7, MAG_BITS)),
)
# The device words: terms (rotation left, mask); see the module docstring
ROT_PAIRS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, PAIR_BITS),),
    ((6, PAIR_BITS),),
    ((12, PAIR_BITS),),
    ((2, PAIR_BITS & ~0x01000100), (26, 0x01000100)),
)
CANONICAL_ZERO_SCALE = 0x38  # E4M3 1.0: the scale of a block of zeros


def _rotations(pairs) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Terms as (rotation left, mask): a shift s under its mask moves the same bits as a rotation
    by s mod 32 (the masks keep only bits that do not wrap)."""
    return tuple(tuple((s % 32, m) for s, m in terms) for terms in pairs)


def _bit_map(pairs) -> list[tuple[int, int]]:
    """(natural bit, word bit) for all 32 bits of a word, from pairs of (rotation, mask) terms."""
    out = []
    for e, terms in enumerate(pairs):
        covered = 0
        for _, m in terms:
            assert not covered & m, "terms of a pair overlap"
            covered |= m
        assert covered == PAIR_BITS, "a pair's terms must give exactly its 8 bits"
        for h in (0, 1):  # value k+e (low half of the pair) and k+e+4 (high half)
            for b, t in enumerate(_NIBBLE_TARGET):
                tgt = t + 16 * h
                (r,) = [r for r, m in terms if (m >> tgt) & 1]
                out.append((4 * (e + 4 * h) + b, (tgt - r) % 32))
    nat, ker = zip(*out)
    assert sorted(nat) == sorted(ker) == list(range(32)), "pairs must move every bit exactly once"
    return out


def _pairs(rotated: bool):
    """The terms the kernel decodes, as (rotation, mask): the device words or the storage words."""
    return ROT_PAIRS if rotated else _rotations(PAIRS)


BIT_MAP = _bit_map(_pairs(False))  # storage words
ROT_BIT_MAP = _bit_map(ROT_PAIRS)  # device words
# the storage words' half-words decode on their own (half_word_table)
assert all(nat // 16 == ker // 16 for nat, ker in BIT_MAP), "a value's bits stay in its half-word"


def _move(words: torch.Tensor, pairs) -> torch.Tensor:
    """Move bit a of each int64 word to bit b for (a, b) in pairs, grouped by distance."""
    by_delta: dict[int, int] = {}
    for a, b in pairs:
        by_delta[b - a] = by_delta.get(b - a, 0) | (1 << a)
    out = torch.zeros_like(words)
    for d, mask in by_delta.items():
        m = words & mask
        out |= (m << d) if d >= 0 else (m >> -d)
    return out


def _words(codes: torch.Tensor) -> torch.Tensor:
    if codes.dtype != torch.uint8 or codes.shape[-1] % 4:
        raise QuantizationError(f"fp4 words: codes must be uint8 [..., K/2] with K % 8 == 0, got "
                                f"{codes.dtype} {tuple(codes.shape)}")
    return codes.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _bytes(words: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    w = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return w.view(torch.uint8).reshape(like.shape)


def to_kernel_words(codes: torch.Tensor) -> torch.Tensor:
    """Natural packed codes uint8 [..., K/2] -> the kernel's word layout (same shape and bytes)."""
    return _bytes(_move(_words(codes), BIT_MAP), codes)


def from_kernel_words(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of to_kernel_words."""
    return _bytes(_move(_words(codes), [(b, a) for a, b in BIT_MAP]), codes)


# storage bit -> device bit, for to_rotated_words
_STORAGE_TO_DEVICE = [(dict(BIT_MAP)[nat], dev) for nat, dev in ROT_BIT_MAP]


def to_rotated_words(codes: torch.Tensor, *, in_place: bool = False, rows_per_pass: int = 1 << 14) -> torch.Tensor:
    """Storage words (to_kernel_words) uint8 [..., N, K/2] -> the device words (ROT_PAIRS): a new
    tensor, or `codes` itself rewritten (in_place; a contiguous copy the caller owns, as
    tiling.tile_fp4_codes': another full copy of a shard8 bank would not fit beside it). Converted in
    passes of `rows_per_pass` rows: the int64 words of a whole bank would take 8x its bytes."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 4:
        raise QuantizationError(f"fp4 words: codes must be uint8 [..., K/2] with K % 8 == 0, got "
                                f"{codes.dtype} {tuple(codes.shape)}")
    if in_place and not codes.is_contiguous():
        raise QuantizationError("to_rotated_words in place: codes must be contiguous")
    flat = codes.reshape(-1, codes.shape[-1])
    out = flat if in_place else torch.empty_like(flat)
    for i in range(0, flat.shape[0], rows_per_pass):
        part = flat[i:i + rows_per_pass]
        out[i:i + rows_per_pass] = _bytes(_move(_words(part), _STORAGE_TO_DEVICE), part)
    return codes if in_place else out.reshape(codes.shape)


def from_rotated_words(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of to_rotated_words (tests): device words -> storage words, a new tensor."""
    return _bytes(_move(_words(codes), [(b, a) for a, b in _STORAGE_TO_DEVICE]), codes)


# Row swizzle. An expert GEMM reads one k32 step of 8 consecutive code rows with one ldmatrix
# matrix: 16 bytes (a "unit") of each row. A chunk's rows kc/2 bytes apart (a multiple of 128 at
# every preset's chunk width) start on the same banks, so they are stored with unit u of row r at
# u ^ (r % width): with width 8 the 8 rows of a matrix hit 8 different 16-byte bank groups, and a
# chunk's code rows are still one copy of the rows as they lie. XOR is its own inverse: the same
# function swizzles and unswizzles.
SWIZZLE_MAX = 8  # 8 rows of an ldmatrix matrix x 16 bytes = the 128 bytes of the 32 banks


def swizzle_units(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Rows [..., N, B] of 16-byte units -> a new tensor with unit u of row r moved to u ^ (r % width)."""
    n, kh = codes.shape[-2:]
    if kh % 16:
        raise QuantizationError(f"fp4 swizzle: rows of {kh} bytes are not whole 16-byte units")
    units = kh // 16
    if width < 1 or width & (width - 1) or units % width:
        raise QuantizationError(f"fp4 swizzle: width {width} is not a power of two dividing {units} units")
    sx = torch.arange(n, device=codes.device) % width
    v = codes.reshape(*codes.shape[:-1], units, 16)
    idx = torch.arange(units, device=codes.device)[None, :] ^ sx[:, None]
    idx = idx[:, :, None].expand(*v.shape[:-3], n, units, 16)
    return torch.gather(v, -2, idx).reshape(codes.shape)


def scale_planes(scales: torch.Tensor, steps: int) -> torch.Tensor:
    """E4M3 block scales [..., B], B a multiple of 2 x steps -> a new tensor with each run of
    `steps` k32 steps (2 x steps bytes: step s, k16 half h at byte 2s + h) in two planes: byte
    2s + h moves to steps * h + s. An expert GEMM thread uses one half of every step (gemm.cuh
    gemm_fp4), so it loads its plane alone and finds consecutive steps' scales side by side."""
    if scales.dtype != torch.uint8 or steps < 1 or scales.shape[-1] % (2 * steps):
        raise QuantizationError(f"scale planes: want uint8 scales [..., B] of whole runs of {steps} steps, got "
                                f"{scales.dtype} {tuple(scales.shape)}")
    v = scales.reshape(*scales.shape[:-1], scales.shape[-1] // (2 * steps), steps, 2)
    return v.transpose(-1, -2).contiguous().reshape(scales.shape)


def canonical_scales(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural codes [..., K/2] and E4M3 scales [..., K/16] -> the same values with every scale
    positive and nonzero (new tensors). NaN scales are refused."""
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] != scales.shape[-1] * (BLOCK // 2):
        raise QuantizationError(f"canonical_scales: codes {tuple(codes.shape)} and scales "
                                f"{tuple(scales.shape)} do not describe the same blocks")
    if ((scales & 0x7F) == 0x7F).any():
        raise QuantizationError("an E4M3 block scale is NaN (S.1111.111); refusing")
    neg = (scales & 0x80) != 0
    zero = (scales & 0x7F) == 0
    blk = codes.reshape(*scales.shape, BLOCK // 2)
    flip = torch.where(neg & ~zero, 0x88, 0).to(torch.uint8).unsqueeze(-1)  # the codes' sign bits
    blk = torch.where(zero.unsqueeze(-1), torch.zeros_like(blk), blk ^ flip)
    sc = torch.where(zero, torch.full_like(scales, CANONICAL_ZERO_SCALE), scales & 0x7F)
    return blk.reshape(codes.shape), sc


def is_canonical(scales: torch.Tensor) -> bool:
    return not (((scales & 0x80) != 0) | ((scales & 0x7F) == 0) | ((scales & 0x7F) == 0x7F)).any()


def half_word_table(device, dtype=torch.bfloat16) -> torch.Tensor:
    """[65536, 4]: the 4 values (in k order) of every half-word of the kernel layout."""
    h = torch.arange(65536, dtype=torch.int64)
    nat = torch.zeros_like(h)
    for a, b in BIT_MAP:  # natural bit a <- kernel bit b, both within the half
        if b < 16:
            nat |= ((h >> b) & 1) << a
    vals = e2m1_table()
    return torch.stack([vals[(nat >> (4 * j)) & 0xF] for j in range(4)], dim=1).to(dtype).to(device)


def decode_pairs(words: torch.Tensor, rotated: bool = False) -> torch.Tensor:
    """The kernel's decode of storage (or, rotated, device) words (int64 [...]) -> int64 [..., 4]
    bf16x2 bit patterns of the pairs, value * 2^-126 (what gemm.cuh computes before the scale
    multiply)."""
    out = []
    for terms in _pairs(rotated):
        p = torch.zeros_like(words)
        for r, m in terms:
            p |= (((words << r) | (words >> (32 - r))) & 0xFFFFFFFF if r else words) & m
        out.append(p)
    return torch.stack(out, dim=-1)


def render_header(rotated: bool = False) -> str:
    """The word layout the kernel reads (device words when `rotated`, else the storage words) as
    C++ constants (the kernel's decode reads these; one source of truth)."""
    rows = []
    for terms in _pairs(rotated):
        t = list(terms) + [(0, 0)] * (2 - len(terms))
        rows.append("{" + ", ".join(f"{{{r}, 0x{m:08X}u}}" for r, m in t) + "}")
    return ("namespace mk {\n"
            f"// NVFP4 {'device' if rotated else 'storage'} word (megakernel/fp4_layout.py): pair e = OR over\n"
            "// terms (rotation left, mask)\n"
            "struct Fp4Term { int rot; uint32_t mask; };\n"
            f"constexpr Fp4Term FP4_PAIRS[4][2] = {{{', '.join(rows)}}};\n"
            "// code rows swizzle in periods of at most this many 16-byte units (swizzle_units)\n"
            f"constexpr int FP4_SWIZZLE_MAX = {SWIZZLE_MAX};\n"
            "}  // namespace mk\n")
