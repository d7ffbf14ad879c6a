"""How the megakernel stores its dense (bf16) weights: pre-tiled, so that a ring chunk is one bulk copy.

A dense GEMM unit streams `rows` weight rows in chunks of `kc` columns, and the ring stage holds
them as rows of kc bf16 plus ROW_PAD bytes (the pad spreads the rows over the banks for the
fragment loads). From row-major [N, K] weights a chunk would be one bulk copy per row: 2 KB copies
for most ops and 1 KB for the pooler's 32-row units, and pieces that small stream below the rate of
one copy per stage (weights.ring). Here the chunk is stored exactly as the stage holds it, pad
included, so the loader moves it with one copy of rows x (2 kc + ROW_PAD) bytes:

    tiled[u][c][r][j] = w[u * rows + r][c * kc + j]   for j < kc;  zero for kc <= j < kc + ROW_PAD/2

[N/rows][K/kc][rows][kc + ROW_PAD/2], contiguous. The pad costs ROW_PAD / (2 kc) more bytes
(0.8% at kc = 1024, 1.6% for the pooler's kc = 512). The kernel never reads the pad.

Only the megakernel's copy is tiled (runtime.Engine builds it from the plan's tiles and keeps it
while the source tensor lives); the reference and the torch baselines read the natural weights.

Expert weights: the engine hands the kernel a copy of each layer's codes and block scales stored
in blocks of kc columns (`tile_fp4_codes`, `tile_fp4_scales`; kc = plan.fp4_kc(K), the model's):

    tiled[e][c][r] = row r of expert e, columns c * kc .. + kc

[E][K/kc][N][kc/2 code bytes] and [E][K/kc][N][kc/16 scale bytes], so that a chunk's run of
consecutive rows is one bulk copy. The code rows are swizzled in 16-byte units
(fp4_layout.swizzle_units, period GemmTile.swizzle) and, with GemmTile.rotated, in device words;
each row's kc/16 scale bytes are in two planes (fp4_layout.scale_planes). The copy does not depend
on a build's unit rows, so every build of a model shares one; it is as large as the bank (~0.87 GB
a shard8 layer).
"""
from __future__ import annotations

import gc
import math
import weakref

import torch

from .config import ConfigError
from .fp4_layout import from_rotated_words, scale_planes, swizzle_units, to_rotated_words
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
    out = torch.zeros(_dense_shape(n, k, t), dtype=w.dtype, device=w.device)
    out[..., :t.kc] = w.reshape(n // t.rows, t.rows, k // t.kc, t.kc).permute(0, 2, 1, 3)
    return out


def untile_dense(tiled: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """Inverse of tile_dense: [N, K] row-major (tests)."""
    u, c, r, _ = tiled.shape
    return tiled[..., :t.kc].permute(0, 2, 1, 3).reshape(u * r, c * t.kc)


def _dense_shape(n: int, k: int, t: GemmTile) -> tuple[int, int, int, int]:
    """tile_dense's copy of an [n, k] matrix: [units, chunks, rows, kc + ROW_PAD / 2]."""
    return n // t.rows, k // t.kc, t.rows, t.kc + ROW_PAD // 2


def _dense_key(t: GemmTile) -> tuple:
    return ("dense", t.rows, t.kc, t.k)


def _fp4_key(t: GemmTile) -> tuple:
    """What an fp4 copy depends on: columns, swizzle and words, not a build's unit rows."""
    return ("fp4", t.kc, t.k, t.swizzle, t.rotated)


def _cached(w: torch.Tensor, key: tuple, build) -> torch.Tensor:
    """build(), once per source tensor and key (engines of one model share the copy). An fp4 bank
    keeps one layout cached: builds for other step sizes choose other chunk widths, and a second
    layout of a large model's banks does not fit beside its weights (shard8: ~19 GB a
    down-projection layout, 57 GB of weights, a 37 GB gate/up copy, on a 141 GB GPU). The cache
    drops the previous layout before building the next; an engine still alive keeps its own copy."""
    entry = _CACHE.get(id(w))
    if entry is None or entry[0]() is not w:
        entry = (weakref.ref(w), {})
        _CACHE[id(w)] = entry
        weakref.finalize(w, _CACHE.pop, id(w), None)
    per = entry[1]
    if key not in per:
        if key[0] == "fp4":
            for k in [k for k in per if k[0] == "fp4"]:
                del per[k]
        per[key] = build()
    return per[key]


def copy_bytes(w: torch.Tensor, t: GemmTile) -> int:
    """Bytes of the kernel's copy of w for tile t (tile_dense's padded rows; an fp4 bank's codes or
    scales: the same bytes as the source), 0 where the cache already holds it."""
    entry = _CACHE.get(id(w))
    per = entry[1] if entry is not None and entry[0]() is w else {}
    if t.fp4:
        return 0 if _fp4_key(t) in per else w.numel() * w.element_size()
    if _dense_key(t) in per:
        return 0
    return math.prod(_dense_shape(*w.shape, t)) * w.element_size()


def clear() -> None:
    """Forget every cached copy (engines alive keep theirs) and give their device memory back:
    before work that needs the memory and not the megakernel's layouts (the peer's batched steps
    at shard8); the next engine rebuilds them."""
    for e in _CACHE.values():
        e[1].clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tiled(w: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """tile_dense(w, t), built once per source tensor and tile shape."""
    return _cached(w, _dense_key(t), lambda: tile_dense(w, t))


def _check_fp4(x: torch.Tensor, t: GemmTile, per: int, what: str) -> None:
    if not t.fp4:
        raise ConfigError(f"tile_fp4_{what}: a bf16 tile (dense weights are tiled: tile_dense)")
    if x.dtype != torch.uint8 or x.dim() != 3 or x.shape[-1] * per != t.k:
        raise ConfigError(f"tile_fp4_{what}: want uint8 {what} [E, N, {t.k // per}], got {x.dtype} {tuple(x.shape)}")


def tile_fp4_codes(codes: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """Expert codes uint8 [E, N, K/2] -> the kernel's copy [E, K/kc, N, kc/2] (above), swizzled,
    in device words when t.rotated."""
    _check_fp4(codes, t, 2, "codes")
    e, n, _ = codes.shape
    out = codes.reshape(e, n, t.chunks, t.kc // 2).permute(0, 2, 1, 3).contiguous()
    out = swizzle_units(out, t.swizzle)
    # rotating rewrites each word in place: no second copy of the bank beside this one
    return to_rotated_words(out, in_place=True) if t.rotated else out


def tile_fp4_scales(scales: torch.Tensor, t: GemmTile) -> torch.Tensor:
    """E4M3 block scales uint8 [E, N, K/16] -> the kernel's copy [E, K/kc, N, kc/16], each row's
    block in planes (fp4_layout.scale_planes)."""
    _check_fp4(scales, t, 16, "scales")
    e, n, _ = scales.shape
    out = scales.reshape(e, n, t.chunks, t.kc // 16).permute(0, 2, 1, 3).contiguous()
    return scale_planes(out, t.kc // 32)


def untile_fp4(codes: torch.Tensor, scales: torch.Tensor, t: GemmTile) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of tile_fp4_codes / tile_fp4_scales: storage words [E, N, K/2] and [E, N, K/16] (tests)."""
    e, c, n, _ = codes.shape
    x = swizzle_units(from_rotated_words(codes) if t.rotated else codes, t.swizzle)
    s = scales.reshape(e, c, n, 2, t.kc // 32).transpose(-1, -2).reshape(e, c, n, t.kc // 16)
    return x.permute(0, 2, 1, 3).reshape(e, n, t.k // 2), s.permute(0, 2, 1, 3).reshape(e, n, t.k // 16)


def fp4_copies(codes: torch.Tensor, scales: torch.Tensor, t: GemmTile) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's copies of an expert bank for fp4 tile t (tile_fp4_codes / tile_fp4_scales),
    built once per source tensor and layout (the unit rows are not part of it)."""
    key = _fp4_key(t)
    return (_cached(codes, key, lambda: tile_fp4_codes(codes, t)),
            _cached(scales, key, lambda: tile_fp4_scales(scales, t)))


def weight_tile(plan, field: str) -> GemmTile:
    """The plan's tile for the dense weight behind pointer `field` (WEIGHT_TILE)."""
    return plan.tiles[WEIGHT_TILE[field]]
