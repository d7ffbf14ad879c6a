"""ncu per-instruction stall summaries (megakernel.ncu_stalls) on small synthetic source-page CSVs
with hand-computed answers; no GPU and no real ncu report needed."""
from __future__ import annotations

import csv
import gzip

import pytest

from megakernel import cli
from megakernel.ncu_stalls import (
    by_execution_count,
    by_op,
    by_source,
    hottest,
    read_sass_csv,
    stall_totals,
    summary_markdown,
)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "# Samples", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_math", "stall_selected", "stall_wait", "stall_wait (Not Issued)"]


def row(addr, src, samples, executed, long_sb=0, math=0, selected=0, wait=0):
    # the "(Not Issued)" column holds junk: it must be ignored; barrier is never sampled
    return [addr, src, str(samples), str(samples), str(executed), "0", str(long_sb), str(math), str(selected),
            str(wait), "999"]


# Classes by execution count (hand-computed):
#   64: 3 instructions, 50 samples: selected 20 (40%), wait 16 (32%), math 14 (28%)
#    8: 2 instructions, 30 samples: long_sb 20 (67%), wait 10 (33%)
#    1: 2 instructions, 10 samples: long_sb 10 (100%)
#    0: 1 instruction, no samples (dropped)
# Totals over 90 samples: long_sb 30, wait 26, selected 20, math 14.
ROWS = [
    row("0x100", "      LDC R1, c[0x0][0x28]", 10, 1, long_sb=10),
    row("0x110", "      FFMA R4, R5, R6, R4", 30, 64, math=9, selected=15, wait=6),
    row("0x120", "      FFMA R7, R8, R6, R7", 20, 64, math=5, selected=5, wait=10),
    ["0x130", "      IADD3 R2, R2, 0x1, RZ", "", "", "64", "", "", "", "", "", ""],  # empty counts read as 0
    row("0x140", "      LDG.E R9, [R2.64]", 25, 8, long_sb=20, wait=5),
    row("0x150", "      BAR.SYNC 0x0", 5, 8, wait=5),
    row("0x160", "      EXIT", 0, 1),
    ["0x170", "      BRA 0x170", "0", "0", "", "0", "0", "0", "0", "0", "0"],
    ["0x180", "      NOP"],  # short row: skipped
]


def write(path, kernels):
    """kernels: [(name, header, rows)] written the way ncu does (all fields quoted)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, header, rows in kernels:
            f.write(f'"Kernel Name","{name}",\n')
            w.writerow(header)
            w.writerows(rows)
    return path


@pytest.fixture(params=["sass.csv", "sass.csv.gz"])
def sample(tmp_path, request):
    return write(tmp_path / request.param, [("mk_run", HEADER, ROWS)])


def test_read_columns_values_and_empty_cells(sample):
    df = read_sass_csv(sample)
    assert list(df.columns) == ["kernel", "address", "source", "samples", "executed",
                                "barrier", "long_sb", "math", "selected", "wait"]  # no "(Not Issued)" column
    assert df.attrs["skipped"] == 1
    assert list(df.address) == [0x100, 0x110, 0x120, 0x130, 0x140, 0x150, 0x160, 0x170]
    assert set(df.kernel) == {"mk_run"}
    assert int(df.samples.sum()) == 90
    assert df.loc[df.address == 0x110, ["samples", "executed", "math", "selected", "wait"]].values.tolist() == \
        [[30, 64, 9, 15, 6]]
    empty = df[df.address == 0x130].iloc[0]
    assert (empty.samples, empty.executed, empty.wait) == (0, 64, 0)
    assert df[df.address == 0x170].executed.item() == 0
    for c in ["address", "samples", "executed", "wait"]:
        assert df[c].dtype.kind == "i"


def test_stall_totals(sample):
    t = stall_totals(read_sass_csv(sample))
    assert t.reason.tolist() == ["long_sb", "wait", "selected", "math"]  # barrier (all zero) dropped
    assert t.samples.tolist() == [30, 26, 20, 14]
    assert t.fraction.tolist() == pytest.approx([30 / 90, 26 / 90, 20 / 90, 14 / 90])


def test_classes_by_execution_count(sample):
    df = read_sass_csv(sample)
    c = by_execution_count(df)
    assert c.executed.tolist() == [64, 8, 1]  # most samples first; the unsampled class 0 dropped
    assert c.instructions.tolist() == [3, 2, 2]
    assert c.samples.tolist() == [50, 30, 10]
    assert c.fraction.tolist() == pytest.approx([50 / 90, 30 / 90, 10 / 90])
    assert c.top3.tolist() == ["selected 40%, wait 32%, math 28%", "long_sb 67%, wait 33%", "long_sb 100%"]
    assert by_execution_count(df, top=2).executed.tolist() == [64, 8]


def test_hottest(sample):
    h = hottest(read_sass_csv(sample), n=3)
    assert h.address.tolist() == ["0x110", "0x140", "0x120"]
    assert h.source.tolist() == ["FFMA R4, R5, R6, R4", "LDG.E R9, [R2.64]", "FFMA R7, R8, R6, R7"]
    assert h.samples.tolist() == [30, 25, 20]
    assert h.executed.tolist() == [64, 8, 64]
    assert h.top_stall.tolist() == ["selected", "long_sb", "wait"]
    assert len(hottest(read_sass_csv(sample), n=50)) == 5  # unsampled instructions are not "hot"


@pytest.mark.parametrize("drop, named", [("# Samples", "# Samples"), ("Instructions Executed", "Instructions Executed"),
                                         ("stall_", "stall_")])
def test_missing_columns_raise_naming_them(tmp_path, drop, named):
    keep = [i for i, h in enumerate(HEADER) if not h.startswith(drop)]
    p = write(tmp_path / "bad.csv", [("mk_run", [HEADER[i] for i in keep], [[r[i] for i in keep] for r in ROWS[:3]])])
    with pytest.raises(ValueError, match="bad.csv") as e:
        read_sass_csv(p)
    assert named in str(e.value)


def test_unreadable_inputs_raise(tmp_path):
    with pytest.raises(ValueError, match="nope.csv.*no such file"):
        read_sass_csv(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ValueError, match="empty.csv"):
        read_sass_csv(tmp_path / "empty.csv")
    (tmp_path / "plain.csv.gz").write_text("not gzip")
    with pytest.raises(ValueError, match="plain.csv.gz"):
        read_sass_csv(tmp_path / "plain.csv.gz")
    p = write(tmp_path / "rowless.csv", [("mk_run", HEADER, [["0x1", "NOP"]])])
    with pytest.raises(ValueError, match="no readable instruction rows"):
        read_sass_csv(p)


def test_several_kernels_need_a_choice(tmp_path):
    p = write(tmp_path / "two.csv", [("a", HEADER, ROWS), ("b", HEADER, [row("0x200", "NOP", 7, 3, wait=7)])])
    with pytest.raises(ValueError, match="several kernels"):
        read_sass_csv(p)
    with pytest.raises(ValueError, match="no kernel named 'c'"):
        read_sass_csv(p, kernel="c")
    b = read_sass_csv(p, kernel="b")
    assert (b.address.tolist(), b.samples.tolist(), set(b.kernel)) == ([0x200], [7], {"b"})
    assert int(read_sass_csv(p, kernel=0).samples.sum()) == 90
    assert read_sass_csv(p, kernel=1).address.tolist() == [0x200]
    # the CLI without --kernel summarises every launch, each under its own heading
    from megakernel.cli import main

    out = tmp_path / "two.md"
    assert main(["ncu-stalls", str(p), "--out", str(out)]) == 0
    md = out.read_text()
    assert md.count("# Launch ") == 2 and "kernel `a`, 90 samples" in md and "kernel `b`, 7 samples" in md


def test_summary_markdown_has_three_tables(sample):
    md = summary_markdown(read_sass_csv(sample), top=2, n=3)
    assert md.count("## ") == 3 and "kernel `mk_run`, 90 samples" in md
    assert "(1 malformed rows skipped)" in md  # the short row is said, not silently dropped
    assert "| long_sb  |        30 | 33.3%" in md
    assert "selected 40%, wait 32%, math 28%" in md and "long_sb 100%" not in md  # top=2 leaves class 1 out
    assert "0x120" in md and "0x100" not in md  # n=3 leaves the 4th hottest out


def test_cli_writes_markdown(sample, tmp_path, capsys):
    out = tmp_path / "stalls.md"
    assert cli.main(["ncu-stalls", str(sample), "--top", "2", "--hottest", "3", "--out", str(out)]) == 0
    assert out.read_text() == summary_markdown(read_sass_csv(sample), top=2, n=3)
    assert cli.main(["ncu-stalls", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv: no such file" in capsys.readouterr().err


# The same build's `nvdisasm -gi -c` listing (offsets = ROWS' addresses - 0x100): LDC before any
# annotation, the FFMAs and IADD3 in an expert GEMM's k-loop, LDG and BAR in a wait, the rest in
# the schedule. The short NOP row is not in the profile; its listing line is never asked for.
LISTING = """\
.text.mk_run:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/r/megakernel/csrc/mk/gemm.cuh", line 367 inlined at "/r/megakernel/csrc/ops/expert_gemm1.cuh", line 30
\t//## File "/r/megakernel/csrc/ops/expert_gemm1.cuh", line 30
        /*0010*/                   FFMA R4, R5, R6, R4 ;
        /*0020*/                   FFMA R7, R8, R6, R7 ;
        /*0030*/                   IADD3 R2, R2, 0x1, RZ ;
\t//## File "/r/megakernel/csrc/mk/wait.cuh", line 60 inlined at "/r/megakernel/csrc/mk/program.cuh", line 206
\t//## File "/r/megakernel/csrc/mk/program.cuh", line 206
        /*0040*/                   LDG.E R9, [R2.64] ;
        /*0050*/                   BAR.SYNC 0x0 ;
\t//## File "/r/megakernel/csrc/mk/program.cuh", line 400
        /*0060*/                   EXIT ;
        /*0070*/              @!P0 BRA 0x70 ;
        /*0080*/                   NOP ;
"""


def test_samples_by_source_position(sample):
    from microbench.sass import instruction_chains

    df = read_sass_csv(sample)
    chains = instruction_chains(LISTING.splitlines(), kernel="mk_run")
    assert [c[0] for c in chains] == list(range(0, 0x90, 0x10)) and chains[0][2] == []
    t = by_source(df, chains, lambda ch: ch[0].rsplit("/", 1)[-1])
    # the k-loop's 3 instructions (50 samples), the wait's 2 (30), the unannotated LDC (10); the
    # schedule's EXIT and BRA have no samples and are dropped; no stall_no_inst column: 0
    assert t.source.tolist() == ["gemm.cuh:367", "wait.cuh:60", "?"]
    assert t.instructions.tolist() == [3, 2, 1] and t.executed.tolist() == [192, 16, 1]
    assert t.samples.tolist() == [50, 30, 10] and t.no_inst.tolist() == [0, 0, 0]
    assert t.top3[0] == "selected 40%, wait 32%, math 28%"


def test_the_per_op_account_splits_copy_waits_from_own_work(sample):
    # the wait (LDG, BAR: 30 samples, long_sb 20, wait 10) inlined into expert GEMM 1's staging:
    # that op's 80 samples are 30 at its copy waits and 50 of its own (the k-loop's reasons); the
    # LDC without line info is "?", all long_sb; the schedule's EXIT and BRA have no samples
    from megakernel.build import op_of_chain
    from microbench.sass import instruction_chains

    inlined = LISTING.replace('line 60 inlined at "/r/megakernel/csrc/mk/program.cuh", line 206\n'
                              '\t//## File "/r/megakernel/csrc/mk/program.cuh", line 206',
                              'line 60 inlined at "/r/megakernel/csrc/ops/expert_gemm1.cuh", line 20\n'
                              '\t//## File "/r/megakernel/csrc/ops/expert_gemm1.cuh", line 20')
    assert inlined != LISTING
    df = read_sass_csv(sample)
    t = by_op(df, instruction_chains(inlined.splitlines(), kernel="mk_run"), op_of_chain)
    assert t.op.tolist() == ["expert_gemm1", "?"]
    assert t.samples.tolist() == [80, 10] and t.copy_wait.tolist() == [30, 0] and t.own.tolist() == [50, 10]
    assert t.share.tolist() == ["88.9%", "11.1%"] and t.instructions.tolist() == [5, 1]
    assert t.own_top3.tolist() == ["selected 40%, wait 32%, math 28%", "long_sb 100%"]
    assert t.own_long_sb.tolist() == ["0%", "100%"] and t.own_no_inst.tolist() == ["0%", "0%"]  # no such column: 0
    # the wait in the schedule (the listing as profiled): the schedule's samples are all copy waits
    t = by_op(df, instruction_chains(LISTING.splitlines(), kernel="mk_run"), op_of_chain)
    s = t.set_index("op")
    assert s.loc["schedule", "copy_wait"] == 30 and s.loc["schedule", "own"] == 0
    assert s.loc["schedule", "own_top3"] == "" and s.loc["expert_gemm1", "copy_wait"] == 0


def test_a_listing_of_another_build_is_refused(sample):
    from microbench.sass import instruction_chains

    other = LISTING.replace("LDG.E R9, [R2.64]", "LDS R9, [R2]")
    with pytest.raises(ValueError, match=r"not the profiled build: offset 0x40 is 'LDG.E R9, \[R2.64\]'"):
        by_source(read_sass_csv(sample), instruction_chains(other.splitlines(), "mk_run"), str)
    short = LISTING.split("\t//## File \"/r/megakernel/csrc/mk/wait.cuh\"")[0]  # no LDG, BAR, ...
    with pytest.raises(ValueError, match="offset 0x40 .* nothing in the listing"):
        by_source(read_sass_csv(sample), instruction_chains(short.splitlines(), "mk_run"), str)


def test_cli_adds_the_source_table_from_a_listing(sample, tmp_path, capsys):
    lst = tmp_path / "mk.sass"
    lst.write_text(LISTING)
    assert cli.main(["ncu-stalls", str(sample), "--listing", str(lst), "--top-source", "2"]) == 0
    md = capsys.readouterr().out
    assert "## Top 2 source positions" in md
    top2, per_op = md.split("## Per op")
    assert "| expert_gemm1 mk/gemm.cuh:367 |" in top2 and "| schedule mk/wait.cuh:60 " in top2 and "| ? " not in top2
    # the per-op account, every op: the k-loop's, the schedule's wait and EXIT, the LDC without line info
    rows = [ln.split("|")[1:6] for ln in per_op.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [[c.strip() for c in r] for r in rows] == [["expert_gemm1", "3", "192", "50", "55.6%"],
                                                      ["schedule", "3", "17", "30", "33.3%"],
                                                      ["?", "1", "1", "10", "11.1%"]]
    assert cli.main(["ncu-stalls", str(sample), "--listing", str(tmp_path / "none.sass")]) == 2
    assert "none.sass: no such listing" in capsys.readouterr().err


def test_cli_rebuilds_the_profiled_build_for_its_tree_size(sample, monkeypatch, capsys):
    # --preset rebuilds the profiled kernel here: the build ncu-mega profiled, i.e. the plan for
    # --tokens (the expert units follow the tree size: plan.expert1_unit_rows)
    import types

    import megakernel.build
    import microbench.sass
    from microbench.sass import instruction_chains

    built = []
    # the plan from the constants a build without a GPU reads (plans.tuned), whatever GPU the host
    # has: on one without a constants file of its own (an H100 here) the build rightly refuses
    monkeypatch.setattr("megakernel.plans.gpu_count", lambda: 0)
    monkeypatch.delenv("MEGABENCH_CONSTANTS", raising=False)  # the test run's defaults on such a GPU (conftest.py)
    monkeypatch.setattr(megakernel.build, "build_gpu", lambda plan: built.append(plan) or types.SimpleNamespace(
        module=types.SimpleNamespace(cubin=b"")))
    monkeypatch.setattr(microbench.sass, "cubin_instruction_chains",
                        lambda cubin, kernel: instruction_chains(LISTING.splitlines(), kernel))
    monkeypatch.setattr(cli, "cubin_instruction_chains", microbench.sass.cubin_instruction_chains)  # top import
    for t, rows in ((16, 256), (1, 128)):
        assert cli.main(["ncu-stalls", str(sample), "--preset", "shard8", "--tokens", str(t), "--top-source", "2"]) == 0
        assert "## Top 2 source positions" in capsys.readouterr().out
        assert built[-1].tiles["expert1"].rows == rows
