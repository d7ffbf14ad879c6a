"""The issue-45 rows of the study-vs-ours tables, on the committed H200 results: each compares
like with like or says what differs, and the figures that misled now show the comparable number.
Also: fractions of bound are never negative and beaten bounds are flagged; the cross-check rows.

No committed figure is asserted: a new GPU run changes them. A row is checked against the quantity
it must show (the derived value, constant or adoption it names), read by another path, and for the
labels and notes that make it comparable."""
from __future__ import annotations

import pytest

from microbench.results import REPO_ROOT
from reports import crosscheck, paper, study
from microbench.fmt import fmt_fraction

ROOT = REPO_ROOT / "reports" / "results"


@pytest.fixture(scope="module")
def ctx():
    from microbench.pins import load_pins
    from microbench.tune import collect
    from reports import megakernel as mk
    from reports.build import Catalog, Context

    if not (ROOT / "sync").is_dir():
        pytest.skip("no committed results in this checkout")
    cat = Catalog.load(ROOT, "NVIDIA H200")
    _, entries = collect(cat.root, cat.gpu, pins=load_pins(cat.gpu))
    base = [r for b, rs in cat.runs.items() if b.startswith("model.") for _, r in rs]
    rows = mk.with_fastest_baselines(mk.step_rows(cat.step_sources()), base)
    tl = cat.latest("megakernel.timeline")
    return Context(cat, REPO_ROOT / "reports" / "figures", REPO_ROOT / "reports", entries, None, rows,
                   tl[1] if tl else None)


def _row(ctx, fid):
    f = next(x for x in paper.load()["figures"] if x["id"] == fid)
    r = study.rows(ctx, [f])[0]
    return r["ours (NVIDIA H200)"], r["like for like?"], r["how ours is obtained"]


def _kib(text):
    """'128.2 KiB (128.2-144.2 KiB)' -> (value, low, high) in KiB."""
    import re

    v, lo, hi = (float(x) for x in re.match(r"([\d.]+) KiB \(([\d.]+)-([\d.]+) KiB\)", text).groups())
    return v, lo, hi


def _ns(text):
    import re

    v, lo, hi = (float(x) for x in re.match(r"([\d.]+) ns \(([\d.]+)-([\d.]+) ns\)", text).groups())
    return v, lo, hi


def _rederived(ctx, bench, key):
    from microbench import rederive

    return rederive.derived(ctx.cat.latest(bench)[1])[key]


def test_icache_rows(ctx):
    ours, like, how = _row(ctx, "icache.sm_capacity")
    # the tuned icache_sm_bytes (a plateau of the 1-warp curve), its spread containing it
    v, lo, hi = _kib(ours)
    assert lo <= v <= hi and like == "yes" and "icache_sm_bytes" in how
    assert v * 1024 == pytest.approx(ctx.tune_entries["icache_sm_bytes"].value, abs=0.06 * 1024)
    ours, like, _ = _row(ctx, "icache.shrunk_block_ratio")
    # the 100 KB block's own spliced/solo ratio beside the study's ratio (was "1.08x" beside 20 KB)
    want = _rederived(ctx, "icache.spliced", "spliced_block_a_ratio_w12_100K_20K").value
    assert float(ours.split("x")[0]) == pytest.approx(want, abs=0.006) and like.startswith("yes")


def test_weights_rows(ctx):
    from microbench.adopt import load_adopted

    ours, like, how = _row(ctx, "weights.ring_stage_bytes")
    # what the build runs, beside the adopted revision's budget
    import re

    built = re.search(r"(\d+) x ([\d.]+ KiB) built", how)
    assert built and ours == built.group(2), (ours, how)
    assert f"adopted revision {load_adopted(ctx.cat.gpu).revision}" in how
    ours, like, how = _row(ctx, "weights.hot_expert_bytes")
    import re

    from microbench.weights.bench import STUDY_EXPERT_BYTES
    from microbench.fmt import fmt

    # the bytes our rule would bet on, in the study's unit, beside what the measured bet prefetched;
    # whether it bets follows its break-even overlap
    worth = _rederived(ctx, "weights.hot_experts", "hot_experts_worth_prefetching").value
    be = ctx.tune_entries["hot_expert_break_even_overlap"].value
    assert ours == fmt(worth * STUDY_EXPERT_BYTES, "B") and ("never bet" in how) == (be >= 1), (ours, how)
    assert re.search(r"prefetches \d+ experts \([\d.]+ MiB\)", how), how
    ours, like, how = _row(ctx, "weights.hot_expert_saving_share")
    assert ours.endswith("%") and 0 <= float(ours[:-1]) <= 100 and like.startswith("yes")  # a share beside a share


def test_sync_and_xgpu_rows(ctx):
    ours, like, how = _row(ctx, "sync.acquire_poll")
    v, lo, hi = _ns(ours)  # the value inside its spread (was 159 ns beside 159.5-160.9 ns)
    assert lo <= v <= hi
    assert v * 1e-9 == pytest.approx(_rederived(ctx, "sync.flags", "poll_load_latency_s").value, rel=2e-3)
    ours, like, how = _row(ctx, "sync.poll_behind_bulk")
    # every SM loaded, not the poller's SM alone (nothing queues there)
    loaded = _rederived(ctx, "sync.flags", "flag_latency_all_sms_loaded_s").value
    assert ours.endswith(" us") and float(ours.split()[0]) * 1e-6 == pytest.approx(loaded, rel=2e-3) and "ns" in how
    ours, like, how = _row(ctx, "sync.fence_loaded")
    assert ours.endswith(" us") and like.startswith("no:") and "every SM, 64 KiB" in how
    ours, like, how = _row(ctx, "xgpu.poll_behind_bulk")
    # the local-HBM case; the every-SM-reads-the-peer case is a queue for NVLink, labelled in the note
    assert ours.endswith(" us") and "load-all-both/local" in how and "NVLink bandwidth" in how
    ours, like, how = _row(ctx, "sync.gpu_drift")
    # the largest stop (the study's "up to"), with p99 and the timer's step beside it
    import re

    p99 = re.search(r"p99 ([\d.]+) (us|ns)", how)
    assert ours.endswith(" us") and p99 and "%globaltimer stepped every" in how, how
    assert float(ours.split()[0]) >= float(p99.group(1)) * (1e-3 if p99.group(2) == "ns" else 1)


def test_throughput_rows_are_accepted_tokens_and_the_verify_ratio_is_beside_the_study_s(ctx):
    from reports import megakernel as mk

    ours, like, how = _row(ctx, "headline.megakernel_tok_s")
    got = float(ours.split()[0].replace(",", ""))
    assert like.startswith("no:") and "6.6 accepted tokens per step" in how and "assumed" in how
    measured = mk.pick_decode(mk.decode_rows([r for _, r in ctx.cat.runs.get("megakernel.decode", [])]), "mega")
    if measured is not None:
        # a GPU run of the device loop: its accepted tokens/s, the projection only beside it
        assert "MEASURED" in how and "PROJECTION" in how and got == pytest.approx(measured.tok_s, rel=2e-3)
    else:
        # 6.6 accepted tokens / a megakernel step (not 16 tokens processed)
        megas = [r for r in ctx.step_rows if r.impl == "mega" and r.preset == "shard8" and r.tokens == 16]
        assert any(got == pytest.approx(6.6 / r.step_s, rel=2e-3) for r in megas), (got, [r.step_s for r in megas])
    ours, like, how = _row(ctx, "headline.verify_ratio")

    base, mega = mk.pick(ctx.step_rows, "best_baseline", 16), mk.pick(ctx.step_rows, "mega", 16)
    assert like == "yes" and "chain" in how  # chain / mega, beside the study's 2.06x
    assert float(ours.rstrip("x")) == pytest.approx(base.step_s / mega.step_s, abs=0.006)


def test_every_row_with_ours_says_whether_it_is_like_for_like(ctx):
    for r in study.rows(ctx, paper.load()["figures"]):
        if r["ours (NVIDIA H200)"] not in ("-",):
            assert r["like for like?"] in ("yes",) or r["like for like?"].startswith(("yes ", "no: ")), r


def test_fraction_of_bound_cells():
    from megabench_synth import series

    from microbench.results import Bound

    ok = series("a", 2e-6, rel_noise=0.0, bound=Bound("time", 1e-6, "s", "x"))
    beaten = series("b", 1e-6, bound=Bound("time", 2e-6, "s", "x"))
    neg = series("c", -5e-10, rel_noise=0.0, bound=Bound("time", 1e-6, "s", "x"))
    assert fmt_fraction(ok) == "50.0%"
    assert "bound beaten" in fmt_fraction(beaten) and any("not a bound" in w for w in beaten.warnings)
    assert neg.fraction_of_bound is None and fmt_fraction(neg) == "" and neg.warnings
    import dataclasses

    legacy = dataclasses.replace(neg, fraction_of_bound=-1939.2)  # as recorded before 2026-12
    assert "n/a" in fmt_fraction(legacy)


def test_cross_check_rows(ctx):
    rows = {(r["class"], r["quantity"], r["independent"][:12]): r for r in crosscheck.rows(ctx)}
    assert {r["class"] for r in rows.values()} >= {"basics", "icache", "weights", "sync", "clocks", "xgpu"}
    end = next(r for k, r in rows.items() if k[1] == "end of the L2 bandwidth plateau")
    assert "gpu-benches" in end["independent"]
    next(r for k, r in rows.items() if k[1] == "L2 plateau read bandwidth")  # shown, agreeing or not
    # whether ours agrees with the independent figure is a measurement (the report shows it); every
    # row gives a verdict, and one that disagrees says so
    assert all(r["agree?"] in ("yes", "NO") or r["agree?"].startswith(("differs", "not computed")) for r in rows.values())
    assert not any(r["agree?"] == "not computed" for r in rows.values())
    from microbench.adopt import load_adopted
    from microbench.pins import load_pins

    st = crosscheck.stability_rows(ctx)
    assert {r["constant"].strip("`") for r in st} >= {"ring_stages", "evict_first_pays", "pdl_pays"}
    assert any(r["verdict"] == "pinned" for r in st) == bool(load_pins(ctx.cat.gpu))
    lines = "\n".join(crosscheck.adoption_lines(ctx))
    assert f"adopted revision {load_adopted(ctx.cat.gpu).revision}" in lines
    assert ("pinned" in lines) == bool(load_pins(ctx.cat.gpu))


def test_a_computed_figure_must_name_a_function_of_the_study():
    from microbench.errors import ResultsFileError
    from reports.study import check_computed

    check_computed([{"id": "weights.ring", "ours": {"kind": "computed", "name": "ring_built"}}])
    with pytest.raises(ResultsFileError, match="'nope' is not in reports/study.py COMPUTED"):
        check_computed([{"id": "weights.ring", "ours": {"kind": "computed", "name": "nope"}}])
