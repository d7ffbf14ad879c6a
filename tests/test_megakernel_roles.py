"""Plan.roles: the front and back ops on a share of the grid each, the experts on every block
(issue 48's role split). The plan and program rules here; the emulated kernel runs them, keeps
mega == chain bitwise under the adversarial schedules and runs each op on its role's blocks only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megakernel import critical_path as cp, tree
from megakernel.config import preset
from megakernel.plan import OP, ROLE_GROUPS, make_plan, parse_roles, render, role_code
from megakernel.program import ASSIGN_STRIDED, assigned_units, build, n_units, role_blocks
from megakernel.reference import KVCache
from megakernel.runtime import Engine
from megakernel.weights import generate

GEO = dict(spin_bound_ns=3_000_000_000)


def _inputs(cfg, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (t,), generator=g), tree.binary_ish(t) if t > 1 else [-1]


def test_parse_roles_forms_and_refusals():
    assert parse_roles(0, 132) == () and parse_roles("", 132) == ()
    assert parse_roles(3, 132) == ROLE_GROUPS
    assert parse_roles("attn+oproj/router+pool+topk", 132) == (("attn", "oproj"), ("router", "pool", "topk"))
    for bad, what in (("attn+expert1", "every block"), ("attn/attn", "two roles"), ("attn+nope", "not an op kind"),
                      ("attn//qkv", "empty role"), (2.5, "want 0")):
        with pytest.raises(ValueError, match=what):
            parse_roles(bad, 132)
    with pytest.raises(ValueError, match="at least as many blocks"):
        make_plan(preset("tiny"), 2, roles=3)


def test_render_carries_each_kinds_role():
    cfg = preset("tiny")
    off, on = make_plan(cfg, 4), make_plan(cfg, 4, roles=3)
    assert "constexpr int ROLES = 0;" in render(off) and "ROLE_CODE = 0x0ull" in render(off)
    assert "constexpr int ROLES = 3;" in render(on)
    code = role_code(on)
    assert f"ROLE_CODE = {code:#x}ull" in render(on)
    for r, group in enumerate(ROLE_GROUPS):
        for k in group:
            assert (code >> (4 * OP[k])) & 15 == r + 1, k
    assert (code >> (4 * OP["expert1"])) & 15 == 0 and (code >> (4 * OP["lm_head"])) & 15 == 0


def test_the_three_roles_are_the_models_first_fit():
    """ROLE_GROUPS is critical_path.roles on the committed code sizes (a new code result that packs
    otherwise shows here)."""
    assert tuple(tuple(r) for r in cp.roles(cp.inputs())) == ROLE_GROUPS


@pytest.mark.parametrize("name,n_sm", [("shard8", 132), ("small", 132), ("tiny", 4), ("tiny", 3)])
def test_every_unit_runs_once_on_its_roles_blocks(name, n_sm):
    plan = make_plan(preset(name), n_sm, roles=3)
    prog = build(plan)
    assert {o.kind for o in prog.ops if o.role >= 0} == {k for g in ROLE_GROUPS for k in g}
    for o in prog.ops:
        if o.assign != ASSIGN_STRIDED:
            assert o.role < 0
            continue
        total = n_units(plan, o.kind, o.layer, 16, 64, 0)
        share = role_blocks(o, n_sm)
        if o.role >= 0:
            assert len(share) in (n_sm // 3, -(-n_sm // 3)) and share.start == o.role * n_sm // 3
        runs = {b: list(assigned_units(o, b, n_sm, total)) for b in range(n_sm)}
        assert sorted(u for us in runs.values() for u in us) == list(range(total)), o.kind
        assert all(not us for b, us in runs.items() if b not in share), o.kind
        per = [len(runs[b]) for b in share]
        assert max(per) - min(per) <= 1, o.kind
        # a grid of fewer blocks than roles (chain mode's one-block top-k) runs it on all of them
        assert list(assigned_units(o, 0, 1, total)) == list(range(total))
    if name == "shard8":  # top-k on a block of its role that runs no router unit
        layer = [o for o in prog.ops if o.layer == 1]
        router, topk = (next(o for o in layer if o.kind == k) for k in ("router", "topk"))
        (tb,) = [b for b in range(n_sm) if assigned_units(topk, b, n_sm, 1)]
        assert tb in role_blocks(topk, n_sm) and not assigned_units(router, tb, n_sm, n_units(plan, "router", 1, 1, 0, 0))


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, generate(cfg), KVCache(cfg).fill_random(torch.Generator().manual_seed(3))


@pytest.mark.parametrize("grid,schedule", [(4, "last"), (4, "random"), (3, "block")])
def test_roles_keep_the_bits_under_adversarial_schedules(tiny, grid, schedule):
    """The role build's mega step (each role one or two of the grid's blocks) equals the default
    build's chain step bitwise, from poisoned buffers: logits, tokens and the KV cache."""
    cfg, w, base = tiny
    toks, par = _inputs(cfg, 16, 40)
    ref_cache = base.clone()
    ref = Engine(w, make_plan(cfg, 4, **GEO), ref_cache, backend="emu").step(toks, par, 40, mode="chain")
    for mode in ("mega", "chain"):
        cache = base.clone()
        eng = Engine(w, make_plan(cfg, 4, roles=3, **GEO), cache, backend="emu", grid=grid, emu_seed=5,
                     emu_schedule=schedule)
        eng.poison()
        out = eng.step(toks, par, 40, mode=mode)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens), mode
        assert cache.equal(ref_cache), mode


def test_the_kernel_runs_each_op_on_the_blocks_program_py_names(tiny):
    """The profiled emulation's op phases, per (launch, block), are exactly the op instances
    assigned_units gives that block: the kernel's my_units and its mirror agree, and a role's ops
    never run outside its share (the roles are visible, not only the bits)."""
    cfg, w, base = tiny
    toks, par = _inputs(cfg, 16, 40)
    t, ctx, grid = 16, 40, 4
    plan = make_plan(cfg, grid, roles=3, profile=True, profile_cap=1024, **GEO)
    eng = Engine(w, plan, base.clone(), backend="emu", grid=grid)
    eng.step(toks, par, ctx, mode="mega")
    tl = eng.timeline("mega")
    role_kinds = {k for g in ROLE_GROUPS for k in g}
    ran = {(s.arg, s.block) for s in tl.spans if s.phase in role_kinds}
    want = set()
    for o in eng.program.ops:
        if o.kind in role_kinds:
            total = n_units(plan, o.kind, o.layer, t, ctx, 0)
            want |= {(o.index, b) for b in range(grid) if assigned_units(o, b, grid, total)}
    assert ran == want
    # and the roles are real: no block ran ops of two roles
    role_of_op = {o.index: o.role for o in eng.program.ops}
    per_block = {}
    for i, b in ran:
        per_block.setdefault(b, set()).add(role_of_op[i])
    assert all(len(r) == 1 for r in per_block.values()) and len(per_block) == grid


def test_placement_counts_blocks_that_keep_their_sm_and_their_role():
    """sm_map.placement on handmade records: launch 1 keeps every block on its SM, launch 2 swaps
    blocks 0 and 5 (roles 0 and 2 of 6 blocks in 3 roles), launch 3 misses a block (not counted)."""
    from megakernel.sm_map import placement, role_of_block

    assert [role_of_block(b, 6, 3) for b in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [role_of_block(b, 4, 3) for b in range(4)] == [0, 1, 2, 2]  # program.role_blocks' shares
    sms = {0: [10, 11, 12, 13, 14, 15], 1: [10, 11, 12, 13, 14, 15], 2: [15, 11, 12, 13, 14, 10]}
    launch, block, sm = [], [], []
    for lc, row in sms.items():
        for b, s in enumerate(row):
            launch += [lc, lc]  # two records a block
            block += [b, b]
            sm += [s, s]
    launch.append(3), block.append(0), sm.append(10)
    m = placement(np.asarray(launch), np.asarray(block), np.asarray(sm), 6)
    assert m.launches == 2 and m.same_sm == pytest.approx(10 / 12) and m.same_role == pytest.approx(10 / 12)
    assert m.by_chance == pytest.approx(3 * (1 / 3) ** 2)
    with pytest.raises(ValueError, match="recorded on SMs"):
        placement(np.asarray([0, 0]), np.asarray([1, 1]), np.asarray([3, 4]), 6)
    with pytest.raises(ValueError, match="no two consecutive"):
        placement(np.asarray([0]), np.asarray([0]), np.asarray([0]), 6)


def test_sm_map_refuses_a_source_tree_and_a_bad_point(capsys, monkeypatch):
    from megakernel import cli

    assert cli.main(["sm-map", "--point", "shard8:16"]) == 2
    assert "PRESET:T:CTX" in capsys.readouterr().err
    assert cli.main(["sm-map", "--variant", f"v={cli.__file__.rsplit('/', 1)[0]}/csrc"]) == 2
    assert "not a source tree" in capsys.readouterr().err
    monkeypatch.setattr("megakernel.cli.no_gpu_reason", lambda: "no CUDA device (test)")
    assert cli.main(["sm-map", "--variant", "roles:roles=3"]) == 2
    assert "sm-map needs a GPU: no CUDA device (test)" in capsys.readouterr().err


def test_the_placement_result_round_trips_into_the_models_inputs(tmp_path):
    """sm_map.to_result saves a typed megakernel.sm_map; critical_path.role_inputs reads the roles
    build's same-role share from it, and takes the share by chance where there is none."""
    from megakernel.sm_map import BENCHMARK, Placement, by_chance, to_result
    from microbench.results import Env, latest

    m = Placement(61, 132, 0.02, 0.36, by_chance(132, 3), 3, tuple([0.36] * 61))
    to_result([("shard8", 16, 2048, "base", (), Placement(61, 132, 0.03, 0.30, m.by_chance, 3, (0.3,) * 61)),
               ("shard8", 16, 2048, "roles", (("roles", 3),), m)], env=Env.capture()).save(tmp_path)
    r = latest(BENCHMARK, root=tmp_path)
    assert r.derived["same_role_shard8_T16_ctx2048_roles"].value == pytest.approx(0.36)
    assert r.derived["by_chance_shard8_T16_ctx2048_roles"].value == pytest.approx(1 / 3)
    got = cp.role_inputs(tmp_path, "shard8", 16, 2048, 132)
    assert got["same_role"] == pytest.approx(0.36) and "roles build" in got["sources"]["placement"]
    none = cp.role_inputs(tmp_path / "empty", "shard8", 16, 2048, 132)
    assert none["same_role"] == pytest.approx(1 / 3) and "by chance" in none["sources"]["placement"]
