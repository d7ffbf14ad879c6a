"""The results folder's retention rule (`megabench prune-results`), and the size budget of reports/
that CI checks. Synthetic repositories in tmp folders; the committed tree is only measured."""
from __future__ import annotations

import json
import os

import pytest
from megabench_synth import env, series

from reports.cli import main
from microbench.errors import ResultsFileError
from microbench.results import REPO_ROOT, Derived, Result
from reports import retention

# reports/ after the pruning of 2026-12-01 held about 15.2 MB; this leaves room for a few full GPU
# runs between prunes. Over it: run `megabench prune-results` (and commit the pruning on its own).
REPORTS_BUDGET_BYTES = 20_000_000


def _save(r: Result, root):
    return r.save(root)


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def repo(tmp_path):
    """A repository with a results folder, notes, a constants file and traces."""
    repo = tmp_path / "repo"
    root = repo / "reports" / "results"
    p = {}
    p["copy_old"] = _save(Result("basics.copy", env(date="2026-11-28T00:00:00Z", sha="aaa0001"), (series("c", 1e-3),)),
                          root)
    p["copy_mid"] = _save(Result("basics.copy", env(date="2026-11-28T12:00:00Z", sha="aaa0002"), (series("c", 1e-3),)),
                          root)
    p["copy_new"] = _save(Result("basics.copy", env(date="2026-11-29T00:00:00Z", sha="aaa0003"), (series("c", 1e-3),)),
                          root)
    p["ring_old"] = _save(Result("weights.ring", env(date="2026-11-28T00:00:00Z", sha="bbb0001"), (series("r", 1e-3),)),
                          root)
    p["ring_new"] = _save(Result("weights.ring", env(date="2026-11-29T00:00:00Z", sha="bbb0002"), (series("r", 1e-3),)),
                          root)
    p["launch_old"] = _save(Result("basics.launch", env(date="2026-11-28T00:00:00Z", sha="ccc0001"),
                                   (series("l", 1e-6),)), root)
    p["launch_mid"] = _save(Result("basics.launch", env(date="2026-11-28T06:00:00Z", sha="ccc0004"),
                                   (series("l", 1e-6),)), root)
    p["launch_new"] = _save(Result("basics.launch", env(date="2026-11-29T00:00:00Z", sha="ccc0003"),
                                   (series("l", 1e-6),)), root)
    # a newer run on another GPU model does not make the H200's run old
    p["launch_h100"] = _save(Result("basics.launch", env(gpu="NVIDIA H100", date="2026-11-30T00:00:00Z", sha="ccc0002"),
                                    (series("l", 1e-6),)), root)
    # the gate-quality result names the runs it replayed (as its series' sources do)
    p["quality"] = _save(Result("gate.quality", env(date="2026-11-29T01:00:00Z", sha="ddd0001"),
                                (series("q", 0.1, unit="", params={"sources": p["launch_old"].name + ":l"}),)), root)
    mk = root / "megakernel"
    mk.mkdir(parents=True)
    names = {}
    for sha, stamp in (("eee0001", "20261128T000000Z"), ("eee0002", "20261129T000000Z"), ("eee0003", "20261129T120000Z")):
        for suf in (".trace.json.gz", ".png"):
            f = mk / f"timeline-shard8-T16-{stamp}-{sha}{suf}"
            f.write_bytes(b"x" * 100)
        names[sha] = f"timeline-shard8-T16-{stamp}-{sha}"
    # the first timeline's result names its trace (a result's own record: keeps no artefact)
    p["tl_old"] = _save(Result("megakernel.timeline", env(date="2026-11-28T00:00:00Z", sha="eee0001"),
                               (series("t", 1e-6),), notes=(f"Perfetto trace: {names['eee0001']}.trace.json",)), root)
    (mk / "ab-thing-20261129T0000Z-eee0002.md").write_text(
        f"The second timeline, `{names['eee0002']}.png`, shows it. Runs: `bench-xgpu-*.json`. **bench-other**\n"
        "Before: `...T060000Z-...json` (a name with its middle left out).\n")
    xg = root / "xgpu"
    xg.mkdir()
    for sha in ("fff0001", "fff0002"):
        (xg / f"bench-xgpu-20261130T1456Z-nvidia-h200-x2-{sha}.json").write_text("{}")
    (xg / "bench-other-20261130T1456Z-nvidia-h200-x2-fff0003.json").write_text("{}")
    (xg / "bench-other-20261131T1456Z-nvidia-h200-x2-fff0004.json").write_text("{}")
    (repo / "reports" / "notes").mkdir(parents=True)
    (repo / "reports" / "notes" / "2026-11-29-diary.md").write_text(f"measured in {p['copy_old'].name}\n")
    (repo / "reports" / "constants").mkdir()
    (repo / "reports" / "constants" / "nvidia-h200.json").write_text(json.dumps(
        {"constants": {"ring_stages": {"result_file": f"reports/results/weights/{p['ring_old'].name}"}}}))
    (repo / "reports" / "REPORT.md").write_text(f"{p['copy_mid'].name}\n")  # regenerated: names nothing
    return repo, root, p, names


def _reasons(plan, path):
    return plan.entries[path].reasons


def test_the_rule_keeps_what_is_read_or_named_and_prunes_the_rest(repo):
    repo, root, p, names = repo
    plan = retention.plan(root, repo)
    assert any(r.startswith("newest basics.copy") for r in _reasons(plan, p["copy_new"]))
    assert _reasons(plan, p["copy_old"]) == ["named by reports/notes/2026-11-29-diary.md"]
    assert _reasons(plan, p["ring_old"]) == ["named by reports/constants/nvidia-h200.json"]
    assert any(r.startswith("newest basics.launch on NVIDIA H100") for r in _reasons(plan, p["launch_h100"]))
    assert _reasons(plan, p["launch_old"]) == [f"named by gate/{p['quality'].name}"]  # through the kept quality result
    assert not _reasons(plan, p["copy_mid"])  # only REPORT.md names it
    assert _reasons(plan, p["launch_mid"]) == ["named by megakernel/ab-thing-20261129T0000Z-eee0002.md"]
    mk = root / "megakernel"
    for sha, kept in (("eee0001", False), ("eee0002", True), ("eee0003", True)):
        for suf in (".trace.json.gz", ".png"):
            assert bool(_reasons(plan, mk / f"{names[sha]}{suf}")) is kept, (sha, suf)
    assert any(r.startswith("trace (newest of kind timeline-shard8-T16-*)")
               for r in _reasons(plan, mk / f"{names['eee0003']}.png"))
    assert _reasons(plan, mk / "ab-thing-20261129T0000Z-eee0002.md")[0] == "note"
    # the markdown glob keeps both bench-xgpu files; of the other kind only the newest stays
    xg = root / "xgpu"
    assert all(_reasons(plan, f) for f in xg.glob("bench-xgpu-*.json"))
    assert not _reasons(plan, xg / "bench-other-20261130T1456Z-nvidia-h200-x2-fff0003.json")
    assert _reasons(plan, xg / "bench-other-20261131T1456Z-nvidia-h200-x2-fff0004.json")
    # the kept timeline result names its trace, but only the trace rule keeps traces
    assert _reasons(plan, p["tl_old"])[0].startswith("newest megakernel.timeline")


def test_report_keeps_each_baselines_fastest_run(tmp_path):
    root = tmp_path / "repo" / "reports" / "results"
    params = {"impl": "torch_eager", "preset": "shard8", "tokens": 16, "context": 4096}
    fast = _save(Result("model.baselines", env(date="2026-11-28T00:00:00Z", sha="f000001"),
                        (series("s", 6e-3, params=params, seed=1),)), root)
    slow = _save(Result("model.baselines", env(date="2026-11-28T06:00:00Z", sha="f000002"),
                        (series("s", 9e-3, params=params, seed=2),)), root)
    new = _save(Result("model.baselines", env(date="2026-11-29T00:00:00Z", sha="f000003"),
                       (series("s", 12e-3, params=params, seed=3),)), root)
    plan = retention.plan(root, tmp_path / "repo")
    # older results' torch_* names are read as the naive_torch_* rows they are (reports/megakernel.py)
    assert _reasons(plan, fast) == ["report (fastest naive_torch_eager run at shard8 T=16 ctx=4096)"]
    assert not _reasons(plan, slow) and _reasons(plan, new)[0].startswith("newest model.baselines")


def test_a_run_without_the_peer_keeps_the_run_holding_its_newest_rows(tmp_path):
    """A later megakernel.step run without the peer (MEGABENCH_PEER=0) does not hide the peer's
    rows of an earlier run: the report shows them (build.step_sources), so retention keeps that run;
    an older run whose peer rows are not the newest is pruned."""
    from reports.build import Catalog
    from reports import megakernel as mk

    root = tmp_path / "repo" / "reports" / "results"

    def step(impl, v, seed):
        return series(f"small/T16/ctx512/{impl}", v, params={"impl": impl, "preset": "small", "tokens": 16,
                                                            "context": 512}, seed=seed)

    old = _save(Result("megakernel.step", env(date="2026-11-27T00:00:00Z", sha="a000001"),
                       (step("mega", 1.3e-3, 1), step("peer", 1.6e-3, 2))), root)
    mid = _save(Result("megakernel.step", env(date="2026-11-28T00:00:00Z", sha="a000002"),
                       (step("mega", 1.2e-3, 3), step("peer", 1.5e-3, 4))), root)
    new = _save(Result("megakernel.step", env(date="2026-11-29T00:00:00Z", sha="a000003"), (step("mega", 1.1e-3, 5),)),
                root)
    plan = retention.plan(root, tmp_path / "repo")
    assert _reasons(plan, mid) == ["report (newest peer row at small T=16 ctx=512)"]
    assert not _reasons(plan, old) and _reasons(plan, new)[0].startswith("newest megakernel.step")
    rows = mk.step_rows(Catalog.load(root).step_sources())
    assert {(r.impl, r.commit) for r in rows} >= {("mega", "a000003"), ("peer", "a000002")}


def test_cli_dry_run_then_prune(repo, capsys):
    repo, root, p, _ = repo
    before = _files(root)
    assert main(["prune-results", "--results", str(root), "--repo", str(repo), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"keep basics/{p['copy_old'].name}: named by reports/notes/2026-11-29-diary.md" in out
    assert f"prune basics/{p['copy_mid'].name}" in out and "dry run: nothing deleted" in out
    assert _files(root) == before
    plan = retention.plan(root, repo)
    assert main(["prune-results", "--results", str(root), "--repo", str(repo)]) == 0
    assert _files(root) == sorted(str(e.path.relative_to(root)) for e in plan.kept)
    assert not p["copy_mid"].exists() and p["copy_old"].exists()
    # applying the rule again prunes nothing: it is a fixpoint
    assert not retention.plan(root, repo).pruned


def test_malformed_result_stops_the_plan_and_deletes_nothing(repo, capsys):
    repo, root, p, _ = repo
    p["copy_new"].write_text(p["copy_new"].read_text()[:40])
    before = _files(root)
    assert main(["prune-results", "--results", str(root), "--repo", str(repo)]) == 2
    assert p["copy_new"].name in capsys.readouterr().err
    assert _files(root) == before
    with pytest.raises(ResultsFileError, match="no such results folder"):
        retention.plan(root / "typo", repo)


def test_a_failed_rename_puts_everything_back(repo, monkeypatch):
    repo, root, _, _ = repo
    before = _files(root)
    plan = retention.plan(root, repo)
    assert len(plan.pruned) >= 3
    real = os.replace
    calls = []

    def flaky(a, b):
        calls.append(a)
        if len(calls) == 3:
            raise OSError("disk said no")
        return real(a, b)

    monkeypatch.setattr(retention.os, "replace", flaky)
    with pytest.raises(ResultsFileError, match="nothing removed"):
        retention.prune(plan)
    assert _files(root) == before and not list(root.glob(".prune-*"))


def test_a_derived_value_naming_a_result_keeps_it(tmp_path):
    """Names count wherever they are in a kept result (derived inputs, params, notes)."""
    root = tmp_path / "repo" / "reports" / "results"
    old = _save(Result("sync.flags", env(date="2026-11-28T00:00:00Z", sha="a000001"), (series("f", 1e-6),)), root)
    _save(Result("sync.flags", env(date="2026-11-29T00:00:00Z", sha="a000002"), (series("f", 1e-6),),
                 {"x": Derived(1.0, "", "rule", None, (old.name,))}), root)
    assert retention.plan(root, tmp_path / "repo").entries[old].reasons


def test_reports_folder_fits_its_budget():
    """CI's size check: the GPU machine receives the whole tree on every run."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(REPO_ROOT / "reports"):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in filenames if not f.startswith("."))
    assert total <= REPORTS_BUDGET_BYTES, (
        f"reports/ holds {total / 1e6:.1f} MB, over its {REPORTS_BUDGET_BYTES / 1e6:.0f} MB budget: run "
        "`megabench prune-results --dry-run`, then without --dry-run, and commit the pruning on its own")


def test_a_brace_list_in_a_note_names_every_file_it_stands_for(repo):
    """`basics.copy-20261128T{000000,120000}Z-*` names both runs (as the shell would expand it).
    Danger: read as no name, the results a note lists that way would be pruned."""
    repo, root, p, names = repo
    (repo / "reports" / "notes" / "2026-11-29-diary.md").write_text(
        "runs: `basics.copy-20261128T{000000,120000}Z-*`\n")
    plan = retention.plan(root, repo)
    for k in ("copy_old", "copy_mid"):  # copy_mid: nothing else keeps it
        assert any(r.startswith("named by reports/notes/2026-11-29-diary.md") for r in _reasons(plan, p[k])), k
