"""Every overhead class the commands run and the report lists, in `megabench run`'s order: the
microbenchmark classes (microbench.registry) and `model`, the torch baselines of the decode step
(megakernel.bench_baselines), wired together here because the harness does not know the
megakernel."""
from __future__ import annotations

from collections.abc import Callable

from microbench import registry

MODEL = "model"
NAMES: tuple[str, ...] = (*registry.CLASSES, MODEL)


def benchmarks(classes: list[str] | None = None) -> dict[str, Callable]:
    """{benchmark name: run function} of the requested classes (all by default). An unknown class
    is a ValueError naming it and the known ones."""
    unknown = sorted(set(classes or ()) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown classes {unknown}; known: {list(NAMES)}")
    micro = [c for c in classes if c != MODEL] if classes else None  # None: every class
    out = registry.benchmarks(micro) if micro != [] else {}
    if not classes or MODEL in classes:
        from megakernel.bench_baselines import BENCHMARKS  # heavy: torch

        out.update(BENCHMARKS)
    return out
