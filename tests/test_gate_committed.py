"""Real H200 data through the stored-results gate. The committed folders pass against themselves
(exit 0: every committed file loads and gates without an unknown). On fixture copies of committed
results (tests/fixtures/results and benchmarks: the shard8 step series, one fence series, two
icache curves, the baseline's eight megakernel cases), series the gate cannot judge say why, and a
1.5x slowdown of any one headline series is a regression, in typed results and in pytest-benchmark
JSON, against one named run and against the folder (its newest run per benchmark). The fixtures,
not the committed folders, carry what these assert, so a new GPU run or a prune changes none of it."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from reports.cli import main
from microbench.gate import EXIT_OK, EXIT_REGRESSION, compare, load_measurements
from microbench.results import REPO_ROOT

RESULTS = REPO_ROOT / "reports" / "results"
BENCH = REPO_ROOT / "reports" / "benchmarks"
FIXTURE_RESULTS = REPO_ROOT / "tests" / "fixtures" / "results"
FIXTURE_BENCH = REPO_ROOT / "tests" / "fixtures" / "benchmarks"
HEADLINE_STEP = [f"megakernel.step:shard8/T{t}/ctx2048/{m}" for t in (16, 1) for m in ("mega", "chain")]


@pytest.fixture(scope="module")
def committed():
    """The fixture copies: real H200 series, fixed."""
    return load_measurements(FIXTURE_RESULTS)


def test_committed_results_pass_against_themselves(capsys):
    # the folder holds several GPUs' runs: each gated on its own (--gpu), every one passing
    gpus = sorted({m.gpu_key for m in load_measurements(RESULTS) if m.gpu_key})
    assert gpus
    for g in gpus:
        assert main(["gate", str(RESULTS), str(RESULTS), "--aa-spread", "none", "--gpu", g]) == EXIT_OK, g
        out = capsys.readouterr().out
        assert "unknown" not in out.split("\n")[0] and " same" in out.split("\n")[0], g
    # one early file (basics, 11-29) predates the GPU label: the documented --assume-gpu names it
    assert main(["gate", str(BENCH), str(BENCH), "--aa-spread", "none", "--assume-gpu", "NVIDIA H200@1980MHz"]) == EXIT_OK


def test_committed_series_not_fit_to_gate_say_why(committed):
    rep = compare(committed, committed)
    why = {v.key: v.reason for v in rep.verdicts if v.verdict == "not gated"}
    fence = [k for k in why if k.startswith("sync.fences:fence/acq_rel_cta/alone/132blk")]
    assert fence and "not a duration" in why[fence[0]] or "independent launches" in why[fence[0]]
    cap = [k for k in why if k.startswith("icache.capacity:")]
    assert cap and all("3 launches" in why[k] for k in cap)
    assert rep.count("unknown") == 0 and rep.count("same") == len(HEADLINE_STEP)
    gated = {v.key for v in rep.verdicts if v.verdict == "same"}
    assert set(HEADLINE_STEP) <= gated


@pytest.mark.parametrize("key", HEADLINE_STEP)
def test_headline_step_slowed_by_half_is_a_regression(committed, key):
    cand = [dataclasses.replace(m, samples=tuple(x * 1.5 for x in m.samples), median=m.median * 1.5)
            if m.key == key else m for m in committed]
    rep = compare(committed, cand)
    got = {v.key: v.verdict for v in rep.verdicts if v.key.startswith("megakernel.step:")}
    assert got[key] == "regression" and list(got.values()).count("regression") == 1
    assert rep.exit_code() == EXIT_REGRESSION


def _newest_megakernel_json():
    """The baseline's eight megakernel cases, per step (rounds of two steps divided, `time_per`)."""
    files = sorted(FIXTURE_BENCH.glob("*megakernel*.json"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.parametrize("case", range(8))
def test_headline_pytest_case_slowed_by_half_is_a_regression(tmp_path, case):
    src = _newest_megakernel_json()
    d = json.loads(src.read_text())
    b = d["benchmarks"][case]
    b["stats"]["data"] = [x * 1.5 for x in b["stats"]["data"]]
    b["stats"]["median"] *= 1.5
    d["datetime"] = "2099-01-01T00:00:00+00:00"
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(d))
    for baseline in (src, FIXTURE_BENCH):  # one named run, and the folder's newest run of each case
        rep = compare(load_measurements(baseline, "NVIDIA H200@1980MHz"), load_measurements(slow))
        got = {v.key: v.verdict for v in rep.verdicts}
        assert got[b["fullname"]] == "regression" and list(got.values()).count("regression") == 1, baseline
    assert main(["gate", str(src), str(slow), "--aa-spread", "none"]) == EXIT_REGRESSION


def test_old_two_step_rounds_compare_per_step_with_new_ones(tmp_path):
    """Before `time_per: step` a megakernel round timed 2 steps; the gate divides, so a per-step run
    of the same speed is the same. The old form is rebuilt from the per-step fixture: each round
    times `steps_per_round` steps and says nothing of `time_per`."""
    new = json.loads(_newest_megakernel_json().read_text())
    old = copy.deepcopy(new)
    for b in old["benchmarks"]:
        steps = b["extra_info"]["steps_per_round"]
        assert steps == 2 and b["extra_info"].pop("time_per") == "step"
        b["stats"]["data"] = [x * steps for x in b["stats"]["data"]]
        b["stats"]["median"] *= steps
    p_old, p_new = tmp_path / "old.json", tmp_path / "new.json"
    p_old.write_text(json.dumps(old))
    p_new.write_text(json.dumps(new))
    old_ms, new_ms = load_measurements(p_old), load_measurements(p_new)
    assert [m.median for m in old_ms] == pytest.approx([m.median for m in new_ms])
    assert np.median(old_ms[-1].samples) == pytest.approx(new_ms[-1].median)
    assert {v.verdict for v in compare(old_ms, new_ms).verdicts} == {"same"}
