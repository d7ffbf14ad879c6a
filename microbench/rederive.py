"""Derived values re-computed from a result's recorded samples with the current rules.

A derivation is a pure function of the samples a run records. When a rule is fixed, applying it
to the samples already recorded is the same derivation the benchmark would make now, with no GPU:
`megabench tune` (microbench/tune.py collect), the stability test (tests/test_stability.py) and the
spreads test (tests/test_spreads.py) read constants through `derived(result)`, so results
recorded before a rule changed and results recorded after it are judged by one rule.

Each entry below is the same function the benchmark itself calls on the series it has just
measured (never a copy of its logic). A result whose series lack what a rule needs (a synthetic
result in a test, an older layout) keeps its recorded values; `rederived_keys` says which keys a
rule re-computed, so provenance can say so.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from .clocks.bench import pdl_derived, residual_derived
from .icache.derive import rederive_capacity, rederive_spliced
from .results import Derived, Result
from .sync.bench import poll_load_latency
from .weights.bench import l2_usable_of, ring_derived


def _icache_capacity(r: Result) -> dict[str, Derived]:
    return rederive_capacity(r)


def _icache_spliced(r: Result) -> dict[str, Derived]:
    return rederive_spliced(r)


def _weights_ring(r: Result) -> dict[str, Derived]:
    ring = [s for s in r.series if s.name.startswith("ring/") and s.bound is not None]
    if not ring:
        raise KeyError("no ring/<config> series with a read-ceiling bound")
    return ring_derived(r.series, ring[0].bound.value, ring[0].bound.source)[0]


def _weights_l2(r: Result) -> dict[str, Derived]:
    bw = [s for s in r.series if s.name.startswith("l2_bandwidth/")]
    if len(bw) < 3:
        raise KeyError("fewer than 3 l2_bandwidth/<size> series")
    u = l2_usable_of(bw, r.env.l2_bytes)
    names = tuple(s.name for s in bw)
    return {"l2_usable_bytes": Derived(u.value, "B", u.rule, u.spread, names,
                                       u.note + f"; datasheet/driver L2 {r.env.l2_bytes} B"),
            "l2_bandwidth_bytes_per_s": Derived(u.plateau, "B/s", "level of the L2 bandwidth plateau: the median of "
                                                "the point medians over the working sets up to the L2 size", None,
                                                names, u.note)}


def _sync_flags(r: Result) -> dict[str, Derived]:
    s = r.series_named("poll_load/acq_gpu")
    old = r.derived.get("poll_load_latency_s")
    return {"poll_load_latency_s": poll_load_latency(s.samples, (s.name,), old.note if old else "")}


def _clocks_launch(r: Result) -> dict[str, Derived]:
    a, b = r.series_named("chain/plain/exclusive"), r.series_named("chain/pdl/exclusive")
    return pdl_derived(a.samples, b.samples, (a.name, b.name))


def _clocks_skew(r: Result) -> dict[str, Derived]:
    old = r.derived.get("clock64_calibration_residual_ns")
    return {"clock64_calibration_residual_ns": residual_derived(r.series_named("skew/calibration_residual_rms").samples,
                                                                old.note if old else "")}


REDERIVERS: Mapping[str, Callable[[Result], dict[str, Derived]]] = {
    "icache.capacity": _icache_capacity,
    "icache.spliced": _icache_spliced,
    "weights.ring": _weights_ring,
    "weights.l2": _weights_l2,
    "sync.flags": _sync_flags,
    "clocks.launch": _clocks_launch,
    "clocks.skew": _clocks_skew,
}


# Benchmarks whose rule re-computes every derived value: the recorded keys it no longer makes
# (the icache levels named by index, icache_l1_bytes / icache_l2_bytes) are dropped, not kept.
REPLACES_ALL = frozenset({"icache.capacity"})


def rederived(r: Result) -> dict[str, Derived]:
    """Only what the current rules re-compute from `r`'s samples ({} when they cannot)."""
    fn = REDERIVERS.get(r.benchmark)
    if fn is None:
        return {}
    try:
        return dict(fn(r))
    except (KeyError, ValueError, TypeError):  # the samples a rule needs are not in this result
        return {}


def derived(r: Result) -> dict[str, Derived]:
    """`r`'s derived values, those the current rules re-compute from its samples replacing the
    recorded ones (keys only the recorded result has are kept, unless the benchmark's rule
    re-computes everything: REPLACES_ALL)."""
    new = rederived(r)
    if new and r.benchmark in REPLACES_ALL:
        return new
    return {**r.derived, **new}


def rederived_keys(r: Result) -> set[str]:
    """Keys whose value or spread the current rules change (or add) relative to the record."""
    new = rederived(r)
    return {k for k, d in new.items() if k not in r.derived or r.derived[k].value != d.value
            or r.derived[k].spread != d.spread or r.derived[k].rule != d.rule}
