"""`megabench constants show`: each constant from its measurement to what the build renders, on
the committed files. The assertions are about structure and the files' consistency with each other
(a pin is what the tuned file holds, the build row follows the adopted revision through plan_for),
never about a measured value a new GPU run can change."""
from __future__ import annotations

import json
import shutil

import pytest

from megakernel.plans import PHASE_ALLOWANCE_NS
from microbench.constants import FEEDS_BUILD, RENAMED, SPECS
from microbench.errors import ResultsFileError
from microbench.results import REPO_ROOT
from reports.cli import main
from reports.constants_cli import BUILD_PATH, PRESETS, render, show

H200 = "NVIDIA H200"
COMMITTED = REPO_ROOT / "reports" / "constants"


@pytest.fixture(scope="module")
def rows():
    return show(H200, REPO_ROOT / "reports" / "results", COMMITTED, 132)


def test_one_row_per_constant_with_every_stage(rows):
    assert [r["name"] for r in rows] == [s.name for s in SPECS]
    for r in rows:
        m = r["measured"]
        assert (m["value"] is None) == (m["result_file"] is None)
        if m["result_file"]:
            assert (REPO_ROOT / m["result_file"]).is_file(), m  # the file it names exists
        else:
            assert m["why_none"]
        assert r["tuned"]["source"] in ("measured", "pinned", "default") and r["tuned"]["revision"] >= 1
        assert r["adopted"] is not None and r["adopted"]["file"].startswith("history/")
        assert r["feeds_build"] == (r["name"] in FEEDS_BUILD)
        if not r["feeds_build"]:
            assert r["build"] is None and r["build_how"] == "not read by the build"


def test_every_constant_the_build_reads_says_how(rows):
    assert set(FEEDS_BUILD) == set(BUILD_PATH)
    for r in (r for r in rows if r["feeds_build"]):
        assert r["build_how"]
        if r["build"] is not None:
            assert set(r["build"]) == set(PRESETS)


def test_pins_are_shown_and_a_pin_the_tuned_revision_lacks_says_so(rows, tmp_path):
    pins = json.loads((COMMITTED / "pins" / "nvidia-h200.json").read_text())["pins"]
    pinned = {r["name"]: r for r in rows if r["pin"] is not None}
    assert set(pinned) == set(pins)
    for name, r in pinned.items():
        assert r["pin"]["value"] == pins[name]["value"] and r["pin"]["reason"].strip()
    # a tuned file that holds every pin: no marker; one that holds none: a marker on each pinned line
    c = tmp_path / "constants"
    shutil.copytree(COMMITTED, c)
    cur = json.loads((c / "nvidia-h200.json").read_text())
    for name, e in pins.items():
        cur["constants"][name].update(value=e["value"], source="pinned")
    (c / "nvidia-h200.json").write_text(json.dumps(cur))
    held = render(H200, show(H200, REPO_ROOT / "reports" / "results", c, 132), 132)
    assert "does not hold it yet" not in held
    for name in pins:
        cur["constants"][name].update(source="measured")
    (c / "nvidia-h200.json").write_text(json.dumps(cur))
    lacking = render(H200, show(H200, REPO_ROOT / "reports" / "results", c, 132), 132)
    assert lacking.count("does not hold it yet") == len(pins)


def test_the_build_row_follows_the_adopted_revision(rows):
    by = {r["name"]: r for r in rows}
    spin = by["spin_bound_ns"]
    assert set(spin["build"].values()) == {spin["adopted"]["value"] + PHASE_ALLOWANCE_NS}
    ring = by["ring_stages"]
    assert all(v >= ring["adopted"]["value"] for v in ring["build"].values())  # fill_ring only adds stages
    assert set(by["max_code_bytes_per_launch"]["build"].values()) == {by["max_code_bytes_per_launch"]["adopted"]["value"]}
    for r in rows:  # a name the adopted revision recorded under an older one says which
        if r["adopted"]["recorded_as"]:
            assert RENAMED[r["adopted"]["recorded_as"]] == r["name"]


def test_a_changed_adoption_moves_the_build_row_and_not_the_tuned_one(tmp_path):
    """The build row reads the adopted revision: change only that file's spin bound."""
    c = tmp_path / "constants"
    shutil.copytree(COMMITTED, c)
    rec = json.loads((c / "adopted" / "nvidia-h200.json").read_text())
    doc = json.loads((c / rec["revision_file"]).read_text())
    doc["constants"]["spin_bound_ns"]["value"] = 7_000_000
    (c / rec["revision_file"]).write_text(json.dumps(doc))
    before = {r["name"]: r for r in show(H200, REPO_ROOT / "reports" / "results", COMMITTED, 132)}
    after = {r["name"]: r for r in show(H200, REPO_ROOT / "reports" / "results", c, 132)}
    assert set(after["spin_bound_ns"]["build"].values()) == {7_000_000 + PHASE_ALLOWANCE_NS}
    assert after["spin_bound_ns"]["build"] != before["spin_bound_ns"]["build"]
    assert after["spin_bound_ns"]["tuned"]["value"] == before["spin_bound_ns"]["tuned"]["value"]


def test_the_text_has_a_block_per_constant(rows):
    text = render(H200, rows, 132)
    for r in rows:
        block = text.split(f"\n{r['name']} (", 1)[1].split("\n\n", 1)[0]
        for line in ("measured", "tuned", "adopted", "build"):
            assert f"\n  {line} " in block, (r["name"], line)
        assert ("\n  pinned " in block) == (r["pin"] is not None)


def test_an_unknown_gpu_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(ResultsFileError, match="unknown GPU 'NVIDIA H100'.*'NVIDIA H200'"):
        show("NVIDIA H100", None, COMMITTED)
    assert main(["constants", "show", "--gpu", "NVIDIA H20"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'NVIDIA H20'" in err and "'NVIDIA H200'" in err


def test_the_command_prints_json_rows(capsys):
    assert main(["constants", "show", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in got] == [s.name for s in SPECS]
