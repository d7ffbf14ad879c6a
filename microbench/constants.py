"""The tuned constants the megakernel build consumes: names, units, defaults and provenance.

This table is the single source of truth for what each overhead class must derive. A
microbenchmark publishes a constant by putting a `Derived` under exactly `derived_key` in the
`Result` of benchmark `benchmark`; `megabench tune` (microbench/tune.py) collects them into the
versioned constants file, and falls back to `default` (loudly) when a class has not reported.
Defaults are conservative: they keep the megakernel correct and safe, not fast.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConstantSpec:
    name: str
    unit: str
    default: float
    benchmark: str  # result that provides it, e.g. "icache.capacity"
    derived_key: str  # key in Result.derived
    doc: str
    integer: bool = False


SPECS: tuple[ConstantSpec, ...] = (
    # ---- instruction cache (microbench/icache)
    ConstantSpec("icache_l1_bytes", "B", 32 * 1024, "icache.capacity", "icache_l1_bytes",
                 "capacity of the innermost instruction-cache level that shows as a step", integer=True),
    ConstantSpec("icache_l2_bytes", "B", 128 * 1024, "icache.capacity", "icache_l2_bytes",
                 "capacity of the next level (the study's ~128 KB per SM)", integer=True),
    ConstantSpec("launch_prefetch_bytes", "B", 32 * 1024, "icache.prefetch", "launch_prefetch_bytes",
                 "code bytes near the SM right after launch (cold first pass is cheap up to here)", integer=True),
    ConstantSpec("max_code_bytes_per_launch", "B", 96 * 1024, "icache.spliced", "max_code_bytes_per_launch",
                 "recommended ceiling of machine code for one persistent launch/phase", integer=True),
    # ---- weight ring and L2 (microbench/weights)
    ConstantSpec("read_ceiling_bytes_per_s", "B/s", 3.0e12, "weights.read_ceiling", "read_ceiling_bytes_per_s",
                 "best plain streaming read bandwidth (roofline denominator)"),
    ConstantSpec("ring_stages", "", 4, "weights.ring", "ring_stages",
                 "shared-memory ring depth (stages)", integer=True),
    ConstantSpec("ring_stage_bytes", "B", 16 * 1024, "weights.ring", "ring_stage_bytes",
                 "bytes per ring stage (one bulk copy)", integer=True),
    ConstantSpec("l2_usable_bytes", "B", 32 * 1024 * 1024, "weights.l2", "l2_usable_bytes",
                 "working set that still hits L2 at full L2 bandwidth", integer=True),
    ConstantSpec("l2_prefetch_budget_bytes", "B", 0, "weights.prefetch", "l2_prefetch_budget_bytes",
                 "bytes worth prefetching into L2 ahead of a phase (0 = don't)", integer=True),
    ConstantSpec("hot_expert_break_even_overlap", "", 1.0, "weights.hot_experts", "hot_expert_break_even_overlap",
                 "fraction of experts two steps must share for the hot-expert L2 bet to pay (1.0 = never bet)"),
    ConstantSpec("evict_first_pays", "", 0, "weights.l2", "evict_first_pays",
                 "1 if evict_first on streamed weights measurably helps reused data", integer=True),
    # ---- synchronisation (microbench/sync)
    ConstantSpec("flag_latency_s", "s", 2.0e-6, "sync.flags", "flag_latency_s",
                 "one-way SM-to-SM flag latency (median)"),
    ConstantSpec("poll_backoff_ns", "ns", 0, "sync.flags", "poll_backoff_ns",
                 "nanosleep between polls (0 = spin)", integer=True),
    ConstantSpec("sync_stop_cost_s", "s", 5.0e-6, "sync.barriers", "sync_stop_cost_s",
                 "expected cost of one dependency wait (per-producer flags) in a persistent grid"),
    ConstantSpec("sentinel_pays", "", 0, "sync.publish", "sentinel_pays",
                 "1 if sentinel-valued slots beat release-flag publishing for small payloads", integer=True),
    ConstantSpec("spin_bound_ns", "ns", 2_000_000_000, "sync.flags", "spin_bound_ns",
                 "watchdog bound: a spin-wait gives up after this long", integer=True),
    # ---- clocks (microbench/clocks)
    ConstantSpec("globaltimer_tick_ns", "ns", 1000, "clocks.timers", "globaltimer_tick_ns",
                 "measured %globaltimer resolution", integer=True),
    ConstantSpec("sm_skew_ns", "ns", 1000, "clocks.skew", "sm_skew_ns",
                 "spread of %globaltimer across SMs released by one flag (p90-p10)"),
    ConstantSpec("pdl_pays", "", 0, "clocks.launch", "pdl_pays",
                 "1 if programmatic dependent launch shortens a chain of persistent one-block-per-SM launches",
                 integer=True),
    ConstantSpec("profiler_stamp_cost_s", "s", 1.0e-7, "clocks.instrumentation", "profiler_stamp_cost_s",
                 "cost of one in-kernel profiler stamp (lane 0 of each block)"),
)

BY_NAME = {s.name: s for s in SPECS}
