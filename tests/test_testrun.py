"""`python -m microbench.testrun` / `megabench test-run`: the README's test command run in a child,
counted by pytest's own reports (the module's plugin hooks), saved as a typed tests.run result.
Each case runs a tiny sample test folder under tmp_path (about a second each)."""
from __future__ import annotations

import json
import textwrap

import pytest

from microbench import testrun
from microbench.errors import OutputError, ResultsFileError
from microbench.results import find, load
from microbench.testrun import COUNTS, count, run_tests
from reports.cli import main

SAMPLE = '''
import os, time
import pytest

def test_pass():
    pass

def test_pass_too():
    assert 1 + 1 == 2

def test_fail():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skip():
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert 0

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_setup_error(broken):
    pass
'''


def _sample(d, body=SAMPLE, name="test_sample.py"):
    d.mkdir(exist_ok=True)
    (d / name).write_text(textwrap.dedent(body))
    return d


def _run(tmp_path, monkeypatch, body=SAMPLE, extra=(), **kw):
    monkeypatch.chdir(tmp_path)  # the sample's own rootdir: not this repository's pytest options
    res = tmp_path / "res"
    res.mkdir(exist_ok=True)
    rc, r, path = run_tests([str(_sample(tmp_path / "sample", body)), "-p", "no:cacheprovider", *extra],
                            res, log=lambda *_: None, **kw)
    return rc, r, path, res


def test_counts_come_from_pytest_and_a_failure_is_a_nonzero_exit(tmp_path, monkeypatch):
    rc, r, path, res = _run(tmp_path, monkeypatch)
    assert rc == 1
    assert path.parent == res / "tests" and path.name.startswith("tests.run-")
    saved = load(path)  # the typed result, as written
    m = saved.series[0].metrics
    assert {k: m[k] for k in COUNTS} == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1, "xfailed": 1,
                                         "xpassed": 0, "deselected": 0}
    assert m["exit_code"] == 1 and m["finished"] and m["gate_direction"] == "none"
    assert saved.derived["failed"].value == 1 and saved.derived["passed"].value == 2
    s = saved.series[0]
    assert s.unit == "s" and s.timer == "host" and 0 < s.samples[0] < 120
    for k in ("python", "gxx", "libc", "os", "cpus", "command"):
        assert k in s.params
    assert s.params["command"].startswith("python -m pytest -q")
    assert saved.env.git_sha and saved.env.date  # the commit and date, as every result records them
    assert any("test_sample.py::test_fail" in n and "test_setup_error (setup)" in n for n in saved.notes)
    # each failure's first line comes back with it (a GPU session returns no traceback)
    why = {k.split("/")[-1]: v for k, v in m["failed_why"]}
    assert why["test_sample.py::test_fail"].startswith("assert 1 == 2")
    assert why["test_sample.py::test_setup_error (setup)"] == "RuntimeError: fixture broke"
    assert find("tests.run", res) == [path]


def test_all_passing_is_exit_zero_with_no_failures(tmp_path, monkeypatch):
    rc, r, _, _ = _run(tmp_path, monkeypatch, "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
                       extra=("-k", "test_a"))
    m = r.series[0].metrics
    assert rc == 0 and m["passed"] == 1 and m["failed"] == 0 and m["errors"] == 0 and m["deselected"] == 1


def test_an_interpreter_abort_is_recorded_with_the_test_that_was_running(tmp_path, monkeypatch):
    body = "import os\n\ndef test_first():\n    pass\n\ndef test_abort():\n    os.abort()\n\ndef test_never():\n    pass\n"
    rc, r, path, _ = _run(tmp_path, monkeypatch, body)
    m = r.series[0].metrics
    assert rc == 128 + 6 and m["passed"] == 1 and not m["finished"]  # SIGABRT, as the fortified longjmp did
    assert any(n.endswith("test_sample.py::test_abort") and "running when it ended" in n for n in r.notes)
    assert path.is_file()


def test_time_limit_stops_pytest_and_still_saves(tmp_path, monkeypatch):
    body = "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n"
    rc, r, path, _ = _run(tmp_path, monkeypatch, body, time_limit_s=4)
    m = r.series[0].metrics
    assert rc == 124 and m["stopped_at_time_limit"] and m["passed"] == 1 and r.series[0].samples[0] < 30
    assert any("test_slow" in n for n in r.notes) and path.is_file()


def test_xdist_workers_are_counted_once(tmp_path, monkeypatch):
    pytest.importorskip("xdist")
    body = "".join(f"def test_{i}():\n    pass\n\n" for i in range(6)) + "def test_bad():\n    assert 0\n"
    rc, r, _, _ = _run(tmp_path, monkeypatch, body, extra=("-n", "2"))
    m = r.series[0].metrics
    assert rc == 1 and m["passed"] == 6 and m["failed"] == 1
    assert m["failed_why"] == [["sample/test_sample.py::test_bad", "assert 0"]]  # the worker's message, through xdist


def test_cli_refuses_a_missing_results_folder_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    _sample(tmp_path / "sample", f"def test_a():\n    open({str(marker)!r}, 'w').close()\n")
    rc = main(["test-run", "--results", str(tmp_path / "typo"), "--", str(tmp_path / "sample")])
    assert rc == 2 and f"results folder {tmp_path / 'typo'} does not exist" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "typo").exists()


def test_count_categories():
    lines = [json.dumps(x) for x in [
        {"event": "collect_error", "nodeid": "t/test_x.py"},
        {"event": "deselected", "n": 3},
        {"event": "start", "nodeid": "a"},
        {"event": "report", "nodeid": "a", "when": "setup", "outcome": "passed", "xfail": False},
        {"event": "report", "nodeid": "a", "when": "call", "outcome": "passed", "xfail": True},  # xpass
        {"event": "report", "nodeid": "a", "when": "teardown", "outcome": "failed", "xfail": False},
        {"event": "start", "nodeid": "b"},
        {"event": "report", "nodeid": "b", "when": "setup", "outcome": "skipped", "xfail": True},  # xfail(run=False)
        {"event": "report", "nodeid": "b", "when": "teardown", "outcome": "passed", "xfail": False},
    ]] + ['{"event": "rep']  # a line cut off by a crash
    c = count(lines)
    assert {k: c[k] for k in COUNTS} == {"passed": 0, "failed": 0, "skipped": 0, "errors": 2, "xfailed": 1,
                                         "xpassed": 1, "deselected": 3}
    assert c["failed_tests"] == ["t/test_x.py", "a (teardown)"] and not c["finished"]
    assert c["running_when_stopped"] is None  # b's teardown was reported


def test_the_slowest_tests_and_the_gpu_tests_time_are_recorded(tmp_path, monkeypatch):
    """Where a run's time goes, so that a run stopped at its limit says what to speed up: the
    slowest tests by setup + call + teardown, and the seconds of the tests marked gpu (which one
    worker runs one after another)."""
    body = ("import time, pytest\n\ndef test_quick():\n    pass\n\n@pytest.mark.gpu\ndef test_slow_gpu():\n"
            "    time.sleep(0.6)\n\ndef test_slow_cpu():\n    time.sleep(0.3)\n")
    (tmp_path / "sample").mkdir()
    (tmp_path / "sample" / "conftest.py").write_text(
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'gpu: a GPU test')\n")
    rc, r, _, _ = _run(tmp_path, monkeypatch, body)
    m = r.series[0].metrics
    names = [n.split("::")[-1] for n, _ in m["slowest"]]
    assert rc == 0 and names[:2] == ["test_slow_gpu", "test_slow_cpu"]
    assert 0.6 <= m["gpu_test_seconds"] < 5 and m["test_seconds"] >= 0.9
    assert any(n.startswith("GPU tests") and "test_slow_gpu" in n for n in r.notes)


# ------------------------------------------------------------------------- a run in parts
# each test appends its name to a file as it starts: which part ran it shows there
PARTS_SAMPLE = '''
import os, time

RAN = os.environ["SAMPLE_RAN"]

def _ran(name):
    with open(RAN, "a") as f:
        f.write(name + "\\n")

def test_a():
    _ran("a")

def test_b():
    _ran("b")
    assert 0, "b is broken"

def test_slow():
    _ran("slow")
    if not os.path.exists(os.environ["SAMPLE_FAST"]):
        time.sleep(60)

def test_z():
    _ran("z")
'''


def _parts_setup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ran, fast = tmp_path / "ran.txt", tmp_path / "fast"
    monkeypatch.setenv("SAMPLE_RAN", str(ran))
    monkeypatch.setenv("SAMPLE_FAST", str(fast))
    res = tmp_path / "res"
    res.mkdir()
    args = [str(_sample(tmp_path / "sample", PARTS_SAMPLE)), "-p", "no:cacheprovider"]
    return args, res, ran, fast


def test_a_stopped_run_is_finished_by_a_resumed_part_counting_each_test_once(tmp_path, monkeypatch):
    """Part 1 stops at its limit inside test_slow; part 2 (--resume) runs test_slow and test_z
    only, and its result counts all four tests once: a, b (failed, in part 1), slow, z."""
    args, res, ran, fast = _parts_setup(tmp_path, monkeypatch)
    log = tmp_path / "reports.jsonl"
    rc1, r1, _ = run_tests(args, res, time_limit_s=5, log=lambda *_: None, keep_log=log)
    m1 = r1.series[0].metrics
    assert rc1 == 124 and m1["passed"] == 1 and m1["failed"] == 1 and m1["parts"] == 1
    assert ran.read_text().split() == ["a", "b", "slow"]
    fast.touch()
    rc2, r2, path = run_tests(args, res, log=lambda *_: None, resume=log)
    m2 = r2.series[0].metrics
    assert ran.read_text().split() == ["a", "b", "slow", "slow", "z"]  # a and b were not run again
    assert {k: m2[k] for k in COUNTS} == {"passed": 3, "failed": 1, "skipped": 0, "errors": 0, "xfailed": 0,
                                          "xpassed": 0, "deselected": 0}
    assert rc2 == 1 and m2["finished"] and m2["parts"] == 2  # part 1's failure fails the whole command
    assert m2["failed_why"] == [["sample/test_sample.py::test_b", "AssertionError: b is broken"]]
    assert abs(r2.series[0].samples[0] - sum(m2["part_seconds"])) < 0.2 and m2["part_seconds"][0] >= 5
    assert any("run in 2 parts" in n for n in r2.notes) and path.is_file()
    # the log now holds a finished run: nothing is left to resume
    with pytest.raises(ResultsFileError, match="that run finished"):
        run_tests(args, res, log=lambda *_: None, resume=log)


def test_a_resumed_part_of_another_command_commit_or_gpu_is_refused(tmp_path, monkeypatch):
    args, res, ran, fast = _parts_setup(tmp_path, monkeypatch)
    log = tmp_path / "reports.jsonl"
    run_tests(args, res, time_limit_s=5, log=lambda *_: None, keep_log=log)
    before = ran.read_text()
    with pytest.raises(ResultsFileError, match="pytest arguments"):
        run_tests([*args, "-k", "test_z"], res, log=lambda *_: None, resume=log)
    head, *rest = log.read_text().splitlines(keepends=True)
    for key, value, what in (("git_sha", "0" * 40, "commit"), ("gpu", "NVIDIA H200", "GPU")):
        forged = tmp_path / f"forged-{key}.jsonl"
        forged.write_text(json.dumps({**json.loads(head), key: value}) + "\n" + "".join(rest))
        with pytest.raises(ResultsFileError, match=what):
            run_tests(args, res, log=lambda *_: None, resume=forged)
    assert ran.read_text() == before  # refused before running anything
    with pytest.raises(OutputError, match="already exists"):
        run_tests(args, res, log=lambda *_: None, keep_log=log)  # a log is never overwritten
    with pytest.raises(OutputError, match="no such file"):
        run_tests(args, res, log=lambda *_: None, resume=tmp_path / "typo.jsonl")
    (tmp_path / "plain.jsonl").write_text('{"event": "start", "nodeid": "x"}\n')
    with pytest.raises(ResultsFileError, match="not a test-run log"):
        run_tests(args, res, log=lambda *_: None, resume=tmp_path / "plain.jsonl")


def test_parts_count_a_test_in_the_part_that_finished_it():
    """A test stopped mid-way in part 1 (its call reported, no teardown) and run again in part 2
    counts once; part 1's finished tests count from part 1."""
    rep = lambda n, when, out="passed": json.dumps({"event": "report", "nodeid": n, "when": when, "outcome": out,
                                                    "xfail": False, "duration": 0.1})
    part = lambda: json.dumps({"event": "part", "args": [], "git_sha": "x", "git_dirty": False, "gpu": None})
    p1 = [part(), rep("a", "setup"), rep("a", "call"), rep("a", "teardown"), rep("s", "setup"), rep("s", "call")]
    p2 = [part(), rep("s", "setup"), rep("s", "call"), rep("s", "teardown")]
    log_parts = testrun.parts([*p1, *p2])
    kept, done = testrun.earlier_reports(log_parts[:1])
    assert done == {"a"} and len(kept) == 3
    c = count([*kept, *log_parts[1][1]])
    assert c["passed"] == 2
    assert testrun.base_id("t.py::test_x[a]@gpu") == "t.py::test_x[a]"
    assert testrun.base_id("t.py::test_x[a@b]") == "t.py::test_x[a@b]"


def test_a_resumed_part_under_xdist_runs_only_what_is_left(tmp_path, monkeypatch):
    """Under xdist (the README's command on a many-core machine) the workers collect: each leaves
    out the tests an earlier part finished."""
    pytest.importorskip("xdist")
    args, res, ran, fast = _parts_setup(tmp_path, monkeypatch)
    args = [*args, "-n", "2"]
    log = tmp_path / "reports.jsonl"
    rc1, r1, _ = run_tests(args, res, time_limit_s=8, log=lambda *_: None, keep_log=log)
    assert rc1 == 124 and "slow" in ran.read_text().split()
    first = ran.read_text().split()
    fast.touch()
    rc2, r2, _ = run_tests(args, res, log=lambda *_: None, resume=log)
    m2 = r2.series[0].metrics
    again = ran.read_text().split()[len(first):]
    assert "slow" in again and not set(again) & (set(first) - {"slow"})  # nothing finished in part 1 ran again
    assert (m2["passed"], m2["failed"], m2["parts"], rc2) == (3, 1, 2, 1)
