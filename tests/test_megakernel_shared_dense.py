"""Plan.shared_dense (issue 48, the layer's code footprint): the dense bf16 ops (qkv, oproj, router,
pool, unpool) through one copy of the GEMM, its staging, ring waits and loader code, shaped at run
time by the op's kind (ops/dense.cuh). The emulated kernel keeps the bits of the per-op build in
both modes under the adversarial schedules, paneled operands included; the GPU build runs one copy
of the GEMM where the per-op build ran five."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel import tree
from megakernel.config import preset
from megakernel.plan import DENSE_OPS, OP, make_plan, render
from megakernel.reference import KVCache
from megakernel.runtime import Engine
from megakernel.weights import generate
from microbench.sass import find_nvdisasm

GEO = dict(spin_bound_ns=3_000_000_000)


def _inputs(cfg, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (t,), generator=g), tree.binary_ish(t) if t > 1 else [-1]


def test_the_switch_renders_and_defaults_off():
    cfg = preset("tiny")
    assert make_plan(cfg, 4).shared_dense == 0 and "constexpr int SHARED_DENSE = 0;" in render(make_plan(cfg, 4))
    for v in (1, 2):
        assert f"constexpr int SHARED_DENSE = {v};" in render(make_plan(cfg, 4, shared_dense=v))
    with pytest.raises(ValueError, match="shared_dense 3"):
        make_plan(cfg, 4, shared_dense=3)
    # ops/dense.cuh's is_dense reads the kinds from plan.DENSE_OPS, rendered
    mask = sum(1 << OP[k] for k in ("qkv", "oproj", "router", "pool", "unpool"))
    assert set(DENSE_OPS) == {"qkv", "oproj", "router", "pool", "unpool"}
    assert f"constexpr unsigned DENSE_KINDS = {mask:#x}u;" in render(make_plan(cfg, 4))


# the last layer's outputs of the dense ops (and top-k's weights, which the router's bits feed): the
# step's logits alone can hide a router difference that changes no expert choice
DENSE_OUT = ("x", "q", "router_logits", "route_w", "pooled")


def _same_dense_outputs(a: Engine, b: Engine, t: int) -> bool:
    return all(torch.equal(a.buf[k][:t], b.buf[k][:t]) for k in DENSE_OUT)


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, generate(cfg), KVCache(cfg).fill_random(torch.Generator().manual_seed(3))


@pytest.mark.parametrize("t,grid,schedule,mode_", [(16, 4, "last", 1), (16, 3, "random", 1), (5, 4, "block", 1),
                                                   (16, 4, "last", 2)])
def test_shared_dense_keeps_the_bits_under_adversarial_schedules(tiny, t, grid, schedule, mode_):
    """The shared build's (and the control's, shared_dense=2) mega and chain steps equal the per-op
    build's chain step bitwise, from poisoned buffers: logits, tokens, the KV cache and the dense
    ops' outputs (T=5: one token tile, the k-loop's other copy)."""
    cfg, w, base = tiny
    toks, par = _inputs(cfg, t, 41)
    ref_cache = base.clone()
    per_op = Engine(w, make_plan(cfg, 4, **GEO), ref_cache, backend="emu")
    ref = per_op.step(toks, par, 40, mode="chain")
    for mode in ("mega", "chain"):
        cache = base.clone()
        eng = Engine(w, make_plan(cfg, 4, shared_dense=mode_, **GEO), cache, backend="emu", grid=grid, emu_seed=7,
                     emu_schedule=schedule)
        eng.poison()
        out = eng.step(toks, par, 40, mode=mode)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens), mode
        assert cache.equal(ref_cache) and _same_dense_outputs(eng, per_op, t), mode


@pytest.mark.slow  # ~40 s of emulation; CI runs it
def test_shared_dense_paneled_operands_keep_the_bits():
    """d_model 1024 in four panels of 256: the shared GEMM restages each panel at its first chunk
    (the router's walk last-first) as the per-op code did; 2 blocks, so that a block runs router and
    pool units back to back and pool finds the router's panel 0 staged."""
    cfg = dataclasses.replace(preset("tiny"), d_model=1024)
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(6))
    geo = dict(ring_stages=2, ring_stage_bytes=4096, norm_panel=256, **GEO)
    per_op, shared = make_plan(cfg, 2, **geo), make_plan(cfg, 2, shared_dense=True, **geo)
    assert shared.norm_k == 256 and shared.tiles["router"].k // shared.tiles["router"].kc == 4
    toks, par = _inputs(cfg, 16, 4)
    ref_eng = Engine(w, per_op, base.clone(), backend="emu")
    ref = ref_eng.step(toks, par, 40, mode="mega")
    for mode in ("mega", "chain"):
        eng = Engine(w, shared, base.clone(), backend="emu", emu_schedule="last")
        eng.poison()
        out = eng.step(toks, par, 40, mode=mode)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens), mode
        assert _same_dense_outputs(eng, ref_eng, 16), mode  # the router's chunks walked last-first on both sides


@pytest.mark.slow  # two NVRTC builds of the shard8 kernel, ~45 s
@pytest.mark.skipif(find_nvdisasm() is None, reason="needs nvdisasm (set MEGABENCH_NVDISASM)")
def test_the_shared_build_runs_one_gemm_copy_for_the_dense_ops():
    """shard8 T=16 for sm_90a: the per-op build's five dense ops each hold a copy of the GEMM code
    (over 4 KB each, 35 KB together); the shared build's GEMM is ops/dense.cuh's, the ops keep their prologues and epilogues
    only, and the kernel is smaller by more than three copies, at the same registers and no spills."""
    from megakernel.build import build_gpu, code_bytes_by_op
    from megakernel.plans import plan_for

    dense = ("qkv_rope", "oproj", "router", "pool", "unpool")
    per_op, shared = (build_gpu(plan_for("shard8", None, 132, tokens=16, shared_dense=s)) for s in (0, 1))
    a, b = code_bytes_by_op(per_op), code_bytes_by_op(shared)
    assert "dense" not in a and min(a[op] for op in dense) > 4096 and sum(a[op] for op in dense) > 5 * 7168
    assert b["dense"] > 12 * 1024 and sum(b.get(op, 0) for op in dense) < sum(a[op] for op in dense) / 3
    assert per_op.usage.code_bytes - shared.usage.code_bytes > 3 * 7168
    for u in (per_op.usage, shared.usage):
        assert u.spill_store_bytes == u.spill_load_bytes == 0
    assert shared.usage.registers <= per_op.usage.registers
