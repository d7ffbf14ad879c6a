"""The device_bench fixture (conftest.py) when pytest-benchmark is off: the README's test command
runs under xdist, which switches pytest-benchmark off, and the pytest-benchmark cases then run as
tests. On the H200 (2026-12-01) every such case failed there on `benchmark.stats` being None."""
from __future__ import annotations

import shutil

import pytest

from microbench.results import REPO_ROOT

pytest_plugins = ["pytester"]

CASE = '''
class Prepared:
    bound = None
    work = None
    metrics = {}
    batch = 2
    launches = 0
    resets = 0
    checked = 0

    def launch(self):
        Prepared.launches += 1

    def before_each(self):
        Prepared.resets += 1

    def after(self):
        Prepared.checked += 1


class Case:
    name = "stand-in"
    params = {}
    prepared = Prepared()

    def prepare(self, harness):
        assert harness == "no GPU needed"
        return self.prepared


def test_case_runs_as_a_test(device_bench):
    p = device_bench(Case())
    # prepared, checked, and three whole samples launched (reset, then batch launches); nothing timed
    assert (p.launches, p.resets) == (6, 3)
    assert p.checked == 1  # the last launches checked afterwards


def test_a_wait_that_gave_up_fails_the_case(device_bench):
    class GaveUp(Prepared):
        def after(self):
            raise RuntimeError("block 3 gave up waiting for the ping flag")

    class Case2(Case):
        prepared = GaveUp()

    device_bench(Case2())


def test_a_failing_check_still_fails(device_bench):
    class Broken(Case):
        def prepare(self, harness):
            raise AssertionError("wrong result")

    device_bench(Broken())
'''


def _run_with_conftest(pytester, monkeypatch, name: str, body: str, *args: str) -> str:
    """`body` as test file `name` beside a copy of the repository's conftest.py, run in a child
    pytest (no xdist, no cache) with `args`; its stdout. The parent's xdist variables are cleared:
    the child would otherwise take itself for a worker."""
    for k in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(k, raising=False)
    shutil.copy(REPO_ROOT / "conftest.py", pytester.path / "conftest.py")
    (pytester.path / name).write_text(body)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", *args, name).stdout.str()


def test_device_bench_with_pytest_benchmark_off_runs_the_case_as_a_test(pytester, monkeypatch):
    out = _run_with_conftest(pytester, monkeypatch, "test_case.py",
                             "import pytest\n\n@pytest.fixture\ndef harness():\n    return 'no GPU needed'\n" + CASE,
                             "--benchmark-disable")
    assert "1 passed" in out and "2 failed" in out and "wrong result" in out, out[-3000:]
    assert "gave up waiting for the ping flag" in out
    assert "'NoneType' object has no attribute 'stats'" not in out


def test_benchmark_json_is_credited_to_megabench_git_sha(pytester, monkeypatch):
    """On the GPU machine's copy of a checkout the .git may be an earlier commit's: the JSON's
    commit_info names the commit MEGABENCH_GIT_SHA credits the run to, as the result files do."""
    import json

    sha = "ab" * 20
    monkeypatch.setenv("MEGABENCH_GIT_SHA", sha)
    monkeypatch.delenv("MEGABENCH_SOURCE_TREE", raising=False)
    out = _run_with_conftest(pytester, monkeypatch, "test_b.py", "def test_b(benchmark):\n    benchmark(lambda: None)\n",
                             "--benchmark-only", "--benchmark-json=out.json")
    assert "1 passed" in out, out[-2000:]
    ci = json.loads((pytester.path / "out.json").read_text())["commit_info"]
    assert ci["id"] == sha and ci["credited_by"] == "MEGABENCH_GIT_SHA"


TOO_SMALL = """
import pytest
from microbench.errors import DeviceMemoryError, GpuTooSmallError


@pytest.fixture(scope="module")
def huge():
    raise GpuTooSmallError("needs 150.0 GiB; this GPU has 79.1 GiB")


def test_model_never_fits(device_bench):
    class Case:
        name = "shard8-stand-in"

        def prepare(self, harness):
            raise GpuTooSmallError("needs 150.0 GiB; this GPU has 79.1 GiB")

    device_bench(Case())


def test_fixture_never_fits(huge):
    pass


def test_plain_test_never_fits():
    raise GpuTooSmallError("needs 150.0 GiB; this GPU has 79.1 GiB")


def test_memory_merely_short():
    raise DeviceMemoryError("needs 20.0 GiB; 3.0 GiB free")
"""


def test_a_model_too_big_for_the_gpu_skips_and_short_memory_fails(pytester, monkeypatch):
    """GpuTooSmallError skips a case, a fixture's test and a plain test, naming the bytes; a
    DeviceMemoryError (free memory short) still fails."""
    out = _run_with_conftest(pytester, monkeypatch, "test_small.py",
                             "import pytest\n\n@pytest.fixture\ndef harness():\n    return None\n" + TOO_SMALL,
                             "--benchmark-disable", "-rs")
    assert "3 skipped" in out and "1 failed" in out, out[-3000:]
    assert out.count("needs 150.0 GiB; this GPU has 79.1 GiB") >= 3 and "3.0 GiB free" in out


def _conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("megabench_root_conftest", REPO_ROOT / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gpu,expect", [("NVIDIA H100 80GB HBM3", "defaults"), ("NVIDIA H200", None), (None, None)])
def test_a_gpu_without_constants_runs_the_tests_on_the_defaults(tmp_path, monkeypatch, gpu, expect):
    """conftest.defaults_without_constants: a GPU with no constants of its own (the folder holds an
    H200's only) gets MEGABENCH_CONSTANTS=defaults and a header line naming it; the H200 keeps its
    constants, a machine without a GPU its own rule, and a value already set is never replaced."""
    import os
    import types

    from megabench_synth import FIXTURES

    d = tmp_path / "constants"
    shutil.copytree(FIXTURES / "constants", d)
    monkeypatch.setenv("MEGABENCH_CONSTANTS_DIR", str(d))
    monkeypatch.delenv("MEGABENCH_CONSTANTS", raising=False)
    monkeypatch.setattr("megakernel.plans.gpu_count", lambda: int(gpu is not None))
    monkeypatch.setattr("megakernel.plans.device_info", lambda: types.SimpleNamespace(name=gpu))
    note = _conftest().defaults_without_constants()
    assert os.environ.get("MEGABENCH_CONSTANTS") == expect
    assert (note is not None) == (expect is not None)
    if note:
        assert f"no tuned constants for {gpu}" in note and "MEGABENCH_CONSTANTS=defaults" in note
    monkeypatch.setenv("MEGABENCH_CONSTANTS", "some-revision.json")
    assert _conftest().defaults_without_constants() is None and os.environ["MEGABENCH_CONSTANTS"] == "some-revision.json"


def test_a_malformed_constants_file_is_named_not_replaced_by_the_defaults(tmp_path, monkeypatch):
    import os
    import types

    from megabench_synth import FIXTURES

    d = tmp_path / "constants"
    shutil.copytree(FIXTURES / "constants", d)
    (d / "nvidia-h100-80gb-hbm3.json").write_text("{not json")
    monkeypatch.setenv("MEGABENCH_CONSTANTS_DIR", str(d))
    monkeypatch.delenv("MEGABENCH_CONSTANTS", raising=False)
    monkeypatch.setattr("megakernel.plans.gpu_count", lambda: 1)
    monkeypatch.setattr("megakernel.plans.device_info", lambda: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3"))
    note = _conftest().defaults_without_constants()
    assert "MEGABENCH_CONSTANTS" not in os.environ
    assert note.startswith("megabench: this GPU's tuned constants do not load:") and "nvidia-h100-80gb-hbm3.json" in note


HELD = """
import gc
import weakref

gc.disable()  # only an explicit collection frees a cycle: the test cannot pass by a timely automatic one
REF = []


class Big:  # an engine, say: its tensors in a reference cycle, as closures and graphs make them
    def __init__(self):
        self.me = self


def test_fails_holding_memory():
    big = Big()
    REF.append(weakref.ref(big))
    raise MemoryError("out of memory, as CUDA says")


def test_after_it():
    assert REF and REF[0]() is None, "the failed test's objects are still alive"
"""


def test_a_failed_test_does_not_hold_its_memory_for_the_next(pytester, monkeypatch):
    """conftest.pytest_runtest_teardown: after a failure, the exception pytest keeps (sys.last_*)
    is dropped and the garbage collected at once, so the failed test's objects, in reference
    cycles too, are gone before the next test allocates (pytest alone drops the exception when the
    next test's call starts, and leaves cycles to a later automatic collection)."""
    out = _run_with_conftest(pytester, monkeypatch, "test_held.py", HELD, "--benchmark-disable")
    assert "1 failed, 1 passed" in out and "out of memory, as CUDA says" in out, out[-3000:]
