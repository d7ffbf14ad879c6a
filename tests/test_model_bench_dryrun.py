"""CPU dry run of model.baselines end to end on the tiny preset: weights, reference check, kernel
count (faked: CUPTI needs a GPU), harness (host-timed stand-in), roofline, acceptance, derived
figures, the result file. Checks the plumbing, not the GPU; a failing case must show in the notes."""
from __future__ import annotations

import time

import numpy as np
import pytest

from megakernel import config
from microbench.harness import Policy
from microbench.results import Series, load


class FakeInfo:
    name = "NVIDIA H200"


class FakeHarness:
    device_index = 0
    policy = Policy()

    def __init__(self):
        self.info = FakeInfo()
        self.calls = []

    def series(self, name, launch, *, params=None, bound=None, work=None, batch=1, cold=False, policy=None,
               before_each=None, metrics=None, hold=True):
        self.calls.append((name, hold, policy.chunk))
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            launch()
            samples.append(time.perf_counter() - t0)
        return Series.from_samples(name, np.asarray(samples), timer="host", unit="s", params=params, bound=bound,
                                   work=work, metrics=metrics)


@pytest.fixture
def dry(monkeypatch):
    from megakernel import baselines as B
    from megakernel import bench_baselines as bb
    from megakernel import kernel_count

    monkeypatch.setattr(bb, "DEVICE", "cpu")
    monkeypatch.setattr(bb, "QUICK_POINTS", {"tiny": [(1, 20), (16, 40)]})
    monkeypatch.setattr(bb, "ACCEPT_NEW", 12)
    monkeypatch.setattr(B, "BASELINES", ("eager",))  # graph and compile need CUDA / minutes of CPU compile
    fake = kernel_count.KernelCount(1, 123, 0, 1, 123, 0, (("k", 123),))
    monkeypatch.setattr(kernel_count, "count_kernels", lambda fn, steps=1: (fn(), fake)[1])
    monkeypatch.setattr(bb, "count_kernels", kernel_count.count_kernels)  # bench_baselines imports it at its top
    yield bb
    bb.release()


def test_dry_run_end_to_end(dry):
    bb = dry
    h = FakeHarness()
    res = bb.run(h, quick=True, save=True)
    assert [s.name for s in res.series] == ["tiny/T1/ctx20/eager", "tiny/T16/ctx40/eager"]
    assert all(hold is False and chunk == 4 for _, hold, chunk in h.calls)
    for s in res.series:
        m = s.metrics
        assert m["launches_per_step"] == 123 and m["ref_max_row_rel"] < 1e-5
        assert s.bound.kind == "time" and s.bound.value == m["roofline_s"] > 0 and "roofline" in s.bound.source
        assert m["bytes_per_step"] == sum(m[f"bytes_{k}"] for k in ("dense", "experts", "kv_read", "kv_write",
                                                                     "lm_head", "embed"))
        assert s.params["impl"] == "naive_torch_eager" and s.params["tokens"] == s.params["T"]
    t16 = res.series[1]
    assert t16.params["distinct_experts"] == bb.study_like_distinct(config.preset("tiny"), 16)
    assert t16.metrics["tokens_per_step"] == res.derived["tiny.acceptance_length"].value
    assert res.series[0].metrics["tokens_per_step"] == 1.0
    assert "tiny/T16/ctx40/eager.tokens_per_s_projected_study_acceptance" in res.derived
    assert "PROJECTION" in res.derived["tiny/T16/ctx40/eager.tokens_per_s_projected_study_acceptance"].rule
    assert "tiny/T1/ctx20/eager.tokens_per_s" in res.derived
    assert not any("FAILED" in n for n in res.notes), res.notes
    from microbench.results import find

    back = load(find("model.baselines")[-1])
    assert [s.name for s in back.series] == [s.name for s in res.series]


def test_a_failing_case_is_reported_not_dropped(dry, monkeypatch):
    from megakernel import baselines as B
    from microbench.errors import CorrectnessError

    def broken(*a, what="", **k):
        raise CorrectnessError(f"{what}: deliberately broken")

    monkeypatch.setattr(B, "compare", broken)
    res = dry.run(FakeHarness(), quick=True, save=False)
    assert res.series == ()
    assert sum("FAILED: CorrectnessError" in n and "deliberately broken" in n for n in res.notes) == 2
