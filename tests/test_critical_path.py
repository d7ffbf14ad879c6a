"""megakernel.critical_path on the committed H200 results and on handmade inputs."""
from __future__ import annotations

import dataclasses

import pytest

from megakernel import critical_path as cp
from microbench.errors import ResultsFileError


@pytest.fixture(scope="module")
def committed():
    inp = cp.inputs()
    rs = cp.rows(inp)
    return inp, rs, cp.segment_rows(rs), cp.levers(inp, rs)


def test_rows_walk_the_whole_layer_launch(committed):
    inp, rs, segs, _ = committed
    items = [r.item for r in rs]
    assert [i for i in items if "->" not in i] == list(cp.CHAIN)
    # every consumer has its hop row, from the later of its producers
    for op, prods in cp.PRODUCERS.items():
        last = max(prods, key=lambda p: inp.edges[p][1])
        assert f"{last} -> {op}" in items
    # along the critical path the rows tile the launch from attention's start to qkv's end
    on_path = sum(s.measured_s for s in segs)
    assert on_path == pytest.approx(inp.edges["qkv"][1] - inp.edges["attn"][0], abs=1e-9)
    # the segments agree with pipeline.layer_segments' cut of the same launch (it takes the first
    # gate/up start and the last down-projection end over blocks, the rows medians)
    by = {s.segment: s.measured_s for s in segs}
    assert by["front"] == pytest.approx(inp.segments_s["front"], abs=1.0e-6)
    assert by["experts"] + by["back"] == pytest.approx(inp.segments_s["experts"] + inp.segments_s["back"], abs=2e-6)


def test_bounds_are_bytes_compute_and_latency(committed):
    inp, rs, segs, _ = committed
    by = {r.item: r for r in rs}
    for r in rs:
        assert r.bytes_s == pytest.approx(r.bytes / inp.ceiling)
        assert r.bound_s == pytest.approx(max(r.bytes_s, r.compute_s) + r.hop_s)
    chunks = cp.expert_chunks_per_block(inp)
    for op in ("expert1", "expert2"):
        assert by[op].compute_s == pytest.approx(chunks[op] * inp.chunk_s[op])
    # the layer's weights and KV rows: the experts' bytes are the routed experts', all of them
    exp = next(s for s in segs if s.segment == "experts")
    from megakernel.config import preset

    assert exp.bytes == pytest.approx(inp.distinct * preset(inp.preset).expert_bytes, rel=1e-6)
    # hop rows: the producer's end tail and the flag, never negative; a fused down projection
    # after its own gate/up units has no grid hop
    assert by["expert1 -> expert2"].hop_s == 0
    assert by["unpool -> qkv"].hop_s == pytest.approx(inp.end_tail_s["unpool"] + inp.flag_s)
    # the committed H200 measurements the model reads (2026-11-29 .. 12-01): within their ranges
    assert 0.4e-6 < inp.publish_s < 0.9e-6 and 0.9e-6 < inp.chunk_s["expert1"] < 1.3e-6
    assert 4e12 < inp.ceiling < 5e12 and 0.4e-6 < inp.flag_s < 0.7e-6


def test_levers_largest_first_with_their_arithmetic(committed):
    inp, rs, segs, lvs = committed
    assert [lv.saving_s for lv in lvs] == sorted((lv.saving_s for lv in lvs), reverse=True)
    pre = next(lv for lv in lvs if "prestage" in lv.name)
    from megakernel.plans import plan_for

    plan = plan_for(inp.preset, None, inp.n_sm, tokens=inp.n_tokens)
    ring = plan.ring_stages * plan.stage_bytes * inp.n_sm / inp.ceiling
    # the prestaged chunks remove at most their own waits: gate/up's first ring_stages ring waits
    opening = inp.opening_waits_s[plan.ring_stages]
    assert 0 < opening < inp.ring_wait_s["expert1"]
    assert pre.saving_s == pytest.approx(min(ring, opening))
    fold = next(lv for lv in lvs if "MoE combine" in lv.name)
    assert fold.saving_s < 0  # a token's partials are too many for one block (the fold was not built)
    # the two front levers end at the pooler's bound: together they save the larger, not the sum
    front = [lv for lv in lvs if lv.limit == "pool"]
    assert len(front) == 2 and cp.combined_saving_s(front) == pytest.approx(max(lv.saving_s for lv in front))
    assert cp.combined_saving_s(lvs) == pytest.approx(pre.saving_s + max(lv.saving_s for lv in front)
                                                      + sum(lv.saving_s for lv in lvs if lv.saving_s > 0
                                                            and not lv.limit and lv is not pre and not lv.hypothesis
                                                            and not (lv.measured_s is not None and lv.measured_s <= 0)))
    md = cp.render(inp, rs, segs, lvs)
    for lv in lvs:
        assert lv.name in md
    assert "70% of the roofline" in md and "| front | front (sum) |" in md


def test_the_later_producer_carries_the_hop_and_the_other_side_is_off_the_path(committed):
    inp, _, _, _ = committed
    e = dict(inp.edges)
    # make the pooler end after top-k: gate/up's hop then counts from the pooler, and the router's
    # side (router, its hops, top-k) drops out of the front's sum
    late = e["topk"][1] + 3e-6
    e["pool"] = (e["pool"][0], late)
    moved = dataclasses.replace(inp, edges=e)
    rs = cp.rows(moved)
    by = {r.item: r for r in rs}
    assert "pool -> expert1" in by and "topk -> expert1" not in by
    assert by["pool -> expert1"].measured_s == pytest.approx(e["expert1"][0] - late)
    front = next(s for s in cp.segment_rows(rs) if s.segment == "front")
    assert front.measured_s == pytest.approx(e["expert1"][0] - e["attn"][0])


def test_missing_results_are_named(tmp_path):
    with pytest.raises(ResultsFileError, match="megakernel.timeline"):
        cp.inputs(tmp_path)


def test_cold_code_column_from_the_code_result_and_the_icache_levels(committed):
    """megakernel.code (CPU build, same NVRTC) equals the GPU's megakernel.build in total; each op
    row's cold-code term is its code bytes / 16 x icache.capacity's L2-served cycles / the clock."""
    inp, rs, segs, lvs = committed
    assert inp.kernel_code_bytes and inp.icache_bytes and inp.clock_hz
    assert inp.l2_cpi > inp.sm_cpi > 0 and sum(inp.code_bytes[op] for op in cp.CHAIN) > 0
    by = {r.item: r for r in rs}
    for op in cp.CHAIN:
        assert by[op].code_s == pytest.approx(inp.code_bytes[op] / 16 * inp.l2_cpi / inp.clock_hz)
        assert cp.warm_gain_s(inp, op) == pytest.approx(by[op].code_s * (1 - inp.sm_cpi / inp.l2_cpi))
        assert by[op].bound_s == pytest.approx(max(by[op].bytes_s, by[op].compute_s) + by[op].hop_s)  # not in it
    # the layer's code overflows the SM's cache (the premise of the column)
    assert inp.layer_code_bytes() > inp.icache_bytes
    # roles: each fits beside the code every block runs, and together they hold every front/back op once
    rl = cp.roles(inp)
    common = sum(inp.code_bytes[op] for op in ("expert1", "expert2", "schedule"))
    assert all(common + sum(inp.code_bytes[o] for o in r) <= inp.icache_bytes for r in rl)
    assert sorted(o for r in rl for o in r) == sorted(o for o in cp.CHAIN if o not in ("expert1", "expert2"))
    roles_lv = next(lv for lv in lvs if "blocks in roles" in lv.name)
    on_path = [r for r in rs if "->" not in r.item and not cp._off_path(r, rs)]
    warm = {r.item: min(cp.warm_gain_s(inp, r.item), max(0.0, r.excess_s)) for r in on_path}
    units, per = cp.op_units(inp), {op: inp.n_sm // 3 for r in rl for op in r}  # 132 SMs: 44 a role
    cost = sum((-(-units[r.item] // per[r.item]) - 1) * r.measured_s for r in on_path if r.item in per)
    gain = sum(v for op, v in warm.items() if op in cp.EVERY_BLOCK) + \
        inp.same_role * sum(v for op, v in warm.items() if op in per)
    assert roles_lv.saving_s == pytest.approx(gain - cost) and not roles_lv.hypothesis
    md = cp.render(inp, rs, segs, lvs)
    assert "| cold code us |" in md and "Cold code (megakernel.code" in md


def test_a_stale_code_result_is_named(tmp_path, committed):
    """A megakernel.code whose kernel is not the one the GPU's megakernel.build ran is not used: the
    column is left out, saying why (a GPU run that changed the kernel must not break the report)."""
    import shutil

    from microbench.results import REPO_ROOT, find, load

    src = REPO_ROOT / "reports" / "results"
    for b in ("megakernel.build", "icache.capacity"):
        for f in find(b, src)[-1:]:
            (tmp_path / f.parent.name).mkdir(exist_ok=True)
            shutil.copy(f, tmp_path / f.parent.name / f.name)
    code = load(find("megakernel.code", src)[-1])
    series = tuple(dataclasses.replace(s, metrics={**s.metrics, "kernel_code_bytes": 1234}) for s in code.series)
    dataclasses.replace(code, series=series).save(tmp_path)
    tl = load(find("megakernel.timeline", src)[-1])
    got = cp.cold_code_inputs(tmp_path, "shard8", 16, tl)
    assert set(got) == {"stale"} and "1234 B kernel" in got["stale"] and "stale" in got["stale"]
    assert cp.cold_code_inputs(tmp_path / "none", "shard8", 16, tl) == {}  # no code result: no column
    inp = dataclasses.replace(committed[0], clock_hz=0.0, sources={**committed[0].sources, "code_stale": got["stale"]})
    assert cp.cold_code_lines(inp, cp.rows(inp)) == [f"Cold code: not shown ({got['stale']})."]


def test_the_code_command_refuses_a_malformed_point(capsys):
    from megakernel.cli import main

    for bad in ("shard8:x", "shard9:16", "shard8", "small:0"):
        assert main(["code", "--point", bad]) == 2
        assert "want PRESET:T" in capsys.readouterr().err


def test_the_code_result_is_filed_under_the_gpu_whose_build_matches(tmp_path, capsys):
    """A code result made without a GPU takes the GPU of the megakernel.build that ran the same
    kernel (so the gate files it under that GPU, static, never gated); with no such build it is
    not saved."""
    import shutil

    from megakernel.cli import for_gpu_of_build
    from microbench.results import REPO_ROOT, find, load

    src = REPO_ROOT / "reports" / "results"
    code = load(find("megakernel.code", src)[-1])
    got = for_gpu_of_build(code, src)
    assert got is not None and got.env.gpu == load(find("megakernel.build", src)[-1]).env.gpu
    assert "built without a GPU" in got.notes[-1]
    (tmp_path / "megakernel").mkdir()
    for f in find("megakernel.build", src)[-1:]:
        shutil.copy(f, tmp_path / "megakernel" / f.name)
    series = tuple(dataclasses.replace(s, metrics={**s.metrics, "kernel_code_bytes": 99}) for s in code.series)
    assert for_gpu_of_build(dataclasses.replace(code, series=series), tmp_path) is None
    assert "ran these kernels" in capsys.readouterr().err


def test_the_role_lever_names_the_rounds_a_role_adds(committed):
    inp, rs, _, lvs = committed
    roles_lv = next(lv for lv in lvs if "blocks in roles" in lv.name)
    units = cp.op_units(inp)
    per_role = inp.n_sm // len(cp.roles(inp))
    many = [op for r in cp.roles(inp) for op in r if units[op] > per_role]
    assert many and all(f"{op} {units[op]} units in {-(-units[op] // per_role)} rounds" in roles_lv.how for op in many)


def test_built_levers_carry_their_in_run_ab_and_the_role_split_is_predicted_by_its_rounds(committed):
    """A lever built as a switch shows the newest in-run A/B of it at the timeline's point (the
    first variant less the lever's, per layer launch). The role split's two conditions come from
    results (the ring's block sweep, the SMs' placement or its share by chance), and its
    prediction, the extra rounds of the front's and back's ops against warm code, lands within a
    quarter of what its A/B measured (H200 2026-12-02: -40 us a layer)."""
    inp, rs, segs, lvs = committed
    by = {lv.name.split(" (")[0].split(":")[0]: lv for lv in lvs}
    roles_lv, pre = by["blocks in roles"], by["prestage predicted experts' first chunks during the front"]
    for lv in (roles_lv, pre):
        assert lv.measured_s is not None and lv.measured_by.startswith("megakernel.ab ")
    assert roles_lv.saving_s < 0 and roles_lv.measured_s < 0
    assert abs(roles_lv.saving_s - roles_lv.measured_s) < 0.25 * abs(roles_lv.measured_s)
    assert 0 < inp.same_role < 1 and inp.ring_blocks_fraction and max(inp.ring_blocks_fraction) == inp.n_sm
    md = cp.render(inp, rs, segs, lvs)
    assert "| measured saving per layer us (in-run A/B) |" in md and "Built and timed: " in md
    assert f"{roles_lv.measured_s * 1e6:+.2f} ({roles_lv.measured_by})" in md


def test_ab_savings_read_switch_variants_against_a_plain_first_variant(tmp_path):
    """ab_savings keeps a variant with switches against a first variant without any, per layer
    launch, and skips A/Bs at other points and variants that are source trees."""
    from megakernel.ab import Checked, PointResult, Variant, to_result
    from microbench.results import Env

    env = Env.capture()
    pr = PointResult("shard8", 16, 2048, {"base": Checked(0.0, True), "r": Checked(0.0, True)},
                     {"base": [1.0e-3] * 3, "r": [1.31e-3] * 3}, None, (), {})
    other = PointResult("small", 16, 512, {"base": Checked(0.0, True), "r": Checked(0.0, True)},
                        {"base": [1.0e-3] * 3, "r": [0.5e-3] * 3}, None, (), {})
    vs = [Variant("base", None, ()), Variant("r", None, (("roles", 3),))]
    to_result([pr, other], vs, env=env).save(tmp_path)
    got = cp.ab_savings(tmp_path, "shard8", 16, 2048, 62)
    assert list(got) == [(("roles", 3),)] and got[(("roles", 3),)][0] == pytest.approx(-0.31e-3 / 62)


def test_the_shared_dense_lever_is_warm_code_less_its_control_and_a_measured_loss_refutes_it(committed):
    """Plan.shared_dense=1's prediction is the warm code of each segment's dense ops after its first
    (oproj and unpool pay the cold fetch) plus what the control (shared_dense=2) measured; an A/B
    that measured no saving lists it as refuted, out of the hypotheses' sum (H200 2026-12-02:
    predicted +2.2 us a layer, measured -4.5 us, the control -1.8 us)."""
    inp, rs, segs, lvs = committed
    lv = next(lv for lv in lvs if "Plan.shared_dense=1" in lv.name)
    assert lv.hypothesis and "(oproj, unpool)" in lv.how
    no_ctrl = dataclasses.replace(inp, ab_savings={k: v for k, v in inp.ab_savings.items() if k != (("shared_dense", 2),)})
    bare = next(x for x in cp.levers(no_ctrl, rs) if "Plan.shared_dense=1" in x.name)
    assert "not measured" in bare.how and bare.saving_s > 0
    ctrl = inp.ab_savings[(("shared_dense", 2),)][0]
    assert lv.saving_s == pytest.approx(bare.saving_s + ctrl)
    md = cp.render(inp, rs, segs, lvs)
    assert lv.measured_s <= 0 and "Refuted by its A/B: the dense ops through one copy" in md
    assert "Plan.shared_dense=1), if their conditions hold" not in md
    won = dataclasses.replace(lv, measured_s=1e-6)
    md2 = cp.render(inp, rs, segs, [won if x is lv else x for x in lvs])
    assert "Refuted by its A/B" not in md2 and "With the hypotheses too (the dense ops through one copy" in md2


def test_the_attention_by_head_lever_counts_its_rounds_and_merge_and_carries_its_ab(committed):
    """Plan.attn_heads saves the hop to the combine and the combine op, less each unit's extra
    staging rounds (a q head's 129-key run in rounds of 64 against a kv head's 32 keys in one), one
    block's read of its head's 16 partials and the ticket's release and round trip. Its A/B (H200
    2026-12-03 13:52Z, shard8 T=16) measured a loss, so it is out of the positive levers' sum."""
    inp, rs, segs, lvs = committed
    lv = next(lv for lv in lvs if "Plan.attn_heads" in lv.name)
    by = {r.item: r for r in rs}
    saved = cp.hop_cost_s(inp, "attn", "attn_combine") + by["attn_combine"].measured_s
    assert "3 rounds of 64 against 1 of 32" in lv.how and "16 partials" in lv.how
    assert 0 < saved - lv.saving_s < saved
    assert lv.measured_s is not None and lv.measured_s < 0 and lv.measured_by.startswith("megakernel.ab 2026-12-03")
    assert cp.combined_saving_s([lv]) == 0.0 and cp.combined_saving_s([dataclasses.replace(lv, measured_s=None)]) > 0


PER_OP_OLD = """## Per op (instructions that ran, warp instructions executed, stall samples)

| op | instructions | executed | samples | share | no_inst | top3 |
|:--|--:|--:|--:|:--|--:|:--|
| router | 5 | 50 | 40 | 40.0% | 20 | no_inst 50% |
"""
PER_OP_NEW = """# Stall reasons ...

## Top 2 source positions

| source | samples |
|:--|--:|
| router mk/wait.cuh:65 | 10 |

## Per op (instructions that ran, warp instructions executed, stall samples: at the op's copy waits, ...)

| op | instructions | executed | samples | share | copy_wait | own | own_no_inst | own_long_sb | own_top3 |
|:--|--:|--:|--:|:--|--:|--:|:--|:--|:--|
| router | 5 | 50 | 40 | 40.0% | 10 | 30 | 50% | 20% | no_inst 50%, long_sb 20% |
| qkv_rope | 4 | 40 | 60 | 60.0% | 0 | 60 | 0% | 40% | long_sb 40% |
| argmax | 0 | 0 | 0 | 0.0% | 0 | 0 |  |  |  |
"""


def test_the_per_op_ncu_account_is_read_from_the_newest_summary_of_the_launch(tmp_path):
    d = tmp_path / "megakernel"
    d.mkdir()
    assert cp.ncu_ops(tmp_path, "shard8", 31) == {}  # no summary: no account
    (d / "ncu-mega-shard8-L31-20261201T0100Z-aaaaaaa-stalls.md").write_text(PER_OP_NEW)
    (d / "ncu-mega-shard8-L31-20261202T0100Z-bbbbbbb-stalls.md").write_text(PER_OP_OLD)  # newer, no split: skipped
    (d / "ncu-mega-shard8-L30-20261203T0100Z-ccccccc-stalls.md").write_text(PER_OP_OLD)  # another launch
    (d / "ncu-mega-small-L31-20261203T0100Z-ddddddd-stalls.md").write_text(PER_OP_OLD)  # another preset
    got = cp.ncu_ops(tmp_path, "shard8", 31)
    assert got["sources"]["ncu"].startswith("ncu-mega-shard8-L31-20261201T0100Z-aaaaaaa-stalls.md")
    assert set(got["ops"]) == {"router", "qkv"}  # by the chain's names (qkv_rope is qkv); ops not in it dropped
    assert got["ops"]["router"] == {"samples": 40, "copy_wait": 10, "own": 30, "own_no_inst": 50.0,
                                    "own_long_sb": 20.0, "own_top3": "no_inst 50%, long_sb 20%"}
    assert cp.ncu_ops(tmp_path, "shard8", 32) == {}
    (d / "ncu-mega-shard8-L31-20261204T0100Z-eeeeeee-stalls.md").write_text(PER_OP_NEW.replace("| 10 | 30 |", "| x | 30 |"))
    with pytest.raises(ResultsFileError, match="20261204T0100Z-eeeeeee-stalls.md: the per-op row of 'router'"):
        cp.ncu_ops(tmp_path, "shard8", 31)


def test_the_ncu_account_sits_beside_each_front_and_back_ops_excess(committed):
    inp, rs, segs, lvs = committed
    assert inp.ncu_ops, "the committed per-op account of the middle launch (ncu-stalls --preset)"
    for op, n in inp.ncu_ops.items():
        assert n["copy_wait"] + n["own"] == n["samples"] and 0 <= n["own_no_inst"] + n["own_long_sb"] <= 100
    lines = cp.ncu_lines(inp, rs)
    on_path = [r for r in rs if "->" not in r.item and r.segment != "experts"]
    assert sum(ln.startswith("| ") and ln.split("|")[1].strip() in cp.CHAIN for ln in lines) == len(on_path)
    # the summary's shares are the own-sample-weighted means of the rows'
    own = sum(inp.ncu_ops[r.item]["own"] for r in on_path)
    fetch = sum(inp.ncu_ops[r.item]["own"] * inp.ncu_ops[r.item]["own_no_inst"] for r in on_path) / own
    assert f"of the own work {fetch:.0f}% waits on instruction fetch" in lines[-1]
    # a handmade account: one op fetch-bound, one load-bound, named so
    ops = {r.item: {"samples": 10, "copy_wait": 0, "own": 10, "own_no_inst": 0.0, "own_long_sb": 0.0, "own_top3": ""}
           for r in on_path}
    ops["router"] = {**ops["router"], "own_no_inst": 60.0}
    ops["attn"] = {**ops["attn"], "own_long_sb": 90.0}
    last = cp.ncu_lines(dataclasses.replace(inp, ncu_ops=ops), rs)[-1]
    assert "mostly fetching code (30% or more): router." in last and "Mostly waiting on loads: attn." in last
    assert cp.ncu_lines(dataclasses.replace(inp, ncu_ops={}), rs) == []
    assert "What the front's and the back's ops stall on" in cp.render(inp, rs, segs, lvs)
