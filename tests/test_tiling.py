"""The megakernel's tiled weights (megakernel/tiling.py): dense and expert layouts, pad, refusals, sharing."""
from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from megakernel import tiling
from megakernel.config import ConfigError, preset
from megakernel.fp4_layout import from_rotated_words, scale_planes
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
        tiling.tile_dense(_w(32, 256), GemmTile(rows=128, kc=256, k=256, fp4=True, swizzle=8))


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


def _bank(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (e, n, k // 16), dtype=torch.uint8, generator=g))


def test_expert_codes_and_scales_lie_in_column_blocks_as_gemm_fp4_reads_them():
    # tile_fp4_*: [E][K/kc][N][kc/2 | kc/16]: a run of consecutive rows of a column block is one
    # copy; code unit u of row r at u ^ (r % 8), in device words; scale byte h * (kc/32) + s =
    # step s's scale of k16 half h
    t = GemmTile(rows=64, kc=256, k=1024, fp4=True, swizzle=8, rotated=True)
    codes, scales = _bank(3, 256, 1024, 1)
    tc, ts = tiling.tile_fp4_codes(codes, t), tiling.tile_fp4_scales(scales, t)
    assert tc.shape == (3, 4, 256, 128) and ts.shape == (3, 4, 256, 16) and tc.is_contiguous()
    words = from_rotated_words(tc)
    for e, c, r, unit in [(0, 0, 0, 3), (1, 3, 5, 2), (2, 1, 37, 7), (2, 2, 255, 0)]:
        v = unit ^ (r % 8)
        assert torch.equal(words[e, c, r, 16 * v:16 * v + 16], codes[e, r, c * 128 + 16 * unit:c * 128 + 16 * unit + 16])
        for s in range(8):
            for h in range(2):
                assert ts[e, c, r, 8 * h + s] == scales[e, r, c * 16 + 2 * s + h]
    back = tiling.untile_fp4(tc, ts, t)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    # the storage words as they are without `rotated`
    assert torch.equal(tiling.tile_fp4_codes(codes, replace(t, rotated=False)), words)


def test_every_build_of_a_model_shares_one_expert_copy():
    # the copy depends on the columns, swizzle and words, not on a build's unit rows (T=1 and T=16
    # builds of shard8 must share it: two copies of its banks do not fit the GPU)
    t = GemmTile(rows=64, kc=128, k=256, fp4=True, swizzle=4, rotated=True)
    codes, scales = _bank(2, 128, 256, 2)
    c1, s1 = tiling.fp4_copies(codes, scales, t)
    c2, s2 = tiling.fp4_copies(codes, scales, replace(t, rows=32))
    assert c1 is c2 and s1 is s2
    c3, _ = tiling.fp4_copies(codes, scales, replace(t, rotated=False))
    assert c3 is not c1 and not torch.equal(c3, c1)  # other words, another copy


def test_a_bank_keeps_one_fp4_layout_cached():
    """Builds for other step sizes choose other chunk widths; the cache holds one layout of a bank
    (two layouts of shard8's banks beside its weights do not fit a 141 GB GPU), and a copy an engine
    still holds stays valid."""
    import gc
    import weakref

    t = GemmTile(rows=64, kc=128, k=256, fp4=True, swizzle=4, rotated=True)
    codes, scales = _bank(2, 128, 256, 5)
    c1, _ = tiling.fp4_copies(codes, scales, t)
    gone = weakref.ref(tiling.fp4_copies(codes, scales, replace(t, kc=64, swizzle=2))[0])
    c3, _ = tiling.fp4_copies(codes, scales, t)  # back to the first layout: rebuilt, equal
    gc.collect()
    assert gone() is None and c3 is not c1 and torch.equal(c3, c1)
    assert tiling.fp4_copies(codes, scales, t)[0] is c3


def test_scale_planes_of_a_run_of_steps():
    sc = torch.arange(2 * 32, dtype=torch.int64).to(torch.uint8).reshape(2, 32)
    x = scale_planes(sc, 4)  # runs of 4 steps = 8 bytes: byte 2s + h -> 4h + s
    assert x[0, :8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7] and x[1, 8:16].tolist() == [40, 42, 44, 46, 41, 43, 45, 47]
    with pytest.raises(Exception, match="whole runs of 16 steps"):
        scale_planes(sc[:, :24], 16)


def test_tile_fp4_refuses_dense_tiles_and_banks_of_another_shape():
    codes, scales = _bank(2, 64, 128, 3)
    t = GemmTile(rows=32, kc=64, k=128, fp4=True, swizzle=2)
    with pytest.raises(ConfigError, match="bf16 tile"):
        tiling.tile_fp4_codes(codes, GemmTile(rows=16, kc=64, k=128, fp4=False))
    with pytest.raises(ConfigError, match=r"want uint8 codes \[E, N, 128\]"):
        tiling.tile_fp4_codes(codes, replace(t, k=256, kc=128))
    with pytest.raises(ConfigError, match=r"want uint8 scales \[E, N, 16\]"):
        tiling.tile_fp4_scales(scales, replace(t, k=256, kc=128))


def test_an_engine_counts_the_copies_it_allocates_and_refuses_what_does_not_fit(tiny_weights_for_copies):
    """runtime.Engine.copies_needed is what _layer_ptrs allocates (tiling.copy_bytes, exact, 0 for
    copies the cache holds), and check_copies_fit names model, bytes and GPU before allocating
    (otherwise shard8 on an 80 GB card fails deep inside the tiling with an allocator trace)."""
    from microbench.errors import DeviceMemoryError, GpuTooSmallError

    from megakernel import runtime
    from megakernel.plans import plan_for
    from megakernel.reference import KVCache

    w = tiny_weights_for_copies
    tiling.clear()
    eng_plan = plan_for("tiny", None, 4)
    probe = runtime.Engine.__new__(runtime.Engine)
    probe.w, probe.plan, probe._share, probe.dev = w, eng_plan, None, w.device
    need = probe.copies_needed()
    eng = runtime.Engine(w, eng_plan, KVCache(w.cfg), backend="emu")
    got = sum({id(t): t.numel() * t.element_size() for t in eng._keep}.values())
    assert need == got > 0
    assert probe.copies_needed() == 0  # all cached now
    runtime.check_copies_fit(need, need + runtime.COPY_HEADROOM, 80 << 30, "GPU", "tiny")
    with pytest.raises(DeviceMemoryError, match=r"shard8: .* need 56\.0 GiB .* NVIDIA H100 80GB HBM3 has 20\.0 GiB free"):
        runtime.check_copies_fit(56 << 30, 20 << 30, 80 << 30, "NVIDIA H100 80GB HBM3", "shard8")
    # short of free memory only (something else holds it): an error, never a skip
    with pytest.raises(DeviceMemoryError) as short:
        runtime.check_copies_fit(56 << 30, 20 << 30, 140 << 30, "NVIDIA H200", "shard8", resident=57 << 30)
    assert not isinstance(short.value, GpuTooSmallError) and "cannot run on this GPU" not in str(short.value)
    # beyond the GPU's total less the model's own weights: no run fits this GPU (GPU tests skip on it)
    with pytest.raises(GpuTooSmallError, match=r"weights take 57\.0 GiB of it: it cannot run on this GPU"):
        runtime.check_copies_fit(56 << 30, 20 << 30, 80 << 30, "NVIDIA H100 80GB HBM3", "shard8", resident=57 << 30)


@pytest.fixture
def tiny_weights_for_copies():
    from megakernel.weights import generate

    return generate(preset("tiny"))
