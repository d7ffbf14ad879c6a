"""Clocks, SM-to-SM skew, launch-to-launch timing and the in-kernel profiler.

profiler.py (ProfileEvents, ProfileLayout, ProfileBuffer, decode, Timeline, trace export, plot)
and calibrate.py are the reusable profiler; the device side is microbench/cuda/mb/profile.cuh.
bench.py holds the benchmarks (clocks.timers, .skew, .launch, .instrumentation).
"""
