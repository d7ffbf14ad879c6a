"""The megakernel builds from an adopted constants revision, never from what tune wrote last;
adopting needs a measurement of the build with that revision; pinned constants keep their value
and say why. CPU only: constants folders are copied to tmp_path.

The constants folder here is a fixture (tests/fixtures/constants: the committed folder as it was
with revision 4 adopted and 5 current, provenance strings shortened), so a new tune, adoption or
pin in reports/constants changes nothing these tests assert."""
from __future__ import annotations

import json
import shutil

import pytest
from megabench_synth import FIXTURES, H200, class_results, env, save_all, series

from microbench import adopt
from microbench import pins as pins_mod
from microbench.errors import ResultsFileError
from microbench.results import Result

CONSTANTS = FIXTURES / "constants"  # a copy of reports/constants at revision 4 adopted, 5 current


@pytest.fixture
def cdir(tmp_path, monkeypatch):
    """A copy of the fixture constants folder, made the constants folder; the build's choice of
    revision is the one without a GPU (plans.tuned) whatever GPU the host has: the fixture holds an
    H200's constants only, and on a host with another GPU tuned() rightly refuses them."""
    d = tmp_path / "constants"
    shutil.copytree(CONSTANTS, d)
    monkeypatch.setenv("MEGABENCH_CONSTANTS_DIR", str(d))
    monkeypatch.delenv("MEGABENCH_CONSTANTS", raising=False)
    monkeypatch.setattr("megakernel.plans.gpu_count", lambda: 0)
    return d


def test_an_adopted_revision_older_than_a_rename_loads_under_the_new_names():
    c = adopt.load_adopted(H200, CONSTANTS)
    assert c.revision == 4 and (c.ring_stages, c.ring_stage_bytes) == (2, 32 * 1024)
    assert c.l2_prefetch_budget_bytes == 40 << 20
    # revision 4 predates the icache rename: its values load under the new names, saying so
    assert c.icache_sm_bytes == 11264 and "renamed since" in c.provenance["icache_sm_bytes"]["note"]
    assert all(p.get("adopted") for p in c.provenance.values())
    assert adopt.load_adopted(None, CONSTANTS).revision == 4  # the only adoption


def _new_revision(cdir, **values):
    """A re-tuned current file (as tune would write it): revision 5 with `values` changed."""
    cur = json.loads((cdir / "nvidia-h200.json").read_text())
    doc = adopt.revision_document(H200, cur["revision_file"], cdir)
    for k, v in values.items():
        doc["constants"][k]["value"] = v
    doc.update(revision=5, revision_file="history/nvidia-h200-r0005.json")
    text = json.dumps(doc, indent=1)
    (cdir / "history" / "nvidia-h200-r0005.json").write_text(text)
    (cdir / "nvidia-h200.json").write_text(text)


def test_a_retuned_revision_does_not_reach_the_build(cdir):
    from megakernel.plans import constants_env, plan_for, tuned

    _new_revision(cdir, ring_stages=3, ring_stage_bytes=16384, l2_prefetch_budget_bytes=0)
    c = tuned()
    assert c.revision == 4 and (c.ring_stages, c.ring_stage_bytes) == (2, 32768)
    p = plan_for("tiny", None, 4)
    assert p.ring_stages - p.ring_fill == 2
    e = constants_env(env())
    assert e.constants_revision == 4 and e.constants_file.endswith("history/nvidia-h200-r0004.json")


def test_a_candidate_revision_is_built_only_when_named(cdir, monkeypatch):
    from megakernel.plans import constants_env, tuned

    _new_revision(cdir, ring_stages=3, ring_stage_bytes=16384)
    monkeypatch.setenv("MEGABENCH_CONSTANTS", str(cdir / "history" / "nvidia-h200-r0005.json"))
    assert tuned().revision == 5 and constants_env(env()).constants_revision == 5


def test_without_an_adoption_the_current_file_is_used_with_a_warning(cdir):
    from megakernel.plans import tuned

    (cdir / "adopted" / "nvidia-h200.json").unlink()
    with pytest.warns(UserWarning, match="no adopted constants revision"):
        assert tuned().revision == json.loads((cdir / "nvidia-h200.json").read_text())["revision"]


def _mk_result(root, rev, bench="megakernel.step", gpu=H200):
    e = env(gpu=gpu)
    import dataclasses

    e = dataclasses.replace(e, constants_revision=rev, constants_file=f"history/nvidia-h200-r{rev:04d}.json")
    return Result(bench, e, (series("step/x"),), {}).save(root)


def test_adopt_needs_a_measurement_of_the_build_with_that_revision(cdir, tmp_path):
    _new_revision(cdir, ring_stages=3, ring_stage_bytes=16384)
    res = tmp_path / "results"
    with pytest.raises(ResultsFileError, match="never adopted unmeasured"):
        adopt.adopt(H200, 5, [], "faster", cdir)
    with pytest.raises(ResultsFileError, match="revision 4, not 5"):
        adopt.adopt(H200, 5, [_mk_result(res, 4)], "faster", cdir)
    with pytest.raises(ResultsFileError, match="not a megakernel"):
        adopt.adopt(H200, 5, [_mk_result(res, 5, bench="weights.ring")], "faster", cdir)
    with pytest.raises(ResultsFileError, match="state the reason"):
        adopt.adopt(H200, 5, [_mk_result(res, 5)], " ", cdir)
    with pytest.raises(ResultsFileError, match="does not exist"):
        adopt.adopt(H200, 6, [_mk_result(res, 5)], "faster", cdir)
    p = adopt.adopt(H200, 5, [_mk_result(res, 5)], "shard8 T=16 -1.2% in an A/B", cdir)
    rec = adopt.load_adoption(H200, cdir)
    assert p.exists() and rec["revision"] == 5 and rec["history"][0]["revision"] == 4
    assert adopt.load_adopted(H200, cdir).ring_stages == 3


def test_pins_hold_a_constant_and_record_what_was_measured(tmp_path):
    from microbench.tune import collect, from_document, render

    res = tmp_path / "results"
    save_all(class_results(), res)
    pins = pins_mod.load_pins(H200, CONSTANTS)
    assert set(pins) == {"l2_prefetch_budget_bytes", "spin_bound_ns", "poll_backoff_ns"}
    assert pins["l2_prefetch_budget_bytes"].value == 40 << 20
    assert pins["spin_bound_ns"].value == 20_000_000  # its rule gave 20 and 10 ms on two fresh machines
    assert pins["poll_backoff_ns"].value == 128  # 128 / 128 / 32 / 0 ns on four machines; the build can't tell
    _, free = collect(res, H200)
    _, held = collect(res, H200, pins=pins)
    e = held["l2_prefetch_budget_bytes"]
    assert e.source == "pinned" and e.value == 40 << 20 and "PINNED" in e.provenance["rule"]
    assert e.provenance["measured_value"] == free["l2_prefetch_budget_bytes"].value != e.value
    doc = render(H200, held, res)
    assert doc["pinned"] == ["l2_prefetch_budget_bytes", "poll_backoff_ns", "spin_bound_ns"]
    assert from_document(doc, gpu=H200).l2_prefetch_budget_bytes == 40 << 20


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["pins"].update(nonsense={"value": 1, "reason": "x"}), "unknown constant"),
    (lambda d: d["pins"]["l2_prefetch_budget_bytes"].update(reason=""), "no reason"),
    (lambda d: d["pins"]["l2_prefetch_budget_bytes"].update(value=1.5), "whole number"),
    (lambda d: d.update(gpu="NVIDIA H100"), "pins for"),
])
def test_bad_pins_are_refused(tmp_path, edit, message):
    d = json.loads((CONSTANTS / "pins" / "nvidia-h200.json").read_text())
    edit(d)
    (tmp_path / "pins").mkdir()
    (tmp_path / "pins" / "nvidia-h200.json").write_text(json.dumps(d))
    with pytest.raises(ResultsFileError, match=message):
        pins_mod.load_pins(H200, tmp_path)


def test_older_megakernel_results_are_credited_with_their_commit_s_revision():
    from microbench.results import find, load

    files = [p for p in find("megakernel.build", FIXTURES / "results") if "58f75e5" in p.name]
    assert files, "the fixture copy of the megakernel.build result of 58f75e5"
    if adopt.revision_at_commit("58f75e5", H200) is None:
        pytest.skip("the commit 58f75e5 is not in this checkout's git history")
    rev, how = adopt.result_revision(load(files[0]))
    assert rev == 4 and "58f75e5" in how
