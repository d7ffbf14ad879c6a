"""Every derived value lies inside its own spread: in every committed result (as the current
rules derive it from the recorded samples, microbench/rederive.py) and in what Result.save
writes. A spread is the rule's uncertainty about that value; one that excludes it (the committed
poll_load_latency_s: 159.0 ns beside 159.5-160.9 ns) describes another statistic.

This is a check that committed files are well-formed, not of what they measured: Result.save
widens a spread that misses its value, so a new run cannot break it, and a prune only removes
files. The one legacy exception is named by its file, which keeps it under the retention rule."""
from __future__ import annotations

import functools

import pytest

from microbench import rederive
from microbench.results import REPO_ROOT, Derived, Result, find, load, spread_contains

ROOT = REPO_ROOT / "reports" / "results"
# Recorded before its rule was fixed (2026-12), and not re-derivable from the samples a result
# keeps (the per-SM rates are not stored): (result file stem, derived key). Naming the file here
# keeps it under the retention rule, so the entry cannot go stale by a prune; a rule that comes to
# re-derive it makes test_legacy_entries_are_still_needed fail until the entry is removed.
LEGACY = {("clocks.skew-20261129T120552Z-nvidia-h200-3c58cd2", "clock64_rate_spread_ppm")}


@functools.lru_cache(maxsize=1)
def _committed_files():
    return tuple((p, load(p)) for p in find(None, ROOT)) if ROOT.is_dir() else ()


def _committed():
    return tuple(r for _, r in _committed_files())


@functools.lru_cache(maxsize=1)
def _committed_violations():
    return frozenset(_violations(_committed_files()))


def _violations(files):
    """{(file stem, derived key)} of the derived values outside their spread."""
    out = set()
    for p, r in files:
        for k, d in rederive.derived(r).items():
            if not spread_contains(d):
                out.add((p.name.split(".json")[0], k))
    return out


def test_every_committed_derived_value_lies_in_its_spread():
    results = _committed()
    if not results:
        pytest.skip("no committed results in this checkout")
    bad = _committed_violations() - LEGACY
    assert not bad, "value outside its spread: " + "; ".join(f"{f} {k}" for f, k in sorted(bad))


def test_legacy_entries_are_still_needed():
    results = _committed()
    if not results:
        pytest.skip("no committed results in this checkout")
    stale = LEGACY - _committed_violations()
    assert not stale, f"no longer violated (remove from LEGACY): {sorted(stale)}"


def test_the_fixed_rules_contain_their_values_on_the_committed_runs():
    """The four the old rules broke, as re-derived now."""
    results = {r.benchmark: r for r in _committed()}
    if "sync.flags" not in results:
        pytest.skip("no committed sync.flags result")
    for bench, key in (("sync.flags", "poll_load_latency_s"), ("clocks.launch", "pdl_pays"),
                       ("clocks.skew", "clock64_calibration_residual_ns")):
        d = rederive.derived(results[bench])[key]
        assert spread_contains(d), (bench, key, d.value, d.spread)
    p = rederive.derived(results["sync.flags"])["poll_load_latency_s"]
    assert p.value == pytest.approx(results["sync.flags"].series_named("poll_load/acq_gpu").summary.median)


def test_save_widens_a_spread_that_misses_its_value_and_says_so(tmp_path):
    from megabench_synth import env, series

    r = Result("x.y", env(), (series("s"),), {"v": Derived(159.0, "ns", "rule", (159.5, 160.9)),
                                             "ok": Derived(1.0, "", "rule", (1.0, 1.0))})
    got = load(r.save(tmp_path))
    assert got.derived["v"].spread == (159.0, 160.9) and "SPREAD WIDENED" in got.derived["v"].note
    assert got.derived["ok"] == r.derived["ok"]
    assert all(spread_contains(d) for d in got.derived.values())
