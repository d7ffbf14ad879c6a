"""Which benchmarks exist. Each overhead class's package exposes BENCHMARKS = {name: run}, where
run(harness=None, quick=None, save=True) -> Result. `megabench run` and the report iterate this."""
from __future__ import annotations

import importlib
from collections.abc import Callable

# class -> module holding BENCHMARKS, in the order `megabench run` executes them
CLASSES = {
    "basics": "microbench.basics.bench",
    "icache": "microbench.icache.bench",
    "weights": "microbench.weights.bench",
    "sync": "microbench.sync.bench",
    "clocks": "microbench.clocks.bench",
    "model": "megakernel.bench_baselines",  # the torch baselines of the decode step (model.baselines)
}


def benchmarks(classes: list[str] | None = None) -> dict[str, Callable]:
    """{benchmark name: run function} for the requested classes (all present ones by default)."""
    out = {}
    for cls, mod in CLASSES.items():
        if classes and cls not in classes:
            continue
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(mod):
                continue  # class not built yet
            raise
        out.update(m.BENCHMARKS)
    return out
