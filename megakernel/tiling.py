"""How the megakernel stores its dense (bf16) weights: pre-tiled, so that a ring chunk is one bulk copy.

A dense GEMM unit streams `rows` weight rows in chunks of `kc` columns, and the ring stage holds
them as rows of kc bf16 plus ROW_PAD bytes (the pad spreads the rows over the banks for the
fragment loads). From row-major [N, K] weights a chunk was one bulk copy per row: 2 KB copies for
most ops and 1 KB for the pooler's 32-row units, where weights.ring measured 1 KB pieces at ~79% of
the stream rate of one copy per stage (512 B: 47.5%). Here the chunk is stored exactly as the stage
holds it, pad included, so the loader moves it with one copy of rows x (2 kc + ROW_PAD) bytes:

    tiled[u][c][r][j] = w[u * rows + r][c * kc + j]   for j < kc;  zero for kc <= j < kc + ROW_PAD/2

[N/rows][K/kc][rows][kc + ROW_PAD/2], contiguous. The pad costs ROW_PAD / (2 kc) more bytes
(0.8% at kc = 1024, 1.6% for the pooler's kc = 512). The kernel never reads the pad.

Only the megakernel's copy is tiled (runtime.Engine builds it from the plan's tiles and keeps it
while the source tensor lives); the reference and the torch baselines read the natural weights.

Expert codes: with Plan.fp4_swizzle the engine hands the kernel a copy of each layer's codes with
the rows swizzled in 16-byte units (`swizzled`, fp4_layout.swizzle_units), so that a chunk's code
rows need no pads and are one bulk copy, and of its block scales likewise (`swizzled_scales`), so
that the scale loads are conflict-free. The copies are as large as the originals (~0.87 GB a
shard8 layer).
"""
from __future__ import annotations

import weakref

import torch

from .config import ConfigError
from .fp4_layout import scale_planes, scale_swizzle, swizzle_units, to_rotated_words
from .plan import ROW_PAD, GemmTile

# the kernel's weight pointer (abi LayerPtrs / Params field) -> the op whose tile it is stored for
WEIGHT_TILE = {"wqkv": "qkv", "wo": "oproj", "router": "router", "pool": "pool", "unpool": "unpool",
               "lm_head": "lm_head"}
LAYER_WEIGHTS = tuple(f for f in WEIGHT_TILE if f != "lm_head")  # per-layer fields (LayerPtrs)
# id(source tensor) -> (weak reference to it, {tile shape: tiled copy}); an entry goes with its
# source (weakref.finalize). Not a WeakKeyDictionary: that compares keys with ==, elementwise for tensors.
_CACHE: dict[int, tuple[weakref.ref, dict]] = {}


def tile_dense(w: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """Row-major bf16 [N, K] -> the tiled layout above (a new tensor on w's device)."""
    if t.fp4:
        raise ConfigError("tile_dense: an fp4 tile (expert weights keep fp4_layout's storage)")
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ConfigError(f"tile_dense: want bf16 [N, K], got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if k != t.k or n % t.rows or k % t.kc:
        raise ConfigError(f"tile_dense: [{n}, {k}] is not whole tiles of {t.rows} rows x {t.kc} of K={t.k}")
    out = torch.zeros(n // t.rows, k // t.kc, t.rows, t.kc + ROW_PAD // 2, dtype=w.dtype, device=w.device)
    out[..., :t.kc] = w.reshape(n // t.rows, t.rows, k // t.kc, t.kc).permute(0, 2, 1, 3)
    return out


def untile_dense(tiled: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """Inverse of tile_dense: [N, K] row-major (tests)."""
    u, c, r, _ = tiled.shape
    return tiled[..., :t.kc].permute(0, 2, 1, 3).reshape(u * r, c * t.kc)


def _cached(w: torch.Tensor, key: tuple, build) -> torch.Tensor:
    """build(), once per source tensor and key (engines of one model share the copy)."""
    entry = _CACHE.get(id(w))
    if entry is None or entry[0]() is not w:
        entry = (weakref.ref(w), {})
        _CACHE[id(w)] = entry
        weakref.finalize(w, _CACHE.pop, id(w), None)
    per = entry[1]
    if key not in per:
        per[key] = build()
    return per[key]


def tiled(w: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """tile_dense(w, t), built once per source tensor and tile shape."""
    return _cached(w, ("dense", t.rows, t.kc, t.k), lambda: tile_dense(w, t))


def swizzled(codes: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """The kernel's copy of expert codes [E, N, K/2] for fp4 tile t: the codes themselves for
    padded row groups (swizzle 0) or a period of 1, else their rows swizzled, and with t.rotated
    in device words (fp4_layout.to_rotated_words); built once per source tensor and layout."""
    if not t.fp4:
        raise ConfigError("swizzled: a bf16 tile (dense weights are tiled: tile_dense)")
    if codes.dtype != torch.uint8 or codes.shape[-1] * 2 != t.k:
        raise ConfigError(f"swizzled: want uint8 codes [..., N, {t.k // 2}], got {codes.dtype} {tuple(codes.shape)}")
    if t.swizzle <= 1:
        return _cached(codes, ("rotated",), lambda: to_rotated_words(codes)) if t.rotated else codes
    # swizzling moves whole 16-byte units, rotating rewrites each word: the order does not matter,
    # and rotating the fresh swizzled copy in place needs no second copy of the bank
    build = ((lambda: to_rotated_words(swizzle_units(codes, t.swizzle), in_place=True)) if t.rotated
             else (lambda: swizzle_units(codes, t.swizzle)))
    return _cached(codes, ("swizzle", t.swizzle, t.rotated), build)


def swizzled_scales(scales: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """The kernel's copy of E4M3 block scales [E, N, K/16] for fp4 tile t: the scales themselves,
    or with rows swizzled (GemmTile.scale_swizzle, fp4_layout.scale_swizzle) and, with
    t.scale_planes, each unit in planes (fp4_layout.scale_planes)."""
    if not t.fp4:
        raise ConfigError("swizzled_scales: a bf16 tile")
    if scales.dtype != torch.uint8 or scales.shape[-1] * 16 != t.k:
        raise ConfigError(f"swizzled_scales: want uint8 scales [..., N, {t.k // 16}], got {scales.dtype} "
                          f"{tuple(scales.shape)}")
    if t.scale_swizzle <= 1:
        if t.scale_planes:
            raise ConfigError("swizzled_scales: scale planes come with swizzled scale rows (GemmTile.scale_planes)")
        return scales
    width, row_div = scale_swizzle(t.k, t.swizzle)
    if width != t.scale_swizzle:
        raise ConfigError(f"swizzled_scales: tile scale swizzle {t.scale_swizzle}, but rows of K={t.k} with code "
                          f"period {t.swizzle} take {width} (fp4_layout.scale_swizzle)")
    # planes permute bytes within a unit, the swizzle moves whole units: either order
    src = (lambda: scale_planes(scales)) if t.scale_planes else (lambda: scales)
    return _cached(scales, ("swizzle", width, row_div, t.scale_planes), lambda: swizzle_units(src(), width, row_div))


def weight_tile(plan, field: str) -> GemmTile:
    """The plan's tile for the dense weight behind pointer `field` (WEIGHT_TILE)."""
    return plan.tiles[WEIGHT_TILE[field]]
