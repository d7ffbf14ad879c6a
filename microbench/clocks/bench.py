"""Clocks, SM-to-SM skew, launch-to-launch timing and the in-kernel profiler's cost.

- clocks.timers: %globaltimer tick (smallest nonzero increment of back-to-back reads, and the
  whole increment distribution), its update period in %clock64 cycles, the %clock64 rate
  against %globaltimer over a long interval (effective SM MHz, NVML beside it), the issue cost
  of reading each timer and of one profiler stamp, and the tick seen under
  `ncu --clock-control none` (when ncu exists). Derives globaltimer_tick_ns.
- clocks.skew: one stamper block per SM released by one flag write; spread of %globaltimer
  across SMs per trial, and a per-SM clock64 -> globaltimer calibration fitted on even trials,
  judged on odd ones. Derives sm_skew_ns and the calibration residual.
- clocks.launch: chains of a persistent-style kernel (plain and PDL; one block per SM exclusive,
  or two launches sharing an SM): when each block of launch k+1 lands and is released relative
  to launch k's exits (profiler stamps), and the device time per chained launch (harness).
- clocks.instrumentation: a persistent 4-phase memory-bound kernel with per-phase stamps
  compiled out / in / 8x; output bitwise identical; cost per launch and per stamp from device
  time (harness). Derives profiler_stamp_cost_s. Exports the Perfetto trace and a PNG timeline.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..datasheet import hbm_peak
from ..errors import CorrectnessError
from ..harness import Case, Harness, Prepared, full_sweeps, run_case
from ..launch import LaunchSpec, launch
from ..results import Bound, Derived, Env, Result, Series, results_root
from ..sass import count_matching, find_disassembler, sass_by_kernel
from ..stats import Summary, bootstrap_ci, mann_whitney
from ..watchdog import Watchdog
from . import analysis as an
from .calibrate import fit_clock_calibration, quantisation_floor_ns
from .events import INSTR, LAUNCH
from .ncu_tick import tick_under_ncu
from .probes import (CHAIN_CONFIGS, LAUNCH_DEFINES, PROFILE_OFF, SkewProbe, chain_run, chain_smem, clock_rate_probe,
                     module, read_cost_probe, stamp_cost_probe, tick_probe)
from .profiler import ProfileBuffer, ProfileLayout, Timeline, edge_series


def _quick(quick):
    return (not full_sweeps()) if quick is None else quick


def artifact_base(benchmark: str, env: Env) -> Path:
    """Where a benchmark's extra files (trace JSON, PNG) go: beside its results JSON."""
    d = results_root() / benchmark.split(".")[0]
    stamp = env.date.replace("-", "").replace(":", "")
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", env.gpu or "cpu").strip("-").lower()
    return d / f"{benchmark}-{stamp}-{gpu}-{env.git_sha[:7]}"


def warm_up(h: Harness) -> None:
    """Busy every SM for 0.1 s so the SM clock leaves its idle state before anything is timed."""
    clock_rate_probe(h.device_index, interval_ns=100_000_000, nvml_samples=1)


def _pcts(x, ps=(10, 50, 90)) -> dict:
    x = np.asarray(x, dtype=np.float64)
    return {f"p{p}": float(np.percentile(x, p)) for p in ps} if x.size else {}


# ====================================================================================== timers
def run_timers(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    dev = h.device_index
    warm_up(h)
    tick = tick_probe(dev, blocks=8, max_changes=1024)
    rates = [clock_rate_probe(dev, interval_ns=50_000_000 if quick else 200_000_000) for _ in range(3 if quick else 8)]
    mhz = np.concatenate([r.mhz for r in rates])
    mhz_med = float(np.median(mhz))
    costs = read_cost_probe(dev, reps=16 if quick else 64)
    stamp64 = stamp_cost_probe(dev, clock64=True, reps=16 if quick else 64)
    stamp_gt = stamp_cost_probe(dev, clock64=False, reps=16 if quick else 64)
    ncu = tick_under_ncu(dev, timeout_s=30.0 if quick else 120.0)
    after = tick_probe(dev, blocks=8, max_changes=1024) if ncu.get("rc") is not None else None

    sass_info: dict = {"disassembler": find_disassembler() or "none found"}
    if find_disassembler():
        try:
            kern = sass_by_kernel(module("timers", dev, {"MB_PROFILE": 1, "MB_PROF_CLOCK64": 1}).cubin)
            sass_info["read_cost_globaltimer_reads"] = count_matching(kern["clk_read_cost"], r"SR_GLOBALTIMER")
            sass_info["read_cost_clock_reads"] = count_matching(kern["clk_read_cost"], r"SR_CLOCKLO")
            sass_info["stamp_instructions_globaltimer_read"] = [i for i in kern["clk_stamp_cost"]
                                                                if "GLOBALTIMER" in i][:2]
        except Exception as e:  # a broken disassembler must not lose the measurement
            sass_info["error"] = f"{e.__class__.__name__}: {e}"

    ns_per_cycle = 1e3 / mhz_med
    series = [
        Series.from_samples("globaltimer/increment", tick.increments_ns, timer="globaltimer", unit="ns",
                            params={"blocks": tick.blocks, "changes": tick.changes}, metrics=tick.to_dict()),
        Series.from_samples("globaltimer/update_period", tick.period_cycles * ns_per_cycle, timer="clock64", unit="ns",
                            params={"sm_mhz_used": mhz_med},
                            metrics={"note": "cycles between consecutive globaltimer changes at the measured SM clock"}),
        Series.from_samples("clock64/seconds_per_cycle", 1e-6 / mhz, timer="globaltimer", unit="s",
                            params={"interval_ns": int(rates[0].ns.mean()), "runs": len(rates)},
                            bound=Bound("throughput", rates[0].nvml_max_mhz * 1e6, "Hz", "NVML max SM clock")
                            if rates[0].nvml_max_mhz else None, work=1.0,
                            metrics={"effective_mhz": _pcts(mhz, (5, 50, 95)),
                                     "nvml_mhz_during": [list(r.nvml_mhz) for r in rates],
                                     "nvml_max_mhz": rates[0].nvml_max_mhz}),
    ]
    one_slot = Bound("latency", 1.0, "cycles", "one issue slot per read (one CS2R instruction in SASS)")
    for name in ("globaltimer", "clock64", "globaltimer+clock64"):
        series.append(Series.from_samples(f"read_cost/{name}", costs[name], timer="clock64", unit="cycles",
                                          params={"reads": 256 * 32, "unit": "per pair" if "+" in name else "per read"},
                                          bound=one_slot, metrics=sass_info if name == "globaltimer" else {}))
    series.append(Series.from_samples("read_cost/loop_baseline", costs["loop"], timer="clock64", unit="cycles",
                                      params={"note": "cycles per slot of the same loop without reads (subtracted)"}))
    gt_cost = float(np.median(costs["globaltimer"]))
    pair_cost = float(np.median(costs["globaltimer+clock64"]))
    series.append(Series.from_samples("stamp_cost/globaltimer", stamp_gt, timer="clock64", unit="cycles",
                                      params={"stamps": 256, "clock64": False},
                                      bound=Bound("latency", gt_cost, "cycles", "one %globaltimer read (this run)")))
    series.append(Series.from_samples("stamp_cost/globaltimer+clock64", stamp64, timer="clock64", unit="cycles",
                                      params={"stamps": 256, "clock64": True},
                                      bound=Bound("latency", pair_cost, "cycles",
                                                  "one %globaltimer + %clock64 pair read (this run)")))
    notes = [f"ncu: {ncu.get('why')}"]
    for label, key in (("profiled by ncu", "profiled"), ("ncu attached, not profiling", "attached_not_profiled")):
        if isinstance(ncu.get(key), dict):
            notes.append(f"tick {label}: {ncu[key]['tick_ns']} ns (mode {ncu[key]['mode_ns']} ns)")
    derived = {
        "globaltimer_tick_ns": Derived(
            float(tick.tick_ns), "ns",
            "smallest nonzero difference between consecutive distinct %globaltimer values read back to back by "
            f"lane 0 of {tick.blocks} blocks ({tick.changes} changes), no profiler attached; spread: range of the "
            "per-block minima", (float(min(tick.per_block_min_ns)), float(max(tick.per_block_min_ns))),
            ("globaltimer/increment",),
            f"most common increment {tick.mode_ns} ns, gcd {tick.gcd_ns} ns, {tick.reads_per_change:.1f} reads per "
            f"change; " + "; ".join(notes)),
        "globaltimer_update_period_ns": Derived(
            float(np.median(tick.period_cycles)) * ns_per_cycle, "ns",
            "median %clock64 cycles between consecutive globaltimer changes x measured ns per cycle",
            tuple(float(np.percentile(tick.period_cycles, p)) * ns_per_cycle for p in (10, 90)),
            ("globaltimer/update_period",)),
        "sm_clock_mhz_effective": Derived(
            mhz_med, "MHz", "median over SMs and runs of %clock64 cycles / %globaltimer ns over each interval; "
            "spread: 5-95% across SMs and runs",
            (float(np.percentile(mhz, 5)), float(np.percentile(mhz, 95))), ("clock64/seconds_per_cycle",),
            f"NVML SM clock during the runs: {sorted({v for r in rates for v in r.nvml_mhz})} MHz, "
            f"max {rates[0].nvml_max_mhz} MHz"),
        "globaltimer_read_cycles": Derived(gt_cost, "cycles", "median over launches of (loop with 8192 unrolled "
                                           "reads - same loop without) / 8192", bootstrap_ci(costs["globaltimer"]),
                                           ("read_cost/globaltimer",)),
        "clock64_read_cycles": Derived(float(np.median(costs["clock64"])), "cycles", "as globaltimer_read_cycles",
                                       bootstrap_ci(costs["clock64"]), ("read_cost/clock64",)),
        "profiler_stamp_issue_s": Derived(
            float(np.median(stamp_gt)) / (mhz_med * 1e6), "s",
            "median cycles per back-to-back profiler stamp (globaltimer only, records in capacity) minus the same "
            "loop with a null buffer, at the measured SM clock; spread: bootstrap 90% CI",
            tuple(v / (mhz_med * 1e6) for v in bootstrap_ci(stamp_gt)), ("stamp_cost/globaltimer",),
            f"with clock64: {float(np.median(stamp64)):.1f} cycles per stamp; issue cost only (the stores are "
            "asynchronous); the in-kernel cost in a real kernel is clocks.instrumentation's profiler_stamp_cost_s"),
    }
    if isinstance(ncu.get("profiled"), dict):
        p = ncu["profiled"]
        derived["globaltimer_tick_ns_under_ncu"] = Derived(
            float(p["tick_ns"]), "ns", "as globaltimer_tick_ns, for the launch ncu --clock-control none profiled"
            + ("" if ncu.get("measured") else " (ncu reported a problem: see note)"),
            (float(min(p["per_block_min_ns"])), float(max(p["per_block_min_ns"]))), (), ncu.get("why", ""))
        series.append(Series.from_samples("globaltimer/min_increment_under_ncu", p["per_block_min_ns"],
                                          timer="globaltimer", unit="ns", metrics=ncu))
    if after is not None:
        derived["globaltimer_tick_ns_after_ncu"] = Derived(
            float(after.tick_ns), "ns", "as globaltimer_tick_ns, re-measured in this process after the ncu child exited",
            (float(min(after.per_block_min_ns)), float(max(after.per_block_min_ns))), ("globaltimer/increment_after_ncu",))
        series.append(Series.from_samples("globaltimer/increment_after_ncu", after.increments_ns, timer="globaltimer",
                                          unit="ns", metrics=after.to_dict()))
    res = Result("clocks.timers", Env.capture(dev), tuple(series), derived, quick=quick, notes=tuple(notes))
    if save:
        res.save()
    return res


# ====================================================================================== skew
def run_skew(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    dev = h.device_index
    warm_up(h)
    tick = tick_probe(dev, blocks=4, max_changes=256).tick_ns
    mhz = h.info.sm_clock_max_mhz or 2000
    cyc_per_ns = mhz / 1e3
    # release phase uniform over >= 4 ticks, so sub-tick spreads average out over trials
    jitter = int(max(4000, 4 * tick * cyc_per_ns))
    probe = SkewProbe(dev)
    probe.run(16, min_delay_cycles=2000, jitter_cycles=jitter)  # warm-up (module, clocks)
    trials = 512 if quick else 4096
    gt, c64, sm = probe.run(trials, min_delay_cycles=2000, jitter_cycles=jitter)
    st = an.analyse_skew(gt, c64, sm, tick)
    floor = st.quantisation_floor_ns
    late = st.per_sm_lateness_ns
    order = np.argsort(late)
    params = {"trials": trials, "blocks": st.blocks, "jitter_cycles": jitter, "min_delay_cycles": 2000,
              "scope": "gpu", "tick_ns": tick}
    series = [
        Series.from_samples("skew/globaltimer_p90_p10", st.gt_spread_p90_p10, timer="globaltimer", unit="ns",
                            params=params, bound=Bound("latency", float(tick), "ns", "globaltimer tick (this run): "
                                                       "one trial cannot resolve less")),
        Series.from_samples("skew/globaltimer_max_min", st.gt_spread_max_min, timer="globaltimer", unit="ns",
                            params=params),
        Series.from_samples("skew/calibrated_p90_p10", st.calibrated_spread_p90_p10, timer="clock64", unit="ns",
                            params={**params, "trials_used": "odd (held out)"}),
        Series.from_samples("skew/calibration_residual_rms", st.heldout_rms_per_trial, timer="clock64", unit="ns",
                            params={**params, "fit": "even trials", "judged": "odd trials"},
                            bound=Bound("latency", floor, "ns", "quantisation floor tick/sqrt(12)"),
                            metrics={"calibration": st.calibration.summary(),
                                     "abs_residual": _pcts(np.abs(st.heldout_residual_ns), (50, 90, 99))}),
        Series.from_samples("skew/per_sm_lateness", late, timer="clock64", unit="ns", params=params,
                            metrics={"latest_sms": [[int(st.sm[i]), float(late[i])] for i in order[::-1][:8]],
                                     "earliest_sms": [[int(st.sm[i]), float(late[i])] for i in order[:8]]}),
    ]
    cs = st.calibrated_spread_p90_p10
    rates = np.asarray(st.calibration.group_rate_ppm, dtype=np.float64)
    rates = rates[np.isfinite(rates)]
    derived = {
        "sm_skew_ns": Derived(
            st.sm_skew_ns, "ns",
            "mean over trials of the per-trial p90-p10 spread of %globaltimer stamps across one stamper block per SM, "
            "all released by one st.release.gpu flag write and stamping right after their acquire poll sees it "
            "(skew + propagation + poll period); release phases are randomised against the tick, so the mean "
            "resolves spreads below one tick; spread: 90% bootstrap CI over trials",
            st.sm_skew_ci, ("skew/globaltimer_p90_p10",),
            f"tick {tick} ns; per-trial median {float(np.median(st.gt_spread_p90_p10)):.0f} ns; max-min mean "
            f"{float(np.mean(st.gt_spread_max_min)):.0f} ns; calibrated clock64 p90-p10 median {float(np.median(cs)):.0f} ns"),
        "sm_skew_calibrated_ns": Derived(
            float(np.median(cs)), "ns", "median over held-out trials of the p90-p10 spread of the stamps' %clock64 "
            "mapped per SM onto globaltimer (offsets + shared rate fitted on the other trials); spread: 90% "
            "bootstrap CI of the median", bootstrap_ci(cs), ("skew/calibrated_p90_p10",)),
        "clock64_calibration_residual_ns": residual_derived(
            st.heldout_rms_per_trial,
            f"pooled RMS over every held-out stamp {st.residual_rms_ns:.1f} ns; quantisation floor tick/sqrt(12) = "
            f"{floor:.1f} ns; fitted clock {st.calibration.sm_mhz:.1f} MHz; in-sample RMS {st.calibration.rms_ns:.1f} ns"),
    }
    if rates.size:
        def width(r):
            return float(np.percentile(r, 90) - np.percentile(r, 10))

        derived["clock64_rate_spread_ppm"] = Derived(
            width(rates), "ppm",
            "p90-p10 across SMs of each SM's own clock64-vs-globaltimer rate relative to the shared rate; spread: 90% "
            "bootstrap CI of that width over SMs", bootstrap_ci(rates, stat=width), ("skew/calibration_residual_rms",),
            f"p10 {np.percentile(rates, 10):+.0f} ppm, p90 {np.percentile(rates, 90):+.0f} ppm")
    res = Result("clocks.skew", Env.capture(dev), tuple(series), derived, quick=quick)
    if save:
        res.save()
    return res


# ====================================================================================== launch chains
CHAIN_WORK_NS = 20_000
CHAIN_JITTER_NS = 1_000


def chain_case(pdl: bool, config: str, launches: int = 8) -> Case:
    """Device time of a chain of `launches` launches (profiler given a null buffer)."""

    def prepare(h: Harness) -> Prepared:
        import torch  # heavy: torch

        k = module("launch", h.device_index, LAUNCH_DEFINES).kernel("clk_chain")
        smem = chain_smem(h.info, config)
        first = LaunchSpec(grid=h.info.sm_count, block=32, smem=smem)
        rest = LaunchSpec(grid=h.info.sm_count, block=32, smem=smem, pdl=pdl)
        sink = torch.zeros(h.info.sm_count, dtype=torch.int32, device="cuda")
        w, j = np.uint64(CHAIN_WORK_NS), np.uint64(CHAIN_JITTER_NS)

        def go():
            for i in range(launches):
                launch(k, first if i == 0 else rest, w, j, sink, *PROFILE_OFF, persistent=True)
        go()
        torch.cuda.synchronize()
        if int(sink.min()) <= 0:
            raise CorrectnessError(f"chain: some block's busy loop never ran (sink {sink.tolist()[:8]}...)")
        ideal = (CHAIN_WORK_NS + 7 * CHAIN_JITTER_NS) * 1e-9 * launches
        return Prepared(launch=go, bound=Bound("time", ideal, "s", "planned busy work of the slowest block x launches"),
                        metrics={"launches": launches})

    mode = "pdl" if pdl else "plain"
    return Case(f"chain/{mode}/{config}", {"pdl": pdl, "config": config, "launches": launches,
                                            "work_ns": CHAIN_WORK_NS, "jitter_ns": CHAIN_JITTER_NS}, prepare)


def _chain_calibrated(tl: Timeline, floor_ns: float):
    """Chain metrics on the clock64 timeline: per-SM offsets over the whole chain when clock64 runs
    on across launches (in-sample RMS within 2x the quantisation floor), else per (launch, SM)."""
    s = tl.stamps
    cal = fit_clock_calibration(s.sm, s.c64, s.gt, key_fields=("sm",))
    keys = ("sm",)
    if cal.rms_ns > 2 * max(floor_ns, 1.0):
        keys = ("launch", "sm")
    tl2 = Timeline.build(s, LAUNCH, clock="clock64", key_fields=keys, strict=True)
    return an.analyse_chain(tl2), {"key_fields": list(keys), "rms_ns": tl2.calibration.rms_ns,
                                   "per_sm_only_rms_ns": cal.rms_ns}


def residual_derived(heldout_rms_per_trial, note: str = "") -> Derived:
    """clock64_calibration_residual_ns from the per-trial held-out RMS (the series
    skew/calibration_residual_rms holds them: microbench/rederive.py re-derives recorded runs)."""
    x = np.asarray(heldout_rms_per_trial, dtype=np.float64)
    v = float(np.mean(x))
    lo, hi = bootstrap_ci(x, stat=np.mean)
    return Derived(v, "ns", "mean over held-out (odd) trials of each trial's RMS of map_sm(clock64) - globaltimer, "
                   "the map fitted on even trials (per-SM offset, one shared rate); spread: 90% bootstrap CI of that "
                   "mean", (min(lo, v), max(hi, v)), ("skew/calibration_residual_rms",), note)


PDL_RULE = ("pdl_pays = 1 if the chain of 8 persistent launches (one block per SM) with programmatic dependent "
            "launch has its third quartile below the first quartile of the same chain without (cuda_event times); "
            "spread: range of the decision over 200 bootstrap resamples of both chains (the time saved is "
            "pdl_chain_gain)")


def pdl_derived(plain_samples, pdl_samples, inputs=()) -> dict[str, Derived]:
    """pdl_pays and pdl_chain_gain from the two exclusive chains' samples (run_launch; also
    applied to recorded results by microbench/rederive.py)."""
    a = np.asarray(plain_samples, dtype=np.float64)
    b = np.asarray(pdl_samples, dtype=np.float64)

    def pays(x, y) -> float:
        return 1.0 if Summary.of(y).q3 < Summary.of(x).q1 else 0.0

    rng = np.random.default_rng(0)
    dec = [pays(rng.choice(a, a.size), rng.choice(b, b.size)) for _ in range(200)]
    v = pays(a, b)
    gain = 1.0 - float(np.median(b) / np.median(a))
    gains = [1.0 - float(np.median(rng.choice(b, b.size)) / np.median(rng.choice(a, a.size))) for _ in range(200)]
    lo, hi = np.percentile(gains, [5, 95])
    note = f"chain of 8: plain {np.median(a) * 1e6:.1f} us, PDL {np.median(b) * 1e6:.1f} us (medians)"
    return {"pdl_pays": Derived(v, "", PDL_RULE, (min(dec + [v]), max(dec + [v])), tuple(inputs), note),
            "pdl_chain_gain": Derived(gain, "", "1 - median PDL chain time / median plain chain time (exclusive SMs); "
                                      "spread: 5-95% over 200 bootstrap resamples", (float(min(lo, gain)), float(max(hi, gain))),
                                      tuple(inputs), note)}


def run_launch(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    dev = h.device_index
    warm_up(h)
    tick = tick_probe(dev, blocks=4, max_changes=256).tick_ns
    floor = quantisation_floor_ns(tick)
    repeats = 3 if quick else 12
    env = Env.capture(dev)
    base = artifact_base("clocks.launch", env)
    series: list[Series] = []
    med: dict[tuple, float] = {}
    notes = []
    for config in CHAIN_CONFIGS:
        for pdl in (False, True):
            mode = "pdl" if pdl else "plain"
            acc: dict[str, list] = {k: [] for k in an.CHAIN_METRICS}
            cal_acc: dict[str, list] = {k: [] for k in an.CHAIN_METRICS}
            cal_info = None
            for r in range(repeats):
                tl = chain_run(h, launches=8, pdl=pdl, config=config, work_ns=CHAIN_WORK_NS,
                               jitter_ns=CHAIN_JITTER_NS, device=dev)
                for k, v in an.analyse_chain(tl).items():
                    acc[k].append(v)
                cm, cal_info = _chain_calibrated(tl, floor)
                for k, v in cm.items():
                    cal_acc[k].append(v)
                if r == 0 and pdl and save:
                    tl.write_trace(f"{base}-{mode}-{config}.trace.json", by="sm")
                    tl.plot(f"{base}-{mode}-{config}.png", by="sm",
                            title=f"clk_chain x8, {mode}, {config} SMs ({env.gpu}), globaltimer")
                    notes.append(f"trace: {base.name}-{mode}-{config}.trace.json (open in ui.perfetto.dev)")
            for k, desc in an.CHAIN_METRICS.items():
                x = np.concatenate(acc[k])
                if x.size == 0:
                    continue
                xc = np.concatenate(cal_acc[k])
                med[(config, mode, k)] = float(np.median(x))
                series.append(Series.from_samples(
                    f"launch/{config}/{mode}/{k}", x, timer="globaltimer", unit="ns",
                    params={"config": config, "pdl": pdl, "launches": 8, "repeats": repeats, "tick_ns": tick,
                            "work_ns": CHAIN_WORK_NS, "jitter_ns": CHAIN_JITTER_NS},
                    metrics={"what": desc, "clock64_calibrated": _pcts(xc), "calibration": cal_info}))
    chains = {}
    for config in CHAIN_CONFIGS:
        plain = run_case(h, chain_case(False, config))
        series.append(plain)
        pdl_case = chain_case(True, config)
        ps = run_case(h, pdl_case)
        series.append(Series.from_samples(ps.name, ps.samples, timer="cuda_event", unit="s", params=ps.params,
                                          bound=Bound("time", plain.summary.median, "s",
                                                      "the same chain launched without PDL (this run)"),
                                          clocks=ps.clocks, metrics=ps.metrics, warnings=ps.warnings))
        chains[config] = (plain, series[-1])

    def d(config, mode, k, rule, name):
        key = (config, mode, k)
        if key not in med:
            return None
        s = next(x for x in series if x.name == f"launch/{config}/{mode}/{k}")
        return Derived(med[key], "ns", rule, bootstrap_ci(s.samples), (s.name,),
                       f"globaltimer tick {tick} ns; clock64-calibrated median {s.metrics['clock64_calibrated'].get('p50')}")

    derived = {k: v for k, v in {
        "launch_gap_plain_ns": d("exclusive", "plain", "land_after_last_exit",
                                 "median over blocks of launches 2..8 of (block lands - previous launch's last exit), "
                                 "plain launches, one block per SM; spread: bootstrap 90% CI", ""),
        "launch_gap_pdl_ns": d("exclusive", "pdl", "land_after_last_exit",
                               "as launch_gap_plain_ns with programmatic dependent launch", ""),
        "pdl_same_sm_handoff_ns": d("exclusive", "pdl", "land_after_same_sm_exit",
                                    "median (block of k+1 lands - exit of k's block on the same SM), PDL, one block "
                                    "per SM at a time", ""),
        "pdl_early_land_ns": d("shared", "pdl", "land_after_last_exit",
                               "median (block of k+1 lands - k's last exit), PDL, SMs shared by two launches: "
                               "negative = lands before the previous launch has finished", ""),
        "pdl_release_after_last_exit_ns": d("shared", "pdl", "release_after_last_exit",
                                            "median (griddepcontrol.wait returns - previous launch's last exit), "
                                            "PDL, SMs shared", ""),
    }.items() if v is not None}
    if "exclusive" in chains:  # one block per SM at a time: the megakernel's per-layer launches
        plain, ps = chains["exclusive"]
        derived.update(pdl_derived(plain.samples, ps.samples, (plain.name, ps.name)))
    res = Result("clocks.launch", env, tuple(series), derived, quick=quick, notes=tuple(notes))
    if save:
        res.save()
    return res


# ====================================================================================== instrumentation
INSTR_PHASES = 4
INSTR_THREADS = 256
INSTR_VARIANTS = {  # name -> (defines, stamp repeat)
    "off": ({"MB_PROFILE": 0}, 0),
    "stamps_x1": ({"MB_PROFILE": 1}, 1),
    "stamps_x8": ({"MB_PROFILE": 1, "INSTR_STAMP_REPEAT": 8}, 8),
    "broken": ({"MB_PROFILE": 0, "INSTR_BROKEN": 1}, 0),
}
POISON = -0x21524111  # 0xDEADBEEF


def _instr_module(h: Harness, variant: str):
    defs, _ = INSTR_VARIANTS[variant]
    return module("instr", h.device_index, {"INSTR_PHASES": INSTR_PHASES, "INSTR_THREADS": INSTR_THREADS, **defs})


class InstrKernel:
    """One compiled variant of instr.cu with its buffers: fresh random input, poisoned outputs."""

    def __init__(self, h: Harness, variant: str, per_block: int, x0=None, coef=None):
        import torch  # heavy: torch

        if per_block % 4:
            raise ValueError("per_block must be a multiple of 4 (16-byte vectors)")
        self.variant = variant
        self.repeat = INSTR_VARIANTS[variant][1]
        self.k = _instr_module(h, variant).kernel("clk_instr")
        self.nb = h.info.sm_count
        self.per_block = per_block
        self.n = self.nb * per_block
        self.spec = LaunchSpec(grid=self.nb, block=INSTR_THREADS)
        self.x = torch.empty((INSTR_PHASES + 1) * self.n, dtype=torch.int32, device="cuda")
        if x0 is None:
            x0 = torch.randint(-2**31, 2**31 - 1, (self.n,), dtype=torch.int32, device="cuda")
        self.x[: self.n].copy_(x0)
        if coef is None:
            coef = torch.randint(-2**31, 2**31 - 1, (2 * INSTR_PHASES,), dtype=torch.int32, device="cuda") | 1
        self.coef = coef
        self.flags = torch.zeros(self.nb, dtype=torch.int32, device="cuda")
        self.wd = Watchdog(200_000_000)
        cap = max(1, an.expected_instr_stamps(INSTR_PHASES, max(self.repeat, 1)))
        self.pb = ProfileBuffer(ProfileLayout(blocks=self.nb, warps=1, cap=cap))  # also for "off": same host work
        self.events = INSTR
        self.poison()

    def poison(self):
        self.x[self.n:].fill_(POISON)

    def before_each(self):
        self.flags.zero_()
        self.pb.reset()

    def launch(self):
        launch(self.k, self.spec, self.x, np.uint32(self.per_block), self.flags, self.coef, self.wd.ptr,
               np.uint64(self.wd.bound_ns), *self.pb.args(), persistent=True)

    def output(self):
        return self.x[INSTR_PHASES * self.n:]

    def run_and_check(self) -> Timeline | None:
        """One launch on poisoned outputs, checked against the exact torch reference; for
        profiled variants the stamps are decoded and counted too."""
        import torch  # heavy: torch

        self.poison()
        self.before_each()
        self.launch()
        torch.cuda.synchronize()
        self.wd.check(lambda w: f"the phase flag of block {w}", context=f"instr kernel ({self.variant})")
        ref = an.instr_reference(self.x[: self.n], self.coef.cpu().tolist(), INSTR_PHASES, self.nb)
        got = self.output().to(torch.int64) & 0xFFFFFFFF
        if not torch.equal(got, ref):
            bad = (got != ref).nonzero()
            raise CorrectnessError(f"instr kernel ({self.variant}): {bad.numel()} of {ref.numel()} words differ from "
                                   f"the reference, first at word {int(bad[0])}")
        if self.repeat == 0:
            st = self.pb.read(recorded=())  # handed out, but this build must not write it
            if len(st):
                raise CorrectnessError(f"instr kernel ({self.variant}) compiled without the profiler wrote "
                                       f"{len(st)} stamps")
            return None
        tl = Timeline.build(self.pb.read(), self.events, strict=True)
        want = an.expected_instr_stamps(INSTR_PHASES, self.repeat)
        cnt = tl.stamps.counts()[0, :, 0]
        if not np.all(cnt == want):
            raise CorrectnessError(f"instr kernel ({self.variant}): stamps per block {sorted(set(cnt.tolist()))}, "
                                   f"expected {want}")
        per_phase = tl.spans_df().groupby("phase").size().to_dict()
        if per_phase != {"compute": INSTR_PHASES * self.nb, "wait": (INSTR_PHASES - 1) * self.nb}:
            raise CorrectnessError(f"instr kernel ({self.variant}): spans per phase {per_phase}")
        return tl


INSTR_PER_BLOCK = 64 * 1024  # u32 words: 256 KiB per block per phase, ~35 MB per buffer on 132 SMs


def instr_case(variant: str, per_block: int | None = None, bound: Bound | None = None,
               keep: dict | None = None) -> Case:
    """Device time of one launch of the instrumentation kernel. prepare() checks the output
    against the reference twice (fresh random input, poisoned outputs) before timing."""

    def prepare(h: Harness) -> Prepared:
        pb = per_block or INSTR_PER_BLOCK
        kern = InstrKernel(h, variant, pb)
        kern.run_and_check()
        kern.run_and_check()  # the timed runs must keep producing it
        if keep is not None:
            keep[variant] = kern
        work = 2.0 * INSTR_PHASES * kern.n * 4
        b = bound
        if b is None and variant == "off":
            peak = hbm_peak(h.info.name)
            b = Bound("bandwidth", peak, "B/s", "datasheet HBM peak (phase p reads what p-1 wrote: partly "
                      "L2-resident)") if peak else None
        stamps = an.expected_instr_stamps(INSTR_PHASES, kern.repeat) if kern.repeat else 0
        return Prepared(launch=kern.launch, before_each=kern.before_each, bound=b, work=work,
                        metrics={"stamps_per_block": stamps, "bytes_moved": int(work), "blocks": kern.nb})

    return Case(f"instr/{variant}", {"variant": variant, "phases": INSTR_PHASES,
                                     "per_block_words": per_block or INSTR_PER_BLOCK}, prepare)


def check_bitwise_identical(h: Harness, per_block: int = 16 * 1024) -> int:
    """Run the uninstrumented and instrumented builds on the same input: outputs must be equal
    bit for bit. Returns the number of words compared."""
    import torch  # heavy: torch

    off = InstrKernel(h, "off", per_block)
    on = InstrKernel(h, "stamps_x1", per_block, x0=off.x[: off.n].clone(), coef=off.coef.clone())
    off.run_and_check()
    on.run_and_check()
    if not torch.equal(off.output(), on.output()):
        raise CorrectnessError("instrumented and uninstrumented builds disagree on the same input")
    return int(off.n)


def run_instrumentation(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    warm_up(h)
    words = check_bitwise_identical(h)
    keep: dict = {}
    off = run_case(h, instr_case("off"))
    tbound = Bound("time", off.summary.median, "s", "the same kernel compiled without stamps (this run)")
    x1 = run_case(h, instr_case("stamps_x1", bound=tbound, keep=keep))
    x8 = run_case(h, instr_case("stamps_x8", bound=tbound))
    series = [off, x1, x8]
    s1, s8 = x1.metrics["stamps_per_block"], x8.metrics["stamps_per_block"]
    slope, icpt, (lo, hi) = an.fit_cost_per_stamp(np.array([0, s1, s8]), [np.asarray(s.samples) for s in series])
    diff, (dlo, dhi) = an.median_difference_ci(off.samples, x1.samples)
    _, p = mann_whitney(x1.samples, off.samples, "greater")
    significant = lo > 0
    stamp_cost = slope if significant else max(hi, 0.0)
    env = Env.capture(h.device_index)
    base = artifact_base("clocks.instrumentation", env)
    notes = [f"outputs of the MB_PROFILE=0 and =1 builds bitwise identical on {words} words of fresh random input; "
             "every variant also equals the exact torch reference"]
    # the timeline shown is a warm launch, right after the timed series (the checked one ran cold)
    tl = keep.pop("stamps_x1").run_and_check() if "stamps_x1" in keep else None
    keep.clear()
    if tl is not None:
        series += edge_series(tl, label=lambda sp: f"{sp.phase}{sp.arg}",
                              extra_params={"stamps": s1, "blocks": tl.stamps.layout.blocks})
    if tl is not None and save:
        tl.write_trace(f"{base}.trace.json", by="launch")
        tl.plot(f"{base}.png", by="sm", title=f"clk_instr, {INSTR_PHASES} phases, stamps by lane 0 of each block "
                                             f"({env.gpu}), globaltimer")
        summ = tl.phase_summary()
        notes.append(f"trace: {base.name}.trace.json (ui.perfetto.dev); plot: {base.name}.png")
        notes.append("phase durations (ns, p10/p50/p90): " + "; ".join(
            f"{ph} {r.dur_p10:.0f}/{r.dur_p50:.0f}/{r.dur_p90:.0f}" for ph, r in summ.iterrows()))
    derived = {
        "profiler_stamp_cost_s": Derived(
            stamp_cost, "s",
            f"least-squares slope of median device time per launch against stamps per block (0, {s1}, {s8}: "
            "compiled out, per-phase stamps, 8x per-phase stamps; lane 0 of warp 0 of each block); spread: 5-95% "
            "bootstrap of the slope" + ("" if significant else "; the interval includes 0, so the value is its "
                                        "upper end (a conservative bound)"),
            (lo, hi), (off.name, x1.name, x8.name),
            f"slope {slope * 1e9:.2f} ns/stamp, intercept {icpt * 1e6:.2f} us"),
        "profiler_cost_per_launch_s": Derived(
            diff, "s", f"median device time with per-phase stamps ({s1} per block) minus without; spread: 5-95% "
            "bootstrap of the difference of medians", (dlo, dhi), (off.name, x1.name),
            f"Mann-Whitney p (stamped slower) = {p:.3g}; {diff / off.summary.median:.2%} of the uninstrumented "
            f"launch ({off.summary.median * 1e6:.1f} us)"),
        "profiler_cost_fraction": Derived(diff / off.summary.median, "", "profiler_cost_per_launch_s / uninstrumented "
                                          "median", (dlo / off.summary.median, dhi / off.summary.median),
                                          (off.name, x1.name)),
    }
    res = Result("clocks.instrumentation", env, tuple(series), derived, quick=quick, notes=tuple(notes))
    if save:
        res.save()
    return res


BENCHMARKS = {
    "clocks.timers": run_timers,
    "clocks.skew": run_skew,
    "clocks.launch": run_launch,
    "clocks.instrumentation": run_instrumentation,
}
