"""attn_combine units of several rows (Plan.combine_rows): a unit merges one q head's partials for
combine_rows consecutive rows, a slice of head_dim threads per row. The rows' bits must be those
of one-row units (the chunks are the row's own), at random and adversarial schedules, with rows of
different requests in one unit, a last unit of fewer rows, and in row groups; the program's rules
must give every (head, row) to exactly one unit. Mutations (a slice reading its neighbour's row's
weights, a unit's rows counted from the wrong row, the chunk boundary off by one) must fail."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel import ab
from megakernel.batch import check_batch, engine_for, make_requests, random_caches
from megakernel.config import preset
from megakernel.plan import WARPS, make_plan
from megakernel.program import n_units, needed_group
from megakernel.reference import KVCache
from megakernel.weights import generate

from megakernel_cases import mutated_csrc, tiny  # noqa: F401 (fixture)

# (T_r, ctx_r): 13 rows (units of 4: 4 | 4 | 4 | 1, requests straddling units), 16 rows, one row,
# and 16 + 9 + 12 rows in three row groups; contexts past tiny's window of 16 and at 0
SHAPES = {"13": ((1, 17), (8, 0), (4, 100)), "16": ((4, 3), (1, 0), (6, 64), (5, 20)), "1": ((1, 90),),
          "groups": ((16, 5), (9, 40), (12, 0))}


def _plan(cfg, rows, **kw):
    groups = -(-rows // 16)
    return make_plan(cfg, 8 if groups > 1 else 4, spin_bound_ns=3_000_000_000, row_groups=groups, **kw)


def _step(w, plan, shape, schedule, seed=3):
    cfg = w.cfg
    caches = random_caches(cfg, len(shape), seed=seed)
    eng = engine_for(w, plan, caches, backend="emu", emu_schedule=schedule, emu_seed=seed)
    eng.poison()
    out = eng.step_batch(make_requests(cfg, shape, seed=seed), mode="mega")
    return out.logits.clone(), out.tokens.clone(), caches


@pytest.mark.parametrize("name", list(SHAPES))
def test_combine_rows_is_bitwise_the_one_row_unit(tiny, name):
    """combine_rows = 32 * WARPS / head_dim against 1: logits, tokens and KV bitwise at the random
    and `last` schedules; the several-row build passes the batch check itself (mega == chain, each
    request its own B=1 step, close to the reference)."""
    cfg, w = tiny[0], tiny[1]
    shape = SHAPES[name]
    rows = sum(t for t, _ in shape)
    cr = 32 * WARPS // cfg.head_dim
    one, many = _plan(cfg, rows), _plan(cfg, rows, combine_rows=cr)
    for sched in ("random", "last"):
        a, b = _step(w, one, shape, sched), _step(w, many, shape, sched)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (name, sched)
        assert all(x.equal(y) for x, y in zip(a[2], b[2]))
    res = check_batch(w, many, random_caches(cfg, len(shape), seed=5), make_requests(cfg, shape, seed=5),
                      schedules=("random", "block"), grid=many.n_sm, seed=5)
    assert res.ok, res.lines()


def _combine_alone(w, plan, shape, seed=7):
    """Layer 0's attn_combine alone (chain mode: op instance i is launch i) on crafted partials
    where the order of the adds shows in the bf16 output (the partials attention writes from a
    random cache rarely show it): every part's weight exp(m - M) is 1 (m = 0), and its O is
    +-2^20 by the part's parity plus noise of about 1, so that the sum cancels to the noise and
    each add at 2^20 rounds by 1/16; about one part in ten has nothing visible (l = 0).
    Returns att_out's rows."""
    cfg = w.cfg
    reqs = make_requests(cfg, shape, seed=seed)
    eng = engine_for(w, plan, random_caches(cfg, len(shape), seed=seed), backend="emu", emu_schedule="random",
                     emu_seed=seed)
    rows = eng.prepare_batch(reqs)
    i = next(o.index for o in eng.program.ops if o.kind == "attn_combine" and o.layer == 0)
    eng.launch_step("chain", part=range(0, i))
    g = torch.Generator().manual_seed(seed)
    o, ml = eng.buf["att_o"], eng.buf["att_ml"]
    sign = 1 - 2 * (torch.arange(o.shape[1]) % 2).float()  # by part
    o.copy_(sign[None, :, None, None] * 2.0 ** 20 + torch.randn(o.shape, generator=g))
    ml[..., 0].zero_()
    ml[..., 1].copy_((0.5 + torch.rand(ml.shape[:-1], generator=g)) * (torch.rand(ml.shape[:-1], generator=g) > 0.1))
    eng.launch_step("chain", part=range(i, i + 1))
    return eng.buf["att_out"][:rows].clone()


def test_combine_rows_keeps_the_order_of_the_adds(tiny):
    """On partials where every change of order shows: several-row units give the one-row units'
    bits, and moving the chunks' boundary (the order, nothing else) does not."""
    cfg, w = tiny[0], tiny[1]
    shape = ((1, 17), (8, 100), (4, 120))  # 4, 8 and 8 parts a row
    cr = 32 * WARPS // cfg.head_dim
    one, many = _plan(cfg, 13), _plan(cfg, 13, combine_rows=cr)
    a, b = _combine_alone(w, one, shape), _combine_alone(w, many, shape)
    # a row whose parts all have l = 0 is NaN (0 / 0) in both: compare the bits
    assert torch.isfinite(a.float()).float().mean() > 0.9 and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_head_dim_128_slices_of_two_rows():
    """small's and shard8's head_dim (128): two rows a unit, a slice of 128 threads each, bitwise
    the one-row units at 11 rows (a last unit of one row)."""
    cfg = dataclasses.replace(preset("tiny"), head_dim=128)
    w = generate(cfg)
    shape = ((3, 20), (8, 0))
    one, two = _plan(cfg, 11), _plan(cfg, 11, combine_rows=2)
    assert n_units(two, "attn_combine", 0, [3, 8], [20, 0], 0) == cfg.n_heads * 6
    for sched in ("random", "block"):
        a, b = _step(w, one, shape, sched), _step(w, two, shape, sched)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), sched


def test_units_cover_every_head_and_row_once(tiny):
    cfg = tiny[0]
    cr = 32 * WARPS // cfg.head_dim
    for t in ([1], [4, 1, 6, 5], [1, 8, 4], [16]):
        rows = sum(t)
        plan = _plan(cfg, min(rows, 16), combine_rows=cr)
        ctx = [3] * len(t)
        n = n_units(plan, "attn_combine", 0, t, ctx, 0)
        assert n == cfg.n_heads * -(-rows // cr)
        # unit u's head: its kv head is the attention group it waits for
        nu = n // cfg.n_heads
        assert [needed_group(plan, "attn_combine", "attn", 0, u, t, ctx) for u in range(n)] == \
            [(u // nu) // cfg.group for u in range(n)]
    with pytest.raises(ValueError, match="combine_rows 3: want 1 or 4"):
        make_plan(cfg, 4, combine_rows=3)


MUTATIONS = {
    # a slice of a several-row unit reading the weights (exp(m - M)) of the unit's first row
    "first row's weights": ("const float* mlr = ml + 2 * PARTS * ri;\n  float* wtr = wt + PARTS * ri;",
                            "const float* mlr = ml + 2 * PARTS * ri;\n  float* wtr = wt;"),
    # the unit's first row counted as if units were one row each
    "unit's rows": ("t0 = (unit % nu) * COMBINE_ROWS,", "t0 = (unit % nu),"),
    # chunk c's boundary one part late: the sums' order changes (bits, not tolerance)
    "chunk boundary": ("const int nparts = req_splits(b, layer, row_req(b, t)) * ATT_KG, per = cdiv(nparts, NSL);",
                       "const int nparts = req_splits(b, layer, row_req(b, t)) * ATT_KG, per = cdiv(nparts, NSL) + (nr > 1);"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_combine_checks_catch_a_mutated_kernel(tiny, tmp_path, name):
    """Each mutation of the several-row path: the whole step's bits (data mutations) or the crafted
    partials' (the order) differ from the one-row build's."""
    cfg, w = tiny[0], tiny[1]
    cr = 32 * WARPS // cfg.head_dim
    if name == "chunk boundary":
        shape = ((1, 17), (8, 100), (4, 120))
        one, many = _plan(cfg, 13), _plan(cfg, 13, combine_rows=cr)
        a = _combine_alone(w, one, shape)
        with ab.kernel_tree(mutated_csrc(tmp_path, "ops/attn_combine.cuh", *MUTATIONS[name])):
            b = _combine_alone(w, many, shape)
        assert not torch.equal(a.view(torch.int16), b.view(torch.int16))
        return
    shape = SHAPES["13"]
    one, many = _plan(cfg, 13), _plan(cfg, 13, combine_rows=cr)
    a = _step(w, one, shape, "random")
    with ab.kernel_tree(mutated_csrc(tmp_path, "ops/attn_combine.cuh", *MUTATIONS[name])):
        b = _step(w, many, shape, "random")
    assert not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))


def test_mk_step_takes_combine_rows_and_refuses_a_wrong_count(capsys):
    """`megabench mk step --combine-rows 4` checks a batch of 13 rows in the emulation (exit 0);
    a count that is neither 1 nor one row per slice is refused by name (exit 2)."""
    from megakernel import cli
    from microbench.device import no_gpu_reason

    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")
    assert cli.main(["step", "--tree-sizes", "1,8,4", "--ctxs", "17,0,100", "--combine-rows", "4", "--check"]) == 0
    out = capsys.readouterr().out
    assert "check: passed" in out and out.count("bitwise its own B=1 step") == 3
    assert cli.main(["step", "--combine-rows", "2"]) == 2
    assert "--combine-rows 2: want 1 or 4 (tiny: a slice of head_dim 64" in capsys.readouterr().err
