"""The clocks note: timer tick, SM skew, calibration residual and profiler cost, read from the
latest saved results (never typed in). `python -m microbench.clocks.note [--root DIR]` prints
markdown; a missing result is said to be missing."""
from __future__ import annotations

from pathlib import Path

from .. import notes

ROWS = (  # (benchmark, derived key, label, scale, unit shown)
    ("clocks.timers", "globaltimer_tick_ns", "%globaltimer tick (no profiler)", 1, "ns"),
    ("clocks.timers", "globaltimer_tick_ns_under_ncu", "%globaltimer tick under ncu --clock-control none", 1, "ns"),
    ("clocks.timers", "globaltimer_tick_ns_after_ncu", "%globaltimer tick after ncu detached", 1, "ns"),
    ("clocks.timers", "globaltimer_update_period_ns", "%globaltimer update period", 1, "ns"),
    ("clocks.timers", "sm_clock_mhz_effective", "effective SM clock (%clock64 / %globaltimer)", 1, "MHz"),
    ("clocks.timers", "globaltimer_read_cycles", "cost of a %globaltimer read", 1, "cycles"),
    ("clocks.timers", "clock64_read_cycles", "cost of a %clock64 read", 1, "cycles"),
    ("clocks.timers", "profiler_stamp_issue_s", "issue cost of one stamp (back to back)", 1e9, "ns"),
    ("clocks.skew", "sm_skew_ns", "SM-to-SM skew, %globaltimer p90-p10", 1, "ns"),
    ("clocks.skew", "sm_skew_calibrated_ns", "SM-to-SM skew on the calibrated %clock64 timeline", 1, "ns"),
    ("clocks.skew", "clock64_calibration_residual_ns", "per-SM %clock64 calibration residual (held out, RMS)", 1, "ns"),
    ("clocks.launch", "launch_gap_plain_ns", "plain launch: block lands after previous launch's last exit", 1e-3, "us"),
    ("clocks.launch", "launch_gap_pdl_ns", "PDL launch: same", 1e-3, "us"),
    ("clocks.launch", "pdl_early_land_ns", "PDL, shared SMs: lands relative to previous last exit", 1e-3, "us"),
    ("clocks.instrumentation", "profiler_cost_per_launch_s", "profiler cost per launch (per-phase stamps)", 1e6, "us"),
    ("clocks.instrumentation", "profiler_cost_fraction", "profiler cost, fraction of the launch", 100, "%"),
    ("clocks.instrumentation", "profiler_stamp_cost_s", "profiler cost per stamp (slope)", 1e9, "ns"),
)


def render(root: Path | None = None) -> str:
    return notes.render("Clocks, skew and in-kernel profiling", ROWS, root)


def main(argv=None) -> int:
    return notes.main(__doc__, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
