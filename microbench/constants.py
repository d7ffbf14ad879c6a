"""The tuned constants the megakernel build consumes: names, units, defaults and provenance.

This table is the single source of truth for what each overhead class must derive. A
microbenchmark publishes a constant by putting a `Derived` under exactly `derived_key` in the
`Result` of benchmark `benchmark`; `megabench tune` (microbench/tune.py) collects them into the
versioned constants file, and falls back to `default` (loudly) when a class has not reported.
Defaults are conservative: they keep the megakernel correct and safe, not fast.

`feeds_build` marks the constants the megakernel build reads (megakernel/plans.py plan_for,
technique_switches, code_budget): those must come out the same from two runs on two machines
(`python -m microbench.stability`), and the build reads them only from an adopted constants revision
(microbench/adopt.py), never straight from whatever tune last wrote.

RENAMED maps a constant's old name to its new one (an older constants revision still loads:
microbench/adopt.py). The icache levels were named by index (l1, l2) and the rule that found
them paired points 1.6% apart in cycles/instruction; they are named for what they are now.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .results import REPO_ROOT


@dataclass(frozen=True)
class ConstantSpec:
    name: str
    unit: str
    default: float
    benchmark: str  # result that provides it, e.g. "icache.capacity"
    derived_key: str  # key in Result.derived
    doc: str
    integer: bool = False
    feeds_build: bool = False  # the megakernel build reads it (stability test, adoption)


SPECS: tuple[ConstantSpec, ...] = (
    # ---- instruction cache (microbench/icache)
    ConstantSpec("icache_l0_bytes", "B", 16 * 1024, "icache.capacity", "icache_l0_bytes",
                 "code that still issues at the full rate from one warp: the innermost instruction cache (an L0 "
                 "per SM sub-partition), the largest body measured on the 1-warp curve's first plateau", integer=True),
    ConstantSpec("icache_sm_bytes", "B", 128 * 1024, "icache.capacity", "icache_sm_bytes",
                 "the SM's instruction cache (the study's ~128 KB per SM): the largest body measured on the last "
                 "plateau below the L2-served level of the 1-warp curve", integer=True),
    ConstantSpec("launch_prefetch_bytes", "B", 32 * 1024, "icache.prefetch", "launch_prefetch_bytes",
                 "code bytes near the SM right after launch (cold first pass is cheap up to here)", integer=True),
    ConstantSpec("max_code_bytes_per_launch", "B", 96 * 1024, "icache.spliced", "max_code_bytes_per_launch",
                 "recommended ceiling of machine code for one persistent launch/phase: the largest splice whose large "
                 "block keeps its solo speed", integer=True, feeds_build=True),
    # ---- weight ring and L2 (microbench/weights)
    ConstantSpec("read_ceiling_bytes_per_s", "B/s", 3.0e12, "weights.read_ceiling", "read_ceiling_bytes_per_s",
                 "best plain streaming read bandwidth (roofline denominator)"),
    ConstantSpec("ring_stages", "", 4, "weights.ring", "ring_stages",
                 "shared-memory ring depth (stages)", integer=True, feeds_build=True),
    ConstantSpec("ring_stage_bytes", "B", 16 * 1024, "weights.ring", "ring_stage_bytes",
                 "bytes per ring stage (one bulk copy)", integer=True, feeds_build=True),
    ConstantSpec("l2_usable_bytes", "B", 32 * 1024 * 1024, "weights.l2", "l2_usable_bytes",
                 "working set that still reads at the L2 plateau bandwidth: the largest size on the plateau of the "
                 "read bandwidth vs working-set curve (not the near-partition bump of the smallest sizes)",
                 integer=True),
    ConstantSpec("l2_prefetch_budget_bytes", "B", 0, "weights.prefetch", "l2_prefetch_budget_bytes",
                 "bytes worth prefetching into L2 ahead of a phase (0 = don't)", integer=True),
    ConstantSpec("hot_expert_break_even_overlap", "", 1.0, "weights.hot_experts", "hot_expert_break_even_overlap",
                 "fraction of experts two steps must share for the hot-expert L2 bet to pay (1.0 = never bet)"),
    ConstantSpec("evict_first_pays", "", 0, "weights.l2", "evict_first_pays",
                 "1 if evict_first on streamed weights measurably helps reused data", integer=True, feeds_build=True),
    # ---- synchronisation (microbench/sync)
    ConstantSpec("flag_latency_s", "s", 2.0e-6, "sync.flags", "flag_latency_s",
                 "one-way SM-to-SM flag latency (median)"),
    ConstantSpec("poll_backoff_ns", "ns", 0, "sync.flags", "poll_backoff_ns",
                 "nanosleep between polls (0 = spin)", integer=True, feeds_build=True),
    ConstantSpec("sync_stop_cost_s", "s", 5.0e-6, "sync.barriers", "sync_stop_cost_s",
                 "expected cost of one dependency wait (per-producer flags) in a persistent grid"),
    ConstantSpec("sentinel_pays", "", 0, "sync.publish", "sentinel_pays",
                 "1 if sentinel-valued slots beat release-flag publishing for small payloads", integer=True,
                 feeds_build=True),
    ConstantSpec("spin_bound_ns", "ns", 2_000_000_000, "sync.flags", "spin_bound_ns",
                 "watchdog bound: a spin-wait gives up after this long", integer=True, feeds_build=True),
    # ---- clocks (microbench/clocks)
    ConstantSpec("globaltimer_tick_ns", "ns", 1000, "clocks.timers", "globaltimer_tick_ns",
                 "measured %globaltimer resolution", integer=True),
    ConstantSpec("sm_skew_ns", "ns", 1000, "clocks.skew", "sm_skew_ns",
                 "spread of %globaltimer across SMs released by one flag (p90-p10)"),
    ConstantSpec("pdl_pays", "", 0, "clocks.launch", "pdl_pays",
                 "1 if programmatic dependent launch shortens a chain of persistent one-block-per-SM launches",
                 integer=True, feeds_build=True),
    ConstantSpec("profiler_stamp_cost_s", "s", 1.0e-7, "clocks.instrumentation", "profiler_stamp_cost_s",
                 "cost of one in-kernel profiler stamp (lane 0 of each block)"),
)

BY_NAME = {s.name: s for s in SPECS}
FEEDS_BUILD = tuple(s.name for s in SPECS if s.feeds_build)
# old name -> new name (constants revisions written before the rename still load)
RENAMED = {"icache_l1_bytes": "icache_l0_bytes", "icache_l2_bytes": "icache_sm_bytes"}


def constants_dir() -> Path:
    return Path(os.environ.get("MEGABENCH_CONSTANTS_DIR", REPO_ROOT / "reports" / "constants"))


def gpu_slug(gpu: str | None) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the same slug results files use)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu or "cpu").strip("-").lower()
