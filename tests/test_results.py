"""Typed results: round trip, atomic no-overwrite writes, clear errors on bad files."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from microbench.errors import ResultsFileError
from microbench.results import GZIP_MIN_BYTES, SCHEMA, VERSION, Bound, Derived, Env, Result, Series, find, latest, load


def make_result(bench="basics.copy", date="2026-11-29T10:00:00Z", median=1e-3) -> Result:
    env = Env(gpu="NVIDIA H200", gpu_uuid="x", cc="9.0", sm_count=132, l2_bytes=62914560, sm_clock_max_mhz=1980,
              mem_clock_max_mhz=3201, driver="580", nvrtc="13.0", cuda_core="1.2.0", torch="2.11", python="3.12",
              git_sha="abcdef0123", git_dirty=False, host="h", date=date)
    rng = np.random.default_rng(1)
    s = Series.from_samples("copy/x", median * (1 + 0.01 * rng.standard_normal(30)), timer="cuda_event", unit="s",
                            params={"bytes": 1 << 20}, bound=Bound("bandwidth", 4e12, "B/s", "test"), work=2e9)
    d = {"bw": Derived(2e12, "B/s", "rule", (1.9e12, 2.1e12), ("copy/x",))}
    return Result(bench, env, (s,), d, quick=True, notes=("n",))


def test_roundtrip(tmp_path):
    r = make_result()
    p = r.save(tmp_path)
    assert p.parent.name == "basics"
    r2 = load(p)
    assert r2.env == r.env
    assert r2.series[0].samples == r.series[0].samples
    assert r2.series[0].summary == r.series[0].summary
    assert r2.series[0].bound == r.series[0].bound
    assert r2.derived["bw"] == r.derived["bw"]
    assert abs(r2.series[0].fraction_of_bound - (2e9 / r.series[0].summary.median) / 4e12) < 1e-12


def test_never_overwrites(tmp_path):
    r = make_result()
    p1, p2 = r.save(tmp_path), r.save(tmp_path)
    assert p1 != p2 and p1.exists() and p2.exists()
    assert not list(tmp_path.rglob(".tmp-*"))


def test_latest_by_date(tmp_path):
    make_result(date="2026-11-01T00:00:00Z", median=2e-3).save(tmp_path)
    make_result(date="2026-11-29T00:00:00Z", median=1e-3).save(tmp_path)
    assert len(find("basics.copy", tmp_path)) == 2
    assert latest("basics.copy", tmp_path).env.date.startswith("2026-11-29")
    assert latest("icache.capacity", tmp_path) is None


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="other"), "schema"),
    (lambda d: d.update(version=VERSION + 1), "newer megabench"),
    (lambda d: d.update(version="1"), "integer"),
    (lambda d: d.pop("env"), "malformed"),
    (lambda d: d["series"][0].update(timer="sundial"), "malformed"),
    (lambda d: d["series"][0].pop("samples"), "malformed"),
])
def test_bad_files_are_refused_with_the_file_named(tmp_path, mutate, message):
    p = make_result().save(tmp_path)
    d = json.loads(p.read_text())
    mutate(d)
    p.write_text(json.dumps(d))
    with pytest.raises(ResultsFileError, match=message) as e:
        load(p)
    assert str(p) in str(e.value)


def test_not_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ResultsFileError, match="not valid JSON"):
        load(p)
    with pytest.raises(ResultsFileError, match="no such"):
        load(tmp_path / "missing.json")


def test_large_results_are_saved_gzipped_and_read_in_either_form(tmp_path):
    # a result of more than GZIP_MIN_BYTES of JSON is written as .json.gz; load, find and latest
    # take both forms, a gzipped name and a plain one never share a stem, and a corrupt gzip is
    # refused with the file named. Perfetto traces beside the results are not results.
    small = make_result(date="2026-11-01T00:00:00Z").save(tmp_path)
    assert small.name.endswith(".json") and len(small.read_bytes()) <= GZIP_MIN_BYTES
    r = make_result(date="2026-11-29T00:00:00Z")
    big = Result(r.benchmark, r.env, r.series * 400, r.derived, r.quick, r.notes)
    p = big.save(tmp_path)
    assert p.name.endswith(".json.gz") and len(gzip.decompress(p.read_bytes())) > GZIP_MIN_BYTES
    assert load(p).series == big.series
    # a trace is not even read: unreadable, a result file would be listed (to fail when loaded)
    (tmp_path / "basics" / "basics.copy-x.trace.json.gz").write_bytes(b"not gzip")
    assert find("basics.copy", tmp_path) == [small, p] == find(None, tmp_path)
    assert latest("basics.copy", tmp_path).env.date.startswith("2026-11-29")
    # the same name again: the next free stem, whatever form the first took
    plain = make_result(date="2026-11-29T00:00:00Z").save(tmp_path)
    assert plain.name.replace(".json", "") == p.name.replace(".json.gz", "") + "-1"
    bad = tmp_path / "basics" / "basics.copy-bad.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ResultsFileError, match="not a readable gzip file") as e:
        load(bad)
    assert str(bad) in str(e.value)


def test_series_requires_known_timer_and_work():
    with pytest.raises(ValueError, match="timer"):
        Series.from_samples("x", [1.0], timer="wallclock", unit="s")
    with pytest.raises(ValueError, match="work"):
        Series.from_samples("x", [1.0], timer="cuda_event", unit="s", bound=Bound("bandwidth", 1, "B/s", "t"))
    with pytest.raises(ValueError, match="non-finite"):
        Series.from_samples("x", [1.0, float("nan")], timer="cuda_event", unit="s")


def test_schema_constant():
    assert make_result().to_json()["schema"] == SCHEMA


def test_dirty_is_judged_by_the_sources_on_disk(tmp_path, monkeypatch):
    """A copy whose .git lags behind its files (the GPU machine gets the caller's files beside an
    earlier commit's .git) is clean when its sources' tree id is the caller's
    (MEGABENCH_SOURCE_TREE), whatever `git status` says; results written beside the sources do not
    count; a changed source does."""
    import shutil
    import subprocess

    import microbench.results as res

    if shutil.which("git") is None:
        pytest.skip("no git")

    def git(*a):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *a], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "megakernel").mkdir()
    (tmp_path / "megakernel" / "k.cu").write_text("v1\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    (tmp_path / "megakernel" / "k.cu").write_text("v2\n")
    git("add", "-A")
    git("commit", "-q", "-m", "two")
    monkeypatch.setattr(res, "REPO_ROOT", tmp_path)
    res.source_tree_id.cache_clear()
    want = res.source_tree_id()  # at commit two, clean
    assert want and not res._dirty(want) and not res._dirty(None)
    git("reset", "-q", "--soft", "HEAD~1")  # .git one commit behind its files
    res.source_tree_id.cache_clear()
    assert res._dirty(None)  # git status: "modified"
    assert not res._dirty(want)
    (tmp_path / "reports" / "results").mkdir(parents=True)
    (tmp_path / "reports" / "results" / "r.json").write_text("{}")  # a run's own output
    res.source_tree_id.cache_clear()
    assert not res._dirty(want)
    (tmp_path / "megakernel" / "k.cu").write_text("v3\n")
    res.source_tree_id.cache_clear()
    assert res._dirty(want)
    monkeypatch.setenv("MEGABENCH_SOURCE_TREE", want)
    assert Env.capture().git_dirty
    res.source_tree_id.cache_clear()


def test_source_tree_command(capsys):
    import microbench.results as res

    assert res._main(["nonsense"]) == 2
    rc = res._main(["source-tree"])
    out = capsys.readouterr().out.strip()
    assert (rc == 0 and len(out) >= 40 and out == res.source_tree_id()) or (rc == 1 and not out)
