"""Kernel launches per step, counted by the profiler (torch.profiler / CUPTI), never estimated.

`count_kernels(fn, steps)` profiles `steps` calls of `fn` (which only enqueues work) and
classifies the device activities: kernels (including those a CUDA graph replays: CUPTI reports
every kernel node it runs), memcpy and memset activities, and on the host side the runtime
calls that launched them (cudaLaunchKernel & co., cudaGraphLaunch).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class KernelCount:
    steps: int
    kernels: int  # device kernel executions
    memcpy: int
    memset: int
    launch_calls: int  # host runtime/driver calls that launch one kernel
    graph_launches: int  # host calls that launch a whole CUDA graph
    top: tuple[tuple[str, int], ...]  # the most frequent kernel names and their counts

    @property
    def kernels_per_step(self) -> float:
        return self.kernels / self.steps

    @property
    def host_calls_per_step(self) -> float:
        return (self.launch_calls + self.graph_launches) / self.steps


def _is_launch_call(name: str) -> bool:
    return "LaunchKernel" in name or "LaunchCooperativeKernel" in name


def classify(events: Iterable, steps: int = 1, top: int = 8) -> KernelCount:
    """Classify profiler events (objects with name() and device_type(), e.g. kineto events)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    kernels: Counter[str] = Counter()
    memcpy = memset = calls = graphs = 0
    for e in events:
        name = e.name()
        if e.device_type() == DeviceType.CUDA:
            if name.startswith("Memcpy"):
                memcpy += 1
            elif name.startswith("Memset"):
                memset += 1
            else:
                kernels[name] += 1
        elif "GraphLaunch" in name:
            graphs += 1
        elif _is_launch_call(name):
            calls += 1
    return KernelCount(steps, sum(kernels.values()), memcpy, memset, calls, graphs,
                       tuple((n[:120], c) for n, c in kernels.most_common(top)))


def count_kernels(fn: Callable[[], object], steps: int = 1) -> KernelCount:
    """Profile `steps` calls of `fn` (device idle before and after) and classify the activities."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kr = getattr(prof.profiler, "kineto_results", None)
    if kr is None:
        raise RuntimeError("torch.profiler returned no kineto results: cannot count kernels")
    return classify(kr.events(), steps)
