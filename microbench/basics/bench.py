"""Copy bandwidth and launch overhead: the harness's reference measurements.

- basics.copy: our 16-byte-vector copy kernel and the driver's D2D memcpy over a size sweep,
  each checked bit-exact on fresh random data before timing. Bound: for memcpy, the datasheet
  HBM rate (labelled as such); for our kernel, the memcpy rate measured at the same size.
  Derived: asymptotic copy bandwidth b and fixed cost a from T = a + V/b (bytes read + written).
- basics.launch: an empty kernel, three ways: host submission rate (host timer), back-to-back
  on the device (events around a batch queued behind the blocking kernel), and as nodes of a
  CUDA graph. Bound for the device figure: the graph-node figure from the same run.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..compiler import compile_cuda
from ..datasheet import hbm_peak
from ..errors import CorrectnessError
from ..harness import Case, Harness, Prepared, full_sweeps, run_case
from ..launch import LaunchSpec, launch
from ..results import Bound, Derived, Env, Result, Series
from ..stats import bootstrap_ci, fit_affine

SRC = Path(__file__).with_name("copy.cu")
MiB = 1 << 20


def copy_sizes(quick: bool) -> list[int]:
    return [64 * MiB, 512 * MiB, 2048 * MiB] if quick else [2 ** k * MiB for k in range(0, 13)]


def _module(h: Harness):
    return compile_cuda(SRC, arch=h.info.arch)


def check_copy(src, dst, what: str) -> None:
    """Bit-exact comparison; names the first wrong 4-byte word."""
    import torch  # heavy: torch

    if not torch.equal(src, dst):
        bad = (src != dst).nonzero()
        first = int(bad[0]) if bad.numel() else -1
        raise CorrectnessError(f"{what}: {bad.numel()} of {src.numel()} words differ, first at word {first}")


def _buffers(nbytes: int):
    import torch  # heavy: torch

    src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.full_like(src, -0x21524111)  # poison: 0xDEADBEEF
    return src, dst


def copy_case(nbytes: int, kernel: str = "mb_copy_v4", bound: Bound | None = None) -> Case:
    def prepare(h: Harness) -> Prepared:
        src, dst = _buffers(nbytes)
        if kernel == "memcpy":
            def go():
                dst.copy_(src)
        else:
            k = _module(h).kernel(kernel)
            spec = LaunchSpec(grid=h.info.sm_count * 4, block=512)
            n16 = np.uint64(nbytes // 16)

            def go():
                launch(k, spec, src, dst, n16)
        go()
        check_copy(src, dst, f"{kernel} of {nbytes} B")
        dst.fill_(-0x21524111)  # poisoned again: the timed runs must keep producing it
        go()
        check_copy(src, dst, f"{kernel} of {nbytes} B (second run)")
        return Prepared(launch=go, bound=bound, work=2.0 * nbytes, metrics={"bytes_moved": 2 * nbytes})

    return Case(f"copy/{kernel}/{nbytes // MiB}MiB", {"bytes": nbytes, "kernel": kernel}, prepare)


def empty_launch_case(batch: int = 200) -> Case:
    def prepare(h: Harness) -> Prepared:
        k = h.empty_kernel()
        spec = LaunchSpec(grid=1, block=32)

        def go():
            launch(k, spec)
        return Prepared(launch=go, batch=batch, metrics={"launches_per_sample": batch})

    return Case("launch/empty/device_back_to_back", {"batch": batch}, prepare)


def _graph_case(nodes: int = 200) -> Case:
    def prepare(h: Harness) -> Prepared:
        import torch  # heavy: torch

        k = h.empty_kernel()
        spec = LaunchSpec(grid=1, block=32)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside capture
            for _ in range(3):
                launch(k, spec)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(nodes):
                launch(k, spec)
        return Prepared(launch=g.replay, metrics={"nodes": nodes})

    return Case("launch/empty/graph", {"nodes": nodes}, prepare)


def host_submit_samples(h: Harness, n: int = 200, reps: int = 15) -> np.ndarray:
    """Host seconds per Python launch() call (device kept busy-free: the queue never fills)."""
    import torch  # heavy: torch

    k = h.empty_kernel()
    spec = LaunchSpec(grid=1, block=32)
    out = []
    for r in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            launch(k, spec)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if r >= 2:
            out.append((t1 - t0) / n)
    return np.asarray(out)


def run_copy(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = (not full_sweeps()) if quick is None else quick
    series: list[Series] = []
    peak = hbm_peak(h.info.name)
    ds_bound = Bound("bandwidth", peak, "B/s", f"datasheet HBM peak for {h.info.name}") if peak else None
    for nbytes in copy_sizes(quick):
        mem = run_case(h, copy_case(nbytes, "memcpy", ds_bound))
        series.append(mem)
        memcpy_rate = 2.0 * nbytes / mem.summary.median
        b = Bound("bandwidth", memcpy_rate, "B/s", f"driver D2D memcpy measured in this run at {nbytes} B")
        series.append(run_case(h, copy_case(nbytes, "mb_copy_v4", b)))
    derived = {}
    for kern in ("memcpy", "mb_copy_v4"):
        ss = [s for s in series if s.params["kernel"] == kern]
        vol = np.array([2.0 * s.params["bytes"] for s in ss])
        med = np.array([s.summary.median for s in ss])
        fit = fit_affine(vol, med)
        # spread: refit on per-size bootstrap medians
        rng = np.random.default_rng(0)
        bs = []
        for _ in range(200):
            t = [np.median(rng.choice(s.samples, size=len(s.samples))) for s in ss]
            bs.append(fit_affine(vol, t).b)
        lo, hi = np.percentile(bs, [5, 95])
        derived[f"{kern}_bandwidth"] = Derived(fit.b, "B/s", "fit T = a + V/b over sizes (V = bytes read+written); "
                                               "spread: 5-95% of 200 bootstrap refits", (float(lo), float(hi)),
                                               tuple(s.name for s in ss), f"fixed cost a = {fit.a * 1e6:.2f} us, "
                                               f"median relative residual {fit.rel_residual:.3f}")
        derived[f"{kern}_fixed_cost"] = Derived(fit.a, "s", "intercept a of the same fit", None,
                                                tuple(s.name for s in ss))
    res = Result("basics.copy", Env.capture(h.device_index), tuple(series), derived, quick=quick)
    if save:
        res.save()
    return res


def run_launch(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = (not full_sweeps()) if quick is None else quick
    graph = run_case(h, _graph_case())
    node_s = graph.summary.median / graph.metrics["nodes"]
    graph_node = Series.from_samples("launch/empty/graph_per_node",
                                     np.asarray(graph.samples) / graph.metrics["nodes"], timer="cuda_event", unit="s",
                                     params={"nodes": graph.metrics["nodes"]}, clocks=graph.clocks)
    dev = run_case(h, empty_launch_case())
    dev = Series.from_samples(dev.name, dev.samples, timer="cuda_event", unit="s", params=dev.params,
                              bound=Bound("latency", node_s, "s", "CUDA-graph node of the same empty kernel, "
                                          "measured in this run"), clocks=dev.clocks, metrics=dev.metrics,
                              warnings=dev.warnings)
    host = Series.from_samples("launch/empty/host_submit", host_submit_samples(h), timer="host", unit="s",
                               params={"launches": 200},
                               bound=Bound("latency", dev.summary.median, "s",
                                           "device back-to-back launch time (the GPU is not the limit)"))
    derived = {
        "launch_overhead_device": Derived(dev.summary.median, "s", "median per-launch device time, "
                                          "200 empty launches queued behind the blocking kernel",
                                          bootstrap_ci(dev.samples), (dev.name,)),
        "graph_node_overhead": Derived(node_s, "s", "median graph replay time / nodes",
                                       tuple(v / graph.metrics["nodes"] for v in bootstrap_ci(graph.samples)),
                                       (graph.name,)),
        "launch_overhead_host": Derived(host.summary.median, "s", "median host seconds per Python launch()",
                                        bootstrap_ci(host.samples), (host.name,)),
    }
    res = Result("basics.launch", Env.capture(h.device_index), (graph, graph_node, dev, host), derived, quick=quick)
    if save:
        res.save()
    return res


BENCHMARKS = {"basics.copy": run_copy, "basics.launch": run_launch}
