"""Which microbenchmarks exist. Each overhead class's bench module exposes BENCHMARKS = {name: run},
where run(harness=None, quick=None, save=True) -> Result. The harness knows only its own classes;
the commands that also run the megakernel's torch baselines (class `model`) add them on the top
floor (reports/classes.py)."""
from __future__ import annotations

from collections.abc import Callable

from .basics import bench as basics
from .clocks import bench as clocks
from .icache import bench as icache
from .sync import bench as sync
from .weights import bench as weights

# class -> its benchmarks, in the order `megabench run` executes them
CLASSES: dict[str, dict[str, Callable]] = {
    "basics": basics.BENCHMARKS,
    "icache": icache.BENCHMARKS,
    "weights": weights.BENCHMARKS,
    "sync": sync.BENCHMARKS,
    "clocks": clocks.BENCHMARKS,
}


def benchmarks(classes: list[str] | None = None) -> dict[str, Callable]:
    """{benchmark name: run function} of the requested classes (all by default). An unknown class
    is a ValueError naming it and the known ones."""
    unknown = sorted(set(classes or ()) - set(CLASSES))
    if unknown:
        raise ValueError(f"unknown classes {unknown}; known: {list(CLASSES)}")
    return {k: v for cls, b in CLASSES.items() if not classes or cls in classes for k, v in b.items()}
