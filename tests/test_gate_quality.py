"""The gate's quality measurement on the CPU: the quality run through synthetic workers on two
"machines", its analysis into gate.quality and gate.aa_spread, honest intervals, verification of
each injection by its measured size, and the report's section."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from megabench_synth import env

from reports.cli import main
from microbench.errors import ResultsFileError
from microbench.gate import load_cross_run
from microbench.gate_quality import (METHOD, QUALITY_CASES, Tally, analyse, effective_n, find_runs, quality_run,
                                     report_lines, run_analysis, to_results, trust_rows, wilson)
from microbench.results import Result

CASES = (("tests/bench/test_bench_basics.py::test_copy[big]", True),
         ("tests/bench/test_bench_sync.py::test_sync[grid]", True),
         ("tests/bench/test_bench_icache.py::test_loop[x]", False),
         ("tests/bench/test_bench_megakernel.py::test_megakernel_step[small-16-512-mega]", True),
         ("tests/bench/test_bench_weights.py::test_unhooked_on_purpose", True))


def _spec(machine: int, cases=CASES):
    """A machine: its own seed, its own small per-case offsets; a case whose hook does nothing."""
    rng = np.random.default_rng(machine)
    out = {}
    for i, (cid, hooked) in enumerate(cases):
        out[cid] = {"time": 1e-4 * (i + 1) * (1 + 0.01 * rng.standard_normal()), "noise": 0.004,
                    "class": cid.split("test_bench_")[1].split(".")[0], "inject": "unhooked" not in cid}
    return {"device": {"name": "NVIDIA H200", "cc": [9, 0], "sm_count": 132, "sm_clock_max_mhz": 1980,
                       "gpu_key": "NVIDIA H200@1980MHz"}, "arch": "sm_90a", "seed": machine, "cases": out,
            "drift": {"amp": 0.03, "period": 7}, "order_penalty": 0.005, "inject_efficiency": 0.95}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    out = []
    for m in (1, 2):
        d = tmp_path_factory.mktemp(f"machine{m}")
        res, path = quality_run(d, rounds=30, backend="synthetic", spec=_spec(m), cases=CASES,
                                env=dataclasses.replace(env(date=f"2026-12-0{m}T10:00:00Z"), host=f"h{m}"),
                                log=lambda s: None)
        out.append(path)
    return out


def test_quality_run_records_every_side_and_variant(two_runs):
    runs = find_runs(two_runs)
    assert len(runs) == 2 and runs[0].env.host != runs[1].env.host
    f = runs[0].figures[CASES[0][0]]
    assert set(f) == {"A", "B", "p2", "p5", "p10"} and all(len(v) == 30 for v in f.values())
    assert set(runs[0].figures[CASES[2][0]]) == {"A", "B"}  # no hook: no injected variants
    assert runs[0].ppm_of == {"p2": 20000, "p5": 50000, "p10": 100000}
    assert two_runs[0].with_name(two_runs[0].name.split(".json")[0] + ".md").exists()


def test_analysis_of_two_runs(two_runs, tmp_path):
    an = analyse(find_runs(two_runs))
    t = {x.measure: x for x in an.tallies}
    # 2 runs x 5 cases x 3 blocks, each A/A trial both orientations at once (two-sided)
    assert t["false_alarm_rate_ab"].rate == 0.0 and t["false_alarm_rate_ab"].trials == 2 * 5 * 3
    assert t["detection_rate_ab_10pct"].rate == 1.0 and t["detection_rate_ab_5pct"].rate == 1.0
    assert t["detection_rate_ab_2pct"].rate == 0.0  # below the 3% floor by design
    # the case whose hook does nothing is verified by its measured size and left out, with the reason
    excl = t["detection_rate_ab_5pct"].excluded
    assert list(excl) == [f"run{r}:tests/bench/test_bench_weights.py::test_unhooked_on_purpose" for r in (1, 2)]
    assert "measured injection" in next(iter(excl.values()))
    got = an.injections[find_runs(two_runs)[0].label]["tests/bench/test_bench_basics.py::test_copy[big]"]
    assert got["p5"] == pytest.approx(0.0475, abs=0.004) and got["p10"] == pytest.approx(0.095, abs=0.004)
    # stored mode is measured beside it, across the two machines
    assert "false_alarm_rate_stored" in t and t["false_alarm_rate_stored"].trials > 0
    assert t["detection_rate_stored_10pct"].trials > 0
    # honest intervals: no false alarm in 30 trials of 10 clusters: n_eff between the clusters and the
    # trials (from the ICC of the trials' estimated slowdowns), and the clusters-only interval beside it
    lo, hi, n_eff, icc = t["false_alarm_rate_ab"].interval()
    assert 10 <= n_eff <= 30 and 0 <= icc <= 1 and lo == 0.0 and hi == pytest.approx(wilson(0, n_eff)[1])
    assert t["false_alarm_rate_ab"].conservative() == pytest.approx(wilson(0, 10))
    q, aa = to_results(an)
    assert q.benchmark == "gate.quality" and aa.benchmark == "gate.aa_spread"
    assert q.derived["detection_rate_ab_5pct"].note.endswith("met by the point estimate")
    assert q.derived["injected_5pct_measured"].value == pytest.approx(0.0475, abs=0.005)
    assert all(s.params.get("method") == METHOD for s in q.series if s.name in q.derived)
    assert len(aa.series) == len(CASES) and all(s.metrics["spread"] >= 0 for s in aa.series)


def test_runs_on_one_machine_say_so_and_save_no_cross_machine_spread(two_runs, tmp_path):
    """Two quality runs on one machine (one GPU UUID) measure no spread across machines: the stored
    rows say "one machine", and gate.aa_spread, which the stored gate reads, is not saved."""
    from microbench.results import find, load

    one = tmp_path / "one"
    for i, p in enumerate(two_runs):
        res = load(p)
        env1 = dataclasses.replace(res.env, gpu_uuid="GPU-same", host="vm", date=f"2026-12-02T0{i}:00:00Z")
        dataclasses.replace(res, env=env1).save(one)
    q, aa, text = run_analysis([one], save=True, save_root=tmp_path / "saved")
    assert "not fresh machines" in text and "gate.aa_spread not saved" in text
    assert not list(find("gate.aa_spread", tmp_path / "saved")) and list(find("gate.quality", tmp_path / "saved"))
    t = {x.measure: x for x in analyse(find_runs([one])).tallies}
    assert "one machine" in t["false_alarm_rate_stored"].what
    assert "share a GPU" in q.notes[-1]
    # the report and the trust line say one machine, not across machines
    lines = "\n".join(report_lines(tmp_path / "saved"))
    assert "two runs on one machine" in lines and "across machines" not in lines and "not fresh machines" in lines
    from microbench.gate_quality import trust_line

    assert "stored (two runs on one machine)" in trust_line(tmp_path / "saved")
    # on two machines the same runs save both
    _, _, text2 = run_analysis(two_runs, save=True, save_root=tmp_path / "two")
    assert list(find("gate.aa_spread", tmp_path / "two")) and "not fresh" not in text2


def test_four_runs_on_two_machines_pair_across_machines(two_runs, tmp_path_factory, tmp_path):
    """Two runs on each of two machines: the stored rows across machines and gate.aa_spread come
    from the four pairs of runs on different machines only; the two pairs on one machine are
    tallied apart and labelled so (the quality runs of 2026-12-02 06:35-06:46Z were made so)."""
    from microbench.gate_quality import ONE_MACHINE, aa_spreads, run_pairs
    from microbench.results import find, load

    more = []
    for m, host in ((3, "h1"), (4, "h2")):  # a second run on each fixture machine (hosts h1, h2)
        d = tmp_path_factory.mktemp(f"again{m}")
        more.append(quality_run(d, rounds=30, backend="synthetic", spec=_spec(m), cases=CASES,
                                env=dataclasses.replace(env(date=f"2026-12-0{m}T10:00:00Z"), host=host),
                                log=lambda s: None)[1])
    runs = find_runs([*two_runs, *more])
    apart, same = run_pairs(runs)
    assert len(apart) == 4 and len(same) == 2
    assert all(runs[i].env.host != runs[j].env.host for i, j in apart)
    an = analyse(runs)
    t = {x.measure: x for x in an.tallies}
    per_pair = t["false_alarm_rate_stored"].trials // 4
    assert per_pair > 0 and t[f"false_alarm_rate_stored{ONE_MACHINE}"].trials == 2 * per_pair
    assert "two machines" in t["false_alarm_rate_stored"].what and "one machine" in t[f"false_alarm_rate_stored{ONE_MACHINE}"].what
    assert t[f"detection_rate_stored_10pct{ONE_MACHINE}"].trials > 0 and t["detection_rate_stored_10pct"].trials > 0
    assert an.spreads == aa_spreads(runs, apart) and an.spreads != aa_spreads(runs)
    q, aa, text = run_analysis([*two_runs, *more], save=True, save_root=tmp_path)
    assert "4 runs on 2 machines" in text and "WARNING" not in text
    assert list(find("gate.aa_spread", tmp_path))
    lines = "\n".join(report_lines(tmp_path))
    assert "4 quality runs of one build on 2 machines" in lines
    assert "false alarms (A/A across machines)" in lines and "false alarms (A/A, two runs on one machine)" in lines
    assert "detection of an injected 5%, baseline from the other run on the same machine" in lines


def test_the_process_tests_calibration_under_a_over_a(two_runs, tmp_path):
    """One p-value of the in-run rule's process test per (run, case) under A/A, tested against
    uniform: the figure that backs the 1% cap, which the trials alone cannot resolve."""
    from microbench.gate_quality import ks_uniform, process_calibration

    assert ks_uniform(np.linspace(0.005, 0.995, 100))[1] > 0.9
    assert ks_uniform(np.linspace(0.0, 0.3, 60))[1] < 1e-6  # a test that calls A/A too often
    d, p = ks_uniform([0.5])
    assert d == pytest.approx(0.5) and 0 <= p <= 1
    runs = find_runs(two_runs)
    cal = process_calibration(runs)
    assert len(cal) == 2 * len(CASES) and all(0.0 <= v <= 1.0 for v in cal.values())
    # one worker a side has no process test
    assert process_calibration([dataclasses.replace(runs[0], replicas=1)]) == {}
    q, _ = to_results(analyse(runs))
    assert {"process_test_below_5pct", "process_test_below_50pct"} <= set(q.derived)
    assert q.derived["process_test_below_50pct"].value == pytest.approx(sum(v < 0.5 for v in cal.values()) / len(cal))
    q.save(tmp_path)
    assert "process test under A/A" in "\n".join(report_lines(tmp_path))


def test_the_pipeline_analyses_the_newest_build_with_two_runs(two_runs):
    """`megabench run` pools one build's quality runs: an earlier build's runs may have timed other
    cases under the same names, and one newer run alone is not a measurement."""
    from microbench.gate_quality import newest_build

    runs = find_runs(two_runs)
    old = [dataclasses.replace(r, env=dataclasses.replace(r.env, git_sha="old", date="2026-11-0" + r.env.date[9:]))
           for r in runs]
    lone = dataclasses.replace(runs[0], env=dataclasses.replace(runs[0].env, git_sha="newest", date="2026-12-09T00"))
    got = newest_build(old + runs + [lone])
    assert [r.env.git_sha for r in got] == [runs[0].env.git_sha] * 2 and got == sorted(runs, key=lambda r: r.env.date)
    assert newest_build(old[:1] + [lone]) == []


def test_saved_spreads_feed_the_stored_gate_and_the_report(two_runs, tmp_path, capsys):
    q, aa, text = run_analysis(two_runs, save=True, save_root=tmp_path)
    assert "false alarms" not in text or "in-run A/B" in text
    cr = load_cross_run(tmp_path, None)
    assert cr is not None and set(cr.per_key) == {c for c, _ in CASES}
    lines = "\n".join(report_lines(tmp_path))
    assert "How much to trust the gate" in lines and "false alarms (A/A)" in lines and "n_eff" in lines
    from microbench.gate_quality import trust_line

    line = trust_line(tmp_path)
    assert line.startswith("Gate: in-run A/B false alarms 0.0%") and "detects 5% 100%" in line and len(line) < 300
    assert trust_line(tmp_path / "none").startswith("Gate: its false-alarm and detection rates are not measured")
    rows = trust_rows(tmp_path)
    assert [r["mode"].split()[0] for r in rows] == ["in-run", "stored"] and rows[0]["detects 10%"].startswith("100%")
    empty = tmp_path / "none"
    empty.mkdir()
    assert "Not measured yet" in "\n".join(report_lines(empty)) and trust_rows(empty) == []


def test_quality_cases_exist_and_their_sources_carry_the_hook():
    """Every case the GPU run asks for is a test the tree collects (a typo would only show on the
    H200, as a case missing on both sides), and the precompiled sources carry the hook."""
    import subprocess
    import sys

    from microbench.gate_quality import HOOKED_SOURCES
    from microbench.results import REPO_ROOT

    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                        "no:cacheprovider", "tests/bench"], capture_output=True, text=True, cwd=REPO_ROOT)
    ids = {ln.strip() for ln in r.stdout.splitlines()}
    assert not [c for c, _ in QUALITY_CASES if c not in ids], r.stdout[-2000:]
    for s in HOOKED_SOURCES:
        assert "MB_INJECT_SCOPE();" in (REPO_ROOT / s).read_text(), s


def test_quality_run_needs_a_gpu(tmp_path):
    from microbench.device import no_gpu_reason
    from microbench.errors import NoGPUError

    if no_gpu_reason() is None:
        pytest.skip("a GPU is here: the quality run would run (minutes)")

    with pytest.raises(NoGPUError, match="quality run times kernels on a GPU"):
        quality_run(tmp_path / "q", backend="pytest")
    assert not (tmp_path / "q").exists()


def test_one_run_is_not_enough(two_runs):
    with pytest.raises(ResultsFileError, match="need two"):
        run_analysis(two_runs[:1])


def test_effective_n_and_wilson():
    assert effective_n([[False] * 10] * 5) == (5.0, 1.0)  # nothing varies: the clusters count
    same = [[False] * 10] * 5
    assert effective_n(same, [list(np.arange(10) * 0.01)] * 5)[0] == pytest.approx(50)  # slowdowns vary within only
    assert effective_n(same, [[0.01 * i] * 10 for i in range(5)])[0] == pytest.approx(5)  # between clusters only
    n_eff, icc = effective_n([[True, False] * 5] * 6)  # events spread evenly: every trial counts
    assert icc == 0.0 and n_eff == pytest.approx(60)
    n_eff, icc = effective_n([[True] * 10] + [[False] * 10] * 5)  # all events in one cluster
    assert icc > 0.9 and n_eff < 7
    lo, hi = wilson(0, 100)
    assert lo == 0 and 0.02 < hi < 0.05
    lo, hi = wilson(95, 100)
    assert lo < 0.95 < hi
    t = Tally("m", "x", "y", 0.0)
    t.add("a", True)
    t.add("a", False)
    assert t.rate == 0.5 and t.trials == 2 and t.flagged == 1


def test_cli_quality_run_and_analysis(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    dirs = []
    for m in (1, 2):
        spec.write_text(json.dumps({"baseline": _spec(m, QUALITY_CASES), "candidate": _spec(m, QUALITY_CASES)}))
        d = tmp_path / f"m{m}"
        assert main(["gate", "--quality-run", "--backend", f"synthetic:{spec}", "--out", str(d), "--rounds",
                     "10"]) == 0
        dirs.append(d)
    capsys.readouterr()
    assert main(["gate", "--quality", str(dirs[0]), str(dirs[1]), "--save", "--results", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "in-run A/B" in out and "saved" in out
    assert main(["gate", "--quality-run", "--backend", f"synthetic:{spec}"]) == 2  # no --out


def test_estimates_of_the_replaced_method_are_not_shown_as_measurements(tmp_path):
    """gate.quality files of the split-halves estimate (2026-11-29) stay committed but are not
    this method's measurement: the report says it is not measured yet."""
    from megabench_synth import series

    old = series("aa_random_halves", 0.0, n=40, unit="fraction", timer="derived",
                 params={"mode": "aa_random_halves", "slowdown": 0.0}, metrics={"flagged": 0, "trials": 8000})
    Result("gate.quality", env(), (old,)).save(tmp_path)
    assert "Not measured yet" in "\n".join(report_lines(tmp_path)) and trust_rows(tmp_path) == []


def test_precompile_spawns_its_workers(monkeypatch):
    # The parent has initialised CUDA before it precompiles (its GPU check); a forked child's driver
    # calls then fail.
    seen = {}

    class Pool:
        def __init__(self, jobs, mp_context=None):
            seen["method"] = mp_context.get_start_method() if mp_context is not None else None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, tasks):
            return [f"{t[0]}" for t in tasks]

    from microbench import gate_quality

    monkeypatch.setattr(gate_quality, "ProcessPoolExecutor", Pool)
    gate_quality.precompile(log=lambda s: None)
    assert seen["method"] == "spawn"


def test_aa_offsets_name_each_case_per_run_and_the_analysis_shows_them(two_runs):
    from microbench.gate_quality import aa_offsets, run_analysis

    runs = find_runs(two_runs)
    offs = aa_offsets(runs)
    assert set(offs) == {c for c, _ in CASES} and all(len(v) == 2 for v in offs.values())
    assert all(abs(x) < 0.02 for v in offs.values() for x in v)  # the synthetic machines' sides barely differ
    # a steady offset of one process shows as itself
    f = runs[0].figures[CASES[0][0]]
    shifted = dataclasses.replace(runs[0], figures={**runs[0].figures, CASES[0][0]: {**f, "B": f["A"] * 1.07}})
    assert aa_offsets([shifted])[CASES[0][0]] == [pytest.approx(0.07)]
    q, _, text = run_analysis(two_runs)
    assert "A/A offsets" in text and "share a GPU" not in text
    assert any(n.startswith("A/A offsets between two worker processes") for n in q.notes)


def test_both_sides_hold_the_same_builds_in_every_worker(two_runs):
    """The quality run measures the gate as `gate --ab` runs it: the default workers a side, and
    sides that differ by nothing but their processes (2026-12-01: B alone held the injected builds
    and its empty launch ran a steady 3-4% slower, which the A/A trials counted)."""
    from microbench.gate_ab import ABConfig
    from microbench.gate_quality import quality_sides
    from microbench.results import REPO_ROOT, load

    a, b = quality_sides(REPO_ROOT, CASES)
    assert a.variants == b.variants and len(a.variants) == 4
    run = find_runs(two_runs)[0]
    r = ABConfig().replicas
    assert run.replicas == r and run.symmetric
    case = CASES[0][0]
    assert [len(run.workers(case, k)) for k in ("A", "B", "p5")] == [r, r, r]
    assert not np.array_equal(run.workers(case, "A")[0], run.workers(case, "A")[1])  # distinct processes
    res = load(two_runs[0])
    workers = {s.params["worker"] for s in res.series if s.params["case"] == case}
    assert workers == {"A", "A#2", "A#3", "B", "B#2", "B#3"}


def test_runs_of_one_worker_a_side_are_tallied_apart(two_runs):
    """The committed 2026-12-01 runs (one worker a side, B alone holding the injections) keep their
    own measures, suffixed, beside those of runs made the current way."""
    from microbench.results import REPO_ROOT

    old = [p for p in (REPO_ROOT / "reports" / "results" / "gate").glob("gate.quality_run-20261201T2*.json.gz")]
    assert old, "the committed single-worker quality runs"
    runs = find_runs([*old, *two_runs])
    assert sorted(r.replicas for r in runs)[0] == 1
    t = {x.measure: x for x in analyse(runs).tallies}
    assert "false_alarm_rate_ab_1w" in t and "false_alarm_rate_ab" in t
    assert t["false_alarm_rate_ab_1w"].rate > 0.05  # what the single-worker runs measured on the H200
    assert t["false_alarm_rate_ab"].trials == 2 * 5 * 3


def test_a_slowdown_the_workers_cannot_confirm_is_tallied_unknown_not_missed(tmp_path):
    """A case whose worker processes differ by a steady 5% (the fence probe on the H200): where
    the rounds see the injected slowdown but the process test cannot confirm it, the verdict is
    unknown, counted in its own tally and never also as caught; quiet cases have no unknowns."""
    noisy = "tests/bench/test_bench_sync.py::test_sync[grid]"
    spec = _spec(3)
    spec["cases"][noisy]["process_sd"] = 0.05
    _, path = quality_run(tmp_path, rounds=20, backend="synthetic", spec=spec, cases=CASES,
                          env=dataclasses.replace(env(date="2026-12-03T10:00:00Z"), host="h3"), log=lambda s: None)
    an = analyse(find_runs([path]))
    t = {x.measure: x for x in an.tallies}
    for pct in ("5pct", "10pct"):
        caught, unknown = t[f"detection_rate_ab_{pct}"], t[f"unknown_rate_ab_{pct}"]
        for cl, flags in unknown.clusters.items():
            assert not any(u and c for u, c in zip(flags, caught.clusters[cl])), (pct, cl)
            if noisy not in cl:
                assert not any(flags), (pct, cl)
    assert sum(t["unknown_rate_ab_10pct"].clusters[f"run1:{noisy}"]) > 0
    assert "unknown_rate_ab" in t and t["unknown_rate_ab"].trials == t["false_alarm_rate_ab"].trials
    q, _ = to_results(an)
    assert "flagged 'unknown'" in q.derived["unknown_rate_ab_10pct"].rule
    assert "flagged 'regression'" in q.derived["detection_rate_ab_10pct"].rule
