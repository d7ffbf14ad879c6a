"""megabench tune: measured vs default constants, provenance, revisions, and refusal of bad files."""
from __future__ import annotations

import dataclasses
import json

import pytest
from megabench_synth import H200, class_results, env, save_all, series

from microbench.constants import SPECS
from microbench.errors import ResultsFileError
from microbench.results import Derived, Result
from microbench.tune import (SCHEMA, VERSION, TunedConstants, collect, gpu_slug, load_constants, render, tune,
                             write)


def _values(root, gpu=H200):
    _, entries = collect(root, gpu)
    return {n: e.value for n, e in entries.items()}


def test_all_measured_with_provenance(tmp_path):
    res = tmp_path / "results"
    save_all(class_results(), res)
    gpu, entries = collect(res)
    assert gpu == H200
    for s in SPECS:
        e = entries[s.name]
        assert e.source == "measured", s.name
        p = e.provenance
        assert p["benchmark"] == s.benchmark and p["gpu"] == H200 and p["git_sha"] == "abc1234"
        assert p["result_file"].endswith(".json") and p["date"] == "2026-11-29T10:00:00Z"
        assert p["rule"].startswith(f"rule for {s.name}") and len(p["spread"]) == 2
        assert isinstance(e.value, int) == s.integer


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_changing_one_measurement_changes_exactly_its_constant(tmp_path, spec):
    res = tmp_path / "results"
    save_all(class_results(date="2026-11-29T10:00:00Z"), res)
    before = _values(res)
    # a newer run of every benchmark; only this constant's measurement differs
    new = 2 * before[spec.name] + 1
    save_all(class_results(date="2026-11-30T10:00:00Z", overrides={spec.name: new}), res)
    after = _values(res)
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {spec.name}
    assert after[spec.name] == (int(new) if spec.integer else new)


def test_newer_result_of_one_benchmark_moves_only_its_constants(tmp_path):
    res = tmp_path / "results"
    save_all(class_results(), res)
    before = _values(res)
    target = "sync.flags"
    owned = {s.name for s in SPECS if s.benchmark == target}
    derived = {s.derived_key: Derived(2 * before[s.name] + 3, s.unit, "re-measured", None) for s in SPECS
               if s.benchmark == target}
    Result(target, env(date="2026-12-01T00:00:00Z"), (series("x"),), derived).save(res)
    after = _values(res)
    assert {n for n in before if before[n] != after[n]} == owned
    _, entries = collect(res, H200)
    for n in owned:
        assert entries[n].provenance["date"] == "2026-12-01T00:00:00Z"


def test_missing_class_falls_back_loudly(tmp_path):
    res = tmp_path / "results"
    icache = {s.name for s in SPECS if s.benchmark.startswith("icache.")}
    save_all([r for r in class_results() if not r.benchmark.startswith("icache.")], res)
    gpu, entries = collect(res)
    doc = render(gpu, entries, res)
    assert set(doc["defaults_used"]) == icache
    assert "DEFAULTS" in doc["WARNING"] and all(n in doc["WARNING"] for n in icache)
    assert list(doc)[:3] == ["schema", "version", "WARNING"]  # loud: at the top
    for n in icache:
        e = doc["constants"][n]
        spec = next(s for s in SPECS if s.name == n)
        assert e["source"] == "default" and e["value"] == spec.default and "no icache." in e["reason"]


def test_result_without_the_key_is_a_default_naming_the_file(tmp_path):
    res = tmp_path / "results"
    rs = class_results(skip={"ring_stages"})
    save_all(rs, res)
    _, entries = collect(res)
    e = entries["ring_stages"]
    assert e.source == "default" and "has no derived 'ring_stages'" in e.provenance["reason"]
    assert entries["ring_stage_bytes"].source == "measured"


def test_other_gpu_results_are_not_mixed(tmp_path):
    res = tmp_path / "results"
    save_all(class_results(gpu="NVIDIA GB300", date="2026-12-01T00:00:00Z"), res)
    save_all(class_results(gpu=H200, skip={"flag_latency_s"}), res)
    gpu, entries = collect(res, H200)
    assert entries["flag_latency_s"].source == "default"  # the GB300 value is not borrowed
    assert collect(res)[0] == "NVIDIA GB300"  # newest result's GPU by default


def test_unit_mismatch_is_refused(tmp_path):
    res = tmp_path / "results"
    Result("sync.flags", env(), (series("x"),), {"flag_latency_s": Derived(1.0, "us", "r")}).save(res)
    with pytest.raises(ResultsFileError, match=r"unit 'us' but constant flag_latency_s is in 's'"):
        collect(res)


def test_malformed_result_is_refused(tmp_path):
    res = tmp_path / "results"
    save_all(class_results(), res)
    bad = res / "sync" / "sync.flags-20261231T000000Z-nvidia-h200-x.json"
    bad.write_text('{"schema": "megabench.result", "version": 1, "env": {"gpu": "NVIDIA H200", '
                   '"date": "2026-12-31T00:00:00Z"}}')
    with pytest.raises(ResultsFileError, match="sync.flags-20261231.*malformed"):
        collect(res, H200)


def test_rule_less_derivation_is_refused(tmp_path):
    res = tmp_path / "results"
    Result("sync.flags", env(), (series("x"),), {"flag_latency_s": Derived(1e-6, "s", " ")}).save(res)
    with pytest.raises(ResultsFileError, match="no rule stated"):
        collect(res)


def test_write_revisions_and_current(tmp_path):
    res, out = tmp_path / "results", tmp_path / "constants"
    save_all(class_results(), res)
    doc, cur, rev, created = tune(res, None, out)
    assert created and cur == out / "nvidia-h200.json" and rev.name == "nvidia-h200-r0001.json"
    assert "WARNING" not in json.loads(cur.read_text())  # every constant measured: nothing to shout about
    assert json.loads(cur.read_text()) == json.loads(rev.read_text())
    # same inputs: no new revision
    _, cur2, rev2, created2 = tune(res, None, out)
    assert not created2 and rev2 == rev
    # a new measurement: a new revision, the old one kept intact
    save_all(class_results(date="2026-12-02T00:00:00Z", overrides={"ring_stages": 6}), res)
    _, cur3, rev3, created3 = tune(res, None, out)
    assert created3 and rev3.name == "nvidia-h200-r0002.json"
    assert json.loads(rev.read_text())["constants"]["ring_stages"]["value"] == 3
    c = load_constants(cur3)
    assert c.ring_stages == 6 and c.revision == 2 and c.gpu == H200
    assert json.loads(cur3.read_text())["supersedes"] == "history/nvidia-h200-r0001.json"


def test_hand_edited_current_needs_force(tmp_path):
    res, out = tmp_path / "results", tmp_path / "constants"
    save_all(class_results(), res)
    _, cur, _, _ = tune(res, None, out)
    d = json.loads(cur.read_text())
    d["constants"]["ring_stages"]["value"] = 99
    cur.write_text(json.dumps(d))
    save_all(class_results(date="2026-12-02T00:00:00Z", overrides={"ring_stages": 7}), res)
    with pytest.raises(ResultsFileError, match="edited by hand"):
        tune(res, None, out)
    _, cur, rev, created = tune(res, None, out, force=True)
    assert created and load_constants(cur).ring_stages == 7


def test_no_results_and_no_gpu_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResultsFileError, match="--gpu NAME --new-gpu"):
        tune(tmp_path / "empty", None, tmp_path / "c")
    with pytest.raises(ResultsFileError, match="no results for GPU 'NVIDIA H200'.*from no GPU; pass --new-gpu"):
        tune(tmp_path / "empty", "NVIDIA H200", tmp_path / "c")
    assert not (tmp_path / "c").exists()
    doc, cur, _, _ = tune(tmp_path / "empty", "NVIDIA H200", tmp_path / "c", new_gpu=True)
    assert len(doc["defaults_used"]) == len(SPECS)
    assert load_constants(cur).defaults_used() == tuple(s.name for s in SPECS)
    assert list(json.loads(cur.read_text()))[:3] == ["schema", "version", "WARNING"]  # loud, at the top


# ----------------------------------------------------------------------------- load_constants
@pytest.fixture
def good_doc(tmp_path):
    res = tmp_path / "results"
    save_all(class_results(), res)
    _, cur, _, _ = tune(res, None, tmp_path / "constants")
    return json.loads(cur.read_text())


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="megabench.result"), "schema is 'megabench.result'"),
    (lambda d: d.update(version=VERSION + 1), "newer megabench"),
    (lambda d: d.update(version="1"), "expected an integer"),
    (lambda d: d.pop("constants"), "no 'constants'"),
    (lambda d: d["constants"].update(warp_speed={"value": 9, "unit": ""}), r"unknown constants \['warp_speed'\]"),
    (lambda d: d["constants"].pop("ring_stages"), r"missing constants \['ring_stages'\]"),
    (lambda d: d["constants"]["flag_latency_s"].update(unit="us"), "flag_latency_s: unit 'us', expected 's'"),
    (lambda d: d["constants"]["ring_stages"].update(value=4.5), "must be an integer"),
    (lambda d: d["constants"]["ring_stages"].update(value="4"), "not a finite number"),
    (lambda d: d["constants"]["ring_stages"].update(source="guessed"), "source 'guessed'"),
    (lambda d: d["constants"]["ring_stages"].pop("rule"), r"without provenance \['rule'\]"),
    (lambda d: d["constants"]["ring_stages"].update(gpu="NVIDIA GB300"), "measured on 'NVIDIA GB300'"),
])
def test_bad_constants_files_are_refused(tmp_path, good_doc, mutate, message):
    mutate(good_doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(good_doc))
    with pytest.raises(ResultsFileError, match=message) as ei:
        load_constants(p)
    assert str(p) in str(ei.value)


def test_load_refuses_other_gpu_and_garbage(tmp_path, good_doc):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(good_doc))
    with pytest.raises(ResultsFileError, match="never cross GPU models"):
        load_constants(p, gpu="NVIDIA GB300")
    p.write_text("{not json")
    with pytest.raises(ResultsFileError, match="not valid JSON"):
        load_constants(p)
    with pytest.raises(ResultsFileError, match="no such constants file"):
        load_constants(tmp_path / "nope.json")


def test_tuned_constants_dataclass(good_doc, tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(good_doc))
    c = load_constants(p)
    assert [f.name for f in dataclasses.fields(TunedConstants)][:len(SPECS)] == [s.name for s in SPECS]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.ring_stages = 2
    defs = c.as_defines()
    assert defs["MB_RING_STAGES"] == str(c.ring_stages)
    assert float(defs["MB_FLAG_LATENCY_S"]) == c.flag_latency_s
    assert c.provenance["ring_stages"]["source"] == "measured"
    d = TunedConstants.defaults()
    assert d.defaults_used() == tuple(s.name for s in SPECS)
    assert d.ring_stages == next(s for s in SPECS if s.name == "ring_stages").default


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200" and gpu_slug(None) == "cpu"
    assert SCHEMA == "megabench.constants"


def test_write_refuses_current_without_revision(tmp_path, good_doc):
    out = tmp_path / "c"
    out.mkdir()
    (out / "nvidia-h200.json").write_text(json.dumps({k: v for k, v in good_doc.items() if k != "revision_file"}))
    with pytest.raises(ResultsFileError, match="no revision file on record"):
        write(good_doc, out)


def test_only_rederives_the_named_constants_and_keeps_the_rest(tmp_path):
    """tune --only: a newer run of every class must not move the constants it does not name."""
    res, out = tmp_path / "results", tmp_path / "constants"
    save_all(class_results(date="2026-11-29T10:00:00Z"), res)
    tune(res, H200, out)
    before = load_constants(out / f"{gpu_slug(H200)}.json")
    target = SPECS[0].name
    other = SPECS[1].name
    v0 = _values(res)
    save_all(class_results(date="2026-11-30T10:00:00Z",
                           overrides={target: 2 * v0[target] + 1, other: 2 * v0[other] + 1}), res)
    doc, cur, rev, created = tune(res, H200, out, only=[target])
    after = load_constants(cur)
    assert created and getattr(after, target) != getattr(before, target)
    assert getattr(after, other) == getattr(before, other)
    assert after.provenance[other]["date"] == "2026-11-29T10:00:00Z"
    assert after.provenance[target]["date"] == "2026-11-30T10:00:00Z"
    with pytest.raises(ResultsFileError, match="unknown constants"):
        tune(res, H200, out, only=["no_such_constant"])
    with pytest.raises(ResultsFileError, match="no current constants file"):
        tune(res, H200, tmp_path / "empty", only=[target])
