"""megabench gate: verdict rules, GPU keying, input formats, exit codes, kernel metrics, quality."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from megabench_synth import env, series

from reports.cli import main
from microbench.errors import ResultsFileError
from microbench.gate import (EXIT_GPU, EXIT_INPUT, EXIT_OK, EXIT_REGRESSION, EXIT_UNKNOWN, CrossRun, GateConfig,
                             GpuMismatchError, Measurement, compare, judge, key_class, load_measurements, newest)
from microbench.kernel_gate import KernelThresholds, compare_kernels, kernel_gate, load_kernel_baseline
from microbench.results import REPO_ROOT, Result, Series

KEY = "NVIDIA H200@1980MHz"


def meas(median=1e-3, noise=0.01, n=40, seed=0, unit="s", key="k", gpu=KEY, samples=True, date="d", static=False):
    rng = np.random.default_rng(seed)
    x = median * (1 + noise * rng.standard_normal(n))
    return Measurement(key, tuple(x) if samples else None, float(np.median(x)), None, unit,
                       {"s": "lower", "B/s": "higher", "": "none"}[unit], gpu, "f", date, static)


# ----------------------------------------------------------------------------- verdict rule
def test_same_distribution_is_same():
    v = judge(meas(seed=1), meas(seed=2))
    assert v.verdict == "same" and abs(v.slowdown) < 0.01


def test_clear_slowdown_is_a_regression():
    v = judge(meas(seed=1), meas(1.10e-3, seed=2))
    assert v.verdict == "regression" and 0.08 < v.slowdown < 0.12 and v.p_slower < 1e-6
    assert v.threshold == pytest.approx(0.05)


def test_slowdown_within_noise_is_not_a_regression():
    v = judge(meas(noise=0.2, seed=1), meas(1.10e-3, noise=0.2, seed=2))
    assert v.verdict == "same" and v.threshold > 0.2


def test_below_floor_is_not_a_regression_even_if_significant():
    v = judge(meas(noise=0.001, seed=1), meas(1.03e-3, noise=0.001, seed=2))
    assert v.verdict == "same" and v.p_slower < 1e-6 and "within the threshold" in v.reason


def test_rank_test_must_agree():
    # median 8% higher but the samples overlap: one wild sample pulls nothing, ranks disagree
    base = Measurement("k", (1.0, 1.0, 1.2, 1.2, 1.0, 1.2, 1.0, 1.2, 1.0, 1.2), 1.1, None, "s", "lower", KEY, "f", "")
    cand = Measurement("k", (1.0, 1.2, 1.2, 1.2, 1.0, 1.2, 1.0, 1.2, 1.0, 1.2), 1.2, None, "s", "lower", KEY, "f", "")
    v = judge(base, cand, GateConfig(floor=0.05, k=0.0))
    assert v.slowdown > 0.05 and v.verdict == "same" and "rank test disagrees" in v.reason


def test_improvement_and_rates():
    assert judge(meas(seed=1), meas(0.8e-3, seed=2)).verdict == "improvement"
    # bandwidth: a lower rate is the slowdown
    v = judge(meas(4e12, unit="B/s", seed=1), meas(3.5e12, unit="B/s", seed=2))
    assert v.verdict == "regression" and v.slowdown == pytest.approx(4 / 3.5 - 1, rel=0.05)
    assert judge(meas(4e12, unit="B/s", seed=1), meas(4.6e12, unit="B/s", seed=2)).verdict == "improvement"


@pytest.mark.parametrize("base_kw, cand_kw, reason", [
    ({"samples": False}, {}, "baseline has no raw samples"),
    ({}, {"samples": False}, "candidate has no raw samples"),
    ({"n": 5}, {}, "baseline has 5 independent repeats"),
])
def test_unknown_without_samples(base_kw, cand_kw, reason):
    v = judge(meas(**base_kw), meas(2e-3, **cand_kw))
    assert v.verdict == "unknown" and reason in v.reason and v.slowdown == pytest.approx(1.0, rel=0.1)


def test_not_gated():
    assert judge(meas(1.0, unit=""), meas(2.0, unit="")).verdict == "not gated"
    assert judge(meas(static=True), meas(2e-3, static=True)).verdict == "not gated"


def test_folder_history_is_not_noise():
    """A folder's earlier runs are history: the newest run of the benchmark is the baseline, and a
    +5.4% candidate against it is a regression even though an older run was 12% off."""
    base = [meas(1e-3, seed=1, date="a", noise=0.002), meas(1.12e-3, seed=2, date="b", noise=0.002)]
    cand = [meas(1.18e-3, seed=3, noise=0.002)]
    v = compare(base, cand).verdicts[0]
    assert v.verdict == "regression" and v.threshold == pytest.approx(0.05) and v.base_median > 1.1e-3


def test_newest_run_per_benchmark_takes_the_whole_file():
    """A benchmark's newest file is its baseline with all its series; a series only an older run
    had is not part of it."""
    old = [dataclasses.replace(meas(seed=1, key="b:x"), run="b", source="old", date="a"),
           dataclasses.replace(meas(seed=2, key="b:gone"), run="b", source="old", date="a")]
    new = [dataclasses.replace(meas(2e-3, seed=3, key="b:x"), run="b", source="new", date="b")]
    picked = newest(old + new)
    assert set(picked) == {("b:x", KEY)} and picked[("b:x", KEY)].source == "new"


def test_cross_run_spread_raises_the_threshold():
    base, cand = [meas(1e-3, seed=1, noise=0.002)], [meas(1.08e-3, seed=2, noise=0.002)]
    assert compare(base, cand).verdicts[0].verdict == "regression"
    rep = compare(base, cand, cross=CrossRun({"k": 0.12}, "NVIDIA H200"))
    assert rep.verdicts[0].verdict == "same" and rep.verdicts[0].threshold == pytest.approx(0.12)
    assert "cross-run noise: A/A spreads of 1 series" in rep.notes[0]
    assert "no A/A cross-run spread recorded" in compare(base, cand).notes[0]
    # a series without its own record takes its class's pooled spread, else everyone's
    cr = CrossRun({"sync.flags:a": 0.01, "sync.flags:b": 0.2, "basics.copy:c": 0.03}, "NVIDIA H200")
    assert cr.for_key("sync.fences:x")[0] == pytest.approx(np.percentile([0.01, 0.2], 90))
    assert cr.for_key("weights.ring:y")[0] == pytest.approx(np.percentile([0.01, 0.2, 0.03], 90))
    assert cr.for_key("basics.copy:c")[0] == pytest.approx(0.03)
    assert cr.for_key("sync.flags:b", exclude_self=True)[0] == pytest.approx(0.01)
    assert key_class("tests/bench/test_bench_sync.py::test_sync[x]") == "sync"
    # another GPU's spreads are not used
    rep = compare(base, cand, cross=CrossRun({"k": 0.12}, "NVIDIA GB300"))
    assert rep.verdicts[0].verdict == "regression" and "not used" in rep.notes[0]


# ----------------------------------------------------------------------------- fitness of series
def _fit(name, **kw):
    from microbench.gate import fitness

    return fitness(series(name, **kw), env())


def test_in_kernel_series_count_launches_not_sms():
    reps, how, _, why = _fit("cap", median=1.0, n=396, unit="cycles/instr", timer="clock64",
                             metrics={"launches": 3})
    assert reps == 3 and "3 launches" in how and "fewer than 8 independent launches" in why
    reps, _, _, why = _fit("grid", median=1.5e-7, n=132, timer="clock64")
    assert reps == 1 and "one launch" in why
    reps, _, contiguous, why = _fit("rec", median=2e-6, n=12 * 132, timer="globaltimer",
                                    metrics={"independent_repeats": 12, "repeat_layout": "contiguous"})
    assert reps == 12 and contiguous and why == ""
    assert _fit("ev", median=1e-5, n=20)[0] is None  # cuda_event: one launch per sample


def test_negative_and_sub_tick_durations_are_not_gated():
    assert "not a duration" in _fit("fence", median=-4.9e-10, timer="clock64", metrics={"independent_repeats": 20})[3]
    why = _fit("gt", median=60.0, unit="ns", timer="globaltimer", params={"tick_ns": 32},
               metrics={"independent_repeats": 20})[3]
    assert "4 ticks" in why and "32" in why
    assert _fit("gt", median=200.0, unit="ns", timer="globaltimer", params={"tick_ns": 32},
                metrics={"independent_repeats": 20})[3] == ""
    assert "not a duration" in _fit("ev", median=1e-6)[3]  # 2 ticks of a CUDA event pair
    assert _fit("ev", median=1e-6, params={"batch": 200})[3] == ""  # a sample is 1/200 of an event pair
    assert _fit("marked", metrics={"gated": False, "not_gated_reason": "a timeline"})[3] == "a timeline"


def test_aggregated_repeats_are_what_the_rank_test_sees(tmp_path):
    rng = np.random.default_rng(0)
    per_launch = 1e-6 * (1 + 0.01 * rng.standard_normal(12))
    x = np.repeat(per_launch, 132) * (1 + 0.2 * rng.standard_normal(12 * 132))  # wide spread across SMs
    s = Series.from_samples("probe", x, timer="globaltimer", unit="s", params={"tick_ns": 32},
                            metrics={"independent_repeats": 12, "repeat_layout": "contiguous"})
    p = Result("sync.probe", env(), (s,)).save(tmp_path)
    (m,) = load_measurements(p)
    assert m.n_repeats == 12 and m.units().shape == (12,)
    v = judge(m, m)
    assert v.verdict == "same" and v.n_base == 12
    few = dataclasses.replace(m, samples=m.samples[:5 * 132], repeats=5)
    assert judge(few, m).verdict == "unknown" and "baseline has 5 independent repeats" in judge(few, m).reason


# ----------------------------------------------------------------------------- GPU keying
def test_cross_gpu_is_refused():
    with pytest.raises(GpuMismatchError, match="refusing to compare across GPUs.*NVIDIA GB300"):
        compare([meas(gpu=KEY)], [meas(gpu="NVIDIA GB300@2032MHz")])
    with pytest.raises(GpuMismatchError, match="does not record|do not record"):
        compare([meas(gpu=None)], [meas()])
    with pytest.raises(GpuMismatchError, match="mixes GPUs"):
        compare([meas()], [meas(), meas(gpu="other@1MHz", key="j")])


def test_baseline_other_gpus_ignored_and_listed():
    rep = compare([meas(gpu="NVIDIA GB300@2032MHz", seed=5), meas(seed=1), meas(key="only_base")],
                  [meas(seed=2), meas(key="new")])
    assert [v.key for v in rep.verdicts] == ["k"] and rep.only_baseline == ["only_base"]
    assert rep.only_candidate == ["new"] and "ignored (other GPUs)" in rep.notes[0]
    md = rep.to_markdown()
    assert "| benchmark" in md and "New in the candidate" in md


def test_exit_codes():
    assert compare([meas(seed=1)], [meas(seed=2)]).exit_code() == EXIT_OK
    assert compare([meas(seed=1)], [meas(1.2e-3, seed=2)]).exit_code() == EXIT_REGRESSION
    unk = compare([meas(samples=False)], [meas()])
    assert unk.exit_code() == EXIT_UNKNOWN and unk.exit_code(allow_unknown=True) == EXIT_OK
    assert compare([meas(key="a")], [meas(key="b")]).exit_code() == EXIT_UNKNOWN  # nothing compared


# ----------------------------------------------------------------------------- files and CLI
def _result(root, bench="basics.copy", median=1e-3, gpu="NVIDIA H200", seed=0, date="2026-11-29T10:00:00Z"):
    r = Result(bench, env(gpu=gpu, date=date), (series("copy/x", median, seed=seed), series("copy/y", 2e-3, seed=seed + 7)))
    return r.save(root)


def _pytest_json(path: Path, medians: dict, data=True, gpu_key=KEY):
    rng = np.random.default_rng(0)
    bs = []
    for name, med in medians.items():
        x = (med * (1 + 0.01 * rng.standard_normal(15))).tolist()
        st = {"median": float(np.median(x)), "iqr": float(np.subtract(*np.percentile(x, [75, 25]))), "min": min(x)}
        if data:
            st["data"] = x
        bs.append({"name": name, "fullname": f"tests/bench/t.py::{name}", "stats": st, "extra_info": {}})
    mi = {"node": "vm"}
    if gpu_key:
        mi["megabench"] = {"gpu_key": gpu_key}
    path.write_text(json.dumps({"machine_info": mi, "commit_info": {}, "benchmarks": bs,
                                "datetime": "2026-11-29T10:00:00+00:00", "version": "5.2.3"}))
    return path


def test_cli_result_files(tmp_path, capsys):
    base = _result(tmp_path / "base")
    same = _result(tmp_path / "same", seed=3)
    slow = _result(tmp_path / "slow", median=1.2e-3, seed=4)
    other = _result(tmp_path / "gb", gpu="NVIDIA GB300")
    assert main(["gate", str(base), str(same)]) == EXIT_OK
    md = tmp_path / "summary.md"
    js = tmp_path / "v.json"
    assert main(["gate", str(tmp_path / "base"), str(tmp_path / "slow"), "--markdown", str(md), "--json", str(js)]) \
        == EXIT_REGRESSION
    assert "REGRESSION" in md.read_text() and "basics.copy:copy/x" in md.read_text()
    assert json.loads(js.read_text())["verdicts"][0]["verdict"] == "regression"
    assert main(["gate", str(base), str(other)]) == EXIT_GPU
    assert "refusing to compare across GPUs" in capsys.readouterr().err
    assert main(["gate", str(base), str(tmp_path / "missing.json")]) == EXIT_INPUT
    (tmp_path / "junk.json").write_text('{"hello": 1}')
    assert main(["gate", str(base), str(tmp_path / "junk.json")]) == EXIT_INPUT
    (tmp_path / "broken.json").write_text("{")
    assert main(["gate", str(base), str(tmp_path / "broken.json")]) == EXIT_INPUT
    assert main(["gate"]) == EXIT_INPUT


def test_cli_pytest_benchmark(tmp_path, capsys):
    a = _pytest_json(tmp_path / "a.json", {"t1": 1e-3, "t2": 2e-3})
    b = _pytest_json(tmp_path / "b.json", {"t1": 1.3e-3, "t2": 2e-3})
    assert main(["gate", str(a), str(b)]) == EXIT_REGRESSION
    nodata = _pytest_json(tmp_path / "c.json", {"t1": 1e-3, "t2": 2e-3}, data=False)
    assert main(["gate", str(a), str(nodata)]) == EXIT_UNKNOWN
    assert main(["gate", str(a), str(nodata), "--allow-unknown"]) == EXIT_OK
    unl = _pytest_json(tmp_path / "d.json", {"t1": 1e-3}, gpu_key=None)
    capsys.readouterr()
    assert main(["gate", str(a), str(unl)]) == EXIT_GPU
    assert "--assume-gpu" in capsys.readouterr().err
    assert main(["gate", str(a), str(unl), "--assume-gpu", KEY]) == EXIT_OK


def test_committed_h200_files_gate_against_themselves():
    """Every committed result loads as gate measurements, each with its GPU, and the basics class
    judged against itself is the same everywhere it is judged. No count or GPU of the committed
    runs is asserted: a new GPU run or a prune changes those."""
    res = REPO_ROOT / "reports" / "results"
    ms = load_measurements(res)
    assert ms and all(m.gpu_key and m.samples for m in ms)
    basics = [m for m in ms if m.key.startswith("basics.")]
    rep = compare(basics, basics)
    judged = [v.verdict for v in rep.verdicts if v.verdict != "not gated"]
    assert judged and set(judged) == {"same"}
    bench = sorted((REPO_ROOT / "reports" / "benchmarks").glob("*.json"))
    if bench:
        pm = load_measurements(bench[0], assume_gpu=KEY)
        assert all(m.samples for m in pm)


def test_load_refuses_malformed_pytest(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"machine_info": {}, "benchmarks": [{"name": "x", "stats": {}}]}))
    with pytest.raises(ResultsFileError, match="malformed"):
        load_measurements(p)


# ----------------------------------------------------------------------------- kernel metrics
BASE = {"schema": "megabench.kernel_metrics", "version": 1, "arch": "sm_90a", "builds": [
    {"source": "a.cu", "defines": {}, "kernels": {"k": {"registers": 32, "spill_store_bytes": 0, "spill_load_bytes": 0,
                                                       "stack_frame_bytes": 0, "static_smem_bytes": 0, "barriers": 0,
                                                       "code_bytes": 1000}}}]}


def _cur(**changes):
    b = copy.deepcopy(BASE["builds"][0])
    b["kernels"]["k"].update(changes)
    return {"a.cu": b}


@pytest.mark.parametrize("changes, fails", [
    ({}, None),
    ({"registers": 30}, None),
    ({"registers": 33}, "registers"),
    ({"spill_store_bytes": 4}, "spills"),
    ({"static_smem_bytes": 16}, "smem"),
    ({"code_bytes": 1090}, None),
    ({"code_bytes": 1200}, "code bytes"),
    ({"stack_frame_bytes": 8}, None),
])
def test_compare_kernels(changes, fails):
    rows, failures = compare_kernels(BASE, _cur(**changes))
    if fails is None:
        assert not failures
    else:
        assert len(failures) == 1 and fails in failures[0]["verdict"]
    assert bool(rows) == bool(changes)


def test_compare_kernels_thresholds_and_new():
    rows, failures = compare_kernels(BASE, _cur(registers=40), KernelThresholds(max_reg_increase=8))
    assert not failures and rows[0]["verdict"] == "ok"
    cur = _cur()
    cur["b.cu"] = {"source": "b.cu", "defines": {}, "kernels": {"n": BASE["builds"][0]["kernels"]["k"]}}
    rows, failures = compare_kernels(BASE, cur)
    assert not failures and rows == [{"build": "b.cu", "kernel": "n", "change": "new kernel", "verdict": "info"}]


def test_kernel_gate_on_the_repository(tmp_path):
    """Against the committed baseline, restricted to one stable source (other sources change under
    other work; the CI step runs the gate over all of them)."""
    import io

    only = ["microbench/basics/copy.cu"]
    assert kernel_gate(out=io.StringIO(), only=only) == EXIT_OK
    doc = load_kernel_baseline()
    p = tmp_path / "km.json"
    # pretend the baseline was leaner: the current build now "grew"
    b = next(b for b in doc["builds"] if b["source"] == "microbench/basics/copy.cu")
    k = next(iter(b["kernels"]))
    b["kernels"][k]["registers"] -= 8
    p.write_text(json.dumps(doc))
    buf = io.StringIO()
    assert kernel_gate(path=p, out=buf, only=only) == EXIT_REGRESSION
    assert "FAIL: registers" in buf.getvalue() and k in buf.getvalue()
    with pytest.raises(ResultsFileError, match="no such .cu"):
        kernel_gate(path=p, out=io.StringIO(), only=["nope.cu"])
    doc["schema"] = "x"
    p.write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError, match="expected 'megabench.kernel_metrics'"):
        kernel_gate(path=p, out=io.StringIO(), only=only)


def test_kernel_gate_update_writes_a_valid_file(tmp_path, monkeypatch):
    import io

    from microbench import kernel_gate as km

    monkeypatch.setattr(km, "measure_kernels", lambda builds, arch: {
        "a.cu": {"source": "a.cu", "defines": {}, "kernels": BASE["builds"][0]["kernels"]}})
    p = tmp_path / "km.json"
    assert kernel_gate(update=True, path=p, out=io.StringIO()) == EXIT_OK
    assert load_kernel_baseline(p)["builds"][0]["kernels"]["k"]["registers"] == 32


def test_committed_kernel_baseline_is_valid():
    doc = load_kernel_baseline()
    assert doc["builds"]


def test_cli_gpu_gates_one_gpu_of_a_mixed_folder(tmp_path, capsys):
    """A results folder holding two GPUs' runs is refused as a candidate (mixing GPUs) unless --gpu
    names one; then only that GPU's runs are gated (a slowdown on it is still found), and a GPU the
    candidate lacks is an input error naming the GPUs it has."""
    _result(tmp_path / "mixed", seed=1)
    _result(tmp_path / "mixed", gpu="NVIDIA H100 80GB HBM3", seed=2)
    _result(tmp_path / "slow", median=1.2e-3, seed=4)
    _result(tmp_path / "slow", gpu="NVIDIA H100 80GB HBM3", seed=5)
    mixed = str(tmp_path / "mixed")
    assert main(["gate", mixed, mixed, "--aa-spread", "none"]) == EXIT_GPU
    assert "--gpu KEY" in capsys.readouterr().err
    assert main(["gate", mixed, mixed, "--aa-spread", "none", "--gpu", "NVIDIA H100 80GB HBM3"]) == EXIT_OK
    assert main(["gate", mixed, str(tmp_path / "slow"), "--aa-spread", "none", "--gpu", "NVIDIA H200"]) == EXIT_REGRESSION
    assert main(["gate", mixed, str(tmp_path / "slow"), "--aa-spread", "none", "--gpu",
                 "NVIDIA H100 80GB HBM3"]) == EXIT_OK
    capsys.readouterr()
    assert main(["gate", mixed, mixed, "--aa-spread", "none", "--gpu", "NVIDIA B200"]) == EXIT_INPUT
    assert "no measurements of it" in capsys.readouterr().err
