"""The report renders from synthetic and committed results, tolerates absent classes, and shows
the study's figures beside ours; the study's figures are complete, well-formed data."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from megabench_synth import class_results, env, save_all, series

from microbench.results import REPO_ROOT, Bound, Derived, Result, Series
from reports import megakernel as mk
from reports import paper
from reports.build import build
from microbench.fmt import fmt, fmt_range


def _icache_curve(date="2026-11-29T10:00:00Z"):
    ss = []
    for warps in (1, 4):
        for kb in (4, 8, 16, 32, 64, 128, 256):
            level = 1.0 if kb <= 32 else (3.0 if kb <= 128 else 9.0)
            ss.append(series(f"cpi/{kb}KiB/w{warps}", level, params={"code_bytes": kb * 1024, "warps": warps},
                             unit="cycles", timer="clock64", seed=kb + warps))
    der = {"icache_l0_bytes": Derived(32 * 1024 * 1.4, "B", "plateaus", (40000, 50000), ("cpi",)),
           "icache_sm_bytes": Derived(128 * 1024 * 1.4, "B", "plateaus", (170000, 190000), ("cpi",)),
           }
    return Result("icache.capacity", env(date=date), tuple(ss), der)


def _spliced():
    der = {f"spliced_ratio_w{w}_100K_{b}K": Derived(v, "", "A+B / (A alone + B alone)", (v - 0.03, v + 0.03))
           for w, b, v in ((1, 100, 1.31), (12, 100, 1.45), (12, 20, 1.08))}
    der["spliced_block_a_ratio_w12_100K_20K"] = Derived(1.001, "", "A spliced / A alone", (0.99, 1.012))
    return Result("icache.spliced", env(), (series("spliced/x", 1e-5),), der)


def _skew():
    rng = np.random.default_rng(0)
    s = Series.from_samples("skew/globaltimer", rng.normal(300e-9, 80e-9, 132) + 1e-6, timer="globaltimer", unit="s")
    return Result("clocks.skew", env(), (s,), {"sm_skew_ns": Derived(210.0, "ns", "p90-p10 of stamps", (190, 230))})


def _megakernel():
    out = []
    rows = []
    for impl, t, launches in (("torch_eager", 12e-3, 1400), ("torch_graph", 8e-3, 1400), ("chain", 9e-3, 700),
                              ("mega", 4e-3, 62), ("mega+none", 5e-3, 62)):
        rows.append(series(f"step/{impl}/shard8/T16", t, params={"impl": impl, "preset": "shard8", "tokens": 16,
                                                                 "context": 4096},
                           bound=Bound("time", 3e-3, "s", "bytes_per_step / read ceiling"),
                           metrics={"launches_per_step": launches, "bytes_per_step": int(3e-3 * 4e12)}))
    out.append(Result("model.baselines", env(), tuple(r for r in rows if r.params["impl"].startswith("torch_"))))
    out.append(Result("megakernel.step", env(), tuple(r for r in rows if r.params["impl"].startswith(("chain", "mega")))))
    tl = []
    for i, (ph, a, b) in enumerate((("attention", 0, 20e-6), ("gemm1", 20e-6, 40e-6), ("gemm2", 40e-6, 60e-6),
                                    ("combine", 65e-6, 80e-6))):
        tl.append(series(f"tl/{ph}/start", a + 1e-6, params={"phase": ph, "edge": "start"}, timer="globaltimer",
                         n=132, seed=2 * i, rel_noise=0.05))
        tl.append(series(f"tl/{ph}/end", b, params={"phase": ph, "edge": "end"}, timer="globaltimer", n=132,
                         seed=2 * i + 1, rel_noise=0.05))
    # the paper's profiler figures are the megakernel's own (not the clocks microbenchmark's)
    out.append(Result("megakernel.timeline", env(), tuple(tl),
                      {"profiler_overhead_fraction": Derived(0.004, "", "profiled / unprofiled step - 1", None)}))
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("report")
    root = tmp_path / "results"
    _icache_curve().save(root)
    _spliced().save(root)
    Result("clocks.instrumentation", env(), (series("stamp", 1e-6),),
           {"profiler_cost_fraction": Derived(0.0001, "", "cost / step", None)}).save(root)
    _skew().save(root)
    save_all(_megakernel(), root)
    Result("tests.run", env(), (series("pytest/duration", 300.0, n=1, timer="host"),),
           {"passed": Derived(630.0, "count", "pytest"), "failed": Derived(0.0, "count", "pytest"),
            "skipped": Derived(12.0, "count", "pytest"), "exit_code": Derived(0.0, "", "exit")}).save(root)
    # two runs of basics.copy: the newer one 20% slower -> the changes table shows a regression
    Result("basics.copy", env(date="2026-11-28T00:00:00Z"), (series("copy/x", 1e-3, seed=1),)).save(root)
    Result("basics.copy", env(date="2026-11-29T00:00:00Z"), (series("copy/x", 1.2e-3, seed=2),)).save(root)
    out = tmp_path / "out"
    (tmp_path / "nobench").mkdir()
    p = build(root, out, bench_dir=tmp_path / "nobench", gpu_present=False)
    return p.read_text(), out


def _body(text: str) -> str:
    """Everything before the appendices: the summary, the class and megakernel sections."""
    return text.split("\n## Appendix")[0]


def _section(text: str, heading: str) -> str:
    """The `## ` section whose heading line contains `heading` (the contents list is not one)."""
    for part in text.split("\n## ")[1:]:
        if heading.removeprefix("## ") in part.split("\n", 1)[0]:
            return part
    raise AssertionError(f"no section {heading!r}")


def test_banner_and_sections(rendered):
    text, out = rendered
    assert text.startswith("# megabench report: NVIDIA H200")
    assert "**Rendered without a GPU**" in text.split("## Summary")[0]
    for h in ("## Summary", "Instruction cache (`icache`)", "Weight ring", "Synchronisation", "Clocks, skew",
              "The megakernel and its baselines", "## What changed since the baseline", "## Tuned constants",
              "## Appendix A. Ablations", "## Appendix C. Raw series", "## Appendix F. Environment and commits"):
        assert h in text, h
    # absent classes say so instead of failing
    weights = text.split("(`weights`)")[2].split("\n## ")[0]
    assert "**Not measured yet**" in weights and "not measured yet" in weights


def test_summary_is_the_first_screen(rendered):
    """The first heading after the title is the summary, and it holds the megakernel table, the class
    rows and the trust box before anything else."""
    text, _ = rendered
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("## "))
    assert lines[first] == "## Summary" and first < 6
    summ = _section(text, "## Summary")
    assert "### The megakernel against every baseline" in summ and "### How sure we are" in summ
    row = next(line for line in summ.splitlines() if "naive torch expression, eager" in line)
    assert "11.98 ms" in row and "1400" in row and "3.00x" in row  # 12 / 4 ms
    row = next(line for line in summ.splitlines() if "megakernel (ours)" in line)
    assert "75.1%" in row and "shard8 T=16 ctx=4096" in row  # roofline 3 ms / 3.995 ms
    assert "mega+none" not in summ  # the ablation lives in Appendix A
    for cls in ("basics", "icache", "weights", "sync", "clocks", "xgpu"):
        assert f"| `{cls}`" in summ, cls
    assert "Constants: " in summ and "Gate:" in summ
    assert "Tests (`tests.run` of 2026-11-29, abc1234, on NVIDIA H200): 630 passed, 12 skipped in " in summ


def test_no_long_lines_in_summary_and_sections(rendered):
    text, _ = rendered
    long = [line[:80] for line in _body(text).splitlines() if len(line) > 300]
    assert not long, long


def test_no_table_appears_twice(rendered):
    text, _ = rendered
    tables, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            tables.append("\n".join(cur))
            cur = []
    assert len(tables) == len(set(tables))
    # every step time is shown once: the summary (main builds) or Appendix A (ablation)
    assert text.count("naive torch expression, eager") == 1 and text.count("| mega+none") == 1


def test_paper_figures_beside_ours(rendered):
    text, _ = rendered
    row = next(line for line in text.splitlines() if line.startswith("| spliced / solo slowdown"))
    assert "1.57x" in row and "1.450x" in row and "spliced_ratio_w12_100K_100K" in row
    like = row.split("|")[4].strip()  # "like for like?": a long answer is a numbered note below the table
    assert like.startswith("yes") or any(line.startswith(f"- {like} yes") for line in text.splitlines())
    # the study's "20 KB gave the other block its solo speed back" is a ratio beside a ratio: block A's own
    # spliced / solo time (1.001x), not the whole splice's 1.08x and not a size
    # the size itself is a parameter of our sweep, not a counterpart: it is listed with the figures that have none
    assert "shrinking one block" in text.split("Appendix D.")[-1]
    row = next(line for line in text.splitlines() if line.startswith("| the 100 KB block spliced with a 20 KB"))
    assert "| 1x |" in row and "1.001x (0.990x - 1.012x)" in row  # the study's 1.0 as the study gives it
    row = next(line for line in text.splitlines() if line.startswith("| profiler cost as a share"))
    assert "2.8%" in row and "0.4%" in row
    assert "8x GB300 (Blackwell Ultra), TP8" in text and "ours (NVIDIA H200)" in text
    row = next(line for line in text.splitlines() if line.startswith("| instruction cache per SM"))
    assert "128 KiB" in row and "179.2 KiB" in row  # study's 128 KB; ours 128 KiB x 1.4
    row = next(line for line in text.splitlines() if line.startswith("| decode step time, megakernel"))
    assert "5.9 ms" in row and "3.995 ms" in row


def test_series_table_and_plots(rendered):
    text, out = rendered
    assert "| cpi/4KiB/w1" in text and "clock64" in text
    figs = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert any(f.startswith("icache.capacity-code-bytes") for f in figs)
    assert any(f.startswith("clocks.skew-skew-globaltimer-hist") for f in figs)
    assert "megakernel-timeline.png" in figs and "megakernel-step-times.png" in figs
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (out / link).is_file(), link


def test_megakernel_section_and_ablation_appendix(rendered):
    text, _ = rendered
    mk_sec = _section(text, "The megakernel and its baselines")
    assert "| gemm2" in mk_sec and "megakernel-step-times.png" in mk_sec
    abl = _section(text, "## Appendix A. Ablations")
    row = next(line for line in abl.splitlines() if "| mega+none" in line)
    assert "+25.0%" in row.replace(" ", "") or "+25" in row  # 5 ms vs the default build's 4 ms


def test_new_baseline_kinds_show_up_by_themselves(tmp_path):
    """An impl the report has never heard of (and the peer) appears in the summary under its own
    name; the torch ones are labelled as the naive expression they are."""
    root = tmp_path / "r"
    base = _megakernel()
    extra = (series("step/peer", 5e-3, params={"impl": "peer", "preset": "shard8", "tokens": 16, "context": 4096},
                    metrics={"launches_per_step": 9}),
             series("step/frob", 6e-3, params={"impl": "frobnicator", "preset": "shard8", "tokens": 16,
                                                "context": 4096}))
    save_all(base + [Result("megakernel.step", env(date="2026-11-29T11:00:00Z"), base[1].series + extra)], root)
    (tmp_path / "nb").mkdir()
    text = build(root, tmp_path / "o", bench_dir=tmp_path / "nb", gpu_present=False).read_text()
    summ = _section(text, "## Summary")
    peer = next(line for line in summ.splitlines() if "peer: Triton fused MoE" in line)
    assert "1.25x" in peer and [c.strip() for c in peer.split("|")][4] == "9"  # 5 / 4 ms; 9 launches
    assert "| frobnicator " in summ
    assert summ.index("megakernel (ours)") < summ.index("peer:") < summ.index("kernel chain") < summ.index("naive")


def test_study_rows_without_counterpart_only_in_the_appendix(rendered):
    text, _ = rendered
    assert "no counterpart measured here" not in _body(text)
    app = _section(text, "## Appendix D.")
    assert "`model.layers`" in app and "`shape.warps_per_block`" in app
    n = sum(1 for f in paper.load()["figures"] if f.get("ours") is None)
    assert sum(1 for line in app.splitlines() if line.startswith("- `")) == n


def test_rules_are_notes_not_repeated_per_row(tmp_path):
    rule = "a long shared rule " * 8
    der = {f"k{i}": Derived(float(i), "s", rule, None) for i in range(5)}
    root = tmp_path / "r"
    Result("sync.flags", env(), (series("s", 1e-6),), der).save(root)
    text = build(root, tmp_path / "o", bench_dir=root, gpu_present=False).read_text()
    sec = _section(text, "(`sync`)")
    assert sec.count(rule.strip()) == 1
    assert sum(1 for line in sec.splitlines() if line.startswith("| `sync.flags`") and "| [1] " in line) == 5


def test_critical_path_table_in_the_section_or_appendix_b(tmp_path, monkeypatch):
    """megakernel.critical_path.table's markdown: prose wrapped, a narrow table in the megakernel's
    section, a wide one in Appendix B; results without what the model reads: said, not hidden."""
    import types

    from microbench.errors import ResultsFileError

    root = tmp_path / "r"
    save_all(_megakernel(), root)
    (tmp_path / "nb").mkdir()
    cp = types.SimpleNamespace(table=lambda root: "A long line of prose. " * 30
                               + "\n\n| segment | us |\n|---|---|\n| front | 31.2 |\n")
    monkeypatch.setattr("reports.build.critical_path", cp)
    text = build(root, tmp_path / "o3", bench_dir=tmp_path / "nb", gpu_present=False).read_text()
    sec = _section(text, "The megakernel and its baselines")
    assert "### Critical path of a layer" in sec and "| front | 31.2 |" in sec
    assert max(len(line) for line in sec.splitlines()) <= 300
    cp.table = lambda root: "| segment | how |\n|---|---|\n| front | " + "x" * 400 + " |\n"
    text = build(root, tmp_path / "o4", bench_dir=tmp_path / "nb", gpu_present=False).read_text()
    assert "see Appendix B" in _section(text, "The megakernel and its baselines")
    assert "| front | xxx" in _section(text, "## Appendix B.")

    def missing(root):
        raise ResultsFileError("no megakernel.timeline result")

    cp.table = missing
    text = build(root, tmp_path / "o5", bench_dir=tmp_path / "nb", gpu_present=False).read_text()
    assert "Not measured yet: no megakernel.timeline result." in _section(text, "The megakernel and its baselines")


def test_impl_names_and_configurations_to_come():
    """The names the baselines may take (naive_torch_*, peer_compile, chain_nopdl) and a routing
    field in the configuration render without touching the report."""
    assert mk.impl_label("naive_torch_eager") == mk.impl_label("torch_eager") == "naive torch expression, eager"
    assert mk.is_naive("naive_torch_other") and mk.impl_label("naive_torch_other") == "naive torch expression (other)"
    order = sorted(["naive_torch_compile", "chain_nopdl", "frob", "peer_compile", "mega", "chain", "peer"],
                   key=mk.impl_rank)
    assert order == ["mega", "peer", "peer_compile", "chain", "chain_nopdl", "frob", "naive_torch_compile"]
    assert mk.config_label(("shard8", 16, 2048, 1, "real")) == "shard8 T=16 ctx=2048 real"
    assert mk.config_label(("shard8", 16, 2048, 1, "forced")) == mk.config_label(("shard8", 16, 2048, 1))
    assert sorted([("small", 1, 512, 1, "forced"), ("shard8", 1, 2048, 1, "real"), ("shard8", 16, 2048, 1, "forced")],
                  key=mk.config_rank)[0] == ("shard8", 16, 2048, 1, "forced")


def test_op_pivot():
    d = {f"idle_wait_{op}_s": Derived(1e-6, "s", f"time in wait_{op}") for op in ("attn", "attn_combine", "qkv")}
    d["publish_qkv_s"] = Derived(2e-6, "s", "publish")
    d["other"] = Derived(1.0, "", "x")
    cols, table, rest = mk.op_pivot(d, ("qkv", "attn", "attn_combine"))
    assert cols == ["idle_wait"] and list(table) == ["qkv", "attn", "attn_combine"]
    assert table["attn_combine"]["idle_wait"] == "idle_wait_attn_combine_s"
    assert set(rest) == {"publish_qkv_s", "other"}


def test_changes_table_flags_the_regression(rendered):
    text, _ = rendered
    sec = text.split("## What changed since the baseline")[1].split("\n## ")[0]
    assert "`basics.copy`: abc1234 (2026-11-29 00:00Z) vs the run before it, abc1234 (2026-11-28 00:00Z)" in sec
    assert "REGRESSION" in sec


def test_constants_section_loud_defaults(rendered):
    text, _ = rendered
    sec = text.split("## Tuned constants")[1]
    assert "**Warning:" in sec and "`ring_stages`" in sec
    row = next(line for line in sec.splitlines() if line.startswith("| icache_sm_bytes"))
    assert "measured" in row and "icache.capacity" in row


def test_all_measured_has_no_warning(tmp_path):
    root = tmp_path / "r"
    save_all(class_results(), root)
    text = build(root, tmp_path / "o", bench_dir=root, gpu_present=True).read_text()
    assert "Rendered on a machine with a GPU" in text and "**Warning" not in text


def test_empty_results_render(tmp_path):
    (tmp_path / "none").mkdir()
    text = build(tmp_path / "none", tmp_path / "o", bench_dir=tmp_path / "none", gpu_present=False).read_text()
    assert text.count("**Not measured yet**") >= 6 and "No results yet" in text


@pytest.mark.slow  # two full renders of the committed results (~60 s); CI runs it (.ci/run -m slow)
def test_report_from_committed_results_is_deterministic(tmp_path):
    a = build(REPO_ROOT / "reports" / "results", tmp_path / "a", gpu_present=False).read_text()
    b = build(REPO_ROOT / "reports" / "results", tmp_path / "b", gpu_present=False).read_text()
    assert a == b
    assert "`basics.copy`" in a and "memcpy_bandwidth" in a and "NVIDIA H200" in a
    long = [line[:80] for line in _body(a).splitlines() if len(line) > 300]
    assert not long, long
    assert "no counterpart measured here" not in _body(a)
    # the detail timeline is condensed in Appendix B, not in the body
    assert "### `megakernel.timeline_detail`" not in _body(a)
    assert "### `megakernel.timeline_detail`" in _section(a, "## Appendix B.")


def test_python_m_reports(tmp_path):
    import subprocess
    import sys

    (tmp_path / "none").mkdir()
    r = subprocess.run([sys.executable, "-m", "reports", "--out", str(tmp_path), "--results", str(tmp_path / "none")],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "REPORT.md").is_file()


# ----------------------------------------------------------------------------- atomic writes
def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def written(tmp_path):
    """A results folder and a report already written from it (the files a bad run must not touch)."""
    root = tmp_path / "results"
    _icache_curve().save(root)
    _skew().save(root)
    save_all(_megakernel(), root)
    out = tmp_path / "out"
    (tmp_path / "nb").mkdir()
    build(root, out, bench_dir=tmp_path / "nb", gpu_present=False)
    (out / "figures" / "keep.txt").write_text("not a figure")
    assert list((out / "figures").glob("*.png"))
    return root, out, _snapshot(out)


def test_report_with_a_typo_in_results_fails_and_touches_nothing(written, tmp_path, capsys):
    from reports.cli import main

    _, out, before = written
    typo = tmp_path / "resutls"
    assert main(["report", "--results", str(typo), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(typo) in err and "no such results folder" in err
    assert _snapshot(out) == before
    assert not [p for p in tmp_path.rglob(".report-*")]  # no temporary folder left behind


@pytest.mark.parametrize("damage", ["truncate", "garbage_gz"])
def test_report_with_a_malformed_result_fails_and_touches_nothing(written, tmp_path, capsys, damage):
    from reports.cli import main

    root, out, before = written
    victim = sorted(root.rglob("icache.capacity-*.json*"))[0]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:len(victim.read_bytes()) // 2])
    else:
        victim.rename(victim.with_name(victim.name.removesuffix(".gz").removesuffix(".json") + ".json.gz"))
        victim = victim.with_name(victim.name.removesuffix(".gz").removesuffix(".json") + ".json.gz")
        victim.write_bytes(b"\x1f\x8b not gzip")
    assert main(["report", "--results", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert victim.name in err
    assert _snapshot(out) == before
    assert not [p for p in tmp_path.rglob(".report-*")]


def test_report_bad_benchmarks_or_baseline_path_fails(written, tmp_path, capsys):
    from reports.cli import main

    root, out, before = written
    assert main(["report", "--results", str(root), "--out", str(out), "--benchmarks", str(tmp_path / "nob")]) == 2
    assert "nob" in capsys.readouterr().err
    assert main(["report", "--results", str(root), "--out", str(out), "--baseline", str(tmp_path / "nobase")]) == 2
    assert "nobase" in capsys.readouterr().err
    assert _snapshot(out) == before


def test_report_replaces_figures_and_keeps_other_files(written):
    root, out, before = written
    stale = out / "figures" / "stale.png"
    stale.write_bytes(b"old")
    build(root, out, bench_dir=root, gpu_present=False)
    assert not stale.exists() and (out / "figures" / "keep.txt").read_text() == "not a figure"
    assert (out / "REPORT.md").read_bytes() == before[__import__("pathlib").Path("REPORT.md")]


# ----------------------------------------------------------------------------- the README's block
def _table_heads(block: str) -> list[tuple[str, ...]]:
    """The header row of every markdown table in `block`, as its cell texts."""
    lines = block.splitlines()
    return [tuple(c.strip() for c in lines[i].strip().strip("|").split("|"))
            for i in range(len(lines) - 1) if lines[i].startswith("|") and lines[i + 1].startswith("|---")]


def _headline_block_problems(text: str, want_heads: list[tuple[str, ...]]) -> list[str]:
    """What is wrong with README text's generated headline block, judged by its shape only."""
    from reports.summary import README_END, README_START

    if text.count(README_START) != 1 or text.count(README_END) != 1 or text.index(README_START) > text.index(README_END):
        return ["the block's markers are not one start followed by one end"]
    block = text[text.index(README_START):text.index(README_END)]
    bad = []
    if not re.search(r"^Measured on NVIDIA [^;]+; generated from the typed results of \d{4}-\d{2}-\d{2}", block,
                     re.MULTILINE):
        bad.append("the dated first line is missing")
    if _table_heads(block) != want_heads:
        bad.append(f"tables {_table_heads(block)} are not the generator's {want_heads}")
    width = None
    for line in block.splitlines():
        if not line.startswith("|"):
            width = None
        elif width is None:
            width = line.count("|")
        elif line.count("|") != width:
            bad.append(f"a row's cells differ from its header's: {line[:60]}")
    return bad


def test_readme_headline_block_is_well_formed(tmp_path):
    """README.md carries exactly one generated headline block, shaped as the generator writes it: its
    tables have the generator's columns and every row as many cells as its header. Its numbers are
    not compared with the committed results, which a new GPU run changes (the block is regenerated
    with `python -m reports --update-readme` after new results are committed). The mutations below
    show the check fails on a lost marker, a hand-edited row and a renamed column."""
    from reports.build import readme_block
    from reports.summary import README_END

    root = tmp_path / "r"
    save_all([_icache_curve(), _spliced(), _skew(), *_megakernel()], root)
    want = _table_heads(readme_block(root))
    assert len(want) == 2, want
    text = (REPO_ROOT / "README.md").read_text()
    assert _headline_block_problems(text, want) == []
    row = next(line for line in text.splitlines() if line.startswith("| shard8"))
    assert _headline_block_problems(text.replace(README_END, ""), want)
    assert _headline_block_problems(text.replace(row, row.rsplit("|", 2)[0] + "|"), want)
    assert _headline_block_problems(text.replace("| step time (IQR)", "| step time      "), want)


def test_update_readme_rewrites_only_the_block(tmp_path, capsys):
    from reports.report_cli import main
    from reports.summary import README_END, README_START

    root = tmp_path / "r"
    save_all(_megakernel(), root)
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{README_START}\nold\n{README_END}\n\n## after\n")
    assert main(["--results", str(root), "--update-readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\n" + README_START) and text.endswith(README_END + "\n\n## after\n")
    assert "old" not in text and "megakernel (ours)" in text
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert main(["--results", str(root), "--update-readme", str(plain)]) == 2
    assert "no headline markers" in capsys.readouterr().err and plain.read_text() == "no markers\n"


# ----------------------------------------------------------------------------- the study's figures
def test_paper_figures_valid_and_complete():
    d = paper.load()
    ids = {f["id"] for f in d["figures"]}
    # spot checks of numbers the study states (PAPER.md), one per class
    by = {f["id"]: f for f in d["figures"]}
    assert by["headline.megakernel_tok_s"]["value"] == 1109 and by["headline.baseline_tok_s"]["value"] == 517
    assert by["icache.spliced_s"]["value"] == pytest.approx(19.5e-6)
    assert (by["sync.acquire_poll"]["low"], by["sync.acquire_poll"]["high"]) == (141e-9, 145e-9)
    assert by["sync.fence_loaded"]["high"] == pytest.approx(4.0e-6)
    assert by["weights.ring_stages"]["value"] == 5 and by["weights.ring_stage_bytes"]["value"] == 32768
    assert by["clocks.profiler_cost_fraction"]["value"] == pytest.approx(0.028)
    assert by["breakdown.next_blocks_land"]["value"] == pytest.approx(84e-6)
    assert {f["class"] for f in d["figures"]} >= {"icache", "weights", "sync", "clocks", "megakernel", "model"}
    assert len(ids) == len(d["figures"]) >= 70
    # every figure with an "ours" says whether it is like for like (reports/paper.py validate)
    assert all(f.get("compare") for f in d["figures"] if f.get("ours") is not None)
    assert by["headline.verify_ratio"]["value"] == pytest.approx(10.9 / 5.3, rel=1e-3)
    assert "GB300" in d["setups"]["gb300"]["hardware"] and "144 SMs" in d["setups"]["gb300"]["hardware"]


def test_paper_constant_links_exist():
    from microbench.constants import BY_NAME

    for f in paper.load()["figures"]:
        o = f.get("ours")
        if o and o["kind"] == "constant":
            assert o["name"] in BY_NAME, f["id"]


def test_paper_validation_refuses_bad_data():
    from microbench.errors import ResultsFileError

    d = json.loads(paper.PATH.read_text())
    d["figures"][0].pop("value")
    with pytest.raises(ResultsFileError, match="value or low/high"):
        paper.validate(d)


def test_nothing_reads_the_brief_at_run_time():
    for pkg in ("microbench", "reports", "megakernel"):
        for p in (REPO_ROOT / pkg).rglob("*.py"):
            assert "/work/shared" not in p.read_text(), p


def test_fmt():
    assert fmt(1.2656e-6, "s") == "1.266 us" and fmt(4.28e12, "B/s") == "4.28 TB/s"
    assert fmt(62914560, "B") == "60 MiB" and fmt(23e6, "B") == "23 MB" and fmt(0.5, "fraction") == "50.0%"
    assert fmt_range(141e-9, 145e-9, "s") == "141-145 ns" and fmt(None) == ""


def test_megakernel_pick_rules():
    rows = mk.step_rows(_megakernel())
    assert mk.pick(rows, "mega").impl == "mega"
    assert mk.pick(rows, "best_baseline").impl == "naive_torch_graph"  # torch_graph read as the naive name
    v, unit, how = mk.figure_value(rows, None, {"metric": "speedup_vs_chain"})
    assert v == pytest.approx(9 / 4, rel=0.05) and unit == "x"
    # tokens/s are accepted tokens with the acceptance stated: at T = 16 and no measured acceptance, the
    # study's 6.6 (assumed), never the 16 tokens processed
    v, unit, how = mk.figure_value(rows, None, {"metric": "tokens_per_s", "impl": "mega"})
    assert v == pytest.approx(6.6 / 4e-3, rel=0.05) and "6.6 accepted" in how and "assumed" in how
    r = mk.pick(rows, "mega")
    assert r.acceptance == (6.6, r.acceptance[1]) and r.tokens_per_s == pytest.approx(16 / r.step_s)
    one = [x for x in mk.step_rows(_megakernel()) if x.impl == "mega"][0]
    import dataclasses

    assert dataclasses.replace(one, tokens=1).acceptance[0] == 1.0
    tl = _megakernel()[2]
    v, _, _ = mk.figure_value(rows, tl, {"metric": "timeline_end_p90", "phase": "gemm2"})
    assert 60e-6 < v < 66e-6


def test_each_baseline_is_its_fastest_committed_run(tmp_path):
    """A later, slower run of a torch baseline does not inflate the megakernel's speed-up: the
    table takes each baseline at each configuration from its fastest committed run and names that
    run's commit; the megakernel rows stay the latest run's; a configuration only an older
    baseline run has is not added."""
    base = _megakernel()
    root = tmp_path / "results"
    save_all(base[1:], root)  # megakernel.step and timeline of 2026-11-29T10:00Z
    params = {"impl": "torch_eager", "preset": "shard8", "tokens": 16}
    old = Result("model.baselines", env(date="2026-11-28T00:00:00Z", sha="old0000"),
                 (series("step/eager", 6e-3, params={**params, "context": 4096}, seed=3),
                  series("step/eager/long", 7e-3, params={**params, "context": 8192}, seed=4)))
    new = Result("model.baselines", env(date="2026-11-29T12:00:00Z", sha="new0000"),
                 (series("step/eager", 12e-3, params={**params, "context": 4096}, seed=5),))
    save_all([old, new], root)
    text = build(root, tmp_path / "out", bench_dir=root).read_text()
    rows = [line for line in text.splitlines() if "naive torch expression, eager" in line]
    assert len(rows) == 1, rows  # the ctx 8192 point of the old run is not added
    assert "old0000" in rows[0] and "1.50x" in rows[0]  # 6 ms / 4 ms, not 12 / 4
    # a newer run within 1% of the fastest counts as as fast: the newest of those is shown
    tie = Result("model.baselines", env(date="2026-11-28T12:00:00Z", sha="tie0000"),
                 (series("step/eager", 6.02e-3, params={**params, "context": 4096}, seed=3),))
    save_all([tie], root)
    text = build(root, tmp_path / "out2", bench_dir=root).read_text()
    assert "tie0000" in next(line for line in text.splitlines() if "naive torch expression, eager" in line)
    mega = next(line for line in text.splitlines() if "megakernel (ours)" in line)
    assert "abc1234" in mega
    assert "fastest committed run" in " ".join(text.split())


def test_tokens_per_s_uses_measured_acceptance_only():
    r = _megakernel()[1]
    s = next(x for x in r.series if x.params["impl"] == "mega")
    row = mk.StepRow("megakernel.step", s, "mega", "shard8", 16, 4096, 1)
    assert row.tokens_per_step == (16.0, False)
    s2 = series("m", 4e-3, params=dict(s.params), metrics={"accepted_tokens_per_step": 6.6, "tokens_per_step": 16})
    row2 = mk.StepRow("megakernel.step", s2, "mega", "shard8", 16, 4096, 1)
    assert row2.tokens_per_step == (6.6, True) and row2.tokens_per_s == pytest.approx(6.6 / s2.summary.median)


def test_curve_plots_ignore_list_valued_params(tmp_path):
    """A tree's parent list is a label, not an axis: it must neither crash the plot nor facet it."""
    from reports import plots

    ss = tuple(series(f"step/T{t}", 1e-3 * t, params={"tokens": t, "parents": list(range(-1, t - 1))}, seed=t)
               for t in (1, 4, 8, 16))
    figs = plots.curve_plots(Result("megakernel.step", env(), ss), "megakernel", tmp_path)
    assert len(figs) == 1


def test_paper_timeline_figures_name_phases_the_megakernel_emits():
    """A phase name the profiler never writes would leave the study's row 'not measured' forever."""
    from megakernel.plan import OP_KINDS

    figs = json.loads((REPO_ROOT / "reports" / "paper_figures.json").read_text())["figures"]
    phases = [f["ours"]["phase"] for f in figs
              if f.get("ours") and str(f["ours"].get("metric", "")).startswith("timeline_")]
    assert phases and set(phases) <= set(OP_KINDS)


def test_routing_is_part_of_a_rows_configuration():
    """megakernel.peer rows: routing is part of a row's configuration (a real-routing row is
    compared with mega at real routing, never with the forced one), figure picks prefer forced
    routing, and model.baselines' older torch_* names read as the naive_torch_* ones."""
    from reports import summary

    base = {"preset": "shard8", "tokens": 16, "context": 2048}
    rows = []
    for impl, routing, t in (("mega", "forced", 6.7e-3), ("peer", "forced", 8.0e-3), ("chain", "forced", 8.5e-3),
                             ("mega", "real", 9.0e-3), ("peer", "real", 18.0e-3)):
        rows.append(series(f"{impl}/{routing}", t, params={**base, "impl": impl, "routing": routing},
                           bound=Bound("time", 3e-3, "s", "roofline"), metrics={"launches_per_step": 9}))
    rows.append(series("kernel/moe_up", 3e-3, params={**base, "op": "moe_up", "kind": "peer_kernel"}, timer="host"))
    old = series("eager", 0.36, params={**base, "impl": "torch_eager"})
    got = mk.step_rows([Result("megakernel.peer", env(), tuple(rows)), Result("model.baselines", env(), (old,))])
    assert len(got) == 6 and {r.routing for r in got} == {"forced", "real"}  # the kernel series is no step row
    assert {r.impl for r in got} >= {"naive_torch_eager", "peer", "mega"} and "torch_eager" not in {r.impl for r in got}
    assert mk.pick(got, "mega").routing == "forced" and mk.pick(got, "best_baseline").impl == "peer"
    table, cfg = [], ""
    for row in summary.step_table(got):
        cfg = row["configuration"] or cfg
        table.append({**row, "configuration": cfg})
    peer_real = next(r for r in table if "real" in r["configuration"] and r["implementation"].startswith("peer"))
    peer_forced = next(r for r in table if "real" not in r["configuration"] and r["implementation"].startswith("peer"))
    assert peer_real["megakernel faster by"] == "2.00x"  # 18 / 9 ms (real), not 18 / 6.7
    assert peer_forced["megakernel faster by"] == "1.19x"  # 8 / 6.7


def test_a_partial_peer_run_does_not_hide_an_earlier_runs_rows(tmp_path):
    """`peer_bench --points small:16:512` saves a megakernel.peer of one point: the rows of an
    earlier full run (here shard8's real routing) still show, each row the newest of its
    implementation and configuration, with its own run's commit."""
    from reports.build import Catalog

    base = {"preset": "shard8", "tokens": 16, "context": 2048}
    full = Result("megakernel.peer", env(date="2026-12-01T19:00:00Z", sha="full000"), tuple(
        series(f"{i}/{r}", t, params={**base, "impl": i, "routing": r}, bound=Bound("time", 3e-3, "s", "roofline"),
               metrics={"launches_per_step": 9}, seed=k)
        for k, (i, r, t) in enumerate((("mega", "real", 10e-3), ("chain", "real", 11e-3), ("peer", "forced", 15e-3)))))
    part = Result("megakernel.peer", env(date="2026-12-01T20:00:00Z", sha="part000"), (
        series("peer/small", 1.5e-3, params={"preset": "small", "tokens": 16, "context": 512, "impl": "peer",
                                             "routing": "forced"}, bound=Bound("time", 3e-4, "s", "roofline"),
               metrics={"launches_per_step": 9}),))
    root = tmp_path / "results"
    save_all([full, part], root)
    rows = mk.with_fastest_baselines(mk.step_rows(Catalog.load(root).step_sources()), [])
    got = {(r.impl, r.preset, r.routing): r.commit for r in rows}
    assert got == {("mega", "shard8", "real"): "full000", ("chain", "shard8", "real"): "full000",
                   ("peer", "shard8", "forced"): "full000", ("peer", "small", "forced"): "part000"}
    assert len(mk.step_rows(Catalog.load(root).latest_all())) == 1  # what the newest result alone gives


def test_pytest_benchmark_comparison_pairs_files_that_share_cases(tmp_path):
    """The newest pytest-benchmark file is compared with the newest earlier file that has any of its
    cases, not with whatever file came just before it (a sync run after a megakernel run)."""
    root = tmp_path / "r"
    Result("sync.flags", env(), (series("s", 1e-6),)).save(root)
    bench = tmp_path / "bench"
    bench.mkdir()
    key = env().gpu_key

    def write(name, when, cases):
        rng = np.random.default_rng(len(name))
        bs = []
        for c in cases:
            x = (1e-4 * (1 + 0.01 * rng.standard_normal(15))).tolist()
            bs.append({"name": c, "fullname": f"tests/bench/t.py::{c}", "extra_info": {},
                       "stats": {"median": float(np.median(x)), "data": x, "min": min(x),
                                 "iqr": float(np.subtract(*np.percentile(x, [75, 25])))}})
        (bench / name).write_text(json.dumps({"machine_info": {"megabench": {"gpu_key": key}}, "commit_info": {},
                                              "benchmarks": bs, "datetime": when, "version": "5.2.3"}))

    write("sync-a.json", "2026-11-29T10:00:00+00:00", ["sync_x", "sync_y"])
    write("mk-b.json", "2026-11-30T10:00:00+00:00", ["mega_x"])
    write("sync-c.json", "2026-12-01T10:00:00+00:00", ["sync_x", "sync_z"])
    text = build(root, tmp_path / "o", bench_dir=bench, gpu_present=False).read_text()
    line = next(ln for ln in text.splitlines() if "pytest-benchmark: `" in ln)
    assert "`sync-c.json` vs the newest earlier file with any of its cases, `sync-a.json`" in line, line
    assert "nothing compared" not in line


def test_the_stress_run_shows_its_counts_and_fails_loudly(tmp_path):
    """The long-decode block reads the newest megakernel.stress: its counts, and FAILED on a mismatch."""
    from megakernel.stress import StressRun, to_result

    for i, bad in enumerate((0, 3)):
        root = tmp_path / f"r{i}"
        run = StressRun("shard8", 2000, n_mismatches=bad, kv_checks=20,
                        mismatches=[f"step {k}: logits differ" for k in range(bad)])
        to_result(run, env()).save(root)
        text = build(root, tmp_path / f"o{i}", bench_dir=root, gpu_present=True).read_text()
        block = text.split("### Long decode, mega and chain alternating", 1)[1].split("###", 1)[0]
        assert "2000 decode steps of shard8" in block and f"{bad} mismatches" in block
        assert ("FAILED" in block) == bool(bad)
    text = build(tmp_path / "r0", tmp_path / "o9", bench_dir=None, gpu_present=False).read_text()
    assert "Long decode" in text


def test_the_default_gpu_is_the_one_whose_results_cover_the_most(tmp_path):
    """Catalog.load without --gpu: a newer partial run on another GPU (one benchmark, as an H100
    session that could run only part of the work) does not turn the report over to it; among GPUs
    covering as many benchmarks the newest wins."""
    from megabench_synth import H200

    from reports.build import Catalog

    h100 = "NVIDIA H100 80GB HBM3"
    root = tmp_path / "r"
    full = class_results(date="2026-12-01T10:00:00Z")
    partial = [Result("megakernel.step", env(gpu=h100, date="2026-12-05T16:00:00Z"), (series("small/T1/ctx512/mega"),))]
    save_all(full + partial, root)
    cat = Catalog.load(root)
    assert cat.gpu == H200 and h100 in cat.other_gpus
    assert Catalog.load(root, gpu=h100).gpu == h100
    save_all(class_results(gpu=h100, date="2026-12-06T10:00:00Z"), tmp_path / "r2")
    save_all(full, tmp_path / "r2")
    assert Catalog.load(tmp_path / "r2").gpu == h100  # as many benchmarks, newer
