"""The megakernel's tiled dense weights (megakernel/tiling.py): layout, pad, refusals, sharing."""
from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from megakernel import tiling
from megakernel.config import ConfigError, preset
from megakernel.fp4_layout import scale_planes, scale_swizzle, swizzle_units, to_rotated_words
from megakernel.plan import ROW_PAD, GemmTile, make_plan


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_a_chunk_is_stored_as_the_stage_holds_it():
    t = GemmTile(rows=16, kc=64, k=256, fp4=False)
    w = _w(48, 256)
    x = tiling.tile_dense(w, t)
    assert tuple(x.shape) == (3, 4, 16, 64 + ROW_PAD // 2) and x.is_contiguous()
    # chunk (u, c) row r = weight row u*16 + r, columns c*64.. (what produce_bf16 copies in one piece)
    for u, c, r in [(0, 0, 0), (1, 2, 5), (2, 3, 15)]:
        assert torch.equal(x[u, c, r, :64], w[u * 16 + r, c * 64:(c + 1) * 64])
    assert not x[..., 64:].any()  # the pad: zeros, never read by the kernel
    assert torch.equal(tiling.untile_dense(x, t), w)
    # a unit's chunks are contiguous: program.cuh's L2 prefetch of a unit is one range
    flat = x.reshape(-1)
    unit1 = flat[1 * 4 * 16 * 72:2 * 4 * 16 * 72].reshape(4, 16, 72)
    assert torch.equal(unit1, x[1])


def test_every_dense_weight_of_a_preset_tiles_for_its_op():
    plan = make_plan(preset("tiny"), 4)
    shapes = {"wqkv": (plan.cfg.qkv_rows, plan.cfg.d_model), "wo": (plan.cfg.d_model, plan.cfg.attn_width),
              "router": (plan.cfg.n_experts, plan.cfg.d_model), "pool": (plan.cfg.d_pool, plan.cfg.d_model),
              "unpool": (plan.cfg.d_model, plan.cfg.d_pool), "lm_head": (plan.cfg.vocab, plan.cfg.d_model)}
    assert set(shapes) == set(tiling.WEIGHT_TILE)
    for field, (n, k) in shapes.items():
        t = tiling.weight_tile(plan, field)
        w = _w(n, k, 1)
        assert torch.equal(tiling.untile_dense(tiling.tile_dense(w, t), t), w), field


def test_bad_weights_are_refused_by_name():
    t = GemmTile(rows=16, kc=64, k=256, fp4=False)
    with pytest.raises(ConfigError, match="not whole tiles"):
        tiling.tile_dense(_w(40, 256), t)  # 40 rows: not whole 16-row units
    with pytest.raises(ConfigError, match="not whole tiles"):
        tiling.tile_dense(_w(32, 128), t)  # K differs from the tile's
    with pytest.raises(ConfigError, match="bf16"):
        tiling.tile_dense(torch.zeros(32, 256), t)
    with pytest.raises(ConfigError, match="fp4"):
        tiling.tile_dense(_w(32, 256), GemmTile(rows=128, kc=256, k=256, fp4=True, chunk_rows=32, row_group=2))


def test_engines_of_one_model_share_the_tiled_copy_and_it_goes_with_its_source():
    t = GemmTile(rows=16, kc=64, k=256, fp4=False)
    w = _w(32, 256)
    a = tiling.tiled(w, t)
    assert tiling.tiled(w, t) is a  # built once
    assert tiling.tiled(w.clone(), t) is not a  # another tensor, another copy
    key = id(w)
    del w, a
    gc.collect()
    assert key not in tiling._CACHE


def test_swizzled_expert_codes_move_whole_units_within_a_row_and_are_shared():
    t = GemmTile(rows=128, kc=512, k=512, fp4=True, chunk_rows=64, row_group=64, swizzle=8)
    codes = torch.randint(0, 256, (3, 128, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x = tiling.swizzled(codes, t)
    assert x.shape == codes.shape and not torch.equal(x, codes)
    # unit u (16 bytes) of row r lies at u ^ (r % 8): what gemm_fp4's ldmatrix bases read back
    for e, r, u in [(0, 0, 3), (1, 5, 2), (2, 13, 15), (2, 127, 9)]:
        v = u ^ (r % 8)
        assert torch.equal(x[e, r, 16 * v:16 * v + 16], codes[e, r, 16 * u:16 * u + 16])
    assert tiling.swizzled(codes, t) is x  # one copy per source tensor and period
    # no swizzle, or a period of 1: the codes themselves, no copy
    for sw in (0, 1):
        plain = GemmTile(rows=128, kc=512, k=512, fp4=True, chunk_rows=64, row_group=64, swizzle=sw)
        assert tiling.swizzled(codes, plain) is codes


def test_rotated_expert_codes_are_the_device_words_of_each_layout():
    """GemmTile.rotated: the kernel's copy is in device words (fp4_layout.to_rotated_words), with
    or without the swizzle, one copy per source tensor and layout."""
    codes = torch.randint(0, 256, (3, 128, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    for sw in (0, 8):
        t = GemmTile(rows=128, kc=512, k=512, fp4=True, chunk_rows=64, row_group=64, swizzle=sw)
        x = tiling.swizzled(codes, replace(t, rotated=True))
        want = to_rotated_words(swizzle_units(codes, sw) if sw else codes)
        assert torch.equal(x, want) and x is not codes
        assert tiling.swizzled(codes, replace(t, rotated=True)) is x
        assert not torch.equal(tiling.swizzled(codes, t), x)  # the storage words stay a layout of their own


def test_scale_planes_come_with_the_scale_swizzle():
    sc = torch.randint(0, 256, (2, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    t = GemmTile(rows=64, kc=1024, k=1024, fp4=True, chunk_rows=32, row_group=32, swizzle=8, scale_swizzle=4)
    width, row_div = scale_swizzle(1024, 8)
    x = tiling.swizzled_scales(sc, replace(t, scale_planes=True))
    assert torch.equal(x, swizzle_units(scale_planes(sc), width, row_div))
    assert not torch.equal(x, tiling.swizzled_scales(sc, t))  # its own copy
    with pytest.raises(ConfigError, match="scale planes"):
        tiling.swizzled_scales(sc, replace(t, scale_swizzle=0, scale_planes=True))


def test_swizzled_refuses_dense_tiles_and_codes_of_another_k():
    codes = torch.zeros(2, 16, 128, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="bf16 tile"):
        tiling.swizzled(codes, GemmTile(rows=16, kc=64, k=256, fp4=False))
    with pytest.raises(ConfigError, match=r"want uint8 codes \[..., N, 64\]"):
        tiling.swizzled(codes, GemmTile(rows=16, kc=128, k=128, fp4=True, chunk_rows=16, row_group=16, swizzle=2))


def test_swizzled_scales_fill_the_banks_of_a_16_byte_load():
    # gemm_fp4 loads one 16-byte scale unit of rows g = 0..7 (and g + 8) at once: swizzled, the 8
    # rows' units must lie in 8 different 16-byte bank groups (of 128 bytes) for every unit
    for k, width in [(2048, 8), (1024, 4), (512, 2)]:
        t = GemmTile(rows=64, kc=k, k=k, fp4=True, chunk_rows=32, row_group=32, swizzle=8, scale_swizzle=width)
        sc = torch.arange(2 * 64 * (k // 16), dtype=torch.int64).to(torch.uint8).reshape(2, 64, k // 16)
        x = tiling.swizzled_scales(sc, t)
        assert tiling.swizzled_scales(sc, t) is x
        rb = k // 16
        for u in range(rb // 16):
            slots = set()
            for r in range(8):
                # where unit u of row r lies now: find it by content
                row = x[1, r].reshape(-1, 16)
                (pos,) = [i for i in range(rb // 16) if torch.equal(row[i], sc[1, r, 16 * u:16 * u + 16])]
                slots.add((r * rb + 16 * pos) // 16 % 8)
            assert len(slots) == 8, (k, u, slots)
    plain = GemmTile(rows=64, kc=2048, k=2048, fp4=True, chunk_rows=32, row_group=32, swizzle=8, scale_swizzle=0)
    sc = torch.zeros(1, 64, 128, dtype=torch.uint8)
    assert tiling.swizzled_scales(sc, plain) is sc
    with pytest.raises(ConfigError, match=r"want uint8 scales \[..., N, 128\]"):
        tiling.swizzled_scales(torch.zeros(1, 64, 64, dtype=torch.uint8), plain)
    wrong = GemmTile(rows=64, kc=2048, k=2048, fp4=True, chunk_rows=32, row_group=32, swizzle=8, scale_swizzle=4)
    with pytest.raises(ConfigError, match="take 8"):
        tiling.swizzled_scales(sc, wrong)
