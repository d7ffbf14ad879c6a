"""CPU dry run of the clocks benchmarks: every run function end to end with the GPU probes
replaced by synthetic data of known shape and the harness by modelled timings. It checks the
plumbing (checks run, every constant the table asks for is derived with a rule and a spread,
results round-trip, the trace and the plot are written and the trace validates, the note
renders), not the GPU: kernel behaviour is the GPU tests' business."""
from __future__ import annotations

import json

import numpy as np
import pytest
from clocks_emulate import emulate

from microbench.clocks import analysis as an
from microbench.clocks import bench
from microbench.clocks.events import INSTR, LAUNCH
from microbench.clocks.probes import RateProbe
from microbench.clocks.profiler import ProfileBuffer, ProfileLayout, Timeline, decode, validate_trace
from microbench.constants import SPECS
from microbench.errors import CorrectnessError
from microbench.results import Series, find, load, results_root

GT0 = 1_764_000_000_000_000_000
SMS = 132


class FakeInfo:
    name = "NVIDIA H200"
    sm_count = SMS
    smem_per_block_optin = 232448
    smem_per_sm = 233472
    reserved_smem_per_block = 1024
    sm_clock_max_mhz = 1980
    arch = "sm_90a"


class FakeHarness:
    device_index = 0
    info = FakeInfo()


def _rng():
    return np.random.default_rng(0)


def fake_tick(device=0, blocks=8, max_changes=1024, **kw):
    rng = _rng()
    inc = rng.choice(np.array([32, 32, 32, 64], dtype=np.uint64), size=(blocks, max_changes))
    cyc = (10**9 + np.cumsum(rng.integers(60, 70, size=(blocks, max_changes)), axis=1)).astype(np.uint64)
    info = np.tile([max_changes, 20 * max_changes, 0, 1], (blocks, 1))
    return an.analyse_tick(inc, cyc, info)


def fake_rate(device=0, interval_ns=50_000_000, nvml_samples=3):
    mhz = 1980 + _rng().normal(0, 0.3, SMS)
    ns = np.full(SMS, interval_ns, dtype=np.int64)
    return RateProbe(mhz, (mhz * ns / 1e3).astype(np.int64), ns, np.arange(SMS), (1980,) * nvml_samples, 1980)


def fake_read_cost(device=0, iters=256, reps=16):
    rng = _rng()
    return {"globaltimer": 2 + rng.normal(0, 0.05, reps), "clock64": 1 + rng.normal(0, 0.05, reps),
            "globaltimer+clock64": 3 + rng.normal(0, 0.05, reps), "loop": 0.6 + rng.normal(0, 0.01, reps)}


def fake_stamp_cost(device=0, n=256, reps=16, clock64=True):
    return (9.0 if clock64 else 7.0) + _rng().normal(0, 0.2, reps)


class FakeSkewProbe:
    def __init__(self, device=0):
        self.spec = type("S", (), {"blocks": SMS})()

    def run(self, trials, **kw):
        rng = np.random.default_rng(trials)
        delay = rng.uniform(0, 400, SMS)
        true = np.cumsum(rng.uniform(3000, 7000, trials))[:, None] + delay[None, :] + rng.uniform(0, 150, (trials, SMS))
        c64 = (rng.integers(10**10, 10**12, SMS)[None, :] + np.round(true * 1.98)).astype(np.uint64)
        gt = np.uint64(GT0) + ((true // 32) * 32).astype(np.uint64)
        sm = rng.permutation(SMS)
        an.check_skew(gt, c64, sm, SMS)
        return gt, c64, sm


def fake_chain_run(h, launches=8, pdl=False, config="exclusive", work_ns=20_000, jitter_ns=1_000, device=0):
    lay = ProfileLayout(blocks=SMS, warps=1, cap=4)
    E = {e.name: e.id for e in LAUNCH.events}
    off = np.random.default_rng(1).integers(10**10, 10**12, SMS)
    st, exits = {}, {}

    def rec(ev, t, b):
        return (E[ev], 0, GT0 + int(t // 32 * 32), int(off[b] + round(t * 1.98)), b)

    for L in range(launches):
        last = max(exits[(L - 1, x)] for x in range(SMS)) if L else 0.0
        for b in range(SMS):
            if L == 0:
                land = 1000.0
            elif not pdl:
                land = last + 1500  # stream order: after the whole previous grid
            elif config == "exclusive":
                land = exits[(L - 1, b)] + 400  # when this SM's previous block leaves
            else:
                land = exits[(L - 1, b)] - 4000  # shared SMs: before the previous block leaves
            go = land + 50 if L == 0 else max(land, last + (700 if pdl else 0))
            end = go + work_ns + (b % 8) * jitter_ns
            exits[(L, b)] = end
            st[(L, b, 0)] = [rec("griddep_wait_begin", land, b), rec("griddep_wait_end", go, b),
                             rec("work_begin", go, b), rec("work_end", end, b)]
    return Timeline.build(decode(emulate(lay, st, launches=launches), lay, launches), LAUNCH, strict=True)


class FakeInstrKernel:
    """Computes what instr.cu computes (on the CPU, small) and writes the stamps it would write."""

    def __init__(self, h, variant, per_block, x0=None, coef=None):
        import torch

        self.variant = variant
        self.repeat = bench.INSTR_VARIANTS[variant][1]
        self.nb = h.info.sm_count
        self.n = self.nb * 16
        self.x = torch.randint(-2**31, 2**31 - 1, (self.n,), dtype=torch.int32) if x0 is None else x0.clone()
        self.coef = (torch.randint(-2**31, 2**31 - 1, (8,), dtype=torch.int32) | 1) if coef is None else coef
        cap = an.expected_instr_stamps(bench.INSTR_PHASES, max(self.repeat, 1))
        self.pb = ProfileBuffer(ProfileLayout(blocks=self.nb, warps=1, cap=cap), device="cpu")
        self.out = None

    def before_each(self):
        self.pb.reset()

    def launch(self):
        pass

    def output(self):
        return self.out

    def run_and_check(self):
        import torch

        ref = an.instr_reference(self.x, self.coef.tolist(), bench.INSTR_PHASES, self.nb)
        out = ref.clone()
        if self.variant == "broken":
            out[-1] ^= 1
        self.out = out
        if not torch.equal(out, ref):
            raise CorrectnessError(f"instr kernel ({self.variant}): 1 of {ref.numel()} words differ from the reference")
        if not self.repeat:
            return None
        self.pb.reset()
        E = {e.name: e.id for e in INSTR.events}
        st = {}
        for b in range(self.nb):
            t, recs = 100.0 * b, []
            for p in range(bench.INSTR_PHASES):
                evs = ([("wait_begin", 500), ("wait_end", 0)] if p else []) + [("compute_begin", 4000),
                                                                                ("compute_end", 0)]
                for ev, dt in evs:
                    for r in range(self.repeat):
                        recs.append((E[ev] if r == 0 else E["mark"], p, GT0 + int(t), 0, b))
                    t += dt
            st[(0, b, 0)] = recs
        raw = emulate(self.pb.layout, st, epoch=self.pb.epoch)
        self.pb.tensor.copy_(torch.from_numpy(raw.view(np.int32)))
        return Timeline.build(self.pb.read(), INSTR, strict=True)


def fake_run_case(h, case, policy=None):
    rng = np.random.default_rng(abs(hash(case.name)) % 2**32)
    if case.name.startswith("instr/"):
        p = case.prepare(h)
        t = 80e-6 + p.metrics["stamps_per_block"] * 20e-9 + rng.normal(0, 0.3e-6, 200)
        return Series.from_samples(case.name, t, timer="cuda_event", unit="s", params=case.params, bound=p.bound,
                                   work=p.work, metrics=p.metrics)
    assert case.name.startswith("chain/")
    per = 27e-6 if case.params["pdl"] else 30e-6
    t = case.params["launches"] * per + rng.normal(0, 0.3e-6, 200)
    return Series.from_samples(case.name, t, timer="cuda_event", unit="s", params=case.params,
                               metrics={"launches": case.params["launches"]})


NCU_CASES = {
    "absent": {"measured": False, "why": "ncu is not on PATH"},
    "measured": {"measured": True, "why": "ncu --clock-control none profiled the first probe launch", "rc": 0,
                 "profiled": fake_tick(blocks=4, max_changes=64).to_dict(),
                 "attached_not_profiled": fake_tick(blocks=4, max_changes=64).to_dict()},
}


@pytest.fixture
def fakes(monkeypatch):
    from microbench.compiler import compile_cuda

    for name, fn in (("tick_probe", fake_tick), ("clock_rate_probe", fake_rate), ("read_cost_probe", fake_read_cost),
                     ("stamp_cost_probe", fake_stamp_cost), ("SkewProbe", FakeSkewProbe),
                     ("chain_run", fake_chain_run), ("run_case", fake_run_case), ("InstrKernel", FakeInstrKernel)):
        monkeypatch.setattr(bench, name, fn)
    monkeypatch.setattr(bench, "module", lambda name, device=0, defines=None: compile_cuda(
        bench.Path(bench.__file__).with_name(f"{name}.cu"), arch="sm_90a", defines=defines or {}))
    return monkeypatch


@pytest.mark.parametrize("ncu", sorted(NCU_CASES))
def test_timers_dry_run(fakes, ncu):
    fakes.setattr(bench, "tick_under_ncu", lambda device=0, timeout_s=0: NCU_CASES[ncu])
    res = bench.run_timers(FakeHarness(), quick=True, save=True)
    d = res.derived
    assert d["globaltimer_tick_ns"].value == 32 and d["globaltimer_tick_ns"].spread == (32.0, 32.0)
    assert d["sm_clock_mhz_effective"].value == pytest.approx(1980, abs=1)
    assert ("globaltimer_tick_ns_under_ncu" in d) == (ncu == "measured")
    assert ("globaltimer_tick_ns_after_ncu" in d) == (ncu == "measured")
    assert any("ncu" in n for n in res.notes)
    s = res.series_named("clock64/seconds_per_cycle")
    assert s.fraction_of_bound == pytest.approx(1.0, abs=0.01)
    assert any(load(p).derived.keys() == d.keys() for p in find("clocks.timers"))  # saved and loadable


def test_skew_dry_run(fakes):
    res = bench.run_skew(FakeHarness(), quick=True, save=True)
    d = res.derived
    assert 200 < d["sm_skew_ns"].value < 500 and d["sm_skew_ns"].spread[0] <= d["sm_skew_ns"].value
    assert 0 < d["clock64_calibration_residual_ns"].value < 32
    assert {"sm_skew_calibrated_ns", "clock64_rate_spread_ppm"} <= set(d)
    assert res.series_named("skew/globaltimer_p90_p10").summary.n == 512


def test_launch_dry_run(fakes):
    res = bench.run_launch(FakeHarness(), quick=True, save=True)
    d = res.derived
    assert d["launch_gap_plain_ns"].value == pytest.approx(1500, abs=40)
    assert d["pdl_early_land_ns"].value < 0
    names = {s.name for s in res.series}
    assert "launch/exclusive/pdl/land_after_same_sm_exit" in names and "chain/pdl/shared" in names
    s = res.series_named("launch/exclusive/plain/land_after_last_exit")
    assert s.metrics["calibration"]["key_fields"] == ["sm"] and s.metrics["clock64_calibrated"]["p50"] > 0
    traces = sorted(results_root().glob("clocks/clocks.launch-*.trace.json"))
    assert traces and all(validate_trace(json.loads(p.read_text())) == [] for p in traces)
    assert sorted(results_root().glob("clocks/clocks.launch-*.png"))


def test_instrumentation_dry_run(fakes):
    res = bench.run_instrumentation(FakeHarness(), quick=True, save=True)
    d = res.derived
    assert d["profiler_stamp_cost_s"].value == pytest.approx(20e-9, rel=0.3)
    assert d["profiler_cost_per_launch_s"].value == pytest.approx(14 * 20e-9, abs=0.15e-6)
    assert 0 < d["profiler_cost_fraction"].value < 0.01
    edges = [s for s in res.series if s.name.startswith("timeline/")]
    assert len(edges) == 2 * (4 + 3) and {s.params["edge"] for s in edges} == {"start", "end"}
    assert {s.params["phase"] for s in edges} == {"compute0", "compute1", "compute2", "compute3", "wait1", "wait2",
                                                 "wait3"}
    assert all(s.summary.n == SMS and s.timer == "globaltimer" for s in edges)
    root = results_root()
    tr = sorted(root.glob("clocks/clocks.instrumentation-*.trace.json"))
    assert tr and validate_trace(json.loads(tr[-1].read_text())) == []


def test_broken_variant_is_refused_before_timing(fakes):
    with pytest.raises(CorrectnessError, match="differ from the reference"):
        bench.instr_case("broken").prepare(FakeHarness())


def test_every_clocks_constant_is_derived_and_the_note_renders(fakes):
    from microbench.clocks.note import render

    fakes.setattr(bench, "tick_under_ncu", lambda device=0, timeout_s=0: NCU_CASES["absent"])
    results = {name: fn(FakeHarness(), quick=True, save=True) for name, fn in bench.BENCHMARKS.items()}
    for spec in SPECS:
        if spec.benchmark.startswith("clocks."):
            d = results[spec.benchmark].derived[spec.derived_key]
            assert d.unit == spec.unit and d.rule and d.spread is not None, spec.name
    note = render()
    assert "| %globaltimer tick (no profiler) | 32 ns |" in note and "not measured" in note  # ncu row
