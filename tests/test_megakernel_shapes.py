"""The megakernel's unit, tile and operand shapes through the host emulation: each shape the
presets' builds use (fp4 chunks, unit rows, paneled operands, attention splits and rounds), run on
a small model in both modes, bitwise equal to each other and close to the reference."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megakernel import plan as plan_mod
from megakernel.build import CSRC
from megakernel.config import preset
from megakernel.plan import make_plan
from megakernel.program import assigned_units, build, splits
from megakernel.reference import KVCache
from megakernel.runtime import Engine, check_close
from megakernel.weights import generate

from megakernel_cases import modes_match_reference, reference_logits, step_inputs, tiny, tree_without


@pytest.mark.parametrize("t", [16, 5])
def test_emulated_wide_normed_operand_by_bulk_copies(t):
    # d_model 1024: the norms' consumers stage the rows < T of bf16(x * g) by one bulk copy
    # (gemm.cuh stage_normed), zero the other rows, and scale their fp32 results by the norm
    # factor; after poison() every buffer is NaN, so a row no producer wrote this step (xg,
    # ss_part) would show in the result
    cfg = dataclasses.replace(preset("tiny"), d_model=1024)
    modes_match_reference(cfg, make_plan(cfg, 4, spin_bound_ns=3_000_000_000), 5, t, 9, 40,
                                    "wide residual vs reference")


def test_residual_units_of_two_row_tiles_where_one_round_needs_them():
    # oproj / unpool units (plan.residual_rows): 16 rows, or 32 where the grid does not hold every
    # 16-row unit at once; a 32-row unit's epilogue gives each thread two outputs of one feature.
    # tiny on 4 blocks (8 units of 16) takes 32 rows, so every emulated tiny test runs that path;
    # here the forced 16-row build too, both poisoned, bitwise chain == mega, close to the reference
    assert make_plan(preset("shard8"), 132).tiles["oproj"].rows == 32  # 256 units of 16 on 132 SMs
    assert make_plan(preset("shard8"), 132).tiles["unpool"].rows == 32
    assert make_plan(preset("small"), 132).tiles["unpool"].rows == 16  # 128 units of 16 fit
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="residual_unit_rows 48: must be a multiple of 16 dividing d_model 128"):
        make_plan(cfg, 4, residual_unit_rows=48)
    for rows in (32, 16):
        plan = make_plan(cfg, 4, spin_bound_ns=3_000_000_000, residual_unit_rows=None if rows == 32 else rows)
        assert plan.tiles["oproj"].rows == plan.tiles["unpool"].rows == rows
        modes_match_reference(cfg, plan, 5, 7, 12, 40, f"{rows}-row residual units vs reference")


# gemm_fp4's chunk shapes: (d_pool, d_expert, gate/up rows, down rows) -> the tiles' (rows, kc,
# swizzle). kc = plan.fp4_kc(K): steps per chunk kc/32 in groups of 4 (one group of 2 at kc = 64,
# two groups at kc = 256), swizzle period min(8, kc/32); tiles per warp rows / 128 (256: two
# tiles on one B fragment; 128: one, two step-parity chains; 64: warps 4-7 idle)
FP4_SHAPES = {"kc64+kc128": ((64, 128, 256, 64), {"expert1": (256, 64, 2), "expert2": (64, 128, 4)}),
              "kc128+kc64": ((128, 64, 128, 128), {"expert1": (128, 128, 4), "expert2": (128, 64, 2)}),
              "kc256 two tiles": ((512, 512, 256, 256), {"expert1": (256, 256, 8), "expert2": (256, 256, 8)}),
              "kc256 four chunks": ((256, 1024, 128, 256), {"expert1": (128, 256, 8), "expert2": (256, 256, 8)})}


@pytest.mark.parametrize("shape", [pytest.param(k, marks=pytest.mark.slow) if k == "kc256 four chunks" else k
                                   for k in sorted(FP4_SHAPES)])  # "four chunks": ~25 s, CI runs it (-m slow)
def test_emulated_fp4_gemm_chunk_shapes(shape):
    # each chunk shape of gemm_fp4 (a code word from the wrong matrix, row, step, swizzle unit,
    # group, chunk or tile changes the logits), with both token tiles (t = 9), mega == chain
    # bitwise and close to the reference
    (dp, de, r1, r2), want = FP4_SHAPES[shape]
    cfg = dataclasses.replace(preset("tiny"), d_model=512, d_pool=dp, d_expert=de)
    plan = make_plan(cfg, 4, spin_bound_ns=3_000_000_000, ring_stage_bytes=32768, expert1_rows=r1, expert2_rows=r2)
    assert {n: (plan.tiles[n].rows, plan.tiles[n].kc, plan.tiles[n].swizzle) for n in want} == want
    modes_match_reference(cfg, plan, 8, 9, 12, 30, f"fp4 chunks {shape} vs reference")


@pytest.mark.slow  # ~45 s of emulation; CI runs it
def test_device_words_give_the_storage_words_bits():
    # Plan.fp4_rotated: the kernel's copy of the codes in device words (ROT_PAIRS) or as stored
    # (PAIRS): the same values through another decode, so the same bits
    cfg = dataclasses.replace(preset("tiny"), d_model=512, d_pool=512, d_expert=512)
    out = {}
    for rot in (True, False):
        plan = make_plan(cfg, 4, spin_bound_ns=3_000_000_000, ring_stage_bytes=32768, fp4_rotated=rot,
                         expert1_rows=256, expert2_rows=256)
        assert all(plan.tiles[n].rotated == rot for n in ("expert1", "expert2"))
        out[rot] = modes_match_reference(cfg, plan, 8, 9, 12, 30, f"fp4 words rotated={rot} vs reference")
    assert torch.equal(out[True], out[False])


def test_xg_holds_the_next_norms_operand_panel_major():
    # The last unpool writes bf16(x * final_norm) for lm_head into xg[0], laid out as the consumers
    # stage it (gemm.cuh xg_at): [which][panel][T_MAX][panel + 8 bf16 of pad], so that a panel's
    # rows < T are one bulk copy. Bitwise: the same fp32 product, rounded once to bf16.
    cfg = dataclasses.replace(preset("tiny"), d_model=1024)
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(6))
    plan = make_plan(cfg, 2, norm_panel=256, ring_stages=2, ring_stage_bytes=4096, spin_bound_ns=3_000_000_000)
    t = 5
    toks, par = step_inputs(cfg, t, 4)
    eng = Engine(w, plan, base.clone(), backend="emu")
    eng.poison()
    eng.step(toks, par, 40, mode="mega")
    xg = eng.buf["xg"]
    kp = plan.norm_k
    assert tuple(xg.shape) == (2, cfg.d_model // kp, cfg.max_tree, kp + 8) and plan.xg_row == kp + 8
    want = (eng.buf["x"][:t] * w.final_norm.float()).to(torch.bfloat16)
    got = xg[0, :, :t, :kp].permute(1, 0, 2).reshape(t, cfg.d_model)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.isnan(xg[0, :, t:].float()).all()  # rows >= T: never written (the consumers zero them)


@pytest.mark.slow  # ~40 s of emulation; CI runs it
def test_emulated_paneled_norm_operand_gives_the_same_bits():
    # d_model 1024 staged in four panels of 256 (chunks of 128-256 columns): the GEMMs sum the same
    # chunks in the same order, so the bits equal the unpaneled build's, in both modes; with 2
    # blocks a block runs router and pool units back to back (pool finds the router's last panel,
    # panel 0, staged and restages the others with the norm factors reused). The router's 4 chunks
    # are walked last-first by loader and consumer alike: against the reference, a disagreement on
    # that order would multiply chunks by the wrong columns.
    cfg = dataclasses.replace(preset("tiny"), d_model=1024)
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(6))
    geo = dict(ring_stages=2, ring_stage_bytes=4096, spin_bound_ns=3_000_000_000)
    whole, paneled = make_plan(cfg, 2, **geo), make_plan(cfg, 2, norm_panel=256, **geo)
    assert paneled.norm_k == 256 and paneled.abuf_bytes < whole.abuf_bytes
    prog = build(paneled)
    router, pool = [next(o for o in prog.ops if o.kind == k) for k in ("router", "pool")]
    assert any(len(assigned_units(router, b, 2, 1)) and len(assigned_units(pool, b, 2, 4)) for b in range(2))
    assert paneled.tiles["router"].k // paneled.tiles["router"].kc == 4
    toks, par = step_inputs(cfg, 16, 4)
    truth, routes = reference_logits(w, base.clone(), toks, par, 40)
    forced = Engine(w, paneled, base.clone(), backend="emu").step(toks, par, 40, mode="mega", routes=routes)
    check_close(forced.logits, truth, "paneled operand vs reference", rel=1e-2)
    ref = Engine(w, whole, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    for mode in ("chain", "mega"):
        out = Engine(w, paneled, base.clone(), backend="emu").step(toks, par, 40, mode=mode)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens), mode
    filled = make_plan(cfg, 2, fill_ring=True, **geo)
    assert filled.ring_stages > 2
    out = Engine(w, filled, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    assert torch.equal(out.logits, Engine(w, filled, base.clone(), backend="emu").step(toks, par, 40, mode="chain").logits)


def test_attention_skipping_sub_blocks_past_a_split_keeps_the_bits(tiny, tmp_path):
    """attention.cuh leaves a round's sub-blocks once they start past the split's run (with 32-key
    splits, the default, a shard8 round's second sub-block scores nothing). An all-masked
    sub-block is a no-op on the online softmax (alpha = 1, p = 0), so the kernel without the skip
    gives the same bits. In tiny a warp scores 16 keys of a round, so the warps past a split's
    keys skip in every split."""
    from megakernel import ab

    cfg, w, base, plan = tiny
    assert plan.keys_per_split == 32 and plan.attn_key_groups * 16 > plan.keys_per_split
    noskip = tree_without(tmp_path, "ops/attention.cuh", "      if (kb0 + kw0 >= total) break;")
    toks, par = step_inputs(cfg, 7, 5)
    a = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    with ab.kernel_tree(noskip):
        b = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens)


def test_attention_combine_past_one_round_of_partials(tiny):
    """attn_combine holds NSL x NB partial rows of O in registers per round (NSL =
    COMPUTE_THREADS / head_dim slices, NB in attn_combine.cuh); a layer with more partials takes
    further rounds, a path that the default splits never reach in tiny. Two-key splits give tiny's global layer at ctx 120
    64 splits x 4 key groups: two rounds. Mega == chain bitwise, and both match the reference."""
    cfg, w, base, _ = tiny
    nb = int(re.search(r"NB = (\d+);", (CSRC / "ops" / "attn_combine.cuh").read_text()).group(1))
    plan = make_plan(cfg, 132, spin_bound_ns=3_000_000_000, keys_per_split=2)
    ctx, t = 120, 8
    parts = max(splits(cfg, plan, layer, ctx, t) for layer in range(cfg.n_layers)) * plan.attn_key_groups
    assert parts > (32 * plan_mod.WARPS // cfg.head_dim) * nb, (parts, nb)  # NSL = COMPUTE_THREADS / HD slices
    toks, par = step_inputs(cfg, t, 9)
    ref, routes = reference_logits(w, base.clone(), toks, par, ctx)
    out = {mode: Engine(w, plan, base.clone(), backend="emu", grid=4).step(toks, par, ctx, mode=mode, routes=routes)
           for mode in ("chain", "mega")}
    assert torch.equal(out["chain"].logits, out["mega"].logits)
    check_close(out["mega"].logits, ref, "combine past one round", rel=1e-2)


def test_attention_splits_that_cut_through_the_new_keys(tiny):
    """Splits run over "cached keys seen, then the T new keys" in equal runs, so with 16 keys per
    split a run can start or end inside the new keys (global layers: 20 cached + 16 new = 3 runs
    of 12; sliding: 15 + 16 = 2 runs of 16, the second all new). Mega == chain bitwise, and both
    agree with the reference under forced routing."""
    import dataclasses

    from megakernel.program import splits

    cfg, w, base, _ = tiny
    plan = dataclasses.replace(make_plan(cfg, 8, spin_bound_ns=3_000_000_000), keys_per_split=16)  # 4 splits max
    ctx, t = 20, 16
    assert [splits(cfg, plan, l, ctx, t) for l in range(cfg.n_layers)] == [3 if cfg.is_global(l) else 2
                                                                           for l in range(cfg.n_layers)]
    toks, par = step_inputs(cfg, t, 11)
    ref, routes = reference_logits(w, base.clone(), toks, par, ctx)
    chain = Engine(w, plan, base.clone(), backend="emu").step(toks, par, ctx, mode="chain", routes=routes)
    mega = Engine(w, plan, base.clone(), backend="emu", emu_seed=3).step(toks, par, ctx, mode="mega", routes=routes)
    assert torch.equal(chain.logits, mega.logits)
    check_close(mega.logits, ref, "16-key attention splits vs reference", rel=1e-2)
