"""The whole icache pipeline on an emulated device (CPU): kernel objects, launches with their
argument lists, correctness checks, record parsing, series, derivations and result files.

The emulator executes what the generated PTX says (it counts the body's FADDs from the PTX text
and gathers the stream's loads from the documented address formula, independently of the
references in bench.py) and times it with a known instruction-cache model. The run_* functions
must recover that model's capacities, prefetch window and spliced-code limit. What this cannot
check: the PTX's semantics on real hardware, the driver, NVML and the real cache; the GPU tests
and the H200 run cover those."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from microbench.cubin import ResourceUsage
from microbench.icache import bench, derive, gen
from microbench.results import Series

KiB = 1024
L0, L1 = 12 * KiB, 128 * KiB  # the model's cache levels (working set <= level -> hit)
WINDOW = 48 * KiB  # the model's launch prefetch window
MHZ = 1980.0
FIXED_CODE = 1664  # bytes of non-body code the fake assembler adds
FADD_B = re.compile(r"add\.rn\.f32 \t%f(\d+), %f\1, %f(3[23]);")


def model_cpi(ws_bytes: float, warps: int) -> float:
    floor = bench.issue_floor_cpi(warps)
    if ws_bytes <= L0:
        return float(floor)
    if ws_bytes <= L1:
        return floor + 0.6
    return floor + 9.0 / np.sqrt(warps)


class Emulator:
    def __init__(self):
        self.rng = np.random.default_rng(11)
        self.last = None  # name of the last kernel launched (instruction-cache state)
        self.l2_flushed = False
        self.last_time = 0.0
        self._counts = {}

    def counts(self, g):
        if g.name not in self._counts:
            c = np.zeros((2, gen.NACC))
            for k, b in FADD_B.findall(g.ptx):
                c[int(b) - 32, int(k)] += 1
            self._counts[g.name] = c
        return self._counts[g.name]

    def launch(self, kernel, spec, *args):
        g = kernel.gen
        warps = spec.block // 32
        nw = spec.grid * warps
        if g.kind == "loop":
            self._loop(g, spec, warps, nw, *args)
        elif g.kind == "probe":
            self._probe(g, spec, warps, nw, *args)
        else:
            self._stream(g, spec, warps, nw, *args)
        self.last = g.name
        if g.kind == "probe":
            self.l2_flushed = False  # its code is in L2 now

    def _acc(self, g, x, out, b0, b1, passes):
        c = self.counts(g)
        out.copy_(x + torch.from_numpy(passes * (c[0] * float(b0) + c[1] * float(b1))).float())

    def _loop(self, g, spec, warps, nw, x, out, rec, iters, b0, b1, never):
        assert isinstance(iters, np.uint32) and isinstance(b0, np.float32) and np.isinf(never)
        passes = int(iters) + 1
        self._acc(g, x, out, b0, b1, passes)
        blocks = [n * 16 for n in g.params["block_sass"]]
        ws = sum(blocks)
        r = rec.view(nw, gen.REC_WORDS)
        noise = 1 + self.rng.normal(0, 0.003, size=(nw, 2))
        for i, (n, nb) in enumerate(zip(g.params["block_sass"], blocks)):
            r[:, gen.R_TIMED0 + i] = torch.from_numpy(int(iters) * n * model_cpi(ws, warps) * noise[:, i]).long()
            r[:, gen.R_FIRST0 + i] = int(n * model_cpi(1e9, warps))
        total = r[:, gen.R_TIMED0:gen.R_TIMED0 + len(blocks)].sum(1) + r[:, gen.R_FIRST0:gen.R_FIRST0 + 2].sum(1)
        r[:, gen.R_TOTAL_CYC] = total
        r[:, gen.R_TOTAL_NS] = (total.double() / MHZ * 1e3).long()
        r[:, gen.R_SMID] = torch.arange(nw) // warps * 2  # SM ids need not be 0..n-1
        r[:, gen.R_PASSES] = passes
        self.last_time = float(total.max()) / (MHZ * 1e6)

    def _probe(self, g, spec, warps, nw, x, out, rec, b0, b1, never):
        self._acc(g, x, out, b0, b1, 1)
        seg = np.asarray(g.params["seg_sass"], dtype=float)
        ends = np.cumsum(seg) * 16
        if self.last == g.name:
            cpi = np.full_like(seg, 1.0)
        else:
            cold = 9.0 if self.l2_flushed else 5.0
            cpi = np.where(ends <= WINDOW, 1.1, cold)
        cyc = seg * cpi
        cyc[0] += 500
        st = 1000 + np.concatenate([[0.0], np.cumsum(cyc)])
        r = rec.view(nw, g.params["rec_words"])
        r[:, :len(st)] = torch.from_numpy(np.round(st * (1 + self.rng.normal(0, 0.002, (nw, 1))))).long()
        r[:, len(st)] = torch.arange(nw) // warps
        self.last_time = float(st[-1]) / (MHZ * 1e6)

    def _stream(self, g, spec, warps, nw, w, out, passes, stride, never):
        assert isinstance(passes, np.uint32) and isinstance(stride, np.uint64)
        S = g.params["stages"]
        acc = torch.zeros(nw, 32, 8, 4)
        p_, g_, s_, j_, l_, c_ = np.ix_(range(int(passes)), range(nw), range(S), range(8), range(32), range(4))
        addr = p_ * int(stride) + g_ * S * 4096 + s_ * 4096 + j_ * 512 + l_ * 16 + c_ * 4
        vals = w[torch.from_numpy(addr // 4)]  # [passes, warps, stages, 8, lanes, 4]
        acc += vals.sum((0, 2)).permute(0, 2, 1, 3)
        out.copy_(acc.reshape(nw * 32, 32))
        code = g.body_bytes
        self.last_time = w.numel() * 4 / (3.8e12 if code <= L1 else 3.3e12)


class FakeModule:
    def __init__(self, g):
        self.g = g

    def kernel(self, name):
        assert name == self.g.name
        return SimpleNamespace(gen=self.g)

    def usage(self, name):
        assert name == self.g.name
        return ResourceUsage(name, 56, 0, 0, 0, 0, 0, self.g.body_bytes + FIXED_CODE)


class FakeHarness:
    device_index = 0

    def __init__(self, emu):
        self.emu = emu
        self.info = SimpleNamespace(name="Emulated", sm_count=4, arch="sm_90a", smem_per_sm=233472,
                                    smem_per_block_optin=232448, reserved_smem_per_block=1024,
                                    sm_clock_max_mhz=int(MHZ), l2_bytes=60 << 20)

    def clocks(self):
        return {"sm_mhz": MHZ, "mem_mhz": 3201, "sm_max_mhz": MHZ}

    def flush_l2(self):
        self.emu.l2_flushed = True

    def series(self, name, launch, *, params=None, bound=None, work=None, batch=1, cold=False, policy=None,
               before_each=None, metrics=None, **_):
        t = []
        for _ in range(8):
            if before_each:
                before_each()
            launch()
            t.append(self.emu.last_time * (1 + self.emu.rng.normal(0, 0.002)))
        return Series.from_samples(name, t, timer="cuda_event", unit="s", params=params, bound=bound, work=work,
                                   metrics=metrics)


@pytest.fixture
def emu(monkeypatch):
    e = Emulator()
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "launch", e.launch)
    monkeypatch.setattr(bench, "compile_many", lambda gens, **kw: {g.name: FakeModule(g) for g in gens})
    monkeypatch.setattr(bench, "STREAM_STAGES_PER_WARP", 384)  # a smaller buffer for the CPU

    def fake_copy_case(nbytes, kernel="mb_copy_v4", bound=None):
        from microbench.harness import Case, Prepared

        def prepare(h):
            def go():
                e.last_time = 2 * nbytes / 4.0e12
            return Prepared(launch=go, work=2.0 * nbytes)
        return Case(f"copy/{kernel}/{nbytes}", {"bytes": nbytes, "kernel": kernel}, prepare)

    import microbench.basics.bench as basics

    monkeypatch.setattr(basics, "copy_case", fake_copy_case)
    monkeypatch.setattr(bench, "copy_case", fake_copy_case)  # icache.bench imports it at its top
    return e


def test_capacity_pipeline_recovers_the_model(emu, tmp_path):
    from microbench.results import load

    res = bench.run_capacity(FakeHarness(emu), quick=True, save=False)
    sw = bench.sweep(True)
    sizes = np.asarray(sw.capacity_sizes)
    d = res.derived
    assert d["icache_l0_bytes"].spread[0] <= L0 < d["icache_l0_bytes"].spread[1]
    assert d["icache_sm_bytes"].spread[0] <= L1 < d["icache_sm_bytes"].spread[1]
    assert d["icache_l0_bytes"].value <= L0  # a measured body size on the level
    assert d["icache_plateau0_cpi_w1"].value == pytest.approx(1.0, rel=0.02)
    assert d["icache_sm_miss_cpi_w1"].value == pytest.approx(9.0 - 0.6, rel=0.05)
    s = res.series_named(f"capacity/w8/{sizes[0]}B")
    assert s.timer == "clock64" and s.unit == "cycles/instr" and s.bound.value == bench.WARP_ISSUE_FLOOR_CPI == 1
    assert s.summary.median == pytest.approx(2.0, rel=0.02) and s.fraction_of_bound == pytest.approx(0.5, rel=0.02)
    assert s.clocks["sm_mhz_inkernel"] == pytest.approx(MHZ, rel=0.01)
    assert s.metrics["distinct_sms"] == 4 and not s.warnings
    # the geometric grid at every warp count, the dense bodies at 1 and 4 warps/SM only
    assert len(res.series) == 3 * len(sizes) + 2 * len(sw.capacity_dense_sizes)
    dense = [x for x in res.series if x.metrics["dense"]]
    assert {x.params["warps_per_sm"] for x in dense} == set(bench.DENSE_WARPS)
    p = res.save(tmp_path)
    assert load(p).derived["icache_sm_bytes"].value == d["icache_sm_bytes"].value
    assert derive.rederive_capacity(load(p))["icache_sm_bytes"] == d["icache_sm_bytes"]


def test_spliced_pipeline_finds_the_code_limit(emu):
    res = bench.run_spliced(FakeHarness(emu), quick=True, save=False)
    d = res.derived
    assert d["spliced_ratio_w12_100K_20K"].value == pytest.approx(1.0, abs=0.02)
    assert d["spliced_ratio_w1_100K_100K"].value > 1.5
    # largest passing spliced kernel: 100 KiB + 20 KiB (120 KiB of body, under the 128 KiB level);
    # the first failure in code-size order is 64 KiB + 64 KiB (body just over 128 KiB)
    n = [gen.instructions_for(b) for b in (100 * KiB, 20 * KiB)]
    want = gen.loop_kernel(n).body_bytes + FIXED_CODE
    assert d["max_code_bytes_per_launch"].value == want
    assert d["max_code_bytes_per_launch"].spread[1] > L1
    s = res.series_named(f"spliced/w12/{100 * KiB}B+{20 * KiB}B")
    assert s.unit == "s" and s.timer == "clock64" and s.metrics["ratio_a"] == pytest.approx(1.0, abs=0.02)
    a = d["spliced_block_a_ratio_w12_100K_20K"]
    assert a.value == pytest.approx(1.0, abs=0.02) and a.spread[0] <= a.value <= a.spread[1]
    assert derive.rederive_spliced(res)["max_code_bytes_per_launch"].value == d["max_code_bytes_per_launch"].value


def test_prefetch_pipeline_finds_the_window(emu):
    res = bench.run_prefetch(FakeHarness(emu), quick=True, save=False)
    ends = np.asarray([s.params["offset_bytes"] for s in res.series if s.name.startswith("prefetch/icache_cold/")])
    want = ends[ends <= WINDOW].max()
    assert res.derived["launch_prefetch_bytes"].value == want
    assert res.derived["launch_prefetch_bytes_l2_cold"].value == want
    assert res.derived["first_pass_ratio_icache_cold_vs_warm"].value > 1.5
    warm = res.series_named("prefetch/warm")
    assert warm.summary.median == pytest.approx(1.0, rel=0.1)  # + the first segment's start cost


def test_code_vs_data_pipeline(emu):
    res = bench.run_code_vs_data(FakeHarness(emu), quick=True, save=False)
    d = res.derived
    assert d["icache_overflow_stream_slowdown"].value == pytest.approx(3.8 / 3.3, rel=0.01)
    assert any("cannot confirm" in n for n in res.notes)  # no capacity result for this GPU yet
    fit = res.series_named("stream/16stages")
    assert fit.bound.value == pytest.approx(4.0e12, rel=0.01) and fit.fraction_of_bound == pytest.approx(0.95, rel=0.01)


def test_broken_kernels_are_caught_by_the_checks(emu):
    from microbench.errors import CorrectnessError

    h = FakeHarness(emu)
    g = gen.loop_kernel([1024], drop_last=1)
    with pytest.raises(CorrectnessError, match="accumulators wrong"):
        bench.GenKernel(h, g, FakeModule(g), 4, 2).run_checked()
    with pytest.raises(CorrectnessError, match="sums wrong"):
        bench.stream_case(16, stages_per_warp=64, passes_override=3).prepare(h)
    bench.stream_case(16, stages_per_warp=64).prepare(h)


def test_note_reads_saved_results(emu, tmp_path):
    from microbench.icache.note import render

    h = FakeHarness(emu)
    assert "no icache.capacity result" in render(tmp_path)
    bench.run_capacity(h, quick=True, save=False).save(tmp_path)
    bench.run_spliced(h, quick=True, save=False).save(tmp_path)
    text = render(tmp_path)
    assert "innermost instruction cache (L0" in text and "not measured (no icache.prefetch result)" in text
    # the emulator models no splice penalty here, so the ratio is 1 within its 0.2% timing noise
    m = re.search(r"\| 100 KiB \+ 20 KiB spliced / alone, 12 warps/SM \| ([0-9.]+) x", text)
    assert m and float(m.group(1)) == pytest.approx(1.0, abs=0.01)


def test_bench_cases_prepare_and_launch(emu):
    """The Cases pytest-benchmark times: prepared (checked) and launchable."""
    h = FakeHarness(emu)
    p = bench.loop_case(gen.loop_kernel([1024]), 4, 8).prepare(h)
    p.launch()
    assert p.bound.kind == "time" and p.bound.value == pytest.approx(9 * 1024 / (MHZ * 1e6))
    for state in bench.PREFETCH_STATES:
        p = bench.probe_case(True, state).prepare(h)
        p.before_each()
        p.launch()
    p = bench.stream_case(16, stages_per_warp=32).prepare(h)
    assert p.work == 32 * 4 * bench.STREAM_WARPS * 4096
