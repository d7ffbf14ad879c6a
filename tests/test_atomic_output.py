"""Every command that writes output writes atomically, and bad input exits non-zero with a message
naming it while every existing file stays byte-for-byte as it was (issue 43, item 4). The commands
run on temporary copies: of the committed constants, and of synthetic results."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import warnings

import pytest
from megabench_synth import H200, class_results, save_all

from microbench import atomic
from reports.cli import main
from microbench.errors import OutputError, ResultsFileError
from microbench.results import REPO_ROOT


def _files(*dirs) -> dict[str, bytes]:
    """{path: bytes} of every file under the folders: what "untouched" is checked against."""
    out = {}
    for d in dirs:
        for p in sorted(d.rglob("*")) if d.exists() else []:
            if p.is_file():
                out[str(p)] = p.read_bytes()
    return out


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """(results root with synthetic H200 results, a copy of the fixture constants folder: a copy of
    the committed one that a new tune or adoption does not change), and $MEGABENCH_CONSTANTS_DIR /
    $MEGABENCH_RESULTS pointing at them."""
    res, const = tmp_path / "results", tmp_path / "constants"
    save_all(class_results(), res)
    shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "constants", const)
    monkeypatch.setenv("MEGABENCH_CONSTANTS_DIR", str(const))
    monkeypatch.setenv("MEGABENCH_RESULTS", str(res))
    monkeypatch.delenv("MEGABENCH_CONSTANTS", raising=False)
    return res, const


# ------------------------------------------------------------------------- the shared writer
def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    p = tmp_path / "out.json"
    atomic.write_json(p, {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1} and p.read_text().endswith("\n")
    assert oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as open() makes it, not mkstemp's 0600
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic.open_atomic(p) as f:
            f.write('{"half": ')
            raise RuntimeError("writer died")
    assert json.loads(p.read_text()) == {"a": 1}  # the old content, whole
    with pytest.raises(TypeError):
        atomic.write_json(p, {"x": object()})  # serialised before the disk is touched
    assert json.loads(p.read_text()) == {"a": 1}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.json"]  # no temporary left behind


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_atomic_write_refuses_a_missing_folder_and_an_existing_name(tmp_path):
    with pytest.raises(OutputError, match=f"folder {tmp_path / 'typo'} does not exist"):
        atomic.write_text(tmp_path / "typo" / "x.md", "x")
    assert not (tmp_path / "typo").exists()
    atomic.write_text(tmp_path / "made" / "x.md", "x", mkdir=True)  # a folder the writer owns
    p = tmp_path / "made" / "x.md"
    with pytest.raises(OutputError, match="exists already"):
        atomic.write_text(p, "y", replace=False)
    assert p.read_text() == "x"
    with pytest.raises(OutputError, match="is a folder"):
        atomic.check_writable(tmp_path / "made")
    with pytest.raises(OutputError, match="does not exist"):
        atomic.check_writable(None, tmp_path / "x.md", tmp_path / "nope" / "y.md")


def test_build_dir_swaps_a_complete_folder_in_and_keeps_the_old_one_on_failure(tmp_path):
    d = tmp_path / "report"
    d.mkdir()
    (d / "old.md").write_text("old")
    with pytest.raises(ValueError):
        with atomic.build_dir(d) as t:
            (t / "new.md").write_text("new")
            raise ValueError("validation failed")
    assert _files(d) == {str(d / "old.md"): b"old"}
    with atomic.build_dir(d) as t:
        (t / "new.md").write_text("new")
    assert _files(d) == {str(d / "new.md"): b"new"}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["report"]


# ------------------------------------------------------------------------- tune
def test_tune_missing_results_folder_names_it_and_writes_nothing(copies, capsys):
    res, const = copies
    before = _files(const)
    for missing in (res.parent / "missing", res.parent / "reslts"):  # missing, typo'd
        rc = main(["tune", "--results", str(missing)])
        err = capsys.readouterr().err
        assert rc == 2 and f"results folder {missing} does not exist" in err, err
    assert _files(const) == before


def test_tune_truncated_result_fails_before_writing(copies, capsys):
    res, const = copies
    save_all(class_results(date="2026-12-01T10:00:00Z"), res)  # a newer run ...
    newest = sorted((res / "sync").glob("sync.flags-20261201*.json"))[-1]
    newest.write_bytes(newest.read_bytes()[:200])  # ... whose file was cut off mid-write: not passed over
    before = _files(const, res)
    rc = main(["tune", "--results", str(res)])
    err = capsys.readouterr().err
    assert rc == 2 and str(newest) in err and "not valid JSON" in err, err
    assert _files(const, res) == before
    newest.unlink()
    gz = res / "sync" / "sync.flags-20261231T000000Z-nvidia-h200-abc1234.json.gz"
    gz.write_bytes(gzip.compress(b'{"schema": "megabench.result", "version": 1, "env": {')[:-6])
    before = _files(const, res)
    assert main(["tune", "--results", str(res), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert str(gz) in err and "not a readable gzip file" in err, err
    assert _files(const, res) == before
    data = bytearray(gzip.compress(b'{"schema": "megabench.result", "version": 1}' * 500))
    data[20:40] = b"\xff" * 20  # a corrupt deflate stream (zlib.error, not an OSError)
    gz.write_bytes(bytes(data))
    before = _files(const, res)
    assert main(["tune", "--results", str(res)]) == 2
    err = capsys.readouterr().err
    assert str(gz) in err and "not a readable gzip file" in err, err
    assert _files(const, res) == before


def test_tune_unknown_gpu_is_refused_naming_the_known_ones(copies, capsys):
    res, const = copies
    before = _files(const)
    rc = main(["tune", "--results", str(res), "--gpu", "NVIDIA H20"])
    err = capsys.readouterr().err
    assert rc == 2 and "no results for GPU 'NVIDIA H20'" in err and "'NVIDIA H200'" in err, err
    assert "did you mean 'NVIDIA H200'?" in err and "--new-gpu" in err
    assert _files(const) == before  # no second constants file
    # asked for explicitly: an all-defaults file for a GPU with no results yet
    assert main(["tune", "--results", str(res), "--gpu", "NVIDIA H20", "--new-gpu"]) == 0
    assert json.loads((const / "nvidia-h20.json").read_text())["defaults_used"]


def test_tune_writes_when_the_input_is_good(copies, capsys):
    res, const = copies
    assert main(["tune", "--results", str(res), "--gpu", H200]) == 0
    doc = json.loads((const / "nvidia-h200.json").read_text())
    assert doc["gpu"] == H200 and not doc["defaults_used"]
    assert not [p for p in const.rglob(".tmp-*")]


# ------------------------------------------------------------------------- reading constants
def test_load_constants_unknown_gpu_is_an_error_unless_defaults_are_asked_for(copies, monkeypatch):
    from microbench.tune import NoConstantsFileError, load_constants

    with pytest.raises(NoConstantsFileError, match=r"'NVIDIA H20'.*NVIDIA H200 \(nvidia-h200.json\)"):
        load_constants(gpu="NVIDIA H20")
    assert load_constants(gpu="NVIDIA H20", defaults_if_missing=True).defaults_used()
    monkeypatch.setenv("MEGABENCH_CONSTANTS", "defaults")
    assert load_constants(gpu="NVIDIA H20").defaults_used()
    assert load_constants(gpu=H200).defaults_used()  # explicit: the process asked for the defaults


def test_cpu_build_with_a_second_constants_file_is_an_error_not_all_defaults(copies, monkeypatch):
    from megakernel.plans import plan_for

    monkeypatch.setattr("megakernel.plans.gpu_count", lambda: 0)  # a CPU build, on a GPU machine too

    _, const = copies
    shutil.copy(const / "nvidia-h200.json", const / "nvidia-h20.json")
    # with an adopted revision the build reads it (microbench/adopt.py), whatever else the folder holds
    assert plan_for("tiny", None, 4).ring_stages >= 1
    shutil.rmtree(const / "adopted")  # without one: the folder's current files, where a second is an error
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: an error
        with pytest.raises(ResultsFileError, match=r"several constants files.*nvidia-h20.json.*nvidia-h200.json"):
            plan_for("tiny", None, 4)
    (const / "nvidia-h20.json").unlink()
    with pytest.warns(UserWarning, match="no adopted constants revision"):
        assert plan_for("tiny", None, 4).ring_stages >= 1  # the single committed file


# ------------------------------------------------------------------------- gate and megakernel.cli
def test_gate_outputs_in_a_missing_folder_are_refused_before_the_work(tmp_path, capsys):
    res = tmp_path / "r"
    files = save_all(class_results(), res)
    rc = main(["gate", str(files[0]), str(files[0]), "--markdown", str(tmp_path / "typo" / "gate.md"),
               "--json", str(tmp_path / "gate.json")])
    err = capsys.readouterr().err
    assert rc == 2 and f"folder {tmp_path / 'typo'} does not exist" in err, err
    assert not (tmp_path / "gate.json").exists()  # neither output written


def test_kernel_gate_update_into_a_missing_folder_compiles_nothing(tmp_path, capsys, monkeypatch):
    import microbench.kernel_gate as km

    monkeypatch.setattr(km, "measure_kernels", lambda *a, **k: pytest.fail("compiled before refusing"))
    rc = main(["gate", "--kernels", "--update", "--kernel-baseline", str(tmp_path / "typo" / "km.json")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_megakernel_cli_output_in_a_missing_folder_is_refused(tmp_path, capsys):
    from megakernel.cli import main as mk_main

    rc = mk_main(["ab-table", str(tmp_path / "none.json"), "--out", str(tmp_path / "typo" / "t.md")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
