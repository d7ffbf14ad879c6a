"""megakernel.critical_path on a fixed copy of H200 results (tests/fixtures/critical_path: trimmed
copies of the results the model reads, so that a new GPU run changes nothing here) and on handmade
inputs."""
from __future__ import annotations

import dataclasses
import gzip
import json
import statistics
from pathlib import Path

import pytest

from megakernel import critical_path as cp
from microbench.errors import ResultsFileError
from microbench.results import find, load

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "critical_path"


def _fixed(benchmark: str):
    (path,) = find(benchmark, FIXTURE)
    return load(path)


@pytest.fixture(scope="module")
def committed():
    inp = cp.inputs(FIXTURE)
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
    # the inputs are the results' own values: the derived ones as written, the publish span the
    # median of the detail trace's publish spans
    assert inp.ceiling == _fixed("weights.read_ceiling").derived["read_ceiling_bytes_per_s"].value
    assert inp.flag_s == _fixed("sync.flags").derived["flag_latency_s"].value
    assert inp.fence_s == _fixed("sync.fences").derived["fence_acq_rel_gpu_loaded_s"].value
    assert inp.l2_rate == _fixed("weights.l2").derived["l2_bandwidth_bytes_per_s"].value
    with gzip.open(FIXTURE / "megakernel" / "timeline-detail-fixture.trace.json.gz", "rt") as f:
        spans = json.load(f)["traceEvents"]
    assert inp.publish_s == pytest.approx(statistics.median(e["dur"] for e in spans if e["name"] == "publish") * 1e-6)


def test_levers_largest_first_with_their_arithmetic(committed):
    inp, rs, segs, lvs = committed
    assert [lv.saving_s for lv in lvs] == sorted((lv.saving_s for lv in lvs), reverse=True)
    fold = next(lv for lv in lvs if "MoE combine" in lv.name)
    assert fold.saving_s < 0  # a token's partials are too many for one block (the fold was not built)
    # the two front levers end at the pooler's bound: together they save the larger, not the sum
    front = [lv for lv in lvs if lv.limit == "pool"]
    assert len(front) == 2 and cp.combined_saving_s(front) == pytest.approx(max(lv.saving_s for lv in front))
    assert cp.combined_saving_s(lvs) == pytest.approx(max(lv.saving_s for lv in front)
                                                      + sum(lv.saving_s for lv in lvs if lv.saving_s > 0 and not lv.limit))
    assert cp.combined_saving_s([dataclasses.replace(lv, saving_s=-1e-6) for lv in lvs]) == 0.0
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
    row's cold-code term is its code bytes / 16 x icache.capacity's L2-served cycles / the clock,
    a column beside the bound, not in it."""
    inp, rs, segs, lvs = committed
    assert inp.kernel_code_bytes and inp.icache_bytes and inp.clock_hz
    assert inp.l2_cpi > inp.sm_cpi > 0 and sum(inp.code_bytes[op] for op in cp.CHAIN) > 0
    by = {r.item: r for r in rs}
    for op in cp.CHAIN:
        assert by[op].code_s == pytest.approx(inp.code_bytes[op] / 16 * inp.l2_cpi / inp.clock_hz)
        assert by[op].bound_s == pytest.approx(max(by[op].bytes_s, by[op].compute_s) + by[op].hop_s)  # not in it
    # the fixture's layer code overflows the SM's cache (the premise of the column)
    assert inp.layer_code_bytes() > inp.icache_bytes
    md = cp.render(inp, rs, segs, lvs)
    assert "| cold code us |" in md and "Cold code (megakernel.code" in md


def test_a_stale_code_result_is_named(tmp_path, committed):
    """A megakernel.code whose kernel is not the one the GPU's megakernel.build ran is not used: the
    column is left out, saying why (a GPU run that changed the kernel must not break the report)."""
    import shutil

    src = FIXTURE
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

    src = FIXTURE
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
    assert inp.ncu_ops, "the fixture's per-op account of the middle launch (ncu-stalls --preset)"
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
