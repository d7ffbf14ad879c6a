"""`megabench run` on the CPU (committed results, nothing committed overwritten) and, with the GPU
parts replaced by fakes, the order and hand-offs of the GPU pipeline."""
from __future__ import annotations

import pytest
from megabench_synth import class_results, env

from reports import run as pipeline
from reports.cli import main
from microbench.results import REPO_ROOT


def _snapshot(d):
    return sorted((str(p.relative_to(d)), p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()) if d.exists() else []


@pytest.mark.slow  # the whole no-GPU pipeline (~35 s); CI runs it
def test_run_without_gpu_uses_committed_results(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("reports.run.no_gpu_reason", lambda: "test: no driver")
    constants = REPO_ROOT / "reports" / "constants"
    results = REPO_ROOT / "reports" / "results"
    before, before_r = _snapshot(constants), _snapshot(results)
    rc = main(["run", "--results", str(results), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no GPU here (test: no driver)" in out
    assert "microbenchmarks: all: skipped (no GPU)" in out and "] tune: tune (est " in out
    assert "cross-GPU microbenchmarks: xgpu: skipped (no GPU; they need 2 or more)" in out
    assert "megakernel: all: skipped (no GPU" in out and "] report: report done in " in out
    assert "megabench-constants-" in out  # tuned into a temporary folder
    assert "without a GPU: not recorded" in out
    assert _snapshot(constants) == before and _snapshot(results) == before_r  # nothing committed touched or added
    text = (tmp_path / "REPORT.md").read_text()
    assert "**Rendered without a GPU**" in text and "basics.copy" in text


class FakeStage:
    """megakernel.pipeline.Stage's interface: items() after construction, constants set by tune."""

    def __init__(self, calls, **kw):
        self.calls, self.kw, self.constants = calls, kw, None

    def items(self, stage):
        from microbench.progress import Item

        def check():
            self.calls.append(("mega", self.kw["quick"], self.constants.ring_stages,
                               self.constants.provenance["ring_stages"]["source"]))

        def broken():
            raise RuntimeError("shard8 check: mega and chain differ bitwise")

        return [Item(stage, "small check", check, groups=("megakernel/small",)),
                Item(stage, "shard8 check", broken, groups=("megakernel/shard8",)),
                Item(stage, "shard8 T=16 ctx=2048 mega", lambda: self.calls.append("timed shard8"),
                     groups=("megakernel/shard8",)),
                Item(stage, "save", lambda: self.calls.append("saved"), always=True)]


def test_run_with_gpu_pipeline_order(tmp_path, capsys, monkeypatch):
    root = tmp_path / "results"
    calls = []
    monkeypatch.setattr("reports.run.no_gpu_reason", lambda: None)
    monkeypatch.setattr("reports.run.device_info", lambda i=0: type("I", (), {"name": "NVIDIA H200"})())
    monkeypatch.setattr("microbench.xgpu.launcher.gpus_or_reason", lambda: (1, "1 GPU on this node"))
    monkeypatch.setattr("reports.run.Harness", lambda: "H")
    monkeypatch.setattr("microbench.results.Env.capture", classmethod(lambda cls, gpu_index=0: env()))
    monkeypatch.setenv("MEGABENCH_RESULTS", str(tmp_path / "elsewhere"))

    def make(bench):
        def run(h, quick=True, save=True):
            calls.append(("bench", bench, h, quick))
            r = next(r for r in class_results() if r.benchmark == bench)
            r.save()  # where MEGABENCH_RESULTS points: the pipeline must point it at --results
            return r
        return run

    def broken(h, quick=True, save=True):
        raise RuntimeError("spin timed out waiting for flag 3")

    fake = {b: make(b) for b in ("sync.flags", "weights.ring")}
    fake["sync.publish"] = broken
    fake["model.baselines"] = lambda *a, **k: pytest.fail("the torch baselines run in the megakernel stage")
    monkeypatch.setattr("reports.classes.benchmarks", lambda classes=None: fake)
    stages = []
    monkeypatch.setattr(pipeline, "megakernel_stage", lambda **kw: stages.append(FakeStage(calls, **kw)) or stages[-1])
    rc = main(["run", "--full", "--results", str(root), "--out", str(tmp_path / "rep"),
               "--constants-out", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert rc == 1  # one benchmark and one check failed ...
    assert "microbenchmarks: sync.publish FAILED after" in out and "spin timed out waiting for flag 3" in out
    # ... and every later stage still ran, in order; the failed preset's timing was skipped
    order = [line.split("] ")[1].split(":")[0] for line in out.splitlines() if " done in " in line]
    assert order == ["microbenchmarks"] * 2 + ["gate quality", "tune", "megakernel", "megakernel", "report"], order
    assert ("bench", "sync.flags", "H", False) in calls
    assert stages[0].kw == {"quick": False, "ablate": True, "timeline": True, "detail": True, "baselines": True}
    # no adoption in this constants folder: the fresh revision, said out loud
    assert ("mega", False, 3, "measured") in calls and "no adopted constants revision" in out
    assert "timed shard8" not in calls and calls[-1] == "saved"
    assert "megakernel: shard8 T=16 ctx=2048 mega: skipped (an earlier item of megakernel/shard8 failed" in out
    assert list((root / "sync").glob("sync.flags-*.json"))
    # the gate's quality: the analysis of the recorded quality runs (two or more), or why there is none;
    # a result over 64 KB is saved gzipped (.json.gz), as the analysis of four committed runs is
    assert list((root / "gate").glob("gate.quality-*.json*")) or "quality run(s) recorded" in out
    assert (tmp_path / "c" / "nvidia-h200.json").is_file() and (tmp_path / "rep" / "REPORT.md").is_file()
    wall = list((root / "run").glob("run.wall-*.json"))  # the run's own durations, under the results root
    assert len(wall) == 1 and "(--full: no budget)" in out


def test_megakernel_stage_builds_the_adopted_revision_not_the_fresh_one(tmp_path, capsys):
    """Issue 45: a fresh run re-tuned the ring and the L2 budget and the megakernel built from them
    unmeasured. With an adoption in the constants folder, the stage builds that revision. The folder
    is the fixture copy of the committed one (revision 4 adopted, 5 current): a new adoption in
    reports/constants does not change what this asserts."""
    import json
    import shutil

    c = tmp_path / "c"
    shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "constants", c)
    cur = json.loads((c / "nvidia-h200.json").read_text())
    doc = json.loads((c / cur["revision_file"]).read_text())
    doc["constants"]["ring_stages"]["value"] = 3
    doc["constants"]["ring_stage_bytes"]["value"] = 16384
    nxt = cur["revision"] + 1
    doc.update(revision=nxt, revision_file=f"history/nvidia-h200-r{nxt:04d}.json")
    for p in (c / doc["revision_file"], c / "nvidia-h200.json"):
        p.write_text(json.dumps(doc))
    got = pipeline.build_constants(c / "nvidia-h200.json")
    assert got.revision == 4 and (got.ring_stages, got.ring_stage_bytes) == (2, 32768)
    assert f"not revision {nxt}" in capsys.readouterr().out


def test_unknown_class_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("reports.run.no_gpu_reason", lambda: pytest.fail("checked after the arguments"))
    rc = main(["run", "--classes", "nosuch", "--results", str(tmp_path), "--no-report",
               "--constants-out", str(tmp_path / "c")])
    assert rc == 2 and "unknown classes ['nosuch']" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_megakernel_stage_absent_or_present():
    st = pipeline.megakernel_stage(quick=True)
    assert st is None or callable(st.items)


@pytest.mark.parametrize("cmd", ["run", "tune", "report", "gate"])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--help"])
    assert ei.value.code == 0 and cmd in capsys.readouterr().out


def test_profile_samples_spread_and_window_hold_the_same_launch_count():
    from megakernel.plans import PROFILE_SAMPLE_EVERY, profile_samples

    spread, window = profile_samples(63)  # shard8: 63 launches, the middle one 31
    assert spread == tuple(range(3, 63, PROFILE_SAMPLE_EVERY)) and 31 in spread and len(spread) == 9
    assert window == tuple(range(27, 36))  # 9 consecutive launches centred on the middle one
    assert profile_samples(13) == ((6,), (6,))  # small
    for n in (1, 2, 7, 8, 100):  # always inside the step, as many launches in both
        s, w = profile_samples(n)
        assert len(s) == len(w) >= 1 and all(0 <= i < n for i in s + w)
        assert w == tuple(range(w[0], w[0] + len(w)))
