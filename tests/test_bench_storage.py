"""pytest-benchmark's own comparison against the committed baseline (reports/benchmarks/<machine_id>/):
the layout it reads, per-step figures, and `--benchmark-compare-fail=median:5%` failing on a 1.5x
slowdown of one headline case and passing without one, end to end in a child pytest. The end-to-end
cases replay the baseline's eight megakernel cases from a fixture copy
(tests/fixtures/benchmarks/0001_h200-baseline-megakernel.json), so a new baseline changes nothing
they assert; the layout test reads the committed file and checks its shape, not its figures."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from microbench.bench_storage import GPU_MACHINE_ID, STORAGE, machine_id, merge, per_step, write_baseline
from microbench.errors import ResultsFileError

pytest_plugins = ["pytester"]
COMMITTED = STORAGE / GPU_MACHINE_ID / "0001_h200-baseline.json"
MEGAKERNEL_CASES = Path(__file__).parent / "fixtures" / "benchmarks" / "0001_h200-baseline-megakernel.json"


def test_committed_baseline_is_in_pytest_benchmarks_layout():
    from pytest_benchmark.utils import get_machine_id

    assert machine_id() == get_machine_id()  # the same formula as pytest-benchmark's
    d = json.loads(COMMITTED.read_text())
    names = [b["fullname"] for b in d["benchmarks"]]
    assert len(names) == len(set(names)) >= 40
    mk = {b["fullname"]: b for b in d["benchmarks"] if "test_megakernel_step" in b["fullname"]}
    assert len(mk) == 8
    for b in mk.values():  # one round is one step (the rounds of two steps were divided), said so
        assert b["extra_info"]["time_per"] == "step"
        assert b["stats"]["median"] == pytest.approx(sorted(b["stats"]["data"])[len(b["stats"]["data"]) // 2])
    assert all(b["stats"].get("data") for b in d["benchmarks"])  # per-round data for `megabench gate`


def test_per_step_and_merge(tmp_path):
    b = {"fullname": "t::x", "extra_info": {"steps_per_round": 2}, "stats": {"data": [2.0, 4.0, 6.0], "median": 4.0}}
    s = per_step(b)
    assert s["stats"]["median"] == 2.0 and s["stats"]["data"] == [1.0, 2.0, 3.0] and s["stats"]["ops"] == 0.5
    assert per_step(s) == s  # already per step
    with pytest.raises(ResultsFileError, match="no per-round data"):
        per_step({"fullname": "t::y", "extra_info": {"steps_per_round": 2}, "stats": {"median": 1.0}})

    def doc(when, med):
        return {"machine_info": {}, "datetime": when, "benchmarks": [
            {"fullname": "t::a", "name": "a", "extra_info": {}, "stats": {"data": [med], "median": med}}]}

    (tmp_path / "old.json").write_text(json.dumps(doc("2026-01-01", 1.0)))
    (tmp_path / "new.json").write_text(json.dumps(doc("2026-02-01", 2.0)))
    m = merge([tmp_path / "new.json", tmp_path / "old.json"])
    assert m["benchmarks"][0]["stats"]["median"] == 2.0 and m["datetime"] == "2026-02-01"
    p1 = write_baseline([tmp_path / "old.json"], "x", tmp_path / "st", "M")
    p2 = write_baseline([tmp_path / "new.json"], "x", tmp_path / "st", "M")
    assert (p1.name, p2.name) == ("0001_x.json", "0002_x.json") and p1.parent.name == "M"
    with pytest.raises(ResultsFileError, match="letters, digits"):
        write_baseline([tmp_path / "new.json"], "a/b", tmp_path / "st", "M")


BENCH = '''
import os
import pytest

POINTS = [("small", 1, 512), ("small", 16, 512), ("shard8", 1, 2048), ("shard8", 16, 2048)]
MEDIANS = {medians}
SLOW = os.environ.get("SLOW_CASE", "")


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("mode", ["chain", "mega"])
@pytest.mark.parametrize("preset,T,ctx", POINTS, ids=lambda v: str(v))
def test_megakernel_step(benchmark, preset, T, ctx, mode):
    """Stands in for the GPU case: each round "measures" the committed per-step median (x 1.5 for
    the slowed case), through a device-clock timer like conftest's device_bench."""
    name = f"{{preset}}-{{T}}-{{ctx}}-{{mode}}"
    clock = Clock()
    benchmark._timer = clock
    step = MEDIANS[name] * (1.5 if name == SLOW else 1.0)

    def one():
        clock.t += step

    benchmark.pedantic(one, rounds=15, iterations=1, warmup_rounds=1)
    benchmark.extra_info["time_per"] = "step"
'''


@pytest.fixture
def stand_in(pytester, monkeypatch):
    for k in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(k, raising=False)  # under -n the child would think it is an xdist worker
    d = json.loads(MEGAKERNEL_CASES.read_text())
    meds = {b["fullname"].split("[", 1)[1].rstrip("]"): b["stats"]["median"] for b in d["benchmarks"]
            if "test_megakernel_step" in b["fullname"]}
    assert len(meds) == 8
    pytester.mkdir("tests")
    pytester.mkdir("tests/bench")
    (pytester.path / "tests" / "bench" / "test_bench_megakernel.py").write_text(BENCH.format(medians=repr(meds)))
    storage = pytester.path / "storage"
    (storage / machine_id()).mkdir(parents=True)
    shutil.copy(MEGAKERNEL_CASES, storage / machine_id() / "0001_h200-baseline.json")  # as if run on the H200's Python
    return pytester, storage


ARGS = ("tests/bench", "-p", "no:cacheprovider", "--benchmark-only", "--benchmark-compare=0001",
        "--benchmark-compare-fail=median:5%")


@pytest.mark.parametrize("slow", ["shard8-16-2048-mega", "small-1-512-chain"])
def test_compare_fail_catches_a_headline_slowed_by_half(stand_in, slow, monkeypatch):
    pytester, storage = stand_in
    monkeypatch.setenv("SLOW_CASE", slow)
    r = pytester.runpytest_subprocess(*ARGS, f"--benchmark-storage={storage}")
    assert r.ret != 0
    out = r.stdout.str() + r.stderr.str()
    assert "Performance has regressed" in out and f"test_megakernel_step[{slow}]" in out
    others = [ln for ln in out.splitlines() if "test_megakernel_step[" in ln and "median" in ln and slow not in ln]
    assert not others, others


def test_compare_passes_without_a_slowdown_and_by_folder_name(stand_in, monkeypatch):
    pytester, storage = stand_in
    monkeypatch.delenv("SLOW_CASE", raising=False)
    r = pytester.runpytest_subprocess(*ARGS, f"--benchmark-storage={storage}")
    assert r.ret == 0, r.stdout.str()[-3000:]
    assert "Comparing against benchmarks from" in r.stdout.str() + r.stderr.str()
    # from any Python, the committed folder by name (platform-glob/filename-glob)
    repo_copy = pytester.path / "committed"
    (repo_copy / GPU_MACHINE_ID).mkdir(parents=True)
    shutil.copy(MEGAKERNEL_CASES, repo_copy / GPU_MACHINE_ID / "0001_h200-baseline.json")
    monkeypatch.setenv("SLOW_CASE", "shard8-1-2048-chain")
    r = pytester.runpytest_subprocess("tests/bench", "-p", "no:cacheprovider", "--benchmark-only",
                                      f"--benchmark-storage={repo_copy}",
                                      f"--benchmark-compare={GPU_MACHINE_ID}/0001",
                                      "--benchmark-compare-fail=median:5%")
    assert r.ret != 0 and "test_megakernel_step[shard8-1-2048-chain]" in r.stdout.str() + r.stderr.str()
