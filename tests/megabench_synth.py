"""Synthetic typed results for CPU tests of tune, report and gate (no GPU, known answers)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from microbench.constants import SPECS
from microbench.results import Bound, Derived, Env, Result, Series

H200 = "NVIDIA H200"
# small copies of committed files, each named with its source in tests/fixtures/README.md: what a
# test reads from them stays put when a new GPU run or a prune changes reports/
FIXTURES = Path(__file__).parent / "fixtures"


def env(gpu=H200, date="2026-11-29T10:00:00Z", sha="abc1234", clock=1980) -> Env:
    return Env(gpu=gpu, gpu_uuid="u", cc="9.0", sm_count=132, l2_bytes=62914560, sm_clock_max_mhz=clock,
               mem_clock_max_mhz=3201, driver="580.159.04", nvrtc="13.0", cuda_core="1.2.0", torch="2.11",
               python="3.12", git_sha=sha, git_dirty=False, host="h", date=date, machine_kind="nvidia-h200")


def series(name, median=1e-5, rel_noise=0.01, n=40, seed=0, unit="s", timer="cuda_event", params=None,
           bound=None, work=None, metrics=None) -> Series:
    rng = np.random.default_rng(seed)
    x = median * (1.0 + rel_noise * rng.standard_normal(n))
    return Series.from_samples(name, x, timer=timer, unit=unit, params=params or {}, bound=bound, work=work,
                               metrics=metrics, clocks={"sm_mhz_before": 1980, "sm_mhz_after": 1980})


def spec_value(spec, bump: float = 0.0):
    """A plausible measured value for a constant, distinct from its default."""
    base = {"B": 48 * 1024, "B/s": 3.3e12, "": 3, "s": 1.5e-6, "ns": 700}.get(spec.unit, 1.0)
    v = base * (1.0 + bump)
    return int(round(v)) if spec.integer else float(v)


def class_results(gpu=H200, date="2026-11-29T10:00:00Z", overrides=None, skip=(), sha="abc1234") -> list[Result]:
    """One Result per benchmark named in SPECS, publishing every derived key it owns.
    overrides: {constant name: value} replaces that constant's derived value."""
    overrides = overrides or {}
    by_bench: dict[str, dict] = {}
    for s in SPECS:
        if s.name in skip:
            continue
        v = overrides.get(s.name, spec_value(s))
        by_bench.setdefault(s.benchmark, {})[s.derived_key] = Derived(
            v, s.unit, f"rule for {s.name}: cheapest configuration within the noise of the best",
            (v * 0.9, v * 1.1), ("sweep/a",), "")
    out = []
    for i, (bench, derived) in enumerate(sorted(by_bench.items())):
        sw = series("sweep/a", 1e-5 * (1 + i), params={"bytes": 1024}, seed=i)
        out.append(Result(bench, env(gpu, date, sha), (sw,), derived, quick=True))
    return out


def save_all(results, root):
    return [r.save(root) for r in results]
