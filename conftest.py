"""pytest wiring shared by every test and benchmark.

- `gpu` tests skip cleanly (with the reason) without a usable CUDA GPU; `multigpu` without two.
- `--megabench-full` selects full sweeps (default quick); it sets MEGABENCH_FULL for the code.
- `device_bench`: a pytest-benchmark fixture whose timer is device time (CUDA events), so
  `--benchmark-compare-fail` and the saved statistics judge the GPU, not the host. One round is
  one step: a case whose launch covers several steps (metrics `steps_per_round`, the megakernel's
  2-step CUDA graph) advances the clock by the time per step (extra_info `time_per: step`).
  Committed baselines for `--benchmark-compare`: microbench/bench_storage.py.
- On a GPU with no tuned constants of its own (no adoption, no constants file), the
  run builds with the documented defaults (MEGABENCH_CONSTANTS=defaults) and its header says so.
- A test or case whose model cannot fit this GPU at all (GpuTooSmallError) skips, naming the
  bytes; free memory merely short stays a failure.
- Results written during tests go to a temporary folder unless MEGABENCH_RESULTS is set, so a
  test run never adds files to the committed reports/results.
"""
from __future__ import annotations

import os
import sys

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("megabench")
    g.addoption("--megabench-full", action="store_true", default=False,
                help="run full sweeps instead of quick ones (also MEGABENCH_FULL=1)")
    g.addoption("--megabench-rounds", type=int, default=None,
                help="pytest-benchmark rounds per device-timed case (default 15 quick / 50 full)")


def defaults_without_constants() -> str | None:
    """Where a GPU is present with no tuned constants of its own and MEGABENCH_CONSTANTS is unset,
    set MEGABENCH_CONSTANTS=defaults (the build's documented defaults) and return the line that
    says so; else None. Danger: without it every test that builds a plan fails on such a GPU with
    NoConstantsFileError, which the build rightly raises outside tests (constants never cross GPU
    models). A malformed constants file is named in the header and left to fail each test that
    builds, by name, not the whole run here."""
    if os.environ.get("MEGABENCH_CONSTANTS"):
        return None
    import warnings

    from megakernel import plans
    from microbench.errors import MegabenchError
    from microbench.tune import NoConstantsFileError

    if not plans.gpu_count():
        return None
    try:
        with warnings.catch_warnings():  # "no adoption, the current file": the tests' concern, not this
            warnings.simplefilter("ignore")
            plans.tuned()
    except NoConstantsFileError:
        os.environ["MEGABENCH_CONSTANTS"] = "defaults"
        return (f"megabench: no tuned constants for {plans.device_info().name}: the tests build with the documented "
                "defaults (MEGABENCH_CONSTANTS=defaults; `megabench run` tunes this GPU's)")
    except MegabenchError as e:  # a malformed file: each test that builds fails naming it, not the whole run here
        return f"megabench: this GPU's tuned constants do not load: {e}"
    return None


def pytest_configure(config):
    if config.getoption("--megabench-full"):
        os.environ["MEGABENCH_FULL"] = "1"
    config._megabench_constants_note = defaults_without_constants()
    # The CPU-side work in tests is many tiny tensor ops: intra-op threads only add OpenMP
    # wake-ups (seen: a 16x128 matmul taking 47 ms with 2 threads on a busy 2-core machine).
    import torch

    torch.set_num_threads(int(os.environ.get("MEGABENCH_TORCH_THREADS", "1")))


def pytest_report_header(config):
    return getattr(config, "_megabench_constants_note", None)


def _gpus() -> tuple[int, str | None]:
    from microbench.device import gpu_count, no_gpu_reason

    return gpu_count(), no_gpu_reason()


def _benchmarking(config) -> bool:
    """A run that times pytest-benchmark cases (pytest-benchmark switches itself off under
    xdist, and timings want the machine to themselves)."""
    opt = config.option
    return bool(getattr(opt, "benchmark_only", False) or getattr(opt, "benchmark_json", None)
                or getattr(opt, "benchmark_save", None) or getattr(opt, "benchmark_autosave", None)
                or getattr(opt, "benchmark_compare", None))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (-p no:xdist) it is simply unused
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, at most 16; none for benchmark runs
    or where MEGABENCH_TEST_WORKERS says so (e.g. 0 to debug in one process)."""
    if _benchmarking(config):
        return 0
    env = os.environ.get("MEGABENCH_TEST_WORKERS")
    if env is not None:
        try:
            return max(0, int(env))
        except ValueError:
            raise pytest.UsageError(f"MEGABENCH_TEST_WORKERS={env!r}: want a whole number of workers") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(16, cores) if cores > 1 else 0


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group markers
def pytest_collection_modifyitems(config, items):
    from microbench.harness import full_sweeps

    n, reason = _gpus()
    skip_gpu = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n}")
    skip_full = pytest.mark.skip(reason="full sweep only (--megabench-full or MEGABENCH_FULL=1)")
    for item in items:
        if "gpu" in item.keywords:
            # one worker runs every GPU test, one after another (under -n, --dist loadgroup)
            item.add_marker(pytest.mark.xdist_group("gpu"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
        if "full" in item.keywords and not full_sweeps():
            item.add_marker(skip_full)


def _too_small_skips(item):
    """A model that cannot fit this GPU at all (GpuTooSmallError: shard8's weights and their tiled
    copies on an 80 GB card) skips the test or case, naming the bytes. Danger: only that class
    may skip; free memory merely short (DeviceMemoryError, another process holding the card) is a
    failure, since it would hide a leak between tests."""
    from microbench.errors import GpuTooSmallError

    try:
        return (yield)
    except GpuTooSmallError as e:
        pytest.skip(f"the GPU is too small for {item.name}'s model: {e}")


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_too_small_skips)  # module-scoped fixtures too
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_too_small_skips)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test that raised, drop the exception pytest keeps for post-mortem debugging
    (sys.last_value / last_traceback / last_exc), collect, and return the GPU memory its frames
    held. Danger: pytest drops it only when the next test's call begins, after that test's setup
    (module fixtures) has allocated, and tensors in reference cycles live on until a later
    collection; one test that ran the GPU out of memory could fail the tests after it."""
    if getattr(sys, "last_value", None) is None and getattr(sys, "last_exc", None) is None:
        return
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def pytest_benchmark_update_machine_info(config, machine_info):
    """Label pytest-benchmark JSON with the GPU, so `megabench gate` can keep baselines per GPU."""
    from microbench.device import gpu_count

    if gpu_count() > 0:
        from microbench.device import device_info

        d = device_info()
        machine_info["megabench"] = {"gpu": d.name, "gpu_key": f"{d.name}@{d.sm_clock_max_mhz}MHz",
                                     "sm_count": d.sm_count, "driver": d.driver_version}


def pytest_benchmark_update_commit_info(config, commit_info):
    """On a copy of a checkout (MEGABENCH_GIT_SHA set, as on the GPU machine, whose .git may be an
    earlier commit's): credit the JSON to that commit, dirty by MEGABENCH_SOURCE_TREE, as the
    result files do; pytest-benchmark read the copy's stale .git (753ac92 for 2767860)."""
    import os

    if os.environ.get("MEGABENCH_GIT_SHA"):
        from microbench.results import git_dirty, git_sha

        stale = commit_info.get("id")
        commit_info.update(id=git_sha(full=True), dirty=git_dirty(),
                           credited_by="MEGABENCH_GIT_SHA", copy_git_id=stale)
        for k in ("time", "author_time"):
            commit_info.pop(k, None)  # the stale commit's times


@pytest.fixture(scope="session", autouse=True)
def _results_dir(tmp_path_factory):
    """Tests write results into a folder of their own (MEGABENCH_TEST_RESULTS, else a temporary
    one), never into the committed reports/results nor into a MEGABENCH_RESULTS the caller set
    (a GPU session's results). Danger: tests writing their runs where a session's results are
    would make the tests that read "the newest results" read their own."""
    os.environ["MEGABENCH_RESULTS"] = os.environ.get("MEGABENCH_TEST_RESULTS") or str(
        tmp_path_factory.mktemp("results"))
    yield


@pytest.fixture(scope="module", autouse=True)
def _free_gpu_memory_after_each_module():
    """GPU tests run one after another in one process (the `gpu` xdist group): drop the weights,
    step contexts and peer models a module left cached before the next one starts. Danger: a
    preset's weights held over from one module can leave the next without GPU memory."""
    yield
    import sys

    # loaded only where a test used them (peer_bench imports bench_baselines): nothing is imported here
    bb = sys.modules.get("megakernel.bench_baselines")
    peer = sys.modules.get("megakernel.peer_bench")
    if bb is not None and (bb._WEIGHTS or bb._CONTEXTS or bb._ACCEPT or (peer is not None and (peer._MODELS or peer._REAL))):
        bb.release()  # its weights and step contexts, and through RELEASE_HOOKS the peer's models
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def harness():
    from microbench.harness import Harness

    return Harness()


@pytest.fixture
def device_bench(benchmark, harness, request):
    """Run a microbench Case under pytest-benchmark with device time.

    Usage: `device_bench(case)`. The case is prepared (allocation + correctness check) once,
    then each round is one blocked, event-timed sample; the round's duration is device seconds.
    extra_info records the timer, the bound and the achieved fraction.
    """
    from microbench.harness import DeviceClock, sample_once

    def run(case, rounds: int | None = None):
        prepared = case.prepare(harness)  # GpuTooSmallError here skips the case (_too_small_skips)
        clock = DeviceClock()
        if not hasattr(benchmark, "_timer"):
            raise RuntimeError("pytest-benchmark internals changed: BenchmarkFixture._timer missing "
                               "(megabench pins pytest-benchmark>=5.2,<5.4)")
        benchmark._timer = clock
        full = request.config.getoption("--megabench-full")
        n = rounds or request.config.getoption("--megabench-rounds") or (50 if full else 15)
        for _ in range(3):  # warm-up outside the statistics: whole samples, reset as the timed ones are
            if prepared.before_each is not None:
                prepared.before_each()
            for _ in range(prepared.batch):
                prepared.launch()
        steps = prepared.metrics.get("steps_per_round", 1)
        steps = steps if isinstance(steps, int) and steps > 1 else 1

        def one():
            clock.advance(sample_once(harness, prepared) / steps)  # one round = one step

        if getattr(benchmark, "disabled", False):
            # pytest-benchmark is off (the README's test command runs under xdist; --benchmark-disable):
            # the case was prepared, checked and launched above, as a test; nothing is timed
            if prepared.after is not None:
                prepared.after()
            return prepared
        benchmark._megabench_after = prepared.after  # the A/B worker checks after each timing request too
        benchmark.pedantic(one, rounds=n, iterations=1, warmup_rounds=1)
        if prepared.after is not None:
            prepared.after()  # the last timed sample's launches: a wait that gave up fails the case
        st = benchmark.stats.stats
        info = {"timer": "cuda_event (device seconds)", "case": case.name, **{k: v for k, v in case.params.items()}}
        if steps > 1:
            info["time_per"] = "step"  # the figures are per step; a launch timed steps_per_round of them
        if prepared.bound is not None:
            b = prepared.bound
            info.update(bound_kind=b.kind, bound_value=b.value, bound_unit=b.unit, bound_source=b.source)
            if b.kind in ("bandwidth", "throughput") and prepared.work:
                ach = prepared.work / steps / st.median  # work per launch, median per step
                info.update(achieved=ach, fraction_of_bound=ach / b.value)
            else:
                info.update(achieved=st.median, fraction_of_bound=b.value / st.median)
        info.update({k: v for k, v in prepared.metrics.items() if isinstance(v, (int, float, str))})
        benchmark.extra_info.update(info)
        return prepared

    return run


_ONE_BYTE = bytes(range(256))


@pytest.fixture(autouse=True)
def _shared_one_byte_objects_intact():
    """The interpreter shares one object per one-byte bytes and per one-character str (b" " * 1 is
    that object). Native code handed one as an output buffer (NVRTC's log, ctypes) writes into
    every use of it in the process: b" " holding NUL turns print's separator into NUL wherever
    text is encoded. After every test each must still hold its own value, or the test that broke
    one fails, named."""
    yield
    bad = [i for i in range(256) if _ONE_BYTE[i:i + 1][0] != i or ord(chr(i)) != i]
    if bad:
        pytest.fail(f"the interpreter's shared one-byte objects of values {bad[:8]} no longer hold them: "
                    "native code wrote into a buffer it did not own")
