"""The in-run A/B gate on the CPU: the paired rule, the worker processes and their protocol, the
alternation of sides, every failure mode, and the pytest backend on a small stand-in tree."""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from reports.cli import main
from microbench.gate import EXIT_GPU, EXIT_INPUT, EXIT_OK, EXIT_REGRESSION, EXIT_UNKNOWN, Measurement, judge
from microbench.gate_ab import (ABConfig, ABGpuMismatch, ABInputError, Comparison, Entry, SideSpec, checkout,
                                paired_verdict, replicas_to_resolve, run_ab, run_rounds)
from microbench.results import REPO_ROOT
from microbench.stats import wilcoxon_signed_rank

H200 = {"name": "NVIDIA H200", "cc": [9, 0], "sm_count": 132, "sm_clock_max_mhz": 1980,
        "gpu_key": "NVIDIA H200@1980MHz"}
HEADLINE = ["megakernel/shard8/T16/ctx2048/mega", "megakernel/shard8/T16/ctx2048/chain",
            "megakernel/shard8/T1/ctx2048/mega", "megakernel/small/T16/ctx512/mega"]


# ----------------------------------------------------------------------------- the statistics
def _brute_signed_rank_p(d):
    """P(W+ >= observed) by enumerating every sign assignment (tiny n, no ties)."""
    a = np.abs(d)
    ranks = np.argsort(np.argsort(a)) + 1
    w = ranks[np.asarray(d) > 0].sum()
    n = len(d)
    hits = sum(sum(r for r, s in zip(ranks, signs) if s) >= w for signs in itertools.product([0, 1], repeat=n))
    return hits / 2 ** n


@pytest.mark.parametrize("seed", range(6))
def test_signed_rank_exact_matches_enumeration(seed):
    rng = np.random.default_rng(seed)
    d = rng.standard_normal(9) + 0.4 * seed / 5
    _, p = wilcoxon_signed_rank(d, "greater")
    assert p == pytest.approx(_brute_signed_rank_p(d), abs=1e-12)
    _, pl = wilcoxon_signed_rank(d, "less")
    assert pl == pytest.approx(_brute_signed_rank_p(-d), abs=1e-12)


def test_signed_rank_smallest_p_and_large_n():
    assert wilcoxon_signed_rank(np.arange(1, 9) * 0.01)[1] == pytest.approx(1 / 256)
    assert wilcoxon_signed_rank(np.arange(1, 8) * 0.01)[1] == pytest.approx(1 / 128)
    rng = np.random.default_rng(0)
    assert wilcoxon_signed_rank(rng.standard_normal(200) + 0.5)[1] < 1e-6  # normal approximation
    assert wilcoxon_signed_rank(rng.standard_normal(200))[1] > 0.01


def _pair(n=12, slow=0.0, noise=0.003, seed=0, drift=0.0):
    rng = np.random.default_rng(seed)
    common = 1e-3 * (1 + drift * np.sin(np.arange(n)))
    a = common * np.exp(noise * rng.standard_normal(n))
    b = common * (1 + slow) * np.exp(noise * rng.standard_normal(n))
    return a, b


def test_paired_rule():
    v = paired_verdict("k", *_pair(slow=0.05))
    assert v.verdict == "regression" and 0.04 < v.slowdown < 0.06 and v.ci[0] < v.slowdown < v.ci[1]
    assert v.p_slower < 0.01 and v.threshold == 0.03
    assert paired_verdict("k", *_pair(slow=0.0)).verdict == "same"
    v = paired_verdict("k", *_pair(slow=0.02))
    assert v.verdict == "same" and "within the floor" in v.reason
    assert paired_verdict("k", *_pair(slow=-0.06)).verdict == "improvement"
    a, b = _pair(slow=0.05)
    assert paired_verdict("k", 1 / a, 1 / b, unit="B/s").verdict == "regression"  # a rate that fell
    assert paired_verdict("k", 1 / b, 1 / a, unit="B/s").verdict == "improvement"
    v = paired_verdict("k", *_pair(n=7, slow=0.5))
    assert v.verdict == "unknown" and "7 rounds (need 8" in v.reason and v.slowdown == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ValueError, match="rounds pair them"):
        paired_verdict("k", [1.0] * 8, [1.0] * 9)


def test_pairing_sees_through_drift_that_blinds_an_unpaired_test():
    """A +5% candidate under a shared 20% drift: the paired ratios see it; the stored rule on the
    very same figures (IQR noise, Mann-Whitney) cannot."""
    a, b = _pair(n=16, slow=0.05, drift=0.2, seed=3)
    assert paired_verdict("k", a, b).verdict == "regression"

    def m(x):
        return Measurement("k", tuple(x), float(np.median(x)), None, "s", "lower", "g", "f", "")

    assert judge(m(a), m(b)).verdict == "same"


# ----------------------------------------------------------------------------- rounds and order
class _FakeWorker:
    def __init__(self, name, log, t=1e-3):
        self.name, self.log, self.t = name, log, t

    def request(self, obj, timeout):
        self.log.append((self.name, obj["round"], obj["slot"], obj["samples"]))
        return {"ok": True, "value": self.t, "values": [self.t] * obj["samples"]}


def test_rounds_alternate_and_share_samples():
    log = []
    ws = {"A": _FakeWorker("A", log, 4e-4), "B": _FakeWorker("B", log, 4e-4)}
    comps = [Comparison("c", "s", [Entry("A", "c"), Entry("B", "c")])]
    run_rounds(ws, comps, 4, ABConfig(round_target_s=2e-3), log=lambda s: None)
    timed = [x for x in log if x[1] >= 0]
    assert [(w, r) for w, r, _, _ in timed] == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2),
                                                 ("B", 3), ("A", 3)]
    assert {k for *_, k in timed} == {5}  # ceil(2 ms / 0.4 ms), the same on both sides
    assert [x[1] for x in log if x[1] < 0] == [-1, -1]  # one calibration request per side, discarded
    assert comps[0].values == [[4e-4] * 4, [4e-4] * 4]


# ----------------------------------------------------------------------------- synthetic workers
def _side(name, cases, device=H200, arch="sm_90a", root=REPO_ROOT, **spec):
    return SideSpec(name, root, name, "synthetic", {"device": device, "arch": arch, "cases": cases, **spec})


CASES = {"basics/copy": {"time": 4e-5, "noise": 0.02, "class": "basics"},
         "sync/pingpong": {"time": 2e-4, "noise": 0.01, "class": "sync"},
         "megakernel/small/T16/mega": {"time": 2e-3, "noise": 0.003, "class": "megakernel"}}


def _quiet(s):
    pass


def test_aa_is_same_despite_drift_and_order_penalty():
    spec = dict(drift={"amp": 0.15, "period": 5}, order_penalty=0.06)  # 6% for whoever times second
    rep = run_ab(_side("baseline", CASES, **spec), _side("candidate", CASES, **spec), rounds=12, log=_quiet)
    assert [v.verdict for v in rep.verdicts] == ["same"] * 3, rep.to_markdown()
    assert rep.exit_code() == EXIT_OK


def test_injected_slowdown_found_and_selection():
    slow = {k: dict(v) for k, v in CASES.items()}
    slow["megakernel/small/T16/mega"]["slowdown"] = 0.05
    rep = run_ab(_side("baseline", CASES), _side("candidate", slow), {"classes": ["megakernel", "sync"]}, rounds=10,
                 log=_quiet)
    got = {v.key: v.verdict for v in rep.verdicts}
    assert got == {"megakernel/small/T16/mega": "regression", "sync/pingpong": "same"}
    assert rep.exit_code() == EXIT_REGRESSION and "REGRESSION" in rep.to_markdown()
    rep = run_ab(_side("baseline", CASES), _side("candidate", slow), {"k": "copy"}, rounds=8, log=_quiet)
    assert [v.key for v in rep.verdicts] == ["basics/copy"]


@pytest.mark.parametrize("headline", HEADLINE)
def test_headline_slowdown_of_half_is_a_regression(headline):
    cases = {h: {"time": 5e-3, "noise": 0.003, "class": "megakernel"} for h in HEADLINE}
    slow = {h: dict(c, slowdown=0.5 if h == headline else 0.0) for h, c in cases.items()}
    rep = run_ab(_side("baseline", cases), _side("candidate", slow), rounds=8, log=_quiet)
    assert {v.key: v.verdict for v in rep.verdicts} == {h: "regression" if h == headline else "same" for h in HEADLINE}


def test_case_on_one_side_and_too_few_rounds_are_unknown():
    more = {**CASES, "basics/new_case": {"time": 1e-5, "class": "basics"}}
    rep = run_ab(_side("baseline", CASES), _side("candidate", more), rounds=8, log=_quiet)
    assert rep.only == {"baseline": [], "candidate": ["basics/new_case"]}
    assert rep.exit_code() == EXIT_UNKNOWN and rep.exit_code(allow_unknown=True) == EXIT_OK
    assert "only on candidate" in rep.to_markdown() and "basics/new_case" in rep.to_markdown()
    rep = run_ab(_side("baseline", CASES), _side("candidate", CASES), rounds=5, log=_quiet)
    assert {v.verdict for v in rep.verdicts} == {"unknown"} and "5 rounds (need 8" in rep.verdicts[0].reason
    assert rep.exit_code() == EXIT_UNKNOWN


def test_failed_case_is_named_and_fails_the_gate():
    broken = {**CASES, "sync/pingpong": {**CASES["sync/pingpong"], "fail": "CorrectnessError: payload 3 != 4"}}
    rep = run_ab(_side("baseline", CASES), _side("candidate", broken), rounds=8, log=_quiet)
    assert rep.failed["candidate"][0]["id"] == "sync/pingpong" and rep.exit_code() == EXIT_INPUT
    assert "FAILED on candidate" in rep.to_markdown() and "payload 3 != 4" in rep.to_markdown()
    assert "sync/pingpong" not in rep.one_sided  # a failure, not a missing case


def test_different_gpus_or_arches_are_refused():
    gb = {**H200, "name": "NVIDIA GB300", "cc": [10, 3]}
    with pytest.raises(ABGpuMismatch, match="different GPUs.*GB300"):
        run_ab(_side("baseline", CASES), _side("candidate", CASES, device=gb), rounds=8, log=_quiet)
    with pytest.raises(ABGpuMismatch, match="different GPUs.*no GPU"):
        run_ab(_side("baseline", CASES), _side("candidate", CASES, device=None), rounds=8, log=_quiet)
    with pytest.raises(ABGpuMismatch, match="architectures.*sm_90"):
        run_ab(_side("baseline", CASES, arch="sm_90"), _side("candidate", CASES), rounds=8, log=_quiet)


def test_tree_that_does_not_build(tmp_path):
    bad = tmp_path / "tree"
    (bad / "microbench").mkdir(parents=True)
    (bad / "microbench" / "__init__.py").write_text("def broken(:\n")
    with pytest.raises(ABInputError, match="baseline tree .* does not build: SyntaxError"):
        run_ab(_side("baseline", CASES, root=bad), _side("candidate", CASES), rounds=8, log=_quiet)
    with pytest.raises(ABInputError, match="does not build: RuntimeError: no module named cuda"):
        run_ab(_side("baseline", CASES), _side("candidate", CASES, fail_start="no module named cuda"), rounds=8,
               log=_quiet)


@pytest.mark.slow  # waits out a worker's timeout (~30 s); CI runs it
def test_worker_that_hangs_is_named():
    with pytest.raises(ABInputError, match="candidate worker .* gave no answer in 1 s"):
        run_ab(_side("baseline", CASES), _side("candidate", CASES, sleep_s=30), rounds=8,
               cfg=ABConfig(time_timeout_s=1.0), log=_quiet)


def test_cli_synthetic_and_bad_revision(tmp_path, capsys):
    slow = {k: dict(v) for k, v in CASES.items()}
    slow["basics/copy"]["slowdown"] = 0.5
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"baseline": {"device": H200, "arch": "sm_90a", "cases": CASES},
                                "candidate": {"device": H200, "arch": "sm_90a", "cases": slow}}))
    out = tmp_path / "out"
    md = tmp_path / "ab.md"
    assert main(["gate", "--ab-tree", str(REPO_ROOT), "--backend", f"synthetic:{spec}", "--rounds", "8",
                 "--out", str(out), "--markdown", str(md), "--json", str(tmp_path / "ab.json")]) == EXIT_REGRESSION
    assert "REGRESSION" in md.read_text()
    assert json.loads((tmp_path / "ab.json").read_text())["rounds"] == 8
    from microbench.results import load

    saved = sorted((out / "gate").glob("gate.ab-*.json"))
    r = load(saved[0])
    assert r.benchmark == "gate.ab" and r.derived["change/basics/copy"].value == pytest.approx(0.5, rel=0.1)
    assert all(s.metrics["gate_direction"] == "none" for s in r.series)
    capsys.readouterr()
    assert main(["gate", "--ab", "no-such-revision-xyz", "--backend", f"synthetic:{spec}"]) == EXIT_INPUT
    assert "does not exist" in capsys.readouterr().err
    assert main(["gate", "--ab-tree", str(REPO_ROOT), "--backend", "synthetic:" + str(tmp_path / "nope.json")]) \
        == EXIT_INPUT
    assert main(["gate", "--ab-tree", str(REPO_ROOT), "--backend", "bogus"]) == EXIT_INPUT
    gb = tmp_path / "gb.json"
    gb.write_text(json.dumps({"baseline": {"device": H200, "arch": "sm_90a", "cases": CASES},
                              "candidate": {"device": {**H200, "name": "NVIDIA B200"}, "arch": "sm_90a",
                                            "cases": CASES}}))
    assert main(["gate", "--ab-tree", str(REPO_ROOT), "--backend", f"synthetic:{gb}"]) == EXIT_GPU


def test_default_selection_leaves_out_what_two_processes_cannot_hold(tmp_path):
    cases = {"megakernel/shard8/T16/mega": {"class": "megakernel"},
             "megakernel/small/T16/mega": {"class": "megakernel"}, "baselines/small/T1/graph": {"class": "baselines"}, "basics/copy": {"class": "basics"}}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"baseline": {"device": H200, "arch": "sm_90a", "cases": cases},
                                "candidate": {"device": H200, "arch": "sm_90a", "cases": cases}}))
    js = tmp_path / "v.json"
    assert main(["gate", "--ab-tree", str(REPO_ROOT), "--backend", f"synthetic:{spec}", "--rounds", "8",
                 "--json", str(js)]) == EXIT_OK
    assert sorted(v["key"] for v in json.loads(js.read_text())["verdicts"]) == ["basics/copy",
                                                                                "megakernel/small/T16/mega"]
    assert main(["gate", "--ab-tree", str(REPO_ROOT), "--backend", f"synthetic:{spec}", "--rounds", "8",
                 "-k", "shard8 or graph", "--json", str(js)]) == EXIT_OK  # named, they run
    assert len(json.loads(js.read_text())["verdicts"]) == 2


def test_k_expressions_like_pytest():
    sys.path.insert(0, str(REPO_ROOT / "microbench"))
    try:
        from ab_worker import CaseError, k_match
    finally:
        sys.path.pop(0)
    assert k_match("not shard8", "megakernel/small") and not k_match("not shard8", "x/shard8/y")
    assert k_match("copy or (sync and PING)", "sync/pingpong") and not k_match("copy and sync", "sync/pingpong")
    with pytest.raises(CaseError, match="not an expression"):
        k_match("copy and", "copy")


def test_checkout_is_a_worktree_removed_afterwards(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    def run(*a):
        return subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True)

    run("init", "-q")
    (repo / "f.txt").write_text("one\n")
    run("add", "f.txt")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    first = run("rev-parse", "HEAD").stdout.strip()
    (repo / "f.txt").write_text("two\n")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "two")
    with checkout(first, repo) as (path, sha):
        assert sha == first and (path / "f.txt").read_text() == "one\n"
        assert str(path) in run("worktree", "list").stdout
    assert not path.exists() and str(path) not in run("worktree", "list").stdout
    with pytest.raises(ABInputError, match="does not exist"):
        with checkout("deadbeef", repo):
            pass


# ----------------------------------------------------------------------------- the pytest backend
CONFTEST = '''
import pytest


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


CALLS = [0]


@pytest.fixture
def device_bench(benchmark):
    """Like the project's: a timer the target advances by what it "measured" (here a nominal
    time with a small deterministic jitter: the CPU machine's wall clock is too busy to test with)."""
    def run(seconds, steps=None, after=None):
        clock = Clock()
        benchmark._timer = clock
        benchmark._megabench_after = after

        def one():
            CALLS[0] += 1
            jitter = 1 + 0.002 * ((CALLS[0] * 7919) % 11 - 5)
            clock.t += seconds * jitter * (steps or 1)
        benchmark.pedantic(one, rounds=5, iterations=1, warmup_rounds=1)
        benchmark.extra_info.update({"timer": "host (test)", "case": "x",
                                     **({"steps_per_round": steps} if steps else {})})
        assert benchmark.stats.stats.median > 0
    return run
'''

BENCH = '''
import pytest

SLOW = {slow}


@pytest.mark.parametrize("name", ["a", "b"])
def test_case(device_bench, name):
    device_bench(0.002 * (SLOW if name == "b" else 1.0))


def test_two_steps(device_bench):
    device_bench(0.001, steps=2)


def test_broken(device_bench):
    if {broken}:
        raise AssertionError("output mismatch at element 7")
    device_bench(0.001)


def test_skipped(device_bench):
    pytest.skip("needs a GPU")
{extra}
'''


def _tree(root: Path, slow=1.0, broken=False, extra=""):
    (root / "tests" / "bench").mkdir(parents=True)
    # like the project's: tests spread over worker processes by default; the A/B worker must not be
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-n 2 --strict-markers"\n')
    (root / "tests" / "bench" / "conftest.py").write_text(CONFTEST)
    (root / "tests" / "bench" / "test_bench_fake.py").write_text(BENCH.format(slow=slow, broken=broken, extra=extra))
    return root


def test_pytest_backend_times_the_trees_own_cases(tmp_path):
    base = _tree(tmp_path / "base")
    extra = "\n\ndef test_new(device_bench):\n    device_bench(0.001)\n"
    cand = _tree(tmp_path / "cand", slow=1.5, broken=True, extra=extra)
    rep = run_ab(SideSpec("baseline", base, "base"), SideSpec("candidate", cand, "cand"), {"classes": ["fake"]},
                 rounds=8, cfg=ABConfig(min_samples=2, max_samples=3), log=_quiet)
    got = {v.key.split("::")[1]: v for v in rep.verdicts}
    assert got["test_case[b]"].verdict == "regression", rep.to_markdown()
    assert got["test_case[b]"].slowdown == pytest.approx(0.5, abs=0.02)
    assert got["test_case[a]"].verdict == "same"
    # a case whose round is two steps is judged per step (its figure: one step's time)
    assert got["test_two_steps"].base_median == pytest.approx(0.001, rel=0.02)
    assert [f["id"].split("::")[1] for f in rep.failed["candidate"]] == ["test_broken"]
    assert "output mismatch at element 7" in rep.failed["candidate"][0]["error"]
    assert [s["id"].split("::")[1] for s in rep.skipped["baseline"]] == ["test_skipped"]
    assert [c.split("::")[1] for c in rep.only["candidate"]] == ["test_new"]
    assert rep.exit_code() == EXIT_INPUT
    assert rep.missing_classes == {"baseline": [], "candidate": []}


def test_a_wait_that_gives_up_during_the_rounds_stops_the_gate_naming_it(tmp_path):
    """device_bench hands the worker the case's check of its last launches (Prepared.after); the
    worker runs it after every timing request, so a spin that gave up mid-run is not timed on."""
    extra = ('\n\nN = [0]\n\n\ndef gave_up():\n    N[0] += 1\n    if N[0] > 3:\n'
             '        raise RuntimeError("block 3 gave up waiting for the pong flag")\n\n\n'
             'def test_spins(device_bench):\n    device_bench(0.001, after=gave_up)\n')
    base, cand = _tree(tmp_path / "base", extra=extra), _tree(tmp_path / "cand", extra=extra)
    with pytest.raises(ABInputError, match=r"time .*test_spins failed: RuntimeError: block 3 gave up waiting for the pong"):
        run_ab(SideSpec("baseline", base, "base"), SideSpec("candidate", cand, "cand"),
               {"classes": ["fake"], "k": "spins"}, rounds=8, cfg=ABConfig(min_samples=2, max_samples=2), log=_quiet)


def test_pytest_backend_variants_and_missing_class(tmp_path):
    base = _tree(tmp_path / "base")
    side = SideSpec("baseline", base, "base", variants=[{"name": "", "env": {}},
                                                        {"name": "v1", "env": {"MEGABENCH_X": "1"}}])
    rep = run_ab(side, SideSpec("candidate", _tree(tmp_path / "cand"), "cand"), {"classes": ["fake", "nothere"],
                                                                                  "k": "test_case"},
                 rounds=8, cfg=ABConfig(min_samples=2, max_samples=2), log=_quiet)
    assert any(c.endswith("test_case[a]@v1") for c in rep.only["baseline"])
    assert rep.missing_classes["candidate"] == ["nothere"]
    assert {v.key.split("::")[1] for v in rep.verdicts} == {"test_case[a]", "test_case[b]"}


def test_worker_is_a_script_of_the_standard_library():
    """The worker runs against other trees: nothing of the controller's package at its top."""
    src = (REPO_ROOT / "microbench" / "ab_worker.py").read_text()
    tops = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert tops and all(ln.split()[1].split(".")[0] in sys.stdlib_module_names | {"__future__"} for ln in tops), tops


# ----------------------------------------------------------------------------- workers a side
@pytest.mark.parametrize("q,df,table", [(0.995, 2, 9.925), (0.995, 4, 4.604), (0.975, 1, 12.706),
                                        (0.975, 3, 3.182), (0.99, 5, 3.365), (0.95, 30, 1.697)])
def test_student_t_matches_the_tables(q, df, table):
    from microbench.stats import student_t_quantile, student_t_sf

    assert student_t_quantile(q, df) == pytest.approx(table, abs=1e-3)
    assert student_t_sf(table, df) == pytest.approx(1 - q, rel=2e-3)
    assert student_t_sf(0.0, df) == pytest.approx(0.5) and student_t_sf(-table, df) == pytest.approx(q, rel=1e-3)


def _workers(offsets, n=10, slow=0.0, noise=0.002, seed=0):
    """Figures of workers with steady offsets (log), round noise and a common drift."""
    rng = np.random.default_rng(seed)
    drift = 1e-3 * (1 + 0.05 * np.sin(np.arange(n)))
    return [drift * (1 + slow) * np.exp(o + noise * rng.standard_normal(n)) for o in offsets]


def test_a_steady_process_offset_is_not_a_regression_with_workers_to_measure_it():
    from microbench.gate_ab import replicated_verdict

    # one worker a side: a 6% placement offset is all the rounds see, and they call it
    a, b = _workers([0.0], seed=1), _workers([0.06], seed=2)
    assert replicated_verdict("k", a, b).verdict == "regression"
    # three a side, whose own offsets spread as much: the same 6% is within what separates two
    # workers, so the gate can neither confirm it nor rule it out: unknown, with the workers it needs
    a, b = _workers([0.0, -0.05, 0.04], seed=1), _workers([0.10, 0.04, 0.06], seed=2)
    v = replicated_verdict("k", a, b)
    assert v.slowdown > 0.06 and v.verdict == "unknown" and v.replicas == 3 and v.p_process > 0.01
    need = replicas_to_resolve(v.process_sd, v.slowdown)
    assert need is not None and need > 3 and f"--replicas {need} would resolve" in v.reason
    assert "within what separates" in v.reason
    # the hint is the fewest workers whose resolution is below the slowdown
    from microbench.stats import student_t_quantile

    def res(r):
        return np.expm1(student_t_quantile(0.995, 2 * (r - 1)) * v.process_sd * np.sqrt(2 / r))

    assert res(need) < v.slowdown <= res(need - 1)
    assert replicas_to_resolve(0.5, 0.05) is None and replicas_to_resolve(0.01, -0.02) is None
    # faster by as much: not confirmed either, and it stays same (the gate is for regressions)
    assert replicated_verdict("k", b, a).verdict == "same"
    within = np.concatenate([np.array([0.0, -0.05, 0.04]) + 0.0033, np.array([0.10, 0.04, 0.06]) - 0.0667])
    assert v.process_sd == pytest.approx(np.sqrt((within ** 2).sum() / 4), rel=0.1)
    # workers that agree: a 5% slowdown is a regression, and the resolution is far below it
    a, b = _workers([0.0, 0.001, -0.001], seed=1), _workers([0.0005, -0.0005, 0.0], slow=0.05, seed=2)
    v = replicated_verdict("k", a, b)
    assert v.verdict == "regression" and v.p_process < 1e-3 and v.resolution < 0.01 and v.threshold == 0.03
    assert replicated_verdict("k", b, a).verdict == "improvement"
    with pytest.raises(ValueError, match="workers"):
        replicated_verdict("k", a, b[:2])
    with pytest.raises(ValueError, match="rounds"):
        replicated_verdict("k", a, [x[:8] for x in b])


def test_workers_interleave_and_alternate():
    log = []
    names = ["baseline", "candidate", "baseline#2", "candidate#2"]
    ws = {n: _FakeWorker(n, log, 1e-3) for n in names}
    comps = [Comparison("c", "s", [Entry(n, "c", n.split("#")[0], 1 + ("#" in n)) for n in names])]
    run_rounds(ws, comps, 2, ABConfig(round_target_s=2e-3), log=lambda s: None)
    timed = [(w, r) for w, r, _, _ in log if r >= 0]
    assert timed == [(n, 0) for n in names] + [(n, 1) for n in reversed(names)]
    assert comps[0].group_values("baseline") == [[1e-3] * 2, [1e-3] * 2]


def test_process_offsets_fool_one_worker_a_side_but_not_three():
    cases = {f"sync/case{i}": {"time": 2e-4, "noise": 0.003, "class": "sync"} for i in range(8)}
    spec = dict(process_sd=0.05, seed=3)
    one = run_ab(_side("baseline", cases, **spec), _side("candidate", cases, **spec), rounds=10,
                 cfg=ABConfig(replicas=1), log=_quiet)
    alarms = [v.key for v in one.verdicts if v.verdict in ("regression", "improvement")]
    assert len(alarms) >= 4, one.to_markdown()  # steady offsets of ~5% pass the 3% floor and every rank test
    assert "one worker a side" in one.to_markdown()
    three = run_ab(_side("baseline", cases, **spec), _side("candidate", cases, **spec), rounds=10, log=_quiet)
    got = [v.verdict for v in three.verdicts]
    assert set(got) <= {"same", "unknown"}, three.to_markdown()  # no false alarm
    slower = [v for v in three.verdicts if v.slowdown > 0.03 and v.p_slower < 0.01]
    assert slower and all(v.verdict == "unknown" and "--replicas" in v.reason for v in slower), three.to_markdown()
    assert three.exit_code() == EXIT_UNKNOWN and three.exit_code(allow_unknown=True) == EXIT_OK
    assert all(v.replicas == 3 for v in three.verdicts)
    assert 0.02 < np.median([v.process_sd for v in three.verdicts]) < 0.08  # the workers' 5% spread, measured
    assert three.sides["baseline"]["workers"] == ["baseline", "baseline#2", "baseline#3"]


def test_three_workers_still_catch_5pct_where_processes_agree():
    slow = {k: dict(v, slowdown=0.05) for k, v in CASES.items()}
    spec = dict(process_sd=0.002)
    rep = run_ab(_side("baseline", CASES, **spec), _side("candidate", slow, **spec), rounds=10, log=_quiet)
    assert [v.verdict for v in rep.verdicts] == ["regression"] * 3, rep.to_markdown()


def test_replicas_below_one_is_refused(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"baseline": {"cases": CASES}, "candidate": {"cases": CASES}}))
    code = main(["gate", "--ab-tree", str(REPO_ROOT), "--backend", f"synthetic:{spec}", "--replicas", "0"])
    assert code == EXIT_INPUT and "--replicas must be >= 1, got 0" in capsys.readouterr().err


def test_a_case_that_fails_on_one_worker_fails_its_side_and_is_named():
    bad = {k: dict(v) for k, v in CASES.items()}
    bad["sync/pingpong"]["fail_worker"] = "candidate#2"
    rep = run_ab(_side("baseline", CASES), _side("candidate", bad), rounds=8, log=_quiet)
    assert [f["id"] for f in rep.failed["candidate"]] == ["sync/pingpong"]
    assert rep.failed["candidate"][0]["error"].startswith("(worker candidate#2) fails on worker candidate#2")
    assert "sync/pingpong" not in {v.key for v in rep.verdicts} and rep.exit_code() == EXIT_INPUT


def test_the_tree_label_of_a_copy_is_the_commit_it_is_credited_to(monkeypatch, tmp_path):
    """On the GPU machine the checkout's .git may be an earlier commit's: with MEGABENCH_GIT_SHA
    the label is that commit, dirty only when the sources differ from MEGABENCH_SOURCE_TREE."""
    from microbench.gate_ab import tree_label
    from microbench.results import source_tree_id

    sha = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("MEGABENCH_GIT_SHA", sha)
    monkeypatch.setenv("MEGABENCH_SOURCE_TREE", source_tree_id())
    assert tree_label(REPO_ROOT) == sha[:12]
    monkeypatch.setenv("MEGABENCH_SOURCE_TREE", "f" * 40)
    assert tree_label(REPO_ROOT) == sha[:12] + "+dirty"
    assert tree_label(tmp_path) == f"{tmp_path} (no git)"  # another tree: its own git, here none
    monkeypatch.delenv("MEGABENCH_GIT_SHA")
    assert tree_label(REPO_ROOT) != sha[:12] and "no git" not in tree_label(REPO_ROOT)
